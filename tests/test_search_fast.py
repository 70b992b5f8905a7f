"""The fast engine (coarse programs generated as arrays) against the reference simulator on fine programs."""

import dataclasses
import importlib

import numpy as np
import pytest

pytest.importorskip("distir_jax.transforms.parallelize")

from distir_jax.executor.reference import reference_simulate  # noqa: E402
from distir_jax.models import MLPConfig, TransformerConfig, get_model_config  # noqa: E402
from distir_jax.presets import get_preset  # noqa: E402
from distir_jax.transforms import coarse_steady  # noqa: E402
from distir_jax.transforms.coarse import (  # noqa: E402
    SplitBlockError,
    layer_features,
    transform_layers_per_chunk,
)
from search import StrategySpace, build_function, enumerate_configs, evaluate  # noqa: E402
from search._fast import FastEngine, fast_unsupported  # noqa: E402

TINY_GPT = TransformerConfig(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)
SPACES = (
    StrategySpace(  # DistIR's grid, small: every degree, pipelines of 1-4 layers per stage
        model=("mlp-xs", MLPConfig(num_layers=6, hidden=96)),
        world_sizes=(1, 2, 4, 8),
        global_batch_sizes=(16, 64),
        microbatches=(2, 4, 8),
        schedules=("gpipe", "1f1b"),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        optimizer=("sgd", "adam"),
    ),
    StrategySpace(
        model=TINY_GPT,
        world_sizes=(1, 2, 4, 8),
        global_batch_sizes=(8, 16),
        microbatches=(2, 4),
        schedules=("gpipe", "1f1b", "interleaved"),
        recompute=("none", "attention", "full"),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        optimizer="adam",
    ),
)


@pytest.fixture(scope="module")
def swept():
    configs = [c for space in SPACES for c in enumerate_configs(space)]
    return configs, evaluate(configs, progress=False, engine="fast")


def test_fast_rows_match_the_reference_simulator_on_fine_programs(swept):
    configs, table = swept
    fast = np.flatnonzero(table["engine"] == "fast")
    assert len(fast) >= 200
    for i in np.random.default_rng(0).choice(fast, size=200, replace=False):
        fn, topology = build_function(configs[i])  # what the exact engine simulates
        reference = reference_simulate(fn, topology)
        np.testing.assert_allclose(
            table["step_time_s"][i], reference.step_time, rtol=1e-9, err_msg=str(configs[i])
        )
        np.testing.assert_allclose(
            table["peak_memory_bytes"][i],
            max(reference.peak_memory.values()),
            rtol=1e-9,
            err_msg=str(configs[i]),
        )


@pytest.fixture
def steady_everywhere(monkeypatch):
    """Short steady programs for pipelines of any length (sweeps keep them for long ones)."""
    monkeypatch.setattr(coarse_steady, "MIN_LONG_OPS", 0)


@pytest.fixture
def exact_built(monkeypatch):
    """The programs the exact engine builds while the test runs, by configuration
    (with the topology), so that a test checks them with the reference simulator
    without building each again (the same function as :func:`build_function`'s)."""
    from search import _transform

    built, build = {}, _transform.build_function

    def recording(config, batch_size, **kwargs):
        fn = build(config, batch_size, **kwargs)
        same_batch = np.ndim(batch_size) == 0 and batch_size == config.global_batch_size
        if same_batch and kwargs.get("representative_only", True):
            built[config] = fn, config.topology()
        return fn

    monkeypatch.setattr(_transform, "build_function", recording)
    return built


def test_long_pipelines_run_short_with_the_reference_simulators_results(steady_everywhere, exact_built):
    space = StrategySpace(
        model=TINY_GPT,
        world_sizes=(4, 8),
        global_batch_sizes=(64,),
        microbatches=(16, 32),
        schedules=("1f1b", "interleaved"),
        recompute=("none", "full"),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        optimizer="adam",
    )
    configs = [c for c in enumerate_configs(space) if c.valid and not fast_unsupported(c)]
    engine = FastEngine(configs)
    steady = [c for c in configs if engine.prepare([c])[0][1].steady is not None]
    assert len(steady) >= 40 and {c.schedule for c in steady} == {"1f1b", "interleaved"}
    sample = [steady[i] for i in np.random.default_rng(1).choice(len(steady), size=24, replace=False)]
    fast = evaluate(sample, progress=False, engine="fast")
    exact = evaluate(sample, progress=False, engine="exact")
    assert fast["status"].tolist() == exact["status"].tolist()
    assert len(exact_built) == len(sample)
    for i, config in enumerate(sample):
        fn, topology = exact_built[config]
        reference = reference_simulate(fn, topology)
        np.testing.assert_allclose(
            fast["step_time_s"][i], reference.step_time, rtol=1e-9, err_msg=str(config)
        )
        peak = max(reference.peak_memory.values())
        np.testing.assert_allclose(fast["peak_memory_bytes"][i], peak, rtol=1e-9, err_msg=str(config))
    for name in ("compute_time_s", "communication_time_s", "bubble_time_s"):
        np.testing.assert_allclose(fast[name], exact[name], rtol=1e-9, atol=1e-15, err_msg=name)
    assert (fast["simulated_ops"] * 2 < exact["simulated_ops"]).all()


def test_long_sequence_parallel_pipelines_run_short_with_the_exact_engines_results(steady_everywhere):
    space = StrategySpace(
        model=TINY_GPT,
        world_sizes=(8,),
        global_batch_sizes=(64,),
        microbatches=(16, 32),
        tensor=(2,),
        schedules=("1f1b",),
        recompute=("none", "full"),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        sequence_parallel=(True,),
        optimizer="adam",
    )
    configs = [c for c in enumerate_configs(space) if c.valid and c.pipeline > 1]
    engine = FastEngine(configs)
    steady = [c for c in configs if engine.prepare([c])[0][1].steady is not None]
    assert {(c.data > 1, c.overlap_grad_comm) for c in steady} == {
        (False, False),
        (True, False),
        (True, True),
    }
    sample = [steady[i] for i in np.random.default_rng(2).choice(len(steady), size=12, replace=False)]
    _assert_same_as_exact(sample)


def test_rows_whose_period_is_not_certified_run_their_long_programs(monkeypatch, steady_everywhere):
    evaluate_module = importlib.import_module("search.evaluate")
    space = StrategySpace(
        model=TINY_GPT, world_sizes=(4,), global_batch_sizes=(32,), microbatches=(16,), schedules=("1f1b",)
    )
    configs = [c for c in enumerate_configs(space) if c.valid and c.pipeline > 1]
    want = evaluate(configs, progress=False, engine="exact")
    extrapolate = evaluate_module._extrapolate
    # Every period fails its certificate (in kernels traced here, then forgotten).
    monkeypatch.setattr(evaluate_module, "_extrapolate", lambda *a: (extrapolate(*a)[0], a[2] == 0))
    monkeypatch.setattr(evaluate_module, "_COMPILED", {})
    long, retried = [], []
    prepare = FastEngine.prepare

    def spy(self, group, *, steady=True, settle=0):
        long.extend(group if not steady else [])
        retried.extend(group if settle else [])
        return prepare(self, group, steady=steady, settle=settle)

    monkeypatch.setattr(FastEngine, "prepare", spy)
    evaluate_module._runner.cache_clear()
    try:
        got = evaluate(configs, progress=False, engine="fast")
    finally:
        evaluate_module._runner.cache_clear()
    # Each one tried as a longer short program, then run at its full length.
    assert len(retried) == len(configs) and len(long) == len(configs)
    assert set(got["engine"].tolist()) == {"fast"}
    np.testing.assert_allclose(got["step_time_s"], want["step_time_s"], rtol=1e-9)
    np.testing.assert_allclose(got["peak_memory_bytes"], want["peak_memory_bytes"], rtol=1e-9)
    assert got["status"].tolist() == want["status"].tolist()


# Every row of SPACES, in parts that the test workers share: (space, world sizes).
@pytest.mark.parametrize("space,world_sizes", [(0, (1, 2, 4, 8)), (1, (1, 2, 4)), (1, (8,))])
def test_fast_and_exact_tables_agree(swept, space, world_sizes):
    configs, table = swept
    ids = {c.config_id for c in enumerate_configs(SPACES[space]) if c.world_size in world_sizes}
    rows = [i for i, c in enumerate(configs) if c.config_id in ids]
    assert len(rows) == len(ids) and set(world_sizes) <= set(SPACES[space].world_sizes)
    configs, fast = [configs[i] for i in rows], table.take(rows)
    exact = evaluate(configs, progress=False, engine="exact")
    assert fast["config_id"].tolist() == exact["config_id"].tolist()
    assert fast["status"].tolist() == exact["status"].tolist()
    assert set(exact["engine"][exact["status"] != "invalid"].tolist()) == {"exact"}
    np.testing.assert_allclose(fast["step_time_s"], exact["step_time_s"], rtol=1e-9)
    np.testing.assert_allclose(fast["peak_memory_bytes"], exact["peak_memory_bytes"], rtol=1e-9)
    for name in ("compute_time_s", "communication_time_s", "bubble_time_s"):
        np.testing.assert_allclose(fast[name], exact[name], rtol=1e-9, atol=1e-15, err_msg=name)
    # The fast programs are much smaller: one op per pipeline step.
    used = fast["engine"] == "fast"
    assert fast["simulated_ops"][used].sum() * 3 < exact["simulated_ops"][used].sum()


def _per_device(result, field: str = "peak_memory_bytes") -> dict:
    """A summary's peak (or resident) bytes by original device, for the devices its ops run on."""
    used = result.simulated
    return dict(zip(result.devices[used].tolist(), getattr(result, field)[used].tolist(), strict=True))


def _assert_summary_is_the_fine_programs(config, sweep_row=None):
    from search.single import simulate_config, summarize_config

    fast, exact = summarize_config(config), simulate_config(config)
    assert (fast.row["engine"], exact.row["engine"]) == ("fast", "exact"), config
    names = ("step_time_s", "peak_memory_bytes", "compute_time_s", "communication_time_s", "bubble_time_s")
    for name in names:
        np.testing.assert_allclose(fast.row[name], exact.row[name], rtol=1e-9, atol=1e-15, err_msg=name)
        if sweep_row is not None:  # the row a sweep of many configurations gave it
            np.testing.assert_allclose(fast.row[name], sweep_row[name], rtol=1e-12, atol=1e-15, err_msg=name)
    assert fast.row["status"] == exact.row["status"]
    fast_peaks, exact_peaks = _per_device(fast), _per_device(exact)
    assert sorted(fast_peaks) == sorted(exact_peaks), config
    np.testing.assert_allclose(
        [fast_peaks[d] for d in sorted(fast_peaks)], [exact_peaks[d] for d in sorted(fast_peaks)], rtol=1e-9
    )
    assert max(fast_peaks.values()) == fast.row["peak_memory_bytes"]
    # What of each peak is resident from the start (a steady short program's too: the long one's).
    fast_resident, exact_resident = (_per_device(r, "resident_bytes") for r in (fast, exact))
    for d, peak in fast_peaks.items():
        assert fast_resident[d] == pytest.approx(exact_resident[d], rel=1e-12), (config, d)
        assert 0 < fast_resident[d] <= peak


def test_a_configuration_summarized_fast_is_its_fine_program_device_by_device(swept):
    configs, table = swept
    fast = np.flatnonzero(table["engine"] == "fast")
    picks = {  # one of each kind: the first in the sweep's order
        "pipeline, data, ZeRO": lambda c: c.pipeline > 1 and c.data > 1 and c.zero,
        # Stage 1 on device 4: the compacted program's device indices are not the cluster's.
        "tensor 4, pipeline": lambda c: c.tensor == 4 and c.pipeline == 2,
        "interleaved, recompute": lambda c: c.virtual_stages > 1 and c.recompute != "none",
        "overlap": lambda c: c.overlap_grad_comm and c.pipeline > 1,
    }
    for name, wanted in picks.items():
        i = next((i for i in fast if wanted(configs[i])), None)
        assert i is not None, name
        _assert_summary_is_the_fine_programs(configs[i], table.row(i))


def test_a_long_pipeline_summarized_from_its_steady_program(steady_everywhere):
    (config,) = [
        c
        for c in enumerate_configs(
            StrategySpace(
                model=TINY_GPT,
                world_sizes=(2,),
                global_batch_sizes=(32,),
                data=(1,),
                tensor=(1,),
                microbatches=(16,),
                schedules=("1f1b",),
                optimizer="adam",
            )
        )
        if c.valid
    ]
    engine = FastEngine([config])
    ((_, prepared, _, _),) = engine.prepare([config])
    assert prepared.steady is not None  # a short program stands for the 16 microbatches
    _assert_summary_is_the_fine_programs(config)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(data=2, pipeline=2, microbatches=4, zero=True, overlap_grad_comm=True, optimizer="adam"),
        dict(
            tensor=2, pipeline=2, microbatches=4, schedule="interleaved", virtual_stages=2, optimizer="adam"
        ),
        dict(data=4, zero=True, recompute="full", optimizer="sgd"),
        dict(
            data=2,
            tensor=2,
            pipeline=2,
            microbatches=4,
            zero=True,
            overlap_grad_comm=True,
            sequence_parallel=True,
            optimizer="adam",
        ),
    ],
    ids=["pipeline-zero-overlap", "tensor-interleaved", "zero-sgd", "sequence-parallel-zero"],
)
@pytest.mark.parametrize("precision", ["mixed", "mixed-half-grads", "half", "mixed-fp8"])
def test_half_precision_rows_are_the_fine_programs(knobs, precision):
    """A bf16 model in each training precision (f32 master copies, moments and
    gradient sums, or some of them in bf16): the fast engine's coarse program,
    measured from the fine block, holds and moves them as the fine program does."""
    import dataclasses

    from search.single import make_config

    model = dataclasses.replace(TINY_GPT, dtype="bf16")
    if precision == "mixed-fp8":  # FP8 tensor cores
        knobs = dict(knobs, hardware="dgx-h100")
    config = make_config(model, batch_size=16, training_precision=precision, **knobs)
    assert config.training_precision == precision == config.model_config.resolved_precision
    _assert_summary_is_the_fine_programs(config)


def test_a_summary_the_fast_engine_cannot_give_is_the_exact_engines():
    from search.single import SingleResult, make_config, summarize_config

    config = make_config("mlp-xs", world_size=2, tensor=2, sequence_parallel=True, batch_size=4)
    assert fast_unsupported(config)
    result = summarize_config(config)
    assert isinstance(result, SingleResult) and result.row["engine"] == "exact"
    with pytest.raises(ValueError, match="engine must be one of"):
        summarize_config(config, engine="quick")
    with pytest.raises(ValueError, match="invalid configuration"):
        summarize_config(make_config(TINY_GPT, world_size=4, data=4, batch_size=2))


_SEQUENCE_PARALLEL = dict(
    model=TINY_GPT, world_size=8, tensor=2, data=2, pipeline=2, microbatches=4, sequence_parallel=True
)


def _step_spans(events) -> dict:
    """``(device, direction, microbatch, chunk) -> (first start, last end)`` in seconds."""
    spans: dict = {}
    for key, start, end in events:
        first, last = spans.get(key, (np.inf, -np.inf))
        spans[key] = (min(first, start), max(last, end))
    return spans


@pytest.mark.parametrize(
    "knobs",
    [
        dict(model="mlp-xs", world_size=4, data=2, pipeline=2, microbatches=4, batch_size=32, dtype="f32"),
        dict(model=TINY_GPT, world_size=8, tensor=4, pipeline=2, microbatches=4, recompute="attention"),
        dict(
            model=TINY_GPT,
            world_size=4,
            data=2,
            pipeline=2,
            microbatches=4,
            zero=True,
            overlap_grad_comm=True,
        ),
        dict(
            model=TINY_GPT, world_size=2, pipeline=2, microbatches=4, schedule="interleaved", virtual_stages=2
        ),
        _SEQUENCE_PARALLEL | dict(overlap_grad_comm=True),
        _SEQUENCE_PARALLEL | dict(zero=True),  # no overlap: mode "sync_tp"
    ],
    ids=[
        "mlp",
        "tensor-recompute",
        "zero-overlap",
        "interleaved",
        "sequence-parallel",
        "sequence-parallel-sync",
    ],
)
def test_a_coarse_trace_spans_each_steps_fine_ops(knobs):
    from search.single import coarse_chrome_trace, make_config, simulate_config

    knobs = dict(knobs)
    config = make_config(knobs.pop("model"), **{"batch_size": 16, "optimizer": "adam"} | knobs)
    coarse = [e for e in coarse_chrome_trace(config)["traceEvents"] if e["ph"] == "X"]
    fine = simulate_config(config)
    # A pipeline step's fine ops: its chunk's and microbatch's, recomputed forwards in its backward.
    fine_ops = [
        (i, "bwd" if op.attr("recompute") else op.attr("phase"), op.attr("microbatch"), op.attr("chunk"))
        for i, op in enumerate(fine.function.ops)
        if op.op_type != "Send" and op.attr("microbatch") is not None
    ]
    want = _step_spans(
        ((int(d), phase, mb, chunk), fine.op_start[i], fine.op_finish[i])
        for i, phase, mb, chunk in fine_ops
        for d in fine.op_devices[i]
        if d >= 0
    )
    direction = {"forward": "fwd", "backward": "bwd"}
    got = _step_spans(
        (
            (e["pid"], direction[e["name"]], e["args"]["microbatch"], e["args"]["chunk"]),
            e["ts"] / 1e6,
            (e["ts"] + e["dur"]) / 1e6,
        )
        for e in coarse
        if e["name"] in direction
    )
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-15, err_msg=str(key))
    end = max(e["ts"] + e["dur"] for e in coarse) / 1e6
    np.testing.assert_allclose(end, fine.row["step_time_s"], rtol=1e-9)
    # On each (device, stream) the events run one after the other.
    for lane in {(e["pid"], e["tid"]) for e in coarse}:
        times = sorted((e["ts"], e["ts"] + e["dur"]) for e in coarse if (e["pid"], e["tid"]) == lane)
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(times, times[1:], strict=False)), lane


def test_no_coarse_trace_where_the_fast_engine_does_not_model_the_configuration():
    from search.single import coarse_chrome_trace, make_config

    config = make_config("mlp-xs", world_size=2, tensor=2, sequence_parallel=True, batch_size=4)
    with pytest.raises(ValueError, match="sequence parallelism"):
        coarse_chrome_trace(config)


def test_rows_the_fast_engine_does_not_model_run_exact():
    space = StrategySpace(
        model=(TINY_GPT, "mlp-xs"),
        world_sizes=(4,),
        global_batch_sizes=(8,),
        microbatches=(2,),
        overlap_grad_comm=(False, True),
        sequence_parallel=(False, True),
        zero=(False, True),
        optimizer="adam",
    )
    configs = list(enumerate_configs(space))
    table = evaluate(configs, progress=False, engine="fast")
    engines = set()
    for c, engine, status in zip(configs, table["engine"], table["status"], strict=True):
        if status == "invalid":
            assert engine == ""
        elif c.sequence_parallel and isinstance(c.model_config, MLPConfig):
            assert engine == "exact" and fast_unsupported(c), c
        else:  # a GPT's sequence parallelism too, with or without gradient overlap
            assert engine == "fast", c
        engines.add((engine, c.sequence_parallel))
    assert {("fast", True), ("exact", True), ("fast", False)} <= engines


def _sequence_parallel_rows(model, **knobs) -> list:
    """The valid sequence-parallel rows of a space with every data-parallel mode (``knobs``: the rest)."""
    common = dict(
        global_batch_sizes=(16,),
        recompute=("none", "full"),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        sequence_parallel=(True,),
        optimizer="adam",
    )
    space = StrategySpace(model=model, **(common | knobs))
    return [c for c in enumerate_configs(space) if c.valid and c.sequence_parallel]


def test_sequence_parallel_rows_match_the_exact_engine():
    """Megatron sequence parallelism in the fast engine: blocks measured under it,
    messages of ``1 / t`` of the sequence, and each LayerNorm gradient's in-place
    tensor-group sync (after the data-parallel reductions, Megatron-LM's order)
    in its update, or without gradient overlap an op per stage before the update
    (mode "sync_tp"), for every schedule, recompute policy and data-parallel
    mode; step time, peak memory and breakdown equal the exact engine's."""
    configs = _sequence_parallel_rows(
        TINY_GPT, world_sizes=(2, 4, 8), microbatches=(2, 4), schedules=("gpipe", "1f1b", "interleaved")
    )
    assert len(configs) >= 100 and {c.data for c in configs} == {1, 2, 4}
    fast = _assert_same_as_exact(configs)
    assert (fast["status"] == "ok").all()


def test_sequence_parallel_rows_of_a_vocabulary_the_tensor_degree_does_not_divide():
    """The embedding's whole output is cut into sequence parts in the embedding
    (the fuzz found it counted in every block when the first block did it)."""
    import dataclasses

    model = dataclasses.replace(TINY_GPT, vocab_size=50)
    configs = _sequence_parallel_rows(model, world_sizes=(4, 8), microbatches=(2,), tensor=(4,))
    assert {(c.pipeline, c.data) for c in configs} >= {(1, 1), (2, 1), (1, 2)}
    _assert_same_as_exact(configs)


def test_sequence_parallelism_halves_messages_and_keeps_the_layer_norm_syncs():
    """What the fast engine's sequence-parallel features say, against the fine block."""
    topology = get_preset("dgx-a100-80gb:2")
    plain = layer_features(TINY_GPT, 2, "none", [4], topology)
    parallel = layer_features(TINY_GPT, 2, "none", [4], topology, sequence_parallel=True)
    np.testing.assert_allclose(parallel.message_bytes, plain.message_bytes / 2)
    # A block's four LayerNorm weights each sync 2 (t - 1) / t of their bytes.
    volume = list(parallel.optimizer[1] - plain.optimizer[1])[5]
    ln_bytes = 4 * TINY_GPT.hidden * 4
    assert volume == pytest.approx(ln_bytes)
    with pytest.raises(ValueError, match="sequence_parallel applies to GPTs under tensor parallelism"):
        layer_features(TINY_GPT, 1, "none", [4], get_preset("dgx-a100-80gb:1"), sequence_parallel=True)


def _split_pairs(config) -> bool:
    """MLP tensor parallelism where the pipeline transform's stages split a (column, row) pair."""
    if config.tensor == 1:
        return False
    features = layer_features(
        config.model_config, config.tensor, "none", [4], get_preset(f"{config.hardware}:{config.tensor}")
    )
    try:
        transform_layers_per_chunk(features, config.pipeline * config.virtual_stages)
    except SplitBlockError:
        return True
    return False


def _assert_same_as_exact(configs):
    fast = evaluate(configs, progress=False, engine="fast")
    exact = evaluate(configs, progress=False, engine="exact")
    assert set(fast["engine"].tolist()) == {"fast"}
    assert fast["status"].tolist() == exact["status"].tolist()
    np.testing.assert_allclose(fast["step_time_s"], exact["step_time_s"], rtol=1e-9)
    np.testing.assert_allclose(fast["peak_memory_bytes"], exact["peak_memory_bytes"], rtol=1e-9)
    for name in ("compute_time_s", "communication_time_s", "bubble_time_s"):
        np.testing.assert_allclose(fast[name], exact[name], rtol=1e-9, atol=1e-15, err_msg=name)
    return fast


def test_padded_zero_shards_of_mlp_pairs_split_by_stages_run_fast():
    """Per-layer features (each stage one layer of a (column, row) pair) with ZeRO over
    3 replicas, which pad every 16-row weight to 18: fast, the exact engine's numbers."""
    space = StrategySpace(
        model=MLPConfig(num_layers=4, hidden=16, dtype="f32"),
        world_sizes=(24,),
        global_batch_sizes=(24,),
        microbatches=(2, 4),
        tensor=(2,),
        pipeline=(4,),
        schedules=("gpipe", "1f1b"),
        zero=(True,),
        overlap_grad_comm=(False, True),
        optimizer="adam",
    )
    configs = [c for c in enumerate_configs(space) if c.valid]
    assert len(configs) == 8 and all(c.data == 3 and _split_pairs(c) for c in configs)
    _assert_same_as_exact(configs)


def test_padded_reduction_transient_of_per_layer_stages_sets_their_peaks():
    """Per-layer stages, ZeRO over 3 replicas padding every weight (64 or 32 rows) to a multiple of 3,
    gradients reduced after the backward pass (no overlap): with one sample per
    microbatch, a stage's reduce-scatter output above its gradients is its peak
    (a fast engine that leaves it out is ~2 KB low), as the exact engine finds."""
    space = StrategySpace(
        model=MLPConfig(num_layers=4, hidden=64, dtype="f32"),
        world_sizes=(24,),
        global_batch_sizes=(3,),
        microbatches=(1,),
        tensor=(2,),
        pipeline=(4,),
        schedules=("gpipe", "1f1b"),
        zero=(True,),
        overlap_grad_comm=(False,),
        optimizer="adam",
    )
    configs = [c for c in enumerate_configs(space) if c.valid]
    assert len(configs) == 2 and all(c.data == 3 and _split_pairs(c) for c in configs)
    _assert_same_as_exact(configs)


def test_mlp_tensor_pairs_split_by_single_layer_stages_run_fast():
    """mlp-xs (8 layers) on t = 2, p = 8: each stage holds one layer, every other
    message is a column layer's feature shard (DistIR's grid, part (a) of the benchmark)."""
    space = StrategySpace(
        model="mlp-xs",
        world_sizes=(16,),
        global_batch_sizes=(64, 256, 1024),
        microbatches=(2, 4, 8),
        dtype="f32",
        hardware="dgx-a100-80gb",
        optimizer="sgd",
    )
    configs = [c for c in enumerate_configs(space) if c.valid and c.tensor == 2 and c.pipeline == 8]
    assert len(configs) == 9 and all(_split_pairs(c) and not fast_unsupported(c) for c in configs)
    _assert_same_as_exact(configs)


@pytest.mark.parametrize(
    "model, world_sizes, optimizer",
    [
        # 3 pairs on 4 chunks (p = 4, or p = 2 with v = 2): chunks of one or two layers,
        # starting with a row layer or ending with a column layer.
        (MLPConfig(num_layers=6, hidden=96), (4, 8, 16), "adam"),
        (MLPConfig(num_layers=6, hidden=96), (8,), "sgd"),
        # 5 pairs on 4 or 8 chunks, 4 on 8.
        (MLPConfig(num_layers=10, hidden=64), (8, 16), "adam"),
        (MLPConfig(num_layers=8, hidden=64), (16,), "adam"),
    ],
)
def test_mlp_tensor_pairs_split_by_stages_match_the_exact_engine(model, world_sizes, optimizer):
    """Mixed chunks, with data parallelism, gradient overlap and ZeRO, every schedule."""
    space = StrategySpace(
        model=model,
        world_sizes=world_sizes,
        global_batch_sizes=(48,),
        microbatches=(2, 4),
        schedules=("gpipe", "1f1b", "interleaved"),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        optimizer=optimizer,
    )
    configs = [c for c in enumerate_configs(space) if c.valid and _split_pairs(c)]
    assert len(configs) >= 8
    assert {c.schedule for c in configs} >= {"1f1b", "interleaved"}
    if max(world_sizes) > 8:  # and replicas, with and without overlap and ZeRO
        assert {(c.zero, c.overlap_grad_comm) for c in configs if c.data > 1} == {
            (z, o) for z in (False, True) for o in (False, True)
        }
    _assert_same_as_exact(configs)


def test_mlps_under_full_recomputation_match_the_exact_engine():
    """A layer's backward then reads a recomputed Relu output: a pipeline stage frees the
    original once sent (whole pairs, split pairs, and without tensor parallelism)."""
    space = StrategySpace(
        model=MLPConfig(num_layers=6, hidden=96),
        world_sizes=(2, 4, 8),
        global_batch_sizes=(16,),
        microbatches=(2, 4),
        schedules=("gpipe", "1f1b"),
        recompute="full",
        optimizer="sgd",
    )
    configs = [c for c in enumerate_configs(space) if c.valid and c.pipeline > 1]
    assert {_split_pairs(c) for c in configs} == {False, True} and {c.tensor for c in configs} >= {1, 2}
    _assert_same_as_exact(configs)
    # The table's peak is the busiest stage's: each stage's too.
    engine = FastEngine(configs)
    for c in configs[:: max(1, len(configs) // 12)]:
        _, prepared, variant, _ = engine.prepare([c])[0]
        fn, topology = build_function(c)
        want = reference_simulate(fn, topology).peak_memory
        got = dict(zip(prepared.devices.tolist(), prepared.peak_bytes[variant].tolist(), strict=True))
        for device, peak in want.items():
            np.testing.assert_allclose(got[device], peak, rtol=1e-9, err_msg=f"{c} device {device}")


def test_mlp_tensor_pairs_split_under_long_pipelines_run_short(steady_everywhere):
    space = StrategySpace(
        model="mlp-xs",
        world_sizes=(16,),
        global_batch_sizes=(256,),
        microbatches=(16, 32),
        overlap_grad_comm=(False, True),
        zero=(False, True),
        optimizer="adam",
    )
    configs = [c for c in enumerate_configs(space) if c.valid and _split_pairs(c)]
    engine = FastEngine(configs)
    assert any(engine.prepare([c])[0][1].steady is not None for c in configs)
    _assert_same_as_exact(configs)


def test_mlps_the_fast_engine_does_not_model_under_tensor_parallelism_run_exact():
    """One (column, row) pair, or an odd number of layers: the exact engine."""
    for layers, reason in ((2, "at least two blocks"), (3, "odd number")):
        space = StrategySpace(
            model=MLPConfig(num_layers=layers, hidden=64),
            world_sizes=(2, 4),
            global_batch_sizes=(16,),
            microbatches=(2,),
        )
        configs = [c for c in enumerate_configs(space) if c.valid]
        table = evaluate(configs, progress=False, engine="fast")
        for c, engine in zip(configs, table["engine"], strict=True):
            assert (engine == "exact") == (c.tensor > 1), c
            assert (reason in fast_unsupported(c)) == (c.tensor > 1), c


def test_per_layer_features_add_up_to_the_pairs():
    """An MLP under tensor parallelism measured per layer: each pair's two layers cost
    what the pair costs, and a column layer's output is a 1 / t feature shard."""
    model, hardware = get_model_config("mlp-xs"), get_preset("dgx-a100-80gb:8")
    pairs = layer_features(model, 2, "none", [4, 8], hardware, optimizer="adam")
    layers = layer_features(model, 2, "none", [4, 8], hardware, optimizer="adam", per_layer=True)
    assert layers.per_layer and layers.step.shape[0] == 6 and layers.num_blocks == model.num_layers
    for name in ("step", "step_flops", "optimizer", "accumulate"):
        got = getattr(layers, name)
        np.testing.assert_allclose(got[0::2] + got[1::2], getattr(pairs, name), rtol=1e-12, err_msg=name)
    for name in ("param_bytes", "state_bytes"):
        np.testing.assert_array_equal(getattr(layers, name).reshape(3, 2).sum(axis=1), getattr(pairs, name))
    np.testing.assert_array_equal(layers.output_bytes[0::2], layers.output_bytes[1::2] / 2)
    np.testing.assert_array_equal(layers.output_bytes[1], pairs.message_bytes)
    assert layers.layer_costs() == pairs.layer_costs()


def test_unknown_engine_is_an_error():
    with pytest.raises(ValueError, match="engine must be one of"):
        evaluate([], engine="approximate")


@pytest.mark.parametrize(
    "model, tensor, policy",
    [("mlp-xs", 1, "none"), ("mlp-xs", 2, "full"), ("gpt2-small", 2, "attention"), ("gpt2-small", 1, "full")],
)
def test_backward_replay_reproduces_the_fused_first_backward(model, tensor, policy):
    """The per-op replay (used for later microbatches and received inputs) agrees with
    the fused program's events where both apply: the first microbatch, input kept."""
    f = layer_features(get_model_config(model), tensor, policy, [4, 8], get_preset("dgx-a100-80gb:8"))
    np.testing.assert_allclose(f.backward_rise[:, 0, 0], f.peak_rise[:, 1], rtol=1e-12)
    np.testing.assert_allclose(f.backward_net[:, 0, 0], f.net_bytes[:, 1], rtol=1e-12)
    # A later microbatch keeps no new gradients: it adds them to the running sums.
    np.testing.assert_allclose(
        f.backward_net[:, 1, 0], f.net_bytes[:, 1] - f.param_bytes[:, None], rtol=1e-12
    )
    for q, seg in enumerate(f.segments):  # overlap segments add up to the whole backward
        assert sum(g is not None for g in seg.grads) == len(f.grad_order[q])
        np.testing.assert_allclose(seg.cost.sum(axis=0), f.step[q, 1], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(seg.net.sum(axis=2), f.backward_net[q], rtol=1e-9, atol=1e-6)
        np.testing.assert_allclose(seg.accumulate.sum(axis=0), f.accumulate[q], rtol=1e-12)


def _replay_op_by_op(bops, part, later, input_freed, cuts):
    """The replay rule, one op at a time (the obvious reference for BackwardOps.replay)."""
    s = bops.alloc.shape[0]
    level, peak, rises, nets = np.zeros(s), np.zeros(s), [], []
    for i in bops.ops[part]:
        peak = np.maximum(peak, level + bops.alloc[:, i])
        level = level + bops.alloc[:, i] - bops.free[:, i]
        if input_freed:
            level = level - bops.input_freed.get(i, 0.0)
        for grad in bops.grads.get(i, ()):
            if later:
                level = level - np.asarray(grad.type.num_bytes, np.float64)
            if cuts:
                rises.append(peak)
                nets.append(level)
                level, peak = np.zeros(s), np.zeros(s)
    if not cuts:
        return peak, level
    return np.stack(rises + [peak]), np.stack(nets + [level])


@pytest.mark.parametrize(
    "model, tensor, policy, sizes",
    [
        ("mlp-xs", 2, "none", [4, 8]),  # a received input freed in the backward
        ("mlp-small", 1, "full", [3]),
        ("gpt2-small", 2, "attention", [1, 2, 4]),
        ("gpt2-small", 4, "full", [5]),
    ],
)
def test_backward_replay_matches_an_op_by_op_replay(model, tensor, policy, sizes, monkeypatch):
    """The vectorized replay (all four variants at once, running sums) equals
    replaying the part's ops one by one, bit for bit, with and without segments."""
    from distir_jax.transforms import coarse_features, coarse_segments

    built = []

    def keep(*args, **kwargs):
        built.append(coarse_segments.backward_ops(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(coarse_features, "backward_ops", keep)
    coarse_features._layer_features.cache_clear()
    layer_features(get_model_config(model), tensor, policy, sizes, get_preset("dgx-a100-80gb:8"))
    (bops,) = built
    assert bops.input_freed and bops.grads  # both kinds of events are exercised
    for part in range(len(bops.ops)):
        for cuts in (False, True):
            rise, net = bops.replay(part, cuts)
            for later in (0, 1):
                for freed in (0, 1):
                    want_rise, want_net = _replay_op_by_op(bops, part, later, freed, cuts)
                    np.testing.assert_array_equal(rise[later, freed], want_rise)
                    np.testing.assert_array_equal(net[later, freed], want_net)


def test_zero_on_a_vocabulary_the_degree_does_not_divide_matches_the_exact_engine():
    """ZeRO shards every weight along axis 0, padding a vocabulary the degree does not
    divide (130 rows over 4 replicas): valid rows, on the fast engine, with the exact
    engine's numbers (the padded shards' memory, updates and collectives)."""
    odd_vocab = TransformerConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=130, seq_len=8)
    space = StrategySpace(
        model=odd_vocab,
        world_sizes=(2, 4),
        global_batch_sizes=(8,),
        microbatches=(2,),
        zero=(True,),
        overlap_grad_comm=(False, True),
        optimizer="adam",
    )
    configs = list(enumerate_configs(space))
    fast, exact = evaluate(configs, progress=False), evaluate(configs, progress=False, engine="exact")
    assert fast["status"].tolist() == exact["status"].tolist()
    assert fast["reason"].tolist() == exact["reason"].tolist()
    np.testing.assert_allclose(fast["step_time_s"], exact["step_time_s"], rtol=1e-9)
    np.testing.assert_allclose(fast["peak_memory_bytes"], exact["peak_memory_bytes"], rtol=1e-9)
    padded = np.asarray([c.zero and c.data == 4 for c in configs])
    assert padded.any() and (fast["status"][padded] == "ok").all()
    simulated = fast["status"] != "invalid"
    assert (fast["engine"][simulated] == "fast").all()
    for name in ("compute_time_s", "communication_time_s", "bubble_time_s"):
        np.testing.assert_allclose(fast[name], exact[name], rtol=1e-9, atol=1e-15, err_msg=name)


def test_data_parallel_groups_across_nodes_match_the_exact_engine():
    """Replicas spread over two DGX nodes, several in each: their collectives run a
    ring per network port (Topology.ring_channels), in the fast engine as in the
    exact one, with and without ZeRO and overlap, pipelined or not."""
    from distir_jax.transforms.coarse import data_parallel_channels

    space = StrategySpace(
        model=TINY_GPT,
        world_sizes=(16,),
        global_batch_sizes=(32,),
        microbatches=(2,),
        tensor=(1, 2),
        pipeline=(1, 2),
        schedules=("1f1b",),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        sequence_parallel=(False, True),  # mode "sync_tp": the updates' tensor syncs apart
        optimizer="adam",
    )
    configs = [c for c in enumerate_configs(space) if c.valid]
    assert any(c.sequence_parallel and c.tensor > 1 and not c.overlap_grad_comm for c in configs)
    channels = {
        c.config_id: data_parallel_channels(c.topology(), c.pipeline, c.tensor, c.data).max() for c in configs
    }
    assert set(channels.values()) == {2.0, 4.0, 8.0}
    _assert_same_as_exact(configs)


def test_grouped_query_attention_runs_fast_as_the_exact_engine():
    """Key / value heads shared by query heads (LLaMA-2 70B style): the fast
    engine's coarse programs measure their blocks, so every strategy equals the
    exact engine's; a tensor degree that splits a key / value head is an invalid row."""
    model = dataclasses.replace(TINY_GPT, num_heads=8, num_kv_heads=2)
    space = StrategySpace(
        model=model,
        world_sizes=(4,),
        global_batch_sizes=(16,),
        microbatches=(2,),
        schedules=("1f1b", "interleaved"),
        recompute=("none", "attention"),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        sequence_parallel=(False, True),
        optimizer="adam",
    )
    configs = list(enumerate_configs(space))
    valid = [c for c in configs if c.valid]
    assert {c.tensor for c in valid} == {1, 2} and {c.pipeline for c in valid} >= {1, 2}
    reasons = {c.reason for c in configs if c.tensor == 4}
    assert reasons == {"tensor=4 must divide the number of key / value heads, which is 2"}
    _assert_same_as_exact(valid)
