"""Strategy spaces: enumeration counts, invalid rows with reasons, stable ids."""

import collections
import dataclasses

import pytest

import search
from distir_jax.models import TransformerConfig
from search import Config, StrategySpace, enumerate_configs, factorisations
from search.space import model_label

TINY_GPT = TransformerConfig(num_layers=2, hidden=64, num_heads=4, vocab_size=128, seq_len=16)


def test_public_names_exist():
    for name in search.__all__:
        assert hasattr(search, name), name


@pytest.mark.parametrize("world_size, expected", [(1, 1), (2, 3), (4, 6), (8, 10), (16, 15), (12, 18)])
def test_factorisations_cover_every_ordered_triple(world_size, expected):
    triples = factorisations(world_size)
    assert len(triples) == expected == len(set(triples))
    assert all(d * t * p == world_size for d, t, p in triples)


def test_factorisations_respect_allowed_degrees():
    assert factorisations(16, tensor=(1,)) == [(1, 1, 16), (2, 1, 8), (4, 1, 4), (8, 1, 2), (16, 1, 1)]
    assert factorisations(8, data=(8,)) == [(8, 1, 1)]


def test_distir_mlp_grid_has_460_rows_per_model():
    # DistIR's grid: world sizes 1..16, batches 64..4096, microbatches 1 without
    # a pipeline, else 2..32. Per batch: 15 triples with p = 1, 20 with p > 1.
    space = StrategySpace(
        model=("mlp-xs", "mlp-small"),
        world_sizes=(1, 2, 4, 8, 16),
        global_batch_sizes=(64, 256, 1024, 4096),
        microbatches=(2, 4, 8, 16, 32),
    )
    configs = list(enumerate_configs(space))
    assert len(configs) == 2 * 4 * (15 * 1 + 20 * 5) == 920
    assert len({c.config_id for c in configs}) == len(configs)
    assert all(c.microbatches == 1 for c in configs if c.pipeline == 1)
    # mlp-xs has 8 layers: 16 stages cannot each get one.
    deep = [c for c in configs if c.model == "mlp-xs" and c.pipeline == 16]
    assert deep and all("pipeline=16" in c.reason for c in deep)
    assert all(
        c.valid
        for c in configs
        if c.model == "mlp-small"
        and c.pipeline == 16
        and c.global_batch_size // c.microbatches >= 1
        and c.microbatch_size > 0
    )


def test_invalid_rows_keep_their_place_and_say_why():
    space = StrategySpace(
        model=TINY_GPT,
        world_sizes=(8,),
        global_batch_sizes=(4, 16),
        microbatches=(2, 8),
        hardware=("dgx-a100-80gb", "v100-pcie-4"),
    )
    configs = list(enumerate_configs(space))
    reasons = collections.Counter()
    for c in configs:
        assert isinstance(c.reason, str)
        if not c.valid:
            reasons[c.reason.split(" ")[0]] += 1
    by_reason = {c.reason for c in configs if not c.valid}
    # 8 GPUs do not fit the 4-GPU V100 server.
    assert any("v100-pcie-4" in r and "num_devices" in r for r in by_reason)
    # 4 heads do not split 8 ways.
    assert any("tensor=8" in r and "heads" in r for r in by_reason)
    # 4 samples cannot be split over 8 replicas.
    assert any("not divisible by data degree 8" in r for r in by_reason)
    # A per-replica batch of 2 does not make 8 microbatches.
    assert any("does not split into 8 microbatches" in r for r in by_reason)
    assert sum(c.valid for c in configs) > 0
    assert all(c.microbatches > 0 and c.microbatch_size > 0 for c in configs if c.valid)


def test_no_duplicates_when_knobs_do_not_apply():
    # Without a pipeline (one microbatch) the schedule and virtual stages do not matter.
    space = StrategySpace(
        model="mlp-xs",
        world_sizes=(2,),
        schedules=("gpipe", "1f1b", "interleaved"),
        virtual_stages=(2, 4),
        microbatches=(2,),
    )
    configs = list(enumerate_configs(space))
    no_pipeline = [c for c in configs if c.pipeline == 1]
    assert len(no_pipeline) == 2  # (d, t) = (2, 1) and (1, 2)
    assert {c.schedule for c in no_pipeline} == {"gpipe"} and {c.virtual_stages for c in no_pipeline} == {1}
    piped = [c for c in configs if c.pipeline == 2]
    assert sorted((c.schedule, c.virtual_stages) for c in piped) == [
        ("1f1b", 1),
        ("gpipe", 1),
        ("interleaved", 2),
        ("interleaved", 4),
    ]


def test_microbatch_sizes_give_counts():
    space = StrategySpace(
        model="mlp-xs", world_sizes=(4,), global_batch_sizes=(64,), pipeline=(2,), microbatch_sizes=(4, 5)
    )
    rows = {(c.data, c.tensor, c.microbatch_size): c for c in enumerate_configs(space)}
    assert rows[(2, 1, 4)].microbatches == 8 and rows[(2, 1, 4)].valid
    assert rows[(1, 2, 4)].microbatches == 16
    assert not rows[(2, 1, 5)].valid and "microbatch size 5" in rows[(2, 1, 5)].reason


def test_config_ids_are_stable_and_ignore_the_reason():
    config = next(iter(enumerate_configs(StrategySpace(model="mlp-xs", world_sizes=(1,)))))
    # A golden value: ids must not change between runs, processes or Python versions.
    assert config.config_id == search.config_id(config.knobs())
    assert config.with_reason("whatever").config_id == config.config_id
    assert config.config_id == "877b4e3cec404907", config.config_id


def test_structural_key_leaves_out_sizes_and_hardware():
    space = StrategySpace(
        model="mlp-xs",
        world_sizes=(2,),
        global_batch_sizes=(64, 128),
        hardware=("dgx-a100-80gb", "dgx-h100"),
        data=(2,),
    )
    configs = list(enumerate_configs(space))
    assert len(configs) == 4 and len({c.structural_key() for c in configs}) == 1


def test_transformer_seq_len_override_and_dtype():
    space = StrategySpace(model=TINY_GPT, world_sizes=(1,), seq_len=32, dtype="bf16")
    (config,) = enumerate_configs(space)
    assert config.seq_len == 32 and config.dtype == "bf16" and config.model_config.seq_len == 32
    assert config.model.startswith("TransformerConfig(")
    assert config.preset == "dgx-a100-80gb:1"


def test_training_precision_applies_to_half_precision_models():
    """bf16 rows take each listed training precision; f32 rows train in full precision
    whatever is listed (one row, not three equal ones); "full" for bf16 is a row's reason."""
    space = StrategySpace(
        model=TINY_GPT,
        world_sizes=(1,),
        dtype=("f32", "bf16"),
        training_precision=("mixed", "half", "mixed-half-grads"),
    )
    rows = [
        (c.dtype, c.training_precision, c.model_config.resolved_precision) for c in enumerate_configs(space)
    ]
    assert rows == [
        ("f32", "full", "full"),
        ("bf16", "mixed", "mixed"),
        ("bf16", "half", "half"),
        ("bf16", "mixed-half-grads", "mixed-half-grads"),
    ]
    # None: each model's own (the default of its dtype, or what its config says).
    (default,) = enumerate_configs(StrategySpace(model=TINY_GPT, world_sizes=(1,), dtype="bf16"))
    assert default.training_precision == "mixed"
    own = dataclasses.replace(TINY_GPT, dtype="bf16", training_precision="half")
    (kept,) = enumerate_configs(StrategySpace(model=own, world_sizes=(1,)))
    assert kept.training_precision == "half" and kept.valid
    (full,) = enumerate_configs(
        StrategySpace(model=TINY_GPT, world_sizes=(1,), dtype="bf16", training_precision="full")
    )
    assert not full.valid and "bf16 models train in precision 'mixed'" in full.reason
    # An invalid row names what it asked for, the model's own where it asked for nothing.
    assert (full.dtype, full.training_precision) == ("bf16", "full")
    (odd,) = enumerate_configs(StrategySpace(model=own, world_sizes=(1,), dtype="tf32"))
    assert not odd.valid and (odd.dtype, odd.training_precision) == ("tf32", "full")
    # One configuration made by hand does not drop a precision its dtype cannot take.
    from search.single import make_config

    with pytest.raises(ValueError, match="'half' chooses how a bf16 / f16 model trains; f32 models"):
        make_config(TINY_GPT, dtype="f32", training_precision="half")
    assert make_config(TINY_GPT, training_precision="full").training_precision == "full"


@pytest.mark.parametrize(
    "bad",
    [
        dict(training_precision="amp"),
        dict(schedules=("zigzag",)),
        dict(recompute=("most",)),
        dict(world_sizes=(0,)),
        dict(model="gpt-9"),
        dict(optimizer="lion"),
        dict(global_batch_sizes=()),
        dict(microbatches=None),
        dict(zero=("yes",)),
        dict(hardware=("dgx-a100-80gb", "tpu-v9")),
        dict(hardware="tpu-v9:16"),
    ],
)
def test_bad_spaces_raise_value_error(bad):
    with pytest.raises(ValueError):
        StrategySpace(**bad)


def test_an_unknown_hardware_name_is_one_error_naming_it_and_the_presets():
    with pytest.raises(ValueError, match=r"unknown preset\(s\) \['tpu-v9'\].*'dgx-a100-80gb'"):
        StrategySpace(model="mlp-xs", hardware=("dgx-a100-80gb", "tpu-v9"))


def test_degrees_that_leave_no_factorisation_are_one_error_and_others_restrict():
    with pytest.raises(ValueError, match=r"world size\(s\) \[8\] has tensor in \[3\]: the space is empty"):
        StrategySpace(world_sizes=(8,), tensor=(3,))
    with pytest.raises(ValueError, match=r"\[4, 8\] has data in \[4\], tensor in \[4\]"):
        StrategySpace(world_sizes=(4, 8), data=(4,), tensor=(4,))
    # World size 1 has no tensor degree 2; world size 8 has: a restriction, rows for 8 only.
    space = StrategySpace(world_sizes=(1, 8), tensor=(2,))
    assert {(c.world_size, c.tensor) for c in enumerate_configs(space)} == {(8, 2)}


def test_sequence_parallel_mlp_rows_need_microbatches_the_tensor_group_can_split():
    space = StrategySpace(
        model="mlp-xs",
        world_sizes=(4,),
        global_batch_sizes=(8,),
        tensor=(2,),
        microbatches=(1, 8),
        sequence_parallel=(True,),
    )
    rows = {(c.data, c.pipeline, c.microbatch_size): c for c in enumerate_configs(space)}
    assert rows[(2, 1, 4)].valid and rows[(1, 2, 8)].valid
    assert "microbatch size 1 is not divisible by tensor degree 2" in rows[(1, 2, 1)].reason


def test_unknown_dtype_is_an_invalid_row_not_an_exception():
    (config,) = enumerate_configs(StrategySpace(model="mlp-xs", world_sizes=(1,), dtype="f8"))
    assert not config.valid and "dtype" in config.reason


def test_config_is_a_frozen_row():
    config = next(iter(enumerate_configs(StrategySpace(model="mlp-xs", world_sizes=(1,)))))
    assert isinstance(config, Config)
    with pytest.raises(AttributeError):
        config.data = 2


def test_options_that_need_a_degree_collapse_without_it():
    space = StrategySpace(
        model=TINY_GPT,
        world_sizes=(2,),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        sequence_parallel=(False, True),
        microbatches=(2,),
    )
    rows = collections.Counter((c.data, c.tensor, c.pipeline) for c in enumerate_configs(space))
    # d = 2: zero x overlap; t = 2: sequence parallel or not; the pipeline: neither.
    assert rows == {(2, 1, 1): 4, (1, 2, 1): 2, (1, 1, 2): 1}


def test_an_mlps_attention_recomputation_is_none():
    # Megatron's selective recomputation recomputes attention, which an MLP has not: the
    # rows would repeat "none"'s; a transformer keeps all three policies.
    policies = ("none", "attention", "full")
    space = StrategySpace(model=("mlp-xs", TINY_GPT), world_sizes=(2,), recompute=policies, microbatches=(2,))
    rows = collections.Counter((c.model, c.recompute) for c in enumerate_configs(space))
    mlp, gpt = "mlp-xs", model_label(TINY_GPT)
    assert rows == {(mlp, "none"): 3, (mlp, "full"): 3} | {(gpt, policy): 3 for policy in policies}
    # Asked for alone, it is one row per strategy, which says what ran.
    alone = list(enumerate_configs(dataclasses.replace(space, model="mlp-xs", recompute="attention")))
    assert [c.recompute for c in alone] == ["none"] * 3
    # So does a row whose model does not resolve (its reason is the dtype).
    bad = dataclasses.replace(space, model="mlp-xs", recompute="attention", dtype="f99")
    bad = list(enumerate_configs(bad))
    assert [c.recompute for c in bad] == ["none"] * 3 and all("dtype" in c.reason for c in bad)


def test_one_config_from_knobs_says_when_its_degrees_do_not_make_the_world_size():
    from search.single import make_config

    with pytest.raises(
        ValueError, match=r"data x tensor x pipeline = 2 x 1 x 1 = 2 does not equal world size 4"
    ):
        make_config("mlp-xs", world_size=4, data=2)
    config = make_config("mlp-xs", world_size=4, data=2, tensor=2)
    assert (config.world_size, config.data, config.tensor, config.pipeline) == (4, 2, 2, 1) and config.valid


@pytest.mark.parametrize(
    "knob",
    [
        "model",
        "world_sizes",
        "global_batch_sizes",
        "microbatches_without_pipeline",
        "schedules",
        "virtual_stages",
        "recompute",
        "zero",
        "sequence_parallel",
        "overlap_grad_comm",
        "hardware",
        "optimizer",
    ],
)
def test_none_is_an_error_naming_the_knob_where_it_has_no_documented_meaning(knob):
    # These once left the space empty (or, for microbatches_without_pipeline, dropped
    # every pipeline == 1 row) without a word.
    with pytest.raises(
        ValueError, match=rf"^{knob} must be one .* or a non-empty sequence of them, got None"
    ):
        StrategySpace(**{knob: None})


def test_none_keeps_its_documented_meanings():
    base = search.count_configs(StrategySpace(model="mlp-xs", world_sizes=(2,)))
    for knob in ("seq_len", "data", "tensor", "pipeline", "microbatch_sizes", "dtype"):
        assert search.count_configs(StrategySpace(model="mlp-xs", world_sizes=(2,), **{knob: None})) == base


def test_microbatches_and_microbatch_sizes_are_exclusive():
    with pytest.raises(ValueError, match=r"microbatches=\(2,\) and microbatch_sizes=\(8,\) both set"):
        StrategySpace(microbatches=(2,), microbatch_sizes=(8,))
    # The default counts give way to sizes (and a space made so can be replaced either way).
    space = StrategySpace(world_sizes=(4,), pipeline=(2,), microbatch_sizes=(8,))
    assert space.microbatches is None and space == StrategySpace(
        world_sizes=(4,), pipeline=(2,), microbatches=None, microbatch_sizes=(8,)
    )
    assert StrategySpace().replace(microbatch_sizes=(8,)).microbatch_sizes == (8,)
    with pytest.raises(ValueError, match="microbatches is None and microbatch_sizes is None"):
        space.replace(microbatch_sizes=None)
    assert StrategySpace().microbatches == (1, 2, 4, 8)


def test_world_sizes_are_bounded_before_a_preset_is_built():
    with pytest.raises(
        ValueError, match=r"world_sizes must be at most MAX_WORLD_SIZE = 16384 GPUs, got \[1000000\]"
    ):
        search.count_configs(StrategySpace(model="mlp-xs", world_sizes=10**6))
    with pytest.raises(ValueError, match=r"hardware: GPU count\(s\) of \['dgx-a100-80gb:1000000'\] exceed"):
        StrategySpace(model="mlp-xs", hardware="dgx-a100-80gb:1000000")
    from search.space import MAX_WORLD_SIZE

    assert StrategySpace(model="mlp-xs", world_sizes=MAX_WORLD_SIZE, data=MAX_WORLD_SIZE).world_sizes == (
        16384,
    )


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(data=0), r"^data must be an int >= 1, got 0"),
        (dict(tensor=-2), r"^tensor must be an int >= 1, got -2"),
        (dict(pipeline=1.0), r"^pipeline must be an int >= 1, got 1.0"),
        (dict(data="2"), r"^data must be an int >= 1, got '2'"),
        (dict(microbatches=0), r"^microbatches must be an int >= 1, got 0"),
        (dict(batch_size=0), r"^batch_size must be an int >= 1, got 0"),
        (dict(virtual_stages=True), r"^virtual_stages must be an int >= 1, got True"),
        (dict(world_size=0), r"^world_size must be None or an int >= 1, got 0"),
        (dict(seq_len="16"), r"^seq_len must be None or an int >= 1"),
        (
            dict(schedule="zigzag"),
            r"^schedule must be one of \['gpipe', '1f1b', 'interleaved'\], got 'zigzag'",
        ),
        (dict(recompute=None), r"^recompute must be one of"),
        (dict(optimizer="lion"), r"^optimizer must be one of"),
        (dict(hardware=None), r"^hardware must be a preset name"),
        (dict(dtype=16), r"^dtype must be None or a str"),
        (dict(zero=1), r"^zero must be True or False, got 1"),
        (dict(world_size=10**6, data=10**6), r"^world_size must be at most MAX_WORLD_SIZE"),
    ],
)
def test_make_config_names_its_own_arguments(knobs, message):
    from search.single import make_config

    with pytest.raises(ValueError, match=message):
        make_config("mlp-xs", **knobs)


@pytest.mark.parametrize("model", [None, 3, ("mlp-xs",)])
def test_make_config_needs_one_model(model):
    from search.single import make_config

    with pytest.raises(ValueError, match=r"^model must be a model preset name"):
        make_config(model)
