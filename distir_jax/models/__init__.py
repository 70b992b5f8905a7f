"""Model builders: single-device IR programs for training steps and inference.

Builders return a :class:`~distir_jax.ir.Function` on device 0, fully typed.
``mlp_*`` build DistIR's MLP, ``transformer_*`` a decoder-only GPT; each has a
``*_training_step`` (forward, loss, backward, optimizer), an ``*_inference``
(forward to the output / logits) and a ``*_loss`` (forward and loss only, for
evaluation and finite-difference checks). ``batch_size`` is an int or a 1-D int
array of size variants.

Annotation contract (what parallelism transforms may rely on; checked by
:func:`check_contract`):

* **layer / phase.** Every op has attrs ``layer`` (int) and ``phase``
  (``"fwd"``, ``"bwd"`` or ``"opt"``). Layer 0 is the input part (token and
  positional embedding; the MLP has no layer-0 ops), layers ``1..L`` are the
  blocks (MLP: the op using weight ``l{i}.w`` is at layer ``i``), layer
  ``L + 1`` is the final LayerNorm, the LM head and the loss (MLP: the loss).
  A backward op has the layer of the forward op it differentiates; an
  optimizer op has its weight's layer. Ops are emitted as: all forward ops in
  layer order, the loss, all backward ops in reverse layer order, then the
  optimizer ops in weight declaration order.
* **Inputs.** Data first: ``x``, ``target`` (MLP, ``[B, H]``) or ``tokens``,
  ``labels`` (transformer, ``[B, S]``, ``i32``); their batch axis is axis 0.
  Then the weights, named ``l{layer}.{name}`` in layer order: MLP ``l{i}.w``;
  transformer ``l0.embed.tokens`` ``[V, H]``, ``l0.embed.pos`` ``[S, H]``, per
  block ``l{i}.ln1.gamma``, ``l{i}.ln1.beta``, ``l{i}.attn.wqkv`` ``[H, 3H]``
  (grouped-query attention: ``l{i}.attn.wq`` ``[H, H]`` and ``l{i}.attn.wkv``
  ``[H, 2 K D]``), ``l{i}.attn.wo`` ``[H, H]``, ``l{i}.ln2.gamma``, ``l{i}.ln2.beta``,
  ``l{i}.mlp.w1`` ``[H, F]``, ``l{i}.mlp.w2`` ``[F, H]``, and
  ``l{L+1}.lnf.gamma``, ``l{L+1}.lnf.beta``, ``l{L+1}.head.w`` ``[H, V]``
  (untied). Then, with training precision ``mixed-fp8``, the FP8 copies
  ``{weight}.fp8`` and ``{weight}.fp8t`` (``f8``, the weight's shape) of
  each weight an FP8 GEMM reads, in order of first use: the forward MatMul
  reads ``{weight}.fp8`` and the input-gradient MatMul ``{weight}.fp8t``
  instead of the weight (as Transformer Engine caches them). Then, per
  weight, for Adam ``{weight}.m`` and ``{weight}.v``, and for a model in
  ``bf16`` or ``f16`` trained in mixed precision (``mixed``,
  ``mixed-half-grads`` or ``mixed-fp8``) the f32 master copy
  ``{weight}.master`` (Adam's moments are then f32 too).
* **Gradients.** The gradient of weight ``W`` is produced by exactly one op
  with attr ``grad_of``: a str ``"W"`` when the op's (only) output is it, or a
  tuple of weight names for ops whose *last* outputs are those gradients, in
  order (``LayerNormGrad``: ``grad_of=(gamma, beta)`` for outputs 1 and 2).
  Gradient values are named ``{W}.grad``. With training precision ``mixed`` the op
  computing it carries no ``grad_of`` and names its output
  ``{W}.grad.{dtype}``; a ``Cast(dtype="f32")`` right after it (same layer and
  phase) carries ``grad_of`` and outputs ``{W}.grad``, so microbatch sums,
  all-reduces and the update see an f32 gradient. Weight gradients of MatMul weights
  are ``MatMul(flat_x, flat_dy, transpose_a=True)`` on ``[B*S, ·]`` operands
  flattened by ``Reshape(shape=(-1, width))``; ``l0.embed.pos``'s is a
  ``ReduceSum`` over axis 0, ``l0.embed.tokens``'s an ``EmbeddingGrad``.
  There is no gradient for the data inputs.
* **Optimizer.** One ``SGD`` or ``Adam`` op per weight, phase ``"opt"``, attr
  ``weight="W"``, outputs ``{W}.new`` (and ``{W}.m.new``, ``{W}.v.new``; with
  mixed precision ``{W}.master.new`` last, the master copy being the update's
  last operand), aliasing their inputs (in place). With ``mixed-fp8``, before
  it, a ``CastInto(copy, W)`` (phase ``"opt"``, no ``weight`` attr) refreshes
  each FP8 copy of ``W`` in place, output ``{copy}.new``: those outputs come
  last among the function's.
* **Losses.** ``MSELoss`` / ``SoftmaxCrossEntropy`` and their gradients carry
  ``shards=1``: a transform that splits the batch into ``k`` equal parts sets
  ``shards=k`` so that the parts' losses and gradients add up to the
  original's.
* **Batch-agnostic reshapes.** Every ``Reshape`` puts ``-1`` at the batch
  axis, so splitting the batch needs no attribute change.
* **Tensor-parallel hints (attr ``tp``).** ``"col"``: a MatMul whose weight is
  split along its output dim (``attn.wqkv``, ``mlp.w1``; MLP: odd layers);
  ``"row"``: split along its input dim (``attn.wo``, ``mlp.w2``; MLP: even
  layers). The hint is on the forward MatMul ``x @ W``, the input-gradient
  MatMul ``dy @ W^T`` (``transpose_b``) and the weight-gradient MatMul (which
  also has ``grad_of``). ``"heads"``: attention ops between the QKV and the
  output projection, which work per head on ``N / t`` heads under a split of
  degree ``t``; ``"sharded"``: other ops on activations split along their
  last axis between a ``col`` and a ``row`` MatMul (``Gelu``/``GeluGrad``,
  MLP ``Relu``/``ReluGrad``, and the flattening Reshapes of such values).
  ``"vocab"``: ops on the vocabulary axis (the token ``Embedding`` and its
  ``EmbeddingGrad``, the LM head's three MatMuls, the flattened logits
  gradient, ``SoftmaxCrossEntropy`` and its gradient), split by vocabulary
  when the degree divides it, else whole.
  Every ``Reshape`` with a ``tp`` hint also has ``tp_axis``: the entry of its
  ``shape`` attr that a split of degree ``t`` divides by ``t``. Ops without
  ``tp`` work on whole (replicated) tensors. ``wqkv``'s columns are ordered
  ``[N, 3, D]`` (``wkv``'s ``[K, 2, D]``) so that a contiguous column split
  splits whole heads. A Reshape whose ``tp_axis`` entry counts key / value
  heads also has ``tp_dim="num_kv_heads"`` (what an error names).
* **Outputs.** Training: ``loss``, then the updated weights in declaration
  order, then (Adam) ``{W}.m.new`` and ``{W}.v.new`` per weight, then (mixed
  precision) ``{W}.master.new`` per weight. Inference:
  ``logits`` ``[B, S, V]`` (transformer) or ``l{L}.h`` ``[B, H]`` (MLP).
"""

from distir_jax.ir._gc import gc_paused
from distir_jax.models.config import (
    MLPConfig,
    TransformerConfig,
    check_batch_size,
    get_model_config,
    model_names,
)
from distir_jax.models.contract import (
    check_contract,
    gradient_ops,
    optimizer_ops,
    weight_layer,
    weight_names,
)
from distir_jax.models.custom import load_models, register_model
from distir_jax.models.flops import model_flops_per_sample
from distir_jax.models.mlp import mlp_inference, mlp_loss, mlp_training_step
from distir_jax.models.transformer import (
    transformer_inference,
    transformer_loss,
    transformer_training_step,
)

__all__ = [
    "MLPConfig",
    "TransformerConfig",
    "build_inference",
    "build_training_step",
    "check_batch_size",
    "check_contract",
    "get_model_config",
    "gradient_ops",
    "load_models",
    "mlp_inference",
    "mlp_loss",
    "mlp_training_step",
    "model_flops_per_sample",
    "model_names",
    "optimizer_ops",
    "register_model",
    "transformer_inference",
    "transformer_loss",
    "transformer_training_step",
    "weight_layer",
    "weight_names",
]


@gc_paused
def build_training_step(config, batch_size, *, optimizer: str = "sgd", lr: float = 1e-3):
    """The training step of either model kind; ``config`` may be a preset name."""
    if isinstance(config, str):
        config = get_model_config(config)
    builder = mlp_training_step if isinstance(config, MLPConfig) else transformer_training_step
    return builder(config, batch_size, optimizer=optimizer, lr=lr)


@gc_paused
def build_inference(config, batch_size):
    """The inference program of either model kind; ``config`` may be a preset name."""
    if isinstance(config, str):
        config = get_model_config(config)
    builder = mlp_inference if isinstance(config, MLPConfig) else transformer_inference
    return builder(config, batch_size)
