"""Backward kernels on the Pallas Triton lowering: dq over the forward plan, dk/dv over the
transposed plan (``pallas_kernels.backward_rows`` says which is which).

FlashAttention-2's backward split in two launches, each one program per (unit, batch) like the
forward kernel (``pallas_kernels.triton.kernel``), each step masked as the forward masks it
(a plain step's rectangle, a grid step's cells, a bitmap step's bits; full steps unmasked):

* ``dq``: the unit's Q, dO tile and each row's lse / delta; per step (a K/V tile)
  P = exp2(S * scale * log2 e - lse * log2 e), dP = dO V^T, dS = P (dP - delta), dQ += dS K;
* ``dkv``: the unit's K, V tile (keys of query head UNIT_HEAD's K/V head); per step (a query
  tile) P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q. dk / dv are
  written per query head in float32 and summed over each K/V head's group outside.

Rows with no selected key carry lse = +inf (``backward_rows.lse_for_backward``): P is 0 there.
On CPU the kernels run in interpret mode (``interpret=None`` picks it without a GPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import abi
from pallas_kernels import backward_rows as rows_
from pallas_kernels.triton.kernel import _bitmap_keep, _grid_keep, padded_head_dim

__all__ = ["dq", "dkv", "dkv_tiles", "MASK_MODES"]

MASK_MODES = ("cond", "always", "none")
_LOG2E = math.log2(math.e)


def dkv_tiles(head_dim: int) -> tuple[int, int]:
    """(keys per unit, queries per step) of the transposed plan: 64 x 64 keeps the two
    float32 accumulators (dK, dV) and the K / V tile of a program in registers up to D = 128
    (tuned on the GPU later; any power of two in [16, 128] is correct)."""
    return (64, 64) if padded_head_dim(head_dim) <= 128 else (32, 32)


def _warps(tile_q: int) -> int:
    return 8 if tile_q >= 128 else 4


def _masked(steps_ref, s, x, row, col, *, mode: str, tile_q: int, tile_kv: int,
            num_steps: int):
    """Scores ``x`` [tile_q, tile_kv] of step ``s`` with -inf where the step selects nothing:
    the forward kernel's rule (``kernel._fwd_kernel``): a branch on STEP_CUTS_B between a
    plain step's rectangle, a grid step's cells and a bitmap step's bits; with mode "cond"
    a full step skips masking."""
    if mode == "none":
        return x
    rect = steps_ref[s, abi.STEP_RECT]
    cuts_b = steps_ref[s, abi.STEP_CUTS_B]
    plain = cuts_b == 0

    def rect_mask(x):
        q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(rect)
        keep = ((row >= q_lo) & (row < q_hi)) & ((col >= kv_lo) & (col < kv_hi))
        return jnp.where(keep, x, -jnp.inf)

    def grid_mask(x):
        keep = _grid_keep(row, col, rect, steps_ref[s, abi.STEP_CUTS_A], cuts_b)
        return jnp.where(keep, x, -jnp.inf)

    def bitmap_mask(x):
        keep = _bitmap_keep(steps_ref, row, col, rect, steps_ref[s, abi.STEP_CUTS_A],
                            tile_q=tile_q, tile_kv=tile_kv, num_steps=num_steps)
        return jnp.where(keep, x, -jnp.inf)

    cells = lambda x: lax.cond(cuts_b == abi.BITMAP_FLAG, bitmap_mask, grid_mask, x)  # noqa: E731
    masked = lambda x: lax.cond(plain, rect_mask, cells, x)                           # noqa: E731
    if mode == "cond":
        full = (rect == jnp.int32(abi.full_rect(tile_q, tile_kv))) & plain
        return lax.cond(full, lambda x: x, masked, x)
    return masked(x)


def _dq_kernel(units_ref, steps_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
               *, tile_q: int, tile_kv: int, group: int, scale: float, mode: str,
               num_steps: int, precision):
    u = pl.program_id(0)
    head = units_ref[u, abi.UNIT_HEAD]
    q_start = units_ref[u, abi.UNIT_Q_START]
    ptr, cnt = units_ref[u, abi.UNIT_STEP_PTR], units_ref[u, abi.UNIT_STEP_CNT]
    kv_head = head if group == 1 else lax.div(head, jnp.int32(group))
    q = q_ref[pl.ds(q_start, tile_q), head, :]                       # [tile_q, Dp]
    do = do_ref[pl.ds(q_start, tile_q), head, :]
    lse2 = lse_ref[...] * _LOG2E                                     # [tile_q], log2 units
    delta = delta_ref[...]
    row = lax.broadcasted_iota(jnp.int32, (tile_q, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, tile_kv), 1)
    qk_scale = scale * _LOG2E

    def body(s, acc):
        kv_start = steps_ref[s, abi.STEP_KV_START]
        k = k_ref[pl.ds(kv_start, tile_kv), kv_head, :]              # [tile_kv, Dp]
        v = v_ref[pl.ds(kv_start, tile_kv), kv_head, :]
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)      # f32 [tile_q, tile_kv]
        qk = _masked(steps_ref, s, qk, row, col, mode=mode, tile_q=tile_q, tile_kv=tile_kv,
                     num_steps=num_steps)
        p = jnp.exp2(qk * qk_scale - lse2[:, None])
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        return acc + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

    acc = lax.fori_loop(ptr, ptr + cnt, body, jnp.zeros((tile_q, q.shape[-1]), jnp.float32))
    plgpu.store(dq_ref, (acc * scale).astype(dq_ref.dtype))


def _dkv_kernel(units_ref, steps_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, tile_q: int, tile_kv: int, group: int, scale: float, mode: str,
                num_steps: int, precision):
    u = pl.program_id(0)
    head = units_ref[u, abi.UNIT_HEAD]                               # a query head
    k_start = units_ref[u, abi.UNIT_Q_START]                         # the unit's first key
    ptr, cnt = units_ref[u, abi.UNIT_STEP_PTR], units_ref[u, abi.UNIT_STEP_CNT]
    kv_head = head if group == 1 else lax.div(head, jnp.int32(group))
    k = k_ref[pl.ds(k_start, tile_q), kv_head, :]                    # [tile_q keys, Dp]
    v = v_ref[pl.ds(k_start, tile_q), kv_head, :]
    row = lax.broadcasted_iota(jnp.int32, (tile_q, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, tile_kv), 1)
    qk_scale = scale * _LOG2E

    def body(s, carry):
        dk, dv = carry
        q_start = steps_ref[s, abi.STEP_KV_START]                    # the step's first query
        q = q_ref[pl.ds(q_start, tile_kv), head, :]                  # [tile_kv queries, Dp]
        do = do_ref[pl.ds(q_start, tile_kv), head, :]
        lse2 = lse_ref[head, pl.ds(q_start, tile_kv)] * _LOG2E
        delta = delta_ref[head, pl.ds(q_start, tile_kv)]
        st = plgpu.dot(k, q, trans_b=True, precision=precision)      # S^T [keys, queries]
        st = _masked(steps_ref, s, st, row, col, mode=mode, tile_q=tile_q, tile_kv=tile_kv,
                     num_steps=num_steps)
        pt = jnp.exp2(st * qk_scale - lse2[None, :])
        dv = dv + plgpu.dot(pt.astype(do.dtype), do, precision=precision)
        dpt = plgpu.dot(v, do, trans_b=True, precision=precision)
        dst = pt * (dpt - delta[None, :])
        dk = dk + plgpu.dot(dst.astype(q.dtype), q, precision=precision)
        return dk, dv

    zeros = jnp.zeros((tile_q, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(ptr, ptr + cnt, body, (zeros, zeros))
    plgpu.store(dk_ref, dk * scale)
    plgpu.store(dv_ref, dv)


def _pad(x, length: int, d_pad: int):
    """[B, L, H, D] -> [B, length, H, d_pad], zeros."""
    extra, pad_d = length - x.shape[1], d_pad - x.shape[-1]
    if extra == 0 and pad_d == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, pad_d)))


def _check(mode, interpret):
    if mode not in MASK_MODES:
        raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mode!r}")
    from pallas_kernels.triton.wrapper import default_interpret
    return default_interpret() if interpret is None else bool(interpret)


_STATICS = ("tile_q", "tile_kv", "q_len_padded", "kv_len_padded", "scale", "mask_mode",
            "interpret")


def dq(q, k, v, do, lse, delta, units, steps, *, tile_q, tile_kv, q_len_padded, kv_len_padded,
       scale, mask_mode="cond", interpret=None, row_index=None):
    """dq [B, Lq, Hq, D] (q.dtype) over a forward plan (its ABI arrays, trusted: built by a
    planner for these tiles and padded lengths). q, do [B, Lq, Hq, D]; k, v [B, Lkv, Hkv, D];
    lse (+inf on rows with no selected key), delta: [B, Hq, Lq] float32. ``mask_mode``
    "none" only for plans whose visited steps are all full. ``row_index``: the plan's (NumPy;
    None: made on the device from units)."""
    interpret = _check(mask_mode, interpret)
    return _dq(q, k, v, do, lse, delta, units, steps,
               rows_.host_unit_index(units, int(tile_q), int(q_len_padded)),
               abi.token_major(row_index), tile_q=int(tile_q), tile_kv=int(tile_kv),
               q_len_padded=int(q_len_padded), kv_len_padded=int(kv_len_padded),
               scale=float(scale), mask_mode=mask_mode, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATICS)
def _dq(q, k, v, do, lse, delta, units, steps, unit_index, row_index_t, *, tile_q, tile_kv,
        q_len_padded, kv_len_padded, scale, mask_mode, interpret):
    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    dp_ = padded_head_dim(D)
    U = units.shape[0]
    lse_u = rows_.unit_rows(rows_.pad_rows(lse, q_len_padded, jnp.inf), units, tile_q,
                            unit_index)
    delta_u = rows_.unit_rows(rows_.pad_rows(delta, q_len_padded, 0.0), units, tile_q,
                              unit_index)
    kernel = functools.partial(
        _dq_kernel, tile_q=tile_q, tile_kv=tile_kv, group=Hq // Hkv, scale=scale,
        mode=mask_mode, num_steps=steps.shape[0], precision=_precision(q.dtype))
    whole = lambda a: pl.BlockSpec(a.shape, lambda u, b: (0,) * a.ndim)     # noqa: E731
    seq = lambda L, H: pl.BlockSpec((None, L, H, dp_), lambda u, b: (b, 0, 0, 0))  # noqa: E731
    per_unit = pl.BlockSpec((None, None, tile_q), lambda u, b: (b, u, 0))
    dq_u = pl.pallas_call(
        kernel, grid=(U, B),
        in_specs=[whole(units), whole(steps), seq(q_len_padded, Hq), seq(kv_len_padded, Hkv),
                  seq(kv_len_padded, Hkv), seq(q_len_padded, Hq), per_unit, per_unit],
        out_specs=pl.BlockSpec((None, None, tile_q, dp_), lambda u, b: (b, u, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, U, tile_q, dp_), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=_warps(tile_q), num_stages=2),
        interpret=interpret, name="tessera_triton_dq",
    )(units, steps, _pad(q, q_len_padded, dp_), _pad(k, kv_len_padded, dp_),
      _pad(v, kv_len_padded, dp_), _pad(do, q_len_padded, dp_), lse_u, delta_u)
    return rows_.gather_units(dq_u[..., :D], None,
                              rows_.token_rows(units, row_index_t, Hq, Lq, tile_q))


def dkv(q, k, v, do, lse, delta, units, steps, *, tile_q, tile_kv, q_len_padded, kv_len_padded,
        scale, mask_mode="cond", interpret=None, row_index=None):
    """(dk, dv) [B, Lkv, Hkv, D] (k.dtype) over a transposed plan: units of ``tile_q`` keys
    (``q_len_padded`` >= Lkv) of query head UNIT_HEAD, steps of ``tile_kv`` queries
    (``kv_len_padded`` >= Lq); summed over each K/V head's group. Other arguments as ``dq``."""
    interpret = _check(mask_mode, interpret)
    return _dkv(q, k, v, do, lse, delta, units, steps, abi.token_major(row_index),
                tile_q=int(tile_q),
                tile_kv=int(tile_kv), q_len_padded=int(q_len_padded),
                kv_len_padded=int(kv_len_padded), scale=float(scale), mask_mode=mask_mode,
                interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATICS)
def _dkv(q, k, v, do, lse, delta, units, steps, row_index_t, *, tile_q, tile_kv, q_len_padded,
         kv_len_padded, scale, mask_mode, interpret):
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    dp_ = padded_head_dim(D)
    U = units.shape[0]
    lse_p = rows_.pad_rows(lse, kv_len_padded, jnp.inf)
    delta_p = rows_.pad_rows(delta, kv_len_padded, 0.0)
    kernel = functools.partial(
        _dkv_kernel, tile_q=tile_q, tile_kv=tile_kv, group=Hq // Hkv, scale=scale,
        mode=mask_mode, num_steps=steps.shape[0], precision=_precision(q.dtype))
    whole = lambda a: pl.BlockSpec(a.shape, lambda u, b: (0,) * a.ndim)     # noqa: E731
    seq = lambda L, H: pl.BlockSpec((None, L, H, dp_), lambda u, b: (b, 0, 0, 0))  # noqa: E731
    rows = pl.BlockSpec((None, Hq, kv_len_padded), lambda u, b: (b, 0, 0))
    out = pl.BlockSpec((None, None, tile_q, dp_), lambda u, b: (b, u, 0, 0))
    shape = jax.ShapeDtypeStruct((B, U, tile_q, dp_), jnp.float32)
    dk_u, dv_u = pl.pallas_call(
        kernel, grid=(U, B),
        in_specs=[whole(units), whole(steps), seq(kv_len_padded, Hq), seq(q_len_padded, Hkv),
                  seq(q_len_padded, Hkv), seq(kv_len_padded, Hq), rows, rows],
        out_specs=[out, out], out_shape=[shape, shape],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(tile_q), num_stages=2),
        interpret=interpret, name="tessera_triton_dkv",
    )(units, steps, _pad(q, kv_len_padded, dp_), _pad(k, q_len_padded, dp_),
      _pad(v, q_len_padded, dp_), _pad(do, kv_len_padded, dp_), lse_p, delta_p)
    ri_t = rows_.token_rows(units, row_index_t, Hq, Lkv, tile_q)
    dk, dv = (rows_.group_sum(rows_.gather_units(x[..., :D], None, ri_t), Hkv)
              for x in (dk_u, dv_u))
    return dk.astype(k.dtype), dv.astype(v.dtype)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

