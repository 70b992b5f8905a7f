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
and a 10 s program weigh alike, and the factors stay positive.
Levenberg-Marquardt minimizes it by default (the kernel's Jacobian by
forward-mode differentiation, a few iterations; where it stops short at a
kink of the piecewise-linear step times, a fit of the smoothed timeline
carries it on); any optax transformation may instead. The simulation is
exact (``temperature=None``: the derivative of each max is its winner's)
unless a temperature smooths it. Everything runs in float64, whatever
``jax_enable_x64`` says, as sweeps do.

A field the measured programs do not depend on (links, for programs that
send nothing) keeps factor 1 and is reported in
:attr:`Calibration.unconstrained`: its factor says nothing about the hardware.
One they barely depend on (GPT-3-sized runs and link latency: doubling it
moves their step times by ~0.2%), or cannot tell from another (one Send: link
latency from bandwidth), is fitted but listed in
:attr:`Calibration.weakly_determined`: measurement noise would move its factor far.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from distir_jax.hardware import Hardware
from distir_jax.ir.builder import FunctionBuilder
from distir_jax.ir.function import Function
from distir_jax.ir.topology import Topology
from distir_jax.kernel import simulate
from distir_jax.lower import Program, _check_program, stack_programs
from distir_jax.presets import register_calibrated_preset

__all__ = [
    "CALIBRATABLE_FIELDS",
    "FACTOR_BOUNDS",
    "NETWORK_FIELDS",
    "Calibration",
    "calibrate",
    "calibration_probes",
    "load_calibration",
    "save_calibration",
    "scaled_topology",
    "step_times_on",
]

# Topology fields that set op durations (memory capacity sets none), then the
# links between nodes on their own (NETWORK_FIELDS).
CALIBRATABLE_FIELDS = (
    "peak_flops",
    "memory_bandwidth",
    "link_bandwidth",
    "link_latency",
    "launch_overhead",
    "network_bandwidth",
    "network_latency",
)
# The links between nodes (InfiniBand, Ethernet), by the link table they are
# entries of. A cluster's two fabrics reach different shares of their datasheet
# figures, so such a factor, where given, scales the links between nodes and
# its link field's factor only the links within a node (NVLink, NVSwitch,
# PCIe); where not, the link field's factor scales every link. Fitted only when
# asked for: telling the fabrics apart needs measurements whose traffic splits
# between them differently.
NETWORK_FIELDS = {"network_bandwidth": "link_bandwidth", "network_latency": "link_latency"}

# |d log(step time) / d theta| below this for every program: the field is not constrained.
_UNCONSTRAINED = 1e-9
# The factors a fit may reach. A figure may all but vanish (a launch overhead
# hidden by CUDA graphs), but one 1000x its datasheet's means the fit is running
# along a direction the measurements barely feel (then also weakly determined).
FACTOR_BOUNDS = (1e-6, 1e3)
_LOG_BOUNDS = tuple(float(np.log(b)) for b in FACTOR_BOUNDS)
# A loss this low is an exact fit (log ratios of ~1e-12: float64's noise).
_EXACT_FIT = 1e-24
# The smoothing temperature that lets a stalled fit past a kink, relative to the
# shortest measured step (0.01% to 1% all escaped where measured).
_ESCAPE = 1e-3
# Iterations of each of its two fits at most (kinks passed: 10-30; measurements
# nothing fits exactly would otherwise spend the whole budget twice).
_ESCAPE_STEPS = 20
# Measurement noise assumed when judging how well the fit determines a factor
# (relative, on every step time), and the factor change that is too much for it.
_NOISE = 0.01
_TOO_FAR = float(np.log(2.0))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` found.

    Attributes:
      topology: the calibrated topology (the base one with each field scaled).
      scales: per calibrated field, the factor it was multiplied by.
      unconstrained: calibrated fields no measured program depends on; their
        factor stayed where it started (1, unless ``initial_scales``).
      weakly_determined: calibrated fields whose factor a 1% error in the
        measured step times could move by more than a factor of 2 (from the
        fitted Jacobian): the programs barely depend on them, or cannot tell
        them from another field. Take those factors with care, or fit them
        from programs that lean on them (``calibration_probes``). The test is
        local: other figures far from these may fit as well (step times are
        piecewise linear in the figures' reciprocals).
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
    weakly_determined: tuple[str, ...] = ()

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
    steps: int | None = None,
    temperature: float | None = None,
    initial_scales: Mapping[str, float] | None = None,
) -> Calibration:
    """Scales ``topology``'s fields so that ``programs`` simulate in their ``measured`` step times.

    Args:
      programs: lowered programs (:func:`~distir_jax.lower.lower`), each for
        at most ``topology``'s devices; a program with size variants stands
        for one measurement per variant.
      measured: ``[B]`` measured step times in seconds, one per program (and variant).
      topology: the cluster the measurements come from, with its nominal numbers.
      fields: which of :data:`CALIBRATABLE_FIELDS` to fit (default: every one
        but :data:`NETWORK_FIELDS` that is not zero everywhere in ``topology``;
        a zero field cannot be scaled). With ``network_bandwidth`` (or
        ``network_latency``) the links between nodes get a factor of their own
        and ``link_bandwidth`` (``link_latency``) scales those within a node.
      optimizer: None for Levenberg-Marquardt (damped Gauss-Newton on the
        log ratios, with the kernel's Jacobian), or any optax transformation
        (``optax.adam(0.05)``, ``optax.lbfgs()``, ...) run on the loss's gradient.
      steps: most iterations (default: 100 for Levenberg-Marquardt, which stops
        once a step no longer lowers the loss; 500 optax steps).
      temperature: None for the exact timeline, or a smoothing scale in
        seconds (see :func:`~distir_jax.kernel.simulate`).
      initial_scales: factors to start the fit from, by field (fitted fields
        only; default 1 each), e.g. an earlier fit's ``scales``.

    Every factor stays within :data:`FACTOR_BOUNDS` (1e-6 to 1e3: a figure may
    all but vanish, as launch overheads under CUDA graphs, but not grow 1000x).

    Returns:
      A :class:`Calibration`.

    Raises:
      ValueError: for no programs, a measurement count that does not match
        them, a step time that is not a positive finite number, an unknown or
        zero field (a network field of a topology of one node), a program on
        more devices than ``topology`` has, a program that takes no time,
        ``steps < 1``, or an initial factor of a field not fitted or outside
        :data:`FACTOR_BOUNDS`.
    """
    return fit_factors(programs, measured, topology, fields, optimizer, steps, temperature, initial_scales)


def fit_factors(
    programs,
    measured,
    topology,
    fields,
    optimizer,
    steps,
    temperature,
    initial_scales,
    *,
    escape: bool = True,
) -> Calibration:
    """:func:`calibrate` (its arguments in order); ``escape=False`` leaves a fit
    stalled at a kink where it stopped (a caller that refits anyway saves the
    smoothed fit: see :func:`search.calibration.calibrate_configs`)."""
    checked_programs(programs, "calibrate")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.number))
    ):
        raise ValueError(f"temperature must be None or a number > 0, got {temperature!r}")
    _require_topology(topology)
    fields = _checked_fields(topology, fields)
    start = _checked_start(fields, initial_scales)
    steps = (100 if optimizer is None else 500) if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if optimizer is not None and not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ValueError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
    program = stack_programs(programs)
    measured = _checked_measured(measured, program.flops.shape[0])
    base = _hardware_of(program, topology)
    between = between_nodes(topology, base.num_devices)
    with jax.enable_x64(True):
        target = jnp.log(jnp.asarray(measured))

        def residual(theta):  # [B] log(simulated / measured)
            return _residual(theta, program, base, between, target, fields, temperature)

        # One compiled function of residuals and their Jacobian serves every step, the
        # checks below and later fits of programs of the same shapes (each compile of
        # the kernel costs seconds on a CPU).
        fixed = functools.partial(
            _linearized, program=program, base=base, between=between, target=target, fields=fields
        )
        linearized = functools.partial(fixed, temperature=temperature)

        def step_times(theta, known=None) -> tuple[np.ndarray, np.ndarray]:
            """Exact step times at ``theta`` and ``[B, F]`` their log's derivatives
            (``known``: ``linearized(theta)``, when a fit already has it)."""
            r, jac = (np.asarray(x) for x in (known or linearized(theta)))
            if temperature is not None:  # the smoothed times are not the exact ones
                return _exact_times(program, _scaled(base, between, fields, theta)), jac
            return measured * np.exp(r), jac

        initial, nominal_sensitivity = step_times(np.zeros(len(fields)))
        idle = np.flatnonzero(~(initial > 0))
        if idle.size:  # its log has no gradient: nothing to fit it by
            raise ValueError(f"program {idle[0]} simulates in 0 s (no op takes time); leave it out")
        theta, at_fit = start, None
        if optimizer is None:
            theta, losses, at_fit = _levenberg_marquardt(linearized, theta, steps)
            if temperature is None and escape:
                smooth = functools.partial(fixed, temperature=float(_ESCAPE * measured.min()))
                theta, losses, at_fit = _escape_kinks(linearized, smooth, theta, losses, at_fit, steps)
        else:
            theta, losses = _descend(residual, theta, optax.with_extra_args_support(optimizer), steps)
            if not np.isfinite(theta).all():
                raise ValueError(
                    f"the optimizer produced non-finite factors {dict(zip(fields, np.exp(theta).tolist()))}; "
                    "lower its learning rate, or use the default (optimizer=None)"
                )
        # Fields the programs depend on neither at the nominal figures nor at the
        # fitted ones. (A factor the fit drove to ~0 has no effect at the fitted
        # point, but the measurements said so: it stays.)
        predicted, sensitivity = step_times(theta, at_fit)
        most = np.maximum(np.abs(sensitivity).max(axis=0), np.abs(nominal_sensitivity).max(axis=0))
        unconstrained = tuple(f for f, s in zip(fields, most, strict=True) if s < _UNCONSTRAINED)
        weak = _weakly_determined(sensitivity, fields, unconstrained)
        if unconstrained:  # back where they started (nominal by default): nothing here moves them
            theta = np.where([f in unconstrained for f in fields], start, theta)
            predicted, _ = step_times(theta)
    scales = {f: float(np.exp(t)) for f, t in zip(fields, theta, strict=True)}
    return Calibration(
        topology=scaled_topology(topology, scales),
        scales=scales,
        unconstrained=unconstrained,
        weakly_determined=weak,
        measured=measured,
        initial=initial,
        predicted=predicted,
        losses=losses,
    )


def checked_programs(programs, caller: str) -> None:
    """Raises unless ``programs`` is a non-empty sequence of lowered Programs (what
    ``caller`` takes), naming the first that is not one."""
    if isinstance(programs, Program) or not isinstance(programs, Sequence):
        raise TypeError(f"programs must be a sequence of lowered Programs, got {type(programs).__name__}")
    if not programs:
        raise ValueError(f"{caller} needs at least one program")
    for i, program in enumerate(programs):
        _check_program(program, f"{caller}: program {i}")


def _residual(theta, program: Program, base: Hardware, between, target, fields: tuple, temperature):
    """``[B]`` log(simulated / measured) step times at log factors ``theta``
    (``between``: ``[D, D]`` which links join two nodes)."""
    hardware = _scaled(base, between, fields, theta)
    return jnp.log(simulate(program, hardware, temperature=temperature).step_time) - target


@functools.partial(jax.jit, static_argnames=("fields", "temperature"))
def _linearized(theta, *, program, base, between, target, fields, temperature):
    """:func:`_residual` and its ``[B, F]`` Jacobian (forward mode: a tangent per field)."""
    args = (program, base, between, target, fields, temperature)
    return _residual(theta, *args), jax.jacfwd(_residual)(theta, *args)


def _weakly_determined(jac: np.ndarray, fields: tuple[str, ...], skip: tuple[str, ...]) -> tuple[str, ...]:
    """Fields (other than ``skip``) whose factor a ``_NOISE`` error in the measured
    step times could move by more than ``_TOO_FAR`` (a factor of 2), from the
    fit's Jacobian ``[B, F]`` of log step times: ``NOISE * sqrt(diag((J^T J)^+))``,
    infinite along directions the programs cannot tell apart (fewer programs
    than fields, or fields that only ever act together)."""
    keep = [i for i, f in enumerate(fields) if f not in skip]
    if not keep:
        return ()
    jac = jac[:, keep]
    _, sv, vt = np.linalg.svd(jac, full_matrices=True)
    sv = np.concatenate([sv, np.zeros(len(keep) - len(sv))])  # missing ones: a null space
    null = sv <= 1e-12 * max(sv.max(), 1e-300)
    with np.errstate(divide="ignore"):
        spread = np.sqrt(np.sum(np.where(null, 0.0, vt / np.where(null, 1.0, sv)[:, None]).T ** 2, axis=1))
    spread = np.where(np.any(np.abs(vt[null]) > 1e-6, axis=0), np.inf, spread)
    return tuple(fields[i] for i, s in zip(keep, spread, strict=True) if _NOISE * s > _TOO_FAR)


def _escape_kinks(linearized, smooth, theta: np.ndarray, losses: np.ndarray, at_fit, steps: int) -> tuple:
    """Step times are piecewise linear in the figures' reciprocals, and Gauss-Newton
    can stop at a kink short of a fit the measurements allow (one set of six
    small-model steps: 0.4% off, the factors up to 80%). Where it stopped short,
    fit the smoothed timeline from there (its maxes soft, ``smooth``), then the
    exact one from that fit; keep whichever ends lower. Takes and returns
    ``(theta, losses, at_fit)`` as :func:`_levenberg_marquardt` gives them (the
    polish's losses after the fit's when it is kept)."""
    loss = float(np.mean(at_fit[0] ** 2))
    if loss < _EXACT_FIT:
        return theta, losses, at_fit
    smoothed, _, _ = _levenberg_marquardt(smooth, theta, min(steps, _ESCAPE_STEPS))
    polished, polish_losses, at_polished = _levenberg_marquardt(
        linearized, smoothed, min(steps, _ESCAPE_STEPS)
    )
    if float(np.mean(at_polished[0] ** 2)) < loss:
        return polished, np.concatenate([losses, polish_losses]), at_polished
    return theta, losses, at_fit


def _levenberg_marquardt(linearized, theta: np.ndarray, steps: int) -> tuple:
    """Minimizes ``mean(r ** 2)`` by damped Gauss-Newton steps (``linearized(theta)``:
    the residuals ``r`` and their Jacobian). Returns ``(theta, losses, (r, jac))``,
    the last two at the returned ``theta`` (callers need not evaluate it again).

    Step times are max-plus in the op costs, so the residuals are piecewise
    smooth in ``theta`` and nearly linear within a piece: Gauss-Newton lands
    on the measured times in a few iterations where first-order descent
    crawls along the narrow valleys of fits with similar programs. The
    damping (Marquardt's, scaled by each field's curvature) grows until a
    step lowers the loss, and the loop stops when none does.
    """
    r, jac = (np.asarray(x) for x in linearized(theta))
    loss, damping, losses = float(np.mean(r**2)), 1e-3, []
    for _ in range(steps):
        losses.append(loss)
        if loss < _EXACT_FIT:  # log ratios of ~1e-12: float64's noise over a program's sums
            break
        curvature = np.sqrt(np.sum(jac**2, axis=0)) + 1e-12  # zero for unconstrained fields
        while damping < 1e12:
            # (J^T J + damping D^2) delta = -J^T r, as least squares (stable when J^T J is singular).
            system = np.vstack([jac, np.diag(np.sqrt(damping) * curvature)])
            delta = np.linalg.lstsq(system, np.concatenate([-r, np.zeros(len(theta))]), rcond=None)[0]
            delta = np.clip(theta + delta, *_LOG_BOUNDS) - theta  # factors stay in FACTOR_BOUNDS
            # The Jacobian comes along (the next step needs it where this one is taken).
            trial, trial_jac = (np.asarray(x) for x in linearized(theta + delta))
            # A step that overflows a factor (a direction the programs hardly feel can
            # run far) gives non-finite times or slopes: a shorter step then.
            if np.mean(trial**2) < loss and np.isfinite(trial_jac).all():
                break
            damping *= 4.0
        else:
            break  # no step lowers the loss: a minimum
        theta, r, jac = theta + delta, trial, trial_jac
        loss, damping = float(np.mean(r**2)), max(damping / 3.0, 1e-12)
    return theta, np.asarray(losses), (r, jac)


def _descend(residual, theta: np.ndarray, optimizer, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` of ``optimizer`` on ``mean(residual(theta) ** 2)``, in one compiled scan."""

    def loss(t):
        return jnp.mean(residual(t) ** 2)

    def step(carry, _):
        t, state = carry
        # Forward mode: at most 5 tangents, where reverse mode through the scan keeps
        # every step's residuals and scatters each gather's cotangent into a whole table.
        grad, value = jax.jacfwd(lambda u: (loss(u),) * 2, has_aux=True)(t)
        # Line-search optimizers (optax.lbfgs) also read the value and the loss itself.
        updates, state = optimizer.update(grad, state, t, value=value, grad=grad, value_fn=loss)
        return (jnp.clip(optax.apply_updates(t, updates), *_LOG_BOUNDS), state), value

    run = jax.jit(lambda t: jax.lax.scan(step, (t, optimizer.init(t)), length=steps))
    (theta, _), losses = run(jnp.asarray(theta))
    return np.asarray(theta), np.asarray(losses)


def calibration_probes(network_peer: int | None = None) -> dict[str, Function]:
    """Small programs that each lean on one hardware figure: time the same work on
    a cluster (f32, devices 0 and 1), then :func:`calibrate` with their lowered forms.

    Args:
      network_peer: a device on another node than device 0 (8 on DGX nodes),
        for two more probes that send to it, or None.

    Returns:
      By name: ``matmul`` ([4096, 4096] @ [4096, 4096]: peak FLOP/s),
      ``elementwise`` (Relu of [8192, 8192]: memory bandwidth), ``large_send``
      ([4096, 4096] from device 0 to 1: link bandwidth), ``tiny_send`` (4 floats:
      link latency), ``launches`` (20 Relus of 8 floats in a row: kernel launch
      overhead) and ``mixed`` (MatMul, Relu, Send, MatMul over both devices);
      with ``network_peer``, ``large_network_send`` and ``tiny_network_send``
      (the sends to it: ``network_bandwidth`` and ``network_latency``).

    Raises:
      ValueError: for a ``network_peer`` that is not an int >= 1.
    """
    if network_peer is not None and (
        isinstance(network_peer, bool) or not isinstance(network_peer, (int, np.integer)) or network_peer < 1
    ):
        raise ValueError(f"network_peer must be None or a device index >= 1, got {network_peer!r}")

    def build(name: str, body) -> Function:
        b = FunctionBuilder(name)
        return b.build(body(b))

    def launches(b):
        y = b.input("x", (8,))
        for _ in range(20):
            y = b.add("Relu", y)
        return y

    def mixed(b):
        h = b.add("Relu", b.add("MatMul", b.input("x", (1024, 1024)), b.input("w", (1024, 1024))))
        return b.add("MatMul", b.add("Send", h, to=1), b.input("w1", (1024, 1024), device=1))

    bodies = {
        "matmul": lambda b: b.add("MatMul", b.input("x", (4096, 4096)), b.input("w", (4096, 4096))),
        "elementwise": lambda b: b.add("Relu", b.input("x", (8192, 8192))),
        "large_send": lambda b: b.add("Send", b.input("x", (4096, 4096)), to=1),
        "tiny_send": lambda b: b.add("Send", b.input("x", (4,)), to=1),
        "launches": launches,
        "mixed": mixed,
    }
    if network_peer is not None:
        peer = int(network_peer)
        bodies["large_network_send"] = lambda b: b.add("Send", b.input("x", (4096, 4096)), to=peer)
        bodies["tiny_network_send"] = lambda b: b.add("Send", b.input("x", (4,)), to=peer)
    return {name: build(name, body) for name, body in bodies.items()}


def _checked_fields(topology: Topology, fields) -> tuple[str, ...]:
    values = _field_values(topology)
    nonzero = tuple(f for f in CALIBRATABLE_FIELDS if np.any(values[f] != 0))
    if fields is None:
        return tuple(f for f in nonzero if f not in NETWORK_FIELDS)
    fields = named_fields(fields)
    zero = [f for f in fields if f not in nonzero]
    if zero:
        raise ValueError(
            f"fields {zero} are 0 everywhere in topology {topology.name!r}"
            + ("" if between_nodes(topology).any() else " (one node: no links between nodes)")
            + ": no factor moves them; leave them out"
        )
    return fields


def _field_values(topology: Topology) -> dict[str, np.ndarray]:
    """Each of :data:`CALIBRATABLE_FIELDS`' figures in ``topology``; a network
    field's are its link table's entries between nodes (none on one node)."""
    values = {f: np.asarray(getattr(topology, f)) for f in CALIBRATABLE_FIELDS if f not in NETWORK_FIELDS}
    between = between_nodes(topology)
    for network, link in NETWORK_FIELDS.items():
        values[network] = values[link][between]
    return values


def between_nodes(topology: Topology, count: int | None = None) -> np.ndarray:
    """``[D, D]`` whether each link of ``topology``'s first ``count`` devices (default:
    all) joins two nodes: the entries :data:`NETWORK_FIELDS` scale."""
    nodes = np.asarray(topology.node_of_device)[: topology.num_devices if count is None else count]
    return nodes[:, None] != nodes[None, :]


def named_fields(fields) -> tuple[str, ...]:
    """``fields`` (a name of :data:`CALIBRATABLE_FIELDS` or a sequence of them) as a
    tuple; a ValueError names what is unknown, repeated or missing."""
    if not isinstance(fields, (str, Sequence)) or isinstance(fields, (bytes, bytearray)):
        raise ValueError(f"fields must be a field name or a sequence of them, got {fields!r}")
    fields = (fields,) if isinstance(fields, str) else tuple(fields)
    # (Names as plain str: NumPy's string scalars would otherwise key the results.)
    fields = tuple(str(f) if isinstance(f, str) else f for f in fields)
    unknown = [f for f in fields if f not in CALIBRATABLE_FIELDS]
    if unknown:
        raise ValueError(f"fields: unknown {unknown}; expected some of {list(CALIBRATABLE_FIELDS)}")
    if not fields or len(set(fields)) < len(fields):
        raise ValueError(f"fields must be distinct names, at least one, got {list(fields)}")
    return fields


def _checked_start(fields: tuple[str, ...], initial_scales) -> np.ndarray:
    """``[F]`` log factors to start from (``initial_scales`` by field, 1 where absent)."""
    if initial_scales is None:
        return np.zeros(len(fields))
    if not isinstance(initial_scales, Mapping):
        kind = type(initial_scales).__name__
        raise ValueError(f"initial_scales must map field names to factors, got {kind}")
    others = sorted(set(initial_scales) - set(fields))
    if others:
        raise ValueError(f"initial_scales: {others} are not among the fitted fields {list(fields)}")
    start = []
    for field in fields:
        factor = initial_scales.get(field, 1.0)
        factor = factor.item() if isinstance(factor, np.ndarray) and factor.ndim == 0 else factor
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float, np.number))
            or not (FACTOR_BOUNDS[0] <= factor <= FACTOR_BOUNDS[1])
        ):
            raise ValueError(
                f"initial_scales[{field!r}] must be a number in [{FACTOR_BOUNDS[0]:g}, "
                f"{FACTOR_BOUNDS[1]:g}] (FACTOR_BOUNDS), got {factor!r}"
            )
        start.append(np.log(float(factor)))
    return np.asarray(start)


def _checked_measured(measured, count: int) -> np.ndarray:
    raw = np.asarray(measured) if not isinstance(measured, Mapping) else None
    if raw is None or raw.dtype.kind not in "iuf":
        kind = type(measured).__name__ if raw is None else f"{raw.dtype} values"
        raise ValueError(f"measured must be numbers of seconds (a sequence or array), got {kind}")
    measured = raw.astype(np.float64)
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


def step_times_on(programs: Sequence[Program], topology: Topology) -> np.ndarray:
    """``[B]`` step times of lowered programs (each for at most ``topology``'s
    devices; with size variants, one per variant) on ``topology``: exact
    semantics, float64, as :attr:`Calibration.predicted` gives them."""
    program = stack_programs(programs)
    hardware = _hardware_of(program, topology)
    with jax.enable_x64(True):
        return _exact_times(program, hardware)


def _hardware_of(program: Program, topology: Topology) -> Hardware:
    """The float64 hardware of ``topology``'s first devices, as many as ``program``
    (stacked) is lowered for."""
    _require_topology(topology)
    devices = program.resident_bytes.shape[-1]
    if devices > topology.num_devices:
        raise ValueError(
            f"the programs are lowered for up to {devices} devices but topology {topology.name!r} has "
            f"{topology.num_devices}; lower them for this topology"
        )
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), _first_devices(topology, devices))


def _require_topology(topology) -> None:
    """A TypeError naming what ``topology`` is, rather than an AttributeError from the
    first field read off it."""
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology (get_preset, ...), got {type(topology).__name__}")


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


def _scaled(base: Hardware, between, fields: tuple[str, ...], theta) -> Hardware:
    """``base`` with field ``fields[i]`` scaled by ``exp(theta[i])`` (see :func:`_scale_figures`)."""
    factors = {f: jnp.exp(theta[i]) for i, f in enumerate(fields)}
    return base.replace(**_scale_figures(lambda f: getattr(base, f), factors, between, jnp))


def _scale_figures(figure, factors: Mapping, between, xp=np) -> dict:
    """The figures ``factors`` scale, scaled: ``{field: figure(field) * factor}``, where
    a network field's factor scales its link table's entries ``between`` nodes
    (``[D, D]`` bools) and the link field's, if given, the others (see
    :data:`NETWORK_FIELDS`). Written once for NumPy and ``jax.numpy`` (``xp``)."""
    scaled = {f: figure(f) * factor for f, factor in factors.items() if f not in NETWORK_FIELDS}
    for network, link in NETWORK_FIELDS.items():
        if network in factors:
            within = factors.get(link, 1.0)
            scaled[link] = figure(link) * xp.where(between, factors[network], within)
    return scaled


def _exact_times(program: Program, hardware: Hardware) -> np.ndarray:
    """``[B]`` step times on ``hardware``, exact semantics, on the host."""
    return np.asarray(simulate(program, hardware).step_time, np.float64)


def check_scales(scales: Mapping[str, float]) -> None:
    """Raises ValueError unless ``scales`` maps some of :data:`CALIBRATABLE_FIELDS`
    to positive finite factors (as :func:`scaled_topology` and
    :func:`~distir_jax.presets.register_calibrated_preset` take them)."""
    unknown = sorted(set(scales) - set(CALIBRATABLE_FIELDS))
    if unknown:
        raise ValueError(f"scales: unknown field(s) {unknown}; expected some of {list(CALIBRATABLE_FIELDS)}")
    for field, factor in scales.items():
        number = isinstance(factor, (int, float, np.number)) and not isinstance(factor, (bool, np.bool_))
        if not (number and np.isfinite(factor) and factor > 0):
            raise ValueError(f"scales[{field!r}] must be a positive finite number, got {factor!r}")


def scaled_topology(topology: Topology, scales: Mapping[str, float]) -> Topology:
    """``topology`` with each field in ``scales`` multiplied by its factor (a new
    object, named ``"<name> (calibrated)"``); a network field's factor scales the
    links between nodes, and its link field's then only those within a node
    (see :data:`NETWORK_FIELDS`).

    Raises:
      ValueError: for a field not in :data:`CALIBRATABLE_FIELDS` or a factor
        that is not a positive finite number.
    """
    check_scales(scales)
    figure = lambda f: np.asarray(getattr(topology, f))  # noqa: E731
    changes = _scale_figures(figure, scales, between_nodes(topology))
    if "launch_overhead" in changes:
        changes["launch_overhead"] = float(changes["launch_overhead"])
    return dataclasses.replace(topology, name=f"{topology.name} (calibrated)", **changes)


# --- Calibration files: a calibrated preset that another process (the CLI) can load ---

CALIBRATION_FORMAT = "distir-jax calibrated preset"
CALIBRATION_VERSION = 1


def save_calibration(path: str | os.PathLike, name: str, base: str, scales: Mapping[str, float]) -> None:
    """Writes preset ``name`` (``base`` scaled by ``scales``, as
    :func:`~distir_jax.presets.register_calibrated_preset` takes them) to a JSON file,
    after checking it registers; :func:`load_calibration` reads it back."""
    register_calibrated_preset(name, base, scales)
    text = {
        "format": CALIBRATION_FORMAT,
        "version": CALIBRATION_VERSION,
        "name": name,
        "base": base,
        "scales": {field: float(factor) for field, factor in scales.items()},
    }
    with open(path, "w") as f:
        json.dump(text, f, indent=1)
        f.write("\n")


def load_calibration(path: str | os.PathLike) -> str:
    """Registers the calibrated preset of a :func:`save_calibration` file (again: a no-op)
    and returns its name.

    Raises:
      ValueError: for a file that is not such a file (named, with what is wrong),
        or a preset that clashes with another of the same name.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"calibration file {os.fspath(path)!r}: {err}") from None
    keys = {"format", "version", "name", "base", "scales"}
    if not (isinstance(data, dict) and data.get("format") == CALIBRATION_FORMAT and set(data) == keys):
        raise ValueError(
            f"calibration file {os.fspath(path)!r}: expected a JSON object with keys {sorted(keys)} "
            f"and format {CALIBRATION_FORMAT!r}, as save_calibration writes"
        )
    if data["version"] != CALIBRATION_VERSION or not isinstance(data["scales"], dict):
        raise ValueError(
            f"calibration file {os.fspath(path)!r}: version {data['version']!r} with scales "
            f"{data['scales']!r}; this release reads version {CALIBRATION_VERSION} with a scales object"
        )
    try:
        register_calibrated_preset(data["name"], data["base"], data["scales"])
    except ValueError as err:
        raise ValueError(f"calibration file {os.fspath(path)!r}: {err}") from None
    return data["name"]
