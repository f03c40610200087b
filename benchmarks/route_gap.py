#!/usr/bin/env python3
"""Where the device route loses time against the host route on the same mask (issue 31's
``device_vs_host_max``): per family at Wan 480p (shared static bounds, the blocks a traced
argument), the host call, the device call, the device plan alone, and the forward kernel pass
(``dispatch.forward``) alone over the device's plan, over the host plan's arrays passed as
operands, and over the host plan as the host route runs it (constants, row maps included),
the device's and the host's also with the unit-major store and its gather (``rows_owned``
off: the A/B of the in-place store, whose outputs must agree bit for bit),
all under the kernel rule in one process; with ``--trace-dir``, the GPU ops of the host and
device calls from a profiler trace.

    python3 benchmarks/route_gap.py --out $OUT/route-gap.json
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/route_gap.py \
        --families aligned,sliding --trace-dir /tmp/trace --out $OUT/route-gap-trace.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main():
    import gather

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gather.grid_arguments(ap)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--trace-dir")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    import plan_profile
    import tessera_jax as tj
    from pallas_kernels import abi
    from tessera_jax.planning.plan import host_pass
    from tessera_jax.runtime import device_route, dispatch
    from tessera_jax.select import device as select_device
    from tessera_jax.tools import timing
    from tessera_jax.validation import check_shapes

    g = gather.grid(args, "route_gap", xla_flags=os.environ.get("XLA_FLAGS", ""))
    L, H, res = g.L, g.H, g.res
    gpu = jax.default_backend() == "gpu"
    q, k, v, scale = gather.inputs(L, H, g.D)
    opts = tj.Options(interpret=True) if args.interpret else None
    sh = check_shapes(q.shape, k.shape, q.dtype)
    backend = dispatch.resolve(None, sh)
    if gpu:
        res["dense_ms"] = gather.cudnn_ms(q, k, v, scale)

    def ms(f, a):
        jax.block_until_ready(f(*a))
        return timing.time_kernel(f, [a]).ms if gpu else None

    for fam, make in g.families:
        if not g.within_budget(args.budget_s):
            continue
        m = make()
        qb, kb, b = (np.asarray(x) for x in (m.q_bounds, m.kv_bounds, m.blocks))
        mask = tj.BlockMask(qb, kb, jnp.asarray(b))
        consts = select_device.static_parts(mask)
        t, cap = device_route._choose(consts, mask, sh, backend, None)
        row = {"family": fam, "device_template": t.name if t else None}
        try:
            host = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, m, scale=scale,
                                                               options=opts))
            dev = jax.jit(lambda q, k, v, bl: tj.sparse_attention(
                q, k, v, tj.BlockMask(qb, kb, bl), scale=scale, options=opts))
            hp = tj.plan(m, q.shape, k.shape, q.dtype, options=opts)
            row["host_template"], row["host_policy"] = hp.template, hp.policy

            decide = device_route.decides(consts, b.shape, sh, t, cap)

            def plan(bl, t=t, cap=cap):
                ap = device_route.device_plans(
                    q, k, qb, kb, bl, consts=consts, t=t, capacity=cap, decide=decide,
                    budget=select_device.BITMAP_BUDGET_BYTES)
                return ap.fwd, ap.ok

            plan_ok = jax.jit(plan)
            bl = jnp.asarray(b)
            dp, ok = plan_ok(bl)
            if ok is not None:              # a worst case past the budget: the plan's fit
                row["plan_fits"] = bool(ok)
            plan = jax.jit(lambda bl: plan_ok(bl)[0])

            def kernel(q, k, v, units, steps, p=dp, t=t, owned=True):
                pp = abi.PassPlan(units, steps, None, p.tile_q, p.tile_kv, p.q_len_padded,
                                  p.kv_len_padded, p.max_steps, p.all_full,
                                  owned and p.rows_owned)
                return dispatch.forward(pp, t, q, k, v, scale, False, interpret=args.interpret)

            hpp = host_pass(hp, rows=True)
            ht = dispatch.get_template(hp.template)
            kernel_host_const = jax.jit(lambda q, k, v: dispatch.forward(
                hpp, ht, q, k, v, scale, False, interpret=args.interpret))
            # The same plan with the unit-major store and its gather (A/B of the in-place store).
            hpp_g = dataclasses.replace(hpp, rows_owned=False)
            kernel_host_gathered = jax.jit(lambda q, k, v: dispatch.forward(
                hpp_g, ht, q, k, v, scale, False, interpret=args.interpret))
            row["rows_owned"] = [bool(hpp.rows_owned), bool(dp.rows_owned)]

            def kernel_host_args(q, k, v, units, steps, p=hpp):
                pp = abi.PassPlan(units, steps, None, p.tile_q, p.tile_kv, p.q_len_padded,
                                  p.kv_len_padded, p.max_steps, p.all_full, p.rows_owned)
                return dispatch.forward(pp, ht, q, k, v, scale, False, interpret=args.interpret)

            same = (t is not None and t.name == hp.template
                    and np.array_equal(np.asarray(dp.units), hp.units))
            row["same_units"] = bool(same)
            out_h, out_d = host(q, k, v), dev(q, k, v, bl)
            row["host_vs_device_max_abs"] = float(jnp.abs(out_h.astype(jnp.float32)
                                                          - out_d.astype(jnp.float32)).max())
            # In place against gathered, same plan and kernel: bit for bit.
            row["direct_equals_gathered"] = [
                bool(jnp.array_equal(kernel_host_const(q, k, v), kernel_host_gathered(q, k, v))),
                bool(jnp.array_equal(jax.jit(kernel)(q, k, v, dp.units, dp.steps),
                                     jax.jit(functools.partial(kernel, owned=False))(
                                         q, k, v, dp.units, dp.steps)))]
            if gpu and not args.trace_dir:      # a trace run traces only (CUPTI twice aborts)
                row["host_ms"] = ms(host, (q, k, v))
                row["device_ms"] = ms(dev, (q, k, v, bl))
                row["plan_ms"] = ms(plan, (bl,))
                row["kernel_device_plan_ms"] = ms(jax.jit(kernel), (q, k, v, dp.units, dp.steps))
                row["kernel_device_plan_gathered_ms"] = ms(
                    jax.jit(functools.partial(kernel, owned=False)),
                    (q, k, v, dp.units, dp.steps))
                row["kernel_host_const_ms"] = ms(kernel_host_const, (q, k, v))
                row["kernel_host_gathered_ms"] = ms(kernel_host_gathered, (q, k, v))
                row["kernel_host_args_ms"] = ms(jax.jit(kernel_host_args),
                                                (q, k, v, jnp.asarray(hp.units),
                                                 jnp.asarray(hp.steps)))
                sel = m.selected_interactions(H) / (L * L * H)
                row["efficiency_host"] = sel * res["dense_ms"] / row["host_ms"]
                row["efficiency_device"] = sel * res["dense_ms"] / row["device_ms"]
                row["device_vs_host"] = row["device_ms"] / row["host_ms"]
            if args.trace_dir and gpu:
                src = plan_profile._hlo_sources(plan.lower(bl).compile().as_text())
                for name, f, a in (("plan", plan, (bl,)), ("device", dev, (q, k, v, bl)),
                                   ("host", host, (q, k, v))):
                    row[f"{name}_ops"] = ops = plan_profile.traced_ops(
                        f, a, os.path.join(args.trace_dir, fam, name), src)
                    print(json.dumps({name: ops}), flush=True)
        except Exception as e:  # noqa: BLE001 - a row records what failed
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    res["elapsed_s"] = time.time() - g.t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
