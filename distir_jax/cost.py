"""The analytical cost model, written once for NumPy (reference) and jnp (kernel).

Compute ops follow a roofline: ``launch + max(flops / peak_flops,
mem_bytes / memory_bandwidth)``; DistIR summed the two terms, which counts a
kernel's memory traffic and arithmetic as if they could not overlap.
Communication ops pay ``hops * latency + volume / bandwidth`` on the group's
slowest link, where the op's registry entry already scaled ``volume`` and
``hops`` for its algorithm (ring all-reduce, all-gather, ...).

Each function takes the array module ``xp`` (``numpy`` or ``jax.numpy``) so
the float64 reference simulator and the batched kernel share one formula.
"""

from __future__ import annotations


def compute_cost(xp, flops, mem_bytes, peak_flops, memory_bandwidth, launch_overhead, maximum=None):
    """Seconds for one compute op on one device (roofline plus launch)."""
    maximum = xp.maximum if maximum is None else maximum
    return launch_overhead + maximum(flops / peak_flops, mem_bytes / memory_bandwidth)


def comm_cost(xp, comm_volume, comm_hops, link_bandwidth, link_latency):
    """Seconds for one communication op over its bottleneck link."""
    return comm_hops * link_latency + comm_volume / link_bandwidth
