"""The VSA and SpargeAttn builders' stages at Wan 720p (issue 17's 5% builder budget): wall
time per jitted call of the block pooling of q and k (XLA's and the Triton kernel's), the pooled scores at each matmul
precision, the top-k (kernel and lax.top_k), and the whole builders, one JSON line each.
H200, session 13: pooling 1.59, scores 0.78 (HIGHEST) / 0.28 (HIGH), top-k 1.01 (kernel)
against 4.90 ms (lax.top_k) (s13/call5-stages.json@4ae09b7); VSA builder 3.35 ms
(h200-loop.json's builder_costs). Session 14 (benchmarks/results/h200-builder-stages.json): pooling 1.67 (XLA) / 0.63 (kernel),
scores 0.92 / 0.35 / 0.27 (HIGHEST / HIGH / DEFAULT).

    python benchmarks/builder_stages.py --out /tmp/stages.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_loop import _median, time_calls  # noqa: E402  (benchmarks/, the script's folder)
from tessera_jax.masks import dynamic as dm  # noqa: E402
from tessera_jax.masks.dynamic import common as dc  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--grid", default="21,45,80")
    ap.add_argument("--heads", type=int, default=40)
    args = ap.parse_args(argv)
    grid = tuple(int(x) for x in args.grid.split(","))
    H, D = args.heads, 128
    _, b = dm.cube_layout(grid)
    L, n = int(b[-1]), len(b) - 1
    kk = int(np.ceil(0.125 * n))
    keys = jax.random.split(jax.random.key(0), 4)
    qs = [jax.random.normal(kq, (1, L, H, D), jnp.bfloat16) for kq in keys[:2]]
    ks = [jax.random.normal(kq, (1, L, H, D), jnp.bfloat16) for kq in keys[2:]]
    pq = [dc.pool_mean(q, b) for q in qs]
    scores = [jnp.einsum("bihd,bjhd->hij", p, p, precision=dc.HI) for p in pq]
    rows = {}

    def rec(name, fn, arg_sets):
        f = jax.jit(fn)
        ts = time_calls(f, arg_sets, args.repeats)
        rows[name] = dict(ms=_median(ts) * 1e3, raw_ms=[t * 1e3 for t in ts])
        print(json.dumps({name: round(rows[name]["ms"], 4)}), flush=True)
        with open(args.out, "w") as fh:
            json.dump(dict(grid=list(grid), heads=H, L=L, blocks=n, topk=kk, stages=rows), fh,
                      indent=1)

    t0 = time.time()
    qk = list(zip(qs, ks))
    # XLA's pooling (the rules' pool="xla", the control: "auto" takes the kernel on a GPU).
    rec("pool_qk", lambda q, k: (dc.pool_mean(q, b, "xla"), dc.pool_mean(k, b, "xla")), qk)
    from pallas_kernels.triton import pool as tp
    interp = jax.default_backend() != "gpu"
    rec("pool_qk_kernel", lambda q, k: (tp.block_sums(q, b, interpret=interp),
                                        tp.block_sums(k, b, interpret=interp)), qk)
    for prec in ("HIGHEST", "HIGH", "DEFAULT"):
        p = getattr(jax.lax.Precision, prec)
        rec(f"scores_{prec.lower()}", lambda a, c, p=p: jnp.einsum(
            "bihd,bjhd->hij", a, c, precision=p), list(zip(pq, pq[::-1])))
    for mode in ("pallas", "xla"):
        def topk(s, mode=mode):
            if mode == "pallas":
                return dc.top_k_rows(s, kk, "pallas", None)
            return jax.lax.top_k(s, kk)[1]
        rec(f"topk_{mode}", topk, [(s,) for s in scores])
    vsa, sparge = dm.VSA(q_bounds=b, keep=0.125), dm.Sparge(topk=0.2, sim_threshold=-1.0)
    rec("vsa_mask", lambda q, k: dm.vsa_mask(q, k, vsa).blocks, qk)
    rec("sparge_topk", lambda q, k: dm.sparge_mask(q, k, sparge).blocks, qk)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
