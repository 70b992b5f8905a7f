"""A timeline kernel for configurations that share their op structure in groups.

The general kernel (:mod:`distir_jax.kernel`) lets every configuration have
its own structure, so each step gathers and scatters one element per
configuration, each at its own index. On CPU, XLA spends ~60-80 ns per
element on such gathers and scatters whatever the batch size, and that is
most of a sweep's kernel time. Sweeps of coarse pipeline programs have a few
to a few dozen configurations per template (the same ops, resources and
finish slots; different op durations). Here a call holds ``G`` groups of
``Bg`` rows, each group one template, and a step reads and writes each
group's clocks and slots at one index per group, moving ``Bg`` contiguous
values per index: ~15-20 ns per op-row on a 2-core CPU at ``G = 64, Bg = 16``
(see ``benchmarks/RESULTS.md``).

Semantics are :func:`distir_jax.kernel.run_ops`' exact ones for ops that take
the same time on every resource they hold, with at most two resources and
one dependency: an op starts at the largest of its resources' clocks, its
dependency's finish slot and 0; it finishes ``seconds`` later, and its
resources' clocks and its output slot become that finish time.

The timeline is one array per call, ``[G, R + 1 + S + 2, Bg]``: each
resource's clock, then the finish slots. Ops come packed, ``[..., 5]`` int32
per op (:func:`pack_ops`), as indices into it: the dependency's slot, the two
resources, the output slot, then a column of the group's seconds table; so a
step is one gather of three values per row, one gather of its duration and
one scatter of three (separate clock and slot arrays took ~15-20% longer per
step on a 2-core CPU: two more gathers and a scatter, see
``benchmarks/RESULTS.md``). Index conventions (so a step never branches): a
missing second resource repeats the first; a missing dependency reads slot
``S`` (never written, always 0); a missing output writes slot ``S + 1``;
padding ops (past a template's end) hold resource ``R`` (never read by real
ops, not part of the step time) and the last seconds column (all zeros).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["GroupedTimeline", "pack_ops", "padding_ops", "run_grouped", "start_grouped", "step_times"]


class GroupedTimeline(NamedTuple):
    """The carry of :func:`run_grouped`.

    Attributes:
      times: ``[G, R + 1 + S + 2, Bg]`` each resource's clock (``R + 1``: the
        last one takes padding ops), then the finish slots (``S + 2``: slot
        ``S`` is always 0, ``S + 1`` takes writes nobody reads).
    """

    times: jax.Array

    def clocks(self, num_resources: int) -> jax.Array:
        """``[G, R + 1, Bg]`` the resources' clocks (the last: padding ops')."""
        return self.times[:, : num_resources + 1]

    def finish_slots(self, num_resources: int) -> jax.Array:
        """``[G, S + 2, Bg]`` the finish slots."""
        return self.times[:, num_resources + 1 :]


def start_grouped(groups: int, resources: int, slots: int, rows: int, dtype=None, xp=jnp) -> GroupedTimeline:
    """Every clock and slot at zero: ``groups`` groups of ``rows`` rows (``xp=numpy``:
    on the host, to be put on the device without compiling anything)."""
    dtype = dtype or jnp.result_type(float)
    return GroupedTimeline(xp.zeros((groups, resources + 1 + slots + 2, rows), dtype))


def pack_ops(
    resource, dep_slot, out_slot, seconds_column, num_resources: int, num_slots: int, out=None
) -> np.ndarray:
    """One template's ops as ``[N, 5]`` int32 for :func:`run_grouped`: indices into
    the timeline (dependency slot, first and second resource, output slot) and
    the seconds column.

    Args:
      resource: ``[N, 2]`` resources each op holds (-1: none; every op holds a first one).
      dep_slot: ``[N]`` the finish slot an op waits for (-1: none).
      out_slot: ``[N]`` the slot its finish time goes to (-1: none).
      seconds_column: ``[N]`` its column of the group's seconds table.
      num_resources, num_slots: ``R`` and ``S`` of the timeline.
      out: an ``[N, 5]`` int32 array to write them into (e.g. the first rows of a
        padded buffer), instead of a new one.
    """
    resource = np.asarray(resource)
    first, second = resource[:, 0], resource[:, 1]
    if len(first) and (first.min() < 0 or resource.max() >= num_resources):
        raise ValueError(
            f"every op needs a first resource, and resources in [0, {num_resources}); got first "
            f"resources from {first.min()}, resources up to {resource.max()}"
        )
    for name, slot in (("dep_slot", dep_slot), ("out_slot", out_slot)):
        if np.size(slot) and np.max(slot) >= num_slots:
            raise ValueError(f"{name} {np.max(slot)} is past the timeline's {num_slots} slots")
    out = np.empty((len(first), 5), np.int32) if out is None else out
    slot = num_resources + 1  # where the finish slots start in the timeline
    out[:, 0] = slot + np.where(np.asarray(dep_slot) >= 0, dep_slot, num_slots)
    out[:, 1] = first
    out[:, 2] = np.where(second >= 0, second, first)
    out[:, 3] = slot + np.where(np.asarray(out_slot) >= 0, out_slot, num_slots + 1)
    out[:, 4] = seconds_column
    return out


def padding_ops(count: int, num_resources: int, num_slots: int, zero_column: int) -> np.ndarray:
    """``[count, 5]`` ops that change nothing a real op reads (see the module docstring)."""
    slot = num_resources + 1
    op = [slot + num_slots, num_resources, num_resources, slot + num_slots + 1, zero_column]
    return np.tile(np.asarray(op, np.int32), (count, 1))


def run_grouped(state: GroupedTimeline, ops: jax.Array, seconds: jax.Array) -> GroupedTimeline:
    """Runs one slice of every group's ops, in order.

    Args:
      state: the timeline so far.
      ops: ``[G, C, 5]`` each group's next ``C`` packed ops.
      seconds: ``[G, U, Bg]`` each group's table of op durations per row.
    """
    groups = jnp.arange(ops.shape[0])[:, None]

    def step(times, op):  # op: [G, 5], indices into each group's timeline
        start = jnp.max(times[groups, op[:, 0:3]], axis=1)  # dependency, resources: [G, Bg]
        end = start + seconds[groups[:, 0], op[:, 4]]
        written = jnp.broadcast_to(end[:, None], (end.shape[0], 3, end.shape[1]))
        return times.at[groups, op[:, 1:4]].set(written), None  # resources, output slot

    return GroupedTimeline(jax.lax.scan(step, state.times, jnp.moveaxis(ops, 1, 0))[0])


def step_times(state: GroupedTimeline, num_resources: int, xp=jnp) -> jax.Array:
    """``[G, Bg]`` every row's step time: its latest resource clock."""
    return xp.max(state.times[:, :num_resources], axis=1)
