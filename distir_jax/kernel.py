"""The batched timeline kernel.

One ``lax.scan`` over ops. Its carry holds, for all B configurations at once,
the clock of every resource ``[R, B]``, the finish-time slots ``[V, B]``, and
the live and peak memory of every device ``[D, B]``. Configurations sit on
the last axis so each step is a handful of small gathers and scatters over
the op's few resource slots, vectorized across B. The compiled kernel does not
grow with N (the scan body is the same for every op), and costs are computed
inside the step from the op's features and the hardware, so no ``[N, K, B]``
cost table is ever built.

Exact and smooth semantics share this code: with a ``temperature`` every max
of the timeline becomes ``temperature * logsumexp(x / temperature)``, which
converges to the exact max as the temperature goes to 0 and has useful
gradients for strategy search.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distir_jax.cost import COST_FEATURES, inverse_bandwidth, op_seconds
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


class _Carry(NamedTuple):
    clock: jax.Array  # [R, B] time each resource becomes free
    finish: jax.Array  # [V, B] finish times still to be read
    busy: jax.Array  # [R, B] busy seconds


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
    """Writes ``values [K, B]`` into rows ``idx``; out-of-range rows are dropped."""
    if idx.ndim == 1:
        ref = table.at[idx]
        return ref.add(values, mode="drop") if add else ref.set(values, mode="drop")
    # One flat scatter (see _gather); rows past the end stay past the end.
    x, b = table.shape
    column = jnp.arange(b, dtype=idx.dtype).reshape((1,) * (idx.ndim - 1) + (b,))
    flat = jnp.where(idx < x, idx * b + column, x * b).reshape(-1)
    values = jnp.broadcast_to(values, idx.shape).reshape(-1)
    ref = table.reshape(-1).at[flat]
    return (ref.add(values, mode="drop") if add else ref.set(values, mode="drop")).reshape(x, b)


def _configs_last(x, base_rank):
    """``[B, *base]`` -> ``[*base, B]``; unbatched ``[*base]`` -> ``[*base, 1]``."""
    x = jnp.asarray(x)
    if x.ndim == base_rank:
        return x[..., None]
    return jnp.moveaxis(x, 0, -1)


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
    if temperature is not None and not temperature > 0:
        raise ValueError(f"temperature must be None or > 0, got {temperature}")
    num_resources = program.resource_device.shape[-1]
    num_devices = program.resident_bytes.shape[-1]
    if hardware.peak_flops.shape[-1] != num_devices:
        raise ValueError(
            f"hardware has {hardware.peak_flops.shape[-1]} devices but the program is padded to "
            f"{num_devices}; use pad_hardware"
        )
    b = batch_size(program, hardware, costs)
    dtype = jnp.result_type(float)

    shared = np.ndim(program.resource) == 2
    if shared:
        res, dev, dep = program.resource, program.slot_device, program.dep_slot
        out, link = program.out_slot, program.link
    else:  # per-config structure: ops first, configs last
        res, dev, dep = (
            jnp.moveaxis(x, 0, -1) for x in (program.resource, program.slot_device, program.dep_slot)
        )
        out = jnp.moveaxis(program.out_slot, 0, -1)
        link = jnp.moveaxis(program.link, 0, -1)
    num_slots = program.num_finish_slots
    xs = dict(
        res_get=jnp.maximum(res, 0),
        res_set=jnp.where(res < 0, num_resources, res),
        slot_ok=(res >= 0),
        dep_get=jnp.maximum(dep, 0),
        dep_ok=(dep >= 0),
        out_set=jnp.where(out < 0, num_slots, out),
    )
    # Per-config structure: every op reads its own hardware rows, so every op is
    # costed before the scan (below) and the scan step only moves clocks.
    precost = not shared and costs is None
    if not precost:
        xs.update({name: _configs_last(getattr(program, name), 1).astype(dtype) for name in COST_FEATURES})
    if costs is not None:
        xs["costs"] = _configs_last(costs, 2).astype(dtype)
    hw = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), hardware)
    # Every per-device and per-link number in one table of rows
    # [1/peak_flops D | 1/memory_bandwidth D | 1/link_bandwidth D*D | latency D*D];
    # an op reads four rows, each by a scalar index (a dynamic slice: on CPU
    # that is much cheaper per step than one vector-indexed gather of four).
    # Reciprocals make the cost formula multiplies, which XLA fuses freely.
    pairs = num_devices * num_devices
    hw_table = jnp.concatenate(
        [
            1.0 / _configs_last(hw.peak_flops, 1),
            1.0 / _configs_last(hw.memory_bandwidth, 1),
            inverse_bandwidth(jnp, _configs_last(hw.link_bandwidth, 2).reshape(pairs, -1)),
            _configs_last(hw.link_latency, 2).reshape(pairs, -1),
        ]
    )  # [2D + 2D^2, Bh], speeds as seconds per flop / byte
    if costs is None and not precost:
        device = jnp.maximum(dev[:, 0], 0)
        pair = link[:, 0] * num_devices + link[:, 1]
        xs["hw_rows"] = jnp.stack(
            [device, device + num_devices, pair + 2 * num_devices, pair + 2 * num_devices + pairs], axis=1
        ).astype(jnp.int32)  # [N, 4]
    launch = _configs_last(hw.launch_overhead, 0)  # [Bh]
    maximum = None if temperature is None else (lambda a, c: _max2(a, c, temperature))

    def op_cost(x):
        """Seconds the op occupies each of its resources: ``[K, B]``, or ``[B]``
        when the cost model makes it the same on every resource (compute ops
        run on one device; a collective costs its bottleneck on every member)."""
        if "costs" in x:
            return jnp.broadcast_to(x["costs"], (x["costs"].shape[0], b))
        if "seconds" in x:
            return x["seconds"]
        per_flop, per_byte, per_link_byte, link_lat = (_gather_one(hw_table, row) for row in x["hw_rows"])
        seconds = op_seconds(
            jnp,
            x,
            per_flop,
            per_byte,
            launch,
            per_link_byte,
            link_lat,
            maximum,
        )
        return jnp.broadcast_to(seconds, (b,))

    if precost:
        # The reads are row gathers in the programs' own [B, N] layout (CPU
        # gathers along the last axis are ~5x cheaper than across
        # configurations), transposed once at the end.
        table = hw_table.T  # [Bh, X]
        first_device = jnp.maximum(program.slot_device[..., 0], 0)  # [B, N]
        pair_rows = program.link[..., 0] * num_devices + program.link[..., 1] + 2 * num_devices

        def read(rows):
            if table.shape[0] == 1:
                return table[0][rows]
            return jnp.take_along_axis(table, rows, axis=1)

        features = {
            name: jnp.broadcast_to(jnp.asarray(getattr(program, name), dtype), first_device.shape)
            for name in COST_FEATURES
        }
        seconds = op_seconds(
            jnp,
            features,
            read(first_device),
            read(first_device + num_devices),
            jnp.reshape(launch, (-1, 1)),
            read(pair_rows),
            read(pair_rows + pairs),
            maximum,
        )
        xs["seconds"] = jnp.broadcast_to(seconds, first_device.shape).T  # [N, B]

    def step(carry: _Carry, x):
        slot_ok = x["slot_ok"] if x["slot_ok"].ndim == 2 else x["slot_ok"][:, None]
        dep_ok = x["dep_ok"] if x["dep_ok"].ndim == 2 else x["dep_ok"][:, None]
        low = jnp.asarray(0.0 if temperature is None else -1e30, dtype)
        clocks = jnp.where(slot_ok, _gather(carry.clock, x["res_get"]), low)
        ready = jnp.where(dep_ok, _gather(carry.finish, x["dep_get"]), low)
        start = _max(jnp.concatenate([clocks, ready, jnp.zeros((1, b), dtype)]), 0, temperature)
        op_seconds = op_cost(x)
        if op_seconds.ndim == 1:  # the same on every resource
            cost = jnp.where(slot_ok, op_seconds[None, :], 0.0)
            fin = start + op_seconds
        else:
            cost = jnp.where(slot_ok, op_seconds, 0.0)  # [K, B]
            fin = start + _max(jnp.where(slot_ok, cost, low), 0, temperature)
        clock = _scatter(carry.clock, x["res_set"], start[None, :] + cost)
        out = x["out_set"][None] if x["out_set"].ndim == 0 else x["out_set"][None, :]
        finish = _scatter(carry.finish, out, fin[None, :])
        busy = _scatter(carry.busy, x["res_set"], cost, add=True)
        new = _Carry(clock, finish, busy)
        return new, ((start, fin) if record_ops else None)

    init = _Carry(
        clock=jnp.zeros((num_resources, b), dtype),
        finish=jnp.zeros((num_slots, b), dtype),
        busy=jnp.zeros((num_resources, b), dtype),
    )
    final, per_op = jax.lax.scan(step, init, xs)
    step_time = _max(final.clock, 0, temperature)
    capacity = jnp.broadcast_to(_configs_last(hw.memory_capacity, 1), (num_devices, b))
    peak = jnp.broadcast_to(_configs_last(program.peak_bytes, 1).astype(dtype), (num_devices, b))
    oom = jnp.any(peak > capacity, axis=0)
    ok = jnp.isfinite(step_time) & jnp.all(jnp.isfinite(peak), axis=0)
    if valid is not None:
        ok = ok & jnp.broadcast_to(jnp.asarray(valid, bool), (b,))
    status = jnp.where(ok, jnp.where(oom, STATUS_OUT_OF_MEMORY, STATUS_OK), STATUS_INVALID).astype(jnp.int32)
    op_start = op_finish = None
    if record_ops:
        op_start, op_finish = per_op[0].T, per_op[1].T
    return SimResult(step_time, peak.T, final.busy.T, status, op_start, op_finish, final.finish.T)
