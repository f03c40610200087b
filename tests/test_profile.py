"""The offline profiler (tiny CPU mode: XLA templates), its resume, refit, and the selection
benchmark's tiny mode."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from tessera_jax.tools import profiler as P
from tessera_jax.select import ranking as S

ARGS = ["--tiny", "--iters", "2", "--warmup", "1", "--dtype", "float32", "--head-dim", "16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny profile run: 2 tiny train masks x 2 candidates."""
    d = tmp_path_factory.mktemp("prof")
    table = P.main(ARGS + ["--out", str(d / "cpu.json"), "--raw", str(d / "raw")])
    return d, table


def _lines(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines() if x.strip()]


def test_tiny_profile_writes_raw_and_table(run):
    d, table = run
    recs = _lines(d / "raw" / "cpu.jsonl")
    masks = [r for r in recs if r["kind"] == "mask"]
    times = [r for r in recs if r["kind"] == "time"]
    assert {m["id"] for m in masks} == {"tiny-sta", "tiny-vsa"}       # train split only
    assert len(times) == 4 and all(r["status"] == "ok" and r["ms"] > 0 for r in times)
    assert {r["candidate"] for r in times} == {"xla_64x64/merge", "xla_128x128/merge"}
    assert all(len(r["samples"]) == 2 and r["timer"] == "wall" for r in times)
    t = S.load_table(d / "cpu.json")
    assert t.candidates == [("xla_64x64", "merge"), ("xla_128x128", "merge")]
    prov = table["provenance"]
    assert prov["split"] == "train" and prov["sampling"]["masks"] == 2
    assert prov["corpus_digest"].startswith("tiny:") and prov["versions"]["jax"]
    assert table["gpu"]["name"] == "cpu" and prov["fit"]["masks_used"] == 2
    # the table's stored relative times are the raw medians
    for i, mid in enumerate(m["id"] for m in masks):
        ms = {r["candidate"]: r["ms"] for r in times if r["id"] == mid}
        best = min(ms.values())
        row = table["model"]["rel_log_time"][i]
        assert row == pytest.approx([np.log(ms["xla_64x64/merge"] / best),
                                     np.log(ms["xla_128x128/merge"] / best)], abs=1e-4)


def test_resume_skips_done_pairs(run, tmp_path, monkeypatch):
    d, _ = run
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = (d / "raw" / "cpu.jsonl").read_text().splitlines()
    # drop one timing and cut the last line in half, as a killed run would leave it
    kept = [x for x in lines if '"xla_128x128/merge"' not in x or '"tiny-sta"' not in x]
    assert len(kept) == len(lines) - 1
    (raw / "cpu.jsonl").write_text("\n".join(kept[:-1]) + "\n" + kept[-1][:40])
    calls = []
    real = P.time_candidate

    def spy(mask, template, policy, *a, **k):
        calls.append((mask.digest, template, policy))
        return real(mask, template, policy, *a, **k)
    monkeypatch.setattr(P, "time_candidate", spy)
    P.main(ARGS + ["--out", str(tmp_path / "cpu.json"), "--raw", str(raw)])
    assert sorted((t, p) for _, t, p in calls) == [("xla_128x128", "merge"),
                                                   ("xla_128x128", "merge")]
    calls.clear()
    P.main(ARGS + ["--out", str(tmp_path / "cpu.json"), "--raw", str(raw)])
    assert calls == []                                        # everything is there now
    assert S.load_table(tmp_path / "cpu.json").data["provenance"]["fit"]["masks_used"] == 2


@pytest.fixture
def no_timing(monkeypatch):
    """Any candidate timing fails the test (--fit-only and an exhausted budget must not time)."""
    def boom(*a, **k):
        raise AssertionError("timed in --fit-only mode")
    monkeypatch.setattr(P, "time_candidate", boom)


def test_fit_only_and_time_budget_do_not_time(run, tmp_path, no_timing):
    d, table = run
    out = P.main(ARGS + ["--out", str(tmp_path / "a.json"), "--raw", str(d / "raw"),
                         "--fit-only"])
    assert out["model"]["rel_log_time"] == table["model"]["rel_log_time"]
    empty = tmp_path / "empty"
    P.main(ARGS + ["--out", str(tmp_path / "b.json"), "--raw", str(empty),
                   "--time-budget", "0"])
    t = S.load_table(tmp_path / "b.json")                     # an empty, valid table
    assert len(t.points) == 0 and t.order(np.zeros(30)) == t.default_order


def test_failing_candidate_is_recorded_not_fatal(tmp_path, monkeypatch):
    real = P.time_candidate

    def flaky(mask, template, policy, *a, **k):
        if template == "xla_128x128":
            raise RuntimeError("out of shared memory")
        return real(mask, template, policy, *a, **k)
    monkeypatch.setattr(P, "time_candidate", flaky)
    table = P.main(ARGS + ["--out", str(tmp_path / "c.json"), "--raw", str(tmp_path / "raw")])
    errs = [r for r in _lines(tmp_path / "raw" / "cpu.jsonl") if r.get("status") == "error"]
    assert len(errs) == 2 and "shared memory" in errs[0]["error"]
    assert all(row[1] is None for row in table["model"]["rel_log_time"])
    assert table["default_order"][0] == 0


def test_spec_sampling_is_per_family_and_train_only():
    specs, sampling = P.select_specs("train", max_masks=28)
    fams = {s["family"] for s in specs}
    assert len(fams) == 14 and all(s["split"] == "train" for s in specs)
    assert len(specs) == 28 and sampling["per_family"]["vsa"]["sampled"] == 2
    again, _ = P.select_specs("train", max_masks=28)
    assert [s["id"] for s in again] == [s["id"] for s in specs]
    with pytest.raises(ValueError, match="split"):
        P.select_specs("validation")
    tok, sampling = P.select_specs("train", families=["tokens"])        # the new family alone
    assert len(tok) == 24 and {s["family"] for s in tok} == {"tokens"}
    assert sampling["per_family"] == {"tokens": {"sampled": 24, "available": 24}}


def test_padded_arrays_keep_the_result():
    """Power-of-two capacities (padding units/steps select nothing) give the same output."""
    import jax
    import tessera_jax as tj
    rng = np.random.default_rng(0)
    m = tj.BlockMask([0, 40, 100, 230], [0, 70, 90, 200, 260], rng.random((2, 3, 4)) < 0.6)
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 230 if i == 0 else 260, 2, 16))
               for i in range(3))
    p = tj.plan(m, q.shape, k.shape, q.dtype, template="xla_64x64", policy="split")
    units, steps, ri, mcap = P.padded_arrays(p)
    assert units.shape[0] & (units.shape[0] - 1) == 0 and units.shape[0] >= p.units.shape[0]
    fn = P._executor(p.template, p.tile_q, p.tile_kv, p.q_len_padded, p.kv_len_padded, mcap,
                     16 ** -0.5)
    out = fn(q, k, v, units, steps, ri)
    ref = tj.reference_attention(q, k, v, m)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def _bench_module():
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "selection.py"
    spec = importlib.util.spec_from_file_location("bench_selection", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_selection_benchmark_tiny(run, tmp_path):
    d, _ = run
    bench = _bench_module()
    out = tmp_path / "sel.json"
    args = ["--tiny", "--table", str(d / "cpu.json"), "--out", str(out), "--iters", "2",
            "--warmup", "1", "--dtype", "float32", "--head-dim", "16", "--sel-repeats", "3"]
    res = bench.main(args)
    data = json.loads(out.read_text())
    s = data["summary"]
    for key in ("regret_median", "regret_p90", "gain_vs_best_fixed_geomean",
                "selection_ms_wan720"):
        assert isinstance(s[key], float) and s[key] > 0, key
    assert s["regret_median"] >= 1.0 and s["masks"] == 2 and s["complete"]
    assert {r["id"] for r in data["masks"]} == {"tiny-ditfa", "tiny-natten"}   # test split
    for r in data["masks"]:
        assert r["chosen"] in r["times_ms"] and r["best_ms"] == min(r["times_ms"].values())
    assert data["selection_cost"][0]["blocks"] == [40, 1182, 1182]
    # resume: a rerun re-times nothing
    res2 = bench.main(args)
    assert [r["times_ms"] for r in res2["masks"]] == [r["times_ms"] for r in res["masks"]]
    # --reuse-times: a fresh run copies the earlier times of the candidates it measured (one
    # dropped here, so it alone is timed again) and chooses again with the table
    prev = json.loads(out.read_text())
    dropped = sorted(prev["masks"][0]["times_ms"])[0]
    del prev["masks"][0]["times_ms"][dropped]
    (tmp_path / "prev.json").write_text(json.dumps(prev))
    res3 = bench.main(args[:4] + [str(tmp_path / "sel3.json")] + args[5:]
                      + ["--reuse-times", str(tmp_path / "prev.json")])
    first, second = res3["masks"]
    assert dropped not in first["reused"] and len(first["reused"]) == len(first["times_ms"]) - 1
    assert second["times_ms"] == res["masks"][1]["times_ms"] and first["chosen"] in first["times_ms"]
    assert res3["reused_times_from"] == str(tmp_path / "prev.json")


def test_error_streak_stops_and_retry_errors_remeasures(tmp_path, monkeypatch):
    real = P.time_candidate

    def broken(*a, **k):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")
    monkeypatch.setattr(P, "time_candidate", broken)
    out = ARGS + ["--out", str(tmp_path / "d.json"), "--raw", str(tmp_path / "raw"),
                  "--max-error-streak", "2"]
    P.main(out)
    recs = [r for r in _lines(tmp_path / "raw" / "cpu.jsonl") if r["kind"] == "time"]
    assert len(recs) == 2 and all(r["status"] == "error" for r in recs)     # stopped early
    monkeypatch.setattr(P, "time_candidate", real)
    P.main(out)                                        # the failed pairs are kept ...
    recs = [r for r in _lines(tmp_path / "raw" / "cpu.jsonl") if r["kind"] == "time"]
    assert len(recs) == 4 and sum(r["status"] == "ok" for r in recs) == 2
    table = P.main(out + ["--retry-errors"])           # ... until asked to measure them again
    _, times = P.read_raw(tmp_path / "raw" / "cpu.jsonl")
    assert len(times) == 4 and all(r["status"] == "ok" for r in times.values())
    assert all(v is not None for row in table["model"]["rel_log_time"] for v in row)


def test_explicit_candidates_fit_only_those(run, tmp_path, no_timing):
    """--candidates T/P picks exactly those pairs for the fit, in order; bad ones raise."""
    d, _ = run
    P.main(ARGS + ["--out", str(tmp_path / "c.json"), "--raw", str(d / "raw"),
           "--fit-only", "--candidates", "xla_128x128/merge"])
    assert S.load_table(tmp_path / "c.json").candidates == [("xla_128x128", "merge")]
    assert P.parse_candidates(["xla_64x64/pack", "xla_64x64/pack", "xla_128x128/merge"]) == \
        [("xla_64x64", "pack"), ("xla_128x128", "merge")]
    for bad in ("xla_64x64", "xla_64x64/nope", "/merge"):
        with pytest.raises(ValueError, match="candidates"):
            P.parse_candidates([bad])
    with pytest.raises(ValueError, match="template"):
        P.parse_candidates(["nope/merge"])


def test_code_revision_prefers_git_then_a_snapshot_file(tmp_path):
    import pathlib
    import subprocess
    from tessera_jax.tools.profiler import code_revision
    assert code_revision(tmp_path) is None                     # not a checkout, no file
    (tmp_path / ".snap_rev").write_text("abc1234\n")
    assert code_revision(tmp_path) == "abc1234"                # a `git archive` snapshot
    repo = pathlib.Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=repo).stdout.strip()
    if head:
        assert code_revision(repo) == head                     # a checkout: its HEAD


# --- plan digests: stale pairs, newest records --------------------------------------------------
def _copy_raw(d, tmp_path, edit=None):
    """The run's raw file copied under tmp_path (``edit(records)`` rewrites its records)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    recs = _lines(d / "raw" / "cpu.jsonl")
    if edit is not None:
        edit(recs)
    (raw / "cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return raw


def _spy(monkeypatch):
    calls = []
    real = P.time_candidate

    def spy(mask, template, policy, *a, **k):
        calls.append((mask.digest, template, policy))
        return real(mask, template, policy, *a, **k)
    monkeypatch.setattr(P, "time_candidate", spy)
    return calls


def test_time_records_carry_plan_digest(run):
    d, _ = run
    times = [r for r in _lines(d / "raw" / "cpu.jsonl") if r["kind"] == "time"]
    assert all(len(r["plan_digest"]) == 16 and "bitmap_steps" in r["plan"] for r in times)
    assert len({r["plan_digest"] for r in times}) == len(times)       # distinct plans


def test_remeasure_stale_retimes_only_changed_plans(run, tmp_path, monkeypatch):
    """A record with another digest or none is timed again; one on the current plan is kept."""
    d, _ = run

    def edit(recs):
        for r in recs:
            if r["kind"] == "time" and r["id"] == "tiny-sta" and r["template"] == "xla_64x64":
                r["plan_digest"] = "0" * 16                     # taken on another plan
            if r["kind"] == "time" and r["id"] == "tiny-vsa" and r["template"] == "xla_128x128":
                del r["plan_digest"]                            # before digests were recorded
    raw = _copy_raw(d, tmp_path, edit)
    calls = _spy(monkeypatch)
    out = ARGS + ["--out", str(tmp_path / "t.json"), "--raw", str(raw)]
    P.main(out)
    assert calls == []                                          # plain resume: nothing to do
    P.main(out + ["--remeasure-stale"])
    assert sorted((t, p) for _, t, p in calls) == [("xla_128x128", "merge"),
                                                   ("xla_64x64", "merge")]
    _, times = P.read_raw(raw / "cpu.jsonl")                    # newest records win
    assert all(len(r["plan_digest"]) == 16 and r["plan_digest"] != "0" * 16
               for r in times.values())
    calls.clear()
    P.main(out + ["--remeasure-stale"])
    assert calls == []                                          # every record is current now


def test_fit_uses_newest_record_and_one_rule_per_mask(run, tmp_path, no_timing):
    d, _ = run
    raw = _copy_raw(d, tmp_path)
    _, times = P.read_raw(raw / "cpu.jsonl")
    newer = dict(times[("tiny-sta", "xla_64x64/merge")])
    newer["ms"] = 1000.0 * times[("tiny-sta", "xla_128x128/merge")]["ms"]
    other = dict(times[("tiny-vsa", "xla_64x64/merge")], rule="cupti/l2=flush/other")
    with open(raw / "cpu.jsonl", "a") as f:
        f.write(json.dumps(newer) + "\n" + json.dumps(other) + "\n")
    t = P.main(ARGS + ["--out", str(tmp_path / "f.json"), "--raw", str(raw), "--fit-only"])
    fit = t["provenance"]["fit"]
    assert fit["masks_used"] == 1 and fit["masks_mixed_rules"] == 1    # tiny-vsa mixes rules
    assert t["model"]["rel_log_time"][0] == pytest.approx([np.log(1000.0), 0.0], abs=1e-4)


def test_plan_digest_follows_the_plan_arrays():
    import dataclasses
    import tessera_jax as tj
    rng = np.random.default_rng(1)
    m = tj.BlockMask.uniform(256, 256, 1, 1, rng.random((1, 256, 256)) < 0.2)   # 1-token
    shape = (1, 256, 2, 16)
    p = tj.plan(m, shape, shape, np.float32, template="xla_64x64", policy="split")
    assert p.stats()["bitmap_steps"] > 0
    tj.clear_caches()
    again = tj.plan(m, shape, shape, np.float32, template="xla_64x64", policy="split")
    assert again is not p and P.plan_digest(again) == P.plan_digest(p)
    steps = p.steps.copy()
    steps[p.num_steps] ^= 1                                     # one bit of one bitmap word
    assert P.plan_digest(dataclasses.replace(p, steps=steps)) != P.plan_digest(p)
    other = tj.plan(m, shape, shape, np.float32, template="xla_128x128", policy="split")
    assert P.plan_digest(other) != P.plan_digest(p)
    assert P.needs_timing(None, "r") and not P.needs_timing({"status": "ok", "rule": "r"}, "r")
    assert P.needs_timing({"status": "ok"}, "r")                # before rules were recorded
    assert not P.needs_timing({"status": "error"}, "r")
    assert P.needs_timing({"status": "error"}, "r", retry_errors=True)
    assert P.is_stale({}, "ab") and not P.is_stale({"plan_digest": "ab"}, "ab")


def test_selection_reuses_only_times_of_the_same_plan(run, tmp_path):
    """--reuse-times copies a time only where the earlier row recorded the same plan digest;
    rows without digests (runs before them) are timed again."""
    d, _ = run
    bench = _bench_module()
    args = ["--tiny", "--table", str(d / "cpu.json"), "--iters", "2", "--warmup", "1",
            "--dtype", "float32", "--head-dim", "16", "--sel-repeats", "2"]
    first = bench.main(args + ["--out", str(tmp_path / "a.json")])
    rows = first["masks"]
    assert all(set(r["plan_digests"]) == set(r["times_ms"]) for r in rows)
    prev = json.loads((tmp_path / "a.json").read_text())
    changed = sorted(prev["masks"][0]["plan_digests"])[0]
    prev["masks"][0]["plan_digests"][changed] = "0" * 16
    del prev["masks"][1]["plan_digests"]
    (tmp_path / "prev.json").write_text(json.dumps(prev))
    res = bench.main(args + ["--out", str(tmp_path / "b.json"), "--reuse-times",
                             str(tmp_path / "prev.json")])
    a, b = res["masks"]
    assert sorted(a["reused"]) == sorted(set(a["times_ms"]) - {changed})
    assert "reused" not in b and b["plan_digests"] == rows[1]["plan_digests"]


def test_dry_run_counts_without_timing(run, tmp_path, no_timing):
    d, _ = run

    def edit(recs):
        for r in recs:
            if r["kind"] == "time" and r["id"] == "tiny-sta":
                r["plan_digest"] = "0" * 16
    raw = _copy_raw(d, tmp_path, edit)
    before = (raw / "cpu.jsonl").read_text()
    base = ARGS + ["--out", str(tmp_path / "x.json"), "--raw", str(raw), "--dry-run"]
    n = P.main(base)
    assert n["pairs"] == 4 and n["to_time"] == 0 and n["kept"] == 4
    n = P.main(base + ["--remeasure-stale"])
    assert n["time"]["stale_plan"] == 2 and n["to_time"] == 2 and n["kept"] == 2
    n = P.main(ARGS + ["--out", str(tmp_path / "x.json"), "--raw", str(tmp_path / "none"),
                       "--dry-run"])
    assert n["time"]["no_record"] == 4 and n["by_family"]["sta"]["time"] == 2
    assert n["bitmap_pairs"] == sum(f["bitmap"] for f in n["by_family"].values())
    assert (raw / "cpu.jsonl").read_text() == before and not (tmp_path / "x.json").exists()


def test_plan_summary_matches_stats():
    import tessera_jax as tj
    rng = np.random.default_rng(2)
    for b, L in ((1, 200), (16, 700), (64, 512)):
        m = tj.BlockMask.uniform(L, L, b, b, rng.random((2, -(-L // b), -(-L // b))) < 0.2)
        for tpl, pol in (("xla_64x64", "split"), ("xla_128x128", "merge")):
            p = tj.plan(m, (1, L, 2, 16), (1, L, 2, 16), np.float32, template=tpl, policy=pol)
            st, sm = p.stats(), P.plan_summary(p)
            assert sm == {k: pytest.approx(st[k]) for k in sm}, (b, tpl)
