"""The analytical cost model, written once for NumPy (reference) and jnp (kernel).

An op's seconds on one of its resources are the sum of a compute part and a
communication part (one of them is zero for ordinary ops; a coarsened op may
have both):

* compute: ``launches * launch_overhead + max(flops / peak_flops, mem_bytes /
  memory_bandwidth) + linear_flops / peak_flops + linear_bytes /
  memory_bandwidth``. The max is a roofline; DistIR summed the two terms, which
  counts a kernel's memory traffic and arithmetic as if they could not
  overlap. The ``linear_*`` terms carry fused groups of ops already split into
  their compute-bound flops and memory-bound bytes, whose times add.
* communication: ``comm_hops * latency + comm_volume / bandwidth`` on the
  group's slowest link, where the op's registry entry already scaled volume
  and hops for its algorithm (ring all-reduce: ``2 (g - 1) / g`` of the bytes
  and ``2 (g - 1)`` hops), and lowering divided the volume by the rings the
  group runs side by side across nodes
  (:meth:`~distir_jax.ir.topology.Topology.ring_channels`).

Each function takes the array module ``xp`` (``numpy`` or ``jax.numpy``) so the
float64 reference simulator and the batched kernel share one formula.
"""

from __future__ import annotations

# Per-op cost features, in the order the lowered Program stores them.
COST_FEATURES = ("launches", "flops", "mem_bytes", "linear_flops", "linear_bytes", "comm_volume", "comm_hops")


def op_seconds(
    xp,
    features,
    seconds_per_flop,
    seconds_per_byte,
    launch_overhead,
    seconds_per_link_byte,
    link_latency,
    maximum=None,
):
    """Seconds one op occupies a resource.

    Speeds come as reciprocals (seconds per flop or byte): the kernel then only
    multiplies, which XLA fuses freely, where divides would each become a
    separate kernel call per step on CPU.

    Args:
      xp: ``numpy`` or ``jax.numpy``.
      features: mapping with every name in ``COST_FEATURES``.
      seconds_per_flop, seconds_per_byte: ``1 / peak_flops`` and
        ``1 / memory_bandwidth`` of the op's device.
      launch_overhead: seconds per kernel launch.
      seconds_per_link_byte, link_latency: the op's bottleneck link
        (``inverse_bandwidth`` of it).
      maximum: the max to use in the roofline (a smooth max for gradients).
    """
    compute = compute_seconds(xp, features, seconds_per_flop, seconds_per_byte, launch_overhead, maximum)
    return with_link_seconds(
        compute, features["comm_hops"], features["comm_volume"], seconds_per_link_byte, link_latency
    )


def compute_seconds(xp, features, seconds_per_flop, seconds_per_byte, launch_overhead, maximum=None):
    """The compute part of :func:`op_seconds` (launches and roofline; no link)."""
    maximum = xp.maximum if maximum is None else maximum
    f = features
    return (
        f["launches"] * launch_overhead
        + maximum(f["flops"] * seconds_per_flop, f["mem_bytes"] * seconds_per_byte)
        + f["linear_flops"] * seconds_per_flop
        + f["linear_bytes"] * seconds_per_byte
    )


def with_link_seconds(compute, comm_hops, comm_volume, seconds_per_link_byte, link_latency):
    """:func:`op_seconds` from its compute part (:func:`compute_seconds`): the link's
    latency per hop and seconds per byte added, in that order (callers that keep
    the compute part get the same floats)."""
    return compute + comm_hops * link_latency + comm_volume * seconds_per_link_byte


def inverse_bandwidth(xp, bandwidth):
    """``1 / bandwidth``, and 0 where there is no bandwidth (a device's link to
    itself carries no bytes, so it may be given as 0)."""
    positive = bandwidth > 0
    return xp.where(positive, 1.0 / xp.where(positive, bandwidth, 1.0), 0.0)
