#!/usr/bin/env python3
"""The device route's all-selected test (``dense_route.on_device``: one ``lax.cond`` on the
traced blocks, cuDNN when every block is selected) against the same route without it, on the
peers' masks at Wan 480p (12 heads, D 128, bf16; bounds static NumPy, blocks a traced
argument, as ``peers.py --mask-source gpu`` runs them), alternating rounds under the kernel
rule in one process. Outputs: with the test, bit for bit the route without it on a sparse
mask, and within bf16 of it on the all-selected one.

    python3 benchmarks/dense_cond_ab.py --rounds 3 --out $OUT/dense-cond-ab.json

Kill criterion (written before the first measurement): the test costs > 1% on a sparse mask.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="dense,moba,svg2")
    ap.add_argument("--grid", default="wan480")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    import peers
    import tessera_jax as tj
    from tessera_jax.masks import build
    from tessera_jax.runtime import dense_route, device_route, dispatch
    from tessera_jax.tools import timing
    from tessera_jax.validation import check_shapes

    rule = timing.KERNEL_RULE
    out = {"device": jax.devices()[0].device_kind, "rule": str(rule), "rows": {}}
    for fam in tqdm(args.families.split(","), desc="families"):
        spec = peers.sample_specs(1, families=[fam], grids=[args.grid])[0][0]
        m = build(spec, heads=args.heads)
        qb, kb, b = (np.asarray(x) for x in (m.q_bounds, m.kv_bounds, m.blocks))
        H, D = args.heads, 128
        key = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(kk, (1, L, H, D), jnp.bfloat16)
                   for kk, L in zip(key, (m.Lq, m.Lkv, m.Lkv)))
        scale = D ** -0.5
        shape = check_shapes(q.shape, k.shape, q.dtype)
        backend = dispatch.resolve(None, shape)
        impl = dense_route.on_device(q, k, v, shape, backend, False, scale)

        def route(dense):
            return jax.jit(lambda q, k, v, blocks: device_route.attention(
                q, k, v, tj.BlockMask(qb, kb, blocks), shape, backend, None, scale, False,
                dense=dense))

        fns = {"planned": route(None), "with_test": route(impl)}
        user = jax.jit(lambda q, k, v, blocks: tj.sparse_attention(
            q, k, v, tj.BlockMask(qb, kb, blocks), scale=scale))
        bj = jnp.asarray(b)
        outs = {n: np.asarray(f(q, k, v, bj), np.float32) for n, f in fns.items()}
        outs["sparse_attention"] = np.asarray(user(q, k, v, bj), np.float32)
        row = {"family": fam, "spec": spec["id"], "density": float(m.density), "impl": impl,
               "backend": backend, "all_selected": bool(b.all()),
               "max_diff_with_test": float(np.abs(outs["with_test"] - outs["planned"]).max()),
               "max_diff_sparse_attention": float(np.abs(outs["sparse_attention"]
                                                         - outs["with_test"]).max()),
               "samples": {n: [] for n in fns}}
        for _ in range(args.rounds):
            for n, f in fns.items():
                row["samples"][n].append(timing.time_kernel(f, [(q, k, v, bj)], rule=rule).ms)
        for n in fns:
            row[f"{n}_ms"] = float(np.median(row["samples"][n]))
        row["with_test_over_planned"] = row["with_test_ms"] / row["planned_ms"]
        out["rows"][fam] = row
        print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
    sparse = [r["with_test_over_planned"] for r in out["rows"].values() if not r["all_selected"]]
    out["summary"] = {"max_sparse_with_test_over_planned": max(sparse) if sparse else None,
                      "sparse_bit_exact": all(r["max_diff_with_test"] == 0.0
                                              for r in out["rows"].values()
                                              if not r["all_selected"]),
                      "kill_criterion": "max_sparse_with_test_over_planned > 1.01"}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["summary"]))


if __name__ == "__main__":
    main()
