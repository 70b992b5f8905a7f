"""One entry point for hybrid parallelism: a :class:`ParallelConfig` and :func:`parallelize`.

:func:`parallelize` applies, in this order, tensor parallelism, activation
recomputation, pipeline parallelism and data parallelism, skipping each one
whose degree is 1 (or policy ``"none"``). Each transform multiplies the device
count and places its ranks outermost (new device ``rank * D_old + d``), so
tensor-parallel ranks get adjacent device ids (one node) and data-parallel
replicas are outermost, as Megatron-LM places them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import numpy as np

from distir_jax.ir._gc import gc_paused
from distir_jax.ir.types import dim_str, normalize_dim
from distir_jax.transforms.base import Distributed, Program, as_distributed
from distir_jax.transforms.data_parallel import data_parallel

__all__ = ["RECOMPUTE_POLICIES", "SCHEDULES", "ParallelConfig", "model_shape", "parallelize"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE_POLICIES = ("none", "attention", "full")
# Original input names of weights and optimizer state; every other input is data.
_STATE_RE = re.compile(r"^l\d+\.")


def _positive_int(name: str, value) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"ParallelConfig: {name} must be an int >= 1, got {name}={value!r}")


def _dividing(name: str, value: int, what: str, size, extra: str = "") -> None:
    """Raises unless ``value`` divides ``size`` (an int or size variants) everywhere."""
    # Plain ints (a sweep validates every row) skip the numpy round trip.
    divides = size % value == 0 if type(size) is int else not np.any(np.asarray(size) % value != 0)
    if not divides:
        raise ValueError(
            f"ParallelConfig: {name}={value} must divide the {what}, which is {dim_str(size)}{extra}"
        )


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """A distribution strategy: parallel degrees and their options.

    Attributes:
      data: data-parallel replicas.
      tensor: tensor-parallel (Megatron) degree.
      pipeline: pipeline stages.
      microbatches: microbatches per step and replica (pipeline only).
      schedule: pipeline schedule, one of :data:`SCHEDULES`.
      virtual_stages: model chunks per pipeline device (``"interleaved"`` only).
      recompute: activation recomputation, one of :data:`RECOMPUTE_POLICIES`.
      zero: ZeRO-1: shard optimizer state over the data-parallel replicas.
      sequence_parallel: Megatron sequence parallelism (needs ``tensor > 1``).
      overlap_grad_comm: overlap gradient reduction with the backward pass.
      bucket_bytes: bucket size for gradient reductions, or ``None``.
    """

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    zero: bool = False
    sequence_parallel: bool = False
    overlap_grad_comm: bool = False
    bucket_bytes: float | None = None

    @property
    def world_size(self) -> int:
        """Devices the strategy uses: ``data * tensor * pipeline``."""
        return self.data * self.tensor * self.pipeline

    def validate(
        self,
        num_layers: int,
        num_heads: int | None,
        batch_size,
        world_size: int | None = None,
        *,
        hidden: int | None = None,
        kv_heads: int | None = None,
    ) -> ParallelConfig:
        """Checks the strategy against a model; returns ``self``.

        Pipeline stages may hold unequal numbers of layers (the pipeline
        transform balances stages by cost), so the hard constraint is
        ``pipeline * virtual_stages <= num_layers``, not divisibility.

        Args:
          num_layers: transformer blocks (MLP: layers) ``L``.
          num_heads: attention heads, or ``None`` for a model without them.
          batch_size: global batch ``B``, an int or a 1-D array of size variants.
          world_size: when given, the device count the strategy must use.
          hidden: when given, the width the tensor degree must divide.
          kv_heads: when given, the key / value heads (grouped-query attention)
            the tensor degree must divide.

        Raises:
          ValueError: naming the parameter, its value and the constraint.
        """
        for name in ("data", "tensor", "pipeline", "microbatches", "virtual_stages"):
            _positive_int(name, getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"ParallelConfig: schedule must be one of {list(SCHEDULES)}, got schedule={self.schedule!r}"
            )
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(
                f"ParallelConfig: recompute must be one of {list(RECOMPUTE_POLICIES)}, "
                f"got recompute={self.recompute!r}"
            )
        for name in ("zero", "sequence_parallel", "overlap_grad_comm"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"ParallelConfig: {name} must be a bool, got {name}={getattr(self, name)!r}")
        bucket = self.bucket_bytes
        if bucket is not None and (
            isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or bucket <= 0
        ):
            raise ValueError(
                f"ParallelConfig: bucket_bytes must be a number > 0 or None, got bucket_bytes={bucket!r}"
            )
        if self.zero and bucket is not None:
            raise ValueError(
                f"ParallelConfig: bucket_bytes={bucket!r} cannot be combined with zero=True (ZeRO scatters "
                "each gradient on its own); set bucket_bytes=None"
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(
                f"ParallelConfig: virtual_stages={self.virtual_stages} needs schedule='interleaved', "
                f"got schedule={self.schedule!r}"
            )
        if self.schedule == "interleaved" and self.microbatches % self.pipeline:
            raise ValueError(
                f"ParallelConfig: schedule='interleaved' needs microbatches={self.microbatches} to be a "
                f"multiple of pipeline={self.pipeline} (microbatches enter the stages in groups of pipeline)"
            )
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("ParallelConfig: sequence_parallel=True needs tensor > 1, got tensor=1")
        if self.microbatches > 1 and self.pipeline == 1:
            raise ValueError(
                f"ParallelConfig: microbatches={self.microbatches} needs pipeline > 1 (microbatches split "
                "the batch between pipeline stages), got pipeline=1"
            )
        if self.pipeline * self.virtual_stages > num_layers:
            raise ValueError(
                f"ParallelConfig: pipeline={self.pipeline} x virtual_stages={self.virtual_stages} must be "
                f"<= the number of layers, {num_layers}: every pipeline stage needs at least one layer"
            )
        if num_heads is not None:
            _dividing("tensor", self.tensor, "number of attention heads", num_heads)
        if kv_heads is not None:
            _dividing("tensor", self.tensor, "number of key / value heads", kv_heads)
        if hidden is not None:
            _dividing("tensor", self.tensor, "hidden size", hidden)
        _dividing("data", self.data, "batch size", batch_size)
        per_replica = normalize_dim(np.asarray(batch_size) // self.data)
        where = f" (batch size {dim_str(batch_size)} / data={self.data})"
        if np.any(np.asarray(per_replica) < self.microbatches):
            raise ValueError(
                f"ParallelConfig: microbatches={self.microbatches} must be <= the per-replica batch, which "
                f"is {dim_str(per_replica)}{where}: every microbatch needs at least one example"
            )
        _dividing("microbatches", self.microbatches, "per-replica batch", per_replica, where)
        if world_size is not None and self.world_size != world_size:
            raise ValueError(
                f"ParallelConfig: data x tensor x pipeline = {self.data} x {self.tensor} x {self.pipeline} = "
                f"{self.world_size} must equal world_size={world_size}"
            )
        return self


def model_shape(program: Program) -> dict:
    """What :meth:`ParallelConfig.validate` needs, read from a contract-keeping program.

    Returns:
      ``num_layers`` (blocks ``L``: ops carry layers ``0..L+1``), ``num_heads``
      (from the head-splitting Reshapes, ``None`` if there are none) and
      ``batch_size`` (dim 0 of the first data input, i.e. of an input whose
      original name is not a weight's or optimizer state's ``l{layer}.…``).
    """
    dist = as_distributed(program)
    fn = dist.function
    layers = [op.attr("layer") for op in fn.ops if isinstance(op.attr("layer"), int)]
    data = [v for v in fn.inputs if not _STATE_RE.match(dist.inputs[v.name].source) and v.type.rank > 0]
    if not layers or not data:
        raise ValueError(f"parallelize: function {fn.name} has no layer-annotated ops or no data input")
    heads: dict[str, set] = {"num_heads": set(), "num_kv_heads": set()}
    for op in fn.ops:
        if op.op_type == "Reshape" and op.attr("tp") == "heads" and op.attr("tp_axis") is not None:
            heads[op.attr("tp_dim") or "num_heads"].add(op.attr("shape")[op.attr("tp_axis")])
    shape = dict(
        num_layers=max(1, max(layers) - 1),
        num_heads=min(heads["num_heads"]) if heads["num_heads"] else None,
        batch_size=data[0].type.shape[0],
    )
    if heads["num_kv_heads"]:  # grouped-query attention
        shape["kv_heads"] = min(heads["num_kv_heads"])
    return shape


def _call(transform, program, *args, representative_only=False, **kwargs) -> Distributed:
    # Transforms that can build one representative rank take the flag; the
    # others are always built in full.
    if representative_only and "representative_only" in inspect.signature(transform).parameters:
        kwargs["representative_only"] = True
    return transform(program, *args, **kwargs)


@gc_paused
def parallelize(fn: Program, config: ParallelConfig, *, representative_only: bool = False) -> Distributed:
    """Applies ``config`` to a single-device training program.

    Order: tensor parallel -> recompute -> pipeline parallel -> data parallel,
    each skipped when its degree is 1 (policy ``"none"``).

    Args:
      fn: a :class:`Function` (or :class:`Distributed`) keeping the model
        annotation contract.
      config: the strategy; validated against ``fn`` first.
      representative_only: build one representative data-parallel replica
        (and tensor rank, where that transform supports it) with collectives
        costed over their full groups; its maps are partial.

    Returns:
      The distributed program, related to ``fn``.

    Raises:
      ValueError: when ``config`` does not fit the model (see
        :meth:`ParallelConfig.validate`).
    """
    dist = as_distributed(fn)
    config.validate(**model_shape(dist))
    if config.tensor > 1:
        from distir_jax.transforms.tensor_parallel import tensor_parallel

        dist = _call(
            tensor_parallel,
            dist,
            config.tensor,
            sequence_parallel=config.sequence_parallel,
            representative_only=representative_only,
        )
    if config.recompute != "none":
        from distir_jax.transforms.recompute import recompute

        dist = recompute(dist, config.recompute)
    if config.pipeline > 1:
        from distir_jax.transforms.pipeline import pipeline_parallel

        dist = pipeline_parallel(
            dist,
            config.pipeline,
            config.microbatches,
            schedule=config.schedule,
            virtual_stages=config.virtual_stages,
        )
    if config.data > 1:
        dist = data_parallel(
            dist,
            config.data,
            overlap=config.overlap_grad_comm,
            bucket_bytes=config.bucket_bytes,
            zero=config.zero,
            representative_only=representative_only,
        )
    return dist
