"""The device planner's core: a block mask held in jax arrays -> plan ABI arrays, in jnp.

The device planner (issue 16): jittable, no host transfer, shapes of the outputs derived from
the static shapes (and static bounds) alone, so a new mask of the same shapes neither retraces
nor recompiles. ``tessera_jax.sparse_attention`` runs it for device masks
(``runtime.device_route``, which plans the forward and the transposed mask's dk/dv pass with
it); it returns an ``abi.PassPlan`` whose arrays the kernels take as traced plan operands.

Plan it builds (``pallas_kernels.abi``): one unit per (query head, query tile), a step for
each K/V tile that holds a selected entry, in key order (bounds shared by the heads or each
head's own); units heaviest first by the cost model, as the host planner orders them.
Tiles: with static (NumPy) bounds, block-aligned ones: those expected to be visited least
(``_segments_fit``: each starts where the one before ends, at most ``abi.GRID`` blocks, a tile
may hold the end of one block and the start of the next), else the greedy ones
(``_segments``: each starts at a block (rounded down to 8 tokens) and owns up to ``abi.GRID``
consecutive blocks that fit the tile, a long block cut into tile-long pieces), so a step rarely
straddles a block edge (Wan 720p STA: 10% fewer steps and no masked ones against the fixed
grid); they are used when they number at most ``_SEGMENT_FREE`` (9 / 8) x the fixed grid's, or
up to ``_SEGMENT_SLACK`` (5 / 4) x where they are expected to be visited at most 0.9x as often
with blocks selected independently at ``ALIGN_DENSITY`` (a tile meeting n blocks visited with
probability 1 - (1 - d)^n: natten's blocks of 24-128 tokens, greedy tiles 1.15x the tiles and
0.80x the visits, 1.71 -> 1.25x the selected interactions at q128 x kv128; fitted ones 1.07x
the tiles, 1.23x; moba's and ssta's blocks of 72-384 tokens, fitted 1.03x the tiles, 1.35 ->
1.13x and 1.20 -> 1.11x where the greedy ones computed 1.28x and 1.29x), so a plan computes at
most (5 / 4)^2 x a dense plan of fixed tiles (a fully selected mask). Traced bounds take
greedy tiles that may start inside a block (``_segments_carry``, found in the program by
pointer doubling) where a row's tiles fit ``traced_slots``. Otherwise the fixed grid of
tile-sized tiles. A step is plain
where every block it meets is selected, else a *grid* step whose cuts are the block bounds
inside its own range and whose cells are the blocks' flags; every (unit, tile) is visited once.
Grid steps hold at most 4 x 4 blocks, so every tile must meet at most ``abi.GRID`` query blocks
and ``abi.GRID`` key blocks (fixed tiles: blocks of >= tile / 3 tokens, or tile-aligned ones of
tile / 4). Host (NumPy) bounds are checked when tracing (ValueError); device bounds yield
``ok`` = False when broken (a tile meets more blocks, bounds not increasing from 0 to the
length), with every index clamped, so bad data never reads out of bounds; check it with
``checkify`` (``check``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi
from tessera_jax.batched_cond import batch_all
from tessera_jax.planning import schedule

__all__ = ["plan_on_device", "bitmap_slots", "check", "pack_words"]

#: jnp.searchsorted's method inside plans: unrolled binary search, one fused kernel (the
#: default "scan" is a while loop, a kernel and a host round trip per level on a GPU).
_SEARCH = "scan_unrolled"


def _blocks_of(bounds, start, end):
    """(first, last) block meeting each own range [start, end) (``end > start``; an empty
    range gives any in-range pair), each [Hb, nt], for ``bounds`` [Hb, n + 1] (NumPy or jnp)
    and ranges [Hb or 1, nt]."""
    n = bounds.shape[1] - 1
    if isinstance(bounds, np.ndarray) and isinstance(start, np.ndarray):
        find = lambda x: np.stack([np.searchsorted(b, r, side="right")     # noqa: E731
                                   for b, r in zip(bounds, np.broadcast_to(
                                       x, (len(bounds),) + x.shape[1:]))])
    else:
        find = lambda x: jax.vmap(  # noqa: E731
            lambda b, r: jnp.searchsorted(b, r, side="right", method=_SEARCH))(
            jnp.asarray(bounds), jnp.broadcast_to(jnp.asarray(x), (bounds.shape[0],) + x.shape[1:]))
    first = (find(start) - 1).clip(0, n - 1)
    last = (find(np.maximum(end - 1, start) if isinstance(end, np.ndarray)
                 else jnp.maximum(end - 1, start)) - 1).clip(0, n - 1)
    return first, last


def _segments(b: np.ndarray, tile: int, align: int = 8):
    """Block-aligned tiles of one bounds row (host): consecutive blocks packed greedily into
    segments of at most ``abi.GRID`` blocks whose aligned start + ``tile`` covers them; a
    block longer than that is cut into pieces. Returns [(origin, lo, hi)]: the tile starts at
    ``origin`` (a multiple of ``align``) and owns tokens [lo, hi)."""
    segs, n, i = [], len(b) - 1, 0
    while i < n:
        lo = int(b[i])
        org = lo - lo % align
        if int(b[i + 1]) - org > tile:                 # a long block: pieces of the tile
            p = lo
            while p < b[i + 1]:
                o = p - p % align
                e = min(o + tile, int(b[i + 1]))
                segs.append((o, p, e))
                p = e
            i += 1
            continue
        j = i + 1
        while j < n and j - i < abi.GRID and int(b[j + 1]) - org <= tile:
            j += 1
        segs.append((org, lo, int(b[j])))
        i = j
    return segs


def _segments_fit(b: np.ndarray, tile: int, align: int = 8, density: float | None = None):
    """Tiles of one bounds row (host) that minimise their expected visits
    (``_expected_visits`` at ``density``, None: ``ALIGN_DENSITY``; a tile meeting n blocks
    counts 1 - (1 - d)^n), as ``_segments``' [(origin, lo, hi)] (tiles own [lo, hi)
    consecutively from 0 to the length, origin = lo rounded down to ``align``, hi <= origin +
    ``tile``, origins strictly increasing, at most ``abi.GRID`` blocks a tile); None where no
    such tiling exists (blocks of a few tokens). Unlike ``_segments``' greedy packing, which
    starts a tile at every block that does not fit the one before (a 288-token block takes 128
    + 128 + 32 tokens, its 32-token tail a tile alone), a tile may cover the end of one block
    and the start of the next where that is expected to be visited less than a tile more: Wan
    480p moba's and ssta's blocks of 72-384 tokens take 263 tiles of 128 (greedy 292, the fixed
    grid 256 of which 92 straddle two blocks, 29 here). A shortest path over the tile ends
    (block bounds and tile ends), in Python: O(tiles x GRID); memoised per row."""
    d = ALIGN_DENSITY if density is None else density
    return _fit_row(tuple(int(x) for x in b), int(tile), int(align), float(d))


@functools.lru_cache(maxsize=1024)
def _fit_row(b: tuple, tile: int, align: int, density: float):
    import bisect
    import heapq
    L, n = b[-1], len(b) - 1
    # Expected visits a tile, plus a hair a tile: of tilings expected to be visited as often,
    # the fewest tiles (96 + 96 + 64 tokens: two 128-token tiles meeting two blocks each,
    # as the fixed grid, not three).
    weight = [0.0] + [visit_probability(k, density) + 1e-6 for k in range(1, abi.GRID + 1)]
    best = {0: (0.0, -1)}                           # tile end -> (cost, the tile's start)
    heap = [0]
    while heap:
        lo = heapq.heappop(heap)
        if lo == L:
            break
        cost = best[lo][0]
        org = lo - lo % align
        lim = min(org + tile, L)
        fb = bisect.bisect_right(b, lo) - 1          # the block holding lo
        ends, j = [], fb + 1
        while j <= n and b[j] <= lim and j - fb <= abi.GRID:
            ends.append((b[j], j - fb))              # up to a block bound: j - fb blocks
            j += 1
        if j - fb <= abi.GRID and (not ends or ends[-1][0] < lim):
            ends.append((lim, j - fb))               # the tile's end, inside block j - 1
        for hi, k in ends:
            if hi < L and hi - hi % align <= org:
                continue                             # the next origin must be past this one
            c = cost + weight[k]
            if hi not in best:
                heapq.heappush(heap, hi)
            if hi not in best or c < best[hi][0] - 1e-9:
                best[hi] = (c, lo)
    if L not in best:
        return None
    segs, hi = [], L
    while hi > 0:
        lo = best[hi][1]
        segs.append((lo - lo % align, lo, hi))
        hi = lo
    return segs[::-1]


def _segments_carry(b: np.ndarray, tile: int, align: int = 8):
    """Greedy tiles of one bounds row (host; the oracle of ``_segments_traced``) that may
    start inside a block: from position p (origin p rounded down to ``align``) a tile takes
    whole blocks while they end by origin + ``tile``, at most ``abi.GRID`` of them; it ends
    at origin + ``tile``, inside a block, where the block at p does not fit (a long block's
    piece, whose remainder then starts a tile that may take the next blocks) or where ending
    at a block bound would give the next tile the same origin (a block of a few tokens before
    one that does not fit). Returns [(origin, lo, hi)] as ``_segments``. Unlike
    ``_segments``, a long block's tail shares its tile with the next blocks: Wan 480p SVG2's
    clusters (2-2,261 tokens) take 617 tiles of 64 tokens a row (greedy 678, 19-24 of them
    repeating an origin; fitted 538), and its q64x2 x kv64 plan no bitmap step."""
    b = [int(x) for x in b]
    segs, n, i, p = [], len(b) - 1, 0, b[0]
    while i < n:
        org = p - p % align
        lim = org + tile
        if b[i + 1] > lim:                             # a piece of block i
            segs.append((org, p, lim))
            p = lim
            continue
        j = i + 1
        while j < n and j - i < abi.GRID and b[j + 1] <= lim:
            j += 1
        e = b[j]
        if j < n and e - org < align and j - i < abi.GRID:
            e = lim                                    # into block j: the next origin moves
        segs.append((org, p, e))
        p, i = e, j                                    # at block j's start or inside it
    return segs


def _segments_traced(bounds, tile: int, slots: int, length: int, align: int = 8):
    """``_segments_carry`` of each traced bounds row [Hb, n + 1] inside a program, with no
    sequential scan. A tile starts at a block start or at a multiple of ``align`` (a cut
    inside a block), so those positions are the nodes, each with one successor (the next
    tile's start); the tiles are the chain from position 0, found by pointer doubling
    (log2 nodes gathers): node k is on it iff nxt^(d(0) - d(k))(0) == k, d = jumps to the
    end. Returns (org, lo, hi) [Hb, slots] as ``_axis``'s block-aligned tiles (unused slots
    own nothing at the last origin) and ``fits`` [Hb]: the row's tiles number <= ``slots``
    and their origins increase strictly (else ``_axis`` keeps the fixed grid). Bounds that
    do not increase to ``length`` give some tiling (every index clamped), never a read out of
    bounds."""
    b = jnp.asarray(bounds, jnp.int32)
    n = b.shape[1] - 1
    grid = np.arange(0, length, align, dtype=np.int32)
    N = grid.size + n                                   # nodes; node N: the end
    levels = max(1, int(N).bit_length())

    def row(r):
        pos = jnp.sort(jnp.concatenate([jnp.asarray(grid), r[:-1]]))
        i = jnp.clip(jnp.searchsorted(r, pos, side="right", method=_SEARCH) - 1, 0, n - 1)
        org = pos - pos % align
        lim = org + tile
        piece = r[i + 1] > lim
        fit = jnp.searchsorted(r, lim, side="right", method=_SEARCH).astype(jnp.int32) - 1
        j = jnp.clip(jnp.minimum(fit, i + abi.GRID), i + 1, n)
        e = r[j]
        cut = (j < n) & (e - org < align) & (j - i < abi.GRID)
        e = jnp.where(piece | cut, lim, e)
        nxt = jnp.searchsorted(pos, e, side="left", method=_SEARCH).astype(jnp.int32)
        nxt = jnp.where(e >= r[-1], N, jnp.maximum(nxt, jnp.arange(N, dtype=jnp.int32) + 1))
        jump = [jnp.append(nxt, N)]                        # node N: the end, its own successor
        for _ in range(levels):
            jump.append(jump[-1][jump[-1]])
        cur, d = jnp.arange(N + 1, dtype=jnp.int32), jnp.zeros(N + 1, jnp.int32)
        for k in range(levels, -1, -1):
            step = jump[k][cur]
            take = step < N
            cur, d = jnp.where(take, step, cur), d + jnp.where(take, 1 << k, 0)
        d = d + (cur < N)
        gap = d[0] - d[:N]
        at = jnp.zeros(N, jnp.int32)
        for k in range(levels, -1, -1):
            at = jnp.where((gap >> k) & 1 == 1, jump[k][at], at)
        on = (gap >= 0) & (at == jnp.arange(N, dtype=jnp.int32))
        total = on.sum()
        index = jnp.cumsum(on) - 1                          # a chain node's slot
        s = jnp.arange(slots, dtype=jnp.int32)
        node = jnp.clip(jnp.searchsorted(index, s, side="left", method=_SEARCH), 0, N - 1)
        used = s < total
        o = org[node]
        lo = pos[node]
        hi = jnp.where(nxt[node] >= N, r[-1], pos[jnp.minimum(nxt[node], N - 1)])
        last = jnp.max(jnp.where(used, o, 0))
        o = jnp.where(used, o, last)
        lo, hi = jnp.where(used, lo, last), jnp.where(used, hi, last)
        increasing = jnp.all(jnp.where(used[1:], o[1:] > o[:-1], True))
        return o, lo, hi, (total <= slots) & increasing

    return jax.vmap(row)(b)


# Block-aligned tiles are used when they number at most ``_SEGMENT_FREE`` x the fixed grid's,
# or up to ``_SEGMENT_SLACK`` x where their expected visits at ``ALIGN_DENSITY`` are at most
# ``_ALIGN_MARGIN`` x the fixed grid's (see ``_axis``; the margin stands for selections that
# are not independent per block: moba's and ssta's bounds, whose greedy tiles (``_segments``)
# are 1.14x the grid's and 0.97x the expected visits, computed 1.35 -> 1.28 on moba's mask but
# 1.20 -> 1.29 on ssta's denser one at q128 x kv128; their fitted tiles, ``_segments_fit``,
# 1.03x the grid's, are taken: 1.13 and 1.11).
_SEGMENT_FREE = 1.125
_SEGMENT_SLACK = 1.25
_ALIGN_MARGIN = 0.9
#: The block density at which ``_axis`` compares the two tilings' expected visits.
ALIGN_DENSITY = 0.5


def visit_probability(n, density: float):
    """Probability that a tile meeting ``n`` blocks (int or array) is visited when each block
    is selected independently with ``density``: 1 - (1 - density)^n."""
    return 1.0 - (1.0 - density) ** n


def _expected_visits(nb: np.ndarray, density: float = ALIGN_DENSITY) -> float:
    """Tiles of one axis expected to be visited per block of the other axis when each block
    is selected independently with ``density`` (``visit_probability``; ``nb`` [Hb, nt]: the
    blocks each tile meets, 0 for a padding tile)."""
    return float(visit_probability(nb, density)[nb > 0].sum())


def _axis(bounds, length: int, tile: int, align_blocks: bool):
    """One axis's tiles: (origin, own lo, own hi) [Hb or 1, nt] relative own ranges, the
    (first, last) blocks they meet [Hb, nt], the padded length, and whether the tiles follow
    the blocks. Static bounds are tiled along their blocks (origins strictly increasing) by
    ``_segments_fit`` (the fewest expected visits), else by ``_segments`` (greedy), the first
    of the two that makes at most ``_SEGMENT_FREE`` x the fixed grid's tiles, or up to
    ``_SEGMENT_SLACK`` x as many expected to be visited less often by ``_ALIGN_MARGIN``
    (``_expected_visits``); else the fixed grid of ``tile``.
    The padded length is the host planner's (the length rounded up to 8, at least a tile):
    tiles that would reach past it start earlier, owning the same rows (``_inside``), so the
    kernels' inputs need no padding copy unless the length is not a multiple of 8."""
    nt = -(-length // tile)
    padded = _round8(max(length, tile))
    start = np.arange(nt, dtype=np.int32) * tile
    end = np.minimum(start + tile, length).astype(np.int32)
    grid = None                        # the fixed grid's (first, last) blocks, once
    if align_blocks and isinstance(bounds, np.ndarray):
        grid = f_first, f_last = _blocks_of(bounds, start[None], end[None])
        for pack in (_segments_fit, _segments):
            rows = [pack(b, tile) for b in bounds]
            if any(r is None for r in rows):
                continue
            S = max(len(r) for r in rows)
            increasing = all(all(a[0] < c[0] for a, c in zip(r, r[1:])) for r in rows)
            if S > _SEGMENT_SLACK * nt or not increasing:
                continue
            seg = np.zeros((len(rows), S, 3), np.int32)
            used = np.zeros((len(rows), S), bool)
            for h, r in enumerate(rows):
                seg[h, :len(r)] = r
                seg[h, len(r):] = r[-1][0]             # padding: own nothing at a used origin
                used[h, :len(r)] = True
            org = seg[..., 0]
            lo, hi = np.where(used, seg[..., 1], org), np.where(used, seg[..., 2], org)
            first, last = _blocks_of(bounds, lo, hi)
            aligned = S <= _SEGMENT_FREE * nt
            if not aligned:                    # more tiles, fewer blocks each: by expectation
                aligned = (_expected_visits(np.where(used, last - first + 1, 0))
                           <= _ALIGN_MARGIN * _expected_visits(f_last - f_first + 1))
            if aligned:
                return (*_inside(org, lo - org, hi - org, padded, tile), first, last, padded,
                        True)
    if align_blocks and not isinstance(bounds, np.ndarray):
        # Traced bounds: each row's block-aligned tiles where they fit the static slots
        # (``traced_slots``), else its fixed grid in the same slots (the rest owning nothing).
        S = traced_slots(length, tile)
        org, lo, hi, fits = _segments_traced(bounds, tile, S, length)
        pad = np.full(S - nt, start[-1], np.int32)
        f_org = np.r_[start, pad]
        f_lo, f_hi = f_org, np.r_[end, pad]
        org = jnp.where(fits[:, None], org, f_org)
        lo = jnp.where(fits[:, None], lo, f_lo)
        hi = jnp.where(fits[:, None], hi, f_hi)
        first, last = _blocks_of(bounds, lo, hi)
        return (*_inside(org, lo - org, hi - org, padded, tile), first, last, padded, True)
    first, last = grid if grid is not None else _blocks_of(bounds, start[None], end[None])
    return (*_inside(start[None], np.zeros_like(start)[None], (end - start)[None], padded, tile),
            first, last, padded, False)


def _round8(n: int) -> int:
    return -(-int(n) // 8) * 8


def _inside(org, lo, hi, padded: int, tile: int):
    """(org, lo, hi) with every tile inside [0, padded): a tile reaching past it starts at
    ``padded - tile`` (a multiple of 8), its own range moved to the same rows. Its own rows
    end by the length <= padded, so they stay inside the tile."""
    xp = np if isinstance(org, np.ndarray) else jnp
    shift = xp.maximum(org + tile - padded, 0)
    return org - shift, lo + shift, hi + shift


def traced_slots(length: int, tile: int) -> int:
    """Tiles per bounds row of an axis with traced bounds: the block-aligned tiles' slots
    (``_SEGMENT_SLACK`` times the fixed grid's, as static bounds are allowed)."""
    nt = -(-length // tile)
    return max(nt, int(_SEGMENT_SLACK * nt))


def _check_host_bounds(name, bounds, length, tile, first, last):
    for h, b in enumerate(bounds):
        at = f"{name}[{h}]" if len(bounds) > 1 else name
        if b[0] != 0 or b[-1] != length or (np.diff(b) <= 0).any():
            raise ValueError(f"{at} must increase strictly from 0 to {length}")
    worst = int((last - first + 1).max())
    if worst > abi.GRID:
        raise ValueError(f"{name}: a tile of {tile} tokens meets {worst} blocks; the device "
                         f"planner's grid steps hold at most {abi.GRID} per axis (blocks of "
                         f">= {tile} / 3 tokens)")


def _fine(first, last):
    """Tiles that meet more than ``abi.GRID`` blocks (NumPy or jnp, [Hb, nt])."""
    return (jnp.asarray(last) - first + 1) > abi.GRID


def _block_counts(blocks, qa, qz, ka, kz):
    """Selected blocks among those each tile pair meets, [Hm, nqt, nkt] int32, from 2-D
    prefix sums of ``blocks`` [Hm, nq, nk] (first / last blocks [Hb, nt] per axis)."""
    Hm = blocks.shape[0]
    P = jnp.pad(jnp.cumsum(jnp.cumsum(blocks.astype(jnp.int32), axis=1), axis=2),
                ((0, 0), (1, 0), (1, 0)))
    h = jnp.arange(Hm)[:, None, None]
    qa, qz = jnp.asarray(qa)[:, :, None], jnp.asarray(qz)[:, :, None] + 1
    ka, kz = jnp.asarray(ka)[:, None, :], jnp.asarray(kz)[:, None, :] + 1
    return P[h, qz, kz] - P[h, qa, kz] - P[h, qz, ka] + P[h, qa, ka]


def block_ids(bounds, positions):
    """Block index of each position per bounds row, clamped into range (bad bounds give wrong
    but in-range ids): bounds [Hb, n + 1], positions [Hb or 1, ...] -> [Hb, ...]."""
    bounds = jnp.asarray(bounds)
    n = bounds.shape[1] - 1
    pos = jnp.broadcast_to(positions, (bounds.shape[0],) + tuple(positions.shape[1:]))
    ids = jax.vmap(lambda b, p: jnp.searchsorted(b, p, side="right", method=_SEARCH))(
        bounds, pos)
    return jnp.clip(ids - 1, 0, n - 1)


def _positions_blocks(bounds, org, tile):
    """Block index of every token of every tile, [Hb, nt, tile], clamped into range."""
    return block_ids(bounds, jnp.asarray(org, jnp.int32)[..., None]
                     + jnp.arange(tile, dtype=jnp.int32))


#: Bitmap slots one pass of ``_bitmap_words``' loop fills by direct gathers (each slot costs
#: tile_q x tile_kv of them): a traced plan's capacity is sized for any bounds (up to
#: ``BITMAP_BUDGET_BYTES``), but only the slots a mask needs are filled.
WORDS_CHUNK = 4096
#: Passes that fill the whole capacity from key patterns (a slot costs tile_q x words there):
#: a pass has a fixed cost of several kernels and, on the GPU, a host round trip for the
#: loop's predicate (Wan 480p clusters filled ~155K slots 4,096 a pass: 38 passes, ~340 us of
#: the plan's ~860, H100).
WORDS_PASSES = 8


def words_chunks(capacity: int, chunk: int | None = None) -> tuple[int, int]:
    """Slots a pass fills (from patterns, by direct gathers): ``chunk`` for both, or by
    default the capacity over ``WORDS_PASSES`` (at least ``WORDS_CHUNK``) and ``WORDS_CHUNK``."""
    if chunk is not None:
        return int(chunk), int(chunk)
    return max(WORDS_CHUNK, -(-int(capacity) // WORDS_PASSES)), WORDS_CHUNK


def _bitmap_words(buf, blocks, need, n_need, qb, kb, qorg, qlo, qhi, korg, klo, khi, tile_q,
                  tile_kv, capacity, chunk: int | None = None, patterns: bool | None = None):
    """``_fill_words`` by per-(head, query block, key tile) key patterns when the slots in use
    cost more gathers than the patterns (n_need * tile_q * tile_kv against Hm * nq * nkt *
    tile_kv; decided on the device: a per-head sliding-tile plan at Wan 480p fills 2,016 of
    1,048,576 slots), else by direct gathers per slot; ``patterns`` True / False forces one
    (the words are the same); ``chunk``: slots a pass fills (``words_chunks``)."""
    Hm, nq, _ = blocks.shape
    pat_cost = Hm * nq * need.shape[2] * tile_kv
    pat_chunk, dir_chunk = words_chunks(capacity, chunk)
    fill = functools.partial(_fill_words, blocks=blocks, need=need, n_need=n_need, qb=qb,
                             kb=kb, qorg=qorg, qlo=qlo, qhi=qhi, korg=korg, klo=klo, khi=khi,
                             tile_q=tile_q, tile_kv=tile_kv, capacity=capacity)
    by_pat = functools.partial(fill, use_pat=True, chunk=pat_chunk)
    direct = functools.partial(fill, use_pat=False, chunk=dir_chunk)
    if patterns is not None:
        return (by_pat if patterns else direct)(buf)
    if pat_cost > capacity * tile_q * tile_kv:
        return direct(buf)
    # Patterns pay once the slots in use number at least pat_cost / (tile_q * tile_kv).
    pays = n_need >= -(-pat_cost // (tile_q * tile_kv))
    return jax.lax.cond(batch_all(pays), by_pat, direct, buf)


def _fill_words(buf, *, blocks, need, n_need, qb, kb, qorg, qlo, qhi, korg, klo, khi, tile_q,
                tile_kv, capacity, chunk, use_pat: bool):
    """``buf`` [S + capacity * bitmap_rows, STEP_COLS] int32 (the S step rows, then zeros) with
    the words of the plan's bitmap steps: slot s (the s-th (head, q tile, kv tile) of ``need``
    in row-major order) holds word(r, w) = bits 32 w .. 32 w + 31 of row r of that tile's
    selection (``abi.pack_bitmap``'s layout). The slots are filled ``chunk`` at a time
    for the ``n_need`` used ones only (a loop with a traced trip count), so the capacity costs
    its zeros, not a pass of gathers over every slot."""
    Hm, nq, nk = blocks.shape
    nqt, nkt = need.shape[1:]
    W = abi.bitmap_words(tile_kv)
    rows_b = abi.bitmap_rows(tile_q, tile_kv)
    offset = buf.shape[0] - capacity * rows_b                           # the words' first row
    flat_all = jnp.nonzero(need.reshape(-1), size=capacity, fill_value=0)[0].astype(jnp.int32)
    row = lambda a, h: h if a.shape[0] > 1 else jnp.zeros_like(h)      # noqa: E731
    qpos = _positions_blocks(qb, qorg, tile_q)                          # [Hbq, nqt, tile_q]
    kpos = _positions_blocks(kb, korg, tile_kv)                         # [Hbk, nkt, tile_kv]
    r = jnp.arange(tile_q, dtype=jnp.int32)
    c = jnp.arange(tile_kv, dtype=jnp.int32)
    if use_pat:
        # Per (head, query block, K/V tile) key patterns, gathered per row.
        kid_all = jnp.broadcast_to(kpos, (Hm,) + kpos.shape[1:])
        pat = blocks[jnp.arange(Hm)[:, None, None, None], jnp.arange(nq)[None, :, None, None],
                     kid_all[:, None]]                                  # [Hm, nq, nkt, Tk]
        pat = pack_words(pat, W)                                        # [Hm, nq, nkt, W]
    K = max(1, min(int(chunk), capacity))

    def words_of(a):
        flat = jax.lax.dynamic_slice(flat_all, (a,), (K,))
        used = (a + jnp.arange(K, dtype=jnp.int32)) < n_need
        h, rest = flat // (nqt * nkt), flat % (nqt * nkt)
        qt, kt = rest // nkt, rest % nkt
        qid = qpos[row(qb, h), qt]                                      # [K, tile_q]
        qo, ko = row(qorg, h), row(korg, h)                             # tiles per bounds row
        rows_in = (r >= jnp.asarray(qlo)[qo, qt][:, None]) & \
            (r < jnp.asarray(qhi)[qo, qt][:, None])
        keys_in = (c >= jnp.asarray(klo)[ko, kt][:, None]) & \
            (c < jnp.asarray(khi)[ko, kt][:, None])
        if use_pat:
            w = pat[h[:, None], qid, kt[:, None]] & pack_words(keys_in, W)[:, None, :]
        else:
            kid = kpos[row(kb, h), kt]                                  # [K, tile_kv]
            sel = blocks[h[:, None, None], qid[:, :, None], kid[:, None, :]] & \
                keys_in[:, None, :]
            w = pack_words(sel, W)                                      # [K, Tq, W]
        w = jnp.where(rows_in[..., None] & used[:, None, None], w, 0)
        w = jnp.swapaxes(w, 1, 2).reshape(K, W * tile_q)               # word(r, w) at w*Tq + r
        w = jnp.pad(w, ((0, 0), (0, rows_b * abi.STEP_COLS - W * tile_q)))
        return w.reshape(K * rows_b, abi.STEP_COLS)

    def body(i, buf):
        a = jnp.minimum(i * K, capacity - K)      # the last pass overlaps: same words again
        return jax.lax.dynamic_update_slice(buf, words_of(a), (offset + a * rows_b, 0))

    passes = (jnp.minimum(n_need, capacity) + K - 1) // K
    return jax.lax.fori_loop(0, passes, body, buf)


def pack_words(bits, W):
    """bool [..., Tk] -> int32 words [..., W] (bit b of word w: key 32 w + b)."""
    pad = W * abi.WORD_BITS - bits.shape[-1]
    b = jnp.pad(bits, [(0, 0)] * (bits.ndim - 1) + [(0, pad)]).astype(jnp.uint32)
    b = b.reshape(bits.shape[:-1] + (W, abi.WORD_BITS))
    w = (b << jnp.arange(abi.WORD_BITS, dtype=jnp.uint32)).sum(-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(w, jnp.int32)


def bitmap_slots(q_bounds: np.ndarray, kv_bounds: np.ndarray, num_heads: int, q_len: int,
                 kv_len: int, tile_q: int, tile_kv: int, align_blocks: bool = True) -> int:
    """Bitmap steps a plan of these static bounds may need: every (head, q tile, kv tile)
    whose tiles meet more than ``abi.GRID`` blocks on either axis (an upper bound: only those
    selected and not all selected take one)."""
    fines = []
    for b, length, tile in ((q_bounds, q_len, tile_q), (kv_bounds, kv_len, tile_kv)):
        b = np.asarray(b, np.int32).reshape(-1, np.shape(b)[-1])
        _, _, _, first, last, _, _ = _axis(b, length, tile, align_blocks)
        fines.append(np.asarray(_fine(first, last)))
    fq, fk = fines                                                       # [Hb, nt]
    pairs = fq[:, :, None] | fk[:, None, :]
    per_row = pairs.reshape(len(pairs), -1).sum(axis=1)
    return int(per_row.sum() if len(per_row) == num_heads else per_row.max() * num_heads)


def plan_on_device(blocks, q_bounds, kv_bounds, *, num_q_heads: int, q_len: int, kv_len: int,
                   tile_q: int, tile_kv: int, align_blocks: bool = True,
                   bitmap_capacity: int = 0,
                   words_chunk: int | None = None,
                   word_patterns: bool | None = None) -> tuple[abi.PassPlan, jax.Array]:
    """(plan, ok): the pass plan of a block mask for these tiles (see the module docstring),
    made in jnp, and a bool [] that is False where the mask does not fit it.

    blocks: bool [Hm, nq, nk] (Hm = 1: shared by the heads, or Hm = num_q_heads), a jax or
    NumPy array, traced values included; q_bounds [nq + 1] or [Hm, nq + 1] (each head its own
    partition, e.g. clusters after a per-head sort) / kv_bounds [nk + 1] or [Hm, nk + 1]: int
    block bounds, NumPy (checked now) or jax arrays (``ok`` says whether they are valid).
    Tiles must be multiples of 8 (TMA alignment of the Mosaic GPU kernel) up to
    ``abi.MAX_TILE``. ``align_blocks``: static bounds get tiles that follow their blocks
    (``_segments_fit``, ``_segments``) where that computes no more than the fixed grid.
    ``bitmap_capacity``: how many bitmap steps the plan may hold (static) for tiles that meet
    more than ``abi.GRID`` blocks per axis (0: none; such a tile then makes ``ok`` False, or a
    ValueError for static bounds); more of them than the capacity also makes ``ok`` False
    (``bitmap_slots`` counts what a plan of static bounds needs); ``words_chunk``: bitmap slots
    filled per pass (None: ``words_chunks``' defaults), ``word_patterns``: fill them from per-key-tile patterns
    (True), by direct gathers (False) or by the cheaper for the slots in use, on the device
    (None); the plan depends on neither. The plan's leaves are jax arrays, its ``row_index``
    None (made from the units where a kernel needs it) and its ``all_full`` None.
    """
    _check_args(blocks, num_q_heads, q_len, kv_len, tile_q, tile_kv)
    Hm, nq, nk = blocks.shape
    # Named scopes: a profile of a plan names its stages.
    with jax.named_scope("plan_axes"):
        qx, kx = _axes_of(q_bounds, kv_bounds, blocks.shape, q_len, kv_len, tile_q, tile_kv,
                          align_blocks, bitmap_capacity)
    blocks = jnp.asarray(blocks)
    with jax.named_scope("plan_step_rows"):
        rows, any_sel, part, need, n_need = _step_rows(blocks, qx, kx, tile_q, tile_kv,
                                                       bitmap_capacity)
    rows_b = abi.bitmap_rows(tile_q, tile_kv)
    with jax.named_scope("plan_compact"):
        steps, ptr, cnt = _compact(rows, any_sel, bitmap_capacity * rows_b)
    if bitmap_capacity:
        # Under a cond: a plan with no bitmap step (most traced bounds) skips the words'
        # patterns (a gather over every (head, query block, key tile)), not only their passes.
        with jax.named_scope("plan_words"):
            # Under vmap: no fill only where no element has bitmap steps.
            steps = jax.lax.cond(~batch_all(n_need == 0), lambda st: _bitmap_words(
                st, blocks, need, n_need, qx.bounds, kx.bounds, qx.org, qx.lo, qx.hi, kx.org,
                kx.lo, kx.hi, tile_q, tile_kv, bitmap_capacity, words_chunk, word_patterns),
                lambda st: st, steps)
    with jax.named_scope("plan_units"):
        units = _units(qx, ptr, cnt, part, num_q_heads, Hm, tile_q, tile_kv)
        ok = _fits(qx, kx, n_need, bitmap_capacity, nq, nk, q_len, kv_len)
    # One unit per (head, tile), the tiles' own ranges covering [0, q_len): every row owned;
    # static tiles count their partly owned 64-row groups (traced ones: fixed or block tiles,
    # not counted).
    part = (abi.partial_groups(qx.org, qx.lo, qx.hi, tile_q, q_len)
            if _static(qx.org, qx.lo, qx.hi) else 0.0)
    plan = abi.PassPlan(units, steps, None, int(tile_q), int(tile_kv), int(qx.padded),
                        int(kx.padded), int(kx.org.shape[1]), rows_owned=True,
                        partial_groups=float(part))
    return plan, jnp.asarray(ok)


def _check_args(blocks, num_q_heads, q_len, kv_len, tile_q, tile_kv) -> None:
    """``plan_on_device``'s checks of its sizes, tiles and blocks (ValueError / TypeError)."""
    for name, val in (("num_q_heads", num_q_heads), ("q_len", q_len), ("kv_len", kv_len),
                      ("tile_q", tile_q), ("tile_kv", tile_kv)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    abi.check_tiles(tile_q, tile_kv)
    if tile_q % 8 or tile_kv % 8:
        raise ValueError(f"tile_q and tile_kv must be multiples of 8, got {tile_q}, {tile_kv}")
    if not hasattr(blocks, "shape") or len(blocks.shape) != 3:
        raise ValueError(f"blocks must be a [Hm, nq, nk] array, got "
                         f"{getattr(blocks, 'shape', type(blocks).__name__)}")
    if jnp.dtype(blocks.dtype) != jnp.bool_:
        raise TypeError(f"blocks must have dtype bool, got {blocks.dtype}")
    if blocks.shape[0] not in (1, num_q_heads):
        raise ValueError(f"blocks has {blocks.shape[0]} heads; it must have 1 (shared) or "
                         f"num_q_heads={num_q_heads}")


class _Axis(NamedTuple):
    """One axis of a device plan: bounds [Hb, n + 1] (NumPy or jnp), tile origins and own
    ranges [Hb or 1, nt], first / last blocks met [Hb, nt], the padded length."""

    bounds: object
    org: object
    lo: object
    hi: object
    first: object
    last: object
    padded: int


def _bounds_of(name, b, blocks_shape, n, length):
    """One axis's bounds, checked, as [Hb, n + 1] int32 (NumPy: values checked now)."""
    Hm, nq, nk = blocks_shape
    shape = tuple(getattr(b, "shape", ()))
    if not (shape == (n + 1,) or shape == (Hm, n + 1)):
        raise ValueError(f"{name} must have shape [{n + 1}] or [{Hm}, {n + 1}] (blocks is "
                         f"[{Hm}, {nq}, {nk}]), got {shape or type(b).__name__}")
    if not jnp.issubdtype(b.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {b.dtype}")
    if isinstance(b, np.ndarray):
        b = b.astype(np.int32).reshape(-1, n + 1)
        for h, row in enumerate(b):
            if row[0] != 0 or row[-1] != length or (np.diff(row) <= 0).any():
                at = f"{name}[{h}]" if len(b) > 1 else name
                raise ValueError(f"{at} must increase strictly from 0 to {length}")
        return b
    return jnp.asarray(b, jnp.int32).reshape(-1, n + 1)


def _axes_of(q_bounds, kv_bounds, blocks_shape, q_len, kv_len, tile_q, tile_kv, align_blocks,
             bitmap_capacity) -> tuple[_Axis, _Axis]:
    """Both axes' checked bounds and tiles (``_axis``). Traced bounds of equal blocks, tile
    and length are tiled in one pass over their rows (half the dependent kernels)."""
    _, nq, nk = blocks_shape
    qb = _bounds_of("q_bounds", q_bounds, blocks_shape, nq, q_len)
    kb = _bounds_of("kv_bounds", kv_bounds, blocks_shape, nk, kv_len)
    if not isinstance(qb, np.ndarray) and not isinstance(kb, np.ndarray) \
            and (nq, tile_q, q_len) == (nk, tile_kv, kv_len):
        org, lo, hi, first, last, padded, _ = _axis(jnp.concatenate([qb, kb]), q_len, tile_q,
                                                    align_blocks)
        h = qb.shape[0]
        if org.shape[0] == 1:                  # the fixed grid: one row for both
            split = [(x, x) for x in (org, lo, hi)]
        else:
            split = [(x[:h], x[h:]) for x in (org, lo, hi)]
        split += [(x[:h], x[h:]) for x in (first, last)]
        return tuple(_Axis(bb, *(p[i] for p in split), padded) for i, bb in enumerate((qb, kb)))
    return (_axis_of("q_bounds", qb, tile_q, q_len, align_blocks, bitmap_capacity),
            _axis_of("kv_bounds", kb, tile_kv, kv_len, align_blocks, bitmap_capacity))


def _axis_of(name, b, tile, length, align_blocks, bitmap_capacity) -> _Axis:
    """One axis's tiles (``_axis``) of checked bounds ``b`` [Hb, n + 1]."""
    org, lo, hi, first, last, padded, _ = _axis(b, length, tile, align_blocks)
    if isinstance(b, np.ndarray) and not bitmap_capacity:
        _check_host_bounds(name, b, length, tile, first, last)
    return _Axis(b, org, lo, hi, first, last, padded)


def _cuts(bounds, idx, inside, org, lo, hi, n):
    """The block bounds inside each tile's own range (tile rows / keys from its origin),
    unused ones at the own range's end: [Hb, nt, GRID - 1]."""
    Hb, nt = idx.shape[:2]
    at = jnp.minimum(idx[..., 1:], n).reshape(Hb, -1)
    c = jnp.take_along_axis(jnp.asarray(bounds), at, axis=1).reshape(Hb, nt, abi.GRID - 1)
    c = c - jnp.asarray(org, jnp.int32)[..., None]
    lo, hi = jnp.asarray(lo, jnp.int32)[..., None], jnp.asarray(hi, jnp.int32)[..., None]
    return jnp.where(inside[..., 1:], jnp.clip(c, lo, hi), hi)


def _step_rows(blocks, qx: _Axis, kx: _Axis, tile_q, tile_kv, bitmap_capacity):
    """Every (head, q tile, kv tile)'s step row [Hm, nqt, nkt, STEP_COLS], whether it is
    visited (``any_sel``) and partial (``part``), and the bitmap steps it needs (``need``,
    their count; None, None without a bitmap capacity)."""
    Hm, nq, nk = blocks.shape
    nqt, nkt = qx.org.shape[1], kx.org.shape[1]
    g = np.arange(abi.GRID, dtype=np.int32)
    qi = jnp.asarray(qx.first)[..., None] + g                 # [Hb, nqt, 4]: segment i's block
    kj = jnp.asarray(kx.first)[..., None] + g
    q_in = (qi <= jnp.asarray(qx.last)[..., None]) & jnp.asarray(qx.hi > qx.lo)[..., None]
    k_in = (kj <= jnp.asarray(kx.last)[..., None]) & jnp.asarray(kx.hi > kx.lo)[..., None]
    # Cells: only as many segments per axis as a tile can meet (static bounds: known now, e.g.
    # 2 x 1 for 64-token blocks on 128 x 64 tiles; the others are never inside a tile).
    gq, gk = (min(abi.GRID, max(1, int(np.max(z - a)) + 1)) if isinstance(a, np.ndarray)
              else abi.GRID for a, z in ((qx.first, qx.last), (kx.first, kx.last)))
    # Each tile pair's selected cells as bits (cell (a, b) at bit GRID * a + b), summed over
    # the gq x gk cells in one elementwise expression: XLA fuses the gathers into one kernel
    # with no [.., gq, gk] temporaries. All selected: every cell inside the tile set.
    # A row of a tile pair's cells is one gather: ``run`` holds each block's run of gk key
    # blocks as gk bits (bit c: key block k + c, clamped to the last), so traced bounds (4 x
    # 4 cells) gather 4 times a tile pair instead of 16.
    heads = jnp.arange(Hm)[:, None, None]
    run = sum(blocks[:, :, np.minimum(np.arange(nk) + c, nk - 1)].astype(jnp.uint8) << c
              for c in range(gk))                                       # [Hm, nq, nk]
    kmask = sum(k_in[..., c].astype(jnp.int32) << c for c in range(gk))   # [Hbk, nkt]
    k0 = jnp.minimum(kj[..., 0], nk - 1)[:, None, :]
    bits = ok_bits = 0
    for a in range(gq):
        qa = jnp.minimum(qi[..., a], nq - 1)[:, :, None]
        inside = jnp.where(q_in[:, :, None, a], kmask[:, None, :], 0)
        cells = run[heads, qa, k0].astype(jnp.int32) & inside
        bits = bits + (cells << (abi.GRID * a))
        ok_bits = ok_bits + (inside << (abi.GRID * a))
    any_sel = bits != 0                                          # [Hm, nqt, nkt]
    all_sel = bits == ok_bits
    full = (Hm, nqt, nkt)
    qcut = _cuts(qx.bounds, qi, q_in, qx.org, qx.lo, qx.hi, nq)
    kcut = _cuts(kx.bounds, kj, k_in, kx.org, kx.lo, kx.hi, nk)
    qlo_j, qhi_j = jnp.asarray(qx.lo, jnp.int32), jnp.asarray(qx.hi, jnp.int32)
    klo_j, khi_j = jnp.asarray(kx.lo, jnp.int32), jnp.asarray(kx.hi, jnp.int32)
    rect = abi.pack_rect(jnp.broadcast_to(qlo_j[:, :, None], full),
                         jnp.broadcast_to(qhi_j[:, :, None], full),
                         jnp.broadcast_to(klo_j[:, None, :], full),
                         jnp.broadcast_to(khi_j[:, None, :], full))
    cuts_a = (qcut[:, :, None, 0] | (qcut[:, :, None, 1] << 8) | (qcut[:, :, None, 2] << 16)
              | (kcut[:, None, :, 0] << 24))                    # [Hb, nqt, nkt]
    cuts_b = kcut[:, None, :, 1] | (kcut[:, None, :, 2] << 8)
    grid = ~all_sel                                              # plain where all selected
    cuts_a = jnp.where(grid, cuts_a, 0)
    cuts_b = jnp.where(grid, cuts_b | (bits << abi.GRID_BITS_SHIFT), 0)
    need = n_need = None
    if bitmap_capacity:
        steps = functools.partial(_bitmap_steps, blocks, qx, kx, tile_q=tile_q,
                                  tile_kv=tile_kv, capacity=bitmap_capacity)
        if _static(qx.first, qx.last, kx.first, kx.last):
            any_sel, need, n_need, cuts_a, cuts_b = steps(any_sel, cuts_a, cuts_b)
        else:
            # Traced bounds: the pass over every tile pair only where a tile meets more than
            # GRID blocks (cubes' and sliding tiles' per-head plans have none; CPU box, Wan
            # 480p cubes: 0.22 of the step rows' 0.45 s). Under vmap: skipped only where no
            # element has such a tile.
            fine = jnp.any(_fine(qx.first, qx.last)) | jnp.any(_fine(kx.first, kx.last))

            def none(any_sel, cuts_a, cuts_b):
                return (any_sel, jnp.zeros(full, bool), jnp.zeros((), jnp.int32), cuts_a,
                        cuts_b)

            any_sel, need, n_need, cuts_a, cuts_b = jax.lax.cond(
                ~batch_all(~fine), steps, none, any_sel, cuts_a, cuts_b)
    # A grid step whose selected cells form one rectangle is a plain step over that rectangle
    # (a plain partial step runs at ~0.84 of a full one against ~0.72 for a grid step on the
    # H200; Wan 480p VSA: 89% of the grid steps).
    one, (r0, r1, c0, c1) = _bits_rectangle(bits)
    conv = grid & one
    if bitmap_capacity:
        conv &= ~need
    seg_q = _segment_edges(qlo_j, qcut, qhi_j)[:, :, None]      # [Hb, nqt, 1, GRID + 1]
    seg_k = _segment_edges(klo_j, kcut, khi_j)[:, None, :]
    rect = jnp.where(conv, abi.pack_rect(_pick(seg_q, r0), _pick(seg_q, r1 + 1),
                                         _pick(seg_k, c0), _pick(seg_k, c1 + 1)), rect)
    cuts_a, cuts_b = jnp.where(conv, 0, cuts_a), jnp.where(conv, 0, cuts_b)
    kv_start = jnp.broadcast_to(jnp.asarray(kx.org, jnp.int32)[:, None, :], full)
    rows = jnp.stack([kv_start, rect, jnp.broadcast_to(cuts_a, full),
                      jnp.broadcast_to(cuts_b, full)], axis=-1)   # [Hm, nqt, nkt, STEP_COLS]
    full_rect = ((qlo_j == 0) & (qhi_j == tile_q))[:, :, None] & \
        ((klo_j == 0) & (khi_j == tile_kv))[:, None, :]
    part = any_sel & ~(all_sel & full_rect)
    if bitmap_capacity:
        part |= need
    return rows, any_sel, part, need, n_need


def _static(*xs) -> bool:
    """Whether every one of ``xs`` is a NumPy array (known when tracing)."""
    return all(isinstance(x, np.ndarray) for x in xs)


def _bitmap_steps(blocks, qx: _Axis, kx: _Axis, any_sel, cuts_a, cuts_b, *, tile_q, tile_kv,
                  capacity):
    """Tiles meeting more than ``abi.GRID`` blocks on an axis become bitmap steps (those not
    all selected: ``need``, slot s of them pointing at the words past the step rows):
    (any_sel, need, its count, cuts_a, cuts_b) updated."""
    Hm, nqt, nkt = any_sel.shape
    full, S = (Hm, nqt, nkt), Hm * nqt * nkt
    qa, qz, ka, kz = qx.first, qx.last, kx.first, kx.last
    fine = _fine(qa, qz)[:, :, None] | _fine(ka, kz)[:, None, :]      # [Hb, nqt, nkt]
    count = _block_counts(blocks, qa, qz, ka, kz)                     # [Hm, nqt, nkt]
    area = (jnp.asarray(qz) - qa + 1)[:, :, None] * (jnp.asarray(kz) - ka + 1)[:, None, :]
    own = jnp.asarray(qx.hi > qx.lo)[:, :, None] & jnp.asarray(kx.hi > kx.lo)[:, None, :]
    any_sel = jnp.where(fine, (count > 0) & own, any_sel)
    need = fine & any_sel & (count < area)                         # not all selected
    need = jnp.broadcast_to(need, full)
    n_need = need.sum(dtype=jnp.int32)
    rows_b = abi.bitmap_rows(tile_q, tile_kv)
    slot = jnp.minimum(jnp.cumsum(need.reshape(-1), dtype=jnp.int32) - 1,
                       capacity - 1).reshape(full)
    cuts_a = jnp.where(need, (S + slot * rows_b) * abi.STEP_COLS, cuts_a)
    cuts_b = jnp.where(need, abi.BITMAP_FLAG, cuts_b)
    return any_sel, need, n_need, cuts_a, cuts_b


def _compact(rows, any_sel, extra_rows: int = 0):
    """The visited tiles' step rows of each (head, query tile), in key order: steps
    [Hm * nqt * nkt + extra_rows, STEP_COLS] (``extra_rows``: room for the bitmap words), and
    each (head, q tile)'s first step and count [Hm, nqt]. Rows past the used ones are left
    unwritten (``lax.empty``: zeros on CPU, uninitialised on a GPU, where zeroing the room
    cost 83 us of clusters' 0.6 ms plan at Wan 480p): units point at their own rows and
    bitmap steps at their own words, so no reader visits them."""
    S = rows.shape[0] * rows.shape[1] * rows.shape[2]
    cnt = any_sel.sum(axis=-1, dtype=jnp.int32)                  # [Hm, nqt]
    ptr = (jnp.cumsum(cnt.reshape(-1)) - cnt.reshape(-1)).reshape(cnt.shape)
    slot = ptr[..., None] + jnp.cumsum(any_sel, axis=-1, dtype=jnp.int32) - 1
    # Unvisited rows go past the end (dropped), each to its own index: with unique indices
    # the scatter stores without atomics.
    past = S + extra_rows + jnp.arange(S, dtype=jnp.int32).reshape(any_sel.shape)
    dest = jnp.where(any_sel, slot, past).reshape(-1)
    steps = jax.lax.empty((S + extra_rows, abi.STEP_COLS), jnp.int32).at[dest].set(
        rows.reshape(-1, abi.STEP_COLS), mode="drop", unique_indices=True)
    return steps, ptr, cnt


def _units(qx: _Axis, ptr, cnt, part, num_q_heads, Hm, tile_q, tile_kv):
    """The units [Hq * nqt, UNIT_COLS], heaviest first."""
    nqt = qx.org.shape[1]
    hm = np.zeros(num_q_heads, np.int32) if Hm == 1 else np.arange(num_q_heads, dtype=np.int32)
    hq = hm if qx.org.shape[0] > 1 else np.zeros(num_q_heads, np.int32)   # bounds row per head
    qlo_j, qhi_j = jnp.asarray(qx.lo, jnp.int32), jnp.asarray(qx.hi, jnp.int32)
    units = jnp.stack([
        jnp.asarray(np.repeat(np.arange(num_q_heads, dtype=np.int32), nqt)),
        jnp.asarray(qx.org, jnp.int32)[hq].reshape(-1),
        qlo_j[hq].reshape(-1), qhi_j[hq].reshape(-1),
        ptr[hm].reshape(-1), cnt[hm].reshape(-1)], axis=1)
    # Heaviest units first, as the host planner's head-major order (schedule.order_units):
    # in head / position order each head's costliest units (several small query blocks in one
    # tile) came last and the last head's formed the kernel's tail, and q64x2 pairs
    # neighbouring units, which then differ in cost (Wan 480p VSA: ~10% of the kernel).
    npart = part.sum(axis=-1, dtype=jnp.int32)[hm].reshape(-1)
    return units[_heavy_first(units, npart, tile_q, tile_kv, part.shape[-1], num_q_heads,
                              Hm == 1)]


def _fits(qx: _Axis, kx: _Axis, n_need, bitmap_capacity, nq, nk, q_len, kv_len):
    """Whether the mask fits the plan: its bitmap steps within the capacity (or, without
    one, every tile meeting at most ``abi.GRID`` blocks per axis) and device bounds valid."""
    if bitmap_capacity:
        ok = n_need <= bitmap_capacity
    else:
        ok = ((jnp.asarray(qx.last) - qx.first + 1).max() <= abi.GRID) & \
            ((jnp.asarray(kx.last) - kx.first + 1).max() <= abi.GRID)
    for b, n, length in ((qx.bounds, nq, q_len), (kx.bounds, nk, kv_len)):
        if not isinstance(b, np.ndarray):
            ok &= (jnp.all(b[:, 0] == 0) & jnp.all(b[:, n] == length)
                   & jnp.all(b[:, 1:] > b[:, :-1]))
    return ok


def _bits_rectangle(bits):
    """Whether the selected cells of each tile (``bits``: cell (i, j) at bit GRID * i + j)
    form one rectangle, and its first / last row and column segments; elementwise integer
    ops only, so XLA fuses them over the [Hm, nqt, nkt] tiles (no [.., gq, gk] temporaries)."""
    nib = [(bits >> (abi.GRID * i)) & ((1 << abi.GRID) - 1) for i in range(abi.GRID)]
    cols = functools.reduce(jnp.bitwise_or, nib)
    rows = sum((x != 0).astype(jnp.int32) << i for i, x in enumerate(nib))
    same = functools.reduce(jnp.logical_and, [(x == 0) | (x == cols) for x in nib])

    def run(x):     # x != 0 and its set bits consecutive
        return (x != 0) & (((x + (x & -x)) & x) == 0)

    def first(x):
        return jax.lax.population_count((x & -x) - 1)

    def last(x):
        return 31 - jax.lax.clz(x)

    return same & run(rows) & run(cols), (first(rows), last(rows), first(cols), last(cols))


def _segment_edges(lo, cut, hi):
    """[.., GRID + 1]: a tile's segment edges, its own range's start, the cuts and its end
    (``lo`` / ``hi`` may have one bounds row for several of ``cut``'s)."""
    shape = cut.shape[:-1]
    return jnp.concatenate([jnp.broadcast_to(lo, shape)[..., None], cut,
                            jnp.broadcast_to(hi, shape)[..., None]], axis=-1)


def _pick(seg, i):
    """``seg[..., i]`` for a small last axis, as a select chain (fuses; no gather)."""
    out = seg[..., 0]
    for t in range(1, seg.shape[-1]):
        out = jnp.where(i == t, seg[..., t], out)
    return out


def _heavy_first(units, partial, tile_q: int, tile_kv: int, max_steps: int,
                 num_q_heads: int = 1, shared: bool = False):
    """The permutation of ``schedule.order_units(..., "head_major")`` for device units (in
    head, position order): cost class (eight per octave of the cost model's unit time, at head
    dim 128) descending, then query head, then position. ``partial``: each unit's masked
    steps, at most ``max_steps`` steps a unit; ``shared``: each of the ``num_q_heads`` heads'
    units cost the same (one mask head), so one head's are counted.

    A counting sort over the classes' static range, not a sort (XLA's sort of the units took
    8 kernels, ~50 us of a ~85 us shared plan; H100, Wan 480p): a unit's place is the units of
    heavier classes plus those of its class before it, a prefix count along the units of a
    one-hot [classes, units] (rows along the minor axis: a column-wise count over per-head
    blocks took 19 us)."""
    m = schedule.DEFAULT_COST_MODEL
    step = m.step_ns_total(tile_q, tile_kv, 128, 2)
    cost = m.unit_ns + units[:, abi.UNIT_STEP_CNT] * step + partial * m.mask_ns
    cls = jnp.floor(jnp.log2(jnp.maximum(cost, 1.0)) * 8).astype(jnp.int32)
    # The classes a unit can have; one spare class each side covers float32 rounding.
    lo = int(np.floor(np.log2(max(m.unit_ns, 1.0)) * 8)) - 1
    hi = int(np.floor(np.log2(max(m.unit_ns + max_steps * (step + m.mask_ns), 1.0)) * 8)) + 1
    C, U = hi - lo + 1, units.shape[0]
    key = jnp.clip(hi - cls, 0, C - 1)                               # 0: the heaviest class
    n = U // num_q_heads if shared else U
    onehot = (jnp.arange(C, dtype=jnp.int32)[:, None] == key[None, :n]).astype(jnp.int32)
    before = jnp.cumsum(onehot, axis=1) - onehot                     # [C, n]
    hist = onehot.sum(axis=1)
    if shared:
        # Head h's unit j: the heavier classes' units of every head, then h heads' units of
        # its class, then its own head's before it.
        heavier = (jnp.cumsum(hist) - hist) * num_q_heads
        own = ((before + heavier[:, None]) * onehot).sum(axis=0)     # [n]
        per_head = (hist[:, None] * onehot).sum(axis=0)
        h = jnp.arange(num_q_heads, dtype=jnp.int32)[:, None]
        pos = (h * per_head[None] + own[None]).reshape(-1)
    else:
        pos = ((before + (jnp.cumsum(hist) - hist)[:, None]) * onehot).sum(axis=0)
    return jnp.zeros(U, jnp.int32).at[pos].set(jnp.arange(U, dtype=jnp.int32),
                                                unique_indices=True)


def check(ok) -> None:
    """A ``checkify`` check of ``plan_on_device``'s ``ok``: the mask fitted the device planner
    (run the caller under ``jax.experimental.checkify.checkify`` to surface it; a no-op
    otherwise)."""
    from jax.experimental import checkify

    checkify.check(ok, f"device plan: a tile meets more than {abi.GRID} blocks per axis, "
                   "or the bounds do not increase from 0 to the length")
