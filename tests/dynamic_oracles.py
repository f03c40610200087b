"""NumPy references of the dynamic mask rules (``tessera_jax.masks.dynamic``), for the tests:
float64, loops, slow. Each returns what the builder computes plus a per-row *margin*: how far
the row's decision is from flipping (score gap at the kept/dropped boundary, distance of a
cumulative sum to its threshold). Float32 builders may differ from these only on rows with a
margin near 0."""

import numpy as np


def numpy_pool(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Mean over each block: [B, L, H, F] -> float64 [B, n, H, F]."""
    return np.stack([x[:, a:b].astype(np.float64).mean(axis=1)
                     for a, b in zip(bounds[:-1], bounds[1:])], axis=1)


def numpy_cum_margin(vals, thr, keep_count, inclusive):
    """Margin of a sorted-descending cumulative rule on one row: the boundary gap and the
    distance of each cumulative sum to the threshold."""
    cum = np.cumsum(vals) if inclusive else np.cumsum(vals) - vals
    mar = float(np.min(np.abs(cum - thr))) if np.isfinite(thr) else np.inf
    if 0 < keep_count < len(vals):
        mar = min(mar, float(vals[keep_count - 1] - vals[keep_count]))
    return mar


def numpy_vsa(q, k, q_bounds, kv_bounds, topk, local=None, scale=None):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, _, Hq, D = q.shape
    g = Hq // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    pq, pk = numpy_pool(q, q_bounds), np.repeat(numpy_pool(k, kv_bounds), g, axis=2)
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


def numpy_sparge(q, k, q_bounds, kv_bounds, *, cdf_threshold=0.98, topk=None,
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
    pq, pk = numpy_pool(q, q_bounds), np.repeat(numpy_pool(k, kv_bounds), g, axis=2)
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
                mar = numpy_cum_margin(vals[vals > 0], cdf_threshold, min(c, int(
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


def numpy_xattn(q, k, *, block=128, stride=8, tau=0.9, keep_diagonal=False, keep_sink=False,
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


def numpy_kmeans(x, c, iters):
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


def numpy_svg2(q, k, q_centroids, kv_centroids, *, iters=2, top_p=0.9, min_kc_ratio=0.1,
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
    ql, qc, mq = numpy_kmeans(fq, q_centroids, iters)
    kl, kc, mk = numpy_kmeans(fk, kv_centroids, iters)
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
                margin = min(margin, numpy_cum_margin(vals, top_p, int(kept.sum()),
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
