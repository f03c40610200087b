#!/usr/bin/env python3
"""Read bandwidth of the GPU's L2 and HBM, seen from one reduction kernel (torch ``sum``) over
buffers of growing size: buffers that fit in L2 give its bandwidth (a lower bound: one kernel's
access pattern), large ones HBM's. For NOTES' question whether 64-row units are L2-bound.

    python benchmarks/l2_bandwidth.py --out l2.json
"""

from __future__ import annotations

import argparse
import json
import sys

SIZES_MB = (4, 8, 16, 24, 32, 40, 48, 64, 128, 512, 2048)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    import torch
    dev = torch.device("cuda")
    rows = []
    for mb in SIZES_MB:
        x = torch.randn(mb * 2**20 // 2, dtype=torch.bfloat16, device=dev)
        for _ in range(5):
            x.sum(dtype=torch.float32)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(a.iters):
            start.record()
            x.sum(dtype=torch.float32)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        ms = times[len(times) // 2]
        rows.append({"mb": mb, "ms": ms, "read_tb_s": mb * 2**20 / (ms * 1e-3) / 1e12})
        print(f"{mb:5d} MB  {ms:8.4f} ms  {rows[-1]['read_tb_s']:6.2f} TB/s", file=sys.stderr,
              flush=True)
        del x
    res = {"benchmark": "l2_bandwidth", "device": torch.cuda.get_device_name(),
           "l2_bytes": getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None),
           "op": "torch.sum(bf16 -> f32), median of iters, CUDA events", "rows": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
