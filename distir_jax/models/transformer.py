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

With grouped-query attention (``num_kv_heads`` ``K < N``, each key / value head
serving ``G = N / K`` query heads) the projections are two weights,
``attn.wq`` ``[H, H]`` and ``attn.wkv`` ``[H, 2 K D]`` (columns ``[K, 2, D]``:
a contiguous split is one of whole key / value heads, with their query heads
in ``wq``'s). Each group's queries are stacked along the sequence, ``q``
``[B, K, G S, D]``, so one batched MatMul per group scores them against the
group's keys ``[B, K, S, D]`` (and their gradients sum over the group by
themselves); scores and probabilities are ``[B, N, S, S]`` again for the mask
and the softmax::

    q  = a @ wq -> [B, S, N, D] -> [B, N, S, D] -> [B, K, G S, D]
    kv = a @ wkv -> [B, S, K, 2D] -> Split k, v [B, S, K, D] -> [B, K, S, D]
    p  = Softmax(CausalMask(Scale(q @ k^T -> [B, N, S, S])))
    c  = (p -> [B, K, G S, S]) @ v -> [B, N, S, D] -> [B, S, H]

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
# On a head-splitting Reshape whose tp_axis entry counts key / value heads (grouped-query
# attention): what a tensor-parallel degree that does not divide it is told.
_KV_HEADS = {"tp_dim": "num_kv_heads"}


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
    # Grouped-query attention: probs as [B, K, G S, S] (q is [B, K, G S, D], k and v [B, K, S, D]).
    grouped_probs: Value | None = None


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
    if cfg.grouped:  # grouped-query attention: queries apart from the shared keys and values
        projections = {"attn.wq": (h, h), "attn.wkv": (h, 2 * cfg.num_kv_heads * cfg.head_dim)}
    else:
        projections = {"attn.wqkv": (h, 3 * h)}
    shapes = {
        "ln1.gamma": (h,),
        "ln1.beta": (h,),
        **projections,
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
    # The linear layers' inputs as their GEMMs read and keep them (f8 with "mixed-fp8").
    ln1 = em.fp8_input(ln1, p + "ln1_fp8")
    grouped_probs = None
    if cfg.grouped:
        kv, group = cfg.num_kv_heads, n // cfg.num_kv_heads
        q = em.op("MatMul", ln1, w["attn.wq"], name=p + "q_proj", tp="col")
        q = em.op("Reshape", q, name=p + "q_bsnd", shape=(-1, s, n, d), tp_axis=2, **_HEADS)
        q = em.op("Transpose", q, name=p + "q_bnsd", perm=_HEADS_PERM, **_HEADS)
        q = _grouped(em, q, kv, group * s, d, p + "q", kv=True)
        kvs = em.op("MatMul", ln1, w["attn.wkv"], name=p + "kv_proj", tp="col")
        kv_tp = dict(_HEADS, **_KV_HEADS)
        kvs = em.op("Reshape", kvs, name=p + "kv_heads", shape=(-1, s, kv, 2 * d), tp_axis=2, **kv_tp)
        parts = em.op("Split", kvs, name=(p + "k_bsnd", p + "v_bsnd"), axis=3, parts=2, **_HEADS)
        k, v = (
            em.op("Transpose", t, name=f"{p}{c}", perm=_HEADS_PERM, **_HEADS)
            for t, c in zip(parts, "kv", strict=True)
        )
        scores = em.op("MatMul", q, k, name=p + "scores_grouped", transpose_b=True, **_HEADS)
        scores = _grouped(em, scores, n, s, s, p + "scores")
    else:
        qkv = em.op("MatMul", ln1, w["attn.wqkv"], name=p + "qkv", tp="col")
        qkv = em.op("Reshape", qkv, name=p + "qkv_heads", shape=(-1, s, n, 3 * d), tp_axis=2, **_HEADS)
        parts = em.op(
            "Split", qkv, name=(p + "q_bsnd", p + "k_bsnd", p + "v_bsnd"), axis=3, parts=3, **_HEADS
        )
        q, k, v = (
            em.op("Transpose", t, name=f"{p}{c}", perm=_HEADS_PERM, **_HEADS)
            for t, c in zip(parts, "qkv", strict=True)
        )
        scores = em.op("MatMul", q, k, name=p + "scores", transpose_b=True, **_HEADS)
    scores = em.op("Scale", scores, name=p + "scaled", factor=1.0 / math.sqrt(d), **_HEADS)
    scores = em.op("CausalMask", scores, name=p + "masked", fill=-1e9, **_HEADS)
    probs = em.op("Softmax", scores, name=p + "probs", axis=-1, **_HEADS)
    if cfg.grouped:
        grouped_probs = _grouped(em, probs, kv, group * s, s, p + "probs_grouped", kv=True)
        ctx = em.op("MatMul", grouped_probs, v, name=p + "ctx_grouped", **_HEADS)
        ctx = _grouped(em, ctx, n, s, d, p + "ctx_bnsd")
    else:
        ctx = em.op("MatMul", probs, v, name=p + "ctx_bnsd", **_HEADS)
    ctx = em.op("Transpose", ctx, name=p + "ctx_bsnd", perm=_HEADS_PERM, **_HEADS)
    ctx = em.op("Reshape", ctx, name=p + "ctx", shape=(-1, s, h), tp_axis=2, **_HEADS)
    ctx = em.fp8_input(ctx, p + "ctx_fp8")
    attn = em.op("MatMul", ctx, w["attn.wo"], name=p + "attn", tp="row")
    x1 = em.op("Add", x, attn, name=p + "x1")
    ln2 = em.op("LayerNorm", x1, w["ln2.gamma"], w["ln2.beta"], name=p + "ln2", eps=cfg.ln_eps)
    ln2 = em.fp8_input(ln2, p + "ln2_fp8")
    h1 = em.op("MatMul", ln2, w["mlp.w1"], name=p + "h1", tp="col")
    g = em.fp8_input(em.op("Gelu", h1, name=p + "gelu", **_SHARDED), p + "gelu_fp8")
    mlp = em.op("MatMul", g, w["mlp.w2"], name=p + "mlp", tp="row")
    out = em.op("Add", x1, mlp, name=p + "out")
    return _BlockActs(x, ln1, q, k, v, probs, ctx, x1, ln2, h1, g, grouped_probs), out


def _grouped(em: Emitter, x: Value, heads: int, rows: int, width: int, name: str, kv: bool = False) -> Value:
    """``x`` as ``[B, heads, rows, width]``: a head axis of query heads ``N`` regrouped
    into key / value heads ``K`` (``kv``) with their ``G`` query heads' rows
    stacked (``[B, N, S, W] -> [B, K, G S, W]``), or back. The heads axis is
    what a tensor-parallel degree divides."""
    tp = dict(_HEADS, **_KV_HEADS) if kv else _HEADS
    return em.op("Reshape", x, name=name, shape=(-1, heads, rows, width), tp_axis=1, **tp)


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
    if cfg.grouped:
        kv, group = cfg.num_kv_heads, n // cfg.num_kv_heads
        dctx = _grouped(em, dctx, kv, group * s, d, p + "dctx_grouped", kv=True)
        dprobs = em.op("MatMul", dctx, acts.v, name=p + "dprobs_grouped", transpose_b=True, **_HEADS)
        dprobs = _grouped(em, dprobs, n, s, s, p + "dprobs")
        dv = em.op("MatMul", acts.grouped_probs, dctx, name=p + "dv", transpose_a=True, **_HEADS)
    else:
        dprobs = em.op("MatMul", dctx, acts.v, name=p + "dprobs", transpose_b=True, **_HEADS)
        dv = em.op("MatMul", acts.probs, dctx, name=p + "dv", transpose_a=True, **_HEADS)
    dscores = em.op("SoftmaxGrad", dprobs, acts.probs, name=p + "dmasked", axis=-1, **_HEADS)
    # The mask's gradient is the mask with fill 0: masked scores got no gradient.
    dscores = em.op("CausalMask", dscores, name=p + "dscaled", fill=0.0, **_HEADS)
    dscores = em.op("Scale", dscores, name=p + "dscores", factor=1.0 / math.sqrt(d), **_HEADS)
    if cfg.grouped:
        return _grouped_qkv_backward(em, cfg, p, acts, dscores, dv, dx1, w)
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


def _grouped_qkv_backward(
    em: Emitter,
    cfg: TransformerConfig,
    p: str,
    acts: _BlockActs,
    dscores: Value,
    dv: Value,
    dx1: Value,
    w: dict,
) -> Value:
    """Grouped-query attention's backward from the scores' gradient ``[B, N, S, S]``
    and ``dv`` ``[B, K, S, D]`` to the block input's; the two projections'
    input gradients are partial sums that add up before one tensor-parallel
    reduction (the rewrite keeps a sum of partial sums partial)."""
    s, h, n, d = cfg.seq_len, cfg.hidden, cfg.num_heads, cfg.head_dim
    kv, group = cfg.num_kv_heads, n // cfg.num_kv_heads
    dscores = _grouped(em, dscores, kv, group * s, s, p + "dscores_grouped", kv=True)
    dq = em.op("MatMul", dscores, acts.k, name=p + "dq_grouped", **_HEADS)  # [B, K, G S, D]
    dk = em.op("MatMul", dscores, acts.q, name=p + "dk", transpose_a=True, **_HEADS)  # sums the group
    dq = _grouped(em, dq, n, s, d, p + "dq_bnsd")
    dq = em.op("Transpose", dq, name=p + "dq_bsnd", perm=_HEADS_PERM, **_HEADS)
    dq = em.op("Reshape", dq, name=p + "dq", shape=(-1, s, h), tp_axis=2, **_HEADS)
    dparts = [
        em.op("Transpose", t, name=f"{p}d{c}_bsnd", perm=_HEADS_PERM, **_HEADS)
        for t, c in zip((dk, dv), "kv", strict=True)
    ]
    dkv = em.op("Concat", *dparts, name=p + "dkv_heads", axis=3, **_HEADS)
    dkv = em.op("Reshape", dkv, name=p + "dkv", shape=(-1, s, 2 * kv * d), tp_axis=2, **_HEADS, **_KV_HEADS)
    ln1 = _flat(em, acts.ln1, h, p + "ln1_flat")
    for weight, grad, width, name in ((w["attn.wq"], dq, h, "dq"), (w["attn.wkv"], dkv, 2 * kv * d, "dkv")):
        em.weight_grad(
            "MatMul",
            weight,
            ln1,
            _flat(em, grad, width, f"{p}{name}_flat", **_HEADS),
            transpose_a=True,
            tp="col",
        )
    dln1_q = em.op("MatMul", dq, w["attn.wq"], name=p + "dln1_q", transpose_b=True, tp="col")
    dln1_kv = em.op("MatMul", dkv, w["attn.wkv"], name=p + "dln1_kv", transpose_b=True, tp="col")
    dln1 = em.op("Add", dln1_q, dln1_kv, name=p + "dln1")
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
