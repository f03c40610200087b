"""CPU benchmark of the XLA block-sparse path against the dense reference (issue 2).

Lq = Lkv = 8192, H = 4, D = 64, 64-token blocks, density 0.1, float32. Each variant runs in its
own subprocess so that its peak resident memory is its own; XLA's compiled memory analysis
(temporary buffers) is reported beside it. Writes ``--out`` (default /tmp/cpu-xla.json; the
official file is benchmarks/results/cpu-xla.json).

    .venv/bin/python benchmarks/xla_path.py --out benchmarks/results/cpu-xla.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tessera_jax.tools import timing  # noqa: E402

L, H, D, BLOCK, DENSITY = 8192, 4, 64, 64, 0.1


def _problem():
    import jax.numpy as jnp
    import numpy as np

    import tessera_jax as tj
    rng = np.random.default_rng(0)
    blocks = rng.random((H, L // BLOCK, L // BLOCK)) < DENSITY
    mask = tj.BlockMask.uniform(L, L, BLOCK, BLOCK, blocks)
    q, k, v = (jnp.asarray(rng.standard_normal((1, L, H, D)), jnp.float32) for _ in range(3))
    return q, k, v, mask


def child(which: str, repeats: int) -> dict:
    import jax

    import tessera_jax as tj
    q, k, v, mask = _problem()
    if which == "xla":
        fn = lambda q, k, v: tj.sparse_attention(q, k, v, mask, backend="xla")  # noqa: E731
    else:
        fn = lambda q, k, v: tj.reference_attention(q, k, v, mask)  # noqa: E731
    # Timed as users call it (eagerly; both entry points jit inside); XLA's memory analysis
    # of the same computation under an outer jit gives its temporary buffers.
    mem = jax.jit(fn).lower(q, k, v).compile().memory_analysis()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Both variants under one rule: host wall clock, one warm-up call, median of --repeats.
    t = timing.time_kernel(fn, [(q, k, v)], rule=timing.wall_rule(repeats, warmup=1))
    out = fn(q, k, v).block_until_ready()
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = [x / 1e3 for x in t.samples]
    result = {"which": which, "times_s": times, "median_s": t.ms / 1e3, "rule": t.rule.name,
              "rss_before_run_bytes": rss_before, "rss_peak_bytes": rss_peak,
              "rss_increase_bytes": rss_peak - rss_before,
              "xla_temp_bytes": getattr(mem, "temp_size_in_bytes", None),
              "xla_output_bytes": getattr(mem, "output_size_in_bytes", None)}
    if which == "xla":
        import numpy as np
        ref = tj.reference_attention(q, k, v, mask)
        result["rel_error_vs_reference"] = float(
            np.linalg.norm(np.asarray(out) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref)))
        result["plan"] = tj.plan(mask, q.shape, k.shape, q.dtype).describe()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=["xla", "reference"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="/tmp/cpu-xla.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats)))
        return
    from tqdm import tqdm
    runs = {}
    for which in tqdm(["xla", "reference"], desc="variants"):
        p = subprocess.run([sys.executable, __file__, "--child", which, "--repeats",
                            str(args.repeats)], capture_output=True, text=True, check=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
        runs[which] = json.loads(p.stdout.strip().splitlines()[-1])
    x, r = runs["xla"], runs["reference"]
    import jax
    summary = {
        "timing_rule": timing.assert_same_rule([x, r], "xla_path"),
        "speedup_vs_reference": r["median_s"] / x["median_s"],
        "peak_rss_ratio": x["rss_peak_bytes"] / r["rss_peak_bytes"],
        "rss_increase_ratio": x["rss_increase_bytes"] / max(r["rss_increase_bytes"], 1),
        "xla_temp_ratio": (x["xla_temp_bytes"] / r["xla_temp_bytes"]
                           if x["xla_temp_bytes"] and r["xla_temp_bytes"] else None),
        "rel_error_vs_reference": x["rel_error_vs_reference"],
    }
    summary["meets_targets"] = bool(summary["speedup_vs_reference"] >= 5
                                    and summary["rss_increase_ratio"] <= 0.25
                                    and (summary["xla_temp_ratio"] or 0) <= 0.25)
    record = {"command": "python benchmarks/xla_path.py", "shape": {"L": L, "H": H, "D": D,
              "block": BLOCK, "density": DENSITY, "dtype": "float32", "B": 1},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "jax": jax.__version__, "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "runs": runs, "summary": summary}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"xla median {x['median_s'] * 1e3:.0f} ms, reference {r['median_s'] * 1e3:.0f} ms, "
          f"speedup {summary['speedup_vs_reference']:.1f}x")
    print(f"memory: RSS increase ratio {summary['rss_increase_ratio']:.3f}, XLA temp ratio "
          f"{summary['xla_temp_ratio']:.3f}, peak RSS ratio {summary['peak_rss_ratio']:.3f}")
    print(f"rel. error {summary['rel_error_vs_reference']:.2e}; wrote {args.out}")


if __name__ == "__main__":
    main()
