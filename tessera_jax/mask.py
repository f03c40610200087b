"""BlockMask: the logical block-sparse mask, a static, hashable host object.

A mask names which logical blocks (query block i x key block j, per head) are computed. Block
boundaries are arbitrary token offsets, so blocks may have any size (1-token blocks next to
blocks of thousands). The mask is immutable and hashed by content, so it can be a closure
constant or a static argument under ``jax.jit``.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["BlockMask"]


def _as_bounds(name: str, bounds, length: int | None = None) -> np.ndarray:
    """Validates block boundaries: 1-D ints, starting at 0, strictly increasing."""
    if isinstance(bounds, (bool, np.bool_)) or bounds is None:
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {type(bounds).__name__}")
    arr = np.asarray(bounds)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size < 2:
        raise ValueError(f"{name} needs at least 2 entries (0 and the length), got {arr.size}")
    if arr[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(arr[0])}")
    steps = np.diff(arr)
    if np.any(steps <= 0):
        bad = int(np.argmax(steps <= 0))
        raise ValueError(
            f"{name} must be strictly increasing; {name}[{bad}]={int(arr[bad])} is followed by "
            f"{int(arr[bad + 1])}")
    if length is not None and arr[-1] != length:
        raise ValueError(f"{name} must end at the sequence length {length}, got {int(arr[-1])}")
    if arr[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{name} exceeds the int32 range")
    out = arr.astype(np.int64)
    out.setflags(write=False)
    return out


def _uniform_bounds(name: str, length: int, block: int) -> np.ndarray:
    for arg, val in ((f"length of {name}", length), (f"block size of {name}", block)):
        if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{arg} must be an int, got {type(val).__name__}")
        if val <= 0:
            raise ValueError(f"{arg} must be positive, got {val}")
    return np.append(np.arange(0, length, block), length)


class BlockMask:
    """Which logical blocks of queries x keys to compute, per head or shared by all heads.

    Args:
      q_bounds: 1-D ints, strictly increasing, ``q_bounds[0] == 0``, ``q_bounds[-1] == Lq``.
      kv_bounds: the same over the keys (``Lkv``).
      blocks: bool ``[Hm, nq, nkv]`` (or ``[nq, nkv]``, read as ``Hm == 1``); ``Hm == 1`` means
        one mask for all heads, otherwise one mask per query head.
    """

    __slots__ = ("q_bounds", "kv_bounds", "blocks", "_digest", "__weakref__")

    def __init__(self, q_bounds, kv_bounds, blocks):
        q_bounds = _as_bounds("q_bounds", q_bounds)
        kv_bounds = _as_bounds("kv_bounds", kv_bounds)
        if isinstance(blocks, BlockMask) or blocks is None:
            raise TypeError(f"blocks must be a bool array, got {type(blocks).__name__}")
        arr = np.asarray(blocks)
        if arr.dtype != np.bool_:
            raise TypeError(f"blocks must have dtype bool, got {arr.dtype}")
        if arr.ndim == 2:
            arr = arr[None]
        if arr.ndim != 3:
            raise ValueError(f"blocks must be [Hm, nq, nkv] (or [nq, nkv]), got shape {arr.shape}")
        nq, nkv = len(q_bounds) - 1, len(kv_bounds) - 1
        if arr.shape[1:] != (nq, nkv):
            raise ValueError(
                f"blocks has shape {arr.shape}, but the bounds give {nq} query blocks and "
                f"{nkv} key blocks: expected [Hm, {nq}, {nkv}]")
        if arr.shape[0] < 1:
            raise ValueError("blocks must have at least one head (Hm >= 1)")
        arr = np.array(arr, dtype=np.bool_, copy=True, order="C")
        arr.setflags(write=False)
        h = hashlib.blake2b(digest_size=16)
        for part in (q_bounds, kv_bounds):
            h.update(np.int64(part.size).tobytes())
            h.update(part.tobytes())
        h.update(np.asarray(arr.shape, np.int64).tobytes())
        h.update(np.packbits(arr).tobytes())
        object.__setattr__(self, "q_bounds", q_bounds)
        object.__setattr__(self, "kv_bounds", kv_bounds)
        object.__setattr__(self, "blocks", arr)
        object.__setattr__(self, "_digest", h.hexdigest())

    def __setattr__(self, name, value):
        raise AttributeError("BlockMask is immutable")

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def uniform(cls, Lq: int, Lkv: int, block_q: int, block_kv: int, blocks) -> "BlockMask":
        """Equal-size blocks; the last block of each axis may be partial."""
        return cls(_uniform_bounds("q", Lq, block_q), _uniform_bounds("kv", Lkv, block_kv), blocks)

    @classmethod
    def from_token_mask(cls, token_mask, q_bounds, kv_bounds, *, exact: bool = True) -> "BlockMask":
        """Block mask from a token-level bool mask ``[Hm, Lq, Lkv]`` (or ``[Lq, Lkv]``).

        With ``exact=True`` every block must be all-selected or all-unselected in the token
        mask (otherwise the block mask would not compute the same function): a mixed block
        raises ``ValueError``. With ``exact=False`` a block is selected if any of its tokens is
        (a superset: use it only when computing extra interactions is acceptable).
        """
        tm = np.asarray(token_mask)
        if tm.dtype != np.bool_:
            raise TypeError(f"token_mask must have dtype bool, got {tm.dtype}")
        if tm.ndim == 2:
            tm = tm[None]
        if tm.ndim != 3:
            raise ValueError(f"token_mask must be [Hm, Lq, Lkv] or [Lq, Lkv], got shape {tm.shape}")
        qb = _as_bounds("q_bounds", q_bounds, tm.shape[1])
        kb = _as_bounds("kv_bounds", kv_bounds, tm.shape[2])
        counts = np.add.reduceat(np.add.reduceat(tm.astype(np.int64), qb[:-1], axis=1),
                                 kb[:-1], axis=2)
        sizes = np.diff(qb)[:, None] * np.diff(kb)[None, :]
        any_sel = counts > 0
        if exact:
            mixed = any_sel & (counts != sizes[None])
            if mixed.any():
                h, i, j = (int(x[0]) for x in np.nonzero(mixed))
                raise ValueError(
                    f"token_mask is not constant on block (head {h}, q block {i} = rows "
                    f"[{qb[i]}, {qb[i + 1]}), kv block {j} = keys [{kb[j]}, {kb[j + 1]})): a "
                    f"block mask can't express it exactly; refine the bounds or pass exact=False")
        return cls(qb, kb, any_sel)

    @classmethod
    def stack(cls, masks: Sequence["BlockMask"]) -> "BlockMask":
        """Per-head mask from one single-head mask per query head (all with the same bounds)."""
        masks = list(masks)
        if not masks:
            raise ValueError("masks must hold at least one BlockMask")
        for i, m in enumerate(masks):
            if not isinstance(m, BlockMask):
                raise TypeError(f"masks[{i}] must be a BlockMask, got {type(m).__name__}")
            if not (np.array_equal(m.q_bounds, masks[0].q_bounds)
                    and np.array_equal(m.kv_bounds, masks[0].kv_bounds)):
                raise ValueError(f"masks[{i}] has other bounds than masks[0]; stacking needs equal bounds")
        return cls(masks[0].q_bounds, masks[0].kv_bounds,
                   np.concatenate([m.blocks for m in masks], axis=0))

    # --- properties ---------------------------------------------------------------------
    @property
    def digest(self) -> str:
        """Content hash (bounds and blocks)."""
        return self._digest

    @property
    def Lq(self) -> int:
        return int(self.q_bounds[-1])

    @property
    def Lkv(self) -> int:
        return int(self.kv_bounds[-1])

    @property
    def num_heads(self) -> int:
        """Hm: 1 for a shared mask, else the number of query heads."""
        return int(self.blocks.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.blocks.shape)  # type: ignore[return-value]

    @property
    def q_sizes(self) -> np.ndarray:
        return np.diff(self.q_bounds)

    @property
    def kv_sizes(self) -> np.ndarray:
        return np.diff(self.kv_bounds)

    def selected_per_head(self) -> np.ndarray:
        """Selected token interactions of each mask head, int64 [Hm]."""
        sizes = self.q_sizes[:, None] * self.kv_sizes[None, :]
        return np.einsum("hij,ij->h", self.blocks.astype(np.int64), sizes)

    def selected_interactions(self, num_q_heads: int | None = None) -> int:
        """Selected (query, key) pairs summed over query heads (a shared mask counts per head)."""
        per = self.selected_per_head()
        if self.num_heads == 1:
            return int(per[0]) * (num_q_heads or 1)
        return int(per.sum())

    @property
    def density(self) -> float:
        """Fraction of token interactions selected, averaged over mask heads."""
        return float(self.selected_per_head().sum() / (self.num_heads * self.Lq * self.Lkv))

    def token_mask(self, head: int | None = None) -> np.ndarray:
        """Dense token-level bool mask ``[Hm, Lq, Lkv]`` (or ``[Lq, Lkv]`` for one head)."""
        blocks = self.blocks if head is None else self.blocks[head]
        out = np.repeat(blocks, self.q_sizes, axis=-2)
        return np.repeat(out, self.kv_sizes, axis=-1)

    def head_blocks(self, num_q_heads: int) -> np.ndarray:
        """Blocks for each of ``num_q_heads`` query heads, bool [Hq, nq, nkv] (a view)."""
        if self.num_heads == 1:
            return np.broadcast_to(self.blocks, (num_q_heads,) + self.blocks.shape[1:])
        if self.num_heads != num_q_heads:
            raise ValueError(
                f"mask has {self.num_heads} heads; it must have 1 or Hq={num_q_heads}")
        return self.blocks

    # --- identity -----------------------------------------------------------------------
    def __hash__(self) -> int:
        return hash(self._digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockMask) and other._digest == self._digest

    def __repr__(self) -> str:
        return (f"BlockMask(Lq={self.Lq}, Lkv={self.Lkv}, heads={self.num_heads}, "
                f"blocks={self.blocks.shape[1]}x{self.blocks.shape[2]}, "
                f"density={self.density:.3f}, digest={self._digest[:8]})")

    def __reduce__(self):
        return (BlockMask, (np.asarray(self.q_bounds), np.asarray(self.kv_bounds),
                            np.asarray(self.blocks)))
