"""Executors that run IR programs on concrete arrays."""

from distir_jax.executor.sequential import execute

__all__ = ["execute"]
