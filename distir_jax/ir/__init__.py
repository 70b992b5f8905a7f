"""The IR: tensor types, values, ops, functions, the op registry and text form."""

from distir_jax.ir.builder import FunctionBuilder
from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, get_spec, register, registered_op_types
from distir_jax.ir.topology import Topology
from distir_jax.ir.typecheck import infer_types
from distir_jax.ir.types import DTYPE_BYTES, TensorType

__all__ = [
    "DTYPE_BYTES",
    "Function",
    "FunctionBuilder",
    "Op",
    "OpError",
    "OpFeatures",
    "OpSpec",
    "TensorType",
    "Topology",
    "Value",
    "get_spec",
    "infer_types",
    "register",
    "registered_op_types",
]
