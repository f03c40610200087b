#!/usr/bin/env python3
"""Side by side with the peers on the H200 (issues 7, 16): tessera_jax vs FlashInfer, FlexAttention, cuDNN.

Issue 16's run (H200; the 26 masks of session 4: 2 per family, 13 families, 8 heads; each mask
once with masks that start on the GPU and once with masks that start on the host). First, here
(PyPI): ``.venv/bin/python benchmarks/fetch_flashinfer.py`` makes ``.carry/flashinfer_site``.
Then one device call on ``nvidia-h200-x4`` (``carry=[".carry/flashinfer_site"]``,
``timeout_s=600``; GPUs 0-1 take half A's sample, 2-3 half B's, each a shard balanced by mask
size; the halves are session 4's, so ``--families`` draws the same masks):

    export PYTHONPATH=$PWD/.carry/flashinfer_site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 \
      XLA_PYTHON_CLIENT_PREALLOCATE=false FLASHINFER_CUDA_ARCH_LIST=9.0a
    A=dense,jenga,natten,sparge,sta,svg2,xattn; B=ditfastattn,moba,radial,ssta,svg,vsa
    for g in 0 1 2 3; do F=$([ $g -lt 2 ] && echo $A || echo $B)
      CUDA_VISIBLE_DEVICES=$g FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws$g timeout 570 python3 \
        benchmarks/peers.py --out $OUT/peers-q$g.json --time-budget 510 --reserve 100 \
        --per-family 2 --heads 8 --mask-source both --families $F --shard $((g % 2))/2 \
        ${SKIP:-} > $OUT/peers-q$g.log 2>&1 &
    done; wait
    python3 benchmarks/peers.py --merge $OUT/peers-q*.json --out $OUT/h200-peers.json \
      > $OUT/merge.log 2>&1; tail -n 2 $OUT/*.log
    tar czf /tmp/r.tgz -C $OUT . && find $OUT -type f -delete && mv /tmp/r.tgz $OUT/

On one ``nvidia-h200`` (session 9's run, masks that start on the GPU, one per family; FlashInfer's
build ~100 s per fresh machine), with ``carry=[".carry/clean", ".carry/flashinfer_site"]`` and
``cd .carry/clean``: ``PYTHONPATH=$PWD/../flashinfer_site:$PWD ... python3 benchmarks/peers.py
--out $OUT/peers-gpu.json --time-budget 500 --reserve 60 --per-family 1 --heads 8 --mask-source
gpu --families dense,ditfastattn,jenga,moba,natten,radial,sparge,ssta,sta,svg,svg2,vsa,xattn``
(the ``tokens`` family is not one of the peers' families), a second call with ``--skip-from``.

Masks a budget cut left out (the logs say "time budget"): put the four part files under
``prev/`` in the work tree (untracked, so they travel) and run the same call again with
``SKIP="--skip-from prev/peers-q0.json prev/peers-q1.json prev/peers-q2.json prev/peers-q3.json"``
(a warm machine keeps FlashInfer's JIT build in /tmp/fi_ws*; a fresh one builds it again,
~100 s). On ``nvidia-h200-x2`` instead, ``benchmarks/h200_run.sh`` does the halves:
``OUT=$OUT BUDGET_S=480 PEERS_ARGS="--mask-source both --reserve 100" bash
benchmarks/h200_run.sh peers``, then again with ``--skip-from`` of the earlier calls' files
added to ``PEERS_ARGS`` (about three calls). Here, the final file:
``.venv/bin/python benchmarks/peers.py --merge prev/peers-*.json call2/peers-*.json --out
benchmarks/results/h200-peers.json`` (later files win per mask and source). Its ``summary`` is
over every row, masks that start on the GPU and on the host (``mask_source``), with
``median_speedup_vs_flashinfer``, ``median_speedup_vs_flex``, ``min_speedup_vs_best_alternative``,
``median_request_overhead_ms`` and ``median_request_excess_over_cudnn_ms`` (our request overhead
minus cuDNN dense's, row by row); ``summary.by_mask_source.{gpu,host}`` has the same keys per
source.

Mask sources (``--mask-source``, default ``host``):

- ``host`` (the issue-7 runs): the mask is a NumPy ``BlockMask``; every request pays its
  conversion / planning from it (tessera_jax: every cache cleared before each call; its
  default ``Options`` tier on a GPU: the device route first, the host plan on a thread, the
  tiered route compiled beforehand by ``tj.precompile`` of the row's own mask where the
  family's bounds are fixed by the grid (``--tiered-bounds auto``: a server compiles its grid's
  route at start-up), else of a mask of other bounds (content-dependent bounds, SVG2's);
  ``sync_request_ms`` / ``tiered_request_ms`` time ``host_planning`` "sync" and "tiered"
  explicitly, summarised under
  ``summary.by_mask_source.host_sync`` / ``host_tiered``).
- ``gpu``: a new mask per request, already on the device, as a content-dependent method makes
  it (``--mask-variants`` masks per case from ``peers_lib.convert.mask_variants``: the corpus
  mask first, the checked one, then variants of the same structure; bounds static, known
  before the mask). tessera_jax: one call of a jitted ``sparse_attention`` with
  ``BlockMask(q_bounds, kv_bounds, blocks)``, blocks a device array (planned inside the
  program); kernel time = that call (device plan + kernel), ``device_plan_ms`` = the device
  plan alone. FlashInfer: the mask a torch bool tensor on the GPU; BSR copies it to the host
  (``.cpu()``) and converts it as "host" does; the variable-block wrapper takes it on the GPU
  and its plan() pays its own copies to the host. FlexAttention: its BlockMask built on the GPU
  from it. cuDNN dense: unchanged.
- ``both``: each mask's rows of both, gpu first (one process: shared inputs and compilations).

Over a sample of the corpus *test* split (``tessera_jax.masks.corpus("test")``), stratified by
family (``--per-family`` masks each, spread over the grids, taken round-robin over families so a
time budget cut keeps the families balanced), per mask and per peer:

- request latency: host wall clock from the logical ``BlockMask`` to the result on the device:
  mask conversion + planning + kernel (tessera_jax: its plan cache is cleared before each call,
  so planning is paid every time; compilation is warmed up and reported apart). A host row
  starts from the mask's NumPy bounds and blocks for every system: FlashInfer converts them,
  tessera_jax builds its ``BlockMask`` from them (validation, packed bits; ``mask_ms``
  alone);
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
point). Not a peer: flex-block-attn (Tencent-Hunyuan, ThunderKittens, SM90): it takes uniform
blocks only (queries a multiple of 16, keys of 64) and lengths that are multiples of them,
with no token mask inside a block; the corpus grids' lengths (Wan 480p 32,760, Wan 720p 75,600,
HunyuanVideo 720p 113,585) are not, and padded keys would be attended by every row selecting
the last key block, so it can run none of the corpus masks exactly (not built).
Conversions are in ``peers_lib/convert.py`` (exactness tested on CPU). Inputs: B=1,
bf16, head_dim 128, one random q/k/v per mask shared by all peers (torch tensors, seen by JAX
through DLPack).

Before timing, every peer's output is checked against ``tessera_jax.reference_attention`` (float32)
on ``--check-rows`` query rows (both ends of blocks + random) x ``--check-kv-heads`` KV heads
(with their query heads); a peer that fails the check, can't take the mask or crashes records why
in its row and is not timed. Writes ``--out`` (raw rows, versions, command, ``summary``) and a PNG
of speedup distributions per family next to it.

One process, masks that start on the host (~8 min on an H200 for ~20 masks):

    python3 benchmarks/peers.py --out $OUT/h200-peers.json --time-budget 480 --per-family 2 --heads 8

CPU checks: ``--dry-run`` (tiny masks; conversions and their exactness; with torch, also
FlexAttention eager on CPU vs the reference; and tessera_jax's device route, mask source gpu, end
to end on the masks of ``--dry-device``: new device masks, the jitted call checked, its request,
kernel and device-plan timings by the host clock), ``--smoke`` (needs torch: the whole pipeline
above on tiny masks, FlashInfer skipped, eager Flex, XLA dense; checks the plumbing, times
nothing; ``--mask-source both`` too):

    python benchmarks/peers.py --dry-run
    python benchmarks/peers.py --smoke --mask-source both --families sta,random_variable_gqa
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import functools
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
    """Test-split specs: per family up to ``per_family``, spread over grids, round-robin order.
    Each family's draw depends on ``seed`` and the family alone (not on the other families
    asked for), so a run of fewer families times the same masks as the whole sample's."""
    from tessera_jax.masks import corpus
    specs = corpus("test")
    by = collections.defaultdict(list)
    for s in specs:
        if (families and s["family"] not in families) or (grids and s["grid"] not in grids):
            continue
        by[s["family"]].append(s)
    picked = {}
    for fam in sorted(by):
        rng = np.random.default_rng([seed, zlib.crc32(fam.encode())])
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


def spec_cost(spec: dict) -> float:
    """A mask's rough time in a run, in units of a small mask's: a fixed part (compilations,
    checks) plus one growing with the tokens squared (~1 + 1 at 80k tokens)."""
    from tessera_jax.masks.grids import get_grid
    try:
        g = get_grid(spec["grid"])
        L = g.t * g.h * g.w + int(spec.get("text") or 0)
    except Exception:  # noqa: BLE001 - an unknown grid: a small mask
        L = 0
    return 1.0 + (L / 80000) ** 2


def shard_specs(specs: list, k: int, n: int) -> list:
    """Shard ``k`` of ``n`` of a sample: masks dealt largest first (``spec_cost``) to the
    shard with the least cost so far, each shard keeping the sample's order (round-robin over
    families, so a budget cut still keeps them balanced). The shards partition the sample."""
    load = [0.0] * n
    owner = {}
    for i in sorted(range(len(specs)), key=lambda i: (-spec_cost(specs[i]), i)):
        j = min(range(n), key=lambda j: (load[j], j))
        owner[i] = j
        load[j] += spec_cost(specs[i])
    return [s for i, s in enumerate(specs) if owner[i] == k]


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
            "max": float(np.max(xs)),
            "geomean": float(np.exp(np.mean(np.log(xs)))) if min(xs) > 0 else None}


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


MASK_SOURCES = ("host", "gpu")
#: The summary keys repeated per mask source under ``by_mask_source``.
HEADLINE = ("masks", "min_speedup_vs_best_alternative", "median_speedup_vs_best_alternative",
            "median_speedup_vs_flashinfer", "median_speedup_vs_flex", "median_speedup_vs_dense",
            "min_kernel_speedup_vs_flashinfer", "median_kernel_speedup_vs_flashinfer",
            "median_request_overhead_ms", "per_family_medians", "request_overhead_ms",
            "median_request_excess_over_cudnn_ms", "request_excess_over_cudnn_ms")


def mask_source(row: dict) -> str:
    """Where a row's masks started: "gpu" or "host" (rows written before sources: "host")."""
    return row.get("mask_source", "host")


def primary_source(rows: list[dict]) -> str:
    """The source of the headline summary and the figure: "gpu" where rows have it."""
    return "gpu" if any(mask_source(r) == "gpu" for r in rows) else "host"


def request_overhead(rows: list[dict]) -> dict:
    """Per peer, stats of request - kernel ms (what a request pays beyond its kernels: host
    work, copies, launch gaps, syncs) over the rows where it ran correctly."""
    per = collections.defaultdict(list)
    for r in rows:
        for p, d in r.get("peers", {}).items():
            if (d.get("status") in OK_STATES and d.get("request_ms") is not None
                    and d.get("kernel_ms") is not None):
                per[p].append(d["request_ms"] - d["kernel_ms"])
    return {p: _stats(v) for p, v in sorted(per.items())}


def request_excess_over_cudnn(rows: list[dict]) -> dict:
    """Stats of tessera_jax's request overhead minus cuDNN dense's, row by row (issue 33:
    what our request adds beyond what cuDNN's own jitted call adds, same mask, same run),
    over the rows where both ran correctly."""
    ex = []
    for r in rows:
        t, d = (r.get("peers", {}).get(p, {}) for p in ("tessera", "dense"))
        if all(x.get("status") in OK_STATES and x.get("request_ms") is not None
               and x.get("kernel_ms") is not None for x in (t, d)):
            ex.append((t["request_ms"] - t["kernel_ms"]) - (d["request_ms"] - d["kernel_ms"]))
    return _stats(ex)


def _device_stats(rows: list[dict]) -> dict:
    """tessera_jax on masks that start on the device: its device-plan and kernel times and
    which templates (or the exact path) the device route ran."""
    ds = [r["peers"]["tessera"] for r in rows
          if r.get("peers", {}).get("tessera", {}).get("route") == "device"]
    if not ds:
        return {}
    return {"device_plan_ms": _stats([d.get("device_plan_ms") for d in ds]),
            "kernel_ms": _stats([d.get("kernel_ms") for d in ds]),
            "kernel_ms_all_variants": _stats([d.get("kernel_ms_all_variants") for d in ds]),
            "templates": dict(collections.Counter(str(d.get("device_template")) for d in ds)),
            "meaning": "kernel_ms: device plan + kernel, one program (variant 0); "
                       "device_plan_ms: planning.device.plan_on_device alone, same rule"}


def summarize(rows: list[dict]) -> dict:
    """The ``summary`` block over every row (rows of both mask sources: issue 33's medians and
    minima cover both; one source: that one's), its ``mask_source``, and, when rows have more
    than one source, the headline keys per source under ``by_mask_source``. The timing rule
    check covers all rows."""
    by = collections.defaultdict(list)
    for r in rows:
        by[mask_source(r)].append(r)
    # Issue 33's keys are medians and minima over both mask sources.
    out = _summarize_source(rows)
    out["mask_source"] = "+".join(sorted(by)) or primary_source(rows)
    out["timing_rules"] = timing_rules(rows)
    if len(by) > 1:
        out["by_mask_source"] = {}
        for k in sorted(by):
            one = _summarize_source(by[k])
            out["by_mask_source"][k] = {h: one[h] for h in HEADLINE}
            for mode in ("sync", "tiered"):
                if k == "host" and any(_mode_ms(r, mode) for r in by[k]):
                    one_mode = _summarize_source([_as_mode(r, mode) for r in by[k]])
                    out["by_mask_source"][f"host_{mode}"] = {h: one_mode[h] for h in HEADLINE}
            if k == "host":
                out["by_mask_source"][k]["tessera_request_over_to_device_request"] = _stats(
                    [r["peers"]["tessera"]["request_ms"] / r["peers"]["tessera"]["to_device_request_ms"]
                     for r in by[k] if r.get("peers", {}).get("tessera", {}).get("to_device_request_ms")
                     and r["peers"]["tessera"].get("request_ms")])
    return out


def _mode_ms(row: dict, mode: str):
    return row.get("peers", {}).get("tessera", {}).get(f"{mode}_request_ms")


def _as_mode(row: dict, mode: str) -> dict:
    """A host row with tessera_jax's request the one of ``Options(host_planning=mode)``
    ("sync" or "tiered"), where it was timed; else the row as it is."""
    t = _mode_ms(row, mode)
    if t is None:
        return row
    me = dict(row["peers"]["tessera"], request_ms=t)
    return dict(row, peers=dict(row["peers"], tessera=me))


def _summarize_source(rows: list[dict]) -> dict:
    """The ``summary`` block of rows of one mask source: request-latency speedups (and
    kernel-only ones), per family, and request overheads."""
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
    overhead = request_overhead(rows)
    excess = request_excess_over_cudnn(rows)
    return {
        "masks": len(rows),
        "min_speedup_vs_best_alternative": req["best_alternative"].get("min"),
        "median_speedup_vs_best_alternative": req["best_alternative"].get("median"),
        "median_speedup_vs_flashinfer": req["flashinfer"].get("median"),
        "median_speedup_vs_flex": req["flex"].get("median"),
        "median_speedup_vs_dense": req["dense"].get("median"),
        "min_kernel_speedup_vs_flashinfer": out["kernel"]["overall"]["flashinfer"].get("min"),
        "median_kernel_speedup_vs_flashinfer":
            out["kernel"]["overall"]["flashinfer"].get("median"),
        "per_family_medians": {
            f: {g: d[g].get("median") for g in ("flashinfer", "flex", "dense", "best_alternative")}
            for f, d in out["request"]["per_family"].items()},
        "median_request_overhead_ms": overhead.get("tessera", {}).get("median"),
        "request_overhead_ms": overhead,
        "median_request_excess_over_cudnn_ms": excess.get("median"),
        "request_excess_over_cudnn_ms": excess,
        "request": out["request"], "kernel": out["kernel"],
        "peer_not_ok": {p: dict(c) for p, c in failures.items()},
        "speedup_upper_bound": speedup_bounds(rows),
        "tessera_device": _device_stats(rows),
        "timing_rules": timing_rules(rows),
        "metric": "speedup = peer time / tessera_jax time on the same mask (request latency: "
                  "conversion + planning + kernel); a peer group's time is its fastest variant "
                  "that passed the check; best alternative = fastest of FlashInfer, "
                  "FlexAttention and cuDNN dense; request overhead = request - kernel ms "
                  "(median_request_overhead_ms: tessera_jax's); request excess over cuDNN = "
                  "tessera_jax's request overhead - cuDNN dense's, same row; mask source gpu: "
                  "a new mask per request, on the device before the call (FlashInfer copies "
                  "it to the host inside its request), host: the NumPy mask, every cache "
                  "cleared per request",
    }


def figure(rows: list[dict], path: str, title: str = "") -> str | None:
    """Per-family distributions of request speedups (log scale), one colour per peer group."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    src = primary_source(rows)
    rows = [r for r in rows if mask_source(r) == src]
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
    ax.set_title(title or f"tessera_jax vs peers, per mask family (H200; masks start on the "
                          f"{'GPU' if src == 'gpu' else 'host'})")
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


class _CaseBase:
    """What every case has: the check of an output subset against the reference, and the new
    masks of a request (``variants``: the mask's own blocks first, the checked one)."""

    source = "host"          # where a request's mask starts: "host" (NumPy) or "gpu"

    def _subset(self):
        """(q, k, v) of the check subset as float32 jax arrays [1, rows, qh, D], [1, Lkv, kvh, D]."""
        raise NotImplementedError

    def reference(self, dense: bool = False):
        """(out [rows, qh, D] float32, empty [rows, qh] bool) of the reference on the subset."""
        if dense in self._ref:
            return self._ref[dense]
        import jax

        import tessera_jax as tj
        from tessera_jax.mask import BlockMask
        qs, ks, vs = self._subset()
        if dense:
            sub = BlockMask(np.arange(self.rows.size + 1), [0, self.Lkv],
                            np.ones((1, self.rows.size, 1), bool))
        else:
            sub = C.row_subset_mask(self.mask, self.rows, self.qh)
        out = tj.reference_attention(qs, ks, vs, sub)
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

    # -- new masks per request (mask source "gpu")
    def variants(self, args) -> list:
        """The blocks of the new masks (NumPy, ``C.mask_variants``), made once per case."""
        if getattr(self, "_variants", None) is None:
            n = args.mask_variants or (request_rule(args).warmup + request_rule(args).repeats)
            seed = int(args.seed) * 1000003 + zlib.crc32(str(self.spec.get("id")).encode()) % 1000003
            self._variants = C.mask_variants(self.mask, n, args.variant_kind, seed=seed,
                                             group=self.g)
        return self._variants

    def variants_jax(self, args) -> list:
        """The variants as jax bool arrays on the device (made before any timing)."""
        if getattr(self, "_variants_jax", None) is None:
            import jax
            self._variants_jax = [jax.device_put(v) for v in self.variants(args)]
            jax.block_until_ready(self._variants_jax)
        return self._variants_jax

    def variants_torch(self, args) -> list:
        """The variants as torch bool tensors on the torch device (made before any timing)."""
        if getattr(self, "_variants_torch", None) is None:
            torch = self.ctx.torch
            self._variants_torch = [torch.from_numpy(v).to(self.ctx.dev)
                                    for v in self.variants(args)]
            _sync()
        return self._variants_torch

    def free(self):
        for n in ("qj", "kj", "vj", "q", "k", "v", "_variants", "_variants_jax",
                  "_variants_torch", "tj_device_fn"):
            setattr(self, n, None)


class Case(_CaseBase):
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

    def _subset(self):
        dl = self.ctx.jax.dlpack.from_dlpack
        rows_t, qh_t, kvh_t = self.idx(self.rows), self.idx(self.qh), self.idx(self.kvh)
        qs = self.q[0].index_select(0, rows_t).index_select(1, qh_t).float().contiguous()[None]
        ks = self.k[0].index_select(1, kvh_t).float().contiguous()[None]
        vs = self.v[0].index_select(1, kvh_t).float().contiguous()[None]
        return dl(qs), dl(ks), dl(vs)


class DryCase(_CaseBase):
    """A ``Case`` without torch (CPU dry run): jax inputs, the same check subset and variants."""

    def __init__(self, spec: dict, mask, Hq: int, Hkv: int, args, head_dim: int = 16):
        import jax
        import jax.numpy as jnp
        self.ctx, self.spec, self.mask = None, spec, mask
        self.Lq, self.Lkv = mask.Lq, mask.Lkv
        self.Hq, self.Hkv, self.g, self.D = Hq, Hkv, Hq // Hkv, head_dim
        key = jax.random.key(int(args.seed) * 1000003 + zlib.crc32(spec["id"].encode()) % 1000003)
        self.qj, self.kj, self.vj = (
            jax.random.normal(jax.random.fold_in(key, i), (1, L, H, head_dim), jnp.bfloat16)
            for i, (L, H) in enumerate(((self.Lq, Hq), (self.Lkv, Hkv), (self.Lkv, Hkv))))
        self.rows = C.check_rows(self.Lq, mask.q_bounds, args.check_rows, seed=args.seed)
        nk = min(args.check_kv_heads, self.Hkv)
        self.kvh = np.unique(np.linspace(0, self.Hkv - 1, nk).round().astype(np.int64))
        self.qh = (self.kvh[:, None] * self.g + np.arange(self.g)[None]).ravel()
        self._ref = {}

    def _subset(self):
        import jax.numpy as jnp
        f32 = jnp.float32
        qs = self.qj[0][self.rows][:, self.qh].astype(f32)[None]
        ks = self.kj[0][:, self.kvh].astype(f32)[None]
        vs = self.vj[0][:, self.kvh].astype(f32)[None]
        return qs, ks, vs


class _Rotor:
    """Hands out a case's new masks in turn: call j gets variant j % n (warm-up calls
    included), so consecutive requests never see the same mask."""

    def __init__(self, items):
        self.items, self.i = list(items), 0

    def next(self):
        x = self.items[self.i % len(self.items)]
        self.i += 1
        return x


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


def bounded_rule(rule: timing.TimingRule, first_ms: float, budget_s: float) -> timing.TimingRule:
    """``rule`` after one untimed call of ``first_ms`` (it counts as a warm-up), with fewer
    timed calls (>= 2) where the rule's would pass ``budget_s``: a diagnostic time outside the
    summary (a 40-head Wan 720p host plan took 11 s: 22 calls were 257 s of a 585 s call)."""
    warmup = max(0, rule.warmup - 1)
    if (warmup + rule.repeats) * first_ms <= budget_s * 1e3:
        return rule.replace(warmup=warmup)
    return rule.replace(warmup=0, repeats=max(2, int(budget_s * 1e3 // max(first_ms, 1e-3))))


def _bounded_request(fn, args, before=None) -> timing.Timing:
    """``_request`` of a diagnostic (not in any ratio) under ``bounded_rule``
    (``--diagnostic-budget`` seconds)."""
    if before:
        before()
    t0 = time.perf_counter()
    fn()
    rule = bounded_rule(request_rule(args), (time.perf_counter() - t0) * 1e3,
                        args.diagnostic_budget)
    return timing.time_request(fn, rule=rule, before=before)


def _kernel_timing(fn, arg_sets, args, framework: str) -> timing.Timing:
    return timing.time_kernel(fn, arg_sets, rule=kernel_rule(args), framework=framework)


def _kernel(fn, arg_sets, args, framework: str) -> dict:
    """``kernel_ms``, ``kernel_samples``, ``kernel_timer``, ``kernel_rule`` of a peer."""
    return _kernel_timing(fn, arg_sets, args, framework).to_json("kernel_")


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


#: XLA backend compiles of this process: [count, seconds] (jax.monitoring's compile event).
_COMPILES = [0, 0.0]


@functools.cache
def _count_compiles() -> None:
    """Registers (once) the listener that counts XLA backend compiles into ``_COMPILES``."""
    import jax

    def listen(event, duration, **_):
        if event == timing.BACKEND_COMPILE:
            _COMPILES[0] += 1
            _COMPILES[1] += float(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)


class _Phases:
    """Wall seconds of each part of a row (``phase_s``): where a row's time goes (compiles,
    planning, timing loops), so a call's budget can be split by measurement; and the XLA
    compiles in each part (``compiles``: [count, seconds]): a compile in a timed part (after
    ``tj.precompile``) is one a request would pay."""

    def __init__(self):
        _count_compiles()
        self.t, self.s, self.c, self.compiles = time.perf_counter(), {}, list(_COMPILES), {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name] = round(self.s.get(name, 0.0) + now - self.t, 3)
        n, sec = _COMPILES[0] - self.c[0], _COMPILES[1] - self.c[1]
        if n:
            was = self.compiles.get(name, [0, 0.0])
            self.compiles[name] = [was[0] + n, round(was[1] + sec, 3)]
        self.t, self.c = now, list(_COMPILES)


def run_tessera(case: Case, args) -> dict:
    import jax
    import tessera_jax as tj
    from request_cases import forget_request_caches
    from tessera_jax.runtime import dispatch as backends
    from tessera_jax.runtime import dense_route
    mask = case.mask

    clear = forget_request_caches   # a new mask: its selection and plan are paid

    call = lambda: tj.sparse_attention(case.qj, case.kj, case.vj, mask)  # noqa: E731
    # The request starts from the logical mask's NumPy arrays, as FlashInfer's conversion
    # does: building the BlockMask (validation, packed bits) is part of it.
    raw = (np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds), np.asarray(mask.blocks))
    request_call = lambda: tj.sparse_attention(case.qj, case.kj, case.vj,  # noqa: E731
                                               tj.BlockMask(*raw))
    ph = _Phases()
    t = time.perf_counter()
    out = jax.block_until_ready(call())
    res = {"first_call_s": time.perf_counter() - t, "phase_s": ph.s,
           "phase_compiles": ph.compiles}
    o = np.asarray(jax.device_get(out[0][case.rows][:, case.qh]), np.float32)
    res.update(case.check(o))
    del out
    ph.mark("first_call_check")
    p = tj.plan(mask, case.qj.shape, case.kj.shape, case.qj.dtype)
    try:
        res["plan"] = {k: v for k, v in p.stats().items() if isinstance(v, (int, float, str, bool))}
    except Exception as e:  # noqa: BLE001
        res["plan"] = {"error": _tail(e, 200)}
    if res["status"] not in OK_STATES:
        return res
    plan_t = _bounded_request(lambda: tj.plan(mask, case.qj.shape, case.kj.shape, case.qj.dtype),
                              args, before=clear)
    res["plan_ms"], res["plan_rule"] = plan_t.ms, plan_t.rule.name
    ph.mark("plan_timing")
    # The default request (Options().host_planning "auto": tiered on a GPU), its executables
    # compiled first as for every peer: ``tj.precompile`` with tiered options compiles the
    # tiered device route, which the default and the explicit modes below share (its key
    # ignores host_planning), and the host plan's executables are compiled by the calls above.
    # Only the route the row's requests run: its own bounds static ("same"), else traced.
    from tessera_jax.runtime import tiered
    bounds_mode = tiered_bounds(case, args)
    tj.precompile(_precompiled(mask, bounds_mode), case.qj.shape, case.kj.shape, case.qj.dtype,
                  options=tj.Options(host_planning="tiered"),
                  tiered_routes=("static",) if bounds_mode == "same" else ("traced",))
    ph.mark("precompile")
    res["host_planning"] = tiered.mode(tj.Options(), case.qj)
    res["tiered_bounds"] = bounds_mode
    before = tiered.stats().get("device_route", 0)
    res.update(_request(lambda: jax.block_until_ready(request_call()), args,
                        before=clear).to_json("request_"))
    res["request_device_route_calls"] = tiered.stats().get("device_route", 0) - before
    ph.mark("request_timing")
    res["mask_ms"] = _request(lambda: tj.BlockMask(*raw), args).ms
    # the default request's own output (the device route where it tiers), checked as the first
    clear()
    out = jax.block_until_ready(request_call())
    o = np.asarray(jax.device_get(out[0][case.rows][:, case.qh]), np.float32)
    res["request_check"] = {k: v for k, v in case.check(o).items()
                            if k in ("status", "rel_err", "why")}
    if res["request_check"]["status"] not in OK_STATES:
        res.update(status="wrong", why="the default request: " + res["request_check"]["why"])
    del out
    ph.mark("request_check")
    # Where a request's time goes beyond plan + kernel: the plan arrays' host->device copy, and
    # an eager call whose plan and device arrays are cached (dispatch + kernel, wall clock).
    # An eager request copies units and steps (row_index is made on the device). An all-selected
    # mask runs cuDNN (dense_route): no plan is built or copied then.
    p = tj.plan(mask, case.qj.shape, case.kj.shape, case.qj.dtype)
    arrays = (p.units, p.steps)
    shape, be = _shape_and_backend(case)
    routed = dense_route.takes(mask, shape, be, False)
    res["route"] = "cudnn_dense" if routed else "plan"
    res["plan_bytes"] = int(sum(a.nbytes for a in arrays))
    res["put_ms"] = _request(lambda: jax.block_until_ready(jax.device_put(arrays)), args).ms
    res["cached_call_ms"] = _request(lambda: jax.block_until_ready(call()), args).ms
    # A tiered request's host parts: the mask's packed copy to the device (static or traced
    # bounds, as the row's requests run; with static bounds the request hands the bits to its
    # jit, which copies them in its dispatch) and the rule's inputs (tier_costs.size_of)
    from tessera_jax.runtime import tier_costs
    static = bounds_mode == "same"
    res["tiered_copy_ms"] = _request(lambda: jax.block_until_ready(
        mask.packed_leaves(static_bounds=static)), args).ms
    res["tiered_rule_ms"] = _request(lambda: tier_costs.size_of(
        mask, shape, backends.resolve(None, shape), tj.Options().device_rule), args).ms
    ph.mark("host_parts")
    # eager (time_kernel calls it as given): the plan is cached and its executable compiled by
    # the calls above (a jax.jit of this closure would compile a new executable with the plan
    # as constants)
    res.update(_kernel(lambda q, k, v: tj.sparse_attention(q, k, v, mask),
                       ((case.qj, case.kj, case.vj),), args, "jax"))
    ph.mark("kernel_timing")
    # The same mask moved to the device compactly (``to_device``: bit-packed) and run by the
    # device route's compiled call (``--mask-source both``: compiled by the gpu row already).
    f = getattr(case, "tj_device_fn", None)
    if f is not None:
        def via_device():
            return jax.block_until_ready(f(case.qj, case.kj, case.vj, mask.to_device().blocks))
        res["to_device_request_ms"] = _request(via_device, args, before=clear).ms
        ph.mark("to_device_request")
    if args.tiered and not routed:
        for mode in ("sync", "tiered"):
            res.update(_mode_request(case, args, clear, mode))
        ph.mark("mode_requests")
    clear()
    return res


def tiered_bounds(case, args) -> str:
    """``--tiered-bounds`` of a row, "auto" resolved: "same" where the family's bounds do not
    depend on the content (the spec built at another seed and step, one head, has the same
    bounds: a fixed-grid method, whose server compiles its grid's route at start-up), "new"
    where they do (SVG2's clusters) or cannot be told (no spec)."""
    if args.tiered_bounds != "auto":
        return args.tiered_bounds
    from tessera_jax.masks.corpus import build
    spec = getattr(case, "spec", None) or {}
    from tessera_jax.masks import FAMILIES
    if "seed" not in spec or spec.get("family") not in FAMILIES:
        return "new"                                 # not a corpus spec (random, smoke cases)
    other = build(dict(spec, seed=int(spec["seed"]) + 1, step=int(spec.get("step", 0)) + 1),
                  heads=1)
    m = case.mask
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               ((other.q_bounds, m.q_bounds), (other.kv_bounds, m.kv_bounds)))
    return "same" if same else "new"


def _precompiled(mask, bounds_mode: str):
    """The mask ``tj.precompile`` sees before a host row's requests: ``same`` (a fixed-grid
    method): the row's own (a tiered request then runs its bounds' static route, as a new mask
    of the same grid would); ``new``: the same block shape with one bound moved (only the
    traced route is compiled for the row's bounds, as for content-dependent bounds)."""
    import tessera_jax as tj
    if bounds_mode == "same":
        return mask
    qb, kb = (np.array(b, np.int64) for b in (mask.q_bounds, mask.kv_bounds))
    for b in (kb, qb):
        gaps = np.flatnonzero(np.diff(b)[:-1] > 1)       # an inner bound that can move down
        if gaps.size:
            b[gaps[0] + 1] -= 1
            return tj.BlockMask(qb, kb, mask.blocks)
    return mask


def _mode_request(case: Case, args, clear, mode: str) -> dict:
    """The first request of a new host mask under ``Options(host_planning=mode)`` ("tiered":
    the rule's choice, device route while the host plan is made on a thread, or the host
    plan; "sync": the host plan first), the executables compiled by ``run_tessera`` first
    (``tj.precompile``, as a server would at start-up). ``<mode>_device_route_calls``: how
    many of the ``<mode>_calls`` requests (warm-up included) ran the device route."""
    import jax
    import tessera_jax as tj
    from tessera_jax.runtime import tiered
    opts = tj.Options(host_planning=mode)
    mask = case.mask
    try:
        clear()
        before = tiered.stats().get("device_route", 0)
        t = _request(lambda: jax.block_until_ready(
            tj.sparse_attention(case.qj, case.kj, case.vj, mask, options=opts)), args,
            before=clear)
        runs = tiered.stats().get("device_route", 0) - before
        return {f"{mode}_request_ms": t.ms, f"{mode}_device_route_calls": runs,
                f"{mode}_calls": request_rule(args).warmup + request_rule(args).repeats}
    except Exception as e:  # noqa: BLE001
        return {f"{mode}_error": _tail(e, 300)}


def _device_choice(case: "_CaseBase", blocks0) -> tuple[dict, object, int]:
    """(row fields, template or None, bitmap capacity): what the device route runs for this
    call site (``device_route``'s own choice: a static template per bounds and shapes)."""
    import tessera_jax as tj
    from tessera_jax import select
    shape, be = _shape_and_backend(case)
    dm = tj.BlockMask(case.mask.q_bounds, case.mask.kv_bounds, blocks0)
    t, cap = select.choose("device", dm, shape, be)      # the template, its bitmap capacity
    return ({"backend": be, "device_template": t.name if t is not None else "exact path",
             "bitmap_capacity": cap}, t, cap)


def run_tessera_device(case: "_CaseBase", args) -> dict:
    """tessera_jax on a mask that starts on the device (``--mask-source gpu``): a request is
    one call of a jitted ``lambda q, k, v, blocks: tj.sparse_attention(q, k, v,
    tj.BlockMask(q_bounds, kv_bounds, blocks))``, bounds static NumPy (as a content-dependent
    method has them), blocks a device array, a new one per request (``case.variants``; the
    first is the checked one). The device route plans inside the program: no host planning,
    no host transfer. Kernel time: the same call under the kernel rule (device plan + kernel,
    one program; variant 0, as the peers' kernels); ``device_plan_ms``: the device plan alone
    (``runtime.device_route.device_plans``' forward plan: the route's template and capacity,
    planned as the route plans it), same rule."""
    import jax

    import tessera_jax as tj
    from request_cases import forget_request_caches
    mask = case.mask
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    blocks = case.variants_jax(args)
    f = jax.jit(lambda q, k, v, b: tj.sparse_attention(q, k, v, tj.BlockMask(qb, kb, b)))
    case.tj_device_fn = f
    qkv = (case.qj, case.kj, case.vj)
    ph = _Phases()
    t = time.perf_counter()
    out = jax.block_until_ready(f(*qkv, blocks[0]))
    res = {"first_call_s": time.perf_counter() - t, "route": "device",
           "variants": len(blocks), "variant_kind": args.variant_kind, "phase_s": ph.s,
           "phase_compiles": ph.compiles}
    o = np.asarray(jax.device_get(out[0][case.rows][:, case.qh]), np.float32)
    res.update(case.check(o))
    del out
    ph.mark("first_call_check")
    try:
        info, tpl, cap = _device_choice(case, blocks[0])
        res.update(info)
    except Exception as e:  # noqa: BLE001
        tpl, cap = None, None
        res["device_template"] = "unknown: " + _tail(e, 200)
    if res["status"] not in OK_STATES:
        return res
    rot = _Rotor(blocks)
    res.update(_request(lambda: jax.block_until_ready(f(*qkv, rot.next())), args,
                        before=forget_request_caches).to_json("request_"))
    ph.mark("request_timing")
    res.update(_kernel(f, [(*qkv, blocks[0])], args, "jax"))
    ph.mark("kernel_timing")
    if tpl is not None:                # (the exact path computes dense work: timed once)
        res["kernel_ms_all_variants"] = _kernel_timing(f, [(*qkv, b) for b in blocks], args,
                                                       "jax").ms
        try:
            # The route's own forward plan (``device_route.device_plans``; XLA drops the
            # dk/dv plan, unused): the plain or the gathering planner, as the call runs it.
            from tessera_jax.runtime import device_route
            from tessera_jax.select import device as select_device
            from tessera_jax.validation import check_shapes
            consts = select_device.static_parts(tj.BlockMask(qb, kb, blocks[0]))
            shape = check_shapes(case.qj.shape, case.kj.shape, case.qj.dtype)
            decide = device_route.decides(consts, tuple(blocks[0].shape), shape, tpl, cap or 0)
            budget = tj.Options().bitmap_budget_bytes
            planf = jax.jit(lambda b: device_route.device_plans(
                case.qj, case.kj, qb, kb, b, consts=consts, t=tpl, capacity=cap or 0,
                decide=decide, budget=budget).fwd)
            res.update(_kernel_timing(planf, [(blocks[0],)], args, "jax").to_json("device_plan_"))
            prot = _Rotor(blocks)
            res["device_plan_wall_ms"] = _request(
                lambda: jax.block_until_ready(planf(prot.next())), args).ms
        except Exception as e:  # noqa: BLE001
            res["device_plan_error"] = _tail(e, 300)
        ph.mark("device_plan_timing")
    if args.gather_alt:
        res["gather_alt"] = _gather_alternatives(case, blocks, args)
        ph.mark("gather_alt")
    if args.device_alt:
        res["device_alt"] = _device_alternatives(case, blocks, args)
        ph.mark("device_alt")
    forget_request_caches()
    return res


def _shape_and_backend(case: "_CaseBase"):
    """(AttnShape, backend) of a case's call: what ``tj.sparse_attention`` would resolve."""
    from tessera_jax.runtime import dispatch as backends
    from tessera_jax.validation import check_shapes
    shape = check_shapes(case.qj.shape, case.kj.shape, case.qj.dtype)
    return shape, backends.resolve(None, shape)


def _checked_kernel(case: "_CaseBase", f, call_args: tuple, args) -> dict:
    """``f(*call_args)`` checked against the reference (status, rel_err, why) and, where it
    passes, timed under the kernel rule; a call that raises is "failed"."""
    import jax
    try:
        o = jax.block_until_ready(f(*call_args))
        chk = case.check(np.asarray(jax.device_get(o[0][case.rows][:, case.qh]), np.float32))
        del o
        r = {k: v for k, v in chk.items() if k in ("status", "rel_err", "why")}
        if r["status"] in OK_STATES:
            r.update(_kernel(f, [call_args], args, "jax"))
        return r
    except Exception as e:  # noqa: BLE001
        return {"status": "failed", "why": _tail(e, 300)}


def _device_alternatives(case: "_CaseBase", blocks, args) -> dict:
    """Each template the device route may run (its device list, candidates and gathering
    template), named to the same call: plan + kernel of variant 0 (checked), the kernel rule;
    ``best``: the fastest. What ``select.device``'s static rule would need to choose per
    mask."""
    import jax
    import tessera_jax as tj
    from tessera_jax.select import device as select_device
    mask = case.mask
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    be = _shape_and_backend(case)[1]
    names = list(select_device.DEVICE_TEMPLATES.get(be, ()))
    names += select_device.DEVICE_CANDIDATES.get(be, ())
    if be in select_device.GATHER_TEMPLATES:
        names.append(select_device.GATHER_TEMPLATES[be])
    qkv, out = (case.qj, case.kj, case.vj), {}
    for name in names:
        out[name] = _checked_kernel(case, jax.jit(
            lambda q, k, v, b, t=name: tj.sparse_attention(q, k, v, tj.BlockMask(qb, kb, b),
                                                           template=t)),
            (*qkv, blocks[0]), args)
        if out[name].get("status") in OK_STATES:
            out[name]["plan_counts"] = _device_plan_counts(case, blocks[0], name)
    timed = {n: r["kernel_ms"] for n, r in out.items() if r.get("kernel_ms")}
    if timed:
        out["best"] = min(timed, key=timed.get)
    return out


def _device_plan_counts(case: "_CaseBase", blocks, name: str) -> dict:
    """What template ``name``'s device forward plan of ``blocks`` computes, counted on the
    device (the kernel times of ``device_alt`` over these give a template's time per
    computed tile, ``select.device.STEP_COST``): steps by kind (plain full / plain partial /
    grid / bitmap / gathered), computed over selected interactions, units with an odd step
    count (a step-pairs kernel's half-empty last stage)."""
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj
    from pallas_kernels import abi
    from tessera_jax.runtime import device_route, dispatch
    from tessera_jax.select import device as select_device
    from tessera_jax.validation import check_qkv
    try:
        mask = case.mask
        qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
        t = dispatch.get_template(name)
        shape = check_qkv(case.qj, case.kj, case.vj)
        dev = tj.BlockMask(qb, kb, blocks)
        consts = select_device.static_parts(dev)
        t, cap = device_route._choose(consts, dev, shape, t.backend, t,
                                      tj.Options().device_rule)
        if t is None:
            return {"status": "exact path"}

        def counts(b):
            fwd = device_route.device_plans(
                case.qj, case.kj, qb, kb, b, consts=consts, t=t, capacity=cap,
                decide=device_route.decides(consts, b.shape, shape, t, cap),
                budget=tj.Options().bitmap_budget_bytes).fwd
            u, st = fwd.units, fwd.steps
            cnt = u[:, abi.UNIT_STEP_CNT]
            used = jnp.arange(st.shape[0]) < jnp.max(u[:, abi.UNIT_STEP_PTR] + cnt)
            # Step rows by kind counted once (a shared mask's query heads visit the same
            # rows); ``steps`` counts every unit's visits.
            cb, rect = st[:, abi.STEP_CUTS_B], st[:, abi.STEP_RECT]
            kinds = {"full": (cb == 0) & (rect == abi.full_rect(t.tile_q, t.tile_kv)),
                     "partial": (cb == 0) & (rect != abi.full_rect(t.tile_q, t.tile_kv)),
                     "bitmap": cb == abi.BITMAP_FLAG, "gathered": abi.is_gather(cb)}
            kinds["grid"] = ~(kinds["full"] | kinds["partial"] | kinds["bitmap"]
                              | kinds["gathered"])
            return ({k: jnp.sum(v & used) for k, v in kinds.items()}, jnp.sum(cnt),
                    jnp.mean((cnt % 2 == 1).astype(jnp.float32)))

        kinds, steps, odd = jax.device_get(jax.jit(counts)(blocks))
        sel = float((np.diff(qb)[None, :, None] * np.diff(kb)[None, None, :]
                     * np.asarray(mask.blocks)).sum()) * shape.num_q_heads / mask.shape[0]
        return {"steps": int(steps), "step_rows_by_kind": {k: int(v) for k, v in kinds.items()},
                "computed_over_selected": float(steps) * t.tile_q * t.tile_kv / max(sel, 1.0),
                "odd_units": float(odd), "tiles": [t.tile_q, t.tile_kv]}
    except Exception as e:  # noqa: BLE001
        return {"status": "failed", "why": _tail(e, 300)}


def _gather_alternatives(case: "_CaseBase", blocks, args) -> dict:
    """The device route with ``Options.device_gather`` on against its default, same run and
    rule, on irregular key blocks (clusters: where the gathering template might pay): static
    bounds ("irregular" against "never"), and the bounds traced ("traced" against "never", the
    route a tiered host request with new bounds runs). Each call is device plan + kernel
    (variant 0, checked against the reference), the kernel rule."""
    import jax
    import tessera_jax as tj
    from tessera_jax.select import device as select_device
    mask = case.mask
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    if not select_device.irregular_kv(kb):
        return {"status": "skipped", "why": "key blocks not irregular"}
    qkv = (case.qj, case.kj, case.vj)
    out = {}
    variants = (("static_never", "never", False), ("static_irregular", "irregular", False),
                ("traced_never", "never", True), ("traced_traced", "traced", True))
    qbj, kbj = jax.device_put(qb), jax.device_put(kb)
    for name, dg, traced in variants:
        opts = tj.Options(device_gather=dg)
        if traced:
            f = jax.jit(lambda q, k, v, b, qq, kk, o=opts: tj.sparse_attention(
                q, k, v, tj.BlockMask(qq, kk, b), options=o))
            out[name] = _checked_kernel(case, f, (*qkv, blocks[0], qbj, kbj), args)
        else:
            f = jax.jit(lambda q, k, v, b, o=opts: tj.sparse_attention(
                q, k, v, tj.BlockMask(qb, kb, b), options=o))
            out[name] = _checked_kernel(case, f, (*qkv, blocks[0]), args)
    for kind, on in (("static", "irregular"), ("traced", "traced")):
        a, b = out.get(f"{kind}_never", {}), out.get(f"{kind}_{on}", {})
        if a.get("kernel_ms") and b.get("kernel_ms"):
            out[f"{kind}_gather_speedup"] = a["kernel_ms"] / b["kernel_ms"]
    # Each device-list template and candidate named on the traced bounds (the rule's choice
    # aside): what a tiered request with new bounds would run with another template.
    be = _shape_and_backend(case)[1]
    for name in (*select_device.DEVICE_TEMPLATES.get(be, ()),
                 *select_device.DEVICE_CANDIDATES.get(be, ())):
        f = jax.jit(lambda q, k, v, b, qq, kk, t=name: tj.sparse_attention(
            q, k, v, tj.BlockMask(qq, kk, b), template=t))
        out[f"traced_{name}"] = _checked_kernel(case, f, (*qkv, blocks[0], qbj, kbj), args)
    return out



def _time_request(res: dict, convert_and_plan, run, args, variants=None) -> dict:
    """Adds plan-only, request (convert + plan + run) and kernel-only timings to ``res``.

    ``variants`` (mask source "gpu"): ``convert_and_plan(v)`` takes a new mask per call (call
    j: variant j % n, warm-up included); the kernel runs the plan of variant 0, the checked
    one. Without: ``convert_and_plan()`` of the case's mask (mask source "host")."""
    def cp_fn():
        if variants is None:
            return convert_and_plan
        rot = _Rotor(variants)
        return lambda: convert_and_plan(rot.next())

    cp = cp_fn()
    res["plan_ms"] = _request(cp, args, sync=_sync).ms
    cp = cp_fn()
    res.update(_request(lambda: (cp(), run()), args, sync=_sync).to_json("request_"))
    convert_and_plan() if variants is None else convert_and_plan(variants[0])
    res.update(_kernel(run, ((),), args, "torch"))
    return res


def run_fi_bsr(case: Case, args, ctx: Ctx) -> dict:
    """FlashInfer BSR. Mask source "gpu": the mask is a torch bool tensor on the device; a
    request copies it to the host (``.cpu()``: plan() takes host BSR arrays), converts it
    (NumPy, as "host") and plans; R, C, M, N come from the static bounds."""
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

    def plan(bb):
        w.plan(torch.from_numpy(bb.indptr), torch.from_numpy(bb.indices), bb.M, bb.N, bb.R, bb.C,
               case.Hq, case.Hkv, case.D, q_data_type=bf, kv_data_type=bf, o_data_type=bf)

    variants = None
    if case.source == "gpu":
        layout = C.fi_bsr_layout(case.mask)
        variants = case.variants_torch(args)

        def convert_and_plan(bt):          # bt: bool [Hm, nq, nkv] on the device
            bb = C.fi_bsr_from_shared(bt[0].cpu().numpy(), layout)
            if isinstance(bb, str):
                raise ValueError(f"a new mask can't be BSR: {bb}")
            plan(bb)
    else:
        def convert_and_plan():
            plan(C.fi_bsr(case.mask))

    run = lambda: w.run(q0, k0, v0)  # noqa: E731
    t = time.perf_counter()
    convert_and_plan() if variants is None else convert_and_plan(variants[0])
    out = run()
    _sync()
    res = {"first_call_s": time.perf_counter() - t, "R": b.R, "C": b.C, "nnz_blocks": b.nnz,
           "kv_padded_to": b.N, "backend": getattr(w, "_backend", None),
           "tensor_cores": getattr(w, "_use_tensor_cores", None)}
    res.update(case.check(out[case.idx(case.rows)][:, case.idx(case.qh)].float().cpu().numpy()))
    del out
    if res["status"] not in OK_STATES:
        return res
    return _time_request(res, convert_and_plan, run, args, variants)


def run_fi_var(case: Case, args, ctx: Ctx) -> dict:
    """FlashInfer variable blocks. Mask source "gpu": the torch bool tensor on the device goes
    to plan() as it is (heads picked / broadcast on the device to the pattern per FlashInfer
    KV head that the static mask layout needs); plan() pays its own copies to the host.
    ``--fi-var-device cpu``: a ``.cpu()`` first. Block sizes: static, on the device."""
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

    variants = None
    if case.source == "gpu":
        variants = case.variants_torch(args)
        row_sz = torch.from_numpy(vv.block_row_sz).to(dev)
        col_sz = torch.from_numpy(vv.block_col_sz).to(dev)
        h_fi, Hm, g = vv.num_kv_heads, case.mask.num_heads, case.g

        def convert_and_plan(bt):          # bt: bool [Hm, nq, nkv] on the device
            if Hm == 1:
                m = bt.expand(h_fi, *bt.shape[1:])
            elif h_fi != Hm:               # heads equal within GQA groups: one per group
                m = bt[::g]
            else:
                m = bt
            m = m.contiguous() if dev.type != "cpu" else m.cpu().contiguous()
            w.plan(m, row_sz, col_sz, case.Hq, h_fi, case.D, q_data_type=bf, kv_data_type=bf)
    else:
        def convert_and_plan():
            c = C.fi_var(case.mask, case.Hq, case.Hkv)
            w.plan(torch.from_numpy(c.block_mask_map).to(dev), torch.from_numpy(c.block_row_sz).to(dev),
                   torch.from_numpy(c.block_col_sz).to(dev), case.Hq, c.num_kv_heads, case.D,
                   q_data_type=bf, kv_data_type=bf)

    run = lambda: w.run(qh, kh, vh)  # noqa: E731
    t = time.perf_counter()
    convert_and_plan() if variants is None else convert_and_plan(variants[0])
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
    return _time_request(res, convert_and_plan, run, args, variants)


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
        variants = static = None

        def convert(bt=None):   # on the GPU: tile counts, index lists, BlockMask, mask_mod
            f = C.flex_blocks_torch(case.mask, block, pad_to=args.flex_pad, device=ctx.dev,
                                    blocks_dev=bt, static=static)
            return flex_block_mask(f, torch, ctx.dev)

        def call(bm):
            return flex(qf, kf, vf, block_mask=bm, enable_gqa=gqa, kernel_options=ko)

        try:
            if case.source == "gpu":   # the mask starts on the device; what the bounds, the
                # tile and the pad give alone is made once (a content-dependent method has it)
                variants = case.variants_torch(args)
                static = C.flex_static_torch(case.mask, block, pad_to=args.flex_pad,
                                             device=ctx.dev)
            t = time.perf_counter()
            bm = convert(None if variants is None else variants[0])
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
        if variants is None:
            res["plan_ms"] = _request(convert, args, sync=_sync).ms
            res.update(_request(lambda: call(convert()), args, sync=_sync).to_json("request_"))
            bm = convert()
        else:
            rot = _Rotor(variants)
            res["plan_ms"] = _request(lambda: convert(rot.next()), args, sync=_sync).ms
            rot = _Rotor(variants)
            res.update(_request(lambda: call(convert(rot.next())), args,
                                sync=_sync).to_json("request_"))
            bm = convert(variants[0])
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
    # The request is timed on every row (each row's excess over cuDNN subtracts its own
    # draw: one draw per shape biased a whole shard, -0.03 against -0.59 ms on one H100);
    # the kernel, flushed and stable, once per shape.
    res.update(_request(lambda: jax.block_until_ready(jitted(case.qj, case.kj, case.vj)),
                        args).to_json("request_"))
    if key in ctx.dense_cache:
        res.update(ctx.dense_cache[key], kernel_cached_from_same_shape=True)
        return res
    t = _kernel(fn, ((case.qj, case.kj, case.vj),), args, "jax")
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


RUNNERS = {"tessera": lambda c, a, x: run_tessera_device(c, a) if c.source == "gpu" else
           run_tessera(c, a), "flashinfer_bsr": run_fi_bsr,
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


def first_plan_run(budget_s: float, cases=None) -> dict:
    """Issue 33's first plan of a fresh install, in this run: ``first_plan.py --fresh-install``
    (a fresh process and empty numba cache per corpus family and 8-token blocks, planning
    alone) as a subprocess; its summary, or the error."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "first_plan.json"
        cmd = [sys.executable, str(HERE / "first_plan.py"), "--fresh-install", "--cases",
               "--out", str(out)] + (["--fresh-cases", *cases] if cases else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
        except subprocess.TimeoutExpired:
            return {"command": " ".join(cmd), "error": f"over its {budget_s:.0f} s budget"}
        if p.returncode or not out.exists():
            return {"command": " ".join(cmd), "error": p.stderr[-2000:]}
        d = json.loads(out.read_text())
    return {"command": " ".join(cmd), "summary": d["summary"], "host": d.get("host")}


def with_first_plan(summary: dict, doc: dict) -> dict:
    """``summary`` with ``first_plan_fresh_install_max_s`` when this run measured it."""
    fp = (doc.get("first_plan") or {}).get("summary") or {}
    if "first_plan_fresh_install_max_s" in fp:
        summary["first_plan_fresh_install_max_s"] = fp["first_plan_fresh_install_max_s"]
    return summary


def doc_summary(doc: dict) -> dict:
    """A result document's ``summary``: its timed rows' (``summarize``) and this run's first
    plan of a fresh install (``with_first_plan``)."""
    return with_first_plan(summarize([r for r in doc["rows"] if "peers" in r]), doc)


def check_same_gpu(docs: dict, gpu) -> None:
    """A run resumed from earlier calls' rows (``--skip-from``: path -> its file, read) runs on
    their GPU: rows of two GPUs never share a file of record (an H100 file would leave the
    H200 run its masks)."""
    for p, d in docs.items():
        theirs = d.get("versions", {}).get("gpu")
        if theirs != gpu:
            raise SystemExit(f"--skip-from {p}: its rows ran on {theirs!r}, this run on "
                             f"{gpu!r}; resume only from the same GPU's files")


def merge_docs(paths, out: str, png: str | None = None) -> dict:
    """One result from several processes' files (e.g. one GPU per half of the families): rows
    concatenated (later files win on a repeated mask id), summary and figure recomputed; each
    part's command, versions and FlashInfer warm-up kept under ``parts``."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    rows = {}
    for d in docs:
        for r in d.get("rows", []):
            rows[(r.get("id", len(rows)), mask_source(r))] = r
    doc = dict(docs[0]) if docs else {}
    doc["rows"] = list(rows.values())
    doc["parts"] = [{k: d.get(k) for k in ("command", "date", "versions", "flashinfer_warmup",
                                            "elapsed_s", "sampling")} | {"file": str(p)}
                    for p, d in zip(paths, docs)]
    doc["command"] = " && ".join(str(d.get("command")) for d in docs)
    doc["elapsed_s"] = max((d.get("elapsed_s") or 0.0) for d in docs) if docs else 0.0
    ok = [r for r in doc["rows"] if "peers" in r]
    doc["first_plan"] = next((d["first_plan"] for d in docs if d.get("first_plan")), None)
    doc["summary"] = doc_summary(doc)
    png = png or str(Path(out).with_suffix(".png"))
    src = primary_source(ok)
    doc["figure"] = figure(ok, png, title=f"tessera_jax vs peers, "
                           f"{sum(mask_source(r) == src for r in ok)} test masks "
                           f"(masks start on the {'GPU' if src == 'gpu' else 'host'})")
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
    if args.shard:                  # one process per GPU over the same sample (same masks)
        specs = shard_specs(specs, *args.shard)
    sources = ["gpu", "host"] if args.mask_source == "both" else [args.mask_source]
    skipped = {f: json.loads(Path(f).read_text()) for f in args.skip_from or ()}
    if skipped:                     # a run cut by its budget: time only the masks it missed
        done = {(r["id"], mask_source(r)) for d in skipped.values() for r in d.get("rows", [])}
        specs = [s for s in specs if any((s["id"], src) not in done for src in sources)]
        log(f"--skip-from: {len(done)} rows already timed; {len(specs)} masks left")
    else:
        done = set()
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in RUNNERS:
            raise SystemExit(f"--peers: unknown peer {p!r}; known: {list(RUNNERS)}")
    log(f"{len(specs)} test-split masks sampled ({args.per_family}/family) from {avail}; "
        f"mask sources {sources}")
    doc = {"benchmark": "peers (issue 7; mask sources: issue 16)",
           "command": " ".join([sys.executable, *sys.argv]),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "config": vars(args), "versions": versions(ctx),
           "mask_sources": sources,
           "sampling": {"split": "test", "per_family": args.per_family,
                        "available_per_family": avail, "heads": args.heads or "all",
                        "note": "stratified by family; specs spread over grids; a head subset "
                                "(--heads) runs the first heads of each mask on every peer alike"},
           "timing": {"kernel": kernel_rule(args).to_json(),
                      "request": request_rule(args).to_json()},
           "rows": [], "notes": []}
    log("versions:", json.dumps(doc["versions"]))
    check_same_gpu(skipped, doc["versions"].get("gpu"))
    if args.first_plan:
        log("first plan of a fresh install (first_plan.py --fresh-install) ...")
        doc["first_plan"] = first_plan_run(args.first_plan)
        log("first plan:", json.dumps(doc["first_plan"].get("summary")
                                      or doc["first_plan"].get("error"))[:400])
    if not args.smoke and any(p.startswith("flashinfer") for p in peers):
        log("FlashInfer warm-up (JIT build of its prefill module on first use) ...")
        doc["flashinfer_warmup"] = fi_warmup(ctx, args)
        doc["flashinfer_warmup"]["curand_include_fallback"] = ctx.fi_env
        log("FlashInfer warm-up:", json.dumps(doc["flashinfer_warmup"], default=str)[:600])
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    png = args.figure or str(out_path.with_suffix(".png"))
    src0 = "gpu" if "gpu" in sources else "host"
    title = (f"tessera_jax vs peers per mask family "
             f"({doc['versions'].get('gpu') or 'CPU smoke'}; request latency, masks start on "
             f"the {'GPU' if src0 == 'gpu' else 'host'})")

    def save():
        ok = [r for r in doc["rows"] if "peers" in r]
        doc["summary"] = doc_summary(doc)
        out_path.write_text(json.dumps(doc, indent=1, default=str))   # partial results survive
        try:
            figure(ok, png, title=title)
        except Exception as e:  # noqa: BLE001
            log("figure failed:", _tail(e, 200))

    try:
        from tqdm import tqdm
        it = tqdm(specs, desc="masks", mininterval=5)
    except ImportError:
        it = specs
    for spec in it:
        if time.time() - T0 > args.time_budget - args.reserve:
            doc["notes"].append(f"time budget reached after {len(doc['rows'])} rows "
                                f"({len(specs)} masks sampled)")
            log(doc["notes"][-1])
            break
        base = row = case = None
        todo = [src for src in sources if (spec["id"], src) not in done]
        try:
            heads = min(args.heads, spec["heads"]) if args.heads else spec["heads"]
            t = time.perf_counter()
            mask = build(spec, heads=heads)
            build_s = time.perf_counter() - t
            Hq = heads
            Hkv = Hq // args.gqa if Hq % args.gqa == 0 else Hq
            base = mask_info(spec, mask, Hq, Hkv, args.head_dim)
            base["build_s"] = build_s
            case = Case(ctx, {**spec, "heads_run": Hq}, mask, Hkv, args)
            for i, src in enumerate(todo):
                if i and time.time() - T0 > args.time_budget - args.reserve / 2:
                    doc["notes"].append(f"time budget: mask {spec['id']} source {src} left "
                                        "for a --skip-from call")
                    log(doc["notes"][-1])
                    break
                row = dict(base, mask_source=src, peers={})
                doc["rows"].append(row)
                case.source = src
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
                log(f"{spec['family']:11s} {spec['grid']:10s} {src:4s} L={mask.Lq} H={Hq} "
                    f"d={mask.density:.3f} " +
                    " ".join(f"{p}={row['peers'][p].get('request_ms') or row['peers'][p].get('status')}"
                             if not isinstance(row['peers'][p].get('request_ms'), float) else
                             f"{p}={row['peers'][p]['request_ms']:.2f}ms" for p in peers) +
                    "  speedup " + " ".join(f"{k}={v:.2f}" for k, v in sp.items()))
                save()
                row = None
        except Exception as e:  # noqa: BLE001
            if row is None:
                row = dict(base or {"id": spec.get("id"), "family": spec.get("family"),
                                    "grid": spec.get("grid")},
                           mask_source=todo[0] if todo else sources[0])
                doc["rows"].append(row)
            row["error"] = _tail(e)
            log("mask failed:", row["error"][:300])
        finally:
            if case is not None:
                case.free()
            del case
            gc.collect()
            if not args.smoke:
                ctx.torch.cuda.empty_cache()
        save()
    doc["summary"] = doc_summary(doc)
    doc["elapsed_s"] = time.time() - T0
    doc["figure"] = figure([r for r in doc["rows"] if "peers" in r], png, title=title)
    out_path.write_text(json.dumps(doc, indent=1, default=str))
    s = doc["summary"]
    log(f"wrote {out_path} and {png}: masks={s['masks']} (start on the {s['mask_source']}) "
        f"min_vs_best_alt={s['min_speedup_vs_best_alternative']} "
        f"median_vs_fi={s['median_speedup_vs_flashinfer']} "
        f"median_vs_flex={s['median_speedup_vs_flex']} "
        f"median_request_overhead_ms={s['median_request_overhead_ms']}")
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
    for i, (fam, grid, mask, gqa) in enumerate(dry_masks(args.seed)):
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
        if _dry_device_wanted(args.dry_device, fam, mask):
            row["tessera_device"] = dry_device({"id": f"dry-{i}", "family": fam, "grid": grid},
                                               mask, Hq, Hkv, args)
        rows.append(row)
    dev_rows = [{"id": f"dry-{i}", "family": r["family"], "mask_source": "gpu",
                 "peers": {"tessera": r["tessera_device"]}}
                for i, r in enumerate(rows) if "tessera_device" in r]
    dev_bad = sum(1 for r in dev_rows if r["peers"]["tessera"].get("status") not in OK_STATES)
    n_bad = sum(1 for r in rows for k, x in r["exact"].items() if x is False)
    n_bad += sum(1 for r in rows for k in ("flex_tiles_match", "flex_cpu_ok",
                                           "flex_torch_conversion_matches")
                 if r.get("torch", {}).get(k) is False)
    doc = {"benchmark": "peers --dry-run (CPU: conversions; tessera_jax's device route)",
           "torch": have_torch, "rows": rows, "inexact_conversions": n_bad,
           "device_masks": len(dev_rows), "device_failures": dev_bad,
           "device_summary": summarize(dev_rows),
           "summary": summarize([])}
    return doc


def _dry_device_wanted(which: str, family: str, mask) -> bool:
    if which in ("all", "none"):
        return which == "all"
    return mask.Lq <= 256 and (which == "tiny" or family in which.split(","))


def dry_device(spec: dict, mask, Hq: int, Hkv: int, args) -> dict:
    """CPU: ``run_tessera_device`` end to end on a tiny mask (XLA backend; jax inputs, no
    torch): new device masks, the jitted device-route call checked against the reference,
    its request, kernel and device-plan timings (host clock off the GPU)."""
    case = DryCase(spec, mask, Hq, Hkv, args)
    case.source = "gpu"
    t = time.perf_counter()
    try:
        res = run_tessera_device(case, args)
    except Exception as e:  # noqa: BLE001
        res = {"status": "failed", "why": _tail(e)}
    res["wall_s"] = time.perf_counter() - t
    case.free()
    return res


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard wants K/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N, got {text!r}")
    return k, n


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None,
                    help="results JSON (default /tmp/h200-peers.json; none in --dry-run; the "
                         "official file: benchmarks/results/h200-peers.json)")
    ap.add_argument("--figure", default=None, help="PNG (default: --out with .png)")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--reserve", type=float, default=45.0,
                    help="seconds kept free at the end of the budget (no mask starts after)")
    ap.add_argument("--diagnostic-budget", type=float, default=20.0,
                    help="seconds a diagnostic time outside the summary (our host plan_ms) may "
                         "take: fewer calls (>= 2) where the request rule's would take longer")
    ap.add_argument("--per-family", type=int, default=3)
    ap.add_argument("--families", type=lambda s: s.split(","), default=None)
    ap.add_argument("--grids", type=lambda s: s.split(","), default=None)
    ap.add_argument("--heads", type=int, default=None, help="first N heads of each mask (all: none)")
    ap.add_argument("--gqa", type=int, default=1, help="query heads per KV head (corpus models: 1)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--iters", type=int, default=20,
                    help="kernel timing runs (median; >= 20, timing.DEVICE_MIN_REPEATS)")
    ap.add_argument("--request-iters", type=int, default=timing.REQUEST_RULE.repeats,
                    help="request timing runs (median)")
    ap.add_argument("--check-rows", type=int, default=2048)
    ap.add_argument("--check-kv-heads", type=int, default=2)
    ap.add_argument("--fi-backend", default="auto", choices=("auto", "fa2", "fa3"))
    ap.add_argument("--fi-var-device", default="cuda", choices=("cuda", "cpu"),
                    help="where the variable-block wrapper's mask tensors are handed to plan()")
    ap.add_argument("--flex-blocks", default="128x128,128x64,64x128,64x64",
                    help="FlexAttention tiles tried (largest first)")
    ap.add_argument("--flex-pad", type=int, default=1024,
                    help="FlexAttention sequences padded to a multiple of this (compile reuse)")
    ap.add_argument("--mask-source", default="host", choices=("host", "gpu", "both"),
                    help="where a request's mask starts: host (NumPy mask, every cache cleared "
                         "per request: the issue-7 runs), gpu (a new mask per request, already "
                         "on the device: issue 16), both (one row per source and mask; the "
                         "summary headline is gpu's, by_mask_source has both)")
    ap.add_argument("--mask-variants", type=int, default=None,
                    help="new masks per case for --mask-source gpu (default: the request "
                         "rule's warm-up + timed calls, so no request repeats a mask)")
    ap.add_argument("--variant-kind", default="perturb", choices=C.VARIANT_KINDS,
                    help="how the new masks are made (peers_lib.convert.mask_variants)")
    ap.add_argument("--dry-device", default="tiny", metavar="WHICH",
                    help="--dry-run: the dry masks that also run tessera_jax's device route "
                         "end to end (mask source gpu, XLA on CPU): tiny (<= 256 queries: every "
                         "family once, the random masks), all, none, or dry families "
                         "(comma-separated: their masks of <= 256 queries)")
    ap.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                    help="time only shard K of N of the sample (drawn as without it, so "
                         "--families picks the same masks; shards balanced by mask size: "
                         "shard_specs), e.g. one process per GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device-alt", action="store_true",
                    help="gpu rows: also time every template the device route may run, named "
                         "(device_alt; ~15 s a template and mask)")
    ap.add_argument("--gather-alt", action=argparse.BooleanOptionalAction, default=True,
                    help="gpu rows on irregular key blocks: also time the device route with "
                         "Options.device_gather on, static and traced bounds (gather_alt)")
    ap.add_argument("--tiered-bounds", default="auto", choices=("auto", "new", "same"),
                    help="host rows: what tj.precompile compiled before the requests: the "
                         "traced route only (new: new bounds each request) or also the row's "
                         "bounds' static route (same: same bounds, new blocks); auto: same "
                         "where the family's bounds do not depend on the content "
                         "(tiered_bounds())")
    ap.add_argument("--tiered", action=argparse.BooleanOptionalAction, default=True,
                    help="host rows: also time tessera_jax's request under "
                         "Options(host_planning='sync') and 'tiered' (sync_request_ms, "
                         "tiered_request_ms)")
    ap.add_argument("--first-plan", type=float, default=0.0, metavar="SECONDS",
                    help="also measure issue 33's first plan of a fresh install in this run "
                         "(summary.first_plan_fresh_install_max_s), within SECONDS; 0: not")
    ap.add_argument("--skip-from", nargs="+", default=None, metavar="JSON",
                    help="skip the (mask, source) rows these earlier result files hold")
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
    if a.mask_variants is not None and a.mask_variants < 1:
        ap.error("--mask-variants must be >= 1")
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
        log(f"merged {len(argv) - 3} files: masks={s['masks']} (start on the "
            f"{s['mask_source']}) min_vs_best_alt={s['min_speedup_vs_best_alternative']} "
            f"median_vs_fi={s['median_speedup_vs_flashinfer']} "
            f"median_vs_flex={s['median_speedup_vs_flex']} "
            f"median_request_overhead_ms={s['median_request_overhead_ms']}")
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
            d = r.get("tessera_device")
            if d is not None:
                print(f"{'':22s} tessera device route: {d.get('status')} "
                      f"template={d.get('device_template')} "
                      + (f"request={d['request_ms']:.2f}ms kernel={d['kernel_ms']:.2f}ms "
                         f"plan={d.get('device_plan_ms', float('nan')):.2f}ms ({d['kernel_timer']})"
                         if d.get("request_ms") is not None else str(d.get("why", ""))[:300]))
        print(f"inexact conversions: {doc['inexact_conversions']} (torch available: {doc['torch']}); "
              f"tessera device route: {doc['device_failures']} of {doc['device_masks']} masks failed")
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
        return 1 if doc["inexact_conversions"] or doc["device_failures"] else 0
    if args.fi_warmup_only:
        t = time.perf_counter()
        res = fi_warmup(Ctx(args), args)
        log("FlashInfer warm-up only:", json.dumps(res, default=str)[:600],
            f"({time.perf_counter() - t:.1f} s)")
        return 0 if not any(k.endswith("error") for k in res) else 1
    if args.out is None:
        args.out = "/tmp/peers-smoke.json" if args.smoke else "/tmp/h200-peers.json"
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
