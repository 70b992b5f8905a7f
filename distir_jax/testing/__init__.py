"""Helpers for tests and benchmarks: random well-typed programs, and the strategies
calibration is checked and timed on (:mod:`distir_jax.testing.strategies`)."""

from distir_jax.testing.random_programs import random_function, random_functions

__all__ = ["random_function", "random_functions"]
