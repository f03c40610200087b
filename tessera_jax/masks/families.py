"""One deterministic generator per video sparse-attention mask family (docs/masks.md, "Families").

Every generator has the signature ``fn(grid, *, heads=None, seed=0, step=0, text=0, **params)``
and returns a ``BlockMask`` over the joint sequence: the video tokens in the family's order (see
``docs/masks.md``), then ``text`` joint text tokens (only on grids with ``text_max > 0``). Text
rows see every key and video rows see every text block (all families keep text dense). Static
families return one shared head (``Hm == 1``) unless their heads differ; dynamic families
select on synthetic scores (``scores.py``) and return one mask per head. Head ``i`` of a mask
depends only on (seed, step, params, i), never on ``heads``.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.masks import grids as G
from tessera_jax.masks.scores import BlockFeatures, ScoreField, block_features, head_params, point_features, rng_for

__all__ = ["FAMILIES", "STA_WINDOW_MIX", "dense", "sta", "ssta", "moba", "vsa", "radial", "svg",
           "svg2", "sparge", "xattn", "jenga", "natten", "ditfastattn", "tokens"]

#: STA windows (in tiles) and their shares in the released HunyuanVideo table.
STA_WINDOW_MIX = (((5, 3, 3), 0.40), ((1, 6, 10), 0.32), ((3, 3, 5), 0.15), ((5, 1, 10), 0.10),
                  ((5, 6, 1), 0.03))


# --- argument checks and assembly ----------------------------------------------------------------
def _common(name: str, grid, heads, seed, step, text):
    grid = G.get_grid(grid)
    if heads is None:
        heads = grid.heads
    for arg, v, lo in (("heads", heads, 1), ("seed", seed, 0), ("step", step, 0), ("text", text, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: {arg} must be an int, got {type(v).__name__}")
        if v < lo:
            raise ValueError(f"{name}: {arg} must be >= {lo}, got {v}")
    if text and not grid.joint:
        raise ValueError(f"{name}: text={text} but grid {grid.name!r} has no joint text "
                         f"(text_max=0); pass text=0")
    if text > grid.text_max:
        raise ValueError(f"{name}: text={text} exceeds grid {grid.name!r} text_max={grid.text_max}")
    return grid, int(heads), int(seed), int(step), int(text)


def _check_frac(name: str, arg: str, v, lo=0.0, hi=1.0, lo_open=True, hi_open=True):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: {arg} must be a number, got {type(v).__name__}")
    if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
        raise ValueError(f"{name}: {arg} must be in {'(' if lo_open else '['}{lo}, {hi}"
                         f"{')' if hi_open else ']'}, got {v}")
    return float(v)


def _check_ints(name: str, arg: str, v, n: int | None = None) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in v)
    except TypeError:
        raise TypeError(f"{name}: {arg} must be a sequence of ints, got {v!r}") from None
    if (n is not None and len(vals) != n) or any(x < 1 for x in vals):
        raise ValueError(f"{name}: {arg} must hold {n or 'some'} positive ints, got {v!r}")
    return vals


def _check_int(name: str, arg: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: {arg} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name}: {arg} must be >= {lo}, got {v}")
    return int(v)


def _assemble(qb, kb, blocks, text: int, text_q: int | None, text_kv: int | None = None):
    """Appends ``text`` joint tokens (blocks of ``text_q``/``text_kv``, ``None``: one block):
    text rows see everything, video rows see all text."""
    blocks = np.asarray(blocks, dtype=bool)
    if blocks.ndim == 2:
        blocks = blocks[None]
    if text:
        text_kv = text_q if text_kv is None else text_kv
        tq = G.uniform_bounds(text, text_q or text)
        tk = G.uniform_bounds(text, text_kv or text)
        Hm, nq, nk = blocks.shape
        out = np.ones((Hm, nq + len(tq) - 1, nk + len(tk) - 1), dtype=bool)
        out[:, :nq, :nk] = blocks
        blocks = out
        qb = np.concatenate([qb, qb[-1] + tq[1:]])
        kb = np.concatenate([kb, kb[-1] + tk[1:]])
    return BlockMask(qb, kb, blocks)


def _maybe_shared(blocks: np.ndarray) -> np.ndarray:
    """[H, nq, nk] -> [1, nq, nk] when all heads are equal."""
    if blocks.shape[0] > 1 and (blocks == blocks[:1]).all():
        return blocks[:1]
    return blocks


# --- selection helpers ---------------------------------------------------------------------------
def _top_k(s: np.ndarray, k: int) -> np.ndarray:
    """Per row, exactly the ``k`` largest entries (ties resolved by index)."""
    nq, nk = s.shape
    k = max(1, min(int(k), nk))
    if k == nk:
        return np.ones(s.shape, dtype=bool)
    thr = np.partition(s, nk - k, axis=1)[:, nk - k]
    out = s >= thr[:, None]
    bad = np.nonzero(out.sum(axis=1) != k)[0]          # ties at the threshold (rare)
    if bad.size:
        idx = np.argsort(-s[bad], axis=1, kind="stable")[:, :k]
        out[bad] = False
        out[bad[:, None], idx] = True
    return out


def _top_p(s: np.ndarray, p: float, min_count: int = 1) -> np.ndarray:
    """Per row, the fewest largest-probability entries whose softmax mass reaches ``p`` (at least
    ``min_count``). Overwrites ``s`` with the probabilities."""
    nk = s.shape[1]
    s -= s.max(axis=1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=1, keepdims=True)
    srt = np.sort(s, axis=1)                              # ascending
    cum = np.cumsum(srt, axis=1)
    # Keeping the top c entries reaches p iff the bottom nk - c hold <= 1 - p.
    j = (cum <= np.float32(1.0 - p) + np.float32(1e-7)).sum(axis=1)
    j = np.clip(j, 0, nk - max(1, min(min_count, nk)))
    thr = np.take_along_axis(srt, j[:, None], axis=1)
    return s >= thr


def _each_head(heads: int, one: Callable[[int], np.ndarray], out: np.ndarray) -> np.ndarray:
    """``out[h] = one(h)`` for every head, on a few threads (NumPy's sorts and partitions release
    the GIL). Each head depends only on its index, so the result does not depend on scheduling."""
    workers = min(heads, os.cpu_count() or 1, 8)
    if workers <= 1:
        for h in range(heads):
            out[h] = one(h)
        return out

    def run(h):
        out[h] = one(h)

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(run, range(heads)))
    return out


def _window_1d(n: int, w: int) -> np.ndarray:
    """[n, n]: query i keeps [start, start + w), start = clip(i - w//2, 0, n - w)."""
    w = min(w, n)
    start = np.clip(np.arange(n) - w // 2, 0, n - w)
    k = np.arange(n)
    return (k[None, :] >= start[:, None]) & (k[None, :] < start[:, None] + w)


def _kron3(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Product of per-axis block masks, over row-major (t, h, w) tile indices."""
    m = (a[:, None, None, :, None, None] & b[None, :, None, None, :, None]
         & c[None, None, :, None, None, :])
    n = a.shape[0] * b.shape[0] * c.shape[0]
    return m.reshape(n, n)


def _interval_gap(lo_q, hi_q, lo_k, hi_k) -> np.ndarray:
    """Smallest |q - k| between token intervals [lo, hi) (0 if they overlap), [nq, nk]."""
    return np.maximum(0, np.maximum(lo_k[None, :] - (hi_q[:, None] - 1),
                                    lo_q[:, None] - (hi_k[None, :] - 1)))


def _coarsen(fine: np.ndarray, fine_q, fine_k, q_bounds, k_bounds) -> np.ndarray:
    """Any-reduction of a mask over fine bounds to coarser bounds (a subset of them)."""
    iq = np.searchsorted(fine_q, q_bounds[:-1])
    ik = np.searchsorted(fine_k, k_bounds[:-1])
    out = np.logical_or.reduceat(fine, iq, axis=-2)
    return np.logical_or.reduceat(out, ik, axis=-1)


# --- families --------------------------------------------------------------------------------------
def dense(grid, *, heads=None, seed=0, step=0, text=0, kind="full", block=128, text_kv=None):
    """Dense attention. ``kind="full"``: every block of the joint sequence (one shared head).
    ``kind="text"``: the text-only (cross-attention) mask: video queries x ``text_kv`` text keys
    (Wan's umT5 cross-attention, 512 tokens, 769 with CLIP for I2V; on joint grids it defaults to
    ``text``), all blocks."""
    grid, heads, seed, step, text = _common("dense", grid, heads, seed, step, text)
    block = _check_int("dense", "block", block)
    Lv = grid.video_tokens
    if kind == "full":
        qb = G.uniform_bounds(Lv, block)
        return _assemble(qb, qb, np.ones((1, len(qb) - 1, len(qb) - 1), bool), text, block)
    if kind == "text":
        n = text_kv if text_kv is not None else (text or grid.cross_text)
        n = _check_int("dense", "text_kv", n)
        qb = G.uniform_bounds(Lv, block)
        kb = G.uniform_bounds(n, block)
        return BlockMask(qb, kb, np.ones((1, len(qb) - 1, len(kb) - 1), bool))
    raise ValueError(f"dense: kind must be 'full' or 'text', got {kind!r}")


def _sta_tiles(grid, tile, window) -> np.ndarray:
    gt = G.tile_grid(grid, tile)
    return _kron3(*(_window_1d(n, w) for n, w in zip(gt, window)))


def sta(grid, *, heads=None, seed=0, step=0, text=0, tile=(6, 8, 8), window=(3, 3, 3)):
    """Sliding-tile attention: tiles ``tile`` (tile-major order, partial edge tiles), key tile kept
    iff inside the query tile's ``window`` (in tiles, clamped at the edges) on every axis, so every
    row keeps prod(min(window, tiles)) tiles. ``window="mix"``: per head, a window drawn from
    ``STA_WINDOW_MIX`` (static: depends on seed and head only). Text: 384-token blocks."""
    grid, heads, seed, step, text = _common("sta", grid, heads, seed, step, text)
    tile = _check_ints("sta", "tile", tile, 3)
    lay = G.tile_layout(grid, tile)
    if isinstance(window, str):
        if window != "mix":
            raise ValueError(f"sta: window must be 3 ints or 'mix', got {window!r}")
        wins, probs = zip(*STA_WINDOW_MIX)
        cum = np.cumsum(probs)
        cache, out = {}, []
        for h in range(heads):
            u = rng_for(seed, "sta", "window", h).random()
            w = wins[min(int(np.searchsorted(cum, u * cum[-1])), len(wins) - 1)]
            if w not in cache:
                cache[w] = _sta_tiles(grid, tile, w)
            out.append(cache[w])
        blocks = _maybe_shared(np.stack(out))
    else:
        window = _check_ints("sta", "window", window, 3)
        blocks = _sta_tiles(grid, tile, window)[None]
    return _assemble(lay.bounds, lay.bounds, blocks, text, 384)


def _tile_topk(name, grid, heads, seed, step, tile, topk, lam, window):
    lay = G.tile_layout(grid, tile)
    f = block_features(grid, lay.order, lay.bounds, seed, name, step)
    n = len(lay.bounds) - 1
    base = _sta_tiles(grid, tile, window) if window is not None else None
    field = ScoreField(f, f, seed, name, step)
    out = np.empty((heads, n, n), dtype=bool)

    def one(h):
        s = field.head(head_params(grid, seed, name, h, step), h)
        if lam is not None:
            # lam * (1 + cos)/2 - (1 - lam) * redundancy, with a squashed logit as the cosine.
            sim = 0.5 * (1.0 + np.tanh(0.25 * s))
            red = sim.mean(axis=0)
            s = lam * sim - (1.0 - lam) * red[None, :]
        else:
            np.fill_diagonal(s, np.inf)   # MoBA: the own tile is always among the top k
        m = _top_k(s, topk)
        return m if base is None else m | base

    return lay, _each_head(heads, one, out)


def ssta(grid, *, heads=None, seed=0, step=0, text=0, topk=32, lam=0.7, tile=(6, 8, 8),
         window=(3, 3, 3)):
    """SSTA (HunyuanVideo-1.5): STA ``window`` over ``tile`` tiles, union per-head top-``topk`` key
    tiles by ``lam * (1 + cos)/2 - (1 - lam) * redundancy`` (``lam=1``: similarity only).
    Text: 384-token blocks."""
    grid, heads, seed, step, text = _common("ssta", grid, heads, seed, step, text)
    topk = _check_int("ssta", "topk", topk)
    lam = _check_frac("ssta", "lam", lam, 0.0, 1.0, lo_open=False, hi_open=False)
    tile = _check_ints("ssta", "tile", tile, 3)
    window = _check_ints("ssta", "window", window, 3)
    lay, out = _tile_topk("ssta", grid, heads, seed, step, tile, topk, lam, window)
    return _assemble(lay.bounds, lay.bounds, out, text, 384)


def moba(grid, *, heads=None, seed=0, step=0, text=0, topk=32, tile=(6, 8, 8)):
    """MoBA: per head, the own tile plus the top-(``topk`` - 1) other key tiles by score: exactly
    ``topk`` tiles per row (uniform rows). Text: 384-token blocks."""
    grid, heads, seed, step, text = _common("moba", grid, heads, seed, step, text)
    topk = _check_int("moba", "topk", topk)
    tile = _check_ints("moba", "tile", tile, 3)
    lay, out = _tile_topk("moba", grid, heads, seed, step, tile, topk, None, None)
    return _assemble(lay.bounds, lay.bounds, out, text, 384)


def vsa(grid, *, heads=None, seed=0, step=0, text=0, sparsity=0.9, cube=(4, 4, 4)):
    """VSA: cubes ``cube`` (tile-major, partial edge cubes of variable size); each (head, query
    cube) keeps exactly ceil((1 - sparsity) * N) key cubes by score. Text: 64-token blocks."""
    grid, heads, seed, step, text = _common("vsa", grid, heads, seed, step, text)
    sparsity = _check_frac("vsa", "sparsity", sparsity, 0.0, 1.0, lo_open=False)
    cube = _check_ints("vsa", "cube", cube, 3)
    lay = G.tile_layout(grid, cube)
    f = block_features(grid, lay.order, lay.bounds, seed, "vsa", step)
    n = len(lay.bounds) - 1
    k = math.ceil((1.0 - sparsity) * n - 1e-9)
    field = ScoreField(f, f, seed, "vsa", step)
    out = np.empty((heads, n, n), dtype=bool)
    _each_head(heads, lambda h: _top_k(field.head(head_params(grid, seed, "vsa", h, step), h), k),
               out)
    return _assemble(lay.bounds, lay.bounds, out, text, 64)


def radial(grid, *, heads=None, seed=0, step=0, text=0, decay=0.2, block=128, sink=True,
           layout="frame"):
    """Radial attention (one static mask for all heads). Frames at distance d <= 1 attend fully;
    otherwise a band |in-frame offset| <= max(2^bitlen(tpf) / 2^bitlen(d) * decay, block), and the
    frame pair is kept only every m-th distance once 2^bitlen(tpf) / 2^bitlen(d) < block
    (m = block // that); ``sink`` adds frame 0 as keys for every query. ``layout="frame"``:
    frame-aligned blocks (``block`` tokens plus a remainder per frame); ``"uniform"``: ``block``
    blocks over the row-major sequence, a block kept if any of its tokens' pairs is."""
    grid, heads, seed, step, text = _common("radial", grid, heads, seed, step, text)
    decay = _check_frac("radial", "decay", decay, 0.0, 1.0, hi_open=False)
    block = _check_int("radial", "block", block)
    if layout not in ("frame", "uniform"):
        raise ValueError(f"radial: layout must be 'frame' or 'uniform', got {layout!r}")
    tpf = grid.tokens_per_frame
    fine = G.frame_layout(grid, block).bounds
    if layout == "uniform":
        coarse = G.uniform_bounds(grid.video_tokens, block)
        fine = np.union1d(fine, coarse).astype(np.int64)
    frame = fine[:-1] // tpf
    lo = fine[:-1] - frame * tpf
    hi = fine[1:] - frame * tpf
    d = np.abs(frame[:, None] - frame[None, :])
    T = grid.t
    dist = np.arange(T)
    bl = np.array([int(x).bit_length() for x in dist])
    base_len = 2.0 ** tpf.bit_length() / 2.0 ** bl
    width = np.maximum(base_len * decay, block)
    split = np.where(base_len < block, np.maximum(1, (block // np.maximum(base_len, 1))), 1)
    split = split.astype(np.int64)
    keep_pair = (dist % split) == 0
    gap = _interval_gap(lo, hi, lo, hi)
    m = (d <= 1) | ((gap <= width[d]) & keep_pair[d])
    if sink:
        m |= (frame == 0)[None, :]
    if layout == "uniform":
        m = _coarsen(m, fine, fine, coarse, coarse)
        bounds = coarse
    else:
        bounds = fine
    return _assemble(bounds, bounds, m[None], text, block)


def _svg_width(grid, density: float, block: int) -> int:
    n = grid.video_tokens
    return int(math.ceil(n * (1.0 - math.sqrt(1.0 - density)) / block) * block)


def svg(grid, *, heads=None, seed=0, step=0, text=0, density=0.3, temporal_frac=0.5, block=128):
    """Sparse-VideoGen: per head a spatial mask (band |q - k| <= W over row-major tokens) or a
    temporal one (the same band in frame-minor order p = (h * W + w) * T + t, evaluated on the
    frame-aligned blocks), both with frame 0 as sink keys. W = N (1 - sqrt(1 - density)) rounded
    up to ``block``. A head is temporal iff its draw u < ``temporal_frac``. Text: dense."""
    grid, heads, seed, step, text = _common("svg", grid, heads, seed, step, text)
    density = _check_frac("svg", "density", density)
    temporal_frac = _check_frac("svg", "temporal_frac", temporal_frac, lo_open=False,
                                hi_open=False)
    block = _check_int("svg", "block", block)
    W = _svg_width(grid, density, block)
    lay = G.frame_layout(grid, block)
    b = lay.bounds
    tpf, T = grid.tokens_per_frame, grid.t
    frame = b[:-1] // tpf
    lo, hi = b[:-1] - frame * tpf, b[1:] - frame * tpf
    sink = (frame == 0)[None, :]
    spatial = (_interval_gap(b[:-1], b[1:], b[:-1], b[1:]) <= W) | sink
    delta = frame[None, :] - frame[:, None]                       # t' - t
    after = lo[None, :] - (hi[:, None] - 1)                       # key range after query range
    before = lo[:, None] - (hi[None, :] - 1)
    temporal = np.where(after > 0, after * T + delta,
                        np.where(before > 0, before * T - delta, np.abs(delta))) <= W
    temporal |= sink
    kinds = [rng_for(seed, "svg", "kind", h).random() < temporal_frac for h in range(heads)]
    out = np.stack([temporal if k else spatial for k in kinds])
    return _assemble(b, b, _maybe_shared(out), text, block)


def _heavy_sizes(rng, total: int, n: int, sigma: float = 1.3) -> np.ndarray:
    n = min(n, total)
    w = rng.lognormal(0.0, sigma, n)
    share = w / w.sum() * (total - n)
    sizes = 1 + np.floor(share).astype(np.int64)
    rem = total - int(sizes.sum())
    if rem:
        sizes[np.argsort(-(share - np.floor(share)), kind="stable")[:rem]] += 1
    return sizes


def _cluster_features(grid, rng, n, seed, step) -> BlockFeatures:
    pos = rng.integers(0, grid.video_tokens, n)
    coords = G.token_coords(grid, pos).astype(np.float64)
    return BlockFeatures(coords, point_features(grid, coords, seed, "svg2", step),
                         (coords[:, 0] == 0).astype(np.float64))


_SVG2_SHARPNESS = 2.0   # clusters are semantically coherent: sharper centroid logits


def svg2(grid, *, heads=None, seed=0, step=0, text=0, q_clusters=300, kv_clusters=1000,
         top_p=0.9, min_frac=0.1):
    """Sparse-VideoGen2: tokens permuted so that clusters are contiguous (queries by query
    cluster, keys by key cluster); blocks are the clusters, with heavy-tailed (log-normal) sizes
    shared by all heads. Per head, key clusters are kept by size-weighted softmax until mass
    ``top_p``, at least ``min_frac`` of them. Text: one dense cluster."""
    grid, heads, seed, step, text = _common("svg2", grid, heads, seed, step, text)
    q_clusters = _check_int("svg2", "q_clusters", q_clusters)
    kv_clusters = _check_int("svg2", "kv_clusters", kv_clusters)
    top_p = _check_frac("svg2", "top_p", top_p, hi_open=False)
    min_frac = _check_frac("svg2", "min_frac", min_frac, lo_open=False, hi_open=False)
    rng = rng_for(seed, "svg2", "clusters")
    Lv = grid.video_tokens
    qs, ks = _heavy_sizes(rng, Lv, q_clusters), _heavy_sizes(rng, Lv, kv_clusters)
    qb, kb = G.cluster_layout(grid, qs), G.cluster_layout(grid, ks)
    fq = _cluster_features(grid, rng, len(qs), seed, step)
    fk = _cluster_features(grid, rng, len(ks), seed, step)
    logsize = np.log(ks).astype(np.float32)[None, :]
    kmin = math.ceil(min_frac * len(ks))
    field = ScoreField(fq, fk, seed, "svg2", step)
    out = np.empty((heads, len(qs), len(ks)), dtype=bool)

    def one(h):
        s = field.head(head_params(grid, seed, "svg2", h, step), h)
        s *= np.float32(_SVG2_SHARPNESS)
        s += logsize
        return _top_p(s, top_p, kmin)

    _each_head(heads, one, out)
    return _assemble(qb, kb, out, text, None)


def sparge(grid, *, heads=None, seed=0, step=0, text=0, tau=0.9, nonsim_frac=0.03,
           block_q=128, block_kv=64):
    """SpargeAttn-like: ``block_q`` x ``block_kv`` blocks over row-major tokens; per head, each row
    keeps blocks until the softmax CDF reaches ``tau``; a ``nonsim_frac`` share of query blocks
    (not self-similar) keeps its full row and of key blocks its full column (dense stripes)."""
    grid, heads, seed, step, text = _common("sparge", grid, heads, seed, step, text)
    tau = _check_frac("sparge", "tau", tau, hi_open=False)
    nonsim_frac = _check_frac("sparge", "nonsim_frac", nonsim_frac, lo_open=False)
    block_q = _check_int("sparge", "block_q", block_q)
    block_kv = _check_int("sparge", "block_kv", block_kv)
    lq, lk = G.uniform_layout(grid, block_q), G.uniform_layout(grid, block_kv)
    fq = block_features(grid, lq.order, lq.bounds, seed, "sparge", step)
    fk = block_features(grid, lk.order, lk.bounds, seed, "sparge", step)
    nq, nk = len(lq.bounds) - 1, len(lk.bounds) - 1
    field = ScoreField(fq, fk, seed, "sparge", step)
    out = np.empty((heads, nq, nk), dtype=bool)

    def one(h):
        m = _top_p(field.head(head_params(grid, seed, "sparge", h, step), h), tau)
        r = rng_for(seed, "sparge", "nonsim", h)
        m[r.random(nq) < nonsim_frac, :] = True
        m[:, r.random(nk) < nonsim_frac] = True
        return m

    _each_head(heads, one, out)
    return _assemble(lq.bounds, lk.bounds, out, text, block_q, block_kv)


def xattn(grid, *, heads=None, seed=0, step=0, text=0, tau=0.9, stride=8, block=128):
    """XAttention-like: ``block`` blocks over row-major tokens scored by a strided antidiagonal
    estimate (the synthetic logits plus estimation noise growing with ``stride``); per head, each
    row keeps the fewest blocks reaching mass ``tau``, plus its diagonal block and the first key
    block (sink). Text: dense."""
    grid, heads, seed, step, text = _common("xattn", grid, heads, seed, step, text)
    tau = _check_frac("xattn", "tau", tau, hi_open=False)
    stride = _check_int("xattn", "stride", stride)
    block = _check_int("xattn", "block", block)
    lay = G.uniform_layout(grid, block)
    f = block_features(grid, lay.order, lay.bounds, seed, "xattn", step)
    n = len(lay.bounds) - 1
    field = ScoreField(f, f, seed, "xattn", step)
    out = np.empty((heads, n, n), dtype=bool)
    est = 0.25 * math.sqrt(stride / 8.0)

    def one(h):
        m = _top_p(field.head(head_params(grid, seed, "xattn", h, step), h, extra_sigma=est), tau)
        np.fill_diagonal(m, True)
        m[:, 0] = True
        return m

    _each_head(heads, one, out)
    return _assemble(lay.bounds, lay.bounds, out, text, block)


def jenga(grid, *, heads=None, seed=0, step=0, text=0, drop=0.7, p=0.3, block=128):
    """Jenga-like: tokens along a 3D Hilbert curve in ``block`` blocks; per head each row keeps
    max(ceil((1 - drop) N), the blocks reaching softmax mass ``p``) top blocks, plus the blocks
    3D-adjacent to it (bounding boxes within one token on every axis). Text: dense."""
    grid, heads, seed, step, text = _common("jenga", grid, heads, seed, step, text)
    drop = _check_frac("jenga", "drop", drop, lo_open=False)
    p = _check_frac("jenga", "p", p, hi_open=False)
    block = _check_int("jenga", "block", block)
    lay = G.hilbert_layout(grid, block)
    f = block_features(grid, lay.order, lay.bounds, seed, "jenga", step)
    coords = G.token_coords(grid, lay.order)
    bmin = np.minimum.reduceat(coords, lay.bounds[:-1], axis=0)
    bmax = np.maximum.reduceat(coords, lay.bounds[:-1], axis=0)
    adj = np.ones((len(bmin), len(bmin)), dtype=bool)
    for a in range(3):
        adj &= (bmin[:, None, a] <= bmax[None, :, a] + 1) & (bmin[None, :, a] <= bmax[:, None, a] + 1)
    n = len(lay.bounds) - 1
    kmin = math.ceil((1.0 - drop) * n - 1e-9)
    field = ScoreField(f, f, seed, "jenga", step)
    out = np.empty((heads, n, n), dtype=bool)
    _each_head(heads, lambda h: _top_p(field.head(head_params(grid, seed, "jenga", h, step), h),
                                       p, kmin) | adj, out)
    return _assemble(lay.bounds, lay.bounds, out, text, block)


def _natten_cover_1d(n: int, k: int, tile: int) -> np.ndarray:
    """Tiles of one axis: query tile keeps key tile iff some query's window [s, s + k) meets it."""
    k = min(k, n)
    s = np.clip(np.arange(n) - k // 2, 0, n - k)
    b = G.uniform_bounds(n, tile)
    lo, hi = s[b[:-1]], s[b[1:] - 1] + k          # union of the windows of the tile's queries
    return (b[None, :-1] < hi[:, None]) & (b[None, 1:] > lo[:, None])


def natten(grid, *, heads=None, seed=0, step=0, text=0, window=(7, 9, 9), stride="tile",
           tile=(2, 8, 8)):
    """NATTEN/GNA 3D neighbourhood attention, tiles ``tile`` in tile-major order (one shared head).
    ``stride="tile"``: queries of a tile share one window, ceil(window / tile) tiles clamped at the
    edges (fully block-sparse); ``stride=1``: the token-level window clamp(i - k//2, 0, n - k),
    whose block mask is its cover (a tile pair is kept iff some query of the tile sees some key of
    it: partial tiles). Text: dense (128-token blocks)."""
    grid, heads, seed, step, text = _common("natten", grid, heads, seed, step, text)
    window = _check_ints("natten", "window", window, 3)
    tile = _check_ints("natten", "tile", tile, 3)
    lay = G.tile_layout(grid, tile)
    if stride == "tile":
        gt = G.tile_grid(grid, tile)
        m = _kron3(*(_window_1d(g, -(-k // t)) for g, k, t in zip(gt, window, tile)))
    elif stride == 1:
        m = _kron3(*(_natten_cover_1d(n, k, t) for n, k, t in zip(grid.shape, window, tile)))
    else:
        raise ValueError(f"natten: stride must be 1 or 'tile', got {stride!r}")
    return _assemble(lay.bounds, lay.bounds, m[None], text, 128)


def ditfastattn(grid, *, heads=None, seed=0, step=0, text=0, window_frac=0.125, block=128):
    """DiTFastAttn window attention (one shared head): a 1D band |q - k| <= window / 2 over the
    row-major video tokens, window = ``window_frac`` * N; ``block`` blocks keep the band's cover.
    Text: dense."""
    grid, heads, seed, step, text = _common("ditfastattn", grid, heads, seed, step, text)
    window_frac = _check_frac("ditfastattn", "window_frac", window_frac, hi_open=False)
    block = _check_int("ditfastattn", "block", block)
    b = G.uniform_bounds(grid.video_tokens, block)
    half = int(window_frac * grid.video_tokens) // 2
    m = _interval_gap(b[:-1], b[1:], b[:-1], b[1:]) <= half
    return _assemble(b, b, m[None], text, block)


#: Rows of random draws per chunk in ``tokens`` (fixed: the mask must not depend on the machine;
#: bounds the float32 scratch to ~64 MiB at 8,190 blocks a row).
_TOKEN_CHUNK_CELLS = 1 << 24


def _band_cells(n: int, r: int) -> int:
    """Cells of an n x n matrix with |i - j| <= r."""
    r = min(r, n - 1)
    return n + 2 * r * n - r * (r + 1)


def _set_band(out: np.ndarray, r: int) -> np.ndarray:
    """Sets |i - j| <= r in a square ``out``, one diagonal at a time (no [n, n] int scratch)."""
    n = out.shape[0]
    i = np.arange(n)
    for d in range(-min(r, n - 1), min(r, n - 1) + 1):
        lo, hi = max(0, -d), min(n, n - d)
        out[i[lo:hi], i[lo:hi] + d] = True
    return out


def _token_random(n: int, density: float, local: float, rng) -> np.ndarray:
    """[n, n]: a diagonal band holding ~``local`` of ``density``, the rest uniform noise, so the
    expected block density is ``density`` (at least the diagonal)."""
    r = 0
    while r + 1 < n and _band_cells(n, r + 1) <= local * density * n * n:
        r += 1
    band_frac = _band_cells(n, r) / (n * n)
    p = max(0.0, (density - band_frac) / (1.0 - band_frac)) if band_frac < 1.0 else 0.0
    out = np.empty((n, n), dtype=bool)
    rows = max(1, _TOKEN_CHUNK_CELLS // n)
    for i in range(0, n, rows):
        out[i:i + rows] = rng.random((min(rows, n - i), n), dtype=np.float32) < np.float32(p)
    return _set_band(out, r)


def tokens(grid, *, heads=None, seed=0, step=0, text=0, kind="random", block=8, density=0.2,
           local=0.5, width=24):
    """Token-level masks (one shared head) over row-major tokens in uniform ``block``-token
    blocks (1-16 tokens: many blocks per GPU tile). ``kind="random"``: block density ~``density``,
    a ``local`` share of it a band around the diagonal, the rest uniform noise (seeded), the
    diagonal always kept; ``kind="band"``: the cover of the token band |q - k| <= ``width`` (exact
    for ``block=1``). Text: dense, 128-token blocks."""
    grid, heads, seed, step, text = _common("tokens", grid, heads, seed, step, text)
    block = _check_int("tokens", "block", block)
    b = G.uniform_bounds(grid.video_tokens, block)
    n = len(b) - 1
    if kind == "random":
        density = _check_frac("tokens", "density", density, hi_open=False)
        local = _check_frac("tokens", "local", local, lo_open=False, hi_open=False)
        rng = rng_for(seed, "tokens", "random", block, round(density * 1e6), round(local * 1e6))
        m = _token_random(n, density, local, rng)
    elif kind == "band":
        width = _check_int("tokens", "width", width, lo=0)
        # Uniform blocks i < j are (j - i - 1) * block + 1 tokens apart at their closest.
        m = _set_band(np.zeros((n, n), dtype=bool), 0 if width == 0 else (width - 1) // block + 1)
    else:
        raise ValueError(f"tokens: kind must be 'random' or 'band', got {kind!r}")
    return _assemble(b, b, m[None], text, 128)


FAMILIES: dict[str, Callable[..., BlockMask]] = {
    "dense": dense, "sta": sta, "ssta": ssta, "moba": moba, "vsa": vsa, "radial": radial,
    "svg": svg, "svg2": svg2, "sparge": sparge, "xattn": xattn, "jenga": jenga, "natten": natten,
    "ditfastattn": ditfastattn, "tokens": tokens,
}
