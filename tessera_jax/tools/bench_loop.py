"""End-to-end benchmark: the jit-compiled 50-step denoising loop with dense vs sparse attention.

    python -m tessera_jax.tools.bench_loop                      # GPU: all cases -> benchmarks/results/h200-loop.json
    python -m tessera_jax.tools.bench_loop --models wan13b_480p # one case (results merge into --out)
    python -m tessera_jax.tools.bench_loop --tiny --out /tmp/x.json   # CPU smoke run, tiny models

Per case it times three compiled loops on the same random weights and noise:
  dense  -- every layer and step dense, ``jax.nn.dot_product_attention`` (cuDNN on GPU);
  tessera -- the case's mask schedule through ``tessera_jax.sparse_attention`` (ranked plans),
            dense warm-up steps through cuDNN;
  fixed  -- the same schedule, one fixed template and the ``keep`` policy for every mask
            (a fixed single-template plan, no ranking).
It also times attention alone for every distinct mask (median of ``--attn-repeats`` calls) and
one dense forward, giving attention's share of step time, the attention-only speedup over the
loop's attention calls and the Amdahl prediction of the loop time:
  predicted = T_dense_loop - sum over (step, layer) of (t_dense_attn - t_attn(mask(step, layer)))
and ``overhead_outside_attention = measured / predicted - 1``.

Cases with a layer subset (``layers_run < layers_total``) report loop times extrapolated per
layer: ``T_full = T_measured * layers_total / layers_run`` (embedding and head are < 1% of a
step at these sizes); the JSON marks them ``extrapolated: true`` and keeps the measured times.
Speedups are ratios of measured loops, which the scaling does not change.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import flax.nnx as nnx

from tessera_jax.flax import AttentionOptions, MaskSchedule, attention
from tessera_jax.mask import BlockMask
from tessera_jax.tools import timing
from tessera_jax.models import (HUNYUAN15, WAN21_14B, WAN21_1_3B, HunyuanModel, WanModel,
                                make_forward, make_sampler)

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency; keep the bench usable without it
    def tqdm(it=None, **kw):
        return it

DEFAULT_OUT = os.path.join("benchmarks", "results", "h200-loop.json")


# --- cases ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark configuration: a model, a video size, a mask family and a schedule shape."""

    name: str
    model: str                       # "wan" | "hunyuan"
    config: object                   # WanConfig | HunyuanConfig with layers_total layers
    frames: int
    height: int
    width: int
    layers_run: int
    steps: int
    dense_steps: int
    family: str                      # a tessera_jax.masks.families generator name
    family_params: tuple = ()
    text_len: int = 0                # joint text tokens (HunyuanVideo), 0 for Wan
    mask_seeds: int = 0              # layer l uses seed l % mask_seeds (0: seed l, all distinct)

    @property
    def layers_total(self) -> int:
        return self.config.num_layers


CASES = {
    # Wan2.1-1.3B T2V 480p (832x480, 81 frames): all 30 layers, 50 steps. Sliding-tile attention
    # with a per-head window mix, a different head draw per layer, 12 dense warm-up steps.
    # Six per-layer head draws cycle over the layers (6 distinct masks: bounds attention-only
    # compile time, which is per mask).
    "wan13b_480p": Case("wan13b_480p", "wan", WAN21_1_3B, 81, 480, 832, 30, 50, 12, "sta",
                        (("window", "mix"),), mask_seeds=6),
    # Wan2.1-14B T2V 720p (1280x720): 2 of 40 layers, radial attention (one shared static mask).
    "wan14b_720p": Case("wan14b_720p", "wan", WAN21_14B, 81, 720, 1280, 2, 50, 12, "radial",
                        (("decay", 0.2),)),
    # HunyuanVideo-1.5 720p (1280x720, 121 frames): 2 of 54 layers, SSTA per head (top-k 32 at
    # T=31), 256 joint text tokens, no dense steps (as released).
    "hunyuan15_720p": Case("hunyuan15_720p", "hunyuan", HUNYUAN15.replace(text_len=256), 121, 720,
                           1280, 2, 50, 0, "ssta", (("topk", 32),), text_len=256),
}


def tiny_cases(steps: int = 3) -> dict[str, Case]:
    """CPU-sized versions of the cases (2 layers, 2 heads of 16, small grids; wan14b_720p runs
    1 of its 2 layers to exercise the per-layer extrapolation)."""
    wan = WAN21_1_3B.replace(num_layers=2, num_heads=2, head_dim=16, ffn_dim=64, text_dim=32,
                             text_len=8, in_channels=4, out_channels=4, freq_dim=32)
    hy = HUNYUAN15.replace(num_layers=2, num_heads=2, head_dim=16, mlp_dim=64, text_dim=32,
                           text_len=8, in_channels=4, out_channels=4, freq_dim=32,
                           rope_dims=(4, 6, 6))
    # Wan latent (5, 12, 16) -> grid (5, 6, 8); Hunyuan latent (5, 4, 6) with patch 1 -> (5, 4, 6)
    return {
        "wan13b_480p": Case("wan13b_480p", "wan", wan, 17, 96, 128, 2, steps, 1, "sta",
                            (("window", "mix"), ("tile", (2, 2, 4)))),
        "wan14b_720p": Case("wan14b_720p", "wan", wan, 17, 96, 128, 1, steps, 1, "radial",
                            (("decay", 0.5), ("block", 16))),
        "hunyuan15_720p": Case("hunyuan15_720p", "hunyuan", hy, 17, 64, 96, 2, steps, 0, "ssta",
                               (("topk", 3), ("tile", (2, 2, 3)), ("window", (1, 1, 1))),
                               text_len=8),
    }


# --- masks ---------------------------------------------------------------------------------------
def _grid_of(case: Case, heads: int, tokens_thw):
    from tessera_jax.masks import grids as G
    t, h, w = tokens_thw
    joint = case.text_len if case.model == "hunyuan" else 0
    cross = case.config.text_len if case.model == "wan" else 0
    return G.Grid(f"bench_{case.name}", t, h, w, heads, joint, cross, case.model)


def _token_order(case: Case, grid, params: dict):
    from tessera_jax.masks import grids as G
    if case.family in ("sta", "ssta", "moba"):
        return np.asarray(G.tile_layout(grid, tuple(params.get("tile", (6, 8, 8)))).order)
    if case.family == "radial" and params.get("layout", "frame") == "frame":
        return np.asarray(G.frame_layout(grid, int(params.get("block", 128))).order)
    return None


def _fallback_mask(L: int, heads: int, block: int, seed: int, text: int) -> BlockMask:
    """Banded per-head block mask (used only when tessera_jax.masks can't be imported)."""
    rng = np.random.default_rng(seed)
    n = -(-L // block)
    i = np.arange(n)
    widths = rng.integers(1, max(2, n // 6), size=heads)
    blocks = np.abs(i[None, :, None] - i[None, None, :]) <= widths[:, None, None]
    m = BlockMask.uniform(L, L, block, block, blocks)
    if text:
        from tessera_jax.models.common import extend_with_text
        m = extend_with_text(m, text)
    return m


def build_schedule(case: Case, heads: int, tokens_thw) -> tuple[MaskSchedule, np.ndarray | None, str]:
    """The case's schedule (one mask per layer: seed = layer), its token order, and the source."""
    params = dict(case.family_params)
    L = int(np.prod(tokens_thw))
    try:
        from tessera_jax.masks import families as F
        grid = _grid_of(case, heads, tokens_thw)
        fn = getattr(F, case.family)
        seeds = [layer % case.mask_seeds if case.mask_seeds else layer
                 for layer in range(case.layers_run)]
        by_seed = {sd: fn(grid, heads=heads, seed=sd, text=case.text_len, **params)
                   for sd in dict.fromkeys(seeds)}
        masks = [by_seed[sd] for sd in seeds]
        # Equal masks must be the same object so the schedule sees one variant per tuple.
        uniq: dict[BlockMask, BlockMask] = {}
        masks = [uniq.setdefault(m, m) for m in masks]
        order = _token_order(case, grid, params)
        source = f"tessera_jax.masks.families.{case.family}({params})"
    except ImportError as e:  # the mask generators are optional for this benchmark
        block = 128 if L >= 4096 else 16
        masks = [_fallback_mask(L, heads, block, layer, case.text_len) for layer in range(case.layers_run)]
        order = None
        source = f"fallback banded masks (tessera_jax.masks unavailable: {e})"
    sched = MaskSchedule.warmup(masks, case.layers_run, case.steps, dense_steps=case.dense_steps)
    return sched, order, source


# --- timing --------------------------------------------------------------------------------------
def _block(x):
    return jax.block_until_ready(x)


def loop_rule(repeats: int, warmup: int = 1, n_inputs: int = 1) -> timing.TimingRule:
    """The rule of every time here (dense, tessera and fixed alike): host wall clock, the
    loop's own clock (attention alone feeds the Amdahl prediction of the loop), inputs rotated
    when there are several."""
    return timing.wall_rule(repeats, warmup, l2="rotate" if n_inputs > 1 else "none")


def time_calls(fn: Callable, args_list, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call under ``loop_rule``, rotating through ``args_list`` (fresh random
    inputs, never zeros)."""
    t = timing.time_kernel(fn, args_list, rule=loop_rule(repeats, warmup, len(args_list)))
    return [x / 1e3 for x in t.samples]


def _median(xs):
    return float(statistics.median(xs))


def _init_model(case: Case, dtype: str, seed: int):
    cfg = case.config.replace(num_layers=case.layers_run, dtype=dtype, param_dtype=dtype)
    cls = WanModel if case.model == "wan" else HunyuanModel
    if jax.default_backend() == "cpu":   # tiny: eager init compiles less than one big init program
        return cls(cfg, rngs=nnx.Rngs(seed)), cfg
    return nnx.jit(lambda: cls(cfg, rngs=nnx.Rngs(seed)))(), cfg   # GPU: one program, on device


def run_case(case: Case, args, progress) -> dict:
    dtype = args.dtype
    model, cfg = _init_model(case, dtype, args.seed)
    latent = cfg.latent_shape(case.frames, case.height, case.width)
    tokens_thw = cfg.token_grid(case.frames, case.height, case.width)
    Lv = int(np.prod(tokens_thw))
    L = Lv + case.text_len
    H, D = cfg.num_heads, cfg.head_dim
    progress.set_postfix_str(f"{case.name}: masks")
    t0 = time.perf_counter()
    sched, order, source = build_schedule(case, H, tokens_thw)
    mask_build_s = time.perf_counter() - t0

    key = jax.random.key(args.seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    noise = jax.random.normal(k1, (1, *latent, cfg.in_channels), jnp.float32)  # f32 latents
    tl = case.text_len if case.model == "hunyuan" else cfg.text_len
    context = jax.random.normal(k2, (1, tl, cfg.text_dim), dtype)

    dense_impl = args.dense_implementation
    if dense_impl == "auto":
        dense_impl = "cudnn" if jax.default_backend() == "gpu" and dtype != "float32" else None
    backend = args.backend
    fixed_template = args.fixed_template or _default_template(backend, H, D, dtype, L)
    variants = {
        "dense": (MaskSchedule.dense(case.layers_run, case.steps),
                  AttentionOptions(dense_implementation=dense_impl)),
        "tessera": (sched, AttentionOptions(backend=backend, dense_implementation=dense_impl)),
        "fixed": (sched, AttentionOptions(template=fixed_template, policy=args.fixed_policy,
                                          dense_implementation=dense_impl)),
    }
    res: dict = dict(
        case=case.name, model=case.model, layers_total=case.layers_total,
        layers_run=case.layers_run, extrapolated=case.layers_run < case.layers_total,
        steps=case.steps, dense_steps=case.dense_steps, video=[case.frames, case.height, case.width],
        latent=list(latent), token_grid=list(tokens_thw), video_tokens=Lv,
        joint_text_tokens=case.text_len, cross_text_tokens=cfg.text_len if case.model == "wan" else 0,
        heads=H, head_dim=D, hidden=cfg.dim, dtype=dtype, mask_source=source,
        mask_build_s=mask_build_s, schedule=repr(sched), variants=len(sched.variants),
        mean_density_sparse_steps=float(np.mean([m.density for row in sched.table for m in row
                                                 if m is not None] or [1.0])),
        token_order="family layout" if order is not None else "frame-major",
        dense_implementation=dense_impl, backend=backend, fixed_template=fixed_template,
        fixed_policy=args.fixed_policy, loops={}, attention={},
        timing={"attention": loop_rule(args.attn_repeats, 1, 2).to_json(),
                "step": loop_rule(args.step_repeats).to_json(),
                "loop": loop_rule(args.loop_repeats, warmup=0).to_json()},
    )

    # -- attention alone: dense and every distinct mask, on random q, k, v of the layer's shape.
    progress.set_postfix_str(f"{case.name}: attention")
    qkv = [tuple(jax.random.normal(k, (1, L, H, D), dtype) for k in jax.random.split(kk, 3))
           for kk in jax.random.split(k3, 2)]
    distinct = list(dict.fromkeys(m for row in sched.table for m in row if m is not None))
    attn_t: dict = {}
    for vname in ("dense", "tessera", "fixed"):
        opts = variants[vname][1]
        per = {}
        targets = [None] if vname == "dense" else distinct
        for m in targets:
            # Jitted per mask, as in the loop (plan arrays are constants of the program).
            fn = jax.jit(lambda q, k, v, m=m, o=opts: attention(q, k, v, m, options=o))
            ts = time_calls(fn, qkv, args.attn_repeats)
            per[m] = ts
        attn_t[vname] = per
    t_dense_attn = _median(attn_t["dense"][None])
    res["attention"] = {
        "dense_s": t_dense_attn, "dense_raw_s": attn_t["dense"][None],
        "masks": [dict(digest=m.digest, density=m.density, heads=m.num_heads,
                       tessera_s=_median(attn_t["tessera"][m]), fixed_s=_median(attn_t["fixed"][m]),
                       tessera_raw_s=attn_t["tessera"][m], fixed_raw_s=attn_t["fixed"][m],
                       plan_tessera=_plan_stats(m, L, H, D, dtype, variants["tessera"][1]),
                       plan_fixed=_plan_stats(m, L, H, D, dtype, variants["fixed"][1]))
                  for m in distinct],
    }

    # -- one dense forward (step time) -> attention's share.
    progress.set_postfix_str(f"{case.name}: step")
    fwd = make_forward(model, None, options=variants["dense"][1])
    state = nnx.state(model)
    t = jnp.full((1,), 500.0, jnp.float32)
    step_ts = time_calls(lambda x: fwd(state, x, t, context), [(noise,)], args.step_repeats)
    step_s = _median(step_ts)
    res["step_dense_s"], res["step_dense_raw_s"] = step_s, step_ts
    res["attention_share_of_step"] = min(1.0, case.layers_run * t_dense_attn / step_s)

    # -- the loops.
    outs = {}
    for vname, (schedule, opts) in variants.items():
        progress.set_postfix_str(f"{case.name}: loop {vname}")
        sampler = make_sampler(model, schedule, shift=args.shift, options=opts,
                               token_order=order if vname != "dense" else None)
        t0 = time.perf_counter()
        compiled = sampler.lower(noise, context).compile()
        compile_s = time.perf_counter() - t0
        state = nnx.state(model)
        last = {}

        def run_loop(state=state, last=last):
            last["out"] = _block(compiled(state, noise, context, None, None))

        ts = [x / 1e3 for x in timing.time_request(
            run_loop, rule=loop_rule(args.loop_repeats, warmup=0)).samples]
        out = last["out"]
        outs[vname] = out
        loop_s = _median(ts)
        if vname == "dense":
            predicted = loop_s
            attn_calls = [t_dense_attn] * (case.steps * case.layers_run)
        else:
            per = attn_t[vname]
            attn_calls = [t_dense_attn if m is None else _median(per[m])
                          for row in schedule.table for m in row]
            predicted = loop_s_dense - sum(t_dense_attn - a for a in attn_calls)
        scale = case.layers_total / case.layers_run
        res["loops"][vname] = dict(
            loop_s=loop_s, loop_raw_s=ts, compile_s=compile_s, traced_forwards=sampler.traced_forwards,
            loop_full_model_s=loop_s * scale,
            attention_s=sum(attn_calls), predicted_loop_s=predicted,
            overhead_outside_attention=loop_s / predicted - 1.0,
            finite=bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))))
        if vname == "dense":
            loop_s_dense = loop_s
    L_ = res["loops"]
    for vname in ("tessera", "fixed"):
        d = L_[vname]
        d["speedup_vs_dense"] = L_["dense"]["loop_s"] / d["loop_s"]
        d["attention_only_speedup"] = L_["dense"]["attention_s"] / d["attention_s"]
        f = res["attention_share_of_step"]
        d["amdahl_speedup"] = L_["dense"]["loop_s"] / d["predicted_loop_s"]
        d["amdahl_speedup_from_share"] = 1.0 / ((1 - f) + f / d["attention_only_speedup"])
        d["max_abs_diff_vs_dense_loop"] = float(jnp.max(jnp.abs(
            outs[vname].astype(jnp.float32) - outs["dense"].astype(jnp.float32))))
    res["speedup_vs_fixed_plan"] = L_["fixed"]["loop_s"] / L_["tessera"]["loop_s"]
    return res


def _default_template(backend, H, D, dtype, L) -> str:
    """The 'fixed' baseline's template: the backend's default, else its 128x128 one, else the
    first registered template that takes the call (FlexAttention-like fixed 128 tiles)."""
    from tessera_jax.runtime import dispatch as backends
    from tessera_jax.validation import check_shapes
    shape = check_shapes((1, L, H, D), (1, L, H, D), dtype)
    be = backends.resolve(backend, shape)
    supported = backends.supported_templates(be, shape)
    names = [t.name for t in supported]
    default = backends.DEFAULT_TEMPLATE.get(be)
    if default in names:
        return default
    square = [t.name for t in supported if (t.tile_q, t.tile_kv) == (128, 128)]
    return (square or names)[0]


def _plan_stats(mask, L, H, D, dtype, opts: AttentionOptions) -> dict | None:
    try:
        import tessera_jax as tj
        p = tj.plan(mask, (1, L, H, D), (1, L, H, D), dtype, template=opts.template,
                    policy=opts.policy, backend=opts.backend)
        st = p.stats()
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in st.items()
                if isinstance(v, (int, float, str, bool, np.generic))}
    except Exception as e:  # stats are informative only
        return {"error": repr(e)}


# --- summary and output -----------------------------------------------------------------------
def summarize(cases: dict) -> dict:
    """The issue's summary over the cases present (geometric mean over cases where aggregated)."""
    if not cases:
        return {}
    def gmean(xs):
        return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else None

    vs_fixed = {k: c["speedup_vs_fixed_plan"] for k, c in cases.items()}
    overhead = {k: c["loops"]["tessera"]["overhead_outside_attention"] for k, c in cases.items()}
    s = dict(
        speedup_vs_fixed_plan=gmean(list(vs_fixed.values())),
        speedup_vs_fixed_plan_by_case=vs_fixed,
        overhead_outside_attention=max(overhead.values(), key=abs) if overhead else None,
        overhead_outside_attention_by_case=overhead,
        wan13b_480p_speedup_vs_dense=(cases["wan13b_480p"]["loops"]["tessera"]["speedup_vs_dense"]
                                      if "wan13b_480p" in cases else None),
        speedup_vs_dense_by_case={k: c["loops"]["tessera"]["speedup_vs_dense"] for k, c in cases.items()},
        amdahl_speedup_by_case={k: c["loops"]["tessera"]["amdahl_speedup"] for k, c in cases.items()},
        attention_only_speedup_by_case={k: c["loops"]["tessera"]["attention_only_speedup"]
                                        for k, c in cases.items()},
        attention_share_by_case={k: c["attention_share_of_step"] for k, c in cases.items()},
        extrapolated_cases=[k for k, c in cases.items() if c["extrapolated"]],
        notes=("speedup_vs_fixed_plan: geometric mean over cases of fixed-plan loop time / tessera "
               "loop time; overhead_outside_attention: the case with the largest |measured / "
               "Amdahl-predicted - 1| of the tessera loop; cases in extrapolated_cases ran a layer "
               "subset (times scaled per layer, speedups measured)."),
    )
    return s


def _environment(args, argv) -> dict:
    dev = jax.devices()[0]
    return dict(
        device=getattr(dev, "device_kind", str(dev)), platform=jax.default_backend(),
        device_count=jax.device_count(), jax=jax.__version__,
        jaxlib=getattr(__import__("jaxlib"), "__version__", None),
        python=platform.python_version(),
        command="python -m tessera_jax.tools.bench_loop " + " ".join(argv),
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tiny=args.tiny)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tessera_jax.tools.bench_loop", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="wan13b_480p,wan14b_720p,hunyuan15_720p",
                   help="comma-separated case names: " + ", ".join(CASES))
    p.add_argument("--tiny", action="store_true", help="tiny CPU configs (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="override the steps of every case")
    p.add_argument("--layers", type=int, default=None,
                   help="override layers_run of the subset cases (not wan13b_480p)")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (--tiny default)")
    p.add_argument("--backend", default=None, help="tessera_jax backend (default: best available)")
    p.add_argument("--fixed-template", default=None, help="template of the fixed-plan baseline")
    p.add_argument("--fixed-policy", default="keep", help="tiling policy of the fixed-plan baseline")
    p.add_argument("--dense-implementation", default="auto", choices=("auto", "cudnn", "xla"))
    p.add_argument("--attn-repeats", type=int, default=None, help="attention timing runs (>= 20 on GPU)")
    p.add_argument("--step-repeats", type=int, default=None)
    p.add_argument("--loop-repeats", type=int, default=1, help="timed runs of each compiled loop")
    p.add_argument("--shift", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", default=None,
                   help="override the mask family of the selected cases (tessera_jax.masks.families)")
    p.add_argument("--family-params", default=None, help='JSON dict, e.g. \'{"window": [3, 3, 3]}\'')
    p.add_argument("--dense-steps", type=int, default=None, help="override the dense warm-up steps")
    p.add_argument("--mask-seeds", type=int, default=None,
                   help="distinct per-layer masks (layer l uses seed l %% N; 0: one per layer)")
    p.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT}; merges cases)")
    args = p.parse_args(argv)
    if args.dense_implementation == "xla":
        args.dense_implementation = None
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.attn_repeats = args.attn_repeats or (3 if args.tiny else 20)
    args.step_repeats = args.step_repeats or (2 if args.tiny else 5)
    args.out = args.out or DEFAULT_OUT
    pool = tiny_cases(args.steps or 3) if args.tiny else CASES
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in pool]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {sorted(pool)}")
    cases = []
    for n in names:
        c = pool[n]
        if args.steps and not args.tiny:
            c = dataclasses.replace(c, steps=args.steps, dense_steps=min(c.dense_steps, args.steps))
        if args.layers and c.layers_run < c.layers_total:
            c = dataclasses.replace(c, layers_run=min(args.layers, c.layers_total))
        if args.family:
            c = dataclasses.replace(c, family=args.family, family_params=())
        if args.family_params:
            params = json.loads(args.family_params)
            if not isinstance(params, dict):
                p.error("--family-params must be a JSON object")
            c = dataclasses.replace(c, family_params=tuple(
                (k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
        if args.dense_steps is not None:
            c = dataclasses.replace(c, dense_steps=min(args.dense_steps, c.steps))
        if args.mask_seeds is not None:
            c = dataclasses.replace(c, mask_seeds=args.mask_seeds)
        cases.append(c)
    args.cases = cases
    return args


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--merge"]:  # --merge A.json B.json ... --out C.json
        if "--out" not in argv or argv.index("--out") != len(argv) - 2 or len(argv) < 4:
            raise SystemExit("usage: bench_loop --merge A.json [B.json ...] --out OUT.json")
        doc = merge_files(argv[1:-2], argv[-1])
        _print_table(doc)
        return doc
    args = parse_args(argv)
    if not args.tiny and jax.default_backend() != "gpu":
        print("bench_loop: no GPU here; run with --tiny for the CPU smoke run", file=sys.stderr)
    doc: dict = {}
    if os.path.exists(args.out):
        try:
            with open(args.out) as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError):
            doc = {}
        if doc.get("environment", {}).get("tiny") != args.tiny:
            doc = {}
    doc.setdefault("cases", {})
    doc.setdefault("runs", [])
    env = _environment(args, argv)
    bar = tqdm(args.cases, desc="bench_loop", unit="case", file=sys.stderr)
    for case in bar:
        try:
            res = run_case(case, args, bar)
        except Exception as e:  # keep the other cases' results; record what failed
            if args.tiny:
                raise
            import traceback
            doc.setdefault("errors", {})[case.name] = dict(error=repr(e), environment=env,
                                                           traceback=traceback.format_exc()[-4000:])
            _write(args.out, doc)
            print(f"bench_loop: case {case.name} failed: {e!r}", file=sys.stderr)
            continue
        res["environment"] = env
        res["family"], res["family_params"] = case.family, dict(case.family_params)
        doc.get("errors", {}).pop(case.name, None)
        doc["cases"][case.name] = res
        doc["environment"] = env
        doc["summary"] = summarize(doc["cases"])
        _write(args.out, doc)
    doc["runs"].append(env)
    doc["summary"] = summarize(doc["cases"])
    _write(args.out, doc)
    _print_table(doc)
    return doc


def _write(path, doc):
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    os.replace(tmp, path)


def merge_files(paths, out) -> dict:
    """Merge result files of several processes (e.g. one per GPU) into ``out``: their cases,
    runs and errors, with the summary recomputed over all cases. Later files win on a clash."""
    doc: dict = {"cases": {}, "runs": []}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        doc["cases"].update(d.get("cases", {}))
        doc["runs"].extend(d.get("runs", []))
        doc.setdefault("errors", {}).update(d.get("errors", {}))
        if "environment" in d:
            doc["environment"] = d["environment"]
    for name in doc["cases"]:
        doc.get("errors", {}).pop(name, None)
    if not doc.get("errors"):
        doc.pop("errors", None)
    doc["summary"] = summarize(doc["cases"])
    _write(out, doc)
    return doc


def _print_table(doc):
    print(f"{'case':16s} {'layers':>7s} {'dense s':>9s} {'tessera s':>9s} {'fixed s':>9s} "
          f"{'vs dense':>8s} {'vs fixed':>8s} {'attn x':>7s} {'amdahl':>7s} {'share':>6s} {'ovh':>7s}")
    for k, c in doc["cases"].items():
        lp = c["loops"]
        sc = c["layers_total"] / c["layers_run"]
        print(f"{k:16s} {c['layers_run']:>3d}/{c['layers_total']:<3d} "
              f"{lp['dense']['loop_s'] * sc:9.3f} {lp['tessera']['loop_s'] * sc:9.3f} "
              f"{lp['fixed']['loop_s'] * sc:9.3f} {lp['tessera']['speedup_vs_dense']:8.3f} "
              f"{c['speedup_vs_fixed_plan']:8.3f} {lp['tessera']['attention_only_speedup']:7.3f} "
              f"{lp['tessera']['amdahl_speedup']:7.3f} {c['attention_share_of_step']:6.3f} "
              f"{lp['tessera']['overhead_outside_attention']:+7.3f}"
              + ("  (extrapolated per layer)" if c["extrapolated"] else ""))
    print("summary:", json.dumps({k: v for k, v in doc["summary"].items() if not k.endswith("_by_case")
                                  and k != "notes"}))


if __name__ == "__main__":
    main()
