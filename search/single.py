"""One configuration: its result row and peak memory per device (:func:`summarize_config`,
the sweep's engines) and a Chrome trace of its coarse program
(:func:`coarse_chrome_trace`), or in detail: every op's timing and a Chrome
trace of the fine program (:func:`simulate_config`, :func:`chrome_trace`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping

import numpy as np

from distir_jax.ir import Function
from distir_jax.lower import lower
from distir_jax.models import MLPConfig, TransformerConfig
from distir_jax.models.config import HALF_DTYPES
from distir_jax.transforms.coarse import SplitBlockError
from search._programs import compact, stack_rows
from search.evaluate import _row, in_precision, simulate_on_host
from search.space import Config, StrategySpace


@dataclasses.dataclass(frozen=True)
class ConfigSummary:
    """What :func:`summarize_config` returns.

    Attributes:
      row: the result-table row (same columns and numbers as a sweep's).
      devices: ``[D']`` original indices of the devices in the simulated
        (symmetry-reduced) program.
      peak_memory_bytes: ``[D']`` peak bytes of each of those devices.
      simulated: ``[D']`` whether any op runs on the device (the others only
        appear as ends of a collective's slowest link).
      resident_bytes: ``[D']`` of each peak, the bytes resident from the
        start (weights, optimizer state, the step's data); the rest is what
        the step allocates (activations, gradients, messages) and holds at
        its peak.
    """

    row: dict
    devices: np.ndarray
    peak_memory_bytes: np.ndarray
    simulated: np.ndarray
    resident_bytes: np.ndarray


@dataclasses.dataclass(frozen=True)
class SingleResult(ConfigSummary):
    """What :func:`simulate_config` returns: a :class:`ConfigSummary` from the
    fine program, and that program's ops.

    Attributes:
      function: the simulated (possibly symmetry-reduced) program.
      op_start, op_finish: ``[N]`` seconds.
      op_devices: ``[N, K]`` original device of each op slot, -1 for none.
      op_streams: ``[N]`` stream of each op.
    """

    function: Function
    op_start: np.ndarray
    op_finish: np.ndarray
    op_devices: np.ndarray
    op_streams: np.ndarray


def simulate_config(
    config: Config, *, representative_only: bool = True, precision: str = "float64"
) -> SingleResult:
    """Builds, lowers and simulates one valid configuration, recording every op
    (``precision``: as :func:`~search.evaluate.evaluate` takes it).

    Raises:
      TypeError: when ``config`` is not a :class:`~search.space.Config`.
      ValueError: when the configuration is invalid (its reason) or cannot be built.
    """
    require_config("config", config)
    if not config.valid:
        raise ValueError(f"invalid configuration: {config.reason}")
    with in_precision(precision):
        from search._transform import build_function

        fn = build_function(config, config.global_batch_size, representative_only=representative_only)
        topology = config.topology()
        prepared = compact(lower(fn, topology), topology)
        program, hardware = stack_rows([(prepared, 0)], prepared.capacity, 1)
        # On the host: the compiled kernel's numbers bit for bit, without compiling it for one row.
        out, (op_start, op_finish) = simulate_on_host(program, hardware)
        row = _row(config, prepared, 0, {k: v[0] for k, v in out.items()}, "exact")  # the fine program
        n = int(prepared.program.num_ops)
        return SingleResult(
            row=row,
            function=fn,
            devices=prepared.devices,
            peak_memory_bytes=prepared.peak_bytes[0],
            simulated=_simulated(prepared),
            resident_bytes=prepared.resident_bytes(0),
            op_start=np.asarray(op_start[0, :n], np.float64),
            op_finish=np.asarray(op_finish[0, :n], np.float64),
            op_devices=_op_devices(prepared),
            op_streams=np.asarray([op.stream for op in fn.ops]),
        )


def summarize_config(config: Config, *, engine: str = "fast", precision: str = "float64") -> ConfigSummary:
    """One valid configuration's row and peak memory per device, as a sweep of it gives them.

    ``engine="fast"`` (the sweep's default) prepares the coarse program the
    fast engine sweeps (milliseconds to a second, GPT-3 175B included; the same
    numbers as the exact engine, tested against the reference simulator).
    Where the fast engine does not model the configuration, and with
    ``engine="exact"``, this is :func:`simulate_config` on the fine program
    (seconds, minutes for GPT-3-sized pipelines). The row's ``engine`` says
    which ran. ``precision``: as :func:`~search.evaluate.evaluate` takes it.

    Raises:
      TypeError: when ``config`` is not a :class:`~search.space.Config`.
      ValueError: when the configuration is invalid (its reason), or ``engine`` is unknown.
    """
    from search._fast import FastEngine, fast_unsupported
    from search.evaluate import evaluate

    _require_valid(config, engine)
    prepared = None
    if engine == "fast" and not fast_unsupported(config):
        prepared = FastEngine([config]).prepare([config])  # None: no coarse program expresses it
    if prepared is None:
        return simulate_config(config, precision=precision)
    # The row from a sweep of this one configuration: its steady-state
    # certificate and retries included. The peaks do not depend on those.
    row = evaluate([config], progress=False, engine="fast", precision=precision).row(0)
    _, ready, variant, _ = prepared[0]
    if ready is None:  # the row is invalid, with the reason the preparation gave
        return ConfigSummary(row, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool), np.zeros(0))
    return ConfigSummary(
        row, ready.devices, ready.peak_bytes[variant], _simulated(ready), ready.resident_bytes(variant)
    )


def config_elasticities(config: Config, *, engine: str = "fast", fields=None) -> dict[str, float]:
    """What each hardware figure of its preset is worth to one valid configuration:
    ``d log(step time) / d log(figure)`` (see :mod:`distir_jax.sensitivity`).

    ``engine="fast"`` differentiates the fast engine's coarse program at full
    length (its fine ops' roofline sides fixed where the preset puts them: the
    fine program's derivative wherever no op sits exactly on its roofline's
    ridge; a GPT-3 175B pipeline takes 2-3 s, compile included); ``"exact"``, and rows
    the fast engine does not model, the fine program (one replica of each
    symmetric group; minutes for GPT-3-sized pipelines). ``fields``: as
    :func:`~distir_jax.sensitivity.step_time_elasticities` takes them.

    Returns:
      ``{field: elasticity}``: speeds (peak FLOP/s, memory and link bandwidth)
      negative or 0, times (link latency, launch overhead) positive or 0; the
      speeds' minus the times' add up to -1.

    Raises:
      TypeError: when ``config`` is not a :class:`~search.space.Config`.
      ValueError: when the configuration is invalid (its reason), ``engine``
        is unknown, or a field is not a hardware figure.
    """
    from distir_jax.sensitivity import step_time_elasticities
    from search._fast import FastEngine, fast_unsupported

    _require_valid(config, engine)
    program = None
    if engine == "fast" and not fast_unsupported(config):
        try:
            program = FastEngine([config]).long_program(config)
        except SplitBlockError:  # no coarse program expresses it: the fine one then
            pass
    if program is None:
        program = fine_program(config)
    found = step_time_elasticities([program], config.topology(), fields)
    return {field: float(values[0]) for field, values in found.items()}


def _require_valid(config: Config, engine: str) -> None:
    """Raises as :func:`summarize_config` says: a TypeError for what is not a
    Config, a ValueError for an unknown engine or an invalid configuration."""
    from search._fast import ENGINES

    require_config("config", config)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not config.valid:
        raise ValueError(f"invalid configuration: {config.reason}")


def fine_program(config: Config):
    """The lowered fine training program of a valid configuration (one replica of
    each symmetric group), as the exact engine builds it."""
    from search._transform import build_function

    fn = build_function(config, config.global_batch_size, representative_only=True)
    return lower(fn, config.topology())


def require_config(name: str, value) -> None:
    """Raises a TypeError naming argument ``name`` unless ``value`` is one :class:`Config`."""
    if not isinstance(value, Config):
        raise _not_configs(name, "a search.Config", value, "one of its rows")


def require_configs(name: str, values) -> list:
    """``values`` as a list of :class:`Config`; a TypeError names ``name`` (or the
    entry ``name[i]``) when it is not a sequence of them."""
    if isinstance(values, (Config, StrategySpace, str, Mapping)) or not isinstance(values, Iterable):
        raise _not_configs(name, "a sequence of search.Config", values, "its rows")
    values = list(values)
    for i, value in enumerate(values):
        require_config(f"{name}[{i}]", value)
    return values


def _not_configs(name: str, expected: str, value, rows: str) -> TypeError:
    what = type(value).__name__
    if isinstance(value, StrategySpace):
        what = f"a StrategySpace ({rows}: list(enumerate_configs(space)))"
    return TypeError(f"{name} must be {expected} (from make_config or enumerate_configs), got {what}")


def _op_devices(prepared) -> np.ndarray:
    """``[N, K]`` the cluster's device of each op slot of a compacted program, -1 for none."""
    slots = np.asarray(prepared.program.slot_device)
    return np.where(slots >= 0, prepared.devices[np.maximum(slots, 0)], -1)


def _simulated(prepared) -> np.ndarray:
    """``[D']`` whether any op of a compacted program runs on each of its devices."""
    slots = np.asarray(prepared.program.slot_device)
    return np.isin(np.arange(len(prepared.devices)), slots[slots >= 0])


def chrome_trace(result: SingleResult) -> dict:
    """A Chrome trace (``chrome://tracing`` / Perfetto) of the fine program: one
    complete event per op per device.

    Times are microseconds; ``pid`` is the device, ``tid`` the stream.
    """
    events = []
    for i, op in enumerate(result.function.ops):
        args = {"op": i, "outputs": [v.name for v in op.outputs]}
        for key in ("layer", "phase", "stage", "microbatch"):
            if op.attr(key) is not None:
                args[key] = op.attr(key)
        for device in result.op_devices[i]:
            if device >= 0:
                events.append(
                    _event(
                        op.op_type,
                        str(op.attr("phase", "op")),
                        result.op_start[i],
                        result.op_finish[i],
                        device,
                        result.op_streams[i],
                        args,
                    )
                )
    return _trace(events, result.devices[result.simulated])


# A coarse op's event name and category, by its kind (coarse_pipeline.KIND_NAMES' order).
_COARSE_EVENTS = (
    ("forward", "compute"),
    ("backward", "compute"),
    ("send activation", "pipeline"),
    ("send gradient", "pipeline"),
    ("reduce gradients", "data parallel"),
    ("update", "data parallel"),
    ("all-gather", "data parallel"),
    ("sync LayerNorm gradients", "tensor parallel"),
)


def coarse_chrome_trace(config: Config, *, precision: str = "float64") -> dict:
    """A Chrome trace of the coarse program the fast engine simulates for ``config``,
    at full length (never a steady short program).

    An event is one pipeline step (a chunk's forward or backward of one
    microbatch; with gradient overlap, a segment of a chunk's last backward),
    message, gradient reduction, update or all-gather, on the first device of
    its stage (a send on both of its devices; the other devices of a stage
    are its replicas). Its args say its chunk, microbatch, stage and segment.
    Its latest end is the step time :func:`summarize_config` gives. A
    pipeline of GPT-3 175B takes about a second, where :func:`chrome_trace`
    of the fine program has an event per op (millions).

    Raises:
      TypeError: when ``config`` is not a :class:`~search.space.Config`.
      ValueError: when the configuration is invalid (its reason), or when the
        fast engine does not model it: then trace the fine program
        (:func:`simulate_config`, :func:`chrome_trace`).
    """
    from search._fast import FastEngine, fast_unsupported

    require_config("config", config)
    if not config.valid:
        raise ValueError(f"invalid configuration: {config.reason}")
    why = fast_unsupported(config)
    if why:
        raise ValueError(f"no coarse program for this configuration: {why}")
    try:
        prepared, template = FastEngine([config]).templated(config)
    except SplitBlockError as err:
        raise ValueError(f"no coarse program for this configuration: {err}") from None
    with in_precision(precision):
        program, hardware = stack_rows([(prepared, 0)], prepared.capacity, 1)
        _, (start, finish) = simulate_on_host(program, hardware)
    devices = _op_devices(prepared)
    named = {"chunk": template.chunk, "microbatch": template.microbatch, "stage": template.stage[:, 0]}
    if template.segment is not None:
        named["segment"] = template.segment
    events = []
    for i in range(template.num_ops):
        name, category = _COARSE_EVENTS[int(template.kind[i])]
        args = {"op": i} | {key: int(values[i]) for key, values in named.items() if values[i] >= 0}
        # A send's receiving end is on the receiver's stream 0 (coarse_pipeline.PipelineTemplate).
        for device, stream in zip(devices[i], (template.stream[i], 0), strict=True):
            if device >= 0:
                events.append(_event(name, category, start[0, i], finish[0, i], device, stream, args))
    return _trace(events, np.unique(devices[devices >= 0]))


def _event(name: str, category: str, start, finish, device, stream, args: dict) -> dict:
    """A complete event (``ph`` X), times in microseconds."""
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": float(start) * 1e6,
        "dur": float(finish - start) * 1e6,
        "pid": int(device),
        "tid": int(stream),
        "args": args,
    }


def _trace(events: list, devices) -> dict:
    """A trace of ``events``, each of ``devices`` named."""
    for device in devices:
        name = {"name": f"device {device}"}
        events.append({"name": "process_name", "ph": "M", "pid": int(device), "args": name})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SingleResult | dict, path: str | os.PathLike) -> None:
    """Writes :func:`chrome_trace` of ``result``, or a trace already made (a dict), as JSON."""
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result if isinstance(result, dict) else chrome_trace(result), f)


def make_config(
    model,
    *,
    hardware: str = "dgx-a100-80gb",
    world_size: int | None = None,
    batch_size: int = 8,
    seq_len: int | None = None,
    data: int = 1,
    tensor: int = 1,
    pipeline: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    recompute: str = "none",
    zero: bool = False,
    sequence_parallel: bool = False,
    overlap_grad_comm: bool = False,
    dtype: str | None = None,
    training_precision: str | None = None,
    optimizer: str = "sgd",
) -> Config:
    """One :class:`Config` from explicit knobs (invalid ones carry their reason).

    ``world_size`` defaults to ``data * tensor * pipeline``.

    Raises:
      ValueError: naming the argument, for a value of the wrong type or out of
        range (``model`` None, ``data`` 0, an unknown ``schedule``, ...), or
        degrees whose product is not ``world_size``.
    """
    from search.space import (
        MAX_WORLD_SIZE,
        OPTIMIZERS,
        RECOMPUTE,
        SCHEDULES,
        StrategySpace,
        enumerate_configs,
    )

    # This function's own arguments, by their names (not the space's plural knobs).
    if model is None or not isinstance(model, (str, MLPConfig, TransformerConfig)):
        raise ValueError(
            "model must be a model preset name (distir_jax.models.model_names) or an MLPConfig / "
            f"TransformerConfig, got {model!r}"
        )
    for name, value in (
        ("data", data),
        ("tensor", tensor),
        ("pipeline", pipeline),
        ("microbatches", microbatches),
        ("batch_size", batch_size),
        ("virtual_stages", virtual_stages),
    ):
        _check_int(name, value)
    _check_int("world_size", world_size, allow_none=True)
    _check_int("seq_len", seq_len, allow_none=True)
    for name, value, allowed in (
        ("schedule", schedule, SCHEDULES),
        ("recompute", recompute, RECOMPUTE),
        ("optimizer", optimizer, OPTIMIZERS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    for name, value in (("hardware", hardware), ("dtype", dtype), ("training_precision", training_precision)):
        if not (isinstance(value, str) or (name != "hardware" and value is None)):
            allowed = (
                "a preset name (distir_jax.presets.preset_names)" if name == "hardware" else "None or a str"
            )
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
    for name, value in (
        ("zero", zero),
        ("sequence_parallel", sequence_parallel),
        ("overlap_grad_comm", overlap_grad_comm),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    product = data * tensor * pipeline
    if world_size is not None and product != world_size:
        raise ValueError(
            f"data x tensor x pipeline = {data} x {tensor} x {pipeline} = {product} "
            f"does not equal world size {world_size}"
        )
    if (world_size or product) > MAX_WORLD_SIZE:
        name = "world_size" if world_size is not None else "data x tensor x pipeline"
        raise ValueError(
            f"{name} must be at most MAX_WORLD_SIZE = {MAX_WORLD_SIZE} GPUs, got {world_size or product}"
        )
    space = StrategySpace(
        model=model,
        world_sizes=(world_size or product,),
        global_batch_sizes=(batch_size,),
        seq_len=seq_len,
        data=(data,),
        tensor=(tensor,),
        pipeline=(pipeline,),
        microbatches=(microbatches,),
        microbatches_without_pipeline=(microbatches,),
        schedules=(schedule,),
        virtual_stages=(virtual_stages,),
        recompute=(recompute,),
        zero=(zero,),
        sequence_parallel=(sequence_parallel,),
        overlap_grad_comm=(overlap_grad_comm,),
        dtype=dtype,
        training_precision=training_precision,
        hardware=(hardware,),
        optimizer=(optimizer,),
    )
    config = next(enumerate_configs(space))  # degrees whose product is the world size: one row
    if training_precision not in (None, "full") and config.dtype not in HALF_DTYPES:
        # A space applies it to the bf16 / f16 rows it has; one configuration would drop it silently.
        raise ValueError(
            f"training_precision={training_precision!r} chooses how a bf16 / f16 model trains; "
            f"{config.dtype} models train in full precision: give dtype bf16 or f16, or no training_precision"
        )
    return config


def _check_int(name: str, value, allow_none: bool = False) -> None:
    """Raises a ValueError naming ``name`` unless ``value`` is an int >= 1 (or None, if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "None or an int >= 1" if allow_none else "an int >= 1"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
