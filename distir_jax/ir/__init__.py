"""The IR: tensor types, values, ops, functions, the op registry and text form."""

# Op definitions register themselves on import. Importing them with the IR puts
# their cost in the import, not in the first op a sweep builds (the registry
# would import them there: ~12 ms where bytecode is not cached).
from distir_jax.ir import ops_comm, ops_compute, ops_loss, ops_nn, ops_optim, ops_shape  # noqa: F401
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
