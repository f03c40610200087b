"""End-to-end benchmark: the jit-compiled 50-step denoising loop with dense vs sparse attention.

    python benchmarks/bench_loop.py --out /tmp/loop.json         # GPU: all cases
    python benchmarks/bench_loop.py --models wan13b_480p         # one case, printed only
    python benchmarks/bench_loop.py --tiny --out /tmp/x.json     # CPU smoke run, tiny models

Results go to ``--out`` only (cases merge into an existing file); without it, the table is
printed and nothing is written. The official file is ``benchmarks/results/h200-loop.json``:
name it in ``--out`` to update it.

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

Dynamic cases (issue 17: ``wan13b_480p_vsa``, ``wan14b_720p_svg2``, ``hunyuan15_720p_sparge``;
issue 33: ``wan13b_480p_xattn``; ``--models dynamic``) build their masks from q and k inside one compiled loop
(``DynamicSchedule``) and time four loops, each compiled once ahead of time:
  dense   -- the cuDNN baseline (as above);
  dynamic -- ours: the rule at every sparse step and layer, device masks through
            ``tessera_jax.sparse_attention``; timed under ``jax.transfer_guard("disallow")``;
  null    -- no self-attention at all: the loop's time outside attention;
  host    -- the plan-on-host design: each mask goes to the host by ``jax.pure_callback``,
            ``tj.plan`` plans it, the kernel runs that plan (``HostPlanned``: plans padded to
            a static capacity derived from the shapes, as a callback's results must be);
then per call at the case's shapes: dense attention, the builder alone, builder + attention.
The peers' loop is an ESTIMATE (labelled so): null loop + dense calls x dense attention +
sparse calls x (our builder + FlashInfer's / FlexAttention's request time from
``--peers-json``). ``--builder-costs all`` instead times each builder variant at Wan 720p
against the attention call it feeds (issue 17's 5% budget). A builder's kernel options are rule
fields (``tessera_jax.masks.dynamic``): set them with ``--rule-params``, e.g.
``'{"top_k": "xla"}'``.

    python benchmarks/bench_loop.py --models wan13b_480p_vsa --steps 25   # 6/25 dense
    python benchmarks/bench_loop.py --builder-costs all --out /tmp/b.json
    python benchmarks/bench_loop.py --merge A.json B.json [--peers-json P.json] --out C.json

``--merge`` joins result files (later cases win) and recomputes the summary; with
``--peers-json`` the dynamic cases' peers estimates are recomputed from that peers file.

Cases with a layer subset (``layers_run < layers_total``) report loop times extrapolated per
layer: ``T_full = T_measured * layers_total / layers_run``; the JSON marks them
``extrapolated: true`` and keeps the measured times. Their speedups are the subset's, which is
not the full model's: the work outside the blocks (embedding, head, the step's own ops) weighs
more in 2 layers than in 54. The one check (H200, HunyuanVideo 720p SpargeAttn, 2 steps;
``--merge ... --scaling-check SUBSET.json FULL.json``, kept as ``layer_scaling_check``): 2
layers 4.53x dense, all 54 layers 3.89x (full / subset 0.86; dense loop 0.90, dynamic 1.05).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import re
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import flax.nnx as nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tessera_jax.flax import AttentionOptions, MaskSchedule, attention
from tessera_jax.mask import BlockMask
from tessera_jax.tools import timing
from tessera_jax.tools.profiler import code_revision   # git HEAD, or a snapshot's .snap_rev
from tessera_jax.models import (HUNYUAN15, WAN21_14B, WAN21_1_3B, HunyuanModel, WanModel,
                                make_forward, make_sampler)

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency; keep the bench usable without it
    def tqdm(it=None, **kw):
        return it

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


def _tiny_configs():
    """(Wan, Hunyuan) configs of 2 layers and 2 heads of 16, for the CPU-sized cases."""
    wan = WAN21_1_3B.replace(num_layers=2, num_heads=2, head_dim=16, ffn_dim=64, text_dim=32,
                             text_len=8, in_channels=4, out_channels=4, freq_dim=32)
    hy = HUNYUAN15.replace(num_layers=2, num_heads=2, head_dim=16, mlp_dim=64, text_dim=32,
                           text_len=8, in_channels=4, out_channels=4, freq_dim=32,
                           rope_dims=(4, 6, 6))
    return wan, hy


def tiny_cases(steps: int = 3) -> dict[str, Case]:
    """CPU-sized versions of the cases (2 layers, 2 heads of 16, small grids; wan14b_720p runs
    1 of its 2 layers to exercise the per-layer extrapolation)."""
    wan, hy = _tiny_configs()
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
    from tessera_jax.models.common import device_init, numpy_init
    if jax.default_backend() == "cpu":   # tiny: NumPy-drawn weights, nothing to compile
        return numpy_init(cls, cfg, seed), cfg
    return device_init(cls, cfg, seed), cfg     # drawn on the device, one program per shape


# A --tiny (CPU smoke) run compiles without LLVM's expensive passes: compile time is most of it.
_FAST_CPU = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(lowered, args):
    return lowered.compile(_FAST_CPU if args.tiny else None)


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

    dense_impl = _dense_impl(args, dtype)
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
    attn_t, res["attention"] = _time_attention(sched, variants, qkv, args, (L, H, D, dtype))
    t_dense_attn = res["attention"]["dense_s"]

    # -- one dense forward (step time) -> attention's share.
    progress.set_postfix_str(f"{case.name}: step")
    fwd = make_forward(model, None, options=variants["dense"][1])
    state = nnx.state(model)
    t = jnp.full((1,), 500.0, jnp.float32)
    step_ts = time_calls(lambda x: fwd(state, x, t, context), [(noise,)], args.step_repeats)
    step_s = _median(step_ts)
    res["step_dense_s"], res["step_dense_raw_s"] = step_s, step_ts
    res["attention_share_of_step"] = min(1.0, case.layers_run * t_dense_attn / step_s)
    _time_loops(case, model, variants, order, (noise, context), attn_t, res, args, progress)
    return res


def _time_attention(sched, variants, qkv, args, shape):
    """(per-variant call times {mask: [s]}, the ``attention`` entry): dense attention and each
    distinct mask of ``sched`` through the tessera and fixed-plan variants."""
    L, H, D, dtype = shape
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
    return attn_t, {
        "dense_s": t_dense_attn, "dense_raw_s": attn_t["dense"][None],
        "masks": [dict(digest=m.digest, density=m.density, heads=m.num_heads,
                       tessera_s=_median(attn_t["tessera"][m]), fixed_s=_median(attn_t["fixed"][m]),
                       tessera_raw_s=attn_t["tessera"][m], fixed_raw_s=attn_t["fixed"][m],
                       plan_tessera=_plan_stats(m, L, H, D, dtype, variants["tessera"][1]),
                       plan_fixed=_plan_stats(m, L, H, D, dtype, variants["fixed"][1]))
                  for m in distinct],
    }


def _time_loops(case, model, variants, order, inputs, attn_t, res, args, progress):
    """The three compiled loops into ``res["loops"]``, with the Amdahl prediction from the
    attention times ``attn_t``, then the speedups."""
    noise, context = inputs
    t_dense_attn = res["attention"]["dense_s"]
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
            predicted = res["loops"]["dense"]["loop_s"] - sum(t_dense_attn - a for a in attn_calls)
        scale = case.layers_total / case.layers_run
        res["loops"][vname] = dict(
            loop_s=loop_s, loop_raw_s=ts, compile_s=compile_s, traced_forwards=sampler.traced_forwards,
            loop_full_model_s=loop_s * scale,
            attention_s=sum(attn_calls), predicted_loop_s=predicted,
            overhead_outside_attention=loop_s / predicted - 1.0,
            finite=bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))))
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


# =============================================================================================
# Dynamic cases (issue 17): masks built from q and k inside the compiled loop
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class DynCase:
    """A loop whose masks a rule builds from each layer's q and k at every sparse step."""

    name: str
    model: str                       # "wan" | "hunyuan"
    config: object
    frames: int
    height: int
    width: int
    layers_run: int
    steps: int
    dense_steps: int                 # for ``steps`` steps (scaled with --steps)
    rule: str                        # "vsa" | "svg2" | "sparge" | "xattn"
    rule_params: tuple = ()
    text_len: int = 0
    cube: tuple = (4, 4, 4)          # VSA's cube (tokens permuted cube-major)
    note: str = ""

    @property
    def layers_total(self) -> int:
        return self.config.num_layers


DYN_CASES = {
    # Wan2.1-1.3B T2V 480p, all 30 layers: VSA (4x4x4 cubes, top 12.5% of key cubes per query
    # cube, issue 17's setting). Dense warm-up 12 of 50 steps (6 of 25): the dense-first-steps
    # shape of the radial / STA / SVG schedules (issue 17 assumes 6/25 for this case).
    "wan13b_480p_vsa": DynCase(
        "wan13b_480p_vsa", "wan", WAN21_1_3B, 81, 480, 832, 30, 50, 12, "vsa",
        (("keep", 0.125),), note="VSA keep 12.5%; tokens cube-major (cube_layout)"),
    # Wan2.1-14B T2V 720p, 2 of 40 layers: SVG2. Dense warm-up 15 of 50 steps (SVG2's Wan 720p
    # script: first_times_fp 0.3). top_p 0.25 instead of 0.9: random-weight q/k give
    # near-uniform cluster scores, where 0.9 keeps ~90% of the keys; 0.25 lands near the
    # density SVG2 reports on Wan (the peers' svg2 corpus mask: 0.25). iters=1 per step is the
    # cheaper variant of docs/dynamic_masks.md; min_cluster_tokens=43 merges clusters so a
    # 128-token tile meets <= 4 of them (no bitmap steps; the mask is a superset of the rule's).
    "wan14b_720p_svg2": DynCase(
        "wan14b_720p_svg2", "wan", WAN21_14B, 81, 720, 1280, 2, 50, 15, "svg2",
        (("q_clusters", 300), ("kv_clusters", 1000), ("init_iters", 50), ("iters", 1),
         ("top_p", 0.25), ("min_kc_ratio", 0.1), ("min_cluster_tokens", 43)),
        note="SVG2 300/1000 clusters, 50 init + 1 iteration per step, top_p 0.25 "
             "(random weights), clusters >= 43 tokens"),
    # HunyuanVideo-1.5 720p, 2 of 54 layers, joint [video, text] attention: SpargeAttn-like
    # in its top-k mode (12.5% of the key blocks per query block: the Wan VSA case's budget)
    # with the self-similarity judgment off (random-weight tokens are never self-similar, so
    # SpargeAttn's 0.6 would keep every row dense). No dense warm-up (SpargeAttn has none).
    "hunyuan15_720p_sparge": DynCase(
        "hunyuan15_720p_sparge", "hunyuan", HUNYUAN15.replace(text_len=256), 121, 720, 1280, 2,
        50, 0, "sparge", (("topk", 0.125), ("sim_threshold", -1.0)), text_len=256,
        note="SpargeAttn top-k 12.5%, 128x64 blocks, self-similarity off (random weights)"),
    # Wan2.1-1.3B T2V 480p, all 30 layers: XAttention (antidiagonal scores of stride 8, 128-token
    # blocks; the paper's 5 dense warm-up steps of 50). tau 0.25 instead of 0.9 for the reason
    # of SVG2's top_p: random-weight scores are near uniform, where 0.9 keeps ~90% of the blocks.
    "wan13b_480p_xattn": DynCase(
        "wan13b_480p_xattn", "wan", WAN21_1_3B, 81, 480, 832, 30, 50, 5, "xattn",
        (("block", 128), ("stride", 8), ("tau", 0.25)),
        note="XAttention stride 8, tau 0.25 (random weights), 128-token blocks"),
}

# The families of the peers' JSON rows each rule's mask corresponds to.
_PEER_FAMILY = {"vsa": "vsa", "svg2": "svg2", "sparge": "sparge", "xattn": "xattn"}


def tiny_dyn_cases(steps: int = 3) -> dict[str, DynCase]:
    """CPU-sized versions of the dynamic cases (1 layer of 2, 2 heads of 16, small grids)."""
    wan, hy = _tiny_configs()
    # Wan latent (5, 12, 16) -> grid (5, 6, 8): 240 tokens; Hunyuan (5, 4, 6) + 8 text: 128
    return {
        "wan13b_480p_vsa": DynCase("wan13b_480p_vsa", "wan", wan, 17, 96, 128, 1, steps, 1,
                                   "vsa", (("keep", 0.25),), cube=(2, 2, 2)),
        "wan14b_720p_svg2": DynCase("wan14b_720p_svg2", "wan", wan, 17, 96, 128, 1, steps, 1,
                                    "svg2", (("q_clusters", 6), ("kv_clusters", 10),
                                             ("init_iters", 3), ("iters", 1), ("top_p", 0.25))),
        "hunyuan15_720p_sparge": DynCase("hunyuan15_720p_sparge", "hunyuan", hy, 17, 64, 96, 1,
                                         steps, 0, "sparge",
                                         (("block_q", 32), ("block_kv", 16), ("topk", 0.25),
                                          ("sim_threshold", -1.0)), text_len=8),
        "wan13b_480p_xattn": DynCase("wan13b_480p_xattn", "wan", wan, 17, 96, 128, 1, steps, 1,
                                     "xattn", (("block", 32), ("stride", 8), ("tau", 0.5))),
    }


def make_rule(case: DynCase, tokens_thw):
    """(rule, token order or None) of a dynamic case."""
    from tessera_jax.masks import dynamic as dm
    params = dict(case.rule_params)
    if case.rule == "vsa":
        order, bounds = dm.cube_layout(tokens_thw, case.cube)
        return dm.VSA(q_bounds=bounds, **params), order
    cls = {"svg2": dm.SVG2, "sparge": dm.Sparge, "xattn": dm.XAttention}[case.rule]
    return cls(**params), None


@dataclasses.dataclass(frozen=True)
class NoAttention:
    """A rule that computes no attention (v, kept alive on q and k so nothing upstream is
    dropped): the loop with it is the loop's time outside self-attention."""

    def init_state(self, q_shape, kv_shape, dtype):
        return ()

    def __call__(self, q, k, v, state, *, scale=None, attend):
        g = q.shape[2] // k.shape[2]
        kk, vv = (jnp.repeat(x, g, axis=2) if g > 1 else x for x in (k, v))
        f32 = jnp.float32
        return (vv.astype(f32) + 0.0 * (q.astype(f32) + kk.astype(f32))).astype(q.dtype), state


# --- the host-planning baseline ---------------------------------------------------------------
#: Per process: what the host-planning callbacks did (calls, overflows, seconds, plan bytes).
HOST_STATS: dict = {}


def _reset_host_stats():
    HOST_STATS.clear()
    HOST_STATS.update(calls=0, overflows=0, plan_s=0.0, plan_bytes=0, capacity_bytes=0)


_reset_host_stats()


def _fine_possible(bounds: np.ndarray, tile: int) -> bool:
    """Whether some tile of ``tile`` tokens can meet more than abi.GRID blocks of these
    static bounds (then the host plan may hold bitmap steps)."""
    from pallas_kernels import abi
    b = np.asarray(bounds, np.int64)
    g = abi.GRID
    if len(b) - 1 <= g:
        return False
    return bool(np.min(b[g:] - b[1:len(b) - g + 1]) <= tile - 1)


@dataclasses.dataclass(frozen=True)
class HostPlanned:
    """``sparse_fn`` of the plan-on-host baseline: inside the compiled loop, the mask goes to
    the host through ``jax.pure_callback`` (blocks bit-packed, bounds), ``tj.plan`` plans it
    there (the template the device route would run, that template's policy), and the kernel
    runs that plan. A callback's results need static shapes, so the plan is padded to a static
    capacity derived from the shapes: units Hq (nq + ceil(Lq / tile_q)), step rows Hm (Hq for
    per-head bounds) ceil(Lq / tile_q) ceil(Lkv / tile_kv) (the planner never computes more
    than dense per head) plus ``bitmap_budget_bytes`` of bitmap words where blocks are small enough to need
    them. A plan past the capacity (counted in ``HOST_STATS['overflows']``) runs the exact XLA
    path. Per-head bounds (SVG2) are planned one head at a time (``tj.plan`` takes shared
    bounds) and the plans joined."""

    backend: str | None = None
    bitmap_budget_bytes: int = 64 << 20

    def __call__(self, q, k, v, mask: BlockMask, scale=None):
        import tessera_jax as tj
        from pallas_kernels import abi
        from tessera_jax.runtime import device_route, dispatch
        from tessera_jax.runtime.exact import exact_attention
        from tessera_jax.validation import check_shapes
        B, Lq, Hq, D = q.shape
        Lkv = k.shape[1]
        scale = float(D) ** -0.5 if scale is None else float(scale)
        shape = check_shapes(q.shape, k.shape, q.dtype)
        be = dispatch.resolve(self.backend, shape)
        t = device_route.choose(mask, shape, be, None)
        if t is None:
            t = next(x for x in dispatch.supported_templates(be, shape)
                     if not getattr(x.kernel, "paired", False))
        tq, tkv = t.tile_q, t.tile_kv
        qp = -(-max(Lq, tq) // t.q_align) * t.q_align
        kvp = -(-max(Lkv, tkv) // t.kv_align) * t.kv_align
        nqt, nkt = -(-Lq // tq), -(-Lkv // tkv)
        Hm, nq, nk = (int(x) for x in mask.blocks.shape)
        per_head = mask.per_head_bounds or not (isinstance(mask.q_bounds, np.ndarray)
                                                and isinstance(mask.kv_bounds, np.ndarray))
        fine = per_head or _fine_possible(mask.q_bounds, tq) or _fine_possible(mask.kv_bounds, tkv)
        # Traced bounds are planned a query head at a time: no step rows shared between heads.
        dense_rows = (Hq if per_head else Hm) * nqt * nkt
        bm_rows = min(dense_rows * abi.bitmap_rows(tq, tkv),
                      self.bitmap_budget_bytes // (4 * abi.STEP_COLS)) if fine else 0
        U_cap, S_cap, M_cap = Hq * (nq + nqt), dense_rows + bm_rows, nk + nkt
        dtype = np.dtype(q.dtype)
        qb_static = None if per_head else np.asarray(mask.q_bounds)
        kb_static = None if per_head else np.asarray(mask.kv_bounds)
        cap_bytes = 4 * (U_cap * abi.UNIT_COLS + S_cap * abi.STEP_COLS)

        def plan_on_host(qb, kb, packed):
            t0 = time.perf_counter()
            blocks = np.unpackbits(np.asarray(packed), count=Hm * nq * nk,
                                   bitorder="little").astype(bool).reshape(Hm, nq, nk)
            units = np.zeros((U_cap, abi.UNIT_COLS), np.int32)
            steps = np.zeros((S_cap, abi.STEP_COLS), np.int32)
            full = (tuple(q.shape), tuple(k.shape))
            if per_head:
                qb = np.asarray(qb).reshape(-1, nq + 1)
                kb = np.asarray(kb).reshape(-1, nk + 1)
                one = ((B, Lq, 1, D), (B, Lkv, 1, D))
                heads = ([(None, BlockMask(qb[0], kb[0], blocks), full)] if Hm == 1 and
                         len(qb) == len(kb) == 1 else
                         [(h, BlockMask(qb[h % len(qb)], kb[h % len(kb)], blocks[h % Hm][None]),
                           one) for h in range(Hq)])
            else:
                heads = [(None, BlockMask(qb_static, kb_static, blocks), full)]
            u_off = s_off = 0
            ok, nbytes = True, 0
            for h, m, hshape in heads:
                p = tj.plan(m, *hshape, dtype, template=t.name)
                U, rows = p.num_units, p.num_steps + p.bitmap_rows
                nbytes += 4 * (U * abi.UNIT_COLS + rows * abi.STEP_COLS)
                cnt = p.units[:U, abi.UNIT_STEP_CNT]
                if (u_off + U > U_cap or s_off + rows > S_cap or p.q_len_padded != qp
                        or p.kv_len_padded != kvp or (U and int(cnt.max()) > M_cap)):
                    ok = False
                    break
                u = p.units[:U].copy()
                u[:, abi.UNIT_STEP_PTR] += s_off
                if h is not None:
                    u[:, abi.UNIT_HEAD] = h
                st = p.steps[:rows].copy()
                bm = st[:p.num_steps, abi.STEP_CUTS_B] == abi.BITMAP_FLAG
                st[:p.num_steps, abi.STEP_CUTS_A][bm] += s_off * abi.STEP_COLS
                units[u_off:u_off + U] = u
                steps[s_off:s_off + rows] = st
                u_off, s_off = u_off + U, s_off + rows
            HOST_STATS["calls"] += 1
            HOST_STATS["overflows"] += int(not ok)
            HOST_STATS["plan_s"] += time.perf_counter() - t0
            HOST_STATS["plan_bytes"] += nbytes
            HOST_STATS["capacity_bytes"] += cap_bytes
            return units, steps, np.bool_(ok)

        packed = jnp.packbits(mask.blocks.reshape(-1), bitorder="little")
        qb = jnp.asarray(mask.q_bounds, jnp.int32) if per_head else jnp.zeros((1,), jnp.int32)
        kb = jnp.asarray(mask.kv_bounds, jnp.int32) if per_head else jnp.zeros((1,), jnp.int32)
        out_types = (jax.ShapeDtypeStruct((U_cap, abi.UNIT_COLS), jnp.int32),
                     jax.ShapeDtypeStruct((S_cap, abi.STEP_COLS), jnp.int32),
                     jax.ShapeDtypeStruct((), jnp.bool_))
        units, steps, ok = jax.pure_callback(plan_on_host, out_types, qb, kb, packed)
        plan = abi.PassPlan(units, steps, None, tq, tkv, qp, kvp, M_cap)
        return jax.lax.cond(
            ok, lambda: dispatch.forward(plan, t, q, k, v, scale, False),
            lambda: exact_attention(q, k, v, mask.q_bounds, mask.kv_bounds,
                                                 mask.blocks, scale=scale))


# --- measurements of one dynamic case ---------------------------------------------------------
_HOST_OPS = re.compile(r'custom_call_target="[^"]*callback[^"]*"'
                       r'|stablehlo\.custom_call @[\w.]*callback'
                       r'|stablehlo\.(?:send|recv|infeed|outfeed)\b'
                       r'|\b(?:send|recv|infeed|outfeed)(?:-start|-done)?\(')


def host_transfer_ops(hlo_text: str) -> int:
    """Host transfer sites in a program's text (compiled HLO or lowered StableHLO): host
    callbacks, send / recv, in- and outfeeds."""
    return len(_HOST_OPS.findall(hlo_text))


def _mask_density(mask: BlockMask, Lq: int, Lkv: int):
    """Selected fraction of the token pairs (mean over heads), a traced scalar."""
    qb = jnp.asarray(mask.q_bounds, jnp.float32).reshape(-1, mask.blocks.shape[1] + 1)
    kb = jnp.asarray(mask.kv_bounds, jnp.float32).reshape(-1, mask.blocks.shape[2] + 1)
    qs, ks = jnp.diff(qb, axis=-1), jnp.diff(kb, axis=-1)
    sel = jnp.einsum("hij,hi,hj->h", mask.blocks.astype(jnp.float32),
                     jnp.broadcast_to(qs, (mask.blocks.shape[0], qs.shape[1])),
                     jnp.broadcast_to(ks, (mask.blocks.shape[0], ks.shape[1])))
    return jnp.mean(sel) / (float(Lq) * float(Lkv))     # Lq * Lkv may exceed int32


def _peer_rows(path: str | None):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def peers_per_call(doc, case: DynCase, L: int, H: int, density: float) -> dict:
    """Per-call request ms of each peer for this case's masks, from a peers JSON: either
    ``{"loop_cases": {case: {peer: ms}}}`` (measured on these masks), or ``benchmarks/peers.py``'s
    rows of the same mask family, scaled by heads x length^2 x density to this case (the row
    with the nearest length). FlashInfer: the faster of its two wrappers."""
    if not doc:
        return {}
    direct = doc.get("loop_cases", {}).get(case.name)
    if direct:
        return {p: dict(ms=float(ms), source="loop_cases") for p, ms in direct.items()}
    fam = _PEER_FAMILY.get(case.rule)
    rows = [r for r in doc.get("rows", []) if r.get("family") == fam]
    out = {}
    for peer, names in (("flashinfer", ("flashinfer_var", "flashinfer_bsr")), ("flex", ("flex",))):
        cands = []
        for r in rows:
            for n in names:
                p = r.get("peers", {}).get(n, {})
                if p.get("status") == "ok" and p.get("request_ms"):
                    cands.append((abs(math.log(r["Lq"] / L)), float(p["request_ms"]), n, r))
        if not cands:
            continue
        best_len = min(c[0] for c in cands)
        _, ms, n, r = min((c for c in cands if c[0] == best_len), key=lambda c: c[1])
        factor = (H / r["Hq"]) * (L / r["Lq"]) ** 2 * (density / max(r["density"], 1e-9))
        out[peer] = dict(ms=ms * factor, row_ms=ms, wrapper=n, row_id=r.get("id"),
                         row_grid=r.get("grid"), row_heads=r["Hq"], row_len=r["Lq"],
                         row_density=r["density"], scale=factor,
                         source="peers rows scaled by heads x length^2 x density")
    return out


def run_dyn_case(case: DynCase, args, progress, save) -> dict:
    """Times a dynamic case: the dense, dynamic and outside-attention (null) loops, the
    per-call builder / attention times, then the host-planning loop; the peers' estimate from
    these. ``save(res)`` is called after each part (a case cut by its time limit keeps what it
    measured)."""
    run = _dyn_setup(case, args)
    # The slowest part (the host-planning loop) last: a case cut by its time limit keeps the rest.
    for stage in ("dense", "dynamic", "null", "per_call", "host"):
        if stage == "per_call":
            if args.attn_repeats > 0:
                progress.set_postfix_str(f"{case.name}: per call")
                run.res["per_call"] = _per_call(case, run.rule, run.L, run.H, run.D, args.dtype,
                                                run.opts, args, run.key)
        elif stage in args.variants:
            _time_dyn_loop(run, stage, args, progress)
        else:
            continue
        _derive_dyn(run, args)
        save(run.res)
    return run.res


def _dyn_setup(case: DynCase, args):
    """What a dynamic case's loops share: the model, its inputs, the schedules and options, and
    the result dict (``res``) with the case's description."""
    from types import SimpleNamespace

    from tessera_jax.flax import DynamicSchedule
    dtype = args.dtype
    model, cfg = _init_model(case, dtype, args.seed)
    latent = cfg.latent_shape(case.frames, case.height, case.width)
    tokens_thw = cfg.token_grid(case.frames, case.height, case.width)
    Lv = int(np.prod(tokens_thw))
    tl = case.text_len if case.model == "hunyuan" else cfg.text_len
    L = cfg.self_attention_len(Lv, tl)
    H, D = cfg.num_heads, cfg.head_dim
    rule, order = make_rule(case, tokens_thw)
    sched = DynamicSchedule.warmup(rule, case.layers_run, case.steps, dense_steps=case.dense_steps)
    null = DynamicSchedule((NoAttention(),), np.ones(sched.table.shape, np.int32))
    key = jax.random.key(args.seed)
    k1, k2, k3 = jax.random.split(key, 3)
    noise = jax.random.normal(k1, (1, *latent, cfg.in_channels), jnp.float32)
    context = jax.random.normal(k2, (1, tl, cfg.text_dim), dtype)
    dense_impl = _dense_impl(args, dtype)
    opts = AttentionOptions(backend=args.backend, dense_implementation=dense_impl,
                            sparse_options=_sparse_options(args))
    host_fn = HostPlanned(backend=args.backend, bitmap_budget_bytes=args.host_bitmap_mb << 20)
    host_opts = AttentionOptions(dense_implementation=dense_impl, sparse_fn=host_fn)
    n_sparse = int(np.sum(sched.table > 0))
    n_dense = sched.table.size - n_sparse
    res: dict = dict(
        kind="dynamic", case=case.name, model=case.model, rule=case.rule,
        device_gather=getattr(args, "device_gather", None),
        rule_params=dict(case.rule_params), rule_repr=repr(rule), note=case.note,
        layers_total=case.layers_total, layers_run=case.layers_run,
        extrapolated=case.layers_run < case.layers_total, steps=case.steps,
        dense_steps=case.dense_steps, video=[case.frames, case.height, case.width],
        latent=list(latent), token_grid=list(tokens_thw), video_tokens=Lv, attention_len=L,
        joint_text_tokens=case.text_len, heads=H, head_dim=D, dtype=dtype,
        token_order="cube-major" if order is not None else "frame-major",
        schedule=repr(sched), sparse_calls=n_sparse, dense_calls=n_dense,
        dense_implementation=dense_impl, backend=args.backend, loops={}, per_call={},
        timing={"loop": loop_rule(args.loop_repeats, warmup=0).to_json(),
                "host_loop": loop_rule(args.host_repeats, warmup=0).to_json(),
                "per_call": loop_rule(args.attn_repeats, 1, 2).to_json()},
        host_capacity=("plans padded to a static capacity derived from the shapes (units "
                       "Hq (nq + ceil(Lq/tile_q)), step rows Hm ceil(Lq/tile_q) ceil(Lkv/tile_kv) "
                       f"+ up to {args.host_bitmap_mb} MiB of bitmap words): a callback's "
                       "results need static shapes"))
    return SimpleNamespace(case=case, model=model, rule=rule, order=order, sched=sched,
                           null=null, noise=noise, context=context, opts=opts,
                           host_opts=host_opts, state=nnx.state(model), key=k3, L=L, H=H, D=D,
                           res=res, outs={})


def _time_dyn_loop(run, vname: str, args, progress):
    """Compiles and times one loop of a dynamic case (``vname``: dense, dynamic, null or host)
    into ``run.res["loops"][vname]``; its output into ``run.outs``."""
    case, res = run.case, run.res
    progress.set_postfix_str(f"{case.name}: loop {vname}")
    if vname == "host":     # numba's loops loaded or compiled before the timed runs
        from tessera_jax.planning import warm_up
        warm_up()
    if vname == "dense":
        sampler = make_sampler(run.model, MaskSchedule.dense(case.layers_run, case.steps),
                               shift=args.shift, options=run.opts)
    else:
        sampler = make_sampler(run.model, {"dynamic": run.sched, "null": run.null,
                                           "host": run.sched}[vname],
                               shift=args.shift,
                               options=run.host_opts if vname == "host" else run.opts,
                               token_order=run.order)
    t0 = time.perf_counter()
    lowered = sampler.lower(run.noise, run.context)
    compiled = _compile(lowered, args)
    compile_s = time.perf_counter() - t0
    call_args = ((run.state, run.noise, run.context, None, None) if vname == "dense" else
                 (run.state, run.noise, run.context, None, None, sampler.table_array()))
    call_args = jax.device_put(call_args)
    last: dict = {}
    guard = vname in ("dynamic", "null")

    def run_loop():
        if guard:       # inputs are on the device: the loop itself may move nothing
            with jax.transfer_guard("disallow"):
                out = compiled(*call_args)
                jax.block_until_ready(out)
        else:
            out = _block(compiled(*call_args))
        last["out"] = out

    _reset_host_stats()
    entry: dict = dict(compile_s=compile_s, trace_count=sampler.trace_count,
                       host_transfer_ops=host_transfer_ops(compiled.as_text()))
    res["loops"][vname] = entry
    try:
        reps = args.host_repeats if vname == "host" else args.loop_repeats
        ts = [x / 1e3 for x in timing.time_request(
            run_loop, rule=loop_rule(reps, warmup=0)).samples]
    except Exception as e:          # the transfer guard (or a run) failed: say so
        entry.update(error=repr(e)[:2000], transfer_guard_ok=False if guard else None)
        return
    run.outs[vname] = last["out"]
    loop_s = _median(ts)
    entry.update(loop_s=loop_s, loop_raw_s=ts, loop_full_model_s=loop_s * case.layers_total
                 / case.layers_run, trace_count=sampler.trace_count,
                 finite=bool(jnp.all(jnp.isfinite(last["out"].astype(jnp.float32)))))
    if guard:
        entry["transfer_guard_ok"] = True
    if vname == "host":
        runs = max(1, len(ts))
        entry["host_callback"] = dict(
            calls_per_loop=HOST_STATS["calls"] / runs,
            plan_s_per_loop=HOST_STATS["plan_s"] / runs,
            overflows=HOST_STATS["overflows"],
            mean_plan_bytes=HOST_STATS["plan_bytes"] / max(1, HOST_STATS["calls"]),
            capacity_bytes_per_call=HOST_STATS["capacity_bytes"] / max(1, HOST_STATS["calls"]))


def _derive_dyn(run, args):
    """The speedups and the peers' estimate from the loops timed so far."""
    res, outs = run.res, run.outs
    L_ = res["loops"]
    for v in outs:
        if v != "dense" and "dense" in outs:
            L_[v]["max_abs_diff_vs_dense_loop"] = float(jnp.max(jnp.abs(
                outs[v].astype(jnp.float32) - outs["dense"].astype(jnp.float32))))
    for v in ("dynamic", "host"):
        if "loop_s" in L_.get(v, {}) and "loop_s" in L_.get("dense", {}):
            L_[v]["speedup_vs_dense"] = L_["dense"]["loop_s"] / L_[v]["loop_s"]
    if "loop_s" in L_.get("dynamic", {}) and "loop_s" in L_.get("host", {}):
        res["speedup_vs_host_planning"] = L_["host"]["loop_s"] / L_["dynamic"]["loop_s"]
    est = _peers_estimate(run.case, res, run.L, run.H, args)
    if est:
        res["peers_estimate"] = est


def _sparse_options(args):
    """The dynamic loop's ``tessera_jax.Options`` (None: the defaults)."""
    import tessera_jax as tj
    dg = getattr(args, "device_gather", None)
    return None if dg is None else tj.Options(device_gather=dg)


def _dense_impl(args, dtype):
    """--dense-implementation with 'auto' resolved: cuDNN for 16-bit dtypes on a GPU, else XLA."""
    if args.dense_implementation != "auto":
        return args.dense_implementation
    return "cudnn" if jax.default_backend() == "gpu" and dtype != "float32" else None


def _per_call(case, rule, L, H, D, dtype, opts, args, key) -> dict:
    """Median seconds per call at the case's shapes: cuDNN dense attention, the rule's mask
    building alone (its permutations included), the rule with tessera's attention, and the
    mask density."""
    B = 1
    qkv = [tuple(jax.random.normal(k, (B, L, H, D), dtype) for k in jax.random.split(kk, 3))
           for kk in jax.random.split(key, 2)]
    state0 = rule.init_state((B, L, H, D), (B, L, H, D), jnp.dtype(dtype))
    dens: list = []

    def probe(q, k, v, mask):
        dens.append(_mask_density(mask, q.shape[1], k.shape[1]))
        return v + jnp.zeros((), v.dtype) * jnp.any(mask.blocks).astype(v.dtype)

    def build(q, k, v, st):
        dens.clear()
        out, st2 = rule(q, k, v, st, attend=probe)
        return out, st2, dens[-1]

    def full(q, k, v, st):
        return rule(q, k, v, st, attend=lambda q, k, v, m: attention(q, k, v, m, options=opts))

    build_j = _compile(jax.jit(build).lower(*qkv[0], state0), args)
    full_j = _compile(jax.jit(full).lower(*qkv[0], state0), args)
    dense_j = _compile(jax.jit(lambda q, k, v: attention(q, k, v, None, options=opts)).lower(
        *qkv[0]), args)
    # A warm state (SVG2: centroids initialised by a first call).
    _, st, _ = build_j(*qkv[0], state0)
    st = jax.block_until_ready(st)
    density = float(build_j(*qkv[1], st)[2])
    args_st = [a + (st,) for a in qkv]
    out = dict(density=density)
    for name, fn, arg_sets in (("dense_attention_s", dense_j, qkv), ("build_s", build_j, args_st),
                               ("dynamic_attention_s", full_j, args_st)):
        ts = time_calls(fn, arg_sets, args.attn_repeats)
        out[name], out[name.replace("_s", "_raw_s")] = _median(ts), ts
    return out


# Builder variants timed at Wan 720p by --builder-costs (issue 17: a builder's cost <= 5% of
# the attention call it feeds). Random q and k give near-uniform scores, so the threshold rules
# run with knobs that land near the papers' densities (docs/dynamic_masks.md).
BUILDER_VARIANTS = {
    # The defaults: each row's top k by the Triton radix select (rule field top_k "auto"), q
    # and k pooled by the Triton kernel (pool "auto"), scores at HIGH precision. Controls, one
    # option back each (H200, session 13-14): "_xla" lax.top_k + scatter (7.61 vs 3.63 ms a
    # call), "_pool_xla" XLA's pooling (3.56 vs 2.67 ms, at HIGHEST), "_highest" float32
    # scores (2.67 vs 2.19 ms with the pooling kernel).
    "vsa": ("vsa", (("keep", 0.125),)),
    "vsa_xla": ("vsa", (("keep", 0.125), ("top_k", "xla"))),
    "vsa_pool_xla": ("vsa", (("keep", 0.125), ("pool", "xla"))),
    "vsa_highest": ("vsa", (("keep", 0.125), ("score_precision", "highest"))),
    "svg2_iters2": ("svg2", (("iters", 2), ("top_p", 0.25), ("min_cluster_tokens", 43))),
    # k-means' assignment by kmeans_assign's default, "auto": the Triton kernel on a GPU.
    "svg2_iters1": ("svg2", (("iters", 1), ("top_p", 0.25), ("min_cluster_tokens", 43))),
    # The same with the assignment forced to the Triton kernel (no [L, C] distances in memory)
    # and, the control, to XLA's matmul + argmin (H200 session 12: 9.27 vs 15.17 ms a call).
    "svg2_iters1_fused": ("svg2", (("iters", 1), ("top_p", 0.25), ("min_cluster_tokens", 43),
                                   ("kmeans_assign", "pallas"))),
    "svg2_iters1_xla": ("svg2", (("iters", 1), ("top_p", 0.25), ("min_cluster_tokens", 43),
                                 ("kmeans_assign", "xla"))),
    "sparge_topk": ("sparge", (("topk", 0.2), ("sim_threshold", -1.0))),
    "sparge_topk_xla": ("sparge", (("topk", 0.2), ("sim_threshold", -1.0), ("top_k", "xla"))),
    "sparge_topk_pool_xla": ("sparge", (("topk", 0.2), ("sim_threshold", -1.0),
                                        ("pool", "xla"))),
    "xattn_s8": ("xattn", (("stride", 8), ("tau", 0.25))),
    "xattn_s64": ("xattn", (("stride", 64), ("tau", 0.25))),
}


def builder_costs(args, progress=None, save=None) -> dict:
    """Per builder variant at Wan 720p (T'H'W' = 21 x 45 x 80, 40 heads, D 128; ``--tiny``: a
    small grid): the mask-building time alone (permutations included), the time of the whole
    call (building + tessera's attention) and the fraction building / attention."""
    grid, H, D = ((5, 6, 8), 2, 16) if args.tiny else ((21, 45, 80), 40, 128)
    L = int(np.prod(grid))
    out = {}
    doc = dict(grid=list(grid), heads=H, head_dim=D, dtype=args.dtype, variants=out)
    names = [n.strip() for n in args.builder_costs.split(",") if n.strip()]
    for name in names:
        if name not in BUILDER_VARIANTS:
            raise SystemExit(f"bench_loop: unknown builder variant {name!r}; known: "
                             f"{sorted(BUILDER_VARIANTS)}")
        rule_name, params = BUILDER_VARIANTS[name]
        if args.tiny:       # small clusters and blocks for the small grid
            params = dict(params, **{"svg2": {"q_clusters": 6, "kv_clusters": 10, "init_iters": 3,
                                              "min_cluster_tokens": 1},
                                     "sparge": {"block_q": 32, "block_kv": 16},
                                     "xattn": {"block": 64}}.get(rule_name, {}))
            params = tuple(params.items())
        case = DynCase(name, "wan", WAN21_14B, 0, 0, 0, 1, 1, 0, rule_name, tuple(params),
                       cube=(2, 2, 2) if args.tiny else (4, 4, 4))
        rule, _ = make_rule(case, grid)
        if progress is not None:
            progress.set_postfix_str(f"builder {name}")
        opts = AttentionOptions(backend=args.backend,
                                dense_implementation=_dense_impl(args, args.dtype),
                                sparse_options=_sparse_options(args))
        try:
            pc = _per_call(case, rule, L, H, D, args.dtype, opts, args, jax.random.key(args.seed))
        except Exception as e:      # keep the other variants
            out[name] = dict(error=repr(e)[:2000])
            continue
        attn = pc["dynamic_attention_s"] - pc["build_s"]
        out[name] = dict(pc, rule=repr(rule), attention_s=attn,
                         fraction=pc["build_s"] / attn if attn > 0 else None)
        if save is not None:
            save(doc)
    return dict(doc, note="fraction = build_s / (dynamic_attention_s - build_s): the builder's cost "
                     "over the sparse attention call it feeds; issue 17 asks <= 0.05")


def _peers_estimate(case: DynCase, res: dict, L: int, H: int, args) -> dict | None:
    """Loop time with the peers' attention, an *estimate*: the loop measured without
    self-attention (``null``), plus the dense calls at the measured dense attention time, plus
    per sparse call our builder's time and the peer's request time (peers JSON)."""
    pc, loops = res.get("per_call", {}), res["loops"]
    if "loop_s" not in loops.get("null", {}) or "build_s" not in pc:
        return None
    per = peers_per_call(_peer_rows(args.peers_json), case, L, H, pc["density"])
    if not per:
        return None
    base = loops["null"]["loop_s"] + res["dense_calls"] * pc["dense_attention_s"]
    est = {p: dict(v, loop_s=base + res["sparse_calls"] * (pc["build_s"] + v["ms"] / 1e3))
           for p, v in per.items()}
    best = min(est, key=lambda p: est[p]["loop_s"])
    out = dict(label="ESTIMATE (not measured): null loop + dense calls x dense attention + "
                     "sparse calls x (our builder + the peer's request time)",
               peers_json=args.peers_json, by_peer=est, best_peer=best,
               best_loop_s=est[best]["loop_s"])
    if "loop_s" in loops.get("dynamic", {}):
        out["speedup_vs_peers_estimate"] = est[best]["loop_s"] / loops["dynamic"]["loop_s"]
    return out


# --- summary and output -----------------------------------------------------------------------
def summarize(cases: dict) -> dict:
    """The issues' summary over the cases present: static-mask cases (geometric mean over cases
    where aggregated) and dynamic ones (``summarize_dynamic``)."""
    if not cases:
        return {}
    dyn = {k: c for k, c in cases.items() if c.get("kind") == "dynamic"}
    cases = {k: c for k, c in cases.items() if c.get("kind") != "dynamic"}
    out = _summarize_static(cases) if cases else {}
    if dyn:
        out.update(summarize_dynamic(dyn))
    return out


def summarize_dynamic(cases: dict) -> dict:
    """Issue 17's summary keys over the dynamic cases present (None where not measured)."""
    def loop(c, v):
        return c["loops"].get(v, {})

    def pick(fn):
        vals = {}
        for k, c in cases.items():
            try:
                x = fn(c)
            except (KeyError, TypeError):
                x = None
            if x is not None:
                vals[k] = x
        return vals

    ops = pick(lambda c: loop(c, "dynamic")["host_transfer_ops"] if loop(c, "dynamic").get(
        "transfer_guard_ok") else None)
    guard_failed = [k for k, c in cases.items() if loop(c, "dynamic").get("transfer_guard_ok") is False]
    traces = pick(lambda c: loop(c, "dynamic")["trace_count"])
    vs_dense = pick(lambda c: loop(c, "dynamic")["speedup_vs_dense"])
    vs_host = pick(lambda c: c["speedup_vs_host_planning"])
    vs_peers = pick(lambda c: c["peers_estimate"]["speedup_vs_peers_estimate"])
    hy = [k for k in vs_dense if cases[k]["model"] == "hunyuan"]
    return dict(
        host_transfers_in_loop=(None if guard_failed or not ops else max(ops.values())),
        host_transfers_in_loop_by_case=ops, transfer_guard_failed=guard_failed,
        compiles_per_loop=max(traces.values()) if traces else None,
        compiles_per_loop_by_case=traces,
        wan13b_480p_dynamic_speedup_vs_dense=vs_dense.get("wan13b_480p_vsa"),
        hunyuan720_dynamic_speedup_vs_dense=vs_dense[hy[0]] if hy else None,
        dynamic_speedup_vs_dense_by_case=vs_dense,
        speedup_vs_host_planning_min=min(vs_host.values()) if vs_host else None,
        speedup_vs_host_planning_by_case=vs_host,
        speedup_vs_peers_estimate_min=min(vs_peers.values()) if vs_peers else None,
        speedup_vs_peers_estimate_by_case=vs_peers,
        dynamic_layers_by_case={k: [c["layers_run"], c["layers_total"]] for k, c in cases.items()},
        dynamic_steps_by_case={k: [c["dense_steps"], c["steps"]] for k, c in cases.items()},
        dynamic_density_by_case=pick(lambda c: c["per_call"]["density"]),
        # The run each case's ratios come from (all its loops are timed in that one call).
        dynamic_run_by_case={k: {f: c.get("environment", {}).get(f)
                                 for f in ("date_utc", "commit", "command")}
                             for k, c in cases.items()},
        dynamic_notes=(
            "Dynamic cases: masks built from q and k inside one compiled loop. "
            "host_transfers_in_loop: host-transfer sites (callbacks, send/recv, in/outfeed) in "
            "the compiled dynamic loop, which is also timed under jax.transfer_guard('disallow') "
            "with its inputs on the device; compiles_per_loop: traces of that loop (compiled "
            "once, ahead of time, and run for every timed run). speedup_vs_host_planning: the same loop with each mask planned on the host "
            "(jax.pure_callback -> tj.plan, plans padded to a static capacity derived from the "
            "shapes) / ours. speedup_vs_peers_estimate is an ESTIMATE, not a measurement: the loop "
            "measured without self-attention + dense calls x measured dense attention + sparse "
            "calls x (our builder + the peer's request time from the peers JSON, scaled to the "
            "case), best peer / ours. Cases with layers_run < layers_total ran a layer subset; "
            "steps as in dynamic_steps_by_case [dense, total]."),
    )


def _summarize_static(cases: dict) -> dict:
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
        command="python benchmarks/bench_loop.py " + " ".join(argv),
        commit=code_revision(pathlib.Path(__file__).resolve().parents[1]),
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tiny=args.tiny)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_loop.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--models", default="wan13b_480p,wan14b_720p,hunyuan15_720p",
                   help="comma-separated case names: " + ", ".join(list(CASES) + list(DYN_CASES))
                   + "; 'dynamic' names the dynamic ones")
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
    p.add_argument("--host-repeats", type=int, default=1,
                   help="timed runs of the host-planning loop (minutes each at full size)")
    p.add_argument("--shift", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", default=None,
                   help="override the mask family of the selected cases (tessera_jax.masks.families)")
    p.add_argument("--family-params", default=None, help='JSON dict, e.g. \'{"window": [3, 3, 3]}\'')
    p.add_argument("--dense-steps", type=int, default=None, help="override the dense warm-up steps")
    p.add_argument("--mask-seeds", type=int, default=None,
                   help="distinct per-layer masks (layer l uses seed l %% N; 0: one per layer)")
    p.add_argument("--out", default=None,
                   help="JSON path, cases merged into it (default: none, the table is printed)")
    g = p.add_argument_group("dynamic cases (masks built from q and k inside the loop)")
    g.add_argument("--variants", default="dense,dynamic,null,host",
                   help="loops to time: dense (cuDNN), dynamic (ours), null (no self-attention: "
                        "the peers' estimate), host (plan on the host per call)")
    g.add_argument("--rule-params", default=None,
                   help='JSON dict overriding the rule fields, knobs and kernel options, e.g. '
                        '\'{"topk": 0.2, "top_k": "xla"}\' (tessera_jax.masks.dynamic)')
    g.add_argument("--peers-json", default=os.path.join("benchmarks", "results", "h200-peers.json"),
                   help="per-call request times of FlashInfer / FlexAttention (benchmarks/peers.py "
                        "rows, or {'loop_cases': {case: {peer: ms}}})")
    g.add_argument("--device-gather", default=None, choices=("never", "traced", "irregular"),
                   help="tessera_jax.Options.device_gather of the dynamic loop's sparse calls "
                        "(default: the library's)")
    g.add_argument("--host-bitmap-mb", type=int, default=64,
                   help="host-planning baseline: MiB of bitmap words in its static plan capacity")
    g.add_argument("--builder-costs", default=None,
                   help="instead of loops: time these builder variants at Wan 720p (comma-"
                        "separated, 'all': " + ", ".join(BUILDER_VARIANTS) + ")")
    args = p.parse_args(argv)
    if args.dense_implementation == "xla":
        args.dense_implementation = None
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.attn_repeats = args.attn_repeats or (3 if args.tiny else 20)
    args.step_repeats = args.step_repeats or (2 if args.tiny else 5)
    pool = ({**tiny_cases(args.steps or 3), **tiny_dyn_cases(args.steps or 3)} if args.tiny
            else {**CASES, **DYN_CASES})
    names = []
    for n in (n.strip() for n in args.models.split(",")):
        names += list(DYN_CASES) if n == "dynamic" else ([n] if n else [])
    unknown = [n for n in names if n not in pool]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {sorted(pool)}")
    if args.builder_costs == "all":
        args.builder_costs = ",".join(BUILDER_VARIANTS)
    args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    bad = [v for v in args.variants if v not in ("dense", "dynamic", "null", "host")]
    if bad:
        p.error(f"unknown variant(s) {bad}")
    cases = []
    for n in names:
        c = pool[n]
        if isinstance(c, DynCase):
            cases.append(_dyn_overrides(c, args, p))
            continue
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


def _dyn_overrides(c: DynCase, args, p) -> DynCase:
    """--steps (dense warm-up steps scaled in proportion unless --dense-steps), --layers,
    --rule-params on a dynamic case."""
    if args.steps and not args.tiny and args.steps != c.steps:
        c = dataclasses.replace(c, steps=args.steps,
                                dense_steps=min(args.steps, round(c.dense_steps * args.steps / c.steps)))
    if args.dense_steps is not None:
        c = dataclasses.replace(c, dense_steps=min(args.dense_steps, c.steps))
    if args.layers and c.layers_run < c.layers_total:
        c = dataclasses.replace(c, layers_run=min(args.layers, c.layers_total))
    if args.rule_params:
        params = json.loads(args.rule_params)
        if not isinstance(params, dict):
            p.error("--rule-params must be a JSON object")
        c = dataclasses.replace(c, rule_params=tuple({**dict(c.rule_params), **params}.items()))
    return c


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--merge"]:  # --merge A.json ... [--peers-json P.json] --out C.json
        peers, bad = None, False
        if "--peers-json" in argv:
            i = argv.index("--peers-json")
            peers, bad = (argv + [None])[i + 1], i + 1 >= len(argv) or argv[i + 1] == "--out"
            argv = argv[:i] + argv[i + 2:]
        if bad or "--out" not in argv or argv.index("--out") != len(argv) - 2 or len(argv) < 4:
            raise SystemExit("usage: bench_loop --merge A.json [B.json ...] [--peers-json P.json] "
                             "[--scaling-check SUBSET.json FULL.json] --out OUT.json")
        checks = []
        while "--scaling-check" in argv:
            i = argv.index("--scaling-check")
            if i + 3 > len(argv) - 2:
                raise SystemExit("usage: --scaling-check SUBSET.json FULL.json")
            checks.append((argv[i + 1], argv[i + 2]))
            argv = argv[:i] + argv[i + 3:]
        doc = merge_files(argv[1:-2], argv[-1], peers, scaling_checks=checks)
        _print_table(doc)
        return doc
    args = parse_args(argv)
    if not args.tiny and jax.default_backend() != "gpu":
        print("bench_loop: no GPU here; run with --tiny for the CPU smoke run", file=sys.stderr)
    doc: dict = {}
    if args.out and os.path.exists(args.out):
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
    if args.builder_costs:
        def save_partial(part):
            _write(args.out, dict(doc, builder_costs=dict(part, environment=env, partial=True)))
        doc["builder_costs"] = dict(builder_costs(args, save=save_partial), environment=env)
        doc["summary"] = summarize(doc["cases"])
        doc["summary"]["builder_cost_fraction_by_variant"] = {
            k: v.get("fraction") for k, v in doc["builder_costs"]["variants"].items()}
        _write(args.out, doc)
        print(json.dumps(doc["summary"]["builder_cost_fraction_by_variant"]))
        return doc
    bar = tqdm(args.cases, desc="bench_loop", unit="case", file=sys.stderr)
    for case in bar:
        def save(partial, case=case):
            doc["cases"][case.name] = dict(partial, partial=True, environment=env)
            doc["summary"] = summarize(doc["cases"])
            _write(args.out, doc)
        try:
            res = (run_dyn_case(case, args, bar, save) if isinstance(case, DynCase)
                   else run_case(case, args, bar))
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
        if not isinstance(case, DynCase):
            res["family"], res["family_params"] = case.family, dict(case.family_params)
        doc.get("errors", {}).pop(case.name, None)
        doc["cases"][case.name] = res
        doc["environment"] = env
        doc["summary"] = summarize(doc["cases"])
        _write(args.out, doc)
    doc["runs"].append(env)
    doc["summary"] = summarize(doc["cases"])
    if "builder_costs" in doc:
        doc["summary"]["builder_cost_fraction_by_variant"] = {
            k: v.get("fraction") for k, v in doc["builder_costs"]["variants"].items()}
    _write(args.out, doc)
    _print_table(doc)
    return doc


def _write(path, doc):
    """``doc`` as JSON at ``path`` (atomically); nothing when ``path`` is None."""
    if path is None:
        return
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    os.replace(tmp, path)


def merge_files(paths, out, peers_json: str | None = None, scaling_checks=()) -> dict:
    """Merge result files of several processes (e.g. one per GPU) into ``out``: their cases,
    runs and errors, with the summary recomputed over all cases. Later files win on a clash.
    With ``peers_json``, every dynamic case's peers estimate is recomputed from that file (the
    loops measured are kept; only the estimate's per-call peer times change). Each
    ``scaling_checks`` pair (subset file, full-depth file of the same case, same steps) is kept
    as ``layer_scaling_check`` (``scaling_check``)."""
    doc: dict = {"cases": {}, "runs": []}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        doc["cases"].update(d.get("cases", {}))
        doc["runs"].extend(d.get("runs", []))
        doc.setdefault("errors", {}).update(d.get("errors", {}))
        if "environment" in d:
            doc["environment"] = d["environment"]
        if "builder_costs" in d:
            doc["builder_costs"] = d["builder_costs"]
    for name, c in doc["cases"].items():
        if not c.get("partial"):
            doc.get("errors", {}).pop(name, None)
        if peers_json is not None and c.get("kind") == "dynamic" and name in DYN_CASES:
            c.pop("peers_estimate", None)
            est = _peers_estimate(DYN_CASES[name], c, c["attention_len"], c["heads"],
                                  argparse.Namespace(peers_json=peers_json))
            if est:
                c["peers_estimate"] = est
    if not doc.get("errors"):
        doc.pop("errors", None)
    doc["summary"] = summarize(doc["cases"])
    if scaling_checks:
        doc["layer_scaling_check"] = {}
        for sub, full in scaling_checks:
            doc["layer_scaling_check"].update(scaling_check(sub, full))
        chk = doc["layer_scaling_check"]
        doc["summary"]["layer_scaling_full_over_subset_speedup_by_case"] = {
            k: v["full_over_subset_speedup"] for k, v in chk.items()}
        doc["summary"]["dynamic_speedup_vs_dense_full_depth_by_case"] = {
            k: v["full"]["speedup_vs_dense"] for k, v in chk.items()}
    if "builder_costs" in doc:
        doc["summary"]["builder_cost_fraction_by_variant"] = {
            k: v.get("fraction") for k, v in doc["builder_costs"]["variants"].items()}
    _write(out, doc)
    return doc


def scaling_check(subset_path: str, full_path: str) -> dict:
    """Issue 33 item 4: one case run on a layer subset and at full depth (same steps, same
    commit and machine, two processes): each side's loop times scaled to the full model, its
    dense / dynamic speedup, and full / subset of each (the subset's scaling error)."""
    out = {}
    with open(subset_path) as f:
        a = json.load(f)
    with open(full_path) as f:
        b = json.load(f)
    for name in set(a["cases"]) & set(b["cases"]):
        ca, cb = a["cases"][name], b["cases"][name]
        if ca["layers_run"] >= cb["layers_run"] or cb["layers_run"] != cb["layers_total"]:
            raise ValueError(f"{name}: {subset_path} must run a layer subset and {full_path} "
                             f"every layer ({ca['layers_run']}, {cb['layers_run']})")
        if ca.get("steps") != cb.get("steps"):
            raise ValueError(f"{name}: the two runs' steps differ ({ca.get('steps')}, "
                             f"{cb.get('steps')})")

        def side(c, d):
            loops = {v: c["loops"][v]["loop_full_model_s"] for v in ("dense", "dynamic")}
            return dict(layers_run=c["layers_run"], steps=c["steps"], loop_full_model_s=loops,
                        speedup_vs_dense=loops["dense"] / loops["dynamic"],
                        commit=d["environment"]["commit"], device=d["environment"]["device"],
                        command=d["environment"]["command"])
        sa, sb = side(ca, a), side(cb, b)
        out[name] = dict(
            subset=sa, full=sb,
            full_over_subset_speedup=sb["speedup_vs_dense"] / sa["speedup_vs_dense"],
            full_over_subset_loop_s={v: sb["loop_full_model_s"][v] / sa["loop_full_model_s"][v]
                                     for v in ("dense", "dynamic")},
            note="loop_full_model_s: each run's loop time scaled per layer to every layer "
                 "(the full-depth run is not scaled); full_over_subset_*: the scaling's error "
                 "on this case (1 = exact)")
    return out


def _print_table(doc):
    static = {k: c for k, c in doc["cases"].items() if c.get("kind") != "dynamic"}
    dyn = {k: c for k, c in doc["cases"].items() if c.get("kind") == "dynamic"}
    if static:
        _print_static({**doc, "cases": static})
    if dyn:
        print(f"{'dynamic case':22s} {'layers':>7s} {'dense s':>9s} {'dynamic s':>9s} "
              f"{'host s':>9s} {'null s':>9s} {'vs dense':>8s} {'vs host':>8s} {'vs peers*':>9s}")
        for k, c in dyn.items():
            lp = c["loops"]
            sc = c["layers_total"] / c["layers_run"]

            def t(v, lp=lp, sc=sc):
                return f"{lp[v]['loop_s'] * sc:9.3f}" if "loop_s" in lp.get(v, {}) else f"{'-':>9s}"

            def f(x, w=8):
                return f"{x:{w}.3f}" if x is not None else f"{'-':>{w}s}"

            print(f"{k:22s} {c['layers_run']:>3d}/{c['layers_total']:<3d} {t('dense')} "
                  f"{t('dynamic')} {t('host')} {t('null')} "
                  f"{f(lp.get('dynamic', {}).get('speedup_vs_dense'))} "
                  f"{f(c.get('speedup_vs_host_planning'))} "
                  f"{f(c.get('peers_estimate', {}).get('speedup_vs_peers_estimate'), 9)}"
                  + ("  (extrapolated per layer)" if c["extrapolated"] else ""))
        print("* an estimate (see summary.dynamic_notes)")
    print("summary:", json.dumps({k: v for k, v in doc.get("summary", {}).items()
                                  if not k.endswith("_by_case") and "notes" not in k}))


def _print_static(doc):
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


if __name__ == "__main__":
    main()
