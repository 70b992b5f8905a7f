"""Loss op types and their gradients.

Losses return a scalar (shape ``()``) on the device of the predictions. The
``shards`` attribute divides by ``rows * shards`` instead of ``rows``: when a
transform splits a batch into equal parts (data-parallel replicas, pipeline
microbatches), each part's loss is then its share of the global mean, and the
parts' losses and gradients simply add up.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.ops_compute import (
    int_attr,
    local_ids,
    require_float_dtype,
    require_int_dtype,
    vocab_shard,
)
from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, register
from distir_jax.ir.shape_rules import (
    elementwise_features,
    require_rank,
    require_same_dtype,
    same_shape,
    shape_str,
)
from distir_jax.ir.types import TensorType, dim_divides, dims_equal


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


def _denominator(attrs, positions: int) -> float:
    """A mean's denominator: the positions (rows, tokens) times the parts a transform
    split the batch into. An empty batch has zero loss, not 0 / 0."""
    return float(max(positions, 1) * int(attrs.get("shards", 1)))


def _mse(attrs, inputs):
    pred, target = inputs
    diff = pred - target
    return (np.asarray(np.sum(diff * diff) / _denominator(attrs, pred.shape[0])),)


def _mse_grad(attrs, inputs):
    pred, target = inputs
    return (2.0 * (pred - target) / _denominator(attrs, pred.shape[0]),)


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


def _check_logits_labels(name, logits, labels) -> None:
    require_rank(logits, 1, f"{name}'s logits")
    require_float_dtype(logits, f"{name}'s logits")
    require_int_dtype(labels, f"{name}'s labels")
    lead = logits.shape[:-1]
    if labels.rank != len(lead) or not all(dims_equal(a, b) for a, b in zip(labels.shape, lead, strict=True)):
        raise OpError(
            f"{name}'s labels must have shape {shape_str(lead)} (logits {shape_str(logits.shape)} "
            f"without the class dim), got {shape_str(labels.shape)}"
        )


def _check_stats(name, stats, lead, parts=None) -> None:
    """Statistics of the vocabulary's parts side by side: ``lead + [3 t]`` (``t = parts``
    when given, else any ``t >= 1``)."""
    require_float_dtype(stats, f"{name}'s statistics")
    width = stats.shape[-1] if stats.rank else 0
    if (
        stats.rank != len(lead) + 1
        or not all(dims_equal(a, b) for a, b in zip(stats.shape[:-1], lead, strict=True))
        or not dim_divides(width, 3)
        or width < 3
        or (parts is not None and width != 3 * parts)
    ):
        t = "3t" if parts is None else f"{3 * parts} (vocab_parts={parts})"
        raise OpError(
            f"{name}'s statistics must have shape {shape_str(tuple(lead) + (t,))} (3 numbers per "
            f"part of the vocabulary, see CrossEntropyStats), got {shape_str(stats.shape)}"
        )


def _sce_infer(name):
    def infer(attrs, ins):
        if len(ins) not in (2, 3) or (len(ins) == 3 and name == "SoftmaxCrossEntropy"):
            expected = "2 operands" if name == "SoftmaxCrossEntropy" else "2 or 3 operands"
            raise OpError(f"{name} takes {expected} (logits, labels[, statistics]), got {len(ins)}")
        logits, labels = ins[:2]
        _check_logits_labels(name, logits, labels)
        _, parts = vocab_shard(attrs, name)
        if len(ins) == 3:
            _check_stats(name, ins[2], logits.shape[:-1], parts)
        elif parts > 1 and name == "SoftmaxCrossEntropy":
            raise OpError(
                f"{name} works on the whole vocabulary, got vocab_parts={parts}: a loss split by "
                "vocabulary is each part's CrossEntropyStats, all-gathered, then CrossEntropyFromStats"
            )
        elif parts > 1:
            raise OpError(
                f"{name} with vocab_parts={parts} needs the statistics of every part as a third operand"
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
    return _denominator(attrs, labels.size)


def _sce(attrs, inputs):
    logits, labels = inputs
    denominator = _sce_setup(attrs, logits, labels)
    picked = np.take_along_axis(_log_softmax(logits), labels[..., None], axis=-1)
    return (np.asarray(-np.sum(picked) / denominator),)


def _sce_grad(attrs, inputs):
    logits, labels = inputs[:2]
    if len(inputs) == 2:
        denominator = _sce_setup(attrs, logits, labels)
        dlogits = np.exp(_log_softmax(logits))
        local, mine = labels, np.ones(labels.shape, bool)
    else:  # this part of the vocabulary, normalized by every part's statistics
        local, mine = local_ids(labels, logits.shape[-1], attrs, "SoftmaxCrossEntropyGrad")
        denominator = _denominator(attrs, labels.size)
        lse, _ = _parts_log_sum_exp(inputs[2])
        dlogits = np.exp(logits - lse[..., None])
    # Subtract the one-hot label without materializing it.
    picked = np.take_along_axis(dlogits, local[..., None], axis=-1)
    np.put_along_axis(dlogits, local[..., None], picked - mine[..., None], axis=-1)
    return (dlogits / denominator,)


def _sce_features(attrs, ins, outs):
    # max, subtract, exp, sum, log-term and pick per logit.
    return OpFeatures(
        flops=5 * ins[0].num_elements,
        mem_bytes=sum(t.num_bytes for t in ins) + outs[0].num_bytes,
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
        # (logits, labels[, statistics]; shards=1, vocab_index=0, vocab_parts=1) -> dlogits
        "SoftmaxCrossEntropyGrad",
        _sce_infer("SoftmaxCrossEntropyGrad"),
        _sce_features,
        _sce_grad,
        num_inputs=None,
    )
)

# --------------------------------------------------------------------------- #
# Cross entropy over a vocabulary split into t parts (tensor parallelism, as
# Megatron-LM's vocab-parallel cross entropy): each part's CrossEntropyStats
# [..., 3] = (max of its logits, sum of exp(logit - max), the label's logit if
# the label is in the part, else 0); an AllGather along the last axis sets
# the parts' statistics side by side, [..., 3 t]; the loss
# (CrossEntropyFromStats) and each part's gradient (SoftmaxCrossEntropyGrad
# with a third operand) follow from them, without gathering the logits.


def _stats_infer(attrs, ins):
    logits, labels = ins
    _check_logits_labels("CrossEntropyStats", logits, labels)
    vocab_shard(attrs, "CrossEntropyStats")
    return (logits.with_shape(tuple(logits.shape[:-1]) + (3,)),)


def _stats(attrs, inputs):
    logits, labels = inputs
    local, mine = local_ids(labels, logits.shape[-1], attrs, "CrossEntropyStats")
    top = np.max(logits, axis=-1)
    total = np.sum(np.exp(logits - top[..., None]), axis=-1)
    picked = np.take_along_axis(logits, local[..., None], axis=-1)[..., 0]
    return (np.stack([top, total, np.where(mine, picked, 0.0)], axis=-1),)


def _parts_log_sum_exp(stats):
    """``(log-sum-exp over the whole vocabulary, the label's logit)`` per position, from
    the parts' statistics ``[..., 3 t]``."""
    parts = stats.reshape(stats.shape[:-1] + (-1, 3))
    top, total, picked = parts[..., 0], parts[..., 1], parts[..., 2]
    overall = np.max(top, axis=-1)
    lse = overall + np.log(np.sum(total * np.exp(top - overall[..., None]), axis=-1))
    return lse, np.sum(picked, axis=-1)


def _from_stats_infer(attrs, ins):
    (stats,) = ins
    require_rank(stats, 1, "CrossEntropyFromStats' statistics")
    _check_stats("CrossEntropyFromStats", stats, stats.shape[:-1])
    _shards(attrs, "CrossEntropyFromStats")
    return (_scalar_like(stats),)


def _from_stats(attrs, inputs):
    lse, picked = _parts_log_sum_exp(inputs[0])
    return (np.asarray(np.sum(lse - picked) / _denominator(attrs, lse.size)),)


register(
    OpSpec(
        "CrossEntropyStats",  # (logits [..., V/t], labels [...]; vocab_index, vocab_parts) -> [..., 3]
        _stats_infer,
        # max, subtract, exp and sum per logit; a pick per position.
        lambda attrs, ins, outs: OpFeatures(
            flops=4 * ins[0].num_elements, mem_bytes=sum(t.num_bytes for t in ins) + outs[0].num_bytes
        ),
        _stats,
        num_inputs=2,
    )
)
register(
    OpSpec(
        "CrossEntropyFromStats",  # (statistics [..., 3 t]; shards=1) -> scalar
        _from_stats_infer,
        lambda attrs, ins, outs: elementwise_features(ins, ins, 2.0),
        _from_stats,
        num_inputs=1,
    )
)
