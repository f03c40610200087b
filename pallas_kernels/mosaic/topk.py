"""Each row's top k as a bool mask, by one Mosaic GPU kernel (Hopper) and one XLA fusion: the
Hopper replacement of ``pallas_kernels.triton.topk`` (same kept set: ``lax.top_k``'s indices).

The kernel (one warpgroup a row) loads the row once from GMEM into registers and finds, by a
bitwise binary search over order-preserving int32 keys (32 count-and-compare passes, each a
warpgroup reduction), the row's k-th largest key t; if more entries tie at t than the top k
has room for, a second search over column positions (log2 of the padded width passes) finds
the last tie kept, ties going to the lower index as ``lax.top_k``'s. It writes these two
int32 per row; XLA then marks ``key > t | (key == t & col <= cut)`` in one elementwise
fusion (the Triton kernel wrote an int8 row that XLA turned into bool: the same traffic).
Rows are read through a flat view with no padded copy: a row's window starts at its first
entry (or, for the last rows, ``width`` entries before the end) and its entries are picked by
position.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = ["topk_mask", "keys", "MAX_COLS"]

#: Longest row the kernel takes (the padded row lives in registers: 32 values a thread);
#: longer rows are the caller's to route elsewhere (``masks.dynamic``: ``lax.top_k``).
MAX_COLS = 4096
#: Threads of the warpgroup that holds a row.
_LANES = 128
_INT_MIN = -(2 ** 31)


def keys(x):
    """int32 keys of float32 x whose signed order is x's total order (-0.0 below +0.0, as
    ``lax.top_k`` compares)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def topk_mask(x, k, *, interpret: bool = False):
    """bool [..., n]: True at each row's k largest entries of x [..., n] (float32; no NaN),
    ties to the lower index: the set ``lax.top_k(x, k)[1]`` marks. ``k`` a static int in
    [1, n]. Rows must be at most ``MAX_COLS`` long. ``interpret``: the Mosaic GPU interpreter
    (CPU tests)."""
    x = jnp.asarray(x)
    if x.ndim < 1 or x.dtype != jnp.float32:
        raise ValueError(f"topk_mask: x must be float32 [..., n], got {x.dtype} {x.shape}")
    n = x.shape[-1]
    if not 1 <= n <= MAX_COLS:
        raise ValueError(f"topk_mask: rows of 1..{MAX_COLS} entries, got {n}")
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"topk_mask: k must be an int, got {type(k).__name__}")
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"topk_mask: k must be in [1, {n}], got {k}")
    if x.size + MAX_COLS >= 2 ** 31:
        raise ValueError(f"topk_mask: at most 2**31 - {MAX_COLS + 1} entries (int32 offsets), "
                         f"got {x.size}")
    return _topk_mask(x, k=k, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def _topk_mask(x, *, k, interpret):
    shape, n = x.shape, x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.shape[0] == 0:
        return jnp.zeros(shape, bool)
    cuts = _thresholds(rows, k, interpret)                          # [R, 2] int32
    t, last = cuts[:, :1], cuts[:, 1:]
    key = keys(rows)
    col = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    return ((key > t) | ((key == t) & (col <= last))).reshape(shape)


def _thresholds(rows, k: int, interpret: bool):
    """[R, 2] int32: each row's k-th largest key t and the column of its last kept tie."""
    R, n = rows.shape
    width = max(_LANES, 1 << (n - 1).bit_length())
    flat = rows.reshape(-1)
    total = R * n
    if total < width:                       # a window must fit: pad the (small) array
        flat = jnp.pad(flat, (0, width - total))
        total = width
    layout = plgpu.Layout.WG_STRIDED((width,), vec_size=1)
    pos_bits = width.bit_length() - 1

    def tessera_topk_mgpu(x_ref, o_ref):
        r = lax.axis_index("r")
        first = r * n
        start = jnp.minimum(first, total - width)
        v = plgpu.load(x_ref.at[pl.ds(start, width)], layout=layout, optimized=False)
        pos = plgpu.broadcasted_iota(jnp.int32, (width,), 0, layout=layout) + (start - first)
        inside = (pos >= 0) & (pos < n)
        key = jnp.where(inside, keys(v), _INT_MIN)                   # padding: below -inf

        def count(m):
            return jnp.sum(m.astype(jnp.int32))

        def bit(i, t):
            # Greedy from the top bit, in unsigned space (u = signed ^ INT_MIN): the largest
            # threshold with count(key >= t) >= k is the k-th largest key.
            cand = t | lax.shift_left(jnp.int32(1), 31 - i)
            return jnp.where(count(key >= (cand ^ _INT_MIN)) >= k, cand, t)

        t = lax.fori_loop(0, 32, bit, jnp.int32(0)) ^ _INT_MIN
        need = k - count(key > t)                                    # ties to keep, >= 1
        tie = key == t

        def cut_bit(i, c):
            # The largest c with fewer than `need` ties before it: the need-th tie's column.
            cand = c | lax.shift_left(jnp.int32(1), pos_bits - 1 - i)
            return jnp.where(count(tie & (pos < cand)) < need, cand, c)

        last = lax.cond(count(tie) > need,
                        lambda: lax.fori_loop(0, pos_bits, cut_bit, jnp.int32(0)),
                        lambda: jnp.int32(width - 1))
        o_ref[r, 0] = t
        o_ref[r, 1] = last

    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    return plgpu.kernel(tessera_topk_mgpu, out_type=jax.ShapeDtypeStruct((R, 2), jnp.int32),
                        grid=(R,), grid_names=("r",), **kwargs)(flat)
