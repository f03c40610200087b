"""Constants, register-layout helpers, the grid / bitmap / gathered step masks (one step's,
``masked_step``, and a step-pairs stage's, ``masked_pair``) and the gathered stage loads shared
by the Mosaic GPU kernels (``kernel``: the forward, ``backward``: dq and dk/dv)."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import abi, step_masks

WG_ROWS = 64                       # rows per consumer warpgroup (one wgmma M tile)
CONSUMERS = 2                      # consumer warpgroups; the producer is warpgroup CONSUMERS
ALIGN = 8                          # q_start / kv_start alignment (rows of one SMEM tile)
TMA_SMEM_ALIGN = 128               # bytes: a TMA copy's SMEM destination


def iota(n: int, dim: int):
    """int32 iota of n in the WGMMA fragment's row (dim 1 reduced) or column layout."""
    return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=plgpu.Layout.WGMMA.reduce(dim))


def bcast(vec, shape, dim: int):
    """A row (dim 0) or column (dim 1) vector broadcast over a [rows, cols] fragment."""
    return plgpu.layout_cast(lax.broadcast_in_dim(vec, shape, [dim]), plgpu.Layout.WGMMA)


def store_owned(val, tiled, untiled, lo, hi, dst):
    """A warpgroup's 64 rows ``val`` (registers) stored in place, only its owned rows [lo, hi)
    (0 <= lo <= hi <= 64): all 64 by one TMA copy from the swizzled ``tiled`` buffer, a part
    by the binary ladder of copies of 32, 16, .., 1 rows from the ``untiled`` buffer (a row is
    D * 2 >= 128 bytes, so any row offset meets TMA's SMEM alignment). ``dst(start, n)``: the
    GMEM view of n rows from row ``start`` of the 64. The copies are committed, not waited."""
    whole = (lo == 0) & (hi == WG_ROWS)

    @pl.when(whole)
    def _():
        tiled[...] = val
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tiled, dst(0, WG_ROWS))

    @pl.when(~whole & (hi > lo))
    def _():
        untiled[...] = val
        plgpu.commit_smem()
        p, n = lo, WG_ROWS // 2
        while n:
            take = hi - p >= n

            @pl.when(take)
            def _(p=p, n=n):
                plgpu.copy_smem_to_gmem(untiled.at[pl.ds(p, n)], dst(p, n))

            p = p + jnp.where(take, n, 0)
            n //= 2


def owned_rows(units, u, row0):
    """(lo, hi): the unit's own rows within a warpgroup's 64 rows from tile row ``row0``."""
    lo = jnp.clip(units[u, abi.UNIT_OWN_LO] - row0, 0, WG_ROWS)
    hi = jnp.clip(units[u, abi.UNIT_OWN_HI] - row0, 0, WG_ROWS)
    return lo, hi


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


def gather_vectors(words, off, row0, tile_kv: int):
    """(key bool [tile_kv] in the column layout, row bool [64] in the row layout) of a
    gathered step whose words start at ``off`` in ``words`` (``abi.pack_gather``: chunk
    starts, key bits, row bits), for the warpgroup of tile rows row0 .. row0 + 63."""
    G, W = abi.gather_chunks(tile_kv), abi.bitmap_words(tile_kv)
    kw = off + G
    rw = kw + W + row0 // abi.WORD_BITS              # the warpgroup's two row words

    def bits_on(first, iota_, n):
        # The bitmap decoder on a vector: word j's scalar against the bit of each index.
        return step_masks.bitmap_hits(lambda j: words[first + j], lambda v, shape, dim: v,
                                      iota_, iota_.shape, n) != 0

    return bits_on(kw, iota(tile_kv, 0), tile_kv), bits_on(rw, iota(WG_ROWS, 1), WG_ROWS)


def masked_step(steps, words, s, row0, tile_q: int, tile_kv: int, mode: str, x,
                gather=False, off: int = 0, on=None):
    """Scores ``x`` [64, tile_kv] of this warpgroup's rows (tile rows row0 .. row0 + 63) with
    -inf where step ``s`` selects nothing (``abi.step_mask``): every kind as one test
    ``row_bits[r] & col_bit[c] != 0`` of a row vector and a column vector (a plain step: 1
    inside its rectangle; a grid step: its cell row / 1 << key segment, ``abi.grid_mask``; a
    bitmap step: its row words / 1 << c % 32 per word column), and with ``gather`` a gathered
    step as a key bias plus a row bias (0 / -inf, ``gather_vectors``). Mode "cond"
    skips full steps. ``off``: the step's keys are columns off .. off + tile_kv of a wider
    ``x`` (a step-pairs stage; -inf on the other columns), ``on``: all -inf unless it holds."""
    if mode == "none":
        return x
    rect = steps[s, abi.STEP_RECT]
    cuts_b = steps[s, abi.STEP_CUTS_B]
    q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(rect)
    q_lo, q_hi = q_lo - row0, q_hi - row0
    rows, cols = iota(WG_ROWS, 1), iota(x.shape[1], 0) - off
    one, zero = jnp.int32(1), jnp.int32(0)

    def plain(x):
        rb = jnp.where((rows >= q_lo) & (rows < q_hi), one, zero)
        cb = jnp.where((cols >= kv_lo) & (cols < kv_hi), one, zero)
        return jnp.where((bcast(rb, x.shape, 0) & bcast(cb, x.shape, 1)) != 0, x, -jnp.inf)

    def grid(x):
        return grid_mask(steps[s, abi.STEP_CUTS_A], cuts_b, q_lo, q_hi, kv_lo, kv_hi,
                         lambda: rows, lambda: cols, row0, x)

    def bitmap(x):
        return bitmap_mask(words, steps[s, abi.STEP_CUTS_A], row0, tile_q, tile_kv, cols, x)

    def gathered(x):
        keys, rws = gather_vectors(words, steps[s, abi.STEP_CUTS_A], row0, tile_kv)
        x = x + bcast(jnp.where(keys, 0.0, -jnp.inf), x.shape, 1)
        return x + bcast(jnp.where(rws, 0.0, -jnp.inf), x.shape, 0)

    kind = step_masks.step_kind(cuts_b)
    branches = [plain, grid, bitmap]
    if gather:
        branches.append(gathered)
        kind = jnp.where(abi.is_gather(cuts_b), 3, kind)
    if on is not None:
        # Off: every column -inf (cols >= -off always).
        branches.append(lambda x: x + bcast(jnp.where(cols < -off, 0.0, -jnp.inf), x.shape, 1))
        kind = jnp.where(on, kind, len(branches) - 1)
    masked = lambda x: lax.switch(kind, branches, x)      # noqa: E731
    if mode == "cond":
        full = step_masks.rows_full(q_lo, q_hi, kv_lo, kv_hi, cuts_b, WG_ROWS, tile_kv)
        if gather:
            full = full | (cuts_b == abi.GATHER_FULL_FLAG)
        return lax.cond(full, lambda x: x, masked, x)
    return masked(x)


def masked_pair(steps, words, sa, sb, has_b, row0, tile_q: int, tile_kv: int, mode: str, x):
    """Scores ``x`` [64, 2 x tile_kv] of a step-pairs stage (``MosaicConfig.step_pairs``:
    steps ``sa`` and ``sb``, the second absent unless ``has_b``) masked by each half's step
    (``masked_step``), combined by max (their keys are disjoint); mode "cond" skips a stage
    whose two steps are both full."""
    if mode == "none":
        return x

    def masked(x):
        return jnp.maximum(
            masked_step(steps, words, sa, row0, tile_q, tile_kv, "always", x),
            masked_step(steps, words, sb, row0, tile_q, tile_kv, "always", x, off=tile_kv,
                        on=has_b))
    if mode != "cond":
        return masked(x)

    def full(s):
        q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(steps[s, abi.STEP_RECT])
        return step_masks.rows_full(q_lo - row0, q_hi - row0, kv_lo, kv_hi,
                                    steps[s, abi.STEP_CUTS_B], WG_ROWS, tile_kv)
    return lax.cond(full(sa) & has_b & full(sb), lambda x: x, masked, x)


def copy_starts(steps, words, s, tile_kv: int, run: int):
    """The first key of each copy of step ``s``'s K/V stage (``run`` keys each, a multiple of
    abi.GATHER_ROWS): from the step's words (a gathered step) or kv_start + run j. The words
    are read for every step (a select, not a branch), so their index is clamped: a plain
    step of a plan of fewer than tile_kv / 8 words would read past ``words``."""
    m = run // abi.GATHER_ROWS
    kv_start = steps[s, abi.STEP_KV_START]
    gathered = abi.is_gather(steps[s, abi.STEP_CUTS_B])
    off = jnp.where(gathered, steps[s, abi.STEP_CUTS_A], 0)
    last = words.shape[0] - 1
    return tuple(jnp.where(gathered, words[jnp.minimum(off + j * m, last)], kv_start + j * run)
                 for j in range(tile_kv // run))


def rows_of(refs, b, head, token_major: bool = True):
    """For each ref, a function of a ``pl.ds`` of rows -> those rows of batch ``b`` and head
    ``head``: refs [B, L, H, D] (``token_major``) or row vectors [B, H, L] (lse, delta)."""
    if token_major:
        return tuple(functools.partial(lambda ref, rows: ref.at[b, rows, head], r) for r in refs)
    return tuple(functools.partial(lambda ref, rows: ref.at[b, head, rows], r) for r in refs)


def load_gathered(views, smems, bars, consumed, starts, run: int, slot, wait):
    """A gathering producer's stages of one step: for each ``views[i]`` (a function of a
    ``pl.ds`` of rows -> the GMEM ref's rows, e.g. K's of one batch and head, or a row vector
    of lse), one TMA copy per run of ``run`` rows at ``starts`` (``copy_starts``) into
    ``smems[i].at[slot]``, copy j issued by warp j % 4 (one issuing thread is too slow for 16
    copies a step); each stage once ``consumed[i].at[slot]`` says the slot is free (when
    ``wait``; None: the stage shares the previous one's); ``bars[i].at[slot]`` expects
    tile / run arrivals."""
    starts = [pl.multiple_of(x, ALIGN) for x in starts]
    for smem in smems:
        row_bytes = math.prod(smem.shape[2:]) * jnp.dtype(smem.dtype).itemsize
        if run * row_bytes % TMA_SMEM_ALIGN:
            raise ValueError(f"load_gathered: copies of {run} rows of {row_bytes} bytes land at "
                             f"SMEM offsets that are not multiples of {TMA_SMEM_ALIGN} bytes "
                             "(TMA's alignment: the GPU faults with a misaligned address)")
    for view, smem, bar, done in zip(views, smems, bars, consumed):
        if done is not None:
            @pl.when(wait)
            def _(done=done):
                plgpu.barrier_wait(done.at[slot])

        def issue(w, view=view, smem=smem, bar=bar):
            for j in range(len(starts)):
                pl.when(w == j % 4)(functools.partial(
                    plgpu.copy_gmem_to_smem, view(pl.ds(starts[j], run)),
                    smem.at[slot, pl.ds(j * run, run)], bar.at[slot]))

        plgpu.warp_map(issue)


def gather_produce(streams, steps, words, num_steps: int, tile: int, run: int, stages: int,
                   load, drain_slot, step_pairs: bool = False):
    """The producer loop of a gathering kernel (forward, dq, dk/dv): ``streams`` holds per
    ring (b, head, step_ptr, step_count) of its unit; step i of each ring's unit by
    ``load(b, head, starts, slot, wait)`` (``starts``: its copies' first rows,
    ``copy_starts`` of ``tile`` rows in runs of ``run``; ``wait``: the slot was used before),
    the next step's starts read while the current copies wait for their slot (the two
    dependent GMEM reads of a gathered step's starts stay off the path from a released slot to
    its next copies: with one slot per ring they cost 0.94 -> 0.75 of cuDNN's rate,
    benchmarks/NOTES.md#gathered-steps); then ``drain_slot(slot)`` on each ring's last
    ``stages`` slots, so every barrier phase is waited for before the barriers go away.
    ``step_pairs``: stage i holds steps 2i and 2i + 1 (``MosaicConfig.step_pairs``), one copy of
    ``tile`` keys each from its kv_start; an odd count's last stage copies its step twice (the
    consumers mask the second)."""
    def slot(g, ring):
        return lax.rem(g, jnp.array(stages, g.dtype)) + ring * stages

    def stages_of(cnt):
        return (cnt + 1) // 2 if step_pairs else cnt

    def next_starts(ptr, cnt, i):
        # Clamped: past a unit's last step the read is of a real row, and unused.
        last = ptr + jnp.maximum(cnt - 1, 0)
        if step_pairs:
            return tuple(steps[jnp.minimum(jnp.minimum(ptr + 2 * i + d, last), num_steps - 1),
                               abi.STEP_KV_START] for d in (0, 1))
        return copy_starts(steps, words, jnp.minimum(jnp.minimum(ptr + i, last), num_steps - 1),
                           tile, run)

    def body(i, carry):
        out = []
        for ring, ((b, head, ptr, cnt), starts) in enumerate(zip(streams, carry)):
            pl.when(i < stages_of(cnt))(functools.partial(load, b, head, starts, slot(i, ring),
                                                          i >= stages))
            out.append(next_starts(ptr, cnt, i + 1))
        return tuple(out)

    total = functools.reduce(jnp.maximum, [stages_of(cnt) for _, _, _, cnt in streams])
    lax.fori_loop(0, total, body, tuple(next_starts(ptr, cnt, jnp.int32(0))
                                        for _, _, ptr, cnt in streams))
    for ring, (_, _, _, cnt) in enumerate(streams):
        n = stages_of(cnt)

        @pl.loop(jnp.maximum(n - stages, 0), n)
        def _(g, ring=ring):
            drain_slot(slot(g, ring))
