"""The kernel's timeline step in NumPy, on the host: no compile.

Compiling the kernel takes about a second on a CPU. A small sweep (a
notebook's few hundred rows, the first calls of a large one while its kernel
compiles) finishes sooner on the host: a NumPy step over a call's rows costs
about what the compiled step does on a CPU (both are a few gathers and
scatters per op, vectorized over the rows).

:func:`run_ops_host` takes the ops' costs from :func:`~distir_jax.kernel.op_costs`,
computed once for both paths, so each step only compares, adds and moves
values, exactly rounded operations: it returns the timeline that
:func:`~distir_jax.kernel.run_ops` returns from the same costs, bit for bit
(tests/test_host_timeline.py), and a sweep may run any call either way.
"""

from __future__ import annotations

import numpy as np

from distir_jax.kernel import OpCosts, Timeline
from distir_jax.lower import Program

__all__ = ["run_ops_host"]


def run_ops_host(
    state: Timeline, program: Program, costs: OpCosts, num_ops=None, *, record_ops: bool = False
) -> tuple[Timeline, tuple | None]:
    """:func:`~distir_jax.kernel.run_ops` on the host: exact semantics,
    per-configuration structure ``[B, N, ...]`` and precomputed ``costs``.

    Args:
      state: the timeline before these ops (NumPy arrays, configurations last).
      program: a slice of the rows' ops; only its structure is read.
      costs: :func:`~distir_jax.kernel.op_costs` of that slice (``xp=numpy``).
      num_ops: optional ``[B]`` ops of each row that matter, counted from this
        slice's first op (a row's ops past its program's end are padding, which
        changes nothing). Each step skips the rows past the last one whose ops
        still matter: sorting rows longest first makes that most of them, and
        rows at the end given 0 (a call's padding rows) are never run.
      record_ops: also return every op's ``(start, finish)``, ``[N, B]`` each
        (zeros for the ops of rows a step skips).

    Returns:
      The timeline after the ops (new arrays; ``state`` is not changed), and
      the ops' times with ``record_ops`` (else None), as :func:`~distir_jax.kernel.run_ops`.
    """
    clock, finish = np.asarray(state.clock), np.asarray(state.finish)
    num_resources, b = clock.shape
    num_slots = finish.shape[0]
    n = np.shape(program.resource)[1]
    live = _live_rows(num_ops, b, n)
    rows = int(live[0]) if n else 0  # rows any step runs; the others stay as they are
    # Structure ops first, configurations last (like the timeline), for the rows that run.
    res, dep = (np.asarray(x)[:rows].transpose(1, 2, 0) for x in (program.resource, program.dep_slot))
    out = np.asarray(program.out_slot)[:rows].T
    has = res >= 0
    if _repeats(res, has):
        raise ValueError("an op lists one resource in two slots: its busy time would count twice")
    # One flat buffer of clocks, finish slots, a row of zeros (what a missing slot
    # or dependency reads: the kernel's max counts it as 0) and a row that takes
    # the writes of missing slots: every step is then one gather and one scatter.
    zeros, sink = num_resources + num_slots, num_resources + num_slots + 1
    times = np.concatenate([clock, finish, np.zeros((2, b), clock.dtype)])
    column = np.arange(rows, dtype=np.int64)
    reads = np.concatenate([np.where(has, res, zeros), np.where(dep >= 0, num_resources + dep, zeros)], 1)
    writes = np.concatenate(
        [np.where(has, res, sink), np.where(out >= 0, num_resources + out, sink)[:, None]], 1
    )
    reads, writes = (x * b + column for x in (reads, writes))
    # Busy totals (and their compute part) share a second buffer, with a sink row each.
    parts = [state.busy] + ([state.compute] if state.compute is not None else [])
    totals = np.stack([np.concatenate([np.asarray(x), np.zeros((1, b), clock.dtype)]) for x in parts])
    adds = np.where(has, res, num_resources) * b + column  # [n, K, rows]
    adds = np.stack([adds + j * (num_resources + 1) * b for j in range(len(parts))], 1)  # [n, parts, K, rows]
    charged = [costs.busy] + ([costs.compute] if len(parts) > 1 else [])
    charged = np.stack([np.asarray(x)[:n, :rows] for x in charged], 1)[:, :, None, :]  # [n, parts, 1, rows]
    seconds = np.asarray(costs.seconds)
    flat_times, flat_totals = times.reshape(-1), totals.reshape(-1)
    recorded = (np.zeros((n, b), clock.dtype), np.zeros((n, b), clock.dtype)) if record_ops else None
    for i in range(n):
        a = live[i]
        if a == 0:
            break
        start = flat_times.take(reads[i, :, :a]).max(axis=0)
        fin = start + seconds[i, :a]
        if record_ops:
            recorded[0][i, :a], recorded[1][i, :a] = start, fin
        # `put` repeats `fin` over the op's slots and its finish slot (rows of `a` indices each).
        flat_times.put(writes[i, :, :a], fin)
        where = adds[i, ..., :a]
        flat_totals.put(where, flat_totals.take(where) + charged[i, ..., :a])
    busy = totals[0, :num_resources]
    compute = totals[1, :num_resources] if len(parts) > 1 else None
    return Timeline(times[:num_resources], times[num_resources:zeros], busy, compute), recorded


def _repeats(index: np.ndarray, valid: np.ndarray) -> bool:
    """Whether any op names one resource in two of its slots (``[N, K, B]``)."""
    k = index.shape[1]
    return any(
        bool((valid[:, i] & valid[:, j] & (index[:, i] == index[:, j])).any())
        for i in range(k)
        for j in range(i + 1, k)
    )


def _live_rows(num_ops, b: int, n: int) -> np.ndarray:
    """``[n]``: at each step, one past the last row that still has ops (all rows without ``num_ops``)."""
    if num_ops is None:
        return np.full(n, b, np.int64)
    left = np.clip(np.asarray(num_ops, np.int64), 0, n)  # [B]
    # A row with k ops left is live for steps < k: step i needs rows up to the
    # last one whose count exceeds i.
    last = np.zeros(n + 1, np.int64)
    np.maximum.at(last, left, np.arange(1, b + 1))
    return np.maximum.accumulate(last[::-1])[::-1][1:]
