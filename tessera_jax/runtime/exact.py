"""The exact path of device masks: attention and its gradients with the block mask evaluated
per token, in float32, over query chunks (dense work, O(chunk x Lkv) memory).

It runs where a device plan can't hold the mask (bitmap steps past the budget, a tile meeting
too many blocks, invalid device bounds: indices are clamped, so the output is finite, never
an out-of-bounds read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import backward_rows as rows_

from tessera_jax.planning.device import block_ids
from tessera_jax.reference import masked_attention

__all__ = ["exact_attention", "exact_backward"]

# Scores of one chunk of the exact path stay near this many float32 elements.
_EXACT_CHUNK_ELEMS = 1 << 24


def exact_attention(q, k, v, q_bounds, kv_bounds, blocks, *, scale, return_lse=False):
    """Attention under a block mask evaluated per token, in float32, over query chunks (dense
    work, O(chunk x Lkv) memory): the exact path of masks the device plan can't hold. Bounds
    [n + 1] or [Hm, n + 1] (NumPy or jax), blocks [Hm, nq, nk]."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    Hm, nq, nk = blocks.shape
    qb = jnp.asarray(q_bounds, jnp.int32).reshape(-1, nq + 1)
    kb = jnp.asarray(kv_bounds, jnp.int32).reshape(-1, nk + 1)
    blocks = jnp.asarray(blocks)
    kid = block_ids(kb, jnp.arange(Lkv, dtype=jnp.int32)[None])        # [Hbk, Lkv]
    C = int(max(8, min(Lq, _EXACT_CHUNK_ELEMS // max(1, B * Hq * Lkv))))
    n_chunks = -(-Lq // C)
    qp = jnp.pad(q, ((0, 0), (0, n_chunks * C - Lq), (0, 0), (0, 0)))
    qc = qp.reshape(B, n_chunks, C, Hq, D).swapaxes(0, 1)
    kf = jnp.repeat(k.astype(jnp.float32), Hq // Hkv, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), Hq // Hkv, axis=2)
    heads = jnp.arange(Hm)[:, None, None]

    def one(args):
        i, qx = args
        rows = i * C + jnp.arange(C, dtype=jnp.int32)
        qid = block_ids(qb, rows[None])                                  # [Hbq, C]
        sel = blocks[heads, qid[:, :, None], kid[:, None, :]]            # [Hm, C, Lkv]
        sel = jnp.broadcast_to(sel, (Hq, C, Lkv))
        return masked_attention(qx.astype(jnp.float32), kf, vf, sel[None], scale)

    o, lse = jax.lax.map(one, (jnp.arange(n_chunks, dtype=jnp.int32), qc))
    out = o.swapaxes(0, 1).reshape(B, n_chunks * C, Hq, D)[:, :Lq].astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.moveaxis(lse, 0, 2).reshape(B, Hq, n_chunks * C)[:, :, :Lq]
    return out, lse


def exact_backward(q, k, v, q_bounds, kv_bounds, blocks, out, lse, do, dlse=None, *, scale):
    """(dq, dk, dv) of ``exact_attention``: the mask evaluated per token, float32,
    over query chunks (dense work, O(chunk x Lkv) memory, dk / dv accumulated in the loop).
    Bounds [n + 1] or [Hm, n + 1], blocks [Hm, nq, nk] (NumPy or jax)."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    Hm, nq, nk = blocks.shape
    f32 = jnp.float32
    qb = jnp.asarray(q_bounds, jnp.int32).reshape(-1, nq + 1)
    kb = jnp.asarray(kv_bounds, jnp.int32).reshape(-1, nk + 1)
    blocks = jnp.asarray(blocks)
    kid = block_ids(kb, jnp.arange(Lkv, dtype=jnp.int32)[None])  # [Hbk, Lkv]
    delta = rows_.delta_of(out, do, dlse)
    lse = rows_.lse_for_backward(lse)
    C = int(max(8, min(Lq, _EXACT_CHUNK_ELEMS // max(1, B * Hq * Lkv))))
    n = -(-Lq // C)
    qx = rows_.pad_len(q.astype(f32), n * C).reshape(B, n, C, Hq, D).swapaxes(0, 1)
    dox = rows_.pad_len(do.astype(f32), n * C).reshape(B, n, C, Hq, D).swapaxes(0, 1)
    lx = rows_.pad_rows(lse, n * C, jnp.inf).reshape(B, Hq, n, C).transpose(2, 0, 1, 3)
    dx = rows_.pad_rows(delta, n * C, 0.0).reshape(B, Hq, n, C).transpose(2, 0, 1, 3)
    kf = jnp.repeat(k.astype(f32), Hq // Hkv, axis=2)
    vf = jnp.repeat(v.astype(f32), Hq // Hkv, axis=2)
    heads = jnp.arange(Hm)[:, None, None]
    hi = jax.lax.Precision.HIGHEST

    def body(carry, xs):
        dk, dv = carry
        i, qc, doc, lc, dc = xs
        qid = block_ids(qb, (i * C + jnp.arange(C, dtype=jnp.int32))[None])
        sel = jnp.broadcast_to(blocks[heads, qid[:, :, None], kid[:, None, :]], (Hq, C, Lkv))
        s = jnp.einsum("bqhd,bkhd->bhqk", qc, kf, precision=hi) * scale
        p = jnp.where(sel[None], jnp.exp(s - lc[..., None]), 0.0)
        dp = jnp.einsum("bqhd,bkhd->bhqk", doc, vf, precision=hi)
        ds = p * (dp - dc[..., None])
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kf, precision=hi) * scale
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, qc, precision=hi) * scale
        dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, doc, precision=hi)
        return (dk, dv), dq

    zeros = jnp.zeros((B, Lkv, Hq, D), f32)
    (dk, dv), dq = jax.lax.scan(body, (zeros, zeros),
                                (jnp.arange(n, dtype=jnp.int32), qx, dox, lx, dx))
    dq = dq.swapaxes(0, 1).reshape(B, n * C, Hq, D)[:, :Lq]
    dk, dv = rows_.group_sum(dk, Hkv), rows_.group_sum(dv, Hkv)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
