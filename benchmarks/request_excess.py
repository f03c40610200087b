#!/usr/bin/env python3
"""Where a device-route request's time beyond its kernels goes, against cuDNN's jitted call
(issue 33: ``median_request_excess_over_cudnn_ms`` <= 0.3; 0.485 in h200-peers.json).

Per corpus test mask FAMILY:GRID (masks start on the GPU as in ``peers.py``: one jitted
``sparse_attention`` with static bounds and a new blocks array per request) and cuDNN dense
on the same inputs: request wall time (``timing.REQUEST_RULE``), the CUPTI kernel sum
(``timing.KERNEL_RULE``), the kernels one call launches and their names by count, and
excess = (request - kernels)_ours - (request - kernels)_cuDNN. Each XLA flag set runs in its
own process (XLA reads the flags once): ``default``, and ``cmdbuf`` (command buffers, i.e.
CUDA graphs, for every command kind, from one command up), whose gain says whether the excess
is launch gaps between the device planner's many small kernels.

    python3 benchmarks/request_excess.py --out $OUT/h200-request-excess.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

MASKS = "sparge:hy720_1x1,ssta:hy480,sta:hy720,svg2:wan480,radial:wan480"
FLAGS = {
    "default": "",
    "cmdbuf": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
              "COLLECTIVES,CONDITIONAL,WHILE,DYNAMIC_SLICE_FUSION "
              "--xla_gpu_graph_min_graph_size=1",
}


def _kernels(fn, args):
    """(count, {name: count}) of the kernels one call launches (CUPTI), or (None, why)."""
    import jax

    from tessera_jax.tools import timing
    try:
        ext = timing._cupti_ext()              # the collector the kernel rule uses
        jax.block_until_ready(fn(*args))
        ext._cupti_init()
        jax.block_until_ready(fn(*args))
        recs = ext._cupti_get_timings(True)
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"[:200]
    names = collections.Counter(str(n)[:60] for n, _ in recs)
    return len(recs), dict(names.most_common(8))


def one(masks: list[str], heads: int, variants: int) -> list[dict]:
    import jax

    import tessera_jax as tj
    from peers_lib.convert import mask_variants
    from request_cases import bf16_inputs, first_test_mask, forget_request_caches
    from tessera_jax.masks import corpus
    from tessera_jax.tools import timing
    specs = corpus("test")
    rows = []
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                  implementation="cudnn"))
    for item in masks:
        row = {"mask": item, "device": jax.devices()[0].device_kind}
        try:
            _, m = first_test_mask(item, heads, specs)
            qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
            q, k, v = bf16_inputs(m, heads)
            bl = [jax.device_put(b) for b in mask_variants(m, variants)]
            f = jax.jit(lambda q, k, v, b: tj.sparse_attention(q, k, v, tj.BlockMask(qb, kb, b)))
            jax.block_until_ready(f(q, k, v, bl[0]))
            it = iter(range(10**9))
            req = timing.time_request(
                lambda: jax.block_until_ready(f(q, k, v, bl[next(it) % len(bl)])),
                before=forget_request_caches)
            kern = timing.time_kernel(f, [(q, k, v, bl[0])])
            n, names = _kernels(f, (q, k, v, bl[0]))
            dreq = timing.time_request(lambda: jax.block_until_ready(dense(q, k, v)))
            dkern = timing.time_kernel(dense, [(q, k, v)])
            dn, _ = _kernels(dense, (q, k, v))
            row.update(request_ms=req.ms, kernel_ms=kern.ms, kernels=n, kernel_names=names,
                       dense_request_ms=dreq.ms, dense_kernel_ms=dkern.ms, dense_kernels=dn,
                       overhead_ms=req.ms - kern.ms, dense_overhead_ms=dreq.ms - dkern.ms,
                       excess_ms=(req.ms - kern.ms) - (dreq.ms - dkern.ms),
                       kernel_timer=kern.timer)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--masks", default=MASKS)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--variants", type=int, default=6)
    ap.add_argument("--flags", default=",".join(FLAGS))
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    masks = a.masks.split(",")
    if a.one:
        print("ROWS " + json.dumps(one(masks, a.heads, a.variants)), flush=True)
        return
    t0 = time.time()
    import pathlib

    from tessera_jax.tools.profiler import code_revision
    res = {"benchmark": "request_excess", "command": " ".join(sys.argv), "flags": FLAGS,
           "commit": code_revision(pathlib.Path(HERE).parent), "runs": {}}
    names = a.flags.split(",")
    for i, name in enumerate(names):
        left = a.budget_s - (time.time() - t0)
        if left < 20:
            res["runs"][name] = {"error": "budget reached"}
            continue
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                           + FLAGS[name]).strip())
        try:
            p = subprocess.run([sys.executable, __file__, "--one", "--masks", a.masks,
                                "--heads", str(a.heads), "--variants", str(a.variants)],
                               env=env, capture_output=True, text=True,
                               timeout=left / (len(names) - i))
            line = [x for x in p.stdout.splitlines() if x.startswith("ROWS ")]
            res["runs"][name] = ({"rows": json.loads(line[-1][5:])} if line else
                                 {"error": p.stderr[-1500:]})
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            res["runs"][name] = {"error": "timeout",
                                 "rows": [json.loads(x) for x in out.splitlines()
                                          if x.startswith("{")]}
        rows = res["runs"][name].get("rows", [])
        ex = [r["excess_ms"] for r in rows if "excess_ms" in r]
        res["runs"][name]["median_excess_ms"] = float(np.median(ex)) if ex else None
        print(name, res["runs"][name].get("median_excess_ms"),
              res["runs"][name].get("error", "")[:300], flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
