"""Per-request plan selection: mask features -> the GPU's ranking table -> (template, policy).

No timing and no search on the request path: ``select`` computes the mask's features
(``tessera_jax.select.features``, cached by mask digest), ranks the table's candidates with the
table's fitted model (k nearest training masks in standardised feature space, candidates
ordered by their mean log time relative to the best candidate on those masks) and returns the
first candidate whose template takes the call (backend, head_dim, dtype). The table format is
documented in ``plan_tables/README.md``; tables are written by
``python -m tessera_jax.tools.profiler``.

Which table: ``plan_tables/<gpu>.json`` (shipped in the wheel as ``tessera_jax/plan_tables/``) where
``<gpu>`` is the device kind normalised (``"NVIDIA H200"`` -> ``h200``; the directory can be
moved with ``$TESSERA_JAX_PLAN_TABLES``).
A GPU without its own table takes a table of the same architecture (H100 -> the H200 table),
with a one-time warning. No table of the architecture, or an unreadable or invalid table: a
one-time warning and ``heuristic`` (below), never an exception. On the XLA backend without a
matching table ``select`` returns None and the API uses its default template.

Heuristic (``heuristic``): key tile 128 when selected key runs average >= 128 tokens and most
run edges sit on the 128-token grid, else 64; a 2-stage ring for 128-key tiles (the H200
feasibility run: 2 stages beat 3 at every density) and 3 stages for 64-key tiles; the
backend's template closest to that (key tile, stages). Policy: ``merge`` when adjacent rows
mostly repeat (same_rows >= 0.5: merged row groups fill tall tiles); else ``split`` when
logical blocks are much smaller than the tile (median query block <= tile_q / 2 or median key
block <= tile_kv / 4: the global grid packs several into one tile, where ``keep`` and
``merge`` would leave tiles half empty); else ``merge`` when key runs are contiguous
(contiguity >= 0.3); else ``keep``. Its regret on measured GPU times is what
``benchmarks/selection.py`` reports as ``heuristic_regret_median`` / ``heuristic_regret_p90``
(on the masks where the heuristic's candidate was among those timed).

Candidate templates come from ``pallas_kernels.templates`` (the static table); this module
imports nothing of ``tessera_jax.runtime``.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import os
import pathlib
import re
import threading
import warnings

import numpy as np

from pallas_kernels import templates as _templates

from tessera_jax.select import features as _features
from tessera_jax.mask import BlockMask

__all__ = ["select", "source", "rank", "heuristic", "load_table", "find_table", "gpu_name", "gpu_arch",
           "table_dir", "TableError", "fit_table", "validate_table", "clear_caches",
           "TABLE_FORMAT", "TABLE_VERSION"]

TABLE_FORMAT = "tessera_jax.plan_table"
TABLE_VERSION = 1
_ENV_DIR = "TESSERA_JAX_PLAN_TABLES"
_TABLE_PACKAGE = "tessera_jax"       # the wheel ships the tables as tessera_jax/plan_tables/
_TABLE_SUBDIR = "plan_tables"        # in the source tree: the repository's top-level plan_tables/
#: log(relative time) charged to a candidate that failed or was not timed on a training mask.
MISSING_PENALTY = math.log(4.0)
#: Smallest standardisation scale of a feature (fractions vary by less than this only by noise).
SCALE_FLOOR = 0.01

# GPU name prefix -> architecture (checked longest prefix first).
_ARCH_BY_NAME = {
    "gh200": "hopper", "h200": "hopper", "h100": "hopper", "h800": "hopper", "h20": "hopper",
    "gb200": "blackwell", "b200": "blackwell", "b100": "blackwell",
    "a100": "ampere", "a800": "ampere", "a40": "ampere", "a30": "ampere", "a10": "ampere",
    "a6000": "ampere", "rtx3090": "ampere",
    "l40s": "ada", "l40": "ada", "l4": "ada", "rtx4090": "ada", "rtx6000": "ada",
    "cpu": "cpu",
}
# Compute capability major.minor -> architecture (when the name is unknown).
_ARCH_BY_CC = {(9, 0): "hopper", (10, 0): "blackwell", (8, 0): "ampere", (8, 6): "ampere",
               (8, 7): "ampere", (8, 9): "ada"}
# Preferred stand-in tables per architecture (first existing one wins, then by name).
_PREFERRED = {"hopper": ("h200", "h100", "gh200"), "blackwell": ("b200",),
              "ampere": ("a100",), "ada": ("l40s",)}


class TableError(ValueError):
    """A plan table that can't be read or fails validation."""


# --- finding tables ------------------------------------------------------------------------
def table_dir() -> pathlib.Path:
    """The directory of plan tables: ``$TESSERA_JAX_PLAN_TABLES``, else the shipped tables
    (``tessera_jax/plan_tables/`` of an installed wheel, else the source tree's top-level
    ``plan_tables/``)."""
    env = os.environ.get(_ENV_DIR)
    if env:
        return pathlib.Path(env)
    return _package_table_dir()


@functools.cache
def _package_table_dir() -> pathlib.Path:
    """``tessera_jax/plan_tables`` of an installed wheel (``pyproject.toml`` maps the top-level
    folder there), else ``plan_tables/`` next to the package in a checkout or an editable
    install (once: ``select`` asks on every request)."""
    return _table_dir_of(pathlib.Path(str(importlib.resources.files(_TABLE_PACKAGE))))


def _table_dir_of(pkg: pathlib.Path) -> pathlib.Path:
    """The tables of the package at ``pkg``: its own ``plan_tables/`` when it holds tables (a
    wheel), else the source tree's top-level one; a folder without tables (a stale one left
    in a checkout) never hides the source tree's."""
    shipped, source = pkg / _TABLE_SUBDIR, pkg.parent / _TABLE_SUBDIR
    return shipped if any(shipped.glob("*.json")) or not source.is_dir() else source


def gpu_name(device_kind: str) -> str:
    """A device kind as a table file stem: ``"NVIDIA H200"`` -> ``"h200"``, ``"cpu"`` -> ``"cpu"``."""
    if not isinstance(device_kind, str):
        raise TypeError(f"device_kind must be a str, got {type(device_kind).__name__}")
    s = device_kind.lower()
    for word in ("nvidia", "tesla", "geforce", "quadro"):
        s = s.replace(word, " ")
    s = re.sub(r"\brtx\s+", "rtx", s)
    toks = [t for t in re.split(r"[^a-z0-9]+", s) if t]
    for t in toks:
        if re.fullmatch(r"[a-z]+\d+[a-z]*", t):
            return t
    return toks[0] if toks else "unknown"


def gpu_arch(name: str, compute_capability=None) -> str | None:
    """Architecture of a GPU name (``gpu_name``) or of its compute capability (``"9.0"``)."""
    for prefix in sorted(_ARCH_BY_NAME, key=len, reverse=True):
        if name == prefix or (name.startswith(prefix) and not name[len(prefix)].isdigit()):
            return _ARCH_BY_NAME[prefix]
    if compute_capability is not None:
        try:
            major, minor = (int(x) for x in str(compute_capability).split(".")[:2])
        except ValueError:
            return None
        if (major, minor) in _ARCH_BY_CC:
            return _ARCH_BY_CC[(major, minor)]
        return {9: "hopper", 10: "blackwell", 8: "ampere"}.get(major)
    return None


def device_name() -> str:
    """``gpu_name`` of the default JAX device ("cpu" on the CPU)."""
    return _current_device()[0]


@functools.cache
def _current_device():
    """(gpu name, compute capability or None) of the default JAX device."""
    import jax
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", None) or d.platform
    if d.platform == "cpu":
        return "cpu", None
    return gpu_name(str(kind)), getattr(d, "compute_capability", None)


def _table_arch(path: pathlib.Path) -> str | None:
    try:
        with open(path) as f:
            head = json.load(f)
        return head.get("gpu", {}).get("arch")
    except Exception:  # noqa: BLE001 - an unreadable table is simply not a stand-in
        return None


def find_table(name: str, arch: str | None, directory=None) -> tuple[pathlib.Path | None, bool]:
    """(path, exact): ``<name>.json``, else a table of the same architecture, else (None, False)."""
    d = pathlib.Path(directory) if directory is not None else table_dir()
    exact = d / f"{name}.json"
    if exact.is_file():
        return exact, True
    if arch is None or not d.is_dir():
        return None, False
    same = sorted(p for p in d.glob("*.json") if _table_arch(p) == arch)
    if not same:
        return None, False
    pref = _PREFERRED.get(arch, ())
    same.sort(key=lambda p: (pref.index(p.stem) if p.stem in pref else len(pref), p.stem))
    return same[0], False


# --- loading and validating ---------------------------------------------------------------
class Table:
    """A loaded, validated ranking table (arrays ready for ``rank``)."""

    def __init__(self, data: dict, path=None):
        validate_table(data)
        self.data = data
        self.path = path
        self.gpu = data["gpu"]
        self.candidates = [(c["template"], c["policy"]) for c in data["candidates"]]
        self.feature_names = tuple(data["features"])
        m = data["model"]
        self.k = int(m["k"])
        self.mean = np.asarray(m["mean"], np.float64)
        self.scale = np.asarray(m["scale"], np.float64)
        self.points = np.asarray(m["points"], np.float64).reshape(-1, len(self.feature_names))
        rel = np.array([[np.nan if v is None else v for v in row] for row in m["rel_log_time"]],
                       np.float64).reshape(len(self.points), len(self.candidates))
        self.rel = np.where(np.isfinite(rel), rel, MISSING_PENALTY)
        self.default_order = [int(i) for i in data["default_order"]]
        missing = [n for n in self.feature_names if n not in _features.FEATURE_NAMES]
        if missing:
            raise TableError(f"table uses features this version does not compute: {missing}")
        self._idx = np.array([_features.FEATURE_NAMES.index(n) for n in self.feature_names])
        # Precomputed for ``order`` (it runs per request): squared norms of the points,
        # tie-break ranks, and whether the table's features are FEATURE_NAMES in order.
        self._sq = np.einsum("nf,nf->n", self.points, self.points)
        self._tie = np.empty(len(self.candidates))
        self._tie[self.default_order] = np.arange(len(self.default_order))
        self._all = np.array_equal(self._idx, np.arange(len(_features.FEATURE_NAMES)))

    def order(self, fvec: np.ndarray) -> list[int]:
        """Candidate indices, best first, for a feature vector in ``FEATURE_NAMES`` order."""
        n = len(self.points)
        if n == 0:
            return list(self.default_order)
        x = ((fvec if self._all else fvec[self._idx]) - self.mean) / self.scale
        # squared distances to the training masks, less |x|^2 (the same for all: ranks kept)
        d = self._sq - 2.0 * (self.points @ x)
        k = self.k
        if k == 1:
            score = self.rel[int(d.argmin())]           # ties: the first training mask
        elif k < n:
            score = self.rel[np.argpartition(d, k - 1)[:k]].mean(axis=0)
        else:
            score = self.rel.mean(axis=0)
        return np.lexsort((self._tie, np.round(score, 9))).tolist()


def validate_table(data) -> None:
    """Raises ``TableError`` naming what is wrong with a table's JSON content."""
    def need(cond, what):
        if not cond:
            raise TableError(f"invalid plan table: {what}")
    need(isinstance(data, dict), "top level must be an object")
    need(data.get("format") == TABLE_FORMAT, f"format must be {TABLE_FORMAT!r}")
    need(data.get("version") == TABLE_VERSION, f"version must be {TABLE_VERSION}")
    for key in ("gpu", "provenance", "features", "candidates", "model", "default_order"):
        need(key in data, f"missing {key!r}")
    need(isinstance(data["gpu"], dict) and isinstance(data["gpu"].get("name"), str),
         "gpu.name must be a string")
    cands = data["candidates"]
    need(isinstance(cands, list) and cands, "candidates must be a non-empty list")
    for c in cands:
        need(isinstance(c, dict) and isinstance(c.get("template"), str)
             and isinstance(c.get("policy"), str), "each candidate needs template and policy")
    feats = data["features"]
    need(isinstance(feats, list) and all(isinstance(f, str) for f in feats) and feats,
         "features must be a non-empty list of names")
    m = data["model"]
    need(isinstance(m, dict) and m.get("kind") == "knn", "model.kind must be 'knn'")
    F, C = len(feats), len(cands)
    need(isinstance(m.get("k"), int) and m["k"] >= 1, "model.k must be a positive int")
    for key in ("mean", "scale"):
        v = m.get(key)
        need(isinstance(v, list) and len(v) == F
             and all(isinstance(x, (int, float)) and math.isfinite(x) for x in v),
             f"model.{key} must hold {F} finite numbers")
    need(all(x > 0 for x in m["scale"]), "model.scale must be positive")
    pts, rel = m.get("points"), m.get("rel_log_time")
    need(isinstance(pts, list) and isinstance(rel, list) and len(pts) == len(rel),
         "model.points and model.rel_log_time must be lists of equal length")
    for p in pts:
        need(isinstance(p, list) and len(p) == F
             and all(isinstance(x, (int, float)) and math.isfinite(x) for x in p),
             f"each model point must hold {F} finite numbers")
    for r in rel:
        need(isinstance(r, list) and len(r) == C
             and all(x is None or (isinstance(x, (int, float)) and math.isfinite(x)) for x in r),
             f"each rel_log_time row must hold {C} numbers or null")
    order = data["default_order"]
    need(isinstance(order, list) and sorted(order) == list(range(C)),
         "default_order must be a permutation of the candidate indices")


def load_table(path) -> Table:
    """Reads and validates a table file (``TableError`` if it can't be used)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TableError(f"can't read plan table {path}: {e}") from e
    return Table(data, path)


# --- selection -----------------------------------------------------------------------------
_lock = threading.Lock()
_TABLES: dict = {}          # (path, mtime) -> Table | TableError
_RESOLVED: dict = {}        # (directory, gpu name, quiet) -> Table | None
_CHOICES: dict = {}         # (digest, shape, backend, table) -> choice
_MAX_CHOICES = 4096
_warned: set = set()


def clear_caches(*, tables: bool = True) -> None:
    """Forgets the choices cached per mask digest and, with ``tables``, the loaded tables, the
    table resolved per GPU and the one-time warnings (``tessera_jax.clear_caches`` calls it)."""
    with _lock:
        _CHOICES.clear()
        if tables:
            _TABLES.clear()
            _RESOLVED.clear()
            _warned.clear()


def _warn_once(key, msg):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"tessera_jax.select.ranking: {msg}", stacklevel=4)


def _load_cached(path: pathlib.Path):
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as e:
        return TableError(f"can't read plan table {path}: {e}")
    key = (str(path), mtime)
    hit = _TABLES.get(key)
    if hit is None:
        try:
            hit = load_table(path)
        except TableError as e:
            hit = e
        _TABLES[key] = hit
    return hit


def _resolve_table(name: str, cc, quiet: bool):
    """(Table or None) for this GPU, warning once about stand-ins, absence and corruption."""
    d = table_dir()
    arch = gpu_arch(name, cc)
    path, exact = find_table(name, arch, d)
    if path is None:
        if not quiet:
            _warn_once(("missing", str(d), name),
                       f"no plan table for GPU {name!r} (architecture {arch}) in {d}; using the "
                       f"documented heuristic (run `python -m tessera_jax.tools.profiler` to make one)")
        return None
    t = _load_cached(path)
    if isinstance(t, TableError):
        if not quiet:
            _warn_once(("corrupt", str(path)), f"{t}; using the documented heuristic")
        return None
    if not exact and not quiet:
        _warn_once(("standin", str(path), name),
                   f"no plan table for GPU {name!r}; using {path.name} (same architecture "
                   f"{arch}), which was profiled on {t.gpu.get('name')!r}")
    return t


def _supports(template_name: str, backend: str, shape) -> bool:
    """Whether the template of this name exists, belongs to ``backend`` and takes the call."""
    try:
        t = _templates.get(template_name)
    except ValueError:
        return False
    return t.backend == backend and t.supports(shape.head_dim, shape.dtype)


def rank(mask: BlockMask, shape, table: Table) -> list[tuple[str, str]]:
    """The table's candidates for this mask and call, best first (no support filtering)."""
    fvec = _features.feature_vector(mask, shape)
    return [table.candidates[i] for i in table.order(fvec)]


def select(mask: BlockMask, shape, backend: str, *, table: Table | None = None):
    """(template, policy) for a call of ``shape`` (an ``AttnShape``) on ``backend``, or None.

    Uses ``table`` if given, else the current GPU's table (see the module docstring). None
    means "no opinion" (XLA backend without a table): the caller uses its default.
    """
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a BlockMask, got {type(mask).__name__}")
    if table is None:
        table = _current_table(backend)
    if table is not None:
        ckey = (mask.digest, tuple(shape), backend, table)   # holds the table: no id reuse
        hit = _CHOICES.get(ckey)
        if hit is not None:
            return hit
        for template, policy in rank(mask, shape, table):
            if _supports(template, backend, shape):
                if len(_CHOICES) >= _MAX_CHOICES:
                    _CHOICES.clear()
                _CHOICES[ckey] = (template, policy)
                return template, policy
        # No candidate of the table runs here (another backend, head_dim or dtype).
    if backend == "xla":
        return None
    return heuristic(mask, shape, backend)


def _current_table(backend: str) -> Table | None:
    """This GPU's table (resolved once; warnings once), or None."""
    name, cc = _current_device()
    quiet = backend == "xla"
    key = (str(table_dir()), name, quiet)
    table = _RESOLVED.get(key, _RESOLVED)
    if table is _RESOLVED:
        with _lock:
            table = _RESOLVED[key] = _resolve_table(name, cc, quiet)
    return table


def source(mask: BlockMask, shape, backend: str) -> str:
    """Where ``select``'s choice for this call comes from, in words (``Plan.describe``): the
    table file and the GPU it was profiled on, the documented heuristic, or the backend's
    default. Dictionary look-ups after ``select`` ran for the call."""
    table = _current_table(backend)
    if table is not None and (mask.digest, tuple(shape), backend, table) in _CHOICES:
        where = pathlib.Path(str(table.path)).name if table.path is not None else "a table"
        return f"ranking table {where} (profiled on {table.gpu.get('name', '?')})"
    device = _current_device()[0]
    if backend == "xla":
        return f"the XLA backend's default template (no table consulted on {device})"
    return f"the documented heuristic (no usable table for {device})"


def heuristic(mask: BlockMask, shape, backend: str):
    """The documented fallback (module docstring): (template, policy), or None if the backend
    has no template that takes the call."""
    f = _features.mask_features(mask, shape)
    # Gathering templates run their own policy, chosen by a ranking table or by the caller.
    supported = [t for t in _templates.for_backend(backend)
                 if t.supports(shape.head_dim, shape.dtype) and not t.policy.startswith("gather")]
    if not supported:
        return None
    run_tokens = 2.0 ** f["log2_run_tokens"] if f["runs_per_row"] > 0 else 0.0
    tile_kv = 128 if (run_tokens >= 128 and f["run_offgrid128"] <= 0.5) else 64
    stages = 2 if tile_kv == 128 else 3
    t = min(supported, key=lambda t: (abs(math.log2(t.tile_kv / tile_kv)), abs(t.stages - stages),
                                      t.name))
    if f["same_rows"] >= 0.5:
        policy = "merge"
    elif (2.0 ** f["log2_q_block"] <= t.tile_q / 2
          or 2.0 ** f["log2_kv_block"] <= t.tile_kv / 4):
        policy = "split"
    elif f["contiguity"] >= 0.3:
        policy = "merge"
    else:
        policy = "keep"
    return t.name, policy


# --- fitting (used by the profiler) -------------------------------------------------------
def _knn_orders(Xs, rel, k, exclude_groups):
    """Leave-one-group-out predicted candidate index for each training point."""
    N = len(Xs)
    sq = (Xs ** 2).sum(1)
    d = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (Xs @ Xs.T), 0.0)
    d[exclude_groups] = np.inf
    kk = min(k, max(N - 1, 1))
    nn = np.argsort(d, axis=1, kind="stable")[:, :kk]
    score = rel[nn].mean(axis=1)                                  # [N, C]
    ok = np.isfinite(d[np.arange(N)[:, None], nn]).all(axis=1)
    return score.argmin(axis=1), ok


def fit_table(X: np.ndarray, times: np.ndarray, candidates, *, groups=None, gpu: dict,
              provenance: dict, feature_names=None, ks=(1, 3, 5, 8, 12, 20)) -> dict:
    """Fits the k-NN ranking and returns the table's JSON content.

    X: [N, F] features of the training masks (``feature_names`` order, default all);
    times: [N, C] milliseconds (NaN: failed / not timed); candidates: [(template, policy)] x C;
    groups: [N] group labels (masks of one group never vote for each other when choosing k).
    """
    feature_names = list(feature_names or _features.FEATURE_NAMES)
    X = np.asarray(X, np.float64)
    T = np.asarray(times, np.float64)
    N, C = T.shape
    if X.shape != (N, len(feature_names)):
        raise ValueError(f"X must be [N={N}, F={len(feature_names)}], got {X.shape}")
    if len(candidates) != C:
        raise ValueError(f"candidates has {len(candidates)} entries, times has {C} columns")
    keep = np.isfinite(T).any(axis=1)
    X, T = X[keep], T[keep]
    groups = (np.arange(N) if groups is None else np.asarray(groups))[keep]
    N = len(T)
    best = np.nanmin(T, axis=1, keepdims=True) if N else np.zeros((0, 1))
    rel = np.log(T / best) if N else np.zeros((0, C))
    rel_f = np.where(np.isfinite(rel), rel, MISSING_PENALTY)
    # Best fixed order: by mean log relative time over the training masks.
    default_order = [int(i) for i in np.argsort(rel_f.mean(axis=0), kind="stable")] \
        if N else list(range(C))
    mean = X.mean(axis=0) if N else np.zeros(len(feature_names))
    scale = X.std(axis=0) if N else np.ones(len(feature_names))
    scale = np.maximum(scale, SCALE_FLOOR)     # near-constant features must not dominate
    Xs = (X - mean) / scale
    cv = {}
    best_k = ks[0]
    if N >= 2:
        same = groups[:, None] == groups[None, :]
        best_score = None
        for k in ks:
            choice, ok = _knn_orders(Xs, rel_f, k, same)
            if not ok.any():
                continue
            r = np.exp(rel_f[np.arange(N), choice][ok])
            cv[str(k)] = {"regret_median": float(np.median(r)),
                          "regret_p90": float(np.quantile(r, 0.9)),
                          "mean_log_regret": float(np.log(r).mean()), "n": int(ok.sum())}
            s = cv[str(k)]["mean_log_regret"]
            if best_score is None or s < best_score - 1e-12:
                best_score, best_k = s, k
    fixed = default_order[0] if C else 0
    fixed_r = np.exp(rel_f[:, fixed]) if N else np.zeros(0)
    rnd = lambda a, n=6: [round(float(x), n) for x in a]  # noqa: E731
    return {
        "format": TABLE_FORMAT,
        "version": TABLE_VERSION,
        "gpu": gpu,
        "provenance": provenance,
        "features": feature_names,
        "candidates": [{"template": t, "policy": p} for t, p in candidates],
        "default_order": default_order,
        "model": {
            "kind": "knn",
            "k": int(best_k),
            "mean": rnd(mean),
            "scale": rnd(scale),
            "points": [rnd(p, 5) for p in Xs],
            "rel_log_time": [[None if not np.isfinite(v) else round(float(v), 5) for v in row]
                             for row in rel],
        },
        "fit": {
            "masks": int(N),
            "k_cv_leave_group_out": cv,
            "best_fixed": {"candidate": fixed, "regret_median": float(np.median(fixed_r))
                           if N else None},
        },
    }
