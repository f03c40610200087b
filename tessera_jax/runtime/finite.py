"""``Options.check_finite``: keys a row does not select never reach it, on every route.

The kernels compute whole tiles: an entry a row does not select gets p = 0, but 0 * NaN = NaN
in P @ V (and a NaN in k makes the scores of a whole tile row NaN), so a non-finite k or v
may reach rows that never select it. No kernel can mask that inside its matmul, so the
runtime does it once, around any route and backend: the call runs on q, k, v with non-finite
entries replaced by 0, and the rows the reference's rule makes NaN (``reference``'s
``nonfinite_rows``: a selected key with a non-finite k or v, or a non-finite q that selects
any key) are set to NaN, out and lse. ``marked_rows`` evaluates that rule per logical block,
which is exact: a block is selected whole. The rows set to NaN pass no gradient (their output
is a constant), so gradients stay finite. Cost: q, k, v read and written once more, out once
more (benchmarks/NOTES.md#inputs).
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.planning.device import block_ids
from tessera_jax.reference import finite_or_zero, nonfinite, set_rows_nan
from tessera_jax.runtime.kernel_runner import tracing

__all__ = ["attention", "marked_rows", "clear_cache"]


def attention(attend, q, k, v, mask: BlockMask, return_lse: bool):
    """``attend(q, k, v)`` (out, or (out, lse) with ``return_lse``) on q, k, v with
    non-finite entries replaced by 0, its rows that select a non-finite key (or hold a
    non-finite query that selects any key) set to NaN."""
    qs, ks, vs, rows = _prepare(q, k, v, *_mask_arrays(mask, tracing(q, k, v)))
    res = attend(qs, ks, vs)
    out, lse = res if return_lse else (res, None)
    out, lse = _mark(out, lse, rows)
    return (out, lse) if return_lse else out


@jax.jit
def _prepare(q, k, v, q_bounds, kv_bounds, blocks):
    """(q, k, v with non-finite entries 0, the rows to set to NaN [B, Hq, Lq])."""
    rows = marked_rows(nonfinite(q), nonfinite(k) | nonfinite(v), q_bounds, kv_bounds, blocks)
    return finite_or_zero(q), finite_or_zero(k), finite_or_zero(v), rows


_mark = jax.jit(set_rows_nan)


def marked_rows(bad_q, bad_kv, q_bounds, kv_bounds, blocks):
    """bool [B, Hq, Lq]: rows that select a key of ``bad_kv`` (bool [B, Lkv, Hkv]: k or v
    non-finite) or hold a query of ``bad_q`` (bool [B, Lq, Hq]) and select any key, under the
    block mask (bounds [n + 1] or [Hm, n + 1], blocks [Hm, nq, nkv]; NumPy or jax)."""
    B, Lq, Hq = bad_q.shape
    Lkv, Hkv = bad_kv.shape[1:]
    Hm, nq, nk = blocks.shape
    heads = np.arange(Hq)
    qb = jnp.asarray(q_bounds, jnp.int32).reshape(-1, nq + 1)
    kb = jnp.asarray(kv_bounds, jnp.int32).reshape(-1, nk + 1)
    kb = jnp.clip(kb[_head_rows(kb.shape[0], Hq)], 0, Lkv)                # [Hq, nk + 1]
    # Non-finite keys before each position; a key block holds one where the count grows.
    before = jnp.pad(jnp.cumsum(bad_kv.astype(jnp.int32), axis=1), ((0, 0), (1, 0), (0, 0)))
    at = before[:, kb, (heads // (Hq // Hkv))[:, None]]                   # [B, Hq, nk + 1]
    bad_block = at[..., 1:] > at[..., :-1]
    sel = jnp.asarray(blocks)[_head_rows(Hm, Hq)]                         # [Hq, nq, nk]
    hit = jnp.any(sel[None] & bad_block[:, :, None, :], axis=-1)          # [B, Hq, nq]
    some = jnp.any(sel, axis=-1)                                          # [Hq, nq]
    qid = block_ids(qb, jnp.arange(Lq, dtype=jnp.int32)[None])[_head_rows(qb.shape[0], Hq)]
    h = heads[:, None]                                                    # with qid: [Hq, Lq]
    return hit[:, h, qid] | (jnp.swapaxes(bad_q, 1, 2) & some[h, qid][None])


def _head_rows(n: int, num_q_heads: int) -> np.ndarray:
    """The row of a mask part with ``n`` rows (1: shared, else one per query head) that each
    query head reads."""
    return np.arange(num_q_heads) if n == num_q_heads else np.zeros(num_q_heads, np.int32)


# Per static mask (weakly held): its arrays on the device, for eager calls, which would copy
# NumPy arrays to the device at every call; under a trace they are constants of the program.
_DEVICE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _mask_arrays(mask: BlockMask, traced: bool) -> tuple:
    """(q_bounds, kv_bounds, blocks) as ``_prepare`` takes them."""
    if not mask.is_static or traced:
        return mask.q_bounds, mask.kv_bounds, mask.blocks
    dev = _DEVICE.get(mask)
    if dev is None:
        dev = _DEVICE[mask] = mask.to_device()
    return dev.q_bounds, dev.kv_bounds, dev.blocks


def clear_cache() -> None:
    """Forgets the static masks' device copies (``tessera_jax.clear_caches``)."""
    _DEVICE.clear()
