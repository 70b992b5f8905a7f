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
        updates): the output allocates no new memory, and the input's buffer
        lives as long as either is used. Or ``(attrs, num_outputs) -> pairs``
        for ops that work in place when their attributes say so (see
        :func:`output_aliases`).
    """

    name: str
    infer: Callable[[Attrs, tuple[TensorType, ...]], tuple[TensorType, ...]]
    features: Callable[[Attrs, tuple[TensorType, ...], tuple[TensorType, ...]], OpFeatures]
    evaluate: Callable[[Attrs, Sequence[np.ndarray]], Sequence[np.ndarray]]
    num_inputs: int | None = None
    single_device: bool = True
    aliases: tuple[tuple[int, int], ...] | Callable[[Attrs, int], tuple[tuple[int, int], ...]] = ()


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"op type {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def aliases_if_inplace(attrs: Attrs, num_outputs: int) -> tuple[tuple[int, int], ...]:
    """:attr:`OpSpec.aliases` of ops that work in place when ``inplace=True``: output
    ``i`` is written into operand ``i`` (an Add into its first operand, a
    ReduceScatter's parts into their members' operands)."""
    return tuple((i, i) for i in range(num_outputs)) if attrs.get("inplace") else ()


def output_aliases(spec: OpSpec, attrs: Attrs, num_outputs: int) -> dict[int, int]:
    """``output -> input`` index of the outputs of an op of type ``spec`` that
    share their input's buffer (:attr:`OpSpec.aliases`)."""
    aliases = spec.aliases
    return dict(aliases(attrs, num_outputs) if callable(aliases) else aliases)


def check_alias_fits(op, output: int, root: str, root_bytes) -> None:
    """Raises ValueError unless ``op``'s output ``output``, which shares the buffer of
    value ``root`` (:func:`output_aliases`, followed to its owner), fits in it: an op
    writing in place into a smaller buffer would make the memory model undercount."""
    value = op.outputs[output]
    need = value.type.num_bytes
    if isinstance(need, (int, float)) and isinstance(root_bytes, (int, float)) and need <= root_bytes:
        return  # the common case, without NumPy
    if np.any(np.asarray(need) > np.asarray(root_bytes)):
        raise ValueError(
            f"{op.op_type} op writing %{value.name} ({_bytes_str(value.type.num_bytes)}) in place "
            f"shares the buffer of %{root} ({_bytes_str(root_bytes)}), which is smaller: an in-place "
            "result must fit in the buffer it is written into (an in-place AllGather's operand must be "
            "a Shard of a value of the result's size)"
        )


def _bytes_str(value) -> str:
    values = np.unique(np.asarray(value, np.float64))
    return f"{values[0]:.0f} bytes" if values.size == 1 else f"{values.tolist()} bytes"


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


# Attributes that annotate an op for transforms and schedules: its place in the
# model, the pipeline and the streams, and tensor-parallel hints. No built-in
# shape rule or cost feature reads them (tests/test_build_speed_invariants.py
# checks this), so results cached by :func:`rule_cache_key` ignore them.
ANNOTATION_ATTRS = frozenset(
    (
        "layer",
        "phase",
        "stage",
        "chunk",
        "microbatch",
        "stream",
        "grad_of",
        "weight",
        "tp",
        "tp_axis",
        "recompute",
    )
)
# Attribute values of these exact types are hashable and frozen as they are.
SCALAR_ATTR_TYPES = frozenset((bool, int, float, str))
# Modules whose rules are the built-in ones: pure functions of their arguments.
_BUILTIN_RULE_MODULES = frozenset(
    "distir_jax.ir." + m
    for m in ("ops_comm", "ops_compute", "ops_loss", "ops_nn", "ops_optim", "ops_shape", "shape_rules")
)


def rule_cache_key(rule: Callable, op, *type_groups: tuple[TensorType, ...]) -> tuple | None:
    """A key under which ``rule``'s result for ``op``'s attributes and the type groups may be reused.

    Built-in shape rules and features are pure functions of the attributes they
    read and of the operand types, and an op copied per microbatch or replica
    differs from its copies only in annotations. So the key is the rule, the
    op's :func:`attrs_cache_key` and the types. Returns ``None`` (do not cache)
    for a rule that is not built in, whose side effects and reads are unknown,
    and for unhashable attributes.

    Args:
      rule: the spec's ``infer`` or ``features`` function.
      op: the :class:`~distir_jax.ir.Op` (its attributes' key is computed once per op).
      type_groups: tuples of :class:`TensorType` (operands; results).
    """
    if getattr(rule, "__module__", None) not in _BUILTIN_RULE_MODULES:
        return None
    attrs = getattr(op, "_attrs_cache_key", None)
    if attrs is None:
        return None
    types = []
    for group in type_groups:
        keys = tuple([t.cache_key if type(t) is TensorType else None for t in group])
        if None in keys:
            return None
        types.append(keys)
    return (rule, attrs, tuple(types))


# Features of built-in ops by rule_cache_key (see cached_features). Cleared when
# full, to bound memory.
_FEATURES_CACHE: dict[tuple, OpFeatures] = {}
_MAX_FEATURES_CACHE = 1 << 16


def cached_features(
    spec: OpSpec, op, ins: tuple[TensorType, ...], outs: tuple[TensorType, ...]
) -> OpFeatures:
    """``spec.features(op.attr_dict, ins, outs)``, computed once per distinct key.

    Copies of an op (per microbatch, replica or repeated layer) have equal
    features. The result is shared, so its size-variant arrays are made
    read-only.
    """
    key = rule_cache_key(spec.features, op, ins, outs)
    if key is not None:
        cached = _FEATURES_CACHE.get(key)
        if cached is not None:
            return cached
    features = spec.features(op.attr_dict, ins, outs)
    if key is not None:
        for field in dataclasses.fields(features):
            value = getattr(features, field.name)
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
        if len(_FEATURES_CACHE) >= _MAX_FEATURES_CACHE:
            _FEATURES_CACHE.clear()
        _FEATURES_CACHE[key] = features
    return features


def op_features(op) -> OpFeatures:
    """The cost features of ``op`` (an :class:`~distir_jax.ir.function.Op`) from its
    own values' types, computed once per distinct op (:func:`cached_features`)."""
    ins, outs = tuple([v.type for v in op.inputs]), tuple([v.type for v in op.outputs])
    return cached_features(get_spec(op.op_type), op, ins, outs)


def attrs_cache_key(attrs: tuple) -> tuple | None:
    """Frozen attributes without annotations, each with the exact types of its value.

    ``1``, ``1.0`` and ``True`` are equal in Python but a rule may check them
    differently, so the types are part of the key. ``None`` when a value is unhashable.
    """
    kept = []
    for k, v in attrs:
        if k in ANNOTATION_ATTRS:
            continue
        t = type(v)
        if t is str:
            kept.append((k, v))
            continue
        if t is tuple:
            item_types = tuple(map(type, v))
            hashable = SCALAR_ATTR_TYPES.issuperset(item_types)
            kept.append((k, v, item_types))
        else:
            hashable = t in SCALAR_ATTR_TYPES  # else a subclass: a NamedTuple, a NumPy scalar
            kept.append((k, v, t))
        if not hashable:
            try:
                hash(v)
            except TypeError:
                return None
    return tuple(kept)


_LOADED = False


def _ensure_loaded() -> None:
    # Op definitions register themselves on import; importing here keeps the
    # registry complete however the package was entered.
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from distir_jax.ir import ops_comm, ops_compute, ops_loss, ops_nn, ops_optim, ops_shape  # noqa: F401
