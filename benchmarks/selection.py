#!/usr/bin/env python3
"""Selection benchmark (issue 5, item 4): the ranking table's choice against every candidate.

Over the corpus TEST split (never used for fitting; sampled per family with ``--max-masks``,
the first ceil(N / families) specs of each family in spec-id order, on the first ``--heads``
heads, as the profiler does), for each mask: every candidate (template x policy) of the
table that the backend ``sparse_attention`` would use can run is timed exactly as the profiler
times it (``tessera_jax.tools.profiler.time_candidate``: plan, power-of-two ABI capacities, the
kernel rule ``tessera_jax.tools.timing.KERNEL_RULE`` on GPU: CUPTI kernel time, L2 flushed,
median of ``--iters`` after ``--warmup``; host wall clock on CPU; every candidate of every mask
under one rule, checked, and rows of another rule are neither resumed nor reused);
``selection.select`` picks one
(no timing); regret = chosen time / best candidate time. The best fixed single plan is the
candidate with the least geometric-mean time over all benchmarked masks (chosen in hindsight,
on the test masks themselves: the strongest fixed baseline); gain = geomean(fixed / chosen).
``gain_vs_train_best_fixed_geomean`` compares with the table's own best fixed candidate (its
``default_order[0]``, chosen on the training masks).

Selection cost is measured on full Wan 720p masks (40 heads, no head subset): per-head test
masks of the corpus (one per family, ``--sel-masks``) and a random 64-token-block mask
[40, 1182, 1182]; per mask the median of ``--sel-repeats`` calls of ``select`` in three states:
``cold`` (every cache cleared: features, bounds tables, choices), ``new_mask`` (features and
choices cleared, block-bounds tables kept: a new mask of a known layout) and ``cached`` (the
same mask again). ``summary.selection_ms_wan720`` is the worst mask's cold median.

    python benchmarks/selection.py --table plan_tables/h200.json \\
        --out benchmarks/results/h200-selection.json --max-masks 120 --heads 4 --time-budget 500
    python benchmarks/selection.py --tiny --table /tmp/cpu.json --out /tmp/sel.json   # CPU
    python benchmarks/selection.py --cost-only --table plan_tables/h200.json   # cost only

``--cost-only`` times nothing on the device: it measures the selection cost alone (seconds,
any host) and prints it; it writes a file only when ``--out`` is given.

Results are saved after every mask; a rerun skips masks already complete (``--no-resume`` to
start over), so the benchmark can be spread over several shorter GPU runs.

``--reuse-times PREV``: every candidate is planned on the host (as the profiler does) and its
time is copied from PREV only when PREV's row recorded the same plan (``plan_digests``, the
profiler's ``plan_digest``), the same call heads and the same timing rule; rows of PREV without
plan digests (runs before them) are not reused at all: their plan cannot be told apart from a
changed one (bitmap steps) and they predate the one timing rule anyway. Each row records
``plan_digests`` and ``bitmap_steps`` per candidate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tessera_jax.select import features as F  # noqa: E402
from tessera_jax.tools import profiler as P  # noqa: E402
from tessera_jax.select import ranking as S  # noqa: E402
from tessera_jax.tools import timing  # noqa: E402

DEFAULT_OUT = "/tmp/h200-selection.json"      # the official file: benchmarks/results/
SEL_FAMILIES = ("vsa", "sparge", "xattn", "svg2", "jenga", "ssta", "moba", "sta")


def log(msg):
    print(f"[selection {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def geomean(x):
    x = np.asarray(x, np.float64)
    return float(np.exp(np.log(x).mean())) if x.size else float("nan")


# --- selection cost -------------------------------------------------------------------------
def _time_select(mask, shape, backend, table, repeats, state):
    """(median ms, min ms, choice) of ``select`` under the request (host wall clock) rule:
    cold / new_mask clear their caches before every call and drop the first; cached counts
    every call (the states before filled the caches)."""
    def clear():
        if state == "cold":
            F.clear_cache()
        else:
            F._CACHE.clear()
        S._CHOICES.clear()

    box = {}

    def call():
        box["choice"] = S.select(mask, shape, backend, table=table)

    cached = state == "cached"
    t = timing.time_request(call, rule=timing.wall_rule(repeats + cached, warmup=int(not cached)),
                            before=None if cached else clear)
    return t.ms, float(min(t.samples)), box["choice"]


def selection_cost(table, backend, *, tiny: bool, n_masks: int, repeats: int, dtype, head_dim):
    """Selection milliseconds on full Wan 720p masks (see the module docstring)."""
    from tessera_jax.mask import BlockMask
    masks = []
    rng = np.random.default_rng(0)
    L = 21 * 45 * 80
    masks.append(("random-64-blocks-10pct",
                  BlockMask.uniform(L, L, 64, 64, rng.integers(0, 256, (40, 1182, 1182),
                                                               dtype=np.uint8) < 26)))
    if not tiny and n_masks > 0:
        from tessera_jax.masks import build, corpus
        test = [s for s in corpus("test") if s["grid"] == "wan720" and s["heads"] == 40]
        for fam in SEL_FAMILIES:
            cand = sorted((s for s in test if s["family"] == fam), key=lambda s: s["id"])
            if cand and len(masks) < n_masks + 1:
                t0 = time.perf_counter()
                m = build(cand[0])
                log(f"selection-cost mask {fam} {cand[0]['id']} {m.shape} built in "
                    f"{time.perf_counter() - t0:.1f} s")
                masks.append((f"{fam}:{cand[0]['id']}", m))
    rows = []
    for name, m in masks:
        shape = P.call_shape(m, dtype, head_dim, 40)
        row = {"mask": name, "blocks": list(m.shape)}
        for state in ("cold", "new_mask", "cached"):
            med, mn, choice = _time_select(m, shape, backend, table, repeats, state)
            row[f"{state}_ms_median"] = round(med, 4)
            row[f"{state}_ms_min"] = round(mn, 4)
        row["choice"] = list(choice) if choice else None
        rows.append(row)
        log(f"select {name}: cold {row['cold_ms_median']:.3f} ms, new mask "
            f"{row['new_mask_ms_median']:.3f} ms, cached {row['cached_ms_median']:.4f} ms")
    return rows


# --- main -----------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", help="plan table (default: plan_tables/<gpu>.json)")
    ap.add_argument("--out", help=f"results file (default {DEFAULT_OUT}; with --cost-only: none)")
    ap.add_argument("--max-masks", type=int, help="sample at most ~N test masks (per family)")
    ap.add_argument("--heads", type=int, default=4, help="first K heads (0: all)")
    ap.add_argument("--families", nargs="+")
    ap.add_argument("--time-budget", type=float, help="stop timing after S seconds (resumable)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode (tiny masks, XLA)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head-dim", type=int, default=128)
    timing.add_rule_arguments(ap)
    ap.add_argument("--compilation-cache", help="jax persistent compilation cache directory")
    ap.add_argument("--sel-masks", type=int, default=4, help="corpus Wan 720p masks for the "
                    "selection cost (plus one random mask)")
    ap.add_argument("--sel-repeats", type=int, default=20)
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--reuse-times", metavar="JSON", help="an earlier selection result: the "
                    "times of candidates it measured on the same masks with the same plan "
                    "(plan digest) are copied (marked per row under 'reused'), only the other "
                    "candidates are timed; the choice is made again with --table")
    ap.add_argument("--cost-only", action="store_true", help="only the selection cost (Wan 720p "
                    "masks, no kernel timing); the backend is mosaic_gpu (xla with --tiny)")
    return ap.parse_args(argv)


def cost_only(a, table, table_path):
    """``--cost-only``: the selection-cost section and its summary figures, printed."""
    dev = P.device_info(None)
    backend = "xla" if a.tiny else "mosaic_gpu"
    sel = selection_cost(table, backend, tiny=a.tiny, n_masks=a.sel_masks,
                         repeats=a.sel_repeats, dtype=a.dtype, head_dim=a.head_dim)
    res = {"benchmark": "selection_cost",
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/selection.py " + " ".join(sys.argv[1:]),
           "device": dev, "versions": P.versions(), "backend": backend,
           "table": {"path": table_path, "gpu": table.gpu, "training_masks": len(table.points)},
           "selection_cost": sel,
           "summary": {"selection_ms_wan720": max(r["cold_ms_median"] for r in sel),
                       "selection_ms_wan720_new_mask_known_layout":
                           max(r["new_mask_ms_median"] for r in sel),
                       "selection_ms_wan720_cached": max(r["cached_ms_median"] for r in sel)}}
    print(json.dumps(res["summary"]))
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


def _same_rule(rows: dict, rule: str, what: str) -> dict:
    """The rows (by mask id) whose candidates were all timed under ``rule``."""
    keep = {i: r for i, r in rows.items() if r.get("rules") == [rule]}
    if len(keep) < len(rows):
        log(f"{len(rows) - len(keep)} earlier rows were timed under another rule than {rule}: "
            f"not {what}")
    return keep


def reusable(old: dict, key: str, call_heads: int, digest: str) -> bool:
    """Whether an earlier row's time of candidate ``key`` stands for this one: a time taken on
    the same plan (digest; rows without digests never) with the same call heads."""
    return (old.get("times_ms", {}).get(key) is not None and old.get("call_heads") == call_heads
            and old.get("plan_digests", {}).get(key) == digest)


def _load_prev(path, resume):
    if resume and os.path.isfile(path):
        try:
            with open(path) as f:
                prev = json.load(f)
            return {r["id"]: r for r in prev.get("masks", []) if r.get("complete")}
        except (OSError, ValueError):
            log(f"{path} is unreadable; starting over")
    return {}


def summarize(rows, cands, train_fixed=None):
    """Regret, best fixed plan and gain over the complete masks (``train_fixed``: the table's
    best fixed candidate on its training masks, a baseline chosen without the test masks)."""
    keys = [P.cand_key(*c) for c in cands]
    ok = [r for r in rows if r.get("complete") and r.get("chosen_ms")]
    if not ok:
        return {"masks": 0}
    T = np.array([[r["times_ms"].get(k) if r["times_ms"].get(k) is not None else np.nan
                   for k in keys] for r in ok], np.float64)
    viable = np.isfinite(T).all(axis=0)
    gm = np.full(len(keys), np.inf)
    gm[viable] = np.exp(np.log(T[:, viable]).mean(axis=0))
    fixed = int(np.argmin(gm)) if viable.any() else None
    chosen = np.array([r["chosen_ms"] for r in ok])
    best = np.array([r["best_ms"] for r in ok])
    regret = chosen / best
    out = {
        "masks": len(ok),
        "regret_median": float(np.median(regret)),
        "regret_p90": float(np.quantile(regret, 0.9)),
        "regret_max": float(regret.max()),
        "best_fixed": keys[fixed] if fixed is not None else None,
        "best_fixed_regret_median": (float(np.median(T[:, fixed] / best))
                                     if fixed is not None else None),
        "gain_vs_best_fixed_geomean": (geomean(T[:, fixed] / chosen)
                                       if fixed is not None else None),
    }
    if train_fixed is not None and train_fixed in keys and viable[keys.index(train_fixed)]:
        j = keys.index(train_fixed)
        out["train_best_fixed"] = train_fixed
        out["gain_vs_train_best_fixed_geomean"] = geomean(T[:, j] / chosen)
    heur = [r["heuristic_ms"] / r["best_ms"] for r in ok if r.get("heuristic_ms")]
    if heur:
        out["heuristic_regret_median"] = float(np.median(heur))
        out["heuristic_regret_p90"] = float(np.quantile(heur, 0.9))
    per_fam = {}
    for r, g in zip(ok, regret):
        per_fam.setdefault(r["family"], []).append(g)
    out["regret_median_by_family"] = {f: float(np.median(v)) for f, v in sorted(per_fam.items())}
    return out


def main(argv=None):
    a = parse_args(argv)
    import jax.numpy as jnp
    if a.compilation_cache:
        from tessera_jax import enable_compilation_cache
        enable_compilation_cache(a.compilation_cache)

    from tessera_jax.runtime import dispatch as backends
    dev = P.device_info(None)
    table_path = a.table or str(S.table_dir() / f"{dev['name']}.json")
    table = S.load_table(table_path)
    if a.cost_only:
        return cost_only(a, table, table_path)
    a.out = a.out or DEFAULT_OUT
    heads = a.heads or None
    specs, sampling = P.select_specs("test", tiny=a.tiny, families=a.families,
                                     max_masks=a.max_masks)
    sampling["heads"] = "all" if heads is None else f"first {heads} (shared masks stay shared)"
    rule = P.timing_rule(a.warmup, a.iters)
    prev = _same_rule(_load_prev(a.out, not a.no_resume), rule.name, "resumed")
    reuse = _same_rule(_load_prev(a.reuse_times, True) if a.reuse_times else {}, rule.name,
                       "reused")
    inputs = P.Inputs(jnp.dtype(a.dtype), a.head_dim)
    t_start = time.monotonic()
    rows = []
    cands_all = table.candidates
    train_fixed = P.cand_key(*cands_all[table.default_order[0]])
    backend = None
    stopped = False
    res = {}

    def save(summary_only=False):
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.out)

    res.update({
        "benchmark": "selection",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/selection.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv),
        "device": dev, "versions": P.versions(),
        "table": {"path": table_path, "gpu": table.gpu, "k": table.k,
                  "training_masks": len(table.points),
                  "provenance_created": table.data["provenance"].get("created"),
                  "corpus_digest": table.data["provenance"].get("corpus_digest")},
        "corpus_digest": P.corpus_digest(a.tiny), "split": "test", "sampling": sampling,
        "dtype": a.dtype, "head_dim": a.head_dim, "batch": 1,
        "timing": {"rule": rule.to_json(),
                   "padding": "ABI capacities rounded up to powers of two (as profiled)"},
        "masks": rows,
        "reused_times_from": a.reuse_times,
    })
    for n, spec in enumerate(specs):
        if spec["id"] in prev:
            rows.append(prev[spec["id"]])
            continue
        if a.time_budget is not None and time.monotonic() - t_start > a.time_budget:
            stopped = True
            break
        mask = P.build_mask(spec, heads)
        hq = P.call_heads(spec, heads)
        shape = P.call_shape(mask, a.dtype, a.head_dim, hq)
        backend = backends.resolve(None, shape)
        cands = [c for c in cands_all if S._supports(c[0], backend, shape)]
        res["backend"] = backend
        res["candidates"] = [P.cand_key(*c) for c in cands]
        F.clear_cache()
        S._CHOICES.clear()
        t0 = time.perf_counter()
        choice = S.select(mask, shape, backend, table=table)
        sel_ms = (time.perf_counter() - t0) * 1e3
        heur = S.heuristic(mask, shape, backend)
        row = {"id": spec["id"], "family": spec["family"], "grid": spec["grid"],
               "call_heads": hq, "blocks": list(mask.shape),
               "density": mask.density, "selection_ms": round(sel_ms, 4),
               "chosen": P.cand_key(*choice) if choice else None,
               "heuristic": P.cand_key(*heur) if heur else None,
               "features": {k: round(float(v), 5) for k, v in F.mask_features(mask, shape).items()},
               "times_ms": {}, "errors": {}}
        old = reuse.get(spec["id"], {})
        row["plan_digests"], row["bitmap_steps"] = {}, {}
        for template, policy in cands:
            k = P.cand_key(template, policy)
            try:
                planned = P.plan_candidate(mask, template, policy, inputs, hq)
                digest = row["plan_digests"][k] = P.plan_digest(planned[0])
                row["bitmap_steps"][k] = P.plan_summary(planned[0])["bitmap_steps"]
                if reusable(old, k, hq, digest):
                    row["times_ms"][k] = old["times_ms"][k]
                    row.setdefault("reused", []).append(k)
                    row.setdefault("timer", old.get("timer"))
                    row.setdefault("rules", list(old["rules"]))
                    continue
                r = P.time_candidate(mask, template, policy, inputs, warmup=a.warmup,
                                     iters=a.iters, num_heads=hq, planned=planned)
                row["times_ms"][k] = r["ms"]
                row.setdefault("timer", r["timer"])
                row.setdefault("rules", [])
                if r["rule"] not in row["rules"]:      # more than one: a fallback mid-row
                    row["rules"].append(r["rule"])
            except Exception as e:  # noqa: BLE001 - a failing candidate is data
                row["times_ms"][k] = None
                row["errors"][k] = f"{type(e).__name__}: {str(e)[:300]}"
        good = {k: v for k, v in row["times_ms"].items() if v is not None}
        if good:
            row["best"] = min(good, key=good.get)
            row["best_ms"] = good[row["best"]]
            row["chosen_ms"] = good.get(row["chosen"])
            row["heuristic_ms"] = good.get(row["heuristic"])
            row["regret"] = (row["chosen_ms"] / row["best_ms"]) if row["chosen_ms"] else None
        row["complete"] = True
        rows.append(row)
        log(f"[{n + 1}/{len(specs)}] {spec['family']:12s} {spec['id']} chosen {row['chosen']} "
            f"regret {row.get('regret') or float('nan'):.3f} (best {row.get('best')}; "
            f"{len(row.get('reused', []))} of {len(cands)} times reused)")
        res["summary"] = summarize(rows, cands, train_fixed)
        save()
    if stopped:
        log(f"time budget reached after {len(rows)} masks; rerun to continue")
    if backend is None:
        backend = "xla" if a.tiny else "mosaic_gpu"
    cands = [c for c in cands_all if P.cand_key(*c) in set(res.get("candidates", []))] or cands_all
    summary = summarize(rows, cands, train_fixed)
    sel = selection_cost(table, backend, tiny=a.tiny, n_masks=a.sel_masks,
                         repeats=a.sel_repeats, dtype=a.dtype, head_dim=a.head_dim)
    summary["selection_ms_wan720"] = max(r["cold_ms_median"] for r in sel)
    summary["selection_ms_wan720_new_mask_known_layout"] = max(r["new_mask_ms_median"]
                                                               for r in sel)
    summary["selection_ms_wan720_cached"] = max(r["cached_ms_median"] for r in sel)
    summary["complete"] = not stopped and len(rows) == len(specs)
    try:                 # every candidate of every mask under one rule (a resumed row included)
        summary["timing_rule"] = timing.assert_same_rule(
            (n for r in rows for n in r.get("rules", [])), "selection benchmark")
        mixed = None
    except timing.MixedRulesError as e:
        summary["timing_rule"], summary["timing_rule_error"] = None, str(e)
        mixed = e
    res["selection_cost"] = sel
    res["summary"] = summary
    save()
    if mixed is not None:                      # saved above; the run fails
        raise SystemExit(f"timing rule check failed: {mixed}")
    log("summary: " + json.dumps({k: v for k, v in summary.items()
                                  if k != "regret_median_by_family"}))
    return res


if __name__ == "__main__":
    main()
