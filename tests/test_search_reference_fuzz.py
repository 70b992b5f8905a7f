"""Random strategy spaces, swept, against the reference simulator run on each row alone.

The fixed spaces of test_search_evaluate.py and test_search_fast.py cover the
knobs one by one; here a seeded generator mixes them (GPT and MLP models,
dtypes, 1-8 GPUs and 3 or 6 (ZeRO's padded shards), every schedule, recompute,
ZeRO, gradient overlap and sequence parallelism, three hardware presets, long
pipelines that run as steady programs; and 8-16 Hopper / Blackwell GPUs with
grouped-query attention and every training precision, FP8 included) and
checks random rows of each sweep: step time, the busiest device's compute +
communication and its bubble to 1e-9, peak memory exactly. (Such a fuzz found
float64 sweeps stacking their inputs in float32.)
"""

import numpy as np
import pytest

from distir_jax.executor.reference import reference_simulate
from distir_jax.models import MLPConfig, TransformerConfig
from distir_jax.transforms import coarse_steady
from search import StrategySpace, build_function, enumerate_configs, evaluate


def _some(rng: np.random.Generator, values: list, most: int) -> tuple:
    """1 to ``most`` of ``values``, at random."""
    return tuple(rng.choice(values, size=int(rng.integers(1, most + 1)), replace=False))


def _random_space(
    rng: np.random.Generator, long: bool, odd: bool = False, wide: bool = False
) -> StrategySpace:
    """A small space; ``long``: 1F1B / interleaved pipelines of 16 or 32 microbatches
    (steady programs, with the test's threshold); ``odd``: 3 or 6 GPUs (degrees of 3,
    whose ZeRO shards pad every weight's rows); ``wide``: 8 or 16 GPUs of the Hopper
    and Blackwell presets (two nodes: rings per network port), grouped-query
    attention and every training precision, FP8 included."""
    if wide:
        return _wide_space(rng)
    layers = int(rng.choice([4, 8] if long else [2, 4, 6, 8]))
    if rng.random() < 0.6:
        heads = int(rng.choice([3, 6] if odd else [2, 4]))
        model = TransformerConfig(
            num_layers=layers,
            hidden=heads * int(rng.choice([8, 16])),
            num_heads=heads,
            vocab_size=int(rng.choice([32, 50])),
            seq_len=int(rng.choice([8, 16])),
            dtype=str(rng.choice(["f32", "bf16"])),
        )
    else:
        model = MLPConfig(num_layers=layers, hidden=int(rng.choice([16, 32])), dtype="f32")
    microbatches = (int(rng.choice([16, 32])),) if long else tuple(map(int, rng.choice([1, 2, 4, 8], 2)))
    schedules = ["1f1b", "interleaved"] if long else ["gpipe", "1f1b", "interleaved"]
    worlds = [3, 6] if odd else [4, 8] if long else [1, 2, 4, 8]
    return StrategySpace(
        model=model,
        world_sizes=(int(rng.choice(worlds)),),
        global_batch_sizes=(max(microbatches) * int(rng.choice([3, 6] if odd else [1, 2])),),
        microbatches=tuple(sorted(set(microbatches))),
        pipeline=(int(rng.choice([2, 4])),) if long else None,
        schedules=_some(rng, schedules, len(schedules)),
        virtual_stages=(2,),
        recompute=_some(rng, ["none", "attention", "full"], 2),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        sequence_parallel=(False, bool(rng.random() < 0.3)),
        hardware=(str(rng.choice(["dgx-a100-80gb", "dgx-h100", "v100-pcie-4"])),),
        optimizer=(str(rng.choice(["sgd", "adam"])),),
    )


def _wide_space(rng: np.random.Generator) -> StrategySpace:
    heads = int(rng.choice([2, 4, 8]))
    model = TransformerConfig(
        num_layers=int(rng.choice([2, 4])),
        hidden=heads * 8,
        num_heads=heads,
        num_kv_heads=int(rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])),
        vocab_size=64,
        seq_len=int(rng.choice([8, 16])),
        dtype="bf16",
    )
    microbatches = tuple(sorted({int(m) for m in rng.choice([1, 2, 4], 2)}))
    return StrategySpace(
        model=model,
        world_sizes=(int(rng.choice([8, 16])),),
        global_batch_sizes=(16,),
        microbatches=microbatches,
        schedules=_some(rng, ["gpipe", "1f1b", "interleaved"], 3),
        virtual_stages=(2,),
        recompute=_some(rng, ["none", "attention", "full"], 2),
        zero=(False, True),
        overlap_grad_comm=(False, True),
        sequence_parallel=(False, bool(rng.random() < 0.4)),
        training_precision=_some(rng, ["mixed", "mixed-half-grads", "half", "mixed-fp8"], 2),
        hardware=(str(rng.choice(["dgx-h100", "dgx-h200", "dgx-b200"])),),
        optimizer=(str(rng.choice(["sgd", "adam"])),),
    )


def _busiest_device(reference) -> tuple[float, float]:
    """The reference's busiest device: its busy seconds (every stream) and its bubble
    (step time less its busiest stream's seconds), as the sweep's breakdown reports them."""
    busy: dict[int, float] = {}
    for (device, _), seconds in reference.busy_time.items():
        busy[device] = busy.get(device, 0.0) + seconds
    device = max(busy, key=busy.get)
    stream = max(s for (d, _), s in reference.busy_time.items() if d == device)
    return busy[device], max(reference.step_time - stream, 0.0)


@pytest.mark.parametrize(
    "seed, long, odd, wide",
    [
        (0, False, False, False),
        (1, False, False, False),
        (2, True, False, False),
        (3, True, False, False),
        (4, False, True, False),
        (5, False, False, True),
    ],
)
def test_random_spaces_sweep_as_the_reference_simulates_each_row(seed, long, odd, wide, monkeypatch):
    if long:  # steady programs from far fewer ops than in real sweeps (the same machinery)
        monkeypatch.setattr(coarse_steady, "MIN_LONG_OPS", 0)
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(4 if long else 8):
        configs = [c for c in enumerate_configs(_random_space(rng, long, odd, wide)) if c.valid]
        if not configs:
            continue
        table = evaluate(configs, progress=False)  # float64
        for i in rng.choice(len(configs), min(3, len(configs)), replace=False):
            if table["status"][i] == "invalid":  # a transform's own check, with its reason
                assert table["reason"][i]
                continue
            reference = reference_simulate(*build_function(configs[i]))
            busy, bubble = _busiest_device(reference)
            what = str(configs[i])
            np.testing.assert_allclose(table["step_time_s"][i], reference.step_time, rtol=1e-9, err_msg=what)
            assert table["peak_memory_bytes"][i] == max(reference.peak_memory.values()), what
            got_busy = table["compute_time_s"][i] + table["communication_time_s"][i]
            np.testing.assert_allclose(got_busy, busy, rtol=1e-9, err_msg=what)
            np.testing.assert_allclose(
                table["bubble_time_s"][i], bubble, rtol=0, atol=1e-9 * reference.step_time
            )
            checked += 1
    assert checked >= (6 if long else 12)
