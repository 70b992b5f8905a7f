"""Small building blocks shared by op shape rules and features."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distir_jax.ir.registry import OpError, OpFeatures
from distir_jax.ir.types import Dim, TensorType, dim_divides, dim_str, dims_equal


def shape_str(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(dim_str(d) for d in shape) + "]"


def require_rank(t: TensorType, min_rank: int, what: str) -> None:
    if t.rank < min_rank:
        raise OpError(f"{what} must have rank >= {min_rank}, got shape {shape_str(t.shape)}")


def require_same_dtype(types: Sequence[TensorType]) -> str:
    dtypes = {t.dtype for t in types}
    if len(dtypes) > 1:
        raise OpError(f"operands must share one dtype, got {sorted(dtypes)}")
    return types[0].dtype


def normalize_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise OpError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank


def broadcast_shapes(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...]:
    """NumPy broadcasting of two shapes whose dims may be size-variant vectors."""
    out = []
    for i in range(max(len(a), len(b))):
        da = a[len(a) - 1 - i] if i < len(a) else 1
        db = b[len(b) - 1 - i] if i < len(b) else 1
        if dims_equal(da, db) or dims_equal(db, 1):
            out.append(da)
        elif dims_equal(da, 1):
            out.append(db)
        else:
            raise OpError(f"shapes {shape_str(a)} and {shape_str(b)} do not broadcast")
    return tuple(reversed(out))


def same_shape(types: Sequence[TensorType], what: str = "operands") -> tuple[Dim, ...]:
    first = types[0]
    for t in types[1:]:
        if t.rank != first.rank or not all(dims_equal(x, y) for x, y in zip(t.shape, first.shape)):
            raise OpError(
                f"{what} must have equal shapes, got " + " and ".join(shape_str(u.shape) for u in types)
            )
    return first.shape


def elementwise_features(ins, outs, flops_per_element: float = 1.0) -> OpFeatures:
    """Roofline features of a memory-bound elementwise op."""
    read = sum(t.num_bytes for t in ins)
    written = sum(t.num_bytes for t in outs)
    elements = sum(t.num_elements for t in outs)
    return OpFeatures(flops=flops_per_element * elements, mem_bytes=read + written)


def free_features(ins, outs) -> OpFeatures:
    """Views (reshape) move no data: only the launch overhead remains."""
    return OpFeatures()


def split_dim(shape: Sequence[Dim], axis: int, parts: int, what: str, pad: bool = False) -> tuple[Dim, ...]:
    """``shape`` with dimension ``axis`` split into ``parts``; with ``pad``, a
    dimension they do not divide is first padded to the next multiple."""
    if not pad and not dim_divides(shape[axis], parts):
        raise OpError(
            f"{what}: dimension {axis} of size {dim_str(shape[axis])} is not divisible by {parts} "
            "(pad=True pads it to a multiple)"
        )
    shape = list(shape)
    shape[axis] = -(-shape[axis] // parts)
    return tuple(shape)


def split_padded(value: np.ndarray, parts: int, axis: int) -> list[np.ndarray]:
    """``value`` split into ``parts`` equal parts along ``axis``, zero-padded first to
    a multiple of ``parts`` where they do not divide it (ZeRO's shards)."""
    missing = -value.shape[axis] % parts
    if missing:
        widths = [(0, 0)] * value.ndim
        widths[axis] = (0, missing)
        value = np.pad(value, widths)
    return np.split(value, parts, axis=axis)
