"""Gathered steps (``abi.GATHER_FLAG``) and the host planner's ``gather`` policy: the ABI's
words and checks, exact cover of random block masks (variable and 1-token blocks, per-head
masks, empty rows, Lq != Lkv), the XLA executor's forward and backward against the float64
reference, and the Mosaic GPU kernel (interpret mode) on a gathered plan with GQA."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

import sys
from pathlib import Path

import tessera_jax as tj
from pallas_kernels import abi
from pallas_kernels.xla import executor
from tessera_jax.planning import gather as gather_policy, planner
from strategies import bounds_from_sizes, heads_and_blocks

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from gather import mask_var_clusters  # noqa: E402   (the H200 benchmark's clusters)


def _coverage(p):
    """int [Hq, Lq, Lkv]: how many steps select each entry (step_mask over step_keys)."""
    Hq, Lq, Lkv = p.shape.num_q_heads, p.shape.q_len, p.shape.kv_len
    cov = np.zeros((Hq, p.q_len_padded, p.kv_len_padded), np.int64)
    for h, q0, lo, hi, ptr, n in p.units[: p.num_units].astype(np.int64):
        s = np.arange(ptr, ptr + n)
        sel = abi.step_mask(p.steps, s, p.tile_q, p.tile_kv)          # [n, T, Tk]
        keys = abi.step_keys(p.steps, s, p.tile_kv)                   # [n, Tk]
        r = np.arange(p.tile_q)
        sel &= ((r >= lo) & (r < hi))[None, :, None]
        for m, kk in zip(sel, keys):
            np.add.at(cov[h, q0: q0 + p.tile_q], (slice(None), kk), m)
    assert not cov[:, Lq:].any() and not cov[:, :, Lkv:].any(), "a step selects padding"
    return cov[:, :Lq, :Lkv]


@st.composite
def gather_masks(draw):
    """(mask, Hq, Hkv): variable blocks, some of 1 token, per head or shared, empty rows."""
    def sizes():
        return draw(st.lists(st.one_of(st.integers(1, 1), st.integers(2, 12),
                                       st.integers(13, 200)), min_size=2, max_size=24))
    qb, kb = bounds_from_sizes(sizes(), 700), bounds_from_sizes(sizes(), 700)
    Hq, Hkv, blocks, rng = heads_and_blocks(draw, len(qb) - 1, len(kb) - 1, [0.05, 0.2, 0.5])
    if blocks.shape[1] > 1 and draw(st.booleans()):
        blocks[:, rng.integers(blocks.shape[1])] = False             # an empty query block
    return tj.BlockMask(qb, kb, blocks), Hq, Hkv


@given(gather_masks(), st.sampled_from([(128, 128), (64, 128), (128, 64), (64, 64)]),
       st.sampled_from(sorted(planner.GATHER_RUNS)), st.sampled_from([(8, 8), (1, 1), (8, 1)]))
@settings(max_examples=60, deadline=None)
def test_gather_plans_cover_the_mask_exactly_once(mt, tiles, policy, aligns):
    """Every selected (query, key) exactly once, whatever the tiles and the alignment (the
    XLA templates' 1: the padded keys still hold whole 8-key chunks)."""
    mask, Hq, Hkv = mt
    tq, tk = tiles
    run = planner.GATHER_RUNS[policy]
    p = planner.build_plan(mask, (1, mask.Lq, Hq, 16), (1, mask.Lkv, Hkv, 16), np.float32,
                           tile_q=tq, tile_kv=tk, policy=policy, q_align=aligns[0],
                           kv_align=aligns[1])
    assert p.kv_len_padded % abi.GATHER_ROWS == 0
    # Chunks in runs of the policy's copy size, checked as a kernel copying that many keys.
    abi.check_plan(p.units, p.steps, tq, tk, p.q_len_padded, p.kv_len_padded, num_q_heads=Hq,
                   q_align=aligns[0], kv_align=aligns[1], max_steps=p.max_steps, gather=run)
    want = mask.head_blocks(Hq)
    tok = np.zeros((Hq, mask.Lq, mask.Lkv), np.int64)
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    for h in range(Hq):
        tok[h] = want[h][np.searchsorted(qb, np.arange(mask.Lq), "right") - 1][
            :, np.searchsorted(kb, np.arange(mask.Lkv), "right") - 1]
    np.testing.assert_array_equal(_coverage(p), tok)
    c = p.tile_cells()                       # the same cover, as absolute rectangles
    cells = np.zeros_like(tok)
    for h, a, b, c0, c1 in zip(c["head"], c["r0"], c["r1"], c["c0"], c["c1"]):
        cells[h, a:b, c0:c1] += 1
    np.testing.assert_array_equal(cells, tok)
    s = p.stats()
    assert s["selected_interactions"] == tok.sum()
    assert s["computed_interactions"] <= s["dense_tile_interactions"]


_CLUSTERS = st.tuples(st.integers(300, 700), st.integers(0, 2**16)).map(
    lambda a: (mask_var_clusters(a[0], 2, q_mean=60, kv_mean=24, seed=a[1], kv_len=a[0] + 37),
               2, 1))


@given(st.one_of(gather_masks(), _CLUSTERS), st.sampled_from([(128, 128), (64, 128)]),
       st.sampled_from([8, 32]), st.sampled_from([None, 64]))
@settings(max_examples=25, deadline=None)
def test_compiled_gather_window_matches_numpy(mt, tiles, run, row_group):
    """The gather policy's units from the numba loops (``loops._nb_gather_window`` a unit, and
    ``_nb_gather_units`` all at once; compiled and interpreted) are NumPy's, byte for byte."""
    from tessera_jax.planning import loops
    mask, Hq, Hkv = mt
    tq, tk = tiles
    if row_group and row_group >= tq:
        row_group = None
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    blocks = mask.head_blocks(Hq)
    qp, kp = -(-mask.Lq // tq) * tq, -(-mask.Lkv // tk) * tk
    want = gather_policy.plan_gather(qb, kb, blocks, tq, tk, mask.Lq, qp, kp, run, row_group)
    for mode in ("compiled", "interpreted"):
        run_ = loops.runner(mode)
        for units in (None, run_._nb_gather_units):
            got = gather_policy.plan_gather(qb, kb, blocks, tq, tk, mask.Lq, qp, kp, run,
                                            row_group, window=run_._nb_gather_window,
                                            units=units)
            for a, b in zip(want, got):
                np.testing.assert_array_equal(a, b)


@st.composite
def _unit_masks(draw):
    """(q bounds, kv bounds, blocks [Hd, nq, nk]) for the all-units NumPy plan: variable and
    1-token blocks, a run of 63-130 one-token query blocks (windows of more than 62 blocks),
    clustered rows (classes of many key blocks), empty heads and query-block rows; or a grid
    of equal blocks (several query blocks in each row group of a tile, classes of many keys:
    units with several steps meeting one row group each)."""
    def sizes(n):
        return draw(st.lists(st.one_of(st.just(1), st.integers(2, 12), st.integers(13, 300)),
                             min_size=1, max_size=n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Hd = draw(st.integers(1, 3))
    if draw(st.integers(0, 2)) == 0:
        qs = [draw(st.sampled_from([16, 24, 32, 40]))] * draw(st.integers(4, 40))
        ks = [draw(st.sampled_from([8, 33, 64, 100]))] * draw(st.integers(8, 80))
        density, cl = rng.choice([0.3, 0.5, 1.0], Hd)[:, None, None], 0
    else:
        qs, ks = sizes(24), sizes(40)
        density = rng.choice([0.03, 0.2, 0.5, 1.0], Hd)[:, None, None]
        cl = draw(st.sampled_from([0, 1, 3]))       # rows drawn from cl clusters (0: none)
    if draw(st.booleans()):
        at = draw(st.integers(0, len(qs)))
        qs = qs[:at] + [1] * draw(st.integers(63, 130)) + qs[at:]
    qb, kb = bounds_from_sizes(qs, 1500), bounds_from_sizes(ks, 3000)
    nq, nk = len(qb) - 1, len(kb) - 1
    if cl:
        rows = rng.random((Hd, cl, nk)) < density
        blocks = rows[:, rng.integers(0, cl, nq)]
    else:
        blocks = rng.random((Hd, nq, nk)) < density
    if draw(st.booleans()):
        blocks[rng.integers(Hd)] = False                             # an empty head
    if nq > 1 and draw(st.booleans()):
        blocks[:, rng.integers(nq)] = False                          # an empty query block
    return qb, kb, blocks


@given(_unit_masks(), st.sampled_from([(128, 128), (64, 128)]), st.sampled_from([8, 32]),
       st.sampled_from([None, 64]))
@settings(max_examples=80, deadline=None)
def test_gather_numpy_all_units_matches_unit_by_unit(qkb, tiles, run, row_group):
    """The NumPy plan of every unit at once (``window=None``) is the unit-by-unit one
    (``_window_classes`` a unit), byte for byte: every array, dtype and shape."""
    qb, kb, blocks = qkb
    tq, tk = tiles
    Lq, Lkv = int(qb[-1]), int(kb[-1])
    qp, kp = -(-Lq // tq) * tq, -(-Lkv // tk) * tk
    args = (qb, kb, blocks, tq, tk, Lq, qp, kp, run, row_group)
    want = gather_policy.plan_gather(*args, window=gather_policy._numpy_window)
    got = gather_policy.plan_gather(*args)
    assert want.word_rows == got.word_rows
    for name, a, b in zip(want._fields[:-1], want[:-1], got[:-1]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


@given(_unit_masks(), st.sampled_from([(128, 128), (64, 128)]), st.sampled_from([None, 64]),
       st.sampled_from([1, 16, 40, 100, 1 << 18]))
@settings(max_examples=40, deadline=None)
def test_gather_numpy_steps_written_in_blocks(qkb, tiles, row_group, block_slots):
    """The all-units plan's single-chunk steps written a block of steps at a time
    (``_single_chunk_steps``; 1 slot: a step a block) are the unit-by-unit plan's, whatever
    the block: pieces and classes cut at the blocks' edges, unused slots in any block."""
    import functools
    qb, kb, blocks = qkb
    tq, tk = tiles
    Lq, Lkv = int(qb[-1]), int(kb[-1])
    args = (qb, kb, blocks, tq, tk, Lq, -(-Lq // tq) * tq, -(-Lkv // tk) * tk, 8, row_group)
    want = gather_policy.plan_gather(*args, window=gather_policy._numpy_window)
    write = gather_policy._single_chunk_steps
    gather_policy._single_chunk_steps = functools.partial(write, block_slots=block_slots)
    try:
        got = gather_policy.plan_gather(*args)
    finally:
        gather_policy._single_chunk_steps = write
    assert want.word_rows == got.word_rows
    for name, a, b in zip(want._fields[:-1], want[:-1], got[:-1]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_gather_numpy_all_units_on_wide_windows():
    """The case above with windows of more than 62 query blocks (signatures of several
    words), clustered rows and shared chunks, both runs and row groups, fixed: steps come."""
    rng = np.random.default_rng(11)
    qb = np.r_[0, 37, 37 + np.arange(1, 141), 400, 777]
    kb = np.r_[0, np.cumsum(rng.integers(1, 20, 90))]
    blocks = (rng.random((2, 4, 90)) < 0.3)[:, rng.integers(0, 4, len(qb) - 1)]
    segs = np.array(gather_policy.segments(qb, 128, int(qb[-1])))
    widest = max(int(np.searchsorted(qb, b)) - int(np.searchsorted(qb, a, "right")) + 1
                 for a, b in segs)
    assert widest > 62
    for run, row_group in ((8, None), (32, 64)):
        args = (qb, kb, blocks, 128, 128, int(qb[-1]), 896, -(-int(kb[-1]) // 128) * 128,
                run, row_group)
        want = gather_policy.plan_gather(*args, window=gather_policy._numpy_window)
        got = gather_policy.plan_gather(*args)
        assert want.cnt.sum() > 0
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)


def test_auto_loops_plan_large_query_blocks_with_numpy(monkeypatch):
    """With the compiled loops running ("auto", ready), the gather policy plans query blocks
    of >= tile_q / ``GATHER_NUMPY_MAX_BLOCKS`` tokens with NumPy's all-units pass (faster
    there), smaller ones with the loops; the steps are the compiled loops' either way."""
    from tessera_jax.planning import loops
    L, rng = 2048, np.random.default_rng(5)
    shape = tj.validation.check_shapes((1, L, 2, 64), (1, L, 2, 64), "float32")
    t = tj.runtime.dispatch.get_template("mgpu_q128_kv128_s2_gather")
    kw = dict(tile_q=t.tile_q, tile_kv=t.tile_kv, policy="gather", q_align=t.q_align,
              kv_align=t.kv_align, template=t.name, unit_order=t.unit_order,
              row_group=t.row_group)
    numpy_calls = []
    real = gather_policy._plan_all_units
    monkeypatch.setattr(gather_policy, "_plan_all_units",
                        lambda *a: numpy_calls.append(1) or real(*a))
    for blk, numpy_pass in ((128, True), (32, True), (16, False), (8, False)):
        n, per_tile = L // blk, 128 // blk      # a tile's query blocks share their keys
        sel = (rng.random((2, L // 128, n)) < 0.15).repeat(per_tile, axis=1)
        m = tj.BlockMask.uniform(L, L, blk, blk, sel)
        want = planner.build_unchecked(m, shape, config=planner.PlannerConfig(loops="compiled"),
                                       **kw)
        assert loops.ready()
        numpy_calls.clear()
        planner.clear_cache()
        got = planner.build_unchecked(m, shape, config=planner.PlannerConfig(), **kw)
        assert bool(numpy_calls) is numpy_pass, blk
        assert want.policy == got.policy == "gather" and want.stats()["gather_steps"] > 0
        np.testing.assert_array_equal(want.steps, got.steps)
        np.testing.assert_array_equal(want.units, got.units)


def test_gather_numpy_all_units_marks_full_steps():
    """Dense tiles whose keys end inside a chunk: a step of 15 whole chunks and a partial one
    is not full (``GATHER_FULL_FLAG``), whole steps are; as the unit-by-unit plan says."""
    flags = set()
    for Lkv in (120, 123, 128, 131, 250, 256):
        qb, kb = np.arange(0, 257, 16), np.r_[0, 7, np.arange(40, Lkv, 40), Lkv]
        blocks = np.ones((1, 16, len(kb) - 1), bool)
        for run in (8, 32):
            args = (qb, kb, blocks, 128, 128, 256, 256, -(-Lkv // 128) * 128, run)
            want = gather_policy.plan_gather(*args, window=gather_policy._numpy_window)
            got = gather_policy.plan_gather(*args)
            for x, y in zip(want, got):
                np.testing.assert_array_equal(x, y)
            S = int(want.cnt.sum())
            flags |= set(want.steps[:S, abi.STEP_CUTS_B].tolist())
    assert flags == {abi.GATHER_FLAG, abi.GATHER_FULL_FLAG}


def test_gather_numpy_all_units_interleaves_row_groups():
    """Units whose steps meet one row group each, several a group (``interleave_groups``
    alternates them): the all-units plan orders them as the unit-by-unit one."""
    rng = np.random.default_rng(3)
    qb, kb = np.arange(0, 513, 32), np.arange(0, 2001, 40)
    blocks = rng.random((2, 16, 50)) < 0.5
    args = (qb, kb, blocks, 128, 128, 512, 512, 2048, 8, 64)
    want = gather_policy.plan_gather(*args, window=gather_policy._numpy_window)
    got = gather_policy.plan_gather(*args)
    plain = gather_policy.plan_gather(*args[:-1], None)
    assert not np.array_equal(want.steps, plain.steps)      # the order differs from no groups
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_gather_plans_of_windows_with_many_blocks():
    """Windows of more than 62 query blocks (1-token blocks: signatures as packed rows, not
    integers) cover the mask exactly once too."""
    rng = np.random.default_rng(5)
    qb = np.arange(301)
    kb = np.r_[0, np.sort(rng.choice(np.arange(1, 2000), 29, replace=False)), 2000]
    # Query clusters of 40 one-token blocks sharing their key blocks: few classes a window.
    blocks = np.repeat(rng.random((2, 8, 30)) < 0.15, 40, axis=1)[:, :300]
    mask = tj.BlockMask(qb, kb, blocks)
    p = planner.build_plan(mask, (1, 300, 2, 16), (1, 2000, 2, 16), np.float32, tile_q=128,
                           tile_kv=128, policy="gather", q_align=8, kv_align=8)
    assert p.stats()["gather_steps"] > 0
    tok = np.stack([blocks[h][:, np.searchsorted(kb, np.arange(2000), "right") - 1]
                    for h in range(2)])
    np.testing.assert_array_equal(_coverage(p), tok)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=30), st.sampled_from([64, 128]))
@settings(max_examples=200, deadline=None)
def test_segments_pack_whole_blocks_into_aligned_tiles(sizes, tile_q):
    qb = np.r_[0, np.cumsum(sizes)]
    L = int(qb[-1])
    segs = gather_policy.segments(qb, tile_q, L)
    assert segs[0][0] == 0 and segs[-1][1] == L
    assert all(a < b for a, b in segs) and all(x[1] == y[0] for x, y in zip(segs, segs[1:]))
    assert all(b - (a - a % 8) <= tile_q for a, b in segs)        # fits its tile
    cuts = {b for _, b in segs[:-1]} - set(qb.tolist())
    for c in cuts:                       # a block is cut only where it fits no tile of its own
        i = int(np.searchsorted(qb, c, "right")) - 1
        assert qb[i + 1] - (qb[i] - qb[i] % 8) > tile_q, (c, qb[i], qb[i + 1])


def test_copy_runs_are_checked():
    """A plan of 8-key chunks is refused by kernels copying 32 keys at once where its chunks
    are not in runs; the gather32 plan of the same mask passes."""
    m = mask_var_clusters(1024, 2, q_mean=60, kv_mean=20, seed=2)
    kw = dict(tile_q=128, tile_kv=128, q_align=8, kv_align=8)
    shp = (1, 1024, 2, 16)
    p8 = planner.build_plan(m, shp, shp, np.float32, policy="gather", **kw)
    p32 = planner.build_plan(m, shp, shp, np.float32, policy="gather32", **kw)
    check = lambda p, run: abi.check_plan(p.units, p.steps, 128, 128, p.q_len_padded,  # noqa
                                          p.kv_len_padded, q_align=8, kv_align=8, gather=run)
    check(p8, 8), check(p32, 32), check(p32, 8)
    with pytest.raises(ValueError, match="runs of 32 consecutive keys"):
        check(p8, 32)
    with pytest.raises(ValueError, match="gather run"):
        check(p32, 24)


def test_gather_beats_split_on_variable_clusters():
    """The point of the policy: on variable clusters (four masks) it computes less than split,
    the best of the other policies there."""
    kw = dict(tile_q=128, tile_kv=128, q_align=8, kv_align=8)
    ratio = {"gather": [], "split": []}
    for seed in range(4):
        m = mask_var_clusters(8192, 2, seed=seed)
        for pol in ratio:
            s = planner.build_plan(m, (1, 8192, 2, 64), (1, 8192, 2, 64), np.float32,
                                   policy=pol, **kw).stats()
            ratio[pol].append(s["computed_interactions"] / s["selected_interactions"])
    assert np.mean(ratio["gather"]) < 0.92 * np.mean(ratio["split"]), ratio


def test_pack_gather_round_trip():
    rng = np.random.default_rng(0)
    for tq, tk in ((128, 128), (64, 128), (64, 64)):
        G = abi.gather_chunks(tk)
        starts = rng.integers(0, 100, (3, G)) * 8
        keys, rows = rng.random((3, tk)) < 0.5, rng.random((3, tq)) < 0.5
        w = abi.pack_gather(starts, keys, rows)
        assert w.shape == (3, abi.gather_words(tq, tk)) and w.dtype == np.int32
        s2, k2, r2 = abi.unpack_gather(w, tq, tk)
        np.testing.assert_array_equal(s2, starts)
        np.testing.assert_array_equal(k2, keys)
        np.testing.assert_array_equal(r2, rows)
    with pytest.raises(ValueError, match="multiple of 8"):
        abi.gather_chunks(60)


def _one_step_plan(tq=128, tk=128, kvp=512):
    """A unit of one gathered step: chunks at random aligned starts, random row and key bits."""
    rng = np.random.default_rng(1)
    G, wr = abi.gather_chunks(tk), abi.gather_word_rows(tq, tk)
    starts = rng.integers(0, kvp // 8, G) * 8
    keys = rng.random(tk) < 0.6
    rows = rng.random(tq) < 0.6
    keys[[3, tk - 2]] = rows[[1, tq - 3]] = True
    keys[[0, 1, 2, tk - 1]] = rows[[0, tq - 2, tq - 1]] = False
    steps = np.zeros((1 + wr, abi.STEP_COLS), np.int32)
    steps.reshape(-1)[4: 4 + abi.gather_words(tq, tk)] = abi.pack_gather(starts, keys, rows)
    steps[0] = (starts[0], abi.pack_rect(1, tq - 2, 3, tk - 1), 4, abi.GATHER_FLAG)
    units = np.array([[0, 0, 0, tq, 0, 1]], np.int32)
    return units, steps, starts, keys, rows


def test_check_plan_catches_every_broken_gather_rule():
    units, steps, *_ = _one_step_plan()
    check = lambda st, **kw: abi.check_plan(units, st, 128, 128, 128, 512, q_align=8,   # noqa
                                            kv_align=8, **{"gather": True, **kw})
    assert check(steps) is False
    with pytest.raises(ValueError, match="kernels that do not gather"):
        check(steps, gather=False)
    bad = steps.copy()
    bad.reshape(-1)[4 + 2] += 4
    with pytest.raises(ValueError, match="chunk start is not a multiple"):
        check(bad)
    bad = steps.copy()
    bad.reshape(-1)[4 + 2] = 512
    with pytest.raises(ValueError, match="chunk start"):
        check(bad)
    bad = steps.copy()
    bad[0, abi.STEP_RECT] = abi.pack_rect(0, 126, 3, 127)
    with pytest.raises(ValueError, match="bounding box"):
        check(bad)
    bad = steps.copy()
    bad[0, abi.STEP_CUTS_B] = abi.GATHER_FULL_FLAG
    with pytest.raises(ValueError, match="GATHER_FULL_FLAG"):
        check(bad)
    bad = steps.copy()
    bad[0, abi.STEP_CUTS_A] = 0                     # its words would be its own step row
    with pytest.raises(ValueError, match="rows a unit visits"):
        check(bad)
    bad = steps.copy()
    bad[0, abi.STEP_CUTS_A] = 6
    with pytest.raises(ValueError, match="offset"):
        check(bad)


def test_step_mask_and_keys_of_a_gathered_step():
    units, steps, starts, keys, rows = _one_step_plan()
    sel = abi.step_mask(steps, 0, 128, 128)
    np.testing.assert_array_equal(sel, rows[:, None] & keys[None, :])
    np.testing.assert_array_equal(abi.step_mask(jnp.asarray(steps), jnp.int32(0), 128, 128), sel)
    kk = abi.step_keys(steps, 0, 128)
    np.testing.assert_array_equal(kk, np.repeat(starts, 8) + np.tile(np.arange(8), 16))


def _ref64(q, k, v, m, scale):
    """Float64 NumPy attention under the mask's token-level selection (rows with no key: 0)."""
    q, k, v = (np.asarray(x, np.float64)[0] for x in (q, k, v))     # [L, H, D]
    Hq, g = q.shape[1], q.shape[1] // k.shape[1]
    blocks = m.head_blocks(Hq)
    qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
    rq = np.searchsorted(qb, np.arange(q.shape[0]), "right") - 1
    rk = np.searchsorted(kb, np.arange(k.shape[0]), "right") - 1
    out = np.zeros_like(q)
    for h in range(Hq):
        sel = blocks[h][rq][:, rk]
        s = np.where(sel, q[:, h] @ k[:, h // g].T * scale, -np.inf)
        mx = np.max(s, axis=1, keepdims=True)
        p = np.where(sel, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
        den = p.sum(1, keepdims=True)
        out[:, h] = (p / np.where(den > 0, den, 1)) @ v[:, h // g]
    return out[None]


@pytest.mark.parametrize("gqa", [1, 2])
def test_xla_runs_gather_plans_forward_and_backward(gqa):
    Lq, Lk, H, D = 700, 530, 4, 16
    m = mask_var_clusters(Lq, H, q_mean=60, kv_mean=20, seed=3, kv_len=Lk)
    p = tj.plan(m, (1, Lq, H, D), (1, Lk, H // gqa, D), jnp.float32, template="xla_128x128",
                policy="gather")
    assert p.stats()["gather_steps"] > 0
    ks = jax.random.split(jax.random.key(gqa), 4)
    q = jax.random.normal(ks[0], (1, Lq, H, D))
    k, v = (jax.random.normal(x, (1, Lk, H // gqa, D)) for x in ks[1:3])
    do = jax.random.normal(ks[3], (1, Lq, H, D))
    f = lambda q, k, v: tj.sparse_attention(q, k, v, m, template="xla_128x128",   # noqa
                                            policy="gather", scale=0.3)
    out, vjp = jax.vjp(f, q, k, v)
    ref, rvjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, m, scale=0.3), q, k, v)
    np.testing.assert_allclose(out, _ref64(q, k, v, m, 0.3), atol=2e-5)
    for a, b in zip(vjp(do), rvjp(do)):
        np.testing.assert_allclose(a, b, atol=5e-5)


@st.composite
def cluster_masks(draw):
    """(mask, Hq, Hkv): per-head variable clusters (``mask_var_clusters``) of random sizes,
    lengths (Lq != Lkv) and density, on which the gather policy makes gathered steps."""
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 2))
    Lq, Lkv = draw(st.integers(300, 700)), draw(st.integers(300, 700))
    m = mask_var_clusters(Lq, Hq, q_mean=draw(st.integers(40, 120)),
                          kv_mean=draw(st.integers(16, 48)),
                          density=draw(st.sampled_from([0.1, 0.2, 0.4])),
                          seed=draw(st.integers(0, 2**16)), kv_len=Lkv)
    return m, Hq, Hkv


@given(st.one_of(gather_masks(), cluster_masks()), st.sampled_from(["gather", "gather32"]))
# 5 examples, random each run: each compiles the XLA executor's forward and backward (~3 s).
@settings(max_examples=5, deadline=None)
def test_xla_gather_plans_match_the_float64_reference(mt, policy):
    """The XLA executor on random gathered plans (variable and 1-token blocks, clusters,
    per-head masks, GQA, empty query blocks, Lq != Lkv) against the float64 reference:
    output, and the gradient of q, k, v against the reference's."""
    mask, Hq, Hkv = mt
    D = 8
    ks = jax.random.split(jax.random.key(mask.Lq + 7 * mask.Lkv), 4)
    q = jax.random.normal(ks[0], (1, mask.Lq, Hq, D))
    k, v = (jax.random.normal(x, (1, mask.Lkv, Hkv, D)) for x in ks[1:3])
    do = jax.random.normal(ks[3], q.shape)
    f = lambda q, k, v: tj.sparse_attention(q, k, v, mask, template="xla_128x128",  # noqa
                                            policy=policy, scale=0.4)
    out, vjp = jax.vjp(f, q, k, v)
    np.testing.assert_allclose(out, _ref64(q, k, v, mask, 0.4), atol=3e-5)
    _, rvjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, mask, scale=0.4), q, k, v)
    for a, b in zip(vjp(do), rvjp(do)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def _run_templates():
    """The gather template, and kernel variants no table template uses (measured slower,
    benchmarks/NOTES.md#gathered-steps) but the kernel keeps: 32-key copy runs, paired 64-row
    units with one kv128 slot per ring; then the gather templates with warpgroup skipping
    (with and without the ping-pong barrier)."""
    import dataclasses
    from pallas_kernels import templates as T

    t = T.get("mgpu_q128_kv128_s2_gather")
    return [t, dataclasses.replace(t, name="run32", policy="gather32",
                                   kernel=T.MosaicConfig(gather=True, gather_run=32)),
            dataclasses.replace(t, name="paired", tile_q=64, stages=1, kernel=T.MosaicConfig(
                paired=True, pair_pingpong=True, gather=True)),
            _skip_template(), T.get("mgpu_q128_kv128_s2_gather_skip_nopp")]


def _skip_template():
    """The gather template with warpgroup skipping and the ping-pong barrier (deleted from the
    table: slower than the variant without it on cubes and sliding tiles,
    benchmarks/NOTES.md#gathered-steps; the kernel keeps it)."""
    import dataclasses
    from pallas_kernels import templates as T

    return dataclasses.replace(T.get("mgpu_q128_kv128_s2_gather"), name="gather_skip_pp",
                               kernel=T.MosaicConfig(gather=True, wg_skip=True))


@pytest.mark.parametrize("which", [0, 1, 2, 3, 4])
def test_mosaic_kernel_runs_a_gather_plan_in_interpret_mode(which):
    from jax._src.pallas.mosaic_gpu.interpret import params as _p
    from pallas_kernels import templates as T
    from pallas_kernels.mosaic import ops as mops

    t = _run_templates()[which]
    Lq, Lk, H, D = 264, 300, 2, 64
    m = mask_var_clusters(Lq, H, density=0.15, seed=5, kv_len=Lk)
    p = planner.build_plan(m, (1, Lq, H, D), (1, Lk, H // 2, D), jnp.bfloat16, tile_q=t.tile_q,
                           tile_kv=t.tile_kv, policy=t.policy, q_align=8, kv_align=8)
    st_ = p.stats()
    assert st_["gather_steps"] > 0 and p.head_policies[0] == t.policy
    if t.kernel.wg_skip:         # some steps' rows lie in one half: one warpgroup skips them
        rect = p.steps[: p.num_steps, abi.STEP_RECT].astype(np.int64)
        q_lo, q_hi = abi.unpack_rect(rect)[:2]
        assert ((q_hi <= 64) | (q_lo >= 64)).any()
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (1, Lq, H, D)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, Lk, H // 2, D)).astype(jnp.bfloat16) for x in ks[1:])
    plan = abi.PassPlan(p.units, p.steps, None, t.tile_q, t.tile_kv, p.q_len_padded,
                        p.kv_len_padded, p.max_steps, None)
    out = mops.forward(q, k, v, plan, template=t, scale=0.125, interpret=_p.InterpretGPUParams())
    ref = _ref64(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), m, 0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2)
    # A plan with a gathered step is refused by a template that does not gather.
    with pytest.raises(ValueError, match="do not gather"):
        mops.forward(q, k, v, plan, template=T.get("mgpu_q128_kv128_s2_hm"), scale=0.125,
                     interpret=_p.InterpretGPUParams())


@pytest.mark.parametrize("which", [0, 2, 3])
def test_mosaic_dq_runs_a_gather_plan_in_interpret_mode(which):
    """The dq kernel's gathered stages (8-key chunks; paired 64-row units; warpgroup
    skipping) against the gradient of the reference, GQA."""
    from jax._src.pallas.mosaic_gpu.interpret import params as _p
    from pallas_kernels import backward_rows as rows
    from pallas_kernels.mosaic import ops as mops

    t = _run_templates()[which]
    Lq, Lk, H, D = 264, 300, 2, 64
    m = mask_var_clusters(Lq, H, q_mean=60, kv_mean=20, density=0.3, seed=6, kv_len=Lk)
    p = planner.build_plan(m, (1, Lq, H, D), (1, Lk, H // 2, D), jnp.bfloat16, tile_q=t.tile_q,
                           tile_kv=t.tile_kv, policy=t.policy, q_align=8, kv_align=8)
    assert p.stats()["gather_steps"] > 0
    ks = jax.random.split(jax.random.key(9), 4)
    q = jax.random.normal(ks[0], (1, Lq, H, D)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, Lk, H // 2, D)).astype(jnp.bfloat16) for x in ks[1:3])
    do = jax.random.normal(ks[3], (1, Lq, H, D)).astype(jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out, lse = tj.reference_attention(*f32, m, scale=0.125, return_lse=True)
    want = jax.vjp(lambda q: tj.reference_attention(q, *f32[1:], m, scale=0.125), f32[0])[1](
        do.astype(jnp.float32))[0]
    delta = jnp.einsum("bqhd,bqhd->bhq", out, do.astype(jnp.float32))
    plan = abi.PassPlan(p.units, p.steps, None, t.tile_q, t.tile_kv, p.q_len_padded,
                        p.kv_len_padded, p.max_steps, None)
    got = mops.dq(q, k, v, do, rows.lse_for_backward(lse), delta, plan, template=t,
                  scale=0.125, interpret=_p.InterpretGPUParams())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


@pytest.mark.parametrize("skip", [False, True])
def test_mosaic_dkv_runs_a_gather_plan_in_interpret_mode(skip, monkeypatch):
    """The dk/dv kernel's gathered Q / dO / lse / delta stages (the transposed mask's gather32
    plan: units of 128 keys, steps of 32-query runs) against the gradients of the reference,
    GQA, per-head clusters; a template whose dk/dv kernel does not gather refuses the plan, and
    the gathering one refuses 8-query chunks (lse / delta copies of 32 bytes: misaligned for
    TMA); the host plans dk/dv of a gathering template with gather32 among its candidates."""
    from jax._src.pallas.mosaic_gpu.interpret import params as _p
    from pallas_kernels import backward_rows as rows
    from pallas_kernels import templates as T
    from pallas_kernels.mosaic import ops as mops
    from tessera_jax.runtime import host_plans

    t = _skip_template() if skip else T.get("mgpu_q128_kv128_s2_gather")
    monkeypatch.setitem(T._REGISTRY, t.name, t)      # tj.plan(template=t.name) below
    Lq, Lk, H, D = 264, 300, 2, 64
    m = mask_var_clusters(Lq, H, q_mean=60, kv_mean=20, density=0.3, seed=8, kv_len=Lk)
    tm = host_plans.transposed_mask(m)
    p = planner.build_plan(tm, (1, Lk, H, D), (1, Lq, H, D), jnp.bfloat16, tile_q=128,
                           tile_kv=64, policy="gather32", q_align=8, kv_align=8,
                           unit_order="head_major")
    assert p.stats()["gather_steps"] > 0
    q_lo, q_hi = abi.unpack_rect(p.steps[: p.num_steps, abi.STEP_RECT].astype(np.int64))[:2]
    assert ((q_hi <= 64) | (q_lo >= 64)).any()     # steps a skipping warpgroup skips
    ks = jax.random.split(jax.random.key(10), 4)
    q = jax.random.normal(ks[0], (1, Lq, H, D)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, Lk, H // 2, D)).astype(jnp.bfloat16) for x in ks[1:3])
    do = jax.random.normal(ks[3], (1, Lq, H, D)).astype(jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out, lse = tj.reference_attention(*f32, m, scale=0.125, return_lse=True)
    want = jax.vjp(lambda k, v: tj.reference_attention(f32[0], k, v, m, scale=0.125),
                   *f32[1:])[1](do.astype(jnp.float32))
    delta = jnp.einsum("bqhd,bqhd->bhq", out, do.astype(jnp.float32))
    plan = abi.PassPlan(p.units, p.steps, None, 128, 64, p.q_len_padded, p.kv_len_padded,
                        p.max_steps, None)
    got = mops.dkv(q, k, v, do, rows.lse_for_backward(lse), delta, plan, template=t,
                   scale=0.125, interpret=_p.InterpretGPUParams())
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=3e-2)
    p8 = planner.build_plan(tm, (1, Lk, H, D), (1, Lq, H, D), jnp.bfloat16, tile_q=128,
                            tile_kv=64, policy="gather", q_align=8, kv_align=8,
                            unit_order="head_major")
    plan8 = abi.PassPlan(p8.units, p8.steps, None, 128, 64, p8.q_len_padded, p8.kv_len_padded,
                         p8.max_steps, None)
    with pytest.raises(ValueError, match="runs of 32"):
        mops.dkv(q, k, v, do, rows.lse_for_backward(lse), delta, plan8, template=t,
                 scale=0.125, interpret=_p.InterpretGPUParams())
    with pytest.raises(ValueError, match="does not gather"):
        mops.dkv(q, k, v, do, rows.lse_for_backward(lse), delta, plan,
                 template=T.get("mgpu_q128_kv128_s2_hm"), scale=0.125,
                 interpret=_p.InterpretGPUParams())
    fwd = tj.plan(m, q.shape, k.shape, q.dtype, template=t.name, policy="gather")
    cands = host_plans.dkv_candidates(fwd, "mosaic_gpu")
    assert "gather32" in [c.policy for c, _ in cands]
    assert {c.row_group for c, per_sm in cands if per_sm == 1} == {
        64 if t.kernel.wg_skip else 128}
    plain = tj.plan(m, q.shape, k.shape, q.dtype, template="mgpu_q128_kv128_s2_hm")
    assert not {"gather", "gather32"} & {
        c.policy for c, _ in host_plans.dkv_candidates(plain, "mosaic_gpu")}


def _dkv_lower(t):
    """The dk/dv kernel of template ``t``'s family lowered for an abstract H200."""
    from cuda_lowering import lower_for_h200
    from pallas_kernels.mosaic import ops as mops

    sds = jax.ShapeDtypeStruct
    L, D = 384, 128
    q, kv = sds((1, L, 4, D), jnp.bfloat16), sds((1, L, 2, D), jnp.bfloat16)
    units, steps = sds((12, abi.UNIT_COLS), jnp.int32), sds((40, abi.STEP_COLS), jnp.int32)
    rows = jnp.zeros((1, 4, L), jnp.float32)
    plan = lambda u, s: abi.PassPlan(u, s, None, 128, 64, L, L, 4)   # noqa: E731
    return lower_for_h200(lambda q, k, v, u, s: mops.dkv(q, k, v, q, rows, rows, plan(u, s),
                                                          template=t, scale=0.1,
                                                          interpret=False),
                          q, kv, kv, units, steps)


@pytest.mark.parametrize("skip", [False, True])
def test_gathering_dkv_lowers_for_cuda(skip):
    """The gathering dk/dv kernel (Q / dO tiles and lse / delta vectors by 32-row copies; with
    warpgroup skipping) lowers for an abstract H200."""
    from pallas_kernels import templates as T

    assert "mosaic_gpu" in _dkv_lower(_skip_template() if skip
                                      else T.get("mgpu_q128_kv128_s2_gather"))


def test_dkv_gather_check_reads_only_visited_rows():
    """``check_dkv_gathers`` looks at the rows units visit: a bitmap step's word rows may hold
    a gather flag's bits in their cuts_b column (the compiled check of a skipping gather
    template on the H200 was refused by that, session 19). Every dk/dv candidate of that
    case passes the kernel's check; a gathered 8-query plan is still refused."""
    import zlib

    from pallas_kernels import contract
    from pallas_kernels.mosaic import backward as mb
    from tessera_jax.runtime import host_plans
    from tessera_jax.tools import gpu_check

    name = "mgpu_q128_kv128_s2_gather_skip_nopp-host-D128"
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    L = int(rng.integers(700, 1500))
    qb, blocks = gpu_check._mask_parts(rng, L, 4, "host", own_all=False)
    fwd = tj.plan(tj.BlockMask(qb, qb, blocks), (1, L, 4, 128), (1, L, 2, 128), jnp.bfloat16,
                  template="mgpu_q128_kv128_s2_gather_skip_nopp")
    cands = [c for c, _ in host_plans.dkv_candidates(fwd, "mosaic_gpu")]
    flagged = 0
    for c in cands:
        st = np.asarray(c.steps)
        flagged += int((abi.is_gather(st[:, abi.STEP_CUTS_B])
                        & ~abi.visited_rows(c.units, len(st))).any())
        contract.check_dkv_gathers(c, mb.DKV_GATHER_RUN)
    assert flagged, "no candidate has a flagged word row: the test would not catch the bug"
    tm = host_plans.transposed_mask(tj.BlockMask(qb, qb, blocks))
    p8 = planner.build_plan(tm, (1, L, 4, 128), (1, L, 4, 128), jnp.bfloat16, tile_q=128,
                            tile_kv=64, policy="gather", q_align=8, kv_align=8)
    assert p8.stats()["gather_steps"] > 0
    with pytest.raises(ValueError, match="runs of 32"):
        contract.check_dkv_gathers(p8, mb.DKV_GATHER_RUN)


def test_gathered_copies_refuse_misaligned_smem():
    """A gathered stage whose copies land at SMEM offsets that are not multiples of 128 bytes
    (8-query lse / delta copies: 32 bytes) is refused when the kernel is traced: the H200
    faulted on it (CUDA_ERROR_MISALIGNED_ADDRESS) while interpret mode ran it."""
    from cuda_lowering import lower_for_h200
    from pallas_kernels.mosaic import backward as mb

    sds = jax.ShapeDtypeStruct
    L, D = 384, 128
    q, kv = sds((1, L, 4, D), jnp.bfloat16), sds((1, L, 2, D), jnp.bfloat16)
    units, steps = sds((12, abi.UNIT_COLS), jnp.int32), sds((40, abi.STEP_COLS), jnp.int32)
    rows = sds((1, 4, L), jnp.float32)

    def dkv(run):
        return lambda q, k, v, lse, u, s: mb.dkv_call(q, k, v, q, lse, lse, u, s, tile_q=128,
                                                      mode="cond", scale=0.1, interpret=False,
                                                      gather_run=run)
    with pytest.raises(ValueError, match="multiples of 128 bytes"):
        lower_for_h200(dkv(8), q, kv, kv, rows, units, steps)
    assert "mosaic_gpu" in lower_for_h200(dkv(mb.DKV_GATHER_RUN), q, kv, kv, rows, units, steps)


def _lower(ops, t, pass_, family, D=128):
    """Forward or dq of template ``t`` lowered for an abstract H200 (``interpret=False``),
    with traced plan arrays: the text names the family's custom call."""
    from cuda_lowering import lower_for_h200

    sds = jax.ShapeDtypeStruct
    L = 384
    q, kv = sds((1, L, 4, D), jnp.bfloat16), sds((1, L, 2, D), jnp.bfloat16)
    units, steps = sds((12, abi.UNIT_COLS), jnp.int32), sds((40, abi.STEP_COLS), jnp.int32)
    plan = lambda u, s: abi.PassPlan(u, s, None, t.tile_q, t.tile_kv, L, L, 4)   # noqa: E731
    rows = jnp.zeros((1, 4, L), jnp.float32)
    fn = {"forward": lambda q, k, v, u, s: ops.forward(q, k, v, plan(u, s), template=t,
                                                       scale=0.1, interpret=False),
          "dq": lambda q, k, v, u, s: ops.dq(q, k, v, q, rows, rows, plan(u, s), template=t,
                                             scale=0.1, interpret=False)}[pass_]
    txt = lower_for_h200(fn, q, kv, kv, units, steps)
    assert family in txt
    return txt


@pytest.mark.parametrize("which", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("pass_", ["forward", "dq"])
def test_gathering_kernels_lower_for_cuda(which, pass_):
    """The gathering forward and dq kernels (8-key chunks, 32-key runs, paired units) lower
    for an abstract H200: Mosaic GPU's lowering refuses what it cannot compile (e.g. a
    negation in warp code, a ring past shared memory) before any GPU sees it."""
    from pallas_kernels.mosaic import ops as mops

    _lower(mops, _run_templates()[which], pass_, "mosaic_gpu")


def _triton_gather_template():
    from pallas_kernels import templates as T

    return T.get("triton_q128_kv128_w8_s3_gather")


def test_triton_kernels_gather_by_index():
    """The Triton forward and dq load a gathered step's keys by index: against the reference
    and its gradient (interpret mode), GQA, f32."""
    from pallas_kernels import backward_rows as rows
    from pallas_kernels.triton import ops as tops

    t = _triton_gather_template()
    Lq, Lk, H, D = 264, 300, 4, 32
    m = mask_var_clusters(Lq, H, q_mean=60, kv_mean=20, density=0.3, seed=6, kv_len=Lk)
    p = planner.build_plan(m, (1, Lq, H, D), (1, Lk, H // 2, D), jnp.float32, tile_q=t.tile_q,
                           tile_kv=t.tile_kv, policy="gather")
    assert p.stats()["gather_steps"] > 0
    ks = jax.random.split(jax.random.key(11), 4)
    q = jax.random.normal(ks[0], (1, Lq, H, D))
    k, v = (jax.random.normal(x, (1, Lk, H // 2, D)) for x in ks[1:3])
    do = jax.random.normal(ks[3], (1, Lq, H, D))
    out_ref, lse = tj.reference_attention(q, k, v, m, scale=0.2, return_lse=True)
    dq_ref = jax.vjp(lambda q: tj.reference_attention(q, k, v, m, scale=0.2), q)[1](do)[0]
    plan = abi.PassPlan(p.units, p.steps, None, t.tile_q, t.tile_kv, p.q_len_padded,
                        p.kv_len_padded, p.max_steps, None)
    out = tops.forward(q, k, v, plan, template=t, scale=0.2, interpret=True)
    np.testing.assert_allclose(out, _ref64(q, k, v, m, 0.2), atol=2e-5)
    delta = jnp.einsum("bqhd,bqhd->bhq", out_ref, do)
    dq = tops.dq(q, k, v, do, rows.lse_for_backward(lse), delta, plan, template=t, scale=0.2,
                 interpret=True)
    np.testing.assert_allclose(dq, dq_ref, atol=5e-5)


@pytest.mark.parametrize("pass_", ["forward", "dq"])
def test_triton_gather_lowers_for_cuda(pass_):
    from pallas_kernels.triton import ops as tops

    _lower(tops, _triton_gather_template(), pass_, "triton")


def test_acceptance_summary_keys_and_merge(tmp_path):
    """``benchmarks/gather_acceptance``: the summary's minima and maxima over families,
    routes and grids, each ratio within one run; a failed check leaves its row out; merged
    runs keep the extreme of each key."""
    import json
    import gather_acceptance as GA

    def row(grid, fam, route, ms, eff, ok=True):
        return dict(grid=grid, family=fam, route=route, ms=ms, efficiency=eff, ok=ok)

    rows = [row("a", "clusters", "host", 2.0, 0.7), row("a", "clusters", "device", 2.2, 0.64),
            row("a", "clusters", "perhead", 2.4, 0.6), row("a", "clusters", "fwd_bwd", 9.0, 0.66),
            row("a", "cubes", "host", 1.0, 0.9), row("a", "cubes", "device", 0.5, 0.3, ok=False),
            row("a", "aligned", "fwd_bwd", 1.0, 0.1),
            row("a", "sliding", "host", 1.0, 0.8), row("a", "sliding", "perhead", 1.1, 0.7),
            row("a", "sliding", "perhead_all", 1.5, 0.5)]
    s = GA.summarize(rows)
    assert s["efficiency_clusters_min"] == 0.64 and s["efficiency_cubes_min"] == 0.9
    assert s["device_vs_host_max"] == pytest.approx(1.1)
    assert s["perhead_bounds_vs_shared_max"] == pytest.approx(1.2)
    assert s["perhead_all_heads_vs_shared_max"] == pytest.approx(1.5)   # beside the key
    assert s["efficiency_sliding_min"] == 0.8              # per-head rows: not in efficiency
    assert s["fwd_bwd_efficiency_irregular_min"] == 0.66      # aligned is not irregular
    other = GA.summarize([row("b", "clusters", "host", 1.0, 0.8),
                          row("b", "clusters", "device", 1.5, 0.5)])
    paths = []
    for i, summ in enumerate((s, other)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps({"summary": summ, "rows": []}))
    GA.merge([str(p) for p in paths], str(tmp_path / "m.json"))
    m = json.loads((tmp_path / "m.json").read_text())["summary"]
    assert m["efficiency_clusters_min"] == 0.5 and m["device_vs_host_max"] == 1.5


def test_acceptance_sampled_rows_reference_matches_the_full_reference():
    """``gather_acceptance.rows_reference`` (the Wan 720p check: sampled query rows, head 0)
    equals the full reference at those rows, and so does its dq; past
    ``FULL_CHECK_MAX_ROWS`` rows the check samples."""
    import gather_acceptance as GA
    import tessera_jax as tj

    L, D = 600, 32
    m = mask_var_clusters(L, 2, density=0.2, seed=3)
    qb, kb, blocks = (np.asarray(x) for x in (m.q_bounds, m.kv_bounds, m.blocks))
    q, k, v, do = (jax.random.normal(x, (1, L, 1, D), jnp.float32)
                   for x in jax.random.split(jax.random.key(1), 4))
    rows = GA.check_rows(L, 97)
    assert len(rows) == 97 and GA.check_rows(L, 0) is None
    assert len(GA.check_rows(GA.FULL_CHECK_MAX_ROWS + 1, 0)) == 2048
    full = lambda q, k, v: tj.reference_attention(              # noqa: E731
        q, k, v, tj.BlockMask(qb, kb, blocks[:1]), scale=0.2)
    part = GA.rows_reference(qb, kb, blocks[0], rows, 0.2)
    np.testing.assert_allclose(part(q[:, rows], k, v), full(q, k, v)[:, rows], atol=1e-5)
    dq_full = jax.vjp(full, q, k, v)[1](do)[0][:, rows]
    dq_part = jax.vjp(part, q[:, rows], k, v)[1](do[:, rows])[0]
    np.testing.assert_allclose(dq_part, dq_full, atol=1e-5)


def test_device_gather_check_summary():
    """``benchmarks/device_gather_check``: per family, the fastest device / per-head template
    and its time over the host plan's, and the alt planner's time over main's; failed rows
    are left out."""
    import device_gather_check as DC

    def row(fam, route, ms, eff=None, ok=True):
        r = dict(family=fam, route=route, ms=ms, ok=ok)
        if eff is not None:
            r["efficiency"] = eff
        return r

    rows = [row("c", "host", 2.0, 0.6), row("c", "device_plain", 4.0, 0.3),
            row("c", "device_gather", 2.5, 0.48), row("c", "perhead_plain", 1.0, 0.9, ok=False),
            row("c", "perhead_gather", 3.0, 0.4), row("c", "plan_main_static", 0.5),
            row("c", "plan_alt_static", 0.25), row("c", "plan_main_perhead", 1.0)]
    s = DC.summarize(rows)["c"]
    assert s["best_device"] == "gather" and s["device_best_vs_host"] == pytest.approx(1.25)
    assert s["best_perhead"] == "gather" and s["perhead_best_vs_host"] == pytest.approx(1.5)
    assert s["plan_alt_over_main_static"] == pytest.approx(0.5)
    assert "plan_alt_over_main_perhead" not in s and s["plan_main_perhead_ms"] == 1.0
