"""GPT-3 175B on 64 A100-80GB GPUs: the whole hybrid-parallel strategy space, end to end.

The issue's benchmark (b): GPT-3 175B training (global batch 1024, sequence
2048) on ``get_preset("dgx-a100-80gb:64")``, over every tensor x pipeline x
data factorisation of 64, every microbatch size dividing the per-replica
batch, every interleaving degree dividing ``layers / pipeline``, activation
recomputation none / attention / full, ZeRO on / off and gradient overlap on /
off (the last two only with data parallelism, where they mean something).
Every configuration is a full 1F1B (or interleaved 1F1B) timeline of a coarse
pipeline program (:mod:`distir_jax.transforms.coarse`), simulated by the
batched kernel. Its steps and messages are issued in the fast order (unit
step costs: a forward 1, a backward 2), so one template serves every
microbatch size and recompute policy; the product (``--product``) follows the
pipeline transform's flops-based order, one template per configuration. The
two agree within 2% for 1F1B and differ by up to -23%/+37% for interleaved
schedules (``benchmarks/RESULTS.md``, thirteenth session).

End to end means: enumerate the space, measure one fine transformer block per
(tensor degree, recompute policy), build one program template per structural
key, fill every configuration's tables, then simulate in batched kernel
calls. The kernel is :mod:`distir_jax.grouped_timeline`: a call holds 48
lanes of 16 configurations, each lane one template's group (its configurations
differ in op durations only), and runs them ``_OP_CHUNK`` ops at a time,
carrying the timeline from slice to slice, so one compiled kernel serves every
call. A call ends when all but its 8 longest lanes are done; those go on in
the next call (timeline and durations kept) while new groups fill the others
(:func:`_lane_calls`: 96 slices instead of 131, the longest groups no longer
hold a whole call). Each step reads and writes a group's timeline at one
index, ~10 ns per op and configuration on a CPU (the general kernel's per-row
gathers cost ~80-100). Op durations are computed per call, one column per distinct (cost
row, stages, link) of a template and only for the columns the call's templates
use (~1/6 of its table), from one flat table of every key's cost rows (the
chunks' step rows stored once per (features, layers), shared by every
pipeline depth and data-parallel mode; the rest once per key, for every
microbatch size), in NumPy: compiling them would cost more than computing
them. The kernel compiles, and its calls (durations, then slices) are
issued, in a background thread while the host finds steady templates and
fills tables; a third thread reads each call's result; XLA's CPU client runs
on one intra-op thread (``NPROC=1``, see below). Peak memory needs no
timeline: two more threads compute it per template, vectorized over its rows,
one pass over the template's memory events per (pipeline tables, microbatch
size), each row then adding its own update bytes (before that, they build the
long templates no short one replaces).

    python benchmarks/sweep_gpt3.py            # the whole space
    python benchmarks/sweep_gpt3.py --quick    # a deterministic subsample, < 40 s
    python benchmarks/sweep_gpt3.py --fit-only # timelines only where memory fits
    python benchmarks/sweep_gpt3.py --quick --check-steady  # also at full length, compared
    python benchmarks/sweep_gpt3.py --no-steady             # every pipeline at full length

The space has 10,458 configurations (1,306 structural keys): the tensor degree
must divide the 96 heads (t <= 32), interleaving needs the microbatch count to
be a multiple of p, and p = 64 (which does not divide 96 layers) gets uneven
stages and no interleaving. A program has ``~4 k v p`` ops, up to ~4e5 for
1024 microbatches of one sample, ~1.1e8 in all. Every long pipeline is
simulated as a short one (``p + 2`` microbatches for 1F1B, ``4p`` interleaved)
whose steady period stands for the rest (:mod:`distir_jax.transforms.coarse_steady`;
short templates are shared by every longer ``k``, and by a long pipeline of
their own length): ~2.2e7 ops in all. Every data-parallel mode runs one
template per pipeline, mode "overlap_zero"'s, whose extra ops take no time in
the others (``_KERNEL_MODE``): 118 templates in all. The kernel runs in
float64 here, so the period's certificate (every resource's clock moves by
the same amount) holds to ~1e-12; a row that fails it is simulated at full
length. Where the time goes
on a 2-core CPU (~1.2-1.9 s in all, by the VM's phase, see
``benchmarks/RESULTS.md``): finding the steady templates (~0.45-0.6 s, while
the kernel compiles and the peaks threads build the long templates),
measuring blocks and filling tables (~0.3-0.5 s), then the short templates'
arrays and the calls (~0.45-0.7 s, the kernel, durations and peaks
overlapped; the longest templates' lanes, carried from call to call, set the
kernel's length). Until the first call it is Python on small arrays, which
holds the GIL: more threads would not help there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import platform
import threading
import time
import types
from typing import NamedTuple

# One intra-op thread for XLA's CPU client (it reads NPROC when it starts, at the
# first computation), unless the caller set one: a timeline step moves a few
# thousand numbers, too little to split, and split over two threads a step runs no
# faster and takes twice the CPU, which the host's table building then lacks
# (benchmarks/RESULTS.md, "NPROC").
os.environ.setdefault("NPROC", "1")

import jax
import jax.numpy as jnp
import numpy as np

from distir_jax.cli import _ints
from distir_jax.cost import COST_FEATURES, compute_seconds, op_seconds, with_link_seconds
from distir_jax.grouped_timeline import (
    GroupedTimeline,
    pack_ops,
    padding_ops,
    run_grouped,
    start_grouped,
    step_times,
)
from distir_jax.hardware import Hardware
from distir_jax.ir._gc import older_objects_frozen
from distir_jax.kernel import STATUS_OK, STATUS_OUT_OF_MEMORY, hardware_rows, op_speeds, status_codes
from distir_jax.models import get_model_config
from distir_jax.presets import get_preset
from distir_jax.transforms.coarse import (
    balanced_layers,
    chunk_step_rows,
    data_mode,
    data_parallel_channels,
    layer_features,
    mode_rows,
    pipeline_template,
    prepare_chunkings,
    stage_devices,
    template_size,
)
from distir_jax.transforms.coarse_program import event_stage_peaks, exact_integers, links_by_kind
from distir_jax.transforms.coarse_steady import (
    extrapolate,
    microbatch_period,
    short_candidates,
    steady_template,
)

MODEL = "gpt3-175b"
PRESET = "dgx-a100-80gb:64"
GLOBAL_BATCH = 1024
RECOMPUTE = ("none", "attention", "full")
# Fixed table sizes, so every kernel call of a bucket has one shape.
_MAX_STAGES = 64
_MAX_CHUNKS = 96
_COST_ROWS = 4 * _MAX_CHUNKS + 2 * _MAX_STAGES + 2  # the last row stays zero (padding ops)
# Most resources one steady period uses (stream 0 of every stage, at most).
_PERIOD_RESOURCES = 2 * _MAX_STAGES
# Largest relative error the steady-state certificate's bound may allow (float64 kernel).
_STEADY_RTOL = 1e-9
# Long templates no short one replaces are built in the peaks threads, those of
# at least this many ops (mostly NumPy over their ops) in one, the others in the other.
_LARGE_TEMPLATE = 4096
# One compiled kernel serves the whole sweep: every call has these shapes. A
# call holds _GROUPS_PER_CALL groups of _ROWS_PER_GROUP configurations, each
# group one template (distir_jax.grouped_timeline); it runs their programs
# _OP_CHUNK ops at a time (carrying the timeline), so programs of any length
# share it; groups are sorted by length into calls. The longest groups (GPT-3's
# short interleaved templates on 32 stages, 96 slices) set how many slices a
# sweep runs; 48 lanes fit the others in as many, at 3/4 of 64 lanes' kernel
# work (alternating runs, NPROC=1: median 1.01 s against 1.02 s end to end, and
# 1.14 s against 1.23 s with XLA on two threads; 2026-12-05).
_OP_CHUNK = 512
_GROUPS_PER_CALL = 48
_ROWS_PER_GROUP = 16
_MAX_SLOTS = 512  # finish slots (a template has at most ~n + 2p + a period's certificate)
_DEPS_PER_OP = 1
# Resources are stage-relative (stage * 2 + stream): one device per stage is simulated.
_RESOURCES = 2 * _MAX_STAGES
# Seconds columns per template: its distinct (cost row, stages, link kind)
# combinations (at most 6 per chunk and 2 per stage), then a zero column for padding.
_SECONDS_COLUMNS = 6 * _MAX_CHUNKS + 2 * _MAX_STAGES + 1


class Config(NamedTuple):
    """One point of the space (a tuple: ~3x faster to make than a frozen dataclass,
    10k of them per sweep)."""

    tensor: int
    pipeline: int
    data: int
    microbatch_size: int
    microbatches: int
    virtual_stages: int
    recompute: str
    zero: bool
    overlap: bool

    @property
    def schedule(self) -> str:
        return "interleaved" if self.virtual_stages > 1 else "1f1b"

    @property
    def global_batch(self) -> int:
        return self.data * self.microbatch_size * self.microbatches

    @property
    def mode(self) -> str:
        return data_mode(self.data, self.overlap, self.zero)

    @property
    def structural_key(self) -> tuple:
        """What the program's structure depends on (besides device numbering)."""
        return (
            self.pipeline,
            self.microbatches,
            self.virtual_stages,
            self.schedule,
            self.zero,
            self.overlap,
            self.data > 1,
        )


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def enumerate_space(model, world: int = 64, global_batch: int = GLOBAL_BATCH) -> list[Config]:
    """Every valid configuration of benchmark (b), in a fixed order."""
    configs = []
    for t in _divisors(world):
        if model.num_heads % t or model.hidden % t or model.ffn_hidden % t:
            continue
        for p in _divisors(world // t):
            d = world // (t * p)
            if global_batch % d or p > model.num_layers:
                continue
            per_replica = global_batch // d
            for b in _divisors(per_replica):
                k = per_replica // b
                if p == 1 or model.num_layers % p:
                    interleave = [1]
                else:  # interleaved 1F1B enters microbatches in groups of p
                    interleave = [v for v in _divisors(model.num_layers // p) if v == 1 or k % p == 0]
                for v in interleave:
                    for rc in RECOMPUTE:
                        for zero in (False, True) if d > 1 else (False,):
                            for overlap in (False, True) if d > 1 else (False,):
                                configs.append(Config(t, p, d, b, k, v, rc, zero, overlap))
    return configs


def _template_arrays(template, steady=None) -> dict:
    """A template's packed ops (:func:`~distir_jax.grouped_timeline.pack_ops`) cut
    into ``[chunks, _OP_CHUNK, 5]`` slices (padded past its end), the seconds
    columns they read (``units``: cost row, stages and link kind of each;
    ``link_class``: :func:`_link_classes`), and each memory event's row and
    resource slot in the memory tables. With ``steady`` (a
    :class:`~distir_jax.transforms.coarse_steady.SteadyTemplate`), also the
    period's finish slots: each resource's clock before and after it.
    """
    if template.num_slots > _MAX_SLOTS or template.dep_slot.shape[1] != _DEPS_PER_OP:
        raise ValueError(
            f"template {template.num_slots} finish slots / {template.dep_slot.shape[1]} deps per op: "
            f"the kernel is compiled for <= {_MAX_SLOTS} / {_DEPS_PER_OP}"
        )
    cost_row, memory_row = template.rows
    if memory_row.max(initial=-1) >= 3 * template.num_chunks + template.pipeline + 3:  # ChunkTables' rows
        raise ValueError(f"template memory rows reach {memory_row.max()}, past its chunk tables'")
    stage, kind = template.stage, template.link_kind
    # An op's duration depends on its cost row and on the devices and link it
    # runs on (per configuration): one seconds column per distinct combination.
    first, column = _columns(cost_row, stage)
    if np.any(kind[first][column] != kind):
        raise ValueError("ops of one cost row and stages run on different link kinds")
    if len(first) >= _SECONDS_COLUMNS:
        raise ValueError(f"template has {len(first)} seconds columns, the kernel {_SECONDS_COLUMNS - 1}")
    resource = np.stack(
        [stage[:, 0] * 2 + template.stream, np.where(stage[:, 1] >= 0, stage[:, 1] * 2, -1)], 1
    )
    n, c = template.num_ops, _OP_CHUNK
    chunks = -(-n // c)
    ops = np.empty((chunks * c, 5), np.int32)
    ops[n:] = _padding(1)
    dep_slot, out_slot = template.dep_slot[:, 0], template.out_slot
    pack_ops(resource, dep_slot, out_slot, column, _RESOURCES, _MAX_SLOTS, out=ops[:n])
    ops = ops.reshape(chunks, c, 5)
    # Seconds columns as [cost row, stage, second stage, link kind], and each one's link class.
    units = np.column_stack([cost_row[first], stage[first], kind[first]]).astype(np.int32)
    link_class = _link_classes(units, template.pipeline)
    # Each memory event's (memory row, resource slot) as one index, -1: none.
    events = template.stage_events[0]
    row = memory_row[events // 2]
    event_slot = np.where(row >= 0, 2 * row + events % 2, -1)
    out = dict(
        ops=ops, units=units, link_class=link_class, event_slot=event_slot, template=template, steady=steady
    )
    out["period_before"] = np.full(_PERIOD_RESOURCES, -1, np.int32)
    out["period_after"] = np.full(_PERIOD_RESOURCES, -1, np.int32)
    if steady is not None:
        if len(steady.resources) > _PERIOD_RESOURCES:
            raise ValueError(f"a period uses {len(steady.resources)} resources, > {_PERIOD_RESOURCES}")
        out["period_before"][: len(steady.before)] = steady.before
        out["period_after"][: len(steady.after)] = steady.after
    return out


# An idle lane's period slots (none).
_NO_PERIOD = np.full(_PERIOD_RESOURCES, -1, np.int32)

# Per thread (templates are built in several): one int32 per (cost row, stage,
# stage), a template's first op of each.
_SCRATCH = threading.local()


def _columns(cost_row: np.ndarray, stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each op's seconds column: ``(first op of each column, column of each op)``,
    columns numbered in order of first use (one per distinct cost row and stages).

    A dense table instead of sorting (``np.unique``): it needs no reset, since
    every entry read was written for this template just before."""
    span = _MAX_STAGES + 1
    if len(cost_row) and not (
        0 <= cost_row.min() and cost_row.max() < _COST_ROWS and stage.max() < _MAX_STAGES
    ):
        raise ValueError(f"ops need cost rows in [0, {_COST_ROWS}) and stages < {_MAX_STAGES}")
    table = getattr(_SCRATCH, "table", None)
    if table is None:
        table = _SCRATCH.table = np.empty(_COST_ROWS * span * span, np.int32)
    combination = (cost_row.astype(np.intp) * span + stage[:, 0] + 1) * span + stage[:, 1] + 1
    n = len(combination)
    table[combination[::-1]] = np.arange(n - 1, -1, -1, dtype=np.int32)  # the last write wins: the first op
    first_op = table[combination]
    is_first = first_op == np.arange(n)
    return np.flatnonzero(is_first), (np.cumsum(is_first) - 1)[first_op]


# A seconds column's link, per stage of the configuration (see _link_classes).
_LINK_CLASSES = 5 * _MAX_STAGES


def _link_classes(units: np.ndarray, pipeline: int) -> np.ndarray:
    """``[U]`` the link class of each seconds column (``units``: cost row, stage,
    second stage, link kind), ``class * _MAX_STAGES + stage``: the link kind
    (0 own device, or the data-parallel group's for a mode "sync" row: the
    updates' kind, see ``_KERNEL_MODE``; 1 tensor-parallel group, 3
    data-parallel group), 2 a send to the next stage, 4 to the previous one.
    A configuration's link and its seconds per class are then one lookup
    (:func:`_link_tables`)."""
    _, stage, second, kind = units.T
    if np.any((kind < 0) | (kind > 3)):
        raise ValueError(f"link kinds must be 0-3, got {sorted(set(kind.tolist()))}")
    send = kind == 2
    ahead = second == (stage + 1) % pipeline
    if np.any(send & ~ahead & (second != (stage - 1) % pipeline)):
        raise ValueError("sends must go to the next stage or to the previous one")
    return np.where(send & ~ahead, 4, kind) * _MAX_STAGES + stage


def _link_tables(rows: _Rows, hw_rows) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds per link byte, link latency)``, ``[K * _LINK_CLASSES]`` each:
    every key's per link class (:func:`_link_classes`), as
    :func:`~distir_jax.transforms.coarse_program.links_by_kind` picks the link
    and :func:`~distir_jax.kernel.op_speeds` reads it (one hardware)."""
    device, p = rows.device, rows.stages[:, None]  # [K, S], -1 past a key's stages
    s = np.arange(_MAX_STAGES)
    ahead = np.take_along_axis(device, (s + 1) % p, axis=1)
    behind = np.take_along_axis(device, (s - 1) % p, axis=1)
    own = np.where(rows.sync[:, None, None], rows.dp_link, np.stack([device, device], -1))  # kind 0: updates
    pairs = [own, rows.tp_link, np.stack([device, ahead], -1)]
    link = np.stack(pairs + [rows.dp_link, np.stack([device, behind], -1)], axis=1)  # [K, 5, S, 2]
    d, table = hw_rows.num_devices, hw_rows.table[0]
    pair = np.maximum(link[..., 0], 0) * d + np.maximum(link[..., 1], 0) + 2 * d  # op_speeds' link rows
    # Data-parallel collectives' bytes divided by their rings side by side (Topology.ring_channels).
    channels = np.ones(link.shape[:3])
    channels[:, 3] = rows.dp_channels
    channels[:, 0] = np.where(rows.sync[:, None], rows.dp_channels, 1.0)
    return (table[pair] / channels).reshape(-1), table[pair + d * d].reshape(-1)


def _padding(count: int) -> np.ndarray:
    """``[count, 5]`` ops past a template's end (reading the zero seconds column)."""
    return padding_ops(count, _RESOURCES, _MAX_SLOTS, _SECONDS_COLUMNS - 1)


def _end_call(state: GroupedTimeline, before, after, periods):
    """Step time of every row (a steady row's long program's, from the clocks
    around its period) and whether its period is certified; ``[G * Bg]`` each
    (on the host: a few thousand rows, not worth a compiled function)."""
    finish = state.finish_slots(_RESOURCES)
    finish = np.moveaxis(finish, 1, 2).reshape(-1, finish.shape[1])
    step_time = step_times(state, _RESOURCES, xp=np).reshape(-1)
    return extrapolate(finish, before, after, periods, step_time, _STEADY_RTOL)


class _Kernel:
    """The compiled call, one shape for the whole sweep, compiled and then issued
    in a background thread (XLA releases the GIL, so the host meanwhile builds
    tables; and issuing a step whose input is still being computed waits, ~3 ms
    a step on a 2-core CPU, which the main thread then does not)."""

    def __init__(self):
        self.future = _WORKER.submit(self._compile)
        # The last call's timeline and durations (the next one may carry lanes of them).
        self.last = self.seconds = None

    @staticmethod
    def _compile():
        """``(advance, carry)``: a slice of every lane's ops, and a call's first
        timeline from the last one's (carried lanes kept, the others at zero)."""
        with jax.enable_x64(True):  # a `with` does not reach other threads
            state = jax.eval_shape(lambda: _start())
            ops = jax.ShapeDtypeStruct((_GROUPS_PER_CALL, _OP_CHUNK, 5), np.int32)
            seconds = jax.ShapeDtypeStruct((_GROUPS_PER_CALL, _SECONDS_COLUMNS, _ROWS_PER_GROUP), np.float64)
            advance = jax.jit(run_grouped, donate_argnums=0).lower(state, ops, seconds).compile()
            kept = jax.ShapeDtypeStruct((_GROUPS_PER_CALL,), bool)
            return advance, jax.jit(_carry).lower(state, kept).compile()

    def load(self, rows: _Rows, hw_rows) -> None:
        """Every key's cost tables and links (``rows``) and the hardware, for the calls' durations."""
        self.rows, self.hw_rows = rows, hw_rows
        self.packed = _WORKER.submit(_packed_tables, rows, hw_rows)  # before any call's durations

    def __call__(
        self, columns: _Columns, slices, before, after, periods, carried
    ) -> concurrent.futures.Future:
        """Issues one call in the background (after the earlier ones): its op durations
        from ``columns``, then its lanes' slices of ops (``slices`` yields
        them), from the last call's timeline in the lanes ``carried`` (``[G]``
        bools) and from zero in the others. The future's result is the call's
        ``(step times, certified)`` on the host.

        A third thread waits for the call's last steps and reads its timeline,
        so the kernel's thread goes on to the next call's durations (dispatch is
        asynchronous; alternating runs: ~1.80 s -> ~1.72 s mean wall)."""
        issued = _WORKER.submit(self._issue, columns, slices, carried)
        return _COLLECTOR.submit(self._collect, issued, before, after, periods)

    def _issue(self, columns: _Columns, slices, carried):
        advance, carry = self.future.result()
        # Carried lanes keep their durations; the others' are filled below (their
        # ops read no column but their own and the zero one, which stays zero).
        seconds = np.zeros((_GROUPS_PER_CALL, _SECONDS_COLUMNS, _ROWS_PER_GROUP))
        if carried.any():
            seconds[carried] = self.seconds[carried]
        self.seconds = seconds
        packed = self.packed.result()
        seconds[columns.unit_group, columns.unit_column] = (
            _general_seconds(self.rows, columns, self.hw_rows)
            if packed is None
            else _packed_seconds(*packed, columns)
        )
        with jax.enable_x64(True):  # a `with` does not reach other threads
            seconds = jax.device_put(seconds)
            # Not donated: the collecting thread reads the last timeline too.
            state = carry(self.last, carried) if carried.any() else jax.device_put(_start())
            for ops in slices:
                state = advance(state, jax.device_put(ops), seconds)
            self.last = state
            return state

    @staticmethod
    def _collect(issued: concurrent.futures.Future, before, after, periods):
        return _end_call(jax.device_get(issued.result()), before, after, periods)


def _carry(state: GroupedTimeline, kept: jax.Array) -> GroupedTimeline:
    """``state`` in the lanes ``kept``, zero in the others."""
    return GroupedTimeline(jnp.where(kept[:, None, None], state.times, 0.0))


def _start() -> GroupedTimeline:
    """A call's timeline at zero, on the host."""
    return start_grouped(_GROUPS_PER_CALL, _RESOURCES, _MAX_SLOTS, _ROWS_PER_GROUP, np.float64, xp=np)


_WORKER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sweep-gpt3-kernel")
_COLLECTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sweep-gpt3-collect")


def _subsample(configs: list, every: int) -> list:
    """Every ``every``-th configuration, in order: all degrees, sizes and options stay represented."""
    return configs[::every]


class _Rows:
    """Each configuration's small tables, from :func:`~distir_jax.transforms.coarse.mode_rows`
    per (tensor, recompute, pipeline, interleaving, data) and its modes, kept flat so
    a kernel call gathers all its rows at once, and each number stored once: a
    pipeline's memory rows serve all its modes, cost rows that do not depend
    on the microbatch size are stored once for all sizes."""

    def __init__(self, model, topology, configs):
        sizes: dict[int, set] = {}
        for c in configs:
            sizes.setdefault(c.tensor, set()).add(c.microbatch_size)
        self.sizes = {t: sorted(s) for t, s in sizes.items()}
        keys: dict[tuple, int] = {}
        key = [
            keys.setdefault(
                (c.tensor, c.recompute, c.pipeline, c.virtual_stages, c.data, c.zero, c.mode), len(keys)
            )
            for c in configs
        ]
        self.key = np.asarray(key)
        # A key's tables hold its tensor degree's sizes (the variant: a configuration's among them).
        self.variant = np.asarray([self.sizes[c.tensor].index(c.microbatch_size) for c in configs])
        data_bytes = [None] * len(keys)
        self.device = np.full((len(keys), _MAX_STAGES), -1, np.int32)  # each key's stage devices and links
        self.tp_link = np.zeros((len(keys), _MAX_STAGES, 2), np.int32)
        self.dp_link = np.zeros((len(keys), _MAX_STAGES, 2), np.int32)
        # What each stage's data-parallel collectives' bytes are divided by (Topology.ring_channels).
        self.dp_channels = np.ones((len(keys), _MAX_STAGES))
        self.last = np.zeros(len(keys), np.intp)  # the last chunk's stage (it holds the labels)
        # Cost rows of the chunks' steps (ChunkTables: forward, first and later backwards,
        # a message: the first 3n + 1) depend on the features and the chunks' layers only:
        # one copy serves every pipeline depth and data-parallel mode. The rest (the
        # reductions, updates and gathers) are per key, one copy for every size.
        steps, steps_of, other = [], {}, [None] * len(keys)
        self.steps, self.split = np.zeros(len(keys), np.intp), np.zeros(len(keys), np.intp)
        # Memory rows per pipeline (all its modes); a key adds bytes to its update rows.
        memory = []
        self.pipeline_of = np.zeros(len(keys), np.intp)
        self.update_extra = np.zeros((len(keys), _MAX_STAGES))
        self.update_row = np.zeros(len(keys), np.intp)  # the first (ModeRows.update_rows)
        self.stages = np.zeros(len(keys), np.intp)
        # Mode "sync" keys run mode "overlap_zero"'s template (_KERNEL_MODE): no
        # reductions or gathers of their own, their update on the data-parallel link.
        self.sync = np.zeros(len(keys), bool)
        resident = [None] * len(keys)
        variants: dict[tuple, list] = {}
        for (t, rc, p, v, d, zero, mode), i in keys.items():
            variants.setdefault((t, rc, p, v, d), []).append((i, zero, mode))
        measured: dict[tuple, object] = {}  # (tensor, recompute): its features, one lookup each
        chunks: dict[tuple, set] = {}  # and the chunk counts of its pipelines
        for t, rc, p, v, _ in variants:
            if (t, rc) not in measured:
                measured[t, rc] = layer_features(model, t, rc, self.sizes[t], topology)
            chunks.setdefault((t, rc), set()).add(p * v)
        for tr, counts in chunks.items():  # every pipeline's chunk tables at once, per features
            prepare_chunkings(measured[tr], [balanced_layers(measured[tr], n) for n in sorted(counts)])
        for (t, rc, p, v, d), members in variants.items():
            features = measured[t, rc]
            layers = balanced_layers(features, p * v)
            made = mode_rows(features, layers, p, 0, [(d, zero, mode) for _, zero, mode in members])
            step = steps_of.setdefault((t, rc, made.layers), len(steps))
            if step == len(steps):
                steps.append(chunk_step_rows(features, layers))
            device, tp_link, dp_link = stage_devices(topology, p, t, d)
            ids = np.asarray([i for i, _, _ in members])
            self.pipeline_of[ids] = len(memory)
            memory.append((made.alloc, made.free))
            self.update_extra[ids, :p] = made.update_extra
            self.update_row[ids], self.stages[ids] = made.update_rows.start, p
            n = p * v
            for j, (i, _, mode) in enumerate(members):
                other[i], resident[i], data_bytes[i] = made.other[j], made.resident[j], features.data_bytes
                if mode == "sync":  # its template's reductions and gathers cost nothing
                    other[i] = other[i].copy()
                    other[i][:n] = other[i][n + p :] = 0.0
                    self.sync[i] = True
            self.split[ids], self.steps[ids] = 3 * p * v + 1, step
            self.device[ids, :p], self.tp_link[ids, :p], self.dp_link[ids, :p] = device, tp_link, dp_link
            self.dp_channels[ids, :p] = data_parallel_channels(topology, p, t, d)
            self.last[ids] = (p * v - 1) % p
        # Tokens (and labels) of every microbatch of each configuration.
        self.data = np.asarray([c.microbatches for c in configs]) * np.asarray(
            [data_bytes[k][v] for k, v in zip(key, self.variant, strict=True)]
        )
        # Flat tables: a step table's variant ``x`` starts at ``steps_start + x * split``,
        # a key's other rows at ``other_start`` (every variant), a pipeline's memory rows
        # for variant ``x`` at ``memory_start + x * memory_rows``, a key's resident
        # bytes at ``resident_start + x``.
        self.cost, start = _flat([x.reshape(-1, x.shape[-1]) for x in steps + other])
        self.steps_start, self.other_start = start[: len(steps)], start[len(steps) :]
        self.alloc, self.memory_start = _flat([a.reshape(-1, 2) for a, _ in memory])
        self.free = _flat([f.reshape(-1, 2) for _, f in memory])[0]
        # Whole byte counts as int64: the peaks' running sums of them are ~8x faster.
        self.alloc, self.free = exact_integers(self.alloc, self.free)
        self.memory_rows = np.asarray([a.shape[1] for a, _ in memory])
        self.resident_bytes, self.resident_start = _flat([_widen(x, _MAX_STAGES) for x in resident])
        if np.any(self.update_extra < 0):  # _stage_peaks adds them to tops computed without them
            raise ValueError("an update's transient bytes are negative")

    def resident(self, ids: np.ndarray) -> np.ndarray:
        """``[len(ids), _MAX_STAGES]`` configurations ``ids``' resident bytes per stage."""
        k, v = self.key[ids], self.variant[ids]
        resident = self.resident_bytes[self.resident_start[k] + v]
        row = np.arange(len(ids))
        resident[row, 0] += self.data[ids]
        resident[row, self.last[k]] += self.data[ids]
        return resident

    def event_bytes(self, ids: np.ndarray, event_slot: np.ndarray):
        """``(net, free)``, ``[len(ids), E]`` each: configurations ``ids``' bytes
        allocated minus freed, and freed, at each memory event of one template
        (``event_slot``: its memory row and resource slot, ``2 * row + slot``; -1: none),
        without their keys' own update bytes (:meth:`update_events`).

        Each configuration's table is gathered first (a few hundred numbers), then
        the events from it: the large gathers read a small block that stays in cache."""
        k, v = self.key[ids], self.variant[ids]
        g = self.pipeline_of[k]
        width = 2 * int(self.memory_rows[g[0]])  # one template: tables of one size
        first = 2 * (self.memory_start[g] + v * self.memory_rows[g])  # each table's first byte count
        index = first[:, None] + np.arange(width)
        # A last column of zeros: slot -1 reads it.
        alloc = self.alloc.reshape(-1)[index]
        free = np.zeros((len(ids), width + 1), self.free.dtype)
        free[:, :width] = self.free.reshape(-1)[index]
        net = np.zeros_like(free)
        np.subtract(alloc, free[:, :width], out=net[:, :width])
        # np.take returns C-ordered rows (fancy indexing on axis 1 would not: cumsum is 3x slower there).
        return np.take(net, event_slot, axis=1), np.take(free, event_slot, axis=1)

    def update_events(self, ids: np.ndarray, event_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(events [U], bytes [len(ids), U])``: the memory events of one template
        (``event_slot`` as :meth:`event_bytes`) on its update rows' slot 0, and
        the bytes configurations ``ids``' keys add to both their allocation and
        their release there (``mode_rows``' ``update_extra``: the reduction's
        transient, which differs by data-parallel mode)."""
        k = self.key[ids]
        p, row = int(self.stages[k[0]]), 2 * int(self.update_row[k[0]])
        offset = event_slot - row
        events = np.flatnonzero((offset >= 0) & (offset < 2 * p) & (offset % 2 == 0))
        return events, self.update_extra[k][:, offset[events] // 2]

    def bytes_key(self, ids: np.ndarray, periods: np.ndarray) -> np.ndarray:
        """``[len(ids)]`` int64, equal for configurations whose memory events carry
        the same bytes (:meth:`event_bytes`: one pipeline's tables, one size) and
        that run as many extra periods ``periods``."""
        k = self.key[ids]
        digits = (self.pipeline_of[k], self.variant[ids], np.asarray(periods, np.int64))
        key = np.zeros(len(ids), np.int64)
        for digit in digits:
            key = key * (int(digit.max(initial=0)) + 1) + digit
        return key

    def cost_base(self, ids: np.ndarray) -> np.ndarray:
        """``[len(ids), 3]`` int32: where configuration ``ids[i]``'s step rows start in
        ``self.cost``, where its other rows would start (they are there from its
        row ``split``, the same for every size), and ``split``."""
        k, v = self.key[ids], self.variant[ids]
        steps = self.steps_start[self.steps[k]] + v * self.split[k]
        other = self.other_start[k] - self.split[k]
        return np.stack([steps, other, self.split[k]], axis=1).astype(np.int32)


def _flat(tables: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``[M, ...]`` tables as one ``[sum M, ...]`` array, and where each one starts."""
    start = np.cumsum([0] + [len(t) for t in tables])[:-1]
    return np.concatenate(tables), start


def _widen(table: np.ndarray, width: int) -> np.ndarray:
    """``[S, p]`` as ``[S, width]``, zeros past ``p``."""
    out = np.zeros((table.shape[0], width))
    out[:, : table.shape[1]] = table
    return out


class _Columns(NamedTuple):
    """What a call's op durations are computed from: its groups' seconds columns
    (``U`` in all, each group's one after the other) and its ``G * Bg`` rows.

    Attributes:
      base: ``[G * Bg, 3]`` where each row's step rows and other rows start in
        the flat cost table, and its first other row (``_Rows.cost_base``).
      key: ``[G * Bg]`` each row's key (``_Rows.key``): its stage devices and links.
      units: ``[U, 4]`` the columns: cost row, stage, second stage and link kind.
      link_class: ``[U]`` each column's link class (:func:`_link_classes`).
      unit_group, unit_column: ``[U]`` each column's group, and its index there.
    """

    base: np.ndarray
    key: np.ndarray
    units: np.ndarray
    link_class: np.ndarray
    unit_group: np.ndarray
    unit_column: np.ndarray


def _general_seconds(rows: _Rows, c: _Columns, hw_rows) -> np.ndarray:
    """``[U, Bg]`` seconds of a call's seconds columns ``c``, for each of their
    groups' rows, by :func:`~distir_jax.cost.op_seconds` (NumPy, in the kernel's
    thread: a compiled function would cost more to compile than this costs to
    run). ``rows``: every key's cost rows and stage devices and links;
    ``hw_rows``: the hardware's :class:`~distir_jax.kernel.HardwareRows` (one hardware)."""
    b = _ROWS_PER_GROUP
    cost_row, stage, second, kind = (c.units[:, i, None] for i in range(4))  # [U, 1] each
    row = c.unit_group[:, None] * b + np.arange(b)  # [U, Bg]
    steps, other, split = (c.base[row, i] for i in range(3))
    index = np.where(cost_row < split, steps, other) + cost_row
    key = c.key[row]
    sender = rows.device[key, stage]
    send = np.stack([sender, np.where(second >= 0, rows.device[key, second], -1)], -1)
    kind = np.where((kind == 0) & rows.sync[key], 3, kind)  # a mode "sync" row's updates (_KERNEL_MODE)
    link = links_by_kind(kind, send, rows.tp_link[key, stage], rows.dp_link[key, stage], xp=np)
    features = rows.cost[index]  # [U, Bg, F]
    # Data-parallel collectives' bytes divided by their rings side by side (Topology.ring_channels).
    channels = np.where(kind == 3, rows.dp_channels[key, stage], 1.0)
    features[..., COST_FEATURES.index("comm_volume")] /= channels
    speeds = list(op_speeds(types.SimpleNamespace(slot_device=send, link=link), hw_rows, np))
    speeds[2] = speeds[2].reshape(())  # one hardware: one launch overhead
    return op_seconds(np, {name: features[..., i] for i, name in enumerate(COST_FEATURES)}, *speeds)


def _packed_seconds(compute, hops, volume, link_bytes, link_latency, c: _Columns) -> np.ndarray:
    """:func:`_general_seconds` from :func:`_packed_tables` (every device computes
    at one speed): the same floats, from a row's compute part and its key's link
    per class, 5 contiguous lookups per duration instead of ~15."""
    g, b = _GROUPS_PER_CALL, _ROWS_PER_GROUP
    base = c.base.reshape(g, b, 3)
    split = base[:, 0, 2]  # a group's rows share a template: its chunks' step rows
    if np.any(base[:, :, 2] != split[:, None]):
        raise ValueError("rows of one group have different numbers of step rows")
    cost_row = c.units[:, 0]
    # A column's rows start at their step rows or at their other rows: one row of [2G, Bg].
    starts = base[:, :, :2].transpose(0, 2, 1).reshape(2 * g, b)
    index = starts[2 * c.unit_group + (cost_row >= split[c.unit_group])] + cost_row[:, None]  # [U, Bg]
    link = (c.key.reshape(g, b) * _LINK_CLASSES)[c.unit_group] + c.link_class[:, None]
    # np.take of 1-D tables: half the time of gathering [U, Bg, 3] rows and splitting them.
    own = (np.take(x, index) for x in (compute, hops, volume))
    return with_link_seconds(*own, np.take(link_bytes, link), np.take(link_latency, link))


def _packed_tables(rows: _Rows, hw_rows) -> tuple | None:
    """``(compute, hops, volume, link bytes, link latency)``, when every device
    computes at one speed (else None): ``[T]`` each: each cost row's compute
    seconds (:func:`~distir_jax.cost.compute_seconds`), link hops and link
    bytes, and :func:`_link_tables`. A duration then reads three numbers and
    two of its key's, instead of seven and its devices' speeds."""
    d, table = hw_rows.num_devices, hw_rows.table[0]
    per_flop, per_byte = table[:d], table[d : 2 * d]
    if np.any(per_flop != per_flop[0]) or np.any(per_byte != per_byte[0]):
        return None
    f = {name: rows.cost[:, i] for i, name in enumerate(COST_FEATURES)}
    compute = compute_seconds(np, f, per_flop[0], per_byte[0], np.reshape(hw_rows.launch, ()))
    columns = (np.ascontiguousarray(x, np.float64) for x in (compute, f["comm_hops"], f["comm_volume"]))
    return (*columns, *_link_tables(rows, hw_rows))


def _slices(ops: list, pad: np.ndarray, length: int):
    """Yields a call's ``length`` ``[G, _OP_CHUNK, 5]`` slices of ops from its lanes'
    ``[chunks, _OP_CHUNK, 5]`` ops (``pad`` past a lane's end, and for idle lanes:
    None); it runs in the kernel's thread."""
    for j in range(length):
        yield np.stack([x[j] if x is not None and j < len(x) else pad for x in ops])


def _groups(ids, template_of, size_of) -> list[tuple]:
    """``(template, configuration ids)`` groups: a template's configurations in
    groups of at most ``_ROWS_PER_GROUP``, longest programs first, so the
    groups a call takes together have similar lengths (little padded work)."""
    members: dict = {}
    for i in sorted(ids):
        members.setdefault(template_of[i], []).append(i)
    groups = [
        (key, np.asarray(m[j : j + _ROWS_PER_GROUP]))
        for key, m in members.items()
        for j in range(0, len(m), _ROWS_PER_GROUP)
    ]
    groups.sort(key=lambda group: -size_of[group[1][0]])  # stable: a template's groups stay together
    return groups


class _Lane(NamedTuple):
    """The group a lane runs in a call (``(template, configuration ids)``, as
    :func:`_groups` makes them) and the chunk of its ops it starts from."""

    group: tuple
    first: int

    @property
    def key(self) -> tuple:
        return self.group[0]

    @property
    def members(self) -> np.ndarray:
        return self.group[1]


class _Call(NamedTuple):
    """One kernel call: ``lanes[j]`` is the :class:`_Lane` lane ``j`` runs (None:
    idle), for ``length`` slices; a lane whose group goes on past them carries
    its timeline into the next call (same lane)."""

    lanes: list
    length: int


def _lane_calls(groups: list[tuple], size_of, carry: int) -> list[_Call]:
    """Kernel calls of :func:`_groups`' groups (longest first): a call's free
    lanes take the next groups, and it runs until all but its ``carry`` longest
    lanes are done; those go on in the next call while the others take new
    groups (``carry=0``: each call runs its groups to their ends). Without
    carrying, the longest programs (~49k ops: GPT-3's short interleaved
    templates on 32 stages, three groups) keep a whole call going after its
    other lanes are done: 131 slices in all at 64 lanes, 96 with it."""
    chunks = [-(-size_of[members[0]] // _OP_CHUNK) for _, members in groups]
    lanes, upcoming, out = [None] * _GROUPS_PER_CALL, 0, []
    while True:
        for j in range(len(lanes)):
            if lanes[j] is None and upcoming < len(groups):
                lanes[j], upcoming = (upcoming, 0), upcoming + 1
        left = sorted((chunks[g] - first for g, first in filter(None, lanes)), reverse=True)
        if not left:
            return out
        # Carrying saves the slices only while new groups can fill the lanes that are done.
        length = left[min(carry, len(left) - 1)] if upcoming < len(groups) else left[0]
        out.append(_Call([None if x is None else _Lane(groups[x[0]], x[1]) for x in lanes], length))
        lanes = [None if x is None or chunks[x[0]] - x[1] <= length else (x[0], x[1] + length) for x in lanes]


# Lanes a call may carry into the next (see _lane_calls).
_CARRIED_LANES = 8


def _stage_peaks(arrays: list[dict], groups: list, rows: _Rows, ids: np.ndarray, periods) -> np.ndarray:
    """``[len(groups) * Bg, _MAX_STAGES]`` each configuration's peak bytes per stage
    (``ids``: the groups' rows, ``Bg`` per group): the product's rule, per template
    (consecutive groups of one template together), from event bytes gathered
    straight from the flat tables (spare rows stay zero).

    Configurations whose events carry the same bytes but on their update rows
    (:meth:`_Rows.bytes_key`: one pipeline's tables, one size; ~1/30 of the
    rows) share one pass over the events; each then raises its update events'
    tops by its own update bytes (:meth:`_Rows.update_events`, at most one per
    stage, added to an event's allocation and release alike: its level does not
    move). ``resident + max(rise, 0)``: the same floats as the product's
    ``max(resident, resident + rise)`` (byte counts are integers here: the sums
    are exact in any order)."""
    b = _ROWS_PER_GROUP
    stage_peak = np.zeros((len(ids), _MAX_STAGES))
    runs = [i for i in range(len(arrays)) if i == 0 or arrays[i] is not arrays[i - 1]] + [len(arrays)]
    for lo, hi in zip(runs[:-1], runs[1:], strict=True):
        a = arrays[lo]
        template = a["template"]
        at = np.concatenate([i * b + np.arange(len(groups[i][1])) for i in range(lo, hi)])
        members = ids[at]
        _, first, inverse = np.unique(
            rows.bytes_key(members, periods[members]), return_index=True, return_inverse=True
        )
        inverse = inverse.reshape(-1)
        distinct = members[first]
        net, free = rows.event_bytes(distinct, a["event_slot"])
        events, extra = rows.update_events(members, a["event_slot"])
        stages, starts, _ = template.stage_runs
        stage = stages[np.searchsorted(starts, events, side="right") - 1]
        if len(np.unique(stage)) != len(stage):
            raise ValueError(
                f"a stage of template {template.pipeline} x {template.microbatches} has two updates"
            )
        none = np.zeros((len(distinct), _MAX_STAGES))
        rise, tops = event_stage_peaks(
            template, net, free, none, a["steady"], extra_periods=periods[distinct], events=events
        )
        rise = rise[inverse]
        rise[:, stage] = np.maximum(rise[:, stage], tops[inverse] + extra)
        stage_peak[at] = rows.resident(members) + rise
    return stage_peak


class _Peaks:
    """A call's stage peaks, computed in parts in the peaks threads (numpy releases
    the GIL over their long arrays, so they run while the host builds the next
    templates, and after the host is done, on both cores)."""

    def __init__(self, arrays: list[dict], groups: list, rows: _Rows, ids: np.ndarray, periods):
        b = _ROWS_PER_GROUP
        # Parts of about equal work (ops times configurations), groups in order.
        work = np.cumsum([a["template"].num_ops * len(m) for a, (_, m) in zip(arrays, groups, strict=True)])
        cuts = np.searchsorted(work, work[-1] * np.arange(1, _PEAK_PARTS) / _PEAK_PARTS, side="right")
        bounds = np.unique(np.concatenate([[0], cuts, [len(groups)]]))
        self.parts = [
            _PEAKS.submit(_stage_peaks, arrays[lo:hi], groups[lo:hi], rows, ids[lo * b : hi * b], periods)
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        ]

    @functools.cached_property
    def result(self) -> np.ndarray:
        """``[len(groups) * Bg, _MAX_STAGES]``, as :func:`_stage_peaks` (waits for them)."""
        return np.concatenate([part.result() for part in self.parts])


def _stage_peak_rows(groups: list[tuple[_Peaks, np.ndarray]]) -> np.ndarray:
    """The stage peaks of groups' rows, from ``(peaks, the group's rows in them)`` each."""
    return np.concatenate([peaks.result[at] for peaks, at in groups])


_PEAK_PARTS = 4
_PEAKS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sweep-gpt3-peaks")


def _run(calls: list[_Call], rows: _Rows, kernel: _Kernel | None, short: dict, periods, templates: dict):
    """Builds templates on first use, fills every call and issues it; returns
    ``[(ids, stage peaks, devices, rows, result)]`` per call for the groups that
    finish in it (``rows``: where ``ids`` are among the call's rows, which the
    future ``result`` has all of; ``stage peaks``: :func:`_stage_peak_rows`
    reads ``ids``' from it; no result without a ``kernel``: peaks only).

    Calls run asynchronously, so building the next templates, slices and peaks
    on the host overlaps the kernel running the previous ones. ``short`` maps
    the keys of steady templates to their SteadyTemplate; ``periods`` gives
    each configuration's extra periods (0 for a long template); ``templates``
    holds the arrays built so far, by kernel key (it gains the new ones).
    """
    pad = _padding(_OP_CHUNK)
    g, b = _GROUPS_PER_CALL, _ROWS_PER_GROUP
    issued, started = [], {}
    for lanes, length in calls:
        for key in dict.fromkeys(lane.key for lane in filter(None, lanes)):
            if key not in templates:
                template = short[key].template if key in short else pipeline_template(*key[:5])
                templates[key] = _template_arrays(template, short.get(key))
        active = [j for j in range(g) if lanes[j] is not None]
        # Rows lane by lane; a lane's spare rows, and idle lanes, repeat a configuration.
        ids = np.full((g, b), lanes[active[0]].members[0])
        for j in active:
            members = lanes[j].members
            ids[j] = members[0]
            ids[j, : len(members)] = members
        ids = ids.reshape(-1)
        arrays = [None if lane is None else templates[lane.key] for lane in lanes]
        done = [j for j in active if lanes[j].first + length >= len(arrays[j]["ops"])]
        # Results leave out the spare rows (they repeat a configuration) and the carried lanes.
        real = np.concatenate([j * b + np.arange(len(lanes[j].members)) for j in done])
        device = rows.device[rows.key[ids[real]]]  # each row's stage devices (their memory capacity)
        # Peak memory needs no timeline: the peaks threads compute it, for the groups that
        # start here (a carried one's long before its last call).
        new = [j for j in active if lanes[j].first == 0]
        if new:
            new_ids = ids.reshape(g, b)[new].reshape(-1)
            peaks = _Peaks([arrays[j] for j in new], [lanes[j].group for j in new], rows, new_ids, periods)
            for i, j in enumerate(new):  # a group by its first configuration
                started[int(lanes[j].members[0])] = peaks, i * b + np.arange(len(lanes[j].members))
        stage_peak = [started.pop(int(lanes[j].members[0])) for j in done]  # (peaks, its rows) per group
        if kernel is None:
            issued.append((ids[real], stage_peak, device, None, None))
            continue
        # The seconds columns of each lane that starts a group, one after the other
        # (idle lanes' stay zero, carried ones keep theirs).
        units = [arrays[j]["units"] for j in new]
        columns = _Columns(
            rows.cost_base(ids),
            rows.key[ids],
            np.concatenate(units) if new else np.zeros((0, 4), np.int32),
            np.concatenate([arrays[j]["link_class"] for j in new]) if new else np.zeros(0, np.int32),
            np.repeat(np.asarray(new, np.intp), [len(u) for u in units]),
            np.concatenate([np.arange(len(u)) for u in units]) if new else np.zeros(0, np.intp),
        )
        ops = [None if lane is None else arrays[j]["ops"][lane.first :] for j, lane in enumerate(lanes)]
        slices = _slices(ops, pad, length)
        before, after = (
            np.repeat(np.stack([_NO_PERIOD if a is None else a[name] for a in arrays]), b, axis=0)
            for name in ("period_before", "period_after")
        )
        carried = np.asarray([lane is not None and lane.first > 0 for lane in lanes])
        result = kernel(columns, slices, before, after, periods[ids], carried)
        issued.append((ids[real], stage_peak, device, real, result))
    return issued


def gpt3_configs_per_second(
    quick: bool,
    *,
    fit_only: bool = False,
    steady: bool = True,
    verbose: bool = True,
    global_batches: tuple[int, ...] = (GLOBAL_BATCH,),
) -> dict:
    """Simulates benchmark (b)'s space end to end and measures configurations per second.

    Args:
      quick: simulate every 8th configuration only (well under 40 s).
      fit_only: compute every configuration's peak memory first and simulate
        the timelines of those that fit only (out-of-memory ones are decided
        by memory alone). The default simulates every configuration's timeline.
      steady: simulate a long 1F1B / interleaved pipeline as a short one whose
        steady period stands for the rest (:mod:`~distir_jax.transforms.coarse_steady`;
        rows whose short run does not certify the period are simulated long).
      verbose: print the size of the space and of the sample once enumerated.
      global_batches: the space of each of these global batch sizes, one
        after the other, in one sweep (benchmark (b): 1024 only). A larger
        space shows the rate once the fixed work (compiling, measuring fine
        blocks, finding steady templates) is shared by more configurations.

    Returns:
      A dict: ``configs`` evaluated, ``space_configs`` in the whole space,
      ``structural_keys`` and ``templates`` among them, ``ops`` (sum of their
      program sizes as simulated), ``simulated`` timelines, ``steady`` (of
      them from a short template), ``uncertified`` (short runs redone long),
      ``fit`` (within memory), ``seconds`` end to end, ``configs_per_second``,
      ``calls`` (kernel calls), ``best`` (the fitting configuration of
      most samples per second, its step time and peak memory), ``phases`` (seconds per
      phase), and per configuration ``step_time``, ``peak`` and ``status``.
    """
    # float64: the steady certificate compares clock shifts to ~1e-9 relative.
    with jax.enable_x64(True):
        return _gpt3(quick, fit_only, steady, verbose, tuple(global_batches))


def _short_candidates(schedule: str, p: int) -> tuple[int, ...]:
    """Interleaved pipelines try ``4p`` short microbatches before the library's
    default ``5p`` (every row of this space certifies at ``4p`` at the time of
    writing; a row that does not is simulated long)."""
    candidates = short_candidates(schedule, p)
    return (4 * p,) + candidates if schedule == "interleaved" else candidates


def _steady(key: tuple):
    """The steady template of a long template's key, or None."""
    p, _, _, schedule, _ = key
    return steady_template(*key, short_microbatches=_short_candidates(schedule, p))


def _never_steady(key: tuple) -> bool:
    """Whether :func:`_steady` returns None for ``key`` whatever the periods found:
    no short candidate fits ``k`` (1F1B and interleaved only, ``p >= 2``)."""
    p, k, _, schedule, _ = key
    if schedule not in ("1f1b", "interleaved") or p < 2:
        return True
    step = microbatch_period(schedule, p)
    return not any(c + step <= k and (k - c) % step == 0 for c in _short_candidates(schedule, p))


# Every configuration's kernel template is its pipeline's in mode "overlap_zero",
# whatever its data-parallel mode: the extra ops take no time in the others.
#
# That template is the core's steps and sends, a reduction (stream 1) after each
# chunk's last backward, then per stage an update (stream 0, waiting for the
# stage's last reduction) and a gather (stream 1, waiting for the update). The
# other modes' templates have the same ops on stream 0 in the same order, and:
#
# - mode "overlap" (ZeRO off): the same ops; its gathers' cost rows are zero.
# - mode "sync": no reductions or gathers (its update all-reduces). Its rows give
#   them zero cost (_Rows). A zero-time reduction ends at its chunk's last
#   backward's finish, which the update's stream 0 has passed already; a
#   zero-time gather ends at its update's finish; neither is read by another op,
#   so every clock on stream 0 and every finish is the same, and stream 1 never
#   passes stream 0 (the step time is the latest clock). Its update talks to the
#   data-parallel group, where mode "overlap_zero"'s update is costed on its own
#   device: link kind 0 is the updates' only, and for a mode "sync" row it means
#   the data-parallel group's link (_link_tables, _general_seconds).
# - mode "none" (no data parallelism): mode "sync"'s without communication
#   (reductions and gathers of one replica cost nothing, and the update's link
#   carries no bytes).
#
# Reductions and gathers allocate nothing (their memory row is zero in every
# mode) and are never a stage's first memory event nor inside a steady period
# (they wait for a finish slot), so peaks are the same too. One template per
# pipeline (instead of one per mode) halves the templates to build and fills
# the groups.
_KERNEL_MODE = "overlap_zero"


def _unreplaced(long_of: list[tuple], steady: bool) -> list[tuple]:
    """The long templates among ``long_of`` that no short one can replace,
    largest first (built before the steady templates are known).

    Besides pipelines no short template fits (:func:`_never_steady`), a long
    pipeline as short as some sibling's short template (same p, v, schedule,
    mode) may run that template (see :func:`_kernel_templates`): which short
    templates there are is known once they are built, so such keys wait."""
    long_of = set(long_of)
    siblings = {key[:1] + key[2:] for key in long_of if steady and not _never_steady(key)}
    keys = {
        key
        for key in long_of
        if (not steady or _never_steady(key))
        and not (key[:1] + key[2:] in siblings and key[1] in _short_candidates(key[3], key[0]))
    }
    return sorted(keys, key=lambda key: -template_size(*key[:3], key[4])[0])


def _long_templates(keys: list[tuple]) -> dict:
    """The kernel arrays of long templates ``keys`` (no steady template), by kernel key."""
    return {key + (False,): _template_arrays(pipeline_template(*key)) for key in keys}


def _kernel_templates(long_of: list[tuple], steady_of: dict) -> tuple[dict, list, np.ndarray]:
    """``(short, template_of, periods)``: the steady templates by kernel key, each
    configuration's kernel key (``long key + (short?,)``, with a short template's
    microbatches) and its extra periods (0: the template runs as it is).

    A long pipeline exactly as short as a sibling's short template runs that
    template with no extra periods: the same program, plus finish slots nobody reads."""
    short = {}
    for key, found in steady_of.items():
        if found is not None:
            short[(key[0], found.template.microbatches) + key[2:] + (True,)] = found
    # Per long key once (a few hundred), then per configuration a lookup.
    kernel_key, extra = {}, {}
    for key, found in steady_of.items():
        if found is None:
            kernel_key[key], extra[key] = key + (key + (True,) in short,), 0
        else:
            kernel_key[key] = (key[0], found.template.microbatches) + key[2:] + (True,)
            extra[key] = found.extra_periods
    template_of = [kernel_key[key] for key in long_of]
    periods = np.asarray([extra[key] for key in long_of], np.float64).reshape(len(long_of))
    return short, template_of, periods


def simulate_configs(
    model, topology, configs: list[Config], *, fit_only: bool = False, steady: bool = True
) -> dict:
    """Simulates ``configs`` (of :func:`enumerate_space`'s kind, any model and
    cluster); float64 (``jax.enable_x64``) is the caller's.

    Returns:
      A dict of per configuration ``step_time``, ``peak`` (largest stage
      peak, bytes) and ``status``; ``phases`` (seconds each); ``templates``,
      ``ops`` (simulated), ``simulated`` timelines, ``steady`` (of them from a
      short template), ``uncertified`` (redone long) and ``calls``.
    """
    begin = time.perf_counter()
    phases = {}
    # The kernel's shapes are fixed: it compiles (in the background) while the host builds tables.
    hardware = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), Hardware.from_topology(topology))
    kernel = _Kernel()
    # Kernel templates: (p, k, v, schedule, mode, short); a short one stands for longer k.
    long_of = [(c.pipeline, c.microbatches, c.virtual_stages, c.schedule, _KERNEL_MODE) for c in configs]
    # Long templates no short one will replace are built by the peaks threads (the
    # large ones by one, the small ones by the other) while this thread finds the
    # steady templates and then fills the tables. Of the host's work before the first
    # kernel call, that order keeps the most of it out of the way of the rest: Python
    # on small arrays holds the GIL (alternating runs: 1.71 s -> 1.62 s mean wall
    # against finding steady templates in a peaks thread while this one fills tables).
    unreplaced = _unreplaced(long_of, steady)
    large = [key for key in unreplaced if template_size(*key[:3], key[4])[0] >= _LARGE_TEMPLATE]
    built = [_PEAKS.submit(_long_templates, keys) for keys in (large, unreplaced[len(large) :])]
    # Every long pipeline that has a short one: short templates are shared by every k.
    steady_of = {key: _steady(key) if steady else None for key in set(long_of)}
    phases["steady templates"] = time.perf_counter() - begin
    tick = time.perf_counter()
    rows = _Rows(model, topology, configs)
    kernel.load(rows, hardware_rows(hardware, per_config_structure=True, xp=np))
    phases["features"] = time.perf_counter() - tick
    tick = time.perf_counter()
    templates = {}
    for made in built:
        templates.update(made.result())
    short, template_of, periods = _kernel_templates(long_of, steady_of)
    steady_rows = int((periods > 0).sum())
    step_time = np.full(len(configs), np.inf)
    status = np.full(len(configs), -1, np.int64)
    peak = np.full(len(configs), np.nan)
    device_capacity = np.asarray(hardware.memory_capacity, np.float64)

    def sizes(ids) -> dict:  # ops of each configuration's kernel template
        of_key = {
            key: short[key].template.num_ops if key in short else template_size(*key[:3], key[4])[0]
            for key in {template_of[i] for i in ids}
        }
        return {i: of_key[template_of[i]] for i in ids}

    todo = list(range(len(configs)))
    if fit_only:
        size_of = sizes(todo)
        calls = _lane_calls(_groups(todo, template_of, size_of), size_of, carry=0)
        for ids, stage_peak, device, _, _ in _run(calls, rows, None, short, periods, templates):
            stage_peak = _stage_peak_rows(stage_peak)
            peak[ids] = stage_peak.max(axis=1)
            fits = np.all((stage_peak <= device_capacity[np.maximum(device, 0)]) | (device < 0), axis=1)
            status[ids[~fits]] = STATUS_OUT_OF_MEMORY
        todo = [i for i in todo if status[i] != STATUS_OUT_OF_MEMORY]
        phases["memory"] = time.perf_counter() - tick
        tick = time.perf_counter()

    def simulate_ids(ids, size_of):
        """Simulates configurations ``ids`` (``size_of``: :func:`sizes`); returns
        those whose period was not certified."""
        calls = _lane_calls(_groups(ids, template_of, size_of), size_of, carry=_CARRIED_LANES)
        redo = set()
        for members, stage_peak, device, real, result in _run(calls, rows, kernel, short, periods, templates):
            times, certified = (x[real] for x in result.result())
            stage_peak = _stage_peak_rows(stage_peak)
            capacity = np.where(device >= 0, device_capacity[np.maximum(device, 0)], np.inf)
            step_time[members] = times
            status[members] = status_codes(times, stage_peak.T, capacity.T, xp=np)
            peak[members] = stage_peak.max(axis=1)
            redo.update(int(i) for i in members[~certified])
        return len(calls), sorted(redo)

    size_of = sizes(todo)
    num_calls, redo = simulate_ids(todo, size_of)
    simulated_ops = sum(size_of.values())
    phases["simulate"] = time.perf_counter() - tick
    if redo:  # short runs whose period had not settled: the long templates
        tick = time.perf_counter()
        for i in redo:
            template_of[i], periods[i] = long_of[i] + (False,), 0
        size_of = sizes(redo)
        simulated_ops += sum(size_of.values())
        simulate_ids(redo, size_of)
        phases["uncertified, long"] = time.perf_counter() - tick
    return dict(
        step_time=step_time,
        peak=peak,
        status=status,
        phases=phases,
        templates=len(set(template_of)),
        ops=int(simulated_ops),
        simulated=len(todo),
        steady=steady_rows,
        uncertified=len(redo),
        calls=num_calls,
    )


# As the product's sweeps (search.evaluate): the ~1e5 objects alive on entry (jax's
# among them) stay out of the full collection the sweep's allocations would trigger
# (~30-60 ms of the GIL on a 2-core CPU).
@older_objects_frozen()
def _gpt3(quick: bool, fit_only: bool, steady: bool, verbose: bool, global_batches: tuple) -> dict:
    begin = time.perf_counter()
    topology = get_preset(PRESET)
    model = get_model_config(MODEL, dtype="bf16")
    everything = [c for batch in global_batches for c in enumerate_space(model, topology.num_devices, batch)]
    configs = _subsample(everything, 8) if quick else everything
    if verbose:
        keys = len({c.structural_key for c in everything})
        batches = ", ".join(map(str, global_batches))
        print(
            f"GPT-3 175B on {PRESET}, global batch {batches}: {len(everything)} configurations, "
            f"{keys} structural keys; evaluating {len(configs)}",
            flush=True,
        )
    r = simulate_configs(model, topology, configs, fit_only=fit_only, steady=steady)
    step_time, peak, status = r["step_time"], r["peak"], r["status"]
    total = time.perf_counter() - begin
    fit = status == STATUS_OK
    # The most samples per second (with one global batch: the shortest step).
    samples = np.asarray([c.global_batch for c in configs], np.float64) / np.where(fit, step_time, np.inf)
    best = int(np.argmax(samples)) if fit.any() else None
    return dict(
        configs=len(configs),
        space_configs=len(everything),
        structural_keys=len({c.structural_key for c in configs}),
        templates=r["templates"],
        ops=r["ops"],
        simulated=r["simulated"],
        steady=r["steady"],
        uncertified=r["uncertified"],
        fit=int(fit.sum()),
        seconds=total,
        configs_per_second=len(configs) / total,
        calls=r["calls"],
        best=None
        if best is None
        else dict(
            configs[best]._asdict(),
            global_batch=configs[best].global_batch,
            step_time_s=float(step_time[best]),
            peak_memory_gb=float(peak[best]) / 1e9,
            samples_per_s=configs[best].global_batch / float(step_time[best]),
        ),
        phases=r["phases"],
        step_time=step_time,
        peak=peak,
        status=status,
    )


def product_space(global_batches: tuple[int, ...] = (GLOBAL_BATCH,)):
    """Benchmark (b)'s space as the product's ``StrategySpace`` (see
    :func:`product_configs_per_second` for how its valid rows differ)."""
    from search import StrategySpace

    return StrategySpace(
        model=MODEL,
        world_sizes=(64,),
        global_batch_sizes=tuple(global_batches),
        microbatch_sizes=tuple(sorted({b for batch in global_batches for b in _divisors(batch)})),
        schedules=("1f1b", "interleaved"),
        virtual_stages=tuple(v for v in _divisors(96) if v > 1),
        recompute=RECOMPUTE,
        zero=(False, True),
        overlap_grad_comm=(False, True),
        dtype="bf16",
        hardware=PRESET.split(":")[0],
        optimizer="adam",  # as layer_features' default, which the rest of this benchmark uses
    )


def product_configs_per_second(quick: bool, global_batches: tuple[int, ...] = (GLOBAL_BATCH,)) -> dict:
    """The same sweep through the product, ``search.evaluate`` (fast engine, exact overlap).

    The space is the equivalent ``StrategySpace``; its valid rows are evaluated
    (every 8th with ``quick``). The product's validity rules differ a little
    from :func:`enumerate_space`'s (11,250 valid rows against 10,458: it
    allows interleaved chunks of uneven sizes, and without a pipeline runs
    one microbatch per replica), so the counts differ. Returns ``configs``, ``seconds``,
    ``configs_per_second`` and ``ok`` (rows that fit in memory).
    """
    from search import enumerate_configs, evaluate

    space = product_space(global_batches)
    begin = time.perf_counter()
    configs = [c for c in enumerate_configs(space) if c.valid]
    configs = _subsample(configs, 8) if quick else configs
    table = evaluate(configs, progress=False)
    seconds = time.perf_counter() - begin
    return dict(
        configs=len(configs),
        seconds=seconds,
        configs_per_second=len(configs) / seconds,
        ok=int((table["status"] == "ok").sum()),
    )


def _set_call_shape(groups: int, rows: int) -> None:
    """Kernel calls of ``groups`` groups (templates) of ``rows`` configurations each."""
    global _GROUPS_PER_CALL, _ROWS_PER_GROUP
    for name, value in (("--groups-per-call", groups), ("--rows-per-group", rows)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")
    _GROUPS_PER_CALL, _ROWS_PER_GROUP = groups, rows


def _batch_sizes(text: str) -> tuple[int, ...]:
    """``--global-batches``: distinct integers >= 1, comma-separated (as the CLI's lists)."""
    sizes = _ints(text)
    if len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(f"expected distinct global batch sizes, got {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every 8th configuration only")
    parser.add_argument(
        "--fit-only", action="store_true", help="simulate fitting configurations' timelines only"
    )
    parser.add_argument("--no-steady", action="store_true", help="simulate every pipeline at its full length")
    parser.add_argument(
        "--check-steady",
        action="store_true",
        help="also simulate every pipeline at full length and compare (slow)",
    )
    parser.add_argument(
        "--groups-per-call",
        type=int,
        default=_GROUPS_PER_CALL,
        help=f"templates per kernel call (default {_GROUPS_PER_CALL}: a CPU; accelerators: more)",
    )
    parser.add_argument(
        "--rows-per-group",
        type=int,
        default=_ROWS_PER_GROUP,
        help=f"configurations per template group (default {_ROWS_PER_GROUP})",
    )
    parser.add_argument(
        "--global-batches",
        type=_batch_sizes,
        default=(GLOBAL_BATCH,),
        help=f"comma-separated global batch sizes swept together (default {GLOBAL_BATCH}: benchmark (b))",
    )
    parser.add_argument(
        "--product",
        action="store_true",
        help="also run the space through search.evaluate (the product's engine, exact overlap)",
    )
    args = parser.parse_args()
    _set_call_shape(args.groups_per_call, args.rows_per_group)
    print(f"# {platform.node()} {platform.machine()} jax {jax.__version__} devices={jax.devices()}")
    print(f"# groups/call {_GROUPS_PER_CALL}, rows/group {_ROWS_PER_GROUP}, ops/slice {_OP_CHUNK}")
    sweep = dict(fit_only=args.fit_only, global_batches=args.global_batches)
    r = gpt3_configs_per_second(args.quick, steady=not args.no_steady, **sweep)
    print(
        f"space: {r['space_configs']} configurations; evaluated {r['configs']} ({r['structural_keys']} "
        f"structural keys, {r['templates']} templates, {r['ops']:.3g} coarse ops simulated); "
        f"{r['simulated']} timelines, {r['steady']} of them from a short steady template "
        f"({r['uncertified']} not certified, redone long); {r['calls']} kernel calls"
    )
    print("phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
    print(
        f"end to end: {r['seconds']:.2f} s, {r['configs_per_second']:.4g} configurations/s; "
        f"{r['fit']} fit in memory"
    )
    print(f"best: {r['best']}")
    if args.check_steady and not args.no_steady:
        full = gpt3_configs_per_second(args.quick, steady=False, verbose=False, **sweep)
        both = np.isfinite(r["step_time"]) & np.isfinite(full["step_time"])
        rel = np.abs(r["step_time"] - full["step_time"]) / full["step_time"]
        print(
            f"check: full-length run {full['seconds']:.2f} s; step times agree to "
            f"{rel[both].max(initial=0):.2e} relative ({int(both.sum())} rows), peaks to "
            f"{np.nanmax(np.abs(r['peak'] - full['peak']) / full['peak']):.2e}, statuses "
            f"{'identical' if np.array_equal(r['status'], full['status']) else 'DIFFER'}"
        )
    if args.product:
        r = product_configs_per_second(args.quick, args.global_batches)
        print(
            f"through search.evaluate: {r['configs']} valid configurations in {r['seconds']:.2f} s, "
            f"{r['configs_per_second']:.4g} configurations/s; {r['ok']} fit in memory",
            flush=True,
        )


if __name__ == "__main__":
    main()
