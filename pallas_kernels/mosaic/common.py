"""Constants, register-layout helpers and the grid / bitmap step masks shared by the Mosaic GPU
kernels (``kernel``: the forward, ``backward``: dq and dk/dv)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import step_masks

WG_ROWS = 64                       # rows per consumer warpgroup (one wgmma M tile)
CONSUMERS = 2                      # consumer warpgroups; the producer is warpgroup CONSUMERS
ALIGN = 8                          # q_start / kv_start alignment (rows of one SMEM tile)


def iota(n: int, dim: int):
    """int32 iota of n in the WGMMA fragment's row (dim 1 reduced) or column layout."""
    return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=plgpu.Layout.WGMMA.reduce(dim))


def bcast(vec, shape, dim: int):
    """A row (dim 0) or column (dim 1) vector broadcast over a [rows, cols] fragment."""
    return plgpu.layout_cast(lax.broadcast_in_dim(vec, shape, [dim]), plgpu.Layout.WGMMA)


def grid_mask(cuts_a, cuts_b, q_lo, q_hi, kv_lo, kv_hi, rows, cols, row0, x):
    """A grid step's mask on a warpgroup's scores ``x`` [64, tile_kv]: -inf where
    ``step_masks.grid_vectors`` (rows / cols: thunks of the fragment's iotas; bounds relative
    to the warpgroup's first row ``row0``) selects nothing. Per element: one and, one
    compare, one select."""
    row_bits, col_bit = step_masks.grid_vectors(cuts_a, cuts_b, q_lo, q_hi, kv_lo, kv_hi, rows,
                                                cols, row0)
    return jnp.where((bcast(row_bits, x.shape, 0) & bcast(col_bit, x.shape, 1)) != 0, x,
                     -jnp.inf)


def bitmap_mask(words, off, row0, tile_q: int, tile_kv: int, cols, x):
    """A bitmap step's mask on a warpgroup's scores ``x`` [64, tile_kv] (rows row0 .. row0 +
    63 of the tile; ``cols``: the key iota): each word column a 1-D GMEM load of the 64 rows'
    words from ``words`` (``steps.reshape(-1)``) at offset ``off`` (``step_masks.bitmap_hits``)."""
    def load(j):
        return plgpu.load(words.at[pl.ds(off + j * tile_q + row0, WG_ROWS)],
                          layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

    hit = step_masks.bitmap_hits(load, bcast, cols, x.shape, tile_kv)
    return jnp.where(hit != 0, x, -jnp.inf)
