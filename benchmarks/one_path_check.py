#!/usr/bin/env python3
"""The one-path issue's GPU check: this tree against the tree before it (4ae09b7), one process.

The old tree is imported under other package names (``old_tessera_jax``,
``old_pallas_kernels``; made by ``benchmarks/one_path_check_old.sh``), so both run on the same
inputs in one process. Each case is a request of the public API (Wan 480p, L = 32,760,
12 heads, D = 128, bf16; the masks of ``benchmarks/kernels.py``): host masks (static NumPy, a
closure constant of a jitted call, or an eager call on a cached plan) and device masks (jax
blocks as jit arguments, shared or per-head bounds), forward and forward+backward (``jax.vjp``
with a random cotangent). Both trees' calls are timed in alternated rounds (old, new, new,
old, ...) under one timing rule; their outputs (out, or dq, dk, dv) on the same inputs must be
identical bit for bit.

    bash benchmarks/one_path_check_old.sh
    python3 benchmarks/one_path_check.py --old-root .carry/old --out $OUT/h200-one-path-check.json

Then (``checks``) the cases of ``tessera_jax.tools.gpu_check`` (what ``make test-gpu`` runs):
every GPU template and both device routes (shared and per-head bounds) on fresh random masks
against the float32 reference, forward (out, lse) and backward (dq, dk, dv).

Summary keys: ``time_ratio_max`` / ``time_ratio_min`` (new / old, ratio of medians per case),
``noise`` (median relative spread of one system between rounds), ``outputs_identical``,
``checks_pass``.
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

# (name, mask, route, pass, options): route "host" (static mask in a jitted call), "eager"
# (static mask, no jit: the request path on a cached plan), "device" (jax blocks as a jit
# argument); pass "fwd" or "fwdbwd"; options: sparse_attention keywords.
CASES = [
    ("host_rand_fwd", "rand128_d0.1", "host", "fwd", {}),
    ("host_cubes_fwd", "cubes64_topk", "host", "fwd", {}),
    ("host_sta_fwd", "sta_cubes", "host", "fwd", {}),
    ("host_clusters_fwd", "clusters_var", "host", "fwd", {}),
    ("host_radial_fwd", "radial_frames", "host", "fwd", {}),
    ("host_cubes_triton_fwd", "cubes64_topk", "host", "fwd", {"backend": "triton"}),
    ("eager_cubes_fwd", "cubes64_topk", "eager", "fwd", {}),
    ("host_cubes_fwdbwd", "cubes64_topk", "host", "fwdbwd", {}),
    ("host_clusters_fwdbwd", "clusters_var", "host", "fwdbwd", {}),
    ("host_rand_fwdbwd", "rand128_d0.1", "host", "fwdbwd", {}),
    ("device_cubes_fwd", "cubes64_topk", "device", "fwd", {}),
    ("device_sta_fwd", "sta_cubes", "device", "fwd", {}),
    ("device_clusters_fwd", "clusters_var", "device", "fwd", {}),
    ("device_perhead_fwd", "perhead_var", "device", "fwd", {}),
    ("eager_device_cubes_fwd", "cubes64_topk", "eager_device", "fwd", {}),
    ("device_cubes_fwdbwd", "cubes64_topk", "device", "fwdbwd", {}),
    ("device_clusters_fwdbwd", "clusters_var", "device", "fwdbwd", {}),
    ("device_perhead_fwdbwd", "perhead_var", "device", "fwdbwd", {}),
]


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def perhead_mask(tj, L, H, seed, density=0.15):
    """Per-head variable bounds (each head its own cuts, 32-256 tokens) and a random per-head
    selection with the diagonal kept."""
    rng = np.random.default_rng(seed)
    n = L // 128
    qb = np.zeros((H, n + 1), np.int64)
    for h in range(H):
        cuts = np.sort(rng.choice(np.arange(1, L), n - 1, replace=False))
        qb[h, 1:-1], qb[h, -1] = cuts, L
    blocks = rng.random((H, n, n)) < density
    blocks[:, np.arange(n), np.arange(n)] = True
    return tj.BlockMask(qb, qb, blocks)


def build_fn(jax, tj, mask, route, pss, opts):
    """A callable of (q, k, v, do) for one tree: its outputs are what the case compares."""
    def attn(q, k, v, m):
        return tj.sparse_attention(q, k, v, m, **opts)

    if route in ("host", "eager"):
        def call(q, k, v, do):
            if pss == "fwd":
                return attn(q, k, v, mask)
            return jax.vjp(lambda q, k, v: attn(q, k, v, mask), q, k, v)[1](do)
        return call if route == "eager" else jax.jit(call)
    qb, kb, blocks = mask.q_bounds, mask.kv_bounds, jax.numpy.asarray(mask.blocks)

    def dev(q, k, v, do, blocks):
        m = tj.BlockMask(qb, kb, blocks)
        if pss == "fwd":
            return attn(q, k, v, m)
        return jax.vjp(lambda q, k, v: attn(q, k, v, m), q, k, v)[1](do)

    if route == "eager_device":
        return lambda q, k, v, do: dev(q, k, v, do, blocks)
    f = jax.jit(dev)
    return lambda q, k, v, do: f(q, k, v, do, blocks)


def run_checks(res, save, deadline, backends, start=0):
    """``tessera_jax.tools.gpu_check``'s cases of ``backends`` (from the ``start``-th), each
    recorded; those past the deadline are recorded as skipped."""
    from tessera_jax.tools import gpu_check
    rng = np.random.default_rng(20261204)
    for name, opts, route, D, Hq, Hkv in gpu_check.cases(backends)[start:]:
        rec = dict(case=name, options=opts, route=route, D=D, Hq=Hq, Hkv=Hkv)
        if time.time() > deadline:
            rec["skipped"] = "time"
        else:
            try:
                rec.update(gpu_check.check_case(rng, D=D, Hq=Hq, Hkv=Hkv, route=route,
                                                options=opts))
            except Exception as e:  # noqa: BLE001
                rec["error"], rec["ok"] = repr(e)[:800], False
                traceback.print_exc()
        log("check", name, rec.get("ok", rec.get("skipped", "")),
            f"out {rec.get('rel_out', float('nan')):.1e}",
            f"grads {max(rec.get('rel_grads', [float('nan')])):.1e}")
        res["checks"].append(rec)
        save()


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--old-root", required=True, help="folder holding old_tessera_jax, "
                    "old_pallas_kernels and old_kernels.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4, help="alternated rounds per case (even)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--cases", default=None, help="comma list of case names (default all)")
    ap.add_argument("--check-from", type=int, default=0,
                    help="skip the first N checks (a run cut short continues where it stopped)")
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke run: a small grid, XLA")
    ap.add_argument("--sections", default="compare,checks",
                    help="compare (new against old) and/or checks (every GPU template and "
                         "both routes against the reference, forward and backward)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.old_root))
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

    import jax
    import jax.numpy as jnp
    import old_kernels                      # the old benchmark's mask generators and inputs
    import old_tessera_jax as old_tj
    import tessera_jax as tj
    from tessera_jax.tools import timing

    rule = timing.KERNEL_RULE
    res = dict(command=" ".join(sys.argv), old_commit="4ae09b7",
               started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               env=dict(python=platform.python_version(), jax=jax.__version__,
                        device_kind=jax.devices()[0].device_kind,
                        plan_tables=str(tj.select.ranking.table_dir())),
               rule=rule.to_json(), cases=[], checks=[])

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=float)

    grid, H, L, D = ((2, 8, 16), 2, 256, 64) if args.tiny else ((21, 30, 52), 12, 32760, 128)
    if args.tiny:
        rule = timing.wall_rule(repeats=3)
    sets = old_kernels.rand_qkv(jax.random.key(3), 1, L, L, H, H, D, jnp.bfloat16, n_sets=2)
    dos = [jax.random.normal(jax.random.key(7 + i), (1, L, H, D), jnp.bfloat16) for i in range(2)]
    sets = [s + (d,) for s, d in zip(sets, dos)]
    gens = {name: fn for name, _, fn in old_kernels.bench_masks(grid, H, L)}
    gens["perhead_var"] = lambda: perhead_mask(old_tj, L, H, 11)
    built = {}
    wanted = None if args.cases is None else set(args.cases.split(","))
    deadline = T0 + args.budget_s
    timings = []
    sections = set(args.sections.split(","))
    for name, mname, route, pss, opts in CASES:
        if "compare" not in sections or (wanted is not None and name not in wanted):
            continue
        if time.time() > deadline:
            res["cases"].append(dict(case=name, skipped="time"))
            continue
        rec = dict(case=name, mask=mname, route=route, pass_=pss, options=opts)
        try:
            if mname not in built:
                m_old = gens[mname]()
                built[mname] = (m_old, tj.BlockMask(m_old.q_bounds, m_old.kv_bounds,
                                                    m_old.blocks))
            m_old, m_new = built[mname]
            fns = {"old": build_fn(jax, old_tj, m_old, route, pss, opts),
                   "new": build_fn(jax, tj, m_new, route, pss, opts)}
            outs = {w: jax.tree.leaves(f(*sets[0])) for w, f in fns.items()}
            rec["identical"] = all(np.array_equal(bits(a), bits(b))
                                   for a, b in zip(outs["old"], outs["new"]))
            rec["max_abs_diff"] = max(float(np.max(np.abs(np.asarray(a, np.float32)
                                                          - np.asarray(b, np.float32))))
                                      for a, b in zip(outs["old"], outs["new"]))
            del outs
            samples = {"old": [], "new": []}
            for r in range(args.rounds):
                for who in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    tm = timing.time_kernel(fns[who], sets, rule=rule)
                    samples[who].append(tm.ms)
                    timings.append(tm)
            med = {k: float(np.median(v)) for k, v in samples.items()}
            rec.update(samples=samples, old_ms=med["old"], new_ms=med["new"],
                       new_over_old=med["new"] / med["old"],
                       spread=float(max((max(v) - min(v)) / np.median(v)
                                        for v in samples.values())))
            log(name, f"old {med['old']:.3f} new {med['new']:.3f} ms",
                f"new/old {rec['new_over_old']:.3f}",
                "identical" if rec["identical"] else f"max diff {rec['max_abs_diff']:.2e}")
        except Exception as e:  # noqa: BLE001
            rec["error"] = repr(e)[:800]
            traceback.print_exc()
        res["cases"].append(rec)
        save()

    if "checks" in sections:
        run_checks(res, save, deadline, ["xla"] if args.tiny else ["mosaic_gpu", "triton"],
                   args.check_from)
    done = [c for c in res["cases"] if "new_over_old" in c]
    try:
        rule_used = timing.assert_same_rule(timings, "one-path check")
    except timing.MixedRulesError as e:
        rule_used = f"MIXED: {e}"
    res["summary"] = dict(
        cases_timed=len(done), cases_total=len(res["cases"]),
        time_ratio_max=max((c["new_over_old"] for c in done), default=None),
        time_ratio_min=min((c["new_over_old"] for c in done), default=None),
        noise=float(np.median([c["spread"] for c in done])) if done else None,
        outputs_identical=bool(done) and all(c["identical"] for c in done),
        checks_pass=f"{sum(1 for c in res['checks'] if c.get('ok'))}/"
                    f"{sum(1 for c in res['checks'] if 'skipped' not in c)}",
        timing_rule=rule_used,
        notes="new/old = this tree's median time / 4ae09b7's, alternated rounds in one "
              "process, same inputs; identical = every output bit-equal")
    res["elapsed_s"] = time.time() - T0
    save()
    print(f"\n{'case':<26} {'old_ms':>8} {'new_ms':>8} {'new/old':>8} identical")
    for c in done:
        print(f"{c['case']:<26} {c['old_ms']:8.3f} {c['new_ms']:8.3f} {c['new_over_old']:8.3f} "
              f"{c['identical']}")
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
