"""A decoder-only GPT as IR programs: forward, loss, backward and optimizer.

Shapes (letters as in the docstrings of the package): ``B`` batch (an int or a
vector of size variants), ``S`` sequence, ``H`` hidden, ``N`` heads, ``D = H /
N`` head dim, ``F`` MLP inner width, ``V`` vocabulary.

Every block is pre-norm::

    a  = LayerNorm(x)                     [B, S, H]
    qkv = a @ wqkv                        [B, S, 3H]   tp="col"
    -> Reshape [B, S, N, 3D] -> Split q, k, v [B, S, N, D] -> Transpose [B, N, S, D]
    p  = Softmax(CausalMask(Scale(q @ k^T)))   [B, N, S, S]
    c  = p @ v -> Transpose [B, S, N, D] -> Reshape [B, S, H]
    x1 = x + c @ wo                        tp="row"
    x2 = x1 + Gelu(LayerNorm(x1) @ w1) @ w2    w1 tp="col", w2 tp="row"

The columns of ``wqkv`` are ordered head by head, ``[N, 3, D]`` (Megatron's
layout), not ``[3, N, D]``: reshaping to ``[B, S, N, 3D]`` before the split
makes a contiguous column split of ``wqkv`` a split of whole heads, so a
tensor-parallel transform splits the weight and divides ``N`` in the Reshape.

The token table, the LM head ``head.w`` ``[H, V]`` and the cross entropy carry
``tp="vocab"``: a tensor degree that divides ``V`` splits them by vocabulary
(Megatron-LM's vocab-parallel embedding, output layer and loss).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from distir_jax.ir.function import Function, Value
from distir_jax.models._emit import Emitter, check_optimizer, emit_optimizer
from distir_jax.models.config import TransformerConfig, check_batch_size

# Transposes between [B, S, N, D] and [B, N, S, D]; the permutation is its own inverse.
_HEADS_PERM = (0, 2, 1, 3)
_HEADS = {"tp": "heads"}
_VOCAB = {"tp": "vocab"}  # split by vocabulary where the tensor degree divides it
_SHARDED = {"tp": "sharded"}


class _BlockActs(NamedTuple):
    """Forward values of one block that its backward reads."""

    x: Value  # block input [B, S, H]
    ln1: Value
    q: Value  # [B, N, S, D]
    k: Value
    v: Value
    probs: Value  # [B, N, S, S]
    ctx: Value  # [B, S, H], input of the wo MatMul
    x1: Value  # after the attention residual
    ln2: Value
    h1: Value  # [B, S, F], before Gelu
    g: Value  # after Gelu


def _check_config(config) -> TransformerConfig:
    if not isinstance(config, TransformerConfig):
        raise ValueError(f"config must be a TransformerConfig, got config={config!r}")
    return config


def _declare_weights(em: Emitter, cfg: TransformerConfig) -> list[dict[str, Value]]:
    """Declares every weight, layer by layer; returns ``{short name: value}`` per layer."""
    h, f = cfg.hidden, cfg.ffn_hidden
    layers = [
        {
            "embed.tokens": em.weight(0, "embed.tokens", (cfg.vocab_size, h)),
            "embed.pos": em.weight(0, "embed.pos", (cfg.seq_len, h)),
        }
    ]
    shapes = {
        "ln1.gamma": (h,),
        "ln1.beta": (h,),
        "attn.wqkv": (h, 3 * h),
        "attn.wo": (h, h),
        "ln2.gamma": (h,),
        "ln2.beta": (h,),
        "mlp.w1": (h, f),
        "mlp.w2": (f, h),
    }
    for layer in range(1, cfg.num_layers + 1):
        layers.append({name: em.weight(layer, name, shape) for name, shape in shapes.items()})
    head = cfg.num_layers + 1
    layers.append(
        {
            "lnf.gamma": em.weight(head, "lnf.gamma", (h,)),
            "lnf.beta": em.weight(head, "lnf.beta", (h,)),
            "head.w": em.weight(head, "head.w", (h, cfg.vocab_size)),
        }
    )
    return layers


def _block_forward(
    em: Emitter, cfg: TransformerConfig, layer: int, x: Value, w: dict
) -> tuple[_BlockActs, Value]:
    """Emits one block; returns the values its backward reads and its output."""
    em.at(layer, "fwd")
    s, h, n, d = cfg.seq_len, cfg.hidden, cfg.num_heads, cfg.head_dim
    p = f"l{layer}."
    ln1 = em.op("LayerNorm", x, w["ln1.gamma"], w["ln1.beta"], name=p + "ln1", eps=cfg.ln_eps)
    qkv = em.op("MatMul", ln1, w["attn.wqkv"], name=p + "qkv", tp="col")
    qkv = em.op("Reshape", qkv, name=p + "qkv_heads", shape=(-1, s, n, 3 * d), tp_axis=2, **_HEADS)
    parts = em.op("Split", qkv, name=(p + "q_bsnd", p + "k_bsnd", p + "v_bsnd"), axis=3, parts=3, **_HEADS)
    q, k, v = (
        em.op("Transpose", t, name=f"{p}{c}", perm=_HEADS_PERM, **_HEADS)
        for t, c in zip(parts, "qkv", strict=True)
    )
    scores = em.op("MatMul", q, k, name=p + "scores", transpose_b=True, **_HEADS)
    scores = em.op("Scale", scores, name=p + "scaled", factor=1.0 / math.sqrt(d), **_HEADS)
    scores = em.op("CausalMask", scores, name=p + "masked", fill=-1e9, **_HEADS)
    probs = em.op("Softmax", scores, name=p + "probs", axis=-1, **_HEADS)
    ctx = em.op("MatMul", probs, v, name=p + "ctx_bnsd", **_HEADS)
    ctx = em.op("Transpose", ctx, name=p + "ctx_bsnd", perm=_HEADS_PERM, **_HEADS)
    ctx = em.op("Reshape", ctx, name=p + "ctx", shape=(-1, s, h), tp_axis=2, **_HEADS)
    attn = em.op("MatMul", ctx, w["attn.wo"], name=p + "attn", tp="row")
    x1 = em.op("Add", x, attn, name=p + "x1")
    ln2 = em.op("LayerNorm", x1, w["ln2.gamma"], w["ln2.beta"], name=p + "ln2", eps=cfg.ln_eps)
    h1 = em.op("MatMul", ln2, w["mlp.w1"], name=p + "h1", tp="col")
    g = em.op("Gelu", h1, name=p + "gelu", **_SHARDED)
    mlp = em.op("MatMul", g, w["mlp.w2"], name=p + "mlp", tp="row")
    out = em.op("Add", x1, mlp, name=p + "out")
    return _BlockActs(x, ln1, q, k, v, probs, ctx, x1, ln2, h1, g), out


def _flat(em: Emitter, x: Value, width: int, name: str, **tp) -> Value:
    """``[B, S, W] -> [B*S, W]`` for a weight gradient; ``-1`` absorbs the batch."""
    if tp:
        tp = dict(tp, tp_axis=1)
    return em.op("Reshape", x, name=name, shape=(-1, width), **tp)


def _layer_norm_grad(em: Emitter, dy: Value, x: Value, gamma: Value, beta: Value, name: str, eps: float):
    """LayerNormGrad whose outputs 1 and 2 are the gradients of gamma and beta."""
    dx, dgamma, dbeta = em.op(
        "LayerNormGrad",
        dy,
        x,
        gamma,
        name=(name, em.grad_name(gamma), em.grad_name(beta)),
        eps=eps,
        **em.grad_attrs(gamma, beta),
    )
    em.record_grad(gamma, dgamma)
    em.record_grad(beta, dbeta)
    return dx


def _block_backward(
    em: Emitter, cfg: TransformerConfig, layer: int, acts: _BlockActs, dout: Value, w: dict
) -> Value:
    """Emits the block's backward; returns the gradient of its input ``x``."""
    em.at(layer, "bwd")
    s, h, n, d, f = cfg.seq_len, cfg.hidden, cfg.num_heads, cfg.head_dim, cfg.ffn_hidden
    p = f"l{layer}."
    # MLP: out = x1 + gelu(ln2 @ w1) @ w2.
    em.weight_grad(
        "MatMul",
        w["mlp.w2"],
        _flat(em, acts.g, f, p + "gelu_flat", **_SHARDED),
        _flat(em, dout, h, p + "dout_flat"),
        transpose_a=True,
        tp="row",
    )
    dg = em.op("MatMul", dout, w["mlp.w2"], name=p + "dgelu", transpose_b=True, tp="row")
    dh1 = em.op("GeluGrad", dg, acts.h1, name=p + "dh1", **_SHARDED)
    em.weight_grad(
        "MatMul",
        w["mlp.w1"],
        _flat(em, acts.ln2, h, p + "ln2_flat"),
        _flat(em, dh1, f, p + "dh1_flat", **_SHARDED),
        transpose_a=True,
        tp="col",
    )
    dln2 = em.op("MatMul", dh1, w["mlp.w1"], name=p + "dln2", transpose_b=True, tp="col")
    dx1 = _layer_norm_grad(em, dln2, acts.x1, w["ln2.gamma"], w["ln2.beta"], p + "dx1_ln", cfg.ln_eps)
    dx1 = em.op("Add", dout, dx1, name=p + "dx1")

    # Attention: x1 = x + ctx @ wo.
    em.weight_grad(
        "MatMul",
        w["attn.wo"],
        _flat(em, acts.ctx, h, p + "ctx_flat", **_HEADS),
        _flat(em, dx1, h, p + "dx1_flat"),
        transpose_a=True,
        tp="row",
    )
    dctx = em.op("MatMul", dx1, w["attn.wo"], name=p + "dctx", transpose_b=True, tp="row")
    dctx = em.op("Reshape", dctx, name=p + "dctx_bsnd", shape=(-1, s, n, d), tp_axis=2, **_HEADS)
    dctx = em.op("Transpose", dctx, name=p + "dctx_bnsd", perm=_HEADS_PERM, **_HEADS)
    dprobs = em.op("MatMul", dctx, acts.v, name=p + "dprobs", transpose_b=True, **_HEADS)
    dv = em.op("MatMul", acts.probs, dctx, name=p + "dv", transpose_a=True, **_HEADS)
    dscores = em.op("SoftmaxGrad", dprobs, acts.probs, name=p + "dmasked", axis=-1, **_HEADS)
    # The mask's gradient is the mask with fill 0: masked scores got no gradient.
    dscores = em.op("CausalMask", dscores, name=p + "dscaled", fill=0.0, **_HEADS)
    dscores = em.op("Scale", dscores, name=p + "dscores", factor=1.0 / math.sqrt(d), **_HEADS)
    dq = em.op("MatMul", dscores, acts.k, name=p + "dq", **_HEADS)
    dk = em.op("MatMul", dscores, acts.q, name=p + "dk", transpose_a=True, **_HEADS)
    dparts = [
        em.op("Transpose", t, name=f"{p}d{c}_bsnd", perm=_HEADS_PERM, **_HEADS)
        for t, c in zip((dq, dk, dv), "qkv", strict=True)
    ]
    dqkv = em.op("Concat", *dparts, name=p + "dqkv_heads", axis=3, **_HEADS)
    dqkv = em.op("Reshape", dqkv, name=p + "dqkv", shape=(-1, s, 3 * h), tp_axis=2, **_HEADS)
    em.weight_grad(
        "MatMul",
        w["attn.wqkv"],
        _flat(em, acts.ln1, h, p + "ln1_flat"),
        _flat(em, dqkv, 3 * h, p + "dqkv_flat", **_HEADS),
        transpose_a=True,
        tp="col",
    )
    dln1 = em.op("MatMul", dqkv, w["attn.wqkv"], name=p + "dln1", transpose_b=True, tp="col")
    dx = _layer_norm_grad(em, dln1, acts.x, w["ln1.gamma"], w["ln1.beta"], p + "dx_ln", cfg.ln_eps)
    return em.op("Add", dx1, dx, name=p + "dx")


class _Forward(NamedTuple):
    weights: list  # one {short name: Value} per layer 0..L+1
    tokens: Value
    labels: Value  # None for inference
    blocks: list  # _BlockActs per block
    x_final: Value  # last block's output
    lnf: Value
    logits: Value


def _forward(cfg: TransformerConfig, batch_size, name: str, with_labels: bool) -> tuple[Emitter, _Forward]:
    batch = check_batch_size(batch_size)
    em = Emitter(name, cfg.dtype, cfg.resolved_precision)
    tokens = em.data("tokens", (batch, cfg.seq_len), "i32")
    labels = em.data("labels", (batch, cfg.seq_len), "i32") if with_labels else None
    weights = _declare_weights(em, cfg)

    em.at(0, "fwd")
    w0 = weights[0]
    x = em.op("Embedding", w0["embed.tokens"], tokens, name="l0.tok", **_VOCAB)
    # [S, H] broadcasts over the batch, so the table has no batch axis.
    x = em.op("Add", x, w0["embed.pos"], name="l0.out")
    blocks = []
    for layer in range(1, cfg.num_layers + 1):
        acts, x = _block_forward(em, cfg, layer, x, weights[layer])
        blocks.append(acts)

    wf = weights[-1]
    em.at(cfg.num_layers + 1, "fwd")
    lnf = em.op("LayerNorm", x, wf["lnf.gamma"], wf["lnf.beta"], name="lnf", eps=cfg.ln_eps)
    logits = em.op("MatMul", lnf, wf["head.w"], name="logits", **_VOCAB)
    return em, _Forward(weights, tokens, labels, blocks, x, lnf, logits)


def transformer_inference(config: TransformerConfig, batch_size) -> Function:
    """The forward pass: inputs ``tokens`` ``[B, S]`` (i32), the weights; output ``logits`` ``[B, S, V]``."""
    config = _check_config(config)
    em, fwd = _forward(config, batch_size, "transformer_inference", with_labels=False)
    return em.build(fwd.logits)


def transformer_loss(config: TransformerConfig, batch_size) -> Function:
    """The forward pass and the cross-entropy loss (no backward): output ``loss``."""
    config = _check_config(config)
    em, fwd = _forward(config, batch_size, "transformer_loss", with_labels=True)
    return em.build(em.op("SoftmaxCrossEntropy", fwd.logits, fwd.labels, name="loss", shards=1, **_VOCAB))


def transformer_training_step(
    config: TransformerConfig, batch_size, *, optimizer: str = "sgd", lr: float = 1e-3
) -> Function:
    """One training step: forward, loss, backward, optimizer update.

    Args:
      config: the model.
      batch_size: ``B``, an int or a 1-D int array of size variants.
      optimizer: ``"sgd"`` or ``"adam"`` (first step; moments ``{weight}.m`` and
        ``{weight}.v`` are function inputs).
      lr: learning rate.

    Returns:
      A function with inputs ``tokens``, ``labels`` (``[B, S]``, i32), the
      weights (and Adam moments) and outputs ``loss``, then ``{weight}.new`` per
      weight (and ``{weight}.m.new``, ``{weight}.v.new``).
    """
    config = _check_config(config)
    optimizer, lr = check_optimizer(optimizer, lr)
    em, fwd = _forward(config, batch_size, "transformer_training_step", with_labels=True)
    head = config.num_layers + 1
    h, vocab = config.hidden, config.vocab_size
    wf = fwd.weights[-1]

    em.at(head, "fwd")
    loss = em.op("SoftmaxCrossEntropy", fwd.logits, fwd.labels, name="loss", shards=1, **_VOCAB)
    em.at(head, "bwd")
    dlogits = em.op("SoftmaxCrossEntropyGrad", fwd.logits, fwd.labels, name="dlogits", shards=1, **_VOCAB)
    em.weight_grad(
        "MatMul",
        wf["head.w"],
        _flat(em, fwd.lnf, h, "lnf_flat"),
        _flat(em, dlogits, vocab, "dlogits_flat", **_VOCAB),
        transpose_a=True,
        **_VOCAB,
    )
    dlnf = em.op("MatMul", dlogits, wf["head.w"], name="dlnf", transpose_b=True, **_VOCAB)
    dx = _layer_norm_grad(
        em, dlnf, fwd.x_final, wf["lnf.gamma"], wf["lnf.beta"], f"l{head - 1}.dout", config.ln_eps
    )

    for layer in range(config.num_layers, 0, -1):
        dx = _block_backward(em, config, layer, fwd.blocks[layer - 1], dx, fwd.weights[layer])

    em.at(0, "bwd")
    w0 = fwd.weights[0]
    # The positional table was broadcast over the batch, so its gradient sums it.
    em.weight_grad("ReduceSum", w0["embed.pos"], dx, axes=(0,), keepdims=False)
    em.weight_grad("EmbeddingGrad", w0["embed.tokens"], dx, fwd.tokens, num_embeddings=vocab, **_VOCAB)

    return em.build(loss, *emit_optimizer(em, optimizer, lr))
