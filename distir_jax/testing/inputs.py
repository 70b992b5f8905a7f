"""Random input arrays for executing model programs in tests."""

from __future__ import annotations

import numpy as np

from distir_jax.ir.function import Function
from distir_jax.models.config import FP8_COPY_SUFFIXES


def random_inputs(fn: Function, seed: int = 0) -> dict[str, np.ndarray]:
    """Well-conditioned random inputs for ``fn``: small weights, LayerNorm gains
    near 1, non-negative Adam second moments, token ids within the vocabulary
    (the first dimension of ``l0.embed.tokens``, when the model has one), and
    mixed-fp8's FP8 weight copies equal to their weights (executors evaluate
    every float in float64)."""
    rng = np.random.default_rng(seed)
    vocab = next((int(v.type.shape[0]) for v in fn.inputs if v.name.endswith("embed.tokens")), 2)
    values = {}
    for v in fn.inputs:
        shape = tuple(int(d) for d in v.type.shape)
        base, _, suffix = v.name.rpartition(".")
        if suffix in FP8_COPY_SUFFIXES and base in values:  # mixed-fp8: a copy of its weight
            values[v.name] = np.array(values[base], copy=True)
        elif v.type.dtype in ("i32", "i64"):
            values[v.name] = rng.integers(0, vocab, size=shape)
        elif v.name.endswith(".gamma"):
            values[v.name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif v.name.endswith(".v"):
            values[v.name] = rng.uniform(0.0, 0.1, size=shape)
        else:
            values[v.name] = 0.5 * rng.standard_normal(shape)
    return values
