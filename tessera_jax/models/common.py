"""Building blocks shared by the video DiTs: patchify, 3D RoPE, time embedding, text-joint masks.

Latent videos are channels-last ``[B, T, H, W, C]``. Tokens are in frame-major order
(t, then h, then w over the patch grid), the order Wan2.1 and HunyuanVideo flatten in; masks
from ``tessera_jax.masks`` must be built over the same order (or the caller permutes).
"""

from __future__ import annotations

import dataclasses
import functools

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.nnx as nnx

from tessera_jax.mask import BlockMask

__all__ = ["MLP", "apply_rope", "check_order", "device_init", "extend_with_text", "layer_masks",
           "numpy_init", "patch_grid", "patchify", "rope_3d", "rope_split", "timestep_embedding",
           "unpatchify"]


def _ints(name: str, val, n: int) -> tuple[int, ...]:
    val = tuple(val)
    if len(val) != n or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0
                            for v in val):
        raise ValueError(f"{name} must be {n} positive ints, got {val}")
    return tuple(int(v) for v in val)


def patch_grid(latent_thw: Sequence[int], patch: Sequence[int]) -> tuple[int, int, int]:
    """Token grid (T', H', W') of a latent (T, H, W) cut into patches (pt, ph, pw)."""
    thw, p = _ints("latent_thw", latent_thw, 3), _ints("patch", patch, 3)
    for a, (n, q) in enumerate(zip(thw, p)):
        if n % q:
            raise ValueError(f"latent axis {a} has size {n}, not a multiple of patch {q}")
    return tuple(n // q for n, q in zip(thw, p))


def patchify(x, patch: Sequence[int]):
    """[B, T, H, W, C] -> tokens [B, T'H'W', pt*ph*pw*C] (frame-major) and the grid (T', H', W')."""
    if x.ndim != 5:
        raise ValueError(f"x must be a latent video [B, T, H, W, C], got shape {x.shape}")
    B, T, H, W, C = x.shape
    pt, ph, pw = _ints("patch", patch, 3)
    gt, gh, gw = patch_grid((T, H, W), (pt, ph, pw))
    x = x.reshape(B, gt, pt, gh, ph, gw, pw, C).transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(B, gt * gh * gw, pt * ph * pw * C), (gt, gh, gw)


def unpatchify(tokens, grid: Sequence[int], patch: Sequence[int], channels: int):
    """Inverse of ``patchify``: [B, T'H'W', pt*ph*pw*C] -> [B, T, H, W, C]."""
    gt, gh, gw = _ints("grid", grid, 3)
    pt, ph, pw = _ints("patch", patch, 3)
    B, L, F = tokens.shape
    if L != gt * gh * gw or F != pt * ph * pw * channels:
        raise ValueError(f"tokens {tokens.shape} don't match grid {grid}, patch {patch} and "
                         f"{channels} channels")
    x = tokens.reshape(B, gt, gh, gw, pt, ph, pw, channels).transpose(0, 1, 4, 2, 5, 3, 6, 7)
    return x.reshape(B, gt * pt, gh * ph, gw * pw, channels)


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Wan2.1's split of head_dim over (t, h, w): d - 4*(d//6), 2*(d//6), 2*(d//6)."""
    d = int(head_dim)
    if d % 2 or d < 6:
        raise ValueError(f"head_dim must be even and >= 6 for 3D RoPE, got {d}")
    return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)


def rope_3d(grid: Sequence[int], dims: Sequence[int], theta: float = 10000.0):
    """cos, sin [T'H'W', sum(dims) // 2] (float32) of 3D RoPE over a token grid.

    Each axis a rotates ``dims[a]`` channels (even) by its own position with frequencies
    ``theta ** (-2i / dims[a])``; channels are in interleaved pairs (x0, x1), (x2, x3), ...
    """
    gt, gh, gw = _ints("grid", grid, 3)
    dims = _ints("dims", dims, 3)
    if any(d % 2 for d in dims):
        raise ValueError(f"dims must be even, got {dims}")
    angles = []
    for n, d, axis in zip((gt, gh, gw), dims, range(3)):
        # Computed in the graph (not a [L, D/2] host constant baked into the executable).
        freqs = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)      # [d/2]
        ang = jnp.arange(n, dtype=jnp.float32)[:, None] * freqs[None]        # [n, d/2]
        shape = [1, 1, 1, d // 2]
        shape[axis] = n
        angles.append(jnp.broadcast_to(ang.reshape(shape), (gt, gh, gw, d // 2)))
    ang = jnp.concatenate(angles, axis=-1).reshape(gt * gh * gw, -1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """Rotates interleaved channel pairs of x [B, L, H, D] by angles cos/sin [L, D/2]."""
    B, L, H, D = x.shape
    if cos.shape != (L, D // 2):
        raise ValueError(f"cos has shape {cos.shape}, expected {(L, D // 2)} for x {x.shape}")
    xf = x.astype(jnp.float32).reshape(B, L, H, D // 2, 2)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return out.reshape(B, L, H, D).astype(x.dtype)


def timestep_embedding(t, dim: int, max_period: float = 10000.0):
    """Sinusoidal embedding [B, dim] (cos, sin halves) of timesteps t [B] (0..1000)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class MLP(nnx.Module):
    """Linear -> activation -> Linear."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, *, act=None, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(d_in, d_hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(d_hidden, d_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.act = act or (lambda x: jax.nn.gelu(x, approximate=True))

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


def extend_with_text(video_mask: BlockMask | None, text_len: int, *, text_block: int | None = None):
    """Mask over [video tokens, text tokens] for joint attention: text rows and columns dense.

    Video rows keep their blocks and see every text key; text rows see everything (as SSTA,
    radial and STA treat the prompt in HunyuanVideo). ``text_block`` splits the text into blocks
    of that size (default: one block). None stays None (dense).
    """
    if video_mask is None:
        return None
    if not isinstance(video_mask, BlockMask):
        raise TypeError(f"video_mask must be a BlockMask or None, got {type(video_mask).__name__}")
    if isinstance(text_len, bool) or not isinstance(text_len, (int, np.integer)) or text_len <= 0:
        raise ValueError(f"text_len must be a positive int, got {text_len!r}")
    tb = text_len if text_block is None else int(text_block)
    if tb <= 0:
        raise ValueError(f"text_block must be positive, got {text_block}")
    extra = np.append(np.arange(tb, text_len, tb), text_len)
    qb = np.concatenate([video_mask.q_bounds, video_mask.Lq + extra])
    kb = np.concatenate([video_mask.kv_bounds, video_mask.Lkv + extra])
    Hm, nq, nk = video_mask.blocks.shape
    n = len(extra)
    blocks = np.ones((Hm, nq + n, nk + n), bool)
    blocks[:, :nq, :nk] = video_mask.blocks
    return BlockMask(qb, kb, blocks)


def layer_masks(masks, num_layers: int) -> tuple:
    """Validates a per-layer mask tuple; None means dense in every layer. An entry may also be
    a ``LayerAttention`` (a dynamic schedule's layer at a traced step)."""
    from tessera_jax.flax import LayerAttention
    if masks is None:
        return (None,) * num_layers
    if isinstance(masks, BlockMask) or not isinstance(masks, Sequence):
        raise TypeError(f"masks must be a sequence with one BlockMask | None per layer, "
                        f"got {type(masks).__name__}")
    masks = tuple(masks)
    if len(masks) != num_layers:
        raise ValueError(f"masks has {len(masks)} entries but the model has {num_layers} layers")
    for i, m in enumerate(masks):
        if m is not None and not isinstance(m, (BlockMask, LayerAttention)):
            raise TypeError(f"masks[{i}] must be a BlockMask, a LayerAttention or None, "
                            f"got {type(m).__name__}")
    return masks


def check_order(order, num_tokens: int):
    """(order, inverse) as int32 arrays, or (None, None): ``order[i]`` is the frame-major index of
    the token at sequence position i (``tessera_jax.masks.grids.Layout.order``)."""
    if order is None:
        return None, None
    arr = np.asarray(order)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"token_order must hold integers, got dtype {arr.dtype}")
    if arr.shape != (num_tokens,) or not np.array_equal(np.sort(arr), np.arange(num_tokens)):
        raise ValueError(f"token_order must be a permutation of the {num_tokens} video tokens, "
                         f"got shape {arr.shape}")
    inv = np.empty_like(arr)
    inv[arr] = np.arange(num_tokens)
    return arr.astype(np.int32), inv.astype(np.int32)


def numpy_init(cls, cfg, seed: int = 0):
    """``cls(cfg)`` with NumPy-drawn weights and no compile (an eager nnx init compiles every
    op of the model, a jitted one the whole init: seconds on a CPU for a tiny model; tests and
    CPU smoke runs). Matrices N(0, 1 / fan_in); vectors 0.1 N(0, 1), plus 1 for norm scales."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        a = rng.standard_normal(x.shape)
        a = a / np.sqrt(x.shape[0]) if x.ndim >= 2 else 0.1 * a + ("scale" in str(path))
        return jnp.asarray(a, x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "kind"))
def _draw(key, *, shape, dtype, kind):
    a = jax.random.normal(key, shape, jnp.float32)
    a = a / np.sqrt(shape[0]) if kind == "matrix" else 0.1 * a + (kind == "scale")
    return a.astype(dtype)


def device_init(cls, cfg, seed: int = 0):
    """``cls(cfg)`` with weights drawn on the default device as ``numpy_init`` draws them, one
    small program per distinct leaf shape: a jitted nnx init of a 30-layer model compiles for
    minutes on a GPU, this in seconds (benchmarks with random weights)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [_draw(k, shape=tuple(x.shape), dtype=jnp.dtype(x.dtype),
                 kind="matrix" if x.ndim >= 2 else ("scale" if "scale" in str(p) else "vector"))
           for k, (p, x) in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, out))


class VideoConfigMixin:
    """Shared geometry of a video DiT config: width, VAE latent shape and token grid.

    Subclasses (frozen dataclasses with ``num_heads``, ``head_dim`` and ``patch``) set
    ``VAE_SPATIAL`` (8 for Wan2.1, 16 for HunyuanVideo-1.5) and ``DEFAULT_VIDEO`` (frames,
    height, width).
    """

    VAE_SPATIAL = 8
    DEFAULT_VIDEO = (81, 480, 832)

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def latent_shape(self, frames=None, height=None, width=None):
        """Latent (T, H, W): VAE 4x in time (causal first frame), VAE_SPATIAL x in space."""
        f0, h0, w0 = self.DEFAULT_VIDEO
        frames, height, width = (frames or f0), (height or h0), (width or w0)
        if (frames - 1) % 4 or height % 16 or width % 16:
            raise ValueError("frames must be 4k+1 and height/width multiples of 16")
        s = self.VAE_SPATIAL
        return ((frames - 1) // 4 + 1, height // s, width // s)

    def token_grid(self, frames=None, height=None, width=None):
        t, h, w = self.latent_shape(frames, height, width)
        return (t // self.patch[0], h // self.patch[1], w // self.patch[2])

    def self_attention_len(self, video_tokens: int, text_tokens: int) -> int:
        """Length of the self-attention sequence (the video tokens; HunyuanVideo adds text)."""
        return int(video_tokens)
