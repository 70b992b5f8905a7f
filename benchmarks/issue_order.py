"""How much the issue order matters: benchmark (b)'s fast order against the product's.

A coarse pipeline program issues each device's steps in its schedule's order,
and interleaves them with the messages (which occupy both devices) in one
global order estimated from step costs. Benchmark (b) (``sweep_gpt3.py``)
estimates with unit costs (a forward 1, a backward 2), so one template serves
every microbatch size; the product (``search.evaluate``, fast engine) uses the
pipeline transform's flops estimates, as the exact engine does. This runs
GPT-3 175B's space on 64 A100-80GB GPUs (every 8th valid configuration, as
``sweep_gpt3.py --product --quick``) through the product twice, the second
time with unit step costs, and compares the tables (~40 s on a 2-core CPU).

    python benchmarks/issue_order.py
"""

from __future__ import annotations

import os
import sys
import time
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_gpt3  # noqa: E402

import search._fast  # noqa: E402
from search import enumerate_configs, evaluate  # noqa: E402


def gpt3_sample() -> list:
    """``sweep_gpt3.product_configs_per_second(quick=True)``'s configurations."""
    return sweep_gpt3._subsample([c for c in enumerate_configs(sweep_gpt3.product_space()) if c.valid], 8)


def main() -> None:
    configs = gpt3_sample()
    begin = time.perf_counter()
    transform = evaluate(configs, progress=False)
    middle = time.perf_counter()
    with mock.patch.object(search._fast, "transform_step_costs", lambda *args, **kwargs: None):
        unit = evaluate(configs, progress=False)  # step_costs=None: the fast (unit-cost) order
    end = time.perf_counter()
    step = np.asarray(transform["step_time_s"], np.float64)
    change = np.asarray(unit["step_time_s"], np.float64) / step - 1.0
    peak = np.asarray(transform["peak_memory_bytes"], np.float64)
    peak_change = np.abs(np.asarray(unit["peak_memory_bytes"], np.float64) / peak - 1.0)
    schedule = np.asarray([c.schedule for c in configs])
    print(
        f"{len(configs)} configurations: transform order {middle - begin:.1f} s, "
        f"unit order {end - middle:.1f} s"
    )
    print("step time, unit order against the transform's (quantiles 0, 0.1, 0.5, 0.9, 1):")
    for name in ("1f1b", "interleaved"):
        rows = schedule == name
        q = np.quantile(change[rows], [0.0, 0.1, 0.5, 0.9, 1.0])
        print(
            f"  {name:12s} {int(rows.sum()):5d} rows: "
            + ", ".join(f"{100 * x:+.2f}%" for x in q)
            + f"; peak memory up to {100 * peak_change[rows].max():.2f}%"
        )
    statuses = int((np.asarray(transform["status"]) != np.asarray(unit["status"])).sum())
    best = [_fastest_fitting(table) for table in (transform, unit)]
    print(f"statuses that differ: {statuses}; the same best strategy: {best[0] == best[1]}")


def _fastest_fitting(table) -> int:
    fits = np.asarray(table["status"]) == "ok"
    return int(np.argmin(np.where(fits, np.asarray(table["step_time_s"], np.float64), np.inf)))


if __name__ == "__main__":
    main()
