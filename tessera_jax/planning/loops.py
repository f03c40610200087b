"""numba-compiled inner loops of the planner; small calls run them as plain Python, and until
they are compiled (in the background: ``start_warm_up``) the planner makes larger plans with
its NumPy tier (``planning.vectorised``).

Each ``_nb_*`` function is one loop of ``tessera_jax.planning.planner`` over packed mask words
(uint64, bit j%64 of word j//64 = key block j), group and unit arrays: row groups and units
(``_nb_groups``, ``_nb_units``, ``_nb_pack_units``), the step rows of keep/merge
(``_nb_fill``, exact counts ``_nb_count``) and of split/pack (``_nb_rects`` and its helpers,
bound ``_nb_rect_bound``; the pieces of one K/V tile joined into grid steps by
``_nb_tiles_once``), the bitmap pass that leaves one step per (unit, K/V tile) (the rows of
the units that revisit a tile compacted in place, ``_nb_bm_unit``: by split/pack's loop as it
writes them, or after the loops by ``_nb_bm_ranges``; the steps of the revisited tiles and
their bitmap words written once all step rows are, ``_nb_bm_pass``), mask packing
(``_nb_pack``) and row_index (``_nb_row_index``).
Loops that take (lo, hi) handle units/rows [lo, hi), so the planner can run two halves on
two threads (they are nogil). The planner calls them through ``runner(mode, ...)``: its
``PlannerConfig.loops`` chooses compiled loops, plain Python with numba's integer semantics,
or (the default) small calls interpreted until the compiled loops are ready (``ready()``), so
that a small plan never imports numba, and ``NotReady`` for a larger call before then;
compiling imports numba and compiles the loops or loads them from its on-disk cache
(``compile_all()``; the planner's ``warm_up()`` does it ahead of time), and ``_nb_ctz`` (count
trailing zeros) is bound to numba's then. The NumPy oracles the tests compare the loops with
are in ``plan_oracle``.
"""

from __future__ import annotations

import functools
import os
import threading
import types

import numpy as np

# The packed step rectangle's byte offsets and the step columns (``pallas_kernels.abi``):
# plain int constants, which numba compiles in.
from pallas_kernels.abi import RECT_KV_HI_SHIFT as _KV_HI
from pallas_kernels.abi import RECT_KV_LO_SHIFT as _KV_LO
from pallas_kernels.abi import RECT_Q_HI_SHIFT as _Q_HI
from pallas_kernels.abi import GRID_BITS_SHIFT as _BITS
from pallas_kernels.abi import STEP_CUTS_A as _CUTS_A
from pallas_kernels.abi import STEP_CUTS_B as _CUTS_B
from pallas_kernels.abi import STEP_KV_START as _KV_START
from pallas_kernels.abi import STEP_RECT as _RECT
from pallas_kernels.abi import BITMAP_FLAG as _BITMAP


def _nb_popcount(x):
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = ((x & np.uint64(0x3333333333333333))
         + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333)))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


def _nb_groups(words, merge):
    """(head, first q block, end q block) of each non-empty row group, as
    ``plan_oracle._row_groups``, and the selected key blocks of each."""
    Hm, nq, W = words.shape
    gh = np.empty(Hm * nq, np.int64)
    gi = np.empty(Hm * nq, np.int64)
    ge = np.empty(Hm * nq, np.int64)
    pc = np.empty(Hm * nq, np.int64)
    G = 0
    for h in range(Hm):
        i = 0
        while i < nq:
            e = i + 1
            if merge:
                while e < nq:
                    same = True
                    for k in range(W):
                        if words[h, e, k] != words[h, i, k]:
                            same = False
                            break
                    if not same:
                        break
                    e += 1
            c = 0
            for k in range(W):
                c += _nb_popcount(words[h, i, k])
            if c:
                gh[G] = h
                gi[G] = i
                ge[G] = e
                pc[G] = c
                G += 1
            i = e
    return gh[:G], gi[:G], ge[:G], pc[:G]


def _nb_tiles(js, je, kb, ka, tk, ltk):
    """Tiles of the key interval of blocks [js, je), anchored at its aligned start."""
    x = kb[je] - ka[js] + tk - 1
    return x >> ltk if ltk >= 0 else x // tk


def _nb_fill(lo, hi, row0, words, ugh, ugi, merge, qlo, qhi, kb, ka, tk, ltk, lim, write,
             steps, cnt, upart, ukeys, urev, ptr, share):
    """Step rows of units [lo, hi), written from steps[row0] (or only counted, with ``write``
    False); returns the end row.

    Each unit's key intervals are decoded from its group's words (merge: run boundaries
    w ^ (w << 1), with a zero word appended so that a run reaching the last key block ends;
    keep: set bits), and each interval's tiles are written as they come. Tiles come in
    non-decreasing kv_start, so a tile two intervals touch (aligned starts, tiles shifted back
    inside kvp) is the row just written: the interval's first tile joins it (tiles once, as
    ``_nb_push`` would: all rows of a unit are [qlo, qhi), so a step holds at most two key runs,
    a grid of one row segment and key segments run, gap, run), else it is a revisit of that
    tile (``urev[u]`` counts them: the bitmap pass, ``planner._bitmap_steps``, makes one step
    of them). A unit's rows depend only on its group and its rows [qlo, qhi), so with
    ``share`` a unit equal in those to the one before (the interior units of a tall row group)
    writes nothing and points at that unit's rows. ``ptr[u]``: the first row of unit u;
    ``upart[u]``: its steps whose keys are not the whole tile.
    """
    s = row0
    for u in range(lo, hi):
        h, i = ugh[u], ugi[u]
        ql, qh = qlo[u], qhi[u]
        if (share and u > lo and h == ugh[u - 1] and i == ugi[u - 1] and ql == qlo[u - 1]
                and qh == qhi[u - 1]):
            ptr[u] = ptr[u - 1]
            cnt[u] = cnt[u - 1]
            upart[u] = upart[u - 1]
            ukeys[u] = ukeys[u - 1]
            urev[u] = urev[u - 1]
            continue
        ptr[u] = s
        e, fullk, keys, rev = _nb_fill_unit(words, h, i, ql, qh, merge, kb, ka, tk, ltk, lim,
                                            write, steps, s)
        cnt[u] = e - s
        upart[u] = e - s - fullk
        ukeys[u] = keys
        urev[u] = rev
        s = e
    return s


def _nb_fill_unit(words, h, i, ql, qh, merge, kb, ka, tk, ltk, lim, write, steps, s):
    """``_nb_fill`` of one unit (group (h, i), rows [ql, qh)), its rows written from row s:
    (end row, steps whose keys are the whole tile, selected keys, revisits). Inlined."""
    W = words.shape[2]
    one, top, zero = np.uint64(1), np.uint64(63), np.uint64(0)
    rows = ql | (qh << _Q_HI)          # the rectangle's row bytes (STEP_RECT)
    mid = rows | (tk << _KV_HI)        # a tile inside an interval: keys [0, tk)
    grid_a = qh | (qh << 8) | (qh << 16)   # a two-run step's row cuts (one row segment)
    fullk = 0                          # steps whose keys are the whole tile
    keys = 0
    rev = 0                            # rows that revisit the tile of the row before
    pk = -1                            # the last row: its kv_start (-1: none yet),
    pa = 0                             # keys [pa, pe), and if ``two`` the gap [pb, pc)
    pb = 0
    pc = 0
    pe = 0
    two = False
    carry = zero
    js = -1
    for k in range(W + 1):
        w = words[h, i, k] if k < W else zero
        if merge:
            b = w ^ ((w << one) | carry)
            carry = w >> top
        else:
            b = w
        while b:
            j = k * 64 + np.int64(_nb_ctz(b))
            b &= b - one
            if not merge:
                js, je = j, j + 1
            elif js < 0:
                js = j
                continue
            else:
                je = j
            # The interval of key blocks [js, je): keys [ks, ke), tiles from a0.
            a0 = ka[js]
            ks = kb[js]
            ke = kb[je]
            keys += ke - ks
            kl0 = ks - a0                  # the first tile's lo
            khl = ke - a0                  # the last tile's hi, if the first is the last
            n = 1
            tl = a0
            sh = 0
            if khl <= tk and a0 <= lim:    # one tile, inside the padded length
                kv, fl, fh = a0, kl0, khl
            else:
                n = _nb_tiles(js, je, kb, ka, tk, ltk)
                tl = a0 + (n - 1) * tk     # the last tile's start, before any shift
                khl = ke - tl
                sh = tl - lim              # > 0: the last tile is shifted back inside kvp
                if n > 1:
                    kv, fl, fh = a0, kl0, tk
                else:
                    kv, fl, fh = tl - sh, kl0 + sh, khl + sh
            # The first tile: joins the last row if that is the same tile and fits.
            if kv == pk and (not two or fl == pe):
                if fl == pe:
                    pe = fh
                    fullk += (not two) & (pa == 0) & (pe == tk)
                else:
                    two = True
                    pb = pe
                    pc = fl
                    pe = fh
                if write:
                    steps[s - 1, _RECT] = rows | (pa << _KV_LO) | (pe << _KV_HI)
                    if two:
                        steps[s - 1, _CUTS_A] = grid_a | (pb << 24)
                        steps[s - 1, _CUTS_B] = pc | (pe << 8) | (5 << _BITS)
            else:
                if write:
                    _nb_put(steps, s, kv, rows | (fl << _KV_LO) | (fh << _KV_HI))
                fullk += (fl == 0) & (fh == tk)
                rev += kv == pk
                pk, pa, pe, two = kv, fl, fh, False
                s += 1
            if n > 1:
                if write:
                    for r in range(1, n - 1):
                        _nb_put(steps, s + r - 1, a0 + r * tk, mid)
                s += n - 2
                fullk += n - 2
                if sh > 0:
                    kv, fl, fh = tl - sh, sh, khl + sh
                else:
                    kv, fl, fh = tl, 0, khl
                if write:
                    _nb_put(steps, s, kv, rows | (fl << _KV_LO) | (fh << _KV_HI))
                fullk += (fl == 0) & (fh == tk)
                pk, pa, pe, two = kv, fl, fh, False
                s += 1
            js = -1
    return s, fullk, keys, rev


def _nb_count(lo, hi, words, ugh, ugi, merge, kb, ka, tk, ltk, lim, cnt):
    """Exact step rows of units [lo, hi) (when the bound is too large to reserve): ``_nb_fill``
    counting."""
    z = np.zeros(len(cnt), np.int64)
    _nb_fill(lo, hi, 0, words, ugh, ugi, merge, z, z, kb, ka, tk, ltk, lim, False,
             np.zeros((1, 4), np.int32), cnt, np.zeros(len(cnt), np.int64),
             np.zeros(len(cnt), np.int64), np.zeros(len(cnt), np.int64),
             np.zeros(len(cnt), np.int64), False)


def _nb_pack(lo, hi, b8, out):
    """Rows [lo, hi) of bool rows seen as uint64 (8 flags per word) -> packed words."""
    n8 = b8.shape[1]
    low, magic = np.uint64(0x0101010101010101), np.uint64(0x0102040810204080)
    for r in range(lo, hi):
        for k in range(out.shape[1]):
            acc = np.uint64(0)
            for t in range(min(8, n8 - 8 * k)):
                byte = ((b8[r, 8 * k + t] & low) * magic) >> np.uint64(56)
                acc |= byte << np.uint64(8 * t)
            out[r, k] = acc


def _nb_row_index(lo, hi, uh, qs, own_lo, own_hi, uidx, tile_q, sentinel, out):
    """row_index rows of query heads [lo, hi), written in order: the owning unit row, else the
    sentinel. Units come sorted by (head, first owned row); uidx: their schedule index."""
    U, Lq = len(uh), out.shape[1]
    u = 0
    while u < U and uh[u] < lo:
        u += 1
    for h in range(lo, hi):
        i = 0
        while u < U and uh[u] == h:
            a, b = qs[u] + own_lo[u], qs[u] + own_hi[u]
            for x in range(i, a):
                out[h, x] = sentinel
            base = uidx[u] * tile_q - qs[u]
            for x in range(a, b):
                out[h, x] = base + x
            i = b
            u += 1
        for x in range(i, Lq):
            out[h, x] = sentinel


def _nb_units(qb, gi, ge, tq, q_align, qp):
    """``_chunk`` of the row groups' rows [qb[gi], qb[ge]): (group, q_start, lo, hi) per unit."""
    G = len(gi)
    U = 0
    for g in range(G):
        a0 = qb[gi[g]] - qb[gi[g]] % q_align
        U += (qb[ge[g]] - a0 + tq - 1) // tq
    ug = np.empty(U, np.int64)
    qs = np.empty(U, np.int64)
    qlo = np.empty(U, np.int64)
    qhi = np.empty(U, np.int64)
    u = 0
    for g in range(G):
        s, e = qb[gi[g]], qb[ge[g]]
        a0 = s - s % q_align
        n = (e - a0 + tq - 1) // tq
        for k in range(n):
            ug[u + k] = g
            qs[u + k] = a0 + k * tq
            qlo[u + k] = 0
            qhi[u + k] = tq
        qlo[u] = s - a0
        last = u + n - 1
        qhi[last] = e - qs[last]
        shift = qs[last] + tq - qp
        if shift > 0:                      # the last tile is shifted back inside qp
            qs[last] -= shift
            qhi[last] += shift
            qlo[last] += shift
        u += n
    return ug, qs, qlo, qhi


# --- tiles once ------------------------------------------------------------------------
# A unit's pieces (one rectangle in one K/V tile each) come in non-decreasing kv_start (keys in
# order; the rectangles of one key segment cut tile by tile), so the pieces of one tile are
# consecutive rows. The step loops write pieces as plain rows; ``_nb_tiles_once`` then scans
# the unit's rows (in cache) for a repeated kv_start and, where it finds one, joins the pieces
# of each tile greedily: the next piece joins the step while the union stays a GRID x GRID
# grid (at most 5 distinct row bounds and 5 distinct key bounds, the grid kept normalised: no
# cut between two equal rows or columns of cells; ``_nb_acc_add``), else it starts the next
# step. The spec, in plain Python: ``plan_oracle.tiles_once``.
# acc (int64 [16]) is the step being built: 1 kv_start, 2 nR, 3..7 row bounds R, 8 nK,
# 9..13 key bounds K, 14 bits (bit 4 i + j: row segment i x key segment j selected).
_ACC_LEN = 16


def _nb_put(steps, s, kv, rect):
    """Writes row s of ``steps`` as a plain step: K/V tile ``kv``, packed rectangle ``rect``."""
    steps[s, _KV_START] = kv
    steps[s, _RECT] = rect
    steps[s, _CUTS_A] = 0
    steps[s, _CUTS_B] = 0


def _nb_store(acc, steps, s):
    """Writes the step ``acc`` as row s (a plain step when it is one cell)."""
    nR, nK = acc[2], acc[8]
    ql, qh = acc[3], acc[2 + nR]
    kl, kh = acc[9], acc[8 + nK]
    _nb_put(steps, s, acc[1], ql | (qh << _Q_HI) | (kl << _KV_LO) | (kh << _KV_HI))
    if nR > 2 or nK > 2:
        q2 = acc[5] if nR > 3 else qh
        q3 = acc[6] if nR > 4 else qh
        k2 = acc[11] if nK > 3 else kh
        k3 = acc[12] if nK > 4 else kh
        steps[s, _CUTS_A] = acc[4] | (q2 << 8) | (q3 << 16) | (acc[10] << 24)
        steps[s, _CUTS_B] = k2 | (k3 << 8) | (acc[14] << _BITS)


def _nb_acc_bound(acc, o, v):
    """Inserts bound v into the sorted bounds at acc[o + 1 : o + 1 + acc[o]] (rows: o = 2,
    keys: o = 8) unless present, remapping the cell bits (a bound inside splits a segment into
    two equal ones, one outside adds an empty segment); returns its index."""
    n = acc[o]
    p = 0
    while p < n and acc[o + 1 + p] < v:
        p += 1
    if p < n and acc[o + 1 + p] == v:
        return p
    for t in range(n, p, -1):
        acc[o + 1 + t] = acc[o + t]
    acc[o + 1 + p] = v
    acc[o] = n + 1
    bits = acc[14]
    if o == 2:                                 # rows: 4-bit rows of bits
        if p == 0:
            bits <<= 4
        elif p < n:
            bits = (bits & ((1 << (4 * p)) - 1)) | ((bits >> (4 * (p - 1))) << (4 * p))
    else:                                      # keys: bit j of each 4-bit row
        if p == 0:
            bits <<= 1
        elif p < n:
            lo = ((1 << p) - 1) * 0x1111
            hi = (0xF ^ ((1 << (p - 1)) - 1)) * 0x1111
            bits = (bits & lo) | ((bits & hi) << 1)
    acc[14] = bits
    return p


def _nb_acc_add(acc, ra, rb, kl, kh):
    """Adds rectangle rows [ra, rb) x keys [kl, kh) (disjoint from what the step holds) if the
    union stays a GRID x GRID grid; returns whether it did (``_nb_acc_two`` when the step is
    one rectangle: that always fits)."""
    nR, nK = acc[2], acc[8]
    need = nR + 2
    for t in range(nR):
        if acc[3 + t] == ra or acc[3 + t] == rb:
            need -= 1
    if need > 5:
        return False
    need = nK + 2
    for t in range(nK):
        if acc[9 + t] == kl or acc[9 + t] == kh:
            need -= 1
    if need > 5:
        return False
    _nb_acc_bound(acc, 2, ra)
    _nb_acc_bound(acc, 2, rb)
    _nb_acc_bound(acc, 8, kl)
    _nb_acc_bound(acc, 8, kh)
    nR, nK = acc[2], acc[8]
    i0 = 0
    while acc[3 + i0] != ra:
        i0 += 1
    i1 = i0
    while acc[3 + i1] != rb:
        i1 += 1
    j0 = 0
    while acc[9 + j0] != kl:
        j0 += 1
    j1 = j0
    while acc[9 + j1] != kh:
        j1 += 1
    bits = acc[14]
    col = ((1 << j1) - 1) ^ ((1 << j0) - 1)
    for i in range(i0, i1):
        bits |= col << (4 * i)
    _nb_acc_norm(acc, bits, nR, nK)
    return True


def _nb_sort4(a, b, c, d):
    """a, b, c, d sorted (a sorting network of five compare-exchanges)."""
    if a > b:
        a, b = b, a
    if c > d:
        c, d = d, c
    if a > c:
        a, c = c, a
    if b > d:
        b, d = d, b
    if b > c:
        b, c = c, b
    return a, b, c, d


def _nb_two_bounds(acc, o, x0, x1, y0, y1):
    """The distinct values of x0 < x1 and y0 < y1, in order, to acc[o + 1:], their count to
    acc[o]; returns the indices of x0, x1, y0, y1 among them (branch-free)."""
    a, b, c, d = _nb_sort4(x0, x1, y0, y1)
    nb = np.int64(b != a)
    nc = np.int64(c != b)
    nd = np.int64(d != c)
    acc[o + 1] = a
    acc[o + 1 + nb] = b
    acc[o + 1 + nb + nc] = c
    acc[o + 1 + nb + nc + nd] = d
    acc[o] = 1 + nb + nc + nd
    return ((a < x0) + nb * (b < x0) + nc * (c < x0) + nd * (d < x0),
            (a < x1) + nb * (b < x1) + nc * (c < x1) + nd * (d < x1),
            (a < y0) + nb * (b < y0) + nc * (c < y0) + nd * (d < y0),
            (a < y1) + nb * (b < y1) + nc * (c < y1) + nd * (d < y1))


def _nb_acc_two(acc, ra, rb, kl, kh):
    """``_nb_acc_add`` when the step is one rectangle: two disjoint rectangles always fit a
    grid, normalised already unless they share a whole side (then they are one rectangle)."""
    a0, a1, c0, c1 = acc[3], acc[4], acc[9], acc[10]
    if ra == a0 and rb == a1 and (kl == c1 or kh == c0):
        acc[9] = min(c0, kl)
        acc[10] = max(c1, kh)
        return True
    if kl == c0 and kh == c1 and (ra == a1 or rb == a0):
        acc[3] = min(a0, ra)
        acc[4] = max(a1, rb)
        return True
    i0, i1, i2, i3 = _nb_two_bounds(acc, 2, a0, a1, ra, rb)
    j0, j1, j2, j3 = _nb_two_bounds(acc, 8, c0, c1, kl, kh)
    bits = (((1 << j1) - 1) ^ ((1 << j0) - 1)) * ((((1 << (4 * i1)) - 1)
                                                  ^ ((1 << (4 * i0)) - 1)) & 0x1111)
    bits |= (((1 << j3) - 1) ^ ((1 << j2) - 1)) * ((((1 << (4 * i3)) - 1)
                                                   ^ ((1 << (4 * i2)) - 1)) & 0x1111)
    acc[14] = bits
    return True


def _nb_acc_norm(acc, bits, nR, nK):
    """Sets acc's cell bits to ``bits`` over its nR row and nK key bounds, normalised: every
    interior cut between two equal columns of cells, then rows, dropped."""
    rm = ((1 << (4 * (nR - 1))) - 1) & 0x1111
    for j in range(nK - 2, 0, -1):
        if ((bits >> (j - 1)) & rm) == ((bits >> j) & rm):
            keep = ((1 << j) - 1) * 0x1111
            high = (((1 << (nK - 2)) - 1) ^ ((1 << j) - 1)) * 0x1111
            bits = (bits & keep) | ((bits >> 1) & high)
            for t in range(j, nK - 1):
                acc[9 + t] = acc[10 + t]
            nK -= 1
    for i in range(nR - 2, 0, -1):
        if ((bits >> (4 * (i - 1))) & 0xF) == ((bits >> (4 * i)) & 0xF):
            bits = (bits & ((1 << (4 * i)) - 1)) | ((bits >> (4 * (i + 1))) << (4 * i))
            for t in range(i, nR - 1):
                acc[3 + t] = acc[4 + t]
            nR -= 1
    acc[2] = nR
    acc[8] = nK
    acc[14] = bits


def _nb_scratch(n):
    """int32 [n, STEP_COLS] zeros, for step rows (interpreted: stores wrap as compiled)."""
    return np.zeros((n, 4), np.int32)


def _nb_tiles_once(src, n, dst, d0, write, tq, tk, acc):
    """Tiles once for the pieces src[:n] of one unit (plain rows in non-decreasing kv_start):
    the pieces of each K/V tile joined into grid steps, the steps written to dst[d0:] (with
    ``write``). Returns (steps, full steps made by joining: a piece that shares its tile is
    never full, one alone is copied as it is; revisits: steps of a tile after its first, where
    its pieces need more than one grid; the first step of the first tile revisited, from
    d0)."""
    r = 1
    while r < n and src[r, _KV_START] != src[r - 1, _KV_START]:
        r += 1
    if r >= n:
        if write:
            for x in range(n):
                for c in range(4):
                    dst[d0 + x, c] = src[x, c]
        return n, np.int64(0), np.int64(0), np.int64(0)
    o = d0
    full = 0
    rev = 0
    fr = 0
    if write:
        for x in range(r - 1):
            for c in range(4):
                dst[o + x, c] = src[x, c]
    o += r - 1
    x = r - 1
    while x < n:
        kv = src[x, _KV_START]
        if x + 1 >= n or src[x + 1, _KV_START] != kv:      # alone in its tile
            if write:
                for c in range(4):
                    dst[o, c] = src[x, c]
            o += 1
            x += 1
            continue
        acc[1] = -1                            # the pieces of this tile, joined greedily
        while x < n and src[x, _KV_START] == kv:
            rect = np.int64(src[x, _RECT])
            ra = rect & 0xFF
            rb = (rect >> _Q_HI) & 0xFF
            kl = (rect >> _KV_LO) & 0xFF
            kh = (rect >> _KV_HI) & 0xFF
            x += 1
            if acc[1] >= 0:
                if acc[2] == 2 and acc[8] == 2:    # the step is one rectangle: always joins
                    _nb_acc_two(acc, ra, rb, kl, kh)
                    continue
                if _nb_acc_add(acc, ra, rb, kl, kh):
                    continue
            if acc[1] >= 0:                     # the next step of this tile
                if rev == 0:
                    fr = o - d0
                if write:
                    _nb_store(acc, dst, o)
                full += _nb_acc_full(acc, tq, tk)
                o += 1
                rev += 1
            acc[1] = kv
            acc[2] = 2
            acc[3] = ra
            acc[4] = rb
            acc[8] = 2
            acc[9] = kl
            acc[10] = kh
            acc[14] = 1
        if write:
            _nb_store(acc, dst, o)
        full += _nb_acc_full(acc, tq, tk)
        o += 1
    return o - d0, np.int64(full), np.int64(rev), np.int64(fr)


def _nb_acc_full(acc, tq, tk):
    """1 if the step acc is the whole tile, one cell (a full step), else 0."""
    return np.int64((acc[2] == 2) & (acc[8] == 2) & (acc[3] == 0) & (acc[4] == tq)
                    & (acc[9] == 0) & (acc[10] == tk))


# --- bitmap steps: one step per (unit, K/V tile) ------------------------------------------
# ``_nb_tiles_once`` (and ``_nb_fill``'s join) leave several steps of one tile where its pieces
# need more than a 4 x 4 grid (1-8 token blocks); the step loops count those revisits as they
# write. ``_nb_bm_unit`` leaves one row per tile in a unit's rows and logs the steps of each
# revisited tile: ``_nb_rects`` calls it on a unit that has any as it writes (the rows still in
# cache), ``_nb_bm_ranges`` on step ranges written before (keep/merge's, and those of the plans
# whose heads the planner chooses first). Once all step rows are written (and their end
# known), ``_nb_bm_pass`` makes each logged tile one step selecting their union, built in a
# bitmap bm of 64-key lanes (int64 [nl * tq], nl = ceil(tk / 64); bit c % 64 of
# bm[(c // 64) * tq + r] is entry (r, c)): a plain step if the union is a rectangle, a grid
# step if its normalised grid (a cut before each row, or column, unlike the one before it) has
# at most 4 x 4 cells, else a bitmap step (``abi.BITMAP_FLAG``), whose words (the ABI's 32-key
# words: lane halves) follow all the step rows. Units without revisits pay one comparison a
# row. The spec, in plain Python: ``plan_oracle.bitmap_steps``.
def _nb_bm_rect(bm, tq, a, b, c, d):
    """ORs rows [a, b) x keys [c, d) into the bitmap bm."""
    if a >= b or c >= d:
        return
    for ln in range(c >> 6, ((d - 1) >> 6) + 1):
        lo = max(c - 64 * ln, 0)
        hi = min(d - 64 * ln, 64)
        m = -(np.int64(1) << lo)               # keys >= lo of the lane
        if hi < 64:
            m &= (np.int64(1) << hi) - 1
        base = ln * tq
        for r in range(a, b):
            bm[base + r] |= m


def _nb_bm_cut(lo, c1, c2, c3, hi, i):
    """Bound i (0..4) of the segments [lo, c1, c2, c3, hi]."""
    if i == 0:
        return lo
    if i == 1:
        return c1
    if i == 2:
        return c2
    if i == 3:
        return c3
    return hi


def _nb_bm_add(bm, src, x, tq, lo, hi):
    """ORs the selection of step row x of src, in rows [lo, hi), into bm: a plain step's
    rectangle, a grid step's selected cells (each clipped to the rectangle, as
    ``abi.grid_mask``)."""
    rect = np.int64(src[x, _RECT])
    ca = np.int64(src[x, _CUTS_A])
    cb = np.int64(src[x, _CUTS_B])
    ql = max(rect & 0xFF, lo)
    qh = min((rect >> _Q_HI) & 0xFF, hi)
    kl = (rect >> _KV_LO) & 0xFF
    kh = (rect >> _KV_HI) & 0xFF
    if cb == 0:
        _nb_bm_rect(bm, tq, ql, qh, kl, kh)
        return
    q1, q2, q3 = ca & 0xFF, (ca >> 8) & 0xFF, (ca >> 16) & 0xFF
    k1, k2, k3 = (ca >> 24) & 0xFF, cb & 0xFF, (cb >> 8) & 0xFF
    bits = (cb >> _BITS) & 0xFFFF
    for i in range(4):                         # each row segment: its cells' keys, lane by
        ra = max(_nb_bm_cut(ql, q1, q2, q3, qh, i), ql)     # lane, ORed into its rows once
        rb = min(_nb_bm_cut(ql, q1, q2, q3, qh, i + 1), qh)
        sel = (bits >> (4 * i)) & 0xF
        if ra >= rb or sel == 0 or kl >= kh:
            continue
        for ln in range(kl >> 6, ((kh - 1) >> 6) + 1):
            m = np.int64(0)
            for j in range(4):
                if (sel >> j) & 1:
                    c0 = max(max(_nb_bm_cut(kl, k1, k2, k3, kh, j), kl) - 64 * ln, 0)
                    c1 = min(min(_nb_bm_cut(kl, k1, k2, k3, kh, j + 1), kh) - 64 * ln, 64)
                    if c0 < c1:
                        mm = -(np.int64(1) << c0)           # keys >= c0 of the lane
                        if c1 < 64:
                            mm &= (np.int64(1) << c1) - 1
                        m |= mm
            if m != 0:
                base = ln * tq
                for r in range(ra, rb):
                    bm[base + r] |= m


def _nb_bm_union(bm, src, x, y, tq, tk):
    """ORs the selections of step rows [x, y) of src (one tile's) into bm; returns the bounds
    of their rectangles (rows [r0, r1), keys [c0, c1)) and whether they are ``uniform``: all of
    one row segment over the same rows (keep/merge), when only row r0 is written (the union's
    rows are all alike)."""
    r0 = tq
    r1 = 0
    c0 = tk
    c1 = 0
    uniform = True
    for z in range(x, y):
        rect = np.int64(src[z, _RECT])
        a, b = rect & 0xFF, (rect >> _Q_HI) & 0xFF
        if z > x and (a != r0 or b != r1):
            uniform = False
        if (src[z, _CUTS_B] != 0
                and (np.int64(src[z, _CUTS_A]) & 0xFFFFFF) != b | (b << 8) | (b << 16)):
            uniform = False
        r0 = min(r0, a)
        r1 = max(r1, b)
        c0 = min(c0, (rect >> _KV_LO) & 0xFF)
        c1 = max(c1, (rect >> _KV_HI) & 0xFF)
    for z in range(x, y):
        _nb_bm_add(bm, src, z, tq, r0, r0 + 1 if uniform else tq)
    return r0, r1, c0, c1, uniform


def _nb_bm_emit(bm, kv, dst, s, tq, col, tr, cuts, r0, r1, l0, l1, uniform):
    """Writes the union in bm (non-empty, inside rows [r0, r1) and lanes [l0, l1); with
    ``uniform``, rows [r0, r1) all alike and only row r0 in bm) as step row s of dst: plain or
    grid where its normalised grid has at most 4 x 4 cells, else a bitmap step (its words'
    offset left 0: ``_nb_bm_pass``). Returns whether it is a bitmap step."""
    nl = col.shape[0]
    for ln in range(nl):
        col[ln] = 0
        tr[ln] = 0
    ql = -1
    qh = 0
    nd = 0                                     # rows unlike the one before (first 5 kept)
    for r in range(r0, r0 + 1 if uniform else min(r1 + 1, tq)):   # (and the row after it)
        a = np.int64(0)
        carry = np.int64(0)
        diff = False
        for ln in range(l0, l1):
            x = bm[ln * tq + r]
            a |= x
            col[ln] |= x
            tr[ln] |= x ^ ((x << 1) | carry)   # bit c: key c unlike key c - 1 in this row
            carry = (x >> 63) & 1
            if r > 0 and x != bm[ln * tq + r - 1]:
                diff = True
        if a != 0:
            if ql < 0:
                ql = r
            qh = r + 1
        if diff:
            if nd < 5:
                cuts[nd] = r
            nd += 1
    if uniform:                                # row r0 all through, then none
        qh = r1
        if r1 < tq:
            cuts[nd] = r1
            nd += 1
    # Row cuts inside the box: the changes but the box's first row (ql > 0) and its end.
    skip = 1 if ql > 0 else 0
    nr = nd - skip - (1 if qh < tq else 0)
    q1 = cuts[skip] if nr > 0 else qh
    q2 = cuts[skip + 1] if nr > 1 else qh
    q3 = cuts[skip + 2] if nr > 2 else qh
    kl = -1
    kh = 0
    for ln in range(nl):
        x = col[ln]
        if x != 0:
            if kl < 0:
                kl = 64 * ln + np.int64(_nb_ctz(x))
            b = 63
            while not (x >> b) & 1:
                b -= 1
            kh = 64 * ln + b + 1
    nk = 0                                     # key cuts: a column unlike the one before
    k1 = kh
    k2 = kh
    k3 = kh
    for ln in range(nl):
        t = tr[ln]
        while t != 0 and nk <= 3:
            c = 64 * ln + np.int64(_nb_ctz(t))
            t &= t - 1
            if kl < c < kh:
                nk += 1
                if nk == 1:
                    k1 = c
                elif nk == 2:
                    k2 = c
                elif nk == 3:
                    k3 = c
    # The bounding box: a plain step if it is all selected (no cut), else cuts or words.
    _nb_put(dst, s, kv, ql | (qh << _Q_HI) | (kl << _KV_LO) | (kh << _KV_HI))
    words = nr > 3 or nk > 3
    if words:                                  # a bitmap step
        dst[s, _CUTS_B] = _BITMAP
    elif nr > 0 or nk > 0:                     # a grid step: the cell of each segment pair
        bits = 0
        for i in range(nr + 1):
            r = _nb_bm_cut(ql, q1, q2, q3, qh, i)
            for j in range(nk + 1):
                c = _nb_bm_cut(kl, k1, k2, k3, kh, j)
                if (bm[(c >> 6) * tq + r] >> (c & 63)) & 1:
                    bits |= 1 << (4 * i + j)
        dst[s, _CUTS_A] = q1 | (q2 << 8) | (q3 << 16) | (k1 << 24)
        dst[s, _CUTS_B] = k2 | (k3 << 8) | (bits << _BITS)
    return words


def _nb_bm_unit(steps, s0, n, x0, u, log, nlog, ntile):
    """One step per K/V tile for the rows steps[s0 : s0 + n] of unit u (non-decreasing
    kv_start, the rows of a revisited tile consecutive, none before row x0), in place: a tile
    visited once keeps its row, the rows of a revisited tile become one row (its kv_start, the
    rest left to ``_nb_bm_pass``, which writes the step selecting their union), and the rows
    freed at the end are zeroed. Each revisited tile is logged in ``log`` from row ``nlog``: a
    row (its row, its rows' count, u, 0), then its rows (at most 3 n / 2 log rows in all,
    which the log must have), and counted in ``ntile``. Returns (rows, nlog, ntile). (The log
    is never grown here: an array reassigned in a compiled loop costs ~1 us a call.)"""
    end = s0 + n
    s = x0
    x = x0
    while x < end:
        kv = steps[x, _KV_START]
        y = x + 1
        while y < end and steps[y, _KV_START] == kv:
            y += 1
        if y == x + 1:                         # visited once: the row as it is
            if s < x:
                for c in range(4):
                    steps[s, c] = steps[x, c]
        else:                                  # logged; one row for the pass to write
            if nlog + 1 + y - x > log.shape[0]:     # (never: the callers size it)
                raise RuntimeError("planner: the bitmap pass's log is too small")
            log[nlog, 0] = s
            log[nlog, 1] = y - x
            log[nlog, 2] = u
            log[nlog, 3] = 0
            for z in range(x, y):
                for c in range(4):
                    log[nlog + 1 + z - x, c] = steps[z, c]
            nlog += 1 + y - x
            ntile += 1
            _nb_put(steps, s, kv, 0)
        s += 1
        x = y
    for r in range(s, end):
        for c in range(4):
            steps[r, c] = 0
    return s - s0, nlog, ntile


def _nb_bm_pass(log, nlog, shift, steps, w0, tq, tk, ujoin):
    """The steps of the revisited tiles logged by ``_nb_bm_unit`` in log[:nlog]: each the
    union of its tile's logged rows (``_nb_bm_union``) written at its row (the logged one +
    ``shift``, where its part of the rows moved) by ``_nb_bm_emit``; a bitmap step's words
    written one bitmap (``abi.bitmap_rows`` rows) after the other from int32 offset w0 of
    ``steps`` (a multiple of 4, on zero rows: only the union's rows are written), its CUTS_A
    that offset; ``ujoin[u]`` counts the unions of unit u that are the whole tile (full
    steps). Returns the bitmap steps."""
    nw = (tk + 31) >> 5
    size = 4 * ((nw * tq + 3) >> 2)            # int32s of one bitmap, padded to whole rows
    nl = (tk + 63) >> 6
    bm = np.zeros(nl * tq, np.int64)
    col = np.zeros(nl, np.int64)
    tr = np.zeros(nl, np.int64)
    cuts = np.zeros(5, np.int64)
    full = (tq << _Q_HI) | (tk << _KV_HI)      # STEP_RECT of the whole tile, as an int32
    if full >= 1 << 31:
        full -= 1 << 32
    flat = steps.reshape(steps.size)           # (C-contiguous: a view)
    i = 0
    k = 0
    while i < nlog:
        m = log[i, 1]
        s = log[i, 0] + shift
        r0, r1, c0, c1, uniform = _nb_bm_union(bm, log, i + 1, i + 1 + m, tq, tk)
        l0, l1 = c0 >> 6, ((c1 - 1) >> 6) + 1
        if _nb_bm_emit(bm, log[i + 1, _KV_START], steps, s, tq, col, tr, cuts, r0, r1, l0, l1,
                       uniform):
            off = w0 + k * size
            steps[s, _CUTS_A] = off
            for w in range(nw):
                base = (w >> 1) * tq
                sh = 32 * (w & 1)
                o = off + w * tq
                if uniform:
                    v = (bm[base + r0] >> sh) & 0xFFFFFFFF
                    for r in range(r0, r1):
                        flat[o + r] = v
                else:
                    for r in range(r0, r1):
                        flat[o + r] = (bm[base + r] >> sh) & 0xFFFFFFFF
            k += 1
        elif steps[s, _CUTS_B] == 0 and np.int64(steps[s, _RECT]) == full:
            ujoin[log[i, 2]] += 1
        for ln in range(l0, l1):               # bm back to zeros
            for r in range(r0, r0 + 1 if uniform else r1):
                bm[ln * tq + r] = 0
        i += 1 + m
    return k


def _nb_bm_shift(log, nlog, shift, steps, d):
    """Subtracts d from the words' offset (CUTS_A) of the bitmap steps logged in log[:nlog]
    (rows: the logged ones + ``shift``): their words moved d int32s down."""
    i = 0
    while i < nlog:
        s = log[i, 0] + shift
        if steps[s, _CUTS_B] == _BITMAP:
            steps[s, _CUTS_A] -= d
        i += 1 + log[i, 1]


def _nb_bm_ranges(lo, hi, src, rs, rn, rrev, dst, row0, nptr, ncnt, wmax):
    """Rows written without the bitmap pass (``planner._bitmap_steps``) made ready for it: the step ranges src[rs[i] : rs[i] + rn[i]] (i in [lo, hi); rows in
    non-decreasing kv_start each, rrev[i] revisits) copied to dst one after the other from row
    row0, those that revisit a tile through ``_nb_bm_unit`` (the range as its unit);
    ``nptr``, ``ncnt``: each range's first row and rows. Returns (end row, log, log rows,
    revisited tiles) (the log sized by ``wmax``: at least the rows of the ranges that revisit a
    tile)."""
    log = np.empty((((3 * wmax) >> 1) + 1, 4), np.int32)     # lazily backed
    nlog = 0
    ntile = 0
    s = row0
    for i in range(lo, hi):
        p = rs[i]
        n = rn[i]
        for x in range(n):
            for c in range(4):
                dst[s + x, c] = src[p + x, c]
        nptr[i] = s
        if rrev[i]:
            n, nlog, ntile = _nb_bm_unit(dst, s, n, s, i, log, nlog, ntile)
        ncnt[i] = n
        s += n
    return s, log, nlog, ntile


def _nb_emit(s, ra, rb, c0, c1, anchor, tq, tk, ltk, kvp, write, steps):
    """A rectangle (rows [ra, rb), keys [c0, c1) from ``anchor``) cut into tiles at anchor +
    t * tk, a last tile crossing kvp shifted back (only the last can): written from steps[s]
    (or only counted). Returns (end row, full tiles, selected interactions).

    Its common case (one tile, not shifted) is written out by hand in the ``_nb_rects_*``
    loops: a shared helper inlined by numba measured ~10% slower on the two-group loop
    (random top-k, pack/split 128x128: 62 vs 56 ms on this 2-core box)."""
    if ltk >= 0:
        t0, t1 = c0 >> ltk, ((c1 - 1) >> ltk) + 1
    else:
        t0, t1 = c0 // tk, (c1 - 1) // tk + 1
    if not write:
        return s + t1 - t0, 0, 0
    rows_full = (ra == 0) & (rb == tq)
    rows = ra | (rb << _Q_HI)              # the rectangle's row bytes (STEP_RECT)
    full = 0
    ts = t0 * tk + anchor
    kl = c0 + anchor - ts                  # only the first tile can start late
    for _ in range(t1 - t0 - 1):           # all tiles but the last end at the tile's end
        _nb_put(steps, s, ts, rows | (kl << _KV_LO) | (tk << _KV_HI))
        full += rows_full & (kl == 0)
        kl = 0
        ts += tk
        s += 1
    kh = c1 + anchor - ts
    sh = max(ts + tk - kvp, 0)
    _nb_put(steps, s, ts - sh, rows | ((kl + sh) << _KV_LO) | ((kh + sh) << _KV_HI))
    full += rows_full & (kl + sh == 0) & (kh + sh == tk)
    return s + 1, full, (rb - ra) * (c1 - c0)


def _nb_emit_more(s, firsts, lasts, rlo, rhi, xa, xb, c0, c1, anchor, tq, tk, ltk, kvp,
                  write, steps):
    """``_nb_emit`` of the rectangles of one segment whose first / last groups are the bits
    of ``firsts`` / ``lasts`` (rows rlo[first] to rhi[last]; empty ones dropped), tile by tile
    (``_nb_emit_tiles``) when the segment spans several tiles."""
    one = np.uint64(1)
    full = 0
    sel_area = 0
    nr = 0
    while firsts:
        ra = rlo[np.int64(_nb_ctz(firsts))]
        rb = rhi[np.int64(_nb_ctz(lasts))]
        firsts &= firsts - one
        lasts &= lasts - one
        if ra < rb:
            xa[nr] = ra
            xb[nr] = rb
            nr += 1
    if nr > 1:
        return _nb_emit_tiles(s, xa, xb, nr, c0, c1, anchor, tq, tk, ltk, kvp, write, steps)
    if nr == 1:
        return _nb_emit(s, xa[0], xb[0], c0, c1, anchor, tq, tk, ltk, kvp, write, steps)
    return s, full, sel_area


def _nb_emit_tiles(s, xa, xb, nr, c0, c1, anchor, tq, tk, ltk, kvp, write, steps):
    """``_nb_emit`` of the rectangles rows [xa[r], xb[r]) (r < nr) of one key segment, in tile
    order (all the rectangles' pieces in a tile, then the next tile), so that the pieces of one
    K/V tile come one after the other (``_nb_tiles_once``)."""
    if ltk >= 0:
        t0, t1 = c0 >> ltk, ((c1 - 1) >> ltk) + 1
    else:
        t0, t1 = c0 // tk, (c1 - 1) // tk + 1
    if not write:
        return s + (t1 - t0) * nr, 0, 0
    full = 0
    ts = t0 * tk + anchor
    for _ in range(t0, t1):
        kl = max(c0 + anchor - ts, 0)
        kh = min(c1 + anchor - ts, tk)
        sh = max(ts + tk - kvp, 0)
        for r in range(nr):
            ra, rb = xa[r], xb[r]
            _nb_put(steps, s, ts - sh,
                    ra | (rb << _Q_HI) | ((kl + sh) << _KV_LO) | ((kh + sh) << _KV_HI))
            full += (ra == 0) & (rb == tq) & (kl + sh == 0) & (kh + sh == tk)
            s += 1
        ts += tk
    area = 0
    for r in range(nr):
        area += (xb[r] - xa[r]) * (c1 - c0)
    return s, full, area


def _nb_rects_one(u, s, w2, r, ra, rb, kb, ka, grid, tq, tk, ltk, kvp, write, steps, nfull,
                  area):
    """``_nb_rects`` for a unit of one row group (row r of w2; rows [ra, rb) of the tile): one
    rectangle per run of its key blocks. Returns the end row."""
    W = w2.shape[1]
    one, top, zero = np.uint64(1), np.uint64(63), np.uint64(0)
    lim = kvp - tk
    rows_full = (ra == 0) & (rb == tq)
    full = 0
    keys = 0                               # selected keys of one-tile rectangles
    sel_area = 0                           # selected interactions of the others
    if ra < rb:
        carry = zero
        js = -1
        for k in range(W + 1):
            w = w2[r, k] if k < W else zero
            b = w ^ ((w << one) | carry)
            carry = w >> top
            while b:
                j = k * 64 + np.int64(_nb_ctz(b))
                b &= b - one
                if js < 0:
                    js = j
                    continue
                anchor = 0 if grid else ka[js]
                c0, c1 = kb[js] - anchor, kb[j] - anchor
                if ltk >= 0:
                    t0 = c0 >> ltk
                else:
                    t0 = c0 // tk
                ts = t0 * tk
                if c1 - ts <= tk and ts + anchor <= lim:    # one tile, not shifted
                    if write:
                        _nb_put(steps, s, ts + anchor, (ra | (rb << _Q_HI) | ((c0 - ts) << _KV_LO)
                                                        | ((c1 - ts) << _KV_HI)))
                        full += (c0 == ts) & (c1 - ts == tk)
                        keys += c1 - c0
                    s += 1
                else:
                    s, f, a = _nb_emit(s, ra, rb, c0, c1, anchor, tq, tk, ltk, kvp, write,
                                       steps)
                    full += f
                    sel_area += a
                js = -1
    if write:
        nfull[u] = full if rows_full else 0
        area[u] = sel_area + (rb - ra) * keys
    return s


def _nb_rects_two(u, s, w2, x0, x1, ra0, rb0, ra1, rb1, touch, kb, ka, grid, tq, tk, ltk,
                  kvp, write, steps, nfull, area, xa, xb):
    """``_nb_rects`` for a unit of two row groups (rows x0, x1 of w2; rows [ra0, rb0) and
    [ra1, rb1) of the tile, clipped; ``touch``: the second starts where the first ends), their
    words and selecting pattern kept in registers. Returns the end row."""
    W = w2.shape[1]
    one, top, zero = np.uint64(1), np.uint64(63), np.uint64(0)
    lim = kvp - tk
    full = 0
    sel_area = 0
    prev = -1                              # previous boundary, if inside the union
    anchor = 0
    sel = 0                                # groups selecting the segment from prev (bits)
    c0w = zero
    c1w = zero
    for k in range(W + 1):
        if k < W:
            w0 = w2[x0, k]
            w1 = w2[x1, k]
        else:
            w0 = zero
            w1 = zero
        b = (w0 ^ ((w0 << one) | c0w)) | (w1 ^ ((w1 << one) | c1w))
        c0w = w0 >> top
        c1w = w1 >> top
        uw = w0 | w1
        while b:
            jb = np.uint64(_nb_ctz(b))
            j = k * 64 + np.int64(jb)
            b &= b - one
            if prev >= 0:                  # the segment [prev, j): one or two rectangles
                c0, c1 = kb[prev] - anchor, kb[j] - anchor
                if sel == 3 and not touch:
                    if ltk >= 0:
                        t0 = c0 >> ltk
                    else:
                        t0 = c0 // tk
                    ts = t0 * tk
                    if ra0 < rb0 and ra1 < rb1 and not (c1 - ts <= tk and ts + anchor <= lim):
                        xa[0], xb[0], xa[1], xb[1] = ra0, rb0, ra1, rb1   # tile by tile
                        s, f, a = _nb_emit_tiles(s, xa, xb, 2, c0, c1, anchor, tq, tk, ltk,
                                                 kvp, write, steps)
                        full += f
                        sel_area += a
                        ra, rb = 0, 0
                    else:
                        if ra0 < rb0:
                            s, f, a = _nb_emit(s, ra0, rb0, c0, c1, anchor, tq, tk, ltk, kvp,
                                               write, steps)
                            full += f
                            sel_area += a
                        ra, rb = ra1, rb1
                else:
                    ra = ra0 if sel & 1 else ra1
                    rb = rb1 if sel & 2 else rb0
                if ra < rb:
                    if ltk >= 0:
                        t0 = c0 >> ltk
                    else:
                        t0 = c0 // tk
                    ts = t0 * tk
                    if c1 - ts <= tk and ts + anchor <= lim:   # one tile, not shifted
                        if write:
                            kl, kh = c0 - ts, c1 - ts
                            _nb_put(steps, s, ts + anchor,
                                    ra | (rb << _Q_HI) | (kl << _KV_LO) | (kh << _KV_HI))
                            full += (ra == 0) & (rb == tq) & (kl == 0) & (kh == tk)
                            sel_area += (rb - ra) * (kh - kl)
                        s += 1
                    else:
                        s, f, a = _nb_emit(s, ra, rb, c0, c1, anchor, tq, tk, ltk, kvp, write,
                                           steps)
                        full += f
                        sel_area += a
            if (uw >> jb) & one:
                if prev < 0 and not grid:
                    anchor = ka[j]
                prev = j
                sel = np.int64((w0 >> jb) & one) | (np.int64((w1 >> jb) & one) << 1)
            else:
                prev = -1
    if write:
        nfull[u] = full
        area[u] = sel_area
    return s


def _nb_rects_wide(u, s, w2, row, g0, g1, r0, r1, q0, olo, ohi, kb, ka, grid, tq, tk, ltk,
                   kvp, write, steps, nfull, area, xa, xb):
    """``_nb_rects`` for one unit of more than 64 row groups (word rows ``row``): the
    selecting groups of each segment found by a loop over the groups. Returns the end row."""
    W = w2.shape[1]
    n = g1 - g0
    one, top, zero = np.uint64(1), np.uint64(63), np.uint64(0)
    full = 0
    sel_area = 0
    prev = -1
    anchor = 0
    for k in range(W + 1):
        b = zero
        uw = zero
        for t in range(n):
            w = w2[row[t], k] if k < W else zero
            c = w2[row[t], k - 1] >> top if k > 0 else zero
            b |= w ^ ((w << one) | c)
            uw |= w
        while b:
            jb = np.uint64(_nb_ctz(b))
            j = k * 64 + np.int64(jb)
            b &= b - one
            if prev >= 0:              # the segment [prev, j): its rectangles
                wk, bit = prev >> 6, np.uint64(prev & 63)
                c0, c1 = kb[prev] - anchor, kb[j] - anchor
                nr = 0
                t = 0
                while True:
                    while t < n and not (w2[row[t], wk] >> bit) & one:
                        t += 1
                    if t >= n:
                        break
                    ta = t
                    t += 1
                    while (t < n and r0[g0 + t] == r1[g0 + t - 1]
                           and (w2[row[t], wk] >> bit) & one):
                        t += 1
                    ra = max(r0[g0 + ta] - q0, olo)
                    rb = min(r1[g0 + t - 1] - q0, ohi)
                    if ra < rb:
                        xa[nr] = ra
                        xb[nr] = rb
                        nr += 1
                if nr:
                    s, f, a = _nb_emit_tiles(s, xa, xb, nr, c0, c1, anchor, tq, tk, ltk, kvp,
                                             write, steps)
                    full += f
                    sel_area += a
            if (uw >> jb) & one:
                if prev < 0 and not grid:
                    anchor = ka[j]
                prev = j
            else:
                prev = -1
    if write:
        nfull[u] = full
        area[u] = sel_area
    return s


def _nb_rects(lo, hi, row0, words, gh, gi, r0, r1, ugroups, uq, uqlo, uqhi, kb, ka, grid, tq,
              tk, ltk, kvp, bound, cap, write, steps, cnt, nfull, area, urev, wmax, bitmaps):
    """split / pack: the steps of units [lo, hi), written from steps[row0] in unit order (or
    only counted, with ``write`` False); returns (end row, end unit, log, log rows, revisited
    tiles) (``_nb_bm_unit``'s log, sized by ``wmax``: at least the rows the call writes before
    it; with ``bitmaps`` False the rows as written). The end unit is hi unless a unit's bound
    (bound[u + 1] - bound[u]) could cross row ``cap``: it stops before that unit. Unit u holds
    the row groups [ugroups[u, 0], ugroups[u, 1]), loads rows [uq[u], uq[u] + tq) and owns
    [uqlo, uqhi) of them; its step count (after the bitmap pass) goes to ``cnt`` and its
    revisits (steps of a tile after its first, before the pass) to ``urev``, and when writing
    its full steps (but those ``_nb_bm_pass`` makes) and selected interactions to ``nfull``
    and ``area``.

    As ``plan_oracle._unit_rects``: a unit's keys are cut at every run boundary of any of its
    groups (segments where the set of selecting groups is constant); in each segment inside
    the union of its groups' runs, each vertical run of selecting groups with touching rows is
    one rectangle. As ``plan_oracle._cut_keys``: a rectangle is cut at the global key grid
    (``grid``, split) or at tiles anchored at the aligned start of the union run holding it
    (pack), tiles crossing kvp shifted back; each tile's rows are clipped to the unit's own
    rows, and dropped if none. The rectangles of a segment are cut tile by tile, so a unit's
    pieces come in non-decreasing kv_start, and those of one K/V tile are joined into grid
    steps by ``_nb_tiles_once`` (tiles once, as ``plan_oracle.tiles_once``); where a tile keeps
    several, the unit's steps go through ``_nb_bm_unit`` (one step per tile).
    Units of one or two groups (most: blocks of about tile_q / 2 rows or more) have their own
    loops (``_nb_rects_one``, ``_nb_rects_two``); other units of <= 64 groups take the
    selecting groups as one word, read when a segment opens from the word being decoded;
    larger ones ``_nb_rects_wide``.
    """
    Hm, nq, W = words.shape
    w2 = words.reshape(Hm * nq, W)
    one, top, zero = np.uint64(1), np.uint64(63), np.uint64(0)
    lim = kvp - tk                         # a tile starting past lim is shifted back
    nmax = 1
    for u in range(lo, hi):
        nmax = max(nmax, ugroups[u, 1] - ugroups[u, 0])
    row = np.empty(nmax, np.int64)         # the unit's groups: their rows of w2
    wb = np.empty(nmax, np.uint64)         # their word k
    ca = np.empty(nmax, np.uint64)         # their carries into word k
    rlo = np.empty(nmax, np.int64)         # their rows relative to q0, clipped to the owned rows
    rhi = np.empty(nmax, np.int64)
    xa = np.empty(nmax + 1, np.int64)      # the rectangles of one segment (rows)
    xb = np.empty(nmax + 1, np.int64)
    acc = np.zeros(_ACC_LEN, np.int64)     # ``_nb_tiles_once``'s step
    log = np.empty((((3 * wmax) >> 1) + 1 if write else 1, 4), np.int32)    # lazily backed
    nlog = 0
    ntile = 0
    # Each unit's pieces are written to a scratch (in cache), then ``_nb_tiles_once`` writes
    # its steps to steps (or only counts them: counts are exact).
    smax = 1
    for u in range(lo, hi):
        smax = max(smax, bound[u + 1] - bound[u])
    scratch = _nb_scratch(smax)
    s = row0
    for u in range(lo, hi):
        if s + bound[u + 1] - bound[u] > cap:
            return s, u, log, nlog, ntile
        g0, g1 = ugroups[u, 0], ugroups[u, 1]
        n = g1 - g0
        h = gh[g0]
        q0, olo, ohi = uq[u], uqlo[u], uqhi[u]
        buf = scratch
        b0 = 0
        for t in range(n):
            row[t] = h * nq + gi[g0 + t]
        if n == 1:
            e = _nb_rects_one(u, b0, w2, row[0], max(r0[g0] - q0, olo), min(r1[g0] - q0, ohi),
                              kb, ka, grid, tq, tk, ltk, kvp, True, buf, nfull, area)
        elif n == 2:
            e = _nb_rects_two(u, b0, w2, row[0], row[1], max(r0[g0] - q0, olo),
                              min(r1[g0] - q0, ohi), max(r0[g0 + 1] - q0, olo),
                              min(r1[g0 + 1] - q0, ohi), r0[g0 + 1] == r1[g0], kb, ka, grid,
                              tq, tk, ltk, kvp, True, buf, nfull, area, xa, xb)
        elif n > 64:
            e = _nb_rects_wide(u, b0, w2, row, g0, g1, r0, r1, q0, olo, ohi, kb, ka, grid, tq,
                               tk, ltk, kvp, True, buf, nfull, area, xa, xb)
        else:
            e = _nb_rects_many(u, b0, w2, row, wb, ca, rlo, rhi, n, g0, r0, r1, q0, olo, ohi,
                               kb, ka, grid, tq, tk, ltk, kvp, buf, nfull, area, xa, xb)
        e, nf, rev, fr = _nb_tiles_once(scratch, e, steps, s, write, tq, tk, acc)
        if rev and bitmaps:                # one row per tile (the rows are in cache)
            if write:
                e, nlog, ntile = _nb_bm_unit(steps, s, e, s + fr, u, log, nlog, ntile)
            else:
                e -= rev
        if write:
            nfull[u] += nf
        cnt[u] = e
        urev[u] = rev
        s += e
    return s, hi, log, nlog, ntile


def _nb_rects_many(u, s, w2, row, wb, ca, rlo, rhi, n, g0, r0, r1, q0, olo, ohi, kb, ka, grid,
                   tq, tk, ltk, kvp, steps, nfull, area, xa, xb):
    """``_nb_rects`` for a unit of 3 to 64 row groups: the selecting groups of a segment taken
    as one word, read when the segment opens from the word being decoded. Returns the end
    row."""
    W = w2.shape[1]
    one, top, zero = np.uint64(1), np.uint64(63), np.uint64(0)
    lim = kvp - tk
    write = True
    s0 = s
    touch = zero                       # bit t: group g0 + t starts where t - 1 ends
    for t in range(n):
        ca[t] = zero
        rlo[t] = max(r0[g0 + t] - q0, olo)
        rhi[t] = min(r1[g0 + t] - q0, ohi)
        if t > 0 and r0[g0 + t] == r1[g0 + t - 1]:
            touch |= one << np.uint64(t)
    full = 0
    sel_area = 0
    prev = -1                          # previous boundary, if inside the union
    anchor = 0
    sel = zero                         # groups selecting the segment from prev
    for k in range(W + 1):
        b = zero
        uw = zero                      # union of the groups' word k
        for t in range(n):
            w = w2[row[t], k] if k < W else zero
            b |= w ^ ((w << one) | ca[t])
            ca[t] = w >> top
            wb[t] = w
            uw |= w
        while b:
            jb = np.uint64(_nb_ctz(b))
            j = k * 64 + np.int64(jb)
            b &= b - one
            if prev >= 0:              # the segment [prev, j): its rectangles
                c0, c1 = kb[prev] - anchor, kb[j] - anchor
                firsts = sel & ~((sel << one) & touch)     # first groups of rects
                lasts = sel & ~((sel >> one) & (touch >> one))  # and their last groups
                ra = rlo[np.int64(_nb_ctz(firsts))]
                rb = rhi[np.int64(_nb_ctz(lasts))]
                if ltk >= 0:
                    t0 = c0 >> ltk
                else:
                    t0 = c0 // tk
                ts = t0 * tk
                one_tile = c1 - ts <= tk and ts + anchor <= lim
                if not one_tile and (firsts & (firsts - one)):   # tile by tile
                    s, f, a = _nb_emit_more(s, firsts, lasts, rlo, rhi, xa, xb, c0, c1,
                                            anchor, tq, tk, ltk, kvp, write, steps)
                    full += f
                    sel_area += a
                    firsts = zero
                elif ra < rb:          # the first rectangle, most often the only one
                    if one_tile:       # one tile, not shifted
                        if write:
                            kl, kh = c0 - ts, c1 - ts
                            _nb_put(steps, s, ts + anchor, (ra | (rb << _Q_HI) | (kl << _KV_LO)
                                                            | (kh << _KV_HI)))
                            full += (ra == 0) & (rb == tq) & (kl == 0) & (kh == tk)
                            sel_area += (rb - ra) * (kh - kl)
                        s += 1
                    else:
                        s, f, a = _nb_emit(s, ra, rb, c0, c1, anchor, tq, tk, ltk, kvp,
                                           write, steps)
                        full += f
                        sel_area += a
                firsts &= firsts - one
                if firsts:             # more rectangles (one tile)
                    s, f, a = _nb_emit_more(s, firsts, lasts & (lasts - one), rlo, rhi,
                                            xa, xb, c0, c1, anchor, tq, tk, ltk, kvp,
                                            write, steps)
                    full += f
                    sel_area += a
            # j opens a segment iff some group selects block j; a union run starts there
            # if the previous segment was outside the union
            if (uw >> jb) & one:
                if prev < 0 and not grid:
                    anchor = ka[j]
                prev = j
                if n == 1:
                    sel = one
                elif n == 2:
                    sel = ((wb[0] >> jb) & one) | (((wb[1] >> jb) & one) << one)
                else:
                    sel = zero
                    for t in range(n):
                        sel |= ((wb[t] >> jb) & one) << np.uint64(t)
            else:
                prev = -1
    nfull[u] = full
    area[u] = sel_area
    return s





def _nb_rect_bound(words, gh, gi, ugroups, cmax, bound):
    """bound[u + 1] = bound[u] + an upper bound on unit u's steps: each step (rectangle x
    tile) is charged to one (group, selected key block) whose keys its tile touches, and a
    block touches at most cmax tiles."""
    W = words.shape[2]
    bound[0] = 0
    for u in range(len(ugroups)):
        c = 0
        for g in range(ugroups[u, 0], ugroups[u, 1]):
            for k in range(W):
                c += _nb_popcount(words[gh[g], gi[g], k])
        bound[u + 1] = bound[u] + c * cmax


def _nb_pack_units(gh, r0, r1, tq, q_align):
    """Greedy packing per head, one pass: a unit starting at group g takes the following
    groups of its head while their rows end within a[g] + tile_q (a: g's aligned start).
    Returns the [first, end) groups of each packed unit, int64 [units, 2]."""
    G = len(gh)
    out = np.empty((G, 2), np.int64)
    U = 0
    g = 0
    while g < G:
        limit = r0[g] - r0[g] % q_align + tq
        e = g + 1
        while e < G and gh[e] == gh[g] and r1[e] <= limit:
            e += 1
        out[U, 0] = g
        out[U, 1] = e
        U += 1
        g = e
    return out[:U]


def _nb_gather_window(blk, kb, row_block, G, m, nchunks):
    """One unit of the gather policy (``planning.gather._window_classes``, byte for byte;
    at most 62 query blocks): (steps, starts int64 [n, G], key_sel bool [n, G * 8], row_sel
    bool [n, tile_q], selected interactions). ``blk``: bool [nb, nk] selections of the
    unit's query blocks; ``row_block``: tile row -> index into ``blk`` (-1: not the unit's);
    ``m``: chunks a copy run holds; ``nchunks``: 8-key chunks of the padded keys."""
    nb, nk = blk.shape
    tq = row_block.shape[0]
    js = np.empty(nk, np.int64)
    nj = 0
    for j in range(nk):
        for r in range(nb):
            if blk[r, j]:
                js[nj] = j
                nj += 1
                break
    if nj == 0:
        return (0, np.empty((0, G), np.int64), np.empty((0, G * 8), np.bool_),
                np.empty((0, tq), np.bool_), 0)
    # Signatures (query block 0 the high bit, as packed rows order), classes in their order.
    sig = np.empty(nj, np.int64)
    for i in range(nj):
        x = 0
        for r in range(nb):
            x = x * 2 + (1 if blk[r, js[i]] else 0)
        sig[i] = x
    o = np.argsort(sig, kind="mergesort")
    inv = np.empty(nj, np.int64)
    first = np.empty(nj, np.int64)
    ncls = 0
    for k in range(nj):
        i = o[k]
        if k == 0 or sig[i] != sig[o[k - 1]]:
            first[ncls] = i
            ncls += 1
        inv[i] = ncls - 1
    row_sel = np.zeros((ncls, tq), np.bool_)
    rows = np.zeros(ncls, np.int64)
    for c in range(ncls):
        jc = js[first[c]]
        for t in range(tq):
            b = row_block[t]
            if b >= 0 and blk[b, jc]:
                row_sel[c, t] = True
                rows[c] += 1
    # Chunk entries (class, chunk, bits of its 8 keys) of every selected key block.
    ne = 0
    for i in range(nj):
        a, e = kb[js[i]], kb[js[i] + 1]
        ne += (e + 7) // 8 - a // 8
    ecls = np.empty(ne, np.int64)
    ech = np.empty(ne, np.int64)
    ebits = np.empty(ne, np.int64)
    k = 0
    for i in range(nj):
        a, e = kb[js[i]], kb[js[i] + 1]
        for ch in range(a // 8, (e + 7) // 8):
            lo = min(max(a - ch * 8, 0), 8)
            hi = min(max(e - ch * 8, 0), 8)
            ecls[k] = inv[i]
            ech[k] = ch
            ebits[k] = (1 << hi) - (1 << lo)
            k += 1
    # By (class, chunk): a class's entries already come in chunk order (key blocks in order,
    # their chunks too), so a stable counting sort by class; equal ones OR-ed.
    at = np.zeros(ncls + 1, np.int64)
    for k in range(ne):
        at[ecls[k] + 1] += 1
    for c in range(ncls):
        at[c + 1] += at[c]
    o = np.empty(ne, np.int64)
    for k in range(ne):
        o[at[ecls[k]]] = k
        at[ecls[k]] += 1
    cls = np.empty(ne, np.int64)
    chs = np.empty(ne, np.int64)
    bits = np.empty(ne, np.int64)
    keys = np.zeros(ncls, np.int64)
    n = 0
    for k in range(ne):
        i = o[k]
        if n > 0 and ecls[i] == cls[n - 1] and ech[i] == chs[n - 1]:
            bits[n - 1] |= ebits[i]
        else:
            cls[n], chs[n], bits[n] = ecls[i], ech[i], ebits[i]
            n += 1
    for k in range(n):
        keys[cls[k]] += _nb_popcount(np.uint64(bits[k]))
    # Copy runs: a class's consecutive chunks cut every m chunks from where they start (a run
    # near the end moved back inside the padded keys).
    seg = np.empty(n, np.int64)
    s_ch = np.empty(n, np.int64)
    s_cls = np.empty(n, np.int64)
    ns = 0
    rs = 0
    tprev = -1
    for k in range(n):
        brk = k == 0 or cls[k] != cls[k - 1] or chs[k] != chs[k - 1] + 1
        if brk:
            rs = k
        t = (chs[k] - chs[rs]) // m
        if brk or t != tprev:
            s_ch[ns] = min(chs[k], nchunks - m)
            s_cls[ns] = cls[k]
            ns += 1
        tprev = t
        seg[k] = ns - 1
    run_bits = np.zeros((ns, m), np.int64)
    for k in range(n):
        run_bits[seg[k], chs[k] - s_ch[seg[k]]] = bits[k]
    # Per class, whole runs first, then by position (stable). Runs come in class order and,
    # within a class, in non-decreasing position (first chunks increase; the clamp to
    # nchunks - m keeps the order), so a stable partition of each class is that sort.
    whole = np.empty(ns, np.bool_)
    for s in range(ns):
        whole[s] = True
        for q in range(m):
            if run_bits[s, q] != 255:
                whole[s] = False
    o = np.empty(ns, np.int64)
    k = 0
    a = 0
    while a < ns:
        e = a
        while e < ns and s_cls[e] == s_cls[a]:
            e += 1
        for s in range(a, e):
            if whole[s]:
                o[k] = s
                k += 1
        for s in range(a, e):
            if not whole[s]:
                o[k] = s
                k += 1
        a = e
    R = G // m
    per = np.zeros(ncls, np.int64)
    for s in range(ns):
        per[s_cls[s]] += 1
    nst = 0
    for c in range(ncls):
        nst += (per[c] + R - 1) // R
    starts = np.empty((nst, G), np.int64)
    key_sel = np.zeros((nst, G * 8), np.bool_)
    rsel = np.empty((nst, tq), np.bool_)
    step = -1
    i = 0
    f0 = 0
    for k in range(ns):
        s = o[k]
        if k == 0 or s_cls[s] != s_cls[o[k - 1]]:
            i = 0
            f0 = s_ch[s]                  # unused runs of a class's last step: its first run
        if i % R == 0:
            step += 1
            for p in range(R):
                for q in range(m):
                    starts[step, p * m + q] = (f0 + q) * 8
            for t in range(tq):
                rsel[step, t] = row_sel[s_cls[s], t]
        pos = i % R
        for q in range(m):
            starts[step, pos * m + q] = (s_ch[s] + q) * 8
            b = run_bits[s, q]
            for x in range(8):
                key_sel[step, (pos * m + q) * 8 + x] = ((b >> x) & 1) == 1
        i += 1
    sel = 0
    for c in range(ncls):
        sel += rows[c] * keys[c]
    return nst, starts, key_sel, rsel, sel


def _nb_interleave(rs, group):
    """``planning.gather.interleave_groups`` of one unit's row selections ``rs`` (bool [n,
    tile_q]): steps meeting one ``group``-row group alternate between the groups, then the
    steps meeting several (or none), each kind in its order."""
    n, tq = rs.shape
    ng = tq // group
    which = np.full(n, -1, np.int64)
    for i in range(n):
        cnt = 0
        w = -1
        for g in range(ng):
            for t in range(g * group, (g + 1) * group):
                if rs[i, t]:
                    cnt += 1
                    if w < 0:
                        w = g
                    break
        if cnt == 1:
            which[i] = w
    seen = np.zeros(ng, np.int64)
    at = np.empty((ng, n), np.int64)
    for i in range(n):
        g = which[i]
        if g >= 0:
            at[g, seen[g]] = i
            seen[g] += 1
    order = np.empty(n, np.int64)
    k = 0
    most = 0
    for g in range(ng):
        most = max(most, seen[g])
    for r in range(most):
        for g in range(ng):
            if r < seen[g]:
                order[k] = at[g, r]
                k += 1
    for i in range(n):
        if which[i] < 0:
            order[k] = i
            k += 1
    return order


def _nb_pack_sel(sel, out, at):
    """Writes bool ``sel`` [n] as ``abi.pack_bits``' words into ``out[at:]`` (bit c % 32 of
    word c // 32, signed int32); returns (first selected, one past the last, all selected),
    (0, n, ...) when none is, as ``argmax`` gives."""
    n = sel.shape[0]
    lo, hi, full = -1, 0, True
    for w in range((n + 31) // 32):
        x = 0
        for c in range(w * 32, min(n, w * 32 + 32)):
            if sel[c]:
                x |= 1 << (c - w * 32)
                if lo < 0:
                    lo = c
                hi = c + 1
            else:
                full = False
        out[at + w] = x - (1 << 32) if x >= (1 << 31) else x
    if lo < 0:
        return 0, n, full
    return lo, hi, full


def _nb_gather_units(blocks, kb, s0, i0, i1, row_blocks, G, m, nchunks, group):
    """Every unit of the gather policy in one call (``planning.gather.plan_gather`` with
    ``_nb_gather_window`` per (head, segment), byte for byte; segments of at most 62 query
    blocks), its steps written packed: per unit (head, segment, steps, selected interactions)
    int64 [U, 4]; per step in unit order (head-major), each unit's steps in
    ``_nb_interleave`` order when ``group`` > 0, its ``abi.pack_gather`` words int32 [S,
    G + ceil(G * 8 / 32) + ceil(tile_q / 32)] and (first chunk start, first and one past the
    last selected row, the same of keys, all rows and keys selected) int64 [S, 6] (a
    selection with none: 0 and the tile, as ``argmax`` gives). ``blocks``: bool [Hd, nq, nk];
    segment s covers query blocks [i0[s], i1[s]) in the tile starting at row s0[s],
    ``row_blocks[s]`` its tile rows' blocks (-1: not its own)."""
    Hd = blocks.shape[0]
    nseg = s0.shape[0]
    tq = row_blocks.shape[1]
    tk = G * 8
    wk = (tk + 31) // 32
    wq = (tq + 31) // 32
    nw = G + wk + wq
    units = np.empty((Hd * nseg, 4), np.int64)
    cap = max(1024, 32 * Hd * nseg)
    words = np.empty((cap, nw), np.int32)        # every word of a step is written
    meta = np.empty((cap, 6), np.int64)
    U = 0
    S = 0
    for h in range(Hd):
        for s in range(nseg):
            n, st, ks, rs, sel = _nb_gather_window(
                np.ascontiguousarray(blocks[h, i0[s]:i1[s]]), kb,
                np.ascontiguousarray(row_blocks[s]), G, m, nchunks)
            if n == 0:
                continue
            if S + n > cap:
                cap = max(2 * cap, S + n)
                a = np.empty((cap, nw), np.int32)
                a[:S] = words[:S]
                words = a
                b = np.empty((cap, 6), np.int64)
                b[:S] = meta[:S]
                meta = b
            if group > 0:
                order = _nb_interleave(rs, group)
            else:
                order = np.arange(n)
            for t in range(n):
                i = order[t]
                r = S + t
                for g in range(G):
                    words[r, g] = st[i, g]
                k_lo, k_hi, k_all = _nb_pack_sel(ks[i], words[r], G)     # key then row bits
                q_lo, q_hi, q_all = _nb_pack_sel(rs[i], words[r], G + wk)
                meta[r, 0] = st[i, 0]
                meta[r, 1] = q_lo
                meta[r, 2] = q_hi
                meta[r, 3] = k_lo
                meta[r, 4] = k_hi
                meta[r, 5] = 1 if (k_all and q_all) else 0
            units[U, 0] = h
            units[U, 1] = s
            units[U, 2] = n
            units[U, 3] = sel
            U += 1
            S += n
    return units[:U], words[:S], meta[:S]


_NB_KERNELS = ("_nb_popcount", "_nb_put", "_nb_groups", "_nb_gather_window", "_nb_interleave",
               "_nb_pack_sel", "_nb_gather_units", "_nb_tiles", "_nb_fill_unit",
               "_nb_fill", "_nb_count", "_nb_pack", "_nb_row_index", "_nb_units", "_nb_store",
               "_nb_acc_bound", "_nb_acc_add",
               "_nb_acc_norm", "_nb_sort4", "_nb_two_bounds", "_nb_acc_two", "_nb_acc_full",
               "_nb_scratch", "_nb_tiles_once", "_nb_bm_rect", "_nb_bm_cut", "_nb_bm_add",
               "_nb_bm_union", "_nb_bm_emit", "_nb_bm_unit", "_nb_bm_pass", "_nb_bm_shift",
               "_nb_bm_ranges",
               "_nb_emit", "_nb_emit_more", "_nb_emit_tiles", "_nb_rects_one", "_nb_rects_two",
               "_nb_rects_wide", "_nb_rects_many", "_nb_rects", "_nb_rect_bound",
               "_nb_pack_units")
# Inlined into their callers (numba IR):
_NB_INLINE = ("_nb_popcount", "_nb_put", "_nb_pack_sel", "_nb_tiles", "_nb_fill_unit",
              "_nb_store", "_nb_acc_bound",
              "_nb_sort4", "_nb_two_bounds", "_nb_acc_two", "_nb_acc_full", "_nb_bm_cut")


# --- running the loops: interpreted while small, compiled after --------------------------
# The planner calls the loops through ``runner(mode, ...)``, chosen by its ``PlannerConfig``:
# "compiled" loads numba and binds the compiled loops (``compile_all()``); "interpreted" (and
# "vectorised", for what its NumPy tier lacks) runs the plain functions as Python with numba's
# semantics (stores into int32 arrays wrap, integer overflow wraps, integer results come back
# as Python ints); "auto" (the default) runs the compiled loops once ``ready()``, before that a
# call whose array arguments hold at most ``max_work`` elements interpreted while this process
# has interpreted fewer than ``budget_work`` elements in all, and raises ``NotReady`` on any
# other call: the planner then makes the plan with its NumPy tier and compiles the loops in the
# background (``start_warm_up``), or compiles them first (``ensure_compiled``). Loading numba
# costs ~0.4-0.5 s on a fresh process even with its on-disk cache warm (importing numba, which
# imports scipy.linalg, and setting up its CPU target), and compiling split/pack's loops 12-25
# s on the 2-core CPU box (merge's ~1.5 s; benchmarks/first_plan.py --fresh-install): the first
# plan of a small mask needs none of it, and a process that plans only small masks never pays
# it. Byte-identical plans either way: tests/test_packaging.py, tests/test_vectorised.py. The
# module's own ``_nb_*`` names are stand-ins that compile on first call (numba resolves the
# names the kernels call there).


class _Int32Out(np.ndarray):
    """A view of an int32 output array whose stores wrap to 32 bits, as a compiled store does."""

    def __setitem__(self, key, value):
        if isinstance(value, (int, np.integer)):
            value = ((int(value) + 0x80000000) & 0xFFFFFFFF) - 0x80000000
        else:
            value = np.asarray(value).astype(np.int32)
        np.ndarray.__setitem__(self, key, value)


def _py_ctz(x):
    x = int(x)
    return (x & -x).bit_length() - 1


def _py_popcount(x):
    return np.int64(int(x).bit_count())


def _box(x):
    if isinstance(x, _Int32Out):
        return x.view(np.ndarray)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def _interpret(name, *args):
    """The loop ``name`` run as plain Python with numba's integer semantics."""
    args = tuple(a.view(_Int32Out) if type(a) is np.ndarray and a.dtype == np.int32 else a
                 for a in args)
    with np.errstate(over="ignore"):
        r = _PY_NS[name](*args)
    return tuple(_box(x) for x in r) if isinstance(r, tuple) else _box(r)


class NotReady(Exception):
    """An "auto" loop call too large to interpret while the compiled loops are not ready
    (``ready()``): the planner plans with its NumPy tier instead, or compiles first."""


def _auto(name, max_work, budget_work, *args):
    """The loop ``name`` compiled once the loops are ready; until then interpreted if the call
    holds at most ``max_work`` array elements and the process has interpreted fewer than
    ``budget_work``, else ``NotReady``."""
    global _interp_work
    if not ready():
        work = sum(a.size for a in args if isinstance(a, np.ndarray))
        if work <= max_work and _interp_work < budget_work:
            _interp_work += work
            return _interpret(name, *args)
        raise NotReady(name)
    return globals()[name](*args)


def ready() -> bool:
    """Whether "auto" runs the compiled loops: numba loaded and no background warm-up
    running (a plan in the meantime would wait for numba's compile lock)."""
    return _JITTED and not warming()


def warming() -> bool:
    """Whether a background warm-up (``start_warm_up``) of this process is still running."""
    w = _WARMING
    return w is not None and w[0] == os.getpid() and w[1].is_alive()


def start_warm_up(warm) -> None:
    """Compiles the loops in the background, once per process, unless they are ready or a
    warm-up failed: a daemon thread first waits for a Python subprocess that compiles every
    loop into numba's on-disk cache (another core, none of this process's GIL: plans made
    meanwhile run at full speed), then runs ``warm`` (the planner's ``warm_up``), which loads
    each loop from that cache (~0.5 s), or compiles it where the cache did not take."""
    global _WARMING
    with _JIT_LOCK:
        if _JITTED or warming() or _WARM_ERROR:
            return
        t = threading.Thread(target=_warm, args=(warm,), name="tessera-plan-compile",
                             daemon=True)
        _WARMING = (os.getpid(), t)
        t.start()


def _warm(warm) -> None:
    try:
        _compile_elsewhere(warm)
        warm()
    except BaseException as e:      # (no numba, a compile error): "auto" keeps its NumPy tier
        _WARM_ERROR.append(repr(e))


# The subprocess of ``_compile_elsewhere``: runs the warm-up, and leaves as soon as the
# process that started it is gone (a short-lived process must not leave a compile behind).
_ELSEWHERE = """
import os, sys, threading, time
def _watch(parent):
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)
threading.Thread(target=_watch, args=(int(sys.argv[1]),), daemon=True).start()
from {module} import {name}
{name}()
"""


def _compile_elsewhere(warm) -> bool:
    """Runs ``warm`` (by module and name) in a new Python process that shares numba's cache
    location (the same package and environment); whether it succeeded."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    code = _ELSEWHERE.format(module=warm.__module__, name=warm.__name__)
    try:
        return subprocess.run([sys.executable, "-c", code, str(os.getpid())], env=env,
                              cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0
    except OSError:
        return False


def wait_ready(timeout: float | None = None) -> bool:
    """Waits for a background warm-up of this process; returns ``ready()``."""
    w = _WARMING
    if w is not None and w[0] == os.getpid():
        w[1].join(timeout)
    return ready()


def ensure_compiled() -> None:
    """The compiled loops ready now: waits for a background warm-up, else loads numba and
    jit-wraps the loops (each compiles, or loads from numba's cache, on its first call)."""
    wait_ready()
    compile_all()


class Runner:
    """The loops as one mode runs them (see above): ``runner.X(*args)`` calls loop ``X``."""

    def __init__(self, mode: str, max_work: int, budget_work: int):
        self.mode, self.max_work, self.budget_work = mode, max_work, budget_work

    def __getattr__(self, name):
        if name not in _PLAIN:
            raise AttributeError(name)
        if self.mode in ("interpreted", "vectorised"):
            return functools.partial(_interpret, name)
        if self.mode == "compiled" or ready():
            if not _JITTED:
                compile_all()
            return globals()[name]        # the compiled loop (looked up here: tests spy on it)
        return functools.partial(_auto, name, self.max_work, self.budget_work)


@functools.lru_cache(maxsize=None)
def runner(mode: str, max_work: int = 0, budget_work: int = 0) -> Runner:
    """The ``Runner`` of ``mode`` ("auto", "compiled" or "interpreted"; ``PlannerConfig``)."""
    return Runner(mode, max_work, budget_work)


class _Loop:
    """Stands for the loop ``name`` until ``compile_all()``, which a call makes."""

    def __init__(self, fn):
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args):
        compile_all()
        return _COMPILED[self.name](*args)

    def __repr__(self):
        return f"<planner loop {self.name} (not compiled yet)>"


def compile_all() -> None:
    """Imports numba and jit-wraps the ``_nb_*`` functions (cached on disk), once per process.

    The wrapped functions replace the stand-ins in this module's namespace, which is where
    numba resolves the names that the kernels call; callers elsewhere look them up through a
    ``runner`` at call time (``run._nb_fill(...)``). With numba's cache warm this loads only the
    loops a process calls, when it calls them (each ~1-10 ms); the fixed cost is numba's
    (see ``runner`` above).
    """
    global _JITTED
    if _JITTED:
        return
    with _JIT_LOCK:
        if _JITTED:
            return
        import numba
        from numba.cpython.unsafe.numbers import trailing_zeros
        g = globals()
        g["_nb_ctz"] = trailing_zeros
        for name in _NB_KERNELS:
            inline = "always" if name in _NB_INLINE else "never"
            _COMPILED[name] = g[name] = numba.njit(cache=True, nogil=True,
                                                   inline=inline)(_PLAIN[name])
        _JITTED = True


_JITTED = False
_JIT_LOCK = threading.RLock()
_WARMING = None                                   # (pid, thread) of a background warm-up
_WARM_ERROR: list = []                            # why a background warm-up failed
_COMPILED: dict = {}
_interp_work = 0                                  # array elements of interpreted calls
_PLAIN = {name: globals()[name] for name in _NB_KERNELS}     # what numba compiles
# The interpreted loops: copies of the plain functions over their own namespace, where the
# loops they call are plain too and ``_nb_ctz`` / ``_nb_popcount`` are Python's.
_PY_NS = dict(globals())
_PY_NS.update({name: types.FunctionType(fn.__code__, _PY_NS, fn.__name__, fn.__defaults__,
                                        fn.__closure__) for name, fn in _PLAIN.items()})
_PY_NS["_nb_ctz"] = _py_ctz
_PY_NS["_nb_popcount"] = _py_popcount
_PY_NS["_nb_scratch"] = lambda n: np.zeros((n, 4), np.int32).view(_Int32Out)
globals().update({name: _Loop(fn) for name, fn in _PLAIN.items()})
