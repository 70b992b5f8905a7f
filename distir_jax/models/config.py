"""Model configurations and named presets.

Configs hold only the model's shape (layers, widths, heads, vocabulary) and
its element type; the batch size is an argument of the builders, because a
sweep varies it (possibly as a vector of size variants) for one model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distir_jax.ir.types import Dim, normalize_dim

# f64 is for numerical tests only; real presets use a training dtype.
MODEL_DTYPES = ("f32", "f16", "bf16", "f64")
HALF_DTYPES = ("bf16", "f16")

# How a model trains in its dtype (the optimizer's and the gradients' dtypes).
# f32 / f64 models train in full precision. Half-precision models train
#   "mixed": with an f32 master copy of each weight and f32 optimizer state,
#     gradients cast to f32 before microbatches are summed and replicas
#     all-reduce them (Megatron-LM's bf16 default: main_grad);
#   "mixed-half-grads": the same, with gradients summed and all-reduced in the
#     model dtype (Megatron-LM's f16 default, DeepSpeed's fp16);
#   "half": with no master copy, optimizer state and gradients in the model dtype;
#   "mixed-fp8": "mixed", with the linear layers' GEMMs (forward, and the
#     backward's data and weight gradients) in FP8 on FP8 tensor cores, as
#     Transformer Engine runs them (attention's batched matmuls, the embedding
#     and the LM head stay in the model dtype). Such a GEMM costs half its
#     flops at the model dtype's peak (FP8 tensor cores run at twice the
#     bf16 / f16 rate on every GPU that has them) and reads 1-byte operands.
#     A transformer block's linear layers read their inputs cast to f8 (a cast
#     fused into the kernel that produced them) and keep those copies for the
#     weight gradients, as Transformer Engine does (sequence parallelism
#     all-gathers the f8 copies); each of those layers' weights has resident
#     FP8 copies, it and its transpose (~2 bytes a parameter), which the GEMMs
#     read instead of it (see models._emit).
PRECISIONS = ("full", "mixed", "mixed-half-grads", "half", "mixed-fp8")
HALF_PRECISIONS = ("mixed", "mixed-half-grads", "half", "mixed-fp8")
# Precisions with f32 master weights and optimizer state.
MASTER_PRECISIONS = ("mixed", "mixed-half-grads", "mixed-fp8")
# Precisions that sum and all-reduce gradients in f32.
F32_GRAD_PRECISIONS = ("mixed", "mixed-fp8")
# Precisions that run the linear layers' GEMMs in FP8, and what each is otherwise.
FP8_PRECISIONS = {"mixed-fp8": "mixed"}
# Under them, a weight's FP8 copies are inputs ``{weight}.fp8`` and ``{weight}.fp8t``
# (its transpose's), in this order: (not transposed, transposed).
FP8_COPY_SUFFIXES = ("fp8", "fp8t")


def _check_positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{owner}: {name} must be an int >= 1, got {name}={value!r}")


def _as_python_ints(config, names) -> None:
    # Sizes end up in op attributes, which take Python ints, not NumPy scalars.
    for name in names:
        object.__setattr__(config, name, int(getattr(config, name)))


def _check_dtype(owner: str, dtype) -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"{owner}: dtype must be one of {list(MODEL_DTYPES)}, got dtype={dtype!r}")


def precisions_for(dtype: str) -> tuple[str, ...]:
    """The training precisions a model in ``dtype`` can take, its default first."""
    return HALF_PRECISIONS if dtype in HALF_DTYPES else ("full",)


def _check_precision(owner: str, dtype: str, precision) -> None:
    """``training_precision`` (None: the dtype's default) must suit ``dtype``."""
    if precision is None:
        return
    if precision not in PRECISIONS:
        raise ValueError(
            f"{owner}: training_precision must be one of {list(PRECISIONS)}, "
            f"got training_precision={precision!r}"
        )
    allowed = precisions_for(dtype)
    if precision not in allowed:
        raise ValueError(
            f"{owner}: {dtype} models train in precision {' or '.join(map(repr, allowed))}, "
            f"got training_precision={precision!r} with dtype={dtype!r}"
        )


class _Precision:
    """The ``resolved_precision`` property shared by the configs."""

    @property
    def resolved_precision(self) -> str:
        """``training_precision``, or the dtype's default (``mixed`` for bf16 / f16, else ``full``)."""
        return self.training_precision or precisions_for(self.dtype)[0]


@dataclasses.dataclass(frozen=True)
class MLPConfig(_Precision):
    """A DistIR-style MLP: ``num_layers`` square ``[hidden, hidden]`` weights, no biases.

    Attributes:
      num_layers: number of weight matrices (layers), ``L``.
      hidden: width of every layer, including the input and the output.
      dtype: element type of weights and activations.
      training_precision: how it trains in ``dtype`` (``PRECISIONS``); None: the
        dtype's default (``mixed`` for bf16 / f16, ``full`` otherwise).
    """

    num_layers: int
    hidden: int
    dtype: str = "f32"
    training_precision: str | None = None

    def __post_init__(self):
        _check_positive_int("MLPConfig", "num_layers", self.num_layers)
        _check_positive_int("MLPConfig", "hidden", self.hidden)
        _as_python_ints(self, ("num_layers", "hidden"))
        _check_dtype("MLPConfig", self.dtype)
        _check_precision("MLPConfig", self.dtype, self.training_precision)

    def num_parameters(self) -> int:
        return self.num_layers * self.hidden * self.hidden


@dataclasses.dataclass(frozen=True)
class TransformerConfig(_Precision):
    """A decoder-only GPT: pre-norm blocks of attention and a Gelu MLP.

    Attributes:
      num_layers: number of transformer blocks, ``L``.
      hidden: model width ``H``; must be divisible by ``num_heads``.
      num_heads: attention heads per block.
      vocab_size: token vocabulary ``V``.
      seq_len: sequence length ``S`` (the positional table has ``S`` rows).
      ffn_hidden: width of the MLP's inner layer ``F``; ``None`` means ``4 H``.
      dtype: element type of weights and activations (token ids are ``i32``).
      ln_eps: LayerNorm epsilon.
      training_precision: how it trains in ``dtype`` (``PRECISIONS``); None: the
        dtype's default (``mixed`` for bf16 / f16, ``full`` otherwise).
      num_kv_heads: key / value heads ``K`` (grouped-query attention, as
        LLaMA-2 70B and LLaMA-3 use: each serves ``num_heads / K`` query
        heads); must divide ``num_heads``. ``None`` means ``num_heads``
        (multi-head attention).
    """

    num_layers: int
    hidden: int
    num_heads: int
    vocab_size: int
    seq_len: int
    ffn_hidden: int | None = None
    dtype: str = "f32"
    ln_eps: float = 1e-5
    training_precision: str | None = None
    num_kv_heads: int | None = None

    def __post_init__(self):
        owner = "TransformerConfig"
        if self.ffn_hidden is None:
            _check_positive_int(owner, "hidden", self.hidden)
            object.__setattr__(self, "ffn_hidden", 4 * int(self.hidden))
        if self.num_kv_heads is None:
            _check_positive_int(owner, "num_heads", self.num_heads)
            object.__setattr__(self, "num_kv_heads", int(self.num_heads))
        sizes = ("num_layers", "hidden", "num_heads", "vocab_size", "seq_len", "ffn_hidden", "num_kv_heads")
        for name in sizes:
            _check_positive_int(owner, name, getattr(self, name))
        _as_python_ints(self, sizes)
        if self.hidden % self.num_heads:
            raise ValueError(
                f"{owner}: hidden={self.hidden} must be divisible by num_heads={self.num_heads} "
                "(each head gets hidden / num_heads features)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{owner}: num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                "(each key / value head serves the same number of query heads)"
            )
        _check_dtype(owner, self.dtype)
        _check_precision(owner, self.dtype, self.training_precision)
        if not isinstance(self.ln_eps, (int, float)) or not self.ln_eps > 0:
            raise ValueError(f"{owner}: ln_eps must be a number > 0, got ln_eps={self.ln_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def grouped(self) -> bool:
        """Whether key / value heads are shared by several query heads (grouped-query attention)."""
        return self.num_kv_heads < self.num_heads

    def num_parameters(self) -> int:
        """Weights of the built program: untied head, no biases besides LayerNorm."""
        h, f = self.hidden, self.ffn_hidden
        per_block = h * h + 2 * h * self.num_kv_heads * self.head_dim + h * h + 2 * h * f + 4 * h
        return (
            (self.vocab_size + self.seq_len) * h + self.num_layers * per_block + 2 * h + h * self.vocab_size
        )


ModelConfig = MLPConfig | TransformerConfig

# The 50,257-token GPT-2 BPE vocabulary padded to 50,304 = 393 x 128 rows, as
# Megatron-LM trains it (--make-vocab-size-divisible-by 128): the embedding and
# the head then split evenly over tensor and ZeRO degrees up to 128.
_VOCAB = 50304
_GPT2 = dict(vocab_size=_VOCAB, seq_len=1024)
_GPT3 = dict(vocab_size=_VOCAB, seq_len=2048)

_PRESETS: dict[str, ModelConfig] = {
    # DistIR's MLP grid (paper, Section 5).
    "mlp-xs": MLPConfig(num_layers=8, hidden=512),
    "mlp-small": MLPConfig(num_layers=16, hidden=8192),
    "mlp-medium": MLPConfig(num_layers=64, hidden=16384),
    "mlp-large": MLPConfig(num_layers=96, hidden=32768),
    # GPT-2 (Radford et al. 2019, Table 2; head counts from the released configs).
    "gpt2-small": TransformerConfig(12, 768, 12, **_GPT2),
    "gpt2-medium": TransformerConfig(24, 1024, 16, **_GPT2),
    "gpt2-large": TransformerConfig(36, 1280, 20, **_GPT2),
    "gpt2-xl": TransformerConfig(48, 1600, 25, **_GPT2),
    # GPT-3 (Brown et al. 2020, Table 2.1). The table lists XL with d_model
    # 2048, 24 heads and d_head 128, which cannot all hold (24 x 128 = 3072);
    # we keep d_model and d_head, i.e. 16 heads, as Megatron's GPT-3 XL does.
    "gpt3-xl": TransformerConfig(24, 2048, 16, **_GPT3),
    "gpt3-6.7b": TransformerConfig(32, 4096, 32, **_GPT3),
    # The table lists d_model 5140, which 40 heads do not divide (and which is
    # not 40 x d_head 128); implementations use 5120 = 40 x 128.
    "gpt3-13b": TransformerConfig(40, 5120, 40, **_GPT3),
    "gpt3-175b": TransformerConfig(96, 12288, 96, **_GPT3),
}


def model_names() -> tuple[str, ...]:
    """Names of the model presets, MLPs first."""
    return tuple(_PRESETS)


def get_model_config(name: str, *, dtype: str | None = None) -> ModelConfig:
    """The preset called ``name``, optionally with another ``dtype``.

    Raises:
      ValueError: for an unknown name (listing the valid ones) or dtype.
    """
    try:
        config = _PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown model name={name!r}; valid names: {', '.join(_PRESETS)} (a model of your own: "
            "distir_jax.models.register_model, or a --models file on the command line)"
        ) from None
    return config if dtype is None else dataclasses.replace(config, dtype=dtype)


def check_batch_size(batch_size) -> Dim:
    """``batch_size`` as a dim (an int or a vector of size variants), all >= 1.

    Raises:
      ValueError: naming ``batch_size`` and its value when it is not a positive
        int or a non-empty 1-D array of positive ints.
    """
    try:
        dim = normalize_dim(batch_size)
    except ValueError as e:
        raise ValueError(
            f"batch_size must be an int >= 1 or a 1-D int array of size variants >= 1, "
            f"got batch_size={batch_size!r} ({e})"
        ) from None
    if np.any(np.asarray(dim) < 1):
        raise ValueError(f"batch_size must be >= 1 for every size variant, got batch_size={batch_size!r}")
    return dim
