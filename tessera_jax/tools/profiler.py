"""Offline profiler: times every candidate plan on the training masks and fits the ranking table.

    python -m tessera_jax.tools.profiler --gpu h200 --out plan_tables/h200.json \\
        [--raw DIR] [--max-masks N] [--heads K] [--families sta vsa ...] [--time-budget S]
    python -m tessera_jax.tools.profiler --gpu h200 --out plan_tables/h200.json --fit-only
    python -m tessera_jax.tools.profiler --tiny --out /tmp/cpu.json      # CPU smoke run, XLA templates

Masks come from the corpus TRAIN split only (``tessera_jax.masks.corpus("train")``; the test
split is never read here). With ``--max-masks N`` each family contributes its first
ceil(N / families) specs in spec-id order (ids are SHA-256 prefixes: a fixed pseudo-random
sample), measured round-robin over families so that a run cut short stays balanced; ``--heads K`` profiles the first K heads of each mask
(``masks.build(spec, heads=K)``; shared masks stay shared and are broadcast to the call's K
query heads). The
sampling is written into the table's provenance.

Candidates are (template x policy): every template of the GPU backend ``sparse_attention``
resolves to here (``mosaic_gpu`` on Hopper, else ``triton``; ``--backends mosaic_gpu triton``
adds the other: ``select`` ranks within the backend of the call, so Triton candidates only
matter to calls that ask for that backend) x ``--policies`` (default keep, merge, split, auto);
on CPU (``--tiny``) the given XLA templates. Each (mask, candidate) is planned with ``tessera_jax.plan``
(what ``sparse_attention`` runs), its ABI arrays padded to power-of-two capacities (so masks
of one grid share compiled executables: compiling per mask would cost more GPU time than the
timing itself; padding units select nothing and return at once), run on random inputs (B=1,
bf16, head_dim 128 by default), and timed under the benchmarks' kernel rule
(``tessera_jax.tools.timing.KERNEL_RULE``: ``--warmup`` (3) calls, then the median of ``--iters``
(20) calls' CUPTI kernel time, the L2 flushed before each); on CPU, host wall clock around
``block_until_ready``. Each time record names its rule; a resumed run re-measures the pairs
recorded under another rule (or before rules were recorded), and the fit uses a mask only when
all its candidates' records share one rule (a run cut mid-mask leaves that mask out).

Each time record also carries ``plan_digest`` (``plan_digest``: SHA-256 of the plan's real unit
and step rows, bitmap words included) and the plan's ``bitmap_steps``. ``--remeasure-stale``
plans every recorded pair again on the host and re-times those whose record names no digest or
another one (the planner changed since: e.g. bitmap steps); the others are kept. The fit reads
the newest record of each (mask, candidate): the last line of the raw file (records are appended
in the order they are measured).

Raw timings go to ``<raw>/<gpu>.jsonl`` (one JSON object per line: ``"kind": "mask"`` records
with features and spec, ``"kind": "time"`` records per (mask, candidate)), appended as they are
measured; a rerun skips the (mask, candidate) pairs already there (``--retry-errors``: except
failed ones; ``--remeasure-stale``: except those whose plan changed), so the profile can be
spread over several shorter GPU runs. ``--families tokens`` profiles one family only; the fit
still uses every complete mask of the raw file. A run stops after
``--max-error-streak`` (``MAX_ERROR_STREAK``) failures in a row (a broken device would otherwise fail every pair). At
the end (or with ``--fit-only``) the ranking is fitted on every mask whose candidates were all
attempted (``selection.fit_table``) and written to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

from tessera_jax.select import features as _features
from tessera_jax.select import ranking as _selection

# keep is left out: merge never has more units or steps than keep (tests/test_planner.py).
DEFAULT_POLICIES = ("merge", "split", "pack", "auto")
TINY_TEMPLATES = ("xla_64x64", "xla_128x128")
#: Consecutive failed timings after which a run stops (a broken device fails everything).
MAX_ERROR_STREAK = 8

#: Tiny masks for CPU runs and tests (not corpus masks): 240-token grid, 2 heads.
TINY_SPECS = (
    {"id": "tiny-sta", "family": "sta", "grid": "tiny", "heads": 2, "seed": 0, "step": 0,
     "text": 0, "params": {"tile": [2, 3, 4], "window": [1, 3, 1]}, "split": "train"},
    {"id": "tiny-vsa", "family": "vsa", "grid": "tiny", "heads": 2, "seed": 1, "step": 0,
     "text": 0, "params": {"sparsity": 0.5, "cube": [2, 2, 2]}, "split": "train"},
    {"id": "tiny-ditfa", "family": "ditfastattn", "grid": "tiny", "heads": 2, "seed": 0,
     "step": 0, "text": 0, "params": {"window_frac": 0.25, "block": 32}, "split": "test"},
    {"id": "tiny-natten", "family": "natten", "grid": "tiny", "heads": 2, "seed": 0, "step": 0,
     "text": 0, "params": {"window": [3, 3, 3], "stride": "tile", "tile": [2, 2, 4]},
     "split": "test"},
)


def log(msg: str) -> None:
    print(f"[profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- masks ----------------------------------------------------------------------------------
def spec_group(spec: dict) -> str:
    """A short label shared by the steps of one drifting sequence (never split apart)."""
    from tessera_jax.masks import group_key
    return hashlib.sha256(group_key(spec).encode()).hexdigest()[:12]


def select_specs(split: str, *, tiny: bool = False, families=None, max_masks=None):
    """(specs, sampling): the split's specs, sampled per family, and a description of how."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if tiny:
        pool = [dict(s) for s in TINY_SPECS if s["split"] == split]
        source = "tiny CPU specs (profile.TINY_SPECS), not the corpus"
    else:
        from tessera_jax.masks import corpus
        pool = corpus(split)
        source = f"tessera_jax.masks.corpus({split!r})"
    if families:
        unknown = sorted(set(families) - {s["family"] for s in pool})
        if unknown and not tiny:
            raise ValueError(f"families {unknown} have no {split} specs")
        pool = [s for s in pool if s["family"] in set(families)]
    by_fam: dict[str, list] = {}
    for s in sorted(pool, key=lambda s: s["id"]):
        by_fam.setdefault(s["family"], []).append(s)
    quota = None
    if max_masks is not None:
        if max_masks < 1:
            raise ValueError(f"max_masks must be >= 1, got {max_masks}")
        quota = math.ceil(max_masks / max(len(by_fam), 1))
    takes, per_family = {}, {}
    for fam in sorted(by_fam):
        takes[fam] = by_fam[fam] if quota is None else by_fam[fam][:quota]
        per_family[fam] = {"sampled": len(takes[fam]), "available": len(by_fam[fam])}
    # Round-robin over families, so that a run cut short by its time budget is balanced.
    chosen = [t[i] for i in range(max((len(t) for t in takes.values()), default=0))
              for t in takes.values() if i < len(t)]
    sampling = {
        "source": source, "split": split, "max_masks": max_masks,
        "rule": ("all specs" if quota is None else
                 f"per family, the first {quota} specs in spec-id (SHA-256) order")
                + "; measured round-robin over families",
        "per_family": per_family, "masks": len(chosen),
    }
    return chosen, sampling


def build_mask(spec: dict, heads: int | None):
    from tessera_jax.masks import build
    h = None if heads is None else min(int(heads), int(spec["heads"]))
    return build(spec, heads=h)


# --- candidates -------------------------------------------------------------------------------
def candidate_list(backends_=None, templates=None, policies=DEFAULT_POLICIES):
    """[(template, policy)]: the given templates, or every template of the given backends."""
    from tessera_jax.runtime import dispatch as backends
    from tessera_jax.planning.planner import POLICIES
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {p!r}")
    if templates:
        names = [backends.get_template(t).name for t in templates]
    else:
        names = [t.name for b in backends_ for t in backends.templates(b)]
    if not names:
        raise ValueError("no templates to profile (no GPU backend here? use --tiny on CPU)")
    return [(t, p) for t in names for p in policies]


def parse_candidates(items) -> list[tuple[str, str]]:
    """["template/policy", ...] -> [(template, policy)], checked against the registries."""
    from tessera_jax.runtime import dispatch as backends
    from tessera_jax.planning.planner import POLICIES
    out = []
    for it in items:
        template, sep, policy = str(it).partition("/")
        if not sep or not template or not policy:
            raise ValueError(f"candidates: expected TEMPLATE/POLICY, got {it!r}")
        if policy not in POLICIES:
            raise ValueError(f"candidates: policy must be one of {POLICIES}, got {policy!r}")
        c = (backends.get_template(template).name, policy)
        if c not in out:
            out.append(c)
    return out


def cand_key(template: str, policy: str) -> str:
    return f"{template}/{policy}"


# --- timing -----------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def padded_arrays(plan):
    """The plan's ABI arrays with capacities rounded up to powers of two (row sentinel moved)."""
    U, S = plan.units.shape[0], plan.steps.shape[0]
    U2, S2 = _pow2(U), _pow2(S)
    units = np.zeros((U2, plan.units.shape[1]), np.int32)
    units[:U] = plan.units
    steps = np.zeros((S2, plan.steps.shape[1]), np.int32)
    steps[:S] = plan.steps
    ri = np.where(plan.row_index == U * plan.tile_q, U2 * plan.tile_q, plan.row_index)
    return units, steps, ri.astype(np.int32), _pow2(plan.max_steps)


@functools.lru_cache(maxsize=None)
def _executor(template, tile_q, tile_kv, qp, kvp, max_steps, scale):
    """A jitted call of the template's backend taking the plan arrays as operands."""
    import jax

    from tessera_jax.runtime import dispatch as backends

    from pallas_kernels.abi import PassPlan

    def run(q, k, v, units, steps, row_index):
        p = PassPlan(units, steps, row_index, tile_q, tile_kv, qp, kvp, max_steps)
        return backends.forward(p, backends.get_template(template), q, k, v, scale, False)
    return jax.jit(run)


def timing_rule(warmup: int | None = None, iters: int | None = None, gpu: bool | None = None):
    """The profile's rule: the benchmarks' kernel rule on GPU (``None``: its warm-up and
    repeats), host wall clock elsewhere (CPU smoke runs). ``gpu``: force one (None: this host)."""
    import jax

    from tessera_jax.tools import timing
    base = timing.KERNEL_RULE
    warmup = base.warmup if warmup is None else max(int(warmup), 1)   # compile outside
    iters = base.repeats if iters is None else int(iters)
    if gpu if gpu is not None else jax.default_backend() == "gpu":
        return base.replace(warmup=warmup, repeats=iters)
    return timing.wall_rule(iters, warmup)


def time_fn(fn, args, *, warmup: int | None, iters: int | None):
    """``fn(*args)`` timed under ``timing_rule(warmup, iters)`` (a ``timing.Timing``)."""
    from tessera_jax.tools import timing
    return timing.time_kernel(fn, [args], rule=timing_rule(warmup, iters), framework="jax")


class Inputs:
    """Random q, k, v (never zeros) for one call shape, reused across candidates."""

    def __init__(self, dtype, head_dim, seed=0):
        self.dtype, self.head_dim, self.seed = dtype, head_dim, seed
        self._key, self._val = None, None

    def get(self, Lq, Lkv, Hq):
        import jax
        key = (Lq, Lkv, Hq)
        if key != self._key:
            self._val = None
            k1, k2, k3 = jax.random.split(jax.random.PRNGKey(self.seed), 3)
            D = self.head_dim
            self._val = tuple(jax.random.normal(kk, (1, L, Hq, D), self.dtype)
                              for kk, L in ((k1, Lq), (k2, Lkv), (k3, Lkv)))
            self._key = key
        return self._val


def plan_digest(plan) -> str:
    """16 hex digits of SHA-256 over what a timing runs: template, tiles, padded lengths, the real
    unit rows and the step rows with their bitmap words (~0.2 s per 170 MB of steps)."""
    h = hashlib.sha256()
    head = [plan.template, plan.tile_q, plan.tile_kv, plan.q_len_padded, plan.kv_len_padded,
            plan.num_units, plan.num_steps, int(getattr(plan, "bitmap_rows", 0)), plan.max_steps]
    h.update(json.dumps(head).encode())
    h.update(np.ascontiguousarray(plan.units[:plan.num_units]))
    h.update(np.ascontiguousarray(plan.steps[:plan.num_steps + head[7]]))
    return h.hexdigest()[:16]


def plan_summary(plan) -> dict:
    """The plan figures a time record keeps, as ``Plan.stats()`` counts them but without its
    tile classification (tens of seconds on token-level plans of 100k+ bitmap steps)."""
    from tessera_jax.planning.schedule import makespan
    r = plan.tile_rects()
    full = ((r["r0"] == r["q0"]) & (r["r1"] == r["q1"]) & (r["c0"] == r["k0"])
            & (r["c1"] == r["k1"]) & (r["cuts_b"] == 0))
    tiles = int(plan.step_counts().astype(np.int64).sum())
    computed = tiles * plan.tile_q * plan.tile_kv
    cost = plan.unit_cost if plan.unit_cost is not None else np.zeros(plan.num_units)
    return {"units": int(plan.num_units), "tiles": tiles, "partial_tiles": tiles - int(full.sum()),
            "waste_fraction": float(1.0 - plan.selected_interactions / computed) if computed
            else 0.0,
            "est_time_us": makespan(cost, plan.cost_model.num_sms) / 1e3,
            "bitmap_steps": int(r["bitmap"].sum())}


def plan_candidate(mask, template: str, policy: str, inputs: Inputs,
                   num_heads: int | None = None):
    """(plan, planning ms) of one candidate on one mask, as ``sparse_attention`` would plan it."""
    from tessera_jax.runtime.api import plan as make_plan
    q, k, _ = inputs.get(mask.Lq, mask.Lkv, num_heads or mask.num_heads)
    t0 = time.perf_counter()
    p = make_plan(mask, q.shape, k.shape, q.dtype, template=template, policy=policy)
    return p, (time.perf_counter() - t0) * 1e3


def time_candidate(mask, template: str, policy: str, inputs: Inputs, *, warmup: int | None,
                   iters: int | None, num_heads: int | None = None, planned=None) -> dict:
    """Plans and times one candidate on one mask (``num_heads`` query heads, default the
    mask's; ``planned``: ``plan_candidate``'s result, not planned again); a raw file dict."""
    import jax

    q, k, v = inputs.get(mask.Lq, mask.Lkv, num_heads or mask.num_heads)
    p, plan_ms = planned or plan_candidate(mask, template, policy, inputs, num_heads)
    digest = plan_digest(p)
    units, steps, ri, ms_cap = padded_arrays(p)
    fn = _executor(p.template, p.tile_q, p.tile_kv, p.q_len_padded, p.kv_len_padded, ms_cap,
                   float(q.shape[-1]) ** -0.5)
    args = (q, k, v) + tuple(jax.device_put(a) for a in (units, steps, ri))
    t1 = time.perf_counter()
    t = time_fn(fn, args, warmup=warmup, iters=iters)
    return {"ms": t.ms, "samples": [round(x, 5) for x in t.samples], "timer": t.timer,
            "rule": t.rule.name, "plan_digest": digest,
            "plan_ms": round(plan_ms, 3), "wall_s": round(time.perf_counter() - t1, 3),
            "plan": plan_summary(p),
            "capacities": [int(units.shape[0]), int(steps.shape[0]), int(ms_cap)]}


def call_heads(spec: dict, heads: int | None) -> int:
    """Query heads of the profiled call: the first ``heads`` of the spec's (all if None); a
    shared mask is broadcast to them."""
    return int(spec["heads"]) if heads is None else min(int(heads), int(spec["heads"]))


def call_shape(mask, dtype, head_dim, num_heads: int | None = None):
    from tessera_jax.validation import check_shapes
    H = num_heads or mask.num_heads
    return check_shapes((1, mask.Lq, H, head_dim), (1, mask.Lkv, H, head_dim), dtype)


# --- raw file ---------------------------------------------------------------------------------
def read_raw(path) -> tuple[dict, dict]:
    """(mask records by id, time records by (id, candidate key)); unreadable lines skipped. A pair
    timed more than once keeps its newest record: the last line (the file is append-only)."""
    masks, times = {}, {}
    p = pathlib.Path(path)
    if not p.is_file():
        return masks, times
    with open(p) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue            # a line cut by a killed run: measured again on resume
            if r.get("kind") == "mask":
                masks[r["id"]] = r
            elif r.get("kind") == "time":
                times[(r["id"], r["candidate"])] = r
    return masks, times


def _append(path, rec):
    with open(path, "a") as f:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()


def needs_timing(rec, rule: str, retry_errors: bool = False) -> bool:
    """Whether a pair whose newest record is ``rec`` (None: never timed) must be timed whatever
    its plan: no record, an ok time under another rule, or an error with ``retry_errors``."""
    if rec is None:
        return True
    if rec.get("status") == "ok":
        return rec.get("rule") != rule
    return bool(retry_errors)


def is_stale(rec, digest: str) -> bool:
    """Whether a record was taken on another plan than ``digest`` (or names none: before
    digests were recorded, when the plan cannot be told)."""
    return rec.get("plan_digest") != digest


# --- environment / provenance -----------------------------------------------------------------
def device_info(gpu: str | None) -> dict:
    import jax
    d = jax.devices()[0]
    kind = str(getattr(d, "device_kind", d.platform))
    cc = getattr(d, "compute_capability", None)
    name = gpu or (_selection.gpu_name(kind) if d.platform != "cpu" else "cpu")
    return {"name": name, "device_kind": kind, "platform": d.platform,
            "compute_capability": None if cc is None else str(cc),
            "arch": _selection.gpu_arch(name, cc)}


def versions() -> dict:
    import jax
    import jaxlib
    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
           "python": platform.python_version()}
    try:
        from tessera_jax import __version__
        out["tessera_jax"] = __version__
    except ImportError:  # pragma: no cover
        pass
    out["git"] = code_revision(pathlib.Path(__file__).resolve().parent.parent)
    return out


def code_revision(root: pathlib.Path) -> str | None:
    """The commit of the code under ``root``: git's HEAD when ``root`` is the top of a git
    checkout; else the ``.snap_rev`` file a `git archive` snapshot carries (the device runs: a
    git lookup from a snapshot inside another checkout finds that checkout's HEAD); else None."""
    root = pathlib.Path(root).resolve()
    try:
        r = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=5, cwd=root)
        lines = r.stdout.split()
        if r.returncode == 0 and len(lines) == 2 and pathlib.Path(lines[0]).resolve() == root:
            return lines[1]
    except Exception:  # noqa: BLE001
        pass
    snap = root / ".snap_rev"
    return snap.read_text().strip() if snap.is_file() else None


def corpus_digest(tiny: bool) -> str:
    if tiny:
        return "tiny:" + hashlib.sha256(json.dumps(TINY_SPECS, sort_keys=True).encode()).hexdigest()
    from tessera_jax.masks import corpus_digest as cd
    return cd()


# --- fitting ----------------------------------------------------------------------------------
def fit_from_raw(raw_path, candidates=None, *, gpu: dict, provenance: dict) -> dict:
    """Fits the table from the raw file (masks whose listed candidates were all attempted)."""
    masks, times = read_raw(raw_path)
    if candidates is None:
        seen = []
        for (_, ck), r in times.items():
            c = (r["template"], r["policy"])
            if c not in seen:
                seen.append(c)
        candidates = seen
    keys = [cand_key(*c) for c in candidates]
    X, T, G, used = [], [], [], []
    incomplete = mixed = 0
    rules: dict[str, int] = {}
    for mid, m in masks.items():
        recs = [times.get((mid, ck)) for ck in keys]
        if any(r is None for r in recs):
            incomplete += 1
            continue
        mask_rules = {r.get("rule") for r in recs if r.get("status") == "ok"}
        if len(mask_rules) > 1:     # relative times within a mask must share one rule
            mixed += 1
            continue
        rule = next(iter(mask_rules), None) or "none recorded"
        rules[rule] = rules.get(rule, 0) + 1
        if list(m.get("feature_names", [])) == list(_features.FEATURE_NAMES):
            x = m["features"]
        else:   # features changed since the run: recompute from the spec
            mask = build_mask(m["spec"], m.get("heads"))
            shape = call_shape(mask, m["dtype"], m["head_dim"],
                               m.get("call_heads") or call_heads(m["spec"], m.get("heads")))
            x = list(_features.feature_vector(mask, shape))
        X.append(x)
        T.append([r["ms"] if r.get("status") == "ok" else np.nan for r in recs])
        G.append(m.get("group", mid))
        used.append(mid)
    prov = dict(provenance)
    prov["fit"] = {"masks_used": len(used), "masks_incomplete": incomplete,
                   "masks_mixed_rules": mixed, "masks_by_rule": rules,
                   "raw_file": str(raw_path), "timings": len(used) * len(keys)}
    X = np.asarray(X, np.float64).reshape(len(used), len(_features.FEATURE_NAMES))
    T = np.asarray(T, np.float64).reshape(len(used), len(keys))
    return _selection.fit_table(X, T, candidates, groups=G, gpu=gpu, provenance=prov)


def write_table(path, data: dict) -> None:
    """Writes a table (validated first): indented JSON, one line per vector and training point."""
    _selection.validate_table(data)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compact = lambda x: json.dumps(x, separators=(",", ":"))  # noqa: E731
    head = {k: v for k, v in data.items() if k != "model"}
    text = json.dumps(head, indent=1)[:-2]          # drop the closing "\n}"
    m = data["model"]
    lines = [f'  "{k}": {compact(m[k])}' for k in m if k not in ("points", "rel_log_time")]
    for k in ("points", "rel_log_time"):
        rows = ",\n".join("   " + compact(r) for r in m[k])
        lines.append(f'  "{k}": [\n{rows}\n  ]' if m[k] else f'  "{k}": []')
    text += ',\n "model": {\n' + ",\n".join(lines) + "\n }\n}\n"
    json.loads(text)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- main -------------------------------------------------------------------------------------
def _progress(total, desc):
    try:
        from tqdm.auto import tqdm
        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=2.0)
    except ImportError:  # pragma: no cover
        class _P:
            def update(self, n=1): pass
            def set_postfix_str(self, s): pass
            def close(self): pass
        return _P()


def _template(text: str) -> str:
    """--templates item: a template the backends' registries know."""
    from tessera_jax.runtime import dispatch as backends
    try:
        return backends.get_template(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _candidate(text: str) -> str:
    """--candidates item: TEMPLATE/POLICY, a known template and policy."""
    from tessera_jax.planning.planner import POLICIES
    template, sep, policy = text.partition("/")
    if not sep or not template or policy not in POLICIES:
        raise argparse.ArgumentTypeError(f"expected TEMPLATE/POLICY with POLICY one of "
                                         f"{', '.join(POLICIES)}, got {text!r}")
    _template(template)
    return text


def parser():
    """The profiler's options (building it plans and times nothing)."""
    from tessera_jax.masks.corpus import FAMILIES
    from tessera_jax.planning.planner import POLICIES
    from tessera_jax.runtime.dispatch import BACKENDS
    from tessera_jax.tools import cli, timing
    ap = cli.Parser("tessera_jax.tools.profiler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", help="table name (default: from the device kind, e.g. h200)")
    ap.add_argument("--out", help="table path (default plan_tables/<gpu>.json)")
    ap.add_argument("--raw", help="directory of raw timings (default plan_tables/raw)")
    ap.add_argument("--max-masks", type=cli.positive_int,
                    help="sample at most ~N masks (per family quota)")
    ap.add_argument("--heads", type=cli.nonnegative_int, default=4,
                    help="profile the first K heads (default 4; 0: all heads)")
    ap.add_argument("--families", nargs="+", choices=sorted(FAMILIES), metavar="FAMILY",
                    help="only these mask families (of: %(choices)s)")
    ap.add_argument("--time-budget", type=cli.nonnegative_float,
                    help="stop measuring after S seconds, then fit (0: fit what the raw file has)")
    ap.add_argument("--max-error-streak", type=cli.positive_int, default=MAX_ERROR_STREAK,
                    help=f"stop after N failed timings in a row (default {MAX_ERROR_STREAK})")
    ap.add_argument("--fit-only", action="store_true", help="refit the table from the raw file")
    ap.add_argument("--retry-errors", action="store_true", help="measure again the (mask, "
                    "candidate) pairs whose raw record is an error")
    ap.add_argument("--remeasure-stale", action="store_true", help="plan every recorded pair "
                    "again and re-time those whose record has no plan digest or another one")
    ap.add_argument("--dry-run", action="store_true", help="time nothing, write nothing: plan "
                    "every pair on this host and print how many a run would time (under the "
                    "GPU rule unless --tiny), with bitmap-step counts; no table")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny masks, XLA templates")
    ap.add_argument("--backends", nargs="+", choices=tuple(BACKENDS),
                    help="backends whose templates are candidates (default: the first "
                    "available of mosaic_gpu, triton; e.g. --backends mosaic_gpu triton for both)")
    ap.add_argument("--templates", nargs="+", type=_template,
                    help="explicit template names (overrides --backends)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(DEFAULT_POLICIES),
                    help="planner policies of the candidates (default: "
                    f"{' '.join(DEFAULT_POLICIES)}; --tiny: merge)")
    ap.add_argument("--candidates", nargs="+", metavar="TEMPLATE/POLICY", type=_candidate,
                    help="explicit candidates (overrides --templates/--policies/--backends)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="q, k, v dtype of the timed calls (default bfloat16)")
    ap.add_argument("--head-dim", type=cli.positive_int, default=128,
                    help="head dimension of the timed calls (default 128)")
    timing.add_rule_arguments(ap)
    ap.add_argument("--compilation-cache", help="jax persistent compilation cache directory "
                    "(executables survive between runs on one machine)")
    return ap


def parse_args(argv=None):
    return parser().parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    from tessera_jax.runtime import dispatch as backends
    if a.compilation_cache:
        from tessera_jax.runtime.api import enable_compilation_cache
        enable_compilation_cache(a.compilation_cache)
    dev = device_info(a.gpu)
    gpu = dev["name"]
    out = pathlib.Path(a.out or _selection.table_dir() / f"{gpu}.json")
    raw_dir = pathlib.Path(a.raw) if a.raw else _selection.table_dir() / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    raw_path = raw_dir / f"{gpu}.jsonl"
    heads = None if not a.heads else a.heads
    if a.candidates:
        cands = parse_candidates(a.candidates)
    elif a.tiny:
        templates = a.templates or list(TINY_TEMPLATES)
        policies = a.policies if a.policies != list(DEFAULT_POLICIES) else ["merge"]
        cands = candidate_list(templates=templates, policies=policies)
    elif a.templates:
        cands = candidate_list(templates=a.templates, policies=a.policies)
    else:
        # Default: the backend sparse_attention resolves to here (selection ranks within it).
        bes = a.backends or [b for b in ("mosaic_gpu", "triton") if backends.is_available(b)][:1]
        cands = candidate_list(backends_=bes, policies=a.policies) if bes else []
        if not cands and not a.fit_only:
            raise SystemExit("no GPU backend available here; use --tiny on CPU or --templates")
    specs, sampling = select_specs("train", tiny=a.tiny, families=a.families,
                                   max_masks=a.max_masks)
    sampling["heads"] = "all" if heads is None else f"first {heads} (shared masks stay shared)"
    provenance = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(), "corpus_digest": corpus_digest(a.tiny), "split": "train",
        "sampling": sampling, "dtype": a.dtype, "head_dim": a.head_dim, "batch": 1,
        "timing": {"rule": timing_rule(a.warmup, a.iters).to_json(),
                   "padding": "ABI capacities rounded up to powers of two",
                   "inputs": "one random normal q, k, v per call shape (not rotated; the "
                             "rule's L2 policy applies)"},
        "command": "python -m tessera_jax.tools.profiler " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
        "device": dev,
    }
    if a.dry_run:
        return dry_run(a, specs, cands, raw_path, heads)
    if not a.fit_only:
        _measure(a, specs, cands, raw_path, heads)
    table = fit_from_raw(raw_path, cands or None, gpu={k: dev[k] for k in
                                                        ("name", "device_kind", "arch",
                                                         "compute_capability")},
                         provenance=provenance)
    write_table(out, table)
    fit = table["fit"]
    log(f"table {out}: {table['provenance']['fit']['masks_used']} masks, "
        f"{len(table['candidates'])} candidates, k={table['model']['k']}; "
        f"leave-group-out regret {fit['k_cv_leave_group_out'].get(str(table['model']['k']))}")
    return table


def _end_cut_line(raw_path) -> None:
    """Ends a line cut by a killed run, so that the next record starts on its own line."""
    if raw_path.is_file() and raw_path.stat().st_size:
        with open(raw_path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _todo(a, specs, cands, times_done, rule):
    """[(spec, candidate, check)]: pairs to time (check False), mask by mask, then, with
    --remeasure-stale, recorded pairs to plan again and time only if their plan changed (check
    True): a run cut short has timed the missing pairs first."""
    timed, checked = [], []
    for s in specs:
        for c in cands:
            rec = times_done.get((s["id"], cand_key(*c)))
            if needs_timing(rec, rule, a.retry_errors):
                timed.append((s, c, False))
            elif a.remeasure_stale:
                checked.append((s, c, True))
    return timed + checked


def _mask_record(a, spec, mask, heads, hq) -> dict:
    """The raw file's record of a profiled mask: spec, call, features."""
    shape = call_shape(mask, a.dtype, a.head_dim, hq)
    return {"kind": "mask", "id": spec["id"], "family": spec["family"], "grid": spec["grid"],
            "group": spec_group(spec) if not a.tiny else spec["id"], "heads": heads,
            "call_heads": hq, "spec": spec, "dtype": a.dtype, "head_dim": a.head_dim,
            "shape": list(mask.shape), "Lq": mask.Lq, "Lkv": mask.Lkv, "density": mask.density,
            "feature_names": list(_features.FEATURE_NAMES),
            "features": [float(x) for x in _features.feature_vector(mask, shape)]}


def dry_run(a, specs, cands, raw_path, heads) -> dict:
    """``--dry-run``: the pairs a run would time, found by planning each one on this host (no
    timing, no raw record); printed as JSON and returned."""
    import jax.numpy as jnp

    from tessera_jax.runtime.api import clear_caches
    _, times_done = read_raw(raw_path)
    rule = timing_rule(a.warmup, a.iters, gpu=not a.tiny).name
    inputs = Inputs(jnp.dtype(a.dtype), a.head_dim)
    out = {"raw": str(raw_path), "rule": rule, "masks": len(specs), "pairs": 0,
           "time": {"no_record": 0, "other_rule": 0, "error": 0, "stale_plan": 0},
           "kept": 0, "bitmap_pairs": 0, "bitmap_masks": 0, "plan_errors": 0, "plan_s": 0.0,
           "by_family": {}}
    for spec in specs:
        mask = build_mask(spec, heads)
        fam = out["by_family"].setdefault(spec["family"], {"masks": 0, "time": 0, "bitmap": 0})
        fam["masks"] += 1
        any_bitmap = False
        for c in cands:
            out["pairs"] += 1
            rec = times_done.get((spec["id"], cand_key(*c)))
            why = _why_timed(a, rec, rule)
            try:
                p, ms = plan_candidate(mask, *c, inputs, call_heads(spec, heads))
            except Exception:  # noqa: BLE001 - a run would record it as an error
                out["plan_errors"] += 1
                p = None
            else:
                out["plan_s"] += ms / 1e3
                bitmap = plan_summary(p)["bitmap_steps"] > 0
                out["bitmap_pairs"] += bitmap
                fam["bitmap"] += bitmap
                any_bitmap |= bitmap
                if why is None and a.remeasure_stale and is_stale(rec, plan_digest(p)):
                    why = "stale_plan"
            if why is None:
                out["kept"] += 1
            else:
                out["time"][why] += 1
                fam["time"] += 1
        out["bitmap_masks"] += any_bitmap
        clear_caches()                          # plans of big masks: one mask's at a time
    out["to_time"] = sum(out["time"].values())
    out["plan_s"] = round(out["plan_s"], 1)
    print(json.dumps(out, indent=1))
    return out


def _why_timed(a, rec, rule) -> str | None:
    """Why a run would time a pair whatever its plan ("no_record", "other_rule", "error"), or
    None when its record stands unless its plan changed."""
    if not needs_timing(rec, rule, a.retry_errors):
        return None
    if rec is None:
        return "no_record"
    return "other_rule" if rec.get("status") == "ok" else "error"


def _measure(a, specs, cands, raw_path, heads):
    import jax.numpy as jnp
    t_start = time.monotonic()
    masks_done, times_done = read_raw(raw_path)
    _end_cut_line(raw_path)
    rule = timing_rule(a.warmup, a.iters).name
    other = sum(1 for r in times_done.values()
                if r.get("status") == "ok" and r.get("rule") != rule)
    if other:
        log(f"{other} timings in {raw_path} were taken under another rule than {rule}: "
            f"they are measured again")
    todo = _todo(a, specs, cands, times_done, rule)
    n_check = sum(c for *_, c in todo)
    log(f"{len(specs)} masks x {len(cands)} candidates; {len(todo) - n_check} timings to do, "
        f"{n_check} recorded pairs to check against the current plan "
        f"({len(specs) * len(cands) - len(todo)} already in {raw_path})")
    inputs = Inputs(jnp.dtype(a.dtype), a.head_dim)
    bar = _progress(len(todo), "profile")
    cur_id, mask = None, None
    stopped = False
    streak = current = stale = 0
    code = versions().get("git")
    for spec, (template, policy), check in todo:
        if a.time_budget is not None and time.monotonic() - t_start > a.time_budget:
            stopped = True
            break
        if spec["id"] != cur_id:
            cur_id = spec["id"]
            mask = build_mask(spec, heads)
            hq = call_heads(spec, heads)
            if cur_id not in masks_done:
                _append(raw_path, _mask_record(a, spec, mask, heads, hq))
                masks_done[cur_id] = True
        key = cand_key(template, policy)
        rec = {"kind": "time", "id": cur_id, "candidate": key, "template": template,
               "policy": policy, "code": code}
        planned = None
        try:
            planned = plan_candidate(mask, template, policy, inputs, hq)
            if check and not is_stale(times_done[(cur_id, key)], plan_digest(planned[0])):
                current += 1            # recorded on this very plan: kept
                bar.update(1)
                continue
            stale += check
            rec.update(time_candidate(mask, template, policy, inputs, warmup=a.warmup,
                                      iters=a.iters, num_heads=hq, planned=planned))
            rec["status"] = "ok"
            streak = 0
        except Exception as e:  # noqa: BLE001 - a failing candidate is data, not a crash
            rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
            if planned is not None:             # the plan that failed (stale once it changes)
                rec["plan_digest"] = plan_digest(planned[0])
            log(f"{cur_id} {rec['candidate']}: {rec['error']}")
            streak += 1
        _append(raw_path, rec)
        if streak >= a.max_error_streak:
            log(f"{streak} failures in a row: the device may be in a bad state; stopping "
                f"(rerun with --retry-errors to measure the failed pairs again)")
            stopped = True
            break
        bar.update(1)
        bar.set_postfix_str(f"{spec['family']} {rec['candidate']} "
                            f"{rec.get('ms', float('nan')):.3f} ms")
    bar.close()
    if n_check:
        log(f"--remeasure-stale: {current} recorded pairs on the current plan kept, {stale} "
            f"stale ones timed again")
    if stopped:
        log("stopped early; rerun to continue (resumable)")


if __name__ == "__main__":
    main()
