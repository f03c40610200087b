#!/usr/bin/env python3
"""Where the device planner's time goes for traced per-head bounds (issue 31's
``perhead_bounds_vs_shared``): per family at Wan 480p, ``plan_on_device``'s stages timed as
prefixes (axes, step rows, compaction, bitmap words, units) under the kernel rule, and the
GPU ops of the whole plan from a profiler trace (perfetto JSON), each fusion named with the
source lines XLA's metadata gives it.

    python3 benchmarks/plan_profile.py --out $OUT/plan-profile.json
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/plan_profile.py \
        --families cubes --trace-dir /tmp/trace --out $OUT/plan-profile-trace.json

(command buffers off: the trace then names each fusion)
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


#: Plans traced per family: with 10 (and command buffers on) the GPU profiler dropped
#: activity records and aborted (session 25, H200).
TRACE_CALLS = 3


def _stages(blocks, qb, kb, *, H, L, t, capacity):
    """Prefix functions of ``plan_on_device`` (the same calls in the same order)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import abi
    from tessera_jax.planning import device as D

    def axes(blocks, qb, kb):
        return D._axes_of(qb, kb, blocks.shape, L, L, t.tile_q, t.tile_kv, True, capacity)

    def rows(blocks, qb, kb):
        qx, kx = axes(blocks, qb, kb)
        return qx, kx, D._step_rows(blocks, qx, kx, t.tile_q, t.tile_kv, capacity)

    def compact(blocks, qb, kb):
        qx, kx, (r, any_sel, part, need, n_need) = rows(blocks, qb, kb)
        rb = abi.bitmap_rows(t.tile_q, t.tile_kv)
        return qx, kx, D._compact(r, any_sel, capacity * rb), part, need, n_need

    def words(blocks, qb, kb):
        qx, kx, (steps, ptr, cnt), part, need, n_need = compact(blocks, qb, kb)
        if capacity:
            steps = jax.lax.cond(n_need > 0, lambda st: D._bitmap_words(
                st, blocks, need, n_need, qx.bounds, kx.bounds, qx.org, qx.lo, qx.hi, kx.org,
                kx.lo, kx.hi, t.tile_q, t.tile_kv, capacity, None, None),
                lambda st: st, steps)
        return steps, ptr, cnt

    def full(blocks, qb, kb):
        return D.plan_on_device(blocks, qb, kb, num_q_heads=H, q_len=L, kv_len=L,
                                tile_q=t.tile_q, tile_kv=t.tile_kv, bitmap_capacity=capacity)

    def leaves(f):
        return jax.jit(lambda *a: [x for x in jax.tree.leaves(f(*a))
                                   if isinstance(x, jax.Array)])

    return {n: leaves(f) for n, f in (("axes", axes), ("rows", rows), ("compact", compact),
                                       ("words", words), ("full", full))}


def _hlo_sources(text: str) -> dict:
    """{fusion / instruction name: its jax ops} of an HLO module's text (op_name tails; a
    fusion's are those of the computation it calls, most frequent first)."""
    comp, calls, lines = None, {}, collections.defaultdict(collections.Counter)
    for line in text.splitlines():
        h = re.match(r"\s*(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if h and "=" not in line.split("{")[0]:
            comp = h.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not m:
            continue
        c = re.search(r"calls=%?([\w.\-]+)", line)
        if c:
            calls[m.group(1)] = c.group(1)
        f = re.search(r'op_name="([^"]*)"', line)
        if f:
            parts = f.group(1).split("/")
            scope = [x for x in parts if x.startswith("plan_")]
            key = "/".join(scope[:1] + parts[-2:])
            lines[m.group(1)][key] += 1
            lines[comp][key] += 1
    out = {}
    for name in set(lines) | set(calls):
        cnt = lines.get(calls.get(name), collections.Counter()) + lines.get(name, collections.Counter())
        out[name] = out[name.replace(".", "_")] = " ".join(k for k, _ in cnt.most_common(4))
    return out


def _trace_ops(trace_dir: str) -> list:
    """(name, total us, count) of the device events of the newest perfetto trace."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        return []
    with gzip.open(files[-1]) as f:
        tr = json.load(f)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    pids = {e["pid"]: e["args"]["name"] for e in ev
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot, cnt = collections.Counter(), collections.Counter()
    for e in ev:
        if e.get("ph") == "X" and "gpu" in str(pids.get(e.get("pid"), "")).lower():
            n = (e.get("args") or {}).get("hlo_op") or e["name"]
            tot[n] += e.get("dur", 0)
            cnt[n] += 1
    return [(n, tot[n], cnt[n]) for n, _ in tot.most_common(25)]


def traced_ops(fn, args, trace_dir: str, src: dict) -> list:
    """The GPU ops of ``TRACE_CALLS`` calls of ``fn(*args)`` (a perfetto trace in
    ``trace_dir``): name, microseconds a call, count, and the jax ops ``src``
    (``_hlo_sources``) names for it."""
    import jax

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(TRACE_CALLS):
            jax.block_until_ready(fn(*args))
    return [dict(name=n, us_per_call=us / TRACE_CALLS, count=c,
                 src=src.get(n.split(":")[0].strip(), "")) for n, us, c in _trace_ops(trace_dir)]


def main():
    import gather

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gather.grid_arguments(ap, families="sliding,aligned,cubes")
    ap.add_argument("--template", default=None, help="forced template (default: the route's)")
    ap.add_argument("--trace-dir")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    import tessera_jax as tj
    from tessera_jax.runtime import device_route, dispatch
    from tessera_jax.select import device as select_device
    from tessera_jax.tools import timing
    from tessera_jax.validation import check_shapes

    g = gather.grid(args, "plan_profile")
    L, H, res = g.L, g.H, g.res
    gpu = jax.default_backend() == "gpu"
    sh = check_shapes((1, L, H, g.D), (1, L, H, g.D), jnp.bfloat16)
    backend = dispatch.resolve(None, sh)
    for fam, make in g.families:
        if not g.within_budget(args.budget_s):
            continue
        m = make()
        qb, kb, b = (np.asarray(x) for x in (m.q_bounds, m.kv_bounds, m.blocks))
        bh, qbh, kbh = gather.per_head(m, H)
        mask = tj.BlockMask(qbh, kbh, bh)
        consts = select_device.static_parts(mask)
        forced = dispatch.get_template(args.template) if args.template else None
        t, cap = device_route._choose(consts, mask, sh, backend, forced)
        first = device_route._first_room(t, cap, bh.shape, L, L, tj.Options())
        cap1 = first[0] if first else cap
        row = {"family": fam, "template": t.name, "capacity": int(cap1)}
        fs = _stages(bh, qbh, kbh, H=H, L=L, t=t, capacity=cap1)
        for name, f in fs.items():
            jax.block_until_ready(f(bh, qbh, kbh))
            if gpu:
                row[f"{name}_ms"] = timing.time_kernel(f, [(bh, qbh, kbh)]).ms
        text = fs["full"].lower(bh, qbh, kbh).compile().as_text()
        src = _hlo_sources(text)
        if args.trace_dir and gpu:
            row["ops"] = traced_ops(fs["full"], (bh, qbh, kbh),
                                    os.path.join(args.trace_dir, fam), src)
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    res["elapsed_s"] = time.time() - g.t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
