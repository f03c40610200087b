"""Lowering for a CUDA target on a machine without one: the kernels must take the real Triton
path (not the interpreter), which only lowering shows here."""

import warnings

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

_H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


def lower_for_h200(f, *args) -> str:
    """The StableHLO text of ``jax.jit(f)`` lowered for CUDA on an abstract H200 (``args``:
    arrays or ShapeDtypeStructs)."""
    with use_abstract_mesh(_H200), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def assert_mosaic_lowers(f, *args) -> None:
    """``jax.jit(f)`` cross-lowers for CUDA through Mosaic GPU (its lowering and layout
    inference run on this CPU machine; a cubin needs a GPU); skipped where this jaxlib has no
    CUDA lowering."""
    import pytest
    try:
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    except Exception as e:  # pragma: no cover - depends on the installed jaxlib
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"no CUDA lowering in this jaxlib: {e}")
        raise
    assert "mosaic_gpu" in lowered.as_text()
