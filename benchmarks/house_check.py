#!/usr/bin/env python3
"""The house issue's GPU check: the refactored tree against the tree before it, same process.

The tree before the refactor (commit 7b7262c) is imported under other package names
(``old_tessera_jax``, ``old_pallas_kernels``; made by ``benchmarks/house_check_old.sh``), so both
run in one process on the same inputs. For each case (mask x template x policy of
``benchmarks/kernels.py``'s official run: Wan 480p, L = 32,760, 12 heads, D = 128, bf16, the
same mask generators) both trees' ``sparse_attention`` is jitted with the mask as a static
constant and timed in alternated rounds (old, new, new, old, ...) under one timing rule, with
cuDNN dense in every round; their outputs on the same inputs are compared (the kernels did not
change, so they should agree bit for bit). Then every kept template is checked against the
dense reference on small random variable-bound masks (GQA, per-head, empty rows).

    python3 benchmarks/house_check.py --old-root .carry/old --out $OUT/h200-house-check.json

Summary keys: ``max_new_over_old``/``min_new_over_old`` (ratio of medians per case),
``noise`` (the median relative spread of the same system between rounds), ``outputs_identical``,
``efficiency_by_mask`` (new, against cuDNN in this run) next to the official file's figures.
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
OFFICIAL = os.path.join(os.path.dirname(__file__), "results", "h200-kernels.json")

# (mask, template, policy): the official run's best Mosaic and Triton template per mask, and the
# table's other candidates on the cubes mask.
CASES = [
    ("rand128_d0.1", "mgpu_q128_kv128_s2_hm", "merge"),
    ("cubes64_topk", "mgpu_q64x2pp_kv64_s2_hm", "pack"),
    ("sta_cubes", "mgpu_q64x2pp_kv64_s2_hm", "pack"),
    ("clusters_var", "mgpu_q64x2_kv64_s2_hm", "pack"),
    ("radial_frames", "mgpu_q128_kv128_s2_hm", "merge"),
    ("rand128_d0.5", "mgpu_q128_kv128_s2_hm", "merge"),
    ("rand128_d0.25", "mgpu_q128_kv128_s2_hm", "merge"),
    ("rand128_d0.05", "mgpu_q128_kv128_s2_hm", "merge"),
    ("cubes64_topk", "mgpu_q128_kv64_s2_skip", "pack"),
    ("cubes64_topk", "mgpu_q128_kv64_s2_hm", "merge"),
    ("cubes64_topk", "mgpu_q64x2_kv64_s2_hm", "merge"),
    ("rand128_d0.1", "triton_q128_kv128_w8_s3_pf_hm", "merge"),
    ("sta_cubes", "triton_q128_kv64_w8_s3_pf_hm", "merge"),
    ("clusters_var", "triton_q128_kv128_w8_s3_pf_hm", "merge"),
]
CHECK_TEMPLATES = ["mgpu_q128_kv128_s2_hm", "mgpu_q128_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm",
                   "mgpu_q128_kv64_s2_skip", "mgpu_q64x2pp_kv64_s2_hm",
                   "triton_q128_kv64_w8_s3_pf_hm", "triton_q128_kv128_w8_s3_pf_hm"]


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--old-root", required=True, help="folder holding old_tessera_jax, "
                    "old_pallas_kernels and old_kernels.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4, help="alternated rounds per case (even)")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--cases", default=None, help="comma list of case indices (default all)")
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
    res = dict(command=" ".join(sys.argv), started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                     time.gmtime()),
               env=dict(python=platform.python_version(), jax=jax.__version__,
                        device_kind=jax.devices()[0].device_kind),
               rule=rule.to_json(), cases=[], checks=[])

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=float)

    grid, H, L, D = (21, 30, 52), 12, 32760, 128
    sets = old_kernels.rand_qkv(jax.random.key(3), 1, L, L, H, H, D, jnp.bfloat16, n_sets=2)
    masks = {name: fn for name, _, fn in old_kernels.bench_masks(grid, H, L)}
    built = {}
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    deadline = T0 + args.budget_s
    timings = []                    # every Timing of the run: one rule for all (checked below)
    for mname, tname, policy in cases:
        if time.time() > deadline:
            res["cases"].append(dict(mask=mname, template=tname, skipped="time"))
            continue
        rec = dict(mask=mname, template=tname, policy=policy)
        try:
            if mname not in built:
                m_old = masks[mname]()
                built[mname] = (m_old, tj.BlockMask(m_old.q_bounds, m_old.kv_bounds, m_old.blocks))
            m_old, m_new = built[mname]
            sel = m_new.selected_interactions(H)
            rec["selected_flops"] = flops = 4.0 * D * sel
            f_old = jax.jit(lambda q, k, v, m=m_old: old_tj.sparse_attention(
                q, k, v, m, template=tname, policy=policy))
            f_new = jax.jit(lambda q, k, v, m=m_new: tj.sparse_attention(
                q, k, v, m, template=tname, policy=policy))
            o_old = np.asarray(f_old(*sets[0]), np.float32)
            o_new = np.asarray(f_new(*sets[0]), np.float32)
            rec["max_abs_diff"] = float(np.max(np.abs(o_old - o_new)))
            rec["identical"] = bool(np.array_equal(o_old, o_new))
            del o_old, o_new
            samples = {"old": [], "new": [], "cudnn": []}
            for r in range(args.rounds):
                for who in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    fn = f_old if who == "old" else f_new
                    tm = timing.time_kernel(fn, sets, rule=rule)
                    samples[who].append(tm.ms)
                    timings.append(tm)
                tm = timing.time_kernel(cudnn, sets, rule=rule)
                samples["cudnn"].append(tm.ms)
                timings.append(tm)
            med = {k: float(np.median(v)) for k, v in samples.items()}
            rec.update(samples=samples, old_ms=med["old"], new_ms=med["new"],
                       cudnn_ms=med["cudnn"], new_over_old=med["new"] / med["old"],
                       spread=float(max((max(v) - min(v)) / np.median(v)
                                        for k, v in samples.items() if k != "cudnn")),
                       efficiency_new=med["cudnn"] / med["new"] * sel / (L * L * H),
                       efficiency_old=med["cudnn"] / med["old"] * sel / (L * L * H))
            log(mname, tname, policy, f"old {med['old']:.3f} new {med['new']:.3f} ms",
                f"new/old {rec['new_over_old']:.3f}", f"eff {rec['efficiency_new']:.3f}",
                "identical" if rec["identical"] else f"max diff {rec['max_abs_diff']:.2e}")
        except Exception as e:  # noqa: BLE001
            rec["error"] = repr(e)[:800]
            traceback.print_exc()
        res["cases"].append(rec)
        save()

    # Every kept template against the dense reference on small random variable-bound masks.
    rng = np.random.default_rng(20261201)
    for tname in CHECK_TEMPLATES:
        for D2, (Hq, Hkv) in ((128, (4, 2)), (64, (2, 2))):
            rec = dict(template=tname, D=D2, Hq=Hq, Hkv=Hkv)
            try:
                Lq = int(rng.integers(700, 1500))
                qb = np.r_[0, np.sort(rng.choice(np.arange(1, Lq), 20, replace=False)), Lq]
                blocks = rng.random((Hq, len(qb) - 1, len(qb) - 1)) < 0.4
                blocks[:, 3] = False                                  # empty rows
                m = tj.BlockMask(qb, qb, blocks)
                ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
                q = jax.random.normal(ks[0], (1, Lq, Hq, D2), jnp.bfloat16)
                k = jax.random.normal(ks[1], (1, Lq, Hkv, D2), jnp.bfloat16)
                v = jax.random.normal(ks[2], (1, Lq, Hkv, D2), jnp.bfloat16)
                out, lse = tj.sparse_attention(q, k, v, m, template=tname, return_lse=True)
                ref, rlse = tj.reference_attention(q, k, v, m, return_lse=True)
                o, r_ = np.asarray(out, np.float32), np.asarray(ref, np.float32)
                rec["rel_err"] = float(np.linalg.norm(o - r_) / np.linalg.norm(r_))
                fin = np.isfinite(np.asarray(rlse))
                rec["lse_max_err"] = float(np.max(np.abs(np.asarray(lse)[fin]
                                                         - np.asarray(rlse)[fin])))
                rec["empty_rows_ok"] = bool(np.all(np.isneginf(np.asarray(lse)[~fin]))
                                            and not np.isnan(o).any())
                rec["ok"] = rec["rel_err"] < 1e-2 and rec["lse_max_err"] < 1e-2 and \
                    rec["empty_rows_ok"]
            except ValueError as e:            # the template doesn't take this head dim
                rec["skipped"] = repr(e)[:300]
            except Exception as e:  # noqa: BLE001
                rec["error"], rec["ok"] = repr(e)[:800], False
                traceback.print_exc()
            log("check", tname, f"D={D2}", rec.get("ok", rec.get("skipped", "")[:60]),
                f"rel {rec.get('rel_err', float('nan')):.2e}")
            res["checks"].append(rec)
    save()

    done = [c for c in res["cases"] if "new_over_old" in c]
    eff = {}
    for c in done:
        eff[c["mask"]] = max(eff.get(c["mask"], 0.0), c["efficiency_new"])
    try:
        official = json.load(open(OFFICIAL))["summary"]["mosaic_efficiency_by_mask"]
    except (OSError, KeyError, ValueError):
        official = {}
    try:
        rule_used = timing.assert_same_rule(timings, "house check")
    except timing.MixedRulesError as e:       # recorded, so the summary says it
        rule_used = f"MIXED: {e}"
    res["summary"] = dict(
        cases_timed=len(done), cases_total=len(res["cases"]),
        max_new_over_old=max((c["new_over_old"] for c in done), default=None),
        min_new_over_old=min((c["new_over_old"] for c in done), default=None),
        noise=float(np.median([c["spread"] for c in done])) if done else None,
        outputs_identical=all(c["identical"] for c in done),
        checks_pass=f"{sum(1 for c in res['checks'] if c.get('ok'))}/"
                    f"{sum(1 for c in res['checks'] if 'skipped' not in c)}",
        efficiency_by_mask={k: round(v, 3) for k, v in eff.items()},
        official_efficiency_by_mask=official, timing_rule=rule_used,
        notes="new/old = this tree's median kernel time / the pre-refactor tree's, alternated "
              "rounds in one process; efficiency = effective TFLOP/s / cuDNN dense, same run")
    res["elapsed_s"] = time.time() - T0
    save()
    print("\ncase                          template                      old_ms  new_ms  new/old  eff")
    for c in done:
        print(f"{c['mask']:<29} {c['template']:<29} {c['old_ms']:7.3f} {c['new_ms']:7.3f} "
              f"{c['new_over_old']:7.3f} {c['efficiency_new']:5.2f}")
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
