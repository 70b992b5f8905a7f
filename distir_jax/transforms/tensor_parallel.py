"""Megatron-style tensor (horizontal) parallelism, optionally with sequence parallelism.

:func:`tensor_parallel` splits every op annotated by the model builders' ``tp``
hints (see :mod:`distir_jax.models`) across ``t`` ranks and runs everything
else redundantly on each rank. Rank ``r`` of old device ``d`` is new device
``r * D + d`` (``D``: device count of the input program).

Where the collectives go, without sequence parallelism (Megatron-LM, Shoeybi
et al. 2019). Per transformer block:

* forward: the attention and MLP inputs (LayerNorm outputs) are replicated, so
  the ``col`` MatMuls (``attn.wqkv``, ``mlp.w1``) read them directly (Megatron's
  ``f``: identity); each ``row`` MatMul (``attn.wo``, ``mlp.w2``) leaves
  partial sums that one ``AllReduce`` (``g``) completes just before the
  residual ``Add``: **2 all-reduces**.
* backward: the ``row`` MatMuls' input and weight gradients read the
  replicated output gradient (``g``'s backward: identity); each ``col``
  MatMul's input gradient is a partial sum that one ``AllReduce`` (``f``'s
  backward) completes just before the ``LayerNormGrad``: **2 all-reduces**.
* weight gradients of split weights are local; LayerNorm gradients are
  computed redundantly from replicated values: no communication.

Vocabulary parallelism (ops with ``tp="vocab"``, where ``t`` divides the
vocabulary ``V``; else they work on whole values): rank ``r`` holds rows
``[r V / t, (r + 1) V / t)`` of the token table and those columns of the LM
head, as Megatron-LM's ``VocabParallelEmbedding`` and parallel output layer.

* forward: each rank looks up the tokens in its rows (zeros for the others),
  and one ``AllReduce`` sums the parts; the head is a ``col`` MatMul whose
  logits stay split by vocabulary; each rank computes ``CrossEntropyStats``
  of its logits (max, sum of exponentials, the label's logit when it is
  one of its tokens), one ``AllGather`` sets the ranks' statistics side by
  side (``[B, S, 3 t]``), and the loss follows from them
  (``CrossEntropyFromStats``);
* backward: each rank's logits gradient comes from its logits and the
  gathered statistics (no communication), the head's input gradient is a
  partial sum (one ``AllReduce``), and each rank scatters the embedding
  gradient into its own rows.

The MLP (columns on odd layers, rows on even ones) gets one ``AllReduce``
before each ``row`` layer's ``Relu`` and one before the ``ReluGrad`` under each
``col`` layer's input gradient; a last ``col`` layer's output is gathered
(``AllGather`` along features) before the loss.

With ``sequence_parallel=True`` (Korthikanti et al. 2022) the replicated
regions (LayerNorms, residual adds, the MLP's row-layer activations) hold
``1 / t`` of the **sequence axis: axis -2**, i.e. ``S`` of ``[B, S, H]`` (the
token, i.e. batch, axis of the MLP's ``[B, H]``). Per block:

* forward: ``AllGather`` along the sequence of each LayerNorm output before
  its ``col`` MatMul, ``ReduceScatter`` along the sequence of each ``row``
  output before the residual ``Add`` (2 + 2);
* backward: ``AllGather`` of the output gradient before each ``row`` MatMul's
  gradients (the conjugate of the reduce-scatter), ``AllGather`` again of each
  LayerNorm output for the ``col`` weight gradient (re-gathered, as Megatron
  does, instead of keeping the forward's copy alive), ``ReduceScatter`` of each
  ``col`` input gradient into its ``LayerNormGrad`` (4 + 2);
* optimizer: LayerNorm gains and biases get an ``AllReduce`` of their
  gradients, which are partial sums over sequence parts, in place, right
  before their updates (data parallelism then reduces the partial sums in the
  backward pass and the sync sums the reduced ones, Megatron-LM's order: see
  :mod:`~distir_jax.transforms.data_parallel`).

The embedding's partial sums are reduce-scattered along the sequence (a
vocabulary the degree does not divide: its replicated output is cut locally,
a ``Split``), the LM head reads the final LayerNorm's output gathered along
the sequence, the head's input gradient is reduce-scattered (cut locally
when whole), and the embedding gradients read the first block's input
gradient gathered along the sequence.

Collectives are placed lazily, right before the first op that needs the
converted value, and carry that op's ``layer`` and ``phase``.
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir._gc import gc_paused
from distir_jax.ir.function import Function
from distir_jax.ir.typecheck import infer_types
from distir_jax.ir.types import dim_divides, dim_str
from distir_jax.transforms.base import Distributed, Program, as_distributed
from distir_jax.transforms.tensor_parallel_rewrite import Rewriter

__all__ = ["tensor_parallel"]

# Model-level names of the dimensions a split divides, by weight name.
_WEIGHT_DIMS = {
    "attn.wqkv": "3 * hidden",
    "attn.wq": "hidden",
    "attn.wkv": "2 * num_kv_heads * head_dim",
    "attn.wo": "hidden",
    "mlp.w1": "ffn_hidden",
    "mlp.w2": "ffn_hidden",
}


@gc_paused
def tensor_parallel(
    program: Program,
    degree: int,
    *,
    sequence_parallel: bool = False,
    representative_only: bool = False,
) -> Distributed:
    """Splits a program's ``tp``-annotated ops across ``degree`` ranks (Megatron-LM).

    Args:
      program: a :class:`Function` built by :mod:`distir_jax.models` (training
        step, loss or inference), or a :class:`Distributed` whose function
        kept the ``tp`` / ``tp_axis`` annotations (e.g. an earlier
        ``tensor_parallel``: splits compose, ``t1 * t2`` ranks in all; the
        vocabulary is split once, its ops lose their hint, and a second
        split keeps each part whole).
      degree: ``t``, the number of ranks; 1 returns ``program`` unchanged.
      sequence_parallel: also split the replicated regions along the
        sequence axis (-2), trading all-reduces for reduce-scatters and
        all-gathers (Megatron-3). The sequence length (MLP: the batch) must
        be divisible by ``degree``.
      representative_only: build rank 0's ops only (devices numbered as in
        the full program); every inserted collective gets a ``group``
        attribute naming all ``t`` ranks' devices, so rank 0's simulated step
        time and peak memory equal the full program's. The result is for
        simulation: it cannot be executed for numbers, and its ``outputs``
        rebuild only the replicated original outputs.

    Returns:
      A :class:`Distributed` relating the new program to the original one:
      split weights (and their Adam moments) are ``InputSlice`` parts along
      the split axis (``col``: output dim, axis 1 of ``[H, F]``; ``row``: input
      dim, axis 0), updated split weights are rebuilt by ``"concat"`` along
      that axis (the token table and LM head along the vocabulary, when
      split), replicated results (the loss, LayerNorm parameters) by
      ``"replica"``, split outputs of inference programs (the logits, split
      by vocabulary) by ``"concat"`` along their split axis, partial sums
      (none in the models' programs) by ``"sum"``.

    Raises:
      ValueError: for ``degree`` not an int >= 1; when ``degree`` does not
        divide ``num_heads``, ``hidden``, ``ffn_hidden`` or another split
        dimension (naming it); with ``sequence_parallel`` when it does not
        divide the sequence axis; for a program without ``tp`` hints or
        with hints that contradict each other.
    """
    if isinstance(degree, (bool, np.bool_)) or not isinstance(degree, (int, np.integer)) or degree < 1:
        raise ValueError(
            f"tensor_parallel: degree must be an int >= 1 (the number of tensor-parallel ranks), "
            f"got degree={degree!r}"
        )
    degree = int(degree)
    base = as_distributed(program)
    if degree == 1:
        return base
    fn = base.function
    if any(v.type is None for op in fn.ops for v in op.outputs):
        fn = infer_types(fn)
    _check_hints(fn)
    _check_divisible(fn, degree)
    rewriter = Rewriter(
        fn, degree, sequence_parallel=bool(sequence_parallel), representative_only=bool(representative_only)
    )
    rewriter.run()
    outputs, recipes = rewriter.outputs()
    suffix = f"tp{degree}_rank0" if representative_only else f"tp{degree}"
    new_fn = Function(f"{fn.name}.{suffix}", tuple(rewriter.inputs()), tuple(rewriter.ops), tuple(outputs))
    if representative_only:
        # Keep only the original outputs whose every part rank 0 can rebuild.
        kept = {k: r for k, r in base.outputs.items() if all(leaf in recipes for leaf in r.leaves())}
        base = Distributed(base.function, base.inputs, kept)
    return base.then(Distributed(new_fn, rewriter.slices, recipes))


def _check_hints(fn: Function) -> None:
    if not any(op.attr("tp") in ("col", "row") for op in fn.ops):
        raise ValueError(
            f"tensor_parallel: function {fn.name} has no MatMul with a tp='col' or tp='row' hint, so "
            "there is nothing to split; build it with distir_jax.models (or annotate it the same way)"
        )


def _dim_name(weight: str, axis: int) -> str:
    for key, label in _WEIGHT_DIMS.items():
        if key in weight:
            return label
    # DistIR's MLP: square [hidden, hidden] weights l{i}.w.
    if weight.split(".")[1:2] == ["w"]:
        return "hidden"
    return f"dimension {axis} of %{weight}"


def _check_divisible(fn: Function, degree: int) -> None:
    """Raises one error naming each distinct dimension that ``degree`` does not divide."""
    problems: dict[str, str] = {}  # "name=size" -> where it was found (first place)
    widths: dict[str, str] = {}  # split widths of other Reshapes, reported if nothing else is
    for op in fn.ops:
        hint = op.attr("tp")
        if op.op_type == "MatMul" and hint in ("col", "row") and not op.attr("transpose_a", False):
            weight = op.inputs[1]
            axis = weight.type.rank - (1 if hint == "col" else 2)
            size = weight.type.shape[axis]
            if not dim_divides(size, degree):
                which = "output" if hint == "col" else "input"
                problems.setdefault(
                    f"{_dim_name(weight.name, axis)}={dim_str(size)}",
                    f"the {which} dim of %{weight.name}, split by tp={hint!r} MatMuls",
                )
        tp_axis = op.attr("tp_axis")
        # tp="vocab" splits only a vocabulary the degree divides (else keeps it whole).
        if op.op_type == "Reshape" and hint not in (None, "vocab") and tp_axis is not None:
            shape = tuple(op.attr("shape"))
            if shape[tp_axis] % degree:
                where = f"entry {tp_axis} of shape={shape} of Reshape %{op.outputs[0].name}"
                if hint == "heads" and len(shape) == 4:
                    heads = op.attr("tp_dim") or "num_heads"  # or the key / value heads
                    problems.setdefault(f"{heads}={shape[tp_axis]}", f"the heads, {where}")
                else:
                    widths.setdefault(f"the split width {shape[tp_axis]}", where)
    problems = problems or widths
    if problems:
        listed = "; ".join(f"{dim} ({where})" for dim, where in problems.items())
        raise ValueError(
            f"tensor_parallel: degree={degree} must divide {listed}. Choose a tensor-parallel degree "
            "that divides the number of heads and every split width."
        )
