#!/usr/bin/env python3
"""Issue 31's acceptance file: what users get on irregular masks, host and device masks, against
cuDNN dense in the same run (``benchmarks/results/h200-gather.json``).

Per grid (Wan 480p: L 32,760; Wan 720p: L 75,600; 12 heads, D 128, bf16) and per family
(``gather.masks``: variable clusters, 64-token top-k cubes, sliding tiles over partial cubes,
radial frames (frame-aligned), random 128-blocks (aligned)), ``tj.sparse_attention`` with the
runtime's own choice of template and policy (nothing named), through

* ``host``: the mask static (host planning);
* ``device``: the blocks a traced argument of the jitted call, bounds static (device planning);
* ``perhead``: the same blocks with per-head bounds ``[Hm, n + 1]`` (every mask head the
  shared partition), traced too;
* ``perhead_all``: every query head its own mask head (blocks broadcast to ``[H, nq, nk]``,
  bounds ``[H, n + 1]``): what per-head masks of the families with one mask head (sliding,
  frames) cost, reported beside the key (``perhead_all_heads_vs_shared_max``);
* ``fwd_bwd`` (clusters, cubes, sliding): forward and the vjp of (q, k, v), host masks, against
  cuDNN's forward and backward.

Every call is checked against the float32 reference on head 0 (relative to the largest
reference entry; gradients too) and timed under ``tools.timing.KERNEL_RULE``. ``efficiency`` =
(selected interactions / time) / (dense interactions / cuDNN's time). Summary keys (minima /
maxima over the families, grids and routes named; each ratio divides two times of this run):
``efficiency_<family>_min`` (host and device), ``device_vs_host_max``,
``perhead_bounds_vs_shared_max`` (per-head bounds over the host's shared bounds),
``fwd_bwd_efficiency_irregular_min``. Both grids fit one 10-minute call (rows are saved as
they come); ``--merge`` combines the files of separate runs (each ratio stays within its run).

    python3 benchmarks/gather_acceptance.py --grids wan720,wan480 --out $OUT/h200-gather.json
    python3 benchmarks/gather_acceptance.py --merge a.json b.json --out h200-gather.json
    python3 benchmarks/gather_acceptance.py --small --interpret        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
T0 = time.time()

GRIDS = {"wan480": (21, 30, 52), "wan720": (21, 45, 80)}
FAMILIES = ("clusters", "cubes", "sliding", "frame_aligned", "aligned")
ROUTES = ("host", "device", "perhead", "perhead_all", "fwd_bwd")
IRREGULAR = ("clusters", "cubes", "sliding")
TOL = 3e-2


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


#: Query rows past which the check samples rows (a Wan 720p reference of every row holds a
#: [75,600]^2 float32 score matrix: 42.6 GiB, over what the H200 has free beside the run).
FULL_CHECK_MAX_ROWS = 40_000


def check_rows(L: int, n: int):
    """The query rows the check compares (sorted, fixed seed), or None for every row: ``n``
    rows where ``n`` > 0, 2,048 past ``FULL_CHECK_MAX_ROWS`` rows, else all."""
    if n <= 0 and L <= FULL_CHECK_MAX_ROWS:
        return None
    n = min(L, n if n > 0 else 2048)
    return np.sort(np.random.default_rng(0).choice(L, n, replace=False))


def rows_reference(qb, kb, blocks0, rows, scale):
    """The float32 reference of mask head 0 at query ``rows`` only: out [B, R, 1, D] of (q at
    those rows, k, v) of one head (``reference.masked_attention``, a [R, Lkv] selection)."""
    import jax.numpy as jnp
    from tessera_jax.reference import masked_attention

    qid = np.searchsorted(qb, rows, side="right") - 1
    kid = np.searchsorted(kb, np.arange(kb[-1]), side="right") - 1
    sel = jnp.asarray(np.asarray(blocks0)[qid][:, kid])[None, None]      # [1, 1, R, Lkv]
    return lambda q, k, v: masked_attention(q, k, v, sel, scale)[0]


def summarize(rows) -> dict:
    """The acceptance keys of one run's rows (ok rows only; ratios within the run)."""
    out: dict = {}
    ok = [r for r in rows if r.get("ok") and "ms" in r]
    for fam in FAMILIES:
        eff = [r["efficiency"] for r in ok if r["family"] == fam and r["route"] in ("host",
                                                                                    "device")]
        if eff:
            out[f"efficiency_{fam}_min"] = min(eff)
    ms = {(r["grid"], r["family"], r["route"]): r["ms"] for r in ok}
    for key, route in (("device_vs_host_max", "device"), ("perhead_bounds_vs_shared_max",
                                                           "perhead"),
                       ("perhead_all_heads_vs_shared_max", "perhead_all")):
        ratios = [ms[(g, f, route)] / ms[(g, f, "host")] for (g, f, r) in ms
                  if r == route and (g, f, "host") in ms]
        if ratios:
            out[key] = max(ratios)
    fb = [r["efficiency"] for r in ok if r["route"] == "fwd_bwd" and r["family"] in IRREGULAR]
    if fb:
        out["fwd_bwd_efficiency_irregular_min"] = min(fb)
    return out


def merge(paths, out_path):
    """One file of several runs' rows; summary keys are the extremes of each run's keys."""
    runs = [json.load(open(p)) for p in paths]
    summary: dict = {}
    for r in runs:
        for k, v in r["summary"].items():
            pick = max if k.endswith("_max") else min
            summary[k] = pick(summary[k], v) if k in summary else v
    res = {"runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs],
           "rows": sum((r["rows"] for r in runs), []), "summary": summary,
           "merged_from": [os.path.basename(p) for p in paths]}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    log(json.dumps(summary))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--grids", default="wan480", help=f"comma-separated subset of {list(GRIDS)}")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="L 1,024, 2 heads, D 64 (CPU)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--check-rows", type=int, default=0,
                    help="query rows the check samples (0: all up to "
                    f"{FULL_CHECK_MAX_ROWS:,} rows, else 2,048)")
    ap.add_argument("--bitmap-first-bytes", type=int, default=None,
                    help="Options.bitmap_first_bytes of every call (default: Options')")
    ap.add_argument("--merge", nargs="+", default=None, help="files of earlier runs to combine")
    args = ap.parse_args()
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        merge(args.merge, args.out)
        return
    for name, val, allowed in (("--grids", args.grids, GRIDS), ("--families", args.families,
                                                                FAMILIES),
                               ("--routes", args.routes, ROUTES)):
        bad = [x for x in val.split(",") if x not in allowed]
        if bad:
            ap.error(f"{name}: unknown {bad}, choose from {list(allowed)}")
    if args.heads < 1:
        ap.error("--heads must be positive")

    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.tools import timing
    import gather as G
    import kernels as K

    gpu = jax.devices()[0].platform == "gpu"
    kw = {} if args.bitmap_first_bytes is None else {"bitmap_first_bytes":
                                                     args.bitmap_first_bytes}
    opts = tj.Options(interpret=True, **kw) if args.interpret else (
        tj.Options(**kw) if kw else None)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "options": kw,
           "rule": timing.KERNEL_RULE.to_json(), "heads": args.heads, "rows": [], "dense": {}}
    routes = args.routes.split(",")
    for grid_name in args.grids.split(","):
        grid = GRIDS[grid_name]
        L, H, D = int(np.prod(grid)), args.heads, 128
        if args.small:
            grid, L, H, D = (2, 8, 64), 1024, 2, 64
        makers = {"clusters": lambda: G.mask_var_clusters(L, H),
                  "cubes": lambda: K.mask_cubes_topk(grid, H, 0.13, 2),
                  "sliding": lambda: K.mask_sta(grid),
                  "frame_aligned": lambda: K.mask_radial(grid),
                  "aligned": lambda: K.mask_rand128(L, H, 0.1, 1)}
        ks = jax.random.split(jax.random.key(0), 4)
        q, k, v = (jax.random.normal(x, (1, L, H, D), jnp.float32).astype(jnp.bfloat16)
                   for x in ks[:3])
        do = jax.random.normal(ks[3], q.shape, jnp.float32).astype(q.dtype)
        scale = D ** -0.5

        def vjp(attn):
            return lambda q, k, v, *extra: jax.vjp(lambda q, k, v: attn(q, k, v, *extra),
                                                   q, k, v)[1](do)

        dense_fn = lambda q, k, v: jax.nn.dot_product_attention(   # noqa: E731
            q, k, v, scale=scale, implementation="cudnn")
        if gpu:
            res["dense"][grid_name] = {
                "forward_ms": timing.time_kernel(jax.jit(dense_fn), [(q, k, v)]).ms,
                "fwd_bwd_ms": timing.time_kernel(jax.jit(vjp(dense_fn)), [(q, k, v)]).ms}
            log(grid_name, "cuDNN", res["dense"][grid_name])
        for fam in args.families.split(","):
            m = makers[fam]()
            qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
            blocks = np.asarray(m.blocks)
            sel = m.selected_interactions(H) / (L * L * H)
            rows = check_rows(L, args.check_rows)
            h0 = [x[:, :, :1].astype(jnp.float32) for x in (q, k, v)]
            if rows is None:
                m0 = tj.BlockMask(qb, kb, blocks[:1])
                ref_fn = lambda q, k, v: tj.reference_attention(q, k, v, m0,  # noqa: E731
                                                                scale=scale)
            else:
                ref_fn = rows_reference(qb, kb, blocks[0], rows, scale)
                h0[0] = h0[0][:, rows]
            ref_f = [ref_fn(*h0)]
            pick = (lambda g: g[:, :, :1]) if rows is None else (  # noqa: E731
                lambda g: g[:, rows, :1])
            ref_b = None
            for route in routes:
                if time.time() - T0 > args.budget_s:
                    log("budget reached")
                    break
                if route == "fwd_bwd" and fam not in IRREGULAR or (
                        route == "perhead_all" and blocks.shape[0] == H):   # = perhead
                    continue
                row = {"grid": grid_name, "family": fam, "route": route, "L": L, "heads": H,
                       "selected_fraction": sel}
                try:
                    if route in ("host", "fwd_bwd"):
                        p = tj.plan(m, q.shape, k.shape, q.dtype, options=opts)
                        row.update(template=p.template, policy=p.policy,
                                   chosen_by=p.chosen_by)
                        attn = lambda q, k, v: tj.sparse_attention(   # noqa: E731
                            q, k, v, m, scale=scale, options=opts)
                        call = (q, k, v)
                    else:
                        from tessera_jax.runtime import device_route, dispatch
                        from tessera_jax.validation import check_shapes
                        # perhead: the same blocks, bounds [Hm, n + 1]; perhead_all: every
                        # query head its own mask head (blocks broadcast to [H, nq, nk]).
                        Hb = H if route == "perhead_all" else blocks.shape[0]
                        b = jnp.asarray(np.broadcast_to(blocks, (Hb,) + blocks.shape[1:])
                                        if route.startswith("perhead") else blocks)
                        if route.startswith("perhead"):
                            qbh = jnp.asarray(np.broadcast_to(qb, (Hb, len(qb))).copy())
                            kbh = jnp.asarray(np.broadcast_to(kb, (Hb, len(kb))).copy())
                        # The device route's static choice of template.
                        sh = check_shapes(q.shape, k.shape, q.dtype)
                        ch = device_route.choose(
                            tj.BlockMask(qb, kb, b) if route == "device" else
                            tj.BlockMask(qbh, kbh, b), sh, dispatch.resolve(None, sh), None,
                            opts or tj.Options())
                        row["template"] = ch.name if ch is not None else None
                        if route.startswith("perhead"):
                            attn = lambda q, k, v, b, qbh, kbh: tj.sparse_attention(  # noqa
                                q, k, v, tj.BlockMask(qbh, kbh, b), scale=scale, options=opts)
                            call = (q, k, v, b, qbh, kbh)
                        else:
                            attn = lambda q, k, v, b: tj.sparse_attention(   # noqa: E731
                                q, k, v, tj.BlockMask(qb, kb, b), scale=scale, options=opts)
                            call = (q, k, v, b)
                    if route == "fwd_bwd":
                        if ref_b is None:
                            d0 = pick(do).astype(jnp.float32)
                            ref_b = jax.vjp(ref_fn, *h0)[1](d0)
                            if rows is not None:     # dk, dv need every row: dq rows only
                                ref_b = ref_b[:1]
                        fn, ref = jax.jit(vjp(attn)), ref_b
                    else:
                        fn, ref = jax.jit(attn), ref_f
                    out = fn(*call)
                    got = out if route == "fwd_bwd" else [out]
                    row["max_err"] = max(
                        float(jnp.abs(pick(g).astype(jnp.float32) - r).max()
                              / max(float(jnp.abs(r).max()), 1e-6)) for g, r in zip(got, ref))
                    row["ok"] = bool(row["max_err"] < TOL)
                    if rows is not None:
                        row["checked"] = (f"head 0, {len(rows)} sampled query rows"
                                          + (" (out; dq of fwd_bwd)" if route == "fwd_bwd"
                                             else ""))
                    if gpu:
                        row["ms"] = timing.time_kernel(fn, [call]).ms
                        d = res["dense"][grid_name]["fwd_bwd_ms" if route == "fwd_bwd"
                                                    else "forward_ms"]
                        row["efficiency"] = sel * d / row["ms"]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                log(json.dumps(row))
                res["rows"].append(row)
                save(res, args.out)              # a run cut by its timeout keeps its rows
    save(res, args.out)
    log(json.dumps(res["summary"]))


def save(res: dict, path: str | None) -> None:
    """Writes ``res`` with the summary of its rows so far to ``path`` (if any)."""
    res["summary"] = summarize(res["rows"])
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
