"""Plan bytes and cold planning time on the host, for the H200's choices on a few corpus masks.

For each FAMILY:GRID (the first mask of the corpus test split, its first ``--heads`` heads), the
(template, policy) that ``selection.select`` picks from ``plan_tables/h200.json`` for the
``mosaic_gpu`` backend is planned cold (planner caches cleared) ``--repeats`` times; reports the
median planning ms, the bytes of ``units``, ``steps`` and ``row_index``, and the copy time those
bytes would take at ``--gbps`` (the H200's measured host->device rate for plans, ~5 GB/s).

    .venv/bin/python benchmarks/plan_bytes.py --out benchmarks/results/cpu-plan-bytes.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

MASKS = ("vsa:hy720_1x1", "svg2:hy720", "ssta:hy720", "sparge:wan480")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", nargs="+", default=list(MASKS))
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gbps", type=float, default=5.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax.numpy as jnp

    import tessera_jax as tj
    from pallas_kernels import abi as plan_abi
    from request_cases import first_test_mask, forget_request_caches
    from tessera_jax.tools import timing
    from tessera_jax.planning import planner
    from tessera_jax.select import ranking as selection
    from tessera_jax.masks import corpus
    from tessera_jax.validation import check_shapes

    table = selection.load_table("plan_tables/h200.json")
    specs = corpus("test")
    planner.warm_up()
    res = {"step_cols": plan_abi.STEP_COLS, "heads": a.heads, "rows": []}
    for item in a.masks:
        spec, m = first_test_mask(item, a.heads, specs)
        H, D = a.heads, 128
        qs, ks = (1, m.Lq, H, D), (1, m.Lkv, H, D)
        shape = check_shapes(qs, ks, jnp.bfloat16)
        template, policy = selection.select(m, shape, "mosaic_gpu", table=table)
        box = {}

        def plan_once():
            box["p"] = tj.plan(m, qs, ks, jnp.bfloat16, template=template, policy=policy)

        # cold planning, host wall clock (the request rule's clock), no warm-up call
        t = timing.time_request(plan_once, rule=timing.wall_rule(a.repeats, warmup=0),
                                before=lambda: forget_request_caches(selection=False))
        p, ms = box["p"], list(t.samples)
        b = {"units": p.units.nbytes, "steps": p.steps.nbytes, "row_index": p.row_index.nbytes}
        total = sum(b.values())
        row = {"id": spec["id"], "mask": item, "template": template, "policy": policy,
               "density": m.density, "num_units": p.num_units, "num_steps": p.num_steps,
               "plan_ms_median": float(np.median(ms)), "plan_ms_min": float(min(ms)),
               "plan_ms": ms, "bytes": b,
               "total_bytes": total, "copy_ms_at_gbps": total / (a.gbps * 1e6)}
        res["rows"].append(row)
        print(f"{item:14s} {template:24s} {policy:6s} S={p.num_steps:9d} plan "
              f"{row['plan_ms_median']:7.1f} ms (min {row['plan_ms_min']:6.1f})  steps {b['steps'] / 1e6:7.2f} MB  total "
              f"{total / 1e6:7.2f} MB  copy@{a.gbps:g}GB/s {row['copy_ms_at_gbps']:6.2f} ms",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
