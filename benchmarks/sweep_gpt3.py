"""GPT-3 175B on 64 A100-80GB GPUs: the whole hybrid-parallel strategy space, end to end.

The issue's benchmark (b): GPT-3 175B training (global batch 1024, sequence
2048) on ``get_preset("dgx-a100-80gb:64")``, over every tensor x pipeline x
data factorisation of 64, every microbatch size dividing the per-replica
batch, every interleaving degree dividing ``layers / pipeline``, activation
recomputation none / attention / full, ZeRO on / off and gradient overlap on /
off (the last two only with data parallelism, where they mean something).
Every configuration is a full 1F1B (or interleaved 1F1B) timeline of a coarse
pipeline program (:mod:`distir_jax.transforms.coarse`), simulated by the
batched kernel.

End to end means: enumerate the space, measure one fine transformer block per
(tensor degree, recompute policy), build one program template per structural
key, fill every configuration's tables, then simulate in batched kernel
calls. One compiled kernel serves every call: it runs 128 rows (configurations
of similar program length) ``_OP_CHUNK`` ops at a time, carrying the timeline
from slice to slice (:func:`distir_jax.kernel.run_ops`), and expands each
row's ops from its template inside the jitted call. It compiles in a
background thread while the host builds tables. Peak memory needs no
timeline: the host computes it per template, vectorized over its rows.

    python benchmarks/sweep_gpt3.py            # the whole space
    python benchmarks/sweep_gpt3.py --quick    # a deterministic subsample, < 40 s
    python benchmarks/sweep_gpt3.py --fit-only # timelines only where memory fits
    python benchmarks/sweep_gpt3.py --quick --check-steady  # also at full length, compared
    python benchmarks/sweep_gpt3.py --no-steady             # every pipeline at full length

The space has 10,458 configurations (1,306 structural keys): the tensor degree
must divide the 96 heads (t <= 32), interleaving needs the microbatch count to
be a multiple of p, and p = 64 (which does not divide 96 layers) gets uneven
stages and no interleaving. A program has ``~4 k v p`` ops, up to ~4e5 for
1024 microbatches of one sample, ~1.1e8 in all. A long pipeline is simulated
as a short one (``p + 2`` microbatches for 1F1B, ``5p`` interleaved) whose
steady period stands for the rest (:mod:`distir_jax.transforms.coarse_steady`),
where that at least halves it: ~2.6e7 ops in all. The kernel runs in float64
here, so the period's certificate (every resource's clock moves by the same
amount) holds to ~1e-12; a row that fails it is simulated at full length.
Where the time goes on a 2-core CPU (~10 s in all): the host measuring
blocks and filling chunk tables (~2.5 s), steady templates (~1 s), then
templates, tables and peak memory per call, overlapped with the kernel
(~1.3e-7 s per op-row at 128 rows; calls are asynchronous).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from distir_jax.cost import COST_FEATURES
from distir_jax.hardware import Hardware
from distir_jax.kernel import (
    STATUS_OK,
    STATUS_OUT_OF_MEMORY,
    conclude,
    hardware_rows,
    run_ops,
    start_timeline,
)
from distir_jax.lower import Program
from distir_jax.models import get_model_config
from distir_jax.presets import get_preset
from distir_jax.transforms.coarse import (
    balanced_layers,
    chunk_tables,
    data_mode,
    layer_features,
    pipeline_template,
    stage_devices,
    template_size,
)
from distir_jax.transforms.coarse_program import stage_peak_memory
from distir_jax.transforms.coarse_steady import extrapolate, steady_template, worth_it

MODEL = "gpt3-175b"
PRESET = "dgx-a100-80gb:64"
GLOBAL_BATCH = 1024
RECOMPUTE = ("none", "attention", "full")
# Fixed table sizes, so every kernel call of a bucket has one shape.
_MAX_STAGES = 64
_MAX_CHUNKS = 96
_COST_ROWS = 4 * _MAX_CHUNKS + 2 * _MAX_STAGES + 2  # the last row stays zero (padding ops)
_MEMORY_ROWS = 3 * _MAX_CHUNKS + _MAX_STAGES + 3
# Most resources one steady period uses (stream 0 of every stage, at most).
_PERIOD_RESOURCES = 2 * _MAX_STAGES
# Largest relative error the steady-state certificate's bound may allow (float64 kernel).
_STEADY_RTOL = 1e-9
# One compiled kernel serves the whole sweep: every call has these shapes. It
# runs its rows' programs _OP_CHUNK ops at a time (carrying the timeline), so
# programs of any length share it; rows are sorted by length into calls.
_OP_CHUNK = 512
_ROWS_PER_CALL = 128
_TEMPLATES_PER_CALL = 128
_MAX_SLOTS = 512  # finish slots (a template has at most ~n + 2p + a period's certificate)
_DEPS_PER_OP = 1


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the space."""

    tensor: int
    pipeline: int
    data: int
    microbatch_size: int
    microbatches: int
    virtual_stages: int
    recompute: str
    zero: bool
    overlap: bool

    @property
    def schedule(self) -> str:
        return "interleaved" if self.virtual_stages > 1 else "1f1b"

    @property
    def mode(self) -> str:
        return data_mode(self.data, self.overlap, self.zero)

    @property
    def structural_key(self) -> tuple:
        """What the program's structure depends on (besides device numbering)."""
        return (
            self.pipeline,
            self.microbatches,
            self.virtual_stages,
            self.schedule,
            self.zero,
            self.overlap,
            self.data > 1,
        )


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def enumerate_space(model, world: int = 64, global_batch: int = GLOBAL_BATCH) -> list[Config]:
    """Every valid configuration of benchmark (b), in a fixed order."""
    configs = []
    for t in _divisors(world):
        if model.num_heads % t or model.hidden % t or model.ffn_hidden % t:
            continue
        for p in _divisors(world // t):
            d = world // (t * p)
            if global_batch % d or p > model.num_layers:
                continue
            per_replica = global_batch // d
            for b in _divisors(per_replica):
                k = per_replica // b
                if p == 1 or model.num_layers % p:
                    interleave = [1]
                else:  # interleaved 1F1B enters microbatches in groups of p
                    interleave = [v for v in _divisors(model.num_layers // p) if v == 1 or k % p == 0]
                for v in interleave:
                    for rc in RECOMPUTE:
                        for zero in (False, True) if d > 1 else (False,):
                            for overlap in (False, True) if d > 1 else (False,):
                                configs.append(Config(t, p, d, b, k, v, rc, zero, overlap))
    return configs


def _template_arrays(template, steady=None) -> dict:
    """A template's per-op index arrays, cut into ``[chunks, _OP_CHUNK, ...]`` slices
    of ops (padded past its end, packed: see :func:`_pack`), and each op's row of
    the memory tables. With ``steady`` (a
    :class:`~distir_jax.transforms.coarse_steady.SteadyTemplate`), also the
    period's finish slots: each resource's clock before and after it.
    """
    if template.num_slots > _MAX_SLOTS or template.dep_slot.shape[1] != _DEPS_PER_OP:
        raise ValueError(
            f"template {template.num_slots} finish slots / {template.dep_slot.shape[1]} deps per op: "
            f"the kernel is compiled for <= {_MAX_SLOTS} / {_DEPS_PER_OP}"
        )
    n, c = template.num_ops, _OP_CHUNK
    chunks = -(-n // c)
    cost_row, memory_row = template.rows
    ops = {}
    for name, value, fill in (
        ("cost_row", cost_row, -1),  # -1: the table's last row, all zeros
        ("stage", template.stage, -1),
        ("stream", template.stream, 0),
        ("link_kind", template.link_kind, 0),
        ("dep_slot", template.dep_slot, -1),
        ("out_slot", template.out_slot, -1),
    ):
        array = np.full((chunks * c,) + value.shape[1:], fill, np.int32)
        array[:n] = value
        ops[name] = array.reshape((chunks, c) + value.shape[1:])
    # Memory per op (-1: the tables' last row, all zeros), for stage_peak_memory.
    memory_row = np.where(memory_row >= 0, memory_row, _MEMORY_ROWS - 1)
    out = dict(ops=_pack(ops), memory_row=memory_row, template=template, steady=steady)
    out["period_before"] = np.full(_PERIOD_RESOURCES, -1, np.int32)
    out["period_after"] = np.full(_PERIOD_RESOURCES, -1, np.int32)
    if steady is not None:
        if len(steady.resources) > _PERIOD_RESOURCES:
            raise ValueError(f"a period uses {len(steady.resources)} resources, > {_PERIOD_RESOURCES}")
        out["period_before"][: len(steady.before)] = steady.before
        out["period_after"][: len(steady.after)] = steady.after
    return out


def _pack(arrays: dict) -> np.ndarray:
    """Per-op fields as one int32 array ``[..., C, 7]`` (one transfer per slice)."""
    column = lambda name: arrays[name].reshape(arrays[name].shape[:2] + (-1,))  # noqa: E731
    return np.concatenate([column(k) for k in _OP_KEYS], axis=-1)


def _unpack(ops) -> dict:
    """:func:`_pack`'s fields again, ``[..., C]`` (``stage [..., C, 2]``), inside jit."""
    return dict(
        cost_row=ops[..., 0],
        stage=ops[..., 1:3],
        stream=ops[..., 3],
        link_kind=ops[..., 4],
        dep_slot=ops[..., 5:6],
        out_slot=ops[..., 6],
    )


_OP_KEYS = ("cost_row", "stage", "stream", "link_kind", "dep_slot", "out_slot")


def _padding_slice() -> np.ndarray:
    """One slice of a template past its end: no ops (packed)."""
    c = _OP_CHUNK
    arrays = dict(
        cost_row=np.full(c, -1, np.int32),
        stage=np.full((c, 2), -1, np.int32),
        stream=np.zeros(c, np.int32),
        link_kind=np.zeros(c, np.int32),
        dep_slot=np.full((c, _DEPS_PER_OP), -1, np.int32),
        out_slot=np.full(c, -1, np.int32),
    )
    return _pack({k: v[None] for k, v in arrays.items()})[0]


def _expand_row(tmpl, tid, cost, device, tp_link, dp_link):
    """One configuration's slice of ops on real devices, and its features (inside jit)."""
    stage = tmpl["stage"][tid]  # [C, 2]
    s = jnp.maximum(stage, 0)
    slot_device = jnp.where(stage >= 0, device[s], -1)
    stream = jnp.stack([tmpl["stream"][tid], jnp.zeros_like(tmpl["stream"][tid])], axis=1)
    resource = jnp.where(stage >= 0, slot_device * 2 + stream, -1)
    kind = tmpl["link_kind"][tid][:, None]
    own = jnp.stack([slot_device[:, 0], slot_device[:, 0]], axis=1)
    link = jnp.where(
        kind == 1,
        tp_link[s[:, 0]],
        jnp.where(kind == 2, slot_device, jnp.where(kind == 3, dp_link[s[:, 0]], own)),
    )
    return resource, slot_device, link, cost[tmpl["cost_row"][tid]]


def _begin_call(rows, hardware):
    num_rows, num_devices = rows["tid"].shape[0], hardware.peak_flops.shape[-1]
    state = start_timeline(2 * num_devices, _MAX_SLOTS, num_rows)
    return state, hardware_rows(hardware, per_config_structure=True)


def _advance_call(state, rates, rows, ops):
    """One slice of every row's ops, expanded from its template."""
    tmpl = _unpack(ops)
    tid = rows["tid"]
    resource, slot_device, link, features = jax.vmap(functools.partial(_expand_row, tmpl))(
        tid, rows["cost"], rows["device"], rows["tp_link"], rows["dp_link"]
    )
    num_rows, n = features.shape[:2]
    zeros = jnp.zeros((num_rows, n), features.dtype)  # coarse ops have no roofline part left
    placeholder = jnp.zeros((1, 1))
    program = Program(
        resource=resource.astype(jnp.int32),
        slot_device=slot_device.astype(jnp.int32),
        dep_slot=tmpl["dep_slot"][tid],
        out_slot=tmpl["out_slot"][tid],
        link=link.astype(jnp.int32),
        is_comm=jnp.zeros(n, bool),
        resource_device=jnp.zeros(state.clock.shape[0], jnp.int32),  # not read; its size is
        num_ops=jnp.full(num_rows, n, jnp.int32),
        alloc_bytes=placeholder,
        free_bytes=placeholder,
        resident_bytes=placeholder,
        peak_bytes=placeholder,
        num_finish_slots=_MAX_SLOTS,
        **{
            name: (zeros if name in ("flops", "mem_bytes") else features[..., i])
            for i, name in enumerate(COST_FEATURES)
        },
    )
    return run_ops(state, program, rates)[0]


def _end_call(state, rows, hardware):
    """Step time (a steady row's long program's, from the clocks around its period),
    status (with the stages' peak bytes, computed on the host) and whether the period is certified."""
    num_devices = hardware.peak_flops.shape[-1]
    on_device = jnp.where(rows["device"] >= 0, rows["device"], num_devices)
    scatter = jax.vmap(lambda where, x: jnp.zeros(num_devices).at[where].set(x, mode="drop"))
    result = conclude(state, scatter(on_device, rows["stage_peak"]), hardware)
    step_time, certified = extrapolate(
        result.finish_slots,
        rows["period_before"],
        rows["period_after"],
        rows["periods"],
        result.step_time,
        _STEADY_RTOL,
        xp=jnp,
    )
    return step_time, result.status, certified


class _Kernel:
    """The compiled call, one shape for the whole sweep (compiled in a background thread
    from the start: XLA releases the GIL, so the host meanwhile builds tables)."""

    def __init__(self, hardware):
        self.future = _COMPILER.submit(self._compile, hardware)

    @staticmethod
    def _compile(hardware):
        with jax.enable_x64(True):  # a `with` does not reach other threads
            rows = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _empty_rows(_ROWS_PER_CALL).items()}
            pad = _padding_slice()
            ops = jax.ShapeDtypeStruct((_TEMPLATES_PER_CALL,) + pad.shape, pad.dtype)
            hw = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.float64), hardware)
            state, rates = jax.eval_shape(_begin_call, rows, hw)
            return (
                jax.jit(_begin_call).lower(rows, hw).compile(),
                jax.jit(_advance_call).lower(state, rates, rows, ops).compile(),
                jax.jit(_end_call).lower(state, rows, hw).compile(),
            )

    def __call__(self, rows, slices, hardware):
        """Issues one call (asynchronously); ``slices`` yields its templates' slices of ops."""
        begin, advance, end = self.future.result()
        rows = jax.device_put(rows)
        state, rates = begin(rows, hardware)
        for ops in slices:
            state = advance(state, rates, rows, jax.device_put(ops))
        return end(state, rows, hardware)


_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sweep-gpt3-compile")


def _subsample(configs: list, every: int) -> list:
    """Every ``every``-th configuration, in order: all degrees, sizes and options stay represented."""
    return configs[::every]


class _Rows:
    """Each configuration's small tables, from chunk tables cached per
    (tensor, recompute, pipeline, interleaving, data, ZeRO, mode), written
    into kernel-call rows a table at a time."""

    def __init__(self, model, topology, configs):
        self.model, self.topology, self.configs = model, topology, configs
        sizes: dict[int, set] = {}
        for c in configs:
            sizes.setdefault(c.tensor, set()).add(c.microbatch_size)
        self.sizes = {t: sorted(s) for t, s in sizes.items()}
        self.keys: dict[tuple, int] = {}
        self.tables: list = []
        key, variant, data = [], [], []
        for c in configs:
            k = (c.tensor, c.recompute, c.pipeline, c.virtual_stages, c.data, c.zero, c.mode)
            key.append(self.keys.setdefault(k, len(self.keys)))
            variant.append(self.sizes[c.tensor].index(c.microbatch_size))
        self.key, self.variant = np.asarray(key), np.asarray(variant)
        self.layout = {}  # key -> (p, first-chunk stage, last-chunk stage, devices)
        for k, i in self.keys.items():
            t, rc, p, v, d, zero, mode = k
            features = self.features(t, rc)
            tables = chunk_tables(
                features, balanced_layers(features, p * v), p, 0, data=d, zero=zero, mode=mode
            )
            self.tables.append((tables, features.data_bytes))
            self.layout[i] = (p, (p * v - 1) % p, stage_devices(topology, p, t, d))
        for c, i in zip(configs, key, strict=True):
            data.append(c.microbatches * self.tables[i][1][self.sizes[c.tensor].index(c.microbatch_size)])
        self.data = np.asarray(data)  # tokens (and labels) of every microbatch

    def features(self, tensor: int, recompute: str):
        return layer_features(self.model, tensor, recompute, self.sizes[tensor], self.topology)

    def fill(self, ids: np.ndarray, out: dict) -> None:
        """Writes configurations ``ids`` into rows ``0..len(ids)-1`` of ``out``."""
        keys = self.key[ids]
        for k in np.unique(keys):
            rows = np.flatnonzero(keys == k)
            tables, _ = self.tables[k]
            variants = self.variant[ids[rows]]
            p, last, (device, tp_link, dp_link) = self.layout[k]
            out["cost"][rows, : tables.cost.shape[1]] = tables.cost[variants]
            out["alloc"][rows, : tables.alloc.shape[1]] = tables.alloc[variants]
            out["free"][rows, : tables.free.shape[1]] = tables.free[variants]
            out["resident"][rows, :p] = tables.resident[variants]
            out["resident"][rows, 0] += self.data[ids[rows]]
            out["resident"][rows, last] += self.data[ids[rows]]
            out["device"][rows, :p] = device
            out["tp_link"][rows, :p] = tp_link
            out["dp_link"][rows, :p] = dp_link


def _empty_rows(num_rows: int) -> dict:
    return dict(
        tid=np.zeros(num_rows, np.int32),
        periods=np.zeros(num_rows, np.float64),
        cost=np.zeros((num_rows, _COST_ROWS, len(COST_FEATURES)), np.float64),
        alloc=np.zeros((num_rows, _MEMORY_ROWS, 2), np.float64),
        free=np.zeros((num_rows, _MEMORY_ROWS, 2), np.float64),
        resident=np.zeros((num_rows, _MAX_STAGES), np.float64),
        device=np.full((num_rows, _MAX_STAGES), -1, np.int32),
        tp_link=np.zeros((num_rows, _MAX_STAGES, 2), np.int32),
        dp_link=np.zeros((num_rows, _MAX_STAGES, 2), np.int32),
        period_before=np.full((num_rows, _PERIOD_RESOURCES), -1, np.int32),
        period_after=np.full((num_rows, _PERIOD_RESOURCES), -1, np.int32),
        stage_peak=np.zeros((num_rows, _MAX_STAGES), np.float64),
    )


def _calls(ids, template_of, size_of) -> list[np.ndarray]:
    """Configuration ids of each kernel call: longest programs first, so a call's
    rows have similar lengths (little padded work); at most ``_ROWS_PER_CALL``
    rows and ``_TEMPLATES_PER_CALL`` templates per call."""
    ids = sorted(ids, key=lambda i: (-size_of[i], template_of[i]))
    calls, current, used = [], [], set()
    for i in ids:
        if len(current) == _ROWS_PER_CALL or (
            template_of[i] not in used and len(used) == _TEMPLATES_PER_CALL
        ):
            calls.append(np.asarray(current))
            current, used = [], set()
        current.append(i)
        used.add(template_of[i])
    if current:
        calls.append(np.asarray(current))
    return calls


def _run(calls, template_of, rows: _Rows, kernel: _Kernel | None, hardware, short: dict, periods):
    """Builds templates on first use, fills every call and issues it; returns
    ``[(ids, stage peaks, result)]`` (no result without a ``kernel``: peaks only).

    Calls run asynchronously, so building the next templates, slices and peaks
    on the host overlaps the kernel running the previous ones. ``short`` maps
    the keys of steady templates to their SteadyTemplate; ``periods`` gives
    each configuration's extra periods (0 for a long template).
    """
    templates, pad = {}, _padding_slice()
    issued = []
    for ids in calls:
        used = list(dict.fromkeys(template_of[i] for i in ids))
        for key in used:
            if key not in templates:
                template = short[key].template if key in short else pipeline_template(*key[:5])
                templates[key] = _template_arrays(template, short.get(key))
        arrays = [templates[key] for key in used]
        out = _empty_rows(_ROWS_PER_CALL)
        index = {key: u for u, key in enumerate(used)}
        tid = out["tid"][: len(ids)] = [index[template_of[i]] for i in ids]
        out["periods"][: len(ids)] = periods[ids]
        out["period_before"][: len(ids)] = [arrays[t]["period_before"] for t in tid]
        out["period_after"][: len(ids)] = [arrays[t]["period_after"] for t in tid]
        rows.fill(ids, out)
        for t, a in enumerate(arrays):  # peak memory needs no timeline: the product's rule, per template
            members = np.flatnonzero(out["tid"][: len(ids)] == t)
            out["stage_peak"][members] = stage_peak_memory(
                a["template"],
                out["alloc"][members],
                out["free"][members],
                out["resident"][members],
                a["steady"],
                extra_periods=out["periods"][members],
                table_rows=a["memory_row"],
            )
        for name in out:  # padding rows repeat the first
            out[name][len(ids) :] = out[name][0]
        peaks = out["stage_peak"][: len(ids)].max(axis=1)
        if kernel is None:
            issued.append((ids, peaks, None))
            continue
        chunks = max(len(a["ops"]) for a in arrays)
        slices = (
            np.stack(
                [a["ops"][j] if j < len(a["ops"]) else pad for a in arrays]
                + [pad] * (_TEMPLATES_PER_CALL - len(arrays))
            )
            for j in range(chunks)
        )
        issued.append((ids, peaks, kernel(out, slices, hardware)))
    return issued


def gpt3_configs_per_second(
    quick: bool, *, fit_only: bool = False, steady: bool = True, verbose: bool = True
) -> dict:
    """Simulates benchmark (b)'s space end to end and measures configurations per second.

    Args:
      quick: simulate every 8th configuration only (well under 40 s).
      fit_only: compute every configuration's peak memory first and simulate
        the timelines of those that fit only (out-of-memory ones are decided
        by memory alone). The default simulates every configuration's timeline.
      steady: simulate a long 1F1B / interleaved pipeline as a short one whose
        steady period stands for the rest (:mod:`~distir_jax.transforms.coarse_steady`;
        rows whose short run does not certify the period are simulated long).
      verbose: print the size of the space and of the sample once enumerated.

    Returns:
      A dict: ``configs`` evaluated, ``space_configs`` in the whole space,
      ``structural_keys`` and ``templates`` among them, ``ops`` (sum of their
      program sizes as simulated), ``simulated`` timelines, ``steady`` (of
      them from a short template), ``uncertified`` (short runs redone long),
      ``fit`` (within memory), ``seconds`` end to end, ``configs_per_second``,
      ``calls`` (kernel calls), ``best`` (the fastest fitting
      configuration, its step time and peak memory), ``phases`` (seconds per
      phase), and per configuration ``step_time``, ``peak`` and ``status``.
    """
    # float64: the steady certificate compares clock shifts to ~1e-9 relative.
    with jax.enable_x64(True):
        return _gpt3(quick, fit_only, steady, verbose)


def _gpt3(quick: bool, fit_only: bool, steady: bool, verbose: bool) -> dict:
    begin = time.perf_counter()
    phases = {}
    topology = get_preset(PRESET)
    model = get_model_config(MODEL, dtype="bf16")
    everything = enumerate_space(model, topology.num_devices, GLOBAL_BATCH)
    configs = _subsample(everything, 8) if quick else everything
    if verbose:
        keys = len({c.structural_key for c in everything})
        print(
            f"GPT-3 175B on {PRESET}: {len(everything)} configurations, {keys} structural keys; "
            f"evaluating {len(configs)}",
            flush=True,
        )
    # The kernel's shapes are fixed: it compiles (in the background) while the host builds tables.
    hardware = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), Hardware.from_topology(topology))
    kernel = _Kernel(hardware)
    rows = _Rows(model, topology, configs)
    phases["features"] = time.perf_counter() - begin
    tick = time.perf_counter()
    # Kernel templates: (p, k, v, schedule, mode, short); a short one stands for longer k.
    long_of = [(c.pipeline, c.microbatches, c.virtual_stages, c.schedule, c.mode) for c in configs]
    steady_of = {key: steady_template(*key) if steady and worth_it(*key) else None for key in set(long_of)}
    short, template_of = {}, []
    periods = np.zeros(len(configs))
    for i, key in enumerate(long_of):
        found = steady_of[key]
        if found is None:
            template_of.append(key + (False,))
            continue
        kernel_key = (key[0], found.template.microbatches) + key[2:] + (True,)
        short[kernel_key] = found
        template_of.append(kernel_key)
        periods[i] = found.extra_periods
    steady_rows = int((periods > 0).sum())
    phases["steady templates"] = time.perf_counter() - tick
    tick = time.perf_counter()
    step_time = np.full(len(configs), np.inf)
    status = np.full(len(configs), -1, np.int64)
    peak = np.full(len(configs), np.nan)
    capacity = float(topology.memory_capacity.max())

    def size(i):  # ops of a configuration's kernel template
        key = template_of[i]
        return short[key].template.num_ops if key in short else template_size(*key[:3], key[4])[0]

    todo = list(range(len(configs)))
    if fit_only:
        calls = _calls(todo, template_of, {i: size(i) for i in todo})
        for ids, peaks, _ in _run(calls, template_of, rows, None, hardware, short, periods):
            peak[ids] = peaks
        todo = [i for i in todo if peak[i] <= capacity]
        status[peak > capacity] = STATUS_OUT_OF_MEMORY
        phases["memory"] = time.perf_counter() - tick
        tick = time.perf_counter()

    def simulate_ids(ids):
        """Simulates configurations ``ids``; returns those whose period was not certified."""
        calls = _calls(ids, template_of, {i: size(i) for i in ids})
        redo = []
        for members, peaks, result in _run(calls, template_of, rows, kernel, hardware, short, periods):
            times, codes, certified = (x[: len(members)] for x in jax.device_get(result))
            step_time[members], status[members], peak[members] = times, codes, peaks
            redo += [int(i) for i in members[~certified]]
        return len(calls), redo

    num_calls, redo = simulate_ids(todo)
    simulated_ops = sum(size(i) for i in todo)
    phases["simulate"] = time.perf_counter() - tick
    if redo:  # short runs whose period had not settled: the long templates
        tick = time.perf_counter()
        for i in redo:
            template_of[i], periods[i] = long_of[i] + (False,), 0
        simulated_ops += sum(size(i) for i in redo)
        simulate_ids(redo)
        phases["uncertified, long"] = time.perf_counter() - tick
    total = time.perf_counter() - begin
    fit = status == STATUS_OK
    best = int(np.argmin(np.where(fit, step_time, np.inf))) if fit.any() else None
    return dict(
        configs=len(configs),
        space_configs=len(everything),
        structural_keys=len({c.structural_key for c in configs}),
        templates=len(set(template_of)),
        ops=int(simulated_ops),
        simulated=len(todo),
        steady=steady_rows,
        uncertified=len(redo),
        fit=int(fit.sum()),
        seconds=total,
        configs_per_second=len(configs) / total,
        calls=num_calls,
        best=None
        if best is None
        else dict(
            dataclasses.asdict(configs[best]),
            step_time_s=float(step_time[best]),
            peak_memory_gb=float(peak[best]) / 1e9,
            samples_per_s=GLOBAL_BATCH / float(step_time[best]),
        ),
        phases=phases,
        step_time=step_time,
        peak=peak,
        status=status,
    )


def product_configs_per_second(quick: bool) -> dict:
    """The same sweep through the product, ``search.evaluate`` (fast engine, exact overlap).

    The space is the equivalent ``StrategySpace``; its valid rows are evaluated
    (every 8th with ``quick``). The product's validity rules differ a little
    from :func:`enumerate_space`'s (11,250 valid rows against 10,458: it
    allows interleaved chunks of uneven sizes, and without a pipeline runs
    one microbatch per replica), so the counts differ. Returns ``configs``, ``seconds``,
    ``configs_per_second`` and ``ok`` (rows that fit in memory).
    """
    from search import StrategySpace, enumerate_configs, evaluate

    space = StrategySpace(
        model=MODEL,
        world_sizes=(64,),
        global_batch_sizes=(GLOBAL_BATCH,),
        microbatch_sizes=tuple(_divisors(GLOBAL_BATCH)),
        schedules=("1f1b", "interleaved"),
        virtual_stages=tuple(v for v in _divisors(96) if v > 1),
        recompute=RECOMPUTE,
        zero=(False, True),
        overlap_grad_comm=(False, True),
        dtype="bf16",
        hardware=PRESET.split(":")[0],
        optimizer="adam",  # as layer_features' default, which the rest of this benchmark uses
    )
    begin = time.perf_counter()
    configs = [c for c in enumerate_configs(space) if c.valid]
    configs = _subsample(configs, 8) if quick else configs
    table = evaluate(configs, progress=False)
    seconds = time.perf_counter() - begin
    return dict(
        configs=len(configs),
        seconds=seconds,
        configs_per_second=len(configs) / seconds,
        ok=int((table["status"] == "ok").sum()),
    )


def _set_rows_per_call(rows: int) -> None:
    """Kernel calls of ``rows`` configurations (and up to as many templates, at most 512)."""
    global _ROWS_PER_CALL, _TEMPLATES_PER_CALL
    if rows < 1:
        raise SystemExit(f"--rows-per-call must be >= 1, got {rows}")
    _ROWS_PER_CALL, _TEMPLATES_PER_CALL = rows, min(rows, 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every 8th configuration only")
    parser.add_argument(
        "--fit-only", action="store_true", help="simulate fitting configurations' timelines only"
    )
    parser.add_argument("--no-steady", action="store_true", help="simulate every pipeline at its full length")
    parser.add_argument(
        "--check-steady",
        action="store_true",
        help="also simulate every pipeline at full length and compare (slow)",
    )
    parser.add_argument(
        "--rows-per-call",
        type=int,
        default=_ROWS_PER_CALL,
        help=f"configurations per kernel call (default {_ROWS_PER_CALL}: a CPU; accelerators: thousands)",
    )
    parser.add_argument(
        "--product",
        action="store_true",
        help="also run the space through search.evaluate (the product's engine, exact overlap)",
    )
    args = parser.parse_args()
    _set_rows_per_call(args.rows_per_call)
    print(f"# {platform.node()} {platform.machine()} jax {jax.__version__} devices={jax.devices()}")
    print(f"# rows/call {_ROWS_PER_CALL}, templates/call {_TEMPLATES_PER_CALL}, ops/slice {_OP_CHUNK}")
    r = gpt3_configs_per_second(args.quick, fit_only=args.fit_only, steady=not args.no_steady)
    print(
        f"space: {r['space_configs']} configurations; evaluated {r['configs']} ({r['structural_keys']} "
        f"structural keys, {r['templates']} templates, {r['ops']:.3g} coarse ops simulated); "
        f"{r['simulated']} timelines, {r['steady']} of them from a short steady template "
        f"({r['uncertified']} not certified, redone long); {r['calls']} kernel calls"
    )
    print("phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
    print(
        f"end to end: {r['seconds']:.2f} s, {r['configs_per_second']:.4g} configurations/s; "
        f"{r['fit']} fit in memory"
    )
    print(f"best: {r['best']}")
    if args.check_steady and not args.no_steady:
        full = gpt3_configs_per_second(args.quick, fit_only=args.fit_only, steady=False, verbose=False)
        both = np.isfinite(r["step_time"]) & np.isfinite(full["step_time"])
        rel = np.abs(r["step_time"] - full["step_time"]) / full["step_time"]
        print(
            f"check: full-length run {full['seconds']:.2f} s; step times agree to "
            f"{rel[both].max(initial=0):.2e} relative ({int(both.sum())} rows), peaks to "
            f"{np.nanmax(np.abs(r['peak'] - full['peak']) / full['peak']):.2e}, statuses "
            f"{'identical' if np.array_equal(r['status'], full['status']) else 'DIFFER'}"
        )
    if args.product:
        r = product_configs_per_second(args.quick)
        print(
            f"through search.evaluate: {r['configs']} valid configurations in {r['seconds']:.2f} s, "
            f"{r['configs_per_second']:.4g} configurations/s; {r['ok']} fit in memory",
            flush=True,
        )


if __name__ == "__main__":
    main()
