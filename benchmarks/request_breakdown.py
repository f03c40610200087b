"""Where a tessera_jax request on a new mask spends its time, part by part, on this machine.

A request = selection (features + table look-up) + planning + the copy of the plan (units and
steps) + dispatch + the kernel. Per corpus test mask (FAMILY:GRID, its first mask there, the first
--heads heads), cold (every cache of the mask cleared) and repeated: each part timed alone on
fresh data, the whole request, the time until ``sparse_attention`` returns (host work before the
device runs), garbage collection during the request, the cached call and the kernel alone.
Also: the host (CPUs, transparent huge pages, the cost of first-touching a fresh 64 MB array)
and a cProfile of one cold request per mask (top functions by cumulative time).

    python benchmarks/request_breakdown.py --masks vsa:hy720_1x1 svg2:hy720 --out rb.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pathlib
import platform
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

DEFAULT_MASKS = ["vsa:hy720_1x1", "svg2:hy720", "svg2:hy480", "xattn:wan720", "sparge:wan480",
                 "ditfastattn:wan480", "moba:hy720_1x1", "ssta:hy720", "jenga:wan480",
                 "dense:wan480", "dense:hy720"]


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text().strip()
    except OSError as e:
        return f"unreadable: {e}"


def host_info() -> dict:
    """CPUs, THP mode and the first-touch cost of a fresh 64 MB array (page faults)."""
    fresh, again = [], []
    for _ in range(3):
        t = time.perf_counter()
        a = np.empty(16 << 20, np.int32)
        a.fill(1)
        fresh.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        a.fill(2)
        again.append((time.perf_counter() - t) * 1e3)
        del a
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu_model": cpu,
            "affinity": len(os.sched_getaffinity(0)),
            "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "fill_64MB_fresh_ms": fresh, "fill_64MB_touched_ms": again}


def put_probe(reps: int = 20) -> dict:
    """Median ms of jax.device_put of fresh int32 arrays: one array, and the same bytes as two
    (what a request copies: units + steps), per size; the fixed cost shows at small sizes."""
    import jax
    out = {}
    for nbytes in (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20):
        one, two = [], []
        for _ in range(reps):
            a = np.ones(nbytes // 4, np.int32)
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(a))
            one.append((time.perf_counter() - t) * 1e3)
            b, c = np.ones(nbytes // 8, np.int32), np.ones(nbytes // 8, np.int32)
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put((b, c)))
            two.append((time.perf_counter() - t) * 1e3)
        out[str(nbytes)] = {"one_ms": float(np.median(one)), "two_ms": float(np.median(two))}
    for k in (1, 2, 4, 8):           # 64 MB in k pieces, one device_put (kernel_backends)
        ts = []
        for _ in range(reps // 2):
            parts = tuple(np.ones((16 << 20) // k, np.int32) for _ in range(k))
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(parts))
            ts.append((time.perf_counter() - t) * 1e3)
        out[f"64MB_in_{k}"] = float(np.median(ts))
    print("put_probe", json.dumps(out), flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--masks", nargs="+", default=DEFAULT_MASKS)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plan-threads", type=int, default=None,
                    help="the planner's threads (tj.Options(planner=PlannerConfig(threads=N)); "
                         "default: PlannerConfig's)")
    a = ap.parse_args(argv)
    import jax
    from tqdm import tqdm

    import tessera_jax as tj
    from tessera_jax.tools import timing
    from request_cases import bf16_inputs, first_test_mask, forget_request_caches
    from tessera_jax.runtime import dispatch as backends
    from tessera_jax.runtime import host_plans
    from tessera_jax.planning import PlannerConfig, planner
    from tessera_jax.masks import corpus
    from tessera_jax.validation import check_shapes

    config = PlannerConfig() if a.plan_threads is None else PlannerConfig(threads=a.plan_threads)
    opts = tj.Options(planner=config)
    planner.warm_up()
    res = {"device": str(jax.devices()[0]), "host": host_info(), "put_probe": put_probe(),
           "planner_threads": config.threads, "rows": []}
    print(json.dumps(res["host"]), flush=True)
    specs = corpus("test")

    clear = forget_request_caches

    for item in tqdm(a.masks, desc="masks"):
        spec, m = first_test_mask(item, a.heads, specs)
        H = a.heads
        q, k, v = bf16_inputs(m, H)
        shape = check_shapes(q.shape, k.shape, q.dtype)
        be = backends.resolve(None, shape)
        call = lambda: tj.sparse_attention(q, k, v, m, options=opts)  # noqa: E731
        jax.block_until_ready(call())                       # compiles
        rec = {k_: [] for k_ in ("select_ms", "plan_ms", "put_ms", "dispatch_ms", "request_ms",
                                 "gc_ms", "cached_call_ms", "cached_dispatch_ms")}
        gc_t = [0.0, None]

        def on_gc(phase, info):
            if phase == "start":
                gc_t[1] = time.perf_counter()
            elif gc_t[1] is not None:
                gc_t[0] += time.perf_counter() - gc_t[1]
                gc_t[1] = None

        gc.callbacks.append(on_gc)
        try:
            for _ in range(a.iters):
                clear()
                t = time.perf_counter()
                tp, pol = host_plans.choose_template(m, shape, be)
                rec["select_ms"].append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                p = tj.plan(m, q.shape, k.shape, q.dtype, template=tp, policy=pol, options=opts)
                rec["plan_ms"].append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                jax.block_until_ready(jax.device_put((p.units, p.steps)))
                rec["put_ms"].append((time.perf_counter() - t) * 1e3)
                del p
                clear()
                gc_t[0] = 0.0
                t = time.perf_counter()
                out = call()
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                t2 = time.perf_counter()
                rec["dispatch_ms"].append((t1 - t) * 1e3)
                rec["request_ms"].append((t2 - t) * 1e3)
                rec["gc_ms"].append(gc_t[0] * 1e3)
                del out
                jax.block_until_ready(call())   # the plan's 2nd call makes its device copies
                t = time.perf_counter()
                out = call()
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                rec["cached_call_ms"].append((time.perf_counter() - t) * 1e3)
                rec["cached_dispatch_ms"].append((t1 - t) * 1e3)
                del out
        finally:
            gc.callbacks.remove(on_gc)
        # eager (called as given, cached executables): the kernel rule of every benchmark
        kt = timing.time_kernel(lambda q_, k_, v_: tj.sparse_attention(q_, k_, v_, m, options=opts),
                                [(q, k, v)],
                                rule=timing.KERNEL_RULE)
        clear()
        prof = cProfile.Profile()
        prof.enable()
        jax.block_until_ready(call())
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        p = tj.plan(m, q.shape, k.shape, q.dtype, options=opts)
        from tessera_jax.runtime import dense_route
        routed = dense_route.takes(m, shape, be, False)
        row = {"mask": item, "id": spec["id"], "density": m.density, "heads": H,
               "route": "cudnn_dense (select/plan/put are not part of its request)" if routed
               else "plan",
               "template": p.template, "policy": p.policy, "step_rows": int(p.num_steps),
               "plan_bytes": int(p.units.nbytes + p.steps.nbytes),
               **kt.to_json("kernel_"),
               "profile": s.getvalue()[-12000:], "samples": rec}
        row.update({k_ + "_median": float(np.median(v_)) for k_, v_ in rec.items()})
        res["rows"].append(row)
        print(f"{item:20s} sel {row['select_ms_median']:6.2f} plan {row['plan_ms_median']:6.2f} "
              f"put {row['put_ms_median']:6.2f} disp {row['dispatch_ms_median']:6.2f} "
              f"req {row['request_ms_median']:7.2f} gc {row['gc_ms_median']:5.2f} "
              f"cached {row['cached_call_ms_median']:7.2f} (disp {row['cached_dispatch_ms_median']:5.2f}) "
              f"kern {row['kernel_ms']:7.2f} "
              f"({p.template}/{p.policy}, {row['plan_bytes'] / 1e6:.1f} MB)", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
