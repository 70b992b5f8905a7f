"""The host timeline (NumPy) against the compiled kernel: the same timeline, bit for bit."""

import functools

import jax
import numpy as np
import pytest

from distir_jax.hardware import Hardware, pad_hardware
from distir_jax.host_timeline import run_ops_host
from distir_jax.kernel import Timeline, hardware_rows, op_costs, run_ops, start_timeline
from distir_jax.lower import Capacity, lower, stack_programs
from distir_jax.testing.random_programs import random_function
from tests.test_kernel import _op_window, random_topology


def _batch(seed: int, num_rows: int, num_streams: int = 2):
    rng = np.random.default_rng(seed)
    fns = [
        random_function(seed * 100 + i, int(rng.integers(20, 160)), 4, num_streams, batch=8, hidden=16)
        for i in range(num_rows)
    ]
    topology = random_topology(rng, 4)
    programs = [lower(fn, topology) for fn in fns]
    capacity = functools.reduce(Capacity.union, (p.capacity for p in programs)).bucketed()
    stacked = stack_programs(programs, capacity)
    hardware = pad_hardware(Hardware.from_topology(topology), capacity.num_devices)
    return rng, programs, capacity, stacked, hardware


def _compiled(state, window, costs):
    run = lambda s, p, c: run_ops(s, p, None, precomputed=c, record_ops=True)  # noqa: E731
    return jax.jit(run)(state, window, costs)


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_timeline_equals_the_kernel_bit_for_bit(x64, seed):
    rng, programs, capacity, stacked, hardware = _batch(seed, 5)
    weights = rng.integers(1, 6, (5, capacity.num_ops)).astype(np.float32)
    cuts = np.unique(np.r_[0, rng.integers(1, capacity.num_ops, 3), capacity.num_ops])
    with jax.enable_x64(x64):
        rows = hardware_rows(hardware, per_config_structure=True, xp=np)
        start = start_timeline(capacity.num_resources, capacity.finish_slots, 5, split_compute=True, xp=np)
        host = kernel = start
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            window = _op_window(stacked, lo, hi)
            costs = op_costs(window, rows, weights[:, lo:hi], split_compute=True, xp=np)
            host, host_ops = run_ops_host(host, window, costs, record_ops=True)
            kernel, kernel_ops = _compiled(kernel, window, costs)
            for got, want in zip(host_ops, kernel_ops, strict=True):  # every op's start and finish
                np.testing.assert_array_equal(got, np.asarray(want))
        # Costs computed inside the kernel instead: the same up to rounding.
        inside, _ = run_ops(start, stacked, rows, weights=weights)
    assert host.clock.dtype == (np.float64 if x64 else np.float32)
    for name in Timeline._fields:
        np.testing.assert_array_equal(getattr(host, name), np.asarray(getattr(kernel, name)), err_msg=name)
        np.testing.assert_allclose(
            getattr(host, name), np.asarray(getattr(inside, name)), rtol=1e-5, atol=1e-30, err_msg=name
        )
    assert np.asarray(host.clock).max() > 0


def test_rows_past_the_last_running_one_are_skipped():
    _, programs, capacity, stacked, hardware = _batch(7, 4, num_streams=1)
    rows = hardware_rows(hardware, per_config_structure=True, xp=np)
    costs = op_costs(stacked, rows, xp=np)
    start = start_timeline(capacity.num_resources, capacity.finish_slots, 4, xp=np)
    full, _ = run_ops_host(start, stacked, costs)
    counts = np.asarray([p.num_ops for p in programs])
    counts[3] = 0  # the last row (a call's padding row) is not run
    skipped, _ = run_ops_host(start, stacked, costs, num_ops=counts)
    for name in ("clock", "finish", "busy"):
        got, want = getattr(skipped, name), getattr(full, name)
        np.testing.assert_array_equal(got[:, :3], want[:, :3], err_msg=name)
        np.testing.assert_array_equal(got[:, 3], 0.0, err_msg=name)
    assert (full.clock[:, 3] > 0).any()


def test_an_op_naming_one_resource_twice_is_refused():
    _, _, capacity, stacked, hardware = _batch(3, 2)
    resource = np.asarray(stacked.resource).copy()
    resource[0, 0, :2] = 1
    bad = stacked.replace(resource=resource)
    rows = hardware_rows(hardware, per_config_structure=True, xp=np)
    start = start_timeline(capacity.num_resources, capacity.finish_slots, 2, xp=np)
    with pytest.raises(ValueError, match="one resource in two slots"):
        run_ops_host(start, bad, op_costs(bad, rows, xp=np))
