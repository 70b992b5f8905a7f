"""The headline scale case stays small: GPT-3 175B on 1024 GPUs."""

import numpy as np

from distir_jax.hardware import Hardware
from distir_jax.kernel import STATUS_NAMES, simulate
from distir_jax.models import get_model_config
from distir_jax.presets import get_preset
from distir_jax.transforms.coarse import coarse_pipeline_program, layer_features


def test_gpt3_175b_on_1024_gpus_is_a_few_tens_of_thousands_of_ops():
    # d=8, t=8, p=16, 128 microbatches (global batch 1024, microbatch 1),
    # interleaved 1F1B with 2 chunks per device, ZeRO and overlapped gradients.
    model = get_model_config("gpt3-175b")
    topology = get_preset("dgx-a100-80gb:1024")
    features = layer_features(model, 8, "full", 1, topology)
    program = coarse_pipeline_program(
        features,
        topology,
        pipeline=16,
        microbatches=128,
        data=8,
        virtual_stages=2,
        schedule="interleaved",
        zero=True,
        overlap=True,
    )
    num_ops = int(program.num_ops)
    assert 10_000 <= num_ops <= 20_000, num_ops  # 16,192 at the time of writing
    result = simulate(program, Hardware.from_topology(topology))
    assert np.isfinite(float(result.step_time[0])) and float(result.step_time[0]) > 0
    assert STATUS_NAMES[int(result.status[0])] in ("ok", "out of memory")
