#!/usr/bin/env python3
"""Where per-head bounds lose time on the device route (issue 31's ``perhead_bounds_vs_shared``;
3.08 on the H100 in session 22; 1.19 in ``results/h100-gather.json``, session 30): per family
at Wan 480p (12 heads, D 128, bf16), the device route with static shared bounds and with traced
per-head bounds (every head the shared partition, the same blocks), each as the whole call and
as its planning alone (``planning.device.plan_on_device`` jitted, the route's own arguments),
and the plans' step counts. On CPU the same plans showed equal steps for ``aligned`` (81,512
visited, 80,857 full), so a gap there is planning or dispatch, not kernel work.

    python3 benchmarks/perhead_diag.py --out $OUT/perhead-diag.json
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="aligned,frame_aligned,cubes,sliding,clusters")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--perhead-templates", default="mgpu_q64x2_kv64_s2_hm",
                    help="templates also forced on the per-head bounds (comma list; '' none)")
    ap.add_argument("--prev-planner", help="another planning/device.py, timed as "
                    "variant perhead_prev (the route's template)")
    ap.add_argument("--plans-only", action="store_true", help="step counts, no calls")
    ap.add_argument("--nocond", action="store_true", help="also perhead_nocond: the per-head "
                    "plan and its kernels with no lax.cond on the plan's ok (the cond's cost)")
    ap.add_argument("--out")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    import gather
    import tessera_jax as tj
    from pallas_kernels import abi
    from tessera_jax.select import device as select_device
    from tessera_jax.runtime import device_route, dispatch
    from tessera_jax.tools import timing
    from tessera_jax.validation import check_shapes

    cur = device_route._device
    prev = None
    if args.prev_planner:
        import importlib.util
        spec = importlib.util.spec_from_file_location("device_prev", args.prev_planner)
        prev = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(prev)
    t0 = time.time()
    gpu = jax.default_backend() == "gpu"
    L, H, fams = gather.masks(args.small)
    D = 128 if not args.small else 64
    q, k, v, scale = gather.inputs(L, H, D)
    opts = tj.Options(interpret=True) if args.interpret else None
    res = {"benchmark": "perhead_diag", "device": str(jax.devices()[0].device_kind),
           "rule": timing.KERNEL_RULE.to_json(), "L": L, "heads": H, "rows": []}
    if gpu:
        res["dense_ms"] = gather.cudnn_ms(q, k, v, scale)
    want = args.families.split(",")
    for fam, make in fams:
        if fam not in want or time.time() - t0 > args.budget_s:
            continue
        m = make()
        qb, kb, b = (np.asarray(x) for x in (m.q_bounds, m.kv_bounds, m.blocks))
        sel = m.selected_interactions(H) / (L * L * H)
        if not args.plans_only:
            h0 = [x[:, :, :1].astype(jnp.float32) for x in (q, k, v)]
            ref = tj.reference_attention(*h0, tj.BlockMask(qb, kb, b[:1]), scale=scale)
        bh, qbh, kbh = gather.per_head(m, H)
        sh = check_shapes(q.shape, k.shape, q.dtype)
        backend = dispatch.resolve(None, sh)
        variants = [("shared", None), ("perhead", None)] + [
            ("perhead", n) for n in args.perhead_templates.split(",") if n]
        if prev is not None:
            variants.append(("perhead_prev", None))
        if args.nocond:
            variants.append(("perhead_nocond", None))
        for route, forced in variants:
            device_route._device = prev if route == "perhead_prev" else cur
            device_route._run.clear_cache()
            mask = (tj.BlockMask(qb, kb, jnp.asarray(b)) if route == "shared"
                    else tj.BlockMask(qbh, kbh, bh))
            consts = select_device.static_parts(mask)
            t, cap = device_route._choose(consts, mask, sh, backend,
                                          dispatch.get_template(forced) if forced else None)
            row = {"family": fam, "route": route, "forced": forced,
                   "template": t.name if t else None, "capacity": int(cap or 0)}
            try:
                if t is None:
                    raise ValueError("no template: the exact path")
                decide = device_route.decides(consts, tuple(mask.blocks.shape), sh, t, cap)
                dyn = [None if c is not None else x
                       for c, x in zip(consts, (mask.q_bounds, mask.kv_bounds, mask.blocks))]
                pargs = tuple(x for x in dyn if x is not None)

                # The route's first plan: with Options.bitmap_first_bytes of bitmap room where
                # its rule applies (the whole budget otherwise).
                first = device_route._first_room(t, cap, bh.shape, L, L, tj.Options()) \
                    if consts[0] is None or consts[1] is None else None
                cap1, budget1 = first or (cap, select_device.BITMAP_BUDGET_BYTES)
                row["first_capacity"] = int(cap1)

                def plan(*xs, consts=consts, t=t, cap=cap1, decide=decide, dyn=dyn,
                         budget=budget1):
                    it = iter(xs)
                    x = [next(it) if d is not None else c.array for d, c in zip(dyn, consts)]
                    ap = device_route.device_plans(q, k, *x, consts=consts, t=t, capacity=cap,
                                                   decide=decide, budget=budget)
                    return ap.fwd, ap.ok

                plan = jax.jit(plan)
                if route == "shared":
                    call = jax.jit(lambda q, k, v, bl: tj.sparse_attention(
                        q, k, v, tj.BlockMask(qb, kb, bl), scale=scale, options=opts))
                    cargs = (q, k, v, jnp.asarray(b))
                elif route == "perhead_nocond":
                    def call(q, k, v, bl, x, y, consts=consts, t=t, cap=cap1, budget=budget1):
                        ap = device_route.device_plans(q, k, x, y, bl, consts=consts, t=t,
                                                       capacity=cap, decide=True, budget=budget)
                        return dispatch.forward(ap.fwd_pass(True), t, q, k, v, scale, False,
                                                interpret=args.interpret)
                    call = jax.jit(call)
                    cargs = (q, k, v, bh, qbh, kbh)
                else:
                    call = jax.jit(lambda q, k, v, bl, x, y, f=forced: tj.sparse_attention(
                        q, k, v, tj.BlockMask(x, y, bl), scale=scale, template=f, options=opts))
                    cargs = (q, k, v, bh, qbh, kbh)
                p, ok = plan(*pargs)
                u, s = np.asarray(p.units), np.asarray(p.steps)
                cnt, ptr = u[:, abi.UNIT_STEP_CNT], u[:, abi.UNIT_STEP_PTR]
                idx = np.concatenate([np.arange(a, a + c) for a, c in zip(ptr, cnt)])
                cb = s[idx, abi.STEP_CUTS_B]
                full = (cb == 0) & (s[idx, abi.STEP_RECT] == abi.full_rect(t.tile_q, t.tile_kv))
                row.update(ok=None if ok is None else bool(ok), units=int(len(u)),
                           step_rows=int(len(s)), visited=int(len(idx)), full=int(full.sum()),
                           grid=int(((cb != 0) & (cb != abi.BITMAP_FLAG)).sum()),
                           bitmap=int((cb == abi.BITMAP_FLAG).sum()))
                row["step_bytes"] = int(s.nbytes)
                if not args.plans_only:
                    out = call(*cargs)
                    row["max_err"] = float(
                        jnp.abs(out[:, :, :1].astype(jnp.float32) - ref).max()
                        / max(float(jnp.abs(ref).max()), 1e-6))
                    row["checked"] = bool(row["max_err"] < 3e-2)
                if gpu and not args.plans_only:
                    row["call_ms"] = timing.time_kernel(call, [cargs]).ms
                    row["efficiency"] = sel * res["dense_ms"] / row["call_ms"]
                    row["plan_ms"] = timing.time_kernel(plan, [pargs]).ms
                    row["call_wall_ms"] = timing.time_kernel(
                        call, [cargs], rule=timing.wall_rule(10)).ms
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
    device_route._device = cur
    res["elapsed_s"] = time.time() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
