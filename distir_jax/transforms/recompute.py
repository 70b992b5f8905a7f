"""Activation recomputation (checkpointing): trade compute for activation memory.

A training step keeps forward activations until the backward reads them.
Recomputation keeps fewer of them: right before a block's backward ops it
re-issues copies of (some of) the block's forward ops, and the backward ops
read those fresh copies. The original activations then have their last use in
the forward pass, so the memory model frees them there; the recomputed ones
live only while the block's backward runs.

Policies (Megatron-LM's names):

* ``"none"``: the program unchanged.
* ``"attention"`` (Megatron's *selective* recomputation): only the attention
  core, the ops with ``tp == "heads"``, is recomputed, from the QKV projection
  that is kept. Its largest activation, the ``[B, N, S, S]`` probabilities, is
  never stashed.
* ``"full"``: every forward op of each block ``1..L`` that its backward needs is
  recomputed; only the block's input (the previous block's output) and the
  weights are kept. The embedding (layer 0) and the head (layer ``L + 1``) are
  left alone: their backward follows right after, nothing would be saved.

Recomputed copies are named ``{name}.rc`` and keep the original op's
attributes (``layer``, ``phase="fwd"``, ``tp``, ...) plus ``recompute=True``.
:func:`~distir_jax.transforms.pipeline.pipeline_parallel` runs them in the
backward step of their microbatch, so the two transforms compose when
recomputation is applied first.
"""

from __future__ import annotations

from distir_jax.ir._gc import gc_paused
from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.typecheck import infer_types
from distir_jax.transforms.base import Distributed, Program, as_distributed

RECOMPUTE_POLICIES = ("none", "attention", "full")


@gc_paused
def recompute(program: Program, policy: str) -> Distributed:
    """Re-issues forward ops of each block before its backward.

    Args:
      program: a :class:`Function` following the model contract (ops carry
        ``layer`` and ``phase``), or a :class:`Distributed`.
      policy: ``"none"``, ``"attention"`` or ``"full"`` (see the module
        docstring).

    Returns:
      A :class:`Distributed` with the same inputs and outputs as ``program``
      and extra ops; it computes exactly the same numbers.

    Raises:
      ValueError: for an unknown policy (listing the valid ones) or ops
        without ``layer`` / ``phase`` annotations.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(
            f"unknown recompute policy={policy!r}; valid policies: {', '.join(RECOMPUTE_POLICIES)}"
        )
    dist = as_distributed(program)
    fn = dist.function
    if policy == "none":
        return dist
    if any(v.type is None for op in fn.ops for v in op.outputs):
        fn = infer_types(fn)
    layers = _layers(fn)
    num_blocks = max(layers, default=1) - 1
    if policy == "attention":
        selectable = lambda op: op.attr("tp") == "heads"  # noqa: E731
    else:
        selectable = lambda op: True  # noqa: E731
    plans = {}
    for layer in range(1, num_blocks + 1):
        plan = _plan_layer(fn, layers, layer, selectable)
        if plan is not None:
            plans[layer] = plan
    step = Function(fn.name, fn.inputs, _emit(fn, layers, plans), fn.outputs)
    return dist.then(Distributed.identity(step))


def _layers(fn: Function) -> list[int]:
    layers = []
    for i, op in enumerate(fn.ops):
        layer, phase = op.attr("layer"), op.attr("phase")
        if isinstance(layer, bool) or not isinstance(layer, int) or phase not in ("fwd", "bwd", "opt"):
            raise ValueError(
                f"op #{i} {op.op_type} has layer={layer!r}, phase={phase!r}; recompute needs every op "
                "annotated with an int layer and phase fwd, bwd or opt (the model contract)"
            )
        layers.append(layer)
    return layers


def _plan_layer(fn: Function, layers: list[int], layer: int, selectable):
    """Indices of the forward ops to recompute for ``layer``, and of its first backward op."""
    forward = {
        i
        for i, op in enumerate(fn.ops)
        if layers[i] == layer
        and op.attr("phase") == "fwd"
        and not op.attr("recompute", False)
        and selectable(op)
    }
    backward = [i for i, op in enumerate(fn.ops) if layers[i] == layer and op.attr("phase") == "bwd"]
    if not forward or not backward:
        return None
    producer = fn.producers()
    # Walk back from what the backward reads, through recomputable ops only:
    # anything else (the block input, weights, kept values) is read as is.
    stack = [producer[x.name] for i in backward for x in fn.ops[i].inputs if producer.get(x.name) in forward]
    chosen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in chosen:
            continue
        chosen.add(i)
        stack.extend(producer[x.name] for x in fn.ops[i].inputs if producer.get(x.name) in forward)
    return (sorted(chosen), backward[0]) if chosen else None


def _emit(fn: Function, layers: list[int], plans: dict) -> tuple[Op, ...]:
    taken = set(fn.values())
    renamed: dict[int, dict[str, Value]] = {}  # layer -> original name -> recomputed value
    insert_before = {first: layer for layer, (_, first) in plans.items()}
    ops: list[Op] = []
    for index, op in enumerate(fn.ops):
        if index in insert_before:
            layer = insert_before[index]
            table = renamed.setdefault(layer, {})
            for i in plans[layer][0]:
                original = fn.ops[i]
                outputs = []
                for x in original.outputs:
                    table[x.name] = Value(_fresh(f"{x.name}.rc", taken), x.type)
                    outputs.append(table[x.name])
                inputs = tuple(table.get(x.name, x) for x in original.inputs)
                ops.append(
                    Op(original.op_type, inputs, tuple(outputs), dict(original.attr_dict, recompute=True))
                )
        table = renamed.get(layers[index]) if op.attr("phase") == "bwd" else None
        if table:
            op = Op(op.op_type, tuple(table.get(x.name, x) for x in op.inputs), op.outputs, op.attrs)
        ops.append(op)
    return tuple(ops)


def _fresh(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}{n}", n + 1
    taken.add(candidate)
    return candidate
