"""Bad input to the IR, the kernel and the reference simulator: a clear error
naming what is wrong, never a wrong number or an error from deep inside."""

import dataclasses

import numpy as np
import pytest

import distir_jax as dj


def _matmul(topology_devices: int = 1):
    b = dj.FunctionBuilder("mm")
    y = b.add("MatMul", b.input("x", (64, 64)), b.input("w", (64, 64)))
    return b.build(y)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(peak_flops=0.0), "peak_flops must be finite and > 0 for every device, got 0.0 for device 0"),
        (dict(memory_bandwidth=0.0), "memory_bandwidth must be finite and > 0"),
        (dict(peak_flops=[1e12, np.nan]), "got nan for device 1"),
        (dict(launch_overhead=float("nan")), "launch_overhead must be a finite number >= 0, got nan"),
        (dict(memory_capacity=[1e9, 1e9, 1e9]), r"memory_capacity must be a number or \[2\] numbers"),
        (dict(link_latency=np.ones((3, 3))), r"link_latency must be a number or \[2, 2\] numbers"),
    ],
)
def test_a_topology_the_cost_model_cannot_divide_by_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(dj.Topology.uniform(2), **changes)


def test_topology_uniform_names_a_bad_device_count():
    for bad in ("a", 0, 2.0, True):
        with pytest.raises(ValueError, match="num_devices must be an int >= 1"):
            dj.Topology.uniform(bad)


def test_the_reference_simulator_refuses_a_nan_cost_instead_of_dropping_it():
    # max(0.0, nan) is 0.0 in Python: the op would have finished at 0.
    fn = _matmul()
    with pytest.raises(
        ValueError, match=r"op 0 \(MatMul -> v0\) on device 0: its cost must be a number >= 0, got nan"
    ):
        dj.reference_simulate(fn, dj.Topology.uniform(1), cost_fn=lambda op, topology: {0: float("nan")})
    with pytest.raises(ValueError, match="got -1.0"):
        dj.reference_simulate(fn, costs=[{0: -1.0}])
    with pytest.raises(ValueError, match="got none"):
        dj.reference_simulate(fn, costs=[{1: 1.0}])
    with pytest.raises(ValueError, match="one entry per op, 1 in all, got 2"):
        dj.reference_simulate(fn, costs=[{0: 1.0}, {0: 1.0}])


@pytest.mark.parametrize("stream", [-1, 1.5, "1", True])
def test_lower_refuses_a_stream_that_is_not_a_resource_index(stream):
    b = dj.FunctionBuilder("f")
    fn = b.build(b.add("Relu", b.input("x", (4, 4)), stream=stream))
    with pytest.raises(ValueError, match=rf"op 0 \(Relu\): stream must be an int >= 0, got {stream!r}"):
        dj.lower(fn, dj.Topology.uniform(1))


@pytest.mark.parametrize(
    "group, message",
    [
        ((), "needs attribute group = a non-empty tuple"),
        ((0, 0), r"group must be distinct, got \[0, 0\]"),
        ((1, 2), r"operands on devices \[0\] are not in its group \[1, 2\]"),
    ],
)
def test_a_collective_group_must_hold_its_operands(group, message):
    b = dj.FunctionBuilder("f")
    with pytest.raises(ValueError, match=message):
        b.add("AllReduce", b.input("x", (4, 4), device=0), group=group)


def test_values_of_another_builder_are_refused():
    foreign = dj.FunctionBuilder("other").input("q", (4,))
    b = dj.FunctionBuilder("f")
    x = b.input("x", (4,))
    with pytest.raises(ValueError, match="Relu: operands must be typed Values from this builder"):
        b.add("Relu", foreign)
    with pytest.raises(ValueError, match="function f: outputs must be typed Values from this builder"):
        b.build(foreign)
    with pytest.raises(ValueError, match="got 'x'"):
        b.build("x")
    assert b.build(b.add("Relu", x)).outputs[0].name == "v0"  # its own still work


def test_arguments_of_the_wrong_kind_are_named():
    fn = _matmul()
    topology = dj.Topology.uniform(1)
    program = dj.lower(fn, topology)
    cases = [
        (lambda: dj.lower(fn, None), "lower takes a Topology"),
        (lambda: dj.lower(program, topology), "lower takes a Function"),
        (lambda: dj.stack_programs([fn]), r"program 0 must be a lowered Program \(lower it first\)"),
        (lambda: dj.pad_program(program, (8, 2, 2, 2, 1, 1)), "capacity must be a Capacity, got tuple"),
        (lambda: dj.calibrate([fn], [1.0], topology), "calibrate: program 0 must be a lowered Program"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(ValueError, match="a preset name is a string"):
        dj.get_preset(None)


def test_simulate_names_an_argument_of_the_wrong_shape():
    topology = dj.Topology.uniform(2)
    program = dj.lower(_matmul(), topology)
    hardware = dj.Hardware.from_topology(topology)
    n, k = program.resource.shape
    cases = [
        (dict(costs=np.ones((3, 3))), rf"costs must be \[N, K\] = \[{n}, {k}\] or \[B, N, K\]"),
        (dict(valid=np.array([True, False, True])), r"valid must be \[B\] = \[1\] bools"),
        (
            dict(hardware=hardware.replace(link_bandwidth=np.ones((3, 3)))),
            r"hardware.link_bandwidth must have shape \[2, 2\]",
        ),
        (
            dict(hardware=hardware.replace(launch_overhead=np.ones(3))),
            r"launch_overhead must be a number or \[\]",
        ),
    ]
    for changes, message in cases:
        args = dict(hardware=hardware) | changes
        with pytest.raises(ValueError, match=message):
            dj.simulate(program, args.pop("hardware"), **args)


def test_size_variants_must_agree_across_inputs():
    b = dj.FunctionBuilder("variants")
    b.input("x", (np.array([32, 64]), 1024))
    with pytest.raises(ValueError, match="input %y has 3 size variants but %x has 2"):
        b.input("y", (np.array([1, 2, 3]), 8))
    with pytest.raises(ValueError, match=r"input %z: .* is a 1-D array, got shape \(1, 2\)"):
        b.input("z", (np.array([[1, 2]]), 8))
    b.input("w", (1024, np.array([8, 16])))  # as many variants: fine
