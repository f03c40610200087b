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
