#!/usr/bin/env python3
"""Side by side with the peers on the H200 (issue 7): tessera_jax vs FlashInfer, FlexAttention, cuDNN.

Over a sample of the corpus *test* split (``tessera_jax.masks.corpus("test")``), stratified by
family (``--per-family`` masks each, spread over the grids, taken round-robin over families so a
time budget cut keeps the families balanced), per mask and per peer:

- request latency: host wall clock from the logical ``BlockMask`` to the result on the device:
  mask conversion + planning + kernel (tessera_jax: its plan cache is cleared before each call,
  so planning is paid every time; compilation is warmed up and reported apart);
- kernel-only time: every peer under one rule, ``tessera_jax.tools.timing.KERNEL_RULE`` (with
  ``--iters`` timed calls): CUPTI kernel time of every launch in one call (JAX and torch alike,
  one collector), the L2 flushed before each call, median after warm-up. Request latencies are
  host wall clock under ``timing.REQUEST_RULE`` (``--request-iters`` calls) for every peer. Both
  rules are written into the JSON (``timing``) and checked (``summary.timing_rules``); a mixed
  rule fails the run after the file is written.

Peers: tessera_jax (``tj.sparse_attention``, default selection); FlashInfer
``BlockSparseAttentionWrapper`` (uniform blocks shared by all heads) and
``VariableBlockSparseAttentionWrapper`` (any mask; one pattern per *KV* head, so a per-head mask
whose heads differ inside a GQA group runs with K/V repeated to Hq heads), each ``plan()`` +
``run()`` (the first plan() JIT-builds FlashInfer's module: done once up front, reported apart);
torch FlexAttention (``torch.compile``d; ``BlockMask`` built on the GPU from the same logical mask
at the largest tile of ``--flex-blocks`` that needs no token-level masking, else 128x128 tiles
whose partially selected tiles use the exact ``mask_mod`` ``blocks[h, qblock[q], kvblock[kv]]``;
sequences padded to ``--flex-pad`` so compiled kernels are reused); cuDNN dense attention
(``jax.nn.dot_product_attention(implementation="cudnn")``, all interactions: the reference
point). Conversions are in ``peers_lib/convert.py`` (exactness tested on CPU). Inputs: B=1,
bf16, head_dim 128, one random q/k/v per mask shared by all peers (torch tensors, seen by JAX
through DLPack).

Before timing, every peer's output is checked against ``tessera_jax.reference_attention`` (float32)
on ``--check-rows`` query rows (both ends of blocks + random) x ``--check-kv-heads`` KV heads
(with their query heads); a peer that fails the check, can't take the mask or crashes records why
in its row and is not timed. Writes ``--out`` (raw rows, versions, command, ``summary``) and a PNG
of speedup distributions per family next to it.

GPU run (see fetch_flashinfer.py for the FlashInfer carry; ~8 min on an H200):

    python3 benchmarks/peers.py --out $OUT/h200-peers.json --time-budget 480 --per-family 2 --heads 8

CPU checks: ``--dry-run`` (tiny masks; conversions and their exactness; with torch, also
FlexAttention eager on CPU vs the reference), ``--smoke`` (needs torch: the whole pipeline above
on tiny masks, FlashInfer skipped, eager Flex, XLA dense; checks the plumbing, times nothing):

    python benchmarks/peers.py --dry-run
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX shares the GPU with torch

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from peers_lib import convert as C          # noqa: E402
from tessera_jax.tools import timing        # noqa: E402

T0 = time.time()
PEERS = ("tessera", "flashinfer_bsr", "flashinfer_var", "flex", "dense")
#: Peer groups of the summary: a group's time is its fastest variant that ran correctly.
GROUPS = {"flashinfer": ("flashinfer_bsr", "flashinfer_var"), "flex": ("flex",),
          "dense": ("dense",)}
OK_STATES = ("ok", "ok_empty_rows_differ")
RTOL = 2e-2          # relative Frobenius error of bf16 outputs vs the float32 reference
ATOL = 0.1           # max abs error on rows that select keys


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def _tail(e: BaseException, n: int = 600) -> str:
    return (type(e).__name__ + ": " + str(e))[:n] + " | " + \
        "".join(traceback.format_exception(e))[-n:].replace("\n", " / ")


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------
def sample_specs(per_family: int, families=None, grids=None, seed: int = 0):
    """Test-split specs: per family up to ``per_family``, spread over grids, round-robin order."""
    from tessera_jax.masks import corpus
    specs = corpus("test")
    by = collections.defaultdict(list)
    for s in specs:
        if (families and s["family"] not in families) or (grids and s["grid"] not in grids):
            continue
        by[s["family"]].append(s)
    rng = np.random.default_rng(seed)
    picked = {}
    for fam in sorted(by):
        by_grid = collections.defaultdict(list)
        for s in sorted(by[fam], key=lambda s: s["id"]):
            by_grid[s["grid"]].append(s)
        order_g = sorted(by_grid)
        rng.shuffle(order_g)
        for g in order_g:
            rng.shuffle(by_grid[g])
        seq = []
        while any(by_grid[g] for g in order_g):
            for g in order_g:
                if by_grid[g]:
                    seq.append(by_grid[g].pop())
        picked[fam] = seq[:per_family]
    out = [picked[f][r] for r in range(per_family) for f in sorted(picked) if r < len(picked[f])]
    return out, {f: len(v) for f, v in sorted(by.items())}


# ----------------------------------------------------------------------------------------------
# Summary and figure (pure Python: tested on CPU)
# ----------------------------------------------------------------------------------------------
def group_time(row: dict, group: str, key: str = "request_ms"):
    """The fastest correct variant of a peer group in a row, or None."""
    ts = [row["peers"][p].get(key) for p in GROUPS[group]
          if p in row.get("peers", {}) and row["peers"][p].get("status") in OK_STATES]
    ts = [t for t in ts if t is not None]
    return min(ts) if ts else None


def speedups(row: dict, key: str = "request_ms") -> dict:
    """tessera_jax speedups over each peer group and over the best alternative in one row."""
    me = row.get("peers", {}).get("tessera", {})
    if me.get("status") not in OK_STATES or me.get(key) is None:
        return {}
    t = me[key]
    out = {}
    alts = []
    for g in GROUPS:
        gt = group_time(row, g, key)
        if gt is not None:
            out[g] = gt / t
            alts.append(gt)
    if alts:
        out["best_alternative"] = min(alts) / t
    return out


def _stats(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": float(np.median(xs)), "min": float(np.min(xs)),
            "max": float(np.max(xs)), "geomean": float(np.exp(np.mean(np.log(xs))))}


def speedup_bounds(rows: list[dict]) -> dict:
    """Per peer group, the speed-up a runtime would reach with zero host cost and a kernel that
    runs exactly the selected FLOPs at this run's best cuDNN dense rate (all interactions, over
    all shapes): a bound for anything no faster than cuDNN dense. Medians and the rate used."""
    rates = []
    for r in rows:
        d = r.get("peers", {}).get("dense", {})
        if (d.get("status") in OK_STATES and d.get("kernel_ms") and r.get("density")
                and r.get("selected_flops")):
            rates.append(r["selected_flops"] / r["density"] / (d["kernel_ms"] * 1e-3))
    if not rates:
        return {}
    rate = max(rates)
    per = collections.defaultdict(list)
    for r in rows:
        if not r.get("selected_flops"):
            continue
        t_min = r["selected_flops"] / rate * 1e3                    # ms
        for g in GROUPS:
            gt = group_time(r, g)
            if gt is not None and t_min > 0:
                per[g].append(gt / t_min)
    return {"dense_rate_tflops": rate / 1e12,
            "median": {g: float(np.median(v)) for g, v in per.items()},
            "masks_below_3x": {g: int(sum(x < 3 for x in v)) for g, v in per.items()},
            "meaning": "peer request ms / (selected FLOPs at this run's best cuDNN dense rate, "
                       "zero host cost): what a runtime matching that rate on exactly the "
                       "selected work would reach on a mask"}


def summarize(rows: list[dict]) -> dict:
    """The ``summary`` block: request-latency speedups (and kernel-only ones), per family."""
    out = {}
    for key, name in (("request_ms", "request"), ("kernel_ms", "kernel")):
        sp = [speedups(r, key) for r in rows]
        block = {g: _stats([s.get(g) for s in sp]) for g in (*GROUPS, "best_alternative")}
        fams = collections.defaultdict(list)
        for r, s in zip(rows, sp):
            fams[r["family"]].append(s)
        per_family = {f: {g: _stats([s.get(g) for s in v]) for g in (*GROUPS, "best_alternative")}
                      for f, v in sorted(fams.items())}
        out[name] = {"overall": block, "per_family": per_family}
    req = out["request"]["overall"]
    failures = collections.defaultdict(collections.Counter)
    for r in rows:
        for p, d in r.get("peers", {}).items():
            if d.get("status") not in OK_STATES:
                failures[p][d.get("status", "?") + ": " + str(d.get("why", ""))[:120]] += 1
    return {
        "masks": len(rows),
        "min_speedup_vs_best_alternative": req["best_alternative"].get("min"),
        "median_speedup_vs_best_alternative": req["best_alternative"].get("median"),
        "median_speedup_vs_flashinfer": req["flashinfer"].get("median"),
        "median_speedup_vs_flex": req["flex"].get("median"),
        "median_speedup_vs_dense": req["dense"].get("median"),
        "per_family_medians": {
            f: {g: d[g].get("median") for g in ("flashinfer", "flex", "dense", "best_alternative")}
            for f, d in out["request"]["per_family"].items()},
        "request": out["request"], "kernel": out["kernel"],
        "peer_not_ok": {p: dict(c) for p, c in failures.items()},
        "speedup_upper_bound": speedup_bounds(rows),
        "timing_rules": timing_rules(rows),
        "metric": "speedup = peer time / tessera_jax time on the same mask (request latency: "
                  "conversion + planning + kernel); a peer group's time is its fastest variant "
                  "that passed the check; best alternative = fastest of FlashInfer, "
                  "FlexAttention and cuDNN dense",
    }


def figure(rows: list[dict], path: str, title: str = "") -> str | None:
    """Per-family distributions of request speedups (log scale), one colour per peer group."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fams = sorted({r["family"] for r in rows})
    groups = ("flashinfer", "flex", "dense", "best_alternative")
    colors = ("tab:blue", "tab:orange", "tab:gray", "tab:red")
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(fams) + 2), 4.5))
    width = 0.8 / len(groups)
    any_pts = False
    for gi, (g, c) in enumerate(zip(groups, colors)):
        for fi, f in enumerate(fams):
            ys = [speedups(r).get(g) for r in rows if r["family"] == f]
            ys = [y for y in ys if y is not None]
            if not ys:
                continue
            any_pts = True
            x = fi - 0.4 + width * (gi + 0.5)
            ax.boxplot([ys], positions=[x], widths=width * 0.8, showfliers=False,
                       patch_artist=True, boxprops=dict(facecolor=c, alpha=0.35),
                       medianprops=dict(color=c))
            ax.scatter(np.full(len(ys), x), ys, s=10, color=c, zorder=3,
                       label=g.replace("_", " ") if fi == 0 or not ax.get_legend_handles_labels()[1].count(g.replace("_", " ")) else None)
    if any_pts:
        ax.set_yscale("log")
    for y, ls in ((1.0, "-"), (3.0, "--")):
        ax.axhline(y, color="k", lw=0.8, ls=ls)
    ax.set_xticks(range(len(fams)))
    ax.set_xticklabels(fams, rotation=30, ha="right")
    ax.set_ylabel("request speedup of tessera_jax (peer ms / ours)")
    ax.set_title(title or "tessera_jax vs peers, per mask family (H200)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------------
def _fi_curand_fallback() -> str | None:
    """FlashInfer's sm90 prefill build includes <curand_kernel.h> (through CUTLASS); if the CUDA
    toolkit lacks it, point nvcc at the copy in torch's nvidia-curand wheel."""
    import importlib.util
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if Path(home, "include", "curand_kernel.h").is_file():
        return None
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13/include", "curand/include"):
            inc = Path(base, sub)
            if (inc / "curand_kernel.h").is_file():
                flag = f"-isystem {inc}"
                os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = \
                    (os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", "") + " " + flag).strip()
                return flag
    return "curand_kernel.h not found (toolkit or nvidia wheels): the JIT build may fail"


class Ctx:
    """Process-wide GPU state: imports, FlashInfer wrappers, compiled Flex, dense cache."""

    def __init__(self, args):
        import jax
        import torch
        self.args = args
        self.jax, self.torch = jax, torch
        self.dev = torch.device("cpu" if args.smoke else "cuda")
        self.fi = None
        self.fi_error = None
        self.fi_ws = None
        self.fi_env = None
        self.fi_wrappers = {}
        self.flex = None
        self.flex_error = None
        self.dense_cache = {}

    # -- FlashInfer
    def flashinfer(self):
        if self.args.smoke:
            self.fi_error = "--smoke (CPU): FlashInfer needs the GPU"
        if self.fi is None and self.fi_error is None:
            try:
                self.fi_env = _fi_curand_fallback()
                import flashinfer
                self.fi = flashinfer
                self.fi_ws = self.torch.empty(256 << 20, dtype=self.torch.uint8, device=self.dev)
            except Exception as e:  # noqa: BLE001
                self.fi_error = "import flashinfer failed: " + _tail(e)
        return self.fi

    def fi_wrapper(self, kind: str):
        if kind not in self.fi_wrappers:
            cls = {"bsr": self.fi.BlockSparseAttentionWrapper,
                   "var": self.fi.VariableBlockSparseAttentionWrapper}[kind]
            self.fi_wrappers[kind] = cls(self.fi_ws, backend=self.args.fi_backend)
        return self.fi_wrappers[kind]

    # -- Flex
    def flex_fn(self):
        if self.flex is None and self.flex_error is None:
            try:
                import torch._dynamo
                from torch.nn.attention.flex_attention import flex_attention
                cfg = torch._dynamo.config
                for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                             "accumulated_recompile_limit"):
                    if hasattr(cfg, name):
                        setattr(cfg, name, max(getattr(cfg, name), 1024))
                # --smoke (CPU): eager (the unfused reference path; compiling on CPU is slow)
                self.flex = flex_attention if self.args.smoke else \
                    self.torch.compile(flex_attention, dynamic=False)
            except Exception as e:  # noqa: BLE001
                self.flex_error = "FlexAttention unavailable: " + _tail(e)
        return self.flex


class Case:
    """One mask on the GPU: inputs (torch, shared with JAX by DLPack) and the reference rows."""

    def __init__(self, ctx: Ctx, spec: dict, mask, Hkv: int, args):
        torch, jax = ctx.torch, ctx.jax
        self.ctx, self.spec, self.mask = ctx, spec, mask
        self.Lq, self.Lkv = mask.Lq, mask.Lkv
        self.Hq = int(spec["heads_run"])
        self.Hkv = Hkv
        self.g = self.Hq // Hkv
        self.D = args.head_dim
        dev = ctx.dev
        gen = torch.Generator(device=dev).manual_seed(
            int(args.seed) * 1000003 + zlib.crc32(spec["id"].encode()) % 1000003)
        bf = torch.bfloat16
        self.q = torch.randn(1, self.Lq, self.Hq, self.D, generator=gen, device=dev, dtype=bf)
        self.k = torch.randn(1, self.Lkv, self.Hkv, self.D, generator=gen, device=dev, dtype=bf)
        self.v = torch.randn(1, self.Lkv, self.Hkv, self.D, generator=gen, device=dev, dtype=bf)
        _sync()
        dl = jax.dlpack.from_dlpack
        self.qj, self.kj, self.vj = dl(self.q), dl(self.k), dl(self.v)
        # check subset: rows x (KV heads and their query heads)
        self.rows = C.check_rows(self.Lq, mask.q_bounds, args.check_rows, seed=args.seed)
        nk = min(args.check_kv_heads, self.Hkv)
        self.kvh = np.unique(np.linspace(0, self.Hkv - 1, nk).round().astype(np.int64))
        self.qh = (self.kvh[:, None] * self.g + np.arange(self.g)[None]).ravel()
        self._ref = {}

    def idx(self, a):
        return self.ctx.torch.as_tensor(np.asarray(a), device=self.ctx.dev)

    def reference(self, dense: bool = False):
        """(out [rows, qh, D] float32, empty [rows, qh] bool) of the reference on the subset."""
        if dense in self._ref:
            return self._ref[dense]
        import tessera_jax as tj
        from tessera_jax.mask import BlockMask
        torch, jax = self.ctx.torch, self.ctx.jax
        rows_t, qh_t, kvh_t = self.idx(self.rows), self.idx(self.qh), self.idx(self.kvh)
        qs = self.q[0].index_select(0, rows_t).index_select(1, qh_t).float().contiguous()[None]
        ks = self.k[0].index_select(1, kvh_t).float().contiguous()[None]
        vs = self.v[0].index_select(1, kvh_t).float().contiguous()[None]
        if dense:
            sub = BlockMask(np.arange(self.rows.size + 1), [0, self.Lkv],
                            np.ones((1, self.rows.size, 1), bool))
        else:
            sub = C.row_subset_mask(self.mask, self.rows, self.qh)
        dl = jax.dlpack.from_dlpack
        out = tj.reference_attention(dl(qs), dl(ks), dl(vs), sub)
        ref = np.asarray(jax.device_get(out), np.float32)[0]                  # [rows, qh, D]
        emp = ~sub.blocks.any(-1)                                              # [Hm', rows]
        emp = np.broadcast_to(emp, (self.qh.size, self.rows.size)).T           # [rows, qh]
        self._ref[dense] = (ref, np.ascontiguousarray(emp))
        del qs, ks, vs, out
        return self._ref[dense]

    def check(self, out: np.ndarray, dense: bool = False) -> dict:
        ref, empty = self.reference(dense)
        out = np.asarray(out, np.float32)
        if out.shape != ref.shape:
            return {"status": "wrong", "why": f"output subset shape {out.shape} != {ref.shape}"}
        sel = ~empty
        d = out[sel] - ref[sel]
        finite = bool(np.isfinite(out[sel]).all())
        rel = float(np.linalg.norm(d) / max(float(np.linalg.norm(ref[sel])), 1e-6)) if d.size else 0.0
        mx = float(np.abs(d).max()) if d.size else 0.0
        em = out[empty]
        empty_ok = bool(np.isfinite(em).all() and (np.abs(em).max() if em.size else 0.0) <= ATOL)
        res = {"rel_err": rel if finite else None, "max_abs_err": mx if finite else None,
               "rows_checked": int(self.rows.size), "q_heads_checked": [int(h) for h in self.qh],
               "empty_rows_checked": int(empty.any(axis=1).sum())}
        if not finite or rel > RTOL or mx > ATOL:
            res.update(status="wrong", why=f"vs float32 reference: rel_err={rel:.3g}, max_abs="
                                           f"{mx:.3g}, finite={finite}")
        elif not empty_ok:
            res.update(status="ok_empty_rows_differ",
                       why="rows that select no key are not 0 (reference: 0)")
        else:
            res["status"] = "ok"
        return res

    def free(self):
        for n in ("qj", "kj", "vj", "q", "k", "v"):
            setattr(self, n, None)


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_rule(args) -> timing.TimingRule:
    """Every peer's kernel time: the one kernel rule, ``--iters`` timed calls."""
    return timing.KERNEL_RULE.replace(repeats=args.iters)


def request_rule(args) -> timing.TimingRule:
    """Every peer's request latency: host wall clock, ``--request-iters`` timed calls."""
    return timing.REQUEST_RULE.replace(repeats=args.request_iters)


def _request(fn, args, **kw) -> timing.Timing:
    return timing.time_request(fn, rule=request_rule(args), **kw)


def _kernel(fn, arg_sets, args, framework: str) -> dict:
    """``kernel_ms``, ``kernel_samples``, ``kernel_timer``, ``kernel_rule`` of a peer."""
    t = timing.time_kernel(fn, arg_sets, rule=kernel_rule(args), framework=framework)
    return t.to_json("kernel_")


def timing_rules(rows: list[dict]) -> dict:
    """The one kernel rule and the one request rule of every peer in ``rows`` (rows written
    before rules were recorded carry none and are not checked); ``error`` when mixed."""
    out = {}
    for kind in ("kernel", "request"):
        try:
            out[kind] = timing.assert_same_rule(
                (d.get(f"{kind}_rule") for r in rows for d in r.get("peers", {}).values()),
                f"peers' {kind} times")
        except timing.MixedRulesError as e:
            out[kind] = None
            out["error"] = (out.get("error", "") + " " + str(e)).strip()
    return out


def run_tessera(case: Case, args) -> dict:
    import jax
    import tessera_jax as tj
    from request_cases import forget_request_caches
    from tessera_jax.runtime import dispatch as backends
    from tessera_jax.runtime import dense_route
    from tessera_jax.validation import check_shapes
    mask = case.mask

    clear = forget_request_caches   # a new mask: its selection and plan are paid

    call = lambda: tj.sparse_attention(case.qj, case.kj, case.vj, mask)  # noqa: E731
    t = time.perf_counter()
    out = jax.block_until_ready(call())
    res = {"first_call_s": time.perf_counter() - t}
    o = np.asarray(jax.device_get(out[0][case.rows][:, case.qh]), np.float32)
    res.update(case.check(o))
    del out
    p = tj.plan(mask, case.qj.shape, case.kj.shape, case.qj.dtype)
    try:
        res["plan"] = {k: v for k, v in p.stats().items() if isinstance(v, (int, float, str, bool))}
    except Exception as e:  # noqa: BLE001
        res["plan"] = {"error": _tail(e, 200)}
    if res["status"] not in OK_STATES:
        return res
    res["plan_ms"] = _request(lambda: tj.plan(mask, case.qj.shape, case.kj.shape, case.qj.dtype),
                              args, before=clear).ms
    res.update(_request(lambda: jax.block_until_ready(call()), args,
                        before=clear).to_json("request_"))
    # Where a request's time goes beyond plan + kernel: the plan arrays' host->device copy, and
    # an eager call whose plan and device arrays are cached (dispatch + kernel, wall clock).
    # An eager request copies units and steps (row_index is made on the device). An all-selected
    # mask runs cuDNN (dense_route): no plan is built or copied then.
    p = tj.plan(mask, case.qj.shape, case.kj.shape, case.qj.dtype)
    arrays = (p.units, p.steps)
    shape = check_shapes(case.qj.shape, case.kj.shape, case.qj.dtype)
    routed = dense_route.takes(mask, shape, backends.resolve(None, shape), False)
    res["route"] = "cudnn_dense" if routed else "plan"
    res["plan_bytes"] = int(sum(a.nbytes for a in arrays))
    res["put_ms"] = _request(lambda: jax.block_until_ready(jax.device_put(arrays)), args).ms
    res["cached_call_ms"] = _request(lambda: jax.block_until_ready(call()), args).ms
    # eager (time_kernel calls it as given): the plan is cached and its executable compiled by
    # the calls above (a jax.jit of this closure would compile a new executable with the plan
    # as constants)
    res.update(_kernel(lambda q, k, v: tj.sparse_attention(q, k, v, mask),
                       (case.qj, case.kj, case.vj), args, "jax"))
    clear()
    return res



def _time_request(res: dict, convert_and_plan, run, args) -> dict:
    """Adds plan-only, request (convert + plan + run) and kernel-only timings to ``res``."""
    res["plan_ms"] = _request(convert_and_plan, args, sync=_sync).ms
    res.update(_request(lambda: (convert_and_plan(), run()), args,
                        sync=_sync).to_json("request_"))
    convert_and_plan()
    res.update(_kernel(run, ((),), args, "torch"))
    return res


def run_fi_bsr(case: Case, args, ctx: Ctx) -> dict:
    torch = ctx.torch
    b = C.fi_bsr(case.mask)
    if isinstance(b, str):
        return {"status": "skipped", "why": b}
    if ctx.flashinfer() is None:
        return {"status": "failed", "why": ctx.fi_error}
    w = ctx.fi_wrapper("bsr")
    bf = torch.bfloat16
    q0 = case.q[0]
    pad = b.N - case.Lkv
    k0 = torch.nn.functional.pad(case.k[0], (0, 0, 0, 0, 0, pad)) if pad else case.k[0]
    v0 = torch.nn.functional.pad(case.v[0], (0, 0, 0, 0, 0, pad)) if pad else case.v[0]

    def convert_and_plan():
        bb = C.fi_bsr(case.mask)
        w.plan(torch.from_numpy(bb.indptr), torch.from_numpy(bb.indices), bb.M, bb.N, bb.R, bb.C,
               case.Hq, case.Hkv, case.D, q_data_type=bf, kv_data_type=bf, o_data_type=bf)

    run = lambda: w.run(q0, k0, v0)  # noqa: E731
    t = time.perf_counter()
    convert_and_plan()
    out = run()
    _sync()
    res = {"first_call_s": time.perf_counter() - t, "R": b.R, "C": b.C, "nnz_blocks": b.nnz,
           "kv_padded_to": b.N, "backend": getattr(w, "_backend", None),
           "tensor_cores": getattr(w, "_use_tensor_cores", None)}
    res.update(case.check(out[case.idx(case.rows)][:, case.idx(case.qh)].float().cpu().numpy()))
    del out
    if res["status"] not in OK_STATES:
        return res
    return _time_request(res, convert_and_plan, run, args)


def run_fi_var(case: Case, args, ctx: Ctx) -> dict:
    torch = ctx.torch
    if ctx.flashinfer() is None:
        return {"status": "failed", "why": ctx.fi_error}
    w = ctx.fi_wrapper("var")
    bf = torch.bfloat16
    vv = C.fi_var(case.mask, case.Hq, case.Hkv)
    qh = case.q[0].transpose(0, 1).contiguous()                       # [Hq, Lq, D]  (HND)
    kh = case.k[0].transpose(0, 1)
    vh = case.v[0].transpose(0, 1)
    if vv.kv_repeat > 1:
        kh = kh.repeat_interleave(vv.kv_repeat, dim=0)
        vh = vh.repeat_interleave(vv.kv_repeat, dim=0)
    kh, vh = kh.contiguous(), vh.contiguous()
    dev = ctx.dev if args.fi_var_device == "cuda" else torch.device("cpu")

    def convert_and_plan():
        c = C.fi_var(case.mask, case.Hq, case.Hkv)
        w.plan(torch.from_numpy(c.block_mask_map).to(dev), torch.from_numpy(c.block_row_sz).to(dev),
               torch.from_numpy(c.block_col_sz).to(dev), case.Hq, c.num_kv_heads, case.D,
               q_data_type=bf, kv_data_type=bf)

    run = lambda: w.run(qh, kh, vh)  # noqa: E731
    t = time.perf_counter()
    convert_and_plan()
    out = run()
    _sync()
    res = {"first_call_s": time.perf_counter() - t, "fi_kv_heads": vv.num_kv_heads,
           "kv_repeat": vv.kv_repeat, "backend": getattr(w, "_backend", None),
           "layout_note": "q/k/v given in HND (transposed once, outside the timings)"}
    sub = out.index_select(0, case.idx(case.qh)).index_select(1, case.idx(case.rows)).transpose(0, 1)
    res.update(case.check(sub.float().cpu().numpy()))
    del out, sub
    if res["status"] not in OK_STATES:
        return res
    return _time_request(res, convert_and_plan, run, args)


def _cap(n: int) -> int:
    return max(64, 1 << (int(n) - 1).bit_length())


def flex_block_mask(fb, torch, dev):
    """A torch ``BlockMask`` with the exact token-level mask_mod, from ``C.FlexBlocks`` (NumPy)
    or from the dict of ``C.flex_blocks_torch`` (tensors already on the device).

    The mask_mod is FlexAttention's definition of the function (its eager path applies only
    it); the tiles are where the compiled kernel looks: full tiles skip the mask_mod, so a mask
    without partial tiles never evaluates it on the GPU.
    """
    from torch.nn.attention.flex_attention import BlockMask
    if isinstance(fb, C.FlexBlocks):
        t = lambda a: torch.from_numpy(np.array(a, order="C")).to(dev)  # noqa: E731
        d = {k: t(getattr(fb, k)) for k in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                            "full_kv_indices")}
        d = {k: v[None] for k, v in d.items()}
        d.update(q_block_id=t(fb.q_block_id), kv_block_id=t(fb.kv_block_id),
                 blocks_padded=t(fb.blocks_padded), block=fb.block, Lq_pad=fb.Lq_pad,
                 Lkv_pad=fb.Lkv_pad)
    else:
        d = fb
    bp = d["blocks_padded"]
    H, nq1, nk1 = bp.shape
    # capacity-padded (powers of two) so that masks of one shape bucket reuse compiled code
    bp_t = torch.zeros((H, _cap(nq1), _cap(nk1)), dtype=torch.bool, device=bp.device)
    bp_t[:, :nq1, :nk1] = bp
    qid, kid = d["q_block_id"], d["kv_block_id"]
    if H == 1:
        def mm(b, h, q_idx, kv_idx):
            return bp_t[0, qid[q_idx], kid[kv_idx]]
    else:
        def mm(b, h, q_idx, kv_idx):
            return bp_t[h, qid[q_idx], kid[kv_idx]]
    args = (d["kv_num_blocks"], d["kv_indices"], d["full_kv_num_blocks"], d["full_kv_indices"])
    try:
        return BlockMask.from_kv_blocks(*args, BLOCK_SIZE=d["block"], mask_mod=mm,
                                        seq_lengths=(d["Lq_pad"], d["Lkv_pad"]))
    except TypeError:
        return BlockMask.from_kv_blocks(*args, BLOCK_SIZE=d["block"], mask_mod=mm)


def _flex_kernel_options(block):
    if tuple(block) == (128, 128):
        return None
    return {"BLOCK_M": min(block[0], 128), "BLOCK_N": min(block[1], 64)}


def run_flex(case: Case, args, ctx: Ctx) -> dict:
    torch = ctx.torch
    flex = ctx.flex_fn()
    if flex is None:
        return {"status": "failed", "why": ctx.flex_error}
    cands = [tuple(int(x) for x in c.split("x")) for c in args.flex_blocks.split(",")]
    fb = C.flex_best_block(case.mask, cands, pad_to=args.flex_pad)
    tries = [fb]
    if fb.block != (128, 128):
        tries.append(C.flex_blocks(case.mask, (128, 128), pad_to=args.flex_pad))
    gqa = case.Hq != case.Hkv
    errors = []
    for fb in tries:
        pq, pk = fb.Lq_pad - case.Lq, fb.Lkv_pad - case.Lkv
        qf = torch.nn.functional.pad(case.q, (0, 0, 0, 0, 0, pq)).transpose(1, 2).contiguous()
        kf = torch.nn.functional.pad(case.k, (0, 0, 0, 0, 0, pk)).transpose(1, 2).contiguous()
        vf = torch.nn.functional.pad(case.v, (0, 0, 0, 0, 0, pk)).transpose(1, 2).contiguous()
        ko = _flex_kernel_options(fb.block)
        block = fb.block

        def convert():      # on the GPU: tile counts, index lists, BlockMask, mask_mod
            f = C.flex_blocks_torch(case.mask, block, pad_to=args.flex_pad, device=ctx.dev)
            return flex_block_mask(f, torch, ctx.dev)

        def call(bm):
            return flex(qf, kf, vf, block_mask=bm, enable_gqa=gqa, kernel_options=ko)

        try:
            t = time.perf_counter()
            bm = convert()
            out = call(bm)
            _sync()
            res = {"first_call_s": time.perf_counter() - t, "block": list(fb.block),
                   "mask_mod": fb.needs_mask_mod, "partial_tiles": fb.num_partial,
                   "full_tiles": fb.num_full, "padded_to": [fb.Lq_pad, fb.Lkv_pad],
                   "kernel_options": ko, "block_fallback_errors": errors or None}
            sub = out[0].index_select(0, case.idx(case.qh)).index_select(
                1, case.idx(case.rows)).transpose(0, 1)
            res.update(case.check(sub.float().cpu().numpy()))
            del out, sub
        except Exception as e:  # noqa: BLE001
            errors.append(f"{fb.block}: {_tail(e, 300)}")
            continue
        if res["status"] not in OK_STATES:
            return res
        res["plan_ms"] = _request(convert, args, sync=_sync).ms
        res.update(_request(lambda: call(convert()), args, sync=_sync).to_json("request_"))
        bm = convert()
        res.update(_kernel(lambda: call(bm), ((),), args, "torch"))
        return res
    return {"status": "failed", "why": " || ".join(errors)}


_DENSE: dict = {}


def run_dense(case: Case, args, ctx: Ctx) -> dict:
    import jax
    key = (case.Lq, case.Lkv, case.Hq, case.Hkv, case.D)
    impl = None if args.smoke else "cudnn"
    if impl not in _DENSE:           # one jitted function: executables are reused across masks
        _DENSE[impl] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation=impl))
    fn = jitted = _DENSE[impl]
    out = jax.block_until_ready(jitted(case.qj, case.kj, case.vj))
    res = {"computes": "all interactions (dense), checked against the dense reference"}
    res.update(case.check(np.asarray(jax.device_get(out[0][case.rows][:, case.qh]), np.float32),
                          dense=True))
    del out
    if res["status"] not in OK_STATES:
        return res
    if key in ctx.dense_cache:
        res.update(ctx.dense_cache[key], cached_from_same_shape=True)
        return res
    t = _request(lambda: jax.block_until_ready(jitted(case.qj, case.kj, case.vj)),
                 args).to_json("request_")
    t.update(_kernel(fn, ((case.qj, case.kj, case.vj),), args, "jax"))
    ctx.dense_cache[key] = t
    res.update(t)
    return res


def fi_warmup(ctx: Ctx, args) -> dict:
    """First plan()+run() of both wrappers on a tiny mask: FlashInfer JIT-builds its prefill
    module here (minutes on a fresh machine), so no mask's row carries the build time."""
    if ctx.flashinfer() is None:
        return {"error": ctx.fi_error}
    torch = ctx.torch
    bf, dev, H, L, D = torch.bfloat16, ctx.dev, 2, 512, args.head_dim
    q, k, v = (torch.randn(L, H, D, dtype=bf, device=dev) for _ in range(3))
    out = {}
    try:
        t = time.perf_counter()
        w = ctx.fi_wrapper("bsr")
        w.plan(torch.arange(5, dtype=torch.int32), torch.arange(4, dtype=torch.int32), L, L, 128,
               128, H, H, D, q_data_type=bf, kv_data_type=bf, o_data_type=bf)
        w.run(q, k, v)
        _sync()
        out.update(bsr_first_call_s=time.perf_counter() - t, bsr_backend=getattr(w, "_backend", None))
    except Exception as e:  # noqa: BLE001
        out["bsr_error"] = _tail(e)
    try:
        t = time.perf_counter()
        w = ctx.fi_wrapper("var")
        eye = torch.eye(4, dtype=torch.bool, device=dev)[None].expand(H, 4, 4).contiguous()
        sz = torch.full((H, 4), 128, dtype=torch.int32, device=dev)
        w.plan(eye, sz, sz.clone(), H, H, D, q_data_type=bf, kv_data_type=bf)
        w.run(q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(),
              v.transpose(0, 1).contiguous())
        _sync()
        out.update(var_first_call_s=time.perf_counter() - t, var_backend=getattr(w, "_backend", None))
    except Exception as e:  # noqa: BLE001
        out["var_error"] = _tail(e)
    return out


RUNNERS = {"tessera": lambda c, a, x: run_tessera(c, a), "flashinfer_bsr": run_fi_bsr,
           "flashinfer_var": run_fi_var, "flex": run_flex, "dense": run_dense}


def mask_info(spec: dict, mask, Hq: int, Hkv: int, D: int) -> dict:
    sel = mask.selected_interactions(Hq)
    return {"id": spec["id"], "family": spec["family"], "grid": spec["grid"],
            "seed": spec.get("seed"), "step": spec.get("step"), "text": spec.get("text"),
            "params": spec.get("params"), "heads_spec": spec["heads"], "Hq": Hq, "Hkv": Hkv,
            "head_dim": D, "Lq": mask.Lq, "Lkv": mask.Lkv, "mask_heads": mask.num_heads,
            "blocks": [int(mask.blocks.shape[1]), int(mask.blocks.shape[2])],
            "density": mask.density, "selected_flops": 4 * D * sel,
            "uniform_blocks": C.is_uniform(mask.q_sizes) is not None
            and C.is_uniform(mask.kv_sizes) is not None,
            "distinct_block_sizes": int(np.unique(np.concatenate([mask.q_sizes,
                                                                  mask.kv_sizes])).size)}


def versions(ctx: Ctx | None) -> dict:
    out = {"python": platform.python_version()}
    for mod in ("numpy", "jax", "jaxlib", "torch", "triton", "flashinfer", "tvm_ffi"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[mod] = f"unavailable ({type(e).__name__})"
    try:
        import torch
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["cuda_torch"] = torch.version.cuda
            out["cudnn_torch"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        pass
    try:
        import jax
        out["jax_devices"] = [str(d) for d in jax.devices()]
    except Exception:  # noqa: BLE001
        pass
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                        "--format=csv,noheader"], capture_output=True,
                                       text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    from tessera_jax.tools.profiler import code_revision   # git HEAD, or a snapshot's .snap_rev
    out["git"] = code_revision(REPO)
    return out


def merge_docs(paths, out: str, png: str | None = None) -> dict:
    """One result from several processes' files (e.g. one GPU per half of the families): rows
    concatenated (later files win on a repeated mask id), summary and figure recomputed; each
    part's command, versions and FlashInfer warm-up kept under ``parts``."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    rows = {}
    for d in docs:
        for r in d.get("rows", []):
            rows[r.get("id", len(rows))] = r
    doc = dict(docs[0]) if docs else {}
    doc["rows"] = list(rows.values())
    doc["parts"] = [{k: d.get(k) for k in ("command", "date", "versions", "flashinfer_warmup",
                                            "elapsed_s", "sampling")} | {"file": str(p)}
                    for p, d in zip(paths, docs)]
    doc["command"] = " && ".join(str(d.get("command")) for d in docs)
    doc["elapsed_s"] = max((d.get("elapsed_s") or 0.0) for d in docs) if docs else 0.0
    ok = [r for r in doc["rows"] if "peers" in r]
    doc["summary"] = summarize(ok)
    png = png or str(Path(out).with_suffix(".png"))
    doc["figure"] = figure(ok, png, title=f"tessera_jax vs peers, {len(ok)} test masks")
    Path(out).write_text(json.dumps(doc, indent=1, default=str))
    return doc


def gpu_main(args) -> int:
    from tessera_jax.masks import build
    ctx = Ctx(args)
    if args.smoke:
        smoke = {f"smoke-{i}": m for i, (_, _, m, _) in enumerate(dry_masks(args.seed))}
        specs = [{"id": f"smoke-{i}", "family": fam, "grid": grid, "heads": m.num_heads
                  if m.num_heads > 1 else 4, "seed": args.seed, "params": {}}
                 for i, (fam, grid, m, _) in enumerate(dry_masks(args.seed))
                 if not args.families or fam in args.families][: args.per_family * 100]
        avail = dict(collections.Counter(s["family"] for s in specs))
        build = lambda spec, heads=None: smoke[spec["id"]]  # noqa: E731
    else:
        specs, avail = sample_specs(args.per_family, args.families, args.grids, args.seed)
    if args.skip_from:              # a run cut by its budget: time only the masks it missed
        done = {r["id"] for f in args.skip_from for r in json.load(open(f)).get("rows", [])}
        specs = [s for s in specs if s["id"] not in done]
        log(f"--skip-from: {len(done)} masks already timed; {len(specs)} left")
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in RUNNERS:
            raise SystemExit(f"--peers: unknown peer {p!r}; known: {list(RUNNERS)}")
    log(f"{len(specs)} test-split masks sampled ({args.per_family}/family) from {avail}")
    doc = {"benchmark": "peers (issue 7)", "command": " ".join([sys.executable, *sys.argv]),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "config": vars(args), "versions": versions(ctx),
           "sampling": {"split": "test", "per_family": args.per_family,
                        "available_per_family": avail, "heads": args.heads or "all",
                        "note": "stratified by family; specs spread over grids; a head subset "
                                "(--heads) runs the first heads of each mask on every peer alike"},
           "timing": {"kernel": kernel_rule(args).to_json(),
                      "request": request_rule(args).to_json()},
           "rows": [], "notes": []}
    log("versions:", json.dumps(doc["versions"]))
    if not args.smoke and any(p.startswith("flashinfer") for p in peers):
        log("FlashInfer warm-up (JIT build of its prefill module on first use) ...")
        doc["flashinfer_warmup"] = fi_warmup(ctx, args)
        doc["flashinfer_warmup"]["curand_include_fallback"] = ctx.fi_env
        log("FlashInfer warm-up:", json.dumps(doc["flashinfer_warmup"], default=str)[:600])
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    png = args.figure or str(out_path.with_suffix(".png"))
    title = (f"tessera_jax vs peers per mask family "
             f"({doc['versions'].get('gpu') or 'CPU smoke'}; request latency)")
    try:
        from tqdm import tqdm
        it = tqdm(specs, desc="masks", mininterval=5)
    except ImportError:
        it = specs
    for spec in it:
        if time.time() - T0 > args.time_budget - args.reserve:
            doc["notes"].append(f"time budget reached after {len(doc['rows'])} of {len(specs)} masks")
            log(doc["notes"][-1])
            break
        row = None
        case = None
        try:
            heads = min(args.heads, spec["heads"]) if args.heads else spec["heads"]
            t = time.perf_counter()
            mask = build(spec, heads=heads)
            build_s = time.perf_counter() - t
            Hq = heads
            Hkv = Hq // args.gqa if Hq % args.gqa == 0 else Hq
            row = mask_info(spec, mask, Hq, Hkv, args.head_dim)
            row["build_s"] = build_s
            row["peers"] = {}
            case = Case(ctx, {**spec, "heads_run": Hq}, mask, Hkv, args)
            for p in peers:
                t = time.perf_counter()
                try:
                    r = RUNNERS[p](case, args, ctx)
                except Exception as e:  # noqa: BLE001
                    r = {"status": "failed", "why": _tail(e)}
                r["wall_s"] = time.perf_counter() - t
                row["peers"][p] = r
            sp = speedups(row)
            row["speedup_request"] = sp
            row["speedup_kernel"] = speedups(row, "kernel_ms")
            log(f"{spec['family']:11s} {spec['grid']:10s} L={mask.Lq} H={Hq} d={mask.density:.3f} " +
                " ".join(f"{p}={row['peers'][p].get('request_ms') or row['peers'][p].get('status')}"
                         if not isinstance(row['peers'][p].get('request_ms'), float) else
                         f"{p}={row['peers'][p]['request_ms']:.2f}ms" for p in peers) +
                "  speedup " + " ".join(f"{k}={v:.2f}" for k, v in sp.items()))
        except Exception as e:  # noqa: BLE001
            row = row or {"id": spec.get("id"), "family": spec.get("family"), "grid": spec.get("grid")}
            row["error"] = _tail(e)
            log("mask failed:", row["error"][:300])
        finally:
            if case is not None:
                case.free()
            del case
            gc.collect()
            if not args.smoke:
                ctx.torch.cuda.empty_cache()
        doc["rows"].append(row)
        doc["summary"] = summarize([r for r in doc["rows"] if "peers" in r])
        out_path.write_text(json.dumps(doc, indent=1, default=str))   # partial results survive
        try:
            figure([r for r in doc["rows"] if "peers" in r], png, title=title)
        except Exception as e:  # noqa: BLE001
            log("figure failed:", _tail(e, 200))
    doc["summary"] = summarize([r for r in doc["rows"] if "peers" in r])
    doc["elapsed_s"] = time.time() - T0
    doc["figure"] = figure([r for r in doc["rows"] if "peers" in r], png, title=title)
    out_path.write_text(json.dumps(doc, indent=1, default=str))
    s = doc["summary"]
    log(f"wrote {out_path} and {png}: masks={s['masks']} min_vs_best_alt="
        f"{s['min_speedup_vs_best_alternative']} median_vs_fi={s['median_speedup_vs_flashinfer']} "
        f"median_vs_flex={s['median_speedup_vs_flex']}")
    if s["timing_rules"].get("error"):          # written above; the run fails
        log("timing rule check FAILED:", s["timing_rules"]["error"])
        return 1
    return 0


# ----------------------------------------------------------------------------------------------
# CPU dry run
# ----------------------------------------------------------------------------------------------
def dry_masks(seed: int = 0):
    """Tiny masks: every family on the test grids, plus random uniform/variable/GQA masks."""
    from tessera_jax.mask import BlockMask
    from tessera_jax.masks import FAMILIES
    out = []
    for fam, fn in FAMILIES.items():
        for grid, text in (("tiny", 0), ("small_text", 40)):
            out.append((fam, grid, fn(grid, heads=4, seed=seed, text=text), 2))
    rng = np.random.default_rng(seed)
    out.append(("random_uniform", "-", BlockMask.uniform(200, 232, 32, 48,
                                                         rng.random((1, 7, 5)) < 0.4), 4))
    qb = np.array([0, 5, 70, 71, 150, 200])
    kb = np.array([0, 64, 65, 100, 190, 232])
    out.append(("random_variable_gqa", "-", BlockMask(qb, kb, rng.random((4, 5, 5)) < 0.5), 2))
    out.append(("random_aligned_perhead", "-",
                BlockMask.uniform(256, 256, 64, 64, rng.random((4, 4, 4)) < 0.5), 4))
    return out


def _torch_pieces(mask, fbsr, fvar, fb, Hq, Hkv, tol=2e-2) -> dict:
    """With torch (CPU): the peers' inputs as tensors; the Flex BlockMask's tiles; FlexAttention
    (eager, CPU: it applies the mask_mod) on the padded inputs vs ``tj.reference_attention``."""
    import warnings

    import torch
    res = {}
    if not isinstance(fbsr, str):
        res["fi_bsr_tensors"] = [tuple(torch.from_numpy(fbsr.indptr).shape),
                                 tuple(torch.from_numpy(fbsr.indices).shape)]
    res["fi_var_tensors"] = [tuple(torch.from_numpy(a).shape) for a in
                             (fvar.block_mask_map, fvar.block_row_sz, fvar.block_col_sz)]
    try:
        import jax.numpy as jnp
        from torch.nn.attention.flex_attention import flex_attention

        import tessera_jax as tj
        bm = flex_block_mask(fb, torch, torch.device("cpu"))
        dense = bm.to_dense()[0].numpy().astype(bool)              # [H_f, nQB, nKB] visited tiles
        tiles = np.zeros_like(dense)
        for num, idx in ((fb.kv_num_blocks, fb.kv_indices), (fb.full_kv_num_blocks, fb.full_kv_indices)):
            for h in range(num.shape[0]):
                for a in range(num.shape[1]):
                    tiles[h, a, idx[h, a, :num[h, a]]] = True
        res["flex_tiles_match"] = bool((dense == tiles).all())
        # the torch conversion (what the GPU run times) gives the same tiles and mask_mod inputs
        ft = C.flex_blocks_torch(mask, fb.block, pad_to=None, device="cpu")   # fb: pad_to=None
        same = all(np.array_equal(getattr(fb, k), ft[k][0].numpy()) for k in
                   ("kv_num_blocks", "full_kv_num_blocks"))
        for k, n in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
            valid = np.arange(fb.kv_indices.shape[-1]) < getattr(fb, n)[..., None]
            same &= np.array_equal(getattr(fb, k)[valid], ft[k][0].numpy()[valid])
        same &= np.array_equal(fb.blocks_padded, ft["blocks_padded"].numpy())
        same &= np.array_equal(fb.q_block_id, ft["q_block_id"].numpy())
        res["flex_torch_conversion_matches"] = bool(same)
        D = 16
        g = np.random.default_rng(1)
        q = g.standard_normal((1, mask.Lq, Hq, D), np.float32)
        k = g.standard_normal((1, mask.Lkv, Hkv, D), np.float32)
        v = g.standard_normal((1, mask.Lkv, Hkv, D), np.float32)
        ref = np.asarray(tj.reference_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask))
        pad = lambda x, L: torch.nn.functional.pad(torch.from_numpy(x), (0, 0, 0, 0, 0, L - x.shape[1]))  # noqa: E731
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o = flex_attention(pad(q, fb.Lq_pad).transpose(1, 2), pad(k, fb.Lkv_pad).transpose(1, 2),
                               pad(v, fb.Lkv_pad).transpose(1, 2), block_mask=bm,
                               enable_gqa=Hq != Hkv)
        o = o.transpose(1, 2)[:, :mask.Lq].numpy()
        # rows that select no key: the reference gives 0, Flex may give anything finite; skip them
        sel = np.broadcast_to(mask.token_mask().any(-1), (Hq, mask.Lq)).T       # [Lq, Hq]
        err = float(np.abs(o[0] - ref[0])[sel].max()) if sel.any() else 0.0
        res["flex_cpu_max_abs_err"] = err
        res["flex_cpu_ok"] = bool(err < tol)
    except Exception as e:  # noqa: BLE001
        res["flex_cpu"] = "not run: " + _tail(e, 200)
    return res


def dry_run(args) -> dict:
    """CPU: conversions of tiny masks and their exactness (the token masks the peers imply)."""
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    rows = []
    for fam, grid, mask, gqa in dry_masks(args.seed):
        Hq = mask.num_heads if mask.num_heads > 1 else 4
        Hkv = Hq // gqa
        tm = np.broadcast_to(mask.token_mask(), (Hq, mask.Lq, mask.Lkv))
        row = {"family": fam, "grid": grid, "Lq": mask.Lq, "Lkv": mask.Lkv, "Hq": Hq, "Hkv": Hkv,
               "mask_heads": mask.num_heads, "density": mask.density, "exact": {}}
        b = C.fi_bsr(mask)
        if isinstance(b, str):
            row["exact"]["fi_bsr"] = None
            row["fi_bsr_skipped"] = b
        else:
            t = C.fi_bsr_token_mask(b)
            row["exact"]["fi_bsr"] = bool(not t[:, mask.Lkv:].any() and (t[:, :mask.Lkv] == tm).all())
        v = C.fi_var(mask, Hq, Hkv)
        row["fi_var_kv_repeat"] = v.kv_repeat
        row["exact"]["fi_var"] = bool((C.fi_var_token_mask(v) == tm).all())
        cands = [tuple(int(x) for x in c.split("x")) for c in args.flex_blocks.split(",")]
        # tiny masks: also 16/32 tiles, so that some are aligned and need no mask_mod
        fb = C.flex_best_block(mask, cands + [(32, 32), (16, 16)], pad_to=None)
        t = C.flex_token_mask(fb)
        t_real = np.broadcast_to(t[:, :mask.Lq, :mask.Lkv], tm.shape)
        row["flex"] = {"block": list(fb.block), "mask_mod": fb.needs_mask_mod,
                       "partial": fb.num_partial, "full": fb.num_full}
        row["exact"]["flex"] = bool(not t[:, :mask.Lq, mask.Lkv:].any() and (t_real == tm).all())
        if have_torch:
            row["torch"] = _torch_pieces(mask, b, v, fb, Hq, Hkv)
        rows.append(row)
    n_bad = sum(1 for r in rows for k, x in r["exact"].items() if x is False)
    n_bad += sum(1 for r in rows for k in ("flex_tiles_match", "flex_cpu_ok",
                                           "flex_torch_conversion_matches")
                 if r.get("torch", {}).get(k) is False)
    doc = {"benchmark": "peers --dry-run (CPU: conversions only)", "torch": have_torch,
           "rows": rows, "inexact_conversions": n_bad,
           "summary": summarize([])}
    return doc


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="results JSON (default benchmarks/results/h200-peers.json; none in --dry-run)")
    ap.add_argument("--figure", default=None, help="PNG (default: --out with .png)")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--reserve", type=float, default=45.0,
                    help="seconds kept free at the end of the budget (no mask starts after)")
    ap.add_argument("--per-family", type=int, default=3)
    ap.add_argument("--families", type=lambda s: s.split(","), default=None)
    ap.add_argument("--grids", type=lambda s: s.split(","), default=None)
    ap.add_argument("--heads", type=int, default=None, help="first N heads of each mask (all: none)")
    ap.add_argument("--gqa", type=int, default=1, help="query heads per KV head (corpus models: 1)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--iters", type=int, default=20,
                    help="kernel timing runs (median; >= 20, timing.DEVICE_MIN_REPEATS)")
    ap.add_argument("--request-iters", type=int, default=5, help="request timing runs (median)")
    ap.add_argument("--check-rows", type=int, default=2048)
    ap.add_argument("--check-kv-heads", type=int, default=2)
    ap.add_argument("--fi-backend", default="auto", choices=("auto", "fa2", "fa3"))
    ap.add_argument("--fi-var-device", default="cuda", choices=("cuda", "cpu"),
                    help="where the variable-block wrapper's mask tensors are handed to plan()")
    ap.add_argument("--flex-blocks", default="128x128,128x64,64x128,64x64",
                    help="FlexAttention tiles tried (largest first)")
    ap.add_argument("--flex-pad", type=int, default=1024,
                    help="FlexAttention sequences padded to a multiple of this (compile reuse)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-from", nargs="+", default=None, metavar="JSON",
                    help="skip the masks whose rows these earlier result files hold")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny masks, conversions only")
    ap.add_argument("--fi-warmup-only", action="store_true",
                    help="only JIT-build FlashInfer's modules (into FLASHINFER_WORKSPACE_BASE), so a "
                         "later run on the same machine finds them built")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, needs torch: the whole GPU pipeline on tiny masks (no FlashInfer, "
                         "eager Flex, XLA dense) to check the plumbing, not to time anything")
    a = ap.parse_args(argv)
    if a.per_family < 1 or a.iters < 1 or a.request_iters < 1 or a.gqa < 1:
        ap.error("--per-family, --iters, --request-iters and --gqa must be >= 1")
    if a.flex_pad % 128:
        ap.error("--flex-pad must be a multiple of 128")
    try:
        kernel_rule(a), request_rule(a)
    except ValueError as e:
        ap.error(f"--iters / --request-iters: {e}")
    return a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--merge"]:  # --merge A.json B.json ... --out C.json
        if "--out" not in argv or argv.index("--out") != len(argv) - 2 or len(argv) < 4:
            raise SystemExit("usage: peers.py --merge A.json [B.json ...] --out OUT.json")
        doc = merge_docs(argv[1:-2], argv[-1])
        s = doc["summary"]
        log(f"merged {len(argv) - 3} files: masks={s['masks']} min_vs_best_alt="
            f"{s['min_speedup_vs_best_alternative']} median_vs_fi={s['median_speedup_vs_flashinfer']} "
            f"median_vs_flex={s['median_speedup_vs_flex']}")
        if s["timing_rules"].get("error"):
            log("timing rule check FAILED:", s["timing_rules"]["error"])
            return 1
        return 0
    args = parse_args(argv)
    if args.dry_run:
        doc = dry_run(args)
        for r in doc["rows"]:
            print(f"{r['family']:22s} {r['grid']:10s} L={r['Lq']:4d} Hq={r['Hq']} Hkv={r['Hkv']} "
                  f"exact={r['exact']} flex={r['flex']['block']} mask_mod={r['flex']['mask_mod']}"
                  + (f" torch={ {k: v for k, v in r['torch'].items() if 'ok' in k or 'match' in k or k == 'flex_cpu'} }"
                     if "torch" in r else ""))
        print(f"inexact conversions: {doc['inexact_conversions']} (torch available: {doc['torch']})")
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
        return 1 if doc["inexact_conversions"] else 0
    if args.fi_warmup_only:
        t = time.perf_counter()
        res = fi_warmup(Ctx(args), args)
        log("FlashInfer warm-up only:", json.dumps(res, default=str)[:600],
            f"({time.perf_counter() - t:.1f} s)")
        return 0 if not any(k.endswith("error") for k in res) else 1
    if args.out is None:
        args.out = "/tmp/peers-smoke.json" if args.smoke else str(HERE / "results" / "h200-peers.json")
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
