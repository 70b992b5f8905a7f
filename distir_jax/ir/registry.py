"""The op registry: one place per op type for its shape rule, cost features
and NumPy semantics.

Every consumer of op semantics (type inference, lowering, the reference
simulator, the sequential executor) goes through :func:`get_spec`, so adding an
op type is one :func:`register` call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from distir_jax.ir.types import Dim, TensorType

Attrs = dict


class OpError(ValueError):
    """Raised by an op's shape rule; type inference adds the op's position."""


@dataclasses.dataclass(frozen=True)
class OpFeatures:
    """Hardware-independent cost features of one op.

    Attributes:
      flops: floating-point operations on each device the op runs on.
      mem_bytes: bytes read plus written in device memory on each device.
      comm_volume: bytes that cross the group's slowest link (already scaled by
        the collective's algorithm, e.g. ``2 (g - 1) / g * n`` for a ring
        all-reduce).
      comm_hops: sequential message latencies the algorithm pays.
      is_comm: whether the op is communication (costed by links) rather than
        compute (costed by the device's roofline).
      launches: kernel launches; ``None`` means 1 for compute, 0 for
        communication.
      linear_flops, linear_bytes: flops and bytes whose times add instead of
        taking the roofline's max (used by coarsened, fused ops).
    """

    flops: Dim = 0
    mem_bytes: Dim = 0
    comm_volume: Dim = 0
    comm_hops: Dim = 0
    is_comm: bool = False
    launches: Dim | None = None
    linear_flops: Dim = 0
    linear_bytes: Dim = 0

    def cost_features(self) -> dict:
        """The features by the names of :data:`distir_jax.cost.COST_FEATURES`."""
        launches = self.launches if self.launches is not None else (0 if self.is_comm else 1)
        return dict(
            launches=launches,
            flops=self.flops,
            mem_bytes=self.mem_bytes,
            linear_flops=self.linear_flops,
            linear_bytes=self.linear_bytes,
            comm_volume=self.comm_volume,
            comm_hops=self.comm_hops,
        )


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How one op type behaves.

    Attributes:
      name: the op type, as written in programs.
      infer: ``(attrs, input_types) -> output_types``; raises :class:`OpError`.
      features: ``(attrs, input_types, output_types) -> OpFeatures``.
      evaluate: ``(attrs, input_arrays) -> output_arrays`` in NumPy.
      num_inputs: exact operand count, or ``None`` for variadic ops.
      single_device: operands and results must all live on one device.
      aliases: ``(output, input)`` pairs whose buffers are shared (in-place
        updates): the output allocates no new memory.
    """

    name: str
    infer: Callable[[Attrs, tuple[TensorType, ...]], tuple[TensorType, ...]]
    features: Callable[[Attrs, tuple[TensorType, ...], tuple[TensorType, ...]], OpFeatures]
    evaluate: Callable[[Attrs, Sequence[np.ndarray]], Sequence[np.ndarray]]
    num_inputs: int | None = None
    single_device: bool = True
    aliases: tuple[tuple[int, int], ...] = ()


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"op type {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get_spec(op_type: str) -> OpSpec:
    _ensure_loaded()
    try:
        return _REGISTRY[op_type]
    except KeyError:
        raise ValueError(
            f"unknown op type {op_type!r}; registered types: {', '.join(sorted(_REGISTRY))}"
        ) from None


def registered_op_types() -> tuple[str, ...]:
    _ensure_loaded()
    return tuple(sorted(_REGISTRY))


_LOADED = False


def _ensure_loaded() -> None:
    # Op definitions register themselves on import; importing here keeps the
    # registry complete however the package was entered.
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from distir_jax.ir import ops_comm, ops_compute, ops_loss, ops_nn, ops_optim, ops_shape  # noqa: F401
