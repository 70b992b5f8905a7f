"""Per-op layout rules of the tensor-parallel transform.

Under a split of degree ``t`` every value of the original program has one
:class:`Layout` across the ``t`` ranks:

* ``REPLICATED``: every rank holds the whole value (identical copies);
* ``sharded(axis)``: rank ``r`` holds part ``r`` of ``t`` equal parts along
  ``axis``;
* ``PARTIAL``: every rank holds a value of the full shape and the original is
  their sum (the output of a row-split MatMul before its all-reduce).

For each op, :func:`plan_op` says which layout each operand must be in (the
rewriter inserts the collective or local split that converts it) and which
layout each result then has. Rules read only the op's type, its attributes
(``tp``, ``tp_axis``, transposes) and its operand layouts, never value names,
so programs already rewritten by other transforms are handled alike.
"""

from __future__ import annotations

from typing import NamedTuple

from distir_jax.ir.function import Op
from distir_jax.ir.types import dim_divides, dims_equal

REPLICATED_KIND, SHARDED_KIND, PARTIAL_KIND = "replicated", "sharded", "partial"


class Layout(NamedTuple):
    """How one original value is laid out over the tensor-parallel ranks."""

    kind: str
    axis: int = -1  # the split axis (non-negative) of a sharded value

    def __str__(self) -> str:
        return f"sharded(axis={self.axis})" if self.kind == SHARDED_KIND else self.kind


REPLICATED = Layout(REPLICATED_KIND)
PARTIAL = Layout(PARTIAL_KIND)


def sharded(axis: int) -> Layout:
    return Layout(SHARDED_KIND, int(axis))


class Plan(NamedTuple):
    """What one op needs and yields.

    Attributes:
      inputs: the layout each operand must have when the op runs.
      outputs: the layout of each result.
      split_inputs: per operand, whether a function input read here for the
        first time may be declared split (weights of col/row MatMuls and
        optimizer states) instead of replicated and split by a local op.
      vocab: the op works on its rank's part of the vocabulary (``tp="vocab"``
        ops that are split): the rewriter gives it ``vocab_index`` and
        ``vocab_parts``, and a cross entropy reads every part's statistics.
    """

    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    split_inputs: tuple[bool, ...]
    vocab: bool = False


# Ops computing each output element from the same element of each operand.
ELEMENTWISE = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "Neg",
        "Identity",
        "Exp",
        "Tanh",
        "Scale",
        "ReluGrad",
        "TanhGrad",
        "Gelu",
        "GeluGrad",
        "Cast",
    }
)
# Elementwise ops that are linear in all their operands: sums of partial
# operands give partial results, so no all-reduce is needed before them.
LINEAR = frozenset({"Add", "Sub", "Neg", "Identity", "Scale", "Cast"})
OPTIMIZERS = frozenset({"SGD", "Adam"})
# Communication ops, with the attribute naming the axis they split or concat.
COLLECTIVE_AXES = {
    "Send": (),
    "AllReduce": (),
    "Broadcast": (),
    "AllGather": ("axis",),
    "ReduceScatter": ("axis",),
    "Scatter": ("axis",),
    "Gather": ("axis",),
    "AllToAll": ("split_axis", "concat_axis"),
}
# Activations are split along this axis (counted from the end) under sequence
# parallelism: S in [B, S, H] for the transformer, the token (batch) axis in
# the MLP's [B, H].
SEQUENCE_FROM_END = 2


class RuleError(ValueError):
    """An op whose annotations the transform cannot honour."""


def _all(layout: Layout, n: int) -> tuple[Layout, ...]:
    return (layout,) * n


def _ranks(op: Op) -> list[int]:
    return [v.type.rank for v in op.inputs]


def _uniform(layout: Layout, op: Op) -> Plan:
    n = len(op.inputs)
    return Plan(_all(layout, n), _all(layout, len(op.outputs)), _all(False, n))


def _from_end(op: Op, layouts) -> int | None:
    """``rank - axis`` of the first sharded operand, or ``None``."""
    for v, layout in zip(op.inputs, layouts, strict=True):
        if layout.kind == SHARDED_KIND:
            return v.type.rank - layout.axis
    return None


def _aligned(op: Op, from_end: int, index: int) -> Layout:
    """Operand ``index`` split on the axis ``from_end`` from the end, unless it broadcasts there."""
    t = op.inputs[index].type
    out = op.outputs[0].type
    axis = t.rank - from_end
    out_axis = out.rank - from_end
    if axis < 0 or (dims_equal(t.shape[axis], 1) and not dims_equal(out.shape[out_axis], 1)):
        return REPLICATED  # broadcast along the split axis: every rank needs it whole
    return sharded(axis)


def _split_along(op: Op, from_end: int) -> Plan:
    """Every operand and result split on the axis ``from_end`` from the end."""
    n = len(op.inputs)
    inputs = tuple(_aligned(op, from_end, i) for i in range(n))
    outputs = tuple(sharded(v.type.rank - from_end) for v in op.outputs)
    return Plan(inputs, outputs, _all(False, n))


def _matmul_split(op: Op, hint: str) -> Plan:
    """Megatron's column / row split of ``x @ W`` and of its two gradients."""
    a_rank, b_rank = _ranks(op)
    out_rank = op.outputs[0].type.rank
    ta, tb = bool(op.attr("transpose_a", False)), bool(op.attr("transpose_b", False))
    last = lambda rank: sharded(rank - 1)  # noqa: E731
    second_last = lambda rank: sharded(rank - 2)  # noqa: E731
    if ta and tb:
        raise RuleError(f"a tp={hint!r} MatMul with transpose_a and transpose_b is not a Megatron matmul")
    if hint == "col":
        if ta:  # dW = x^T @ dy: x whole, dy split by columns -> dW split by columns.
            return Plan((REPLICATED, last(b_rank)), (last(out_rank),), (False, False))
        if tb:  # dx = dy @ W^T: contracts the split axis -> partial sums.
            return Plan((last(a_rank), last(b_rank)), (PARTIAL,), (False, True))
        return Plan((REPLICATED, last(b_rank)), (last(out_rank),), (False, True))
    if ta:  # dW = x^T @ dy: x split by columns -> dW split by rows.
        return Plan((last(a_rank), REPLICATED), (second_last(out_rank),), (False, False))
    if tb:  # dx = dy @ W^T with W split by rows -> dx split by columns.
        return Plan((REPLICATED, second_last(b_rank)), (last(out_rank),), (False, True))
    return Plan((last(a_rank), second_last(b_rank)), (PARTIAL,), (False, True))


def _split_region(op: Op, layouts, hint: str) -> Plan:
    """``heads`` / ``sharded`` ops: each rank works on its own heads or features."""
    if op.op_type == "Reshape":
        tp_axis = op.attr("tp_axis")
        if tp_axis is None:
            raise RuleError(f"a Reshape with tp={hint!r} needs attribute tp_axis")
        if layouts[0].kind != SHARDED_KIND:
            raise RuleError(f"a Reshape with tp={hint!r} reads %{op.inputs[0].name}, which is {layouts[0]}")
        out_rank = op.outputs[0].type.rank
        return Plan((layouts[0],), (sharded(int(tp_axis) % out_rank),), (False,))
    from_end = _from_end(op, layouts)
    if from_end is None:
        raise RuleError(
            f"tp={hint!r} marks it as working on split values, but no operand is split "
            f"(operand layouts: {', '.join(map(str, layouts))})"
        )
    rank = op.inputs[0].type.rank
    axis = rank - from_end
    if op.op_type == "Transpose":
        return Plan((sharded(axis),), (sharded(tuple(op.attr("perm")).index(axis)),), (False,))
    # Splitting or concatenating along the split axis, or contracting it,
    # would mix ranks' parts: the annotations must keep it a batch axis.
    if (op.op_type in ("Split", "Concat") and int(op.attr("axis", 0)) % rank == axis) or (
        op.op_type == "MatMul" and axis >= rank - 2
    ):
        raise RuleError(f"tp={hint!r} needs the split axis {axis} to stay a batch axis of the op")
    return _split_along(op, from_end)


def _elementwise(op: Op, layouts, sequence_parallel: bool) -> Plan:
    """Unannotated elementwise ops: follow a split operand, keep partial sums, or replicate."""
    from_end = _from_end(op, layouts)
    if from_end is not None:  # follow the split operand: no communication
        return _split_along(op, from_end)
    if all(layout == PARTIAL for layout in layouts) and op.op_type in LINEAR:
        return _uniform(PARTIAL, op)
    if sequence_parallel and PARTIAL in layouts and op.outputs[0].type.rank >= SEQUENCE_FROM_END:
        # A residual add or activation after a row MatMul: reduce-scatter the
        # partial sums along the sequence instead of all-reducing them.
        return _split_along(op, SEQUENCE_FROM_END)
    return _uniform(REPLICATED, op)


def _layer_norm(op: Op, layouts, sequence_parallel: bool) -> Plan:
    """LayerNorm(x, gamma, beta) and LayerNormGrad(dy, x, gamma): rows are independent."""
    rank = op.inputs[0].type.rank
    activations = 1 if op.op_type == "LayerNorm" else 2
    from_end = None
    for layout in layouts[:activations]:
        if layout.kind == SHARDED_KIND and layout.axis != rank - 1:
            from_end = rank - layout.axis
            break
    if from_end is None and sequence_parallel and rank >= SEQUENCE_FROM_END:
        from_end = SEQUENCE_FROM_END
    if from_end is None:
        return _uniform(REPLICATED, op)
    row_split = sharded(rank - from_end)
    inputs = _all(row_split, activations) + _all(REPLICATED, len(op.inputs) - activations)
    # dgamma and dbeta sum over rows: each rank holds its rows' share.
    outputs = (row_split,) if op.op_type == "LayerNorm" else (row_split, PARTIAL, PARTIAL)
    return Plan(inputs, outputs, _all(False, len(op.inputs)))


def _collective(op: Op, layouts) -> Plan:
    """Existing Sends and collectives run once per rank, on that rank's part.

    They are linear, so partial operands give partial results; a value split
    along the axis the collective concatenates or splits is gathered first.
    """
    layout = layouts[0]
    if any(other != layout for other in layouts[1:]):
        layout = REPLICATED
    if layout.kind == SHARDED_KIND:
        rank = op.inputs[0].type.rank
        busy = {int(op.attr(key, 0)) % rank for key in COLLECTIVE_AXES[op.op_type]}
        if layout.axis in busy:
            layout = REPLICATED
    return _uniform(layout, op)


def _optimizer(op: Op, layouts) -> Plan:
    """An update runs on each rank's part of its weight; state and gradient follow the weight."""
    layout = layouts[0]
    n = len(op.inputs)
    return Plan(_all(layout, n), _all(layout, len(op.outputs)), (False,) + _all(True, n - 1))


def _cast_into(layouts) -> Plan:
    """A weight's FP8 copy refreshed from the weight (mixed-fp8): both in the copy's
    layout, which the GEMM that reads it gave it. The weight's first reader
    (its GEMMs read the copies) places it so, as the GEMMs would have."""
    layout = layouts[0]
    return Plan((layout, layout), (layout,), (False, True))


# Losses that a split by vocabulary rewrites to read every part's statistics.
CROSS_ENTROPY = frozenset({"SoftmaxCrossEntropy", "SoftmaxCrossEntropyGrad"})


def _vocab_size(op: Op):
    """The vocabulary an op with ``tp="vocab"`` works on (the token table's rows, the LM
    head's columns, the logits' last axis: Megatron-LM splits them all by vocabulary)."""
    if op.op_type == "Embedding":
        return op.inputs[0].type.shape[0]
    if op.op_type == "EmbeddingGrad":
        return op.attr("num_embeddings")
    if op.op_type == "MatMul":  # x @ W, x^T @ dlogits, dlogits @ W^T: the second operand's last axis
        return op.inputs[1].type.shape[-1]
    return op.inputs[0].type.shape[-1]  # logits, or a Reshape of them


def _vocab(op: Op, layouts, degree: int) -> Plan:
    """Vocabulary parallelism where ``degree`` divides the vocabulary; else whole values
    (also for ops an earlier split already cut by vocabulary: a second split keeps
    each part whole, replicated over its new ranks)."""
    if not dim_divides(_vocab_size(op), degree) or int(op.attr("vocab_parts", 1)) > 1:
        return _uniform(REPLICATED, op)
    last = sharded(op.inputs[0].type.rank - 1)
    if op.op_type == "Embedding":  # each rank looks up its rows: zeros elsewhere, partial sums
        return Plan((sharded(0), REPLICATED), (PARTIAL,), (True, False), vocab=True)
    if op.op_type == "EmbeddingGrad":  # each rank scatters into its own rows
        return Plan((REPLICATED, REPLICATED), (sharded(0),), (False, False), vocab=True)
    if op.op_type == "MatMul":
        return _matmul_split(op, "col")
    if op.op_type in CROSS_ENTROPY:
        out = REPLICATED if op.op_type == "SoftmaxCrossEntropy" else last
        return Plan((last, REPLICATED), (out,), (False, False), vocab=True)
    if op.op_type == "Reshape":
        return _split_region(op, layouts, "vocab")
    raise RuleError(
        f"tp='vocab' is meaningful on Embedding, EmbeddingGrad, MatMul, Reshape and "
        f"{', '.join(sorted(CROSS_ENTROPY))}, not {op.op_type}"
    )


def plan_op(op: Op, layouts, *, sequence_parallel: bool, degree: int) -> Plan:
    """The layouts op ``op`` needs and produces, given its operands' current layouts.

    Args:
      op: a typed op of the program being split.
      layouts: the current layout of each operand (function inputs not yet
        placed count as replicated).
      sequence_parallel: split replicated-region activations along the
        sequence axis (Megatron-3).
      degree: the split's degree (``tp="vocab"`` ops split only a vocabulary it divides).

    Raises:
      RuleError: for a ``tp`` hint the op cannot carry.
    """
    hint = op.attr("tp")
    if hint in ("col", "row"):
        if op.op_type != "MatMul":
            raise RuleError(f"tp={hint!r} is only meaningful on a MatMul")
        return _matmul_split(op, hint)
    if hint in ("heads", "sharded"):
        return _split_region(op, layouts, hint)
    if hint == "vocab":
        return _vocab(op, layouts, degree)
    if hint is not None:
        raise RuleError(f"unknown tp hint tp={hint!r}; expected col, row, heads, sharded or vocab")
    if op.op_type in COLLECTIVE_AXES:
        return _collective(op, layouts)
    if op.op_type in OPTIMIZERS:
        return _optimizer(op, layouts)
    if op.op_type == "CastInto":
        return _cast_into(layouts)
    if op.op_type in ELEMENTWISE:
        return _elementwise(op, layouts, sequence_parallel)
    if op.op_type in ("LayerNorm", "LayerNormGrad"):
        return _layer_norm(op, layouts, sequence_parallel)
    # Unannotated embeddings, losses, reductions and layout ops work on whole values.
    return _uniform(REPLICATED, op)
