"""Dense reference attention restricted to a BlockMask (float32 inside). For checks only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.validation import check_bool, check_mask, check_qkv, check_scale


def reference_attention(q, k, v, mask: BlockMask, scale=None, return_lse=False):
    """Materialises the [B, Hq, Lq, Lkv] scores; a row with no selected key gives 0 / -inf."""
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
    o, lse = masked_attention(qf, kf, vf, token[None], scale)
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
