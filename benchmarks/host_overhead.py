#!/usr/bin/env python3
"""Host time an eager ``tj.sparse_attention`` call adds around its compiled work (issue 16:
<= 0.1 ms for a mask already planned). Tiny shapes (L = 64, one head, D = 8) so the compute is
negligible; host wall clock per call (median of ``--calls``), against the same call inside one
``jax.jit`` (dispatch + compute only). Cases: a static mask (host plan, front cache hit), a
device mask (jax arrays), device blocks with static bounds, a static mask with per-head bounds.

    python benchmarks/host_overhead.py --out benchmarks/results/cpu-host-overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def median_ms(f, calls):
    import jax
    for _ in range(10):
        jax.block_until_ready(f())
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = f()
        ts.append(time.perf_counter() - t0)
    jax.block_until_ready(r)
    return float(np.median(ts) * 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj

    rng = np.random.default_rng(0)
    L, H, D = 64, 1, 8
    q, k, v = (jnp.asarray(rng.standard_normal((1, L, H, D)), jnp.float32) for _ in range(3))
    static = tj.BlockMask.uniform(L, L, 32, 32, rng.random((H, 2, 2)) < 0.6)
    cases = {
        "static_mask": static,
        "device_mask": static.to_device(),
        "device_blocks_static_bounds": tj.BlockMask(np.asarray(static.q_bounds),
                                                    np.asarray(static.kv_bounds),
                                                    jnp.asarray(static.blocks)),
        "static_per_head_bounds": tj.BlockMask(np.stack([static.q_bounds]), static.kv_bounds,
                                               static.blocks),
    }
    rows = []
    for name, m in cases.items():
        jitted = jax.jit(lambda q, k, v, m: tj.sparse_attention(q, k, v, m))
        eager_ms = median_ms(lambda: tj.sparse_attention(q, k, v, m), args.calls)
        jit_ms = median_ms(lambda: jitted(q, k, v, m), args.calls)
        rows.append(dict(case=name, eager_ms=eager_ms, jitted_ms=jit_ms,
                         host_overhead_ms=eager_ms - jit_ms))
        print(rows[-1], flush=True)
    res = dict(command=" ".join(sys.argv), env=dict(python=platform.python_version(),
               jax=jax.__version__, backend=jax.default_backend(), machine=platform.machine()),
               rows=rows, summary=dict(host_overhead_ms_max=max(r["host_overhead_ms"]
                                                                for r in rows)))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(res["summary"])


if __name__ == "__main__":
    main()
