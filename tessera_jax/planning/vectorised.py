"""The planner's NumPy tier: keep / merge / split / pack plans in vectorised NumPy, no numba.

Why: numba takes 12-25 s to compile the loops (``planning.loops``) that split and pack call,
~1.5 s for merge's, on a fresh install (benchmarks/NOTES.md, "Host planner"); a first plan
must not wait for that. ``PlannerConfig.loops`` "auto" makes the plans too large to interpret
here until the loops, compiled in the background, are ready; "vectorised" always. The plans
are the loops', byte for byte (tests/test_vectorised.py: the golden plans, random masks).

How, without the loops' tiles-once join and bitmap pass: every step of a finished plan is the
canonical step of its own selection (the unit's selected cells in its K/V tile): its bounding
box; a cut before each row (key) unlike the one before it; plain without cuts, a grid with at
most GRID - 1 cuts per axis, else a bitmap step (``plan_oracle._canonical_step``); and a unit's
steps come in increasing kv_start. So this tier needs, per policy:

1. which keys of which K/V tile each unit selects: the policy's key runs tiled from the
   loops' anchors (``_tile_pieces``: merge/keep at each interval's aligned start, split at the
   global grid, pack at the start of the unit's union run), tiles crossing kvp shifted back;
   per *segment* (rows of one row group in one tile, one key word per 64 keys);
2. the canonical step of each (unit, tile) from its segments (``_canonical``), bitmap words
   laid out as ``abi.pack_bitmap``;
3. the loops' layout: units that share step rows (keep/merge's tall row groups, broken where
   the loops split the units between threads, ``_share_flags``), step rows in unit order,
   bitmap words after all of them in step order, padded to ``bucket`` (``_raw``).

Units are made in chunks (``PlannerConfig.tier_chunk_steps``): a fresh process pays ~2 ms for
each MB of memory it touches first (page faults, on a VM), and a chunk's few-MB temporaries
are reused by the next.

Full steps (``_Raw.nfull``) are those that are the whole tile, plain; ``area`` the selected
interactions of a unit's own rows. ``auto`` (its choice reads the loops' counts before the
bitmap pass) has no NumPy version: ``policy_raw`` returns None for it.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels import abi

from tessera_jax.planning import planner as _pl

_U64 = np.dtype("<u8")
_ONE = np.uint64(1)
# _PREFIX[k]: the k low bits set (k = 0..64).
_PREFIX = np.array([(1 << k) - 1 for k in range(65)], _U64)
_WORD_CHUNK = 1 << 16      # nonzero words unpacked at a time (4 MB of bytes)
_BITMAP_CHUNK = 1 << 22    # bitmap word entries written at a time


# --- bits of packed words -------------------------------------------------------------------
def _set_bits(words: np.ndarray):
    """(row, bit) of every set bit of ``words`` [R, W] (uint64), in (row, bit) order: only the
    non-zero words are unpacked, a cache-sized chunk at a time."""
    R, W = words.shape
    flat = words.reshape(-1)
    nz = np.flatnonzero(flat)
    cw = np.bitwise_count(flat[nz]).astype(np.int64)
    rows, pos = [], []
    for a in range(0, len(nz), _WORD_CHUNK):
        idx = nz[a:a + _WORD_CHUNK]
        c = cw[a:a + _WORD_CHUNK]
        bits = np.flatnonzero(np.unpackbits(flat[idx].view(np.uint8), bitorder="little"))
        row = idx // W
        # Bit b of the chunk's k-th word is entry 64 k + b of ``bits``: key 64 (its column)
        # + b, so each word's keys are ``bits`` shifted by 64 (column - k).
        base = (idx - row * W - np.arange(len(idx))) * 64
        pos.append(np.repeat(base, c) + bits)
        rows.append(np.repeat(row, c))
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(pos)


def _runs(words: np.ndarray):
    """(row, first, end) of each run of set bits of ``words`` [R, W] (end exclusive), in
    (row, first) order: run bounds are the bits unlike the bit before them."""
    R, W = words.shape
    w = np.zeros((R, W + 1), _U64)                 # a zero word: a run can end at bit 64 W
    w[:, :W] = words
    f = w.reshape(-1)
    edge = f << _ONE
    edge[1:] |= f[:-1] >> np.uint64(63)            # (rows end in a zero word: no carry across)
    edge ^= f
    row, pos = _set_bits(edge.reshape(R, W + 1))
    return row[0::2], pos[0::2], pos[1::2]


def _ctz(x: np.ndarray) -> np.ndarray:
    """Trailing zeros of uint64 x (64 for 0)."""
    return np.bitwise_count((x & (~x + _ONE)) - _ONE).astype(np.int64)


def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bits of uint64 x up to its highest set bit (0 for 0)."""
    x = x.copy()
    for s in (1, 2, 4, 8, 16, 32):
        x |= x >> np.uint64(s)
    return np.bitwise_count(x).astype(np.int64)


def _lane_masks(lo: np.ndarray, hi: np.ndarray, nl: int) -> np.ndarray:
    """uint64 [n, nl]: keys [lo, hi) of a tile, 64 keys a lane (lane l: keys 64 l ...)."""
    if nl == 1:
        return (_PREFIX[hi] ^ _PREFIX[lo])[:, None]
    out = np.empty((len(lo), nl), _U64)
    for ln in range(nl):
        a = np.clip(lo - 64 * ln, 0, 64)
        b = np.clip(hi - 64 * ln, 0, 64)
        np.bitwise_xor(_PREFIX[b], _PREFIX[a], out=out[:, ln])
    return out


def _first_bits(x: np.ndarray, count: int, pad: np.ndarray):
    """The positions of the first ``count`` set bits of the lanes x [n, nl] (key 64 l + b),
    ``pad`` where there are fewer; x is consumed."""
    n, nl = x.shape
    out = []
    for _ in range(count):
        pos = pad.copy()
        todo = np.ones(n, bool)
        for ln in range(nl):
            v = x[:, ln]
            hit = todo & (v != 0)
            if hit.any():
                low = v[hit] & (~v[hit] + _ONE)
                pos[hit] = 64 * ln + _ctz(low)
                x[hit, ln] = v[hit] ^ low
                todo &= ~hit
        out.append(pos)
    return out


# --- row groups and units -------------------------------------------------------------------
def row_groups(words: np.ndarray, merge: bool):
    """(head, first q block, end q block, selected key blocks) of each non-empty row group,
    as ``loops._nb_groups``: merge joins consecutive identical rows."""
    Hm, nq, W = words.shape
    new = np.ones((Hm, nq), bool)
    if merge and nq > 1:
        new[:, 1:] = (words[:, 1:] != words[:, :-1]).any(axis=-1)
    gh, gi = np.nonzero(new)
    flat = gh * nq + gi
    ge = np.minimum(np.append(flat[1:], Hm * nq) - gh * nq, nq)
    pc = np.bitwise_count(words[gh, gi]).sum(axis=-1, dtype=np.int64)
    keep = pc > 0
    return gh[keep], gi[keep], ge[keep], pc[keep]


def pack_units(gh, r0, r1, tile_q: int, q_align: int) -> np.ndarray:
    """``loops._nb_pack_units``: per head, a unit starting at group g takes the following
    groups while their rows end within g's aligned start + tile_q; int64 [units, 2] of
    [first, end) groups. The greedy chains are followed for all heads at once."""
    G = len(gh)
    big = int(r1.max()) + tile_q + 1 if G else 1
    a = r0 - r0 % q_align
    nxt = np.searchsorted(gh * big + r1, gh * big + a + tile_q, side="right")
    nxt = np.maximum(nxt, np.arange(1, G + 1))
    start = np.zeros(G, bool)
    cur = np.flatnonzero(np.r_[True, gh[1:] != gh[:-1]]) if G else np.zeros(0, np.int64)
    while cur.size:
        start[cur] = True
        nx = nxt[cur]
        ok = nx < G
        ok[ok] = gh[nx[ok]] == gh[cur[ok]]
        cur = nx[ok]
    s = np.flatnonzero(start)
    return np.stack([s, np.append(s[1:], G)], axis=1).astype(np.int64)


# --- key segments: the keys each row group selects in each K/V tile ------------------------
def _tile_pieces(ks, ke, anchor, tk: int, lim: int):
    """Key ranges [ks, ke) cut at anchor + t * tk (anchor None: 0, the global grid), a tile
    starting past ``lim`` shifted back to it: (range, kv_start, lo, hi) per piece, keys
    [lo, hi) of the tile, in range order."""
    ltk = tk.bit_length() - 1
    pow2 = tk == 1 << ltk
    if anchor is None:
        ut0 = (ks >> ltk) << ltk if pow2 else ks - ks % tk
    else:
        off = ks - anchor
        ut0 = ks - (off & (tk - 1) if pow2 else off % tk)  # each range's first tile, unshifted
    d = ke - 1 - ut0
    n = (d >> ltk if pow2 else d // tk) + 1
    if not len(n) or n.max() == 1:
        kv = np.minimum(ut0, lim)
        return np.arange(len(ks)), kv, ks - kv, np.minimum(ke, ut0 + tk) - kv
    r = np.repeat(np.arange(len(ks)), n)
    ut = ut0[r] + (np.arange(len(r)) - (np.cumsum(n) - n)[r]) * tk
    kv = np.minimum(ut, lim)
    return r, kv, np.maximum(ks[r], ut) - kv, np.minimum(ke[r], ut + tk) - kv


def _key_segments(row, ks, ke, anchor, tk: int, lim: int, nl: int):
    """The key runs (row, [ks, ke)) of row groups, tiled from their anchors, as segments: one
    (row, kv_start, key lanes) per (row, K/V tile), in (row, kv_start) order (a row's pieces
    come in non-decreasing kv_start, so equal tiles are neighbours)."""
    r, kv, lo, hi = _tile_pieces(ks, ke, anchor, tk, lim)
    prow = row[r]
    x = _lane_masks(lo, hi, nl)
    if len(prow) < 2:
        return prow, kv, x
    new = np.r_[True, (prow[1:] != prow[:-1]) | (kv[1:] != kv[:-1])]
    starts = np.flatnonzero(new)
    if len(starts) == len(prow):
        return prow, kv, x
    return prow[starts], kv[starts], np.bitwise_or.reduceat(x, starts, axis=0)


class _Segs:
    """Segments of units: unit, kv_start, rows [ra, rb) of the tile, key lanes x [n, nl];
    sorted by (unit, kv_start, ra) once ``sort`` ran. ``mixed``: the segments of units made
    of several row groups (the rest are in order as made)."""

    def __init__(self, unit, kv, ra, rb, x, mixed=None):
        self.unit, self.kv, self.ra, self.rb, self.x = unit, kv, ra, rb, x
        self.mixed = np.arange(len(unit)) if mixed is None else mixed
        self._tiles = None

    def sort(self, kvp: int) -> "_Segs":
        """Stable by (unit, kv_start) where units mix row groups: a unit's segments come row
        group by row group, each group's in kv_start order, its groups in row order."""
        m = self.mixed
        if len(m) > 1:
            key = self.unit[m] * (kvp + 1) + self.kv[m]
            if not np.all(key[1:] >= key[:-1]):
                o = m[np.argsort(key, kind="stable")]
                for name in ("unit", "kv", "ra", "rb", "x"):
                    a = getattr(self, name)
                    a[m] = a[o]
        self.mixed = m[:0]
        self._tiles = None
        return self

    def tiles(self) -> np.ndarray:
        """The first segment of each (unit, tile): the plan's steps."""
        if self._tiles is None:
            u, kv = self.unit, self.kv
            self._tiles = (np.flatnonzero(np.r_[True, (u[1:] != u[:-1]) | (kv[1:] != kv[:-1])])
                           if len(u) else np.zeros(0, np.int64))
        return self._tiles


def _expand(seg_first, seg_count, carrier_row, unit, ra, rb, srow_kv, srow_x):
    """The segments of carriers (a row group's rows [ra, rb) in a unit, its key segments
    [seg_first, + seg_count) of ``srow_kv``/``srow_x``), in carrier order."""
    m = seg_count[carrier_row]
    idx = np.repeat(seg_first[carrier_row] - (np.cumsum(m) - m), m) + np.arange(int(m.sum()))
    c = np.repeat(np.arange(len(m)), m)
    su = unit[c]
    alone = np.ones(len(unit), bool)               # the unit's only carrier
    if len(unit) > 1:
        same = unit[1:] == unit[:-1]
        alone[1:] &= ~same
        alone[:-1] &= ~same
    return _Segs(su, srow_kv[idx], ra[c], rb[c], srow_x[idx],
                 mixed=np.flatnonzero(~alone[c]) if not alone.all() else np.zeros(0, np.int64))


def _per_row(row, n_rows: int):
    """(first, count) of each row's entries in ``row`` (sorted)."""
    count = np.bincount(row, minlength=n_rows).astype(np.int64)
    return np.cumsum(count) - count, count


# --- the canonical step of each (unit, tile) -------------------------------------------------
class _Steps:
    """Canonical steps of sorted segments: per step its unit, its int32 step row, whether
    it is full (the whole tile, plain) or a bitmap step, and its segments [first, end)."""

    def __init__(self, unit, cols, full, bitmap, first, end):
        self.unit, self.cols, self.full, self.bitmap = unit, cols, full, bitmap
        self.first, self.end = first, end


def _box(col: np.ndarray):
    """(kl, kh): the lowest and one past the highest key of the lanes col [n, nl] (non-zero
    rows)."""
    n, nl = col.shape
    if nl == 1:
        return _ctz(col[:, 0]), _bit_length(col[:, 0])
    kl = np.full(n, 64 * nl, np.int64)
    kh = np.zeros(n, np.int64)
    for ln in range(nl):
        v = col[:, ln]
        np.minimum(kl, np.where(v != 0, 64 * ln + _ctz(v), 64 * nl), out=kl)
        np.maximum(kh, np.where(v != 0, 64 * ln + _bit_length(v), 0), out=kh)
    return kl, kh


def _canonical(s: _Segs, tq: int, tk: int) -> _Steps:
    """The canonical step of each (unit, tile) of the sorted segments ``s``: one segment whose
    keys are one run is a plain step; the rest go through ``_canonical_cuts``."""
    n = len(s.unit)
    nl = s.x.shape[1]
    gs = s.tiles()
    ng = len(gs)
    ge = np.append(gs[1:], n)
    col = np.bitwise_or.reduceat(s.x, gs, axis=0) if n else s.x
    kl, kh = _box(col)
    ql, qh = s.ra[gs], s.rb[ge - 1]
    cols = np.zeros((ng, abi.STEP_COLS), np.int32)   # (int64 -> int32 wraps: packed bytes)
    cols[:, abi.STEP_KV_START] = s.kv[gs]
    cols[:, abi.STEP_RECT] = (ql | (qh << abi.RECT_Q_HI_SHIFT) | (kl << abi.RECT_KV_LO_SHIFT)
                              | (kh << abi.RECT_KV_HI_SHIFT)).astype(np.int32)
    bitmap = np.zeros(ng, bool)
    plain = (ge - gs == 1) & (col == _lane_masks(kl, kh, nl)).all(axis=1)
    hard = np.flatnonzero(~plain)
    if hard.size:
        cuts_a, cuts_b, bm = _canonical_cuts(s, gs[hard], ge[hard], kl[hard], kh[hard],
                                             ql[hard], qh[hard])
        cols[hard, abi.STEP_CUTS_A] = cuts_a.astype(np.int32)
        cols[hard, abi.STEP_CUTS_B] = cuts_b.astype(np.int32)
        bitmap[hard] = bm
    full = ((cols[:, abi.STEP_CUTS_B] == 0) & (ql == 0) & (qh == tq) & (kl == 0)
            & (kh == tk))
    return _Steps(s.unit[gs], cols, full, bitmap, gs, ge)


def _canonical_cuts(s: _Segs, gs, ge, kl, kh, ql, qh):
    """(CUTS_A, CUTS_B, bitmap?) of the steps made of segments [gs, ge) (sorted by rows) with
    key box [kl, kh) and row box [ql, qh): a cut before each row (key) unlike the one before
    it; a grid of the cells' values where at most GRID - 1 per axis, else a bitmap step."""
    ng = len(gs)
    m = ge - gs
    seg = np.repeat(gs - (np.cumsum(m) - m), m) + np.arange(int(m.sum()))
    gid = np.repeat(np.arange(ng), m)
    x = s.x[seg]
    ra, rb = s.ra[seg], s.rb[seg]
    n, nl = x.shape
    lo = np.cumsum(m) - m                          # each step's first segment, in seg
    tr = x ^ (x << _ONE)                           # bit c: key c unlike key c - 1
    if nl > 1:
        tr[:, 1:] ^= x[:, :-1] >> np.uint64(63)
    inner = np.bitwise_or.reduceat(tr, lo, axis=0) & _lane_masks(kl + 1, kh, nl)
    nk = np.bitwise_count(inner).sum(axis=1, dtype=np.int64)
    k1, k2, k3 = _first_bits(inner, abi.GRID - 1, kh)
    # Row cuts: where a segment's rows start after a gap (two: the gap's first row, zeros,
    # and the segment's) or at the last one's end with other keys.
    cont = gid[1:] == gid[:-1]
    gap = cont & (ra[1:] > rb[:-1])
    diff = cont & ~gap & (x[1:] != x[:-1]).any(axis=1)
    ncut = gap.astype(np.int64) * 2 + diff
    nr = np.bincount(gid[1:], weights=ncut, minlength=ng).astype(np.int64)
    cs = np.repeat(np.arange(1, n), ncut)          # each cut's segment, cuts in row order
    zero = np.zeros(len(cs), bool)                 # the gap's first row: zeros follow
    if len(cs):
        zero[:] = gap[cs - 1]
        zero[1:] &= cs[1:] != cs[:-1]
    cut_row = np.where(zero, rb[cs - 1], ra[cs]) if len(cs) else cs
    cfirst = np.cumsum(nr) - nr
    bitmap = (nr > abi.GRID - 1) | (nk > abi.GRID - 1)
    cuts_a = np.zeros(ng, np.int64)
    cuts_b = np.where(bitmap, abi.BITMAP_FLAG, 0)
    g = np.flatnonzero(~bitmap & ((nr > 0) | (nk > 0)))         # grid steps (else plain)
    if g.size:
        q = [np.where(nr[g] > i, cut_row[np.minimum(cfirst[g] + i, max(len(cs) - 1, 0))]
                      if len(cs) else 0, qh[g]) for i in range(abi.GRID - 1)]
        # Cell (i, j): the keys of row segment i's first row (the step's first segment, else
        # the one after cut i - 1, zeros after a gap's first row) at key segment j's first.
        keys = [kl[g], k1[g], k2[g], k3[g]]
        bits = np.zeros(len(g), np.int64)
        for i in range(abi.GRID):
            if i == 0:
                w_seg, live = lo[g], np.ones(len(g), bool)
            else:
                at = np.minimum(cfirst[g] + i - 1, max(len(cs) - 1, 0))
                live = nr[g] >= i
                if len(cs):
                    live &= ~zero[at]
                    w_seg = cs[at]
                else:
                    w_seg = lo[g]
            for j, c in enumerate(keys):
                on = live & (nk[g] >= j)
                w = x[w_seg, np.minimum(c >> 6, nl - 1)]
                b = (w >> (c & 63).astype(_U64)) & _ONE
                bits |= (b.astype(np.int64) & on) << (abi.GRID * i + j)
        cuts_a[g] = q[0] | (q[1] << 8) | (q[2] << 16) | (k1[g] << 24)
        cuts_b[g] = k2[g] | (k3[g] << 8) | (bits << abi.GRID_BITS_SHIFT)
    return cuts_a, cuts_b, bitmap


def _bitmap_words(s: _Segs, first, end, out: np.ndarray, tq: int, tk: int) -> None:
    """Writes the words of the bitmap steps of segments [first, end) (one per step) to out
    (int32 [steps, bitmap_rows * STEP_COLS], zeros): word w of row r at w * tq + r
    (``abi.pack_bitmap``). Per chunk of steps, each row's segment (0: none) is laid out by
    one ``np.repeat`` of the rows' runs (gap, segment, gap, ..., gap to tq)."""
    nw = abi.bitmap_words(tk)
    nb = len(first)
    if not nb:
        return
    halves = np.zeros((len(s.x) + 1, 2 * s.x.shape[1]), np.uint32)   # row 0: no segment
    halves[1:] = s.x.view(np.uint32).reshape(len(s.x), -1)           # little-endian words
    per = max(1, _BITMAP_CHUNK // tq)
    for c0 in range(0, nb, per):
        m = end[c0:c0 + per] - first[c0:c0 + per]
        starts = np.cumsum(m) - m
        k = np.repeat(first[c0:c0 + per] - starts, m) + np.arange(int(m.sum()))  # segments
        prev_end = np.empty(len(k), np.int64)
        prev_end[1:] = s.rb[k[:-1]]
        prev_end[starts] = 0
        # Runs of rows per step: (gap, segment) per segment, then the gap to tq.
        lens = np.empty(2 * len(k) + len(m), np.int64)
        vals = np.zeros(2 * len(k) + len(m), np.int64)
        at = 2 * np.arange(len(k)) + np.repeat(np.arange(len(m)), m)
        lens[at] = s.ra[k] - prev_end
        lens[at + 1] = s.rb[k] - s.ra[k]
        vals[at + 1] = k + 1
        lens[2 * (starts + m) + np.arange(len(m))] = tq - s.rb[k[starts + m - 1]]
        ids = np.repeat(vals, lens)                                       # [steps * tq]
        blk = out[c0:c0 + per]
        for w in range(nw):
            blk[:, w * tq:(w + 1) * tq] = halves[ids, w].view(np.int32).reshape(len(m), tq)


# --- policies --------------------------------------------------------------------------------
class _Policy:
    """One policy's units: head, qs, lo, hi; ``share[u]``: unit u reuses the step rows of the
    unit before; ``cnt``: each unit's steps; ``segments(u0, u1)``: the sorted segments of the
    units [u0, u1) that store their own rows (the plan is made in chunks of units, so that a
    fresh process touches little new memory: ~2 ms a MB on a VM)."""

    def __init__(self, head, qs, lo, hi, share, cnt, ctx, segments):
        self.head, self.qs, self.lo, self.hi, self.share = head, qs, lo, hi, share
        self.cnt, self.segments = cnt, segments
        self.tq, self.tk, self.chunk = ctx.tile_q, ctx.tile_kv, ctx.cfg.tier_chunk_steps


def _source(share: np.ndarray) -> np.ndarray:
    """The unit whose step rows each unit uses: itself, or (``share``) the last unit before it
    that stores its own."""
    src = np.arange(len(share))
    if share.any():
        src[share] = 0
        np.maximum.accumulate(src, out=src)
    return src


def _row_chunks(weight: np.ndarray, per: int):
    """[lo, hi) ranges over rows of about ``per`` summed ``weight`` each."""
    if not len(weight):
        return []
    ends = np.searchsorted(np.cumsum(weight), np.arange(per, int(weight.sum()), per),
                           side="right")
    cuts = np.unique(np.r_[0, ends, len(weight)])
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def _tile_counts(words: np.ndarray, kb, ka, tk: int, lim: int, per: int,
                 single: bool = False):
    """Steps of each row of ``words`` [R, W]: the distinct K/V tiles of its key runs (single:
    its set bits), each tiled from ka of its first block (None: the global grid), in chunks
    of about ``per`` words."""
    out = np.zeros(len(words), np.int64)
    for r0, r1 in _row_chunks(np.full(len(words), words.shape[1]), per):
        if single:
            row, js = _set_bits(words[r0:r1])
            je = js + 1
        else:
            row, js, je = _runs(words[r0:r1])
        r, kv, _, _ = _tile_pieces(kb[js], kb[je], None if ka is None else ka[js], tk, lim)
        pr = row[r]
        new = np.ones(len(pr), bool)
        new[1:] = (pr[1:] != pr[:-1]) | (kv[1:] != kv[:-1])
        out[r0:r1] = np.bincount(pr[new], minlength=r1 - r0)
    return out


def _rowgroup_policy(ctx, merge: bool, share: bool) -> _Policy | None:
    """keep / merge (``planner._plan_rowgroups``); share: tall row groups share step rows."""
    tq, tk = ctx.tile_q, ctx.tile_kv
    gh, gi, ge, pc = row_groups(ctx.words, merge)
    if len(gh) == 0:
        return None
    kb = np.asarray(ctx.kb, np.int64)
    ka = kb - kb % ctx.kv_align
    qb = np.asarray(ctx.qb, np.int64)
    lim = ctx.kvp - tk
    ug, qs, qlo, qhi = _pl._chunk(qb[gi], qb[ge], tq, ctx.q_align, ctx.qp)
    gw = ctx.words[gh, gi]
    flags = (_share_flags(ctx, ug, gh, gi, qlo, qhi, pc, ka, kb) if share
             else np.zeros(len(ug), bool))

    def segments(u0, u1):
        stored = u0 + np.flatnonzero(~flags[u0:u1])
        g0, g1 = int(ug[u0]), int(ug[u1 - 1]) + 1
        if merge:
            row, js, je = _runs(gw[g0:g1])
        else:
            row, js = _set_bits(gw[g0:g1])
            je = js + 1
        srow, skv, sx = _key_segments(row, kb[js], kb[je], ka[js], tk, lim, -(-tk // 64))
        first, count = _per_row(srow, g1 - g0)
        return _expand(first, count, ug[stored] - g0, stored, qlo[stored], qhi[stored], skv,
                       sx)
    cnt = _tile_counts(gw, kb, ka, tk, lim, ctx.cfg.tier_chunk_steps, single=not merge)[ug]
    return _Policy(gh[ug], qs, qlo, qhi, flags, cnt, ctx, segments)


def _share_flags(ctx, ug, gh, gi, qlo, qhi, pc, ka, kb) -> np.ndarray:
    """Which units reuse the step rows of the unit before (same group, same rows), as
    ``planner._plan_rowgroups`` lays them out: never across the units' split between threads
    (its bound decides it), none where the bound is counted exactly first."""
    cfg, tq, tk = ctx.cfg, ctx.tile_q, ctx.tile_kv
    U = len(ug)
    same = np.zeros(U, bool)
    same[1:] = ((gh[ug][1:] == gh[ug][:-1]) & (gi[ug][1:] == gi[ug][:-1])
                & (qlo[1:] == qlo[:-1]) & (qhi[1:] == qhi[:-1]))
    cmax = int(((kb[1:] - ka[:-1] + tk - 1) // tk).max())
    bound = np.zeros(U + 1, np.int64)
    np.cumsum(pc[ug] * cmax, out=bound[1:])
    B = int(bound[-1])
    if _pl._wide(cfg, U, B):
        same[_pl._wide_edges(bound, cfg.threads)[1:-1]] = False
        return same
    if _pl.bucket(B) * abi.STEP_COLS * 4 > cfg.max_bound_bytes:
        return np.zeros(U, bool)
    if _pl._two(cfg, U, B):
        same[min(max(int(np.searchsorted(bound, B // 2)), 1), U - 1)] = False
    return same


def _grid_policy(ctx) -> _Policy | None:
    """split (``planner._plan_grid``): units the query grid cells, tiles the key grid's."""
    tq, tk = ctx.tile_q, ctx.tile_kv
    g = _pl._grid_groups(ctx)
    if g is None:
        return None
    gh, gi, r0, r1, ustart, uq, lo, hi = g
    U = len(ustart)
    uend = np.append(ustart[1:], len(gh))
    kb = np.asarray(ctx.kb, np.int64)
    lim = ctx.kvp - tk
    gw = ctx.words[gh, gi]

    def segments(u0, u1):
        # Each (head, query block) once (a block crossing a grid line is a carrier in each of
        # its cells), its runs cut at the key grid.
        e0, e1 = int(ustart[u0]), int(uend[u1 - 1])
        h, i = gh[e0:e1], gi[e0:e1]
        new = np.r_[True, (h[1:] != h[:-1]) | (i[1:] != i[:-1])]
        row, js, je = _runs(gw[e0:e1][new])
        srow, skv, sx = _key_segments(row, kb[js], kb[je], None, tk, lim, -(-tk // 64))
        first, count = _per_row(srow, int(new.sum()))
        cunit = np.repeat(np.arange(u0, u1), uend[u0:u1] - ustart[u0:u1])
        return _expand(first, count, np.cumsum(new) - 1, cunit, r0[e0:e1] - uq[cunit],
                       r1[e0:e1] - uq[cunit], skv, sx).sort(ctx.kvp)
    # Steps: the grid tiles the runs of each cell's union of rows touch.
    cnt = _tile_counts(np.bitwise_or.reduceat(gw, ustart, axis=0), kb, None, tk, lim,
                       ctx.cfg.tier_chunk_steps)
    return _Policy(gh[ustart], uq, lo, hi, np.zeros(U, bool), cnt, ctx, segments)


def _pack_policy(ctx) -> _Policy | None:
    """pack (``planner._plan_pack``): packed row groups, tiles anchored at the unit's union
    runs."""
    tq, tk = ctx.tile_q, ctx.tile_kv
    gh, gi, ge, _ = row_groups(ctx.words, True)
    if len(gh) == 0:
        return None
    qb = np.asarray(ctx.qb, np.int64)
    kb = np.asarray(ctx.kb, np.int64)
    ka = kb - kb % ctx.kv_align
    lim = ctx.kvp - tk
    r0, r1 = qb[gi], qb[ge]
    ugroups = pack_units(gh, r0, r1, tq, ctx.q_align)
    cu, qs, qlo, qhi = _pl._chunk(r0[ugroups[:, 0]], r1[ugroups[:, 1] - 1], tq, ctx.q_align,
                                  ctx.qp)
    gw = ctx.words[gh, gi]
    union = np.bitwise_or.reduceat(gw, ugroups[:, 0], axis=0)
    U = len(cu)

    def segments(u0, u1):
        p0, p1 = int(cu[u0]), int(cu[u1 - 1]) + 1            # packed units
        g0, g1 = int(ugroups[p0, 0]), int(ugroups[p1 - 1, 1])
        # Each group's runs, anchored at the start of its unit's union run holding them.
        urow, us, _ = _runs(union[p0:p1])
        gunit = np.repeat(np.arange(p1 - p0), ugroups[p0:p1, 1] - ugroups[p0:p1, 0])
        row, js, je = _runs(gw[g0:g1])
        nk1 = len(kb)
        run = np.searchsorted(urow * nk1 + us, gunit[row] * nk1 + js, side="right") - 1
        srow, skv, sx = _key_segments(row, kb[js], kb[je], ka[us[run]], tk, lim,
                                      -(-tk // 64))
        # Carriers: each unit's groups, rows clipped to the unit's own (never empty).
        m = (ugroups[:, 1] - ugroups[:, 0])[cu[u0:u1]]
        cg = np.repeat(ugroups[cu[u0:u1], 0] - (np.cumsum(m) - m), m) + np.arange(int(m.sum()))
        cunit = np.repeat(np.arange(u0, u1), m)
        ra = np.maximum(r0[cg] - qs[cunit], qlo[cunit])
        rb = np.minimum(r1[cg] - qs[cunit], qhi[cunit])
        first, count = _per_row(srow, g1 - g0)
        return _expand(first, count, cg - g0, cunit, ra, rb, skv, sx).sort(ctx.kvp)
    # Steps: the tiles of the union runs of each packed unit's groups (each holds selected
    # keys), the same for each of its units (several: one group taller than the tile).
    cnt = _tile_counts(union, kb, ka, tk, lim, ctx.cfg.tier_chunk_steps)[cu]
    return _Policy(gh[ugroups[cu, 0]], qs, qlo, qhi, np.zeros(U, bool), cnt, ctx, segments)


def _policy(ctx, policy: str, share: bool) -> _Policy | None:
    """The units of ``policy`` (None: no units)."""
    if policy == "split":
        return _grid_policy(ctx)
    if policy == "pack":
        return _pack_policy(ctx)
    return _rowgroup_policy(ctx, policy == "merge", share)


# --- layout: the raw plan ----------------------------------------------------------------
class _Out:
    """The plan's step array being written: S step rows, then bitmap words (``wr`` rows each)
    from row S, in a zeroed reservation the OS backs only where written (room for a bitmap
    per step, within ``max_bytes``), grown by doubling past it."""

    def __init__(self, S: int, wr: int, max_bytes: int):
        self.S, self.wr, self.nb = S, wr, 0
        room = max(0, min(S * wr, max_bytes // (abi.STEP_COLS * 4) - S))
        self.steps = np.zeros((_pl.bucket(S + room), abi.STEP_COLS), np.int32)

    def words(self, k: int) -> np.ndarray:
        """The next k bitmaps' words (int32 [k, wr * STEP_COLS]); their CUTS_A offsets."""
        end = self.S + (self.nb + k) * self.wr
        if end > len(self.steps):
            grown = np.zeros((_pl.bucket(max(end, 2 * len(self.steps))), abi.STEP_COLS),
                             np.int32)
            grown[:self.S + self.nb * self.wr] = self.steps[:self.S + self.nb * self.wr]
            self.steps = grown
        at = self.S + self.nb * self.wr
        self.nb += k
        offs = (at + np.arange(k) * self.wr) * abi.STEP_COLS
        return self.steps[at:end].reshape(k, self.wr * abi.STEP_COLS), offs

    def done(self) -> np.ndarray:
        return self.steps[:_pl.bucket(self.S + self.nb * self.wr)]


def _emit(pol: _Policy, sel: np.ndarray, shared: bool, out: _Out, s0: int):
    """Writes the step rows of ``pol``'s units ``sel`` (``_raw``) from row s0 of ``out``, and
    their bitmap words, chunk by chunk; returns (steps, full steps, selected interactions) of
    each selected unit."""
    U = len(pol.head)
    src = _source(pol.share)
    emit = sel & ~pol.share if shared else sel
    full, area = np.zeros(U, np.int64), np.zeros(U, np.int64)
    stored = np.flatnonzero(~pol.share)
    ends = np.append(stored[1:], U)                # a chunk starts at a unit storing its rows
    for c0, c1 in _row_chunks(pol.cnt[stored], pol.chunk):
        u0, u1 = int(stored[c0]), int(ends[c1 - 1])
        segs = pol.segments(u0, u1)
        st = _canonical(segs, pol.tq, pol.tk)
        keys = np.bitwise_count(segs.x).sum(axis=1, dtype=np.int64)
        area[u0:u1] = np.bincount(segs.unit - u0, weights=(segs.rb - segs.ra) * keys,
                                  minlength=u1 - u0)
        full[u0:u1] = np.bincount(st.unit - u0, weights=st.full, minlength=u1 - u0)
        made = np.bincount(st.unit - u0, minlength=u1 - u0)
        if not np.array_equal(made, np.where(pol.share[u0:u1], 0, pol.cnt[u0:u1])):
            raise RuntimeError("planner: the NumPy tier's steps differ from its counts")
        if np.array_equal(emit[u0:u1], ~pol.share[u0:u1]):   # each stored step, in order
            cols, at = st.cols, np.flatnonzero(st.bitmap)
            b = at
        else:                      # some units left out, or each its own copy of shared rows
            first = np.zeros(u1 - u0 + 1, np.int64)          # each unit's steps in st
            np.cumsum(made, out=first[1:])
            e = u0 + np.flatnonzero(emit[u0:u1])
            n = pol.cnt[e]
            idx = (np.repeat(first[src[e] - u0] - (np.cumsum(n) - n), n)
                   + np.arange(int(n.sum())))
            cols, at = st.cols[idx], np.flatnonzero(st.bitmap[idx])
            b = idx[at]
        out.steps[s0:s0 + len(cols)] = cols
        words, offs = out.words(len(b))
        out.steps[s0 + at, abi.STEP_CUTS_A] = offs
        _bitmap_words(segs, st.first[b], st.end[b], words, pol.tq, pol.tk)
        s0 += len(cols)
    full, area = full[src], area[src]
    return full[sel], area[sel]


def _raw(parts, shared: bool, max_bytes: int) -> "_pl._Raw":
    """The raw plan of ``parts`` ((policy, unit selection) pairs, concatenated in order): step
    rows in unit order, then the bitmap words in step order, padded to ``bucket``. ``shared``:
    units that share step rows keep sharing them (a unit's ``ptr`` is the rows before it), as
    the loops lay out one policy's plan; else each unit has its own copy (``_Raw.unshared``,
    as the fallback to split concatenates plans). ``max_bytes``: most bytes reserved for the
    words ahead (``PlannerConfig.max_bound_bytes``)."""
    parts = [(pol, sel) for pol, sel in parts if sel.any()]
    if not parts:
        return _pl._empty_raw()
    S = sum(int(pol.cnt[sel & ~pol.share if shared else sel].sum()) for pol, sel in parts)
    out = _Out(S, abi.bitmap_rows(parts[0][0].tq, parts[0][0].tk), max_bytes)
    per = {k: [] for k in ("head", "qs", "lo", "hi", "cnt", "nfull", "area", "share")}
    s0 = 0
    for pol, sel in parts:
        full, area = _emit(pol, sel, shared, out, s0)
        s0 += int(pol.cnt[sel & ~pol.share if shared else sel].sum())
        for k, v in (("head", pol.head[sel]), ("qs", pol.qs[sel]), ("lo", pol.lo[sel]),
                     ("hi", pol.hi[sel]), ("cnt", pol.cnt[sel]), ("nfull", full),
                     ("area", area), ("share", (pol.share & shared)[sel])):
            per[k].append(v)
    head, qs, lo, hi, cnt, nfull, area, share = (np.concatenate(per[k]) for k in (
        "head", "qs", "lo", "hi", "cnt", "nfull", "area", "share"))
    ptr = None
    if share.any():
        stored = np.where(share, 0, cnt)
        ptr = (np.cumsum(stored) - stored)[_source(share)]
    return _pl._Raw(head, qs, lo, hi, cnt, out.done(), nfull, area, ptr=ptr,
                    stored=S if ptr is not None else None, words=out.nb * out.wr,
                    wr=out.wr if out.nb else 0)


def _head_tiles(pol: _Policy, Hd: int) -> np.ndarray:
    """K/V tiles each distinct mask head's units visit (``planner._head_computed`` / tile)."""
    return np.bincount(pol.head, weights=pol.cnt, minlength=Hd)


def policy_raw(ctx, policy: str, shape, hmap, num_heads: int):
    """(raw plan, policy of each mask head, whether heads' units come from several policies)
    as ``planner._policy_raw`` makes them for keep / merge / split / pack, the invariant
    enforced the same way (a head above dense takes split's units where those compute less);
    None for ``auto``."""
    if policy == "auto":
        return None
    Hd, tq, tk = ctx.words.shape[0], ctx.tile_q, ctx.tile_kv
    pol = _policy(ctx, policy, ctx.cfg.share_step_lists)
    if pol is None:
        return _pl._empty_raw(), (policy,) * num_heads, False
    every = np.ones(len(pol.head), bool)
    if policy != "split":
        bound = _pl.dense_tile_interactions(shape.q_len, shape.kv_len, tq, tk)
        comp = _head_tiles(pol, Hd) * float(tq * tk)
        if (comp > bound).any():
            alt = _grid_policy(ctx)
            use = (comp > bound) & (_head_tiles(alt, Hd) * float(tq * tk) < comp)
            if use.any():
                parts = [(pol, ~use[pol.head]), (alt, use[alt.head])]
                return (_raw(parts, False, ctx.cfg.max_bound_bytes),
                        tuple("split" if use[k] else policy for k in hmap), True)
    return _raw([(pol, every)], True, ctx.cfg.max_bound_bytes), (policy,) * num_heads, False


def split_raw(ctx):
    """split's raw plan (the gather policies' fallback, ``planner._policy_raw``)."""
    pol = _grid_policy(ctx)
    if pol is None:
        return _pl._empty_raw()
    return _raw([(pol, np.ones(len(pol.head), bool))], True, ctx.cfg.max_bound_bytes)


# --- row_index --------------------------------------------------------------------------------
def row_index(uh, qs, lo, hi, uidx, Hq: int, Lq: int, tile_q: int, sentinel: int):
    """``loops._nb_row_index`` over all heads: row_index [Hq, Lq], u * tile_q + r for the row
    r of unit u (schedule index ``uidx``) that owns it, else ``sentinel``."""
    out = np.full((Hq, Lq), sentinel, np.int32)
    n = hi - lo
    tot = int(n.sum())
    if tot:
        k = np.repeat(np.arange(len(uh)), n)
        r = np.arange(tot) - np.repeat(np.cumsum(n) - n, n)
        x = qs[k] + lo[k] + r
        out.reshape(-1)[uh[k] * Lq + x] = (uidx[k] * tile_q - qs[k] + x).astype(np.int32)
    return out
