"""The hardware pytree: a topology's numbers as arrays the kernel can batch over."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from distir_jax.ir.topology import Topology


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Device and link parameters, optionally with a leading batch axis ``[B, ...]``.

    Attributes:
      peak_flops: ``[D]`` FLOP/s per device.
      memory_bandwidth: ``[D]`` bytes/s per device.
      memory_capacity: ``[D]`` bytes per device (out-of-memory threshold).
      link_bandwidth: ``[D, D]`` bytes/s, one direction.
      link_latency: ``[D, D]`` seconds per message.
      launch_overhead: ``[]`` seconds per compute kernel.
    """

    peak_flops: np.ndarray
    memory_bandwidth: np.ndarray
    memory_capacity: np.ndarray
    link_bandwidth: np.ndarray
    link_latency: np.ndarray
    launch_overhead: np.ndarray

    @classmethod
    def from_topology(cls, topology: Topology) -> Hardware:
        return cls(
            peak_flops=np.asarray(topology.peak_flops),
            memory_bandwidth=np.asarray(topology.memory_bandwidth),
            memory_capacity=np.asarray(topology.memory_capacity),
            link_bandwidth=np.asarray(topology.link_bandwidth),
            link_latency=np.asarray(topology.link_latency),
            launch_overhead=np.asarray(topology.launch_overhead),
        )

    @property
    def num_devices(self) -> int:
        return int(np.shape(self.peak_flops)[-1])

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.peak_flops)[:-1])

    def replace(self, **changes) -> Hardware:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    Hardware, data_fields=[f.name for f in dataclasses.fields(Hardware)], meta_fields=[]
)


def stack_hardware(items: Sequence[Hardware]) -> Hardware:
    """Stacks unbatched hardware descriptions into one with a leading ``[B]`` axis."""
    if not items:
        raise ValueError("stack_hardware needs at least one Hardware")
    sizes = {h.num_devices for h in items}
    if len(sizes) > 1:
        raise ValueError(f"hardware to stack must have one device count, got {sorted(sizes)}; pad first")
    return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *items)


def pad_hardware(hardware: Hardware, num_devices: int) -> Hardware:
    """Adds idle devices (never touched by any op) up to ``num_devices``.

    Padded devices get unit speeds, infinite capacity and links so no formula
    divides by zero.
    """
    have = hardware.num_devices
    if num_devices < have:
        raise ValueError(f"cannot pad hardware with {have} devices down to {num_devices}")

    def vec(x, fill):  # (np.pad does the same, ~10x slower: sweeps pad every program's hardware)
        x = np.asarray(x)
        out = np.full((*x.shape[:-1], num_devices), fill, x.dtype)
        out[..., :have] = x
        return out

    def mat(x, fill):
        x = np.asarray(x)
        out = np.full((*x.shape[:-2], num_devices, num_devices), fill, x.dtype)
        out[..., :have, :have] = x
        return out

    return Hardware(
        peak_flops=vec(hardware.peak_flops, 1.0),
        memory_bandwidth=vec(hardware.memory_bandwidth, 1.0),
        memory_capacity=vec(hardware.memory_capacity, np.inf),
        link_bandwidth=mat(hardware.link_bandwidth, 1.0),
        link_latency=mat(hardware.link_latency, 0.0),
        launch_overhead=np.asarray(hardware.launch_overhead),
    )
