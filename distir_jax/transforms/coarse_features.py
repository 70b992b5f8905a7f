"""Per-layer features for coarse pipeline programs, measured on one fine block.

A GPT's blocks are identical, so one block's training step, built by the real
model builder and transforms (tensor parallel with ``representative_only``,
then recomputation) and lowered once with the microbatch size as a vector of
size variants, gives the costs and memory events of every block of every
coarse pipeline program with that tensor degree, policy and hardware.
:func:`layer_features` builds a one-block model (layer 0: embedding; layer 1:
the block; layer 2: final LayerNorm, head and loss), fuses its ops by
``(layer, direction)`` with :func:`~distir_jax.transforms.coarse_fuse.coarsen`
and keeps, per part and direction (``F``: forward; ``B``: recomputation and
backward):

* the fused cost features (roofline split into linear terms on the
  topology's first device, see :mod:`coarse_fuse`: exact on that hardware,
  the fused-kernel approximation on hardware of other speeds); tensor-parallel
  collectives are part of them, as communication on the TP group's link;
* the memory events: the peak rise above the live bytes at the part's start
  and the net bytes it leaves allocated. Chained, these reproduce what the
  forward keeps for the backward (only the block input under ``"full"``
  recomputation, no attention scores under ``"attention"``, ...) and what the
  backward frees, without any formula for activation sizes;
* the raw roofline flops (to balance stages and estimate step times).

Per part also: the weight, gradient and Adam-state bytes of the
representative rank, the fused optimizer update, and (for any data-parallel
degree) the gradient all-reduce or ZeRO reduce-scatter / all-gather features,
from the communication ops' own registry entries. ZeRO pads a weight whose
rows the degree does not divide to the next multiple, as the fine
data-parallel transform does (:meth:`LayerFeatures.zero_shards`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from distir_jax.cost import COST_FEATURES
from distir_jax.ir.registry import get_spec
from distir_jax.ir.topology import Topology
from distir_jax.ir.types import DTYPE_BYTES, TensorType
from distir_jax.lower import lower
from distir_jax.models.config import MLPConfig, TransformerConfig
from distir_jax.models.mlp import mlp_training_step
from distir_jax.models.transformer import transformer_training_step
from distir_jax.transforms.coarse_fuse import fuse_groups
from distir_jax.transforms.coarse_segments import backward_ops, linear_features
from distir_jax.transforms.data_parallel import (
    OPTIMIZER_GRADIENT,
    gradient_to_reduce,
    zero_scatter_attrs,
    zero_shard,
)

__all__ = ["DIRECTIONS", "PARTS", "SHARD_SCALED", "LayerFeatures", "layer_features", "layer_parts"]

PARTS = ("embed", "block", "head")
DIRECTIONS = ("F", "B")
_FEATURE_INDEX = {name: i for i, name in enumerate(COST_FEATURES)}
# Cost features of an update (or of a gradient's sync before it) that grow with
# its rows, so a ZeRO shard divides them; launches and hops stay.
SHARD_SCALED = [
    _FEATURE_INDEX[name] for name in ("flops", "mem_bytes", "linear_flops", "linear_bytes", "comm_volume")
]


@dataclasses.dataclass(frozen=True, eq=False)
class LayerFeatures:
    """Features of a GPT's parts on one microbatch, for ``S`` microbatch sizes.

    Parts are ``PARTS`` (embedding, one block, head + loss); directions are
    ``DIRECTIONS``. ``F = len(COST_FEATURES)``.

    Attributes:
      model: the model (all its blocks share these features).
      tensor: tensor-parallel degree ``t`` (features are rank 0's).
      recompute: the recomputation policy.
      microbatch_sizes: ``[S]`` samples per microbatch.
      step: ``[3, 2, S, F]`` fused cost features of a part's pass.
      step_flops: ``[3, 2, S]`` raw flops of the pass (for balancing stages).
      peak_rise: ``[3, 2, S]`` bytes above the start's live bytes at the
        pass's peak.
      net_bytes: ``[3, 2, S]`` bytes the pass leaves allocated (negative when
        it frees more than it allocates).
      message_bytes: ``[S]`` one block output (or its gradient): a pipeline message.
      data_bytes: ``[S]`` one microbatch's token ids (its labels are as large).
      param_bytes: ``[3]`` weight bytes of each part (gradients are as large).
      state_bytes: ``[3]`` optimizer state bytes of each part.
      copy_bytes: ``[3]`` bytes of each part's resident FP8 weight copies
        (training precision "mixed-fp8": each weight its FP8 GEMMs read, and its
        transpose, in f8; ZeRO does not shard them), or None for none.
      optimizer: ``[3, F]`` fused optimizer update of each part's weights (with
        their ``tensor_syncs``).
      accumulate: ``[3, F]`` adding one microbatch's weight gradients of a part
        to the running sums (an ``Add`` per weight, in later microbatches' backwards).
      grad_types: per part, the types of its weight gradients.
      weights: per part, ``(name, type)`` of its weights in optimizer order
        (the names of the model's first block, embedding and head).
      weight_bytes: per part, ``(rows, weight bytes, optimizer state bytes)``
        of each weight, in optimizer order (ZeRO shards pad the rows).
      op_layers, op_flops: the measured model's ops (all but optimizer updates):
        their layers, and their flops ``[S, ops]``, for
        :meth:`layer_costs`.
      backward_rise, backward_net: ``[3, 2, 2, S]`` a part's backward memory by
        ``[part, later microbatch, input freed here]``: a later microbatch adds
        each weight gradient to the running sum right after computing it (in
        place; then the gradient goes);
        see ``output_used_by_own_backward`` for the input.
      segments: per part, its backward cut after each weight gradient
        (:class:`~distir_jax.transforms.coarse_segments.PartSegments`), for
        exact gradient overlap.
      layers_per_block: model layers in one block (GPT: 1; MLP: 1, or a column
        and a row layer under tensor parallelism, which must stay together).
      ends_are_blocks: the embedding and head parts are the model's first and
        last blocks rather than extra parts (MLP: the first layer's input needs
        no gradient; the last one's output gradient comes from the loss).
      output_used_by_own_backward: a block's backward reads the block's output
        (an MLP layer's Relu gradient reads the Relu output, unless ``"full"``
        recomputation recomputes it), so a pipeline chunk keeps the output it
        sent until its backward.
      per_layer: parts are single layers rather than blocks (an MLP under
        tensor parallelism whose pipeline cut splits a column / row pair):
        ``P = 6`` parts, the measured three pairs' layers in order (first
        column, first row, middle column, middle row, last column, last row
        with the loss); :func:`layer_parts` maps a model's layers onto them.
        Arrays with a leading ``3`` above then have ``6``.
      output_bytes: ``[P, S]`` with ``per_layer``: bytes a part's output
        crosses a pipeline boundary with (a column layer's Relu output is a
        ``1 / t`` feature shard), else None.
      sequence_parallel: measured under Megatron sequence parallelism.
      tensor_syncs: per part, ``(rows, [F] linear cost)`` of each in-place
        tensor-group all-reduce of a weight gradient before its update (under
        sequence parallelism a LayerNorm's, partial over sequence parts), in
        optimizer order; ``optimizer`` and ``segments``' per-weight updates include them.
    """

    model: TransformerConfig | MLPConfig
    tensor: int
    recompute: str
    microbatch_sizes: np.ndarray
    step: np.ndarray
    step_flops: np.ndarray
    peak_rise: np.ndarray
    net_bytes: np.ndarray
    message_bytes: np.ndarray
    data_bytes: np.ndarray
    param_bytes: np.ndarray
    state_bytes: np.ndarray
    optimizer: np.ndarray
    accumulate: np.ndarray
    grad_types: tuple
    weights: tuple
    weight_bytes: tuple
    backward_rise: np.ndarray
    backward_net: np.ndarray
    segments: tuple = ()
    op_layers: tuple = ()
    op_flops: np.ndarray | None = None
    layers_per_block: int = 1
    ends_are_blocks: bool = False
    output_used_by_own_backward: bool = False
    per_layer: bool = False
    output_bytes: np.ndarray | None = None
    sequence_parallel: bool = False
    tensor_syncs: tuple = ()
    copy_bytes: np.ndarray | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks to cut into pipeline chunks (with the embedding and head if ``ends_are_blocks``)."""
        return self.model.num_layers // self.layers_per_block

    def layer_costs(self, variants: tuple[int, ...] | None = None) -> tuple[float, ...]:
        """Forward + backward flops of the measured model's layers ``0..M+1``, as
        the pipeline transform sums them to cut stages: each op's mean over the
        size variants it is built with (``variants``; default all), in program order."""
        variants = tuple(range(self.num_variants)) if variants is None else tuple(variants)
        return _layer_costs(self, variants)

    @functools.cached_property
    def grad_order(self) -> tuple:
        """Per part, its weight gradients' bytes in the order its backward produces
        them (the order a data-parallel transform reduces them in)."""
        return tuple(
            tuple(float(np.max(g.num_bytes)) for g in seg.grads if g is not None) for seg in self.segments
        )

    @functools.cached_property
    def grad_rows(self) -> tuple:
        """Per part, the rows of :attr:`grad_order`'s gradients (ZeRO pads them)."""
        return tuple(
            tuple(int(np.max(g.shape[0])) if g.rank else 1 for g in seg.grads if g is not None)
            for seg in self.segments
        )

    @property
    def num_variants(self) -> int:
        return int(self.microbatch_sizes.shape[0])

    def take_variants(self, variants: Sequence[int]) -> LayerFeatures:
        """These features for some of the size variants only, in the order given.

        A sweep measures a block once for every microbatch size it needs; each
        program needs only its own, and its arrays scale with their number.
        Cached: the keys of a sweep that need the same sizes share one object,
        and so the caches keyed by features (chunk costs, data-parallel
        collectives, reduction peaks) serve all of them."""
        return _take_variants(self, tuple(int(x) for x in variants))

    def _subset(self, variants: tuple[int, ...]) -> LayerFeatures:
        v = list(variants)
        return dataclasses.replace(
            self,
            microbatch_sizes=self.microbatch_sizes[v],
            step=self.step[:, :, v],
            step_flops=self.step_flops[:, :, v],
            peak_rise=self.peak_rise[:, :, v],
            net_bytes=self.net_bytes[:, :, v],
            message_bytes=self.message_bytes[v],
            data_bytes=self.data_bytes[v],
            backward_rise=self.backward_rise[..., v],
            backward_net=self.backward_net[..., v],
            segments=tuple(seg.take_variants(v) for seg in self.segments),
            op_flops=None if self.op_flops is None else self.op_flops[v],
            output_bytes=None if self.output_bytes is None else self.output_bytes[:, v],
        )

    def zero_shards(self, degree: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``[P]`` each part's optimizer state bytes in one ZeRO shard over ``degree``
        replicas, and its update's share of the whole update's cost (the weight
        shards' bytes over the weights': an update's flops and bytes grow with its
        rows, alike for every weight of a part), when some weight's rows must be
        padded (:func:`~distir_jax.transforms.data_parallel.zero_shard`); else None
        (every share is ``1 / degree``)."""
        return _zero_shards(self, int(degree))

    def data_parallel(self, degree: int, zero: bool) -> tuple[np.ndarray, np.ndarray]:
        """Gradient communication of each part over ``degree`` replicas (ring collectives).

        Returns:
          ``(reduce, gather)``, each ``[3, F]`` (``[P, F]``): an ``AllReduce`` per gradient
          (``zero=False``; ``gather`` is zero), or a ``ReduceScatter`` of each
          gradient and an ``AllGather`` of each updated weight shard.
        """
        return _data_parallel(self, int(degree), bool(zero))

    def sync_parts(self, shard: int) -> np.ndarray:
        """``[P, F]`` each part's tensor syncs (:attr:`tensor_syncs`) added up, on
        ZeRO shards over ``shard`` replicas (1: whole gradients); cached, read only."""
        return _sync_parts(self, int(shard))


@functools.lru_cache(maxsize=4096)
def _take_variants(features: LayerFeatures, variants: tuple[int, ...]) -> LayerFeatures:
    return features._subset(variants)


@functools.lru_cache(maxsize=4096)
def _layer_costs(features: LayerFeatures, variants: tuple[int, ...]) -> tuple[float, ...]:
    costs = [0.0] * (1 + max(features.op_layers))
    means = features.op_flops[list(variants)].mean(axis=0)
    for layer, flops in zip(features.op_layers, means.tolist(), strict=True):
        costs[layer] += flops
    return tuple(costs)


def layer_features(
    model: TransformerConfig | MLPConfig,
    tensor: int,
    recompute: str,
    microbatch_sizes,
    topology: Topology,
    *,
    optimizer: str = "adam",
    per_layer: bool = False,
    sequence_parallel: bool = False,
) -> LayerFeatures:
    """Features of ``model``'s parts under tensor degree ``tensor`` and a recompute policy.

    Cached by ``(model, tensor, recompute, microbatch sizes, topology,
    optimizer, per_layer, sequence_parallel)``; the model carries its dtype and
    the topology its hardware.

    Args:
      model: a GPT or an MLP configuration (its ``num_layers`` is ignored: a
        GPT of one block is measured; an MLP of three blocks: the first and the
        last differ from the others, see ``LayerFeatures.ends_are_blocks``).
      tensor: tensor-parallel degree; must divide the heads and widths.
      recompute: ``"none"``, ``"attention"`` or ``"full"``.
      microbatch_sizes: an int or 1-D ints, the size variants ``S``.
      topology: at least ``tensor`` devices; its device 0 decides which ops
        are compute-bound, and its links are not used (coarse programs cost
        each collective on its own group's link).
      optimizer: ``"adam"`` or ``"sgd"``.
      per_layer: an MLP under tensor parallelism measured per layer rather
        than per (column, row) pair (see ``LayerFeatures.per_layer``), for
        pipeline cuts that split a pair.
      sequence_parallel: a GPT under Megatron sequence parallelism
        (``tensor > 1``): its blocks' messages are ``1 / tensor`` of the
        sequence, and each update includes the tensor group's in-place
        all-reduce of a LayerNorm gradient (see :mod:`~distir_jax.transforms.tensor_parallel`).

    Returns:
      A :class:`LayerFeatures`.
    """
    sizes = tuple(int(b) for b in np.atleast_1d(np.asarray(microbatch_sizes)))
    if not sizes or min(sizes) < 1:
        raise ValueError(f"microbatch_sizes must be ints >= 1, got {microbatch_sizes!r}")
    per_layer = bool(per_layer)
    if per_layer and not (isinstance(model, MLPConfig) and tensor > 1):
        raise ValueError(
            f"per_layer applies to MLPs under tensor parallelism, got {model!r}, tensor={tensor}"
        )
    sequence_parallel = bool(sequence_parallel)
    if sequence_parallel and not (isinstance(model, TransformerConfig) and tensor > 1):
        raise ValueError(
            f"sequence_parallel applies to GPTs under tensor parallelism, got {model!r}, tensor={tensor}"
        )
    return _layer_features(
        model, int(tensor), recompute, sizes, topology, optimizer, per_layer, sequence_parallel
    )


def layer_parts(num_layers: int) -> tuple[int, ...]:
    """The ``per_layer`` part of each layer of an MLP of ``num_layers`` (even) layers
    under tensor parallelism: the first pair's, the last pair's, middle column / row."""
    parts = [2 + i % 2 for i in range(num_layers)]
    parts[-2:] = [4, 5]
    parts[0] = 0
    if num_layers > 2:
        parts[1] = 1
    return tuple(parts)


@functools.lru_cache(maxsize=64)
def _parallel_step(model, tensor: int, sizes: tuple, optimizer: str, sequence_parallel: bool = False):
    """The measured model's training step under tensor parallelism (shared by the
    recompute policies, which are applied after it), how many layers make a
    block, and the bytes of a message and of a microbatch's data per sample."""
    from distir_jax.transforms.tensor_parallel import tensor_parallel

    batch = np.asarray(sizes, np.int64) if len(sizes) > 1 else sizes[0]
    if isinstance(model, MLPConfig):
        # Tensor parallelism pairs a column-split layer with a row-split one.
        per_block = 1 if tensor == 1 else 2
        if model.num_layers % per_block:
            raise ValueError(
                f"tensor parallelism keeps MLP layers in (column, row) pairs; "
                f"{model.num_layers} layers do not pair up"
            )
        three = dataclasses.replace(model, num_layers=3 * per_block)
        fn = mlp_training_step(three, batch, optimizer=optimizer)
        per_sample = model.hidden * DTYPE_BYTES[model.dtype]
        message, data = per_sample, per_sample  # activations; inputs x and targets [b, hidden]
    else:
        per_block = 1
        fn = transformer_training_step(dataclasses.replace(model, num_layers=1), batch, optimizer=optimizer)
        message = model.seq_len * model.hidden * DTYPE_BYTES[model.dtype]
        if sequence_parallel:  # a block's output holds 1 / t of the sequence
            message /= tensor
        data = model.seq_len * DTYPE_BYTES["i32"]  # token ids (labels are as large)
    if tensor > 1:
        fn = tensor_parallel(
            fn, tensor, sequence_parallel=sequence_parallel, representative_only=True
        ).function
    return fn, per_block, message, data


@functools.lru_cache(maxsize=256)
def _layer_features(
    model, tensor, policy, sizes, topology, optimizer, per_layer=False, sequence_parallel=False
) -> LayerFeatures:
    from distir_jax.transforms.recompute import recompute as recompute_transform

    fn, per_block, message, data = _parallel_step(model, tensor, sizes, optimizer, sequence_parallel)
    if isinstance(model, MLPConfig):

        def part_of(layer):  # blocks: the first (embedding part), a middle one, the last with the loss
            if per_layer:  # layers 1..6, the loss with the last
                return min(layer - 1, 3 * per_block - 1)
            return min((layer - 1) // per_block, 2)

    else:

        def part_of(layer):  # layer 0: embedding, 1: the block, 2: final LayerNorm, head and loss
            return layer

    num_parts = 6 if per_layer else 3
    fn = recompute_transform(fn, policy).function
    s = len(sizes)

    def label(op):
        phase, part = op.attr("phase"), part_of(op.attr("layer"))
        if phase == "opt":  # updates, with any tensor group's gradient syncs (fused together)
            return ("opt", part)
        return (part, "B" if phase == "bwd" or op.attr("recompute", False) else "F")

    labels = [label(op) for op in fn.ops]
    fine = lower(fn, topology)
    coarse, member_group = fuse_groups(fine, labels, topology)
    index = {labels[i]: int(member_group[i]) for i in range(len(labels))}

    def per_variant(x):  # [G] or [S, G] -> [S, G]
        x = np.asarray(x, np.float64)
        return np.broadcast_to(x, (s,) + x.shape[-1:]) if x.ndim == 1 else x

    feats = np.stack([per_variant(getattr(coarse, name)) for name in COST_FEATURES], axis=-1)  # [S, G, F]
    alloc = per_variant(np.asarray(coarse.alloc_bytes)[..., 0])
    freed = per_variant(np.asarray(coarse.free_bytes)[..., 0])
    raw_flops = per_variant(fine.flops)
    step = np.zeros((num_parts, 2, s, len(COST_FEATURES)))
    step_flops = np.zeros((num_parts, 2, s))
    rise = np.zeros((num_parts, 2, s))
    net = np.zeros((num_parts, 2, s))
    for part in range(num_parts):
        for d, direction in enumerate(DIRECTIONS):
            g = index.get((part, direction))
            if g is None:
                continue
            step[part, d] = feats[:, g]
            rise[part, d] = alloc[:, g]
            net[part, d] = alloc[:, g] - freed[:, g]
            mask = np.asarray([lab == (part, direction) for lab in labels])
            step_flops[part, d] = raw_flops[:, mask].sum(axis=1)
    bops = backward_ops(fn, fine, labels, s, num_parts)
    replays = [bops.replay(q, cuts=False) for q in range(num_parts)]
    backward_rise = np.stack([r for r, _ in replays])  # [P, 2, 2, S]
    backward_net = np.stack([n for _, n in replays])
    linear = linear_features(fine, topology, s)
    updates: list[list] = [[] for _ in range(num_parts)]
    weights: list[list] = [[] for _ in range(num_parts)]
    producer = fn.producers()
    # A tensor group's sync of a gradient (sequence parallelism's LayerNorms,
    # in place) runs right before its update: a per-weight update includes it.
    syncs = {
        op.outputs[0].name: linear[0, i]
        for i, (op, (kind, _)) in enumerate(zip(fn.ops, labels, strict=True))
        if kind == "opt" and op.op_type == "AllReduce"
    }
    tensor_syncs: list[list] = [[] for _ in range(num_parts)]
    for i, (op, (kind, part)) in enumerate(zip(fn.ops, labels, strict=True)):
        if kind == "opt" and op.op_type in OPTIMIZER_GRADIENT:
            grad = op.inputs[OPTIMIZER_GRADIENT[op.op_type]]
            cost = linear[0, i]
            if grad.name in syncs:
                tensor_syncs[part].append((_rows(grad.type), syncs[grad.name]))
                cost = cost + syncs[grad.name]
            updates[part].append((gradient_to_reduce(fn, producer, grad).name, cost))
            weights[part].append((op.inputs[0].name, op.inputs[0].type))
    segments = tuple(bops.segments(q, linear, topology, updates[q]) for q in range(num_parts))
    # Per-op flops and layers, for the pipeline transform's per-layer costs.
    costed = [i for i, op in enumerate(fn.ops) if op.attr("phase") != "opt"]
    op_flops = per_variant(fine.flops)[:, costed]
    op_flops.setflags(write=False)
    op_layers = tuple(fn.ops[i].attr("layer") for i in costed)
    optimizer_features = np.zeros((num_parts, len(COST_FEATURES)))
    params = np.zeros(num_parts)
    state = np.zeros(num_parts)
    grads: list[list] = [[] for _ in range(num_parts)]
    weight_bytes: list[list] = [[] for _ in range(num_parts)]
    copies = np.zeros(num_parts)
    for op in fn.ops:
        if op.attr("phase") == "opt" and op.op_type == "CastInto":  # a resident FP8 copy's refresh
            copies[part_of(op.attr("layer"))] += float(op.inputs[0].type.num_bytes)
        if op.attr("phase") != "opt" or op.op_type not in OPTIMIZER_GRADIENT:
            continue
        part = part_of(op.attr("layer"))
        nbytes = float(op.inputs[0].type.num_bytes)
        state_bytes = sum(float(v.type.num_bytes) for v in op.inputs[2:])
        params[part] += nbytes
        state[part] += state_bytes
        grads[part].append(op.inputs[1].type)
        weight_bytes[part].append((_rows(op.inputs[0].type), nbytes, state_bytes))
    for part in range(num_parts):
        if ("opt", part) in index:  # parts without weights (an MLP's loss) have no update
            optimizer_features[part] = feats[0, index[("opt", part)]]
        if per_layer:  # a layer's lone update would keep its roofline: linear terms add up across layers
            mask = np.asarray([lab == ("opt", part) for lab in labels])
            optimizer_features[part] = linear[0, mask].sum(axis=0)
    accumulate = np.stack([seg.accumulate.sum(axis=0) for seg in segments])  # an Add per weight gradient
    b = np.asarray(sizes, np.float64)
    output_bytes = None
    if per_layer:  # a column layer's Relu output is a feature shard (a row layer follows)
        shard = np.asarray([1.0 / tensor if q % 2 == 0 else 1.0 for q in range(num_parts)])
        output_bytes = shard[:, None] * (b * message)[None, :]
    return LayerFeatures(
        model=model,
        tensor=tensor,
        recompute=policy,
        microbatch_sizes=np.asarray(sizes, np.int64),
        step=step,
        step_flops=step_flops,
        peak_rise=rise,
        net_bytes=net,
        message_bytes=b * message,
        data_bytes=b * data,
        param_bytes=params,
        state_bytes=state,
        optimizer=optimizer_features,
        accumulate=accumulate,
        grad_types=tuple(tuple(g) for g in grads),
        weights=tuple(tuple(w) for w in weights),
        weight_bytes=tuple(tuple(w) for w in weight_bytes),
        backward_rise=backward_rise,
        backward_net=backward_net,
        segments=segments,
        op_layers=op_layers,
        op_flops=op_flops,
        layers_per_block=1 if per_layer else per_block,
        ends_are_blocks=isinstance(model, MLPConfig),
        # Full recomputation reads a recomputed copy: the original goes with its last send.
        output_used_by_own_backward=isinstance(model, MLPConfig) and policy != "full",
        per_layer=per_layer,
        output_bytes=output_bytes,
        sequence_parallel=sequence_parallel,
        tensor_syncs=tuple(tuple(t) for t in tensor_syncs),
        copy_bytes=copies if copies.any() else None,
    )


def _rows(value_type) -> int:
    """The rows a ZeRO shard splits (axis 0; a scalar is one row; size variants: the largest)."""
    return int(np.max(value_type.shape[0])) if value_type.rank else 1


@functools.lru_cache(maxsize=1024)  # by identity
def _sync_parts(features: LayerFeatures, shard: int) -> np.ndarray:
    out = np.zeros((features.step.shape[0], len(COST_FEATURES)))
    for q, syncs in enumerate(features.tensor_syncs):
        for rows, cost in syncs:
            cost = np.array(cost, np.float64)
            if shard > 1:  # ZeRO: the sync all-reduces the reduced gradient's shard
                cost[SHARD_SCALED] = zero_shard(cost[SHARD_SCALED], rows, shard)
            out[q] += cost
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=1024)  # by identity
def _zero_shards(features: LayerFeatures, degree: int):
    if all(rows % degree == 0 for part in features.weight_bytes for rows, _, _ in part):
        return None
    out = np.zeros((2, len(features.weight_bytes)))
    for q, part in enumerate(features.weight_bytes):
        out[0, q] = sum(zero_shard(st, rows, degree) for rows, _, st in part)
        total = sum(w for _, w, _ in part)
        out[1, q] = sum(zero_shard(w, rows, degree) for rows, w, _ in part) / total if total else 0.0
    out.setflags(write=False)
    return out[0], out[1]


@functools.lru_cache(maxsize=1024)
def _data_parallel_cached(grad_types: tuple, weight_dtype: str, degree: int, zero: bool):
    # Keyed by the gradients' types: every recompute policy and size shares them.
    num_parts = len(grad_types)
    reduce = np.zeros((num_parts, len(COST_FEATURES)))
    gather = np.zeros((num_parts, len(COST_FEATURES)))
    if degree == 1:
        return reduce, gather
    volume, hops = _FEATURE_INDEX["comm_volume"], _FEATURE_INDEX["comm_hops"]
    for part, types in enumerate(grad_types):
        for grad in types:
            (r_volume, r_hops), (g_volume, g_hops) = _gradient_collectives(
                grad.cache_key, grad, weight_dtype, degree, zero
            )
            reduce[part, volume] += r_volume
            reduce[part, hops] += r_hops
            gather[part, volume] += g_volume
            gather[part, hops] += g_hops
    return reduce, gather


@functools.lru_cache(maxsize=4096)
def _gradient_collectives(key: tuple, grad, weight_dtype: str, degree: int, zero: bool) -> tuple:
    """``((volume, hops) of the reduction, (volume, hops) of the gather)`` of one
    gradient of type ``grad``, cached: a block's gradients repeat a few types (a
    LayerNorm's scale and shift, for one). ``key`` is its ``cache_key``, which
    the cache hashes well (a type's own hash tells dtype, device and rank only).
    ZeRO gathers the updated weight's shards, in ``weight_dtype`` (the gradient's
    may be wider: mixed precision)."""
    group = {"group": tuple(range(degree)), "axis": 0}
    if not zero:
        f = get_spec("AllReduce").features(group, (grad,), (grad,))
        return (float(f.comm_volume), float(f.comm_hops)), (0.0, 0.0)
    # Rows the degree does not divide are padded, as the data-parallel transform does.
    padded = dict(group, **zero_scatter_attrs(grad, degree))
    rs = get_spec("ReduceScatter")
    (shard,) = rs.infer(padded, (grad,))
    f = rs.features(padded, (grad,), (shard,))
    shard = TensorType(shard.shape, weight_dtype, shard.device)
    ag = get_spec("AllGather")
    (whole,) = ag.infer(group, (shard,))
    g = ag.features(group, (shard,), (whole,))
    return (float(f.comm_volume), float(f.comm_hops)), (float(g.comm_volume), float(g.comm_hops))


@functools.lru_cache(maxsize=4096)  # by identity: cheaper to look up than hashing the types
def _data_parallel(features: LayerFeatures, degree: int, zero: bool):
    if degree < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {degree}")
    return _data_parallel_cached(features.grad_types, features.model.dtype, degree, zero)
