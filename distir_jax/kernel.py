"""The batched timeline kernel.

One ``lax.scan`` over ops. Its carry, a :class:`Timeline`, holds for all B
configurations at once the clock of every resource ``[R, B]``, the
finish-time slots ``[V, B]`` and busy times. :func:`simulate` runs a whole
program; sweeps instead call :func:`run_ops` on consecutive slices of ops,
carrying the timeline, then :func:`conclude`: one compiled kernel then serves
programs of every length. Peak memory follows program order and byte counts
only, so it is computed once at lowering, not here. Configurations sit on
the last axis so each step is a handful of small gathers and scatters over
the op's few resource slots, vectorized across B. The compiled kernel does not
grow with N (the scan body is the same for every op). With structure shared
by all configurations, costs are computed inside the step from the op's
features and the hardware, so no ``[N, K, B]`` cost table is ever built; with
a structure per configuration every op reads its own hardware rows, so
:func:`op_costs` costs all ops at once before the scan (or on the host, for
sweeps: :mod:`distir_jax.host_timeline` then runs the same step in NumPy).

Exact and smooth semantics share this code: with a ``temperature`` every max
of the timeline becomes ``temperature * logsumexp(x / temperature)``, which
converges to the exact max as the temperature goes to 0 and has useful
gradients for strategy search.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distir_jax.cost import COST_FEATURES, compute_seconds, inverse_bandwidth, op_seconds
from distir_jax.hardware import Hardware
from distir_jax.lower import Program

# Status codes, per configuration.
STATUS_OK = 0
STATUS_OUT_OF_MEMORY = 1
STATUS_INVALID = 2
STATUS_NAMES = {STATUS_OK: "ok", STATUS_OUT_OF_MEMORY: "out of memory", STATUS_INVALID: "invalid"}


class SimResult(NamedTuple):
    """Per-configuration results of :func:`simulate`, leading axis ``[B]``.

    Attributes:
      step_time: ``[B]`` seconds until the last op finishes.
      peak_memory: ``[B, D]`` peak bytes per device.
      busy_time: ``[B, R]`` seconds each resource is busy.
      status: ``[B]`` STATUS_OK, STATUS_OUT_OF_MEMORY or STATUS_INVALID.
      op_start: ``[B, N]`` start time of every op, if recorded, else None.
      op_finish: ``[B, N]`` finish time of every op, if recorded, else None.
      finish_slots: ``[B, V]`` the finish-time slots at the end: each slot
        holds the finish of the last op that wrote it (a program may give
        ops slots nobody reads, to learn when they finished without
        recording every op).
    """

    step_time: jax.Array
    peak_memory: jax.Array
    busy_time: jax.Array
    status: jax.Array
    op_start: jax.Array | None = None
    op_finish: jax.Array | None = None
    finish_slots: jax.Array | None = None


def _max(x, axis, temperature):
    if temperature is None:
        return jnp.max(x, axis=axis)
    return temperature * jax.nn.logsumexp(x / temperature, axis=axis)


def _max2(a, b, temperature):
    if temperature is None:
        return jnp.maximum(a, b)
    return temperature * jnp.logaddexp(a / temperature, b / temperature)


def _gather(table, idx):
    """Rows of ``table [X, Bt]`` at ``idx`` (``[K]`` shared or ``[K, B]`` per config)."""
    if idx.ndim == 1:
        return table[idx]
    if table.shape[1] == 1:
        return table[idx, 0]
    # One flat gather: XLA's CPU gather is much faster on a 1-D operand.
    b = table.shape[1]
    column = jnp.arange(b, dtype=idx.dtype).reshape((1,) * (idx.ndim - 1) + (b,))
    return jnp.take(table.reshape(-1), idx * b + column, axis=0)


def _gather_one(table, idx):
    """Row ``idx`` of ``table [X, Bt]``: ``[Bt]`` for a shared index, ``[B]`` per config."""
    if idx.ndim == 0:
        return table[idx]
    if table.shape[1] == 1:
        return table[idx, 0]
    return jnp.take_along_axis(table, idx[None, :], axis=0)[0]


def _scatter(table, idx, values, add=False):
    """Writes ``values [K, B]`` into rows ``idx``; out-of-range rows are dropped.

    An op's resources are distinct (lowering takes each device once), and
    rows past the end are moved to distinct places past the end, so every
    index is unique and the scatter says so. That matters for derivatives:
    JAX differentiates a scatter that may repeat an index by tagging every
    element of the table with an id, a table-sized scatter and gather per
    step (the Jacobian of a 33k-op, 8-row batch took 5.7 s instead of 0.3 s).
    """
    x = table.shape[0]
    # Slot k of a missing row goes to x + k: past the end, and apart from the others.
    slot = jnp.arange(idx.shape[0], dtype=idx.dtype).reshape((-1,) + (1,) * (idx.ndim - 1))
    kwargs = dict(mode="drop", unique_indices=True)
    if idx.ndim == 1:
        ref = table.at[jnp.where(idx < x, idx, x + slot)]
        return ref.add(values, **kwargs) if add else ref.set(values, **kwargs)
    # One flat scatter (see _gather); rows past the end stay past the end.
    b = table.shape[1]
    column = jnp.arange(b, dtype=idx.dtype).reshape((1,) * (idx.ndim - 1) + (b,))
    flat = (jnp.where(idx < x, idx, x + slot) * b + column).reshape(-1)
    values = jnp.broadcast_to(values, idx.shape).reshape(-1)
    ref = table.reshape(-1).at[flat]
    return (ref.add(values, **kwargs) if add else ref.set(values, **kwargs)).reshape(x, b)


def _configs_last(x, base_rank, xp=jnp):
    """``[B, *base]`` -> ``[*base, B]``; unbatched ``[*base]`` -> ``[*base, 1]``."""
    x = xp.asarray(x)
    if x.ndim == base_rank:
        return x[..., None]
    return xp.moveaxis(x, 0, -1)


def batch_size(program: Program, hardware: Hardware, costs=None) -> int:
    """The common batch size of a program, its hardware and optional costs."""
    sizes = set()
    for x, base in ((program.resource, 2), (program.flops, 1), (hardware.peak_flops, 1)):
        if np.ndim(x) == base + 1:
            sizes.add(int(np.shape(x)[0]))
    if costs is not None and np.ndim(costs) == 3:
        sizes.add(int(np.shape(costs)[0]))
    if len(sizes) > 1:
        raise ValueError(f"batch sizes of program, hardware and costs disagree: {sorted(sizes)}")
    return sizes.pop() if sizes else 1


class Timeline(NamedTuple):
    """The kernel's state between runs of ops, configurations last.

    A program may run as consecutive slices of its ops (:func:`run_ops`),
    each passing its timeline to the next: the result is the same as one run
    over all of them. Sweeps do that so one compiled kernel serves programs of
    every length.
    """

    clock: jax.Array  # [R, B] time each resource becomes free
    finish: jax.Array  # [V, B] finish-time slots
    busy: jax.Array  # [R, B] busy seconds
    compute: jax.Array | None = None  # [R, B] the compute part of busy, if tracked


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HardwareRows:
    """Every per-device and per-link number of a batch of hardware, as one table.

    Rows ``[1/peak_flops D | 1/memory_bandwidth D | 1/link_bandwidth D*D | latency D*D]``
    (speeds as seconds per flop / byte: reciprocals make the cost formula
    multiplies, which XLA fuses freely). ``table`` is ``[X, Bh]`` for programs
    whose structure all configurations share, ``[Bh, X]`` for per-configuration
    structure (see :func:`hardware_rows`).
    """

    table: jax.Array
    launch: jax.Array  # [Bh] seconds per kernel launch
    num_devices: int = dataclasses.field(metadata=dict(static=True))


def hardware_rows(hardware: Hardware, per_config_structure: bool, xp=jnp) -> HardwareRows:
    """The cost model's hardware numbers for :func:`run_ops` (computed once per batch;
    ``xp=numpy`` computes them on the host, in the kernel's float type)."""
    dtype = jnp.result_type(float)
    hw = jax.tree_util.tree_map(lambda x: xp.asarray(x, dtype), hardware)
    num_devices = hw.peak_flops.shape[-1]
    pairs = num_devices * num_devices
    last = functools.partial(_configs_last, xp=xp)
    table = xp.concatenate(
        [
            1.0 / last(hw.peak_flops, 1),
            1.0 / last(hw.memory_bandwidth, 1),
            inverse_bandwidth(xp, last(hw.link_bandwidth, 2).reshape(pairs, -1)),
            last(hw.link_latency, 2).reshape(pairs, -1),
        ]
    )  # [2D + 2D^2, Bh]
    # Per-configuration structure reads rows along each configuration's own
    # axis (CPU gathers along the last axis are ~5x cheaper than across configurations).
    launch = last(hw.launch_overhead, 0)
    return HardwareRows(table.T if per_config_structure else table, launch, num_devices)


def op_speeds(program: Program, rows: HardwareRows, xp=jnp) -> tuple:
    """``op_seconds``' hardware arguments for every op of per-configuration
    structure ``[B, N]``: the op's first device's speeds and its link's."""
    d = rows.num_devices
    first_device = xp.maximum(program.slot_device[..., 0], 0)  # [B, N]
    pair_rows = program.link[..., 0] * d + program.link[..., 1] + 2 * d
    table = rows.table  # [Bh, X]

    def read(where):
        if table.shape[0] == 1:
            return table[0][where]
        return xp.take_along_axis(table, where, axis=1)

    return (
        read(first_device),
        read(first_device + d),
        xp.reshape(rows.launch, (-1, 1)),
        read(pair_rows),
        read(pair_rows + d * d),
    )


class OpCosts(NamedTuple):
    """Every op's seconds, computed before the timeline runs (per-configuration
    structure), ``[N, B]`` each: configurations last, like the timeline.

    Attributes:
      seconds: how long the op occupies each of its resources.
      busy: what it adds to each resource's busy total (``seconds`` times
        the op's weight, see :func:`run_ops`).
      compute: the compute part of ``busy``, or None when not tracked.
    """

    seconds: jax.Array
    busy: jax.Array
    compute: jax.Array | None = None


def op_costs(
    program: Program,
    rows: HardwareRows,
    weights=None,
    *,
    split_compute: bool = False,
    temperature: float | None = None,
    xp=jnp,
) -> OpCosts:
    """The cost model applied to every op of per-configuration structure ``[B, N]``
    at once (``weights``: ``[B, N]``, as in :func:`run_ops`).

    :func:`run_ops` calls it before its scan; a sweep calls it on the host
    (``xp=numpy``, exact semantics) and passes the result to :func:`run_ops`
    or :func:`~distir_jax.host_timeline.run_ops_host`, which then only add,
    compare and move clocks: the two give the same timeline, bit for bit.
    """
    if xp is not jnp and temperature is not None:
        raise ValueError("smooth (temperature) costs are computed inside jax only")
    dtype = jnp.result_type(float)
    shape = program.resource.shape[:2]
    features = {
        name: xp.broadcast_to(xp.asarray(getattr(program, name), dtype), shape) for name in COST_FEATURES
    }
    speeds = op_speeds(program, rows, xp)
    maximum = None if temperature is None else (lambda a, c: _max2(a, c, temperature))
    seconds = xp.broadcast_to(op_seconds(xp, features, *speeds, maximum), shape)
    weight = 1.0 if weights is None else xp.broadcast_to(xp.asarray(weights, dtype), shape)
    compute = None
    if split_compute:
        compute = xp.broadcast_to(compute_seconds(xp, features, *speeds[:3], maximum), shape)
        compute = (compute * weight).T
    return OpCosts(seconds.T, (seconds * weight).T, compute)


def start_timeline(
    num_resources: int, num_slots: int, batch: int, *, split_compute: bool = False, xp=jnp
) -> Timeline:
    """All clocks, finish slots and busy times at zero, for :func:`run_ops`.

    ``split_compute``: also track how much of each resource's busy time is the
    cost model's compute part (the rest is communication).
    """
    dtype = jnp.result_type(float)
    zeros = lambda n: xp.zeros((n, batch), dtype)  # noqa: E731
    compute = zeros(num_resources) if split_compute else None
    return Timeline(zeros(num_resources), zeros(num_slots), zeros(num_resources), compute)


@functools.partial(jax.jit, static_argnames=("temperature", "record_ops"))
def simulate(
    program: Program,
    hardware: Hardware,
    costs: jax.Array | None = None,
    valid: jax.Array | None = None,
    *,
    temperature: float | None = None,
    record_ops: bool = False,
) -> SimResult:
    """Simulates a batch of configurations in one call.

    Any of ``program`` (structure ``[B, N, K]`` or features ``[B, N]``),
    ``hardware`` (``[B, D]``) and ``costs`` may carry a leading batch axis; the
    others are shared.

    Args:
      program: a lowered (and padded) :class:`Program`.
      hardware: device and link parameters, ``D`` matching the program.
      costs: optional explicit seconds per op slot, ``[N, K]`` or ``[B, N, K]``,
        replacing the analytical cost model.
      valid: optional ``[B]`` bools; False marks a configuration invalid.
      temperature: None for exact semantics, or a positive smoothing scale in
        seconds (and bytes, for peak memory) for differentiable search.
      record_ops: also return every op's start and finish times.

    Returns:
      A :class:`SimResult` with leading axis ``[B]``.
    """
    _check(program, hardware, temperature, costs, valid)
    rows = hardware_rows(hardware, np.ndim(program.resource) == 3)
    num_resources = program.resource_device.shape[-1]
    state = start_timeline(num_resources, program.num_finish_slots, batch_size(program, hardware, costs))
    state, per_op = run_ops(state, program, rows, costs, temperature=temperature, record_ops=record_ops)
    result = conclude(state, program.peak_bytes, hardware, valid, temperature=temperature)
    if record_ops:
        result = result._replace(op_start=per_op[0].T, op_finish=per_op[1].T)
    return result


def _check(program: Program, hardware: Hardware, temperature, costs=None, valid=None) -> None:
    """Shapes, at trace time: a mismatch found inside the scan names no argument."""
    # (A program or hardware of another type never gets here: jit names its argument.)
    if temperature is not None and not temperature > 0:
        raise ValueError(f"temperature must be None or > 0, got {temperature}")
    num_devices = program.resident_bytes.shape[-1]
    if np.shape(hardware.peak_flops)[-1:] != (num_devices,):
        raise ValueError(
            f"hardware has {np.shape(hardware.peak_flops)[-1:]} devices but the program is padded to "
            f"{num_devices}; use pad_hardware"
        )
    batch = tuple(np.shape(hardware.peak_flops)[:-1])
    expected = {
        "memory_bandwidth": batch + (num_devices,),
        "memory_capacity": batch + (num_devices,),
        "link_bandwidth": batch + (num_devices, num_devices),
        "link_latency": batch + (num_devices, num_devices),
    }
    for name, shape in expected.items():
        if tuple(np.shape(getattr(hardware, name))) != shape:
            raise ValueError(
                f"hardware.{name} must have shape {list(shape)} (as peak_flops: {list(batch)} "
                f"configurations, {num_devices} devices), got {list(np.shape(getattr(hardware, name)))}"
            )
    if tuple(np.shape(hardware.launch_overhead)) not in ((), batch):
        got = list(np.shape(hardware.launch_overhead))
        raise ValueError(f"hardware.launch_overhead must be a number or {list(batch)}, got {got}")
    ops = tuple(np.shape(program.resource)[-2:])  # [N, K]
    if costs is not None and (np.ndim(costs) not in (2, 3) or tuple(np.shape(costs)[-2:]) != ops):
        raise ValueError(
            f"costs must be [N, K] = {list(ops)} or [B, N, K] seconds, got {list(np.shape(costs))}"
        )
    if valid is not None:
        size = batch_size(program, hardware, costs)
        if tuple(np.shape(valid)) != (size,):
            raise ValueError(
                f"valid must be [B] = [{size}] bools, one per configuration, got {list(np.shape(valid))}"
            )


def run_ops(
    state: Timeline,
    program: Program,
    rows: HardwareRows | None,
    costs: jax.Array | None = None,
    weights: jax.Array | None = None,
    *,
    precomputed: OpCosts | None = None,
    temperature: float | None = None,
    record_ops: bool = False,
) -> tuple[Timeline, tuple | None]:
    """Runs the program's ops, in order, from ``state``: the timeline after them,
    and (with ``record_ops``) each op's ``(start, finish)``, ``[N, B]`` each.

    ``program``'s op arrays may be any slice of a program's ops; its per-device
    arrays are not read. ``rows`` is :func:`hardware_rows` of the batch's
    hardware, with ``per_config_structure`` as the program's structure.
    ``weights`` (``[N]`` or ``[B, N]``) count each op's seconds that many times
    in the busy (and compute) totals, not in the clocks: an op that stands for
    several runs of itself (see :mod:`distir_jax.transforms.coarse_steady`).
    ``precomputed``: the ops' :func:`op_costs`, computed beforehand (then
    ``rows`` and ``weights`` are not read and may be None, and of ``program``
    only ``resource``, ``dep_slot``, ``out_slot`` and ``resource_device``).
    """
    split_compute = state.compute is not None
    if split_compute and costs is not None:
        raise ValueError("split_compute needs the cost model's compute part; explicit costs have none")
    num_resources = program.resource_device.shape[-1]
    b = state.clock.shape[1]
    dtype = state.clock.dtype

    shared = np.ndim(program.resource) == 2
    res, dep, out = program.resource, program.dep_slot, program.out_slot
    if not shared:  # per-config structure: ops first, configs last
        res, dep, out = (jnp.moveaxis(x, 0, -1) for x in (res, dep, out))
    num_slots = state.finish.shape[0]
    xs = dict(
        res_get=jnp.maximum(res, 0),
        res_set=jnp.where(res < 0, num_resources, res),
        slot_ok=(res >= 0),
        dep_get=jnp.maximum(dep, 0),
        dep_ok=(dep >= 0),
        out_set=jnp.where(out < 0, num_slots, out),
    )
    # Per-config structure: every op reads its own hardware rows, so every op is
    # costed before the scan (op_costs) and the scan step only moves clocks.
    if precomputed is None and not shared and costs is None:
        precomputed = op_costs(program, rows, weights, split_compute=split_compute, temperature=temperature)
    if precomputed is not None:
        if shared or costs is not None:
            raise ValueError("precomputed op costs need per-configuration structure and no explicit costs")
        if split_compute and precomputed.compute is None:
            raise ValueError("this timeline tracks the compute part: precompute it (split_compute=True)")
        xs.update(seconds=precomputed.seconds, charged=precomputed.busy)
        if split_compute:
            xs["charged_compute"] = precomputed.compute
    else:
        xs.update({name: _configs_last(getattr(program, name), 1).astype(dtype) for name in COST_FEATURES})
    if costs is not None:
        xs["costs"] = _configs_last(costs, 2).astype(dtype)
    if weights is not None and precomputed is None:
        xs["weight"] = _configs_last(weights, 1).astype(dtype)
    # An op reads four rows of the table, each by a scalar index (a dynamic
    # slice: on CPU that is much cheaper per step than one vector-indexed
    # gather of four).
    if costs is None and precomputed is None:  # shared structure
        num_devices = rows.num_devices
        pairs = num_devices * num_devices
        device = jnp.maximum(program.slot_device[:, 0], 0)
        pair = program.link[:, 0] * num_devices + program.link[:, 1]
        xs["hw_rows"] = jnp.stack(
            [device, device + num_devices, pair + 2 * num_devices, pair + 2 * num_devices + pairs], axis=1
        ).astype(jnp.int32)  # [N, 4]
    maximum = None if temperature is None else (lambda a, c: _max2(a, c, temperature))

    def op_cost(x):
        """Seconds the op occupies each of its resources: ``[K, B]``, or ``[B]``
        when the cost model makes it the same on every resource (compute ops
        run on one device; a collective costs its bottleneck on every member);
        and with ``split_compute``, the compute part ``[B]``."""
        if "costs" in x:
            return jnp.broadcast_to(x["costs"], (x["costs"].shape[0], b)), None
        if "seconds" in x:
            return x["seconds"], None
        speeds = [_gather_one(rows.table, row) for row in x["hw_rows"]]
        speeds.insert(2, rows.launch)  # [Bh]
        seconds = jnp.broadcast_to(op_seconds(jnp, x, *speeds, maximum), (b,))
        if not split_compute:
            return seconds, None
        return seconds, jnp.broadcast_to(compute_seconds(jnp, x, *speeds[:3], maximum), (b,))

    def step(carry: Timeline, x):
        slot_ok = x["slot_ok"] if x["slot_ok"].ndim == 2 else x["slot_ok"][:, None]
        dep_ok = x["dep_ok"] if x["dep_ok"].ndim == 2 else x["dep_ok"][:, None]
        low = jnp.asarray(0.0 if temperature is None else -1e30, dtype)
        clocks = jnp.where(slot_ok, _gather(carry.clock, x["res_get"]), low)
        ready = jnp.where(dep_ok, _gather(carry.finish, x["dep_get"]), low)
        start = _max(jnp.concatenate([clocks, ready, jnp.zeros((1, b), dtype)]), 0, temperature)
        op_seconds, compute_seconds = op_cost(x)
        if op_seconds.ndim == 1:  # the same on every resource
            cost = jnp.where(slot_ok, op_seconds[None, :], 0.0)
            fin = start + op_seconds
        else:
            cost = jnp.where(slot_ok, op_seconds, 0.0)  # [K, B]
            fin = start + _max(jnp.where(slot_ok, cost, low), 0, temperature)
        clock = _scatter(carry.clock, x["res_set"], start[None, :] + cost)
        out = x["out_set"][None] if x["out_set"].ndim == 0 else x["out_set"][None, :]
        finish = _scatter(carry.finish, out, fin[None, :])
        # Missing slots write past the end (dropped): what they add does not matter.
        weight = x["weight"][None, :] if "weight" in x else 1.0
        charged = x["charged"][None, :] if "charged" in x else cost * weight
        busy = _scatter(carry.busy, x["res_set"], charged, add=True)
        compute = None
        if split_compute:
            if "charged_compute" in x:
                charged = x["charged_compute"][None, :]
            else:
                charged = jnp.where(slot_ok, compute_seconds[None, :], 0.0) * weight
            compute = _scatter(carry.compute, x["res_set"], charged, add=True)
        new = Timeline(clock, finish, busy, compute)
        return new, ((start, fin) if record_ops else None)

    return jax.lax.scan(step, state, xs)


def conclude(
    state: Timeline,
    peak_bytes: jax.Array,
    hardware: Hardware,
    valid: jax.Array | None = None,
    *,
    temperature: float | None = None,
    xp=jnp,
) -> SimResult:
    """The results once every op has run: step time, busy time, peak memory
    (``peak_bytes``, ``[D]`` or ``[B, D]``: the program's, computed at lowering)
    and status. ``xp=numpy`` concludes on the host (exact semantics only)."""
    if xp is not jnp and temperature is not None:
        raise ValueError("a smooth (temperature) timeline concludes inside jax only")
    num_devices = peak_bytes.shape[-1]
    b = state.clock.shape[1]
    dtype = state.clock.dtype
    step_time = _max(state.clock, 0, temperature) if xp is jnp else xp.max(state.clock, axis=0)
    capacity = _configs_last(xp.asarray(hardware.memory_capacity, dtype), 1, xp)
    capacity = xp.broadcast_to(capacity, (num_devices, b))
    peak = xp.broadcast_to(_configs_last(peak_bytes, 1, xp).astype(dtype), (num_devices, b))
    status = status_codes(step_time, peak, capacity, valid, xp=xp)
    return SimResult(step_time, peak.T, state.busy.T, status, finish_slots=state.finish.T)


def status_codes(step_time, peak, capacity, valid=None, *, xp=jnp):
    """``[B]`` status per configuration from its step time ``[B]`` and its
    devices' peak bytes and capacities (``[D, B]`` each, configurations last):
    invalid if anything is not finite or ``valid`` (``[B]``) says so, out of
    memory if a device's peak exceeds its capacity, else ok."""
    oom = xp.any(peak > capacity, axis=0)
    ok = xp.isfinite(step_time) & xp.all(xp.isfinite(peak), axis=0)
    if valid is not None:
        ok = ok & xp.broadcast_to(xp.asarray(valid, bool), ok.shape)
    return xp.where(ok, xp.where(oom, STATUS_OUT_OF_MEMORY, STATUS_OK), STATUS_INVALID).astype(xp.int32)
