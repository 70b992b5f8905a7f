"""Fitting the cost model to measured step times, by gradient through the kernel.

An analytical cost model is only as good as its hardware numbers: datasheet
peak FLOP/s and bandwidths overstate what kernels and collectives reach.
DistIR calibrates its model from measurements; here calibration is one
gradient descent through the timeline kernel itself, so what is fitted is
the simulated *step time* of whole programs (overlap, pipeline bubbles and
waiting included), not each op's cost in isolation.

Each calibrated field of the topology gets one factor (an efficiency): every
device's peak FLOP/s, say, is multiplied by the same ``exp(theta)``. The loss
is the mean squared log ratio of simulated to measured step times, so a 1 ms
and a 10 s program weigh alike, and the factors stay positive. Any optax
transformation minimizes it (default ``optax.adam(0.05)``); the simulation is
exact (``temperature=None``: the gradient of each max is its winner's) unless
a temperature smooths it. Everything runs in float64, whatever
``jax_enable_x64`` says, as sweeps do.

A field the measured programs do not depend on (links, for programs that
send nothing) keeps factor 1 and is reported in
:attr:`Calibration.unconstrained`: its factor says nothing about the hardware.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distir_jax.hardware import Hardware
from distir_jax.ir.topology import Topology
from distir_jax.kernel import simulate
from distir_jax.lower import Program, stack_programs

__all__ = ["CALIBRATABLE_FIELDS", "Calibration", "calibrate"]

# Topology fields that set op durations (memory capacity sets none).
CALIBRATABLE_FIELDS = ("peak_flops", "memory_bandwidth", "link_bandwidth", "link_latency", "launch_overhead")

# |d log(step time) / d theta| below this for every program: the field is not constrained.
_UNCONSTRAINED = 1e-9


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` found.

    Attributes:
      topology: the calibrated topology (the base one with each field scaled).
      scales: per calibrated field, the factor it was multiplied by.
      unconstrained: calibrated fields no measured program depends on; their
        factor stayed at 1.
      measured: ``[B]`` the measured step times, seconds.
      initial: ``[B]`` simulated step times on the base topology.
      predicted: ``[B]`` simulated step times on the calibrated topology
        (exact semantics).
      losses: ``[steps]`` the loss (mean squared log ratio) before each step.
    """

    topology: Topology
    scales: dict[str, float]
    unconstrained: tuple[str, ...]
    measured: np.ndarray
    initial: np.ndarray
    predicted: np.ndarray
    losses: np.ndarray

    @property
    def hardware(self) -> Hardware:
        """The calibrated topology as the kernel's :class:`Hardware`."""
        return Hardware.from_topology(self.topology)

    @property
    def relative_error(self) -> np.ndarray:
        """``[B]`` predicted / measured - 1."""
        return self.predicted / self.measured - 1.0


def calibrate(
    programs: Sequence[Program],
    measured,
    topology: Topology,
    *,
    fields: Sequence[str] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    steps: int = 500,
    temperature: float | None = None,
) -> Calibration:
    """Scales ``topology``'s fields so that ``programs`` simulate in their ``measured`` step times.

    Args:
      programs: lowered programs (:func:`~distir_jax.lower.lower`), each for
        at most ``topology``'s devices; a program with size variants stands
        for one measurement per variant.
      measured: ``[B]`` measured step times in seconds, one per program (and variant).
      topology: the cluster the measurements come from, with its nominal numbers.
      fields: which of :data:`CALIBRATABLE_FIELDS` to fit (default: every one
        that is not zero everywhere in ``topology``; a zero field cannot be scaled).
      optimizer: any optax transformation (default ``optax.adam(0.05)``).
      steps: optimizer steps.
      temperature: None for the exact timeline, or a smoothing scale in
        seconds (see :func:`~distir_jax.kernel.simulate`).

    Returns:
      A :class:`Calibration`.

    Raises:
      ValueError: for no programs, a measurement count that does not match
        them, a step time that is not a positive finite number, an unknown or
        zero field, a program on more devices than ``topology`` has, or
        ``steps < 1``.
    """
    if not programs:
        raise ValueError("calibrate needs at least one program")
    fields = _checked_fields(topology, fields)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    optimizer = optax.adam(0.05) if optimizer is None else optimizer
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise ValueError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
    program = stack_programs(programs)
    measured = _checked_measured(measured, program.flops.shape[0])
    devices = program.resident_bytes.shape[-1]
    if devices > topology.num_devices:
        raise ValueError(
            f"the programs are lowered for up to {devices} devices but topology {topology.name!r} has "
            f"{topology.num_devices}; lower them for this topology"
        )
    with jax.enable_x64(True):
        hardware = _first_devices(topology, devices)
        base = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), hardware)

        def log_step_time(theta):
            return jnp.log(simulate(program, _scaled(base, fields, theta), temperature=temperature).step_time)

        target = jnp.log(jnp.asarray(measured))

        def loss(theta):
            return jnp.mean((log_step_time(theta) - target) ** 2)

        def step(carry, _):
            theta, state = carry
            value, grad = jax.value_and_grad(loss)(theta)
            updates, state = optimizer.update(grad, state, theta)
            return (optax.apply_updates(theta, updates), state), value

        theta = jnp.zeros(len(fields))
        initial = _exact_times(program, base, fields, theta)
        idle = np.flatnonzero(~(initial > 0))
        if idle.size:  # its log has no gradient: nothing to fit it by
            raise ValueError(f"program {idle[0]} simulates in 0 s (no op takes time); leave it out")
        descend = jax.jit(lambda t: jax.lax.scan(step, (t, optimizer.init(t)), length=steps))
        (theta, _), losses = descend(theta)
        # Which fields the programs depend on, at the fitted point.
        sensitivity = np.abs(np.asarray(jax.jacfwd(log_step_time)(theta)))  # [B, F]
        most = sensitivity.max(axis=0)
        unconstrained = tuple(f for f, s in zip(fields, most, strict=True) if s < _UNCONSTRAINED)
        theta = jnp.where(jnp.asarray([f in unconstrained for f in fields]), 0.0, theta)
        predicted = _exact_times(program, base, fields, theta)
    scales = {f: float(np.exp(t)) for f, t in zip(fields, np.asarray(theta), strict=True)}
    return Calibration(
        topology=_scaled_topology(topology, scales),
        scales=scales,
        unconstrained=unconstrained,
        measured=measured,
        initial=initial,
        predicted=predicted,
        losses=np.asarray(losses),
    )


def _checked_fields(topology: Topology, fields) -> tuple[str, ...]:
    nonzero = tuple(f for f in CALIBRATABLE_FIELDS if np.any(np.asarray(getattr(topology, f)) != 0))
    if fields is None:
        return nonzero
    fields = (fields,) if isinstance(fields, str) else tuple(fields)
    unknown = [f for f in fields if f not in CALIBRATABLE_FIELDS]
    if unknown:
        raise ValueError(f"fields: unknown {unknown}; expected some of {list(CALIBRATABLE_FIELDS)}")
    if not fields or len(set(fields)) < len(fields):
        raise ValueError(f"fields must be distinct names, at least one, got {list(fields)}")
    zero = [f for f in fields if f not in nonzero]
    if zero:
        raise ValueError(
            f"fields {zero} are 0 everywhere in topology {topology.name!r}: no factor moves them; "
            "leave them out"
        )
    return fields


def _checked_measured(measured, count: int) -> np.ndarray:
    measured = np.asarray(measured, np.float64)
    if measured.shape != (count,):
        raise ValueError(
            f"measured must hold one step time per program (a program with size variants: one per "
            f"variant), {count} in all, got shape {measured.shape}"
        )
    bad = np.flatnonzero(~(np.isfinite(measured) & (measured > 0)))
    if bad.size:
        raise ValueError(
            f"measured step times must be positive and finite, got {float(measured[bad[0]])} "
            f"at index {bad[0]}"
        )
    return measured


def _first_devices(topology: Topology, count: int) -> Hardware:
    """The hardware of ``topology``'s devices ``0 .. count - 1`` (programs lowered for
    a smaller cluster use those)."""
    hardware = Hardware.from_topology(topology)
    matrices = ("link_bandwidth", "link_latency")
    changes = {}
    for field in ("peak_flops", "memory_bandwidth", "memory_capacity", *matrices):
        x = getattr(hardware, field)
        changes[field] = x[:count, :count] if field in matrices else x[:count]
    return hardware.replace(**changes)


def _scaled(base: Hardware, fields: tuple[str, ...], theta) -> Hardware:
    """``base`` with field ``fields[i]`` times ``exp(theta[i])``."""
    return base.replace(**{f: getattr(base, f) * jnp.exp(theta[i]) for i, f in enumerate(fields)})


def _exact_times(program: Program, base: Hardware, fields, theta) -> np.ndarray:
    """``[B]`` step times at ``theta``, exact semantics, on the host."""
    return np.asarray(simulate(program, _scaled(base, fields, theta)).step_time, np.float64)


def _scaled_topology(topology: Topology, scales: dict[str, float]) -> Topology:
    changes = {f: np.asarray(getattr(topology, f)) * s for f, s in scales.items()}
    if "launch_overhead" in changes:
        changes["launch_overhead"] = float(changes["launch_overhead"])
    return dataclasses.replace(topology, name=f"{topology.name} (calibrated)", **changes)
