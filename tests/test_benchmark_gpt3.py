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


def _assert_each_configuration_as_simulated_alone(model, topology, configs, result):
    """``result`` (:func:`sweep_gpt3.simulate_configs`) row by row against the
    product's coarse program of each configuration, simulated alone."""
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


def test_the_benchmark_pipeline_matches_each_configuration_simulated_alone(small_gpt):
    model, topology, configs = small_gpt
    with jax.enable_x64(True):
        result = sweep_gpt3.simulate_configs(model, topology, configs)
        assert result["steady"] > 0  # some rows come from a short steady template
        _assert_each_configuration_as_simulated_alone(model, topology, configs, result)


def test_peaks_set_by_the_gradient_reduction_transient(small_gpt):
    """Rows that share their events' bytes but for their updates' (mode "sync": the
    reduction's transient) share a pass over the events; with activations of 16
    tokens that transient sets some stages' peaks, each row's own."""
    model, topology, _ = small_gpt
    model = dataclasses.replace(model, seq_len=16)
    space = sweep_gpt3.enumerate_space(model, world=16, global_batch=32)
    configs = [c for c in space if c.mode == "sync" and c.microbatch_size == 2 and c.pipeline <= 4][::5]
    assert {c.pipeline for c in configs} == {1, 2, 4} and {c.zero for c in configs} == {False, True}
    with jax.enable_x64(True):
        result = sweep_gpt3.simulate_configs(model, topology, configs)
        _assert_each_configuration_as_simulated_alone(model, topology, configs, result)


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


def test_spaces_of_several_global_batches_swept_together_give_each_ones_rows(small_gpt):
    """Rows of several global batches share keys and templates (more size variants
    per key): each space's rows come out as that space swept alone, bit for bit."""
    model, topology, _ = small_gpt
    spaces = [sweep_gpt3.enumerate_space(model, world=16, global_batch=batch)[::7] for batch in (16, 64)]
    assert {c.global_batch for c in spaces[0]} == {16} and {c.global_batch for c in spaces[1]} == {64}
    with jax.enable_x64(True):
        alone = [sweep_gpt3.simulate_configs(model, topology, space) for space in spaces]
        together = sweep_gpt3.simulate_configs(model, topology, spaces[0] + spaces[1])
    cut = len(spaces[0])
    for name in ("step_time", "peak", "status"):
        np.testing.assert_array_equal(together[name][:cut], alone[0][name])
        np.testing.assert_array_equal(together[name][cut:], alone[1][name])


@pytest.mark.parametrize("carry", [0, 1, 2])
def test_lanes_carried_into_later_calls_change_no_result(small_gpt, monkeypatch, carry):
    """A lane whose group outlasts its call goes on in the next one (its timeline and
    durations kept, its peaks computed when it started): the same floats."""
    model, topology, configs = small_gpt
    with jax.enable_x64(True):
        want = sweep_gpt3.simulate_configs(model, topology, configs)
        monkeypatch.setattr(sweep_gpt3, "_GROUPS_PER_CALL", 3)
        monkeypatch.setattr(sweep_gpt3, "_ROWS_PER_GROUP", 2)
        monkeypatch.setattr(sweep_gpt3, "_OP_CHUNK", 64)  # groups of 1-9 chunks
        monkeypatch.setattr(sweep_gpt3, "_CARRIED_LANES", carry)
        carried = []
        lane_calls = sweep_gpt3._lane_calls
        monkeypatch.setattr(
            sweep_gpt3,
            "_lane_calls",
            lambda *a, **k: carried.append(lane_calls(*a, **k)) or carried[-1],
        )
        got = sweep_gpt3.simulate_configs(model, topology, configs)
    for name in ("step_time", "peak", "status"):
        np.testing.assert_array_equal(got[name], want[name])
    lanes = [lane for call in carried[0] for lane in call.lanes if lane is not None]
    assert any(first > 0 for _, first in lanes) == (carry > 0)


def test_lane_calls_run_every_chunk_of_every_group_once_in_one_lane(monkeypatch):
    monkeypatch.setattr(sweep_gpt3, "_GROUPS_PER_CALL", 4)
    chunks = [9, 7, 6, 5, 4, 4, 3, 2, 2, 1, 1]
    groups = [(("key", g), np.asarray([g])) for g in range(len(chunks))]  # as _groups: longest first
    size_of = {g: n * sweep_gpt3._OP_CHUNK for g, n in enumerate(chunks)}
    total = {}
    for carry in (0, 1, 2):
        ran = {}  # group: (its lane, chunks run)
        for call in sweep_gpt3._lane_calls(groups, size_of, carry):
            for lane, entry in enumerate(call.lanes):
                if entry is not None:
                    (_, members), first = entry
                    g = int(members[0])
                    assert ran.get(g, (lane, 0)) == (lane, first)  # one lane, its chunks in order
                    ran[g] = lane, first + call.length
        assert sorted(ran) == list(range(len(chunks)))
        assert all(done >= chunks[g] for g, (_, done) in ran.items())
        total[carry] = sum(call.length for call in sweep_gpt3._lane_calls(groups, size_of, carry))
    assert total[0] == 9 + 4 + 2  # each call as long as its longest group
    assert total[2] < total[1] < total[0]  # the long groups no longer hold whole calls


def test_durations_from_packed_tables_are_op_seconds_bit_for_bit(small_gpt, monkeypatch):
    """Devices of one speed let a duration read a precomputed compute part and its
    key's link per class: the same floats (sends both ways, links within and across nodes)."""
    model, topology, configs = small_gpt
    with jax.enable_x64(True):
        packed = sweep_gpt3.simulate_configs(model, topology, configs)
        monkeypatch.setattr(sweep_gpt3, "_packed_tables", lambda rows, hw_rows: None)
        general = sweep_gpt3.simulate_configs(model, topology, configs)
    for name in ("step_time", "peak", "status"):
        np.testing.assert_array_equal(packed[name], general[name])


def test_packed_tables_only_for_devices_of_one_speed(small_gpt):
    from distir_jax.kernel import hardware_rows

    model, topology, configs = small_gpt
    hardware = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), Hardware.from_topology(topology))
    rows = sweep_gpt3._Rows(model, topology, configs)
    with jax.enable_x64(True):
        hw_rows = hardware_rows(hardware, True, xp=np)
        *own, link_bytes, link_latency = sweep_gpt3._packed_tables(rows, hw_rows)
        assert [x.shape for x in own] == [(len(rows.cost),)] * 3  # compute seconds, hops, bytes
        assert link_bytes.shape == link_latency.shape == (len(rows.stages) * sweep_gpt3._LINK_CLASSES,)
        slower = dataclasses.replace(hardware, peak_flops=hardware.peak_flops * np.linspace(1.0, 2.0, 16))
        assert sweep_gpt3._packed_tables(rows, hardware_rows(slower, True, xp=np)) is None


def test_link_classes_name_the_link_kind_and_a_sends_direction():
    # Columns: cost row, stage, second stage, link kind (own, tensor, send, data).
    units = np.asarray(
        [[0, 1, -1, 0], [0, 1, -1, 1], [0, 1, 2, 2], [0, 1, 0, 2], [0, 3, 0, 2], [0, 2, -1, 3]]
    )
    s = sweep_gpt3._MAX_STAGES
    np.testing.assert_array_equal(
        sweep_gpt3._link_classes(units, 4), [1, s + 1, 2 * s + 1, 4 * s + 1, 2 * s + 3, 3 * s + 2]
    )
    with pytest.raises(ValueError, match="next stage or to the previous"):
        sweep_gpt3._link_classes(np.asarray([[0, 0, 2, 2]]), 4)
    with pytest.raises(ValueError, match="link kinds must be 0-3"):
        sweep_gpt3._link_classes(np.asarray([[0, 0, -1, 5]]), 4)
