"""distir-jax: a JAX-accelerated, vectorized simulator for distributed deep-learning strategies."""
