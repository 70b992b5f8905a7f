"""How soon a pipeline's timeline becomes periodic in the microbatch count (evidence, not a speed test).

Benchmark (b) spends its time on programs of up to 1024 microbatches, ~4e5
ops each. If a program's step time were exactly affine in the microbatch
count ``m`` past a short transient, a program of a few times ``p``
microbatches would give the step time of any larger ``m``. This script
measures, for sampled GPT-3 175B strategies on 64 A100s:

* the smallest ``m`` from which the step time (fast-engine program, kernel
  in float64) is affine in ``m`` to 1e-12 relative, over ``m = p .. ~6p``;
* the smallest ``m`` from which the pipeline transform's issue order for
  ``m + step`` microbatches is the order for ``m`` with one period of events
  inserted (``step`` is ``p`` for the interleaved schedule, else 1).

Sampling ``m`` up to ~6p is evidence, not a proof: using it for results
needs a certificate (for example the whole simulator state shifting by one
period's time over one period of the small program).

    python benchmarks/steady_state.py [--samples 12]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

jax.config.update("jax_enable_x64", True)  # exact slopes: float32 sums would blur them

import numpy as np  # noqa: E402

from distir_jax.kernel import simulate  # noqa: E402
from distir_jax.transforms.coarse import layer_features, transform_layers_per_chunk, transform_step_costs  # noqa: E402
from distir_jax.transforms.coarse_pipeline import _core  # noqa: E402
from search import StrategySpace, enumerate_configs  # noqa: E402
from search._fast import FastEngine  # noqa: E402
from search._programs import stack_rows  # noqa: E402

SPACE = StrategySpace(
    model="gpt3-175b",
    world_sizes=(64,),
    global_batch_sizes=(1024,),
    microbatch_sizes=(1, 2),
    schedules=("1f1b", "interleaved"),
    virtual_stages=(2,),
    recompute=("none", "full"),
    zero=(False, True),
    overlap_grad_comm=(False, True),
    dtype="bf16",
    hardware="dgx-a100-80gb",
    optimizer="adam",
)


def step_time(config, microbatches: int) -> float:
    """The fast engine's step time of ``config`` with another microbatch count (float64)."""
    c = dataclasses.replace(
        config,
        microbatches=microbatches,
        global_batch_size=microbatches * config.microbatch_size * config.data,
    )
    [(_, prepared, variant, reason)] = FastEngine([c]).prepare([c], steady=False)
    if reason:
        raise ValueError(reason)
    program, hardware = stack_rows([(prepared, variant)], prepared.capacity, 1)
    program = jax.tree_util.tree_map(lambda x: x.astype(np.float64) if x.dtype == np.float32 else x, program)
    hardware = jax.tree_util.tree_map(lambda x: x.astype(np.float64), hardware)
    return float(simulate(program, hardware).step_time[0])


def order_roles(core: dict, shift: int = 0) -> list[tuple]:
    """The issue order as (kind, chunk, microbatch + shift, stage) per event."""
    roles = list(zip(core["kind"], core["chunk"], core["mb"] + shift, core["stage"], strict=True))
    return [roles[i] for i in np.argsort(core["rank"])]


def is_insertion(small: dict, large: dict, step: int) -> bool:
    """Whether ``large``'s order is ``small``'s with one block inserted (later microbatches renumbered)."""
    a, b = order_roles(small), order_roles(large)
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    shifted = order_roles(small, step)
    suffix = next((i for i, (x, y) in enumerate(zip(shifted[::-1], b[::-1])) if x != y), len(a))
    return prefix + suffix >= len(a)


def first_from(ms, flags, at_least: int = 2):
    """The first ``m`` from which every flag is true, with at least ``at_least`` flags, or None."""
    return next(
        (m for i, m in enumerate(ms[: len(flags)]) if len(flags) - i >= at_least and all(flags[i:])), None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12, help="strategies sampled from the space")
    args = parser.parse_args()
    configs = [c for c in enumerate_configs(SPACE) if c.valid and c.pipeline > 1]
    picked = np.random.default_rng(0).choice(len(configs), min(args.samples, len(configs)), replace=False)
    for config in (configs[i] for i in picked):
        p, v = config.pipeline, config.virtual_stages
        step = p if config.schedule == "interleaved" else 1
        ms = list(range(step * -(-p // step), 8 * p + step, step))
        times = np.array([step_time(config, m) for m in ms])
        slopes = np.diff(times)
        # Slopes equal to the last one (which is compared with itself, so left out).
        affine = first_from(ms, np.abs(slopes[:-1] - slopes[-1]) <= 1e-12 * abs(slopes[-1]))
        # The pipeline transform sees a microbatch before data parallelism splits it
        # (d replicas' worth) and orders steps by its flops, as search._fast does.
        features = layer_features(
            config.model_config,
            config.tensor,
            config.recompute,
            (config.microbatch_size * config.data,),
            config.topology(),
        )
        costs = transform_step_costs(features, transform_layers_per_chunk(features, p * v))
        cores = {m: _core(p, m, v, config.schedule, costs) for m in ms}
        inserted = first_from(ms[:-1], [is_insertion(cores[m], cores[m + step], step) for m in ms[:-1]])
        print(
            f"t={config.tensor} p={p} d={config.data} {config.schedule} v={v} recompute={config.recompute} "
            f"zero={config.zero} overlap={config.overlap_grad_comm}: m = {ms[0]}..{ms[-1]}; step time affine "
            f"from m={affine or 'beyond'}, slope {slopes[-1]:.4g} s per {step} microbatch(es); order one "
            f"period per {step} more from m={inserted or 'beyond'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
