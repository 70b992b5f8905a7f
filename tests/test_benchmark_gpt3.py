"""Benchmark (b)'s own pipeline (grouped timeline kernel, steady templates, host peaks)
against the product's coarse program of each configuration, simulated alone."""

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest

from distir_jax.hardware import Hardware
from distir_jax.kernel import simulate
from distir_jax.models import get_model_config
from distir_jax.presets import get_preset
from distir_jax.transforms.coarse import coarse_pipeline_program, layer_features

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import sweep_gpt3  # noqa: E402


@pytest.fixture(scope="module")
def small_gpt():
    """A small GPT on 16 devices of the benchmark's preset: cheap programs, every mode."""
    model = get_model_config("gpt2-small", dtype="bf16")
    topology = get_preset("dgx-a100-80gb:16")
    space = sweep_gpt3.enumerate_space(model, world=16, global_batch=32)
    rng = np.random.default_rng(0)
    # Every pipeline depth and data-parallel mode, and the longest pipelines (steady templates).
    by_kind = {}
    for c in space:
        by_kind.setdefault((c.pipeline, c.virtual_stages > 1, c.mode), []).append(c)
    configs = [group[int(rng.integers(len(group)))] for group in by_kind.values()]
    configs += sorted(space, key=lambda c: -c.microbatches * c.pipeline)[:4]
    return model, topology, configs


def test_the_benchmark_pipeline_matches_each_configuration_simulated_alone(small_gpt):
    model, topology, configs = small_gpt
    with jax.enable_x64(True):
        result = sweep_gpt3.simulate_configs(model, topology, configs)
        assert result["steady"] > 0  # some rows come from a short steady template
        hardware = Hardware.from_topology(topology)
        for i, c in enumerate(configs):
            features = layer_features(model, c.tensor, c.recompute, c.microbatch_size, topology)
            program = coarse_pipeline_program(
                features,
                topology,
                pipeline=c.pipeline,
                microbatches=c.microbatches,
                data=c.data,
                virtual_stages=c.virtual_stages,
                schedule=c.schedule,
                zero=c.zero,
                overlap=c.overlap,
            )
            alone = simulate(program, hardware)
            np.testing.assert_allclose(
                result["step_time"][i], float(alone.step_time[0]), rtol=1e-9, err_msg=str(c)
            )
            np.testing.assert_allclose(
                result["peak"][i], float(np.max(alone.peak_memory[0])), rtol=1e-9, err_msg=str(c)
            )
            assert result["status"][i] == int(alone.status[0]), c


def test_every_row_is_simulated_once_whatever_the_call_shape(small_gpt, monkeypatch):
    """Groups split across calls, and spare rows and groups, change no result."""
    model, topology, configs = small_gpt
    with jax.enable_x64(True):
        want = sweep_gpt3.simulate_configs(model, topology, configs)
        monkeypatch.setattr(sweep_gpt3, "_GROUPS_PER_CALL", 3)
        monkeypatch.setattr(sweep_gpt3, "_ROWS_PER_GROUP", 2)
        got = sweep_gpt3.simulate_configs(model, topology, configs)
    for name in ("step_time", "peak", "status"):
        np.testing.assert_array_equal(got[name], want[name])
    assert got["calls"] > want["calls"]


def test_durations_from_packed_costs_are_op_seconds_bit_for_bit(small_gpt, monkeypatch):
    """Devices of one speed let a duration read a precomputed compute part: the same floats."""
    model, topology, configs = small_gpt
    with jax.enable_x64(True):
        packed = sweep_gpt3.simulate_configs(model, topology, configs)
        monkeypatch.setattr(sweep_gpt3, "_packed_costs", lambda cost, hw_rows: None)
        general = sweep_gpt3.simulate_configs(model, topology, configs)
    for name in ("step_time", "peak", "status"):
        np.testing.assert_array_equal(packed[name], general[name])


def test_packed_costs_only_for_devices_of_one_speed():
    from distir_jax.kernel import hardware_rows

    hardware = jax.tree_util.tree_map(
        lambda x: np.asarray(x, np.float64), Hardware.from_topology(get_preset("dgx-a100-80gb:16"))
    )
    cost = np.abs(np.random.default_rng(0).normal(size=(5, 7)))
    with jax.enable_x64(True):
        assert sweep_gpt3._packed_costs(cost, hardware_rows(hardware, True, xp=np)).shape == (5, 3)
        slower = dataclasses.replace(hardware, peak_flops=hardware.peak_flops * np.linspace(1.0, 2.0, 16))
        assert sweep_gpt3._packed_costs(cost, hardware_rows(slower, True, xp=np)) is None
