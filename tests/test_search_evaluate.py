"""Batched sweeps against the reference simulator; sharding, resuming and compile reuse."""

import dataclasses
import functools
import gc
import importlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from concurrent.futures import Future

import jax
import numpy as np
import pytest

pytest.importorskip("distir_jax.transforms.parallelize")

from distir_jax.executor.reference import reference_simulate  # noqa: E402
from distir_jax.lower import Capacity, pad_program  # noqa: E402
from distir_jax.models import TransformerConfig  # noqa: E402
from search import ResultTable, StrategySpace, build_function, enumerate_configs, evaluate  # noqa: E402
from search._programs import RowStack, stack_rows  # noqa: E402

# `search.evaluate` the module (the package re-exports the function of that name).
evaluate_module = importlib.import_module("search.evaluate")
TINY_GPT = TransformerConfig(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)

MLP_SPACE = StrategySpace(
    model="mlp-xs",
    world_sizes=(1, 2, 4),
    global_batch_sizes=(16, 32, 64),
    microbatches=(2, 4),
    schedules=("gpipe", "1f1b"),
    zero=(False, True),
    overlap_grad_comm=(False, True),
)
GPT_SPACE = StrategySpace(
    model=TINY_GPT,
    world_sizes=(1, 2, 4),
    global_batch_sizes=(8, 16),
    microbatches=(2,),
    schedules=("1f1b", "interleaved"),
    recompute=("none", "attention", "full"),
    sequence_parallel=(False, True),
    optimizer="adam",
)


@pytest.fixture(scope="module")
def swept():
    configs = list(enumerate_configs(MLP_SPACE)) + list(enumerate_configs(GPT_SPACE))
    return configs, evaluate(configs, progress=False, engine="exact")  # the fast engine: test_search_fast


def test_one_row_per_configuration_in_order(swept):
    configs, table = swept
    assert table["config_id"].tolist() == [c.config_id for c in configs]
    assert set(table["status"].tolist()) <= {"ok", "out of memory", "invalid"}
    simulated = table["status"] != "invalid"
    assert simulated.sum() > 50
    assert all(r for r in table["reason"][~simulated])  # every invalid row says why
    for name in ("step_time_s", "throughput_samples_per_s", "peak_memory_bytes", "bubble_time_s"):
        assert not np.isnan(table[name]).any()


def test_sweep_matches_the_reference_simulator(swept):
    """200 random rows: the default (float64) sweep to 1e-9, and a float32 sweep of
    the same rows to 1e-5, against the reference simulator (float64) run alone."""
    configs, table = swept
    simulated = np.flatnonzero(table["status"] != "invalid")
    assert len(simulated) >= 200
    picked = np.random.default_rng(0).choice(simulated, size=200, replace=False)
    narrow = evaluate([configs[i] for i in picked], progress=False, engine="exact", precision="float32")
    for j, i in enumerate(picked):
        fn, topology = build_function(configs[i])
        reference = reference_simulate(fn, topology)
        peak = max(reference.peak_memory.values())
        for got, rtol in ((table, 1e-9), (narrow.take([j]), 1e-5)):
            k = i if got is table else 0
            np.testing.assert_allclose(
                got["step_time_s"][k], reference.step_time, rtol=rtol, err_msg=str(configs[i])
            )
            np.testing.assert_allclose(got["peak_memory_bytes"][k], peak, rtol=1e-12, err_msg=str(configs[i]))
            assert got["throughput_samples_per_s"][k] == pytest.approx(
                configs[i].global_batch_size / reference.step_time, rel=rtol
            )


def test_utilization_is_the_models_flops_over_the_gpus_peak(swept):
    from distir_jax.models import model_flops_per_sample

    configs, table = swept
    simulated = table["status"] != "invalid"
    assert (table["mfu"][~simulated] == 0).all() and (table["model_tflops_per_gpu"][~simulated] == 0).all()
    for i in np.flatnonzero(simulated):
        c = configs[i]
        flops_per_s = model_flops_per_sample(c.model_config) * c.global_batch_size / table["step_time_s"][i]
        peak = c.world_size * c.topology().peak_flops[0]  # the presets' GPUs are all alike
        assert table["mfu"][i] == pytest.approx(flops_per_s / peak, rel=1e-12)
        assert table["model_tflops_per_gpu"][i] == pytest.approx(flops_per_s / c.world_size / 1e12, rel=1e-12)
    # Every simulated row does some of the model's work, and none beats the GPUs' peak.
    assert 0 < table["mfu"][simulated].min() and table["mfu"].max() < 1


def test_breakdown_adds_up_to_the_step_time_with_one_stream(swept):
    configs, table = swept
    rows = [i for i, c in enumerate(configs) if not c.overlap_grad_comm and table["status"][i] != "invalid"]
    total = table["compute_time_s"][rows] + table["communication_time_s"][rows] + table["bubble_time_s"][rows]
    np.testing.assert_allclose(total, table["step_time_s"][rows], rtol=1e-4)
    assert (table["compute_time_s"][rows] > 0).all() and (table["bubble_time_s"][rows] >= 0).all()
    single = [i for i in rows if configs[i].world_size == 1]
    assert (table["communication_time_s"][single] == 0).all()


def test_one_compiled_kernel_serves_many_structural_keys(swept, monkeypatch):
    configs, _ = swept
    subset = [c for c in configs if c.model == "mlp-xs" and c.world_size <= 2 and not c.zero]
    assert len({c.structural_key() for c in subset if c.valid}) > 5
    capacities = []
    run = evaluate_module._run

    def spy(call, rows, periods, devices, num_items):
        capacities.append(rows.capacity)
        return run(call, rows, periods, devices, num_items)

    monkeypatch.setattr(evaluate_module, "_run", spy)
    monkeypatch.setattr(evaluate_module, "_HOST_CALL_SECONDS", 0)  # every call runs the compiled kernel
    monkeypatch.setattr(evaluate_module, "_COMPILED", {})
    evaluate(subset, progress=False)
    assert len(evaluate_module._COMPILED) == 1  # one compile
    assert len({c.num_ops for c in capacities}) > 1 or len(capacities) == 1


@pytest.mark.parametrize("max_bytes", [200_000, 60_000])
def test_held_programs_stay_bounded_and_early_calls_change_nothing(swept, monkeypatch, max_bytes):
    configs, _ = swept
    subset = configs[:80]
    held, in_buckets, programs = [], [], {}
    add = evaluate_module._Batcher.add

    def spy(self, config, prepared, variant, engine):
        programs[id(prepared)] = prepared.nbytes
        add(self, config, prepared, variant, engine)
        in_buckets.append(sum(sum(h.values()) for h in self.held.values()))
        held.append(in_buckets[-1] + self.queued_bytes)  # calls waiting for their kernels too

    monkeypatch.setattr(evaluate_module._Batcher, "add", spy)
    # A kernel-memory bound this small lets the programs of only a few keys wait at once.
    tight = evaluate(subset, progress=False, max_bytes=max_bytes)
    assert max(held) <= evaluate_module._HELD_PER_CALL_BYTES * max_bytes + max(programs.values())
    assert max(in_buckets) < sum(programs.values())  # buckets were flushed early
    monkeypatch.undo()
    assert tight == evaluate(subset, progress=False)


def test_one_configuration_in_detail_matches_the_reference_op_by_op(swept):
    # simulate_config runs on the host (no compile): every op's times as the reference's.
    from search.single import simulate_config

    configs, table = swept
    picked = [i for i, c in enumerate(configs) if c.valid and c.pipeline > 1 and c.data > 1][:2]
    picked += [i for i, c in enumerate(configs) if c.valid and c.tensor > 1][:1]
    assert len(picked) == 3
    for i in picked:
        one = simulate_config(configs[i])
        reference = reference_simulate(one.function, configs[i].topology())
        np.testing.assert_allclose(one.op_finish, reference.op_finish, rtol=1e-5, atol=1e-12)
        np.testing.assert_allclose(one.row["step_time_s"], reference.step_time, rtol=1e-5)
        np.testing.assert_allclose(one.row["step_time_s"], table["step_time_s"][i], rtol=1e-5)
        assert one.row["peak_memory_bytes"] == table["peak_memory_bytes"][i]
        assert (one.op_start <= one.op_finish).all() and len(one.op_start) == len(one.function.ops)


def test_fp8_rows_are_the_reference_simulators_and_need_fp8_tensor_cores():
    """Training precision "mixed-fp8" in a sweep: on H100s each row is its fine
    program's reference simulation (FP8 GEMMs through tensor and sequence
    parallelism, pipelines and recomputation), shorter than "mixed" on one GPU and
    in less memory (the linear layers' saved inputs are f8); on A100s the rows are
    invalid and say why."""
    model = dataclasses.replace(TINY_GPT, dtype="bf16")
    knobs = dict(model=model, global_batch_sizes=(8,), microbatches=(4,), recompute=("none", "full"))
    space = StrategySpace(
        hardware=("dgx-h100", "dgx-a100-80gb"),
        world_sizes=(1, 4),
        training_precision=("mixed", "mixed-fp8"),
        sequence_parallel=(False, True),
        schedules=("1f1b",),
        **knobs,
    )
    configs = list(enumerate_configs(space))
    table = evaluate(configs, progress=False)
    checked = 0
    for i, config in enumerate(configs):
        if config.training_precision == "mixed-fp8" and config.preset.startswith("dgx-a100"):
            assert table["status"][i] == "invalid" and "no FP8 tensor cores" in table["reason"][i]
            continue
        if table["status"][i] == "invalid" or (config.training_precision != "mixed-fp8" and checked % 3):
            continue
        reference = reference_simulate(*build_function(config))
        np.testing.assert_allclose(
            table["step_time_s"][i], reference.step_time, rtol=1e-9, err_msg=str(config)
        )
        assert table["peak_memory_bytes"][i] == max(reference.peak_memory.values())
        checked += 1
    assert checked >= 10
    one = {
        c.training_precision: i
        for i, c in enumerate(configs)
        if c.world_size == 1 and c.preset.startswith("dgx-h100") and c.recompute == "none"
    }
    fp8, mixed = one["mixed-fp8"], one["mixed"]
    assert table["step_time_s"][fp8] < table["step_time_s"][mixed]
    # The linear layers keep f8 inputs for their gradients (less than mixed), and
    # FP8 copies of their weights and transposes, resident (more).
    fn = build_function(configs[fp8])[0]
    copies = sum(int(v.type.num_bytes) for v in fn.inputs if v.name.endswith((".fp8", ".fp8t")))
    assert copies > 0
    assert table["peak_memory_bytes"][fp8] - copies < table["peak_memory_bytes"][mixed]
    assert table["mfu"][fp8] > table["mfu"][mixed]  # the same model flops in less time


def test_out_of_memory_rows_are_simulated_and_explained():
    # mlp-medium's weights alone (64 x 16384^2 x 4 bytes, ~69 GB) overflow a 16 GB V100.
    space = StrategySpace(model="mlp-medium", world_sizes=(1,), hardware="v100-pcie-4", dtype="f32")
    table = evaluate(space, progress=False)
    assert table["status"].tolist() == ["out of memory"]
    assert "exceeds" in table["reason"][0] and table["peak_memory_gb"][0] > 16
    assert np.isfinite(table["step_time_s"][0])
    # The reason splits the peak into what is resident from the start and what the step allocates.
    found = re.search(r"([\d.]+) GB resident .* \+ ([\d.]+) GB the step allocates", table["reason"][0])
    resident, allocated = float(found[1]), float(found[2])
    assert resident + allocated == pytest.approx(table["peak_memory_gb"][0], abs=0.011)
    weights = 64 * 16384**2 * 4 / 1e9  # with the batch's data, resident: it alone does not fit
    assert weights < resident < weights + 1 and allocated > 0


def test_zero_over_replicas_that_do_not_divide_the_rows_pads_and_matches_the_reference():
    """ZeRO with 3 or 6 data-parallel replicas (the 64-wide layers' and the 16-position
    table's rows pad to multiples of them): valid rows, simulated by the fast engine,
    equal to the reference simulator run on the fine programs."""
    space = StrategySpace(
        model=TINY_GPT,
        world_sizes=(3, 6),
        global_batch_sizes=(12,),
        microbatches=(2,),
        zero=(True,),
        overlap_grad_comm=(False, True),
        optimizer="adam",
    )
    configs = list(enumerate_configs(space))
    table = evaluate(configs, progress=False)
    padded = [i for i, c in enumerate(configs) if c.data in (3, 6) and c.zero and c.valid]
    assert len(padded) >= 4 and all(table["status"][i] == "ok" for i in padded)
    assert all(table["engine"][i] == "fast" for i in padded)
    for i in padded:
        fn, topology = build_function(configs[i])
        ref = reference_simulate(fn, topology)
        assert table["step_time_s"][i] == pytest.approx(ref.step_time, rel=1e-9)
        assert table["peak_memory_bytes"][i] == max(ref.peak_memory.values())


def test_interrupted_and_resumed_sweep_equals_one_run(tmp_path, swept):
    configs, table = swept
    subset = configs[:60]
    once = tmp_path / "once.csv"
    evaluate(subset, results_path=once, progress=False)
    resumed = tmp_path / "resumed.csv"
    evaluate(subset[::3], results_path=resumed, progress=False)  # "interrupted" after a third
    assert len(ResultTable.read(resumed)) == len(subset[::3])
    evaluate(subset, results_path=resumed, progress=False)
    assert ResultTable.read(resumed) == ResultTable.read(once)
    _assert_same_numbers(ResultTable.read(once), table.take(np.arange(60)))  # fast engine vs exact


def _without_derived_columns(src, dst) -> None:
    """``src``'s results as a distir-jax without the derived columns wrote them."""
    import csv

    from search.results import DERIVED_COLUMNS

    with open(src, newline="") as f:
        lines = list(csv.reader(f))
    keep = [i for i, name in enumerate(lines[0]) if name not in DERIVED_COLUMNS]
    with open(dst, "w", newline="") as f:
        csv.writer(f).writerows([line[i] for i in keep] for line in lines)


def test_a_sweep_resumes_a_file_written_before_the_utilization_columns(tmp_path, swept):
    configs, _ = swept
    subset = configs[:24] + [c for c in configs if not c.valid][:6]  # simulated rows and invalid ones
    once = tmp_path / "once.csv"
    evaluate(subset, results_path=once, progress=False)
    old = tmp_path / "old.csv"
    evaluate(subset[::2], results_path=tmp_path / "half.csv", progress=False)
    _without_derived_columns(tmp_path / "half.csv", old)
    with pytest.raises(ValueError, match=r"missing \['model_tflops_per_gpu', 'mfu'\].*resume the sweep"):
        ResultTable.read(old)
    assert set(ResultTable.read_columns(old, ["config_id", "mfu"])) == {"config_id"}
    evaluate(subset, results_path=old, progress=False)  # fills them in, then sweeps the rest
    assert ResultTable.read(old) == ResultTable.read(once)
    # Rows of configurations the resumed sweep does not have: their MFU cannot be filled in.
    _without_derived_columns(tmp_path / "half.csv", old)
    with pytest.raises(ValueError, match=r"old\.csv: written by an older distir-jax, and its row \w+ is not"):
        evaluate(subset[1::2], results_path=old, progress=False)


def test_process_slices_partition_the_sweep(swept):
    configs, table = swept
    subset = configs[:40]
    parts = [evaluate(subset, progress=False, process_index=i, process_count=3) for i in range(3)]
    assert sorted(sum((p["config_id"].tolist() for p in parts), [])) == sorted(c.config_id for c in subset)
    merged = ResultTable.concat(parts)
    order = {cid: i for i, cid in enumerate(merged["config_id"].tolist())}
    assert merged.take([order[c.config_id] for c in subset]) == evaluate(subset, progress=False)
    _assert_same_numbers(evaluate(subset, progress=False), table.take(np.arange(40)))


def test_a_results_file_has_a_manifest_of_its_slice(swept, tmp_path):
    """Written before the first row; a file cut short lacks what the manifest lists."""
    from search.manifest import manifest_gap, manifest_path, manifest_sweep

    configs, _ = swept
    subset = configs[:20]
    path = tmp_path / "new" / "part1.csv"  # a folder not there yet
    table = evaluate(subset, results_path=path, progress=False, process_index=1, process_count=3)
    manifest = json.loads(pathlib.Path(manifest_path(path)).read_text())
    assert manifest_path(path) == str(tmp_path / "new" / "part1.manifest.json")
    # The sweep's id (every part's manifest names the same one: see search.manifest).
    assert manifest.pop("sweep") == manifest_sweep(path) and len(manifest_sweep(path)) == 16
    inputs = manifest.pop("inputs")  # the definitions behind the names (the next test)
    assert set(inputs["models"]) == {"mlp-xs"} and inputs["models"]["mlp-xs"]["hidden"] == 512
    assert list(inputs["hardware"]) == ["dgx-a100-80gb:1 (f32)", "dgx-a100-80gb:2 (f32)"]
    assert manifest == {
        "configurations": 20,
        "part": 1,
        "parts": 3,
        "config_ids": [c.config_id for c in subset[1::3]],
    }
    assert manifest_gap(path, table) == (True, "")
    checked, warning = manifest_gap(path, table.take(range(len(table) - 2)))
    assert checked and warning.startswith(f"{path} lacks 2 of the 7 configurations its sweep assigned it")
    assert manifest_gap(tmp_path / "elsewhere.csv", table) == (False, "")


def test_a_sweep_resumed_after_its_model_or_hardware_was_redefined_is_an_error(tmp_path, monkeypatch):
    """A config id names a model and a hardware, not their sizes: the manifest's
    recorded definitions tell a redefined one (a --models file or calibration
    edited between runs) from the one the rows were computed with."""
    from distir_jax.models import config
    from search.manifest import manifest_path

    monkeypatch.setattr(config, "_PRESETS", dict(config._PRESETS))  # forget it afterwards
    config._PRESETS["tiny-x"] = TINY_GPT
    space = dict(world_sizes=(2,), global_batch_sizes=(8,), microbatches=(2,), schedules=("1f1b",))
    tiny = list(enumerate_configs(StrategySpace(model="tiny-x", **space)))
    mlp = list(enumerate_configs(StrategySpace(model="mlp-xs", **space)))
    path = tmp_path / "sweep.csv"
    evaluate(tiny[:2], results_path=path, progress=False)
    first = ResultTable.read(path)
    config._PRESETS["tiny-x"] = dataclasses.replace(TINY_GPT, hidden=128, ffn_hidden=512)
    with pytest.raises(
        ValueError,
        match=r"sweep\.csv holds rows computed with other definitions than this "
        r"sweep's: model 'tiny-x' \(ffn_hidden 256 -> 512, hidden 64 -> 128\)\. Resuming",
    ):
        evaluate(tiny, results_path=path, progress=False)
    assert ResultTable.read(path) == first  # untouched
    fresh = evaluate(tiny, results_path=path, progress=False, resume=False)  # afresh: recorded anew
    assert evaluate(tiny, results_path=path, progress=False) == fresh
    # Rows of another model join the file; the first model's definition stays recorded.
    evaluate(mlp, results_path=path, progress=False)
    manifest = json.loads(pathlib.Path(manifest_path(path)).read_text())
    assert (
        manifest["inputs"]["models"]["tiny-x"]["hidden"] == 128 and "mlp-xs" in manifest["inputs"]["models"]
    )
    config._PRESETS["tiny-x"] = TINY_GPT
    with pytest.raises(ValueError, match=r"model 'tiny-x' \(ffn_hidden 512 -> 256, hidden 128 -> 64\)"):
        evaluate(mlp + tiny, results_path=path, progress=False)
    # Hardware: a digest of its figures (a recalibrated preset keeps its name).
    manifest["inputs"]["models"]["tiny-x"] = json.loads(json.dumps(dataclasses.asdict(TINY_GPT)))
    (hardware,) = manifest["inputs"]["hardware"]
    manifest["inputs"]["hardware"][hardware] = "0" * 16
    pathlib.Path(manifest_path(path)).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"hardware {re.escape(hardware)} \(other device or link figures"):
        evaluate(mlp, results_path=path, progress=False)
    # A manifest from before they were recorded: nothing to check against.
    del manifest["inputs"]
    pathlib.Path(manifest_path(path)).write_text(json.dumps(manifest))
    assert len(evaluate(mlp, results_path=path, progress=False)) == len(fresh) + len(mlp)


def test_a_process_resumed_from_its_own_file_finishes_its_own_slice(swept, tmp_path):
    """Hosts with a results file each: one interrupted and resumed evaluates the rest
    of its slice (not every other row of what its file lacks, which were other hosts')."""
    configs, _ = swept
    subset = configs[:30]
    paths = [tmp_path / f"part{i}.csv" for i in range(2)]
    evaluate(subset[0::2][:5], results_path=paths[0], progress=False)  # host 0, "interrupted"
    parts = [
        evaluate(subset, results_path=p, progress=False, process_index=i, process_count=2)
        for i, p in enumerate(paths)
    ]
    ids = [ResultTable.read(p)["config_id"].tolist() for p in paths]
    assert sorted(ids[0]) == sorted(c.config_id for c in subset[0::2])
    assert sorted(ids[1]) == sorted(c.config_id for c in subset[1::2])
    merged = ResultTable.concat(parts)
    order = {cid: i for i, cid in enumerate(merged["config_id"].tolist())}
    assert merged.take([order[c.config_id] for c in subset]) == evaluate(subset, progress=False)


def _assert_same_numbers(a: ResultTable, b: ResultTable) -> None:
    assert a["config_id"].tolist() == b["config_id"].tolist()
    assert a["status"].tolist() == b["status"].tolist()
    np.testing.assert_allclose(a["step_time_s"], b["step_time_s"], rtol=1e-5)
    np.testing.assert_allclose(a["peak_memory_bytes"], b["peak_memory_bytes"], rtol=1e-9)


SHARDING_SCRIPT = textwrap.dedent("""
    import jax
    from distir_jax.transforms import coarse_steady
    from search import StrategySpace, enumerate_configs, evaluate
    import importlib
    from search._fast import FastEngine
    evaluate_module = importlib.import_module("search.evaluate")
    assert len(jax.local_devices()) == 4, jax.local_devices()
    evaluate_module._HOST_CALL_SECONDS = 0  # every call runs the compiled kernel, sharded or not
    coarse_steady.MIN_LONG_OPS = 0  # short steady programs for the long pipelines here too
    space = StrategySpace(model="mlp-xs", world_sizes=(1, 2, 4), global_batch_sizes=(16, 64),
                          tensor=(1,), microbatches=(2, 4, 16))
    configs = [c for c in enumerate_configs(space) if c.valid]
    steady = [c for c in configs if FastEngine([c]).prepare([c])[0][1].steady is not None]
    assert len(steady) >= 4, len(steady)
    sharded = evaluate(space, progress=False, shard=True)
    unsharded = evaluate(space, progress=False, shard=False)
    assert len(sharded) > 10 and sharded == unsharded, "sharded and unsharded tables differ"
    print("SHARDED_OK", len(sharded))
""")


def test_sharded_and_unsharded_tables_are_identical():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", SHARDING_SCRIPT],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SHARDED_OK" in done.stdout


HOST_ONLY_SCRIPT = textwrap.dedent("""
    from jax._src import xla_bridge
    from search import StrategySpace, evaluate
    table = evaluate(StrategySpace(model="mlp-xs", world_sizes=(1, 2, 4), global_batch_sizes=(16, 64)),
                     progress=False)
    assert (table["status"] == "ok").sum() > 10, table["status"]
    assert not xla_bridge.backends_are_initialized(), "a sweep run on the host started a JAX backend"
    print("HOST_ONLY_OK", len(table))
""")


def test_a_sweep_that_runs_on_the_host_starts_no_jax_backend():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = [sys.executable, "-c", HOST_ONLY_SCRIPT]
    done = subprocess.run(script, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HOST_ONLY_OK" in done.stdout


def test_calls_run_on_the_host_give_the_compiled_kernels_table_bit_for_bit(monkeypatch):
    # A call whose kernel is still compiling may run on the host instead.
    from distir_jax.transforms import coarse_steady

    monkeypatch.setattr(coarse_steady, "MIN_LONG_OPS", 0)  # short steady programs here too
    space = StrategySpace(
        model="mlp-xs", world_sizes=(1, 2, 4), global_batch_sizes=(16, 64), microbatches=(2, 4, 16)
    )
    ran = []
    run = evaluate_module._run

    def spy(call, rows, periods, devices, num_items):
        ran.append((call is None, periods is not None))
        return run(call, rows, periods, devices, num_items)

    monkeypatch.setattr(evaluate_module, "_run", spy)
    monkeypatch.setattr(evaluate_module, "_HOST_CALL_SECONDS", 0)
    compiled = evaluate(space, progress=False)
    calls = len(ran)
    monkeypatch.setattr(evaluate_module, "_HOST_CALL_SECONDS", math.inf)
    never = lambda capacity, num_rows, devices: evaluate_module._Call(num_rows, Future())  # noqa: E731
    monkeypatch.setattr(evaluate_module, "_compiled_call", never)  # kernels that never finish compiling
    host = evaluate(space, progress=False)
    assert not any(on_host for on_host, _ in ran[:calls]) and all(on_host for on_host, _ in ran[calls:])
    assert any(steady for _, steady in ran)
    assert compiled == host


def test_row_windows_equal_the_whole_stack(swept):
    # A call stacks its rows' ops a window at a time: the windows, end to end,
    # are the whole stack (programs of several lengths, size variants, padding rows).
    configs, _ = swept
    subset = [c for c in configs if c.valid and c.model == "mlp-xs" and c.world_size <= 4][:40]
    items = []
    for group in evaluate_module._groups(subset):
        for _, prepared, variant, reason in evaluate_module._prepare_group(group, {}):
            if not reason:
                items.append((prepared, variant))
    assert len({id(p) for p, _ in items}) > 3 and len({p.capacity.num_ops for p, _ in items}) > 1
    capacity = functools.reduce(Capacity.union, (p.capacity for p, _ in items)).bucketed()
    program, _ = stack_rows(items, capacity, len(items) + 3)
    rows = RowStack(items, capacity, len(items) + 3)
    cut = capacity.num_ops // 3
    for lo, hi in ((0, cut), (cut, capacity.num_ops)):
        window = rows.program(lo, hi)
        for name in ("resource", "slot_device", "dep_slot", "out_slot", "link", "is_comm", "flops"):
            whole = np.asarray(getattr(program, name))[:, lo:hi]
            np.testing.assert_array_equal(getattr(window, name), whole, err_msg=name)
    # Against the lowering's own padding, row by row (padding rows repeat the first).
    for row, (prepared, variant) in enumerate(items + items[:1] * 3):
        padded = pad_program(prepared.program, capacity)
        for name in ("resource", "slot_device", "dep_slot", "out_slot", "link", "is_comm", "flops"):
            want = np.asarray(getattr(padded, name))
            want = want[variant] if name == "flops" and want.ndim == 2 else want
            np.testing.assert_array_equal(np.asarray(getattr(program, name))[row], want, err_msg=name)


def test_a_compiled_kernel_serves_rows_of_any_length_that_fit_its_other_sizes(monkeypatch):
    def cap(num_ops, num_devices):
        return Capacity(num_ops, 2, 1, 64, num_devices, 2 * num_devices)

    chunk = evaluate_module._OP_CHUNK
    devices = [jax.local_devices()[0]]
    target = evaluate_module._target(devices)
    monkeypatch.setattr(evaluate_module, "_COMPILED", {(target, cap(chunk, 8), 32): None})
    # A call runs its ops a slice at a time: any op count fits the compiled kernel.
    assert evaluate_module._compiled_cover(cap(4096, 4), devices) == cap(4096, 8)
    assert evaluate_module._compiled_cover(cap(300 * chunk, 8), devices) == cap(300 * chunk, 8)
    # Rows on 16 devices cannot run in the 8-device kernel.
    assert evaluate_module._compiled_cover(cap(4096, 16), devices) == cap(4096, 16)
    assert evaluate_module._compiled_row_counts(cap(4096, 8), devices) == [32]


def test_compiled_kernels_are_bounded_oldest_finished_first(monkeypatch):
    done, running = Future(), Future()
    done.set_result(None)
    compiled = {("old", i): done for i in range(3)} | {("running", 0): running}
    monkeypatch.setattr(evaluate_module, "_COMPILED", compiled)
    monkeypatch.setattr(evaluate_module, "_MAX_COMPILED", 3)
    monkeypatch.setattr(evaluate_module._COMPILER, "submit", lambda *args: running)
    capacity = Capacity(512, 2, 1, 64, 2, 4)
    evaluate_module._compiled_call(capacity, 32, [jax.local_devices()[0]])
    # Five entries, at most three kept: the two oldest finished go, the running compile stays.
    assert list(compiled)[:2] == [("old", 2), ("running", 0)] and len(compiled) == 3


def test_compiled_kernels_are_kept_apart_by_float_width():
    devices = [jax.local_devices()[0]]
    with jax.enable_x64(False):
        narrow = evaluate_module._target(devices)
    with jax.enable_x64(True):  # as tests/test_kernel.py switches it
        assert evaluate_module._target(devices) != narrow  # a float32 kernel is not reused under x64


@pytest.mark.parametrize("callers_x64", [False, True])
def test_a_sweep_compiles_its_kernel_in_its_own_precision(callers_x64, monkeypatch):
    # Kernels compile in a background thread, which a `with jax.enable_x64()` does not
    # reach; and the caller's setting is neither read nor changed.
    space = StrategySpace(model="mlp-xs", world_sizes=(2,), global_batch_sizes=(16,), microbatches=(2,))
    monkeypatch.setattr(evaluate_module, "_HOST_CALL_SECONDS", 0)  # compile, however small the sweep
    monkeypatch.setattr(evaluate_module, "_COMPILED", {})  # this test's kernels only
    with jax.enable_x64(callers_x64):
        narrow = evaluate(space, progress=False, precision="float32")
        wide = evaluate(space, progress=False)  # float64
        assert bool(jax.config.jax_enable_x64) == callers_x64
    assert narrow["config_id"].tolist() == wide["config_id"].tolist()
    assert narrow["step_time_s"] == pytest.approx(wide["step_time_s"], rel=1e-5)
    assert narrow["step_time_s"].tolist() != wide["step_time_s"].tolist()  # not the same floats
    compiled = evaluate_module._COMPILED
    dtypes = {(key[0][1], compiled[key].result().out_info.clock.dtype) for key in compiled}
    assert dtypes == {(False, np.dtype(np.float32)), (True, np.dtype(np.float64))}


def test_float64_on_tpus_is_refused_with_what_to_do_instead():
    tpu = type("FakeTpu", (), {"platform": "tpu"})()
    with jax.enable_x64(True), pytest.raises(ValueError, match=r"TPUs have none: pass precision='float32'"):
        evaluate_module._compiled_call(None, 8, [tpu])


def test_an_unknown_precision_is_one_error():
    with pytest.raises(ValueError, match=r"precision must be one of \('float64', 'float32'\), got 'half'"):
        evaluate(MLP_SPACE, progress=False, precision="half")


def test_a_float64_sweep_is_float64_from_its_inputs_on(swept, monkeypatch):
    """In float64 (the default) the stacked features, hardware and period weights are
    float64 too, on the host and in the compiled kernel: the sweep is the float64
    reference's to 1e-9 (stored in float32 and upcast, a 5 us launch overhead
    alone put step times 2.5e-8 off)."""
    configs, _ = swept
    valid = [c for c in configs if c.valid]
    picked = [valid[i] for i in np.random.default_rng(1).choice(len(valid), 12, replace=False)]
    reference = [reference_simulate(*build_function(c)).step_time for c in picked]
    for compiled in (False, True):
        if compiled:
            monkeypatch.setattr(evaluate_module, "_HOST_CALL_SECONDS", 0)  # compile, however small
        table = evaluate(picked, progress=False)
        simulated = table["status"] != "invalid"
        assert simulated.sum() >= 8
        np.testing.assert_allclose(
            table["step_time_s"][simulated], np.asarray(reference)[simulated], rtol=1e-9
        )
    assert any(key[0][1] for key in evaluate_module._COMPILED)  # a float64 kernel ran


def test_sweeps_keep_full_collections_off_older_objects_and_restore_the_callers_gc(monkeypatch):
    seen = []
    prepare = evaluate_module.FastEngine.prepare

    def spy(self, group, **kwargs):
        seen.append(gc.get_freeze_count())
        return prepare(self, group, **kwargs)

    monkeypatch.setattr(evaluate_module.FastEngine, "prepare", spy)
    configs = [c for c in enumerate_configs(MLP_SPACE) if c.valid][:4]
    assert gc.get_freeze_count() == 0
    evaluate(configs, progress=False)
    assert seen and min(seen) > 0  # the caller's objects were frozen during the sweep
    assert gc.get_freeze_count() == 0  # and are back in the oldest generation after it
    gc.freeze()  # a caller that froze objects itself keeps exactly its own freeze
    try:
        frozen = gc.get_freeze_count()
        evaluate(configs, progress=False)
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_h200_runs_h100_strategies_with_the_same_bytes_no_slower_and_fits_more():
    """DGX H200 is DGX H100 with 141 GB of faster memory: every row keeps its
    peak bytes, its step time does not grow, and what overflowed 80 GB fits."""
    space = StrategySpace(
        model="gpt3-xl",
        world_sizes=(8,),
        global_batch_sizes=(64,),
        tensor=(8,),
        microbatches=(1,),
        hardware=("dgx-h100", "dgx-h200"),
        dtype="bf16",
        recompute=("none",),
        zero=(False,),
        overlap_grad_comm=(False,),
    )
    table = evaluate(space, progress=False)
    h100, h200 = (table.take(np.flatnonzero(table["hardware"] == h)) for h in ("dgx-h100", "dgx-h200"))
    assert h100["config_id"].size == h200["config_id"].size == 1
    assert h100["peak_memory_bytes"][0] == h200["peak_memory_bytes"][0]
    assert 80e9 < h100["peak_memory_bytes"][0] < 141e9
    assert (h100["status"][0], h200["status"][0]) == ("out of memory", "ok")
    assert h200["step_time_s"][0] < h100["step_time_s"][0]


def test_a_dtype_the_model_does_not_take_gives_invalid_rows():
    """tf32 is a compute dtype of the presets, not a model dtype: each row says so
    (as an unknown dtype's do) instead of the sweep raising once it has started."""
    configs = list(enumerate_configs(StrategySpace(model="mlp-xs", world_sizes=(1, 2), dtype="tf32")))
    table = evaluate(configs, progress=False)  # rows, as the command line passes them
    assert len(table) > 0 and set(table["status"].tolist()) == {"invalid"}
    assert all("dtype must be one of" in reason for reason in table["reason"].tolist())


def test_a_fresh_sweep_replaces_an_earlier_file_only_with_its_rows(tmp_path, monkeypatch):
    path, manifest = tmp_path / "r.csv", tmp_path / "r.manifest.json"
    space = StrategySpace(model="mlp-xs", world_sizes=(2,), global_batch_sizes=(8, 16))
    evaluate(space.replace(global_batch_sizes=(8,)), results_path=path, progress=False)
    before = path.read_bytes(), manifest.read_bytes()

    def fail(self):
        raise ValueError("a transform failed")

    with monkeypatch.context() as m:
        m.setattr(evaluate_module._Batcher, "flush_all", fail)
        with pytest.raises(ValueError, match="a transform failed"):
            evaluate(space, results_path=path, resume=False, progress=False)
    assert (path.read_bytes(), manifest.read_bytes()) == before
    fresh = evaluate(space, results_path=path, resume=False, checkpoint_seconds=0, progress=False)
    assert ResultTable.read(path) == fresh == evaluate(space, progress=False)
    assert len(json.loads(manifest.read_text())["config_ids"]) == len(fresh)


@pytest.mark.parametrize(
    "index, count, message",
    [
        (0, 0, r"^process_count must be None or an int >= 1, got 0"),
        (0, -1, r"^process_count must be None or an int >= 1, got -1"),
        (0, "2", r"^process_count must be None or an int >= 1, got '2'"),
        (-1, 2, r"^process_index must be None or an int >= 0, got -1"),
        (2, 2, r"^process_index must be in \[0, 2\), got 2"),
    ],
)
def test_process_slice_errors_name_the_bad_argument(index, count, message):
    space = StrategySpace(model="mlp-xs", world_sizes=(1,))
    with pytest.raises(ValueError, match=message):
        evaluate(space, progress=False, process_index=index, process_count=count)


@pytest.mark.parametrize("function", ["simulate_config", "summarize_config", "coarse_chrome_trace"])
@pytest.mark.parametrize("bad", [{"model": "mlp-xs"}, StrategySpace(model="mlp-xs", world_sizes=(1,)), None])
def test_single_config_functions_say_they_need_a_config(function, bad):
    import search.single

    with pytest.raises(
        TypeError, match=r"^config must be a search.Config \(from make_config or enumerate_configs\)"
    ):
        getattr(search.single, function)(bad)


def test_calibrate_configs_says_it_needs_configs():
    from search import calibrate_configs, make_config

    space = StrategySpace(model="mlp-xs", world_sizes=(1,))
    with pytest.raises(TypeError, match=r"^configs must be a sequence of search.Config.*got a StrategySpace"):
        calibrate_configs(space, [1.0])
    with pytest.raises(TypeError, match=r"^configs must be a sequence of search.Config.*got Config"):
        calibrate_configs(make_config("mlp-xs"), [1.0])
    with pytest.raises(TypeError, match=r"^configs\[1\] must be a search.Config .*got dict"):
        calibrate_configs([make_config("mlp-xs"), {"model": "mlp-xs"}], [1.0, 1.0])
