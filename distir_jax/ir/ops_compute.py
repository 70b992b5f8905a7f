"""Compute op types: each registers its shape rule, features and NumPy semantics.

MatMul, broadcasting binary ops, simple unary ops and their gradients live
here; activations and normalization are in ``ops_nn``, layout ops in
``ops_shape``, losses in ``ops_loss`` and optimizer updates in ``ops_optim``.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, aliases_if_inplace, register
from distir_jax.ir.shape_rules import (
    broadcast_shapes,
    elementwise_features,
    require_rank,
    require_same_dtype,
    same_shape,
    shape_str,
)
from distir_jax.ir.types import TensorType, dims_equal

FLOAT_DTYPES = ("f64", "f32", "f16", "bf16", "f8")
INT_DTYPES = ("i64", "i32")


def require_float_dtype(t: TensorType, what: str) -> None:
    """Gradients, losses and activations are only defined on float tensors."""
    if t.dtype not in FLOAT_DTYPES:
        raise OpError(f"{what} must have a float dtype {list(FLOAT_DTYPES)}, got {t.dtype}")


def require_int_dtype(t: TensorType, what: str) -> None:
    """Token ids and labels index tables, so they must be integers."""
    if t.dtype not in INT_DTYPES:
        raise OpError(
            f"{what} must have an integer dtype {list(INT_DTYPES)}, got {t.dtype} "
            f"(shape {shape_str(t.shape)})"
        )


_REQUIRED = object()


def int_attr(attrs, key: str, op_name: str, default=_REQUIRED, minimum=None) -> int:
    """Reads an int attribute, or raises :class:`OpError` naming the op and key."""
    value = attrs.get(key, default)
    if value is _REQUIRED:
        raise OpError(f"{op_name} needs attribute {key} (an int)")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OpError(f"{op_name}'s attribute {key} must be an int, got {key}={value!r}")
    if minimum is not None and value < minimum:
        raise OpError(f"{op_name}'s attribute {key} must be >= {minimum}, got {key}={value}")
    return int(value)


def vocab_shard(attrs, op_name: str) -> tuple[int, int]:
    """``(vocab_index, vocab_parts)``: the op holds part ``vocab_index`` of
    ``vocab_parts`` equal parts of the vocabulary (tensor parallelism splits the
    token table, the LM head and the loss by vocabulary); ``(0, 1)``: all of it."""
    parts = int_attr(attrs, "vocab_parts", op_name, 1, minimum=1)
    index = int_attr(attrs, "vocab_index", op_name, 0, minimum=0)
    if index >= parts:
        raise OpError(f"{op_name}'s vocab_index must be in [0, {parts - 1}], got vocab_index={index}")
    return index, parts


def local_ids(ids: np.ndarray, rows: int, attrs, op_name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(local, mine)``: token ids or labels as rows of this op's part of the
    vocabulary (:func:`vocab_shard`, ``rows`` a part), clipped into it, and
    which of them fall in it. Raises for ids outside the whole vocabulary."""
    index, parts = vocab_shard(attrs, op_name)
    vocab = rows * parts
    if ids.size and (np.min(ids) < 0 or np.max(ids) >= vocab):
        raise ValueError(
            f"{op_name}: ids must be in [0, {vocab}), got values in [{np.min(ids)}, {np.max(ids)}]"
        )
    local = ids - index * rows
    mine = (local >= 0) & (local < rows)
    return np.where(mine, local, 0), mine


def float_attr(attrs, key: str, op_name: str, default=_REQUIRED) -> float:
    """Reads a numeric attribute, or raises :class:`OpError` naming the op and key."""
    value = attrs.get(key, default)
    if value is _REQUIRED:
        raise OpError(f"{op_name} needs attribute {key} (a number)")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise OpError(f"{op_name}'s attribute {key} must be a number, got {key}={value!r}")
    return float(value)


# --------------------------------------------------------------------------- #
# MatMul: a[..., m, k] @ b[..., k, n], leading dims broadcast.


def _matmul_operand_shapes(attrs, a: TensorType, b: TensorType):
    sa, sb = list(a.shape), list(b.shape)
    if attrs.get("transpose_a", False):
        sa[-2], sa[-1] = sa[-1], sa[-2]
    if attrs.get("transpose_b", False):
        sb[-2], sb[-1] = sb[-1], sb[-2]
    return sa, sb


def _matmul_infer(attrs, ins):
    a, b = ins
    require_rank(a, 2, "MatMul operand a")
    require_rank(b, 2, "MatMul operand b")
    if attrs.get("fp8", False):  # operands in f8 or in the dtype of the result (cast as loaded)
        dtypes = {a.dtype, b.dtype} - {"f8"}
        dtype = attrs.get("dtype")  # the result's, which two f8 operands do not tell
        if dtype is not None:
            if dtype not in FLOAT_DTYPES or dtype == "f8":
                raise OpError(f"an FP8 MatMul's result dtype must be wider than f8, got dtype={dtype!r}")
            dtypes.add(dtype)
        if len(dtypes) != 1:
            raise OpError(
                f"an FP8 MatMul reads f8 operands and ones in its result's dtype (attribute dtype, or its "
                f"other operand's), got {a.dtype}, {b.dtype}" + (f" and dtype={dtype!r}" if dtype else "")
            )
        (dtype,) = dtypes
    else:
        dtype = require_same_dtype(ins)
    sa, sb = _matmul_operand_shapes(attrs, a, b)
    if not dims_equal(sa[-1], sb[-2]):
        raise OpError(
            f"contraction dims differ: a {shape_str(sa)} @ b {shape_str(sb)} ({sa[-1]} != {sb[-2]})"
        )
    batch = broadcast_shapes(sa[:-2], sb[:-2])
    return (TensorType(batch + (sa[-2], sb[-1]), dtype, a.device),)


def _matmul_features(attrs, ins, outs):
    a, b = ins
    sa, _ = _matmul_operand_shapes(attrs, a, b)
    (out,) = outs
    flops = 2 * out.num_elements * sa[-1]
    if attrs.get("fp8", False):
        # On FP8 tensor cores (training precision "mixed-fp8"): twice the bf16 / f16
        # rate on every GPU that has them (H100 / H200 1,979 against 989 dense
        # TFLOPS, B200 4.5 against 2.25 PFLOPS), so half the flops at the model
        # dtype's peak, which is what a device's peak is; 1-byte operands.
        return OpFeatures(flops=flops / 2, mem_bytes=a.num_elements + b.num_elements + out.num_bytes)
    return OpFeatures(flops=flops, mem_bytes=a.num_bytes + b.num_bytes + out.num_bytes)


def _matmul_eval(attrs, inputs):
    a, b = inputs
    if attrs.get("transpose_a", False):
        a = np.swapaxes(a, -1, -2)
    if attrs.get("transpose_b", False):
        b = np.swapaxes(b, -1, -2)
    return (np.matmul(a, b),)


register(OpSpec("MatMul", _matmul_infer, _matmul_features, _matmul_eval, num_inputs=2))

# --------------------------------------------------------------------------- #
# CastInto: ``x`` cast into the buffer of ``dest`` (same shape, ``dest``'s dtype),
# in place. Training precision "mixed-fp8" keeps, as Transformer Engine does, an
# FP8 copy of each linear layer's weight and one of its transpose, resident,
# refreshed from the weight once a step and read by every microbatch's GEMMs.


def _cast_into_infer(attrs, ins):
    dest, x = ins
    require_float_dtype(dest, "CastInto's destination")
    require_float_dtype(x, "CastInto's operand")
    same_shape(ins, "CastInto's destination (whose buffer it writes) and operand")
    return (TensorType(dest.shape, dest.dtype, dest.device),)


def _cast_into_features(attrs, ins, outs):
    # Its time is left out: once a step it moves ~3 bytes a parameter per copy
    # (GPT-3 175B at t4 p8 on H100s: ~16 ms of a ~50 s step).
    return OpFeatures(flops=0.0, mem_bytes=0.0, launches=0)


register(
    OpSpec(
        "CastInto",  # (dest, x) -> dest, holding x in dest's dtype
        _cast_into_infer,
        _cast_into_features,
        # Executors evaluate every float in float64, so the value is x's.
        lambda attrs, inputs: (np.array(inputs[1], copy=True),),
        num_inputs=2,
        aliases=((0, 0),),
    )
)

# --------------------------------------------------------------------------- #
# Elementwise binary ops with broadcasting.


def _binary_infer(attrs, ins):
    a, b = ins
    dtype = require_same_dtype(ins)
    shape = broadcast_shapes(a.shape, b.shape)
    same = len(shape) == len(a.shape) and all(dims_equal(x, y) for x, y in zip(shape, a.shape, strict=True))
    if attrs.get("inplace") and not same:
        raise OpError(
            f"inplace=True writes the result into the first operand, so it needs the result's shape "
            f"{shape_str(shape)}; got {shape_str(a.shape)} (broadcast against {shape_str(b.shape)})"
        )
    return (TensorType(shape, dtype, a.device),)


def _binary_features(attrs, ins, outs):
    return elementwise_features(ins, outs)


for _name, _fn in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply), ("Div", np.divide)):
    register(
        OpSpec(
            _name,
            _binary_infer,
            _binary_features,
            (lambda fn: lambda attrs, inputs: (fn(inputs[0], inputs[1]),))(_fn),
            num_inputs=2,
            # inplace=True: the result overwrites the first operand (of the result's
            # shape), as a gradient is added into its running sum (`main_grad.add_(grad)`).
            aliases=aliases_if_inplace,
        )
    )

# --------------------------------------------------------------------------- #
# Elementwise unary ops.


def _unary_infer(attrs, ins):
    (x,) = ins
    return (x,)


def _register_unary(name, fn, flops_per_element=1.0):
    register(
        OpSpec(
            name,
            _unary_infer,
            lambda attrs, ins, outs: elementwise_features(ins, outs, flops_per_element),
            lambda attrs, inputs: (fn(inputs[0]),),
            num_inputs=1,
        )
    )


_register_unary("Relu", lambda x: np.maximum(x, 0.0))
_register_unary("Neg", np.negative)
_register_unary("Identity", lambda x: np.array(x, copy=True))
# Transcendentals run on special-function units; one flop per element keeps
# them memory-bound, which is what they are on every current accelerator.
_register_unary("Exp", np.exp)
_register_unary("Tanh", np.tanh)


def _relu_grad_infer(attrs, ins):
    same_shape(ins, "ReluGrad's dy and x")
    require_same_dtype(ins)
    return (ins[0],)


register(
    OpSpec(
        "ReluGrad",  # (dy, x) -> dy * (x > 0)
        _relu_grad_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs),
        lambda attrs, inputs: (inputs[0] * (inputs[1] > 0),),
        num_inputs=2,
    )
)


def _tanh_grad_infer(attrs, ins):
    same_shape(ins, "TanhGrad's dy and y")
    require_float_dtype(ins[0], "TanhGrad's dy")
    require_same_dtype(ins)
    return (ins[0],)


register(
    OpSpec(
        "TanhGrad",  # (dy, y = tanh(x)) -> dy * (1 - y^2)
        _tanh_grad_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs, 3.0),
        lambda attrs, inputs: (inputs[0] * (1.0 - inputs[1] * inputs[1]),),
        num_inputs=2,
    )
)

# --------------------------------------------------------------------------- #
# Scale: multiply by a constant attribute (e.g. 1 / sqrt(d) in attention).


def _scale_infer(attrs, ins):
    (x,) = ins
    float_attr(attrs, "factor", "Scale")
    require_float_dtype(x, "Scale's operand")
    return (x,)


register(
    OpSpec(
        "Scale",  # (x; factor) -> x * factor
        _scale_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs),
        lambda attrs, inputs: (inputs[0] * float(attrs["factor"]),),
        num_inputs=1,
    )
)

# --------------------------------------------------------------------------- #
# Cast: a float tensor in another float dtype. Mixed precision casts each
# half-precision weight gradient to f32 before microbatches are summed and
# replicas all-reduce it (Megatron-LM's main_grad).


def _cast_infer(attrs, ins):
    (x,) = ins
    require_float_dtype(x, "Cast's operand")
    # (Not `to`: that attribute names a device, which transforms move.)
    dtype = attrs.get("dtype")
    if dtype not in FLOAT_DTYPES:
        raise OpError(f"Cast needs attribute dtype, one of {list(FLOAT_DTYPES)}, got dtype={dtype!r}")
    return (TensorType(x.shape, dtype, x.device),)


def _cast_features(attrs, ins, outs):
    if attrs.get("fused", False):
        # An epilogue of the kernel that produced the operand (Transformer Engine
        # casts a LayerNorm's or a GeLU's output to FP8 as it writes it): no
        # launch and no read of its own, only the bytes it writes.
        return OpFeatures(flops=0.0, mem_bytes=outs[0].num_bytes, launches=0)
    # Data movement, as Transpose and Concat: no flops. (The pipeline transform
    # orders and balances steps by flops that scale with the batch; a weight
    # gradient's cast does not.)
    return elementwise_features(ins, outs, 0.0)


register(
    OpSpec(
        "Cast",  # (x; dtype; fused) -> x in `dtype`
        _cast_infer,
        _cast_features,
        # Executors evaluate every float in float64, so the value is unchanged.
        lambda attrs, inputs: (np.array(inputs[0], copy=True),),
        num_inputs=1,
    )
)
