"""Sequential executor tests: multi-device programs against plain NumPy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distir_jax.executor import execute
from distir_jax.ir import Function, FunctionBuilder, Op, TensorType, Value, registry


@pytest.fixture
def rng():
    return np.random.default_rng(1)


def _all_finite(values):
    return all(np.all(np.isfinite(v)) for v in values.values() if np.issubdtype(v.dtype, np.floating))


def test_two_device_communication(rng):
    b = FunctionBuilder("comm")
    x0, x1 = b.input("x0", (4, 6), device=0), b.input("x1", (4, 6), device=1)
    sent = b.add("Send", x0, to=1, names="sent")
    results = [
        sent,
        b.add("AllReduce", x0, x1, names=("ar0", "ar1")),
        b.add("AllGather", x0, x1, axis=0, names=("ag0", "ag1")),
        b.add("ReduceScatter", x0, x1, axis=1, names=("rs0", "rs1")),
        b.add("Scatter", x0, devices=(0, 1), axis=0, names=("sc0", "sc1")),
        b.add("Gather", x0, x1, to=0, axis=1, names="ga"),
        b.add("Broadcast", x1, devices=(0, 1), names=("bc0", "bc1")),
        b.add("AllToAll", x0, x1, split_axis=0, concat_axis=1, names=("aa0", "aa1")),
        b.add("Add", sent, x1, names="mixed"),  # both on device 1 after the Send
    ]
    fn = b.build(*results)

    a0, a1 = rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    out = execute(fn, {"x0": a0, "x1": a1})
    expected = {
        "sent": a0,
        "ar0": a0 + a1,
        "ar1": a0 + a1,
        "ag0": np.concatenate([a0, a1]),
        "ag1": np.concatenate([a0, a1]),
        "rs0": (a0 + a1)[:, :3],
        "rs1": (a0 + a1)[:, 3:],
        "sc0": a0[:2],
        "sc1": a0[2:],
        "ga": np.concatenate([a0, a1], axis=1),
        "bc0": a1,
        "bc1": a1,
        "aa0": np.concatenate([a0[:2], a1[:2]], axis=1),
        "aa1": np.concatenate([a0[2:], a1[2:]], axis=1),
        "mixed": a0 + a1,
    }
    assert set(out) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(out[name], want, rtol=1e-15, err_msg=name)
    assert _all_finite(out)


def test_padded_reduce_scatter_and_trimmed_all_gather(rng):
    """ZeRO's collectives for rows a group does not divide: the sum padded with zero
    rows to a multiple, split; the gathered parts' first ``size`` rows."""
    from distir_jax.ir import get_spec

    b = FunctionBuilder("padded")
    xs = [b.input(f"x{i}", (7, 2), device=i) for i in range(3)]
    parts = b.add("ReduceScatter", *xs, axis=0, pad=True, names=("p0", "p1", "p2"))
    assert [v.type.shape for v in parts] == [(3, 2)] * 3  # ceil(7 / 3) rows each
    whole = b.add("AllGather", *parts, axis=0, size=7, names=("w0", "w1", "w2"))
    assert [v.type.shape for v in whole] == [(7, 2)] * 3
    arrays = {f"x{i}": rng.normal(size=(7, 2)) for i in range(3)}
    out = execute(b.build(*parts, *whole), arrays)
    total = sum(arrays.values())
    padded = np.concatenate([total, np.zeros((2, 2))])
    for i in range(3):
        np.testing.assert_array_equal(out[f"p{i}"], padded[3 * i : 3 * i + 3])
        np.testing.assert_array_equal(out[f"w{i}"], total)
    # The ring moves the padded sum: 9 rows, not 7; the gather its 3-row parts.
    rs, ag = (get_spec(t) for t in ("ReduceScatter", "AllGather"))
    types = [tuple(v.type for v in values) for values in (xs, parts, whole)]
    assert rs.features({"axis": 0, "pad": True}, types[0], types[1]).comm_volume == pytest.approx(
        2 / 3 * 9 * 2 * 4
    )
    assert ag.features({"axis": 0, "size": 7}, types[1], types[2]).comm_volume == 2 * 3 * 2 * 4
    # Without pad=True an indivisible dimension is an error that says how to pad.
    with pytest.raises(ValueError, match=r"size 7 is not divisible by 3 \(pad=True pads it"):
        b.add("ReduceScatter", *xs, axis=0)
    with pytest.raises(ValueError, match=r"AllGather's size must be an int in \[1, 9\], got 10"):
        b.add("AllGather", *parts, axis=0, size=10)


def _mlp_step(b, x, t, w1, w2, shards=1):
    """Forward and backward of a two-layer MLP; returns ``(loss, dw1, dw2)``."""
    h = b.add("MatMul", x, w1)
    a = b.add("Relu", h)
    y = b.add("MatMul", a, w2)
    loss = b.add("MSELoss", y, t, shards=shards)
    dy = b.add("MSELossGrad", y, t, shards=shards)
    dw2 = b.add("MatMul", a, dy, transpose_a=True)
    da = b.add("MatMul", dy, w2, transpose_b=True)
    dh = b.add("ReluGrad", da, h)
    dw1 = b.add("MatMul", x, dh, transpose_a=True)
    return loss, dw1, dw2


def test_mlp_training_step_matches_numpy(rng):
    b = FunctionBuilder("mlp")
    x, t = b.input("x", (8, 3)), b.input("t", (8, 2))
    w1, w2 = b.input("w1", (3, 5)), b.input("w2", (5, 2))
    loss, dw1, dw2 = _mlp_step(b, x, t, w1, w2)
    new_w1 = b.add("SGD", w1, dw1, lr=0.1, names="new_w1")
    new_w2 = b.add("SGD", w2, dw2, lr=0.1, names="new_w2")
    fn = b.build(loss, new_w1, new_w2)
    data = {k: rng.normal(size=s) for k, s in [("x", (8, 3)), ("t", (8, 2)), ("w1", (3, 5)), ("w2", (5, 2))]}
    out = execute(fn, data)

    h = data["x"] @ data["w1"]
    a = np.maximum(h, 0)
    y = a @ data["w2"]
    dy = 2 * (y - data["t"]) / 8
    g2 = a.T @ dy
    g1 = data["x"].T @ ((dy @ data["w2"].T) * (h > 0))
    np.testing.assert_allclose(out[loss.name], np.sum((y - data["t"]) ** 2) / 8, rtol=1e-13)
    np.testing.assert_allclose(out["new_w1"], data["w1"] - 0.1 * g1, rtol=1e-13)
    np.testing.assert_allclose(out["new_w2"], data["w2"] - 0.1 * g2, rtol=1e-13)
    assert _all_finite(out)


def test_data_parallel_shards_reproduce_the_global_step(rng):
    """Two replicas with shards=2 and an AllReduce equal one device's step."""
    shapes = {"x": (8, 3), "t": (8, 2), "w1": (3, 5), "w2": (5, 2)}
    data = {k: rng.normal(size=s) for k, s in shapes.items()}

    single = FunctionBuilder("single")
    ins = {k: single.input(k, s) for k, s in shapes.items()}
    loss, dw1, dw2 = _mlp_step(single, ins["x"], ins["t"], ins["w1"], ins["w2"])
    ref = execute(single.build(loss, dw1, dw2), data)

    dp = FunctionBuilder("dp")
    replicas = []
    for d in (0, 1):
        x = dp.input(f"x{d}", (4, 3), device=d)
        t = dp.input(f"t{d}", (4, 2), device=d)
        w1, w2 = dp.input(f"w1_{d}", (3, 5), device=d), dp.input(f"w2_{d}", (5, 2), device=d)
        replicas.append(_mlp_step(dp, x, t, w1, w2, shards=2))
    losses = dp.add("AllReduce", *(r[0] for r in replicas))
    g1 = dp.add("AllReduce", *(r[1] for r in replicas))
    g2 = dp.add("AllReduce", *(r[2] for r in replicas))
    dp_inputs = {}
    for d in (0, 1):
        rows = slice(4 * d, 4 * d + 4)
        dp_inputs.update({f"x{d}": data["x"][rows], f"t{d}": data["t"][rows]})
        dp_inputs.update({f"w1_{d}": data["w1"], f"w2_{d}": data["w2"]})
    out = execute(dp.build(losses[1], g1[0], g2[1]), dp_inputs)
    got = list(out.values())
    for value, want in zip(got, ref.values(), strict=True):
        np.testing.assert_allclose(value, want, rtol=1e-12)


def test_untyped_function_is_inferred_and_return_all(rng):
    x = Value("x", TensorType((2, 3)))
    fn = Function(
        "f",
        (x,),
        (
            Op("Tanh", (Value("x"),), (Value("y"),)),
            Op("Scale", (Value("y"),), (Value("z"),), {"factor": 2.0}),
        ),
        (Value("z"),),
    )
    a = rng.normal(size=(2, 3))
    out = execute(fn, {"x": a})
    assert list(out) == ["z"]
    np.testing.assert_allclose(out["z"], 2 * np.tanh(a))
    everything = execute(fn, {"x": a}, return_all=True)
    assert list(everything) == ["x", "y", "z"]


def test_integer_inputs_stay_integer_and_inputs_are_not_mutated(rng):
    b = FunctionBuilder("emb")
    table, ids = b.input("table", (5, 3)), b.input("ids", (2, 4), dtype="i32")
    emb = b.add("Embedding", table, ids)
    dtable = b.add("EmbeddingGrad", emb, ids, num_embeddings=5)
    fn = b.build(emb, dtable)
    table_data = rng.normal(size=(5, 3)).astype(np.float32)
    id_data = rng.integers(0, 5, size=(2, 4))
    before = (table_data.copy(), id_data.copy())
    out = execute(fn, {"table": table_data, "ids": id_data}, return_all=True)
    assert out["ids"].dtype == np.int32
    assert out[emb.name].dtype == np.float64  # floats run in float64
    np.testing.assert_array_equal(out[emb.name], table_data.astype(np.float64)[id_data])
    np.testing.assert_array_equal(table_data, before[0])
    np.testing.assert_array_equal(id_data, before[1])


def _tiny():
    b = FunctionBuilder("tiny")
    x = b.input("x", (3, 4))
    return b.build(b.add("Relu", x))


def test_missing_input():
    with pytest.raises(ValueError, match="no value given for input %x"):
        execute(_tiny(), {})


def test_wrong_shape():
    with pytest.raises(ValueError, match=r"%x: expected shape \[3, 4\].*found shape \[4, 3\]"):
        execute(_tiny(), {"x": np.zeros((4, 3))})


def test_unknown_input_name():
    with pytest.raises(ValueError, match="no input named %y"):
        execute(_tiny(), {"x": np.zeros((3, 4)), "y": np.zeros(2)})


def test_float_data_for_integer_input():
    b = FunctionBuilder("ids")
    ids = b.input("ids", (3,), dtype="i64")
    fn = b.build(b.add("Embedding", b.input("table", (4, 2)), ids))
    with pytest.raises(ValueError, match="%ids: declared i64"):
        execute(fn, {"ids": np.zeros(3), "table": np.zeros((4, 2))})


def test_size_variant_dims_are_rejected():
    b = FunctionBuilder("variants")
    x = b.input("x", (np.array([2, 4]), 4))
    fn = b.build(b.add("Relu", x))
    with pytest.raises(ValueError, match="size-variant"):
        execute(fn, {"x": np.zeros((2, 4))})


def test_op_disagreeing_with_its_shape_rule_is_reported(monkeypatch):
    spec = registry.get_spec("Relu")
    broken = dataclasses.replace(spec, evaluate=lambda attrs, inputs: (inputs[0][:1],))
    monkeypatch.setitem(registry._REGISTRY, "Relu", broken)
    with pytest.raises(RuntimeError, match=r"op #0 Relu .*shape \[1, 4\]"):
        execute(_tiny(), {"x": np.zeros((3, 4))})
