"""Wan2.1 text-to-video DiT in flax nnx (the attention-relevant structure; random weights).

Per block: adaLN-style time modulation (6 vectors), self-attention with q/k RMSNorm and 3D RoPE
(the attention a mask makes sparse), cross-attention to 512 text tokens (dense), and a GELU FFN.
Patch (1, 2, 2) over a 16-channel latent, as in ``Wan-Video/Wan2.1:wan/modules/model.py``.
Nothing is downloaded: this is for timing and for checking the sparse path, not for sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.nnx as nnx

from tessera_jax.flax import DEFAULT_OPTIONS, AttentionOptions, attention
from tessera_jax.mask import BlockMask

from tessera_jax.models.common import (MLP, VideoConfigMixin, apply_rope, check_order, layer_masks, patchify,
                     rope_3d, rope_split, timestep_embedding, unpatchify)

__all__ = ["WAN21_1_3B", "WAN21_14B", "WanConfig", "WanModel"]


def _pos(name, val):
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0:
        raise ValueError(f"{name} must be a positive int, got {val!r}")


@dataclasses.dataclass(frozen=True)
class WanConfig(VideoConfigMixin):
    """Shape of a Wan2.1 DiT. ``num_layers`` may be a subset of the real depth (for timing)."""
    VAE_SPATIAL = 8
    DEFAULT_VIDEO = (81, 480, 832)

    num_layers: int = 30
    num_heads: int = 12
    head_dim: int = 128
    ffn_dim: int = 8960
    in_channels: int = 16
    out_channels: int = 16
    patch: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for f in ("num_layers", "num_heads", "head_dim", "ffn_dim", "in_channels", "out_channels",
                  "text_dim", "text_len", "freq_dim"):
            _pos(f, getattr(self, f))
        if len(self.patch) != 3:
            raise ValueError(f"patch must be 3 ints, got {self.patch}")
        for p in self.patch:
            _pos("patch", p)
        rope_split(self.head_dim)
        for f in ("dtype", "param_dtype"):
            jnp.dtype(getattr(self, f))


WAN21_1_3B = WanConfig(num_layers=30, num_heads=12, head_dim=128, ffn_dim=8960)
WAN21_14B = WanConfig(num_layers=40, num_heads=40, head_dim=128, ffn_dim=13824)


class _Attn(nnx.Module):
    """Wan attention: q/k RMSNorm over the hidden size; RoPE (self) or text keys (cross)."""

    def __init__(self, cfg: WanConfig, *, rngs: nnx.Rngs, kv_dim: int | None = None):
        dim, kw = cfg.dim, dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        self.q = nnx.Linear(dim, dim, **kw)
        self.k = nnx.Linear(kv_dim or dim, dim, **kw)
        self.v = nnx.Linear(kv_dim or dim, dim, **kw)
        self.o = nnx.Linear(dim, dim, **kw)
        self.norm_q = nnx.RMSNorm(dim, epsilon=cfg.eps, **kw)
        self.norm_k = nnx.RMSNorm(dim, epsilon=cfg.eps, **kw)
        self.h, self.d = cfg.num_heads, cfg.head_dim

    def __call__(self, x, ctx=None, *, rope=None, mask=None, options=DEFAULT_OPTIONS):
        src = x if ctx is None else ctx
        B, L, _ = x.shape
        q = self.norm_q(self.q(x)).reshape(B, L, self.h, self.d)
        k = self.norm_k(self.k(src)).reshape(B, src.shape[1], self.h, self.d)
        v = self.v(src).reshape(B, src.shape[1], self.h, self.d)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = attention(q, k, v, mask, options=options)
        return self.o(o.reshape(B, L, self.h * self.d))


class WanBlock(nnx.Module):
    def __init__(self, cfg: WanConfig, *, rngs: nnx.Rngs):
        dim, kw = cfg.dim, dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, epsilon=cfg.eps, use_bias=False, use_scale=False, **kw)
        self.norm2 = nnx.LayerNorm(dim, epsilon=cfg.eps, use_bias=False, use_scale=False, **kw)
        self.norm3 = nnx.LayerNorm(dim, epsilon=cfg.eps, **kw)
        self.self_attn = _Attn(cfg, rngs=rngs)
        self.cross_attn = _Attn(cfg, rngs=rngs)
        self.ffn = MLP(dim, cfg.ffn_dim, dim, **kw)
        self.modulation = nnx.Param(
            (jax.random.normal(rngs.params(), (6, dim), jnp.float32) / dim ** 0.5)
            .astype(cfg.param_dtype))

    def __call__(self, x, e, ctx, rope, mask, options):
        # e: [B, 6, dim] time projection; Wan adds the block's own modulation.
        e = (self.modulation[...][None].astype(jnp.float32) + e.astype(jnp.float32))
        sh1, sc1, g1, sh2, sc2, g2 = (e[:, i:i + 1] for i in range(6))
        h = (self.norm1(x).astype(jnp.float32) * (1 + sc1) + sh1).astype(x.dtype)
        y = self.self_attn(h, rope=rope, mask=mask, options=options)
        x = (x.astype(jnp.float32) + y.astype(jnp.float32) * g1).astype(x.dtype)
        x = x + self.cross_attn(self.norm3(x), ctx, options=options).astype(x.dtype)
        h = (self.norm2(x).astype(jnp.float32) * (1 + sc2) + sh2).astype(x.dtype)
        y = self.ffn(h)
        return (x.astype(jnp.float32) + y.astype(jnp.float32) * g2).astype(x.dtype)


class WanModel(nnx.Module):
    """Wan2.1 T2V: latent [B, T, H, W, 16], timestep [B] (0..1000), text [B, Lt, 4096] -> velocity."""

    def __init__(self, cfg: WanConfig, *, rngs: nnx.Rngs):
        if not isinstance(cfg, WanConfig):
            raise TypeError(f"cfg must be a WanConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        dim, kw = cfg.dim, dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        pprod = int(np.prod(cfg.patch))
        self.patch_embedding = nnx.Linear(pprod * cfg.in_channels, dim, **kw)  # = Conv3d, stride = kernel
        self.text_embedding = MLP(cfg.text_dim, dim, dim, **kw)
        self.time_embedding = MLP(cfg.freq_dim, dim, dim, act=jax.nn.silu, **kw)
        self.time_projection = nnx.Linear(dim, 6 * dim, **kw)
        self.blocks = nnx.List([WanBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.head_norm = nnx.LayerNorm(dim, epsilon=cfg.eps, use_bias=False, use_scale=False, **kw)
        self.head = nnx.Linear(dim, pprod * cfg.out_channels, **kw)
        self.head_modulation = nnx.Param(
            (jax.random.normal(rngs.params(), (2, dim), jnp.float32) / dim ** 0.5)
            .astype(cfg.param_dtype))

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def num_tokens(self, latent_thw) -> int:
        return int(np.prod([n // p for n, p in zip(latent_thw, self.cfg.patch)]))

    def __call__(self, x, t, context, *, masks: Sequence[BlockMask | None] | None = None,
                 options: AttentionOptions = DEFAULT_OPTIONS, cond=None, token_order=None,
                 remat: bool = False):
        """``masks``: one ``BlockMask | None`` per layer over the T'H'W' video tokens (None: dense),
        or a ``LayerAttention`` (a dynamic schedule's layer: it builds its mask from q and k).
        ``remat``: recompute each block's activations in the backward (``nnx.remat``), so that
        training keeps one block's activations at a time (Wan2.1-1.3B at 480p: ~90 GiB without).

        ``token_order`` (static int array, a permutation): run the blocks on the tokens in this
        order (the order a mask family's blocks refer to, e.g. tile-major for sliding-tile
        attention); the output is the same up to rounding, as only attention mixes tokens.
        """
        cfg = self.cfg
        if cond is not None:
            raise ValueError("WanModel (T2V) takes no cond")
        if x.ndim != 5 or x.shape[-1] != cfg.in_channels:
            raise ValueError(f"x must be [B, T, H, W, {cfg.in_channels}], got {x.shape}")
        if context.ndim != 3 or context.shape[-1] != cfg.text_dim:
            raise ValueError(f"context must be [B, Lt, {cfg.text_dim}], got {context.shape}")
        masks = layer_masks(masks, cfg.num_layers)
        dtype = jnp.dtype(cfg.dtype)
        tokens, grid = patchify(x.astype(dtype), cfg.patch)
        order, inverse = check_order(token_order, tokens.shape[1])
        rope = rope_3d(grid, rope_split(cfg.head_dim), cfg.rope_theta)
        if order is not None:
            tokens, rope = tokens[:, order], (rope[0][order], rope[1][order])
        h = self.patch_embedding(tokens)
        e = self.time_embedding(timestep_embedding(t, cfg.freq_dim).astype(dtype))   # [B, dim]
        e6 = self.time_projection(jax.nn.silu(e)).reshape(x.shape[0], 6, cfg.dim)
        ctx = self.text_embedding(context.astype(dtype))
        for block, m in zip(self.blocks, masks):
            def run(block, h, e6, ctx, rope, m=m):
                return block(h, e6, ctx, rope, m, options)
            h = (nnx.remat(run) if remat else run)(block, h, e6, ctx, rope)
        mod = self.head_modulation[...][None].astype(jnp.float32) + e[:, None].astype(jnp.float32)
        h = (self.head_norm(h).astype(jnp.float32) * (1 + mod[:, 1:2]) + mod[:, 0:1]).astype(dtype)
        out = self.head(h)
        if inverse is not None:
            out = out[:, inverse]
        return unpatchify(out, grid, cfg.patch, cfg.out_channels).astype(x.dtype)

