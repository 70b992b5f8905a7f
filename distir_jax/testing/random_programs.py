"""Random well-typed multi-device programs, for property tests and benchmarks.

Two generators, both built through :class:`FunctionBuilder` so every program
type-checks:

* :func:`random_functions` is a hypothesis strategy of small programs that mix
  every core compute and communication op with random attributes of every
  kind (to exercise printers, parsers and transforms);
* :func:`random_function` is deterministic (NumPy RNG, no hypothesis) and fast
  enough for benchmark-sized programs: 16384 ops on 64 devices in about a
  second.
"""

from __future__ import annotations

import functools
from collections import deque

import numpy as np

from distir_jax.ir.builder import FunctionBuilder
from distir_jax.ir.function import Function, Value
from distir_jax.ir.registry import registered_op_types
from distir_jax.ir.types import DTYPE_BYTES

# Attributes that some op reads (and keyword names of FunctionBuilder.add):
# random extra attributes never use these keys.
RESERVED_ATTRS = frozenset(
    {"to", "devices", "axis", "split_axis", "concat_axis", "lr", "transpose_a", "transpose_b", "stream"}
    | {"names", "op_type", "self"}
)
BINARY_OPS = ("Add", "Sub", "Mul", "Div")
UNARY_OPS = ("Relu", "Neg", "Identity")
# Used when registered; each maps a tensor to one of the same type.
OPTIONAL_UNARY_OPS = ("Tanh", "Gelu", "Exp")
COMM_OPS = ("Send", "AllReduce", "AllGather", "ReduceScatter", "AllToAll", "Broadcast", "Scatter", "Gather")
_DIMS = (1, 2, 3, 4, 6, 8)
_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.]{0,7}"

# --------------------------------------------------------------------------- #
# Hypothesis strategy.


def random_functions(max_ops: int = 12, max_devices: int = 4, num_streams: int = 2):
    """A hypothesis strategy of random well-typed multi-device functions.

    Programs mix MatMul (with transposes), broadcasting Add/Sub/Mul/Div,
    Relu/Neg/Identity (plus optional unary ops when registered), SGD, Send and
    every collective over random device groups. Operands are reused values or
    fresh inputs of random shapes (scalars included) and dtypes; some values
    get random names; some ops carry ``stream`` in ``[0, num_streams)`` and
    random extra attributes of every kind (ints, floats including NaN, inf and
    -0.0, unicode strings, bools, empty, 1- and n-tuples).

    Args:
      max_ops: the most ops a program has (it may have none).
      max_devices: programs use between 1 and this many devices.
      num_streams: stream attributes are drawn from ``range(num_streams)``.
    """
    from hypothesis import strategies as st

    @st.composite
    def functions(draw):
        return _Drawer(draw, max_devices, num_streams).function(max_ops)

    return functions()


# Strategies are built once and drawn from many times: hypothesis checks a
# strategy when it is first drawn from, and building and checking them anew at
# every draw took ~60% of the time to draw a program (and most of the time of
# the property tests that use them).


@functools.cache
def _integers(low: int, high: int):
    from hypothesis import strategies as st

    return st.integers(low, high)


@functools.cache
def _sampled(options: tuple):
    from hypothesis import strategies as st

    return st.sampled_from(options)


@functools.cache
def _booleans():
    from hypothesis import strategies as st

    return st.booleans()


@functools.cache
def _shapes(min_rank: int, max_rank: int):
    from hypothesis import strategies as st

    return st.lists(_sampled(_DIMS), min_size=min_rank, max_size=max_rank)


@functools.cache
def _distinct(count: int, min_size: int, max_size: int):
    """Lists of ``min_size..max_size`` distinct ints in ``[0, count)``."""
    from hypothesis import strategies as st

    return st.lists(_integers(0, count - 1), min_size=min_size, max_size=max_size, unique=True)


@functools.cache
def _names():
    from hypothesis import strategies as st

    return st.from_regex(_NAME_PATTERN, fullmatch=True)


@functools.cache
def _learning_rates():
    from hypothesis import strategies as st

    return st.floats(1e-6, 1.0)


@functools.cache
def _extra_attrs():
    from hypothesis import strategies as st

    keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,8}", fullmatch=True)
    keys = keys.filter(lambda k: k not in RESERVED_ATTRS)
    scalars = st.one_of(st.integers(), st.floats(), st.text(max_size=6), st.booleans())
    return st.dictionaries(keys, st.one_of(scalars, st.lists(scalars, max_size=3).map(tuple)), max_size=2)


class _Drawer:
    """Draws one program op by op; ``pool`` holds every value drawn so far."""

    def __init__(self, draw, max_devices: int, num_streams: int):
        self.draw = draw
        self.num_devices = draw(_integers(1, max_devices))
        self.num_streams = num_streams
        self.builder = FunctionBuilder(draw(_names()))
        self.pool: list[Value] = []
        self.names: set[str] = set()

    def _int(self, low: int, high: int) -> int:
        return self.draw(_integers(low, high))

    def _flip(self) -> bool:
        return self.draw(_booleans())

    def _one_of(self, options):
        """One of ``options`` (a sequence built per draw is indexed, not sampled)."""
        return options[self._int(0, len(options) - 1)]

    def function(self, max_ops: int) -> Function:
        draw = self.draw
        # Compute kinds twice, so that about half of all ops compute.
        kinds = ("MatMul", "binary", "unary", "SGD") * 2
        kinds += COMM_OPS if self.num_devices > 1 else COMM_OPS[1:]
        for _ in range(self._int(0, max_ops)):
            op_type, operands, attrs = getattr(self, "_" + draw(_sampled(kinds)))()
            if self._flip():
                attrs["stream"] = self._int(0, self.num_streams - 1)
            attrs.update(draw(_extra_attrs()))
            names = self._result_names(_result_count(op_type, operands, attrs))
            if op_type in OPTIONAL_UNARY_OPS:
                # Another module defines these; fall back if its rule rejects the operand.
                try:
                    outputs = self.builder.add(op_type, *operands, names=names, **attrs)
                except ValueError:
                    outputs = self.builder.add("Identity", *operands, names=names, **attrs)
            else:
                outputs = self.builder.add(op_type, *operands, names=names, **attrs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            self.pool.extend(outputs)
            self.names.update(v.name for v in outputs)
        returned = []
        if self.pool:
            returned = [self.pool[i] for i in draw(_distinct(len(self.pool), 0, 3))]
        return self.builder.build(*returned)

    # Operands -------------------------------------------------------------

    def _fresh_name(self) -> str | None:
        """A random unused name, or ``None`` (then the builder picks one)."""
        if self._int(0, 3) != 0:
            return None
        name = self.draw(_names())
        return None if name in self.names else name

    def _result_names(self, count: int) -> list[str] | None:
        names = [self._fresh_name() for _ in range(count)]
        if None in names or len(set(names)) != count:
            return None  # the builder names all results or none
        return names

    def _input(self, shape, dtype, device) -> Value:
        name, count = self._fresh_name(), len(self.names)
        while name is None or name in self.names:
            name, count = f"in{count}", count + 1
        self.names.add(name)
        value = self.builder.input(name, shape, dtype, device)
        self.pool.append(value)
        return value

    def _operand(
        self, device=None, shape=None, dtype=None, min_rank=0, max_rank=3, where=None, new_shape=None
    ):
        """A reused value that fits, or (half the time, or if none fits) a new
        input of ``shape`` (else ``new_shape``, else a random shape)."""
        fits = [
            v
            for v in self.pool
            if (device is None or v.type.device == device)
            and (shape is None or v.type.shape == tuple(shape))
            and (dtype is None or v.type.dtype == dtype)
            and min_rank <= v.type.rank <= max_rank
            and (where is None or where(v))
        ]
        if fits and self._flip():
            return self._one_of(fits)
        shape = new_shape if shape is None else shape
        if shape is None:
            shape = self.draw(_shapes(min_rank, max_rank))
        if dtype is None:
            dtype = self.draw(_sampled(tuple(sorted(DTYPE_BYTES))))
        if device is None:
            device = self._int(0, self.num_devices - 1)
        return self._input(tuple(shape), dtype, device)

    def _group(self, size_min=1):
        return self.draw(_distinct(self.num_devices, size_min, self.num_devices))

    def _members(self, first: Value, devices) -> list[Value]:
        t = first.type
        return [first] + [self._operand(d, t.shape, t.dtype) for d in devices[1:]]

    def _split_operand(self, device, parts):
        """An operand with a dimension divisible by ``parts``, and that axis."""
        shape = self.draw(_shapes(1, 3))
        shape[self._int(0, len(shape) - 1)] = parts * self.draw(_sampled(_DIMS[:4]))
        x = self._operand(
            device, min_rank=1, where=lambda v: any(d % parts == 0 for d in v.type.shape), new_shape=shape
        )
        axis = self._one_of([a for a, d in enumerate(x.type.shape) if d % parts == 0])
        return x, (axis - x.type.rank if self._flip() else axis)

    # Op kinds: each returns (op_type, operands, attrs) -------------------

    def _MatMul(self):
        a = self._operand(min_rank=2, max_rank=2)
        ta, tb = self._flip(), self._flip()
        k, n = a.type.shape[0 if ta else 1], self.draw(_sampled(_DIMS))
        b = self._operand(
            a.type.device,
            dtype=a.type.dtype,
            min_rank=2,
            max_rank=2,
            where=lambda v: v.type.shape[1 if tb else 0] == k,
            new_shape=(n, k) if tb else (k, n),
        )
        attrs = {}
        if ta or self._flip():
            attrs["transpose_a"] = ta
        if tb or self._flip():
            attrs["transpose_b"] = tb
        return "MatMul", (a, b), attrs

    def _binary(self):
        a = self._operand()
        # b's shape broadcasts against a's: a suffix of it (b shorter) or
        # extra leading dims (b longer); 1s broadcast in either direction.
        start = self._int(0, a.type.rank)
        prefix = self.draw(_shapes(0, 3 - a.type.rank)) if start == 0 else []
        suffix = [
            self.draw(_sampled(_DIMS)) if d == 1 else (1 if self._int(0, 3) == 0 else d)
            for d in a.type.shape[start:]
        ]
        b = self._operand(a.type.device, prefix + suffix, a.type.dtype)
        operands = (a, b) if self._flip() else (b, a)
        return self.draw(_sampled(BINARY_OPS)), operands, {}

    def _unary(self):
        optional = tuple(t for t in OPTIONAL_UNARY_OPS if t in registered_op_types())
        op_type = self.draw(_sampled(UNARY_OPS + optional))
        x = self._operand(dtype=self.draw(_sampled(("f32", "f16", "bf16", "f64"))))
        return op_type, (x,), {}

    def _SGD(self):
        w = self._operand()
        g = self._operand(w.type.device, w.type.shape, w.type.dtype)
        return "SGD", (w, g), {"lr": self.draw(_learning_rates())}

    def _Send(self):
        x = self._operand()
        to = self._int(0, self.num_devices - 2)
        return "Send", (x,), {"to": to + (to >= x.type.device)}

    def _AllReduce(self):
        devices = self._group()
        return "AllReduce", tuple(self._members(self._operand(devices[0]), devices)), {}

    def _AllGather(self):
        devices = self._group()
        x = self._operand(devices[0], min_rank=1)
        attrs = self._maybe_axis("axis", x)
        return "AllGather", tuple(self._members(x, devices)), attrs

    def _ReduceScatter(self):
        devices = self._group()
        x, axis = self._split_operand(devices[0], len(devices))
        return "ReduceScatter", tuple(self._members(x, devices)), {"axis": axis}

    def _AllToAll(self):
        devices = self._group()
        x, split_axis = self._split_operand(devices[0], len(devices))
        attrs = {"split_axis": split_axis, **self._maybe_axis("concat_axis", x)}
        return "AllToAll", tuple(self._members(x, devices)), attrs

    def _Broadcast(self):
        return "Broadcast", (self._operand(),), {"devices": tuple(self._group())}

    def _Scatter(self):
        devices = self._group()
        x, axis = self._split_operand(None, len(devices))
        return "Scatter", (x,), {"devices": tuple(devices), "axis": axis}

    def _Gather(self):
        devices = self._group()
        x = self._operand(devices[0], min_rank=1)
        attrs = {"to": self._int(0, self.num_devices - 1), **self._maybe_axis("axis", x)}
        return "Gather", tuple(self._members(x, devices)), attrs

    def _maybe_axis(self, key, x):
        if self._flip():
            return {}
        return {key: self._int(-x.type.rank, x.type.rank - 1)}


def _result_count(op_type, operands, attrs) -> int:
    if op_type in ("Broadcast", "Scatter"):
        return len(attrs["devices"])
    if op_type in ("AllReduce", "AllGather", "ReduceScatter", "AllToAll"):
        return len(operands)
    return 1


# --------------------------------------------------------------------------- #
# Deterministic generator for benchmarks.


def random_function(
    seed: int,
    num_ops: int,
    num_devices: int,
    num_streams: int = 1,
    *,
    batch: int = 256,
    hidden: int = 1024,
    comm_fraction: float = 0.15,
    window: int = 8,
) -> Function:
    """A deterministic random program of exactly ``num_ops`` ops.

    Every device starts with an activation ``x_d<i>: [batch, hidden]``, a bias
    ``[hidden]`` and two weights ``[hidden, hidden]``. Each step picks a device
    and, with probability ``1 - comm_fraction``, a compute op on it (MatMul
    with weights, broadcasting Add/Sub/Mul/Div, unary ops, weight gradients
    ``MatMul(a, b, transpose_a)`` followed by SGD updates); otherwise a Send
    or a collective over a random group of 2 to 8 devices. Operands are drawn
    from the last ``window`` values of a shape on their device, biased towards
    recent ones, so the dependency graph is a DAG with reuse, not a chain.
    Activations are ``[m, hidden]``: collectives shard and regather rows, so
    ``m`` stays at most ``batch``.

    Args:
      seed: seed of the NumPy generator; equal arguments give equal programs.
      num_ops: the number of ops.
      num_devices: devices ``0 .. num_devices - 1``; 1 means no communication.
      num_streams: with more than 1, every op gets a random ``stream``.
      batch: rows of each device's first activation.
      hidden: columns of activations, and the size of weights.
      comm_fraction: the share of ops that communicate (when devices > 1).
      window: how many recent values of each shape a device draws from.

    Returns:
      The function; its outputs are each device's latest full-batch
      activation and its current weights.
    """
    return _Generator(seed, num_devices, num_streams, batch, hidden, comm_fraction, window).build(num_ops)


class _Generator:
    def __init__(self, seed, num_devices, num_streams, batch, hidden, comm_fraction, window):
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        self.rng = np.random.default_rng(seed)
        self.num_devices, self.num_streams = num_devices, num_streams
        self.batch, self.hidden = batch, hidden
        self.comm_fraction = comm_fraction if num_devices > 1 else 0.0
        self.window = window
        self.builder = FunctionBuilder(f"random_{seed}")
        # recent[d][m]: the latest values of shape [m, hidden] on device d.
        self.recent: list[dict[int, deque]] = []
        self.weights: list[list[Value]] = []
        self.bias: list[Value] = []
        for d in range(num_devices):
            x = self.builder.input(f"x_d{d}", (batch, hidden), device=d)
            self.recent.append({batch: deque([x], maxlen=window)})
            self.weights.append(
                [self.builder.input(f"w{j}_d{d}", (hidden, hidden), device=d) for j in (0, 1)]
            )
            self.bias.append(self.builder.input(f"bias_d{d}", (hidden,), device=d))
        self.num_ops = 0

    def build(self, num_ops: int) -> Function:
        rng = self.rng
        while self.num_ops < num_ops:
            d = int(rng.integers(self.num_devices))
            if rng.random() < self.comm_fraction:
                self._communicate(d)
            else:
                self._compute(d, num_ops - self.num_ops)
        outputs = [self.recent[d][self.batch][-1] for d in range(self.num_devices)]
        outputs += [w for ws in self.weights for w in ws]
        return self.builder.build(*outputs)

    def _add(self, op_type, *inputs, **attrs):
        if self.num_streams > 1:
            attrs["stream"] = int(self.rng.integers(self.num_streams))
        self.num_ops += 1
        return self.builder.add(op_type, *inputs, **attrs)

    def _push(self, value: Value) -> None:
        rows = value.type.shape[0]
        by_rows = self.recent[value.type.device]
        if rows not in by_rows:
            by_rows[rows] = deque(maxlen=self.window)
        by_rows[rows].append(value)

    def _pick(self, device: int, rows: int | None = None) -> Value:
        """A recent value on ``device`` (of ``rows`` rows), favouring the newest."""
        by_rows = self.recent[device]
        if rows is None:
            keys = list(by_rows)
            rows = self.batch if self.rng.random() < 0.5 else keys[int(self.rng.integers(len(keys)))]
        values = by_rows[rows]
        back = min(int(self.rng.geometric(0.35)) - 1, len(values) - 1)
        return values[-1 - back]

    def _compute(self, d: int, ops_left: int) -> None:
        rng = self.rng
        kind = rng.random()
        if kind < 0.3:
            w = self.weights[d][int(rng.integers(2))]
            self._push(self._add("MatMul", self._pick(d), w, transpose_b=bool(rng.random() < 0.5)))
        elif kind < 0.55:
            a = self._pick(d)
            b = self.bias[d] if rng.random() < 0.3 else self._pick(d, a.type.shape[0])
            self._push(self._add(BINARY_OPS[int(rng.integers(4))], a, b))
        elif kind < 0.9 or ops_left < 2:
            self._push(self._add(UNARY_OPS[int(rng.integers(3))], self._pick(d)))
        else:
            a = self._pick(d)
            grad = self._add("MatMul", a, self._pick(d, a.type.shape[0]), transpose_a=True)
            j = int(rng.integers(2))
            self.weights[d][j] = self._add("SGD", self.weights[d][j], grad, lr=0.01)

    def _communicate(self, d: int) -> None:
        rng = self.rng
        if rng.random() < 0.5:
            to = int(rng.integers(self.num_devices - 1))
            to += to >= d
            self._push(self._add("Send", self._pick(d), to=to))
            return
        size = int(rng.integers(2, min(8, self.num_devices) + 1))
        others = rng.choice(self.num_devices - 1, size - 1, replace=False)
        group = [d] + [int(o) + int(o >= d) for o in others]
        shared = set(self.recent[group[0]]).intersection(*(self.recent[g] for g in group[1:]))
        kind = COMM_OPS[1 + int(rng.integers(len(COMM_OPS) - 1))]
        split = [m for m in shared if m % size == 0]
        joinable = [m for m in shared if m * size <= self.batch]
        rows = self.batch
        if kind in ("ReduceScatter", "AllToAll") and split:
            rows = split[int(rng.integers(len(split)))]
        elif kind in ("AllGather", "Gather") and joinable:
            rows = joinable[int(rng.integers(len(joinable)))]
        elif kind == "Scatter" and self.batch % size == 0:
            pass
        elif kind != "Broadcast":
            kind = "AllReduce"
        if kind == "Broadcast":
            outs = self._add(kind, self._pick(d), devices=tuple(group[1:]))
        elif kind == "Scatter":
            outs = self._add(kind, self._pick(d, rows), devices=tuple(group), axis=0)
        elif kind == "Gather":
            outs = self._add(kind, *(self._pick(g, rows) for g in group), to=d, axis=0)
        else:
            outs = self._add(kind, *(self._pick(g, rows) for g in group))
        for v in outs if isinstance(outs, tuple) else (outs,):
            self._push(v)
