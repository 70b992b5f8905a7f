"""Step-time elasticities: derivatives through the kernel, checked against the reference simulator."""

import dataclasses

import numpy as np
import pytest

import distir_jax as dj
from distir_jax.calibrate import CALIBRATABLE_FIELDS, NETWORK_FIELDS, scaled_topology
from distir_jax.sensitivity import SPEED_FIELDS, TIME_FIELDS
from distir_jax.testing import random_function

# Relative step of the finite differences, in log figure (1%).
H = 0.01
# The figures of a cluster of one node (no links between nodes).
NODE_FIELDS = tuple(f for f in CALIBRATABLE_FIELDS if f not in NETWORK_FIELDS)


def _two_nodes_of_two() -> dj.Topology:
    """Devices 0, 1, 8, 9 of two DGX A100 nodes: NVSwitch within a node, InfiniBand between."""
    whole, kept = dj.get_preset("dgx-a100-80gb:16"), np.array([0, 1, 8, 9])
    pair = np.ix_(kept, kept)
    vectors = {f: getattr(whole, f)[kept] for f in ("peak_flops", "memory_bandwidth", "memory_capacity")}
    return dataclasses.replace(
        whole,
        name="two DGX A100 nodes, two GPUs each",
        link_bandwidth=whole.link_bandwidth[pair],
        link_latency=whole.link_latency[pair],
        node_of_device=whole.node_of_device[kept],
        **vectors,
    )


def _budget(elasticities: dict) -> np.ndarray:
    """Speeds' elasticities minus the times': -1 for any homogeneous step time."""
    speeds = sum(elasticities[f] for f in SPEED_FIELDS if f in elasticities)
    return speeds - sum(elasticities[f] for f in TIME_FIELDS if f in elasticities)


def _reference_time(fn, topology, field, log_factor, fields=NODE_FIELDS) -> float:
    """The reference step time with ``field`` scaled as its elasticity among ``fields``
    means it: a link field next to its network field, within nodes only."""
    scales = {field: float(np.exp(log_factor))}
    scales |= {net: 1.0 for net, link in NETWORK_FIELDS.items() if link == field and net in fields}
    return dj.reference_simulate(fn, scaled_topology(topology, scales)).step_time


@pytest.mark.parametrize("seed,nodes", [(0, 1), (1, 1), (2, 2), (3, 2)])
def test_elasticities_are_subgradients_of_the_reference_step_time(seed, nodes):
    """A step time is convex in each figure's log factor (max-plus in costs that are
    convex and monotone in it), so any derivative the kernel reports, ties
    included, lies between the reference simulator's backward and forward
    differences; and the budget is exact. On two nodes the links between them
    (the network figures) count apart from those within a node."""
    topology = dj.get_preset("dgx-a100-80gb:4") if nodes == 1 else _two_nodes_of_two()
    fn = random_function(seed, 60, 4, num_streams=2, batch=256, hidden=512, comm_fraction=0.3)
    found = dj.step_time_elasticities([dj.lower(fn, topology)], topology)
    assert list(found) == list(NODE_FIELDS if nodes == 1 else CALIBRATABLE_FIELDS)
    if nodes == 2:  # both fabrics are on the critical path
        assert found["network_bandwidth"][0] < 0 and found["link_bandwidth"][0] < 0
    np.testing.assert_allclose(_budget(found), -1.0, atol=1e-12)
    at = dj.reference_simulate(fn, topology).step_time
    for field, (value,) in found.items():
        backward = (at - _reference_time(fn, topology, field, -H, tuple(found))) / H
        forward = (_reference_time(fn, topology, field, H, tuple(found)) - at) / H
        slope = value * at  # d(step time) / d(log factor)
        assert backward - 1e-9 * at <= slope <= forward + 1e-9 * at, (field, backward, slope, forward)
        assert (value <= 0) if field in SPEED_FIELDS else (value >= 0), (field, value)


def test_a_send_rests_on_link_bandwidth_and_latency_in_proportion():
    """One Send: its time is latency plus bytes over bandwidth, and the two
    elasticities are those parts' shares of it."""
    topology = dj.get_preset("dgx-a100-80gb:2")
    fn = dj.calibration_probes()["large_send"]
    found = dj.step_time_elasticities([dj.lower(fn, topology)], topology)
    total = dj.reference_simulate(fn, topology).step_time
    latency = float(np.asarray(topology.link_latency)[0, 1])  # one hop between two devices
    assert found["link_latency"][0] == pytest.approx(latency / total, rel=1e-9)
    assert found["link_bandwidth"][0] == pytest.approx(-(total - latency) / total, rel=1e-9)
    for field in ("peak_flops", "memory_bandwidth", "launch_overhead"):
        assert found[field][0] == 0.0


def test_the_network_and_the_links_within_a_node_split_the_links_elasticity():
    """Sends within a node and across nodes: with the network figures, ``link_*``
    is the part within a node and ``network_*`` the rest; without, ``link_*`` is
    their sum (every link scaled at once); a send across nodes rests on the
    network figures alone, in proportion to its latency and transfer time."""
    topology = _two_nodes_of_two()
    b = dj.FunctionBuilder("both_fabrics")
    near = b.add("Send", b.input("x", (2048, 2048)), to=1)
    far = b.add("Send", b.input("y", (1024, 1024), device=1), to=2)
    program = dj.lower(b.build(near, far), topology)
    split = dj.step_time_elasticities([program], topology)
    whole = dj.step_time_elasticities([program], topology, fields=NODE_FIELDS)
    for link, network in (("link_bandwidth", "network_bandwidth"), ("link_latency", "network_latency")):
        assert split[link][0] + split[network][0] == pytest.approx(whole[link][0], rel=1e-12)
        assert split[network][0] != 0.0 and split[link][0] != whole[link][0]
    np.testing.assert_allclose(_budget(split), -1.0, atol=1e-12)

    fn = dj.calibration_probes(network_peer=2)["large_network_send"]
    found = dj.step_time_elasticities([dj.lower(fn, topology)], topology)
    total = dj.reference_simulate(fn, topology).step_time
    latency = float(topology.link_latency[0, 2])
    assert found["network_latency"][0] == pytest.approx(latency / total, rel=1e-9)
    assert found["network_bandwidth"][0] == pytest.approx(-(total - latency) / total, rel=1e-9)
    assert found["link_bandwidth"][0] == found["link_latency"][0] == 0.0


def test_several_programs_and_chosen_fields():
    topology = dj.get_preset("dgx-a100-80gb:2")
    programs = [dj.lower(dj.calibration_probes()[k], topology) for k in ("matmul", "elementwise")]
    found = dj.step_time_elasticities(programs, topology, fields=("peak_flops", "memory_bandwidth"))
    assert list(found) == ["peak_flops", "memory_bandwidth"]
    # The MatMul is compute-bound, the Relu memory-bound (launch overhead aside).
    assert found["peak_flops"][0] < -0.95 and found["memory_bandwidth"][0] == 0.0
    assert found["memory_bandwidth"][1] < -0.95 and found["peak_flops"][1] == 0.0


def test_bad_arguments_are_named():
    topology = dj.get_preset("dgx-a100-80gb:2")
    program = dj.lower(dj.calibration_probes()["matmul"], topology)
    with pytest.raises(TypeError, match="sequence of lowered Programs"):
        dj.step_time_elasticities(program, topology)
    with pytest.raises(ValueError, match="at least one program"):
        dj.step_time_elasticities([], topology)
    with pytest.raises(ValueError, match=r"unknown \['flops'\]"):
        dj.step_time_elasticities([program], topology, fields=["flops"])
    with pytest.raises(ValueError, match="distinct"):
        dj.step_time_elasticities([program], topology, fields=["peak_flops", "peak_flops"])
    two = dj.lower(dj.calibration_probes()["large_send"], topology)
    with pytest.raises(ValueError, match="lowered for up to 2 devices"):
        dj.step_time_elasticities([two], dj.get_preset("dgx-a100-80gb:1"))
    for topology_ in (None, "dgx-a100-80gb:2"):  # was an AttributeError from the hardware's assembly
        with pytest.raises(TypeError, match="topology must be a Topology"):
            dj.step_time_elasticities([program], topology_)
        with pytest.raises(TypeError, match="topology must be a Topology"):
            dj.calibrate([program], [1.0], topology_)
    with pytest.raises(ValueError, match="a field name or a sequence of them"):
        dj.step_time_elasticities([program], topology, fields=b"peak_flops")
    (key,) = dj.step_time_elasticities([program], topology, fields=[np.str_("peak_flops")])
    assert type(key) is str


def test_a_program_that_takes_no_time_is_named_by_program_and_variant():
    """Size variants are rows of the stacked batch: the error names the program the
    caller passed (and its variant), not the row."""
    topology = dataclasses.replace(dj.get_preset("dgx-a100-80gb:2"), launch_overhead=0.0)
    b = dj.FunctionBuilder("sizes")
    relu = b.add("Relu", b.input("x", (np.array([64, 0]), 64)))  # no bytes at all at 0 rows
    sizes = dj.lower(b.build(relu), topology)
    matmul = dj.lower(dj.calibration_probes()["matmul"], topology)
    with pytest.raises(ValueError, match=r"program 0 \(size variant 1\) simulates in 0 s"):
        dj.step_time_elasticities([sizes, matmul], topology)
    with pytest.raises(ValueError, match=r"program 1 \(size variant 1\) simulates in 0 s"):
        dj.step_time_elasticities([matmul, sizes], topology)


def test_configurations_coarse_programs_have_the_fine_programs_elasticities():
    """The fast engine's coarse program (its fine ops' roofline sides fixed on the
    preset) has the fine program's derivatives: pipelines, tensor and data
    parallelism, gradient overlap and ZeRO, recomputation."""
    from distir_jax.models import TransformerConfig
    from search import config_elasticities, make_config

    tiny = TransformerConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=512, seq_len=64)
    for knobs in (
        dict(batch_size=16, data=2, tensor=2, pipeline=2, microbatches=4, overlap_grad_comm=True, zero=True),
        dict(batch_size=16, tensor=2, pipeline=2, microbatches=4, schedule="interleaved", virtual_stages=2),
        dict(batch_size=8, data=4, recompute="full", optimizer="adam"),
    ):
        config = make_config(tiny, **knobs)
        fast = config_elasticities(config)
        exact = config_elasticities(config, engine="exact")
        assert list(fast) == list(NODE_FIELDS)
        for field in NODE_FIELDS:
            assert fast[field] == pytest.approx(exact[field], abs=1e-9), (knobs, field)
        assert _budget(fast) == pytest.approx(-1.0)


def test_configuration_errors_are_named():
    from search import config_elasticities, make_config

    with pytest.raises(TypeError, match="search.Config"):
        config_elasticities("gpt2-small")
    with pytest.raises(ValueError, match="invalid configuration"):
        config_elasticities(make_config("gpt2-small", batch_size=3, data=2))
    with pytest.raises(ValueError, match="engine must be one of"):
        config_elasticities(make_config("mlp-xs", batch_size=8), engine="slow")


def test_simulate_prints_the_sensitivity(capsys):
    from distir_jax.cli import main

    assert main(["simulate", "--model", "mlp-xs", "--batch-size", "64", "--data", "2", "--sensitivity"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("sensitivity:"))
    rows = [line.split() for line in lines[start + 2 : start + 2 + len(NODE_FIELDS)]]
    assert [row[0] for row in rows] == list(NODE_FIELDS)
    values = {row[0]: float(row[1].rstrip("%")) for row in rows}
    assert _budget(values) == pytest.approx(-1.0, abs=1e-3)  # printed to 4 decimals
    assert all(not row[2].startswith("-") for row in rows)  # shares are sizes


def test_a_figure_the_step_does_not_depend_on_has_no_negative_share(capsys):
    """A speed's elasticity is +0.0 where the step does not depend on it (a
    memory-bound MLP's peak FLOP/s): its share prints as 0.0%, not -0.0%."""
    from distir_jax.cli import _print_sensitivity

    _print_sensitivity({"peak_flops": 0.0, "memory_bandwidth": -1.0, "launch_overhead": 0.0})
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[2] for row in rows] == ["0.0%", "100.0%", "0.0%"]
