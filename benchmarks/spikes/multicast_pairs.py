#!/usr/bin/env python3
"""Spike (issue 31): K/V tiles multicast to a pair of CTAs, so 64-row units stop paying twice
the L2 bytes per FLOP of 128-row units.

Paired 64-row units (each consumer warpgroup its own unit and K/V stream) top out at ~0.93 of
cuDNN on dense work with one plain copy per stage (``h200-split-rings.json``: a deeper K ring
changes nothing), ~10 TB/s from L2 into the SMs. This spike runs the library's forward kernel
in clusters of two CTAs (``plgpu.kernel(cluster=(2, 1))``): both CTAs of a cluster hold units
of one head that visit the same K/V tiles in the same order (dense work), and each tile is
copied once per cluster (``copy_gmem_to_smem(..., collective_axes="cluster")``: each CTA loads
half of the tile and multicasts it to both), a slot freed only when the consumers of both CTAs
released it (``plgpu.ClusterBarrier``). The kernel is the library's source with textual
patches (a spike: nothing of it stays).

Predicted: if L2's output is what limits paired units, paired kv128 0.93 -> ~0.97 and paired
kv64 0.80 -> ~0.85 of cuDNN; if it is each SM's port from L2, no change. Kill: paired kv128
with multicast below 0.96 of cuDNN. Only if it passes: a CTA pair's merged step lists (shared
tiles multicast, the rest per CTA) for cubes (benchmarks/NOTES.md#open).

    python3 benchmarks/spikes/multicast_pairs.py --out $OUT/h200-multicast-spike.json
    python3 benchmarks/spikes/multicast_pairs.py --lower-only    # CPU: cross-lowers every variant
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


PATCHES = [
    # Clusters of two CTAs along the unit axis.
    ('''        grid=(-(-U // 2) if cfg.paired else U, B),
        grid_names=("unit", "batch"),''',
     '''        grid=(-(-(-(-U // 2) if cfg.paired else U) // 2), B),
        grid_names=("unit", "batch"),
        cluster=(2, 1),
        cluster_names=("cluster", "cluster_b"),'''),
    # The CTA's index: its cluster's and its place in it.
    ('''        u = lax.axis_index("unit") * 2 + ring''',
     '''        u = (lax.axis_index("unit") * 2 + lax.axis_index("cluster")) * 2 + ring'''),
    ('''        w = lax.axis_index("unit") * c.batch + lax.axis_index("batch")''',
     '''        w = ((lax.axis_index("unit") * 2 + lax.axis_index("cluster")) * c.batch
             + lax.axis_index("batch"))'''),
    # A slot is free once the consumers of both CTAs released it (each CTA's copy writes half
    # the tile into both CTAs' slots).
    ('''            (plgpu.Barrier(num_arrivals=1 if cfg.paired else nwg, num_barriers=slots),) * 2,''',
     '''            (plgpu.ClusterBarrier(collective_axes=("cluster",),
                                  num_arrivals=1 if cfg.paired else nwg,
                                  num_barriers=slots),) * 2,'''),
    # Each tile copied once per cluster: each CTA loads half and multicasts it.
    ('''    plgpu.copy_gmem_to_smem(c.k.at[src], c.k_smem.at[slot], c.k_bar.at[slot])''',
     '''    plgpu.copy_gmem_to_smem(c.k.at[src], c.k_smem.at[slot], c.k_bar.at[slot],
                            collective_axes="cluster")'''),
    ('''    plgpu.copy_gmem_to_smem(c.v.at[src], c.v_smem.at[slot], c.v_bar.at[slot])''',
     '''    plgpu.copy_gmem_to_smem(c.v.at[src], c.v_smem.at[slot], c.v_bar.at[slot],
                            collective_axes="cluster")'''),
]


def multicast_module():
    """pallas_kernels.mosaic.kernel in clusters of two CTAs with multicast K/V copies."""
    src = open(os.path.join(ROOT, "pallas_kernels", "mosaic", "kernel.py")).read()
    for old, new in PATCHES:
        assert src.count(old) == 1, old[:70]
        src = src.replace(old, new)
    mod = types.ModuleType("multicast_spike")
    sys.modules[mod.__name__] = mod          # dataclasses look the module up
    exec(compile(src, "<multicast spike>", "exec"), mod.__dict__)
    return mod


def variants():
    """(name, template, multicast)."""
    from pallas_kernels import templates as T

    q128, pp64 = T.get("mgpu_q128_kv128_s2_hm"), T.get("mgpu_q64x2pp_kv64_s2_hm")
    pp128 = dataclasses.replace(pp64, name="spike_q64x2pp_kv128_s1", tile_kv=128, stages=1)
    out = []
    for name, t in (("q64x2pp_kv128_s1", pp128), ("q64x2pp_kv64_s2", pp64),
                    ("q128_kv128_s2", q128)):
        out += [(f"{name} one copy", t, False), (f"{name} multicast x2", t, True)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--lower-only", action="store_true",
                    help="cross-lower every variant for CUDA (this machine needs no GPU)")
    ap.add_argument("--budget-s", type=float, default=300)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from pallas_kernels.mosaic import kernel as plain
    from paired_gather import check_and_time, dense_plan
    from tessera_jax.tools import timing

    mods = {False: plain, True: multicast_module()}
    L, H, D = args.L, args.heads, 128
    scale = D ** -0.5
    res = {"device": str(jax.devices()[0].device_kind), "L": L, "heads": H, "D": D,
           "rule": timing.KERNEL_RULE.to_json(), "jax": jax.__version__, "rows": []}
    gpu = jax.devices()[0].platform == "gpu"
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, L, H, D), jnp.float32).astype(jnp.bfloat16) for x in ks)
    if gpu:
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, implementation="cudnn"))
        res["dense_ms"] = timing.time_kernel(dense, [(q, k, v)]).ms
        log(f"cuDNN dense {res['dense_ms']:.3f} ms")
    rng = np.random.default_rng(1)
    for name, t, mc in variants():
        if time.time() - T0 > args.budget_s:
            log("budget reached")
            break
        row = dict(variant=name, template=t.name, multicast=mc)
        try:
            mk = mods[mc]
            cfg = mk.KernelConfig.from_template(t, "none")
            units, steps, key_index = dense_plan(L, H, t.tile_q, t.tile_kv, False, rng, False)
            # Units of one head come in runs of 4 (paired) / 2 per cluster: same K/V tiles.
            assert (L // t.tile_q) % (4 if t.tile_q == 64 else 2) == 0
            fn = jax.jit(lambda q, k, v, u, s, mk=mk, cfg=cfg: mk.forward(
                q, k, v, u, s, cfg=cfg, scale=scale)[0])
            du, ds = jnp.asarray(units), jnp.asarray(steps)
            if args.lower_only or not gpu:
                txt = fn.trace(q, k, v, du, ds).lower(lowering_platforms=("cuda",)).as_text()
                row["lowered"] = "mosaic_gpu" in txt
            else:
                check_and_time(row, fn, (q, k, v, du, ds), key_index, scale, res["dense_ms"])
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        log(json.dumps(row))
        res["rows"].append(row)
    rates = {r["variant"]: r.get("rate") for r in res["rows"] if r.get("ok")}
    mc = rates.get("q64x2pp_kv128_s1 multicast x2")
    res["summary"] = {"rates": rates, "paired_kv128_multicast_rate": mc,
                      "kill": None if mc is None else mc < 0.96}
    log(json.dumps(res["summary"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
