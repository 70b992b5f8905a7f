"""Pipeline schedules as data, their validation, and a global issue order.

A schedule says, for each pipeline device ``s`` (``0..p-1``), the order in
which it runs its steps. A step is a :class:`Step` ``(chunk, microbatch,
direction)``: the forward (``"F"``) or backward (``"B"``) pass of one model
chunk on one microbatch. With ``v`` virtual stages the model is cut into
``n = p * v`` chunks and chunk ``c`` lives on device ``c % p``; without
interleaving ``v = 1`` and chunk ``s`` is stage ``s``.

Steps depend on each other only within a microbatch: the forward of chunk
``c`` needs the forward of chunk ``c - 1``; the backward of chunk ``c`` needs
its own forward and the backward of chunk ``c + 1``. A device runs its steps
strictly in order, so a schedule can deadlock; :func:`validate_schedule`
proves it does not.

Since the simulator's issue order *is* the schedule, the pipeline transform
turns a schedule into one global list of steps and messages:
:func:`global_issue_order` states the rule step by step;
:func:`estimated_issue_order`, which the transform uses, computes the same
rule with array arithmetic (:mod:`~distir_jax.transforms.coarse_schedule`), so
that the coarse program generator, which never builds ``Step`` objects, can
reproduce the transform's order bit for bit.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
DIRECTIONS = ("F", "B")


class Step(NamedTuple):
    """One unit of pipeline work: a pass of one model chunk on one microbatch."""

    chunk: int
    microbatch: int
    direction: str  # "F" or "B"

    def __str__(self) -> str:
        return f"{self.direction}(chunk {self.chunk}, microbatch {self.microbatch})"


Schedule = dict[int, tuple[Step, ...]]


def _check_sizes(p, k, v) -> None:
    for name, value in (("degree", p), ("microbatches", k), ("virtual_stages", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")


def gpipe(p: int, k: int) -> Schedule:
    """GPipe: every device runs all its forwards, then all its backwards (FIFO).

    Args:
      p: pipeline devices (stages).
      k: microbatches.
    """
    _check_sizes(p, k, 1)
    return {
        s: tuple(Step(s, m, "F") for m in range(k)) + tuple(Step(s, m, "B") for m in range(k))
        for s in range(p)
    }


def one_f_one_b(p: int, k: int) -> Schedule:
    """PipeDream-Flush (1F1B): warm-up forwards, alternate, then cool-down backwards.

    Stage ``s`` runs ``min(p - s, k)`` forwards, then alternates one backward and
    one forward, then runs the remaining backwards. At most ``p - s``
    microbatches are in flight on stage ``s``, which bounds its stashed
    activations; the bubble is GPipe's.
    """
    _check_sizes(p, k, 1)
    schedule = {}
    for s in range(p):
        warm = min(p - s, k)
        steps = [Step(s, m, "F") for m in range(warm)]
        for m in range(k - warm):
            steps += [Step(s, m, "B"), Step(s, warm + m, "F")]
        steps += [Step(s, m, "B") for m in range(k - warm, k)]
        schedule[s] = tuple(steps)
    return schedule


def interleaved_1f1b(p: int, k: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: each device holds ``v`` chunks ``s, s + p, ...``.

    Microbatches go through a device's chunks in groups of ``p``; device ``s``
    warms up with ``2 (p - s - 1) + (v - 1) p`` forwards, then alternates
    forward and backward, then cools down (Narayanan et al. 2021).

    Raises:
      ValueError: when ``k`` is not a multiple of ``p`` (the schedule cycles
        through microbatches in groups of ``p``).
    """
    _check_sizes(p, k, v)
    if k % p:
        raise ValueError(
            f"the interleaved schedule needs microbatches to be a multiple of degree, "
            f"got microbatches={k}, degree={p}"
        )
    total = k * v

    def step(s: int, i: int, forward: bool) -> Step:
        group, j = divmod(i, p * v)
        local = j // p
        if not forward:  # backwards visit the chunks in reverse
            local = v - 1 - local
        return Step(local * p + s, group * p + j % p, "F" if forward else "B")

    schedule = {}
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        steps = [step(s, i, True) for i in range(warm)]
        for i in range(total - warm):
            steps += [step(s, warm + i, True), step(s, i, False)]
        steps += [step(s, i, False) for i in range(total - warm, total)]
        schedule[s] = tuple(steps)
    return schedule


def make_schedule(schedule, p: int, k: int, v: int = 1) -> Schedule:
    """A schedule by name (``"gpipe"``, ``"1f1b"``, ``"interleaved"``) or a validated custom one.

    Raises:
      ValueError: for an unknown name (listing the valid ones), a named
        schedule that does not support ``v``, or an invalid custom schedule.
    """
    if isinstance(schedule, str):
        if schedule not in SCHEDULE_NAMES:
            raise ValueError(
                f"unknown schedule={schedule!r}; valid names: {', '.join(SCHEDULE_NAMES)}, "
                "or a dict device -> list of (chunk, microbatch, 'F' | 'B')"
            )
        if schedule == "interleaved":
            return interleaved_1f1b(p, k, v)
        if v != 1:
            raise ValueError(
                f"schedule={schedule!r} runs one chunk per device, got virtual_stages={v}; "
                "use schedule='interleaved' or a custom schedule for virtual_stages > 1"
            )
        return gpipe(p, k) if schedule == "gpipe" else one_f_one_b(p, k)
    return validate_schedule(schedule, p, k, v)


def step_dependencies(step: Step, num_chunks: int) -> tuple[Step, ...]:
    """Steps of other chunks (or the own forward) that ``step`` waits for."""
    chunk, mb, direction = step
    if direction == "F":
        return (Step(chunk - 1, mb, "F"),) if chunk > 0 else ()
    deps = [Step(chunk, mb, "F")]
    if chunk < num_chunks - 1:
        deps.append(Step(chunk + 1, mb, "B"))
    return tuple(deps)


def _as_step(raw, device: int, index: int, p: int, k: int, v: int) -> Step:
    where = f"schedule[{device}][{index}]"
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) != 3:
        raise ValueError(f"{where} must be a (chunk, microbatch, direction) triple, got {raw!r}")
    chunk, mb, direction = raw
    for name, value, bound in (("chunk", chunk, p * v), ("microbatch", mb, k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < bound:
            raise ValueError(f"{where}: {name} must be an int in [0, {bound}), got {name}={value!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"{where}: direction must be 'F' or 'B', got {direction!r}")
    step = Step(int(chunk), int(mb), direction)
    if step.chunk % p != device:
        raise ValueError(
            f"{where} = {step} is on device {device}, but chunk {chunk} lives on device "
            f"{chunk % p} (chunk c runs on device c % degree, degree={p})"
        )
    return step


def validate_schedule(schedule: Mapping, p: int, k: int, v: int = 1) -> Schedule:
    """Checks a schedule and returns it normalized (tuples of :class:`Step`).

    A valid schedule lists every ``(chunk, microbatch, direction)`` exactly
    once, on device ``chunk % p``; runs each chunk's forward of a microbatch
    before its backward; and does not deadlock when every device runs its
    steps in order and waits for the steps it depends on.

    Args:
      schedule: ``device -> sequence of (chunk, microbatch, direction)`` for
        devices ``0..p-1``.
      p: pipeline devices.
      k: microbatches.
      v: chunks per device (virtual stages).

    Raises:
      ValueError: naming the device, position and step at fault; for a
        deadlock, the stuck device, its step and the step it waits for.
    """
    _check_sizes(p, k, v)
    if not isinstance(schedule, Mapping):
        raise ValueError(
            f"schedule must be a name ({', '.join(SCHEDULE_NAMES)}) or a dict device -> list of "
            f"(chunk, microbatch, direction), got {type(schedule).__name__}"
        )
    if set(schedule) != set(range(p)):
        raise ValueError(
            f"schedule must have one entry per device 0..{p - 1} (degree={p}), got devices {sorted(schedule)}"
        )
    normalized: Schedule = {}
    position: dict[Step, int] = {}
    for device in range(p):
        steps = []
        for index, raw in enumerate(schedule[device]):
            step = _as_step(raw, device, index, p, k, v)
            if step in position:
                raise ValueError(
                    f"schedule[{device}][{index}] = {step} appears twice (first at position {position[step]})"
                )
            position[step] = index
            steps.append(step)
        normalized[device] = tuple(steps)
    missing = [
        Step(c, m, d)
        for c in range(p * v)
        for m in range(k)
        for d in DIRECTIONS
        if Step(c, m, d) not in position
    ]
    if missing:
        shown = ", ".join(f"{s} on device {s.chunk % p}" for s in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ValueError(f"schedule is missing {len(missing)} step(s): {shown}{more}")
    for c in range(p * v):
        for m in range(k):
            f, b = Step(c, m, "F"), Step(c, m, "B")
            if position[b] < position[f]:
                raise ValueError(
                    f"schedule[{c % p}] runs {b} at position {position[b]} before its forward "
                    f"{f} at position {position[f]}"
                )
    schedule_times(normalized, p * v)  # raises on deadlock
    return normalized


def schedule_times(
    schedule: Schedule, num_chunks: int, cost: Callable[[Step], float] | None = None
) -> dict[Step, tuple[float, float]]:
    """``(start, finish)`` of every step when devices run in order and wait for dependencies.

    Args:
      schedule: a schedule (well formed; see :func:`validate_schedule`).
      num_chunks: ``p * v``.
      cost: seconds (or any unit) per step; default 1 for a forward, 2 for a
        backward.

    Raises:
      ValueError: when the order deadlocks, naming the stuck device, its step
        and the step it waits for.
    """
    cost = cost or (lambda step: 1.0 if step.direction == "F" else 2.0)
    pos = dict.fromkeys(schedule, 0)
    clock = dict.fromkeys(schedule, 0.0)
    times: dict[Step, tuple[float, float]] = {}
    last = num_chunks - 1
    progress = True
    while progress:  # step_dependencies inlined: every pipeline transform runs this to rule out deadlock
        progress = False
        for device, steps in schedule.items():
            i, now = pos[device], clock[device]
            while i < len(steps):
                step = steps[i]
                chunk, mb, direction = step
                start = now
                if direction == "F":
                    if chunk > 0:
                        before = times.get((chunk - 1, mb, "F"))
                        if before is None:
                            break
                        start = max(start, before[1])
                else:
                    own = times.get((chunk, mb, "F"))
                    if own is None:
                        break
                    start = max(start, own[1])
                    if chunk < last:
                        later = times.get((chunk + 1, mb, "B"))
                        if later is None:
                            break
                        start = max(start, later[1])
                finish = start + float(cost(step))
                times[step] = (start, finish)
                now = finish
                i += 1
                progress = True
            pos[device], clock[device] = i, now
    stuck = [d for d in schedule if pos[d] < len(schedule[d])]
    if stuck:
        p = len(schedule)
        lines = []
        for device in stuck:
            step = schedule[device][pos[device]]
            waits = [d for d in step_dependencies(step, num_chunks) if d not in times]
            lines.append(
                f"device {device} is stuck at its step {pos[device]} {step}, which waits for "
                + " and ".join(f"{w} on device {w.chunk % p}" for w in waits)
            )
        raise ValueError("schedule deadlocks: " + "; ".join(lines))
    return times


def global_issue_order(
    schedule: Schedule,
    num_chunks: int,
    messages: Iterable[tuple[Step, Step, Hashable]],
    times: Mapping[Step, tuple[float, float]] | None = None,
) -> list[tuple[str, object]]:
    """Interleaves all devices' steps and the messages between them into one list.

    Steps are issued in order of their estimated start times, which respects
    every device's order and every dependency. Under the simulator's
    semantics a message (a ``Send``) occupies both its devices and starts when
    both are free: a barrier. It is placed at the time ``tau`` between its
    producer's finish and its consumer's start where the two devices come
    free closest together (each finishes the step it is running at ``tau``),
    so that neither waits for the other; among equally good times, the
    earliest. When the estimates are exact and the devices share a free
    moment, the barrier costs nothing: GPipe and 1F1B on balanced stages keep
    their textbook bubble.

    Args:
      schedule: a valid schedule.
      num_chunks: ``p * v``.
      messages: ``(producer step, consumer step, key)`` for data that crosses
        devices; the producer's device sends to the consumer's device.
      times: estimated ``(start, finish)`` per step with positive durations
        (default :func:`schedule_times`).

    Returns:
      Events in issue order: ``("step", Step)`` or ``("message", key)``. Each
      message comes after its producer and before its consumer.
    """
    p = len(schedule)
    times = times or schedule_times(schedule, num_chunks)
    if any(finish <= start for start, finish in times.values()):
        raise ValueError("global_issue_order needs estimated step times with positive durations")
    starts = {d: [times[st][0] for st in steps] for d, steps in schedule.items()}
    ends = {d: [times[st][1] for st in steps] for d, steps in schedule.items()}

    def free_at(device: int, tau: float) -> float:
        """When ``device`` can join a barrier issued at ``tau``: after the step it is running."""
        i = bisect.bisect_left(starts[device], tau) - 1
        return ends[device][i] if i >= 0 and ends[device][i] > tau else tau

    def cost(a: int, b: int, tau: float) -> tuple[float, float, float]:
        fa, fb = free_at(a, tau), free_at(b, tau)
        return (abs(fa - fb), max(fa, fb), tau)

    events = [(times[st][0], 1, device, ("step", st)) for device, steps in schedule.items() for st in steps]
    for index, (producer, consumer, key) in enumerate(messages):
        a, b = producer.chunk % p, consumer.chunk % p
        lo, hi = times[producer][1], times[consumer][0]
        candidates = {lo, hi}
        for device in (a, b):
            for table in (starts[device], ends[device]):
                candidates.update(table[bisect.bisect_left(table, lo) : bisect.bisect_right(table, hi)])
        tau = min(candidates, key=lambda t: cost(a, b, t))
        # At equal times a message goes before steps: a consumer starts exactly at hi.
        events.append((tau, 0, index, ("message", key)))
    events.sort(key=lambda e: e[:3])
    return [e[3] for e in events]


def estimated_issue_order(
    schedule: Schedule,
    num_chunks: int,
    messages: Sequence[tuple[Step, Step, Hashable]],
    step_costs,
) -> list[tuple[str, object]]:
    """:func:`global_issue_order` on times estimated from per-chunk costs, with array arithmetic.

    The times are :func:`~distir_jax.transforms.coarse_schedule.estimated_times`'
    (equal to :func:`schedule_times`' up to the last bits of float sums; bit
    for bit with integer costs), and the order is the one
    :func:`global_issue_order` gives on them.

    Args:
      schedule: a valid schedule (every device runs ``2 k v`` steps).
      num_chunks: ``p * v``.
      messages: as for :func:`global_issue_order`.
      step_costs: ``[num_chunks, 2]`` positive cost of each chunk's forward
        and backward.

    Returns:
      Events in issue order, as :func:`global_issue_order` returns them.
    """
    from distir_jax.transforms.coarse_schedule import check_step_costs, estimated_times, issue_order

    p = len(schedule)
    rows = [schedule[d] for d in range(p)]
    m = len(rows[0])
    if any(len(r) != m for r in rows):
        raise ValueError(f"every device of a valid schedule runs as many steps, got {[len(r) for r in rows]}")
    step_costs = check_step_costs(step_costs, num_chunks)
    steps = [st for r in rows for st in r]
    chunk = np.fromiter((st.chunk for st in steps), np.int64, len(steps)).reshape(p, m)
    mb = np.fromiter((st.microbatch for st in steps), np.int64, len(steps)).reshape(p, m)
    backward = np.fromiter((st.direction == "B" for st in steps), bool, len(steps)).reshape(p, m)
    start, finish = estimated_times(
        chunk, mb, backward, num_chunks, step_costs[chunk, backward.astype(np.int64)]
    )
    flat = {st: i for i, st in enumerate(steps)}
    producer = np.fromiter((flat[a] for a, _, _ in messages), np.int64, len(messages))
    consumer = np.fromiter((flat[b] for _, b, _ in messages), np.int64, len(messages))
    order = issue_order(start, finish, producer, consumer)
    n = len(steps)
    return [("step", steps[i]) if i < n else ("message", messages[i - n][2]) for i in order.tolist()]
