#!/usr/bin/env python3
"""Where the dense family's host request loses to cuDNN's jitted call (issue 33's
``min_speedup_vs_best_alternative``: 0.87 ms against 0.36 on the H100, kernels equal): the
dispatch (time to return, not waiting) and the synchronised wall time of cuDNN's call made
four ways, on jax arrays and on arrays shared from torch by DLPack (as ``peers.py`` makes
them): the peers' jitted call, ``dense_route``'s ahead-of-time executable, the same function
through ``jax.jit``, and ``tj.sparse_attention`` (cached mask; a new mask with caches cleared,
as the peers' request). One process, interleaved rounds, wall clock, median.

    python3 benchmarks/dense_dispatch.py --out $OUT/dense-dispatch.json
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=int, default=200, metavar="N",
                    help="cProfile N calls of each of our ways (0: none); the top functions "
                         "by own time go into the JSON (``profile``)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    import peers
    import tessera_jax as tj
    from tessera_jax.masks import build
    from tessera_jax.runtime import dense_route

    spec = peers.sample_specs(1, families=["dense"], grids=["wan480"])[0][0]
    m = build(spec, heads=1)
    raw = (np.asarray(m.q_bounds), np.asarray(m.kv_bounds), np.asarray(m.blocks))
    H, D = args.heads, 128
    scale = D ** -0.5
    keys = jax.random.split(jax.random.key(0), 3)
    native = tuple(jax.random.normal(kk, (1, L, H, D), jnp.bfloat16)
                   for kk, L in zip(keys, (m.Lq, m.Lkv, m.Lkv)))
    inputs = {"jax": native}
    try:
        import torch
        t = tuple(torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16)
                  for L in (m.Lq, m.Lkv, m.Lkv))
        torch.cuda.synchronize()
        inputs["dlpack"] = tuple(jax.dlpack.from_dlpack(x) for x in t)
    except Exception as e:  # noqa: BLE001
        print("no torch inputs:", e)
    peers_jit = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                      implementation="cudnn"))
    ours_jit = dense_route._dense_fn()

    def ways(q, k, v):
        comp = dense_route._verdict(q, k, v, scale)
        if isinstance(comp, Exception):
            raise SystemExit(f"cuDNN refused the call: {comp}")
        return {
            "peers_jit": (lambda: peers_jit(q, k, v), None),
            "aot_compiled": (lambda: comp(q, k, v), None),
            "ours_jit": (lambda: ours_jit(q, k, v, scale=scale), None),
            "sparse_attention_cached": (lambda: tj.sparse_attention(q, k, v, m), None),
            "sparse_attention_request": (lambda: tj.sparse_attention(q, k, v,
                                                                     tj.BlockMask(*raw)),
                                         tj.clear_caches),
        }

    out = {"device": jax.devices()[0].device_kind, "spec": spec["id"], "rows": {}}
    for src, (q, k, v) in inputs.items():
        w = ways(q, k, v)
        for f, before in w.values():                     # compile, warm
            for _ in range(3):
                if before:
                    before()
                jax.block_until_ready(f())
        samples = {n: {"dispatch": [], "wall": []} for n in w}
        for _ in range(args.rounds):
            for n, (f, before) in w.items():
                for _ in range(args.n):
                    if before:
                        before()
                    t0 = time.perf_counter()
                    r = f()
                    t1 = time.perf_counter()
                    jax.block_until_ready(r)
                    t2 = time.perf_counter()
                    samples[n]["dispatch"].append((t1 - t0) * 1e3)
                    samples[n]["wall"].append((t2 - t0) * 1e3)
        out["rows"][src] = {n: {"dispatch_ms": float(np.median(s["dispatch"])),
                                "wall_ms": float(np.median(s["wall"])),
                                "wall_p10_ms": float(np.percentile(s["wall"], 10)),
                                "wall_p90_ms": float(np.percentile(s["wall"], 90))}
                            for n, s in samples.items()}
        print(src, json.dumps(out["rows"][src], indent=1), flush=True)
        if args.profile:
            out.setdefault("profile", {})[src] = _profiles(w, args.profile)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


def _profiles(ways: dict, n: int) -> dict:
    """Per way of ours, cProfile's top 25 functions by own time over ``n`` calls (the wait for
    the device outside the profile): where this host's Python goes."""
    import cProfile
    import io
    import pstats

    import jax
    res = {}
    for name, (f, before) in ways.items():
        if not name.startswith("sparse_attention"):
            continue
        pr = cProfile.Profile()
        for _ in range(n):
            if before:
                before()
            pr.enable()
            r = f()
            pr.disable()
            jax.block_until_ready(r)
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        res[name] = buf.getvalue()
    return res


if __name__ == "__main__":
    main()
