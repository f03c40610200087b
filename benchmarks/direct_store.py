#!/usr/bin/env python3
"""In-place row stores against unit-major tiles and their gather (``Options.store_in_place``)
at Wan 480p, per corpus family: the host route's forward, the device route's forward (shared
static bounds, traced blocks) and, on the irregular families, the host route's forward +
backward, each timed with the option on and off in alternating rounds (one process, the
kernel rule), outputs compared bit for bit, and cuDNN dense in the same run.

    python3 benchmarks/direct_store.py --out $OUT/direct-store.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main():
    import gather

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gather.grid_arguments(ap)
    ap.add_argument("--backward", default="clusters,cubes,sliding")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    import tessera_jax as tj
    from pallas_kernels import abi
    from tessera_jax.tools import timing

    g = gather.grid(args, "direct_store", rounds=args.rounds)
    L, H, res = g.L, g.H, g.res
    gpu = jax.default_backend() == "gpu"
    q, k, v, scale = gather.inputs(L, H, g.D)
    do = jax.random.normal(jax.random.key(5), q.shape, q.dtype)
    if gpu:
        res["dense_ms"] = gather.cudnn_ms(q, k, v, scale)

    def opts(in_place):
        return tj.Options(store_in_place=in_place, interpret=True if args.interpret else None)

    for fam, make in tqdm(g.families, desc="families"):
        if not g.within_budget(args.budget_s):
            break
        m = make()
        qb, kb, b = (np.asarray(x) for x in (m.q_bounds, m.kv_bounds, m.blocks))
        hp = tj.plan(m, q.shape, k.shape, q.dtype)
        u = hp.units[:hp.num_units]
        row = {"family": fam, "template": hp.template, "policy": hp.policy,
               "rows_owned": bool(hp.rows_owned),
               "partial_groups": abi.partial_groups(u[:, abi.UNIT_Q_START],
                                                    u[:, abi.UNIT_OWN_LO],
                                                    u[:, abi.UNIT_OWN_HI], hp.tile_q, L)}
        cases = {}
        for ip in (True, False):
            o = opts(ip)
            cases[("host", ip)] = (jax.jit(lambda q, k, v, o=o: tj.sparse_attention(
                q, k, v, m, scale=scale, options=o)), (q, k, v))
            cases[("device", ip)] = (jax.jit(lambda q, k, v, bl, o=o: tj.sparse_attention(
                q, k, v, tj.BlockMask(qb, kb, bl), scale=scale, options=o)),
                (q, k, v, jnp.asarray(b)))
            if fam in args.backward.split(","):
                def fb(q, k, v, o=o):
                    out, vjp = jax.vjp(lambda q, k, v: tj.sparse_attention(
                        q, k, v, m, scale=scale, options=o), q, k, v)
                    return (out,) + vjp(do)
                cases[("fwd_bwd", ip)] = (jax.jit(fb), (q, k, v))
        try:
            for route in ("host", "device", "fwd_bwd"):
                if (route, True) not in cases:
                    continue
                a, b_ = (jax.block_until_ready(cases[(route, ip)][0](*cases[(route, ip)][1]))
                         for ip in (True, False))
                row[f"{route}_equal"] = all(bool(jnp.array_equal(x, y)) for x, y in
                                            zip(jax.tree.leaves(a), jax.tree.leaves(b_)))
                if not gpu:
                    continue
                times = {True: [], False: []}
                for _ in range(args.rounds):
                    for ip in (True, False):
                        f, xs = cases[(route, ip)]
                        times[ip].append(timing.time_kernel(f, [xs]).ms)
                row[f"{route}_in_place_ms"] = statistics.median(times[True])
                row[f"{route}_gathered_ms"] = statistics.median(times[False])
                row[f"{route}_rounds_ms"] = [times[True], times[False]]
                row[f"{route}_in_place_vs_gathered"] = (row[f"{route}_in_place_ms"]
                                                        / row[f"{route}_gathered_ms"])
            if gpu:
                sel = m.selected_interactions(H) / (L * L * H)
                for route in ("host", "device"):
                    row[f"efficiency_{route}"] = (sel * res["dense_ms"]
                                                  / row[f"{route}_in_place_ms"])
        except Exception as e:  # noqa: BLE001 - a row records what failed
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    res["elapsed_s"] = time.time() - g.t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
