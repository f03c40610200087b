#!/usr/bin/env python3
"""The gathering templates' compiled checks (``gpu_check.check_case``), each case in its own
process with faulthandler, so that a crashing kernel (session 19: a segfault, a misaligned
address) ends its case only: as ``gpu_check.cases`` gives them (a Mosaic GPU template's
dk/dv forced to gather) and with the runtime's own dk/dv choice. One JSON line per case.

    python3 benchmarks/gather_diag.py --out $OUT/gather-diag.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(name: str, forced: bool) -> dict:
    sys.path.insert(0, ROOT)
    import zlib

    import numpy as np

    from tessera_jax.tools import gpu_check
    _, options, route, D, Hq, Hkv = next(c for c in gpu_check.cases() if c[0] == name)
    if not forced:
        options = {k: v for k, v in options.items() if k != "options"}
    rng = np.random.default_rng(zlib.crc32(name.encode()))      # as tests/gpu do
    return gpu_check.check_case(rng, D=D, Hq=Hq, Hkv=Hkv, route=route, options=options)


def cases() -> list[tuple[str, bool]]:
    """(case name, dk/dv forced to gather) of every gathering case of this GPU."""
    sys.path.insert(0, ROOT)
    from tessera_jax.tools import gpu_check
    out = []
    for name, options, *_ in gpu_check.cases():
        if "gather" in name:
            out += [(name, True), (name, False)] if "options" in options else [(name, False)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=100)
    ap.add_argument("--budget-s", type=float, default=400)
    args = ap.parse_args()
    if args.child:
        name, forced = json.loads(args.child)
        print("RESULT " + json.dumps(child(name, forced)), flush=True)
        return
    t0 = time.time()
    with open(args.out, "w") as f:
        for name, forced in cases():
            if time.time() - t0 > args.budget_s:
                break
            s = time.time()
            try:
                p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--child",
                                    json.dumps([name, forced])],
                                   capture_output=True, text=True, timeout=args.timeout)
                rc, out, err = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                rc, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
            res = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
            rec = dict(case=name, dkv_forced=forced, rc=rc, s=round(time.time() - s, 1),
                       **(json.loads(res[0]) if res else {}))
            if not res:
                lines = [ln for ln in err.splitlines() if ln.strip()]
                rec["err_head"] = lines[:6]
                rec["err_tail"] = lines[-25:]
            print(json.dumps(rec)[:600], flush=True)
            f.write(json.dumps(rec) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
