#!/usr/bin/env python3
"""Gathered K/V steps (issue 31) against the tree's best plan and cuDNN dense, forward, host route.

Wan 480p (L 32,760, 12 heads, D 128, bf16), masks this project's tables never saw: variable
clusters (query clusters ~110 tokens, key clusters ~40, ~20% density, per-head selection),
64-token top-k cubes, sliding tiles over partial cubes, radial frames (frame-aligned) and
random 128-blocks at density 0.1 (aligned). Per mask: the ranking's choice (``default``), the
gather template with the ``gather`` policy, checked against the float32 reference on head 0,
timed with cuDNN dense in the same process under ``tools.timing.KERNEL_RULE``. ``efficiency``
= (selected interactions / time) / (dense interactions / cuDNN's time).

    python3 benchmarks/gather.py --out $OUT/h200-gather-fwd.json
    python3 benchmarks/gather.py --backward --masks clusters,cubes,sliding \
        --out $OUT/h200-gather-fwd-bwd.json            # forward + backward (jax.vjp)
    python3 benchmarks/gather.py --small --variants default   # CPU smoke run (L 1,024, XLA;
                                                              # Mosaic templates need a GPU)

With ``--backward`` every case is the forward + backward (the vjp of q, k, v for a random
cotangent) against cuDNN's forward + backward in the same process, its dq / dk / dv checked
against the reference's on head 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def mask_var_clusters(L, H, q_mean=110, kv_mean=40, density=0.2, seed=3, kv_len=None):
    """SVG2-like variable clusters (``gpu_check.cluster_parts``) of L queries and ``kv_len``
    (default L) keys, from ``seed``."""
    import tessera_jax as tj
    from tessera_jax.tools import gpu_check

    return tj.BlockMask(*gpu_check.cluster_parts(np.random.default_rng(seed), L, H, q_mean,
                                                 kv_mean, density, kv_len))


def masks(small: bool):
    import kernels as K

    if small:
        L, H, grid = 1024, 2, (2, 8, 64)
    else:
        L, H, grid = 32760, 12, (21, 30, 52)
    return L, H, [
        ("clusters", lambda: mask_var_clusters(L, H)),
        ("cubes", lambda: K.mask_cubes_topk(grid, H, 0.13, 2)),
        ("sliding", lambda: K.mask_sta(grid)),
        ("frame_aligned", lambda: K.mask_radial(grid)),
        ("aligned", lambda: K.mask_rand128(L, H, 0.1, 1)),
    ]


FAMILIES = "aligned,frame_aligned,sliding,cubes,clusters"


def grid_arguments(ap, families: str = FAMILIES):
    """The flags every Wan-grid diagnostic takes: --families (names, comma-separated),
    --small (a small grid, head_dim 64), --budget-s (no family starts past it) and --out."""
    ap.add_argument("--families", default=families)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--out")


class Grid(NamedTuple):
    """A diagnostic's grid (``grid``): L, heads, head_dim, the named families' (name, make)
    in ``masks`` order, the result file's header (``rows`` to fill) and the start time."""

    L: int
    H: int
    D: int
    families: list
    res: dict
    t0: float

    def within_budget(self, budget_s: float) -> bool:
        return time.time() - self.t0 <= budget_s


def grid(args, benchmark: str, **fields) -> Grid:
    """The grid of ``grid_arguments``' flags and a result header: benchmark, device, the
    kernel timing rule, L, heads, ``fields``."""
    import jax

    from tessera_jax.tools import timing

    t0 = time.time()
    L, H, fams = masks(args.small)
    names = args.families.split(",")
    res = {"benchmark": benchmark, "device": str(jax.devices()[0].device_kind),
           "rule": timing.KERNEL_RULE.to_json(), "L": L, "heads": H, **fields, "rows": []}
    return Grid(L, H, 128 if not args.small else 64, [f for f in fams if f[0] in names], res,
                t0)


def inputs(L: int, H: int, D: int):
    """q, k, v [1, L, H, D] bfloat16 from a fixed seed and the softmax scale: the inputs every
    Wan-grid benchmark of this family times and checks."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, L, H, D), jnp.float32).astype(jnp.bfloat16) for x in ks)
    return q, k, v, D ** -0.5


def cudnn_ms(q, k, v, scale, timed=None) -> float:
    """cuDNN dense attention's time under ``timing.KERNEL_RULE`` (``timed``: how the attention
    is wrapped before timing, default ``jax.jit``)."""
    import jax

    from tessera_jax.tools import timing

    dense = (timed or jax.jit)(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, implementation="cudnn"))
    return timing.time_kernel(dense, [(q, k, v)]).ms


def per_head(mask, H: int):
    """A shared-bounds mask's (blocks, q_bounds, kv_bounds) as per-head jax arrays [H, ...]:
    every head the shared partition."""
    import jax.numpy as jnp

    qb, kb, b = (np.asarray(x) for x in (mask.q_bounds, mask.kv_bounds, mask.blocks))
    return (jnp.asarray(np.broadcast_to(b, (H,) + b.shape[1:])),
            jnp.asarray(np.broadcast_to(qb, (H, len(qb))).copy()),
            jnp.asarray(np.broadcast_to(kb, (H, len(kb))).copy()))


# The paired 64-row and 32-key-run templates of results/h200-gather-fwd.json (commit f5463ea)
# were deleted: never the best on any mask (benchmarks/NOTES.md#gathered-steps).
VARIANTS = {"default": (None, None), "gather": ("mgpu_q128_kv128_s2_gather", "gather"),
            # The same template on the device route: the selection a traced argument (a
            # device mask, bounds static), planned inside the program.
            "gather_device": ("mgpu_q128_kv128_s2_gather", None),
            # Warpgroup skipping on gathered steps (a class's rows in one 64-row half run on
            # that half's warpgroup), without the ping-pong barrier.
            "gather_skip_nopp": ("mgpu_q128_kv128_s2_gather_skip_nopp", "gather")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--budget-s", type=float, default=520)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--masks", default=None, help="comma-separated subset of the mask names")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="head dim (default 128; 64 with --small)")
    ap.add_argument("--backward", action="store_true",
                    help="time forward + backward (vjp of q, k, v) instead of the forward")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.tools import timing

    L, H, cases = masks(args.small)
    D = args.head_dim or (128 if not args.small else 64)
    q, k, v, scale = inputs(L, H, D)
    gpu = jax.devices()[0].platform == "gpu"
    opts = tj.Options(interpret=True) if args.interpret else None
    res = {"device": str(jax.devices()[0].device_kind), "L": L, "heads": H, "D": D,
           "jax": jax.__version__, "rule": timing.KERNEL_RULE.to_json(), "rows": []}
    do = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(q.dtype)
    res["pass"] = "forward+backward" if args.backward else "forward"

    def timed(attn):
        """The timed function of an attention ``attn(q, k, v)``: itself, or with
        ``--backward`` its forward and the vjp of (q, k, v) for ``do``."""
        if not args.backward:
            return jax.jit(attn)
        return jax.jit(lambda q, k, v, *extra: jax.vjp(
            lambda q, k, v: attn(q, k, v, *extra), q, k, v)[1](do))

    if gpu:
        res["dense_ms"] = cudnn_ms(q, k, v, scale, timed)
        log(f"cuDNN dense {res['dense_ms']:.3f} ms")
    want = set(args.masks.split(",")) if args.masks else None
    variants = [(v, *VARIANTS[v]) for v in args.variants.split(",")]
    for name, make in cases:
        if want is not None and name not in want:
            continue
        m = make()
        m0 = tj.BlockMask(m.q_bounds, m.kv_bounds, np.asarray(m.blocks)[:1])
        h0 = [x[:, :, :1].astype(jnp.float32) for x in (q, k, v)]
        ref_fn = lambda q, k, v: tj.reference_attention(q, k, v, m0, scale=scale)  # noqa: E731
        ref = (jax.vjp(ref_fn, *h0)[1](do[:, :, :1].astype(jnp.float32)) if args.backward
               else [ref_fn(*h0)])
        for var, template, policy in variants:
            if time.time() - T0 > args.budget_s:
                log("budget reached")
                break
            row = {"mask": name, "variant": var}
            try:
                p = tj.plan(m, q.shape, k.shape, q.dtype, template=template, policy=policy,
                            options=opts)
                s = p.stats()
                row.update(template=p.template, policy=p.policy,
                           computed_over_selected=s["computed_interactions"]
                           / s["selected_interactions"],
                           selected_fraction=s["selected_interactions"] / s["dense_interactions"],
                           gather_steps=s["gather_steps"], tiles=s["tiles"])
                if var.endswith("_device"):
                    qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
                    fn = timed(lambda q, k, v, b, t=template: tj.sparse_attention(
                        q, k, v, tj.BlockMask(qb, kb, b), scale=scale, template=t,
                        options=opts))
                    call = (q, k, v, jnp.asarray(m.blocks))
                else:
                    fn = timed(lambda q, k, v, t=template, po=policy: tj.sparse_attention(
                        q, k, v, m, scale=scale, template=t, policy=po, options=opts))
                    call = (q, k, v)
                out = fn(*call)
                got = out if args.backward else [out]
                # Relative to the largest reference entry (gradients are not O(1)).
                row["max_err"] = max(
                    float(jnp.abs(g[:, :, :1].astype(jnp.float32) - r).max()
                          / max(float(jnp.abs(r).max()), 1e-6)) for g, r in zip(got, ref))
                row["ok"] = bool(row["max_err"] < 3e-2)
                if gpu:
                    row["ms"] = timing.time_kernel(fn, [call]).ms
                    row["efficiency"] = row["selected_fraction"] * res["dense_ms"] / row["ms"]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(json.dumps(row))
            res["rows"].append(row)
    eff = {}
    for r in res["rows"]:
        if "efficiency" in r and r.get("ok"):
            key = f"efficiency_{r['mask']}_{r['variant']}"
            eff[key] = r["efficiency"]
    ms = {(r["mask"], r["variant"]): r["ms"] for r in res["rows"] if r.get("ok") and "ms" in r}
    ratios = [ms[(mk, "gather_device")] / ms[(mk, "gather")] for mk, var in ms
              if var == "gather_device" and (mk, "gather") in ms]
    if ratios:
        eff["device_vs_host_max"] = max(ratios)
    res["summary"] = eff
    log(json.dumps(eff))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
