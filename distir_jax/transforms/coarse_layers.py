"""Pipeline chunks as sequences of single-layer parts (MLPs whose cut splits a layer pair).

Under tensor parallelism an MLP's blocks are (column, row) layer pairs; when
the pipeline transform's stage boundaries fall inside a pair, a chunk may
start with a row layer or end with a column layer. Such keys use features
measured per layer (``LayerFeatures.per_layer``: six parts, the measured
three pairs' layers) and describe each chunk by its layers' parts in forward
order (:func:`chunk_parts`). Everything the three-part code derives from
``[n, 3]`` part counts and runs of identical blocks is derived here by
folding over these short sequences (an MLP has a handful of layers per chunk):

* costs: part counts (coarse costs are linear in the parts);
* memory: each chunk's forward chains its layers' measured events in order,
  its backward in reverse, the first layer of a receiving chunk in the
  variant that frees the received input after its last read;
* gradient overlap: a chunk's last backward cut into its layers' segments,
  weights in forward order; gradients of a stage in the order they are made;
* messages: the bytes of the chunk's last layer's output (a column layer's is
  a ``1 / t`` feature shard), per boundary.
"""

from __future__ import annotations

import functools

import numpy as np

from distir_jax.transforms.coarse_features import LayerFeatures, layer_parts

__all__ = [
    "boundary_bytes",
    "chunk_parts",
    "layer_chunk_segments",
    "layer_chunk_updates",
    "layer_pass_memory",
    "layer_stage_grads",
    "part_counts",
]


@functools.lru_cache(maxsize=4096)
def chunk_parts(features: LayerFeatures, layers: tuple) -> tuple[tuple[int, ...], ...]:
    """Per chunk, the parts of its layers in forward order (``layers``: layers per chunk)."""
    parts = layer_parts(features.model.num_layers)
    starts = np.concatenate([[0], np.cumsum(layers)]).tolist()
    return tuple(parts[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True))


def part_counts(features: LayerFeatures, layers: tuple) -> np.ndarray:
    """``[n, P]``: how many layers of each part chunk ``c`` holds."""
    chunks = chunk_parts(features, layers)
    coef = np.zeros((len(chunks), features.step.shape[0]))
    for c, seq in enumerate(chunks):
        np.add.at(coef[c], list(seq), 1.0)
    return coef


def _receives(features: LayerFeatures, c: int) -> bool:
    """Whether chunk ``c``'s first layer frees a received input (the sender keeps its own copy)."""
    return c > 0 and features.output_used_by_own_backward


def layer_pass_memory(features: LayerFeatures, layers: tuple) -> tuple:
    """``(forward, [first backward, later backward])``, each ``(rise, net)`` ``[n, S]``."""
    chunks = chunk_parts(features, layers)
    n, s = len(chunks), features.num_variants

    def fold(passes):  # (rise, net) [S] each, one after the other
        rise, net = np.zeros(s), np.zeros(s)
        for r, m in passes:
            rise, net = np.maximum(rise, net + r), net + m
        return rise, net

    def table(per_chunk):
        out = [fold(per_chunk(c, seq)) for c, seq in enumerate(chunks)]
        return np.stack([r for r, _ in out]).reshape(n, s), np.stack([m for _, m in out]).reshape(n, s)

    rise_f, net_f = features.peak_rise[:, 0], features.net_bytes[:, 0]
    fwd = table(lambda c, seq: [(rise_f[q], net_f[q]) for q in seq])
    bwd = []
    for later in (0, 1):
        r, m = features.backward_rise[:, later], features.backward_net[:, later]  # [P, freed, S]

        def backward(c, seq, r=r, m=m):  # last layer first; a receiving chunk's first frees its input
            freed = [int(_receives(features, c) and i == 0) for i in range(len(seq))]
            return [(r[q, f], m[q, f]) for q, f in reversed(list(zip(seq, freed, strict=True)))]

        bwd.append(table(backward))
    return fwd, bwd


def layer_chunk_segments(features: LayerFeatures, layers: tuple) -> list[list[tuple]]:
    """Per chunk, its last backward's segments: ``(part, segment, input freed here, position)``,
    layers in backward order (``position``: the layer's place in the chunk, forward order)."""
    out = []
    for c, seq in enumerate(chunk_parts(features, layers)):
        receives = _receives(features, c)
        out.append(
            [
                (q, j, receives and i == 0, i)
                for i, q in reversed(list(enumerate(seq)))
                for j in range(features.segments[q].num_segments)
            ]
        )
    return out


def layer_chunk_updates(features: LayerFeatures, layers: tuple, chunks) -> list[list[tuple]]:
    """Per chunk, its weights in optimizer (forward) order: ``(part, update, position of the
    segment its gradient ends)`` (``chunks``: :func:`layer_chunk_segments`)."""
    out = []
    for seq, chunk in zip(chunk_parts(features, layers), chunks, strict=True):
        position = {(q, j, i): k for k, (q, j, _, i) in enumerate(chunk)}
        out.append(
            [
                (q, u, position[(q, j, i)])
                for i, q in enumerate(seq)
                for u, (j, _) in enumerate(features.segments[q].updates)
            ]
        )
    return out


def layer_stage_grads(features: LayerFeatures, layers: tuple, stage: int, p: int, rows: bool = False) -> list:
    """A stage's gradient bytes (``rows``: their rows) in the order its backward
    passes make them (later chunks first)."""
    chunks = chunk_parts(features, layers)
    n, order = len(chunks), features.grad_rows if rows else features.grad_order
    grads: list = []
    for c in range(n - 1 - (n - 1 - stage) % p, -1, -p):
        for q in chunks[c][::-1]:
            grads += list(order[q])
    return grads


def boundary_bytes(features: LayerFeatures, layers: tuple) -> np.ndarray:
    """``[n, S]``: bytes of the message after chunk ``c``'s last layer (its output or its
    gradient); the last chunk's row is zero."""
    chunks = chunk_parts(features, layers)
    out = np.stack([features.output_bytes[seq[-1]] for seq in chunks])
    out[-1] = 0.0
    return out
