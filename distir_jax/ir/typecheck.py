"""Type inference: fills in every value's type, or says exactly what is wrong."""

from __future__ import annotations

from distir_jax.ir._gc import gc_paused
from distir_jax.ir.function import Function, Op, Value
from distir_jax.ir.registry import OpError, get_spec, rule_cache_key
from distir_jax.ir.shape_rules import shape_str
from distir_jax.ir.types import TensorType


def _where(op: Op, index: int) -> str:
    outs = ", ".join("%" + v.name for v in op.outputs)
    return f"op #{index} {op.op_type}" + (f" (-> {outs})" if outs else "")


# Results of built-in shape rules by rule_cache_key: transforms copy each op per
# microbatch and replica, and a model repeats layers, so most ops repeat an
# earlier op's rule, attributes and operand types. Only successes are stored, so
# a bad op still raises its own error. Cleared when full, to bound memory.
_INFER_CACHE: dict[tuple, tuple[TensorType, ...]] = {}
_MAX_INFER_CACHE = 1 << 16


def infer_op_types(op: Op, index: int, input_types: tuple[TensorType, ...]) -> tuple[TensorType, ...]:
    """Output types of one op, with errors that name the op and its position."""
    try:
        spec = get_spec(op.op_type)
    except ValueError as e:
        raise ValueError(f"{_where(op, index)}: {e}") from None
    # The operand-count and device checks below depend only on the spec and the
    # types, so they are part of the key too.
    key = rule_cache_key(spec.infer, op, input_types)
    if key is not None:
        key = (key, spec.num_inputs, spec.single_device)
        cached = _INFER_CACHE.get(key)
        if cached is not None:
            return cached
    if spec.num_inputs is not None and len(input_types) != spec.num_inputs:
        raise ValueError(f"{_where(op, index)}: expected {spec.num_inputs} operands, got {len(input_types)}")
    if spec.single_device:
        devices = sorted({t.device for t in input_types})
        if len(devices) > 1:
            detail = ", ".join(f"%{v.name} on d{t.device}" for v, t in zip(op.inputs, input_types))
            raise ValueError(
                f"{_where(op, index)}: operands must be on one device, got {detail}; "
                "insert a Send or a collective to move data"
            )
    try:
        out_types = tuple(spec.infer(op.attr_dict, input_types))
    except OpError as e:
        operands = ", ".join(
            f"%{v.name}: {shape_str(t.shape)} {t.dtype} d{t.device}" for v, t in zip(op.inputs, input_types)
        )
        raise ValueError(f"{_where(op, index)}: {e} (operands: {operands})") from None
    if key is not None:
        if len(_INFER_CACHE) >= _MAX_INFER_CACHE:
            _INFER_CACHE.clear()
        _INFER_CACHE[key] = out_types
    return out_types


@gc_paused
def infer_types(fn: Function) -> Function:
    """Returns ``fn`` with every op output typed.

    Raises:
      ValueError: naming the op and its position, for an unknown op type, a
        value used before it is defined (or a cycle), a value defined twice,
        operands on different devices where one device is required, or shapes
        that do not fit the op's rule.
    """
    types: dict[str, TensorType] = {}
    for v in fn.inputs:
        if v.type is None:
            raise ValueError(f"function input %{v.name} has no type")
        if v.name in types:
            raise ValueError(f"function input %{v.name} is declared twice")
        types[v.name] = v.type
    producer = fn.producers()
    new_ops = []
    for index, op in enumerate(fn.ops):
        for v in op.inputs:
            if v.name not in types:
                raise ValueError(_undefined_message(fn, op, index, v, producer))
        input_types = tuple(types[v.name] for v in op.inputs)
        out_types = infer_op_types(op, index, input_types)
        if len(out_types) != len(op.outputs):
            raise ValueError(
                f"{_where(op, index)}: produces {len(out_types)} results, but "
                f"{len(op.outputs)} output names were given"
            )
        for v, t in zip(op.outputs, out_types):
            if v.name in types:
                raise ValueError(f"{_where(op, index)}: value %{v.name} is defined twice")
            if v.type is not None and v.type != t:
                raise ValueError(
                    f"{_where(op, index)}: %{v.name} is declared {v.type} but the op produces {t}"
                )
            types[v.name] = t
        new_ops.append(
            op._with_values(
                tuple(Value(v.name, types[v.name]) for v in op.inputs),
                tuple(Value(v.name, t) for v, t in zip(op.outputs, out_types)),
            )
        )
    for v in fn.outputs:
        if v.name not in types:
            raise ValueError(f"function output %{v.name} is never defined")
    return fn.replace(ops=tuple(new_ops), outputs=tuple(Value(v.name, types[v.name]) for v in fn.outputs))


def _undefined_message(fn: Function, op: Op, index: int, v: Value, producer: dict[str, int]) -> str:
    where = _where(op, index)
    if v.name not in producer:
        return f"{where}: operand %{v.name} is never defined"
    later = producer[v.name]
    if _reaches(fn, later, index):
        return (
            f"{where}: operand %{v.name} is produced by op #{later}, which itself depends on "
            f"op #{index}: the program has a cycle"
        )
    return (
        f"{where}: operand %{v.name} is used before it is defined (by op #{later}); "
        "ops must be listed in an order where every operand is already defined"
    )


def _reaches(fn: Function, start: int, target: int) -> bool:
    """Whether op ``start`` depends, through data, on op ``target``."""
    producer = fn.producers()
    stack, seen = [start], set()
    while stack:
        i = stack.pop()
        if i == target:
            return True
        if i in seen:
            continue
        seen.add(i)
        stack.extend(producer[v.name] for v in fn.ops[i].inputs if v.name in producer)
    return False
