"""Request latency of tessera_jax on a few corpus masks, with and without a planner switch.

A/B of a host-side change on the request path (a new mask: selection + planning + the copy of
the plan to the device + the call), alternating the two settings in one process so that both
see the same machine. Today's switch: ``PlannerConfig.share_step_lists`` (units of a tall row
group share one copy of their step rows). Output: per mask and setting, median wall-clock ms of the
request and of its parts, the plan's bytes, and the output checked against the other setting.

    python benchmarks/request_path.py --masks dense:hy720 ssta:hy720 svg2:hy720 --heads 8 \
        --out results/request-path.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _med(xs):
    return float(np.median(xs))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", nargs="+", default=["dense:hy720", "ssta:hy720", "svg2:hy720"],
                    help="FAMILY:GRID of the corpus test split (its first mask there)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two settings")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    from tqdm import tqdm

    import tessera_jax as tj
    from request_cases import bf16_inputs, first_test_mask, forget_request_caches
    from tessera_jax.planning import PlannerConfig, planner
    from tessera_jax.masks import corpus

    specs = corpus("test")
    planner.warm_up()
    res = {"device": str(jax.devices()[0]), "switch": "PlannerConfig.share_step_lists", "rows": []}

    def clear():
        forget_request_caches(selection=False)

    for item in tqdm(a.masks, desc="masks"):
        fam, grid = item.split(":")
        spec, m = first_test_mask(item, a.heads, specs)
        q, k, v = bf16_inputs(m, a.heads)
        opts = {flag: tj.Options(planner=PlannerConfig(share_step_lists=flag))
                for flag in (False, True)}
        row = {"id": spec["id"], "family": fam, "grid": grid, "density": m.density, "by": {}}
        outs = {}
        for _ in range(a.rounds):
            for flag in (False, True):
                call = lambda: tj.sparse_attention(q, k, v, m, options=opts[flag])  # noqa: E731
                clear()
                outs[flag] = np.asarray(jax.block_until_ready(call()), np.float32)  # compiles
                rec = row["by"].setdefault(str(flag), {"request_ms": [], "plan_ms": [],
                                                       "put_ms": [], "cached_call_ms": []})
                for _ in range(a.iters):
                    clear()
                    t0 = time.perf_counter()
                    jax.block_until_ready(call())
                    rec["request_ms"].append((time.perf_counter() - t0) * 1e3)
                    clear()
                    t0 = time.perf_counter()
                    p = tj.plan(m, q.shape, k.shape, q.dtype, options=opts[flag])
                    rec["plan_ms"].append((time.perf_counter() - t0) * 1e3)
                    arrays = (p.units, p.steps)    # what an eager request copies
                    t0 = time.perf_counter()
                    jax.block_until_ready(jax.device_put(arrays))
                    rec["put_ms"].append((time.perf_counter() - t0) * 1e3)
                    jax.block_until_ready(call())
                    t0 = time.perf_counter()
                    jax.block_until_ready(call())
                    rec["cached_call_ms"].append((time.perf_counter() - t0) * 1e3)
                rec["plan_bytes"] = int(sum(x.nbytes for x in arrays))
                rec["template"], rec["policy"] = p.template, p.policy
        for rec in row["by"].values():
            for kk in ("request_ms", "plan_ms", "put_ms", "cached_call_ms"):
                rec[kk + "_median"] = _med(rec[kk])
        d = outs[True] - outs[False]
        row["max_abs_diff_between_settings"] = float(np.abs(d).max())
        res["rows"].append(row)
        off, on = row["by"]["False"], row["by"]["True"]
        print(f"{fam:8s} {grid:10s} request {off['request_ms_median']:7.2f} -> "
              f"{on['request_ms_median']:7.2f} ms  plan {off['plan_ms_median']:6.2f} -> "
              f"{on['plan_ms_median']:6.2f}  put {off['put_ms_median']:6.2f} -> "
              f"{on['put_ms_median']:6.2f}  MB {off['plan_bytes'] / 1e6:6.1f} -> "
              f"{on['plan_bytes'] / 1e6:6.1f}  max|diff| {row['max_abs_diff_between_settings']:.1e}",
              flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
