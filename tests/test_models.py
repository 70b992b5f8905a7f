"""Model builders: gradients against finite differences, presets, annotation contract."""

import dataclasses
import json
import time

import numpy as np
import pytest

from distir_jax import models
from distir_jax.executor.sequential import execute
from distir_jax.ir.registry import get_spec
from distir_jax.models import (
    MLPConfig,
    TransformerConfig,
    check_contract,
    gradient_ops,
    model_flops_per_sample,
    optimizer_ops,
    weight_names,
)
from distir_jax.testing.inputs import random_inputs

TINY_MLP = MLPConfig(num_layers=3, hidden=5, dtype="f64")
TINY_GPT = TransformerConfig(num_layers=2, hidden=8, num_heads=2, vocab_size=11, seq_len=4, dtype="f64")
# Grouped-query attention: 4 query heads share 2 key / value heads.
TINY_GQA = dataclasses.replace(TINY_GPT, num_heads=4, num_kv_heads=2)
BATCH = 3
LR = 0.1


def builders(config):
    if isinstance(config, MLPConfig):
        return models.mlp_training_step, models.mlp_loss
    return models.transformer_training_step, models.transformer_loss


def finite_difference_grad(loss_fn, inputs, name, step=1e-5):
    """Central differences of the scalar loss w.r.t. every element of input ``name``."""
    base = inputs[name]
    grad = np.zeros_like(base)
    for index in np.ndindex(base.shape):
        values = []
        for sign in (1.0, -1.0):
            perturbed = base.copy()
            perturbed[index] += sign * step
            values.append(float(execute(loss_fn, {**inputs, name: perturbed})["loss"]))
        grad[index] = (values[0] - values[1]) / (2 * step)
    return grad


# --------------------------------------------------------------------------- #
# Gradient proof.


@pytest.mark.parametrize("config", [TINY_MLP, TINY_GPT, TINY_GQA], ids=["mlp", "gpt", "gqa"])
def test_sgd_step_applies_the_finite_difference_gradient(config):
    train_builder, loss_builder = builders(config)
    train = train_builder(config, BATCH, optimizer="sgd", lr=LR)
    loss_fn = loss_builder(config, BATCH)
    inputs = random_inputs(train)
    out = execute(train, inputs)

    loss_inputs = {v.name: inputs[v.name] for v in loss_fn.inputs}
    np.testing.assert_allclose(out["loss"], execute(loss_fn, loss_inputs)["loss"], rtol=1e-12)
    for name in weight_names(train):
        applied = (inputs[name] - out[f"{name}.new"]) / LR
        expected = finite_difference_grad(loss_fn, loss_inputs, name)
        np.testing.assert_allclose(applied, expected, rtol=1e-6, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("config", [TINY_MLP, TINY_GPT, TINY_GQA], ids=["mlp", "gpt", "gqa"])
def test_adam_first_step_matches_hand_written_adam(config):
    train_builder, _ = builders(config)
    sgd = train_builder(config, BATCH, optimizer="sgd", lr=LR)
    adam = train_builder(config, BATCH, optimizer="adam", lr=LR)
    inputs = random_inputs(adam, seed=1)
    sgd_out = execute(sgd, {v.name: inputs[v.name] for v in sgd.inputs})
    out = execute(adam, inputs)

    beta1, beta2, eps = 0.9, 0.999, 1e-8
    np.testing.assert_allclose(out["loss"], sgd_out["loss"], rtol=1e-12)
    for name in weight_names(adam):
        g = (inputs[name] - sgd_out[f"{name}.new"]) / LR
        m = beta1 * inputs[f"{name}.m"] + (1 - beta1) * g
        v = beta2 * inputs[f"{name}.v"] + (1 - beta2) * g * g
        w = inputs[name] - LR * (m / (1 - beta1)) / (np.sqrt(v / (1 - beta2)) + eps)
        np.testing.assert_allclose(out[f"{name}.m.new"], m, rtol=1e-9, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(out[f"{name}.v.new"], v, rtol=1e-9, atol=1e-14, err_msg=name)
        np.testing.assert_allclose(out[f"{name}.new"], w, rtol=1e-9, atol=1e-12, err_msg=name)


def test_grouped_query_attention_shares_each_key_value_head_among_its_query_heads():
    """The block's attention output against NumPy: query head ``i`` attends with
    key / value head ``i // G`` (``G = num_heads / num_kv_heads``), causally."""
    cfg = TINY_GQA
    train = models.transformer_training_step(cfg, BATCH)
    every = execute(train, random_inputs(train, seed=2), return_all=True)
    b, s, n, kv, d = BATCH, cfg.seq_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = every["l1.ln1"]
    q = (a @ every["l1.attn.wq"]).reshape(b, s, n, d)
    k, v = np.split((a @ every["l1.attn.wkv"]).reshape(b, s, kv, 2 * d), 2, axis=3)
    ctx = np.zeros((b, s, n, d))
    for i in range(n):
        j = i // (n // kv)
        scores = np.einsum("bsd,btd->bst", q[:, :, i], k[:, :, j]) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        ctx[:, :, i] = np.einsum("bst,btd->bsd", p / p.sum(-1, keepdims=True), v[:, :, j])
    np.testing.assert_allclose(every["l1.ctx"], ctx.reshape(b, s, n * d), rtol=1e-12)
    # Fewer key / value weights: LLaMA-2 70B's 8 of 64 heads.
    assert cfg.num_parameters() == TINY_GPT.num_parameters() - cfg.num_layers * cfg.hidden * cfg.hidden
    assert sum(int(np.prod(v.type.shape)) for v in train.inputs if v.name in weight_names(train)) == (
        cfg.num_parameters()
    )


def test_inference_matches_the_forward_of_the_training_step():
    infer = models.transformer_inference(TINY_GPT, BATCH)
    train = models.transformer_training_step(TINY_GPT, BATCH)
    inputs = random_inputs(train)
    logits = execute(infer, {v.name: inputs[v.name] for v in infer.inputs})["logits"]
    assert logits.shape == (BATCH, TINY_GPT.seq_len, TINY_GPT.vocab_size)
    every = execute(train, inputs, return_all=True)
    np.testing.assert_array_equal(every["logits"], logits)

    mlp_out = execute(
        models.mlp_inference(TINY_MLP, BATCH), random_inputs(models.mlp_inference(TINY_MLP, BATCH))
    )
    assert mlp_out["l3.h"].shape == (BATCH, TINY_MLP.hidden)


def test_causal_model_ignores_future_tokens():
    # A check of the mask wiring independent of the gradients: changing the
    # last token must leave the logits of earlier positions unchanged.
    infer = models.transformer_inference(TINY_GPT, 1)
    inputs = random_inputs(infer)
    changed = dict(inputs, tokens=inputs["tokens"].copy())
    changed["tokens"][0, -1] = (changed["tokens"][0, -1] + 1) % TINY_GPT.vocab_size
    a, b = execute(infer, inputs)["logits"], execute(infer, changed)["logits"]
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], rtol=1e-12)
    assert not np.allclose(a[:, -1], b[:, -1])


# --------------------------------------------------------------------------- #
# Presets at their real sizes.


def expected_op_count(config, optimizer_ops_per_weight=1):
    if isinstance(config, MLPConfig):
        # fwd MatMul + Relu, loss + grad, ReluGrad + weight grad, L - 1 input grads, updates.
        return 6 * config.num_layers + 1
    # Per block 22 fwd + 34 bwd + 8 updates; embedding 2 + 2 + 2; head 3 + 6 + 3.
    return 64 * config.num_layers + 18


@pytest.mark.parametrize("name", models.model_names())
def test_every_preset_builds_quickly_at_real_size(name):
    config = models.get_model_config(name)
    start = time.perf_counter()
    fn = models.build_training_step(config, 8, optimizer="adam")
    elapsed = time.perf_counter() - start
    assert len(fn.ops) == expected_op_count(config)
    assert elapsed < 10.0, f"{name}: {elapsed:.1f} s to build {len(fn.ops)} ops"
    check_contract(fn)
    check_contract(models.build_inference(name, 8), training=False)
    assert parameter_count(fn) == config.num_parameters()


def parameter_count(fn, exclude=()):
    keep = set(weight_names(fn)) - set(exclude)
    return sum(int(v.type.num_elements) for v in fn.inputs if v.name in keep)


def test_parameter_counts_match_published_sizes():
    gpt2 = models.build_inference("gpt2-small", 1)
    # GPT-2 ties its LM head to the token embedding, so its 124M count has no
    # separate head; our head is untied (simpler to split), so leave it out.
    assert parameter_count(gpt2, exclude=("l13.head.w",)) == pytest.approx(124.4e6, rel=0.01)
    gpt3 = models.build_inference("gpt3-175b", 1)
    assert parameter_count(gpt3) == pytest.approx(175.0e9, rel=0.01)
    assert parameter_count(gpt3, exclude=("l97.head.w",)) == pytest.approx(175.0e9, rel=0.01)
    mlp = models.build_inference("mlp-large", 1)
    assert parameter_count(mlp) == 96 * 32768**2


def test_gpt3_presets_keep_head_dim_128():
    for name in ("gpt3-xl", "gpt3-6.7b", "gpt3-13b", "gpt3-175b"):
        assert models.get_model_config(name).head_dim == 128, name


# --------------------------------------------------------------------------- #
# Annotation contract.


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("config", [TINY_MLP, TINY_GPT, TINY_GQA], ids=["mlp", "gpt", "gqa"])
def test_annotation_contract(config, optimizer):
    fn = builders(config)[0](config, BATCH, optimizer=optimizer)
    check_contract(fn)
    weights = weight_names(fn)
    assert set(gradient_ops(fn)) == set(weights)
    assert set(optimizer_ops(fn)) == set(weights)
    for w, (op_index, out_index) in gradient_ops(fn).items():
        assert fn.ops[op_index].outputs[out_index].name == f"{w}.grad"
        assert fn.ops[op_index].attr("phase") == "bwd"
    # Issue order: forward, then backward, then updates.
    phases = [op.attr("phase") for op in fn.ops]
    assert phases == sorted(phases, key=["fwd", "bwd", "opt"].index)
    outputs = [v.name for v in fn.outputs]
    states = [f"{w}.{s}.new" for w in weights for s in "mv"] if optimizer == "adam" else []
    assert outputs == ["loss"] + [f"{w}.new" for w in weights] + states
    for op in fn.ops:
        if op.op_type == "Reshape":
            assert op.attr("shape")[0] == -1, "the batch axis must stay -1"
            assert (op.attr("tp") is None) == (op.attr("tp_axis") is None)


@pytest.mark.parametrize("precision", ["mixed", "mixed-half-grads", "half", "mixed-fp8"])
@pytest.mark.parametrize("config", [TINY_MLP, TINY_GPT, TINY_GQA], ids=["mlp", "gpt", "gqa"])
def test_training_precisions_keep_the_contract(config, precision):
    """bf16: "mixed" (and "mixed-fp8") casts each weight's gradient to f32 right after
    the op computing it (the cast carries grad_of); the others keep it in bf16. Master
    copies come with all but "half", last among the outputs."""
    config = dataclasses.replace(config, dtype="bf16", training_precision=precision)
    assert config.resolved_precision == precision
    fn = builders(config)[0](config, BATCH, optimizer="adam")
    check_contract(fn)
    weights = weight_names(fn)
    producers = fn.producers()
    for w, (op_index, out_index) in gradient_ops(fn).items():
        op = fn.ops[op_index]
        assert op.outputs[out_index].name == f"{w}.grad" and op.attr("phase") == "bwd"
        if precision in ("mixed", "mixed-fp8"):
            assert op.op_type == "Cast" and op.outputs[0].type.dtype == "f32"
            source = fn.ops[producers[op.inputs[0].name]]
            assert op.inputs[0].name == f"{w}.grad.bf16" and source.attr("grad_of") is None
            assert (source.attr("layer"), source.attr("phase")) == (op.attr("layer"), op.attr("phase"))
        else:
            assert op.op_type != "Cast" and op.outputs[out_index].type.dtype == "bf16"
    assert (precision in ("mixed", "mixed-fp8")) == any(op.op_type == "Cast" for op in fn.ops)
    masters = [f"{w}.master.new" for w in weights] if precision != "half" else []
    # mixed-fp8: the FP8 copies of the weights its GEMMs read, refreshed in place.
    inputs = {v.name for v in fn.inputs}
    copies = [f"{w}.{s}.new" for w in weights for s in ("fp8", "fp8t") if f"{w}.{s}" in inputs]
    assert bool(copies) == (precision == "mixed-fp8")
    outputs = [v.name for v in fn.outputs]
    assert (
        outputs
        == ["loss"]
        + [f"{w}.new" for w in weights]
        + [f"{w}.{s}.new" for w in weights for s in "mv"]
        + masters
        + copies
    )
    assert models.get_model_config("gpt3-xl").resolved_precision == "full"
    assert dataclasses.replace(TINY_GPT, dtype="f16").resolved_precision == "mixed"


@pytest.mark.parametrize("precision", [None, "mixed"])
@pytest.mark.parametrize("config", [TINY_MLP, TINY_GPT, TINY_GQA], ids=["mlp", "gpt", "gqa"])
def test_flops_outside_the_optimizer_scale_with_the_batch(config, precision):
    """The pipeline transform orders and balances steps by the flops of the whole
    batch's program, the fast engine by one microbatch's: the same order only while
    every op but the updates does work in proportion to the batch."""
    if precision:
        config = dataclasses.replace(config, dtype="bf16", training_precision=precision)
    build = builders(config)[0]
    small, large = build(config, 4, optimizer="adam"), build(config, 12, optimizer="adam")
    for a, b in zip(small.ops, large.ops, strict=True):
        if a.attr("phase") == "opt":
            continue
        flops = [
            float(
                get_spec(op.op_type)
                .features(op.attr_dict, [v.type for v in op.inputs], [v.type for v in op.outputs])
                .flops
            )
            for op in (a, b)
        ]
        assert flops[1] == pytest.approx(3 * flops[0], rel=1e-12), (a.op_type, [v.name for v in a.outputs])


def matmuls_using(fn, weight):
    return [
        op
        for op in fn.ops
        if op.op_type == "MatMul" and (weight in {v.name for v in op.inputs} or op.attr("grad_of") == weight)
    ]


def test_tensor_parallel_hints_on_transformer():
    fn = models.transformer_training_step(TINY_GPT, BATCH)
    for layer in (1, 2):
        for weight, tp in (("attn.wqkv", "col"), ("attn.wo", "row"), ("mlp.w1", "col"), ("mlp.w2", "row")):
            ops = matmuls_using(fn, f"l{layer}.{weight}")
            # forward, input gradient and weight gradient
            assert len(ops) == 3 and all(op.attr("tp") == tp for op in ops), weight
        heads = [op.op_type for op in fn.ops if op.attr("layer") == layer and op.attr("tp") == "heads"]
        assert heads.count("Softmax") == 1 and heads.count("SoftmaxGrad") == 1
        assert heads.count("MatMul") == 6  # scores, context; their four gradients
        sharded = {op.op_type for op in fn.ops if op.attr("layer") == layer and op.attr("tp") == "sharded"}
        assert sharded == {"Gelu", "GeluGrad", "Reshape"}
    # The embedding and the head: the ops on the vocabulary axis, and nothing else.
    vocab = [(op.op_type, op.attr("layer")) for op in fn.ops if op.attr("tp") == "vocab"]
    assert sorted(vocab) == sorted(
        [("Embedding", 0), ("EmbeddingGrad", 0), ("SoftmaxCrossEntropy", 3), ("SoftmaxCrossEntropyGrad", 3)]
        + [("MatMul", 3)] * 3  # logits, the head's weight and input gradients
        + [("Reshape", 3)]  # the flattened logits gradient
    )
    assert all(op.attr("tp") in (None, "vocab") for op in fn.ops if op.attr("layer") in (0, 3))


def test_tensor_parallel_hints_on_mlp_alternate():
    fn = models.mlp_training_step(MLPConfig(4, 8), 2)
    for layer, tp in zip(range(1, 5), ["col", "row", "col", "row"], strict=True):
        ops = matmuls_using(fn, f"l{layer}.w")
        assert len(ops) == (3 if layer > 1 else 2) and all(op.attr("tp") == tp for op in ops)
    relus = {op.attr("layer"): op.attr("tp") for op in fn.ops if op.op_type == "Relu"}
    assert relus == {1: "sharded", 2: None, 3: "sharded", 4: None}


def test_contract_checker_reports_violations():
    fn = models.mlp_training_step(TINY_MLP, BATCH)
    bad = list(fn.ops)
    bad[0] = dataclasses.replace(bad[0], attrs=tuple((k, v) for k, v in bad[0].attrs if k != "phase"))
    with pytest.raises(ValueError, match="phase=None"):
        check_contract(fn.replace(ops=tuple(bad)))
    without_update = fn.replace(ops=tuple(op for op in fn.ops if op.attr("weight") != "l2.w"))
    with pytest.raises(ValueError, match="l2.w has 0 optimizer ops"):
        check_contract(without_update)


# --------------------------------------------------------------------------- #
# Size variants.


def op_features(fn):
    for op in fn.ops:
        ins = tuple(v.type for v in op.inputs)
        outs = tuple(v.type for v in op.outputs)
        yield op, get_spec(op.op_type).features(op.attr_dict, ins, outs)


@pytest.mark.parametrize("config", [TINY_MLP, TINY_GPT, TINY_GQA], ids=["mlp", "gpt", "gqa"])
def test_size_variants_give_per_variant_features(config):
    sizes = np.array([2, 4, 8])
    build = builders(config)[0]
    fn = build(config, sizes, optimizer="adam")
    check_contract(fn)
    first_matmul = next(f for op, f in op_features(fn) if op.op_type == "MatMul")
    width = config.hidden
    if isinstance(config, MLPConfig):
        per_row = 2 * width * width
    else:  # the query projection: with the keys and values, or alone (grouped-query attention)
        per_row = 2 * config.seq_len * width * (width if config.grouped else 3 * width)
    np.testing.assert_array_equal(first_matmul.flops, sizes * per_row)
    # Batch independence: variant i equals building with size i alone.
    for i, size in enumerate(sizes):
        alone = build(config, int(size), optimizer="adam")
        for (op, f), (_, g) in zip(op_features(fn), op_features(alone), strict=True):
            for field in ("flops", "mem_bytes"):
                got = np.broadcast_to(getattr(f, field), sizes.shape)[i]
                assert got == pytest.approx(getattr(g, field)), (op.op_type, field)


# --------------------------------------------------------------------------- #
# Bad inputs.


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: models.get_model_config("gpt5"), r"name='gpt5'.*gpt2-small"),
        (lambda: TransformerConfig(2, 10, 3, 11, 4), r"hidden=10 .*num_heads=3"),
        (lambda: TransformerConfig(0, 8, 2, 11, 4), r"num_layers=0"),
        (lambda: MLPConfig(2, 8, dtype="f8"), r"dtype='f8'"),
        (lambda: models.get_model_config("mlp-xs", dtype="i32"), r"dtype='i32'"),
        (
            lambda: MLPConfig(2, 8, training_precision="amp"),
            r"one of \['full', 'mixed'.*got training_precision='amp'",
        ),
        (lambda: MLPConfig(2, 8, training_precision="mixed"), r"f32 models train in precision 'full'"),
        (
            lambda: dataclasses.replace(TINY_GPT, dtype="bf16", training_precision="full"),
            r"bf16 models train in precision 'mixed' or 'mixed-half-grads' or 'half' or 'mixed-fp8'.*'full'",
        ),
        (lambda: models.mlp_training_step(TINY_MLP, 0), r"batch_size=0"),
        (lambda: models.transformer_inference(TINY_GPT, np.array([2, 0])), r"batch_size=array\(\[2, 0\]\)"),
        (lambda: models.transformer_training_step(TINY_GPT, 2.5), r"batch_size=2.5"),
        (lambda: models.mlp_training_step(TINY_MLP, 2, optimizer="rmsprop"), r"optimizer='rmsprop'"),
        (lambda: models.transformer_training_step(TINY_GPT, 2, lr=-1.0), r"lr=-1.0"),
        (lambda: models.transformer_inference(TINY_MLP, 2), r"config must be a TransformerConfig"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_parameter(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_public_names_exist():
    for name in models.__all__:
        assert hasattr(models, name), name


# --- model FLOPs (the numerator of MFU) -------------------------------------


def _program_matmul_flops(config, batch: int) -> float:
    """Every forward and backward MatMul's FLOPs in the training step's program, whole."""
    fn = models.build_training_step(config, batch)
    total = 0.0
    for op in fn.ops:
        if op.op_type == "MatMul" and op.attr("phase") != "opt":
            types = (tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs))
            total += float(get_spec("MatMul").features(op.attr_dict, *types).flops)
    return total


@pytest.mark.parametrize(
    "config",
    [
        MLPConfig(num_layers=7, hidden=12),
        TransformerConfig(num_layers=5, hidden=16, num_heads=4, vocab_size=40, seq_len=6),
        TransformerConfig(num_layers=2, hidden=16, num_heads=2, vocab_size=40, seq_len=6, ffn_hidden=24),
    ],
    ids=["mlp", "gpt", "gpt-2-layers"],
)
def test_model_flops_are_the_programs_matmuls_at_any_batch(config):
    for batch in (1, 3):
        assert _program_matmul_flops(config, batch) == batch * model_flops_per_sample(config)


def test_model_flops_are_megatrons_formula():
    # Narayanan et al. (2021): 72 S L H^2 (1 + S / (6 H) + V / (12 H L)) per sample;
    # an MLP needs no gradient of its input: 6 L H^2 - 2 H^2.
    for name in ("gpt2-small", "gpt3-xl", "gpt3-175b"):
        c = models.get_model_config(name)
        s, n, h, v = c.seq_len, c.num_layers, c.hidden, c.vocab_size
        want = 72 * s * n * h * h * (1 + s / (6 * h) + v / (12 * h * n))
        assert model_flops_per_sample(name) == pytest.approx(want, rel=1e-12), name
    mlp = models.get_model_config("mlp-small")
    assert model_flops_per_sample(mlp) == 6 * mlp.num_layers * mlp.hidden**2 - 2 * mlp.hidden**2


# --- models of the user's own sizes, by name ---------------------------------


@pytest.fixture
def model_registry(monkeypatch):
    """Models registered by a test are forgotten after it."""
    from distir_jax.models import config

    monkeypatch.setattr(config, "_PRESETS", dict(config._PRESETS))


def test_a_models_file_registers_its_models_by_name(tmp_path, model_registry):
    path = tmp_path / "models.json"
    gpt = dict(kind="gpt", num_layers=3, hidden=32, num_heads=4, vocab_size=64, seq_len=8, ffn_hidden=96)
    path.write_text(json.dumps({"my-gpt": gpt, "my.mlp_2": {"kind": "mlp", "num_layers": 2, "hidden": 8}}))
    assert models.load_models(path) == ["my-gpt", "my.mlp_2"]
    fields = {k: v for k, v in gpt.items() if k != "kind"}
    assert models.get_model_config("my-gpt") == TransformerConfig(**fields)
    assert models.get_model_config("my.mlp_2") == MLPConfig(num_layers=2, hidden=8)
    assert models.model_names()[-2:] == ("my-gpt", "my.mlp_2")
    assert models.load_models(path) == ["my-gpt", "my.mlp_2"]  # again: the same models, no error


@pytest.mark.parametrize(
    "content, pattern",
    [
        ("{not json", r"models\.json: not JSON"),
        ("[]", r"models\.json: expected an object of models by name"),
        ('{"m": 3}', r"model 'm': expected an object of fields, got 3"),
        ('{"m": {"kind": "rnn"}}', r"model 'm': 'kind' must be one of \['gpt', 'mlp'\], got 'rnn'"),
        ('{"m": {"kind": "mlp", "hidden": 8}}', r"model 'm': .*missing 1 required .*'num_layers'"),
        ('{"m": {"kind": "mlp", "num_layers": 2, "hidden": 8, "heads": 2}}', r"unknown field.* \['heads'\]"),
        ('{"m": {"kind": "mlp", "num_layers": 0, "hidden": 8}}', r"model 'm': MLPConfig: num_layers"),
        ('{"gpt2-small": {"kind": "mlp", "num_layers": 2, "hidden": 8}}', r"'gpt2-small' is a built-in"),
        ('{"a,b": {"kind": "mlp", "num_layers": 2, "hidden": 8}}', r"model name='a,b': expected letters"),
    ],
)
def test_a_bad_models_file_is_an_error_naming_the_file_and_model(tmp_path, model_registry, content, pattern):
    path = tmp_path / "models.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=pattern):
        models.load_models(path)
    with pytest.raises(ValueError, match=r"nowhere\.json: cannot read the models file"):
        models.load_models(tmp_path / "nowhere.json")


def test_a_name_keeps_its_model(model_registry):
    models.register_model("mine", MLPConfig(num_layers=2, hidden=8))
    models.register_model("mine", MLPConfig(num_layers=2, hidden=8))
    with pytest.raises(
        ValueError, match=r"'mine' is already registered as MLPConfig\(num_layers=2, hidden=8,"
    ):
        models.register_model("mine", MLPConfig(num_layers=2, hidden=16))
    with pytest.raises(ValueError, match=r"expected an MLPConfig or a TransformerConfig, got dict"):
        models.register_model("other", {"num_layers": 2})
    with pytest.raises(ValueError, match=r"unknown model name='yours'.*register_model"):
        models.get_model_config("yours")


# FP8 GEMMs of each tiny model: the MLP's 3 layers forward and their weight
# gradients, the last 2's data gradients; each GPT block's 4 projections (GQA:
# 5, queries and keys / values apart) forward, data and weight gradient. A GPT
# block casts its 4 linear layers' inputs to f8 (an MLP's are kept for ReluGrad).
@pytest.mark.parametrize("config", [TINY_MLP, TINY_GPT, TINY_GQA], ids=["mlp", "gpt", "gqa"])
def test_mixed_fp8_computes_what_mixed_does(config):
    """Executors evaluate every float in float64, so a mixed-fp8 step whose FP8 weight
    copies hold their weights (as ``random_inputs`` makes them) gives the loss, updated
    weights and state of a mixed step, and refreshed copies equal to the weights it read."""
    mixed, fp8 = (
        dataclasses.replace(config, dtype="bf16", training_precision=p) for p in ("mixed", "mixed-fp8")
    )
    build = builders(mixed)[0]
    a, b = build(mixed, BATCH, optimizer="adam"), build(fp8, BATCH, optimizer="adam")
    inputs = random_inputs(b, seed=3)
    copies = [v.name for v in b.inputs if v.name.endswith((".fp8", ".fp8t"))]
    assert copies and all(np.array_equal(inputs[c], inputs[c.rsplit(".", 1)[0]]) for c in copies)
    want = execute(a, {v.name: inputs[v.name] for v in a.inputs})
    got = execute(b, inputs)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-15, err_msg=name)
    for c in copies:
        np.testing.assert_array_equal(got[f"{c}.new"], inputs[c.rsplit(".", 1)[0]])


@pytest.mark.parametrize(
    "config, gemms, casts",
    [(TINY_MLP, 3 + 3 + 2, 0), (TINY_GPT, 2 * 4 * 3, 2 * 4), (TINY_GQA, 2 * 5 * 3, 2 * 4)],
    ids=["mlp", "gpt", "gqa"],
)
def test_mixed_fp8_runs_the_linear_layers_gemms_in_fp8(config, gemms, casts):
    """Training precision "mixed-fp8" is "mixed" with the MatMuls tensor parallelism
    splits by columns or rows (forward, data and weight gradients) marked FP8: half
    their flops at the bf16 peak, 1-byte operands; a block's linear layers read their
    inputs cast to f8, and their weight gradients read those copies (what Transformer
    Engine saves). Attention's batched matmuls and the LM head stay bf16, and model
    flops (MFU's numerator) are the GEMMs' own."""
    from distir_jax.ir.registry import op_features
    from distir_jax.models.flops import model_flops_per_sample

    mixed, fp8 = (
        dataclasses.replace(config, dtype="bf16", training_precision=p) for p in ("mixed", "mixed-fp8")
    )
    build = builders(mixed)[0]
    a, b = build(mixed, BATCH, optimizer="adam"), build(fp8, BATCH, optimizer="adam")
    f8_casts = [op for op in b.ops if op.op_type == "Cast" and op.attr("dtype") == "f8"]
    assert len(f8_casts) == casts and all(op.attr("phase") == "fwd" for op in f8_casts)
    for op in f8_casts:  # an epilogue of its producer's kernel: no launch, the f8 bytes written
        features = op_features(op)
        assert (features.launches, features.flops) == (0, 0.0) and op.attr("fused") is True
        np.testing.assert_array_equal(features.mem_bytes, op.outputs[0].type.num_elements)
    cast_of = {op.outputs[0].name: op.inputs[0].name for op in f8_casts}
    readers = {name: [op for op in b.ops if name in [v.name for v in op.inputs]] for name in cast_of}
    for name, ops in readers.items():  # forward GEMMs, and (through a Reshape) the weights' gradients
        kinds = sorted(
            {"fp8 GEMM" if op.op_type == "MatMul" and op.attr("fp8") else op.op_type for op in ops}
        )
        assert kinds == ["Reshape", "fp8 GEMM"], (name, kinds)
    # The weights' FP8 copies (Transformer Engine's cached weight and transpose):
    # resident inputs the forward and data-gradient GEMMs read instead of the
    # weight, each refreshed in place from the weight by a CastInto before its update.
    refresh = [op for op in b.ops if op.op_type == "CastInto"]
    copies = {v.name: v for v in b.inputs if v.name.endswith((".fp8", ".fp8t"))}
    assert sorted(op.inputs[0].name for op in refresh) == sorted(copies) and copies
    updates = {op.attr("weight"): i for i, op in enumerate(b.ops) if op.op_type == "Adam"}
    for op in refresh:
        copy, weight = op.inputs
        assert copy.name.rsplit(".", 1)[0] == weight.name and copy.type.dtype == "f8"
        assert copy.type.shape == weight.type.shape and op.attr("phase") == "opt"
        assert b.ops.index(op) < updates[weight.name]  # the weight the step read
        features = op_features(op)
        assert (features.flops, features.mem_bytes, features.launches) == (0.0, 0.0, 0)
    gemm_reads = {v.name for op in b.ops if op.op_type == "MatMul" and op.attr("fp8") for v in op.inputs}
    assert set(copies) <= gemm_reads and not gemm_reads & set(updates)
    assert [v.name for v in b.outputs][-len(refresh) :] == [op.outputs[0].name for op in refresh]
    weights = set(weight_names(a))
    kept = [op for op in b.ops if op not in f8_casts and op not in refresh]
    assert len(kept) == len(a.ops)
    marked = 0
    for x, y in zip(a.ops, kept, strict=True):
        assert x.op_type == y.op_type
        if x.op_type == "Reshape" and y.inputs[0].name in cast_of:  # the saved copy, for the gradient
            (want,), (got,) = x.outputs, y.outputs
            assert (got.type.shape, got.type.dtype) == (want.type.shape, "f8")
            continue
        assert [v.type for v in x.outputs] == [v.type for v in y.outputs]
        linear = x.op_type == "MatMul" and x.attr("tp") in ("col", "row")
        for u, w in zip(x.inputs, y.inputs, strict=True):  # a GEMM reads a weight's FP8 copy
            if u.name in weights:
                assert w.name in ((f"{u.name}.fp8", f"{u.name}.fp8t") if linear else (u.name,))
        assert bool(y.attr("fp8", False)) == linear and x.attr("fp8") is None
        fx, fy = op_features(x), op_features(y)
        if linear:
            marked += 1
            np.testing.assert_array_equal(np.asarray(fy.flops) * 2, fx.flops)
            ins = sum(np.asarray(v.type.num_elements) for v in y.inputs)  # 1 byte each
            np.testing.assert_array_equal(fy.mem_bytes, ins + y.outputs[0].type.num_bytes)
        else:
            assert (fx.flops, fx.mem_bytes) == (fy.flops, fy.mem_bytes)
    assert marked == gemms
    assert model_flops_per_sample(fp8) == model_flops_per_sample(mixed)
