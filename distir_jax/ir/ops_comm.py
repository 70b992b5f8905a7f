"""Communication op types: ``Send`` and MPI-style collectives.

Collectives take one value per participating device and return one per device
(``Broadcast`` and ``Scatter`` start from one root value, ``Gather`` ends in
one). Costs follow ring algorithms over the group in operand order: features
give the bytes crossing the slowest link (``comm_volume``) and the number of
sequential latencies (``comm_hops``); the link itself is chosen at lowering,
which also divides the bytes by the rings a group runs side by side across
nodes (:meth:`~distir_jax.ir.topology.Topology.ring_channels`).

Every collective accepts an optional ``group`` attribute: the devices of the
full group when a symmetry-reduced program simulates only some members (the
others are identical replicas). Costs then use the full group's size and its
slowest link, while the op occupies only the devices it really touches.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, aliases_if_inplace, register
from distir_jax.ir.shape_rules import normalize_axis, require_same_dtype, same_shape, split_dim, split_padded
from distir_jax.ir.types import TensorType, dim_str


def _distinct_devices(ins) -> tuple[int, ...]:
    devices = tuple(t.device for t in ins)
    if len(set(devices)) != len(devices):
        raise OpError(f"operands must be on distinct devices, got devices {list(devices)}")
    return devices


def _group_inputs(ins, what, attrs):
    if not ins:
        raise OpError(f"{what} needs at least one operand")
    same_shape(ins, f"{what}'s operands")
    require_same_dtype(ins)
    devices = _distinct_devices(ins)
    if "group" in attrs:  # the full group of a symmetry-reduced collective: its members among them
        group = _device_list(attrs, "group", what)
        outside = [d for d in devices if d not in group]
        if outside:
            raise OpError(f"{what}'s operands on devices {outside} are not in its group {list(group)}")
    return devices


def _device_list(attrs, key, what):
    devices = attrs.get(key)
    if devices is None or not isinstance(devices, tuple) or not devices:
        raise OpError(f"{what} needs attribute {key} = a non-empty tuple of device indices")
    if len(set(devices)) != len(devices):
        raise OpError(f"{what}'s {key} must be distinct, got {list(devices)}")
    return tuple(int(d) for d in devices)


def _group_size(attrs, ins) -> int:
    """Members of the collective: the full ``group`` when a symmetry-reduced
    program keeps only some of them, else one per operand."""
    return len(attrs["group"]) if "group" in attrs else len(ins)


def _ring(volume_factor, hops_per_member, moved=lambda ins, outs, group: ins[0].num_bytes):
    """Features of a ring collective on ``g`` members moving ``n`` bytes each
    (``moved``: ``n`` from the operand and result types and ``g``)."""

    def features(attrs, ins, outs):
        # A symmetry-reduced program keeps one representative replica but
        # costs each collective over its full group, named by `group`.
        group = len(attrs["group"]) if "group" in attrs else len({t.device for t in ins + outs})
        n = moved(ins, outs, group)
        return OpFeatures(
            comm_volume=volume_factor(group) * n,
            comm_hops=hops_per_member * (group - 1),
            is_comm=True,
        )

    return features


# --------------------------------------------------------------------------- #
# Send: one value to another device.


def _send_infer(attrs, ins):
    (x,) = ins
    if "to" not in attrs:
        raise OpError("Send needs attribute to = the destination device")
    to = int(attrs["to"])
    if to == x.device:
        raise OpError(f"Send from device {x.device} to itself")
    return (x.on(to),)


register(
    OpSpec(
        "Send",
        _send_infer,
        lambda attrs, ins, outs: OpFeatures(comm_volume=ins[0].num_bytes, comm_hops=1, is_comm=True),
        lambda attrs, inputs: (np.array(inputs[0], copy=True),),
        num_inputs=1,
        single_device=False,
    )
)

# --------------------------------------------------------------------------- #
# AllReduce: every member gets the sum. With inplace=True each member's sum is
# written into its operand's buffer (as Megatron-LM all-reduces LayerNorm
# gradients in place): no new memory.


def _allreduce_infer(attrs, ins):
    _group_inputs(ins, "AllReduce", attrs)
    return tuple(ins)


def _allreduce_eval(attrs, inputs):
    total = np.sum(np.stack(inputs), axis=0)
    return tuple(np.array(total, copy=True) for _ in inputs)


register(
    OpSpec(
        "AllReduce",
        _allreduce_infer,
        _ring(lambda g: 2 * (g - 1) / g, 2),
        _allreduce_eval,
        single_device=False,
        aliases=aliases_if_inplace,
    )
)

# --------------------------------------------------------------------------- #
# AllGather: every member gets the concatenation along `axis`. With
# inplace=True each member's result is written into the buffer its operand is
# a view of (a `Shard` of the whole value, as ZeRO gathers updated weight
# shards into the weight's own buffer): no new memory. The memory model checks
# that the buffer holds the result (`lower`, the reference simulator).


def _allgather_infer(attrs, ins):
    _group_inputs(ins, "AllGather", attrs)
    axis = normalize_axis(int(attrs.get("axis", 0)), ins[0].rank)
    shape = list(ins[0].shape)
    gathered = shape[axis] * _group_size(attrs, ins)
    if "size" in attrs:  # the first `size` of the gathered rows: a padded ReduceScatter's inverse
        size = attrs["size"]
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= gathered:
            raise OpError(f"AllGather's size must be an int in [1, {dim_str(gathered)}], got {size!r}")
        gathered = size
    shape[axis] = gathered
    return tuple(t.with_shape(shape) for t in ins)


def _allgather_eval(attrs, inputs):
    axis = int(attrs.get("axis", 0))
    whole = np.concatenate(inputs, axis=axis)
    if "size" in attrs:
        whole = np.take(whole, np.arange(attrs["size"]), axis=axis)
    return tuple(np.array(whole, copy=True) for _ in inputs)


register(
    OpSpec(
        "AllGather",
        _allgather_infer,
        _ring(lambda g: g - 1, 1),
        _allgather_eval,
        single_device=False,
        aliases=aliases_if_inplace,
    )
)

# --------------------------------------------------------------------------- #
# ReduceScatter: member i gets part i of the sum, split along `axis`. With
# pad=True a dimension the group does not divide is padded with zeros to the
# next multiple first (as ZeRO implementations pad their flat buffers): the
# last members' parts end in zeros, and the ring moves the padded bytes. With
# inplace=True each member's part is written into its operand's buffer, as
# ZeRO's gradient buffers are (Megatron-LM's distributed optimizer): no new
# memory, and the operand's bytes stay live while its part is used.


def _reducescatter_infer(attrs, ins):
    _group_inputs(ins, "ReduceScatter", attrs)
    axis = normalize_axis(int(attrs.get("axis", 0)), ins[0].rank)
    shape = split_dim(ins[0].shape, axis, _group_size(attrs, ins), "ReduceScatter", bool(attrs.get("pad")))
    return tuple(t.with_shape(shape) for t in ins)


def _reducescatter_eval(attrs, inputs):
    # Padding only with pad=True: the type rule refuses an indivisible dimension otherwise.
    total = np.sum(np.stack(inputs), axis=0)
    return tuple(split_padded(total, len(inputs), int(attrs.get("axis", 0))))


def _padded_bytes(ins, outs, group):
    """The (padded) sum's bytes: the group's parts, each an output's size."""
    return np.maximum(ins[0].num_bytes, outs[0].num_bytes * group)


register(
    OpSpec(
        "ReduceScatter",
        _reducescatter_infer,
        _ring(lambda g: (g - 1) / g, 1, _padded_bytes),
        _reducescatter_eval,
        single_device=False,
        aliases=aliases_if_inplace,
    )
)

# --------------------------------------------------------------------------- #
# AllToAll: member i gets part i of every member's split, concatenated.


def _alltoall_infer(attrs, ins):
    _group_inputs(ins, "AllToAll", attrs)
    rank = ins[0].rank
    split_axis = normalize_axis(int(attrs.get("split_axis", 0)), rank)
    concat_axis = normalize_axis(int(attrs.get("concat_axis", 0)), rank)
    g = _group_size(attrs, ins)
    shape = list(split_dim(ins[0].shape, split_axis, g, "AllToAll"))
    shape[concat_axis] = shape[concat_axis] * g
    return tuple(t.with_shape(shape) for t in ins)


def _alltoall_eval(attrs, inputs):
    g = len(inputs)
    split_axis = int(attrs.get("split_axis", 0))
    concat_axis = int(attrs.get("concat_axis", 0))
    parts = [np.split(x, g, axis=split_axis) for x in inputs]
    return tuple(np.concatenate([parts[j][i] for j in range(g)], axis=concat_axis) for i in range(g))


register(
    OpSpec(
        "AllToAll",
        _alltoall_infer,
        _ring(lambda g: (g - 1) / g, 1),
        _alltoall_eval,
        single_device=False,
    )
)

# --------------------------------------------------------------------------- #
# Broadcast and Scatter: from one root value to `devices`.


def _broadcast_infer(attrs, ins):
    (x,) = ins
    devices = _device_list(attrs, "devices", "Broadcast")
    return tuple(x.on(d) for d in devices)


register(
    OpSpec(
        "Broadcast",
        _broadcast_infer,
        _ring(lambda g: 1, 1),  # pipelined ring: n / bw + (g - 1) latencies
        lambda attrs, inputs: tuple(np.array(inputs[0], copy=True) for _ in attrs["devices"]),
        num_inputs=1,
        single_device=False,
    )
)


def _scatter_infer(attrs, ins):
    (x,) = ins
    devices = _device_list(attrs, "devices", "Scatter")
    axis = normalize_axis(int(attrs.get("axis", 0)), x.rank)
    shape = split_dim(x.shape, axis, len(devices), "Scatter")
    return tuple(TensorType(shape, x.dtype, d) for d in devices)


register(
    OpSpec(
        "Scatter",
        _scatter_infer,
        _ring(lambda g: (g - 1) / g, 1),
        lambda attrs, inputs: tuple(
            np.split(inputs[0], len(attrs["devices"]), axis=int(attrs.get("axis", 0)))
        ),
        num_inputs=1,
        single_device=False,
    )
)

# --------------------------------------------------------------------------- #
# Gather: members' values concatenated on device `to`.


def _gather_infer(attrs, ins):
    _group_inputs(ins, "Gather", attrs)
    if "to" not in attrs:
        raise OpError("Gather needs attribute to = the destination device")
    axis = normalize_axis(int(attrs.get("axis", 0)), ins[0].rank)
    shape = list(ins[0].shape)
    shape[axis] = shape[axis] * len(ins)
    return (TensorType(tuple(shape), ins[0].dtype, int(attrs["to"])),)


register(
    OpSpec(
        "Gather",
        _gather_infer,
        _ring(lambda g: g - 1, 1),
        lambda attrs, inputs: (np.concatenate(inputs, axis=int(attrs.get("axis", 0))),),
        single_device=False,
    )
)
