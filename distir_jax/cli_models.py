"""``distir-jax models``: the models ``--model`` may name, and their sizes."""

from __future__ import annotations

__all__ = ["add_models_parser", "run_models"]

_HEADER = tuple("model kind layers hidden heads ffn vocab seq parameters FLOP/sample from".split())
# Parameters with B for billions, as models are named; FLOPs with SI prefixes.
_PARAMETERS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
_FLOPS = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def add_models_parser(sub, add_file_options) -> None:
    """The ``models`` subcommand (``add_file_options``: the commands' shared
    ``--presets`` and ``--models``)."""
    c = sub.add_parser(
        "models",
        help="list the models --model may name, and their sizes",
        description="List the built-in model presets and those of --models files: their sizes, "
        "parameters and model FLOPs per training sample (forward and backward matmuls, the "
        "numerator of a sweep's mfu column).",
    )
    add_file_options(c)


def run_models(args) -> int:
    from distir_jax.models import TransformerConfig, get_model_config, model_flops_per_sample, model_names
    from distir_jax.models.custom import MODEL_KINDS

    rows = [_HEADER]
    for name in model_names():
        config = get_model_config(name)
        kind = next(k for k, cls in MODEL_KINDS.items() if isinstance(config, cls))  # a models file's
        sizes = ("-",) * 4
        if isinstance(config, TransformerConfig):
            heads = config.num_heads if not config.grouped else f"{config.num_heads}/{config.num_kv_heads}"
            sizes = (heads, config.ffn_hidden, config.vocab_size, config.seq_len)
        rows.append(
            (name, kind, config.num_layers, config.hidden)
            + sizes
            + (_scaled(config.num_parameters(), _PARAMETERS), _scaled(model_flops_per_sample(config), _FLOPS))
            + (args.model_files.get(name, "built-in"),)
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_HEADER))]
    for row in rows:  # names to the left, numbers to the right
        cells = [str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))]
        print("  ".join(cells))
    return 0


def _scaled(n: float, prefixes) -> str:
    for scale, prefix in prefixes:
        if n >= scale:
            return f"{n / scale:.1f}{prefix}"
    return f"{n:.0f}"
