"""Synthetic attention scores for the dynamic mask families (docs/masks.md, "Synthetic scores").

Per head ``h``, the block-pooled logit of query block ``i`` and key block ``j`` is

    S = scale_h * (-min(sum_a ((c_i,a - c_j,a) / l_h,a)^2, CLIP) + alpha_h * <e_i, e_j>
                   + beta_h * sink_j + sigma_h * noise)

where ``c`` are block centroids in token units (t, h, w), ``l_h`` the head's length scales
(spatial heads: short in t; temporal heads: short in h and w; global heads: long everywhere),
``e`` the block-mean membership in a few moving semantic blobs (objects), ``sink`` the fraction of
a key block in frame 0, noise centred uniform with unit variance, and ``scale_h`` a softmax
temperature. Each family then applies its own selection
rule (top-k, top-p, ...) to S. Head parameters depend only on (seed, family, head), so the
first ``k`` heads of a mask do not depend on how many heads it has; ``step`` drifts the blobs,
the length scales and the noise slowly (drifting step sequences).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from tessera_jax.masks.grids import Grid

__all__ = ["HeadParams", "head_params", "BlockFeatures", "block_features", "point_features",
           "ScoreField", "rng_for"]

CLIP = 16.0          # distance term saturates at 4 length scales
NUM_BLOBS = 6


def _code(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def rng_for(seed: int, family: str, *stream) -> np.random.Generator:
    """Independent generator for (seed, family, stream...); streams are ints or strings."""
    key = [int(seed) & 0xFFFFFFFF, _code(family)]
    key += [(_code(s) if isinstance(s, str) else int(s)) for s in stream]
    return np.random.default_rng(key)


@dataclasses.dataclass(frozen=True)
class HeadParams:
    kind: str              # "spatial" | "temporal" | "global"
    ell: np.ndarray        # [3] length scales in tokens (t, h, w)
    alpha: float           # semantic weight (logits)
    beta: float            # frame-0 sink weight (logits)
    sigma: float           # noise std (logits)
    u: float               # a spare uniform draw (unused by the current families)
    scale: float           # logit scale (softmax temperature) of the head


def head_params(grid: Grid, seed: int, family: str, head: int, step: int = 0) -> HeadParams:
    """Per-head length scales and weights, drawn from (seed, family, head); ``step`` drifts them."""
    rng = rng_for(seed, family, "head", head)
    r = rng.random()
    dims = np.array(grid.shape, dtype=np.float64)
    if r < 0.4:
        kind = "spatial"
        ell = np.array([rng.uniform(0.3, 1.2), *(rng.uniform(0.06, 0.2, 2) * dims[1:])])
    elif r < 0.65:
        kind = "temporal"
        ell = np.array([rng.uniform(0.15, 0.5) * dims[0], *rng.uniform(0.8, 2.5, 2)])
    else:
        kind = "global"
        ell = rng.uniform(0.05, 0.16, 3) * dims
    alpha = rng.uniform(0.0, 8.0)
    beta = rng.uniform(0.0, 6.0) if rng.random() < 0.5 else 0.0
    sigma = rng.uniform(0.3, 1.2)
    u = rng.random()
    scale = rng.uniform(0.2, 0.6)
    z = rng.standard_normal(3)
    if step:
        ell = ell * np.exp(0.03 * step * z)
    return HeadParams(kind, np.maximum(ell, 0.3), float(alpha), float(beta), float(sigma), float(u),
                      float(scale))


@dataclasses.dataclass(frozen=True)
class BlockFeatures:
    centroid: np.ndarray   # [n, 3] float64, token units
    semantic: np.ndarray   # [n, K] float64
    sink: np.ndarray       # [n] fraction of the block's tokens in frame 0


def _blobs(grid: Grid, seed: int, family: str, step: int):
    rng = rng_for(seed, family, "blobs")
    c0 = rng.random((NUM_BLOBS, 2)) * np.array([grid.h, grid.w])
    vel = rng.normal(0.0, 0.4, (NUM_BLOBS, 2)) * np.array([grid.h, grid.w]) / max(grid.t, 1) / 4
    rad = rng.uniform(0.08, 0.3, NUM_BLOBS) * min(grid.h, grid.w) + 0.5
    if step:
        c0 = c0 + 0.02 * step * rng.normal(0.0, 1.0, (NUM_BLOBS, 2)) * np.array([grid.h, grid.w])
    return c0, vel, rad


def point_features(grid: Grid, coords: np.ndarray, seed: int, family: str, step: int = 0):
    """Semantic memberships ``[N, K]`` of points ``coords [N, 3]`` (t, h, w), unit rows."""
    c0, vel, rad = _blobs(grid, seed, family, step)
    coords = np.asarray(coords, dtype=np.float64)
    centers = c0[None] + coords[:, :1, None] * vel[None]            # [N, K, 2]
    d2 = ((coords[:, None, 1:] - centers) ** 2).sum(-1) / rad[None] ** 2
    e = np.exp(-0.5 * d2)
    e = np.concatenate([e, np.full((len(e), 1), 0.15)], axis=1)
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def block_features(grid: Grid, order: np.ndarray, bounds: np.ndarray, seed: int, family: str,
                   step: int = 0) -> BlockFeatures:
    """Centroids, mean semantics and frame-0 fractions of the blocks of a layout."""
    hw = grid.h * grid.w
    order = np.asarray(order, dtype=np.int64)
    coords = np.stack([order // hw, (order // grid.w) % grid.h, order % grid.w], axis=1)
    sem = point_features(grid, coords, seed, family, step)
    vals = np.concatenate([coords.astype(np.float64), sem, (coords[:, :1] == 0)], axis=1)
    sums = np.add.reduceat(vals, bounds[:-1], axis=0) / np.diff(bounds)[:, None]
    return BlockFeatures(sums[:, :3], sums[:, 3:-1], sums[:, -1])


class ScoreField:
    """Block logits of every head over one (query layout, key layout) pair.

    The head-independent parts (squared centroid offsets per axis, semantic affinity, a noise
    pool) are computed once; ``head(hp)`` then costs a few in-place passes. Noise: one pool of
    centred uniform noise (unit variance) ``[2 nq, nk]`` per mask; a head reads ``nq`` of its rows
    in its own random order (cheap, and independent of the number of heads). With
    ``step > 0`` the pool is cos(a) * pool_0 + sin(a) * pool_step, a = min(0.15 step, pi / 2).
    """

    def __init__(self, fq: BlockFeatures, fk: BlockFeatures, seed: int, family: str, step: int = 0):
        self.nq, self.nk = len(fq.centroid), len(fk.centroid)
        self.d2 = [np.square(fq.centroid[:, a, None].astype(np.float32)
                             - fk.centroid[None, :, a].astype(np.float32)) for a in range(3)]
        self.sem = fq.semantic.astype(np.float32) @ fk.semantic.astype(np.float32).T
        self.sink = fk.sink.astype(np.float32)
        self.seed, self.family = seed, family
        self.pool = self._pool(rng_for(seed, family, "noise"))
        if step:
            a = min(0.15 * step, np.pi / 2)
            self.pool *= np.float32(np.cos(a))
            self.pool += np.float32(np.sin(a)) * self._pool(rng_for(seed, family, "noise", step))

    def _pool(self, rng):
        u = rng.random((2 * self.nq, self.nk), dtype=np.float32)
        u -= np.float32(0.5)
        u *= np.float32(np.sqrt(12.0))
        return u

    def head(self, hp: HeadParams, head: int, extra_sigma: float = 0.0) -> np.ndarray:
        """Logits ``[nq, nk]`` float32 of one head (a fresh array; thread-safe)."""
        s = np.empty((self.nq, self.nk), np.float32)
        tmp = np.empty((self.nq, self.nk), np.float32)
        inv = (1.0 / np.square(hp.ell)).astype(np.float32)
        np.multiply(self.d2[0], inv[0], out=s)
        for a in (1, 2):
            np.multiply(self.d2[a], inv[a], out=tmp)
            s += tmp
        np.minimum(s, np.float32(CLIP), out=s)
        np.negative(s, out=s)
        if hp.alpha:
            np.multiply(self.sem, np.float32(hp.alpha), out=tmp)
            s += tmp
        if hp.beta:
            s += (np.float32(hp.beta) * self.sink)[None, :]
        sigma = np.float32(np.hypot(hp.sigma, extra_sigma))
        if sigma:
            r = rng_for(self.seed, self.family, "perm", head)
            rows = r.permutation(2 * self.nq)[:self.nq]
            np.take(self.pool, rows, axis=0, out=tmp)
            tmp *= sigma
            s += tmp
        s *= np.float32(hp.scale)
        return s
