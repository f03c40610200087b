"""The ``gather`` policy: physical K/V tiles assembled from the selected keys, wherever they lie.

Units are query *segments* of each head: runs of whole query blocks that fit one tile of
tile_q rows starting at the segment's first row rounded down to the alignment (a block longer
than that is cut into pieces), so a tile's rows mostly share their keys wherever the blocks lie;
the unit owns its segment's rows (``abi.UNIT_OWN_LO`` / ``UNIT_OWN_HI``). In a segment, every
selected key block gets a *signature*: the set of the segment's query blocks that select it.
Key blocks of one signature form a *class*, a rank-one selection (those rows x those keys);
its keys are covered by chunks of ``abi.GATHER_ROWS`` keys aligned to GATHER_ROWS, and each
tile_kv / GATHER_ROWS chunks of a class make one gathered step (``abi.GATHER_FLAG``: chunk
starts, key bits, row bits). A chunk that two classes share (a block boundary inside it) is
loaded by both, each masking the other's keys by its key bits. So a step is never cut by
more than the window's rows and the chunk rounding: the waste is the rows of the window no
class member owns and the keys its chunks hold for another class, not the blocks' offsets
from a fixed tile grid. Full chunks come first in a class, so its leading steps are whole
(``abi.GATHER_FULL_FLAG`` when every row of the window selects them).

NumPy on the host; knows nothing of Pallas. ``planner`` calls ``plan_gather`` for the
``gather`` policy and wraps the result like its other policies' raw plans.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pallas_kernels import abi

__all__ = ["plan_gather", "segments", "chunk_pairs", "interleave_groups", "GatherRaw"]


class GatherRaw(NamedTuple):
    """Units (in head, window order) and their steps: cnt.sum() step rows, then ``word_rows``
    rows of their words."""

    head: np.ndarray
    qs: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    cnt: np.ndarray
    nfull: np.ndarray
    area: np.ndarray
    steps: np.ndarray
    word_rows: int


def chunk_pairs(a, b):
    """(block, chunk, bits) of each (key block, chunk of abi.GATHER_ROWS keys it meets), for
    blocks [a, b) (int arrays), in block order: bit i of ``bits`` is key GATHER_ROWS * chunk + i."""
    A = abi.GATHER_ROWS
    c0, c1 = a // A, -(-b // A)
    n = c1 - c0
    blk = np.repeat(np.arange(len(a)), n)
    ch = _ranges(c0, n)
    lo = np.clip(a[blk] - ch * A, 0, A)
    hi = np.clip(b[blk] - ch * A, 0, A)
    return blk, ch, (np.left_shift(1, hi) - np.left_shift(1, lo)).astype(np.int64)


def _window_classes(blk, kb, row_block, tile_q: int, G: int, m: int, nchunks: int):
    """The steps of one unit: (starts [n, G], key_sel [n, G * 8], row_sel [n, tile_q]) and
    the selected interactions. ``blk``: bool [nb, nk], the selections of the unit's query
    blocks; ``row_block``: the tile row -> index into ``blk`` (-1: not the unit's). ``m``:
    chunks per copy (a *run*: m chunks of consecutive keys, at stage positions aligned to m),
    ``nchunks``: chunks of the padded keys."""
    A = abi.GATHER_ROWS
    js = np.flatnonzero(blk.any(axis=0))
    if js.size == 0:
        return None
    nb = blk.shape[0]
    if nb <= 62:    # signatures as integers, in the order of their packed bits (block 0 high)
        sig = blk[:, js].T.astype(np.int64) @ (np.int64(1) << np.arange(nb - 1, -1, -1))
        _, first, inv = np.unique(sig, return_index=True, return_inverse=True)
    else:
        sig = np.packbits(blk[:, js].T, axis=1)                   # [nj, ceil(nb / 8)]
        _, first, inv = np.unique(sig, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    ncls = len(first)
    members = blk[:, js[first]]                                   # [nb, ncls]
    row_sel = np.zeros((ncls, tile_q), bool)
    live = row_block >= 0
    row_sel[:, live] = members[row_block[live]].T
    # Chunk entries of every selected key block: (class, chunk, bits of its 8 keys).
    blk, ch, bits = chunk_pairs(kb[js], kb[js + 1])
    cls = inv[blk]
    key = cls * (int(ch.max()) + 1) + ch
    o = np.argsort(key, kind="stable")
    key, bits, cls, ch = key[o], bits[o], cls[o], ch[o]
    new = np.concatenate(([True], key[1:] != key[:-1]))
    at = np.flatnonzero(new)
    bits = np.bitwise_or.reduceat(bits, at)
    cls, ch = cls[at], ch[at]
    # Copy runs: a class's consecutive chunks cut every m chunks from where they start (a run
    # near the end moved back inside the padded keys); each chunk lies in one run.
    brk = np.concatenate(([True], (cls[1:] != cls[:-1]) | (ch[1:] != ch[:-1] + 1)))
    rs = np.maximum.accumulate(np.where(brk, np.arange(len(ch)), 0))   # its stretch's first
    t = (ch - ch[rs]) // m
    seg_first = brk | (t != np.concatenate(([-1], t[:-1])))
    seg = np.cumsum(seg_first) - 1                                      # run of each chunk
    s_ch = np.minimum(ch[seg_first], nchunks - m)                       # run's first chunk
    s_cls = cls[seg_first]
    nseg = len(s_ch)
    run_bits = np.zeros((nseg, m), np.int64)
    run_bits[seg, ch - s_ch[seg]] = bits
    # Per class, whole runs first (so whole steps come first), then by position.
    whole = (run_bits == (1 << A) - 1).all(axis=1)
    o = np.lexsort((s_ch, ~whole, s_cls))
    s_ch, s_cls, run_bits = s_ch[o], s_cls[o], run_bits[o]
    R = G // m                                                          # runs a step
    per = np.bincount(s_cls, minlength=ncls)
    steps_per = -(-per // R)
    ns = int(steps_per.sum())
    i = np.arange(nseg) - np.repeat(np.cumsum(per) - per, per)
    step = np.repeat(np.cumsum(steps_per) - steps_per, per) + i // R
    pos = i % R
    # Unused runs of a class's last step: its first run again, no keys.
    fill = np.repeat(s_ch[np.cumsum(per) - per][:, None], steps_per, axis=0)
    run_start = np.repeat(fill, R, axis=1)
    run_start[step, pos] = s_ch
    starts = ((run_start[:, :, None] + np.arange(m)) * A).reshape(ns, G)
    key_bits = np.zeros((ns, R, m), np.int64)
    key_bits[step, pos] = run_bits
    key_sel = ((key_bits.reshape(ns, G)[:, :, None] >> np.arange(A)) & 1).astype(bool)
    key_sel = key_sel.reshape(ns, G * A)
    step_cls = np.repeat(np.arange(ncls), steps_per)
    rows = row_sel.sum(axis=1)
    keys = np.bincount(cls, weights=np.bitwise_count(bits), minlength=ncls).astype(np.int64)
    return starts, key_sel, row_sel[step_cls], int((rows * keys).sum())


def _numpy_window(blk, kb, row_block, G: int, m: int, nchunks: int):
    """``_window_classes`` in the signature of ``loops._nb_gather_window`` (steps first):
    as ``plan_gather``'s ``window``, the unit-by-unit NumPy plan (the reference of the
    all-units one, ``_plan_all_units``)."""
    got = _window_classes(blk, kb, row_block, row_block.shape[0], G, m, nchunks)
    return (0, None, None, None, 0) if got is None else (len(got[0]),) + got


def segments(qb, tile_q: int, q_len: int, align: int = abi.GATHER_ROWS,
             max_blocks: int | None = None):
    """[(a, b)]: the owned row ranges of a head's units, in order, covering [0, q_len). Whole
    query blocks are packed while they fit a tile starting at ``a`` rounded down to ``align``
    (and, with ``max_blocks``, while the run holds fewer blocks or pieces); a block is cut only
    where it fits no tile of its own, its first piece filling the current tile (later pieces
    start aligned). Packing never computes more: keys that blocks share are loaded once."""
    out, a, end, nb = [], 0, 0, 0
    full = (lambda: nb >= max_blocks) if max_blocks else (lambda: False)    # noqa: E731
    for e in np.minimum(np.asarray(qb, np.int64)[1:], q_len):
        e = int(e)
        while e - (a - a % align) > tile_q or full():
            if end > a and (e - (end - end % align) <= tile_q or full()):
                out.append((a, end))             # the block fits a tile of its own
                a, nb = end, 0
            else:                                # it must be cut: fill this tile first
                cut = a - a % align + tile_q
                out.append((a, cut))
                a, end, nb = cut, cut, 0
        end, nb = e, nb + 1
    if end > a:
        out.append((a, end))
    return out


def interleave_groups(row_sel: np.ndarray, group: int) -> np.ndarray:
    """The order of a unit's steps (``row_sel``: bool [n, tile_q]) for a kernel that runs a
    step only on the ``group``-row groups it meets: steps meeting one group alternate between
    the groups (so each group's warpgroup computes while the other skips: a ring of two
    stages keeps both busy), then the steps meeting several, each kind in its order."""
    n, tile_q = row_sel.shape
    meets = row_sel.reshape(n, tile_q // group, group).any(axis=2)
    one = meets.sum(axis=1) == 1
    which = np.where(one, meets.argmax(axis=1), -1)
    # Rank of each single-group step within its group: sorting by (rank, group) alternates.
    rank = np.zeros(n, np.int64)
    for g in range(tile_q // group):
        sel = which == g
        rank[sel] = np.arange(int(sel.sum()))
    return np.lexsort((np.arange(n), which, np.where(one, rank, n), ~one))


def plan_gather(qb, kb, blocks, tile_q: int, tile_kv: int, q_len: int,
                q_len_padded: int, kv_len_padded: int, run: int = abi.GATHER_ROWS,
                row_group: int | None = None, window=None, units=None) -> GatherRaw:
    """The gather policy's units and steps for the distinct mask heads ``blocks`` (bool [Hd, nq,
    nk]) over block bounds ``qb`` / ``kb``: one unit per (head, segment with a selected key;
    ``segments``), the steps of its classes (``_window_classes``), steps in unit order, then
    their words (``abi.gather_word_rows`` rows each). A tile that would pass ``q_len_padded``
    (a multiple of the alignment) is moved back inside it, owning only its segment's rows.
    ``run``: keys a copy loads (a multiple of GATHER_ROWS dividing tile_kv): chunks come in
    runs of consecutive keys at stage positions aligned to it (``abi.check_plan``'s
    ``gather_run``), so a kernel copies a run at once. ``row_group``: rows a kernel computes
    as one (it skips a step's groups that no row of it selects; None: the tile): a unit's
    steps are ordered by ``interleave_groups``. ``window``: a compiled ``_window_classes``
    for units of at most 62 query blocks (``loops._nb_gather_window``, the same steps byte for
    byte; ``_numpy_window``: ``_window_classes`` itself), called one unit at a time, or None:
    NumPy plans every unit at once (``_plan_all_units``, the same steps). ``units``: a
    compiled loop over every unit at once (``loops._nb_gather_units``, the same steps; used
    when no segment has more than 62 query blocks), or None."""
    qb, kb = np.asarray(qb, np.int64), np.asarray(kb, np.int64)
    G = abi.gather_chunks(tile_kv)
    m = abi.gather_run_chunks(tile_kv, run)
    Hd = blocks.shape[0]
    segs = np.array(segments(qb, tile_q, q_len), np.int64).reshape(-1, 2)
    # Per segment (shared by the heads): the tile's first row, its query blocks [i0, i1), and
    # each tile row's block within them (-1: a row the segment does not own).
    w0, w1 = segs[:, 0], segs[:, 1]
    s0s = np.minimum(w0 - w0 % abi.GATHER_ROWS, q_len_padded - tile_q)
    i0s = np.searchsorted(qb, w0, side="right") - 1
    i1s = np.searchsorted(qb, w1, side="left")
    r = s0s[:, None] + np.arange(tile_q)
    row_blocks = np.where((r >= w0[:, None]) & (r < w1[:, None]),
                          np.searchsorted(qb, r, side="right") - 1 - i0s[:, None], -1)
    group = row_group if row_group and row_group < tile_q else 0
    nchunks = kv_len_padded // abi.GATHER_ROWS
    if units is not None and (len(segs) == 0 or int((i1s - i0s).max()) <= 62):
        u, words, meta = units(np.ascontiguousarray(blocks, bool), kb, s0s, i0s, i1s,
                               row_blocks, G, m, nchunks, group)
        seg, cnt = u[:, 1], u[:, 2]
        full = meta[:, 5].astype(bool)
        nfull = np.bincount(np.repeat(np.arange(len(cnt)), cnt), weights=full,
                            minlength=len(cnt)).astype(np.int64)
        return _assemble_words(words, meta, u[:, 0], s0s[seg], w0[seg] - s0s[seg],
                               w1[seg] - s0s[seg], cnt, nfull, u[:, 3], tile_q, tile_kv)
    if window is None:
        return _plan_all_units(kb, np.asarray(blocks, bool), tile_q, tile_kv, G, m, nchunks,
                               s0s, i0s, i1s, w0, w1, row_blocks, group)
    return _plan_unit_by_unit(kb, blocks, tile_q, tile_kv, G, m, nchunks, s0s, i0s, i1s, w0,
                              w1, row_blocks, group, window)


def _plan_unit_by_unit(kb, blocks, tile_q, tile_kv, G, m, nchunks, s0s, i0s, i1s, w0, w1,
                       row_blocks, group, window=None) -> GatherRaw:
    """``plan_gather`` one unit at a time: ``window`` (the compiled ``_window_classes``) for
    units of at most 62 query blocks, ``_window_classes`` for the others (all of them when
    ``window`` is None: the reference of ``_plan_all_units``)."""
    Hd = blocks.shape[0]
    head, qs, lo, hi, cnt, nfull, area = [], [], [], [], [], [], []
    parts = []
    for h in range(Hd):
        for k in range(len(s0s)):
            s0, i0, i1 = int(s0s[k]), int(i0s[k]), int(i1s[k])
            blk = blocks[h, i0:i1]
            row_block = row_blocks[k]
            if window is not None and blk.shape[0] <= 62:
                n, *got = window(blk, kb, row_block, G, m, nchunks)
                got = got if n else None
            else:
                got = _window_classes(blk, kb, row_block, tile_q, G, m, nchunks)
            if got is None:
                continue
            starts, key_sel, row_sel, sel = got
            if group:
                o = interleave_groups(row_sel, group)
                starts, key_sel, row_sel = starts[o], key_sel[o], row_sel[o]
            full = key_sel.all(axis=1) & row_sel.all(axis=1)
            parts.append((starts, key_sel, row_sel, full))
            head.append(h)
            qs.append(s0)
            lo.append(int(w0[k]) - s0)
            hi.append(int(w1[k]) - s0)
            cnt.append(len(starts))
            nfull.append(int(full.sum()))
            area.append(sel)
    cat = [np.concatenate([p[i] for p in parts]) if parts else None for i in range(4)]
    return _assemble(*cat, np.array(head, np.int64), np.array(qs, np.int64),
                     np.array(lo, np.int64), np.array(hi, np.int64), np.array(cnt, np.int64),
                     np.array(nfull, np.int64), np.array(area, np.int64), tile_q, tile_kv)


_SIG_BITS = 62                          # query blocks of one signature word
_CTZ8 = np.array([(x & -x).bit_length() - 1 if x else 0 for x in range(256)], np.int64)
_BITLEN8 = np.array([x.bit_length() if x else 8 for x in range(256)], np.int64)


def _ranges(start, n):
    """int64 [n.sum()]: start[i] + (0 .. n[i] - 1) for each i, in order."""
    n = np.asarray(n, np.int64)
    tot = int(n.sum())
    off = np.cumsum(n) - n
    return np.arange(tot, dtype=np.int64) + np.repeat(np.asarray(start, np.int64) - off, n)


def _plan_all_units(kb, blocks, tile_q, tile_kv, G, m, nchunks, s0s, i0s, i1s, w0, w1,
                    row_blocks, group) -> GatherRaw:
    """``plan_gather`` with every unit at once in NumPy (``_window_classes`` a unit, byte for
    byte). Signatures are words of up to 62 query blocks (the first block the high bit, as
    the packed rows sort), so classes sort as ``np.unique`` orders them; they are written
    densely per (unit, key block) and a class's key intervals are their runs along the keys,
    whose chunks are generated at once (a chunk that two intervals of a class share OR-ed
    into one); runs, their order (a class's whole runs first) and their step slots are
    computed over every class together, and the steps' words are written packed (no bool
    selections), a block of steps at a time when runs are single chunks."""
    A = abi.GATHER_ROWS
    nseg, tq = len(s0s), tile_q
    empty = np.zeros(0, np.int64)
    if nseg == 0 or not blocks.any():
        return _assemble_words(None, None, empty, empty, empty, empty, empty, empty, empty,
                               tile_q, tile_kv)
    nb = i1s - i0s
    maxb = int(nb.max())
    # 1-2. Key intervals: runs of a unit's consecutive key blocks of one signature.
    sig = _signatures(blocks, i0s, nb)
    ru, ja, jb, rsig = _signature_runs(sig)
    if not len(ru):
        return _assemble_words(None, None, empty, empty, empty, empty, empty, empty, empty,
                               tile_q, tile_kv)
    W = rsig.shape[1]
    # 3. Classes: runs sorted by (unit, signature), stable (key blocks in order). Runs of a
    # class are never contiguous (a run is maximal), so they are the class's intervals.
    if W == 1 and int(ru[-1]).bit_length() + maxb <= 62:
        ckey = (ru << maxb) | rsig[:, 0].astype(np.int64)
        co = None if (ckey[1:] >= ckey[:-1]).all() else np.argsort(ckey, kind="stable")
        if co is not None:
            ckey = ckey[co]
        cnew = np.concatenate(([True], ckey[1:] != ckey[:-1]))
    else:
        co = np.lexsort(tuple(rsig[:, c] for c in range(W - 1, -1, -1)) + (ru,))
        su, ss = ru[co], rsig[co]
        cnew = np.concatenate(([True], (su[1:] != su[:-1])
                               | (ss[1:] != ss[:-1]).any(axis=1)))
    if co is not None:
        ru, ja, jb, rsig = ru[co], ja[co], jb[co], rsig[co]
    cat = np.flatnonzero(cnew)
    C = len(cat)
    icls = np.cumsum(cnew) - 1                           # class of each interval
    cu = ru[cat]                                         # unit of each class
    # Rows of each class: the OR of its blocks' rows in the tile (its signature's bits).
    cwords, crows, clo, chi = _class_rows(row_blocks, nb, tq, cu % nseg, rsig[cat])
    # 4. Key intervals [a, b), chunks [c0, c1).
    a, b = kb[ja], kb[jb + 1]
    ckeys = np.add.reduceat(b - a, cat)
    c0, c1 = a // A, -(-b // A)
    # 5-6. Steps: their words (into the plan's steps, unless reordered) and rows (first
    # chunk's key, rectangle, flag; STEP_CUTS_A after), from each class's runs in slots.
    wk, wq = abi.bitmap_words(tile_kv), abi.bitmap_words(tq)
    nw = G + wk + wq
    if m == 1 and int(c1.max()) <= nchunks:
        S, steps_per, per, nwh, *pieces = _single_chunk_pieces(icls, a, b, c0, c1, C, G)
        cfull = np.where(crows == tq, nwh // G, 0)      # full steps of each class (its first)
        steps, words, rows = _step_arrays(S, tq, tile_kv, nw, group)
        _single_chunk_steps(words, rows, G, *pieces, steps_per, per, cfull, cwords, clo, chi)
    else:
        S, steps_per, rstart, kbytes = _run_slots(icls, a, b, c0, c1, C, G, m, nchunks)
        steps, words, rows = _step_arrays(S, tq, tile_kv, nw, group)
        np.multiply(rstart.reshape(S, G), A, out=words[:, :G], casting="unsafe")
        _put_bytes(words, G, kbytes)
        words[:, G + wk:] = np.repeat(cwords, steps_per, axis=0)
        nz = kbytes != 0
        fb = nz.argmax(axis=1)
        lb = G - 1 - nz[:, ::-1].argmax(axis=1)
        ar = np.arange(S)
        full = (kbytes == 255).all(axis=1) & np.repeat(crows == tq, steps_per)
        _put_rows(rows, words[:, 0], np.repeat(clo, steps_per), np.repeat(chi, steps_per),
                  fb * A + _CTZ8[kbytes[ar, fb]], lb * A + _BITLEN8[kbytes[ar, lb]], full)
        cfull = np.add.reduceat(full, np.cumsum(steps_per) - steps_per)
    # 7. Units (those with a selected key), in (head, segment) order.
    unew = np.concatenate(([True], cu[1:] != cu[:-1]))
    uat = np.flatnonzero(unew)
    uid = cu[uat]
    cnt = np.add.reduceat(steps_per, uat).astype(np.int64)
    wr = abi.gather_word_rows(tq, tile_kv)
    if group:
        o = _interleave_all(cwords, steps_per, cnt, tq, group)
        steps[S: S + S * wr].reshape(S, -1)[:, :nw] = words[o]
        steps[:S] = rows[o]
    _point_words(steps, S, wr)
    nfull = np.add.reduceat(cfull, uat).astype(np.int64)
    area = np.add.reduceat(crows * ckeys, uat).astype(np.int64)
    useg = uid % nseg
    return GatherRaw((uid // nseg).astype(np.int64), s0s[useg], w0[useg] - s0s[useg],
                     w1[useg] - s0s[useg], cnt, nfull, area, steps, S * wr)


def _class_rows(row_blocks, nb, tq: int, k, sig):
    """Per class, from its segment ``k`` and signature words ``sig`` [C, W] (``_signatures``'):
    the rows its blocks own in the tile as ``abi.pack_bits`` words [C, wq], their count, and
    their range [lo, hi) ((0, tq) when none)."""
    maxb = int(nb.max())
    eq = row_blocks[:, None, :] == np.arange(maxb)[:, None]          # [nseg, maxb, tq]
    rmask = abi.pack_bits(eq)                                         # [nseg, maxb, wq]
    # The class's blocks: the set bits of its words (little-endian bytes: bit p of word w at
    # p + 8 * itemsize * w), block r at bit min(nb, 62 (w + 1)) - 1 - r of word w.
    wbits = 8 * sig.dtype.itemsize
    xc, p = np.nonzero(np.unpackbits(np.ascontiguousarray(sig).view(np.uint8), axis=1,
                                     bitorder="little"))
    w = p // wbits
    xk = k[xc]
    xr = np.minimum(nb[xk], _SIG_BITS * (w + 1)) - 1 - (p - w * wbits)
    xs = np.flatnonzero(np.concatenate(([True], xc[1:] != xc[:-1])))
    cwords = np.bitwise_or.reduceat(rmask[xk, xr], xs, axis=0)
    # Blocks own disjoint rows: the count and range of the OR's bits are the class's.
    rb = np.ascontiguousarray(cwords).view(np.uint8)           # row i: byte i // 8, bit i % 8
    crows = np.bitwise_count(rb).sum(axis=1, dtype=np.int64)
    nz = rb != 0
    fb = nz.argmax(axis=1)
    lb = rb.shape[1] - 1 - nz[:, ::-1].argmax(axis=1)
    ar = np.arange(len(rb))
    none = crows == 0
    return (cwords, crows, np.where(none, 0, fb * 8 + _CTZ8[rb[ar, fb]]),
            np.where(none, tq, lb * 8 + _BITLEN8[rb[ar, lb]]))


def _interleave_all(cwords, steps_per, cnt, tq: int, group: int):
    """``interleave_groups`` of every unit's steps at once (a unit's ``cnt`` steps are
    contiguous; a class's ``steps_per`` steps share its rows ``cwords``): the order of all
    steps."""
    C, S = len(cwords), int(cnt.sum())
    ar = np.arange(S)
    step_unit = np.repeat(np.arange(len(cnt)), cnt)
    rsel = np.unpackbits(np.ascontiguousarray(cwords).view(np.uint8), axis=1,
                         bitorder="little")[:, :tq].astype(bool)
    meets = rsel.reshape(C, tq // group, group).any(axis=2)
    one_c = meets.sum(axis=1) == 1
    which_c = np.where(one_c, meets.argmax(axis=1), -1)
    one, which = np.repeat(one_c, steps_per), np.repeat(which_c, steps_per)
    gk = step_unit * (tq // group + 1) + which + 1
    go = np.argsort(gk, kind="stable")
    gs = gk[go]
    gfirst = np.maximum.accumulate(
        np.where(np.concatenate(([True], gs[1:] != gs[:-1])), ar, 0))
    rank = np.empty(S, np.int64)
    rank[go] = ar - gfirst
    return np.lexsort((ar, which, np.where(one, rank, S), ~one, step_unit))


def _signatures(blocks, i0s, nb):
    """The signature of every (unit, key block), dense: uint [W, Hd * nseg, nk] (0: none of the
    segment's blocks selects it), words of up to 62 query blocks, the segment's first block
    the high bit (``_window_classes``' order). A pass per block row of the widest segment
    over the selections (no sort of them); one block a segment: the selections themselves."""
    Hd, nq, nk = blocks.shape
    nseg, maxb = len(i0s), int(nb.max())
    if maxb == 1:
        x = blocks if nseg == nq and (i0s == np.arange(nq)).all() else blocks[:, i0s]
        return x.view(np.uint8).reshape(1, Hd * nseg, nk)
    W = -(-maxb // _SIG_BITS)
    dt = np.dtype(np.uint64 if W > 1 else
                  next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64)
                       if np.dtype(t).itemsize * 8 >= maxb))
    sig = np.zeros((W, Hd, nseg, nk), dt)
    for r in range(maxb):
        w = r // _SIG_BITS
        ks = np.flatnonzero(nb > r)
        bit = (np.minimum(nb[ks], _SIG_BITS * (w + 1)) - 1 - r).astype(dt)
        x = blocks[:, i0s[ks] + r].view(np.uint8).astype(dt) << bit[:, None]
        if len(ks) == nseg:
            sig[w] |= x
        else:
            sig[w][:, ks] |= x
    return sig.reshape(W, Hd * nseg, nk)


def _signature_runs(sig):
    """The maximal runs of a unit's consecutive key blocks of one signature (``_signatures``,
    none 0), in (unit, key block) order: their unit, first and last key block, and signature
    words [R, W]. A class's runs are its key intervals."""
    W, U, nk = sig.shape
    nz = sig[0] != 0
    same = sig[0][:, 1:] == sig[0][:, :-1]
    for w in range(1, W):
        nz |= sig[w] != 0
        same &= sig[w][:, 1:] == sig[w][:, :-1]
    start, end = nz.copy(), nz
    start[:, 1:] &= ~same
    end[:, :-1] &= ~same
    rs, re = np.flatnonzero(start), np.flatnonzero(end)
    ru = rs // nk
    return ru, rs - ru * nk, re - ru * nk, sig.reshape(W, U * nk)[:, rs].T


def _single_chunk_pieces(icls, a, b, c0, c1, C: int, G: int):
    """The runs of one-chunk runs (``m`` = 1, every chunk below ``nchunks``) as *pieces* of
    consecutive slots, from the classes' key intervals without a pass per chunk: a class's
    runs are its intervals' full chunks (whole, in order), then their partial chunks (at an
    unaligned end; a chunk two intervals share OR-ed, never whole: the keys between them are
    not the class's), in order, then its last step's unused runs (its first run again, no
    keys). (steps, steps, runs and whole runs of each class, then per piece in slot order:
    first chunk, slots, chunk step (1, or 0: unused runs), key bits uint8.)"""
    A = abi.GATHER_ROWS
    am = a % A
    fa = c0 + (am != 0)
    nf = np.maximum(b // A - fa, 0)                     # full chunks [fa, fa + nf)
    one = c1 - 1 == c0
    head_bits = (255 << am) & 255
    tail_bits = (1 << (b - (c1 - 1) * A)) - 1
    hp = am != 0
    tp = (b % A != 0) & ~(hp & one)
    pv = np.stack([hp, tp], 1).ravel()
    pcl = np.repeat(icls, 2)[pv]
    pc = np.stack([c0, c1 - 1], 1).ravel()[pv]
    pb = np.stack([np.where(one, head_bits & tail_bits, head_bits), tail_bits], 1).ravel()[pv]
    if len(pc):
        at = np.flatnonzero(np.concatenate(([True], (pcl[1:] != pcl[:-1])
                                            | (pc[1:] != pc[:-1]))))
        pb, pcl, pc = np.bitwise_or.reduceat(pb, at), pcl[at], pc[at]
    fi = np.flatnonzero(nf > 0)
    fcl = icls[fi]
    nwh = np.bincount(fcl, weights=nf[fi], minlength=C).astype(np.int64)
    per = nwh + np.bincount(pcl, minlength=C)
    steps_per = -(-per // G)
    S = int(steps_per.sum())
    nun = steps_per * G - per
    first = np.zeros(C, np.int64)                         # each class's first run
    if len(pc):
        k = np.flatnonzero(np.concatenate(([True], pcl[1:] != pcl[:-1])))
        first[pcl[k]] = pc[k]
    if len(fcl):
        k = np.flatnonzero(np.concatenate(([True], fcl[1:] != fcl[:-1])))
        first[fcl[k]] = fa[fi][k]
    uc = np.flatnonzero(nun)
    o = np.argsort(np.concatenate((3 * fcl, 3 * pcl + 1, 3 * uc + 2)), kind="stable")
    pstart = np.concatenate((fa[fi], pc, first[uc]))[o]
    plen = np.concatenate((nf[fi], np.ones(len(pc), np.int64), nun[uc]))[o]
    pstep = np.concatenate((np.ones(len(fi) + len(pc), np.int64),
                            np.zeros(len(uc), np.int64)))[o]
    pbyte = np.concatenate((np.full(len(fi), 255, np.uint8), pb.astype(np.uint8),
                            np.zeros(len(uc), np.uint8)))[o]
    return S, steps_per, per, nwh, pstart, plen, pstep, pbyte


def _single_chunk_steps(words, rows, G: int, pstart, plen, pstep, pbyte, steps_per, per,
                        cfull, cwords, clo, chi, block_slots: int = 1 << 18):
    """Writes the steps' ``words`` [S, nw] and ``rows`` [S, STEP_COLS] (but STEP_CUTS_A) from
    their slots' pieces (``_single_chunk_pieces``) and their classes' runs ``per``, full steps
    ``cfull``, row words and rows [lo, hi): a block of steps at a time, so that its slots'
    values stay in cache between the passes over them."""
    A = abi.GATHER_ROWS
    S, wk = len(words), -(-G // 4)
    pend = np.cumsum(plen)
    at = pend - plen
    # Slot t of a piece holds key A * (pstart + t - at): a constant a piece plus A * t, summed
    # in uint32 (wrapping; the sum is a key); the unused slots (chunk step 0), A * pstart.
    pval = (A * (pstart - at)).astype(np.uint32)
    fval = (A * pstart).astype(np.uint32)
    ce = np.cumsum(steps_per)
    cs = ce - steps_per                                    # each class's first step
    lb = np.full(S, G - 1, np.int64)                       # each step's last run with a key
    lb[ce - 1] = per - 1 - (steps_per - 1) * G
    full = np.repeat(np.tile([True, False], len(cs)),
                     np.stack([cfull, steps_per - cfull], 1).ravel())
    B = max(1, block_slots // G)
    tkey = np.arange(0, A * B * G, A, dtype=np.uint32)
    for s0 in range(0, S, B):
        s1 = min(S, s0 + B)
        n, blk = s1 - s0, slice(s0, s1)
        i, j, ln = _clipped(at, pend, s0 * G, s1 * G)
        key = np.repeat(pval[i:j] + np.uint32(A * s0 * G % 2**32), ln)
        key += tkey[:n * G]
        f = np.flatnonzero(pstep[i:j] == 0)
        if len(f):
            key[_ranges((np.cumsum(ln) - ln)[f], ln[f])] = np.repeat(fval[i:j][f], ln[f])
        words[blk, :G] = key.reshape(n, G).view(np.int32)
        kbytes = np.repeat(pbyte[i:j], ln).reshape(n, G)
        _put_bytes(words[blk], G, kbytes)
        i, j, ln = _clipped(cs, ce, s0, s1)
        words[blk, G + wk:] = np.repeat(cwords[i:j], ln, axis=0)
        lbs = lb[blk]
        _put_rows(rows[blk], words[blk, 0], np.repeat(clo[i:j], ln), np.repeat(chi[i:j], ln),
                  _CTZ8[kbytes[:, 0]], lbs * A + _BITLEN8[kbytes[np.arange(n), lbs]],
                  full[blk])


def _clipped(at, end, lo: int, hi: int):
    """(i, j, lengths): the items [i, j) of consecutive ranges [at, end) (none empty) that
    meet [lo, hi), and their lengths inside it."""
    i = int(np.searchsorted(end, lo, "right"))
    j = int(np.searchsorted(at, hi, "left"))
    ln = end[i:j] - at[i:j]
    ln[0] -= lo - at[i]
    ln[-1] -= end[j - 1] - hi
    return i, j, ln


def _put_bytes(words, G: int, kbytes):
    """words[:, G: G + wk] = the key bits ``kbytes`` (uint8 [S, G]) as little-endian int32."""
    wk = -(-G // 4)
    if G == 4 * wk:
        words[:, G:G + wk] = kbytes.view("<i4")
    else:
        pad = np.zeros((len(kbytes), 4 * wk), np.uint8)
        pad[:, :G] = kbytes
        words[:, G:G + wk] = pad.view("<i4")


def _run_slots(icls, a, b, c0, c1, C: int, G: int, m: int, nchunks: int):
    """Step slots of runs of ``m`` chunks, from each chunk of the classes' key intervals:
    (steps, steps of each class, chunk of each slot [S * G], key bits [S, G] uint8)."""
    A = abi.GATHER_ROWS
    head_bits = (255 << (a - c0 * A)) & 255
    tail_bits = (1 << (b - (c1 - 1) * A)) - 1
    # A chunk shared with the class's previous interval is that interval's (OR-ed there).
    dup = np.concatenate(([False], (icls[1:] == icls[:-1]) & (c0[1:] == c1[:-1] - 1)))
    c0g = c0 + dup
    ng = c1 - c0g
    off = np.cumsum(ng) - ng
    NE = int(ng.sum())
    ech = _ranges(c0g, ng)
    ebits = np.full(NE, 255, np.uint8)
    g = ng > 0
    ebits[off[g & ~dup]] = head_bits[g & ~dup]
    last = off[g] + ng[g] - 1
    ebits[last] &= tail_bits[g].astype(np.uint8)
    if dup.any():
        d = np.flatnonzero(dup)
        prev = np.maximum.accumulate(np.where(g, np.arange(len(g)), -1))[d - 1]
        np.bitwise_or.at(ebits, off[prev] + ng[prev] - 1,
                         (head_bits[d] & np.where(ng[d] == 0, tail_bits[d], 255))
                         .astype(np.uint8))
    ecls = np.repeat(icls, ng)
    # Copy runs: a class's consecutive chunks cut every m chunks from where they start
    # (moved back inside the padded keys); each chunk lies in one run.
    if m == 1:
        r_cls, r_sch = ecls, np.minimum(ech, nchunks - 1)
        run_bits = ebits[:, None]
        whole = ebits == 255
    else:
        brk = np.concatenate(([True], (ecls[1:] != ecls[:-1]) | (ech[1:] != ech[:-1] + 1)))
        rs = np.maximum.accumulate(np.where(brk, np.arange(NE), 0))
        first = brk | ((ech - ech[rs]) % m == 0)
        rid = np.cumsum(first) - 1
        r_cls, r_sch = ecls[first], np.minimum(ech[first], nchunks - m)
        run_bits = np.zeros((len(r_sch), m), np.uint8)
        run_bits[rid, ech - r_sch[rid]] = ebits
        whole = (run_bits == 255).all(axis=1)
    NR = len(r_cls)
    # Run slots: per class, whole runs first then the others (each in order), R a step.
    R = G // m
    per = np.bincount(r_cls, minlength=C)
    roff = np.cumsum(per) - per
    steps_per = -(-per // R)
    soff = (np.cumsum(steps_per) - steps_per) * R
    S = int(steps_per.sum())
    cw = np.cumsum(whole)
    cw0 = np.concatenate(([0], cw))[roff]                # whole runs before the class
    nwh = np.concatenate(([0], cw))[roff + per] - cw0
    slot = np.where(whole, (soff - cw0 - 1)[r_cls] + cw,
                    (soff + nwh - roff + cw0)[r_cls] + np.arange(NR) - cw)
    rstart = np.empty(S * R, np.int64)
    rstart[slot] = r_sch
    nun = steps_per * R - per                            # unused runs of a class's last step
    if nun.any():
        rstart[_ranges(soff + per, nun)] = np.repeat(rstart[soff], nun)   # its first run
    kbytes = np.zeros((S * R, m), np.uint8)
    kbytes[slot] = run_bits
    if m > 1:
        rstart = (rstart[:, None] + np.arange(m)).reshape(-1)
    return S, steps_per, rstart, kbytes.reshape(S, G)


def _assemble(starts, key_sel, row_sel, full, head, qs, lo, hi, cnt, nfull, area, tile_q,
              tile_kv) -> GatherRaw:
    """The raw plan of the units' steps (concatenated in unit order) and their words, from
    the steps' selections (``_assemble_words`` of their packing)."""
    S = int(cnt.sum())
    words = meta = None
    if S:
        words = abi.pack_gather(starts, key_sel, row_sel)             # [S, n]
        meta = np.stack([starts[:, 0], row_sel.argmax(1), tile_q - row_sel[:, ::-1].argmax(1),
                         key_sel.argmax(1), tile_kv - key_sel[:, ::-1].argmax(1), full], 1)
    return _assemble_words(words, meta, head, qs, lo, hi, cnt, nfull, area, tile_q, tile_kv)


def _step_arrays(S: int, tile_q: int, tile_kv: int, nw: int, group: int):
    """(``_steps_array``, int32 [S, nw] and [S, STEP_COLS] its steps' words and rows are
    written to): its own, or new arrays when they are reordered (``group``)."""
    steps = _steps_array(S, tile_q, tile_kv)
    if group:
        return steps, np.empty((S, nw), np.int32), np.empty((S, abi.STEP_COLS), np.int32)
    words = steps[S: S + S * abi.gather_word_rows(tile_q, tile_kv)].reshape(S, -1)[:, :nw]
    return steps, words, steps[:S]


def _steps_array(S: int, tile_q: int, tile_kv: int):
    """The zero ``steps`` of a raw plan of S gathered steps: S step rows, then their words
    (``abi.gather_word_rows`` rows each), in a capacity ``bucket``."""
    from tessera_jax.planning.planner import bucket

    return np.zeros((bucket(S + S * abi.gather_word_rows(tile_q, tile_kv)), abi.STEP_COLS),
                    np.int32)


def _put_rows(rows, kv_start, qlo, qhi, klo, khi, full):
    """The gathered steps' rows (but ``STEP_CUTS_A``): first chunk's key, the rectangle of
    rows [qlo, qhi) x keys [klo, khi) in the tile, and the flag (whole, or masked)."""
    rows[:, abi.STEP_KV_START] = kv_start
    rows[:, abi.STEP_RECT] = abi.pack_rect(qlo, qhi, klo, khi)
    rows[:, abi.STEP_CUTS_B] = np.where(full, abi.GATHER_FULL_FLAG, abi.GATHER_FLAG)


def _point_words(steps, S: int, wr: int):
    """Each of the S step rows' ``STEP_CUTS_A``: where its ``wr`` word rows start."""
    steps[:S, abi.STEP_CUTS_A] = (S + np.arange(S) * wr) * abi.STEP_COLS


def _assemble_words(words, meta, head, qs, lo, hi, cnt, nfull, area, tile_q,
                    tile_kv) -> GatherRaw:
    """The raw plan of the units' steps from their packed words (int32 [S, gather_words]) and
    ``meta`` (int [S, 6]: first chunk start, selected rows [lo, hi), keys [lo, hi), all
    selected; ``loops._nb_gather_units``' layout)."""
    S = int(cnt.sum())
    wr = abi.gather_word_rows(tile_q, tile_kv)
    steps = _steps_array(S, tile_q, tile_kv)
    if S:
        steps[S: S + S * wr].reshape(S, wr * abi.STEP_COLS)[:, : words.shape[1]] = words
        _put_rows(steps[:S], *meta[:, :5].T, meta[:, 5].astype(bool))
        _point_words(steps, S, wr)
    return GatherRaw(head, qs, lo, hi, cnt, nfull, area, steps, S * wr)
