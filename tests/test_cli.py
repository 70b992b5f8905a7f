"""The distir-jax command line: sweep, simulate, help and usage errors."""

import importlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from distir_jax.cli import main, simulate_command
from search import ResultTable

SMALL_SWEEP = [
    "sweep",
    "--model",
    "mlp-xs",
    "--world-sizes",
    "1,2",
    "--batch-sizes",
    "16,32",
    "--recompute",
    "none",
    "--dtype",
    "f32",
    "--optimizer",
    "sgd",
    "--zero",
    "no",
    "--overlap",
    "no",
    "--microbatches",
    "2,4",
    "--schedules",
    "1f1b",
    "--no-progress",
    "--top-k",
    "3",
]


def _one_line_error(capsys, code, argv):
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err and "Traceback" not in err, err
    return err


def test_sweep_writes_results_and_prints_the_best(tmp_path, capsys):
    pytest.importorskip("distir_jax.transforms.parallelize")
    out = tmp_path / "sweep.csv"
    assert main(SMALL_SWEEP + ["--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "top 3 by throughput" in text and "samples/s" in text and str(out) in text
    table = ResultTable.read(out)
    # 2 batches x (1 GPU + 2 GPUs as d2 or t2 + the 2-stage pipeline with 2 or 4 microbatches)
    assert len(table) == 2 * (1 + 2 + 2)
    assert set(table["model"].tolist()) == {"mlp-xs"}
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return
    assert ResultTable.read(tmp_path / "sweep.parquet") == table


def test_a_sweep_where_nothing_fits_shows_the_rows_closest_to_fitting(tmp_path, capsys):
    out = tmp_path / "sweep.csv"
    assert main(SMALL_SWEEP + ["--output", str(out), "--memory-limit", "1e-6"]) == 0
    text = capsys.readouterr().out
    assert "no configuration fits under 1e-06 GB per GPU; the 5 of least peak memory" in text
    assert "top 3 by throughput" not in text and "peak GB" in text
    closest = ResultTable.read(out).closest_to_fitting(5, memory_limit=1e3)
    shown = text.split("least peak memory per GPU:\n")[1].splitlines()[1:6]
    assert [line.split()[:4] for line in shown] == [
        [str(closest[c][i]) for c in ("data", "tensor", "pipeline", "microbatches")] for i in range(5)
    ]


def test_a_sweep_of_invalid_rows_only_says_why(tmp_path, capsys):
    out = tmp_path / "sweep.csv"
    argv = SMALL_SWEEP + ["--output", str(out), "--world-sizes", "2", "--pipeline", "2"]
    argv += ["--microbatches", "3"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2 configurations in" in text and "2 invalid" in text and "(engine" not in text
    assert "no configuration is valid; the most common reasons (rows, one of them):" in text
    assert "does not split into 3 microbatches" in text


def test_the_default_sweep_is_the_main_job(tmp_path, capsys):
    """`distir-jax sweep` with no options: the README's main job."""
    pytest.importorskip("distir_jax.transforms.parallelize")
    out = tmp_path / "sweep.csv"
    assert main(["sweep", "--no-progress", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gpt3-xl" in text and "top 10 by throughput" in text and "Pareto front" in text
    table = ResultTable.read(out)
    assert len(table) > 1000 and (table["status"] == "ok").sum() > 500
    ran = table["status"] != "invalid"
    assert set(table["engine"][ran].tolist()) == {"fast"}  # every default knob is modelled fast
    assert set(table["tensor"][table["status"] == "ok"].tolist()) >= {1, 2, 4, 8}


def test_exact_engine_gives_the_same_table(tmp_path, capsys):
    pytest.importorskip("distir_jax.transforms.parallelize")
    fast, exact = tmp_path / "fast.csv", tmp_path / "exact.csv"
    assert main(SMALL_SWEEP + ["--output", str(fast)]) == 0
    assert main(SMALL_SWEEP + ["--output", str(exact), "--engine", "exact"]) == 0
    a, b = ResultTable.read(fast), ResultTable.read(exact)
    assert a["config_id"].tolist() == b["config_id"].tolist()
    assert set(b["engine"][b["status"] != "invalid"].tolist()) == {"exact"}
    for name in ("step_time_s", "peak_memory_bytes"):
        assert a[name] == pytest.approx(b[name], rel=1e-5)


def test_sweep_resume_keeps_existing_rows(tmp_path, capsys):
    pytest.importorskip("distir_jax.transforms.parallelize")
    out = tmp_path / "r.csv"
    assert main(SMALL_SWEEP + ["--batch-sizes", "16", "--output", str(out)]) == 0
    first = ResultTable.read(out)
    capsys.readouterr()
    assert main(SMALL_SWEEP + ["--output", str(out), "--resume", "--memory-limit", "1000"]) == 0
    both = ResultTable.read(out)
    n = len(first)
    assert len(both) == 2 * n
    assert set(first["config_id"].tolist()) < set(both["config_id"].tolist())
    text = capsys.readouterr().out
    # The rate counts the rows this run simulated; the resumed ones are counted apart.
    assert "under 1000 GB" in text and f"{2 * n} configurations, {n} simulated in " in text
    assert f", {n} resumed from {out}:" in text
    # Rows of another space stay in the file (last), and the summary says how many.
    assert main(SMALL_SWEEP + ["--batch-sizes", "32", "--output", str(out), "--resume"]) == 0
    text = capsys.readouterr().out
    assert f"{2 * n} configurations, 0 simulated in " in text
    assert f", {n} resumed from {out}, {n} kept from it that are not in this sweep's space:" in text


# The command line in a process of its own (the console script may not be on PATH).
_RUN_CLI = "import sys; from distir_jax.cli import main; sys.exit(main(sys.argv[1:]))"


def _same_rows(table: ResultTable, like: ResultTable) -> bool:
    """Whether ``table`` holds ``like``'s rows, in any order."""
    at = {cid: i for i, cid in enumerate(table["config_id"].tolist())}
    return len(table) == len(like) and table.take([at[c] for c in like["config_id"].tolist()]) == like


def test_a_sweep_in_parts_merges_into_the_whole_sweep(tmp_path, capsys):
    whole, out = tmp_path / "whole.csv", tmp_path / "sweep.csv"
    assert main(SMALL_SWEEP + ["--output", str(whole)]) == 0
    for part in range(3):
        assert main(SMALL_SWEEP + ["--output", str(out), "--parts", "3", "--part", str(part)]) == 0
    text = capsys.readouterr().out
    assert "this run is part 2 of 3" in text and f"distir-jax merge {out}" in text
    parts = [tmp_path / f"sweep.part-{i}-of-3.csv" for i in range(3)]
    sizes = [len(ResultTable.read(p)) for p in parts]
    assert sum(sizes) == len(ResultTable.read(whole)) and min(sizes) > 0 and not out.exists()
    assert main(["merge", str(out), *map(str, parts[::-1]), "--top-k", "3"]) == 0
    # Every part, complete: the one-process sweep's file, row for row and byte for byte.
    assert out.read_bytes() == whole.read_bytes()
    captured = capsys.readouterr()
    assert "configurations from 3 files" in captured.out and "top 3 by throughput" in captured.out
    assert "incomplete" not in captured.out and captured.err == ""
    # A part not given, or cut short (an interrupted run's checkpoint): merged, and said.
    assert main(["merge", str(out), str(parts[0]), str(parts[2])]) == 0
    captured = capsys.readouterr()
    assert (
        "(incomplete: see the warnings)" in captured.out
        and len(ResultTable.read(out)) == sum(sizes) - sizes[1]
    )
    assert (
        captured.err.strip()
        == f"distir-jax merge: warning: 1 of 3 parts not given ({parts[1]}): their rows are missing"
    )
    cut = tmp_path / "cut" / parts[1].name
    cut.parent.mkdir()
    ResultTable.read(parts[1]).take(range(sizes[1] - 2)).write(cut)
    assert main(["merge", str(out), str(parts[0]), str(cut), str(parts[2])]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "warning" in err and str(cut) in err
    assert (
        f"has {sizes[1] - 2} row" in err
        and f"where a complete part 1 of 3 has at least {sizes[2]}:" in err
        and "--resume" in err
    )
    # Renamed parts (or a part missing) keep the files' order: the same rows.
    renamed = [tmp_path / f"p{i}.csv" for i in range(3)]
    for part, copy in zip(parts, renamed, strict=True):
        copy.write_bytes(part.read_bytes())
    assert main(["merge", str(out), *map(str, renamed)]) == 0
    merged = ResultTable.read(out)
    assert _same_rows(merged, ResultTable.read(whole)) and out.read_bytes() != whole.read_bytes()
    assert merged.take(range(sizes[0])) == ResultTable.read(parts[0])


def test_merge_finds_parts_all_cut_short_alike_by_their_manifests(tmp_path, capsys):
    """Every part stopped at once (a job's time limit): their lengths look like a
    complete sweep's, but each part's manifest lists the configurations it lacks."""
    folder = tmp_path / "results"  # not there yet: the sweep makes it (as in a fresh clone)
    out = folder / "sweep.csv"
    for part in range(3):
        assert main(SMALL_SWEEP + ["--output", str(out), "--parts", "3", "--part", str(part)]) == 0
    parts = [folder / f"sweep.part-{i}-of-3.csv" for i in range(3)]
    manifests = [folder / f"sweep.part-{i}-of-3.manifest.json" for i in range(3)]
    sizes = [len(ResultTable.read(p)) for p in parts]
    assert (
        all(m.exists() for m in manifests)
        and len(json.loads(manifests[1].read_text())["config_ids"]) == sizes[1]
    )
    capsys.readouterr()
    for part, n in zip(parts, sizes, strict=True):  # each one row short: still "complete" by length
        ResultTable.read(part).take(range(n - 1)).write(part)
    assert main(["merge", str(out), *map(str, parts)]) == 0
    captured = capsys.readouterr()
    warnings = captured.err.strip().splitlines()
    assert "(incomplete: see the warnings)" in captured.out and len(warnings) == 3
    for part, manifest, n, warning in zip(parts, manifests, sizes, warnings, strict=True):
        assert warning.startswith(f"distir-jax merge: warning: {part} lacks 1 of the {n} configurations")
        assert str(manifest) in warning and "--resume" in warning
    # Resumed, a part is whole again: no warning for it.
    assert main(SMALL_SWEEP + ["--output", str(out), "--parts", "3", "--part", "1", "--resume"]) == 0
    capsys.readouterr()
    assert main(["merge", str(out), *map(str, parts)]) == 0
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 2 and not any(str(parts[1]) in w for w in warnings)
    # The merged file replaces a one-process sweep's of that name: its manifest goes.
    assert main(SMALL_SWEEP + ["--output", str(out)]) == 0 and (folder / "sweep.manifest.json").exists()
    assert main(["merge", str(out), *map(str, parts)]) == 0
    assert not (folder / "sweep.manifest.json").exists()
    capsys.readouterr()
    # A manifest that cannot be read is named, and its part checked by its length instead
    # (two rows short now: fewer than a complete part 0 can have, whatever the others hold).
    manifests[0].write_text("{not json")
    ResultTable.read(parts[0]).take(range(sizes[0] - 2)).write(parts[0])
    assert main(["merge", str(out), *map(str, parts)]) == 0
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 3
    assert f"{manifests[0]} is not a sweep manifest (JSONDecodeError" in warnings[0]
    assert f"{parts[2]} lacks 1 of the {sizes[2]} configurations" in warnings[1]
    assert f"{parts[0]} has {sizes[0] - 2} rows where a complete part 0 of 3 has at least" in warnings[2]


def test_merge_puts_a_sweeps_parts_in_enumeration_order_only_when_all_are_there():
    from distir_jax.cli import _sweep_order

    parts = [f"r/s.part-{i}-of-3.csv" for i in range(3)]
    # 8 rows: part 0 holds rows 0, 3, 6; part 1: 1, 4, 7; part 2: 2, 5.
    order = _sweep_order(parts, [3, 3, 2])
    assert np.concatenate([[0, 3, 6], [1, 4, 7], [2, 5]])[order].tolist() == list(range(8))
    order = _sweep_order(parts[::-1], [2, 3, 3])  # given in another order
    assert np.concatenate([[2, 5], [1, 4, 7], [0, 3, 6]])[order].tolist() == list(range(8))
    assert _sweep_order(parts[:2], [3, 3]) is None  # a part missing
    assert _sweep_order(parts, [2, 3, 3]) is None  # part 0 unfinished (or not of one sweep)
    assert _sweep_order([parts[0], parts[0], parts[2]], [3, 3, 2]) is None  # a part twice
    assert _sweep_order(parts[:2] + ["r/s.part-2-of-4.csv"], [3, 3, 2]) is None
    assert _sweep_order(["a.csv", "b.csv"], [1, 1]) is None


def test_merge_keeps_a_repeated_row_once_and_refuses_two_different_ones(tmp_path, capsys):
    a, b, out = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "out.csv"
    assert main(SMALL_SWEEP + ["--output", str(a)]) == 0
    assert main(["merge", str(out), str(a), str(a)]) == 0
    assert _same_rows(ResultTable.read(out), ResultTable.read(a))
    table = ResultTable.read(a)
    columns = {name: table[name].copy() for name in table.columns}
    changed = int(np.flatnonzero(table["status"] == "ok")[0])
    columns["step_time_s"][changed] *= 2
    ResultTable(columns).write(b)
    capsys.readouterr()
    err = _one_line_error(capsys, 2, ["merge", str(out), str(a), str(b)])
    assert table["config_id"][changed] in err and "different results" in err


def test_a_distributed_sweep_on_two_processes_merges_into_the_whole_sweep(tmp_path, capsys):
    """Two processes of one jax.distributed job (found as a SLURM job on this host)
    sweep a part each; merged, they are the sweep run in one process."""
    whole = tmp_path / "whole.csv"
    assert main(SMALL_SWEEP + ["--output", str(whole)]) == 0
    job = str(int.from_bytes(os.urandom(2), "little"))  # the coordinator's port follows the job id
    argv = [
        sys.executable,
        "-c",
        _RUN_CLI,
        *SMALL_SWEEP,
        "--output",
        str(tmp_path / "sweep.csv"),
        "--distributed",
    ]
    slurm = dict(
        SLURM_JOB_ID=job, SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_STEP_NUM_NODES="1"
    )
    processes = [
        subprocess.Popen(
            argv,
            env={
                **os.environ,
                **slurm,
                "SLURM_PROCID": str(i),
                "SLURM_LOCALID": str(i),
                "DISTIR_JAX_CACHE": "off",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert "this run is part 0 of 2" in outputs[0] and "this run is part 1 of 2" in outputs[1]
    parts = [str(tmp_path / f"sweep.part-{i}-of-2.csv") for i in range(2)]
    assert main(["merge", str(tmp_path / "merged.csv"), *parts]) == 0
    assert (tmp_path / "merged.csv").read_bytes() == whole.read_bytes()


def test_distributed_without_a_cluster_says_what_to_do_instead():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_COORD", "KUBE"))}
    done = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, *SMALL_SWEEP, "--distributed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "jax.distributed.initialize() failed" in done.stderr and "--parts N --part I" in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--world-sizes", "two"],
        ["sweep", "--batch-sizes", "0"],
        ["sweep", "--model", "gpt-9"],
        ["sweep", "--schedules", "zigzag"],
        ["sweep", "--zero", "maybe"],
        ["sweep", "--output", "results.txt"],
        ["sweep", "--engine", "approximate"],
        ["sweep", "--hardware", "dgx-a100-80gb,tpu-v9"],
        ["sweep", "--world-sizes", "8", "--tensor", "3"],  # no factorisation: nothing to sweep
        ["simulate", "--hardware", "tpu-v9"],
        ["sweep", "--no-such-option"],
        ["simulate", "--data", "0"],
        ["simulate", "--data", "2", "--world-size", "3"],
        ["simulate", "--recompute", "most"],
        ["sweep", "--parts", "2", "--part", "2"],
        ["sweep", "--part", "-1"],
        ["sweep", "--distributed", "--parts", "2"],
        ["merge", "out.csv"],
        ["merge", "out.txt", "part.csv"],
        ["merge", "out.csv", "no-such-part.csv"],
        ["frobnicate"],
        [],
    ],
)
def test_bad_options_give_one_line_and_exit_2(argv, capsys):
    _one_line_error(capsys, 2, argv)


def test_help_lists_every_option(capsys):
    assert main(["sweep", "--help"]) == 0
    text = capsys.readouterr().out
    for option in (
        "--model",
        "--world-sizes",
        "--batch-sizes",
        "--seq-len",
        "--data",
        "--tensor",
        "--pipeline",
        "--microbatches",
        "--microbatch-sizes",
        "--schedules",
        "--virtual-stages",
        "--recompute",
        "--zero",
        "--sequence-parallel",
        "--overlap",
        "--dtype",
        "--hardware",
        "--optimizer",
        "--output",
        "--resume",
        "--top-k",
        "--memory-limit",
        "--chunk-size",
        "--chunk-memory",
        "--engine",
        "--parts",
        "--part",
        "--distributed",
    ):
        assert option in text, option
    assert main(["merge", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--top-k" in text and "--memory-limit" in text
    assert main(["simulate", "--help"]) == 0
    text = capsys.readouterr().out
    for option in (
        "--model",
        "--batch-size",
        "--data",
        "--tensor",
        "--pipeline",
        "--microbatches",
        "--schedule",
        "--recompute",
        "--zero",
        "--trace",
        "--full",
        "--hardware",
        "--dtype",
    ):
        assert option in text, option
    assert main(["--help"]) == 0 and "sweep" in capsys.readouterr().out


def test_simulate_prints_the_numbers_and_writes_a_trace(tmp_path, capsys):
    pytest.importorskip("distir_jax.transforms.pipeline")
    trace = tmp_path / "trace.json"
    argv = [
        "simulate",
        "--model",
        "mlp-xs",
        "--data",
        "2",
        "--pipeline",
        "2",
        "--microbatches",
        "2",
        "--batch-size",
        "16",
        "--dtype",
        "f32",
        "--optimizer",
        "sgd",
        "--engine",
        "exact",
        "--trace",
        str(trace),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for field in ("status: ok", "step time:", "throughput:", "peak memory per device (", "device    0:"):
        assert field in text, text
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all(e["dur"] >= 0 and e["pid"] in (0, 1) for e in complete)
    # Every op appears once per device it runs on: sends touch two devices.
    sends = [e for e in complete if e["name"] == "Send"]
    assert sends and len({e["pid"] for e in sends}) == 2


def test_simulate_runs_the_fast_engine_with_the_fine_programs_numbers(capsys):
    pytest.importorskip("distir_jax.transforms.pipeline")
    argv = ["simulate", "--model", "mlp-xs", "--data", "2", "--pipeline", "2", "--microbatches", "4"]
    argv += ["--batch-size", "32", "--dtype", "f32", "--zero", "--overlap-grad-comm"]
    outputs = {}
    for engine in ("", "exact"):
        assert main(argv + (["--engine", engine] if engine else [])) == 0
        outputs[engine or "default"] = capsys.readouterr().out.splitlines()
    default, exact = outputs["default"], outputs["exact"]
    assert any(line.startswith("engine: fast") for line in default), default
    assert "engine: exact (the fine program)" in exact
    # Everything else it prints (step time, throughput, breakdown, each device's peak) is the same.
    numbers = {name: [x for x in lines if not x.startswith("engine:")] for name, lines in outputs.items()}
    assert numbers["default"] == numbers["exact"]
    assert sum(line.startswith("  device ") for line in default) == 2


def test_simulate_traces_the_coarse_program_with_the_fast_engine(tmp_path, capsys):
    pytest.importorskip("distir_jax.transforms.pipeline")
    trace = tmp_path / "trace.json"
    argv = ["simulate", "--model", "mlp-xs", "--data", "2", "--pipeline", "2", "--microbatches", "4"]
    assert main(argv + ["--batch-size", "32", "--dtype", "f32", "--trace", str(trace)]) == 0
    text = capsys.readouterr().out
    assert "engine: fast" in text and "an event per pipeline step" in text
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    assert {"forward", "backward", "send activation", "send gradient", "update"} <= names
    assert {e["pid"] for e in events} == {0, 1}  # a representative per stage
    step = float(re.search(r"step time: (\S+) s", text).group(1))
    assert max(e["ts"] + e["dur"] for e in events) / 1e6 == pytest.approx(step, rel=1e-5)


def test_simulate_full_needs_the_exact_engine(capsys):
    argv = ["simulate", "--model", "mlp-xs", "--pipeline", "2", "--microbatches", "2", "--batch-size", "8"]
    assert main(argv + ["--engine", "fast", "--full"]) == 2
    err = capsys.readouterr().err
    assert "--full simulates every replica of the fine program" in err and len(err.strip().splitlines()) == 1


def test_sweep_prints_the_command_that_simulates_its_best_row(tmp_path, capsys):
    pytest.importorskip("distir_jax.transforms.pipeline")
    out = tmp_path / "sweep.csv"
    assert main(SMALL_SWEEP + ["--output", str(out), "--zero", "both"]) == 0
    text = capsys.readouterr().out
    command = text.split("the best one up close")[1].splitlines()[1].split()
    assert command[:2] == ["distir-jax", "simulate"] and command[-2:] == ["--trace", "best.json"]
    trace = tmp_path / "best.json"
    assert main(command[1:-1] + [str(trace)]) == 0
    printed = capsys.readouterr().out
    best = ResultTable.read(out).top_k(1).row(0)
    assert f"step time: {best['step_time_s']:.6g} s" in printed
    assert "--sensitivity" in command and "\nsensitivity: the step time's change" in printed
    knobs = f"data {best['data']} x tensor {best['tensor']} x pipeline {best['pipeline']}"
    assert f"global batch {best['global_batch_size']}: {knobs}" in printed
    assert trace.exists()
    # Every knob at its default is left out; a model that is not a preset has no command.
    assert simulate_command(dict(best, model="MLPConfig(num_layers=2)")) is None
    # A training precision is named where it is not its dtype's default.
    assert "--training-precision" not in simulate_command(
        dict(best, dtype="bf16", training_precision="mixed")
    )
    assert "--training-precision half" in simulate_command(
        dict(best, dtype="bf16", training_precision="half")
    )
    assert "--tensor" not in command and "--model" in command  # tensor 1 (the default), mlp-xs (not)


def test_simulate_invalid_configuration_says_why(capsys):
    assert main(["simulate", "--model", "mlp-xs", "--data", "4", "--batch-size", "2"]) == 1
    assert "invalid" in capsys.readouterr().out


def test_sweep_says_up_front_which_rows_need_the_exact_engine():
    pytest.importorskip("distir_jax.transforms.parallelize")
    from distir_jax.cli import _exact_rows_notice
    from search import StrategySpace, enumerate_configs

    space = StrategySpace(
        model="mlp-xs", world_sizes=(2,), global_batch_sizes=(8,), sequence_parallel=(False, True)
    )
    configs = list(enumerate_configs(space))
    exact = [c.valid and c.sequence_parallel for c in configs]
    assert sum(exact) > 0
    notice = _exact_rows_notice(configs)
    assert notice == (
        f"  {sum(exact)} of them on the exact engine (seconds or more per structure: every program is "
        "built with the transforms): the fast engine models sequence parallelism in GPTs only\n"
    )
    assert _exact_rows_notice([c for c, e in zip(configs, exact, strict=True) if not e]) == ""


# --- Defects found by fuzzing the command line --------------------------------


@pytest.mark.parametrize(
    "argv, named",
    [
        (["sweep", "--output", "{tmp}/a.csv/x.csv"], "a.csv' is a file"),
        (["sweep", "--output", "{tmp}/folder.csv"], "directory"),
        (["sweep", "--output", "{tmp}/folder.csv", "--resume"], "directory"),
        (["simulate", "--model", "mlp-xs", "--trace", "{tmp}/folder.csv"], "directory"),
        (["simulate", "--model", "mlp-xs", "--trace", "{tmp}/a.csv/t.json"], "a.csv' is a file"),
        (["merge", "{tmp}/folder.csv", "{tmp}/a.csv"], "directory"),
    ],
)
def test_an_output_that_cannot_be_written_is_a_one_line_error(argv, named, tmp_path, capsys):
    (tmp_path / "a.csv").write_text("x\n")
    (tmp_path / "folder.csv").mkdir()
    if argv[0] == "merge":  # a real results file to merge
        assert main(SMALL_SWEEP + ["--output", str(tmp_path / "a.csv")]) == 0
        capsys.readouterr()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] == "sweep":
        argv += ["--model", "mlp-xs", "--world-sizes", "2"]
    assert named in _one_line_error(capsys, 2, argv)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_under_proc_is_a_one_line_error(capsys):
    err = _one_line_error(capsys, 2, ["sweep", "--model", "mlp-xs", "--output", "/proc/o.csv"])
    assert "'/proc/o.csv' cannot be written" in err
    err = _one_line_error(capsys, 2, ["simulate", "--model", "mlp-xs", "--trace", "/proc/x.json"])
    assert "'/proc/x.json' cannot be written" in err


def test_a_file_error_while_running_is_a_one_line_error_with_status_1(tmp_path, capsys, monkeypatch):
    evaluate_module = importlib.import_module("search.evaluate")  # `search.evaluate` is the function

    def disk_full(table, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(evaluate_module, "_write_atomic", disk_full)
    out = tmp_path / "sweep.csv"
    err = _one_line_error(capsys, 1, SMALL_SWEEP + ["--output", str(out)])
    assert err == f"distir-jax sweep: error: {out}: No space left on device"


BIG = "99999999999999999999"


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--chunk-memory", "inf"],
        ["sweep", "--memory-limit", "inf"],
        ["sweep", "--batch-sizes", BIG],
        ["sweep", "--microbatches", BIG],
        ["sweep", "--seq-len", BIG],
        ["sweep", "--part", BIG],
        ["simulate", "--batch-size", BIG],
    ],
)
def test_numbers_too_large_for_the_simulator_are_usage_errors(argv, tmp_path, capsys):
    if argv[0] == "sweep":
        argv = argv + ["--model", "mlp-xs", "--world-sizes", "2", "--output", str(tmp_path / "x.csv")]
    err = _one_line_error(capsys, 2, argv)
    assert f"argument {argv[1]}:" in err and repr(argv[2]) in err


def test_a_failed_sweep_leaves_the_existing_results_file_alone(tmp_path, capsys, monkeypatch):
    out = tmp_path / "e.csv"
    manifest = tmp_path / "e.manifest.json"
    assert main(SMALL_SWEEP + ["--output", str(out)]) == 0
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    assert out in before and manifest in before
    # Refused up front (a dtype no row can run with) ...
    _one_line_error(capsys, 2, SMALL_SWEEP + ["--output", str(out), "--dtype", "tf32"])
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    # ... or failing once the sweep runs: a fresh sweep replaces the file only with its own rows.
    evaluate_module = importlib.import_module("search.evaluate")  # `search.evaluate` is the function

    def fail(self):
        raise ValueError("a transform failed")

    with monkeypatch.context() as m:
        m.setattr(evaluate_module._Batcher, "flush_all", fail)
        err = _one_line_error(capsys, 2, SMALL_SWEEP + ["--output", str(out), "--batch-sizes", "8"])
    assert "a transform failed" in err
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert main(SMALL_SWEEP + ["--output", str(out), "--batch-sizes", "8"]) == 0
    assert set(ResultTable.read(out)["global_batch_size"].tolist()) == {8}
    assert manifest.read_bytes() != before[manifest]


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--dtype", "f64"],
        ["sweep", "--dtype", "bf16,tf32"],
        ["simulate", "--dtype", "f64"],
        ["simulate", "--dtype", "tf32"],
    ],
)
def test_dtype_takes_exactly_what_its_help_lists(argv, capsys):
    from search.space import HARDWARE_DTYPE

    err = _one_line_error(capsys, 2, argv)
    assert "argument --dtype:" in err and ", ".join(HARDWARE_DTYPE) in err
    assert main([argv[0], "--help"]) == 0
    assert f"dtype: {', '.join(HARDWARE_DTYPE)}" in capsys.readouterr().out.replace("dtype(s)", "dtype")


def test_merge_never_overwrites_one_of_its_inputs(tmp_path, capsys, monkeypatch):
    out = tmp_path / "p.csv"
    for part in range(2):
        assert main(SMALL_SWEEP + ["--output", str(out), "--parts", "2", "--part", str(part)]) == 0
    parts = [tmp_path / f"p.part-{i}-of-2.csv" for i in range(2)]
    before = parts[0].read_bytes()
    capsys.readouterr()
    err = _one_line_error(capsys, 2, ["merge", str(parts[0]), str(parts[0]), str(parts[1])])
    assert "would overwrite its input" in err and str(parts[0]) in err
    monkeypatch.chdir(tmp_path)  # the same file by another name
    _one_line_error(capsys, 2, ["merge", f"./{parts[1].name}", str(parts[0]), str(parts[1])])
    assert parts[0].read_bytes() == before


@pytest.mark.parametrize(
    "argv, says",
    [
        (["sweep", "--microbatches", "2", "--microbatch-sizes", "4"], "give one of them"),
        (["simulate", "--model", "mlp-xs", "--sequence-parallel"], "--tensor > 1"),
        (["simulate", "--model", "mlp-xs", "--zero"], "--zero acts on the gradients of data-parallel"),
        (["simulate", "--model", "mlp-xs", "--overlap-grad-comm", "--tensor", "2"], "give --data > 1"),
        (["sweep", "--world-sizes", "4", "--tensor", "1", "--sequence-parallel", "yes"], "tensor degree > 1"),
        (["sweep", "--world-sizes", "1", "--sequence-parallel", "both"], "tensor degree > 1"),
        (
            ["simulate", "--dtype", "f32", "--training-precision", "half"],
            "f32 models train in full precision",
        ),
        (["sweep", "--dtype", "f32", "--training-precision", "half"], "--dtype f32 has neither"),
    ],
)
def test_contradictory_options_are_usage_errors(argv, says, tmp_path, capsys):
    if argv[0] == "sweep":
        argv = argv + ["--model", "mlp-xs", "--output", str(tmp_path / "x.csv")]
    err = _one_line_error(capsys, 2, argv)
    assert says in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["sweep", "--top-k", "0"], "argument --top-k: expected one integer from 1"),
        (["sweep", "--chunk-size", "0"], "argument --chunk-size: expected one integer from 1"),
        (["sweep", "--parts", "0"], "argument --parts: expected one integer from 1"),
        (["sweep", "--seq-len", "0"], "argument --seq-len: expected one integer from 1"),
        (["simulate", "--batch-size", "0"], "argument --batch-size: expected one integer from 1"),
        (["simulate", "--data", "0"], "argument --data: expected one integer from 1"),
        (["simulate", "--schedule", "foo"], "argument --schedule: expected one of gpipe, 1f1b, interleaved"),
        (["simulate", "--hardware", "foo"], "argument --hardware: expected one of dgx-a100-80gb,"),
        (["simulate", "--recompute", "most"], "argument --recompute: expected one of none, attention"),
        (
            ["simulate", "--training-precision", "full"],
            "--training-precision: expected one of mixed, mixed-half",
        ),
        (["sweep", "--training-precision", "mixed,amp"], "--training-precision: expected some of mixed,"),
    ],
)
def test_errors_name_the_option_and_what_it_takes(argv, says, capsys):
    assert says in _one_line_error(capsys, 2, argv)


def test_printed_tables_show_the_knobs_that_vary(tmp_path, capsys):
    pytest.importorskip("distir_jax.transforms.parallelize")
    out = tmp_path / "s.csv"
    argv = SMALL_SWEEP + ["--output", str(out), "--world-sizes", "2,2", "--top-k", "4"]
    assert main(argv + ["--dtype", "bf16,f16", "--hardware", "dgx-a100-80gb,dgx-a100-80gb"]) == 0
    text = capsys.readouterr().out
    assert "configurations of mlp-xs on dgx-a100-80gb:2 ..." in text  # each preset once
    top = text.split("top 4 by throughput:\n")[1].splitlines()
    assert top[0].split()[:2] == ["dtype", "d"] and {line.split()[0] for line in top[1:5]} == {"bf16", "f16"}
    # One value of each: the columns of a plain sweep.
    assert main(argv) == 0
    top = capsys.readouterr().out.split("top 4 by throughput:\n")[1].splitlines()
    assert top[0].split()[:4] == ["d", "t", "p", "mb"]


def test_simulate_says_which_switches_are_on(capsys):
    pytest.importorskip("distir_jax.transforms.parallelize")
    argv = ["simulate", "--model", "mlp-xs", "--data", "2", "--tensor", "2", "--batch-size", "32"]
    assert main(argv + ["--zero", "--overlap-grad-comm", "--sequence-parallel", "--dtype", "f32"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(
        "recompute none, ZeRO-1, gradient overlap, sequence parallel, f32 (full precision), adam"
    )
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("recompute none, bf16 (mixed precision), adam")
    assert main(argv + ["--training-precision", "half"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("recompute none, bf16 (half precision), adam")


def test_calibrate_then_sweep_and_simulate_on_the_calibrated_preset(tmp_path, capsys, monkeypatch):
    """The workflow: a sweep's rows with their measured step times -> `calibrate` ->
    a calibration file that `sweep --presets` and `simulate --presets` load."""
    from lab_measurements import lab_rows, write_measurements

    import distir_jax as dj
    from distir_jax import presets

    for registry in ("PRESETS", "_NODES"):  # this test's presets go with it
        monkeypatch.setattr(presets, registry, dict(getattr(presets, registry)))
    truth = dict(
        peak_flops=0.5, memory_bandwidth=0.75, link_bandwidth=0.4, link_latency=2.0, launch_overhead=1.5
    )
    dj.register_calibrated_preset("a100-lab-truth", "dgx-a100-80gb", truth)
    rows = lab_rows(tmp_path / "lab.csv", "a100-lab-truth")
    # "Run" on the lab's cluster, nominally DGX A100s.
    write_measurements(tmp_path / "measured.csv", rows[:: len(rows) // 8][:8], hardware="dgx-a100-80gb")

    calibration = tmp_path / "lab.calibration.json"
    argv = ["calibrate", str(tmp_path / "measured.csv"), "--name", "a100-lab", "--output", str(calibration)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for field, factor in truth.items():
        assert re.search(rf"^  {field} +{factor:.4g}(  \(weakly determined: .*\))?$", out, re.M), out
    # Eight MLP steps barely depend on latency and launches (exact "measurements" still pin them).
    assert re.search(r"^  link_latency +2  \(weakly determined: a 1% error", out, re.M), out
    assert f"distir-jax sweep --presets {calibration} --hardware a100-lab" in out
    assert json.loads(calibration.read_text())["scales"] == pytest.approx(truth, rel=1e-6)

    # Another process would start without the preset: only the file brings it back.
    for registry in ("PRESETS", "_NODES"):
        table = {k: v for k, v in getattr(presets, registry).items() if k != "a100-lab"}
        monkeypatch.setattr(presets, registry, table)
    sweep = ["sweep", "--model", "mlp-small", "--world-sizes", "4", "--batch-sizes", "64", "--no-progress"]
    sweep += ["--hardware", "a100-lab", "--output", str(tmp_path / "calibrated.csv")]
    # The lab sweep's other knobs, so its rows hold the truth for every row of this one.
    sweep += ["--dtype", rows[0]["dtype"], "--optimizer", rows[0]["optimizer"], "--microbatches", "2"]
    sweep += ["--schedules", "1f1b", "--zero", "no", "--overlap", "no", "--recompute", "none"]
    assert _one_line_error(capsys, 2, sweep)  # without --presets the name is unknown
    assert main(sweep + ["--presets", str(calibration)]) == 0
    command = capsys.readouterr().out.split("up close")[1].splitlines()[1].split()
    assert command[:4] == ["distir-jax", "simulate", "--presets", str(calibration)]
    calibrated = ResultTable.read(tmp_path / "calibrated.csv")
    best = calibrated.top_k(1)
    # The printed command simulates the best row on the calibrated preset, with its step time.
    assert main(command[1:-2]) == 0
    assert f"step time: {best['step_time_s'][0]:.6g}" in capsys.readouterr().out.replace(" s,", ",")
    # Which is the truth's step time for that strategy, where the fit is exact.
    true_rows = ResultTable.read(tmp_path / "lab.csv")
    same = [i for i in range(len(true_rows)) if _same_strategy(true_rows.row(i), best.row(0))]
    assert same and true_rows["step_time_s"][same[0]] == pytest.approx(best["step_time_s"][0], rel=1e-9)


def test_calibrate_fits_the_network_apart_and_says_when_to(tmp_path, capsys, monkeypatch):
    """Strategies on one node and across two, "run" on a lab whose InfiniBand reaches
    another share of its figures than NVSwitch: one factor for all links misses
    them, and `calibrate` says which --fields fit the network apart; those land on
    the lab's figures."""
    from lab_measurements import lab_rows, write_measurements

    import distir_jax as dj
    from distir_jax import presets

    for registry in ("PRESETS", "_NODES"):  # this test's presets go with it
        monkeypatch.setattr(presets, registry, dict(getattr(presets, registry)))
    truth = dict(
        peak_flops=0.5, memory_bandwidth=0.75, link_bandwidth=0.4, link_latency=2.0, launch_overhead=1.5
    )
    truth |= dict(network_bandwidth=0.15, network_latency=4.0)
    dj.register_calibrated_preset("a100-two-fabrics", "dgx-a100-80gb", truth)
    rows = lab_rows(tmp_path / "lab.csv", "a100-two-fabrics", world_sizes=(4, 8, 16))
    picked = rows[:: len(rows) // 12][:12]
    assert {row["world_size"] for row in picked} == {"4", "8", "16"}
    measured = write_measurements(tmp_path / "measured.csv", picked, hardware="dgx-a100-80gb")

    argv = ["calibrate", str(measured), "--name", "one-factor", "--output", str(tmp_path / "one.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    worst = re.search(r"still miss a measurement by ([0-9.]+)%", out)
    assert worst and float(worst.group(1)) > 20, out
    fields = re.search(r"--fields (\S+) fits it apart", out)
    assert fields and fields.group(1).split(",") == list(dj.CALIBRATABLE_FIELDS), out

    argv = ["calibrate", str(measured), "--name", "two-fabrics", "--output", str(tmp_path / "two.json")]
    assert main(argv + ["--fields", fields.group(1)]) == 0
    out = capsys.readouterr().out
    assert "still miss" not in out and "fits it apart" not in out
    assert json.loads((tmp_path / "two.json").read_text())["scales"] == pytest.approx(truth, rel=1e-6)


def _same_strategy(a: dict, b: dict) -> bool:
    from search import Config

    return all(a[k] == b[k] for k in Config.KNOBS if k != "hardware")


def test_calibrate_errors_are_one_line(tmp_path, capsys):
    missing = str(tmp_path / "none.csv")
    assert "No such file" in _one_line_error(capsys, 2, ["calibrate", missing, "--name", "x"])
    assert "--name" in _one_line_error(capsys, 2, ["calibrate", missing, "--name", "a:b"])
    fields = _one_line_error(capsys, 2, ["calibrate", missing, "--name", "x", "--fields", "flops"])
    assert "expected some of peak_flops" in fields
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert "calibration file" in _one_line_error(capsys, 2, ["sweep", "--presets", str(bad)])
    # A name the printed commands could not repeat unquoted, and an empty output path.
    assert "--name must be letters" in _one_line_error(capsys, 2, ["calibrate", missing, "--name", "a b"])
    assert "--output must be a file path" in _one_line_error(
        capsys, 2, ["calibrate", missing, "--name", "x", "--output", ""]
    )
    # calibrate loads --presets too (measured rows may name a calibrated preset).
    argv = ["calibrate", missing, "--name", "x", "--presets", str(bad)]
    assert "calibration file" in _one_line_error(capsys, 2, argv)
    assert main(["--help"]) == 0
    assert "{sweep,simulate,merge,calibrate,models}" in capsys.readouterr().out


def test_merge_warns_when_the_parts_come_from_different_sweeps(tmp_path, capsys):
    # Part 0 of one sweep and part 1 of another, named as one sweep's parts: each is
    # complete by its own manifest, and only the manifests' sweep ids tell the mix.
    out, other = tmp_path / "sweep.csv", tmp_path / "other" / "sweep.csv"
    assert main(SMALL_SWEEP + ["--output", str(out), "--parts", "2", "--part", "0"]) == 0
    changed = [x if x != "16,32" else "16,64" for x in SMALL_SWEEP]  # other batch sizes
    assert main(changed + ["--output", str(other), "--parts", "2", "--part", "1"]) == 0
    for suffix in (".csv", ".manifest.json"):
        source = other.parent / f"sweep.part-1-of-2{suffix}"
        (tmp_path / source.name).write_bytes(source.read_bytes())
    capsys.readouterr()
    parts = [str(tmp_path / f"sweep.part-{i}-of-2.csv") for i in range(2)]
    assert main(["merge", str(tmp_path / "joined.csv"), *parts]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parts of 2 different sweeps" in err, err
    assert all(part in err for part in parts)
    # The parts of one sweep name one sweep: no warning.
    assert main(SMALL_SWEEP + ["--output", str(out), "--parts", "2", "--part", "1"]) == 0
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "joined.csv"), *parts]) == 0
    assert capsys.readouterr().err == ""


def test_parts_of_a_model_redefined_between_them_do_not_merge(tmp_path, capsys, monkeypatch):
    # Each part ran with a --models file defining "tiny-gpt", edited in between:
    # the configuration ids match, the sizes do not; the error names the change.
    from distir_jax.models import config

    monkeypatch.setattr(config, "_PRESETS", dict(config._PRESETS))
    fields = dict(kind="gpt", num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)
    argv = ["sweep", "--model", "tiny-gpt", "--world-sizes", "2", "--batch-sizes", "8", "--microbatches"]
    argv += ["2", "--schedules", "1f1b", "--no-progress", "--parts", "2", "--output", str(tmp_path / "s.csv")]
    for part, hidden in ((0, 64), (1, 128)):
        models = tmp_path / f"models-{part}.json"
        models.write_text(json.dumps({"tiny-gpt": dict(fields, hidden=hidden)}))
        monkeypatch.setattr(config, "_PRESETS", dict(config._PRESETS))
        config._PRESETS.pop("tiny-gpt", None)  # a new process, as each part would be
        assert main(argv + ["--part", str(part), "--models", str(models)]) == 0
    capsys.readouterr()
    parts = [str(tmp_path / f"s.part-{i}-of-2.csv") for i in range(2)]
    assert main(["merge", str(tmp_path / "joined.csv"), *parts]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"distir-jax merge: error: {parts[0]} and {parts[1]} were computed with different definitions: "
        "model 'tiny-gpt' (ffn_hidden 256 -> 512, hidden 64 -> 128); merging them would mix the two\n"
    )
    assert not (tmp_path / "joined.csv").exists()


def test_a_sweep_of_a_model_from_a_models_file(tmp_path, capsys, monkeypatch):
    # A model of one's own sizes, by name: the rows are the Python API's for its
    # config, and the simulate command the sweep prints names the file again.
    from distir_jax.models import TransformerConfig, config
    from search import StrategySpace, evaluate

    monkeypatch.setattr(config, "_PRESETS", dict(config._PRESETS))  # forget it afterwards
    fields = dict(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)
    models = tmp_path / "models.json"
    models.write_text(json.dumps({"tiny-gpt": dict(kind="gpt", **fields)}))
    out = tmp_path / "sweep.csv"
    argv = ["sweep", "--models", str(models), "--model", "tiny-gpt", "--world-sizes", "4", "--batch-sizes"]
    argv += ["16", "--microbatches", "2,4", "--schedules", "1f1b", "--recompute", "none,full", "--zero"]
    argv += ["no", "--overlap", "no", "--no-progress", "--output", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    table = ResultTable.read(out)
    assert set(table["model"].tolist()) == {"tiny-gpt"} and (table["status"] == "ok").sum() > 10
    space = StrategySpace(
        model=TransformerConfig(**fields),
        world_sizes=(4,),
        global_batch_sizes=(16,),
        microbatches=(2, 4),
        schedules=("1f1b",),
        recompute=("none", "full"),
        zero=(False,),
        overlap_grad_comm=(False,),
        dtype="bf16",
        optimizer="adam",
    )
    want = evaluate(space, progress=False)
    for name in ("status", "step_time_s", "peak_memory_bytes", "mfu"):
        assert table[name].tolist() == want[name].tolist(), name
    command = text.split("the best one up close")[1].splitlines()[1].split()
    assert command[2:6] == ["--models", str(models), "--model", "tiny-gpt"]
    assert command[-3:] == ["--sensitivity", "--trace", "best.json"]
    assert main(command[1:-3]) == 0  # simulate, without --sensitivity and the trace
    best = table.top_k(1)
    assert f"step time: {best['step_time_s'][0]:.6g} s" in capsys.readouterr().out


def test_models_lists_every_model_with_its_sizes(tmp_path, capsys, monkeypatch):
    from distir_jax.models import config, model_names

    monkeypatch.setattr(config, "_PRESETS", dict(config._PRESETS))
    models = tmp_path / "models.json"
    models.write_text(json.dumps({"mine": {"kind": "mlp", "num_layers": 3, "hidden": 1000}}))
    assert main(["models", "--models", str(models)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = "model kind layers hidden heads ffn vocab seq parameters FLOP/sample from"
    assert lines[0].split() == header.split()
    assert [line.split()[0] for line in lines[1:]] == list(model_names())
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    # GPT-3 175B: 175.2B parameters (untied head), 2.2 PFLOP a sample of 2048 tokens.
    assert rows["gpt3-175b"] == "gpt 96 12288 96 49152 50304 2048 175.2B 2.2P built-in".split()
    # 3 layers of 1000 x 1000: 3M parameters; 6 L H^2 - 2 H^2 = 16 MFLOP a sample.
    assert rows["mine"] == ["mlp", "3", "1000", "-", "-", "-", "-", "3.0M", "16.0M", str(models)]
