"""What every transform returns: the new program and how it relates to the old.

A transform maps a program to a distributed program. To prove it correct
numerically, and to compose transforms, we must know how each new input is
cut from an original input and how each original output is rebuilt from new
outputs. :class:`Distributed` records both:

* ``inputs``: every input of the new function -> an :class:`InputSlice`: the
  original input's name and a chain of equal splits ``(axis, index, parts)``
  applied in order (empty chain: a full copy, e.g. a replicated weight). A
  dimension the parts do not divide is padded with zeros to the next multiple
  first (ZeRO's shards of a weight whose rows the replicas do not divide).
* ``outputs``: every original output -> a :class:`Recipe` tree whose leaves
  name new outputs and whose nodes say how to combine them: ``"concat"``
  along an axis (a sharded result), ``"sum"`` (partial results, e.g. each
  data-parallel replica's share of the loss) or ``"replica"`` (identical
  copies; checking they really are identical is part of the proof).

Transforms accept a :class:`Function` or a :class:`Distributed` and compose by
substituting maps, so ``data_parallel(pipeline_parallel(fn, ...), ...)`` still
relates to the original ``fn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Union

import numpy as np

from distir_jax.ir.function import Function
from distir_jax.ir.shape_rules import split_padded

Split = tuple[int, int, int]  # (axis, index, parts)


@dataclasses.dataclass(frozen=True)
class InputSlice:
    """A new input is ``source`` split along ``splits`` in order."""

    source: str
    splits: tuple[Split, ...] = ()

    def then(self, axis: int, index: int, parts: int) -> InputSlice:
        return InputSlice(self.source, self.splits + ((axis, index, parts),))

    def cut(self, value: np.ndarray) -> np.ndarray:
        for axis, index, parts in self.splits:  # padded where parts do not divide (see above)
            value = split_padded(value, parts, axis)[index]
        return value


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to rebuild one original output from outputs of the new program.

    Either a leaf (``name`` set) or a combination of ``parts``.
    """

    name: str | None = None
    kind: str = "leaf"  # "leaf" | "concat" | "sum" | "replica"
    parts: tuple[Recipe, ...] = ()
    axis: int = 0
    size: int | None = None  # "concat": keep the first `size` along `axis` (padded shards)

    @staticmethod
    def leaf(name: str) -> Recipe:
        return Recipe(name=name)

    @staticmethod
    def combine(kind: str, parts, axis: int = 0, size: int | None = None) -> Recipe:
        if kind not in ("concat", "sum", "replica"):
            raise ValueError(f"unknown recipe kind {kind!r}; expected concat, sum or replica")
        if size is not None and kind != "concat":
            raise ValueError(f"only a concat recipe keeps a size, got kind {kind!r}")
        parts = tuple(parts)
        if len(parts) == 1 and size is None:
            return parts[0]
        return Recipe(kind=kind, parts=parts, axis=axis, size=size)

    def leaves(self) -> tuple[str, ...]:
        if self.kind == "leaf":
            return (self.name,)
        return tuple(n for p in self.parts for n in p.leaves())

    def substitute(self, table: Mapping[str, Recipe]) -> Recipe:
        """Replaces each leaf by ``table[leaf]`` (composing two transforms)."""
        if self.kind == "leaf":
            return table[self.name]
        parts = tuple(p.substitute(table) for p in self.parts)
        return dataclasses.replace(self, parts=parts)

    def build(self, values: Mapping[str, np.ndarray], rtol: float = 1e-9, atol: float = 1e-12) -> np.ndarray:
        """Evaluates the recipe; raises if replicas that must agree do not."""
        if self.kind == "leaf":
            return np.asarray(values[self.name])
        built = [p.build(values, rtol, atol) for p in self.parts]
        if self.kind == "concat":
            whole = np.concatenate(built, axis=self.axis)
            return whole if self.size is None else np.take(whole, np.arange(self.size), axis=self.axis)
        if self.kind == "sum":
            return np.sum(np.stack(built), axis=0)
        for other, part in zip(built[1:], self.parts[1:]):
            if not np.allclose(other, built[0], rtol=rtol, atol=atol):
                raise AssertionError(
                    f"replicas disagree: {part.leaves()} differs from {self.parts[0].leaves()}"
                )
        return built[0]


@dataclasses.dataclass(frozen=True)
class Distributed:
    """A transformed program and its relation to the original program."""

    function: Function
    inputs: Mapping[str, InputSlice]
    outputs: Mapping[str, Recipe]

    @staticmethod
    def identity(fn: Function) -> Distributed:
        return Distributed(
            fn,
            {v.name: InputSlice(v.name) for v in fn.inputs},
            {v.name: Recipe.leaf(v.name) for v in fn.outputs},
        )

    def then(self, step: Distributed) -> Distributed:
        """Composes: ``step`` transformed ``self.function``; relate it to the original."""
        inputs = {}
        for name, sl in step.inputs.items():
            base = self.inputs[sl.source]
            inputs[name] = InputSlice(base.source, base.splits + sl.splits)
        outputs = {name: recipe.substitute(step.outputs) for name, recipe in self.outputs.items()}
        return Distributed(step.function, inputs, outputs)

    def shard_inputs(self, original: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Input arrays for the new program, cut from the original program's inputs."""
        return {name: sl.cut(np.asarray(original[sl.source])) for name, sl in self.inputs.items()}

    def gather_outputs(
        self, new_values: Mapping[str, np.ndarray], rtol: float = 1e-9
    ) -> dict[str, np.ndarray]:
        """The original program's outputs, rebuilt from the new program's outputs."""
        return {name: recipe.build(new_values, rtol) for name, recipe in self.outputs.items()}


Program = Union[Function, Distributed]


def as_distributed(program: Program) -> Distributed:
    return program if isinstance(program, Distributed) else Distributed.identity(program)
