"""Backward of the plan executor in plain JAX: dq over the forward plan, dk/dv over the
transposed plan (``pallas_kernels.backward_rows`` says which is which).

Exact (float32 inside, HIGHEST precision), any device: the CPU/TPU path and the oracle the GPU
backward kernels are checked against. Like the forward executor it never builds the dense
[Lq, Lkv] matrix: work goes in chunks of units, each holding O(units x max_steps x tile_q x
tile_kv) scores, and nothing but the gradients outlives a chunk. Every step kind (plain, grid,
bitmap) selects what ``abi.step_mask`` says (``executor.selection``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import abi
from pallas_kernels import backward_rows as rows_
from pallas_kernels.xla.executor import CHUNK_ELEMS, selection

_HI = lax.Precision.HIGHEST
_STATICS = ("tile_q", "tile_kv", "q_len_padded", "kv_len_padded", "max_steps", "scale")


def _chunks(units, per_unit: int):
    """(units padded to whole chunks, reshaped [n, C, UNIT_COLS]; U) for ``lax.map``."""
    U = units.shape[0]
    chunk = max(1, min(U, CHUNK_ELEMS // max(per_unit, 1)))
    n = -(-U // chunk)
    units_p = jnp.pad(units, ((0, n * chunk - U), (0, 0)))   # padding units: no steps
    return units_p.reshape(n, chunk, -1), U


def _unit_major(fn, units, per_unit: int):
    """Runs ``fn`` (units [C, UNIT_COLS] -> a tuple of [B, C, ...]) over chunks of units and
    joins the results to [B, U, ...]."""
    chunked, U = _chunks(units, per_unit)
    if chunked.shape[0] == 1:
        return fn(chunked[0])
    outs = lax.map(fn, chunked)
    return tuple(jnp.moveaxis(o, 0, 1).reshape(o.shape[1], -1, *o.shape[3:])[:, :U]
                 for o in outs)


def _steps_of(u, steps, M: int):
    """(step rows [C, M, STEP_COLS], valid [C, M]) of units u [C, UNIT_COLS]."""
    ptr, cnt = u[:, abi.UNIT_STEP_PTR], u[:, abi.UNIT_STEP_CNT]
    m = jnp.arange(M)
    valid = m[None, :] < cnt[:, None]
    return steps[jnp.where(valid, ptr[:, None] + m[None, :], 0)], valid


def _padded(q, k, v, do, lse, delta, q_rows: int, kv_rows: int):
    """q, k, v, do, lse, delta in float32, the query side padded to ``q_rows`` (lse with +inf,
    delta with 0: padded rows select nothing) and the key side to ``kv_rows``."""
    f32 = jnp.float32
    qp, dop = (rows_.pad_len(x.astype(f32), q_rows) for x in (q, do))
    kp, vp = (rows_.pad_len(x.astype(f32), kv_rows) for x in (k, v))
    return (qp, kp, vp, dop, rows_.pad_rows(lse.astype(f32), q_rows, jnp.inf),
            rows_.pad_rows(delta.astype(f32), q_rows, 0.0))


@functools.partial(jax.jit, static_argnames=_STATICS)
def dq(q, k, v, do, lse, delta, units, steps, row_index=None, *, tile_q, tile_kv,
       q_len_padded, kv_len_padded, max_steps, scale):
    """dq [B, Lq, Hq, D] (q.dtype) over the forward plan (its ABI arrays and statics).

    q, do: [B, Lq, Hq, D]; k, v: [B, Lkv, Hkv, D]; lse, delta: [B, Hq, Lq] float32 (lse +inf on
    rows with no selected key, ``backward_rows.lse_for_backward``); ``row_index`` None: made
    on the device from units."""
    B, Lq, Hq, D = q.shape
    group = Hq // k.shape[2]
    qp, kp, vp, dop, lse_p, delta_p = _padded(q, k, v, do, lse, delta, q_len_padded,
                                              kv_len_padded)
    flat = steps.reshape(-1)
    r_t = jnp.arange(tile_q)

    def chunk(u):
        h = u[:, abi.UNIT_HEAD]
        st, valid = _steps_of(u, steps, max_steps)
        qi = u[:, abi.UNIT_Q_START, None] + r_t                       # [C, T]
        qt, dot_ = qp[:, qi, h[:, None]], dop[:, qi, h[:, None]]       # [B, C, T, D]
        lt, dt = lse_p[:, h[:, None], qi], delta_p[:, h[:, None], qi]  # [B, C, T]
        ki = abi.tile_keys(st, flat, tile_kv)                          # [C, M, Tk]
        kvh = (h // group)[:, None, None]
        kt, vt = kp[:, ki, kvh], vp[:, ki, kvh]                        # [B, C, M, Tk, D]
        s = jnp.einsum("bctd,bcmkd->bctmk", qt, kt, precision=_HI) * scale
        sel = selection(st, valid, flat, tile_q, tile_kv)[None]       # [1, C, T, M, Tk]
        p = jnp.where(sel, jnp.exp(s - lt[..., None, None]), 0.0)
        dp = jnp.einsum("bctd,bcmkd->bctmk", dot_, vt, precision=_HI)
        ds = p * (dp - dt[..., None, None])
        return (jnp.einsum("bctmk,bcmkd->bctd", ds, kt, precision=_HI) * scale,)

    (dq_u,) = _unit_major(chunk, units, tile_q * max_steps * tile_kv * B)
    ri = rows_.row_index(units, row_index, Hq, Lq, tile_q)
    return rows_.gather_units(dq_u, ri).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=_STATICS)
def dkv(q, k, v, do, lse, delta, units, steps, row_index=None, *, tile_q, tile_kv,
        q_len_padded, kv_len_padded, max_steps, scale):
    """(dk, dv) [B, Lkv, Hkv, D] (k.dtype) over the *transposed* plan: its units are key
    tiles (``tile_q`` keys, ``q_len_padded`` >= Lkv) of query head UNIT_HEAD, its steps query
    tiles (``tile_kv`` queries, ``kv_len_padded`` >= Lq). Per query head, then summed over
    each K/V head's group. Other arguments as ``dq``; ``row_index`` is the transposed plan's
    [Hq, Lkv]."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    # The transposed plan's rows are keys (q_len_padded), its steps queries (kv_len_padded).
    qp, kp, vp, dop, lse_p, delta_p = _padded(q, k, v, do, lse, delta, kv_len_padded,
                                              q_len_padded)
    flat = steps.reshape(-1)
    r_t = jnp.arange(tile_q)

    def chunk(u):
        h = u[:, abi.UNIT_HEAD]                                        # query head
        st, valid = _steps_of(u, steps, max_steps)
        ki = u[:, abi.UNIT_Q_START, None] + r_t                        # keys [C, T]
        kvh = (h // group)[:, None]
        kt, vt = kp[:, ki, kvh], vp[:, ki, kvh]                        # [B, C, T, D]
        qi = abi.tile_keys(st, flat, tile_kv)                          # queries [C, M, Tq]
        hq = h[:, None, None]
        qt, dot_ = qp[:, qi, hq], dop[:, qi, hq]                       # [B, C, M, Tq, D]
        lt, dt = lse_p[:, hq, qi], delta_p[:, hq, qi]                  # [B, C, M, Tq]
        s = jnp.einsum("bctd,bcmkd->bctmk", kt, qt, precision=_HI) * scale
        sel = selection(st, valid, flat, tile_q, tile_kv)[None]       # [1, C, T, M, Tq]
        p = jnp.where(sel, jnp.exp(s - lt[:, :, None]), 0.0)
        dv = jnp.einsum("bctmk,bcmkd->bctd", p, dot_, precision=_HI)
        dp = jnp.einsum("bctd,bcmkd->bctmk", vt, dot_, precision=_HI)
        ds = p * (dp - dt[:, :, None])
        return jnp.einsum("bctmk,bcmkd->bctd", ds, qt, precision=_HI) * scale, dv

    dk_u, dv_u = _unit_major(chunk, units, tile_q * max_steps * tile_kv * B)
    ri = rows_.row_index(units, row_index, Hq, Lkv, tile_q)
    dk, dv = (rows_.group_sum(rows_.gather_units(x, ri), Hkv) for x in (dk_u, dv_u))
    return dk.astype(k.dtype), dv.astype(v.dtype)


__all__ = ["dq", "dkv"]
