"""Transforms: programs in, distributed programs (with their maps) out.

Every transform accepts a :class:`~distir_jax.ir.Function` or a
:class:`Distributed` and returns a :class:`Distributed` related to the
original program, so transforms compose.
"""

import importlib

from distir_jax.transforms.base import Distributed, InputSlice, Recipe
from distir_jax.transforms.data_parallel import data_parallel
from distir_jax.transforms.parallelize import ParallelConfig, parallelize

__all__ = ["Distributed", "InputSlice", "ParallelConfig", "Recipe", "data_parallel", "parallelize"]

# Transforms written in their own modules; the package imports without them,
# but an error inside one that exists is not hidden.
for _module, _name in (
    ("tensor_parallel", "tensor_parallel"),
    ("pipeline", "pipeline_parallel"),
    ("recompute", "recompute"),
):
    try:
        globals()[_name] = getattr(importlib.import_module(f"{__name__}.{_module}"), _name)
        __all__.append(_name)
    except ModuleNotFoundError as _error:
        if _error.name != f"{__name__}.{_module}":
            raise
del _module, _name
