"""Steady-state reduction: a long pipeline as a short template plus periods.

The oracle is the long template itself: its ops must be the short one's with
the period repeated, and the kernel on it (float64) must give the step time
and per-stage peak memory that the short run extrapolates to.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from distir_jax.hardware import Hardware
from distir_jax.kernel import simulate
from distir_jax.models import TransformerConfig
from distir_jax.presets import get_preset
from distir_jax.transforms import coarse_program, coarse_steady
from distir_jax.transforms.coarse import (
    balanced_layers,
    coarse_pipeline_program,
    layer_features,
    pipeline_template,
    steady_pipeline_program,
    transform_step_costs,
)
from distir_jax.transforms.coarse_schedule import order_costs
from distir_jax.transforms.coarse_steady import (
    _find_period,
    _signature,
    _signature_columns,
    extrapolate,
    steady_template,
    worth_it,
)

GPT = TransformerConfig(num_layers=8, hidden=64, num_heads=4, vocab_size=128, seq_len=16, dtype="f32")
PIPELINES = [
    ("1f1b", 2, 1),
    ("1f1b", 4, 1),
    ("interleaved", 2, 2),
    ("interleaved", 4, 2),
    ("interleaved", 2, 4),
]


@pytest.fixture(autouse=True)
def steady_wherever_it_applies(monkeypatch):
    """Short programs even where they would save little (sweeps skip those)."""
    monkeypatch.setattr(coarse_program, "worth_it", lambda *args: True)


@functools.cache
def topology():
    return get_preset("dgx-a100-80gb:16", dtype="f32")


@pytest.mark.parametrize("schedule, p, v", PIPELINES + [("1f1b", 8, 1), ("interleaved", 8, 2)])
@pytest.mark.parametrize("mode", ["none", "sync", "overlap", "overlap_zero"])
def test_long_templates_are_the_short_one_with_the_period_repeated(schedule, p, v, mode):
    step = p if schedule == "interleaved" else 1
    found = 0
    for k in range(step, 14 * p + 1, step):
        steady = steady_template(p, k, v, schedule, mode)
        if steady is None:
            continue
        found += 1
        assert steady.extra_periods >= 1 and steady.microbatches == k
        long = pipeline_template(p, k, v, schedule, mode)
        np.testing.assert_array_equal(_unrolled(steady), _signature(long))
    assert found >= 4


def _unrolled(steady) -> np.ndarray:
    """The signature of the long program ``steady`` stands for: its short template's
    with the period repeated, without the slots only the certificate reads
    (out_slot is the last column)."""
    short = _signature(steady.template)
    certificate = np.isin(short[:, -1], np.concatenate([steady.before, steady.after]))
    short[certificate & (short[:, -1] >= 0), -1] = -1
    begin, end = steady.period
    return np.concatenate([short[:end]] + [short[begin:end]] * steady.extra_periods + [short[end:]])


def test_no_steady_template_where_none_applies(monkeypatch):
    assert steady_template(4, 64, 1, "gpipe") is None  # GPipe's warm-up grows with k
    assert steady_template(1, 64, 1, "1f1b") is None  # no pipeline
    assert steady_template(4, 6, 1, "1f1b") is None  # not longer than the short one
    # Worth it: long enough to matter, and longer than the two short templates that find the period.
    assert worth_it(8, 512, 1, "1f1b", "none") and not worth_it(4, 64, 1, "1f1b", "none")
    monkeypatch.setattr(coarse_steady, "MIN_LONG_OPS", 0)
    assert worth_it(4, 64, 1, "1f1b", "none") and not worth_it(4, 8, 1, "1f1b", "none")
    assert not worth_it(4, 64, 1, "gpipe", "none")


def _period_by_brute_force(short: np.ndarray, long: np.ndarray, copies: int):
    """The latest ``(i - L, i)`` with ``long = short[:i] + short[i - L:i] * copies + short[i:]``."""
    extra = len(long) - len(short)
    if extra <= 0 or extra % copies:
        return None
    length = extra // copies
    for i in range(len(short), length - 1, -1):
        rebuilt = np.concatenate([short[:i]] + [short[i - length : i]] * copies + [short[i:]])
        if np.array_equal(rebuilt, long):
            return i - length, i
    return None


def test_find_period():
    rng = np.random.default_rng(0)
    a, q, z = (rng.integers(0, 5, (n, 3)) for n in (7, 4, 6))
    short = list(np.concatenate([a, q, z]).T)
    assert _find_period(short, list(np.concatenate([a, q, q, z]).T)) == (7, 11)
    assert _find_period(short, list(np.concatenate([a, q, q[::-1], z]).T)) is None
    assert _find_period(short, short) is None
    # Several copies inserted: their number says the period's length.
    assert _find_period(short, list(np.concatenate([a, q, q, q, z]).T), copies=2) == (7, 11)
    assert _find_period(short, list(np.concatenate([a, q, q, q, z]).T), copies=1) is None
    assert _find_period(short, list(np.concatenate([a, q, q, q[::-1], z]).T), copies=2) is None


def test_find_period_finds_the_latest_insertion_as_brute_force_does():
    """Short alphabets make blocks that also match a little earlier or later (``Z``
    starting like ``Q``, rotations of ``Q``): the latest insertion point wins."""
    rng = np.random.default_rng(1)
    found = 0
    for _ in range(400):
        a, q, z = (rng.integers(0, 2, (int(rng.integers(1, 6)), 2)) for _ in range(3))
        copies = int(rng.integers(1, 4))
        short = np.concatenate([a, q, z])
        long = np.concatenate([a] + [q] * (1 + copies) + [z])
        if rng.random() < 0.3:  # another program
            long[rng.integers(len(long))] ^= 1
        want = _period_by_brute_force(short, long, copies)
        assert _find_period(list(short.T), list(long.T), copies) == want
        found += want is not None
    assert 200 < found < 400


@pytest.mark.parametrize("schedule, p, v", PIPELINES)
@pytest.mark.parametrize("mode", ["none", "overlap_zero"])
def test_period_of_templates_as_brute_force_finds_it(schedule, p, v, mode):
    step = p if schedule == "interleaved" else 1
    short, longer, long = (
        pipeline_template(p, k, v, schedule, mode) for k in (3 * p, 3 * p + step, 3 * p + 3 * step)
    )
    a, b, c = (_signature(t) for t in (short, longer, long))
    for other, copies in ((longer, 1), (long, 3)):
        want = _period_by_brute_force(a, b if copies == 1 else c, copies)
        assert want is not None
        assert _find_period(_signature_columns(short), _signature_columns(other), copies) == want


def _programs(schedule, p, v, k, tensor, recompute, data, zero, overlap, transform_order=False, **steady):
    """The long program, and the short steady one with its SteadyTemplate.

    ``transform_order``: the pipeline transform's issue order (from the
    block's flops) and exact overlap segments, as the sweep's fast engine
    builds them; otherwise the unit-cost order.
    """
    features = layer_features(GPT, tensor, recompute, [1, 4], topology())
    layers = balanced_layers(features, p * v)
    kwargs = dict(
        pipeline=p,
        microbatches=k,
        data=data,
        virtual_stages=v,
        schedule=schedule,
        zero=zero,
        overlap=overlap,
        layers_per_chunk=layers,
    )
    if transform_order:
        kwargs.update(step_costs=transform_step_costs(features, layers, [0]), overlap_segments=True)
    long = coarse_pipeline_program(features, topology(), **kwargs)
    short, found = steady_pipeline_program(features, topology(), **kwargs, **steady)
    return found, long, short


def _extrapolate(steady, run):
    extra = np.full(len(run.step_time), steady.extra_periods, np.float64)
    finish, time = np.asarray(run.finish_slots), np.asarray(run.step_time)
    return extrapolate(finish, steady.before, steady.after, extra, time, rtol=1e-9)


CASES = [
    # schedule, p, v, k, tensor, recompute, data, zero, overlap[, transform order]
    ("1f1b", 2, 1, 16, 1, "none", 1, False, False),
    ("1f1b", 4, 1, 13, 2, "attention", 2, False, False),
    ("1f1b", 4, 1, 20, 2, "full", 2, False, True),
    ("1f1b", 2, 1, 9, 1, "attention", 2, True, True),
    ("interleaved", 2, 2, 16, 1, "none", 2, True, False),
    ("interleaved", 4, 2, 28, 2, "attention", 2, False, False),
    ("interleaved", 2, 4, 12, 2, "full", 2, False, True),
    ("interleaved", 2, 2, 14, 1, "attention", 2, True, True),
    # The transform's order and exact overlap, as the sweep's fast engine builds programs.
    ("1f1b", 4, 1, 13, 2, "attention", 2, False, True, True),
    ("1f1b", 2, 1, 11, 1, "full", 2, True, True, True),
    ("interleaved", 2, 2, 16, 1, "none", 2, True, True, True),
    ("interleaved", 4, 2, 24, 1, "attention", 1, False, False, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_extrapolated_step_time_and_peak_memory_equal_the_long_programs(case):
    steady, long, short = _programs(*case)
    assert steady is not None and int(short.num_ops) < int(long.num_ops)
    hardware = Hardware.from_topology(topology())
    with jax.enable_x64(True):
        want = np.asarray(simulate(long, hardware).step_time)
        run = simulate(short, hardware)
        got, certified = _extrapolate(steady, run)
    assert certified.all()
    np.testing.assert_allclose(got, want, rtol=1e-9)
    np.testing.assert_allclose(short.peak_bytes, long.peak_bytes, rtol=1e-12)
    np.testing.assert_array_equal(short.resident_bytes, long.resident_bytes)


def test_an_unsettled_period_is_not_certified():
    # With p + 1 microbatches the 1F1B order already repeats, but the clocks have not settled.
    steady, long, short = _programs("1f1b", 4, 1, 16, 1, "none", 1, False, False, short_microbatches=(5,))
    assert steady is not None
    hardware = Hardware.from_topology(topology())
    with jax.enable_x64(True):
        want = np.asarray(simulate(long, hardware).step_time)
        run = simulate(short, hardware)
        claimed, certified = _extrapolate(steady, run)
    assert not certified.any()
    assert np.all(np.abs(claimed - want) > 1e-6 * want)  # and what it would claim is wrong


def test_steady_needs_exactly_computed_estimated_times():
    """Step costs are ordered by as integers (order_costs), so sums stay exact for any realistic pipeline."""
    exact = np.array([[3.0, 6.0], [4.0, 8.0]])
    assert coarse_steady._exact_times(exact, 1000)
    assert coarse_steady._exact_times(exact + 0.5, 1000)  # rounded to integers first
    assert not coarse_steady._exact_times(exact, 2**50)  # sums past 2**53 would round
    assert steady_template(2, 64, 1, "1f1b", "none", step_costs=exact) is not None


def test_orders_come_from_integer_costs():
    """Integers up to 2**30 stay as they are; anything else is scaled so the largest is 2**30."""
    small = np.array([[3.0, 6.0], [4.0, 8.0]])
    np.testing.assert_array_equal(order_costs(small), small)
    big = np.array([[1.5e13, 3.0e13 + 0.25], [1.0 + 1e13, 2.0e13]])
    got = order_costs(big)
    assert got.max() == 2.0**30 and np.all(got == np.floor(got)) and np.all(got >= 1.0)
    np.testing.assert_allclose(got / got.max(), big / big.max(), rtol=1e-9)


def test_costs_that_differ_in_their_last_bits_give_one_order():
    """The pipeline transform and a coarse template sum a chunk's flops in different
    orders; GPT-3 175B's interleaved order used to differ between the two (0.16%)."""
    from distir_jax.models import get_model_config

    model = get_model_config("gpt3-175b", dtype="bf16")
    features = layer_features(model, 8, "full", [128], get_preset("dgx-a100-80gb:8", dtype="bf16"))
    p, k, v = 8, 8, 2
    costs = transform_step_costs(
        features, coarse_program.transform_layers_per_chunk(features, p * v, [0]), [0]
    )
    nudged = np.nextafter(costs, np.inf)
    a = _signature(pipeline_template(p, k, v, "interleaved", "none", costs))
    b = _signature(pipeline_template(p, k, v, "interleaved", "none", nudged))
    np.testing.assert_array_equal(a, b)


def test_steady_templates_with_step_costs_are_checked_against_the_long_one(monkeypatch):
    """GPT-3 175B with the transform's costs: the short template repeats into the
    long one (ordered by integer costs, every sum exact); paired with another
    program's long one (unit costs: another order), no short one stands for it."""
    from distir_jax.models import get_model_config

    model = get_model_config("gpt3-175b", dtype="bf16")
    features = layer_features(model, 8, "full", [4], get_preset("dgx-a100-80gb:8", dtype="bf16"))
    p, k, v = 8, 256, 4
    layers = coarse_program.transform_layers_per_chunk(features, p * v, [0])
    costs = transform_step_costs(features, layers, [0])
    steady = steady_template(p, k, v, "interleaved", "none", step_costs=costs)
    assert steady is not None and steady.extra_periods > 0
    long = pipeline_template(p, k, v, "interleaved", "none", costs)
    np.testing.assert_array_equal(_unrolled(steady), _signature(long))
    other = pipeline_template(p, k, v, "interleaved", "none")
    assert not np.array_equal(_signature(other), _signature(long))
    # The check reads the long order's events (every mode's template is made of them).
    other_events = coarse_steady.core_columns(p, k, v, "interleaved", None)
    built = coarse_steady.core_columns
    monkeypatch.setattr(
        coarse_steady, "core_columns", lambda p_, k_, *rest: other_events if k_ == k else built(p_, k_, *rest)
    )
    coarse_steady._core_period.cache_clear()
    assert steady_template(p, k, v, "interleaved", "none", step_costs=costs) is None
    coarse_steady._core_period.cache_clear()


@pytest.mark.parametrize("schedule, p, v", PIPELINES)
@pytest.mark.parametrize("mode", ["none", "sync", "overlap", "overlap_zero"])
def test_long_templates_in_the_transforms_order_are_the_short_one_repeated(schedule, p, v, mode):
    """The transform's order (step costs) is checked once on the orders' events,
    which every data-parallel mode shares: each mode's long template, exact
    overlap segments and per-weight ZeRO updates included, is then its short
    template with the period repeated."""
    features = layer_features(GPT, 2, "attention", [4], topology())
    layers = balanced_layers(features, p * v)
    costs = transform_step_costs(features, layers, [0])
    plan = (None, None)
    if mode.startswith("overlap"):
        plan = coarse_program.segment_plan(features, layers, mode == "overlap_zero")
    step = p if schedule == "interleaved" else 1
    found = 0
    for k in range(step, 14 * p + 1, step):
        steady = steady_template(p, k, v, schedule, mode, costs, *plan)
        if steady is None:
            continue
        found += 1
        long = pipeline_template(p, k, v, schedule, mode, costs, *plan)
        np.testing.assert_array_equal(_unrolled(steady), _signature(long))
    assert found >= 4


@pytest.mark.parametrize("mode", ["none", "sync"])
def test_modes_without_reductions_check_the_order_without_last_backwards(mode):
    """Their templates do not tell a last backward from another backward, so their
    period may hold one (found by fuzzing: costs with a backward cheaper than
    its forward, whose shortest order's period does); overlap modes, which
    reduce after last backwards, find none there."""
    costs = np.array(
        [
            [0.0705747, 13.86651075],
            [0.06145347, 1.39236827],
            [0.30459791, 0.18975016],
            [0.36284176, 6.26640143],
        ]
    )
    for k in (7, 8, 19):
        steady = steady_template(4, k, 1, "1f1b", mode, costs)
        assert steady is not None and steady.template.microbatches == 6, k
        assert coarse_steady.core_columns(4, 6, 1, "1f1b", order_costs(costs))[4][: steady.period[1]].any()
        np.testing.assert_array_equal(
            _unrolled(steady), _signature(pipeline_template(4, k, 1, "1f1b", mode, costs))
        )
    assert steady_template(4, 7, 1, "1f1b", "overlap", costs) is None


@pytest.mark.parametrize("schedule, p, v, k", [("1f1b", 4, 1, 40), ("interleaved", 2, 2, 40)])
def test_the_period_check_sees_a_change_in_any_part_of_the_long_template(schedule, p, v, k):
    """The period is found where the long template inserts copies of it
    (``_short_in``), so a changed op in the prefix, in any copy of the period or
    in the rest, or one copy too many, leaves none."""
    steady = steady_template(p, k, v, schedule, "overlap_zero")
    assert steady is not None and steady.extra_periods >= 2
    family = (p, steady.template.microbatches, v, schedule, "overlap_zero", None, None, None)
    long = pipeline_template(p, k, v, schedule, "overlap_zero")
    found = coarse_steady._short_in(long, family)
    assert found is not None and found.period == steady.period and found.template is steady.template
    begin, end = steady.period
    length = end - begin
    last_copy = end + (steady.extra_periods - 1) * length
    for where in (begin // 2, end + length // 2, last_copy + length // 2, long.num_ops - 1):
        stage = long.stage.copy()
        stage[where, 0] = (stage[where, 0] + 1) % p  # the op on another stage
        assert coarse_steady._short_in(dataclasses.replace(long, stage=stage), family) is None, where
    more = pipeline_template(p, k + (p if schedule == "interleaved" else 1), v, schedule, "overlap_zero")
    assert coarse_steady._short_in(dataclasses.replace(more, microbatches=k), family) is None


def test_step_costs_that_round_to_the_same_integers_share_a_short_template():
    """Short templates are cached by the integers steps are ordered by
    (``order_costs``), so flops estimates that differ only past them (other
    microbatch sizes of one model) share one; costs that are no step costs
    fail as ``pipeline_template`` says."""
    costs = np.array([[1.0e13, 2.0e13], [1.2e13, 2.4e13], [1.0e13, 2.0e13], [1.4e13, 2.8e13]])
    nudged = costs * (1 + 1e-12) + 1.0
    np.testing.assert_array_equal(order_costs(costs), order_costs(nudged))
    p, k, v = 2, 64, 2
    a = steady_template(p, k, v, "interleaved", "none", step_costs=costs)
    b = steady_template(p, k, v, "interleaved", "none", step_costs=nudged)
    assert a is not None and a.template is b.template
    long = pipeline_template(p, k, v, "interleaved", "none", nudged)
    np.testing.assert_array_equal(_unrolled(b), _signature(long))
    for bad in (costs[:3], -costs):
        with pytest.raises(ValueError, match="step_costs must be"):
            steady_template(p, k, v, "interleaved", "none", step_costs=bad)
        with pytest.raises(ValueError, match="step_costs must be"):
            pipeline_template(p, k, v, "interleaved", "none", bad)
