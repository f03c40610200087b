"""How the Pallas kernels decode a step's mask (``pallas_kernels.abi``: a plain step's
rectangle, a grid step's cells, a bitmap step's bits) into the scores they keep.

One module for the four kernel bodies (``mosaic.kernel``, ``mosaic.backward``,
``triton.kernel``, ``triton.backward``); the field layout and unpacking come from ``abi``,
which the XLA executor and the reference (``abi.step_mask``) read too. The bodies differ where
their primitives do: the Mosaic GPU kernels hold 64-row fragments in register layouts, so they
build a row vector and a column vector and broadcast them (``grid_vectors``,
``bitmap_hits`` with the kernel's ``load`` / ``bcast``; ``step_kind`` picks a ``lax.switch``
branch); the Triton kernels work on [tile_q, tile_kv] blocks against row / column iotas
(``grid_keep``, ``bitmap_keep``, ``gather_keep``, ``masked_block``: branches by
``lax.cond``; ``step_key_rows``: a gathered step's keys as an index vector).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import abi

__all__ = ["segment_select", "grid_vectors", "bitmap_hits", "step_kind", "rows_full",
           "grid_keep", "bitmap_keep", "gather_keep", "step_key_rows", "masked_block"]

assert abi.STEP_COLS == 4      # bitmap_keep: flat index f is steps[f >> 2, f & 3]


# --- both families -----------------------------------------------------------------------------
def segment_select(idx, lo, hi, cuts, vals):
    """Per entry of ``idx`` (an iota): ``vals[n]`` for n = the number of ``cuts``
    (non-decreasing scalars) at or below it, 0 outside [lo, hi). Compares and selects against
    scalars only (no vector shift): later cuts win, so an empty segment (a repeated cut) is
    skipped exactly as ``abi.grid_mask``'s count (idx >= c1) + (idx >= c2) + (idx >= c3)."""
    out = jnp.where(idx >= cuts[0], vals[1], vals[0])
    for cut, val in zip(cuts[1:], vals[2:]):
        out = jnp.where(idx >= cut, val, out)
    return jnp.where((idx >= lo) & (idx < hi), out, jnp.int32(0))


def grid_vectors(cuts_a, cuts_b, q_lo, q_hi, kv_lo, kv_hi, rows, cols, row0=None):
    """A grid step's selection (``abi.grid_mask``) as two factors: entry (r, c) is kept iff
    row_bits[r] & col_bit[c] != 0, where row_bits is the 4-bit row of the cell matrix for r's
    row segment (0 outside the rectangle's rows) and col_bit = 1 << (c's key segment) (0
    outside its keys). ``rows`` / ``cols``: thunks giving the row and key iotas (any shape
    that broadcasts); ``row0``: the first tile row of those rows (None: 0, no offset), which
    the row cuts are moved by; q_lo / q_hi are given relative to it already."""
    (q1, q2, q3), (k1, k2, k3), _ = abi.unpack_grid(cuts_a, cuts_b)
    nibbles = [abi.grid_nibble(cuts_b, n) for n in range(abi.GRID)]
    row_vals, col_vals = rows(), cols()
    q_cuts = (q1, q2, q3) if row0 is None else (q1 - row0, q2 - row0, q3 - row0)
    row_bits = segment_select(row_vals, q_lo, q_hi, q_cuts, nibbles)
    col_bit = segment_select(col_vals, kv_lo, kv_hi, (k1, k2, k3),
                             [jnp.int32(1 << j) for j in range(abi.GRID)])
    return row_bits, col_bit


# --- Mosaic GPU: row and column vectors in the fragment's layouts ----------------------------
def bitmap_hits(load_words, bcast, cols, shape, tile_kv: int):
    """A bitmap step's selection on a [rows, tile_kv] fragment of shape ``shape``: nonzero
    where bit c % 32 of the row's word c // 32 is set. Per word column j, ``load_words(j)``
    gives the rows' words (a row vector), and-ed with the column bit (1 << c % 32 where
    c // 32 == j, else 0; ``cols``: the key iota) after ``bcast(vec, shape, dim)``; bits
    outside the rectangle are 0 by the ABI, so nothing else is masked."""
    one = jnp.full(cols.shape, 1, jnp.int32)
    hit = None
    for j in range(abi.bitmap_words(tile_kv)):
        row_word = load_words(j)
        in_col = (cols >= j * abi.WORD_BITS) & (cols < (j + 1) * abi.WORD_BITS)
        col_bit = jnp.where(in_col, lax.shift_left(one, cols & (abi.WORD_BITS - 1)),
                            jnp.int32(0))
        term = bcast(row_word, shape, 0) & bcast(col_bit, shape, 1)
        hit = term if hit is None else hit | term
    return hit


def step_kind(cuts_b):
    """The ``lax.switch`` index of a step's kind: 0 plain, 1 grid, 2 bitmap."""
    return jnp.where(cuts_b == 0, 0, jnp.where(cuts_b == abi.BITMAP_FLAG, 2, 1))


def rows_full(q_lo, q_hi, kv_lo, kv_hi, cuts_b, num_rows: int, tile_kv: int):
    """Whether a step is full for ``num_rows`` rows (its bounds relative to them): a plain
    step whose rectangle covers them all, and all keys."""
    return ((q_lo <= 0) & (q_hi >= num_rows) & (kv_lo == 0) & (kv_hi == tile_kv)
            & (cuts_b == 0))


# --- Triton: [tile_q, tile_kv] blocks ----------------------------------------------------------
def grid_keep(row, col, rect, cuts_a, cuts_b):
    """A grid step's selection on the [tile_q, tile_kv] block, from the row iota [tile_q, 1]
    and the key iota [1, tile_kv] (``grid_vectors``): per element one and, one compare."""
    q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(rect)
    row_bits, col_bit = grid_vectors(cuts_a, cuts_b, q_lo, q_hi, kv_lo, kv_hi, lambda: row,
                                     lambda: col)
    return (row_bits & col_bit) != 0


def bitmap_keep(steps_ref, row, col, rect, off, *, tile_q: int, tile_kv: int, num_steps: int):
    """A bitmap step's selection (cuts_b == BITMAP_FLAG, off = cuts_a) on the [tile_q,
    tile_kv] block: key c of row r is kept iff bit c % 32 of word(r, c // 32) is set,
    word(r, w) = steps.reshape(-1)[off + w * tile_q + r]. Word column w is one gather of
    tile_q int32 from ``steps_ref`` [num_steps, STEP_COLS] (row f >> 2, column f & 3 of flat
    index f; off clamped to [0, 4 * num_steps] and the row to the array, so an invalid offset
    reads wrong words, never out of bounds), zeroed outside the rectangle's rows; each key
    picks its word with W - 1 selects against the key iota and tests it against col_bit
    [1, tile_kv] = 1 << (c % 32) (0 outside the rectangle's keys): per element of the block
    W - 1 selects, one and and one compare."""
    q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(rect)
    rows_in = (row >= q_lo) & (row < q_hi)                          # [tile_q, 1]
    base = jnp.clip(off, 0, abi.STEP_COLS * num_steps) + row        # [tile_q, 1] flat index
    word = None
    for w in range(abi.bitmap_words(tile_kv)):
        f = base + w * tile_q
        wd = steps_ref[jnp.minimum(f >> 2, num_steps - 1), f & 3]   # [tile_q, 1]
        wd = jnp.where(rows_in, wd, jnp.int32(0))
        word = wd if word is None else jnp.where(col >= w * abi.WORD_BITS, wd, word)
    col_bit = jnp.left_shift(jnp.int32(1), col & (abi.WORD_BITS - 1))
    col_bit = jnp.where((col >= kv_lo) & (col < kv_hi), col_bit, jnp.int32(0))
    return (word & col_bit) != 0


def _word(steps_ref, f, num_steps: int):
    """Word ``f`` of ``steps.reshape(-1)`` (any shape of flat indices; clamped into the array,
    so an invalid offset reads wrong words, never out of bounds)."""
    f = jnp.clip(f, 0, abi.STEP_COLS * num_steps - 1)
    return steps_ref[f >> 2, f & 3]


def step_key_rows(steps_ref, s, col, *, tile_kv: int, num_steps: int, gather: bool):
    """The key rows of step ``s``'s K/V tile: ``pl.ds(kv_start, tile_kv)``, or with ``gather``
    an index vector [tile_kv] (a gathered step's start[c // 8] + c % 8: one gather of its
    chunk starts; other steps kv_start + c). ``col``: the key iota [1, tile_kv]."""
    kv_start = steps_ref[s, abi.STEP_KV_START]
    if not gather:
        return pl.ds(kv_start, tile_kv)
    A = abi.GATHER_ROWS
    gathered = abi.is_gather(steps_ref[s, abi.STEP_CUTS_B])
    start = _word(steps_ref, steps_ref[s, abi.STEP_CUTS_A] + col // A, num_steps)
    return jnp.where(gathered, start + col % A, kv_start + col)[0]


def gather_keep(steps_ref, row, col, off, *, tile_q: int, tile_kv: int, num_steps: int):
    """A gathered step's selection (words at ``off``: chunk starts, key bits, row bits) on the
    [tile_q, tile_kv] block: row r's bit and key c's bit both set (two gathers of words)."""
    G, W = abi.gather_chunks(tile_kv), abi.bitmap_words(tile_kv)
    bit = lambda words, i: (words >> (i & (abi.WORD_BITS - 1))) & 1      # noqa: E731
    key = bit(_word(steps_ref, off + G + col // abi.WORD_BITS, num_steps), col)
    rows = bit(_word(steps_ref, off + G + W + row // abi.WORD_BITS, num_steps), row)
    return (rows & key) != 0


def masked_block(steps_ref, s, x, row, col, *, mode: str, tile_q: int, tile_kv: int,
                 num_steps: int, gather: bool = False):
    """Scores ``x`` [tile_q, tile_kv] of step ``s`` with -inf where the step selects nothing:
    a branch on STEP_CUTS_B between a plain step's rectangle (alone) and the others, which
    branch again between a grid's cells and a bitmap's bits (with ``gather``, and a gathered
    step's row x key bits); mode "cond" skips full steps, "none" masks nothing (plans whose
    visited steps are all full)."""
    if mode == "none":
        return x
    rect = steps_ref[s, abi.STEP_RECT]
    cuts_b = steps_ref[s, abi.STEP_CUTS_B]       # 0: a plain step
    plain = cuts_b == 0

    def rect_mask(x):
        q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(rect)
        keep = ((row >= q_lo) & (row < q_hi)) & ((col >= kv_lo) & (col < kv_hi))
        return jnp.where(keep, x, -jnp.inf)

    def grid_mask(x):
        keep = grid_keep(row, col, rect, steps_ref[s, abi.STEP_CUTS_A], cuts_b)
        return jnp.where(keep, x, -jnp.inf)

    def bitmap_mask(x):
        keep = bitmap_keep(steps_ref, row, col, rect, steps_ref[s, abi.STEP_CUTS_A],
                           tile_q=tile_q, tile_kv=tile_kv, num_steps=num_steps)
        return jnp.where(keep, x, -jnp.inf)

    cells = lambda x: lax.cond(cuts_b == abi.BITMAP_FLAG, bitmap_mask, grid_mask, x)  # noqa: E731
    if gather:
        def gather_mask(x):
            keep = gather_keep(steps_ref, row, col, steps_ref[s, abi.STEP_CUTS_A],
                               tile_q=tile_q, tile_kv=tile_kv, num_steps=num_steps)
            return jnp.where(keep, x, -jnp.inf)

        cells_only = cells
        cells = lambda x: lax.cond(abi.is_gather(cuts_b), gather_mask, cells_only, x)  # noqa: E731
    masked = lambda x: lax.cond(plain, rect_mask, cells, x)                           # noqa: E731
    if mode == "cond":
        full = (rect == jnp.int32(abi.full_rect(tile_q, tile_kv))) & plain
        if gather:
            full = full | (cuts_b == abi.GATHER_FULL_FLAG)
        return lax.cond(full, lambda x: x, masked, x)
    return masked(x)
