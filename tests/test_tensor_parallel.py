"""Tensor (Megatron) parallelism: numerical proof, placement of collectives, symmetry, errors."""

import collections
import dataclasses
import itertools

import numpy as np
import pytest

from distir_jax import models
from distir_jax.executor.reference import op_costs, reference_simulate
from distir_jax.executor.sequential import execute
from distir_jax.ir import FunctionBuilder, Topology
from distir_jax.ir.function import Op, Value
from distir_jax.ir.parser import parse_function
from distir_jax.ir.printer import print_function
from distir_jax.ir.typecheck import infer_types
from distir_jax.lower import lower
from distir_jax.models import MLPConfig, TransformerConfig
from distir_jax.testing.inputs import random_inputs
from distir_jax.transforms.base import Distributed
from distir_jax.transforms.tensor_parallel import tensor_parallel
from distir_jax.transforms.tensor_parallel_rewrite import group_sized_gathers

MLP = MLPConfig(num_layers=4, hidden=8, dtype="f64")
GPT = TransformerConfig(num_layers=2, hidden=8, num_heads=4, vocab_size=11, seq_len=4, dtype="f64")
# 12 tokens: degrees 2 and 4 split the vocabulary (the token table, LM head and loss).
GPT_VOCAB = dataclasses.replace(GPT, vocab_size=12)
# Grouped-query attention: the 4 query heads share 2 key / value heads.
GQA = dataclasses.replace(GPT, num_kv_heads=2)
BATCH = {"mlp": 4, "gpt": 2, "gpt_vocab": 2, "gqa": 2}
CONFIGS = {"mlp": MLP, "gpt": GPT, "gpt_vocab": GPT_VOCAB, "gqa": GQA}
RTOL = 1e-9
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter")


def training(model, optimizer="sgd", batch=None):
    return models.build_training_step(
        CONFIGS[model], BATCH[model] if batch is None else batch, optimizer=optimizer, lr=0.1
    )


def assert_same_outputs(fn, dist: Distributed, seed=0):
    """Runs both programs; the rebuilt outputs equal the original's (replicas checked equal)."""
    inputs = random_inputs(fn, seed)
    expected = execute(fn, inputs)
    got = dist.gather_outputs(execute(dist.function, dist.shard_inputs(inputs)), rtol=RTOL)
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=1e-12, err_msg=name)


def count(fn, op_type, **attrs):
    return sum(op.op_type == op_type and all(op.attr(k) == v for k, v in attrs.items()) for op in fn.ops)


# --------------------------------------------------------------------------- #
# Numerical proof.


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model", ["mlp", "gpt", "gpt_vocab"])
def test_training_step_computes_the_original(model, optimizer, degree, sequence_parallel):
    fn = training(model, optimizer)
    dist = tensor_parallel(fn, degree, sequence_parallel=sequence_parallel)
    assert dist.function.devices == tuple(range(degree))
    assert_same_outputs(fn, dist)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt", "gpt_vocab"])
def test_inference_computes_the_original(model, degree, sequence_parallel):
    fn = models.build_inference(CONFIGS[model], BATCH[model])
    assert_same_outputs(fn, tensor_parallel(fn, degree, sequence_parallel=sequence_parallel))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_mlp_with_a_last_column_layer(sequence_parallel):
    # An odd layer count ends on a column layer, whose output is gathered
    # along features before the loss.
    fn = models.mlp_training_step(MLPConfig(3, 8, dtype="f64"), 4, optimizer="adam", lr=0.1)
    dist = tensor_parallel(fn, 2, sequence_parallel=sequence_parallel)
    assert count(dist.function, "AllGather", phase="fwd") >= 1
    assert_same_outputs(fn, dist)


def test_weights_are_split_along_megatrons_axes():
    fn = training("gpt", "adam")
    dist = tensor_parallel(fn, 2)
    splits = {sl.source: sl.splits for name, sl in dist.inputs.items() if name.endswith(".tp1")}
    assert splits["l1.attn.wqkv"] == ((1, 1, 2),)  # columns: whole heads
    assert splits["l1.mlp.w1"] == ((1, 1, 2),)
    assert splits["l1.attn.wo"] == ((0, 1, 2),)  # rows
    assert splits["l1.mlp.w2.m"] == ((0, 1, 2),)  # Adam state follows its weight
    assert splits["l1.ln1.gamma"] == () and splits["l3.head.w"] == () and splits["tokens"] == ()
    kinds = {name: (r.kind, r.axis) for name, r in dist.outputs.items()}
    assert kinds["loss"][0] == "replica"
    assert kinds["l1.attn.wqkv.new"] == ("concat", 1)
    assert kinds["l1.mlp.w2.v.new"] == ("concat", 0)
    assert kinds["l1.ln2.beta.new"][0] == "replica"


@pytest.mark.parametrize("config", [GPT, MLPConfig(num_layers=4, hidden=8)], ids=["gpt", "mlp"])
def test_mixed_fp8_weights_split_like_their_fp8_copies(config):
    """With mixed-fp8 the GEMMs read a weight's FP8 copies, not the weight: the copies
    are split as the weight would be, and the weight (first read by the CastInto that
    refreshes a copy) like them, with its optimizer state; nothing is gathered."""
    config = dataclasses.replace(config, dtype="bf16", training_precision="mixed-fp8")
    fn = models.build_training_step(config, 4, optimizer="adam")
    mixed = dataclasses.replace(config, training_precision="mixed")
    mixed = models.build_training_step(mixed, 4, optimizer="adam")
    want = {
        sl.source: sl.splits for name, sl in tensor_parallel(mixed, 2).inputs.items() if name.endswith(".tp1")
    }
    dist = tensor_parallel(fn, 2)
    splits = {sl.source: sl.splits for name, sl in dist.inputs.items() if name.endswith(".tp1")}
    copies = [name for name in splits if name.endswith((".fp8", ".fp8t"))]
    assert copies
    for name in copies:
        weight = name.rsplit(".", 1)[0]
        assert splits[name] == splits[weight] == want[weight] != ()
        assert splits[f"{weight}.master"] == splits[f"{weight}.m"] == want[weight]
    assert {name: s for name, s in splits.items() if name not in copies} == want
    assert not [op for op in dist.function.ops if op.op_type == "AllGather" and ".grad" in op.inputs[0].name]
    assert_same_outputs(fn, dist)


@pytest.mark.parametrize("model", ["gpt", "gpt_vocab"])
@pytest.mark.parametrize("inner_sp, outer_sp", list(itertools.product([False, True], repeat=2)))
def test_tensor_parallel_composes_with_itself(inner_sp, outer_sp, model):
    fn = training(model, "adam")
    dist = tensor_parallel(tensor_parallel(fn, 2, sequence_parallel=inner_sp), 2, sequence_parallel=outer_sp)
    assert dist.function.devices == (0, 1, 2, 3)
    # Four ranks in all: each holds one of the four heads.
    qkv = [op for op in dist.function.ops if op.outputs[0].name.startswith("l1.qkv_heads")]
    assert len(qkv) == 4 and all(op.attr("shape")[2] == 1 for op in qkv)
    assert_same_outputs(fn, dist)


def test_existing_sends_and_devices_are_mapped_per_rank():
    # A program on two devices: the MLP on device 0 sends its output to device 1.
    fn = models.mlp_inference(MLP, 4)
    send = Op("Send", fn.outputs, (Value("moved"),), {"to": 1, "layer": 4, "phase": "fwd"})
    fn = infer_types(fn.replace(ops=fn.ops + (send,), outputs=(Value("moved"),)))
    dist = tensor_parallel(fn, 2)
    # Rank r of old device d is device r * 2 + d.
    assert [v.type.device for v in dist.function.outputs] == [1, 3]
    assert dist.function.devices == (0, 1, 2, 3)
    assert_same_outputs(fn, dist)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_programs_from_other_transforms(model, sequence_parallel):
    data_parallel = pytest.importorskip("distir_jax.transforms.data_parallel").data_parallel
    pipeline_parallel = pytest.importorskip("distir_jax.transforms.pipeline").pipeline_parallel
    fn = training(model, "adam", batch=2 * BATCH[model])
    sp = sequence_parallel
    before = tensor_parallel(data_parallel(pipeline_parallel(fn, 2, 2), 2), 2, sequence_parallel=sp)
    after = pipeline_parallel(tensor_parallel(fn, 2, sequence_parallel=sp), 2, 2)
    assert len(before.function.devices) == 8
    assert_same_outputs(fn, before)
    assert_same_outputs(fn, after)


# --------------------------------------------------------------------------- #
# Text form, lowering and simulation.


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_print_parse_lower_and_simulate(model, sequence_parallel):
    degree = 2
    dist = tensor_parallel(training(model, "adam"), degree, sequence_parallel=sequence_parallel)
    text = print_function(dist.function)
    parsed = parse_function(text)
    assert parsed == dist.function and print_function(parsed) == text
    topology = Topology.uniform(degree)
    program = lower(dist.function, topology)
    assert int(program.num_ops) == len(dist.function.ops)
    result = reference_simulate(dist.function, topology)
    assert result.step_time > 0 and set(result.peak_memory) == {0, 1}


def test_size_variant_batches_lower_in_one_pass():
    fn = models.transformer_training_step(
        TransformerConfig(2, 8, 4, 11, 4), np.array([2, 4, 8]), optimizer="adam"
    )
    dist = tensor_parallel(fn, 2, sequence_parallel=True)
    program = lower(dist.function, Topology.uniform(2))
    assert program.flops.shape == (3, len(dist.function.ops))


def _matmul_seconds(fn, topology, device, head):
    """Compute time on one device of the MatMuls split by ``col`` / ``row`` hints, and
    with ``head`` of the LM head's (a split by vocabulary drops their hint)."""
    return sum(
        op_costs(op, topology)[device]
        for op in fn.ops
        if op.op_type == "MatMul"
        and (op.attr("tp") in ("col", "row") or (head and op.attr("layer") == GPT.num_layers + 1))
        and device in op.devices
    )


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt", "gpt_vocab"])
def test_matmul_compute_drops_by_the_degree(model, degree):
    # Compute-bound devices, free links: only flops count. The LM head is split
    # too where the degree divides the vocabulary (12 rows; not 11).
    free = dict(
        peak_flops=1e9, memory_bandwidth=1e30, link_bandwidth=1e30, link_latency=0.0, launch_overhead=0.0
    )
    fn = training(model)
    head = model == "gpt_vocab"
    dist = tensor_parallel(fn, degree)
    original = _matmul_seconds(fn, Topology.uniform(1, **free), 0, head)
    topology = Topology.uniform(degree, **free)
    for device in range(degree):
        seconds = _matmul_seconds(dist.function, topology, device, head)
        np.testing.assert_allclose(seconds * degree, original, rtol=1e-12)
    busy = reference_simulate(dist.function, topology).step_time
    assert busy < reference_simulate(fn, Topology.uniform(1, **free)).step_time


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_vocab_parallel_embedding_head_and_loss(sequence_parallel):
    """Megatron-LM's vocabulary parallelism: each rank holds V / t rows of the token
    table and columns of the LM head; the lookup's partial sums are all-reduced (or
    reduce-scattered along the sequence), the loss comes from every part's
    statistics, all-gathered ([B, S, 3 t]), and the logits are never gathered."""
    degree, vocab, hidden = 4, GPT_VOCAB.vocab_size, GPT_VOCAB.hidden
    fn = training("gpt_vocab", "adam")
    dist = tensor_parallel(fn, degree, sequence_parallel=sequence_parallel)
    assert_same_outputs(fn, dist)
    new = dist.function
    shapes = {v.name: tuple(v.type.shape) for v in new.inputs}
    for rank in range(degree):
        for name in ("embed.tokens", "embed.tokens.m", "embed.tokens.v"):
            assert shapes[f"l0.{name}.tp{rank}"] == (vocab // degree, hidden)
        assert shapes[f"l3.head.w.tp{rank}"] == (hidden, vocab // degree)
    assert dist.inputs["l0.embed.tokens.tp3"].splits == ((0, 3, degree),)
    lookups = [op for op in new.ops if op.op_type == "Embedding"]
    assert [(op.attr("vocab_index"), op.attr("vocab_parts")) for op in lookups] == [(r, 4) for r in range(4)]
    assert {op.attr("num_embeddings") for op in new.ops if op.op_type == "EmbeddingGrad"} == {vocab // degree}
    assert count(new, "CrossEntropyStats") == count(new, "CrossEntropyFromStats") == degree
    assert count(new, "SoftmaxCrossEntropy") == 0
    gathers = [op for op in new.ops if op.op_type == "AllGather" and op.attr("layer") == GPT.num_layers + 1]
    stats = [op for op in gathers if op.inputs[0].name.startswith("logits.stats")]
    assert len(stats) == 1 and tuple(stats[0].outputs[0].type.shape) == (2, GPT.seq_len, 3 * degree)
    assert not any(op.inputs[0].name.startswith("logits.tp") for op in gathers)  # logits stay split
    # The lookup's partial sums: one collective after the embedding, one for the
    # head's input gradient (the conjugate of its column split).
    reduce = "ReduceScatter" if sequence_parallel else "AllReduce"
    assert count(new, reduce, layer=0, phase="fwd") == 1
    assert count(new, reduce, layer=GPT.num_layers + 1, phase="bwd") == 1


def test_vocabulary_the_degree_does_not_divide_stays_whole():
    dist = tensor_parallel(training("gpt", "adam"), 2)  # 11 tokens
    shapes = {v.name: tuple(v.type.shape) for v in dist.function.inputs}
    assert shapes["l0.embed.tokens.tp1"] == (GPT.vocab_size, GPT.hidden)
    assert shapes["l3.head.w.tp1"] == (GPT.hidden, GPT.vocab_size)
    assert count(dist.function, "SoftmaxCrossEntropy") == 2 and count(dist.function, "CrossEntropyStats") == 0


def test_megatron_all_reduces_per_transformer_block():
    fn = training("gpt", "adam")
    dist = tensor_parallel(fn, 4).function
    for layer in range(1, GPT.num_layers + 1):
        # Forward: after attn.wo and mlp.w2 (g); backward: under wqkv and w1 (f's conjugate).
        assert count(dist, "AllReduce", layer=layer, phase="fwd") == 2
        assert count(dist, "AllReduce", layer=layer, phase="bwd") == 2
    assert count(dist, "AllReduce") == 4 * GPT.num_layers
    assert count(dist, "AllGather") == count(dist, "ReduceScatter") == 0
    # Every all-reduce spans the four ranks of one old device.
    assert {op.devices for op in dist.ops if op.op_type == "AllReduce"} == {(0, 1, 2, 3)}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_grouped_query_attention_splits_whole_key_value_heads(optimizer, sequence_parallel):
    """Each rank holds whole key / value heads and their query heads: the same
    numbers, and Megatron's collectives per block (the two projections' input
    gradients add up as partial sums, then one reduction)."""
    fn = training("gqa", optimizer)
    dist = tensor_parallel(fn, 2, sequence_parallel=sequence_parallel)
    assert_same_outputs(fn, dist)
    plain = tensor_parallel(training("gpt", optimizer), 2, sequence_parallel=sequence_parallel).function
    for kind in COLLECTIVES:
        for phase in ("fwd", "bwd", "opt"):
            assert count(dist.function, kind, phase=phase) == count(plain, kind, phase=phase), (kind, phase)
    with pytest.raises(ValueError, match=r"degree=4 must divide num_kv_heads=2 \(the heads, entry"):
        tensor_parallel(fn, 4)


def test_sequence_parallel_collectives_per_transformer_block():
    dist = tensor_parallel(training("gpt"), 2, sequence_parallel=True).function
    for layer in range(1, GPT.num_layers + 1):
        # Forward: gather before wqkv and w1, reduce-scatter after wo and w2.
        assert count(dist, "AllGather", layer=layer, phase="fwd") == 2
        assert count(dist, "ReduceScatter", layer=layer, phase="fwd") == 2
        # Backward: gather the output gradient before wo and w2, re-gather the
        # LayerNorm outputs for the wqkv and w1 weight gradients, and
        # reduce-scatter the input gradients of wqkv and w1.
        assert count(dist, "AllGather", layer=layer, phase="bwd") == 4
        assert count(dist, "ReduceScatter", layer=layer, phase="bwd") == 2
        assert count(dist, "AllReduce", layer=layer, phase=("fwd")) == 0
        # LayerNorm gains and biases: partial sums over sequence parts.
        assert count(dist, "AllReduce", layer=layer, phase="opt") == 4
    gathers = [op for op in dist.ops if op.op_type in ("AllGather", "ReduceScatter")]
    assert {op.attr("axis") for op in gathers} == {1}  # S of [B, S, H]


def test_mlp_collectives_follow_distirs_horizontal_parallelism():
    dist = tensor_parallel(training("mlp"), 2).function
    # One all-reduce after each row layer (2, 4) and under each column layer but the first (3).
    assert [(op.attr("layer"), op.attr("phase")) for op in dist.ops if op.op_type in COLLECTIVES] == [
        (2, "fwd"),
        (4, "fwd"),
        (2, "bwd"),
    ]
    sp = tensor_parallel(training("mlp"), 2, sequence_parallel=True).function
    assert {op.attr("axis") for op in sp.ops if op.op_type in ("AllGather", "ReduceScatter")} == {0}


# --------------------------------------------------------------------------- #
# Symmetry reduction.


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_representative_rank_simulates_like_the_full_program(model, degree, sequence_parallel):
    fn = training(model, "adam")
    if sequence_parallel and not group_sized_gathers():
        # Rank 0's AllGather / ReduceScatter would need result sizes taken from
        # their `group` attribute, which this IR's shape rules do not do.
        with pytest.raises(ValueError, match="representative_only=True"):
            tensor_parallel(fn, degree, sequence_parallel=True, representative_only=True)
        return
    full = tensor_parallel(fn, degree, sequence_parallel=sequence_parallel)
    rep = tensor_parallel(fn, degree, sequence_parallel=sequence_parallel, representative_only=True)
    assert rep.function.devices == (0,)
    # Rank 0's ops are exactly the full program's ops that touch device 0.
    assert len(rep.function.ops) == sum(0 in op.devices for op in full.function.ops)
    groups = {op.attr("group") for op in rep.function.ops if op.op_type in COLLECTIVES}
    assert groups == {tuple(range(degree))}
    topology = Topology.uniform(degree, link_latency=1e-6)
    a, b = reference_simulate(full.function, topology), reference_simulate(rep.function, topology)
    np.testing.assert_allclose(b.step_time, a.step_time, rtol=1e-12)
    np.testing.assert_allclose(b.peak_memory[0], a.peak_memory[0], rtol=1e-12)
    # Only outputs rank 0 holds whole keep a recipe.
    assert "loss" in rep.outputs and not any(name.endswith("wqkv.new") for name in rep.outputs)


# --------------------------------------------------------------------------- #
# Bad input.


@pytest.mark.parametrize("degree", [0, -2, 2.0, True, "2"])
def test_degree_must_be_a_positive_int(degree):
    with pytest.raises(ValueError, match=r"tensor_parallel: degree must be an int >= 1.*degree="):
        tensor_parallel(training("mlp"), degree)


def test_degree_one_is_the_identity():
    fn = training("gpt")
    dist = tensor_parallel(fn, 1, sequence_parallel=True)
    assert dist.function is fn
    assert all(sl.splits == () for sl in dist.inputs.values())


@pytest.mark.parametrize(
    "config, degree, named",
    [
        (GPT, 3, "num_heads=4"),
        (GPT, 8, "num_heads=4"),
        (TransformerConfig(1, 8, 4, 11, 4, ffn_hidden=6, dtype="f64"), 4, "ffn_hidden=6"),
        (MLP, 3, "hidden=8"),
    ],
)
def test_degree_must_divide_heads_and_widths(config, degree, named):
    fn = models.build_training_step(config, 2)
    with pytest.raises(ValueError, match=rf"tensor_parallel: degree={degree} must divide .*{named}"):
        tensor_parallel(fn, degree)


def test_sequence_parallel_needs_a_divisible_sequence():
    fn = models.build_training_step(TransformerConfig(1, 8, 4, 11, 3, dtype="f64"), 2)
    tensor_parallel(fn, 2)  # fine without sequence parallelism
    with pytest.raises(ValueError, match=r"degree=2 must divide dimension 1 .*size 3.*sequence_parallel"):
        tensor_parallel(fn, 2, sequence_parallel=True)


def test_program_without_hints_is_refused():
    b = FunctionBuilder("plain")
    y = b.add("MatMul", b.input("x", (4, 8)), b.input("w", (8, 8)))
    with pytest.raises(ValueError, match="no MatMul with a tp='col' or tp='row' hint"):
        tensor_parallel(b.build(y), 2)


def test_contradictory_hints_are_refused():
    b = FunctionBuilder("bad")
    y = b.add("Relu", b.input("x", (4, 8)), tp="heads", layer=1, phase="fwd")
    z = b.add("MatMul", y, b.input("w", (8, 8)), tp="col", layer=1, phase="fwd")
    with pytest.raises(ValueError, match=r"op #0 Relu.*no operand is split"):
        tensor_parallel(b.build(z), 2)


def test_counts_are_per_rank_copies():
    fn = training("gpt")
    dist = tensor_parallel(fn, 2).function
    original = collections.Counter(op.op_type for op in fn.ops)
    split = collections.Counter(op.op_type for op in dist.ops)
    assert split["MatMul"] == 2 * original["MatMul"]
    assert split["AllReduce"] == 4 * GPT.num_layers
