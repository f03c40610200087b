"""Registers the Pallas GPU backends with ``tessera_jax.backends`` when their modules import."""

from __future__ import annotations

import functools

import jax

from . import backends


@functools.cache
def _gpu_capability() -> tuple[int, int] | None:
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    if not devs:
        return None
    cc = getattr(devs[0], "compute_capability", None)
    try:
        major, minor = (int(x) for x in str(cc).split("."))
    except (TypeError, ValueError):
        return (0, 0)
    return (major, minor)


def _runner(module_name: str):
    def run(plan, template, q, k, v, scale, return_lse):
        import importlib
        mod = importlib.import_module(module_name)
        return mod.attention(q, k, v, plan.units, plan.steps, plan.row_index, template=template,
                             q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded,
                             scale=scale, return_lse=return_lse)
    return run


def _available(module_name: str, min_cc: tuple[int, int]):
    def available() -> bool:
        cc = _gpu_capability()
        if cc is None or cc < min_cc:
            return False
        try:
            __import__(module_name)
        except ImportError:
            return False
        return True
    return available


backends.register_backend("mosaic_gpu", _runner("pallas_kernels.mosaic_fwd"),
                          _available("pallas_kernels.mosaic_fwd", (9, 0)))
backends.register_backend("triton", _runner("pallas_kernels.triton_fwd"),
                          _available("pallas_kernels.triton_fwd", (8, 0)))
