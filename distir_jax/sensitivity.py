"""What each hardware figure is worth to a program: step-time elasticities, by
forward-mode differentiation through the timeline kernel.

``step_time_elasticities(programs, topology)[field][b]`` is ``d log(step time)
/ d log(figure)`` of program ``b``, the figure (one of
:data:`~distir_jax.calibrate.CALIBRATABLE_FIELDS`) scaled on every device and
link at once; on a cluster of several nodes the links between nodes
(``network_bandwidth``, ``network_latency``: InfiniBand) count apart from
those within a node (``link_*``: NVLink), so it also says which fabric
bounds the step. -0.9 for ``peak_flops`` says 1% more FLOP/s shortens the step by
~0.9%: the step is compute-bound; +0.05 for ``link_latency``, that 1% more
latency lengthens it by ~0.05%. It answers "what bounds this strategy on this
cluster" beyond the compute / communication / bubble split of a result row,
which cannot say whether communication that overlaps compute still delays
the step: the derivative follows the critical path through the whole
timeline, overlap and pipeline bubbles included.

Budget: a step time is homogeneous in the figures. Scaling every speed (peak
FLOP/s, memory and link bandwidth) by ``s`` and every time (link latency,
launch overhead) by ``1 / s`` scales every op, hence the step, by ``1 / s``;
so the speeds' elasticities minus the times' add up to -1 (Euler's theorem),
and each figure's share of the step is its elasticity's size.

The derivative is local. A step time is piecewise linear in the figures'
reciprocals, and where two paths tie for the critical one (symmetric
pipelines do), JAX's derivative of a max averages the tied branches: the
value lies between the rates of shortening and of lengthening the figure,
and the budget above still holds (tied branches are equal in value, so any
average of them is homogeneous too). Rooflines tie only where an op's
flops and bytes take exactly equally long.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from distir_jax.calibrate import (
    CALIBRATABLE_FIELDS,
    NETWORK_FIELDS,
    _hardware_of,
    _linearized,
    between_nodes,
    checked_programs,
    named_fields,
)
from distir_jax.ir.topology import Topology
from distir_jax.lower import Program, stack_programs

__all__ = ["SPEED_FIELDS", "TIME_FIELDS", "step_time_elasticities"]

# Figures that make an op faster as they grow, and those that make it slower.
SPEED_FIELDS = ("peak_flops", "memory_bandwidth", "link_bandwidth", "network_bandwidth")
TIME_FIELDS = ("link_latency", "launch_overhead", "network_latency")


def step_time_elasticities(
    programs: Sequence[Program], topology: Topology, fields: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """``d log(step time) / d log(figure)`` of each program, per hardware figure.

    Args:
      programs: lowered programs (:func:`~distir_jax.lower.lower`), each for
        at most ``topology``'s devices; a program with size variants gives
        one value per variant.
      topology: the cluster, at the figures to differentiate at.
      fields: figures of :data:`~distir_jax.calibrate.CALIBRATABLE_FIELDS`
        (default: all, the network ones only where the programs' devices
        span nodes). A figure that is 0 in ``topology`` (no launch
        overhead, no links between nodes) has elasticity 0. With
        ``network_bandwidth`` (``network_latency``), ``link_bandwidth``
        (``link_latency``) is the links within a node, and the network one
        those between nodes; without, ``link_*`` is every link (the sum of the two).

    Returns:
      ``{field: [B] elasticities}`` in ``fields``' order; exact semantics,
      float64, from one forward-mode Jacobian (one kernel call with a
      tangent per field).

    Raises:
      TypeError: when ``programs`` is not a sequence of lowered Programs, or
        ``topology`` not a Topology.
      ValueError: for no programs, an unknown or repeated field, a program
        on more devices than ``topology`` has, or one (or one size variant)
        that takes no time.
    """
    checked_programs(programs, "step_time_elasticities")
    program = stack_programs(programs)
    base = _hardware_of(program, topology)
    between = between_nodes(topology, base.num_devices)
    if fields is None:
        fields = tuple(f for f in CALIBRATABLE_FIELDS if f not in NETWORK_FIELDS or between.any())
    else:
        fields = named_fields(fields)
    batch = program.flops.shape[0]
    with jax.enable_x64(True):
        # log step time and its Jacobian: the calibration's residual against a target of 1 s.
        log_time, jac = _linearized(
            np.zeros(len(fields)),
            program=program,
            base=base,
            between=between,
            target=np.zeros(batch),
            fields=fields,
            temperature=None,
        )
    idle = np.flatnonzero(~np.isfinite(np.asarray(log_time)))
    if idle.size:
        # The rows are size variants, not programs: name the program the caller passed (and its variant).
        rows = [
            (i, f" (size variant {s})" if p.flops.ndim == 2 else "")
            for i, p in enumerate(programs)
            for s in range(p.flops.shape[0] if p.flops.ndim == 2 else 1)
        ]
        i, variant = rows[idle[0]]
        raise ValueError(f"program {i}{variant} simulates in 0 s (no op takes time): it has no elasticities")
    jac = np.asarray(jac, np.float64)
    return {field: jac[:, i] for i, field in enumerate(fields)}
