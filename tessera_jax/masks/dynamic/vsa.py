"""VSA-like masks: per-head top-k of block-pooled scores (``VSA``, ``vsa_mask``)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.masks.dynamic import common as c


def cube_layout(shape, cube=(4, 4, 4)) -> tuple[np.ndarray, np.ndarray]:
    """VSA's cube-major token order of a (T, H, W) latent grid: ``(order, bounds)``.

    ``order[p]`` is the row-major index ``(t * H + h) * W + w`` of the token at position ``p``
    (cubes in row-major cube order, row-major inside a cube); ``bounds`` are the cubes' bounds
    over that order. Edge cubes are partial (their real token counts, no padding). Permute
    with ``x[:, order]`` and give ``bounds`` to ``VSA(q_bounds=...)``; ``np.argsort(order)``
    undoes it.
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


@dataclasses.dataclass(frozen=True)
class VSA(c.Stateless):
    """VSA (Zhang et al., "VSA: Faster Video Diffusion with Trainable Sparse Attention",
    arXiv:2505.13389; FastVideo's ``video_sparse_attn``), its coarse stage: tokens in cube-major
    order, 4x4x4 cubes of 64 tokens (edge cubes partial; ``cube_layout``); q and k mean-pooled
    per cube; scores ``scale * q_i . k_j`` (the softmax of the coarse stage does not change a
    row's ranking); each query cube keeps its top-k key cubes, the same k for every row and
    head. FastVideo sets k = ceil((1 - VSA_sparsity) * cubes); the default ``keep=0.125``
    (87.5% sparsity) is issue 17's Wan2.1 setting. A frozen (hashable) dataclass: the
    configuration of ``vsa_mask`` and a rule of a ``tessera_jax.flax.DynamicSchedule``.

    Fields:
      q_bounds, kv_bounds: static block bounds (ints, [n + 1] from 0 to the length; e.g.
        ``cube_layout(...)[1]``). ``None``: ``block``-token blocks (the last one partial);
        ``kv_bounds=None`` with ``Lq == Lkv`` reuses ``q_bounds``.
      block: the block size when bounds are not given (64: one 4x4x4 cube).
      keep: fraction of key blocks kept per row, k = ceil(keep * nkv) (default 0.125); or
      topk: k itself (not both).
      local: if given (>= 0), key blocks with ``|i - j| <= local`` are always kept and count
        towards k (the rest of the row is the top of the other blocks): rows stay uniform.
        Needs nq == nkv and 2 * local + 1 <= k. Not in VSA (default None).
      top_k: how each row's top k is taken (``common.KERNEL_CHOICES``): "mosaic"
        (``pallas_kernels.mosaic.topk``: a radix select in registers, one row a warpgroup, on
        Hopper), "triton" (or "pallas": ``pallas_kernels.triton.topk``, the same in Triton,
        for Ampere/Ada), "xla" (``lax.top_k`` then a scatter) or "auto" (the default: on a
        GPU the Mosaic kernel, the Triton one before Hopper). Same kept set.
      pool: how blocks of 2-byte q and k are pooled: "mosaic" (``pallas_kernels.mosaic.pool``:
        x read once in its dtype by one TMA copy a block; H * F a multiple of 128, blocks of
        at most 256 tokens in at most 16 sizes), "triton" (or "pallas":
        ``pallas_kernels.triton.pool``, blocks of at most 256 tokens), "xla" (a padded float32
        copy gathered into equal rows and summed) or "auto" (the default: on a GPU the Mosaic
        kernel, the Triton one before Hopper; XLA where the kernel does not take the shape).
        H200, q and k at Wan 720p (session 14): Triton 0.63 ms against XLA's 1.67; the
        builder 3.56 -> 2.67 ms.
      score_precision: matmul precision of the pooled scores: "high" (the default: three bf16
        passes, ~2^-16 relative, so rows change only at near-ties; VSA itself scores in bf16)
        or "highest" (float32). H200, Wan 720p scores: 0.35 vs 0.92 ms; the builder with the
        pooling kernel 2.19 ms (4.7% of its attention) against 2.67 (session 14).
    """

    q_bounds: tuple | None = None
    kv_bounds: tuple | None = None
    block: int = 64
    keep: float | None = None
    topk: int | None = None
    local: int | None = None
    top_k: str = "auto"
    pool: str = "auto"
    score_precision: str = "high"

    def __post_init__(self):
        c.check_pooled_rule(self, {"block": ("int",), "keep": ("optional_frac",),
                                   "topk": ("optional_int",), "local": ("optional_int", 0)})
        if self.topk is not None and self.keep is not None:
            raise ValueError(f"VSA: give keep or topk, not both (topk={self.topk}, "
                             f"keep={self.keep})")

    def mask(self, q, k, scale=None) -> BlockMask:
        return vsa_mask(q, k, self, scale=scale)


def _row_k(fn, n_kv, rule: VSA) -> int:
    if rule.topk is not None:
        return c.check_int(fn, "topk", rule.topk, 1, n_kv)
    keep = 0.125 if rule.keep is None else rule.keep
    return max(1, min(n_kv, math.ceil(keep * n_kv - 1e-9)))


def _local_blocks(fn, rule: VSA, nq: int, nk: int, kk: int):
    """bool [nq, nk] of the always-kept blocks (``local``), or None."""
    if rule.local is None:
        return None
    if nq != nk:
        raise ValueError(f"{fn}: local needs as many query as key blocks, got {nq} and {nk}")
    if 2 * rule.local + 1 > kk:
        raise ValueError(f"{fn}: local={rule.local} keeps up to {2 * rule.local + 1} blocks a "
                         f"row, more than k={kk}")
    i = np.arange(nq)
    return np.abs(i[:, None] - i[None, :]) <= rule.local


def vsa_mask(q, k, rule: VSA = VSA(), *, scale=None) -> BlockMask:
    """The VSA-like mask of q [B, Lq, Hq, D] and k [B, Lkv, Hkv, D] (GQA: k's head
    ``h // (Hq // Hkv)`` scores query head ``h``) by ``rule`` (``VSA``: the knobs). Batch
    elements share the mask: scores are averaged over B. ``scale``: default ``D ** -0.5``.

    Returns ``BlockMask`` with the static bounds and traced blocks bool [Hq, nq, nkv].
    """
    fn = "vsa_mask"
    rule = c.check_rule(fn, rule, VSA)
    B, Lq, Lkv, Hq, Hkv, D = c.check_qk(fn, q, k)
    qb = c.bounds_or_uniform(fn, "q_bounds", rule.q_bounds, rule.block, Lq)
    if rule.kv_bounds is None and rule.q_bounds is not None and Lq == Lkv:
        kb = qb
    else:
        kb = c.bounds_or_uniform(fn, "kv_bounds", rule.kv_bounds, rule.block, Lkv)
    nq, nk = len(qb) - 1, len(kb) - 1
    kk = _row_k(fn, nk, rule)
    scale = c.check_scale(fn, scale, D)
    forced = _local_blocks(fn, rule, nq, nk, kk)
    if kk == nk:
        return BlockMask(qb, kb, jnp.ones((Hq, nq, nk), bool))
    pq = c.pool_mean(q, qb, rule.pool)
    pk = c.repeat_heads(c.pool_mean(k, kb, rule.pool), Hq // Hkv, axis=2)
    s = jnp.einsum("bihd,bjhd->hij", pq, pk,
                   precision=c.score_precision(rule.score_precision)) * (scale / B)
    if forced is not None:
        s = jnp.where(jnp.asarray(forced)[None], jnp.inf, s)

    def by_sort(s):
        _, idx = jax.lax.top_k(s, kk)
        return jnp.zeros((Hq, nq, nk), bool).at[
            jnp.arange(Hq)[:, None, None], jnp.arange(nq)[None, :, None], idx].set(
                True, mode="drop")

    return BlockMask(qb, kb, c.top_k_rows(s, kk, rule.top_k, by_sort))
