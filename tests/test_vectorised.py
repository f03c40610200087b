"""The planner's NumPy tier (``planning.vectorised``) and the "auto" tiers (issue 33).

* The NumPy tier's plans are the loops' plans, byte for byte: the golden digests
  (``tests/golden_plans.py``), and on random masks against the interpreted loops (which give
  the compiled loops' plans: ``test_packaging``), under every ``PlannerConfig`` layout choice
  (threads, the wide path, the exact-count path, shared step lists).
* "auto" plans a large mask in a fresh process by the NumPy tier and leaves numba's compile
  to a background thread (``loops.start_warm_up``), so the first plan never waits for it;
  with ``background_compile=False`` it compiles first, as before.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tessera_jax as tj
from tessera_jax.planning import PlannerConfig, build_plan, loops, planner, vectorised

import golden_plans
from test_planner import plan_masks

ROOT = pathlib.Path(__file__).resolve().parent.parent
TILE_POLICIES = ("keep", "merge", "split", "pack")


def _golden(masks, config):
    """Keys of the golden plans of ``masks`` (keep/merge/split/pack) that ``config`` changes."""
    want = json.loads(golden_plans.PATH.read_text())
    build = golden_plans._build_plan()
    changed = []
    for item in masks:
        name, mask, Hq, Hkv = item[:4]
        Lq, Lk = item[4:6] if len(item) > 4 else (mask.Lq, mask.Lkv)
        for tname, tq, tk, qa, ka, order in golden_plans.CONFIGS:
            for pol in TILE_POLICIES:
                p = build(mask, (1, Lq, Hq, 64), (1, Lk, Hkv, 64), np.float32, tile_q=tq,
                          tile_kv=tk, policy=pol, q_align=qa, kv_align=ka, template=tname,
                          unit_order=order, config=config)
                if golden_plans.plan_digest(p) != want[f"{name}|{tname}|{pol}"]:
                    changed.append(f"{name}|{tname}|{pol}")
    return changed


def _no_loops(monkeypatch):
    """Fails the test if any loop runs, compiled or interpreted."""
    def refuse(*args, **kwargs):
        raise AssertionError("a planner loop ran")
    monkeypatch.setattr(loops, "compile_all", refuse)
    monkeypatch.setattr(loops, "_interpret", refuse)
    for name in loops._PLAIN:
        monkeypatch.setattr(loops, name, refuse)


@pytest.mark.parametrize("chunk", [1 << 17, 3])
def test_numpy_tier_gives_the_golden_plans(monkeypatch, chunk):
    """Every keep/merge/split/pack plan of the golden random masks (variable bounds, 1-token
    blocks, shared and per-head masks, GQA; every shipped template's tiles), by the NumPy
    tier alone, in one chunk or many: the recorded digests, byte for byte."""
    _no_loops(monkeypatch)
    planner._build_cached.cache_clear()
    try:
        changed = _golden(golden_plans.random_masks(),
                          PlannerConfig(loops="vectorised", tier_chunk_steps=chunk))
    finally:
        planner._build_cached.cache_clear()
    assert not changed, f"{len(changed)} plans differ, e.g. {changed[:5]}"


@pytest.mark.slow
def test_numpy_tier_gives_the_golden_corpus_plans(monkeypatch):
    """The golden corpus masks (every family on the 480p grids, 2 heads): the recorded
    digests by the NumPy tier (~10-20 s)."""
    _no_loops(monkeypatch)
    planner._build_cached.cache_clear()
    try:
        changed = _golden(golden_plans.corpus_masks(), PlannerConfig(loops="vectorised"))
    finally:
        planner._build_cached.cache_clear()
    assert not changed, f"{len(changed)} plans differ, e.g. {changed[:5]}"


_LAYOUTS = [{}, {"threads": 1}, {"threads": 2, "par_min_rows": 0},
            {"threads": 4, "par_min_rows": 0, "wide_min_rows": 0},
            {"max_bound_bytes": 0}, {"share_step_lists": False}]
_CHUNKS = [1 << 17, 1, 7]          # the tier's chunks: one, a unit (or word) at a time, a few


def _arrays(p):
    return (p.units, p.steps, p.num_units, p.num_steps, p.max_steps, p.bitmap_rows,
            p.selected_interactions, p.head_policies, p.maybe_all_full, p.unit_cost)


@given(plan_masks(), st.sampled_from([(64, 64), (128, 64), (128, 96), (64, 192), (8, 8)]),
       st.sampled_from([(1, 1), (8, 8), (16, 32)]),
       st.sampled_from(TILE_POLICIES + ("gather",)), st.sampled_from(_LAYOUTS),
       st.sampled_from(_CHUNKS))
@settings(max_examples=80, deadline=None)
def test_numpy_tier_equals_the_loops(mt, tile, align, policy, layout, chunk):
    """Random masks (1-token to long blocks, empty rows, repeated heads), tiles (one not a
    power of two), alignments and policies, under each layout choice of ``PlannerConfig``
    (two threads, the wide path, the exact-count path, unshared step lists) and chunk size of
    the tier: the NumPy tier's plan is the loops' (interpreted), array for array."""
    mask, Hq, Hkv = mt
    tq, tk = tile
    qa, ka = align
    if tq % qa or tk % ka:
        qa, ka = 1, 1
    if policy == "gather" and tk % 8:     # gathered steps copy chunks of 8 keys
        tk = 64
        ka = 1 if tk % ka else ka

    def plan(loops_mode):
        return build_plan(mask, (1, mask.Lq, Hq, 16), (1, mask.Lkv, Hkv, 16), "float32",
                          tile_q=tq, tile_kv=tk, policy=policy, q_align=qa, kv_align=ka,
                          config=PlannerConfig(loops=loops_mode, tier_chunk_steps=chunk,
                                               **layout))

    got, want = plan("vectorised"), plan("interpreted")
    for a, b in zip(_arrays(got), _arrays(want)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.row_index, want.row_index)


def test_numpy_tier_row_index_equals_the_loop():
    """``Plan.row_index`` by the NumPy tier: the loop's, owned rows and the sentinel."""
    rng = np.random.default_rng(3)
    b = np.r_[0, np.sort(rng.choice(np.arange(1, 500), 30, replace=False)), 500]
    m = tj.BlockMask(b, b, rng.random((3, 31, 31)) < 0.3)
    for pol in ("merge", "pack"):
        got, want = (build_plan(m, (1, 500, 3, 16), (1, 500, 3, 16), "float32", tile_q=64,
                                tile_kv=64, policy=pol, config=PlannerConfig(loops=mode))
                     for mode in ("vectorised", "interpreted"))
        np.testing.assert_array_equal(got.row_index, want.row_index)


def test_canonical_steps_of_segments():
    """A step's canonical form from its segments: a gap between row groups is two row cuts
    (zeros between), equal neighbours no cut, more than GRID - 1 cuts a bitmap step whose
    words are ``abi.pack_bitmap`` of the selection."""
    from pallas_kernels import abi
    tq, tk = 16, 64
    x = np.array([[0b1111], [0b1111], [0b0110], [0b1 << 40]], np.uint64)
    s = vectorised._Segs(np.zeros(4, np.int64), np.zeros(4, np.int64), np.array([0, 2, 6, 9]),
                         np.array([2, 4, 8, 12]), x)
    st_ = vectorised._canonical(s, tq, tk)
    sel = np.zeros((tq, tk), bool)
    for a, b, w in zip(s.ra, s.rb, x[:, 0]):
        sel[a:b] = [(int(w) >> c) & 1 for c in range(tk)]
    assert st_.bitmap.tolist() == [True]      # rows: 0-4 | gap | 6-8 | gap | 9-12: 4 cuts
    out = np.zeros((1, abi.bitmap_rows(tq, tk) * abi.STEP_COLS), np.int32)
    vectorised._bitmap_words(s, st_.first, st_.end, out, tq, tk)
    np.testing.assert_array_equal(out[0, :2 * tq], abi.pack_bitmap(sel))
    q_lo, q_hi, k_lo, k_hi = abi.unpack_rect(int(st_.cols[0, abi.STEP_RECT]))
    assert (q_lo, q_hi, k_lo, k_hi) == (0, 12, 0, 41)
    # Two groups with the same keys, touching: one plain rectangle.
    s2 = vectorised._Segs(np.zeros(2, np.int64), np.zeros(2, np.int64), np.array([0, 3]),
                          np.array([3, 16]), np.array([[0b1100], [0b1100]], np.uint64))
    st2 = vectorised._canonical(s2, tq, tk)
    assert st2.cols[0, abi.STEP_CUTS_B] == 0 and not st2.bitmap[0]


def test_planner_config_loop_modes():
    assert PlannerConfig(loops="vectorised").loops == "vectorised"
    with pytest.raises(TypeError, match="background_compile"):
        PlannerConfig(background_compile=1)
    with pytest.raises(ValueError, match="loops must be one of"):
        PlannerConfig(loops="numpy")


def test_start_warm_up_runs_once_on_a_daemon_thread():
    """The background warm-up runs its callable on a daemon thread (only where the loops are
    not ready: a fresh process, ``test_auto_first_plan_...``); here, where they are ready or
    warming, it starts nothing."""
    loops.ensure_compiled()
    ran = threading.Event()
    loops.start_warm_up(ran.set)
    assert not ran.wait(0.2) and loops.ready()


_FIRST_PLAN = r"""
import json, sys, time
import numpy as np
import tessera_jax as tj
from tessera_jax.planning import PlannerConfig, build_plan, loops
sys.path.insert(0, sys.argv[1])
import golden_plans
started = []
if sys.argv[2] == "no-thread":          # record the request, start nothing: numba stays out
    loops.start_warm_up = lambda warm: started.append(warm.__name__)
# 8-token blocks at L = 8,192, 20% random, shared over 4 heads: split's loops are too large
# to interpret (numba would compile them for ~10-25 s on a 2-core box).
rng = np.random.default_rng(0)
b = np.arange(0, 8193, 8)
m = tj.BlockMask(b, b, rng.random((1, 1024, 1024)) < 0.2)
shape = (1, 8192, 4, 64)
cfg = PlannerConfig(**json.loads(sys.argv[3]))
t0 = time.perf_counter()
p = build_plan(m, shape, shape, "bfloat16", tile_q=64, tile_kv=64, policy="split",
               q_align=8, kv_align=8, config=cfg)
t = time.perf_counter() - t0
ready, numba = loops.ready(), "numba" in sys.modules
want = golden_plans.plan_digest(build_plan(m, shape, shape, "bfloat16", tile_q=64, tile_kv=64,
                                           policy="split", q_align=8, kv_align=8,
                                           config=PlannerConfig(loops="vectorised")))
print(json.dumps({"plan_s": t, "ready": ready, "numba": numba, "started": started,
                  "warming": loops.warming(), "same": golden_plans.plan_digest(p) == want,
                  "steps": int(p.num_steps), "bitmap_rows": int(p.bitmap_rows)}))
"""


def _first_plan(tmp_path, thread: str, **options) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR",)}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _FIRST_PLAN, str(ROOT / "tests"), thread,
                        json.dumps(options)], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_auto_first_plan_of_a_large_mask_does_not_wait_for_numba(tmp_path):
    """A fresh process, empty numba cache, "auto": the first plan of a mask too large to
    interpret is the NumPy tier's (the same plan), made without importing numba, and asks
    for the background compile once it is built. Without the tier it would compile split's
    loops first (12-25 s here): ``background_compile=False`` shows that path still works."""
    out = _first_plan(tmp_path, "no-thread")
    assert out["same"] and out["bitmap_rows"] > 0, out
    assert not out["numba"] and not out["ready"], out      # numba never loaded for the plan
    assert out["started"] == ["warm_up"], out
    assert out["plan_s"] < 8.0, out                        # ~0.1-0.3 s; compiling: 12-25 s


def test_auto_first_plan_starts_the_background_compile(tmp_path):
    """The real thread: right after the first plan the loops are not ready (the warm-up is
    compiling them on its thread, which the process leaves at exit)."""
    out = _first_plan(tmp_path, "thread")
    assert out["same"] and not out["ready"] and out["warming"], out


@pytest.mark.slow
def test_auto_without_background_compile_compiles_first(tmp_path):
    """``background_compile=False``: the first large plan loads numba and compiles the loops
    it calls (the behaviour before the NumPy tier; ~20 s here), and gives the same plan."""
    out = _first_plan(tmp_path, "no-thread", background_compile=False)
    assert out["same"] and out["numba"] and out["ready"] and not out["started"], out
