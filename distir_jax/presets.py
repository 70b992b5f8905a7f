"""Hardware presets as data: published GPU and server figures turned into `Topology` objects.

Every figure comes from a vendor datasheet or whitepaper, cited next to the
constant that holds it. Units are SI: FLOP/s, bytes/s, bytes and seconds.
Conventions used throughout:

* Peak FLOP/s are *dense* figures (no structured sparsity) for the chosen
  compute dtype: ``"f32"`` (plain FP32 CUDA cores), ``"tf32"`` (TF32 tensor
  cores, Ampere and newer), ``"f16"`` and ``"bf16"`` (tensor cores with FP32
  accumulate; Volta has no bf16). GPUs with FP8 tensor cores (Hopper and
  newer) also list ``"fp8"``, which is not a model dtype: training precision
  ``"mixed-fp8"`` runs a bf16 / f16 model's linear layers on them
  (:func:`fp8_problem`).
* Link bandwidths are *one direction*; vendors usually quote the sum of both
  directions (e.g. "600 GB/s NVLink"), which we halve.
* A datasheet "GB" is taken as 1e9 bytes. The physical parts hold binary
  gibibytes (16 GiB, 80 GiB), part of which the driver reserves, so the decimal
  figure is a slightly conservative usable capacity.
* Per-message latencies and the kernel launch overhead are modelling
  assumptions, not datasheet figures; see `NVLINK_LATENCY`.

Preset names (`get_preset`):

* ``"v100-pcie-4"``: one server with 4 V100-16GB PCIe GPUs.
* ``"dgx-a100-80gb"``: DGX A100 80GB nodes of 8 GPUs (``num_nodes=`` for more).
* ``"dgx-h100"``: DGX H100 nodes of 8 GPUs (``num_nodes=`` for more).
* ``"dgx-h200"``: DGX H200 nodes of 8 GPUs (``num_nodes=`` for more).
* ``"dgx-b200"``: DGX B200 nodes of 8 GPUs (``num_nodes=`` for more).
* a name given to :func:`register_calibrated_preset`: a preset above with
  its figures scaled by a calibration (:func:`distir_jax.calibrate.calibrate`).
* ``"<preset>:<N>"``: ``N`` GPUs of that preset, e.g. ``"dgx-a100-80gb:16"``
  is two DGX A100 nodes and ``"dgx-h100:4"`` half of one node. ``N`` must be
  1..(GPUs per node) or a multiple of the GPUs per node; the V100 server is a
  single node, so ``"v100-pcie-4:N"`` takes ``N`` in 1..4.

JSON (`topology_to_json` / `topology_from_json`) stores every vector and matrix
in full with repr-exact floats, so a topology round-trips bit for bit.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from distir_jax.ir.topology import Topology

# --- Compute dtypes ---------------------------------------------------------

COMPUTE_DTYPES = ("f32", "tf32", "f16", "bf16")

# --- Link figures (one direction, bytes/s) ----------------------------------

# PCIe 3.0 base specification: 8 GT/s per lane, 128b/130b encoding, x16 lanes.
# That is ~15.75 GB/s each way; the V100 datasheet's "32 GB/s" is both ways.
PCIE3_X16_BANDWIDTH = 16 * 8e9 * (128 / 130) / 8
# Third-generation NVLink on A100: 12 links x 25 GB/s each way = 300 GB/s
# (A100 datasheet: "NVLink 600 GB/s", bidirectional). Through the NVSwitches of
# a DGX A100 every GPU pair gets the full rate (DGX A100 whitepaper).
NVLINK3_BANDWIDTH = 300e9
# Fourth-generation NVLink on H100 SXM: 18 links x 25 GB/s = 450 GB/s each way
# (H100 datasheet: "NVLink 900 GB/s", bidirectional).
NVLINK4_BANDWIDTH = 450e9
# Fifth-generation NVLink on B200: 18 links x 50 GB/s each way = 900 GB/s
# (HGX / DGX B200: "NVLink 1.8 TB/s" per GPU, bidirectional).
NVLINK5_BANDWIDTH = 900e9
# One HDR InfiniBand port per GPU on DGX A100 (ConnectX-6, 200 Gb/s).
HDR_IB_BANDWIDTH = 200e9 / 8
# One NDR InfiniBand port per GPU on DGX H100, H200 and B200 (ConnectX-7, 400 Gb/s).
NDR_IB_BANDWIDTH = 400e9 / 8

# Self-links never carry traffic, but `Topology` wants positive bandwidths and
# a finite value keeps the JSON form standard.
SELF_LINK_BANDWIDTH = 1e18

# --- Latencies (seconds): modelling assumptions -----------------------------

# End-to-end cost of one message as a collective library sees it (software,
# synchronisation and the wire), not the bare wire latency. The values follow
# the per-hop latencies in NCCL's tuning model (src/graph/tuning.cc, `hwLat`,
# Ring with the LL128 / Simple protocols: NVLink 1.9 / 3.4 us, PCI 2.5 / 5.7 us,
# network 4.0 / 9.6-14 us), rounded to a few microseconds.
NVLINK_LATENCY = 3e-6
PCIE_LATENCY = 5e-6
INFINIBAND_LATENCY = 8e-6
# Host-side cost of launching one CUDA kernel: a few microseconds (see NVIDIA's
# "Getting Started with CUDA Graphs" developer blog, 2019). An assumption.
KERNEL_LAUNCH_OVERHEAD = 5e-6


@dataclasses.dataclass(frozen=True)
class _GpuSpec:
    """One GPU model: dense peak FLOP/s per dtype (and ``"fp8"``), and its memory."""

    model: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_capacity: float
    # dtype -> why the GPU cannot run it; for dtypes missing from peak_flops.
    unsupported: Mapping[str, str]
    # What a calibration scaled the datasheet's peaks by (1: the datasheet's own).
    peak_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class _NodeSpec:
    """One server: identical GPUs, one intra-node fabric, one NIC class between nodes."""

    gpu: _GpuSpec
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    # None for presets that describe a single server with no scale-out network.
    inter_bandwidth: float | None
    inter_latency: float | None
    launch_overhead: float = KERNEL_LAUNCH_OVERHEAD


# NVIDIA V100 Tensor Core GPU datasheet (2020), "V100 for PCIe" column:
# FP32 14 TFLOPS, Tensor (FP16 in, FP32 accumulate) 112 TFLOPS, 16 GB HBM2 at
# 900 GB/s. Volta has neither TF32 nor bf16 tensor cores.
_V100_PCIE_16GB = _GpuSpec(
    model="V100",
    peak_flops={"f32": 14e12, "f16": 112e12},
    memory_bandwidth=900e9,
    memory_capacity=16e9,
    unsupported={
        "bf16": "V100 (Volta) has no bf16 tensor cores; use 'f16' or 'f32'",
        "tf32": "TF32 tensor cores arrived with Ampere (A100); V100 supports 'f32' and 'f16'",
        "fp8": "V100 (Volta) has no FP8 tensor cores (they arrived with Hopper, H100)",
    },
)

# NVIDIA A100 Tensor Core GPU datasheet (2021), "A100 80GB SXM" column:
# FP32 19.5 TFLOPS, TF32 Tensor 156 TFLOPS, BF16 / FP16 Tensor 312 TFLOPS
# (312 / 624 / 624 with sparsity, not used), 80 GB HBM2e at 2,039 GB/s.
_A100_SXM_80GB = _GpuSpec(
    model="A100",
    peak_flops={"f32": 19.5e12, "tf32": 156e12, "f16": 312e12, "bf16": 312e12},
    memory_bandwidth=2039e9,
    memory_capacity=80e9,
    unsupported={"fp8": "A100 (Ampere) has no FP8 tensor cores (they arrived with Hopper, H100)"},
)

# NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), table comparing
# A100 and H100, "H100 SXM5" column: FP32 66.9 TFLOPS, TF32 Tensor 494.7,
# FP16 / BF16 Tensor 989.4 TFLOPS dense (989.4 / 1978.9 with sparsity). The
# NVIDIA H100 Tensor Core GPU datasheet rounds these to 67 and quotes only the
# sparse tensor figures (989 / 1,979), i.e. twice the dense ones; FP8 Tensor
# 1978.9 TFLOPS dense (3957.8 sparse). Memory per the datasheet, "H100 SXM"
# column: 80 GB HBM3 at 3.35 TB/s.
_H100_SXM_80GB = _GpuSpec(
    model="H100",
    peak_flops={"f32": 66.9e12, "tf32": 494.7e12, "f16": 989.4e12, "bf16": 989.4e12, "fp8": 1978.9e12},
    memory_bandwidth=3.35e12,
    memory_capacity=80e9,
    unsupported={},
)

# NVIDIA H200 Tensor Core GPU datasheet (2024), "H200 SXM" column: the H100
# SXM's compute (same GH100 die and clocks: the datasheet's FP32 67 and sparse
# TF32 989 / FP16 and BF16 1,979 TFLOPS are the H100 SXM's), with 141 GB of
# HBM3e at 4.8 TB/s.
_H200_SXM_141GB = dataclasses.replace(
    _H100_SXM_80GB, model="H200", memory_bandwidth=4.8e12, memory_capacity=141e9
)

# NVIDIA HGX B200 specifications (per GPU, 1,000 W): FP32 75 TFLOPS, TF32
# Tensor 2.2 PFLOPS, FP16 / BF16 Tensor 4.5 PFLOPS and FP8 Tensor 9 PFLOPS
# *with sparsity*, halved here (1.1, 2.25 and 4.5 PFLOPS dense), 180 GB HBM3e
# at 7.7 TB/s.
_B200_180GB = _GpuSpec(
    model="B200",
    peak_flops={"f32": 75e12, "tf32": 1.1e15, "f16": 2.25e15, "bf16": 2.25e15, "fp8": 4.5e15},
    memory_bandwidth=7.7e12,
    memory_capacity=180e9,
    unsupported={},
)


def _dgx(gpu: _GpuSpec, nvlink_bandwidth: float, port_bandwidth: float) -> _NodeSpec:
    """A DGX node: 8 GPUs behind NVSwitches, one InfiniBand port per GPU."""
    return _NodeSpec(
        gpu=gpu,
        gpus_per_node=8,
        intra_bandwidth=nvlink_bandwidth,
        intra_latency=NVLINK_LATENCY,
        inter_bandwidth=port_bandwidth,
        inter_latency=INFINIBAND_LATENCY,
    )


_NODES: dict[str, _NodeSpec] = {
    # A 4-GPU PCIe server: each GPU on its own PCIe 3.0 x16 slot. Peer traffic
    # is assumed to reach the full x16 rate for every pair (a PCIe switch).
    "v100-pcie-4": _NodeSpec(
        gpu=_V100_PCIE_16GB,
        gpus_per_node=4,
        intra_bandwidth=PCIE3_X16_BANDWIDTH,
        intra_latency=PCIE_LATENCY,
        inter_bandwidth=None,
        inter_latency=None,
    ),
    # NVIDIA DGX A100 System Architecture whitepaper (2020) and DGX A100
    # datasheet: 8 A100 GPUs, 6 NVSwitches (600 GB/s per GPU, both ways),
    # 8 single-port ConnectX-6 HDR 200 Gb/s InfiniBand NICs, one per GPU.
    "dgx-a100-80gb": _dgx(_A100_SXM_80GB, NVLINK3_BANDWIDTH, HDR_IB_BANDWIDTH),
    # NVIDIA DGX H100 datasheet: 8 H100 SXM 80GB GPUs, 4 NVSwitches (900 GB/s
    # per GPU, both ways), 8 ConnectX-7 NDR 400 Gb/s InfiniBand NICs, one per GPU.
    "dgx-h100": _dgx(_H100_SXM_80GB, NVLINK4_BANDWIDTH, NDR_IB_BANDWIDTH),
    # NVIDIA DGX H200 datasheet: a DGX H100 with H200 GPUs (4 NVSwitches, 900
    # GB/s NVLink per GPU both ways, 8 ConnectX-7 400 Gb/s NICs for the compute fabric).
    "dgx-h200": _dgx(_H200_SXM_141GB, NVLINK4_BANDWIDTH, NDR_IB_BANDWIDTH),
    # NVIDIA DGX B200 datasheet: 8 B200 GPUs, 2 NVSwitches (1.8 TB/s NVLink per
    # GPU both ways), 8 single-port ConnectX-7 400 Gb/s NICs for the compute fabric.
    "dgx-b200": _dgx(_B200_180GB, NVLINK5_BANDWIDTH, NDR_IB_BANDWIDTH),
}


def _peak_flops(preset: str, gpu: _GpuSpec, dtype: str) -> float:
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{preset}: unknown dtype {dtype!r}; expected one of {list(COMPUTE_DTYPES)}")
    if dtype in gpu.unsupported:
        raise ValueError(f"{preset}: dtype {dtype!r} is not supported: {gpu.unsupported[dtype]}")
    return gpu.peak_flops[dtype]


def _positive_int(preset: str, what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{preset}: {what} must be a positive integer, got {value!r}")
    return int(value)


def _build(preset: str, num_devices: int, dtype: str) -> Topology:
    """Lays ``num_devices`` GPUs of ``preset`` out node by node, filling each node first."""
    spec = _NODES[preset]
    flops = _peak_flops(preset, spec.gpu, dtype)
    nodes = np.arange(num_devices) // spec.gpus_per_node
    same_node = nodes[:, None] == nodes[None, :]
    # `cluster` only spans nodes when there is a network, so a single-server
    # preset has no cross-node pairs and its (absent) network figures go unused.
    inter_bw = spec.inter_bandwidth or spec.intra_bandwidth
    inter_lat = spec.inter_latency or spec.intra_latency
    bandwidth = np.where(same_node, spec.intra_bandwidth, inter_bw)
    np.fill_diagonal(bandwidth, SELF_LINK_BANDWIDTH)
    latency = np.where(same_node, spec.intra_latency, inter_lat)
    np.fill_diagonal(latency, 0.0)
    return Topology(
        name=f"{preset}:{num_devices} {dtype}",
        peak_flops=np.full(num_devices, flops),
        memory_bandwidth=np.full(num_devices, spec.gpu.memory_bandwidth),
        memory_capacity=np.full(num_devices, spec.gpu.memory_capacity),
        link_bandwidth=bandwidth,
        link_latency=latency,
        launch_overhead=spec.launch_overhead,
        node_of_device=nodes,
    )


def v100_pcie_server(dtype: str = "f32") -> Topology:
    """One server with 4 V100-16GB PCIe GPUs linked through PCIe 3.0 x16.

    Figures (NVIDIA V100 Tensor Core GPU datasheet, 2020, "V100 for PCIe"):
    14 TFLOPS FP32, 112 TFLOPS FP16 tensor, 16 GB HBM2 at 900 GB/s. Links:
    PCIe 3.0 x16, ~15.75 GB/s each way (8 GT/s x 16 lanes, 128b/130b), 5 us per
    message. Kernel launch overhead 5 us (an assumption).

    Args:
      dtype: ``"f32"`` or ``"f16"``; V100 has no TF32 or bf16 tensor cores.

    Returns:
      A 4-device, single-node `Topology`.
    """
    return _build("v100-pcie-4", 4, dtype)


def dgx_a100(num_nodes: int = 1, dtype: str = "bf16") -> Topology:
    """DGX A100 80GB nodes of 8 GPUs: NVSwitch inside a node, HDR InfiniBand between nodes.

    Figures (NVIDIA A100 Tensor Core GPU datasheet, 2021, "A100 80GB SXM";
    NVIDIA DGX A100 System Architecture whitepaper, 2020): dense 19.5 / 156 /
    312 / 312 TFLOPS for f32 / tf32 / f16 / bf16, 80 GB HBM2e at 2,039 GB/s,
    NVLink 300 GB/s each way to every peer through NVSwitch (3 us per message),
    one 200 Gb/s HDR port per GPU = 25 GB/s each way between nodes (8 us).
    Kernel launch overhead 5 us (an assumption).

    Args:
      num_nodes: how many DGX A100 nodes; devices ``8k..8k+7`` are node ``k``.
      dtype: one of ``"f32"``, ``"tf32"``, ``"f16"``, ``"bf16"``.

    Returns:
      A `Topology` with ``8 * num_nodes`` devices.
    """
    num_nodes = _positive_int("dgx-a100-80gb", "num_nodes", num_nodes)
    return _build("dgx-a100-80gb", 8 * num_nodes, dtype)


def dgx_h100(num_nodes: int = 1, dtype: str = "bf16") -> Topology:
    """DGX H100 nodes of 8 H100 SXM 80GB GPUs: NVSwitch inside, NDR InfiniBand between nodes.

    Figures (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022, and
    NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM"; NVIDIA DGX H100
    datasheet): dense 66.9 / 494.7 / 989.4 / 989.4 TFLOPS for f32 / tf32 / f16 /
    bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 450 GB/s each way to every peer
    through NVSwitch (3 us per message), one 400 Gb/s NDR port per GPU =
    50 GB/s each way between nodes (8 us). Kernel launch overhead 5 us (an
    assumption).

    Args:
      num_nodes: how many DGX H100 nodes; devices ``8k..8k+7`` are node ``k``.
      dtype: one of ``"f32"``, ``"tf32"``, ``"f16"``, ``"bf16"``.

    Returns:
      A `Topology` with ``8 * num_nodes`` devices.
    """
    num_nodes = _positive_int("dgx-h100", "num_nodes", num_nodes)
    return _build("dgx-h100", 8 * num_nodes, dtype)


def dgx_h200(num_nodes: int = 1, dtype: str = "bf16") -> Topology:
    """DGX H200 nodes of 8 H200 SXM 141GB GPUs: a DGX H100 with more, faster memory.

    Figures (NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM"; NVIDIA DGX
    H200 datasheet): the H100 SXM's dense 66.9 / 494.7 / 989.4 / 989.4 TFLOPS
    for f32 / tf32 / f16 / bf16, 141 GB HBM3e at 4.8 TB/s, NVLink 450 GB/s each
    way to every peer through NVSwitch (3 us per message), one 400 Gb/s NDR
    port per GPU = 50 GB/s each way between nodes (8 us). Kernel launch
    overhead 5 us (an assumption).

    Arguments and result as :func:`dgx_h100`'s.
    """
    num_nodes = _positive_int("dgx-h200", "num_nodes", num_nodes)
    return _build("dgx-h200", 8 * num_nodes, dtype)


def dgx_b200(num_nodes: int = 1, dtype: str = "bf16") -> Topology:
    """DGX B200 nodes of 8 B200 GPUs: fifth-generation NVLink inside, NDR InfiniBand between nodes.

    Figures (NVIDIA HGX B200 specifications, per GPU; NVIDIA DGX B200
    datasheet): dense 75 / 1,100 / 2,250 / 2,250 TFLOPS for f32 / tf32 / f16 /
    bf16 (the tensor figures are the sparse ones halved), 180 GB HBM3e at
    7.7 TB/s, NVLink 900 GB/s each way to every peer through NVSwitch (3 us
    per message, as NVLink 4), one 400 Gb/s NDR port per GPU = 50 GB/s each
    way between nodes (8 us). Kernel launch overhead 5 us (an assumption).
    FP8 and FP4, which Blackwell also runs, are not among the compute dtypes.

    Arguments and result as :func:`dgx_h100`'s.
    """
    num_nodes = _positive_int("dgx-b200", "num_nodes", num_nodes)
    return _build("dgx-b200", 8 * num_nodes, dtype)


def cluster(node: str, num_devices: int, dtype: str = "bf16") -> Topology:
    """``num_devices`` GPUs of the server ``node``, filling whole nodes first.

    Args:
      node: a preset name from `preset_names`, e.g. ``"dgx-h100"``.
      num_devices: a positive multiple of the GPUs per node (8 for the DGX
        presets), or at most that many for part of one node. The V100 server
        has no scale-out network, so it takes 1..4 only.
      dtype: the compute dtype; see `COMPUTE_DTYPES`.

    Returns:
      A `Topology` whose ``node_of_device`` is ``device // gpus_per_node``.

    Raises:
      ValueError: for an unknown node or dtype, or a device count that does
        not fill whole nodes.
    """
    if node not in _NODES:
        raise ValueError(f"unknown preset {node!r}; expected one of {preset_names()}")
    spec = _NODES[node]
    per_node = spec.gpus_per_node
    if spec.inter_bandwidth is None:
        allowed = f"1..{per_node} (a single server, no network between servers)"
    else:
        allowed = f"a positive multiple of {per_node} (whole nodes) or 1..{per_node} (part of one node)"
    is_int = isinstance(num_devices, (int, np.integer)) and not isinstance(num_devices, (bool, np.bool_))
    if is_int and num_devices >= 1:
        fits = num_devices <= per_node or (spec.inter_bandwidth is not None and num_devices % per_node == 0)
    else:
        fits = False
    if not fits:
        raise ValueError(f"{node}: num_devices must be {allowed}, got {num_devices!r}")
    return _build(node, int(num_devices), dtype)


PRESETS: dict[str, Callable[..., Topology]] = {
    "v100-pcie-4": v100_pcie_server,
    "dgx-a100-80gb": dgx_a100,
    "dgx-h100": dgx_h100,
    "dgx-h200": dgx_h200,
    "dgx-b200": dgx_b200,
}


def register_calibrated_preset(name: str, base: str, scales: Mapping[str, float]) -> None:
    """Registers preset ``name``: server preset ``base`` with its figures scaled, so
    that sweeps (``StrategySpace(hardware=...)``) and :func:`get_preset` can name it.

    Args:
      name: the new preset's name (no ``":"``), not yet registered.
      base: a registered server preset, e.g. ``"dgx-a100-80gb"``.
      scales: factors by field, as :attr:`distir_jax.calibrate.Calibration.scales`
        gives them: ``peak_flops`` (every dtype's peak), ``memory_bandwidth``,
        ``link_bandwidth`` and ``link_latency`` (within nodes, and between
        them unless ``network_bandwidth`` / ``network_latency`` give those
        their own factors), and ``launch_overhead``; fields left out keep
        their figures.

    Raises:
      ValueError: for a name that is taken (by another preset than this very
        one) or malformed, an unknown base or field, or a factor that is not
        positive and finite.

    The preset lives in this process; :func:`distir_jax.calibrate.save_calibration`
    writes it to a file that ``load_calibration`` (and the CLI's ``--presets``) reads back.
    """
    from distir_jax.calibrate import (  # what a calibration scales
        CALIBRATABLE_FIELDS,
        NETWORK_FIELDS,
        check_scales,
    )

    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a preset name is a non-empty string without ':', got {name!r}")
    if base not in _NODES:
        raise ValueError(f"unknown base preset {base!r}; expected one of {sorted(_NODES)}")
    check_scales(scales)
    s = {field: float(scales.get(field, 1.0)) for field in CALIBRATABLE_FIELDS}
    # The links between nodes: their own factors where given, else the links' (NETWORK_FIELDS).
    network = {link: float(scales.get(field, s[link])) for field, link in NETWORK_FIELDS.items()}
    spec = _NODES[base]
    gpu = dataclasses.replace(
        spec.gpu,
        model=f"{spec.gpu.model} ({name})",
        peak_flops={dtype: flops * s["peak_flops"] for dtype, flops in spec.gpu.peak_flops.items()},
        memory_bandwidth=spec.gpu.memory_bandwidth * s["memory_bandwidth"],
        peak_scale=spec.gpu.peak_scale * s["peak_flops"],
    )
    networked = spec.inter_bandwidth is not None
    node = dataclasses.replace(
        spec,
        gpu=gpu,
        intra_bandwidth=spec.intra_bandwidth * s["link_bandwidth"],
        intra_latency=spec.intra_latency * s["link_latency"],
        inter_bandwidth=spec.inter_bandwidth * network["link_bandwidth"] if networked else None,
        inter_latency=spec.inter_latency * network["link_latency"] if networked else None,
        launch_overhead=spec.launch_overhead * s["launch_overhead"],
    )
    if name in PRESETS:
        if _NODES.get(name) == node:
            return  # the same preset again (a calibration file loaded twice)
        raise ValueError(f"preset {name!r} is already registered; pick another name")
    _NODES[name] = node
    dtype = inspect.signature(PRESETS[base]).parameters["dtype"].default

    def constructor(num_nodes: int = 1, dtype: str = dtype) -> Topology:
        num_nodes = _positive_int(name, "num_nodes", num_nodes)
        if num_nodes > 1 and not networked:
            raise ValueError(f"{name}: one server with no network between servers; num_nodes must be 1")
        return _build(name, _NODES[name].gpus_per_node * num_nodes, dtype)

    PRESETS[name] = constructor


def fp8_problem(preset: str, dtype: str) -> str:
    """Why ``preset``'s GPUs (``"name"`` or ``"name:N"``) cannot run a ``dtype``
    model's GEMMs in FP8 (training precision ``"mixed-fp8"``), or ``""``. The
    cost model charges an FP8 GEMM half its flops at ``dtype``'s peak, so the
    GPU's FP8 tensor cores must run at exactly twice that peak (as on H100,
    H200 and B200)."""
    name = preset.partition(":")[0]
    if name not in _NODES:
        return f"unknown preset {name!r}; expected one of {sorted(_NODES)}"
    gpu = _NODES[name].gpu
    if "fp8" in gpu.unsupported:
        return f"{name}: training_precision 'mixed-fp8' needs FP8 tensor cores: {gpu.unsupported['fp8']}"
    fp8, half = gpu.peak_flops.get("fp8"), gpu.peak_flops.get(dtype)
    if fp8 is None or half is None or not math.isclose(fp8, 2 * half, rel_tol=1e-3):
        return (
            f"{name}: training_precision 'mixed-fp8' needs FP8 tensor cores at twice the {dtype} peak "
            f"(the {gpu.model}'s figures: fp8 {fp8}, {dtype} {half} FLOP/s)"
        )
    return ""


def datasheet_peak_flops(preset: str, dtype: str) -> float:
    """One GPU's datasheet peak FLOP/s in ``dtype`` on ``preset`` (``"name"`` or
    ``"name:N"``), before any calibration's factor: what model FLOPs utilization
    is measured against (a calibrated peak is what runs reach)."""
    name = preset.partition(":")[0]
    if name not in _NODES:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(_NODES)}")
    spec = _NODES[name]
    return _peak_flops(name, spec.gpu, dtype) / spec.gpu.peak_scale


def preset_names() -> list[str]:
    """The registered preset names, sorted."""
    return sorted(PRESETS)


def get_preset(name: str, **kwargs) -> Topology:
    """Builds a preset by name; ``"<preset>:<N>"`` asks for ``N`` GPUs.

    Args:
      name: a key of `PRESETS` (``"dgx-a100-80gb"``), or a key and a GPU
        count (``"dgx-a100-80gb:16"`` is two nodes, see `cluster`).
      **kwargs: passed on to the constructor (``dtype=``, ``num_nodes=``);
        with a count, only ``dtype`` is accepted.

    Returns:
      The `Topology`.

    Raises:
      ValueError: for an unknown name, a malformed count, or arguments the
        constructor does not take.
    """
    if not isinstance(name, str):
        raise ValueError(f"a preset name is a string such as 'dgx-a100-80gb:16', got {name!r}")
    base, sep, count = name.partition(":")
    if base not in PRESETS:
        raise ValueError(f"unknown preset {base!r} in {name!r}; expected one of {preset_names()}")
    if not sep:
        constructor = PRESETS[base]
        try:
            inspect.signature(constructor).bind(**kwargs)
        except TypeError as err:
            # Unknown keyword arguments are a usage error, reported like the rest.
            raise ValueError(f"{base}: bad arguments {sorted(kwargs)}: {err}") from None
        return constructor(**kwargs)
    if not (count.isascii() and count.isdigit()):
        raise ValueError(
            f"preset {name!r}: the GPU count after ':' must be a positive integer, got {count!r}"
        )
    extra = sorted(set(kwargs) - {"dtype"})
    if extra:
        raise ValueError(
            f"preset {name!r} already gives the GPU count; only dtype= may be passed, got {extra}"
        )
    return cluster(base, int(count), **kwargs)


# --- JSON --------------------------------------------------------------------

FORMAT_VERSION = 1
_VECTOR_KEYS = ("peak_flops", "memory_bandwidth", "memory_capacity")
_MATRIX_KEYS = ("link_bandwidth", "link_latency")
_KEYS = ("format_version", "name", *_VECTOR_KEYS, *_MATRIX_KEYS, "launch_overhead", "node_of_device")


def _dumps(value) -> str:
    # json writes floats with repr(), the shortest string that parses back to
    # the same double, so the round trip is exact. Non-finite values come out
    # as the (non-standard) Infinity, which json.loads reads back.
    return json.dumps(value, separators=(",", ":"))


def topology_to_json(topo: Topology) -> str:
    """Serializes ``topo`` to JSON: one key per line, one matrix row per line.

    Args:
      topo: the topology.

    Returns:
      A JSON object with the keys of format version 1: ``format_version``,
      ``name``, the ``[D]`` vectors, the ``[D, D]`` matrices as lists of rows,
      ``launch_overhead`` and ``node_of_device``.
    """
    lines = [f'"format_version": {FORMAT_VERSION}', f'"name": {_dumps(topo.name)}']
    for key in _VECTOR_KEYS:
        lines.append(f'"{key}": {_dumps(getattr(topo, key).tolist())}')
    for key in _MATRIX_KEYS:
        rows = ",\n  ".join(_dumps(row) for row in getattr(topo, key).tolist())
        lines.append(f'"{key}": [\n  {rows}\n ]')
    lines.append(f'"launch_overhead": {_dumps(float(topo.launch_overhead))}')
    lines.append(f'"node_of_device": {_dumps(topo.node_of_device.tolist())}')
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def _array(key: str, value: Any, shape: tuple[int, ...], kinds: str) -> np.ndarray:
    """``value`` as an array of ``shape`` whose dtype kind is one of ``kinds``."""
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged nested lists
        arr = None
    if arr is None or arr.dtype.kind not in kinds or arr.shape != shape:
        what = "integers" if kinds == "iu" else "numbers"
        found = "ragged lists" if arr is None else f"dtype {arr.dtype}, shape {list(arr.shape)}"
        raise ValueError(f"topology JSON: {key!r} must be {what} of shape {list(shape)}, got {found}")
    return arr


def topology_from_json(text: str) -> Topology:
    """Parses the output of `topology_to_json`.

    Args:
      text: JSON text with exactly the keys of format version 1.

    Returns:
      The `Topology`, equal bit for bit to the one serialized.

    Raises:
      ValueError: for invalid JSON, an unknown ``format_version``, a missing or
        unexpected key (named in the message), or a value of the wrong type or
        shape.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"topology JSON: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"topology JSON: expected an object, got {type(data).__name__}")
    if "format_version" not in data:
        raise ValueError("topology JSON: missing key 'format_version'")
    version = data["format_version"]
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise ValueError(f"topology JSON: unsupported 'format_version' {version!r}; this reader knows 1")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise ValueError(f"topology JSON: missing key(s) {missing}")
    extra = sorted(k for k in data if k not in _KEYS)
    if extra:
        raise ValueError(f"topology JSON: unexpected key(s) {extra}; expected exactly {list(_KEYS)}")
    if not isinstance(data["name"], str):
        raise ValueError(f"topology JSON: 'name' must be a string, got {data['name']!r}")
    overhead = data["launch_overhead"]
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)):
        raise ValueError(f"topology JSON: 'launch_overhead' must be a number, got {overhead!r}")
    peak = data["peak_flops"]
    if not isinstance(peak, list) or not peak:
        raise ValueError(f"topology JSON: 'peak_flops' must be a non-empty list of numbers, got {peak!r}")
    num_devices = len(peak)
    arrays = {k: _array(k, data[k], (num_devices,), "if") for k in _VECTOR_KEYS}
    arrays.update({k: _array(k, data[k], (num_devices, num_devices), "if") for k in _MATRIX_KEYS})
    nodes = _array("node_of_device", data["node_of_device"], (num_devices,), "iu")
    return Topology(
        name=data["name"],
        launch_overhead=float(overhead),
        node_of_device=nodes,
        **{k: v.astype(np.float64) for k, v in arrays.items()},
    )


def save_topology(topo: Topology, path: str | os.PathLike) -> None:
    """Writes ``topo`` to ``path`` as `topology_to_json` text (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(topology_to_json(topo))


def load_topology(path: str | os.PathLike) -> Topology:
    """Reads a topology written by `save_topology`."""
    with open(path, encoding="utf-8") as f:
        return topology_from_json(f.read())
