"""Coarsening: fuse groups of consecutive ops on one resource into single ops.

:func:`coarsen` works on lowered :class:`~distir_jax.lower.Program` arrays
(a :class:`~distir_jax.ir.Function` is lowered first). The caller labels every
op; ops with the same label that follow each other on the same resources (no
other op on those resources in between) become one op:

* **Cost.** A fused op's seconds are the sum of its members' seconds on the
  given topology. The roofline ``max(flops / peak, bytes / bandwidth)`` does
  not add up, so each member's roofline is split, on the topology's speeds,
  into ``linear_flops`` (compute-bound members) or ``linear_bytes``
  (memory-bound members), whose times add. This is exact on that topology;
  on other hardware it is the fused-kernel approximation (a member that is
  memory-bound there is still costed by its flops). Launches and
  communication volumes and hops add too; all communicating members of a
  group must share one bottleneck link, which becomes the fused op's link.
* **Timeline.** The fused op waits for every input of its members before it
  starts (dependencies that issue order implies under the analytic cost model
  are dropped, see :func:`prune_implied`). That equals the members' timeline whenever no member waits for an
  input that arrives while an earlier member runs (true for pipeline steps,
  whose messages occupy the receiving device before the step starts).
* **Memory.** Per device, the fused op allocates the members' peak rise
  ``A = max_j (sum_{i<j} (alloc_i - free_i) + alloc_j)`` and frees
  ``A - sum (alloc_i - free_i)``: the live bytes after the op and the peak
  during it are the members' own, so peak memory is kept whenever no other
  op touching the device sits between the group's members.

Fused ops are issued in a topological order of the groups that keeps every
resource's order and otherwise follows each group's first member.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from typing import Union

import numpy as np

from distir_jax.cost import COST_FEATURES
from distir_jax.ir.function import Function
from distir_jax.ir.topology import Topology
from distir_jax.lower import NO_SLOT, Program, allocate_finish_slots, lower, peak_memory
from distir_jax.transforms.base import Distributed

__all__ = ["allocate_finish_slots", "coarsen", "fuse_groups", "prune_implied", "roofline_terms"]

_LINEAR = ("launches", "linear_flops", "linear_bytes", "comm_volume", "comm_hops")


def roofline_terms(flops, mem_bytes, per_flop, per_byte):
    """An op's roofline ``max(flops * per_flop, bytes * per_byte)`` as linear terms:
    ``(linear_flops, linear_bytes)``, only the bound one nonzero. Exact on the
    device whose speeds are given, and additive, so fused ops sum their terms."""
    compute_bound = flops * per_flop >= mem_bytes * per_byte
    return np.where(compute_bound, flops, 0.0), np.where(compute_bound, 0.0, mem_bytes)


_COMM = ("comm_volume", "comm_hops")


def coarsen(
    program: Union[Function, Distributed, Program],
    group_of_op: Union[Callable, Sequence[Hashable]],
    topology: Topology,
    *,
    num_streams: int | None = None,
) -> Program:
    """Fuses labelled runs of ops into single ops.

    Args:
      program: a function (lowered here on ``topology``), a transform's
        result, or an unpadded, unbatched lowered program (features may carry
        a leading size-variant axis).
      group_of_op: a label per op (any hashable; ``None`` keeps the op on its
        own): a sequence, or a callable taking the :class:`Op` (for a
        function) or the op index (for a program).
      topology: the cluster whose speeds split each roofline into linear terms.
      num_streams: streams per device when lowering a function.

    Returns:
      The coarse program, with peak memory recomputed from its events.

    Raises:
      ValueError: when the labels do not make one op per label and resource
        set fusible: communicating members on different links, or groups that
        depend on each other both ways.
    """
    if isinstance(program, Distributed):
        program = program.function
    if isinstance(program, Function):
        labels = list(group_of_op) if not callable(group_of_op) else [group_of_op(op) for op in program.ops]
        program = lower(program, topology, num_streams=num_streams)
    else:
        n = int(program.num_ops)
        labels = list(group_of_op) if not callable(group_of_op) else [group_of_op(i) for i in range(n)]
    return fuse_groups(program, labels, topology)[0]


def fuse_groups(program: Program, labels: Sequence[Hashable], topology: Topology):
    """:func:`coarsen` on a lowered program with one label per op.

    Returns:
      ``(coarse program, group)``: ``group[i]`` is the index of the fused op
      that holds op ``i``.
    """
    if np.ndim(program.resource) != 2:
        raise ValueError("coarsen takes one program, not a stacked batch of programs")
    n = int(program.num_ops)
    if len(labels) != n:
        raise ValueError(f"group_of_op gave {len(labels)} labels for {n} ops")
    resource = np.asarray(program.resource)[:n]
    groups, group_of, resources = _groups(resource, labels)
    deps = _explicit_deps(np.asarray(program.dep_slot)[:n], np.asarray(program.out_slot)[:n])
    order = _topological_order(groups, group_of, resources, deps)
    rank = np.empty(len(groups), np.int64)
    rank[order] = np.arange(len(groups))
    group_deps = []
    for g in order:
        found: dict[int, None] = {}
        for i in groups[g]:
            for j in deps[i]:
                if group_of[j] != g:
                    found[int(rank[group_of[j]])] = None
        group_deps.append(list(found))
    new_resources = [resources[g] for g in order]
    kept = prune_implied(group_deps, new_resources)
    dep_slot, out_slot, num_slots = allocate_finish_slots(kept)
    member_group = rank[group_of]  # op -> new index
    coarse = _fused_program(program, topology, n, groups, order, member_group, dep_slot, out_slot, num_slots)
    return coarse, member_group


def _groups(resource: np.ndarray, labels):
    """Groups of consecutive same-label ops on the same resources."""
    groups: list[list[int]] = []
    resources: list[tuple[int, ...]] = []
    group_of = np.empty(len(labels), np.int64)
    open_: dict = {}
    last_on: dict[int, int] = {}
    for i, label in enumerate(labels):
        rs = tuple(int(r) for r in resource[i] if r >= 0)
        g = None
        if label is not None:
            key = (label, tuple(sorted(rs)))
            candidate = open_.get(key)
            if candidate is not None and all(last_on.get(r) == candidate for r in rs):
                g = candidate
            else:
                open_[key] = len(groups)
        if g is None:
            g = len(groups)
            groups.append([])
            resources.append(rs)
        groups[g].append(i)
        group_of[i] = g
        for r in rs:
            last_on[r] = g
    return groups, group_of, resources


def _explicit_deps(dep_slot: np.ndarray, out_slot: np.ndarray) -> list[list[int]]:
    """The producer op of every finish slot an op reads (readers read before the op writes)."""
    writer: dict[int, int] = {}
    deps = []
    for i in range(len(out_slot)):
        deps.append([writer[int(s)] for s in dep_slot[i] if s != NO_SLOT])
        if out_slot[i] != NO_SLOT:
            writer[int(out_slot[i])] = i
    return deps


def _topological_order(groups, group_of, resources, deps) -> list[int]:
    """Groups in an order that respects data and per-resource order, by first member."""
    succ: list[set[int]] = [set() for _ in groups]
    last_on: dict[int, int] = {}
    for g, members in enumerate(groups):  # groups are numbered by first member
        for r in resources[g]:
            if r in last_on and last_on[r] != g:
                succ[last_on[r]].add(g)
            last_on[r] = g
        for i in members:
            for j in deps[i]:
                if group_of[j] != g:
                    succ[int(group_of[j])].add(g)
    indegree = np.zeros(len(groups), np.int64)
    for s in succ:
        for g in s:
            indegree[g] += 1
    ready = [g for g in range(len(groups)) if indegree[g] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        g = heapq.heappop(ready)
        order.append(g)
        for h in succ[g]:
            indegree[h] -= 1
            if indegree[h] == 0:
                heapq.heappush(ready, h)
    if len(order) != len(groups):
        stuck = [groups[g][0] for g in range(len(groups)) if indegree[g] > 0][:4]
        raise ValueError(
            "coarsen: the labelled groups depend on each other both ways (a group's later member "
            f"needs an op that needs its earlier member), e.g. the groups of ops {stuck}; split them"
        )
    return order


def prune_implied(deps: Sequence[Sequence[int]], resources: Sequence[Sequence[int]]) -> list[list[int]]:
    """Drops dependencies that issue order already implies under the analytic cost model.

    The analytic model costs an op the same on each of its resources, so every
    resource it occupies is busy until it finishes: a consumer that shares a
    resource with its producer (issued later there) waits for it anyway. (With
    explicit per-resource costs only single-resource producers would qualify,
    which is what :func:`~distir_jax.lower.lower` keeps to.) Of several
    single-resource producers on one resource, the last issued implies the others.
    """
    single = [rs[0] if len(rs) == 1 else None for rs in resources]
    kept = []
    for i, ds in enumerate(deps):
        mine = set(resources[i])
        last: dict[int, int] = {}
        others = []
        for j in ds:
            if mine.intersection(resources[j]):
                continue
            r = single[j]
            if r is None:
                others.append(j)
            else:
                last[r] = max(last.get(r, -1), j)
        kept.append(sorted(set(others) | set(last.values())))
    return kept


def _fused_program(program, topology, n, groups, order, member_group, dep_slot, out_slot, num_slots):
    g_count = len(groups)
    first = np.asarray([groups[g][0] for g in order])
    members = np.asarray([len(groups[g]) for g in order])
    # Ops sorted by new group, members in issue order: segments for reduceat.
    perm = np.argsort(member_group, kind="stable")
    starts = np.concatenate([[0], np.cumsum(members)[:-1]])
    resource = np.asarray(program.resource)[:n]
    slot_device = np.asarray(program.slot_device)[:n]
    fused = {name: np.asarray(getattr(program, name))[..., :n] for name in COST_FEATURES}
    device = np.maximum(slot_device[:, 0], 0)
    per_flop = 1.0 / topology.peak_flops[device]
    per_byte = 1.0 / topology.memory_bandwidth[device]
    bound_flops, bound_bytes = roofline_terms(fused["flops"], fused["mem_bytes"], per_flop, per_byte)
    multi = (members > 1)[member_group]  # singletons keep their roofline
    linear = {name: fused[name] for name in _LINEAR}
    linear["linear_flops"] = linear["linear_flops"] + np.where(multi, bound_flops, 0.0)
    linear["linear_bytes"] = linear["linear_bytes"] + np.where(multi, bound_bytes, 0.0)
    features = {name: np.add.reduceat(linear[name][..., perm], starts, axis=-1) for name in _LINEAR}
    for name in ("flops", "mem_bytes"):
        features[name] = np.where(members > 1, 0.0, fused[name][..., first])
    # One link per group: the link of its communicating members.
    link = np.asarray(program.link)[:n]
    comm = np.zeros(n, bool)
    for name in _COMM:
        comm |= np.any(np.reshape(fused[name] != 0, (-1, n)), axis=0)
    group_link = link[first].copy()
    for new, g in enumerate(order):
        talking = {tuple(link[i]) for i in groups[g] if comm[i]}
        if len(talking) > 1:
            raise ValueError(
                f"coarsen: the group of ops {groups[g][:6]} communicates over different links "
                f"{sorted(talking)}; label such ops separately"
            )
        if talking:
            group_link[new] = talking.pop()
    is_comm = np.zeros(g_count, bool)
    np.logical_or.at(is_comm, member_group, np.asarray(program.is_comm)[:n])
    alloc, free = _fused_memory(program, n, resource, first, member_group, perm, starts)
    new_slot_device = slot_device[first]
    return Program(
        resource=resource[first],
        slot_device=new_slot_device,
        dep_slot=dep_slot,
        out_slot=out_slot,
        link=group_link.astype(np.int32),
        is_comm=is_comm,
        resource_device=np.asarray(program.resource_device),
        num_ops=np.asarray(g_count, np.int32),
        alloc_bytes=alloc,
        free_bytes=free,
        resident_bytes=np.asarray(program.resident_bytes),
        peak_bytes=peak_memory(new_slot_device, alloc, free, np.asarray(program.resident_bytes)),
        num_finish_slots=num_slots,
        **{name: np.asarray(features[name], np.float64) for name in COST_FEATURES},
    )


def _fused_memory(program, n, resource, first, member_group, perm, starts):
    """Per group and slot: peak rise ``A`` allocated, ``A - net`` freed (see the module docstring)."""
    k = resource.shape[1]
    alloc = np.asarray(program.alloc_bytes)[..., :n, :]
    free = np.asarray(program.free_bytes)[..., :n, :]
    # Align every member's slots with its group's slot order (that of the first member).
    group_res = resource[first][member_group]  # [N, K]
    where = np.argmax(resource[:, :, None] == group_res[:, None, :], axis=2)  # member slot -> group slot
    where = np.where(resource >= 0, where, np.arange(k)[None, :])
    rows = np.arange(n)[:, None]
    aligned_alloc = np.zeros_like(alloc)
    aligned_free = np.zeros_like(free)
    aligned_alloc[..., rows, where] = alloc
    aligned_free[..., rows, where] = free
    a = aligned_alloc[..., perm, :]
    delta = a - aligned_free[..., perm, :]
    running = np.cumsum(delta, axis=-2)
    before_segment = np.take(running - delta, starts, axis=-2)  # running total at each group's start
    seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(perm))))
    before = running - delta - np.take(before_segment, seg, axis=-2)
    rise = np.maximum.reduceat(before + a, starts, axis=-2)
    net = np.add.reduceat(delta, starts, axis=-2)
    return rise, rise - net
