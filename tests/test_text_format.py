"""The text format: exact round trips, golden output and parser errors."""

from __future__ import annotations

import re
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distir_jax.ir import Function, FunctionBuilder, Op, TensorType, Value, infer_types
from distir_jax.ir.parser import parse_function
from distir_jax.ir.printer import print_function
from distir_jax.testing import random_function, random_functions

COMM_OPS = {"Send", "AllReduce", "AllGather", "ReduceScatter", "AllToAll", "Broadcast", "Scatter", "Gather"}


def exact(fn: Function):
    """Everything a round trip must keep, with attribute types and float bits
    spelled out (``1 == 1.0 == True`` and ``nan != nan`` hide both)."""

    def value(v):
        t = v.type
        return v.name, None if t is None else (tuple((type(d), d) for d in t.shape), t.dtype, t.device)

    def attr(x):
        if isinstance(x, tuple):
            return "tuple", tuple(attr(i) for i in x)
        if isinstance(x, float):
            return "float", struct.pack("<d", x)
        return type(x).__name__, x

    ops = tuple(
        (
            op.op_type,
            tuple(map(value, op.inputs)),
            tuple(map(value, op.outputs)),
            tuple((k, attr(v)) for k, v in op.attrs),
        )
        for op in fn.ops
    )
    return fn.name, tuple(map(value, fn.inputs)), ops, tuple(map(value, fn.outputs))


def assert_round_trip(fn: Function, check: bool = True) -> str:
    text = print_function(fn)
    parsed = parse_function(text, check=check)
    assert exact(parsed) == exact(fn), text
    assert print_function(parsed) == text
    return text


# --------------------------------------------------------------------------- #
# Round trips.


@settings(max_examples=300, deadline=None)
@given(random_functions(max_ops=12, max_devices=4, num_streams=3))
def test_random_programs_round_trip(fn):
    assert_round_trip(fn)


@settings(max_examples=100, deadline=None)
@given(random_functions(max_ops=8, max_devices=3), st.data())
def test_partially_typed_programs_round_trip(fn, data):
    # Untype some definitions and, independently, some references: references
    # that disagree with their definition are annotated (`%x: T` or `%x: ?`).
    names = sorted(fn.values())
    untyped_defs = data.draw(st.sets(st.sampled_from(names))) if names else set()
    untyped_refs = data.draw(st.sets(st.sampled_from(names))) if names else set()

    def strip(v, names):
        return Value(v.name) if v.name in names else v

    fn = Function(
        fn.name,
        tuple(strip(v, untyped_defs) for v in fn.inputs),
        tuple(
            Op(
                op.op_type,
                tuple(strip(v, untyped_refs) for v in op.inputs),
                tuple(strip(v, untyped_defs) for v in op.outputs),
                op.attrs,
            )
            for op in fn.ops
        ),
        tuple(strip(v, untyped_refs) for v in fn.outputs),
    )
    assert_round_trip(fn, check=False)


def _t(*shape, dtype="f32", device=0):
    return TensorType(shape, dtype, device)


def _edge_programs():
    a, b = Value("a", _t(2, 3)), Value("b", _t(2, 3, device=1))
    yield "empty", Function("f", (), (), ())
    yield "untyped", Function("f", (Value("x"),), (Op("Foo", (Value("x"),), (Value("y"),)),), (Value("y"),))
    yield (
        "no results, op types named like keywords",
        Function(
            "f",
            (a,),
            (
                Op("return", (a,), ()),
                Op("func", (), (), {"k": 1}),
                Op("Tensor", (a, a), (Value("r", _t(2, 3)),)),
                Op("Print.v2", (), ()),
            ),
            (a,),
        ),
    )
    yield (
        "defined twice, used before and never defined",
        Function(
            "f",
            (a, b),
            (
                Op("Foo", (Value("late", _t(1)), Value("ghost")), (Value("a", _t(5, device=2)),)),
                Op("Bar", (Value("a", _t(5, device=2)), Value("a", _t(2, 3))), (Value("late", _t(1)),)),
            ),
            (Value("a", _t(5, device=2)), Value("ghost"), Value("late", _t(7))),
        ),
    )
    yield (
        "scalars and zero-size dims",
        Function(
            "_f.1",
            (Value("s", _t(dtype="i64", device=63)), Value("z", _t(0, 4))),
            (),
            (Value("s", _t(dtype="i64", device=63)),),
        ),
    )
    floats = (0.0, -0.0, 1.0, -2.5, 0.1, 1e-05, 1e16, 1.5e300, 5e-324, 2.2250738585072014e-308, float("inf"))
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]
    negative_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0]
    attrs = {
        "ints": (0, -1, 2**64, -(2**100)),
        "floats": floats + (float("-inf"),),
        "nans": (float("nan"), nan_payload, negative_nan),
        "bools": (True, False),
        "strings": ("", '"', "\\", 'a\\"b', "\n\t\r\x00\x7f", "é中😀", "\ud800", "\u2028\xa0 ", "\\u0041"),
        "empty": (),
        "one_int": (1,),
        "one_str": ("x",),
        "one_bool": (True,),
        "int": 1,
        "float": 1.0,
        "bool": True,
        "str": "1",
        "x.y_z": "dotted key",
    }
    yield "every attribute kind", Function("f", (a,), (Op("Tag", (a,), (Value("t", _t(2, 3)),), attrs),), ())


@pytest.mark.parametrize("fn", [fn for _, fn in _edge_programs()], ids=[name for name, _ in _edge_programs()])
def test_edge_programs_round_trip(fn):
    assert_round_trip(fn, check=False)


def test_numpy_attribute_scalars_print_as_python_scalars():
    op = Op(
        "Foo", (), (), {"f": np.float64(0.5), "i": (np.int64(3),), "b": (np.bool_(True), np.float32(0.25))}
    )
    fn = parse_function(print_function(Function("f", (), (op,), ())), check=False)
    assert exact(fn)[2][0][3] == (
        ("b", ("tuple", (("bool", True), ("float", struct.pack("<d", 0.25))))),
        ("f", ("float", struct.pack("<d", 0.5))),
        ("i", ("tuple", (("int", 3),))),
    )


# --------------------------------------------------------------------------- #
# Golden text.


def _golden_program() -> Function:
    b = FunctionBuilder("mlp")
    x = b.input("x", (64, 512), device=0)
    w = b.input("w", (512, 512), device=0)
    s = b.input("s", (), dtype="bf16", device=1)
    h = b.add("MatMul", x, w, transpose_b=False)
    r = b.add("Relu", h, stream=1)
    t = b.add(
        "Identity",
        r,
        count=3,
        eps=1e-05,
        flag=True,
        label='say "hi"\n',
        empty=(),
        one=(0.5,),
        mix=(1, 2.0, "x", False),
        big=-(2**70),
    )
    y = b.add("Send", t, to=1, names="y")
    _, q = b.add("AllReduce", t, y, names=("p", "q"))
    u = b.add("Mul", s, b.add("Neg", s))
    return b.build(q, u)


GOLDEN = """\
func @mlp(%x: Tensor[64x512; f32; d0], %w: Tensor[512x512; f32; d0], %s: Tensor[; bf16; d1]) {
  %v0: Tensor[64x512; f32; d0] = MatMul(%x, %w) {transpose_b = false}
  %v1: Tensor[64x512; f32; d0] = Relu(%v0) {stream = 1}
  %v2: Tensor[64x512; f32; d0] = Identity(%v1) {big = -1180591620717411303424, count = 3, empty = (), \
eps = 1e-05, flag = true, label = "say \\"hi\\"\\n", mix = (1, 2.0, "x", false), one = (0.5,)}
  %y: Tensor[64x512; f32; d1] = Send(%v2) {to = 1}
  %p: Tensor[64x512; f32; d0], %q: Tensor[64x512; f32; d1] = AllReduce(%v2, %y)
  %v3: Tensor[; bf16; d1] = Neg(%s)
  %v4: Tensor[; bf16; d1] = Mul(%s, %v3)
  return %q, %v4
}
"""


def test_golden_text():
    fn = _golden_program()
    assert print_function(fn) == GOLDEN
    assert str(fn) == GOLDEN
    assert exact(parse_function(GOLDEN)) == exact(fn)


def test_long_headers_put_one_parameter_per_line():
    b = FunctionBuilder("wide")
    values = [b.input(f"input_{i}", (1024, 1024), device=i) for i in range(3)]
    text = print_function(b.build(*values))
    assert text == (
        "func @wide(\n"
        "  %input_0: Tensor[1024x1024; f32; d0],\n"
        "  %input_1: Tensor[1024x1024; f32; d1],\n"
        "  %input_2: Tensor[1024x1024; f32; d2]\n"
        ") {\n"
        "  return %input_0, %input_1, %input_2\n"
        "}\n"
    )
    assert_round_trip(b.build(*values))


def test_annotated_references():
    x = Value("x", _t(4))
    fn = Function("f", (x,), (Op("Foo", (Value("x"), Value("x", _t(8))), (Value("y"),)),), (Value("x"),))
    assert print_function(fn) == (
        "func @f(%x: Tensor[4; f32; d0]) {\n  %y = Foo(%x: ?, %x: Tensor[8; f32; d0])\n  return %x: ?\n}\n"
    )


def test_layout_and_comments_are_free():
    text = """
    // A hand-written program.
    func @mlp (
        %x : Tensor[ 64x512 ; f32 ; d0 ] , %w: Tensor[512x512;f32;d0],
    ) {
      %v0: Tensor[64x512; f32; d0] =
          MatMul(%x, %w) { transpose_b = false, }   // trailing comma is fine
      %v1 : Tensor[64x512; f32; d1] = Send( %v0 ) {to=1}
      %t = Identity(%v1) {tags = ( 1 , "a" , )}
      return %v1 , %t
    }
    """
    fn = parse_function(text)
    assert [op.op_type for op in fn.ops] == ["MatMul", "Send", "Identity"]
    assert fn.ops[0].attrs == (("transpose_b", False),)
    assert fn.ops[2].attrs == (("tags", (1, "a")),)
    assert fn.outputs[0].type == _t(64, 512, device=1)
    assert fn.outputs[1].type is None  # types the text leaves out stay None
    assert_round_trip(fn)


# --------------------------------------------------------------------------- #
# Errors.

_OK = "func @f(%x: Tensor[8x8; f32; d0]) {\n  %y: Tensor[8x8; f32; d0] = Relu(%x)\n  return %y\n}\n"

PARSE_ERRORS = [
    (
        "unterminated body",
        "func @f(%x: Tensor[8; f32; d0]) {\n  %y = Relu(%x)\n",
        r"line 3, col 1: expected an op",
    ),
    ("no return", "func @f() {\n}", r"line 2, col 1: expected an op or 'return' before .*, found '\}'"),
    ("missing close brace", "func @f() {\n  return\n", r"line 3, col 1: expected '\}' after the return"),
    ("trailing text", _OK + "extra", r"line 5, col 1: expected end of input .*found 'extra'"),
    ("not a function", "fun @f() {}", r"line 1, col 1: expected 'func'"),
    ("bad function name", "func f() {}", r"line 1, col 6: expected a function name like @main"),
    (
        "operands not closed",
        "func @f(%x) {\n  %y = Relu(%x {a = 1}\n  return\n}",
        r"line 2, col 16: expected ',' or '\)' after operand %x, found '\{'",
    ),
    (
        "missing '='",
        "func @f(%x) {\n  %y Relu(%x)\n  return\n}",
        r"line 2, col 6: expected ',' or '=' after result %y",
    ),
    ("unknown dtype", "func @f(%x: Tensor[8; f4; d0]) {\n  return\n}", r"line 1, col 23: unknown dtype 'f4'"),
    (
        "dangling x",
        "func @f(%x: Tensor[8x; f32; d0]) {\n  return\n}",
        r"line 1, col 22: expected a dimension after 'x'",
    ),
    (
        "bad device",
        "func @f(%x: Tensor[8; f32; 0]) {\n  return\n}",
        r"line 1, col 28: expected a device like d0",
    ),
    (
        "not a type",
        "func @f(%x: tensor<8xf32>) {\n  return\n}",
        r"line 1, col 13: expected a type like Tensor",
    ),
    (
        "unclosed type",
        "func @f(%x: Tensor[8; f32; d0) {\n  return\n}",
        r"col 30: expected '\]' to close the type",
    ),
    (
        "'?' on a definition",
        "func @f(%x: ?) {\n  return\n}",
        r"line 1, col 13: a definition of %x cannot be typed",
    ),
    (
        "bad attr value",
        "func @f() {\n  Foo() {a = }\n  return\n}",
        r"line 2, col 14: expected a value for attribute 'a'",
    ),
    (
        "bad attr key",
        "func @f() {\n  Foo() {1 = 2}\n  return\n}",
        r"line 2, col 10: expected an attribute name",
    ),
    (
        "attr without '='",
        "func @f() {\n  Foo() {a 1}\n  return\n}",
        r"col 12: expected '=' after attribute name 'a'",
    ),
    (
        "duplicate attr",
        "func @f() {\n  Foo() {a = 1, a = 2}\n  return\n}",
        r"line 2, col 17: attribute 'a' is given twice",
    ),
    ("nested tuple", "func @f() {\n  Foo() {a = ((1,),)}\n  return\n}", r"line 2, col 15: nested tuples"),
    (
        "1-tuple without comma",
        "func @f() {\n  Foo() {a = (1)}\n  return\n}",
        r"col 16: a 1-tuple needs a trailing comma",
    ),
    (
        "unterminated string",
        'func @f() {\n  Foo() {a = "abc}\n  return\n}',
        r"line 2, col 14: unterminated string",
    ),
    ("bad escape", 'func @f() {\n  Foo() {a = "\\q"}\n  return\n}', r"line 2, col 15: unknown escape '\\q'"),
    (
        "short unicode escape",
        'func @f() {\n  Foo() {a = "\\u12"}\n  return\n}',
        r"expected 4 hex digits after '\\u'",
    ),
    (
        "bad NaN bits",
        "func @f() {\n  Foo() {a = nan(0x1)}\n  return\n}",
        r"expected 16 hex digits of NaN bits",
    ),
    (
        "NaN bits of a number",
        "func @f() {\n  Foo() {a = nan(0x3ff0000000000000)}\n  return\n}",
        r"is not a NaN",
    ),
    ("bad value name", "func @f(%1x) {\n  return\n}", r"line 1, col 9: expected a parameter like %x"),
]


@pytest.mark.parametrize(
    "text,message", [(t, m) for _, t, m in PARSE_ERRORS], ids=[n for n, _, _ in PARSE_ERRORS]
)
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_function(text, check=False)


CHECK_ERRORS = [
    (
        "duplicate value",
        "%y: Tensor[8x8; f32; d0] = Relu(%x)\n  %y = Neg(%x)",
        r"line 3: op #1 Neg .*: value %y is defined twice",
    ),
    ("duplicate input", None, r"line 1: function input %x is declared twice"),
    ("unknown op", "%y = Frobnicate(%x)", r"line 2: op #0 Frobnicate .*: unknown op type 'Frobnicate'"),
    (
        "use before definition",
        "%y = Relu(%z)\n  %z = Neg(%x)",
        r"line 2: op #0 Relu .*: operand %z is used before it is defined",
    ),
    (
        "wrong declared type",
        "%y: Tensor[8x8; f32; d1] = Relu(%x)",
        r"line 2: op #0 Relu .*: %y is declared .* but the op produces",
    ),
    ("bad operands", "%y = MatMul(%x)", r"line 2: op #0 MatMul .*: expected 2 operands, got 1"),
]


@pytest.mark.parametrize(
    "body,message", [(b, m) for _, b, m in CHECK_ERRORS], ids=[n for n, _, _ in CHECK_ERRORS]
)
def test_check_errors(body, message):
    if body is None:
        text = "func @f(%x: Tensor[8x8; f32; d0], %x: Tensor[8x8; f32; d0]) {\n  return\n}\n"
    else:
        text = f"func @f(%x: Tensor[8x8; f32; d0]) {{\n  {body}\n  return %y\n}}\n"
    parse_function(text, check=False)  # the syntax is fine
    with pytest.raises(ValueError, match=message):
        parse_function(text)


def test_undefined_output_points_at_return():
    text = "func @f(%x: Tensor[8; f32; d0]) {\n  %y = Relu(%x)\n  return %y, %w\n}\n"
    with pytest.raises(ValueError, match=r"line 3: function output %w is never defined"):
        parse_function(text)


def test_variant_dims_cannot_be_printed():
    b = FunctionBuilder("sweep")
    x = b.input("x", (np.array([64, 128]), 512))
    fn = b.build(b.add("Relu", x, names="act"))
    with pytest.raises(
        ValueError, match=r"cannot print input %x of function @sweep: .*size-variant.*concrete sizes"
    ):
        print_function(fn)
    fn = fn.replace(inputs=(Value("x"),))
    with pytest.raises(ValueError, match=r"cannot print operand %x of op #0 Relu: .*concrete sizes"):
        print_function(fn)


@pytest.mark.parametrize(
    "op,message",
    [
        (Op("Not an identifier", (), ()), r"op #0 Not an identifier: op type .* cannot be printed"),
        (Op("Foo", (), (), {"k": (1, None)}), r"attribute 'k': cannot print a NoneType"),
        (Op("Foo", (), (), (("k", 1), ("k", 2))), r"attribute 'k' appears twice"),
    ],
)
def test_unprintable_ops(op, message):
    with pytest.raises(ValueError, match=message):
        print_function(Function("f", (), (op,), ()))


# --------------------------------------------------------------------------- #
# The deterministic benchmark generator.


def test_random_function_is_deterministic_and_well_typed():
    fn = random_function(seed=3, num_ops=500, num_devices=8, num_streams=3)
    assert len(fn.ops) == 500
    assert print_function(fn) == print_function(random_function(3, 500, 8, 3))
    assert print_function(fn) != print_function(random_function(4, 500, 8, 3))
    assert exact(infer_types(fn)) == exact(fn)
    assert {op.stream for op in fn.ops} == {0, 1, 2}
    assert_round_trip(fn)


def test_random_function_mixes_ops_and_reuses_values():
    fn = random_function(seed=0, num_ops=4000, num_devices=16)
    kinds = {op.op_type for op in fn.ops}
    assert COMM_OPS <= kinds
    assert {"MatMul", "Add", "Relu", "SGD"} <= kinds
    comm = sum(op.op_type in COMM_OPS for op in fn.ops) / len(fn.ops)
    assert 0.08 <= comm <= 0.22
    assert "stream" not in {k for op in fn.ops for k, _ in op.attrs}
    # Operands come from several steps back, not only from the previous op.
    producer = fn.producers()
    gaps = [i - producer[v.name] for i, op in enumerate(fn.ops) for v in op.inputs if v.name in producer]
    assert np.mean(np.array(gaps) > 1) > 0.5
    assert len({len(op.devices) for op in fn.ops}) > 3  # groups of several sizes
    assert random_function(0, 50, 1).devices == (0,)


def test_random_function_scales():
    start = time.perf_counter()
    fn = random_function(seed=1, num_ops=16384, num_devices=64, num_streams=2)
    elapsed = time.perf_counter() - start
    assert len(fn.ops) == 16384 and fn.devices == tuple(range(64))
    assert elapsed < 10.0, f"took {elapsed:.1f}s"
    text = print_function(fn)
    assert len(text.splitlines()) > 16384
    assert re.search(r"= AllToAll\(", text)
