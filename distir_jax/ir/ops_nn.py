"""Neural-network op types: activations, softmax, masking, layer norm, embeddings.

Each forward op that needs one has a gradient op; ``CausalMask`` is its own
gradient (``CausalMask(dy; fill=0.0)``) because it is linear in the kept
positions.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.ops_compute import (
    float_attr,
    int_attr,
    local_ids,
    require_float_dtype,
    require_int_dtype,
    vocab_shard,
)
from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, register
from distir_jax.ir.shape_rules import (
    elementwise_features,
    normalize_axis,
    require_rank,
    require_same_dtype,
    same_shape,
    shape_str,
)
from distir_jax.ir.types import TensorType, dim_str, dims_equal


def _grad_pair_infer(name: str, second: str):
    """Shape rule of ``(dy, z) -> dx`` where all three share one shape."""

    def infer(attrs, ins):
        same_shape(ins, f"{name}'s dy and {second}")
        require_float_dtype(ins[0], f"{name}'s dy")
        require_same_dtype(ins)
        return (ins[0],)

    return infer


# --------------------------------------------------------------------------- #
# Gelu, tanh approximation: 0.5 x (1 + tanh(c (x + a x^3))).

_GELU_C = float(np.sqrt(2.0 / np.pi))
_GELU_A = 0.044715


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + _GELU_A * x**3)))


def _gelu_grad(dy, x):
    t = np.tanh(_GELU_C * (x + _GELU_A * x**3))
    dinner = _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


def _gelu_infer(attrs, ins):
    require_float_dtype(ins[0], "Gelu's operand")
    return (ins[0],)


register(
    OpSpec(
        "Gelu",
        _gelu_infer,
        # x^3 (2), inner affine (3), tanh (1), 1 + t, two products.
        lambda attrs, ins, outs: elementwise_features(ins, outs, 9.0),
        lambda attrs, inputs: (_gelu(inputs[0]),),
        num_inputs=1,
    )
)
register(
    OpSpec(
        "GeluGrad",  # (dy, x) -> dy * gelu'(x)
        _grad_pair_infer("GeluGrad", "x"),
        lambda attrs, ins, outs: elementwise_features(ins, outs, 16.0),
        lambda attrs, inputs: (_gelu_grad(inputs[0], inputs[1]),),
        num_inputs=2,
    )
)

# --------------------------------------------------------------------------- #
# Softmax along one axis, and its gradient given the softmax output y.


def _softmax(x, axis):
    # Subtracting the max keeps exp from overflowing; it cancels exactly.
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def _softmax_infer(attrs, ins):
    (x,) = ins
    require_rank(x, 1, "Softmax's operand")
    require_float_dtype(x, "Softmax's operand")
    normalize_axis(int_attr(attrs, "axis", "Softmax", -1), x.rank)
    return (x,)


def _softmax_grad_infer(attrs, ins):
    dy, _ = ins
    same_shape(ins, "SoftmaxGrad's dy and y")
    require_float_dtype(dy, "SoftmaxGrad's dy")
    require_same_dtype(ins)
    normalize_axis(int_attr(attrs, "axis", "SoftmaxGrad", -1), dy.rank)
    return (dy,)


def _softmax_grad(attrs, inputs):
    dy, y = inputs
    axis = int(attrs.get("axis", -1))
    return (y * (dy - np.sum(dy * y, axis=axis, keepdims=True)),)


register(
    OpSpec(
        "Softmax",  # (x; axis=-1)
        _softmax_infer,
        # max, subtract, exp, sum, divide.
        lambda attrs, ins, outs: elementwise_features(ins, outs, 5.0),
        lambda attrs, inputs: (_softmax(inputs[0], int(attrs.get("axis", -1))),),
        num_inputs=1,
    )
)
register(
    OpSpec(
        "SoftmaxGrad",  # (dy, y; axis=-1) -> y * (dy - sum(dy * y))
        _softmax_grad_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs, 4.0),
        _softmax_grad,
        num_inputs=2,
    )
)

# --------------------------------------------------------------------------- #
# CausalMask: positions j > i of the trailing [s, s] block become `fill`.


def _causal_mask_infer(attrs, ins):
    (x,) = ins
    require_rank(x, 2, "CausalMask's operand")
    if not dims_equal(x.shape[-1], x.shape[-2]):
        raise OpError(
            f"CausalMask needs square trailing dims [s, s], got shape {shape_str(x.shape)} "
            f"({dim_str(x.shape[-2])} != {dim_str(x.shape[-1])})"
        )
    float_attr(attrs, "fill", "CausalMask", -1e9)
    return (x,)


def _causal_mask(attrs, inputs):
    (x,) = inputs
    s = x.shape[-1]
    future = np.triu(np.ones((s, s), dtype=bool), k=1)
    return (np.where(future, float(attrs.get("fill", -1e9)), x),)


register(
    OpSpec(
        "CausalMask",  # (x; fill=-1e9); its gradient is CausalMask(dy; fill=0.0)
        _causal_mask_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs),
        _causal_mask,
        num_inputs=1,
    )
)

# --------------------------------------------------------------------------- #
# LayerNorm over the last axis with a per-feature gain and bias.


def _layer_norm_params(name, x: TensorType, params, param_names):
    require_rank(x, 1, f"{name}'s x")
    require_float_dtype(x, f"{name}'s x")
    hidden = x.shape[-1]
    for p, pname in zip(params, param_names, strict=True):
        if p.rank != 1 or not dims_equal(p.shape[0], hidden):
            raise OpError(
                f"{name}'s {pname} must have shape [{dim_str(hidden)}] (the last dim of x "
                f"{shape_str(x.shape)}), got {shape_str(p.shape)}"
            )


def _eps(attrs, name):
    eps = float_attr(attrs, "eps", name, 1e-5)
    if eps <= 0.0:
        raise OpError(f"{name}'s eps must be > 0, got eps={eps}")
    return eps


def _layer_norm_infer(attrs, ins):
    x, gamma, beta = ins
    _layer_norm_params("LayerNorm", x, (gamma, beta), ("gamma", "beta"))
    require_same_dtype(ins)
    _eps(attrs, "LayerNorm")
    return (x,)


def _normalize(x, eps):
    """``(x_hat, rstd)`` with statistics over the last axis."""
    centered = x - np.mean(x, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(np.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return centered * rstd, rstd


def _layer_norm(attrs, inputs):
    x, gamma, beta = inputs
    x_hat, _ = _normalize(x, float(attrs.get("eps", 1e-5)))
    return (x_hat * gamma + beta,)


def _layer_norm_grad_infer(attrs, ins):
    dy, x, gamma = ins
    if dy.rank != x.rank or not all(dims_equal(a, b) for a, b in zip(dy.shape, x.shape, strict=True)):
        raise OpError(
            f"LayerNormGrad's dy must have the shape of x {shape_str(x.shape)}, got {shape_str(dy.shape)}"
        )
    _layer_norm_params("LayerNormGrad", x, (gamma,), ("gamma",))
    require_float_dtype(dy, "LayerNormGrad's dy")
    require_same_dtype(ins)
    _eps(attrs, "LayerNormGrad")
    return (dy, gamma.on(dy.device), gamma.on(dy.device))


def _layer_norm_grad(attrs, inputs):
    dy, x, gamma = inputs
    x_hat, rstd = _normalize(x, float(attrs.get("eps", 1e-5)))
    g = dy * gamma
    # d x_hat / d x projects out the mean and the x_hat direction.
    dx = rstd * (g - np.mean(g, axis=-1, keepdims=True) - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True))
    hidden = x.shape[-1]
    dgamma = np.sum((dy * x_hat).reshape(-1, hidden), axis=0)
    dbeta = np.sum(dy.reshape(-1, hidden), axis=0)
    return (dx, dgamma, dbeta)


register(
    OpSpec(
        "LayerNorm",  # (x, gamma, beta; eps=1e-5)
        _layer_norm_infer,
        # mean, center, square, variance, scale by rstd, gain, bias.
        lambda attrs, ins, outs: elementwise_features(ins, outs, 8.0),
        _layer_norm,
        num_inputs=3,
    )
)


def _layer_norm_grad_features(attrs, ins, outs):
    dy = ins[0]
    base = elementwise_features(ins, outs, 0.0)
    # Recomputing x_hat (~5) plus the two reductions and the projection (~9).
    return OpFeatures(flops=14.0 * dy.num_elements, mem_bytes=base.mem_bytes)


register(
    OpSpec(
        "LayerNormGrad",  # (dy, x, gamma; eps=1e-5) -> (dx, dgamma, dbeta)
        _layer_norm_grad_infer,
        _layer_norm_grad_features,
        _layer_norm_grad,
        num_inputs=3,
    )
)

# --------------------------------------------------------------------------- #
# Embedding lookup and its scatter-add gradient.


# With vocab_parts > 1 (tensor parallelism by vocabulary, as Megatron-LM's
# VocabParallelEmbedding) the table is part vocab_index of the vocabulary's
# rows: the lookup writes zeros for ids outside it, so the parts' results sum
# to the whole lookup, and the gradient keeps only its own rows.


def _embedding_infer(attrs, ins):
    table, ids = ins
    if table.rank != 2:
        raise OpError(f"Embedding's table must have shape [V, H], got {shape_str(table.shape)}")
    require_float_dtype(table, "Embedding's table")
    require_int_dtype(ids, "Embedding's ids")
    vocab_shard(attrs, "Embedding")
    return (TensorType(ids.shape + (table.shape[1],), table.dtype, table.device),)


def _embedding(attrs, inputs):
    table, ids = inputs
    local, mine = local_ids(ids, table.shape[0], attrs, "Embedding")
    return (np.take(table, local, axis=0) * mine[..., None],)


register(
    OpSpec(
        "Embedding",  # (table [V, H], ids [...]; vocab_index=0, vocab_parts=1) -> [..., H]
        _embedding_infer,
        # A gather: read the ids and the chosen rows, write the rows.
        lambda attrs, ins, outs: OpFeatures(flops=0, mem_bytes=ins[1].num_bytes + 2 * outs[0].num_bytes),
        _embedding,
        num_inputs=2,
    )
)


def _embedding_grad_infer(attrs, ins):
    dy, ids = ins
    require_rank(dy, 1, "EmbeddingGrad's dy")
    require_float_dtype(dy, "EmbeddingGrad's dy")
    require_int_dtype(ids, "EmbeddingGrad's ids")
    lead = dy.shape[:-1]
    if len(lead) != ids.rank or not all(dims_equal(a, b) for a, b in zip(lead, ids.shape, strict=True)):
        raise OpError(
            f"EmbeddingGrad's dy {shape_str(dy.shape)} must be ids' shape {shape_str(ids.shape)} "
            "plus a trailing hidden dim"
        )
    rows = int_attr(attrs, "num_embeddings", "EmbeddingGrad", minimum=1)
    vocab_shard(attrs, "EmbeddingGrad")
    return (TensorType((rows, dy.shape[-1]), dy.dtype, dy.device),)


def _embedding_grad(attrs, inputs):
    dy, ids = inputs
    rows = int(attrs["num_embeddings"])
    local, mine = local_ids(ids, rows, attrs, "EmbeddingGrad")
    hidden = dy.shape[-1]
    dtable = np.zeros((rows, hidden), dtype=dy.dtype)
    # add.at accumulates repeated ids, which plain fancy assignment would drop.
    np.add.at(dtable, local.reshape(-1), (dy * mine[..., None]).reshape(-1, hidden))
    return (dtable,)


register(
    OpSpec(
        # (dy [..., H], ids [...]; num_embeddings, vocab_index=0, vocab_parts=1) -> [num_embeddings, H]
        "EmbeddingGrad",
        _embedding_grad_infer,
        lambda attrs, ins, outs: OpFeatures(
            flops=ins[0].num_elements,
            mem_bytes=ins[0].num_bytes + ins[1].num_bytes + outs[0].num_bytes,
        ),
        _embedding_grad,
        num_inputs=2,
    )
)
