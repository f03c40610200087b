#!/usr/bin/env python3
"""Spike (issue 31): paired 64-row units with kv128 steps, K and V rings of different depths.

Two paired units with kv128 need 256 KB for two K/V slots per ring; with one slot per ring
(164 KB) the copies' latency is exposed on every step (dense work 0.936 of cuDNN with one
plain copy, 0.66 / 0.62 / 0.37 with 64- / 32- / 8-key gathered copies,
``h200-paired-gather-spike.json``). ``MosaicConfig.v_stages`` gives each ring two K slots and
one V slot (224 KB, with no reduction scratch): K is copied a step ahead, V has a step's QK
and softmax to arrive. Part 1: dense work (every step full, mode "none"), rates against
cuDNN. Part 2: Wan 480p clusters, cubes and sliding tiles (12 heads, D 128) with the runtime's
own plan against paired split-ring gather plans, every row checked on head 0.

Predicted: one copy ~0.95, 32-key copies >= 0.90, 8-key >= 0.85 of cuDNN; then cubes (gather32,
computed / selected 1.174) ~0.76, sliding (1.072) ~0.84, clusters (gather, 1.273) ~0.66.
Kill: 32-key copies below 0.85 of cuDNN on dense work, or no mask above the runtime's plan.

    python3 benchmarks/spikes/split_rings.py --out $OUT/h200-split-rings.json
    python3 benchmarks/spikes/split_rings.py --interpret --L 512 --heads 2 --small   # CPU
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
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def spike_templates():
    """name -> Template of the variants (registered so the runtime can be asked for them)."""
    from pallas_kernels import templates as T

    pp64 = T.get("mgpu_q64x2pp_kv64_s2_hm")

    def paired(pp=True, run=0, ks=2, vs=1):
        name = (f"spike_q64x2{'pp' if pp else ''}_kv128_k{ks}v{vs}"
                + (f"_g{run}" if run else ""))
        pol = {0: "pack", 8: "gather", 32: "gather32", 64: "gather64", 128: "gather"}[run]
        return dataclasses.replace(
            pp64, name=name, tile_kv=128, stages=ks, policy=pol,
            kernel=T.MosaicConfig(paired=True, pair_pingpong=pp, gather=bool(run),
                                  gather_run=run or 8, v_stages=vs if vs != ks else 0))

    out = {}
    for t in (paired(), paired(pp=False), paired(ks=1, vs=1),
              paired(run=128), paired(run=64), paired(run=32), paired(run=8),
              paired(pp=False, run=32), paired(pp=False, run=8)):
        out[t.name] = t
        T._REGISTRY[t.name] = t
    return out


def dense_variants(ts):
    """(row name, template, gathered steps)."""
    from pallas_kernels import templates as T

    rows = [("q128_kv128 one copy", T.get("mgpu_q128_kv128_s2_hm"), False),
            ("q64x2pp_kv64_s2 one copy", T.get("mgpu_q64x2pp_kv64_s2_hm"), False),
            ("q128_kv128 gather8", T.get("mgpu_q128_kv128_s2_gather"), True)]
    for name, t in ts.items():
        gathered = t.kernel.gather
        rows.append((name.replace("spike_", "") + (" contiguous" if gathered else " one copy"),
                     t, gathered))
    return rows


def part_dense(args, res, ts, q, k, v, interp):
    import jax
    import jax.numpy as jnp
    from paired_gather import dense_plan
    from gather_copies import reference
    from pallas_kernels.mosaic import kernel as mk
    from tessera_jax.tools import timing

    L, H, D = q.shape[1], q.shape[2], q.shape[3]
    scale = D ** -0.5
    rng = np.random.default_rng(1)
    for name, t, gathered in dense_variants(ts):
        if time.time() - T0 > args.dense_budget_s:
            log("dense budget reached")
            break
        row = dict(part="dense", variant=name, template=t.name)
        try:
            cfg = mk.KernelConfig.from_template(t, "none")
            row["smem_bytes"] = mk.smem_bytes(cfg, D)
            units, steps, key_index = dense_plan(L, H, t.tile_q, t.tile_kv, gathered, rng, False)
            fn = jax.jit(lambda q, k, v, u, s, cfg=cfg: mk.forward(
                q, k, v, u, s, cfg=cfg, scale=scale, interpret=interp)[0])
            du, ds = jnp.asarray(units), jnp.asarray(steps)
            out = fn(q, k, v, du, ds)
            got = out[0].reshape(H, L, D)[jnp.array([0, H - 1])]
            got = jnp.moveaxis(got, 0, 1).astype(jnp.float32)
            ref = reference(q, k, v, jnp.asarray(key_index), [0, H - 1], scale)
            row["rel_err"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            row["ok"] = bool(row["rel_err"] < 2e-2)
            if "dense_ms" in res:
                row["ms"] = timing.time_kernel(fn, [(q, k, v, du, ds)]).ms
                row["rate"] = res["dense_ms"] / row["ms"]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        log(json.dumps(row))
        res["rows"].append(row)


MASK_VARIANTS = {
    "clusters": [None, "spike_q64x2pp_kv128_k2v1_g8", "spike_q64x2_kv128_k2v1_g8",
                 "mgpu_q128_kv128_s2_gather"],
    "cubes": [None, "spike_q64x2pp_kv128_k2v1_g32", "spike_q64x2_kv128_k2v1_g32",
              "spike_q64x2pp_kv128_k2v1_g8"],
    "sliding": [None, "spike_q64x2pp_kv128_k2v1_g32", "spike_q64x2pp_kv128_k2v1_g64",
                "spike_q64x2pp_kv128_k2v1"],
}


def part_masks(args, res, ts):
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    import gather as G
    from tessera_jax.tools import timing

    L, H, cases = G.masks(args.small)
    D = 64 if args.small else 128
    opts = tj.Options(interpret=True) if args.interpret else None
    q, k, v, scale = G.inputs(L, H, D)
    gpu = jax.devices()[0].platform == "gpu"
    if gpu:
        res["dense_ms_480"] = G.cudnn_ms(q, k, v, scale, jax.jit)
        log(f"cuDNN dense Wan 480p {res['dense_ms_480']:.3f} ms")
    for name, make in cases:
        if name not in MASK_VARIANTS:
            continue
        m = make()
        m0 = tj.BlockMask(m.q_bounds, m.kv_bounds, np.asarray(m.blocks)[:1])
        h0 = [x[:, :, :1].astype(jnp.float32) for x in (q, k, v)]
        ref = tj.reference_attention(*h0, m0, scale=scale)
        for template in MASK_VARIANTS[name]:
            if time.time() - T0 > args.budget_s:
                log("budget reached")
                return
            policy = None if template is None else ts.get(template, None)
            policy = None if template is None else (policy.policy if policy is not None
                                                    else None)
            row = {"part": "masks", "mask": name, "variant": template or "default"}
            try:
                p = tj.plan(m, q.shape, k.shape, q.dtype, template=template, policy=policy,
                            options=opts)
                s = p.stats()
                row.update(template=p.template, policy=p.policy,
                           computed_over_selected=s["computed_interactions"]
                           / s["selected_interactions"],
                           selected_fraction=s["selected_interactions"] / s["dense_interactions"],
                           gather_steps=s["gather_steps"])
                fn = jax.jit(lambda q, k, v, t=template, po=policy: tj.sparse_attention(
                    q, k, v, m, scale=scale, template=t, policy=po, options=opts))
                out = fn(q, k, v)
                row["max_err"] = float(jnp.abs(out[:, :, :1].astype(jnp.float32) - ref).max()
                                       / max(float(jnp.abs(ref).max()), 1e-6))
                row["ok"] = bool(row["max_err"] < 3e-2)
                if gpu:
                    row["ms"] = timing.time_kernel(fn, [(q, k, v)]).ms
                    row["efficiency"] = (row["selected_fraction"] * res["dense_ms_480"]
                                         / row["ms"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            log(json.dumps(row))
            res["rows"].append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--no-masks", action="store_true")
    ap.add_argument("--small", action="store_true", help="small masks (CPU smoke run)")
    ap.add_argument("--dense-budget-s", type=float, default=250)
    ap.add_argument("--budget-s", type=float, default=540)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from tessera_jax.tools import timing

    interp = False
    if args.interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as _p
        interp = _p.InterpretGPUParams()
    ts = spike_templates()
    L, H, D = args.L, args.heads, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, L, H, D), jnp.float32).astype(jnp.bfloat16) for x in ks)
    res = {"device": str(jax.devices()[0].device_kind), "L": L, "heads": H, "D": D,
           "rule": timing.KERNEL_RULE.to_json(), "jax": jax.__version__, "rows": []}
    if jax.devices()[0].platform == "gpu":
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=D ** -0.5, implementation="cudnn"))
        res["dense_ms"] = timing.time_kernel(dense, [(q, k, v)]).ms
        log(f"cuDNN dense {res['dense_ms']:.3f} ms")

    def save():
        rates = {r["variant"]: r.get("rate") for r in res["rows"]
                 if r["part"] == "dense" and r.get("ok")}
        eff = {f"{r['mask']} {r['variant']}": r.get("efficiency") for r in res["rows"]
               if r["part"] == "masks" and r.get("ok")}
        res["summary"] = {"rates": rates, "efficiency": eff}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    part_dense(args, res, ts, q, k, v, interp)
    save()
    if not args.no_masks:
        part_masks(args, res, ts)
    save()
    log(json.dumps(res["summary"]))


if __name__ == "__main__":
    main()
