"""Exact conversions of a ``tessera_jax.BlockMask`` to the inputs of the peer libraries (NumPy only).

Each converter returns a frozen dataclass of NumPy arrays (or a ``str`` saying why the peer can't
take the mask), and each has a ``*_token_mask`` twin that rebuilds, from those arrays alone and
with the peer's own semantics, the token-level mask the peer would compute. The tests compare
that with ``mask.token_mask()``: a conversion is only used if the two are equal.

- FlashInfer ``BlockSparseAttentionWrapper`` (BSR): one ``R x C`` block grid shared by all heads;
  the last query block may be short (``qo_indptr[-1] = M``), K/V are viewed as pages of ``C``
  keys, so ``Lkv`` is padded up to ``N = NB * C`` and the padded keys must never be selected.
- FlashInfer ``VariableBlockSparseAttentionWrapper``: variable block sizes, one pattern per *KV*
  head (query head ``h`` uses pattern ``h // (Hq / H_fi)``). A per-query-head mask whose heads
  differ inside a GQA group can't be expressed that way; then K/V are repeated to ``Hq`` heads
  (``kv_repeat = Hq / Hkv``) so that every query head has its own pattern: same function, more
  K/V memory.
- torch FlexAttention ``BlockMask``: fixed ``(Bq, Bkv)`` tiles over sequences padded to a
  multiple of the tile; a tile whose tokens are all selected is "full" (no ``mask_mod``), one with
  some selected tokens is "partial" and needs the token-level ``mask_mod``
  ``blocks[h, q_block_id[q], kv_block_id[kv]]`` (padded tokens map to an unselected sentinel).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

__all__ = ["FIBsr", "FIVar", "FlexBlocks", "fi_bsr", "fi_bsr_layout", "fi_bsr_from_shared",
           "fi_bsr_token_mask", "fi_var", "flex_static_torch", "mask_variants", "VARIANT_KINDS",
           "fi_var_token_mask", "flex_blocks", "flex_blocks_torch", "flex_token_mask", "flex_best_block",
           "FLEX_BLOCK_CANDIDATES", "is_uniform", "shared_blocks", "row_subset_mask", "check_rows"]

#: FlexAttention tile shapes tried, largest first (its default is 128 x 128).
FLEX_BLOCK_CANDIDATES: tuple[tuple[int, int], ...] = ((128, 128), (128, 64), (64, 128), (64, 64))


def _check_mask(mask) -> None:
    from tessera_jax.mask import BlockMask
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a tessera_jax.BlockMask, got {type(mask).__name__}")


def _check_heads(mask, num_q_heads: int, num_kv_heads: int) -> tuple[int, int]:
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if mask.num_heads not in (1, num_q_heads):
        raise ValueError(f"mask has {mask.num_heads} heads; it must have 1 or num_q_heads={num_q_heads}")
    return int(num_q_heads), int(num_kv_heads)


def shared_blocks(mask) -> np.ndarray | None:
    """The one ``[nq, nkv]`` pattern if every head has the same blocks, else None."""
    b = mask.blocks
    if b.shape[0] == 1 or bool(np.all(b == b[:1])):
        return b[0]
    return None


def is_uniform(sizes: np.ndarray) -> int | None:
    """The block size if all blocks have it except a shorter last one, else None."""
    sizes = np.asarray(sizes)
    s = int(sizes[0])
    if np.all(sizes[:-1] == s) and int(sizes[-1]) <= s:
        return s
    return None


# --------------------------------------------------------------------------------------------
# FlashInfer BSR (BlockSparseAttentionWrapper)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FIBsr:
    """Inputs of ``BlockSparseAttentionWrapper.plan``; K/V are zero-padded from ``Lkv`` to ``N``."""

    indptr: np.ndarray      # int32 [MB + 1]
    indices: np.ndarray     # int32 [nnz]
    M: int                  # = Lq
    N: int                  # padded key length, NB * C
    R: int
    C: int
    Lkv: int                # real key length

    @property
    def nnz(self) -> int:
        return int(self.indices.size)


def fi_bsr_layout(mask) -> dict | str:
    """The static part of a BSR conversion: ``R``, ``C``, ``M``, ``N``, ``Lkv`` from the bounds
    alone (a content-dependent method knows them before its mask exists), or why the bounds
    can't be one ``R x C`` grid."""
    _check_mask(mask)
    R, C = is_uniform(mask.q_sizes), is_uniform(mask.kv_sizes)
    if R is None or C is None:
        return "variable block sizes: BSR needs one R x C block grid"
    NB = mask.blocks.shape[2]
    return {"R": R, "C": C, "M": mask.Lq, "N": NB * C, "Lkv": mask.Lkv}


def fi_bsr_from_shared(shared: np.ndarray, layout: dict) -> FIBsr | str:
    """BSR inputs of one shared ``[nq, nkv]`` pattern on the grid of ``fi_bsr_layout``, or why
    not (a selected short last KV block)."""
    R, C, N, Lkv = layout["R"], layout["C"], layout["N"], layout["Lkv"]
    if Lkv % C and shared[:, -1].any():
        return ("short last KV block is selected: BSR pages K/V by C keys (needs an in-block "
                "mask, the custom-mask fa2 path)")
    counts = shared.sum(axis=1)
    indptr = np.zeros(shared.shape[0] + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.nonzero(shared)[1]                       # row-major: grouped by row, sorted
    return FIBsr(indptr=indptr.astype(np.int32), indices=indices.astype(np.int32),
                 M=layout["M"], N=N, R=R, C=C, Lkv=Lkv)


def fi_bsr(mask) -> FIBsr | str:
    """BSR inputs for a mask with uniform blocks shared by all heads, or why it can't be one."""
    _check_mask(mask)
    shared = shared_blocks(mask)
    if shared is None:
        return "per-head mask: the BSR pattern is shared by all heads"
    layout = fi_bsr_layout(mask)
    if isinstance(layout, str):
        return layout
    return fi_bsr_from_shared(shared, layout)


def fi_bsr_token_mask(b: FIBsr) -> np.ndarray:
    """Token mask ``[M, N]`` (padded keys included) that FlashInfer computes for these inputs."""
    MB = b.indptr.size - 1
    NB = b.N // b.C
    blk = np.zeros((MB, NB), bool)
    rows = np.repeat(np.arange(MB), np.diff(b.indptr))
    blk[rows, b.indices] = True
    # qo_indptr = R * arange(MB + 1) with qo_indptr[-1] = M: the last row block is short.
    row_sizes = np.full(MB, b.R)
    row_sizes[-1] = b.M - b.R * (MB - 1)
    return np.repeat(np.repeat(blk, row_sizes, axis=0), b.C, axis=1)


# --------------------------------------------------------------------------------------------
# FlashInfer variable blocks (VariableBlockSparseAttentionWrapper)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FIVar:
    """Inputs of ``VariableBlockSparseAttentionWrapper.plan`` (one pattern per FlashInfer KV head)."""

    block_mask_map: np.ndarray   # bool [H_fi, MB, NB]
    block_row_sz: np.ndarray     # int32 [H_fi, MB]
    block_col_sz: np.ndarray     # int32 [H_fi, NB]
    num_qo_heads: int
    num_kv_heads: int            # H_fi: what FlashInfer is told (Hkv, or Hq when kv_repeat > 1)
    kv_repeat: int               # K/V heads are repeated this many times (1: native GQA)


def fi_var(mask, num_q_heads: int, num_kv_heads: int) -> FIVar:
    """Variable-block inputs; K/V heads are repeated when a GQA group's heads differ."""
    _check_mask(mask)
    Hq, Hkv = _check_heads(mask, num_q_heads, num_kv_heads)
    g = Hq // Hkv
    shared = shared_blocks(mask)
    if shared is not None:
        bmap, h_fi, rep = np.broadcast_to(shared, (Hkv,) + shared.shape), Hkv, 1
    else:
        b = mask.blocks                                           # [Hq, nq, nkv]
        grouped = b.reshape(Hkv, g, *b.shape[1:])
        if bool(np.all(grouped == grouped[:, :1])):
            bmap, h_fi, rep = grouped[:, 0], Hkv, 1
        else:
            bmap, h_fi, rep = b, Hq, g
    rows = np.broadcast_to(mask.q_sizes.astype(np.int32), (h_fi, mask.q_sizes.size))
    cols = np.broadcast_to(mask.kv_sizes.astype(np.int32), (h_fi, mask.kv_sizes.size))
    return FIVar(block_mask_map=np.array(bmap, order="C"), block_row_sz=np.array(rows, order="C"),
                 block_col_sz=np.array(cols, order="C"), num_qo_heads=Hq, num_kv_heads=h_fi,
                 kv_repeat=rep)


def fi_var_token_mask(v: FIVar) -> np.ndarray:
    """Token mask ``[Hq, Lq, Lkv]`` that FlashInfer computes: query head h uses pattern h // g."""
    g = v.num_qo_heads // v.num_kv_heads
    out = []
    for h in range(v.num_qo_heads):
        hk = h // g
        t = np.repeat(v.block_mask_map[hk], v.block_row_sz[hk], axis=0)
        out.append(np.repeat(t, v.block_col_sz[hk], axis=1))
    return np.stack(out)


# --------------------------------------------------------------------------------------------
# torch FlexAttention BlockMask
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlexBlocks:
    """Inputs of ``BlockMask.from_kv_blocks`` (batch dim left out) and of the token ``mask_mod``."""

    block: tuple[int, int]
    Lq: int
    Lkv: int
    Lq_pad: int
    Lkv_pad: int
    kv_num_blocks: np.ndarray        # int32 [H_f, nQB]       partial tiles (need mask_mod)
    kv_indices: np.ndarray           # int32 [H_f, nQB, nKB]
    full_kv_num_blocks: np.ndarray   # int32 [H_f, nQB]       fully selected tiles
    full_kv_indices: np.ndarray      # int32 [H_f, nQB, nKB]
    q_block_id: np.ndarray           # int32 [Lq_pad]  logical q block of each row (nq: padding)
    kv_block_id: np.ndarray          # int32 [Lkv_pad] logical kv block of each key (nkv: padding)
    blocks_padded: np.ndarray        # bool [H_f, nq + 1, nkv + 1]; the sentinel row/col is False

    @property
    def needs_mask_mod(self) -> bool:
        return bool(self.kv_num_blocks.any())

    @property
    def num_partial(self) -> int:
        return int(self.kv_num_blocks.sum())

    @property
    def num_full(self) -> int:
        return int(self.full_kv_num_blocks.sum())


def _tile_segments(bounds: np.ndarray, length_pad: int, tile: int):
    """Refines logical bounds by tile bounds: (segment block id, length, tile start indices)."""
    n = bounds.size - 1
    tiles = np.arange(0, length_pad + 1, tile)
    pts = np.union1d(np.append(bounds, length_pad), tiles)
    starts, lens = pts[:-1], np.diff(pts)
    blk = np.searchsorted(bounds, starts, side="right") - 1
    blk = np.where(starts >= bounds[-1], n, blk)               # padding -> sentinel block n
    tile_start_idx = np.searchsorted(starts, tiles[:-1])
    return blk, lens, tile_start_idx


def flex_blocks(mask, block: Sequence[int] = (128, 128), pad_to: int | None = None) -> FlexBlocks:
    """Flex tiles of ``block`` over sequences padded to a multiple of ``pad_to`` (default: block).

    Counts selected tokens per tile without building the token mask (segment sums), so it stays
    cheap at 75k tokens and 40 heads.
    """
    _check_mask(mask)
    Bq, Bkv = (int(x) for x in block)
    if Bq < 16 or Bkv < 16 or Bq % 16 or Bkv % 16:
        raise ValueError(f"block must be two multiples of 16, got {tuple(block)}")
    pq = pad_to or Bq
    pk = pad_to or Bkv
    if pq % Bq or pk % Bkv:
        raise ValueError(f"pad_to={pad_to} must be a multiple of the block {tuple(block)}")
    Lq_pad = -(-mask.Lq // pq) * pq
    Lkv_pad = -(-mask.Lkv // pk) * pk
    nq, nkv = mask.blocks.shape[1:]
    bp = np.zeros((mask.num_heads, nq + 1, nkv + 1), bool)
    bp[:, :nq, :nkv] = mask.blocks
    qblk, qlen, qtiles = _tile_segments(mask.q_bounds, Lq_pad, Bq)
    kblk, klen, ktiles = _tile_segments(mask.kv_bounds, Lkv_pad, Bkv)
    # counts[h, a, b] = sum over segments (qs in tile a, ks in tile b) qlen * klen * bp[h, .., ..]
    # int32 is enough: a tile holds at most Bq * Bkv tokens
    x = bp[:, :, kblk].astype(np.int32) * klen.astype(np.int32)                  # [H, nq+1, nsk]
    x = np.add.reduceat(x, ktiles, axis=2)                                       # [H, nq+1, nKB]
    x = x[:, qblk, :] * qlen.astype(np.int32)[None, :, None]                     # [H, nsq, nKB]
    counts = np.add.reduceat(x, qtiles, axis=1)                                  # [H, nQB, nKB]
    full = counts == Bq * Bkv
    partial = (counts > 0) & ~full
    nKB = counts.shape[2]

    def pack(sel):
        """(count, indices first then 0s) per tile row; O(selected) scatter, no sort."""
        num = sel.sum(axis=2, dtype=np.int32)
        h, a, b = np.nonzero(sel)                      # row-major: b ascending in each row
        starts = np.cumsum(num.ravel()) - num.ravel()
        pos = np.arange(b.size) - np.repeat(starts, num.ravel())
        idx = np.zeros(sel.shape, np.int32)
        idx[h, a, pos] = b
        return num, idx

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)
    q_id = np.repeat(np.arange(nq + 1, dtype=np.int32),
                     np.append(mask.q_sizes, Lq_pad - mask.Lq))
    kv_id = np.repeat(np.arange(nkv + 1, dtype=np.int32),
                      np.append(mask.kv_sizes, Lkv_pad - mask.Lkv))
    return FlexBlocks(block=(Bq, Bkv), Lq=mask.Lq, Lkv=mask.Lkv, Lq_pad=Lq_pad, Lkv_pad=Lkv_pad,
                      kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
                      full_kv_indices=full_idx, q_block_id=q_id, kv_block_id=kv_id,
                      blocks_padded=bp)


def flex_static_torch(mask, block: Sequence[int] = (128, 128), pad_to: int | None = None,
                      device="cuda") -> dict:
    """The part of ``flex_blocks_torch`` that depends on the bounds, the shapes and the tile
    alone, as tensors on ``device`` (a content-dependent method has them before its mask
    exists): pass it back as ``static=`` so a request converts only the blocks."""
    import torch
    _check_mask(mask)
    Bq, Bkv = (int(x) for x in block)
    pq, pk = pad_to or Bq, pad_to or Bkv
    if Bq < 16 or Bkv < 16 or Bq % 16 or Bkv % 16 or pq % Bq or pk % Bkv:
        raise ValueError(f"bad block {tuple(block)} / pad_to {pad_to}")
    Lq_pad = -(-mask.Lq // pq) * pq
    Lkv_pad = -(-mask.Lkv // pk) * pk
    H, nq, nkv = mask.blocks.shape
    qblk, qlen, qtiles = _tile_segments(mask.q_bounds, Lq_pad, Bq)
    kblk, klen, ktiles = _tile_segments(mask.kv_bounds, Lkv_pad, Bkv)
    t = lambda a, dt=torch.int64: torch.as_tensor(np.array(a, order="C"), dtype=dt, device=device)  # noqa: E731

    def seg(starts, size):
        """Index tensors of a segment sum over runs starting at ``starts`` (reduceat): the
        run ends, and the positions whose inclusive prefix sum is subtracted (runs > 0)."""
        nz = np.nonzero(starts > 0)[0]
        return {"ends": t(np.append(starts[1:], size) - 1), "nz": t(nz) if nz.size else None,
                "before": t(starts[nz] - 1) if nz.size else None}

    return {"key": (tuple(mask.blocks.shape), mask.Lq, mask.Lkv, (Bq, Bkv), pad_to, str(device)),
            "shape": (H, nq, nkv), "block": (Bq, Bkv), "Lq_pad": Lq_pad, "Lkv_pad": Lkv_pad,
            "kblk": t(kblk), "klen": t(klen, torch.int32), "kseg": seg(ktiles, kblk.size),
            "qblk": t(qblk), "qlen": t(qlen, torch.int32)[None, :, None],
            "qseg": seg(qtiles, qblk.size),
            "q_id": torch.repeat_interleave(torch.arange(nq + 1, dtype=torch.int32, device=device),
                                            t(np.append(mask.q_sizes, Lq_pad - mask.Lq))),
            "kv_id": torch.repeat_interleave(torch.arange(nkv + 1, dtype=torch.int32, device=device),
                                             t(np.append(mask.kv_sizes, Lkv_pad - mask.Lkv)))}


def flex_blocks_torch(mask, block: Sequence[int] = (128, 128), pad_to: int | None = None,
                      device="cuda", blocks_dev=None, static: dict | None = None) -> dict:
    """``flex_blocks`` computed with torch on ``device`` (the GPU conversion the benchmark times).

    Returns the tensors of ``BlockMask.from_kv_blocks`` (batch dim included) and of the mask_mod:
    ``kv_num_blocks``, ``kv_indices``, ``full_kv_num_blocks``, ``full_kv_indices`` (int32
    ``[1, H_f, nQB(, nKB)]``; index entries past the count are unspecified, as Flex allows),
    ``q_block_id``, ``kv_block_id``, ``blocks_padded`` (bool ``[H_f, nq + 1, nkv + 1]``), and
    ``block``, ``Lq_pad``, ``Lkv_pad``. ``blocks_dev``: the mask's blocks already on ``device``
    (a bool tensor of the mask's shape, e.g. a new mask computed there). ``static``: the
    ``flex_static_torch`` of the same mask shapes, bounds, block and pad (None: made here).
    """
    import torch
    if static is None:
        static = flex_static_torch(mask, block, pad_to, device)
    elif static["key"] != (tuple(mask.blocks.shape), mask.Lq, mask.Lkv,
                           tuple(int(x) for x in block), pad_to, str(device)):
        raise ValueError("static= was made for another mask shape, block, pad or device")
    H, nq, nkv = static["shape"]
    Bq, Bkv = static["block"]
    b = blocks_dev if blocks_dev is not None else \
        torch.as_tensor(np.array(mask.blocks, order="C"), dtype=torch.bool, device=device)
    if tuple(b.shape) != (H, nq, nkv) or b.dtype != torch.bool:
        raise ValueError(f"blocks_dev must be bool {(H, nq, nkv)}, got {b.dtype} {tuple(b.shape)}")
    bp = torch.zeros((H, nq + 1, nkv + 1), dtype=torch.bool, device=device)
    bp[:, :nq, :nkv] = b

    def seg_sum(x, seg, dim):
        """Sums of consecutive runs of ``x`` along ``dim`` (reduceat; runs from ``seg``)."""
        cs = torch.cumsum(x, dim=dim, dtype=torch.int32)
        hi = cs.index_select(dim, seg["ends"])
        lo = torch.zeros_like(hi)
        if seg["nz"] is not None:
            lo.index_copy_(dim, seg["nz"], cs.index_select(dim, seg["before"]))
        return hi - lo

    x = bp.index_select(2, static["kblk"]).to(torch.int32) * static["klen"]          # [H, nq+1, nsk]
    x = seg_sum(x, static["kseg"], 2)                                                  # [H, nq+1, nKB]
    x = x.index_select(1, static["qblk"]) * static["qlen"]                             # [H, nsq, nKB]
    counts = seg_sum(x, static["qseg"], 1)                                             # [H, nQB, nKB]
    full = counts == Bq * Bkv
    partial = (counts > 0) & ~full

    def pack(sel):
        num = sel.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None], idx[None]

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)
    return {"kv_num_blocks": kv_num, "kv_indices": kv_idx, "full_kv_num_blocks": full_num,
            "full_kv_indices": full_idx, "q_block_id": static["q_id"],
            "kv_block_id": static["kv_id"], "blocks_padded": bp, "block": (Bq, Bkv),
            "Lq_pad": static["Lq_pad"], "Lkv_pad": static["Lkv_pad"]}


def flex_token_mask(fb: FlexBlocks) -> np.ndarray:
    """Token mask ``[H_f, Lq_pad, Lkv_pad]`` FlexAttention computes: full tiles all selected,
    partial tiles through the mask_mod, other tiles skipped."""
    Bq, Bkv = fb.block
    H, nQB = fb.kv_num_blocks.shape
    nKB = fb.kv_indices.shape[2]
    kinds = np.zeros((H, nQB, nKB), np.int8)                 # 0 skip, 1 partial, 2 full
    for num, idx, val in ((fb.kv_num_blocks, fb.kv_indices, 1),
                          (fb.full_kv_num_blocks, fb.full_kv_indices, 2)):
        for h in range(H):
            for a in range(nQB):
                kinds[h, a, idx[h, a, :num[h, a]]] = val
    tiles = np.repeat(np.repeat(kinds, Bq, axis=1), Bkv, axis=2)
    modval = fb.blocks_padded[:, fb.q_block_id][:, :, fb.kv_block_id]      # the mask_mod
    return (tiles == 2) | ((tiles == 1) & modval)


def flex_best_block(mask, candidates: Sequence[Sequence[int]] = FLEX_BLOCK_CANDIDATES,
                    pad_to: int | None = None) -> FlexBlocks:
    """The largest candidate tile that needs no mask_mod, else the first candidate (mask_mod)."""
    best = None
    for c in candidates:
        fb = flex_blocks(mask, c, pad_to)
        if not fb.needs_mask_mod:
            return fb
        if best is None:
            best = fb
    return best


# --------------------------------------------------------------------------------------------
# Checks on a subset of query rows
# --------------------------------------------------------------------------------------------
def row_subset_mask(mask, rows: np.ndarray, heads: np.ndarray | None = None):
    """A BlockMask over only ``rows`` (each a 1-row query block) and the mask heads ``heads``:
    the reference on it equals the full reference restricted to those rows and heads."""
    from tessera_jax.mask import BlockMask
    _check_mask(mask)
    rows = np.asarray(rows, np.int64)
    if rows.ndim != 1 or rows.size == 0 or rows.min() < 0 or rows.max() >= mask.Lq:
        raise ValueError(f"rows must be a non-empty 1-D subset of [0, {mask.Lq})")
    qblk = np.searchsorted(mask.q_bounds, rows, side="right") - 1
    b = mask.blocks
    if heads is not None and b.shape[0] > 1:
        b = b[np.asarray(heads)]
    return BlockMask(np.arange(rows.size + 1), mask.kv_bounds, b[:, qblk, :])


def check_rows(Lq: int, q_bounds: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """Up to ``n`` sorted query rows: both ends of every logical block first (a spread of them
    if there are too many), then random rows."""
    rng = np.random.default_rng(seed)
    ends = np.unique(np.concatenate([q_bounds[:-1], q_bounds[1:] - 1]))
    if ends.size > n // 2:
        ends = np.unique(ends[np.linspace(0, ends.size - 1, n // 2).astype(np.int64)])
    rest = max(0, min(n, Lq) - ends.size)
    pool = np.setdiff1d(np.arange(Lq), ends) if Lq <= 1 << 22 else None
    extra = rng.choice(pool, size=min(rest, pool.size), replace=False) if pool is not None else \
        rng.integers(0, Lq, rest)
    return np.unique(np.concatenate([ends, extra])).astype(np.int64)


# --------------------------------------------------------------------------------------------
# New masks per request (a content-dependent method's mask changes every call)
# --------------------------------------------------------------------------------------------
#: How ``mask_variants`` makes new masks from a corpus mask.
VARIANT_KINDS: tuple[str, ...] = ("perturb", "permute")


def mask_variants(mask, n: int, kind: str = "perturb", seed: int = 0,
                  group: int = 1) -> list[np.ndarray]:
    """``n`` blocks arrays ``[Hm, nq, nkv]`` (bool, C order) for new masks with ``mask``'s
    bounds: ``mask.blocks`` itself first (the variant a benchmark checks), then ``n - 1`` others.

    - ``"perturb"`` (default): variant ``i`` has its heads rolled by ``i * group`` (per-head
      masks; ``group``: query heads per KV head, so heads stay in their GQA groups) and one
      selected block deselected, in a row that keeps another block where there is one, in
      every head of its GQA group (of all heads if the mask's heads are equal: heads that are
      equal stay equal). Each variant differs from the others (unless the mask selects
      nothing); the family's structure stays, the work is within one block per group. A mask
      that selects every block stays so: its variants are new arrays of the same blocks
      (deselecting one would make it another family, and its best alternative, cuDNN's
      dense call, would compute other work than the mask names).
    - ``"permute"``: the key blocks permuted among key blocks of the same size, one random
      permutation per variant for all heads: the same selected work, the structure across
      keys lost (a sliding window becomes scattered blocks), so tiles hold more blocks.
    """
    _check_mask(mask)
    if kind not in VARIANT_KINDS:
        raise ValueError(f"kind must be one of {VARIANT_KINDS}, got {kind!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    base = np.array(mask.blocks, dtype=np.bool_, order="C")        # a writable copy
    Hm = base.shape[0]
    rng = np.random.default_rng(seed)
    out = [base]
    if kind == "permute":
        sizes = mask.kv_sizes
        for _ in range(1, n):
            perm = np.arange(sizes.size)
            for s in np.unique(sizes):
                cls = np.nonzero(sizes == s)[0]
                perm[cls] = rng.permutation(cls)
            out.append(np.ascontiguousarray(base[:, :, perm]))
        return out
    if base.all():
        return out + [base.copy() for _ in range(1, n)]
    same_all = Hm > 1 and bool((base == base[:1]).all())
    nkv = base.shape[2]
    digest = lambda a: hashlib.blake2b(np.packbits(a).tobytes(), digest_size=16).digest()  # noqa: E731
    seen = {digest(base)}
    for i in range(1, n):
        rolled = np.ascontiguousarray(np.roll(base, (i * group) % Hm, axis=0)) if Hm > 1 \
            else base
        sel = np.flatnonzero(rolled)
        rows = rolled.sum(axis=-1).ravel()                  # selected blocks per (head, row)
        v = rolled.copy()
        for attempt in range(256):
            if not sel.size:
                break
            c = int(sel[rng.integers(sel.size)])
            if rows[c // nkv] < 2 and attempt < 128:        # keep a row's last block if can
                continue
            h, r, k = np.unravel_index(c, rolled.shape)
            # the same block in every head that must stay equal: all heads of a shared
            # per-head mask, else the pick's GQA group (FlashInfer reads one head per group)
            hs = slice(0, Hm) if same_all else slice(h - h % group, h - h % group + group)
            v = rolled.copy()
            v[hs, r, k] = False
            if digest(v) not in seen:
                break
        seen.add(digest(v))
        out.append(v)
    return out
