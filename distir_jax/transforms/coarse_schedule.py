"""Pipeline schedules and issue orders as NumPy arrays, for coarse pipeline programs.

:mod:`~distir_jax.transforms.schedules` builds schedules as Python objects,
one :class:`Step` at a time; a sweep over GPT-3 175B needs hundreds of
schedules with up to ~10^5 steps each, so this module computes the same
schedules with array arithmetic (tests check they are equal) and a global
issue order without a Python loop over steps:

* :func:`schedule_arrays`: ``[p, M]`` chunk, microbatch and direction of each
  device's steps, ``M = 2 k v``.
* :func:`estimated_times`: start and finish of every step when devices run
  their steps in order and wait for the steps they depend on (as
  :func:`~distir_jax.transforms.schedules.schedule_times`), by relaxation:
  with the cross-device inputs fixed, a device's finish times are a prefix
  maximum, ``finish_i = C_i + max_{j <= i} max(0, ext_j - C_{j-1})`` with
  ``C`` the running sum of its costs; repeating until nothing changes takes
  one pass per device hop of the longest dependency path. 1F1B with unit
  costs has them in closed form, which one pass confirms.
* :func:`message_times`: when each message is issued, by the rule of
  :func:`~distir_jax.transforms.schedules.global_issue_order` (the time
  between its producer's finish and its consumer's start where both devices
  come free closest together), for all messages at once.
* :func:`issue_order`: steps by estimated start and messages by these times,
  that function's order. The pipeline transform itself orders its program
  this way (:func:`~distir_jax.transforms.schedules.estimated_issue_order`),
  so coarse programs reproduce its order bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "ORDER_RESOLUTION",
    "check_step_costs",
    "estimated_times",
    "issue_order",
    "message_times",
    "order_costs",
    "schedule_arrays",
]


def schedule_arrays(schedule: str, p: int, k: int, v: int = 1):
    """The steps of a named schedule, device by device.

    Args:
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
      p, k, v: pipeline devices, microbatches, chunks per device.

    Returns:
      ``(chunk, microbatch, backward)``, each ``[p, 2 k v]``: device ``s``'s
      steps in order; ``backward`` is True for a backward pass. Read only:
      they are cached (sweeps ask for one schedule with many step costs).

    Raises:
      ValueError: for an unknown schedule, ``v > 1`` without ``"interleaved"``,
        or the interleaved schedule with ``k`` not a multiple of ``p``.
    """
    for name, value in (("degree", p), ("microbatches", k), ("virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"unknown schedule={schedule!r}; valid names: gpipe, 1f1b, interleaved")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"schedule={schedule!r} runs one chunk per device, got virtual_stages={v}")
    if schedule == "interleaved" and k % p:
        raise ValueError(
            f"the interleaved schedule needs microbatches to be a multiple of degree, got {k} and {p}"
        )
    return _schedule_arrays(schedule, int(p), int(k), int(v))


@functools.lru_cache(maxsize=1024)
def _schedule_arrays(schedule: str, p: int, k: int, v: int):
    # Every device at once: device ``s`` runs ``warm[s]`` forwards, then
    # alternating pairs, then the remaining backwards.
    s = np.arange(p)[:, None]  # [p, 1]
    t = np.arange(2 * k * v)[None, :]  # [1, 2kv] each step's position
    if schedule == "gpipe":
        backward = np.broadcast_to(t >= k, (p, 2 * k))
        mb, chunk = np.broadcast_to(t % k, (p, 2 * k)), np.broadcast_to(s, (p, 2 * k))
    elif schedule == "1f1b":
        index, backward = _interleave_positions(t, np.minimum(p - s, k), k, backward_first=True)
        mb, chunk = index, np.broadcast_to(s, index.shape)
    else:
        total = k * v
        index, backward = _interleave_positions(
            t, np.minimum(2 * (p - s - 1) + (v - 1) * p, total), total, backward_first=False
        )
        group, j = np.divmod(index, p * v)
        local = j // p
        mb = group * p + j % p
        chunk = np.where(backward, v - 1 - local, local) * p + s
    arrays = tuple(
        np.ascontiguousarray(x, dtype=dtype)
        for x, dtype in zip((chunk, mb, backward), (np.int64, np.int64, bool), strict=True)
    )
    for x in arrays:
        x.setflags(write=False)
    return arrays


def _interleave_positions(t: np.ndarray, warm: np.ndarray, total: int, backward_first: bool):
    """The pass of each position ``t`` (``[1, 2 total]``) of each device (``warm``:
    ``[p, 1]`` warm-up forwards): ``(index, backward)``, ``[p, 2 total]`` each. A
    device runs forwards ``0 .. warm - 1``, then pairs (backward ``j`` and forward
    ``warm + j``, in either order), then the remaining backwards."""
    steady = total - warm
    u = t - warm  # position within the pairs
    in_pairs = (u >= 0) & (u < 2 * steady)
    second = u % 2 == 1  # the second of a pair
    pair_backward = second != backward_first
    backward = np.where(in_pairs, pair_backward, u >= 0)
    index = np.where(in_pairs, np.where(pair_backward, u // 2, warm + u // 2), np.where(u < 0, t, t - total))
    return index, backward


# Step costs only order steps (by estimated start). They are rounded to integers
# of at most 2**30 (scaled by the largest) so that every estimated time is an
# exact float64 sum (up to 2**22 steps per device). The pipeline transform and a
# coarse template, whose costs come from the same flops summed in different
# orders, then order steps identically (a last-bit difference can break a tie
# the other way: GPT-3 175B's interleaved programs did, 0.16% off in step
# time), and a long pipeline's order repeats exactly (see coarse_steady).
ORDER_RESOLUTION = 2.0**30


def order_costs(step_costs) -> np.ndarray:
    """``step_costs`` as the integers steps are ordered by (see ``ORDER_RESOLUTION``):
    unchanged when they are integers of at most ``ORDER_RESOLUTION`` already
    (unit costs, small models), else scaled so the largest is that, and rounded."""
    costs = np.asarray(step_costs, np.float64)
    if costs.size == 0 or (np.all(costs == np.floor(costs)) and costs.max() <= ORDER_RESOLUTION):
        return costs
    return np.maximum(np.round(costs * (ORDER_RESOLUTION / costs.max())), 1.0)


def check_step_costs(step_costs, num_chunks: int) -> np.ndarray:
    """``step_costs`` as a float64 ``[num_chunks, 2]`` array of the integers steps are
    ordered by (:func:`order_costs`; each chunk's forward and backward).

    Raises:
      ValueError: when it has another shape or a cost that is not positive.
    """
    step_costs = np.asarray(step_costs, np.float64)
    if step_costs.shape != (num_chunks, 2) or not np.all(step_costs > 0):
        raise ValueError(
            f"step_costs must be [{num_chunks}, 2] positive numbers (per chunk: forward, backward), "
            f"got shape {step_costs.shape}"
        )
    return order_costs(step_costs)


def estimated_times(chunk, microbatch, backward, num_chunks: int, cost, *, schedule: str | None = None):
    """Start and finish of every step when each device runs its steps in order.

    A forward waits for the previous chunk's forward of its microbatch, a
    backward for the next chunk's backward (its own forward runs earlier on
    the same device); messages take no time. With integer costs the sums are
    exact and the times equal :func:`~distir_jax.transforms.schedules.schedule_times`'
    bit for bit; otherwise they may differ in the last bits (other summation
    order), but a step never starts before the finish it waits for.

    Args:
      chunk, microbatch, backward: ``[p, M]`` from :func:`schedule_arrays`.
      num_chunks: ``p * v``.
      cost: ``[p, M]`` positive seconds (or units) per step.
      schedule: the schedule the steps are (:func:`schedule_arrays`' name),
        if known: a 1F1B schedule whose forwards all cost one integer and
        backwards another (unit step costs) has its times in closed form
        (:func:`_one_f_one_b_finish`), checked by one update instead of
        relaxed from below.

    Returns:
      ``(start, finish)``, each ``[p, M]``.

    Raises:
      ValueError: when the order deadlocks (no fixed point is reached).
    """
    p, m = chunk.shape
    k = int(microbatch.max()) + 1
    flat = np.arange(p * m).reshape(p, m)
    position = np.full((2, num_chunks, k), -1, np.int64)
    position[backward.astype(np.int64), chunk, microbatch] = flat
    dep = np.full((p, m), -1, np.int64)
    fwd_dep = ~backward & (chunk > 0)
    dep[fwd_dep] = position[0, chunk[fwd_dep] - 1, microbatch[fwd_dep]]
    bwd_dep = backward & (chunk < num_chunks - 1)
    dep[bwd_dep] = position[1, chunk[bwd_dep] + 1, microbatch[bwd_dep]]
    has_dep = dep >= 0
    # A step without an input reads the zero past the finishes (a where per row update costs more).
    dep_index = np.where(has_dep, dep, p * m)
    total = np.cumsum(cost, axis=1)
    before = total - cost
    flat_finish = np.zeros(p * m + 1)
    finish = flat_finish[: p * m].reshape(p, m)  # a view: row updates show through it
    finish[:] = total

    # A device's finishes from its steps' inputs: ``total`` plus the largest wait so
    # far. Iterated from ``total`` up, this reaches the least fixed point, whatever
    # the order rows are updated in. Deep pipelines update rows in device order and
    # then back (forward inputs come from the device before, backward ones from the
    # one after), which carries a chain of waits across every device in one sweep:
    # 2-3 sweeps for 1F1B and interleaved orders, where updating all rows at once
    # takes ~2p iterations. On small arrays the vectorized update is the cheaper
    # (from ~4096 steps on 8 or more devices the sweeps are: p = 16 interleaved,
    # k = 64, v = 6: 1.5 ms against 3.3 ms).
    #
    # A sweep that changed something is followed by one update of all rows at
    # once rather than another sweep: it shows convergence at a fraction of a
    # sweep's cost (GPT-3's deep pipelines: 2 sweeps and a check instead of 3).
    def update(d) -> bool:
        wait = flat_finish[dep_index[d]]
        wait -= before[d]
        np.maximum(wait, 0.0, out=wait)
        np.maximum.accumulate(wait, axis=-1, out=wait)
        wait += total[d]
        if (wait != finish[d]).any():
            finish[d] = wait
            return True
        return False

    one_chunk_each = schedule == "1f1b" and p == num_chunks
    guess = _one_f_one_b_finish(microbatch, backward, cost) if one_chunk_each else None
    if guess is not None:
        # The waits form no cycle, so the times have one fixed point: a guess that
        # one update leaves as it is, is it (else relax from below as usual).
        finish[:] = guess
        if not update(slice(None)):
            return _starts(finish, flat_finish, dep_index)
        finish[:] = total
    rows = [slice(None)]  # all at once
    if p >= 8 and m >= 16 and p * m >= 4096:
        rows = list(range(p)) + list(range(p - 2, 0, -1))
    for _ in range(2 * p * m + 2):
        changed = False
        for d in rows:
            changed |= update(d)
        if changed and len(rows) > 1:
            changed = update(slice(None))
        if not changed:
            return _starts(finish, flat_finish, dep_index)
    raise ValueError("the schedule deadlocks: estimated step times do not converge")


def _starts(finish, flat_finish, dep_index):
    """``(start, finish)`` from the fixed point's finishes (``finish``, a view of
    ``flat_finish``, whose last entry is the zero steps without an input read)."""
    # Starts from the finishes they wait for, not ``finish - cost``: float
    # rounding could put a step's start a bit before its input's finish.
    previous = np.concatenate([np.zeros((finish.shape[0], 1)), finish[:, :-1]], axis=1)
    return np.maximum(previous, flat_finish[dep_index]), finish


def _one_f_one_b_finish(microbatch, backward, cost):
    """Every step's finish under 1F1B (``[p, 2k]``, one chunk per device) when every
    forward costs one integer ``f`` and every backward another ``g``, else None.

    Device ``s`` runs its ``w = min(p - s, k)`` warm-up forwards back to back from
    ``s f`` (each waits for the one before it on device ``s - 1``, which is ahead
    by exactly that); backward ``j`` of device ``s`` starts at ``p f + (p - 1 - s) g
    + j (f + g)``: the last device's steady pairs, one backward later per device
    up the pipeline; the forward that follows backward ``j`` in a pair starts
    when it ends, and its input, forward ``j + w`` of device ``s - 1``, ends at
    that same time. (Integers: the sums are exact, so the caller's one update can
    confirm them bit for bit.)"""
    forward = ~backward
    f, g = cost[forward], cost[backward]
    if not (f.size and g.size and np.all(f == f[0]) and np.all(g == g[0])) or not _integral(cost):
        return None
    f, g = float(f[0]), float(g[0])
    p, m = cost.shape
    s = np.arange(p)[:, None]
    warm = np.minimum(p - s, m // 2)
    pairs_from = p * f + (p - 1 - s) * g  # backward 0's start
    start = np.where(
        backward,
        pairs_from + microbatch * (f + g),
        np.where(microbatch < warm, (s + microbatch) * f, pairs_from + (microbatch - warm) * (f + g) + g),
    )
    return start + cost


def message_times(start, finish, producer, consumer):
    """Issue time of each message, as :func:`~distir_jax.transforms.schedules.global_issue_order` picks it.

    A message is a barrier of its two devices; it goes at the candidate time
    ``tau`` in ``[producer finish, consumer start]`` (those two, and the step
    starts and ends of either device in between) that minimizes ``(|fa - fb|,
    max(fa, fb), tau)``, where ``fx`` is when device ``x`` finishes the step it
    runs at ``tau``.

    Args:
      start, finish: ``[p, M]`` estimated step times, each row ascending,
        with positive durations.
      producer, consumer: ``[X]`` flat step indices (``device * M + i``).

    Returns:
      ``[X]`` issue times.
    """
    p, m = start.shape
    lo, hi = finish.reshape(-1)[producer], start.reshape(-1)[consumer]
    out = lo.copy()  # a message its consumer takes at once has one candidate
    wait = np.flatnonzero(hi > lo)
    # Every time searched for below is one of these two tables' (so integers when they are).
    exact = _integral(start) and _integral(finish)
    starts, finishes = _RowSearch(start, exact), _RowSearch(finish, exact)
    # At ``lo`` the sender is free (its producer just finished); if the receiver
    # is free too, ``lo`` is optimal: both keys 0 and ``lo``, the least of all.
    receiver_free = _free_at(starts, finish, consumer[wait] // m, lo[wait])
    busy = receiver_free > lo[wait]
    wait = wait[busy]
    if wait.size:
        out[wait] = _barrier_times(
            starts, finishes, producer[wait], consumer[wait], lo[wait], hi[wait], receiver_free[busy]
        )
    return out


def issue_order(start, finish, producer, consumer) -> np.ndarray:
    """:func:`~distir_jax.transforms.schedules.global_issue_order`'s order, as indices.

    Steps go by estimated start (device number breaks ties), messages by
    :func:`message_times` (their own order breaks ties), and a message before
    a step at equal times.

    Args:
      start, finish: ``[p, M]`` estimated step times (see :func:`message_times`).
      producer, consumer: ``[X]`` flat step indices of each message.

    Returns:
      ``[p * M + X]`` event indices in issue order: ``i < p * M`` is step
      ``i`` (``device * M + position``), ``p * M + j`` is message ``j``.
    """
    p, m = start.shape
    tau = message_times(start, finish, producer, consumer)
    time = np.concatenate([start.reshape(-1), tau])
    tier = np.concatenate([np.ones(p * m), np.zeros(len(tau))])
    tie = np.concatenate([np.repeat(np.arange(p), m), np.arange(len(tau))])
    return np.lexsort((tie, tier, time))


def _barrier_times(starts: _RowSearch, finishes: _RowSearch, producer, consumer, lo, hi, receiver_free):
    """Each waiting message's issue time (see :func:`message_times`); ``receiver_free``:
    when its receiver can join a barrier at ``lo`` (already searched)."""
    start, finish = starts.table, finishes.table
    m = start.shape[1]
    a, i_a = np.divmod(producer, m)
    b, i_b = np.divmod(consumer, m)
    order_a = order_b = None  # rows in order, for searches that go row by row
    if starts.keys is None or finishes.keys is None:
        order_a, order_b = np.argsort(a, kind="stable"), np.argsort(b, kind="stable")
    # Steps of the sender after its producer start at >= lo, and steps of the
    # receiver before its consumer end at <= hi, so only the far ends need a search.
    ranges = [
        (a, start, i_a + 1, starts(a, hi, "right", order_a)),
        (a, finish, i_a, finishes(a, hi, "right", order_a)),
        (b, start, starts(b, lo, "left", order_b), i_b + 1),
        (b, finish, finishes(b, lo, "left", order_b), i_b),
    ]
    # Candidates in groups: ``lo`` (the sender's own boundary), ``hi`` (the
    # receiver's), then each range's step boundaries, a message's together. A
    # candidate that is one device's own step boundary finds that device free
    # (it is not inside a step), so only the other device needs a search. The
    # lexicographic minimum over all candidates is the minimum over each
    # group's minimum, so groups are reduced one by one, with no sort.
    everyone = np.arange(len(lo))
    best = _best_candidates(starts, finish, b, lo, receiver=False, firsts=everyone, free_other=receiver_free)
    groups = [(a, hi, True, everyone, everyone)]
    for side, (device, table, first, last) in enumerate(ranges):
        count = np.maximum(last - first, 0)
        owner = np.repeat(everyone, count)
        offset = np.arange(owner.shape[0]) - np.repeat(np.cumsum(count) - count, count)
        tau = table.reshape(-1)[device[owner] * m + first[owner] + offset]
        firsts = np.flatnonzero(np.concatenate([[True], owner[1:] != owner[:-1]])) if len(owner) else owner
        groups.append((b if side < 2 else a, tau, side >= 2, owner, firsts))
    for other, tau, receiver, owner, firsts in groups:
        keys = _best_candidates(starts, finish, other[owner], tau, receiver, firsts)
        has = owner[firsts]  # the messages with candidates in this group
        ahead = _lexicographically_less(keys, tuple(k[has] for k in best))
        for k, new in zip(best, keys, strict=True):
            k[has[ahead]] = new[ahead]
    return best[2]


def _best_candidates(
    starts: _RowSearch, finish, other, tau, receiver: bool, firsts, free_other=None
) -> tuple:
    """Per message, its best candidate's keys ``(|fa - fb|, max(fa, fb), tau)``,
    lexicographically least (``firsts``: where each message's candidates begin
    among ``tau``, a message's together). ``tau`` are boundaries of the
    receiver's steps (``receiver``) or of the sender's; ``other`` is the other
    device of each, and ``free_other`` when it can join at ``tau``, if known."""
    if free_other is None:
        free_other = _free_at(starts, finish, other, tau)
    fa, fb = (free_other, tau) if receiver else (tau, free_other)
    keys = (np.abs(fa - fb), np.maximum(fa, fb), tau)
    if len(firsts) == len(tau):  # one candidate per message
        return tuple(np.array(k, np.float64) for k in keys)
    sizes = np.diff(np.append(firsts, len(tau)))
    best = np.ones(len(tau), bool)
    out = []
    for key in keys:
        key = np.where(best, key, np.inf)
        least = np.minimum.reduceat(key, firsts)
        best &= key == np.repeat(least, sizes)
        out.append(least)
    return tuple(out)


def _lexicographically_less(x: tuple, y: tuple) -> np.ndarray:
    """Elementwise: whether key tuple ``x`` comes before ``y``."""
    less = np.zeros(len(x[0]), bool)
    equal = np.ones(len(x[0]), bool)
    for u, v in zip(x, y, strict=True):
        less |= equal & (u < v)
        equal &= u == v
    return less


class _RowSearch:
    """``np.searchsorted(table[row[i]], values[i], side)`` for every ``i``, over the
    rows of one ``[p, M]`` table (each row ascending, times >= 0), made once per
    table: message placement searches each of its two tables several times.

    With integer times (``exact``: the table and every value searched, unit step
    costs), one search over all rows at once, each row offset by a power of two
    above its largest time (exact in float64); otherwise one search per row."""

    def __init__(self, table: np.ndarray, exact: bool):
        self.table = table
        top = float(table[:, -1].max()) if table.size else 0.0
        self.offset = 2.0 ** np.ceil(np.log2(top + 2.0))
        self.keys = None
        if exact and self.offset * table.shape[0] < 2.0**52:
            self.keys = (table + self.offset * np.arange(table.shape[0])[:, None]).reshape(-1)

    def __call__(self, row, values, side: str, order=None):
        """``order`` may pass ``np.argsort(row, kind="stable")`` when it is already known."""
        table = self.table
        if self.keys is not None:
            return np.searchsorted(self.keys, values + self.offset * row, side=side) - row * table.shape[1]
        out = np.empty(len(values), np.int64)
        order = np.argsort(row, kind="stable") if order is None else order
        bounds = np.searchsorted(row[order], np.arange(table.shape[0] + 1))
        for r in range(table.shape[0]):
            idx = order[bounds[r] : bounds[r + 1]]
            if idx.size:
                out[idx] = np.searchsorted(table[r], values[idx], side=side)
        return out


def _free_at(starts: _RowSearch, finish, device, tau):
    """When ``device`` can join a barrier at ``tau``: the end of the step it runs then, or ``tau``."""
    m = finish.shape[1]
    index = starts(device, tau, "left") - 1
    end = finish.reshape(-1)[device * m + np.maximum(index, 0)]
    return np.where((index >= 0) & (end > tau), end, tau)


def _integral(x) -> bool:
    x = np.asarray(x)
    return bool(np.all(x == np.floor(x)))
