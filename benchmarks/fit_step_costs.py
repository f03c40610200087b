"""Per-step-kind kernel costs fitted from the profiler's raw records (no GPU needed).

The raw files (``plan_tables/raw/<gpu>.jsonl``, ``tessera_jax.tools.profiler``) hold one
kernel time per (mask, template/policy) but only a summary of the plan timed (units, tiles,
partial tiles, bitmap steps on the newer records): not how many steps of each kind it ran.
This script rebuilds every timed plan on the host (``masks.build`` of the stored spec, then
``tessera_jax.plan`` with the record's template and policy, one planner thread), checks it is
the plan that was timed (``profiler.plan_digest`` where the record has one, else its units,
tiles and partial tiles), counts its steps by kind from ``Plan.tile_rects()``:

    full     plain step whose rectangle is the whole tile (no mask evaluated)
    plain    plain step with a smaller rectangle (masked by rows / keys bounds)
    grid     grid step (<= abi.GRID x abi.GRID cells)
    bitmap   bitmap step (a bit per entry)
    gfull    gathered step selecting its whole tile (GATHER_FULL_FLAG)
    gmask    gathered step with a mask (GATHER_FLAG)

and fits, per GPU and template (its policies pooled),

    kernel_us ~= a*full + b*plain + c*grid + d*bitmap + e*gfull + f*gmask + g*units + const

by non-negative least squares (Lawson-Hanson, NumPy), weighted by 1 / kernel_us (so it
minimises relative error: the records span 0.01-28 ms). Kinds a template never runs are left
out of its fit. Reported per (GPU, template): records, coefficients in ns a step, ratios to
the full step, R^2 (on kernel_us), median |relative error| in sample and
leave-one-family-out (each family predicted by the fit on the others), and a family
bootstrap's 10-90% range of the ratios (resamples holding that kind). Then, on the masks
timed with all three device-list templates (``DEVICE_PAIRS``), how often today's
``STEP_COST`` x computed area and the same with the fitted kind ratios pick the fastest
(``choice_check``; host plans standing in for device plans). Records whose template no
longer exists, failed records and plans that do not reproduce are skipped (counted).

    JAX_PLATFORMS=cpu python benchmarks/fit_step_costs.py \\
        [--gpus h100 h200] [--raw plan_tables/raw] [--counts /tmp/step_counts.json] \\
        [--min-units N] [--out fit.json]

``--counts`` caches the step counts (planning every record takes ~2-4 min on one core);
a second run with the same file only fits. ``--min-units`` keeps records whose plans have at
least N units (the linear model is a sum over steps; plans of fewer units than SMs are bound
by their longest unit instead).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("full", "plain", "grid", "bitmap", "gfull", "gmask")
COLS = KINDS + ("units", "const")


# --- records ----------------------------------------------------------------------------------
def step_counts(plan) -> dict:
    from pallas_kernels import abi
    r = plan.tile_rects()
    cb = r["cuts_b"]
    full = ((r["r0"] == r["q0"]) & (r["r1"] == r["q1"]) & (r["c0"] == r["k0"])
            & (r["c1"] == r["k1"]) & (cb == 0))
    out = {"full": int(full.sum()), "plain": int(((cb == 0) & ~full).sum()),
           "grid": int(r["grid"].sum()), "bitmap": int(r["bitmap"].sum()),
           "gfull": int((cb == abi.GATHER_FULL_FLAG).sum()),
           "gmask": int((cb == abi.GATHER_FLAG).sum()), "units": int(plan.num_units)}
    assert sum(out[k] for k in KINDS) == len(cb)
    return out


def count_all(gpus, raw_dir, cache_path):
    """{gpu: [row]}: one row per ok record with reproduced plan; and skip reasons."""
    from pallas_kernels import templates as _templates
    from tessera_jax.planning.config import PlannerConfig
    from tessera_jax.runtime.api import plan as make_plan
    from tessera_jax.runtime.options import Options
    from tessera_jax.tools import profiler as P

    cache = {}
    if cache_path and os.path.exists(cache_path):
        cache = json.load(open(cache_path))
    opts = Options(planner=PlannerConfig(threads=1, loops="vectorised"))
    known = {t.name for t in _templates.TEMPLATES}
    rows, skipped = {}, {}
    built = {}
    t_start = time.perf_counter()
    for gpu in gpus:
        masks, times = P.read_raw(pathlib.Path(raw_dir) / f"{gpu}.jsonl")
        rows[gpu], skip = [], collections.Counter()
        by_mask = collections.defaultdict(list)
        for (mid, _), r in sorted(times.items()):
            by_mask[mid].append(r)
        for mid, recs in by_mask.items():
            m = masks.get(mid)
            mask = None
            for r in recs:
                if r.get("status") != "ok" or r.get("ms") is None:
                    skip["not ok"] += 1
                    continue
                if r["template"] not in known:
                    skip[f"template gone: {r['template']}"] += 1
                    continue
                if m is None:
                    skip["no mask record"] += 1
                    continue
                key = f"{mid}/{r['candidate']}"
                c = cache.get(key)
                if c is None:
                    if mask is None:
                        mask = built.get(mid) or P.build_mask(m["spec"], m.get("heads"))
                        built.clear()
                        built[mid] = mask
                    H = m.get("call_heads") or mask.num_heads
                    p = make_plan(mask, (1, mask.Lq, H, m["head_dim"]),
                                  (1, mask.Lkv, H, m["head_dim"]), m["dtype"],
                                  template=r["template"], policy=r["policy"], options=opts)
                    s = P.plan_summary(p)
                    c = dict(step_counts(p), digest=P.plan_digest(p), tiles=s["tiles"],
                             partial_tiles=s["partial_tiles"], bitmap_steps=s["bitmap_steps"])
                    cache[key] = c
                rp = r.get("plan") or {}
                if r.get("plan_digest"):
                    same = r["plan_digest"] == c["digest"]
                else:
                    same = all(rp.get(k) == c[k2] for k, k2 in (
                        ("units", "units"), ("tiles", "tiles"), ("partial_tiles", "partial_tiles")))
                    if "bitmap_steps" in rp:
                        same &= rp["bitmap_steps"] == c["bitmap_steps"]
                if not same:
                    skip["plan differs from the timed one"] += 1
                    continue
                rows[gpu].append(dict(c, id=mid, family=m["family"], mask_grid=m["grid"],
                                      template=r["template"], policy=r["policy"],
                                      us=r["ms"] * 1e3))
        skipped[gpu] = dict(skip)
    if cache_path:
        json.dump(cache, open(cache_path, "w"))
    print(f"# counted in {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return rows, skipped


# --- fit --------------------------------------------------------------------------------------
def nnls(A, b, tol=1e-10, max_iter=500):
    """Lawson-Hanson: argmin ||A x - b|| subject to x >= 0."""
    m, n = A.shape
    x = np.zeros(n)
    P = np.zeros(n, bool)
    w = A.T @ (b - A @ x)
    for _ in range(max_iter):
        if P.all() or w[~P].max() <= tol * max(1.0, np.abs(w).max()):
            break
        j = np.flatnonzero(~P)[np.argmax(w[~P])]
        P[j] = True
        while True:
            z = np.zeros(n)
            z[P] = np.linalg.lstsq(A[:, P], b, rcond=None)[0]
            if (z[P] > 0).all():
                x = z
                break
            neg = P & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            P &= x > tol
            x[~P] = 0.0
        w = A.T @ (b - A @ x)
    return x


def design(rows, cols):
    X = np.array([[r[c] if c != "const" else 1.0 for c in cols] for r in rows], float)
    y = np.array([r["us"] for r in rows])
    return X, y


def fit(rows, cols):
    X, y = design(rows, cols)
    w = 1.0 / y
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)    # column scaling for conditioning
    x = nnls(X * w[:, None] / scale, y * w) / scale
    return x


def summarize(rows, n_boot=200, seed=0):
    used = [k for k in KINDS if any(r[k] for r in rows)]
    cols = used + ["units", "const"]
    coef = fit(rows, cols)
    X, y = design(rows, cols)
    pred = X @ coef
    r2 = 1.0 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    rel = np.abs(pred / y - 1.0)
    fams = sorted({r["family"] for r in rows})
    lofo, lofo_fam = [], {}
    for f in fams:
        tr = [r for r in rows if r["family"] != f]
        te = [r for r in rows if r["family"] == f]
        c = fit(tr, cols)
        Xt, yt = design(te, cols)
        e = np.abs(Xt @ c / yt - 1.0)
        lofo.extend(e)
        lofo_fam[f] = float(np.median(e))
    # The reference step: a gathering template's full gathered step, else the full plain step.
    ref = "gfull" if "gfull" in used else ("full" if "full" in used else None)
    boot = collections.defaultdict(list)
    rng = np.random.default_rng(seed)
    byf = {f: [r for r in rows if r["family"] == f] for f in fams}
    for _ in range(n_boot):
        pick = rng.choice(len(fams), len(fams))
        rs = [r for i in pick for r in byf[fams[i]]]
        c = dict(zip(cols, fit(rs, cols)))
        if ref and c[ref] > 0:
            for k in used:
                if any(r[k] for r in rs):      # only resamples that hold this kind
                    boot[k].append(c[k] / c[ref])
    cd = dict(zip(cols, coef))
    return {
        "records": len(rows), "families": len(fams), "cols": cols,
        "ns_per_step": {k: cd[k] * 1e3 for k in used},
        "ns_per_unit": cd["units"] * 1e3, "const_us": cd["const"],
        "ratio_to": ref,
        "ratio": {k: (cd[k] / cd[ref] if ref and cd[ref] > 0 else None) for k in used},
        "ratio_p10_p90": {k: [float(np.percentile(v, 10)), float(np.percentile(v, 90))]
                          for k, v in boot.items()},
        "steps": {k: int(sum(r[k] for r in rows)) for k in used},
        "r2": float(r2), "med_rel_err": float(np.median(rel)),
        "lofo_med_rel_err": float(np.median(lofo)) if lofo else None,
        "lofo_p90_rel_err": float(np.percentile(lofo, 90)) if lofo else None,
        "lofo_med_rel_err_by_family": lofo_fam,
        "kind_families": {k: sorted({r["family"] for r in rows if r[k]}) for k in used},
    }


#: The device list's templates with the policy whose host plan is closest to a device plan.
DEVICE_PAIRS = {"mgpu_q128_kv128_s2_hm": "merge", "mgpu_q128_kv64_s2_hm": "merge",
                "mgpu_q64x2_kv64_s2_hm": "pack"}


def choice_check(rows, fits, gpu):
    """On masks timed with all three device templates: how often the fastest is the one of
    least STEP_COST x computed area (today's price with the plan's real tiles), and of least
    STEP_COST x area x sum(steps x the template's fitted kind ratio to its full step)."""
    from tessera_jax.select.device import STEP_COST
    area = {}
    by = collections.defaultdict(dict)
    for r in rows:
        if DEVICE_PAIRS.get(r["template"]) == r["policy"]:
            by[r["id"]][r["template"]] = r
    masks = [m for m in by.values() if len(m) == len(DEVICE_PAIRS)]
    if not masks:
        return None
    from pallas_kernels import templates as _templates
    for t in _templates.TEMPLATES:
        area[t.name] = t.tile_q * t.tile_kv
    out = {}
    for name in ("step_cost", "per_kind"):
        agree, regret, misses = 0, [], []
        for m in masks:
            meas = {t: m[t]["us"] for t in DEVICE_PAIRS}
            price = {}
            for t in DEVICE_PAIRS:
                ra = fits[f"{gpu}/{t}"]["ratio"] if name == "per_kind" else {}
                price[t] = STEP_COST[t] * area[t] * sum(
                    m[t][k] * (ra.get(k) if ra.get(k) is not None else 1.0)
                    for k in ("full", "plain", "grid", "bitmap"))
            best, pick = min(meas, key=meas.get), min(price, key=price.get)
            agree += best == pick
            regret.append(meas[pick] / meas[best])
            if best != pick:
                misses.append(f"{m[best]['family']}: {pick} {meas[pick] / meas[best]:.3f}x")
        out[name] = {"masks": len(masks), "agree": agree, "regret_mean": float(np.mean(regret)),
                     "regret_max": float(np.max(regret)), "misses": misses}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", nargs="+", default=["h100", "h200"])
    ap.add_argument("--raw", default=str(ROOT / "plan_tables" / "raw"))
    ap.add_argument("--counts", default=None, help="JSON cache of the step counts")
    ap.add_argument("--min-units", type=int, default=0)
    ap.add_argument("--boot", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows, skipped = count_all(a.gpus, a.raw, a.counts)
    out = {"min_units": a.min_units, "skipped": skipped, "fits": {}}
    hdr = (f"{'gpu':5} {'template':36} {'n':>4} {'ref':>5} {'ref ns':>6} "
           + " ".join(f"{k:>6}" for k in KINDS)
           + f" {'unit ns':>7} {'c us':>5} {'R2':>6} {'med':>5} {'lofo':>5}"
           "  p10-p90 (family bootstrap): plain / grid / bitmap / gmask")
    print(hdr)
    for gpu in a.gpus:
        by_t = collections.defaultdict(list)
        for r in rows[gpu]:
            if r["units"] >= a.min_units:
                by_t[r["template"]].append(r)
        for t in sorted(by_t):
            s = summarize(by_t[t], a.boot)
            out["fits"][f"{gpu}/{t}"] = s
            ra, b = s["ratio"], s["ratio_p10_p90"]
            f = lambda k: f"{ra[k]:6.2f}" if ra.get(k) is not None else f"{'-':>6}"
            rng = lambda k: (f"{b[k][0]:.2f}-{b[k][1]:.2f}" if k in b else "-")
            print(f"{gpu:5} {t:36} {s['records']:4d} {s['ratio_to'] or '-':>5} "
                  f"{s['ns_per_step'].get(s['ratio_to'], 0):6.2f} "
                  + " ".join(f(k) for k in KINDS)
                  + f" {s['ns_per_unit']:7.1f} {s['const_us']:5.1f} {s['r2']:6.3f} "
                  f"{s['med_rel_err']:5.3f} {s['lofo_med_rel_err']:5.3f}  "
                  + " / ".join(rng(k) for k in ("plain", "grid", "bitmap", "gmask")))
    print("skipped:", json.dumps(skipped))
    out["choice"] = {}
    for gpu in a.gpus:
        c = choice_check([r for r in rows[gpu] if r["units"] >= a.min_units], out["fits"], gpu)
        out["choice"][gpu] = c
        for name, v in (c or {}).items():
            print(f"{gpu} device-template choice by {name}: {v['agree']}/{v['masks']} fastest, "
                  f"regret mean {v['regret_mean']:.4f} max {v['regret_max']:.3f}; "
                  f"misses {v['misses']}")
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)
    return out


if __name__ == "__main__":
    main()
