"""Coarse programs: fusion, array schedules and issue orders, and the direct generator.

The oracle is the fine program built by the real transforms (tensor parallel,
recompute, pipeline, data parallel, symmetry-reduced where they can be):
:func:`coarsen` must keep its step time and peak memory, and
:func:`coarse_pipeline_program` must equal :func:`coarsen` of it op for op.
Step times are compared in float64 with a small Program-level simulator
that follows the kernel's semantics.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from distir_jax.cost import COST_FEATURES, inverse_bandwidth, op_seconds
from distir_jax.executor.reference import reference_simulate
from distir_jax.hardware import Hardware
from distir_jax.ir import FunctionBuilder, Topology
from distir_jax.ir.registry import get_spec
from distir_jax.kernel import simulate
from distir_jax.lower import lower, peak_memory
from distir_jax.models import MLPConfig, TransformerConfig, build_training_step
from distir_jax.presets import get_preset
from distir_jax.transforms import coarse, coarse_program
from distir_jax.transforms.base import as_distributed
from distir_jax.transforms.coarse import (
    DATA_MODES,
    balanced_layers,
    chunk_step_rows,
    chunk_tables,
    chunk_tables_by_mode,
    coarse_pipeline_program,
    coarsen,
    estimated_times,
    layer_features,
    mode_rows,
    pipeline_template,
    schedule_arrays,
    stage_peak_memory,
    template_size,
)
from distir_jax.transforms.data_parallel import data_parallel
from distir_jax.transforms.pipeline import balanced_boundaries, pipeline_parallel
from distir_jax.transforms.recompute import recompute
from distir_jax.transforms.schedules import (
    Step,
    estimated_issue_order,
    global_issue_order,
    make_schedule,
    schedule_times,
)
from distir_jax.transforms.tensor_parallel import tensor_parallel

GPT = TransformerConfig(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16, dtype="f32")
MICROBATCH = 2
RTOL = 1e-9


@functools.cache
def topology() -> Topology:
    # Two DGX nodes: tensor groups inside a node, pipeline and data replicas across.
    return get_preset("dgx-a100-80gb:16", dtype="f32")


def simulate64(program, topo: Topology, variant: int = 0) -> float:
    """Step time of a Program in float64, op by op (the kernel's semantics)."""
    features = {}
    for name in COST_FEATURES:
        x = np.asarray(getattr(program, name), np.float64)
        features[name] = x[variant] if x.ndim == 2 else x
    clock = np.zeros(program.resource_device.shape[-1])
    finish = np.zeros(program.num_finish_slots)
    for i in range(int(program.num_ops)):
        resources = [r for r in program.resource[i] if r >= 0]
        start = max(
            [clock[r] for r in resources] + [finish[s] for s in program.dep_slot[i] if s >= 0] + [0.0]
        )
        device = program.slot_device[i, 0]
        a, b = program.link[i]
        seconds = op_seconds(
            np,
            {k: v[i] for k, v in features.items()},
            1.0 / topo.peak_flops[device],
            1.0 / topo.memory_bandwidth[device],
            topo.launch_overhead,
            inverse_bandwidth(np, topo.link_bandwidth[a, b]),
            topo.link_latency[a, b],
        )
        for r in resources:
            clock[r] = start + seconds
        if program.out_slot[i] >= 0:
            finish[program.out_slot[i]] = start + seconds
    return float(clock.max())


def chunk_of_layer(layers) -> list[int]:
    """Chunk of layers ``0..L+1`` for blocks-per-chunk ``layers`` (embedding first, head last)."""
    return [0] + [c for c, n in enumerate(layers) for _ in range(n)] + [len(layers) - 1]


@functools.cache
def fine_program(tensor, policy, p, k, v, schedule, data, zero, overlap, layers):
    """The real transforms' program (symmetry-reduced) and the pipeline transform's step estimates."""
    fn = build_training_step(GPT, MICROBATCH * k * data, optimizer="adam")
    dist = as_distributed(fn)
    if tensor > 1:
        dist = tensor_parallel(dist, tensor, representative_only=True)
    dist = recompute(dist, policy)
    before_pipeline = dist.function
    if p > 1:
        boundaries = tuple(int(x) for x in np.cumsum(layers)[:-1] + 1)
        dist = pipeline_parallel(dist, p, k, schedule=schedule, virtual_stages=v, boundaries=boundaries)
    if data > 1:
        dist = data_parallel(dist, data, overlap=overlap, zero=zero, representative_only=True)
    # The pipeline transform orders steps by 1 + the flops of each chunk and direction.
    chunk = chunk_of_layer(layers)
    flops: dict = {}
    for op in before_pipeline.ops:
        phase = op.attr("phase")
        if phase == "opt":
            continue
        f = (
            get_spec(op.op_type)
            .features(op.attr_dict, tuple(x.type for x in op.inputs), tuple(x.type for x in op.outputs))
            .flops
        )
        key = (chunk[op.attr("layer")], 1 if phase == "bwd" or op.attr("recompute", False) else 0)
        flops.setdefault(key, []).append(float(np.mean(np.asarray(f, np.float64))))
    costs = np.ones((p * v, 2))
    for (c, d), values in flops.items():
        costs[c, d] = 1.0 + sum(values)
    return dist.function, costs


def step_label(chunk, tensor):
    """The coarse group of a fine op: a pipeline step, a chunk's reduction, a stage's update or gather."""

    def label(op):
        if op.op_type == "Send":
            return None
        phase, group = op.attr("phase"), op.attr("group")
        # Data-parallel collectives span replicas (stride p * t); tensor-parallel ones adjacent ranks.
        data_parallel = group is not None and (tensor == 1 or group[1] - group[0] > 1)
        if phase in ("fwd", "bwd") and not data_parallel:
            direction = "B" if phase == "bwd" or op.attr("recompute", False) else "F"
            return ("step", op.attr("chunk", 0), op.attr("microbatch", 0), direction)
        device = op.devices[0]
        if phase == "bwd":
            return ("reduce", chunk[op.attr("layer")]) if op.stream == 1 else ("update", device)
        return ("gather", device) if op.stream == 1 else ("update", device)

    return label


CASES = [
    # tensor, recompute, p, k, v, schedule, data, zero, overlap
    (1, "none", 2, 4, 1, "1f1b", 1, False, False),
    (2, "full", 2, 4, 1, "1f1b", 2, False, False),
    (2, "attention", 2, 4, 1, "1f1b", 2, False, True),
    (2, "none", 2, 4, 1, "1f1b", 2, True, True),
    (1, "none", 2, 4, 1, "1f1b", 2, True, False),
    (1, "none", 2, 4, 2, "interleaved", 2, False, True),
    (1, "attention", 2, 3, 1, "gpipe", 1, False, False),
    (2, "none", 4, 8, 1, "1f1b", 1, False, False),
    (1, "none", 1, 1, 1, "1f1b", 2, False, False),
]


def case_id(case):
    t, rc, p, k, v, schedule, d, zero, overlap = case
    return f"t{t}-{rc}-p{p}k{k}v{v}-{schedule}-d{d}{'-zero' if zero else ''}{'-overlap' if overlap else ''}"


def build(case):
    t, policy, p, k, v, schedule, d, zero, overlap = case
    layers = (GPT.num_layers // (p * v),) * (p * v)
    fine, costs = fine_program(t, policy, p, k, v, schedule, d, zero, overlap, layers)
    coarse = coarsen(fine, step_label(chunk_of_layer(layers), t), topology())
    features = layer_features(GPT, t, policy, [MICROBATCH], topology())
    kwargs = dict(
        pipeline=p,
        microbatches=k,
        data=d,
        virtual_stages=v,
        schedule=schedule,
        zero=zero,
        overlap=overlap,
        layers_per_chunk=layers,
    )
    streams = max(1, fine.num_streams)
    generated = coarse_pipeline_program(features, topology(), step_costs=costs, num_streams=streams, **kwargs)
    return fine, coarse, generated, features, kwargs


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_generated_program_equals_coarsened_fine_program(case):
    _, coarse, generated, _, _ = build(case)
    assert int(generated.num_ops) == int(coarse.num_ops)
    k = coarse.resource.shape[1]  # without a pipeline no op has a second slot
    np.testing.assert_array_equal(generated.resource[:, :k], coarse.resource)
    np.testing.assert_array_equal(generated.slot_device[:, :k], coarse.slot_device)
    assert np.all(generated.resource[:, k:] < 0)
    np.testing.assert_array_equal((generated.dep_slot >= 0).any(axis=1), (coarse.dep_slot >= 0).any(axis=1))
    talks = (np.asarray(coarse.comm_volume) > 0) | (np.asarray(coarse.comm_hops) > 0)
    np.testing.assert_array_equal(generated.link[talks], coarse.link[talks])
    for name in COST_FEATURES:
        np.testing.assert_allclose(
            np.asarray(getattr(generated, name))[0],
            getattr(coarse, name),
            rtol=1e-12,
            atol=1e-9,
            err_msg=name,
        )
    want = simulate64(coarse, topology())
    assert simulate64(generated, topology()) == pytest.approx(want, rel=RTOL)


@pytest.mark.parametrize("case", [c for c in CASES if not c[-1]], ids=case_id)
def test_coarsening_keeps_step_time_and_peak_memory(case):
    """Exact whenever no op of a step waits mid-step (true without overlapped gradient reductions)."""
    fine, coarse, _, _, _ = build(case)
    fine_program_arrays = lower(fine, topology())
    assert int(coarse.num_ops) < int(fine_program_arrays.num_ops)
    step = reference_simulate(fine, topology()).step_time
    assert simulate64(fine_program_arrays, topology()) == pytest.approx(step, rel=RTOL)
    assert simulate64(coarse, topology()) == pytest.approx(step, rel=RTOL)
    np.testing.assert_allclose(coarse.peak_bytes, fine_program_arrays.peak_bytes, rtol=1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if c[-1]], ids=case_id)
def test_coarsening_overlapped_reductions_waits_for_whole_steps(case):
    # A chunk's fused reduction starts when its last backward ends, so overlap hides less.
    fine, coarse, _, _, _ = build(case)
    step = reference_simulate(fine, topology()).step_time
    assert step <= simulate64(coarse, topology()) <= 1.1 * step


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_generated_memory_matches_the_fine_programs(case):
    """The generator replays the fine block's memory events: equal peaks, except with
    gradient overlap (coarse reductions start after a chunk's last backward)."""
    _, coarse, generated, _, kwargs = build(case)
    used = np.asarray(coarse.peak_bytes) > 0
    overlap = kwargs["overlap"] and kwargs["data"] > 1
    np.testing.assert_allclose(
        np.asarray(generated.peak_bytes)[0][used],
        np.asarray(coarse.peak_bytes)[used],
        rtol=0.05 if overlap else 1e-9,
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fast_issue_order_is_close_to_the_transforms(case):
    _, _, generated, features, kwargs = build(case)
    fast = coarse_pipeline_program(features, topology(), **kwargs)
    assert simulate64(fast, topology()) == pytest.approx(simulate64(generated, topology()), rel=0.02)


def test_kernel_agrees_with_float64_on_size_variants():
    sizes = [1, 2, 4]
    features = layer_features(GPT, 2, "attention", sizes, topology())
    program = coarse_pipeline_program(
        features,
        topology(),
        pipeline=2,
        microbatches=4,
        data=2,
        overlap=True,
        zero=True,
        virtual_stages=2,
        schedule="interleaved",
        layers_per_chunk=[1] * 4,
    )
    assert np.asarray(program.flops).shape == (3, int(program.num_ops))
    result = simulate(program, Hardware.from_topology(topology()))
    for s, size in enumerate(sizes):
        want = simulate64(program, topology(), s)
        assert float(result.step_time[s]) == pytest.approx(want, rel=1e-5)
        single = coarse_pipeline_program(
            layer_features(GPT, 2, "attention", [size], topology()),
            topology(),
            pipeline=2,
            microbatches=4,
            data=2,
            overlap=True,
            zero=True,
            virtual_stages=2,
            schedule="interleaved",
            layers_per_chunk=[1] * 4,
        )
        assert simulate64(single, topology()) == pytest.approx(want, rel=RTOL)
        np.testing.assert_allclose(np.asarray(single.peak_bytes)[0], np.asarray(program.peak_bytes)[s])


def test_one_f_one_b_needs_less_memory_than_gpipe():
    features = layer_features(GPT, 1, "none", [MICROBATCH], topology())
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        program = coarse_pipeline_program(
            features, topology(), pipeline=4, microbatches=8, schedule=schedule, layers_per_chunk=[1] * 4
        )
        peaks[schedule] = np.asarray(program.peak_bytes)[0]
    assert peaks["1f1b"][0] < peaks["gpipe"][0]  # the first stage keeps p, not k, microbatches
    assert np.all(peaks["1f1b"] <= peaks["gpipe"])
    # The same ordering in the fine programs the transforms build.
    fine = {
        s: lower(fine_program(1, "none", 4, 8, 1, s, 1, False, False, (1,) * 4)[0], topology()).peak_bytes
        for s in ("gpipe", "1f1b")
    }
    assert fine["1f1b"][0] < fine["gpipe"][0]


def test_recomputation_keeps_less_for_the_backward():
    stash = {
        policy: layer_features(GPT, 1, policy, [MICROBATCH], topology()).net_bytes[1, 0, 0]  # block forward
        for policy in ("none", "attention", "full")
    }
    features = layer_features(GPT, 1, "full", [MICROBATCH], topology())
    assert stash["full"] == features.message_bytes[0]  # only the block's output (the next input) stays
    assert stash["full"] < stash["attention"] < stash["none"]
    # Recomputing costs flops in the backward.
    flops = {
        policy: layer_features(GPT, 1, policy, [MICROBATCH], topology()).step_flops[1, 1, 0]
        for policy in ("none", "full")
    }
    assert flops["full"] > flops["none"]


def test_block_costs_scale_with_the_microbatch():
    topo = topology()
    features = layer_features(GPT, 2, "none", [1, 2, 4], topo)
    f = {name: features.step[1, :, :, i] for i, name in enumerate(COST_FEATURES)}  # block: [direction, S]
    seconds = (
        f["launches"] * topo.launch_overhead
        + f["linear_flops"] / topo.peak_flops[0]
        + f["linear_bytes"] / topo.memory_bandwidth[0]
    )
    np.testing.assert_allclose(features.step_flops[1, :, 1], 2 * features.step_flops[1, :, 0])
    assert np.all(np.diff(seconds, axis=1) > 0)
    assert np.all(f["flops"] == 0) and np.all(f["mem_bytes"] == 0)  # the roofline is split into linear terms
    assert np.all(f["comm_volume"] > 0)  # tensor-parallel all-reduces
    np.testing.assert_array_equal(
        f["comm_hops"], 2 * 2 * (2 - 1)
    )  # per pass: 2 ring all-reduces of 2 (t - 1) hops


@pytest.mark.parametrize(
    "mode, zero", [("none", False), ("sync", True), ("overlap", False), ("overlap_zero", True)]
)
def test_tables_without_step_rows_are_the_rest_of_the_tables(mode, zero):
    features = layer_features(GPT, 2, "none", [1, 2], topology())
    layers = balanced_layers(features, 4)
    data = 1 if mode == "none" else 2
    full = chunk_tables(features, layers, 2, 8, data=data, zero=zero, mode=mode)
    rest = chunk_tables(features, layers, 2, 8, data=data, zero=zero, mode=mode, step_rows=False)
    split = 3 * len(layers) + 1
    np.testing.assert_array_equal(chunk_step_rows(features, layers), full.cost[:, :split])
    np.testing.assert_array_equal(rest.cost, full.cost[:, split:])
    for name in ("alloc", "free", "resident"):
        np.testing.assert_array_equal(getattr(rest, name), getattr(full, name))
    rest.alloc[...] = -1.0  # each call's tables are its own (the shared parts are cached)
    again = chunk_tables(features, layers, 2, 8, data=data, zero=zero, mode=mode)
    np.testing.assert_array_equal(again.alloc, full.alloc)
    with pytest.raises(ValueError, match="step_rows=False"):
        chunk_tables(features, layers, 2, 8, data=2, mode="overlap", segments=True, step_rows=False)


def test_tables_by_mode_are_each_modes_tables():
    features = layer_features(GPT, 2, "attention", [1, 2], topology())
    layers = balanced_layers(features, 4)
    modes = [
        (2, False, "sync"),
        (2, True, "sync"),
        (2, False, "overlap"),
        (2, True, "overlap_zero"),
        (1, False, "none"),
    ]
    for step_rows in (True, False):
        together = chunk_tables_by_mode(features, layers, 2, 8, modes, step_rows=step_rows)
        for (data, zero, mode), got in zip(modes, together, strict=True):
            want = chunk_tables(features, layers, 2, 8, data=data, zero=zero, mode=mode, step_rows=step_rows)
            for name in ("cost", "alloc", "free", "resident"):
                np.testing.assert_array_equal(
                    getattr(got, name), getattr(want, name), err_msg=f"{mode} {name}"
                )
    # Modes differ where they should: ZeRO shards the resident optimizer state.
    assert np.all(together[1].resident < together[0].resident)


def test_mode_rows_expand_to_each_modes_tables():
    features = layer_features(GPT, 2, "full", [1, 2, 4], topology())
    layers = balanced_layers(features, 4)
    modes = [(2, False, "sync"), (2, True, "sync"), (2, False, "overlap"), (2, True, "overlap_zero")]
    modes.append((1, False, "none"))
    rows = mode_rows(features, layers, 2, 8, modes)
    update = slice(3 * len(layers) + 1, 3 * len(layers) + 1 + 2)  # the two stages' update rows
    for i, (data, zero, mode) in enumerate(modes):
        want = chunk_tables(features, layers, 2, 8, data=data, zero=zero, mode=mode, step_rows=False)
        for size in range(3):  # cost rows past the steps do not depend on the microbatch size
            np.testing.assert_array_equal(rows.other[i], want.cost[size], err_msg=f"{mode} cost")
        for name in ("alloc", "free"):
            got = getattr(rows, name).copy()
            got[:, update, 0] += rows.update_extra[i]
            np.testing.assert_array_equal(got, getattr(want, name), err_msg=f"{mode} {name}")
        np.testing.assert_array_equal(rows.resident[i], want.resident, err_msg=f"{mode} resident")
    # Only a synchronous all-reduce adds a transient to the update rows (ZeRO scatters in place).
    assert np.all(rows.update_extra[0] > 0) and np.all(rows.update_extra[1:] == 0)
    assert not rows.alloc.flags.writeable and not rows.free.flags.writeable  # shared by the modes


@pytest.mark.parametrize(
    "model, tensor, per_layer",
    [
        (GPT, 2, False),
        (MLPConfig(num_layers=8, hidden=32, dtype="f32"), 1, False),  # ends are blocks
        (MLPConfig(num_layers=8, hidden=32, dtype="f32"), 2, True),  # per layer
    ],
)
def test_chunkings_prepared_together_equal_one_at_a_time(model, tensor, per_layer):
    # Sizes no other test asks for: features (and chunk tables) of their own.
    features = layer_features(model, tensor, "attention", [3, 5], topology(), per_layer=per_layer)
    chunkings = [tuple(int(x) for x in balanced_layers(features, n)) for n in (4, 1, 2, 3)]
    alone = [coarse_program._chunk_parts_of([(features, c)])[0] for c in chunkings]
    coarse.prepare_chunkings(features, chunkings)
    for c, want in zip(chunkings, alone, strict=True):
        got = coarse_program._chunk_parts(features, c)  # the prepared tables, cached
        assert got.stage_coef is None and not got.steps.flags.writeable
        for name, x, y in [
            ("coef", got.coef, want.coef),
            ("steps", got.steps, want.steps),
            *[(f"fwd {i}", got.fwd[i], want.fwd[i]) for i in range(2)],
            *[(f"bwd {j} {i}", got.bwd[j][i], want.bwd[j][i]) for j in range(2) for i in range(2)],
        ]:
            np.testing.assert_array_equal(x, y, err_msg=f"{c} {name}")
        assert want.steps.shape[1] == 3 * len(c) + 1
    # The first and last chunks hold the embedding and head parts, each chunking's own.
    if not per_layer:
        together = coarse_program._chunk_parts_of([(features, c) for c in chunkings])
        assert [float(x.coef[0, 0]) for x in together] == [1.0] * len(chunkings)
        assert [float(x.coef[-1, 2]) for x in together] == [1.0] * len(chunkings)


def test_the_template_cache_can_be_shared_between_threads():
    import concurrent.futures
    import threading

    from distir_jax.transforms.coarse_pipeline import _BoundedCache

    builds = []
    lock = threading.Lock()

    def build(x):
        with lock:
            builds.append(x)
        return np.full(100, x)

    cache = _BoundedCache(build, lambda value: value.nbytes, max_bytes=5 * 800)  # holds 5: evicts often
    keys = [i % 12 for i in range(3000)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        values = list(pool.map(cache.get, keys))
    for key, value in zip(keys, values, strict=True):
        np.testing.assert_array_equal(value, np.full(100, key))
    assert len(cache.items) <= 5 and cache.held == sum(v.nbytes for v in cache.items.values())
    assert len(builds) >= 12  # every key built at least once (again after an eviction)


def test_taking_variants_equals_measuring_those_sizes_alone():
    topo = topology()
    both = layer_features(GPT, 2, "attention", [1, 2, 4], topo, optimizer="adam")
    alone = layer_features(GPT, 2, "attention", [4, 1], topo, optimizer="adam")
    taken = both.take_variants([2, 0])
    for field in dataclasses.fields(taken):
        got, want = getattr(taken, field.name), getattr(alone, field.name)
        if field.name == "segments":
            for a, b in zip(got, want, strict=True):
                for name in ("cost", "accumulate", "rise", "net"):
                    np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12)
                assert a.grads == b.grads and len(a.updates) == len(b.updates)
        elif isinstance(want, np.ndarray):
            np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=field.name)
        elif field.name != "model":
            assert got == want, field.name
    kwargs = dict(pipeline=2, microbatches=4, data=2, zero=True, overlap=True, overlap_segments=True)
    one, two = (coarse_pipeline_program(f, topo, **kwargs) for f in (taken, alone))
    np.testing.assert_allclose(one.peak_bytes, two.peak_bytes, rtol=1e-12)
    np.testing.assert_allclose(one.linear_flops, two.linear_flops, rtol=1e-12)


@pytest.mark.parametrize("schedule,p,k,v", [("1f1b", 4, 6, 1), ("gpipe", 3, 4, 1), ("interleaved", 2, 8, 2)])
def test_estimated_steps_never_start_before_what_they_wait_for(schedule, p, k, v):
    chunk, mb, backward = schedule_arrays(schedule, p, k, v)
    # Costs whose float sums round (unlike small integers): starts may not be finish - cost.
    costs = np.random.default_rng(7).uniform(0.1, 3.7, size=(p * v, 2)) * 1e9 + 0.123
    start, finish = estimated_times(chunk, mb, backward, p * v, costs[chunk, backward.astype(int)])
    assert np.all(start[:, 1:] >= finish[:, :-1]) and np.all(finish > start)
    at = {
        (int(c), int(m), bool(b)): (s0, f0)
        for c, m, b, s0, f0 in zip(
            chunk.ravel(), mb.ravel(), backward.ravel(), start.ravel(), finish.ravel(), strict=True
        )
    }
    for (c, m, b), (s0, _) in at.items():
        waits = [(c - 1, m, False)] if not b and c > 0 else [(c + 1, m, True)] if b and c < p * v - 1 else []
        waits += [(c, m, False)] if b else []
        assert all(s0 >= at[w][1] for w in waits)


@pytest.mark.parametrize("f,g", [(1, 2), (1, 1), (3, 5), (7, 3)])
def test_one_f_one_b_times_in_closed_form_are_the_relaxations(f, g):
    # 1F1B with uniform integer step costs skips the relaxation when its closed
    # form is confirmed; the closed form itself must be exact for every depth and
    # microbatch count (fewer microbatches than devices too), or it saves nothing.
    from distir_jax.transforms.coarse_schedule import _one_f_one_b_finish

    for p in (1, 2, 3, 5, 8, 13):
        for k in sorted({1, 2, p - 1, p, p + 1, p + 2, 2 * p + 3, 4 * p} - {0}):
            chunk, mb, backward = schedule_arrays("1f1b", p, k)
            cost = np.where(backward, float(g), float(f))
            start, finish = estimated_times(chunk, mb, backward, p, cost)
            guess = _one_f_one_b_finish(mb, backward, cost)
            np.testing.assert_array_equal(guess, finish, err_msg=f"{p=} {k=}")
            fast = estimated_times(chunk, mb, backward, p, cost, schedule="1f1b")
            np.testing.assert_array_equal(fast[0], start)
            np.testing.assert_array_equal(fast[1], finish)
    # Costs that differ by chunk or are not integers have no closed form here.
    chunk, mb, backward = schedule_arrays("1f1b", 4, 6)
    uneven = np.where(backward, 2.0, 1.0 + (chunk == 0))
    assert _one_f_one_b_finish(mb, backward, uneven) is None
    assert _one_f_one_b_finish(mb, backward, np.where(backward, 2.5, 1.0)) is None
    start, finish = estimated_times(chunk, mb, backward, 4, uneven, schedule="1f1b")
    np.testing.assert_array_equal(finish, estimated_times(chunk, mb, backward, 4, uneven)[1])


def test_estimated_times_report_an_order_that_deadlocks():
    # Device 0 runs chunk 0's backward before its forward; device 1 runs chunk 1's
    # forward (which waits for chunk 0's) before its backward (which chunk 0's waits for).
    chunk = np.asarray([[0, 0], [1, 1]])
    mb = np.zeros((2, 2), np.int64)
    backward = np.asarray([[True, False], [False, True]])
    with pytest.raises(ValueError, match="deadlocks"):
        estimated_times(chunk, mb, backward, 2, np.ones((2, 2)))


# (schedule, p, k, v) cases for the array schedule code against the step-by-step one.
SCHEDULE_CASES = [
    ("gpipe", 3, 5, 1),
    ("gpipe", 3, 4, 1),
    ("1f1b", 4, 6, 1),
    ("1f1b", 4, 2, 1),
    ("1f1b", 5, 7, 1),
    ("1f1b", 1, 3, 1),
    ("interleaved", 4, 8, 2),
    ("interleaved", 2, 8, 2),
    ("interleaved", 3, 9, 2),
    ("interleaved", 2, 4, 3),
    ("interleaved", 4, 8, 3),
    ("1f1b", 32, 40, 1),  # deep enough for device-by-device sweeps (estimated_times)
    ("interleaved", 32, 64, 2),
    ("interleaved", 8, 64, 4),  # 8 devices, 512 steps each: device-by-device sweeps too
]


@pytest.mark.parametrize("schedule,p,k,v", SCHEDULE_CASES)
def test_array_schedules_match_the_schedules_module(schedule, p, k, v):
    chunk, mb, backward = schedule_arrays(schedule, p, k, v)
    reference = make_schedule(schedule, p, k, v)
    for s in range(p):
        steps = [Step(int(c), int(m), "B" if b else "F") for c, m, b in zip(chunk[s], mb[s], backward[s])]
        assert steps == list(reference[s])
    rng = np.random.default_rng(p * 100 + k)
    costs = rng.integers(1, 5, size=(p * v, 2)).astype(np.float64)  # integer sums are exact
    start, finish = estimated_times(chunk, mb, backward, p * v, costs[chunk, backward.astype(int)])
    times = schedule_times(reference, p * v, lambda st: costs[st.chunk, int(st.direction == "B")])
    for s in range(p):
        for i in range(chunk.shape[1]):
            assert times[Step(int(chunk[s, i]), int(mb[s, i]), "B" if backward[s, i] else "F")] == (
                start[s, i],
                finish[s, i],
            )


@pytest.mark.parametrize("schedule,p,k,v", SCHEDULE_CASES)
def test_issue_order_is_global_issue_orders(schedule, p, k, v):
    n = p * v
    costs = np.random.default_rng(k).uniform(0.5, 3.0, size=(n, 2))
    template = pipeline_template(p, k, v, schedule, "none", step_costs=costs)
    plan = make_schedule(schedule, p, k, v)
    messages = [(Step(c, m, "F"), Step(c + 1, m, "F"), ("a", c, m)) for c in range(n - 1) for m in range(k)]
    messages += [
        (Step(c, m, "B"), Step(c - 1, m, "B"), ("g", c, m)) for c in range(n - 1, 0, -1) for m in range(k)
    ]
    # The transform's order (array arithmetic) is the step-by-step rule applied to the same times.
    chunk, mb, backward = schedule_arrays(schedule, p, k, v)
    start, finish = estimated_times(chunk, mb, backward, n, costs[chunk, backward.astype(int)])
    times = {
        Step(int(c), int(m), "B" if b else "F"): (s0, f0)
        for c, m, b, s0, f0 in zip(
            chunk.ravel(),
            mb.ravel(),
            backward.ravel(),
            start.ravel().tolist(),
            finish.ravel().tolist(),
            strict=True,
        )
    }
    transform = estimated_issue_order(plan, n, messages, costs)
    assert transform == global_issue_order(plan, n, messages, times)
    want = [tuple(e) if what == "step" else e for what, e in transform]
    names = {0: "F", 1: "B", 2: "a", 3: "g"}
    got = []
    for kind, c, m in zip(template.kind, template.chunk, template.microbatch, strict=True):
        if kind <= 1:
            got.append((int(c), int(m), names[int(kind)]))
        elif kind <= 3:
            got.append((names[int(kind)], int(c), int(m)))
    assert got == want


def test_stage_peak_memory_is_lower_peak_memory():
    features = layer_features(GPT, 1, "attention", [1, 3], topology())
    program = coarse_pipeline_program(
        features,
        topology(),
        pipeline=4,
        microbatches=8,
        data=2,
        zero=True,
        overlap=True,
        layers_per_chunk=[1] * 4,
    )
    want = peak_memory(program.slot_device, program.alloc_bytes, program.free_bytes, program.resident_bytes)
    np.testing.assert_allclose(program.peak_bytes, want, rtol=1e-12)
    template = pipeline_template(4, 8, 1, "1f1b", "overlap_zero")
    stages = stage_peak_memory(
        template, program.alloc_bytes, program.free_bytes, np.asarray(program.resident_bytes)[:, :4]
    )
    np.testing.assert_allclose(stages, np.asarray(program.peak_bytes)[:, :4], rtol=1e-12)


@pytest.mark.parametrize("steady", [False, True])
def test_event_tops_raise_peaks_as_bytes_added_there(steady):
    """``event_stage_peaks(events=...)``: bytes an event allocates and frees besides
    (one event per stage) raise its stage's peak as if they were in its tables."""
    from distir_jax.transforms.coarse_steady import steady_template

    found = steady_template(4, 12, 1, "1f1b", "overlap_zero") if steady else None
    template = found.template if steady else pipeline_template(4, 6, 1, "1f1b", "overlap_zero")
    assert not steady or found is not None
    stages, starts, _ = template.stage_runs
    rng = np.random.default_rng(3)
    rows, num_events = 6, len(template.stage_events[0])
    net = rng.integers(-50, 60, (rows, num_events)).astype(np.float64)
    free = rng.integers(0, 40, (rows, num_events)).astype(np.float64)
    resident = rng.integers(0, 100, (rows, 4)).astype(np.float64)
    periods = np.arange(rows) % 3
    ends = np.append(starts[1:], num_events)
    events = np.asarray([rng.integers(lo, hi) for lo, hi in zip(starts, ends, strict=True)])
    extra = rng.integers(0, 40, (rows, len(events))).astype(np.float64)
    extra[::2] *= 1000  # even rows: the extra bytes set every stage's peak
    raised = free.copy()
    raised[:, events] += extra
    steady_arg = found if steady else None
    want = coarse_program.event_stage_peaks(
        template, net.copy(), raised, resident, steady_arg, extra_periods=periods
    )
    peak, tops = coarse_program.event_stage_peaks(
        template, net.copy(), free.copy(), resident, steady_arg, extra_periods=periods, events=events
    )
    got = peak.copy()
    got[:, stages] = np.maximum(peak[:, stages], resident[:, stages] + tops + extra)
    np.testing.assert_array_equal(got, want)
    assert np.all(want[::2, stages] > peak[::2, stages]) and np.any(want[1::2] == peak[1::2])


@pytest.mark.parametrize("steady", [False, True])
def test_event_peaks_from_whole_byte_counts_in_int64_are_the_same_floats(steady):
    """``event_stage_peaks`` on int64 tables (``exact_integers``, what sweeps pass for
    byte counts): peaks and event tops bit for bit as from float64 ones."""
    from distir_jax.transforms.coarse_steady import steady_template

    found = steady_template(4, 40, 2, "interleaved", "overlap_zero") if steady else None
    template = found.template if steady else pipeline_template(4, 8, 2, "interleaved", "overlap_zero")
    starts = template.stage_runs[1]
    rng = np.random.default_rng(5)
    rows, num_events = 5, len(template.stage_events[0])
    net = rng.integers(-(2**40), 2**40, (rows, num_events)).astype(np.float64)
    free = rng.integers(0, 2**40, (rows, num_events)).astype(np.float64)
    resident = rng.integers(0, 2**45, (rows, 4)).astype(np.float64)
    events = starts[1:] + 1
    whole = coarse_program.exact_integers(net, free)
    assert all(x.dtype == np.int64 for x in whole)
    kwargs = dict(extra_periods=np.arange(rows) % 3 if steady else None, events=events)
    want = coarse_program.event_stage_peaks(template, net.copy(), free.copy(), resident, found, **kwargs)
    got = coarse_program.event_stage_peaks(template, *(x.copy() for x in whole), resident, found, **kwargs)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)


def test_exact_integers_keeps_fractions_and_huge_numbers_as_floats():
    whole, half = np.array([[3.0, -2.0]]), np.array([[1.5, 2.0]])
    assert [x.dtype for x in coarse_program.exact_integers(whole, whole)] == [np.int64, np.int64]
    for other in (half, np.array([[2.0**53, 0.0]])):
        kept = coarse_program.exact_integers(whole, other)
        assert kept[0] is whole and kept[1] is other  # both stay float64: one dtype for the pair


def test_coarsen_rejects_groups_on_different_links():
    # Tensor-parallel all-reduces (inside a node) and data-parallel ones (across nodes) in one group.
    fine, _ = fine_program(2, "none", 2, 4, 1, "1f1b", 2, False, False, (2, 2))
    with pytest.raises(ValueError, match="different links"):
        coarsen(fine, lambda op: "all" if op.op_type != "Send" else None, topology())


def test_coarsen_rejects_groups_that_depend_on_each_other_both_ways():
    b = FunctionBuilder("cycle")
    x = b.input("x", (4, 4))
    a = b.add("Relu", x)
    c = b.add("Relu", a, stream=1)  # another resource, between the two members
    d = b.add("Relu", c)
    fn = b.build(d)
    with pytest.raises(ValueError, match="both ways"):
        coarsen(fn, ["x", None, "x"], Topology.uniform(1))
    assert int(coarsen(fn, ["x", None, "y"], Topology.uniform(1)).num_ops) == 3


def test_coarse_program_checks_its_arguments():
    features = layer_features(GPT, 1, "none", [MICROBATCH], topology())
    with pytest.raises(ValueError, match="layers_per_chunk"):
        coarse_pipeline_program(features, topology(), pipeline=2, microbatches=2, layers_per_chunk=[3, 2])
    with pytest.raises(ValueError, match="devices"):
        coarse_pipeline_program(features, topology(), pipeline=4, microbatches=4, data=8)
    with pytest.raises(ValueError, match="multiple of degree"):
        coarse_pipeline_program(
            features, topology(), pipeline=2, microbatches=3, virtual_stages=2, schedule="interleaved"
        )


@pytest.mark.parametrize("p,k,v", [(1, 3, 1), (2, 4, 1), (4, 8, 2), (3, 6, 2)])
def test_template_size_without_building(p, k, v):
    for mode in DATA_MODES:
        template = pipeline_template(p, k, v, "interleaved" if v > 1 else "1f1b", mode)
        assert template_size(p, k, v, mode) == (template.num_ops, template.num_slots)
        assert template.num_streams == (2 if mode.startswith("overlap") else 1)


def test_mode_sync_tp_syncs_each_stage_on_its_tensor_group_before_its_update():
    """Sequence parallelism without gradient overlap: each stage's LayerNorm
    gradients are all-reduced over its tensor group (an op costed on that
    group's link) before its update all-reduces over the data-parallel group."""
    from distir_jax.transforms.coarse_pipeline import KIND_NAMES, data_mode

    assert data_mode(2, False, True, tensor_syncs=True) == "sync_tp"
    assert data_mode(2, True, True, tensor_syncs=True) == "overlap_zero"
    assert data_mode(1, False, False, tensor_syncs=True) == "none"
    p = 3
    template = pipeline_template(p, 6, 1, "1f1b", "sync_tp")
    plain = pipeline_template(p, 6, 1, "1f1b", "sync")
    names = [KIND_NAMES[k] for k in template.kind]
    assert names[: plain.num_ops - p] == [KIND_NAMES[k] for k in plain.kind[: plain.num_ops - p]]
    assert names[plain.num_ops - p :] == ["tensor_sync", "update"] * p
    ends = slice(plain.num_ops - p, None)
    assert template.stage[ends, 0].tolist() == np.repeat(np.arange(p), 2).tolist()
    assert (template.stream[ends] == 0).all()
    assert template.link_kind[ends].tolist() == [1, 3] * p


def test_balanced_layers_minimize_what_the_pipeline_transform_minimizes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        blocks = int(rng.integers(1, 30))
        chunks = int(rng.integers(1, blocks + 1))
        embed, head = rng.uniform(0.0, 3.0, 2)
        model = TransformerConfig(blocks, 8, 2, 11, 4)
        features = layer_features(model, 1, "none", [1], Topology.uniform(1))
        flops = np.zeros_like(features.step_flops)
        flops[:, 0] = np.array([embed, 1.0, head])[:, None]
        layers = balanced_layers(dataclasses.replace(features, step_flops=flops), chunks)
        costs = [embed] + [1.0] * blocks + [head]
        reference = np.diff((1,) + balanced_boundaries(costs, chunks) + (blocks + 1,))

        assert layers.sum() == blocks and layers.min() >= 1
        np.testing.assert_allclose(_objective(layers, embed, head), _objective(reference, embed, head))


def test_transform_cuts_are_shared_by_costs_a_power_of_two_apart():
    """The pipeline transform's partition is the same for costs scaled by a power of
    two (every sum, square and comparison scales exactly), so the coarse cut is
    cached by the scaled costs: microbatch sizes twice as large share it."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        blocks = int(rng.integers(2, 40))
        chunks = int(rng.integers(1, blocks + 1))
        costs = list(rng.uniform(0.0, 10.0, blocks + 2) * rng.choice([1.0, 1e6, 1e12]))
        scaled = coarse_program._power_of_two_scaled(tuple(costs))
        assert 0.5 <= max(scaled) < 1.0
        cut = balanced_boundaries(costs, chunks)
        for k in (-3, 0, 5):
            assert balanced_boundaries([c * 2.0**k for c in costs], chunks) == cut
        assert balanced_boundaries(list(scaled), chunks) == cut
    model = TransformerConfig(12, 32, 2, 50, 8)
    features = layer_features(model, 1, "full", [1, 2, 3], Topology.uniform(1))
    coarse_program._transform_cut.cache_clear()
    one, two = (coarse_program.transform_layers_per_chunk(features, 5, [b]) for b in (0, 1))
    assert coarse_program._transform_cut.cache_info().misses == 1  # sizes 1 and 2: one cut
    np.testing.assert_array_equal(one, two)
    coarse_program.transform_layers_per_chunk(features, 5, [2])  # size 3: costs 1.5x, another key
    assert coarse_program._transform_cut.cache_info().misses == 2


def _objective(layers, embed, head):
    """What the pipeline transform's partition minimizes: the costliest chunk, then the sum of squares."""
    cost = np.asarray(layers, np.float64).copy()
    cost[0] += embed
    cost[-1] += head
    return cost.max(), (cost**2).sum()
