"""Data parallelism: replicate a training program, split its batch, reduce its gradients.

:func:`data_parallel` works on any training program that keeps the model
annotation contract (see :mod:`distir_jax.models`), including programs that
other transforms already spread over several devices:

* **Inputs.** An input whose *original* name (its :class:`InputSlice` source)
  is a weight or optimizer state (``l{layer}.…``) is replicated; every other
  input is data and is split along axis 0, its batch axis.
* **Devices.** Replica ``r`` runs old device ``d`` on new device
  ``r * D_old + d``, so data-parallel replicas are the outermost rank.
* **Ops.** Every op is copied once per replica (copies adjacent in issue
  order) and re-typed by the builder. Device attributes (``to``, ``devices``,
  ``group``) are remapped; losses get ``shards *= degree`` so that the
  replicas' losses and gradients add up to the original's.
* **Gradients.** The value to reduce is the gradient operand of each optimizer
  op (``SGD`` / ``Adam`` with ``phase="opt"``): after any microbatch
  accumulation, and one per old device when a weight is sharded, so no
  ``grad_of`` bookkeeping is needed. Each gets an ``AllReduce`` (sum) over its
  replicas' copies. A gradient that a tensor group's ``AllReduce`` syncs in
  the optimizer phase (a LayerNorm's under sequence parallelism) is reduced
  before that sync, in the backward pass, as Megatron-LM does.
* **Placement.** Without ``overlap`` the reductions of an old device are issued
  together right before the first op that needs one of them (its optimizer),
  as DistIR does after the whole backward pass. With ``overlap`` each one is
  issued on stream 1 right after its gradient is produced, so it runs during
  the rest of the backward pass; anything that must wait for it (unpacking a
  bucket, the optimizer) is issued as late as possible on stream 0.
* **Buckets** (``bucket_bytes``). Consecutive gradients of one device share one
  all-reduce: each is flattened (a free Reshape), they are concatenated, the
  bucket is reduced, then cut back. The IR has no slicing op, only ``Split``
  into equal parts, so a bucket is cut into pieces of the gcd of its
  gradients' sizes and each gradient's pieces are concatenated and reshaped.
  A bucket closes when adding a gradient would exceed ``bucket_bytes`` (a
  larger gradient forms its own bucket), change the dtype, or need more than
  :data:`MAX_BUCKET_PIECES` pieces. Unlike PyTorch's DDP, whose gradients are
  views into the bucket, the cut-back copies cost memory traffic here.
* **ZeRO-1** (``zero``). Gradients are reduce-scattered along axis 0 in
  place (``ReduceScatter(inplace=True)``: each shard is part of its
  gradient's buffer, which lives until the update, as in ZeRO's flat
  gradient buffers). Each replica updates its shard with its shard of the
  optimizer state (Adam's ``m`` and ``v``, and a mixed-precision update's f32
  master copy, become per-replica inputs) and of the weight, a view
  ``{w}.dp{r}.master = Shard(w)`` (ZeRO partitions the master weights with
  the optimizer state; with mixed precision this is the half-precision shard
  the update writes, next to the f32 master's), then the updated weight
  shards are all-gathered in place (``AllGather(inplace=True)``) into the
  weight's own buffer, as Megatron-LM's distributed optimizer gathers into
  its parameter buffer: the weight is counted once. (A weight only its
  optimizer reads has no full copy: its shard is an input and the gathered
  weight a new buffer.) A weight whose rows the degree does not divide is
  padded with zero rows to the next multiple, as ZeRO implementations pad their flat buffers:
  shards of ``ceil(rows / degree)`` rows (``ReduceScatter(pad=True)``; the
  padded rows' gradient, state and update stay zero), and the gather keeps
  the first ``rows`` (``AllGather(size=rows)``); sharded outputs are rebuilt
  the same way.

Symmetry reduction (``representative_only``): only replica 0 is built, and
each new collective carries ``group`` = its full group's devices, numbered as
in the full program, so replica 0's simulated step time and memory are the
full program's. Its collectives sum a single operand, so it does not compute
the original numbers, and its maps are partial: inputs are replica 0's slices
and every original output maps to replica 0's copy alone. (ReduceScatter and
AllGather size their results by ``group``, so ZeRO's shards keep their shapes.)
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np

from distir_jax.ir._gc import gc_paused
from distir_jax.ir.builder import FunctionBuilder
from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.typecheck import infer_types
from distir_jax.ir.types import TensorType, dim_divides, dim_str, has_variants
from distir_jax.transforms.base import Distributed, InputSlice, Program, Recipe, as_distributed

__all__ = [
    "MAX_BUCKET_PIECES",
    "OPTIMIZER_GRADIENT",
    "data_parallel",
    "gradient_to_reduce",
    "zero_padding",
    "zero_scatter_attrs",
    "zero_shard",
    "zero_shard_problem",
]

# Most equal pieces a bucket may be cut into; bounds the values one bucket adds.
MAX_BUCKET_PIECES = 64
# Original input names of weights and optimizer state (the contract's l{layer}.…).
_STATE_RE = re.compile(r"^l\d+\.")
# Op attributes that hold device indices and must follow a replica's devices.
_DEVICE_ATTRS = ("to", "devices", "group")
# Optimizer op types and the operand index of their gradient.
OPTIMIZER_GRADIENT = {"SGD": 1, "Adam": 1}


class _Grad(NamedTuple):
    """One gradient to reduce: an operand of an optimizer op."""

    name: str  # value name in the input program
    device: int  # old device
    layer: int
    type: TensorType

    def at(self, phase: str) -> dict:
        """Annotations of the ops that move this gradient."""
        return dict(layer=self.layer, phase=phase)


@gc_paused
def data_parallel(
    program: Program,
    degree: int,
    *,
    overlap: bool = False,
    bucket_bytes: float | None = None,
    zero: bool = False,
    representative_only: bool = False,
) -> Distributed:
    """Data-parallel version of a training program over ``degree`` replicas.

    Args:
      program: a :class:`Function` or :class:`Distributed` keeping the model
        annotation contract, on devices ``0..D_old-1``.
      degree: number of replicas; must divide the batch size.
      overlap: issue each gradient reduction on stream 1 as soon as the
        gradient is ready, overlapping the rest of the backward pass.
      bucket_bytes: when set, reduce consecutive gradients of a device in
        buckets of at most this many bytes (sizes compared at the largest size
        variant; gradients need fixed shapes).
      zero: ZeRO-1: shard optimizer state and the update along axis 0.
      representative_only: build replica 0 only (see the module docstring).

    Returns:
      The new program on ``degree * D_old`` devices, related to the original
      program: data inputs split along axis 0; outputs rebuilt as ``"sum"``
      (losses), ``"replica"`` (updated weights and other replicated values),
      ``"concat"`` along axis 0 (ZeRO's optimizer state, per-example outputs).
      With ``degree == 1`` the program is returned unchanged.

    Raises:
      ValueError: naming the parameter, its value and the constraint, for a
        bad ``degree`` or ``bucket_bytes``, a batch size ``degree`` does not
        divide, or (``zero``) a scalar weight, or a size-variant dim 0 that
        ``degree`` does not divide (a padded shard needs one size).
    """
    if isinstance(degree, (bool, np.bool_)) or not isinstance(degree, (int, np.integer)) or degree < 1:
        raise ValueError(f"data_parallel: degree must be an int >= 1, got degree={degree!r}")
    degree = int(degree)
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, float)) or not bucket_bytes > 0
    ):
        raise ValueError(f"data_parallel: bucket_bytes must be a number > 0 or None, got {bucket_bytes=!r}")
    if zero and bucket_bytes is not None:
        raise ValueError(
            f"data_parallel: bucket_bytes={bucket_bytes!r} with zero=True is not supported; ZeRO "
            "reduce-scatters each gradient along its own axis 0, so pass bucket_bytes=None"
        )
    base = as_distributed(program)
    if degree == 1:
        return base
    fn = base.function
    if any(v.type is None for op in fn.ops for v in op.outputs):
        fn = infer_types(fn)
    sources = {name: sl.source for name, sl in base.inputs.items()}
    step = _Replicator(fn, sources, degree, overlap, bucket_bytes, zero, representative_only).run()
    return base.then(step)


def _num_devices(fn: Function) -> int:
    """``D_old``: one past the largest device the program or a collective's group names."""
    found = set(fn.devices)
    for op in fn.ops:
        for key in _DEVICE_ATTRS:
            value = op.attr(key)
            if value is not None:
                found.update(int(d) for d in (value if isinstance(value, tuple) else (value,)))
    return max(found, default=0) + 1


def _split_rows(t: TensorType, degree: int) -> TensorType:
    """``t``'s share of one of ``degree`` replicas along axis 0 (a ZeRO shard of a
    weight whose rows they do not divide: ``ceil(rows / degree)``, padded)."""
    return t.with_shape((-(-t.shape[0] // degree),) + t.shape[1:])


def zero_shard_problem(name: str, weight_type, degree: int) -> str:
    """Why ZeRO cannot shard weight ``name`` over ``degree`` replicas, or ``""``:
    a scalar, or a size-variant dim 0 ``degree`` does not divide (other dims are
    padded, see :func:`zero_padding`)."""
    if weight_type.rank == 0:
        return f"data_parallel(zero=True): weight %{name} is a scalar; ZeRO shards state along axis 0"
    rows = weight_type.shape[0]
    if has_variants((rows,)) and not dim_divides(rows, degree):
        return (
            f"data_parallel(zero=True): weight %{name} has size-variant dim 0 {dim_str(rows)}, which "
            f"degree={degree} must divide: a padded ZeRO shard needs one size"
        )
    return ""


def zero_padding(weight_type, degree: int) -> int:
    """Zero rows ZeRO adds to a value's dim 0 so ``degree`` replicas divide it (0 when
    they do, size-variant dims included; a padded dim has one size, see
    :func:`zero_shard_problem`)."""
    rows = weight_type.shape[0]
    return 0 if dim_divides(rows, degree) else -int(rows) % degree


def zero_scatter_attrs(grad_type, degree: int) -> dict:
    """The attributes ZeRO's ReduceScatter of ``grad_type`` over ``degree`` replicas
    adds to its group and axis: ``pad`` where its rows must be padded."""
    return {"pad": True} if zero_padding(grad_type, degree) else {}


def zero_shard(total, rows: int, degree: int):
    """One ZeRO shard's share of ``total`` (bytes, or costs that grow with the
    rows) of a value of ``rows`` rows over ``degree`` replicas: ``total / degree``,
    or ``ceil(rows / degree)`` rows' worth when its rows are padded."""
    if rows % degree == 0:
        return total / degree
    return total / rows * -(-rows // degree)


def gradient_to_reduce(fn: Function, producer: dict[str, int], grad: Value) -> Value:
    """The value whose replicas are summed for an optimizer's gradient operand ``grad``
    of ``fn`` (``producer``: ``fn.producers()``).

    Where ``grad`` is the result of an ``AllReduce`` in the optimizer phase
    (tensor parallelism's sync of a gradient that is a partial sum over ranks:
    a LayerNorm's under sequence parallelism), its operand on the same device
    is reduced instead, during the backward pass, and the sync then sums the
    reduced values: the same sum, in Megatron-LM's order
    (``finalize_model_grads``: data-parallel reductions in the backward, then
    the tensor group's all-reduce of LayerNorm gradients, then the step).
    """
    index = producer.get(grad.name)
    op = None if index is None else fn.ops[index]
    if op is None or op.op_type != "AllReduce" or op.attr("phase") != "opt":
        return grad
    return op.inputs[[v.name for v in op.outputs].index(grad.name)]


def _fits(bucket: list[_Grad], grad: _Grad, cap: float) -> bool:
    """Whether ``grad`` may join ``bucket`` (see the module docstring)."""
    if not bucket:
        return True
    if grad.type.dtype != bucket[0].type.dtype:
        return False
    members = bucket + [grad]
    if sum(int(g.type.num_bytes) for g in members) > cap:
        return False
    sizes = [int(g.type.num_elements) for g in members]
    unit = math.gcd(*sizes) or 1
    return sum(s // unit for s in sizes) <= MAX_BUCKET_PIECES


class _Replicator:
    """Builds the replicated program, op by op, for :func:`data_parallel`."""

    def __init__(self, fn, sources, degree, overlap, bucket_bytes, zero, representative_only):
        self.fn, self.degree, self.overlap, self.zero = fn, degree, overlap, zero
        self.cap = bucket_bytes
        self.representative = representative_only
        self.num_old = _num_devices(fn)
        self.replicas = (0,) if representative_only else tuple(range(degree))
        self.data = {v.name for v in fn.inputs if not _STATE_RE.match(sources[v.name])}
        self.b = FunctionBuilder(f"{fn.name}.dp{degree}")
        self.env: list[dict[str, Value]] = [{} for _ in range(degree)]
        self.masters: list[dict[str, Value]] = [{} for _ in range(degree)]  # ZeRO weight shards
        self.slices: dict[str, InputSlice] = {}
        self.grads: dict[str, _Grad] = {}
        self.updates: dict[int, _Grad] = {}  # optimizer op index -> its gradient
        self.ready: set[str] = set()  # gradients whose reduced value is in env
        self.pending: dict[int, list[_Grad]] = {}  # old device -> produced, not reduced
        self.open: dict[int, list[_Grad]] = {}  # old device -> bucket being filled
        self.inflight: dict[str, tuple[list[_Grad], list[Value]]] = {}  # reduced, not cut back
        self.buckets = 0
        self._find_gradients()
        if zero:
            self._check_zero()

    # ------------------------------------------------------------------ #
    # Analysis of the input program.

    def _find_gradients(self) -> None:
        producer = self.fn.producers()
        for index, op in enumerate(self.fn.ops):
            if op.attr("phase") != "opt" or op.attr("weight") is None:
                continue
            if op.op_type not in OPTIMIZER_GRADIENT:
                raise ValueError(
                    f"data_parallel: op #{index} {op.op_type} updates weight {op.attr('weight')!r}, but only "
                    f"{sorted(OPTIMIZER_GRADIENT)} are known optimizer ops"
                )
            v = gradient_to_reduce(self.fn, producer, op.inputs[OPTIMIZER_GRADIENT[op.op_type]])
            grad = _Grad(v.name, v.type.device, int(op.attr("layer", 0)), v.type)
            self.grads[v.name] = grad
            self.updates[index] = grad
            if self.cap is not None and has_variants(v.type.shape):
                raise ValueError(
                    f"data_parallel: bucket_bytes needs gradients of fixed shape, but %{v.name} is "
                    f"{v.type}; pass bucket_bytes=None for size-variant weights"
                )

    def _check_zero(self) -> None:
        """ZeRO shards the optimizer's weight, state and gradient: nothing else may read them."""
        inputs = {v.name for v in self.fn.inputs}
        readers: dict[str, set[int]] = {}
        for index, op in enumerate(self.fn.ops):
            for v in op.inputs:
                readers.setdefault(v.name, set()).add(index)
        self.sharded = {v.name for i in self.updates for v in self.fn.ops[i].inputs[2:]}
        # A weight input only its optimizer reads needs no full copy.
        self.dropped = ({self.fn.ops[i].inputs[0].name for i in self.updates} & inputs) - {
            v.name for i, op in enumerate(self.fn.ops) if i not in self.updates for v in op.inputs
        }
        # An earlier ZeRO's shards (views of weight inputs) are sharded again, as views.
        views = {
            op.outputs[0].name for op in self.fn.ops if op.op_type == "Shard" and op.inputs[0].name in inputs
        }
        for index in self.updates:
            op = self.fn.ops[index]
            weight = op.inputs[0]
            if weight.name not in inputs | views or not all(v.name in inputs for v in op.inputs[2:]):
                raise ValueError(
                    f"data_parallel(zero=True): op #{index} {op.op_type} must read its weight (or a Shard of "
                    "it) and optimizer state directly from function inputs, which ZeRO shards"
                )
            shared = [v.name for v in op.inputs[1:] if readers[v.name] != {index}]
            if shared:
                raise ValueError(
                    f"data_parallel(zero=True): {', '.join('%' + n for n in shared)} must be read only by "
                    f"optimizer op #{index}, since ZeRO keeps only a shard of it"
                )
            problem = zero_shard_problem(weight.name, weight.type, self.degree)
            if problem:
                raise ValueError(problem)

    # ------------------------------------------------------------------ #
    # Emission helpers.

    def device(self, r: int, d: int) -> int:
        return r * self.num_old + d

    def _add(self, op_type, inputs, names, attrs, where) -> tuple[Value, ...]:
        try:
            out = self.b.add(op_type, *inputs, names=names, **attrs)
        except ValueError as e:
            raise ValueError(f"data_parallel(degree={self.degree}): cannot emit {where}: {e}") from None
        return out if isinstance(out, tuple) else (out,)

    def _one(self, op_type, inputs, name, **attrs) -> Value:
        return self._add(op_type, inputs, [name], attrs, op_type)[0]

    def _remap(self, attrs: dict, r: int) -> dict:
        attrs = dict(attrs)
        for key in _DEVICE_ATTRS:
            if key in attrs:
                value = attrs[key]
                if isinstance(value, tuple):
                    attrs[key] = tuple(self.device(r, int(d)) for d in value)
                else:
                    attrs[key] = self.device(r, int(value))
        if "shards" in attrs:  # each replica's loss is its share of the global mean
            attrs["shards"] = int(attrs["shards"]) * self.degree
        return attrs

    def _collective(self, op_type, values, names, grad: _Grad, phase, **attrs) -> tuple[Value, ...]:
        """One collective over the replicas of ``grad``'s old device (an operand per built replica)."""
        if self.representative:
            attrs["group"] = tuple(self.device(r, grad.device) for r in range(self.degree))
        if self.overlap:
            attrs["stream"] = 1
        return self._add(op_type, values, names, dict(attrs, **grad.at(phase)), op_type)

    # ------------------------------------------------------------------ #
    # The program.

    def run(self) -> Distributed:
        self._inputs()
        for index, op in enumerate(self.fn.ops):
            for v in op.inputs:
                if v.name in self.grads:
                    self._require(self.grads[v.name])
            if self.zero and index in self.updates:
                self._zero_update(op, self.updates[index])
                continue
            for r in self.replicas:
                ins = [self.env[r][v.name] for v in op.inputs]
                names = [f"{v.name}.dp{r}" for v in op.outputs]
                outs = self._add(op.op_type, ins, names, self._remap(op.attr_dict, r), f"op #{index}")
                for v, new in zip(op.outputs, outs, strict=True):
                    self.env[r][v.name] = new
            for v in op.outputs:
                if v.name in self.grads:
                    self._produced(self.grads[v.name])
        return self._finish()

    def _inputs(self) -> None:
        masters = [self.fn.ops[i].inputs[0] for i in self.updates] if self.zero else []
        for v in self.fn.inputs:
            if v.name in self.data and (v.type.rank == 0 or not dim_divides(v.type.shape[0], self.degree)):
                batch = dim_str(v.type.shape[0]) if v.type.rank else "none (a scalar)"
                raise ValueError(
                    f"data_parallel: degree={self.degree} must divide the batch size (axis 0) of data "
                    f"input %{v.name}, which is {batch}; choose a degree that divides every batch size"
                )
        for r in self.replicas:
            for v in self.fn.inputs:
                if self.zero and v.name in self.dropped:
                    continue
                split = v.name in self.data or (self.zero and v.name in self.sharded)
                t = _split_rows(v.type, self.degree) if split else v.type
                new = self.b.input(f"{v.name}.dp{r}", t.shape, t.dtype, self.device(r, t.device))
                self.slices[new.name] = (
                    InputSlice(v.name).then(0, r, self.degree) if split else InputSlice(v.name)
                )
                self.env[r][v.name] = new
            for w in masters:
                if w.name not in self.dropped:  # a view of the replica's weight (`_zero_update`)
                    continue
                t = _split_rows(w.type, self.degree)
                new = self.b.input(f"{w.name}.dp{r}.master", t.shape, t.dtype, self.device(r, t.device))
                self.slices[new.name] = InputSlice(w.name).then(0, r, self.degree)
                self.masters[r][w.name] = new

    def _produced(self, grad: _Grad) -> None:
        """Called right after the last replica copy of ``grad``'s producer."""
        if not self.overlap:
            self.pending.setdefault(grad.device, []).append(grad)
        elif self.zero:
            self._scatter(grad)
        elif self.cap is None:
            self._reduce([grad])
        else:
            if not _fits(self.open.get(grad.device, []), grad, self.cap):
                self._close(grad.device)
            bucket = self.open.setdefault(grad.device, [])
            bucket.append(grad)
            if sum(int(g.type.num_bytes) for g in bucket) >= self.cap:
                self._close(grad.device)

    def _require(self, grad: _Grad) -> None:
        """Makes ``grad``'s reduced value (or ZeRO shard) available before its consumer."""
        if grad.name in self.ready:
            return
        if not self.overlap:
            grads = self.pending.pop(grad.device, [])
            if self.zero:
                for g in grads:
                    self._scatter(g)
                return
            for bucket in self._group(grads):
                self._reduce(bucket)
                if len(bucket) > 1:
                    self._cut(bucket[0])
            return
        if grad in self.open.get(grad.device, ()):
            self._close(grad.device)
        if grad.name not in self.ready:
            self._cut(grad)

    def _group(self, grads: list[_Grad]) -> list[list[_Grad]]:
        if self.cap is None:
            return [[g] for g in grads]
        buckets: list[list[_Grad]] = []
        for g in grads:
            if buckets and _fits(buckets[-1], g, self.cap):
                buckets[-1].append(g)
            else:
                buckets.append([g])
        return buckets

    def _close(self, device: int) -> None:
        bucket = self.open.pop(device, [])
        if bucket:
            self._reduce(bucket)

    def _reduce(self, bucket: list[_Grad]) -> None:
        """All-reduces one bucket; a bucket of one needs no packing or cutting back."""
        first = bucket[0]
        if len(bucket) == 1:
            values = [self.env[r][first.name] for r in self.replicas]
            names = [f"{first.name}.dp{r}.sum" for r in self.replicas]
            outs = self._collective("AllReduce", values, names, first, "bwd")
            for r, out in zip(self.replicas, outs, strict=True):
                self.env[r][first.name] = out
            self.ready.add(first.name)
            return
        tag, self.buckets = f"bucket{self.buckets}", self.buckets + 1
        packed = []
        for r in self.replicas:
            flat = []
            for g in bucket:
                value = self.env[r][g.name]
                if value.type.rank != 1:  # a free view
                    value = self._one("Reshape", [value], f"{g.name}.dp{r}.flat", shape=(-1,), **g.at("bwd"))
                flat.append(value)
            packed.append(self._one("Concat", flat, f"{tag}.dp{r}.packed", axis=0, **bucket[-1].at("bwd")))
        names = [f"{tag}.dp{r}.sum" for r in self.replicas]
        reduced = self._collective("AllReduce", packed, names, bucket[-1], "bwd")
        for g in bucket:
            self.inflight[g.name] = (bucket, list(reduced))

    def _cut(self, grad: _Grad) -> None:
        """Cuts the reduced bucket holding ``grad`` back into its gradients."""
        bucket, reduced = self.inflight[grad.name]
        sizes = [int(g.type.num_elements) for g in bucket]
        unit = math.gcd(*sizes) or 1
        counts = [s // unit for s in sizes]
        for r, whole in zip(self.replicas, reduced, strict=True):
            names = [f"{whole.name}.piece{i}" for i in range(sum(counts))]
            attrs = dict(grad.at("bwd"), axis=0, parts=sum(counts))
            pieces = self._add("Split", [whole], names, attrs, "Split")
            start = 0
            for g, count in zip(bucket, counts, strict=True):
                part, start = pieces[start : start + count], start + count
                value = part[0]
                if count > 1:
                    value = self._one("Concat", part, f"{g.name}.dp{r}.joined", axis=0, **g.at("bwd"))
                if value.type.rank != g.type.rank:
                    shape = tuple(int(d) for d in g.type.shape)
                    value = self._one("Reshape", [value], f"{g.name}.dp{r}.sum", shape=shape, **g.at("bwd"))
                self.env[r][g.name] = value
        for g in bucket:
            self.inflight.pop(g.name)
            self.ready.add(g.name)

    def _scatter(self, grad: _Grad) -> None:
        """ZeRO: reduce-scatters ``grad`` along axis 0; replica r keeps shard r."""
        values = [self.env[r][grad.name] for r in self.replicas]
        names = [f"{grad.name}.dp{r}.shard" for r in self.replicas]
        pad = zero_scatter_attrs(grad.type, self.degree)
        # In place: the shard is part of the gradient's buffer, which lives until the update.
        outs = self._collective("ReduceScatter", values, names, grad, "bwd", axis=0, inplace=True, **pad)
        for r, out in zip(self.replicas, outs, strict=True):
            self.env[r][grad.name] = out
        self.ready.add(grad.name)

    def _zero_update(self, op: Op, grad: _Grad) -> None:
        """ZeRO: the optimizer on each replica's shard, then all-gather the weight."""
        weight = op.inputs[0]
        views = weight.name not in self.dropped
        pad = zero_scatter_attrs(weight.type, self.degree)
        shards = []
        for r in self.replicas:
            if views:  # the shard this replica updates is part of its weight's buffer
                attrs = dict(parts=self.degree, index=r, **pad)
                name = f"{weight.name}.dp{r}.master"
                view = self._one("Shard", [self.env[r][weight.name]], name, axis=0, **attrs, **grad.at("opt"))
                self.masters[r][weight.name] = view
            # The optimizer's own gradient operand: a tensor group's sync of the
            # reduced value where there is one (`gradient_to_reduce`).
            ins = [self.masters[r][weight.name], self.env[r][op.inputs[OPTIMIZER_GRADIENT[op.op_type]].name]]
            ins += [self.env[r][v.name] for v in op.inputs[2:]]
            names = [f"{op.outputs[0].name}.dp{r}.shard"] + [f"{v.name}.dp{r}" for v in op.outputs[1:]]
            outs = self._add(op.op_type, ins, names, self._remap(op.attr_dict, r), f"sharded {op.op_type}")
            for v, new in zip(op.outputs[1:], outs[1:], strict=True):
                self.env[r][v.name] = new
            shards.append(outs[0])
        new_weight = op.outputs[0].name
        names = [f"{new_weight}.dp{r}" for r in self.replicas]
        rows = op.outputs[0].type.shape[0]
        trim = {"size": int(rows)} if zero_padding(op.outputs[0].type, self.degree) else {}
        # In place into the weight's buffer, unless only the optimizer read the weight
        # (no full copy was kept: the gathered weight is a new buffer).
        gathered = self._collective("AllGather", shards, names, grad, "opt", axis=0, inplace=views, **trim)
        for r, out in zip(self.replicas, gathered, strict=True):
            self.env[r][new_weight] = out

    def _finish(self) -> Distributed:
        kinds = _output_kinds(self.fn, self.data, self.grads, self.zero)
        outputs, recipes = [], {}
        for v in self.fn.outputs:
            copies = [self.env[r][v.name] for r in self.replicas]
            outputs += copies
            leaves = [Recipe.leaf(c.name) for c in copies]
            kind = kinds[v.name]
            # ZeRO's shards of a weight's state the degree does not divide are padded: trimmed back.
            padded = kind == "concat" and v.type.rank and zero_padding(v.type, self.degree)
            size = int(v.type.shape[0]) if padded else None
            combined = Recipe.combine(kind, leaves, axis=0, size=size)
            recipes[v.name] = leaves[0] if self.representative else combined
        return Distributed(self.b.build(*outputs), dict(self.slices), recipes)


def _output_kinds(fn: Function, data: set[str], grads: dict, zero: bool) -> dict[str, str]:
    """How each original value is rebuilt from the replicas' copies, by propagation.

    Data is split (``"concat"``), state replicated; losses and what is computed
    from them are partial (``"sum"``); reduced gradients, and updated weights,
    are replicated again; ZeRO's updated optimizer state is split.
    """
    kinds = {v.name: "concat" if v.name in data else "replica" for v in fn.inputs}
    for op in fn.ops:
        found = {kinds[v.name] for v in op.inputs}
        if op.attr("phase") == "opt" and op.op_type in OPTIMIZER_GRADIENT:
            out = ["replica"] + ["concat" if zero else "replica"] * (len(op.outputs) - 1)
        elif "sum" in found or (op.attr("shards") is not None and all(v.type.rank == 0 for v in op.outputs)):
            out = ["sum"] * len(op.outputs)
        else:
            out = ["concat" if "concat" in found else "replica"] * len(op.outputs)
        for v, kind in zip(op.outputs, out, strict=True):
            kinds[v.name] = "replica" if v.name in grads else kind
    return kinds
