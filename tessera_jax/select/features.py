"""Mask features for plan selection: a short, fixed vector describing a ``BlockMask``'s shape.

The ranking tables (``tessera_jax.select.ranking``) map these features to an ordered list of
candidate plans, so they must be cheap (selection, features included, runs per request: the
budget is <= 1 ms at Wan 720p, 40 heads x 1182 x 1182 blocks, i.e. 56 M booleans, more than
one pass over the mask costs). Row statistics are averages over query *tokens* (a block row
counts with its height). They are computed on packed bits: of the whole mask when it has at
most ``SAMPLE_BITS`` block bits (exact), else of a deterministic sample: at most
``MAX_SAMPLE_HEADS`` mask heads (both are the defaults of ``Sampling``, an argument) (evenly spaced) and, per head, block rows at query tokens
evenly spaced along Lq (staggered between heads; a row is drawn in proportion to its tokens),
each with the row after it for the same-rows statistic. The mask part is cached by digest;
the call-shape part costs microseconds.

Cost: what depends only on the layout (mask heads and block bounds: the sampled rows and their
weights, key-block bit masks, bounds-only features) is cached per layout, so a new mask of a
known layout costs one strided read of its sampled rows, one packing, and a fixed handful of
whole-array operations on the packed words (one popcount stack whose row totals give every
count). Selection on Wan 720p 40-head masks (four corpus families and a random one), on a
2-core AMD EPYC host: 0.12-0.18 ms for a new mask of a known layout, 0.23-0.34 ms for a new
layout (was 0.46-0.62 and 0.58-0.77 ms), ~0.4 us cached (``benchmarks/selection.py
--cost-only``; ``benchmarks/results/cpu-selection-cost.json``).

Features (``FEATURE_NAMES``; all scale-free or log2):

* ``log2_q_tiles``: log2 of query heads x Lq / 128, capped at ``Q_TILES_CAP`` = 1024 (work
  units of a 128-row tile: the parallelism available against the SM count; beyond ~8 waves on
  132 SMs it hardly matters, and the cap makes a table profiled on a head subset -- 4 heads of
  a 32K-token video already reach it -- see full calls as the same size, instead of as larger
  than every training mask);
  ``log2_kv_len``: log2 Lkv; ``head_dim``: D / 128.
* ``density`` (selected token pairs / all), ``block_density`` (selected blocks / all).
* ``row_cv``, ``row_max_mean``: spread of selected keys (tokens) per query of a non-empty row.
* ``empty_rows``: fraction of queries with no selected key.
* ``runs_per_row``: runs of adjacent selected key blocks per non-empty row; ``log2_run_tokens``:
  log2 of their mean length in tokens; ``contiguity``: fraction of selected key blocks whose
  right neighbour is selected too (merging along keys pays when high).
* ``same_rows``: fraction of query-block rows whose next row has the identical key list
  (merging along queries pays when high).
* ``log2_q_block``, ``log2_kv_block``: log2 median logical block size; ``q_mult64``,
  ``q_mult128``, ``kv_mult64``, ``kv_mult128``: fraction of blocks whose size is a multiple of
  64 / 128 tokens (blocks that tile exactly).
* ``kv_partial64``, ``kv_partial128``: fraction of selected key blocks whose size is not a
  multiple of the tile (their last tile is partial under ``keep``); ``run_offgrid64``,
  ``run_offgrid128``: fraction of run edges (starts and ends) off the 64 / 128 token grid
  (partial tiles under ``merge`` and ``split``); ``q_partial128``: fraction of the queries of
  non-empty rows that sit in a block whose size is not a multiple of 128.
* ``head_density_cv``: std / mean of per-head densities (0 for a shared mask).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.planning.planner import pack_rows  # bool rows -> uint64 words, as the planner packs

__all__ = ["FEATURE_NAMES", "Sampling", "mask_features", "feature_vector", "clear_cache",
           "SAMPLE_BITS", "MAX_SAMPLE_HEADS", "Q_TILES_CAP"]

FEATURE_NAMES = (
    "log2_q_tiles", "log2_kv_len", "head_dim",
    "density", "block_density", "row_cv", "row_max_mean", "empty_rows",
    "runs_per_row", "log2_run_tokens", "contiguity", "same_rows",
    "log2_q_block", "log2_kv_block", "q_mult64", "q_mult128", "kv_mult64", "kv_mult128",
    "kv_partial64", "kv_partial128", "run_offgrid64", "run_offgrid128", "q_partial128",
    "head_density_cv",
)

#: Most block bits read per mask (beyond it, rows are sampled); 2^19 bits = 64 KiB packed.
SAMPLE_BITS = 1 << 19
#: Most mask heads read per mask.
MAX_SAMPLE_HEADS = 64


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Which block bits the features read: the whole mask up to ``bits`` block bits, else a
    sample of at most ``max_heads`` heads and about ``bits`` bits (the ranking tables were
    fitted on the defaults)."""

    bits: int = SAMPLE_BITS
    max_heads: int = MAX_SAMPLE_HEADS

    def __post_init__(self):
        for name in ("bits", "max_heads"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"sampling {name} must be a positive int, got {val!r}")


DEFAULT_SAMPLING = Sampling()
_MIN_PAIRS = 4
#: ``log2_q_tiles`` saturates here (1024 query tiles of 128 rows).
Q_TILES_CAP = 1024

_U64 = np.dtype("<u8")
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 1024
_LAYOUTS: collections.OrderedDict = collections.OrderedDict()
_LAYOUT_CACHE_SIZE = 32
#: Most distinct key-block sizes counted by bit masks; beyond, a byte look-up table sums tokens.
_MAX_SIZE_GROUPS = 8
# Indices into FEATURE_NAMES of the call-shape features (filled per call).
_I_QT, _I_KV, _I_HD = (FEATURE_NAMES.index(n) for n in ("log2_q_tiles", "log2_kv_len",
                                                         "head_dim"))
_ONE, _TOP = np.uint64(1), np.uint64(63)
# [8, 256] float32: bit b of byte value v.
_BYTE_BITS = ((np.arange(256)[None, :] >> np.arange(8)[:, None]) & 1).astype(np.float32)
_NOT_BIT0 = ~np.uint64(1)


def clear_cache() -> None:
    """Forgets cached features and layouts (``tessera_jax.clear_caches`` calls it)."""
    _CACHE.clear()
    _LAYOUTS.clear()


class _Layout:
    """What depends only on (mask heads, block bounds): the rows read and their weights, the
    key-block bit masks and the bounds-only features. Cached per layout (a new mask of a known
    layout only reads its rows)."""

    __slots__ = ("exact", "nkv", "W", "n64", "H", "R", "idx", "view_rows", "tail", "valid",
                 "plan", "K", "coef", "lut", "lut_base", "w", "w_sum", "w_head",
                 "wq", "pw", "pw_sum", "static", "fix", "ones_w", "ones_b",
                 "head_den")


def _median(a: np.ndarray) -> float:
    n = a.size
    p = np.partition(a, [(n - 1) // 2, n // 2])
    return 0.5 * float(p[(n - 1) // 2] + p[n // 2])


def _sizes(a: np.ndarray):
    """Block sizes as (first size, the sizes that differ from it, median, fraction of
    multiples of 64, of 128); layouts mostly repeat one size, so the rest is short."""
    n = a.size
    base = int(a[0])
    rest = a[a != base]
    nb = n - rest.size
    med = float(base) if 2 * nb > n else _median(a)   # a value in over half the slots
    m64 = (nb if base % 64 == 0 else 0) + (np.count_nonzero((rest & 63) == 0) if rest.size else 0)
    m128 = (nb if base % 128 == 0 else 0) + (np.count_nonzero((rest & 127) == 0)
                                             if rest.size else 0)
    return base, rest, med, m64 / n, m128 / n


def _layout(mask: BlockMask, sampling: Sampling = DEFAULT_SAMPLING) -> _Layout:
    """The mask's layout (cached: looked up by shape, then compared bound by bound, which is
    cheaper than hashing the bounds)."""
    qb, kb = mask.q_bounds, mask.kv_bounds
    Hm, nq, nkv = mask.blocks.shape
    key = (Hm, nq, nkv, int(qb[-1]), int(kb[-1]), sampling)
    entries = _LAYOUTS.get(key)
    if entries is None:
        entries = _LAYOUTS[key] = []
        if len(_LAYOUTS) > _LAYOUT_CACHE_SIZE:
            _LAYOUTS.popitem(last=False)
    for q2, k2, lay in entries:
        if (q2 is qb or np.array_equal(q2, qb)) and (k2 is kb or np.array_equal(k2, kb)):
            return lay
    lay = _make_layout(mask, Hm, nq, nkv, sampling)
    if len(entries) >= 4:
        entries.pop(0)
    entries.append((qb, kb, lay))
    return lay


def _make_layout(mask: BlockMask, Hm: int, nq: int, nkv: int,
                 sampling: Sampling = DEFAULT_SAMPLING) -> _Layout:
    kb, qb = mask.kv_bounds, mask.q_bounds
    ks, qs = kb[1:] - kb[:-1], qb[1:] - qb[:-1]
    lay = _Layout()
    W = -(-nkv // 64)
    lay.nkv, lay.W, lay.n64 = nkv, W, 64 * W
    _, _, q_med, q64, q128 = _sizes(qs)
    base, rest, k_med, k64, k128 = _sizes(ks)
    lay.static = {"log2_q_block": math.log2(q_med), "log2_kv_block": math.log2(k_med),
                  "q_mult64": q64, "q_mult128": q128, "kv_mult64": k64, "kv_mult128": k128}
    lay.exact = Hm * nq * nkv <= sampling.bits or nq < 2
    if lay.exact:
        _whole_rows(lay, qs, Hm, nq)
    else:
        _sampled_rows(lay, mask, qs, sampling)
    lay.head_den = np.maximum(np.asarray(lay.w_head, np.float64) * mask.Lkv, 1e-300)
    lay.fix = lay.n64 == nkv    # the top bit of a row's last word is a block: no carry across
    _count_stack(lay, ks, kb, base, rest)
    return lay


def _whole_rows(lay: _Layout, qs: np.ndarray, Hm: int, nq: int) -> None:
    """The layout reads the whole mask: every row, weighted by its query tokens; adjacent
    pairs (i, i + 1)."""
    q_off = (qs & 127) != 0
    w = np.broadcast_to(qs.astype(np.float64), (Hm, nq))
    lay.w, lay.w_sum, lay.w_head = w.reshape(-1), float(w.sum()), w.sum(-1)
    lay.wq = (w * q_off).reshape(-1)
    pw = np.array(w)
    pw[:, -1] = 0.0                   # the last row of a head has no pair
    lay.pw, lay.pw_sum = pw.reshape(-1), float(pw.sum())
    lay.idx = None
    lay.H, lay.R = Hm, nq


def _sampled_rows(lay: _Layout, mask: BlockMask, qs: np.ndarray, sampling: Sampling) -> None:
    """The layout reads a sample: up to ``max_heads`` heads (evenly spaced) and per head P
    query *tokens* evenly spaced along Lq (staggered between heads), each standing for its
    block row (rows drawn in proportion to their tokens: weight 1), plus the row after each."""
    Hm, nq, nkv = mask.blocks.shape
    qb = mask.q_bounds
    if Hm <= sampling.max_heads:
        hs = np.arange(Hm)    # what the spacing below gives: linspace(0, Hm - 1, Hm)
    else:
        hs = np.unique(np.linspace(0, Hm - 1, sampling.max_heads).round().astype(np.int64))
    Hs = len(hs)
    P = max(_MIN_PAIRS, sampling.bits // (2 * Hs * nkv))
    pos = (np.arange(P)[None, :] + (np.arange(Hs)[:, None] + 0.5) / Hs) * (mask.Lq / P)
    r = np.searchsorted(qb, pos.astype(np.int64), side="right") - 1
    r = np.minimum(r, nq - 2)                                        # [Hs, P]
    flat = (hs[:, None] * nq + r).reshape(-1)
    lay.idx = np.concatenate([flat, flat + 1])                      # [2 Hs P]
    lay.w, lay.w_sum, lay.w_head = None, float(Hs * P), float(P)
    lay.wq = ((qs & 127) != 0)[r].reshape(-1).astype(np.float64)
    lay.pw, lay.pw_sum = None, float(Hs * P)
    # Rows are read as n64 bytes from their start (bytes past nkv belong to the next row and
    # are masked off after packing); the rows too close to the end are copied separately.
    lay.view_rows = max((Hm * nq * nkv - lay.n64) // nkv + 1, 0)
    lay.tail = (np.flatnonzero(lay.idx >= lay.view_rows)
                if int(lay.idx.max()) >= lay.view_rows else None)
    lay.H, lay.R = Hs, P


def _count_stack(lay: _Layout, ks, kb, base: int, rest) -> None:
    """The layout's popcount stack (``lay.plan``, ``lay.coef``, ``lay.lut``): which counts of
    a row's words give its tokens, partial blocks, runs and run edges."""
    nkv, W, M = lay.nkv, lay.W, lay.H * lay.R
    # Rows of the popcount stack: (source, key-block mask or None: all). Sources: 0 words,
    # 1 run edges (bit j: block j differs from block j - 1, i.e. a run starts at j or one
    # ended at j - 1), 3 words ^ the paired row. Tokens per row = sum over key-block size
    # groups of size x popcount, when there are few distinct sizes, else a byte look-up table;
    # every total is a coefficient vector over the stack's row totals. With L the rows whose
    # last block is selected (a run ends there, off the grid iff Lkv is) and E the edges
    # before it: runs = (E + L) / 2, run edges off the grid = E & off-grid bounds + L [Lkv off].
    if rest.size > 4 * _MAX_SIZE_GROUPS and len(set(rest[:64].tolist())) > _MAX_SIZE_GROUPS:
        vals = None                                   # many sizes: the look-up table
    else:
        vals = sorted(set(rest.tolist()))
        if len(vals) > _MAX_SIZE_GROUPS:
            vals = None
    use_lut = vals is None
    # coef rows: tokens, selected blocks off the 64 / 128 grid, runs, run edges off the
    # 64 / 128 grid, rows unlike their pair; columns: the stack's rows.
    plan, coef = [(0, None)], [[float(base), float(base % 64 != 0), float(base % 128 != 0),
                                0.0, 0.0, 0.0, 0.0]]

    index = {(0, None): 0}

    def add(src, m, j, c):
        """Counts popcount(source & m) with coefficient c in coef row j (m None: all); equal
        rows are counted once."""
        key = (src, None if m is None else m.tobytes())
        i = index.get(key)
        if i is None:
            if m is not None and not m.any():
                return
            i = index[key] = len(plan)
            plan.append((src, m))
            coef.append([0.0] * 7)
        coef[i][j] += c

    if use_lut:
        coef[0][1:3] = [0.0, 0.0]
        add(0, (ks & 63) != 0, 1, 1.0)
        add(0, (ks & 127) != 0, 2, 1.0)
    else:
        for v in vals:
            m = ks == v
            add(0, m, 0, float(v - base))
            add(0, m, 1, float(v % 64 != 0) - float(base % 64 != 0))
            add(0, m, 2, float(v % 128 != 0) - float(base % 128 != 0))
    lastm = np.zeros(nkv, bool)
    lastm[-1] = True
    add(0, lastm, 3, 0.5)
    add(0, lastm, 4, float(kb[-1] % 64 != 0))
    add(0, lastm, 5, float(kb[-1] % 128 != 0))
    add(1, np.ones(nkv, bool), 3, 0.5)
    add(1, (kb[:-1] & 63) != 0, 4, 1.0)
    add(1, (kb[:-1] & 127) != 0, 5, 1.0)
    add(3, None, 6, 1.0)
    K = len(plan)
    rows = np.zeros((K, lay.n64), bool)
    rows[0, :nkv] = True
    for i, (_, m) in enumerate(plan):
        if m is not None:
            rows[i, :nkv] = m
    masks = np.packbits(rows.reshape(-1), bitorder="little").view(_U64).reshape(K, W)
    lay.valid = masks[0]
    lay.plan = [(s, None if m is None else np.repeat(masks[i][None], M, 0))
                for i, (s, m) in enumerate(plan)]
    lay.coef, lay.K = np.array(coef).T.copy(), K
    lay.lut = None
    if use_lut:
        # Byte look-up table: tokens of the set bits of byte value v at byte position p.
        # All 8 W bytes of a row (the padding bytes are 0: no tokens), so that the indices
        # come from contiguous arrays: byte value + 256 x position (tiled over the rows).
        padded = np.zeros(lay.n64, np.float32)           # sums of <= 8 sizes: exact
        padded[:nkv] = ks
        lay.lut = (padded.reshape(8 * W, 8) @ _BYTE_BITS).reshape(-1)
        lay.lut_base = np.repeat((np.arange(8 * W, dtype=np.intp) * 256)[None], M, 0)
        lay.ones_b = np.ones(8 * W, np.float32)          # row sums < 2^24: exact in float32
    lay.ones_w = np.ones(W, np.float32)


def _words(mask: BlockMask, lay: _Layout) -> np.ndarray:
    """Packed uint64 words of the rows the layout reads: [H R, W] (exact) or [2, Hs P, W]
    (sampled: the rows, then the row after each)."""
    b = mask.blocks
    if lay.exact:
        return pack_rows(b).reshape(-1, lay.W)
    nkv, n64 = lay.nkv, lay.n64
    if not b.flags.c_contiguous:                      # (BlockMask makes it contiguous)
        b = np.ascontiguousarray(b)
    idx = lay.idx
    if lay.view_rows == 0:                            # a tiny mask: copy the rows
        g = np.zeros((idx.size, n64), np.bool_)
        g[:, :nkv] = b.reshape(-1, nkv)[idx]
    else:
        # rows of n64 bytes, one every nkv bytes (b is C-contiguous and read-only: so is the
        # view); fancy indexing, as np.take would first copy the whole view
        view = np.ndarray((lay.view_rows, n64), np.bool_, b, 0, (nkv, 1))
        if lay.tail is None:
            g = view[idx]
        else:
            g = view[np.minimum(idx, lay.view_rows - 1)]
            g[lay.tail, :nkv] = b.reshape(-1, nkv)[idx[lay.tail]]
    words = np.packbits(g.reshape(-1), bitorder="little").view(_U64).reshape(2, -1, lay.W)
    if n64 != nkv:
        words[..., -1] &= lay.valid[-1]
    return words


def _mask_part(mask: BlockMask, sampling: Sampling = DEFAULT_SAMPLING) -> dict:
    """Features that depend only on the mask (cached by digest and sampling)."""
    lay = _layout(mask, sampling)
    words = _words(mask, lay)
    A = words if lay.exact else words[0]                                # [M, W]
    M, W = A.shape
    a = A.reshape(-1)
    # Run edges: block j differs from block j - 1 (bit j of sh: block j - 1 selected; no
    # carry from the row before).
    sh = a << _ONE
    sh[1:] |= a[:-1] >> _TOP
    if lay.fix:
        sh.reshape(M, W)[:, 0] &= _NOT_BIT0
    edges = np.bitwise_xor(a, sh, out=sh).reshape(M, W)
    Z = np.empty((lay.K, M, W), _U64)
    for k, (src, m) in enumerate(lay.plan):
        if src == 3:                                                    # row vs its pair
            if lay.exact:
                np.bitwise_xor(A[:-1], A[1:], out=Z[k, :-1])
                Z[k, -1] = 0
            else:
                np.bitwise_xor(A, words[1], out=Z[k])
            continue
        x = A if src == 0 else edges
        if m is None:
            Z[k] = x
        else:
            np.bitwise_and(x, m, out=Z[k])
    if W == 1:
        C = np.bitwise_count(Z).reshape(lay.K, M).astype(np.float64)
    else:
        C = (np.bitwise_count(Z).astype(np.float32) @ lay.ones_w).astype(np.float64)  # [K, M]
    cnt = C[0]
    if lay.lut is None:
        tok = lay.coef[0] @ C                                           # tokens per row
    else:
        by = A.view(np.uint8).astype(np.intp)
        by += lay.lut_base
        tok = (np.take(lay.lut, by, mode="wrap") @ lay.ones_b).astype(np.float64)
    w = lay.w
    nonempty = cnt > 0
    diff = C[-1] == 0                   # same as its pair (the xor row is the stack's last)
    if w is None:                                                       # sampled: weights 1
        tot = C.sum(1)
        ne = nonempty.astype(np.float64)
        wtok = tok
        same = float(np.count_nonzero(diff))
    else:
        tot = C @ w
        ne = nonempty * w
        wtok = w * tok
        same = (lay.pw * diff).sum()
    # Python floats from here (the same float64 values; cheaper scalar arithmetic).
    _, p64, p128, nruns, off64, off128, _ = (lay.coef @ tot).tolist()
    sel = float(tot[0])
    sw = lay.w_sum
    swn = float(ne.sum())

    def wfrac(num, den):
        return num / den if den > 0 else 0.0

    stok = float(wtok.sum())
    mean_tok = wfrac(stok, swn)
    var_tok = wfrac(float((ne * (tok - mean_tok) ** 2).sum()), swn)
    tok_max = float(tok.max()) if swn > 0 else 0.0
    head_dens = wtok.reshape(lay.H, lay.R).sum(-1) / lay.head_den
    # mean and std as np.mean / np.std compute them (same values, less overhead)
    hm = np.add.reduce(head_dens) / lay.H
    hmean = float(hm)
    if lay.H > 1 and hmean > 0:
        x = head_dens - hm
        hcv = math.sqrt(float(np.add.reduce(x * x) / lay.H)) / hmean
    else:
        hcv = 0.0
    f = dict(lay.static)
    f.update({
        "density": hmean,
        "block_density": wfrac(sel, sw * lay.nkv),
        "row_cv": math.sqrt(var_tok) / mean_tok if mean_tok > 0 else 0.0,
        "row_max_mean": tok_max / mean_tok if mean_tok > 0 else 0.0,
        "empty_rows": 1.0 - wfrac(swn, sw),
        "runs_per_row": wfrac(nruns, swn),
        "log2_run_tokens": math.log2(stok / nruns) if nruns > 0 else 0.0,
        "contiguity": wfrac(sel - nruns, sel),     # adjacent pairs: each run has one end
        "same_rows": wfrac(float(same), lay.pw_sum) if lay.pw_sum > 0 else 1.0,
        "kv_partial64": wfrac(p64, sel),
        "kv_partial128": wfrac(p128, sel),
        "run_offgrid64": wfrac(off64, 2 * nruns),
        "run_offgrid128": wfrac(off128, 2 * nruns),
        "q_partial128": wfrac(float((nonempty * lay.wq).sum()), swn),
        "head_density_cv": hcv,
    })
    f["_exact"] = lay.exact
    f["_vec"] = np.array([f.get(n, 0.0) for n in FEATURE_NAMES], np.float64)
    return f


def _part(mask: BlockMask, sampling) -> dict:
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a BlockMask, got {type(mask).__name__}")
    if sampling is None:
        sampling = DEFAULT_SAMPLING
    elif not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a features.Sampling or None, got "
                        f"{type(sampling).__name__}")
    key = mask.digest if sampling is DEFAULT_SAMPLING else (mask.digest, sampling)
    part = _CACHE.get(key)
    if part is None:
        part = _mask_part(mask, sampling)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.popitem(last=False)
        _CACHE[key] = part
    return part


def _shape_features(mask: BlockMask, shape) -> tuple[float, float, float]:
    hq = mask.num_heads if shape is None else int(shape.num_q_heads)
    lq = mask.Lq if shape is None else int(shape.q_len)
    lkv = mask.Lkv if shape is None else int(shape.kv_len)
    d = 128 if shape is None else int(shape.head_dim)
    return (math.log2(min(max(hq * lq / 128.0, 1.0), Q_TILES_CAP)), math.log2(max(lkv, 1)),
            d / 128.0)


def mask_features(mask: BlockMask, shape=None, *, sampling: Sampling | None = None) -> dict:
    """Features of ``mask`` (``FEATURE_NAMES``) for a call of ``shape`` (an ``AttnShape`` or
    None: one query head per mask head, head_dim 128), read as ``sampling`` says (None:
    ``DEFAULT_SAMPLING``). Cached by mask digest and sampling."""
    part = _part(mask, sampling)
    out = {k: v for k, v in part.items() if not k.startswith("_")}
    out["log2_q_tiles"], out["log2_kv_len"], out["head_dim"] = _shape_features(mask, shape)
    return out


def feature_vector(mask: BlockMask, shape=None, *, sampling: Sampling | None = None
                   ) -> np.ndarray:
    """``mask_features`` as float64 [len(FEATURE_NAMES)] in ``FEATURE_NAMES`` order."""
    v = _part(mask, sampling)["_vec"].copy()
    v[_I_QT], v[_I_KV], v[_I_HD] = _shape_features(mask, shape)
    return v
