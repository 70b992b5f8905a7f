"""One compiled kernel serves many programs; its size does not grow with N."""

import jax
import numpy as np

from distir_jax.hardware import Hardware, pad_hardware
from distir_jax.ir import Topology
from distir_jax.kernel import simulate
from distir_jax.lower import Capacity, lower, pad_program
from distir_jax.testing.random_programs import random_function


def test_programs_padded_to_one_capacity_reuse_one_compiled_kernel():
    topology = Topology.uniform(4)
    capacity = Capacity(256, 4, 8, 128, 4, 4)
    hardware = pad_hardware(Hardware.from_topology(topology), capacity.num_devices)
    programs = [
        pad_program(lower(random_function(s, 40 + 30 * s, 4, batch=8, hidden=16), topology), capacity)
        for s in range(5)
    ]
    assert len({p.num_ops.item() for p in programs}) == 5
    simulate(programs[0], hardware)  # warm the cache
    before = simulate._cache_size()
    results = [simulate(p, hardware) for p in programs]
    assert simulate._cache_size() == before
    assert len({float(r.step_time[0]) for r in results}) == 5  # really different programs


def _jaxpr_size(num_ops: int) -> int:
    topology = Topology.uniform(4)
    program = pad_program(
        lower(random_function(0, num_ops, 4, batch=8, hidden=16), topology), Capacity(num_ops, 4, 8, 64, 4, 4)
    )
    jaxpr = jax.make_jaxpr(lambda p, h: simulate(p, h))(program, Hardware.from_topology(topology))
    return len(str(jaxpr))


def test_jaxpr_does_not_grow_with_num_ops():
    sizes = {n: _jaxpr_size(n) for n in (64, 512, 4096)}
    # Only the printed array shapes may get longer (more digits), not the program.
    assert max(sizes.values()) - min(sizes.values()) < 200, sizes


def test_lowering_keeps_finish_slots_small():
    topology = Topology.uniform(8)
    program = lower(random_function(1, 4096, 8, batch=8, hidden=16), topology)
    # Slots are reused once read, so V stays far below N.
    assert program.num_finish_slots < 200
    assert np.asarray(program.dep_slot).shape[1] <= 8
