"""Readers and a checker for the annotation contract of model programs.

The contract itself is stated in the docstring of :mod:`distir_jax.models`.
Transforms can call :func:`check_contract` on their input and use the readers
below instead of parsing names.
"""

from __future__ import annotations

import collections
import re

from distir_jax.ir.function import Function, Op
from distir_jax.models.config import FP8_COPY_SUFFIXES

PHASES = ("fwd", "bwd", "opt")
TP_HINTS = ("col", "row", "heads", "sharded", "vocab")

_WEIGHT_RE = re.compile(r"^l(\d+)\.")
# Inputs ``{weight}.{suffix}`` that belong to a weight, not weights of their own:
# its optimizer's state, mixed precision's master copy, mixed-fp8's FP8 copies.
_STATE_SUFFIXES = ("m", "v", "master", *FP8_COPY_SUFFIXES)
# Optimizer-phase ops that refresh a weight's FP8 copies rather than update it.
_REFRESH = "CastInto"


def weight_names(fn: Function) -> tuple[str, ...]:
    """Weight inputs (``l{layer}.…``), in declaration order, without Adam moments,
    mixed precision's master copies and mixed-fp8's FP8 copies."""
    names = [v.name for v in fn.inputs if _WEIGHT_RE.match(v.name)]
    present = set(names)

    def optimizer_state(name: str) -> bool:
        base, _, suffix = name.rpartition(".")
        return suffix in _STATE_SUFFIXES and base in present

    return tuple(n for n in names if not optimizer_state(n))


def weight_layer(name: str) -> int:
    """The layer number of weight ``l{layer}.…``."""
    match = _WEIGHT_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a weight name of the form l<layer>.<name>")
    return int(match.group(1))


def grad_of(op: Op) -> tuple[str, ...]:
    """Weights whose gradients ``op`` produces: its last ``len(result)`` outputs, in order."""
    value = op.attr("grad_of")
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def gradient_ops(fn: Function) -> dict[str, tuple[int, int]]:
    """``weight -> (op index, output index)`` of the op output holding its gradient."""
    found = {}
    for index, op in enumerate(fn.ops):
        names = grad_of(op)
        first = len(op.outputs) - len(names)
        for k, name in enumerate(names):
            found[name] = (index, first + k)
    return found


def optimizer_ops(fn: Function) -> dict[str, int]:
    """``weight -> index`` of the optimizer op updating it."""
    return {op.attr("weight"): i for i, op in enumerate(fn.ops) if _updates(op)}


def _updates(op: Op) -> bool:
    """Whether ``op`` is an optimizer op (an FP8 copy's refresh is not)."""
    return op.attr("phase") == "opt" and op.op_type != _REFRESH


def check_contract(fn: Function, *, training: bool = True) -> None:
    """Checks the annotation contract; raises ``ValueError`` listing every violation.

    Args:
      fn: a program built by this package (or transformed so as to keep the
        contract).
      training: also require one gradient op and one optimizer op per weight.
    """
    problems = []
    weights = set(weight_names(fn))
    # The MLP's loss sits one layer past its last weight (L + 1).
    num_layers = max((weight_layer(w) for w in weights), default=0) + 1
    ordered = weight_names(fn)
    for index, op in enumerate(fn.ops):
        where = f"op #{index} {op.op_type}"
        layer, phase = op.attr("layer"), op.attr("phase")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= num_layers:
            problems.append(f"{where}: layer={layer!r} is not an int in [0, {num_layers}]")
        if phase not in PHASES:
            problems.append(f"{where}: phase={phase!r} is not one of {list(PHASES)}")
        tp = op.attr("tp")
        if tp is not None and tp not in TP_HINTS:
            problems.append(f"{where}: tp={tp!r} is not one of {list(TP_HINTS)}")
        names = grad_of(op)
        if len(names) > len(op.outputs):
            problems.append(
                f"{where}: grad_of names {len(names)} weights but the op has {len(op.outputs)} outputs"
            )
        for name in names:
            if name not in weights:
                problems.append(f"{where}: grad_of={name!r} is not a weight input")
            elif weight_layer(name) != layer:
                problems.append(f"{where}: gradient of {name} is emitted at layer {layer}")
        if _updates(op) and op.attr("weight") not in weights:
            problems.append(f"{where}: optimizer op has weight={op.attr('weight')!r}, not a weight input")
    if training:
        grads = collections.Counter(name for op in fn.ops for name in grad_of(op))
        updates = collections.Counter(op.attr("weight") for op in fn.ops if _updates(op))
        for w in ordered:
            if grads[w] != 1:
                problems.append(f"weight {w} has {grads[w]} grad_of ops, expected 1")
            if updates[w] != 1:
                problems.append(f"weight {w} has {updates[w]} optimizer ops, expected 1")
    if problems:
        raise ValueError(f"function {fn.name} breaks the model contract:\n  " + "\n  ".join(problems))
