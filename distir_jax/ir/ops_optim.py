"""Optimizer update op types.

Updates are in place: each new state tensor aliases the old one (``aliases``),
so a training step allocates no second copy of the weights or moments.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.ops_compute import float_attr, int_attr, require_float_dtype
from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, register
from distir_jax.ir.shape_rules import elementwise_features, require_same_dtype, same_shape

# --------------------------------------------------------------------------- #
# SGD: w - lr * g.


def _sgd_infer(attrs, ins):
    w, g = ins
    same_shape(ins, "SGD's weight and gradient")
    require_same_dtype(ins)
    float_attr(attrs, "lr", "SGD")
    return (w,)


register(
    OpSpec(
        "SGD",  # (w, g; lr) -> w - lr * g
        _sgd_infer,
        lambda attrs, ins, outs: elementwise_features(ins, outs, 2.0),
        lambda attrs, inputs: (inputs[0] - float(attrs["lr"]) * inputs[1],),
        num_inputs=2,
        aliases=((0, 0),),
    )
)

# --------------------------------------------------------------------------- #
# Adam with bias correction.

# Per element: two moment updates (3 + 4), two bias corrections, sqrt, add
# eps, divide, scale by lr and subtract.
_ADAM_FLOPS_PER_ELEMENT = 14.0


def _adam_hyper(attrs):
    """Validated ``(lr, beta1, beta2, eps, step)``; raises :class:`OpError`."""
    lr = float_attr(attrs, "lr", "Adam")
    beta1 = float_attr(attrs, "beta1", "Adam", 0.9)
    beta2 = float_attr(attrs, "beta2", "Adam", 0.999)
    eps = float_attr(attrs, "eps", "Adam", 1e-8)
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise OpError(f"Adam's {name} must be in [0, 1), got {name}={beta}")
    if eps <= 0.0:
        raise OpError(f"Adam's eps must be > 0, got eps={eps}")
    # Bias correction divides by 1 - beta^step, which is 0 at step 0.
    step = int_attr(attrs, "step", "Adam", 1, minimum=1)
    return lr, beta1, beta2, eps, step


def _adam_infer(attrs, ins):
    w = ins[0]
    same_shape(ins, "Adam's w, g, m and v")
    require_float_dtype(w, "Adam's weight")
    require_same_dtype(ins)
    _adam_hyper(attrs)
    return (w, w, w)


def _adam_features(attrs, ins, outs):
    # elementwise_features counts flops per output element; Adam has three
    # outputs per weight element, so count against the weight instead.
    base = elementwise_features(ins, outs, 0.0)
    return OpFeatures(flops=_ADAM_FLOPS_PER_ELEMENT * ins[0].num_elements, mem_bytes=base.mem_bytes)


def _adam_eval(attrs, inputs):
    lr, beta1, beta2, eps, step = _adam_hyper(attrs)
    w, g, m, v = inputs
    m_new = beta1 * m + (1.0 - beta1) * g
    v_new = beta2 * v + (1.0 - beta2) * g * g
    m_hat = m_new / (1.0 - beta1**step)
    v_hat = v_new / (1.0 - beta2**step)
    w_new = w - lr * m_hat / (np.sqrt(v_hat) + eps)
    return (w_new, m_new, v_new)


register(
    OpSpec(
        "Adam",  # (w, g, m, v; lr, beta1, beta2, eps, step) -> (w', m', v')
        _adam_infer,
        _adam_features,
        _adam_eval,
        num_inputs=4,
        # w' overwrites w, m' overwrites m, v' overwrites v.
        aliases=((0, 0), (1, 2), (2, 3)),
    )
)
