"""Mask features for plan selection: a short, fixed vector describing a ``BlockMask``'s shape.

The ranking tables (``tessera_jax.selection``) map these features to an ordered list of
candidate plans, so they must be cheap (selection, features included, runs per request: the
budget is <= 1 ms at Wan 720p, 40 heads x 1182 x 1182 blocks, i.e. 56 M booleans, more than
one pass over the mask costs). They are computed on packed bits of a *deterministic row
sample* of the mask: at most ``MAX_SAMPLE_HEADS`` mask heads (evenly spaced) and, per head,
pairs of adjacent query-block rows (evenly spaced, staggered between heads) so that at most
``SAMPLE_BITS`` block bits are read. A mask under that size is read whole and its features are
exact. Results are cached by (mask digest, call shape).

Features (``FEATURE_NAMES``; all scale-free or log2):

* ``log2_q_tiles``: log2 of query heads x Lq / 128, capped at ``Q_TILES_CAP`` (work units of
  a 128-row tile: the parallelism available against the SM count; beyond ~30 waves on 132 SMs
  it stops mattering, and the cap lets tables profiled on head subsets serve full calls);
  ``log2_kv_len``: log2 Lkv; ``head_dim``: D / 128.
* ``density`` (selected token pairs / all), ``block_density`` (selected blocks / all).
* ``row_cv``, ``row_max_mean``: spread of selected keys (tokens) per non-empty query-block row.
* ``empty_rows``: fraction of query-block rows with no selected key.
* ``runs_per_row``: runs of adjacent selected key blocks per non-empty row; ``log2_run_tokens``:
  log2 of their mean length in tokens; ``contiguity``: fraction of selected key blocks whose
  right neighbour is selected too (merging along keys pays when high).
* ``same_rows``: fraction of adjacent query-block rows with identical key lists (merging along
  queries pays when high).
* ``log2_q_block``, ``log2_kv_block``: log2 median logical block size; ``q_mult64``,
  ``q_mult128``, ``kv_mult64``, ``kv_mult128``: fraction of blocks whose size is a multiple of
  64 / 128 tokens (blocks that tile exactly).
* ``kv_partial64``, ``kv_partial128``: fraction of selected key blocks whose size is not a
  multiple of the tile (their last tile is partial under ``keep``); ``run_offgrid64``,
  ``run_offgrid128``: fraction of run edges (starts and ends) off the 64 / 128 token grid
  (partial tiles under ``merge`` and ``split``); ``q_partial128``: fraction of non-empty query
  rows' tokens in blocks whose size is not a multiple of 128.
* ``head_density_cv``: std / mean of per-head densities (0 for a shared mask).
"""

from __future__ import annotations

import collections
import math

import numpy as np

from .mask import BlockMask

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
MAX_SAMPLE_HEADS = 8
_MIN_PAIRS = 4
#: ``log2_q_tiles`` saturates here (4096 query tiles of 128 rows).
Q_TILES_CAP = 4096

_U64 = np.dtype("<u8")
_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 1024


def clear_cache() -> None:
    """Forgets cached features (tests and timing of the uncached path)."""
    _CACHE.clear()
    _BOUNDS.clear()


def _pack(bits: np.ndarray) -> np.ndarray:
    """bool [..., n] -> little-endian uint64 words [..., ceil(n / 64)] (bit j%64 of word j//64)."""
    pk = np.packbits(bits, axis=-1, bitorder="little")
    nb = pk.shape[-1]
    W = -(-nb // 8)
    if nb != 8 * W:
        pk = np.pad(pk, [(0, 0)] * (pk.ndim - 1) + [(0, 8 * W - nb)])
    return np.ascontiguousarray(pk).view(_U64)


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


def _sample(mask: BlockMask) -> tuple[np.ndarray, np.ndarray, int]:
    """(blocks [Hs, 2P, nkv] as rows i_0..i_{P-1} then i_0+1..i_{P-1}+1, query rows, pairs)."""
    Hm, nq, nkv = mask.blocks.shape
    if nq < 2:
        return mask.blocks, np.zeros((Hm, 1), np.int64), 0
    if Hm * nq * nkv <= SAMPLE_BITS:
        b = mask.blocks
        rows = np.arange(nq)
        pairs = nq - 1
        # All rows, and the same rows shifted by one for the adjacency comparison.
        return b, np.broadcast_to(rows, (Hm, nq)), pairs
    hs = np.unique(np.linspace(0, Hm - 1, min(Hm, MAX_SAMPLE_HEADS)).round().astype(np.int64))
    P = max(_MIN_PAIRS, min(nq - 1, SAMPLE_BITS // (2 * len(hs) * nkv)))
    stride = (nq - 1) / P
    base = np.arange(P) * stride
    offs = (np.arange(len(hs)) / len(hs)) * stride
    rows = np.minimum(np.floor(base[None, :] + offs[:, None]).astype(np.int64), nq - 2)
    rows = np.concatenate([rows, rows + 1], axis=1)                      # [Hs, 2P]
    return mask.blocks[hs[:, None], rows], rows, P


def _mask_part(mask: BlockMask) -> dict:
    """Features that depend only on the mask (cached by digest)."""
    info = _bounds_info(mask.kv_bounds, mask.q_bounds)
    Hm, nq, nkv = mask.blocks.shape
    Lkv = mask.Lkv
    if Hm * nq * nkv <= SAMPLE_BITS:
        S = mask.blocks
        rows = np.broadcast_to(np.arange(nq), (Hm, nq))
        exact = True
    else:
        S, rows, _ = _sample(mask)
        exact = False
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
    runs = np.bitwise_count(starts).sum(-1, dtype=np.int64)
    adjacent = int(np.bitwise_count(words & follow).sum(dtype=np.int64))

    def popc(a, m):
        return int(np.bitwise_count(a & m).sum(dtype=np.int64))

    cm = info["colmasks"]
    qs = info["qs"][rows]                                               # [Hs, R] row heights
    nonempty = cnt > 0
    total_blocks = int(cnt.sum())
    total_runs = int(runs.sum())
    tok_ne = tok[nonempty]
    mean_tok = float(tok_ne.mean()) if tok_ne.size else 0.0
    head_dens = (qs * tok).sum(-1) / np.maximum(qs.sum(-1) * Lkv, 1)
    hmean = float(head_dens.mean())
    density = hmean
    block_density = total_blocks / (Hs * R * nkv)
    # Identical adjacent rows: exact over all adjacent pairs, or over the sampled pairs.
    if exact:
        same = (words[:, 1:] == words[:, :-1]).all(-1) if nq > 1 else np.ones((Hs, 0), bool)
    else:
        P = R // 2
        same = (words[:, :P] == words[:, P:]).all(-1)
    q_off = info["q_off128"][rows]
    f = dict(info["static"])
    f.update({
        "density": density,
        "block_density": block_density,
        "row_cv": float(tok_ne.std() / mean_tok) if mean_tok > 0 else 0.0,
        "row_max_mean": float(tok_ne.max() / mean_tok) if mean_tok > 0 else 0.0,
        "empty_rows": float(1.0 - nonempty.mean()),
        "runs_per_row": float(total_runs / max(int(nonempty.sum()), 1)),
        "log2_run_tokens": math.log2(float(tok.sum()) / total_runs) if total_runs else 0.0,
        "contiguity": adjacent / total_blocks if total_blocks else 0.0,
        "same_rows": float(same.mean()) if same.size else 1.0,
        "kv_partial64": popc(words, cm[0]) / total_blocks if total_blocks else 0.0,
        "kv_partial128": popc(words, cm[1]) / total_blocks if total_blocks else 0.0,
        "run_offgrid64": ((popc(starts, cm[2]) + popc(ends, cm[4]))
                          / (2 * total_runs) if total_runs else 0.0),
        "run_offgrid128": ((popc(starts, cm[3]) + popc(ends, cm[5]))
                           / (2 * total_runs) if total_runs else 0.0),
        "q_partial128": (float((qs * q_off * nonempty).sum() / max((qs * nonempty).sum(), 1))),
        "head_density_cv": (float(head_dens.std() / hmean) if (Hs > 1 and hmean > 0) else 0.0),
    })
    f["_exact"] = exact
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
