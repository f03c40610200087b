"""Block-sparse attention forward on the Pallas Triton lowering: executes a plan (``plan_abi``).

The portable GPU path (Ampere, Ada, Hopper without Mosaic GPU) and the kernel the CPU tests run
in interpret mode. One program per (work unit, batch): it loads its Q tile once, walks the
unit's steps (K/V tiles) with a dynamic loop and an exp2 online softmax, masks only partial
steps, and writes one unit-major tile of output and LSE. Passing
``jax.experimental.pallas.triton.CompilerParams`` selects this lowering even though Mosaic GPU
is jax's default GPU lowering.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import abi as plan_abi

__all__ = ["TritonConfig", "attention", "mask_mode_for", "plan_mask_mode", "supports"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256      # padded head dim; beyond it one Q tile + accumulator won't fit registers
MIN_TILE = 16           # Triton's dot needs M, N, K >= 16
MASK_MODES = ("cond", "always", "none", "prefix")
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _is_pow2(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0 and (x & (x - 1)) == 0


def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernel computes with: the next power of two, at least ``MIN_TILE``."""
    return max(MIN_TILE, pl.next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True, slots=True)
class TritonConfig:
    """Static kernel parameters (part of the compiled executable).

    tile_q, tile_kv: the plan's Q tile height and K/V tile width (powers of two in [16, 128]:
      Triton blocks must be powers of two, its dot needs 16, the plan ABI's rectangle bytes
      hold at most 255).
    num_warps: warps per program; None picks 4 for head_dim <= 64, else 8 (like jax's mha).
    num_stages: software-pipelining depth of the K/V loads inside the step loop.
    mask_mode: how steps are masked. "cond": a ``lax.cond`` per step skips the element mask
      on full steps; "always": every step masked (no branch); "none": no masking code at all
      (only for plans whose visited steps are all full); "prefix": per unit, a loop without
      masking code over its leading full steps, then the "cond" loop over the rest (the count
      computed in the wrapper; two loops in sequence, not under a branch: ptxas serialised the
      wgmma of loops under a ``lax.cond``).
    prefetch: the loop carries the next step's kv_start, so a step's K/V address does not hang
      on a scalar load of the same iteration. With it and num_stages >= 3 Triton's pipeliner
      issues the K/V copies a full step ahead (3 buffers) instead of after the step's compute
      (seen in the TTGIR of Triton 3.9 for sm_90; carrying two steps ahead stopped it
      pipelining at all, so one it is).
    """

    tile_q: int
    tile_kv: int
    num_warps: int | None = None
    num_stages: int = 2
    mask_mode: str = "cond"
    prefetch: bool = False

    def __post_init__(self):
        for name in ("tile_q", "tile_kv"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(val).__name__}")
            if not _is_pow2(val) or not MIN_TILE <= val <= plan_abi.MAX_TILE:
                raise ValueError(f"{name} must be a power of two in [{MIN_TILE}, "
                                 f"{plan_abi.MAX_TILE}] (the plan ABI packs rectangle "
                                 f"bounds in bytes), got {val}")
        if self.num_warps is not None:
            if isinstance(self.num_warps, bool) or not isinstance(self.num_warps, (int, np.integer)):
                raise TypeError(f"num_warps must be an int or None, got {type(self.num_warps).__name__}")
            if self.num_warps not in (1, 2, 4, 8, 16):
                raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, (int, np.integer)):
            raise TypeError(f"num_stages must be an int, got {type(self.num_stages).__name__}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages}")
        if self.mask_mode not in MASK_MODES:
            raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {self.mask_mode!r}")
        if not isinstance(self.prefetch, (bool, np.bool_)):
            raise TypeError(f"prefetch must be a bool, got {type(self.prefetch).__name__}")

    def warps_for(self, head_dim: int) -> int:
        if self.num_warps is not None:
            return int(self.num_warps)
        return 4 if head_dim <= 64 else 8


def supports(head_dim: int, dtype) -> str | None:
    """None if this kernel can take the call, else the reason it can't (for backend fallback)."""
    dt = jnp.dtype(dtype)
    if dt not in SUPPORTED_DTYPES:
        return f"dtype {dt} is not supported (float32, bfloat16, float16)"
    if padded_head_dim(head_dim) > MAX_HEAD_DIM:
        return f"head_dim {head_dim} exceeds {MAX_HEAD_DIM}"
    return None


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
def _fwd_kernel(*refs, tile_q: int, tile_kv: int, group: int, qk_scale: float, mask_mode: str,
                prefetch: int, num_steps: int, precision):
    """One work unit x one batch element: Q tile vs. the unit's steps, online softmax (exp2)."""
    if mask_mode == "prefix":
        units_ref, steps_ref, lead_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    else:
        units_ref, steps_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        lead_ref = None
    u = pl.program_id(0)
    head = units_ref[u, plan_abi.UNIT_HEAD]
    q_start = units_ref[u, plan_abi.UNIT_Q_START]
    step_ptr = units_ref[u, plan_abi.UNIT_STEP_PTR]
    step_cnt = units_ref[u, plan_abi.UNIT_STEP_CNT]
    kv_head = head if group == 1 else lax.div(head, jnp.int32(group))
    d_pad = q_ref.shape[-1]

    q = q_ref[pl.ds(q_start, tile_q), head, :]                      # [tile_q, Dp]
    row = lax.broadcasted_iota(jnp.int32, (tile_q, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, tile_kv), 1)

    def step(s, kv_start, carry, masking):
        acc, m_prev, l_prev = carry
        k = k_ref[pl.ds(kv_start, tile_kv), kv_head, :]             # [tile_kv, Dp]
        v = v_ref[pl.ds(kv_start, tile_kv), kv_head, :]
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)     # f32 [tile_q, tile_kv]
        if masking != "none":
            rect = steps_ref[s, plan_abi.STEP_RECT]

            def masked(x):
                q_lo, q_hi, kv_lo, kv_hi = plan_abi.unpack_rect(rect)
                keep = ((row >= q_lo) & (row < q_hi)) & ((col >= kv_lo) & (col < kv_hi))
                return jnp.where(keep, x, -jnp.inf)

            if masking == "cond":
                full = rect == jnp.int32(plan_abi.full_rect(tile_q, tile_kv))
                qk = lax.cond(full, lambda x: x, masked, qk)
            else:
                qk = masked(qk)
        # Scores in log2 units: s = qk * scale * log2(e); max commutes with the positive scale,
        # so exp2(qk * c - m) is one FMA per element.
        m_cur = jnp.max(qk, axis=-1) * qk_scale
        m_next = jnp.maximum(m_prev, m_cur)
        if masking == "none":
            m_safe = m_next             # every row has a finite score from the first step on
        else:
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)     # a row with nothing yet
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(qk * qk_scale - m_safe[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=-1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_next, l_next

    init = (jnp.zeros((tile_q, d_pad), jnp.float32),
            jnp.full((tile_q,), -jnp.inf, jnp.float32),
            jnp.zeros((tile_q,), jnp.float32))
    lo, hi = step_ptr, step_ptr + step_cnt
    last = jnp.int32(num_steps - 1)

    def run(masking, lo, hi, init):
        if not prefetch:
            body = lambda s, c: step(s, steps_ref[s, plan_abi.STEP_KV_START], c, masking)
            return lax.fori_loop(lo, hi, body, init)

        # The kv_start of the next ``prefetch`` steps ride in the loop carry, so a step's K/V
        # address does not wait on a scalar load issued in the same iteration (depth 1 only
        # from the config: depth 2 made Triton 3.9 drop the software pipelining).
        kv_at = lambda i: steps_ref[jnp.minimum(i, last), plan_abi.STEP_KV_START]

        def body(s, c):
            starts, carry = c
            nxt = kv_at(s + prefetch)
            return starts[1:] + (nxt,), step(s, starts[0], carry, masking)

        first = tuple(kv_at(lo + i) for i in range(prefetch))
        return lax.fori_loop(lo, hi, body, (first, init))[1]

    if mask_mode == "prefix":
        mid = lo + lead_ref[u]
        acc, m_i, l_i = run("cond", mid, hi, run("none", lo, mid, init))
    else:
        acc, m_i, l_i = run(mask_mode, lo, hi, init)

    has_key = l_i > 0.0
    l_safe = jnp.where(has_key, l_i, 1.0)
    # plgpu.store, not ref[...] = x: the latter lowers to a swap (an extra load of the tile).
    plgpu.store(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype))
    plgpu.store(lse_ref, jnp.where(has_key, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf))


def _leading_full_steps(units, steps, tile_q: int, tile_kv: int):
    """int32 [U]: how many of each unit's first steps are full (mask mode "prefix"), from the
    index of the next partial step at or after each row (a reverse running minimum)."""
    S = steps.shape[0]
    partial = steps[:, plan_abi.STEP_RECT] != plan_abi.full_rect(tile_q, tile_kv)
    idx = jnp.where(partial, jnp.arange(S, dtype=jnp.int32), jnp.int32(S))
    next_partial = jnp.concatenate([lax.cummin(idx, reverse=True), jnp.full((1,), S, jnp.int32)])
    ptr = jnp.clip(units[:, plan_abi.UNIT_STEP_PTR], 0, S)
    cnt = jnp.maximum(units[:, plan_abi.UNIT_STEP_CNT], 0)
    return jnp.minimum(next_partial[ptr] - ptr, cnt).astype(jnp.int32)


def _attention_forward(q, k, v, units, steps, *, config: TritonConfig, scale: float,
                       head_dim: int, interpret: bool):
    """pallas_call over grid (num_units, B); q/k/v already padded (lengths and head dim)."""
    B, Lqp, Hq, d_pad = q.shape
    _, Lkvp, Hkv, _ = k.shape
    U = units.shape[0]
    tq, tkv = config.tile_q, config.tile_kv
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _fwd_kernel, tile_q=tq, tile_kv=tkv, group=Hq // Hkv, qk_scale=scale * _LOG2E,
        mask_mode=config.mask_mode, prefetch=int(config.prefetch), num_steps=steps.shape[0],
        precision=precision)
    whole = lambda shape: pl.BlockSpec(shape, lambda u, b: (0,) * len(shape))
    plan_ops = [units, steps]
    if config.mask_mode == "prefix":
        plan_ops.append(_leading_full_steps(units, steps, tq, tkv))
    return pl.pallas_call(
        kernel,
        grid=(U, B),
        in_specs=[whole(x.shape) for x in plan_ops] + [
            pl.BlockSpec((None, Lqp, Hq, d_pad), lambda u, b: (b, 0, 0, 0)),
            pl.BlockSpec((None, Lkvp, Hkv, d_pad), lambda u, b: (b, 0, 0, 0)),
            pl.BlockSpec((None, Lkvp, Hkv, d_pad), lambda u, b: (b, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, tq, d_pad), lambda u, b: (b, u, 0, 0)),
            pl.BlockSpec((None, None, tq), lambda u, b: (b, u, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, U, tq, d_pad), q.dtype),
            jax.ShapeDtypeStruct((B, U, tq), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=config.warps_for(head_dim), num_stages=config.num_stages),
        interpret=interpret,
        name="tessera_triton_fwd",
    )(*plan_ops, q, k, v)


@functools.partial(jax.jit, static_argnames=(
    "config", "q_len_padded", "kv_len_padded", "scale", "return_lse", "interpret"))
def _attention(q, k, v, units, steps, row_index, *, config, q_len_padded, kv_len_padded,
               scale, return_lse, interpret):
    B, Lq, Hq, D = q.shape
    d_pad = padded_head_dim(D)
    pad_d = d_pad - D

    def pad(x, length):
        extra = length - x.shape[1]
        if extra == 0 and pad_d == 0:
            return x
        return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, pad_d)))

    out_units, lse_units = _attention_forward(
        pad(q, q_len_padded), pad(k, kv_len_padded), pad(v, kv_len_padded),
        units, steps, config=config, scale=scale, head_dim=D, interpret=interpret)
    if pad_d:
        out_units = out_units[..., :D]
    if row_index is None:
        row_index = plan_abi.row_index_from_units(units, Hq, Lq, config.tile_q)
    out, lse = plan_abi.gather_rows(out_units, lse_units, row_index)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# Public entry
# --------------------------------------------------------------------------------------------
def _check_int(name, val, minimum=1):
    if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if val < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {val}")
    return int(val)


def _check_plan_array(name, x, cols=None, shape=None):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an int32 array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name} must have dtype int32, got {x.dtype}")
    if cols is not None and (len(x.shape) != 2 or x.shape[1] != cols or x.shape[0] < 1):
        raise ValueError(f"{name} must have shape [N >= 1, {cols}], got {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


_CHECKED: dict = {}     # id pair -> (units, steps, all_full): concrete plans already checked


def _check_concrete_plan(units, steps, Hq, tile_q, tile_kv, q_len_padded, kv_len_padded):
    """Bounds of a host (NumPy) plan (an out-of-range tile would read out of bounds on a GPU);
    returns whether every visited step is full (mask mode "none" can run it).

    Memoised per array pair (the arrays are held so their ids stay unique), so a cached plan
    costs a dict look-up per call. ``Hq`` None skips the head check.
    """
    key = (id(units), id(steps), Hq, tile_q, tile_kv, q_len_padded, kv_len_padded)
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit[2]
    u, st = np.asarray(units, np.int64), np.asarray(steps)
    real = u[:, plan_abi.UNIT_STEP_CNT] > 0
    head, qs = u[:, plan_abi.UNIT_HEAD], u[:, plan_abi.UNIT_Q_START]
    ptr, cnt = u[:, plan_abi.UNIT_STEP_PTR], u[:, plan_abi.UNIT_STEP_CNT]
    bad = []
    if Hq is not None and ((head < 0) | (head >= Hq)).any():
        bad.append(f"a unit's head is outside [0, {Hq})")
    if ((qs < 0) | (qs + tile_q > q_len_padded)).any():
        bad.append(f"a unit's Q tile leaves [0, q_len_padded={q_len_padded})")
    if (cnt < 0).any() or ((ptr < 0) | (ptr + cnt > len(st)))[real].any():
        bad.append(f"a unit's steps leave the {len(st)} rows of steps")
    kvs = st[:, plan_abi.STEP_KV_START].astype(np.int64)
    if ((kvs < 0) | (kvs + tile_kv > kv_len_padded)).any():
        bad.append(f"a step's K/V tile leaves [0, kv_len_padded={kv_len_padded})")
    if bad:
        raise ValueError("invalid plan for the Triton kernel: " + "; ".join(bad))
    # Visited step rows by a prefix count over the units' [ptr, ptr + cnt) ranges.
    edges = np.zeros(len(st) + 1, np.int64)
    np.add.at(edges, ptr[real], 1)
    np.add.at(edges, (ptr + cnt)[real], -1)
    visited = np.cumsum(edges[:-1]) > 0
    full = st[:, plan_abi.STEP_RECT] == plan_abi.full_rect(tile_q, tile_kv)
    all_full = bool((full | ~visited).all())
    if len(_CHECKED) >= 64:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[key] = (units, steps, all_full)
    return all_full


def _template_config(template):
    """(tile_q, tile_kv, num_stages, num_warps, mask_mode, prefetch) of a "triton" template."""
    from pallas_kernels import templates as _templates
    t = _templates.get(template)
    if t.backend != "triton":
        raise ValueError(f"template {t.name!r} belongs to backend {t.backend!r}, not 'triton'")
    return t, (t.tile_q, t.tile_kv, t.stages, t.option("num_warps"),
               t.option("mask_mode", "cond"), bool(t.option("prefetch", False)))


def mask_mode_for(template, all_full: bool) -> str:
    """The mask mode a plan runs with on this template, given whether every step it visits is
    full (for a trusted plan that knows it, e.g. ``Plan.all_full``: no walk over the steps)."""
    _, (_, _, _, _, mode, _) = _template_config(template)
    return _auto_mask_mode(mode, bool(all_full))


def plan_mask_mode(units, steps, template, q_len_padded, kv_len_padded) -> str:
    """The mask mode a concrete (NumPy) plan runs with on this template: "none" (no masking
    code) when the template masks by "cond" or "prefix" and every visited step is full, else the
    template's own. Checks the plan's bounds like ``attention`` does."""
    t, (tq, tkv, _, _, mode, _) = _template_config(template)
    all_full = _check_concrete_plan(units, steps, None, tq, tkv, int(q_len_padded),
                                    int(kv_len_padded))
    return _auto_mask_mode(mode, all_full)


def _auto_mask_mode(mode: str, all_full: bool) -> str:
    return "none" if all_full and mode in ("cond", "prefix") else mode


def default_interpret() -> bool:
    """Interpret mode unless jax's default backend is a GPU."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def attention(q, k, v, units, steps, row_index, *, q_len_padded, kv_len_padded, tile_q=None,
              tile_kv=None, scale=None, return_lse=False, num_warps=None, num_stages=None,
              mask_mode=None, prefetch=None, template=None, interpret=None, check_plan=True):
    """Block-sparse attention forward executing a plan, on the Pallas Triton lowering.

    q: [B, Lq, Hq, D]; k, v: [B, Lkv, Hkv, D] (same dtype: float32, bfloat16 or float16;
    Hq % Hkv == 0). units, steps, row_index and the static ints are a plan's fields (see
    ``pallas_kernels.abi``; ``row_index=None`` computes it on the device from units).
    The kernel configuration comes either from ``template`` (a
    registered "triton" template or its name: tile shape, num_stages, num_warps, mask_mode,
    prefetch) or from tile_q / tile_kv / num_warps / num_stages / prefetch directly
    (num_stages defaults to 2). mask_mode (see ``TritonConfig``) None takes the template's
    ("cond" without one), switched to "none" when a concrete NumPy plan's steps are all full;
    an explicit "none" on a concrete plan with partial steps is an error. scale defaults to
    D ** -0.5. interpret=None runs interpret mode when jax has no GPU. check_plan=False: the
    caller vouches for a NumPy plan (built by the planner for these tiles): no host walk over
    its steps, and the template's mask mode applies.
    Returns out [B, Lq, Hq, D] in q.dtype, and with return_lse also lse [B, Hq, Lq] float32
    (natural log; -inf and a 0 output row where no key is selected).
    """
    auto_mode = mask_mode is None
    if template is not None:
        t, (t_tq, t_tkv, t_st, t_nw, t_mode, t_pf) = _template_config(template)
        for name, given, want in (("tile_q", tile_q, t_tq), ("tile_kv", tile_kv, t_tkv),
                                  ("num_stages", num_stages, t_st),
                                  ("num_warps", num_warps, t_nw), ("prefetch", prefetch, t_pf)):
            if given is not None and given != want:
                raise ValueError(f"{name}={given} contradicts template {t.name!r} ({name}={want})")
        tile_q, tile_kv, num_stages, num_warps, prefetch = t_tq, t_tkv, t_st, t_nw, t_pf
        if mask_mode is None:
            mask_mode = t_mode
    elif tile_q is None or tile_kv is None:
        raise ValueError("pass either template or both tile_q and tile_kv")
    if num_stages is None:
        num_stages = 2
    if mask_mode is None:
        mask_mode = "cond"
    if prefetch is None:
        prefetch = False
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

    config = TritonConfig(tile_q, tile_kv, num_warps, num_stages, mask_mode, prefetch)
    q_len_padded = _check_int("q_len_padded", q_len_padded)
    kv_len_padded = _check_int("kv_len_padded", kv_len_padded)
    if q_len_padded < max(Lq, tile_q):
        raise ValueError(f"q_len_padded={q_len_padded} must be >= Lq={Lq} and >= tile_q={tile_q}")
    if kv_len_padded < max(Lkv, tile_kv):
        raise ValueError(
            f"kv_len_padded={kv_len_padded} must be >= Lkv={Lkv} and >= tile_kv={tile_kv}")
    _check_plan_array("units", units, cols=plan_abi.UNIT_COLS)
    _check_plan_array("steps", steps, cols=plan_abi.STEP_COLS)
    if row_index is not None:       # None: computed on the device from units
        _check_plan_array("row_index", row_index, shape=(Hq, Lq))
    if check_plan and isinstance(units, np.ndarray) and isinstance(steps, np.ndarray):
        all_full = _check_concrete_plan(units, steps, Hq, int(tile_q), int(tile_kv),
                                        q_len_padded, kv_len_padded)
        if mask_mode == "none" and not all_full:
            raise ValueError("mask_mode='none' needs a plan whose visited steps are all full; "
                             "this plan has partial steps")
        if auto_mode:
            config = dataclasses.replace(config, mask_mode=_auto_mask_mode(mask_mode, all_full))

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

    return _attention(q, k, v, units, steps, row_index, config=config,
                      q_len_padded=q_len_padded, kv_len_padded=kv_len_padded, scale=scale,
                      return_lse=bool(return_lse), interpret=bool(interpret))
