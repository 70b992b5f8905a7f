"""Lowering: a typed IR function plus a topology becomes fixed-shape arrays.

This is the one boundary between Python objects and arrays. Everything right
of it (cost model, timeline kernel) is a pure function of the
:class:`Program` pytree, so ``jit``, ``vmap``, ``grad`` and sharding apply.

Shapes: N ops, K resource slots per op (the widest op's device count), P
dependency slots per op, V finish-time slots, D devices, R = D * S resources
(S streams per device), and an optional leading S_v axis of size variants on
the feature fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from distir_jax.cost import COST_FEATURES
from distir_jax.ir._gc import gc_paused
from distir_jax.ir.function import Function
from distir_jax.ir.registry import check_alias_fits, get_spec, op_features, output_aliases
from distir_jax.ir.topology import Topology
from distir_jax.ir.typecheck import infer_types

# Named sentinels for padding, declared once.
NO_RESOURCE = -1  # an unused resource slot of an op
NO_DEVICE = -1  # the device of an unused slot / a padded resource
NO_SLOT = -1  # an unused dependency slot, or an op whose finish nobody reads

_STRUCTURE_FIELDS = ("resource", "slot_device", "dep_slot", "out_slot", "link", "is_comm", "resource_device")
_FEATURE_FIELDS = COST_FEATURES + ("alloc_bytes", "free_bytes", "resident_bytes", "peak_bytes")


@dataclasses.dataclass(frozen=True)
class Program:
    """A lowered program: one frozen pytree of fixed-shape arrays.

    Structure (integers, shared by all size variants):
      resource: ``[N, K]`` resource index of each of the op's slots, or NO_RESOURCE.
      slot_device: ``[N, K]`` device of each slot, or NO_DEVICE.
      dep_slot: ``[N, P]`` finish-time slots the op must wait for, or NO_SLOT.
        Dependencies already implied by issue order on a shared resource are
        dropped at lowering; only the others are read.
      out_slot: ``[N]`` finish-time slot the op writes, or NO_SLOT.
      link: ``[N, 2]`` devices at the ends of a communication op's slowest link.
      is_comm: ``[N]`` whether the op is costed as communication.
      resource_device: ``[R]`` device of each resource (NO_DEVICE for padding).
      num_ops: ``[]`` number of real (unpadded) ops.
    Features (floats; may carry a leading size-variant axis):
      launches, flops, mem_bytes, linear_flops, linear_bytes, comm_volume,
        comm_hops: ``[N]`` cost features (see :mod:`distir_jax.cost`).
      alloc_bytes, free_bytes: ``[N, K]`` bytes allocated before / freed after
        the op on each slot's device.
      resident_bytes: ``[D]`` bytes resident from the start on each device.
      peak_bytes: ``[D]`` peak bytes per device. Memory follows program order
        and byte counts only, never the timeline or the hardware, so it is
        computed here once per size variant (exactly, in float64) instead of
        once per configuration inside the kernel.
    Static:
      num_finish_slots: V.
    """

    resource: np.ndarray
    slot_device: np.ndarray
    dep_slot: np.ndarray
    out_slot: np.ndarray
    link: np.ndarray
    is_comm: np.ndarray
    resource_device: np.ndarray
    num_ops: np.ndarray
    launches: np.ndarray
    flops: np.ndarray
    mem_bytes: np.ndarray
    linear_flops: np.ndarray
    linear_bytes: np.ndarray
    comm_volume: np.ndarray
    comm_hops: np.ndarray
    alloc_bytes: np.ndarray
    free_bytes: np.ndarray
    resident_bytes: np.ndarray
    peak_bytes: np.ndarray
    num_finish_slots: int

    @property
    def capacity(self) -> Capacity:
        return Capacity(
            num_ops=self.resource.shape[-2],
            slots_per_op=self.resource.shape[-1],
            deps_per_op=self.dep_slot.shape[-1],
            finish_slots=self.num_finish_slots,
            num_devices=self.resident_bytes.shape[-1],
            num_resources=self.resource_device.shape[-1],
        )

    def replace(self, **changes) -> Program:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    Program,
    data_fields=[f.name for f in dataclasses.fields(Program) if f.name != "num_finish_slots"],
    meta_fields=["num_finish_slots"],
)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Array sizes a program is padded to, so one compiled kernel serves many."""

    num_ops: int
    slots_per_op: int
    deps_per_op: int
    finish_slots: int
    num_devices: int
    num_resources: int

    def sizes(self) -> tuple[int, ...]:
        """The sizes in field order (``dataclasses.astuple`` deep-copies, and sweeps call this a lot)."""
        return (
            self.num_ops,
            self.slots_per_op,
            self.deps_per_op,
            self.finish_slots,
            self.num_devices,
            self.num_resources,
        )

    def union(self, other: Capacity) -> Capacity:
        return Capacity(*(max(a, b) for a, b in zip(self.sizes(), other.sizes())))

    def bucketed(self) -> Capacity:
        """Rounds every size up to a power of two, to share compiled kernels."""
        up = lambda n: 1 << max(0, int(n) - 1).bit_length()  # noqa: E731
        return Capacity(*(up(n) for n in self.sizes()))


@gc_paused
def lower(fn: Function, topology: Topology, *, num_streams: int | None = None) -> Program:
    """Lowers ``fn`` on ``topology`` to a :class:`Program`.

    Args:
      fn: the program (types are inferred if missing).
      topology: the cluster; selects each collective's bottleneck link.
      num_streams: streams per device; defaults to the most any op uses.

    Returns:
      An unpadded Program; use :func:`pad_program` to fit a capacity.
    """
    if not isinstance(fn, Function):
        raise TypeError(f"lower takes a Function (FunctionBuilder.build), got {type(fn).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"lower takes a Topology (get_preset, ...), got {type(topology).__name__}")
    if any(v.type is None for op in fn.ops for v in op.outputs):
        fn = infer_types(fn)
    op_devices = [op.devices for op in fn.ops]
    used = {v.type.device for v in fn.inputs if v.type is not None}  # fn.devices, from op_devices
    for devices in op_devices:
        used.update(devices)
    topology.check_devices(tuple(sorted(used)), f"function {fn.name!r}")
    num_devices = topology.num_devices
    op_streams = [op.attr("stream", 0) for op in fn.ops]  # as Op.stream, checked
    for i, stream in enumerate(op_streams):  # a resource index: a float or -1 would alias another
        if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)) or stream < 0:
            raise ValueError(f"op {i} ({fn.ops[i].op_type}): stream must be an int >= 0, got {stream!r}")
    used_streams = 1 + max(op_streams, default=0)  # fn.num_streams
    streams = used_streams if num_streams is None else int(num_streams)
    if streams < used_streams:
        raise ValueError(f"num_streams={streams}, but function {fn.name!r} uses stream {used_streams - 1}")
    n = len(fn.ops)
    k = max([1] + [len(d) for d in op_devices])
    resources = []
    links = []
    is_comm = []
    columns = [[] for _ in COST_FEATURES]
    # Copies of an op (per microbatch, replica or repeated layer) share a group;
    # its check and link are pure functions of it, so each is computed once.
    link_cache: dict[tuple, tuple] = {}
    for i, op in enumerate(fn.ops):
        stream = op_streams[i]
        resources.append([d * streams + stream for d in op_devices[i]])
        f = op_features(op)
        is_comm.append(f.is_comm)
        values = f.cost_features()
        group = op.attr("group")  # op.comm_group, reusing op_devices
        group = tuple(int(d) for d in group) if group else op_devices[i]
        cached = link_cache.get(group)
        if cached is None:
            topology.check_devices(group, f"op #{i} {op.op_type}'s group")
            cached = link_cache[group] = topology.collective_link(group)
        link, channels = cached
        if channels != 1.0:  # rings side by side across nodes (Topology.ring_channels)
            values = dict(values, comm_volume=values["comm_volume"] / channels)
        for column, name in zip(columns, COST_FEATURES):
            column.append(values[name])
        links.append(link)
    resource = _padded_rows(resources, k, NO_RESOURCE)
    slot_device = _padded_rows(op_devices, k, NO_DEVICE)
    dep_slot, out_slot, num_slots = _finish_slots(fn, resources)
    alloc_bytes, free_bytes, resident = _memory_events(fn, op_devices, k, num_devices)
    resource_device = np.repeat(np.arange(num_devices, dtype=np.int32), streams)
    stacked = {name: _stack_variants(column) for name, column in zip(COST_FEATURES, columns)}
    resident_bytes = _stack_variants(resident)
    return Program(
        resource=resource,
        slot_device=slot_device,
        dep_slot=dep_slot,
        out_slot=out_slot,
        link=np.array(links, np.int32).reshape(n, 2),
        is_comm=np.array(is_comm, bool).reshape(n),
        resource_device=resource_device,
        num_ops=np.asarray(n, np.int32),
        alloc_bytes=alloc_bytes,
        free_bytes=free_bytes,
        resident_bytes=resident_bytes,
        peak_bytes=peak_memory(slot_device, alloc_bytes, free_bytes, resident_bytes),
        num_finish_slots=num_slots,
        **stacked,
    )


def _padded_rows(rows: Sequence[Sequence[int]], width: int, fill: int) -> np.ndarray:
    """``[len(rows), width]`` int32 rows, each padded with ``fill``."""
    flat = []
    for row in rows:
        flat.extend(row)
        flat.extend([fill] * (width - len(row)))
    return np.array(flat, np.int32).reshape(len(rows), width)


def _stack_variants(values) -> np.ndarray:
    """Stacks per-op numbers or ``[S]`` vectors of size variants into ``[N]``, or ``[S, N]``
    when any entry is a vector."""
    if not any(issubclass(t, np.ndarray) for t in set(map(type, values))):  # no array at all: quick
        return np.asarray(values, np.float64).reshape(len(values))
    vectors = [i for i, x in enumerate(values) if isinstance(x, np.ndarray) and x.ndim == 1]
    if not vectors:
        return np.asarray(values, np.float64).reshape(len(values))
    sizes = {values[i].shape[0] for i in vectors}
    if len(sizes) > 1:
        raise ValueError(f"size-variant dims disagree on the number of variants: {sorted(sizes)}")
    (s,) = sizes
    out = np.empty((s, len(values)), np.float64)
    is_vector = np.zeros(len(values), bool)
    is_vector[vectors] = True
    numbers = np.flatnonzero(~is_vector)
    out[:, numbers] = np.asarray([values[i] for i in numbers], np.float64).reshape(len(numbers))
    out[:, vectors] = np.stack([values[i] for i in vectors], axis=1)
    return out


def _finish_slots(fn: Function, resources: Sequence[Sequence[int]]):
    """Which dependencies the kernel must read, and where finish times live.

    A dependency on a single-resource op that ran on one of the consumer's own
    resources is implied by issue order there (that resource's clock is at
    least the producer's finish), so it is dropped. The remaining producers get
    a finish-time slot (:func:`allocate_finish_slots`), which keeps V, and the
    kernel's carry, small.

    Args:
      fn: the program.
      resources: per op, the resources it occupies (unpadded).
    """
    producer = fn.producers()
    single = [(row[0] if len(row) == 1 else None) for row in resources]
    deps: list[list[int]] = []
    for i, op in enumerate(fn.ops):
        mine = set(resources[i])
        needed = []
        for v in op.inputs:
            j = producer.get(v.name)
            if j is None or j in needed or (single[j] is not None and single[j] in mine):
                continue
            needed.append(j)
        deps.append(needed)
    return allocate_finish_slots(deps)


def allocate_finish_slots(deps: Sequence[Sequence[int]]):
    """Finish-time slots by linear scan: a slot is reused once its last reader ran.

    Args:
      deps: per op, the earlier ops whose finish it reads.

    Returns:
      ``(dep_slot [N, P], out_slot [N], num_slots)``.
    """
    n = len(deps)
    last_reader: dict[int, int] = {}
    for i, ds in enumerate(deps):
        for j in ds:
            last_reader[j] = i
    expiring: dict[int, list[int]] = {}
    for j, i in last_reader.items():
        expiring.setdefault(i, []).append(j)
    width = max([1] + [len(d) for d in deps])
    dep_rows = []
    out_slot = [NO_SLOT] * n
    slot_of: dict[int, int] = {}
    free: list[int] = []
    num_slots = 0
    for i in range(n):
        dep_rows.append([slot_of[j] for j in deps[i]])
        for j in expiring.get(i, ()):  # readers read before the op writes
            free.append(slot_of[j])
        if i in last_reader:
            if free:
                slot = free.pop()
            else:
                slot, num_slots = num_slots, num_slots + 1
            slot_of[i] = slot
            out_slot[i] = slot
    dep_slot = _padded_rows(dep_rows, width, NO_SLOT)
    return dep_slot, np.array(out_slot, np.int32).reshape(n), max(num_slots, 1)


def _memory_events(fn: Function, op_devices, k: int, num_devices: int):
    """Bytes allocated before and freed after each op on each slot's device, and resident bytes.

    Returns:
      ``(alloc_bytes, free_bytes, resident)``: ``[N, K]`` arrays (``[S, N, K]``
      when a counted buffer has size variants) and, per device, a number or an
      ``[S]`` vector.
    """
    buffer_of: dict[str, str] = {}
    size: dict[str, object] = {}
    device_of: dict[str, int] = {}
    pinned: set[str] = set()
    resident: list = [0.0] * num_devices
    for v in fn.inputs:
        buffer_of[v.name] = v.name
        size[v.name] = v.type.num_bytes
        device_of[v.name] = v.type.device
        pinned.add(v.name)
        resident[v.type.device] = resident[v.type.device] + v.type.num_bytes
    aliases_of: dict[str, dict[int, int]] = {}  # by op type, where attributes do not decide them
    for op in fn.ops:
        aliases = aliases_of.get(op.op_type)
        if aliases is None:
            spec = get_spec(op.op_type)
            aliases = output_aliases(spec, op.attr_dict, len(op.outputs))
            if not callable(spec.aliases):
                aliases_of[op.op_type] = aliases
        for o, v in enumerate(op.outputs):
            if o in aliases:
                root = buffer_of[op.inputs[aliases[o]].name]
                check_alias_fits(op, o, root, size[root])
                buffer_of[v.name] = root
            else:
                buffer_of[v.name] = v.name
                size[v.name] = v.type.num_bytes
                device_of[v.name] = v.type.device
    pinned.update(buffer_of[v.name] for v in fn.outputs)
    last_use: dict[str, int] = {}
    for i, op in enumerate(fn.ops):
        for v in op.inputs:
            last_use[buffer_of[v.name]] = i
        for v in op.outputs:
            last_use[buffer_of[v.name]] = i
    # Events (op, slot, buffer), in program order; a slot's bytes are their sum.
    alloc = []
    for i, op in enumerate(fn.ops):
        for v in op.outputs:
            if buffer_of[v.name] == v.name:
                alloc.append((i, op_devices[i].index(v.type.device), v.name))
    free = [(i, op_devices[i].index(device_of[buf]), buf) for buf, i in last_use.items() if buf not in pinned]
    n = len(fn.ops)
    return _event_bytes(alloc, size, n, k), _event_bytes(free, size, n, k), resident


def _event_bytes(events, size: dict, n: int, k: int) -> np.ndarray:
    """Sums each event's buffer size into its ``(op, slot)`` cell: ``[N, K]``, or ``[S, N, K]``
    when any of the sizes is a vector of size variants."""
    ops = np.array([e[0] for e in events], np.intp)
    slots = np.array([e[1] for e in events], np.intp)
    sizes = [size[e[2]] for e in events]
    vectors = [j for j, x in enumerate(sizes) if isinstance(x, np.ndarray)]
    if not vectors:
        out = np.zeros((n, k), np.float64)
        np.add.at(out, (ops, slots), np.array(sizes, np.float64).reshape(len(sizes)))
        return out
    lengths = {sizes[j].shape[0] for j in vectors}
    if len(lengths) > 1:
        raise ValueError(f"size-variant dims disagree on the number of variants: {sorted(lengths)}")
    (s,) = lengths
    values = np.empty((len(sizes), s), np.float64)
    for j, x in enumerate(sizes):
        values[j] = x
    out = np.zeros((n, k, s), np.float64)
    np.add.at(out, (ops, slots), values)
    return np.ascontiguousarray(out.transpose(2, 0, 1))


def peak_memory(slot_device, alloc_bytes, free_bytes, resident_bytes) -> np.ndarray:
    """Peak bytes per device, ``[..., D]``, from the program-order memory events.

    Per device, the live bytes before each of its ops are the resident bytes
    plus a running sum of earlier allocations minus frees; the peak is the
    largest live-plus-allocation. Vectorized over ops and size variants.
    """
    num_devices = resident_bytes.shape[-1]
    lead = np.broadcast_shapes(alloc_bytes.shape[:-2], free_bytes.shape[:-2], resident_bytes.shape[:-1])
    peak = np.broadcast_to(np.asarray(resident_bytes, np.float64), lead + (num_devices,)).copy()
    for d in range(num_devices):
        on_d = slot_device == d  # [N, K], ops in program order, row-major
        if not on_d.any():
            continue
        alloc = alloc_bytes[..., on_d]  # [..., E]
        delta = alloc - free_bytes[..., on_d]
        before = np.cumsum(delta, axis=-1) - delta  # exclusive running sum
        events = resident_bytes[..., d : d + 1] + before + alloc
        peak[..., d] = np.maximum(peak[..., d], events.max(axis=-1))
    return peak


def pad_program(program: Program, capacity: Capacity) -> Program:
    """Pads ``program`` to ``capacity``; padded ops cost nothing and touch nothing."""
    _check_program(program, "pad_program")
    if not isinstance(capacity, Capacity):
        raise TypeError(f"pad_program: capacity must be a Capacity, got {type(capacity).__name__}")
    have = program.capacity
    for name, want, got in zip(
        ("num_ops", "slots_per_op", "deps_per_op", "finish_slots", "num_devices", "num_resources"),
        capacity.sizes(),
        have.sizes(),
    ):
        if want < got:
            raise ValueError(f"capacity {name}={want} is smaller than the program's {got}")
    n, k, p = capacity.num_ops, capacity.slots_per_op, capacity.deps_per_op
    d, r = capacity.num_devices, capacity.num_resources
    return Program(
        resource=_pad(program.resource, (n, k), NO_RESOURCE),
        slot_device=_pad(program.slot_device, (n, k), NO_DEVICE),
        dep_slot=_pad(program.dep_slot, (n, p), NO_SLOT),
        out_slot=_pad(program.out_slot, (n,), NO_SLOT),
        link=_pad(program.link, (n, 2), 0),
        is_comm=_pad(program.is_comm, (n,), False),
        resource_device=_pad(program.resource_device, (r,), NO_DEVICE),
        num_ops=program.num_ops,
        **{name: _pad(getattr(program, name), (n,), 0.0) for name in COST_FEATURES},
        alloc_bytes=_pad(program.alloc_bytes, (n, k), 0.0),
        free_bytes=_pad(program.free_bytes, (n, k), 0.0),
        resident_bytes=_pad(program.resident_bytes, (d,), 0.0),
        peak_bytes=_pad(program.peak_bytes, (d,), 0.0),
        num_finish_slots=capacity.finish_slots,
    )


def _pad(x: np.ndarray, trailing: tuple, fill) -> np.ndarray:
    x = np.asarray(x)
    lead = x.ndim - len(trailing)
    widths = [(0, 0)] * lead + [(0, t - s) for s, t in zip(x.shape[lead:], trailing)]
    return np.pad(x, widths, constant_values=fill)


def stack_programs(programs: Sequence[Program], capacity: Capacity | None = None) -> Program:
    """Pads programs of different structure to one capacity and stacks them: ``[B, ...]``.

    Programs with size variants contribute one batch entry per variant.
    """
    if not programs:
        raise ValueError("stack_programs needs at least one program")
    for i, prog in enumerate(programs):
        _check_program(prog, f"stack_programs: program {i}")
    if capacity is None:
        capacity = programs[0].capacity
        for prog in programs[1:]:
            capacity = capacity.union(prog.capacity)
    padded = [pad_program(prog, capacity) for prog in programs]
    rows = []
    for prog in padded:
        variants = prog.flops.shape[0] if prog.flops.ndim == 2 else None
        rows.extend([prog] if variants is None else [_variant(prog, s) for s in range(variants)])
    fields = {
        f.name: np.stack([getattr(prog, f.name) for prog in rows])
        for f in dataclasses.fields(Program)
        if f.name != "num_finish_slots"
    }
    return Program(**fields, num_finish_slots=capacity.finish_slots)


def _variant(program: Program, s: int) -> Program:
    """Size variant ``s`` of a program with a leading variant axis on its features."""
    changes = {}
    for name in _FEATURE_FIELDS:
        x = getattr(program, name)
        base_rank = 2 if name in ("alloc_bytes", "free_bytes") else 1
        changes[name] = x[s] if x.ndim > base_rank else x
    return program.replace(**changes)


def _check_program(program, what: str) -> None:
    if not isinstance(program, Program):
        hint = " (lower it first)" if isinstance(program, Function) else ""
        raise TypeError(f"{what} must be a lowered Program{hint}, got {type(program).__name__}")
