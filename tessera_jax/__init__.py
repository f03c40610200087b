"""tessera_jax: block-sparse attention for video diffusion transformers in JAX."""

from . import masks
from .api import enable_compilation_cache, plan, precompile, sparse_attention
from .mask import BlockMask
from .planner import Plan
from .reference import reference_attention

__all__ = ["BlockMask", "Plan", "enable_compilation_cache", "plan", "precompile",
           "reference_attention", "sparse_attention"]
__version__ = "0.1.0"


def __getattr__(name):
    # tessera_jax.viz imports matplotlib: load it only when asked for.
    if name == "viz":
        import importlib
        return importlib.import_module(".viz", __name__)
    raise AttributeError(f"module 'tessera_jax' has no attribute {name!r}")
