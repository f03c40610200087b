#!/usr/bin/env python3
"""The cost of ``tj.Options(check_finite=True)`` (issue 32): sparse calls with it off and on.

Wan 480p (B 1, L 32,760, 12 heads, D 128, bf16). Cases: sliding tiles (the fastest forward
here, so the largest relative cost), 64-token top-k cubes and variable clusters on the host
route and the cubes as a device mask (device route), forward; the cubes forward + backward.
Each case is timed off and on, alternated for ``--rounds`` rounds under
``tools.timing.KERNEL_RULE``; ``summary`` holds on / off per case (median over rounds).
Checks: on finite inputs the two give identical outputs (gradients too); per forward case,
with one NaN in v at a key that some rows select, ``on`` makes exactly the rows that select
it NaN (counted from the block mask), ``off`` may make more.

    python3 benchmarks/check_finite_cost.py --out $OUT/h200-check-finite.json
    python3 benchmarks/check_finite_cost.py --small     # CPU smoke run (L 1,024, XLA backend)
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
T0 = time.time()
#: Bandwidth of the prediction (the H200's ~4.8 TB/s peak, ~3.3 TB/s in practice).
PREDICT_BYTES_PER_S = 3.3e12


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def problem(small: bool):
    """(L, H, D, masks by name)."""
    import gather
    import kernels as K
    if small:
        L, H, D, grid = 1024, 2, 64, (2, 8, 64)
    else:
        L, H, D, grid = 32760, 12, 128, (21, 30, 52)
    return L, H, D, {"sliding": K.mask_sta(grid), "cubes": K.mask_cubes_topk(grid, H, 0.13, 2),
                     "clusters": gather.mask_var_clusters(L, H)}


def cases(masks, scale):
    """(name, mask, fn(options) -> the jitted call, its extra arguments, forward?)."""
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj

    def host(m):
        return lambda o: jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, m, scale=scale,
                                                                     options=o))

    def device(m):
        return lambda o: jax.jit(lambda q, k, v, b: tj.sparse_attention(
            q, k, v, tj.BlockMask(m.q_bounds, m.kv_bounds, b), scale=scale, options=o))

    def fwd_bwd(m):
        def make(o):
            f = lambda q, k, v: tj.sparse_attention(q, k, v, m, scale=scale, options=o)  # noqa
            return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
        return make

    cubes, sliding = masks["cubes"], masks["sliding"]
    return [("sliding_fwd", sliding, host(sliding), (), True),
            ("cubes_fwd", cubes, host(cubes), (), True),
            ("cubes_fwd_bwd", cubes, fwd_bwd(cubes), ("do",), False),
            ("cubes_device_fwd", cubes, device(cubes), (jnp.asarray(cubes.blocks),), True),
            ("clusters_fwd", masks["clusters"], host(masks["clusters"]), (), True)]


def nan_key(m, H: int) -> tuple[int, int]:
    """(the first key of a key block that about half the query blocks of head 0 select, the
    (row, head) pairs that select it over H heads, counted from the block mask)."""
    blocks = np.broadcast_to(np.asarray(m.blocks), (H,) + tuple(m.blocks.shape[1:]))
    j = int(np.argmin(np.abs(blocks[0].mean(0) - 0.5)))
    return int(m.kv_bounds[j]), int((blocks[:, :, j] * np.diff(m.q_bounds)).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=100,
                    help="start no new case past this many seconds")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.tools import timing

    L, H, D, masks = problem(args.small)
    scale = D ** -0.5
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (1, L, H, D), jnp.float32).astype(jnp.bfloat16)
                   for x in ks)
    per = q.size * q.dtype.itemsize
    moved = 8 * per           # q, k, v read and written, out read and written
    res = {"device": str(jax.devices()[0].device_kind), "L": L, "heads": H, "D": D,
           "jax": jax.__version__, "rule": timing.KERNEL_RULE.to_json(),
           "predicted": {"bytes": moved, "ms": 1e3 * moved / PREDICT_BYTES_PER_S,
                         "bytes_per_s": PREDICT_BYTES_PER_S}, "rows": []}
    log(json.dumps(res["predicted"]))
    opts = {"off": tj.Options(), "on": tj.Options(check_finite=True)}
    for name, m, make, extra, forward in cases(masks, scale):
        if time.time() - T0 > args.budget_s:
            log("budget reached")
            break
        row = {"case": name}
        try:
            fns = {key: make(o) for key, o in opts.items()}
            extra = tuple(do if x == "do" else x for x in extra)
            outs = {key: jax.block_until_ready(f(q, k, v, *extra)) for key, f in fns.items()}
            pairs = list(zip(jax.tree.leaves(outs["off"]), jax.tree.leaves(outs["on"])))
            row["identical"] = all(bool(jnp.array_equal(a, b)) for a, b in pairs)
            row["max_abs_diff"] = max(float(jnp.abs(a.astype(jnp.float32)
                                                    - b.astype(jnp.float32)).max())
                                      for a, b in pairs)
            if forward:
                j, row["nan_rows_expected"] = nan_key(m, H)
                bad_v = v.at[:, j].set(jnp.nan)
                row["nan_key"] = j
                for key, f in fns.items():
                    o = f(q, k, bad_v, *extra)
                    row[f"nan_rows_{key}"] = int(jnp.isnan(o).any(-1).sum())
                row["exact_on"] = row["nan_rows_on"] == row["nan_rows_expected"]
            ratios = []
            for r in range(args.rounds):
                t = {key: timing.time_kernel(f, [(q, k, v) + extra]) for key, f in fns.items()}
                row.update({f"ms_{key}_{r}": x.ms for key, x in t.items()})
                row["timer"] = t["on"].rule.timer
                ratios.append(t["on"].ms / t["off"].ms)
            row["ratio"] = statistics.median(ratios)
        except Exception as e:  # noqa: BLE001  (one case's failure is recorded, the rest run)
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(json.dumps(row))
        res["rows"].append(row)
    res["summary"] = {f"ratio_{r['case']}": r["ratio"] for r in res["rows"] if "ratio" in r}
    res["summary"]["all_checks"] = all(r.get("identical") and r.get("exact_on", True)
                                       for r in res["rows"])
    log(json.dumps(res["summary"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
