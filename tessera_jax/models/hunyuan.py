"""HunyuanVideo-1.5 DiT in flax nnx (the attention-relevant structure; random weights).

54 double-stream blocks: video and text tokens keep separate weights (modulation, QKV, q/k
RMSNorm per head, projection, MLP) but attend *jointly* over the sequence [video, text]; RoPE
(3D, dims 16/56/56) rotates the video tokens only. Patch (1, 1, 1) over a 32-channel latent
(VAE 4x in time, 16x in space); I2V concatenates the image latent and a mask channel to the
input (``cond_channels=33``). The text encoder stack (Qwen2.5-VL + byT5 + token refiner) is
reduced to an MLP projection of ``text_len`` valid tokens, which is what attention sees.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.nnx as nnx

from tessera_jax.flax import DEFAULT_OPTIONS, AttentionOptions, attention
from tessera_jax.mask import BlockMask

from tessera_jax.models.common import (MLP, VideoConfigMixin, apply_rope, check_order, extend_with_text,
                     layer_masks, patchify, rope_3d, timestep_embedding, unpatchify)

__all__ = ["HUNYUAN15", "HUNYUAN15_I2V", "HunyuanConfig", "HunyuanModel"]


@dataclasses.dataclass(frozen=True)
class HunyuanConfig(VideoConfigMixin):
    """Shape of a HunyuanVideo-1.5 DiT. ``num_layers`` may be a subset of 54 (for timing)."""
    VAE_SPATIAL = 16
    DEFAULT_VIDEO = (121, 720, 1280)

    num_layers: int = 54
    num_heads: int = 16
    head_dim: int = 128
    mlp_dim: int = 8192
    in_channels: int = 32
    cond_channels: int = 0
    out_channels: int = 32
    patch: tuple[int, int, int] = (1, 1, 1)
    text_dim: int = 3584
    text_len: int = 256
    freq_dim: int = 256
    rope_dims: tuple[int, int, int] = (16, 56, 56)
    rope_theta: float = 256.0
    eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for f in ("num_layers", "num_heads", "head_dim", "mlp_dim", "in_channels", "out_channels",
                  "text_dim", "text_len", "freq_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.cond_channels < 0:
            raise ValueError(f"cond_channels must be >= 0, got {self.cond_channels}")
        if sum(self.rope_dims) != self.head_dim or any(d % 2 for d in self.rope_dims):
            raise ValueError(f"rope_dims {self.rope_dims} must be even and sum to "
                             f"head_dim={self.head_dim}")
        for f in ("dtype", "param_dtype"):
            jnp.dtype(getattr(self, f))

    def self_attention_len(self, video_tokens: int, text_tokens: int) -> int:
        """Joint attention over [video, text]."""
        return int(video_tokens) + int(text_tokens)


HUNYUAN15 = HunyuanConfig()
HUNYUAN15_I2V = HunyuanConfig(cond_channels=33)


class _Stream(nnx.Module):
    """One stream's weights of a double-stream block (video or text)."""

    def __init__(self, cfg: HunyuanConfig, *, rngs: nnx.Rngs):
        dim = cfg.dim
        kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        self.mod = nnx.Linear(dim, 6 * dim, **kw)
        self.norm1 = nnx.LayerNorm(dim, epsilon=cfg.eps, use_bias=False, use_scale=False, **kw)
        self.qkv = nnx.Linear(dim, 3 * dim, **kw)
        self.q_norm = nnx.RMSNorm(cfg.head_dim, epsilon=cfg.eps, **kw)
        self.k_norm = nnx.RMSNorm(cfg.head_dim, epsilon=cfg.eps, **kw)
        self.proj = nnx.Linear(dim, dim, **kw)
        self.norm2 = nnx.LayerNorm(dim, epsilon=cfg.eps, use_bias=False, use_scale=False, **kw)
        self.mlp = MLP(dim, cfg.mlp_dim, dim, **kw)
        self.h, self.d = cfg.num_heads, cfg.head_dim

    def qkv_of(self, x, vec):
        mods = self.mod(jax.nn.silu(vec)).astype(jnp.float32).reshape(x.shape[0], 6, -1)
        sh1, sc1 = mods[:, 0:1], mods[:, 1:2]
        h = (self.norm1(x).astype(jnp.float32) * (1 + sc1) + sh1).astype(x.dtype)
        B, L, _ = x.shape
        q, k, v = jnp.split(self.qkv(h).reshape(B, L, 3 * self.h, self.d), 3, axis=2)
        return self.q_norm(q), self.k_norm(k), v, mods

    def finish(self, x, attn, mods):
        g1, sh2, sc2, g2 = mods[:, 2:3], mods[:, 3:4], mods[:, 4:5], mods[:, 5:6]
        B, L = x.shape[:2]
        y = self.proj(attn.reshape(B, L, self.h * self.d))
        x = (x.astype(jnp.float32) + y.astype(jnp.float32) * g1).astype(x.dtype)
        h = (self.norm2(x).astype(jnp.float32) * (1 + sc2) + sh2).astype(x.dtype)
        return (x.astype(jnp.float32) + self.mlp(h).astype(jnp.float32) * g2).astype(x.dtype)


class DoubleStreamBlock(nnx.Module):
    def __init__(self, cfg: HunyuanConfig, *, rngs: nnx.Rngs):
        self.img = _Stream(cfg, rngs=rngs)
        self.txt = _Stream(cfg, rngs=rngs)

    def __call__(self, img, txt, vec, rope, mask, options):
        iq, ik, iv, imod = self.img.qkv_of(img, vec)
        tq, tk, tv, tmod = self.txt.qkv_of(txt, vec)
        iq, ik = apply_rope(iq, *rope), apply_rope(ik, *rope)
        q = jnp.concatenate([iq, tq], axis=1)
        k = jnp.concatenate([ik, tk], axis=1)
        v = jnp.concatenate([iv, tv], axis=1)
        o = attention(q, k, v, mask, options=options)                 # joint [video, text]
        Lv = img.shape[1]
        return self.img.finish(img, o[:, :Lv], imod), self.txt.finish(txt, o[:, Lv:], tmod)


@functools.lru_cache(maxsize=256)
def _joint_mask(mask: BlockMask, Lv: int, Lt: int) -> BlockMask:
    if mask.Lq == Lv + Lt and mask.Lkv == Lv + Lt:
        return mask
    if mask.Lq == Lv and mask.Lkv == Lv:
        return extend_with_text(mask, Lt)
    raise ValueError(f"a HunyuanVideo mask must cover the video ({Lv}) or the joint sequence "
                     f"video + text ({Lv + Lt}) tokens, got Lq={mask.Lq}, Lkv={mask.Lkv}")


class HunyuanModel(nnx.Module):
    """HunyuanVideo-1.5: latent [B, T, H, W, 32], t [B], text [B, Lt, 3584] -> velocity."""

    def __init__(self, cfg: HunyuanConfig, *, rngs: nnx.Rngs):
        if not isinstance(cfg, HunyuanConfig):
            raise TypeError(f"cfg must be a HunyuanConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        dim = cfg.dim
        kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        pprod = int(np.prod(cfg.patch))
        self.img_in = nnx.Linear(pprod * (cfg.in_channels + cfg.cond_channels), dim, **kw)
        self.txt_in = MLP(cfg.text_dim, dim, dim, act=jax.nn.silu, **kw)
        self.time_in = MLP(cfg.freq_dim, dim, dim, act=jax.nn.silu, **kw)
        self.blocks = nnx.List([DoubleStreamBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_mod = nnx.Linear(dim, 2 * dim, **kw)
        self.final_norm = nnx.LayerNorm(dim, epsilon=cfg.eps, use_bias=False, use_scale=False, **kw)
        self.final = nnx.Linear(dim, pprod * cfg.out_channels, **kw)

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def __call__(self, x, t, context, *, masks: Sequence[BlockMask | None] | None = None,
                 options: AttentionOptions = DEFAULT_OPTIONS, cond=None, token_order=None):
        """``masks``: one ``BlockMask | None`` per layer, over the video tokens (text is then
        appended dense) or over the joint [video, text] sequence, or a ``LayerAttention``
        (sees the joint sequence). ``token_order``: as in ``WanModel`` (a permutation of the
        video tokens; text stays last)."""
        cfg = self.cfg
        if x.ndim != 5 or x.shape[-1] != cfg.in_channels:
            raise ValueError(f"x must be [B, T, H, W, {cfg.in_channels}], got {x.shape}")
        if context.ndim != 3 or context.shape[-1] != cfg.text_dim:
            raise ValueError(f"context must be [B, Lt, {cfg.text_dim}], got {context.shape}")
        if cfg.cond_channels:
            if cond is None or cond.shape != x.shape[:-1] + (cfg.cond_channels,):
                raise ValueError(f"cond must be [B, T, H, W, {cfg.cond_channels}] (I2V), "
                                 f"got {None if cond is None else cond.shape}")
        elif cond is not None:
            raise ValueError("cond given but cond_channels=0 (T2V config)")
        dtype = jnp.dtype(cfg.dtype)
        xin = x if cond is None else jnp.concatenate([x, cond.astype(x.dtype)], axis=-1)
        tokens, grid = patchify(xin.astype(dtype), cfg.patch)
        Lv, Lt = tokens.shape[1], context.shape[1]
        masks = tuple(m if m is None or not isinstance(m, BlockMask) else _joint_mask(m, Lv, Lt)
                      for m in layer_masks(masks, cfg.num_layers))
        order, inverse = check_order(token_order, Lv)
        rope = rope_3d(grid, cfg.rope_dims, cfg.rope_theta)
        if order is not None:
            tokens, rope = tokens[:, order], (rope[0][order], rope[1][order])
        img = self.img_in(tokens)
        txt = self.txt_in(context.astype(dtype))
        vec = self.time_in(timestep_embedding(t, cfg.freq_dim).astype(dtype))
        for block, m in zip(self.blocks, masks):
            img, txt = block(img, txt, vec, rope, m, options)
        mod = self.final_mod(jax.nn.silu(vec)).astype(jnp.float32)
        sh, sc = mod[:, None, :cfg.dim], mod[:, None, cfg.dim:]
        h = (self.final_norm(img).astype(jnp.float32) * (1 + sc) + sh).astype(dtype)
        out = self.final(h)
        if inverse is not None:
            out = out[:, inverse]
        return unpatchify(out, grid, cfg.patch, cfg.out_channels).astype(x.dtype)
