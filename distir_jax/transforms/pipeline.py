"""Pipeline parallelism: stages of layers, microbatches and a schedule.

:func:`pipeline_parallel` cuts a training program by its ``layer`` attribute
into ``p * v`` contiguous chunks (chunk ``c`` on pipeline device ``c % p``),
splits the batch into ``k`` microbatches and copies every forward and backward
op once per microbatch. Values that cross devices go by ``Send``: forward
activations to the next stage, activation gradients back to the previous one.
Forward values the backward reads are simply kept until their last use: the
memory model frees a buffer after its last consumer, so the activations a
schedule keeps in flight (``k`` per stage for GPipe, ``p - s`` for 1F1B)
follow from the issue order alone.

Weight gradients are summed over microbatches by ``Add(inplace=True)`` ops in
microbatch order (a running sum, issued as soon as the next microbatch's
gradient exists, added into in place as frameworks accumulate gradients),
then each weight gets its single optimizer op. Loss ops get
``shards *= k``, so the microbatch losses and gradients add up to the
original's.

Issue order: every device runs its steps in the schedule's order; the steps
of all devices are interleaved by their estimated start times (per-step
flops, see :func:`~distir_jax.transforms.schedules.estimated_issue_order`), each
``Send`` placed where its two devices come free together, and the optimizer
ops follow after the flush. New ops carry the ``layer`` / ``phase`` of the op
they serve and ``stage`` (pipeline device; a ``Send``'s receiver), ``chunk``
and ``microbatch``; copied ops keep their attributes and gain the same three.

Devices: a program with ``D`` devices (for example ``t`` tensor-parallel
ranks) becomes one with ``p * D``; old device ``d`` of pipeline device ``s``
is ``s * D + d``, and a ``Send`` goes between corresponding ranks. Inputs are
placed on the pipeline device(s) that use them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from distir_jax.ir._gc import gc_paused
from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.registry import op_features
from distir_jax.ir.typecheck import infer_op_types, infer_types
from distir_jax.ir.types import TensorType, dim_divides, dim_str
from distir_jax.models.contract import grad_of
from distir_jax.transforms.base import Distributed, InputSlice, Program, Recipe, as_distributed
from distir_jax.transforms.schedules import DIRECTIONS, Schedule, Step, estimated_issue_order, make_schedule

# Inputs named l<layer>.<...> are weights or optimizer state; the rest are
# data, whose axis 0 is the batch (the model contract).
_WEIGHT_RE = re.compile(r"^l\d+\.")
_OPT = "O"  # the kind of optimizer ops, next to the step directions "F" and "B"


@gc_paused
def pipeline_parallel(
    program: Program,
    degree: int,
    microbatches: int,
    *,
    schedule="1f1b",
    virtual_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    overlap_sends: bool = False,
    representative_only: bool = False,
) -> Distributed:
    """Pipelines a training program over ``degree`` stages.

    Args:
      program: a :class:`Function` following the model contract, or a
        :class:`Distributed` (e.g. already tensor parallel).
      degree: pipeline devices ``p`` (stages).
      microbatches: ``k``; must divide the batch of every data input.
      schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved"`` or a custom
        schedule, ``{device: [(chunk, microbatch, "F" | "B"), ...]}``.
      virtual_stages: chunks per device ``v`` (``"interleaved"`` or custom).
      boundaries: optional partition, the first block of each chunk but the
        first: ``p * v - 1`` increasing layers in ``[2, L]``. By default
        blocks are split to minimise the largest chunk's forward + backward
        flops; layer 0 (embedding) goes with the first chunk and layer
        ``L + 1`` (head, loss) with the last.
      overlap_sends: put the ``Send`` ops on stream 1, a communication stream,
        so transfers overlap compute (asynchronous point-to-point, as in
        Megatron-LM). By default they share the compute stream, DistIR's
        semantics: a ``Send`` is a barrier between its two devices, which
        costs the interleaved schedule part of its gain.
      representative_only: accepted for a uniform interface with the other
        transforms; pipeline stages are not replicas of each other, so the
        whole program is always kept.

    Returns:
      A :class:`Distributed` relating the pipelined program to the original.
      The loss's recipe is the ``"sum"`` of the ``k`` microbatch losses
      (``loss.mb{j}``, already scaled by ``shards``); updated weights are
      leaves on their stage's device.

    Raises:
      ValueError: naming the parameter, its value and the constraint: degree
        or microbatches below 1, degree (times virtual_stages) above the
        number of layers, microbatches not dividing the batch, an unknown
        schedule name, the interleaved schedule with microbatches not a
        multiple of degree, bad boundaries, or an invalid custom schedule.
    """
    dist = as_distributed(program)
    fn = dist.function
    if any(v.type is None for op in fn.ops for v in op.outputs):
        fn = infer_types(fn)
    for name, value in (
        ("degree", degree),
        ("microbatches", microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    for name, value in (("overlap_sends", overlap_sends), ("representative_only", representative_only)):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be a bool, got {name}={value!r}")
    p, k, v = int(degree), int(microbatches), int(virtual_stages)
    kinds, layers = _classify(fn)
    num_blocks = max(layers, default=1) - 1
    if p * v > num_blocks:
        what = f"degree={p}" if v == 1 else f"degree * virtual_stages = {p} * {v} = {p * v}"
        raise ValueError(
            f"{what} exceeds the number of layers ({num_blocks} blocks in function {fn.name}); "
            "each chunk needs at least one layer"
        )
    plan_schedule = make_schedule(schedule, p, k, v)
    data = {n for n in (x.name for x in fn.inputs) if not _WEIGHT_RE.match(dist.inputs[n].source)}
    _check_batch(fn, data, k)
    costs = _layer_costs(fn, layers, num_blocks)
    if boundaries is None:
        boundaries = balanced_boundaries(costs, p * v)
    chunk_of_layer = _chunk_of_layer(boundaries, p * v, num_blocks)
    chunks = [chunk_of_layer[layer] for layer in layers]
    step = _Builder(fn, p, k, plan_schedule, kinds, chunks, data, bool(overlap_sends)).build()
    return dist.then(step)


def balanced_boundaries(layer_costs: Sequence[float], num_chunks: int) -> tuple[int, ...]:
    """Contiguous partition of blocks ``1..L`` minimising the costliest chunk.

    Args:
      layer_costs: cost of layers ``0..L+1``; layer 0 is charged to the first
        chunk and layer ``L + 1`` to the last.
      num_chunks: chunks ``n``, ``1 <= n <= L``.

    Returns:
      The first block of chunks ``1..n-1``. Among partitions with the same
      largest chunk, the one with the smallest sum of squared chunk costs; on
      a further tie, the one whose chunks end earliest.
    """
    blocks = len(layer_costs) - 2
    if num_chunks == blocks:  # one block per chunk: the only partition
        return tuple(range(2, blocks + 1))
    prefix = np.concatenate([[0.0], np.cumsum(layer_costs[1:-1], dtype=np.float64)])
    a = np.arange(blocks + 1)[:, None]  # a chunk holds blocks a+1..b
    b = np.arange(blocks + 1)[None, :]
    extra = np.where(a == 0, float(layer_costs[0]), 0.0) + np.where(b == blocks, float(layer_costs[-1]), 0.0)
    cost = (prefix[None, :] - prefix[:, None]) + extra  # [a, b]
    cost_squared, upper = cost * cost, a < b
    # best[i][b]: (largest chunk, sum of squares) of i chunks over blocks 1..b, a
    # dynamic program over chunks, each step vectorized over (a, b). Chunk i
    # can only start after block i - 1 and end by block blocks - (n - i): each
    # step reads that band only.
    worst = np.full(blocks + 1, np.inf)
    squares = np.full(blocks + 1, np.inf)
    worst[0] = squares[0] = 0.0
    choice = np.zeros((num_chunks, blocks + 1), np.int64)
    for i in range(1, num_chunks + 1):
        rows, cols = slice(i - 1, blocks - (num_chunks - i)), slice(i, blocks - (num_chunks - i) + 1)
        before = worst[rows, None]
        ok = upper[rows, cols] & np.isfinite(before)
        cand_worst = np.where(ok, np.maximum(before, cost[rows, cols]), np.inf)
        cand_squares = np.where(ok, squares[rows, None] + cost_squared[rows, cols], np.inf)
        low = cand_worst.min(axis=0)
        tied = cand_worst == low
        sq = np.where(tied, cand_squares, np.inf)
        low_sq = sq.min(axis=0)
        pick = (i - 1) + np.argmax(tied & (sq == low_sq), axis=0)  # the first (smallest a) on ties
        worst = np.full(blocks + 1, np.inf)
        squares = np.full(blocks + 1, np.inf)
        worst[cols], squares[cols] = low, low_sq  # inf where no partition reaches b
        choice[i - 1, cols] = np.where(np.isfinite(low), pick, 0)
    cuts, j = [], blocks
    for i in range(num_chunks, 0, -1):
        j = int(choice[i - 1][j])
        cuts.append(j + 1)
    return tuple(reversed(cuts[:-1]))


# --------------------------------------------------------------------------- #
# Analysis of the input program.


def _classify(fn: Function) -> tuple[list[str], list[int]]:
    """Kind (``F``, ``B`` or optimizer) and layer of every op; checks the annotations."""
    kinds, layers = [], []
    for i, op in enumerate(fn.ops):
        layer, phase = op.attr("layer"), op.attr("phase")
        if type(layer) is not int or layer < 0 or phase not in ("fwd", "bwd", "opt"):
            raise ValueError(
                f"op #{i} {op.op_type} has layer={layer!r}, phase={phase!r}; pipeline_parallel needs "
                "every op annotated with an int layer >= 0 and phase fwd, bwd or opt (the model contract)"
            )
        # Recomputed forward copies run just before their layer's backward.
        recomputed = phase == "fwd" and op.attr("recompute", False)
        kinds.append(_OPT if phase == "opt" else "B" if phase == "bwd" or recomputed else "F")
        layers.append(layer)
    producer = fn.producers()
    for i, op in enumerate(fn.ops):
        if kinds[i] == _OPT:
            continue
        for x in op.inputs:
            if x.name not in producer:
                continue
            j = producer[x.name]
            forward_ok = kinds[j] == "F" and (kinds[i] == "B" or layers[j] <= layers[i])
            backward_ok = kinds[j] == "B" and kinds[i] == "B" and layers[j] >= layers[i]
            if not (forward_ok or backward_ok):
                raise ValueError(
                    f"op #{i} {op.op_type} (layer {layers[i]}, {op.attr('phase')}) reads %{x.name} from "
                    f"op #{j} (layer {layers[j]}, {fn.ops[j].attr('phase')}); a pipeline needs forward "
                    "values to flow to later layers and gradients to earlier ones"
                )
    return kinds, layers


def _check_batch(fn: Function, data: set[str], k: int) -> None:
    for x in fn.inputs:
        if x.name not in data:
            continue
        if x.type.rank == 0 or not dim_divides(x.type.shape[0], k):
            batch = dim_str(x.type.shape[0]) if x.type.rank else "none (a scalar)"
            raise ValueError(
                f"microbatches={k} must divide the batch (axis 0) of every data input; "
                f"%{x.name} has batch size {batch}"
            )


def _op_flops(op: Op) -> float:
    f = op_features(op)
    # Size variants: balance for their mean.
    return float(np.mean(np.asarray(f.flops, dtype=np.float64)))


def _layer_costs(fn: Function, layers: list[int], num_blocks: int) -> list[float]:
    """Forward + backward flops of layers ``0..L+1`` (all devices together)."""
    costs = [0.0] * (num_blocks + 2)
    for op, layer in zip(fn.ops, layers, strict=True):
        if op.attr("phase") != "opt":
            costs[layer] += _op_flops(op)
    return costs


def _chunk_of_layer(boundaries, n: int, num_blocks: int) -> list[int]:
    ok = (
        isinstance(boundaries, Sequence)
        and len(boundaries) == n - 1
        and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in boundaries)
        and all(2 <= b <= num_blocks for b in boundaries)
        and all(a < b for a, b in zip(boundaries[:-1], boundaries[1:], strict=True))
    )
    if not ok:
        raise ValueError(
            f"boundaries must list the first layer of chunks 1..{n - 1}: {n - 1} strictly increasing "
            f"ints in [2, {num_blocks}] (blocks are layers 1..{num_blocks}), got boundaries={boundaries!r}"
        )
    starts = [1] + [int(b) for b in boundaries]
    chunk = [0] * (num_blocks + 2)
    for c, start in enumerate(starts):
        for layer in range(start, num_blocks + 1):
            chunk[layer] = c
    chunk[num_blocks + 1] = n - 1
    return chunk


def _device_count(fn: Function) -> int:
    found = set(fn.devices)
    for op in fn.ops:
        for key in ("to", "devices", "group"):
            value = op.attr(key)
            if value is not None:
                found.update(int(d) for d in (value if isinstance(value, tuple) else (value,)))
    return 1 + max(found, default=0)


def _shift_devices(attrs: dict, offset: int) -> dict:
    """Moves device-valued attributes (Send's ``to``, collective groups) by ``offset``."""
    if "to" in attrs:
        attrs["to"] = int(attrs["to"]) + offset
    for key in ("devices", "group"):
        if key in attrs:
            attrs[key] = tuple(int(d) + offset for d in attrs[key])
    return attrs


# --------------------------------------------------------------------------- #
# Emission.


class _Builder:
    """Emits the pipelined program: inputs, per-step op copies, Sends, sums, optimizer."""

    def __init__(self, fn, p, k, schedule: Schedule, kinds, chunks, data, overlap_sends):
        self.fn, self.p, self.k, self.schedule = fn, p, k, schedule
        self.send_attrs = {"stream": 1} if overlap_sends else {}
        self.kinds, self.chunks, self.data = kinds, chunks, data
        self.width = _device_count(fn)  # D: devices per stage
        self.num_chunks = max(chunks, default=0) + 1
        self.producer = fn.producers()
        self.types: dict[str, TensorType] = {}
        self.values: dict[str, Value] = {}  # the same names, as Values (made once, reused as operands)
        self.ops: list[Op] = []
        self.inputs: list[Value] = []
        self.slices: dict[str, InputSlice] = {}
        # (old name, microbatch or None, pipeline device) -> new name.
        self.local: dict[tuple, str] = {}
        self.items: dict[tuple[int, str], list[int]] = {}
        for i, kind in enumerate(kinds):
            if kind != _OPT:
                self.items.setdefault((chunks[i], kind), []).append(i)
        consumed_by_opt = {x.name for i, op in enumerate(fn.ops) if kinds[i] == _OPT for x in op.inputs}
        # The last len(grad_of) outputs of an op are the gradients it names.
        grads = {x.name for op in fn.ops for x in op.outputs[len(op.outputs) - len(grad_of(op)) :]}
        outputs = {x.name for x in fn.outputs}
        # Per-microbatch values summed over microbatches: what the optimizer reads.
        self.summed = {
            x.name
            for i, op in enumerate(fn.ops)
            if kinds[i] != _OPT
            for x in op.outputs
            if x.name in consumed_by_opt or (x.name in outputs and x.name in grads)
        }
        self.partial: dict[str, dict] = {}

    def device_of(self, chunk: int) -> int:
        return chunk % self.p

    # -- values ------------------------------------------------------------ #

    def _define(self, name: str, type_: TensorType) -> Value:
        if name in self.types:
            raise ValueError(
                f"pipeline_parallel: value name %{name} would be defined twice; rename the "
                "original value so that it does not collide with a generated name"
            )
        self.types[name] = type_
        value = self.values[name] = Value(name, type_)
        return value

    def _emit(self, op_type: str, in_names, out_names, attrs: dict) -> None:
        ins = tuple([self.values[n] for n in in_names])
        probe = Op(op_type, ins, (), attrs)
        out_types = infer_op_types(probe, len(self.ops), tuple(x.type for x in ins))
        outs = tuple(self._define(n, t) for n, t in zip(out_names, out_types, strict=True))
        self.ops.append(probe._with_values(ins, outs))

    def _declare_inputs(self) -> None:
        users: dict[str, set[int]] = {}
        for i, op in enumerate(self.fn.ops):
            for x in op.inputs:
                users.setdefault(x.name, set()).add(self.device_of(self.chunks[i]))
        for x in self.fn.inputs:
            stages = sorted(users.get(x.name, {0}))
            for s in stages:
                device = x.type.device + s * self.width
                if x.name not in self.data:
                    name = x.name if len(stages) == 1 else f"{x.name}.s{s}"
                    self.inputs.append(self._define(name, x.type.on(device)))
                    self.slices[name] = InputSlice(x.name)
                    self.local[(x.name, None, s)] = name
                    continue
                shape = (x.type.shape[0] // self.k,) + tuple(x.type.shape[1:])
                for j in range(self.k):
                    name = f"{x.name}.mb{j}" if len(stages) == 1 else f"{x.name}.s{s}.mb{j}"
                    self.inputs.append(self._define(name, TensorType(shape, x.type.dtype, device)))
                    sl = InputSlice(x.name)
                    self.slices[name] = sl.then(0, j, self.k) if self.k > 1 else sl
                    self.local[(x.name, j, s)] = name

    def _resolve(self, name: str, mb, stage: int) -> str:
        key = (name, mb if name in self.data or name in self.producer else None, stage)
        return self.local[key]

    # -- steps, messages, sums ----------------------------------------------- #

    def _step(self, step: Step) -> None:
        s = self.device_of(step.chunk)
        j = step.microbatch
        for i in self.items.get((step.chunk, step.direction), ()):
            op = self.fn.ops[i]
            attrs = _shift_devices(op.attr_dict, s * self.width)
            if "shards" in attrs:  # each microbatch's loss is 1 / k of the mean
                attrs["shards"] = int(attrs["shards"]) * self.k
            attrs.update(stage=s, chunk=step.chunk, microbatch=j)
            outs = [f"{x.name}.mb{j}" for x in op.outputs]
            self._emit(op.op_type, [self._resolve(x.name, j, s) for x in op.inputs], outs, attrs)
            for x, new in zip(op.outputs, outs, strict=True):
                self.local[(x.name, j, s)] = new
                if x.name in self.summed:
                    self._accumulate(x.name, j, s, op)

    def _accumulate(self, name: str, mb: int, stage: int, op: Op) -> None:
        """Adds microbatch gradients into a running sum, strictly in microbatch order."""
        state = self.partial.setdefault(name, {"next": 0, "ready": {}, "total": None, "stage": stage})
        chunk = self.chunks[self.producer[name]]
        state["ready"][mb] = self.local[(name, mb, stage)]
        while state["next"] in state["ready"]:
            m = state["next"]
            part = state["ready"].pop(m)
            if m == 0:
                state["total"] = part
            else:
                total = f"{name}.acc{m}"
                # In place, as gradients accumulate (Megatron-LM's main_grad.add_): no second sum.
                attrs = dict(_phase_attrs(op), stage=stage, chunk=chunk, microbatch=m, inplace=True)
                self._emit("Add", [state["total"], part], [total], attrs)
                state["total"] = total
            state["next"] += 1

    def _send(self, source: str, name: str, to_stage: int, attrs: dict) -> str:
        rank = self.types[source].device % self.width
        attrs = dict(attrs, to=to_stage * self.width + rank, stage=to_stage, **self.send_attrs)
        self._emit("Send", [source], [name], attrs)
        return name

    def _messages(self) -> tuple[list, dict]:
        """Cross-device transfers ``(producer step, consumer step, (value, mb, stage))``."""
        position = {st: i for steps in self.schedule.values() for i, st in enumerate(steps)}
        crossing: dict[str, dict[int, list[tuple[int, str, Op]]]] = {}
        for i, op in enumerate(self.fn.ops):
            if self.kinds[i] == _OPT:
                continue
            s = self.device_of(self.chunks[i])
            for x in op.inputs:
                j = self.producer.get(x.name)
                if j is not None and self.device_of(self.chunks[j]) != s:
                    crossing.setdefault(x.name, {}).setdefault(s, []).append(
                        (self.chunks[i], self.kinds[i], op)
                    )
        messages, first_use = [], {}
        for name, by_stage in crossing.items():
            j = self.producer[name]
            for mb in range(self.k):
                source = Step(self.chunks[j], mb, self.kinds[j])
                for s, uses in by_stage.items():
                    chunk, kind, op = min(uses, key=lambda u: position[Step(u[0], mb, u[1])])
                    messages.append((source, Step(chunk, mb, kind), (name, mb, s)))
                    first_use[(name, mb, s)] = (op, chunk)
        return messages, first_use

    def _optimizer(self) -> None:
        for i, op in enumerate(self.fn.ops):
            if self.kinds[i] != _OPT:
                continue
            chunk = self.chunks[i]
            s = self.device_of(chunk)
            ins = []
            for x in op.inputs:
                if x.name in self.partial:
                    state = self.partial[x.name]
                    source = state["total"]
                    if state["stage"] != s:
                        source = self._send(source, f"{x.name}.sum.s{s}", s, _phase_attrs(op))
                    ins.append(source)
                elif (x.name, None, s) in self.local:
                    ins.append(self.local[(x.name, None, s)])
                else:  # another optimizer op's result on another stage
                    found = self._copy_of(x.name, None)
                    ins.append(self._send(found, f"{x.name}.s{s}", s, _phase_attrs(op)))
            attrs = _shift_devices(op.attr_dict, s * self.width)
            attrs.update(stage=s, chunk=chunk)
            self._emit(op.op_type, ins, [x.name for x in op.outputs], attrs)
            for x in op.outputs:
                self.local[(x.name, None, s)] = x.name

    def _copy_of(self, name: str, mb) -> str:
        """The new name of ``name`` (microbatch ``mb``) on the first stage that holds it."""
        return next(self.local[(name, mb, s)] for s in range(self.p) if (name, mb, s) in self.local)

    def _recipes(self) -> tuple[list[str], dict[str, Recipe]]:
        leaves: dict[str, None] = {}
        recipes = {}
        for x in self.fn.outputs:
            name, kind = x.name, "concat"
            if name in self.partial:
                parts = [self.partial[name]["total"]]
            elif name in self.data or (name in self.producer and self.kinds[self.producer[name]] != _OPT):
                parts = [self._copy_of(name, j) for j in range(self.k)]
                # Losses (scalars) add up over microbatches; activations stack along the batch.
                kind = "sum" if x.type.rank == 0 else "concat"
            else:  # optimizer results and unsplit inputs
                parts = [self._copy_of(name, None)]
            leaves.update(dict.fromkeys(parts))
            recipes[name] = Recipe.combine(kind, [Recipe.leaf(n) for n in parts], axis=0)
        return list(leaves), recipes

    def build(self) -> Distributed:
        self._declare_inputs()
        messages, first_use = self._messages()
        flops = {key: sum(_op_flops(self.fn.ops[i]) for i in ops) for key, ops in self.items.items()}
        step_costs = [[1.0 + flops.get((c, d), 0.0) for d in DIRECTIONS] for c in range(self.num_chunks)]
        for kind, event in estimated_issue_order(self.schedule, self.num_chunks, messages, step_costs):
            if kind == "step":
                self._step(event)
                continue
            name, mb, s = event
            producer = self.producer[name]
            source = self.local[(name, mb, self.device_of(self.chunks[producer]))]
            consumer, chunk = first_use[event]
            attrs = dict(_phase_attrs(consumer), chunk=chunk, microbatch=mb)
            self.local[(name, mb, s)] = self._send(source, f"{name}.mb{mb}.s{s}", s, attrs)
        self._optimizer()
        leaves, recipes = self._recipes()
        fn = Function(
            self.fn.name,
            tuple(self.inputs),
            tuple(self.ops),
            tuple(Value(n, self.types[n]) for n in leaves),
        )
        return Distributed(fn, self.slices, recipes)


def _phase_attrs(op: Op) -> dict:
    return dict(layer=op.attr("layer"), phase=op.attr("phase"))
