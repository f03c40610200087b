"""Planner: logical blocks -> physical tiles -> work units, as the int32 arrays of the plan ABI.

Pure NumPy on the host, run at trace time; knows nothing of Pallas. The output format is
documented in ``pallas_kernels/plan_abi.py``. Policies:

* ``keep``:  each selected logical block is its own K/V interval (split into tiles of ``tile_kv``
  when larger; a smaller block leaves the rest of its tile masked); every query block is its own
  row group.
* ``merge``: along keys, runs of adjacent selected blocks form one interval, tiled as a whole
  (loaded K/V reused, fewer partial tiles); along queries, adjacent query blocks with identical
  key lists share one row group, so taller work units stream K/V once.

Intervals longer than a tile are *split* into several tiles in both policies.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from pallas_kernels import plan_abi as abi

from .mask import BlockMask
from .validation import AttnShape, check_shapes

POLICIES = ("keep", "merge")


def bucket(n: int) -> int:
    """Capacity bucket >= n: the next multiple of 2^(k-3) where 2^(k-1) < n <= 2^k.

    Eight buckets per octave keep padding under ~14% while masks of similar size share one
    compiled executable.
    """
    n = max(int(n), 1)
    if n <= 8:
        return n
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A host plan: ABI arrays plus the static integers a backend compiles against."""

    template: str
    policy: str
    tile_q: int
    tile_kv: int
    shape: AttnShape
    q_len_padded: int
    kv_len_padded: int
    units: np.ndarray        # int32 [U_cap, UNIT_COLS], schedule order
    steps: np.ndarray        # int32 [S_cap, STEP_COLS]
    row_index: np.ndarray    # int32 [Hq, Lq]
    num_units: int           # real units (the rest is padding)
    num_steps: int           # real steps
    max_steps: int           # capacity >= the longest unit
    mask_digest: str
    selected_interactions: int  # summed over query heads, one batch element

    @property
    def capacities(self) -> tuple[int, int, int]:
        return (self.units.shape[0], self.steps.shape[0], self.max_steps)

    def step_counts(self) -> np.ndarray:
        return self.units[: self.num_units, abi.UNIT_STEP_CNT]

    def stats(self) -> dict:
        return _stats(self)

    def describe(self) -> str:
        s = self.stats()
        return (
            f"plan {self.template} ({self.policy}): tiles {self.tile_q}x{self.tile_kv}, "
            f"{s['units']} work units, {s['tiles']} tiles "
            f"(kept {s['kept']}, merged {s['merged']}, split {s['split']}); "
            f"selected {s['selected_interactions']:,} interactions, computed "
            f"{s['computed_interactions']:,} (waste {s['waste_fraction']:.1%}); "
            f"K/V bytes {s['kv_bytes'] / 2**20:.1f} MiB; capacities U={self.capacities[0]} "
            f"S={self.capacities[1]} M={self.capacities[2]}")


def _chunk(starts, ends, tile, align, limit):
    """Cuts intervals [starts, ends) into tiles of ``tile`` at aligned offsets inside [0, limit).

    Returns (owner, tile_start, lo, hi): the interval each tile came from, its first token and
    the selected sub-range [lo, hi) relative to the tile. Tiles that would cross ``limit`` are
    shifted back (their lo/hi shift with them), so kernels never read past the padded length.
    """
    starts = np.asarray(starts, np.int64)
    ends = np.asarray(ends, np.int64)
    a0 = (starts // align) * align
    n = -(-(ends - a0) // tile)
    owner = np.repeat(np.arange(len(starts)), n)
    first = np.cumsum(n) - n
    c = np.arange(int(n.sum())) - np.repeat(first, n)
    ts = a0[owner] + c * tile
    lo = np.maximum(starts[owner] - ts, 0)
    hi = np.minimum(ends[owner] - ts, tile)
    shift = np.maximum(ts + tile - limit, 0)
    return owner, ts - shift, lo + shift, hi + shift


def _row_groups(blocks: np.ndarray, policy: str):
    """(head, first q block, end q block) of each non-empty row group."""
    Hm, nq, _ = blocks.shape
    if policy == "merge":
        new = np.ones((Hm, nq), bool)
        new[:, 1:] = np.any(blocks[:, 1:] != blocks[:, :-1], axis=-1)
    else:
        new = np.ones((Hm, nq), bool)
    gh, gi = np.nonzero(new)
    flat = gh * nq + gi
    end_flat = np.append(flat[1:], Hm * nq)
    # A group ends at the next group's start, or at the end of its head's rows.
    ge = np.minimum(end_flat - gh * nq, nq)
    keep = blocks[gh, gi].any(axis=-1)
    return gh[keep], gi[keep], ge[keep]


def _kv_intervals(rows: np.ndarray, policy: str):
    """(group, first kv block, last kv block) of each selected interval of each row."""
    if policy == "merge":
        pad = np.zeros((rows.shape[0], 1), bool)
        prev = np.concatenate([pad, rows[:, :-1]], axis=1)
        nxt = np.concatenate([rows[:, 1:], pad], axis=1)
        g, js = np.nonzero(rows & ~prev)
        _, je = np.nonzero(rows & ~nxt)
        return g, js, je
    g, j = np.nonzero(rows)
    return g, j, j


def build_plan(mask: BlockMask, q_shape, kv_shape, dtype, *, tile_q: int, tile_kv: int,
               policy: str = "merge", q_align: int = 1, kv_align: int = 1,
               template: str | None = None) -> Plan:
    """Plans ``mask`` for q [B, Lq, Hq, D] / k, v [B, Lkv, Hkv, D] with the given tile shape."""
    shape = check_shapes(q_shape, kv_shape, dtype)
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a BlockMask, got {type(mask).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, val in (("tile_q", tile_q), ("tile_kv", tile_kv), ("q_align", q_align),
                      ("kv_align", kv_align)):
        if not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if tile_q % q_align or tile_kv % kv_align:
        raise ValueError("tile_q and tile_kv must be multiples of q_align and kv_align")
    return _build_cached(mask, shape, tile_q, tile_kv, policy, q_align, kv_align,
                         template or f"xla_{tile_q}x{tile_kv}")


@functools.lru_cache(maxsize=64)
def _build_cached(mask, shape, tile_q, tile_kv, policy, q_align, kv_align, template) -> Plan:
    from .validation import check_mask
    check_mask(mask, shape)
    Hq = shape.num_q_heads
    qb, kb = mask.q_bounds, mask.kv_bounds
    qp = _round_up(max(shape.q_len, tile_q), q_align)
    kvp = _round_up(max(shape.kv_len, tile_kv), kv_align)

    blocks = mask.blocks
    gh, gi, ge = _row_groups(blocks, policy)
    ig, js, je = _kv_intervals(blocks[gh, gi], policy)
    # K/V tiles of each row group (identical for all units of the group).
    own, kvs, klo, khi = _chunk(kb[js], kb[je + 1], tile_kv, kv_align, kvp)
    tile_group = ig[own]
    order = np.argsort(tile_group, kind="stable")
    tile_group, kvs, klo, khi = tile_group[order], kvs[order], klo[order], khi[order]
    G = len(gh)
    g_nsteps = np.bincount(tile_group, minlength=G)
    g_first = np.cumsum(g_nsteps) - g_nsteps

    # Units: each row group's query rows cut into tiles of tile_q.
    ug, qs, qlo, qhi = _chunk(qb[gi], qb[ge], tile_q, q_align, qp)
    uh = gh[ug]
    if mask.num_heads == 1 and Hq > 1:
        n1 = len(ug)
        uh = np.repeat(np.arange(Hq), n1)
        ug, qs, qlo, qhi = (np.tile(x, Hq) for x in (ug, qs, qlo, qhi))
    cnt = g_nsteps[ug]

    # Schedule: heaviest units first (cost ~ steps), heads interleaved among equals.
    sched = np.lexsort((uh, qs, -cnt))
    ug, uh, qs, qlo, qhi, cnt = (x[sched] for x in (ug, uh, qs, qlo, qhi, cnt))
    U = len(ug)

    # Steps: a unit's steps are its group's tiles with the unit's own rows. Units of a shared
    # group share nothing in memory (rows differ), so steps are laid out per unit.
    S = int(cnt.sum())
    ptr = np.cumsum(cnt) - cnt
    su = np.repeat(np.arange(U), cnt)
    tix = g_first[ug][su] + (np.arange(S) - ptr[su])
    U_cap, S_cap = bucket(U), bucket(S)
    max_cnt = int(cnt.max()) if U else 0
    M = bucket(max_cnt)

    units = np.zeros((U_cap, abi.UNIT_COLS), np.int32)
    units[:U, abi.UNIT_HEAD] = uh
    units[:U, abi.UNIT_Q_START] = qs
    units[:U, abi.UNIT_OWN_LO] = qlo
    units[:U, abi.UNIT_OWN_HI] = qhi
    units[:U, abi.UNIT_STEP_PTR] = ptr
    units[:U, abi.UNIT_STEP_CNT] = cnt
    steps = np.zeros((S_cap, abi.STEP_COLS), np.int32)
    steps[:S, abi.STEP_KV_START] = kvs[tix]
    steps[:S, abi.STEP_Q_LO] = qlo[su]
    steps[:S, abi.STEP_Q_HI] = qhi[su]
    steps[:S, abi.STEP_KV_LO] = klo[tix]
    steps[:S, abi.STEP_KV_HI] = khi[tix]

    row_index = np.full((Hq, shape.q_len), U_cap * tile_q, np.int32)
    nrows = qhi - qlo
    ru = np.repeat(np.arange(U), nrows)
    r = np.arange(int(nrows.sum())) - np.repeat(np.cumsum(nrows) - nrows, nrows) + qlo[ru]
    row_index[uh[ru], qs[ru] + r] = ru * tile_q + r
    for a in (units, steps, row_index):
        a.setflags(write=False)
    return Plan(template=template, policy=policy, tile_q=tile_q, tile_kv=tile_kv, shape=shape,
                q_len_padded=qp, kv_len_padded=kvp, units=units, steps=steps,
                row_index=row_index, num_units=U, num_steps=S, max_steps=M,
                mask_digest=mask.digest,
                selected_interactions=mask.selected_interactions(Hq))


def _stats(plan: Plan) -> dict:
    U, S = plan.num_units, plan.num_steps
    st = plan.steps[:S].astype(np.int64)
    tiles = S
    computed = tiles * plan.tile_q * plan.tile_kv
    sel = plan.selected_interactions
    full = ((st[:, abi.STEP_Q_LO] == 0) & (st[:, abi.STEP_Q_HI] == plan.tile_q)
            & (st[:, abi.STEP_KV_LO] == 0) & (st[:, abi.STEP_KV_HI] == plan.tile_kv))
    itemsize = np.dtype(plan.shape.dtype).itemsize
    kv_bytes = tiles * plan.tile_kv * plan.shape.head_dim * itemsize * 2
    cnt = plan.step_counts().astype(np.int64)
    cost = cnt * (plan.tile_q * plan.tile_kv) + 1  # interactions per unit (+1: never zero)
    return {
        "template": plan.template,
        "policy": plan.policy,
        "tile_q": plan.tile_q,
        "tile_kv": plan.tile_kv,
        "units": U,
        "tiles": tiles,
        "full_tiles": int(full.sum()),
        "partial_tiles": int(tiles - full.sum()),
        "selected_interactions": int(sel),
        "computed_interactions": int(computed),
        "waste_fraction": float(1.0 - sel / computed) if computed else 0.0,
        "kv_bytes": int(kv_bytes),
        "max_unit_cost": int(cost.max()) if U else 0,
        "balance": float(cost.mean() / cost.max()) if U else 1.0,
        "kept": 0, "merged": 0, "split": 0,
        "capacities": plan.capacities,
    }
