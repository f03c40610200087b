"""SpargeAttn-like masks: block-pooled scores, a per-row cumulative-probability threshold and a
self-similarity judgment (``Sparge``, ``sparge_mask``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.masks.dynamic import common as c


@dataclasses.dataclass(frozen=True)
class Sparge(c.Stateless):
    """SpargeAttn (Zhang et al., "SpargeAttn: Accurate Sparse Attention Accelerating Any Model
    Inference", ICML 2025, arXiv:2502.18137; thu-ml/SpargeAttn ``get_block_map_meansim``):

    1. blocks of ``block_q`` = 128 queries and ``block_kv`` = 64 keys, mean-pooled (or the
       static ``q_bounds`` / ``kv_bounds``, tuples of ints from 0 to the length);
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

    SpargeAttn tunes ``cdf_threshold`` and ``sim_threshold`` per head; these are scalars.
    ``top_k``, ``pool``, ``score_precision``: as ``VSA``'s (``top_k`` serves the ``topk``
    mode). A frozen (hashable) dataclass: the configuration of ``sparge_mask`` and a rule of a
    ``tessera_jax.flax.DynamicSchedule``.
    """

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
    top_k: str = "auto"
    pool: str = "auto"
    score_precision: str = "high"

    def __post_init__(self):
        c.check_pooled_rule(self, {"block_q": ("int",), "block_kv": ("int",),
                                   "topk": ("optional_frac",), "min_keep": ("int",),
                                   "smooth_k": ("bool",), "sink": ("bool",)})
        if self.topk is None:
            object.__setattr__(self, "cdf_threshold",
                               c.check_frac("Sparge", "cdf_threshold", self.cdf_threshold))
        t = self.sim_threshold
        if isinstance(t, (bool, np.bool_)) or not isinstance(
                t, (int, float, np.integer, np.floating)):
            raise TypeError(f"Sparge: sim_threshold must be a number, got {type(t).__name__}")
        if not -1.0 <= float(t) <= 1.0:
            raise ValueError(f"Sparge: sim_threshold must be in [-1, 1] (a cosine), got {t}")

    def mask(self, q, k, scale=None) -> BlockMask:
        return sparge_mask(q, k, self, scale=scale)


def _self_similarity(x, bounds: np.ndarray):
    """Mean pairwise cosine similarity of the tokens of each block (self-pairs included), per
    batch element and head: ||sum of unit vectors||^2 / n^2, [B, n, H]. Zero vectors count
    as 0."""
    x = x.astype(jnp.float32)
    nrm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    u = jnp.where(nrm > 0, x / jnp.where(nrm > 0, nrm, 1.0), 0.0)
    s = c.pool_sum(u, bounds)
    n = jnp.asarray(np.diff(bounds), jnp.float32)
    return jnp.sum(s * s, axis=-1) / (n * n)[None, :, None]


def _block_probs(q, k, qb, kb, rule: Sparge, scale: float, g: int):
    """(p [Hq, nq, nk]: each row's softmax over its self-similar key blocks, sim_q [Hq, nq],
    sim_k [Hq, nk]: the self-similarity judgments; batch: logits averaged, a block
    self-similar only if it is in every element)."""
    B, Lkv = q.shape[0], k.shape[1]
    pq = c.pool_mean(q, qb, rule.pool)                                 # [B, nq, Hq, D]
    ksum = c.pool_sum(k, kb, rule.pool)                                # [B, nk, Hkv, D]
    pk = ksum / jnp.asarray(np.diff(kb), jnp.float32)[None, :, None, None]
    kc = k.astype(jnp.float32)
    if rule.smooth_k:
        kc = kc - (ksum.sum(axis=1, keepdims=True) / Lkv)
    sim_q = jnp.min(_self_similarity(q, qb), axis=0) > rule.sim_threshold   # [nq, Hq]
    sim_k = jnp.min(_self_similarity(kc, kb), axis=0) > rule.sim_threshold  # [nk, Hkv]
    sim_k = c.repeat_heads(sim_k, g, axis=1).T                              # [Hq, nk]
    sim_q = sim_q.T                                                         # [Hq, nq]

    s = jnp.einsum("bihd,bjhd->hij", pq, c.repeat_heads(pk, g, axis=2),
                   precision=c.score_precision(rule.score_precision))
    s = jnp.where(sim_k[:, None, :], s * (scale / B), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(sim_k[:, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    tot = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(tot > 0, tot, 1.0), sim_q, sim_k


def sparge_mask(q, k, rule: Sparge = Sparge(), *, scale=None) -> BlockMask:
    """The SpargeAttn-like mask of q [B, Lq, Hq, D] and k [B, Lkv, Hkv, D] by ``rule``
    (``Sparge``: the knobs). ``scale``: default ``D ** -0.5``.

    Returns ``BlockMask`` with static bounds and traced blocks bool [Hq, nq, nkv].
    """
    fn = "sparge_mask"
    rule = c.check_rule(fn, rule, Sparge)
    B, Lq, Lkv, Hq, Hkv, D = c.check_qk(fn, q, k)
    qb = c.bounds_or_uniform(fn, "q_bounds", rule.q_bounds, rule.block_q, Lq)
    kb = c.bounds_or_uniform(fn, "kv_bounds", rule.kv_bounds, rule.block_kv, Lkv)
    nk = len(kb) - 1
    min_keep = c.check_int(fn, "min_keep", rule.min_keep, 1, nk)
    scale = c.check_scale(fn, scale, D)
    p, sim_q, sim_k = _block_probs(q, k, qb, kb, rule, scale, Hq // Hkv)
    kk = None if rule.topk is None else max(1, int(rule.topk * nk))

    def by_sort(p):
        order, ps = c.sorted_desc(p)
        r = jnp.arange(nk)
        if kk is None:
            keep_sorted = (jnp.cumsum(ps, axis=-1) <= rule.cdf_threshold) | (r < min_keep)
        else:
            keep_sorted = jnp.broadcast_to(r < kk, ps.shape)
        return c.scatter_rows(order, keep_sorted)

    if kk is None or kk == nk:
        blocks = by_sort(p)
    else:                                 # the first kk of the stable descending sort
        blocks = c.top_k_rows(p, kk, rule.top_k, by_sort)
    blocks = blocks | ~sim_k[:, None, :] | ~sim_q[:, :, None]
    if rule.sink:
        blocks = blocks.at[:, :, 0].set(True)
    return BlockMask(qb, kb, blocks)
