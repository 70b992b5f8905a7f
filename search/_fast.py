"""The fast engine: coarse pipeline programs generated as arrays, no IR per configuration.

The exact engine builds every structural key's program with the real
transforms (Python, ~0.1-0.3 ms per op: seconds per key for a pipeline of
many microbatches, minutes for GPT-3-sized programs). The fast engine instead
measures one fine block per (model, tensor degree, recompute policy,
optimizer, hardware, microbatch sizes) with
:func:`~distir_jax.transforms.coarse.layer_features` and fills a cached
:class:`~distir_jax.transforms.coarse.PipelineTemplate` per structural key
(:func:`~distir_jax.transforms.coarse.coarse_pipeline_program`): one op per
(chunk, microbatch, direction), one per message, a few per stage for data
parallelism. Building a key costs milliseconds.

How close it is: the same numbers as the exact engine (tests/test_search_fast.py
checks step time and peak memory to 1e-9 against the
reference simulator on the fine programs). The coarse ops fuse each step's
fine ops on the reference hardware (exact there: see
:mod:`distir_jax.transforms.coarse_fuse`), the issue order is the pipeline
transform's own (from the same ``1 + flops`` estimates), and the memory
events are the fine block's, replayed per pass (forward, first and later
backward, a received input's last read, each gradient's reduction).

With gradient overlap, each chunk's last backward is cut after every weight
gradient and each gradient's all-reduce (ZeRO: reduce-scatter) follows its
segment on stream 1, as the data-parallel transform issues them; with ZeRO the
updates and all-gathers then run weight by weight
(:mod:`distir_jax.transforms.coarse_segments`).

A long 1F1B or interleaved pipeline is prepared as a short program whose
steady period stands for the rest
(:func:`~distir_jax.transforms.coarse.steady_pipeline_program`): kernel
time then stops growing with the microbatch count. Its order comes from the
pipeline transform's step costs, so its template is first checked op for op
against the long template (built, not simulated; see
:mod:`~distir_jax.transforms.coarse_steady`); its kernel call extrapolates and
certifies it (see :mod:`search.evaluate`).

Under tensor parallelism an MLP's blocks are (column, row) layer pairs. Where
the pipeline transform's stages split a pair, the key is prepared from
features measured per layer instead (``layer_features(..., per_layer=True)``,
see :mod:`distir_jax.transforms.coarse_layers`): chunks are layer ranges, and
a message after a column layer is its Relu output's feature shard. Such keys
with interleaved stages run their long programs (no steady short one).

Under Megatron sequence parallelism (GPTs) the blocks are measured with it:
messages are ``1 / t`` of the sequence, and each LayerNorm gradient's in-place
tensor-group sync runs before its update (after the data-parallel reductions,
Megatron-LM's order): with gradient overlap or without data parallelism
inside the update, costed on the tensor group's link; without overlap as an
op of its own per stage (mode ``"sync_tp"``), since that update all-reduces
over the data-parallel group.

Rows the fast engine does not model (other models, sequence parallelism in
an MLP, an MLP of one layer pair or of an odd number of layers under tensor
parallelism, an MLP of one layer) fall back to the exact engine; the
``engine`` column says which one ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from distir_jax.ir import Topology, registered_op_types
from distir_jax.lower import Program
from distir_jax.models import MLPConfig, TransformerConfig
from distir_jax.transforms.coarse import (
    PipelineTemplate,
    SplitBlockError,
    layer_features,
    steady_pipeline_program,
    templated_pipeline_program,
    transform_layers_per_chunk,
    transform_step_costs,
)
from distir_jax.transforms.coarse_steady import short_candidates
from distir_jax.transforms.data_parallel import zero_shard_problem
from search._programs import Prepared, compact
from search._transform import parallel_config
from search.space import HARDWARE_DTYPE, Config, _topology

ENGINES = ("exact", "fast")

# Every sweep measures fine blocks, which reads the op registry: load its
# definitions with the engine, not inside the first sweep (they load lazily).
registered_op_types()


def fast_unsupported(config: Config) -> str:
    """Why the fast engine cannot simulate ``config`` (then the exact engine does), or ``""``.

    Not modelled: models other than GPTs and MLPs, sequence parallelism in an MLP, and
    under tensor parallelism an MLP of an odd number of layers or of a single
    (column, row) pair (and an MLP of one layer without it). Pipeline cuts
    inside a pair are modelled (per layer), with any schedule, data
    parallelism, gradient overlap and ZeRO.
    """
    model = config.model_config
    if not isinstance(model, (TransformerConfig, MLPConfig)):
        return f"the fast engine models GPT and MLP training steps, not {type(model).__name__}"
    if config.sequence_parallel and not isinstance(model, TransformerConfig):
        return "the fast engine models sequence parallelism in GPTs only"
    # Under tensor parallelism an MLP's blocks are (column, row) layer pairs;
    # a pipeline cut that splits one is modelled per layer (see _prepare).
    if isinstance(model, MLPConfig):
        per_block = 1 if config.tensor == 1 else 2
        if model.num_layers % per_block:
            return "tensor parallelism pairs an MLP's layers, and this MLP has an odd number"
        if model.num_layers // per_block < 2:
            return "the fast engine models MLPs of at least two blocks (layer pairs under tensor parallelism)"
    return ""


class FastEngine:
    """Prepares structural keys as coarse programs; block measurements shared by the whole sweep.

    One fine block is measured per (model, tensor degree, recompute policy,
    optimizer, hardware) with every microbatch size the sweep needs as a size
    variant, on a cluster of ``tensor`` devices of the row's hardware (a block
    only reads its first device's speeds; links come in when a program is
    filled for its real cluster).
    """

    def __init__(self, configs: Sequence[Config], *, scales: Mapping[str, float] | None = None):
        """``scales``: measure blocks on each preset with these fields scaled
        (:func:`~distir_jax.calibrate.scaled_topology`), not on the preset itself.
        The measurement only decides which fine ops are compute-bound (see
        :func:`~distir_jax.transforms.coarse.layer_features`), so programs
        prepared that way are exact on the scaled hardware: calibration builds
        them there."""
        self._scales = dict(scales or {})
        self._scaled: dict[int, tuple] = {}  # id(topology) -> (topology, scaled): lru caches key by identity
        sizes: dict[tuple, set] = {}
        for c in configs:
            # A replica's microbatch, and the pipeline transform's (which runs
            # before data parallelism splits it d ways): see _prepare.
            sizes.setdefault(_measure_key(c), set()).update((c.microbatch_size, c.microbatch_size * c.data))
        self._sizes = {key: tuple(sorted(v)) for key, v in sizes.items()}

    def prepare(
        self, group: Sequence[Config], *, steady: bool = True, settle: int = 0
    ) -> list[tuple[Config, Prepared | None, int, str]] | None:
        """One structural key's coarse programs (one per hardware preset).

        With ``steady``, a long 1F1B / interleaved pipeline is prepared as a
        short program whose steady period stands for the rest
        (:func:`~distir_jax.transforms.coarse.steady_pipeline_program`);
        the kernel call extrapolates it, and reports rows whose period has not
        settled. Those need a longer short program (``settle=1``: skip the
        shortest of :func:`~distir_jax.transforms.coarse_steady.short_candidates`)
        or the long one (``steady=False``).

        Returns:
          ``(config, prepared, variant, reason)`` per row, like the exact
          engine's preparation; or None when a coarse program cannot express
          the key: then the caller runs the exact engine.
        """
        prepared: dict[str, tuple[Prepared, tuple] | str] = {}
        for c in group:
            if c.preset in prepared:
                continue
            try:
                prepared[c.preset] = self._prepare(c, group, steady, settle)
            except SplitBlockError:
                return None
            except ValueError as err:
                prepared[c.preset] = str(err).splitlines()[0]
        rows = []
        for c in group:
            p = prepared[c.preset]
            if isinstance(p, str):
                rows.append((c, None, 0, p))
            else:
                program, sizes = p
                rows.append((c, program, sizes.index(c.microbatch_size), ""))
        return rows

    def _prepare(
        self, config: Config, group: Sequence[Config], steady: bool, settle: int
    ) -> tuple[Prepared, tuple]:
        features, topology, program_args, sizes = self._program_inputs(config, group)
        schedule, pipeline = program_args["schedule"], program_args["pipeline"]
        program, period = steady_pipeline_program(
            features,
            topology,
            **program_args,
            # Per-layer messages differ by chunk, which a steady period of
            # interleaved stages does not tell apart.
            steady=steady and not (features.per_layer and program_args["virtual_stages"] > 1),
            # A retry: only the longer short programs (possibly none: then the long one).
            short_microbatches=short_candidates(schedule, pipeline)[settle:] if settle else None,
        )
        return compact(program, topology, period), sizes

    def templated(self, config: Config) -> tuple[Prepared, PipelineTemplate]:
        """``config``'s long coarse program (never a steady short one) and the
        template it fills, whose ops name the program's (a trace's events).

        Raises:
          SplitBlockError: when no coarse program expresses it (see :meth:`prepare`).
          ValueError: when the configuration cannot be built (its reason).
        """
        program, template, topology = self._long(config)
        return compact(program, topology), template

    def long_program(self, config: Config) -> Program:
        """``config``'s long coarse program, lowered for its whole cluster (not
        compacted; raises as :meth:`templated`)."""
        return self._long(config)[0]

    def _long(self, config: Config) -> tuple[Program, PipelineTemplate, Topology]:
        features, topology, program_args, _ = self._program_inputs(config, [config])
        program, template = templated_pipeline_program(features, topology, **program_args)
        return program, template, topology

    def _program_inputs(self, config: Config, group: Sequence[Config]) -> tuple:
        """``(features, topology, program arguments, sizes)`` of ``config``'s coarse
        program (:func:`~distir_jax.transforms.coarse.coarse_pipeline_program`'s
        arguments besides the first two), and the microbatch sizes its variants are."""
        key = _measure_key(config)
        sizes = self._sizes.get(key) or tuple(
            sorted({c.microbatch_size for c in group} | {c.microbatch_size * c.data for c in group})
        )
        model, tensor, recompute, optimizer, hardware, dtype, sequence_parallel = key
        topology = self._measured_on(_measure_topology(hardware, dtype, tensor))
        features = layer_features(
            model,
            tensor,
            recompute,
            sizes,
            topology,
            optimizer=optimizer,
            sequence_parallel=sequence_parallel,
        )
        # The exact engine builds this key with its own batch sizes as variants, and
        # the pipeline transform, which runs before data parallelism, cuts stages
        # and orders steps by the mean flops of its microbatches (d replicas'
        # worth each): so here too.
        variants = sorted({sizes.index(c.microbatch_size * c.data) for c in group})
        chunks = config.pipeline * config.virtual_stages
        try:
            layers = transform_layers_per_chunk(features, chunks, variants)
        except SplitBlockError:  # the stages split an MLP's (column, row) pairs: per layer then
            features = layer_features(
                model, tensor, recompute, sizes, topology, optimizer=optimizer, per_layer=True
            )
            layers = transform_layers_per_chunk(features, chunks, variants)
        if config.zero and config.data > 1:  # the exact engine's ZeRO shards each weight's axis 0
            for part in features.weights:  # embedding, blocks, head: the model's optimizer order
                for name, weight_type in part:
                    problem = zero_shard_problem(name, weight_type, config.data)
                    if problem:
                        raise ValueError(problem)
        topology = config.topology()
        # The program carries only this key's own microbatch sizes as variants.
        used = sorted({sizes.index(c.microbatch_size) for c in group})
        pc = parallel_config(config)  # the transforms' reading of the row's knobs
        program_args = dict(
            pipeline=pc.pipeline,
            microbatches=pc.microbatches,
            data=pc.data,
            virtual_stages=pc.virtual_stages,
            schedule=pc.schedule,
            zero=pc.zero,
            overlap=pc.overlap_grad_comm,
            layers_per_chunk=layers,
            step_costs=transform_step_costs(features, layers, variants),
            overlap_segments=True,
        )
        return features.take_variants(used), topology, program_args, tuple(sizes[i] for i in used)

    def _measured_on(self, topology: Topology) -> Topology:
        """The topology blocks are measured on: ``topology``, scaled (one object per
        preset, so the feature caches keep serving it)."""
        if not self._scales:
            return topology
        found = self._scaled.get(id(topology))
        if found is None:
            from distir_jax.calibrate import scaled_topology  # (optax: only when calibrating)

            found = self._scaled[id(topology)] = (topology, scaled_topology(topology, self._scales))
        return found[1]


def _measure_key(config: Config) -> tuple:
    return (
        config.model_config,
        config.tensor,
        config.recompute,
        config.optimizer,
        config.hardware,
        HARDWARE_DTYPE.get(config.dtype, config.dtype),
        config.sequence_parallel,
    )


def _measure_topology(hardware: str, dtype: str, tensor: int):
    """``tensor`` devices of the row's hardware (or its explicit cluster)."""
    return _topology(hardware if ":" in hardware else f"{hardware}:{tensor}", dtype)
