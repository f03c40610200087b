#!/usr/bin/env python3
"""What a masked step costs in the Mosaic GPU kernel, by step kind and mask evaluation.

Synthetic plans that visit every tile of every head once (so each computes exactly the dense
work and its time compares with cuDNN dense directly), all steps of one kind:
  full    whole tiles (mask mode "none": no masking code; and "cond": the per-step check only)
  plain   partial rectangles (all rows, tile_kv - 1 keys)
  rows    partial rectangles (tile_q - 8 rows, all keys)
  grid    2 x 2 grids (two of four cells) inside the whole tile
  bitmap  a random bit per entry (abi.BITMAP_FLAG), one bitmap per tile
in mask mode "cond" (mode "none" too for full steps). Every
variant is checked against a float32 reference on two heads, then timed with cuDNN dense in the
same process under ``tools.timing.KERNEL_RULE``. ``rate`` = cuDNN time / ours (1.0: as fast
as dense per computed entry).

    python3 benchmarks/masked_steps.py --out $OUT/h200-masked-steps.json
    python3 benchmarks/masked_steps.py --interpret --L 256 --heads 2   # CPU smoke run

Runs 1-4 (``h200-masked-steps-run{1..4}.json@4ae09b7``, in git history) also timed variants since deleted or
made the default: ``mask_eval`` "vector" (one formula for plain and grid steps) and "early" (the
mask as a bias built before the QK wgmma's wait), mode "always" (runs 1-2), ``pipeline``
(FA3's intra-warpgroup pipelining, run 3, templates named "+pipe"), ``rect_mask="rowcol"``
(run 4, "+rowcol": now the kernel's plain-step mask): ``benchmarks/NOTES.md#masked-steps``.
Run 5 is ``benchmarks/results/h200-masked-steps.json``.
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

T0 = time.time()
TEMPLATES = ["mgpu_q128_kv128_s2_hm", "mgpu_q64x2pp_kv64_s2_hm", "mgpu_q128_kv64_s2_hm"]
# (plan kind, mask_eval, mask mode)
VARIANTS = [("full", "none"), ("full", "cond"), ("plain", "cond"), ("rows", "cond"),
            ("grid", "cond"),
            ("bitmap", "cond")]


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def synthetic_plan(kind, L, H, tile_q, tile_kv, rng):
    """(units, steps, token [L, L] bool): every head's units visit every K/V tile once; all
    heads share the step rows; bitmap words follow the step rows (abi.BITMAP_FLAG)."""
    from pallas_kernels import abi

    nq, nk = L // tile_q, L // tile_kv
    S = nq * nk
    W = abi.bitmap_words(tile_kv)
    words_rows = (S * W * tile_q) // abi.STEP_COLS if kind == "bitmap" else 0
    steps = np.zeros((S + words_rows, abi.STEP_COLS), np.int32)
    flat = steps.reshape(-1)
    token = np.zeros((L, L), bool)
    r = np.arange(tile_q)[:, None]
    col = np.arange(tile_kv)[None, :]
    for t in range(nq):
        for c in range(nk):
            s = t * nk + c
            st = steps[s]
            st[abi.STEP_KV_START] = c * tile_kv
            if kind == "full":
                st[abi.STEP_RECT] = abi.pack_rect(0, tile_q, 0, tile_kv)
                m = np.ones((tile_q, tile_kv), bool)
            elif kind == "plain":
                st[abi.STEP_RECT] = abi.pack_rect(0, tile_q, 0, tile_kv - 1)
                m = np.broadcast_to(col < tile_kv - 1, (tile_q, tile_kv))
            elif kind == "rows":                       # partial rows, alternating halves
                lo, hi = (0, tile_q - 8) if c % 2 == 0 else (8, tile_q)
                st[abi.STEP_RECT] = abi.pack_rect(lo, hi, 0, tile_kv)
                m = np.broadcast_to((r >= lo) & (r < hi), (tile_q, tile_kv))
            elif kind == "grid":
                h, k = tile_q // 2, tile_kv // 2
                st[abi.STEP_RECT] = abi.pack_rect(0, tile_q, 0, tile_kv)
                st[abi.STEP_CUTS_A], st[abi.STEP_CUTS_B] = abi.pack_grid(
                    (h, tile_q, tile_q), (k, tile_kv, tile_kv), 1 | 1 << 5)
                m = (r < h) == (col < k)
            else:
                m = rng.random((tile_q, tile_kv)) < 0.5
                m[0, 0] = m[-1, -1] = True                   # the rectangle is the tile
                off = S * abi.STEP_COLS + s * W * tile_q
                st[abi.STEP_RECT] = abi.pack_rect(0, tile_q, 0, tile_kv)
                st[abi.STEP_CUTS_A], st[abi.STEP_CUTS_B] = off, abi.BITMAP_FLAG
                padded = np.zeros((tile_q, W * 32), bool)
                padded[:, :tile_kv] = m
                bits = padded.reshape(tile_q, W, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
                words = bits.sum(-1).astype(np.uint32).view(np.int32)     # [tile_q, W]
                flat[off: off + W * tile_q] = words.T.reshape(-1)
            token[t * tile_q:(t + 1) * tile_q, c * tile_kv:(c + 1) * tile_kv] = m
    units = np.zeros((H * nq, abi.UNIT_COLS), np.int32)
    for h in range(H):
        for t in range(nq):
            units[h * nq + t] = (h, t * tile_q, 0, tile_q, t * nk, nk)
    return units, steps, token


def reference(q, k, v, token, heads, scale):
    """float32 masked attention of ``heads`` (jnp, on the device)."""
    import jax.numpy as jnp

    outs = []
    for h in heads:
        qh, kh, vh = (x[0, :, h].astype(jnp.float32) for x in (q, k, v))
        s = (qh @ kh.T) * scale
        s = jnp.where(token, s, -jnp.inf)
        p = jnp.exp(s - s.max(-1, keepdims=True))
        outs.append((p / p.sum(-1, keepdims=True)) @ vh)
    return jnp.stack(outs, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--templates", default=",".join(TEMPLATES))
    ap.add_argument("--interpret", action="store_true", help="CPU: Mosaic GPU interpreter")
    ap.add_argument("--budget-s", type=float, default=540)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from pallas_kernels import abi
    from pallas_kernels import templates as T
    from pallas_kernels.mosaic import ops as mosaic_ops
    from tessera_jax.tools import timing

    interp = False
    if args.interpret:
        from jax._src.pallas.mosaic_gpu.interpret import params as _p
        interp = _p.InterpretGPUParams()
    L, H, D = args.L, args.heads, 128
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, L, H, D), jnp.float32).astype(dtype) for kk in keys)
    scale = D ** -0.5
    results = {"device": str(jax.devices()[0].device_kind), "L": L, "heads": H, "D": D,
               "rule": timing.KERNEL_RULE.to_json(), "rows": []}
    gpu = jax.devices()[0].platform == "gpu"
    if gpu:
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale,
                                                                     implementation="cudnn"))
        td = timing.time_kernel(dense, [(q, k, v)])
        results["dense_ms"] = td.ms
        log(f"cuDNN dense {td.ms:.3f} ms")
    rng = np.random.default_rng(1)
    plans = {}
    for name in args.templates.split(","):
        t = T.get(name)
        for kind, mode in VARIANTS:
            if time.time() - T0 > args.budget_s:
                log("budget reached")
                break
            key = (kind, t.tile_q, t.tile_kv)
            if key not in plans:
                plans[key] = synthetic_plan(kind, L, H, t.tile_q, t.tile_kv, rng)
            units, steps, token = plans[key]
            tv = t
            row = dict(template=name, kind=kind, mode=mode)
            try:
                # A trusted plan: all_full=True runs mode "none", False the template's.
                fn = jax.jit(lambda q, k, v, u, s, tv=tv, mode=mode: mosaic_ops.forward(
                    q, k, v, abi.PassPlan(u, s, None, tv.tile_q, tv.tile_kv, L, L, 0,
                                          mode == "none"),
                    template=tv, scale=scale, check_plan=False, interpret=interp))
                du, ds = jnp.asarray(units), jnp.asarray(steps)
                out = fn(q, k, v, du, ds)
                ref = reference(q, k, v, jnp.asarray(token), [0, H - 1], scale)
                got = out[0][:, [0, H - 1]].astype(jnp.float32)
                row["rel_err"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                row["ok"] = bool(row["rel_err"] < 2e-2)
                if gpu:
                    tm = timing.time_kernel(fn, [(q, k, v, du, ds)])
                    row["ms"] = tm.ms
                    row["rate"] = results["dense_ms"] / tm.ms
            except Exception as e:                            # keep going: record it
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(json.dumps(row))
            results["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
