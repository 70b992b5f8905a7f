"""The ``distir-jax`` command: ``sweep`` a strategy space, ``simulate`` one configuration,
``merge`` a sweep's parts, ``calibrate`` a hardware preset to measured step times, list
the ``models``.

    distir-jax sweep                      # GPT-3 XL on 16 A100s: which strategy should I run?
    distir-jax sweep --model mlp-small --world-sizes 4,8 --batch-sizes 256 --top-k 5
    distir-jax simulate --model gpt3-xl --data 4 --pipeline 4 --microbatches 8
    distir-jax simulate --model gpt3-xl --data 4 --pipeline 4 --microbatches 8 --trace trace.json
    distir-jax sweep --parts 4 --part 0   # one of 4 hosts or jobs; then:
    distir-jax merge results/sweep.csv results/sweep.part-*-of-4.csv
    distir-jax calibrate measured.csv --name my-a100   # a preset fitted to measured step times
    distir-jax models --models my-models.json          # the models --model may name, and their sizes
    distir-jax sweep --presets results/my-a100.calibration.json --hardware my-a100

Usage errors print one line and exit with status 2; a file that cannot be read or
written while running prints one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence

from distir_jax.cli_calibrate import add_calibrate_parser, run_calibrate
from distir_jax.cli_models import add_models_parser, run_models

# The built-in sweep: GPT-3 XL (1.3B) training on two DGX A100 nodes, every
# degree, schedule, recomputation, ZeRO and gradient-overlap choice (~2,200
# strategies, seconds).
# (GPT-2 XL's 25 heads would rule out every tensor-parallel degree on 16 GPUs.)
DEFAULT_SWEEP = dict(
    model="gpt3-xl",
    world_sizes="16",
    batch_sizes="64,256,1024",
    microbatches="2,4,8,16",
    schedules="1f1b,interleaved",
    recompute="none,attention,full",
    zero="both",
    overlap="both",
    dtype="bf16",
    optimizer="adam",
    hardware="dgx-a100-80gb",
)
DEFAULT_OUTPUT = os.path.join("results", "sweep.csv")
_CHOICE = {"no": (False,), "yes": (True,), "both": (False, True)}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


# Larger counts or sizes overflow the int64 arithmetic of the simulator's tables.
_MAX_INT = 2**62


def _int(text: str, least: int) -> int | None:
    """``text`` as an int in ``[least, _MAX_INT]``, or None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if least <= value <= _MAX_INT else None


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(_int(x, 1) for x in text.split(",") if x.strip())
    if not values or None in values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers from 1 to 2**62, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = _int(text, 1)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected one integer from 1 to 2**62, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text, 0)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected one integer from 0 to 2**62, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:  # inf would overflow the int byte counts made from it
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _one_of(allowed: Sequence[str]):
    """An argparse type: one name from ``allowed`` (a one-line error naming them otherwise)."""

    def check(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return text

    return check


def _some_of(allowed: Sequence[str]):
    """An argparse type: comma-separated names, each from ``allowed``."""

    def check(text: str) -> tuple[str, ...]:
        values = _names(text)
        unknown = [v for v in values if v not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"expected some of {', '.join(allowed)}, got {', '.join(map(repr, unknown))}"
            )
        return values

    return check


def _preset(text: str) -> str:
    """A hardware preset name, optionally with a device count (``dgx-a100-80gb:16``)."""
    from distir_jax.presets import preset_names

    if text.partition(":")[0] not in preset_names():
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(preset_names())}, got {text!r}")
    return text


_PRECISION_HELP = (
    "mixed (f32 master weights and optimizer state, gradients summed and all-reduced in f32: "
    "Megatron-LM's bf16), mixed-half-grads (the same with gradients in the model dtype), half (no "
    "master copy; optimizer state and gradients in the model dtype), mixed-fp8 (mixed, with the linear "
    "layers' GEMMs in FP8 as Transformer Engine runs them, its cached FP8 weight copies and their "
    "transposes resident: H100, H200 and B200); f32 models train in full precision"
)


def _add_model_options(p: argparse.ArgumentParser, many: bool) -> None:
    from distir_jax.models import model_names
    from distir_jax.models.config import HALF_PRECISIONS
    from distir_jax.presets import preset_names
    from search.space import HARDWARE_DTYPE, OPTIMIZERS

    # --dtype takes the model dtypes with a hardware peak: the model configs also take
    # f64 (numerical tests) and the presets tf32, but no row of either can ever run.
    dtypes = tuple(HARDWARE_DTYPE)
    names = ", ".join(model_names())
    if many:
        p.add_argument(
            "--model",
            type=_names,
            metavar="NAME,...",
            default=_names(DEFAULT_SWEEP["model"]),
            help=f"model preset(s), comma-separated, from: {names}, or named in a --models file "
            f"(default: {DEFAULT_SWEEP['model']})",
        )
        p.add_argument(
            "--hardware",
            type=_names,
            metavar="NAME,...",
            default=_names(DEFAULT_SWEEP["hardware"]),
            help=f"hardware preset(s) from {', '.join(preset_names())}; each world size "
            "takes that many GPUs of it (default: dgx-a100-80gb)",
        )
        p.add_argument(
            "--dtype",
            type=_some_of(dtypes),
            metavar="NAME,...",
            default=_names(DEFAULT_SWEEP["dtype"]),
            help=f"model dtype(s): {', '.join(dtypes)}; sets the hardware's peak FLOP/s (default: bf16)",
        )
        p.add_argument(
            "--training-precision",
            type=_some_of(HALF_PRECISIONS),
            metavar="NAME,...",
            default=None,
            help=f"how bf16 / f16 models train: {_PRECISION_HELP} (default: mixed)",
        )
        p.add_argument(
            "--optimizer",
            type=_names,
            metavar="NAME,...",
            default=_names(DEFAULT_SWEEP["optimizer"]),
            help="optimizer(s): sgd, adam (default: adam)",
        )
    else:
        model = DEFAULT_SWEEP["model"]
        p.add_argument(
            "--model",
            default=model,
            help=f"model preset, from: {names}, or named in a --models file (default: {model})",
        )
        p.add_argument(
            "--hardware",
            type=_preset,
            default="dgx-a100-80gb",
            help=f"hardware preset, from {', '.join(preset_names())} (default: dgx-a100-80gb)",
        )
        p.add_argument(
            "--dtype",
            type=_one_of(dtypes),
            default="bf16",
            help=f"model dtype: {', '.join(dtypes)} (default: bf16)",
        )
        p.add_argument(
            "--training-precision",
            type=_one_of(HALF_PRECISIONS),
            default=None,
            help=f"how a bf16 / f16 model trains: {_PRECISION_HELP} (default: mixed)",
        )
        p.add_argument(
            "--optimizer",
            type=_one_of(OPTIMIZERS),
            default="adam",
            help="optimizer: sgd or adam (default: adam)",
        )
    p.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help="sequence length of transformer models (default: the preset's, 1024 for GPT-2)",
    )


def build_parser() -> argparse.ArgumentParser:
    from search.space import RECOMPUTE, SCHEDULES

    parser = _Parser(
        prog="distir-jax", description="Simulate distributed training strategies with DistIR-JAX."
    )
    commands = "{sweep,simulate,merge,calibrate,models}"
    sub = parser.add_subparsers(dest="command", metavar=commands, parser_class=_Parser)
    sub.required = True

    s = sub.add_parser(
        "sweep",
        help="simulate every strategy of a space and rank them",
        description="Simulate every strategy of a space in batched kernel calls, print the best ones and "
        "write one row per configuration to a results file. With no options: GPT-3 XL "
        "training on 16 GPUs of 2 DGX A100 nodes, global batch 64, 256 and 1024, every degree, "
        "schedule, recomputation, ZeRO and gradient-overlap choice.",
    )
    _add_model_options(s, many=True)
    s.add_argument(
        "--world-sizes",
        type=_ints,
        metavar="N,...",
        default=_ints(DEFAULT_SWEEP["world_sizes"]),
        help=f"GPU counts, comma-separated (default: {DEFAULT_SWEEP['world_sizes']})",
    )
    s.add_argument(
        "--batch-sizes",
        type=_ints,
        metavar="N,...",
        default=_ints(DEFAULT_SWEEP["batch_sizes"]),
        help=f"global batch sizes (default: {DEFAULT_SWEEP['batch_sizes']})",
    )
    s.add_argument(
        "--data",
        type=_ints,
        metavar="N,...",
        default=None,
        help="data-parallel degrees to allow (default: any)",
    )
    s.add_argument(
        "--tensor",
        type=_ints,
        metavar="N,...",
        default=None,
        help="tensor-parallel degrees to allow (default: any)",
    )
    s.add_argument(
        "--pipeline",
        type=_ints,
        metavar="N,...",
        default=None,
        help="pipeline degrees to allow (default: any); "
        "by default every data x tensor x pipeline factorisation of each world size is tried",
    )
    s.add_argument(
        "--microbatches",
        type=_ints,
        metavar="N,...",
        default=None,  # not given: DEFAULT_SWEEP's, unless --microbatch-sizes replaces it
        help=f"microbatch counts for pipelines (default: {DEFAULT_SWEEP['microbatches']}); "
        "runs without a pipeline use 1",
    )
    s.add_argument(
        "--microbatch-sizes",
        type=_ints,
        metavar="N,...",
        default=None,
        help="samples per microbatch instead of counts (count = batch / (data x size))",
    )
    s.add_argument(
        "--schedules",
        type=_names,
        metavar="NAME,...",
        default=_names(DEFAULT_SWEEP["schedules"]),
        help=f"pipeline schedules: gpipe, 1f1b, interleaved (default: {DEFAULT_SWEEP['schedules']})",
    )
    s.add_argument(
        "--virtual-stages",
        type=_ints,
        metavar="N,...",
        default=(2,),
        help="model chunks per device for the interleaved schedule (default: 2)",
    )
    s.add_argument(
        "--recompute",
        type=_names,
        metavar="NAME,...",
        default=_names(DEFAULT_SWEEP["recompute"]),
        help=f"activation recomputation: none, attention, full (default: {DEFAULT_SWEEP['recompute']})",
    )
    s.add_argument(
        "--zero",
        choices=tuple(_CHOICE),
        default=DEFAULT_SWEEP["zero"],
        help=f"ZeRO-1 optimizer-state sharding: no, yes or both (default: {DEFAULT_SWEEP['zero']})",
    )
    s.add_argument(
        "--sequence-parallel",
        choices=tuple(_CHOICE),
        default="no",
        help="Megatron sequence parallelism (tensor > 1): no, yes or both (default: no)",
    )
    s.add_argument(
        "--overlap",
        choices=tuple(_CHOICE),
        default=DEFAULT_SWEEP["overlap"],
        help="overlap gradient all-reduces with the backward pass: no, yes or both "
        f"(default: {DEFAULT_SWEEP['overlap']})",
    )
    s.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        metavar="PATH",
        help=f"results file, .csv or .parquet (default: {DEFAULT_OUTPUT}; a .parquet copy is "
        "written next to a .csv when pyarrow is installed, and a .manifest.json listing the "
        "configurations it is to hold, for merge)",
    )
    s.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in --output and simulate only the missing configurations "
        "(a running sweep checkpoints there every minute, so an interrupted one can resume; "
        "rows computed when a model or hardware name meant other sizes are an error, not kept)",
    )
    s.add_argument(
        "--parts",
        type=_positive_int,
        default=1,
        metavar="N",
        help="split the sweep into N parts, each run on its own (hosts, or a job array) with --part, "
        "then joined with `distir-jax merge` (default: 1)",
    )
    s.add_argument(
        "--part",
        type=_non_negative_int,
        default=0,
        metavar="I",
        help="the part this run sweeps, 0 to N-1: every N-th configuration from the I-th; its "
        "results go to --output with .part-I-of-N before the suffix (default: 0)",
    )
    s.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize(), which finds the cluster in the "
        "environment (SLURM, Open MPI, Kubernetes, TPU pods), and sweep this process's part, "
        "jax.process_index() of jax.process_count(); elsewhere, run --parts/--part on each host",
    )
    _add_ranking_options(s)
    s.add_argument(
        "--chunk-size",
        type=_positive_int,
        default=None,
        help="most configurations per kernel call (default: 256 on CPU, 4096 on accelerators)",
    )
    s.add_argument(
        "--chunk-memory",
        type=_positive_float,
        default=1.0,
        help="most estimated kernel memory per call, in GB (default: 1)",
    )
    s.add_argument(
        "--engine",
        default="fast",
        choices=("fast", "exact"),
        help="fast: coarse programs generated as arrays, the same numbers (tested against the "
        "reference simulator) in milliseconds per strategy; rows it does not model (an MLP's "
        "sequence parallelism, a model of another kind) run exact. exact: build every program with the real "
        "transforms (default: fast)",
    )
    _add_precision_option(s)
    _add_file_options(s)
    s.add_argument("--no-progress", action="store_true", help="do not show a progress bar")

    m = sub.add_parser(
        "simulate",
        help="simulate one configuration",
        description="Simulate one configuration and print its step time, throughput, peak "
        "memory per device and status.",
    )
    _add_model_options(m, many=False)
    m.add_argument("--batch-size", type=_positive_int, default=64, help="global batch size (default: 64)")
    m.add_argument(
        "--world-size", type=_positive_int, default=None, help="GPUs (default: data x tensor x pipeline)"
    )
    for name, what in (("data", "data-parallel"), ("tensor", "tensor-parallel"), ("pipeline", "pipeline")):
        m.add_argument(f"--{name}", type=_positive_int, default=1, help=f"{what} degree (default: 1)")
    m.add_argument("--microbatches", type=_positive_int, default=1, help="microbatches (default: 1)")
    m.add_argument(
        "--schedule",
        type=_one_of(SCHEDULES),
        default="1f1b",
        help="gpipe, 1f1b or interleaved (default: 1f1b)",
    )
    m.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=1,
        help="model chunks per device, interleaved schedule only (default: 1)",
    )
    m.add_argument(
        "--recompute",
        type=_one_of(RECOMPUTE),
        default="none",
        help="none, attention or full (default: none)",
    )
    m.add_argument("--zero", action="store_true", help="ZeRO-1 optimizer-state sharding")
    m.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism")
    m.add_argument(
        "--overlap-grad-comm", action="store_true", help="overlap gradient reduction with the backward pass"
    )
    _add_precision_option(m)
    _add_file_options(m)
    m.add_argument(
        "--engine",
        default=None,
        choices=("fast", "exact"),
        help="fast: the coarse program a sweep simulates, the same numbers as a sweep's row "
        "(under a second, GPT-3 175B included); configurations it does not model run exact. "
        "exact: build the fine program with the real transforms (minutes for GPT-3-sized "
        "pipelines). Default: fast, or exact with --full",
    )
    m.add_argument(
        "--full",
        action="store_true",
        help="simulate every replica of the fine program instead of one representative per "
        "symmetric group (the exact engine)",
    )
    m.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="write a Chrome trace to PATH: an event per pipeline step, message and "
        "data-parallel op of the coarse program (fast engine), or per op of the fine one (exact)",
    )
    m.add_argument(
        "--sensitivity",
        action="store_true",
        help="also print what each hardware figure is worth: the %% change of the step time "
        "per 1%% more peak FLOP/s, memory bandwidth, link bandwidth, link latency and launch "
        "overhead (derivatives through the timeline: overlap and bubbles included)",
    )

    g = sub.add_parser(
        "merge",
        help="join the results files of a sweep's parts and rank them",
        description="Join the results files of a sweep run in parts (sweep --parts / --distributed) "
        "into one, then print the best strategies as sweep does. Given every part (by their "
        "names, *.part-I-of-N), the file is the one-process sweep's, row for row; a part not "
        "given, or lacking configurations its manifest (*.manifest.json, written by its sweep) "
        "lists (an interrupted run), is named in a warning.",
    )
    g.add_argument("output", help="the joined results file, .csv or .parquet")
    g.add_argument("inputs", nargs="+", metavar="part", help="the parts' results files")
    _add_ranking_options(g)
    _add_file_options(g)

    from distir_jax.calibrate import CALIBRATABLE_FIELDS

    add_calibrate_parser(sub, _some_of(CALIBRATABLE_FIELDS), _add_file_options)
    add_models_parser(sub, _add_file_options)
    return parser


def _add_precision_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision",
        default="float64",
        choices=("float64", "float32"),
        help="the timeline's float type: float64 equals the float64 reference simulator to "
        "~1e-14 at about float32's speed on a CPU; float32 rounding grows with a program's "
        "length (to ~1e-4 for GPT-3 175B pipelines), for TPUs (default: float64)",
    )


def _add_ranking_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--top-k",
        type=_positive_int,
        default=10,
        help="how many of the best strategies to print (default: 10)",
    )
    p.add_argument(
        "--memory-limit",
        type=_positive_float,
        default=None,
        metavar="GB",
        help="only rank strategies whose peak memory per GPU is at most this many GB",
    )


def _exact_rows_notice(configs) -> str:
    """A line per reason the fast engine leaves valid rows to the exact engine, or ``""``."""
    from collections import Counter

    from search._fast import fast_unsupported

    reasons = Counter(fast_unsupported(c) for c in configs if c.valid)
    reasons.pop("", None)
    return "".join(
        f"  {n} of them on the exact engine (seconds or more per structure: every program is built "
        f"with the transforms): {reason}\n"
        for reason, n in reasons.most_common()
    )


def _use_compilation_cache() -> None:
    """Keeps compiled kernels between runs: XLA compiles take seconds on a CPU.

    In ``$DISTIR_JAX_CACHE`` (default ``~/.cache/distir-jax/xla``; ``off`` disables it).
    """
    path = os.environ.get(
        "DISTIR_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "distir-jax", "xla")
    )
    if path.strip().lower() in ("", "0", "off", "none", "false"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 failure, 2 usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        preset_files = _load_preset_files(argv)
    except ValueError as err:
        print(f"distir-jax: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2): return it, as for the other outcomes
        return int(exit_.code or 0)
    args.preset_files = preset_files
    commands = {
        "sweep": _sweep,
        "simulate": _simulate,
        "merge": _merge,
        "calibrate": run_calibrate,
        "models": run_models,
    }
    try:
        args.model_files = _load_model_files(args.models)
        _use_compilation_cache()
        return commands[args.command](args)
    except ValueError as err:  # a bad combination of options, found by the library
        print(f"distir-jax {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except ImportError as err:  # e.g. a parallelism transform that is not installed
        print(f"distir-jax {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`distir-jax sweep | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as err:  # a file that cannot be read or written (disk full, permissions, ...)
        where = f"{err.filename}: " if err.filename else ""
        print(f"distir-jax {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 1


def _load_preset_files(argv: Sequence[str]) -> dict[str, str]:
    """Registers the calibrated presets of ``--presets`` files before the rest of the
    command line is parsed (``--hardware`` is checked against the preset names):
    their names and files."""
    from distir_jax.calibrate import load_calibration

    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--presets", default="")
    known, _ = early.parse_known_args(argv)
    return {load_calibration(path): path for path in _names(known.presets)} if known.presets else {}


def _add_file_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--presets",
        default="",
        metavar="FILE,...",
        help="calibration files (written by `distir-jax calibrate`) whose presets --hardware may name",
    )
    p.add_argument(
        "--models",
        default="",
        metavar="FILE,...",
        help='JSON files of your own models by name, which --model may name: {"my-gpt": {"kind": "gpt", '
        '"num_layers": 32, "hidden": 4096, "num_heads": 32, "vocab_size": 32000, "seq_len": 4096}} '
        "(fields of distir_jax.models.TransformerConfig, or MLPConfig for kind mlp)",
    )


def _load_model_files(models: str) -> dict[str, str]:
    """Registers the models of ``--models`` files; returns each one's file, by name."""
    from distir_jax.models import load_models

    if not models:
        return {}
    return {name: path for path in _names(models) for name in load_models(path)}


def _sweep(args) -> int:
    from distir_jax.models.config import HALF_DTYPES
    from search import StrategySpace, enumerate_configs, evaluate, factorisations

    if args.microbatches is not None and args.microbatch_sizes is not None:
        # The space takes sizes over counts: one of them would be ignored.
        raise ValueError("--microbatches and --microbatch-sizes both set the microbatches: give one of them")
    if args.microbatches is None and args.microbatch_sizes is None:
        args.microbatches = _ints(DEFAULT_SWEEP["microbatches"])
    space = StrategySpace(
        model=args.model,
        world_sizes=args.world_sizes,
        global_batch_sizes=args.batch_sizes,
        seq_len=args.seq_len,
        data=args.data,
        tensor=args.tensor,
        pipeline=args.pipeline,
        microbatches=args.microbatches,
        microbatch_sizes=args.microbatch_sizes,
        schedules=args.schedules,
        virtual_stages=args.virtual_stages,
        recompute=args.recompute,
        zero=_CHOICE[args.zero],
        sequence_parallel=_CHOICE[args.sequence_parallel],
        overlap_grad_comm=_CHOICE[args.overlap],
        dtype=args.dtype,
        training_precision=args.training_precision,
        hardware=args.hardware,
        optimizer=args.optimizer,
    )
    if True in space.sequence_parallel and not any(
        t > 1
        for w in space.world_sizes
        for _, t, _ in factorisations(w, space.data, space.tensor, space.pipeline)
    ):  # every row would run without it, silently
        raise ValueError(
            f"--sequence-parallel {args.sequence_parallel} needs tensor parallelism, and no "
            "configuration of this sweep has a tensor degree > 1: allow one with --tensor"
        )
    if args.training_precision is not None and not set(args.dtype) & set(HALF_DTYPES):
        raise ValueError(  # every row would train in full precision, silently
            f"--training-precision chooses how bf16 / f16 models train, and this sweep's --dtype "
            f"{','.join(args.dtype)} has neither: add bf16 or f16, or give no --training-precision"
        )
    _check_output(args.output, "--output")
    part, parts = _sweep_part(args)
    output = _part_path(args.output, part, parts)
    for path in _copy_paths(output):
        _check_writable(path, "--output")
    start = time.perf_counter()
    configs = list(enumerate_configs(space))
    mine = configs[part::parts]  # what evaluate takes of them
    this_part = f"; this run is part {part} of {parts}: {len(mine)} of them" if parts > 1 else ""
    print(
        f"sweeping {len(configs)} configurations of {', '.join(map(str, space.model))} on "
        f"{', '.join(f'{h}:{w}' for h in space.hardware for w in space.world_sizes)}{this_part} ...",
        flush=True,
    )
    if args.engine == "fast":  # say up front which rows take the slow path, and why
        print(_exact_rows_notice(mine), end="", flush=True)
    done = _config_ids(output) if args.resume and os.path.exists(output) else set()
    # Always through results_path: evaluate checkpoints there, so an interrupted
    # sweep can go on with --resume. A fresh sweep (resume=False) leaves an earlier
    # file, and its manifest, as they are until it writes its own rows over them.
    table = evaluate(
        configs,
        results_path=output,
        resume=args.resume,
        max_configs_per_call=args.chunk_size,
        max_bytes=int(args.chunk_memory * 1e9),
        progress=not args.no_progress,
        process_index=part,
        process_count=parts,
        engine=args.engine,
        precision=args.precision,
    )
    elapsed = time.perf_counter() - start
    # The rate counts what this run simulated; a resumed file's rows are counted apart.
    ids = {c.config_id for c in mine}
    ran = len(ids - done)
    how = f" in {elapsed:.1f} s ({ran / max(elapsed, 1e-9):.1f}/s)"
    if done:
        outside = len(done - {c.config_id for c in configs})
        how = f", {ran} simulated{how}, {len(done & ids)} resumed from {output}" + (
            f", {outside} kept from it that are not in this sweep's space" if outside else ""
        )
    _report(table, args, _write_copies(table, output), how)
    if parts > 1:
        print(
            f"\nthe ranking above is this part's; once every part is done, join them with:\n"
            f"  distir-jax merge {args.output} {_part_path(args.output, '*', parts)}"
        )
    return 0


def _merge(args) -> int:
    from search import ResultTable
    from search.manifest import manifest_path

    _check_output(args.output, "the merged file")
    # The merged file (and its .parquet copy) is written over: never over one of the parts.
    written = {os.path.realpath(p) for p in _copy_paths(args.output)}
    for path in args.inputs:
        if os.path.realpath(path) in written:
            raise ValueError(f"the merged file would overwrite its input {path!r}: give another output path")
    tables = []
    for path in args.inputs:
        if not os.path.isfile(path):
            raise ValueError(f"no results file {path!r}")
        tables.append(ResultTable.read(path))
    _check_same_definitions(args.inputs)
    for path in _copy_paths(args.output):
        _check_writable(path, "the merged file")
    table = _without_repeats(ResultTable.concat(tables), args.inputs, tables)
    lengths = [len(t) for t in tables]
    order = _sweep_order(args.inputs, lengths)
    if order is not None and len(order) == len(table):  # every part of one sweep, no row twice
        table = table.take(order)  # the one-process sweep's order
    table.write(args.output)
    manifest = manifest_path(args.output)
    if os.path.exists(manifest) and manifest not in {manifest_path(str(path)) for path in args.inputs}:
        os.remove(manifest)  # an earlier sweep's, into this file name: it no longer describes it
    # A part missing or cut short leaves its configurations out of the table: say so.
    gaps = _incomplete_parts(args.inputs, lengths, tables)
    for gap in gaps:
        print(f"distir-jax merge: warning: {gap}", file=sys.stderr)
    how = f" from {len(tables)} files" + (" (incomplete: see the warnings)" if gaps else "")
    _report(table, args, _write_copies(table, args.output), how)
    return 0


def _check_same_definitions(paths: Sequence[str]) -> None:
    """Raises when two files' manifests record different definitions under one
    model or hardware name (a model file or calibration changed between parts)."""
    from search.manifest import changed_inputs, recorded_inputs

    seen: list[tuple[str, dict]] = []
    for path in paths:
        inputs = recorded_inputs(path)
        if inputs is None:
            continue
        for earlier, before in seen:
            changed = changed_inputs(before, inputs)
            if changed:
                raise ValueError(
                    f"{earlier} and {path} were computed with different definitions: "
                    f"{'; '.join(changed)}; merging them would mix the two"
                )
        seen.append((str(path), inputs))


def _without_repeats(table, paths: Sequence[str], tables: Sequence):
    """``table`` with each configuration once: parts of one sweep never share
    a row, but a file given twice, or a part resumed into another's file, may
    repeat one; the same row twice is kept once, two different ones are an error."""
    import numpy as np

    ids = table["config_id"]
    _, first = np.unique(ids, return_index=True)
    if len(first) == len(ids):
        return table
    keep = np.sort(first)
    kept = dict(zip(ids[keep].tolist(), keep.tolist(), strict=True))
    source = np.repeat(np.arange(len(tables)), [len(t) for t in tables])
    for i in np.setdiff1d(np.arange(len(ids)), keep):
        j = kept[ids[i]]
        if table.row(int(i)) != table.row(j):
            raise ValueError(
                f"configuration {ids[i]} has different results in {paths[source[j]]!r} and "
                f"{paths[source[i]]!r}: are they parts of one sweep?"
            )
    return table.take(keep)


def _config_ids(path: str) -> set[str]:
    from search import ResultTable

    return set(ResultTable.read_columns(path, ["config_id"])["config_id"])


def _check_output(path: str, what: str) -> None:
    if not str(path).endswith((".csv", ".parquet")):
        raise ValueError(f"{what} must end in .csv or .parquet, got {path!r}")
    if str(path).endswith(".parquet") and not _has_pyarrow():
        raise ValueError(f"{what} is .parquet, which needs pyarrow; install it or write a .csv")


def _check_writable(path: str, what: str) -> None:
    """Fails unless a file can be written at ``path`` (making its folder): before a
    sweep or simulation runs, not once it is done, and before any file is replaced."""
    if os.path.isdir(path):
        raise ValueError(f"{what} must be a file, got the directory {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{what} {path!r} cannot be written: {existing!r} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # a file of ours, gone when closed
            pass
    except OSError as err:
        raise ValueError(f"{what} {path!r} cannot be written: {err.strerror or err}") from None


def _sweep_part(args) -> tuple[int, int]:
    """``(part, parts)`` of this run: ``--part`` / ``--parts``, or with ``--distributed``
    this process's index and count once ``jax.distributed`` is initialized."""
    if not args.distributed:
        if args.part >= args.parts:
            raise ValueError(f"--part must be in [0, {args.parts}) for --parts {args.parts}, got {args.part}")
        return args.part, args.parts
    if args.parts != 1 or args.part != 0:
        raise ValueError("--distributed takes this process's part from jax.distributed: drop --part/--parts")
    import jax

    try:
        jax.distributed.initialize()
    except (RuntimeError, ValueError) as err:
        raise ValueError(
            f"--distributed: jax.distributed.initialize() failed ({err}); it finds the hosts of a "
            "SLURM, Open MPI, Kubernetes or TPU job: elsewhere run each host with --parts N --part I"
        ) from None
    return jax.process_index(), jax.process_count()


# What _part_path appends to a results file's name.
_PART_NAME = re.compile(r"\.part-(\d+)-of-(\d+)\.(?:csv|parquet)$")


def _sweep_order(paths: Sequence[str], lengths: Sequence[int]):
    """Where the rows of ``paths`` (concatenated) go in the one-process sweep's order, or None.

    Part ``I`` of ``N`` holds configurations ``I, I + N, I + 2N, ...`` in
    enumeration order (``_sweep``), so when ``paths`` are every part of one
    sweep by name (``*.part-I-of-N.csv``), each once and complete (part ``I``
    has as many rows as ``range(I, total, N)``), interleaving them gives the
    whole sweep's file row for row. Otherwise (files renamed, a part missing
    or unfinished) the merge keeps the files' order. (An unfinished part lacks
    the end of its slice; where that still fits the count, the rows missing are
    the sweep's last ones, and the order of the others is still the sweep's.)"""
    import numpy as np

    found = _part_numbers(paths)
    if not all(found) or len({n for _, n in found}) != 1:
        return None
    parts, index = found[0][1], [i for i, _ in found]
    total = sum(lengths)
    if sorted(index) != list(range(parts)) or any(
        n != len(range(i, total, parts)) for i, n in zip(index, lengths, strict=True)
    ):
        return None
    return np.argsort(np.concatenate([np.arange(i, total, parts) for i in index]))


def _incomplete_parts(paths: Sequence[str], lengths: Sequence[int], tables: Sequence) -> list[str]:
    """Why files of a sweep may not hold all of its configurations.

    A file with its sweep's manifest (:mod:`search.manifest`, next to it) is
    checked against it: every configuration the sweep assigned it must be in
    it. Named parts of one sweep (``*.part-I-of-N``, :data:`_PART_NAME`) must
    all be given; one without its manifest is checked by its length instead:
    a complete sweep's part ``I`` has ``len(range(I, total, N))`` rows, no
    fewer than a later part's, at most one fewer than any other's (parts all
    cut short alike pass that check: only a manifest knows the sweep's size)."""
    from search.manifest import RESUME_ADVICE, manifest_gap, manifest_sweep

    out, measured = [], set()
    for path, table in zip(paths, tables, strict=True):
        checked, gap = manifest_gap(str(path), table)
        if checked:
            measured.add(str(path))
        if gap:
            out.append(gap)
    sweeps: dict[str, list[str]] = {}  # the sweep each manifest names -> its files
    for path in paths:
        sweep = manifest_sweep(str(path))
        if sweep is not None:
            sweeps.setdefault(sweep, []).append(str(path))
    if len(sweeps) > 1:  # each part may be whole, and the join still a mix
        groups = "; ".join(f"sweep {sweep}: {', '.join(files)}" for sweep, files in sweeps.items())
        out.append(f"the files are parts of {len(sweeps)} different sweeps ({groups}), not one")
    by_count: dict[int, dict[int, tuple[str, int]]] = {}  # N -> I -> (path, rows), a repeat once
    for path, n, found in zip(paths, lengths, _part_numbers(paths), strict=True):
        if found:
            by_count.setdefault(found[1], {}).setdefault(found[0], (str(path), n))
    for parts, rows in sorted(by_count.items()):
        missing = [i for i in range(parts) if i not in rows]
        if missing:
            whole = _whole_path(next(iter(rows.values()))[0])
            names = ", ".join(_part_path(whole, i, parts) for i in missing)
            out.append(f"{len(missing)} of {parts} parts not given ({names}): their rows are missing")
        longest = max(n for _, n in rows.values())
        for i, (path, n) in sorted(rows.items()):
            expected = max([longest - 1] + [m for j, (_, m) in rows.items() if j > i])
            if n < expected and path not in measured:
                out.append(
                    f"{path} has {n} row{'s' * (n != 1)} where a complete part {i} of {parts} has "
                    f"at least {expected}: was it interrupted? {RESUME_ADVICE}"
                )
    return out


def _part_numbers(paths: Sequence[str]) -> list[tuple[int, int] | None]:
    """``(I, N)`` of each path named as part ``I`` of ``N`` (:data:`_PART_NAME`), else None."""
    found = [_PART_NAME.search(os.path.basename(str(path))) for path in paths]
    return [(int(m[1]), int(m[2])) if m else None for m in found]


def _whole_path(part_path: str) -> str:
    """The results file a part's name was made from (the inverse of :func:`_part_path`)."""
    return part_path[: _PART_NAME.search(part_path).start()] + os.path.splitext(part_path)[1]


def _part_path(path: str, part: int | str, parts: int) -> str:
    """``results/sweep.csv`` as part ``part`` of ``parts``: ``results/sweep.part-2-of-4.csv``
    (``part="*"``: the shell pattern of them all); :data:`_PART_NAME` reads it back."""
    if parts == 1:
        return path
    root, suffix = os.path.splitext(path)
    return f"{root}.part-{part}-of-{parts}{suffix}"


def _copy_paths(path: str) -> list[str]:
    """The files a results table written to ``path`` is in: ``path`` and, next to
    a .csv, a .parquet copy when pyarrow is installed."""
    if path.endswith(".csv") and _has_pyarrow():
        return [path, path[: -len(".csv")] + ".parquet"]
    return [path]


def _write_copies(table, path: str) -> list[str]:
    """The files ``table`` is in (:func:`_copy_paths`): ``path``, written already, and its copy."""
    written = _copy_paths(path)
    for copy in written[1:]:
        table.to_parquet(copy)
    return written


def _report(table, args, written: list[str], how: str) -> None:
    """Prints a results table's counts, its best rows (or why none fits) and its files."""
    counts = {s: int((table["status"] == s).sum()) for s in ("ok", "out of memory", "invalid")}
    engines = {e: int((table["engine"] == e).sum()) for e in ("fast", "exact")}
    ran = ", ".join(f"{n} {e}" for e, n in engines.items() if n)
    print(
        f"{len(table)} configurations{how}: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + (f" (engine: {ran})" if ran else "")
    )
    limit = None if args.memory_limit is None else args.memory_limit * 1e9
    best = table.top_k(args.top_k, memory_limit=limit)
    under = "" if limit is None else f" under {args.memory_limit:g} GB per GPU"
    columns = table.display_columns()  # every knob the sweep varies, even where the rows shown agree
    if len(best):
        print(f"\ntop {len(best)} by throughput{under}:")
        print(best.format(columns))
        front = table.pareto_front()
        print(f"\nthroughput vs peak memory Pareto front ({len(front)} configurations):")
        print(front.format(columns))
        command = simulate_command(best.row(0), preset_files=args.preset_files, model_files=args.model_files)
        if command:
            what = "each device's peak, what bounds it, a trace of its pipeline"
            print(f"\nthe best one up close ({what}):\n  {command}")
    else:
        _print_why_none_fits(table, limit, under)
    print("\nresults: " + " and ".join(os.path.abspath(p) for p in written))


def simulate_command(
    row: dict, trace: str = "best.json", preset_files: dict | None = None, model_files: dict | None = None
) -> str | None:
    """The ``distir-jax simulate`` command line of a results row (options at their
    defaults left out), printing its sensitivities and writing its trace to
    ``trace``; None for a model that is not a preset (no option names it).
    ``preset_files``: the calibration file of each calibrated preset (by name),
    for ``--presets``; ``model_files``: the file of each model of a ``--models``
    file (by name)."""
    from distir_jax.models import get_model_config, model_names
    from distir_jax.models.config import precisions_for

    if row["model"] not in model_names():
        return None
    defaults = vars(build_parser().parse_args(["simulate"]))
    defaults["world_size"] = row["data"] * row["tensor"] * row["pipeline"]
    defaults["seq_len"] = getattr(get_model_config(row["model"]), "seq_len", 0)
    defaults["training_precision"] = precisions_for(row["dtype"])[0]  # what no option gives
    words = ["distir-jax", "simulate"]
    calibrated = (preset_files or {}).get(row["hardware"].partition(":")[0])
    words += ["--presets", calibrated] if calibrated else []
    custom = (model_files or {}).get(row["model"])
    words += ["--models", custom] if custom else []
    for name, column in _SIMULATE_KNOBS:
        option = "--" + name.replace("_", "-")
        if isinstance(defaults[name], bool):  # a flag (its default: off)
            words += [option] if row[column] else []
        elif row[column] != defaults[name]:
            words += [option, str(row[column])]
    words += ["--sensitivity", "--trace", trace]
    return " ".join(shlex.quote(word) for word in words)  # pastes back as it is


# `distir-jax simulate`'s options that are a configuration's knobs, and their
# results-table columns (make_config takes the options' names).
_SIMULATE_KNOBS = (
    ("model", "model"),
    ("hardware", "hardware"),
    ("world_size", "world_size"),
    ("batch_size", "global_batch_size"),
    ("seq_len", "seq_len"),
    ("data", "data"),
    ("tensor", "tensor"),
    ("pipeline", "pipeline"),
    ("microbatches", "microbatches"),
    ("schedule", "schedule"),
    ("virtual_stages", "virtual_stages"),
    ("recompute", "recompute"),
    ("zero", "zero"),
    ("sequence_parallel", "sequence_parallel"),
    ("overlap_grad_comm", "overlap_grad_comm"),
    ("dtype", "dtype"),
    ("training_precision", "training_precision"),
    ("optimizer", "optimizer"),
)


def _print_why_none_fits(table, limit: float | None, under: str) -> None:
    """What to print instead of a ranking when no row fits: the rows that come
    closest (least peak memory), or, when none was simulated, why rows are invalid."""
    closest = table.closest_to_fitting(5, memory_limit=limit)
    if len(closest):
        print(f"\nno configuration fits{under}; the {len(closest)} of least peak memory per GPU:")
        print(closest.format(table.display_columns()))
        print(
            "smaller microbatches (--microbatch-sizes, or more --microbatches), --recompute full, "
            "--zero yes and more pipeline or tensor parallelism lower the peak; every row's reason "
            "is in the results file"
        )
        return
    print(f"\nno configuration is valid{under}; the most common reasons (rows, one of them):")
    for reason, rows in table.reasons()[:5]:
        print(f"  {rows:6d}  {reason}")
    print("every row's reason is in the results file")


def _simulate(args) -> int:
    from search._fast import fast_unsupported
    from search.single import (
        SingleResult,
        coarse_chrome_trace,
        config_elasticities,
        make_config,
        simulate_config,
        summarize_config,
        write_chrome_trace,
    )

    if args.full and args.engine == "fast":
        raise ValueError("--full simulates every replica of the fine program: --engine exact, or no --engine")
    engine = args.engine or ("exact" if args.full else "fast")
    # Switches the configuration would drop, silently, for want of the degree they act on.
    if args.sequence_parallel and args.tensor == 1:
        raise ValueError("--sequence-parallel splits the sequence over a tensor group: give --tensor > 1")
    for flag, on in (("--zero", args.zero), ("--overlap-grad-comm", args.overlap_grad_comm)):
        if on and args.data == 1:
            raise ValueError(f"{flag} acts on the gradients of data-parallel replicas: give --data > 1")

    config = make_config(args.model, **{name: getattr(args, name) for name, _ in _SIMULATE_KNOBS[1:]})
    if args.trace:  # before a simulation that may take minutes
        _check_writable(args.trace, "--trace")
    switches = (
        (config.zero, "ZeRO-1"),
        (config.overlap_grad_comm, "gradient overlap"),
        (config.sequence_parallel, "sequence parallel"),
    )
    print(
        f"{config.model} on {config.preset}, global batch {config.global_batch_size}: data {config.data} x "
        f"tensor {config.tensor} x pipeline {config.pipeline}, {config.microbatches} microbatch(es), "
        f"{config.schedule}, recompute {config.recompute}"
        + "".join(f", {name}" for on, name in switches if on)
        + f", {config.dtype} ({config.training_precision} precision), {config.optimizer}"
    )
    if not config.valid:
        print(f"status: invalid ({config.reason})")
        return 1
    if engine == "exact":
        result = simulate_config(config, representative_only=not args.full, precision=args.precision)
    else:
        result = summarize_config(config, engine=engine, precision=args.precision)
    row = result.row
    print(f"status: {row['status']}" + (f" ({row['reason']})" if row["reason"] else ""))
    if row["status"] == "invalid":
        return 1
    if row["engine"] == "fast":
        print("engine: fast (the coarse program a sweep simulates; --engine exact builds the fine one)")
    elif engine == "fast":  # it fell back, as a sweep's row would
        why = fast_unsupported(config) or "no coarse program expresses this configuration"
        print(f"engine: exact ({why})")
    else:
        print("engine: exact (the fine program)")
    print(f"step time: {row['step_time_s']:.6g} s")
    print(f"throughput: {row['throughput_samples_per_s']:.6g} samples/s")
    print(
        f"model FLOPs utilization: {row['mfu']:.1%} ({row['model_tflops_per_gpu']:.4g} TFLOP/s of the "
        "model's matmuls per GPU; recomputation not counted)"
    )
    print(
        f"compute / communication / bubble on the busiest GPU: {row['compute_time_s']:.4g} / "
        f"{row['communication_time_s']:.4g} / {row['bubble_time_s']:.4g} s"
    )
    print("peak memory per device (resident from the start + allocated by the step and held at its peak):")
    for device, peak, resident, used in zip(
        result.devices, result.peak_memory_bytes, result.resident_bytes, result.simulated, strict=True
    ):
        if used:
            held = (peak - resident) / 1e9
            print(f"  device {int(device):>4}: {peak / 1e9:8.3f} GB = {resident / 1e9:.3f} + {held:.3f}")
    shown = int(result.simulated.sum())
    if shown < config.world_size:
        print(
            f"  ({shown} of {config.world_size} devices simulated; the others are identical replicas of "
            "these. Use --full to simulate all.)"
        )
    from distir_jax.models.config import FP8_PRECISIONS

    copies = " and their FP8 copies" if config.training_precision in FP8_PRECISIONS else ""
    print(
        f"  (resident: weights{copies}, optimizer state, the step's data; allocated: activations, "
        "gradients, messages)"
    )
    if args.sensitivity:
        _print_sensitivity(config_elasticities(config, engine=engine))
    if args.trace:
        if isinstance(result, SingleResult):  # the fine program's
            trace, what = result, "an event per op of the fine program"
        else:
            trace = coarse_chrome_trace(config, precision=args.precision)
            what = "an event per pipeline step, message and data-parallel op; --engine exact: per op"
        write_chrome_trace(trace, args.trace)
        print(f"trace: {os.path.abspath(args.trace)} ({what})")
    return 0


def _print_sensitivity(elasticities: dict[str, float]) -> None:
    """``simulate --sensitivity``'s lines: each figure's elasticity, and what it says."""
    from distir_jax.sensitivity import SPEED_FIELDS

    print("sensitivity: the step time's change per 1% more of each hardware figure, and the share")
    print("of the critical path that figure's time is (derivatives through the whole timeline):")
    for field, value in elasticities.items():
        # + 0.0: a speed the step does not depend on has elasticity +0.0, its share not "-0.0%".
        share = (-value if field in SPEED_FIELDS else value) + 0.0
        print(f"  {field:18s} {value:+9.4f}%   {share:6.1%} of the critical path")


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
