"""Host planning cost on the Wan2.1 720p grid: cold plan, cached plan, and mask building.

Wan2.1-14B at 720p has a latent token grid of (21, 45, 80) = 75,600 tokens and 40 heads. Tokens
are ordered cube-major (4x4x4 cubes, as VSA/STA reorder them): 1,440 logical blocks of at most
64 tokens (1,100 of 64, 320 of 16, 20 of 4: partial cubes at the edges). Two per-head mask
families at ~10% block density:

* ``sta``:  sliding-tile windows over the cube grid (STA's clipped-window rule), a window of
  144 cubes per head chosen among five shapes (STA's released tables use 4-5 distinct windows
  per layer), so heads repeat and the planner plans each distinct head mask once.
* ``sta40``: the same rule with 40 distinct windows (every head differs; 130-160 cubes each).
* ``topk``: per head and query cube, the 144 key cubes with the highest random score (VSA-like
  top-k with no locality: the worst case for merging).

Cold = a fresh ``tj.plan`` (planner cache cleared) on a mask whose digest is already computed,
in a process that has planned before (the planner's compiled loops are loaded): the cost of a
new mask. cached = ``tj.plan`` on a digest already planned. Mask construction (blocks + digest)
is timed separately: it is not planning. The planner's loops run compiled (numba) on
``PlannerConfig().threads`` threads (2 on this host); the default policy is also timed on 1
thread (planned by ``planner.build_plan`` with ``PlannerConfig(threads=1)`` and the template's
tiles: the runtime takes no planner options).
Policies: every one on ``mgpu_q128_kv128_s2_hm``, merge on ``xla_64x64``, and merge / split / pack
on ``mgpu_q64x2_kv64_s2_hm`` (what the H200 ranking table picks, with pack, for cube masks).

First plan = the first ``tj.plan`` of a fresh process (``sta``, default template and policy),
which also imports numba and compiles the planner's loops, or loads them from numba's on-disk
cache: timed in two subprocesses sharing an empty cache directory (the first compiles and
writes the cache, the second loads it).

    .venv/bin/python benchmarks/planning.py [--repeats 5] [--out benchmarks/results/cpu-planning.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

import jax
import jax.numpy as jnp

import tessera_jax as tj
from tessera_jax.runtime import api
from tessera_jax.planning import planner

GRID = (21, 45, 80)          # Wan2.1 720p latent (frames, height, width)
CUBE = (4, 4, 4)
HEADS = 40
HEAD_DIM = 128
WINDOWS = ((3, 6, 8), (2, 6, 12), (6, 4, 6), (4, 6, 6), (3, 4, 12))   # 144 cubes each
WINDOWS40 = tuple((t, h, w) for t in range(1, 7) for h in range(1, 13) for w in range(1, 21)
                  if 136 <= t * h * w <= 152 and w >= 4)[:40]


def cube_layout(grid=GRID, cube=CUBE):
    """(bounds, cube grid) of the cube-major token order: one logical block per cube."""
    counts = [-(-g // c) for g, c in zip(grid, cube)]
    sizes = [np.minimum(c, g - c * np.arange(n)) for g, c, n in zip(grid, cube, counts)]
    vol = (sizes[0][:, None, None] * sizes[1][None, :, None] * sizes[2][None, None, :]).ravel()
    return np.concatenate([[0], np.cumsum(vol)]), tuple(counts)


def sta_blocks(cgrid, window):
    """STA rule over cubes: key cube kept iff |clip(q_a, w//2, G-1-w//2) - k_a| <= w//2."""
    axes = []
    for g, w in zip(cgrid, window):
        w = min(w, g)
        q = np.arange(g)
        c = np.clip(q, w // 2, g - 1 - (w - 1 - w // 2))
        k = np.arange(g)
        axes.append((k[None, :] >= c[:, None] - w // 2) & (k[None, :] <= c[:, None] + (w - 1 - w // 2)))
    a, b, c = axes
    m = a[:, None, None, :, None, None] & b[None, :, None, None, :, None] & c[None, None, :, None, None, :]
    n = int(np.prod(cgrid))
    return m.reshape(n, n)


def build_masks(heads=HEADS, seed=0):
    bounds, cgrid = cube_layout()
    n = len(bounds) - 1
    t0 = time.perf_counter()
    sta = np.stack([sta_blocks(cgrid, WINDOWS[h % len(WINDOWS)]) for h in range(heads)])
    t_sta_blocks = time.perf_counter() - t0
    t0 = time.perf_counter()
    m_sta = tj.BlockMask(bounds, bounds, sta)
    t_sta_mask = time.perf_counter() - t0
    sta40 = np.stack([sta_blocks(cgrid, WINDOWS40[h % len(WINDOWS40)]) for h in range(heads)])
    t0 = time.perf_counter()
    m_sta40 = tj.BlockMask(bounds, bounds, sta40)
    t_sta40_mask = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    scores = rng.random((heads, n, n), dtype=np.float32)
    k = 144
    kth = np.partition(scores, n - k, axis=-1)[..., n - k: n - k + 1]
    topk = scores >= kth
    t_topk_blocks = time.perf_counter() - t0
    t0 = time.perf_counter()
    m_topk = tj.BlockMask(bounds, bounds, topk)
    t_topk_mask = time.perf_counter() - t0
    return {"sta": (m_sta, t_sta_blocks, t_sta_mask),
            "sta40": (m_sta40, t_sta_blocks, t_sta40_mask), "topk": (m_topk, t_topk_blocks, t_topk_mask)}


def time_plan(mask, q_shape, kv_shape, dtype, template, policy, repeats, cached_calls=2000,
              threads=None):
    """``threads``: the planner's (None: its default, through ``tj.plan``)."""
    make = lambda: tj.plan(mask, q_shape, kv_shape, dtype, template=template,  # noqa: E731
                           policy=policy)
    if threads is not None:
        from tessera_jax.planning import PlannerConfig
        from tessera_jax.runtime import dispatch
        t, cfg = dispatch.get_template(template), PlannerConfig(threads=threads)
        make = lambda: planner.build_plan(  # noqa: E731
            mask, q_shape, kv_shape, dtype, tile_q=t.tile_q, tile_kv=t.tile_kv, policy=policy,
            q_align=t.q_align, kv_align=t.kv_align, template=t.name, unit_order=t.unit_order,
            config=cfg)
    cold, cold_cpu = [], []
    for _ in range(repeats):
        planner._build_cached.cache_clear()
        api._PLANS.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        p = make()
        cold.append(time.perf_counter() - t0)
        cold_cpu.append(time.process_time() - c0)
    make()
    cached = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(cached_calls):
            make()
        cached.append((time.perf_counter() - t0) / cached_calls)
    s = p.stats()
    keep = ("units", "tiles", "full_tiles", "kept", "merged", "split", "waste_fraction",
            "kv_bytes", "max_unit_cost", "est_time_us", "balance", "capacities")
    return {"template": template, "policy": policy, "threads": p.config.threads,
            "cold_ms": [round(x * 1e3, 3) for x in cold],
            "cold_ms_median": round(float(np.median(cold)) * 1e3, 3),
            "cold_ms_min": round(float(np.min(cold)) * 1e3, 3),
            "cold_cpu_ms": [round(x * 1e3, 3) for x in cold_cpu],
            "cold_cpu_ms_median": round(float(np.median(cold_cpu)) * 1e3, 3),
            "cached_us": [round(x * 1e6, 3) for x in cached],
            "cached_us_median": round(float(np.median(cached)) * 1e6, 3),
            "stats": {k: (list(s[k]) if isinstance(s[k], tuple) else s[k]) for k in keep}}


def first_plan() -> dict:
    """The first ``tj.plan`` of this process (run in a fresh subprocess by ``main``)."""
    bounds, cgrid = cube_layout()
    sta = np.stack([sta_blocks(cgrid, WINDOWS[h % len(WINDOWS)]) for h in range(HEADS)])
    m = tj.BlockMask(bounds, bounds, sta)
    m.digest
    shape = (1, m.Lq, HEADS, HEAD_DIM)
    t0 = time.perf_counter()
    tj.plan(m, shape, shape, jnp.bfloat16, template="mgpu_q128_kv128_s2_hm", policy="merge")
    first = time.perf_counter() - t0
    planner._build_cached.cache_clear()
    api._PLANS.clear()
    t0 = time.perf_counter()
    tj.plan(m, shape, shape, jnp.bfloat16, template="mgpu_q128_kv128_s2_hm", policy="merge")
    again = time.perf_counter() - t0
    return {"first_plan_ms": round(first * 1e3, 1),
            "same_mask_again_cold_ms": round(again * 1e3, 1)}


def time_first_plans() -> dict:
    """First plans of two fresh processes sharing an empty numba cache: compile, then load."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for key in ("compile", "cache_load"):
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--first-plan"],
                               env=env, capture_output=True, text=True, check=True)
            out[key] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="default policy and template only")
    ap.add_argument("--first-plan", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first_plan:
        print(json.dumps(first_plan()))
        return None
    load0 = list(os.getloadavg())
    firsts = time_first_plans()
    print(f"first plan of a process: {firsts['compile']['first_plan_ms']:.0f} ms compiling, "
          f"{firsts['cache_load']['first_plan_ms']:.0f} ms loading numba's cache", flush=True)
    t0 = time.perf_counter()
    planner.warm_up()
    warm_up_ms = (time.perf_counter() - t0) * 1e3
    masks = build_masks()
    L = masks["sta"][0].Lq
    q_shape = (1, L, HEADS, HEAD_DIM)
    kv_shape = (1, L, HEADS, HEAD_DIM)
    dtype = jnp.bfloat16
    runs = []
    configs = [("mgpu_q128_kv128_s2_hm", "merge", None), ("mgpu_q128_kv128_s2_hm", "merge", 1)]
    if not args.quick:
        configs += [("mgpu_q128_kv128_s2_hm", p, None) for p in ("keep", "split", "pack", "auto")]
        configs += [("xla_64x64", "merge", None)]
        # the template the H200 table picks for cube masks (64x64 tiles, its option: pack)
        configs += [("mgpu_q64x2_kv64_s2_hm", p, None) for p in ("merge", "split", "pack")]
    for name, (m, t_blocks, t_mask) in masks.items():
        for template, policy, threads in configs:
            r = time_plan(m, q_shape, kv_shape, dtype, template, policy, args.repeats,
                          threads=threads)
            r.update(mask=name, density=round(m.density, 4),
                     selected_blocks=int(m.blocks.sum()),
                     mask_blocks_ms=round(t_blocks * 1e3, 2),
                     mask_construct_digest_ms=round(t_mask * 1e3, 2))
            runs.append(r)
            print(f"{name:5s} {template:20s} {policy:6s} x{r['threads']} cold {r['cold_ms_median']:8.1f} ms "
                  f"(min {r['cold_ms_min']:.1f}, cpu {r['cold_cpu_ms_median']:.1f})  "
                  f"cached {r['cached_us_median']:6.2f} us  tiles {r['stats']['tiles']:>9,}  "
                  f"waste {r['stats']['waste_fraction']:.3f}  est {r['stats']['est_time_us']:.0f} us",
                  flush=True)
    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/planning.py"] + (argv or sys.argv[1:])),
        "what": "host planning cost, Wan2.1 720p grid (21,45,80)=75,600 tokens, 4x4x4-cube "
                "logical blocks (<=64 tokens, 1,440 blocks), 40 per-head masks at ~10% density",
        "load_average_before_after": [load0, list(os.getloadavg())],
        "note": "cold_ms is wall time of a new mask's plan in a process that has planned "
                "before; cold_cpu_ms is this process's CPU time, summed over threads (the "
                "host is shared with other jobs, so wall time includes waiting for a core); "
                "threads: PlannerConfig.threads, the threads of the planner's compiled loops",
        "first_plan": firsts,
        "warm_up_ms": round(warm_up_ms, 1),
        "host": {"machine": platform.machine(), "processor": platform.processor(),
                 "cpus": os.cpu_count(), "python": platform.python_version(),
                 "numpy": np.__version__, "jax": jax.__version__},
        "shape": {"q": list(q_shape), "kv": list(kv_shape), "dtype": "bfloat16"},
        "targets": {"cold_ms": 50, "cached_us": 50},
        "runs": runs,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
