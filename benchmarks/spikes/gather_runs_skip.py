#!/usr/bin/env python3
"""Spike (issue 31): gathered steps with copy runs of 32 / 64 keys and warpgroup skipping.

Session 19 measured 8-key gathered steps with skipping (`h200-gather-skip.json`): a half step
costs ~0.83 of a full one, so the step is bound by its 32 copies, not its MMA. With 64-key
runs a stage is 2 + 2 copies. Predicted: cubes 0.49 -> 0.60-0.70 of cuDNN, sliding 0.65 ->
0.70-0.75, clusters below 8-key gathering (run rounding). Kill criterion: cubes below 0.65
(0.80 out of reach on this design). Stand-in templates registered for this process only;
runs benchmarks/gather.py's loop.

    python3 benchmarks/spikes/gather_runs_skip.py --out $OUT/h200-gather-runs-skip.json
"""

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

import gather  # noqa: E402
from pallas_kernels import templates as T  # noqa: E402

base = T.get("mgpu_q128_kv128_s2_gather")
SPIKE = {
    "g8_skip": ("gather", dict(wg_skip=True)),
    "g32": ("gather32", dict(gather_run=32)),
    "g64": ("gather64", dict(gather_run=64)),
    "g32_skip": ("gather32", dict(gather_run=32, wg_skip=True)),
    "g64_skip": ("gather64", dict(gather_run=64, wg_skip=True)),
    "g64_skip_nopp": ("gather64", dict(gather_run=64, wg_skip=True, schedule_barrier=False)),
}
for name, (policy, kw) in SPIKE.items():
    t = dataclasses.replace(base, name=f"spike_{name}", policy=policy,
                            kernel=T.MosaicConfig(gather=True, **kw))
    T._REGISTRY[t.name] = t
    gather.VARIANTS[name] = (t.name, policy)

if __name__ == "__main__":
    if "--variants" not in sys.argv:
        sys.argv += ["--variants", "default,gather," + ",".join(SPIKE)]
    gather.main()
