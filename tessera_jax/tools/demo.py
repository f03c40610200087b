"""The main job (`make demo`): plan and run a sliding-tile video mask, check it, time it.

CPU: a small video token grid; GPU: the Wan2.1 480p grid (21 x 30 x 52 = 32,760 tokens, 12 heads).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import tessera_jax as tj
from tessera_jax import masks
from tessera_jax.tools import cli, timing


def _head(mask: tj.BlockMask, h: int) -> tj.BlockMask:
    return tj.BlockMask(mask.q_bounds, mask.kv_bounds, mask.blocks[h if mask.num_heads > 1 else 0])


def _work_line(plan) -> str:
    """The plan's computed work against the bound the planner keeps (``Plan.stats()``): a dense
    plan of the same tiles, which exceeds Lq x Lkv where the tiles overhang the lengths."""
    s = plan.stats()
    done, bound, dense = (s["computed_interactions"], s["dense_tile_interactions"],
                          s["dense_interactions"])
    line = (f"work: computed {done:,} interactions = {done / bound:.2f}x a dense plan of the "
            f"same {plan.tile_q}x{plan.tile_kv} tiles (the planner keeps every head <= 1x)")
    if bound > dense:
        line += (f"; {done / dense:.2f}x Lq x Lkv x heads, as the tiles overhang the "
                 f"{plan.shape.q_len}x{plan.shape.kv_len} lengths")
    return line


def parser() -> cli.Parser:
    """The demo's options (building it starts nothing: no JAX backend, no planning)."""
    ap = cli.Parser("tessera_jax.tools.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-grid", type=cli.int_tuple("T,H,W"), default=(4, 16, 16),
                    metavar="T,H,W", help="video token grid used on CPU (frames, height, width "
                    "in latent patches; default 4,16,16); ignored on a GPU (Wan2.1 480p)")
    ap.add_argument("--repeats", type=cli.positive_int, default=None,
                    help="timed calls, median (default 5 on CPU, 20 on a GPU, the least the "
                    "GPU kernel rule accepts)")
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        grid, heads, dim, dtype = masks.get_grid("wan480"), 12, 128, jnp.bfloat16
        tile, window = (6, 8, 8), (3, 3, 5)
        repeats = 20 if args.repeats is None else args.repeats
    else:
        grid, heads, dim, dtype = masks.Grid("demo", *args.cpu_grid, 4), 4, 64, jnp.float32
        tile, window = (2, 4, 4), (1, 3, 3)
        repeats = 5 if args.repeats is None else args.repeats
    # GPU: the kernel rule of every benchmark (CUPTI kernel time, L2 flushed, median);
    # CPU: host wall clock after one warm-up call.
    try:
        rule = (timing.KERNEL_RULE.replace(repeats=repeats) if on_gpu
                else timing.wall_rule(repeats, warmup=1))
    except ValueError as e:
        ap.error(f"argument --repeats: {e}")
    L = grid.video_tokens
    try:
        mask = masks.sta(grid, heads=heads, tile=tile, window=window)
    except ValueError as e:
        ap.error(f"argument --cpu-grid: {e}")
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"video grid {grid.shape} = {L:,} tokens, {heads} heads, head_dim {dim}, {jnp.dtype(dtype).name}")
    print(f"mask: sliding-tile windows {window} over tiles {tile}: {mask}")

    shape = (1, L, heads, dim)
    # One-shot host times (a first call happens once): the timing module's wall clock.
    plan, t_first = timing.wall_once(lambda: tj.plan(mask, shape, shape, dtype))
    # A second, different mask: planning alone (the kernel module and plan table are loaded).
    other = masks.sta(grid, heads=heads, tile=tile, window=tuple(max(1, w - 2) for w in window))
    _, t_new = timing.wall_once(lambda: tj.plan(other, shape, shape, dtype))
    _, t_cached = timing.wall_once(lambda: tj.plan(mask, shape, shape, dtype))
    print(f"planning: {t_first:.1f} ms first call (loads backend and table), "
          f"{t_new:.1f} ms for a new mask, {t_cached * 1e3:.1f} us cached")
    print(plan.describe())
    print(_work_line(plan))

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, L, heads, dim), dtype) for kk in keys)
    run = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, mask))
    with cli.ticking("compiling and running sparse_attention"):
        out = jax.block_until_ready(run(q, k, v))

    # Check against the dense float32 reference (one head on GPU: the dense scores are large).
    h = 0 if not on_gpu else heads // 2
    sl = slice(None) if not on_gpu else slice(h, h + 1)
    ref = tj.reference_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                 mask if not on_gpu else _head(mask, h))
    got = np.asarray(out[:, :, sl], np.float32)
    err = float(np.linalg.norm(got - np.asarray(ref, np.float32)) / np.linalg.norm(np.asarray(ref, np.float32)))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    print(f"check vs reference_attention: relative error {err:.2e} "
          f"({'ok' if err <= tol else 'FAILED'}, tolerance {tol:g})")

    with cli.ticking("timing sparse_attention"):
        ts = timing.time_kernel(lambda: run(q, k, v), rule=rule)
    t_sparse = ts.ms / 1e3
    flops = 4 * dim * mask.selected_interactions(heads)
    rate = flops / t_sparse
    rate_s = f"{rate / 1e12:.1f} effective TFLOP/s" if on_gpu else f"{rate / 1e9:.1f} effective GFLOP/s"
    print(f"sparse_attention: {t_sparse * 1e3:.2f} ms (median of {repeats}), {rate_s}, "
          f"density {mask.density:.3f}")
    if on_gpu:
        dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                     implementation="cudnn"))
        with cli.ticking("timing cuDNN dense attention"):
            td = timing.time_kernel(lambda: dense(q, k, v), rule=rule)
        t_dense = td.ms / 1e3
        print(f"cuDNN dense attention: {t_dense * 1e3:.2f} ms -> speed-up {t_dense / t_sparse:.2f}x")
    else:
        with cli.ticking("timing the dense reference"):
            td = timing.time_kernel(lambda: tj.reference_attention(q, k, v, mask), rule=rule)
        t_ref = td.ms / 1e3
        print(f"dense reference: {t_ref * 1e3:.2f} ms -> speed-up {t_ref / t_sparse:.2f}x")
    print(f"timing rule: {timing.assert_same_rule([ts, td], 'demo speed-up')}")
    if err > tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
