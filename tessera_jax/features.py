"""Mask features for plan selection: a short, fixed vector describing a ``BlockMask``'s shape.

The ranking tables (``tessera_jax.selection``) map these features to an ordered list of
candidate plans, so they must be cheap (selection, features included, runs per request: the
budget is <= 1 ms at Wan 720p, 40 heads x 1182 x 1182 blocks, i.e. 56 M booleans, more than
one pass over the mask costs). Row statistics are averages over query *tokens* (a block row
counts with its height). They are computed on packed bits: of the whole mask when it has at
most ``SAMPLE_BITS`` block bits (exact), else of a deterministic sample: at most
``MAX_SAMPLE_HEADS`` mask heads (evenly spaced) and, per head, block rows at query tokens
evenly spaced along Lq (staggered between heads; a row is drawn in proportion to its tokens),
each with the row after it for the adjacency statistic. The mask part is cached by digest;
the call-shape part costs microseconds.

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
import math

import numpy as np

from .mask import BlockMask
from .planner import _pack  # bool rows -> uint64 words, shared with the planner

__all__ = ["FEATURE_NAMES", "mask_features", "feature_vector", "clear_cache", "SAMPLE_BITS",
           "MAX_SAMPLE_HEADS", "Q_TILES_CAP"]

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
_MIN_PAIRS = 4
#: ``log2_q_tiles`` saturates here (1024 query tiles of 128 rows).
Q_TILES_CAP = 1024

_U64 = np.dtype("<u8")
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 1024


def clear_cache() -> None:
    """Forgets cached features (tests and timing of the uncached path)."""
    _CACHE.clear()
    _BOUNDS.clear()




_BOUNDS: collections.OrderedDict = collections.OrderedDict()


def _bounds_info(kv_bounds: np.ndarray, q_bounds: np.ndarray) -> dict:
    """Per-column masks and look-up tables that depend only on the block bounds (cached)."""
    key = (kv_bounds.tobytes(), q_bounds.tobytes())
    hit = _BOUNDS.get(key)
    if hit is not None:
        return hit
    ks = np.diff(kv_bounds)
    qs = np.diff(q_bounds)
    nkv = ks.size
    nbytes = -(-nkv // 8)
    uniform = nkv == 1 or bool(np.all(ks[:-1] == ks[0]))
    lut = None
    if not uniform:
        # Byte look-up table: tokens of the set bits of byte value v at byte position p.
        padded = np.zeros(nbytes * 8, np.float64)
        padded[:nkv] = ks
        bits = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(np.float64)
        lut = (padded.reshape(nbytes, 8) @ bits.T).astype(np.float32).reshape(-1)
    W = -(-nbytes // 8)
    info = {
        "ks": ks, "qs": qs, "nkv": nkv, "nbytes": nbytes, "W": W,
        "lut": lut, "lut_base": (np.arange(nbytes, dtype=np.int32) * 256)[None, :],
        # (size, last size) when every key block but the last has one size: no table needed
        "uniform": (int(ks[0]), int(ks[-1])) if uniform else None,
        # bit masks over key blocks: [size off the 64 / 128 grid, start off it, end off it]
        "colmasks": _pack(np.stack([ks % 64 != 0, ks % 128 != 0,
                                    kv_bounds[:-1] % 64 != 0, kv_bounds[:-1] % 128 != 0,
                                    kv_bounds[1:] % 64 != 0, kv_bounds[1:] % 128 != 0])),
        "static": {
            "log2_q_block": math.log2(_median(qs)),
            "log2_kv_block": math.log2(_median(ks)),
            "q_mult64": float(np.mean(qs % 64 == 0)),
            "q_mult128": float(np.mean(qs % 128 == 0)),
            "kv_mult64": float(np.mean(ks % 64 == 0)),
            "kv_mult128": float(np.mean(ks % 128 == 0)),
        },
        "q_off128": (qs % 128 != 0),
    }
    if len(_BOUNDS) >= 64:
        _BOUNDS.popitem(last=False)
    _BOUNDS[key] = info
    return info


def _median(a: np.ndarray) -> float:
    n = a.size
    p = np.partition(a, [(n - 1) // 2, n // 2])
    return 0.5 * float(p[(n - 1) // 2] + p[n // 2])


def _sample(mask: BlockMask):
    """(blocks [Hs, R, nkv], query-block row of each, row weights [Hs, R], pair weights
    [Hs, R // 2] or [Hs, R - 1], paired) for the feature estimates.

    Whole mask (exact): every row, weighted by its query tokens; adjacent pairs (i, i+1).
    Sampled: up to ``MAX_SAMPLE_HEADS`` heads (evenly spaced) and per head ``P`` query *tokens*
    evenly spaced along Lq (staggered between heads), each standing for its block row: rows
    are drawn in proportion to their tokens, so every sampled row has weight 1. The rows come
    as [r_0..r_{P-1}, r_0+1..r_{P-1}+1] so the second half pairs with the first.
    """
    Hm, nq, nkv = mask.blocks.shape
    qs = np.diff(mask.q_bounds).astype(np.float64)
    if Hm * nq * nkv <= SAMPLE_BITS or nq < 2:
        rows = np.broadcast_to(np.arange(nq), (Hm, nq))
        w = np.broadcast_to(qs, (Hm, nq))
        return mask.blocks, rows, w, w[:, :-1], False
    hs = np.unique(np.linspace(0, Hm - 1, min(Hm, MAX_SAMPLE_HEADS)).round().astype(np.int64))
    Hs = len(hs)
    P = max(_MIN_PAIRS, SAMPLE_BITS // (2 * Hs * nkv))
    Lq = mask.Lq
    pos = (np.arange(P)[None, :] + (np.arange(Hs)[:, None] + 0.5) / Hs) * (Lq / P)
    rows = np.searchsorted(mask.q_bounds, pos.astype(np.int64), side="right") - 1
    rows = np.minimum(rows, nq - 2)
    rows = np.concatenate([rows, rows + 1], axis=1)                      # [Hs, 2P]
    w = np.ones((Hs, 2 * P))
    w[:, P:] = 0.0                     # the paired rows only serve the same-rows comparison
    return mask.blocks[hs[:, None], rows], rows, w, np.ones((Hs, P)), True


def _mask_part(mask: BlockMask) -> dict:
    """Features that depend only on the mask (cached by digest)."""
    info = _bounds_info(mask.kv_bounds, mask.q_bounds)
    nkv = mask.blocks.shape[2]
    Lkv = mask.Lkv
    S, rows, w, pw, paired = _sample(mask)
    Hs, R, _ = S.shape
    by = np.packbits(S, axis=-1, bitorder="little")                   # [Hs, R, nbytes]
    W = info["W"]
    if by.shape[-1] != 8 * W:
        by8 = np.zeros(by.shape[:-1] + (8 * W,), np.uint8)
        by8[..., : by.shape[-1]] = by
    else:
        by8 = np.ascontiguousarray(by)
    words = by8.view(_U64)                                              # [Hs, R, W]
    cnt = np.bitwise_count(words).sum(-1, dtype=np.int64)               # blocks per row
    # Selected tokens per row: block count x the common size when key blocks are uniform (the
    # last may be partial), else a byte look-up table (tokens of the set bits of each byte).
    if info["uniform"] is not None:
        size, last = info["uniform"]
        tok = cnt * size
        if last != size:
            tok = tok - S[..., -1] * (size - last)
        tok = tok.astype(np.float64)
    else:
        idx = by.astype(np.int32)
        idx += info["lut_base"]
        tok = np.take(info["lut"], idx).sum(-1, dtype=np.float64)
    one, top = np.uint64(1), np.uint64(63)
    carry = np.zeros_like(words)
    carry[..., 1:] = words[..., :-1] >> top
    starts = words & ~((words << one) | carry)
    nxt = np.zeros_like(words)
    nxt[..., :-1] = (words[..., 1:] & one) << top
    follow = (words >> one) | nxt                 # bit j set iff block j+1 is selected
    ends = words & ~follow
    cm = info["colmasks"]

    def popc(a, m=None):                          # per row
        return np.bitwise_count(a if m is None else a & m).sum(-1, dtype=np.int64)

    runs = popc(starts)
    sw = w.sum()
    ne = (cnt > 0) * w                            # weights of non-empty rows
    swn = ne.sum()
    sel = (w * cnt).sum()
    nruns = (w * runs).sum()

    def wfrac(num, den):
        return float(num / den) if den > 0 else 0.0

    mean_tok = wfrac((ne * tok).sum(), swn)
    var_tok = wfrac((ne * (tok - mean_tok) ** 2).sum(), swn)
    tok_max = float(tok[ne > 0].max()) if swn > 0 else 0.0
    head_dens = (w * tok).sum(-1) / np.maximum(w.sum(-1) * Lkv, 1e-300)
    hmean = float(head_dens.mean())
    if paired:
        P = R // 2
        same = (words[:, :P] == words[:, P:]).all(-1)
    else:
        same = (words[:, 1:] == words[:, :-1]).all(-1)
    qoff = info["q_off128"][rows]
    f = dict(info["static"])
    f.update({
        "density": hmean,
        "block_density": wfrac(sel, sw * nkv),
        "row_cv": math.sqrt(var_tok) / mean_tok if mean_tok > 0 else 0.0,
        "row_max_mean": tok_max / mean_tok if mean_tok > 0 else 0.0,
        "empty_rows": 1.0 - wfrac(swn, sw),
        "runs_per_row": wfrac(nruns, swn),
        "log2_run_tokens": math.log2((w * tok).sum() / nruns) if nruns > 0 else 0.0,
        "contiguity": wfrac((w * popc(words, follow)).sum(), sel),
        "same_rows": wfrac((pw * same).sum(), pw.sum()) if same.size else 1.0,
        "kv_partial64": wfrac((w * popc(words, cm[0])).sum(), sel),
        "kv_partial128": wfrac((w * popc(words, cm[1])).sum(), sel),
        "run_offgrid64": wfrac((w * (popc(starts, cm[2]) + popc(ends, cm[4]))).sum(), 2 * nruns),
        "run_offgrid128": wfrac((w * (popc(starts, cm[3]) + popc(ends, cm[5]))).sum(),
                                2 * nruns),
        "q_partial128": wfrac((ne * qoff).sum(), swn),
        "head_density_cv": (float(head_dens.std() / hmean) if (Hs > 1 and hmean > 0) else 0.0),
    })
    f["_exact"] = not paired
    return f


def mask_features(mask: BlockMask, shape=None) -> dict:
    """Features of ``mask`` (``FEATURE_NAMES``) for a call of ``shape`` (an ``AttnShape`` or
    None: one query head per mask head, head_dim 128). Cached by mask digest."""
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a BlockMask, got {type(mask).__name__}")
    key = mask.digest
    part = _CACHE.get(key)
    if part is None:
        part = _mask_part(mask)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.popitem(last=False)
        _CACHE[key] = part
    hq = mask.num_heads if shape is None else int(shape.num_q_heads)
    lq = mask.Lq if shape is None else int(shape.q_len)
    lkv = mask.Lkv if shape is None else int(shape.kv_len)
    d = 128 if shape is None else int(shape.head_dim)
    out = {k: v for k, v in part.items() if not k.startswith("_")}
    out["log2_q_tiles"] = math.log2(min(max(hq * lq / 128.0, 1.0), Q_TILES_CAP))
    out["log2_kv_len"] = math.log2(max(lkv, 1))
    out["head_dim"] = d / 128.0
    return out


def feature_vector(mask: BlockMask, shape=None) -> np.ndarray:
    """``mask_features`` as float64 [len(FEATURE_NAMES)] in ``FEATURE_NAMES`` order."""
    f = mask_features(mask, shape)
    return np.array([f[n] for n in FEATURE_NAMES], np.float64)
