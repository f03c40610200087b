"""Dense reference attention restricted to a BlockMask (float32 inside). For checks only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.validation import check_bool, check_mask, check_qkv, check_scale


def reference_attention(q, k, v, mask: BlockMask, scale=None, return_lse=False):
    """Materialises the [B, Hq, Lq, Lkv] scores; a row with no selected key gives 0 / -inf.
    Masking by selection: keys a row does not select never reach it, whatever their values;
    a row is NaN (out and lse) exactly when it selects a key whose k or v holds a NaN or an
    inf, or when its own q does and it selects any key (``nonfinite_rows``)."""
    shape = check_qkv(q, k, v)
    check_mask(mask, shape)
    scale = check_scale(scale, shape.head_dim)
    return_lse = check_bool("return_lse", return_lse)
    token = jnp.asarray(mask.token_mask())                     # [Hm, Lq, Lkv] bool
    return _reference(q, k, v, token, scale, return_lse, shape.num_q_heads // shape.num_kv_heads)


@jax.jit(static_argnames=("scale", "return_lse", "group"))
def _reference(q, k, v, token, scale, return_lse, group):
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    kf = jnp.repeat(kf, group, axis=2)
    vf = jnp.repeat(vf, group, axis=2)
    rows = nonfinite_rows(nonfinite(qf), nonfinite(kf) | nonfinite(vf), token[None])
    o, lse = masked_attention(*(finite_or_zero(x) for x in (qf, kf, vf)), token[None], scale)
    o, lse = set_rows_nan(o, lse, rows)
    o = o.astype(q.dtype)
    return (o, lse) if return_lse else o


def masked_attention(qf, kf, vf, sel, scale):
    """(out [B, Lq, H, D], lse [B, H, Lq]) in float32 of q [B, Lq, H, D] against k, v
    [B, Lkv, H, D] (float32, k and v already repeated to q's heads) where ``sel`` (bool,
    broadcast against the scores [B, H, Lq, Lkv]) selects; a row selecting nothing gives 0 and
    lse -inf. The reference's rule, also the device route's exact path (per query chunk)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision="highest") * scale
    s = jnp.where(sel, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), vf, precision="highest")
    lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)) + m_safe[..., 0],
                    -jnp.inf)
    return o, lse


# --- non-finite inputs: the rule, also applied by ``Options.check_finite`` (runtime.finite) ---
def nonfinite_rows(bad_q, bad_kv, sel):
    """bool [B, H, Lq]: the rows that masking by selection makes NaN, those that select a key
    of ``bad_kv`` (bool [B, Lkv, H]) or hold a query of ``bad_q`` (bool [B, Lq, H]) and select
    any key; ``sel`` as in ``masked_attention``."""
    hit = jnp.any(sel & jnp.swapaxes(bad_kv, 1, 2)[:, :, None, :], axis=-1)
    return hit | (jnp.swapaxes(bad_q, 1, 2) & jnp.any(sel, axis=-1))


def nonfinite(x):
    """bool x.shape[:-1]: the vectors (last axis) of x that hold a NaN or an inf."""
    return ~jnp.isfinite(x).all(-1)


@jax.custom_jvp
def finite_or_zero(x):
    """x with its NaN and inf entries replaced by 0 (same dtype). Its tangent passes through
    unchanged: what reaches a non-finite entry is 0 anyway (no row that selects it passes a
    gradient, the others give it p = 0), and the backward then keeps no mask of x."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


finite_or_zero.defjvp(lambda primals, tangents: (finite_or_zero(*primals), tangents[0]))


def set_rows_nan(out, lse, rows):
    """(out [B, Lq, H, D], lse [B, H, Lq] or None) with the rows of ``rows`` [B, H, Lq] NaN."""
    out = jnp.where(jnp.swapaxes(rows, 1, 2)[..., None], jnp.nan, out)
    return out, (None if lse is None else jnp.where(rows, jnp.nan, lse))
