#!/usr/bin/env python3
"""Spike (issue 31): gathered K/V stages filled by cp.async from the producer's 128 threads.

A gathered stage today is tile_kv / 8 TMA copies of 8 keys issued from the producer's four
warps: 0.91 of cuDNN's rate per computed tile at q128_kv128 (one copy 0.98), and 0.37 with one
kv128 slot per ring on paired 64-row units (one copy 0.94), because every copy's issue and
arrival is exposed (benchmarks/NOTES.md#gathered-steps). With ``MosaicConfig.gather_copy =
"cp_async"`` each 8-key run is one 16-byte load per producer thread, and a stage one wait, one
proxy fence and one arrival. Rows: dense work (every step full, chunks at random rows) for
q128_kv128 and paired kv128 / kv64, TMA against cp.async; then the irregular masks at Wan 480p
(clusters, cubes, sliding) for the gather templates with both copies and the paired 64-row
gather units, every case checked against the float32 reference, cuDNN dense in the same run.

Predicted (per stage: 2 x 16 TMA issues + 32 arrivals against 32 loads per thread and one
arrival): q128 gathered dense work 0.91 -> >= 0.95; paired kv128 s1 gathered 0.37 -> >= 0.85
(then cubes' 64-row units, computed / selected 1.146, reach ~0.75). Kill: q128 cp.async below
0.94 on dense work and no mask above its TMA template by 5%.

    python3 benchmarks/spikes/cp_gather.py --out $OUT/h200-cp-gather-spike.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from gather_copies import reference  # noqa: E402
from paired_gather import dense_plan  # noqa: E402
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def spike_templates():
    """name -> Template: the cp.async twins of the gather templates and paired 64-row gather
    units (kv128 one slot per ring; kv64 two), registered for this process only."""
    from pallas_kernels import templates as T

    g, gs = T.get("mgpu_q128_kv128_s2_gather"), T.get("mgpu_q128_kv128_s2_gather_skip_nopp")
    pp = T.get("mgpu_q64x2pp_kv64_s2_hm")
    out = {}
    for base in (g, gs):
        for copy in ("tma", "cp_async"):
            name = base.name + ("_cp" if copy == "cp_async" else "")
            out[name] = dataclasses.replace(
                base, name=name, kernel=dataclasses.replace(base.kernel, gather_copy=copy))
    for kv, stages in ((128, 1), (64, 2)):
        for copy in ("tma", "cp_async"):
            name = f"spike_q64x2pp_kv{kv}_s{stages}_gather" + ("_cp" if copy == "cp_async"
                                                               else "")
            out[name] = dataclasses.replace(
                pp, name=name, tile_kv=kv, stages=stages, policy="gather",
                kernel=T.MosaicConfig(paired=True, pair_pingpong=True, gather=True,
                                      gather_copy=copy))
    for t in out.values():
        T._REGISTRY.setdefault(t.name, t)
    return out


def dense_rows(args, q, k, v, scale, dense_ms, interp, res):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import templates as T
    from pallas_kernels.mosaic import kernel as mk
    from tessera_jax.tools import timing

    L, H = q.shape[1], q.shape[2]
    t = spike_templates()
    rows = [("q128 one copy", T.get("mgpu_q128_kv128_s2_hm"), False)]
    for name in ("mgpu_q128_kv128_s2_gather", "mgpu_q128_kv128_s2_gather_cp",
                 "spike_q64x2pp_kv128_s1_gather", "spike_q64x2pp_kv128_s1_gather_cp",
                 "spike_q64x2pp_kv64_s2_gather", "spike_q64x2pp_kv64_s2_gather_cp"):
        rows.append((name + " random8", t.get(name) or T.get(name), True))
    rng = np.random.default_rng(1)
    for name, tpl, gathered in rows:
        if time.time() - T0 > args.budget_s:
            break
        row = dict(part="dense", variant=name)
        try:
            cfg = mk.KernelConfig.from_template(tpl, "none")
            units, steps, key_index = dense_plan(L, H, tpl.tile_q, tpl.tile_kv, gathered, rng,
                                                 "random" if gathered else False)
            fn = jax.jit(lambda q, k, v, u, s, cfg=cfg: mk.forward(
                q, k, v, u, s, cfg=cfg, scale=scale, interpret=interp)[0])
            du, ds = jnp.asarray(units), jnp.asarray(steps)
            out = fn(q, k, v, du, ds)
            got = jnp.moveaxis(out[0].reshape(H, L, -1)[jnp.array([0, H - 1])], 0, 1)
            ref = reference(q, k, v, jnp.asarray(key_index), [0, H - 1], scale)
            row["rel_err"] = float(jnp.linalg.norm(got.astype(jnp.float32) - ref)
                                   / jnp.linalg.norm(ref))
            row["ok"] = bool(row["rel_err"] < 2e-2)
            if dense_ms:
                row["ms"] = timing.time_kernel(fn, [(q, k, v, du, ds)]).ms
                row["rate"] = dense_ms / row["ms"]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        log(json.dumps(row))
        res["rows"].append(row)


def mask_rows(args, scale, interp, res):
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from gather import masks
    from tessera_jax.tools import timing

    spike_templates()
    L, H, cases = masks(args.small)
    D = 128 if not args.small else 64
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, L, H, D), jnp.float32).astype(jnp.bfloat16) for x in ks)
    gpu = jax.devices()[0].platform == "gpu"
    dense_ms = None
    if gpu:
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=D ** -0.5, implementation="cudnn"))
        dense_ms = res["mask_dense_ms"] = timing.time_kernel(dense, [(q, k, v)]).ms
    opts = tj.Options(interpret=True) if interp else None
    variants = [("mgpu_q128_kv128_s2_gather", "gather"), ("mgpu_q128_kv128_s2_gather_cp", "gather"),
                ("spike_q64x2pp_kv128_s1_gather_cp", "gather"),
                ("spike_q64x2pp_kv64_s2_gather_cp", "gather"),
                ("mgpu_q128_kv128_s2_gather_skip_nopp_cp", "gather"), (None, None)]
    for mname, make in cases:
        if mname not in args.masks.split(","):
            continue
        m = make()
        m0 = tj.BlockMask(m.q_bounds, m.kv_bounds, np.asarray(m.blocks)[:1])
        h0 = [x[:, :, :1].astype(jnp.float32) for x in (q, k, v)]
        ref = tj.reference_attention(*h0, m0, scale=D ** -0.5)
        for template, policy in variants:
            if time.time() - T0 > args.budget_s:
                log("budget reached")
                return
            row = dict(part="mask", mask=mname, variant=template or "default")
            try:
                p = tj.plan(m, q.shape, k.shape, q.dtype, template=template, policy=policy,
                            options=opts)
                s = p.stats()
                row.update(template=p.template, policy=p.policy,
                           computed_over_selected=s["computed_interactions"]
                           / s["selected_interactions"],
                           selected_fraction=s["selected_interactions"] / s["dense_interactions"])
                fn = jax.jit(lambda q, k, v, t=template, po=policy: tj.sparse_attention(
                    q, k, v, m, scale=D ** -0.5, template=t, policy=po, options=opts))
                out = fn(q, k, v)
                row["max_err"] = float(jnp.abs(out[:, :, :1].astype(jnp.float32) - ref).max()
                                       / max(float(jnp.abs(ref).max()), 1e-6))
                row["ok"] = bool(row["max_err"] < 3e-2)
                if dense_ms:
                    row["ms"] = timing.time_kernel(fn, [(q, k, v)]).ms
                    row["efficiency"] = row["selected_fraction"] * dense_ms / row["ms"]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            log(json.dumps(row))
            res["rows"].append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="CPU smoke: small masks, interpret")
    ap.add_argument("--masks", default="clusters,cubes,sliding")
    ap.add_argument("--parts", default="dense,mask")
    ap.add_argument("--budget-s", type=float, default=520)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from tessera_jax.tools import timing

    interp = False
    if args.small:
        from jax._src.pallas.mosaic_gpu.interpret import params as _p
        interp = _p.InterpretGPUParams()
        args.L, args.heads = 512, 2
    L, H, D = args.L, args.heads, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, L, H, D), jnp.float32).astype(jnp.bfloat16) for x in ks)
    scale = D ** -0.5
    gpu = jax.devices()[0].platform == "gpu"
    res = {"device": str(jax.devices()[0].device_kind), "L": L, "heads": H, "D": D,
           "rule": timing.KERNEL_RULE.to_json(), "jax": jax.__version__, "rows": []}
    dense_ms = None
    if gpu:
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, implementation="cudnn"))
        dense_ms = res["dense_ms"] = timing.time_kernel(dense, [(q, k, v)]).ms
        log(f"cuDNN dense {dense_ms:.3f} ms")
    try:
        if "dense" in args.parts:
            dense_rows(args, q, k, v, scale, dense_ms, interp, res)
        if "mask" in args.parts:
            mask_rows(args, scale, interp, res)
    finally:
        ok = [r for r in res["rows"] if r.get("ok")]
        res["summary"] = {
            "dense_rate": {r["variant"]: r.get("rate") for r in ok if r["part"] == "dense"},
            "mask_efficiency": {f"{r['mask']}/{r['variant']}": r.get("efficiency")
                                for r in ok if r["part"] == "mask"}}
        log(json.dumps(res["summary"]))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
