"""Layout op types: Reshape, Transpose, Concat, Split, Shard and ReduceSum.

Shape attributes are plain ints; size variants enter only through the operand
types, so ``Reshape``'s ``-1`` is where a variant dimension flows through.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.ops_compute import int_attr
from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, register
from distir_jax.ir.shape_rules import (
    elementwise_features,
    free_features,
    normalize_axis,
    require_same_dtype,
    shape_str,
    split_dim,
    split_padded,
)
from distir_jax.ir.types import dim_divides, dim_str, dims_equal


def _int_tuple(attrs, key, op_name):
    value = attrs.get(key)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (int(value),)
    if not isinstance(value, tuple) or not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
    ):
        raise OpError(f"{op_name} needs attribute {key} = a tuple of ints, got {key}={value!r}")
    return tuple(int(v) for v in value)


def _copy(x):
    # A fresh array, so no later consumer can observe a view of an operand.
    return np.array(x, copy=True)


# --------------------------------------------------------------------------- #
# Reshape(x; shape) with at most one -1 inferred from the element count.


def _reshape_infer(attrs, ins):
    (x,) = ins
    target = _int_tuple(attrs, "shape", "Reshape")
    if sum(d == -1 for d in target) > 1 or any(d < -1 for d in target):
        raise OpError(f"Reshape's shape {target} may hold at most one -1 and otherwise sizes >= 0")
    total = x.num_elements
    known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
    if -1 not in target:
        if not dims_equal(total, known):
            raise OpError(
                f"Reshape cannot turn {shape_str(x.shape)} ({dim_str(total)} elements) into "
                f"shape={target} ({known} elements)"
            )
        return (x.with_shape(target),)
    if known == 0 or not dim_divides(total, known):
        raise OpError(
            f"Reshape cannot infer the -1 in shape={target}: {shape_str(x.shape)} has "
            f"{dim_str(total)} elements, not a multiple of {known}"
        )
    inferred = total // known
    return (x.with_shape(tuple(inferred if d == -1 else d for d in target)),)


register(
    OpSpec(
        "Reshape",  # (x; shape)
        _reshape_infer,
        lambda attrs, ins, outs: free_features(ins, outs),
        lambda attrs, inputs: (_copy(np.reshape(inputs[0], tuple(attrs["shape"]))),),
        num_inputs=1,
        aliases=((0, 0),),  # a view: the result shares its operand's buffer
    )
)

# --------------------------------------------------------------------------- #
# Transpose(x; perm).


def _transpose_infer(attrs, ins):
    (x,) = ins
    perm = _int_tuple(attrs, "perm", "Transpose")
    if sorted(perm) != list(range(x.rank)):
        raise OpError(
            f"Transpose's perm={perm} is not a permutation of the {x.rank} axes of {shape_str(x.shape)}"
        )
    return (x.with_shape(tuple(x.shape[p] for p in perm)),)


register(
    OpSpec(
        "Transpose",  # (x; perm)
        _transpose_infer,
        # Unlike Reshape, a transpose moves every element.
        lambda attrs, ins, outs: elementwise_features(ins, outs, 0.0),
        lambda attrs, inputs: (_copy(np.transpose(inputs[0], tuple(attrs["perm"]))),),
        num_inputs=1,
    )
)

# --------------------------------------------------------------------------- #
# Concat(*xs; axis=0) and Split(x; axis=0, parts).


def _concat_infer(attrs, ins):
    if not ins:
        raise OpError("Concat needs at least one operand")
    first = ins[0]
    axis = normalize_axis(int_attr(attrs, "axis", "Concat", 0), first.rank)
    require_same_dtype(ins)
    for t in ins[1:]:
        if t.rank != first.rank or not all(
            dims_equal(a, b) for i, (a, b) in enumerate(zip(t.shape, first.shape, strict=True)) if i != axis
        ):
            raise OpError(
                f"Concat along axis {axis} needs equal shapes elsewhere, got "
                + " and ".join(shape_str(u.shape) for u in ins)
            )
    shape = list(first.shape)
    shape[axis] = sum((t.shape[axis] for t in ins[1:]), first.shape[axis])
    return (first.with_shape(shape),)


register(
    OpSpec(
        "Concat",  # (*xs; axis=0)
        _concat_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs, 0.0),
        lambda attrs, inputs: (np.concatenate(inputs, axis=int(attrs.get("axis", 0))),),
        num_inputs=None,
    )
)


def _split_infer(attrs, ins):
    (x,) = ins
    parts = int_attr(attrs, "parts", "Split", minimum=1)
    axis = normalize_axis(int_attr(attrs, "axis", "Split", 0), x.rank)
    if not dim_divides(x.shape[axis], parts):
        raise OpError(
            f"Split: dimension {axis} of {shape_str(x.shape)} (size {dim_str(x.shape[axis])}) "
            f"is not divisible by parts={parts}"
        )
    shape = list(x.shape)
    shape[axis] = shape[axis] // parts
    return tuple(x.with_shape(shape) for _ in range(parts))


register(
    OpSpec(
        "Split",  # (x; axis=0, parts) -> parts equal pieces
        _split_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs, 0.0),
        lambda attrs, inputs: tuple(
            _copy(p) for p in np.split(inputs[0], int(attrs["parts"]), axis=int(attrs.get("axis", 0)))
        ),
        num_inputs=1,
    )
)

# --------------------------------------------------------------------------- #
# Shard(x; axis=0, parts, index, pad=False): part `index` of `parts` equal parts
# of x along `axis`, as a view (ZeRO's shard of a weight, which the update
# writes in place and an in-place AllGather then fills back). With pad=True a
# dimension `parts` does not divide is padded with zeros to the next multiple
# first, as ZeRO pads its flat buffers; the view still counts only x's bytes.


def _shard_infer(attrs, ins):
    (x,) = ins
    parts = int_attr(attrs, "parts", "Shard", minimum=1)
    index = int_attr(attrs, "index", "Shard", minimum=0)
    if index >= parts:
        raise OpError(f"Shard's index must be in [0, {parts - 1}] for parts={parts}, got index={index}")
    axis = normalize_axis(int_attr(attrs, "axis", "Shard", 0), x.rank)
    return (x.with_shape(split_dim(x.shape, axis, parts, "Shard", bool(attrs.get("pad")))),)


def _shard_eval(attrs, inputs):
    parts = split_padded(inputs[0], int(attrs["parts"]), int(attrs.get("axis", 0)))
    return (_copy(parts[int(attrs["index"])]),)


register(
    OpSpec(
        "Shard",  # (x; axis=0, parts, index, pad=False) -> one part, a view
        _shard_infer,
        lambda attrs, ins, outs: OpFeatures(launches=0),  # an offset into x: no kernel at all
        _shard_eval,
        num_inputs=1,
        aliases=((0, 0),),  # a view: the result shares its operand's buffer
    )
)

# --------------------------------------------------------------------------- #
# ReduceSum(x; axes, keepdims=False).


def _reduce_axes(attrs, rank):
    axes = tuple(normalize_axis(a, rank) for a in _int_tuple(attrs, "axes", "ReduceSum"))
    if len(set(axes)) != len(axes):
        raise OpError(f"ReduceSum's axes={attrs['axes']} name an axis twice")
    return axes


def _reduce_sum_infer(attrs, ins):
    (x,) = ins
    axes = _reduce_axes(attrs, x.rank)
    keepdims = attrs.get("keepdims", False)
    if not isinstance(keepdims, bool):
        raise OpError(f"ReduceSum's keepdims must be a bool, got keepdims={keepdims!r}")
    if keepdims:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return (x.with_shape(shape),)


def _reduce_sum(attrs, inputs):
    (x,) = inputs
    axes = tuple(a % x.ndim for a in _int_tuple(attrs, "axes", "ReduceSum"))
    keepdims = bool(attrs.get("keepdims", False))
    # dtype=x.dtype: NumPy would otherwise widen small integer sums.
    return (np.asarray(np.sum(x, axis=axes, keepdims=keepdims, dtype=x.dtype)),)


register(
    OpSpec(
        "ReduceSum",  # (x; axes, keepdims=False)
        _reduce_sum_infer,
        lambda attrs, ins, outs: OpFeatures(
            flops=ins[0].num_elements, mem_bytes=ins[0].num_bytes + outs[0].num_bytes
        ),
        _reduce_sum,
        num_inputs=1,
    )
)
