"""Calibration: fitted factors recover a known hardware from its step times."""

import dataclasses

import numpy as np
import optax
import pytest

import distir_jax as dj
from distir_jax.calibrate import scaled_topology
from distir_jax.testing.strategies import GPT3_175B_COMMON, GPT3_175B_RUNS, SMALL_TRAINING_RUNS, TINY_GPT

# dj.calibration_probes(): programs that each lean on one field (compute, memory,
# link bandwidth, link latency, kernel launches) and a mix of them on two devices.
KINDS = ("matmul", "elementwise", "large_send", "tiny_send", "launches", "mixed")
TRUTH = dict(peak_flops=0.55, memory_bandwidth=0.8, link_bandwidth=0.4, link_latency=3.0, launch_overhead=2.0)


def _function(kind: str) -> dj.Function:
    return dj.calibration_probes()[kind]


def _scaled(topology: dj.Topology, factors: dict) -> dj.Topology:
    changes = {k: np.asarray(getattr(topology, k)) * v for k, v in factors.items()}
    changes["launch_overhead"] = float(changes.get("launch_overhead", topology.launch_overhead))
    return dataclasses.replace(topology, **changes)


@pytest.fixture(scope="module")
def base():
    return dj.get_preset("dgx-a100-80gb:8")


@pytest.fixture(scope="module")
def measured_on_truth(base):
    """Each kind's program (lowered for ``base``) and its step time on the true
    hardware, from the reference simulator (not the kernel being fitted)."""
    truth = _scaled(base, TRUTH)
    functions = [_function(kind) for kind in KINDS]
    programs = [dj.lower(fn, base) for fn in functions]
    return programs, np.asarray([dj.reference_simulate(fn, truth).step_time for fn in functions])


def test_recovers_every_factor(base, measured_on_truth):
    programs, measured = measured_on_truth
    fit = dj.calibrate(programs, measured, base)
    assert set(fit.scales) == set(TRUTH)
    for field, factor in TRUTH.items():
        assert fit.scales[field] == pytest.approx(factor, rel=1e-6), field
    assert fit.unconstrained == ()
    np.testing.assert_allclose(fit.predicted, measured, rtol=1e-9)
    assert np.all(np.abs(fit.initial / measured - 1) > 0.2)  # the nominal numbers were far off
    assert fit.losses[-1] < 1e-20 < fit.losses[0] and len(fit.losses) < 30  # Levenberg-Marquardt
    # The calibrated topology is what it says: the reference simulator agrees on it.
    assert fit.topology.name.endswith("(calibrated)")
    again = [dj.reference_simulate(_function(kind), fit.topology).step_time for kind in KINDS]
    np.testing.assert_allclose(again, measured, rtol=1e-9)
    np.testing.assert_allclose(fit.relative_error, 0.0, atol=1e-9)


@pytest.mark.parametrize(
    "optimizer, steps", [(optax.adam(0.05), 500), (optax.lbfgs(), 60)], ids=["adam", "lbfgs"]
)
def test_any_optax_optimizer(base, measured_on_truth, optimizer, steps):
    programs, measured = measured_on_truth
    fit = dj.calibrate(programs, measured, base, optimizer=optimizer, steps=steps)
    assert len(fit.losses) == steps and fit.losses[-1] < 1e-9
    for field, factor in TRUTH.items():
        assert fit.scales[field] == pytest.approx(factor, rel=1e-3), field


def test_fields_not_measured_are_unconstrained(base):
    truth = _scaled(base, TRUTH)
    functions = [_function(kind) for kind in ("matmul", "elementwise", "launches")]  # one device, no message
    measured = [dj.reference_simulate(fn, truth).step_time for fn in functions]
    fit = dj.calibrate([dj.lower(fn, base) for fn in functions], measured, base)
    assert set(fit.unconstrained) == {"link_bandwidth", "link_latency"}
    assert fit.scales["link_bandwidth"] == fit.scales["link_latency"] == 1.0
    for field in ("peak_flops", "memory_bandwidth", "launch_overhead"):
        assert fit.scales[field] == pytest.approx(TRUTH[field], rel=1e-6)


def test_chosen_fields_and_optimizer(base, measured_on_truth):
    programs, measured = measured_on_truth
    # The optimizer given is the one used: a zero learning rate moves nothing.
    still = dj.calibrate(programs, measured, base, optimizer=optax.adam(0.0), steps=3)
    assert still.scales == dict.fromkeys(still.scales, 1.0)
    np.testing.assert_array_equal(still.predicted, still.initial)
    # Only the compute factor, by plain SGD: it fits the matmul's time exactly, a
    # little below the true 0.55 (it also absorbs the launches' doubled overhead).
    one = dj.calibrate(
        programs[:1], measured[:1], base, fields=["peak_flops"], optimizer=optax.sgd(0.5), steps=150
    )
    assert list(one.scales) == ["peak_flops"]
    np.testing.assert_allclose(one.predicted, measured[:1], rtol=1e-9)
    assert 0.5 < one.scales["peak_flops"] < TRUTH["peak_flops"]


def test_smooth_calibration_lands_near_the_exact_one(base, measured_on_truth):
    programs, measured = measured_on_truth
    fit = dj.calibrate(programs, measured, base, temperature=1e-9)
    for field, factor in TRUTH.items():
        assert fit.scales[field] == pytest.approx(factor, rel=1e-2), field


def test_size_variants_are_measurements(base):
    b = dj.FunctionBuilder("variants")
    y = b.add("MatMul", b.input("x", (np.array([1024, 4096]), 4096)), b.input("w", (4096, 4096)))
    program = dj.lower(b.build(y), base)
    truth = _scaled(base, {"peak_flops": 0.5})
    measured = [dj.simulate(program, dj.Hardware.from_topology(truth)).step_time[i] for i in range(2)]
    fit = dj.calibrate([program], measured, base, fields="peak_flops")
    assert fit.scales["peak_flops"] == pytest.approx(0.5, rel=1e-4)
    with pytest.raises(ValueError, match="one per variant"):
        dj.calibrate([program], measured[:1], base)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(programs=[]), "at least one program"),
        (dict(measured=[1e-3]), r"2 in all, got shape \(1,\)"),
        (dict(measured=[1e-3, 0.0]), "positive and finite, got 0.0 at index 1"),
        (dict(measured=[1e-3, float("nan")]), "positive and finite, got nan at index 1"),
        (dict(fields=["peak_flop"]), r"unknown \['peak_flop'\]"),
        (dict(fields=[]), "at least one"),
        (dict(fields=["peak_flops", "peak_flops"]), "distinct"),
        (
            dict(topology=dj.Topology.uniform(8), fields=["link_latency"]),
            "0 everywhere in topology 'uniform'",
        ),
        (dict(topology=dj.Topology.uniform(1)), "lowered for up to 8 devices but topology 'uniform' has 1"),
        (dict(steps=0), "steps must be an int >= 1"),
        (dict(optimizer="adam"), "optax.GradientTransformation, got str"),
    ],
)
def test_bad_input_is_named(base, kwargs, message):
    programs = [dj.lower(_function(kind), base) for kind in ("matmul", "large_send")]
    args = dict(programs=programs, measured=[1e-3, 1e-3], topology=base) | kwargs
    with pytest.raises(ValueError, match=message):
        dj.calibrate(args.pop("programs"), args.pop("measured"), args.pop("topology"), **args)


def test_a_program_that_takes_no_time_is_named(base):
    b = dj.FunctionBuilder("empty")
    x = b.input("x", (4,))
    programs = [dj.lower(_function("matmul"), base), dj.lower(b.build(x), base)]
    with pytest.raises(ValueError, match="program 1 simulates in 0 s"):
        dj.calibrate(programs, [1e-3, 1e-3], base)


def test_programs_for_fewer_devices_use_the_first_ones(base):
    # Lowered for a 2-device cluster, measured on devices 0 and 1 of the 8-device one.
    functions = [_function(kind) for kind in ("large_send", "matmul")]
    truth = _scaled(base, {"link_bandwidth": 0.4, "peak_flops": 0.55})
    measured = [dj.reference_simulate(fn, truth).step_time for fn in functions]
    programs = [dj.lower(fn, dj.Topology.uniform(2)) for fn in functions]
    fit = dj.calibrate(programs, measured, base, fields=["link_bandwidth", "peak_flops"])
    assert fit.scales == pytest.approx({"link_bandwidth": 0.4, "peak_flops": 0.55}, rel=1e-6)
    assert fit.topology.num_devices == base.num_devices


@pytest.fixture
def registry(monkeypatch):
    """The preset registries, restored after the test."""
    from distir_jax import presets

    monkeypatch.setattr(presets, "PRESETS", dict(presets.PRESETS))
    monkeypatch.setattr(presets, "_NODES", dict(presets._NODES))
    return presets


def test_calibrated_preset_is_the_calibrated_topology(base, registry):
    dj.register_calibrated_preset("a100-measured", "dgx-a100-80gb", TRUTH)
    assert "a100-measured" in dj.preset_names()
    for count in (8, 16):
        nominal, calibrated = dj.get_preset(f"dgx-a100-80gb:{count}"), dj.get_preset(f"a100-measured:{count}")
        expected = _scaled(nominal, TRUTH)
        off_diagonal = ~np.eye(count, dtype=bool)  # self-links carry nothing
        for field in ("peak_flops", "memory_bandwidth", "memory_capacity", "launch_overhead"):
            np.testing.assert_allclose(getattr(calibrated, field), getattr(expected, field), rtol=1e-15)
        for field in ("link_bandwidth", "link_latency"):
            np.testing.assert_allclose(
                getattr(calibrated, field)[off_diagonal], getattr(expected, field)[off_diagonal], rtol=1e-15
            )
        np.testing.assert_array_equal(calibrated.node_of_device, nominal.node_of_device)
    assert dj.get_preset("a100-measured", num_nodes=2, dtype="f32").num_devices == 16


def test_sweeps_name_a_calibrated_preset(registry):
    from search import StrategySpace, evaluate

    dj.register_calibrated_preset("a100-slow", "dgx-a100-80gb", {"peak_flops": 0.5, "link_bandwidth": 0.5})
    space = StrategySpace(model="mlp-xs", world_sizes=(2, 4), global_batch_sizes=(64,), microbatches=(2,))
    nominal = evaluate(space, progress=False)
    slow = evaluate(space.replace(hardware=("a100-slow",)), progress=False)
    ok = nominal["status"] == "ok"
    assert ok.any() and np.array_equal(slow["status"], nominal["status"])
    assert np.all(slow["step_time_s"][ok] > nominal["step_time_s"][ok])
    assert set(slow["hardware"]) == {"a100-slow"}
    # MFU is measured against the datasheet's peak, not the calibrated one: slower
    # steps, the same model FLOPs, a lower utilization (a chain of calibrations too).
    assert registry.datasheet_peak_flops("a100-slow:4", "bf16") == registry.datasheet_peak_flops(
        "dgx-a100-80gb", "bf16"
    )
    dj.register_calibrated_preset("a100-slower", "a100-slow", {"peak_flops": 0.5})
    assert registry.datasheet_peak_flops("a100-slower", "f32") == registry.datasheet_peak_flops(
        "dgx-a100-80gb", "f32"
    )
    ratio = nominal["step_time_s"][ok] / slow["step_time_s"][ok]
    np.testing.assert_allclose(slow["mfu"][ok], nominal["mfu"][ok] * ratio, rtol=1e-12)


@pytest.mark.parametrize(
    "name, base_name, scales, message",
    [
        ("dgx-h100", "dgx-a100-80gb", {}, "'dgx-h100' is already registered"),
        ("a:b", "dgx-a100-80gb", {}, "without ':'"),
        ("x", "dgx-a100", {}, "unknown base preset 'dgx-a100'"),
        ("x", "dgx-a100-80gb", {"memory_capacity": 2.0}, r"unknown field\(s\) \['memory_capacity'\]"),
        (
            "x",
            "dgx-a100-80gb",
            {"peak_flops": 0.0},
            r"scales\['peak_flops'\] must be a positive finite number",
        ),
    ],
)
def test_bad_calibrated_preset_is_named(registry, name, base_name, scales, message):
    with pytest.raises(ValueError, match=message):
        dj.register_calibrated_preset(name, base_name, scales)
    assert name not in registry.PRESETS or name == "dgx-h100"


NETWORK_TRUTH = dict(TRUTH, network_bandwidth=0.25, network_latency=1.5)


def _scaled_by_fabric(topology: dj.Topology, factors: dict) -> dj.Topology:
    """``_scaled``, the links between nodes by the network factors instead."""
    within = {f: v for f, v in factors.items() if not f.startswith("network_")}
    scaled, nodes = _scaled(topology, within), topology.node_of_device
    between = nodes[:, None] != nodes[None, :]
    changes = {}
    for x in ("bandwidth", "latency"):
        table = np.asarray(getattr(topology, f"link_{x}"))
        factor = np.where(between, factors[f"network_{x}"], factors[f"link_{x}"])
        changes[f"link_{x}"] = table * factor
    return dataclasses.replace(scaled, **changes)


def test_recovers_the_network_apart_from_the_links_within_a_node():
    """Two DGX A100 nodes whose InfiniBand reaches another share of its datasheet
    than NVSwitch: the probes with sends across nodes recover all seven factors;
    one factor for every link cannot fit them."""
    base = dj.get_preset("dgx-a100-80gb:16")
    functions = list(dj.calibration_probes(network_peer=8).values())
    truth = _scaled_by_fabric(base, NETWORK_TRUTH)
    measured = np.asarray([dj.reference_simulate(fn, truth).step_time for fn in functions])
    programs = [dj.lower(fn, base) for fn in functions]
    fit = dj.calibrate(programs, measured, base, fields=dj.CALIBRATABLE_FIELDS)
    assert fit.scales == pytest.approx(NETWORK_TRUTH, rel=1e-6)
    assert fit.unconstrained == () == fit.weakly_determined
    np.testing.assert_allclose(fit.predicted, measured, rtol=1e-9)
    again = [dj.reference_simulate(fn, fit.topology).step_time for fn in functions]
    np.testing.assert_allclose(again, measured, rtol=1e-9)
    # By default the network is not fitted apart: every link gets link_*'s factor.
    default = dj.calibrate(programs, measured, base)
    assert set(default.scales) == set(TRUTH)
    assert np.max(np.abs(default.relative_error)) > 0.2


def test_network_factors_scale_the_links_between_nodes_only(registry):
    dj.register_calibrated_preset("a100-two-fabrics", "dgx-a100-80gb", NETWORK_TRUTH)
    off_diagonal = ~np.eye(16, dtype=bool)  # self-links carry nothing
    nominal = dj.get_preset("dgx-a100-80gb:16")
    expected = _scaled_by_fabric(nominal, NETWORK_TRUTH)
    for calibrated in (dj.get_preset("a100-two-fabrics:16"), scaled_topology(nominal, NETWORK_TRUTH)):
        for field in ("link_bandwidth", "link_latency"):
            np.testing.assert_allclose(
                getattr(calibrated, field)[off_diagonal], getattr(expected, field)[off_diagonal], rtol=1e-15
            )
    # A network factor alone leaves the links within a node as they are.
    alone = scaled_topology(nominal, {"network_bandwidth": 0.5})
    np.testing.assert_array_equal(alone.link_bandwidth[:8, :8], nominal.link_bandwidth[:8, :8])
    np.testing.assert_array_equal(alone.link_bandwidth[:8, 8:], 0.5 * nominal.link_bandwidth[:8, 8:])


def test_network_fields_need_links_between_nodes(base, measured_on_truth):
    programs, measured = measured_on_truth
    with pytest.raises(ValueError, match=r"\['network_latency'\] are 0 everywhere .*one node"):
        dj.calibrate(programs, measured, base, fields=("link_latency", "network_latency"))
    with pytest.raises(ValueError, match="network_peer must be None or a device index >= 1, got 0"):
        dj.calibration_probes(network_peer=0)


def test_single_server_calibrated_preset_has_one_node(registry):
    dj.register_calibrated_preset("v100-measured", "v100-pcie-4", {"peak_flops": 0.7})
    assert dj.get_preset("v100-measured").peak_flops[0] == pytest.approx(0.7 * 14e12)  # f32, as the base
    with pytest.raises(ValueError, match="num_nodes must be 1"):
        dj.get_preset("v100-measured", num_nodes=2)


@pytest.mark.parametrize("engine", ["fast", "exact"])
def test_calibrate_configs_from_measured_training_steps(registry, engine):
    from search import calibrate_configs, make_config, simulate_config

    knobs = [dict(model=TINY_GPT, **k) for k in SMALL_TRAINING_RUNS] + [
        dict(model="mlp-xs", batch_size=64, data=4)
    ]
    dj.register_calibrated_preset("a100-truth", "dgx-a100-80gb", TRUTH)
    # "Measured": the exact engine's step times of the same strategies on the true hardware.
    measured = [simulate_config(make_config(hardware="a100-truth", **k)).row["step_time_s"] for k in knobs]
    fit = calibrate_configs([make_config(**k) for k in knobs], measured, engine=engine)
    assert fit.scales == pytest.approx(TRUTH, rel=1e-6)
    np.testing.assert_allclose(fit.predicted, measured, rtol=1e-9)
    assert fit.topology.num_devices == 8  # the largest configuration's cluster


def test_coarse_calibration_predicts_the_fine_programs_step_times(registry):
    """Measurements no figures meet exactly (the truth's times, off by up to 5%):
    whatever round the coarse fit stops at, its predicted step times are the fine
    programs' own on its figures."""
    from distir_jax.calibrate import step_times_on
    from search import calibrate_configs, make_config, simulate_config
    from search.single import fine_program

    knobs = [*SMALL_TRAINING_RUNS, dict(batch_size=32, tensor=4, recompute="full")]
    dj.register_calibrated_preset("a100-noisy-truth", "dgx-a100-80gb", TRUTH)
    exact = [
        simulate_config(make_config(TINY_GPT, hardware="a100-noisy-truth", **k)).row["step_time_s"]
        for k in knobs
    ]
    measured = np.asarray(exact) * (1 + np.array([0.05, -0.03, 0.02, -0.05, 0.04, -0.01]))
    configs = [make_config(TINY_GPT, **k) for k in knobs]
    fit = calibrate_configs(configs, measured)
    fine = step_times_on([fine_program(c) for c in configs], fit.topology)
    np.testing.assert_allclose(fit.predicted, fine, rtol=1e-9)
    assert np.max(np.abs(fit.relative_error)) < 0.06


def test_coarse_calibration_of_gpt3_runs_refits_until_exact(registry):
    """Six GPT-3 175B runs on 64 GPUs, fitted on their coarse programs (thousands of
    ops, built in milliseconds; the fine ones have ~1e6 ops and take minutes).
    Programs whose fine ops are split into compute- and memory-bound by the
    nominal figures stop short of the truth; measuring the blocks again on the
    fitted figures and refitting lands on it. The links between the eight nodes
    reach another share of their figures than those within a node."""
    from search import calibrate_configs, evaluate, make_config
    from search._fast import FastEngine

    truth = dict(peak_flops=0.55, memory_bandwidth=0.8, link_bandwidth=0.4, network_bandwidth=0.7)
    dj.register_calibrated_preset("a100-gpt3-truth", "dgx-a100-80gb", truth)
    common, knobs = GPT3_175B_COMMON, GPT3_175B_RUNS
    # "Measured": a sweep's rows on the true hardware (the sweep's fast engine equals
    # the exact engine to ~1e-9, tests/test_search_fast.py).
    truth_rows = evaluate(
        [make_config("gpt3-175b", hardware="a100-gpt3-truth", **common, **k) for k in knobs], progress=False
    )
    measured = np.asarray(truth_rows["step_time_s"], np.float64)
    configs = [make_config("gpt3-175b", **common, **k) for k in knobs]
    fit = calibrate_configs(configs, measured, fields=tuple(truth))
    assert fit.scales == pytest.approx(truth, rel=1e-8)
    np.testing.assert_allclose(fit.predicted, measured, rtol=1e-9)
    assert np.all(fit.initial / measured - 1 < -0.3)  # the nominal figures were far off
    # One fit of the programs measured on the nominal figures is 0.1-0.7% off.
    engine = FastEngine(configs)
    first = dj.calibrate(
        [engine.long_program(c) for c in configs], measured, configs[0].topology(), fields=tuple(truth)
    )
    assert max(abs(first.scales[f] / truth[f] - 1) for f in truth) > 1e-3


def test_fields_the_step_times_barely_depend_on_are_flagged(base, measured_on_truth):
    programs, measured = measured_on_truth
    assert dj.calibrate(programs, measured, base).weakly_determined == ()
    # Only a 256 MB Send depends on the links: its time alone cannot tell latency
    # from bandwidth (and latency is ~0.3% of it).
    b = dj.FunctionBuilder("huge_send")
    huge = b.build(b.add("Send", b.input("x", (8192, 8192)), to=1))
    kinds = ("matmul", "elementwise", "launches")
    functions = [huge] + [_function(kind) for kind in kinds]
    truth = _scaled(base, TRUTH)
    fit = dj.calibrate(
        [dj.lower(fn, base) for fn in functions],
        [dj.reference_simulate(fn, truth).step_time for fn in functions],
        base,
    )
    assert fit.weakly_determined == ("link_bandwidth", "link_latency")
    assert fit.unconstrained == ()
    np.testing.assert_allclose(fit.relative_error, 0.0, atol=1e-9)  # a fit, just not a unique one


def test_calibration_restarts_from_initial_scales(base, measured_on_truth):
    programs, measured = measured_on_truth
    fit = dj.calibrate(programs, measured, base)
    again = dj.calibrate(programs, measured, base, initial_scales=fit.scales)
    assert again.scales == pytest.approx(TRUTH, rel=1e-9)
    assert len(again.losses) <= 2  # it starts at the minimum
    np.testing.assert_allclose(again.initial, fit.initial)  # still the nominal figures' times
    cases = [
        ({"memory_capacity": 2.0}, r"\['memory_capacity'\] are not among the fitted fields"),
        ({"peak_flops": 0.0}, r"initial_scales\['peak_flops'\] must be a number in \[1e-06, 1000\]"),
        ({"peak_flops": 2e3}, "must be a number in"),
        ({"peak_flops": float("nan")}, "must be a number in"),
        ([("peak_flops", 0.5)], "must map field names to factors, got list"),
    ]
    for start, message in cases:
        with pytest.raises(ValueError, match=message):
            dj.calibrate(programs, measured, base, initial_scales=start)


def test_calibrate_configs_errors(registry):
    from search import calibrate_configs, make_config

    ok = make_config("mlp-xs", batch_size=64, data=2)
    cases = [
        ([], "at least one configuration"),
        ([ok, make_config("mlp-xs", batch_size=3, data=2)], "configuration 1 .* is invalid: "),
        ([ok, make_config("mlp-xs", batch_size=64, data=2, hardware="dgx-h100")], "one hardware"),
        ([ok, make_config("mlp-xs", batch_size=64, data=2, dtype="f16")], "one dtype"),
        (
            [ok, make_config("mlp-xs", batch_size=64, data=2, hardware="dgx-a100-80gb:16")],
            "not the first devices",
        ),
    ]
    for configs, message in cases:
        with pytest.raises(ValueError, match=message):
            calibrate_configs(configs, [1e-3] * len(configs))
    with pytest.raises(ValueError, match=r"engine must be one of \['fast', 'exact'\], got 'fine'"):
        calibrate_configs([ok], [1e-3], engine="fine")
    with pytest.raises(ValueError, match="initial_scales is not an option"):
        calibrate_configs([ok], [1e-3], initial_scales={"peak_flops": 2.0})


def test_calibration_file_round_trip(tmp_path, registry, monkeypatch):
    path = tmp_path / "a100.json"
    dj.save_calibration(path, "a100-file", "dgx-a100-80gb", TRUTH)
    expected = dj.get_preset("a100-file:16")
    # Another process: the registries as they start.
    monkeypatch.setattr(registry, "PRESETS", {k: v for k, v in registry.PRESETS.items() if k != "a100-file"})
    monkeypatch.setattr(registry, "_NODES", {k: v for k, v in registry._NODES.items() if k != "a100-file"})
    assert "a100-file" not in dj.preset_names()
    assert dj.load_calibration(path) == "a100-file"
    assert dj.load_calibration(path) == "a100-file"  # again: nothing changes
    loaded = dj.get_preset("a100-file:16")
    for field in ("peak_flops", "memory_bandwidth", "link_bandwidth", "link_latency", "launch_overhead"):
        np.testing.assert_array_equal(getattr(loaded, field), getattr(expected, field))


def test_bad_calibration_files_are_named(tmp_path, registry):
    import json

    def write(name, content):
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return path

    good = dict(format="distir-jax calibrated preset", version=1, name="x1", base="dgx-a100-80gb", scales={})
    cases = [
        (tmp_path / "missing.json", "missing.json"),
        (write("text.json", "not json"), "Expecting value"),
        (write("keys.json", good | {"extra": 1}), "expected a JSON object with keys"),
        (write("version.json", good | {"version": 2}), "version 2"),
        (write("scales.json", good | {"scales": {"peak_flops": -1}}), "positive finite"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            dj.load_calibration(path)
    dj.register_calibrated_preset("x2", "dgx-a100-80gb", {"peak_flops": 0.5})
    with pytest.raises(ValueError, match="clash.json.*'x2' is already registered"):
        dj.load_calibration(write("clash.json", good | {"name": "x2"}))


def test_measured_sweep_rows_calibrate_their_preset(tmp_path, registry):
    """The workflow: run some strategies of a sweep, add their measured step times
    to its results file's rows, calibrate the preset from that file."""
    from lab_measurements import lab_rows, write_measurements

    from search import calibrate_configs
    from search.calibration import read_measurements

    dj.register_calibrated_preset("a100-true", "dgx-a100-80gb", TRUTH)
    rows = lab_rows(tmp_path / "true.csv", "a100-true")
    picked = rows[:: len(rows) // 8][:8]  # every layout: 1 to 4 GPUs, d, t and p
    path = write_measurements(tmp_path / "measured.csv", picked, hardware="dgx-a100-80gb")
    configs, measured = read_measurements(path)
    assert [c.hardware for c in configs] == ["dgx-a100-80gb"] * 8
    assert {(c.data, c.tensor, c.pipeline) for c in configs} >= {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)}
    fit = calibrate_configs(configs, measured)
    assert fit.scales == pytest.approx(TRUTH, rel=1e-6)


def test_bad_measurements_are_named(tmp_path):
    import csv

    from lab_measurements import write_measurements as file

    from search import StrategySpace, evaluate
    from search.calibration import read_measurements

    space = StrategySpace(model="mlp-xs", world_sizes=(2,), global_batch_sizes=(64,), microbatches=(2,))
    evaluate(space, progress=False).to_csv(tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))[:2]
    cases = [
        (tmp_path / "none.csv", "No such file"),
        (file(tmp_path / "a.csv", rows, measured_from="model"), r"line 2: measured_step_time_s='mlp-xs'"),
        (file(tmp_path / "b.csv", rows, data="two"), r"line 2: data='two' is not a int"),
        (file(tmp_path / "c.csv", rows, model="gpt-9"), "line 2: unknown model"),
        (file(tmp_path / "d.csv", rows, global_batch_size="3"), "line 2: invalid configuration: "),
    ]
    (tmp_path / "e.csv").write_text("model,hardware\nmlp-xs,dgx-a100-80gb\n")
    cases.append((tmp_path / "e.csv", r"expected a header with columns \['world_size'"))
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            read_measurements(path)


def test_a_factor_the_fit_drives_to_zero_stays_fitted():
    """Measured without launch overheads: the fit takes that factor to ~0, where
    nothing depends on it any more; it is fitted, not unconstrained (reset to 1)."""
    nominal = dj.Topology.uniform(1)
    truth = dataclasses.replace(nominal, launch_overhead=0.0, peak_flops=nominal.peak_flops * 0.5)

    def matmul(rows):
        b = dj.FunctionBuilder("mm")
        return b.build(b.add("MatMul", b.input("x", (rows, 4096)), b.input("w", (4096, 4096))))

    measured = [dj.reference_simulate(matmul(n), truth).step_time for n in (512, 4096)]
    programs = [dj.lower(matmul(n), nominal) for n in (512, 4096)]
    fit = dj.calibrate(programs, measured, nominal, fields=["peak_flops", "launch_overhead"])
    assert fit.unconstrained == ()
    assert fit.scales["peak_flops"] == pytest.approx(0.5, rel=1e-6) and fit.scales["launch_overhead"] < 1e-3
    np.testing.assert_allclose(fit.predicted, measured, rtol=1e-6)


def test_the_probes_lean_each_on_its_own_field(base):
    """Each probe's step time moves with its own figure far more than with the others."""
    probes = dj.calibration_probes()
    assert list(probes) == list(KINDS)
    own = dict(matmul="peak_flops", elementwise="memory_bandwidth", large_send="link_bandwidth")
    own |= dict(tiny_send="link_latency", launches="launch_overhead")
    for kind, field in own.items():
        nominal = dj.reference_simulate(probes[kind], base).step_time
        moved = {
            f: abs(dj.reference_simulate(probes[kind], _scaled(base, {f: 2.0})).step_time / nominal - 1)
            for f in TRUTH
        }
        assert max(moved, key=moved.get) == field and moved[field] > 0.3, (kind, moved)


def test_measurements_file_errors_name_the_line(tmp_path):
    from search.calibration import MEASURED_COLUMN, read_measurements

    header = "model,hardware,world_size,global_batch_size,seq_len,data,tensor,pipeline,microbatches,"
    header += "schedule,virtual_stages,recompute,zero,sequence_parallel,overlap_grad_comm,dtype,optimizer,"
    header += MEASURED_COLUMN
    row = "mlp-xs,dgx-a100-80gb,2,64,0,2,1,1,1,1f1b,1,none,False,False,False,f32,sgd,"
    path = tmp_path / "m.csv"
    # A spreadsheet's byte order mark before the header is no column name.
    path.write_text("\ufeff" + header + "\n" + row + "0.01\n", encoding="utf-8")
    configs, measured = read_measurements(path)
    assert len(configs) == 1 and measured.tolist() == [0.01]
    for seconds in ("0", "-0.1", "nan", "inf"):
        path.write_text(header + "\n" + row + "0.01\n" + row + seconds + "\n")
        with pytest.raises(
            ValueError, match=rf"m.csv, line 3: {MEASURED_COLUMN}=.* is not a positive number"
        ):
            read_measurements(path)
    path.write_text(header + "\n" + row.replace("dgx-a100-80gb,2", "dgx-a100-80gb:1,2") + "0.01\n")
    with pytest.raises(
        ValueError, match="m.csv, line 2: world_size=2 needs 2 devices; hardware .dgx-a100-80gb:1. has 1"
    ):
        read_measurements(path)
    path.write_bytes(b"\xff\xfe" + header.encode("utf-16-le"))
    with pytest.raises(ValueError, match="m.csv' is not UTF-8 text"):
        read_measurements(path)


def test_calibrate_input_errors_name_the_argument(base, measured_on_truth):
    from distir_jax.calibrate import scaled_topology, step_times_on

    programs, measured = measured_on_truth
    cases = [
        (lambda: dj.calibrate(programs[0], measured[:1], base), TypeError, "programs must be a sequence"),
        (lambda: dj.calibrate(programs, ["a"] * len(programs), base), ValueError, "measured must be numbers"),
        (
            lambda: dj.calibrate(programs, [True] * len(programs), base),
            ValueError,
            "measured must be numbers",
        ),
        (lambda: dj.calibrate(programs, {"a": 1.0}, base), ValueError, "measured must be numbers"),
        (lambda: dj.calibrate(programs, measured, base, fields=3), ValueError, "fields must be a field name"),
        (lambda: dj.calibrate(programs, measured, base, temperature="x"), ValueError, "temperature must be"),
        (lambda: scaled_topology(base, {"foo": 2.0}), ValueError, r"unknown field\(s\) \['foo'\]"),
        (lambda: scaled_topology(base, {"peak_flops": -1.0}), ValueError, "positive finite"),
        (lambda: step_times_on(programs, dj.get_preset("dgx-a100-80gb:1")), ValueError, "up to 8 devices"),
        (
            lambda: dj.calibrate(programs, measured, base, optimizer=optax.adam(float("nan")), steps=3),
            ValueError,
            "the optimizer produced non-finite factors",
        ),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()
    # A 0-d array is a number.
    fit = dj.calibrate(programs, measured, base, initial_scales={"peak_flops": np.array(0.55)})
    assert fit.scales["peak_flops"] == pytest.approx(0.55, rel=1e-9)


def test_coarse_rounds_do_not_call_a_field_the_nominal_figures_depend_on_unconstrained(registry):
    """One data-parallel step of a small model: at the fitted figures every fine op
    is memory-bound, so the last round's coarse programs do not depend on peak
    FLOP/s; the nominal figures' programs did. Not unconstrained: weakly determined."""
    from distir_jax.models import TransformerConfig
    from search import calibrate_configs, make_config, simulate_config

    tiny = TransformerConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=512, seq_len=64)
    dj.register_calibrated_preset("a100-one-truth", "dgx-a100-80gb", TRUTH)
    knobs = dict(batch_size=8, data=8)
    measured = [simulate_config(make_config(tiny, hardware="a100-one-truth", **knobs)).row["step_time_s"]]
    fit = calibrate_configs([make_config(tiny, **knobs)], measured)
    assert "peak_flops" not in fit.unconstrained
    assert "peak_flops" in fit.weakly_determined  # one measurement, five figures: all of them, in fact
    np.testing.assert_allclose(fit.predicted, measured, rtol=1e-9)


def test_a_fit_stalled_at_a_kink_goes_on_through_the_smoothed_timeline(registry):
    """Six small-model steps whose exact Gauss-Newton fit stops at a kink 0.4% short
    (factors up to 80% off); from a fit of the smoothed timeline it lands."""
    from distir_jax.models import TransformerConfig
    from search import calibrate_configs, make_config, simulate_config

    tiny = TransformerConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=512, seq_len=64)
    knobs = [
        dict(batch_size=8),
        dict(batch_size=8, data=2),
        dict(batch_size=16, data=4, tensor=2),
        dict(batch_size=32, data=2, tensor=4, pipeline=2, microbatches=4),
        dict(batch_size=64, data=8, tensor=2, world_size=16),
        dict(batch_size=64, data=4, pipeline=4, microbatches=8, world_size=16),
    ]
    dj.register_calibrated_preset("a100-kink-truth", "dgx-a100-80gb", TRUTH)
    measured = [
        simulate_config(make_config(tiny, hardware="a100-kink-truth", **k)).row["step_time_s"] for k in knobs
    ]
    fit = calibrate_configs([make_config(tiny, **k) for k in knobs], measured, engine="exact")
    # The stall was 0.4% off; landed, the least determined figure (memory bandwidth)
    # is within ~1.5e-8 of the truth.
    assert fit.scales == pytest.approx(TRUTH, rel=1e-7)
    np.testing.assert_allclose(fit.predicted, measured, rtol=1e-9)
