"""DistIR's MLP as IR programs: ``L`` layers ``h <- relu(h @ W_i)``, MSE loss.

Shapes: ``x`` and ``target`` are ``[B, H]``; weight ``l{i}.w`` (``i = 1..L``)
is ``[H, H]``. ``B`` may be a vector of size variants.

Tensor-parallel hints follow DistIR's horizontal parallelism: weights alternate
column split (odd layers, ``tp="col"``) and row split (even layers,
``tp="row"``), so the activation between a column and a row layer is split
along its features; the ops working on it carry ``tp="sharded"``.
"""

from __future__ import annotations

from distir_jax.ir.function import Function, Value
from distir_jax.models._emit import Emitter, check_optimizer, emit_optimizer
from distir_jax.models.config import MLPConfig, check_batch_size


def _tp_kind(layer: int) -> str:
    return "col" if layer % 2 == 1 else "row"


def _relu_tp(layer: int, num_layers: int) -> dict:
    # Relu after a column layer sees a feature shard only when a row layer
    # follows to consume it; otherwise the transform gathers it first.
    if _tp_kind(layer) == "col" and layer < num_layers:
        return {"tp": "sharded"}
    return {}


def _check_config(config) -> MLPConfig:
    if not isinstance(config, MLPConfig):
        raise ValueError(f"config must be an MLPConfig, got config={config!r}")
    return config


def _forward(em: Emitter, config: MLPConfig, x: Value) -> tuple[list[Value], list[Value]]:
    """Emits the layers; returns the activations ``h_0..h_L`` and the weights."""
    hs, weights = [x], []
    for layer in range(1, config.num_layers + 1):
        w = em.weight(layer, "w", (config.hidden, config.hidden))
        weights.append(w)
        em.at(layer, "fwd")
        z = em.op("MatMul", hs[-1], w, name=f"l{layer}.z", tp=_tp_kind(layer))
        hs.append(em.op("Relu", z, name=f"l{layer}.h", **_relu_tp(layer, config.num_layers)))
    return hs, weights


def _inputs(config: MLPConfig, batch_size, name: str, with_target: bool):
    batch = check_batch_size(batch_size)
    em = Emitter(name, config.dtype, config.resolved_precision)
    x = em.data("x", (batch, config.hidden))
    target = em.data("target", (batch, config.hidden)) if with_target else None
    return em, x, target


def mlp_inference(config: MLPConfig, batch_size) -> Function:
    """The forward pass: inputs ``x`` then ``l1.w..lL.w``; output ``l{L}.h`` ``[B, H]``."""
    config = _check_config(config)
    em, x, _ = _inputs(config, batch_size, "mlp_inference", with_target=False)
    hs, _ = _forward(em, config, x)
    return em.build(hs[-1])


def mlp_loss(config: MLPConfig, batch_size) -> Function:
    """The forward pass and the MSE loss (no backward): output ``loss``."""
    config = _check_config(config)
    em, x, target = _inputs(config, batch_size, "mlp_loss", with_target=True)
    hs, _ = _forward(em, config, x)
    em.at(config.num_layers + 1, "fwd")
    return em.build(em.op("MSELoss", hs[-1], target, name="loss", shards=1))


def mlp_training_step(config: MLPConfig, batch_size, *, optimizer: str = "sgd", lr: float = 1e-3) -> Function:
    """One training step: forward, MSE loss, backward, optimizer update.

    Args:
      config: the model.
      batch_size: ``B``, an int or a 1-D int array of size variants.
      optimizer: ``"sgd"`` or ``"adam"`` (one step with ``step=1`` bias
        correction; moments are inputs ``l{i}.w.m`` / ``l{i}.w.v``).
      lr: learning rate.

    Returns:
      A function with inputs ``x``, ``target``, the weights (and Adam moments)
      and outputs ``loss``, then the updated weights ``l{i}.w.new`` (and
      moments ``l{i}.w.m.new``, ``l{i}.w.v.new``).
    """
    config = _check_config(config)
    optimizer, lr = check_optimizer(optimizer, lr)
    em, x, target = _inputs(config, batch_size, "mlp_training_step", with_target=True)
    hs, weights = _forward(em, config, x)
    num_layers = config.num_layers

    em.at(num_layers + 1, "fwd")
    loss = em.op("MSELoss", hs[-1], target, name="loss", shards=1)
    em.at(num_layers + 1, "bwd")
    dh = em.op("MSELossGrad", hs[-1], target, name=f"l{num_layers}.dh", shards=1)

    for layer in range(num_layers, 0, -1):
        w = weights[layer - 1]
        em.at(layer, "bwd")
        # relu'(z) = relu'(h), and h_i is kept anyway for the next layer's
        # weight gradient, so z can be freed right after the forward Relu.
        dz = em.op("ReluGrad", dh, hs[layer], name=f"l{layer}.dz", **_relu_tp(layer, num_layers))
        tp = _tp_kind(layer)
        em.weight_grad("MatMul", w, hs[layer - 1], dz, transpose_a=True, tp=tp)
        if layer > 1:  # x needs no gradient
            dh = em.op("MatMul", dz, w, name=f"l{layer - 1}.dh", transpose_b=True, tp=tp)

    return em.build(loss, *emit_optimizer(em, optimizer, lr))
