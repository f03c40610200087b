#!/usr/bin/env python3
"""Spike (issue 31 item 1): a K/V stage filled by N TMA copies at dynamic offsets.

The Mosaic GPU forward kernel with its producer's one tile_kv-row copy per K (V) stage
replaced by ``N`` copies of tile_kv / N rows each, at starts read from the plan's words
(``steps.reshape(-1)[cuts_a + j]``: the extra GMEM read a gathered step pays), one barrier per
stage expecting N arrivals. Plans visit every tile of every head once (dense work, mode
"none"), so the rate against cuDNN dense compares directly with the one-copy kernel.
Variants: N in 1, 2, 4, 8, 16 with contiguous chunks (the pure copy cost); N = 16 and 8 with
random 8-row-aligned chunk starts (a real gather); N = 16 with starts at 8k + 4 and no
alignment hint (does Mosaic refuse it, or read the wrong rows?). Every variant is checked
against a float32 reference of its gathered keys. Kill criterion: a 4-copy stage below 0.85
of the one-copy full step.

The kernel is the library's source with two textual patches (a spike: nothing of it stays).

    python3 benchmarks/spikes/gather_copies.py --out $OUT/h200-gather-spike.json
    python3 benchmarks/spikes/gather_copies.py --interpret --L 256 --heads 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def spike_module(copies: int, aligned: bool = True, warps: bool = False):
    """pallas_kernels.mosaic.kernel with the producer filling each stage by ``copies`` copies
    (``warps``: issued by the producer's four warps, copy j by warp j % 4)."""
    src = open(os.path.join(ROOT, "pallas_kernels", "mosaic", "kernel.py")).read()
    old_load = '''    kv_start = pl.multiple_of(c.steps[ptr + i, plan_abi.STEP_KV_START], ALIGN)
    src = (b, pl.ds(kv_start, c.cfg.tile_kv), kv_head)

    @pl.when(g >= c.cfg.stages)
    def _():
        plgpu.barrier_wait(c.k_consumed.at[slot])

    plgpu.copy_gmem_to_smem(c.k.at[src], c.k_smem.at[slot], c.k_bar.at[slot])

    @pl.when(g >= c.cfg.stages)
    def _():
        plgpu.barrier_wait(c.v_consumed.at[slot])

    plgpu.copy_gmem_to_smem(c.v.at[src], c.v_smem.at[slot], c.v_bar.at[slot])
'''
    hint = "pl.multiple_of({}, ALIGN)" if aligned else "{}"
    new_load = f'''    rows = c.cfg.tile_kv // {copies}
    off = c.steps[ptr + i, plan_abi.STEP_CUTS_A]
    starts = [{hint.format("c.words[off + j]")} for j in range({copies})]

    @pl.when(g >= c.cfg.stages)
    def _():
        plgpu.barrier_wait(c.k_consumed.at[slot])

    ISSUE_K

    @pl.when(g >= c.cfg.stages)
    def _():
        plgpu.barrier_wait(c.v_consumed.at[slot])

    ISSUE_V
'''
    for x in "kv":
        one = (f"plgpu.copy_gmem_to_smem(c.{x}.at[b, pl.ds(starts[j], rows), kv_head], "
               f"c.{x}_smem.at[slot, pl.ds(j * rows, rows)], c.{x}_bar.at[slot])")
        if warps:
            issue = (f"def _issue(w):\n"
                     f"        for j in range({copies}):\n"
                     f"            pl.when(w == j % 4)(lambda j=j: {one})\n"
                     f"    plgpu.warp_map(_issue)")
        else:
            issue = f"for j in range({copies}):\n        {one}"
        new_load = new_load.replace(f"ISSUE_{x.upper()}", issue)
    old_bar = ("(plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),\n"
               "             plgpu.Barrier(num_barriers=nwg)),")
    new_bar = (f"(plgpu.Barrier(num_arrivals={copies}, num_barriers=slots), "
               f"plgpu.Barrier(num_arrivals={copies}, num_barriers=slots),\n"
               "             plgpu.Barrier(num_barriers=nwg)),")
    for old, new in ((old_load, new_load), (old_bar, new_bar)):
        assert src.count(old) == 1, old[:60]
        src = src.replace(old, new)
    mod = types.ModuleType(f"gather_spike_{copies}_{aligned}_{warps}")
    sys.modules[mod.__name__] = mod          # dataclasses look the module up
    exec(compile(src, f"<spike {copies}>", "exec"), mod.__dict__)
    return mod


def dense_plan(L, H, tile_q, tile_kv, copies, rng, chunks="contiguous"):
    """(units, steps, key_index [nk * tile_kv]): every unit visits nk steps (shared rows); step
    s's chunk starts are words after the step rows; key_index lists the keys a unit sees."""
    from pallas_kernels import abi

    nq, nk = L // tile_q, L // tile_kv
    rows = tile_kv // copies
    words_rows = -(-nk * copies // abi.STEP_COLS)
    steps = np.zeros((nk + words_rows, abi.STEP_COLS), np.int32)
    flat = steps.reshape(-1)
    keys = []
    for s in range(nk):
        off = nk * abi.STEP_COLS + s * copies
        if chunks == "contiguous":
            starts = s * tile_kv + rows * np.arange(copies)
        else:
            starts = rng.integers(0, L // 8 - rows // 8 + 1, copies) * 8
            if chunks == "unaligned":
                starts = np.minimum(starts + 4, L - rows)
        flat[off: off + copies] = starts
        steps[s] = (starts[0], abi.pack_rect(0, tile_q, 0, tile_kv), off, 0)
        keys.append((starts[:, None] + np.arange(rows)[None, :]).reshape(-1))
    units = np.array([(h, t * tile_q, 0, tile_q, 0, nk) for h in range(H) for t in range(nq)],
                     np.int32)
    return units, steps, np.concatenate(keys)


def reference(q, k, v, key_index, heads, scale):
    import jax.numpy as jnp

    outs = []
    for h in heads:
        qh = q[0, :, h].astype(jnp.float32)
        kh, vh = (x[0, key_index, h].astype(jnp.float32) for x in (k, v))
        s = (qh @ kh.T) * scale
        p = jnp.exp(s - s.max(-1, keepdims=True))
        outs.append((p / p.sum(-1, keepdims=True)) @ vh)
    return jnp.stack(outs, 1)


VARIANTS = [(0, "contiguous"), (1, "contiguous"), (2, "contiguous"), (4, "contiguous"),
            (8, "contiguous"), (16, "contiguous"), (16, "random"), (8, "random"),
            (16, "unaligned"), (4, "warps"), (8, "warps"), (16, "warps"), (16, "random-warps")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--templates", default="mgpu_q128_kv128_s2_hm,mgpu_q64x2pp_kv64_s2_hm")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--variants", default=None, help="copies:chunks,... (default: all)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from pallas_kernels import abi, contract
    from pallas_kernels import templates as T
    from pallas_kernels.mosaic import kernel as base_kernel
    from tessera_jax.tools import timing

    interp = False
    if args.interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as _p
        interp = _p.InterpretGPUParams()
    L, H, D = args.L, args.heads, 128
    dtype = jnp.bfloat16
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, L, H, D), jnp.float32).astype(dtype) for kk in ks)
    scale = D ** -0.5
    gpu = jax.devices()[0].platform == "gpu"
    res = {"device": str(jax.devices()[0].device_kind), "L": L, "heads": H, "D": D,
           "rule": timing.KERNEL_RULE.to_json(), "jax": jax.__version__, "rows": []}
    if gpu:
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, implementation="cudnn"))
        res["dense_ms"] = timing.time_kernel(dense, [(q, k, v)]).ms
        log(f"cuDNN dense {res['dense_ms']:.3f} ms")
    rng = np.random.default_rng(1)
    for name in args.templates.split(","):
        t = T.get(name)
        cfg = base_kernel.KernelConfig.from_template(t, "none")
        variants = VARIANTS if not args.variants else [
            (int(x.split(":")[0]), x.split(":")[1]) for x in args.variants.split(",")]
        for copies, chunks in variants:
            if time.time() - T0 > args.budget_s:
                log("budget reached")
                break
            if copies and t.tile_kv // copies < 8:
                continue
            row = dict(template=name, copies=copies, chunks=chunks)
            try:
                mod = base_kernel if copies == 0 else spike_module(
                    copies, aligned=chunks != "unaligned", warps="warps" in chunks)
                units, steps, key_index = dense_plan(L, H, t.tile_q, t.tile_kv,
                                                     max(copies, 1), rng,
                                                     chunks.replace("-warps", "").replace(
                                                         "warps", "contiguous"))

                def fn(q, k, v, u, s, mod=mod, cfg=cfg):
                    return mod.forward(q, k, v, u, s, cfg=cfg, scale=scale,
                                       interpret=interp)[0]

                fn = jax.jit(fn)
                du, ds = jnp.asarray(units), jnp.asarray(steps)
                out = fn(q, k, v, du, ds)                    # [1, U, tile_q, D]
                nq = L // t.tile_q
                got = out[0].reshape(H, nq * t.tile_q, D)[jnp.array([0, H - 1])]
                got = jnp.moveaxis(got, 0, 1).astype(jnp.float32)
                ref = reference(q, k, v, jnp.asarray(key_index), [0, H - 1], scale)
                row["rel_err"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                row["ok"] = bool(row["rel_err"] < 2e-2)
                if gpu:
                    tm = timing.time_kernel(fn, [(q, k, v, du, ds)])
                    row["ms"] = tm.ms
                    row["rate"] = res["dense_ms"] / tm.ms
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            log(json.dumps(row))
            res["rows"].append(row)
    base = {r["template"]: r.get("ms") for r in res["rows"] if r["copies"] == 0}
    for r in res["rows"]:
        if r.get("ms") and base.get(r["template"]):
            r["vs_one_copy"] = base[r["template"]] / r["ms"]
    four = [r["vs_one_copy"] for r in res["rows"]
            if r["copies"] == 4 and r["chunks"] == "contiguous" and "vs_one_copy" in r]
    res["summary"] = {"four_copy_vs_one_copy_min": min(four) if four else None,
                      "kill": (min(four) < 0.85) if four else None}
    log(json.dumps(res["summary"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
