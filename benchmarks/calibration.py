"""Calibration: how fast and how exactly each optimizer recovers a known hardware.

A "lab" cluster is a DGX A100 preset whose five figures are off by known
factors (peak FLOP/s 0.55, memory bandwidth 0.8, link bandwidth 0.4, link
latency 3, launch overhead 2). The measurements are the exact engine's step
times of training steps on it (``search.simulate_config``); each optimizer
then fits the nominal preset to them (``search.calibrate_configs``), side by
side in one run:

* Levenberg-Marquardt (the default: the kernel's forward-mode Jacobian),
* ``optax.adam(0.05)``, 500 steps,
* ``optax.lbfgs()``, 100 steps.

Two problem sets: the 6 probe programs of ``dj.calibration_probes()``, each
leaning on one figure (a MatMul, an elementwise op, a large and a tiny Send, a
chain of small kernels, a mix),
and training steps of GPT-2 small (or, with ``--quick``, of a 4-layer
transformer) under data, tensor and pipeline parallelism, whose step times all
depend on every figure at once (a harder, ill-conditioned fit).

Then the two engines ``calibrate_configs`` builds programs with, side by
side: the fast engine's coarse programs (refitted until exact on the fitted
figures) against the fine programs the transforms build, on six GPT-3 XL
strategies on 16 GPUs (measured by the exact engine); and the fast engine
alone on six GPT-3 175B strategies on 64 GPUs (measured by a sweep on a
lab off in four figures, its network apart; their step times barely depend
on latencies and launch overhead, so those four are fitted), next to the
time the transforms take to build one of their fine programs (not with
``--quick``). Before them, the probes with sends across two nodes
(``calibration_probes(network_peer=8)``) on a lab whose InfiniBand is off
by other factors than its NVSwitch, fitted with one factor for every link
and with the network apart.

    python benchmarks/calibration.py [--quick]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np
import optax

import distir_jax as dj
from distir_jax.testing.strategies import GPT3_175B_COMMON, GPT3_175B_RUNS, SMALL_TRAINING_RUNS, TINY_GPT
from search import calibrate_configs, make_config, simulate_config

TRUTH = dict(peak_flops=0.55, memory_bandwidth=0.8, link_bandwidth=0.4, link_latency=3.0, launch_overhead=2.0)
# A lab whose InfiniBand between nodes reaches another share of its figures than NVSwitch.
NETWORK_TRUTH = dict(TRUTH, network_bandwidth=0.25, network_latency=1.5)
NOMINAL = "dgx-a100-80gb"


def _optimizers():
    return (
        ("levenberg-marquardt", None, None),
        ("adam 0.05", optax.adam(0.05), 500),
        ("lbfgs", optax.lbfgs(), 100),
    )


def _report(name: str, fit, seconds: float, fields=tuple(TRUTH)) -> None:
    factor_error = max(abs(fit.scales[f] / NETWORK_TRUTH[f] - 1) for f in fields)
    time_error = np.max(np.abs(fit.relative_error))
    weak = f"   weakly determined: {', '.join(fit.weakly_determined)}" if fit.weakly_determined else ""
    print(
        f"  {name:20s} {len(fit.losses):4d} iterations {seconds:7.2f} s   "
        f"step times off by <= {time_error:.1e}   factors off by <= {factor_error:.1e}{weak}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4-layer transformer instead of GPT-2 small")
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.machine()} jax {jax.__version__} devices={jax.devices()}")
    dj.register_calibrated_preset("lab", NOMINAL, TRUTH)
    base = dj.get_preset(f"{NOMINAL}:8")
    lab = dj.get_preset("lab:8")

    probes = dj.calibration_probes()
    programs = [dj.lower(fn, base) for fn in probes.values()]
    measured = [dj.reference_simulate(fn, lab).step_time for fn in probes.values()]
    print(f"6 probe programs (reference-simulated on the lab cluster), {len(TRUTH)} factors:")
    for name, optimizer, steps in _optimizers():
        start = time.perf_counter()
        fit = dj.calibrate(programs, measured, base, optimizer=optimizer, steps=steps)
        _report(name, fit, time.perf_counter() - start)
    _two_nodes()

    model = TINY_GPT if args.quick else "gpt2-small"
    knobs = list(SMALL_TRAINING_RUNS)
    start = time.perf_counter()
    strategies = [(model, k) for k in knobs] + [("mlp-xs", dict(batch_size=64, data=4))]
    on_lab = [make_config(m, hardware="lab", **k) for m, k in strategies]
    measured = [simulate_config(c).row["step_time_s"] for c in on_lab]
    configs = [make_config(m, **k) for m, k in strategies]
    label = "a 4-layer transformer" if args.quick else "GPT-2 small"
    print(
        f"6 training steps ({label} d2 / t2 / p2 / d2t2p2 / 1 GPU, and an MLP; measured by the exact "
        f"engine in {time.perf_counter() - start:.1f} s):"
    )
    for name, optimizer, steps in _optimizers():
        start = time.perf_counter()
        fit = calibrate_configs(configs, measured, optimizer=optimizer, steps=steps)
        _report(name, fit, time.perf_counter() - start)
    _engines()
    _gpt3(build_fine=not args.quick)


def _engines() -> None:
    """Coarse against fine programs on six GPT-3 XL strategies (16 GPUs), measured exactly."""
    common = dict(world_size=16, batch_size=256, dtype="bf16", optimizer="adam")
    knobs = [
        dict(data=16),
        dict(data=8, tensor=2, overlap_grad_comm=True),
        dict(data=4, pipeline=4, microbatches=16),
        dict(data=2, tensor=4, pipeline=2, microbatches=8, zero=True),
        dict(
            tensor=8, pipeline=2, microbatches=32, schedule="interleaved", virtual_stages=2, recompute="full"
        ),
        dict(data=8, pipeline=2, microbatches=4, recompute="attention"),
    ]
    start = time.perf_counter()
    measured = [
        simulate_config(make_config("gpt3-xl", hardware="lab", **common, **k)).row["step_time_s"]
        for k in knobs
    ]
    configs = [make_config("gpt3-xl", **common, **k) for k in knobs]
    print(
        f"6 GPT-3 XL training steps on 16 GPUs (d16 / d8t2 / d4p4 / d2t4p2 ZeRO / t8p2 interleaved / d8p2; "
        f"measured by the exact engine in {time.perf_counter() - start:.1f} s), Levenberg-Marquardt:"
    )
    seconds = {}
    for engine in ("fast", "exact"):
        start = time.perf_counter()
        fit = calibrate_configs(configs, measured, engine=engine)
        seconds[engine] = time.perf_counter() - start
        _report(f"{engine} engine", fit, seconds[engine])
    print(f"  fast engine vs exact engine: {seconds['exact'] / seconds['fast']:.1f}x")


def _two_nodes() -> None:
    """The 8 probes of ``calibration_probes(network_peer=8)`` on two nodes of a lab whose
    network is off by other factors than its NVSwitch: every link one factor (the
    default fields) against the network apart (all seven)."""
    dj.register_calibrated_preset("lab-network", NOMINAL, NETWORK_TRUTH)
    base, lab = dj.get_preset(f"{NOMINAL}:16"), dj.get_preset("lab-network:16")
    probes = dj.calibration_probes(network_peer=8)
    programs = [dj.lower(fn, base) for fn in probes.values()]
    measured = [dj.reference_simulate(fn, lab).step_time for fn in probes.values()]
    print(f"{len(probes)} probe programs on two nodes, the network off by other factors than NVSwitch:")
    for label, fields in (("one link factor", None), ("network apart", dj.CALIBRATABLE_FIELDS)):
        start = time.perf_counter()
        fit = dj.calibrate(programs, measured, base, fields=fields)
        shown = tuple(NETWORK_TRUTH) if fields else tuple(f for f in TRUTH if not f.startswith("link_"))
        _report(f"{label} ({len(fit.scales)})", fit, time.perf_counter() - start, shown)


def _gpt3(build_fine: bool) -> None:
    """The fast engine on six GPT-3 175B strategies (64 GPUs), measured by a sweep."""
    from search import evaluate
    from search._transform import build_function

    fields = ("peak_flops", "memory_bandwidth", "link_bandwidth", "network_bandwidth")
    common, knobs = GPT3_175B_COMMON, GPT3_175B_RUNS
    # A lab whose latencies and launch overhead are right: four fitted factors can meet it exactly.
    dj.register_calibrated_preset("lab-4", NOMINAL, {f: NETWORK_TRUTH[f] for f in fields})
    on_lab = [make_config("gpt3-175b", hardware="lab-4", **common, **k) for k in knobs]
    measured = np.asarray(evaluate(on_lab, progress=False)["step_time_s"], np.float64)
    configs = [make_config("gpt3-175b", **common, **k) for k in knobs]
    print(f"6 GPT-3 175B training steps on 64 GPUs (measured by a sweep), {len(fields)} factors:")
    start = time.perf_counter()
    fit = calibrate_configs(configs, measured, fields=fields)
    _report("fast engine", fit, time.perf_counter() - start, fields)
    if build_fine:
        start = time.perf_counter()
        fn = build_function(configs[0], configs[0].global_batch_size, representative_only=True)
        program = dj.lower(fn, configs[0].topology())
        print(
            f"  the exact engine's fine program of the first one alone: {program.flops.shape[-1]:,} ops, "
            f"built and lowered in {time.perf_counter() - start:.1f} s"
        )


if __name__ == "__main__":
    main()
