"""Calibrating a hardware preset from measured training steps of a few strategies.

The measurements a team has are step times of strategies it ran. Each
configuration's training program is lowered for its own cluster, and
:func:`distir_jax.calibrate.calibrate` fits the preset's factors to all of
them at once. The programs come from one of the sweep's engines:

* ``"fast"`` (default): the fast engine's coarse program (one op per pipeline
  step, message and data-parallel reduction), built in milliseconds where the
  transforms take minutes for a GPT-3-sized model, and thousands of ops
  where the fine program has a million. A coarse op sums its fine ops' times,
  each fine op costed as compute- or memory-bound on the hardware its block
  was measured on; that is exact there and only there. So the fit is
  repeated: blocks are measured again on the calibrated figures, and the
  fit restarts from them until the programs no longer change (one or two
  rounds more; none when no fine op changes side), at most ``_MAX_ROUNDS``
  fits and one more (a settled fit short of exact gets ``calibrate``'s
  smoothed escape past a kink once), keeping the one whose own programs
  miss the measurements least.
  Its step times (``predicted``) are the fine programs' own on its figures.
* ``"exact"``: the full training program built with the transforms (one
  replica of each symmetric group), as the exact engine does.

Configurations the fast engine does not model (see
:func:`search._fast.fast_unsupported`) get their fine programs either way.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np

from distir_jax.calibrate import _EXACT_FIT, Calibration, calibrate, fit_factors, step_times_on
from distir_jax.lower import Program
from search.results import COLUMNS
from search.single import fine_program
from search.space import Config

_ENGINES = ("fast", "exact")
# Fits on coarse programs at most (exact measurements settle in 1-3).
_MAX_ROUNDS = 5

# The measurements file's column of measured seconds per step; its other
# columns are a results table's knob columns (a sweep's rows, measured).
MEASURED_COLUMN = "measured_step_time_s"
# Knobs a row must give; microbatch_size follows from the others. A row may
# leave out training_precision (files from before that knob): its dtype's default.
_OPTIONAL_KNOBS = ("training_precision",)
_ROW_KNOBS = tuple(k for k in Config.KNOBS if k != "microbatch_size")

__all__ = ["MEASURED_COLUMN", "calibrate_configs", "read_measurements"]


def calibrate_configs(configs: Sequence[Config], measured, *, engine: str = "fast", **options) -> Calibration:
    """Fits the configurations' hardware preset to their measured step times.

    Args:
      configs: valid configurations (:func:`~search.single.make_config`, or
        rows of a space) on one hardware preset and dtype; world sizes may
        differ (a smaller cluster is the first devices of the largest).
      measured: ``[B]`` measured seconds per training step, one per configuration.
      engine: ``"fast"`` (coarse programs, refitted until exact; see the
        module's docstring) or ``"exact"`` (fine programs).
      **options: :func:`~distir_jax.calibrate.calibrate`'s (``fields``,
        ``optimizer``, ``steps``, ``temperature``); ``steps`` bounds each
        fit (the fast engine fits up to ``_MAX_ROUNDS`` times).

    Returns:
      The :class:`~distir_jax.calibrate.Calibration` of the largest
      configuration's cluster; ``scales`` go to
      :func:`~distir_jax.presets.register_calibrated_preset` with the preset's
      name (``configs[0].hardware`` without a count). With the fast engine,
      ``initial`` is the first round's (the nominal figures) and ``losses``
      run over every round.

    Raises:
      TypeError: when ``configs`` is not a sequence of :class:`~search.space.Config`.
      ValueError: for no or an invalid configuration (with its reason), more
        than one preset or dtype, a cluster that is not the first devices of
        the largest, an unknown engine, or what ``calibrate`` rejects.
    """
    from search.single import require_configs

    if engine not in _ENGINES:
        raise ValueError(f"engine must be one of {list(_ENGINES)}, got {engine!r}")
    if "initial_scales" in options:
        raise ValueError(
            "calibrate_configs starts from the preset's own figures; initial_scales is not an option"
        )
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
    if engine == "exact":
        return calibrate([fine_program(c) for c in configs], measured, largest, **options)
    return _calibrate_coarse(configs, measured, largest, options)


def _calibrate_coarse(configs: list[Config], measured, largest, options: dict) -> Calibration:
    """:func:`calibrate_configs` on coarse programs, refitted until they no longer change.

    Each round measures blocks on the last fit's figures and fits from there.
    Where measurements the model cannot meet exactly keep a fine op moving
    between compute- and memory-bound from round to round, the rounds stop
    after ``_MAX_ROUNDS`` fits (one more where a settled fit goes on past a
    kink), at the fit whose own programs (exact on its figures) miss the
    measurements least.
    """
    from search._fast import FastEngine, fast_unsupported

    arguments = dict(dict.fromkeys(("fields", "optimizer", "steps", "temperature")), **options)
    fine = {i: fine_program(c) for i, c in enumerate(configs) if fast_unsupported(c)}
    fits, best, fitted, scales, escaped = [], None, None, {}, False
    while True:
        engine = FastEngine(configs, scales=scales)
        programs = [fine[i] if i in fine else engine.long_program(c) for i, c in enumerate(configs)]
        if fits:  # the last fit, judged on programs exact on its figures
            settled = _same_programs(programs, fitted)  # then its own times are exact already
            predicted = fits[-1].predicted if settled else step_times_on(programs, fits[-1].topology)
            loss = float(np.mean(np.log(predicted / fits[-1].measured) ** 2))
            if best is None or loss < best[0]:
                best = (loss, dataclasses.replace(fits[-1], predicted=predicted))
            # Settled short of an exact fit: once, let the fit go on past a kink
            # (calibrate's smoothed escape; the rounds before need none, as each
            # restarts from new programs anyway).
            escape = settled and best[0] > _EXACT_FIT and not escaped
            if (settled and not escape) or len(fits) >= _MAX_ROUNDS + escaped + escape:
                break
            escaped |= escape
        else:
            escape = False
        start = scales or None
        fits.append(
            fit_factors(programs, measured, largest, initial_scales=start, escape=escape, **arguments)
        )
        fitted, scales = programs, fits[-1].scales
    fit, losses = best[1], np.concatenate([fit.losses for fit in fits])
    # A later round's programs may not depend on a field the nominal figures' did
    # (every fine op of it memory-bound on the fitted figures): its factor stayed
    # where that round started, and the fit hardly pins it.
    unconstrained = tuple(f for f in fit.unconstrained if f in fits[0].unconstrained)
    weak = set(fit.weakly_determined) | (set(fit.unconstrained) - set(unconstrained))
    return dataclasses.replace(
        fit,
        initial=fits[0].initial,
        losses=losses,
        unconstrained=unconstrained,
        weakly_determined=tuple(f for f in fit.scales if f in weak),
    )


def _same_programs(a: list[Program], b: list[Program]) -> bool:
    leaves = (jax.tree_util.tree_leaves(p) for p in (a, b))
    return all(np.array_equal(x, y) for x, y in zip(*leaves, strict=True))


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
    ``overlap_grad_comm``, ``dtype``, ``optimizer``; optionally
    ``training_precision``, by default the dtype's) and
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
        with open(path, newline="", encoding="utf-8-sig") as f:  # (-sig: spreadsheets' byte order mark)
            rows = list(csv.DictReader(f))
            header = rows[0].keys() if rows else []
    except OSError as err:
        raise ValueError(f"measurements file {where!r}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"measurements file {where!r} is not UTF-8 text: {err.reason} at byte {err.start}"
        ) from None
    required = [c for c in (*_ROW_KNOBS, MEASURED_COLUMN) if c not in _OPTIONAL_KNOBS]
    missing = [c for c in required if c not in header]
    if not rows or missing:
        raise ValueError(f"{where}: expected a header with columns {missing or required} and rows")
    given = [c for c in (*_ROW_KNOBS, MEASURED_COLUMN) if c in header]
    configs, measured = [], []
    for number, row in enumerate(rows, start=2):  # line numbers, after the header
        knobs = dict.fromkeys(_OPTIONAL_KNOBS)
        for name in given:
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
        try:
            devices = config.topology().num_devices
        except ValueError as err:
            raise ValueError(f"{where}, line {number}: {err}") from None
        if devices < config.world_size:
            raise ValueError(
                f"{where}, line {number}: world_size={config.world_size} needs {config.world_size} devices; "
                f"hardware {knobs['hardware']!r} has {devices}"
            )
        seconds = knobs[MEASURED_COLUMN]
        if not (np.isfinite(seconds) and seconds > 0):
            raise ValueError(
                f"{where}, line {number}: {MEASURED_COLUMN}={seconds!r} is not a positive number"
            )
        configs.append(config)
        measured.append(knobs[MEASURED_COLUMN])
    return configs, np.asarray(measured, np.float64)
