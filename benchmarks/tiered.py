"""Tiered planning (``Options(host_planning=...)``): the constants of its rule, and the first
and second request on a new host mask, synchronous against tiered.

Two sections, one JSON:

* ``fit``: host planning (``tj.plan`` with every cache cleared: template choice + planner;
  min of --fit-repeats) over corpus test masks (--fit-families x --fit-grids, --heads heads), and
  the device route's planner alone (jitted, compiled; traced bounds, as tiered calls run it)
  over --families x --fit-grids; non-negative least squares of ``tier_costs.TierCosts``' host
  and device-planning terms. The kernel terms and compile time come from ``requests``.
* ``requests``: per --families mask at --grid, executables of both routes compiled first (a
  new mask of known shapes): host planning, the host plan's call, the device route's call
  (mask already on the device) and its planner, host planning beside a Python thread (the
  GIL: ``gil_probe``); then, each after ``tj.clear_caches()``, the
  first and the second request (the second right after the first returns) under "sync",
  "tiered" (the rule's choice, with the constants in the tree) and "device_first" (always
  the device route first), with the route each ran and the rule's prediction.

CPU box (what ``benchmarks/results/cpu-tiered.json`` holds; XLA backend, so head_dim 8 and
float32 to keep a Wan 480p call to seconds):

    python benchmarks/tiered.py --head-dim 8 --dtype float32 --repeats 2 \\
        --out benchmarks/results/cpu-tiered.json

H200 (a GPU session; Wan 480p as served: head_dim 128, bfloat16):

    python benchmarks/tiered.py --out benchmarks/results/h200-tiered.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

FIT_FAMILIES = ["svg2", "vsa", "sparge", "sta", "jenga", "xattn", "ssta", "moba", "svg",
                "radial", "natten"]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _inputs(mask, heads: int, head_dim: int, dtype: str):
    import jax
    import jax.numpy as jnp
    key = jax.random.key(0)
    return tuple(jax.random.normal(jax.random.fold_in(key, i), (1, L, heads, head_dim),
                                   jnp.dtype(dtype))
                 for i, L in enumerate((mask.Lq, mask.Lkv, mask.Lkv)))


def _shape(mask, heads, head_dim, dtype):
    from tessera_jax.validation import check_shapes
    return check_shapes((1, mask.Lq, heads, head_dim), (1, mask.Lkv, heads, head_dim), dtype)


def host_plan_ms(mask, shape, repeats: int) -> float:
    """Min ms of ``tj.plan`` on a new mask (every cache cleared)."""
    import tessera_jax as tj
    ts = []
    for _ in range(repeats):
        tj.clear_caches()
        t0 = time.perf_counter()
        tj.plan(mask, (1, shape.q_len, shape.num_q_heads, shape.head_dim),
                (1, shape.kv_len, shape.num_kv_heads, shape.head_dim), shape.dtype)
        ts.append(_ms(t0))
    return float(min(ts))


def _spin(stop) -> int:
    """Pure-Python iterations (the GIL held) until ``stop()``."""
    n = 0
    while not stop():
        for _ in range(1000):
            n += 1
    return n


def gil_probe(mask, shape, repeats: int) -> dict:
    """Host planning on a background thread while this thread runs pure Python (holding the
    GIL between switches): the plan's ms against alone, and the Python rate this thread keeps
    against alone (1.0: planning released the GIL throughout; ~0.5 on a full core: it held
    it). The min over ``repeats``."""
    import concurrent.futures
    import tessera_jax as tj
    alone = host_plan_ms(mask, shape, repeats)
    t0 = time.perf_counter()
    n = _spin(lambda: time.perf_counter() - t0 > alone / 1e3)
    solo_rate = n / (time.perf_counter() - t0)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    plan_ms, rate = [], []
    for _ in range(repeats):
        tj.clear_caches()
        fut = pool.submit(host_plan_ms, mask, shape, 1)      # clears, then plans
        t0 = time.perf_counter()
        n = _spin(fut.done)
        rate.append(n / (time.perf_counter() - t0) / solo_rate)
        plan_ms.append(fut.result())
    pool.shutdown()
    return {"plan_alone_ms": alone, "plan_beside_python_ms": float(min(plan_ms)),
            "python_rate_beside_plan": float(max(rate))}


def device_planner(mask, shape, backend: str, budget: int):
    """(fn() running the device route's planner on ``mask`` with traced bounds, template,
    capacity)."""
    import jax
    import jax.numpy as jnp
    from tessera_jax.runtime import device_route
    from tessera_jax.select import device as sd
    t, cap = sd.choose_template(sd.DeviceFeatures(None, None, mask.shape, shape), backend,
                                None, sd.DeviceRule(budget))
    dm = mask.to_device()
    q = jnp.zeros((1, shape.q_len, shape.num_q_heads, shape.head_dim), shape.dtype)
    k = jnp.zeros((1, shape.kv_len, shape.num_kv_heads, shape.head_dim), shape.dtype)

    @jax.jit
    def plan(q, k, qb, kb, blocks):
        p = device_route.device_plans(q, k, qb, kb, blocks, consts=(None, None, None), t=t,
                                      capacity=cap, decide=True, budget=budget)
        return jax.tree_util.tree_leaves(p.fwd), p.ok

    return (lambda: jax.block_until_ready(plan(q, k, dm.q_bounds, dm.kv_bounds, dm.blocks))), \
        t, cap


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call ms, min ms of ``repeats`` more)."""
    t0 = time.perf_counter()
    fn()
    return _ms(t0), best_of(fn, repeats)[0]


def best_of(fn, repeats: int):
    """(min ms of ``repeats`` calls, the last call's result)."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = fn()
        ts.append(_ms(t0))
    return float(min(ts)), r


def _nnls(rows, cols, target):
    """Non-negative least squares of ``target`` on the columns ``cols`` of ``rows`` (a
    column of ones first; unweighted, so the large masks, where the rule's choice matters,
    fit best): (coefficients, {median, max} of max(predicted / measured, its inverse))."""
    from scipy.optimize import nnls
    A = np.array([[1.0] + [float(r[c]) for c in cols] for r in rows])
    y = np.array([float(r[target]) for r in rows])
    x, _ = nnls(A, y)
    pred = A @ x
    for r, p_ in zip(rows, pred):
        r["predicted_" + target] = float(p_)
    ratio = np.maximum(pred / y, y / np.maximum(pred, 1e-9))
    return x, {"median_ratio": float(np.median(ratio)), "max_ratio": float(ratio.max())}


def _uniform(L: int, heads: int):
    """A small per-head mask (64-token blocks, 30% selected): anchors the fits' fixed costs."""
    import tessera_jax as tj
    n = -(-L // 64)
    rng = np.random.default_rng(L)
    return tj.BlockMask.uniform(L, L, 64, 64, rng.random((heads, n, n)) < 0.3)


def fit_section(a, specs, backend: str) -> dict:
    from tqdm import tqdm
    from request_cases import first_test_mask
    from tessera_jax.runtime import options as options_
    budget = options_.DEFAULT.bitmap_budget_bytes
    host_rows, dev_rows = [], []
    masks = {}
    for fam, grid in [(f, g) for g in a.fit_grids for f in a.fit_families]:
        try:
            masks[f"{fam}:{grid}"] = first_test_mask(f"{fam}:{grid}", a.heads, specs)[1]
        except StopIteration:
            continue
    small = {f"uniform:L{L}": _uniform(L, a.heads) for L in a.fit_small}
    for name, m in tqdm({**masks, **small}.items(), desc="fit: host planning"):
        shape = _shape(m, a.heads, a.head_dim, a.dtype)
        sel = int(np.count_nonzero(m.blocks))
        host_rows.append({"mask": name, "blocks": int(np.prod(m.shape)),
                          "selected": sel,
                          "pairs": sel * m.Lq / m.shape[1] * m.Lkv / m.shape[2],
                          "host_plan_ms": host_plan_ms(m, shape, a.fit_repeats)})
    dev = {f"{f}:{g}": masks[f"{f}:{g}"] for g in a.fit_grids for f in a.families}
    for name, m in tqdm({**dev, **small}.items(), desc="fit: device planning"):
        shape = _shape(m, a.heads, a.head_dim, a.dtype)
        fn, t, cap = device_planner(m, shape, backend, budget)
        first, best = timed(fn, a.fit_repeats)
        nqt, nkt = -(-shape.q_len // t.tile_q), -(-shape.kv_len // t.tile_kv)
        dev_rows.append({"mask": name, "template": t.name,
                         "tiles": a.heads * nqt * nkt, "bitmaps": int(cap),
                         "device_plan_first_ms": first, "device_plan_ms": best})
    hx, herr = _nnls(host_rows, ("blocks", "selected", "pairs"), "host_plan_ms")
    dx, derr = _nnls(dev_rows, ("tiles", "bitmaps"), "device_plan_ms")
    return {"host": host_rows, "device": dev_rows,
            "host_fit": {"host_ms": hx[0], "host_ns_per_block": hx[1] * 1e6,
                         "host_ns_per_selected": hx[2] * 1e6, "host_ns_per_pair": hx[3] * 1e6,
                         **herr},
            "device_fit": {"device_ms": dx[0], "device_ns_per_tile": dx[1] * 1e6,
                           "device_ns_per_bitmap": dx[2] * 1e6, **derr}}


def _route_of(before: dict, after: dict) -> str:
    return "device" if after.get("device_route", 0) > before.get("device_route", 0) else "host"


def _request(call, mode_opts) -> tuple[float, str, np.ndarray]:
    """(ms of one blocked call, the route it ran, its output)."""
    import jax
    from tessera_jax.runtime import tiered
    s0 = tiered.stats()
    t0 = time.perf_counter()
    out = jax.block_until_ready(call(mode_opts))
    return _ms(t0), _route_of(s0, tiered.stats()), out


def request_section(a, specs, backend: str) -> list:
    import jax
    from tqdm import tqdm
    import tessera_jax as tj
    from request_cases import first_test_mask
    from tessera_jax.runtime import tier_costs, tiered
    from tessera_jax.select import ranking
    rows = []
    platform_ = jax.devices()[0].platform
    costs = tier_costs.costs_for(platform_, backend, ranking.device_name())
    for fam in tqdm(a.families, desc="requests"):
        spec, m = first_test_mask(f"{fam}:{a.grid}", a.heads, specs)
        q, k, v = _inputs(m, a.heads, a.head_dim, a.dtype)
        shape = _shape(m, a.heads, a.head_dim, a.dtype)
        opts = {mode: tj.Options(host_planning=mode) for mode in ("sync", "tiered",
                                                                  "device_first")}
        call = lambda o: tj.sparse_attention(q, k, v, m, options=o)        # noqa: E731
        row = {"mask": f"{fam}:{a.grid}", "id": spec["id"], "density": m.density,
               "blocks": int(np.prod(m.shape)), "selected": int(np.count_nonzero(m.blocks))}
        # Executables of both routes compiled (a new mask of shapes served before).
        tj.clear_caches()
        row["sync_cold_ms"], _, ref = _request(call, opts["sync"])
        ref = np.asarray(ref, np.float32)
        tj.clear_caches()
        row["device_first_cold_ms"] = _request(call, opts["device_first"])[0]
        tiered.wait()
        # Parts (executables compiled above).
        row["host_plan_ms"] = host_plan_ms(m, shape, a.repeats)
        row["gil"] = gil_probe(m, shape, a.repeats)
        call(opts["sync"])                       # plan cached again
        row["host_call_ms"] = best_of(lambda: jax.block_until_ready(call(opts["sync"])),
                                      a.repeats)[0]
        dm = m.to_device()
        dev = lambda: jax.block_until_ready(tj.sparse_attention(q, k, v, dm))  # noqa: E731
        row["device_call_ms"], out_dev = best_of(dev, a.repeats)
        row["max_abs_diff_device_vs_host"] = float(
            np.abs(np.asarray(out_dev, np.float32) - ref).max())
        fn, t, cap = device_planner(m, shape, backend, tj.Options().bitmap_budget_bytes)
        row["device_template"], row["device_capacity"] = t.name, int(cap)
        row["device_plan_ms"] = timed(fn, a.repeats)[1]
        t0 = time.perf_counter()
        jax.block_until_ready(m.to_device().blocks)
        row["to_device_ms"] = _ms(t0)
        size = tier_costs.size_of(m, shape, backend, tj.Options().device_rule)
        row["interactions_d"] = None if size is None else size.interactions_d
        if size is not None and costs is not None:
            host, device = tier_costs.predict(size, costs, True)
            row["predicted"] = {"host_plan_ms": host, "device_extra_ms": device,
                                "tiers": tier_costs.tiers(size, costs, True)}
        # Requests: first and second on a new mask, per mode.
        for mode in ("sync", "tiered", "device_first"):
            rec = row.setdefault(mode, {"first_ms": [], "first_route": [], "second_ms": [],
                                        "second_route": []})
            diff = 0.0
            for _ in range(a.repeats):
                tj.clear_caches()
                ms, route, out = _request(call, opts[mode])
                rec["first_ms"].append(ms)
                rec["first_route"].append(route)
                diff = max(diff, float(np.abs(np.asarray(out, np.float32) - ref).max()))
                ms, route, out = _request(call, opts[mode])
                rec["second_ms"].append(ms)
                rec["second_route"].append(route)
                diff = max(diff, float(np.abs(np.asarray(out, np.float32) - ref).max()))
                tiered.wait()
            rec["max_abs_diff_vs_sync"] = diff
            rec["first_ms_median"] = float(np.median(rec["first_ms"]))
            rec["second_ms_median"] = float(np.median(rec["second_ms"]))
        row["compile_ms"] = row["device_first_cold_ms"] - \
            row["device_first"]["first_ms_median"]
        rows.append(row)
        print(f"{row['mask']:14s} host plan {row['host_plan_ms']:7.1f} ms  device plan "
              f"{row['device_plan_ms']:7.1f}  host call {row['host_call_ms']:8.1f}  device call "
              f"{row['device_call_ms']:8.1f}  first sync / tiered / device_first "
              f"{row['sync']['first_ms_median']:8.1f} / {row['tiered']['first_ms_median']:8.1f}"
              f" ({row['tiered']['first_route'][0]}) / "
              f"{row['device_first']['first_ms_median']:8.1f}  second "
              f"{row['sync']['second_ms_median']:8.1f} / {row['tiered']['second_ms_median']:8.1f}"
              f" / {row['device_first']['second_ms_median']:8.1f} "
              f"({row['device_first']['second_route'][0]})", flush=True)
    return rows


def kernel_fit(rows) -> dict:
    """The kernel and compile terms of ``TierCosts`` from the requests' parts."""
    ok = [r for r in rows if r.get("interactions_d")]
    if not ok:
        return {}
    k = sum(r["host_call_ms"] for r in ok) / sum(r["interactions_d"] for r in ok) * 1e6
    excess = [(r["device_call_ms"] - r["device_plan_ms"] - r["host_call_ms"]) / r["host_call_ms"]
              for r in ok]
    return {"kernel_ns_per_interaction": k, "kernel_excess": max(0.0, float(np.median(excess))),
            "kernel_excess_each": excess,
            "compile_ms": float(np.median([r["compile_ms"] for r in ok]))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["svg2", "vsa", "sparge"])
    ap.add_argument("--grid", default="wan480")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fit-repeats", type=int, default=5)
    ap.add_argument("--fit-families", nargs="+", default=FIT_FAMILIES)
    ap.add_argument("--fit-grids", nargs="+", default=["wan480", "hy480", "wan720"])
    ap.add_argument("--fit-small", nargs="*", type=int, default=[256, 1024, 4096, 8192],
                    help="lengths of small uniform masks added to both fits")
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--skip-requests", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import tessera_jax as tj
    from tessera_jax.masks import corpus
    from tessera_jax.planning import planner
    from tessera_jax.runtime import dispatch, tier_costs
    from tessera_jax.select import ranking
    from tessera_jax.validation import check_shapes

    planner.warm_up()
    specs = corpus("test")
    backend = dispatch.resolve(None, check_shapes((1, 128, 1, a.head_dim),
                                                  (1, 128, 1, a.head_dim), a.dtype))
    platform_ = jax.devices()[0].platform
    costs = tier_costs.costs_for(platform_, backend, ranking.device_name())
    res = {"command": "python benchmarks/tiered.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
           "machine": {"device": str(jax.devices()[0]), "platform": platform_,
                       "backend": backend, "cpus": os.cpu_count(),
                       "python": platform.python_version(), "jax": jax.__version__},
           "args": vars(a), "costs_in_tree": None if costs is None else costs.__dict__}

    def dump():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    if not a.skip_fit:
        res["fit"] = fit_section(a, specs, backend)
        print(json.dumps({k: res["fit"][k] for k in ("host_fit", "device_fit")}), flush=True)
        dump()
    if not a.skip_requests:
        res["requests"] = request_section(a, specs, backend)
        res["kernel_fit"] = kernel_fit(res["requests"])
        print(json.dumps(res["kernel_fit"]), flush=True)
        dump()
    tj.clear_caches()
    return res


if __name__ == "__main__":
    main()
