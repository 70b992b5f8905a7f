"""Every way a program can be ill-formed gets a ValueError that names the op."""

import numpy as np
import pytest

from distir_jax.ir import Function, Op, TensorType, Value, infer_types


def t(*shape, device=0, dtype="f32"):
    return TensorType(shape, dtype, device)


def fn_of(inputs, ops, outputs):
    return Function("f", tuple(inputs), tuple(ops), tuple(Value(n) for n in outputs))


X = Value("x", t(4, 8))
W = Value("w", t(8, 16))
W_D1 = Value("w1", t(8, 16, device=1))


@pytest.mark.parametrize(
    "program, pattern",
    [
        (
            fn_of([X, W], [Op("MatMul", (W, X), (Value("y"),))], ["y"]),
            r"op #0 MatMul \(-> %y\): contraction dims differ.*\[8, 16\].*\[4, 8\]",
        ),
        (fn_of([X], [Op("Relu", (Value("z"),), (Value("y"),))], ["y"]), r"op #0 Relu.*%z is never defined"),
        (
            fn_of([X], [Op("Relu", (Value("b"),), (Value("a"),)), Op("Relu", (X,), (Value("b"),))], ["a"]),
            r"op #0 Relu.*%b is used before it is defined \(by op #1\)",
        ),
        (
            fn_of(
                [X],
                [Op("Relu", (Value("b"),), (Value("a"),)), Op("Relu", (Value("a"),), (Value("b"),))],
                ["a"],
            ),
            r"op #0 Relu.*cycle",
        ),
        (
            fn_of([X, W_D1], [Op("MatMul", (X, W_D1), (Value("y"),))], ["y"]),
            r"op #0 MatMul.*one device.*%x on d0, %w1 on d1.*Send",
        ),
        (
            fn_of([X], [Op("Frobnicate", (X,), (Value("y"),))], ["y"]),
            r"op #0 Frobnicate.*unknown op type 'Frobnicate'",
        ),
        (
            fn_of([X], [Op("Relu", (X,), (Value("y"),)), Op("Relu", (X,), (Value("y"),))], ["y"]),
            r"op #1 Relu.*%y is defined twice",
        ),
        (fn_of([X], [Op("Relu", (X,), (Value("y"),))], ["nope"]), r"function output %nope is never defined"),
        (
            fn_of([X], [Op("Relu", (X,), (Value("y"), Value("z")))], ["y"]),
            r"op #0 Relu.*1 results.*2 output names",
        ),
        (fn_of([X], [Op("Relu", (X, X), (Value("y"),))], ["y"]), r"op #0 Relu.*expected 1 operands, got 2"),
        (fn_of([X], [Op("Send", (X,), (Value("y"),), {"to": 0})], ["y"]), r"op #0 Send.*to itself"),
        (
            fn_of([X], [Op("Relu", (X,), (Value("y", t(4, 9)),))], ["y"]),
            r"%y is declared .*4x9.* produces .*4x8",
        ),
    ],
)
def test_ill_formed_programs_raise_named_errors(program, pattern):
    with pytest.raises(ValueError, match=pattern):
        infer_types(program)


def test_bad_tensor_types_raise():
    with pytest.raises(ValueError, match="unknown dtype 'f4'"):
        TensorType((2,), "f4")
    with pytest.raises(ValueError, match="dimension must be >= 0"):
        TensorType((-1,))
    with pytest.raises(ValueError, match="device must be an int >= 0"):
        TensorType((2,), "f32", -1)
    with pytest.raises(ValueError, match="1-D integer array"):
        TensorType((np.array([[1, 2]]),))
    with pytest.raises(ValueError, match="invalid value name"):
        Value("1x")


def test_inferred_types_fill_every_value():
    fn = fn_of([X, W], [Op("MatMul", (X, W), (Value("y"),)), Op("Relu", (Value("y"),), (Value("z"),))], ["z"])
    typed = infer_types(fn)
    assert typed.ops[1].outputs[0].type == t(4, 16)
    assert typed.outputs[0].type == t(4, 16)
