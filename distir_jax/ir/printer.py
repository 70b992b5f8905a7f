"""Prints a :class:`Function` in the IR's text form, one op per line.

Example::

  func @mlp(%x: Tensor[64x512; f32; d0], %w: Tensor[512x512; f32; d0]) {
    %v0: Tensor[64x512; f32; d0] = MatMul(%x, %w) {transpose_b = false}
    %v1: Tensor[64x512; f32; d1] = Send(%v0) {to = 1}
    return %v1
  }

Grammar (whitespace, newlines included, only separates tokens; ``//`` starts a
comment that runs to the end of the line)::

  function := 'func' '@'NAME '(' [def (',' def)* [',']] ')' '{' op* return '}'
  def      := '%'NAME [':' type]                      a parameter or a result
  ref      := '%'NAME [':' (type | '?')]              an operand or an output
  op       := [def (',' def)* '='] OPTYPE '(' [ref (',' ref)*] ')' [attrs]
  return   := 'return' [ref (',' ref)*]
  type     := 'Tensor' '[' [INT ('x' INT)*] ';' DTYPE ';' 'd'INT ']'
  attrs    := '{' [NAME '=' attr (',' NAME '=' attr)* [',']] '}'
  attr     := scalar | '(' ')' | '(' scalar ',' ')' | '(' scalar (',' scalar)+ [','] ')'
  scalar   := INT | FLOAT | STRING | 'true' | 'false'

``NAME`` and ``OPTYPE`` are identifiers (letters, digits, ``_`` and ``.``,
starting with a letter or ``_``). A scalar shape is written ``Tensor[; f32; d0]``.
An ``INT`` has no ``.`` or exponent; a ``FLOAT`` is Python's ``repr`` of the
float (``1.0``, ``1e-05``, ``inf``, ``-inf``, ``nan``), and a NaN other than the
canonical quiet NaN is written by its bits, ``nan(0x7ff0000000000001)``.
``STRING`` is double-quoted with the escapes ``\\\\ \\" \\n \\t \\r \\xHH
\\uHHHH \\UHHHHHHHH``; other printable characters appear as themselves.
The header is one line, or one parameter per line when it would be long. An
op without results whose type is ``return`` is told from the return statement
by the ``(`` after it.

A definition without a type is an untyped value. A reference normally carries
no type: it has the type of its name's latest definition before it (or, if it
has none yet, of its first definition; or ``None`` if the name is never
defined). Only a reference whose own type differs from that is annotated, with
its type or with ``?`` for ``None``, so every :class:`Function` round-trips.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable

import numpy as np

from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.types import TensorType, has_variants

IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
# Bits of the NaN that ``float("nan")`` returns; other NaNs print their bits.
CANONICAL_NAN_BITS = 0x7FF8000000000000
# The header is printed one parameter per line when it would be longer.
_MAX_HEADER_WIDTH = 100
_INDENT = "  "
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


class ReferenceScope:
    """The type an unannotated reference to a name stands for.

    Both the printer and the parser walk definitions in program order (function
    inputs, then each op's results after its operands) and ask this scope what
    a reference means, so the two agree by construction.
    """

    def __init__(self, definitions: Iterable[tuple[str, TensorType | None]]):
        self._first: dict[str, TensorType | None] = {}
        for name, type_ in definitions:
            self._first.setdefault(name, type_)
        self._latest: dict[str, TensorType | None] = {}

    def define(self, name: str, type_: TensorType | None) -> None:
        self._latest[name] = type_

    def resolve(self, name: str) -> TensorType | None:
        if name in self._latest:
            return self._latest[name]
        return self._first.get(name)


def same_type(a: TensorType | None, b: TensorType | None) -> bool:
    if a is b:
        return True
    return a is not None and b is not None and a == b


def all_definitions(fn: Function) -> list[tuple[str, TensorType | None]]:
    """``(name, type)`` of every definition, in program order."""
    defs = [(v.name, v.type) for v in fn.inputs]
    for op in fn.ops:
        defs.extend((v.name, v.type) for v in op.outputs)
    return defs


def print_function(fn: Function) -> str:
    """Returns the text form of ``fn``; :func:`parse_function` reads it back.

    Raises:
      ValueError: if a value's type has size-variant dimensions (the text form
        needs concrete sizes), an op type is not an identifier, an op has two
        attributes with one key, or an attribute holds a value the format has
        no spelling for.
    """
    scope = ReferenceScope(all_definitions(fn))
    params = []
    for v in fn.inputs:
        params.append(_definition(v, f"input %{v.name} of function @{fn.name}"))
        scope.define(v.name, v.type)
    header = f"func @{fn.name}(" + ", ".join(params) + ") {"
    if len(header) > _MAX_HEADER_WIDTH:
        header = f"func @{fn.name}(\n" + ",\n".join(_INDENT + p for p in params) + "\n) {"
    lines = [header]
    for index, op in enumerate(fn.ops):
        lines.append(_INDENT + _op_line(op, index, scope))
    outputs = ", ".join(_reference(v, scope, f"output %{v.name} of function @{fn.name}") for v in fn.outputs)
    lines.append(_INDENT + ("return " + outputs if outputs else "return"))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _op_line(op: Op, index: int, scope: ReferenceScope) -> str:
    where = f"op #{index} {op.op_type}"
    if not isinstance(op.op_type, str) or not IDENTIFIER_RE.match(op.op_type):
        raise ValueError(
            f"{where}: op type {op.op_type!r} cannot be printed; expected letters, digits, '_' or '.', "
            "starting with a letter or '_'"
        )
    operands = ", ".join(_reference(v, scope, f"operand %{v.name} of {where}") for v in op.inputs)
    for v in op.outputs:
        scope.define(v.name, v.type)
    line = f"{op.op_type}({operands})"
    if op.outputs:
        results = ", ".join(_definition(v, f"result %{v.name} of {where}") for v in op.outputs)
        line = f"{results} = {line}"
    if op.attrs:
        line += " " + format_attrs(op.attrs, where)
    return line


def _definition(v: Value, what: str) -> str:
    if v.type is None:
        return "%" + v.name
    return f"%{v.name}: {format_type(v.type, what)}"


def _reference(v: Value, scope: ReferenceScope, what: str) -> str:
    if same_type(v.type, scope.resolve(v.name)):
        return "%" + v.name
    if v.type is None:
        return f"%{v.name}: ?"
    return f"%{v.name}: {format_type(v.type, what)}"


def format_type(t: TensorType, what: str = "a value") -> str:
    """``Tensor[64x512; f32; d0]``; ``what`` names the value in errors."""
    if has_variants(t.shape):
        raise ValueError(
            f"cannot print {what}: its type {t} has size-variant dimensions, and the text format needs "
            "concrete sizes; print a function built for one size variant"
        )
    dims = "x".join(str(d) for d in t.shape)
    return f"Tensor[{dims}; {t.dtype}; d{t.device}]"


def format_attrs(attrs: tuple, where: str = "op") -> str:
    """``{key = value, ...}`` for an op's sorted ``(key, value)`` pairs."""
    items = []
    seen = set()
    for key, value in attrs:
        if key in seen:
            raise ValueError(f"{where}: attribute {key!r} appears twice; the text form needs unique keys")
        seen.add(key)
        items.append(f"{key} = {format_attr_value(value, f'{where}, attribute {key!r}')}")
    return "{" + ", ".join(items) + "}"


def format_attr_value(value, what: str = "attribute") -> str:
    """One attribute value; a tuple of one item keeps its trailing comma."""
    if isinstance(value, tuple):
        items = [_format_scalar(x, what) for x in value]
        return f"({items[0]},)" if len(items) == 1 else "(" + ", ".join(items) + ")"
    return _format_scalar(value, what)


def _format_scalar(x, what: str) -> str:
    # bool before int: bool is a subclass of int.
    if isinstance(x, (bool, np.bool_)):
        return "true" if x else "false"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        return format_float(float(x))
    if isinstance(x, str):
        return quote_string(x)
    raise ValueError(
        f"{what}: cannot print a {type(x).__name__}; attribute values are ints, floats, strings, "
        "bools or flat tuples of those"
    )


def format_float(x: float) -> str:
    """Shortest text that reads back as the same bits."""
    if x != x:
        bits = struct.unpack("<Q", struct.pack("<d", x))[0]
        return "nan" if bits == CANONICAL_NAN_BITS else f"nan(0x{bits:016x})"
    return repr(x)


def quote_string(s: str) -> str:
    """Double-quoted string; control, invisible and unpaired surrogate
    characters are escaped, so a string never spans lines."""
    if s.isprintable() and '"' not in s and "\\" not in s:
        return '"' + s + '"'
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            if code < 0x100:
                out.append(f"\\x{code:02x}")
            elif code < 0x10000:
                out.append(f"\\u{code:04x}")
            else:
                out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'
