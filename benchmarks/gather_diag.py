#!/usr/bin/env python3
"""Which gathering kernel crashes on the GPU: each case (template, pass, L, dk/dv gathering)
in its own process with faulthandler, forward or forward + backward of gpu_check's masks
(variable bounds, per-head blocks, an empty query block, GQA 4/2, D 128) against the
float32 reference. One JSON line per case.

    python3 benchmarks/gather_diag.py --out $OUT/gather-diag.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(template: str, mode: str, L: int, dkv_gather: bool, D: int) -> dict:
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tessera_jax as tj
    from tessera_jax.tools import gpu_check
    from tessera_jax.tools.gpu_check import _mask_parts, _rel
    from tessera_jax.runtime import host_plans
    if dkv_gather:      # the gathered dk/dv candidate chosen whenever offered
        score = host_plans.dkv_score
        host_plans.dkv_score = lambda p, per_sm, o: (-1.0 if p.policy.startswith("gather")
                                                     else score(p, per_sm, o))
    else:
        from pallas_kernels.mosaic import ops
        ops.DKV_GATHER_POLICY = None
    rng = np.random.default_rng(L)
    qb, blocks = _mask_parts(rng, L, 4, "host")
    host = tj.BlockMask(qb, qb, blocks)
    ks = jax.random.split(jax.random.key(L), 4)
    q = jax.random.normal(ks[0], (1, L, 4, D), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, L, 2, D), jnp.bfloat16) for x in ks[1:3])
    do = jax.random.normal(ks[3], (1, L, 4, D), jnp.bfloat16)
    rec = {}
    if mode == "fwd":
        out = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, host, template=template))(
            q, k, v)
        out.block_until_ready()
        rec["ran"] = True
        ref = tj.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), host)
        rec["rel_out"] = _rel(out, ref)
        rec["ok"] = rec["rel_out"] < gpu_check.OUT_TOL
        return rec
    f = jax.jit(lambda q, k, v: jax.vjp(
        lambda q, k, v: tj.sparse_attention(q, k, v, host, template=template), q, k, v)[1](do))
    grads = f(q, k, v)
    jax.block_until_ready(grads)
    rec["ran"] = True
    _, rvjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, host),
                      *(x.astype(jnp.float32) for x in (q, k, v)))
    rg = rvjp(do.astype(jnp.float32))
    rec["rel_grads"] = [_rel(g, r) for g, r in zip(grads, rg)]
    rec["ok"] = max(rec["rel_grads"]) < gpu_check.GRAD_TOL
    return rec


CASES = [
    ("mgpu_q128_kv128_s2_gather", "bwd", 1024, False),
    ("mgpu_q128_kv128_s2_gather", "bwd", 1024, True),
    ("mgpu_q128_kv128_s2_gather", "bwd", 1003, True),
    ("mgpu_q128_kv128_s2_gather", "bwd", 1003, False),
    ("triton_q128_kv128_w8_s3_gather", "bwd", 1024, True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=100)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--D", type=int, default=128)
    args = ap.parse_args()
    if args.child:
        t, mode, L, g = json.loads(args.child)
        print("RESULT " + json.dumps(child(t, mode, L, g, args.D)), flush=True)
        return
    t0 = time.time()
    with open(args.out, "w") as f:
        for t, mode, L, g in CASES:
            if time.time() - t0 > args.budget_s:
                break
            s = time.time()
            try:
                p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--D",
                                    str(args.D), "--child", json.dumps([t, mode, L, g])],
                                   capture_output=True, text=True, timeout=args.timeout)
                rc, out, err = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                rc, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
            res = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
            rec = dict(template=t, mode=mode, L=L, dkv_gather=g, rc=rc, s=round(time.time() - s, 1),
                       **(json.loads(res[0]) if res else {}))
            if not res:
                lines = [ln for ln in err.splitlines() if ln.strip()]
                rec["err_head"] = lines[:6]
                rec["err_tail"] = lines[-25:]
            print(json.dumps(rec)[:600], flush=True)
            f.write(json.dumps(rec) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
