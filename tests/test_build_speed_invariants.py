"""What the build-speed caches rely on, and that they never skip a check.

Type inference and lowering reuse the results of built-in shape rules and
features for ops that differ only in annotation attributes
(``registry.ANNOTATION_ATTRS``); building and lowering pause the cyclic
garbage collector.
"""

import dataclasses
import gc

import numpy as np
import pytest

from distir_jax.ir import FunctionBuilder, Op, OpSpec, TensorType, Value, get_spec, registry
from distir_jax.lower import lower
from distir_jax.models import MLPConfig, TransformerConfig, build_training_step
from distir_jax.presets import get_preset
from distir_jax.transforms.parallelize import ParallelConfig, parallelize

GPT = TransformerConfig(num_layers=4, hidden=16, num_heads=4, vocab_size=32, seq_len=8, dtype="f32")
MLP = MLPConfig(num_layers=4, hidden=16, dtype="f32")
STRATEGIES = [
    ParallelConfig(tensor=2, sequence_parallel=True, pipeline=2, microbatches=2, data=2, zero=True),
    ParallelConfig(
        tensor=2, recompute="attention", pipeline=2, microbatches=2, schedule="interleaved", virtual_stages=2
    ),
    ParallelConfig(
        recompute="full", pipeline=2, microbatches=4, schedule="gpipe", data=2, overlap_grad_comm=True
    ),
    ParallelConfig(data=2, bucket_bytes=4096.0, overlap_grad_comm=True),
]


class _NoAnnotations(dict):
    """Attributes whose annotation entries may not be read, nor the whole dict walked."""

    def _check(self, key):
        assert key not in registry.ANNOTATION_ATTRS, f"a built-in rule read annotation {key!r}"

    def __getitem__(self, key):
        self._check(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._check(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._check(key)
        return super().__contains__(key)

    def _walk(self, *args):
        raise AssertionError("a built-in rule walked all attributes, annotations included")

    __iter__ = keys = items = values = _walk


def _programs():
    for model in (GPT, MLP):
        for batch in (8, np.array([8, 16])):
            base = build_training_step(model, batch, optimizer="adam")
            yield base
            for config in STRATEGIES:
                if config.sequence_parallel and model is MLP:
                    continue
                yield parallelize(base, config).function


def test_built_in_rules_read_no_annotation():
    seen = set()
    for fn in _programs():
        for op in fn.ops:
            spec = get_spec(op.op_type)
            ins = tuple(v.type for v in op.inputs)
            outs = tuple(v.type for v in op.outputs)
            assert spec.infer(_NoAnnotations(op.attr_dict), ins) == outs
            expected = spec.features(op.attr_dict, ins, outs)
            got = spec.features(_NoAnnotations(op.attr_dict), ins, outs)
            for field in dataclasses.fields(expected):
                np.testing.assert_array_equal(getattr(got, field.name), getattr(expected, field.name))
            seen.add(op.op_type)
    assert {"MatMul", "Send", "AllReduce", "ReduceScatter", "AllGather", "Adam", "LayerNorm"} <= seen


def test_a_cached_rule_still_checks_attribute_types():
    # 2, 2.0 and True are equal Python keys; only 2 is an int part count.
    b = FunctionBuilder("f")
    x = b.input("x", (4, 6))
    b.add("Split", x, parts=2)
    b.add("Split", x, parts=2)
    for parts in (2.0, True):
        with pytest.raises(ValueError, match="Split's attribute parts must be an int"):
            b.add("Split", x, parts=parts)


def test_a_cached_rule_still_checks_operands():
    b = FunctionBuilder("f")
    x = b.input("x", (4, 6))
    w = b.input("w", (6, 3))
    b.add("MatMul", x, w)
    with pytest.raises(ValueError, match="contraction dims differ"):
        b.add("MatMul", w, w)
    w1 = b.input("w1", (6, 3), device=1)
    with pytest.raises(ValueError, match="operands must be on one device"):
        b.add("MatMul", x, w1)


def test_names_are_checked_every_time():
    Op("Relu", (), (), {"layer": 1})  # a known attribute name
    for bad in ("1x", "a b", ""):
        with pytest.raises(ValueError, match=f"invalid value name {bad!r}"):
            Value(bad)
        with pytest.raises(ValueError, match=f"invalid attribute name {bad!r}"):
            Op("Relu", (), (), {"layer": 1, bad: 1})
    with pytest.raises(ValueError, match="nested sequences are not supported"):
        Op("Relu", (), (), {"layer": 1, "shape": ((1, 2),)})


def test_rules_of_registered_ops_are_not_cached(monkeypatch):
    calls = []

    def infer(attrs, ins):
        calls.append(attrs.get("layer"))
        return ins

    spec = OpSpec("Echo", infer, lambda attrs, ins, outs: registry.OpFeatures(), lambda attrs, xs: xs)
    monkeypatch.setitem(registry._REGISTRY, "Echo", spec)
    b = FunctionBuilder("f")
    x = b.input("x", (4,))
    b.add("Echo", x, layer=1)
    b.add("Echo", x, layer=2)
    assert calls == [1, 2]


def test_shared_sizes_are_read_only():
    t = TensorType((np.array([2, 4]), 3))
    assert t.num_bytes.tolist() == [24, 48] and not t.num_bytes.flags.writeable
    with pytest.raises(ValueError):
        t.num_elements[0] = 0
    assert (
        TensorType((np.array([2, 4]), 3)) == t and t.cache_key == TensorType((np.array([2, 4]), 3)).cache_key
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_building_and_lowering_restore_the_garbage_collector(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        fn = parallelize(build_training_step(MLP, 8), ParallelConfig(pipeline=2, microbatches=2))
        lower(fn.function, get_preset("dgx-a100-80gb"))
        assert gc.isenabled() == enabled
        with pytest.raises(ValueError):
            parallelize(fn.function, ParallelConfig(pipeline=3, microbatches=3))
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
