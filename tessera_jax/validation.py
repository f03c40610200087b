"""Argument checks shared by every entry point: clear errors, nothing silently fixed."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask, concrete

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_SUPPORTED = frozenset(np.dtype(d) for d in SUPPORTED_DTYPES)


class AttnShape(NamedTuple):
    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype


def check_shapes(q_shape, kv_shape, dtype, v_shape=None, v_dtype=None, k_dtype=None) -> AttnShape:
    """Validates q [B, Lq, Hq, D] and k, v [B, Lkv, Hkv, D] shapes and dtypes."""
    q_shape, kv_shape = tuple(q_shape), tuple(kv_shape)
    if len(q_shape) != 4:
        raise ValueError(f"q must have rank 4 [B, Lq, Hq, D], got shape {q_shape}")
    if len(kv_shape) != 4:
        raise ValueError(f"k must have rank 4 [B, Lkv, Hkv, D], got shape {kv_shape}")
    if v_shape is not None and tuple(v_shape) != kv_shape:
        raise ValueError(f"v must have the shape of k {kv_shape}, got {tuple(v_shape)}")
    B, Lq, Hq, D = q_shape
    Bk, Lkv, Hkv, Dk = kv_shape
    if Bk != B:
        raise ValueError(f"k has batch {Bk} but q has batch {B}")
    if Dk != D:
        raise ValueError(f"k has head dim {Dk} but q has head dim {D}")
    if min(q_shape) <= 0 or min(kv_shape) <= 0:
        raise ValueError(f"q and k must have no empty dimension, got {q_shape} and {kv_shape}")
    if Hq % Hkv:
        raise ValueError(f"the number of query heads Hq={Hq} must be a multiple of the number "
                         f"of key/value heads Hkv={Hkv}")
    dt = np.dtype(dtype)
    if dt not in _SUPPORTED:
        raise TypeError(f"q has dtype {dt}; supported: float32, bfloat16, float16")
    for name, other in (("k", k_dtype), ("v", v_dtype)):
        if other is not None and np.dtype(other) != dt:
            raise TypeError(f"{name} has dtype {np.dtype(other)} but q has dtype {dt}; "
                            f"cast explicitly, nothing is cast silently")
    return AttnShape(B, Lq, Lkv, Hq, Hkv, D, dt)


def check_qkv(q, k, v) -> AttnShape:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return check_shapes(q.shape, k.shape, q.dtype, v.shape, v.dtype, k.dtype)


def check_mask(mask, shape: AttnShape) -> BlockMask:
    """The mask against the call's shapes (NumPy bounds, and jax bounds outside a trace); a
    device mask's traced bounds are checked on the device instead (``runtime.device_route.check``)."""
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a tessera_jax.BlockMask, got {type(mask).__name__}")
    for axis, name, bounds, length in (("Lq", "q", mask.q_bounds, shape.q_len),
                                       ("Lkv", "kv", mask.kv_bounds, shape.kv_len)):
        values = concrete(bounds)
        if values is not None:
            end = int(values.reshape(-1, values.shape[-1])[0, -1])
            if end != length:
                what = "queries" if name == "q" else "keys"
                arr = "q" if name == "q" else "k"
                raise ValueError(f"mask covers {axis}={end} {what} but {arr} has length "
                                 f"{length} (mask.{name}_bounds ends at {end})")
    if mask.num_heads not in (1, shape.num_q_heads):
        raise ValueError(f"mask has {mask.num_heads} heads; it must have 1 (shared) or "
                         f"Hq={shape.num_q_heads} (one per query head); inside a shard_map "
                         "over heads, tessera_jax.parallel.local_attention takes the mask of "
                         "all heads")
    return mask


def check_scale(scale, head_dim: int) -> float:
    """None -> D ** -0.5; otherwise a finite positive Python/NumPy real (static)."""
    if scale is None:
        return float(head_dim) ** -0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a Python float (static), got {type(scale).__name__}")
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be finite and positive, got {scale}")
    return s


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)
