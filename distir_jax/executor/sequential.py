"""The sequential executor: runs a program's ops one by one in NumPy.

It is the numerical ground truth for transforms: a data-parallel or pipelined
rewrite of a program must compute what the original computes. Devices are
only labels here; ``Send`` and collectives are ordinary ops whose ``evaluate``
takes one array per operand, so a multi-device program runs in one process.
Floats run in float64 whatever their declared dtype, so comparisons between
a program and its rewrite are exact up to summation order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from distir_jax.ir.function import Function
from distir_jax.ir.registry import get_spec
from distir_jax.ir.shape_rules import shape_str
from distir_jax.ir.typecheck import infer_types
from distir_jax.ir.types import TensorType, has_variants

_INT_DTYPES = {"i32": np.int32, "i64": np.int64}


def _is_typed(fn: Function) -> bool:
    return all(v.type is not None for op in fn.ops for v in op.inputs + op.outputs) and all(
        v.type is not None for v in fn.outputs
    )


def _check_concrete(fn: Function) -> None:
    for value in fn.values().values():
        if has_variants(value.type.shape):
            raise ValueError(
                f"function {fn.name} has size-variant dimensions (%{value.name}: "
                f"{shape_str(value.type.shape)}); the executor needs concrete sizes: "
                "build the program with one size per dimension"
            )


def _as_input_array(name: str, declared: TensorType, given) -> np.ndarray:
    """Validates one input and converts it to its execution dtype (a copy)."""
    array = np.asarray(given)
    expected = tuple(int(d) for d in declared.shape)
    if array.shape != expected:
        raise ValueError(
            f"input %{name}: expected shape {list(expected)} ({declared}), found shape {list(array.shape)}"
        )
    if declared.dtype in _INT_DTYPES:
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"input %{name}: declared {declared.dtype}, so it needs integer data; found {array.dtype}"
            )
        return np.array(array, dtype=_INT_DTYPES[declared.dtype])
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"input %{name}: declared {declared.dtype}, found non-numeric data {array.dtype}")
    return np.array(array, dtype=np.float64)


def _bind_inputs(fn: Function, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    declared = {v.name: v.type for v in fn.inputs}
    unknown = sorted(set(inputs) - set(declared))
    if unknown:
        raise ValueError(
            f"function {fn.name} has no input named {', '.join('%' + n for n in unknown)}; "
            f"its inputs are {', '.join('%' + n for n in declared)}"
        )
    missing = [n for n in declared if n not in inputs]
    if missing:
        raise ValueError(
            f"function {fn.name}: no value given for input {', '.join('%' + n for n in missing)}"
        )
    return {name: _as_input_array(name, t, inputs[name]) for name, t in declared.items()}


def _check_result(index: int, op_type: str, name: str, declared: TensorType, result) -> np.ndarray:
    """Checks one op result against its inferred type; a mismatch is an op bug."""
    array = np.asarray(result)
    expected = tuple(int(d) for d in declared.shape)
    where = f"op #{index} {op_type} (-> %{name})"
    if array.shape != expected:
        raise RuntimeError(
            f"{where}: evaluate returned shape {list(array.shape)} but its shape rule inferred "
            f"{declared}; the op's evaluate and infer disagree"
        )
    is_int = np.issubdtype(array.dtype, np.integer)
    if (declared.dtype in _INT_DTYPES) != is_int:
        raise RuntimeError(
            f"{where}: evaluate returned {array.dtype} data but its shape rule inferred {declared}"
        )
    return array if is_int else np.asarray(array, dtype=np.float64)


def execute(
    fn: Function, inputs: Mapping[str, np.ndarray], *, return_all: bool = False
) -> dict[str, np.ndarray]:
    """Runs ``fn`` on concrete inputs, op by op in issue order.

    Args:
      fn: the program; untyped op outputs are inferred first.
      inputs: one array per function input, by name, with exactly the declared
        shape. Float inputs run in float64; integer inputs (declared ``i32`` /
        ``i64``) stay integers.
      return_all: return every value (inputs and every op result), not only
        the function's outputs.

    Returns:
      Arrays by value name: the function outputs, or every value.

    Raises:
      ValueError: for an unknown, missing or misshapen input, or for a program
        with size-variant dimensions (the executor needs one concrete size).
      RuntimeError: when an op's ``evaluate`` disagrees with its shape rule,
        naming the op's position and type.
    """
    if not _is_typed(fn):
        fn = infer_types(fn)
    _check_concrete(fn)
    env = _bind_inputs(fn, inputs)
    for index, op in enumerate(fn.ops):
        spec = get_spec(op.op_type)
        args = [env[v.name] for v in op.inputs]
        results = tuple(spec.evaluate(op.attr_dict, args))
        if len(results) != len(op.outputs):
            raise RuntimeError(
                f"op #{index} {op.op_type}: evaluate returned {len(results)} results, "
                f"the op has {len(op.outputs)} outputs"
            )
        for value, result in zip(op.outputs, results, strict=True):
            env[value.name] = _check_result(index, op.op_type, value.name, value.type, result)
    if return_all:
        return dict(env)
    return {v.name: env[v.name] for v in fn.outputs}
