"""The reference simulator: pure Python, float64, one op at a time.

It implements the simulation contract of DESIGN.md directly on an IR
:class:`~distir_jax.ir.Function`, with no arrays, padding or tricks, and is the
oracle the batched kernel is tested against.

Semantics:
  * A resource is a ``(device, stream)`` pair; an op occupies one resource on
    each of its devices, on its ``stream`` attribute (default 0).
  * Op i starts at the maximum of the finish times of the ops producing its
    operands and the times its resources become free. Resource r is then busy
    until ``start + cost[i, r]``; the op finishes at ``start + max_r cost[i, r]``.
  * Memory, per device, in program (issue) order: function inputs are resident
    from the start and never freed; each op allocates its outputs (an output
    that aliases an input, as in-place optimizer updates do, allocates
    nothing), the peak is recorded, then every buffer whose last use was this
    op is freed. Buffers held by function outputs are never freed; a result
    nobody uses is freed right after it is recorded.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import numpy as np

from distir_jax.cost import inverse_bandwidth, op_seconds
from distir_jax.ir.function import Function, Op
from distir_jax.ir.registry import check_alias_fits, get_spec, output_aliases
from distir_jax.ir.topology import Topology
from distir_jax.ir.typecheck import infer_types
from distir_jax.ir.types import has_variants

# costs[i][device] -> seconds the op occupies its resource on that device.
CostTable = list


@dataclasses.dataclass(frozen=True)
class ReferenceResult:
    """What the reference simulator returns (float64, seconds and bytes)."""

    step_time: float
    op_start: np.ndarray  # [N]
    op_finish: np.ndarray  # [N]
    busy_time: dict  # (device, stream) -> seconds busy
    peak_memory: dict  # device -> bytes


def op_costs(op: Op, topology: Topology) -> dict[int, float]:
    """Per-device cost of one op under the analytical model, in float64."""
    spec = get_spec(op.op_type)
    ins = tuple(v.type for v in op.inputs)
    outs = tuple(v.type for v in op.outputs)
    features = {k: float(v) for k, v in spec.features(op.attr_dict, ins, outs).cost_features().items()}
    (a, b), channels = _collective_link(topology, tuple(op.comm_group))
    features["comm_volume"] /= channels  # rings side by side across nodes
    return {
        d: float(
            op_seconds(
                np,
                features,
                1.0 / topology.peak_flops[d],
                1.0 / topology.memory_bandwidth[d],
                topology.launch_overhead,
                inverse_bandwidth(np, topology.link_bandwidth[a, b]),
                topology.link_latency[a, b],
            )
        )
        for d in op.devices
    }


# A program repeats a few groups: each one's link is found once.
_collective_link = functools.lru_cache(maxsize=4096)(Topology.collective_link)


def reference_simulate(
    fn: Function,
    topology: Topology | None = None,
    *,
    costs: CostTable | None = None,
    cost_fn: Callable[[Op, Topology], Mapping[int, float]] | None = None,
) -> ReferenceResult:
    """Simulates ``fn`` one op at a time.

    Args:
      fn: the program; typed or not (types are inferred).
      topology: the cluster, used by the analytical cost model.
      costs: optional explicit costs, ``costs[i][device]`` for every op ``i``
        and each of its devices; overrides the cost model.
      cost_fn: optional ``(op, topology) -> {device: seconds}``.

    Returns:
      A :class:`ReferenceResult`.
    """
    fn = _typed(fn)
    if costs is None and topology is None:
        raise ValueError("reference_simulate needs a topology or explicit costs")
    if topology is not None:
        topology.check_devices(fn.devices)
    cost_fn = cost_fn or op_costs
    producer = fn.producers()
    finish: list[float] = []
    start_times: list[float] = []
    clock: dict[tuple[int, int], float] = {}
    busy: dict[tuple[int, int], float] = {}
    if costs is not None and len(costs) != len(fn.ops):
        raise ValueError(f"costs must hold one entry per op, {len(fn.ops)} in all, got {len(costs)}")
    for i, op in enumerate(fn.ops):
        per_device = costs[i] if costs is not None else cost_fn(op, topology)
        resources = [(d, op.stream) for d in op.devices]
        start = 0.0
        for v in op.inputs:
            if v.name in producer:
                start = max(start, finish[producer[v.name]])
        for r in resources:
            start = max(start, clock.get(r, 0.0))
        longest = 0.0
        for r in resources:
            try:
                c = float(per_device[r[0]])
            except (KeyError, IndexError, TypeError, ValueError):
                c = None
            # Python's max() passes NaN over (max(0.0, nan) is 0.0): a bad cost must not vanish.
            if c is None or not c >= 0.0:
                raise ValueError(
                    f"op {i} ({op.op_type} -> {op.outputs[0].name if op.outputs else 'no result'}) on "
                    f"device {r[0]}: its cost must be a number >= 0, got {'none' if c is None else c}"
                )
            clock[r] = start + c
            busy[r] = busy.get(r, 0.0) + c
            longest = max(longest, c)
        start_times.append(start)
        finish.append(start + longest)
    step = max([0.0] + list(clock.values()))
    return ReferenceResult(
        step_time=step,
        op_start=np.asarray(start_times, np.float64),
        op_finish=np.asarray(finish, np.float64),
        busy_time=busy,
        peak_memory=reference_peak_memory(fn),
    )


def reference_peak_memory(fn: Function) -> dict[int, float]:
    """Peak bytes per device under the program-order memory model above."""
    fn = _typed(fn)
    buffer_of: dict[str, str] = {}  # value name -> owning buffer (alias root)
    size: dict[str, float] = {}
    device_of: dict[str, int] = {}
    pinned: set[str] = set()  # resident inputs and buffers held by outputs
    live: dict[int, float] = {d: 0.0 for d in fn.devices}
    for v in fn.inputs:
        buffer_of[v.name] = v.name
        size[v.name] = float(v.type.num_bytes)
        device_of[v.name] = v.type.device
        pinned.add(v.name)
        live[v.type.device] += size[v.name]
    for op in fn.ops:
        aliases = output_aliases(get_spec(op.op_type), op.attr_dict, len(op.outputs))
        for o, v in enumerate(op.outputs):
            if o in aliases:
                root = buffer_of[op.inputs[aliases[o]].name]
                check_alias_fits(op, o, root, size[root])
                buffer_of[v.name] = root
            else:
                buffer_of[v.name] = v.name
                size[v.name] = float(v.type.num_bytes)
                device_of[v.name] = v.type.device
    for v in fn.outputs:
        pinned.add(buffer_of[v.name])
    last_use: dict[str, int] = {}
    for i, op in enumerate(fn.ops):
        for v in op.inputs + op.outputs:
            last_use[buffer_of[v.name]] = i
    peak = dict(live)
    for i, op in enumerate(fn.ops):
        for v in op.outputs:
            if buffer_of[v.name] == v.name:
                live[v.type.device] += size[v.name]
        for d in op.devices:
            peak[d] = max(peak[d], live[d])
        for buf in {buffer_of[v.name] for v in op.inputs + op.outputs}:
            if last_use[buf] == i and buf not in pinned:
                live[device_of[buf]] -= size[buf]
    return peak


def _typed(fn: Function) -> Function:
    if any(v.type is None for op in fn.ops for v in op.outputs):
        fn = infer_types(fn)
    for v in fn.inputs:
        if has_variants(v.type.shape):
            raise ValueError(
                f"the reference simulator needs concrete sizes, but input %{v.name} has "
                f"size variants {v.type}; simulate one variant at a time"
            )
    return fn
