import os

import jax

# Strict numerics: implicit rank promotion hides shape bugs.
jax.config.update("jax_numpy_rank_promotion", "raise")
# The CLI keeps compiled kernels in ~/.cache between runs; tests leave the home directory alone.
os.environ.setdefault("DISTIR_JAX_CACHE", "off")
