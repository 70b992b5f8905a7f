"""ParallelConfig validation and the parallelize pipeline (tensor -> recompute -> pipeline -> data)."""

import dataclasses
import functools
import re

import numpy as np
import pytest

import distir_jax.transforms as transforms
from distir_jax import models
from distir_jax.executor.reference import reference_simulate
from distir_jax.executor.sequential import execute
from distir_jax.ir import Topology
from distir_jax.models import MLPConfig, TransformerConfig
from distir_jax.transforms import ParallelConfig, data_parallel, parallelize
from distir_jax.transforms.parallelize import model_shape

MLP = MLPConfig(num_layers=4, hidden=8, dtype="f64")
GPT = TransformerConfig(num_layers=2, hidden=8, num_heads=2, vocab_size=12, seq_len=4, dtype="f64")
# bf16 models in each training precision (by default "mixed": f32 master copies,
# moments and gradient sums): the same programs' numbers in the sequential
# executor, which computes in float64 whatever the dtype.
CONFIGS = {
    "mlp": MLP,
    "gpt": GPT,
    "mlp-bf16": dataclasses.replace(MLP, dtype="bf16"),
    "gpt-bf16": dataclasses.replace(GPT, dtype="bf16"),
    "mlp-bf16-half-grads": dataclasses.replace(MLP, dtype="bf16", training_precision="mixed-half-grads"),
    "gpt-bf16-half": dataclasses.replace(GPT, dtype="bf16", training_precision="half"),
    # Grouped-query attention: 4 query heads share 2 key / value heads.
    "gqa": dataclasses.replace(GPT, num_heads=4, num_kv_heads=2),
}
PRECISION_CASES = {
    "mixed": "gpt-bf16",
    "mixed-half-grads": "gpt-bf16-half-grads",
    "half": "gpt-bf16-half",
    "mixed-fp8": "gpt-bf16-fp8",
}
CONFIGS["gpt-bf16-half-grads"] = dataclasses.replace(GPT, dtype="bf16", training_precision="mixed-half-grads")
CONFIGS["gpt-bf16-fp8"] = dataclasses.replace(GPT, dtype="bf16", training_precision="mixed-fp8")
BATCH = 8


@functools.cache
def case(model: str, optimizer: str = "adam"):
    """``(program, inputs, outputs)`` of one float64 training step."""
    config = CONFIGS[model]
    fn = models.build_training_step(config, BATCH, optimizer=optimizer, lr=0.1)
    rng = np.random.default_rng(1)
    inputs = {}
    for v in fn.inputs:
        shape = tuple(int(d) for d in v.type.shape)
        if v.type.dtype == "i32":
            inputs[v.name] = rng.integers(0, config.vocab_size, size=shape)
        elif v.name.endswith(".v"):
            inputs[v.name] = rng.uniform(0.0, 0.1, size=shape)
        else:
            inputs[v.name] = (1.0 if v.name.endswith(".gamma") else 0.0) + 0.3 * rng.standard_normal(shape)
    return fn, inputs, execute(fn, inputs)


def assert_computes_the_original(dist, model, optimizer="adam"):
    fn, inputs, expected = case(model, optimizer)
    got = dist.gather_outputs(execute(dist.function, dist.shard_inputs(inputs)))
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


# --------------------------------------------------------------------------- #
# ParallelConfig.validate.

GPT_SHAPE = dict(num_layers=4, num_heads=8, batch_size=16)


@pytest.mark.parametrize(
    "config, kwargs",
    [
        (ParallelConfig(), {}),
        (ParallelConfig(data=2, tensor=2, pipeline=2, microbatches=8), dict(world_size=8)),
        (ParallelConfig(pipeline=3, microbatches=2), {}),  # stages may be uneven
        (ParallelConfig(pipeline=2, microbatches=4, schedule="interleaved", virtual_stages=2), {}),
        (ParallelConfig(data=4, zero=True, overlap_grad_comm=True, recompute="full"), {}),
        (ParallelConfig(tensor=4, sequence_parallel=True, bucket_bytes=2**20), dict(hidden=64)),
    ],
)
def test_validate_accepts(config, kwargs):
    assert config.validate(**GPT_SHAPE, **kwargs) is config


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (ParallelConfig(data=0), {}, r"data must be an int >= 1, got data=0"),
        (ParallelConfig(tensor=-1), {}, r"tensor must be an int >= 1, got tensor=-1"),
        (ParallelConfig(pipeline=2.0), {}, r"pipeline must be an int >= 1, got pipeline=2\.0"),
        (ParallelConfig(microbatches=0), {}, r"microbatches must be an int >= 1, got microbatches=0"),
        (ParallelConfig(schedule="zigzag"), {}, r"schedule must be one of .*'1f1b'.*got schedule='zigzag'"),
        (ParallelConfig(recompute="some"), {}, r"recompute must be one of .*got recompute='some'"),
        (ParallelConfig(zero=1), {}, r"zero must be a bool, got zero=1"),
        (
            ParallelConfig(bucket_bytes=-1),
            {},
            r"bucket_bytes must be a number > 0 or None, got bucket_bytes=-1",
        ),
        (ParallelConfig(data=2, zero=True, bucket_bytes=1024), {}, r"bucket_bytes=1024 cannot be combined"),
        (ParallelConfig(data=3), {}, r"data=3 must divide the batch size, which is 16"),
        (
            ParallelConfig(data=4, pipeline=2, microbatches=8),
            {},
            r"microbatches=8 must be <= the per-replica batch, which is 4 \(batch size 16 / data=4\)",
        ),
        (
            ParallelConfig(data=2, pipeline=2, microbatches=3),
            {},
            r"microbatches=3 must divide the per-replica batch, which is 8",
        ),
        (ParallelConfig(microbatches=2), {}, r"microbatches=2 needs pipeline > 1"),
        (ParallelConfig(pipeline=5), {}, r"pipeline=5 x virtual_stages=1 must be <= the number of layers, 4"),
        (
            ParallelConfig(pipeline=2, microbatches=2, schedule="interleaved", virtual_stages=3),
            {},
            r"pipeline=2 x virtual_stages=3 must be <= the number of layers, 4",
        ),
        (ParallelConfig(virtual_stages=2), {}, r"virtual_stages=2 needs schedule='interleaved'"),
        (
            ParallelConfig(pipeline=2, microbatches=3, schedule="interleaved"),
            dict(batch_size=12),
            r"microbatches=3 to be a multiple of pipeline=2",
        ),
        (ParallelConfig(tensor=3), {}, r"tensor=3 must divide the number of attention heads, which is 8"),
        (ParallelConfig(tensor=4), dict(hidden=30), r"tensor=4 must divide the hidden size, which is 30"),
        (ParallelConfig(sequence_parallel=True), {}, r"sequence_parallel=True needs tensor > 1"),
        (ParallelConfig(data=2, tensor=2), dict(world_size=8), r"= 4 must equal world_size=8"),
    ],
)
def test_validate_rejects(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config.validate(**{**GPT_SHAPE, **kwargs})


def test_validate_checks_every_batch_size_variant():
    ParallelConfig(data=4, pipeline=2, microbatches=2).validate(4, 8, np.array([8, 16]))
    with pytest.raises(ValueError, match=r"data=4 must divide the batch size, which is \{8,6\}"):
        ParallelConfig(data=4).validate(4, 8, np.array([8, 6]))
    with pytest.raises(
        ValueError, match=r"microbatches=4 must be <= the per-replica batch, which is \{2,4\}"
    ):
        ParallelConfig(data=4, pipeline=2, microbatches=4).validate(4, 8, np.array([8, 16]))


def test_world_size_is_the_product_of_degrees():
    assert ParallelConfig(data=2, tensor=4, pipeline=3).world_size == 24


def test_model_shape_reads_the_program():
    assert model_shape(case("mlp")[0]) == dict(num_layers=4, num_heads=None, batch_size=BATCH)
    assert model_shape(case("gpt")[0]) == dict(num_layers=2, num_heads=2, batch_size=BATCH)
    dp = data_parallel(case("gpt")[0], 2)
    assert model_shape(dp)["batch_size"] == BATCH // 2


# --------------------------------------------------------------------------- #
# parallelize.


def test_public_names():
    for name in ("Distributed", "InputSlice", "Recipe", "data_parallel", "ParallelConfig", "parallelize"):
        assert name in transforms.__all__
    for name in transforms.__all__:
        assert callable(getattr(transforms, name))


def test_default_config_is_the_identity():
    fn = case("mlp")[0]
    assert parallelize(fn, ParallelConfig()).function is fn


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize(
    "config",
    [
        ParallelConfig(data=2),
        ParallelConfig(data=4, overlap_grad_comm=True, bucket_bytes=1024),
        ParallelConfig(data=2, zero=True),
    ],
)
def test_data_only_computes_the_original(model, config):
    dist = parallelize(case(model)[0], config)
    assert dist.function.devices == tuple(range(config.world_size))
    assert_computes_the_original(dist, model)


def test_grouped_query_attention_needs_a_tensor_degree_dividing_its_key_value_heads():
    fn = case("gqa")[0]
    assert model_shape(fn) == dict(num_layers=2, num_heads=4, batch_size=BATCH, kv_heads=2)
    with pytest.raises(ValueError, match=r"tensor=4 must divide the number of key / value heads, which is 2"):
        parallelize(fn, ParallelConfig(tensor=4))


def test_parallelize_validates_against_the_program():
    with pytest.raises(ValueError, match=r"data=3 must divide the batch size, which is 8"):
        parallelize(case("mlp")[0], ParallelConfig(data=3))
    with pytest.raises(ValueError, match=r"microbatches=8 must be <= the per-replica batch, which is 4"):
        parallelize(case("mlp")[0], ParallelConfig(data=2, pipeline=2, microbatches=8))


@pytest.mark.parametrize("zero", [False, True])
def test_representative_data_replica_matches_the_full_program(zero):
    fn = models.build_training_step(GPT, BATCH, optimizer="adam")
    config = ParallelConfig(data=4, overlap_grad_comm=True, zero=zero)
    topology = Topology.uniform(4, link_latency=1e-6)
    full = reference_simulate(parallelize(fn, config).function, topology)
    one = reference_simulate(parallelize(fn, config, representative_only=True).function, topology)
    assert one.step_time == pytest.approx(full.step_time, rel=1e-12)
    assert one.peak_memory[0] == pytest.approx(full.peak_memory[0], rel=1e-12)


# --------------------------------------------------------------------------- #
# Hybrids, once the other transforms exist.

HYBRIDS = {
    "tensor": (["tensor_parallel"], ParallelConfig(data=2, tensor=2)),
    "tensor_sp": (["tensor_parallel"], ParallelConfig(tensor=2, sequence_parallel=True)),
    "tensor_sp_data": (["tensor_parallel"], ParallelConfig(data=2, tensor=2, sequence_parallel=True)),
    "pipeline_1f1b": (["pipeline"], ParallelConfig(data=2, pipeline=2, microbatches=2)),
    "pipeline_gpipe": (["pipeline"], ParallelConfig(pipeline=2, microbatches=4, schedule="gpipe")),
    "recompute": (["recompute"], ParallelConfig(data=2, recompute="full")),
    "all": (
        ["tensor_parallel", "pipeline", "recompute"],
        ParallelConfig(
            data=2,
            tensor=2,
            pipeline=2,
            microbatches=2,
            recompute="attention",
            zero=True,
            overlap_grad_comm=True,
        ),
    ),
}
HYBRIDS["all_sp"] = (
    HYBRIDS["all"][0],
    dataclasses.replace(HYBRIDS["all"][1], recompute="full", sequence_parallel=True),
)


@pytest.mark.parametrize(
    "model", ["mlp", "gpt", "mlp-bf16", "gpt-bf16", "mlp-bf16-half-grads", "gpt-bf16-half", "gqa"]
)
@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_hybrid_computes_the_original(hybrid, model):
    modules, config = HYBRIDS[hybrid]
    for module in modules:
        pytest.importorskip(f"distir_jax.transforms.{module}")
    if model.startswith("mlp") and config.sequence_parallel:
        pytest.skip("sequence parallelism splits a sequence axis the MLP does not have")
    dist = parallelize(case(model)[0], config)
    assert dist.function.devices == tuple(range(config.world_size))
    assert_computes_the_original(dist, model)


def _is_state(name: str) -> bool:
    """An input holding optimizer state or a master copy (``{w}.m.tp0.dp1``,
    ``{w}.master.dp0``), not ZeRO's shard of the weight an update writes (``{w}.dp1.master``)."""
    parts = name.split(".")
    return any(
        p in ("m", "v", "master") and not re.fullmatch(r"dp\d+", parts[i - 1]) for i, p in enumerate(parts)
    )


@pytest.mark.parametrize("precision", list(PRECISION_CASES))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_precision_sets_state_and_gradient_dtypes(optimizer, precision):
    """Mixed precision: the update runs on an f32 master copy (and f32 moments),
    2 + 4 (SGD) or 2 + 12 (Adam) bytes a parameter resident, and with "mixed"
    gradients are summed over microbatches and reduced over replicas in f32.
    "half": no master, moments in bf16 (2 or 2 + 4 bytes), gradients in bf16.
    ZeRO keeps a 1/d shard of the state; every variant computes the original."""
    pytest.importorskip("distir_jax.transforms.pipeline")
    model = PRECISION_CASES[precision]
    fn = case(model, optimizer)[0]
    weights = {v.name: v.type for v in fn.inputs if v.name in models.weight_names(fn)}
    params = sum(int(t.num_elements) for t in weights.values())
    # mixed-fp8: each weight its FP8 GEMMs read has resident FP8 copies (it and its transpose).
    copies = {v.name: v.type for v in fn.inputs if v.name.rsplit(".", 1)[-1] in ("fp8", "fp8t")}
    assert bool(copies) == (precision == "mixed-fp8") and {t.dtype for t in copies.values()} <= {"f8"}
    state = {
        v.name: v.type for v in fn.inputs if v.name.rsplit(".", 1)[0] in weights and v.name not in copies
    }
    state_dtype = "bf16" if precision == "half" else "f32"
    assert {t.dtype for t in weights.values()} == {"bf16"}
    assert {t.dtype for t in state.values()} == ({state_dtype} if state else set())
    state_bytes = (
        (4 if precision == "half" else 12) if optimizer == "adam" else (0 if precision == "half" else 4)
    )
    assert sum(int(t.num_bytes) for t in (*weights.values(), *state.values())) == (2 + state_bytes) * params
    grad_dtype = "f32" if precision in ("mixed", "mixed-fp8") else "bf16"
    state_bytes_held = {}
    for zero in (False, True):
        config = ParallelConfig(data=2, tensor=2, pipeline=2, microbatches=2, zero=zero)
        dist = parallelize(fn, config)
        assert_computes_the_original(dist, model, optimizer)
        ops = dist.function.ops
        # What the updates read, what sums microbatches and what reduces over replicas.
        grads = {op.inputs[1].type.dtype for op in ops if op.op_type in ("SGD", "Adam")}
        sums = {
            op.outputs[0].type.dtype for op in ops if op.op_type == "Add" and ".acc" in op.outputs[0].name
        }
        reduced = {
            op.outputs[0].type.dtype
            for op in ops
            if op.op_type in ("AllReduce", "ReduceScatter") and ".grad" in op.inputs[0].name
        }
        assert grads == sums == reduced == {grad_dtype}
        # Gradients are summed into their running sums and ZeRO-scattered in place.
        accumulate = [op for op in ops if op.op_type == "Add" and ".acc" in op.outputs[0].name]
        scatter = [op for op in ops if op.op_type == "ReduceScatter"]
        assert accumulate and bool(scatter) == zero
        assert all(op.attr("inplace") for op in accumulate + scatter)
        state_bytes_held[zero] = sum(int(v.type.num_bytes) for v in dist.function.inputs if _is_state(v.name))
    # Two data-parallel replicas hold the state twice; under ZeRO once, in halves.
    assert state_bytes_held[False] == 2 * state_bytes_held[True] or state_bytes == 0


def test_interleaved_hybrid_computes_the_original():
    pytest.importorskip("distir_jax.transforms.pipeline")
    config = ParallelConfig(data=2, pipeline=2, microbatches=2, schedule="interleaved", virtual_stages=2)
    assert_computes_the_original(parallelize(case("mlp")[0], config), "mlp")


def test_tensor_ranks_are_adjacent_and_data_replicas_outermost():
    pytest.importorskip("distir_jax.transforms.tensor_parallel")
    dist = parallelize(case("mlp")[0], ParallelConfig(data=2, tensor=2))
    groups = {op.devices for op in dist.function.ops if op.op_type == "AllReduce"}
    # Tensor-parallel groups are adjacent devices; replicas pair device d with d + 2.
    assert groups == {(0, 1), (2, 3), (0, 2), (1, 3)}


@pytest.mark.parametrize("zero", [False, True])
def test_representative_hybrid_matches_the_full_program(zero):
    pytest.importorskip("distir_jax.transforms.tensor_parallel")
    fn = models.build_training_step(GPT, BATCH, optimizer="adam")
    config = ParallelConfig(data=2, tensor=2, zero=zero)
    topology = Topology.uniform(4, link_latency=1e-6)
    full = reference_simulate(parallelize(fn, config).function, topology)
    one = reference_simulate(parallelize(fn, config, representative_only=True).function, topology)
    assert one.step_time == pytest.approx(full.step_time, rel=1e-12)
    assert one.peak_memory[0] == pytest.approx(full.peak_memory[0], rel=1e-12)
