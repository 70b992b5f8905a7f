"""A builder for writing programs by hand (and for model builders).

Example::

    b = FunctionBuilder("mlp")
    x = b.input("x", (64, 512), device=0)
    w = b.input("w", (512, 512), device=0)
    y = b.add("Relu", b.add("MatMul", x, w))
    fn = b.build(y)

Each :meth:`add` infers the result types at once, so a mistake is reported at
the line that made it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.typecheck import infer_op_types
from distir_jax.ir.types import TensorType


class FunctionBuilder:
    def __init__(self, name: str):
        self.name = name
        self._inputs: list[Value] = []
        self._ops: list[Op] = []
        self._names: set[str] = set()
        self._values: dict[str, Value] = {}  # what each name of this builder holds
        self._variants: tuple[int, str] | None = None  # (size variants, the first input with them)
        self._counter = 0

    def _fresh(self, hint: str | None) -> str:
        if hint is not None:
            if hint in self._names:
                raise ValueError(f"value name %{hint} is already used in function {self.name}")
            self._names.add(hint)
            return hint
        while True:
            name = f"v{self._counter}"
            self._counter += 1
            if name not in self._names:
                self._names.add(name)
                return name

    def input(self, name: str, shape, dtype: str = "f32", device: int = 0) -> Value:
        """Declares a function input (weights, data, optimizer state); a dimension may
        be a 1-D array of size variants, as many in every input that has them."""
        for dim in shape:
            variants = np.shape(dim)
            if not variants:
                continue
            if len(variants) != 1 or variants[0] < 1:
                raise ValueError(
                    f"input %{name}: a size-variant dimension is a 1-D array, got shape {variants}"
                )
            first = self._variants or (variants[0], name)
            if variants[0] != first[0]:
                raise ValueError(
                    f"input %{name} has {variants[0]} size variants but %{first[1]} has {first[0]}: "
                    "every size-variant dimension of a function lists the same variants"
                )
            self._variants = first
        value = Value(self._fresh(name), TensorType(tuple(shape), dtype, device))
        self._inputs.append(value)
        self._values[value.name] = value
        return value

    def add(
        self,
        op_type: str,
        *inputs: Value,
        names: None | str | Sequence[str] = None,
        **attrs,
    ) -> Value | tuple[Value, ...]:
        """Appends an op; returns its result, or a tuple when it has several."""
        inputs = tuple(inputs)
        for v in inputs:
            self._check_own(v, f"{op_type}: operands")
        probe = Op(op_type, inputs, (), attrs)
        out_types = infer_op_types(probe, len(self._ops), tuple(v.type for v in inputs))
        if isinstance(names, str):
            names = (names,)
        if names is not None and len(names) != len(out_types):
            raise ValueError(f"{op_type}: {len(out_types)} results but {len(names)} names given")
        outputs = tuple(
            Value(self._fresh(None if names is None else names[i]), t) for i, t in enumerate(out_types)
        )
        self._ops.append(probe._with_values(inputs, outputs))
        self._values.update((v.name, v) for v in outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def build(self, *outputs: Value) -> Function:
        flat: list[Value] = []
        for o in outputs:
            flat.extend(o if isinstance(o, (tuple, list)) else (o,))
        for v in flat:
            self._check_own(v, f"function {self.name}: outputs")
        return Function(self.name, tuple(self._inputs), tuple(self._ops), tuple(flat))

    def _check_own(self, value, what: str) -> None:
        """``value`` must be a typed Value made by this builder (one of another
        builder's would name a value this function does not have)."""
        ok = isinstance(value, Value) and value.type is not None
        held = self._values.get(value.name) if ok else None
        if held is not value:  # the same object, or (rebuilt) an equal one
            try:
                ok = held is not None and bool(held == value)
            except ValueError:  # size-variant shapes compare elementwise: the name matched
                ok = held is not None
        if not ok:
            raise ValueError(f"{what} must be typed Values from this builder, got {value!r}")
