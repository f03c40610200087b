"""tessera_jax: block-sparse attention for video diffusion transformers in JAX."""

from tessera_jax import masks
from tessera_jax.runtime.api import (clear_caches, enable_compilation_cache, plan, precompile,
                                     sparse_attention)
from tessera_jax.mask import BlockMask
from tessera_jax.planning.planner import Plan
from tessera_jax.runtime.options import Options
from tessera_jax.reference import reference_attention
from tessera_jax import parallel  # several devices: docs/multi_gpu.md

__all__ = ["BlockMask", "Options", "Plan", "clear_caches", "enable_compilation_cache", "plan", "precompile",
           "reference_attention", "sparse_attention"]
__version__ = "0.1.0"


def __getattr__(name):
    # tessera_jax.viz imports matplotlib: load it only when asked for.
    if name == "viz":
        import importlib
        return importlib.import_module("tessera_jax.viz")
    raise AttributeError(f"module 'tessera_jax' has no attribute {name!r}")
