"""Bitmap steps (issue 15, "a physical tile is computed once"): a step whose selection is a bit
per entry (``abi.BITMAP_FLAG``, words after the step rows), and the planner's pass that leaves one
step per (unit, K/V tile) in every plan.

* ABI: ``pack_bitmap`` / ``unpack_bitmap`` round trips, ``step_mask`` (the one evaluator: NumPy,
  jnp, a per-entry loop of the docstring's rule), ``selected_cells``, the grid view of a bitmap
  row, ``check_plan`` / ``bitmap_problems`` on every broken rule.
* Planner: the bitmap pass (``plan_loops._nb_bm_unit`` on the units that revisit a tile: in
  split/pack's loops as they write them, or after the loops, ``planner._bitmap_steps``, as
  keep/merge, ``auto`` and the fallback to split run it; words after all the step rows,
  ``planner._finish``) == its specification ``plan_oracle.bitmap_steps`` on the oracles' rows,
  array for array (every policy, shared and unshared rows, every thread path: one, two (a
  short estimate too), the exact-count path, 4 and 8 threads; interpreted and compiled; words
  with and without room after the rows), and ``planner._bitmap_steps`` on hand-written rows; every plan of every policy and template tile shape on masks of 1-8 token blocks (per
  head, shared, empty rows) visits each (unit, tile) once, covers its mask exactly and computes
  at most dense; shared masks keep sharing their steps and words.
* Negative controls: a corrupted bitmap (a bit flipped inside or outside its rectangle, a bad
  offset, words over step rows) is caught by the exact-cover check or by ``check_plan``.
"""

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plan_oracle
import tessera_jax as tj
from pallas_kernels import abi
from tessera_jax.planning import loops as plan_loops
from tessera_jax.planning import planner
from tessera_jax.planning.planner import TILE_POLICIES as POLICIES, build_plan
from strategies import bounds_from_sizes, heads_and_blocks
from test_planner import (_assert_same_raw, _check_abi, _check_stats, _ctx, _direct_kinds,
                          _on_threads, _plan, _with_pass)

TEMPLATE_TILES = [(64, 64), (128, 128), (128, 64), (64, 128)]   # the kept templates' shapes
ODD_TILES = [(16, 40), (64, 192), (8, 33)]                      # W = 2, 6, 2; nl = 1, 3, 1


# --- masks -------------------------------------------------------------------------------
@st.composite
def token_bounds(draw, max_len=320):
    """Bounds of mostly 1-8 token blocks, now and then a long one (so tiles hold more than 4
    segments per axis, and some fewer)."""
    sizes = draw(st.lists(st.one_of(st.integers(1, 3), st.integers(4, 8), st.integers(1, 1),
                                    st.integers(20, 90)), min_size=8, max_size=60))
    return bounds_from_sizes(sizes, max_len)


@st.composite
def token_masks(draw):
    """(mask, Hq, Hkv): per head (a head repeated sometimes) or shared, empty query rows."""
    qb, kb = draw(token_bounds()), draw(token_bounds())
    Hq, Hkv, blocks, rng = heads_and_blocks(draw, len(qb) - 1, len(kb) - 1,
                                            [0.05, 0.2, 0.5, 0.9])
    if blocks.shape[0] > 1 and draw(st.booleans()):
        blocks[-1] = blocks[0]
    if blocks.shape[1] > 1 and draw(st.booleans()):
        blocks[:, rng.integers(blocks.shape[1]):][:, :3] = False      # empty query rows
    return tj.BlockMask(qb, kb, blocks), Hq, Hkv


def _random_token_mask(rng, L, Lk, H, b, density):
    return tj.BlockMask.uniform(L, Lk, b, b, rng.random((H, -(-L // b), -(-Lk // b))) < density)


def _head_computed(p):
    u = p.units[: p.num_units]
    return np.bincount(u[:, abi.UNIT_HEAD], weights=u[:, abi.UNIT_STEP_CNT],
                       minlength=p.shape.num_q_heads) * p.tile_q * p.tile_kv


# --- the ABI -----------------------------------------------------------------------------
def _rule_by_loop(steps, s, tq, tk):
    """A step's selection read from the abi docstring entry by entry (plain / grid through
    ``grid_mask``; a bitmap: bit c % 32 of flat[off + (c // 32) * tq + r] inside the rect)."""
    flat = steps.reshape(-1)
    ks, rect, ca, cb = (int(x) for x in steps[s])
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in abi.unpack_rect(rect))
    if cb != abi.BITMAP_FLAG:
        return abi.grid_mask(np.int64(rect), np.int64(ca), np.int64(cb), np.arange(tq)[:, None],
                             np.arange(tk)[None, :])
    out = np.zeros((tq, tk), bool)
    for r in range(tq):
        for c in range(tk):
            w = int(flat[ca + (c // 32) * tq + r]) & 0xFFFFFFFF
            out[r, c] = q_lo <= r < q_hi and k_lo <= c < k_hi and (w >> (c % 32)) & 1
    return out


def _hand_plan(rng, tq, tk, n=6):
    """A unit of n steps (tiles 0, tk, ...): bitmap, grid and plain steps mixed, the bitmaps'
    words after the step rows (one shared by two steps), each bitmap rectangle tight."""
    wr = abi.bitmap_rows(tq, tk)
    steps = np.zeros((n + 3 * wr + 1, abi.STEP_COLS), np.int32)
    flat = steps.reshape(-1)
    sels = []
    for i in range(n):
        sel = np.zeros((tq, tk), bool)
        if i % 3 == 2:                                   # plain
            a, b = sorted(rng.choice(tq + 1, 2, replace=False))
            c, d = sorted(rng.choice(tk + 1, 2, replace=False))
            sel[a:b, c:d] = True
            steps[i] = (i * tk, abi.pack_rect(a, b, c, d), 0, 0)
        elif i % 3 == 1:                                 # grid
            qc = np.sort(rng.integers(0, tq + 1, 3))
            kc = np.sort(rng.integers(0, tk + 1, 3))
            ca, cb = abi.pack_grid(qc, kc, int(rng.integers(1, 1 << 16)))
            steps[i] = (i * tk, abi.pack_rect(0, tq, 0, tk), ca, cb)
            sel = abi.step_mask(steps, i, tq, tk)
            if not sel.any():
                steps[i] = (i * tk, abi.pack_rect(0, 1, 0, 1), 0, 0)
                sel = abi.step_mask(steps, i, tq, tk)
        else:                                            # bitmap
            sel = rng.random((tq, tk)) < 0.3
            sel[rng.integers(tq), tk - 1] = True         # the last key (bit 31 of a word)
            sel[:, : rng.integers(0, tk // 2)] = False
            k = i // 3
            off = (n + 1 + k * wr) * abi.STEP_COLS
            flat[off: off + abi.bitmap_words(tk) * tq] = abi.pack_bitmap(sel)
            r, c = np.flatnonzero(sel.any(1)), np.flatnonzero(sel.any(0))
            steps[i] = (i * tk, abi.pack_rect(r[0], r[-1] + 1, c[0], c[-1] + 1), off,
                        abi.BITMAP_FLAG)
        sels.append(sel)
    return steps, sels


@pytest.mark.parametrize("tq,tk", TEMPLATE_TILES + ODD_TILES)
def test_pack_bitmap_step_mask_and_cells(tq, tk):
    rng = np.random.default_rng(tq * 1000 + tk)
    sel = rng.random((3, tq, tk)) < 0.4
    w = abi.pack_bitmap(sel)
    assert w.dtype == np.int32 and w.shape == (3, abi.bitmap_words(tk) * tq)
    np.testing.assert_array_equal(abi.unpack_bitmap(w, tq, tk), sel)
    # bit c % 32 of word(r, c // 32) at w * tq + r, by hand
    r, c = int(rng.integers(tq)), int(rng.integers(tk))
    word = int(w[0, (c // 32) * tq + r]) & 0xFFFFFFFF
    assert bool((word >> (c % 32)) & 1) == sel[0, r, c]
    steps, sels = _hand_plan(rng, tq, tk)
    n = len(sels)
    got = abi.step_mask(steps, np.arange(n), tq, tk)
    np.testing.assert_array_equal(got, np.stack(sels))
    np.testing.assert_array_equal(np.asarray(abi.step_mask(jnp.asarray(steps), jnp.arange(n),
                                                           tq, tk)), got)
    if tq * tk <= 64 * 64:
        for s in range(n):
            np.testing.assert_array_equal(_rule_by_loop(steps, s, tq, tk), got[s])
    i, q0, q1, k0, k1 = abi.selected_cells(steps, np.arange(n), tq, tk)
    cov = np.zeros((n, tq, tk), np.int64)
    for a, b, c_, d, e in zip(i, q0, q1, k0, k1):
        cov[a, b:c_, d:e] += 1
    np.testing.assert_array_equal(cov, got)                 # disjoint, union = step_mask
    units = np.array([[0, 0, 0, tq, 0, n]], np.int32)
    assert abi.check_plan(units, steps, tq, tk, tq, n * tk) is False
    view = abi.unpack_steps(steps[:n], grid=True)
    bm = steps[:n, abi.STEP_CUTS_B] == abi.BITMAP_FLAG
    assert (view[bm, abi.VIEW_BITS] == 0).all()
    assert (view[bm, abi.VIEW_Q1] == view[bm, abi.VIEW_Q_HI]).all()
    with pytest.raises(ValueError, match="bitmap"):
        abi.step_cells(steps[:n, abi.STEP_RECT], steps[:n, abi.STEP_CUTS_A],
                       steps[:n, abi.STEP_CUTS_B])
    assert abi.grid_problems(steps[:n]) == []


def test_check_plan_catches_every_broken_bitmap_rule():
    rng = np.random.default_rng(7)
    tq, tk = 16, 40                                      # W = 2: keys 40..63 exist in words
    steps, _ = _hand_plan(rng, tq, tk)
    n = 6
    units = np.array([[0, 0, 0, tq, 0, n]], np.int32)
    kw = dict(tile_q=tq, tile_kv=tk, q_len_padded=tq, kv_len_padded=n * tk)
    assert abi.check_plan(units, steps, **kw) is False
    b = int(np.flatnonzero(steps[:n, abi.STEP_CUTS_B] == abi.BITMAP_FLAG)[0])
    off = int(steps[b, abi.STEP_CUTS_A])
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in abi.unpack_rect(int(steps[b, abi.STEP_RECT])))

    def flip(r, c):
        def edit(s):
            s.reshape(-1)[off + (c // 32) * tq + r] ^= np.int32(1 << (c % 32)) if c % 32 < 31 \
                else np.int32(-(1 << 31))
        return edit

    def set_(col, value):
        def edit(s):
            s[b, col] = value
        return edit

    def clear(s):
        s.reshape(-1)[off: off + abi.bitmap_words(tk) * tq] = 0

    cases = {
        "outside its rectangle": flip(q_hi, k_lo) if q_hi < tq else flip(q_lo, k_hi),
        "key >= tile_kv": flip(q_lo, 45),
        "multiple of 4": set_(abi.STEP_CUTS_A, off + 1),
        "leave the": set_(abi.STEP_CUTS_A, (len(steps) - 1) * abi.STEP_COLS),
        "rows a unit visits": set_(abi.STEP_CUTS_A, 0),
        "rectangle is empty": set_(abi.STEP_RECT, abi.pack_rect(3, 3, k_lo, k_hi)),
        "selects nothing": clear,
    }
    for what, edit in cases.items():
        s2 = steps.copy()
        edit(s2)
        with pytest.raises(ValueError, match=what):
            abi.check_plan(units, s2, **kw)
    # Word rows are no steps: a word row that would be a bad step is not checked as one, but
    # an unvisited row that holds no words is (every step row is the ABI's).
    s3 = steps.copy()
    s3[n] = (-5, 0, 7, 9)                                  # the gap row before the words
    with pytest.raises(ValueError, match="kv_start|plain step|grid step"):
        abi.check_plan(units, s3, **kw)


# --- the planner's pass == its specification ---------------------------------------------
def _assert_pass_matches_spec(raw, tq, tk):
    # Compiled loops: "auto" raises NotReady on a large call before numba has compiled them.
    got = planner._bitmap_steps(raw, tq, tk, planner.PlannerConfig(loops="compiled"))
    want = plan_oracle.bitmap_steps(raw.steps, raw.first, raw.cnt, tq, tk)
    if want is None:
        assert got is raw                       # nothing revisited: the raw as it is
        return got
    steps, ptr, cnt, S, W = want
    assert (got.stored, got.words) == (S, W)
    np.testing.assert_array_equal(got.ptr, ptr)
    np.testing.assert_array_equal(got.cnt, cnt)
    assert got.steps.shape == steps.shape
    np.testing.assert_array_equal(got.steps, steps)
    np.testing.assert_array_equal(got.area, raw.area)
    full = ((steps[:, abi.STEP_RECT] == abi.full_rect(tq, tk))
            & (steps[:, abi.STEP_CUTS_B] == 0)).astype(np.int64)
    F = np.r_[0, np.cumsum(full)]
    np.testing.assert_array_equal(got.nfull, F[ptr + cnt] - F[ptr])     # full steps per unit
    return got


def _revisits(raw):
    """Steps of a raw plan that visit the K/V tile of the step before in their unit (0: one
    step per (unit, tile), the steps of a unit coming in non-decreasing kv_start)."""
    n = 0
    for f, c in zip(raw.first.tolist(), raw.cnt.tolist()):
        kv = raw.steps[f: f + c, abi.STEP_KV_START]
        assert (kv[1:] >= kv[:-1]).all()
        n += int((kv[1:] == kv[:-1]).sum())
    return n


_ORACLES = {"keep": (plan_oracle._plan_rowgroups_numpy, (False,)),
            "merge": (plan_oracle._plan_rowgroups_numpy, (True,)),
            "split": (plan_oracle._plan_grid_numpy, ()),
            "pack": (plan_oracle._plan_pack_numpy, ())}


@given(token_masks(), st.sampled_from(TEMPLATE_TILES + ODD_TILES),
       st.sampled_from([(1, 1), (8, 8)]))
@settings(max_examples=30, deadline=None)
def test_bitmap_pass_equals_its_specification(mt, tile, align):
    """Each policy's compiled loops (grid join and bitmap pass as they write) == the oracle's
    rows after the pass's specification, shared rows included (words relocated when unshared);
    and == both stages of the specification from the oracle's pieces. Without the pass
    (``bitmaps`` False, as ``auto``'s candidates) the loops give the oracle's rows as they are,
    their revisits counted, and ``_bitmap_steps`` on them the same plan as the loops' pass."""
    mask = mt[0]
    tq, tk = tile
    qal, kal = (a if t % a == 0 else 1 for a, t in zip(align, tile))
    ctx = _ctx(mask, tq, tk, qal, kal)
    for policy, (oracle, args) in _ORACLES.items():
        want = oracle(ctx, *args)
        got = planner._plan_policy(ctx, policy, share=False)
        _assert_same_raw(got, want, ctx)
        assert not _revisits(got)
        shared = planner._plan_policy(ctx, policy, share=True)
        _assert_same_raw(shared.unshared(), want, ctx)
        assert shared.num_steps <= got.num_steps and shared.words <= got.words
        assert not _revisits(shared)
        assert not shared.steps[shared.num_steps + shared.words:].any()
        for share in (False, True):
            pending = planner._plan_policy(ctx, policy, share=share, bitmaps=False)
            assert pending.pending and pending.words == 0
            np.testing.assert_array_equal(pending.rev, got.rev)
            np.testing.assert_array_equal(pending.visits(), got.cnt)
            plain = pending.unshared()
            for f in ("cnt", "nfull", "area", "steps"):
                np.testing.assert_array_equal(getattr(plain, f), getattr(want, f), err_msg=f)
            passed = planner._bitmap_steps(pending, tq, tk, ctx.cfg)
            assert not passed.pending
            _assert_same_raw(passed.unshared(), want, ctx)
        # Both stages of the spec (grid join, then one step per tile) from the oracle's
        # pieces: the compiled policy + pass, row for row.
        pc = plan_oracle.pieces(oracle, ctx, *args)
        steps, cnt, S = plan_oracle.tiles_once(pc["unit"], pc["kv"], pc["ql"], pc["qh"],
                                               pc["kl"], pc["kh"], tile=(tq, tk))
        np.testing.assert_array_equal(cnt, got.cnt)
        assert S == got.num_steps
        n = S + got.words
        np.testing.assert_array_equal(steps[:n], got.steps[:n])


# Every way the drivers run the step loops (``PlannerConfig`` fields as ``_on_threads`` sets them):
# one thread; two (the second half written past an estimate or the bound, moved down); a short
# estimate (the first half stops, the rest counted and written after moving the second half);
# the exact-count path; 4 and 8 threads (chunks counted, written at their offsets, the bitmap
# pass's gaps closed); the words written where the rows' reservation has room for them (from 0
# rows on, not only from _ROOM_MIN_ROWS) instead of after a copy of the rows.
_PATHS = {"one": (1, {}), "two": (2, {}),
          "short estimate": (2, {"est_margin": -0.9, "sample_stride": 3, "est_slack": 0}),
          "exact": (2, {"max_bound_bytes": 0}), "four": (4, {}), "eight": (8, {}),
          "room": (2, {"room_min_rows": 0})}


def test_bitmap_pass_on_every_thread_path():
    """Every thread path (``_PATHS``) == the oracle's rows after the pass's specification (the
    specification, the slow part, computed once per mask, tile and policy)."""
    rng = np.random.default_rng(11)
    masks = [_random_token_mask(rng, 700, 640, 2, 4, 0.3),
             _random_token_mask(rng, 300, 260, 1, 1, 0.1),
             _random_token_mask(rng, 900, 900, 3, 8, 0.2)]
    for mask in masks:
        for tq, tk in ((64, 64), (128, 128)):
            ctx = _ctx(mask, tq, tk, 1, 1)
            for policy, (oracle, args) in _ORACLES.items():
                want = oracle(ctx, *args)
                expect = _with_pass(want, tq, tk)
                for path, (threads, attrs) in _PATHS.items():
                    on = _on_threads(ctx, threads, **attrs)
                    got = planner._plan_policy(on, policy, share=False)
                    shared = planner._plan_policy(on, policy, share=True)
                    later = planner._bitmap_steps(planner._plan_policy(
                        on, policy, share=True, bitmaps=False), tq, tk, on.cfg)  # (auto's way)
                    for r in (got, shared.unshared(), later.unshared()):
                        _assert_same_raw(r, want, ctx, expect)
                    for r in (shared, later):
                        assert not r.steps[r.num_steps + r.words:].any(), path


def test_bitmap_pass_interpreted_equals_compiled():
    rng = np.random.default_rng(12)
    for mask in (_random_token_mask(rng, 300, 260, 2, 1, 0.1),
                 _random_token_mask(rng, 200, 330, 1, 4, 0.3)):
        ctx = _ctx(mask, 64, 64, 1, 1)
        for policy in ("keep", "merge", "split", "pack"):
            for threads in (1, 2):
                on = _on_threads(ctx, threads, loops="compiled")
                want = planner._plan_policy(on, policy, share=True)
                with _no_compiling():
                    got = planner._plan_policy(_on_threads(ctx, threads, loops="interpreted"),
                                               policy, share=True)
                assert got.words == want.words > 0
                for f in ("cnt", "nfull", "area", "rev", "njoin", "ptr", "steps"):
                    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)


@contextlib.contextmanager
def _no_compiling():
    """Fails if a compiled loop is called (``PlannerConfig(loops="interpreted")`` runs every
    loop as plain Python, as ``test_packaging`` checks)."""
    def no_compiling(*args):
        raise AssertionError("a compiled loop was called")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_loops, "compile_all", no_compiling)
        for name in plan_loops._PLAIN:
            mp.setattr(plan_loops, name, no_compiling)
        yield


def test_the_union_of_a_revisited_tile_takes_the_cheapest_kind():
    """The steps of a revisited tile become a plain step where their union is a rectangle (the
    whole tile: a full step), a grid step where it fits 4 x 4, a bitmap step otherwise."""
    tq, tk = 64, 64
    rows = []

    def plain(kv, a, b, c, d):
        rows.append((kv, int(abi.pack_rect(a, b, c, d)), 0, 0))

    plain(0, 0, 10, 0, 64)                    # unit 0, tile 0: two halves of a rectangle
    plain(0, 10, 20, 0, 64)
    plain(64, 0, 32, 0, 64)                   # tile 64: the whole tile in two steps
    plain(64, 32, 64, 0, 64)
    plain(0, 0, 10, 0, 64)                    # unit 1, tile 0: an L
    plain(0, 10, 20, 0, 10)
    plain(64, 0, 5, 0, 5)                     # tile 64: two rectangles apart
    plain(64, 50, 60, 40, 64)
    for k in range(5):                        # unit 2, tile 0: five stripes
        plain(0, 4 * k, 4 * k + 2, 0, 64)
    plain(128, 1, 2, 3, 4)                    # tile 128 visited once: kept as it is
    steps = np.array(rows, np.int64).astype(np.int32)
    z = np.zeros(3, np.int64)
    raw = planner._Raw(z, z, z, z + tq, np.array([4, 4, 6]), steps, z, z)
    got = _assert_pass_matches_spec(raw, tq, tk)
    st_ = got.steps[: got.stored]
    kinds = ["plain" if cb == 0 else "bitmap" if cb == abi.BITMAP_FLAG else "grid"
             for cb in st_[:, abi.STEP_CUTS_B]]
    assert kinds == ["plain", "plain", "grid", "grid", "bitmap", "plain"]
    assert st_[1, abi.STEP_RECT] == abi.full_rect(tq, tk) and got.nfull.tolist() == [1, 0, 0]
    assert got.cnt.tolist() == [2, 2, 2] and got.words == abi.bitmap_rows(tq, tk)
    for u, (a, n) in enumerate(((0, 4), (4, 4), (8, 6))):
        for kv in np.unique(steps[a:a + n, 0]):
            mine = a + np.flatnonzero(steps[a:a + n, 0] == kv)
            one = got.ptr[u] + np.flatnonzero(st_[got.ptr[u]: got.ptr[u] + got.cnt[u], 0] == kv)
            assert len(one) == 1
            np.testing.assert_array_equal(abi.step_mask(got.steps, one[0], tq, tk),
                                          abi.step_mask(steps, mine, tq, tk).any(0))


# --- whole plans: tiles once, exact cover, within dense -----------------------------------
@given(token_masks(), st.sampled_from(TEMPLATE_TILES), st.sampled_from([1, 8]))
@settings(max_examples=25, deadline=None)
def test_every_plan_tiles_once_covers_exactly_and_stays_within_dense(mt, tile, align):
    mask, Hq, Hkv = mt
    tq, tk = tile
    bound = planner.dense_tile_interactions(mask.Lq, mask.Lkv, tq, tk)
    for policy in POLICIES:
        p = _plan(mask, Hq, Hkv, tq, tk, policy, align, align)
        t = _check_abi(p, mask, align, align)          # coverage == the token mask, ABI rules
        s = _check_stats(p, mask, t)                    # tile_revisits == 0 among them
        plan_oracle.check_exact_cover(p)
        assert s["tile_revisits"] == 0
        key = t["unit"] * (p.kv_len_padded + 1) + t["k0"]
        assert len(np.unique(key)) == len(key)
        assert s["computed_interactions"] == len(key) * tq * tk    # <= tq x tk per (unit, tile)
        assert (_head_computed(p) <= bound).all(), (policy, _head_computed(p), bound)
        # bitmap steps only where a grid does not do: never full, never a rectangle or grid
        bm = t["bitmap"]
        if bm.any():
            assert not p.all_full
        for st_ in np.unique(t["step"][bm])[:20]:
            sel = abi.step_mask(p.steps, st_, tq, tk)
            row, words = plan_oracle._canonical_step(0, sel)
            assert words is not None, "a bitmap step whose selection fits a grid"
            r, c = np.flatnonzero(sel.any(1)), np.flatnonzero(sel.any(0))   # tight rectangle
            assert tuple(int(x) for x in abi.unpack_rect(int(p.steps[st_, abi.STEP_RECT]))) == (
                r[0], r[-1] + 1, c[0], c[-1] + 1)


@given(token_masks(), st.sampled_from(TEMPLATE_TILES), st.sampled_from(POLICIES))
@settings(max_examples=15, deadline=None)
def test_kinds_of_bitmap_tiles_match_direct_count(mt, tile, policy):
    mask, Hq, Hkv = mt
    p = _plan(mask, Hq, Hkv, *tile, policy)
    t = p.tile_rects()
    s = p.stats()
    np.testing.assert_array_equal([s["kept"], s["merged"], s["split"]], _direct_kinds(p, t))


@pytest.mark.parametrize("tile", TEMPLATE_TILES)
def test_dense_when_tiles_divide_the_lengths(tile):
    """Token-level masks (1, 4, 8 token blocks, a 1-token band) on lengths the tiles divide:
    every policy computes at most Lq x Lkv per head (split exactly dense where every tile
    holds a selected entry)."""
    tq, tk = tile
    rng = np.random.default_rng(tq + tk)
    L = 512
    i = np.arange(L)
    masks = [_random_token_mask(rng, L, L, 2, b, 0.1) for b in (1, 4, 8)]
    masks.append(tj.BlockMask.uniform(L, L, 1, 1, (np.abs(i[:, None] - i[None]) <= 24)[None]))
    for mask in masks:
        for policy in POLICIES:
            p = _plan(mask, 2, 1, tq, tk, policy)
            s = p.stats()
            assert s["tile_revisits"] == 0
            assert (_head_computed(p) <= L * L).all(), (policy, s["computed_interactions"])
        plan_oracle.check_exact_cover(p)


def test_shared_masks_keep_sharing_steps_and_words():
    """The heads of a shared mask (and repeated per-head masks) point at one copy of their
    steps and bitmap words: the plan holds as many rows as the plan of one head."""
    rng = np.random.default_rng(3)
    one = _random_token_mask(rng, 256, 256, 1, 1, 0.1)
    per_head = tj.BlockMask(one.q_bounds, one.kv_bounds, np.repeat(one.blocks, 4, axis=0))
    for policy in POLICIES:
        p1 = _plan(one, 1, 1, 64, 64, policy)
        ps = _plan(one, 4, 2, 64, 64, policy)
        ph = _plan(per_head, 4, 2, 64, 64, policy)
        for p in (ps, ph):
            assert p.num_steps == p1.num_steps and p.bitmap_rows == p1.bitmap_rows > 0
            assert p.steps.shape == p1.steps.shape
            assert p.stats()["bitmap_steps"] == 4 * p1.stats()["bitmap_steps"]
            u = p.units[: p.num_units]
            ptrs = {h: sorted(u[u[:, abi.UNIT_HEAD] == h, abi.UNIT_STEP_PTR].tolist())
                    for h in range(4)}
            assert all(ptrs[h] == ptrs[0] for h in range(4))


def test_plans_without_revisits_are_left_as_they_were():
    """No unit revisits a tile (blocks of 16+ tokens on 64-tiles): the pass returns the raw
    plan itself, so those plans are byte-identical to the plans before bitmap steps."""
    rng = np.random.default_rng(2)
    mask = _random_token_mask(rng, 512, 512, 2, 16, 0.3)
    ctx = _ctx(mask, 64, 64, 1, 1)
    for policy in ("keep", "merge", "split", "pack"):
        raw = planner._plan_policy(ctx, policy, share=True)
        assert not raw.rev.any() and raw.words == 0 and not _revisits(raw)
        assert planner._bitmap_steps(raw, 64, 64, ctx.cfg) is raw
        p = _plan(mask, 2, 2, 64, 64, policy)
        assert p.bitmap_rows == 0 and p.stats()["bitmap_steps"] == 0


def test_issue_cases_compute_at_most_dense():
    """The issue's CPU cases (L = 1024, 4 heads, 64 x 64 tiles): before bitmap steps 1-token
    blocks computed 184x dense, 4-token 10.2x, a 1-token band 1.95x; now at most dense."""
    rng = np.random.default_rng(0)
    L = 1024
    for b in (1, 4):
        m = _random_token_mask(rng, L, L, 4, b, 0.1)
        for policy in ("merge", "split", "auto"):
            s = _plan(m, 4, 4, 64, 64, policy).stats()
            assert s["computed_interactions"] == s["dense_interactions"], (b, policy)
            assert s["bitmap_steps"] == s["tiles"] == 4 * 16 * 16
    i = np.arange(L)
    band = tj.BlockMask.uniform(L, L, 1, 1, (np.abs(i[:, None] - i[None]) <= 24)[None])
    s = _plan(band, 1, 1, 64, 64, "auto").stats()
    assert s["computed_interactions"] <= 0.2 * s["dense_interactions"]


# --- negative controls: a corrupted bitmap is caught ---------------------------------------
def test_a_corrupted_bitmap_is_caught():
    rng = np.random.default_rng(9)
    mask = _random_token_mask(rng, 256, 256, 1, 1, 0.1)
    p = build_plan(mask, (1, 256, 2, 16), (1, 256, 2, 16), jnp.float32, tile_q=64, tile_kv=64,
                   policy="split")
    plan_oracle.check_exact_cover(p)
    b = int(np.flatnonzero(p.steps[: p.num_steps, abi.STEP_CUTS_B] == abi.BITMAP_FLAG)[0])
    off = int(p.steps[b, abi.STEP_CUTS_A])
    sel = abi.step_mask(p.steps, b, 64, 64)
    q_lo, q_hi, k_lo, k_hi = (int(x) for x in abi.unpack_rect(int(p.steps[b, abi.STEP_RECT])))
    r, c = np.argwhere(~sel[q_lo:q_hi, k_lo:k_hi])[0] + (q_lo, k_lo)   # unselected, inside

    def corrupted(edit):
        steps = p.steps.copy()
        edit(steps)
        return _replace(p, steps)

    def flip(rr, cc):
        def edit(s):
            w = s.reshape(-1)[off + (cc // 32) * 64 + rr].view(np.uint32)
            s.reshape(-1)[off + (cc // 32) * 64 + rr] = np.uint32(w ^ (1 << (cc % 32))).view(
                np.int32)
        return edit

    # A bit set inside the rectangle: a valid plan that selects one entry too many.
    bad = corrupted(flip(r, c))
    abi.check_plan(bad.units, bad.steps, 64, 64, bad.q_len_padded, bad.kv_len_padded)
    with pytest.raises(AssertionError):
        plan_oracle.check_exact_cover(bad)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(plan_oracle.coverage(bad), np.broadcast_to(
            mask.token_mask(), (2, 256, 256)))
    # A selected bit cleared: one entry too few.
    r1, c1 = np.argwhere(sel)[0]
    with pytest.raises(AssertionError):
        plan_oracle.check_exact_cover(corrupted(flip(r1, c1)))
    # A word at another offset: the bits of another tile.
    other = int(np.flatnonzero(p.steps[: p.num_steps, abi.STEP_CUTS_B] == abi.BITMAP_FLAG)[1])
    with pytest.raises((AssertionError, ValueError)):
        plan_oracle.check_exact_cover(corrupted(lambda s: s.__setitem__(
            (b, abi.STEP_CUTS_A), s[other, abi.STEP_CUTS_A])))
    # Bits outside the rectangle, words over step rows: check_plan.
    outside = (q_hi, k_lo) if q_hi < 64 else (q_lo - 1, k_lo)
    if 0 <= outside[0] < 64:
        with pytest.raises(ValueError, match="outside"):
            plan_oracle.check_exact_cover(corrupted(flip(*outside)))
    with pytest.raises(ValueError, match="visits"):
        plan_oracle.check_exact_cover(corrupted(lambda s: s.__setitem__(
            (b, abi.STEP_CUTS_A), 0)))
    # And the compiled pass against its spec: a changed word is a difference.
    ctx = _ctx(mask, 64, 64, 1, 1)
    got = planner._plan_policy(ctx, "split")
    want = _with_pass(plan_oracle._plan_grid_numpy(ctx), 64, 64)[0]
    np.testing.assert_array_equal(got.steps, want.steps)
    want.steps.reshape(-1)[4 * got.num_steps + 3] ^= 4
    assert not np.array_equal(got.steps, want.steps)


def _replace(p, steps):
    import dataclasses
    steps.setflags(write=False)
    return dataclasses.replace(p, steps=steps)
