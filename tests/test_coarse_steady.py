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
    _op_keys,
    _signature,
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
        short = _signature(steady.template)
        # Without the slots only the certificate reads (out_slot is the last column).
        certificate = np.isin(short[:, -1], np.concatenate([steady.before, steady.after]))
        short[certificate & (short[:, -1] >= 0), -1] = -1
        begin, end = steady.period
        rebuilt = np.concatenate([short[:end]] + [short[begin:end]] * steady.extra_periods + [short[end:]])
        np.testing.assert_array_equal(rebuilt, _signature(pipeline_template(p, k, v, schedule, mode)))
    assert found >= 4


def test_no_steady_template_where_none_applies(monkeypatch):
    assert steady_template(4, 64, 1, "gpipe") is None  # GPipe's warm-up grows with k
    assert steady_template(1, 64, 1, "1f1b") is None  # no pipeline
    assert steady_template(4, 6, 1, "1f1b") is None  # not longer than the short one
    # Worth it: long enough to matter, and longer than the two short templates that find the period.
    assert worth_it(8, 512, 1, "1f1b", "none") and not worth_it(4, 64, 1, "1f1b", "none")
    monkeypatch.setattr(coarse_steady, "MIN_LONG_OPS", 0)
    assert worth_it(4, 64, 1, "1f1b", "none") and not worth_it(4, 8, 1, "1f1b", "none")
    assert not worth_it(4, 64, 1, "gpipe", "none")


def test_find_period():
    rng = np.random.default_rng(0)
    a, q, z = (rng.integers(0, 5, (n, 3)) for n in (7, 4, 6))
    short = np.concatenate([a, q, z])
    assert _find_period(short, np.concatenate([a, q, q, z])) == (7, 11)
    assert _find_period(short, np.concatenate([a, q, q[::-1], z])) is None
    assert _find_period(short, short) is None


@pytest.mark.parametrize("schedule, p, v", PIPELINES)
@pytest.mark.parametrize("mode", ["none", "overlap_zero"])
def test_op_keys_are_equal_exactly_where_signatures_are(schedule, p, v, mode):
    step = p if schedule == "interleaved" else 1
    short, longer = (pipeline_template(p, k, v, schedule, mode) for k in (3 * p, 3 * p + step))
    keys, signatures = _op_keys(short, longer), (_signature(short), _signature(longer))
    assert keys[0].ndim == 1  # packed: these fit in 63 bits
    rng = np.random.default_rng(0)
    i, j = rng.integers(0, len(keys[0]), 2000), rng.integers(0, len(keys[1]), 2000)
    np.testing.assert_array_equal(
        keys[0][i] == keys[1][j], np.all(signatures[0][i] == signatures[1][j], axis=1)
    )
    assert _find_period(*keys) == _find_period(*signatures) is not None


def test_op_keys_fall_back_to_signatures_when_they_do_not_fit():
    short = pipeline_template(2, 4, 1, "1f1b", "none")
    dep_slot, out_slot = short.dep_slot.copy(), short.out_slot.copy()
    dep_slot[-1], out_slot[0] = 2**31 - 2, 2**31 - 2  # two digits of 2**31: no room in 63 bits
    wide = dataclasses.replace(short, num_slots=2**31 - 1, dep_slot=dep_slot, out_slot=out_slot)
    keys = _op_keys(wide, wide)
    assert keys[0].ndim == 2
    np.testing.assert_array_equal(keys[0], _signature(wide))


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


def test_steady_templates_with_step_costs_are_checked_against_the_long_one():
    """GPT-3 175B with the transform's costs: the short template repeats into the
    long one (ordered by integer costs, every sum exact); a short template
    paired with another program's long one does not, which the check
    (``_repeats_into``) sees."""
    from distir_jax.models import get_model_config

    model = get_model_config("gpt3-175b", dtype="bf16")
    features = layer_features(model, 8, "full", [4], get_preset("dgx-a100-80gb:8", dtype="bf16"))
    p, k, v = 8, 256, 4
    layers = coarse_program.transform_layers_per_chunk(features, p * v, [0])
    costs = transform_step_costs(features, layers, [0])
    steady = steady_template(p, k, v, "interleaved", "none", step_costs=costs)
    assert steady is not None and steady.extra_periods > 0
    assert coarse_steady._repeats_into(steady, pipeline_template(p, k, v, "interleaved", "none", costs))
    other = pipeline_template(p, k, v, "interleaved", "none")  # unit costs: another order
    assert not coarse_steady._repeats_into(steady, other)


@pytest.mark.parametrize("schedule, p, v, k", [("1f1b", 4, 1, 40), ("interleaved", 2, 2, 40)])
def test_the_repeat_check_sees_a_change_in_any_part_of_the_long_template(schedule, p, v, k):
    """``_repeats_into`` compares the prefix, every copy of the period and the rest
    separately: a changed op in any of them, or one copy too many, fails it."""
    steady = steady_template(p, k, v, schedule, "overlap_zero")
    assert steady is not None and steady.extra_periods >= 2
    long = pipeline_template(p, k, v, schedule, "overlap_zero")
    assert coarse_steady._repeats_into(steady, long)
    begin, end = steady.period
    length = end - begin
    last_copy = end + (steady.extra_periods - 1) * length
    for where in (begin // 2, end + length // 2, last_copy + length // 2, long.num_ops - 1):
        stage = long.stage.copy()
        stage[where, 0] = (stage[where, 0] + 1) % p  # the op on another stage
        assert not coarse_steady._repeats_into(steady, dataclasses.replace(long, stage=stage)), where
    fewer = dataclasses.replace(steady, extra_periods=steady.extra_periods - 1)
    assert not coarse_steady._repeats_into(fewer, long)


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
    assert coarse_steady._repeats_into(b, pipeline_template(p, k, v, "interleaved", "none", nudged))
    for bad in (costs[:3], -costs):
        with pytest.raises(ValueError, match="step_costs must be"):
            steady_template(p, k, v, "interleaved", "none", step_costs=bad)
        with pytest.raises(ValueError, match="step_costs must be"):
            pipeline_template(p, k, v, "interleaved", "none", bad)
