"""Measurements for calibration tests: a sweep's rows "run" on a lab cluster
whose true figures are a registered preset, with their step times as measured."""

import csv

from search import StrategySpace, evaluate
from search.calibration import MEASURED_COLUMN


def lab_rows(path, preset: str, world_sizes=(1, 2, 4)) -> list[dict]:
    """The ok rows (CSV text values) of a small MLP sweep on ``preset`` over ``world_sizes``
    GPUs and every data, tensor and pipeline layout, its results written to ``path``."""
    space = StrategySpace(
        model="mlp-small", world_sizes=world_sizes, global_batch_sizes=(64, 1024), microbatches=(2,),
        schedules=("1f1b",), zero=(False,), overlap_grad_comm=(False,), hardware=(preset,),
    )  # fmt: skip
    evaluate(space, results_path=path, progress=False)
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row["status"] == "ok"]


def write_measurements(path, rows: list[dict], measured_from: str = "step_time_s", **changes):
    """A measurements file of ``rows`` (with ``changes``), each measured as its ``measured_from``."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], MEASURED_COLUMN])
        writer.writeheader()
        for row in rows:
            writer.writerow(row | changes | {MEASURED_COLUMN: row[measured_from]})
    return path
