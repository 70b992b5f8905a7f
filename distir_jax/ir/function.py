"""Values, ops and functions: the IR's frozen Python objects.

A :class:`Function` is a list of ops in *issue order*; the issue order is the
schedule. Every cross-device data movement is an explicit op (``Send`` or a
collective), so an op's devices are exactly the devices of its inputs and
outputs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from distir_jax.ir.registry import SCALAR_ATTR_TYPES, attrs_cache_key
from distir_jax.ir.types import TensorType

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")

AttrValue = Any  # int | float | str | bool | tuple of those


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid {what} name {name!r}: expected letters, digits, '_' or '.', "
            "starting with a letter or '_'"
        )
    return name


# Attribute names already checked. Programs use a few dozen distinct names, so
# remembering them skips a regex match per attribute of every op; the bound
# only keeps unusual inputs from growing it without limit.
_CHECKED_ATTR_NAMES: set[str] = set()
_MAX_CHECKED_ATTR_NAMES = 4096


def _check_attr_name(name: str) -> None:
    check_name(name, "attribute")
    if type(name) is str and len(_CHECKED_ATTR_NAMES) < _MAX_CHECKED_ATTR_NAMES:
        _CHECKED_ATTR_NAMES.add(name)


def _freeze_attrs(attrs) -> tuple[tuple[str, AttrValue], ...]:
    """Checks and freezes attributes (a dict or ``(key, value)`` pairs), in the
    given order, then sorts them by key."""
    if isinstance(attrs, dict):
        # Known names and plain scalar values, checked by C loops: the checks
        # below would accept them unchanged.
        if _CHECKED_ATTR_NAMES.issuperset(attrs) and SCALAR_ATTR_TYPES.issuperset(map(type, attrs.values())):
            return tuple(sorted(attrs.items()))
        attrs = attrs.items()
    frozen = []
    for key, value in attrs:
        # Known names and plain scalars (the common case) skip the full checks,
        # which would accept them unchanged.
        if type(key) is not str or key not in _CHECKED_ATTR_NAMES:
            _check_attr_name(key)
        if type(value) not in SCALAR_ATTR_TYPES:
            value = _freeze_attr(key, value)
        frozen.append((key, value))
    frozen.sort()
    return tuple(frozen)


def _freeze_attr(key: str, value: AttrValue) -> AttrValue:
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
        for item in value:
            if isinstance(item, (tuple, list, dict)):
                raise ValueError(f"attribute {key!r}: nested sequences are not supported, got {value!r}")
        return value
    if isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(
        f"attribute {key!r} must be an int, float, str, bool or a tuple of those, got {type(value).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class Value:
    """A named SSA value. ``type`` is ``None`` until type inference runs."""

    name: str
    type: TensorType | None = None

    def __post_init__(self):
        if type(self.name) is not str or not _NAME_RE.match(self.name):  # check_name, inlined
            check_name(self.name, "value")

    def with_type(self, type_: TensorType) -> Value:
        return Value(self.name, type_)


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation: its type, operands, results and attributes.

    ``attrs`` is stored as a sorted tuple of ``(key, value)`` pairs so that an op
    is hashable and prints deterministically. Use :meth:`attr` to read one.
    """

    op_type: str
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    attrs: tuple[tuple[str, AttrValue], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "attrs", _freeze_attrs(self.attrs))
        # The attributes as a key of rule caches (see registry.rule_cache_key).
        object.__setattr__(self, "_attrs_cache_key", attrs_cache_key(self.attrs))

    def _with_values(self, inputs: tuple[Value, ...], outputs: tuple[Value, ...]) -> Op:
        """This op with other operands and results.

        Its attrs were frozen and checked when it was made, so they are not
        checked again: builders and transforms make every op twice (a probe to
        infer types, then the op with typed results).
        """
        op = object.__new__(Op)
        object.__setattr__(op, "op_type", self.op_type)
        object.__setattr__(op, "inputs", tuple(inputs))
        object.__setattr__(op, "outputs", tuple(outputs))
        object.__setattr__(op, "attrs", self.attrs)
        object.__setattr__(op, "_attrs_cache_key", getattr(self, "_attrs_cache_key", None))
        return op

    @property
    def attr_dict(self) -> dict[str, AttrValue]:
        return dict(self.attrs)

    def attr(self, key: str, default: AttrValue = None) -> AttrValue:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def devices(self) -> tuple[int, ...]:
        """Devices the op occupies, in first-seen order (inputs, then outputs)."""
        seen: dict[int, None] = {}
        for v in self.inputs + self.outputs:
            if v.type is None:
                raise ValueError(f"op {self.op_type} uses untyped value %{v.name}; run infer_types first")
            seen.setdefault(v.type.device, None)
        return tuple(seen)

    @property
    def comm_group(self) -> tuple[int, ...]:
        """Devices a collective is costed over: its ``group`` attribute, else its devices."""
        group = self.attr("group")
        return tuple(int(d) for d in group) if group else self.devices

    @property
    def stream(self) -> int:
        return int(self.attr("stream", 0))


@dataclasses.dataclass(frozen=True)
class Function:
    """A program: typed inputs, ops in issue order, and outputs."""

    name: str
    inputs: tuple[Value, ...]
    ops: tuple[Op, ...]
    outputs: tuple[Value, ...]

    def __post_init__(self):
        check_name(self.name, "function")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    @property
    def devices(self) -> tuple[int, ...]:
        found = {v.type.device for v in self.inputs if v.type is not None}
        for op in self.ops:
            found.update(op.devices)
        return tuple(sorted(found))

    @property
    def num_streams(self) -> int:
        return 1 + max((op.stream for op in self.ops), default=0)

    def values(self) -> dict[str, Value]:
        """Every value by name: inputs first, then op outputs in issue order."""
        table = {v.name: v for v in self.inputs}
        for op in self.ops:
            for v in op.outputs:
                table[v.name] = v
        return table

    def producers(self) -> dict[str, int]:
        """Index of the op producing each non-input value."""
        return {v.name: i for i, op in enumerate(self.ops) for v in op.outputs}

    def replace(self, **changes) -> Function:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        from distir_jax.ir.printer import print_function

        return print_function(self)


def values_by_name(values: Iterable[Value]) -> dict[str, Value]:
    return {v.name: v for v in values}
