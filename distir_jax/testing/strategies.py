"""Strategies the calibration tests and ``benchmarks/calibration.py`` fit from, in one place.

Each is ``search.make_config`` keywords besides the model: the benchmark times
what the tests check, on the same runs.
"""

from __future__ import annotations

from distir_jax.models import TransformerConfig

# A 4-layer GPT small enough for the exact engine in a test.
TINY_GPT = TransformerConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=512, seq_len=64)

# Training steps of one model on up to 8 GPUs: data, tensor, pipeline, all three, one GPU.
SMALL_TRAINING_RUNS = (
    dict(batch_size=8, data=2, optimizer="adam"),
    dict(batch_size=8, tensor=2),
    dict(batch_size=8, pipeline=2, microbatches=4),
    dict(batch_size=16, data=2, tensor=2, pipeline=2, microbatches=2, overlap_grad_comm=True),
    dict(batch_size=1),
)

# GPT-3 175B on 64 GPUs: six strategies that lean on different figures.
GPT3_175B_COMMON = dict(world_size=64, batch_size=1024, dtype="bf16", optimizer="adam")
GPT3_175B_RUNS = (
    dict(tensor=8, pipeline=8, microbatches=128, recompute="full"),
    dict(data=2, tensor=8, pipeline=4, microbatches=64, recompute="full", zero=True, overlap_grad_comm=True),
    dict(
        tensor=8, pipeline=8, microbatches=64, schedule="interleaved", virtual_stages=3, recompute="attention"
    ),
    dict(data=4, tensor=4, pipeline=4, microbatches=32, recompute="full"),
    dict(tensor=16, pipeline=4, microbatches=16),
    dict(tensor=32, pipeline=2, microbatches=8, recompute="attention"),
)
