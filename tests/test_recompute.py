"""Activation recomputation: same numbers, less activation memory, more compute."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from distir_jax import models
from distir_jax.executor import execute
from distir_jax.executor.reference import reference_simulate
from distir_jax.ir import Function, Op, Topology
from distir_jax.ir.parser import parse_function
from distir_jax.ir.printer import print_function
from distir_jax.lower import lower
from distir_jax.models import MLPConfig, TransformerConfig
from distir_jax.testing.inputs import random_inputs
from distir_jax.transforms.pipeline import pipeline_parallel
from distir_jax.transforms.recompute import RECOMPUTE_POLICIES, recompute

MLP = MLPConfig(num_layers=8, hidden=8, dtype="f64")
GPT = TransformerConfig(num_layers=4, hidden=8, num_heads=2, vocab_size=11, seq_len=4, dtype="f64")
CONFIGS = {"mlp": MLP, "gpt": GPT, "gqa": dataclasses.replace(GPT, num_heads=4, num_kv_heads=2)}


@functools.cache
def training_step(model: str, optimizer: str = "sgd", batch: int = 8) -> Function:
    return models.build_training_step(CONFIGS[model], batch, optimizer=optimizer, lr=0.1)


def assert_equivalent(dist, fn):
    inputs = random_inputs(fn)
    expected = execute(fn, inputs)
    got = dist.gather_outputs(execute(dist.function, dist.shard_inputs(inputs)))
    assert set(got) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("policy", RECOMPUTE_POLICIES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model", ["mlp", "gpt", "gqa"])
def test_recompute_computes_the_original_step(model, optimizer, policy):
    fn = training_step(model, optimizer)
    assert_equivalent(recompute(fn, policy), fn)


@pytest.mark.parametrize(
    "model,policy,p,k,schedule,v",
    [
        ("gpt", "full", 2, 2, "1f1b", 1),
        ("gpt", "attention", 2, 4, "gpipe", 1),
        ("gpt", "full", 4, 4, "1f1b", 1),
        ("gpt", "full", 2, 2, "interleaved", 2),
        ("gpt", "attention", 1, 2, "1f1b", 1),
        ("gqa", "attention", 2, 4, "1f1b", 1),
        ("gqa", "full", 2, 2, "interleaved", 2),
        ("mlp", "full", 4, 2, "1f1b", 1),
        ("mlp", "full", 2, 4, "interleaved", 2),
    ],
)
def test_recompute_then_pipeline(model, policy, p, k, schedule, v):
    fn = training_step(model, "adam")
    dist = pipeline_parallel(recompute(fn, policy), p, k, schedule=schedule, virtual_stages=v)
    assert_equivalent(dist, fn)
    # Recomputed copies run inside the backward step of their microbatch.
    for index, op in enumerate(dist.function.ops):
        if op.attr("recompute"):
            later = dist.function.ops[index + 1 :]
            assert any(
                o.attr("phase") == "bwd" and o.attr("microbatch") == op.attr("microbatch") for o in later
            )


def test_full_recompute_structure():
    fn = training_step("gpt")
    new = recompute(fn, "full").function
    copies = [op for op in new.ops if op.attr("recompute")]
    forward = [op for op in fn.ops if op.attr("phase") == "fwd" and 1 <= op.attr("layer") <= GPT.num_layers]
    # Every forward op of a block that feeds its backward is re-issued once; the
    # last two (x1 + g @ w2, the block output) feed only the next block.
    assert len(copies) == len(forward) - 2 * GPT.num_layers
    assert all(op.attr("phase") == "fwd" and op.outputs[0].name.endswith(".rc") for op in copies)
    first_backward = {}
    for index, op in enumerate(new.ops):
        if op.attr("phase") == "bwd":
            first_backward.setdefault(op.attr("layer"), index)
    for index, op in enumerate(new.ops):
        if op.attr("recompute"):
            # Issued just before the layer's backward, after every other layer's forward.
            assert index < first_backward[op.attr("layer")]
            assert index > first_backward[op.attr("layer") + 1]
    # The backward of block 1 reads recomputed activations, never the stashed ones.
    stashed = {
        v.name for op in fn.ops if op.attr("layer") == 1 and op.attr("phase") == "fwd" for v in op.outputs
    }
    reads = {
        v.name for op in new.ops if op.attr("layer") == 1 and op.attr("phase") == "bwd" for v in op.inputs
    }
    assert not reads & stashed
    assert {"l1.probs.rc", "l1.ln1.rc", "l1.h1.rc"} <= reads


def test_attention_recompute_touches_only_the_attention_core():
    fn = training_step("gpt")
    new = recompute(fn, "attention").function
    copies = [op for op in new.ops if op.attr("recompute")]
    assert copies and all(op.attr("tp") == "heads" for op in copies)
    assert {op.outputs[0].name for op in copies if op.op_type == "Softmax"} == {
        f"l{i}.probs.rc" for i in range(1, GPT.num_layers + 1)
    }
    # The MLP has no attention: nothing to recompute.
    mlp = training_step("mlp")
    assert recompute(mlp, "attention").function.ops == mlp.ops
    assert recompute(mlp, "none").function is mlp


def test_recompute_saves_memory_and_costs_time():
    fn = training_step("gpt", batch=64)
    topology = Topology.uniform(1)
    results = {
        policy: reference_simulate(recompute(fn, policy).function, topology) for policy in RECOMPUTE_POLICIES
    }
    peak = {policy: r.peak_memory[0] for policy, r in results.items()}
    time = {policy: r.step_time for policy, r in results.items()}
    assert peak["full"] < peak["attention"] < peak["none"]
    assert time["none"] < time["attention"] < time["full"]


def test_recompute_lowers_pipeline_memory():
    fn = training_step("gpt", batch=64)
    topology = Topology.uniform(2)
    plain = reference_simulate(pipeline_parallel(fn, 2, 4).function, topology)
    full = reference_simulate(pipeline_parallel(recompute(fn, "full"), 2, 4).function, topology)
    for device in (0, 1):
        assert full.peak_memory[device] < plain.peak_memory[device]
    assert full.step_time > plain.step_time


def test_text_round_trip_and_lowering():
    new = recompute(training_step("gpt", "adam"), "full").function
    text = print_function(new)
    assert print_function(parse_function(text)) == text
    assert int(lower(new, Topology.uniform(1)).num_ops) == len(new.ops)


def test_bad_inputs():
    fn = training_step("mlp")
    with pytest.raises(
        ValueError, match=r"unknown recompute policy='selective'; valid policies: none, attention, full"
    ):
        recompute(fn, "selective")
    op = fn.ops[0]
    bad = fn.replace(ops=(Op(op.op_type, op.inputs, op.outputs, {"phase": "fwd"}),) + fn.ops[1:])
    with pytest.raises(ValueError, match=r"op #0 MatMul has layer=None"):
        recompute(bad, "full")
