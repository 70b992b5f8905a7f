"""Calibrating a hardware preset from measured training steps of a few strategies.

The measurements a team has are step times of strategies it ran. Each
configuration's full training program is built with the transforms (as the
exact engine does, one replica of each symmetric group) and lowered for its
own cluster, and :func:`distir_jax.calibrate.calibrate` fits the preset's
factors to all of them at once.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence

import numpy as np

from distir_jax.calibrate import Calibration, calibrate
from distir_jax.lower import lower
from search.results import COLUMNS
from search.space import Config

# The measurements file's column of measured seconds per step; its other
# columns are a results table's knob columns (a sweep's rows, measured).
MEASURED_COLUMN = "measured_step_time_s"
# Knobs a row must give; microbatch_size follows from the others.
_ROW_KNOBS = tuple(k for k in Config.KNOBS if k != "microbatch_size")

__all__ = ["MEASURED_COLUMN", "calibrate_configs", "read_measurements"]


def calibrate_configs(configs: Sequence[Config], measured, **options) -> Calibration:
    """Fits the configurations' hardware preset to their measured step times.

    Args:
      configs: valid configurations (:func:`~search.single.make_config`, or
        rows of a space) on one hardware preset and dtype; world sizes may
        differ (a smaller cluster is the first devices of the largest).
      measured: ``[B]`` measured seconds per training step, one per configuration.
      **options: :func:`~distir_jax.calibrate.calibrate`'s (``fields``,
        ``optimizer``, ``steps``, ``temperature``).

    Returns:
      The :class:`~distir_jax.calibrate.Calibration` of the largest
      configuration's cluster; ``scales`` go to
      :func:`~distir_jax.presets.register_calibrated_preset` with the preset's
      name (``configs[0].hardware`` without a count).

    Raises:
      TypeError: when ``configs`` is not a sequence of :class:`~search.space.Config`.
      ValueError: for no or an invalid configuration (with its reason), more
        than one preset or dtype, a cluster that is not the first devices of
        the largest, or what ``calibrate`` rejects.
    """
    from search._transform import build_function
    from search.single import require_configs

    configs = require_configs("configs", configs)
    if not configs:
        raise ValueError("calibrate_configs needs at least one configuration")
    for i, config in enumerate(configs):
        if not config.valid:
            raise ValueError(f"configuration {i} ({config.config_id}) is invalid: {config.reason}")
    for knob in ("hardware", "dtype"):
        values = sorted(
            {getattr(c, knob).partition(":")[0] if knob == "hardware" else c.dtype for c in configs}
        )
        if len(values) > 1:
            raise ValueError(f"the configurations must share one {knob}, got {values}")
    largest = max(configs, key=lambda c: c.world_size).topology()
    for i, config in enumerate(configs):
        if not _leads(config.topology(), largest):
            raise ValueError(
                f"configuration {i}'s cluster ({config.preset}) is not the first devices of "
                f"{largest.name}; calibrate one cluster at a time"
            )
    programs = [
        lower(build_function(c, c.global_batch_size, representative_only=True), c.topology()) for c in configs
    ]
    return calibrate(programs, measured, largest, **options)


def _leads(small, large) -> bool:
    """Whether topology ``small`` is ``large``'s first devices, figure for figure."""
    n = small.num_devices
    vectors = ("peak_flops", "memory_bandwidth", "memory_capacity")
    same = all(np.array_equal(getattr(small, f), getattr(large, f)[:n]) for f in vectors)
    same &= all(
        np.array_equal(getattr(small, f), getattr(large, f)[:n, :n])
        for f in ("link_bandwidth", "link_latency")
    )
    return same and small.launch_overhead == large.launch_overhead


def read_measurements(path: str | os.PathLike) -> tuple[list[Config], np.ndarray]:
    """The configurations and measured step times of a measurements CSV file.

    The file has a header with the knob columns of a results table (``model``,
    ``hardware``, ``world_size``, ``global_batch_size``, ``seq_len``, ``data``,
    ``tensor``, ``pipeline``, ``microbatches``, ``schedule``,
    ``virtual_stages``, ``recompute``, ``zero``, ``sequence_parallel``,
    ``overlap_grad_comm``, ``dtype``, ``optimizer``) and
    :data:`MEASURED_COLUMN`: a sweep's results file, cut to the strategies that
    were run and given that column, is one. Other columns are ignored.

    Raises:
      ValueError: naming the file, row and column of a missing column, a value
        that does not parse, a model that is not a preset, or an invalid
        configuration.
    """
    from search.results import _parse
    from search.single import make_config

    where = os.fspath(path)
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
            header = rows[0].keys() if rows else []
    except OSError as err:
        raise ValueError(f"measurements file {where!r}: {err.strerror or err}") from None
    missing = [c for c in (*_ROW_KNOBS, MEASURED_COLUMN) if c not in header]
    if not rows or missing:
        raise ValueError(f"{where}: expected a header with columns {missing or list(_ROW_KNOBS)} and rows")
    configs, measured = [], []
    for number, row in enumerate(rows, start=2):  # line numbers, after the header
        knobs = {}
        for name in (*_ROW_KNOBS, MEASURED_COLUMN):
            kind = float if name == MEASURED_COLUMN else COLUMNS[name]
            try:
                knobs[name] = _parse((row[name] or "").strip(), kind)
            except ValueError:
                raise ValueError(
                    f"{where}, line {number}: {name}={row[name]!r} is not a {kind.__name__}"
                ) from None
        try:
            config = make_config(
                knobs["model"],
                hardware=knobs["hardware"],
                world_size=knobs["world_size"],
                batch_size=knobs["global_batch_size"],
                seq_len=knobs["seq_len"] or None,  # 0: a model without a sequence
                **{
                    k: knobs[k]
                    for k in _ROW_KNOBS
                    if k not in ("model", "hardware", "world_size", "global_batch_size", "seq_len")
                },
            )
        except ValueError as err:
            raise ValueError(f"{where}, line {number}: {err}") from None
        if not config.valid:
            raise ValueError(f"{where}, line {number}: invalid configuration: {config.reason}")
        configs.append(config)
        measured.append(knobs[MEASURED_COLUMN])
    return configs, np.asarray(measured, np.float64)
