"""Kernel vs reference simulator, measured side by side in one run.

For each (B configurations, N ops, D devices) it times the jitted kernel on B
hardware variants of one random program and the pure-Python reference
simulator on the same program, and prints configurations/second,
op-configuration updates/second, compile time and the speedup (reference
seconds per configuration x B / kernel seconds).

It then times the batch sweeps actually make: B programs of *different*
structure (16 random programs, each repeated, padded to one capacity and
stacked), where every configuration carries its own op-to-resource tables,
and the grouped kernel (configurations sharing a structure in groups, as
benchmark (b) of ``sweep.py`` runs them) against the general one on the
same rows.

    python benchmarks/kernel.py            # the full grid
    python benchmarks/kernel.py --quick    # B=1024, N=2048, D=8 only (< 60 s)
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

from distir_jax.executor.reference import reference_simulate
from distir_jax.hardware import Hardware
from distir_jax.ir import Topology
from distir_jax.kernel import simulate
from distir_jax.lower import lower, stack_programs
from distir_jax.testing.random_programs import random_function


def hardware_variants(topology: Topology, batch: int) -> Hardware:
    """``batch`` copies of the topology's hardware with speeds scaled 1x..2x."""
    base = Hardware.from_topology(topology)
    scale = np.linspace(1.0, 2.0, batch)

    def vary(x):
        x = np.asarray(x, np.float32)
        return np.broadcast_to(x, (batch,) + x.shape) * scale.reshape((batch,) + (1,) * x.ndim)

    return jax.tree_util.tree_map(vary, base)


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def measure(batch: int, num_ops: int, num_devices: int, reference_cache: dict) -> dict:
    topology = Topology.uniform(num_devices, link_latency=2e-6)
    fn = random_function(0, num_ops, num_devices, batch=64, hidden=256)
    program = lower(fn, topology)
    hardware = hardware_variants(topology, batch)
    t = time.perf_counter()
    compiled = simulate.lower(program, hardware).compile()
    compile_s = time.perf_counter() - t
    kernel_s = best_time(lambda: compiled(program, hardware), repeats=10 if num_ops * batch < 2**24 else 3)
    key = (num_ops, num_devices)
    if key not in reference_cache:
        reference_cache[key] = best_time(lambda: reference_simulate(fn, topology), repeats=2)
    reference_s = reference_cache[key]
    return dict(
        B=batch,
        N=num_ops,
        D=num_devices,
        compile_s=compile_s,
        kernel_s=kernel_s,
        configs_per_s=batch / kernel_s,
        op_updates_per_s=batch * num_ops / kernel_s,
        reference_s_per_config=reference_s,
        speedup=reference_s * batch / kernel_s,
    )


def measure_mixed(batch: int, num_ops: int, num_devices: int, distinct: int = 16) -> dict:
    """Kernel time on ``batch`` programs of ``distinct`` different structures (per-configuration tables)."""
    topology = Topology.uniform(num_devices, link_latency=2e-6)
    programs = [
        lower(random_function(seed, num_ops, num_devices, batch=64, hidden=256), topology)
        for seed in range(distinct)
    ]
    stacked = stack_programs([programs[i % distinct] for i in range(batch)])
    hardware = hardware_variants(topology, batch)
    compiled = simulate.lower(stacked, hardware).compile()
    kernel_s = best_time(lambda: compiled(stacked, hardware), repeats=5)
    return dict(
        B=batch, N=num_ops, D=num_devices, kernel_s=kernel_s, op_updates_per_s=batch * num_ops / kernel_s
    )


def measure_grouped(groups: int, rows: int, num_ops: int, slice_ops: int = 512) -> dict:
    """The grouped kernel (:mod:`distir_jax.grouped_timeline`, which benchmark (b)
    of ``sweep.py`` runs) against the general kernel on the same ops: ``groups``
    random structures of ``num_ops`` ops (two resources and one dependency at
    most, as coarse pipeline programs), ``rows`` configurations each with their
    own op durations; both run ``slice_ops`` ops per call, carrying the timeline."""
    import types

    import jax.numpy as jnp

    from distir_jax.grouped_timeline import pack_ops, run_grouped, start_grouped
    from distir_jax.kernel import OpCosts, run_ops, start_timeline

    resources, slots, columns = 64, 64, 256
    rng = np.random.default_rng(0)
    first = rng.integers(0, resources, (groups, num_ops))
    second = np.where(rng.random((groups, num_ops)) < 0.5, rng.integers(0, resources, (groups, num_ops)), -1)
    dep = np.where(rng.random((groups, num_ops)) < 0.2, rng.integers(0, slots, (groups, num_ops)), -1)
    out = np.where(rng.random((groups, num_ops)) < 0.2, rng.integers(0, slots, (groups, num_ops)), -1)
    column = rng.integers(0, columns - 1, (groups, num_ops))
    seconds = rng.random((groups, columns, rows)).astype(np.float32)
    ops = np.stack(
        [
            pack_ops(np.stack([first[g], second[g]], 1), dep[g], out[g], column[g], resources, slots)
            for g in range(groups)
        ]
    )
    grouped = jax.jit(run_grouped)

    def run_grouped_calls():
        state = start_grouped(groups, resources, slots, rows, jnp.float32)
        for j in range(0, num_ops, slice_ops):
            state = grouped(state, ops[:, j : j + slice_ops], seconds)
        return state

    # The same rows with a structure each: configurations last, as the general kernel has them.
    b = groups * rows
    each = lambda x: np.repeat(x, rows, axis=0)  # noqa: E731
    structure = dict(
        resource=each(np.stack([first, second], -1)),
        dep_slot=each(dep)[..., None],
        out_slot=each(out),
    )
    durations = np.take_along_axis(seconds, column[:, :, None], axis=1)  # [G, N, Bg]
    durations = np.moveaxis(durations, 2, 1).reshape(b, num_ops).T  # [N, B]

    @jax.jit
    def general(state, resource, dep_slot, out_slot, cost):
        program = types.SimpleNamespace(  # run_ops reads only these with precomputed costs
            resource=resource,
            dep_slot=dep_slot,
            out_slot=out_slot,
            resource_device=jnp.zeros(resources, jnp.int32),
        )
        return run_ops(state, program, None, precomputed=OpCosts(cost, cost))[0]

    def run_general_calls():
        state = start_timeline(resources, slots, b)
        state = state._replace(
            **{name: getattr(state, name).astype(jnp.float32) for name in ("clock", "finish", "busy")}
        )
        for j in range(0, num_ops, slice_ops):
            at = slice(j, j + slice_ops)
            fields = (structure[name][:, at] for name in ("resource", "dep_slot", "out_slot"))
            state = general(state, *fields, durations[at])
        return state

    grouped_state, general_state = run_grouped_calls(), run_general_calls()  # compile, and agree
    np.testing.assert_allclose(
        np.asarray(grouped_state.clocks(resources)[:, :-1]).transpose(0, 2, 1).reshape(b, resources),
        np.asarray(general_state.clock).T,
        rtol=1e-6,
    )
    grouped_s = best_time(run_grouped_calls, repeats=3)
    general_s = best_time(run_general_calls, repeats=3)
    return dict(
        G=groups,
        Bg=rows,
        N=num_ops,
        grouped_op_updates_per_s=b * num_ops / grouped_s,
        general_op_updates_per_s=b * num_ops / general_s,
        ratio=general_s / grouped_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="only B=1024, N=2048, D=8")
    args = parser.parse_args()
    grid = (
        [(1024, 2048, 8)]
        if args.quick
        else [(b, n, d) for d in (8, 64) for n in (256, 2048, 16384) for b in (1, 64, 1024, 8192)]
    )
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()} jax {jax.__version__} "
        f"backend={jax.default_backend()} devices={jax.devices()}"
    )
    header = (
        f"{'B':>5} {'N':>6} {'D':>3} {'compile s':>9} {'kernel s':>9} {'configs/s':>10} "
        f"{'op-upd/s':>9} {'ref s/cfg':>9} {'speedup':>8}"
    )
    print(header)
    cache: dict = {}
    rows = []
    for b, n, d in grid:
        r = measure(b, n, d, cache)
        rows.append(r)
        print(
            f"{r['B']:>5} {r['N']:>6} {r['D']:>3} {r['compile_s']:>9.2f} {r['kernel_s']:>9.4f} "
            f"{r['configs_per_s']:>10.3g} {r['op_updates_per_s']:>9.3g} {r['reference_s_per_config']:>9.4f} "
            f"{r['speedup']:>8.0f}",
            flush=True,
        )
    mixed = measure_mixed(1024, 2048, 8)
    print(
        f"different structure per configuration: B={mixed['B']} N={mixed['N']} D={mixed['D']}: "
        f"kernel {mixed['kernel_s']:.4f} s, {mixed['op_updates_per_s']:.3g} op updates/s",
        flush=True,
    )
    g = measure_grouped(64, 16, 2048)
    print(
        f"grouped templates (distir_jax.grouped_timeline): {g['G']} groups x {g['Bg']} configurations, "
        f"N={g['N']}: {g['grouped_op_updates_per_s']:.3g} op updates/s against the general kernel's "
        f"{g['general_op_updates_per_s']:.3g} on the same rows (structure per configuration): "
        f"{g['ratio']:.1f}x",
        flush=True,
    )
    target = next(r for r in rows if (r["B"], r["N"], r["D"]) == (1024, 2048, 8))
    speedup, updates = target["speedup"], target["op_updates_per_s"]
    print(f"kernel_speedup_vs_reference={speedup:.0f} op_updates_per_s={updates:.3g}")


if __name__ == "__main__":
    main()
