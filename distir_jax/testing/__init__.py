"""Helpers for tests and benchmarks: random well-typed programs."""

from distir_jax.testing.random_programs import random_function, random_functions

__all__ = ["random_function", "random_functions"]
