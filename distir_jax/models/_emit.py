"""Shared machinery of the model builders: annotated op emission and optimizers."""

from __future__ import annotations

import math

from distir_jax.ir.builder import FunctionBuilder
from distir_jax.ir.function import Function, Value
from distir_jax.models.config import F32_GRAD_PRECISIONS, FP8_COPY_SUFFIXES, FP8_PRECISIONS, MASTER_PRECISIONS

OPTIMIZERS = ("sgd", "adam")
PHASES = ("fwd", "bwd", "opt")

# Adam's defaults (Kingma & Ba 2015); the step is the first, so the bias
# correction is 1 / (1 - beta).
ADAM_BETA1 = 0.9
ADAM_BETA2 = 0.999
ADAM_EPS = 1e-8


def check_optimizer(optimizer, lr) -> tuple[str, float]:
    """Validated ``(optimizer, lr)``; raises ``ValueError`` naming the bad one."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got optimizer={optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite number > 0, got lr={lr!r}")
    return optimizer, float(lr)


class Emitter:
    """A :class:`FunctionBuilder` that stamps ``layer`` and ``phase`` on every op.

    The builders set the current layer and phase with :meth:`at` and then emit
    ops with :meth:`op`, so no op can leave without its annotations.
    """

    def __init__(self, name: str, dtype: str, precision: str = "full"):
        self.builder = FunctionBuilder(name)
        self.dtype = dtype
        self.precision = precision
        # Mixed precision sums and all-reduces weight gradients in f32: each is
        # cast as the backward emits it (Megatron-LM's main_grad).
        self.grad_dtype = MASTER_DTYPE if precision in F32_GRAD_PRECISIONS else dtype
        self.casts_grads = self.grad_dtype != dtype
        # The linear layers' GEMMs (the MatMuls tensor parallelism splits by
        # columns or rows, forward and backward) run in FP8 (config.PRECISIONS),
        # their forward inputs cast to f8 (fp8_input).
        self.fp8 = precision in FP8_PRECISIONS
        # Their weights' FP8 copies (Transformer Engine's cached weight and its
        # transpose), by weight name: resident inputs the forward and the data
        # gradient's GEMMs read, refreshed from the weight in the optimizer phase.
        self.fp8_copies: dict[str, dict[bool, Value]] = {}
        self.layer = 0
        self.phase = "fwd"
        self.weights: list[Value] = []
        self._weight_names: set[str] = set()  # a GEMM operand's test: one lookup, not a scan
        # Gradient of each weight, by weight name, as the backward emits it.
        self.grads: dict[str, Value] = {}

    def at(self, layer: int, phase: str) -> Emitter:
        assert phase in PHASES, phase
        self.layer, self.phase = layer, phase
        return self

    def data(self, name: str, shape, dtype: str | None = None) -> Value:
        return self.builder.input(name, shape, dtype or self.dtype)

    def weight(self, layer: int, name: str, shape) -> Value:
        """Declares weight ``l{layer}.{name}`` as a function input."""
        value = self.builder.input(f"l{layer}.{name}", shape, self.dtype)
        self.weights.append(value)
        self._weight_names.add(value.name)
        return value

    def op(self, op_type: str, *inputs: Value, name=None, **attrs):
        if self.fp8 and op_type == "MatMul" and attrs.get("tp") in ("col", "row"):
            attrs.update(fp8=True, dtype=self.dtype)  # the result's: the operands may both be f8
            inputs = tuple(self._fp8_copy(x, bool(attrs.get("transpose_b"))) for x in inputs)
        return self.builder.add(op_type, *inputs, names=name, layer=self.layer, phase=self.phase, **attrs)

    def _fp8_copy(self, x: Value, transposed: bool) -> Value:
        """The FP8 copy a GEMM reads for operand ``x`` if ``x`` is a weight (its
        transpose's for a data gradient, ``x @ W^T``: ``{w}.fp8t``, else
        ``{w}.fp8``), declared as an input on first use; else ``x``."""
        if x.name not in self._weight_names:
            return x
        copies = self.fp8_copies.setdefault(x.name, {})
        if transposed not in copies:
            suffix = FP8_COPY_SUFFIXES[transposed]
            # Same shape as the weight: a transpose's layout is the kernel's business.
            copies[transposed] = self.builder.input(f"{x.name}.{suffix}", x.type.shape, "f8")
        return copies[transposed]

    def fp8_input(self, x: Value, name: str) -> Value:
        """``x`` as an FP8 GEMM reads it and keeps it for the weight's gradient: cast
        to f8 with "mixed-fp8" (Transformer Engine saves this copy, not ``x``; the
        cast is its producer's epilogue, ``fused``), else ``x``."""
        return self.op("Cast", x, name=name, dtype="f8", fused=True) if self.fp8 else x

    def weight_grad(self, op_type: str, weight: Value, *inputs: Value, **attrs) -> Value:
        """Emits the op producing ``weight``'s gradient, named ``{weight}.grad``."""
        grad = self.op(op_type, *inputs, name=self.grad_name(weight), **self.grad_attrs(weight), **attrs)
        return self.record_grad(weight, grad)

    def grad_name(self, weight: Value) -> str:
        """The name of the value the backward computes as ``weight``'s gradient."""
        return f"{weight.name}.grad.{self.dtype}" if self.casts_grads else f"{weight.name}.grad"

    def grad_attrs(self, *weights: Value) -> dict:
        """``grad_of`` for an op computing the gradients of ``weights`` (its last
        outputs), unless each is cast: then the cast carries it."""
        if self.casts_grads:
            return {}
        names = tuple(w.name for w in weights)
        return {"grad_of": names[0] if len(names) == 1 else names}

    def record_grad(self, weight: Value, grad: Value) -> Value:
        """Records ``weight``'s gradient, cast to ``grad_dtype`` first if it is
        not in it; returns what the optimizer will read."""
        if weight.name in self.grads:
            raise AssertionError(f"second gradient of {weight.name}")
        if grad.type.dtype != self.grad_dtype:
            grad = self.op(
                "Cast", grad, name=f"{weight.name}.grad", dtype=self.grad_dtype, grad_of=weight.name
            )
        self.grads[weight.name] = grad
        return grad

    def build(self, *outputs) -> Function:
        return self.builder.build(*outputs)


def weight_layer(weight: Value) -> int:
    """The layer number in a weight name ``l{layer}.…``."""
    return int(weight.name.split(".", 1)[0][1:])


# Mixed precision keeps master weights, optimizer state and (precision "mixed")
# gradient sums in this dtype (see ``distir_jax.models.config.PRECISIONS``).
MASTER_DTYPE = "f32"


def emit_optimizer(em: Emitter, optimizer: str, lr: float) -> list[Value]:
    """Emits one update per weight (declaration order) from ``em.grads``; returns the new state.

    Adam's moments are declared here as function inputs ``{weight}.m`` and
    ``{weight}.v`` (after all weights), so they count as resident memory. In
    mixed precision (``em.precision`` ``mixed`` or ``mixed-half-grads``) each
    weight also has an f32 master copy ``{weight}.master``, the moments are
    f32, and the update runs on the master and writes the weight from it (see
    :mod:`distir_jax.ir.ops_optim`); with ``mixed`` it reads an f32 gradient.

    With ``mixed-fp8``, each weight an FP8 GEMM reads has FP8 copies (see
    :meth:`Emitter.op`), refreshed by a ``CastInto`` before its update.

    Returns:
      The updated weights, then (Adam) each weight's new ``m`` and ``v``, then
      (mixed precision) each weight's new ``master``, then (mixed-fp8) the
      refreshed FP8 copies.
    """
    mixed = em.precision in MASTER_PRECISIONS
    state = {}
    for w in em.weights:
        dtype = MASTER_DTYPE if mixed else w.type.dtype
        names = (("m", "v") if optimizer == "adam" else ()) + (("master",) if mixed else ())
        state[w.name] = [em.builder.input(f"{w.name}.{n}", w.type.shape, dtype) for n in names]
    new_weights, new_moments, new_masters, new_copies = [], [], [], []
    for w in em.weights:
        em.at(weight_layer(w), "opt")
        # Its FP8 copies (mixed-fp8), refreshed in place from the weight the step
        # read, before the update writes it (Transformer Engine refreshes them from
        # the weight at a step's first microbatch: the same bytes and buffers).
        for copy in em.fp8_copies.get(w.name, {}).values():
            new_copies.append(em.op("CastInto", copy, w, name=f"{copy.name}.new"))
        g = em.grads[w.name]
        ins = state[w.name]
        names = (f"{w.name}.new",) + tuple(f"{v.name}.new" for v in ins)
        if optimizer == "sgd":
            outs = em.op("SGD", w, g, *ins, name=names if ins else names[0], lr=lr, weight=w.name)
        else:
            outs = em.op(
                "Adam",
                w,
                g,
                *ins,
                name=names,
                lr=lr,
                beta1=ADAM_BETA1,
                beta2=ADAM_BETA2,
                eps=ADAM_EPS,
                step=1,
                weight=w.name,
            )
        outs = outs if isinstance(outs, tuple) else (outs,)
        new_weights.append(outs[0])
        new_moments += list(outs[1:3] if optimizer == "adam" else ())
        new_masters += [outs[-1]] if mixed else []
    return new_weights + new_moments + new_masters + new_copies
