"""Content-dependent block masks built on the device, inside ``jax.jit`` (issue 17, item 1).

Four builders, each a pure-jnp function of the layer's ``q`` and ``k`` ([B, L, H, D]; GQA:
``Hq % Hkv == 0``, each key head repeated over its query group when scores are pooled), with
static shapes and no host round trip: each returns what ``tessera_jax.sparse_attention`` needs,
traced values that a compiled denoising loop can build per step and layer without retracing.

* ``vsa_mask``: VSA-like. Mean-pool q and k over static blocks (4x4x4 cubes in cube-major
  order: ``cube_layout``), per-head top-k key blocks of the pooled scores per query block.
* ``sparge_mask``: SpargeAttn-like. Mean-pool over 128-query x 64-key blocks, softmax of the
  pooled scores, keep key blocks while the cumulative probability stays <= ``cdf_threshold``;
  blocks that are not self-similar keep their whole row / column.
* ``xattn_mask``: XAttention-like. Strided antidiagonal scores (stride 8) summed per
  128-token block, keep the fewest blocks reaching ``tau`` of the row's mass.
* ``svg2_init`` / ``svg2_mask`` / ``svg2_attention``: SVG2-like. Per-head k-means of q and of k
  (fixed iteration count, warm-started from carried centroids), tokens permuted so that
  clusters are contiguous (per head), per-head bounds from the cluster sizes, cluster pairs
  kept by size-weighted softmax mass up to ``top_p``; ``permute`` / ``unpermute`` move
  tensors in and out of the cluster order.

Each builder is also a *rule* (``VSA``, ``Sparge``, ``XAttention``, ``SVG2``: frozen
dataclasses of its knobs), the form a ``tessera_jax.flax.DynamicSchedule`` takes: a rule builds
the mask, runs the attention it is given and returns the state to carry to the next step
(SVG2's centroids), so a compiled denoising loop calls it at every step and layer.

Batch: ``BlockMask`` has no batch axis, so the B elements of a call share one mask; every
rule is applied to the batch mean of its score (SpargeAttn's self-similarity: the batch
minimum; SVG2: k-means on the tokens' features concatenated over the batch). Call a builder
per element for per-element masks.

Static arguments (block layouts, counts, thresholds) are checked when tracing and raise
``ValueError``/``TypeError`` naming the argument; the data cannot be checked inside ``jit``,
but no data (NaN included) makes a builder read out of bounds or emit invalid bounds: every
gather is clamped and every index is built in range.

The ``_numpy_*`` functions at the end are NumPy references of the same rules for the tests
(float64, loops; slow): they are not part of the API. ``docs/dynamic_masks.md`` has the knobs,
the per-call cost at Wan 720p and the use in a compiled loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask, _as_bounds
from tessera_jax.runtime.api import sparse_attention

__all__ = ["cube_layout", "vsa_mask", "sparge_mask", "xattn_mask", "SVG2State", "SVG2Layout",
           "kmeans", "svg2_init", "svg2_mask", "svg2_attention", "permute", "unpermute",
           "VSA", "Sparge", "XAttention", "SVG2", "SVG2Carry"]

_HI = jax.lax.Precision.HIGHEST

#: Matmul precision of the VSA and SpargeAttn pooled block scores: "high" (the default:
#: three bf16 passes, ~2^-16 relative, so rows change only at near-ties; VSA itself scores in
#: bf16) or "highest" (float32). H200, Wan 720p VSA scores: 0.35 vs 0.92 ms; the VSA builder
#: with the pooling kernel 2.19 ms (4.7% of its attention) against 2.67 (session 14).
SCORE_PRECISION = "high"


def _score_precision():
    if SCORE_PRECISION not in SWITCHES["SCORE_PRECISION"]:
        raise ValueError(f"SCORE_PRECISION must be one of {SWITCHES['SCORE_PRECISION']}, got "
                         f"{SCORE_PRECISION!r}")
    return getattr(jax.lax.Precision, SCORE_PRECISION.upper())


# Elements of float32 scores one XAttention chunk may hold (256 MiB).
_XATTN_CHUNK_ELEMS = 1 << 26


# --- argument checks ---------------------------------------------------------------------
def _check_int(fn: str, name: str, v, lo: int = 1, hi: int | None = None) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{fn}: {name} must be {rng}, got {v}")
    return int(v)


def _check_frac(fn: str, name: str, v, *, lo_open=True, hi_open=False) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: {name} must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or (v <= 0 if lo_open else v < 0) or (v >= 1 if hi_open else v > 1):
        raise ValueError(f"{fn}: {name} must be in {'(' if lo_open else '['}0, 1"
                         f"{')' if hi_open else ']'}, got {v}")
    return v


def _check_bool(fn: str, name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(v).__name__}")
    return bool(v)


def _check_scale(fn: str, scale, D: int) -> float:
    if scale is None:
        return float(D) ** -0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(
            scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: scale must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(float(scale)) and scale > 0):
        raise ValueError(f"{fn}: scale must be a positive finite number, got {scale}")
    return float(scale)


def _check_array(fn: str, name: str, x, ndim: int, what: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array {what}, got {type(x).__name__}")
    if len(x.shape) != ndim:
        raise ValueError(f"{fn}: {name} must be {what}, got shape {tuple(x.shape)}")
    if any(int(s) == 0 for s in x.shape):
        raise ValueError(f"{fn}: {name} has an empty axis: shape {tuple(x.shape)}")


def _check_qk(fn: str, q, k) -> tuple[int, int, int, int, int, int]:
    """(B, Lq, Lkv, Hq, Hkv, D) of q [B, Lq, Hq, D] and k [B, Lkv, Hkv, D]."""
    _check_array(fn, "q", q, 4, "[B, Lq, Hq, D]")
    _check_array(fn, "k", k, 4, "[B, Lkv, Hkv, D]")
    for name, x in (("q", q), ("k", k)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{fn}: {name} must have a floating dtype, got {x.dtype}")
    B, Lq, Hq, D = (int(s) for s in q.shape)
    Bk, Lkv, Hkv, Dk = (int(s) for s in k.shape)
    if Bk != B:
        raise ValueError(f"{fn}: k has batch {Bk} but q has batch {B}")
    if Dk != D:
        raise ValueError(f"{fn}: k has head dim {Dk} but q has head dim {D}")
    if Hq % Hkv:
        raise ValueError(f"{fn}: q's heads Hq={Hq} must be a multiple of k's heads Hkv={Hkv} "
                         f"(GQA)")
    return B, Lq, Lkv, Hq, Hkv, D


def _static_bounds(fn: str, name: str, bounds, length: int) -> np.ndarray:
    """Static block bounds [n + 1] from 0 to ``length`` (NumPy or a sequence of ints)."""
    if isinstance(bounds, jax.Array):
        raise TypeError(f"{fn}: {name} must be static (NumPy or a sequence of ints), got a jax "
                        f"array: the block layout of these builders is fixed at trace time")
    return _as_bounds(f"{fn}: {name}", bounds, length)


def _bounds_or_uniform(fn: str, name: str, bounds, block, block_name: str,
                       length: int) -> np.ndarray:
    if bounds is not None:
        return _static_bounds(fn, name, bounds, length)
    block = _check_int(fn, block_name, block)
    return np.append(np.arange(0, length, block, dtype=np.int64), np.int64(length))


# --- shared pieces -----------------------------------------------------------------------
def cube_layout(shape, cube=(4, 4, 4)) -> tuple[np.ndarray, np.ndarray]:
    """VSA's cube-major token order of a (T, H, W) latent grid: ``(order, bounds)``.

    ``order[p]`` is the row-major index ``(t * H + h) * W + w`` of the token at position ``p``
    (cubes in row-major cube order, row-major inside a cube); ``bounds`` are the cubes' bounds
    over that order. Edge cubes are partial (their real token counts, no padding). Permute
    with ``x[:, order]`` and give ``bounds`` to ``vsa_mask``; ``np.argsort(order)`` undoes it.
    """
    try:
        T, H, W = (int(s) for s in shape)
        ct, ch, cw = (int(c) for c in cube)
    except (TypeError, ValueError):
        raise TypeError(f"cube_layout: shape and cube must each be 3 ints, got {shape!r}, "
                        f"{cube!r}") from None
    if min(T, H, W) < 1 or min(ct, ch, cw) < 1:
        raise ValueError(f"cube_layout: shape and cube must hold positive ints, got {shape!r}, "
                         f"{cube!r}")
    t, h, w = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    key = (((t // ct) * (-(-H // ch)) + h // ch) * (-(-W // cw)) + w // cw).ravel()
    order = np.argsort(key, kind="stable").astype(np.int64)
    return order, np.concatenate([[0], np.cumsum(np.bincount(key))]).astype(np.int64)


def _pool_sum(x, bounds: np.ndarray):
    """Float32 sum of ``x`` [B, L, H, F] over each static block: [B, n, H, F]."""
    sizes = np.diff(bounds)
    # The kernel for 2-byte inputs (q, k), read once in their dtype; float32 arrays the
    # builder derives (SpargeAttn's unit vectors) stay with XLA, which fuses their making
    # into the sums (through the kernel they are written out first: 3.96 -> 4.51 ms).
    if _use_kernel("POOL", POOL) and jnp.dtype(x.dtype).itemsize <= 2:
        from pallas_kernels.triton import pool as tp
        if sizes.max() <= tp.MAX_BLOCK:
            # Mask scores only (piecewise constant): the kernel has no autodiff rule.
            return tp.block_sums(jax.lax.stop_gradient(x), bounds,
                                 interpret=jax.default_backend() != "gpu")
    x = x.astype(jnp.float32)
    n, L = len(sizes), int(bounds[-1])
    b = int(sizes[0])
    if n == 1 or (np.all(sizes[:-1] == b) and sizes[-1] <= b):
        xp = jnp.pad(x, ((0, 0), (0, n * b - L), (0, 0), (0, 0)))
        return xp.reshape(x.shape[0], n, b, *x.shape[2:]).sum(axis=2)
    bmax = int(sizes.max())
    if n * bmax <= 2 * L:
        # Unequal blocks (cube layouts' partial edge cubes): gather each block's tokens into a
        # row of bmax, zeros past its end, and sum the rows. A scatter-add (segment_sum) costs
        # one atomic per element on a GPU: ~4 ms per tensor at Wan 480p against ~0.05 here.
        j = np.arange(bmax)
        idx = np.where(j[None] < sizes[:, None], bounds[:-1, None] + j[None], L).astype(np.int32)
        xp = jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0)))
        g = jnp.take(xp, jnp.asarray(idx.reshape(-1)), axis=1, mode="clip")
        return g.reshape(x.shape[0], n, bmax, *x.shape[2:]).sum(axis=2)
    ids = np.repeat(np.arange(n, dtype=np.int32), sizes)
    s = jax.ops.segment_sum(jnp.moveaxis(x, 1, 0), ids, num_segments=n, indices_are_sorted=True)
    return jnp.moveaxis(s, 0, 1)


def _pool_mean(x, bounds: np.ndarray):
    sizes = jnp.asarray(np.diff(bounds), jnp.float32)
    return _pool_sum(x, bounds) / sizes[None, :, None, None]


def _repeat_heads(x, group: int, axis: int):
    return x if group == 1 else jnp.repeat(x, group, axis=axis)


def _scatter_rows(order, keep_sorted):
    """bool [..., n]: ``out[..., order[..., r]] = keep_sorted[..., r]`` (``order`` a
    permutation of each row)."""
    flat_o = order.reshape(-1, order.shape[-1])
    flat_k = keep_sorted.reshape(-1, order.shape[-1])
    rows = jnp.arange(flat_o.shape[0])[:, None]
    out = jnp.zeros(flat_o.shape, bool).at[rows, flat_o].set(flat_k, mode="drop")
    return out.reshape(order.shape)


# Each row's top k (``vsa_mask``, ``sparge_mask(topk=...)``) is taken by one fused Triton
# kernel on a GPU (``TOP_K``), else by sorting (``lax.top_k``; SpargeAttn's ``argsort``).
# Measured on the H200, builder wall time per call at Wan 720p ([40, 1440, 1440] scores;
# session 13): VSA 7.61 ms with lax.top_k, 3.63 ms with the kernel; SpargeAttn top-k 5.96 vs
# 3.90 ms. A radix select written as XLA ops was slower than the sort and was removed (session
# 12: VSA 8.73 vs 7.71 ms; Wan 480p 1.42 vs 0.79 ms, launch-bound).

#: How each row's top k is taken: "pallas" (``pallas_kernels.triton.topk.topk_mask``: one
#: Triton kernel, a radix select on the float bits in registers, one row a program; the
#: interpreter off a GPU, slow), "xla" (``lax.top_k`` then a scatter; SpargeAttn's argsort for
#: ``sparge_mask``) or "auto" (the default): "pallas" on a GPU, "xla" elsewhere. Same kept set
#: exactly (ties to the lower index, -0.0 below +0.0 as ``lax.top_k``; scores have no NaN).
#: Rows longer than the kernel's ``MAX_COLS`` (4096) always take the "xla" path.
TOP_K = "auto"

#: How blocks of 2-byte q and k are pooled (``vsa_mask``, ``sparge_mask``): "pallas"
#: (``pallas_kernels.triton.pool.block_sums``: one Triton kernel reading x once in its own
#: dtype, blocks of at most 256 tokens), "xla" (a padded float32 copy of x gathered into equal
#: rows and summed) or "auto" (the default: "pallas" on a GPU). H200, q and k at Wan 720p
#: (session 14): 0.63 ms against 1.67; the VSA builder 3.56 -> 2.67 ms.
POOL = "auto"

#: The module's switches and the values each takes (``tools.bench_loop --builder-switch``).
SWITCHES = {"TOP_K": ("auto", "xla", "pallas"), "POOL": ("auto", "xla", "pallas"),
            "KMEANS_ASSIGN": ("auto", "xla", "pallas"), "SCORE_PRECISION": ("highest", "high")}


def _use_kernel(name: str, value: str) -> bool:
    """Whether kernel switch ``name`` set to ``value`` picks its Triton kernel here ("pallas";
    "auto" on a GPU). Off a GPU the kernel runs in the interpreter."""
    if value not in SWITCHES[name]:
        raise ValueError(f"{name} must be one of {SWITCHES[name]}, got {value!r}")
    return value == "pallas" or (value == "auto" and jax.default_backend() == "gpu")


def _fused_topk(n: int):
    """``topk_mask(x, k)`` of the Triton kernel if ``TOP_K`` picks it for rows of n, else
    None."""
    if not _use_kernel("TOP_K", TOP_K):
        return None
    from pallas_kernels.triton import topk as tt
    if n > tt.MAX_COLS:
        return None
    # The mask is piecewise constant and the kernel has no autodiff rule: its input leaves the
    # trace of gradients (as lax.top_k's indices carry none).
    return lambda x, k: tt.topk_mask(jax.lax.stop_gradient(x.astype(jnp.float32)), k,
                                     interpret=jax.default_backend() != "gpu")


def _sorted_desc(p):
    """(order, sorted values) of each row, largest first, ties by the lower index."""
    order = jnp.argsort(-p, axis=-1, stable=True)
    return order, jnp.take_along_axis(p, order, axis=-1, mode="clip")


# --- VSA ---------------------------------------------------------------------------------
def _vsa_topk(fn, n_kv, keep, topk) -> int:
    if topk is not None and keep is not None:
        raise ValueError(f"{fn}: give keep or topk, not both (topk={topk}, keep={keep})")
    if topk is not None:
        return _check_int(fn, "topk", topk, 1, n_kv)
    keep = _check_frac(fn, "keep", 0.125 if keep is None else keep)
    return max(1, min(n_kv, math.ceil(keep * n_kv - 1e-9)))


def vsa_mask(q, k, *, q_bounds=None, kv_bounds=None, block: int = 64, keep: float | None = None,
             topk: int | None = None, local: int | None = None, scale=None) -> BlockMask:
    """VSA-like mask: per-head top-k of block-pooled scores (VSA's coarse stage).

    VSA (Zhang et al., "VSA: Faster Video Diffusion with Trainable Sparse Attention",
    arXiv:2505.13389; FastVideo's ``video_sparse_attn``): tokens in cube-major order, 4x4x4
    cubes of 64 tokens (edge cubes partial; ``cube_layout``); q and k mean-pooled per cube;
    scores ``scale * q_i . k_j`` (the softmax of the coarse stage does not change a row's
    ranking); each query cube keeps its top-k key cubes, the same k for every row and head.
    FastVideo sets k = ceil((1 - VSA_sparsity) * cubes); the default ``keep=0.125`` (87.5%
    sparsity) is issue 17's Wan2.1 setting.

    Args:
      q, k: [B, Lq, Hq, D], [B, Lkv, Hkv, D] (GQA: k's head ``h // (Hq // Hkv)`` scores query
        head ``h``). Batch elements share the mask: scores are averaged over B.
      q_bounds, kv_bounds: static block bounds (NumPy ints, [n + 1] from 0 to the length; e.g.
        ``cube_layout(...)[1]``). ``None``: ``block``-token blocks (the last one partial);
        ``kv_bounds=None`` with ``Lq == Lkv`` reuses ``q_bounds``.
      block: the block size when bounds are not given (64: one 4x4x4 cube).
      keep: fraction of key blocks kept per row, k = ceil(keep * nkv) (default 0.125); or
      topk: k itself (not both).
      local: if given (>= 0), key blocks with ``|i - j| <= local`` are always kept and count
        towards k (the rest of the row is the top of the other blocks): rows stay uniform.
        Needs nq == nkv and 2 * local + 1 <= k. Not in VSA (default None).
      scale: score scale, default ``D ** -0.5``.

    Returns:
      ``BlockMask`` with the static bounds and traced blocks bool [Hq, nq, nkv].
    """
    fn = "vsa_mask"
    B, Lq, Lkv, Hq, Hkv, D = _check_qk(fn, q, k)
    qb = _bounds_or_uniform(fn, "q_bounds", q_bounds, block, "block", Lq)
    if kv_bounds is None and q_bounds is not None and Lq == Lkv:
        kb = qb
    else:
        kb = _bounds_or_uniform(fn, "kv_bounds", kv_bounds, block, "block", Lkv)
    nq, nk = len(qb) - 1, len(kb) - 1
    kk = _vsa_topk(fn, nk, keep, topk)
    scale = _check_scale(fn, scale, D)
    forced = None
    if local is not None:
        local = _check_int(fn, "local", local, 0)
        if nq != nk:
            raise ValueError(f"{fn}: local needs as many query as key blocks, got {nq} and {nk}")
        if 2 * local + 1 > kk:
            raise ValueError(f"{fn}: local={local} keeps up to {2 * local + 1} blocks a row, "
                             f"more than k={kk}")
        i = np.arange(nq)
        forced = np.abs(i[:, None] - i[None, :]) <= local
    if kk == nk:
        return BlockMask(qb, kb, jnp.ones((Hq, nq, nk), bool))
    pq = _pool_mean(q, qb)
    pk = _repeat_heads(_pool_mean(k, kb), Hq // Hkv, axis=2)
    s = jnp.einsum("bihd,bjhd->hij", pq, pk, precision=_score_precision()) * (scale / B)
    if forced is not None:
        s = jnp.where(jnp.asarray(forced)[None], jnp.inf, s)
    fused = _fused_topk(nk)
    if fused is not None:
        return BlockMask(qb, kb, fused(s, kk))
    _, idx = jax.lax.top_k(s, kk)
    blocks = jnp.zeros((Hq, nq, nk), bool).at[
        jnp.arange(Hq)[:, None, None], jnp.arange(nq)[None, :, None], idx].set(
            True, mode="drop")
    return BlockMask(qb, kb, blocks)


# --- SpargeAttn ----------------------------------------------------------------------------
def _self_similarity(x, bounds: np.ndarray):
    """Mean pairwise cosine similarity of the tokens of each block (self-pairs included), per
    batch element and head: ||sum of unit vectors||^2 / n^2, [B, n, H]. Zero vectors count
    as 0."""
    x = x.astype(jnp.float32)
    nrm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    u = jnp.where(nrm > 0, x / jnp.where(nrm > 0, nrm, 1.0), 0.0)
    s = _pool_sum(u, bounds)
    n = jnp.asarray(np.diff(bounds), jnp.float32)
    return jnp.sum(s * s, axis=-1) / (n * n)[None, :, None]


def sparge_mask(q, k, *, q_bounds=None, kv_bounds=None, block_q: int = 128, block_kv: int = 64,
                cdf_threshold: float = 0.98, topk: float | None = None,
                sim_threshold: float = 0.6, min_keep: int = 1, smooth_k: bool = True,
                sink: bool = False, scale=None) -> BlockMask:
    """SpargeAttn-like mask: block-pooled scores, per-row cumulative-probability threshold,
    self-similarity judgment.

    SpargeAttn (Zhang et al., "SpargeAttn: Accurate Sparse Attention Accelerating Any Model
    Inference", ICML 2025, arXiv:2502.18137; thu-ml/SpargeAttn ``get_block_map_meansim``):

    1. blocks of ``block_q`` = 128 queries and ``block_kv`` = 64 keys, mean-pooled;
    2. a block is *self-similar* when the mean pairwise cosine similarity of its tokens
       exceeds ``sim_threshold`` (SpargeAttn's ``simthreshd1``, 0.6 in
       ``spas_sage2_attn_meansim_cuda``); keys are centred first (``smooth_k``: k minus its
       mean over the sequence, SpargeAttn's default);
    3. ``p = softmax_j(scale * q_i . k_j)`` over the self-similar key blocks; sorted
       descending, keep the blocks whose inclusive cumulative probability is
       <= ``cdf_threshold`` (``cdfthreshd``, 0.98), at least ``min_keep`` (SpargeAttn: 1);
       or, with ``topk`` (a fraction), the first ``max(1, int(topk * nkv))``;
    4. a key block that is not self-similar keeps its whole column, a query block its whole
       row; ``sink`` keeps key block 0 (``attention_sink``, off by default).

    SpargeAttn tunes ``cdf_threshold`` and ``sim_threshold`` per head; pass scalars here.
    Batch: logits averaged over B, a block self-similar only if it is in every element.

    Returns:
      ``BlockMask`` with static bounds and traced blocks bool [Hq, nq, nkv].
    """
    fn = "sparge_mask"
    B, Lq, Lkv, Hq, Hkv, D = _check_qk(fn, q, k)
    qb = _bounds_or_uniform(fn, "q_bounds", q_bounds, block_q, "block_q", Lq)
    kb = _bounds_or_uniform(fn, "kv_bounds", kv_bounds, block_kv, "block_kv", Lkv)
    nk = len(kb) - 1
    if topk is not None:
        topk = _check_frac(fn, "topk", topk)
    else:
        cdf_threshold = _check_frac(fn, "cdf_threshold", cdf_threshold)
    if isinstance(sim_threshold, (bool, np.bool_)) or not isinstance(
            sim_threshold, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: sim_threshold must be a number, got "
                        f"{type(sim_threshold).__name__}")
    if not -1.0 <= float(sim_threshold) <= 1.0:
        raise ValueError(f"{fn}: sim_threshold must be in [-1, 1] (a cosine), got "
                         f"{sim_threshold}")
    min_keep = _check_int(fn, "min_keep", min_keep, 1, nk)
    smooth_k = _check_bool(fn, "smooth_k", smooth_k)
    sink = _check_bool(fn, "sink", sink)
    scale = _check_scale(fn, scale, D)
    g = Hq // Hkv

    pq = _pool_mean(q, qb)                                             # [B, nq, Hq, D]
    ksum = _pool_sum(k, kb)                                            # [B, nk, Hkv, D]
    pk = ksum / jnp.asarray(np.diff(kb), jnp.float32)[None, :, None, None]
    kc = k.astype(jnp.float32)
    if smooth_k:
        kc = kc - (ksum.sum(axis=1, keepdims=True) / Lkv)
    sim_q = jnp.min(_self_similarity(q, qb), axis=0) > sim_threshold   # [nq, Hq]
    sim_k = jnp.min(_self_similarity(kc, kb), axis=0) > sim_threshold  # [nk, Hkv]
    sim_k = _repeat_heads(sim_k, g, axis=1).T                          # [Hq, nk]
    sim_q = sim_q.T                                                    # [Hq, nq]

    s = jnp.einsum("bihd,bjhd->hij", pq, _repeat_heads(pk, g, axis=2),
                   precision=_score_precision())
    s = jnp.where(sim_k[:, None, :], s * (scale / B), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(sim_k[:, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    tot = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(tot > 0, tot, 1.0)
    kk = None if topk is None else max(1, int(topk * nk))
    fused = None if kk is None or kk == nk else _fused_topk(nk)
    if fused is not None:
        blocks = fused(p, kk)             # the first kk of the stable descending sort
    else:
        order, ps = _sorted_desc(p)
        r = jnp.arange(nk)
        if topk is None:
            keep_sorted = (jnp.cumsum(ps, axis=-1) <= cdf_threshold) | (r < min_keep)
        else:
            keep_sorted = jnp.broadcast_to(r < kk, ps.shape)
        blocks = _scatter_rows(order, keep_sorted)
    blocks = blocks | ~sim_k[:, None, :] | ~sim_q[:, :, None]
    if sink:
        blocks = blocks.at[:, :, 0].set(True)
    return BlockMask(qb, kb, blocks)


# --- XAttention --------------------------------------------------------------------------
def _strided(x, n_groups: int, stride: int, reverse: bool):
    """[B, L, H, D] -> [B, n_groups, H, stride * D]: group g holds tokens g*S .. g*S+S-1
    (reversed for queries: the antidiagonal), zero past the length."""
    B, L, H, D = x.shape
    xp = jnp.pad(x, ((0, 0), (0, n_groups * stride - L), (0, 0), (0, 0)))
    xp = xp.reshape(B, n_groups, stride, H, D)
    if reverse:
        xp = xp[:, :, ::-1]
    return jnp.moveaxis(xp, 2, 3).reshape(B, n_groups, H, stride * D)


def xattn_mask(q, k, *, block: int = 128, stride: int = 8, tau: float = 0.9,
               keep_diagonal: bool = False, keep_sink: bool = False, scale=None,
               chunk_blocks: int | None = None) -> BlockMask:
    """XAttention-like mask: strided antidiagonal block scores, per-row cumulative threshold.

    XAttention (Xu et al., "XAttention: Block Sparse Attention with Antidiagonal Scoring",
    ICML 2025, arXiv:2503.16428; mit-han-lab/x-attention ``xattn_estimate``,
    ``find_blocks_chunked``):

    1. queries and keys in groups of ``stride`` S consecutive tokens; the score of query
       group i' and key group j' is the antidiagonal sum ``sum_m q[i'S + S-1-m] . k[j'S + m]``
       times ``scale / S``, softmaxed over all key groups of the row;
    2. block score A[i, j] = the sum of those probabilities over the ``block`` x ``block``
       block (``block / S`` groups each way); a row's mass is the sum of its A;
    3. each query block keeps the fewest key blocks, largest A first, whose mass reaches
       ``tau`` of the row's: a block is kept while the mass before it is < tau * total.
       ``keep_diagonal`` / ``keep_sink`` (block i == j / key block 0) are always kept and
       counted first, as in the paper's causal mode.

    Paper's video settings (HunyuanVideo): stride 8, tau 0.9 or 0.95, blocks of 128, 5 dense
    warm-up steps. The non-causal reference code has no forced blocks but, as a side effect of
    its index scatter, also sets key block 0 in rows that drop a block (``keep_sink=True``
    comes close). Lengths need not be multiples of ``block`` or S: the last group and block
    are partial (zero-padded tokens, all-padding key groups excluded).

    Cost: the strided scores are 1/S of dense QK^T (see docs/dynamic_masks.md); queries are
    processed ``chunk_blocks`` query blocks at a time (default: ~2**26 float32 scores).

    Returns:
      ``BlockMask`` with uniform static bounds of ``block`` and traced blocks [Hq, nq, nkv].
    """
    fn = "xattn_mask"
    B, Lq, Lkv, Hq, Hkv, D = _check_qk(fn, q, k)
    block = _check_int(fn, "block", block)
    stride = _check_int(fn, "stride", stride)
    if block % stride:
        raise ValueError(f"{fn}: block={block} must be a multiple of stride={stride}")
    tau = _check_frac(fn, "tau", tau)
    keep_diagonal = _check_bool(fn, "keep_diagonal", keep_diagonal)
    keep_sink = _check_bool(fn, "keep_sink", keep_sink)
    scale = _check_scale(fn, scale, D)
    nqb, nkb = -(-Lq // block), -(-Lkv // block)
    rb = block // stride                      # groups per block
    if chunk_blocks is None:
        chunk_blocks = max(1, min(nqb, _XATTN_CHUNK_ELEMS // max(1, B * Hq * rb * nkb * rb)))
    else:
        chunk_blocks = _check_int(fn, "chunk_blocks", chunk_blocks)
        chunk_blocks = min(chunk_blocks, nqb)
    n_chunks = -(-nqb // chunk_blocks)
    nq_groups = n_chunks * chunk_blocks * rb
    nk_groups = nkb * rb
    qr = _strided(q, nq_groups, stride, True)                          # [B, nqg, Hq, S*D]
    kr = _repeat_heads(_strided(k, nk_groups, stride, False), Hq // Hkv, axis=2)
    q_valid = jnp.arange(nq_groups) * stride < Lq
    k_valid = jnp.arange(nk_groups) * stride < Lkv
    qr = qr.reshape(B, n_chunks, chunk_blocks * rb, Hq, stride * D).swapaxes(0, 1)
    qv = q_valid.reshape(n_chunks, chunk_blocks * rb)
    f = scale / stride

    def one(args):
        qc, valid = args
        s = jnp.einsum("bihf,bjhf->bhij", qc, kr, precision=_HI,
                       preferred_element_type=jnp.float32) * f
        s = jnp.where(k_valid[None, None, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(valid[None, None, :, None], p, 0.0)
        a = p.reshape(B, Hq, chunk_blocks, rb, nkb, rb).sum(axis=(3, 5))
        return a.mean(axis=0)                                          # [Hq, cb, nkb]

    if n_chunks == 1:
        a = one((qr[0], qv[0]))[None]
    else:
        a = jax.lax.map(one, (qr, qv))                                 # [nc, Hq, cb, nkb]
    a = jnp.moveaxis(a, 0, 1).reshape(Hq, n_chunks * chunk_blocks, nkb)[:, :nqb]
    forced = np.zeros((nqb, nkb), bool)
    if keep_diagonal:
        d = np.arange(min(nqb, nkb))
        forced[d, d] = True
    if keep_sink:
        forced[:, 0] = True
    forced_j = jnp.asarray(forced)[None]
    total = jnp.sum(a, axis=-1, keepdims=True)
    order = jnp.argsort(-jnp.where(forced_j, jnp.inf, a), axis=-1, stable=True)
    a_sorted = jnp.take_along_axis(a, order, axis=-1, mode="clip")
    before = jnp.cumsum(a_sorted, axis=-1) - a_sorted
    blocks = _scatter_rows(order, before < tau * total) | forced_j
    bounds = np.append(np.arange(0, Lq, block, dtype=np.int64), np.int64(Lq))
    kbounds = np.append(np.arange(0, Lkv, block, dtype=np.int64), np.int64(Lkv))
    return BlockMask(bounds, kbounds, blocks)


# --- SVG2 --------------------------------------------------------------------------------
class SVG2State(NamedTuple):
    """k-means centroids carried between steps (a pytree: a ``lax.scan`` carry).

    q_centroids: float32 [Hq, CQ, B * D]; kv_centroids: float32 [Hkv, CK, B * D] (features of
    a token: its vectors of the B batch elements, concatenated)."""

    q_centroids: jax.Array
    kv_centroids: jax.Array


class SVG2Layout(NamedTuple):
    """``svg2_mask``'s result: the mask over the permuted tokens, the permutations (position
    p of head h holds token ``perm[h, p]``) and the new centroids."""

    mask: BlockMask
    q_perm: jax.Array       # int32 [Hq, Lq]
    kv_perm: jax.Array      # int32 [Hkv, Lkv]
    state: SVG2State


def _features(x):
    """[B, L, H, D] -> float32 [H, L, B * D]."""
    B, L, H, D = x.shape
    return jnp.transpose(x, (2, 1, 0, 3)).reshape(H, L, B * D)


def _assign(x, c):
    """Nearest centroid of each point (squared Euclidean, ties to the lower index): x [L, F]
    (its dtype sets the matmul's), c float32 [C, F] -> int32 [L]."""
    cx = c.astype(x.dtype)
    cn = jnp.sum(jnp.square(cx.astype(jnp.float32)), axis=-1)
    dots = jnp.einsum("lf,cf->lc", x, cx, preferred_element_type=jnp.float32)
    return jnp.argmin(cn[None, :] - 2.0 * dots, axis=-1).astype(jnp.int32)


def _update(x, labels, c):
    """Centroids as the means of their points; an empty cluster keeps its centroid.
    x [H, L, F], labels int32 [H, L], c float32 [H, C, F]. The sums are a ``segment_sum``
    (scatter-add); one-hot matmuls per head instead were slower on the H200 and removed
    (session 12, Wan 720p SVG2 ``iters=1`` builder: 26.05 ms against 14.90 ms)."""
    C = c.shape[1]
    seg = jax.vmap(lambda v, lh: jax.ops.segment_sum(v, lh, num_segments=C))
    sums = seg(x.astype(jnp.float32), labels)
    counts = seg(jnp.ones(labels.shape, jnp.float32), labels)
    return jnp.where(counts[..., None] > 0, sums / jnp.maximum(counts, 1.0)[..., None], c)


#: How k-means assigns points: "pallas" (``pallas_kernels.triton.kmeans.assign``: one Triton
#: kernel, the argmin kept in registers; the interpreter off a GPU, slow), "xla" (``_assign``: a
#: matmul, then an argmin over the [L, C] distances, which go to memory and back: ~24 GB a call
#: at SVG2's Wan 720p key side) or "auto", the default: "pallas" on a GPU, "xla" elsewhere. Same
#: labels up to float rounding of near ties. H200, session 12 (Wan 720p SVG2 ``iters=1``, 40
#: heads, L = 75,600, one call): builder 9.27 ms fused against 15.17 ms xla, 8.8% of the
#: attention call it feeds against 14.3%.
KMEANS_ASSIGN = "auto"


def _assigner():
    """The batched assignment [H, L, F] x [H, C, F] -> [H, L] of ``KMEANS_ASSIGN``."""
    if _use_kernel("KMEANS_ASSIGN", KMEANS_ASSIGN):
        from pallas_kernels.triton import kmeans as tk
        # Labels are piecewise constant (zero derivative); the kernel has no autodiff rule, so
        # its inputs leave the trace of gradients (as the XLA argmin's do implicitly).
        sg = jax.lax.stop_gradient
        return lambda x, c: tk.assign(sg(x), sg(c), interpret=jax.default_backend() != "gpu")
    return jax.vmap(_assign)


def kmeans(x, centroids, *, iters: int):
    """Fixed-iteration k-means (squared Euclidean), batched over heads.

    Each iteration assigns every point to its nearest centroid (ties: the lower index) and
    moves each centroid to the mean of its points (an empty cluster keeps its centroid), as
    SVG2's ``batch_kmeans_Euclid`` without the host-side convergence test.

    Args:
      x: [H, L, F] points (any float dtype: the distance matmul runs in it, float32 sums).
      centroids: float32 [H, C, F], the warm start.
      iters: static int >= 0.
    Returns:
      (labels int32 [H, L]: the last iteration's assignment, centroids float32 [H, C, F]: the
      means of those clusters). ``iters == 0``: the assignment to ``centroids``, unchanged.
    """
    fn = "kmeans"
    _check_array(fn, "x", x, 3, "[H, L, F]")
    _check_array(fn, "centroids", centroids, 3, "[H, C, F]")
    if centroids.shape[0] != x.shape[0] or centroids.shape[2] != x.shape[2]:
        raise ValueError(f"{fn}: centroids {tuple(centroids.shape)} do not match x "
                         f"{tuple(x.shape)}: expected [{x.shape[0]}, C, {x.shape[2]}]")
    iters = _check_int(fn, "iters", iters, 0)
    c = centroids.astype(jnp.float32)
    assign = _assigner()
    if iters == 0:
        return assign(x, c), c

    def body(_, carry):
        c, _ = carry
        lab = assign(x, c)
        return _update(x, lab, c), lab

    carry = (c, jnp.zeros(x.shape[:2], jnp.int32))
    if iters <= 4:                  # the per-step warm starts: unrolled, no device loop
        for i in range(iters):
            carry = body(i, carry)
        c, lab = carry
    else:
        c, lab = jax.lax.fori_loop(0, iters, body, carry)
    return lab, c


def _check_clusters(fn: str, name: str, C, L: int) -> int:
    C = _check_int(fn, name, C)
    if C > L:
        raise ValueError(f"{fn}: {name}={C} exceeds the sequence length {L}: every block needs "
                         f"a token")
    if C * L >= 2 ** 31:
        raise ValueError(f"{fn}: {name} * length = {C * L} must stay below 2**31 (int32 "
                         f"arithmetic of the block layout)")
    return C


def svg2_init(q, k, key, *, q_clusters: int = 300, kv_clusters: int = 1000,
              iters: int = 50) -> SVG2State:
    """First centroids of ``svg2_mask``: ``q_clusters`` / ``kv_clusters`` distinct random
    tokens per head, then ``iters`` k-means iterations (SVG2 on Wan 720p: 300 query and 1000
    key clusters, 50 iterations at the first sparse step; Hunyuan: 400 query clusters).

    ``key``: a jax PRNG key. Returns an ``SVG2State`` (jittable: ``key`` may be traced)."""
    fn = "svg2_init"
    B, Lq, Lkv, Hq, Hkv, D = _check_qk(fn, q, k)
    cq = _check_clusters(fn, "q_clusters", q_clusters, Lq)
    ck = _check_clusters(fn, "kv_clusters", kv_clusters, Lkv)
    iters = _check_int(fn, "iters", iters, 0)
    kq, kk = jax.random.split(key)

    def seeds(x, C, key):
        H, L = x.shape[0], x.shape[1]
        idx = jax.vmap(lambda kh: jax.random.permutation(kh, L)[:C])(jax.random.split(key, H))
        c0 = jnp.take_along_axis(x, idx[:, :, None], axis=1, mode="clip").astype(jnp.float32)
        return kmeans(x, c0, iters=iters)[1]

    return SVG2State(seeds(_features(q), cq, kq), seeds(_features(k), ck, kk))


def _groups(labels, C: int, m: int):
    """One head's cluster groups (see ``svg2_mask``): labels int32 [L] -> (group of each
    cluster [C], cluster sizes [C], number of groups). A cluster of >= m tokens closes a group,
    except the last such cluster (the clusters after it join its group); smaller clusters join
    the next group. Group ids follow label order."""
    idx = jnp.arange(C, dtype=jnp.int32)
    counts = jnp.bincount(labels, length=C).astype(jnp.int32)
    big = counts >= m
    last_big = jnp.max(jnp.where(big, idx, -1))
    cut = (big & (idx < last_big)).astype(jnp.int32)
    gid = jnp.cumsum(cut) - cut
    return gid.astype(jnp.int32), counts, 1 + jnp.sum(cut)


def _layout(labels, gid, counts, n_groups, order, m: int):
    """One head's group-contiguous layout: the groups in ``order`` (int32 [C]: position ->
    group id, the ``n_groups`` groups first), each group's clusters in label order, each group
    cut into near-equal pieces (blocks). Returns (perm [L], bounds [C + 1], group id of each
    block [C])."""
    C = counts.shape[0]
    L = labels.shape[0]
    idx = jnp.arange(C, dtype=jnp.int32)
    g = jax.ops.segment_sum(counts, gid, num_segments=C, indices_are_sorted=True)[order]
    valid = idx < n_groups
    extra = C - n_groups
    # Pieces: each group is cut into p_j >= 1 near-equal pieces, sum p_j = C, by largest
    # remainder in proportion to its room; room counts pieces of >= m tokens when that fits,
    # else pieces of >= 1 token (always fits: L >= C).
    cap_m = jnp.where(valid, g // m - 1, 0)
    cap_1 = jnp.where(valid, g - 1, 0)
    use_m = jnp.sum(cap_m) >= extra
    cap = jnp.where(use_m, cap_m, cap_1)
    den = jnp.maximum(jnp.sum(cap), 1)
    num = extra * cap
    base, rem = num // den, num % den
    r = extra - jnp.sum(base)
    rorder = jnp.argsort(-rem, stable=True)
    plus = jnp.zeros((C,), jnp.int32).at[rorder].set((idx < r).astype(jnp.int32), mode="drop")
    p = jnp.where(valid, 1 + base + plus, 0)
    pend = jnp.cumsum(p)
    gstart = jnp.cumsum(g) - g
    blk_pos = jnp.clip(jnp.searchsorted(pend, idx, side="right"), 0, C - 1).astype(jnp.int32)
    t = idx - (pend - p)[blk_pos]
    pj = jnp.maximum(p[blk_pos], 1)
    starts = gstart[blk_pos] + (t * g[blk_pos]) // pj
    bounds = jnp.concatenate([starts, jnp.full((1,), L, jnp.int32)]).astype(jnp.int32)
    rank = jnp.zeros((C,), jnp.int32).at[order].set(idx)               # group id -> position
    # Each cluster's place: by its group's position, then by label; tokens stay in order.
    place = jnp.zeros((C,), jnp.int32).at[jnp.lexsort((idx, rank[gid]))].set(idx)
    perm = jnp.argsort(place[labels], stable=True).astype(jnp.int32)
    return perm, bounds, order[blk_pos]


def _kv_group_order(merged, n_groups, group: int):
    """[Hkv, CK] key-group order per key head (position -> group id), from the group selection
    ``merged`` [Hq, CQ, CK] of its ``group`` query heads: by popularity, the groups that more
    query groups select first (ties in label order), ids >= ``n_groups`` last. Selected runs
    merge and never-selected groups gather at the end; the token-level mask is the same in any
    order. H200, session 12 (Wan 720p SVG2 ``iters=1``, density 0.245): attention 105.1 ms
    against 136.6 ms with the groups in k-means label order (builder 14.9 vs 15.2 ms), so label
    order was removed."""
    Hq, _, CK = merged.shape
    idx = jnp.arange(CK, dtype=jnp.int32)
    pop = jnp.sum(merged.astype(jnp.int32), axis=1).reshape(Hq // group, group, CK).sum(axis=1)
    key = jnp.where(idx[None, :] < n_groups[:, None], -pop, jnp.iinfo(jnp.int32).max)
    return jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)


def _merge_groups(sel, gid, nonempty, axis: int):
    """OR of ``sel`` over the non-empty clusters of each group along ``axis`` (0 or 1)."""
    x = jnp.where(jnp.expand_dims(nonempty, 1 - axis), sel, False).astype(jnp.int32)
    x = jnp.moveaxis(x, axis, 0)
    out = jax.ops.segment_sum(x, gid, num_segments=x.shape[0], indices_are_sorted=True) > 0
    return jnp.moveaxis(out, 0, axis)


def _svg2_select(q_centroids, kv_centroids, kv_counts, *, group: int, scale: float,
                 batch: int, top_p: float, n_min: int):
    """Cluster-pair selection bool [Hq, CQ, CK]: size-weighted softmax of centroid scores,
    sorted descending, a cluster kept while the mass before it is <= top_p, at least n_min."""
    ck = _repeat_heads(kv_centroids, group, axis=0)
    counts = _repeat_heads(kv_counts, group, axis=0).astype(jnp.float32)
    s = jnp.einsum("hcf,hkf->hck", q_centroids, ck, precision=_HI) * (scale / batch)
    logw = jnp.where(counts > 0, jnp.log(jnp.maximum(counts, 1.0)), -jnp.inf)
    z = s + logw[:, None, :]
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0))
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    order, ps = _sorted_desc(p)
    before = jnp.cumsum(ps, axis=-1) - ps
    keep = (before <= top_p) | (jnp.arange(p.shape[-1]) < n_min)
    return _scatter_rows(order, keep)


def svg2_mask(q, k, state: SVG2State, *, iters: int = 2, top_p: float = 0.9,
              min_kc_ratio: float = 0.1, min_cluster_tokens: int = 1,
              scale=None) -> SVG2Layout:
    """SVG2-like mask: semantic-aware permutation by per-head k-means of q and k.

    Sparse VideoGen2 (Yang et al., "Sparse VideoGen2: Accelerate Video Generation with Sparse
    Attention via Semantic-Aware Permutation", arXiv:2505.18875; svg-project/Sparse-VideoGen
    ``svg/kmeans_utils.py``: ``batch_kmeans_Euclid``, ``identify_dynamic_map``):

    1. k-means of each query head's tokens and of each key head's tokens (squared Euclidean),
       ``iters`` iterations warm-started from ``state`` (SVG2: 2 per step after 50 at the
       first; ``svg2_init``), no convergence test (nothing goes to the host);
    2. tokens sorted by cluster (stable), so each cluster is contiguous, per head; the key
       clusters' groups (below) most selected first (``_kv_group_order``: selected runs merge
       into fewer tiles; the token-level mask does not depend on it);
    3. the score of query cluster i and key cluster j is ``scale * c_i . c_j`` of the
       centroids, ``P_ij`` its softmax over j weighted by the key clusters' sizes; sorted
       descending, a key cluster is kept while the mass before it is <= ``top_p`` (0.9), and
       the first ``int(min_kc_ratio * CK)`` (``min_kc_ratio`` 0.1) always;
    4. blocks are the clusters: per-head bounds from their sizes.

    Static shapes with variable clusters: the mask has exactly CQ x CK blocks per head. An
    empty cluster has no block; clusters with fewer than ``min_cluster_tokens`` tokens are
    merged into the next cluster (in label order; the ones after the last large cluster into
    the last group), and a merged block pair is kept if any of its non-empty cluster pairs is
    (a superset of the selection: more interactions, never fewer). The freed blocks go to
    the largest groups, cut into near-equal pieces of one group each (same selection, exactly
    the same token-level mask), pieces of >= ``min_cluster_tokens`` whenever they fit
    (always when the length is >= (2m - 1) x clusters), else of >= 1 token.

    Performance: a 128-token tile meeting at most 4 clusters per axis is one plain or grid
    step; a tile cut more finely takes a bitmap step (a bit per entry, 2 KB, slower), within
    ``device_route.BITMAP_BUDGET_BYTES`` for the whole plan (per-head traced bounds: checked on
    the device); past it the whole call takes the exact path, dense work in XLA. SVG2's Wan
    720p setting (1000 key clusters over 75,600 tokens, heavy-tailed sizes) has some finely cut
    tiles; ``min_cluster_tokens`` merges small clusters (43: no bitmap steps at all). The
    default (1) is the paper's rule.

    Args:
      q, k: [B, Lq, Hq, D], [B, Lkv, Hkv, D]; GQA: key clusters per key head, each query head
        scored against its group's key head. B > 1: one clustering on features concatenated
        over the batch (logits: the batch mean).
      state: ``SVG2State`` (``svg2_init``, or the previous call's ``state``).
      iters, top_p, min_kc_ratio, min_cluster_tokens, scale: see above (scale: ``D ** -0.5``).
    Returns:
      ``SVG2Layout(mask, q_perm, kv_perm, state)``: mask with per-head bounds [Hq, C + 1]
      (int32 jax arrays) and blocks [Hq, CQ, CK] over the permuted tokens.
    """
    fn = "svg2_mask"
    B, Lq, Lkv, Hq, Hkv, D = _check_qk(fn, q, k)
    if not isinstance(state, SVG2State):
        raise TypeError(f"{fn}: state must be an SVG2State (svg2_init), got "
                        f"{type(state).__name__}")
    F = B * D
    qc, kc = state
    for name, c, H in (("q_centroids", qc, Hq), ("kv_centroids", kc, Hkv)):
        _check_array(fn, f"state.{name}", c, 3, f"[{H}, C, {F}]")
        if int(c.shape[0]) != H or int(c.shape[2]) != F:
            raise ValueError(f"{fn}: state.{name} has shape {tuple(c.shape)}, expected "
                             f"[{H}, C, {F}] for these q and k")
    iters = _check_int(fn, "iters", iters, 0)
    top_p = _check_frac(fn, "top_p", top_p)
    min_kc_ratio = _check_frac(fn, "min_kc_ratio", min_kc_ratio, lo_open=False)
    m = _check_int(fn, "min_cluster_tokens", min_cluster_tokens)
    CQ = _check_clusters(fn, "state.q_centroids.shape[1] (query clusters)", int(qc.shape[1]),
                         Lq)
    CK = _check_clusters(fn, "state.kv_centroids.shape[1] (key clusters)", int(kc.shape[1]),
                         Lkv)
    scale = _check_scale(fn, scale, D)
    g = Hq // Hkv

    q_lab, qc = kmeans(_features(q), qc, iters=iters)
    k_lab, kc = kmeans(_features(k), kc, iters=iters)
    q_gid, q_n, q_ng = jax.vmap(lambda x: _groups(x, CQ, m))(q_lab)
    k_gid, k_n, k_ng = jax.vmap(lambda x: _groups(x, CK, m))(k_lab)
    sel = _svg2_select(qc, kc, k_n, group=g, scale=scale, batch=B, top_p=top_p,
                       n_min=int(min_kc_ratio * CK))
    k_gid_r, k_n_r = (_repeat_heads(x, g, axis=0) for x in (k_gid, k_n))
    merged = jax.vmap(lambda s, gq, nq, gk, nk: _merge_groups(
        _merge_groups(s, gq, nq > 0, 0), gk, nk > 0, 1))(sel, q_gid, q_n, k_gid_r, k_n_r)
    q_order = jnp.broadcast_to(jnp.arange(CQ, dtype=jnp.int32), (Hq, CQ))
    k_order = _kv_group_order(merged, k_ng, g)
    lay = jax.vmap(lambda *a: _layout(*a, m))
    q_perm, qb, q_blk = lay(q_lab, q_gid, q_n, q_ng, q_order)
    k_perm, kb, k_blk = lay(k_lab, k_gid, k_n, k_ng, k_order)
    k_blk_r = _repeat_heads(k_blk, g, axis=0)
    blocks = jax.vmap(lambda mg, bq, bk: mg[bq[:, None], bk[None, :]])(merged, q_blk, k_blk_r)
    mask = BlockMask(qb, _repeat_heads(kb, g, axis=0), blocks)
    return SVG2Layout(mask, q_perm, k_perm, SVG2State(qc, kc))


def _check_perm(fn: str, x, perm, xname: str):
    _check_array(fn, "perm", perm, 2, "[H, L]")
    if not jnp.issubdtype(perm.dtype, jnp.integer):
        raise TypeError(f"{fn}: perm must hold integers, got {perm.dtype}")
    _check_array(fn, xname, x, 4, "[B, L, H, D]")
    if (int(perm.shape[0]), int(perm.shape[1])) != (int(x.shape[2]), int(x.shape[1])):
        raise ValueError(f"{fn}: perm has shape {tuple(perm.shape)} but {xname} "
                         f"{tuple(x.shape)} needs [H, L] = [{x.shape[2]}, {x.shape[1]}]")


def permute(x, perm):
    """``x`` [B, L, H, D] in a per-head order: ``out[b, p, h] = x[b, perm[h, p], h]``
    (``perm`` [H, L], e.g. ``SVG2Layout.q_perm``; indices are clamped, never read out of
    bounds)."""
    _check_perm("permute", x, perm, "x")
    idx = jnp.swapaxes(perm.astype(jnp.int32), 0, 1)[None, :, :, None]
    return jnp.take_along_axis(x, idx, axis=1, mode="clip")


def unpermute(out, perm):
    """The inverse of ``permute``: ``res[b, perm[h, p], h] = out[b, p, h]``."""
    _check_perm("unpermute", out, perm, "out")
    H, L = int(perm.shape[0]), int(perm.shape[1])
    inv = jnp.zeros((H, L), jnp.int32).at[jnp.arange(H)[:, None], perm].set(
        jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (H, L)), mode="drop")
    return permute(out, inv)


def svg2_attention(q, k, v, state: SVG2State, *, iters: int = 2, top_p: float = 0.9,
                   min_kc_ratio: float = 0.1, min_cluster_tokens: int = 1, scale=None,
                   backend=None):
    """SVG2-like sparse attention end to end: ``svg2_mask``, permute q / k / v, run
    ``tessera_jax.sparse_attention`` on the cluster-contiguous tensors, un-permute the output.

    Returns ``(out [B, Lq, Hq, D] in q's order and dtype, new SVG2State)``: carry the state to
    the next step (a ``lax.scan`` carry). Knobs and the performance note: ``svg2_mask``.
    """
    _check_array("svg2_attention", "v", v, 4, "[B, Lkv, Hkv, D]")
    lay = svg2_mask(q, k, state, iters=iters, top_p=top_p, min_kc_ratio=min_kc_ratio,
                    min_cluster_tokens=min_cluster_tokens, scale=scale)
    qp = permute(q, lay.q_perm)
    kp, vp = permute(k, lay.kv_perm), permute(v, lay.kv_perm)
    out = sparse_attention(qp, kp, vp, lay.mask, scale=scale, backend=backend)
    return unpermute(out, lay.q_perm), lay.state


# --- rules: the builders as choices of a DynamicSchedule -----------------------------------
# Each rule is a frozen (hashable) dataclass of its knobs: ``init_state(q_shape, kv_shape,
# dtype)`` gives its first loop carry and ``rule(q, k, v, state, *, scale, attend)`` builds the
# mask from q and k and returns ``(attend(q, k, v, mask), new state)``; ``attend`` is the sparse
# attention the loop runs (``tessera_jax.sparse_attention`` by default, a baseline's otherwise).
def _static_tuple(name: str, bounds):
    if bounds is None:
        return None
    if isinstance(bounds, jax.Array):
        raise TypeError(f"{name} must be static (NumPy or a sequence of ints), got a jax array")
    arr = np.asarray(bounds)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be 1-D ints, got {arr.dtype} of shape {arr.shape}")
    return tuple(int(x) for x in arr)


def _as_np(b):
    return None if b is None else np.asarray(b, np.int64)


@dataclasses.dataclass(frozen=True)
class VSA:
    """``vsa_mask`` as a rule (stateless): the same knobs and defaults (keep 12.5%)."""

    q_bounds: tuple | None = None
    kv_bounds: tuple | None = None
    block: int = 64
    keep: float | None = None
    topk: int | None = None
    local: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "q_bounds", _static_tuple("VSA.q_bounds", self.q_bounds))
        object.__setattr__(self, "kv_bounds", _static_tuple("VSA.kv_bounds", self.kv_bounds))

    def init_state(self, q_shape, kv_shape, dtype):
        return ()

    def mask(self, q, k, scale=None) -> BlockMask:
        return vsa_mask(q, k, q_bounds=_as_np(self.q_bounds), kv_bounds=_as_np(self.kv_bounds),
                        block=self.block, keep=self.keep, topk=self.topk, local=self.local,
                        scale=scale)

    def __call__(self, q, k, v, state, *, scale=None, attend):
        return attend(q, k, v, self.mask(q, k, scale)), state


@dataclasses.dataclass(frozen=True)
class Sparge:
    """``sparge_mask`` as a rule (stateless): the same knobs and defaults."""

    q_bounds: tuple | None = None
    kv_bounds: tuple | None = None
    block_q: int = 128
    block_kv: int = 64
    cdf_threshold: float = 0.98
    topk: float | None = None
    sim_threshold: float = 0.6
    min_keep: int = 1
    smooth_k: bool = True
    sink: bool = False

    def __post_init__(self):
        object.__setattr__(self, "q_bounds", _static_tuple("Sparge.q_bounds", self.q_bounds))
        object.__setattr__(self, "kv_bounds", _static_tuple("Sparge.kv_bounds", self.kv_bounds))

    def init_state(self, q_shape, kv_shape, dtype):
        return ()

    def mask(self, q, k, scale=None) -> BlockMask:
        return sparge_mask(q, k, q_bounds=_as_np(self.q_bounds), kv_bounds=_as_np(self.kv_bounds),
                           block_q=self.block_q, block_kv=self.block_kv,
                           cdf_threshold=self.cdf_threshold, topk=self.topk,
                           sim_threshold=self.sim_threshold, min_keep=self.min_keep,
                           smooth_k=self.smooth_k, sink=self.sink, scale=scale)

    def __call__(self, q, k, v, state, *, scale=None, attend):
        return attend(q, k, v, self.mask(q, k, scale)), state


@dataclasses.dataclass(frozen=True)
class XAttention:
    """``xattn_mask`` as a rule (stateless): the same knobs and defaults (stride 8; the
    cheaper variant of docs/dynamic_masks.md is ``stride=64``)."""

    block: int = 128
    stride: int = 8
    tau: float = 0.9
    keep_diagonal: bool = False
    keep_sink: bool = False
    chunk_blocks: int | None = None

    def init_state(self, q_shape, kv_shape, dtype):
        return ()

    def mask(self, q, k, scale=None) -> BlockMask:
        return xattn_mask(q, k, block=self.block, stride=self.stride, tau=self.tau,
                          keep_diagonal=self.keep_diagonal, keep_sink=self.keep_sink,
                          scale=scale, chunk_blocks=self.chunk_blocks)

    def __call__(self, q, k, v, state, *, scale=None, attend):
        return attend(q, k, v, self.mask(q, k, scale)), state


class SVG2Carry(NamedTuple):
    """The SVG2 rule's loop carry: the centroids and whether they were initialised."""

    centroids: SVG2State
    ready: jax.Array        # bool []


@dataclasses.dataclass(frozen=True)
class SVG2:
    """SVG2 as a rule: at its first sparse step (``ready`` False in the carry) ``svg2_init``
    (``init_iters`` k-means iterations from ``seed``), then at every call ``svg2_mask``
    warm-started from the carried centroids with ``iters`` iterations, q / k / v permuted per
    head, the sparse attention, the output un-permuted. The paper's knobs and defaults
    (``iters=2``; the cheaper variant of docs/dynamic_masks.md is ``iters=1``)."""

    q_clusters: int = 300
    kv_clusters: int = 1000
    init_iters: int = 50
    iters: int = 2
    top_p: float = 0.9
    min_kc_ratio: float = 0.1
    min_cluster_tokens: int = 1
    seed: int = 0

    def init_state(self, q_shape, kv_shape, dtype):
        B, Lq, Hq, D = q_shape
        Lkv, Hkv = kv_shape[1], kv_shape[2]
        for name, C, L in (("q_clusters", self.q_clusters, Lq),
                           ("kv_clusters", self.kv_clusters, Lkv)):
            _check_clusters("SVG2", name, C, L)
        return SVG2Carry(SVG2State(jnp.zeros((Hq, self.q_clusters, B * D), jnp.float32),
                                   jnp.zeros((Hkv, self.kv_clusters, B * D), jnp.float32)),
                         jnp.zeros((), bool))

    def layout(self, q, k, carry: SVG2Carry, scale=None) -> SVG2Layout:
        """The mask and permutations of this call (initialising the centroids if needed)."""
        cent = jax.lax.cond(
            carry.ready, lambda: carry.centroids,
            lambda: svg2_init(q, k, jax.random.key(self.seed), q_clusters=self.q_clusters,
                              kv_clusters=self.kv_clusters, iters=self.init_iters))
        return svg2_mask(q, k, cent, iters=self.iters, top_p=self.top_p,
                         min_kc_ratio=self.min_kc_ratio,
                         min_cluster_tokens=self.min_cluster_tokens, scale=scale)

    def __call__(self, q, k, v, carry, *, scale=None, attend):
        lay = self.layout(q, k, carry, scale)
        out = attend(permute(q, lay.q_perm), permute(k, lay.kv_perm), permute(v, lay.kv_perm),
                     lay.mask)
        return unpermute(out, lay.q_perm), SVG2Carry(lay.state, jnp.ones((), bool))


# =========================================================================================
# NumPy references of the same rules (tests only; float64, loops). Each returns what the
# builder computes plus a per-row *margin*: how far the row's decision is from flipping
# (score gap at the kept/dropped boundary, distance of a cumulative sum to its threshold).
# Float32 builders may differ from these only on rows with a margin near 0.
# =========================================================================================
def _numpy_pool(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Mean over each block: [B, L, H, F] -> float64 [B, n, H, F]."""
    return np.stack([x[:, a:b].astype(np.float64).mean(axis=1)
                     for a, b in zip(bounds[:-1], bounds[1:])], axis=1)


def _numpy_cum_margin(vals, thr, keep_count, inclusive):
    """Margin of a sorted-descending cumulative rule on one row: the boundary gap and the
    distance of each cumulative sum to the threshold."""
    cum = np.cumsum(vals) if inclusive else np.cumsum(vals) - vals
    mar = float(np.min(np.abs(cum - thr))) if np.isfinite(thr) else np.inf
    if 0 < keep_count < len(vals):
        mar = min(mar, float(vals[keep_count - 1] - vals[keep_count]))
    return mar


def _numpy_vsa(q, k, q_bounds, kv_bounds, topk, local=None, scale=None):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, _, Hq, D = q.shape
    g = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    pq, pk = _numpy_pool(q, q_bounds), np.repeat(_numpy_pool(k, kv_bounds), g, axis=2)
    s = np.einsum("bihd,bjhd->hij", pq, pk) * scale / B
    nq, nk = s.shape[1:]
    forced = np.zeros((nq, nk), bool)
    if local is not None:
        i = np.arange(nq)
        forced = np.abs(i[:, None] - i[None, :]) <= local
    blocks = np.zeros(s.shape, bool)
    margin = np.full(s.shape[:2], np.inf)
    for h in range(Hq):
        for i in range(nq):
            key = np.where(forced[i], np.inf, s[h, i])
            order = np.argsort(-key, kind="stable")
            blocks[h, i, order[:topk]] = True
            if topk < nk:
                vals = key[order]
                margin[h, i] = vals[topk - 1] - vals[topk]
    return blocks, margin


def _numpy_sparge(q, k, q_bounds, kv_bounds, *, cdf_threshold=0.98, topk=None,
                  sim_threshold=0.6, min_keep=1, smooth_k=True, sink=False, scale=None,
                  inclusive=True):
    """``inclusive=False`` is a deliberately wrong rule (mass before a block, for the tests'
    negative control)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Lkv, Hkv, D = k.shape
    Hq = q.shape[2]
    g = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale

    def sim(x, bounds):
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            blk = x[:, a:b]                                            # [B, n, H, D]
            nrm = np.linalg.norm(blk, axis=-1, keepdims=True)
            u = np.where(nrm > 0, blk / np.where(nrm > 0, nrm, 1), 0)
            gram = np.einsum("bihd,bjhd->bhij", u, u)
            out.append(gram.mean(axis=(2, 3)).min(axis=0))             # [H]
        return np.stack(out)                                           # [n, H]

    kc = k - k.mean(axis=1, keepdims=True) if smooth_k else k
    raw_q, raw_k = sim(q, q_bounds).T, np.repeat(sim(kc, kv_bounds).T, g, axis=0)
    sim_q, sim_k = raw_q > sim_threshold, raw_k > sim_threshold      # [Hq, nq], [Hq, nk]
    pq, pk = _numpy_pool(q, q_bounds), np.repeat(_numpy_pool(k, kv_bounds), g, axis=2)
    s = np.einsum("bihd,bjhd->hij", pq, pk) * scale / B
    nq, nk = s.shape[1:]
    blocks = np.zeros(s.shape, bool)
    margin = np.full((Hq, nq), np.inf)
    for h in range(Hq):
        for i in range(nq):
            row = np.where(sim_k[h], s[h, i], -np.inf)
            if sim_k[h].any():
                p = np.exp(row - row.max())
                p /= p.sum()
            else:
                p = np.zeros(nk)
            order = np.argsort(-p, kind="stable")
            vals = p[order]
            if topk is None:
                cum = np.cumsum(vals) if inclusive else np.cumsum(vals) - vals
                kept = (cum <= cdf_threshold) | (np.arange(nk) < min_keep)
                c = int(kept.sum())
                mar = _numpy_cum_margin(vals[vals > 0], cdf_threshold, min(c, int(
                    np.sum(vals > 0))), inclusive) if vals[0] > 0 else np.inf
            else:
                c = max(1, int(topk * nk))
                kept = np.arange(nk) < c
                mar = vals[c - 1] - vals[c] if c < nk and vals[c] > 0 else np.inf
            blocks[h, i, order[kept]] = True
            # the similarity judgments flip whole rows and columns
            mar = min(mar, float(np.min(np.abs(raw_k[h] - sim_threshold))),
                      abs(float(raw_q[h, i]) - sim_threshold))
            margin[h, i] = np.inf if not sim_q[h, i] and abs(
                float(raw_q[h, i]) - sim_threshold) > 1e-4 else mar
    blocks |= ~sim_k[:, None, :]
    blocks |= ~sim_q[:, :, None]
    if sink:
        blocks[:, :, 0] = True
    return blocks, margin


def _numpy_xattn(q, k, *, block=128, stride=8, tau=0.9, keep_diagonal=False, keep_sink=False,
                 scale=None, exclusive=True):
    """``exclusive=False`` is a deliberately wrong rule (mass including the block) for the
    negative control."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    k = np.repeat(k, Hq // Hkv, axis=2)
    scale = D ** -0.5 if scale is None else scale
    nqb, nkb = -(-Lq // block), -(-Lkv // block)
    ngq, ngk = nqb * block // stride, nkb * block // stride
    qp = np.zeros((B, ngq * stride, Hq, D))
    qp[:, :Lq] = q
    kp = np.zeros((B, ngk * stride, Hq, D))
    kp[:, :Lkv] = k
    logits = np.zeros((B, Hq, ngq, ngk))
    for m in range(stride):          # antidiagonal: q[i'S + S-1-m] . k[j'S + m]
        logits += np.einsum("bihd,bjhd->bhij", qp[:, stride - 1 - m::stride], kp[:, m::stride])
    logits *= scale / stride
    logits[..., np.arange(ngk) * stride >= Lkv] = -np.inf
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    p[:, :, np.arange(ngq) * stride >= Lq] = 0
    r = block // stride
    a = p.reshape(B, Hq, nqb, r, nkb, r).sum(axis=(3, 5)).mean(axis=0)   # [Hq, nqb, nkb]
    forced = np.zeros((nqb, nkb), bool)
    if keep_diagonal:
        d = np.arange(min(nqb, nkb))
        forced[d, d] = True
    if keep_sink:
        forced[:, 0] = True
    blocks = np.zeros(a.shape, bool)
    margin = np.full(a.shape[:2], np.inf)
    for h in range(Hq):
        for i in range(nqb):
            row = a[h, i]
            order = np.argsort(-np.where(forced[i], np.inf, row), kind="stable")
            vals = row[order]
            cum = np.cumsum(vals) - vals if exclusive else np.cumsum(vals)
            thr = tau * row.sum()
            kept = (cum < thr) | forced[i][order]
            blocks[h, i, order[kept]] = True
            nf = int(forced[i].sum())
            free = ~forced[i][order]
            mar = float(np.min(np.abs(cum[free] - thr))) if free.any() else np.inf
            c = int(kept.sum())
            if nf < c < nkb:
                mar = min(mar, float(vals[c - 1] - vals[c]))
            margin[h, i] = mar / max(row.sum(), 1e-300)
    return blocks, margin


def _numpy_kmeans(x, c, iters):
    """(labels, centroids, min assignment margin) of ``kmeans`` in float64."""
    x = np.asarray(x, np.float64)
    c = np.asarray(c, np.float64).copy()
    H, L, _ = x.shape
    margin = np.inf

    def assign(c):
        nonlocal margin
        d = np.sum(c * c, axis=-1)[:, None, :] - 2 * np.einsum("hlf,hcf->hlc", x, c)
        lab = np.argmin(d, axis=-1)
        if d.shape[-1] > 1:
            srt = np.sort(d, axis=-1)
            margin = min(margin, float(np.min(srt[..., 1] - srt[..., 0])))
        return lab

    if iters == 0:
        return assign(c), c, margin
    for _ in range(iters):
        lab = assign(c)
        for h in range(H):
            for j in range(c.shape[1]):
                sel = lab[h] == j
                if sel.any():
                    c[h, j] = x[h, sel].mean(axis=0)
    return lab, c, margin


def _numpy_svg2(q, k, q_centroids, kv_centroids, *, iters=2, top_p=0.9, min_kc_ratio=0.1,
                min_cluster_tokens=1, scale=None, exclusive=True):
    """The SVG2 rule on token level: returns (token mask bool [Hq, Lq, Lkv] over the original
    token order, q labels, kv labels, q centroids, kv centroids, margin). ``exclusive=False``
    is a deliberately wrong rule (mass including the cluster) for the negative control."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    fq = q.transpose(2, 1, 0, 3).reshape(Hq, Lq, B * D)
    fk = k.transpose(2, 1, 0, 3).reshape(Hkv, Lkv, B * D)
    ql, qc, mq = _numpy_kmeans(fq, q_centroids, iters)
    kl, kc, mk = _numpy_kmeans(fk, kv_centroids, iters)
    CQ, CK = qc.shape[1], kc.shape[1]
    n_min = int(min_kc_ratio * CK)
    m = min_cluster_tokens

    def groups(lab, C):
        counts = np.bincount(lab, minlength=C)
        big = np.nonzero(counts >= m)[0]
        gid = np.zeros(C, np.int64)
        if len(big):
            for c in range(C):      # group = number of large clusters before c, capped
                gid[c] = min(int(np.sum(big < c)), len(big) - 1)
        return gid, counts

    margin = min(mq, mk)
    tok = np.zeros((Hq, Lq, Lkv), bool)
    for h in range(Hq):
        hk = h // g
        counts_k = np.bincount(kl[hk], minlength=CK)
        s = qc[h] @ kc[hk].T * scale / B
        with np.errstate(divide="ignore"):
            z = s + np.log(counts_k.astype(np.float64))[None, :]
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        sel = np.zeros((CQ, CK), bool)
        for i in range(CQ):
            order = np.argsort(-p[i], kind="stable")
            vals = p[i][order]
            before = np.cumsum(vals) - vals if exclusive else np.cumsum(vals)
            kept = (before <= top_p) | (np.arange(CK) < n_min)
            sel[i, order[kept]] = True
            if np.sum(np.bincount(ql[h], minlength=CQ)[i]) > 0:
                margin = min(margin, _numpy_cum_margin(vals, top_p, int(kept.sum()),
                                                       not exclusive))
        gq, nq = groups(ql[h], CQ)
        gk, nk = groups(kl[hk], CK)
        gsel = np.zeros((CQ, CK), bool)
        for i in range(CQ):
            for j in range(CK):
                if sel[i, j] and nq[i] and nk[j]:
                    gsel[gq[i], gk[j]] = True
        tok[h] = gsel[gq[ql[h]]][:, gk[kl[hk]]]
    return tok, ql, kl, qc, kc, margin
