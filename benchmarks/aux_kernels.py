#!/usr/bin/env python3
"""Off the Triton lowering (issue 32, item 3): each Mosaic GPU auxiliary kernel against the Pallas
Triton kernel it replaces on Hopper's default path, in one process, at Wan 480p.

Sections (``--sections``), each old (``pallas_kernels.triton``) against new
(``pallas_kernels.mosaic``), their outputs checked against each other, and XLA's version timed
for context:

* ``delta``: the backward's row dots, rowsum(out * dout) of out, dout [1, 32760, 12, 128] bf16
  (``triton.delta.row_dots`` / ``mosaic.delta.row_dots``; XLA: ``backward_rows.delta_of``).
* ``pool``: block sums of q and of k [1, 32760, 12, 128] bf16 over VSA's 624 cubes of the
  21 x 30 x 52 latent grid (partial edge cubes: 8 block sizes), one jitted call for both
  (``triton.pool.block_sums`` / ``mosaic.pool.block_sums``; XLA: the rules' ``pool="xla"``).
* ``topk``: each row's top 78 of VSA's pooled scores [12, 624, 624] float32 (k = ceil(0.125 *
  624); ``triton.topk.topk_mask`` / ``mosaic.topk.topk_mask``, same kept set exactly;
  XLA: ``lax.top_k``).
* ``kmeans``: SVG2's assignment of the 32,760 tokens' features [12, 32760, 128] bf16 to 1000
  key and 300 query centroids (``triton.kmeans.assign`` / ``mosaic.kmeans.assign``; labels
  agree up to float rounding of near ties; XLA: matmul + argmin).
* ``builders``: the VSA and SpargeAttn top-k builders end to end, rule options "triton"
  against "mosaic" (the kernels above inside the real builders).

Every time is ``tools.timing.KERNEL_RULE`` (CUPTI kernel time, L2 flushed, median of 20), old
and new alternated over ``--rounds`` rounds; a ratio is new / old of the median over rounds.
``summary``: ``delta_new_over_old``, ``pool_new_over_old``, ``topk_new_over_old``,
``kmeans_new_over_old`` (key and query sides summed; each side too), each to be <= 1.1;
``all_within_1_1``; ``outputs_agree``.

The training step's memory (the reason the row dots are a kernel: a custom call keeps the
forward's output token-major) is re-checked by ``benchmarks/backward.py``'s train section,
compile only (the sparse step now runs the Mosaic row dots; ``sparse_jnp_delta`` is the jnp
control; summary ``train_step_peak_memory_vs_dense``, session 14: 0.99985):

    python3 benchmarks/backward.py --sections train --steps 0 --layers 4 \\
        --train-variants sparse,dense,sparse_jnp_delta --out $OUT/h200-train-memory.json

    python3 benchmarks/aux_kernels.py --out $OUT/h200-aux-kernels.json
    python3 benchmarks/aux_kernels.py --small --out /tmp/aux.json     # CPU smoke (interpreters)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
T0 = time.time()

SECTIONS = ("delta", "pool", "topk", "kmeans", "builders")
#: Wan 480p: latent grid (T, H, W), heads, head dim; VSA keeps 12.5% of the cubes; SVG2's
#: clusters (key, query).
FULL = dict(grid=(21, 30, 52), heads=12, head_dim=128, keep=0.125, clusters=(1000, 300))
#: The CPU smoke run: the same code at interpreter sizes (H * D a multiple of 256, D of 64).
SMALL = dict(grid=(2, 6, 12), heads=2, head_dim=128, keep=0.25, clusters=(20, 7))
BOUND = 1.1


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


class Bench:
    """Times old against new under one rule, alternating over rounds, and keeps the rows."""

    def __init__(self, args, rule, res):
        self.args, self.rule, self.res = args, rule, res

    def over_budget(self) -> bool:
        return time.time() - T0 > self.args.budget_s

    def compare(self, name, variants, arg_sets, check=None):
        """``variants``: {label: fn} with "old" and "new" (and context entries), each jitted and
        timed on ``arg_sets``; ``check(outputs)`` -> dict of agreement facts (``ok``)."""
        import jax
        from tessera_jax.tools import timing
        row = self.res.setdefault("sections", {}).setdefault(name, {})
        fns = {label: jax.jit(f) for label, f in variants.items()}
        outs = {}
        for label, f in fns.items():
            t0 = time.time()
            outs[label] = jax.block_until_ready(f(*arg_sets[0]))
            row.setdefault(label, {})["first_call_s"] = time.time() - t0
        if check is not None:
            row["check"] = check(outs)
            log(name, "check", json.dumps(row["check"]))
        order = list(fns)
        for r in range(self.args.rounds):
            # Old and new alternate (reversed every other round): drift hits both alike.
            for label in (order if r % 2 == 0 else order[::-1]):
                t = timing.time_kernel(fns[label], arg_sets, rule=self.rule)
                row[label].setdefault("rounds_ms", []).append(t.ms)
                row[label]["rule"] = t.rule.name
                log(name, label, f"round {r}: {t.ms:.4f} ms")
        for label in order:
            row[label]["ms"] = statistics.median(row[label]["rounds_ms"])
        row["new_over_old"] = row["new"]["ms"] / row["old"]["ms"]
        log(name, f"new/old {row['new_over_old']:.3f}",
            " ".join(f"{k} {v['ms']:.4f} ms" for k, v in row.items() if isinstance(v, dict)
                     and "ms" in v))
        self.save()
        return row

    def save(self):
        if self.args.out:
            with open(self.args.out, "w") as f:
                json.dump(self.res, f, indent=1)


def _close(a, b, rel):
    """Agreement of two float arrays: max |a - b| over max |b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    return dict(max_rel_diff=err, ok=bool(err <= rel))


# --- sections ----------------------------------------------------------------------------------
def delta_section(b: Bench, shape, interpret):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import backward_rows
    from pallas_kernels.mosaic import delta as md
    from pallas_kernels.triton import delta as td
    keys = jax.random.split(jax.random.key(1), 4)
    sets = [tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in keys[i:i + 2])
            for i in (0, 2)]
    b.compare("delta", {
        "old": lambda o, g: td.row_dots(o, g, interpret=interpret),
        "new": lambda o, g: md.row_dots(o, g, interpret=interpret),
        "xla": lambda o, g: backward_rows.delta_of(o, g),
    }, sets, lambda outs: _close(outs["new"], outs["old"], 1e-5))


def pool_section(b: Bench, shape, bounds, interpret):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.mosaic import pool as mp
    from pallas_kernels.triton import pool as tp
    from tessera_jax.masks.dynamic import common as dc
    keys = jax.random.split(jax.random.key(2), 4)
    sets = [tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in keys[i:i + 2])
            for i in (0, 2)]

    def both(mod):
        return lambda q, k: (mod.block_sums(q, bounds, interpret=interpret),
                             mod.block_sums(k, bounds, interpret=interpret))

    b.res["pool_blocks"] = dict(n=len(bounds) - 1,
                                sizes=sorted(set(np.diff(bounds).tolist())))
    b.compare("pool", {
        "old": both(tp), "new": both(mp),
        "xla": lambda q, k: (dc.pool_sum(q, bounds, "xla"), dc.pool_sum(k, bounds, "xla")),
    }, sets, lambda outs: _close(np.stack(outs["new"]), np.stack(outs["old"]), 1e-5))


def _vsa_scores(q, k, bounds):
    """VSA's pooled scores [H, n, n] float32 (the builder's, at HIGH precision)."""
    import jax
    import jax.numpy as jnp
    from tessera_jax.masks.dynamic import common as dc
    bounds = np.asarray(bounds)
    pq, pk = dc.pool_mean(q, bounds, "xla"), dc.pool_mean(k, bounds, "xla")
    return jnp.einsum("bihd,bjhd->hij", pq, pk, precision=jax.lax.Precision.HIGH) * (
        q.shape[-1] ** -0.5)


def topk_section(b: Bench, shape, bounds, keep, interpret):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.mosaic import topk as mt
    from pallas_kernels.triton import topk as tt
    keys = jax.random.split(jax.random.key(3), 4)
    sets = [(jax.jit(_vsa_scores, static_argnums=2)(
        jax.random.normal(keys[i], shape, jnp.bfloat16),
        jax.random.normal(keys[i + 1], shape, jnp.bfloat16), tuple(int(v) for v in bounds)),)
        for i in (0, 2)]
    n = len(bounds) - 1
    kk = max(1, math.ceil(keep * n - 1e-9))
    b.res["topk_shape"] = dict(scores=list(sets[0][0].shape), k=kk)

    def check(outs):
        same = bool(np.array_equal(np.asarray(outs["new"]), np.asarray(outs["old"])))
        return dict(identical=same, kept_per_row=int(np.asarray(outs["new"]).sum(-1).max()),
                    ok=same)

    b.compare("topk", {
        "old": lambda s: tt.topk_mask(s, kk, interpret=interpret),
        "new": lambda s: mt.topk_mask(s, kk, interpret=interpret),
        "xla": lambda s: jax.lax.top_k(s, kk)[1],
    }, sets, check)


def kmeans_section(b: Bench, shape, clusters, interpret):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.mosaic import kmeans as mk
    from pallas_kernels.triton import kmeans as tk
    from tessera_jax.masks.dynamic import clustering
    _, L, H, D = shape
    keys = jax.random.split(jax.random.key(4), 4)
    rows = {}
    for side, C in zip(("kv", "q"), clusters):
        sets = []
        for i in (0, 2):
            x = jax.random.normal(keys[i], (H, L, D), jnp.bfloat16)
            idx = jax.random.choice(keys[i + 1], L, (C,), replace=False)
            sets.append((x, x[:, idx].astype(jnp.float32)))      # SVG2's seeds: tokens

        def check(outs, x=sets[0][0], c=sets[0][1]):
            new, old = np.asarray(outs["new"]), np.asarray(outs["old"])
            same = float((new == old).mean())
            # Where they differ, the two picks must be (near) equally near.
            xf = np.asarray(x, np.float32)
            cf = np.asarray(c.astype(x.dtype), np.float32)
            diff = np.nonzero(new != old)
            gap = 0.0
            if diff[0].size:
                h, l = diff[0][:1000], diff[1][:1000]
                cn = (cf ** 2).sum(-1)
                d_new = cn[h, new[h, l]] - 2 * (xf[h, l] * cf[h, new[h, l]]).sum(-1)
                d_old = cn[h, old[h, l]] - 2 * (xf[h, l] * cf[h, old[h, l]]).sum(-1)
                gap = float(np.abs(d_new - d_old).max() / max(np.abs(d_old).max(), 1e-30))
            return dict(labels_equal=same, max_rel_distance_gap=gap,
                        ok=bool(same >= 0.999 and gap <= 1e-3))

        rows[side] = b.compare(f"kmeans_{side}", {
            "old": lambda x, c: tk.assign(x, c, interpret=interpret),
            "new": lambda x, c: mk.assign(x, c, interpret=interpret),
            "xla": lambda x, c: jax.vmap(clustering._assign)(x, c),
        }, sets, check)
        if b.over_budget():
            break
    return rows


def builders_section(b: Bench, shape, bounds, keep):
    import jax
    import jax.numpy as jnp
    from tessera_jax.masks import dynamic as dm
    keys = jax.random.split(jax.random.key(5), 4)
    sets = [tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in keys[i:i + 2])
            for i in (0, 2)]
    b_ = tuple(int(v) for v in bounds)
    for name, make in (
            ("vsa", lambda o: dm.VSA(q_bounds=b_, keep=keep, top_k=o, pool=o)),
            ("sparge_topk", lambda o: dm.Sparge(topk=0.2, sim_threshold=-1.0, top_k=o, pool=o))):
        builder = dm.vsa_mask if name == "vsa" else dm.sparge_mask

        def check(outs):
            same = bool(np.array_equal(np.asarray(outs["new"]), np.asarray(outs["old"])))
            return dict(identical=same, ok=same)

        b.compare(f"builder_{name}", {
            "old": lambda q, k, r=make("triton"), f=builder: f(q, k, r).blocks,
            "new": lambda q, k, r=make("mosaic"), f=builder: f(q, k, r).blocks,
        }, sets, check)
        if b.over_budget():
            break


# --- summary -----------------------------------------------------------------------------------
def summarize(res) -> dict:
    s = res.get("sections", {})

    def ratio(name):
        return s.get(name, {}).get("new_over_old")

    out = {f"{k}_new_over_old": ratio(k) for k in ("delta", "pool", "topk")}
    kv, q = s.get("kmeans_kv", {}), s.get("kmeans_q", {})
    out["kmeans_kv_new_over_old"], out["kmeans_q_new_over_old"] = (ratio("kmeans_kv"),
                                                                   ratio("kmeans_q"))
    if "ms" in kv.get("new", {}) and "ms" in q.get("new", {}):
        out["kmeans_new_over_old"] = ((kv["new"]["ms"] + q["new"]["ms"])
                                      / (kv["old"]["ms"] + q["old"]["ms"]))
    else:
        out["kmeans_new_over_old"] = ratio("kmeans_kv")
    for name in ("builder_vsa", "builder_sparge_topk"):
        out[f"{name}_new_over_old"] = ratio(name)
    main = [out[f"{k}_new_over_old"] for k in ("delta", "pool", "topk", "kmeans")]
    out["all_within_1_1"] = (all(r is not None and r <= BOUND for r in main)
                             if all(r is not None for r in main) else None)
    checks = [v["check"]["ok"] for v in s.values() if isinstance(v, dict) and "check" in v]
    out["outputs_agree"] = bool(checks) and all(checks)
    out["errors"] = sorted(res.get("errors", {}))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--small", action="store_true",
                    help="CPU smoke run: interpreter sizes, the kernels interpreted, wall clock")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--rounds", type=int, default=2, help="alternated old / new timing rounds")
    ap.add_argument("--budget-s", type=float, default=240,
                    help="stop starting sections past this many seconds")
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")

    import jax
    from tessera_jax.masks import dynamic as dm
    from tessera_jax.tools import timing
    from tessera_jax.tools.profiler import code_revision   # git HEAD, or a snapshot's .snap_rev

    cfg = SMALL if args.small else FULL
    gpu = jax.default_backend() == "gpu"
    interpret = not gpu
    rule = timing.KERNEL_RULE if not args.small else timing.wall_rule(1, warmup=0)
    _, bounds = dm.cube_layout(cfg["grid"])
    L, H, D = int(bounds[-1]), cfg["heads"], cfg["head_dim"]
    shape = (1, L, H, D)
    dev = jax.devices()[0]
    res = dict(device=str(getattr(dev, "device_kind", dev.platform)), jax=jax.__version__,
               commit=code_revision(pathlib.Path(HERE).parent), small=args.small, L=L, heads=H,
               head_dim=D, grid=list(cfg["grid"]), rule=rule.to_json(), rounds=args.rounds,
               bound=BOUND)
    b = Bench(args, rule, res)
    log(f"{res['device']}, jax {jax.__version__}, L {L}, heads {H}, D {D}, "
        f"interpret={interpret}, sections {sections}")
    runs = {"delta": lambda: delta_section(b, shape, interpret),
            "pool": lambda: pool_section(b, shape, bounds, interpret),
            "topk": lambda: topk_section(b, shape, bounds, cfg["keep"], interpret),
            "kmeans": lambda: kmeans_section(b, shape, cfg["clusters"], interpret),
            "builders": lambda: builders_section(b, shape, bounds, cfg["keep"])}
    for name in sections:
        if b.over_budget():
            log("budget reached: skipping", name)
            res.setdefault("skipped", []).append(name)
            continue
        try:
            runs[name]()
        except Exception as e:  # noqa: BLE001
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            log(name, "FAILED", repr(e)[:300])
            traceback.print_exc()
        b.save()
    res["summary"] = summarize(res)
    res["wall_s"] = time.time() - T0
    log("summary", json.dumps(res["summary"]))
    b.save()
    return res


if __name__ == "__main__":
    main()
