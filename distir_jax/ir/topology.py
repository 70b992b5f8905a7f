"""The cluster a program runs on: devices, their speeds, and the links between them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


def _array(name, value, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` as a float64 array of ``shape`` (a number fills it), or a ValueError naming ``name``."""
    try:
        return np.broadcast_to(np.asarray(value, dtype=np.float64), shape).copy()
    except (TypeError, ValueError):
        what = "device" if len(shape) == 1 else "device pair"
        raise ValueError(
            f"{name} must be a number or {list(shape)} numbers (one per {what}), got {np.shape(value)}"
        ) from None


def _vector(name, value, n, positive: bool = False) -> np.ndarray:
    """Per-device figures: finite and >= 0 (> 0 for speeds, which costs divide by)."""
    arr = _array(name, value, (n,))
    bad = ~np.isfinite(arr) | ((arr <= 0) if positive else (arr < 0))
    if np.any(bad):
        device = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name} must be finite and {'> 0' if positive else '>= 0'} for every device, "
            f"got {arr[device]} for device {device}"
        )
    arr.setflags(write=False)
    return arr


def _matrix(name, value, n) -> np.ndarray:
    arr = _array(name, value, (n, n))
    if np.any(np.isnan(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be >= 0 for every device pair")
    arr.setflags(write=False)
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """Devices and links, in SI units (FLOP/s, bytes/s, bytes, seconds).

    Attributes:
      name: a label, e.g. ``"dgx-a100-80gb x2"``.
      peak_flops: ``[D]`` peak throughput of each device for the program's dtype.
      memory_bandwidth: ``[D]`` device memory bandwidth.
      memory_capacity: ``[D]`` device memory size.
      link_bandwidth: ``[D, D]`` one-direction bandwidth between device pairs.
      link_latency: ``[D, D]`` one message's latency between device pairs.
      launch_overhead: fixed cost of one compute kernel.
      node_of_device: ``[D]`` which node (server) each device sits in.
    """

    name: str
    peak_flops: np.ndarray
    memory_bandwidth: np.ndarray
    memory_capacity: np.ndarray
    link_bandwidth: np.ndarray
    link_latency: np.ndarray
    launch_overhead: float = 0.0
    node_of_device: np.ndarray | None = None

    def __post_init__(self):
        n = int(np.asarray(self.peak_flops).reshape(-1).shape[0])
        if n < 1:
            raise ValueError("a topology needs at least one device")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("peak_flops", _vector("peak_flops", self.peak_flops, n, positive=True))
        set_("memory_bandwidth", _vector("memory_bandwidth", self.memory_bandwidth, n, positive=True))
        set_("memory_capacity", _vector("memory_capacity", self.memory_capacity, n))
        set_("link_bandwidth", _matrix("link_bandwidth", self.link_bandwidth, n))
        set_("link_latency", _matrix("link_latency", self.link_latency, n))
        if not 0 <= float(self.launch_overhead) < np.inf:
            raise ValueError(f"launch_overhead must be a finite number >= 0, got {self.launch_overhead}")
        set_("launch_overhead", float(self.launch_overhead))
        nodes = (
            np.zeros(n, np.int64)
            if self.node_of_device is None
            else np.asarray(self.node_of_device, np.int64)
        )
        if nodes.shape != (n,):
            raise ValueError(f"node_of_device must have shape [{n}], got {nodes.shape}")
        nodes.setflags(write=False)
        set_("node_of_device", nodes)
        off_diag = ~np.eye(n, dtype=bool)
        if np.any(self.link_bandwidth[off_diag] <= 0):
            raise ValueError("link_bandwidth must be > 0 between every pair of distinct devices")

    @property
    def num_devices(self) -> int:
        return int(self.peak_flops.shape[0])

    @classmethod
    def uniform(
        cls,
        num_devices: int,
        *,
        peak_flops: float = 1.4e13,
        memory_bandwidth: float = 9e11,
        memory_capacity: float = 16e9,
        link_bandwidth: float = 25e9 / 8,
        link_latency: float = 0.0,
        launch_overhead: float = 1e-5,
        name: str = "uniform",
    ) -> Topology:
        """Identical devices, every pair linked alike (DistIR's defaults)."""
        if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
            raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
        return cls(
            name=name,
            peak_flops=np.full(num_devices, peak_flops),
            memory_bandwidth=np.full(num_devices, memory_bandwidth),
            memory_capacity=np.full(num_devices, memory_capacity),
            link_bandwidth=np.full((num_devices, num_devices), link_bandwidth),
            link_latency=np.full((num_devices, num_devices), link_latency),
            launch_overhead=launch_overhead,
        )

    def check_devices(self, devices: Sequence[int], where: str = "program") -> None:
        bad = [d for d in devices if not 0 <= d < self.num_devices]
        if bad:
            raise ValueError(
                f"{where} uses device(s) {bad}, but topology {self.name!r} has devices "
                f"0..{self.num_devices - 1}"
            )

    def bottleneck_link(self, devices: Sequence[int]) -> tuple[int, int]:
        """The slowest link of a ring over ``devices`` in the given order.

        Collectives are costed by the ring's slowest hop (with
        :meth:`ring_channels` of its bandwidth); ties go to the higher
        latency, then to the first hop. A single device has no link: ``(d, d)``.
        """
        devices = list(devices)
        if len(devices) < 2:
            return (devices[0], devices[0])
        return min(_ring_hops(devices), key=lambda ab: (self.link_bandwidth[ab], -self.link_latency[ab]))

    def collective_link(self, devices: Sequence[int]) -> tuple[tuple[int, int], float]:
        """``(bottleneck_link, ring_channels)`` of a collective over ``devices``,
        the bottleneck found once: what a collective is costed on."""
        devices = [int(d) for d in devices]
        link = self.bottleneck_link(devices)
        a, b = link
        if len(devices) < 2 or self.node_of_device[a] == self.node_of_device[b]:
            return link, 1.0
        return link, float(np.unique(self.node_of_device[devices], return_counts=True)[1].min())

    def ring_channels(self, devices: Sequence[int]) -> float:
        """How many times its bottleneck link's bandwidth a collective over ``devices`` gets.

        A group with ``m`` members in each of several nodes runs ``m`` rings
        side by side, each crossing between nodes through another member's
        network port (NCCL builds one ring per NIC, and the presets' nodes have
        one NIC per GPU): where the ring's slowest hop is between nodes
        (:meth:`bottleneck_link`), the network carries ``m`` ports' bandwidth.
        1 for a group in one node, with one member in some node, or whose
        slowest hop is inside a node. Costs divide a collective's bytes by it
        (``lower``, the reference simulator, the coarse programs; all through
        :meth:`collective_link`).

        It assumes the links inside a node keep up with ``m`` ports (every
        preset's do: DGX A100 8 x 25 GB/s against 300, H100 and H200 8 x 50
        against 450, B200 8 x 50 against 900); a whole number, so a step time
        stays a function of the bottleneck link's figures (calibration and
        sensitivities differentiate it)."""
        return self.collective_link(devices)[1]


def _ring_hops(devices: list[int]) -> list[tuple[int, int]]:
    """The hops of a ring over ``devices`` (two devices: one hop)."""
    return list(zip(devices, devices[1:] + devices[:1])) if len(devices) > 2 else [tuple(devices)]
