"""Tiles once (issue 15): a physical tile is computed once, however many logical blocks touch it.

* Piece level (the policies' grid join): the pieces of one K/V tile of a unit (one rectangle
  each, as the policies cut them, ``plan_oracle.pieces``) whose distinct row bounds and key
  bounds are at most 5 each (a 4 x 4 grid) become exactly one step, in every policy; the rest
  become one step in ``build_plan``'s bitmap pass (tests/test_bitmap_steps.py).
* Mask level: masks whose blocks leave every tile at most 4 segments per axis (bounds on a
  tile / 4 grid) are planned with no tile revisits and no bitmap step by split, and no plan of
  any policy computes more than dense (``build_plan`` falls back to split per head).
* Always: split's plan is within dense (it visits each grid tile once), no head computes more
  than dense; auto prefers a candidate within dense.
* The XLA executor evaluates hand-written grid steps (every cell pattern, random cuts) exactly.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plan_oracle
import tessera_jax as tj
from pallas_kernels import abi
from pallas_kernels.xla import ops as xla_ops
from tessera_jax.planning import planner
from tessera_jax.planning.planner import TILE_POLICIES as POLICIES, build_plan
from contract_calls import xla_template
from strategies import heads_and_blocks
from test_planner import TILES, _ctx, _plan, plan_masks

_ORACLES = {"keep": (plan_oracle._plan_rowgroups_numpy, (False,)),
            "merge": (plan_oracle._plan_rowgroups_numpy, (True,)),
            "split": (plan_oracle._plan_grid_numpy, ()),
            "pack": (plan_oracle._plan_pack_numpy, ())}


def _head_computed(p):
    """Computed interactions of each query head."""
    u = p.units[: p.num_units]
    return np.bincount(u[:, abi.UNIT_HEAD], weights=u[:, abi.UNIT_STEP_CNT],
                       minlength=p.shape.num_q_heads) * p.tile_q * p.tile_kv


@given(plan_masks(), st.sampled_from(TILES), st.sampled_from([(1, 1), (8, 8), (16, 32)]))
@settings(max_examples=40, deadline=None)
def test_pieces_of_a_tile_that_fit_a_grid_are_one_step(mt, tile, align):
    mask = mt[0]
    tq, tk = tile
    qal, kal = align
    ctx = _ctx(mask, tq, tk, qal, kal if tk % kal == 0 else 1)
    for policy, (oracle, args) in _ORACLES.items():
        pc = plan_oracle.pieces(oracle, ctx, *args)
        raw = planner._plan_policy(ctx, policy, share=False)
        first = np.cumsum(raw.cnt) - raw.cnt
        kv = raw.steps[: raw.num_steps, abi.STEP_KV_START]
        for (u, k), idx in _groups(pc["unit"], pc["kv"]).items():
            rows = {int(v) for v in np.r_[pc["ql"][idx], pc["qh"][idx]]}
            keys = {int(v) for v in np.r_[pc["kl"][idx], pc["kh"][idx]]}
            visits = int((kv[first[u]: first[u] + raw.cnt[u]] == k).sum())
            if len(rows) <= 5 and len(keys) <= 5:
                assert visits == 1, (policy, u, k, sorted(rows), sorted(keys))
            assert 1 <= visits <= len(idx)      # never more steps than pieces


def _groups(unit, kv):
    out: dict = {}
    for i, key in enumerate(zip(unit.tolist(), kv.tolist())):
        out.setdefault(key, []).append(i)
    return out


@st.composite
def quarter_grid_masks(draw):
    """(mask, Hq, Hkv, tile): block bounds on the tile / 4 grid and lengths multiples of the
    tile, so every tile has at most 4 segments per axis."""
    tq, tk = draw(st.sampled_from([(64, 64), (128, 128), (64, 128), (128, 64)]))
    nq, nk = draw(st.integers(1, 6)), draw(st.integers(1, 6))

    def bounds(n, t):
        cuts = draw(st.lists(st.integers(1, 4 * n - 1), max_size=4 * n, unique=True))
        return np.unique(np.r_[0, np.array(cuts, np.int64) * (t // 4), n * t])

    qb, kb = bounds(nq, tq), bounds(nk, tk)
    Hq, Hkv, blocks, _ = heads_and_blocks(draw, len(qb) - 1, len(kb) - 1, [0.1, 0.3, 0.7, 1.0])
    return tj.BlockMask(qb, kb, blocks), Hq, Hkv, (tq, tk)


@given(quarter_grid_masks())
@settings(max_examples=40, deadline=None)
def test_at_most_four_segments_per_axis_tiles_once_and_never_above_dense(mt):
    mask, Hq, Hkv, (tq, tk) = mt
    dense = mask.Lq * mask.Lkv
    split = _plan(mask, Hq, Hkv, tq, tk, "split")
    assert split.stats()["tile_revisits"] == 0 and split.stats()["bitmap_steps"] == 0
    for policy in POLICIES:
        p = _plan(mask, Hq, Hkv, tq, tk, policy)
        s = p.stats()
        assert s["dense_tile_interactions"] == s["dense_interactions"] == dense * Hq
        assert (_head_computed(p) <= dense).all(), (policy, s)
        np.testing.assert_array_equal(plan_oracle.coverage(p), np.broadcast_to(
            mask.token_mask(), (Hq, mask.Lq, mask.Lkv)))


@given(plan_masks(), st.sampled_from(TILES), st.sampled_from([1, 8]))
@settings(max_examples=30, deadline=None)
def test_no_head_computes_more_than_dense_or_split(mt, tile, align):
    """build_plan's invariant: a head's plan computes at most max(dense at these tiles, what
    split computes for it); split's plan is within dense (it tiles once, always)."""
    mask, Hq, Hkv = mt
    tq, tk = tile
    bound = planner.dense_tile_interactions(mask.Lq, mask.Lkv, tq, tk)
    split = _plan(mask, Hq, Hkv, tq, tk, "split", align, align)
    sc = _head_computed(split)
    assert split.stats()["tile_revisits"] == 0
    assert (sc <= bound).all()
    for policy in POLICIES:
        p = _plan(mask, Hq, Hkv, tq, tk, policy, align, align)
        pc = _head_computed(p)
        assert (pc <= np.maximum(bound, sc)).all(), (policy, pc, sc, bound)
        hp = np.array(p.head_policies if mask.num_heads > 1 else p.head_policies * Hq)
        if policy not in ("split", "auto"):
            assert p.stats()["fallback_heads"] == int((hp == "split").sum())
            assert set(hp) <= {policy, "split"}


@given(plan_masks(), st.sampled_from(TILES))
@settings(max_examples=25, deadline=None)
def test_auto_prefers_a_candidate_within_dense(mt, tile):
    mask, Hq, Hkv = mt
    tq, tk = tile
    bound = planner.dense_tile_interactions(mask.Lq, mask.Lkv, tq, tk)
    within = np.zeros(Hq, bool)
    for policy in ("merge", "split", "pack"):
        ctx = _ctx(mask, tq, tk, 1, 1)
        raw = planner._plan_policy(ctx, policy, share=False)
        per = np.bincount(raw.head, weights=raw.cnt, minlength=ctx.words.shape[0]) * tq * tk
        hmap = planner._dedupe_heads(planner.pack_rows(mask.blocks))[1]
        per = per[hmap] if mask.num_heads > 1 else np.repeat(per, Hq)
        within |= per <= bound
    auto = _head_computed(_plan(mask, Hq, Hkv, tq, tk, "auto"))
    assert (auto[within] <= bound).all()


def test_token_level_masks_fall_back_to_split_and_report_it():
    """1-token blocks under merge anchor a tile at every block start (hundreds of times dense
    before tiles once; a unit per 1-row group, so above dense even with bitmap steps):
    build_plan plans those heads by split, and stats/describe say so. Split's tiles hold 64
    segments per axis: one bitmap step each, the plan exactly dense."""
    rng = np.random.default_rng(0)
    L = 256
    m = tj.BlockMask.uniform(L, L, 1, 1, rng.random((2, L, L)) < 0.1)
    ctx = _ctx(m, 64, 64, 1, 1)
    merged = planner._plan_policy(ctx, "merge", share=False)
    p = _plan(m, 2, 2, 64, 64, "merge")
    s = p.stats()
    assert p.head_policies == ("split", "split") and s["fallback_heads"] == 2
    assert s["computed_interactions"] < merged.cnt.sum() * 64 * 64
    assert "2 heads planned by split" in p.describe() and "bitmap steps" in p.describe()
    assert s["grid_steps"] == 0 and s["tile_revisits"] == 0   # 1-token blocks: > 4 segments
    assert s["bitmap_steps"] == s["tiles"] == 2 * 16
    assert s["computed_interactions"] == s["dense_interactions"]
    band = tj.BlockMask.uniform(L, L, 16, 16, np.abs(np.subtract.outer(np.arange(16),
                                                                       np.arange(16))) <= 1)
    for policy in POLICIES:                     # 16-token blocks: 4 segments a tile at most
        s = _plan(band, 2, 1, 64, 64, policy).stats()
        assert s["tile_revisits"] == 0 and s["computed_interactions"] <= s["dense_interactions"]


def _grid_steps(rng, n, tq, tk):
    """n random step rows (kv_start 0): grid steps with random cuts inside random rectangles
    (empty segments included) and random non-zero bits, and some plain steps."""
    steps = np.zeros((n, abi.STEP_COLS), np.int32)
    for i in range(n):
        q_lo, q_hi = sorted(rng.choice(tq + 1, 2, replace=False))
        k_lo, k_hi = sorted(rng.choice(tk + 1, 2, replace=False))
        steps[i, abi.STEP_RECT] = abi.pack_rect(q_lo, q_hi, k_lo, k_hi)
        if i % 5:
            qc = np.sort(rng.integers(q_lo, q_hi + 1, 3))
            kc = np.sort(rng.integers(k_lo, k_hi + 1, 3))
            ca, cb = abi.pack_grid(qc, kc, int(rng.integers(1, 1 << 16)))
            steps[i, abi.STEP_CUTS_A], steps[i, abi.STEP_CUTS_B] = ca, cb
    return steps


@pytest.mark.parametrize("tq,tk", [(64, 64), (128, 192)])
def test_executor_evaluates_hand_written_grid_steps_exactly(tq, tk):
    """Units of one step each over one K/V tile: out and lse equal a dense NumPy softmax under
    the step's selection (grid_mask written out as a per-cell loop)."""
    rng = np.random.default_rng(tq + tk)
    n, D = 24, 16
    steps = _grid_steps(rng, n, tq, tk)
    # unit i: head 0, q rows [0, tq) owning all, its one step i; a second head of queries so
    # that each unit's output lands in its own rows: unit i -> head i.
    units = np.zeros((n, abi.UNIT_COLS), np.int32)
    units[:, abi.UNIT_HEAD] = np.arange(n)
    units[:, abi.UNIT_OWN_HI] = tq
    units[:, abi.UNIT_STEP_PTR] = np.arange(n)
    units[:, abi.UNIT_STEP_CNT] = 1
    q = rng.standard_normal((1, tq, n, D)).astype(np.float32)
    k = rng.standard_normal((1, tk, 1, D)).astype(np.float32)
    v = rng.standard_normal((1, tk, 1, D)).astype(np.float32)
    row_index = (np.arange(n)[:, None] * tq + np.arange(tq)[None, :]).astype(np.int32)
    plan = abi.PassPlan(units, steps, jnp.asarray(row_index), tq, tk, tq, tk, 1)
    out, lse = xla_ops.forward(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), plan,
                               template=xla_template(tq, tk), scale=0.5, return_lse=True)
    for i in range(n):
        sel = _cells_by_loop(steps[i], tq, tk)
        s = 0.5 * q[0, :, i] @ k[0, :, 0].T
        s = np.where(sel, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        has = np.isfinite(m[:, 0])
        p = np.where(sel, np.exp(s - np.where(has[:, None], m, 0)), 0)
        l = p.sum(1)
        want = np.where(has[:, None], p @ v[0, :, 0] / np.where(has, l, 1)[:, None], 0)
        np.testing.assert_allclose(np.asarray(out)[0, :, i], want, atol=1e-5, rtol=1e-5)
        want_lse = np.where(has, np.log(np.where(has, l, 1)) + m[:, 0], -np.inf)
        np.testing.assert_allclose(np.asarray(lse)[0, i], want_lse, atol=1e-5, rtol=1e-5)


def _cells_by_loop(step, tq, tk):
    """The selection of one step, cell by cell (independent of abi.grid_mask's arithmetic)."""
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in abi.unpack_rect(int(step[abi.STEP_RECT])))
    sel = np.zeros((tq, tk), bool)
    if step[abi.STEP_CUTS_B] == 0:
        sel[q_lo:q_hi, k_lo:k_hi] = True
        return sel
    qc, kc, bits = abi.unpack_grid(int(step[abi.STEP_CUTS_A]), int(step[abi.STEP_CUTS_B]))
    rb = [q_lo, *(int(x) for x in qc), q_hi]
    kb = [k_lo, *(int(x) for x in kc), k_hi]
    bits = int(bits)
    for i, j in itertools.product(range(4), range(4)):
        if bits >> (4 * i + j) & 1:
            sel[rb[i]:rb[i + 1], kb[j]:kb[j + 1]] = True
    return sel


def test_grid_mask_matches_the_cell_loop():
    rng = np.random.default_rng(3)
    steps = _grid_steps(rng, 300, 128, 192)
    rows, cols = np.arange(128)[:, None], np.arange(192)[None, :]
    for st_ in steps.astype(np.int64):
        got = abi.grid_mask(st_[abi.STEP_RECT], st_[abi.STEP_CUTS_A], st_[abi.STEP_CUTS_B],
                            rows, cols)
        np.testing.assert_array_equal(got, _cells_by_loop(st_, 128, 192))
        v, r0, r1, c0, c1 = abi.step_cells(st_[abi.STEP_RECT], st_[abi.STEP_CUTS_A],
                                           st_[abi.STEP_CUTS_B])
        cells = np.zeros((128, 192), np.int64)
        for a, b, c, d in zip(r0, r1, c0, c1):
            cells[a:b, c:d] += 1
        np.testing.assert_array_equal(cells, got)


def test_planned_grid_steps_are_normalised():
    """A grid step never has a cut between two equal rows or columns of cells (the planner's
    grids are the coarsest), and never selects every cell (that is a plain step)."""
    rng = np.random.default_rng(4)
    qb = np.unique(np.r_[0, rng.integers(1, 500, 80), 500])
    m = tj.BlockMask(qb, qb, rng.random((2, len(qb) - 1, len(qb) - 1)) < 0.3)
    for policy in ("split", "pack"):
        p = _plan(m, 2, 2, 64, 64, policy)
        view = abi.unpack_steps(p.steps[: p.num_steps], grid=True)
        g = view[p.steps[: p.num_steps, abi.STEP_CUTS_B] != 0]
        assert len(g)
        for row in g:
            R = [int(x) for x in row[[abi.VIEW_Q_LO, abi.VIEW_Q1, abi.VIEW_Q2, abi.VIEW_Q3,
                                      abi.VIEW_Q_HI]]]
            K = [int(x) for x in row[[abi.VIEW_KV_LO, abi.VIEW_K1, abi.VIEW_K2, abi.VIEW_K3,
                                      abi.VIEW_KV_HI]]]
            nr, nk = len(set(R)) - 1, len(set(K)) - 1
            assert R == sorted(R) and K == sorted(K)
            assert R[: nr + 1] == sorted(set(R)) and K[: nk + 1] == sorted(set(K))  # pad at hi
            cells = [[(int(row[abi.VIEW_BITS]) >> (4 * i + j)) & 1 for j in range(nk)]
                     for i in range(nr)]
            assert not all(all(c) for c in cells)
            assert all(cells[i] != cells[i + 1] for i in range(nr - 1))
            assert all([c[j] for c in cells] != [c[j + 1] for c in cells]
                       for j in range(nk - 1))
            assert int(row[abi.VIEW_BITS]) >> 16 == 0 and all(
                (int(row[abi.VIEW_BITS]) >> (4 * i + j)) & 1 == 0
                for i in range(4) for j in range(4) if i >= nr or j >= nk)
