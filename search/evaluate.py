"""Batched evaluation of a strategy space: every configuration in a few kernel calls.

Pipeline (one direction):

1. Enumerate the space; rows that break a constraint become ``"invalid"``
   rows with their reason straight away.
2. Group the valid rows by structural key (:meth:`Config.structural_key`:
   every knob except the global batch size, which flows as a size-variant
   batch dim, and the hardware, a batch axis of ``Hardware``). Per key, one
   program carrying S size variants, per hardware preset:

   * fast engine (default, :mod:`search._fast`): a coarse program (one op per
     pipeline step) filled from a cached template and one measured fine
     block; milliseconds per key, the same numbers as the exact engine. A
     long 1F1B / interleaved pipeline becomes a short program whose steady
     period stands for the rest (:mod:`~distir_jax.transforms.coarse_steady`):
     its call extrapolates the step time and the breakdown, and certifies
     that the period had settled (same clock shift on every resource); the
     rows it cannot certify run again as a longer short program, then if
     need be as their long programs.
   * exact engine (and the rows the fast engine does not model): build the
     model once with ``batch_size = np.array(<the group's batch sizes>)``,
     parallelize it with ``representative_only=True`` (one replica of each
     symmetric group; collectives costed over their full groups) and lower it.
3. Compact each program to the devices it uses, and put it in a bucket by its
   op count rounded up to a power of two (``Capacity.bucketed``). A bucket is
   simulated when it holds as many rows as one call may take
   (``max_configs_per_call``, and ``max_bytes`` of estimated kernel memory);
   the remaining rows are sorted by op count at the end and cut into full
   calls (rows of similar length together). A call runs its rows' ops
   ``_OP_CHUNK`` at a time, carrying the timeline from slice to slice
   (:func:`distir_jax.kernel.run_ops`) and stacking the next slice on the
   host while the kernel runs the last: its compiled kernel depends on the
   row count and the other sizes, never on the programs' lengths, so a whole
   sweep usually compiles one.
4. Each call shards its rows over all local JAX devices (a ``Mesh`` with one
   ``"configs"`` axis; ``shard_map`` runs the kernel on each device's slice,
   with no communication).

Precision: float64 by default (``precision``): the timeline, the op
features, hardware numbers and period weights it reads, whatever the
caller's ``jax_enable_x64``. A sweep then equals the float64 reference
simulator to rounding (random small spaces: within 4e-14, 400 rows), at
about float32's speed on a CPU. In float32 (for TPUs, which have no
float64, or half the kernel's memory) step times match it to about 1e-6 on
programs of thousands of ops; rounding grows with a program's length (a
400k-op GPT-3 175B pipeline run at full length was off by up to 1.5e-3).
Steady programs keep it short, but their period's clock shift, a difference
of two rounded clocks, is multiplied by the periods it stands for: on every
8th valid row of GPT-3 175B's space on 64 GPUs (1,407), float32 step times
are within 1.0e-4 of float64's (316 rows above 1e-5, the five farthest all
steady); on the CLI's default GPT-3 XL sweep within 7.4e-6. Peak memory
comes from lowering, in float64, and is compared with the preset's capacity
in float64.

Time: with the exact engine, building and lowering the programs (Python)
dominates; with the fast engine, preparing keys and the kernel calls do.
Every call costs its ops on the host (:func:`~distir_jax.kernel.op_costs`)
and runs them either in the compiled kernel or on the host
(:func:`~distir_jax.host_timeline.run_ops_host`), with the same results, bit
for bit. A sweep starts compiling only once the rows it has prepared would
take the host longer than about a quarter of a compile (a few hundred MLP
rows never compile); then the kernel the sweep most likely needs compiles in
a background thread (XLA releases the GIL; sizes raised to what later rows
may need: see ``_Batcher._compile_ahead``), a full call waits in a queue
until its kernel is ready while later rows are prepared, a call due before
its kernel runs on the host if that should end first, and calls pad to a
compiled kernel's sizes and row count where that costs less than a compile.
The progress bar counts configurations prepared.

Multi-host: call ``jax.distributed.initialize()`` on every host first, then
``evaluate`` on each with its own ``results_path``: by default each host
takes every ``jax.process_count()``-th configuration starting at
``jax.process_index()`` and shards it over its local devices; no host talks
to another. A host resumed from its own file goes on with its own slice.
Merge the files afterwards with
``ResultTable.concat([ResultTable.read(p) for p in paths])``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from distir_jax.host_timeline import run_ops_host
from distir_jax.ir._gc import older_objects_frozen
from distir_jax.kernel import (
    STATUS_INVALID,
    OpCosts,
    Timeline,
    conclude,
    hardware_rows,
    op_costs,
    run_ops,
    start_timeline,
)
from distir_jax.lower import Capacity, lower
from distir_jax.models import model_flops_per_sample
from distir_jax.presets import datasheet_peak_flops
from distir_jax.transforms.coarse_steady import extrapolate
from search._fast import ENGINES, FastEngine, fast_unsupported
from search._programs import (
    Prepared,
    RowStack,
    compact,
    row_bytes,
    row_shapes,
    stack_periods,
)
from search._progress import progress_bar
from search.manifest import changed_inputs, merged_inputs, recorded_inputs, sweep_inputs, write_manifest
from search.results import DERIVED_COLUMNS, STATUS_OK, STATUS_OOM, ResultTable, invalid_metrics
from search.results import STATUS_INVALID as INVALID
from search.space import HARDWARE_DTYPE, Config, StrategySpace, _one_line, as_configs

CONFIG_AXIS = "configs"
_BUILD_ERRORS = (ValueError, NotImplementedError)
# Whether to pad a call's rows up to a compiled row count rather than compile
# another: kernel seconds per padded op row (a 2-core CPU, per-configuration
# structure) against seconds per compile.
_SECONDS_PER_OP_ROW = 2.5e-7
_SECONDS_PER_COMPILE = 1.0
# Calls may run on the host (run_ops_host: the same results, bit for bit). A
# sweep starts compiling its kernel only once the rows it has prepared would
# take the host more than a quarter of this; until then, and while the kernel
# compiles, calls estimated to take the host less than this run there (about
# one compile: 0 compiles from the first row and runs every call compiled).
# Host seconds per op step, and per op and row, on a 2-core CPU.
_HOST_CALL_SECONDS = 1.0
_HOST_SECONDS_PER_STEP = 3e-5
_HOST_SECONDS_PER_OP_ROW = 3e-7
# The kernel's float types a sweep may ask for (see evaluate's ``precision``).
PRECISIONS = ("float64", "float32")
# Ops per kernel invocation: a call runs its rows' ops a slice at a time, carrying
# the timeline, so its compiled kernel does not depend on the programs' lengths.
_OP_CHUNK = 512
# Finish slots of the kernel compiled ahead of a sweep's first call (see _Batcher._compile_ahead).
_FINISH_SLOTS_AHEAD = 64
_MIN_ROWS = 32
_CPU_ROWS_PER_CALL = 256
# Programs waiting in buckets may hold at most this many times ``max_bytes`` of
# host memory; past it the bucket holding the most runs early (a GPT-3 175B
# program of 1024 microbatches is ~100 MB on the host).
_HELD_PER_CALL_BYTES = 2


def in_precision(precision: str):
    """The ``jax.enable_x64`` context of a sweep's ``precision`` (see :func:`evaluate`),
    once checked: ``with in_precision(p):`` computes in it, then restores the caller's."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return jax.enable_x64(precision == "float64")


# Full collections during a sweep skip the caller's long-lived objects (see _gc).
@older_objects_frozen()
def evaluate(
    space_or_configs: StrategySpace | Sequence[Config],
    *,
    results_path: str | os.PathLike | None = None,
    resume: bool = True,
    max_configs_per_call: int | None = None,
    max_bytes: int = 1 << 30,
    progress: bool = True,
    shard: bool = True,
    process_index: int | None = None,
    process_count: int | None = None,
    checkpoint_seconds: float = 60.0,
    engine: str = "fast",
    precision: str = "float64",
) -> ResultTable:
    """Simulates every configuration of a space (or a list of rows) in batched kernel calls.

    Args:
      space_or_configs: a :class:`StrategySpace` or :class:`Config` rows.
      results_path: a ``.csv`` or ``.parquet`` file. If it exists, its rows are
        kept and only configurations missing from it (by ``config_id``) are
        evaluated; the merged table is written back (also every
        ``checkpoint_seconds`` while running, so an interrupted sweep resumes).
        A manifest of the configurations it is to hold is written next to it
        first (:mod:`search.manifest`: ``distir-jax merge`` checks it).
      resume: keep the rows already in ``results_path`` (see above). False: a
        fresh sweep, which ignores them and leaves the file and its manifest as
        they are until it writes its own rows (a checkpoint, or the end) over them.
      max_configs_per_call: most rows in one kernel call. Default: 256 on CPU
        (the kernel's per-step tables then stay in cache: about twice the
        throughput per row of 1024-row calls on a 2-core CPU), 4096 on
        accelerators once the sweep compiles (its calls on the host: 256; a
        sweep that never compiles never starts a JAX backend).
      max_bytes: most estimated kernel memory of one call, in bytes; programs
        waiting to be batched hold at most twice this on the host.
      progress: show a progress bar (tqdm if installed) in configurations/s.
      shard: split each call's rows over all local JAX devices.
      process_index, process_count: this host's slice of the configurations
        (default: ``jax.process_index()`` / ``jax.process_count()``): ints,
        ``0 <= process_index < process_count``.
      checkpoint_seconds: how often to write partial results to ``results_path``.
      engine: ``"fast"`` (default) generates coarse programs as arrays
        (:mod:`search._fast`: milliseconds per structural key instead of
        seconds, the same step times and peak memory: tested against the
        reference simulator on the fine programs) and runs the exact engine
        for rows it does not model; ``"exact"`` builds every structural key's
        program with the transforms. The table's ``engine`` column says which
        one ran.
      precision: the kernel's float type, ``"float64"`` (default: step times
        equal the float64 reference simulator's to ~1e-14, at about the speed
        of float32 on a CPU) or ``"float32"`` (rounding grows with a
        program's length, to ~1e-4 on GPT-3 175B's steady pipelines; for TPUs,
        which have no float64: a float64 call compiled for one raises, or to
        halve the kernel's memory).
    Returns:
      A :class:`ResultTable`, one row per configuration, in enumeration order
      (rows read from ``results_path`` that are not in the space come last).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    # The count first: an index is only out of range of a count that is itself valid.
    for name, value, least in (("process_count", process_count, 1), ("process_index", process_index, 0)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least
        ):
            raise ValueError(f"{name} must be None or an int >= {least}, got {value!r}")
    # This sweep's jax work (and the background compiles it starts, see _target) in
    # its own float type; the caller's jax_enable_x64 is left as it was.
    with in_precision(precision):
        configs = as_configs(space_or_configs)
        existing = None
        if resume and results_path and os.path.exists(results_path):
            existing = ResultTable.read(
                results_path, derive=functools.partial(_derived, configs, results_path)
            )
        inputs = sweep_inputs(configs) if results_path else None  # what the manifest records
        if existing is not None:  # its rows must come from this sweep's definitions
            recorded = recorded_inputs(results_path)
            changed = changed_inputs(recorded, inputs)
            if changed:
                raise ValueError(
                    f"{results_path} holds rows computed with other definitions than this sweep's: "
                    f"{'; '.join(changed)}. Resuming would mix the two: sweep afresh (resume=False; "
                    "the CLI without --resume) or give another results file"
                )
            inputs = merged_inputs(recorded, inputs)
        done_ids = set(existing["config_id"].tolist()) if existing is not None else set()
        index, count = _process_slice(process_index, process_count)
        if not 0 <= index < count:
            raise ValueError(f"process_index must be in [0, {count}), got {index}")
        # The manifest comes before any row, so an interrupted sweep's file has it too;
        # a fresh sweep's (resume=False) comes with its first rows, not over the
        # manifest of a file it has not replaced yet.
        if results_path and resume:
            write_manifest(results_path, configs, index, count, inputs)
        manifest_due = bool(results_path) and not resume

        def write(table):
            nonlocal manifest_due
            if manifest_due:
                write_manifest(results_path, configs, index, count, inputs)
                manifest_due = False
            _write_atomic(table, results_path)

        # The slice first, then what is done: a host resumed from its own results file
        # (which holds its slice only) goes on with its slice, whatever the others did.
        todo = [c for c in configs[index::count] if c.config_id not in done_ids]

        rows: dict[str, dict] = {}
        bar = progress_bar(len(todo), progress)
        last_checkpoint = [time.perf_counter()]

        def emit(new_rows):
            for row in new_rows:
                rows[row["config_id"]] = row
            if results_path and time.perf_counter() - last_checkpoint[0] > checkpoint_seconds:
                write(_merge(configs, existing, rows))
                last_checkpoint[0] = time.perf_counter()

        invalid = [ResultTable.row_for(c, INVALID, c.reason, invalid_metrics()) for c in todo if not c.valid]
        emit(invalid)
        bar.update(len(invalid))
        models: dict = {}  # single-device programs, shared by the keys of one model and batch set
        valid = [c for c in todo if c.valid]
        largest = max((c.world_size for c in valid), default=1)
        batcher = _Batcher(max_configs_per_call, max_bytes, shard, emit, len(valid), largest)
        fast_engine = FastEngine([c for c in valid if not fast_unsupported(c)]) if engine == "fast" else None
        for group in _groups(valid):
            rows_of_group = None
            if fast_engine is not None and not fast_unsupported(group[0]):
                rows_of_group = fast_engine.prepare(group)  # None: not expressible, run exact
            fast = rows_of_group is not None
            if not fast:
                rows_of_group = _prepare_group(group, models)
            for config, prepared, variant, reason in rows_of_group:
                if reason:
                    emit([ResultTable.row_for(config, INVALID, reason, invalid_metrics())])
                else:
                    batcher.add(config, prepared, variant, "fast" if fast else "exact")
                # Progress counts configurations prepared (see the module docstring's "Time").
                bar.update(1)
        batcher.flush_all()
        retries = 0
        while batcher.redo:  # short steady programs whose period had not settled
            redo, batcher.redo = batcher.redo, []
            retries += 1
            for group in _groups(redo):
                # First a longer short program (the clocks may settle later), then the long one.
                if retries == 1:
                    again = fast_engine.prepare(group, settle=1)
                else:
                    again = fast_engine.prepare(group, steady=False)
                for config, prepared, variant, reason in again:
                    if reason:
                        emit([ResultTable.row_for(config, INVALID, reason, invalid_metrics())])
                    else:
                        batcher.add(config, prepared, variant, "fast")
            batcher.flush_all()
        bar.close()
        table = _merge(configs, existing, rows)
        if results_path:
            write(table)
        return table


def _write_atomic(table: ResultTable, path) -> None:
    """Writes a sibling file, then renames it: an interrupted write never leaves a broken results file."""
    root, suffix = os.path.splitext(os.fspath(path))
    partial = f"{root}.partial{suffix}"
    table.write(partial)
    os.replace(partial, path)


def _derived(configs: Sequence[Config], path, columns: dict) -> dict:
    """The :data:`~search.results.DERIVED_COLUMNS` of a results file written
    without them, from its rows' step times and this sweep's configurations."""
    by_id = {c.config_id: c for c in configs}
    unknown = next((cid for cid in columns["config_id"] if cid not in by_id), None)
    if unknown is not None:
        raise ValueError(
            f"{path}: written by an older distir-jax, and its row {unknown} is not a configuration "
            "of this sweep (its model FLOPs utilization cannot be filled in); sweep again without "
            "resuming it"
        )
    rows = [
        invalid_metrics() if status == INVALID else _utilization(by_id[cid], step)
        for cid, status, step in zip(
            columns["config_id"], columns["status"], columns["step_time_s"], strict=True
        )
    ]
    return {name: [row[name] for row in rows] for name in DERIVED_COLUMNS}


def _merge(configs: Sequence[Config], existing: ResultTable | None, rows: dict) -> ResultTable:
    """Existing and new rows, in the configurations' order; unknown old rows last."""
    old = {} if existing is None else {cid: i for i, cid in enumerate(existing["config_id"].tolist())}
    order, new_rows = [], []
    for c in configs:
        cid = c.config_id
        if cid in rows:
            order.append(("new", len(new_rows)))
            new_rows.append(rows[cid])
        elif cid in old:
            order.append(("old", old.pop(cid)))
    pieces = []
    new_table = ResultTable.from_rows(new_rows) if new_rows else ResultTable.empty()
    # Consecutive runs from one source become one `take`, keeping this linear.
    for source, idx in _runs(order):
        pieces.append((new_table if source == "new" else existing).take(np.asarray(idx, np.int64)))
    if old:
        pieces.append(existing.take(np.asarray(sorted(old.values()), np.int64)))
    return ResultTable.concat(pieces)


def _runs(order):
    runs = []
    for source, i in order:
        if runs and runs[-1][0] == source:
            runs[-1][1].append(i)
        else:
            runs.append((source, [i]))
    return runs


def _groups(configs: Sequence[Config]) -> list[list[Config]]:
    groups: dict[tuple, list[Config]] = {}
    for c in configs:
        groups.setdefault(c.structural_key(), []).append(c)
    return list(groups.values())


def _prepare_group(group: Sequence[Config], models: dict):
    """Builds, parallelizes and lowers one structural key; yields ``(config, prepared, variant, reason)``."""
    from search._transform import build_function  # needs the transforms; imported late on purpose

    batches = sorted({c.global_batch_size for c in group})
    try:
        fn = build_function(group[0], np.asarray(batches) if len(batches) > 1 else batches[0], models=models)
    except _BUILD_ERRORS as err:
        if len(batches) > 1:  # find which batch sizes fail, one at a time
            for b in batches:
                yield from _prepare_group([c for c in group if c.global_batch_size == b], models)
            return
        for c in group:
            yield c, None, 0, _one_line(err)
        return
    prepared: dict[str, Prepared] = {}
    for c in group:
        if c.preset not in prepared:
            try:
                prepared[c.preset] = compact(lower(fn, c.topology()), c.topology())
            except _BUILD_ERRORS as err:
                prepared[c.preset] = _one_line(err)
        p = prepared[c.preset]
        if isinstance(p, str):
            yield c, None, 0, p
        else:
            yield c, p, batches.index(c.global_batch_size) if p.num_variants > 1 else 0, ""


def build_function(config: Config, *, representative_only: bool = True):
    """The (symmetry-reduced) distributed program of one configuration, and its topology.

    This is what :func:`evaluate` simulates for the row (with the batch as one
    of several size variants); use it to check a row with the reference simulator.
    """
    from search._transform import build_function as build

    return build(config, config.global_batch_size, representative_only=representative_only), config.topology()


class _Batcher:
    """Collects rows into capacity buckets and simulates a bucket when it is full.

    A full bucket's kernel call is queued while its kernel compiles in the
    background (:func:`_compiled_call`); queued calls run as soon as their
    kernels are ready, so compiling overlaps the preparation of later rows.
    """

    def __init__(
        self, max_configs: int | None, max_bytes: int, shard: bool, emit, expected_rows=0, expected_devices=1
    ):
        if (max_configs is not None and max_configs < 1) or max_bytes < 1:
            raise ValueError(
                f"max_configs_per_call and max_bytes must be >= 1, got {max_configs}, {max_bytes}"
            )
        # Until the sweep compiles, calls run on the host: the JAX devices (and the
        # default rows per call, which depends on their platform) are looked up only
        # then, so a sweep that never compiles never starts a JAX backend.
        self.default_rows = max_configs is None
        self.max_configs = _CPU_ROWS_PER_CALL if max_configs is None else max_configs
        self.max_bytes, self.shard, self.emit = max_bytes, shard, emit
        self._devices: list | None = None
        # What the whole sweep will add, for compiling its kernel from the first row on.
        self.expected_rows, self.expected_devices = expected_rows, expected_devices
        self.compiling = False  # whether the sweep compiles kernels (see _HOST_CALL_SECONDS)
        self.host_seconds = 0.0  # estimated host seconds of the rows added so far
        # Rows of short steady programs whose period the run did not certify
        # (see coarse_steady): the caller simulates their long programs.
        self.redo: list[Config] = []
        self.items: dict[int, list] = {}
        self.capacity: dict[int, Capacity] = {}
        # Host bytes of the distinct programs each bucket holds: large models' programs
        # are big, and rows of many buckets wait at once, so the total is bounded too.
        self.held: dict[int, dict[int, int]] = {}
        self.held_bytes = 0
        self.queue: collections.deque = collections.deque()  # (chunk, capacity, call, bytes)
        self.queued_bytes = 0

    def add(self, config: Config, prepared: Prepared, variant: int, engine: str) -> None:
        num_ops = prepared.capacity.num_ops  # a row runs its ops and its share of a call's steps
        self.host_seconds += _host_seconds(num_ops / self.max_configs, num_ops)
        if not self.compiling and self.host_seconds >= _HOST_CALL_SECONDS / 4:
            self.compiling = True
            self._compile_ahead(prepared.capacity)
        cap = prepared.capacity.bucketed()
        key = cap.num_ops
        self.capacity[key] = cap if key not in self.items else self.capacity[key].union(cap)
        self.items.setdefault(key, []).append((config, prepared, variant, engine))
        held = self.held.setdefault(key, {})
        if id(prepared) not in held:
            held[id(prepared)] = prepared.nbytes
            self.held_bytes += prepared.nbytes
        bound = _HELD_PER_CALL_BYTES * self.max_bytes
        limit = self._limit(self.capacity[key])
        if len(self.items[key]) >= limit:
            self._flush(key)
        elif self.compiling and len(self.items[key]) == (limit + 1) // 2:
            # Half full: compile its full call's kernel ahead (on an otherwise idle
            # core while this thread prepares rows); a last partial call reuses it.
            _compiled_call(_compiled_cover(self.capacity[key], self.devices), limit, self.devices)
        if self.held_bytes + self.queued_bytes > bound:
            self._run_queued(wait=True)
            if self.held_bytes > bound:
                self._flush(max(self.held, key=lambda k: sum(self.held[k].values())), wait=True)
        self._run_queued(wait=False)

    @property
    def devices(self) -> list:
        """The local JAX devices calls are sharded over (found on first use)."""
        if self._devices is None:
            self._devices = _local_devices(self.shard)
            if self.default_rows and self._devices[0].platform != "cpu":
                self.max_configs = 4096
        return self._devices

    def _cover(self, capacity: Capacity) -> Capacity:
        """What a call of ``capacity`` is padded to: a compiled kernel's sizes that hold
        it, once the sweep compiles (host calls pad nothing)."""
        return _compiled_cover(capacity, self.devices) if self.compiling else capacity

    def flush_all(self) -> None:
        """Simulates every pending row, sorted by length into full calls (see :meth:`_plan`)."""
        plan = self._plan()
        self.items.clear()
        self.capacity.clear()
        self.held.clear()
        self.held_bytes = 0
        for capacity, items in plan:
            self._queue(items, capacity)
        self._run_queued(wait=True)

    def _plan(self) -> list[tuple[Capacity, list]]:
        """The pending rows regrouped into ``(capacity, rows)`` calls.

        Rows were bucketed by power-of-two op counts on the way in (so full
        buckets could run early). The rest are sorted by op count, longest
        first, and cut into calls as full as :meth:`_limit` allows: rows of
        similar length share a call (little padded work), and only the last,
        shortest call has padding rows.
        """
        pending = sorted(
            (item for items in self.items.values() for item in items),
            key=lambda item: item[1].capacity.num_ops,
            reverse=True,
        )
        plan = []
        while pending:
            limit = self._limit(_whole_slices(pending[0][1].capacity.bucketed()))
            items, pending = pending[:limit], pending[limit:]
            # Other sizes bucketed (they select the compiled kernel); ops as they are, in whole slices.
            longest = items[0][1].capacity.num_ops
            capacity = functools.reduce(Capacity.union, (item[1].capacity.bucketed() for item in items))
            capacity = dataclasses.replace(capacity, num_ops=longest)
            plan.append((self._cover(capacity), items))
        return plan

    def _limit(self, capacity: Capacity) -> int:
        """Most rows of one call: a call holds one slice of ops at a time (on the host
        and on the device), so this does not depend on the programs' lengths."""
        n = len(self._devices) if self._devices is not None else 1  # host calls: one device
        rows = min(self.max_configs, max(1, self.max_bytes // row_bytes(_kernel_capacity(capacity))))
        return max(n, rows // n * n)

    def _compile_ahead(self, capacity: Capacity) -> None:
        """Starts compiling the kernel the sweep will most likely call, from its first row.

        Its sizes are the first row's, raised to what later rows may need: the
        most devices any row's cluster has, two streams each, and a few dozen finish slots (a
        call of rows that need more compiles its own kernel then). Compiling
        takes about a second, during which this thread prepares the rows.
        """
        # Rows with gradient overlap put communication on a second stream per device.
        streams = max(2, capacity.num_resources // max(1, capacity.num_devices))
        devices = max(capacity.num_devices, self.expected_devices)
        floor = dataclasses.replace(
            capacity,
            finish_slots=max(capacity.finish_slots, _FINISH_SLOTS_AHEAD),
            num_devices=devices,
            num_resources=max(capacity.num_resources, devices * streams),
        ).bucketed()
        rows = min(self._limit(floor), max(_MIN_ROWS, 1 << max(0, self.expected_rows - 1).bit_length()))
        n = len(self.devices)
        _compiled_call(floor, -(-rows // n) * n, self.devices)

    def _num_rows(self, chunk: list, capacity: Capacity) -> int:
        """Rows of the call that simulates ``chunk``: a few fixed counts, so calls share compiled shapes."""
        # A power of two, and at least a few dozen: small sweeps then share
        # compiled shapes, and padding rows cost next to nothing.
        n = len(self.devices)
        num_rows = min(self._limit(capacity), max(_MIN_ROWS, 1 << (len(chunk) - 1).bit_length()))
        num_rows = -(-num_rows // n) * n
        # A larger call of this capacity compiled already: padding rows may cost less than a compile.
        larger = [r for r in _compiled_row_counts(capacity, self.devices) if r >= num_rows]
        if (
            larger
            and (min(larger) - num_rows) * capacity.num_ops * _SECONDS_PER_OP_ROW < _SECONDS_PER_COMPILE
        ):
            return min(larger)
        return num_rows

    def _flush(self, key: int, wait: bool = False) -> None:
        items, capacity = self.items.pop(key), self.capacity.pop(key)
        self.held_bytes -= sum(self.held.pop(key, {}).values())
        self._queue(items, capacity)
        self._run_queued(wait)

    def _queue(self, items: list, capacity: Capacity) -> None:
        """Queues the calls that simulate ``items``; their kernels start compiling now."""
        capacity = self._cover(_whole_slices(capacity))  # pad, not compile
        limit = self._limit(capacity)
        for start in range(0, len(items), limit):
            chunk = items[start : start + limit]
            if self.compiling:
                call = _compiled_call(capacity, self._num_rows(chunk, capacity), self.devices)
            else:  # on the host: no padding rows
                call = _Call(len(chunk), None)
            nbytes = sum({id(p): p.nbytes for _, p, _, _ in chunk}.values())
            self.queue.append((chunk, capacity, call, nbytes))
            self.queued_bytes += nbytes

    def _run_queued(self, wait: bool) -> None:
        """Runs queued calls in order: all of them, or while their kernels are compiled."""
        while self.queue and (wait or self.queue[0][2].ready()):
            chunk, capacity, call, nbytes = self.queue.popleft()
            pairs = [(p, v) for _, p, v, _ in chunk]
            rows = RowStack(pairs, capacity, call.num_rows)
            periods = stack_periods(pairs, capacity, call.num_rows) if _any_steady(chunk) else None
            # Not compiled yet: run on the host if that should end before the compile does.
            host = call.future is None or (
                not call.ready()
                and _host_seconds(*_steps_and_op_rows(chunk))
                < min(_HOST_CALL_SECONDS, call.due - time.perf_counter())
            )
            out = _run(None if host else call.result(), rows, periods, self._devices, len(chunk))
            self.queued_bytes -= nbytes
            certified = out.pop("certified", np.ones(call.num_rows, bool))
            self.redo.extend(c for i, (c, *_) in enumerate(chunk) if not certified[i])
            self.emit(
                [
                    _row(c, p, v, {k: x[i] for k, x in out.items()}, engine)
                    for i, (c, p, v, engine) in enumerate(chunk)
                    if certified[i]
                ]
            )


def _row(config: Config, prepared: Prepared, variant: int, out: dict, engine: str) -> dict:
    """A result row from the kernel's outputs for one configuration."""
    variant = variant if prepared.num_variants > 1 else 0
    peak = prepared.peak_bytes[variant]
    capacity = np.asarray(prepared.hardware.memory_capacity, np.float64)
    step = float(out["step_time"])
    metrics = {
        "step_time_s": step,
        "throughput_samples_per_s": config.global_batch_size / step if step > 0 else math.inf,
        **_utilization(config, step),
        "peak_memory_bytes": float(peak.max()),
        "peak_memory_gb": float(peak.max()) / 1e9,
        "compute_time_s": float(out["compute"]),
        "communication_time_s": float(out["communication"]),
        "bubble_time_s": float(out["bubble"]),
        "simulated_ops": int(prepared.program.num_ops),
        "engine": engine,
    }
    if int(out["status"]) == STATUS_INVALID or not math.isfinite(step):
        reason = "simulation gave a non-finite step time"
        return ResultTable.row_for(config, INVALID, reason, invalid_metrics())
    over = peak > capacity
    if over.any():
        d = int(np.argmax(peak - capacity))
        resident = float(prepared.resident_bytes(variant)[d])
        reason = (
            f"peak {peak[d] / 1e9:.2f} GB on device {int(prepared.devices[d])} exceeds its "
            f"{capacity[d] / 1e9:.2f} GB: {resident / 1e9:.2f} GB resident (weights, optimizer state, "
            f"data) + {(peak[d] - resident) / 1e9:.2f} GB the step allocates (activations, gradients, "
            "messages)"
        )
        return ResultTable.row_for(config, STATUS_OOM, reason, metrics)
    return ResultTable.row_for(config, STATUS_OK, "", metrics)


def _utilization(config: Config, step: float) -> dict:
    """``model_tflops_per_gpu`` and ``mfu`` of a row that ran ``step`` seconds
    (see :mod:`search.results`): the model's matmul FLOPs per step over the
    step time, per GPU and over the GPUs' datasheet peak FLOP/s (a calibrated
    preset's too: MFU measures what runs reach against the datasheet)."""
    flops = model_flops_per_sample(config.model_config) * config.global_batch_size
    flops_per_s = flops / step if step > 0 else math.inf  # as the throughput
    peak = config.world_size * datasheet_peak_flops(
        config.preset, HARDWARE_DTYPE.get(config.dtype, config.dtype)
    )
    return {"model_tflops_per_gpu": flops_per_s / config.world_size / 1e12, "mfu": flops_per_s / peak}


def _local_devices(shard: bool) -> list:
    return list(jax.local_devices()) if shard else [jax.local_devices()[0]]


def _process_slice(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """This process's slice of a sweep: the given index and count, else jax's.

    Without ``jax.distributed`` there is one process: asking jax would start its
    backend, which a sweep whose calls all run on the host never needs."""
    several = (process_index is None or process_count is None) and jax.distributed.is_initialized()
    index = process_index if process_index is not None else (jax.process_index() if several else 0)
    count = process_count if process_count is not None else (jax.process_count() if several else 1)
    return int(index), int(count)


def _run(advance, rows: RowStack, periods, devices, num_items: int) -> dict:
    """One kernel call, its ops in slices of ``_OP_CHUNK`` (``periods``: None for a
    call without steady programs); rows are split over ``devices`` when there are
    several. ``advance``: the compiled kernel, or None to run on the host
    (:func:`~distir_jax.host_timeline.run_ops_host`); rows past ``num_items``
    are padding.

    Only the slices run in jax (one compiled kernel per sweep); the zero
    timeline before them, the ops' costs and the results after them are
    computed on the host. Calls are asynchronous: the host prepares the next
    slice of ops while the kernel runs the last.
    """
    left = np.where(np.arange(rows.num_rows) < num_items, rows.per_device["num_ops"], 0)
    # The compiled kernel runs whole slices of ops (its shapes); the host runs only up
    # to the last op any row has (a call of short rows pads its ops to a whole slice).
    longest = rows.capacity.num_ops if advance is not None else max(1, int(left.max(initial=0)))
    first = rows.program(0, min(_OP_CHUNK, longest))
    state, rates = _begin_rows(first, rows.hardware, xp=np)
    if advance is not None:
        state = jax.device_put(state, _config_sharding(tuple(devices), configs_last=True))
    for lo in range(0, rows.capacity.num_ops, _OP_CHUNK):
        r, hi = rows.num_rows, min(lo + _OP_CHUNK, longest)
        if advance is None:  # the host runs only the rows with ops left (longest first: a prefix)
            running = np.flatnonzero(left > lo)
            if not len(running):
                break
            r = int(running[-1]) + 1
        chunk = first if lo == 0 and r == rows.num_rows else rows.program(lo, hi, r)
        weight = None if periods is None else periods["op_weight"][:r, lo:hi]
        running_rates = rates
        if r < rows.num_rows:
            running_rates = dataclasses.replace(rates, table=rates.table[:r], launch=rates.launch[:r])
        costs = op_costs(chunk, running_rates, weight, split_compute=True, xp=np)
        if advance is None:
            state, _ = run_ops_host(state, chunk, costs, left - lo)
        else:
            shardings = (
                _config_sharding(tuple(devices)),
                _config_sharding(tuple(devices), configs_last=True),
            )
            state = advance(state, *jax.device_put((_structure(chunk), costs), shardings))
    state = jax.tree_util.tree_map(np.asarray, state)
    return _end_rows(state, first, rows.hardware, periods)


def _host_seconds(steps: float, op_rows: float) -> float:
    """Estimated seconds of :func:`run_ops_host` for ``steps`` op steps over ``op_rows`` ops of rows."""
    return steps * _HOST_SECONDS_PER_STEP + op_rows * _HOST_SECONDS_PER_OP_ROW


def _steps_and_op_rows(chunk) -> tuple[int, int]:
    """A call's op steps (its longest row's ops) and ops over all its rows."""
    ops = [item[1].capacity.num_ops for item in chunk]
    return max(ops), sum(ops)


def _config_sharding(devices: tuple, configs_last: bool = False):
    """Rows split over ``devices`` (a one-device call stays on its device, whatever the default);
    ``configs_last``: for the kernel's timeline, whose arrays put configurations last."""
    if len(devices) == 1:
        return SingleDeviceSharding(devices[0])
    spec = PartitionSpec(None, CONFIG_AXIS) if configs_last else PartitionSpec(CONFIG_AXIS)
    return NamedSharding(Mesh(np.asarray(devices), (CONFIG_AXIS,)), spec)


@dataclasses.dataclass
class _Call:
    """A kernel call's shape, and its compiled executable (compiled in the background;
    None: the call runs on the host)."""

    num_rows: int
    future: concurrent.futures.Future | None
    due: float = 0.0  # when the compile should be done (time.perf_counter())

    def ready(self) -> bool:
        """Whether the call can run now without waiting for a compile."""
        return self.future is None or self.future.done()

    def result(self):
        return self.future.result()


# Background threads compile the kernel shapes: XLA releases the GIL while it
# compiles (mostly on one core per kernel), so the host meanwhile prepares and
# stacks rows, and a sweep's last calls compile side by side.
_COMPILER = concurrent.futures.ThreadPoolExecutor(
    max_workers=max(1, min(4, (os.cpu_count() or 1))), thread_name_prefix="distir-jax-compile"
)
# Compiled kernels, oldest first; past _MAX_COMPILED the oldest finished ones
# go (a long notebook session sweeps many shapes; a call holds its own).
_COMPILED: dict[tuple, concurrent.futures.Future] = {}
_COMPILE_DUE: dict[tuple, float] = {}  # when each compile should be done
_MAX_COMPILED = 32


def _compiled_call(capacity: Capacity, num_rows: int, devices: list) -> _Call:
    """The compiled kernel call for ``num_rows`` rows of ``capacity``, started if new.
    The kernel runs ``_OP_CHUNK`` ops at a time, costed on the host, so one
    compiled call serves every op count, steady programs or not."""
    if jax.config.jax_enable_x64 and any(getattr(d, "platform", "") == "tpu" for d in devices):
        raise ValueError(
            "precision='float64' needs float64 on the devices, and TPUs have none: "
            "pass precision='float32' (distir-jax: --precision float32)"
        )
    capacity = _kernel_capacity(capacity)
    key = (_target(devices), capacity, num_rows)
    future = _COMPILED.get(key)
    if future is None or (future.done() and future.exception() is not None):  # retry failures
        x64 = key[0][1]  # the caller's setting: a `with jax.enable_x64()` does not reach other threads
        _COMPILED.pop(key, None)
        future = _COMPILED[key] = _COMPILER.submit(_compile, tuple(devices), capacity, num_rows, x64)
        _COMPILE_DUE[key] = time.perf_counter() + _SECONDS_PER_COMPILE
        for old in [k for k, f in _COMPILED.items() if f.done()][: max(0, len(_COMPILED) - _MAX_COMPILED)]:
            del _COMPILED[old]
            _COMPILE_DUE.pop(old, None)
    return _Call(num_rows, future, _COMPILE_DUE.get(key, 0.0))


def _kernel_capacity(capacity: Capacity) -> Capacity:
    """What a compiled call depends on: every size but the op count (one slice of ops)."""
    return dataclasses.replace(capacity, num_ops=_OP_CHUNK)


def _whole_slices(capacity: Capacity) -> Capacity:
    """``capacity`` with its op count rounded up to whole slices of ``_OP_CHUNK`` ops."""
    return dataclasses.replace(capacity, num_ops=-(-capacity.num_ops // _OP_CHUNK) * _OP_CHUNK)


def _compiled_cover(capacity: Capacity, devices: list) -> Capacity:
    """``capacity``, padded to the device and slot counts of a compiled call that holds it, if any.

    Padding a call to a compiled kernel's device and slot counts costs less than a compile.
    """
    target, kernel = _target(devices), _kernel_capacity(capacity)
    covers = [key[1] for key in _COMPILED if key[0] == target and _holds(key[1], kernel)]
    cover = min(covers, key=Capacity.sizes, default=kernel)
    return dataclasses.replace(cover, num_ops=capacity.num_ops)


def _target(devices: list) -> tuple:
    """What a compiled kernel depends on besides its shapes: the devices, and whether
    jax computes in float64 (the kernel's float type follows ``jax_enable_x64`` when traced)."""
    return tuple(devices), bool(jax.config.jax_enable_x64)


def _holds(outer: Capacity, inner: Capacity) -> bool:
    return all(a >= b for a, b in zip(outer.sizes(), inner.sizes(), strict=True))


def _compiled_row_counts(capacity: Capacity, devices: list) -> list[int]:
    """Row counts with a kernel compiled (or compiling) for ``capacity`` on ``devices``."""
    key = (_target(devices), _kernel_capacity(capacity))
    return [k[2] for k in _COMPILED if k[:2] == key]


def _any_steady(items) -> bool:
    """Whether any of ``(config, prepared, variant, engine)`` items is a short steady
    program (its call then weights the period's ops and extrapolates)."""
    return any(item[1].steady is not None for item in items)


def _compile(devices: tuple, capacity: Capacity, num_rows: int, x64: bool):
    """The kernel of a call: one slice of ops (:func:`_advance_rows`), compiled."""
    with jax.enable_x64(x64):
        rows, last = _config_sharding(devices), _config_sharding(devices, configs_last=True)
        program, hardware, _ = row_shapes(capacity, num_rows, rows)
        state, rates = jax.eval_shape(_begin_rows, program, hardware)
        on_last = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=last)  # noqa: E731
        state = jax.tree_util.tree_map(on_last, state)
        costs = jax.eval_shape(functools.partial(op_costs, split_compute=True), program, rates)
        costs = jax.tree_util.tree_map(on_last, costs)
        return _runner(devices).lower(state, _structure(program), costs).compile()


@functools.cache
def _runner(devices: tuple):
    """:func:`_advance_rows`, jitted; over several devices, each runs its slice of the rows."""
    if len(devices) == 1:
        return jax.jit(_advance_rows)
    rows, last = PartitionSpec(CONFIG_AXIS), PartitionSpec(None, CONFIG_AXIS)
    state = Timeline(last, last, last, last)  # the kernel keeps configurations last
    in_specs = (state, rows, OpCosts(last, last, last))
    mesh = Mesh(np.asarray(devices), (CONFIG_AXIS,))
    # The kernel starts its scan from fresh (unvarying) zeros; per-device slices never
    # communicate, so the varying-axis check has nothing to protect here.
    sharded = jax.shard_map(_advance_rows, mesh=mesh, in_specs=in_specs, out_specs=state, check_vma=False)
    return jax.jit(sharded)


def simulate_on_host(program, hardware, periods=None) -> tuple[dict, tuple]:
    """Whole programs on the host (no compile): the breakdown of :func:`_end_rows`,
    ``[B]`` each, and every op's ``(start, finish)``, ``[B, N]`` each.

    A sweep's call runs the same steps with the ops in slices (:func:`_run`).
    """
    state, rates = _begin_rows(program, hardware, xp=np)
    weight = None if periods is None else periods["op_weight"]
    costs = op_costs(program, rates, weight, split_compute=True, xp=np)
    state, (start, finish) = run_ops_host(state, program, costs, record_ops=True)
    return _end_rows(state, program, hardware, periods), (start.T, finish.T)


def _begin_rows(program, hardware, xp=jnp):
    """A call's zero timeline (tracking the compute part of busy time), and its
    hardware as cost-model rows (``xp=numpy``: on the host)."""
    num_rows = hardware.peak_flops.shape[0]
    num_resources = program.resource_device.shape[-1]
    state = start_timeline(num_resources, program.num_finish_slots, num_rows, split_compute=True, xp=xp)
    return state, hardware_rows(hardware, per_config_structure=True, xp=xp)


def _advance_rows(state, structure, costs: OpCosts):
    """Runs one slice of every row's ops, costed on the host (:func:`_structure`
    of the slice, and its :func:`~distir_jax.kernel.op_costs`)."""
    return run_ops(state, structure, None, precomputed=costs)[0]


# What the compiled kernel reads of a slice whose ops are costed already.
_KERNEL_FIELDS = ("resource", "dep_slot", "out_slot", "resource_device")


def _structure(program):
    """``program`` without what the kernel does not read (None: nothing to transfer)."""
    return program.replace(
        **{
            f.name: None
            for f in dataclasses.fields(program)
            if f.name not in _KERNEL_FIELDS + ("num_finish_slots",)
        }
    )


def _end_rows(state, program, hardware, periods=None) -> dict:
    """Step time, status and the compute / communication / bubble breakdown on
    the busiest device, ``[B]`` each, computed on the host (NumPy).

    With ``periods`` (:func:`~search._programs.stack_periods`), a short steady
    program's row reports its long program (see
    :mod:`~distir_jax.transforms.coarse_steady`): the step time grows by ``r``
    times the period's clock shift, its ops count ``1 + r`` times in the
    breakdown (``op_weight``, folded into the ops' costs by
    :func:`~distir_jax.kernel.op_costs`), and ``certified`` says whether the
    shift was the same on every resource (rows where it was not need their
    long program).
    """
    xp = np
    sim = conclude(state, program.peak_bytes, hardware, xp=xp)
    num_rows, num_devices = hardware.peak_flops.shape
    step_time, busy = sim.step_time, sim.busy_time  # [B], [B, R]
    certified = xp.ones(num_rows, bool)
    if periods is not None:
        extra = periods["extra_periods"].astype(step_time.dtype)
        step_time, certified = _extrapolate(sim, periods, extra)
    # A resource's busy time, compute part and rest, summed over each device's streams.
    on_device = program.resource_device[..., None] == xp.arange(num_devices).reshape(1, 1, -1)  # [B, R, D]
    busy_dev = xp.einsum("br,brd->bd", busy, on_device.astype(busy.dtype))
    compute_dev = xp.einsum("br,brd->bd", state.compute.T, on_device.astype(busy.dtype))
    busiest = xp.argmax(busy_dev, axis=1)
    pick = lambda x: xp.take_along_axis(x, busiest[:, None], axis=1)[:, 0]  # noqa: E731
    on_busiest = program.resource_device == busiest[:, None]
    stream_busy = xp.max(xp.where(on_busiest, busy, 0.0), axis=1)
    return {
        "step_time": step_time,
        "status": sim.status,
        "compute": pick(compute_dev),
        "communication": pick(busy_dev - compute_dev),
        "bubble": xp.maximum(step_time - stream_busy, 0.0),
        "certified": certified,
    }


def _extrapolate(sim, periods, extra):
    """The long programs' step times, and whether each row's period is certified,
    within what the kernel's float type can tell apart."""
    # float32 clocks carry rounding of a few ulps, which the bound r * spread multiplies.
    rtol = max(1e-9, 100 * float(jnp.finfo(sim.step_time.dtype).eps))
    before, after = periods["period_before"], periods["period_after"]
    return extrapolate(sim.finish_slots, before, after, extra, sim.step_time, rtol, xp=np)
