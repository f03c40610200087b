"""Registers the Pallas GPU backends with ``tessera_jax.backends`` when their modules import."""

from __future__ import annotations

import functools
import weakref

import jax
import numpy as np
import jax.numpy as jnp

from . import backends
from .planner import Plan


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


# Per plan (weakly held, so a plan dropped from the API's cache frees its entry): the plan's
# arrays on the device and the extra keyword arguments its kernel takes, made on the first
# call, which also runs the kernel module's host checks of the NumPy plan. Later calls skip
# both (the checks walk every step: milliseconds on big per-head plans).
_PREPARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _runner(module_name: str):
    def run(plan, template, q, k, v, scale, return_lse):
        import importlib
        mod = importlib.import_module(module_name)
        kw = dict(template=template, q_len_padded=plan.q_len_padded,
                  kv_len_padded=plan.kv_len_padded, scale=scale, return_lse=return_lse)
        arrays = (plan.units, plan.steps, plan.row_index)
        if not all(isinstance(a, np.ndarray) for a in arrays):
            # Plan arrays as operands of a jitted caller (the profiler): nothing to check or
            # keep on the host; the template's own mask mode applies.
            return mod.attention(q, k, v, *arrays, **kw)
        try:
            per_plan = _PREPARED.setdefault(plan, {})
        except TypeError:           # a plan-like object that can't be weakly referenced
            per_plan = {}
        hit = per_plan.get((module_name, template.name))
        if hit is not None:
            on_device, extra = hit
            # Under a trace the plan becomes constants of the caller's program: hand over the
            # NumPy arrays (literals, as on the first call), never the cached device arrays,
            # which jax would hoist into extra executable inputs (an AOT-compiled denoising
            # loop on the H200 then failed: "compiled for 858 inputs but called with 827").
            tracing = isinstance(q, jax.core.Tracer)
            return mod.attention(q, k, v, *(arrays if tracing else on_device), **kw, **extra)
        extra = {}
        trusted = isinstance(plan, Plan)       # built by the planner for this template
        if hasattr(mod, "plan_mask_mode"):
            # Mosaic GPU: no masking code at all for a plan whose steps are all full.
            extra["mask_mode"] = (mod.mask_mode_for(template, plan.all_full) if trusted else
                                  mod.plan_mask_mode(plan.units, plan.steps, template,
                                                     plan.q_len_padded, plan.kv_len_padded))
        tracing = isinstance(q, jax.core.Tracer)
        if trusted and not tracing:
            # One host->device copy per plan, and no second walk over the steps: the kernel
            # module's checks of a NumPy plan only repeat what the planner guarantees.
            on_device = tuple(jax.device_put(arrays))
            per_plan[(module_name, template.name)] = (on_device, extra)
            return mod.attention(q, k, v, *on_device, **kw, **extra)
        out = mod.attention(q, k, v, *arrays, **kw, **extra)   # checks the NumPy plan
        per_plan[(module_name, template.name)] = (tuple(jnp.asarray(a) for a in arrays), extra)
        return out
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
