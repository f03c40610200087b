"""Where a host-start request's time goes beyond the same mask's GPU-start call (issue 33).

In ``peers.py`` a tiered request on a new host mask runs 1-2.5 ms over the gpu row's call of the
same mask (H100, ``results/h100-peers.json``), while its measured host parts (the packed copy,
the rule) explain ~0.3-0.6 ms. Per mask (corpus test masks, --families at --grid, --heads
heads), each timed by the one request rule (host wall clock; every cache cleared before each
call, as a new mask), executables compiled first:

* ``gpu_call``: the gpu row's call, ``jit(lambda q, k, v, b: sparse_attention(..., BlockMask(
  q_bounds, kv_bounds, b)))`` on blocks already on the device (static bounds);
* ``mask``: the ``BlockMask`` built from its NumPy arrays (validation, packed bits),
  which peers' host rows count in the request;
* ``copy``: ``mask.packed_leaves(static_bounds=...)`` to the device (a tiered request with
  static bounds hands the bits to its jit instead since session 35: ``route_host_packed``);
* ``route``: the tiered device route on premade leaves (``tiered._device_route``: the packed
  program's dispatch, unpack, plan and kernel, no Python front, no background plan);
* ``route_unpacked``: the route's entry (``device_route.attention``) on unpacked device
  blocks; ``route_python``: the route with its prepared call stubbed (Python alone);
* ``copy_route``: the two in a row; ``route_host_packed`` (static bounds): the route given
  the packed bits as NumPy, copied by its jitted call's dispatch instead of ``device_put``;
* ``front``: ``tj.sparse_attention`` with the tiered route stubbed to return q (validation,
  keys, rule, bookkeeping; the background plan not submitted);
* ``request_no_plan``: the whole tiered request with no background plan submitted;
* ``request``: the default request (tiered: a new mask starts no background plan, its host
  plan waits for the mask's second call, ``Options.host_plan_from_call``);
* ``request_plan_at_once``: the same with the host plan started at the first call
  (``host_plan_from_call=1``, the default before session 35);
* ``request_from_arrays``: the default request building its ``BlockMask`` from the NumPy
  arrays, as peers' host rows time it.

Beside them, cProfile's top functions by own time of the route and of the request
(``profile_route``, ``profile_request``: ms per call own and cumulative, calls, name).

The bounds are static where the family's bounds do not change with the mask
(``peers.tiered_bounds``), traced otherwise, as peers' host rows run them.

    python3 benchmarks/host_row_breakdown.py --out $OUT/h100-host-row-breakdown.json
    python3 benchmarks/host_row_breakdown.py --small      # CPU smoke run (XLA, tiny masks)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import types

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def _small_masks():
    """CPU smoke masks: a shared grid of 64-token blocks and irregular key blocks."""
    import tessera_jax as tj
    rng = np.random.default_rng(0)
    grid = np.arange(0, 513, 64)
    kb = np.r_[0, np.cumsum(rng.permutation(np.arange(20, 32)))]
    kb = np.r_[kb[kb < 512], 512]
    return [({"family": "grid", "grid": "small"}, tj.BlockMask(grid, grid, rng.random(
                (2, 8, 8)) < 0.4), "same"),
            ({"family": "clusters", "grid": "small"}, tj.BlockMask(grid, kb, rng.random(
                (2, 8, len(kb) - 1)) < 0.4), "new")]


def _corpus_masks(families, grid: str, heads: int):
    import peers
    from tessera_jax.masks.corpus import build
    args = peers.parse_args(["--tiered-bounds", "auto"])
    out = []
    for spec in peers.sample_specs(1, families, [grid])[0]:
        mask = build(spec, heads=heads)
        case = types.SimpleNamespace(spec=spec, mask=mask)      # what tiered_bounds reads
        out.append((spec, mask, peers.tiered_bounds(case, args)))
    return out


def _profile(fn, before, calls: int = 5, top: int = 25) -> list:
    """The ``top`` functions by own time over ``calls`` calls of ``fn`` (``before`` each, not
    profiled): (ms per call own, ms per call cumulative, calls per call, name)."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    for _ in range(calls):
        before()
        pr.enable()
        fn()
        pr.disable()
    st = pstats.Stats(pr).stats
    rows = sorted(((tt, ct, nc, f"{pathlib.Path(f).name}:{ln}({name})")
                   for (f, ln, name), (_, nc, tt, ct, _) in st.items()), reverse=True)[:top]
    return [(round(tt * 1e3 / calls, 4), round(ct * 1e3 / calls, 4), nc / calls, name)
            for tt, ct, nc, name in rows]


def breakdown(spec: dict, mask, bounds_mode: str, head_dim: int, dtype: str, heads: int,
              repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    import tessera_jax as tj
    from request_cases import forget_request_caches
    from tessera_jax.runtime import device_route, dispatch, tiered
    from tessera_jax.tools import timing
    from tessera_jax.validation import check_scale, check_shapes
    rule = timing.REQUEST_RULE.replace(repeats=repeats)
    key = jax.random.key(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, L, heads, head_dim),
                                 jnp.dtype(dtype))
               for i, L in enumerate((mask.Lq, mask.Lkv, mask.Lkv)))
    shape = check_shapes(q.shape, k.shape, q.dtype)
    be = dispatch.resolve(None, shape)
    scale = check_scale(None, head_dim)
    opts = tj.Options(host_planning="tiered")
    static = bounds_mode == "same"
    bkey = tiered.bounds_key(mask)
    ropts = tiered.route_options(opts, bkey)
    traced_key = tiered._compiled_key(q, k, mask, be, scale, False, ropts)
    tj.precompile(mask, q.shape, k.shape, q.dtype, options=opts,
                  tiered_routes=("static",) if static else ("traced",))
    res = {"family": spec["family"], "grid": spec["grid"], "bounds": bounds_mode,
           "blocks": list(mask.shape), "backend": be}
    clear = forget_request_caches
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    f = jax.jit(lambda q, k, v, b: tj.sparse_attention(q, k, v, tj.BlockMask(qb, kb, b)))
    dev_blocks = jax.device_put(mask.blocks)
    ckey = traced_key + (bkey,) if static else traced_key
    leaves = mask.packed_leaves(static_bounds=static)

    def route(lv):
        return jax.block_until_ready(tiered._device_route(
            q, k, v, mask, lv, shape, be, scale, False, ropts, ckey))

    def t(name, fn):
        r = timing.time_request(fn, rule=rule, before=clear)
        res[name + "_ms"] = r.ms
        res[name + "_samples"] = r.samples
    t("gpu_call", lambda: jax.block_until_ready(f(q, k, v, dev_blocks)))
    t("mask", lambda: tj.BlockMask(qb, kb, mask.blocks))
    t("copy", lambda: jax.block_until_ready(mask.packed_leaves(static_bounds=static)))
    t("route", lambda: route(leaves))
    # The route's program on unpacked blocks (its jitted entry, no unpack), and its Python
    # alone (the program stubbed): what separates ``route`` from ``gpu_call``.
    like = tj.BlockMask(leaves[0], leaves[1], dev_blocks) if static else \
        tj.BlockMask(*jax.device_put((qb, kb)), dev_blocks)
    t("route_unpacked", lambda: jax.block_until_ready(device_route.attention(
        q, k, v, like, shape, be, None, scale, False, tiered._untiered(ropts))))
    real_fn = tiered._PREPARED[ckey]             # the route's prepared call (run above)
    try:
        tiered._PREPARED[ckey] = lambda q, *a: q
        t("route_python", lambda: route(leaves))
    finally:
        tiered._PREPARED[ckey] = real_fn
    res["profile_route"] = _profile(lambda: route(leaves), clear)
    t("copy_route", lambda: route(mask.packed_leaves(static_bounds=static)))
    if static:     # the packed bits handed to the route's jit as NumPy (its C++ path copies)
        t("route_host_packed", lambda: route(mask.packed_leaves(static_bounds=True,
                                                                host_bits=True)))
    real_route, real_exec = tiered._device_route, tiered._executor

    class _NoPlan:
        def submit(self, fn, *a):
            return None
    try:
        tiered._executor = _NoPlan
        tiered._device_route = lambda q, *a, **kw: q
        t("front", lambda: tj.sparse_attention(q, k, v, mask, options=opts))
        tiered._device_route = real_route
        t("request_no_plan", lambda: jax.block_until_ready(
            tj.sparse_attention(q, k, v, mask, options=opts)))
    finally:
        tiered._device_route, tiered._executor = real_route, real_exec
    clear()
    t("request", lambda: jax.block_until_ready(tj.sparse_attention(q, k, v, mask)))
    at_once = tj.Options(host_plan_from_call=1)
    t("request_plan_at_once", lambda: jax.block_until_ready(
        tj.sparse_attention(q, k, v, mask, options=at_once)))
    blocks = np.asarray(mask.blocks)
    t("request_from_arrays", lambda: jax.block_until_ready(
        tj.sparse_attention(q, k, v, tj.BlockMask(qb, kb, blocks))))
    res["profile_request"] = _profile(
        lambda: jax.block_until_ready(tj.sparse_attention(q, k, v, mask)), clear)
    res["device_route_calls"] = tiered.stats().get("device_route", 0)
    clear()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="sparge,jenga,vsa,svg2")
    ap.add_argument("--grid", default="wan480")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--small", action="store_true", help="CPU smoke run: tiny masks, XLA")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    if a.small:
        masks, a.heads, a.head_dim, a.dtype = _small_masks(), 2, 16, "float32"
    else:
        masks = _corpus_masks(a.families.split(","), a.grid, a.heads)
    rows = []
    for spec, mask, mode in masks:
        t0 = time.perf_counter()
        try:
            r = breakdown(spec, mask, mode, a.head_dim, a.dtype, a.heads, a.repeats)
        except Exception as e:  # noqa: BLE001
            r = {"family": spec["family"], "error": f"{type(e).__name__}: {e}"[:400]}
        r["wall_s"] = time.perf_counter() - t0
        rows.append(r)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                          if not k.endswith("_samples") and not k.startswith("profile_")}),
              flush=True)
        doc = {"benchmark": "host_row_breakdown", "device": str(jax.devices()[0].device_kind),
               "argv": sys.argv[1:] if argv is None else list(argv), "rule": "request (wall "
               "clock, caches cleared before each call)", "rows": rows}
        if a.out:                                   # after each mask: a cut run keeps its rows
            pathlib.Path(a.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
