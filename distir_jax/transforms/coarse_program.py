"""Filling a :class:`PipelineTemplate` with one configuration's numbers.

:func:`coarse_pipeline_program` is the entry point (see :mod:`coarse_pipeline`
for what the ops are); :func:`chunk_tables` and :func:`realize` are its two
halves, exposed for sweeps that fill many configurations into one batch.
Every per-op array is a gather from a small table (a row per chunk, stage or
message kind), so filling a template costs a few vectorized passes over its
ops.

Memory is the fine program's (tests hold peaks to 1e-9 of the exact
engine's, device by device): forward stashes, backward frees and transients
are the fine block's own events, chained through a chunk's blocks, with a
later microbatch's additions into the gradient sums replayed op by op
(:mod:`coarse_segments`, in place); messages, weights, optimizer state,
gradients and each all-reduce's output buffer (ZeRO reduce-scatters, updates
and all-gathers in place, its weight shards views of the weights) are
counted as the transforms emit them.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from distir_jax.cost import COST_FEATURES
from distir_jax.ir.topology import Topology
from distir_jax.ir.types import TensorType
from distir_jax.lower import NO_DEVICE, NO_RESOURCE, Program
from distir_jax.transforms.coarse_features import SHARD_SCALED, LayerFeatures, layer_parts
from distir_jax.transforms.coarse_layers import (
    boundary_bytes,
    layer_chunk_segments,
    layer_chunk_updates,
    layer_pass_memory,
    layer_stage_grads,
    part_counts,
)
from distir_jax.transforms.coarse_pipeline import (
    SEND_ACTIVATION,
    SEND_GRADIENT,
    SYNC_MODES,
    UPDATE,
    PipelineTemplate,
    _BoundedCache,
    data_mode,
    pipeline_template,
)
from distir_jax.transforms.coarse_steady import SteadyTemplate, steady_template, worth_it
from distir_jax.transforms.data_parallel import zero_scatter_attrs, zero_shard

__all__ = [
    "ChunkTables",
    "ModeRows",
    "SplitBlockError",
    "balanced_layers",
    "chunk_step_rows",
    "chunk_tables",
    "chunk_tables_by_mode",
    "coarse_pipeline_program",
    "data_parallel_channels",
    "event_stage_peaks",
    "exact_integers",
    "links_by_kind",
    "mode_rows",
    "part_coefficients",
    "prepare_chunkings",
    "realize",
    "segment_plan",
    "stage_devices",
    "stage_peak_memory",
    "transform_layers_per_chunk",
    "transform_step_costs",
]

_F = len(COST_FEATURES)
_VOLUME, _HOPS = COST_FEATURES.index("comm_volume"), COST_FEATURES.index("comm_hops")
_EMBED, _BLOCK, _HEAD = range(3)
_TENSOR_LINK = 1  # PipelineTemplate.link_kind of the tensor-parallel group's link


@dataclasses.dataclass(frozen=True)
class ChunkTables:
    """One configuration's numbers for :func:`realize` (``S`` variants, ``n`` chunks, ``p`` stages).

    Attributes:
      cost: ``[S, 4n + 2p + 1, F]`` rows: forward of chunk ``c``, first
        backward of ``c``, later backwards of ``c`` (which add to the gradient
        sums), a message, reduction of ``c``, update of stage ``s``, gather of ``s``
        (mode ``"sync_tp"``: its tensor sync).
      alloc, free: ``[S, 3n + p + 3, 2]`` bytes per resource slot, rows: forward
        of ``c``, first backward of ``c``, later backwards of ``c``, an
        activation message, update of ``s``, nothing, a gradient message.
      resident: ``[S, p]`` bytes resident on each stage's device.
      message_rows: None (every message uses the rows above), or ``(cost row,
        memory row)`` where per-boundary message rows start (features
        ``per_layer``: a message after a column layer is a feature shard):
        cost rows ``b`` and memory rows ``b`` (activation) and ``n + b``
        (gradient) for the boundary after chunk ``b``; they follow all others.
      tensor_syncs: the updates sync LayerNorm gradients over the tensor group
        (sequence parallelism): outside the sync modes (whose updates talk to
        the data-parallel group and whose syncs are ops of their own) they are
        costed on that group's link, not on their own device (see :func:`realize`).
    """

    cost: np.ndarray
    alloc: np.ndarray
    free: np.ndarray
    resident: np.ndarray
    message_rows: tuple[int, int] | None = None
    tensor_syncs: bool = False


def balanced_layers(features: LayerFeatures, num_chunks: int) -> np.ndarray:
    """Blocks per chunk, balancing forward + backward flops as the pipeline transform does.

    Blocks are identical, so instead of the transform's dynamic program this
    fills blocks one at a time into the currently cheapest chunk (the
    embedding weighs on the first chunk, the head on the last), which
    minimizes both the costliest chunk and the sum of squares the transform
    minimizes. Among equally cheap chunks the latest gets the block, as the
    transform tends to choose: later 1F1B stages keep fewer microbatches in
    flight, so this also keeps peak memory lower. (On ties the two may still
    differ in which chunk gets a block.)

    Features measured per layer (``features.per_layer``) get the pipeline
    transform's own cut (:func:`transform_layers_per_chunk`), in layers.
    """
    return _balanced_layers(features, int(num_chunks))


@functools.lru_cache(maxsize=4096)
def _balanced_layers(features: LayerFeatures, num_chunks: int) -> np.ndarray:
    if features.per_layer:
        return transform_layers_per_chunk(features, num_chunks)
    per_part = features.step_flops.sum(axis=1).mean(axis=-1)  # [3]: forward + backward, mean over variants
    return _fill_blocks(
        float(per_part[_EMBED]),
        float(per_part[_BLOCK]),
        float(per_part[_HEAD]),
        features.num_blocks,
        int(num_chunks),
        features.ends_are_blocks,
    )


class SplitBlockError(ValueError):
    """The pipeline transform would cut inside a block, which a coarse program cannot express."""


def transform_layers_per_chunk(
    features: LayerFeatures, num_chunks: int, variants: Sequence[int] | None = None
) -> np.ndarray:
    """Blocks per chunk exactly as the pipeline transform cuts the model into stages.

    The transform partitions the model's layers with
    :func:`~distir_jax.transforms.pipeline.balanced_boundaries` on per-layer
    flops (the mean over the size variants it is built with: ``variants`` of
    ``features``, default all); this runs it on the same costs, from the
    measured blocks repeated.

    With ``features.per_layer`` the cut is in layers (of any part).

    Raises:
      SplitBlockError: a chunk boundary would fall inside a block (an MLP's
        column / row layer pair under tensor parallelism), which features
        measured per pair cannot express (features measured per layer can).
    """
    costs = features.layer_costs(None if variants is None else tuple(int(v) for v in variants))
    u, blocks = features.layers_per_block, features.num_blocks
    parts = layer_parts(blocks) if features.per_layer else None
    scaled = _power_of_two_scaled(costs)
    return _transform_cut(scaled, u, blocks, int(num_chunks), features.ends_are_blocks, parts)


def _power_of_two_scaled(costs: tuple) -> tuple:
    """``costs`` divided by the power of two at or above their largest: the same cut
    (every sum, square and comparison of the partition scales exactly), and a
    cache key that microbatch sizes a power of two apart share (their flops
    are multiples: GPT-3 175B's product sweep cuts 216 times instead of 1,534)."""
    x = np.asarray(costs, np.float64)
    if not x.size or not np.all(np.isfinite(x)) or x.max() <= 0.0:
        return tuple(costs)
    return tuple(np.ldexp(x, -int(np.frexp(x.max())[1])).tolist())


@functools.lru_cache(maxsize=4096)
def _transform_cut(
    measured: tuple, u: int, blocks: int, num_chunks: int, ends_are_blocks: bool, parts: tuple | None = None
) -> np.ndarray:
    from distir_jax.transforms.pipeline import balanced_boundaries

    if not 1 <= num_chunks <= blocks * u:
        raise ValueError(f"cannot cut {blocks} blocks into {num_chunks} chunks of at least one block")
    if num_chunks > blocks:
        raise SplitBlockError(f"{num_chunks} stages split some of the {blocks} blocks of {u} layers")
    if parts is not None:  # measured: layer 0 (none), the six measured layers, the loss
        units = [measured[1 + q] for q in parts]
    elif ends_are_blocks:  # measured: layer 0 (none), first, middle and last blocks, the loss
        first, middle, last = (list(measured[1 + i * u : 1 + (i + 1) * u]) for i in range(3))
        units = first + middle * (blocks - 2) + last if blocks > 1 else first
    else:  # measured: layer 0 (embedding), one block, the head
        units = list(measured[1:2]) * blocks
    costs = [measured[0], *units, measured[-1]]
    starts = np.asarray([1, *balanced_boundaries(costs, num_chunks), len(units) + 1])
    if np.any((starts - 1) % u):
        raise SplitBlockError(
            f"the pipeline transform's stages split a block of {u} layers "
            f"(stages start at layers {list(starts[1:-1])})"
        )
    layers = np.diff(starts) // u
    layers.setflags(write=False)
    return layers


def part_coefficients(features: LayerFeatures, layers_per_chunk: Sequence[int]) -> np.ndarray:
    """``[n, 3]``: how many of each part (embedding, block, head) chunk ``c`` holds.

    With ``features.ends_are_blocks`` (MLPs) the first chunk's first block is
    the embedding part and the last chunk's last block the head part. With
    ``features.per_layer``, ``[n, P]``: layers of each part (see
    :func:`~distir_jax.transforms.coarse_layers.part_counts`).
    """
    if features.per_layer:
        return part_counts(features, tuple(int(x) for x in layers_per_chunk))
    return _block_coefficients(layers_per_chunk, features.ends_are_blocks)


def _block_coefficients(layers_per_chunk: Sequence[int], ends_are_blocks: bool) -> np.ndarray:
    n = len(layers_per_chunk)
    return _block_coefficients_at(layers_per_chunk, np.arange(n) == 0, np.arange(n) == n - 1, ends_are_blocks)


def _block_coefficients_at(layers, first: np.ndarray, last: np.ndarray, ends_are_blocks: bool) -> np.ndarray:
    """:func:`_block_coefficients` of chunks ``layers`` where ``first`` and ``last``
    mark the first and last chunks (several pipelines' chunks, one after the other)."""
    layers = np.asarray(layers, np.float64)
    blocks = layers - first - last if ends_are_blocks else layers
    return np.stack([first, blocks, last], axis=1).astype(np.float64)


def transform_step_costs(
    features: LayerFeatures, layers_per_chunk: Sequence[int], variants: Sequence[int] | None = None
) -> np.ndarray:
    """``[p * v, 2]`` step-cost estimates as the pipeline transform makes them: ``1 + flops``.

    The transform orders the steps of all devices by start times estimated
    from each chunk's forward / backward flops (the mean over the size
    variants it is built with: ``variants`` of ``features``, default all);
    passed as ``step_costs`` these give a template the fine program's order.
    """
    flops = features.step_flops if variants is None else features.step_flops[..., list(variants)]
    return 1.0 + part_coefficients(features, layers_per_chunk) @ flops.mean(axis=-1)


@functools.lru_cache(maxsize=4096)
def _fill_blocks(
    embed: float, block: float, head: float, num_blocks: int, num_chunks: int, ends_are_blocks: bool = False
) -> np.ndarray:
    layers = np.ones(num_chunks, np.int64)
    cost = np.full(num_chunks, block)
    if ends_are_blocks:  # the first and last blocks are the embedding and head parts themselves
        cost[0], layers[-1] = embed, layers[-1] + (num_chunks == 1)
        cost[-1] = cost[-1] + head if num_chunks == 1 else head
    else:
        cost[0] += embed
        cost[-1] += head
    if not 1 <= num_chunks or layers.sum() > num_blocks:
        raise ValueError(f"cannot cut {num_blocks} blocks into {num_chunks} chunks of at least one block")
    # Each block to the cheapest chunk, the latest of those (a heap of (cost, -chunk)).
    heap = [(float(x), -c) for c, x in enumerate(cost)]
    heapq.heapify(heap)
    for _ in range(num_blocks - int(layers.sum())):
        x, c = heap[0]
        layers[-c] += 1
        heapq.heapreplace(heap, (x + block, c))
    layers.setflags(write=False)
    return layers


def _chain(first, second):
    """Two passes one after the other: ``(peak rise, net bytes)``."""
    return np.maximum(first[0], first[1] + second[0]), first[1] + second[1]


@dataclasses.dataclass(frozen=True)
class _PipelineParts:
    """What :func:`chunk_tables` needs that does not depend on data parallelism."""

    coef: np.ndarray  # [n, 3] parts per chunk
    stage_coef: np.ndarray | None  # [p, 3] parts per stage
    steps: np.ndarray  # [S, 3n + 1, F]: forward, first backward, later backwards of each chunk, a message
    fwd: tuple  # (rise, net) [n, S] of each chunk's forward
    bwd: list  # the same of its first and of its later backwards


@functools.lru_cache(maxsize=4096)
def _pipeline_parts(features: LayerFeatures, layers: tuple, p: int) -> _PipelineParts:
    """Chunk costs and pass memory of ``layers`` blocks per chunk on ``p`` stages, shared by
    every data-parallel degree, ZeRO setting and mode (cached; read only)."""
    parts = _chunk_parts(features, layers)
    stage_coef = np.zeros((p, parts.coef.shape[1]))
    np.add.at(stage_coef, np.arange(len(layers)) % p, parts.coef)
    stage_coef.setflags(write=False)
    # Not dataclasses.replace: it costs more than the rest of this function.
    return _PipelineParts(parts.coef, stage_coef, parts.steps, parts.fwd, parts.bwd)


def _chunk_parts(features: LayerFeatures, layers: tuple) -> _PipelineParts:
    """:func:`_pipeline_parts` but ``stage_coef`` (None): what does not depend on the
    number of stages, shared by every pipeline depth with these chunks (cached;
    :func:`prepare_chunkings` computes many at once)."""
    return _CHUNK_PARTS.get(features, layers)


def prepare_chunkings(features: LayerFeatures, chunkings) -> None:
    """Computes the chunk tables of many chunkings of one model (each a sequence
    of blocks per chunk) in one vectorized pass and caches them, for the
    pipelines a sweep is about to build (:func:`mode_rows`, :func:`chunk_tables`,
    :func:`chunk_step_rows`): benchmark (b)'s GPT-3 175B sweep has 201
    chunkings of 18 features, 28 ms one at a time and 10 ms so. The tables
    are the same either way."""
    keys = list(dict.fromkeys((features, tuple(int(x) for x in layers)) for layers in chunkings))
    _CHUNK_PARTS.get_many(keys, _chunk_parts_of)


def _chunk_parts_of(keys: list[tuple]) -> list[_PipelineParts]:
    """:func:`_chunk_parts` of each ``(features, layers)``, computed together per features."""
    out = [None] * len(keys)
    by_features: dict = {}
    for i, (features, _) in enumerate(keys):
        by_features.setdefault(features, []).append(i)
    for features, members in by_features.items():
        if features.per_layer:  # chunks of single layers, chained one by one
            made = [_layer_chunk_parts(features, keys[i][1]) for i in members]
        else:
            made = _whole_block_chunk_parts(features, [keys[i][1] for i in members])
        for i, parts in zip(members, made, strict=True):
            out[i] = parts
    return out


def _chunk_parts_nbytes(parts: _PipelineParts) -> int:
    arrays = (parts.coef, parts.steps, *parts.fwd, *(x for b in parts.bwd for x in b))
    return sum(x.nbytes for x in arrays)


def _one_chunk_parts(features: LayerFeatures, layers: tuple) -> _PipelineParts:
    return _chunk_parts_of([(features, layers)])[0]


_CHUNK_PARTS = _BoundedCache(_one_chunk_parts, _chunk_parts_nbytes, 256 << 20)


def _step_rows(features: LayerFeatures, coef: np.ndarray) -> np.ndarray:
    """``[S, n, 3, F]`` each chunk's forward, first and later backward costs (its
    parts' ``coef``: ``[n, 3]``, or ``[n, P]`` per layer)."""
    step = features.step  # [3, 2, S, F]
    forward = np.einsum("cq,qsf->scf", coef, step[:, 0])
    backward = np.einsum("cq,qsf->scf", coef, step[:, 1])
    accumulate = coef @ features.accumulate  # [n, F]: later microbatches add to the running sums
    return np.stack([forward, backward, backward + accumulate[None]], axis=2)


def _message_row(features: LayerFeatures) -> np.ndarray:
    """``[S, 1, F]`` the cost row of a message between chunks."""
    message = np.zeros((features.num_variants, 1, _F))
    message[:, 0, _VOLUME] = features.message_bytes
    message[:, 0, _HOPS] = 1.0
    return message


def _steps_of(rows: np.ndarray, message: np.ndarray) -> np.ndarray:
    """``[S, 3n + 1, F]`` (forwards, first backwards, later backwards, a message) from
    :func:`_step_rows`' ``[S, n, 3, F]``."""
    return np.concatenate([rows.transpose(0, 2, 1, 3).reshape(rows.shape[0], -1, _F), message], axis=1)


def _layer_chunk_parts(features: LayerFeatures, layers: tuple) -> _PipelineParts:
    """:func:`_chunk_parts` of features measured per layer."""
    coef = part_coefficients(features, layers)  # [n, P] layers of each part per chunk
    steps = _steps_of(_step_rows(features, coef), _message_row(features))
    fwd, bwd = layer_pass_memory(features, layers)
    for x in (coef, steps, *fwd, *(y for b in bwd for y in b)):
        x.setflags(write=False)
    return _PipelineParts(coef, None, steps, fwd, bwd)


def _whole_block_chunk_parts(features: LayerFeatures, chunkings: list[tuple]) -> list[_PipelineParts]:
    """:func:`_chunk_parts` of several chunkings of whole blocks, computed over all
    their chunks at once (every quantity is per chunk, given where each chunking
    starts and ends) and then cut apart (views of shared read-only arrays)."""
    sizes = np.asarray([len(c) for c in chunkings], np.int64)
    ends = np.cumsum(sizes)
    layers = np.asarray([x for c in chunkings for x in c], np.int64)
    first = np.zeros(len(layers), bool)
    first[ends - sizes] = True
    last = np.zeros(len(layers), bool)
    last[ends - 1] = True
    coef = _block_coefficients_at(layers, first, last, features.ends_are_blocks)  # [N, 3] parts per chunk
    rows = _step_rows(features, coef)  # [S, N, 3, F]
    message = _message_row(features)
    # Memory of each chunk's passes, chained from its parts.
    rise_f, net_f = features.peak_rise[:, 0], features.net_bytes[:, 0]  # [3, S]
    rise_b, net_b = features.backward_rise, features.backward_net  # [3, later, input freed, S]
    # A received input is freed by the chunk's own first part when the sender's
    # backward keeps the original (MLPs); otherwise the measured events free it.
    receives = ~first & features.output_used_by_own_backward
    count = coef[:, 1:2]  # blocks; the first chunk may hold none besides the embedding (MLPs)

    # Passes as [..., N, S]: the forward's, and the backwards' with a leading axis
    # for the first and the later microbatches (one pass over both).
    def part(rise, net, present):  # [..., S] each -> [..., N, S] where present
        where = present[:, None]
        return np.where(where, rise[..., None, :], 0.0), np.where(where, net[..., None, :], 0.0)

    def blocks(rise, net, num):  # num identical blocks one after the other
        peak = rise[..., None, :] + np.maximum(0.0, (num - 1) * net[..., None, :])
        return np.where(num > 0, peak, 0.0), num * net[..., None, :]

    absent = (np.zeros((len(layers), features.num_variants)),) * 2
    fwd = _chain(
        _chain(
            _chain(absent, part(rise_f[_EMBED], net_f[_EMBED], first)),
            blocks(rise_f[_BLOCK], net_f[_BLOCK], count),
        ),
        part(rise_f[_HEAD], net_f[_HEAD], last),
    )
    r, m = np.moveaxis(rise_b, 1, 0), np.moveaxis(net_b, 1, 0)  # [later, 3, input freed, S]
    head_first = receives & (count[:, 0] == 0)  # the head is the chunk's only (first) part
    head = _chain(
        part(r[:, _HEAD, 0], m[:, _HEAD, 0], last & ~head_first),
        part(r[:, _HEAD, 1], m[:, _HEAD, 1], last & head_first),
    )
    first_block = (receives & (count[:, 0] > 0))[:, None]
    body = _chain(
        blocks(r[:, _BLOCK, 0], m[:, _BLOCK, 0], count - first_block),
        blocks(r[:, _BLOCK, 1], m[:, _BLOCK, 1], first_block * 1.0),
    )
    rise, net = _chain(_chain(head, body), part(r[:, _EMBED, 0], m[:, _EMBED, 0], first))
    shared = (coef, *fwd, rise, net)
    for x in shared:
        x.setflags(write=False)
    out = []
    for a, b in zip((ends - sizes).tolist(), ends.tolist(), strict=True):
        steps = _steps_of(rows[:, a:b], message)
        steps.setflags(write=False)
        bwd = [(rise[0, a:b], net[0, a:b]), (rise[1, a:b], net[1, a:b])]
        out.append(_PipelineParts(coef[a:b], None, steps, (fwd[0][a:b], fwd[1][a:b]), bwd))
    return out


def chunk_tables(
    features: LayerFeatures,
    layers_per_chunk: Sequence[int],
    pipeline: int,
    microbatches: int,
    *,
    data: int = 1,
    zero: bool = False,
    mode: str = "none",
    segments: bool = False,
    step_rows: bool = True,
) -> ChunkTables:
    """The tables of one configuration, for all of ``features``' size variants.

    Args:
      features: the model's part features.
      layers_per_chunk: blocks of each of the ``n = p * v`` chunks.
      pipeline, microbatches: ``p`` and ``k`` (``k`` only sizes the resident
        token and label inputs).
      data, zero, mode: data-parallel degree, ZeRO, and :func:`data_mode`.
      segments: append the rows of each chunk's last backward cut into
        segments and of each gradient's reduction (mode ``"overlap"``, for a
        template built with :func:`segment_plan`).
      step_rows: False leaves the chunks' step rows (the first ``3n + 1``
        cost rows) out of ``cost``: they depend on ``features`` and
        ``layers_per_chunk`` only (:func:`chunk_step_rows`), for callers that
        keep one copy for every pipeline depth and data-parallel mode.

    Returns:
      A :class:`ChunkTables` with a leading ``S`` axis.
    """
    if not step_rows and (segments or features.per_layer):
        raise ValueError("step_rows=False applies to whole-block tables without segments only")
    (tables,) = chunk_tables_by_mode(
        features, layers_per_chunk, pipeline, microbatches, [(data, zero, mode)], step_rows=step_rows
    )
    layers, k = tuple(int(x) for x in layers_per_chunk), int(microbatches)
    if segments:
        if not mode.startswith("overlap"):
            raise ValueError(f"segments apply to the overlap modes only, got mode {mode!r}")
        tables = _with_segments(tables, features, layers, k, data, zero)
    if features.per_layer:
        tables = _with_boundary_messages(tables, features, layers)
    if features.sequence_parallel:
        tables = dataclasses.replace(tables, tensor_syncs=True)
    return tables


def chunk_tables_by_mode(
    features: LayerFeatures,
    layers_per_chunk: Sequence[int],
    pipeline: int,
    microbatches: int,
    modes: Sequence[tuple[int, bool, str]],
    *,
    step_rows: bool = True,
) -> list[ChunkTables]:
    """:func:`chunk_tables` (without segments) of one pipeline for each
    ``(data, zero, mode)`` of ``modes``, computed together: what they share
    once, the rest stacked over them (a sweep's data-parallel variants of a
    pipeline cost little more than one). ``step_rows`` as for
    :func:`chunk_tables`; one :class:`ChunkTables` per mode, in order.
    :func:`mode_rows` gives the same numbers without the copies."""
    rows = mode_rows(features, layers_per_chunk, pipeline, microbatches, modes)
    m, (s, memory_rows, _) = len(modes), rows.alloc.shape
    steps = [_chunk_parts(features, rows.layers).steps] if step_rows else []  # [S, 3n + 1, F]
    cost = np.empty((m, s, sum(x.shape[1] for x in steps) + rows.other.shape[1], _F))
    if steps:
        cost[:, :, : steps[0].shape[1]] = steps[0]
    cost[:, :, cost.shape[2] - rows.other.shape[1] :] = rows.other[:, None]
    alloc = np.empty((m, s, memory_rows, 2))
    alloc[:] = rows.alloc
    free = np.empty_like(alloc)
    free[:] = rows.free
    alloc[:, :, rows.update_rows, 0] += rows.update_extra[:, None]
    free[:, :, rows.update_rows, 0] += rows.update_extra[:, None]
    return [ChunkTables(cost[i], alloc[i], free[i], rows.resident[i]) for i in range(m)]


@dataclasses.dataclass(frozen=True)
class ModeRows:
    """:func:`chunk_tables_by_mode`'s tables of one pipeline, compact: what its
    ``M`` data-parallel modes share once, the rest per mode, and no size axis
    where the numbers do not depend on the microbatch size. A mode's
    :class:`ChunkTables` (``step_rows=False``) is ``cost = other`` (for every
    size), ``alloc`` and ``free`` with ``update_extra`` added to slot 0 of
    the update rows (:attr:`update_rows`), and ``resident``.

    Attributes:
      layers: blocks per chunk.
      alloc, free: ``[S, 3n + p + 3, 2]`` memory rows every mode shares (read only).
      update_extra: ``[M, p]`` bytes each stage's update allocates and frees
        besides (the transient of reducing its gradients, mode ``"sync"``).
      other: ``[M, n + 2p, F]`` the cost rows after the step rows: each chunk's
        reduction, each stage's update and gather (independent of the size).
      resident: ``[M, S, p]`` bytes resident per stage.
    """

    layers: tuple[int, ...]
    alloc: np.ndarray
    free: np.ndarray
    update_extra: np.ndarray
    other: np.ndarray
    resident: np.ndarray

    @property
    def update_rows(self) -> slice:
        """The memory rows of the stages' updates, ``3n + 1 .. 3n + p``."""
        start = 3 * len(self.layers) + 1
        return slice(start, start + self.update_extra.shape[1])


def mode_rows(
    features: LayerFeatures,
    layers_per_chunk: Sequence[int],
    pipeline: int,
    microbatches: int,
    modes: Sequence[tuple[int, bool, str]],
) -> ModeRows:
    """The tables of :func:`chunk_tables_by_mode` (without step rows) as
    :class:`ModeRows`: for sweeps that gather rows from them rather than copy them."""
    p, k = int(pipeline), int(microbatches)
    layers = tuple(int(x) for x in layers_per_chunk)
    s = features.num_variants
    base = _pipeline_parts(features, layers, p)
    modes = _ModeParts.key(modes)
    parts = _mode_parts(features, modes)
    other = np.concatenate(
        [
            np.matmul(base.coef, parts.reduce),  # each chunk's reduction
            np.matmul(base.stage_coef, parts.update),  # each stage's update
            np.matmul(base.stage_coef, parts.last),  # each stage's gather, or tensor sync
        ],
        axis=1,
    )
    alloc, free, params, state = _memory_base(features, layers, p)
    extra = np.zeros((len(modes), p))
    if parts.reduction_peak.size:  # ZeRO reduce-scatters in place: no rise
        extra[parts.reduction_peak] = _reduction_peak(features, layers, p)
    # ZeRO's weight shards are views of the weights: only the state is sharded.
    resident = params + state / parts.shard[:, None]  # [M, p]
    for i, state_shard in parts.padded:  # the state shards, padded rows included
        resident[i] = params + base.stage_coef @ state_shard
    data_inputs = k * features.data_bytes  # [S]
    resident = np.repeat(resident[:, None], s, axis=1)
    resident[:, :, 0] += data_inputs  # tokens, on the first chunk's stage
    resident[:, :, (len(layers) - 1) % p] += data_inputs  # labels, on the last chunk's stage
    return ModeRows(layers, alloc, free, extra, other, resident)


class _ModeParts(NamedTuple):
    """What :func:`mode_rows` computes per data-parallel mode, whatever the
    pipeline: ``[M, P, F]`` each part's reduction, update (with what the mode
    adds to it) and last op (gather or tensor sync); ``[M]`` the ZeRO shard
    count; the modes whose updates rise by the reduction's transient
    (``reduction_peak``, indices) and ``(mode, [P] state bytes per shard)``
    of those whose ZeRO shards pad some weight's rows."""

    reduce: np.ndarray
    update: np.ndarray
    last: np.ndarray
    shard: np.ndarray
    reduction_peak: np.ndarray
    padded: tuple

    @staticmethod
    def key(modes) -> tuple:
        return tuple((int(d), bool(z), str(mode)) for d, z, mode in modes)


@functools.lru_cache(maxsize=1024)  # by the features' identity: a sweep asks once per pipeline
def _mode_parts(features: LayerFeatures, modes: tuple) -> _ModeParts:
    data = np.asarray([d for d, _, _ in modes], np.int64)
    zero = np.asarray([z for _, z, _ in modes], bool)
    sync = np.asarray([mode in SYNC_MODES for _, _, mode in modes], bool)
    shard = np.where(zero, data, 1)
    parts = [features.data_parallel(int(d), bool(z)) for d, z in zip(data, zero, strict=True)]
    reduce_parts = np.stack([r for r, _ in parts])  # [M, 3, F] (per layer: [M, P, F])
    gather_parts = np.stack([g for _, g in parts])
    # LayerNorm gradients' tensor-group syncs (sequence parallelism; zero
    # without): in the sync modes an op of their own (mode "sync_tp", on the
    # gather rows, which those modes' updates hold), else in the updates (on the
    # tensor group's link). The measured update holds them: take them out.
    syncs = np.stack([features.sync_parts(int(n)) for n in shard])  # [M, P, F]
    updates = features.optimizer - features.sync_parts(1)
    adam = np.repeat(updates[None], len(modes), axis=0)
    adam[:, :, SHARD_SCALED] /= shard[:, None, None]
    # Modes whose ZeRO shards pad some weight's rows: each part's update per its shard's rows.
    padded = [(i, features.zero_shards(int(data[i]))) for i in np.flatnonzero(zero & (data > 1))]
    padded = [(int(i), shards) for i, shards in padded if shards is not None]
    for i, (_, scale) in padded:
        adam[i][:, SHARD_SCALED] = updates[:, SHARD_SCALED] * scale[:, None]
    out = _ModeParts(
        reduce_parts,
        adam + np.where(sync[:, None, None], reduce_parts + gather_parts, syncs),
        np.where(sync[:, None, None], syncs, gather_parts),
        shard,
        np.flatnonzero(sync & ~zero),
        tuple((i, state_shard) for i, (state_shard, _) in padded),
    )
    for x in out[:5]:
        x.setflags(write=False)  # cached
    return out


def chunk_step_rows(features: LayerFeatures, layers_per_chunk: Sequence[int]) -> np.ndarray:
    """``[S, 3n + 1, F]`` the cost rows :func:`chunk_tables` leaves out with
    ``step_rows=False`` (the same for every pipeline depth and data-parallel
    mode; cached, read only)."""
    return _chunk_parts(features, tuple(int(x) for x in layers_per_chunk)).steps


@functools.lru_cache(maxsize=4096)
def _memory_base(features: LayerFeatures, layers: tuple, p: int) -> tuple:
    """``(alloc, free, params, state)`` of :func:`chunk_tables` that every
    data-parallel degree, ZeRO setting and mode share (cached; read only):
    passes, messages and each stage's gradients; weight (with mixed-fp8's
    FP8 copies) and optimizer state bytes per stage."""
    base = _pipeline_parts(features, layers, p)
    n, s = len(layers), features.num_variants
    alloc = np.zeros((s, 3 * n + p + 3, 2))
    free = np.zeros_like(alloc)
    for i, (a, b) in enumerate([base.fwd, base.bwd[0], base.bwd[1]]):
        alloc[:, i * n : (i + 1) * n, 0] = a.T
        free[:, i * n : (i + 1) * n, 0] = (a - b).T
    # A message arrives on the receiver, and the sender's copy goes, unless the
    # sender's own backward still reads it (an MLP's Relu output): then the
    # chunk's measured backward frees it (and the receiver's copy goes in the
    # next chunk's backward, see `receives`).
    message = features.message_bytes
    kept = features.output_used_by_own_backward
    for row, sender_frees in ((3 * n, not kept), (3 * n + p + 2, True)):  # activation, gradient
        alloc[:, row, 1] = message
        free[:, row, 0] = message if sender_frees else 0.0
    weights = base.stage_coef @ features.param_bytes
    free[:, 3 * n + 1 : 3 * n + 1 + p, 0] = weights  # each stage's gradients: as large as its weights
    # Weights, and their FP8 copies (mixed-fp8): resident whole on every replica.
    params = weights if features.copy_bytes is None else weights + base.stage_coef @ features.copy_bytes
    state = base.stage_coef @ features.state_bytes
    out = (alloc, free, params, state)
    for x in out:
        x.setflags(write=False)
    return out


def _with_boundary_messages(tables: ChunkTables, features: LayerFeatures, layers: tuple) -> ChunkTables:
    """``tables`` plus a cost row per boundary and a memory row per boundary and direction
    (see ``ChunkTables.message_rows``): a message after a column layer is a feature shard.

    As for whole pairs, an activation stays on its sender if its backward
    reads it (an MLP layer's Relu output, unless recomputed), and then the
    receiver's first layer frees its copy; a gradient goes from its sender."""
    nbytes = boundary_bytes(features, layers)  # [n, S]
    n, s = nbytes.shape
    cost = np.zeros((s, n, _F))
    cost[:, :, _VOLUME] = nbytes.T
    cost[:, :, _HOPS] = 1.0
    alloc = np.zeros((s, 2 * n, 2))
    free = np.zeros_like(alloc)
    alloc[:, :, 1] = np.concatenate([nbytes, nbytes]).T
    free[:, n:, 0] = nbytes.T
    if not features.output_used_by_own_backward:
        free[:, :n, 0] = nbytes.T
    rows = (tables.cost.shape[1], tables.alloc.shape[1])
    return ChunkTables(
        np.concatenate([tables.cost, cost], axis=1),
        np.concatenate([tables.alloc, alloc], axis=1),
        np.concatenate([tables.free, free], axis=1),
        tables.resident,
        rows,
    )


def _message_rows(template: PipelineTemplate, cost_at: int, memory_at: int) -> tuple[np.ndarray, np.ndarray]:
    """The template's rows with each message on its boundary's rows (``ChunkTables.message_rows``)."""
    cost_row, memory_row = template.rows
    activation, gradient = template.kind == SEND_ACTIVATION, template.kind == SEND_GRADIENT
    boundary = template.chunk - gradient  # a gradient crosses its sender's input boundary
    n = template.num_chunks
    cost_row = np.where(activation | gradient, cost_at + boundary, cost_row)
    memory_row = np.where(
        activation, memory_at + boundary, np.where(gradient, memory_at + n + boundary, memory_row)
    )
    return cost_row, memory_row


def _chunk_segments(features: LayerFeatures, coef: np.ndarray):
    """Per chunk, its last backward's segments in order: ``(part, segment, input freed here, copy)``.

    Backward order: the head, the blocks (the chunk's first block last), the
    embedding; ``copy`` numbers a chunk's blocks in forward order. On a
    receiving chunk of an MLP the first part frees the received input (see
    ``output_used_by_own_backward``).
    """
    n = coef.shape[0]
    out = []
    for c in range(n):
        receives = c > 0 and features.output_used_by_own_backward
        count = int(coef[c, _BLOCK])
        parts = [(_HEAD, receives and count == 0, 0)] if coef[c, _HEAD] else []
        parts += [(_BLOCK, receives and b == 0, b) for b in range(count - 1, -1, -1)]
        parts += [(_EMBED, False, 0)] if coef[c, _EMBED] else []
        out.append(
            [
                (q, j, freed, copy)
                for q, freed, copy in parts
                for j in range(features.segments[q].num_segments)
            ]
        )
    return out


def _chunk_updates(features: LayerFeatures, coef: np.ndarray, chunks) -> list[list[tuple]]:
    """Per chunk, its weights in optimizer (forward) order: ``(part, update, position of the
    segment its gradient ends)``."""
    out = []
    for c, chunk in enumerate(chunks):
        position = {(q, j, copy): i for i, (q, j, _, copy) in enumerate(chunk)}
        parts = [(_EMBED, 0)] if coef[c, _EMBED] else []
        parts += [(_BLOCK, b) for b in range(int(coef[c, _BLOCK]))]
        parts += [(_HEAD, 0)] if coef[c, _HEAD] else []
        out.append(
            [
                (q, u, position[(q, j, copy)])
                for q, copy in parts
                for u, (j, _) in enumerate(features.segments[q].updates)
            ]
        )
    return out


def segment_plan(features: LayerFeatures, layers_per_chunk: Sequence[int], zero: bool) -> tuple:
    """``(segments, updates)`` of :func:`~distir_jax.transforms.coarse_pipeline.pipeline_template`
    for exact overlap: per chunk, whether each segment of its last backward ends
    with a weight gradient; and with ZeRO, per chunk, for each weight in
    optimizer order, the segment whose reduction its update waits for (else None)."""
    return _segment_plan(features, tuple(int(x) for x in layers_per_chunk), bool(zero))


@functools.lru_cache(maxsize=4096)
def _segment_plan(features: LayerFeatures, layers: tuple, zero: bool) -> tuple:
    chunks, updates = _chunk_plan(features, layers, zero)
    flags = tuple(
        tuple(features.segments[q].grads[j] is not None for q, j, _, _ in chunk) for chunk in chunks
    )
    if not zero:
        return flags, None
    return flags, tuple(tuple(pos for _, _, pos in c) for c in updates)


@functools.lru_cache(maxsize=4096)
def _chunk_plan(features: LayerFeatures, layers: tuple, zero: bool) -> tuple:
    """:func:`_chunk_segments` and (with ZeRO, else ``[]``) :func:`_chunk_updates` of
    ``layers`` blocks per chunk: pure functions of the features and the cut, shared by
    every key that cuts the model alike (cached; read only)."""
    if features.per_layer:
        chunks = layer_chunk_segments(features, layers)
        return chunks, (layer_chunk_updates(features, layers, chunks) if zero else [])
    coef = part_coefficients(features, layers)
    chunks = _chunk_segments(features, coef)
    return chunks, (_chunk_updates(features, coef, chunks) if zero else [])


def _with_segments(
    tables: ChunkTables, features: LayerFeatures, layers: tuple, k: int, data: int, zero: bool
) -> ChunkTables:
    """``tables`` plus segment rows, one reduction row per segment (zero for tails), and with
    ZeRO an update row then an all-gather row per weight (see :func:`segment_plan`)."""
    later = int(k > 1)  # the last microbatch adds to running sums unless it is the only one
    seg_at, upd_at = _segment_rows(features, layers, zero)
    total, weights = len(seg_at), len(upd_at)
    s = tables.cost.shape[0]
    cost = np.zeros((s, 2 * total + 2 * weights, _F))
    alloc = np.zeros((s, 2 * total + 2 * weights, 2))
    free = np.zeros_like(alloc)
    # Chunks repeat the same block segments: every distinct one is filled once
    # (cached per features and degree), then gathered.
    u_cost, u_alloc, u_free, r_cost, r_alloc, r_free = _segment_values(features, later, int(data), zero)
    cost[:, :total], alloc[:, :total, 0], free[:, :total, 0] = (
        u_cost[:, seg_at],
        u_alloc[:, seg_at],
        u_free[:, seg_at],
    )
    cost[:, total : 2 * total] = r_cost[seg_at]
    alloc[:, total : 2 * total, 0], free[:, total : 2 * total, 0] = r_alloc[seg_at], r_free[seg_at]
    if weights:  # ZeRO: each replica updates its shard in place, then all-gathers the weight
        w_cost, w_free, g_cost = _update_values(features, int(data))
        row = 2 * total
        cost[:, row : row + weights], free[:, row : row + weights, 0] = w_cost[:, upd_at], w_free[upd_at]
        cost[:, row + weights :] = g_cost[upd_at]
    return ChunkTables(
        np.concatenate([tables.cost, cost], axis=1),
        np.concatenate([tables.alloc, alloc], axis=1),
        np.concatenate([tables.free, free], axis=1),
        tables.resident,
    )


def _segment_keys(features: LayerFeatures) -> dict:
    """Every ``(part, segment, input freed here)`` of the features, numbered."""
    segments = enumerate(features.segments)
    keys = [(q, j, freed) for q, seg in segments for j in range(seg.num_segments) for freed in (0, 1)]
    return {key: i for i, key in enumerate(keys)}


def _update_keys(features: LayerFeatures) -> dict:
    """Every ``(part, weight)`` of the features, numbered."""
    keys = [(q, w) for q, seg in enumerate(features.segments) for w in range(len(seg.updates))]
    return {key: i for i, key in enumerate(keys)}


@functools.lru_cache(maxsize=4096)
def _segment_rows(features: LayerFeatures, layers: tuple, zero: bool) -> tuple[np.ndarray, np.ndarray]:
    """Which of :func:`_segment_keys` each segment row is, and (with ZeRO) which of
    :func:`_update_keys` each weight row is, for ``layers`` blocks per chunk (cached; read only)."""
    chunks, updates = _chunk_plan(features, layers, zero)
    seg_index, upd_index = _segment_keys(features), _update_keys(features)
    seg_at = np.asarray(
        [seg_index[(q, j, int(freed))] for chunk in chunks for q, j, freed, _ in chunk], np.int64
    )
    upd_at = np.asarray([upd_index[(q, w)] for chunk in updates for q, w, _ in chunk], np.int64)
    seg_at.setflags(write=False)
    upd_at.setflags(write=False)
    return seg_at, upd_at


@functools.lru_cache(maxsize=1024)
def _segment_values(features: LayerFeatures, later: int, data: int, zero: bool) -> tuple:
    """Per :func:`_segment_keys` entry: its segment's cost ``[S, u, F]``, alloc and free
    ``[S, u]``, and its reduction's cost ``[u, F]``, alloc and free ``[u]`` (cached; read only)."""
    keys = _segment_keys(features)
    s, u = features.num_variants, len(keys)
    u_cost, u_alloc, u_free = np.zeros((s, u, _F)), np.zeros((s, u)), np.zeros((s, u))
    r_cost, r_alloc, r_free = np.zeros((u, _F)), np.zeros(u), np.zeros(u)
    for (q, j, freed), i in keys.items():
        seg = features.segments[q]
        u_cost[:, i] = seg.cost[j] + later * seg.accumulate[j][None, :]
        u_alloc[:, i] = seg.rise[later, freed, j]
        u_free[:, i] = seg.rise[later, freed, j] - seg.net[later, freed, j]
        grad = seg.grads[j]
        if grad is not None:
            r_cost[i] = _collective("ReduceScatter" if zero else "AllReduce", grad, data)
            if not zero:  # the all-reduce writes a new buffer, then the gradient goes
                # (ZeRO reduce-scatters in place: the gradient lives until its update)
                r_alloc[i] = r_free[i] = float(np.max(grad.num_bytes))
    out = (u_cost, u_alloc, u_free, r_cost, r_alloc, r_free)
    for x in out:
        x.setflags(write=False)
    return out


@functools.lru_cache(maxsize=1024)
def _update_values(features: LayerFeatures, data: int) -> tuple:
    """Per :func:`_update_keys` entry (ZeRO): its update's cost ``[S, u, F]`` and free
    ``[u]``, and its all-gather's cost ``[u, F]`` (it allocates nothing: the weight's
    shards are gathered in place) (cached; read only)."""
    keys = _update_keys(features)
    s, u = features.num_variants, len(keys)
    scaled = np.zeros(_F, bool)
    scaled[SHARD_SCALED] = True
    w_cost, w_free = np.zeros((s, u, _F)), np.zeros(u)
    g_cost = np.zeros((u, _F))
    for (q, w), i in keys.items():
        j, update = features.segments[q].updates[w]
        grad = features.segments[q].grads[j]
        rows = int(grad.shape[0])  # ZeRO pads rows the degree does not divide
        w_cost[:, i] = np.where(scaled, zero_shard(update, rows, data), update)
        w_free[i] = float(np.max(grad.num_bytes))  # the gradient, whose buffer holds its shard
        # The updated weight's shard, in the weight's dtype (the gradient's may be wider).
        shard = TensorType((-(-rows // data), *grad.shape[1:]), features.model.dtype, grad.device)
        g_cost[i] = _collective("AllGather", shard, data)
    out = (w_cost, w_free, g_cost)
    for x in out:
        x.setflags(write=False)
    return out


@functools.lru_cache(maxsize=4096)
def _collective(op_type: str, value, degree: int) -> np.ndarray:
    """``[F]`` features of a data-parallel collective on ``value`` over ``degree`` replicas (axis 0)."""
    from distir_jax.ir.registry import get_spec

    spec = get_spec(op_type)
    attrs = {"group": tuple(range(degree)), "axis": 0}
    if op_type == "ReduceScatter":  # padded as the data-parallel transform pads
        attrs.update(zero_scatter_attrs(value, degree))
    f = spec.features(attrs, (value,), spec.infer(attrs, (value,)))
    out = np.zeros(_F)
    out[_VOLUME], out[_HOPS] = float(np.max(f.comm_volume)), float(np.max(f.comm_hops))
    return out


@functools.lru_cache(maxsize=4096)  # by identity: cheaper to look up than hashing the gradients
def _reduction_peak(features: LayerFeatures, layers: tuple, p: int) -> np.ndarray:
    """``[p]`` bytes above the level after the backward pass while a stage's gradients are
    all-reduced (without ZeRO, which reduce-scatters in place: no rise).

    The data-parallel transform all-reduces the gradients one by one, each
    collective writing a new buffer as large as its gradient and then freeing
    the gradient: a stage rises by its largest gradient, whatever the degree.
    """
    if not features.per_layer:  # depends on the gradients only: shared by recompute policies and sizes
        return _part_reduction_peak(features.grad_order, features.ends_are_blocks, layers, p)
    grads = [layer_stage_grads(features, layers, stage, p) for stage in range(p)]
    extra = np.asarray([max(g, default=0.0) for g in grads], np.float64)
    extra.setflags(write=False)  # cached
    return extra


@functools.lru_cache(maxsize=4096)
def _part_reduction_peak(grad_order: tuple, ends_are_blocks: bool, layers: tuple, p: int) -> np.ndarray:
    """:func:`_reduction_peak` without ZeRO, by part: each stage's largest gradient."""
    n = len(layers)
    if n % p:
        raise ValueError(f"{n} chunks do not split evenly over {p} stages")
    coef = _block_coefficients(layers, ends_are_blocks)  # [n, 3]: the parts each chunk holds
    largest = np.asarray([max(grad_order[q], default=0.0) for q in range(3)], np.float64)
    stages = np.arange(n) % p
    extra = np.zeros(p)
    np.maximum.at(extra, stages, np.max(np.where(coef > 0, largest[None, :], 0.0), axis=1))
    extra.setflags(write=False)  # cached
    return extra


@functools.lru_cache(maxsize=4096)
def stage_devices(topology: Topology, pipeline: int, tensor: int, data: int):
    """Device and links of each stage's representative: ``(device [p], tp_link [p, 2], dp_link [p, 2])``."""
    p, t, d = pipeline, tensor, data
    if p * t * d > topology.num_devices:
        raise ValueError(
            f"pipeline x tensor x data = {p} x {t} x {d} needs {p * t * d} devices; "
            f"topology {topology.name!r} has {topology.num_devices}"
        )
    device = np.arange(p) * t
    tp = np.asarray([topology.bottleneck_link(list(range(s * t, s * t + t))) for s in range(p)], np.int32)
    dp = np.asarray([topology.bottleneck_link(group) for group in _data_parallel_groups(p, t, d)], np.int32)
    return device.astype(np.int32), tp.reshape(p, 2), dp.reshape(p, 2)


def _data_parallel_groups(pipeline: int, tensor: int, data: int) -> list[list[int]]:
    """Each stage's representative's data-parallel group (rank ``r`` of stage ``s``:
    device ``r p t + s t``, as the transforms lay replicas out)."""
    p, t, d = pipeline, tensor, data
    return [[r * p * t + s * t for r in range(d)] for s in range(p)]


@functools.lru_cache(maxsize=4096)
def data_parallel_channels(topology: Topology, pipeline: int, tensor: int, data: int) -> np.ndarray:
    """``[p]`` each stage's data-parallel group's :meth:`~distir_jax.ir.topology.Topology.ring_channels`
    (the groups of :func:`stage_devices`' ``dp_link``): what its collectives' bytes are divided by.
    Tensor-parallel collectives need none here: the features measure them on a
    group laid out as every stage's (``lower`` divides them already). Read only."""
    out = np.asarray([topology.ring_channels(g) for g in _data_parallel_groups(pipeline, tensor, data)])
    out.setflags(write=False)
    return out


def realize(
    template: PipelineTemplate,
    tables: ChunkTables,
    topology: Topology,
    tensor: int,
    data: int,
    num_streams: int | None = None,
    steady: SteadyTemplate | None = None,
) -> Program:
    """The Program of a template filled with ``tables``.

    Args:
      template: the structure (:func:`pipeline_template`).
      tables: the configuration's numbers (:func:`chunk_tables`).
      topology: the cluster; stage ``s`` runs on device ``s * tensor`` and
        collectives take their groups' slowest links.
      tensor, data: the tensor- and data-parallel degrees.
      num_streams: streams per device (at least the template's).
      steady: when ``template`` is this steady template's short one, its
        peak memory is the long program's (:func:`stage_peak_memory`).

    Returns:
      A Program whose features and memory carry ``S`` size variants.
    """
    p = template.pipeline
    streams = template.num_streams if num_streams is None else int(num_streams)
    if streams < template.num_streams:
        raise ValueError(f"num_streams={streams}, but mode {template.mode!r} uses stream 1")
    device, tp_link, dp_link = stage_devices(topology, p, int(tensor), int(data))
    cost_row, memory_row = template.rows
    if tables.message_rows is not None:
        cost_row, memory_row = _message_rows(template, *tables.message_rows)
    stage = template.stage
    used = stage >= 0
    slot_device = np.where(used, device[np.maximum(stage, 0)], NO_DEVICE).astype(np.int32)
    stream = np.stack([template.stream, np.zeros_like(template.stream)], axis=1)
    resource = np.where(used, slot_device * streams + stream, NO_RESOURCE).astype(np.int32)
    first = np.maximum(stage[:, 0], 0)
    link_kind = template.link_kind
    if tables.tensor_syncs and template.mode not in SYNC_MODES:  # the updates talk to the tensor group
        link_kind = np.where(template.kind == UPDATE, _TENSOR_LINK, link_kind)
    link = links_by_kind(link_kind, slot_device, tp_link[first], dp_link[first]).astype(np.int32)
    cost = tables.cost[:, cost_row]  # [S, N, F]
    channels = data_parallel_channels(topology, p, int(tensor), int(data))
    if np.any(channels != 1.0):  # rings side by side across nodes (Topology.ring_channels)
        cost[..., _VOLUME] /= np.where(link_kind == 3, channels[first], 1.0)
    alloc = tables.alloc[:, memory_row]  # [S, N, 2]
    free = tables.free[:, memory_row]
    num_devices = topology.num_devices
    resident = np.zeros((tables.resident.shape[0], num_devices))
    resident[:, device] = tables.resident
    peak = np.zeros_like(resident)
    peak[:, device] = stage_peak_memory(template, alloc, free, tables.resident, steady)
    is_comm = (link_kind >= 2) | ((link_kind == 1) & (tensor > 1))
    return Program(
        resource=resource,
        slot_device=slot_device,
        dep_slot=template.dep_slot,
        out_slot=template.out_slot,
        link=link,
        is_comm=is_comm,
        resource_device=np.repeat(np.arange(num_devices, dtype=np.int32), streams),
        num_ops=np.asarray(template.num_ops, np.int32),
        alloc_bytes=alloc,
        free_bytes=free,
        resident_bytes=resident,
        peak_bytes=peak,
        num_finish_slots=template.num_slots,
        **{name: cost[..., i] for i, name in enumerate(COST_FEATURES)},
    )


def links_by_kind(link_kind, slot_device, tp_link, dp_link, xp=np):
    """``[..., 2]`` the link each op is costed on, by its ``link_kind`` (``[...]``,
    :attr:`~distir_jax.transforms.coarse_pipeline.PipelineTemplate.link_kind`):
    its own device's, its stage's tensor-parallel group's (``tp_link``, ``[..., 2]``),
    a send's two devices (``slot_device``, ``[..., 2]``), or its stage's
    data-parallel group's (``dp_link``, ``[..., 2]``). ``xp``: numpy or jax.numpy."""
    kind = xp.asarray(link_kind)[..., None]
    own = xp.broadcast_to(slot_device[..., :1], slot_device.shape)
    return xp.where(kind == 1, tp_link, xp.where(kind == 2, slot_device, xp.where(kind == 3, dp_link, own)))


def stage_peak_memory(
    template: PipelineTemplate,
    alloc,
    free,
    resident,
    steady: SteadyTemplate | None = None,
    extra_periods=None,
) -> np.ndarray:
    """Peak bytes of each stage's device, ``[S, p]``: :func:`~distir_jax.lower.peak_memory`'s
    program-order rule, with the events sorted by stage once per template.

    ``alloc`` and ``free`` are ``[S, N, 2]`` bytes per op and resource slot. With
    ``steady`` (``template`` being its short one), the long program's: each copy
    of the period moves a stage's running bytes by the period's net, so the
    copies peak at the first one's rise plus ``max(0, r * net)`` and everything
    after them at its short rise plus ``r * net``. ``extra_periods`` (``[S]``)
    gives each row its own ``r`` instead of ``steady.extra_periods`` (rows of
    one short template standing for different long ones).
    """
    perm, _ = template.stage_events
    s = alloc.shape[0]
    free = np.asarray(free).reshape(s, -1)
    net, free = exact_integers((np.asarray(alloc).reshape(s, -1) - free)[:, perm], free[:, perm])
    return event_stage_peaks(template, net, free, resident, steady, extra_periods)


def exact_integers(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """``arrays`` as int64 when every number in them is a whole number below
    ``2**53`` (byte counts are), else as they are: :func:`event_stage_peaks`
    then gives the same floats (float64 sums of such numbers are exact) ~3x
    faster, as NumPy adds up int64 rows ~8x faster than float64 ones (whose
    running sums are a serial chain of float additions)."""
    limit = 2.0**53
    small = all(x.size == 0 or (x.max() < limit and x.min() > -limit) for x in arrays)  # cheaper than abs
    whole = [x.astype(np.int64) for x in arrays] if small else []
    return tuple(whole) if small and all(np.array_equal(w, x) for w, x in zip(whole, arrays)) else arrays


def event_stage_peaks(
    template: PipelineTemplate,
    net,
    free,
    resident,
    steady: SteadyTemplate | None = None,
    extra_periods=None,
    events=None,
):
    """:func:`stage_peak_memory` from each stage event's net bytes (allocated
    minus freed) and freed bytes, ``[S, E]`` float64 each, in
    ``template.stage_events`` order (event ``e`` is op slot ``perm[e]``): for
    callers that gather them from tables of their own in one pass. Both
    arrays are overwritten (they are the largest ones here: no copies); both
    may be int64 instead (:func:`exact_integers`), for the same peaks sooner.

    With ``events`` (event indices, ``[U]``), returns ``(peak, tops)``: also
    each of those events' top above its stage's starting level, ``[S, U]``
    (what it contributes to that stage's rise, the long program's where
    ``steady``), so a caller can raise those events' tops for rows that
    differ from these only there."""
    stages, starts, _ = template.stage_runs
    # Values at the few events read later, before the running sums overwrite them.
    first_delta = net[:, starts]
    if steady is not None:
        runs, run_stage, run_part, stage_runs, (first, last) = steady.stage_part_runs
        q0, q1 = np.maximum(first, 0), np.maximum(last, 0)
        q0_delta = net[:, q0]
    # Bytes after each event, counted from the first stage's start.
    level = np.cumsum(net, axis=1, out=net)
    # An event's top (its level before it, plus what it allocates) is ``level + free``;
    # each stage's rise is its largest top above the level its run starts from.
    base = level[:, starts] - first_delta  # [S, stages]
    top = np.add(level, free, out=free)
    if events is not None:
        events = np.asarray(events, np.intp)
        tops = top[:, events] - base[:, np.searchsorted(starts, events, side="right") - 1]
    if steady is None:
        rise = np.maximum.reduceat(top, starts, axis=1) - base
    else:
        # Tops per (stage, part) run, parts A, Q, Z in program order: each copy of the
        # period moves a stage's level by the period's net, so Q's copies top out at
        # the first one's plus ``max(0, r * net)`` and Z at its own plus ``r * net``.
        period_net = np.where(first >= 0, level[:, q1] - level[:, q0] + q0_delta, 0.0)  # [S, stages]
        run_top = np.maximum.reduceat(top, runs, axis=1) - base[:, run_stage]
        r = steady.extra_periods if extra_periods is None else np.reshape(extra_periods, (-1, 1))
        moved = (r * period_net)[:, run_stage]
        shift = np.where(run_part == 1, np.maximum(moved, 0.0), np.where(run_part == 2, moved, 0.0))
        run_top = run_top + shift  # float64 (not in place: the tops may be int64)
        rise = np.maximum.reduceat(run_top, stage_runs, axis=1)
        if events is not None:
            tops = tops + shift[:, np.searchsorted(runs, events, side="right") - 1]
    peak = np.array(resident, np.float64, copy=True)
    peak[:, stages] = np.maximum(peak[:, stages], resident[:, stages] + rise)
    return peak if events is None else (peak, tops)


def coarse_pipeline_program(
    features: LayerFeatures,
    topology: Topology,
    *,
    pipeline: int,
    microbatches: int,
    data: int = 1,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
    zero: bool = False,
    overlap: bool = False,
    layers_per_chunk: Sequence[int] | None = None,
    step_costs=None,
    num_streams: int | None = None,
    overlap_segments: bool = False,
) -> Program:
    """The coarse Program of one hybrid-parallel training step.

    Args:
      features: the model's part features (tensor degree, recompute policy,
        hardware); every one of its ``S`` microbatch sizes becomes a size
        variant of the result.
      topology: the cluster; at least ``data * tensor * pipeline`` devices.
      pipeline, microbatches, virtual_stages, schedule: the pipeline.
      data: data-parallel replicas; ``zero`` shards optimizer state,
        ``overlap`` reduces each chunk's gradients on stream 1.
      layers_per_chunk: blocks of each of the ``p * v`` chunks; default
        balanced like the pipeline transform.
      step_costs: ``None`` for the fast issue order, or ``[p * v, 2]``
        estimates for the transform's order (see :func:`pipeline_template`).
      num_streams: streams per device (at least the mode's).
      overlap_segments: with ``overlap``, cut each chunk's last backward after
        every weight gradient and reduce each gradient right after its
        segment, as the data-parallel transform does (with ZeRO, then update
        and all-gather weight by weight): the fine program's timeline.
        Otherwise one reduction per chunk follows its last backward (fewer
        ops, later reductions).

    Returns:
      A Program with features ``[S, N]`` (``N ~ 4 k v p``).
    """
    program, _, _ = _pipeline_program(
        features,
        topology,
        pipeline=pipeline,
        microbatches=microbatches,
        data=data,
        virtual_stages=virtual_stages,
        schedule=schedule,
        zero=zero,
        overlap=overlap,
        layers_per_chunk=layers_per_chunk,
        step_costs=step_costs,
        num_streams=num_streams,
        overlap_segments=overlap_segments,
    )
    return program


def templated_pipeline_program(features: LayerFeatures, topology: Topology, **kwargs) -> tuple:
    """:func:`coarse_pipeline_program` (same arguments), and the
    :class:`PipelineTemplate` it fills: ``(program, template)``, op ``i`` of
    the one being op ``i`` of the other (its kind, chunk, microbatch and
    stages name it, e.g. in a trace)."""
    program, _, template = _pipeline_program(features, topology, **kwargs)
    return program, template


def steady_pipeline_program(
    features: LayerFeatures,
    topology: Topology,
    *,
    steady: bool = True,
    short_microbatches: tuple[int, ...] | None = None,
    **kwargs,
) -> tuple[Program, SteadyTemplate | None]:
    """:func:`coarse_pipeline_program`, as a short steady program where one stands for it.

    With ``steady``, a long 1F1B / interleaved pipeline becomes the short
    program of :func:`~distir_jax.transforms.coarse_steady.steady_template`
    (whose period stands for the rest) where that saves work
    (:func:`~distir_jax.transforms.coarse_steady.worth_it`), with the long
    program's tables: resident tokens of all ``microbatches`` and the long
    program's peak memory. Its step time is the long one's only once a run certifies the
    period (:func:`~distir_jax.transforms.coarse_steady.extrapolate`).

    Args:
      features, topology, kwargs: as :func:`coarse_pipeline_program` takes them.
      steady: allow the short program.
      short_microbatches: passed to :func:`~distir_jax.transforms.coarse_steady.steady_template`
        (then the short program is used wherever it applies).

    Returns:
      ``(program, steady_template)``: the short program and its
      SteadyTemplate, or the long program and None.
    """
    program, short, _ = _pipeline_program(
        features, topology, steady=steady, short_microbatches=short_microbatches, **kwargs
    )
    return program, short


def _pipeline_program(
    features,
    topology,
    *,
    pipeline,
    microbatches,
    data=1,
    virtual_stages=1,
    schedule="1f1b",
    zero=False,
    overlap=False,
    layers_per_chunk=None,
    step_costs=None,
    num_streams=None,
    overlap_segments=False,
    steady=False,
    short_microbatches=None,
):
    p, v = int(pipeline), int(virtual_stages)
    n = p * v
    if layers_per_chunk is None:
        layers_per_chunk = balanced_layers(features, n)
    layers = np.asarray(layers_per_chunk, np.int64)
    if layers.shape != (n,) or layers.min() < 1 or layers.sum() != features.num_blocks:
        raise ValueError(
            f"layers_per_chunk must give each of the {n} chunks >= 1 of the model's "
            f"{features.num_blocks} blocks, got {list(layers)}"
        )
    mode = data_mode(int(data), bool(overlap), bool(zero), features.sequence_parallel)
    segments = overlap_segments and mode.startswith("overlap")
    flags, updates = segment_plan(features, layers, mode == "overlap_zero") if segments else (None, None)
    structure = (p, int(microbatches), v, schedule, mode, step_costs, flags, updates)
    short = None
    if steady and (short_microbatches is not None or worth_it(p, int(microbatches), v, schedule, mode)):
        short = steady_template(*structure, short_microbatches=short_microbatches)
    template = pipeline_template(*structure) if short is None else short.template
    tables = chunk_tables(
        features, layers, p, int(microbatches), data=int(data), zero=bool(zero), mode=mode, segments=segments
    )
    program = realize(template, tables, topology, features.tensor, int(data), num_streams, short)
    return program, short, template
