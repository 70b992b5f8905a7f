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
from distir_jax.models import TransformerConfig
from search import calibrate_configs, make_config, simulate_config

TRUTH = dict(peak_flops=0.55, memory_bandwidth=0.8, link_bandwidth=0.4, link_latency=3.0, launch_overhead=2.0)
NOMINAL = "dgx-a100-80gb"


def _optimizers():
    return (
        ("levenberg-marquardt", None, None),
        ("adam 0.05", optax.adam(0.05), 500),
        ("lbfgs", optax.lbfgs(), 100),
    )


def _report(name: str, fit, seconds: float) -> None:
    factor_error = max(abs(fit.scales[f] / TRUTH[f] - 1) for f in TRUTH)
    time_error = np.max(np.abs(fit.relative_error))
    print(
        f"  {name:20s} {len(fit.losses):4d} iterations {seconds:7.2f} s   "
        f"step times off by <= {time_error:.1e}   factors off by <= {factor_error:.1e}"
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

    model = TransformerConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=512, seq_len=64)
    model = model if args.quick else "gpt2-small"
    knobs = [
        dict(batch_size=8, data=2, optimizer="adam"),
        dict(batch_size=8, tensor=2),
        dict(batch_size=8, pipeline=2, microbatches=4),
        dict(batch_size=16, data=2, tensor=2, pipeline=2, microbatches=2, overlap_grad_comm=True),
        dict(batch_size=1),
    ]
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


if __name__ == "__main__":
    main()
