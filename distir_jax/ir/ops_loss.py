"""Loss op types and their gradients.

Losses return a scalar (shape ``()``) on the device of the predictions. The
``shards`` attribute divides by ``rows * shards`` instead of ``rows``: when a
transform splits a batch into equal parts (data-parallel replicas, pipeline
microbatches), each part's loss is then its share of the global mean, and the
parts' losses and gradients simply add up.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.ops_compute import int_attr, require_float_dtype, require_int_dtype
from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, register
from distir_jax.ir.shape_rules import require_rank, require_same_dtype, same_shape, shape_str
from distir_jax.ir.types import TensorType, dims_equal


def _shards(attrs, name) -> int:
    return int_attr(attrs, "shards", name, 1, minimum=1)


def _scalar_like(t: TensorType) -> TensorType:
    return TensorType((), t.dtype, t.device)


# --------------------------------------------------------------------------- #
# MSELoss: sum((pred - target)^2) / (rows * shards).


def _mse_infer(name):
    def infer(attrs, ins):
        pred, _ = ins
        require_rank(pred, 1, f"{name}'s pred")
        same_shape(ins, f"{name}'s pred and target")
        require_float_dtype(pred, f"{name}'s pred")
        require_same_dtype(ins)
        _shards(attrs, name)
        return (_scalar_like(pred),) if name == "MSELoss" else (pred,)

    return infer


def _mse_denominator(attrs, pred) -> float:
    # An empty batch has zero loss, not 0 / 0.
    return float(max(pred.shape[0], 1) * int(attrs.get("shards", 1)))


def _mse(attrs, inputs):
    pred, target = inputs
    diff = pred - target
    return (np.asarray(np.sum(diff * diff) / _mse_denominator(attrs, pred)),)


def _mse_grad(attrs, inputs):
    pred, target = inputs
    return (2.0 * (pred - target) / _mse_denominator(attrs, pred),)


register(
    OpSpec(
        "MSELoss",  # (pred, target; shards=1) -> scalar
        _mse_infer("MSELoss"),
        # subtract, square, accumulate.
        lambda attrs, ins, outs: OpFeatures(
            flops=3 * ins[0].num_elements,
            mem_bytes=ins[0].num_bytes + ins[1].num_bytes + outs[0].num_bytes,
        ),
        _mse,
        num_inputs=2,
    )
)
register(
    OpSpec(
        "MSELossGrad",  # (pred, target; shards=1) -> dpred
        _mse_infer("MSELossGrad"),
        lambda attrs, ins, outs: OpFeatures(
            flops=3 * ins[0].num_elements,
            mem_bytes=ins[0].num_bytes + ins[1].num_bytes + outs[0].num_bytes,
        ),
        _mse_grad,
        num_inputs=2,
    )
)

# --------------------------------------------------------------------------- #
# SoftmaxCrossEntropy: mean over positions of -log softmax(logits)[label].


def _sce_infer(name):
    def infer(attrs, ins):
        logits, labels = ins
        require_rank(logits, 1, f"{name}'s logits")
        require_float_dtype(logits, f"{name}'s logits")
        require_int_dtype(labels, f"{name}'s labels")
        lead = logits.shape[:-1]
        if labels.rank != len(lead) or not all(
            dims_equal(a, b) for a, b in zip(labels.shape, lead, strict=True)
        ):
            raise OpError(
                f"{name}'s labels must have shape {shape_str(lead)} (logits {shape_str(logits.shape)} "
                f"without the class dim), got {shape_str(labels.shape)}"
            )
        _shards(attrs, name)
        return (_scalar_like(logits),) if name == "SoftmaxCrossEntropy" else (logits,)

    return infer


def _log_softmax(logits):
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _sce_setup(attrs, logits, labels):
    """Checks label ids; returns the mean's denominator."""
    classes = logits.shape[-1]
    if labels.size and (np.min(labels) < 0 or np.max(labels) >= classes):
        raise ValueError(
            f"SoftmaxCrossEntropy: labels must be in [0, {classes}), got values in "
            f"[{np.min(labels)}, {np.max(labels)}]"
        )
    return float(max(labels.size, 1) * int(attrs.get("shards", 1)))


def _sce(attrs, inputs):
    logits, labels = inputs
    denominator = _sce_setup(attrs, logits, labels)
    picked = np.take_along_axis(_log_softmax(logits), labels[..., None], axis=-1)
    return (np.asarray(-np.sum(picked) / denominator),)


def _sce_grad(attrs, inputs):
    logits, labels = inputs
    denominator = _sce_setup(attrs, logits, labels)
    dlogits = np.exp(_log_softmax(logits))
    # Subtract the one-hot label without materializing it.
    np.put_along_axis(
        dlogits, labels[..., None], np.take_along_axis(dlogits, labels[..., None], axis=-1) - 1.0, axis=-1
    )
    return (dlogits / denominator,)


def _sce_features(attrs, ins, outs):
    logits, labels = ins
    # max, subtract, exp, sum, log-term and pick per logit.
    return OpFeatures(
        flops=5 * logits.num_elements,
        mem_bytes=logits.num_bytes + labels.num_bytes + outs[0].num_bytes,
    )


register(
    OpSpec(
        "SoftmaxCrossEntropy",  # (logits [..., V], labels [...]; shards=1) -> scalar
        _sce_infer("SoftmaxCrossEntropy"),
        _sce_features,
        _sce,
        num_inputs=2,
    )
)
register(
    OpSpec(
        "SoftmaxCrossEntropyGrad",  # (logits, labels; shards=1) -> dlogits
        _sce_infer("SoftmaxCrossEntropyGrad"),
        _sce_features,
        _sce_grad,
        num_inputs=2,
    )
)
