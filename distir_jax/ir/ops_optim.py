"""Optimizer update op types.

Updates are in place: each new state tensor aliases the old one (``aliases``),
so a training step allocates no second copy of the weights or moments.

Mixed precision, as models are trained in bf16 / f16: an update may take a
last operand, the weight's master copy in a wider float dtype (f32), and the
optimizer state (Adam's moments) is in that dtype too. The update then runs
on the master (the gradient, in the weight's dtype or f32, read as it is) and writes the
weight, in place in its own dtype, from the new master: per parameter the
weight's 2 bytes plus 12 of f32 master and moments resident, as Megatron-LM
and DeepSpeed keep them.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir.ops_compute import float_attr, int_attr, require_float_dtype
from distir_jax.ir.registry import OpError, OpFeatures, OpSpec, register
from distir_jax.ir.shape_rules import elementwise_features, require_same_dtype, same_shape

# --------------------------------------------------------------------------- #
# Operands shared by the updates: (w, g, state..., [master]).


def _state_types(ins, op: str, what: str, has_master: bool) -> tuple:
    """Checks an update's operands (``what`` names them): every operand has the
    weight's shape; the rest (the optimizer state, then a master copy if there
    is one) share a float dtype, which may be wider than the weight's only with
    a master copy (mixed precision); the gradient has the weight's dtype (Adam's
    a float one), or with a master copy the master's. Returns the types of the rest."""
    same_shape(ins, what)
    if op == "Adam":  # (SGD's arithmetic is defined on any numbers)
        require_float_dtype(ins[0], f"{op}'s weight")
    state = tuple(ins[2:])
    if state:
        require_same_dtype(state)
        require_float_dtype(state[0], f"{op}'s state and master copy")
    w, g = ins[:2]
    if not (g.dtype == w.dtype or (has_master and g.dtype == state[-1].dtype)):
        wider = f" or its master copy's {state[-1].dtype}" if has_master else ""
        raise OpError(f"{op}'s gradient is {g.dtype}; expected its weight's dtype {w.dtype}{wider}")
    return state


# --------------------------------------------------------------------------- #
# SGD: w - lr * g.


def _sgd_infer(attrs, ins):
    if len(ins) not in (2, 3):
        raise OpError(
            f"SGD takes a weight, its gradient and optionally an f32 master copy, got {len(ins)} operands"
        )
    w = ins[0]
    state = _state_types(ins, "SGD", "SGD's weight, gradient and master copy", len(ins) == 3)
    float_attr(attrs, "lr", "SGD")
    return (w,) + tuple(state)


def _sgd_features(attrs, ins, outs):
    # With a master copy the weight is only written (from the new master).
    read = ins[1:] if len(ins) == 3 else ins
    return elementwise_features(read, outs, 2.0 / len(outs))


def _sgd_eval(attrs, inputs):
    lr = float(attrs["lr"])
    if len(inputs) == 3:
        master = inputs[2] - lr * inputs[1]
        return (master.astype(inputs[0].dtype), master)
    return (inputs[0] - lr * inputs[1],)


register(
    OpSpec(
        "SGD",  # (w, g[, master]; lr) -> w - lr * g (master - lr * g, and w from it)
        _sgd_infer,
        _sgd_features,
        _sgd_eval,
        aliases=((0, 0), (1, 2)),
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
    if len(ins) not in (4, 5):
        raise OpError(
            f"Adam takes w, g, m, v and optionally an f32 master copy of w, got {len(ins)} operands"
        )
    w = ins[0]
    state = _state_types(ins, "Adam", "Adam's w, g, m, v and master copy", len(ins) == 5)
    if len(ins) == 4 and state[0].dtype != w.dtype:
        raise OpError(
            f"Adam's moments are {state[0].dtype} and its weight {w.dtype}: moments wider than the "
            "weight need its master copy in their dtype (a fifth operand)"
        )
    _adam_hyper(attrs)
    return (w,) + tuple(state)


def _adam_features(attrs, ins, outs):
    # elementwise_features counts flops per output element; Adam has three or
    # four outputs per weight element, so count against the weight instead.
    # With a master copy the weight is only written (from the new master).
    base = elementwise_features(ins[1:] if len(ins) == 5 else ins, outs, 0.0)
    return OpFeatures(flops=_ADAM_FLOPS_PER_ELEMENT * ins[0].num_elements, mem_bytes=base.mem_bytes)


def _adam_eval(attrs, inputs):
    lr, beta1, beta2, eps, step = _adam_hyper(attrs)
    w, g, m, v = inputs[:4]
    m_new = beta1 * m + (1.0 - beta1) * g
    v_new = beta2 * v + (1.0 - beta2) * g * g
    m_hat = m_new / (1.0 - beta1**step)
    v_hat = v_new / (1.0 - beta2**step)
    master = inputs[4] if len(inputs) == 5 else w
    new = master - lr * m_hat / (np.sqrt(v_hat) + eps)
    if len(inputs) == 5:
        return (new.astype(w.dtype), m_new, v_new, new)
    return (new, m_new, v_new)


register(
    OpSpec(
        "Adam",  # (w, g, m, v[, master]; lr, beta1, beta2, eps, step) -> (w', m', v'[, master'])
        _adam_infer,
        _adam_features,
        _adam_eval,
        # w' overwrites w, m' overwrites m, v' overwrites v, master' overwrites master.
        aliases=((0, 0), (1, 2), (2, 3), (3, 4)),
    )
)
