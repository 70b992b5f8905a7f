"""Coarse programs: one op per pipeline step, for sweeps over large models.

A fine program of GPT-3 175B under a pipeline schedule has millions of ops;
its coarse version has one op per (chunk, microbatch, direction), one per
message, and a few per stage for data parallelism. Two ways to get one:

* :func:`coarsen` fuses the ops of any lowered program by caller-given labels
  (e.g. a program built by the real transforms), keeping its timeline and
  peak memory on a reference topology.
* :func:`coarse_pipeline_program` builds the same coarse program directly as
  arrays from :func:`layer_features` (one fine block, measured once per
  tensor degree, recompute policy and hardware) and a
  :class:`PipelineTemplate` (one per structural key), without any IR.

Tests check that the two agree op for op on small models.
"""

from distir_jax.transforms.coarse_features import (
    DIRECTIONS,
    PARTS,
    LayerFeatures,
    layer_features,
    layer_parts,
)
from distir_jax.transforms.coarse_fuse import allocate_finish_slots, coarsen, fuse_groups, prune_implied
from distir_jax.transforms.coarse_pipeline import (
    DATA_MODES,
    KIND_NAMES,
    PipelineTemplate,
    data_mode,
    pipeline_template,
    template_size,
)
from distir_jax.transforms.coarse_program import (
    ChunkTables,
    ModeRows,
    SplitBlockError,
    balanced_layers,
    chunk_step_rows,
    chunk_tables,
    chunk_tables_by_mode,
    coarse_pipeline_program,
    data_parallel_channels,
    mode_rows,
    prepare_chunkings,
    realize,
    stage_devices,
    stage_peak_memory,
    steady_pipeline_program,
    templated_pipeline_program,
    transform_layers_per_chunk,
    transform_step_costs,
)
from distir_jax.transforms.coarse_schedule import estimated_times, message_times, schedule_arrays

__all__ = [
    "DATA_MODES",
    "DIRECTIONS",
    "KIND_NAMES",
    "PARTS",
    "ChunkTables",
    "LayerFeatures",
    "ModeRows",
    "PipelineTemplate",
    "SplitBlockError",
    "allocate_finish_slots",
    "balanced_layers",
    "chunk_step_rows",
    "chunk_tables",
    "chunk_tables_by_mode",
    "coarse_pipeline_program",
    "coarsen",
    "data_mode",
    "data_parallel_channels",
    "estimated_times",
    "fuse_groups",
    "layer_features",
    "layer_parts",
    "message_times",
    "mode_rows",
    "pipeline_template",
    "prepare_chunkings",
    "prune_implied",
    "realize",
    "schedule_arrays",
    "stage_devices",
    "stage_peak_memory",
    "steady_pipeline_program",
    "templated_pipeline_program",
    "template_size",
    "transform_layers_per_chunk",
    "transform_step_costs",
]
