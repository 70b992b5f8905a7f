"""The batched kernel against the pure-Python reference simulator."""

import dataclasses
import functools

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distir_jax.cost import COST_FEATURES, inverse_bandwidth, op_seconds
from distir_jax.executor.reference import reference_simulate
from distir_jax.hardware import Hardware, pad_hardware, stack_hardware
from distir_jax.ir import FunctionBuilder, Topology
from distir_jax.kernel import (
    STATUS_INVALID,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    conclude,
    hardware_rows,
    run_ops,
    simulate,
    start_timeline,
)
from distir_jax.lower import Capacity, lower, pad_program, stack_programs
from distir_jax.presets import dgx_a100
from distir_jax.testing.random_programs import random_function, random_functions

MAX_DEVICES = 4
# One capacity for every small random program, so the whole property test
# compiles the kernel once per precision.
SMALL = Capacity(num_ops=32, slots_per_op=4, deps_per_op=8, finish_slots=32, num_devices=4, num_resources=8)


def random_topology(rng: np.random.Generator, num_devices: int) -> Topology:
    bw = rng.uniform(1e9, 1e11, (num_devices, num_devices))
    return Topology(
        name="random",
        peak_flops=rng.uniform(1e12, 1e14, num_devices),
        memory_bandwidth=rng.uniform(1e11, 2e12, num_devices),
        memory_capacity=np.full(num_devices, 1e12),
        link_bandwidth=(bw + bw.T) / 2,
        link_latency=rng.uniform(0, 1e-5, (num_devices, num_devices)),
        launch_overhead=rng.uniform(0, 1e-5),
    )


def assert_matches_reference(result, index, fn, topology, rtol, costs=None):
    ref = reference_simulate(fn, topology, costs=costs)
    np.testing.assert_allclose(float(result.step_time[index]), ref.step_time, rtol=rtol, atol=1e-30)
    peak = np.asarray(result.peak_memory[index])
    for d, expected in ref.peak_memory.items():
        np.testing.assert_allclose(peak[d], expected, rtol=rtol)
    np.testing.assert_allclose(
        np.asarray(result.op_finish[index][: len(fn.ops)]), ref.op_finish, rtol=rtol, atol=1e-30
    )
    assert int(result.status[index]) == STATUS_OK


def run_one(fn, topology, capacity=SMALL, costs=None):
    program = pad_program(lower(fn, topology), capacity)
    hardware = pad_hardware(Hardware.from_topology(topology), capacity.num_devices)
    return simulate(program, hardware, costs, record_ops=True)


def slot_costs(fn, rng, capacity):
    """Random per-(op, device) costs, as the reference's dict and the kernel's table."""
    table = np.zeros((capacity.num_ops, capacity.slots_per_op))
    per_op = []
    for i, op in enumerate(fn.ops):
        c = {d: float(rng.uniform(0.1, 2.0)) for d in op.devices}
        per_op.append(c)
        table[i, : len(op.devices)] = [c[d] for d in op.devices]
    return per_op, table


@pytest.mark.parametrize("x64,rtol", [(True, 1e-9), (False, 1e-5)])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fn=random_functions(max_ops=SMALL.num_ops, max_devices=MAX_DEVICES, num_streams=2),
    seed=st.integers(0, 2**31),
)
def test_random_programs_match_reference(x64, rtol, fn, seed):
    topology = random_topology(np.random.default_rng(seed), MAX_DEVICES)
    with jax.enable_x64(x64):
        result = run_one(fn, topology)
        assert_matches_reference(result, 0, fn, topology, rtol)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fn=random_functions(max_ops=SMALL.num_ops, max_devices=MAX_DEVICES, num_streams=2),
    seed=st.integers(0, 2**31),
)
def test_explicit_uneven_costs_match_reference(fn, seed):
    # Per-device costs differ inside one op, so dependencies on multi-device
    # ops cannot be replaced by resource order: the finish slots are exercised.
    rng = np.random.default_rng(seed)
    topology = random_topology(rng, MAX_DEVICES)
    per_op, table = slot_costs(fn, rng, SMALL)
    with jax.enable_x64(True):
        result = run_one(fn, topology, costs=table)
        assert_matches_reference(result, 0, fn, topology, 1e-9, costs=per_op)


@pytest.mark.parametrize("num_streams", [1, 2])
def test_mixed_structure_batch_equals_each_alone(num_streams):
    rng = np.random.default_rng(num_streams)
    fns = [
        random_function(seed, int(rng.integers(20, 200)), 4, num_streams, batch=8, hidden=16)
        for seed in range(6)
    ]
    topology = random_topology(rng, 4)
    programs = [lower(fn, topology) for fn in fns]
    capacity = programs[0].capacity
    for p in programs[1:]:
        capacity = capacity.union(p.capacity)
    capacity = capacity.bucketed()
    stacked = stack_programs(programs, capacity)
    hardware = pad_hardware(Hardware.from_topology(topology), capacity.num_devices)
    with jax.enable_x64(True):
        batch = simulate(stacked, hardware, record_ops=True)
        assert batch.step_time.shape == (len(fns),)
        for i, (fn, program) in enumerate(zip(fns, programs)):
            alone = simulate(pad_program(program, capacity), hardware, record_ops=True)
            np.testing.assert_allclose(batch.step_time[i], alone.step_time[0], rtol=1e-12)
            np.testing.assert_allclose(batch.peak_memory[i], alone.peak_memory[0], rtol=1e-12)
            np.testing.assert_allclose(batch.busy_time[i], alone.busy_time[0], rtol=1e-12)
            assert_matches_reference(batch, i, fn, topology, 1e-9)


def test_hardware_batch_equals_each_topology():
    rng = np.random.default_rng(7)
    fn = random_function(3, 300, 4, batch=8, hidden=16)
    topologies = [random_topology(rng, 4) for _ in range(5)]
    program = lower(fn, topologies[0])  # same links are bottlenecks: uniform scaling
    hardware = stack_hardware([Hardware.from_topology(t) for t in topologies])
    with jax.enable_x64(True):
        result = simulate(program, hardware, record_ops=True)
        for i, topology in enumerate(topologies):
            # The reference picks each ring's bottleneck on its own topology;
            # the program was lowered on the first, so lower each alone too.
            alone = simulate(lower(fn, topology), Hardware.from_topology(topology))
            ref = reference_simulate(fn, topology)
            np.testing.assert_allclose(alone.step_time[0], ref.step_time, rtol=1e-9)
            if _same_bottlenecks(fn, topologies[0], topology):
                np.testing.assert_allclose(result.step_time[i], ref.step_time, rtol=1e-9)


def _same_bottlenecks(fn, a, b):
    return all(a.bottleneck_link(op.devices) == b.bottleneck_link(op.devices) for op in fn.ops)


def _variant_program(batch):
    """A two-device program whose activations have ``batch`` rows."""
    b = FunctionBuilder("variants")
    x = b.input("x", (batch, 64), device=0)
    w0 = b.input("w0", (64, 64), device=0)
    w1 = b.input("w1", (64, 64), device=1)
    h = b.add("Relu", b.add("MatMul", x, w0))
    g = b.add("Send", h, to=1)
    y = b.add("MatMul", g, w1)
    z = b.add("MatMul", h, w0)
    r0, r1 = b.add("AllReduce", z, y)
    return b.build(r0, r1)


def test_size_variants_equal_each_size_alone():
    sizes = np.array([4, 16, 64, 256])
    topology = Topology.uniform(2, link_latency=2e-6)
    program = lower(_variant_program(sizes), topology)
    assert program.flops.shape == (len(sizes), 6)
    with jax.enable_x64(True):
        result = simulate(program, Hardware.from_topology(topology), record_ops=True)
        assert result.step_time.shape == (len(sizes),)
        for i, size in enumerate(sizes):
            assert_matches_reference(result, i, _variant_program(int(size)), topology, 1e-9)


def test_status_out_of_memory_and_invalid():
    fn = _variant_program(64)
    topology = Topology.uniform(2, memory_capacity=1e4)
    program = lower(fn, topology)
    hardware = stack_hardware([Hardware.from_topology(topology), Hardware.from_topology(Topology.uniform(2))])
    result = simulate(program, hardware, valid=np.array([True, False]))
    assert list(np.asarray(result.status)) == [STATUS_OUT_OF_MEMORY, STATUS_INVALID]
    assert np.all(np.isfinite(result.step_time))


def test_padding_touches_nothing():
    fn = random_function(1, 50, 4, batch=8, hidden=16)
    topology = Topology.uniform(4)
    program = lower(fn, topology)
    big = Capacity(128, 8, 16, 64, 8, 16)
    padded = pad_program(program, big)
    a = simulate(program, Hardware.from_topology(topology), record_ops=True)
    b = simulate(padded, pad_hardware(Hardware.from_topology(topology), 8), record_ops=True)
    np.testing.assert_allclose(a.step_time, b.step_time, rtol=1e-6)
    np.testing.assert_allclose(a.peak_memory, b.peak_memory[:, :4], rtol=1e-6)
    assert np.all(np.asarray(b.peak_memory)[:, 4:] == 0)
    assert np.all(np.asarray(b.busy_time)[:, 4:] == 0)
    np.testing.assert_allclose(
        np.asarray(b.op_start)[0, len(fn.ops) :], np.asarray(b.op_start)[0, len(fn.ops) :] * 0
    )


def test_hardware_device_mismatch_is_a_clear_error():
    fn = _variant_program(8)
    program = lower(fn, Topology.uniform(2))
    with pytest.raises(ValueError, match="pad_hardware"):
        simulate(program, Hardware.from_topology(Topology.uniform(3)))


def test_lower_rejects_devices_outside_topology():
    fn = _variant_program(8)
    with pytest.raises(ValueError, match=r"device\(s\) \[1\]"):
        lower(fn, Topology.uniform(1))


def test_smooth_semantics_converge_and_have_gradients():
    fn = random_function(5, 200, 4, batch=8, hidden=16)
    topology = Topology.uniform(4, link_latency=1e-6)
    program = lower(fn, topology)
    hardware = Hardware.from_topology(topology)
    with jax.enable_x64(True):
        exact = float(simulate(program, hardware).step_time[0])
        errors = [
            abs(float(simulate(program, hardware, temperature=t).step_time[0]) - exact) / exact
            for t in (1e-5, 1e-7, 1e-9)
        ]
        assert errors[0] > errors[1] > errors[2]
        assert errors[2] < 1e-3

        def step_time(bandwidth):
            hw = hardware.replace(link_bandwidth=jnp.full((4, 4), bandwidth))
            return simulate(program, hw, temperature=1e-7).step_time[0]

        grad = jax.grad(step_time)(jnp.asarray(3e9))
        assert np.isfinite(grad) and grad < 0  # faster links, shorter steps


def _scatters(jaxpr) -> list:
    """Every scatter equation of a jaxpr, sub-jaxprs (the scan's body) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("scatter"):
            found.append(eqn)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            found.extend(_scatters(sub))
    return found


@pytest.mark.parametrize("per_config_structure", [False, True])
def test_derivatives_scatter_by_unique_index_and_match_differences(per_config_structure):
    """Forward-mode derivatives of the step time: JAX differentiates a scatter that
    may repeat an index by tagging the whole table per step (~15x the cost on a
    GPT-3-sized batch), so every scatter of the kernel and of its JVP must say its
    indices are unique; and the derivatives are the step time's slopes."""
    fns = [random_function(seed, 24, 3, batch=256, hidden=512) for seed in (3, 4)]
    topology = Topology.uniform(3, link_latency=1e-6)
    programs = [pad_program(lower(fn, topology), SMALL) for fn in fns]
    program = stack_programs(programs) if per_config_structure else programs[0]
    hardware = pad_hardware(Hardware.from_topology(topology), SMALL.num_devices)
    with jax.enable_x64(True):
        hardware = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), hardware)

        def step_time(log_scale):  # peak FLOP/s and link bandwidth scaled
            hw = hardware.replace(
                peak_flops=hardware.peak_flops * jnp.exp(log_scale[0]),
                link_bandwidth=hardware.link_bandwidth * jnp.exp(log_scale[1]),
            )
            return simulate(program, hw).step_time

        point = jnp.asarray([0.1, -0.2])
        jaxpr = jax.make_jaxpr(jax.jacfwd(step_time))(point).jaxpr
        scatters = _scatters(jaxpr)
        assert scatters and all(eqn.params["unique_indices"] for eqn in scatters)
        jac = np.asarray(jax.jacfwd(step_time)(point))
        for i in range(2):
            h = np.eye(2)[i] * 1e-6
            slope = (np.asarray(step_time(point + h)) - np.asarray(step_time(point - h))) / 2e-6
            np.testing.assert_allclose(jac[:, i], slope, rtol=1e-5, atol=1e-12)
        assert np.all(jac < 0)  # faster devices and links, shorter steps


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fns=st.lists(
        random_functions(max_ops=SMALL.num_ops, max_devices=MAX_DEVICES, num_streams=2),
        min_size=2,
        max_size=6,
    ),
    seed=st.integers(0, 2**31),
)
def test_random_mixed_batches_equal_each_alone(fns, seed):
    topology = random_topology(np.random.default_rng(seed), MAX_DEVICES)
    programs = [lower(fn, topology) for fn in fns]
    hardware = pad_hardware(Hardware.from_topology(topology), SMALL.num_devices)
    with jax.enable_x64(True):
        batch = simulate(stack_programs(programs, SMALL), hardware, record_ops=True)
        for i, fn in enumerate(fns):
            assert_matches_reference(batch, i, fn, topology, 1e-9)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 512), min_size=2, max_size=6))
def test_random_size_variants_equal_each_size_alone(sizes):
    topology = Topology.uniform(2, link_latency=1e-6)
    with jax.enable_x64(True):
        result = simulate(
            lower(_variant_program(np.array(sizes)), topology),
            Hardware.from_topology(topology),
            record_ops=True,
        )
        # Equal sizes collapse to one concrete dimension: a batch of one.
        shared = result.step_time.shape[0] == 1
        for i, size in enumerate(sizes):
            assert_matches_reference(result, 0 if shared else i, _variant_program(size), topology, 1e-9)


def _op_window(program, lo, hi):
    """Ops ``lo .. hi`` of a stacked program (per-device arrays whole)."""
    fields = ("resource", "slot_device", "dep_slot", "out_slot", "link", "is_comm") + COST_FEATURES
    return program.replace(**{name: np.asarray(getattr(program, name))[:, lo:hi] for name in fields})


@pytest.mark.parametrize("shared", [False, True])
def test_ops_run_in_slices_give_the_same_timeline_as_one_run(shared):
    # Sweeps run a program's ops a slice at a time, carrying the timeline.
    rng = np.random.default_rng(11)
    fns = [random_function(seed, 150, 4, 2, batch=8, hidden=16) for seed in range(4)]
    topology = random_topology(rng, 4)
    programs = [lower(fn, topology) for fn in fns[:1] if shared] or [lower(fn, topology) for fn in fns]
    capacity = functools.reduce(Capacity.union, (p.capacity for p in programs)).bucketed()
    stacked = stack_programs(programs * (4 if shared else 1), capacity)
    hardware = pad_hardware(Hardware.from_topology(topology), capacity.num_devices)
    with jax.enable_x64(True):
        whole = simulate(stacked, hardware)
        rows = hardware_rows(hardware, per_config_structure=True)
        state = start_timeline(capacity.num_resources, capacity.finish_slots, 4)
        cuts = np.unique(np.r_[0, rng.integers(1, capacity.num_ops, 5), capacity.num_ops])
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            state, _ = run_ops(state, _op_window(stacked, lo, hi), rows)
        sliced = conclude(state, stacked.peak_bytes, hardware)
    np.testing.assert_array_equal(sliced.step_time, whole.step_time)
    np.testing.assert_array_equal(sliced.busy_time, whole.busy_time)
    np.testing.assert_array_equal(sliced.finish_slots, whole.finish_slots)
    np.testing.assert_array_equal(sliced.status, whole.status)


def test_weighted_busy_and_its_compute_part():
    # Each op's seconds count `weight` times in busy time (not in the clocks), and
    # the compute part is the cost model's with the communication features zeroed.
    rng = np.random.default_rng(5)
    fns = [random_function(seed, 120, 4, 2, batch=8, hidden=16) for seed in range(3)]
    topology = random_topology(rng, 4)
    programs = [lower(fn, topology) for fn in fns]
    capacity = functools.reduce(Capacity.union, (p.capacity for p in programs)).bucketed()
    stacked = stack_programs(programs, capacity)
    hardware = pad_hardware(Hardware.from_topology(topology), capacity.num_devices)
    weights = rng.integers(1, 5, (3, capacity.num_ops)).astype(np.float64)
    with jax.enable_x64(True):
        rows = hardware_rows(hardware, per_config_structure=True)
        start = start_timeline(capacity.num_resources, capacity.finish_slots, 3, split_compute=True)
        state, _ = run_ops(start, stacked, rows, weights=weights)
        plain = simulate(stacked, hardware)
        comm_zeroed = stacked.replace(
            comm_volume=np.zeros_like(stacked.comm_volume), comm_hops=np.zeros_like(stacked.comm_hops)
        )
        compute_only, _ = run_ops(start, comm_zeroed, rows, weights=weights)
        concluded = conclude(state, stacked.peak_bytes, hardware)
        np.testing.assert_array_equal(concluded.step_time, plain.step_time)
    # Busy time per resource: each slot's cost, weighted.
    resource = np.asarray(stacked.resource)
    for name, got in (("busy", state.busy), ("compute", state.compute)):
        expected = np.zeros_like(np.asarray(got))
        seconds = _slot_seconds(stacked, hardware, comm=name == "busy")
        for b in range(3):
            for k in range(resource.shape[2]):
                on = resource[b, :, k] >= 0
                np.add.at(expected[:, b], resource[b, on, k], (seconds[b] * weights[b])[on])
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12, atol=1e-300, err_msg=name)
    np.testing.assert_allclose(np.asarray(state.compute), np.asarray(compute_only.busy), rtol=1e-12)


def _slot_seconds(program, hardware, comm: bool):
    """Each op's seconds ``[B, N]`` by the cost model (without its communication part unless ``comm``)."""
    features = {name: np.asarray(getattr(program, name), np.float64) for name in COST_FEATURES}
    if not comm:
        features["comm_volume"] = np.zeros_like(features["comm_volume"])
        features["comm_hops"] = np.zeros_like(features["comm_hops"])
    first = np.maximum(np.asarray(program.slot_device)[..., 0], 0)
    link = np.asarray(program.link)
    bandwidth = np.asarray(hardware.link_bandwidth)[link[..., 0], link[..., 1]]
    return op_seconds(
        np,
        features,
        1.0 / np.asarray(hardware.peak_flops)[first],
        1.0 / np.asarray(hardware.memory_bandwidth)[first],
        float(hardware.launch_overhead),
        inverse_bandwidth(np, bandwidth),
        np.asarray(hardware.link_latency)[link[..., 0], link[..., 1]],
    )


def _all_reduce(devices, rows: int = 65536):
    """One all-reduce of a ``[rows, 1024]`` f32 value (256 MB) held on each of ``devices``."""
    b = FunctionBuilder("all_reduce")
    xs = [b.input(f"x{d}", (rows, 1024), device=d) for d in devices]
    return b.build(*b.add("AllReduce", *xs))


@pytest.mark.parametrize(
    "devices, channels",
    [
        (range(16), 8),  # 8 members in each of 2 nodes: 8 rings, one per NIC
        ([0, 1, 8, 9], 2),
        ([0, 8], 1),  # one member per node: one port each
        ([0, 1, 2, 8], 1),  # some node holds one member
        (range(8), 1),  # one node: NVLink
    ],
)
def test_collectives_across_nodes_run_one_ring_per_network_port(devices, channels):
    """NCCL's ring all-reduce over m members in each of several nodes runs m rings
    side by side, each through another member's NIC: the network carries m ports'
    bandwidth (while NVLink keeps up). The kernel and the reference agree on it."""
    topology = dgx_a100(num_nodes=2, dtype="f32")
    devices = list(devices)
    assert topology.ring_channels(devices) == channels
    fn = _all_reduce(devices)
    n, nbytes = len(devices), 65536 * 1024 * 4
    across = len(set(topology.node_of_device[devices].tolist())) > 1
    bandwidth, latency = (25e9, 8e-6) if across else (300e9, 3e-6)
    want = 2 * (n - 1) / n * nbytes / (channels * bandwidth) + 2 * (n - 1) * latency
    ref = reference_simulate(fn, topology)
    assert ref.step_time == pytest.approx(want, rel=1e-9)
    with jax.enable_x64(True):
        result = simulate(lower(fn, topology), Hardware.from_topology(topology))
    np.testing.assert_allclose(np.ravel(result.step_time), ref.step_time, rtol=1e-12)


def test_ring_channels_need_the_slowest_hop_between_nodes():
    # Two nodes of 4 whose links inside a node are slower than those between them:
    # the ring's slowest hop is inside a node, which more rings would not widen.
    node = np.arange(8) // 4
    same = node[:, None] == node[None, :]
    topology = Topology(
        name="slow-nodes",
        peak_flops=np.full(8, 1e14),
        memory_bandwidth=np.full(8, 1e12),
        memory_capacity=np.full(8, 1e11),
        link_bandwidth=np.where(same, 10e9, 20e9),
        link_latency=np.zeros((8, 8)),
        node_of_device=node,
    )
    assert topology.ring_channels(range(8)) == 1.0
    ref = reference_simulate(_all_reduce(range(8)), topology)
    assert ref.step_time == pytest.approx(2 * 7 / 8 * 2**28 / 10e9, rel=1e-9)
    faster_inside = dataclasses.replace(topology, link_bandwidth=np.where(same, 40e9, 20e9))
    assert faster_inside.ring_channels(range(8)) == 4.0
    assert faster_inside.ring_channels([0, 1, 4]) == 1.0
