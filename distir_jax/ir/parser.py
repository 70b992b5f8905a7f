"""Parses the text form written by :func:`~distir_jax.ir.printer.print_function`.

The grammar is in :mod:`distir_jax.ir.printer`. Parsing is syntax only: any
identifier is accepted as an op type. With ``check=True`` (the default) the
parsed function is then type-checked with :func:`infer_types`.
"""

from __future__ import annotations

import bisect
import re
import struct

from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.printer import ReferenceScope
from distir_jax.ir.typecheck import infer_types
from distir_jax.ir.types import DTYPE_BYTES, TensorType

_NAME = r"[A-Za-z_][A-Za-z0-9_.]*"
_SPACE_RE = re.compile(r"(?:\s+|//[^\n]*)*")
_IDENT_RE = re.compile(_NAME)
_VALUE_NAME_RE = re.compile("%(" + _NAME + ")")
_FUNC_NAME_RE = re.compile("@(" + _NAME + ")")
_KEYWORD_RE = {word: re.compile(word + r"(?![A-Za-z0-9_.])") for word in ("func", "return", "Tensor")}
_DIMS_RE = re.compile(r"\d+(?:x\d+)*")
_DTYPE_RE = re.compile(r"[A-Za-z0-9_]+")
_DEVICE_RE = re.compile(r"d(\d+)(?![A-Za-z0-9_.])")
_PLAIN_TYPE_RE = re.compile(r"Tensor\[[0-9x]*; \w+; d\d+\]")
_NUMBER_RE = re.compile(
    r"[-+]?(?:(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+|inf(?![A-Za-z0-9_.]))"
)
_NAN_BITS_RE = re.compile(r"\(0x([0-9a-fA-F]{16})\)")
_STRING_CHUNK_RE = re.compile(r'[^"\\\n\r]+')
_FOUND_RE = re.compile(r'[%@]?[A-Za-z0-9_.+-]+|"|\S')
_ESCAPED = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}
_ESCAPE_DIGITS = {"x": 2, "u": 4, "U": 8}
_OP_INDEX_RE = re.compile(r"op #(\d+)\b")


def parse_function(text: str, check: bool = True) -> Function:
    """Reads one function from its text form.

    Args:
      text: the text, as written by :func:`print_function` or by hand.
      check: run :func:`infer_types` on the result, so that unknown op types,
        values used before they are defined or defined twice, and declared
        types that differ from the inferred ones are errors.

    Returns:
      The function exactly as written (types that the text omits stay
      ``None``; call :func:`infer_types` to fill them in).

    Raises:
      ValueError: ``line L, col C: expected X, found Y`` for a syntax error, or
        ``line L: ...`` with the type checker's message when ``check`` fails.
    """
    parser = _Parser(text)
    fn = parser.function()
    if check:
        try:
            infer_types(fn)
        except ValueError as e:
            raise ValueError(f"line {parser.line_of_error(str(e))}: {e}") from None
    return fn


class _Parser:
    """A recursive-descent parser over the raw text, with one cursor."""

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise ValueError(f"parse_function expects a str, got {type(text).__name__}")
        self.text = text
        self.pos = 0
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self._op_positions: list[int] = []
        self._function_pos = 0
        self._return_pos = 0
        self._types: dict[str, TensorType] = {}

    # ----------------------------------------------------------------- cursor

    def line_col(self, pos: int) -> tuple[int, int]:
        line = bisect.bisect_right(self._line_starts, pos)
        return line, pos - self._line_starts[line - 1] + 1

    def error(self, message: str, pos: int | None = None) -> ValueError:
        line, col = self.line_col(self.pos if pos is None else pos)
        return ValueError(f"line {line}, col {col}: {message}")

    def found(self) -> str:
        """What is at the cursor, for 'expected X, found Y' messages."""
        self.skip()
        if self.pos >= len(self.text):
            return "end of input"
        token = _FOUND_RE.match(self.text, self.pos).group()
        return repr(token if len(token) <= 30 else token[:27] + "...")

    def expected(self, what: str) -> ValueError:
        return self.error(f"expected {what}, found {self.found()}")

    def skip(self) -> None:
        pos = self.pos
        if pos < len(self.text) and (self.text[pos].isspace() or self.text[pos] == "/"):
            self.pos = _SPACE_RE.match(self.text, pos).end()

    def peek(self, literal: str) -> bool:
        self.skip()
        return self.text.startswith(literal, self.pos)

    def accept(self, literal: str) -> bool:
        if self.peek(literal):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str, context: str) -> None:
        if not self.accept(literal):
            raise self.expected(f"'{literal}' {context}")

    def match(self, pattern: re.Pattern) -> re.Match | None:
        self.skip()
        m = pattern.match(self.text, self.pos)
        if m:
            self.pos = m.end()
        return m

    def require(self, pattern: re.Pattern, what: str) -> re.Match:
        m = self.match(pattern)
        if m is None:
            raise self.expected(what)
        return m

    def line_of_error(self, message: str) -> int:
        """The line a type checker message is about: its op, or the return."""
        m = _OP_INDEX_RE.match(message)
        if m and int(m.group(1)) < len(self._op_positions):
            return self.line_col(self._op_positions[int(m.group(1))])[0]
        if message.startswith("function output"):
            return self.line_col(self._return_pos)[0]
        return self.line_col(self._function_pos)[0]

    # -------------------------------------------------------------- structure

    def function(self) -> Function:
        self.skip()
        self._function_pos = self.pos
        self.require(_KEYWORD_RE["func"], "'func' at the start of a function")
        name = self.require(_FUNC_NAME_RE, "a function name like @main after 'func'").group(1)
        self.expect("(", "after the function name")
        params: list[tuple[str, TensorType | None]] = []
        if not self.accept(")"):
            while True:
                params.append(self.definition("a parameter like %x: Tensor[8x8; f32; d0]"))
                if self.accept(")"):
                    break
                self.expect(",", f"or ')' after parameter %{params[-1][0]}")
                if self.accept(")"):
                    break
        self.expect("{", "to open the function body")
        raw_ops = []
        while not self.at_return():
            self.skip()
            self._op_positions.append(self.pos)
            raw_ops.append(self.op())
        self._return_pos = self.pos
        self.pos += len("return")
        returns = []
        if self.peek("%"):
            returns.append(self.reference("a returned value like %y"))
            while self.accept(","):
                returns.append(self.reference("a returned value like %y after ','"))
        self.expect("}", "after the return statement" if not returns else "or ',' after the returned values")
        self.skip()
        if self.pos < len(self.text):
            raise self.expected("end of input after the function's closing '}'")
        return _build(name, params, raw_ops, returns)

    def at_return(self) -> bool:
        """Whether a return statement starts here (``return(`` is an op)."""
        self.skip()
        m = _KEYWORD_RE["return"].match(self.text, self.pos)
        if m is None:
            return False
        after = _SPACE_RE.match(self.text, m.end()).end()
        return not self.text.startswith("(", after)

    def op(self):
        results = []
        if self.peek("%"):
            while True:
                results.append(self.definition("a result like %y"))
                if self.accept("="):
                    break
                self.expect(",", f"or '=' after result %{results[-1][0]}")
            op_type = self.require(_IDENT_RE, "an op type like MatMul after '='").group()
        else:
            if self.pos >= len(self.text) or self.peek("}"):
                raise self.expected("an op or 'return' before the function's closing '}'")
            op_type = self.require(_IDENT_RE, "an op like '%y = MatMul(%a, %b)' or 'return'").group()
        self.expect("(", f"after op type {op_type}")
        operands = []
        if not self.accept(")"):
            while True:
                operands.append(self.reference(f"an operand of {op_type} like %x"))
                if self.accept(")"):
                    break
                self.expect(",", f"or ')' after operand %{operands[-1][0]}")
        attrs = self.attrs(op_type) if self.peek("{") else {}
        return op_type, operands, results, attrs

    def definition(self, what: str) -> tuple[str, TensorType | None]:
        name = self.require(_VALUE_NAME_RE, what).group(1)
        if not self.accept(":"):
            return name, None
        if self.peek("?"):
            raise self.error(f"a definition of %{name} cannot be typed '?'; leave out ': ?' for no type")
        return name, self.type(f"after '%{name}:'")

    def reference(self, what: str) -> tuple[str, bool, TensorType | None]:
        """``(name, annotated, type)`` of a use of a value."""
        name = self.require(_VALUE_NAME_RE, what).group(1)
        if not self.accept(":"):
            return name, False, None
        if self.accept("?"):
            return name, True, None
        return name, True, self.type(f"or '?' after '%{name}:'")

    def type(self, context: str) -> TensorType:
        self.skip()
        m = _PLAIN_TYPE_RE.match(self.text, self.pos)
        if m and m.group() in self._types:
            # Programs repeat a few types many times; share one object each.
            self.pos = m.end()
            return self._types[m.group()]
        start = self.pos
        t = self._type(context)
        self._types[self.text[start : self.pos]] = t
        return t

    def _type(self, context: str) -> TensorType:
        self.require(_KEYWORD_RE["Tensor"], f"a type like Tensor[8x8; f32; d0] {context}")
        self.expect("[", "after 'Tensor'")
        dims_match = self.match(_DIMS_RE)
        dims = tuple(int(d) for d in dims_match.group().split("x")) if dims_match else ()
        if dims_match and self.text.startswith("x", self.pos):
            raise self.error(f"expected a dimension after 'x', found {self.found()}", self.pos + 1)
        self.expect(";", "after the dimensions (write Tensor[; f32; d0] for a scalar)")
        self.skip()
        dtype_pos = self.pos
        dtype = self.require(_DTYPE_RE, "a dtype like f32").group()
        if dtype not in DTYPE_BYTES:
            raise self.error(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}", dtype_pos)
        self.expect(";", "after the dtype")
        device = int(self.require(_DEVICE_RE, "a device like d0").group(1))
        self.expect("]", "to close the type")
        return TensorType(dims, dtype, device)

    # ------------------------------------------------------------- attributes

    def attrs(self, op_type: str) -> dict:
        self.expect("{", "")
        attrs: dict = {}
        if self.accept("}"):
            return attrs
        while True:
            self.skip()
            key_pos = self.pos
            key = self.require(_IDENT_RE, f"an attribute name of {op_type}").group()
            if key in attrs:
                raise self.error(f"attribute {key!r} is given twice", key_pos)
            self.expect("=", f"after attribute name {key!r}")
            attrs[key] = self.attr_value(key)
            if self.accept("}"):
                return attrs
            self.expect(",", f"or '}}' after attribute {key!r}")
            if self.accept("}"):
                return attrs

    def attr_value(self, key: str):
        if not self.accept("("):
            return self.scalar(f"a value for attribute {key!r} (int, float, string, true, false or tuple)")
        items = []
        if self.accept(")"):
            return ()
        items.append(self.scalar(f"a tuple item or ')' in attribute {key!r}"))
        if self.accept(")"):
            raise self.error(
                f"a 1-tuple needs a trailing comma in attribute {key!r}: write (x,)", self.pos - 1
            )
        while True:
            self.expect(",", f"or ')' after a tuple item in attribute {key!r}")
            if self.accept(")"):
                return tuple(items)
            items.append(self.scalar(f"a tuple item or ')' in attribute {key!r}"))
            if self.accept(")"):
                return tuple(items)

    def scalar(self, what: str):
        self.skip()
        if self.peek('"'):
            return self.string()
        if self.peek("("):
            raise self.error("nested tuples are not supported in attributes")
        m = self.match(_NUMBER_RE)
        if m:
            token = m.group()
            if any(c in token for c in ".eEn"):
                return float(token)
            return int(token)
        start = self.pos
        m = self.match(_IDENT_RE)
        word = m.group() if m else None
        if word == "true":
            return True
        if word == "false":
            return False
        if word == "nan":
            if not self.text.startswith("(", self.pos):
                return float("nan")
            bits = _NAN_BITS_RE.match(self.text, self.pos)
            if bits is None:
                raise self.error("expected 16 hex digits of NaN bits like nan(0x7ff0000000000001)", self.pos)
            self.pos = bits.end()
            value = struct.unpack("<d", struct.pack("<Q", int(bits.group(1), 16)))[0]
            if value == value:
                raise self.error(f"nan(0x{bits.group(1)}) is not a NaN", start)
            return value
        self.pos = start
        raise self.expected(what)

    def string(self) -> str:
        start = self.pos
        self.pos += 1
        parts = []
        text = self.text
        while True:
            m = _STRING_CHUNK_RE.match(text, self.pos)
            if m:
                parts.append(m.group())
                self.pos = m.end()
            if self.pos >= len(text) or text[self.pos] in "\n\r":
                raise self.error("unterminated string (strings end on the same line)", start)
            ch = text[self.pos]
            if ch == '"':
                self.pos += 1
                return "".join(parts)
            # A backslash escape.
            code = text[self.pos + 1 : self.pos + 2]
            if code in _ESCAPED:
                parts.append(_ESCAPED[code])
                self.pos += 2
            elif code in _ESCAPE_DIGITS:
                digits = text[self.pos + 2 : self.pos + 2 + _ESCAPE_DIGITS[code]]
                if len(digits) != _ESCAPE_DIGITS[code] or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                    raise self.error(
                        f"expected {_ESCAPE_DIGITS[code]} hex digits after '\\{code}' in a string", self.pos
                    )
                if int(digits, 16) > 0x10FFFF:
                    raise self.error(f"'\\{code}{digits}' is not a unicode code point", self.pos)
                parts.append(chr(int(digits, 16)))
                self.pos += 2 + len(digits)
            else:
                raise self.error(
                    f"unknown escape '\\{code}' in a string; expected one of "
                    '\\\\ \\" \\n \\t \\r \\xHH \\uHHHH \\UHHHHHHHH',
                    self.pos,
                )


def _build(name, params, raw_ops, returns) -> Function:
    """Turns parsed records into a :class:`Function`, resolving references."""
    definitions = list(params)
    for _, _, results, _ in raw_ops:
        definitions.extend(results)
    scope = ReferenceScope(definitions)

    def use(ref) -> Value:
        ref_name, annotated, type_ = ref
        return Value(ref_name, type_ if annotated else scope.resolve(ref_name))

    inputs = []
    for param_name, type_ in params:
        inputs.append(Value(param_name, type_))
        scope.define(param_name, type_)
    ops = []
    for op_type, operands, results, attrs in raw_ops:
        op_inputs = tuple(use(r) for r in operands)
        for result_name, type_ in results:
            scope.define(result_name, type_)
        ops.append(Op(op_type, op_inputs, tuple(Value(n, t) for n, t in results), attrs))
    return Function(name, tuple(inputs), tuple(ops), tuple(use(r) for r in returns))
