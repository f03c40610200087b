"""BlockMask: the logical block-sparse mask.

A mask names which logical blocks (query block i x key block j, per head) are computed. Block
boundaries are arbitrary token offsets, so blocks may have any size (1-token blocks next to
blocks of thousands), and each head may have its own partition (bounds ``[Hm, n + 1]``).

Two kinds, one class. A mask of NumPy arrays is *static*: validated, immutable and hashed by
content, so it can be a closure constant or a static argument under ``jax.jit`` (the host
planner plans it once). A mask holding a jax array (a traced value inside ``jax.jit``
included) is a *device* mask: shapes and dtypes are checked, and the bounds' values too when
they are concrete (outside a trace; traced ones: ``runtime.device_route.check``); it is planned
inside the compiled program (``runtime.device_route``). ``BlockMask`` is a pytree: a device
mask's leaves are its arrays (a jit argument, a ``lax.scan`` carry); a static mask has no
leaves and is its own structure, so under jit it stays a static value. ``to_device`` makes a
device mask of a static one.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["BlockMask"]


_INT32_MAX = int(np.iinfo(np.int32).max)


def _as_bounds(name: str, bounds, length: int | None = None) -> np.ndarray:
    """Validates block boundaries: 1-D ints, starting at 0, strictly increasing."""
    if isinstance(bounds, (bool, np.bool_)) or bounds is None:
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {type(bounds).__name__}")
    arr = np.asarray(bounds)
    _check_ints(name, arr)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return _checked_rows(name, arr[None], length)[0]


def _check_ints(name: str, arr: np.ndarray) -> None:
    if arr.dtype.kind not in "iu":                   # (bool's kind is "b")
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")


def _checked_rows(name: str, arr: np.ndarray, length: int | None = None) -> np.ndarray:
    """Bounds rows ``arr`` [R, n + 1] (ints) as read-only int64, each checked: at least 2
    entries, starting at 0, strictly increasing, the last within int32 (and equal to
    ``length`` if given); the message names the first bad row (``name[r]`` when R > 1) and
    entry."""
    if arr.shape[1] >= 2:
        # Valid bounds (every request's) pass four whole-array tests; a failure finds its
        # row and entry below.
        last = arr[:, -1]
        if not arr[:, 0].any() and (arr[:, 1:] > arr[:, :-1]).all() \
                and last.max() <= _INT32_MAX and (length is None or (last == length).all()):
            out = arr.astype(np.int64)
            out.setflags(write=False)
            return out

    def row_name(r):
        return name if arr.shape[0] == 1 else f"{name}[{r}]"
    if arr.shape[1] < 2:
        raise ValueError(f"{row_name(0)} needs at least 2 entries (0 and the length), got "
                         f"{arr.shape[1]}")
    bad = np.flatnonzero(arr[:, 0] != 0)
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"{row_name(r)} must start at 0, got {int(arr[r, 0])}")
    down = arr[:, 1:] <= arr[:, :-1]
    if down.any():
        r, i = (int(x) for x in np.argwhere(down)[0])
        raise ValueError(
            f"{row_name(r)} must be strictly increasing; {row_name(r)}[{i}]={int(arr[r, i])} is "
            f"followed by {int(arr[r, i + 1])}")
    last = arr[:, -1]
    if length is not None and (last != length).any():
        r = int(np.flatnonzero(last != length)[0])
        raise ValueError(f"{row_name(r)} must end at the sequence length {length}, got "
                         f"{int(last[r])}")
    if (last > _INT32_MAX).any():
        r = int(np.flatnonzero(last > _INT32_MAX)[0])
        raise ValueError(f"{row_name(r)} exceeds the int32 range")
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


def _is_jax(x) -> bool:
    """A jax array, traced values included (the mask is then a device mask)."""
    import jax
    return isinstance(x, jax.Array)


def _host_bounds(name: str, bounds) -> np.ndarray:
    """Host bounds [n + 1] or per head [Hm, n + 1], each row checked (``_checked_rows``), all
    rows ending at the same length."""
    arr = np.asarray(bounds) if not isinstance(bounds, (bool, np.bool_)) and bounds is not None \
        else bounds
    if isinstance(arr, np.ndarray) and arr.ndim == 2:
        if arr.shape[0] < 1:
            raise ValueError(f"{name} per head must have at least one row, got shape {arr.shape}")
        _check_ints(f"{name}[0]", arr)
        out = _checked_rows(name if arr.shape[0] > 1 else f"{name}[0]", arr)
        ends = np.unique(out[:, -1])
        if ends.size > 1:
            raise ValueError(f"{name}: every head's bounds must end at the same length, got "
                             f"{[int(e) for e in ends]}")
        return out
    if isinstance(arr, np.ndarray) and arr.ndim > 2:
        raise ValueError(f"{name} must be [n + 1] or per head [Hm, n + 1], got shape {arr.shape}")
    return _as_bounds(name, bounds)


def concrete(x) -> np.ndarray | None:
    """The values of bounds known now: a NumPy array, or a jax array outside a trace (read
    back to the host); None for traced values."""
    import jax
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _device_bounds(name: str, bounds):
    """Shape and dtype checks of device bounds (values: ``_check_concrete``)."""
    import jax.numpy as jnp
    if not jnp.issubdtype(bounds.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got dtype {bounds.dtype}")
    if bounds.ndim not in (1, 2) or bounds.shape[-1] < 2:
        raise ValueError(f"{name} must be [n + 1] or [Hm, n + 1] with n >= 1, got shape "
                         f"{tuple(bounds.shape)}")
    return bounds


def _check_concrete(name: str, bounds) -> None:
    """Values of jax bounds known now (outside a trace) are validated like NumPy ones;
    traced values are checked on the device (``runtime.device_route.check`` under
    ``checkify``) and never read out of bounds."""
    if not isinstance(bounds, np.ndarray):
        values = concrete(bounds)
        if values is not None:
            _host_bounds(name, values)


#: 64-bit words ``BlockMask.count_selected`` counts at a time when it may stop early (32 KB,
#: 262,144 blocks: Wan 480p's 12-head masks take 18 chunks).
_COUNT_CHUNK = 4096


def _count_bits(words: np.ndarray, start: int, stop_above: int | None,
                chunk: int = _COUNT_CHUNK) -> int:
    """``start`` plus the set bits of ``words`` (uint64), ``chunk`` words at a time once
    ``stop_above`` is given, stopping as soon as the count passes it."""
    if stop_above is None:
        return start + int(np.bitwise_count(words).sum(dtype=np.int64))
    count = start
    for i in range(0, words.size, chunk):
        if count > stop_above:
            break
        count += int(np.bitwise_count(words[i:i + chunk]).sum(dtype=np.int64))
    return count


class BlockMask:
    """Which logical blocks of queries x keys to compute, per head or shared by all heads.

    Args:
      q_bounds: ints, strictly increasing from 0 to ``Lq``: ``[nq + 1]`` (all heads) or
        ``[Hm, nq + 1]`` (each head its own partition, e.g. clusters after a per-head sort).
      kv_bounds: the same over the keys (``Lkv``), ``[nkv + 1]`` or ``[Hm, nkv + 1]``.
      blocks: bool ``[Hm, nq, nkv]`` (or ``[nq, nkv]``, read as ``Hm == 1``); ``Hm == 1`` means
        one mask for all heads, otherwise one mask per query head.
    Any of them may be a jax array (traced values included): the mask is then a device mask
    (``is_static`` False), see the module docstring.
    """

    __slots__ = ("q_bounds", "kv_bounds", "_blocks", "_bshape", "_digest", "_hash", "_packed",
                 "__weakref__")

    def __init__(self, q_bounds, kv_bounds, blocks):
        if isinstance(blocks, BlockMask) or blocks is None:
            raise TypeError(f"blocks must be a bool array, got {type(blocks).__name__}")
        if any(_is_jax(x) for x in (q_bounds, kv_bounds, blocks)):
            self._init_device(q_bounds, kv_bounds, blocks)
            return
        q_bounds = _host_bounds("q_bounds", q_bounds)
        kv_bounds = _host_bounds("kv_bounds", kv_bounds)
        arr = np.asarray(blocks)
        if arr.dtype != np.bool_:
            raise TypeError(f"blocks must have dtype bool, got {arr.dtype}")
        self._check_shapes(q_bounds, kv_bounds, arr.shape)
        if arr.ndim == 2:
            arr = arr[None]
        # A static mask keeps its blocks as packed bits (a copy: the caller's array may
        # change); ``blocks`` unpacks them when first read. The request path (the device copy,
        # counts, cache keys) reads the bits only: Wan 480p's 4.7 MB of bools are not copied,
        # and no digest is computed (``__hash__`` folds the bits' words, ``__eq__`` compares
        # the bits; ``digest``, SHA-256, is made when first read).
        packed = np.packbits(arr.reshape(-1))
        packed.setflags(write=False)
        self._set(q_bounds, kv_bounds, None, packed, tuple(arr.shape))

    def _init_device(self, q_bounds, kv_bounds, blocks):
        import jax.numpy as jnp
        parts = []
        for name, b in (("q_bounds", q_bounds), ("kv_bounds", kv_bounds)):
            if _is_jax(b):
                parts.append(_device_bounds(name, b))
            else:
                if isinstance(b, (bool, np.bool_)) or b is None:
                    raise TypeError(f"{name} must be an int array, got {type(b).__name__}")
                parts.append(_host_bounds(name, b))
        if not (_is_jax(blocks) or isinstance(blocks, np.ndarray)):
            blocks = np.asarray(blocks)
        if jnp.dtype(blocks.dtype) != jnp.bool_:
            raise TypeError(f"blocks must have dtype bool, got {blocks.dtype}")
        self._check_shapes(parts[0], parts[1], tuple(blocks.shape))
        for name, b in zip(("q_bounds", "kv_bounds"), parts):
            _check_concrete(name, b)
        if blocks.ndim == 2:
            blocks = blocks[None]
        self._set(parts[0], parts[1], blocks)

    @staticmethod
    def _check_shapes(q_bounds, kv_bounds, shape) -> bool:
        """blocks' shape against the bounds' shapes (per-head bounds: one row per mask head)."""
        if len(shape) == 2:
            shape = (1,) + tuple(shape)
        if len(shape) != 3:
            raise ValueError(f"blocks must be [Hm, nq, nkv] (or [nq, nkv]), got shape {shape}")
        nq, nkv = q_bounds.shape[-1] - 1, kv_bounds.shape[-1] - 1
        if tuple(shape[1:]) != (nq, nkv):
            raise ValueError(
                f"blocks has shape {tuple(shape)}, but the bounds give {nq} query blocks and "
                f"{nkv} key blocks: expected [Hm, {nq}, {nkv}]")
        if shape[0] < 1:
            raise ValueError("blocks must have at least one head (Hm >= 1)")
        for name, b in (("q_bounds", q_bounds), ("kv_bounds", kv_bounds)):
            if b.ndim == 2 and b.shape[0] != shape[0]:
                raise ValueError(f"{name} has per-head bounds for {b.shape[0]} heads but blocks "
                                 f"has Hm={shape[0]}; they must match")
        return True

    def _set(self, q_bounds, kv_bounds, blocks, packed=None, shape=None):
        object.__setattr__(self, "_packed", packed)     # a static mask's bits; None: device
        object.__setattr__(self, "_digest", None)       # made when first read
        object.__setattr__(self, "_hash", None)
        object.__setattr__(self, "q_bounds", q_bounds)
        object.__setattr__(self, "kv_bounds", kv_bounds)
        object.__setattr__(self, "_blocks", blocks)
        object.__setattr__(self, "_bshape", shape)     # a static mask's; None: blocks'

    @property
    def blocks(self):
        """bool ``[Hm, nq, nkv]``: read-only NumPy for a static mask (unpacked from its bits
        when first read), the given array for a device mask."""
        b = self._blocks
        if b is None:
            n = int(np.prod(self._bshape))
            b = np.unpackbits(self._packed, count=n).view(np.bool_).reshape(self._bshape)
            b.setflags(write=False)
            object.__setattr__(self, "_blocks", b)       # a race unpacks twice, harmlessly
        return b

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
    def is_static(self) -> bool:
        """True for a validated NumPy mask (hashable, planned on the host); False for a device
        mask (jax arrays)."""
        return self._packed is not None

    @property
    def per_head_bounds(self) -> bool:
        """Whether the bounds are per head ([Hm, n + 1]) on either axis."""
        return self.q_bounds.ndim == 2 or self.kv_bounds.ndim == 2

    @property
    def digest(self) -> str:
        """Content hash (bounds and blocks) of a static mask: SHA-256, 32 hex digits, made
        when first read (0.38 ms for Wan 480p's 584 KB of packed bits on the CPU box, so
        not on the request path, whose cache keys use ``__hash__`` and ``__eq__``)."""
        self._need_static("digest")
        d = self._digest
        if d is None:
            h = hashlib.sha256()
            for part in (self.q_bounds, self.kv_bounds):
                # 1-D bounds hash their size, per-head ones their shape
                h.update(np.asarray(part.shape if part.ndim == 2 else part.size,
                                    np.int64).tobytes())
                h.update(part.tobytes())
            h.update(np.asarray(self._bshape, np.int64).tobytes())
            h.update(memoryview(self._packed))
            d = h.hexdigest()[:32]
            object.__setattr__(self, "_digest", d)       # a race hashes twice, harmlessly
        return d

    def _need_static(self, what: str) -> None:
        if self._packed is None:
            raise TypeError(f"BlockMask.{what} needs a static (NumPy) mask; this one holds jax "
                            f"arrays (a device mask): use to_host() on concrete values")

    def _host_length(self, bounds, what: str) -> int:
        if _is_jax(bounds):
            raise TypeError(f"BlockMask.{what} is not known statically: the mask's bounds are "
                            f"a jax array (a device mask)")
        return int(np.asarray(bounds)[..., -1].reshape(-1)[0])

    @property
    def Lq(self) -> int:
        return self._host_length(self.q_bounds, "Lq")

    @property
    def Lkv(self) -> int:
        return self._host_length(self.kv_bounds, "Lkv")

    @property
    def num_heads(self) -> int:
        """Hm: 1 for a shared mask, else the number of query heads."""
        return self.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        s = self._bshape if self._bshape is not None else self._blocks.shape
        return tuple(int(x) for x in s)  # type: ignore[return-value]

    @property
    def q_sizes(self) -> np.ndarray:
        """Query block sizes, [nq] or per head [Hm, nq] (static masks)."""
        self._need_static("q_sizes")
        return np.diff(self.q_bounds, axis=-1)

    @property
    def kv_sizes(self) -> np.ndarray:
        self._need_static("kv_sizes")
        return np.diff(self.kv_bounds, axis=-1)

    def _head_sizes(self):
        """(q sizes, kv sizes), each [Hm, n]."""
        H = self.num_heads
        qs, ks = self.q_sizes, self.kv_sizes
        return (np.broadcast_to(qs, (H, qs.shape[-1])), np.broadcast_to(ks, (H, ks.shape[-1])))

    def selected_per_head(self) -> np.ndarray:
        """Selected token interactions of each mask head, int64 [Hm]."""
        qs, ks = self._head_sizes()
        return np.einsum("hij,hi,hj->h", self.blocks.astype(np.int64), qs.astype(np.int64),
                         ks.astype(np.int64))

    def selected_interactions(self, num_q_heads: int | None = None) -> int:
        """Selected (query, key) pairs summed over query heads (a shared mask counts per head)."""
        per = self.selected_per_head()
        if self.num_heads == 1:
            return int(per[0]) * (num_q_heads or 1)
        return int(per.sum())

    def count_selected(self, stop_above: int | None = None) -> int:
        """Selected blocks over all mask heads, counted on a static mask's packed bits as
        64-bit words (Wan 480p's [12, 624, 624]: 0.07 against 0.20 ms for the bools, CPU).
        ``stop_above``: the count may stop once past it, returning a partial count above it
        (so ``count_selected(k) > k`` tells whether more than ``k`` blocks are selected,
        reading only as many words as it takes)."""
        self._need_static("count_selected")
        p = self._packed
        n = p.size // 8 * 8
        tail = int(np.bitwise_count(p[n:]).sum(dtype=np.int64))
        return _count_bits(p[:n].view(np.uint64), tail, stop_above)

    def selects_all(self) -> bool:
        """Whether every block of every head is selected, on a static mask's packed bits: a
        first byte short of 0xFF (as a sparse mask's usually is) answers at once, else the
        least of the whole bytes and the last byte's padded bits decide."""
        self._need_static("selects_all")
        n = int(np.prod(self._bshape))
        p, full, rem = self._packed, n // 8, n % 8
        if full and (p[0] != 0xFF or p[:full].min() != 0xFF):
            return False
        return not rem or int(p[full]) == (0xFF << (8 - rem)) & 0xFF

    @property
    def density(self) -> float:
        """Fraction of token interactions selected, averaged over mask heads."""
        return float(self.selected_per_head().sum() / (self.num_heads * self.Lq * self.Lkv))

    def token_mask(self, head: int | None = None) -> np.ndarray:
        """Dense token-level bool mask ``[Hm, Lq, Lkv]`` (or ``[Lq, Lkv]`` for one head)."""
        if head is not None:
            qs, ks = self._head_sizes()
            out = np.repeat(self.blocks[head], qs[head], axis=0)
            return np.repeat(out, ks[head], axis=1)
        if not self.per_head_bounds:
            out = np.repeat(self.blocks, self.q_sizes, axis=-2)
            return np.repeat(out, self.kv_sizes, axis=-1)
        return np.stack([self.token_mask(h) for h in range(self.num_heads)])

    def head_blocks(self, num_q_heads: int) -> np.ndarray:
        """Blocks for each of ``num_q_heads`` query heads, bool [Hq, nq, nkv] (a view)."""
        if self.num_heads == 1:
            return np.broadcast_to(self.blocks, (num_q_heads,) + self.blocks.shape[1:])
        if self.num_heads != num_q_heads:
            raise ValueError(
                f"mask has {self.num_heads} heads; it must have 1 or Hq={num_q_heads}")
        return self.blocks

    # --- moving between host and device -------------------------------------------------
    def to_device(self, device=None, *, static_bounds: bool = False) -> "BlockMask":
        """This static mask as a device mask, copied compactly: blocks bit-packed (1 bit per
        block) and unpacked on the device, bounds as int32 (``static_bounds``: the bounds
        stay these NumPy arrays, so the device route plans with them known when tracing:
        tiles aligned to the blocks, one executable per bounds)."""
        qb, kb, packed = self.packed_leaves(device, static_bounds=static_bounds)
        return BlockMask._from_leaves(qb, kb, unpack_blocks(packed, self.blocks.shape))

    def packed_leaves(self, device=None, *, static_bounds: bool = False,
                      host_bits: bool = False):
        """(q_bounds, kv_bounds, packed blocks) of ``to_device`` before the unpack: the blocks
        as the bit-packed uint8 device array (``unpack_blocks`` inside a program makes them
        bools: no eager ops on the request path), bounds int32 device arrays (NumPy with
        ``static_bounds``). ``host_bits`` (with ``static_bounds``): the packed bits stay this
        mask's read-only NumPy array, for a jitted call to copy in its own dispatch (on the
        H100 0.06-0.16 ms less than ``device_put`` first, ``results/h100-host-row-breakdown``)."""
        import jax
        self._need_static("to_device")
        if host_bits and not static_bounds:
            raise ValueError("host_bits needs static_bounds: NumPy bounds are static leaves")
        if static_bounds:            # (every static mask holds its digest's packed bits)
            bits = self._packed if host_bits else jax.device_put(self._packed, device)
            return self.q_bounds, self.kv_bounds, bits
        qb, kb = (np.asarray(b, np.int32) for b in (self.q_bounds, self.kv_bounds))
        return jax.device_put((qb, kb, self._packed), device)

    def to_host(self) -> "BlockMask":
        """A static (validated NumPy) copy of a mask of concrete values."""
        if self.is_static:
            return self
        return BlockMask(np.asarray(self.q_bounds), np.asarray(self.kv_bounds),
                         np.asarray(self.blocks))

    # --- identity and pytree ------------------------------------------------------------
    def __hash__(self) -> int:
        """A static mask's hash: its shapes, bounds and the XOR and sum of its packed bits'
        64-bit words (0.04 ms for Wan 480p's 584 KB on the CPU box, against SHA-256's 0.38).
        Masks whose words are a permutation of each other's collide; ``__eq__`` compares the
        bits, so a collision costs a comparison, never a wrong match."""
        h = self._hash
        if h is None:
            if self._packed is None:
                raise TypeError("a device BlockMask (jax arrays) is not hashable; a static "
                                "mask needs NumPy arrays (to_host() on concrete values)")
            p = self._packed
            n = p.size // 8 * 8
            w = p[:n].view(np.uint64)
            h = hash((self._bshape, self.q_bounds.shape, self.q_bounds.tobytes(),
                      self.kv_bounds.shape, self.kv_bounds.tobytes(),
                      int(np.bitwise_xor.reduce(w)) if n else 0,
                      int(w.sum(dtype=np.uint64)) if n else 0, p[n:].tobytes()))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other) -> bool:
        """Static masks: equal content (shapes, bounds, blocks); device masks: identity."""
        if self is other:
            return True
        if self._packed is None or not isinstance(other, BlockMask) or other._packed is None:
            return False
        if self._digest is not None and other._digest is not None:
            return self._digest == other._digest
        return (self._bshape == other._bshape and hash(self) == hash(other)
                and all(a.shape == b.shape and np.array_equal(a, b)
                        for a, b in ((self.q_bounds, other.q_bounds),
                                     (self.kv_bounds, other.kv_bounds),
                                     (self._packed, other._packed))))

    def __repr__(self) -> str:
        bounds = "per-head" if self.per_head_bounds else "shared"
        if self._packed is None:
            return (f"BlockMask(device, heads={self.num_heads}, blocks={self.blocks.shape[1]}x"
                    f"{self.blocks.shape[2]}, {bounds} bounds)")
        return (f"BlockMask(Lq={self.Lq}, Lkv={self.Lkv}, heads={self.num_heads}, "
                f"blocks={self.blocks.shape[1]}x{self.blocks.shape[2]}, "
                + ("per-head bounds, " if self.per_head_bounds else "")
                + f"density={self.density:.3f}, digest={self.digest[:8]})")

    def __reduce__(self):
        return (BlockMask, (np.asarray(self.q_bounds), np.asarray(self.kv_bounds),
                            np.asarray(self.blocks)))

    @classmethod
    def _from_leaves(cls, q_bounds, kv_bounds, blocks) -> "BlockMask":
        """A device mask from pytree leaves, unchecked (leaves may be tracers, abstract
        values or placeholders)."""
        m = object.__new__(cls)
        m._set(q_bounds, kv_bounds, blocks)
        return m


def unpack_blocks(packed, shape):
    """Blocks bool ``shape`` from their ``np.packbits`` bytes (a jax array; jittable)."""
    import jax.numpy as jnp
    n = int(np.prod(shape))
    return jnp.unpackbits(packed, count=n).astype(bool).reshape(shape)


# A static mask is a pytree without leaves whose structure is the mask itself (hashed by its
# digest): under jit it stays a static value planned on the host, as the contract says. A
# device mask's leaves are its three arrays.
def _flatten(m: BlockMask):
    if m._packed is not None:
        return (), m
    return (m.q_bounds, m.kv_bounds, m.blocks), None


def _unflatten(static, leaves):
    return static if static is not None else BlockMask._from_leaves(*leaves)


def _register():
    import jax
    jax.tree_util.register_pytree_node(BlockMask, _flatten, _unflatten)


_register()
