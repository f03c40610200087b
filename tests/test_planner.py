"""Planner properties: exact cover of the selected set (every step evaluated with
``abi.step_mask``: plain, grid and bitmap steps), ABI invariants, tiles once (a unit visits a K/V
tile once: tests/test_tiles_once.py, tests/test_bitmap_steps.py), stats, schedule, executor."""

import contextlib
import dataclasses
import inspect
import itertools
import time

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera_jax as tj
from pallas_kernels import abi
from tessera_jax.planning import loops as plan_loops
import plan_oracle
from strategies import bounds_from_sizes, heads_and_blocks
from tessera_jax.planning import planner
from tessera_jax.planning import schedule
from tessera_jax.planning.config import PlannerConfig
from tessera_jax.planning.planner import TILE_POLICIES as POLICIES, build_plan, bucket
from tessera_jax.validation import AttnShape

TILES = [(tq, tk) for tq in (64, 128) for tk in (64, 128, 192)]   # kv_hi >= 128: bit 31


@st.composite
def wild_bounds(draw, max_len=700):
    """Bounds mixing 1-token blocks with blocks of hundreds of tokens."""
    sizes = draw(st.lists(st.one_of(st.integers(1, 3), st.integers(4, 70),
                                    st.integers(150, 400)), min_size=1, max_size=9))
    return bounds_from_sizes(sizes, max_len)


@st.composite
def plan_masks(draw):
    """(mask, Hq, Hkv): per-head (some heads repeated) or shared, with empty rows."""
    qb, kb = draw(wild_bounds()), draw(wild_bounds())
    Hq, Hkv, blocks, rng = heads_and_blocks(draw, len(qb) - 1, len(kb) - 1,
                                            [0.0, 0.1, 0.4, 0.8, 1.0])
    if blocks.shape[0] > 1 and draw(st.booleans()):
        blocks[-1] = blocks[0]                      # repeated head masks share their steps
    if blocks.shape[1] > 1 and draw(st.booleans()):
        blocks[:, rng.integers(blocks.shape[1])] = False   # an empty query-block row
    return tj.BlockMask(qb, kb, blocks), Hq, Hkv


def _plan(mask, Hq, Hkv, tq, tk, policy, q_align=1, kv_align=1, dtype=jnp.float32, D=16,
          config=None):
    return build_plan(mask, (1, mask.Lq, Hq, D), (1, mask.Lkv, Hkv, D), dtype, tile_q=tq,
                      tile_kv=tk, policy=policy, q_align=q_align, kv_align=kv_align,
                      config=config)


def _coverage(plan):
    """How many steps select each (head, query, key): int [Hq, Lq, Lkv], every step evaluated
    with ``abi.step_mask`` (``plan_oracle.coverage``); ``tile_cells`` gives the same."""
    cov = plan_oracle.coverage(plan)
    Hq, Lq, Lkv = plan.shape.num_q_heads, plan.shape.q_len, plan.shape.kv_len
    t = plan.tile_cells()
    d = np.zeros((Hq, plan.q_len_padded + 1, plan.kv_len_padded + 1), np.int64)
    for (r, c), sgn in (((t["r0"], t["c0"]), 1), ((t["r0"], t["c1"]), -1),
                        ((t["r1"], t["c0"]), -1), ((t["r1"], t["c1"]), 1)):
        np.add.at(d, (t["head"], r, c), sgn)
    np.testing.assert_array_equal(d.cumsum(1).cumsum(2)[:, :Lq, :Lkv], cov)
    return cov


def _check_abi(plan, mask, q_align=1, kv_align=1):
    Hq, Lq, Lkv = plan.shape.num_q_heads, plan.shape.q_len, plan.shape.kv_len
    tq, tk, U, S = plan.tile_q, plan.tile_kv, plan.num_units, plan.num_steps
    u = plan.units.astype(np.int64)
    s = abi.unpack_steps(plan.steps).astype(np.int64)
    for a in (plan.units, plan.steps, plan.row_index):
        assert a.dtype == np.int32
    assert plan.units.shape == (bucket(U), abi.UNIT_COLS)
    assert plan.steps.shape == (bucket(S + plan.bitmap_rows), abi.STEP_COLS)
    assert plan.row_index.shape == (Hq, Lq)
    assert plan.q_len_padded >= Lq and plan.kv_len_padded >= Lkv
    assert plan.q_len_padded % q_align == 0 and plan.kv_len_padded % kv_align == 0
    # Padding rows select nothing (rows past the plan's steps and bitmap words are zero);
    # grids and bitmaps are valid.
    assert (u[U:, abi.UNIT_OWN_LO] == u[U:, abi.UNIT_OWN_HI]).all()
    assert (u[U:, abi.UNIT_STEP_CNT] == 0).all()
    assert not plan.steps[S + plan.bitmap_rows:].any()
    assert abi.grid_problems(plan.steps[:S]) == []
    step_rows = np.arange(len(plan.steps)) < S
    bad, words_at = abi.bitmap_problems(plan.steps, np.arange(S), tq, tk, step_rows)
    assert bad == [] and words_at.sum() == plan.bitmap_rows
    assert words_at[S:S + plan.bitmap_rows].all()
    ur = u[:U]
    # Tiles inside the padded lengths, starts aligned, owned rows inside the tile and real rows.
    qs = ur[:, abi.UNIT_Q_START]
    assert (qs >= 0).all() and (qs + tq <= plan.q_len_padded).all()
    assert (qs % q_align == 0).all()
    lo, hi = ur[:, abi.UNIT_OWN_LO], ur[:, abi.UNIT_OWN_HI]
    assert (0 <= lo).all() and (lo < hi).all() and (hi <= tq).all() and (qs + hi <= Lq).all()
    assert ((0 <= ur[:, abi.UNIT_HEAD]) & (ur[:, abi.UNIT_HEAD] < Hq)).all()
    cnt, ptr = ur[:, abi.UNIT_STEP_CNT], ur[:, abi.UNIT_STEP_PTR]
    assert (cnt >= 1).all() and (ptr >= 0).all() and (ptr + cnt <= S).all()
    assert U == 0 or plan.max_steps >= cnt.max()
    t = plan.tile_rects()
    ks = t["k0"]
    assert (ks >= 0).all() and (ks + tk <= plan.kv_len_padded).all()
    assert (ks % kv_align == 0).all()
    st_ = s[t["step"]]
    assert (0 <= st_[:, abi.VIEW_KV_LO]).all()
    assert (st_[:, abi.VIEW_KV_LO] < st_[:, abi.VIEW_KV_HI]).all()
    assert (st_[:, abi.VIEW_KV_HI] <= tk).all()
    assert (st_[:, abi.VIEW_Q_LO] >= lo[t["unit"]]).all()
    assert (st_[:, abi.VIEW_Q_HI] <= hi[t["unit"]]).all()
    assert (st_[:, abi.VIEW_Q_LO] < st_[:, abi.VIEW_Q_HI]).all()
    # Units of a head own disjoint rows; row_index points at the owner, or the sentinel.
    expect = np.full((Hq, Lq), plan.units.shape[0] * tq, np.int64)
    owned = np.zeros((Hq, Lq), np.int64)
    for k in range(U):
        h, q0 = ur[k, abi.UNIT_HEAD], qs[k]
        owned[h, q0 + lo[k]: q0 + hi[k]] += 1
        expect[h, q0 + lo[k]: q0 + hi[k]] = k * tq + np.arange(lo[k], hi[k])
    assert owned.max() <= 1, "two units own one row"
    np.testing.assert_array_equal(plan.row_index, expect)
    # Exact cover: every selected interaction once, nothing else (so every unselected entry of a
    # computed tile is masked), each step's selection by the kernels' rule (abi.step_mask).
    tm = mask.token_mask().astype(np.int64)
    tm = np.broadcast_to(tm, (Hq, Lq, Lkv)) if mask.num_heads == 1 else tm
    cov = _coverage(plan)
    np.testing.assert_array_equal(cov, tm)
    # A row with a selected key is owned.
    assert (owned >= tm.any(-1)).all()
    return t


def _direct_kinds(plan, t):
    """kept / merged / split per tile, counted directly from token-level block ids: a visit is
    split if a logical block it selects part of is not wholly selected by it, else merged if it
    selects several blocks, else kept (its selection by ``abi.step_mask``)."""
    m = plan.mask
    qid = np.repeat(np.arange(len(m.q_sizes)), m.q_sizes)
    kid = np.repeat(np.arange(len(m.kv_sizes)), m.kv_sizes)
    out = np.zeros(3, np.int64)
    tq, tk = plan.tile_q, plan.tile_kv
    for v in range(len(t["r0"])):
        sel = abi.step_mask(plan.steps, t["step"][v], tq, tk)
        r, c = np.nonzero(sel)
        r, c = r + t["q0"][v], c + t["k0"][v]
        blocks, n = np.unique(np.stack([qid[r], kid[c]], 1), axis=0, return_counts=True)
        whole = (n == m.q_sizes[blocks[:, 0]] * m.kv_sizes[blocks[:, 1]]).all()
        out[2 if not whole else (1 if len(blocks) > 1 else 0)] += 1
    return out


def _check_stats(plan, mask, t):
    s = plan.stats()
    for key in ("template", "tile_q", "tile_kv", "tiles", "selected_interactions",
                "computed_interactions", "kept", "merged", "split", "waste_fraction",
                "kv_bytes", "max_unit_cost", "balance", "dense_interactions",
                "dense_tile_interactions", "tile_revisits", "grid_steps", "bitmap_steps",
                "fallback_heads"):
        assert key in s, key
    Hq = plan.shape.num_q_heads
    tiles = int(plan.step_counts().sum())
    assert s["tiles"] == tiles == len(t["r0"])
    assert s["selected_interactions"] == mask.selected_interactions(Hq)
    c = plan.tile_cells(t)
    assert s["selected_interactions"] == int(((c["r1"] - c["r0"]) * (c["c1"] - c["c0"])).sum())
    assert s["computed_interactions"] == tiles * plan.tile_q * plan.tile_kv
    assert s["dense_interactions"] == plan.shape.q_len * plan.shape.kv_len * Hq
    assert s["dense_tile_interactions"] == Hq * planner.dense_tile_interactions(
        plan.shape.q_len, plan.shape.kv_len, plan.tile_q, plan.tile_kv)
    assert s["grid_steps"] == int(t["grid"].sum())
    assert s["bitmap_steps"] == int(t["bitmap"].sum())
    cb = plan.steps[t["step"], abi.STEP_CUTS_B]
    assert (t["grid"] == ((cb != 0) & (cb != abi.BITMAP_FLAG))).all()
    assert (t["bitmap"] == (cb == abi.BITMAP_FLAG)).all()
    seen = set()
    revisits = 0
    for unit, k0 in zip(t["unit"].tolist(), t["k0"].tolist()):
        revisits += (unit, k0) in seen
        seen.add((unit, k0))
    assert s["tile_revisits"] == revisits == 0          # tiles once, always
    if tiles:
        assert s["waste_fraction"] == pytest.approx(
            1 - s["selected_interactions"] / s["computed_interactions"])
    item = np.dtype(plan.shape.dtype).itemsize
    assert s["kv_bytes"] == tiles * 2 * plan.tile_kv * plan.shape.head_dim * item
    assert s["kept"] + s["merged"] + s["split"] == tiles
    full = ((t["r0"] == t["q0"]) & (t["r1"] == t["q1"]) & (t["c0"] == t["k0"])
            & (t["c1"] == t["k1"]) & ~t["grid"] & ~t["bitmap"])
    assert s["full_tiles"] == int(full.sum())
    assert plan.all_full == bool(full.all())          # exact, or the kernel would not mask
    assert 0 < s["balance"] <= 1.0 + 1e-12
    if plan.num_units:
        assert s["max_unit_cost"] == pytest.approx(float(plan.unit_cost.max()))
    return s


@given(plan_masks(), st.sampled_from([1, 8, 16]), st.sampled_from([1, 8, 64]))
# 25 examples, random each run: each plans and checks 6 tile shapes x 5 policies (~0.5 s).
@settings(max_examples=25)
def test_every_policy_and_tile_covers_selected_set_exactly(mt, q_align, kv_align):
    mask, Hq, Hkv = mt
    for (tq, tk), policy in itertools.product(TILES, POLICIES):
        p = _plan(mask, Hq, Hkv, tq, tk, policy, q_align, kv_align)
        t = _check_abi(p, mask, q_align, kv_align)
        _check_stats(p, mask, t)


@given(plan_masks(), st.sampled_from(TILES), st.sampled_from(POLICIES))
@settings(max_examples=25)
def test_kept_merged_split_match_direct_count(mt, tile, policy):
    mask, Hq, Hkv = mt
    p = _plan(mask, Hq, Hkv, *tile, policy)
    t = p.tile_rects()
    s = p.stats()
    np.testing.assert_array_equal([s["kept"], s["merged"], s["split"]], _direct_kinds(p, t))


@given(plan_masks(), st.sampled_from([(64, 64), (64, 128), (128, 64), (128, 128)]),
       st.sampled_from(POLICIES), st.integers(0, 2**31 - 1))
# 8 examples, random each run: each compiles the executor and the reference (~1 s).
@settings(max_examples=8)
def test_xla_executor_matches_reference(mt, tile, policy, seed):
    mask, Hq, Hkv = mt
    rng = np.random.default_rng(seed)
    B, D = 2, 16
    q = jnp.asarray(rng.standard_normal((B, mask.Lq, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, mask.Lkv, Hkv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, mask.Lkv, Hkv, D)), jnp.float32)
    tq, tk = tile
    out, lse = tj.sparse_attention(q, k, v, mask, backend="xla", template=f"xla_{tq}x{tk}",
                                   policy=policy, return_lse=True)
    ref, ref_lse = tj.reference_attention(q, k, v, mask, return_lse=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_all_full_on_aligned_and_partial_masks(policy):
    """Plan.all_full (no masking anywhere) holds for tile-aligned masks and not once a block
    or the sequence end cuts a tile."""
    rng = np.random.default_rng(5)
    blocks = rng.random((2, 4, 6)) < 0.5
    blocks[:, :, 0] = True
    aligned = tj.BlockMask.uniform(512, 768, 128, 128, blocks)
    p = _plan(aligned, 2, 2, 128, 128, policy)
    assert p.all_full and p.maybe_all_full
    cut = tj.BlockMask.uniform(500, 768, 128, 128, blocks)       # last query block: 116 rows
    assert not _plan(cut, 2, 2, 128, 128, policy).all_full
    small = tj.BlockMask.uniform(512, 768, 64, 64, np.repeat(np.repeat(blocks, 2, 1), 2, 2))
    ps = _plan(small, 2, 2, 128, 128, policy)
    # keep plans a 128-row unit per 64-row block, a tile per 64-key block (partial tiles, twice
    # dense): both heads fall back to split, which tiles the 128-aligned selection whole.
    assert ps.all_full
    assert ps.stats()["fallback_heads"] == (2 if policy == "keep" else 0)
    raw = planner._plan_policy(_ctx(small, 128, 128, 1, 1), policy if policy != "auto" else
                               "merge", share=False)
    assert (raw.nfull == raw.cnt).all() == (policy != "keep")
    assert not _plan(tj.BlockMask.uniform(512, 768, 64, 64, rng.random((2, 8, 12)) < .3),
                     2, 2, 128, 128, policy).all_full


def test_policies_differ_as_documented():
    # 8 query blocks of 32 rows, 8 key blocks of 32 keys; rows 0-3 identical, a key run of 3.
    blocks = np.zeros((8, 8), bool)
    blocks[:4, 1:4] = True
    blocks[4, 0] = blocks[5, 7] = True
    m = tj.BlockMask.uniform(256, 256, 32, 32, blocks)
    stats = {p: _plan(m, 1, 1, 64, 64, p).stats() for p in ("keep", "merge", "split")}
    # keep: one tile per selected block (12 + 2), every one a whole single block.
    assert stats["keep"]["tiles"] == 14 and stats["keep"]["kept"] == 14
    # merge: rows 0-3 are one group (two 64-row units), their run of 3 blocks = 96 keys ->
    # 2 tiles each; rows 4 and 5 one tile each.
    assert stats["merge"]["units"] == 4 and stats["merge"]["tiles"] == 6
    # split: tiles on the 64-grid; a 32-block-aligned mask is cut along block edges only.
    t = _plan(m, 1, 1, 64, 64, "split").tile_rects()
    assert (t["q0"] % 64 == 0).all() and (t["k0"] % 64 == 0).all()
    assert stats["split"]["split"] == 0 and stats["split"]["merged"] > 0
    # ... while 48-token blocks cross the grid lines and are split there.
    m48 = tj.BlockMask.uniform(240, 240, 48, 48, np.ones((5, 5), bool))
    s48 = _plan(m48, 1, 1, 64, 64, "split").stats()
    # 4x4 grid cells; the last cell [192, 240) x [192, 240) is exactly block (4, 4).
    assert s48["tiles"] == 16 and s48["split"] == 15 and s48["kept"] == 1
    assert s48["full_tiles"] == 9
    for s in stats.values():
        assert s["selected_interactions"] == 4 * 3 * 32 * 32 + 2 * 32 * 32


def test_pack_shares_units_between_short_query_blocks():
    # 64-token query blocks, windows of 3 key blocks shifted by one per row: merge gives one
    # 128-row unit per 64-row block; pack puts two blocks in one unit, with an L-shaped cover.
    n = 8
    blocks = np.zeros((n, n), bool)
    for i in range(n):
        blocks[i, max(0, i - 1): i + 2] = True
    m = tj.BlockMask.uniform(64 * n, 64 * n, 64, 64, blocks)
    merge = _plan(m, 1, 1, 128, 128, "merge").stats()
    pack = _plan(m, 1, 1, 128, 128, "pack").stats()
    assert merge["units"] == n and pack["units"] == n // 2
    assert pack["computed_interactions"] < merge["computed_interactions"]
    assert pack["selected_interactions"] == merge["selected_interactions"]


def test_large_block_is_split_into_tiles():
    m = tj.BlockMask(np.array([0, 300]), np.array([0, 1, 500]), np.array([[[False, True]]]))
    for policy in ("keep", "merge", "split", "pack"):
        s = _plan(m, 1, 1, 128, 128, policy).stats()
        assert s["tiles"] >= 3 * 4 and s["split"] == s["tiles"], (policy, s)


def test_auto_picks_the_cheapest_policy_per_head():
    rng = np.random.default_rng(0)
    qb = np.concatenate([[0], np.cumsum(rng.integers(1, 90, 12))])
    blocks = rng.random((3, 12, 12)) < np.array([0.05, 0.5, 1.0])[:, None, None]
    m = tj.BlockMask(qb, qb, blocks)
    costs = {}
    for p in POLICIES:
        plan = _plan(m, 3, 1, 64, 128, p)
        costs[p] = np.bincount(plan.units[: plan.num_units, abi.UNIT_HEAD],
                               weights=plan.unit_cost, minlength=3)
    best = np.min([costs[p] for p in POLICIES if p != "auto"], axis=0)
    np.testing.assert_allclose(costs["auto"], best)
    auto = _plan(m, 3, 1, 64, 128, "auto")
    assert set(auto.head_policies) <= {"merge", "split", "pack"}
    assert "auto" in auto.describe()


@given(plan_masks(), st.sampled_from(TILES), st.sampled_from([1, 8]))
@settings(max_examples=30)
def test_merge_never_has_more_units_or_steps_than_keep(mt, tile, align):
    """The policies as they plan (before build_plan's fallback to split, which may replace
    either on some heads)."""
    mask, Hq, Hkv = mt
    ctx = _ctx(mask, *tile, align, align)
    k = planner._plan_policy(ctx, "keep", share=False)
    m = planner._plan_policy(ctx, "merge", share=False)
    assert len(m.cnt) <= len(k.cnt)
    assert m.cnt.sum() <= k.cnt.sum()
    shape = AttnShape(1, mask.Lq, mask.Lkv, Hq, Hkv, 16, np.dtype(np.float32))
    cost = lambda r: planner._raw_costs(r, ctx, shape, schedule.DEFAULT_COST_MODEL).sum()
    assert cost(m) <= cost(k) + 1e-6


def test_schedule_heaviest_first_heads_interleaved():
    rng = np.random.default_rng(1)
    blocks = rng.random((4, 16, 16)) < 0.3
    blocks[:, :2] = True                                   # two heavy query blocks per head
    m = tj.BlockMask.uniform(1024, 1024, 64, 64, blocks)
    p = _plan(m, 4, 2, 64, 64, "merge")
    cost = p.unit_cost
    cls = np.floor(np.log2(cost) * 8)
    assert (np.diff(cls) <= 0).all(), "units not in non-increasing cost class"
    u = p.units[: p.num_units]
    heads = u[:4, abi.UNIT_HEAD]
    assert len(set(heads.tolist())) == 4, "the heaviest units should come from all heads"
    assert schedule.balance(cost, 132) <= 1.0


def test_cost_model_and_balance():
    m = schedule.CostModel()
    c = schedule.unit_costs([1, 2], [0, 2], tile_q=128, tile_kv=128, head_dim=128, itemsize=2)
    step = m.step_ns_total(128, 128, 128, 2)
    np.testing.assert_allclose(c, [m.unit_ns + step, m.unit_ns + 2 * step + 2 * m.mask_ns])
    assert schedule.balance([5.0] * 132, 132) == pytest.approx(1.0)
    assert schedule.makespan([10, 1, 1, 1], 2) == 10
    assert schedule.balance([3, 3, 2, 2, 2], 2) == pytest.approx(6 / 7)
    with pytest.raises(ValueError, match="step_ns"):
        schedule.CostModel(step_ns=-1.0)
    with pytest.raises(ValueError, match="num_sms"):
        schedule.CostModel(num_sms=0)


def test_shared_mask_units_share_steps_and_repeated_heads_too():
    rng = np.random.default_rng(2)
    blocks = rng.random((1, 10, 10)) < 0.4
    shared = tj.BlockMask.uniform(640, 640, 64, 64, blocks)
    per_head = tj.BlockMask.uniform(640, 640, 64, 64, np.repeat(blocks, 4, axis=0))
    ps = _plan(shared, 4, 4, 64, 64, "merge")
    ph = _plan(per_head, 4, 4, 64, 64, "merge")
    assert ps.num_steps == ph.num_steps and ps.num_units == ph.num_units == 4 * ps.num_units // 4
    assert ps.stats()["tiles"] == 4 * ps.num_steps


def _unit_lists(plan):
    """Each unit's fields but its step pointer, and its steps (kv_start and selection, as
    bytes: a bitmap step's offset differs between layouts, its words do not)."""
    u = plan.units[: plan.num_units]
    view = abi.unpack_steps(plan.steps[: plan.num_steps])
    rows = [view[p:p + c, :1].tobytes()
            + abi.step_mask(plan.steps, np.arange(p, p + c), plan.tile_q, plan.tile_kv).tobytes()
            for p, c in u[:, [4, 5]]]
    return np.delete(u, 4, axis=1), rows


@given(plan_masks(), st.sampled_from(TILES), st.sampled_from(POLICIES))
@settings(max_examples=30, deadline=None)
def test_shared_step_lists_change_only_pointers_and_storage(mt, tile, policy):
    """Consecutive units with equal step lists point at one copy: every unit visits exactly the
    rows it visits without sharing, and the plan stores no more rows."""
    mask, Hq, Hkv = mt
    shared = _plan(mask, Hq, Hkv, *tile, policy)
    assert PlannerConfig().share_step_lists
    plain = _plan(mask, Hq, Hkv, *tile, policy, config=PlannerConfig(share_step_lists=False))
    a_units, a_rows = _unit_lists(shared)
    b_units, b_rows = _unit_lists(plain)
    np.testing.assert_array_equal(a_units, b_units)
    assert a_rows == b_rows
    assert shared.num_steps <= plain.num_steps and shared.steps.shape[0] <= plain.steps.shape[0]
    assert shared.bitmap_rows <= plain.bitmap_rows
    assert not shared.steps[shared.num_steps + shared.bitmap_rows:].any()   # padding rows: zero
    assert shared.all_full == plain.all_full


def test_all_selected_mask_stores_one_list_per_unit_height():
    """An all-selected mask: every full-height unit streams the same tiles, so the plan keeps
    two lists per head-distinct mask (full height, and the short last unit), not one per unit."""
    L, tq, tk = 1000, 128, 64
    mask = tj.BlockMask.uniform(L, L, 100, 100, np.ones((1, 10, 10), bool))
    planner._build_cached.cache_clear()
    p = _plan(mask, 4, 2, tq, tk, "merge")
    n_kv = -(-L // tk)
    assert p.num_units == 4 * -(-L // tq) and p.num_steps == 2 * n_kv
    assert int(p.step_counts().sum()) == p.num_units * n_kv
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, L, 4, 16)), jnp.float32)
    k = jnp.asarray(np.random.default_rng(1).standard_normal((1, L, 2, 16)), jnp.float32)
    out = tj.sparse_attention(q, k, k, mask, backend="xla", template=f"xla_{tq}x{tk}",
                              policy="merge")
    np.testing.assert_allclose(np.asarray(out), np.asarray(tj.reference_attention(q, k, k, mask)),
                               atol=2e-5, rtol=2e-5)


def test_bucket_and_padding():
    assert [bucket(n) for n in (0, 1, 5, 8, 9, 17, 100, 1000)] == [1, 1, 5, 8, 10, 20, 112, 1024]
    for n in range(1, 5000, 37):
        b = bucket(n)
        assert n <= b <= n * 1.25
    # Few distinct capacities: masks of similar size share one compiled executable.
    assert len({bucket(n) for n in range(1025, 2049)}) == 4


def test_plan_is_cached_by_digest():
    rng = np.random.default_rng(3)
    blocks = rng.random((2, 20, 20)) < 0.2
    m1 = tj.BlockMask.uniform(1280, 1280, 64, 64, blocks)
    m2 = tj.BlockMask.uniform(1280, 1280, 64, 64, blocks.copy())   # equal content, new object
    args = ((1, 1280, 2, 64), (1, 1280, 2, 64), jnp.bfloat16)
    p1 = tj.plan(m1, *args, template="xla_64x64", policy="merge")
    assert tj.plan(m2, *args, template="xla_64x64", policy="merge") is p1
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        tj.plan(m2, *args, template="xla_64x64", policy="merge")
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 200e-6, per_call      # the target is 50 us; loose for a loaded CI host


def test_describe_and_stats_keys():
    m = tj.BlockMask.uniform(300, 200, 50, 40, np.eye(6, 5, dtype=bool))
    p = _plan(m, 2, 1, 64, 128, "merge")
    d = p.describe()
    for word in ("merge", "64x128", "tiles", "waste", "K/V"):
        assert word in d
    s = p.stats()
    assert s["template"] == "xla_64x128" and s["policy"] == "merge"
    s["tiles"] = -1
    assert p.stats()["tiles"] != -1, "stats() must return a copy"


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(policy="fancy"), ValueError, "policy"),
    (dict(tile_q=0), ValueError, "tile_q"),
    (dict(tile_kv=96, kv_align=64), ValueError, "kv_align"),
    (dict(tile_q=64, q_align=48), ValueError, "q_align"),
    (dict(tile_q=True), ValueError, "tile_q"),
    (dict(cost_model="fast"), TypeError, "cost_model"),
    (dict(row_group=48), ValueError, "row_group"),
    (dict(row_group=0), ValueError, "row_group"),
    (dict(row_group=True), ValueError, "row_group"),
])
def test_bad_arguments(kwargs, exc, match):
    m = tj.BlockMask.uniform(128, 128, 64, 64, np.ones((2, 2), bool))
    args = dict(tile_q=64, tile_kv=64)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        build_plan(m, (1, 128, 1, 16), (1, 128, 1, 16), jnp.float32, **args)
    with pytest.raises(TypeError, match="mask"):
        build_plan(np.ones((2, 2), bool), (1, 128, 1, 16), (1, 128, 1, 16), jnp.float32,
                   tile_q=64, tile_kv=64)
    with pytest.raises(ValueError, match="Lq"):
        build_plan(m, (1, 100, 1, 16), (1, 128, 1, 16), jnp.float32, tile_q=64, tile_kv=64)


def test_bit_helpers_match_numpy():
    rng = np.random.default_rng(4)
    for n, dens in ((1, 0.5), (63, 0.3), (64, 0.9), (65, 0.05), (300, 0.5), (300, 0.01)):
        rows = rng.random((7, n)) < dens
        w = planner._pack(rows)
        r, pos = plan_oracle._bit_positions(w)
        er, ep = np.nonzero(rows)
        np.testing.assert_array_equal(r, er)
        np.testing.assert_array_equal(pos, ep)
        rr, s, e = plan_oracle._runs(w)
        pad = np.pad(rows, ((0, 0), (1, 1)))
        d = np.diff(pad.astype(np.int8), axis=1)
        sr, ss = np.nonzero(d == 1)
        _, ee = np.nonzero(d == -1)
        np.testing.assert_array_equal(rr, sr)
        np.testing.assert_array_equal(s, ss)
        np.testing.assert_array_equal(e, ee)


def _with_pass(raw, tq, tk):
    """A raw plan of the NumPy oracle (its steps as the policy's loops join them into grid
    steps) after the bitmap pass's specification (``plan_oracle.bitmap_steps``: one step per
    (unit, K/V tile), words after the step rows), as the compiled policies leave theirs:
    (raw, revisits per unit)."""
    got = plan_oracle.bitmap_steps(raw.steps, raw.first, raw.cnt, tq, tk)
    if got is None:
        return raw, np.zeros(len(raw.cnt), np.int64)
    steps, ptr, cnt, S, W = got
    full = ((steps[:S, abi.STEP_RECT] == abi.full_rect(tq, tk))
            & (steps[:S, abi.STEP_CUTS_B] == 0)).astype(np.int64)
    F = np.r_[0, np.cumsum(full)]
    assert (ptr == np.cumsum(cnt) - cnt).all()          # oracle rows: consecutive, unshared
    return dataclasses.replace(raw, cnt=cnt, steps=steps, nfull=F[ptr + cnt] - F[ptr],
                               words=W), raw.cnt - cnt


def _assert_same_raw(got, want, ctx, expect=None):
    """A compiled policy's raw plan equals the NumPy oracle's after the bitmap pass's
    specification (``_with_pass``, or ``expect``: its result), field by field and step by step,
    bitmap words included; its revisits and the full steps the pass made as the
    specification's. A ``pending`` raw (keep/merge's loops) equals the oracle's rows as they
    are, its revisits counted."""
    post, rev = _with_pass(want, ctx.tile_q, ctx.tile_kv) if expect is None else expect
    np.testing.assert_array_equal(got.rev, rev, err_msg="rev")
    if got.pending:
        post = want
    else:
        np.testing.assert_array_equal(got.njoin, post.nfull - want.nfull, err_msg="njoin")
    for f in ("head", "qs", "lo", "hi", "cnt", "nfull", "area", "words"):
        np.testing.assert_array_equal(getattr(got, f), getattr(post, f), err_msg=f)
    assert got.steps.shape == post.steps.shape and got.steps.dtype == np.int32
    n = got.num_steps
    np.testing.assert_array_equal(abi.unpack_steps(got.steps[:n]), abi.unpack_steps(post.steps[:n]))
    np.testing.assert_array_equal(got.steps, post.steps)


# (NumPy oracle, compiled policy) of split and pack.
_SPLIT_PACK = ((plan_oracle._plan_grid_numpy, planner._plan_grid),
               (plan_oracle._plan_pack_numpy, planner._plan_pack))
_SPLIT_PACK_BY_POLICY = tuple((fn, oracle) for oracle, fn in _SPLIT_PACK)


def _assert_split_pack_match_oracle(mask, tilings):
    """Compiled split and pack equal their oracles for each (tq, tk, q_align, kv_align)."""
    for tq, tk, qal, kal in tilings:
        ctx = _ctx(mask, tq, tk, qal, kal)
        for numpy_fn, fn in _SPLIT_PACK:
            _assert_same_raw(fn(ctx), numpy_fn(ctx), ctx)


def _on_threads(ctx, n, **options):
    """``ctx`` with the planner on ``n`` threads, splitting work of any size (no minimum), and
    any other ``PlannerConfig`` fields as given (e.g. ``max_bound_bytes=0`` for the
    exact-count path); its other fields kept (the compiled loops: "auto" would raise
    ``NotReady`` on a fresh install before numba has compiled them)."""
    cfg = dataclasses.replace(ctx.cfg, threads=n, par_min_rows=0, wide_min_rows=0, **options)
    return dataclasses.replace(ctx, cfg=cfg)


def _ctx(mask, tq, tk, q_align, kv_align, kv_len=None):
    """A planner context whose loops run compiled (these tests compare the compiled loops with
    their oracles; "auto" would raise ``NotReady`` on a large call before they are ready)."""
    kv_len = mask.Lkv if kv_len is None else kv_len
    qp = planner._round_up(max(mask.Lq, tq), q_align)
    kvp = planner._round_up(max(kv_len, tk), kv_align)
    words, _ = planner._dedupe_heads(planner._pack(mask.blocks))
    return planner._Ctx(mask.q_bounds, mask.kv_bounds, words, tq, tk, q_align, kv_align, qp, kvp,
                        PlannerConfig(loops="compiled"))


@given(plan_masks(), st.sampled_from([(64, 64), (128, 96), (128, 128), (64, 192)]),
       st.sampled_from([(1, 1), (8, 8), (16, 32)]),
       st.sampled_from(["one", "two", "exact", "four", "eight"]))
@settings(max_examples=50, deadline=None)
def test_compiled_keep_merge_equal_numpy_oracle(mt, tile, align, mode):
    """The compiled keep/merge loops give exactly the NumPy oracle's arrays: one thread, two
    threads (second half written past the bound and moved down), the exact-count path, and 4 or
    8 threads (chunks counted, then written at exact offsets)."""
    mask = mt[0]
    tq, tk = tile
    qal, kal = align
    if tk % kal:
        kal = 1
    ctx = _ctx(mask, tq, tk, qal, kal)
    for merge in (False, True):
        want = plan_oracle._plan_rowgroups_numpy(ctx, merge)
        exact = {"max_bound_bytes": 0} if mode == "exact" else {}
        threads = {"one": 1, "four": 4, "eight": 8}.get(mode, 2)
        on = _on_threads(ctx, threads, **exact)
        got = planner._plan_rowgroups(on, merge, share=False)
        shared = planner._plan_rowgroups(on, merge, share=True)
        _assert_same_raw(got, want, ctx)
        _assert_same_raw(shared.unshared(), want, ctx)       # same units, each its own rows again
        assert shared.num_steps <= got.num_steps
        assert not shared.steps[shared.num_steps + shared.words:].any()   # past: zeros


def test_compiled_keep_merge_edge_intervals():
    """keep, merge, split and pack: intervals longer than a tile, tiles shifted back inside the padded keys (alone and as
    the last of several), a run reaching the last key block, 64 and 128 key blocks, a
    non-power-of-two tile."""
    rng = np.random.default_rng(7)
    for nkv, kv_size in ((64, 7), (128, 3), (130, 5), (9, 100)):
        kb = np.arange(nkv + 1) * kv_size
        qb = np.array([0, 40, 200, 333])
        blocks = rng.random((2, 3, nkv)) < 0.6
        blocks[:, :, -1] = True
        blocks[0, 0] = True
        m = tj.BlockMask(qb, kb, blocks)
        for tk, kal in ((64, 8), (96, 32), (128, 1), (192, 64)):
            ctx = _ctx(m, 64, tk, 8, kal)
            for merge in (False, True):
                want = plan_oracle._plan_rowgroups_numpy(ctx, merge)
                _assert_same_raw(planner._plan_rowgroups(ctx, merge, share=False), want, ctx)
                _assert_same_raw(planner._plan_rowgroups(ctx, merge).unshared(), want, ctx)
            for numpy_fn, fn in _SPLIT_PACK:
                _assert_same_raw(fn(ctx), numpy_fn(ctx), ctx)


def test_compiled_pack_matches_packbits():
    cfg = PlannerConfig(pack_min_bytes=0, par_min_rows=0)
    rng = np.random.default_rng(5)
    for shape, dens in (((3, 5, 8), 0.5), ((2, 7, 64), 0.3), ((4, 3, 136), 0.9),
                        ((1, 9, 1440), 0.1)):
        rows = rng.random(shape) < dens
        words = planner.pack_rows(rows, cfg)
        pk = np.packbits(rows, axis=-1, bitorder="little")
        want = np.zeros(shape[:-1] + (8 * words.shape[-1],), np.uint8)
        want[..., : pk.shape[-1]] = pk
        np.testing.assert_array_equal(words, want.view(np.uint64))
        interpreted = planner.pack_rows(rows, dataclasses.replace(cfg, loops="interpreted"))
        np.testing.assert_array_equal(interpreted, words)


def test_unit_order_option_head_major(monkeypatch):
    rng = np.random.default_rng(11)
    blocks = rng.random((4, 24, 24)) < 0.3
    blocks[:, :3] = True                                   # heavy rows: several cost classes
    m = tj.BlockMask.uniform(1536, 1536, 64, 64, blocks)
    base = _plan(m, 4, 2, 64, 64, "merge")
    assert base.unit_order == "interleaved" and base.stats()["unit_order"] == "interleaved"
    hm = build_plan(m, (1, 1536, 4, 16), (1, 1536, 2, 16), jnp.float32, tile_q=64, tile_kv=64,
                    policy="merge", unit_order="head_major")
    assert hm is not base and hm.unit_order == "head_major"
    U = hm.num_units
    u, ub = hm.units[:U], base.units[:U]
    key = lambda x: sorted(map(tuple, x[:, [abi.UNIT_HEAD, abi.UNIT_Q_START, abi.UNIT_OWN_LO]]))
    assert key(u) == key(ub), "not a permutation of the same units"
    np.testing.assert_array_equal(hm.steps, base.steps)
    np.testing.assert_array_equal(np.sort(hm.unit_cost), np.sort(base.unit_cost))
    # Heaviest cost class first, then query head, then q_start.
    cls = np.floor(np.log2(hm.unit_cost) * 8)
    assert (np.diff(cls) <= 0).all()
    h, q = u[:, abi.UNIT_HEAD].astype(np.int64), u[:, abi.UNIT_Q_START].astype(np.int64)
    same = cls[1:] == cls[:-1]
    step = np.stack([h[1:] - h[:-1], q[1:] - q[:-1]], axis=1)[same]
    assert ((step[:, 0] > 0) | ((step[:, 0] == 0) & (step[:, 1] > 0))).all()
    assert not (h[1:] != h[:-1])[same].all(), "head-major runs of one head expected"
    # row_index follows the units (the ABI check recomputes it from them).
    _check_abi(hm, m)
    # The planner reads no template table: a template name alone plans interleaved (the runtime
    # passes its template's unit_order, tests/test_api.py), and the cache key includes the order.
    p = build_plan(m, (1, 1536, 4, 16), (1, 1536, 2, 16), jnp.float32, tile_q=64, tile_kv=64,
                   policy="merge", template="mgpu_q128_kv128_s2_hm")
    assert p.unit_order == "interleaved"
    p = build_plan(m, (1, 1536, 4, 16), (1, 1536, 2, 16), jnp.float32, tile_q=64, tile_kv=64,
                   policy="merge", template="mgpu_q128_kv128_s2_hm", unit_order="head_major")
    assert p.unit_order == "head_major"
    np.testing.assert_array_equal(p.units, hm.units)
    with pytest.raises(ValueError, match="unit_order"):
        build_plan(m, (1, 1536, 4, 16), (1, 1536, 2, 16), jnp.float32, tile_q=64, tile_kv=64,
                   unit_order="random")
    with pytest.raises(ValueError, match="order"):
        schedule.order_units([1.0], [0], [0], [0], order="diagonal")


@given(plan_masks(), st.sampled_from([(64, 64), (128, 96), (128, 128), (64, 192)]),
       st.sampled_from([1, 8, 16]), st.booleans())
@settings(max_examples=40, deadline=None)
def test_compiled_split_equals_numpy_oracle(mt, tile, q_align, two):
    mask = mt[0]
    ctx = _ctx(mask, *tile, q_align, 1)
    want = plan_oracle._plan_grid_numpy(ctx)
    got = planner._plan_grid(_on_threads(ctx, 2 if two else 1))
    _assert_same_raw(got, want, ctx)


@given(plan_masks(), st.sampled_from([(64, 64), (128, 96), (128, 128), (64, 192)]),
       st.sampled_from([(1, 1), (8, 8), (16, 32)]), st.booleans())
@settings(max_examples=40, deadline=None)
def test_compiled_pack_policy_equals_numpy_oracle(mt, tile, align, two):
    mask = mt[0]
    tq, tk = tile
    qal, kal = align
    ctx = _ctx(mask, tq, tk, qal, kal if tk % kal == 0 else 1)
    want = plan_oracle._plan_pack_numpy(ctx)
    got = planner._plan_pack(_on_threads(ctx, 2 if two else 1))
    _assert_same_raw(got, want, ctx)


def test_compiled_split_pack_many_groups_per_unit():
    """Units of more than 64 row groups (1-token query blocks): the per-group loop, not the
    one-word bit pattern."""
    rng = np.random.default_rng(9)
    qb = np.concatenate([np.arange(0, 200), [260, 300]])
    kb = np.concatenate([[0], np.cumsum(rng.integers(1, 90, 40))])
    blocks = rng.random((2, len(qb) - 1, len(kb) - 1)) < 0.3
    blocks[:, 10:80] = blocks[:, 10:11]                  # identical rows: touching rectangles
    blocks[:, 30:200:7] = False                          # empty rows: rectangles that don't touch
    m = tj.BlockMask(qb, kb, blocks)
    _assert_split_pack_match_oracle(m, ((128, 64, 1, 1), (128, 128, 8, 8), (64, 96, 16, 32)))


@given(plan_masks(), st.sampled_from([(64, 64), (128, 96), (64, 192)]),
       st.sampled_from([(1, 1), (16, 32)]), st.booleans())
@settings(max_examples=15, deadline=None)
def test_compiled_split_pack_exact_count_path(mt, tile, align, two):
    """Where the step bound is too large to reserve, split/pack count first: same arrays."""
    mask = mt[0]
    tq, tk = tile
    ctx = _ctx(mask, tq, tk, align[0], align[1] if tk % align[1] == 0 else 1)
    for numpy_fn, fn in _SPLIT_PACK:
        want = numpy_fn(ctx)
        got = fn(_on_threads(ctx, 2 if two else 1, max_bound_bytes=0))
        _assert_same_raw(got, want, ctx)


@given(plan_masks(), st.sampled_from([(64, 64), (128, 96), (128, 128), (64, 192)]),
       st.sampled_from([(1, 1), (8, 8), (16, 32)]))
@settings(max_examples=30, deadline=None)
def test_split_pack_step_bound_holds_per_unit(mt, tile, align):
    """The reserved bound of split/pack (popcount of a unit's groups x the most tiles one
    block can touch) is at least the pieces each unit writes (its scratch holds them before
    tiles once joins them), so at least its step count too."""
    mask = mt[0]
    tq, tk = tile
    ctx = _ctx(mask, tq, tk, align[0], align[1] if tk % align[1] == 0 else 1)
    seen = []
    plan_loops.compile_all()           # the spy wraps the compiled loop, never gets compiled
    real = plan_loops._nb_rects

    names = list(inspect.signature(plan_loops._PLAIN["_nb_rects"]).parameters)

    def spy(*args):
        end = real(*args)
        a = dict(zip(names, args))
        seen.append((a["words"], a["gh"], a["gi"], a["ugroups"], a["cnt"].copy(), a["write"],
                     a["lo"], a["hi"]))
        return end

    kb = np.asarray(ctx.kb, np.int64)
    cmax = int(((kb[1:] - kb[:-1] + 2 * tk - 2) // tk).max())
    for fn, oracle in _SPLIT_PACK_BY_POLICY:
        seen.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan_loops, "_nb_rects", spy)     # where the drivers look it up
            fn(_on_threads(ctx, 1, loops="compiled"))
        assert seen or not ctx.words.any(), "spy not called: not patched where the drivers look"
        if not seen:
            continue
        (words, gh, gi, ugroups, cnt, write, lo, hi), = seen
        assert write and (lo, hi) == (0, len(ugroups))
        bound = np.empty(len(ugroups) + 1, np.int64)
        plan_loops._nb_rect_bound(words, gh, gi, ugroups, cmax, bound)
        pc = plan_oracle.pieces(oracle, ctx)
        per = np.zeros(len(ugroups), np.int64)       # the oracle's units: those with steps
        np.add.at(per, np.flatnonzero(cnt > 0)[pc["unit"]], 1)
        assert (cnt <= per).all() and (per <= np.diff(bound)).all()


@given(plan_masks(), st.sampled_from([(64, 64), (128, 96), (64, 192)]),
       st.sampled_from([(1, 1), (16, 32)]), st.sampled_from([-0.9, -0.3, 0.0, 0.02]),
       st.sampled_from([1, 3, 32]))
@settings(max_examples=30, deadline=None)
def test_compiled_split_pack_two_threads_any_estimate(mt, tile, align, margin, stride):
    """The second thread starts at an estimate of the first half's rows: a short estimate
    (the first half stops, the rest is counted and the second half moved up) or a long one
    gives the oracle's arrays."""
    mask = mt[0]
    tq, tk = tile
    ctx = _ctx(mask, tq, tk, align[0], align[1] if tk % align[1] == 0 else 1)
    for numpy_fn, fn in _SPLIT_PACK:
        want = numpy_fn(ctx)
        got = fn(_on_threads(ctx, 2, est_margin=margin, sample_stride=stride, est_slack=0))
        _assert_same_raw(got, want, ctx)


def test_compiled_split_pack_two_group_units_with_a_gap():
    """Units of two row groups that don't touch (an empty query block between them): a key
    range both select is two rectangles; touching groups make one."""
    rng = np.random.default_rng(3)
    qb = np.array([0, 30, 40, 70, 100, 128, 160])
    kb = np.concatenate([[0], np.cumsum(rng.integers(10, 90, 12))])
    blocks = rng.random((2, 6, 12)) < 0.5
    blocks[:, 1] = False                                 # rows 30-40 empty: a gap
    blocks[:, 2] = blocks[:, 0]                          # same keys on both sides of it
    blocks[:, 4, :3] = True
    blocks[:, 3, :3] = True                              # touching groups sharing keys
    m = tj.BlockMask(qb, kb, blocks)
    _assert_split_pack_match_oracle(m, ((128, 64, 1, 1), (128, 128, 8, 8), (64, 32, 1, 1)))
    units = plan_loops._nb_pack_units(np.zeros(4, np.int64), np.array([0, 40, 70, 100]),
                                      np.array([30, 70, 100, 130]), 128, 1)
    np.testing.assert_array_equal(units, [[0, 3], [3, 4]])


@given(plan_masks(), st.sampled_from([(64, 64), (128, 96), (128, 128)]),
       st.sampled_from([(1, 1), (8, 8)]), st.sampled_from([4, 8]), st.booleans())
@settings(max_examples=30, deadline=None)
def test_wide_split_pack_equal_the_oracles(mt, tile, align, threads, pack):
    """split/pack on 4 or 8 threads (chunks counted, then written at exact offsets) equal the
    NumPy oracles, as on one or two threads."""
    mask = mt[0]
    tq, tk = tile
    qal, kal = align
    ctx = _ctx(mask, tq, tk, qal, kal if tk % kal == 0 else 1)
    want = (plan_oracle._plan_pack_numpy if pack else plan_oracle._plan_grid_numpy)(ctx)
    got = (planner._plan_pack if pack else planner._plan_grid)(_on_threads(ctx, threads))
    _assert_same_raw(got, want, ctx)


@pytest.mark.parametrize("threads", [4, 8])
def test_wide_keep_merge_run_and_share_on_a_large_mask(threads):
    """The wide keep/merge path runs and equals the oracle, shared rows included (tall row
    groups: interior units of one group share rows, also across chunk starts' neighbours)."""
    rng = np.random.default_rng(10 + threads)
    qb = np.r_[0, 900, 1000, np.arange(1064, 3000, 64), 3000]     # a tall group: 7 units
    kb = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, 1500), 40, replace=False)), 1500])
    blocks = rng.random((2, len(qb) - 1, len(kb) - 1)) < 0.35
    ctx = _ctx(tj.BlockMask(qb, kb, blocks), 128, 64, 8, 8)
    for merge in (False, True):
        want = plan_oracle._plan_rowgroups_numpy(ctx, merge)
        calls = []
        real = planner._rowgroups_wide
        on = _on_threads(ctx, threads)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(planner, "_rowgroups_wide", lambda *a: calls.append(1) or real(*a))
            got = planner._plan_rowgroups(on, merge, share=False)
            shared = planner._plan_rowgroups(on, merge, share=True)
        assert calls == [1, 1]
        _assert_same_raw(got, want, ctx)
        _assert_same_raw(shared.unshared(), want, ctx)
        assert shared.num_steps < got.num_steps             # the tall group stored once
        assert not shared.steps[shared.num_steps + shared.words:].any()


@pytest.mark.parametrize("threads", [4, 8])
def test_wide_split_pack_run_and_match_on_a_large_mask(threads):
    """The wide path runs (many units) and gives the oracles' plans, per-head masks with
    variable blocks and empty rows."""
    rng = np.random.default_rng(threads)
    qb = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, 2000), 60, replace=False)), 2000])
    kb = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, 1500), 50, replace=False)), 1500])
    blocks = rng.random((3, len(qb) - 1, len(kb) - 1)) < 0.3
    blocks[:, 5] = False
    ctx = _ctx(tj.BlockMask(qb, kb, blocks), 64, 64, 8, 8)
    for oracle, fn in _SPLIT_PACK:
        calls = []
        real = planner._rect_steps_wide
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(planner, "_rect_steps_wide", lambda *a: calls.append(1) or real(*a))
            got = fn(_on_threads(ctx, threads))
        assert calls == [1]
        _assert_same_raw(got, oracle(ctx), ctx)


_LOOP_CHOICE = r"""
import json, sys
import numpy as np
import tessera_jax as tj
from tessera_jax.planning import PlannerConfig, build_plan
b = np.arange(0, 257, 64)
m = tj.BlockMask(b, b, np.tril(np.ones((4, 4), bool))[None].repeat(2, 0))
cfg = PlannerConfig(**json.loads(sys.argv[1]))
build_plan(m, (1, 256, 2, 64), (1, 256, 2, 64), "float32", tile_q=64, tile_kv=64, config=cfg)
from tessera_jax.planning import loops
print(json.dumps("numba" in sys.modules or loops.warming()))
"""


@pytest.mark.parametrize("options,numba", [({}, False), ({"loops": "interpreted"}, False),
                                           ({"loops": "vectorised"}, False),
                                           ({"loops": "compiled"}, True),
                                           ({"interp_budget_work": 0}, True),
                                           ({"interp_max_work": 0}, True),
                                           ({"interp_max_work": 0,
                                             "background_compile": False}, True)])
def test_compiled_or_interpreted_loops_are_an_explicit_choice(tmp_path, options, numba):
    """A fresh process planning a small mask: its loops run interpreted (numba not imported)
    by default, compiled where the config asks for it, or where the "auto" thresholds (work
    per call, work per process) say so, whatever the time the process has spent: numba then
    loads or compiles in the background after the plan (the NumPy tier made it), or, without
    ``background_compile``, for the plan."""
    import json
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-c", _LOOP_CHOICE, json.dumps(options)], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) is numba


def _step_words(plan, rows):
    """Each step row of ``rows`` with its words (a gathered step's), as one tuple."""
    wr = abi.gather_word_rows(plan.tile_q, plan.tile_kv)
    out = []
    for s in range(rows.start, rows.stop):
        st = plan.steps[s]
        words = ()
        if abi.is_gather(int(st[abi.STEP_CUTS_B])):
            a = int(st[abi.STEP_CUTS_A])
            words = tuple(plan.steps.reshape(-1)[a: a + wr * abi.STEP_COLS])
        out.append((st[abi.STEP_KV_START], st[abi.STEP_RECT], st[abi.STEP_CUTS_B]) + words)
    return out


def _computed_by_visit(plan, group):
    """Interactions computed, visit by visit from the units' step rows: tile_kv x group rows
    per row group of the tile that the step's rectangle meets."""
    total = 0
    for u in plan.units[: plan.num_units]:
        for s in range(u[abi.UNIT_STEP_PTR], u[abi.UNIT_STEP_PTR] + u[abi.UNIT_STEP_CNT]):
            q_lo, q_hi, _, _ = abi.unpack_rect(int(plan.steps[s, abi.STEP_RECT]))
            total += sum(plan.tile_kv * group for g0 in range(0, plan.tile_q, group)
                         if q_lo < q_hi and q_lo < g0 + group and q_hi > g0)
    return total


@given(plan_masks(), st.sampled_from(["merge", "pack", "split", "gather"]),
       st.sampled_from([32, 64]))
@settings(max_examples=25, deadline=None)
def test_row_groups_count_only_the_groups_a_step_meets(mt, policy, group):
    """With row groups (a kernel that skips a step's groups its rectangle misses), computed
    interactions are counted per group met: never fewer than selected, never more than whole
    tiles, and the plan's arrays are those of the plan without groups."""
    mask, Hq, Hkv = mt
    D = 16
    args = dict(tile_q=128, tile_kv=64, policy=policy, q_align=8, kv_align=8)
    whole = build_plan(mask, (1, mask.Lq, Hq, D), (1, mask.Lkv, Hkv, D), jnp.float32, **args)
    grouped = build_plan(mask, (1, mask.Lq, Hq, D), (1, mask.Lkv, Hkv, D), jnp.float32,
                         row_group=group, **args)
    assert grouped.row_group == group and whole.row_group == 128
    np.testing.assert_array_equal(grouped.units, whole.units)
    if policy != "gather":
        np.testing.assert_array_equal(grouped.steps, whole.steps)
    else:                       # the same steps, a unit's in another order (interleave_groups)
        for u in whole.units[: whole.num_units]:
            rows = slice(u[abi.UNIT_STEP_PTR], u[abi.UNIT_STEP_PTR] + u[abi.UNIT_STEP_CNT])
            key = lambda p: sorted(map(tuple, _step_words(p, rows)))   # noqa: E731
            assert key(grouped) == key(whole)
    s, w = grouped.stats(), whole.stats()
    assert s["row_group"] == group and w["row_group"] == 128
    assert s["computed_interactions"] == _computed_by_visit(grouped, group)
    assert w["computed_interactions"] == _computed_by_visit(whole, 128)
    assert s["selected_interactions"] <= s["computed_interactions"] <= w["computed_interactions"]


def test_templates_pass_their_row_groups():
    """A template whose kernel skips a warpgroup's rows (``wg_skip``) plans with 64-row
    groups; the others with the whole tile."""
    from pallas_kernels import templates

    for t in templates.TEMPLATES:
        want = 64 if getattr(t.kernel, "wg_skip", False) else t.tile_q
        assert t.row_group == want, t.name
    skip = [t for t in templates.TEMPLATES if t.row_group < t.tile_q]
    assert skip, "no template computes row groups"
    t = skip[0]
    m = tj.BlockMask(np.array([0, 64, 256]), np.array([0, 128, 256]),
                     np.array([[True, False], [False, True]]))
    p = tj.plan(m, (1, 256, 2, 64), (1, 256, 2, 64), jnp.bfloat16, template=t.name)
    assert p.row_group == 64
    s = p.stats()
    assert s["computed_interactions"] < s["tiles"] * t.tile_q * t.tile_kv


def test_interleave_groups_alternates_single_group_steps():
    """Steps meeting one 64-row group alternate between the groups while both have some,
    then the rest of one group, then the steps meeting both; each kind keeps its order."""
    from tessera_jax.planning.gather import interleave_groups

    def rows(*spans):
        r = np.zeros(128, bool)
        for a, b in spans:
            r[a:b] = True
        return r

    lo, hi, both = rows((0, 10)), rows((70, 80)), rows((60, 70))
    sel = np.stack([lo, lo, lo, hi, both, hi, lo])
    order = interleave_groups(sel, 64)
    assert sorted(order) == list(range(7))
    assert list(order) == [0, 3, 1, 5, 2, 6, 4]
    assert list(interleave_groups(sel, 128)) == list(range(7))
