"""Preparing lowered programs for batched evaluation: compaction, padding and row stacking.

A symmetry-reduced program touches few of the cluster's devices (one replica
per pipeline stage, plus the ends of each collective's slowest link), but
lowering sizes its device tables for the whole cluster. :func:`compact`
renumbers the devices it really uses, so the kernel's per-configuration
state and the ``[D, D]`` link tables shrink from the world size to a handful.

Rows: the kernel takes programs stacked on a leading batch axis. One row is
one configuration: a size variant of a lowered program, padded to its
bucket's capacity, next to the hardware it runs on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from distir_jax.cost import COST_FEATURES
from distir_jax.hardware import Hardware, pad_hardware, stack_hardware
from distir_jax.ir import Topology
from distir_jax.lower import NO_DEVICE, NO_RESOURCE, NO_SLOT, Capacity, Program
from distir_jax.transforms.coarse_steady import SteadyTemplate

# Per-op cost features (``[N]``, or ``[S, N]`` with size variants) and per-device
# features (``[D]`` or ``[S, D]``); the kernel never reads alloc / free bytes.
_OP_FEATURES = COST_FEATURES
_DEVICE_FEATURES = ("resident_bytes", "peak_bytes")
_OP_FIELDS = ("resource", "slot_device", "dep_slot", "out_slot", "link", "is_comm") + _OP_FEATURES
# Kernel working memory per row, as a multiple of the row's input bytes: the
# kernel re-lays structure configs-last and derives a few index tables from it.
_WORKSPACE_FACTOR = 4


def kernel_float() -> np.dtype:
    """The kernel's float type in the caller's context: float32, or float64 under
    ``jax.enable_x64``. Stacked features, hardware and period weights are
    stored in it, so a float64 sweep is float64 from its inputs on (a float32
    launch overhead of 5 us, upcast, is 2.5e-8 off)."""
    return np.dtype(jax.numpy.result_type(float))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One lowered, compacted program and its hardware, ready to be cut into rows.

    Attributes:
      program: the compacted program; features may have a leading ``[S]`` axis.
      hardware: the compacted hardware, ``[D']`` devices.
      devices: ``[D']`` original device index of each compacted device.
      peak_bytes: ``[S, D']`` float64 peak bytes per device and variant.
      steady: when ``program`` is a short steady program standing for a
        longer one (:mod:`~distir_jax.transforms.coarse_steady`), its period;
        ``peak_bytes`` are then the long program's already.
    """

    program: Program
    hardware: Hardware
    devices: np.ndarray
    peak_bytes: np.ndarray
    steady: SteadyTemplate | None = None

    @property
    def num_variants(self) -> int:
        return self.peak_bytes.shape[0]

    def resident_bytes(self, variant: int) -> np.ndarray:
        """``[D']`` bytes resident from the start on each device (size ``variant``):
        weights, optimizer state and the step's data; the rest of a peak is what
        the step allocates (activations, gradients, messages)."""
        resident = np.asarray(self.program.resident_bytes, np.float64)
        return resident[variant] if resident.ndim > 1 else resident

    @functools.cached_property
    def capacity(self) -> Capacity:
        return self.program.capacity  # (read for every row a sweep batches)

    @functools.cached_property
    def nbytes(self) -> int:
        """Host bytes of its arrays (what holding it pending costs)."""
        leaves = jax.tree_util.tree_leaves((self.program, self.hardware, self.devices, self.peak_bytes))
        return int(sum(np.asarray(x).nbytes for x in leaves))


def compact(program: Program, topology: Topology, steady: SteadyTemplate | None = None) -> Prepared:
    """Keeps only the devices a program uses (ops, collective links, resident data).

    ``steady``: the program's period, when it is a short steady program (ops keep their order).
    """
    num_devices = topology.num_devices
    streams = program.resource_device.shape[-1] // num_devices
    resident = np.asarray(program.resident_bytes).reshape(-1, num_devices)
    slot_device = np.asarray(program.slot_device)
    used = resident.max(axis=0) > 0
    used[slot_device[slot_device >= 0]] = True
    used[np.asarray(program.link)] = True
    devices = np.flatnonzero(used) if used.any() else np.zeros(1, np.int64)
    remap = np.full(num_devices, NO_DEVICE, np.int64)
    remap[devices] = np.arange(len(devices))
    new_slot_device = np.where(slot_device >= 0, remap[np.maximum(slot_device, 0)], NO_DEVICE)
    resource = np.asarray(program.resource)
    new_resource = np.where(
        resource >= 0, remap[np.maximum(resource, 0) // streams] * streams + resource % streams, NO_RESOURCE
    )
    compacted = program.replace(
        resource=new_resource.astype(np.int32),
        slot_device=new_slot_device.astype(np.int32),
        link=remap[np.asarray(program.link)].astype(np.int32),
        resource_device=np.repeat(np.arange(len(devices), dtype=np.int32), streams),
        resident_bytes=np.asarray(program.resident_bytes)[..., devices],
        peak_bytes=np.asarray(program.peak_bytes)[..., devices],
    )
    pair = np.ix_(devices, devices)
    hardware = Hardware(
        peak_flops=topology.peak_flops[devices],
        memory_bandwidth=topology.memory_bandwidth[devices],
        memory_capacity=topology.memory_capacity[devices],
        link_bandwidth=topology.link_bandwidth[pair],
        link_latency=topology.link_latency[pair],
        launch_overhead=np.asarray(topology.launch_overhead),
    )
    peak = np.asarray(compacted.peak_bytes, np.float64).reshape(-1, len(devices))
    return Prepared(compacted, hardware, devices, peak, steady)


def row_bytes(capacity: Capacity) -> int:
    """Estimated device bytes one row of this capacity needs in a kernel call."""
    n, k, p = capacity.num_ops, capacity.slots_per_op, capacity.deps_per_op
    d, r, v = capacity.num_devices, capacity.num_resources, capacity.finish_slots
    # resource and slot_device, deps, out, link, is_comm, features, period weight
    f = kernel_float().itemsize
    per_op = 8 * k + 4 * p + 4 + 8 + 1 + f * len(_OP_FEATURES) + f
    inputs = n * per_op + 2 * f * d * d + 4 * f * d + 4 * r
    carry = f * (3 * r + v + 2 * d)
    return _WORKSPACE_FACTOR * inputs + carry


def stack_rows(items: Sequence[tuple[Prepared, int]], capacity: Capacity, num_rows: int):
    """Stacks ``(prepared, variant)`` pairs into ``[num_rows, ...]`` kernel inputs.

    Rows past ``len(items)`` repeat the first item (their results are
    discarded); they keep the row count at a few fixed values so that calls
    reuse compiled kernels.

    Returns:
      ``(program, hardware)`` with a leading row axis; ``alloc_bytes`` and
      ``free_bytes`` are placeholders (the kernel reads the precomputed
      ``peak_bytes`` instead).
    """
    rows = RowStack(items, capacity, num_rows)
    return rows.program(0, capacity.num_ops), rows.hardware


class RowStack:
    """The rows of one kernel call: per-device arrays and hardware stacked at
    once, op arrays one window of ops at a time (:meth:`program`), so a call
    over long programs never holds all of its ops on the host (see
    :func:`stack_rows` for the row layout)."""

    def __init__(self, items: Sequence[tuple[Prepared, int]], capacity: Capacity, num_rows: int):
        items = list(items) + [items[0]] * (num_rows - len(items))
        self.capacity, self.num_rows = capacity, num_rows
        fields = _row_fields(capacity, num_rows)
        self.float = fields["flops"][1]
        self.per_device = {
            name: np.full(shape, fill, dtype)
            for name, (shape, dtype, fill) in fields.items()
            if name not in _OP_FIELDS
        }
        # Rows of one program share its structure: one assignment fills them all.
        members: dict[int, tuple[Prepared, list[int], list[int]]] = {}
        for row, (prepared, variant) in enumerate(items):
            _, rows, variants = members.setdefault(id(prepared), (prepared, [], []))
            rows.append(row)
            variants.append(variant)
        self.members = [(p, np.asarray(rows), np.asarray(variants)) for p, rows, variants in members.values()]
        d = capacity.num_devices
        member_hardware, member_of = [], np.zeros(num_rows, np.int64)
        for m, (prepared, rows, variants) in enumerate(self.members):
            prog = prepared.program
            x = np.asarray(prog.resource_device)
            self.per_device["resource_device"][rows, : x.shape[-1]] = x
            self.per_device["num_ops"][rows] = int(prog.num_ops)
            for name in _DEVICE_FEATURES:
                x = np.asarray(getattr(prog, name))
                self.per_device[name][rows, : x.shape[-1]] = x[variants] if x.ndim > 1 else x
            hw = prepared.hardware
            member_hardware.append(pad_hardware(hw, d) if hw.num_devices < d else hw)
            member_of[rows] = m
        # Each program's hardware stacked once, then a row per configuration;
        # in the kernel's float type, like the other stacked fields.
        stacked = stack_hardware(member_hardware)
        self.hardware = jax.tree_util.tree_map(lambda x: x[member_of].astype(self.float), stacked)

        self._concatenate(items)

    def _concatenate(self, items) -> None:
        """Every distinct program's op arrays end to end (structure per program, features
        per program and size variant), each ending in one padding op: a window of
        every row is then one gather per field."""
        fields = _row_fields(self.capacity, 1, 1)
        index = {id(p): m for m, (p, _, _) in enumerate(self.members)}
        sources: dict[tuple[int, int], int] = {}
        row_source = np.asarray([sources.setdefault((index[id(p)], v), len(sources)) for p, v in items])
        lengths = [int(np.shape(p.program.resource)[0]) for p, _, _ in self.members]
        self._flat = {}
        for name in _OP_FIELDS:
            shape, dtype, fill = fields[name]
            if name in _OP_FEATURES:
                parts = []
                for m, v in sources:
                    x = np.asarray(getattr(self.members[m][0].program, name))
                    parts.append(x[v] if x.ndim > 1 else x)
            else:
                parts = [np.asarray(getattr(p.program, name)) for p, _, _ in self.members]
            self._flat[name] = _end_to_end(parts, shape[2:], dtype, fill)
        member_of = np.asarray([index[id(p)] for p, _ in items])
        self._length = np.asarray(lengths)[member_of]
        self._start = np.cumsum([0] + lengths)[member_of]
        source_lengths = [lengths[m] for m, _ in sources]
        self._feature_start = np.cumsum([0] + source_lengths)[row_source]

    def program(self, lo: int, hi: int, rows: int | None = None) -> Program:
        """The rows' ops ``lo .. hi`` (padding past each program's end), with the
        per-device arrays; only the first ``rows`` rows if given."""
        rows = self.num_rows if rows is None else rows
        at = np.arange(lo, hi)[None, :]
        inside = at < self._length[:rows, None]
        where = {
            False: np.where(inside, self._start[:rows, None] + at, len(self._flat["resource"]) - 1),
            True: np.where(inside, self._feature_start[:rows, None] + at, len(self._flat["flops"]) - 1),
        }
        arrays = {name: np.take(self._flat[name], where[name in _OP_FEATURES], axis=0) for name in _OP_FIELDS}
        placeholder = np.zeros((rows, 1, 1), self.float)
        return Program(
            **arrays,
            **{name: x[:rows] for name, x in self.per_device.items()},
            alloc_bytes=placeholder,
            free_bytes=placeholder,
            num_finish_slots=self.capacity.finish_slots,
        )


def _end_to_end(parts: list, trailing: tuple, dtype, fill) -> np.ndarray:
    """``parts`` (``[n_i, *t_i]`` with ``t_i <= trailing``) one after the other, padded with
    ``fill`` to ``trailing``, and one padding row at the end."""
    lengths = [len(x) for x in parts]
    flat = np.full((sum(lengths) + 1, *trailing), fill, dtype)
    starts = np.cumsum([0] + lengths)
    # Parts of one trailing shape are copied in one go (one concatenate, one assignment).
    by_shape: dict[tuple, list[int]] = {}
    for i, x in enumerate(parts):
        by_shape.setdefault(x.shape[1:], []).append(i)
    for tail, members in by_shape.items():
        block = np.concatenate([parts[i] for i in members])
        if len(by_shape) == 1:  # every part: they are already in order
            flat[(slice(0, len(block)), *(slice(0, m) for m in tail))] = block
            continue
        size = np.asarray(lengths)[members]
        rows = np.arange(len(block)) + np.repeat(starts[members] - (np.cumsum(size) - size), size)
        flat[(rows, *(slice(0, m) for m in tail))] = block
    return flat


def _row_fields(
    capacity: Capacity, num_rows: int, num_ops: int | None = None
) -> dict[str, tuple[tuple[int, ...], type, object]]:
    """Shape, dtype and padding value of each stacked program field, ``[num_rows, ...]``
    (``num_ops``: a window of that many ops instead of the capacity's)."""
    n = capacity.num_ops if num_ops is None else num_ops
    k, p = capacity.slots_per_op, capacity.deps_per_op
    d, r = capacity.num_devices, capacity.num_resources
    f = kernel_float()
    return {
        "resource": ((num_rows, n, k), np.int32, NO_RESOURCE),
        "slot_device": ((num_rows, n, k), np.int32, NO_DEVICE),
        "dep_slot": ((num_rows, n, p), np.int32, NO_SLOT),
        "out_slot": ((num_rows, n), np.int32, NO_SLOT),
        "link": ((num_rows, n, 2), np.int32, 0),
        "is_comm": ((num_rows, n), np.bool_, False),
        "resource_device": ((num_rows, r), np.int32, NO_DEVICE),
        "num_ops": ((num_rows,), np.int32, 0),
        **{name: ((num_rows, n), f, 0.0) for name in _OP_FEATURES},
        **{name: ((num_rows, d), f, 0.0) for name in _DEVICE_FEATURES},
    }


def stack_periods(items: Sequence[tuple[Prepared, int]], capacity: Capacity, num_rows: int) -> dict:
    """The rows' steady periods, ``[num_rows, ...]`` (rows as in :func:`stack_rows`).

    ``op_weight``: how many times the long program runs each op (``1 + r``
    in the period of a steady program, else 1); ``period_before`` /
    ``period_after``: the finish slots that hold the clocks of the period's
    resources before and after it (-1 past them); ``extra_periods``: ``r``
    (0 for a program that is not steady).
    """
    items = list(items) + [items[0]] * (num_rows - len(items))
    arrays = {
        name: np.full(shape, fill, dtype)
        for name, (shape, dtype, fill) in _period_fields(capacity, num_rows).items()
    }
    for row, (prepared, _) in enumerate(items):
        steady = prepared.steady
        if steady is None:
            continue
        begin, end = steady.period
        arrays["op_weight"][row, begin:end] = 1 + steady.extra_periods
        arrays["period_before"][row, : len(steady.before)] = steady.before
        arrays["period_after"][row, : len(steady.after)] = steady.after
        arrays["extra_periods"][row] = steady.extra_periods
    return arrays


def _period_fields(capacity: Capacity, num_rows: int) -> dict[str, tuple[tuple[int, ...], type, object]]:
    n, r = capacity.num_ops, capacity.num_resources  # a period uses at most every resource
    f = kernel_float()
    return {
        "op_weight": ((num_rows, n), f, 1.0),
        "period_before": ((num_rows, r), np.int32, -1),
        "period_after": ((num_rows, r), np.int32, -1),
        "extra_periods": ((num_rows,), f, 0.0),
    }


def row_shapes(capacity: Capacity, num_rows: int, sharding=None):
    """:func:`stack_rows`' and :func:`stack_periods`' outputs as ``jax.ShapeDtypeStruct``
    leaves: compiles a call ahead of its data. Returns ``(program, hardware, periods)``."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    arrays = {name: spec(shape, dtype) for name, (shape, dtype, _) in _row_fields(capacity, num_rows).items()}
    f = kernel_float()
    placeholder = spec((num_rows, 1, 1), f)
    program = Program(
        **arrays, alloc_bytes=placeholder, free_bytes=placeholder, num_finish_slots=capacity.finish_slots
    )
    d = capacity.num_devices
    per_device = {"link_bandwidth": (d, d), "link_latency": (d, d), "launch_overhead": ()}
    hardware = Hardware(
        **{
            field.name: spec((num_rows, *per_device.get(field.name, (d,))), f)
            for field in dataclasses.fields(Hardware)
        }
    )
    periods = {
        name: spec(shape, dtype) for name, (shape, dtype, _) in _period_fields(capacity, num_rows).items()
    }
    return program, hardware, periods
