"""Op registry tests: gradients against finite differences, shape rules,
size variants, and optimizer numerics."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distir_jax.ir import FunctionBuilder, TensorType, get_spec, registered_op_types

RTOL, ATOL = 1e-6, 1e-8


def run(op_type, *arrays, **attrs):
    return get_spec(op_type).evaluate(attrs, [np.asarray(a) for a in arrays])


def numeric_grad(objective, x, h=1e-5):
    """Central differences of the scalar ``objective`` at ``x`` (float64)."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += h
        down[i] -= h
        grad[i] = (objective(up) - objective(down)) / (2 * h)
    return grad


def features(op_type, in_types, **attrs):
    spec = get_spec(op_type)
    outs = tuple(spec.infer(attrs, tuple(in_types)))
    return outs, spec.features(attrs, tuple(in_types), outs)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_registry_has_every_op():
    expected = {
        "MatMul", "Add", "Sub", "Mul", "Div", "Relu", "Neg", "Identity", "ReluGrad", "Exp", "Tanh",
        "TanhGrad", "Scale", "Gelu", "GeluGrad", "Softmax", "SoftmaxGrad", "CausalMask", "LayerNorm",
        "LayerNormGrad", "Reshape", "Transpose", "Concat", "Split", "ReduceSum", "MSELoss",
        "MSELossGrad", "SoftmaxCrossEntropy", "SoftmaxCrossEntropyGrad", "Embedding",
        "EmbeddingGrad", "SGD", "Adam", "Send", "AllReduce", "Cast", "CastInto", "Shard",
        "CrossEntropyStats", "CrossEntropyFromStats",
    }  # fmt: skip
    assert expected <= set(registered_op_types())


# --------------------------------------------------------------------------- #
# Gradients against central finite differences of the forward op.


@pytest.mark.parametrize(
    "forward, grad, second",
    [("Relu", "ReluGrad", "x"), ("Gelu", "GeluGrad", "x"), ("Tanh", "TanhGrad", "y")],
)
def test_unary_grad(rng, forward, grad, second):
    x = rng.normal(size=(3, 4)) * 2
    x = np.where(np.abs(x) < 0.1, 0.5, x)  # keep away from Relu's kink
    cot = rng.normal(size=x.shape)
    z = x if second == "x" else run(forward, x)[0]
    (analytic,) = run(grad, cot, z)
    numeric = numeric_grad(lambda u: np.sum(run(forward, u)[0] * cot), x)
    np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_grad(rng, axis):
    x = rng.normal(size=(3, 4, 5))
    cot = rng.normal(size=x.shape)
    (y,) = run("Softmax", x, axis=axis)
    (analytic,) = run("SoftmaxGrad", cot, y, axis=axis)
    numeric = numeric_grad(lambda u: np.sum(run("Softmax", u, axis=axis)[0] * cot), x)
    np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL)


def test_causal_mask_is_its_own_grad(rng):
    x = rng.normal(size=(2, 4, 4))
    cot = rng.normal(size=x.shape)
    (analytic,) = run("CausalMask", cot, fill=0.0)
    # A moderate fill: -1e9 would swamp the differences in rounding error; the
    # gradient does not depend on the fill value.
    numeric = numeric_grad(lambda u: np.sum(run("CausalMask", u, fill=-3.0)[0] * cot), x)
    np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL)


def test_layer_norm_grad(rng):
    x, gamma, beta = rng.normal(size=(2, 3, 5)), rng.normal(size=5), rng.normal(size=5)
    cot = rng.normal(size=x.shape)
    dx, dgamma, dbeta = run("LayerNormGrad", cot, x, gamma, eps=1e-3)

    def objective(x_, g_, b_):
        return np.sum(run("LayerNorm", x_, g_, b_, eps=1e-3)[0] * cot)

    np.testing.assert_allclose(dx, numeric_grad(lambda u: objective(u, gamma, beta), x), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        dgamma, numeric_grad(lambda u: objective(x, u, beta), gamma), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        dbeta, numeric_grad(lambda u: objective(x, gamma, u), beta), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("shards", [1, 3])
def test_mse_loss_grad(rng, shards):
    pred, target = rng.normal(size=(4, 3)), rng.normal(size=(4, 3))
    (loss,) = run("MSELoss", pred, target, shards=shards)
    assert loss.shape == ()
    np.testing.assert_allclose(loss, np.sum((pred - target) ** 2) / (4 * shards), rtol=1e-12)
    (analytic,) = run("MSELossGrad", pred, target, shards=shards)
    numeric = numeric_grad(lambda u: run("MSELoss", u, target, shards=shards)[0], pred)
    np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("shards, label_dtype", [(1, np.int64), (2, np.int32)])
def test_softmax_cross_entropy_grad(rng, shards, label_dtype):
    logits = rng.normal(size=(2, 3, 5))
    labels = rng.integers(0, 5, size=(2, 3)).astype(label_dtype)
    (loss,) = run("SoftmaxCrossEntropy", logits, labels, shards=shards)
    probs = np.exp(logits) / np.sum(np.exp(logits), axis=-1, keepdims=True)
    picked = np.take_along_axis(probs, labels[..., None].astype(np.int64), axis=-1)
    np.testing.assert_allclose(loss, -np.mean(np.log(picked)) / shards, rtol=1e-12)
    (analytic,) = run("SoftmaxCrossEntropyGrad", logits, labels, shards=shards)
    numeric = numeric_grad(lambda u: run("SoftmaxCrossEntropy", u, labels, shards=shards)[0], logits)
    np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL)


def test_embedding_grad_accumulates_repeated_ids(rng):
    table = rng.normal(size=(6, 4))
    ids = np.array([[0, 2, 2], [5, 0, 2]], dtype=np.int32)
    cot = rng.normal(size=(2, 3, 4))
    (out,) = run("Embedding", table, ids)
    np.testing.assert_array_equal(out, table[ids])
    (analytic,) = run("EmbeddingGrad", cot, ids, num_embeddings=6)
    numeric = numeric_grad(lambda u: np.sum(run("Embedding", u, ids)[0] * cot), table)
    np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_vocabulary_parts_rebuild_the_loss_lookup_and_gradients(rng, parts):
    """Megatron-LM's vocabulary parallelism, op by op: each part's lookup is zero outside
    its rows and the parts sum to the whole; every part's statistics, side by side, give
    the whole cross entropy and each part its slice of the gradient; each part's
    embedding gradient is its rows of the whole one."""
    vocab, rows = 8, 8 // parts
    logits = 3 * rng.normal(size=(2, 3, vocab))
    labels = rng.integers(0, vocab, size=(2, 3))
    cut = [slice(r * rows, (r + 1) * rows) for r in range(parts)]
    shard = [dict(vocab_index=r, vocab_parts=parts) for r in range(parts)]
    parts_stats = [
        run("CrossEntropyStats", logits[..., c], labels, **a)[0] for c, a in zip(cut, shard, strict=True)
    ]
    stats = np.concatenate(parts_stats, axis=-1)
    (loss,) = run("CrossEntropyFromStats", stats, shards=2)
    np.testing.assert_allclose(loss, run("SoftmaxCrossEntropy", logits, labels, shards=2)[0], rtol=1e-13)
    (whole,) = run("SoftmaxCrossEntropyGrad", logits, labels, shards=2)
    for c, a in zip(cut, shard, strict=True):
        (part,) = run("SoftmaxCrossEntropyGrad", logits[..., c], labels, stats, shards=2, **a)
        np.testing.assert_allclose(part, whole[..., c], rtol=1e-12, atol=1e-15)
    table, dy = rng.normal(size=(vocab, 4)), rng.normal(size=(2, 3, 4))
    lookups = [run("Embedding", table[c], labels, **a)[0] for c, a in zip(cut, shard, strict=True)]
    np.testing.assert_array_equal(sum(lookups), table[labels])
    (dtable,) = run("EmbeddingGrad", dy, labels, num_embeddings=vocab)
    for c, a in zip(cut, shard, strict=True):
        (part,) = run("EmbeddingGrad", dy, labels, num_embeddings=rows, **a)
        np.testing.assert_array_equal(part, dtable[c])
    # Labels are checked against the whole vocabulary, not the part.
    match = r"CrossEntropyStats: ids must be in \[0, 8\), got values in \[0, 9\]"
    with pytest.raises(ValueError, match=match):
        run("CrossEntropyStats", logits[..., cut[0]], np.array([[0, 9, 1]] * 2), **shard[0])


@pytest.mark.parametrize("batch", [(), (2,)])
def test_matmul_transposes_are_its_grads(rng, batch):
    a, b = rng.normal(size=batch + (3, 4)), rng.normal(size=batch + (4, 5))
    cot = rng.normal(size=batch + (3, 5))
    (da,) = run("MatMul", cot, b, transpose_b=True)
    (db,) = run("MatMul", a, cot, transpose_a=True)
    np.testing.assert_allclose(
        da, numeric_grad(lambda u: np.sum(run("MatMul", u, b)[0] * cot), a), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        db, numeric_grad(lambda u: np.sum(run("MatMul", a, u)[0] * cot), b), rtol=RTOL, atol=ATOL
    )


# --------------------------------------------------------------------------- #
# Forward values.


def test_gelu_matches_jax_tanh_approximation(rng):
    x = rng.normal(size=50) * 3
    (ours,) = run("Gelu", x)
    theirs = np.asarray(jax.nn.gelu(x.astype(np.float32), approximate=True))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_softmax_family_is_stable_for_huge_logits():
    x = np.array([[1000.0, 0.0, -1000.0], [5.0, 5.0, 5.0]])
    (y,) = run("Softmax", x)
    np.testing.assert_allclose(y.sum(axis=-1), 1.0)
    (loss,) = run("SoftmaxCrossEntropy", x, np.array([2, 0]))
    (grad,) = run("SoftmaxCrossEntropyGrad", x, np.array([2, 0]))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(loss, (2000.0 + np.log(3.0)) / 2, rtol=1e-12)


def test_layer_norm_and_causal_mask_values(rng):
    x = rng.normal(size=(3, 8)) * 4 + 2
    (y,) = run("LayerNorm", x, np.ones(8), np.zeros(8))
    np.testing.assert_allclose(y.mean(axis=-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=-1), 1.0, rtol=1e-4)
    (m,) = run("CausalMask", np.zeros((3, 3)))
    np.testing.assert_array_equal(m, [[0, -1e9, -1e9], [0, 0, -1e9], [0, 0, 0]])


def test_layout_ops_match_numpy(rng):
    x = rng.normal(size=(2, 3, 4))
    np.testing.assert_array_equal(run("Reshape", x, shape=(-1, 4))[0], x.reshape(6, 4))
    np.testing.assert_array_equal(run("Transpose", x, perm=(2, 0, 1))[0], x.transpose(2, 0, 1))
    np.testing.assert_array_equal(run("Concat", x, x, axis=1)[0], np.concatenate([x, x], axis=1))
    parts = run("Split", x, axis=2, parts=2)
    np.testing.assert_array_equal(parts[1], x[:, :, 2:])
    np.testing.assert_array_equal(run("ReduceSum", x, axes=(0, 2))[0], x.sum(axis=(0, 2)))
    ids = np.array([[1, 2], [3, 4]], dtype=np.int32)
    (total,) = run("ReduceSum", ids, axes=(1,), keepdims=True)
    assert total.dtype == np.int32 and total.shape == (2, 1)
    assert run("Scale", x, factor=0.5)[0] == pytest.approx(x * 0.5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 3))
def test_reshape_infers_minus_one(dims, position):
    target = list(dims)
    target[position % len(dims)] = -1
    b = FunctionBuilder("f")
    y = b.add("Reshape", b.input("x", dims), shape=tuple(target))
    assert y.type.shape == tuple(dims)


# --------------------------------------------------------------------------- #
# Shape rules through the builder.


def _build(op_type, specs, attrs, device=0):
    b = FunctionBuilder("f")
    vals = [b.input(f"x{i}", shape, dtype, device) for i, (shape, dtype) in enumerate(specs)]
    outs = b.add(op_type, *vals, **attrs)
    return outs if isinstance(outs, tuple) else (outs,)


F, INT, F8 = "f32", "i32", "f8"
GOOD = [
    ("MatMul", [((3, 4), F), ((4, 5), F)], {}, [(3, 5)]),
    ("MatMul", [((2, 4, 3), F), ((5, 4), F)], {"transpose_a": True, "transpose_b": True}, [(2, 3, 5)]),
    ("Add", [((3, 4), F), ((4,), F)], {}, [(3, 4)]),
    ("Exp", [((3, 4), F)], {}, [(3, 4)]),
    ("Tanh", [((3, 4), F)], {}, [(3, 4)]),
    ("TanhGrad", [((3, 4), F), ((3, 4), F)], {}, [(3, 4)]),
    ("Gelu", [((3, 4), F)], {}, [(3, 4)]),
    ("GeluGrad", [((3, 4), F), ((3, 4), F)], {}, [(3, 4)]),
    ("Scale", [((3, 4), F)], {"factor": 0.125}, [(3, 4)]),
    ("Softmax", [((2, 3, 4), F)], {"axis": 1}, [(2, 3, 4)]),
    ("SoftmaxGrad", [((2, 3, 4), F), ((2, 3, 4), F)], {}, [(2, 3, 4)]),
    ("CausalMask", [((2, 5, 5), F)], {}, [(2, 5, 5)]),
    ("LayerNorm", [((2, 3, 8), F), ((8,), F), ((8,), F)], {}, [(2, 3, 8)]),
    ("LayerNormGrad", [((2, 3, 8), F), ((2, 3, 8), F), ((8,), F)], {}, [(2, 3, 8), (8,), (8,)]),
    ("Reshape", [((2, 3, 4), F)], {"shape": (-1, 4)}, [(6, 4)]),
    ("Reshape", [((1, 1), F)], {"shape": ()}, [()]),
    ("Transpose", [((2, 3, 4), F)], {"perm": (2, 0, 1)}, [(4, 2, 3)]),
    ("Concat", [((2, 3), F), ((2, 1), F), ((2, 2), F)], {"axis": -1}, [(2, 6)]),
    ("Split", [((6, 4), F)], {"parts": 3}, [(2, 4)] * 3),
    ("Shard", [((6, 4), F)], {"parts": 3, "index": 2}, [(2, 4)]),
    ("CastInto", [((3, 4), F8), ((3, 4), F)], {}, [(3, 4)]),
    ("Shard", [((7, 4), F)], {"parts": 3, "index": 0, "pad": True}, [(3, 4)]),
    ("Shard", [((2, 6), F)], {"axis": -1, "parts": 2, "index": 1}, [(2, 3)]),
    ("ReduceSum", [((2, 3, 4), F)], {"axes": (0, -1)}, [(3,)]),
    ("ReduceSum", [((2, 3, 4), F)], {"axes": (1,), "keepdims": True}, [(2, 1, 4)]),
    ("MSELoss", [((4, 3), F), ((4, 3), F)], {"shards": 2}, [()]),
    ("MSELossGrad", [((4, 3), F), ((4, 3), F)], {}, [(4, 3)]),
    ("SoftmaxCrossEntropy", [((2, 3, 7), F), ((2, 3), INT)], {}, [()]),
    ("SoftmaxCrossEntropyGrad", [((2, 3, 7), F), ((2, 3), "i64")], {}, [(2, 3, 7)]),
    ("Embedding", [((7, 4), F), ((2, 3), INT)], {}, [(2, 3, 4)]),
    ("EmbeddingGrad", [((2, 3, 4), F), ((2, 3), INT)], {"num_embeddings": 7}, [(7, 4)]),
    ("Embedding", [((7, 4), F), ((2, 3), INT)], {"vocab_index": 2, "vocab_parts": 3}, [(2, 3, 4)]),
    ("CrossEntropyStats", [((2, 3, 7), F), ((2, 3), INT)], {"vocab_index": 1, "vocab_parts": 2}, [(2, 3, 3)]),
    ("CrossEntropyFromStats", [((2, 3, 6), F)], {"shards": 2}, [()]),
    (
        "SoftmaxCrossEntropyGrad",
        [((2, 3, 7), F), ((2, 3), INT), ((2, 3, 6), F)],
        {"vocab_index": 1, "vocab_parts": 2},
        [(2, 3, 7)],
    ),
    ("SGD", [((3, 4), F), ((3, 4), F)], {"lr": 0.1}, [(3, 4)]),
    ("Adam", [((3, 4), F)] * 4, {"lr": 0.1, "step": 3}, [(3, 4)] * 3),
]


@pytest.mark.parametrize("op_type, specs, attrs, expected", GOOD, ids=[g[0] for g in GOOD])
def test_shape_rule_and_evaluate_agree(rng, op_type, specs, attrs, expected):
    outs = _build(op_type, specs, attrs, device=1)
    assert [v.type.shape for v in outs] == expected
    assert all(v.type.device == 1 for v in outs)
    float_dtype = next(d for _, d in specs if d.startswith("f"))
    assert all(v.type.dtype == float_dtype for v in outs)
    arrays = [
        rng.integers(0, 2, size=shape) if dtype.startswith("i") else rng.normal(size=shape)
        for shape, dtype in specs
    ]
    if op_type == "Adam":
        arrays[3] = np.abs(arrays[3])  # a second moment is never negative
    if op_type in ("CrossEntropyFromStats", "SoftmaxCrossEntropyGrad"):
        arrays[-1] = np.abs(arrays[-1])  # statistics hold sums of exponentials
    before = [a.copy() for a in arrays]
    results = run(op_type, *arrays, **attrs)
    assert [np.shape(r) for r in results] == expected
    assert all(np.all(np.isfinite(r)) for r in results)
    for a, b in zip(arrays, before, strict=True):  # evaluate must not mutate its operands
        np.testing.assert_array_equal(a, b)


BAD = [
    ("MatMul", [((3, 4), F), ((5, 6), F)], {}, ["[3, 4]", "[5, 6]"]),
    ("TanhGrad", [((3, 4), F), ((4, 3), F)], {}, ["[3, 4]", "[4, 3]"]),
    ("GeluGrad", [((3,), INT), ((3,), INT)], {}, ["i32"]),
    ("Gelu", [((3,), INT)], {}, ["i32"]),
    ("Scale", [((3,), F)], {}, ["factor"]),
    ("Scale", [((3,), F)], {"factor": "big"}, ["factor='big'"]),
    ("Add", [((1, 4), F), ((8, 4), F)], {"inplace": True}, ["first operand", "[8, 4]", "[1, 4]"]),
    ("Add", [((4,), F), ((8, 4), F)], {"inplace": True}, ["first operand", "[8, 4]", "[4]"]),
    ("Cast", [((3,), F)], {}, ["Cast", "dtype=None"]),
    ("Cast", [((3,), F)], {"dtype": "i32"}, ["dtype='i32'", "bf16"]),
    ("Cast", [((3,), INT)], {"dtype": "f32"}, ["Cast's operand", "i32"]),
    ("CastInto", [((3, 4), F), ((4, 3), F)], {}, ["CastInto", "[3, 4]", "[4, 3]"]),
    ("CastInto", [((3,), INT), ((3,), F)], {}, ["destination", "i32"]),
    ("MatMul", [((3, 4), F8), ((4, 5), F8)], {"fp8": True}, ["f8, f8"]),
    ("MatMul", [((3, 4), F8), ((4, 5), F8)], {"fp8": True, "dtype": "f8"}, ["wider than f8"]),
    ("Softmax", [((3, 4), F)], {"axis": 2}, ["axis 2"]),
    ("SoftmaxGrad", [((3, 4), F), ((3, 5), F)], {}, ["[3, 4]", "[3, 5]"]),
    ("CausalMask", [((2, 3, 4), F)], {}, ["[2, 3, 4]"]),
    ("LayerNorm", [((3, 4), F), ((5,), F), ((4,), F)], {}, ["gamma", "[5]", "[3, 4]"]),
    ("LayerNorm", [((3, 4), F), ((4,), F), ((4,), F)], {"eps": -1.0}, ["eps"]),
    ("LayerNormGrad", [((3, 5), F), ((3, 4), F), ((4,), F)], {}, ["[3, 5]", "[3, 4]"]),
    ("Reshape", [((4, 6), F)], {"shape": (5, -1)}, ["(5, -1)", "[4, 6]"]),
    ("Reshape", [((4, 6), F)], {"shape": (5, 5)}, ["(5, 5)", "[4, 6]"]),
    ("Reshape", [((4, 6), F)], {"shape": (-1, -1)}, ["(-1, -1)"]),
    ("Transpose", [((4, 6), F)], {"perm": (0, 0)}, ["perm=(0, 0)", "[4, 6]"]),
    ("Transpose", [((4, 6), F)], {}, ["perm"]),
    ("Concat", [((2, 3), F), ((3, 3), F)], {"axis": 1}, ["[2, 3] and [3, 3]"]),
    ("Split", [((5, 4), F)], {"parts": 2}, ["parts=2", "[5, 4]"]),
    ("Split", [((4, 4), F)], {"parts": 0}, ["parts"]),
    ("Shard", [((4, 4), F)], {"index": 0}, ["Shard needs attribute parts"]),
    ("Shard", [((4, 4), F)], {"parts": 2, "index": 2}, ["index must be in [0, 1]", "index=2"]),
    ("Shard", [((5, 4), F)], {"parts": 2, "index": 0}, ["size 5 is not divisible by 2", "pad=True"]),
    ("ReduceSum", [((2, 3), F)], {"axes": (0, 0)}, ["axes"]),
    ("ReduceSum", [((2, 3), F)], {"axes": (3,)}, ["axis 3"]),
    ("MSELoss", [((3, 4), F), ((3, 5), F)], {}, ["[3, 4]", "[3, 5]"]),
    ("MSELoss", [((3, 4), F), ((3, 4), F)], {"shards": 0}, ["shards"]),
    ("SoftmaxCrossEntropy", [((2, 3, 5), F), ((2, 3), F)], {}, ["labels", "f32"]),
    ("SoftmaxCrossEntropy", [((2, 3, 5), F), ((2, 4), INT)], {}, ["[2, 3]", "[2, 4]"]),
    ("SoftmaxCrossEntropyGrad", [((5,), INT), ((), INT)], {}, ["logits", "i32"]),
    ("Embedding", [((2, 3, 4), F), ((2,), INT)], {}, ["[2, 3, 4]"]),
    ("Embedding", [((6, 4), F), ((2,), F)], {}, ["ids", "f32"]),
    ("EmbeddingGrad", [((2, 4), F), ((2,), INT)], {}, ["num_embeddings"]),
    ("Embedding", [((6, 4), F), ((2,), INT)], {"vocab_index": 2, "vocab_parts": 2}, ["vocab_index", "[0,"]),
    ("CrossEntropyStats", [((2, 7), F), ((2,), INT)], {"vocab_parts": 0}, ["vocab_parts", ">= 1"]),
    ("SoftmaxCrossEntropyGrad", [((2, 7), F), ((2,), INT)], {"vocab_parts": 2}, ["vocab_parts=2", "third"]),
    ("SoftmaxCrossEntropyGrad", [((2, 7), F), ((2,), INT), ((2, 4), F)], {}, ["statistics", "[2, 4]"]),
    ("SoftmaxCrossEntropy", [((2, 7), F), ((2,), INT), ((2, 6), F)], {}, ["2 operands", "got 3"]),
    ("CrossEntropyFromStats", [((2, 5), F)], {}, ["statistics", "[2, 5]"]),
    ("CrossEntropyFromStats", [((2, 0), F)], {}, ["statistics", "[2, 0]"]),
    (
        "SoftmaxCrossEntropyGrad",
        [((2, 7), F), ((2,), INT), ((2, 3), F)],
        {"vocab_parts": 2},
        ["statistics", "6 (vocab_parts=2)", "[2, 3]"],
    ),
    ("SoftmaxCrossEntropy", [((2, 7), F), ((2,), INT)], {"vocab_parts": 2}, ["whole vocabulary"]),
    ("EmbeddingGrad", [((2, 4), F), ((3,), INT)], {"num_embeddings": 5}, ["[2, 4]", "[3]"]),
    ("SGD", [((3, 4), F), ((4, 3), F)], {"lr": 0.1}, ["[3, 4]", "[4, 3]"]),
    ("SGD", [((3, 4), F), ((3, 4), F)], {}, ["lr"]),
    ("Adam", [((3, 4), F)] * 3 + [((4, 3), F)], {"lr": 0.1}, ["[3, 4]", "[4, 3]"]),
    ("Adam", [((3, 4), F)] * 4, {}, ["lr"]),
    ("Adam", [((3, 4), F)] * 4, {"lr": 0.1, "beta1": 1.0}, ["beta1"]),
    ("Adam", [((3, 4), F)] * 4, {"lr": 0.1, "step": 0}, ["step"]),
]


@pytest.mark.parametrize("op_type, specs, attrs, fragments", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(op_type, specs, attrs, fragments):
    with pytest.raises(ValueError) as info:
        _build(op_type, specs, attrs)
    message = str(info.value)
    assert message.startswith(f"op #0 {op_type}:"), message
    # The rule's own words must name the problem; the operand list that type
    # inference appends would otherwise satisfy any shape fragment.
    own_words = message.split(" (operands:")[0]
    for fragment in fragments:
        assert fragment in own_words, message


def test_operands_on_two_devices_are_rejected():
    b = FunctionBuilder("f")
    x, gamma, beta = b.input("x", (2, 4)), b.input("g", (4,), device=1), b.input("b", (4,))
    with pytest.raises(ValueError, match="one device"):
        b.add("LayerNorm", x, gamma, beta)


def test_bad_ids_raise_at_evaluate():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        run("Embedding", np.zeros((3, 2)), np.array([0, 3]))
    with pytest.raises(ValueError, match="labels"):
        run("SoftmaxCrossEntropy", np.zeros((2, 3)), np.array([0, -1]))


# --------------------------------------------------------------------------- #
# Size variants: one inference gives per-variant shapes and feature vectors.

BATCH = np.array([2, 4, 8])


def _per_variant_features_match(op_type, in_types, concrete_types, **attrs):
    outs, feats = features(op_type, in_types, **attrs)
    for k in range(len(BATCH)):
        _, concrete = features(op_type, concrete_types(int(BATCH[k])), **attrs)
        for field in dataclasses.fields(concrete):
            if field.name != "is_comm":
                vector = np.broadcast_to(getattr(feats, field.name), BATCH.shape)
                assert vector[k] == pytest.approx(getattr(concrete, field.name))
    return outs, feats


def test_reshape_minus_one_absorbs_variants():
    b = FunctionBuilder("f")
    y = b.add("Reshape", b.input("x", (BATCH, 3, 8)), shape=(-1, 8))
    np.testing.assert_array_equal(y.type.shape[0], BATCH * 3)
    assert y.type.shape[1] == 8
    with pytest.raises(ValueError, match="Reshape"):
        b.add("Reshape", b.input("z", (BATCH, 3)), shape=(6, 4))


def test_matmul_with_variant_batch():
    in_types = (TensorType((BATCH, 16)), TensorType((16, 8)))
    outs, feats = _per_variant_features_match(
        "MatMul", in_types, lambda n: (TensorType((n, 16)), TensorType((16, 8)))
    )
    np.testing.assert_array_equal(outs[0].shape[0], BATCH)
    assert isinstance(feats.flops, np.ndarray)
    np.testing.assert_array_equal(feats.flops, 2 * BATCH * 8 * 16)
    np.testing.assert_array_equal(feats.mem_bytes, 4 * (BATCH * 16 + 16 * 8 + BATCH * 8))


def test_layer_norm_with_variant_batch():
    h = (TensorType((8,)), TensorType((8,)))
    outs, feats = _per_variant_features_match(
        "LayerNorm", (TensorType((BATCH, 8)),) + h, lambda n: (TensorType((n, 8)),) + h
    )
    np.testing.assert_array_equal(outs[0].shape[0], BATCH)
    assert isinstance(feats.mem_bytes, np.ndarray)
    np.testing.assert_array_equal(feats.mem_bytes, 4 * (2 * BATCH * 8 + 16))
    grads, _ = _per_variant_features_match(
        "LayerNormGrad",
        (TensorType((BATCH, 8)), TensorType((BATCH, 8)), h[0]),
        lambda n: (TensorType((n, 8)), TensorType((n, 8)), h[0]),
    )
    assert [g.shape[-1] for g in grads] == [8, 8, 8]


def test_other_ops_with_variant_batch():
    x = TensorType((BATCH, 6, 16))
    (loss,), _ = _per_variant_features_match(
        "SoftmaxCrossEntropy",
        (x, TensorType((BATCH, 6), "i32")),
        lambda n: (TensorType((n, 6, 16)), TensorType((n, 6), "i32")),
    )
    assert loss.shape == ()
    parts, _ = features("Split", (x,), axis=0, parts=2)
    np.testing.assert_array_equal(parts[0].shape[0], BATCH // 2)
    (cat,), _ = features("Concat", (x, x), axis=0)
    np.testing.assert_array_equal(cat.shape[0], 2 * BATCH)
    with pytest.raises(ValueError, match="not divisible"):
        features("Split", (TensorType((np.array([2, 3]), 4)),), axis=0, parts=2)


# --------------------------------------------------------------------------- #
# Optimizers.


def test_sgd_numerics_and_alias(rng):
    w, g = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    (new_w,) = run("SGD", w, g, lr=0.05)
    np.testing.assert_allclose(new_w, w - 0.05 * g, rtol=1e-15)
    # Mixed precision: the update runs on the master copy, and the weight is written from it.
    master = rng.normal(size=(3, 4))
    new_w, new_master = run("SGD", w, g, master, lr=0.05)
    np.testing.assert_allclose(new_master, master - 0.05 * g, rtol=1e-15)
    np.testing.assert_array_equal(new_w, new_master)
    assert get_spec("SGD").aliases == ((0, 0), (1, 2))


def test_adam_numerics_over_steps_and_aliases(rng):
    lr, b1, b2, eps = 0.01, 0.8, 0.95, 1e-6
    w = rng.normal(size=(3, 4))
    m, v = np.zeros_like(w), np.zeros_like(w)
    ref_w, ref_m, ref_v = w.copy(), m.copy(), v.copy()
    for step in range(1, 4):
        g = rng.normal(size=w.shape)
        w, m, v = run("Adam", w, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, step=step)
        # Hand-written Adam (Kingma & Ba, Algorithm 1).
        ref_m = b1 * ref_m + (1 - b1) * g
        ref_v = b2 * ref_v + (1 - b2) * g**2
        m_hat, v_hat = ref_m / (1 - b1**step), ref_v / (1 - b2**step)
        ref_w = ref_w - lr * m_hat / (np.sqrt(v_hat) + eps)
        np.testing.assert_allclose(w, ref_w, rtol=1e-12)
        np.testing.assert_allclose(m, ref_m, rtol=1e-12)
        np.testing.assert_allclose(v, ref_v, rtol=1e-12)
    # Mixed precision: the same update on the master copy; the weight is written from it.
    master = ref_w.copy()
    g = rng.normal(size=w.shape)
    plain = run("Adam", ref_w, g, ref_m, ref_v, lr=lr, beta1=b1, beta2=b2, eps=eps, step=4)
    mixed = run(
        "Adam", rng.normal(size=w.shape), g, ref_m, ref_v, master, lr=lr, beta1=b1, beta2=b2, eps=eps, step=4
    )
    for got, want in zip(mixed, plain + (plain[0],), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-15)
    assert get_spec("Adam").aliases == ((0, 0), (1, 2), (2, 3), (3, 4))


def test_adam_features_count_weight_elements():
    t = TensorType((10, 10))
    _, feats = features("Adam", (t,) * 4, lr=0.1)
    assert feats.mem_bytes == 7 * 400
    assert feats.flops == 14 * 100
    # Mixed precision: bf16 weight and gradient, f32 moments and master. The weight is
    # written, not read: g, m, v, master in; w, m, v, master out.
    half, wide = TensorType((10, 10), "bf16"), TensorType((10, 10), "f32")
    outs, feats = features("Adam", (half, half, wide, wide, wide), lr=0.1)
    assert [o.dtype for o in outs] == ["bf16", "f32", "f32", "f32"]
    assert feats.mem_bytes == (2 + 3 * 4 + 2 + 3 * 4) * 100
    assert feats.flops == 14 * 100
    outs, feats = features("SGD", (half, half, wide), lr=0.1)
    assert [o.dtype for o in outs] == ["bf16", "f32"] and feats.mem_bytes == (2 + 4 + 2 + 4) * 100
    assert feats.flops == 2 * 100
    # Precision "mixed": the gradient is f32 too, and read as such.
    outs, feats = features("Adam", (half, wide, wide, wide, wide), lr=0.1)
    assert [o.dtype for o in outs] == ["bf16", "f32", "f32", "f32"]
    assert feats.mem_bytes == (4 + 3 * 4 + 2 + 3 * 4) * 100


@pytest.mark.parametrize("inplace", [False, True])
def test_in_place_add_and_reduce_scatter_allocate_nothing(inplace):
    """``inplace=True`` writes an Add into its first operand (a gradient into its running
    sum) and a ReduceScatter's parts into their operands (ZeRO's gradient buffers): the
    operand's buffer lives on in the result, and no new one is allocated."""
    import distir_jax as dj
    from distir_jax.executor.reference import reference_peak_memory
    from distir_jax.ir.registry import output_aliases

    b = dj.FunctionBuilder("sums")
    x = [b.input(f"x{d}", (8, 4), device=d) for d in (0, 1)]  # 128 bytes each, resident
    y = [b.add("Relu", v) for v in x]  # +128 a device
    z = [b.add("Relu", v) for v in x]  # +128 a device
    s = [b.add("Add", y[d], z[d], inplace=inplace) for d in (0, 1)]  # +128 unless in place
    parts = b.add("ReduceScatter", *s, axis=0, inplace=inplace)  # +64 unless in place
    fn = b.build(*[b.add("Relu", part) for part in parts])  # +64 a device
    assert output_aliases(get_spec("Add"), {"inplace": inplace}, 1) == ({0: 0} if inplace else {})
    assert output_aliases(get_spec("ReduceScatter"), {"inplace": inplace}, 2) == (
        {0: 0, 1: 1} if inplace else {}
    )
    # The peak is at the Add: x + y + z (+ s unless in place). In place the sum lives on
    # through the ReduceScatter (x + s + 64 at the last Relu, below that).
    want = 128 + (128 + 128 if inplace else 3 * 128)
    assert reference_peak_memory(fn) == {0: want, 1: want}
    topology = dj.Topology.uniform(2)
    result = dj.simulate(dj.lower(fn, topology), dj.Hardware.from_topology(topology))
    np.testing.assert_array_equal(np.asarray(result.peak_memory), [[want, want]])


def test_cast_into_refreshes_its_destination_in_place():
    """``CastInto(dest, x)``: ``x`` in ``dest``'s dtype, written into ``dest``'s buffer
    (mixed-fp8's resident FP8 weight copies, refreshed from the weight): no new
    allocation, and no time (its features are zero). An FP8 MatMul then reads two
    f8 operands, its result in attribute ``dtype``."""
    import distir_jax as dj
    from distir_jax.executor.reference import reference_peak_memory
    from distir_jax.ir.registry import op_features, output_aliases

    b = dj.FunctionBuilder("refresh")
    x = b.input("x", (4, 8), "bf16")  # 64 bytes
    w = b.input("w", (8, 16), "bf16")  # 256 bytes
    copy = b.input("w.fp8", (8, 16), "f8")  # 128 bytes, resident
    x8 = b.add("Cast", x, dtype="f8")  # +32
    y = b.add("MatMul", x8, copy, fp8=True, dtype="bf16")  # +128: [4, 16] bf16
    new = b.add("CastInto", copy, w)  # in place: +0
    fn = b.build(y, new)
    assert y.type.dtype == "bf16" and new.type == copy.type
    assert output_aliases(get_spec("CastInto"), {}, 1) == {0: 0}
    assert reference_peak_memory(fn) == {0: 64 + 256 + 128 + 32 + 128}
    features = op_features(fn.ops[-1])
    assert (features.flops, features.mem_bytes, features.launches) == (0.0, 0.0, 0)
    (value,) = run("CastInto", np.zeros((2, 3)), np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(value, np.arange(6.0).reshape(2, 3))


def test_shard_is_a_padded_view():
    """Part ``index`` of ``parts`` along ``axis``; with pad=True the parts are those of
    the value padded with zero rows to a multiple (ZeRO's last shard ends in zeros)."""
    x = np.arange(14.0).reshape(7, 2)
    (last,) = run("Shard", x, parts=3, index=2, pad=True)
    np.testing.assert_array_equal(last, [[12.0, 13.0], [0.0, 0.0], [0.0, 0.0]])
    (first,) = run("Shard", x, parts=3, index=0, pad=True)
    np.testing.assert_array_equal(first, x[:3])
    assert not np.shares_memory(first, x)  # executors never hand out views
    outs, feats = features("Shard", (TensorType((7, 2), "f32", 0),), parts=3, index=1, pad=True)
    assert outs == (TensorType((3, 2), "f32", 0),)
    assert all(value == 0 for value in feats.cost_features().values())  # not even a launch


@pytest.mark.parametrize("inplace", [False, True])
def test_shard_update_and_in_place_all_gather_allocate_nothing(inplace):
    """ZeRO's weight update: each device updates its shard of the weight (a ``Shard``
    view) in place and all-gathers the shards; with ``inplace=True`` into the weight's
    own buffer, else into a new one next to it."""
    import distir_jax as dj
    from distir_jax.executor import execute
    from distir_jax.executor.reference import reference_peak_memory

    b = dj.FunctionBuilder("zero_update")
    w = [b.input(f"w{d}", (8, 4), device=d) for d in (0, 1)]  # 128 bytes each, resident
    g = [b.input(f"g{d}", (4, 4), device=d) for d in (0, 1)]  # 64 bytes each, resident
    shards = [b.add("Shard", w[d], parts=2, index=d) for d in (0, 1)]  # views
    new = [b.add("Add", shards[d], g[d], inplace=True) for d in (0, 1)]  # into the views
    gathered = b.add("AllGather", *new, axis=0, inplace=inplace)  # +128 unless in place
    fn = b.build(*[b.add("Relu", v) for v in gathered])  # +128 a device
    want = 128 + 64 + (128 if inplace else 2 * 128)
    assert reference_peak_memory(fn) == {0: want, 1: want}
    topology = dj.Topology.uniform(2)
    result = dj.simulate(dj.lower(fn, topology), dj.Hardware.from_topology(topology))
    np.testing.assert_array_equal(np.asarray(result.peak_memory), [[want, want]])
    rng = np.random.default_rng(0)
    arrays = {f"{n}{d}": rng.normal(size=(8 if n == "w" else 4, 4)) for n in "wg" for d in (0, 1)}
    out = execute(fn, arrays)
    updated = np.concatenate([arrays["w0"][:4] + arrays["g0"], arrays["w1"][4:] + arrays["g1"]])
    for v in fn.outputs:
        np.testing.assert_array_equal(out[v.name], np.maximum(updated, 0.0))


def test_in_place_result_larger_than_its_buffer_is_an_error():
    """An in-place AllGather of values that are not views of a whole-sized buffer
    would write past them: both memory models refuse it, naming the op and sizes."""
    import distir_jax as dj
    from distir_jax.executor.reference import reference_peak_memory

    b = dj.FunctionBuilder("overflow")
    parts = [b.input(f"p{d}", (4, 4), device=d) for d in (0, 1)]
    gathered = b.add("AllGather", *parts, axis=0, inplace=True, names=("w0", "w1"))
    fn = b.build(*gathered)
    match = r"AllGather op writing %w0 \(128 bytes\) in place shares the buffer of %p0 \(64 bytes\)"
    with pytest.raises(ValueError, match=match):
        reference_peak_memory(fn)
    with pytest.raises(ValueError, match=match):
        dj.lower(fn, dj.Topology.uniform(2))


def test_cast_changes_only_the_dtype():
    # Data movement: each element read in one dtype and written in the other, no flops.
    outs, feats = features("Cast", (TensorType((10, 10), "bf16", 3),), dtype="f32")
    assert outs == (TensorType((10, 10), "f32", 3),)
    assert feats.mem_bytes == (2 + 4) * 100 and feats.flops == 0
    x = np.random.default_rng(0).normal(size=(3, 4))
    (y,) = run("Cast", x, dtype="bf16")
    np.testing.assert_array_equal(y, x)  # executors run floats in float64
    assert y is not x


@pytest.mark.parametrize(
    "op_type, types, match",
    [
        # f32 moments for a bf16 weight need its f32 master copy.
        ("Adam", ("bf16", "bf16", "f32", "f32"), "need its master copy"),
        ("Adam", ("bf16", "bf16", "f32", "f32", "bf16"), "share one dtype"),
        # A gradient in the weight's dtype, or with a master copy in the master's.
        (
            "Adam",
            ("bf16", "f16", "f32", "f32", "f32"),
            "gradient is f16; expected its weight's dtype bf16 or",
        ),
        ("Adam", ("f32", "bf16", "f32", "f32"), "gradient is bf16; expected its weight's dtype f32$"),
        ("SGD", ("bf16", "f32"), "gradient is f32; expected its weight's dtype bf16$"),
        ("Adam", ("f32",) * 3, "optionally an f32 master copy"),
        ("SGD", ("bf16", "bf16", "f32", "f32"), "optionally an f32 master copy"),
        ("SGD", ("bf16", "bf16", "i32"), "float dtype"),
    ],
)
def test_optimizer_operand_errors(op_type, types, match):
    with pytest.raises(ValueError, match=match):
        features(op_type, tuple(TensorType((4, 4), d) for d in types), lr=0.1)
