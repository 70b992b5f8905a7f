"""Strategy spaces: every combination of parallelism knobs, as rows.

A :class:`StrategySpace` names the values to try for each knob;
:func:`enumerate_configs` expands it into :class:`Config` rows in a fixed,
documented order. A row that breaks a constraint (a degree that does not
divide the batch or the layers, a preset that cannot hold the world size, a
check of :meth:`ParallelConfig.validate`) keeps its place in the sweep and
carries a ``reason``; nothing is dropped silently.

Conventions, chosen so that no two rows describe the same run:

* Degrees: by default every factorisation ``data * tensor * pipeline ==
  world_size``; listing ``data`` / ``tensor`` / ``pipeline`` restricts the
  factorisations to those values.
* Microbatches apply to pipelines (``pipeline > 1``): counts from
  ``microbatches``, or counts derived from ``microbatch_sizes``
  (``global_batch / (data * size)``). Without a pipeline the count comes from
  ``microbatches_without_pipeline`` (default ``(1,)``: no gradient
  accumulation, as in DistIR's grid).
* Knobs that do not apply take one canonical value. A schedule only matters
  with several microbatches or stages: a run with ``pipeline == 1`` and one
  microbatch gets the first non-interleaved schedule listed (else
  ``"1f1b"``). ``virtual_stages`` only applies to ``"interleaved"``; other
  schedules get 1. ``zero`` and ``overlap_grad_comm`` need ``data > 1`` and
  ``sequence_parallel`` needs ``tensor > 1``; otherwise they are False. An
  MLP has no attention, so its ``"attention"`` recomputation (Megatron's
  selective one) recomputes nothing: it is ``"none"``.
  ``training_precision`` applies to bf16 / f16 models; f32 / f64 models train in
  ``"full"`` precision whatever it lists.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Union

from distir_jax.models import MLPConfig, TransformerConfig, get_model_config
from distir_jax.models.config import FP8_PRECISIONS, HALF_DTYPES, PRECISIONS, precisions_for
from distir_jax.presets import fp8_problem, get_preset, preset_names

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "attention", "full")
OPTIMIZERS = ("sgd", "adam")
# Model dtype -> compute dtype of the hardware preset's peak FLOP/s.
HARDWARE_DTYPE = {"f32": "f32", "f16": "f16", "bf16": "bf16"}

ModelSpec = Union[str, MLPConfig, TransformerConfig]  # noqa: UP007 (a runtime alias)

# The largest world size a space takes (and GPU count in a "<preset>:<N>"
# hardware name). A preset holds [D, D] float64 link bandwidth and latency
# tables: 2 x 2 GiB at 16,384 GPUs, and a typo of a few more digits would
# otherwise end in a MemoryError, not a message.
MAX_WORLD_SIZE = 16384


class _DefaultCounts(tuple):
    """The default of ``StrategySpace.microbatches``: a tuple that tells the
    default from counts given on purpose, which ``microbatch_sizes`` excludes."""

    __slots__ = ()


DEFAULT_MICROBATCHES = _DefaultCounts((1, 2, 4, 8))


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _as_tuple(name: str, value, kind) -> tuple:
    """``value`` as a non-empty tuple of ``kind``; a scalar becomes a 1-tuple."""
    if value is None:
        # None means "any" only where a knob's documentation says so; the caller
        # handles those. Elsewhere it would leave the space empty, with no row to say why.
        raise ValueError(f"{name} must be one {_kind_name(kind)} or a non-empty sequence of them, got None")
    if isinstance(value, (str, bool, int, MLPConfig, TransformerConfig)):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a value or a sequence of values, got {value!r}") from None
    if not items:
        raise ValueError(f"{name} must not be empty")
    for item in items:
        ok = isinstance(item, kind) and not (kind is int and isinstance(item, bool))
        if not ok:
            raise ValueError(
                f"{name} entries must be {_kind_name(kind)}, got {item!r} ({type(item).__name__})"
            )
    return tuple(dict.fromkeys(items))  # keep order, drop repeats


def _positive(name: str, values: tuple) -> tuple:
    bad = [v for v in values if int(v) < 1]
    if bad:
        raise ValueError(f"{name} must be integers >= 1, got {list(bad)}")
    return tuple(int(v) for v in values)


def _one_of(name: str, values: tuple, allowed: tuple) -> tuple:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{name}: unknown value(s) {bad}; expected some of {list(allowed)}")
    return values


@dataclasses.dataclass(frozen=True)
class StrategySpace:
    """The knobs of a sweep; every field takes one value or a sequence of values.

    None is a value only where it is documented below (``seq_len``, ``data``,
    ``tensor``, ``pipeline``, ``microbatches``, ``microbatch_sizes``,
    ``dtype``, ``training_precision``); elsewhere, and for an empty sequence, the space raises a
    ``ValueError`` naming the knob.

    Attributes:
      model: model preset name(s) (see ``distir_jax.models.model_names``) or
        ``MLPConfig`` / ``TransformerConfig`` objects.
      world_sizes: GPU counts, at most :data:`MAX_WORLD_SIZE`.
      global_batch_sizes: samples per training step, over all replicas.
      seq_len: override of the transformers' sequence length (None: preset's).
      data, tensor, pipeline: allowed degrees (None: any factorisation).
      microbatches: microbatch counts tried when ``pipeline > 1`` (default
        ``(1, 2, 4, 8)``; None with ``microbatch_sizes``).
      microbatch_sizes: alternatively, samples per microbatch (exclusive with
        ``microbatches``: give one of them; the default counts give way).
      microbatches_without_pipeline: counts tried when ``pipeline == 1``.
      schedules: pipeline schedules, some of ``SCHEDULES``.
      virtual_stages: model chunks per device for ``"interleaved"``.
      recompute: activation recomputation, some of ``RECOMPUTE``.
      zero: shard optimizer state across data-parallel replicas (ZeRO-1).
      sequence_parallel: Megatron sequence parallelism (with ``tensor > 1``).
      overlap_grad_comm: overlap gradient all-reduces with the backward pass.
      dtype: model dtypes (None: each preset's own); the hardware's peak
        FLOP/s follow the dtype.
      training_precision: how bf16 / f16 models train, some of
        ``distir_jax.models.config.PRECISIONS`` (None: each model's own, by
        default ``"mixed"``: f32 master weights, optimizer state and gradient
        sums); f32 / f64 models train in ``"full"`` precision.
      hardware: hardware preset names without a count (see
        ``distir_jax.presets.preset_names``); ``"<preset>:<N>"`` is built per
        world size (a count is at most :data:`MAX_WORLD_SIZE`).
      optimizer: ``"sgd"`` or ``"adam"``.
    """

    model: Any = "mlp-xs"
    world_sizes: Any = (1, 2, 4, 8)
    global_batch_sizes: Any = (64,)
    seq_len: int | None = None
    data: Any = None
    tensor: Any = None
    pipeline: Any = None
    microbatches: Any = DEFAULT_MICROBATCHES
    microbatch_sizes: Any = None
    microbatches_without_pipeline: Any = (1,)
    schedules: Any = ("1f1b",)
    virtual_stages: Any = (2,)
    recompute: Any = ("none",)
    zero: Any = (False,)
    sequence_parallel: Any = (False,)
    overlap_grad_comm: Any = (False,)
    dtype: Any = None
    training_precision: Any = None
    hardware: Any = ("dgx-a100-80gb",)
    optimizer: Any = ("sgd",)

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("model", _as_tuple("model", self.model, (str, MLPConfig, TransformerConfig)))
        for name in ("world_sizes", "global_batch_sizes", "microbatches_without_pipeline", "virtual_stages"):
            set_(name, _positive(name, _as_tuple(name, getattr(self, name), int)))
        too_large = [w for w in self.world_sizes if w > MAX_WORLD_SIZE]
        if too_large:
            raise ValueError(
                f"world_sizes must be at most MAX_WORLD_SIZE = {MAX_WORLD_SIZE} GPUs, got {too_large} "
                "(a preset's [D, D] link tables would not fit in memory)"
            )
        for name in ("data", "tensor", "pipeline", "microbatch_sizes"):
            value = getattr(self, name)
            set_(name, None if value is None else _positive(name, _as_tuple(name, value, int)))
        if self.microbatch_sizes is not None:
            if self.microbatches is not None and not isinstance(self.microbatches, _DefaultCounts):
                raise ValueError(
                    f"microbatches={self.microbatches!r} and microbatch_sizes={self.microbatch_sizes!r} "
                    "both set the microbatches of pipelines: give one of them (the other None)"
                )
            set_("microbatches", None)
        elif self.microbatches is None:
            raise ValueError(
                "microbatches is None and microbatch_sizes is None: give microbatch counts "
                "(microbatches) or samples per microbatch (microbatch_sizes)"
            )
        elif not isinstance(self.microbatches, _DefaultCounts):  # the default is valid as it is
            set_("microbatches", _positive("microbatches", _as_tuple("microbatches", self.microbatches, int)))
        if self.seq_len is not None and (
            isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1
        ):
            raise ValueError(f"seq_len must be None or an int >= 1, got {self.seq_len!r}")
        set_("schedules", _one_of("schedules", _as_tuple("schedules", self.schedules, str), SCHEDULES))
        set_("recompute", _one_of("recompute", _as_tuple("recompute", self.recompute, str), RECOMPUTE))
        set_("optimizer", _one_of("optimizer", _as_tuple("optimizer", self.optimizer, str), OPTIMIZERS))
        for name in ("zero", "sequence_parallel", "overlap_grad_comm"):
            set_(name, _as_tuple(name, getattr(self, name), bool))
        # None: each model's own dtype (normalized to (None,), which `replace` sees again).
        keep_dtype = self.dtype is None or self.dtype == (None,)
        set_("dtype", (None,) if keep_dtype else _as_tuple("dtype", self.dtype, str))
        keep_precision = self.training_precision is None or self.training_precision == (None,)
        if keep_precision:
            set_("training_precision", (None,))
        else:
            precision = _as_tuple("training_precision", self.training_precision, str)
            set_("training_precision", _one_of("training_precision", precision, PRECISIONS))
        set_("hardware", _as_tuple("hardware", self.hardware, str))
        for m in self.model:  # fail early on an unknown preset name
            if isinstance(m, str):
                get_model_config(m)
        # An unknown hardware name is a typo, not a strategy that does not fit: one
        # error, not a row per configuration. (A count a preset cannot build, or a
        # dtype it has no peak for, is a row's reason: other rows may have it.)
        presets = preset_names()
        unknown = [h for h in self.hardware if h.partition(":")[0] not in presets]
        if unknown:
            raise ValueError(
                f"hardware: unknown preset(s) {unknown}; expected some of {presets} (a calibrated "
                "preset is registered first: register_calibrated_preset, or the CLI's --presets)"
            )
        counts = [h.partition(":")[2] for h in self.hardware]
        too_large = [
            h
            for h, n in zip(self.hardware, counts, strict=True)
            if n.isascii() and n.isdigit() and int(n) > MAX_WORLD_SIZE
        ]
        if too_large:
            raise ValueError(
                f"hardware: GPU count(s) of {too_large} exceed MAX_WORLD_SIZE = {MAX_WORLD_SIZE} "
                "(a preset's [D, D] link tables would not fit in memory)"
            )
        # Degrees restrict the factorisations; restricted to none, the sweep would be
        # empty with no row to say why. (A world size some other one leaves rows for
        # is a restriction, as asked: world sizes 1 and 8 with tensor 2.)
        if not any(factorisations(w, self.data, self.tensor, self.pipeline) for w in self.world_sizes):
            limits = {"data": self.data, "tensor": self.tensor, "pipeline": self.pipeline}
            allowed = ", ".join(f"{name} in {list(v)}" for name, v in limits.items() if v is not None)
            raise ValueError(
                f"no data x tensor x pipeline factorisation of world size(s) {list(self.world_sizes)} "
                f"has {allowed}: the space is empty (each degree must divide the world size, "
                "and their product equal it)"
            )

    def replace(self, **changes) -> StrategySpace:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of a sweep: the knobs, and why it is invalid (if it is).

    ``seq_len`` is 0 for models without a sequence (MLPs). ``microbatches`` /
    ``microbatch_size`` are 0 where the batch does not split evenly (the row
    is then invalid). ``model_config`` holds the resolved model (dtype and
    sequence length applied); it is not part of the row's identity.
    """

    model: str
    hardware: str
    world_size: int
    global_batch_size: int
    seq_len: int
    data: int
    tensor: int
    pipeline: int
    microbatches: int
    microbatch_size: int
    schedule: str
    virtual_stages: int
    recompute: str
    zero: bool
    sequence_parallel: bool
    overlap_grad_comm: bool
    dtype: str
    training_precision: str
    optimizer: str
    reason: str = ""
    model_config: Any = dataclasses.field(default=None, compare=False, repr=False)

    # Every knob, in column order; `config_id` hashes these.
    KNOBS: ClassVar[tuple[str, ...]] = (
        "model",
        "hardware",
        "world_size",
        "global_batch_size",
        "seq_len",
        "data",
        "tensor",
        "pipeline",
        "microbatches",
        "microbatch_size",
        "schedule",
        "virtual_stages",
        "recompute",
        "zero",
        "sequence_parallel",
        "overlap_grad_comm",
        "dtype",
        "training_precision",
        "optimizer",
    )
    # Knobs that do not change a program's structure: the global batch size
    # flows as a size-variant dim (and so does the microbatch size it implies)
    # and the hardware is a batch axis of the kernel's `Hardware`.
    SIZE_KNOBS: ClassVar[tuple[str, ...]] = ("hardware", "global_batch_size", "microbatch_size")

    @property
    def valid(self) -> bool:
        return not self.reason

    @functools.cached_property
    def config_id(self) -> str:
        """A stable id of the knobs: the same in every run, process and Python version."""
        return config_id(self.knobs())

    def knobs(self) -> dict:
        return {k: getattr(self, k) for k in self.KNOBS}

    def structural_key(self) -> tuple:
        """Knobs that fix the program's structure (everything but sizes and hardware)."""
        return tuple(getattr(self, k) for k in self.KNOBS if k not in self.SIZE_KNOBS)

    @property
    def preset(self) -> str:
        """The hardware preset for this world size, e.g. ``"dgx-a100-80gb:16"``."""
        return self.hardware if ":" in self.hardware else f"{self.hardware}:{self.world_size}"

    def topology(self):
        return _topology(self.preset, HARDWARE_DTYPE.get(self.dtype, self.dtype))

    def with_reason(self, reason: str) -> Config:
        config = dataclasses.replace(self, reason=reason)
        if "config_id" in self.__dict__:  # the reason is not a knob: the id stays
            config.__dict__["config_id"] = self.__dict__["config_id"]
        return config


def config_id(knobs: dict) -> str:
    """16 hex digits of SHA-1 over the knobs' canonical text (not Python's salted hash)."""
    text = "|".join(f"{k}={_canonical(knobs[k])}" for k in Config.KNOBS)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _canonical(value) -> str:
    if isinstance(value, (bool,)):
        return "1" if value else "0"
    return str(value)


@functools.lru_cache(maxsize=64)
def _topology(preset: str, dtype: str):
    return get_preset(preset, dtype=dtype)


def model_label(model: ModelSpec) -> str:
    """The text naming a model in a table: its preset name, or its fields."""
    if isinstance(model, str):
        return model
    # Multi-head attention's key / value heads (all of them) go unnamed: labels,
    # and so configuration ids, stay those from before grouped-query attention.
    unnamed = () if getattr(model, "grouped", True) else ("num_kv_heads",)
    fields = ",".join(
        f"{f.name}={getattr(model, f.name)}" for f in dataclasses.fields(model) if f.name not in unnamed
    )
    return f"{type(model).__name__}({fields})"


def resolve_model(model: ModelSpec, dtype: str | None, seq_len: int | None, precision: str | None = None):
    """The model config with ``dtype``, training ``precision`` (bf16 / f16 models; others
    train in full precision) and (transformers) ``seq_len`` applied."""
    config = _unresolved(model)
    changes = {}
    if dtype is not None and dtype != config.dtype:
        changes["dtype"] = dtype
    # Spelled out, so that rows made by hand resolve to the same config.
    precision = _asked_precision(config, dtype, precision)
    if precision != config.training_precision:
        changes["training_precision"] = precision
    if seq_len is not None and isinstance(config, TransformerConfig) and seq_len != config.seq_len:
        changes["seq_len"] = seq_len
    return dataclasses.replace(config, **changes) if changes else config


def factorisations(world_size: int, data=None, tensor=None, pipeline=None) -> list[tuple[int, int, int]]:
    """``(d, t, p)`` with ``d * t * p == world_size``, each in its allowed set (None: any)."""
    # Divisors in pairs up to the square root: a huge world size (a typo) answers at once.
    small = [n for n in range(1, math.isqrt(world_size) + 1) if world_size % n == 0]
    divisors = sorted(set(small + [world_size // n for n in small]))
    out = []
    for d, t in itertools.product(divisors, divisors):
        if world_size % (d * t):
            continue
        p = world_size // (d * t)
        limits = ((d, data), (t, tensor), (p, pipeline))
        if all(allowed is None or degree in allowed for degree, allowed in limits):
            out.append((d, t, p))
    return out


def _microbatch_choices(space: StrategySpace, batch: int, d: int, p: int) -> list[tuple[int, int, str]]:
    """``(count, size, reason)`` for each microbatch choice of one (batch, d, p)."""
    per_replica, rem = divmod(batch, d)
    if rem:
        # The batch cannot be split; still one row per choice, all invalid.
        reason = f"global batch {batch} is not divisible by data degree {d}"
        if p == 1:
            return [(m, 0, reason) for m in space.microbatches_without_pipeline]
        if space.microbatch_sizes is not None:
            return [(0, s, reason) for s in space.microbatch_sizes]
        return [(m, 0, reason) for m in space.microbatches]
    choices = []
    if p > 1 and space.microbatch_sizes is not None:
        for size in space.microbatch_sizes:
            count, rem = divmod(per_replica, size)
            if rem or count == 0:
                choices.append(
                    (0, size, f"per-replica batch {per_replica} is not a multiple of microbatch size {size}")
                )
            else:
                choices.append((count, size, ""))
        return choices
    counts = space.microbatches if p > 1 else space.microbatches_without_pipeline
    for m in counts:
        size, rem = divmod(per_replica, m)
        if rem or size == 0:
            choices.append((m, 0, f"per-replica batch {per_replica} does not split into {m} microbatches"))
        else:
            choices.append((m, size, ""))
    return choices


def enumerate_configs(space: StrategySpace) -> Iterator[Config]:
    """Every configuration of ``space`` as a :class:`Config`, invalid ones with a reason.

    Order: model, hardware, world size, global batch, (data, tensor, pipeline)
    in factorisation order, microbatches, schedule, virtual stages, recompute,
    zero, sequence parallel, overlap, dtype, training precision, optimizer. Configurations that
    the conventions of this module make identical appear once.
    """
    seen: set[tuple] = set()
    for model, hardware, world_size, batch in itertools.product(
        space.model, space.hardware, space.world_sizes, space.global_batch_sizes
    ):
        label = model_label(model)
        for d, t, p in factorisations(world_size, space.data, space.tensor, space.pipeline):
            for (m, size, batch_reason), dtype, precision in itertools.product(
                _microbatch_choices(space, batch, d, p), space.dtype, space.training_precision
            ):
                try:
                    model_config = resolve_model(model, dtype, space.seq_len, precision)
                    model_reason = ""
                except ValueError as err:
                    model_config, model_reason = None, _one_line(err)
                if model_config is not None:
                    resolved_dtype, resolved_precision = model_config.dtype, model_config.resolved_precision
                else:  # the row names what it asked for: the model's own where it asked for none
                    resolved_dtype, resolved_precision = _requested(model, dtype, precision)
                seq = model_config.seq_len if isinstance(model_config, TransformerConfig) else 0
                mlp = isinstance(model_config or _unresolved(model), MLPConfig)
                for schedule, v, recompute, zero, sp, overlap, optimizer in itertools.product(
                    space.schedules,
                    space.virtual_stages,
                    space.recompute,
                    space.zero,
                    space.sequence_parallel,
                    space.overlap_grad_comm,
                    space.optimizer,
                ):
                    if p == 1 and m <= 1:
                        schedule = next((s for s in space.schedules if s != "interleaved"), "1f1b")
                    if schedule != "interleaved":
                        v = 1
                    if d == 1:  # no data parallelism: nothing to shard or overlap
                        zero = overlap = False
                    if t == 1:
                        sp = False
                    if mlp and recompute == "attention":  # nothing to recompute selectively
                        recompute = "none"
                    # The knobs in Config.KNOBS order: the conventions above make many
                    # combinations equal, and a tuple is checked long before a Config is built.
                    knobs = (
                        label, hardware, world_size, batch, seq, d, t, p, m, size,
                        schedule, v, recompute, zero, sp, overlap, resolved_dtype, resolved_precision,
                        optimizer,
                    )  # fmt: skip
                    if knobs in seen:
                        continue
                    seen.add(knobs)
                    config = Config(**dict(zip(Config.KNOBS, knobs)), model_config=model_config)
                    reason = model_reason or batch_reason or constraint_reason(config)
                    yield config.with_reason(reason) if reason else config


def _asked_precision(config, dtype: str | None, precision: str | None) -> str | None:
    """The training precision a row asks of model ``config`` in ``dtype`` (None: its own):
    None for full precision (a half-precision model's choice does not carry over to
    f32), else the row's, the model's own or the dtype's default."""
    dtype = dtype or config.dtype
    if dtype not in HALF_DTYPES:
        return None
    return precision or config.training_precision or precisions_for(dtype)[0]


def _unresolved(model: ModelSpec) -> MLPConfig | TransformerConfig:
    """``model``'s config as given (a preset's own dtype and sequence length)."""
    return get_model_config(model) if isinstance(model, str) else model


def _requested(model: ModelSpec, dtype: str | None, precision: str | None) -> tuple[str, str]:
    """``(dtype, training precision)`` of a row whose model does not resolve."""
    config = _unresolved(model)
    return str(dtype or config.dtype), str(_asked_precision(config, dtype, precision) or "full")


def constraint_reason(config: Config) -> str:
    """Why ``config`` cannot run, or ``""``: hardware, model shape, then the transforms' own checks."""
    try:
        config.topology()
    except ValueError as err:
        return _one_line(err)
    if config.training_precision in FP8_PRECISIONS:
        problem = fp8_problem(config.preset, HARDWARE_DTYPE.get(config.dtype, config.dtype))
        if problem:
            return problem
    model = config.model_config
    # Stages may hold unequal layer counts (the pipeline transform balances
    # them), so layers need not divide evenly; ParallelConfig.validate checks
    # the rest (degrees, heads, batch splits).
    if isinstance(model, TransformerConfig):
        if model.ffn_hidden % config.tensor:
            return f"MLP width {model.ffn_hidden} is not divisible by tensor degree {config.tensor}"
        if config.sequence_parallel and model.seq_len % config.tensor:
            return f"sequence length {model.seq_len} is not divisible by tensor degree {config.tensor}"
    elif isinstance(model, MLPConfig) and config.sequence_parallel and config.microbatch_size % config.tensor:
        # An MLP has no sequence axis: sequence parallelism splits each microbatch's
        # rows over the tensor group (the transform's reduce-scatter would fail).
        return (
            f"sequence parallelism splits an MLP's microbatch rows over the tensor degree: "
            f"microbatch size {config.microbatch_size} is not divisible by tensor degree {config.tensor}"
        )
    return _transform_reason(config)


def _transform_reason(config: Config) -> str:
    """The parallelism transforms' own check (``ParallelConfig.validate``), if installed."""
    try:
        from search._transform import validate_config
    except ImportError:  # transforms not available: the checks above are all we have
        return ""
    return validate_config(config)


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(text.split())


def count_configs(space: StrategySpace) -> int:
    """Number of rows :func:`enumerate_configs` yields."""
    return sum(1 for _ in enumerate_configs(space))


def as_configs(space_or_configs: StrategySpace | Sequence[Config]) -> list[Config]:
    """A space's configurations, or a given list of them, as a list."""
    if isinstance(space_or_configs, StrategySpace):
        return list(enumerate_configs(space_or_configs))
    configs = []
    for c in space_or_configs:
        if not isinstance(c, Config):
            raise ValueError(f"expected a StrategySpace or Config rows, got {type(c).__name__}")
        # A row made by hand: resolve its preset name. (An invalid row is never built,
        # and one of a dtype the model does not take has no model to resolve.)
        if c.model_config is None and c.valid:
            model_config = resolve_model(c.model, c.dtype, c.seq_len or None, c.training_precision)
            c = dataclasses.replace(c, model_config=model_config)
        configs.append(c)
    return configs
