"""Token grids of video DiTs and the logical block layouts that sparse-attention methods use.

A layout fixes two things: the order of the video tokens in the sequence (``order``: the
row-major flat index ``(t * H + h) * W + w`` of the token at each position) and the logical
block boundaries over that order. Video tokens always come first; joint text tokens (HunyuanVideo)
are appended after them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "Grid", "GRIDS", "CORPUS_GRIDS", "get_grid", "Layout", "row_major", "uniform_layout",
    "frame_layout", "tile_layout", "hilbert_layout", "cluster_layout", "uniform_bounds",
    "token_coords", "block_centroids", "hilbert_index_3d", "tile_grid",
]


@dataclasses.dataclass(frozen=True)
class Grid:
    """A latent video token grid ``(t, h, w)`` with the model's head count and joint text.

    ``text_max`` > 0 means the model runs joint attention with up to that many text tokens
    appended after the video (HunyuanVideo-1.5); 0 means text enters through cross-attention
    (Wan), whose key length is ``cross_text``.
    """

    name: str
    t: int
    h: int
    w: int
    heads: int
    text_max: int = 0
    cross_text: int = 0
    model: str = "test"

    def __post_init__(self):
        for f in ("t", "h", "w", "heads"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"Grid.{f} must be a positive int, got {v!r}")
        if self.text_max < 0 or self.cross_text < 0:
            raise ValueError("Grid.text_max and Grid.cross_text must be >= 0")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.t, self.h, self.w)

    @property
    def tokens_per_frame(self) -> int:
        return self.h * self.w

    @property
    def video_tokens(self) -> int:
        return self.t * self.h * self.w

    @property
    def joint(self) -> bool:
        return self.text_max > 0


GRIDS: dict[str, Grid] = {g.name: g for g in (
    # Wan2.1 (text by cross-attention: 512 umT5 tokens).
    Grid("wan720", 21, 45, 80, 40, 0, 512, "wan"),
    Grid("wan480", 21, 30, 52, 40, 0, 512, "wan"),
    Grid("wan720_49f", 13, 45, 80, 40, 0, 512, "wan"),
    # HunyuanVideo-1.5 (joint attention, <= 1000 + 256 + 729 text/vision tokens appended).
    Grid("hy720", 31, 45, 80, 16, 1985, 0, "hunyuan"),
    Grid("hy480", 31, 30, 53, 16, 1985, 0, "hunyuan"),
    Grid("hy720_1x1", 31, 60, 60, 16, 1985, 0, "hunyuan"),
    # Token-level masks at L = 4,096 (16 x 16 x 16; the corpus's "tokens" family: 1-token blocks).
    Grid("tok4096", 16, 16, 16, 12, 0, 0, "tokens"),
    # Small grids for CPU tests (not in the corpus).
    Grid("tiny", 5, 6, 8, 2, 0, 24, "test"),
    Grid("small", 9, 12, 16, 4, 0, 64, "test"),
    Grid("small_text", 7, 10, 12, 3, 600, 0, "test"),
)}

#: Grids of the corpus: the four main grids, the two variants, then the token-level grid (only
#: the "tokens" family, with ``wan480``).
CORPUS_GRIDS = ("wan720", "wan480", "hy720", "hy480", "hy720_1x1", "wan720_49f", "tok4096")


def get_grid(grid) -> Grid:
    """A ``Grid`` by name (see ``GRIDS``), or the ``Grid`` itself."""
    if isinstance(grid, Grid):
        return grid
    if not isinstance(grid, str):
        raise TypeError(f"grid must be a grid name or a Grid, got {type(grid).__name__}")
    if grid not in GRIDS:
        raise ValueError(f"grid {grid!r} is unknown; known grids: {sorted(GRIDS)}")
    return GRIDS[grid]


class Layout(NamedTuple):
    """Video token order (row-major flat index per sequence position) and block bounds."""

    order: np.ndarray
    bounds: np.ndarray


def uniform_bounds(length: int, block: int) -> np.ndarray:
    """Blocks of ``block`` tokens; the last one may be partial."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return np.append(np.arange(0, length, block, dtype=np.int64), np.int64(length))


def row_major(grid: Grid) -> np.ndarray:
    return np.arange(grid.video_tokens, dtype=np.int64)


def uniform_layout(grid: Grid, block: int) -> Layout:
    """Row-major tokens, blocks of ``block`` tokens (blocks straddle frames)."""
    return Layout(row_major(grid), uniform_bounds(grid.video_tokens, block))


def frame_layout(grid: Grid, block: int) -> Layout:
    """Row-major tokens; each frame is cut into ``block``-token blocks plus a remainder block.

    Wan 720p at 128: 28 x 128 + 16 tokens per frame (3,600 = 28 * 128 + 16).
    """
    tpf = grid.tokens_per_frame
    per = uniform_bounds(tpf, block)[:-1]
    starts = (np.arange(grid.t, dtype=np.int64)[:, None] * tpf + per[None, :]).ravel()
    return Layout(row_major(grid), np.append(starts, np.int64(grid.video_tokens)))


def tile_layout(grid: Grid, tile: tuple[int, int, int]) -> Layout:
    """Tile-major order: tiles of ``tile = (tt, th, tw)`` tokens in row-major tile order, the
    tokens of one tile row-major inside it. One block per tile; edge tiles are partial (real
    token counts, no padding), so blocks have variable sizes when the grid is not a multiple.
    """
    tt, th, tw = (int(x) for x in tile)
    if min(tt, th, tw) < 1:
        raise ValueError(f"tile must hold three positive ints, got {tile}")
    T, H, W = grid.shape
    t, h, w = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    key = (((t // tt) * (-(-H // th)) + h // th) * (-(-W // tw)) + w // tw).ravel()
    order = np.argsort(key, kind="stable").astype(np.int64)
    counts = np.bincount(key)
    return Layout(order, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def tile_grid(grid: Grid, tile: tuple[int, int, int]) -> tuple[int, int, int]:
    """Number of tiles per axis (edge tiles included)."""
    return tuple(-(-n // t) for n, t in zip(grid.shape, tile))  # type: ignore[return-value]


def hilbert_index_3d(coords: np.ndarray, bits: int) -> np.ndarray:
    """Hilbert-curve index of integer points ``[N, 3]`` in ``[0, 2**bits)^3`` (Skilling 2004)."""
    X = [np.asarray(coords[:, i], dtype=np.int64).copy() for i in range(3)]
    M = 1 << (bits - 1)
    Q = M
    while Q > 1:
        P = Q - 1
        for i in range(3):
            hit = (X[i] & Q) != 0
            X[0] = np.where(hit, X[0] ^ P, X[0])
            t = np.where(hit, 0, (X[0] ^ X[i]) & P)
            X[0] = X[0] ^ t
            if i:
                X[i] = X[i] ^ t
        Q >>= 1
    for i in range(1, 3):
        X[i] = X[i] ^ X[i - 1]
    t = np.zeros_like(X[0])
    Q = M
    while Q > 1:
        t = np.where((X[2] & Q) != 0, t ^ (Q - 1), t)
        Q >>= 1
    X = [x ^ t for x in X]
    idx = np.zeros_like(X[0])
    for b in range(bits - 1, -1, -1):
        for i in range(3):
            idx = (idx << 1) | ((X[i] >> b) & 1)
    return idx


def hilbert_layout(grid: Grid, block: int) -> Layout:
    """Tokens sorted along a 3D Hilbert curve (over the enclosing power-of-two cube), cut into
    ``block``-token blocks (Jenga)."""
    bits = max(1, math.ceil(math.log2(max(grid.shape))))
    coords = token_coords(grid, row_major(grid))
    order = np.argsort(hilbert_index_3d(coords, bits), kind="stable").astype(np.int64)
    return Layout(order, uniform_bounds(grid.video_tokens, block))


def cluster_layout(grid: Grid, sizes: np.ndarray) -> np.ndarray:
    """Bounds of contiguous clusters of the given sizes (tokens assumed permuted by cluster)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.sum() != grid.video_tokens or np.any(sizes < 1):
        raise ValueError("cluster sizes must be >= 1 and sum to the video token count")
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def token_coords(grid: Grid, order: np.ndarray) -> np.ndarray:
    """``(t, h, w)`` of each sequence position, int64 ``[L, 3]``."""
    order = np.asarray(order, dtype=np.int64)
    hw = grid.h * grid.w
    return np.stack([order // hw, (order // grid.w) % grid.h, order % grid.w], axis=1)


def block_centroids(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Mean of ``values [L, C]`` over each block, float64 ``[n, C]``."""
    sums = np.add.reduceat(np.asarray(values, dtype=np.float64), bounds[:-1], axis=0)
    return sums / np.diff(bounds)[:, None]
