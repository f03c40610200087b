"""The device planner's core: a block mask held in jax arrays -> plan ABI arrays, in jnp.

A first piece of the device planner (issue 16): jittable, no host transfer, shapes of the
outputs derived from the static shapes alone, so a new mask of the same shapes neither retraces
nor recompiles. It is not yet wired into ``tessera_jax.sparse_attention`` (which plans on the
host); the kernels take its arrays as traced plan operands.

Plan it builds (``pallas_kernels.abi``): one unit per (query head, query tile) at
q_start = t * tile_q, owning its rows below Lq; a step for each K/V tile (at c * tile_kv) that
holds a selected entry, in key order (bounds shared by the heads or each head's own): plain
and whole where the tile lies inside the lengths and every block it meets is selected; plain
over the rows / keys inside the lengths where only that clips it; else a *grid* step whose
cuts are the block bounds inside the tile and whose cells are the blocks' flags. So every (unit, tile) is visited once and the plan computes
at most a dense plan of these tiles. Grid steps hold at most 4 x 4 blocks: every tile must meet
at most ``abi.GRID`` query blocks and ``abi.GRID`` key blocks (blocks of >= tile / 3 tokens,
or tile-aligned ones of tile / 4). Host (NumPy) bounds are checked when tracing (ValueError);
device bounds yield ``ok`` = False when broken (a tile meets more blocks, bounds not
increasing from 0 to the length), with every index clamped, so bad data never reads out of
bounds; check it with ``checkify`` (``check``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi

__all__ = ["DevicePlan", "plan_on_device", "check"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["units", "steps", "ok"],
                   meta_fields=["tile_q", "tile_kv", "q_len_padded", "kv_len_padded",
                                "max_steps"])
@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """The plan ABI arrays (jax arrays, static shapes: the pytree's leaves) and the static
    values kernels need (its metadata: a jitted function may return the plan)."""

    units: jax.Array          # int32 [Hq * nqt, UNIT_COLS]
    steps: jax.Array          # int32 [Hm * nqt * nkt, STEP_COLS]; rows past the used ones: 0
    ok: jax.Array             # bool []: the mask fits the grid steps (and its bounds are valid)
    tile_q: int
    tile_kv: int
    q_len_padded: int
    kv_len_padded: int
    max_steps: int            # nkt: the most steps a unit can have


def _tile_blocks(bounds, length: int, tile: int, n_tiles: int):
    """(first, last) block of each tile's tokens inside the length, each [Hb, n_tiles], and the
    tiles' own extents (tokens below the length) [n_tiles], for ``bounds`` [Hb, n + 1] (NumPy
    or jnp)."""
    start = np.arange(n_tiles, dtype=np.int32) * tile
    end = np.minimum(start + tile, length)
    n = bounds.shape[1] - 1
    if isinstance(bounds, np.ndarray):
        find = lambda x: np.stack([np.searchsorted(b, x, side="right") for b in bounds])  # noqa: E731
    else:
        find = lambda x: jax.vmap(lambda b: jnp.searchsorted(b, x, side="right"))(bounds)  # noqa: E731
    first = (find(start) - 1).clip(0, n - 1)
    last = (find(end - 1) - 1).clip(0, n - 1)
    return first, last, end - start


def _check_host_bounds(name, bounds, length, tile, n_tiles):
    for h, b in enumerate(bounds):
        at = f"{name}[{h}]" if len(bounds) > 1 else name
        if b[0] != 0 or b[-1] != length or (np.diff(b) <= 0).any():
            raise ValueError(f"{at} must increase strictly from 0 to {length}")
    first, last, _ = _tile_blocks(bounds, length, tile, n_tiles)
    worst = int((last - first + 1).max())
    if worst > abi.GRID:
        raise ValueError(f"{name}: a tile of {tile} tokens meets {worst} blocks; the device "
                         f"planner's grid steps hold at most {abi.GRID} per axis (blocks of "
                         f">= {tile} / 3 tokens)")


def plan_on_device(blocks, q_bounds, kv_bounds, *, num_q_heads: int, q_len: int, kv_len: int,
                   tile_q: int, tile_kv: int) -> DevicePlan:
    """The plan of a block mask for these tiles (see the module docstring), in jnp.

    blocks: bool [Hm, nq, nk] (Hm = 1: shared by the heads, or Hm = num_q_heads), a jax or
    NumPy array, traced values included; q_bounds [nq + 1] or [Hm, nq + 1] (each head its own
    partition, e.g. clusters after a per-head sort) / kv_bounds [nk + 1] or [Hm, nk + 1]: int
    block bounds, NumPy (checked now) or jax arrays (``ok`` says whether they are valid).
    Tiles must be multiples of 8 (TMA alignment of the Mosaic GPU kernel) up to
    ``abi.MAX_TILE``.
    """
    for name, val in (("num_q_heads", num_q_heads), ("q_len", q_len), ("kv_len", kv_len),
                      ("tile_q", tile_q), ("tile_kv", tile_kv)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    abi.check_tiles(tile_q, tile_kv)
    if tile_q % 8 or tile_kv % 8:
        raise ValueError(f"tile_q and tile_kv must be multiples of 8, got {tile_q}, {tile_kv}")
    if not hasattr(blocks, "shape") or len(blocks.shape) != 3:
        raise ValueError(f"blocks must be a [Hm, nq, nk] array, got "
                         f"{getattr(blocks, 'shape', type(blocks).__name__)}")
    if jnp.dtype(blocks.dtype) != jnp.bool_:
        raise TypeError(f"blocks must have dtype bool, got {blocks.dtype}")
    Hm, nq, nk = blocks.shape
    if Hm not in (1, num_q_heads):
        raise ValueError(f"blocks has {Hm} heads; it must have 1 (shared) or "
                         f"num_q_heads={num_q_heads}")
    nqt, nkt = -(-q_len // tile_q), -(-kv_len // tile_kv)
    host = []
    for name, b, n, length, tile, nt in (("q_bounds", q_bounds, nq, q_len, tile_q, nqt),
                                         ("kv_bounds", kv_bounds, nk, kv_len, tile_kv, nkt)):
        shape = tuple(getattr(b, "shape", ()))
        if not (shape == (n + 1,) or shape == (Hm, n + 1)):
            raise ValueError(f"{name} must have shape [{n + 1}] or [{Hm}, {n + 1}] (blocks is "
                             f"[{Hm}, {nq}, {nk}]), got {shape or type(b).__name__}")
        if not jnp.issubdtype(b.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {b.dtype}")
        if isinstance(b, np.ndarray):
            b = b.astype(np.int32).reshape(-1, n + 1)
            _check_host_bounds(name, b, length, tile, nt)
        else:
            b = jnp.asarray(b, jnp.int32).reshape(-1, n + 1)
        host.append(b)
    qb, kb = host                                               # [Hb, n + 1], Hb in (1, Hm)
    blocks = jnp.asarray(blocks)

    qa, qz, q_own = _tile_blocks(qb, q_len, tile_q, nqt)        # [Hb, nqt] x2, [nqt]
    ka, kz, k_own = _tile_blocks(kb, kv_len, tile_kv, nkt)
    g = np.arange(abi.GRID, dtype=np.int32)
    qi = jnp.asarray(qa)[..., None] + g                        # [Hb, nqt, 4]: segment i's block
    kj = jnp.asarray(ka)[..., None] + g
    q_in = qi <= jnp.asarray(qz)[..., None]                     # segment i exists
    k_in = kj <= jnp.asarray(kz)[..., None]
    heads = jnp.arange(Hm)[:, None, None, None, None]
    cells = blocks[heads, jnp.minimum(qi, nq - 1)[:, :, None, :, None],
                   jnp.minimum(kj, nk - 1)[:, None, :, None, :]]   # [Hm, nqt, nkt, 4, 4]
    cell_ok = q_in[:, :, None, :, None] & k_in[:, None, :, None, :]
    cells &= cell_ok
    any_sel = cells.any(axis=(-2, -1))                          # [Hm, nqt, nkt]
    all_sel = (cells | ~cell_ok).all(axis=(-2, -1))

    # Cuts: the block bounds inside the tile (tile rows / keys), unused ones at the tile's own
    # extent; the rectangle is the tile's own rows x keys.
    def cuts(bounds, idx, inside, own, tile, n):
        Hb, nt = idx.shape[:2]
        at = jnp.minimum(idx[..., 1:], n).reshape(Hb, -1)
        c = jnp.take_along_axis(jnp.asarray(bounds), at, axis=1).reshape(Hb, nt, abi.GRID - 1)
        c = c - (jnp.arange(nt, dtype=jnp.int32) * tile)[:, None]
        own = jnp.asarray(own, jnp.int32)[:, None]
        return jnp.where(inside[..., 1:], jnp.clip(c, 0, own), own)   # [Hb, nt, 3]

    qcut = cuts(qb, qi, q_in, q_own, tile_q, nq)
    kcut = cuts(kb, kj, k_in, k_own, tile_kv, nk)
    bits = (cells.astype(jnp.int32)
            << (abi.GRID * g[:, None] + g[None, :])).sum(axis=(-2, -1))   # [Hm, nqt, nkt]
    q_own_j, k_own_j = jnp.asarray(q_own, jnp.int32), jnp.asarray(k_own, jnp.int32)
    rect = abi.pack_rect(jnp.zeros((nqt, nkt), jnp.int32),
                         jnp.broadcast_to(q_own_j[:, None], (nqt, nkt)),
                         jnp.zeros((nqt, nkt), jnp.int32),
                         jnp.broadcast_to(k_own_j[None, :], (nqt, nkt)))
    cuts_a = (qcut[:, :, None, 0] | (qcut[:, :, None, 1] << 8) | (qcut[:, :, None, 2] << 16)
              | (kcut[:, None, :, 0] << 24))                    # [Hb, nqt, nkt]
    cuts_b = kcut[:, None, :, 1] | (kcut[:, None, :, 2] << 8)
    grid = ~all_sel                                              # plain where all selected
    cuts_a = jnp.where(grid, cuts_a, 0)
    cuts_b = jnp.where(grid, cuts_b | (bits << abi.GRID_BITS_SHIFT), 0)
    kv_start = jnp.broadcast_to(jnp.arange(nkt, dtype=jnp.int32) * tile_kv, any_sel.shape)
    rows = jnp.stack([kv_start, jnp.broadcast_to(rect[None], any_sel.shape), cuts_a, cuts_b],
                     axis=-1)                                    # [Hm, nqt, nkt, STEP_COLS]

    # Compaction: the selected tiles of each (head, query tile), in key order.
    cnt = any_sel.sum(axis=-1, dtype=jnp.int32)                  # [Hm, nqt]
    ptr = (jnp.cumsum(cnt.reshape(-1)) - cnt.reshape(-1)).reshape(cnt.shape)
    slot = ptr[..., None] + jnp.cumsum(any_sel, axis=-1, dtype=jnp.int32) - 1
    S = Hm * nqt * nkt
    dest = jnp.where(any_sel, slot, S).reshape(-1)               # S: dropped
    steps = jnp.zeros((S, abi.STEP_COLS), jnp.int32).at[dest].set(
        rows.reshape(-1, abi.STEP_COLS), mode="drop")

    hm = np.zeros(num_q_heads, np.int32) if Hm == 1 else np.arange(num_q_heads, dtype=np.int32)
    t = np.arange(nqt, dtype=np.int32)
    units = jnp.stack([
        jnp.asarray(np.repeat(np.arange(num_q_heads, dtype=np.int32), nqt)),
        jnp.asarray(np.tile(t * tile_q, num_q_heads)),
        jnp.zeros(num_q_heads * nqt, jnp.int32),
        jnp.asarray(np.tile(q_own.astype(np.int32), num_q_heads)),
        ptr[hm].reshape(-1), cnt[hm].reshape(-1)], axis=1)

    ok = ((qz - qa + 1).max() <= abi.GRID) & ((kz - ka + 1).max() <= abi.GRID)
    for b, n, length in ((qb, nq, q_len), (kb, nk, kv_len)):
        if not isinstance(b, np.ndarray):
            ok &= (jnp.all(b[:, 0] == 0) & jnp.all(b[:, n] == length)
                   & jnp.all(b[:, 1:] > b[:, :-1]))
    return DevicePlan(units, steps, jnp.asarray(ok), int(tile_q), int(tile_kv),
                      nqt * int(tile_q), nkt * int(tile_kv), nkt)


def check(plan: DevicePlan) -> None:
    """A ``checkify`` check that the mask fitted the device planner (run the caller under
    ``jax.experimental.checkify.checkify`` to surface it; a no-op otherwise)."""
    from jax.experimental import checkify

    checkify.check(plan.ok, f"device plan: a tile meets more than {abi.GRID} blocks per axis, "
                   "or the bounds do not increase from 0 to the length")
