#!/usr/bin/env python3
"""Spike (issue 31): gathered K/V rings of three stages instead of two.

Session 22 (`results/h100-stage-tx.json`) killed one barrier arrival per stage: 0.6-1.8%
faster, so a gathered step is not bound by its copies' arrivals. What is left of the copies'
cost is their latency: a stage's 16 + 16 copies of 8 keys land later than one 128-key copy,
and with two stages the consumer waits for them (dense work, `h200-gather-spike.json`: one
copy 0.987 of cuDNN, 16 copies 0.911). A third stage hides one more step of latency.
Shared memory: Q/O 32 KB + 3 x (K + V 64 KB) + LSE, barriers and Mosaic's own ~2.5 KB;
lowered for the H200 the D 128 forward needs 232,568 of 232,448 bytes (the dq kernel 264 KB),
so the spike runs at D 64, where the forward fits (tested), and decides whether a D 128
forward without its LSE buffer (512 bytes; inference needs no LSE) is worth building.

Predicted (if latency-bound): a gathered full step 0.91 -> ~0.96 of cuDNN per computed tile,
a half step 0.83 -> ~0.6 of a full one: clusters 0.605 -> ~0.64, cubes (skip) 0.50 -> ~0.60,
sliding (skip) 0.66 -> ~0.71 (the two-stage figures: H100, D 128, session 22). Kill
criterion: less than 3% faster than the two-stage template at D 64 on every mask. Stand-in templates
registered for this process only; runs benchmarks/gather.py's loop and checks.

    python3 benchmarks/spikes/gather_stages.py --head-dim 64 --masks cubes,sliding,clusters \
        --out $OUT/h200-gather-stages.json
"""

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

import gather  # noqa: E402
from pallas_kernels import templates as T  # noqa: E402

SPIKE = {"gather_s3": "mgpu_q128_kv128_s2_gather",
         "gather_skip_nopp_s3": "mgpu_q128_kv128_s2_gather_skip_nopp"}
for name, base in SPIKE.items():
    b = T.get(base)
    t = dataclasses.replace(b, name=f"spike_{name}", stages=3)
    T._REGISTRY[t.name] = t
    gather.VARIANTS[name] = (t.name, "gather")

if __name__ == "__main__":
    if "--variants" not in sys.argv:
        sys.argv += ["--variants", "gather,gather_skip_nopp," + ",".join(SPIKE)]
    gather.main()
