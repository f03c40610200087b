"""CPU checks of the peers benchmark (issue 7): exact mask conversions to FlashInfer's and
FlexAttention's inputs, the check subset, sampling, the summary/figure, the --dry-run mode, and
the FlashInfer trimming helpers (no network, no GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tessera_jax as tj
from tessera_jax.mask import BlockMask

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from peers_lib import convert as C  # noqa: E402


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peers = _load("peers")
fetch = _load("fetch_flashinfer")


def _per_q_head(mask, Hq):
    return np.broadcast_to(mask.token_mask(), (Hq, mask.Lq, mask.Lkv))


@st.composite
def masks(draw):
    """Random masks: uniform or variable bounds (short edges), shared or per head, GQA, empty rows."""
    Hkv = draw(st.integers(1, 2))
    g = draw(st.integers(1, 3))
    Hq = Hkv * g

    def bounds(L):
        if draw(st.booleans()):
            b = draw(st.integers(1, max(1, L)))
            return np.append(np.arange(0, L, b), L)
        cuts = draw(st.lists(st.integers(1, L - 1), max_size=6, unique=True)) if L > 1 else []
        return np.array([0, *sorted(cuts), L])

    Lq = draw(st.integers(1, 150))
    Lkv = draw(st.integers(1, 150))
    qb, kb = bounds(Lq), bounds(Lkv)
    Hm = draw(st.sampled_from([1, Hq]))
    seed = draw(st.integers(0, 2**31 - 1))
    p = draw(st.floats(0.0, 1.0))
    blocks = np.random.default_rng(seed).random((Hm, qb.size - 1, kb.size - 1)) < p
    if Hm > 1 and draw(st.booleans()):
        blocks[:] = blocks[:1]                      # per-head form, identical heads
    return BlockMask(qb, kb, blocks), Hq, Hkv


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks())
def test_flashinfer_conversions_are_exact(case):
    mask, Hq, Hkv = case
    want = _per_q_head(mask, Hq)
    v = C.fi_var(mask, Hq, Hkv)
    assert v.block_mask_map.shape == (v.num_kv_heads, *mask.blocks.shape[1:])
    assert v.num_qo_heads == Hq and Hq % v.num_kv_heads == 0
    assert np.array_equal(C.fi_var_token_mask(v), want)
    b = C.fi_bsr(mask)
    if isinstance(b, str):
        assert b                                    # says why
    else:
        t = C.fi_bsr_token_mask(b)
        assert t.shape == (mask.Lq, b.N) and b.N % b.C == 0 and b.N >= mask.Lkv
        assert not t[:, mask.Lkv:].any()            # padded keys are never selected
        assert np.array_equal(np.broadcast_to(t[:, :mask.Lkv], want.shape), want)
        assert b.indptr[-1] == b.indices.size and b.indices.dtype == np.int32


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks(), st.sampled_from([(16, 16), (32, 16), (16, 48), (64, 64)]),
       st.sampled_from([None, 192]))
def test_flex_conversion_is_exact(case, block, pad_to):
    mask, Hq, _ = case
    fb = C.flex_blocks(mask, block, pad_to=pad_to)
    assert fb.Lq_pad % (pad_to or block[0]) == 0 and fb.Lq_pad >= mask.Lq
    t = C.flex_token_mask(fb)
    assert not t[:, :mask.Lq, mask.Lkv:].any()     # padded keys never attended by real rows
    got = np.broadcast_to(t[:, :mask.Lq, :mask.Lkv], (Hq, mask.Lq, mask.Lkv)) if t.shape[0] == 1 \
        else t[:, :mask.Lq, :mask.Lkv]
    assert np.array_equal(got, _per_q_head(mask, Hq))
    # full tiles are entirely selected; partial tiles have a selected and an unselected token
    Bq, Bkv = block
    tm = np.zeros((mask.num_heads, fb.Lq_pad, fb.Lkv_pad), bool)
    tm[:, :mask.Lq, :mask.Lkv] = mask.token_mask()
    tiles = tm.reshape(mask.num_heads, fb.Lq_pad // Bq, Bq, fb.Lkv_pad // Bkv, Bkv).sum((2, 4))
    for h in range(mask.num_heads):
        for a in range(tiles.shape[1]):
            full = set(fb.full_kv_indices[h, a, :fb.full_kv_num_blocks[h, a]].tolist())
            part = set(fb.kv_indices[h, a, :fb.kv_num_blocks[h, a]].tolist())
            assert full == set(np.nonzero(tiles[h, a] == Bq * Bkv)[0].tolist())
            assert part == set(np.nonzero((tiles[h, a] > 0) & (tiles[h, a] < Bq * Bkv))[0].tolist())


def test_checks_catch_a_wrong_conversion():
    """The token-mask comparison the tests rely on sees one dropped block."""
    rng = np.random.default_rng(3)
    blocks = rng.random((1, 6, 5)) < 0.5
    blocks[0, 2, 1] = True
    mask = BlockMask.uniform(96, 80, 16, 16, blocks)
    b = C.fi_bsr(mask)
    bad = C.FIBsr(indptr=np.maximum(b.indptr - (np.arange(b.indptr.size) > 2), 0).astype(np.int32),
                  indices=np.delete(b.indices, b.indptr[2]), M=b.M, N=b.N, R=b.R, C=b.C, Lkv=b.Lkv)
    assert not np.array_equal(C.fi_bsr_token_mask(bad), mask.token_mask()[0])
    fb = C.flex_blocks(mask, (32, 32))
    assert fb.num_full + fb.num_partial > 0
    h, a = np.argwhere(fb.full_kv_num_blocks + fb.kv_num_blocks > 0)[0]
    kv_num = fb.kv_num_blocks.copy()
    full_num = fb.full_kv_num_blocks.copy()
    if full_num[h, a]:
        full_num[h, a] -= 1
    else:
        kv_num[h, a] -= 1
    import dataclasses
    bad_fb = dataclasses.replace(fb, kv_num_blocks=kv_num, full_kv_num_blocks=full_num)
    assert not np.array_equal(C.flex_token_mask(bad_fb)[:, :96, :80], mask.token_mask())


def test_fi_bsr_choices():
    rng = np.random.default_rng(0)
    shared = rng.random((1, 4, 3)) < 0.6
    # short last KV block, unselected: BSR with zero-padded K/V
    s = shared.copy()
    s[:, :, -1] = False
    b = C.fi_bsr(BlockMask.uniform(100, 90, 32, 32, s))
    assert not isinstance(b, str) and (b.R, b.C, b.N, b.M) == (32, 32, 96, 100)
    # ... selected: refused with the reason
    s[0, 0, -1] = True
    why = C.fi_bsr(BlockMask.uniform(100, 90, 32, 32, s))
    assert isinstance(why, str) and "short last KV block" in why
    per_head = BlockMask.uniform(64, 64, 32, 32, rng.random((2, 2, 2)) < 0.5)
    if not np.array_equal(per_head.blocks[0], per_head.blocks[1]):
        assert "per-head" in C.fi_bsr(per_head)
    variable = BlockMask([0, 10, 64], [0, 32, 64], np.ones((1, 2, 2), bool))
    assert "variable" in C.fi_bsr(variable)


def test_fi_var_gqa_semantics():
    rng = np.random.default_rng(1)
    b = rng.random((4, 3, 3)) < 0.5
    b[1] = ~b[0]                                    # group 0 (heads 0,1) differs
    m = BlockMask.uniform(48, 48, 16, 16, b)
    v = C.fi_var(m, 4, 2)
    assert v.kv_repeat == 2 and v.num_kv_heads == 4
    same = b.copy()
    same[1], same[3] = same[0], same[2]
    v2 = C.fi_var(BlockMask.uniform(48, 48, 16, 16, same), 4, 2)
    assert v2.kv_repeat == 1 and v2.num_kv_heads == 2
    assert np.array_equal(v2.block_mask_map, same[::2])
    with pytest.raises(ValueError, match="num_q_heads"):
        C.fi_var(m, 4, 3)
    with pytest.raises(ValueError, match="heads"):
        C.fi_var(m, 8, 2)
    with pytest.raises(TypeError, match="BlockMask"):
        C.fi_var(b, 4, 2)


def test_flex_best_block_prefers_aligned_tiles():
    rng = np.random.default_rng(2)
    m = BlockMask.uniform(512, 512, 64, 128, rng.random((1, 8, 4)) < 0.5)
    fb = C.flex_best_block(m)
    assert fb.block == (64, 128) and not fb.needs_mask_mod
    odd = BlockMask([0, 100, 300, 512], [0, 200, 512], rng.random((1, 3, 2)) < 0.7)
    fb2 = C.flex_best_block(odd)
    assert fb2.block == (128, 128)
    with pytest.raises(ValueError, match="block"):
        C.flex_blocks(m, (24, 128))
    with pytest.raises(ValueError, match="pad_to"):
        C.flex_blocks(m, (128, 128), pad_to=192)


def test_row_subset_reference_matches_full_reference():
    import jax.numpy as jnp
    rng = np.random.default_rng(4)
    qb, kb = np.array([0, 7, 20, 33, 40]), np.array([0, 5, 25, 36])
    blocks = rng.random((4, 4, 3)) < 0.5
    blocks[1, 2] = False                           # an empty row block in head 1
    m = BlockMask(qb, kb, blocks)
    q = rng.standard_normal((1, 40, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 36, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1, 36, 2, 8)).astype(np.float32)
    full = np.asarray(tj.reference_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), m))
    rows = C.check_rows(40, qb, 20, seed=0)
    assert np.all(np.diff(rows) > 0) and rows.min() >= 0 and rows.max() < 40
    assert set(qb[:-1]) <= set(rows.tolist())       # every block start is checked
    kvh, qh = np.array([1]), np.array([2, 3])
    sub = C.row_subset_mask(m, rows, qh)
    got = np.asarray(tj.reference_attention(jnp.asarray(q[:, rows][:, :, qh]), jnp.asarray(k[:, :, kvh]),
                                            jnp.asarray(v[:, :, kvh]), sub))
    np.testing.assert_allclose(got, full[:, rows][:, :, qh], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        C.row_subset_mask(m, np.array([40]))


def _row(fam, tess, fi_var=None, fi_bsr=None, flex=None, dense=None, status=None):
    def p(t, st="ok"):
        return {"status": st, "request_ms": t, "kernel_ms": None if t is None else t / 2}
    r = {"family": fam, "peers": {"tessera": p(tess)}}
    for name, t in (("flashinfer_var", fi_var), ("flashinfer_bsr", fi_bsr), ("flex", flex),
                    ("dense", dense)):
        if t is not None:
            r["peers"][name] = p(t, (status or {}).get(name, "ok"))
    return r


def test_summary_speedups():
    rows = [_row("sta", 1.0, fi_var=4.0, fi_bsr=3.0, flex=5.0, dense=6.0),
            _row("sta", 2.0, fi_var=4.0, flex=10.0, dense=3.0),
            _row("vsa", 1.0, fi_var=1.5, flex=2.0, dense=1.2, status={"dense": "wrong"}),
            _row("vsa", 1.0, fi_var=0.5, fi_bsr=0.1, flex=2.0, status={"flashinfer_bsr": "failed"})]
    s = peers.summarize(rows)
    # best alternatives: 3.0/1, 3.0/2, 1.5/1, 0.5/1
    assert s["min_speedup_vs_best_alternative"] == pytest.approx(0.5)
    assert s["median_speedup_vs_flashinfer"] == pytest.approx(np.median([3.0, 2.0, 1.5, 0.5]))
    assert s["median_speedup_vs_flex"] == pytest.approx(np.median([5.0, 5.0, 2.0, 2.0]))
    assert s["per_family_medians"]["vsa"]["dense"] is None
    assert s["per_family_medians"]["sta"]["best_alternative"] == pytest.approx(2.25)
    assert s["kernel"]["overall"]["flashinfer"]["n"] == 4
    assert "wrong" in " ".join(s["peer_not_ok"]["dense"])
    # a row where tessera itself failed gives no speedups
    assert peers.speedups(_row("x", 1.0, fi_var=2.0, status=None) | {"peers": {
        "tessera": {"status": "wrong", "request_ms": 1.0}}}) == {}


def test_speedup_upper_bound():
    """No runtime beats selected FLOPs at the run's best dense rate: peer time / that time."""
    a = _row("dense", 1.0, fi_var=2.0, flex=3.0, dense=2.0) | {"selected_flops": 4e12,
                                                                "density": 1.0}
    b = _row("sta", 1.0, fi_var=0.5, flex=4.0, dense=2.0) | {"selected_flops": 1e12,
                                                              "density": 0.25}
    b["peers"]["dense"]["kernel_ms"] = 2.0          # a slower dense shape: not the rate used
    bnd = peers.speedup_bounds([a, b])
    assert bnd["dense_rate_tflops"] == pytest.approx(4000.0)   # 4e12 FLOP in a 1 ms kernel
    # t_min: a 1 ms, b 0.25 ms; FlashInfer 2.0 / 1 and 0.5 / 0.25
    assert bnd["median"]["flashinfer"] == pytest.approx(2.0)
    assert bnd["median"]["flex"] == pytest.approx(np.median([3.0, 16.0]))
    assert bnd["masks_below_3x"]["flashinfer"] == 2
    assert peers.summarize([a, b])["speedup_upper_bound"] == bnd
    assert peers.speedup_bounds([_row("x", 1.0, fi_var=2.0)]) == {}


def test_bounded_diagnostic_timing():
    """A slow diagnostic (a 40-head 720p host plan) takes >= 2 timed calls within the budget; a
    fast one keeps the request rule, its probe call counting as the warm-up."""
    rule = peers.timing.REQUEST_RULE
    assert peers.bounded_rule(rule, 1.0, 20.0) == rule.replace(warmup=rule.warmup - 1)
    assert peers.bounded_rule(rule, 11_000.0, 20.0) == rule.replace(warmup=0, repeats=2)
    assert peers.bounded_rule(rule, 900.0, 20.0) == rule.replace(warmup=0)
    assert peers.bounded_rule(rule, 1000.0, 20.0) == rule.replace(warmup=0, repeats=20)
    assert peers.bounded_rule(rule.replace(repeats=3), 900.0, 20.0).repeats == 3
    args = peers.parse_args(["--request-iters", "21", "--diagnostic-budget", "0.12"])
    calls, befores = [], []
    t = peers._bounded_request(lambda: (calls.append(1), time.sleep(0.05)), args,
                               before=lambda: befores.append(1))
    assert t.rule.repeats == 2 and len(t.samples) == 2 and len(calls) == 3 == len(befores)
    assert min(t.samples) >= 45.0
    calls.clear()
    t = peers._bounded_request(lambda: calls.append(1), peers.parse_args(["--request-iters", "5"]))
    assert len(t.samples) == 5 and len(calls) == 5 + rule.warmup


def test_skip_from_needs_the_same_gpu():
    docs = {"h100.json": {"versions": {"gpu": "NVIDIA H100 80GB HBM3"}, "rows": []}}
    peers.check_same_gpu(docs, "NVIDIA H100 80GB HBM3")
    peers.check_same_gpu({}, "NVIDIA H200")
    with pytest.raises(SystemExit, match="same GPU"):
        peers.check_same_gpu(docs, "NVIDIA H200")


def test_figure_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row("sta", 1.0, fi_var=4.0, flex=5.0, dense=6.0),
            _row("vsa", 2.0, fi_var=4.0, flex=10.0, dense=3.0)]
    out = peers.figure(rows, str(tmp_path / "f.png"))
    assert out and (tmp_path / "f.png").stat().st_size > 1000


def test_merge_of_two_gpu_halves(tmp_path):
    pytest.importorskip("matplotlib")
    a = {"command": "a", "versions": {"gpu": "x"}, "rows": [
        dict(_row("sta", 1.0, fi_var=4.0, flex=5.0, dense=6.0), id="m1"),
        dict(_row("vsa", 2.0, fi_var=4.0, flex=10.0, dense=3.0), id="m2")]}
    b = {"command": "b", "rows": [dict(_row("vsa", 1.0, fi_var=1.0, flex=2.0, dense=3.0), id="m2"),
                                  dict(_row("sta", 2.0, fi_var=1.0, flex=3.0), id="m3")]}
    for n, d in (("a", a), ("b", b)):
        (tmp_path / f"{n}.json").write_text(json.dumps(d))
    out = tmp_path / "m.json"
    assert peers.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["id"] for r in doc["rows"]] == ["m1", "m2", "m3"]      # b's m2 replaced a's
    assert doc["summary"] == peers.summarize(doc["rows"]) and doc["summary"]["masks"] == 3
    assert doc["summary"]["median_speedup_vs_flashinfer"] == pytest.approx(1.0)
    assert [p["command"] for p in doc["parts"]] == ["a", "b"]
    assert (tmp_path / "m.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="usage"):
        peers.main(["--merge", str(out)])


def test_first_plan_in_the_same_run(tmp_path):
    """``--first-plan`` measures issue 33's first plan of a fresh install inside the peers
    run (one fresh process per case; here one family), its key in the summary; a merge keeps
    it; a run without it has no such key."""
    fp = peers.first_plan_run(300, cases=["dense"])
    assert "error" not in fp, fp
    got = fp["summary"]["first_plan_fresh_install_max_s"]
    assert 0 < got < 60 and fp["summary"]["cases_counted"] == ["dense"]
    assert peers.with_first_plan({}, {"first_plan": fp}) == {
        "first_plan_fresh_install_max_s": got}
    assert peers.with_first_plan({}, {}) == {}
    a = {"command": "a", "rows": [dict(_row("sta", 1.0, fi_var=4.0), id="m1")],
         "first_plan": fp}
    b = {"command": "b", "rows": [dict(_row("vsa", 1.0, fi_var=2.0), id="m2")]}
    for n, d in (("a", a), ("b", b)):
        (tmp_path / f"{n}.json").write_text(json.dumps(d))
    doc = peers.merge_docs([tmp_path / "b.json", tmp_path / "a.json"], str(tmp_path / "m.json"))
    assert doc["summary"]["first_plan_fresh_install_max_s"] == got


def test_sampling_is_stratified_and_test_only():
    specs, avail = peers.sample_specs(2, seed=0)
    fams = [s["family"] for s in specs]
    assert all(s["split"] == "test" for s in specs)
    assert set(fams) == set(avail)
    for f in avail:
        assert fams.count(f) == min(2, avail[f])
    k = len(avail)
    assert len(set(fams[:k])) == k                   # round-robin: every family once first
    again, _ = peers.sample_specs(2, seed=0)
    assert [s["id"] for s in again] == [s["id"] for s in specs]
    # a family's masks do not depend on which other families are asked for
    some = sorted(avail)[1::3]
    sub, _ = peers.sample_specs(2, some, seed=0)
    assert [s["id"] for s in sub] == [s["id"] for s in specs if s["family"] in some]
    assert [s["id"] for s in peers.sample_specs(2, some, seed=1)[0]] != [s["id"] for s in sub]


#: Dry masks whose device route runs in test_dry_run: shared 64-token windows, per-head cubes,
#: variable clusters (bitmap steps), variable bounds with GQA, per-head aligned blocks.
DRY_DEVICE = "sta,vsa,svg2,random_variable_gqa,random_aligned_perhead"


def test_dry_run(tmp_path):
    """Conversions of every dry mask, and tessera_jax's device route (mask source gpu) end to
    end on CPU: new device masks, the jitted call checked, request / kernel / device-plan
    times (host clock), the summary of those rows."""
    out = tmp_path / "dry.json"
    assert peers.main(["--dry-run", "--dry-device", DRY_DEVICE, "--request-iters", "3",
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["inexact_conversions"] == 0
    fams = {r["family"] for r in doc["rows"]}
    from tessera_jax.masks import FAMILIES
    assert set(FAMILIES) <= fams
    assert any(r["exact"]["fi_bsr"] for r in doc["rows"])
    assert any(r["fi_var_kv_repeat"] > 1 for r in doc["rows"])
    assert any(r["flex"]["mask_mod"] for r in doc["rows"]) and \
        any(not r["flex"]["mask_mod"] for r in doc["rows"])
    dev = [r for r in doc["rows"] if "tessera_device" in r]
    assert {r["family"] for r in dev} == set(DRY_DEVICE.split(","))
    assert doc["device_failures"] == 0 and doc["device_masks"] == len(dev)
    for r in dev:
        d = r["tessera_device"]
        assert d["status"] == "ok" and d["route"] == "device", d
        warm = peers.timing.REQUEST_RULE.warmup    # a new mask for each call it times
        assert d["rel_err"] < peers.RTOL and d["variants"] == warm + 3
        assert d["request_ms"] > 0 and d["kernel_ms"] > 0 and d["kernel_ms_all_variants"] > 0
        assert d["request_rule"] == peers.request_rule(
            peers.parse_args(["--request-iters", "3"])).name
        assert d["device_template"].startswith("xla_") and d["device_plan_ms"] > 0
        assert d["kernel_timer"] == "wall"                      # no GPU: the host clock
        ph = d["phase_s"]                    # where the row's wall time went, part by part
        assert {"first_call_check", "request_timing", "kernel_timing",
                "device_plan_timing"} <= set(ph) and all(x >= 0 for x in ph.values())
        assert sum(ph.values()) <= r["tessera_device"]["wall_s"] + 1e-3
        pc = d["phase_compiles"]             # XLA compiles per part: the first call compiles
        assert set(pc) <= set(ph) and pc["first_call_check"][0] >= 1
        assert all(sec <= ph[k] + 1e-3 for k, (n, sec) in pc.items())
    assert any(r["tessera_device"]["bitmap_capacity"] for r in dev)     # bitmap steps ran
    s = doc["device_summary"]
    assert s["mask_source"] == "gpu" and s["masks"] == len(dev)
    assert s["median_request_overhead_ms"] == pytest.approx(np.median(
        [r["tessera_device"]["request_ms"] - r["tessera_device"]["kernel_ms"] for r in dev]))
    assert sum(s["tessera_device"]["templates"].values()) == len(dev)


def test_mask_variants():
    rng = np.random.default_rng(5)
    qb, kb = np.array([0, 5, 70, 71, 150, 200]), np.array([0, 64, 65, 100, 190, 232])
    per_head = BlockMask(qb, kb, rng.random((4, 5, 5)) < 0.5)
    shared = BlockMask.uniform(200, 232, 32, 48, rng.random((1, 7, 5)) < 0.4)
    same = BlockMask(qb, kb, np.repeat(rng.random((1, 5, 5)) < 0.5, 4, axis=0))
    for m in (per_head, shared, same):
        vs = C.mask_variants(m, 6, group=2, seed=1)
        assert len(vs) == 6 and vs[0] is not None and np.array_equal(vs[0], m.blocks)
        assert len({v.tobytes() for v in vs}) == 6                 # a new mask every time
        for i, v in enumerate(vs[1:], 1):
            assert v.dtype == np.bool_ and v.shape == m.blocks.shape and v.flags.c_contiguous
            rolled = np.roll(m.blocks, 2 * i, axis=0) if m.num_heads > 1 else m.blocks
            gone = rolled & ~v
            assert not (v & ~rolled).any() and 1 <= gone.sum() <= 4    # one block (per group)
            assert gone.any(axis=0).sum() == 1
            # rows with two or more blocks keep one
            assert (v.sum(-1) >= np.minimum(rolled.sum(-1), 1)).all()
        if m is same:                                   # heads that were equal stay equal
            assert all((v == v[:1]).all() for v in vs)
        BlockMask(m.q_bounds, m.kv_bounds, vs[-1])      # a valid mask
    assert all(np.array_equal(v, per_head.blocks)       # key blocks of distinct sizes stay
               for v in C.mask_variants(per_head, 3, kind="permute"))
    mixed = BlockMask([0, 40, 100, 256], [0, 32, 64, 96, 100, 132, 164, 200],
                      rng.random((4, 3, 7)) < 0.5)
    vs = C.mask_variants(mixed, 4, kind="permute", seed=2)
    assert len({v.tobytes() for v in vs}) > 1
    want = mixed.selected_interactions(4)
    for v in vs:                                        # the same work, keys moved
        assert BlockMask(mixed.q_bounds, mixed.kv_bounds, v).selected_interactions(4) == want
    uniform = BlockMask.uniform(200, 232, 32, 48, rng.random((1, 7, 5)) < 0.4)
    for v in C.mask_variants(uniform, 4, kind="permute", seed=3):
        assert np.array_equal(v[:, :, -1], uniform.blocks[:, :, -1])   # short last block stays
    assert len(C.mask_variants(shared, 1)) == 1
    full = BlockMask(qb, kb, np.ones((4, 5, 5), bool))   # all selected: stays all selected
    vs = C.mask_variants(full, 4, seed=4)
    assert len(vs) == 4 and all(v.all() and v.shape == (4, 5, 5) for v in vs)
    assert len({id(v) for v in vs}) == 4 and all(v.flags.writeable for v in vs[1:])
    with pytest.raises(ValueError, match="kind"):
        C.mask_variants(shared, 3, kind="shuffle")
    with pytest.raises(ValueError, match="n must"):
        C.mask_variants(shared, 0)
    with pytest.raises(ValueError, match="group"):
        C.mask_variants(shared, 2, group=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks())
def test_fi_bsr_static_split_matches(case):
    """BSR from a pattern that arrives later (a new mask) on the layout of the bounds alone
    equals the one-step conversion."""
    mask, _, _ = case
    b = C.fi_bsr(mask)
    layout = C.fi_bsr_layout(mask)
    shared = C.shared_blocks(mask)
    if shared is None or isinstance(layout, str):     # refused, saying why
        assert isinstance(b, str) and b in ("per-head mask: the BSR pattern is shared by all "
                                            "heads", layout)
        return
    got = C.fi_bsr_from_shared(shared, layout)
    if isinstance(b, str):
        assert got == b
    else:
        assert all(np.array_equal(getattr(got, f), getattr(b, f)) for f in ("indptr", "indices"))
        assert (got.M, got.N, got.R, got.C, got.Lkv) == (b.M, b.N, b.R, b.C, b.Lkv)


def _src_row(fam, src, tess, kern, fi, rid):
    r = _row(fam, tess, fi_var=fi, flex=3 * tess, dense=4 * tess)
    r["peers"]["tessera"]["kernel_ms"] = kern
    return dict(r, id=rid, mask_source=src)


def test_summary_by_mask_source(tmp_path):
    """The headline is the gpu rows' (new masks on the device), the host rows' follow under
    by_mask_source; request overhead = request - kernel per peer; old rows are host rows."""
    gpu = [_src_row("sta", "gpu", 1.0, 0.9, 3.0, "a"), _src_row("vsa", "gpu", 2.0, 1.7, 5.0, "b")]
    host = [_src_row("sta", "host", 2.0, 0.9, 3.0, "a"), _src_row("vsa", "host", 4.0, 1.7, 5.0, "b")]
    s = peers.summarize(gpu + host)
    assert s["mask_source"] == "gpu+host" and s["masks"] == 4       # both sources
    assert s["median_speedup_vs_flashinfer"] == pytest.approx(np.median([3.0, 2.5, 1.5, 1.25]))
    assert s["min_speedup_vs_best_alternative"] == pytest.approx(1.25)
    assert s["median_request_overhead_ms"] == pytest.approx(np.median([0.1, 0.3, 1.1, 2.3]))
    # excess over cuDNN dense, row by row: (tess req - kern) - (dense req - dense req / 2)
    assert s["median_request_excess_over_cudnn_ms"] == pytest.approx(np.median(
        [0.1 - 2.0, 0.3 - 4.0, 1.1 - 4.0, 2.3 - 8.0]))
    g = s["by_mask_source"]["gpu"]
    assert g["masks"] == 2 and g["median_speedup_vs_flashinfer"] == pytest.approx(np.median([3.0, 2.5]))
    assert g["median_request_overhead_ms"] == pytest.approx(np.median([0.1, 0.3]))
    assert g["request_overhead_ms"]["flashinfer_var"]["median"] == pytest.approx(np.median([1.5, 2.5]))
    h = s["by_mask_source"]["host"]
    assert h["masks"] == 2 and h["median_speedup_vs_flashinfer"] == pytest.approx(np.median([1.5, 1.25]))
    assert h["median_request_overhead_ms"] == pytest.approx(np.median([1.1, 2.3]))
    # kernels alone: tessera kernel 0.9 / 1.7 ms against FlashInfer's (its request / 2 here)
    assert g["min_kernel_speedup_vs_flashinfer"] == pytest.approx(min(1.5 / 0.9, 2.5 / 1.7))
    assert "host_tiered" not in s["by_mask_source"] and "host_sync" not in s["by_mask_source"]
    # host rows with a tiered first request: a block of their own, tessera's request the tiered one
    tiered = [dict(r, peers=dict(r["peers"], tessera=dict(r["peers"]["tessera"],
                                                          tiered_request_ms=t)))
              for r, t in zip(host, (1.0, 2.0))]
    st = peers.summarize(gpu + tiered)
    ht = st["by_mask_source"]["host_tiered"]
    assert ht["median_speedup_vs_flashinfer"] == pytest.approx(np.median([3.0, 2.5]))
    assert ht["median_request_overhead_ms"] == pytest.approx(np.median([0.1, 0.3]))
    assert st["by_mask_source"]["host"] == s["by_mask_source"]["host"]   # sync rows unchanged
    assert st["median_speedup_vs_flashinfer"] == s["median_speedup_vs_flashinfer"]
    # a dense peer that failed gives no excess for its row
    bad = _src_row("sta", "gpu", 1.0, 0.9, 3.0, "c")
    bad["peers"]["dense"]["status"] = "wrong"
    assert peers.summarize([bad])["request_excess_over_cudnn_ms"] == {"n": 0}
    assert set(s["per_family_medians"]) == {"sta", "vsa"}
    old = [dict(_row("sta", 1.0, fi_var=2.0), id="x")]          # written before mask sources
    so = peers.summarize(old)
    assert so["mask_source"] == "host" and "by_mask_source" not in so and so["masks"] == 1
    # a negative overhead (host clock noise) gives no geomean, not NaN
    neg = [_src_row("sta", "gpu", 1.0, 1.2, 3.0, "n")]
    assert peers.summarize(neg)["request_overhead_ms"]["tessera"]["geomean"] is None
    # merge keeps one row per (mask, source); later files win
    for n, rows in (("a", gpu + host[:1]), ("b", host[1:] + [_src_row("sta", "host", 1.0, 0.9, 3.0, "a")])):
        (tmp_path / f"{n}.json").write_text(json.dumps({"command": n, "rows": rows}))
    pytest.importorskip("matplotlib")
    out = tmp_path / "m.json"
    assert peers.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted((r["id"], r["mask_source"]) for r in doc["rows"]) == \
        [("a", "gpu"), ("a", "host"), ("b", "gpu"), ("b", "host")]
    assert doc["summary"]["by_mask_source"]["host"]["median_speedup_vs_flashinfer"] == \
        pytest.approx(np.median([3.0, 1.25]))


def test_smoke_both_mask_sources(tmp_path):
    """Needs torch (CPU): the GPU pipeline on one tiny mask, masks starting on the device and
    on the host (FlashInfer absent, eager Flex, XLA dense): rows of both sources, all checked."""
    pytest.importorskip("torch")
    out = tmp_path / "smoke.json"
    rc = peers.main(["--smoke", "--mask-source", "both", "--families", "random_variable_gqa",
                     "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, doc.get("summary", {}).get("timing_rules")
    assert [r["mask_source"] for r in doc["rows"]] == ["gpu", "host"]
    for r in doc["rows"]:
        for p in ("tessera", "flex", "dense"):
            assert r["peers"][p]["status"] in peers.OK_STATES, (r["mask_source"], p, r["peers"][p])
    gpu, host = doc["rows"]
    assert gpu["peers"]["tessera"]["route"] == "device"
    assert host["peers"]["tessera"]["route"] in ("plan", "cudnn_dense")
    assert host["peers"]["tessera"]["to_device_request_ms"] > 0
    t = host["peers"]["tessera"]
    # the host request builds its BlockMask from the NumPy arrays, as FlashInfer converts them
    assert 0 < t["mask_ms"] < t["request_ms"] and t["request_check"]["status"] in peers.OK_STATES
    for mode in ("sync", "tiered"):
        assert t[f"{mode}_request_ms"] > 0
        assert 0 <= t[f"{mode}_device_route_calls"] <= t[f"{mode}_calls"]
    assert t["sync_device_route_calls"] == 0 and t["host_planning"] == "sync"   # CPU: auto is sync
    assert doc["summary"]["mask_source"] == "gpu+host" and set(doc["summary"]["by_mask_source"]) \
        == {"gpu", "host", "host_sync", "host_tiered"}


def test_shards_partition_the_sample():
    """One process per GPU: the shards of a sample are disjoint, cover it, keep its order and
    carry similar loads (the hy720 masks spread over them)."""
    specs, _ = peers.sample_specs(2, ["dense", "jenga", "natten", "sparge", "sta", "svg2", "xattn"])
    pos = {s["id"]: i for i, s in enumerate(specs)}
    for n in (2, 3):
        shards = [peers.shard_specs(specs, k, n) for k in range(n)]
        ids = [s["id"] for sh in shards for s in sh]
        assert sorted(ids) == sorted(pos) and len(set(ids)) == len(ids)
        for sh in shards:
            assert [pos[s["id"]] for s in sh] == sorted(pos[s["id"]] for s in sh)
        loads = [sum(map(peers.spec_cost, sh)) for sh in shards]
        assert max(loads) - min(loads) <= max(map(peers.spec_cost, specs))
    assert peers.spec_cost({"grid": "hy720", "text": 905}) > peers.spec_cost({"grid": "wan480"})
    assert peers.parse_args(["--shard", "1/2"]).shard == (1, 2)
    for bad in ("2/2", "x", "1"):
        with pytest.raises(SystemExit):
            peers.parse_args(["--shard", bad])


def test_bad_arguments():
    with pytest.raises(SystemExit):
        peers.parse_args(["--per-family", "0"])
    with pytest.raises(SystemExit):
        peers.parse_args(["--flex-pad", "100"])
    with pytest.raises(SystemExit):
        peers.parse_args(["--mask-variants", "0"])
    with pytest.raises(SystemExit):
        peers.parse_args(["--mask-source", "disk"])
    a = peers.parse_args([])
    assert a.mask_source == "host" and a.variant_kind == "perturb"    # today's runs by default


# --- fetch_flashinfer helpers (no network) --------------------------------------------------
def test_ninja_flags_and_representatives(tmp_path):
    nj = tmp_path / "build.ninja"
    nj.write_text("cuda_home = /usr/local\ncommon_cflags = -DA=1 $\n    -I/x/include $\n"
                  "    -isystem $cuda_home/include\ncuda_cflags = $common_cflags $\n"
                  "    -gencode=arch=compute_90a,code=sm_90a $\n    --compress-mode=size $\n    -O3\n")
    flags = fetch._ninja_flags(nj)
    assert flags[:3] == ["-DA=1", "-I/x/include", "-isystem"]
    assert "/usr/local/include" in flags and "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert not any(f.startswith("--compress-mode") for f in flags)
    reps = fetch._representative_sources({"sources": ["a/k_mask_0.cu", "a/k_mask_1.cu", "a/b.cu"]})
    assert [p.name for p in reps] == ["k_mask_0.cu", "b.cu"]


def test_include_closure(tmp_path):
    pkg = tmp_path / "site" / "flashinfer"
    inc = pkg / "data" / "include" / "flashinfer"
    inc.mkdir(parents=True)
    (pkg / "data" / "cutlass" / "include" / "cute").mkdir(parents=True)
    (inc / "a.cuh").write_text('#pragma once\n#include "b.cuh"\n#if 0\n#include <cute/x.hpp>\n#endif\n')
    (inc / "b.cuh").write_text("#include <cuda_runtime.h>\n")
    (inc / "unused.cuh").write_text("")
    (pkg / "data" / "cutlass" / "include" / "cute" / "x.hpp").write_text("")
    src = tmp_path / "gen.cu"
    src.write_text('#include <flashinfer/a.cuh>\n#include "config.inc"\n')
    kept, unresolved = fetch.include_closure(tmp_path / "site", [src])
    names = {p.name for p in kept}
    assert names == {"a.cuh", "b.cuh", "x.hpp"}     # conservative: the #if 0 include is kept
    assert unresolved == {"cuda_runtime.h", "config.inc"}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masks(), st.sampled_from([(16, 16), (32, 16), (64, 64)]), st.sampled_from([None, 192]))
def test_flex_torch_conversion_matches_numpy(case, block, pad_to):
    """The torch conversion (timed on the GPU) equals the NumPy one tested above."""
    pytest.importorskip("torch")
    mask, _, _ = case
    a = C.flex_blocks(mask, block, pad_to=pad_to)
    b = C.flex_blocks_torch(mask, block, pad_to=pad_to, device="cpu")
    assert (b["Lq_pad"], b["Lkv_pad"]) == (a.Lq_pad, a.Lkv_pad)
    for k, n in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
        num = b[n][0].numpy()
        assert np.array_equal(num, getattr(a, n))
        valid = np.arange(a.kv_indices.shape[-1]) < num[..., None]
        assert np.array_equal(b[k][0].numpy()[valid], getattr(a, k)[valid])
    for k in ("q_block_id", "kv_block_id", "blocks_padded"):
        assert np.array_equal(b[k].numpy(), getattr(a, k))
    # a new mask already on the device, with the static part made once: as the NumPy one of
    # that mask
    import torch
    static = C.flex_static_torch(mask, block, pad_to=pad_to, device="cpu")
    v = C.mask_variants(mask, 2, seed=3)[-1]
    vm = BlockMask(mask.q_bounds, mask.kv_bounds, v)
    a2 = C.flex_blocks(vm, block, pad_to=pad_to)
    b2 = C.flex_blocks_torch(mask, block, pad_to=pad_to, device="cpu",
                             blocks_dev=torch.from_numpy(v), static=static)
    for k, n in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
        num = b2[n][0].numpy()
        assert np.array_equal(num, getattr(a2, n))
        valid = np.arange(a2.kv_indices.shape[-1]) < num[..., None]
        assert np.array_equal(b2[k][0].numpy()[valid], getattr(a2, k)[valid])
    assert np.array_equal(b2["blocks_padded"].numpy(), a2.blocks_padded)
    with pytest.raises(ValueError, match="static"):
        C.flex_blocks_torch(mask, (16, 16) if tuple(block) != (16, 16) else (32, 16),
                            pad_to=pad_to, device="cpu", static=static)


def test_wall_ms_reports_garbage_collection_time():
    """The request timer's gc accounting: a call that collects reports its collection time, a
    call that does not reports 0, and the callback is removed afterwards."""
    import gc
    from peers_lib.timing import wall_ms
    junk = [[i] for i in range(200_000)]            # enough objects for a measurable collection
    n_callbacks = len(gc.callbacks)
    got: list = []
    times = wall_ms(gc.collect, iters=3, warmup=0, gc_ms=got)
    assert len(got) == 3 and all(g > 0 for g in got) and len(times) == 3
    assert all(g <= t + 1e-6 for g, t in zip(got, times))
    quiet: list = []
    gc.disable()                                    # no automatic collection can land in it
    try:
        wall_ms(lambda: sum(range(100)), iters=2, warmup=0, gc_ms=quiet)
    finally:
        gc.enable()
    assert quiet == [0.0, 0.0] and len(gc.callbacks) == n_callbacks
    del junk


def test_precompiled_masks_for_tiered_host_rows():
    """``--tiered-bounds new`` precompiles a mask of the same block shape with other bounds
    (only the traced route is compiled for the row's bounds); ``same`` the row's mask."""
    import argparse as _ap
    qb, kb = np.array([0, 1, 5, 9]), np.array([0, 4, 5, 12])
    m = tj.BlockMask(qb, kb, np.ones((2, 3, 3), bool))
    got = peers._precompiled(m, "new")
    assert got.shape == m.shape and got.digest != m.digest
    assert np.array_equal(got.q_bounds, qb) and np.array_equal(got.kv_bounds, [0, 3, 5, 12])
    assert peers._precompiled(m, "same") is m
    one = tj.BlockMask(np.array([0, 1, 2]), np.array([0, 1, 2]), np.ones((1, 2, 2), bool))
    assert peers._precompiled(one, "new") is one   # nothing moves


def test_auto_tiered_bounds_follow_the_family():
    """``--tiered-bounds auto``: "same" for a family whose bounds the grid fixes (sparge),
    "new" for content-dependent bounds (svg2's clusters) and for a case without a spec; an
    explicit mode is kept."""
    import argparse as _ap
    from tessera_jax.masks import corpus
    from tessera_jax.masks.corpus import build
    auto = _ap.Namespace(tiered_bounds="auto")
    specs = {s["family"]: s for s in corpus("test") if s["grid"] == "wan480"}
    for fam, want in (("sparge", "same"), ("svg2", "new")):
        case = _ap.Namespace(spec=specs[fam], mask=build(specs[fam], heads=1))
        assert peers.tiered_bounds(case, auto) == want, fam
        assert peers.tiered_bounds(case, _ap.Namespace(tiered_bounds="new")) == "new"
    m = tj.BlockMask(np.array([0, 4, 8]), np.array([0, 4, 8]), np.ones((1, 2, 2), bool))
    assert peers.tiered_bounds(_ap.Namespace(spec={}, mask=m), auto) == "new"


def test_gather_alternatives_on_irregular_keys():
    """``gather_alt`` of a gpu row whose key blocks have more than 8 distinct sizes: the four
    device-route variants (static / traced bounds, gathering off / on) each checked against the
    reference and timed; ratios of the pairs. A grid of equal key blocks is skipped."""
    rng = np.random.default_rng(3)
    kb = np.concatenate([[0], np.cumsum(rng.permutation(np.arange(1, 13)))])   # 12 sizes
    qb = np.array([0, 20, 45, 78])
    blocks = rng.random((4, 3, len(kb) - 1)) < 0.5
    blocks[0, 1] = False                                                        # an empty row
    mask = tj.BlockMask(qb, kb, blocks)
    args = peers.parse_args(["--iters", "20", "--request-iters", "2", "--check-rows", "64"])
    case = peers.DryCase({"id": "alt", "family": "svg2"}, mask, 4, 2, args)
    case.source = "gpu"
    res = peers._gather_alternatives(case, [mask.to_device().blocks], args)
    for name in ("static_never", "static_irregular", "traced_never", "traced_traced"):
        assert res[name]["status"] == "ok" and res[name]["rel_err"] < peers.RTOL, res[name]
        assert res[name]["kernel_ms"] > 0
    assert res["static_gather_speedup"] > 0 and res["traced_gather_speedup"] > 0
    from tessera_jax.select import device as select_device
    for name in select_device.DEVICE_TEMPLATES["xla"]:      # each named on traced bounds
        assert res[f"traced_{name}"]["status"] == "ok", res[f"traced_{name}"]
    grid = tj.BlockMask(qb, np.arange(0, 97, 8), rng.random((1, 3, 12)) < 0.5)
    case = peers.DryCase({"id": "grid", "family": "sta"}, grid, 4, 2, args)
    assert peers._gather_alternatives(case, [grid.to_device().blocks], args)["status"] == "skipped"


def test_device_alternatives_time_every_device_template():
    """``device_alt`` of a gpu row: each template of the backend's device list named to the
    same call (the XLA backend here), checked against the reference and timed; ``best``."""
    from tessera_jax.select import device as select_device
    rng = np.random.default_rng(5)
    qb, kb = np.array([0, 40, 96, 128]), np.array([0, 24, 64, 128])
    mask = tj.BlockMask(qb, kb, rng.random((4, 3, 3)) < 0.6)
    args = peers.parse_args(["--iters", "20", "--request-iters", "2", "--check-rows", "64"])
    case = peers.DryCase({"id": "alt", "family": "natten"}, mask, 4, 2, args)
    res = peers._device_alternatives(case, [mask.to_device().blocks], args)
    names = select_device.DEVICE_TEMPLATES["xla"]
    for n in names:
        assert res[n]["status"] == "ok" and res[n]["rel_err"] < peers.RTOL, res[n]
    assert res["best"] in names
    assert min(res[n]["kernel_ms"] for n in names) == res[res["best"]]["kernel_ms"]
    # Each template's device plan counted: its steps cover the selection at least once.
    sel = (np.diff(qb)[None, :, None] * np.diff(kb)[None, None, :] * mask.blocks).sum()
    for n in names:
        pc = res[n]["plan_counts"]
        assert pc["computed_over_selected"] >= 1.0, (n, pc)
        assert pc["steps"] * pc["tiles"][0] * pc["tiles"][1] >= sel, (n, pc)
        assert sum(pc["step_rows_by_kind"].values()) >= 1 and 0 <= pc["odd_units"] <= 1
