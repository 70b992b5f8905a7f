"""Models of the user's own sizes, by name: for sweeps and the command line.

A sweep's table names a model, and a resumed or merged sweep, a calibration
and the ``simulate`` command a sweep prints all find it again by that name.
:func:`register_model` makes a config a preset of that name for this process;
:func:`load_models` registers every model of a JSON file, which the command
line reads with ``--models FILE``::

    {
      "llama-7b-like": {"kind": "gpt", "num_layers": 32, "hidden": 4096,
                        "num_heads": 32, "vocab_size": 32000, "seq_len": 4096,
                        "ffn_hidden": 16512},
      "llama2-70b-like": {"kind": "gpt", "num_layers": 80, "hidden": 8192,
                          "num_heads": 64, "num_kv_heads": 8, "vocab_size": 32000,
                          "seq_len": 4096, "ffn_hidden": 43008},
      "mlp-wide": {"kind": "mlp", "num_layers": 8, "hidden": 16384}
    }

A model's fields are :class:`~distir_jax.models.TransformerConfig`'s
(``"gpt"``) or :class:`~distir_jax.models.MLPConfig`'s (``"mlp"``). The GPT
block is GPT-2's (LayerNorm, a GELU MLP of ``ffn_hidden``, learned
positions): a model of another block is approximated by its sizes. A SwiGLU
MLP of width ``F`` (three matrices) has the weights and FLOPs of this one at
``1.5 F``: LLaMA-7B's 11008 is 16512 above, LLaMA-2 70B's 28672 is 43008.
Grouped-query attention is the block's own: ``num_kv_heads`` key / value
heads, each shared by ``num_heads / num_kv_heads`` query heads.
"""

from __future__ import annotations

import dataclasses
import json
import re

from distir_jax.models import config as _config
from distir_jax.models.config import MLPConfig, TransformerConfig

__all__ = ["MODEL_KINDS", "load_models", "register_model"]

MODEL_KINDS = {"gpt": TransformerConfig, "mlp": MLPConfig}
# Built-in presets cannot be redefined: tables and ids written with them keep their meaning.
_BUILT_IN = frozenset(_config.model_names())
# Names go into comma-separated option lists and hardware-like "name:..." text.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def register_model(name: str, config) -> None:
    """Makes ``config`` the model preset ``name`` (``get_model_config(name)``,
    ``StrategySpace(model=name)``, ``--model name``) in this process.

    Raises:
      ValueError: for a name that is not letters, digits and ``._+-`` (starting
        with a letter or digit), that of a built-in preset, or one already
        registered with another config; or a config of another type.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"model name={name!r}: expected letters, digits and '._+-', starting with a letter or digit"
        )
    if not isinstance(config, (MLPConfig, TransformerConfig)):
        what = type(config).__name__
        raise ValueError(f"model {name!r}: expected an MLPConfig or a TransformerConfig, got {what}")
    if name in _BUILT_IN:
        raise ValueError(f"model name={name!r} is a built-in preset; give your model another name")
    known = _config._PRESETS.get(name)
    if known is not None and known != config:
        raise ValueError(f"model {name!r} is already registered as {known}; it cannot also be {config}")
    _config._PRESETS[name] = config


def load_models(path) -> list[str]:
    """Registers every model of the JSON file ``path`` (see the module docstring);
    returns their names, in the file's order.

    Raises:
      ValueError: naming the file (and the model and field) for a file that is not
        JSON, not an object of models, or with a model of an unknown kind, with
        unknown or missing fields, or with values its config rejects.
    """
    try:
        with open(path) as f:
            models = json.load(f)
    except OSError as err:
        raise ValueError(f"{path}: cannot read the models file ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(models, dict) or not models:
        example = '{"my-gpt": {"kind": "gpt", ...}}'
        raise ValueError(f"{path}: expected an object of models by name, e.g. {example}")
    configs = {name: _config_of(path, name, fields) for name, fields in models.items()}
    for name, config in configs.items():
        try:
            register_model(name, config)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return list(configs)


def _config_of(path, name: str, fields):
    where = f"{path}: model {name!r}"
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: expected an object of fields, got {fields!r}")
    fields = dict(fields)
    kind = fields.pop("kind", None)
    if kind not in MODEL_KINDS:
        raise ValueError(f"{where}: 'kind' must be one of {sorted(MODEL_KINDS)}, got {kind!r}")
    cls = MODEL_KINDS[kind]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} for kind {kind!r}; its fields are {allowed}")
    try:
        return cls(**fields)
    except TypeError as err:  # a required field left out
        raise ValueError(f"{where}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
