"""Coarse pipeline programs, generated directly as arrays.

:func:`coarse_pipeline_program` builds the :class:`~distir_jax.lower.Program`
of a hybrid-parallel GPT training step with one op per pipeline step, without
building or lowering any IR: what the fine program (tensor parallel,
recompute, pipeline and data parallel transforms, ``representative_only``)
would give after :func:`~distir_jax.transforms.coarse_fuse.coarsen` grouped
its ops by ``(chunk, microbatch, direction)``.

Ops, in the issue order of
:func:`~distir_jax.transforms.schedules.global_issue_order` (steps by
estimated start, each message where its two devices come free closest
together; see :mod:`coarse_schedule`), from estimated step costs: by default
one unit per chunk forward and two per backward (so a template serves every
configuration of its structural key), or the caller's (the pipeline transform
uses ``1 + flops``, which reproduces its order exactly):

* ``F`` / ``B``: a chunk's forward / backward on one microbatch, on its stage's
  device; features ``layers * block (+ embedding on chunk 0) (+ head on the
  last chunk)`` from :class:`~distir_jax.transforms.coarse_features.LayerFeatures`;
  tensor-parallel collectives are in them, on the TP group's link.
* ``Send``: a block output to the next chunk's device after a forward, its
  gradient to the previous one after a backward.
* data parallelism (``d > 1``): without overlap, one op per stage after its
  last step holds the gradient all-reduce (or ZeRO reduce-scatter and
  all-gather) and the Adam update; with overlap, each chunk's reduction is an
  op on stream 1 right after the chunk's last backward, then the update (and
  with ZeRO the all-gather, again on stream 1). With ``segments`` (exact
  overlap), each chunk's last backward is instead cut after every weight
  gradient, each gradient reduced on stream 1 right after its segment, and
  with ZeRO the updates and all-gathers run weight by weight.
* tensor syncs (sequence parallelism, mode ``"sync_tp"``: without overlap):
  one op per stage before its update, the in-place all-reduces of its
  LayerNorm gradients over its tensor group (in the other modes the update
  holds them).

Dependencies: a step's inputs arrive by messages that occupy its device's
stream before it, so under the analytic cost model (an op busy until it
finishes on every resource it holds) issue order implies them; only the
stream-1 data-parallel ops carry explicit dependencies, which keeps the
kernel's finish-time table to a few slots (with ZeRO and exact overlap, one
per weight of a stage: each update waits for its own reduction).

Symmetry reduction: devices are numbered as the transforms number them
(tensor ranks adjacent, then stages, data replicas outermost: ``dp * p * t +
stage * t + tp``); only tensor rank 0 of replica 0 is simulated, one device
per stage, and every collective is costed on its full group's slowest link.

Memory per stage device: resident weights and optimizer state (ZeRO: a
``1 / d`` shard of the state; the weight shard an update writes is a view of
the weight, gathered back in place, as the data-parallel transform emits
them) and the microbatches' tokens / labels; gradients are
allocated by a chunk's first backward and freed by the update; each forward
keeps what the fine block's memory events say it keeps until the matching
backward frees it, so GPipe's and 1F1B's stashes follow from the issue order;
a message is allocated on the receiver and freed on the sender. Peak memory
comes from these events.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading

import numpy as np

from distir_jax.lower import NO_SLOT
from distir_jax.transforms.coarse_schedule import (
    check_step_costs,
    estimated_times,
    issue_order,
    schedule_arrays,
)

__all__ = [
    "DATA_MODES",
    "KIND_NAMES",
    "SYNC_MODES",
    "PipelineTemplate",
    "data_mode",
    "pipeline_template",
    "template_size",
]

# Op kinds of a coarse pipeline program.
F, B, SEND_ACTIVATION, SEND_GRADIENT, REDUCE, UPDATE, GATHER, TENSOR_SYNC = range(8)
KIND_NAMES = ("F", "B", "send_activation", "send_gradient", "reduce", "update", "gather", "tensor_sync")
# How gradients meet across data-parallel replicas (structure only). Mode
# "sync_tp" is mode "sync" whose stages also sync LayerNorm gradients over
# their tensor group (sequence parallelism): an op per stage before its update,
# which all-reduces over the data-parallel group (the other modes' updates hold
# these syncs themselves, on the tensor group's link: see coarse_program.realize).
DATA_MODES = ("none", "sync", "overlap", "overlap_zero", "sync_tp")
SYNC_MODES = ("sync", "sync_tp")


def data_mode(data: int, overlap: bool, zero: bool, tensor_syncs: bool = False) -> str:
    """The structural data-parallel mode of a configuration (``tensor_syncs``: its
    updates sync LayerNorm gradients over the tensor group, sequence parallelism)."""
    if data == 1:
        return "none"
    if not overlap:
        return "sync_tp" if tensor_syncs else "sync"
    return "overlap_zero" if zero else "overlap"


def template_size(pipeline: int, microbatches: int, virtual_stages: int, mode: str) -> tuple[int, int]:
    """``(num_ops, num_slots)`` of a template, without building it.

    Steps ``2 k v p``, messages ``2 k (n - 1)`` with ``n = p v`` chunks, then
    per mode a reduction per chunk, an update per stage and a gather (mode
    ``"sync_tp"``: a tensor sync) per stage.
    Finish slots: each chunk's last backward and each stage's last reduction
    (and its update, read by the gather) are read by a later op.
    """
    p, k, v = pipeline, microbatches, virtual_stages
    n = p * v
    overlap = mode.startswith("overlap")
    gathers = p if mode in ("overlap_zero", "sync_tp") else 0  # all-gathers, or tensor syncs
    num_ops = 2 * k * n + 2 * k * (n - 1) + (n if overlap else 0) + p + gathers
    num_slots = n + p + gathers if overlap else 1
    return num_ops, num_slots


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineTemplate:
    """The structure of a coarse pipeline program, stage-relative (``N`` ops).

    Attributes:
      pipeline, microbatches, virtual_stages, schedule, mode: the structural key.
      kind: ``[N]`` op kind (``KIND_NAMES``).
      chunk: ``[N]`` chunk of a step, send (its producer's) or reduction; -1 otherwise.
      microbatch: ``[N]`` microbatch of a step or send; -1 otherwise.
      stage: ``[N, 2]`` stage of each resource slot (a send: sender, receiver), or -1.
      stream: ``[N]`` stream the op runs on.
      dep_slot, out_slot, num_slots: finish-time slots, as in a Program.
      segment: ``[N]`` with ``segments``: the segment of a chunk's last
        backward a step op is, or the reduction of; -1 otherwise.
      segments: None, or per chunk, whether each of its last backward's
        segments ends with a weight gradient (then a reduction follows it).
    """

    pipeline: int
    microbatches: int
    virtual_stages: int
    schedule: str
    mode: str
    kind: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    stage: np.ndarray
    stream: np.ndarray
    dep_slot: np.ndarray
    out_slot: np.ndarray
    num_slots: int
    segment: np.ndarray | None = None
    segments: tuple | None = None
    updates: tuple | None = None

    @property
    def num_ops(self) -> int:
        return int(self.kind.shape[0])

    @property
    def num_chunks(self) -> int:
        return self.pipeline * self.virtual_stages

    @property
    def num_streams(self) -> int:
        return 2 if self.mode.startswith("overlap") else 1

    @functools.cached_property
    def stage_events(self) -> tuple[np.ndarray, np.ndarray]:
        """Memory events (resource slots, ``[N * 2]`` flattened) grouped by stage, each
        stage's in program order: ``(slot permutation, stage of each)``."""
        flat = self.stage.reshape(-1)
        used = np.flatnonzero(flat >= 0)
        # Stages are small ints: a stable sort of int16 keys is a radix sort.
        perm = used[np.argsort(flat[used].astype(np.int16), kind="stable")]
        return perm, flat[perm]

    @functools.cached_property
    def stage_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stages that have memory events, where each one's run starts in
        :attr:`stage_events`' order, and how long it is."""
        perm, event_stage = self.stage_events
        stages, starts = np.unique(event_stage, return_index=True)
        return stages, starts, np.diff(np.append(starts, perm.shape[0]))

    @functools.cached_property
    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Cost-table and memory-table row of every op (see :class:`~.coarse_program.ChunkTables`)."""
        n, p = self.num_chunks, self.pipeline
        kind, chunk, stage = self.kind, self.chunk, self.stage[:, 0]
        later = self.microbatch > 0
        # Each row is linear in the op's chunk, stage and "later microbatch" by
        # kind (F, B, two sends, reduce, update, gather, tensor sync): one lookup
        # per term. A tensor sync (mode "sync_tp", which gathers nothing) takes its
        # stage's gather row; it allocates nothing (in place).
        cost_row = _by_kind(
            kind,
            chunk,
            stage,
            later,
            start=(0, n, 3 * n, 3 * n, 3 * n + 1, 4 * n + 1, 4 * n + p + 1, 4 * n + p + 1),
            per_chunk=(1, 1, 0, 0, 1, 0, 0, 0),
            per_stage=(0, 0, 0, 0, 0, 1, 1, 1),
            per_later=(0, n, 0, 0, 0, 0, 0, 0),
        )
        memory_row = _by_kind(
            kind,
            chunk,
            stage,
            later,
            start=(0, n, 3 * n, 3 * n + p + 2, 3 * n + p + 1, 3 * n + 1, 3 * n + p + 1, 3 * n + p + 1),
            per_chunk=(1, 1, 0, 0, 0, 0, 0, 0),
            per_stage=(0, 0, 0, 0, 0, 1, 0, 0),
            per_later=(0, n, 0, 0, 0, 0, 0, 0),
        )
        if self.segments is not None:  # segment rows follow (see ChunkTables), then per-weight ones
            offset = np.concatenate([[0], np.cumsum([len(c) for c in self.segments])])
            total = int(offset[-1])
            seg = self.segment >= 0
            index = offset[np.maximum(chunk, 0)] + self.segment
            reduce = seg & (kind == REDUCE)
            if self.updates is not None:
                per_weight = np.concatenate([[0], np.cumsum([len(c) for c in self.updates])])
                weight = seg & ((kind == UPDATE) | (kind == GATHER))
                index = np.where(
                    weight,
                    2 * total
                    + per_weight[np.maximum(chunk, 0)]
                    + self.segment
                    + per_weight[-1] * (kind == GATHER),
                    index,
                )
                reduce = reduce & ~weight
            cost_row = np.where(seg, 4 * n + 2 * p + 1 + index + total * reduce, cost_row)
            memory_row = np.where(seg, 3 * n + p + 3 + index + total * reduce, memory_row)
        return cost_row, memory_row

    @functools.cached_property
    def link_kind(self) -> np.ndarray:
        """``[N]`` which link an op is costed on: 0 none (its own device), 1 the
        tensor-parallel group's, 2 the two devices of a send, 3 the data-parallel group's."""
        # By kind (F, B, two sends, reduce, update, gather, tensor sync); an update
        # talks to the data-parallel group only in the sync modes (it all-reduces there).
        update = 3 if self.mode in SYNC_MODES else 0
        table = np.asarray([1, 1, 2, 2, 3, update, 3, 1], np.int8)
        return table[self.kind]


def _by_kind(kind, chunk, stage, later, *, start, per_chunk, per_stage, per_later) -> np.ndarray:
    """``start[k] + per_chunk[k] * chunk + per_stage[k] * stage + per_later[k] * later``
    for each op's kind ``k`` (chunk and stage are -1 where an op has none: their
    coefficient is 0 there)."""
    kind = np.asarray(kind, np.intp)  # np.take with native indices: ~3x a small-int fancy index
    out = np.take(np.asarray(start, np.int64), kind)
    for coefficient, x in ((per_chunk, chunk), (per_stage, stage), (per_later, later)):
        term = np.take(np.asarray(coefficient, np.int64), kind)
        np.multiply(term, x, out=term, casting="unsafe")
        out += term
    return out


def pipeline_template(
    pipeline: int,
    microbatches: int,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
    mode: str = "none",
    step_costs=None,
    segments: tuple | None = None,
    updates: tuple | None = None,
) -> PipelineTemplate:
    """The structure of a coarse pipeline program.

    Args:
      pipeline, microbatches, virtual_stages: ``p``, ``k``, ``v``.
      schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
      mode: one of ``DATA_MODES`` (see :func:`data_mode`).
      step_costs: ``None`` for the fast issue order (cached per key): steps
        by their estimated start with unit forward and double backward costs,
        messages when their data is ready. Or ``[p * v, 2]`` estimated seconds
        of each chunk's forward and backward: then the order is
        :func:`~distir_jax.transforms.schedules.estimated_issue_order`'s, as
        the pipeline transform computes it from the same estimates.

      segments: with gradient overlap (``mode`` ``"overlap"``): per chunk, a
        tuple of bools, one per segment of its last backward, True where the
        segment ends with a weight gradient. Each chunk's last backward then
        becomes these segments, each gradient's reduction on stream 1 right
        after its segment, as the data-parallel transform issues them. None:
        one reduction per chunk after its last backward (an approximation).
      updates: with segments and ZeRO (``mode`` ``"overlap_zero"``): per chunk,
        for each weight in optimizer order, the segment whose reduction its
        update waits for; each stage then updates and all-gathers weight by
        weight (an update on stream 0, its all-gather on stream 1).

    Returns:
      A :class:`PipelineTemplate`.
    """
    if mode not in DATA_MODES:
        raise ValueError(f"mode must be one of {DATA_MODES}, got {mode!r}")
    segments, updates = hashable_plan(segments, updates)
    if segments is not None:
        if not mode.startswith("overlap"):
            raise ValueError(f"segments apply to the overlap modes only, got mode {mode!r}")
        if len(segments) != int(pipeline) * int(virtual_stages) or not all(segments):
            raise ValueError(f"segments needs a non-empty tuple per chunk, got {len(segments)} entries")
    if (mode == "overlap_zero" and segments is not None) != (updates is not None):
        raise ValueError("updates go with segments in mode 'overlap_zero', and only there")
    if step_costs is None and segments is None:
        return _cached_template(int(pipeline), int(microbatches), int(virtual_stages), schedule, mode)
    costs = _costs_key(step_costs)  # the data-parallel modes of one pipeline share a core
    # Cached whole: a sweep's keys that differ only in data-parallel degree share
    # a template (their step costs are the pipeline transform's, before data
    # parallelism splits the microbatches), and with it its derived tables.
    key = (int(pipeline), int(microbatches), int(virtual_stages), schedule, costs)
    return _cached_built(*key, mode, segments, updates)


def core_columns(pipeline: int, microbatches: int, virtual_stages: int, schedule: str, step_costs) -> list:
    """What every data-parallel mode's template makes of each step and message of the
    core (the order :func:`pipeline_template` issues them in, before a mode adds
    its ops), ``[E]`` each: kind, chunk, stage, receiving stage, whether it is its
    chunk's last backward, and whether its microbatch is a later one (not the
    first). A template's ops are these events one for one, then the mode's
    ops at the end; the overlap modes also cut each last backward into
    segments and add reductions after them."""
    key = (int(pipeline), int(microbatches), int(virtual_stages), schedule, _costs_key(step_costs))
    core = _cached_core(*key)
    return [core[name] for name in ("kind", "chunk", "stage", "stage2", "last_backward")] + [core["mb"] > 0]


def _costs_key(step_costs) -> tuple | None:
    """``step_costs`` as the cores' cache key (hashable), or None."""
    if step_costs is None:
        return None
    step_costs = np.asarray(step_costs, np.float64)
    return step_costs.shape, tuple(step_costs.ravel().tolist())


def hashable_plan(segments, updates) -> tuple:
    """``segments`` and ``updates`` (see :func:`pipeline_template`) as nested tuples, or None."""
    if segments is not None:
        segments = tuple(tuple(bool(x) for x in c) for c in segments)
    if updates is not None:
        updates = tuple(tuple(int(j) for j in c) for c in updates)
    return segments, updates


@functools.lru_cache(maxsize=16)
def _cached_template(p, k, v, schedule, mode):
    return _build_template(_cached_core(p, k, v, schedule, None), mode)


class _BoundedCache:
    """Recent results of ``build``, least recently used first, bounded in bytes:
    sweeps revisit a pipeline for each data-parallel degree and mode, and
    GPT-3-sized cores and templates are tens of MB each. Safe to share between
    threads (a lock guards the table, not the builds: two threads may build one
    key at once, and the first to finish is kept)."""

    def __init__(self, build, nbytes, max_bytes: int):
        self.build, self.nbytes, self.max_bytes = build, nbytes, max_bytes
        self.held, self.items = 0, collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, *key):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        return self._keep(key, self.build(*key))

    def get_many(self, keys: list[tuple], build_many) -> list:
        """The values of ``keys``; those not held are built by one call of
        ``build_many(missing keys)`` (a list of their values, in order)."""
        with self.lock:
            missing = [key for key in keys if key not in self.items]
        built = dict(zip(missing, build_many(missing) if missing else [], strict=True))
        return [self._keep(key, built[key]) if key in built else self.get(*key) for key in keys]

    def _keep(self, key: tuple, value):
        """Holds ``value`` for ``key`` unless a value is held already; returns the one held."""
        with self.lock:
            if key in self.items:
                return self.items[key]
            self.items[key] = value
            self.held += self.nbytes(value)
            while len(self.items) > 1 and self.held > self.max_bytes:
                self.held -= self.nbytes(self.items.popitem(last=False)[1])
        return value


def _new_core(p, k, v, schedule, costs) -> dict:
    step_costs = None if costs is None else np.asarray(costs[1], np.float64).reshape(costs[0])
    return _core(p, k, v, schedule, step_costs)


def _new_template(p, k, v, schedule, costs, mode, segments, updates) -> PipelineTemplate:
    return _build_template(_cached_core(p, k, v, schedule, costs), mode, segments, updates)


def _template_nbytes(template: PipelineTemplate) -> int:
    # Its derived tables (cached properties) come to about as much again.
    fields = (getattr(template, f.name) for f in dataclasses.fields(template))
    return 2 * sum(x.nbytes for x in fields if isinstance(x, np.ndarray))


def _nbytes(core: dict) -> int:
    return sum(x.nbytes for x in core.values() if isinstance(x, np.ndarray))


_cached_core = _BoundedCache(_new_core, _nbytes, 256 << 20).get
_cached_built = _BoundedCache(_new_template, _template_nbytes, 256 << 20).get


def _core(p, k, v, schedule, step_costs) -> dict:
    """Steps and messages in the pipeline transform's order
    (:func:`~distir_jax.transforms.schedules.estimated_issue_order`).
    Independent of data parallelism, so shared by its modes."""
    chunk, mb, backward = schedule_arrays(schedule, p, k, v)
    n = p * v
    if step_costs is None:  # a forward per chunk, a backward twice that
        step_costs = np.stack([np.ones(n), 2.0 * np.ones(n)], axis=1)
    step_costs = check_step_costs(step_costs, n)
    # The pipeline transform's own estimate (schedules.estimated_issue_order), bit for bit.
    start, finish = estimated_times(
        chunk, mb, backward, n, step_costs[chunk, backward.astype(np.int64)], schedule=schedule
    )
    m = chunk.shape[1]
    flat_chunk, flat_mb, flat_bwd = chunk.reshape(-1), mb.reshape(-1), backward.reshape(-1)
    device = np.repeat(np.arange(p), m)
    position = np.full((2, n, k), -1, np.int64)
    position[flat_bwd.astype(np.int64), flat_chunk, flat_mb] = np.arange(p * m)
    # Messages, in the order the pipeline transform lists them: activations by
    # boundary, then gradients from the last boundary back, microbatches inner.
    act_c, act_m = np.divmod(np.arange((n - 1) * k), k)
    grad_c = n - 1 - act_c
    producer = np.concatenate([position[0, act_c, act_m], position[1, grad_c, act_m]])
    consumer = np.concatenate([position[0, act_c + 1, act_m], position[1, grad_c - 1, act_m]])
    order = issue_order(start, finish, producer, consumer)
    num_messages = len(producer)
    msg_kind = np.repeat([SEND_ACTIVATION, SEND_GRADIENT], (n - 1) * k)
    msg_chunk = np.concatenate([act_c, grad_c])
    receiver = np.where(msg_kind == SEND_ACTIVATION, msg_chunk + 1, msg_chunk - 1) % p
    # Events in issue order (rank: twice the position, leaving room for what follows an event).
    return dict(
        p=p,
        k=k,
        v=v,
        schedule=schedule,
        rank=2 * np.arange(len(order)),
        kind=np.concatenate([np.where(flat_bwd, B, F), msg_kind])[order],
        chunk=np.concatenate([flat_chunk, msg_chunk])[order],
        mb=np.concatenate([flat_mb, act_m, act_m])[order],
        stage=np.concatenate([device, msg_chunk % p])[order],
        stage2=np.concatenate([np.full(p * m, -1), receiver])[order],
        last_backward=np.concatenate([flat_bwd & (flat_mb == k - 1), np.zeros(num_messages, bool)])[order],
    )


def _build_template(
    core: dict, mode: str, segments: tuple | None = None, updates: tuple | None = None
) -> PipelineTemplate:
    """Adds a data-parallel mode's ops to a core; orders ops, finds dependencies and slots."""
    p, k, v = core["p"], core["k"], core["v"]
    n = p * v
    core = _split_last_backwards(core, segments) if segments is not None else dict(core, segment=None)
    # Each chunk's reduction right after its last backward (with segments: each
    # gradient's right after its segment); updates (each followed by its
    # gather) last, in stage order.
    if not mode.startswith("overlap"):
        reduces = np.zeros_like(core["last_backward"])
    elif segments is None:
        reduces = core["last_backward"]
    else:
        reduces = core["ends_grad"]
    num_red = int(reduces.sum())
    last = core["rank"].max(initial=0) + 2
    num_events = len(core["rank"])
    if updates is None:  # per stage its update (then its gather, with ZeRO; after its tensor sync, "sync_tp")
        ends = {"overlap_zero": (UPDATE, GATHER), "sync_tp": (TENSOR_SYNC, UPDATE)}.get(mode, (UPDATE,))
        end_kind = np.repeat(ends, p)
        end_chunk = end_segment = end_producer = np.full(len(ends) * p, -1)
        end_stage = np.tile(np.arange(p), len(ends))
        end_stream = np.repeat([int(k == GATHER) for k in ends], p)  # gathers on stream 1
        end_rank = np.concatenate([last + 2 * np.arange(p) + e for e in range(len(ends))])
    else:  # per weight: its update (waits for its reduction), then its gather
        # The reduction event of each (chunk, segment), to wait for.
        red_index = {
            (int(c), int(j)): num_events + i
            for i, (c, j) in enumerate(zip(core["chunk"][reduces], core["segment"][reduces], strict=True))
        }
        rows = [(c % p, c, u, red_index[(c, j)]) for c in range(n) for u, j in enumerate(updates[c])]
        rows.sort(key=lambda r: (r[0], r[1], r[2]))  # stage by stage; chunks, then weights, in order
        stage_u, chunk_u, index_u, wait_u = (
            (np.asarray(x, np.int64) for x in zip(*rows)) if rows else [np.zeros(0, np.int64)] * 4
        )
        w = len(rows)
        end_kind = np.concatenate([np.full(w, UPDATE), np.full(w, GATHER)])
        end_chunk = np.concatenate([chunk_u, chunk_u])
        end_segment = np.concatenate([index_u, index_u])
        end_stage = np.concatenate([stage_u, stage_u])
        end_stream = np.concatenate([np.zeros(w, np.int64), np.ones(w, np.int64)])
        end_rank = np.concatenate([last + 2 * np.arange(w), last + 2 * np.arange(w) + 1])
        # An update waits for its reduction; a gather for its update.
        end_producer = np.concatenate([wait_u, num_events + num_red + np.arange(w)])
    num_end = len(end_kind)
    none = np.full(num_red + num_end, -1)
    kind = np.concatenate([core["kind"], np.full(num_red, REDUCE), end_kind])
    ev_chunk = np.concatenate([core["chunk"], core["chunk"][reduces], end_chunk])
    ev_mb = np.concatenate([core["mb"], none])
    ev_stage = np.concatenate([core["stage"], core["stage"][reduces], end_stage])
    ev_stage2 = np.concatenate([core["stage2"], none])
    ev_stream = np.concatenate(  # reductions and gathers on stream 1
        [np.zeros(num_events, np.int64), np.ones(num_red, np.int64), end_stream]
    )
    producer = np.concatenate([np.full(num_events, -1), np.flatnonzero(reduces), end_producer])
    ev_segment = None
    if core["segment"] is not None:
        ev_segment = np.concatenate([core["segment"], core["segment"][reduces], end_segment])
    # The core's events are in rank order: each reduction goes right after its event
    # (rank + 1), the ends after all of them (in rank order among themselves), so the
    # merged order needs no sort.
    num_ops = num_events + num_red + num_end
    order = np.empty(num_ops, np.int64)
    at = np.arange(num_events) + np.cumsum(reduces) - reduces  # each event's new position
    order[at] = np.arange(num_events)
    order[at[reduces] + 1] = num_events + np.arange(num_red)
    order[num_events + num_red :] = num_events + num_red + np.argsort(end_rank, kind="stable")
    kind, ev_chunk, ev_mb = kind[order], ev_chunk[order], ev_mb[order]
    ev_stage, ev_stage2, ev_stream = ev_stage[order], ev_stage2[order], ev_stream[order]
    ev_segment = None if ev_segment is None else ev_segment[order]
    op = np.arange(num_ops)
    position = np.empty(num_ops, np.int64)
    position[order] = op
    # A step's inputs arrive by sends that occupy its device's stream before it,
    # so (costs being equal on a send's two resources) issue order implies them;
    # only the data-parallel ops on stream 1 need explicit dependencies: a
    # reduction on the (last) backward it follows.
    deps = np.full((num_ops, 1), -1, np.int64)
    producer = producer[order]
    waits = producer >= 0  # reductions, and with per-weight updates the updates and gathers too
    deps[waits, 0] = position[producer[waits]]
    if updates is None and mode.startswith("overlap"):  # an update waits for its stage's last reduction
        red = kind == REDUCE
        last_reduce = np.full(p, -1, np.int64)
        np.maximum.at(last_reduce, ev_stage[red], op[red])
        upd = kind == UPDATE
        deps[upd, 0] = last_reduce[ev_stage[upd]]
    gat = kind == GATHER
    if gat.any() and updates is None:
        update_op = np.full(p, -1, np.int64)
        update_op[ev_stage[kind == UPDATE]] = op[kind == UPDATE]
        deps[gat, 0] = update_op[ev_stage[gat]]
    dep_slot, out_slot, num_slots = _finish_slots(deps)
    stage = np.stack([ev_stage, ev_stage2], axis=1)
    return PipelineTemplate(
        p,
        k,
        v,
        core["schedule"],
        mode,
        kind.astype(np.int8),
        ev_chunk,
        ev_mb,
        stage,
        ev_stream,
        dep_slot,
        out_slot,
        num_slots,
        ev_segment,
        segments,
        updates,
    )


def _split_last_backwards(core: dict, segments: tuple) -> dict:
    """Replaces each chunk's last backward by its segments (in place in the issue order).

    Ranks are rescaled so that segment ``j`` of a step of rank ``r`` gets
    ``r + 2 j`` and its reduction ``r + 2 j + 1``, all below the next event.
    """
    scale = 2 * max(len(c) for c in segments) + 2
    last = core["last_backward"]
    count = np.where(last, np.array([len(c) for c in segments], np.int64)[core["chunk"]], 1)
    source = np.repeat(np.arange(len(count)), count)
    # Position of each piece within its step: 0 .. count - 1.
    j = np.arange(len(source)) - np.repeat(np.cumsum(count) - count, count)
    out = {name: core[name][source] for name in ("kind", "chunk", "mb", "stage", "stage2", "last_backward")}
    out["rank"] = core["rank"][source] * (scale // 2) + 2 * j
    split = out["last_backward"]
    # ends_grad[chunk][segment], flattened: whether that segment ends with a weight gradient.
    offsets = np.cumsum([0] + [len(c) for c in segments])
    flags = np.fromiter((f for c in segments for f in c), bool, int(offsets[-1]))
    ends_grad = np.zeros(len(source), bool)
    ends_grad[split] = flags[offsets[out["chunk"][split]] + j[split]]
    return dict(core, **out, segment=np.where(split, j, -1), ends_grad=ends_grad)


def _finish_slots(deps):
    """Finish-time slots: one per op whose finish another op reads (a few per
    stage, or one per weight with per-weight updates; no reuse is needed)."""
    num_ops = deps.shape[0]
    read = np.zeros(num_ops, bool)  # op indices: a mask gives them sorted and distinct (np.unique sorts)
    read[deps[deps >= 0]] = True
    producer = np.flatnonzero(read)
    out_slot = np.full(num_ops, NO_SLOT, np.int32)
    out_slot[producer] = np.arange(len(producer))
    dep_slot = np.where(deps >= 0, out_slot[np.maximum(deps, 0)], NO_SLOT).astype(np.int32)
    return dep_slot, out_slot, max(1, len(producer))
