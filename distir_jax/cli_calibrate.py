"""``distir-jax calibrate``: a hardware preset fitted to measured step times.

The measurements are a CSV file of strategies that were run, as rows of a
results table (a sweep's file, cut to those rows) with a column of measured
seconds per step. The fit is written as a calibration file that ``sweep`` and
``simulate`` load with ``--presets``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex

import numpy as np

DEFAULT_DIRECTORY = "results"
# A preset name the printed commands can repeat unquoted.
_NAME = re.compile(r"[A-Za-z0-9._-]+")


def add_calibrate_parser(sub, field_names, add_file_options) -> None:
    """The ``calibrate`` subcommand's options (``field_names``: parses ``--fields``;
    ``add_file_options``: adds the commands' shared ``--presets`` and ``--models``)."""
    from distir_jax.calibrate import CALIBRATABLE_FIELDS
    from search.calibration import MEASURED_COLUMN

    c = sub.add_parser(
        "calibrate",
        help="fit a hardware preset to measured step times",
        description="Fit one factor per hardware figure (peak FLOP/s, memory bandwidth, link "
        "bandwidth and latency, kernel launch overhead) of the strategies' preset so that their "
        "simulated step times match measured ones, and write the calibrated preset to a file "
        "that `sweep --presets` and `simulate --presets` load. MEASUREMENTS is a CSV file with a "
        "results table's knob columns (model, hardware, world_size, global_batch_size, seq_len, "
        "data, tensor, pipeline, microbatches, schedule, virtual_stages, recompute, zero, "
        f"sequence_parallel, overlap_grad_comm, dtype, optimizer) and {MEASURED_COLUMN}: a "
        "sweep's results file cut to the strategies you ran, with that column added.",
    )
    c.add_argument("measurements", help="the measurements CSV file")
    add_file_options(c)  # the measured rows may name a calibrated preset, or a model of a file
    c.add_argument("--name", required=True, help="the calibrated preset's name (no ':')")
    c.add_argument(
        "--output",
        default=None,
        metavar="PATH",
        help=f"the calibration file to write (default: {DEFAULT_DIRECTORY}/<name>.calibration.json)",
    )
    c.add_argument(
        "--engine",
        default="fast",
        choices=("fast", "exact"),
        help="fast: each strategy's coarse program (built in milliseconds, GPT-3 175B "
        "included), refitted until it is exact on the calibrated figures; strategies it does "
        "not model (sequence parallelism in an MLP, say) run exact. exact: the fine programs the transforms "
        "build (minutes for GPT-3-sized pipelines). Default: fast",
    )
    c.add_argument(
        "--fields",
        type=field_names,
        default=None,
        metavar="NAME,...",
        help=f"figures to fit, from {', '.join(CALIBRATABLE_FIELDS)} (default: all that the "
        "preset gives a non-zero value, but the network ones; network_bandwidth and network_latency "
        "give the links between nodes factors of their own, and link_* then those within a node: "
        "fit them from strategies whose traffic splits between the two differently)",
    )


def run_calibrate(args: argparse.Namespace) -> int:
    """Runs ``calibrate``. Raises ValueError for bad input (the CLI's one-line usage error)."""
    from distir_jax.calibrate import NETWORK_FIELDS, between_nodes, save_calibration
    from search.calibration import calibrate_configs, read_measurements

    name = args.name
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"--name must be letters, digits, '.', '_' or '-' (a name commands can repeat), got {name!r}"
        )
    if args.output == "":
        raise ValueError("--output must be a file path, got an empty one")
    output = args.output or os.path.join(DEFAULT_DIRECTORY, f"{name}.calibration.json")
    configs, measured = read_measurements(args.measurements)
    base = configs[0].hardware.partition(":")[0]
    print(f"calibrating {base} on {len(configs)} measured strategies ...", flush=True)
    fit = calibrate_configs(configs, measured, engine=args.engine, fields=args.fields)
    print("factor by figure (calibrated = nominal x factor):")
    for field, factor in fit.scales.items():
        note = ""
        if field in fit.unconstrained:
            note = "  (no measured strategy depends on it: left as it is)"
        elif field in fit.weakly_determined:
            note = "  (weakly determined: a 1% error in the measurements could move it 2x)"
        print(f"  {field:18s} {factor:.4g}{note}")
    print("step time against the measured one:    nominal   calibrated")
    nominal, calibrated = fit.initial / fit.measured - 1, fit.relative_error
    for config, before, after in zip(configs, nominal, calibrated, strict=True):
        label = f"d{config.data} t{config.tensor} p{config.pipeline} batch {config.global_batch_size}"
        print(f"  {config.model:12s} {label:28s} {before:+9.2%} {after:+11.2%}")
    worst = float(np.max(np.abs(calibrated)))
    if worst > 0.05:
        print(
            f"the calibrated figures still miss a measurement by {worst:.1%}: the cost model does not "
            "capture everything these runs spent time on (or a measurement is off)"
        )
        if between_nodes(fit.topology).any() and not set(NETWORK_FIELDS) & set(fit.scales):
            fields = ",".join([*fit.scales, *NETWORK_FIELDS])
            print(
                "  these runs span nodes, whose network may reach another share of its figures than the "
                f"links within a node: --fields {fields} fits it apart"
            )
    if os.path.dirname(output):
        os.makedirs(os.path.dirname(output), exist_ok=True)
    save_calibration(output, name, base, fit.scales)
    print(f"wrote {output}")
    print(f"use it: distir-jax sweep --presets {shlex.quote(output)} --hardware {name}")
    return 0
