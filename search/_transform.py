"""The one place the search package calls the parallelism transforms.

Importing this module fails (``ImportError``) when
``distir_jax.transforms.parallelize`` is not installed; callers treat that as
"no transform checks available".
"""

from __future__ import annotations

import numpy as np

from distir_jax.ir import Function
from distir_jax.models import build_training_step
from distir_jax.transforms.parallelize import ParallelConfig, parallelize
from search.space import Config, _one_line


def parallel_config(config: Config) -> ParallelConfig:
    """The transforms' :class:`ParallelConfig` for one row."""
    return ParallelConfig(
        data=config.data,
        tensor=config.tensor,
        pipeline=config.pipeline,
        microbatches=max(config.microbatches, 1),
        schedule=config.schedule,
        virtual_stages=config.virtual_stages,
        recompute=config.recompute,
        zero=config.zero,
        sequence_parallel=config.sequence_parallel,
        overlap_grad_comm=config.overlap_grad_comm,
    )


def validate_config(config: Config) -> str:
    """``ParallelConfig.validate``'s complaint about ``config`` as one line, or ``""``.

    The ``"ParallelConfig: "`` prefix is dropped: in a table every reason is about the strategy.
    """
    try:
        model = config.model_config
        parallel_config(config).validate(
            model.num_layers,
            getattr(model, "num_heads", None),
            config.global_batch_size,
            config.world_size,
            hidden=model.hidden,
            kv_heads=getattr(model, "num_kv_heads", None),
        )
    except ValueError as err:
        return _one_line(err).removeprefix("ParallelConfig: ")
    return ""


def build_function(
    config: Config,
    batch_size: int | np.ndarray,
    *,
    representative_only: bool = True,
    models: dict | None = None,
) -> Function:
    """The distributed training step of ``config``; ``batch_size`` may be a vector of variants.

    Args:
      config: the row (its global batch size is ignored in favour of ``batch_size``).
      batch_size: the global batch, an int or a 1-D array of size variants.
      representative_only: simulate one replica of each symmetric group (collectives
        are still costed over their full groups).
      models: optional cache of single-device programs (IR functions are
        immutable, so keys that share a model, batch sizes and optimizer share one).
    """
    key = (config.model_config, tuple(np.atleast_1d(batch_size).tolist()), config.optimizer)
    fn = None if models is None else models.get(key)
    if fn is None:
        fn = build_training_step(config.model_config, batch_size, optimizer=config.optimizer)
        if models is not None:
            models[key] = fn
    return parallelize(fn, parallel_config(config), representative_only=representative_only).function
