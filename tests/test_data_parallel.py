"""Data parallelism: numerical proof, composition, text form, simulation, symmetry, errors."""

import dataclasses
import functools

import numpy as np
import pytest

from distir_jax import models
from distir_jax.executor.reference import reference_simulate
from distir_jax.executor.sequential import execute
from distir_jax.ir import Topology
from distir_jax.ir.parser import parse_function
from distir_jax.ir.printer import print_function
from distir_jax.lower import lower
from distir_jax.models import MLPConfig, TransformerConfig
from distir_jax.testing.inputs import random_inputs
from distir_jax.transforms import Distributed, Recipe, data_parallel

MLP = MLPConfig(num_layers=4, hidden=8, dtype="f64")
GPT = TransformerConfig(num_layers=2, hidden=8, num_heads=2, vocab_size=11, seq_len=4, dtype="f64")
# ZeRO splits every weight along dim 0, the [V, H] token table included.
GPT_ZERO = dataclasses.replace(GPT, vocab_size=12)
CONFIGS = {"mlp": MLP, "gpt": GPT, "gpt_zero": GPT_ZERO}
BATCH = 8
RTOL = 1e-9

VARIANTS = {
    "plain": {},
    "overlap": dict(overlap=True),
    "buckets": dict(bucket_bytes=1500),
    "overlap_buckets": dict(overlap=True, bucket_bytes=1500),
    "zero": dict(zero=True),
    "zero_overlap": dict(zero=True, overlap=True),
}


@functools.cache
def case(model: str, optimizer: str):
    """``(program, inputs, outputs)`` of one training step, run by the sequential executor."""
    config = CONFIGS[model]
    fn = models.build_training_step(config, BATCH, optimizer=optimizer, lr=0.1)
    inputs = random_inputs(fn)
    return fn, inputs, execute(fn, inputs)


def rebuilt_outputs(dist: Distributed, inputs):
    return dist.gather_outputs(execute(dist.function, dist.shard_inputs(inputs)), rtol=RTOL)


def assert_same_outputs(got, expected):
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=1e-12, err_msg=name)


def collectives(fn, op_type="AllReduce"):
    return [op for op in fn.ops if op.op_type == op_type]


# --------------------------------------------------------------------------- #
# Numerical proof.


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_data_parallel_computes_the_original_step(model, optimizer, degree, variant):
    kwargs = VARIANTS[variant]
    fn, inputs, expected = case("gpt_zero" if model == "gpt" and "zero" in variant else model, optimizer)
    dist = data_parallel(fn, degree, **kwargs)
    assert dist.function.devices == tuple(range(degree))
    assert_same_outputs(rebuilt_outputs(dist, inputs), expected)


@pytest.mark.parametrize(
    "inner, outer",
    [
        ({}, {}),
        (dict(overlap=True, bucket_bytes=1500), {}),
        ({}, dict(zero=True)),
        (dict(zero=True), {}),
        (dict(zero=True), dict(zero=True, overlap=True)),
    ],
    ids=["plain", "inner_buckets", "outer_zero", "inner_zero", "both_zero"],
)
@pytest.mark.parametrize("model", ["mlp", "gpt_zero"])
def test_nested_data_parallel_equals_one_transform(model, inner, outer):
    fn, inputs, expected = case(model, "adam")
    nested = data_parallel(data_parallel(fn, 2, **inner), 2, **outer)
    single = data_parallel(fn, 4)
    assert nested.function.devices == single.function.devices == (0, 1, 2, 3)
    assert_same_outputs(rebuilt_outputs(nested, inputs), rebuilt_outputs(single, inputs))
    assert_same_outputs(rebuilt_outputs(nested, inputs), expected)


def test_degree_one_returns_the_program_unchanged():
    fn, _, _ = case("mlp", "sgd")
    dist = data_parallel(fn, 1, overlap=True, zero=True)
    assert dist.function is fn
    assert all(sl.splits == () for sl in dist.inputs.values())


def test_maps_split_data_replicate_weights_and_sum_losses():
    fn, _, _ = case("mlp", "adam")
    dist = data_parallel(fn, 2)
    assert dist.inputs["x.dp1"].source == "x" and dist.inputs["x.dp1"].splits == ((0, 1, 2),)
    assert dist.inputs["l1.w.dp1"].splits == ()
    assert dist.outputs["loss"] == Recipe.combine("sum", [Recipe.leaf("loss.dp0"), Recipe.leaf("loss.dp1")])
    assert dist.outputs["l1.w.new"].kind == "replica"
    assert dist.outputs["l1.w.m.new"].kind == "replica"
    losses = [op for op in dist.function.ops if op.op_type in ("MSELoss", "MSELossGrad")]
    assert {op.attr("shards") for op in losses} == {2}
    zero = data_parallel(fn, 2, zero=True)
    assert zero.outputs["l1.w.m.new"].kind == "concat"
    assert zero.inputs["l1.w.m.dp1"].splits == ((0, 1, 2),)
    # The shard each replica updates is a view of its weight, gathered back in place.
    assert "l1.w.dp1.master" not in zero.inputs
    producer = {v.name: op for op in zero.function.ops for v in op.outputs}
    shard = producer["l1.w.dp1.master"]
    assert shard.op_type == "Shard" and shard.inputs[0].name == "l1.w.dp1"
    assert (shard.attr("axis"), shard.attr("parts"), shard.attr("index")) == (0, 2, 1)
    gather = producer["l1.w.new.dp1"]
    assert gather.op_type == "AllGather" and gather.attr("inplace")


def test_zero_weight_read_only_by_its_update_is_an_input_shard():
    """A weight nothing but its update reads has no full copy: ZeRO's shard of it is an
    input, padded where the degree does not divide its rows, and the gathered weight a
    new buffer (no in-place gather: there is no weight buffer to write into)."""
    from distir_jax.executor.reference import reference_peak_memory
    from distir_jax.ir import FunctionBuilder

    b = FunctionBuilder("update_only")
    x = b.input("x", (4, 3, 2), dtype="f64")  # data: split along axis 0
    w = b.input("l0.w", (3, 2), dtype="f64")  # 3 rows over 2 replicas: padded shards
    grad = b.add("ReduceSum", x, axes=(0,), layer=0, phase="bwd")
    fn = b.build(b.add("SGD", w, grad, lr=0.5, weight="l0.w", layer=0, phase="opt"))
    rng = np.random.default_rng(0)
    inputs = {"x": rng.normal(size=(4, 3, 2)), "l0.w": rng.normal(size=(3, 2))}
    dist = data_parallel(fn, 2, zero=True)
    assert_same_outputs(rebuilt_outputs(dist, inputs), execute(fn, inputs))
    assert dist.inputs["l0.w.dp1.master"].splits == ((0, 1, 2),)
    assert "l0.w.dp1" not in dist.inputs and not collectives(dist.function, "Shard")
    (gather,) = collectives(dist.function, "AllGather")
    assert not gather.attr("inplace") and gather.attr("size") == 3
    # Each device: x's half (96 bytes) and the 2-row shard (32) resident; the half-sum
    # (48, reduce-scattered in place) lives until the update, then the gathered weight
    # (48) is allocated: either is the peak.
    assert reference_peak_memory(dist.function) == {0: 96 + 32 + 48, 1: 96 + 32 + 48}


@pytest.mark.parametrize("config", [MLP, GPT], ids=["mlp", "gpt"])
def test_inference_outputs_are_concatenated_along_the_batch(config):
    fn = models.build_inference(config, BATCH)
    inputs = random_inputs(fn)
    dist = data_parallel(fn, 4)
    (output,) = fn.outputs
    assert dist.outputs[output.name].kind == "concat"
    assert_same_outputs(rebuilt_outputs(dist, inputs), execute(fn, inputs))


def test_size_variant_batches_are_split_and_lower():
    fn = models.build_training_step(MLPConfig(2, 8), np.array([8, 16]), optimizer="sgd")
    dist = data_parallel(fn, 4)
    (x,) = [v for v in dist.function.inputs if v.name == "x.dp3"]
    assert list(x.type.shape[0]) == [2, 4]
    program = lower(dist.function, Topology.uniform(4))
    assert program.flops.shape[0] == 2  # one row of features per batch size
    with pytest.raises(ValueError, match=r"degree=4.*batch size.*%x.*\{8,6\}"):
        data_parallel(models.build_training_step(MLPConfig(2, 8), np.array([8, 6])), 4)


# --------------------------------------------------------------------------- #
# Structure of the gradient communication.


def test_without_overlap_all_reductions_follow_the_backward_pass():
    fn, _, _ = case("gpt", "sgd")
    ops = data_parallel(fn, 2).function.ops
    reductions = [i for i, op in enumerate(ops) if op.op_type == "AllReduce"]
    last_backward = max(
        i for i, op in enumerate(ops) if op.attr("phase") == "bwd" and op.op_type != "AllReduce"
    )
    first_update = min(i for i, op in enumerate(ops) if op.attr("phase") == "opt")
    assert len(reductions) == len(models.weight_names(fn))
    assert last_backward < min(reductions) and max(reductions) < first_update
    assert all(ops[i].stream == 0 and len(ops[i].inputs) == 2 for i in reductions)


def test_overlap_issues_each_reduction_on_stream_1_right_after_its_gradient():
    fn, _, _ = case("gpt", "sgd")
    new = data_parallel(fn, 2, overlap=True).function
    producer = new.producers()
    for i, op in enumerate(new.ops):
        if op.op_type == "AllReduce":
            assert op.stream == 1 and op.attr("phase") == "bwd"
            ready = max(producer[v.name] for v in op.inputs)
            # Only other reductions (of the same op's other gradients) come in between.
            assert all(new.ops[j].op_type == "AllReduce" for j in range(ready + 1, i))
    compute_streams = {op.stream for op in new.ops if op.op_type != "AllReduce"}
    assert compute_streams == {0}


def test_buckets_share_reductions_and_respect_the_cap():
    fn, _, _ = case("mlp", "sgd")  # four [8, 8] f64 gradients of 512 bytes
    plain = collectives(data_parallel(fn, 2, overlap=True).function)
    two = collectives(data_parallel(fn, 2, overlap=True, bucket_bytes=1024).function)
    one = collectives(data_parallel(fn, 2, overlap=True, bucket_bytes=1 << 20).function)
    assert (len(plain), len(two), len(one)) == (4, 2, 1)
    assert all(int(op.inputs[0].type.num_bytes) <= 1024 for op in two)


def test_zero_scatters_gradients_and_gathers_weights():
    fn, _, _ = case("gpt_zero", "adam")
    new = data_parallel(fn, 4, zero=True).function
    weights = models.weight_names(fn)
    assert len(collectives(new, "ReduceScatter")) == len(collectives(new, "AllGather")) == len(weights)
    assert not collectives(new, "AllReduce")
    adam = [op for op in new.ops if op.op_type == "Adam" and op.attr("weight") == "l0.embed.tokens"]
    assert [tuple(op.inputs[0].type.shape) for op in adam] == [(3, 8)] * 4


# --------------------------------------------------------------------------- #
# Text form, lowering and simulation.


@pytest.mark.parametrize("variant", list(VARIANTS) + ["representative"])
def test_programs_print_parse_lower_and_simulate(variant):
    fn, _, _ = case("gpt_zero", "adam")
    kwargs = dict(VARIANTS.get(variant, {}), representative_only=variant == "representative")
    new = data_parallel(fn, 2, **kwargs).function
    text = print_function(new)
    assert print_function(parse_function(text)) == text
    topology = Topology.uniform(2)
    assert lower(new, topology).num_ops == len(new.ops)
    assert reference_simulate(new, topology).step_time > 0


def _free_communication(n):
    return Topology.uniform(n, link_bandwidth=1e30, link_latency=0.0, launch_overhead=0.0)


@pytest.mark.parametrize("degree", [2, 4])
def test_free_communication_divides_compute_time_by_the_degree(degree):
    # Compute-bound: matmul flops grow with the batch, the update does not.
    fn = models.build_training_step(MLPConfig(num_layers=4, hidden=256), 4096, optimizer="sgd")
    single = reference_simulate(fn, _free_communication(1)).busy_time[(0, 0)]
    dist = reference_simulate(data_parallel(fn, degree).function, _free_communication(degree))
    assert single / dist.busy_time[(0, 0)] == pytest.approx(degree, rel=0.1)


@pytest.mark.parametrize("bucket_bytes", [None, 1 << 19])
@pytest.mark.parametrize("degree", [2, 4])
def test_overlap_is_never_slower_when_communication_costs(degree, bucket_bytes):
    fn = models.build_training_step(MLPConfig(num_layers=4, hidden=256), 512, optimizer="adam")
    topology = Topology.uniform(degree, link_latency=1e-5)
    serial = reference_simulate(data_parallel(fn, degree, bucket_bytes=bucket_bytes).function, topology)
    overlapped = data_parallel(fn, degree, overlap=True, bucket_bytes=bucket_bytes).function
    assert reference_simulate(overlapped, topology).step_time <= serial.step_time


# --------------------------------------------------------------------------- #
# Symmetry reduction.


@pytest.mark.parametrize("variant", ["plain", "overlap", "overlap_buckets", "zero", "zero_overlap"])
@pytest.mark.parametrize("degree", [2, 4])
def test_representative_replica_simulates_like_the_full_program(degree, variant):
    fn = models.build_training_step(GPT_ZERO, BATCH, optimizer="adam")
    topology = Topology.uniform(degree, link_latency=1e-6)
    full = reference_simulate(data_parallel(fn, degree, **VARIANTS[variant]).function, topology)
    reduced = data_parallel(fn, degree, representative_only=True, **VARIANTS[variant]).function
    assert reduced.devices == (0,)
    one = reference_simulate(reduced, topology)
    assert one.step_time == pytest.approx(full.step_time, rel=1e-12)
    assert one.peak_memory[0] == pytest.approx(full.peak_memory[0], rel=1e-12)


def test_representative_collectives_name_their_full_group():
    fn, _, _ = case("mlp", "sgd")
    dist = data_parallel(data_parallel(fn, 2), 4, representative_only=True)
    outer = [op for op in collectives(dist.function) if op.attr("group") is not None]
    assert outer and all(op.attr("group") in ((0, 2, 4, 6), (1, 3, 5, 7)) for op in outer)
    assert dist.function.devices == (0, 1)
    assert dist.outputs["loss"].kind == "sum"  # the inner replicas' sum of outer replica 0's leaves
    assert all(leaf.endswith(".dp0") for leaf in dist.outputs["loss"].leaves())


# --------------------------------------------------------------------------- #
# Bad input.


@pytest.mark.parametrize("degree", [0, -2, 1.5, True, "2"])
def test_bad_degree(degree):
    fn, _, _ = case("mlp", "sgd")
    with pytest.raises(ValueError, match=r"degree must be an int >= 1, got degree="):
        data_parallel(fn, degree)


def test_batch_not_divisible():
    fn, _, _ = case("mlp", "sgd")
    with pytest.raises(ValueError, match=r"degree=3 must divide the batch size .* %x, which is 8"):
        data_parallel(fn, 3)


def test_zero_refuses_a_scalar_weight():
    from distir_jax.transforms.data_parallel import zero_shard_problem

    fn, _, _ = case("gpt", "adam")
    scalar = fn.inputs[0].type.with_shape(())
    assert "is a scalar" in zero_shard_problem("w", scalar, 2)
    assert zero_shard_problem("w", scalar.with_shape((11, 8)), 2) == ""  # padded instead


# --------------------------------------------------------------------------- #
# ZeRO on weights whose rows the degree does not divide: padded shards.


@pytest.mark.parametrize("variant", ["zero", "zero_overlap"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model, degree", [("gpt", 2), ("gpt", 3), ("mlp", 3), ("gpt", 6)])
def test_zero_pads_the_shards_of_weights_the_degree_does_not_divide(model, degree, optimizer, variant):
    # GPT's token table has 11 rows (padded to 12 for 2, 3 and 6 replicas); the MLP's
    # 8-wide layers have 8 rows (9 for 3 replicas).
    fn = models.build_training_step(CONFIGS[model], 12, optimizer=optimizer, lr=0.1)
    inputs = random_inputs(fn)
    dist = data_parallel(fn, degree, **VARIANTS[variant])
    new = dist.function
    padded = [op for op in collectives(new, "ReduceScatter") if op.attr("pad")]
    trimmed = [op for op in collectives(new, "AllGather") if op.attr("size") is not None]
    assert padded and len(trimmed) == len(padded)  # one collective over the replicas each
    if model == "gpt":
        tokens = [
            op
            for op in new.ops
            if op.op_type == {"sgd": "SGD", "adam": "Adam"}[optimizer]
            and op.attr("weight") == "l0.embed.tokens"
        ]
        assert [tuple(op.inputs[0].type.shape) for op in tokens] == [(-(-11 // degree), 8)] * degree
    # The padded rows' gradient, state and update stay zero: the original step, rebuilt.
    assert_same_outputs(rebuilt_outputs(dist, inputs), execute(fn, inputs))
    text = print_function(new)
    assert print_function(parse_function(text)) == text


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_zero_representative_replica_simulates_like_the_full_program(overlap):
    fn = models.build_training_step(GPT, 12, optimizer="adam")
    topology = Topology.uniform(3, link_latency=1e-6)
    full = reference_simulate(data_parallel(fn, 3, zero=True, overlap=overlap).function, topology)
    one = reference_simulate(
        data_parallel(fn, 3, zero=True, overlap=overlap, representative_only=True).function, topology
    )
    assert one.step_time == pytest.approx(full.step_time, rel=1e-12)
    assert one.peak_memory[0] == pytest.approx(full.peak_memory[0], rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bucket_bytes=0), r"bucket_bytes must be a number > 0 or None, got bucket_bytes=0"),
        (dict(bucket_bytes="1MB"), r"bucket_bytes must be a number > 0"),
        (dict(bucket_bytes=1024, zero=True), r"bucket_bytes=1024 with zero=True is not supported"),
    ],
)
def test_bad_options(kwargs, message):
    fn, _, _ = case("mlp", "sgd")
    with pytest.raises(ValueError, match=message):
        data_parallel(fn, 2, **kwargs)
