#!/usr/bin/env python3
"""Forward+backward of sparse attention on the GPU (issue 18): ours against cuDNN dense and
torch FlexAttention, gradient errors, and a Wan2.1-1.3B 480p training step sparse vs dense.

1. Kernels, Wan2.1 480p (L = 32,760, 12 heads, D = 128, bf16, B = 1), per mask (128-aligned
   random at densities 0.1 / 0.25 / 0.5; irregular: VSA-like per-head top-k 64-token cubes,
   sliding tiles over cubes, variable clusters; ``kernels.py``'s generators): the jitted
   ``jax.vjp`` of ``tj.sparse_attention`` (backend=None: Mosaic GPU on an H200; out, dq, dk,
   dv for a random cotangent), cuDNN dense (``jax.nn.dot_product_attention``, same call) and
   FlexAttention (compiled, same mask, 128 blocks; forward + ``torch.autograd.grad``), all
   timed under ``timing.KERNEL_RULE`` (CUPTI kernel time, L2 flushed, median of 20).
   Forward+backward FLOPs = 3.5 x the forward FLOPs of the selected work (4 D per selected
   interaction, DESIGN.md); efficiency = our effective TFLOP/s / cuDNN dense's.
2. Gradient error: bf16 gradients of ours against a float32 dense reference
   (``tj.reference_attention``'s autodiff) at a size the reference fits (``--err-grid``),
   the same mask families; rel. error = ||g - g_ref|| / ||g_ref||, max over dq, dk, dv.
3. Training step, Wan2.1-1.3B (30 layers; ``--layers``) at 480p, random weights, bf16
   parameters, flow-matching MSE, optax AdamW: the jitted step with a VSA-like mask of
   density 0.125 in every layer (tokens in cube-major order, ``token_order``) against the
   dense model (cuDNN); step time (median of ``--steps``) and peak memory (the compiled
   step's memory analysis: arguments + outputs + temporaries - aliases, state donated; and
   the device's peak_bytes_in_use after each when available). Wall clock per step (one
   executable, host-dispatched: the same rule for both).

Summary (``h200-backward.json``): fwd_bwd_efficiency_aligned_min, fwd_bwd_speedup_vs_flex_
irregular_geomean, grad_rel_err_max, train_step_speedup_vs_dense_wan13b_480p,
train_step_peak_memory_vs_dense.

    PYTHONPATH=. python3 benchmarks/backward.py --out $OUT/h200-backward.json
    PYTHONPATH=. python3 benchmarks/backward.py --dry-run          # CPU: tiny, XLA, no torch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tessera_jax.tools import timing  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# --- masks -----------------------------------------------------------------------------------
def bench_masks(grid, H, L, seed=0, aligned=(0.1, 0.25, 0.5)):
    """[(name, family, thunk)]: the kernel benchmark's generators (``kernels.py``)."""
    import kernels as K
    out = [(f"rand128_d{d}", "aligned", lambda d=d: K.mask_rand128(L, H, d, seed + 1))
           for d in aligned]
    out += [("cubes64_topk", "irregular", lambda: K.mask_cubes_topk(grid, H, 0.13, seed + 2)),
            ("sta_cubes", "irregular", lambda: K.mask_sta(grid)),
            ("clusters_var", "irregular", lambda: K.mask_clusters(L, H, 0.18, seed + 3))]
    return out


def cube_order(grid, cube=(4, 4, 4)):
    """The permutation of raster (t, h, w) tokens into ``kernels.cube_layout``'s cube-major
    order (the order its masks' blocks refer to)."""
    T, Hh, W = grid
    idx = np.arange(T * Hh * W).reshape(T, Hh, W)
    parts = []
    for a in range(0, T, cube[0]):
        for b in range(0, Hh, cube[1]):
            for c in range(0, W, cube[2]):
                parts.append(idx[a:a + cube[0], b:b + cube[1], c:c + cube[2]].reshape(-1))
    return np.concatenate(parts)


# --- 1. forward + backward -------------------------------------------------------------------
#: (name, Options.dkv_policies, Options.paired_dkv_policy) forced in the controls of the dk/dv
#: plan's pick.
DKV_CONTROLS = (("merge128", ("merge",), None), ("pack128", ("pack",), None),
                ("paired64_pack", (), "pack"))


def fwd_bwd_fns(mask, backend, dense_impl, options=None):
    """(ours, dense): jitted (q, k, v, do) -> (out, dq, dk, dv)."""
    import jax
    import tessera_jax as tj

    def vjp_of(f):
        def run(q, k, v, do):
            out, vjp = jax.vjp(f, q, k, v)
            return (out,) + vjp(do)
        return jax.jit(run)

    ours = vjp_of(lambda q, k, v: tj.sparse_attention(q, k, v, mask, backend=backend,
                                                       options=options))
    dense = vjp_of(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation=dense_impl))
    return ours, dense


def flex_fwd_bwd(mask, L, H, D):
    """FlexAttention forward + backward (torch.autograd.grad) over ``mask``, and its block-mask
    build time (``kernels.flex_setup``)."""
    import torch
    import kernels as K
    fa, build_ms, how = K.flex_setup(mask, L, H, D)

    def run(q, k, v, do):
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        out = fa(q, k, v)
        return (out,) + torch.autograd.grad(out, (q, k, v), do)
    return run, build_ms, how


def inputs(key, B, L, H, D, dtype, n_sets):
    import jax
    import jax.numpy as jnp
    sets = []
    for i in range(n_sets):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        sets.append(tuple(jax.random.normal(k_, (B, L, H, D), jnp.float32).astype(dtype)
                          for k_ in ks))
    return sets


def kernels_section(res, args, rule):
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    L, H, D, dtype = args.L, args.heads, args.head_dim, jnp.dtype(args.dtype)
    sets = inputs(jax.random.key(0), 1, L, H, D, dtype, 2)
    dense_flops = 3.5 * 4 * D * L * L * H
    rows = res.setdefault("fwd_bwd", [])
    dense_t = None
    for name, family, make in bench_masks(tuple(args.grid), H, L, args.seed):
        if time.time() > args.deadline:
            log("budget spent: stopping the kernel section")
            break
        mask = make()
        row = dict(mask=name, family=family, density=mask.density,
                   selected=mask.selected_interactions(H))
        try:
            row["template"] = tj.plan(mask, (1, L, H, D), (1, L, H, D), dtype,
                                      backend=args.backend).template
        except Exception as e:  # noqa: BLE001
            row["template"] = repr(e)[:200]
        if row["selected"] == 0:                  # tiny dry-run grids: nothing to time
            continue
        try:
            ours, dense = fwd_bwd_fns(mask, args.backend, args.dense_impl)
            if dense_t is None:
                dense_t = timing.time_kernel(dense, sets, rule=rule)
                res["dense_fwd_bwd"] = dict(**dense_t.to_json(), tflops=dense_flops
                                            / dense_t.ms / 1e9, implementation=args.dense_impl)
                log("dense fwd+bwd", f"{dense_t.ms:.3f} ms",
                    f"{dense_flops / dense_t.ms / 1e9:.0f} TFLOP/s")
            t = timing.time_kernel(ours, sets, rule=rule)
            fwd = jax.jit(lambda q, k, v, do: tj.sparse_attention(q, k, v, mask,
                                                                  backend=args.backend))
            tfw = timing.time_kernel(fwd, sets, rule=rule)
            row["ours_fwd"] = dict(**tfw.to_json(), tflops=4 * D * row["selected"] / tfw.ms / 1e9)
            if args.dkv_controls and row["family"] == "irregular":
                # The same call with each dk/dv plan choice forced (the controls of the pick).
                from tessera_jax.runtime import host_plans

                def dkv_pick(opts):     # (tile_q, policy) of the dk/dv plan under the options
                    tp = host_plans.dkv_plan(tj.plan(mask, (1, L, H, D), (1, L, H, D), dtype,
                                                     backend=args.backend), options=opts)
                    return tp.tile_q, tp.policy

                row["dkv_pick"] = pick = dkv_pick(tj.Options())
                for cname, pols, paired in DKV_CONTROLS:
                    opts = tj.Options(dkv_policies=pols, paired_dkv_policy=paired)
                    if dkv_pick(opts) == pick:          # the pick itself: timed above
                        row.setdefault("dkv_controls", {})[cname] = dict(
                            **t.to_json(), same_as_ours=True)
                        continue
                    ctl, _ = fwd_bwd_fns(mask, args.backend, args.dense_impl, opts)
                    tc = timing.time_kernel(ctl, sets, rule=rule)
                    row.setdefault("dkv_controls", {})[cname] = tc.to_json()
                    log(name, f"ours, dk/dv {cname}", f"{tc.ms:.3f} ms")
            flops = 3.5 * 4 * D * row["selected"]
            row.update(ours=dict(**t.to_json(), tflops=flops / t.ms / 1e9),
                       efficiency=(flops / t.ms) / (dense_flops / dense_t.ms))
            log(name, "ours", f"{t.ms:.3f} ms", f"eff {row['efficiency']:.2f}")
            if args.flex:
                import torch
                fx, build_ms, how = flex_fwd_bwd(mask, L, H, D)
                tsets = [[torch.from_dlpack(x).permute(0, 2, 1, 3).contiguous() for x in s]
                         for s in sets]
                tf = timing.time_kernel(fx, tsets, rule=rule, framework="torch")
                row["flex"] = dict(**tf.to_json(), tflops=flops / tf.ms / 1e9,
                                   block_mask_ms=build_ms, block_mask_how=how)
                row["speedup_vs_flex"] = tf.ms / t.ms
                log(name, "flex", f"{tf.ms:.3f} ms", f"ours {row['speedup_vs_flex']:.2f}x",
                    f"(ours fwd {tfw.ms:.3f} ms)")
                del fx, tsets
                torch.cuda.empty_cache()        # torch's cache would starve the training step
        except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(name, "FAILED", row["error"][:300])
            traceback.print_exc()
        rows.append(row)


# --- 2. gradient error -----------------------------------------------------------------------
def grad_error_section(res, args):
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    grid = tuple(args.err_grid)
    L, H, D = int(np.prod(grid)), args.err_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    q, k, v, do = inputs(jax.random.key(1), 1, L, H, D, jnp.float32, 1)[0]
    rows = res.setdefault("grad_error", [])
    for name, family, make in bench_masks(grid, H, L, args.seed):
        mask = make()
        try:
            def g(f, *xs):
                return jax.vjp(f, *xs[:3])[1](xs[3])
            ref = jax.jit(lambda *x: g(lambda q, k, v: tj.reference_attention(q, k, v, mask),
                                       *x))(q, k, v, do)
            low = [x.astype(dtype) for x in (q, k, v, do)]
            got = jax.jit(lambda *x: g(lambda q, k, v: tj.sparse_attention(
                q, k, v, mask, backend=args.backend), *x))(*low)
            if mask.selected_interactions(H) == 0:
                continue
            errs = [float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
                    for a, b in zip(got, ref)]
            rows.append(dict(mask=name, family=family, L=L, heads=H, dq=errs[0], dk=errs[1],
                             dv=errs[2]))
            log(name, "grad rel err", " ".join(f"{e:.2e}" for e in errs))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(mask=name, error=f"{type(e).__name__}: {e}"[:2000]))
            log(name, "grad error FAILED", repr(e)[:300])


# --- 2b. gradient checks of the GPU kernels on random problems -------------------------------
def _rand_bounds(rng, L, n, max_size):
    """n + 1 increasing bounds 0..L, blocks of 1..~max_size tokens (1-token blocks among them)."""
    cuts = np.unique(np.clip(np.cumsum(rng.integers(1, max_size + 1, size=n))[:-1], 1, L - 1))
    while len(cuts) < n - 1:
        cuts = np.unique(np.r_[cuts, rng.integers(1, L)])
    return np.r_[0, np.sort(cuts[: n - 1]), L]


def check_cases(seed=0, shrink=1):
    """[(name, kwargs)]: random problems for the GPU kernels' gradients: variable bounds with
    1-token blocks, per-head masks and bounds, GQA, empty rows, ragged Lq != Lkv, lse
    returned with its cotangent, bf16 and f16, host (NumPy) and device (jax) masks."""
    out = []
    for i, (Lq, Lkv, Hq, Hkv, D, dtype, size, device, per_head_bounds, lse) in enumerate([
            (1000, 1000, 4, 4, 128, "bfloat16", 64, False, False, False),
            (1531, 1210, 8, 2, 128, "bfloat16", 40, False, False, True),
            (777, 903, 4, 1, 64, "float16", 7, False, False, True),
            (640, 640, 4, 2, 128, "bfloat16", 1, False, False, False),
            (1400, 1100, 4, 2, 128, "bfloat16", 90, True, False, True),
            (1024, 1280, 4, 4, 64, "float16", 60, True, True, False)]):
        rng = np.random.default_rng(seed + 100 + i)
        Lq, Lkv, size = Lq // shrink, Lkv // shrink, max(1, size // shrink)
        nq, nk = max(2, Lq // size), max(2, Lkv // size)
        nq, nk = min(nq, 640), min(nk, 640)
        rows = Hq if per_head_bounds else 1
        qb = np.stack([_rand_bounds(rng, Lq, nq, 2 * size) for _ in range(rows)])
        kb = np.stack([_rand_bounds(rng, Lkv, nk, 2 * size) for _ in range(rows)])
        if not per_head_bounds:
            qb, kb = qb[0], kb[0]
        blocks = rng.random((Hq, nq, nk)) < 0.3
        blocks[:, rng.integers(nq)] = False                   # a query block with no key
        out.append((f"rand{i}_L{Lq}x{Lkv}_H{Hq}/{Hkv}_D{D}_{dtype}_b{size}"
                    + ("_device" if device else "") + ("_phb" if per_head_bounds else "")
                    + ("_lse" if lse else ""),
                    dict(Lq=Lq, Lkv=Lkv, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, qb=qb, kb=kb,
                         blocks=blocks, device=device, lse=lse, seed=seed + i)))
    return out


def _f32_reference_grads(q, k, v, mask, do, dlse):
    """(out, dq, dk, dv) of the float32 dense-masked reference, at the highest matmul
    precision (no TF32)."""
    import jax
    import tessera_jax as tj
    with jax.default_matmul_precision("highest"):
        if dlse is None:
            out, vjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, mask), q, k, v)
            return (out,) + vjp(do)
        (out, lse), vjp = jax.vjp(lambda q, k, v: tj.reference_attention(
            q, k, v, mask, return_lse=True), q, k, v)
        return (out,) + vjp((do, dlse))


def grad_checks_section(res, args):
    """bf16 / f16 gradients of the GPU kernels (``args.check_backends``) against float32 on
    random problems (``check_cases``), then jax.grad / checkpoint / vmap-of-grad / jit(grad)
    with backend=None."""
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    rows = res.setdefault("grad_checks", [])
    for name, c in check_cases(args.seed, 8 if args.dry_run else 1)[args.check_from:]:
        ks = jax.random.split(jax.random.key(c["seed"]), 5)
        q = jax.random.normal(ks[0], (1, c["Lq"], c["Hq"], c["D"]), jnp.float32)
        k = jax.random.normal(ks[1], (1, c["Lkv"], c["Hkv"], c["D"]), jnp.float32)
        v = jax.random.normal(ks[2], (1, c["Lkv"], c["Hkv"], c["D"]), jnp.float32)
        do = jax.random.normal(ks[3], q.shape, jnp.float32)
        dlse = jax.random.normal(ks[4], (1, c["Hq"], c["Lq"]), jnp.float32) if c["lse"] else None
        host = tj.BlockMask(c["qb"], c["kb"], c["blocks"]) if c["qb"].ndim == 1 else None
        for backend in args.check_backends:
            if time.time() > args.deadline:
                log("budget spent: stopping the gradient checks")
                return
            row = dict(case=name, backend=backend)
            try:
                dt = jnp.dtype(c["dtype"])
                low = [x.astype(dt) for x in (q, k, v, do)]
                dev = c["device"]

                def f(q, k, v, qb, kb, blocks):
                    m = tj.BlockMask(qb, kb, blocks)
                    return tj.sparse_attention(q, k, v, m, backend=backend,
                                               return_lse=c["lse"])
                mb = (jnp.asarray(c["qb"]), jnp.asarray(c["kb"]), jnp.asarray(c["blocks"]))
                if dev:
                    def run(q, k, v, do, dlse, qb, kb, blocks):
                        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, qb, kb, blocks), q, k, v)
                        return (out,) + vjp(do if dlse is None else (do, dlse))
                    got = jax.jit(run)(*low, dlse, *mb)
                else:
                    def run(q, k, v, do, dlse):
                        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, c["qb"], c["kb"],
                                                            c["blocks"]), q, k, v)
                        return (out,) + vjp(do if dlse is None else (do, dlse))
                    got = jax.jit(run)(*low, dlse)
                if c["qb"].ndim == 1:
                    want = _f32_reference_grads(q, k, v, host, do, dlse)
                else:                                # per-head bounds: one head at a time
                    parts = []
                    g = c["Hq"] // c["Hkv"]
                    for h in range(c["Hq"]):
                        mh = tj.BlockMask(c["qb"][h], c["kb"][h], c["blocks"][h:h + 1])
                        kh = h // g
                        parts.append(_f32_reference_grads(
                            q[:, :, h:h + 1], k[:, :, kh:kh + 1], v[:, :, kh:kh + 1], mh,
                            do[:, :, h:h + 1], None if dlse is None else dlse[:, h:h + 1]))
                    out_ = jnp.concatenate([p[0] for p in parts], 2)
                    dq_ = jnp.concatenate([p[1] for p in parts], 2)
                    dk_ = sum(jnp.pad(p[2], ((0, 0), (0, 0), (h // g, c["Hkv"] - 1 - h // g),
                                             (0, 0))) for h, p in enumerate(parts))
                    dv_ = sum(jnp.pad(p[3], ((0, 0), (0, 0), (h // g, c["Hkv"] - 1 - h // g),
                                             (0, 0))) for h, p in enumerate(parts))
                    want = (out_, dq_, dk_, dv_)
                got_out = got[0][0] if c["lse"] else got[0]
                errs = {}
                for nm, a, b in zip(("out", "dq", "dk", "dv"), (got_out,) + tuple(got[1:]),
                                    want):
                    a = a.astype(jnp.float32)
                    errs[nm] = float(jnp.linalg.norm(a - b) / jnp.maximum(
                        jnp.linalg.norm(b), 1e-30))
                    errs[nm + "_finite"] = bool(jnp.isfinite(a).all())
                row.update(errs)
                log(name, backend, " ".join(f"{n} {errs[n]:.2e}" for n in
                                            ("out", "dq", "dk", "dv")))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                log(name, backend, "FAILED", row["error"][:400])
                traceback.print_exc()
            rows.append(row)
    transforms_check(res, 256 if args.dry_run else 1024)


def transforms_check(res, L):
    """jax.grad, jax.checkpoint, jax.vmap over jax.grad and jit(grad) of a device mask with
    backend=None (the GPU's default backend), against the float32 reference's gradients."""
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    out = res.setdefault("transforms", {})
    rng = np.random.default_rng(7)
    H, D = 4, 128
    qb = np.r_[0, np.sort(rng.choice(np.arange(1, L), 20, replace=False)), L]
    mask = tj.BlockMask(qb, qb, rng.random((H, 21, 21)) < 0.4)
    ks = jax.random.split(jax.random.key(3), 4)
    q, k, v = (jax.random.normal(kk, (3, L, H, D), jnp.float32) for kk in ks[:3])
    w = jax.random.normal(ks[3], (L, H, D), jnp.float32)

    def loss(q, k, v, m=mask):
        return jnp.sum(tj.sparse_attention(q[None], k[None], v[None], m)[0]
                       .astype(jnp.float32) * w)

    def ref_loss(q, k, v):
        with jax.default_matmul_precision("highest"):
            return jnp.sum(tj.reference_attention(q[None], k[None], v[None], mask)[0] * w)

    want = jax.vmap(jax.grad(ref_loss, (0, 1, 2)))(q, k, v)
    lo = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    dev = tj.BlockMask(mask.q_bounds, mask.kv_bounds, jnp.asarray(mask.blocks))
    variants = {
        "grad": lambda: [x[None] for x in jax.grad(loss, (0, 1, 2))(lo[0][0], lo[1][0],
                                                                     lo[2][0])],
        "checkpoint": lambda: [x[None] for x in jax.grad(jax.checkpoint(loss), (0, 1, 2))(
            lo[0][1], lo[1][1], lo[2][1])],
        "vmap_grad": lambda: jax.vmap(jax.grad(loss, (0, 1, 2)))(*lo),
        "jit_grad_device_mask": lambda: [x[None] for x in jax.jit(jax.grad(loss, (0, 1, 2)))(
            lo[0][2], lo[1][2], lo[2][2], dev)],
        "vmap_grad_device_mask": lambda: jax.vmap(jax.grad(loss, (0, 1, 2)),
                                                  in_axes=(0, 0, 0, None))(*lo, dev),
    }
    sel = {"grad": slice(0, 1), "checkpoint": slice(1, 2), "vmap_grad": slice(0, 3),
           "jit_grad_device_mask": slice(2, 3), "vmap_grad_device_mask": slice(0, 3)}
    for name, fn in variants.items():
        try:
            got = fn()
            errs = [float(jnp.linalg.norm(a.astype(jnp.float32) - b[sel[name]])
                          / jnp.linalg.norm(b[sel[name]])) for a, b in zip(got, want)]
            out[name] = dict(dq=errs[0], dk=errs[1], dv=errs[2])
            log("transform", name, " ".join(f"{e:.2e}" for e in errs))
        except Exception as e:  # noqa: BLE001
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:2000])
            log("transform", name, "FAILED", out[name]["error"][:400])
            traceback.print_exc()


# --- 3. training step ------------------------------------------------------------------------
def memory_of(compiled) -> dict:
    """Bytes of a compiled executable's memory analysis (peak estimate: arguments + outputs +
    temporaries - aliased)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    d = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                          "temp_size_in_bytes", "alias_size_in_bytes")
         if hasattr(m, k)}
    d["peak_estimate_bytes"] = (d.get("argument_size_in_bytes", 0)
                                + d.get("output_size_in_bytes", 0)
                                + d.get("temp_size_in_bytes", 0)
                                - d.get("alias_size_in_bytes", 0))
    return d


def train_step_section(res, args):
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp
    import optax
    import kernels as K
    from tessera_jax.flax import AttentionOptions
    from tessera_jax.models import WAN21_1_3B, WanModel
    if args.dry_run:
        from tessera_jax.tools.finetune import tiny_config
        cfg = tiny_config(layers=2, heads=2, head_dim=16)
        grid = (4, 4, 8)
    else:
        cfg = WAN21_1_3B.replace(num_layers=args.layers, dtype="bfloat16",
                                 param_dtype="bfloat16")
        grid = tuple(args.grid)
    latent = (grid[0], 2 * grid[1], 2 * grid[2])             # patch (1, 2, 2)
    L = int(np.prod(grid))
    mask = K.mask_cubes_topk(grid, cfg.num_heads, args.train_density, args.seed + 5)
    order = cube_order(grid)
    out = res.setdefault("train_step", {})
    out.update(config=dict(remat_per_block=args.remat, layers=cfg.num_layers,
                           heads=cfg.num_heads, head_dim=cfg.head_dim, tokens=L, latent=latent, mask_density=mask.density,
                           param_dtype=cfg.param_dtype))
    key = jax.random.key(2)
    x0 = jax.random.normal(key, (1,) + latent + (cfg.in_channels,), jnp.float32)
    text = jax.random.normal(jax.random.fold_in(key, 1), (1, cfg.text_len, cfg.text_dim),
                             jnp.float32)
    for variant in args.train_variants.split(","):
        if time.time() > args.deadline:
            log("budget spent: stopping the training section")
            break
        sparse = variant in ("sparse", "sparse_jnp_delta")
        from tessera_jax.runtime import core
        saved = core._row_dots
        if variant == "sparse_jnp_delta":
            # The control of the row-dot kernel: delta by jnp (XLA's reduce).
            core._row_dots = lambda plan, ops, options: None
        try:
            model = WanModel(cfg, rngs=nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)
            masks = [mask] * cfg.num_layers if sparse else None
            options = AttentionOptions(dense_implementation=args.dense_impl)

            def loss_fn(model, k):
                kn, kt = jax.random.split(k)
                noise = jax.random.normal(kn, x0.shape, x0.dtype)
                t = jax.random.uniform(kt, (1,))
                tb = t[:, None, None, None, None]
                xt = (1 - tb) * x0 + tb * noise
                v = model(xt, 1000.0 * t, text, masks=masks, options=options,
                          token_order=order if sparse else None,
                          remat=args.remat)
                return jnp.mean((v.astype(jnp.float32) - (noise - x0)) ** 2)

            graphdef, state = nnx.split((model, opt))

            def step(state, k):
                m, o = nnx.merge(graphdef, state)
                loss, grads = nnx.value_and_grad(loss_fn)(m, k)
                o.update(m, grads)
                return loss, nnx.state((m, o))

            ks = [jax.random.fold_in(key, 10 + i) for i in range(args.steps + 1)]
            t0 = time.perf_counter()
            compiled = jax.jit(step, donate_argnums=0).lower(state, ks[0]).compile()
            compile_s = time.perf_counter() - t0
            try:
                mem = memory_of(compiled)
            except Exception as e:  # noqa: BLE001
                mem = {"error": repr(e)[:500]}
            if args.steps == 0:                      # memory only (the compiled estimate)
                out[variant] = dict(compile_s=compile_s, memory=mem)
                log("train step", variant, "compiled", f"peak est "
                    f"{mem.get('peak_estimate_bytes', 0) / 2**30:.2f} GiB")
                continue
            loss, state = compiled(state, ks[0])                     # warm-up
            jax.block_until_ready(loss)
            samples = []
            for k_ in ks[1:]:
                (loss, state), ms = timing.wall_once(lambda: compiled(state, k_),
                                                     jax.block_until_ready)
                samples.append(ms)
            r = loss
            rule = timing.wall_rule(len(samples), warmup=1)
            tm = timing.Timing.from_samples(samples, rule, "jax")
            dev_peak = None
            try:
                dev_peak = jax.devices()[0].memory_stats().get("peak_bytes_in_use")
            except Exception:  # noqa: BLE001
                pass
            out[variant] = dict(**tm.to_json(), compile_s=compile_s, memory=mem,
                                device_peak_bytes_so_far=dev_peak, last_loss=float(r))
            log("train step", variant, f"{tm.ms:.1f} ms", f"peak est "
                f"{mem.get('peak_estimate_bytes', 0) / 2**30:.2f} GiB")
        except Exception as e:  # noqa: BLE001
            out[variant] = dict(error=f"{type(e).__name__}: {e}"[:2000])
            log("train step", variant, "FAILED", repr(e)[:300])
            traceback.print_exc()
        finally:
            core._row_dots = saved


def row_dots_section(res, args, rule):
    """The backward's delta = rowsum(out * dout) at the benchmark shape: the Triton row-dot
    kernel against jnp (XLA's reduce), under one timing rule."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import backward_rows as rows_
    from pallas_kernels.triton import delta as td
    L, H, D, dtype = args.L, args.heads, args.head_dim, jnp.dtype(args.dtype)
    sets = inputs(jax.random.key(3), 1, L, H, D, dtype, 2)
    interpret = jax.default_backend() != "gpu"
    out = res.setdefault("row_dots", {})
    for name, f in (("kernel", lambda q, k, v, do: td.row_dots(q, do, interpret=interpret)),
                    ("jnp", lambda q, k, v, do: rows_.delta_of(q, do))):
        t = timing.time_kernel(jax.jit(f), sets, rule=rule)
        out[name] = dict(**t.to_json(), gb_per_s=2 * L * H * D * dtype.itemsize / t.ms / 1e6)
        log("row dots", name, f"{t.ms:.4f} ms", f"{out[name]['gb_per_s']:.0f} GB/s")


# --- summary ---------------------------------------------------------------------------------
def summarize(res) -> dict:
    rows = [r for r in res.get("fwd_bwd", []) if "efficiency" in r]
    aligned = [r["efficiency"] for r in rows if r["family"] == "aligned" and r["density"] >= 0.1]
    flex = [r["speedup_vs_flex"] for r in rows
            if r["family"] == "irregular" and "speedup_vs_flex" in r]
    errs = [max(r["dq"], r["dk"], r["dv"]) for r in res.get("grad_error", []) + res.get(
        "grad_checks", []) if "dq" in r]
    errs += [max(t["dq"], t["dk"], t["dv"]) for t in res.get("transforms", {}).values()
             if "dq" in t]
    failed = [r.get("case", r.get("mask")) for r in res.get("grad_error", []) + res.get(
        "grad_checks", []) if "error" in r] + [n for n, t in res.get("transforms", {}).items()
                                                if "error" in t]
    tr = res.get("train_step", {})
    sp, dn = tr.get("sparse", {}), tr.get("dense", {})
    speed = dn["ms"] / sp["ms"] if "ms" in sp and "ms" in dn else None
    mem = None
    try:
        mem = (sp["memory"]["peak_estimate_bytes"] / dn["memory"]["peak_estimate_bytes"])
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    return dict(
        fwd_bwd_efficiency_aligned_min=min(aligned) if aligned else None,
        fwd_bwd_speedup_vs_flex_irregular_geomean=(float(np.exp(np.mean(np.log(flex))))
                                                   if flex else None),
        grad_rel_err_max=max(errs) if errs else None,
        grad_checks_failed=failed,
        train_step_speedup_vs_dense_wan13b_480p=speed,
        train_step_peak_memory_vs_dense=mem)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results JSON (default: none, the results are "
                    "logged; the official file is benchmarks/results/h200-backward.json)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: tiny shapes, the XLA path, host wall clock, no torch")
    ap.add_argument("--grid", default="21,30,52", help="token grid T,H,W (Wan 480p)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--err-grid", default="5,12,16", help="token grid of the gradient check")
    ap.add_argument("--err-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=30, help="Wan2.1-1.3B layers to train")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed training steps (0: compile only, for the memory estimate)")
    ap.add_argument("--train-density", type=float, default=0.125)
    ap.add_argument("--train-variants", default="sparse,dense",
                    help="sparse, dense, sparse_jnp_delta (sparse, delta by jnp: the control "
                    "of the row-dot kernel)")
    ap.add_argument("--no-dkv-controls", dest="dkv_controls", action="store_false",
                    help="skip the irregular masks' control runs with each dk/dv plan choice "
                         "forced (DKV_CONTROLS)")
    ap.add_argument("--no-remat", dest="remat", action="store_false",
                    help="keep every block's activations (Wan2.1-1.3B 480p: ~90 GiB, does not "
                         "fit beside the optimizer state); default: nnx.remat per block, both "
                         "variants")
    ap.add_argument("--backend", default=None, help="sparse_attention backend (None: best)")
    ap.add_argument("--no-flex", dest="flex", action="store_false")
    ap.add_argument("--sections", default="checks,grad,kernels,train",
                    help="checks (random problems and transforms), grad, kernels, train, "
                    "rowdots (the delta kernel against jnp)")
    ap.add_argument("--check-from", type=int, default=0, help="first check case to run")
    ap.add_argument("--check-backends", default=None,
                    help="backends of the gradient checks (default: mosaic_gpu,triton on a "
                         "GPU, xla on a CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=540)
    args = ap.parse_args(argv)
    import jax
    on_gpu = jax.default_backend() == "gpu"
    if args.dry_run:
        args.grid, args.err_grid, args.heads, args.head_dim = "2,8,12", "2,4,8", 2, 64
        args.dtype, args.flex, args.steps = "float32", False, 3
        args.backend = args.backend or "xla"
    args.grid = [int(x) for x in args.grid.split(",")]
    args.err_grid = [int(x) for x in args.err_grid.split(",")]
    args.L = int(np.prod(args.grid))
    args.check_backends = (args.check_backends or ("mosaic_gpu,triton" if on_gpu else "xla")
                           ).split(",")
    args.dense_impl = "cudnn" if on_gpu else None
    args.deadline = T0 + args.budget_s
    if args.flex and not on_gpu:
        args.flex = False
    rule = timing.KERNEL_RULE if on_gpu else timing.wall_rule(3 if args.dry_run else 20)
    res = dict(benchmark="backward" + (" --dry-run" if args.dry_run else ""),
               command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
               device=str(jax.devices()[0]), platform=platform.platform(),
               versions=dict(jax=jax.__version__), timing=rule.name,
               shape=dict(L=args.L, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype))
    sections = args.sections.split(",")
    out = args.out

    def save(final):
        res["summary"] = summarize(res)
        res["partial"] = not final
        if out:
            with open(out, "w") as f:
                json.dump(res, f, indent=1, default=str)
            log("wrote", out, "" if final else "(partial)")

    # A run cut by ``timeout`` (SIGTERM) keeps what it measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    final = False
    try:
        for name, section in (("kernels", lambda: kernels_section(res, args, rule)),
                              ("checks", lambda: grad_checks_section(res, args)),
                              ("grad", lambda: grad_error_section(res, args)),
                              ("train", lambda: train_step_section(res, args)),
                              ("rowdots", lambda: row_dots_section(res, args, rule))):
            if name in sections:
                section()
                save(False)
        final = True
    finally:
        save(final)
    print(json.dumps(res["summary"], indent=1))
    # Every fwd+bwd time of the comparison under one rule (after saving: a mixed run is kept).
    timing.assert_same_rule([r[s] for r in res.get("fwd_bwd", []) for s in ("ours", "flex")
                             if s in r] + [res.get("dense_fwd_bwd")], "fwd+bwd")
    return res


if __name__ == "__main__":
    main()
