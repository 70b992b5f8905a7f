"""Model FLOPs: the numerator of model FLOPs utilization (MFU).

MFU (Chowdhery et al., PaLM, 2022, appendix B) divides the FLOP/s a training
run needs by the cluster's peak: the matrix multiplications of one forward and
one backward pass, whatever the strategy spends beyond them (activation
recomputation, optimizer updates, elementwise ops). It compares strategies
on one scale, and a simulated row with a measured run's MFU.

They are counted on the model's own program, not by a formula: every
``MatMul`` of the training step outside the optimizer phase, at the cost
model's ``2 m n k``. For a GPT this is Narayanan et al.'s (2021)
``72 S L H^2 (1 + S / (6 H) + V / (12 H L))`` per sample, with the padded
vocabulary ``V`` (tests check it). FP8 GEMMs (training precision
``mixed-fp8``) count their flops, not the half the cost model charges them.
"""

from __future__ import annotations

import dataclasses
import functools

from distir_jax.ir.registry import op_features

__all__ = ["model_flops_per_sample"]

# Programs of this many layers are counted whole; deeper ones are a 2-layer
# program plus (L - 2) copies of the 3-layer program's extra layer (the first
# and the last layer may differ from the others, the middle ones may not).
_COUNTED_WHOLE = 3


@functools.lru_cache(maxsize=256)
def model_flops_per_sample(config) -> float:
    """Matmul FLOPs of one sample's forward and backward pass (no recomputation,
    no optimizer): a training step of global batch ``B`` needs ``B`` times this.

    Args:
      config: an ``MLPConfig`` or ``TransformerConfig``, or a preset name.
    """
    from distir_jax.models.config import FP8_PRECISIONS, get_model_config

    if isinstance(config, str):
        config = get_model_config(config)
    if config.training_precision in FP8_PRECISIONS:  # the same GEMMs: their flops, not their FP8 cost
        config = dataclasses.replace(config, training_precision=FP8_PRECISIONS[config.training_precision])
    layers = config.num_layers
    if layers <= _COUNTED_WHOLE:
        return _matmul_flops(config)
    two, three = (_matmul_flops(dataclasses.replace(config, num_layers=n)) for n in (2, 3))
    return two + (layers - 2) * (three - two)


def _matmul_flops(config) -> float:
    """Forward and backward matmul FLOPs of a training step of batch 1 (it is
    linear in the batch: every matmul has or contracts the batch axis)."""
    from distir_jax.models import build_training_step

    total = 0.0
    for op in build_training_step(config, 1).ops:
        if op.op_type == "MatMul" and op.attr("phase") != "opt":
            total += float(op_features(op).flops)
    return total
