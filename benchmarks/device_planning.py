#!/usr/bin/env python3
"""Issue 16 on the GPU: device masks checked in bf16, and device planning against host planning.

1. Checks (bf16 against ``tj.reference_attention``'s float32, relative max error): a mask
   computed from q and k inside ``jax.jit`` (pooled scores, per-head top-k, L = 4096) through
   ``tj.sparse_attention``; per-head traced bounds (variable clusters >= 48 tokens); 8-token
   blocks (the exact path). Traces counted over three masks.
2. Per corpus family, one train spec at Wan 720p and at HunyuanVideo 720p (40 query heads; a
   per-head mask of fewer heads is repeated to 40), D = 128:
   - ``host_plan_ms``: ``tj.plan`` of a new mask (caches cleared), host wall clock, median;
   - ``device_plan_ms``: ``planning.device.plan_on_device`` (blocks traced, bounds static),
     CUPTI kernel time under the kernel rule, and ``device_plan_wall_ms`` (call to result);
   - ``fits``: whether a device template's plan holds the mask (``device_template``; else the
     exact path, not timed here);
   - ``device_route_ms``: the whole device-route call (plan + kernel in one program; the
     best of the Mosaic device templates that hold the mask, each in
     ``device_route_ms_by_template``), on the same mask as
     ``host_kernel_ms`` (the host plan's kernel, the mask a static constant); also
     ``device_route_alternating_ms_by_template``, alternating with a column-permuted mask
     (new masks, one program; until session 12 this was device_route_ms); cuDNN dense
     ``dense_ms``: all under the kernel rule, same process.

    python3 benchmarks/device_planning.py --out $OUT/h200-device-planning.json --budget-s 500

With ``--route-grids wan720`` the other grids get planning times only (the kernels cost most).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import numpy as np

T0 = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))


def checks(res):
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj

    rng = np.random.default_rng(16)
    L, Hq, Hkv, D, POOL, KEEP = 4096, 8, 4, 128, 64, 8
    bounds = np.arange(0, L + 1, POOL)

    def topk_blocks(q, k):
        pq = q[0].astype(jnp.float32).reshape(L // POOL, POOL, Hq, D).mean(1)
        pk = jnp.repeat(k[0].astype(jnp.float32).reshape(L // POOL, POOL, Hkv, D).mean(1),
                        Hq // Hkv, axis=1)
        _, idx = jax.lax.top_k(jnp.einsum("ihd,jhd->hij", pq, pk), KEEP)
        n = L // POOL
        return jnp.zeros((Hq, n, n), bool).at[jnp.arange(Hq)[:, None, None],
                                              jnp.arange(n)[None, :, None], idx].set(True)

    traces = []

    @jax.jit
    def layer(q, k, v):
        traces.append(1)
        return tj.sparse_attention(q, k, v, tj.BlockMask(bounds, bounds, topk_blocks(q, k)))

    def qkv(seed, Lq=L, Lkv=L):
        r = np.random.default_rng(seed)
        return (jnp.asarray(r.standard_normal((1, Lq, Hq, D)), jnp.bfloat16),
                jnp.asarray(r.standard_normal((1, Lkv, Hkv, D)), jnp.bfloat16),
                jnp.asarray(r.standard_normal((1, Lkv, Hkv, D)), jnp.bfloat16))

    errs = []
    for seed in range(3):
        q, k, v = qkv(seed)
        blocks = np.asarray(jax.jit(topk_blocks)(q, k))
        ref = tj.reference_attention(q, k, v, tj.BlockMask(bounds, bounds, blocks))
        errs.append(rel_err(layer(q, k, v), ref))
    text = layer.lower(q, k, v).as_text().lower()
    res["checks"].append(dict(name="topk_in_jit_bf16", rel_err_max=max(errs), traces=len(traces),
                              host_callback="callback" in text, ok=max(errs) < 2e-2
                              and len(traces) == 1 and "callback" not in text))

    # Per-head traced bounds (clusters of >= 48 tokens, each head its own order).
    sizes = rng.integers(48, 400, size=200)
    sizes = sizes[np.cumsum(sizes) < L]
    sizes = np.r_[sizes, L - sizes.sum()] if L - sizes.sum() >= 48 else \
        np.r_[sizes[:-1], L - sizes[:-1].sum()]
    qb = np.stack([np.r_[0, np.cumsum(rng.permutation(sizes))] for _ in range(Hq)])
    blocks = rng.random((Hq, len(sizes), len(sizes))) < 0.2
    f = jax.jit(lambda q, k, v, m: tj.sparse_attention(q, k, v, m))
    q, k, v = qkv(7)
    out = f(q, k, v, tj.BlockMask(jnp.asarray(qb), jnp.asarray(qb), jnp.asarray(blocks)))
    e = rel_err(out, tj.reference_attention(q, k, v, tj.BlockMask(qb, qb, blocks)))
    res["checks"].append(dict(name="per_head_traced_bounds_bf16", rel_err_max=e, ok=e < 2e-2))

    # 8-token blocks: a tile meets 16 blocks, the exact path.
    L8 = 2048
    b8 = np.arange(0, L8 + 1, 8)
    blocks8 = rng.random((1, L8 // 8, L8 // 8)) < 0.2
    q, k, v = qkv(8, L8, L8)
    out = f(q, k, v, tj.BlockMask(jnp.asarray(b8), jnp.asarray(b8), jnp.asarray(blocks8)))
    e = rel_err(out, tj.reference_attention(q, k, v, tj.BlockMask(b8, b8, blocks8)))
    res["checks"].append(dict(name="token8_exact_path_bf16", rel_err_max=e, ok=e < 2e-2))
    for c in res["checks"]:
        log("check", c)


def family_masks(grids, heads):
    from tessera_jax.masks import corpus
    from tessera_jax.masks.corpus import build
    from tessera_jax.masks.families import FAMILIES
    import tessera_jax as tj
    specs = corpus("train")
    for fam in FAMILIES:          # family-major: a budget cut keeps both grids of each family
        for grid in grids:
            spec = next((s for s in specs if s["family"] == fam and s["grid"] == grid
                         and s.get("step", 0) == 0), None)
            if spec is None:
                continue
            m = build(spec)
            if m.num_heads not in (1, heads):
                reps = -(-heads // m.num_heads)
                m = tj.BlockMask(m.q_bounds, m.kv_bounds,
                                 np.concatenate([m.blocks] * reps)[:heads])
            yield grid, fam, spec["id"], m


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--grids", default="wan720,hy720")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--families", default=None)
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--host-repeats", type=int, default=3)
    ap.add_argument("--route-grids", default=None,
                    help="grids whose device-route and host-kernel times are measured (default: all;"
                         " the others get planning times only)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.planning import device
    from tessera_jax.tools import timing

    rule = timing.KERNEL_RULE
    res = dict(command=" ".join(sys.argv), env=dict(
        python=platform.python_version(), jax=jax.__version__,
        device_kind=jax.devices()[0].device_kind), rule=rule.to_json(), checks=[], rows=[])

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=float)

    if not args.no_checks:
        try:
            checks(res)
        except Exception as e:                                  # noqa: BLE001
            traceback.print_exc()
            res["checks"].append(dict(name="checks", error=repr(e), ok=False))
        save()

    H, D = args.heads, 128
    fams = set(args.families.split(",")) if args.families else None
    dense_cache = {}
    for grid, fam, sid, m in family_masks(args.grids.split(","), H):
        if fams and fam not in fams:
            continue
        if time.time() - T0 > args.budget_s:
            log("budget reached")
            break
        row = dict(grid=grid, family=fam, spec=sid, Lq=m.Lq, Lkv=m.Lkv, heads=H,
                   mask_heads=m.num_heads, blocks=list(m.shape), density=m.density)
        try:
            Lq, Lkv = m.Lq, m.Lkv
            qs, ks = (1, Lq, H, D), (1, Lkv, H, D)
            host_ms = []
            for _ in range(args.host_repeats):
                tj.clear_caches()
                t0 = time.perf_counter()
                p = tj.plan(m, qs, ks, jnp.bfloat16)
                host_ms.append((time.perf_counter() - t0) * 1e3)
            row.update(host_plan_ms=float(np.median(host_ms)), host_template=p.template,
                       host_policy=p.stats().get("policy"))

            qb = np.asarray(m.q_bounds, np.int32)
            kb = np.asarray(m.kv_bounds, np.int32)
            from tessera_jax import select
            from tessera_jax.runtime import device_route
            from tessera_jax.validation import check_shapes
            dev_t, cap = select.choose("device", tj.BlockMask(qb, kb, jnp.asarray(m.blocks)),
                                       check_shapes(qs, ks, jnp.bfloat16), "mosaic_gpu")
            row["bitmap_capacity"] = int(cap)
            fits = dev_t is not None
            row.update(fits=fits, device_template=dev_t.name if fits else "exact path")
            rng = np.random.default_rng(0)
            variants = [jnp.asarray(np.asarray(m.blocks))]
            variants.append(jnp.asarray(rng.permutation(np.asarray(m.blocks), axis=-1)))
            if fits:
                planf = jax.jit(lambda b: device.plan_on_device(
                    b, qb, kb, num_q_heads=H, q_len=Lq, kv_len=Lkv, tile_q=dev_t.tile_q,
                    tile_kv=dev_t.tile_kv, bitmap_capacity=cap))
                t = timing.time_kernel(planf, [(b,) for b in variants], rule=rule)
                row["device_plan_ms"] = t.ms
                jax.block_until_ready(planf(variants[0]))
                walls = []
                for i in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(planf(variants[i % 2]))
                    walls.append((time.perf_counter() - t0) * 1e3)
                row["device_plan_wall_ms"] = float(np.median(walls))

            if args.route_grids and grid not in args.route_grids.split(","):
                res["rows"].append(row)
                log(row)
                save()
                continue
            r = np.random.default_rng(1)
            q = jnp.asarray(r.standard_normal(qs), jnp.bfloat16)
            k = jnp.asarray(r.standard_normal(ks), jnp.bfloat16)
            v = jnp.asarray(r.standard_normal(ks), jnp.bfloat16)
            shape = check_shapes(qs, ks, jnp.bfloat16)
            for name in select.device.DEVICE_TEMPLATES["mosaic_gpu"]:
                t = tj.runtime.dispatch.get_template(name)
                if device_route.choose(tj.BlockMask(qb, kb, variants[0][:1]), shape,
                                       "mosaic_gpu", t) is None:
                    continue
                route = jax.jit(lambda q, k, v, b, name=name: tj.sparse_attention(
                    q, k, v, tj.BlockMask(qb, kb, b), template=name))
                # The mask the host kernel runs (a like-for-like ratio), then alternating with
                # the column-permuted one (new masks, no retrace; that one plans differently).
                row.setdefault("device_route_ms_by_template", {})[name] = timing.time_kernel(
                    route, [(q, k, v, variants[0])], rule=rule).ms
                row.setdefault("device_route_alternating_ms_by_template", {})[name] = \
                    timing.time_kernel(route, [(q, k, v, b) for b in variants], rule=rule).ms
            if row.get("device_route_ms_by_template"):
                row["device_route_ms"] = min(row["device_route_ms_by_template"].values())
            host = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, m))
            row["host_kernel_ms"] = timing.time_kernel(host, [(q, k, v)], rule=rule).ms
            key = (Lq, Lkv)
            if key not in dense_cache:
                dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, implementation="cudnn"))
                dense_cache[key] = timing.time_kernel(dense, [(q, k, v)], rule=rule).ms
            row["dense_ms"] = dense_cache[key]
            del q, k, v
        except Exception as e:                                   # noqa: BLE001
            traceback.print_exc()
            row["error"] = repr(e)[:500]
        res["rows"].append(row)
        log(row)
        save()

    ok_rows = [r for r in res["rows"] if "host_plan_ms" in r]
    res["summary"] = dict(
        checks_pass=f"{sum(bool(c.get('ok')) for c in res['checks'])}/{len(res['checks'])}",
        device_plan_ms_max=max((r["device_plan_ms"] for r in ok_rows if "device_plan_ms" in r),
                               default=None),
        host_plan_ms_median=float(np.median([r["host_plan_ms"] for r in ok_rows]))
        if ok_rows else None,
        fits=f"{sum(bool(r.get('fits')) for r in ok_rows)}/{len(ok_rows)}",
        device_route_over_host_kernel={f"{r['grid']}/{r['family']}": r["device_route_ms"]
                                       / r["host_kernel_ms"]
                                       for r in ok_rows if "device_route_ms" in r})
    log("summary", res["summary"])
    save()


if __name__ == "__main__":
    main()
