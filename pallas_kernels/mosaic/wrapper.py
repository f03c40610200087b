"""The Mosaic GPU kernel's wrapper: input and plan checks, padding, the mask mode, the launch.

``attention`` runs a plan (``pallas_kernels.abi``) built for a ``mosaic_gpu`` template
(``pallas_kernels.templates``) with the kernel body of ``pallas_kernels.mosaic.kernel``:
Hopper (sm_90a), bf16/f16, head dims 64 and 128, plan starts multiples of 8 (the templates'
q_align / kv_align: TMA fills 8-row tiled, swizzled SMEM). A plan whose visited steps are all
full runs mask mode "none" (no masking code at all); ``mask_mode_for`` / ``plan_mask_mode``
say which mode a plan runs with. Measurements of the kernel variants: ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi as plan_abi
from pallas_kernels import templates as _templates
from pallas_kernels import backward_rows as rows_
from pallas_kernels.mosaic.kernel import MASK_MODES, KernelConfig, forward

__all__ = ["KernelConfig", "attention", "config_from_template", "mask_mode_for",
           "plan_mask_mode", "MASK_MODES"]


def _template(template):
    t = _templates.get(template)
    if t.backend != "mosaic_gpu":
        raise ValueError(f"template {t.name!r} is for backend {t.backend!r}, not mosaic_gpu")
    return t


def config_from_template(template, mask_mode: str | None = None) -> KernelConfig:
    """The kernel config of a ``mosaic_gpu`` template (name or Template); ``mask_mode``
    overrides the template's (the wrapper picks "none" for all-full plans)."""
    return KernelConfig.from_template(_template(template), mask_mode)


def mask_mode_for(template, all_full: bool) -> str:
    """The mask mode a plan runs with, given whether every step it visits is full (for a
    trusted plan whose fullness is known, e.g. ``Plan.all_full``: no walk over the steps):
    "none" for an all-full plan on a template that masks by "cond", else the template's."""
    mode = _template(template).kernel.mask_mode
    return "none" if mode == "cond" and all_full else mode


def plan_mask_mode(units, steps, template, q_len_padded, kv_len_padded) -> str:
    """The mask mode a concrete (NumPy) plan runs with (``mask_mode_for`` of its fullness).
    Checks the plan like ``attention`` does (``abi.check_plan``)."""
    t = _template(template)
    return mask_mode_for(t, _check_plan(units, steps, t, q_len_padded, kv_len_padded))


def _check_plan(units, steps, t, q_len_padded, kv_len_padded, num_q_heads=None) -> bool:
    return plan_abi.check_plan(np.asarray(units), np.asarray(steps), t.tile_q, t.tile_kv,
                               q_len_padded, kv_len_padded, num_q_heads=num_q_heads,
                               q_align=t.q_align, kv_align=t.kv_align)


def _check(q, k, v, units, steps, row_index, t, q_len_padded, kv_len_padded, scale):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a rank-4 array [B, L, H, D], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    B, Lq, Hq, D = q.shape
    Bk, Lkv, Hkv, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if Bk != B or Dk != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch/head dim")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not t.supports(D, q.dtype):
        raise ValueError(f"template {t.name!r} supports head dims {t.head_dims} and dtypes "
                         f"{t.dtypes}; got head_dim={D}, dtype={jnp.dtype(q.dtype).name}")
    plan_abi.check_plan_arrays(units, steps, row_index, num_q_heads=Hq, q_len=Lq)
    for name, val, low, unit, align in (("q_len_padded", q_len_padded, Lq, t.tile_q, t.q_align),
                                        ("kv_len_padded", kv_len_padded, Lkv, t.tile_kv,
                                         t.kv_align)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{name} must be a static int, got {type(val).__name__}")
        if val < max(low, unit) or val % align:
            raise ValueError(f"{name}={val} must be >= the sequence length {low} and the tile "
                             f"{unit}, and a multiple of {align}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 \
            or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")


@functools.partial(jax.jit, static_argnames=("template", "q_len_padded", "kv_len_padded",
                                             "scale", "return_lse", "interpret", "mask_mode"))
def _attention(q, k, v, units, steps, row_index, row_index_t=None, *, template, q_len_padded,
               kv_len_padded, scale, return_lse, interpret, mask_mode=None):
    cfg = config_from_template(template, mask_mode)
    qp = rows_.pad_len(q, q_len_padded)
    kp = rows_.pad_len(k, kv_len_padded)
    vp = rows_.pad_len(v, kv_len_padded)
    out_u, lse_u = forward(qp, kp, vp, units, steps, cfg=cfg, scale=scale, interpret=interpret)
    if row_index is None:
        row_index = plan_abi.row_index_from_units(units, q.shape[2], q.shape[1], template.tile_q)
    out, lse = plan_abi.gather_rows(out_u, lse_u, row_index, row_index_t)
    return (out, lse) if return_lse else out


def attention(q, k, v, units, steps, row_index, *, template, q_len_padded, kv_len_padded,
              scale=None, return_lse=False, interpret=False, mask_mode=None, check_plan=True):
    """Block-sparse attention executing a plan on Hopper with Mosaic GPU.

    q [B, Lq, Hq, D]; k, v [B, Lkv, Hkv, D] (bf16 or f16, D in the template's head dims);
    units, steps, row_index: the plan's int32 arrays (``plan_abi``), built for this
    template's tile_q / tile_kv and the given padded lengths; ``row_index=None`` computes it on
    the device from units (``plan_abi.row_index_from_units``: nothing to copy). Returns out
    [B, Lq, Hq, D] (q.dtype) and, with ``return_lse``, lse [B, Hq, Lq] (float32, natural log;
    -inf and output 0 for a row with no selected key). ``interpret``: a Mosaic GPU
    interpreter params object (``jax._src.pallas.mosaic_gpu.interpret``) to run on CPU, for
    tests. ``mask_mode`` (``MASK_MODES``): None picks it from a concrete NumPy plan ("none"
    when every step is full, ``mask_mode_for``) or takes the template's for traced plan
    arrays; "none" on a plan with partial steps would be wrong, so a concrete plan is checked
    (``abi.check_plan``). ``check_plan=False``: the caller vouches for a NumPy plan (the
    planner built it for this template): no host walk over its steps, and its arrays go into
    the jitted call as they are (copied by jax's C++ dispatch, which costs less than a
    separate device_put).
    """
    t = _template(template)
    if mask_mode is not None and mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be None or one of {MASK_MODES}, got {mask_mode!r}")
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5 if hasattr(q, "shape") and len(q.shape) == 4 else 1.0
    _check(q, k, v, units, steps, row_index, t, q_len_padded, kv_len_padded, scale)
    if check_plan and isinstance(units, np.ndarray) and isinstance(steps, np.ndarray):
        all_full = _check_plan(units, steps, t, q_len_padded, kv_len_padded, q.shape[2])
        if mask_mode == "none" and not all_full:
            raise ValueError("mask_mode='none' needs a plan whose steps are all full; this "
                             "plan has partial steps")
        mask_mode = mask_mode or mask_mode_for(t, all_full)
    # NumPy arrays stay NumPy: the jitted call copies them (not a separate device_put).
    units, steps = (a if isinstance(a, np.ndarray) else jnp.asarray(a) for a in (units, steps))
    if row_index is not None and not isinstance(row_index, np.ndarray):
        row_index = jnp.asarray(row_index)   # None: computed on the device from units
    return _attention(q, k, v, units, steps, row_index, plan_abi.token_major(row_index),
                      template=t,
                      q_len_padded=int(q_len_padded), kv_len_padded=int(kv_len_padded),
                      scale=float(scale), return_lse=bool(return_lse), interpret=interpret,
                      mask_mode=mask_mode)
