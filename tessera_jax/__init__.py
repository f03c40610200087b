"""tessera_jax: block-sparse attention for video diffusion transformers in JAX."""

from .api import enable_compilation_cache, plan, precompile, sparse_attention
from .mask import BlockMask
from .planner import Plan
from .reference import reference_attention

__all__ = ["BlockMask", "Plan", "enable_compilation_cache", "plan", "precompile",
           "reference_attention", "sparse_attention"]
__version__ = "0.1.0"
