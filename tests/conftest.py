import jax

# Strict numerics: implicit rank promotion hides shape bugs.
jax.config.update("jax_numpy_rank_promotion", "raise")
