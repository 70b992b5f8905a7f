"""Hardware presets: published figures, layout of nodes and links, exact JSON round trip."""

import json

import numpy as np
import pytest

from distir_jax import presets
from distir_jax.ir.topology import Topology

# Every (preset, dtype) pair the presets support; bf16 / tf32 on V100 are errors.
SUPPORTED = [
    ("v100-pcie-4", "f32"),
    ("v100-pcie-4", "f16"),
    *[
        (name, dtype)
        for name in ("dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200")
        for dtype in presets.COMPUTE_DTYPES
    ],
]

# name -> (dtype, peak FLOP/s, HBM bytes/s, bytes, intra-node bytes/s, inter-node bytes/s)
PUBLISHED = {
    "v100-pcie-4": ("f32", 14e12, 900e9, 16e9, 16 * 8e9 * 128 / 130 / 8, None),
    "dgx-a100-80gb": ("bf16", 312e12, 2.039e12, 80e9, 300e9, 25e9),
    "dgx-h100": ("bf16", 989.4e12, 3.35e12, 80e9, 450e9, 50e9),
    "dgx-h200": ("bf16", 989.4e12, 4.8e12, 141e9, 450e9, 50e9),
    "dgx-b200": ("bf16", 2.25e15, 7.7e12, 180e9, 900e9, 50e9),
}


def all_preset_topologies():
    """One topology per supported preset/dtype, plus multi-node and partial layouts."""
    topos = [presets.get_preset(name, dtype=dtype) for name, dtype in SUPPORTED]
    topos += [
        presets.dgx_a100(num_nodes=3, dtype="tf32"),
        presets.dgx_h100(num_nodes=2),
        presets.get_preset("dgx-h100:4", dtype="f16"),
        presets.get_preset("v100-pcie-4:2", dtype="f16"),
    ]
    return topos


def bits(arr):
    """The raw bytes of an array, so equality is bit for bit (0.0 vs -0.0, NaN payloads)."""
    return np.ascontiguousarray(arr).tobytes()


# --- Construction and published figures -------------------------------------


@pytest.mark.parametrize("name,dtype", SUPPORTED)
def test_every_preset_builds(name, dtype):
    topo = presets.get_preset(name, dtype=dtype)
    assert isinstance(topo, Topology)
    assert topo.num_devices == {"v100-pcie-4": 4}.get(name, 8)
    assert np.all(topo.peak_flops > 0)
    assert np.all(np.diag(topo.link_bandwidth) > 0)
    np.testing.assert_array_equal(topo.link_bandwidth, topo.link_bandwidth.T)
    np.testing.assert_array_equal(topo.link_latency, topo.link_latency.T)
    assert topo.launch_overhead == 5e-6
    assert dtype in topo.name and name in topo.name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_figures(name):
    dtype, flops, hbm_bw, capacity, intra_bw, _ = PUBLISHED[name]
    topo = presets.get_preset(name, dtype=dtype)
    np.testing.assert_array_equal(topo.peak_flops, flops)
    np.testing.assert_array_equal(topo.memory_bandwidth, hbm_bw)
    np.testing.assert_array_equal(topo.memory_capacity, capacity)
    np.testing.assert_allclose(topo.link_bandwidth[0, 1], intra_bw, rtol=1e-12)


@pytest.mark.parametrize(
    "builder,expected",
    [
        (presets.v100_pcie_server, {"f32": 14e12, "f16": 112e12}),
        (presets.dgx_a100, {"f32": 19.5e12, "tf32": 156e12, "f16": 312e12, "bf16": 312e12}),
        (presets.dgx_h100, {"f32": 66.9e12, "tf32": 494.7e12, "f16": 989.4e12, "bf16": 989.4e12}),
        (presets.dgx_h200, {"f32": 66.9e12, "tf32": 494.7e12, "f16": 989.4e12, "bf16": 989.4e12}),
        (presets.dgx_b200, {"f32": 75e12, "tf32": 1.1e15, "f16": 2.25e15, "bf16": 2.25e15}),
    ],
)
def test_dense_peak_flops_per_dtype(builder, expected):
    for dtype, flops in expected.items():
        assert builder(dtype=dtype).peak_flops[0] == flops


def test_h100_dense_is_half_the_sparse_datasheet_figure():
    # The H100 datasheet quotes 1,979 TFLOPS bf16 *with sparsity*; dense is half.
    assert presets.dgx_h100().peak_flops[0] == pytest.approx(1979e12 / 2, rel=1e-3)
    # So are B200's (HGX B200: 4.5 PFLOPS bf16 and 2.2 PFLOPS tf32 with sparsity).
    assert presets.dgx_b200().peak_flops[0] == 4.5e15 / 2
    assert presets.dgx_b200(dtype="tf32").peak_flops[0] == 2.2e15 / 2


def test_fp8_gemms_need_fp8_tensor_cores_at_twice_the_half_precision_peak(monkeypatch):
    """``fp8_problem``: training precision "mixed-fp8" charges an FP8 GEMM half its
    flops at the model dtype's peak, so only GPUs whose FP8 peak is twice it run it
    (H100 / H200 whitepaper: 1,978.9 dense TFLOPS; HGX B200: 9 PFLOPS sparse)."""
    for name in ("dgx-h100", "dgx-h200:16", "dgx-b200"):
        assert presets.fp8_problem(name, "bf16") == presets.fp8_problem(name, "f16") == ""
    assert presets._NODES["dgx-b200"].gpu.peak_flops["fp8"] == 9e15 / 2
    for registry in ("_NODES", "PRESETS"):  # the preset below lives in this test only
        monkeypatch.setattr(presets, registry, dict(getattr(presets, registry)))
    presets.register_calibrated_preset("h100-fp8-slow", "dgx-h100", {"peak_flops": 0.7})
    assert presets.fp8_problem("h100-fp8-slow", "bf16") == ""  # one factor scales every peak
    assert "A100 (Ampere) has no FP8 tensor cores" in presets.fp8_problem("dgx-a100-80gb:8", "bf16")
    assert "V100 (Volta) has no FP8" in presets.fp8_problem("v100-pcie-4", "f16")
    assert "twice the f32 peak" in presets.fp8_problem("dgx-h100", "f32")
    assert "unknown preset 'tpu'" in presets.fp8_problem("tpu:8", "bf16")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):  # not a model dtype
        presets.dgx_h100(dtype="fp8")


def test_pcie3_bandwidth_is_one_direction():
    # ~15.75 GB/s each way; the datasheet's 32 GB/s counts both directions.
    assert presets.PCIE3_X16_BANDWIDTH == pytest.approx(15.75e9, rel=1e-3)


def test_defaults():
    assert presets.v100_pcie_server().name == "v100-pcie-4:4 f32"
    assert presets.dgx_a100().name == "dgx-a100-80gb:8 bf16"
    assert presets.dgx_h100().name == "dgx-h100:8 bf16"
    assert presets.dgx_h200().name == "dgx-h200:8 bf16"
    assert presets.dgx_b200().name == "dgx-b200:8 bf16"


# --- Nodes and links --------------------------------------------------------


@pytest.mark.parametrize("name", ["dgx-a100-80gb", "dgx-h100", "dgx-h200", "dgx-b200"])
def test_intra_and_inter_node_links(name):
    _, _, _, _, intra_bw, inter_bw = PUBLISHED[name]
    topo = presets.get_preset(name, num_nodes=3)
    assert topo.num_devices == 24
    np.testing.assert_array_equal(topo.node_of_device, np.repeat([0, 1, 2], 8))
    same = topo.node_of_device[:, None] == topo.node_of_device[None, :]
    off_diag = ~np.eye(24, dtype=bool)
    np.testing.assert_array_equal(topo.link_bandwidth[same & off_diag], intra_bw)
    np.testing.assert_array_equal(topo.link_bandwidth[~same], inter_bw)
    np.testing.assert_array_equal(topo.link_latency[same & off_diag], presets.NVLINK_LATENCY)
    np.testing.assert_array_equal(topo.link_latency[~same], presets.INFINIBAND_LATENCY)
    assert np.all(np.diag(topo.link_bandwidth) == presets.SELF_LINK_BANDWIDTH)
    assert np.all(np.diag(topo.link_latency) == 0.0)
    # NVLink beats InfiniBand, and the slowest hop of a ring across nodes is IB.
    assert intra_bw > inter_bw
    a, b = topo.bottleneck_link([0, 1, 8, 9])
    assert topo.node_of_device[a] != topo.node_of_device[b]


def test_v100_links_are_pcie():
    topo = presets.v100_pcie_server()
    np.testing.assert_array_equal(topo.node_of_device, 0)
    off_diag = ~np.eye(4, dtype=bool)
    np.testing.assert_array_equal(topo.link_bandwidth[off_diag], presets.PCIE3_X16_BANDWIDTH)
    np.testing.assert_array_equal(topo.link_latency[off_diag], presets.PCIE_LATENCY)


def test_latencies_are_a_few_microseconds():
    for latency in (presets.NVLINK_LATENCY, presets.PCIE_LATENCY, presets.INFINIBAND_LATENCY):
        assert 1e-6 <= latency <= 10e-6
    assert presets.NVLINK_LATENCY < presets.INFINIBAND_LATENCY


@pytest.mark.parametrize("count,nodes", [(1, 1), (4, 1), (8, 1), (16, 2), (64, 8)])
def test_cluster_sizes(count, nodes):
    topo = presets.cluster("dgx-h100", count, dtype="f16")
    assert topo.num_devices == count
    assert len(set(topo.node_of_device.tolist())) == nodes
    same = presets.get_preset(f"dgx-h100:{count}", dtype="f16")
    assert same.name == topo.name
    assert bits(same.link_bandwidth) == bits(topo.link_bandwidth)


def test_name_with_count_matches_num_nodes():
    by_count = presets.get_preset("dgx-a100-80gb:16")
    by_nodes = presets.dgx_a100(num_nodes=2)
    for key in ("peak_flops", "memory_bandwidth", "link_bandwidth", "link_latency", "node_of_device"):
        assert bits(getattr(by_count, key)) == bits(getattr(by_nodes, key))


def test_registry():
    assert presets.preset_names() == ["dgx-a100-80gb", "dgx-b200", "dgx-h100", "dgx-h200", "v100-pcie-4"]
    assert set(presets.PRESETS) == set(presets.preset_names())
    assert all(callable(f) for f in presets.PRESETS.values())


# --- Bad inputs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: presets.dgx_a100(dtype="fp8"), r"dgx-a100-80gb: unknown dtype 'fp8'.*'f32', 'tf32'"),
        (lambda: presets.v100_pcie_server(dtype="bf16"), r"v100-pcie-4.*'bf16'.*no bf16 tensor cores"),
        (lambda: presets.v100_pcie_server(dtype="tf32"), r"v100-pcie-4.*'tf32'.*Ampere"),
        (lambda: presets.get_preset("v100-pcie-4:2", dtype="bf16"), r"no bf16 tensor cores"),
        (
            lambda: presets.cluster("dgx-a100-80gb", 12),
            r"dgx-a100-80gb: num_devices must be a positive "
            r"multiple of 8 .* or 1\.\.8 .*got 12",
        ),
        (lambda: presets.cluster("dgx-h100", 0), r"dgx-h100: num_devices must be .*multiple of 8.*got 0"),
        (lambda: presets.cluster("dgx-h100", -8), r"got -8"),
        (lambda: presets.cluster("dgx-h100", 8.0), r"got 8\.0"),
        (lambda: presets.cluster("dgx-h100", True), r"got True"),
        (lambda: presets.cluster("v100-pcie-4", 8), r"v100-pcie-4: num_devices must be 1\.\.4.*got 8"),
        (lambda: presets.cluster("dgx-gb300", 8), r"unknown preset 'dgx-gb300'.*'dgx-a100-80gb'"),
        (lambda: presets.dgx_h100(num_nodes=0), r"dgx-h100: num_nodes must be a positive integer, got 0"),
        (lambda: presets.get_preset("tpu-v4"), r"unknown preset 'tpu-v4'.*'dgx-h200', 'v100-pcie-4'"),
        (lambda: presets.get_preset("dgx-h100:12"), r"multiple of 8.*got 12"),
        (lambda: presets.get_preset("dgx-h100:two"), r"GPU count after ':' must be a positive integer"),
        (lambda: presets.get_preset("dgx-h100:"), r"GPU count after ':'"),
        (lambda: presets.get_preset("dgx-h100:16", num_nodes=2), r"only dtype= may be passed.*num_nodes"),
        (
            lambda: presets.get_preset("v100-pcie-4", num_nodes=2),
            r"v100-pcie-4: bad arguments \['num_nodes'\]",
        ),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- JSON ------------------------------------------------------------------------


@pytest.mark.parametrize("topo", all_preset_topologies(), ids=lambda t: t.name)
def test_json_round_trip_is_exact(topo, tmp_path):
    text = presets.topology_to_json(topo)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    path = tmp_path / "topo.json"
    presets.save_topology(topo, path)
    for back in (presets.topology_from_json(text), presets.load_topology(path)):
        assert back.name == topo.name
        assert back.launch_overhead == topo.launch_overhead
        for key in ("peak_flops", "memory_bandwidth", "memory_capacity", "link_bandwidth", "link_latency"):
            assert getattr(back, key).dtype == np.float64
            assert bits(getattr(back, key)) == bits(getattr(topo, key)), key
        np.testing.assert_array_equal(back.node_of_device, topo.node_of_device)
        assert presets.topology_to_json(back) == text


def test_json_round_trip_of_awkward_floats():
    # Values whose shortest repr has many digits, subnormals and infinities.
    rng = np.random.default_rng(0)
    n = 5
    topo = Topology(
        name='odd \u00b5 "quoted"',
        peak_flops=rng.uniform(1e12, 1e15, n),
        memory_bandwidth=np.array([0.1, 1 / 3, 5e-324, 1e308, 2.0**-1074 * 3]),
        memory_capacity=rng.uniform(0, 1e11, n),
        link_bandwidth=np.where(np.eye(n, dtype=bool), np.inf, rng.uniform(1e9, 1e12, (n, n))),
        link_latency=rng.uniform(0, 1e-5, (n, n)),
        launch_overhead=1 / 7,
        node_of_device=[0, 0, 3, 3, 7],
    )
    back = presets.topology_from_json(presets.topology_to_json(topo))
    assert back.name == topo.name and back.launch_overhead == topo.launch_overhead
    for key in ("peak_flops", "memory_bandwidth", "memory_capacity", "link_bandwidth", "link_latency"):
        assert bits(getattr(back, key)) == bits(getattr(topo, key)), key
    np.testing.assert_array_equal(back.node_of_device, topo.node_of_device)


def _doc(**changes):
    """The JSON object of a small preset with ``changes`` applied (None deletes a key)."""
    data = json.loads(presets.topology_to_json(presets.get_preset("dgx-h100:2")))
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    "text,match",
    [
        (_doc(format_version=None), r"missing key 'format_version'"),
        (_doc(format_version=2), r"unsupported 'format_version' 2"),
        (_doc(format_version="1"), r"unsupported 'format_version' '1'"),
        (_doc(format_version=True), r"unsupported 'format_version' True"),
        (_doc(link_latency=None), r"missing key\(s\) \['link_latency'\]"),
        (_doc(name=None, launch_overhead=None), r"missing key\(s\) \['name', 'launch_overhead'\]"),
        (_doc(bandwidth=[1.0]), r"unexpected key\(s\) \['bandwidth'\]"),
        (_doc(name=3), r"'name' must be a string"),
        (_doc(launch_overhead="5us"), r"'launch_overhead' must be a number"),
        (_doc(peak_flops=[]), r"'peak_flops' must be a non-empty list"),
        (_doc(memory_capacity=[1.0]), r"'memory_capacity' must be numbers of shape \[2\]"),
        (_doc(memory_bandwidth=["a", "b"]), r"'memory_bandwidth' must be numbers"),
        (_doc(link_bandwidth=[[1.0, 2.0], [3.0]]), r"'link_bandwidth' must be numbers .*ragged"),
        (_doc(link_latency=[0.0, 0.0]), r"'link_latency' must be numbers of shape \[2, 2\]"),
        (_doc(node_of_device=[0.0, 1.0]), r"'node_of_device' must be integers"),
        (_doc(link_bandwidth=[[1.0, 0.0], [0.0, 1.0]]), r"link_bandwidth must be > 0"),
        ("[1, 2]", r"expected an object, got list"),
        ('{"format_version": 1,', r"not valid JSON"),
    ],
)
def test_bad_json_raises(text, match):
    with pytest.raises(ValueError, match=match):
        presets.topology_from_json(text)
