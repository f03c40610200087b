"""The Triton-lowering kernel's wrapper: input and plan checks, padding, the mask mode, the
launch of ``pallas_kernels.triton.kernel``.

``attention`` runs a plan (``pallas_kernels.abi``) with a kernel configured either by a
``triton`` template (``pallas_kernels.templates``) or by tile_q / tile_kv / num_warps /
num_stages / prefetch directly. A concrete plan whose visited steps are all full runs mask
mode "none" (no masking code); ``mask_mode_for`` / ``plan_mask_mode`` say which mode a plan
runs with.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi as plan_abi
from pallas_kernels import templates as _templates
from pallas_kernels.templates import TritonConfig
from pallas_kernels.triton.kernel import (MASK_MODES, MAX_HEAD_DIM, KernelConfig, forward,
                                          padded_head_dim)

__all__ = ["KernelConfig", "attention", "mask_mode_for", "plan_mask_mode", "default_interpret",
           "MASK_MODES"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _template(template):
    t = _templates.get(template)
    if t.backend != "triton":
        raise ValueError(f"template {t.name!r} belongs to backend {t.backend!r}, not 'triton'")
    return t


def mask_mode_for(template, all_full: bool) -> str:
    """The mask mode a plan runs with on this template, given whether every step it visits is
    full (for a trusted plan that knows it, e.g. ``Plan.all_full``: no walk over the steps):
    "none" for an all-full plan on a template that masks by "cond", else the template's."""
    return _auto_mask_mode(_template(template).kernel.mask_mode, bool(all_full))


def plan_mask_mode(units, steps, template, q_len_padded, kv_len_padded) -> str:
    """The mask mode a concrete (NumPy) plan runs with on this template (``mask_mode_for`` of
    its fullness). Checks the plan like ``attention`` does (``abi.check_plan``)."""
    t = _template(template)
    all_full = plan_abi.check_plan(units, steps, t.tile_q, t.tile_kv, int(q_len_padded),
                                   int(kv_len_padded), q_align=t.q_align, kv_align=t.kv_align)
    return _auto_mask_mode(t.kernel.mask_mode, all_full)


def _auto_mask_mode(mode: str, all_full: bool) -> str:
    return "none" if all_full and mode == "cond" else mode


def default_interpret() -> bool:
    """Interpret mode unless jax's default backend is a GPU."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


@functools.partial(jax.jit, static_argnames=(
    "config", "q_len_padded", "kv_len_padded", "scale", "return_lse", "interpret"))
def _attention(q, k, v, units, steps, row_index, row_index_t=None, *, config, q_len_padded,
               kv_len_padded, scale, return_lse, interpret):
    B, Lq, Hq, D = q.shape
    d_pad = padded_head_dim(D)
    pad_d = d_pad - D

    def pad(x, length):
        extra = length - x.shape[1]
        if extra == 0 and pad_d == 0:
            return x
        return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, pad_d)))

    out_units, lse_units = forward(
        pad(q, q_len_padded), pad(k, kv_len_padded), pad(v, kv_len_padded),
        units, steps, config=config, scale=scale, head_dim=D, interpret=interpret)
    if pad_d:
        out_units = out_units[..., :D]
    if row_index is None:
        row_index = plan_abi.row_index_from_units(units, Hq, Lq, config.tile_q)
    out, lse = plan_abi.gather_rows(out_units, lse_units, row_index, row_index_t)
    return (out, lse) if return_lse else out


def _check_int(name, val, minimum=1):
    if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if val < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {val}")
    return int(val)


def _config(template, tile_q, tile_kv, num_warps, num_stages, prefetch, mask_mode):
    """(KernelConfig, q_align, kv_align) from a template or the direct arguments; mask_mode
    None takes the template's ("cond" without one)."""
    if template is not None:
        t = _template(template)
        for name, given, want in (("tile_q", tile_q, t.tile_q), ("tile_kv", tile_kv, t.tile_kv),
                                  ("num_stages", num_stages, t.stages),
                                  ("num_warps", num_warps, t.kernel.num_warps),
                                  ("prefetch", prefetch, t.kernel.prefetch)):
            if given is not None and given != want:
                raise ValueError(f"{name}={given} contradicts template {t.name!r} ({name}={want})")
        return KernelConfig.from_template(t, mask_mode), t.q_align, t.kv_align
    if tile_q is None or tile_kv is None:
        raise ValueError("pass either template or both tile_q and tile_kv")
    mode = mask_mode or "cond"
    variant = TritonConfig(num_warps=num_warps, prefetch=False if prefetch is None else prefetch,
                           mask_mode=mode if mode in TritonConfig.MASK_MODES else "cond")
    return KernelConfig(tile_q, tile_kv, 2 if num_stages is None else num_stages, variant,
                        mode), 1, 1


def attention(q, k, v, units, steps, row_index, *, q_len_padded, kv_len_padded, tile_q=None,
              tile_kv=None, scale=None, return_lse=False, num_warps=None, num_stages=None,
              mask_mode=None, prefetch=None, template=None, interpret=None, check_plan=True):
    """Block-sparse attention forward executing a plan, on the Pallas Triton lowering.

    q: [B, Lq, Hq, D]; k, v: [B, Lkv, Hkv, D] (same dtype: float32, bfloat16 or float16;
    Hq % Hkv == 0). units, steps, row_index and the static ints are a plan's fields (see
    ``pallas_kernels.abi``; ``row_index=None`` computes it on the device from units).
    The kernel configuration comes either from ``template`` (a "triton" template or its name:
    tile shape, stages, its ``TritonConfig``) or from tile_q / tile_kv / num_warps /
    num_stages / prefetch directly (num_stages defaults to 2). mask_mode (``MASK_MODES``) None
    takes the template's ("cond" without one), switched to "none" when a concrete NumPy plan's
    steps are all full; an explicit "none" on a concrete plan with partial steps is an error.
    scale defaults to D ** -0.5. interpret=None runs interpret mode when jax has no GPU.
    check_plan=False: the caller vouches for a NumPy plan (built by the planner for these
    tiles): no host walk over its steps (``abi.check_plan``), and the template's mask mode
    applies.
    Returns out [B, Lq, Hq, D] in q.dtype, and with return_lse also lse [B, Hq, Lq] float32
    (natural log; -inf and a 0 output row where no key is selected).
    """
    auto_mode = mask_mode is None
    if mask_mode is not None and mask_mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be None or one of {MASK_MODES}, got {mask_mode!r}")
    config, q_align, kv_align = _config(template, tile_q, tile_kv, num_warps, num_stages,
                                        prefetch, mask_mode)
    tile_q, tile_kv = config.tile_q, config.tile_kv
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have rank 4 [B, L, H, D], got shape {tuple(x.shape)}")
    B, Lq, Hq, D = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    Bk, Lkv, Hkv, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head dim")
    if min(q.shape) < 1 or min(k.shape) < 1:
        raise ValueError(f"q and k must have no empty dimension, got {q.shape} and {k.shape}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    dt = jnp.dtype(q.dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {dt}; supported: float32, bfloat16, float16")
    for name, x in (("k", k), ("v", v)):
        if jnp.dtype(x.dtype) != dt:
            raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {dt}")
    if padded_head_dim(D) > MAX_HEAD_DIM:
        raise ValueError(f"head_dim D={D} is not supported by the Triton kernel (max {MAX_HEAD_DIM})")
    if template is not None and not _templates.get(template).supports(D, dt):
        t = _templates.get(template)
        raise ValueError(f"template {t.name!r} takes head dims {t.head_dims[0]}.."
                         f"{t.head_dims[-1]} and dtypes {t.dtypes}; got head_dim={D}, dtype={dt}")

    q_len_padded = _check_int("q_len_padded", q_len_padded)
    kv_len_padded = _check_int("kv_len_padded", kv_len_padded)
    if q_len_padded < max(Lq, tile_q):
        raise ValueError(f"q_len_padded={q_len_padded} must be >= Lq={Lq} and >= tile_q={tile_q}")
    if kv_len_padded < max(Lkv, tile_kv):
        raise ValueError(
            f"kv_len_padded={kv_len_padded} must be >= Lkv={Lkv} and >= tile_kv={tile_kv}")
    plan_abi.check_plan_arrays(units, steps, row_index, num_q_heads=Hq, q_len=Lq)
    if check_plan and isinstance(units, np.ndarray) and isinstance(steps, np.ndarray):
        all_full = plan_abi.check_plan(units, steps, tile_q, tile_kv, q_len_padded,
                                       kv_len_padded, num_q_heads=Hq, q_align=q_align,
                                       kv_align=kv_align)
        if config.mask_mode == "none" and not all_full:
            raise ValueError("mask_mode='none' needs a plan whose visited steps are all full; "
                             "this plan has partial steps")
        if auto_mode:
            config = KernelConfig(config.tile_q, config.tile_kv, config.stages, config.variant,
                                  _auto_mask_mode(config.mask_mode, all_full))

    if scale is None:
        scale = float(D) ** -0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a Python float (static), got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be finite and positive, got {scale}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if interpret is None:
        interpret = default_interpret()
    elif not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"interpret must be a bool or None, got {type(interpret).__name__}")

    return _attention(q, k, v, units, steps, row_index, plan_abi.token_major(row_index),
                      config=config,
                      q_len_padded=q_len_padded, kv_len_padded=kv_len_padded, scale=scale,
                      return_lse=bool(return_lse), interpret=bool(interpret))
