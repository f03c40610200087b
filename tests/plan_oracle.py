"""NumPy oracles of the planner's compiled step builders (tests only; never called by a plan).

``_plan_rowgroups_numpy`` (keep / merge), ``_plan_grid_numpy`` (split) and
``_plan_pack_numpy`` (pack) build the same ``_Raw`` arrays as ``planner._plan_rowgroups``,
``_plan_grid`` and ``_plan_pack`` in vectorised NumPy, from set-bit positions and runs of the
packed mask words instead of the compiled loops of ``plan_loops``: an independent second
implementation that the tests compare the compiled one with, array for array.

Tiles once: each policy cuts the selected set into *pieces* (one rectangle in one K/V tile),
a unit's pieces in key order (the rectangles of one key segment tile by tile), and
``tiles_once`` (the specification, in plain Python over sets of bounds and explicit cell
matrices, independent of the compiled bit arithmetic of ``plan_loops._nb_acc_*``) joins the
consecutive pieces of one tile greedily into grid steps. Where a tile's pieces need more than
a 4 x 4 grid, that leaves several steps of one tile; ``bitmap_steps`` (the specification of
``planner._bitmap_steps``, over boolean [tile_q, tile_kv] matrices from ``abi.step_mask``,
independent of the compiled word arithmetic of ``plan_loops._nb_bm_*``) makes them one step:
plain, grid or bitmap (``tiles_once(..., tile=(tq, tk))`` runs both stages). ``coverage``
evaluates a plan's steps with ``abi.step_mask``, the rule every kernel implements.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels import abi

from tessera_jax.planning import vectorised
from tessera_jax.planning.planner import _U64, _chunk, _Ctx, _empty_raw, _Raw, bucket

_CHUNK = 1 << 16        # step rows expanded at a time (about 1.3 MB, cache-sized)
_WORD_CHUNK = 1 << 14   # words unpacked at a time (1 MB of bytes)


# --- bit helpers: set-bit positions and runs of packed words ---------------------------
def _set_bits(words: np.ndarray, dtype=np.int64):
    """(bits per row, bit positions) of the set bits of ``words`` [R, W], in (row, bit) order.

    Only the non-zero words are unpacked (one byte per bit), a cache-sized chunk at a time,
    and each position is written once: the work grows with the non-zero words and the set
    bits, with no pass per bit rank and no large int64 temporaries.
    """
    R, W = words.shape
    flat = words.reshape(-1)
    nzw = np.flatnonzero(flat)
    vals = flat[nzw]
    cw = np.bitwise_count(vals)                 # set bits per non-zero word
    rw = nzw // W
    off = (nzw - rw * W) * 64                   # first bit of each non-zero word in its row
    ends = np.cumsum(cw, dtype=np.int64)
    pos = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
    for a in range(0, len(nzw), _WORD_CHUNK):
        b = min(a + _WORD_CHUNK, len(nzw))
        bits = np.unpackbits(vals[a:b].view(np.uint8), bitorder="little").view(np.bool_)
        p = np.repeat(off[a:b] - 64 * np.arange(b - a), cw[a:b])
        p += np.flatnonzero(bits)
        pos[int(ends[a] - cw[a]): int(ends[b - 1])] = p
    per_row = np.bincount(rw, weights=cw, minlength=R).astype(np.int64)
    return per_row, pos


def _bit_positions(words: np.ndarray):
    """(row, bit) of every set bit of ``words`` [R, W], sorted by (row, bit)."""
    per_row, pos = _set_bits(words)
    return np.repeat(np.arange(len(per_row)), per_row), pos


def _runs(words: np.ndarray, nbits: int | None = None):
    """(row, first, end) of each run of set bits of ``words`` [R, W] (end exclusive)."""
    per_row, first, end = _run_bounds(words, nbits)
    return np.repeat(np.arange(len(per_row)), per_row), first, end


def _run_bounds(words: np.ndarray, nbits: int | None = None):
    """(runs per row, first, end) of the runs of set bits of ``words`` [R, W], in row order
    (int32 positions).

    Run boundaries (first bits and exclusive ends) are the bits that differ from the bit
    before them: ``w ^ (w << 1)`` with the carry from the previous word. Rows are processed
    as one flat word array: bits at or past ``nbits`` (default 64 W) must be zero, so a row's
    last word carries 0 into the next row and a run can end at bit ``nbits`` only if
    ``nbits < 64 W``; otherwise a spare zero word is appended.
    """
    R, W = words.shape
    if nbits is None or nbits >= 64 * W:
        w = np.zeros((R, W + 1), _U64)
        w[:, :W] = words
        words, W = w, W + 1
    f = words.reshape(-1)
    both = f << np.uint64(1)
    if f.size:
        both[1:] |= f[:-1] >> np.uint64(63)
    both ^= f
    per_row, pos = _set_bits(both.reshape(R, W), np.int32)   # start, end, start, end, ...
    return per_row >> 1, pos[0::2], pos[1::2]


# --- the step builders -------------------------------------------------------------------
def _row_groups(ctx: _Ctx, merge: bool):
    """(head, first q block, end q block) of each non-empty row group."""
    w = ctx.words
    Hm, nq, W = w.shape
    # "any word differs" per row: the per-word booleans padded to whole 8-byte words and
    # or-ed as uint64 (a short last-axis reduction is slow in NumPy)
    x = np.zeros((Hm, nq, -(-W // 8) * 8), bool)
    y = x.view(np.uint64)

    def any_set() -> np.ndarray:
        acc = y[..., 0].copy()
        for j in range(1, y.shape[-1]):
            acc |= y[..., j]
        return acc != 0

    np.not_equal(w, 0, out=x[..., :W])
    nonempty = any_set()
    new = np.ones((Hm, nq), bool)
    if merge and nq > 1:
        x[:, 0] = False
        np.not_equal(w[:, 1:], w[:, :-1], out=x[:, 1:, :W])
        new[:, 1:] = any_set()[:, 1:]
    gh, gi = np.nonzero(new)
    flat = gh * nq + gi
    end_flat = np.append(flat[1:], Hm * nq)
    ge = np.minimum(end_flat - gh * nq, nq)  # a group ends at the next start or its head's end
    keep = nonempty[gh, gi]
    return gh[keep], gi[keep], ge[keep]


PIECES: list | None = None   # a list: the oracles append their pieces to it (``pieces``)


def pieces(fn, ctx: _Ctx, *args):
    """The pieces an oracle cuts (before ``tiles_once``): a dict of int64 arrays ``unit``,
    ``kv``, ``ql``, ``qh``, ``kl``, ``kh`` in emission order (units as in the oracle's raw)."""
    global PIECES
    PIECES = []
    try:
        fn(ctx, *args)
        got = PIECES
    finally:
        PIECES = None
    if not got:
        z = np.zeros(0, np.int64)
        return dict(unit=z, kv=z, ql=z, qh=z, kl=z, kh=z)
    return dict(zip(("unit", "kv", "ql", "qh", "kl", "kh"),
                    (np.asarray(x, np.int64) for x in got[0])))


def _raw_from_columns(ctx: _Ctx, head, qs, lo, hi, cnt, kvs, ql, qh, kl, kh,
                      order=None) -> _Raw:
    """A _Raw from per-piece columns (split / pack): ``order`` (per piece, within a unit)
    sorts each unit's pieces stably first (tile by tile inside a key segment), then
    ``tiles_once`` joins them into steps; full steps and areas per unit."""
    cnt = np.asarray(cnt, np.int64)
    unit = np.repeat(np.arange(len(cnt)), cnt)
    area = np.bincount(unit, weights=(qh - ql).astype(np.int64) * (kh - kl),
                       minlength=len(cnt)).astype(np.int64)
    if order is not None and len(unit):
        srt = np.lexsort((order, unit))
        kvs, ql, qh, kl, kh = (np.asarray(x)[srt] for x in (kvs, ql, qh, kl, kh))
    if PIECES is not None:
        PIECES.append((unit, kvs, ql, qh, kl, kh))
    rows, cnt = tiles_once(unit, kvs, ql, qh, kl, kh)
    S = len(rows)
    steps = np.zeros((bucket(S), abi.STEP_COLS), np.int32)
    if S:
        steps[:S] = rows
    first = np.cumsum(cnt) - cnt
    if len(first) and S:
        full = ((steps[:S, abi.STEP_RECT] == abi.full_rect(ctx.tile_q, ctx.tile_kv))
                & (steps[:S, abi.STEP_CUTS_B] == 0))
        nfull = np.add.reduceat(full.astype(np.int64), first)
        nfull[cnt == 0] = 0
    else:
        nfull = np.zeros(len(cnt), np.int64)
    return _Raw(head, qs, lo, hi, cnt, steps, nfull, area)


# --- tiles once: the specification -------------------------------------------------------
def _grid_of(rects):
    """The normalised grid of disjoint rectangles (q0, q1, k0, k1): (row bounds, key bounds,
    cells [rows][keys] selected), with no cut between two equal rows or columns of cells."""
    R = sorted({v for r in rects for v in r[:2]})
    K = sorted({v for r in rects for v in r[2:]})
    cells = [[any(r[0] <= R[i] < r[1] and r[2] <= K[j] < r[3] for r in rects)
              for j in range(len(K) - 1)] for i in range(len(R) - 1)]
    j = 1
    while j < len(K) - 1:                      # a key cut between two equal columns
        if all(row[j - 1] == row[j] for row in cells):
            del K[j]
            for row in cells:
                del row[j]
        else:
            j += 1
    i = 1
    while i < len(R) - 1:                      # a row cut between two equal rows
        if cells[i - 1] == cells[i]:
            del R[i]
            del cells[i]
        else:
            i += 1
    return R, K, cells


def _step_row(kv, rects):
    """The ABI step row (kv_start, rect, cuts_a, cuts_b) of the grid of ``rects``."""
    R, K, cells = _grid_of(rects)
    rect = int(abi.pack_rect(R[0], R[-1], K[0], K[-1]))
    if len(R) == 2 and len(K) == 2:
        return (kv, rect, 0, 0)
    qc = (R[1:-1] + [R[-1]] * 3)[:3]
    kc = (K[1:-1] + [K[-1]] * 3)[:3]
    bits = sum(1 << (abi.GRID * i + j) for i, row in enumerate(cells)
               for j, on in enumerate(row) if on)
    ca, cb = abi.pack_grid(qc, kc, bits)
    return (kv, rect, int(ca), int(cb))


def tiles_once(unit, kv, ql, qh, kl, kh, tile=None):
    """The tiles-once specification: pieces (rows [ql, qh) x keys [kl, kh) of the K/V tile at
    kv, in the order the policies emit them) become steps. A piece joins the step being built
    if it is in the same unit and tile and the union still fits a GRID x GRID grid: the
    distinct row bounds of the step's normalised grid (``_grid_of``) and the piece's at most 5,
    and the key bounds likewise; else the step is done and the piece starts the next.
    Returns (step rows int32 [S, STEP_COLS], steps per unit). With ``tile`` = (tile_q,
    tile_kv), the second stage too (``bitmap_steps``: one step per (unit, tile)): returns
    (steps int32 [bucket(rows), STEP_COLS] with the bitmap words after the step rows, steps
    per unit, step rows)."""
    U = int(unit.max()) + 1 if len(unit) else 0
    cnt = np.zeros(U, np.int64)
    rows = []
    cur = None                                 # [unit, kv, rects, R, K]
    for u, v, a, b, c, d in zip(*(np.asarray(x).tolist() for x in (unit, kv, ql, qh, kl,
                                                                      kh))):
        if cur is not None and cur[0] == u and cur[1] == v:
            if (len(set(cur[3]) | {a, b}) <= 5 and len(set(cur[4]) | {c, d}) <= 5):
                cur[2].append((a, b, c, d))
                cur[3], cur[4], _ = _grid_of(cur[2])
                continue
        if cur is not None:
            rows.append(_step_row(cur[1], cur[2]))
            cnt[cur[0]] += 1
        cur = [u, v, [(a, b, c, d)], [a, b], [c, d]]
    if cur is not None:
        rows.append(_step_row(cur[1], cur[2]))
        cnt[cur[0]] += 1
    out = np.array(rows, np.int64).reshape(-1, abi.STEP_COLS).astype(np.int32)
    if tile is None:
        return out, cnt
    first = np.cumsum(cnt) - cnt
    got = bitmap_steps(out if len(out) else np.zeros((1, abi.STEP_COLS), np.int32), first, cnt,
                       *tile)
    if got is None:
        return out, cnt, len(out)
    steps, _, new_cnt, S, _ = got
    return steps, new_cnt, S


def _canonical_step(kv, sel):
    """The step row of the non-empty selection ``sel`` (bool [tile_q, tile_kv]) of the tile at
    kv, and its words (None unless a bitmap step): its bounding box; a cut before each row
    (column) of the box unlike the one before it; plain if there is none, a grid of the cells'
    values if at most GRID - 1 per axis, else a bitmap step (offset left 0)."""
    rows, cols = np.flatnonzero(sel.any(1)), np.flatnonzero(sel.any(0))
    q_lo, q_hi, k_lo, k_hi = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    rect = int(abi.pack_rect(q_lo, q_hi, k_lo, k_hi))
    rc = [r for r in range(q_lo + 1, q_hi) if (sel[r] != sel[r - 1]).any()]
    kc = [c for c in range(k_lo + 1, k_hi) if (sel[:, c] != sel[:, c - 1]).any()]
    if not rc and not kc:
        assert sel[q_lo:q_hi, k_lo:k_hi].all() and sel.sum() == (q_hi - q_lo) * (k_hi - k_lo)
        return (kv, rect, 0, 0), None
    if len(rc) < abi.GRID and len(kc) < abi.GRID:
        R, K = [q_lo] + rc, [k_lo] + kc
        bits = sum(1 << (abi.GRID * i + j) for i, r in enumerate(R) for j, c in enumerate(K)
                   if sel[r, c])
        ca, cb = abi.pack_grid((rc + [q_hi] * 3)[:3], (kc + [k_hi] * 3)[:3], bits)
        return (kv, rect, int(ca), int(cb)), None
    return (kv, rect, 0, abi.BITMAP_FLAG), abi.pack_bitmap(sel)


def bitmap_steps(steps, first, cnt, tile_q, tile_kv):
    """The specification of ``planner._bitmap_steps`` on step ranges [first, first + cnt) of
    ``steps`` (units may share a range): None if no unit visits a K/V tile twice; else each
    distinct range (in (first, cnt) order) rewritten after the one before: copied if it visits
    each tile once, else the steps of each tile (in a stable sort by kv_start) replaced, where
    there are several, by one step selecting their union (``abi.step_mask``), in its canonical
    form (``_canonical_step``); bitmap words after the step rows, ``abi.bitmap_rows`` rows
    each, in the order of their steps. Returns (steps [bucket(rows), STEP_COLS], ptr, cnt per
    unit, step rows, word rows)."""
    steps = np.asarray(steps)
    first, cnt = np.asarray(first, np.int64), np.asarray(cnt, np.int64)
    kvs = steps[:, abi.STEP_KV_START]
    if not any(len(set(kvs[f:f + c].tolist())) < c for f, c in zip(first, cnt)):
        return None
    ranges = sorted({(int(f), int(c)) for f, c in zip(first, cnt) if c > 0})
    rows, words, at = [], [], {}
    for f, c in ranges:
        at[f, c] = len(rows)
        idx = f + np.argsort(kvs[f:f + c], kind="stable")
        if len(set(kvs[f:f + c].tolist())) == c:
            rows += [tuple(int(x) for x in steps[i]) for i in range(f, f + c)]
            continue
        for kv in sorted(set(kvs[f:f + c].tolist())):
            mine = idx[kvs[idx] == kv]
            if len(mine) == 1:
                rows.append(tuple(int(x) for x in steps[mine[0]]))
                continue
            sel = abi.step_mask(steps, mine, tile_q, tile_kv)
            assert sel.sum() == sel.any(0).sum(), "the steps of a tile overlap"
            row, w = _canonical_step(int(kv), sel.any(0))
            if w is not None:
                row = row[:2] + (len(words), abi.BITMAP_FLAG)     # the k-th bitmap: fixed below
                words.append(w)
            rows.append(row)
    S = len(rows)
    wr = abi.bitmap_rows(tile_q, tile_kv)
    out = np.zeros((bucket(S + wr * len(words)), abi.STEP_COLS), np.int32)
    flat = out.reshape(-1)
    for s, row in enumerate(rows):
        if row[3] == abi.BITMAP_FLAG:
            k = row[2]
            row = row[:2] + ((S + k * wr) * abi.STEP_COLS, abi.BITMAP_FLAG)
            flat[row[2]: row[2] + len(words[k])] = words[k]
        out[s] = np.array(row, np.int64).astype(np.int32)
    ptr = np.array([at[f, c] if c > 0 else 0 for f, c in zip(first.tolist(), cnt.tolist())],
                   np.int64)
    ncnt = np.array([len(set(kvs[f:f + c].tolist())) for f, c in zip(first.tolist(),
                                                                      cnt.tolist())], np.int64)
    return out, ptr, ncnt, S, wr * len(words)


def check_exact_cover(plan) -> None:
    """AssertionError unless the plan's steps (their ``abi.step_mask`` selections, as
    ``Plan.tile_cells``: plain, grid and bitmap steps) select every selected (head, query,
    key) of its mask exactly once and nothing else, and no unit visits a K/V tile twice
    (tiles once); for masks too large for ``coverage``: per head, on the grid compressed to
    the block bounds and the cells' bounds (each compressed cell lies in one logical block and
    is selected uniformly by every step cell). The plan also passes ``abi.check_plan``."""
    mask = plan.mask
    Hq = plan.shape.num_q_heads
    blocks = mask.head_blocks(Hq)
    abi.check_plan(plan.units, plan.steps, plan.tile_q, plan.tile_kv, plan.q_len_padded,
                   plan.kv_len_padded, num_q_heads=Hq, max_steps=plan.max_steps)
    c = plan.tile_cells()
    # every visit selects something (its cells are abi.selected_cells of its step)
    t = plan.tile_rects()
    assert len(c["visit"]) == 0 or (np.bincount(c["visit"], minlength=len(t["r0"])) > 0).all()
    key = t["unit"] * (plan.kv_len_padded + 1) + t["k0"]
    assert len(np.unique(key)) == len(key), "a unit visits a K/V tile twice"
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    for h in range(Hq):
        on = c["head"] == h
        r0, r1, c0, c1 = (c[k][on] for k in ("r0", "r1", "c0", "c1"))
        assert (r0 >= 0).all() and (r1 <= mask.Lq).all() and (c0 >= 0).all()
        assert (c1 <= mask.Lkv).all(), "a step selects padding"
        R = np.unique(np.r_[qb, r0, r1])
        K = np.unique(np.r_[kb, c0, c1])
        d = np.zeros((len(R) + 1, len(K) + 1), np.int32)
        a, b = np.searchsorted(R, r0), np.searchsorted(R, r1)
        e, f = np.searchsorted(K, c0), np.searchsorted(K, c1)
        np.add.at(d, (a, e), 1)
        np.add.at(d, (a, f), -1)
        np.add.at(d, (b, e), -1)
        np.add.at(d, (b, f), 1)
        cov = d.cumsum(0).cumsum(1)[: len(R) - 1, : len(K) - 1]
        bq = np.searchsorted(qb, R[:-1], side="right") - 1
        bk = np.searchsorted(kb, K[:-1], side="right") - 1
        want = blocks[h][np.ix_(bq, bk)]
        assert (cov == want).all(), f"head {h}: {(cov != want).sum()} compressed cells differ"


def coverage(plan) -> np.ndarray:
    """How many steps select each (head, query, key): int [Hq, Lq, Lkv], every visited step
    evaluated with ``abi.step_mask`` on its whole tile (AssertionError if a step selects an
    entry outside [0, Lq) x [0, Lkv))."""
    Hq, Lq, Lkv = plan.shape.num_q_heads, plan.shape.q_len, plan.shape.kv_len
    tq, tk = plan.tile_q, plan.tile_kv
    cov = np.zeros((Hq, plan.q_len_padded, plan.kv_len_padded), np.int64)
    u = plan.units[: plan.num_units].astype(np.int64)
    for h, q0, _, _, ptr, n in u:
        st = plan.steps[ptr: ptr + n].astype(np.int64)
        sel = abi.step_mask(plan.steps, np.arange(ptr, ptr + n), tq, tk)
        for k0, m in zip(st[:, abi.STEP_KV_START], sel):
            cov[h, q0: q0 + tq, k0: k0 + tk] += m
    assert not cov[:, Lq:].any() and not cov[:, :, Lkv:].any(), "a step selects padding"
    return cov[:, :Lq, :Lkv]


def _plan_rowgroups_numpy(ctx: _Ctx, merge: bool) -> _Raw:
    """keep / merge in vectorised NumPy: the test oracle of ``planner._plan_rowgroups``.

    One row group per unit, the group's K/V tiles anchored at interval starts.

    Built from per-interval values (int32): unit costs and areas from interval sums per group,
    and the step rows in cache-sized chunks of units, where each (unit, key interval) pair
    contributes one template row that ``np.repeat`` expands into the interval's tiles; the K/V
    starts then advance by one tile per row, the first, last and shifted tiles are patched, and
    the chunk (in the unpacked view of ``plan_abi.unpack_steps``) is packed into ``steps``.
    """
    tq, tk, al, kvp = ctx.tile_q, ctx.tile_kv, ctx.kv_align, ctx.kvp
    gh, gi, ge = _row_groups(ctx, merge)
    G = len(gh)
    if G == 0:
        return _empty_raw()
    gw = ctx.words[gh, gi]
    kb = ctx.kb.astype(np.int32)                      # bounds are checked to fit int32
    if merge:
        n_int, js, je = _run_bounds(gw, len(kb) - 1)
        ks, ke = kb[js], kb[je]
    else:
        ig, js = _bit_positions(gw)
        ks, ke = kb[js], kb[js + 1]
        n_int = np.bincount(ig, minlength=G)
    # Per interval: tiles of tk from a0 (aligned); the last may be shifted back inside kvp.
    if al == 1:
        a0 = ks
    elif al & (al - 1) == 0:
        a0 = ks & np.int32(-al)
    else:
        a0 = ks - ks % np.int32(al)
    n = ke - a0
    n += tk - 1
    if tk & (tk - 1) == 0:
        n >>= tk.bit_length() - 1
    else:
        n //= tk
    tl = n - 1                                        # last tile's start before the shift
    tl *= tk
    tl += a0
    kl0 = ks - a0                                     # first tile's lo
    khl = ke - tl                                     # last tile's hi
    part = (kl0 != 0).astype(np.int32)                # partial tiles per interval
    part += khl != tk
    part -= (part == 2) & (n == 1)                    # a single tile counts once
    sh = np.flatnonzero(tl > kvp - tk)                # tiles shifted back inside kvp
    shift = tl[sh] + (tk - kvp)
    if sh.size:
        one = n[sh] == 1
        kl0[sh[one]] += shift[one]
        khl[sh] += shift
        part[sh] = np.where(one, 1, (kl0[sh] != 0) + 1)
    # Per group: intervals, tiles, full tiles, selected keys.
    i_first = np.cumsum(n_int) - n_int
    g_n = np.add.reduceat(n, i_first, dtype=np.int32).astype(np.int64)
    g_full = g_n - np.add.reduceat(part, i_first, dtype=np.int32)
    ke -= ks
    g_keys = np.add.reduceat(ke, i_first, dtype=np.int32).astype(np.int64)
    ug, qs, qlo, qhi = _chunk(ctx.qb[gi], ctx.qb[ge], tq, ctx.q_align, ctx.qp)
    U = len(ug)
    cnt = g_n[ug]
    nfull = np.where((qlo == 0) & (qhi == tq), g_full[ug], 0)
    area = (qhi - qlo) * g_keys[ug]
    S = int(cnt.sum())
    # Instances: (unit, interval of the unit's group), in unit order, expanded in chunks of
    # whole units (about _CHUNK steps each) so that every pass below runs in cache.
    m = n_int[ug]
    u_inst = np.concatenate([[0], np.cumsum(m)])
    u_step = np.concatenate([[0], np.cumsum(cnt)])
    cuts = np.unique(np.searchsorted(u_step, np.arange(0, S, _CHUNK), side="right") - 1)
    cuts = np.append(cuts, U).tolist()
    qlo32, qhi32 = qlo.astype(np.int32), qhi.astype(np.int32)
    # Mostly single-tile intervals: the template is the exact single tile (lo and hi), and the
    # rows of longer intervals are fixed; otherwise the template is a middle tile and the
    # first (lo, where late) and last (hi) tiles are patched.
    single = 2 * (S - int(u_inst[-1])) < int(u_inst[-1])
    late = None if single else kl0 != 0               # first tiles that start late
    shifted = None
    if sh.size:
        shifted = np.zeros(len(ks), bool)
        shifted[sh] = True
        shift_at = np.zeros(len(ks), np.int32)
        shift_at[sh] = shift
    steps = np.zeros((bucket(S), abi.STEP_COLS), np.int32)
    for u0, u1 in zip(cuts[:-1], cuts[1:]):
        i0, i1 = int(u_inst[u0]), int(u_inst[u1])
        s0, s1 = int(u_step[u0]), int(u_step[u1])
        mm = m[u0:u1]
        if U == G:
            iv = slice(i0, i1)
        else:
            iv = np.repeat(i_first[ug[u0:u1]] - (np.cumsum(mm) - mm), mm)
            iv += np.arange(i1 - i0)
        nn = n[iv]
        fc = np.cumsum(nn, dtype=np.int32)
        fc -= nn                                      # first row of each instance (chunk)
        # kv_start = a0 + (row - fc) * tk: the template holds a0 - fc * tk, then every row
        # gets row * tk added after the repeat.
        tm = np.empty((i1 - i0, abi.VIEW_COLS), np.int32)
        col = np.multiply(fc, tk, out=tm[:, abi.VIEW_KV_START])
        np.subtract(a0[iv], col, out=col)
        tm[:, abi.VIEW_Q_LO] = np.repeat(qlo32[u0:u1], mm)
        tm[:, abi.VIEW_Q_HI] = np.repeat(qhi32[u0:u1], mm)
        if single:
            tm[:, abi.VIEW_KV_LO] = kl0[iv]
            tm[:, abi.VIEW_KV_HI] = khl[iv]
        else:
            tm[:, abi.VIEW_KV_LO] = 0
            tm[:, abi.VIEW_KV_HI] = tk
        t = np.repeat(tm, nn, axis=0)
        t[:, abi.VIEW_KV_START] += np.arange(0, (s1 - s0) * tk, tk, dtype=np.int32)
        lc = fc + nn
        lc -= 1                                       # last row of each instance
        if single:
            mi = np.flatnonzero(nn > 1)
            if mi.size:
                c = nn[mi] - 1
                r = np.repeat(fc[mi] - (np.cumsum(c) - c), c)
                r += np.arange(len(r))
                t[r, abi.VIEW_KV_HI] = tk             # not last
                t[r + 1, abi.VIEW_KV_LO] = 0          # not first
        else:
            t[lc, abi.VIEW_KV_HI] = khl[iv]
            k = np.flatnonzero(late[iv])
            t[fc[k], abi.VIEW_KV_LO] = kl0[k + i0 if U == G else iv[k]]
        if shifted is not None:                       # last tiles shifted back inside kvp
            k = np.flatnonzero(shifted[iv])
            if k.size:
                sc = shift_at[k + i0 if U == G else iv[k]]
                t[lc[k], abi.VIEW_KV_START] -= sc
                more = nn[k] > 1                      # a single tile has the shift in its lo
                t[lc[k[more]], abi.VIEW_KV_LO] = sc[more]
        steps[s0:s1, abi.STEP_KV_START] = t[:, abi.VIEW_KV_START]
        steps[s0:s1, abi.STEP_RECT] = abi.pack_rect(*t[:, abi.VIEW_Q_LO:].T)
    # Tiles once: the pieces come in non-decreasing kv_start; join those of one tile.
    q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(steps[:S, abi.STEP_RECT].astype(np.int64))
    raw = _raw_from_columns(ctx, gh[ug], qs, qlo, qhi, cnt, steps[:S, abi.STEP_KV_START],
                            q_lo, q_hi, kv_lo, kv_hi)
    np.testing.assert_array_equal(raw.area, area)
    if not raw.cnt.sum() < cnt.sum():          # nothing joined: the arrays as built
        np.testing.assert_array_equal(raw.nfull, nfull)
    return raw


def _unit_rects(gw, r0, r1, ustart, uend, kb):
    """Exact rectangles of units made of consecutive row groups.

    gw [G, W]: packed key blocks of each group; rows [r0, r1) of each group; unit u holds the
    groups [ustart[u], uend[u]). The keys of a unit are cut into segments where the set of
    selecting groups is constant; each vertical run of adjacent selecting groups (rows
    touching) in a segment is one rectangle. Returns (unit, row0, row1, key block j0, key
    block j1, union words [U, W]) in unit order, then key order.
    """
    G = gw.shape[0]
    gw = np.concatenate([gw, np.zeros((G, 1), _U64)], axis=1)   # room for an end at nkv
    one, top = np.uint64(1), np.uint64(63)
    carry = np.zeros_like(gw)
    carry[:, 1:] = gw[:, :-1] >> top
    starts = gw & ~((gw << one) | carry)
    nxtb = np.zeros_like(gw)
    nxtb[:, :-1] = (gw[:, 1:] & one) << top
    ends = gw & ~((gw >> one) | nxtb)                # last block of each run
    ecarry = np.zeros_like(gw)
    ecarry[:, 1:] = ends[:, :-1] >> top
    bounds = starts | (ends << one) | ecarry         # run starts and exclusive run ends
    union = np.bitwise_or.reduceat(gw, ustart, axis=0)
    su, pos = _bit_positions(np.bitwise_or.reduceat(bounds, ustart, axis=0))
    # Segments [pos_k, pos_k+1) of constant group pattern, inside the union's runs.
    last = np.r_[su[1:] != su[:-1], True]
    inside = ((union[su, pos >> 6] >> (pos & 63).astype(np.uint64)) & one).astype(bool) & ~last
    seg = np.flatnonzero(inside)
    sg_u, j0, j1 = su[seg], pos[seg], pos[seg + 1]
    # Groups of each segment's unit that select it; vertical runs of adjacent rows -> rects.
    p = (uend - ustart)[sg_u]
    n = int(p.sum())
    es = np.repeat(np.arange(len(seg)), p)
    eg = np.repeat(ustart[sg_u] - (np.cumsum(p) - p), p) + np.arange(n)
    ej = j0[es]
    sel = ((gw[eg, ej >> 6] >> (ej & 63).astype(np.uint64)) & one).astype(bool)
    cont = np.zeros(n, bool)                         # continues the rect of the group above
    cont[1:] = (sel[1:] & sel[:-1] & (es[1:] == es[:-1]) & (r0[eg[1:]] == r1[eg[:-1]]))
    rs = np.flatnonzero(sel & ~cont)
    re = np.flatnonzero(sel & ~np.r_[cont[1:], False])
    rseg = es[rs]
    return sg_u[rseg], r0[eg[rs]], r1[eg[re]], j0[rseg], j1[rseg], union[:, :-1]


def _cut_keys(c0, c1, anchor, tk, kvp):
    """Cuts key ranges [c0, c1) at anchor + k * tk: (owner, tile start, lo, hi), shifted
    back inside kvp like ``planner._chunk``."""
    k0 = (c0 - anchor) // tk
    nt = (c1 - 1 - anchor) // tk - k0 + 1
    pr = np.repeat(np.arange(len(c0)), nt)
    tix = np.repeat(k0 - (np.cumsum(nt) - nt), nt) + np.arange(int(nt.sum()))
    ts = anchor[pr] + tix * tk
    klo = np.maximum(c0[pr] - ts, 0)
    khi = np.minimum(c1[pr] - ts, tk)
    shift = np.maximum(ts + tk - kvp, 0)
    return pr, ts - shift, klo + shift, khi + shift


def _plan_grid_numpy(ctx: _Ctx) -> _Raw:
    """split in vectorised NumPy: the test oracle of ``planner._plan_grid``."""
    Hm, nq, W = ctx.words.shape
    tq, tk = ctx.tile_q, ctx.tile_kv
    nonempty = ctx.words.any(axis=-1)                          # [Hm, nq]
    # Query pieces: each query block cut at the query grid (the same for every head).
    own_q, cell, plo, phi = _chunk(ctx.qb[:-1], ctx.qb[1:], tq, tq, ctx.qp)
    keep = nonempty[:, own_q]                                  # [Hm, pieces]
    gh, gp = np.nonzero(keep)
    if len(gh) == 0:
        return _empty_raw()
    gcell, gi = cell[gp], own_q[gp]
    r0, r1 = gcell + plo[gp], gcell + phi[gp]
    gw = ctx.words[gh, gi]
    new = np.r_[True, (gh[1:] != gh[:-1]) | (gcell[1:] != gcell[:-1])]
    ustart = np.flatnonzero(new)
    uend = np.append(ustart[1:], len(gh))
    ru, ra, rb, j0, j1, _ = _unit_rects(gw, r0, r1, ustart, uend, ctx.kb)
    c0, c1 = ctx.kb[j0], ctx.kb[j1]
    pr, ts, klo, khi = _cut_keys(c0, c1, np.zeros_like(c0), tk, ctx.kvp)
    uq = gcell[ustart]
    pu = ru[pr]
    cnt = np.bincount(pu, minlength=len(ustart))
    lo = np.minimum.reduceat(r0, ustart) - uq
    hi = np.maximum.reduceat(r1, ustart) - uq
    # tile by tile inside a key segment (its first key block j0), rectangles in row order
    order = j0[pr].astype(np.int64) * (ctx.kvp + 1) + ts
    return _raw_from_columns(ctx, gh[ustart], uq, lo, hi, cnt, ts, ra[pr] - uq[pu],
                             rb[pr] - uq[pu], klo, khi, order=order)


def _plan_pack_numpy(ctx: _Ctx) -> _Raw:
    """pack in vectorised NumPy: the test oracle of ``planner._plan_pack``."""
    qb, kb, tq, tk = ctx.qb, ctx.kb, ctx.tile_q, ctx.tile_kv
    gh, gi, ge = _row_groups(ctx, merge=True)
    G = len(gh)
    if G == 0:
        return _empty_raw()
    r0, r1 = qb[gi], qb[ge]
    # Greedy packing per head (the NumPy tier's, itself checked against the loops by
    # tests/test_vectorised.py): a unit at group g takes the following groups of its head
    # while their rows end within g's aligned start + tile_q.
    ustart, uend = vectorised.pack_units(gh, r0, r1, tq, ctx.q_align).T
    Ul = len(ustart)
    ru, ra, rb, j0, j1, union = _unit_rects(ctx.words[gh, gi], r0, r1, ustart, uend, kb)
    c0, c1 = kb[j0], kb[j1]
    # Tiles: anchored at the start of the union run holding the rectangle.
    uu, us_, _ = _runs(union, len(kb) - 1)
    nk = len(kb)
    run = np.searchsorted(uu * nk + us_, ru * nk + j0, side="right") - 1
    anchor = (kb[us_[run]] // ctx.kv_align) * ctx.kv_align
    pr, ts, klo, khi = _cut_keys(c0, c1, anchor, tk, ctx.kvp)
    pu, pa, pb = ru[pr], ra[pr], rb[pr]               # pieces, in unit order
    # Units: each packed unit's rows in tiles of tile_q (several only for one tall group).
    cu, qs, qlo, qhi = _chunk(r0[ustart], r1[uend - 1], tq, ctx.q_align, ctx.qp)
    npc = np.bincount(pu, minlength=Ul)
    pfirst = np.cumsum(npc) - npc
    m = npc[cu]
    x = np.repeat(pfirst[cu] - (np.cumsum(m) - m), m) + np.arange(int(m.sum()))
    xc = np.repeat(np.arange(len(cu)), m)
    ql = np.maximum(pa[x] - qs[xc], qlo[xc])
    qh = np.minimum(pb[x] - qs[xc], qhi[xc])
    keep = ql < qh
    if not keep.all():
        x, xc, ql, qh = x[keep], xc[keep], ql[keep], qh[keep]
    cnt = np.bincount(xc, minlength=len(cu))
    has = cnt > 0
    order = j0[pr[x]].astype(np.int64) * (ctx.kvp + 1) + ts[x]
    return _raw_from_columns(ctx, gh[ustart[cu]][has], qs[has], qlo[has], qhi[has], cnt[has],
                             ts[x], ql, qh, klo[x], khi[x], order=order)
