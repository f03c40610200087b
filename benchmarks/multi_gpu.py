#!/usr/bin/env python3
"""Issue 19: sparse attention on several GPUs (``tessera_jax.parallel``) against one GPU, and the
head imbalance with and without cost balancing.

Per mask (Wan 720p, 40 query heads, D = 128, bf16; per-head families whose heads differ most in
density), on the N GPUs of one host:

* ``one_gpu_ms``: ``tj.sparse_attention`` on GPU 0, the whole call;
* ``ulysses_ms`` / ``ulysses_balanced_ms``: ``ulysses_attention`` with q, k, v sharded over the
  sequence (all-to-alls included), contiguous heads / heads assigned by plan cost ("lpt");
* ``head_parallel_ms`` / ``head_parallel_balanced_ms``: ``head_parallel_attention`` with q, k, v
  sharded over heads (no communication); balanced: heads permuted once beforehand, as a model
  would permute its projection weights;
* the imbalance (max device / mean device) of both assignments: ``cost_model`` from the
  planner's estimate, ``measured`` from each device's slice timed alone on GPU 0 under the
  kernel rule (CUPTI, L2 flushed), with the template the sharded call uses;
* ``rel_err``: each sharded output against the one-GPU output.

One timing rule for the one-GPU and the N-GPU calls: host wall clock until every shard is ready
(CUPTI sums kernels over all GPUs), no L2 flush (q, k, v are 774 MB each), 3 warm-up calls,
median of 20. ``summary``: ``attention_speedup_{N}gpu_wan720`` (median over masks of
one_gpu_ms / ulysses_balanced_ms), ``head_parallel_speedup_{N}gpu_wan720``,
``head_imbalance_max`` (measured, with balancing), ``head_imbalance_max_unbalanced``, their
``_cost_model`` versions, ``checks_pass``. ``--loop`` adds a Wan2.1-14B 720p loop (``--loop-layers``
of its 40 layers, ``--loop-steps`` steps) on one GPU against N with ``UlyssesAttention``:
``loop_speedup_{N}gpu_wan14b_720p``.

``--one-device``: on one GPU, the sharded wrappers on a 1-device mesh against the plain call
under the kernel rule: ``one_device_overhead_max`` (target: <= 0.02).

``--dry-run``: CPU, 2 simulated devices, the small test grid, few repeats: checks the script.

    python3 benchmarks/multi_gpu.py --out $OUT/h200x2-scale.json --budget-s 540      # h200-x2
    python3 benchmarks/multi_gpu.py --one-device --out $OUT/h200-one-device.json      # one H200
    .venv/bin/python benchmarks/multi_gpu.py --dry-run --out /tmp/multi_gpu_dry.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np

T0 = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# family -> generator parameters; per-head families with unequal heads first.
MASKS = {"xattn": {}, "sparge": {}, "sta_mix": {"window": "mix"}, "jenga": {}, "svg2": {},
         "vsa": {}}


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, 2 simulated devices, tiny")
    ap.add_argument("--one-device", action="store_true",
                    help="1-device mesh against the plain call (one GPU)")
    ap.add_argument("--devices", type=int, default=None, help="GPUs to use (default: all)")
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--grid", default=None, help="default wan720 (dry run: small)")
    ap.add_argument("--heads", type=int, default=None, help="default 40 (dry run: 4)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128 (dry run: 64)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls (default 20)")
    ap.add_argument("--loop", action="store_true", help="also time a Wan2.1-14B loop")
    ap.add_argument("--loop-layers", type=int, default=2)
    ap.add_argument("--loop-steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=540)
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=2")
        args.masks = args.masks if args.masks != ",".join(MASKS) else "xattn,sta_mix"
    args.grid = args.grid or ("small" if args.dry_run else "wan720")
    args.heads = args.heads or (4 if args.dry_run else 40)
    args.head_dim = args.head_dim or (64 if args.dry_run else 128)
    args.repeats = args.repeats or (3 if args.dry_run else 20)
    return args


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))


def build_mask(name: str, grid: str, heads: int):
    from tessera_jax import masks
    params = dict(MASKS[name])
    family = name.split("_")[0]
    return masks.FAMILIES[family](grid, heads=heads, **params)


def main(argv=None):
    args = parse(argv)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import tessera_jax as tj
    from tessera_jax import parallel as tp
    from tessera_jax.tools import timing

    n = args.devices or (1 if args.one_device else jax.device_count())
    devices = jax.devices()[:n]
    wall = timing.wall_rule(repeats=args.repeats, warmup=1 if args.dry_run else 3)
    kernel = timing.KERNEL_RULE if not args.dry_run else wall
    res = dict(command=" ".join([sys.argv[0]] + (argv or sys.argv[1:])),
               env=dict(python=platform.python_version(), jax=jax.__version__,
                        device_kind=devices[0].device_kind, devices=n,
                        backend=jax.default_backend()),
               rules=dict(sharded_vs_one=wall.to_json(), per_device_slices=kernel.to_json()),
               args=vars(args), rows=[], summary={})

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=float)

    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    H, D, dt = args.heads, args.head_dim, jnp.bfloat16
    rng = np.random.default_rng(19)
    for name in args.masks.split(","):
        if time.time() - T0 > args.budget_s:
            log("budget reached")
            break
        row = dict(mask=name, grid=args.grid, heads=H, head_dim=D, devices=n)
        try:
            m = build_mask(name, args.grid, H)
            L = m.Lq
            row.update(L=L, density=m.density, mask_heads=m.num_heads)
            host = [rng.standard_normal((1, L, H, D)).astype(np.float32) for _ in range(3)]
            one = jax.device_put(tuple(x.astype(dt) for x in host), devices[0])
            f1 = jax.jit(lambda q, k, v, m=m: tj.sparse_attention(q, k, v, m))
            ref = f1(*one)
            if args.one_device:
                run_one_device(row, m, one, f1, ref, mesh, kernel, tj, tp, timing, jax)
            else:
                run_sharded(row, m, host, one, f1, ref, mesh, n, wall, kernel, tj, tp, timing,
                            jax, jnp, NamedSharding, P, dt)
        except Exception as e:                                     # noqa: BLE001
            traceback.print_exc()
            row["error"] = repr(e)
        res["rows"].append(row)
        log({k: v for k, v in row.items() if not isinstance(v, (list, dict))})
        save()
    if args.loop and not args.one_device and time.time() - T0 < args.budget_s:
        try:
            res["loop"] = run_loop(args, mesh, n, jax, jnp, tp, timing, wall)
        except Exception as e:                                     # noqa: BLE001
            traceback.print_exc()
            res["loop"] = dict(error=repr(e))
    res["summary"] = summarize(res, n, args)
    save()
    log("summary", res["summary"])
    return res


def run_one_device(row, m, one, f1, ref, mesh, kernel, tj, tp, timing, jax):
    """The 1-device mesh against the plain call, under the kernel rule."""
    t_plain = timing.time_kernel(f1, [one], rule=kernel)
    row.update(plain_ms=t_plain.ms, plain_timing=t_plain.to_json())
    for key, fn in (("head_parallel", tp.head_parallel_attention),
                    ("ulysses", tp.ulysses_attention)):
        f = jax.jit(lambda q, k, v, fn=fn, m=m: fn(q, k, v, m, axis_name="x", mesh=mesh))
        row[f"{key}_rel_err"] = rel_err(f(*one), ref)
        t = timing.time_kernel(f, [one], rule=kernel)
        row.update({f"{key}_ms": t.ms, f"{key}_over_plain": t.ms / t_plain.ms})


def run_sharded(row, m, host, one, f1, ref, mesh, n, wall, kernel, tj, tp, timing, jax, jnp,
                NamedSharding, P, dt):
    """One GPU against N: Ulysses and head parallel, contiguous and balanced; imbalance."""
    H = host[0].shape[2]
    L = host[0].shape[1]
    row["one_gpu_ms"] = timing.time_kernel(f1, [one], rule=wall).ms
    costs = tp.head_costs(m, host[0].shape, host[1].shape, dt)
    rep = tp.balance_report(costs, n)
    heads = {"contiguous": tp.contiguous_heads(H, n), "balanced": rep.heads}
    row.update(cost_model_imbalance=rep.balanced, cost_model_imbalance_unbalanced=rep.unbalanced,
               balanced_heads=rep.heads.tolist())

    seq = NamedSharding(mesh, P(None, "x", None, None))
    hsh = NamedSharding(mesh, P(None, None, "x", None))
    if L % n == 0:
        xs = jax.device_put(tuple(x.astype(dt) for x in host), seq)
        for key, h in (("ulysses", None), ("ulysses_balanced", "lpt")):
            f = jax.jit(lambda q, k, v, h=h: tp.ulysses_attention(q, k, v, m, axis_name="x",
                                                                  mesh=mesh, heads=h))
            row[f"{key}_rel_err"] = rel_err(f(*xs), ref)
            row[f"{key}_ms"] = timing.time_kernel(f, [xs], rule=wall).ms
    for key, order in (("head_parallel", "contiguous"), ("head_parallel_balanced", "balanced")):
        perm = heads[order].reshape(-1)
        mp = tj.BlockMask(m.q_bounds, m.kv_bounds, m.blocks[perm]) if m.num_heads > 1 else m
        xs = jax.device_put(tuple(x[:, :, perm].astype(dt) for x in host), hsh)
        f = jax.jit(lambda q, k, v, mp=mp: tp.head_parallel_attention(q, k, v, mp,
                                                                      axis_name="x", mesh=mesh))
        out = np.asarray(f(*xs), np.float32)
        row[f"{key}_rel_err"] = rel_err(out[:, :, np.argsort(perm)], ref)
        row[f"{key}_ms"] = timing.time_kernel(f, [xs], rule=wall).ms
    # Each device's slice alone on GPU 0, with the template and policy the sharded call uses.
    for order, h in heads.items():
        if m.num_heads == 1:
            break
        plans = tp.device_plans(m, h, (1, L, H // n, host[0].shape[3]),
                                (1, L, H // n, host[0].shape[3]), dt)
        times = []
        for d, md in enumerate(tp.local_masks(m, h)):
            p = plans.plans[d]
            fd = jax.jit(lambda q, k, v, md=md, p=p: tj.sparse_attention(
                q, k, v, md, template=p.template, policy=p.policy))
            xs = jax.device_put(tuple(x[:, :, h[d]].astype(dt) for x in host),
                                jax.devices()[0])
            times.append(timing.time_kernel(fd, [xs], rule=kernel).ms)
        sfx = "" if order == "balanced" else "_unbalanced"
        row[f"measured_device_ms{sfx}"] = times
        row[f"measured_imbalance{sfx}"] = max(times) / statistics.fmean(times)
        row["template"] = plans.template
    for key in ("ulysses", "ulysses_balanced", "head_parallel", "head_parallel_balanced"):
        if f"{key}_ms" in row:
            row[f"{key}_speedup"] = row["one_gpu_ms"] / row[f"{key}_ms"]


def run_loop(args, mesh, n, jax, jnp, tp, timing, wall) -> dict:
    """Wan2.1-14B at 720p (a layer subset, random weights) on one GPU and on N with Ulysses."""
    import flax.nnx as nnx
    from tessera_jax.flax import AttentionOptions, MaskSchedule
    from tessera_jax.models import WAN21_14B, WanModel, make_sampler
    cfg = WAN21_14B.replace(num_layers=args.loop_layers)
    frames, height, width = (81, 720, 1280)
    if args.dry_run:
        cfg = cfg.replace(num_heads=4, head_dim=16, ffn_dim=64, text_dim=32, text_len=8,
                          in_channels=4, out_channels=4, freq_dim=32)
        frames, height, width = (5, 64, 64)
    grid = cfg.token_grid(frames, height, width)
    graph, state = nnx.split(nnx.eval_shape(lambda: WanModel(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: jnp.asarray((0.02 * rng.standard_normal(s.shape))
                                               .astype(np.float32)).astype(jnp.bfloat16), state)
    model = nnx.merge(graph, state)
    L = int(np.prod(grid))
    block = 128 if not args.dry_run else 16
    nb = -(-L // block)
    dens = np.linspace(0.05, 0.6, cfg.num_heads)
    blocks = rng.random((cfg.num_heads, nb, nb)) < dens[:, None, None]
    blocks[:, np.arange(nb), np.arange(nb)] = True
    import tessera_jax as tj
    mask = tj.BlockMask.uniform(L, L, block, block, blocks)
    sched = MaskSchedule.constant(mask, cfg.num_layers, args.loop_steps)
    lat = cfg.latent_shape(frames, height, width)
    noise = jnp.asarray(rng.standard_normal((1,) + lat + (cfg.in_channels,)), jnp.bfloat16)
    ctx = jnp.asarray(rng.standard_normal((1, cfg.text_len, cfg.text_dim)), jnp.bfloat16)
    one = make_sampler(model, sched)
    many = make_sampler(model, sched, options=AttentionOptions(
        sparse_fn=tp.UlyssesAttention(mesh, "x", heads="lpt")))
    loop_rule = wall.replace(repeats=max(3, min(wall.repeats, 5)), warmup=1)
    out1, outn = one(noise, ctx), many(noise, ctx)
    t1 = timing.time_kernel(one, [(noise, ctx)], rule=loop_rule).ms
    tn = timing.time_kernel(many, [(noise, ctx)], rule=loop_rule).ms
    return dict(layers=cfg.num_layers, steps=args.loop_steps, tokens=L, one_gpu_ms=t1,
                ulysses_ms=tn, speedup=t1 / tn, rel_err=rel_err(outn, out1),
                rule=loop_rule.to_json())


def summarize(res, n, args) -> dict:
    rows = [r for r in res["rows"] if "error" not in r]
    s = {}
    if args.one_device:
        over = [r[f"{k}_over_plain"] for r in rows for k in ("head_parallel", "ulysses")
                if f"{k}_over_plain" in r]
        s["one_device_overhead_max"] = max(over) - 1 if over else None
        s["one_device_within_2pct"] = bool(over) and max(over) <= 1.02
        s["checks_pass"] = bool(rows) and all(
            r.get(f"{k}_rel_err", 1) < 2e-2 for r in rows for k in ("head_parallel", "ulysses"))
        return s

    def med(key):
        xs = [r[key] for r in rows if key in r]
        return statistics.median(xs) if xs else None

    def mx(key):
        xs = [r[key] for r in rows if key in r]
        return max(xs) if xs else None

    tag = f"{n}gpu_{args.grid}"
    s[f"attention_speedup_{tag}"] = med("ulysses_balanced_speedup")
    s[f"attention_speedup_{tag}_min"] = min(
        (r["ulysses_balanced_speedup"] for r in rows if "ulysses_balanced_speedup" in r),
        default=None)
    s[f"attention_speedup_{tag}_unbalanced"] = med("ulysses_speedup")
    s[f"head_parallel_speedup_{tag}"] = med("head_parallel_balanced_speedup")
    s[f"head_parallel_speedup_{tag}_unbalanced"] = med("head_parallel_speedup")
    s["head_imbalance_max"] = mx("measured_imbalance")
    s["head_imbalance_max_unbalanced"] = mx("measured_imbalance_unbalanced")
    s["head_imbalance_max_cost_model"] = mx("cost_model_imbalance")
    s["head_imbalance_max_unbalanced_cost_model"] = mx("cost_model_imbalance_unbalanced")
    errs = [r[k] for r in rows for k in r if k.endswith("_rel_err")]
    s["checks_pass"] = bool(errs) and max(errs) < 2e-2 and len(rows) == len(res["rows"])
    loop = res.get("loop")
    if loop and "speedup" in loop:
        s[f"loop_speedup_{n}gpu_wan14b_720p" if not args.dry_run else "loop_speedup_dry_run"] = \
            loop["speedup"]
    return s


if __name__ == "__main__":
    main()
