"""A part's backward pass, replayed op by op from the measured fine block.

Two users:

* Memory of a backward pass in the variants a coarse program needs but the
  measured block does not contain: on a later microbatch each weight
  gradient is added to the running sum right after it is computed (the
  pipeline transform's ``Add(inplace=True)``: into the sum, after which the
  gradient goes), and on the first block of a pipeline chunk
  a received input is freed after its last read (when the sender's own
  backward keeps the original, as an MLP's Relu output).
* Gradient overlap: the data-parallel transform issues each gradient's
  reduction on stream 1 right after the gradient is final (after its ``Add``
  on the last microbatch). A coarse program keeps that timeline by cutting
  the last microbatch's backward of each chunk into *segments*, one ending
  with each weight gradient plus a tail, each gradient segment followed by its
  reduction.

Replay rule (that of :func:`~distir_jax.lower.peak_memory`): an op allocates,
the level peaks, then it frees. Costs are the ops' roofline split into linear
terms on the measuring topology's first device, as
:mod:`~distir_jax.transforms.coarse_fuse` does, so segments add up exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from distir_jax.cost import COST_FEATURES
from distir_jax.ir.registry import get_spec
from distir_jax.transforms.coarse_fuse import roofline_terms
from distir_jax.transforms.data_parallel import OPTIMIZER_GRADIENT, gradient_to_reduce

__all__ = ["BackwardOps", "PartSegments", "add_features", "backward_ops", "linear_features"]

_F = {name: i for i, name in enumerate(COST_FEATURES)}


@dataclasses.dataclass(frozen=True, eq=False)
class PartSegments:
    """One part's backward, cut after each weight gradient (``m`` segments, the last a tail).

    Attributes:
      cost: ``[m, S, F]`` linear cost features of each segment's fine ops.
      accumulate: ``[m, F]`` adding the segment's gradient to the running sum
        (later microbatches only).
      rise, net: ``[2, 2, m, S]`` memory of each segment by ``[later
        microbatch, input freed here]``.
      grads: the type of the gradient each segment ends with (None: the tail).
      updates: the part's weights in optimizer order: ``(segment of its
        gradient, [F] linear cost of its update)``.
    """

    cost: np.ndarray
    accumulate: np.ndarray
    rise: np.ndarray
    net: np.ndarray
    grads: tuple
    updates: tuple = ()

    @property
    def num_segments(self) -> int:
        return len(self.grads)

    def take_variants(self, variants: list[int]) -> PartSegments:
        """These segments for some of the size variants only."""
        return dataclasses.replace(
            self, cost=self.cost[:, variants], rise=self.rise[..., variants], net=self.net[..., variants]
        )


class _Grad(NamedTuple):
    name: str
    type: object


@dataclasses.dataclass(frozen=True)
class BackwardOps:
    """The measured block's backward ops of each part, with their memory events.

    Attributes:
      ops: per part, fine op indices in program order.
      alloc, free: ``[S, N]`` bytes each op allocates and frees on its first device.
      input_freed: per op index, the bytes of the part's input last read there.
      grads: per op index, the weight gradients it outputs (name and type), in output order.
    """

    ops: tuple
    alloc: np.ndarray
    free: np.ndarray
    input_freed: dict
    grads: dict

    def replay(self, part: int, cuts: bool):
        """``(rise, net)`` of the part's backward by ``[later microbatch, input freed
        here]``: ``[2, 2, S]`` each, or ``[2, 2, m, S]`` per segment with ``cuts``.

        In op order: an op's allocation raises the level (the peak is taken
        there), then its frees (input freed: also the part's input it reads
        last) lower it; after an op, each weight gradient it outputs goes (on
        a later microbatch: added into the running sum) and, with ``cuts``,
        ends a segment (the next starts at zero). Computed as running sums
        over those events, all four variants at once: byte counts are whole
        numbers, so the sums are exact in any order (a loop over ops took ~50
        us a replay, and a measured block replays each part 8 times)."""
        op_alloc, op_net, op_input, grad_bytes, op_event, grad_event, op_segment = self._events[part]
        s = self.alloc.shape[0]
        flag = np.asarray([0.0, 1.0])
        delta = np.zeros((2, 2, s, 1 + op_event.size + grad_event.size))  # column 0: the level at the start
        delta[..., 1 + op_event] = op_net - flag[:, None, None] * op_input
        # A later microbatch's Add into the running sum, in place: then the gradient goes.
        delta[..., 1 + grad_event] = -flag[:, None, None, None] * grad_bytes
        level = np.cumsum(delta, axis=-1)  # level[..., 1 + e]: after event e; level[..., e]: before it
        tops = level[..., op_event] + op_alloc  # each op's allocation on the level before it
        if not cuts:
            return tops.max(axis=-1, initial=0.0), level[..., -1]  # the level starts at 0
        # A segment's levels are the running sum's less its level where it began.
        start = np.concatenate([level[..., :1], level[..., 1 + grad_event]], axis=-1)  # [2, 2, S, m]
        end = np.concatenate([level[..., 1 + grad_event], level[..., -1:]], axis=-1)
        rise = np.zeros_like(start)
        if op_event.size:
            first = np.flatnonzero(np.diff(op_segment, prepend=-1))  # each segment's first op
            highest = np.maximum.reduceat(tops - start[..., op_segment], first, axis=-1)
            rise[..., op_segment[first]] = np.maximum(highest, 0.0)
        return rise.swapaxes(-1, -2), (end - start).swapaxes(-1, -2)

    @functools.cached_property
    def _events(self) -> tuple:
        """Per part, its replay events: per op its allocation, allocation less frees
        and the input bytes it frees (``[S, n]`` each); the gradients' bytes
        (``[S, G]``, in order); where the op and gradient events are in the event
        order (``[n]``, ``[G]``: an op's gradients follow it); and each op's
        segment (gradients before it)."""
        return tuple(self._part_events(q) for q in range(len(self.ops)))

    def _part_events(self, part: int) -> tuple:
        ops = list(self.ops[part])
        s = self.alloc.shape[0]
        count = np.asarray([len(self.grads.get(i, ())) for i in ops], np.intp)
        before = np.cumsum(count) - count  # gradients ahead of each op
        op_event = np.arange(len(ops)) + before
        is_op = np.zeros(len(ops) + int(count.sum()), bool)
        is_op[op_event] = True
        grad_event = np.flatnonzero(~is_op)  # each op's gradients right after it
        grads = [grad for i in ops for grad in self.grads.get(i, ())]
        grad_bytes = np.zeros((s, len(grads)))
        for j, grad in enumerate(grads):
            grad_bytes[:, j] = np.asarray(grad.type.num_bytes, np.float64)
        op_input = np.zeros((s, len(ops)))
        for j, i in enumerate(ops):
            if i in self.input_freed:
                op_input[:, j] = self.input_freed[i]
        alloc, free = self.alloc[:, ops], self.free[:, ops]
        return alloc, alloc - free, op_input, grad_bytes, op_event, grad_event, before

    def segments(self, part: int, features: np.ndarray, topology, updates=()) -> PartSegments:
        """The part's segments; ``features`` ``[S, N, F]`` are the fine ops' linear costs.

        ``updates``: the part's optimizer updates in program order, ``(gradient
        name, [F] linear cost)`` each.
        """
        cost, grads, names, current = [], [], [], np.zeros(features[:, 0].shape)
        for i in self.ops[part]:
            current = current + features[:, i]
            for grad in self.grads.get(i, ()):
                cost.append(current)
                grads.append(grad.type)
                names.append(grad.name)
                current = np.zeros_like(current)
        cost.append(current)
        grads.append(None)
        accumulate = np.stack([add_features(g, topology) for g in grads])
        rise, net = self.replay(part, cuts=True)
        ordered = tuple((names.index(name), update) for name, update in updates)
        return PartSegments(np.stack(cost), accumulate, rise, net, tuple(grads), ordered)


def backward_ops(fn, fine, labels, num_variants: int, num_parts: int = 3) -> BackwardOps:
    """The backward ops of parts ``0..num_parts - 1`` of a measured block (``labels``:
    ``(part, "F" / "B")`` per op, ``("opt", part)`` for optimizer updates)."""

    def per_variant(x):
        x = np.asarray(x, np.float64)[..., 0]  # the op's first slot: device 0
        return np.broadcast_to(x, (num_variants,) + x.shape[-1:])

    producer = fn.producers()
    type_of = {v.name: v.type for op in fn.ops for v in op.outputs}
    # What the optimizer updates with: the sums a pipeline accumulates (before a
    # tensor group's sync of them, which belongs to the update).
    updated = {
        gradient_to_reduce(fn, producer, op.inputs[OPTIMIZER_GRADIENT[op.op_type]]).name
        for op in fn.ops
        if op.attr("phase") == "opt" and op.op_type in OPTIMIZER_GRADIENT
    }
    ops: list[list[int]] = [[] for _ in range(num_parts)]
    last_read: dict[tuple[int, str], int] = {}  # (part, its input) -> op of the last read in its backward
    grads: dict[int, list] = {}
    for i, (op, (part, direction)) in enumerate(zip(fn.ops, labels, strict=True)):
        if direction != "B" or part == "opt":
            continue
        ops[part].append(i)
        for v in op.inputs:
            j = producer.get(v.name)
            if j is not None and labels[j] == (part - 1, "F"):
                last_read[(part, v.name)] = i
        found = [_Grad(v.name, v.type) for v in op.outputs if v.name in updated]
        if found:
            grads[i] = found
    input_freed: dict[int, np.ndarray] = {}
    for (_, name), i in last_read.items():
        input_freed[i] = input_freed.get(i, 0.0) + np.asarray(type_of[name].num_bytes, np.float64)
    return BackwardOps(
        tuple(tuple(p) for p in ops),
        per_variant(fine.alloc_bytes),
        per_variant(fine.free_bytes),
        input_freed,
        grads,
    )


def linear_features(fine, topology, num_variants: int) -> np.ndarray:
    """``[S, N, F]`` each fine op's cost as linear terms (roofline split on device 0)."""
    n = int(fine.num_ops)
    f = {
        name: np.broadcast_to(np.asarray(getattr(fine, name), np.float64), (num_variants, n))
        for name in COST_FEATURES
    }
    bound_flops, bound_bytes = roofline_terms(f["flops"], f["mem_bytes"], *_speeds(topology))
    out = np.zeros((num_variants, n, len(COST_FEATURES)))
    for name in ("launches", "linear_flops", "linear_bytes", "comm_volume", "comm_hops"):
        out[..., _F[name]] = f[name]
    out[..., _F["linear_flops"]] += bound_flops
    out[..., _F["linear_bytes"]] += bound_bytes
    return out


def add_features(grad, topology) -> np.ndarray:
    """Linear features of adding gradient ``grad`` to its running sum (zero for None)."""
    out = np.zeros(len(COST_FEATURES))
    if grad is None:
        return out
    f = get_spec("Add").features({}, (grad, grad), (grad,))
    out[_F["launches"]] = 1.0
    terms = roofline_terms(float(np.max(f.flops)), float(np.max(f.mem_bytes)), *_speeds(topology))
    out[_F["linear_flops"]], out[_F["linear_bytes"]] = (float(t) for t in terms)
    return out


def _speeds(topology) -> tuple[float, float]:
    """Seconds per flop and per byte of the measuring topology's first device."""
    return 1.0 / topology.peak_flops[0], 1.0 / topology.memory_bandwidth[0]
