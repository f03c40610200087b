#!/usr/bin/env python3
"""Which template the device route should run on irregular masks, and what its gather planning
costs (issue 31: ``device_vs_host_max``, ``perhead_bounds_vs_shared_max``), in one process.

Wan 480p (L 32,760, 12 heads, D 128, bf16), variable clusters, 64-token top-k cubes and
sliding tiles (``gather.masks``). Per mask, against cuDNN dense in the same run (efficiency =
selected interactions / time over cuDNN's dense rate), every call checked against the float32
reference on head 0:

* ``host``: the static mask, the runtime's choice (host planning);
* ``device_<t>`` / ``perhead_<t>``: the blocks a traced argument of one jitted call (device
  planning + kernel), bounds static and shared, or per head ``[H, n + 1]`` and traced, with
  template ``t``: ``rule`` (the device route's static rule, ``select.device``), ``plain``
  (``mgpu_q128_kv128_s2_hm``: ``planning.device.plan_on_device``), ``gather`` and
  ``gather_skip_nopp`` (``planning.device_gather``);
* ``plan_<impl>_<bounds>``: the device gather planning alone (jitted, 128 x 128 tiles; with
  ``--plan-720`` also family ``svg2_720``: Wan 720p, 40 heads, ~300 x 1000 clusters), for
  this tree's ``planning.device_gather`` (``main``) and, with ``--alt-planner FILE``, another
  implementation of it loaded from FILE (``alt``; e.g. branch dg-blockrank's: this file with
  ``benchmarks/pending/dg-blockrank.diff`` applied), same masks and capacities; their plans
  are compared (identical).

    python3 benchmarks/device_gather_check.py --out $OUT/h200-device-gather-check.json \\
        --alt-planner /tmp/alt/tessera_jax/planning/device_gather.py   # h200_session.sh builds it
    python3 benchmarks/device_gather_check.py --small --interpret      # CPU smoke run

Decisions it feeds (``benchmarks/NOTES.md#gathered-steps``): the device rule's template for
traced / per-head bounds and for irregular static bounds (gather if it beats plain by > 10%
on a family), and the dg-blockrank branch (kept if its planning is >= 1.3x faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
T0 = time.time()
TOL = 3e-2
TEMPLATES = {"rule": None, "plain": "mgpu_q128_kv128_s2_hm",
             "gather": "mgpu_q128_kv128_s2_gather",
             "gather_skip_nopp": "mgpu_q128_kv128_s2_gather_skip_nopp"}


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def load_planner(path: str):
    """A device_gather implementation from a file (its own module, imports as the tree's)."""
    spec = importlib.util.spec_from_file_location("device_gather_alt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def summarize(rows: list[dict]) -> dict:
    """Per family: each route's efficiency, the best device / per-head template, planning
    times and the alt / main planning ratio (all from this run)."""
    out: dict = {}
    ok = [r for r in rows if r.get("ok") and "ms" in r]
    for fam in sorted({r["family"] for r in ok}):
        f = {r["route"]: r for r in ok if r["family"] == fam}
        s = {k: round(v["efficiency"], 4) for k, v in f.items() if "efficiency" in v}
        for kind in ("device", "perhead"):
            t = {k[len(kind) + 1:]: v for k, v in f.items()
                 if k.startswith(kind + "_") and "efficiency" in v}
            if t:
                s[f"best_{kind}"] = min(t, key=lambda k: t[k]["ms"])
                if "host" in f:
                    s[f"{kind}_best_vs_host"] = round(t[s[f"best_{kind}"]]["ms"]
                                                      / f["host"]["ms"], 4)
        for b in ("static", "perhead"):
            m, a = f.get(f"plan_main_{b}"), f.get(f"plan_alt_{b}")
            if m:
                s[f"plan_main_{b}_ms"] = round(m["ms"], 4)
            if m and a:
                s[f"plan_alt_over_main_{b}"] = round(a["ms"] / m["ms"], 4)
        out[fam] = s
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--families", default="clusters,cubes,sliding")
    ap.add_argument("--templates", default=",".join(TEMPLATES))
    ap.add_argument("--alt-planner", default=None, help="a device_gather.py to time beside")
    ap.add_argument("--small", action="store_true", help="L 1,024, 2 heads, D 64 (CPU)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--plan-720", action="store_true",
                    help="also time the planning alone at Wan 720p, 40 heads (SVG2's clusters)")
    args = ap.parse_args()
    bad = [t for t in args.templates.split(",") if t not in TEMPLATES]
    if bad:
        ap.error(f"--templates: unknown {bad}, choose from {list(TEMPLATES)}")

    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.planning import device_gather as dg_main
    from tessera_jax.tools import timing, profiler
    import gather as G

    planners = {"main": dg_main}
    if args.alt_planner:
        planners["alt"] = load_planner(args.alt_planner)
    gpu = jax.devices()[0].platform == "gpu"
    opts = tj.Options(interpret=True) if args.interpret else None
    L, H, fams = G.masks(args.small)
    L0, H0 = L, H
    D = 64 if args.small else 128
    res = {"benchmark": "device_gather_check", "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "commit": profiler.code_revision(os.path.dirname(HERE)),
           "rule": timing.KERNEL_RULE.to_json(), "L": L, "heads": H, "head_dim": D,
           "alt_planner": args.alt_planner, "rows": []}
    q, k, v, scale = G.inputs(L, H, D)
    if gpu:
        res["dense_ms"] = G.cudnn_ms(q, k, v, scale)
        log("cuDNN", res["dense_ms"])

    def save():
        res["summary"] = summarize(res["rows"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    want = args.families.split(",")
    if args.plan_720 and not args.small:
        # Planning alone at the SVG2 loop's size (Wan 720p, 40 heads, 300 x 1000 clusters).
        fams = [("svg2_720", lambda: G.mask_var_clusters(
            75600, 40, q_mean=252, kv_mean=76, density=0.25, seed=5))] + list(fams)
        want.append("svg2_720")
    for fam, make in fams:
        if fam not in want:
            continue
        L, H = (75600, 40) if fam == "svg2_720" else (L0, H0)
        m = make()
        qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
        blocks = np.asarray(m.blocks)
        bh = np.broadcast_to(blocks, (H,) + blocks.shape[1:])
        qbh, kbh = (jnp.asarray(np.broadcast_to(x, (H, len(x))).copy()) for x in (qb, kb))
        sel = m.selected_interactions(H) / (L * L * H)
        if fam != "svg2_720":
            m0 = tj.BlockMask(qb, kb, blocks[:1])
            h0 = [x[:, :, :1].astype(jnp.float32) for x in (q, k, v)]
            ref = tj.reference_attention(*h0, m0, scale=scale)

        def _rule(mask):
            from tessera_jax.runtime import device_route, dispatch
            from tessera_jax.validation import check_shapes
            sh = check_shapes(q.shape, k.shape, q.dtype)
            t = device_route.choose(mask, sh, dispatch.resolve(None, sh), None)
            return "rule: " + (t.name if t is not None else "exact path")

        def row_of(route, fn, call, **extra):
            row = {"family": fam, "route": route, "L": L, "heads": H, "selected_fraction": sel,
                   **extra}
            try:
                out = fn(*call)
                if route.startswith("plan_"):
                    row["ok"] = bool(out[1])
                    row["plan"] = out[0]
                else:
                    row["max_err"] = float(jnp.abs(out[:, :, :1].astype(jnp.float32) - ref).max()
                                           / max(float(jnp.abs(ref).max()), 1e-6))
                    row["ok"] = bool(row["max_err"] < TOL)
                if gpu:
                    row["ms"] = timing.time_kernel(fn, [call]).ms
                    if not route.startswith("plan_"):
                        row["efficiency"] = sel * res["dense_ms"] / row["ms"]
                elif route.startswith("plan_"):
                    row["ms"] = timing.time_kernel(fn, [call]).ms
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            return row

        # Planning alone, each implementation, static and per-head bounds.
        plans = {}
        for impl, dg in planners.items():
            for bname in ("static", "perhead"):
                if time.time() - T0 > args.budget_s:
                    break
                kw = dict(q_len=L, kv_len=L, tile_q=128, tile_kv=128)
                if bname == "static":
                    cap = dg.step_bound(qb, kb, **kw)[1] * blocks.shape[0]
                    fn = jax.jit(lambda b, dg=dg, cap=cap, kw=kw: dg.plan_gather_on_device(
                        b, qb, kb, num_q_heads=H, capacity=cap, **kw))
                    call = (jnp.asarray(blocks),)
                else:
                    cap = dg.step_bound(qbh, kbh, **kw)[1] * H
                    fn = jax.jit(lambda b, x, y, dg=dg, cap=cap, kw=kw: dg.plan_gather_on_device(
                        b, x, y, num_q_heads=H, capacity=cap, **kw))
                    call = (jnp.asarray(bh), qbh, kbh)
                row = row_of(f"plan_{impl}_{bname}", fn, call, capacity=int(cap))
                p = row.pop("plan", None)
                if p is not None:
                    plans[(impl, bname)] = (np.asarray(p.units), np.asarray(p.steps))
                    main_p = plans.get(("main", bname))
                    if impl != "main" and main_p is not None:
                        row["identical_to_main"] = bool(
                            np.array_equal(main_p[0], plans[(impl, bname)][0])
                            and np.array_equal(main_p[1], plans[(impl, bname)][1]))
                log(json.dumps(row))
                res["rows"].append(row)
                save()
        plans.clear()
        if fam == "svg2_720":
            continue                   # planning only at this size
        # Attention through each route.
        routes = [("host", None)] + [(f"{r}_{t}", TEMPLATES[t]) for r in ("perhead", "device")
                                     for t in args.templates.split(",")]
        for route, tname in routes:
            if time.time() - T0 > args.budget_s:
                log("budget reached")
                break
            if route == "host":
                p = tj.plan(m, q.shape, k.shape, q.dtype, options=opts)
                extra = {"template": p.template, "policy": p.policy}
                fn = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, m, scale=scale,
                                                                 options=opts))
                call = (q, k, v)
            elif route.startswith("perhead"):
                extra = {"template": tname or _rule(tj.BlockMask(qbh, kbh, jnp.asarray(bh)))}
                fn = jax.jit(lambda q, k, v, b, x, y, t=tname: tj.sparse_attention(
                    q, k, v, tj.BlockMask(x, y, b), scale=scale, template=t, options=opts))
                call = (q, k, v, jnp.asarray(bh), qbh, kbh)
            else:
                extra = {"template": tname or _rule(tj.BlockMask(qb, kb, jnp.asarray(blocks)))}
                fn = jax.jit(lambda q, k, v, b, t=tname: tj.sparse_attention(
                    q, k, v, tj.BlockMask(qb, kb, b), scale=scale, template=t, options=opts))
                call = (q, k, v, jnp.asarray(blocks))
            row = row_of(route, fn, call, **extra)
            log(json.dumps(row))
            res["rows"].append(row)
            save()
    save()
    res["elapsed_s"] = time.time() - T0
    save()
    log(json.dumps(res["summary"]))


if __name__ == "__main__":
    main()
