"""Each row's top k as a bool mask in one Triton kernel: a radix select on the float bits, the
row kept in registers, no sort. ``lax.top_k`` sorts every row (many passes over memory: ~4.1 ms
of the 7.7 ms VSA builder at Wan 720p, [40, 1440, 1440] float32 scores, H200 session 12); here
each program loads one row once, finds its k-th largest value by a bitwise binary search over
order-preserving integer keys (32 compare-and-count passes in registers), keeps the ties with
the lowest indices (``lax.top_k``'s rule) and writes the row's mask.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

#: Longest row the kernel takes (the padded row lives in registers); longer rows are the
#: caller's to route elsewhere (``masks.dynamic`` falls back to ``lax.top_k``).
MAX_COLS = 4096
#: Warps per program (one row a program).
NUM_WARPS = 4

_INT_MIN = -(2 ** 31)


def _keys(x, col, n: int):
    """int32 keys whose signed order is x's float total order (-0.0 < +0.0, as ``lax.top_k``
    compares); columns past the row (index >= n) get the smallest key, below -inf."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return jnp.where(col < n, key, _INT_MIN)


def _kernel(x_ref, o_ref, *, n: int, width: int, k: int):
    # The whole [R, n] arrays are the refs: row r is read and written through a mask over a
    # power-of-two width (no padded copy of the scores, no slice of the mask afterwards).
    r = pl.program_id(0)
    col = lax.broadcasted_iota(jnp.int32, (width,), 0)
    inside = col < n
    x = plgpu.load(x_ref.at[r, pl.ds(0, width)], mask=inside, other=0.0)
    key = _keys(x, col, n)                                           # [width] int32

    def bit(i, t):
        # Greedy from the top bit, in unsigned space (u = signed ^ INT_MIN): the largest
        # threshold t with count(key >= t) >= k is the k-th largest key.
        cand = t | lax.shift_left(jnp.int32(1), 31 - i)
        cnt = jnp.sum((key >= (cand ^ _INT_MIN)).astype(jnp.int32))
        return jnp.where(cnt >= k, cand, t)

    t = lax.fori_loop(0, 32, bit, jnp.int32(0)) ^ _INT_MIN
    above = key > t
    need = k - jnp.sum(above.astype(jnp.int32))                      # ties to keep, >= 1
    tie = key == t
    rank = jnp.cumsum(tie.astype(jnp.int32))                          # 1-based among ties
    keep = above | (tie & (rank <= need))
    plgpu.store(o_ref.at[r, pl.ds(0, width)], keep.astype(jnp.int8), mask=inside)


def topk_mask(x, k, *, interpret: bool = False):
    """bool [..., n]: True at each row's k largest entries of x [..., n] (float32; no NaN),
    ties to the lower index: the set ``lax.top_k(x, k)[1]`` marks. ``k`` a static int in
    [1, n]. Rows must be at most ``MAX_COLS`` long."""
    x = jnp.asarray(x)
    if x.ndim < 1 or x.dtype != jnp.float32:
        raise ValueError(f"topk_mask: x must be float32 [..., n], got {x.dtype} {x.shape}")
    n = x.shape[-1]
    if not 1 <= n <= MAX_COLS:
        raise ValueError(f"topk_mask: rows of 1..{MAX_COLS} entries, got {n}")
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"topk_mask: k must be in [1, {n}], got {k}")
    if x.size >= 2 ** 31:
        raise ValueError(f"topk_mask: at most 2**31 - 1 entries (int32 offsets), got {x.size}")
    return _topk_mask(x, k=k, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def _topk_mask(x, *, k, interpret):
    shape = x.shape
    n = shape[-1]
    rows = x.reshape(-1, n)
    R = rows.shape[0]
    if R == 0:
        return jnp.zeros(shape, bool)
    width = max(16, 1 << (n - 1).bit_length())
    out = pl.pallas_call(
        functools.partial(_kernel, n=n, width=width, k=k),
        grid=(R,),
        out_shape=jax.ShapeDtypeStruct((R, n), jnp.int8),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="tessera_topk_mask",
    )(rows)
    return (out != 0).reshape(shape)
