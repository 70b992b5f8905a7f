"""distir-jax: a JAX-accelerated, vectorized and differentiable simulator for
distributed deep-learning execution strategies.

The data flow is one direction::

    models / FunctionBuilder -> Function (IR) -> transforms -> lower() -> Program
    Program + Hardware -> simulate() (jit, batched over configurations) -> SimResult
"""

from distir_jax.calibrate import (
    CALIBRATABLE_FIELDS,
    Calibration,
    calibrate,
    calibration_probes,
    load_calibration,
    save_calibration,
)
from distir_jax.executor.reference import ReferenceResult, reference_simulate
from distir_jax.executor.sequential import execute
from distir_jax.hardware import Hardware, pad_hardware, stack_hardware
from distir_jax.ir import (
    Function,
    FunctionBuilder,
    Op,
    OpFeatures,
    OpSpec,
    TensorType,
    Topology,
    Value,
    get_spec,
    infer_types,
    register,
    registered_op_types,
)
from distir_jax.ir.parser import parse_function
from distir_jax.ir.printer import print_function
from distir_jax.kernel import (
    STATUS_INVALID,
    STATUS_NAMES,
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    SimResult,
    simulate,
)
from distir_jax.lower import (
    NO_DEVICE,
    NO_RESOURCE,
    NO_SLOT,
    Capacity,
    Program,
    lower,
    pad_program,
    stack_programs,
)
from distir_jax.presets import (
    get_preset,
    load_topology,
    preset_names,
    register_calibrated_preset,
    save_topology,
)
from distir_jax.sensitivity import step_time_elasticities

__version__ = "0.1.0"

__all__ = [
    "CALIBRATABLE_FIELDS",
    "NO_DEVICE",
    "NO_RESOURCE",
    "NO_SLOT",
    "STATUS_INVALID",
    "STATUS_NAMES",
    "STATUS_OK",
    "STATUS_OUT_OF_MEMORY",
    "Calibration",
    "Capacity",
    "Function",
    "FunctionBuilder",
    "Hardware",
    "Op",
    "OpFeatures",
    "OpSpec",
    "Program",
    "ReferenceResult",
    "SimResult",
    "TensorType",
    "Topology",
    "Value",
    "calibrate",
    "calibration_probes",
    "execute",
    "get_preset",
    "get_spec",
    "infer_types",
    "load_calibration",
    "load_topology",
    "lower",
    "pad_hardware",
    "pad_program",
    "parse_function",
    "preset_names",
    "print_function",
    "reference_simulate",
    "register",
    "register_calibrated_preset",
    "registered_op_types",
    "save_calibration",
    "save_topology",
    "simulate",
    "stack_hardware",
    "stack_programs",
    "step_time_elasticities",
]
