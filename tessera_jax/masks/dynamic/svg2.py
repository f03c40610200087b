"""SVG2-like masks: a semantic-aware permutation by per-head k-means of q and of k (``SVG2``,
``svg2_init``, ``svg2_mask``, ``svg2_attention``; ``permute`` / ``unpermute`` move tensors in
and out of the cluster order)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tessera_jax.mask import BlockMask
from tessera_jax.masks.dynamic import common as c
from tessera_jax.masks.dynamic.clustering import kmeans
from tessera_jax.runtime.api import sparse_attention

#: Values of ``SVG2.kv_order``: the order of each key head's cluster groups.
KV_ORDERS = ("popularity", "label")


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


def _check_clusters(fn: str, name: str, C, L: int) -> int:
    C = c.check_int(fn, name, C)
    if C > L:
        raise ValueError(f"{fn}: {name}={C} exceeds the sequence length {L}: every block needs "
                         f"a token")
    if C * L >= 2 ** 31:
        raise ValueError(f"{fn}: {name} * length = {C * L} must stay below 2**31 (int32 "
                         f"arithmetic of the block layout)")
    return C


class SVG2Carry(NamedTuple):
    """The SVG2 rule's loop carry: the centroids and whether they were initialised."""

    centroids: SVG2State
    ready: jax.Array        # bool []


@dataclasses.dataclass(frozen=True)
class SVG2:
    """Sparse VideoGen2 (Yang et al., "Sparse VideoGen2: Accelerate Video Generation with Sparse
    Attention via Semantic-Aware Permutation", arXiv:2505.18875; svg-project/Sparse-VideoGen
    ``svg/kmeans_utils.py``: ``batch_kmeans_Euclid``, ``identify_dynamic_map``):

    1. k-means of each query head's tokens and of each key head's tokens (squared Euclidean),
       ``iters`` iterations warm-started from the carried centroids (SVG2: 2 per step after
       ``init_iters`` = 50 at the first, from ``q_clusters`` / ``kv_clusters`` random tokens of
       ``seed``: ``svg2_init``), no convergence test (nothing goes to the host);
    2. tokens sorted by cluster (stable), so each cluster is contiguous, per head; the key
       clusters' groups (below) ordered by ``kv_order``: "popularity" (the default: the most
       selected first, so selected runs merge into fewer tiles) or "label" (k-means label
       order); the token-level mask does not depend on it. H200, session 12 (Wan 720p SVG2
       ``iters=1``, density 0.245): attention 105.1 ms by popularity against 136.6 ms in label
       order (builder 14.9 vs 15.2 ms);
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
    default (1) is the paper's rule; ``iters=1`` is the cheaper variant of
    docs/dynamic_masks.md. ``kmeans_assign``: ``kmeans``'s ``assign`` option.

    As a rule of a ``tessera_jax.flax.DynamicSchedule``: at its first sparse step (``ready``
    False in the carry) ``svg2_init``, then at every call ``svg2_mask`` warm-started from the
    carried centroids, q / k / v permuted per head, the sparse attention, the output
    un-permuted. A frozen (hashable) dataclass.
    """

    q_clusters: int = 300
    kv_clusters: int = 1000
    init_iters: int = 50
    iters: int = 2
    top_p: float = 0.9
    min_kc_ratio: float = 0.1
    min_cluster_tokens: int = 1
    seed: int = 0
    kmeans_assign: str = "auto"
    kv_order: str = "popularity"

    def __post_init__(self):
        c.check_fields(self, {
            "q_clusters": ("int",), "kv_clusters": ("int",), "init_iters": ("int", 0),
            "iters": ("int", 0), "top_p": ("frac",), "min_kc_ratio": ("frac", {"lo_open": False}),
            "min_cluster_tokens": ("int",), "seed": ("int", -2 ** 63),
            "kmeans_assign": ("choice", c.KERNEL_CHOICES), "kv_order": ("choice", KV_ORDERS)})

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
        cent = jax.lax.cond(carry.ready, lambda: carry.centroids,
                            lambda: svg2_init(q, k, jax.random.key(self.seed), self))
        return svg2_mask(q, k, cent, self, scale=scale)

    def __call__(self, q, k, v, carry, *, scale=None, attend):
        lay = self.layout(q, k, carry, scale)
        out = attend(permute(q, lay.q_perm), permute(k, lay.kv_perm), permute(v, lay.kv_perm),
                     lay.mask)
        return unpermute(out, lay.q_perm), SVG2Carry(lay.state, jnp.ones((), bool))


def svg2_init(q, k, key, rule: SVG2 = SVG2()) -> SVG2State:
    """First centroids of ``svg2_mask``: ``rule.q_clusters`` / ``rule.kv_clusters`` distinct
    random tokens per head, then ``rule.init_iters`` k-means iterations (SVG2 on Wan 720p: 300
    query and 1000 key clusters, 50 iterations at the first sparse step; Hunyuan: 400 query
    clusters).

    ``key``: a jax PRNG key. Returns an ``SVG2State`` (jittable: ``key`` may be traced)."""
    fn = "svg2_init"
    rule = c.check_rule(fn, rule, SVG2)
    B, Lq, Lkv, Hq, Hkv, D = c.check_qk(fn, q, k)
    cq = _check_clusters(fn, "q_clusters", rule.q_clusters, Lq)
    ck = _check_clusters(fn, "kv_clusters", rule.kv_clusters, Lkv)
    kq, kk = jax.random.split(key)

    def seeds(x, C, key):
        H, L = x.shape[0], x.shape[1]
        idx = jax.vmap(lambda kh: jax.random.permutation(kh, L)[:C])(jax.random.split(key, H))
        c0 = jnp.take_along_axis(x, idx[:, :, None], axis=1, mode="clip").astype(jnp.float32)
        return kmeans(x, c0, iters=rule.init_iters, assign=rule.kmeans_assign)[1]

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
    order (``SVG2.kv_order``)."""
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
    ck = c.repeat_heads(kv_centroids, group, axis=0)
    counts = c.repeat_heads(kv_counts, group, axis=0).astype(jnp.float32)
    s = jnp.einsum("hcf,hkf->hck", q_centroids, ck, precision=c.HI) * (scale / batch)
    logw = jnp.where(counts > 0, jnp.log(jnp.maximum(counts, 1.0)), -jnp.inf)
    z = s + logw[:, None, :]
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0))
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    order, ps = c.sorted_desc(p)
    before = jnp.cumsum(ps, axis=-1) - ps
    keep = (before <= top_p) | (jnp.arange(p.shape[-1]) < n_min)
    return c.scatter_rows(order, keep)


def _label_order(n_groups, CK: int):
    """[Hkv, CK] key groups in k-means label order (group ids from 0: valid groups first)."""
    return jnp.broadcast_to(jnp.arange(CK, dtype=jnp.int32), (n_groups.shape[0], CK))


def _check_state(fn: str, state, Hq: int, Hkv: int, F: int, Lq: int, Lkv: int):
    """(CQ, CK) of a valid ``SVG2State`` for these q and k."""
    if not isinstance(state, SVG2State):
        raise TypeError(f"{fn}: state must be an SVG2State (svg2_init), got "
                        f"{type(state).__name__}")
    qc, kc = state
    for name, cent, H in (("q_centroids", qc, Hq), ("kv_centroids", kc, Hkv)):
        c.check_array(fn, f"state.{name}", cent, 3, f"[{H}, C, {F}]")
        if int(cent.shape[0]) != H or int(cent.shape[2]) != F:
            raise ValueError(f"{fn}: state.{name} has shape {tuple(cent.shape)}, expected "
                             f"[{H}, C, {F}] for these q and k")
    CQ = _check_clusters(fn, "state.q_centroids.shape[1] (query clusters)", int(qc.shape[1]),
                         Lq)
    CK = _check_clusters(fn, "state.kv_centroids.shape[1] (key clusters)", int(kc.shape[1]),
                         Lkv)
    return CQ, CK


def svg2_mask(q, k, state: SVG2State, rule: SVG2 = SVG2(), *, scale=None) -> SVG2Layout:
    """The SVG2-like mask of q [B, Lq, Hq, D] and k [B, Lkv, Hkv, D] by ``rule`` (``SVG2``: the
    knobs; ``iters`` k-means iterations from ``state``, the ``svg2_init`` or previous call's
    centroids). GQA: key clusters per key head, each query head scored against its group's key
    head. B > 1: one clustering on features concatenated over the batch (logits: the batch
    mean). ``scale``: default ``D ** -0.5``.

    Returns ``SVG2Layout(mask, q_perm, kv_perm, state)``: mask with per-head bounds [Hq, C + 1]
    (int32 jax arrays) and blocks [Hq, CQ, CK] over the permuted tokens.
    """
    fn = "svg2_mask"
    rule = c.check_rule(fn, rule, SVG2)
    B, Lq, Lkv, Hq, Hkv, D = c.check_qk(fn, q, k)
    CQ, CK = _check_state(fn, state, Hq, Hkv, B * D, Lq, Lkv)
    scale = c.check_scale(fn, scale, D)
    g, m = Hq // Hkv, rule.min_cluster_tokens

    q_lab, qc = kmeans(_features(q), state.q_centroids, iters=rule.iters,
                       assign=rule.kmeans_assign)
    k_lab, kc = kmeans(_features(k), state.kv_centroids, iters=rule.iters,
                       assign=rule.kmeans_assign)
    q_gid, q_n, q_ng = jax.vmap(lambda x: _groups(x, CQ, m))(q_lab)
    k_gid, k_n, k_ng = jax.vmap(lambda x: _groups(x, CK, m))(k_lab)
    sel = _svg2_select(qc, kc, k_n, group=g, scale=scale, batch=B, top_p=rule.top_p,
                       n_min=int(rule.min_kc_ratio * CK))
    k_gid_r, k_n_r = (c.repeat_heads(x, g, axis=0) for x in (k_gid, k_n))
    merged = jax.vmap(lambda s, gq, nq, gk, nk: _merge_groups(
        _merge_groups(s, gq, nq > 0, 0), gk, nk > 0, 1))(sel, q_gid, q_n, k_gid_r, k_n_r)
    q_order = jnp.broadcast_to(jnp.arange(CQ, dtype=jnp.int32), (Hq, CQ))
    k_order = (_kv_group_order(merged, k_ng, g) if rule.kv_order == "popularity"
               else _label_order(k_ng, CK))
    lay = jax.vmap(lambda *a: _layout(*a, m))
    q_perm, qb, q_blk = lay(q_lab, q_gid, q_n, q_ng, q_order)
    k_perm, kb, k_blk = lay(k_lab, k_gid, k_n, k_ng, k_order)
    k_blk_r = c.repeat_heads(k_blk, g, axis=0)
    blocks = jax.vmap(lambda mg, bq, bk: mg[bq[:, None], bk[None, :]])(merged, q_blk, k_blk_r)
    mask = BlockMask(qb, c.repeat_heads(kb, g, axis=0), blocks)
    return SVG2Layout(mask, q_perm, k_perm, SVG2State(qc, kc))


def _check_perm(fn: str, x, perm, xname: str):
    c.check_array(fn, "perm", perm, 2, "[H, L]")
    if not jnp.issubdtype(perm.dtype, jnp.integer):
        raise TypeError(f"{fn}: perm must hold integers, got {perm.dtype}")
    c.check_array(fn, xname, x, 4, "[B, L, H, D]")
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


def svg2_attention(q, k, v, state: SVG2State, rule: SVG2 = SVG2(), *, scale=None,
                   backend=None):
    """SVG2-like sparse attention end to end: ``svg2_mask``, permute q / k / v, run
    ``tessera_jax.sparse_attention`` on the cluster-contiguous tensors, un-permute the output.

    Returns ``(out [B, Lq, Hq, D] in q's order and dtype, new SVG2State)``: carry the state to
    the next step (a ``lax.scan`` carry). Knobs and the performance note: ``SVG2``.
    """
    c.check_array("svg2_attention", "v", v, 4, "[B, Lkv, Hkv, D]")
    lay = svg2_mask(q, k, state, rule, scale=scale)
    qp = permute(q, lay.q_perm)
    kp, vp = permute(k, lay.kv_perm), permute(v, lay.kv_perm)
    out = sparse_attention(qp, kp, vp, lay.mask, scale=scale, backend=backend)
    return unpermute(out, lay.q_perm), lay.state
