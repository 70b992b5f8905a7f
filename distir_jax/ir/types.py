"""Tensor types and dimension arithmetic.

A dimension is either a Python ``int`` or a 1-D integer NumPy array of *size
variants* (one entry per configuration in a sweep). Every shape rule and cost
feature is written with the helpers below, so one pass of type inference and
lowering yields features for a whole vector of sizes without rebuilding the
program per size.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np

Dim = Union[int, np.ndarray]

# Bytes per element of each supported dtype. The IR never stores data, only
# sizes, so a dtype is just a name and a width.
DTYPE_BYTES = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "f8": 1,  # FP8 (E4M3 / E5M2): the inputs of FP8 GEMMs (training precision "mixed-fp8")
    "i64": 8,
    "i32": 4,
}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return dtype


def normalize_dim(dim) -> Dim:
    """Returns ``dim`` as an int, or as a read-only int64 vector of variants."""
    if type(dim) is int and dim >= 0:  # the common case, first (bool is not an exact int)
        return dim
    if isinstance(dim, (bool, np.bool_)):
        raise ValueError(f"dimension must be an integer, got {dim!r}")
    if isinstance(dim, (int, np.integer)):
        if dim < 0:
            raise ValueError(f"dimension must be >= 0, got {dim}")
        return int(dim)
    arr = np.asarray(dim)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.size == 0:
        raise ValueError(
            f"a dimension must be an int or a non-empty 1-D integer array of size variants, got {dim!r}"
        )
    if np.any(arr < 0):
        raise ValueError(f"dimension variants must be >= 0, got {arr}")
    if np.all(arr == arr[0]):
        return int(arr[0])
    arr = arr.astype(np.int64)
    arr.setflags(write=False)
    return arr


def dims_equal(a: Dim, b: Dim) -> bool:
    """True when two dimensions agree for every size variant."""
    if type(a) is int and type(b) is int:
        return a == b
    return bool(np.all(np.asarray(a) == np.asarray(b)))


def dim_divides(dim: Dim, parts: int) -> bool:
    if type(dim) is int and type(parts) is int and parts > 0:
        return dim % parts == 0
    return bool(np.all(np.asarray(dim) % parts == 0))


def dim_str(dim: Dim) -> str:
    if isinstance(dim, np.ndarray):
        return "{" + ",".join(str(int(x)) for x in dim) + "}"
    return str(dim)


def num_elements(shape: tuple[Dim, ...]) -> Dim:
    total: Dim = 1
    for d in shape:
        total = total * d
    return total


def has_variants(shape: tuple[Dim, ...]) -> bool:
    return any(isinstance(d, np.ndarray) for d in shape)


class cached_attribute:
    """A value computed on first read and stored on the instance, so later reads
    never reach this descriptor; for immutable objects (a frozen dataclass's
    ``__setattr__`` is bypassed). Unlike ``functools.cached_property`` it takes
    no lock and does not materialize the instance ``__dict__``, which cost about
    a microsecond per first read.
    """

    def __init__(self, fn):
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = self.fn(obj)
        # Not obj.__dict__[...]: reading __dict__ makes Python build the dict (slow).
        object.__setattr__(obj, self.name, value)
        return value


@dataclasses.dataclass(frozen=True, eq=False)
class TensorType:
    """The static type of a value: its shape, element type and device.

    Attributes:
      shape: dimensions; each an int or a vector of size variants.
      dtype: element type name, a key of ``DTYPE_BYTES``.
      device: index of the device holding the value.
    """

    shape: tuple[Dim, ...]
    dtype: str = "f32"
    device: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(normalize_dim(d) for d in self.shape))
        check_dtype(self.dtype)
        if not isinstance(self.device, (int, np.integer)) or self.device < 0:
            raise ValueError(f"device must be an int >= 0, got {self.device!r}")
        object.__setattr__(self, "device", int(self.device))

    @property
    def rank(self) -> int:
        return len(self.shape)

    # The type is immutable, so sizes and the cache key are computed once, on first
    # use. Size-variant results are made read-only: they are shared by every
    # reader, and an in-place update would otherwise change the type.

    @cached_attribute
    def num_elements(self) -> Dim:
        return _read_only(num_elements(self.shape))

    @cached_attribute
    def num_bytes(self) -> Dim:
        return _read_only(self.num_elements * DTYPE_BYTES[self.dtype])

    @cached_attribute
    def cache_key(self) -> tuple:
        """A hashable key equal for equal types (``__eq__`` is exact; this is its hashable form).

        Size-variant dims become tuples of ints: a normalized vector is never all
        equal, so it cannot collide with an int dim.
        """
        shape = tuple(d if type(d) is int else tuple(d.tolist()) for d in self.shape)
        return (shape, self.dtype, self.device)

    def with_shape(self, shape) -> TensorType:
        return TensorType(tuple(shape), self.dtype, self.device)

    def on(self, device: int) -> TensorType:
        return TensorType(self.shape, self.dtype, device)

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorType):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.device == other.device
            and self.rank == other.rank
            and all(dims_equal(a, b) for a, b in zip(self.shape, other.shape))
        )

    def __hash__(self):
        return hash((self.dtype, self.device, self.rank))

    def __str__(self) -> str:
        dims = "x".join(dim_str(d) for d in self.shape)
        return f"Tensor[{dims}; {self.dtype}; d{self.device}]"


def _read_only(dim: Dim) -> Dim:
    if isinstance(dim, np.ndarray):
        dim.setflags(write=False)
    return dim
