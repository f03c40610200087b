#!/usr/bin/env python3
"""Spike (issue 33, ``MosaicConfig.step_pairs``): the device route's forward and forward +
backward on q128 x kv64 plans, two steps a stage against one, in one process.

Per mask (the corpus' first spec of a family at a grid, ``--masks family:grid:heads``), the
device route (static bounds, traced blocks: the peers' gpu rows) named on each template of
``--templates``: forward (plan + kernel) and the jitted vjp (forward, dq, dk/dv), both under
``timing.KERNEL_RULE``; out, dq, dk and dv compared with the first template's (q128 x kv64,
checked against the reference on the GPU by ``make test-gpu``). Kill criterion
(benchmarks/NOTES.md#kernel-steps): the forward with step pairs not <= 0.97x q128 x kv64 on
the SpargeAttn masks.

    python3 benchmarks/spikes/step_pairs.py --out $OUT/step-pairs.json
    python3 benchmarks/spikes/step_pairs.py --smoke          # CPU: a small mask, interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
T0 = time.time()
TEMPLATES = ("mgpu_q128_kv64_s2_hm", "mgpu_q128_kv64x2_s2_hm", "mgpu_q128_kv128_s2_hm")


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def masks(args):
    """(name, BlockMask, heads) of each ``--masks`` entry; ``--smoke``: one small mask of
    SpargeAttn's shape (128-row query blocks, 64-key blocks, ragged ends)."""
    import tessera_jax as tj
    if args.smoke:
        rng = np.random.default_rng(0)
        qb, kb = np.r_[np.arange(0, 328, 128), 328], np.r_[np.arange(0, 300, 64), 300]
        blocks = rng.random((2, len(qb) - 1, len(kb) - 1)) < 0.5
        return [("smoke", tj.BlockMask(qb, kb, blocks), 2)]
    from tessera_jax.masks import corpus
    out = []
    for entry in args.masks.split(","):
        family, grid, heads = entry.split(":")
        spec = next(s for s in corpus.test_specs()
                    if s["family"] == family and s["grid"] == grid)
        out.append((f"{family}-{grid}", corpus.build(spec, heads=int(heads)), int(heads)))
    return out


def rel(a, b) -> float:
    a, b = (np.asarray(x, np.float32) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def run_mask(name, mask, H, args) -> dict:
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.runtime import device_route, dispatch
    from tessera_jax.tools import timing
    from tessera_jax.validation import check_qkv
    D = 64 if args.smoke else 128
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, mask.Lq, H, D), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, mask.Lkv, H, D), jnp.bfloat16) for x in ks[1:3])
    do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    blocks = jax.device_put(np.asarray(mask.blocks))
    shape = check_qkv(q, k, v)
    opts = tj.Options(interpret=True if args.smoke else None)
    res, first = {"blocks": list(mask.shape), "heads": H}, None
    for name_t in args.templates.split(","):
        t = dispatch.get_template(name_t)

        def fwd(q, k, v, b, t=t):
            return device_route.attention(q, k, v, tj.BlockMask(qb, kb, b), shape, t.backend, t,
                                          D ** -0.5, False, opts)

        def fwd_bwd(q, k, v, b, do, fwd=fwd):
            out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, b), q, k, v)
            return (out, *vjp(do))

        r = {}
        try:
            f, g = jax.jit(fwd), jax.jit(fwd_bwd)
            got = jax.device_get(g(q, k, v, blocks, do))
            if first is None:
                first = got
            r["rel_vs_first"] = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"),
                                                                 got, first)}
            if not args.smoke:
                r.update(timing.time_kernel(f, ((q, k, v, blocks),)).to_json("fwd_"))
                r.update(timing.time_kernel(g, ((q, k, v, blocks, do),)).to_json("fwd_bwd_"))
            r["status"] = "ok" if max(r["rel_vs_first"].values()) < 2e-2 else "mismatch"
        except Exception as e:  # noqa: BLE001
            r = {"status": "failed", "why": f"{type(e).__name__}: {str(e)[-300:]}"}
        log(name, name_t, r.get("status"), r.get("fwd_ms"), r.get("fwd_bwd_ms"))
        res[name_t] = r
    base, pairs = res.get(TEMPLATES[0], {}), res.get(TEMPLATES[1], {})
    for key in ("fwd_ms", "fwd_bwd_ms"):
        if base.get(key) and pairs.get(key):
            res[f"pairs_over_kv64_{key[:-3]}"] = pairs[key] / base[key]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--masks", default="sparge:wan480:12,natten:wan480:12,sparge:hy720:16")
    ap.add_argument("--templates", default=",".join(TEMPLATES))
    ap.add_argument("--smoke", action="store_true", help="CPU: a small mask, interpreted")
    ap.add_argument("--budget-s", type=float, default=540.0)
    args = ap.parse_args()
    import jax
    out = {"spike": "step_pairs", "jax": jax.__version__,
           "devices": [str(d) for d in jax.devices()], "rule": "timing.KERNEL_RULE",
           "masks": {}}
    for name, mask, H in masks(args):
        if time.time() - T0 > args.budget_s:
            out["cut"] = f"budget {args.budget_s} s reached before {name}"
            break
        out["masks"][name] = run_mask(name, mask, H, args)
        if args.out:                                   # partial results survive a cut call
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    sparge = [m.get("pairs_over_kv64_fwd") for n, m in out["masks"].items()
              if n.startswith("sparge")]
    if sparge and all(x is not None for x in sparge):
        out["kill"] = {"criterion": "pairs_over_kv64_fwd <= 0.97 on every sparge mask",
                       "killed": any(x > 0.97 for x in sparge), "ratios": sparge}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({n: {k: v for k, v in m.items() if k.startswith("pairs_")}
                      for n, m in out["masks"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
