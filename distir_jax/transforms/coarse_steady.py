"""A long pipeline as a short one plus repeated periods (steady-state reduction).

A 1F1B or interleaved pipeline with many microbatches issues a warm-up, then
one steady period over and over, then a cool-down: in issue order its
template is ``A Q^(1+r) Z`` where the template with ``r`` fewer periods is
``A Q Z``. Only that short template needs building and simulating:

* The kernel's timeline is max-plus: an op starts at the largest of its
  resources' clocks, its finish slots and 0, and every clock it holds moves
  to that start plus its duration. Adding ``c >= 0`` to every input of an op
  adds ``c`` to its start and finish.
* If running ``Q`` after ``A`` moves every clock that ``Q`` touches by the
  same ``lam`` (the *certificate*, read from the short run's finish slots by
  :func:`extrapolate`),
  each further copy of ``Q`` moves them by ``lam`` again, and ``Z`` then runs
  ``r * lam`` later than in the short program, all of it. So the long step
  time is the short one plus ``r * lam``, exactly (in real arithmetic; in
  float64 the bound below is ~1e-13).
* That needs, besides the certificate, what :func:`steady_template` checks
  statically: ``A`` and ``Q`` read and write no finish slots, ``A`` uses no
  resource that ``Q`` does not (so every resource is either shifted or never
  used before ``Z``), and every op of ``Z`` reads at least one clock or slot
  something wrote before it (an op that reads only untouched resources
  would start at 0 in both programs, not ``r * lam`` later).
* Peak memory needs no certificate: each stage's running bytes change by
  the same net amount over every copy of ``Q`` (the same events with the
  same sizes), so the long program's peak follows from the short one's
  per-part rises (:func:`~distir_jax.transforms.coarse_program.stage_peak_memory`).

When the certificate fails (the period has not settled in the short
program), the caller simulates the long template. If the certificate's
spread is ``e`` (largest minus smallest clock shift), the extrapolated time
is off by at most ``r * e`` (max-plus maps do not expand differences), which
is what :func:`extrapolate` bounds.

Which ``Q`` is the period comes from the structure, not the costs: the
templates for ``k`` and ``k + P`` microbatches (``P`` = 1, or ``p`` for the
interleaved schedule, which enters microbatches in groups of ``p``) must
differ by one inserted copy of a block that already ends the periodic part.
That the template for any larger ``k`` is the same with more copies is what
tests check against full templates (and ``benchmarks/sweep_gpt3.py
--check-steady`` on the whole GPT-3 space); it follows from the issue order
being computed from estimated times, which are themselves max-plus and
periodic once settled. That needs them computed exactly: steps are ordered by
integer costs (:func:`~distir_jax.transforms.coarse_schedule.order_costs`), and
with float ``1 + flops`` costs GPT-3 175B's long order was not the short one
repeated (ties broke differently from period to period). A template built from
step costs (the pipeline transform's order) is moreover checked op for op
against the long order before it stands for it: its period is found in the
long order's events themselves, as the block they insert ``r`` copies of, with
no order of one period more. The events are what every data-parallel mode
builds its template from, one op per event (the overlap modes: up to the first
last backward), so one check serves all modes (:func:`_verified_period`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from distir_jax.transforms.coarse_pipeline import (
    PipelineTemplate,
    core_columns,
    hashable_plan,
    pipeline_template,
    template_size,
)
from distir_jax.transforms.coarse_schedule import check_step_costs, order_costs

__all__ = [
    "MIN_LONG_OPS",
    "SteadyTemplate",
    "extrapolate",
    "microbatch_period",
    "short_candidates",
    "steady_template",
    "worth_it",
]


@dataclasses.dataclass(frozen=True, eq=False)
class SteadyTemplate:
    """A short template whose one period stands for ``extra_periods + 1`` copies.

    Attributes:
      template: the short template ``A Q Z``. Besides its own finish slots,
        it gives the ops of ``before`` and ``after`` slots that nothing
        reads, so a run's final slots (``SimResult.finish_slots``) hold
        their finish times.
      microbatches: ``k`` of the long program it stands for.
      extra_periods: ``r``, the copies of ``Q`` the long program has beyond the short one's.
      period: ``(begin, end)`` op range of ``Q`` in ``template``.
      before, after: ``[R]`` per resource (``stage * 2 + stream``) that ``Q``
        uses: the finish slot of the last op on it before ``Q`` (-1: none,
        clock 0) and of the last op on it within ``Q``, that is, the
        resource's clock before and after the period.
      resources: ``[R]`` those resources.
      event_part: ``[E]`` for each memory event of ``template.stage_events``,
        0 if its op is in ``A``, 1 in ``Q``, 2 in ``Z``.
    """

    template: PipelineTemplate
    microbatches: int
    extra_periods: int
    period: tuple[int, int]
    before: np.ndarray
    after: np.ndarray
    resources: np.ndarray
    event_part: np.ndarray

    @functools.cached_property
    def stage_part_runs(self) -> tuple:
        """The memory events (:attr:`PipelineTemplate.stage_events`' order) cut into
        runs of one stage and one part (``A``, ``Q``, ``Z`` come in program order
        within a stage): ``(run starts [K], each run's stage position [K], its
        part [K], where each stage's runs start among them [stages], and (first,
        last) [stages] event of each stage's ``Q``, -1 if none)``."""
        _, event_stage = self.template.stage_events
        stages, _, _ = self.template.stage_runs
        position = np.searchsorted(stages, event_stage)
        key = position * 3 + self.event_part
        runs = np.flatnonzero(np.diff(key, prepend=-1) != 0)
        in_period = np.flatnonzero(self.event_part == 1)
        first = np.full(len(stages), -1)
        last = np.full(len(stages), -1)
        first[position[in_period[::-1]]] = in_period[::-1]  # the last write wins: the first event
        last[position[in_period]] = in_period
        run_stage = position[runs]
        stage_runs = np.flatnonzero(np.diff(run_stage, prepend=-1) != 0)
        return runs, run_stage, self.event_part[runs], stage_runs, (first, last)


def microbatch_period(schedule: str, pipeline: int) -> int:
    """Microbatches one steady period adds: interleaved 1F1B enters them in groups of ``p``."""
    return pipeline if schedule == "interleaved" else 1


def short_candidates(schedule: str, pipeline: int) -> tuple[int, ...]:
    """Short microbatch counts to try, smallest first: the 1F1B order is
    periodic from ``k = p + 1`` and its clocks usually from ``p + 2``, the
    interleaved ones from ``3p`` and ``5p`` (the clocks may settle later: a
    caller whose certificate fails may try the longer ones)."""
    p = pipeline
    if schedule == "interleaved":
        return (5 * p, 6 * p, 8 * p)
    return (p + 2, 2 * p + 2, 4 * p)


def _signature(template: PipelineTemplate) -> np.ndarray:
    """``[N, X]``: everything the kernel and the memory replay see of an op."""
    return np.column_stack(_signature_columns(template)).astype(np.int64)


def _signature_columns(template: PipelineTemplate) -> list[np.ndarray]:
    """:func:`_signature`'s columns, ``[N]`` each (views, in the template's dtypes)."""
    cost_row, memory_row = template.rows
    columns = [cost_row, memory_row, template.stage, template.stream, template.link_kind]
    columns += [template.dep_slot, template.out_slot]
    columns = [np.asarray(c).reshape(len(cost_row), -1) for c in columns]
    return [c[:, j] for c in columns for j in range(c.shape[1])]


def _find_period(short: list, long: list, copies: int = 1) -> tuple[int, int] | None:
    """``(begin, end)`` of a block ``Q`` with ``short = A Q Z`` and ``long = A Q^(1 + copies) Z``,
    or None; the latest such block if there are several.

    ``short`` and ``long`` are two programs' ops as columns (``[N]`` arrays,
    :func:`_signature_columns`), compared column by column: a GPT-3 long
    template has ~1e5 ops, and packing or stacking the columns cost more than
    comparing them."""
    n1, extra = len(short[0]), len(long[0]) - len(short[0])
    if extra <= 0 or extra % copies:
        return None
    length = extra // copies
    if length > n1:
        return None

    def agree(x: list, y: list) -> int:  # how many leading ops agree in every column
        differ = [np.flatnonzero(a != b) for a, b in zip(x, y, strict=True)]
        return min((int(d[0]) for d in differ if d.size), default=len(x[0]))

    prefix = agree(short, [c[:n1] for c in long])
    suffix = agree([c[::-1] for c in short], [c[::-1][:n1] for c in long])
    # Insertion points i with long = short[:i] + X + short[i:]: N1 - suffix <= i <= prefix.
    # X is copies of the block before it when long repeats with period L over
    # [i - L, i + extra): long[j] == long[j + L] for every j there.
    lo, hi = max(n1 - suffix, length), min(prefix, n1)
    if hi < lo:
        return None
    window = slice(lo - length, hi + extra - length)  # every j some point needs
    repeats = np.ones(window.stop - window.start, bool)
    for c in long:
        repeats &= c[window.start + length : window.stop + length] == c[window]
    bad = np.concatenate([[0], np.cumsum(~repeats)])
    points = np.arange(lo, hi + 1)
    points = points[bad[points - lo + extra] == bad[points - lo]]
    if not points.size:
        return None
    i = int(points[-1])
    return i - length, i


def _resources(template: PipelineTemplate) -> np.ndarray:
    """``[N, 2]`` resource of each op slot (``stage * 2 + stream``; a send's
    receiving slot is on stream 0), -1 where unused."""
    stage = template.stage
    stream = np.stack([template.stream, np.zeros_like(template.stream)], axis=1)
    return np.where(stage >= 0, stage * 2 + stream, -1)


def _statically_sound(template: PipelineTemplate, begin: int, end: int) -> bool:
    """The conditions besides the certificate (see the module docstring)."""
    if np.any(template.dep_slot[:end] >= 0) or np.any(template.out_slot[:end] >= 0):
        return False
    res = _resources(template)
    flat = res.reshape(-1)
    in_period = np.zeros(flat.max(initial=0) + 1, bool)
    period = res[begin:end]
    in_period[period[period >= 0]] = True
    earlier = res[:begin]
    if not np.all(in_period[earlier[earlier >= 0]]):
        return False
    # An op of Z whose every resource is used for the first time, and that waits for no slot,
    # would start at 0 in both programs.
    used = np.flatnonzero(flat >= 0)
    first = np.full(len(in_period), len(res))
    resource, at = np.unique(flat[used], return_index=True)
    first[resource] = used[at] // 2  # each resource's first op
    late = res[end:]
    op = np.arange(end, len(res))
    fresh = np.where(late >= 0, first[np.maximum(late, 0)] == op[:, None], True).all(axis=1)
    fresh &= (late >= 0).any(axis=1)
    waits = (template.dep_slot[end:].reshape(len(late), -1) >= 0).any(axis=1)
    return not np.any(fresh & ~waits)


def _last_op_on(res: np.ndarray, resources: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per resource, the last op in ``[lo, hi)`` using it, or -1."""
    flat = res[lo:hi].reshape(-1)
    used = flat >= 0
    last = np.full(max(int(res.max(initial=0)), int(resources.max(initial=0))) + 1, -1, np.int64)
    np.maximum.at(last, flat[used], lo + np.flatnonzero(used) // res.shape[1])
    return last[resources]


def steady_template(
    pipeline: int,
    microbatches: int,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
    mode: str = "none",
    step_costs=None,
    segments: tuple | None = None,
    updates: tuple | None = None,
    *,
    short_microbatches: tuple[int, ...] | None = None,
) -> SteadyTemplate | None:
    """The short template that stands for a long 1F1B / interleaved one, or None.

    Args:
      pipeline, microbatches, virtual_stages, schedule, mode, step_costs,
        segments, updates: the long template's, as
        :func:`~distir_jax.transforms.coarse_pipeline.pipeline_template`
        takes them (the short one gets the same).
      short_microbatches: short microbatch counts to try, in order (default:
        a few per schedule, smallest first).

    Returns:
      None when the long program is not longer than the shortest that shows
      a period, for GPipe (whose warm-up grows with ``k``), or when no
      candidate short template has a period that passes the static checks.
      The certificate on costs is the caller's (see :func:`extrapolate`).
    """
    p, k, v = int(pipeline), int(microbatches), int(virtual_stages)
    if schedule not in ("1f1b", "interleaved") or p < 2:
        return None
    if step_costs is not None:
        # The integers steps are ordered by, which is all a template reads of its
        # costs: the short templates are cached by them, so microbatch sizes whose
        # flops estimates round to the same integers share one (GPT-3 175B's
        # product sweep: 972 short templates instead of 2,310).
        step_costs = check_step_costs(step_costs, p * v)
        if not _exact_times(step_costs, k):
            return None
    # With step costs (the pipeline transform's order) the long order is built
    # and must be the short one repeated: the order's periodicity is tested for
    # unit costs (and holds for GPT-3's costs rounded to integers), not proved.
    verify = step_costs is not None
    step = microbatch_period(schedule, p)
    candidates = short_candidates(schedule, p) if short_microbatches is None else short_microbatches
    costs = None if step_costs is None else tuple(map(tuple, np.asarray(step_costs, np.float64).tolist()))
    segments, updates = hashable_plan(segments, updates)  # cache keys
    for short_k in candidates:
        if short_k + step > k:
            return None
        if (k - short_k) % step:
            continue
        family = (p, int(short_k), v, schedule, mode, costs, segments, updates)
        if verify:
            # The period is found where the long order repeats it: that is the
            # check, and no template of one period more is needed to find it.
            found = _verified_period(family, k)
        else:
            found = _short(family)
        if found is not None:
            return dataclasses.replace(found, microbatches=k, extra_periods=(k - short_k) // step)
    return None


def _template(family: tuple, microbatches: int | None = None) -> PipelineTemplate:
    """The template of ``family`` (``(p, short k, v, schedule, mode, costs, segments,
    updates)``, costs hashable) with its own short ``k`` or ``microbatches``."""
    p, short_k, v, schedule, mode, costs, segments, updates = family
    k = short_k if microbatches is None else microbatches
    step_costs = None if costs is None else np.asarray(costs, np.float64)
    return pipeline_template(p, k, v, schedule, mode, step_costs, segments, updates)


def _short_in(long: PipelineTemplate, family: tuple) -> SteadyTemplate | None:
    """:func:`_short`'s template of ``family`` if ``long`` is it with its period
    repeated (``A Q Z`` and ``A Q^(1+r) Z``), else None: the check on whole
    templates, op for op, that the tests hold :func:`_verified_period`'s (on
    the orders' events) to.

    The period is where ``long`` inserts ``r`` copies of a block that ends the
    periodic part (:func:`_find_period`), so finding it checks the long
    template op for op."""
    p, short_k, _, schedule = family[:4]
    copies = (long.microbatches - short_k) // microbatch_period(schedule, p)
    if copies < 1:
        return None
    found = _find_period(_signature_columns(_template(family)), _signature_columns(long), copies)
    return None if found is None else _with_period(family, *found)


def _verified_period(family: tuple, microbatches: int) -> SteadyTemplate | None:
    """:func:`_short`'s template of ``family`` if the long order (``microbatches``) is
    the short one with its period repeated, found on the orders' events
    (:func:`~distir_jax.transforms.coarse_pipeline.core_columns`), which every
    data-parallel mode shares, rather than on each mode's long template.

    That suffices: a mode makes each event one op of its template, and every
    column of the op's signature is a function of the event's kind, chunk,
    stages and whether its microbatch is a later one; it adds ops only at the
    end (which do not depend on ``k``), where the finish slots are, except
    that the overlap modes also cut each last backward into segments and add
    their reductions right after, with slots. So a period of those columns
    is, op for op, a period of a mode's template, if in the overlap modes it
    also ends before the short order's first last backward; the long
    template is then the short one with it repeated (tests check this against
    long templates). The period is then moved on as far as the template
    repeats (its ops see less of the events than the events differ by), to
    where :func:`_short_in` finds it in the long template."""
    p, short_k, v, schedule, mode = family[:5]
    found = _core_period(p, short_k, v, schedule, family[5], microbatches, mode.startswith("overlap"))
    if found is None:
        return None
    begin, end = found
    length = end - begin
    ops = _signature_columns(_template(family))
    repeats = np.ones(len(ops[0]) - end, bool)
    for column in ops:
        repeats &= column[end:] == column[begin : len(column) - length]
    end += int(np.argmin(repeats)) if not repeats.all() else len(repeats)
    return _with_period(family, end - length, end)


@functools.lru_cache(maxsize=512)
def _core_period(
    p: int, short_k: int, v: int, schedule: str, costs: tuple, microbatches: int, reductions: bool
):
    """``(begin, end)`` of the period of the orders of ``short_k`` and ``microbatches``
    (see :func:`_verified_period`; ``reductions``: for the overlap modes, whose
    templates add ops after last backwards)."""
    step_costs = None if costs is None else np.asarray(costs, np.float64)
    short = core_columns(p, short_k, v, schedule, step_costs)
    long = core_columns(p, microbatches, v, schedule, step_costs)
    if not reductions:  # the last backwards are ops like any other
        short, long = short[:4] + short[5:], long[:4] + long[5:]
    found = _find_period(short, long, (microbatches - short_k) // microbatch_period(schedule, p))
    if found is None or (reductions and short[4][: found[1]].any()):
        return None
    return found


def _exact_times(step_costs, microbatches: int) -> bool:
    """Whether every estimated time of the long program is computed exactly: the
    integer costs steps are ordered by (``order_costs``), summed over all
    microbatches, stay below ``2**53`` (float64 sums of such integers round
    nothing). With rounded sums, ties between estimated times can break
    differently from one period to the next (float ``1 + flops`` costs did, for
    GPT-3 175B)."""
    costs = order_costs(step_costs)  # what the order is computed from
    return bool(np.all(costs == np.floor(costs))) and float(costs.sum()) * microbatches < 2.0**53


@functools.lru_cache(maxsize=512)
def _short(family: tuple) -> SteadyTemplate | None:
    """The short template of ``family`` (see :func:`_template`) and its period, if
    it has one that passes the static checks (shared by every longer ``k``)."""
    p, short_k, _, schedule = family[:4]
    # On the orders' events (cores: the template of one period more need not be
    # built): ~25% of finding GPT-3 175B's 31 steady templates.
    return _verified_period(family, short_k + microbatch_period(schedule, p))


@functools.lru_cache(maxsize=512)
def _with_period(family: tuple, begin: int, end: int) -> SteadyTemplate | None:
    """The short template of ``family`` (see :func:`_template`) with period
    ``[begin, end)``, if that passes the static checks (one per short template
    and period: the long programs it stands for share it)."""
    short = _template(family)
    if not _statically_sound(short, begin, end):
        return None
    res = _resources(short)
    in_period = res[begin:end]
    resources = np.unique(in_period[in_period >= 0])
    op = short.stage_events[0] // 2
    before, after = _last_op_on(res, resources, 0, begin), _last_op_on(res, resources, begin, end)
    # Slots nobody reads for the ops whose finishes are the clocks (A and Q write no other slots).
    marked = np.unique(np.concatenate([before[before >= 0], after]))
    slot = np.full(short.num_ops, -1, np.int64)
    slot[marked] = short.num_slots + np.arange(len(marked))
    out_slot = short.out_slot.copy()
    out_slot[marked] = slot[marked]
    return SteadyTemplate(
        template=dataclasses.replace(short, out_slot=out_slot, num_slots=short.num_slots + len(marked)),
        microbatches=short.microbatches,
        extra_periods=0,
        period=(begin, end),
        before=np.where(before >= 0, slot[np.maximum(before, 0)], -1),
        after=slot[after],
        resources=resources,
        event_part=(op >= begin).astype(np.int8) + (op >= end),
    )


# Long programs shorter than this are simulated as they are: the kernel runs
# them fast, and finding a period costs building two short templates.
MIN_LONG_OPS = 4096


def worth_it(pipeline: int, microbatches: int, virtual_stages: int, schedule: str, mode: str) -> bool:
    """Whether a steady template saves work: the long program has at least
    ``MIN_LONG_OPS`` ops and more than the two short templates that find its
    period without step costs (sizes from
    :func:`~distir_jax.transforms.coarse_pipeline.template_size`; with step
    costs one short template is built, and the long one to check it against)."""
    if schedule not in ("1f1b", "interleaved") or pipeline < 2:
        return False
    short_k = short_candidates(schedule, pipeline)[0]
    step = microbatch_period(schedule, pipeline)
    size = lambda k: template_size(pipeline, k, virtual_stages, mode)[0]  # noqa: E731
    long = size(microbatches)
    return long >= MIN_LONG_OPS and size(short_k) + size(short_k + step) <= long


def extrapolate(finish_slots, before, after, extra_periods, step_time, rtol, xp=np):
    """The long programs' step times from short runs, and whether each is certified.

    Written once for NumPy and ``jax.numpy`` (``xp``), like the cost model.

    Args:
      finish_slots: ``[B, V]`` the short runs' final finish slots (``SimResult.finish_slots``).
      before, after: ``[B, R]`` or ``[R]``: :attr:`SteadyTemplate.before` /
        ``after``, -1 past a row's resources.
      extra_periods: ``[B]`` ``r`` (0: the row is no steady program; it is certified).
      step_time: ``[B]`` of the short runs.
      rtol: the largest relative error the bound ``r * spread`` may reach
        (``spread``: largest minus smallest clock shift over the period).

    Returns:
      ``(step_time, certified)``: ``[B]`` the short time plus ``r`` times the
      period's clock shift, and ``[B]`` bools; a row that is not certified
      needs its long program.
    """
    finish = xp.asarray(finish_slots)
    shape = (finish.shape[0], xp.shape(before)[-1])
    before, after = xp.broadcast_to(before, shape), xp.broadcast_to(after, shape)
    clock_before = xp.where(before >= 0, xp.take_along_axis(finish, xp.maximum(before, 0), axis=1), 0.0)
    clock_after = xp.take_along_axis(finish, xp.maximum(after, 0), axis=1)
    shift, used = clock_after - clock_before, after >= 0
    lam = xp.max(xp.where(used, shift, 0.0), axis=1)
    spread = lam - xp.min(xp.where(used, shift, lam[:, None]), axis=1)
    long_time = step_time + extra_periods * lam
    return long_time, (extra_periods == 0) | (extra_periods * spread <= rtol * long_time)
