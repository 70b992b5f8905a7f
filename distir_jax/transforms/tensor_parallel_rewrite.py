"""The rewriter behind :func:`~distir_jax.transforms.tensor_parallel.tensor_parallel`.

It walks the original program once, in issue order. For each op it asks
:func:`~distir_jax.transforms.tensor_parallel_rules.plan_op` which layout each
operand must have, converts operands that are not in it (a collective, or a
local ``Split`` when a replicated value only needs to be cut), then emits one
copy of the op per rank. Conversions are placed lazily, just before the first
op that needs them, and reused by later consumers, so each partial sum is
all-reduced once however many ops read it.

Rank ``r`` of old device ``d`` runs on new device ``r * D + d`` (``D``: device
count of the input program). A symmetry-reduced rewrite builds rank 0 only and
gives every inserted collective a ``group`` attribute naming all ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.shape_rules import shape_str
from distir_jax.ir.typecheck import infer_op_types
from distir_jax.ir.types import TensorType, dim_divides, dim_str, dims_equal
from distir_jax.transforms.base import InputSlice, Recipe
from distir_jax.transforms.tensor_parallel_rules import (
    COLLECTIVE_AXES,
    CROSS_ENTROPY,
    PARTIAL,
    REPLICATED,
    SHARDED_KIND,
    Layout,
    Plan,
    RuleError,
    plan_op,
)

_DEVICE_ATTRS = ("to", "devices", "group")
_RECIPE_KINDS = {"replicated": "replica", "partial": "sum", SHARDED_KIND: "concat"}


def old_device_count(fn: Function) -> int:
    """Devices of ``fn``, counting those named only by collectives' attributes."""
    found = set(fn.devices)
    for op in fn.ops:
        if op.op_type in COLLECTIVE_AXES:
            for key in _DEVICE_ATTRS:
                value = op.attr(key)
                if value is not None:
                    found.update(int(d) for d in (value if isinstance(value, tuple) else (value,)))
    return 1 + max(found, default=0)


def group_sized_gathers() -> bool:
    """Whether AllGather sizes its result by its ``group`` (needed by rank-0-only programs)."""
    t = TensorType((2,), "f32", 0)
    probe = Op("AllGather", (Value("x", t),), (), {"axis": 0, "group": (0, 1)})
    try:
        (out,) = infer_op_types(probe, 0, (t,))
    except ValueError:
        return False
    return dims_equal(out.shape[0], 4)


class Rewriter:
    """Builds the split program; read :attr:`ops`, :meth:`inputs`, :meth:`outputs` after :meth:`run`."""

    def __init__(self, fn: Function, degree: int, *, sequence_parallel: bool, representative_only: bool):
        self.fn = fn
        self.degree = degree
        self.sequence_parallel = sequence_parallel
        self.representative = representative_only
        self.ranks = (0,) if representative_only else tuple(range(degree))
        self.num_old_devices = old_device_count(fn)
        self.ops: list[Op] = []
        self.slices: dict[str, InputSlice] = {}
        self._names: set[str] = set()
        self._inputs = {v.name: v for v in fn.inputs}
        self._types = {name: v.type for name, v in fn.values().items()}
        # Layout and per-rank values of every original value; None: an input
        # not placed yet (its first use decides whether it arrives split).
        self._layout: dict[str, Layout | None] = {v.name: None for v in fn.inputs}
        self._parts: dict[str, tuple[Value, ...]] = {}
        self._converted: dict[tuple, tuple[Value, ...]] = {}
        self._statistics: dict[str, tuple[Value, ...]] = {}  # by logits: every part's, gathered
        self._producer = fn.producers()

    # ------------------------------------------------------------------ #
    # Walking the program.

    def run(self) -> None:
        for index, op in enumerate(self.fn.ops):
            self._rewrite(index, op)
        for v in self.fn.inputs:
            if self._layout[v.name] is None:
                self._place_input(v.name, REPLICATED)

    def inputs(self) -> list[Value]:
        return [p for v in self.fn.inputs for p in self._parts[v.name]]

    def outputs(self) -> tuple[list[Value], dict[str, Recipe]]:
        """New outputs (every rank's part of each original output) and their recipes.

        A rank-0-only program can rebuild only the outputs rank 0 holds
        whole (replicated ones); the others get no recipe.
        """
        values, recipes = [], {}
        for v in self.fn.outputs:
            layout, parts = self._layout[v.name], self._parts[v.name]
            values.extend(parts)
            leaves = [Recipe.leaf(p.name) for p in parts]
            if self.representative:
                if layout == REPLICATED:
                    recipes[v.name] = leaves[0]
                continue
            axis = layout.axis if layout.kind == SHARDED_KIND else 0
            recipes[v.name] = Recipe.combine(_RECIPE_KINDS[layout.kind], leaves, axis=axis)
        return values, recipes

    def _rewrite(self, index: int, op: Op) -> None:
        layouts = [self._layout[v.name] or REPLICATED for v in op.inputs]
        try:
            plan = plan_op(op, layouts, sequence_parallel=self.sequence_parallel, degree=self.degree)
        except RuleError as e:
            raise ValueError(f"tensor_parallel: op #{index} {op.op_type}{_results(op)}: {e}") from None
        args = [
            self._convert(v.name, target, op, may_split)
            for v, target, may_split in zip(op.inputs, plan.inputs, plan.split_inputs, strict=True)
        ]
        op_type = op.op_type
        if plan.vocab and op_type in CROSS_ENTROPY:  # from every part's statistics
            stats = self._vocab_statistics(op, args[0], args[1])
            if op_type == "SoftmaxCrossEntropy":
                op_type, args = "CrossEntropyFromStats", [stats]
            else:
                args = args + [stats]
        per_rank = []
        for k, rank in enumerate(self.ranks):
            names = [self._fresh(f"{v.name}.tp{rank}") for v in op.outputs]
            attrs = self._rank_attrs(op, rank, plan)
            per_rank.append(self._emit(op_type, [a[k] for a in args], names, attrs))
        for j, v in enumerate(op.outputs):
            parts = tuple(outs[j] for outs in per_rank)
            self._check_part(index, op, v, plan.outputs[j], parts[0])
            self._layout[v.name], self._parts[v.name] = plan.outputs[j], parts

    def _rank_attrs(self, op: Op, rank: int, plan: Plan) -> dict:
        attrs = op.attr_dict
        split = bool(plan.outputs) and plan.outputs[0].kind == SHARDED_KIND
        if op.op_type == "Reshape" and split and op.attr("tp") is not None and "tp_axis" in attrs:
            # The model's contract: tp_axis names the entry of `shape` (heads,
            # or a split width) that a split of degree t divides by t.
            shape = list(attrs["shape"])
            shape[attrs["tp_axis"]] //= self.degree
            attrs["shape"] = tuple(shape)
        # This rank's part of the vocabulary (a split loss reads every part's statistics instead).
        if plan.vocab and op.op_type != "SoftmaxCrossEntropy":
            attrs.update(vocab_index=rank, vocab_parts=self.degree)
            if op.op_type == "EmbeddingGrad":
                attrs["num_embeddings"] = int(attrs["num_embeddings"]) // self.degree
        if attrs.get("tp") == "vocab" and any(x != REPLICATED for x in plan.inputs + plan.outputs):
            # Split by vocabulary once: a second split keeps each part whole.
            del attrs["tp"]
        if op.op_type in COLLECTIVE_AXES:
            for key in _DEVICE_ATTRS:
                if key in attrs:
                    value = attrs[key]
                    attrs[key] = (
                        tuple(self._device(rank, d) for d in value)
                        if isinstance(value, tuple)
                        else self._device(rank, value)
                    )
        return attrs

    def _check_part(self, index, op, original: Value, layout: Layout, part: Value) -> None:
        # A plan that disagrees with the shapes the ops really produce would
        # give wrong recipes; fail here, where the op is known.
        expected = list(original.type.shape)
        if layout.kind == SHARDED_KIND:
            expected[layout.axis] = expected[layout.axis] // self.degree
        got = part.type.shape
        if len(got) != len(expected) or not all(dims_equal(a, b) for a, b in zip(got, expected, strict=True)):
            raise ValueError(
                f"tensor_parallel: op #{index} {op.op_type}{_results(op)}: %{original.name} should be "
                f"{layout} with per-rank shape {shape_str(expected)}, but the rewritten op produces "
                f"{shape_str(got)}; check its tp / tp_axis annotations"
            )

    # ------------------------------------------------------------------ #
    # Values, inputs and emission.

    def _device(self, rank: int, device: int) -> int:
        return rank * self.num_old_devices + int(device)

    def _fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def _emit(self, op_type: str, inputs, names, attrs: Mapping) -> tuple[Value, ...]:
        probe = Op(op_type, tuple(inputs), (), dict(attrs))
        types = infer_op_types(probe, len(self.ops), tuple(v.type for v in inputs))
        outputs = tuple(Value(n, t) for n, t in zip(names, types, strict=True))
        self.ops.append(probe._with_values(probe.inputs, outputs))
        return outputs

    def _place_input(self, name: str, layout: Layout) -> None:
        """Declares the per-rank copies of original input ``name``, split per ``layout``."""
        original = self._inputs[name]
        shape = list(original.type.shape)
        if layout.kind == SHARDED_KIND:
            self._check_divides(name, shape, layout.axis)
            shape[layout.axis] = shape[layout.axis] // self.degree
        parts = []
        for rank in self.ranks:
            t = TensorType(tuple(shape), original.type.dtype, self._device(rank, original.type.device))
            value = Value(self._fresh(f"{name}.tp{rank}"), t)
            splits = ((layout.axis, rank, self.degree),) if layout.kind == SHARDED_KIND else ()
            self.slices[value.name] = InputSlice(name, splits)
            parts.append(value)
        self._layout[name], self._parts[name] = layout, tuple(parts)

    def _check_divides(self, name: str, shape, axis: int) -> None:
        if not dim_divides(shape[axis], self.degree):
            hint = (
                " (sequence_parallel=True splits activations along their sequence axis, the one "
                "before the hidden axis)"
                if self.sequence_parallel
                else ""
            )
            raise ValueError(
                f"tensor_parallel: degree={self.degree} must divide dimension {axis} of %{name} "
                f"{shape_str(shape)} (size {dim_str(shape[axis])}) to split it across ranks{hint}"
            )

    # ------------------------------------------------------------------ #
    # Layout conversions.

    def _convert(self, name: str, target: Layout, consumer: Op, may_split_input: bool) -> tuple[Value, ...]:
        """``name``'s per-rank values in layout ``target``, converting (once) if needed."""
        if self._layout[name] is None:
            placed = target if may_split_input and target != PARTIAL else REPLICATED
            self._place_input(name, placed)
        layout = self._layout[name]
        if layout == target:
            return self._parts[name]
        gathers = layout.kind == SHARDED_KIND and target == REPLICATED
        # A gathered activation is gathered again in the backward pass rather
        # than kept alive from the forward (Megatron-3 re-gathers the
        # sequence-parallel input of a column MatMul the same way).
        key = (name, target, consumer.attr("phase") if gathers else None)
        if key not in self._converted:
            self._converted[key] = self._conversion(name, layout, target, consumer)
        return self._converted[key]

    def _conversion(self, name: str, layout: Layout, target: Layout, consumer: Op) -> tuple[Value, ...]:
        parts = self._parts[name]
        if target == REPLICATED:
            if layout == PARTIAL:
                # A gradient's sync right before its update (a LayerNorm's under sequence
                # parallelism, partial over sequence parts) sums in place, as Megatron-LM's
                # does: nothing else reads the partial sums.
                attrs = {"inplace": True} if consumer.attr("phase") == "opt" else {}
                return self._collective("AllReduce", parts, attrs, f"{name}.allreduce", consumer)
            phase = consumer.attr("phase")
            base = f"{name}.allgather" if phase in (None, "fwd") else f"{name}.allgather_{phase}"
            return self._collective("AllGather", parts, {"axis": layout.axis}, base, consumer)
        if target.kind != SHARDED_KIND:
            raise ValueError(f"tensor_parallel: cannot turn %{name} from {layout} into {target}")
        self._check_divides(name, list(self._types[name].shape), target.axis)
        if layout == PARTIAL:
            return self._collective(
                "ReduceScatter", parts, {"axis": target.axis}, f"{name}.reducescatter", consumer
            )
        if layout != REPLICATED:
            parts = self._convert(name, REPLICATED, consumer, False)
        return self._local_split(parts, target.axis, f"{name}.split{target.axis}", consumer, name)

    def _vocab_statistics(self, op: Op, logits, labels) -> tuple[Value, ...]:
        """Every rank's ``[..., 3 t]`` statistics of the logits (:func:`CrossEntropyStats`
        of each part, all-gathered along the last axis), computed once per logits
        value: the loss and its gradient share them, as Megatron-LM's backward
        reuses what its forward kept."""
        name = op.inputs[0].name
        if name not in self._statistics:
            parts = []
            for k, rank in enumerate(self.ranks):
                attrs = dict(_placement(op), vocab_index=rank, vocab_parts=self.degree)
                names = [self._fresh(f"{name}.stats.tp{rank}")]
                parts += self._emit("CrossEntropyStats", [logits[k], labels[k]], names, attrs)
            axis = op.inputs[0].type.rank - 1
            self._statistics[name] = self._collective(
                "AllGather", parts, {"axis": axis}, f"{name}.stats.allgather", op
            )
        return self._statistics[name]

    def _collective(self, op_type: str, parts, attrs: dict, base: str, consumer: Op) -> tuple[Value, ...]:
        attrs = dict(attrs, **_placement(consumer))
        if self.representative:
            if op_type in ("AllGather", "ReduceScatter") and not group_sized_gathers():
                raise ValueError(
                    f"tensor_parallel: representative_only=True needs a rank-0-only {op_type}, but "
                    f"this IR sizes {op_type}'s result by its operand count, not by its `group` "
                    "attribute; use representative_only=False (sequence_parallel=True always "
                    "needs AllGather and ReduceScatter)"
                )
            device = parts[0].type.device  # rank 0's device is the old device
            attrs["group"] = tuple(self._device(rank, device) for rank in range(self.degree))
        names = [self._fresh(f"{base}.tp{rank}") for rank in self.ranks]
        return self._emit(op_type, parts, names, attrs)

    def _local_split(self, parts, axis: int, base: str, consumer: Op, name: str) -> tuple[Value, ...]:
        """Each rank cuts its own part out of replicated value ``name``: no communication.

        The cut is local work of the value's producer, so it carries the
        producer's layer (issued, as every conversion, right before the
        consumer): under sequence parallelism a whole vocabulary's embedding
        output is cut into sequence parts in the embedding, as Megatron-LM's
        embedding scatters its output, not in the first block."""
        placement = _placement(consumer)
        index = self._producer.get(name)
        layer = None if index is None else self.fn.ops[index].attr("layer")
        if layer is not None:
            placement["layer"] = layer
        mine = []
        for k, rank in enumerate(self.ranks):
            names = [self._fresh(f"{base}_{j}.tp{rank}") for j in range(self.degree)]
            pieces = self._emit("Split", [parts[k]], names, dict(axis=axis, parts=self.degree, **placement))
            mine.append(pieces[rank])
        return tuple(mine)


def _placement(consumer: Op) -> dict:
    """``layer`` and ``phase`` of the op a new op serves."""
    return {k: consumer.attr(k) for k in ("layer", "phase") if consumer.attr(k) is not None}


def _results(op: Op) -> str:
    return " (-> " + ", ".join("%" + v.name for v in op.outputs) + ")" if op.outputs else ""
