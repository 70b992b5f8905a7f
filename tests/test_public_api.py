"""The public surface: every advertised name exists and is importable."""

import distir_jax
import distir_jax.ir
import distir_jax.models


def test_public_names_exist():
    for module in (distir_jax, distir_jax.ir, distir_jax.models):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name} is advertised but missing"


def test_end_to_end_quickstart():
    b = distir_jax.FunctionBuilder("quickstart")
    x = b.input("x", (32, 64), device=0)
    w = b.input("w", (64, 64), device=0)
    y = b.add("Send", b.add("Relu", b.add("MatMul", x, w)), to=1)
    fn = b.build(y)
    topology = distir_jax.Topology.uniform(2)
    result = distir_jax.simulate(distir_jax.lower(fn, topology), distir_jax.Hardware.from_topology(topology))
    reference = distir_jax.reference_simulate(fn, topology)
    assert abs(float(result.step_time[0]) - reference.step_time) <= 1e-5 * reference.step_time
    assert distir_jax.parse_function(distir_jax.print_function(fn)) == fn
