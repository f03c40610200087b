"""The mask corpus: 2,345 small JSON-able specs with a fixed train/test split; masks are built
on demand by ``build(spec)`` and never stored.

Composition (``docs/masks.md``): 400 specs per main grid (wan720, wan480, hy720, hy480), 200 per
variant grid (hy720_1x1, wan720_49f: every other spec of the per-grid list, MoBA from its second), plus 63 drifting step
sequences (9 per dynamic family on the main grids) that add steps 1..5 to a step-0 spec, plus 30
token-level specs (family ``tokens``: wan480 and tok4096), appended last so that every earlier
spec keeps its id and split (``corpus_digest(exclude=("tokens",))`` is the digest before them).
Split: per family, the spec groups (a spec without its ``step``, so a step sequence never straddles
the split) ordered by SHA-256 of their canonical JSON; the first round(20%) are ``test``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import zlib
from typing import Any

import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.masks.families import FAMILIES
from tessera_jax.masks.grids import GRIDS, get_grid

__all__ = ["CORPUS_SIZE", "MAIN_GRIDS", "VARIANT_GRIDS", "TOKEN_GRIDS", "DYNAMIC_FAMILIES",
           "DENSITY_RANGES", "TEST_FRACTION", "corpus", "train_specs", "test_specs", "build",
           "spec_key", "group_key", "corpus_digest"]

CORPUS_SIZE = 2345
MAIN_GRIDS = ("wan720", "wan480", "hy720", "hy480")
VARIANT_GRIDS = ("hy720_1x1", "wan720_49f")
#: Grids of the token-level family: 4-, 8-, 16-token blocks at Wan 480p, 1-token at L = 4,096.
TOKEN_GRIDS = ("wan480", "tok4096")
DYNAMIC_FAMILIES = ("ssta", "moba", "vsa", "svg2", "sparge", "xattn", "jenga")
DRIFT_PER_FAMILY = 9
DRIFT_STEPS = 5
TEST_FRACTION = 0.2

#: Token density (selected / all interactions, averaged over heads) of every corpus mask lies in
#: these closed ranges (measured over the whole corpus; see docs/masks.md).
DENSITY_RANGES: dict[str, tuple[float, float]] = {
    "dense": (1.0, 1.0),
    "sta": (0.06, 0.47),
    "ssta": (0.10, 0.66),
    "moba": (0.05, 0.60),
    "vsa": (0.05, 0.32),
    "radial": (0.15, 0.58),
    "svg": (0.14, 0.52),
    "svg2": (0.19, 0.36),
    "sparge": (0.035, 0.58),
    "xattn": (0.07, 0.54),
    "jenga": (0.10, 0.40),
    "natten": (0.025, 0.30),
    "ditfastattn": (0.03, 0.30),
    "tokens": (0.004, 0.31),
}

_STA_WINDOWS = ((3, 3, 3), (5, 3, 3), (1, 6, 10), (3, 3, 5), (5, 1, 10), (5, 6, 1))
_NATTEN_FRACS = ((0.6, 0.5, 0.3), (0.3, 0.3, 0.3), (1.0, 0.2, 0.2), (0.2, 0.6, 0.6))


def _family_params(grid: str) -> dict[str, list[dict[str, Any]]]:
    """Per family, the (params, seed) list of one grid (docs/masks.md, "Corpus")."""
    g = GRIDS[grid]
    P: dict[str, list[dict[str, Any]]] = {}
    text_kv = g.cross_text if not g.joint else None
    P["dense"] = [{"params": {"kind": "full", "block": 128}, "seed": 0},
                  {"params": {"kind": "text", "block": 128, **({"text_kv": text_kv} if text_kv else {})},
                   "seed": 0}]
    P["sta"] = ([{"params": {"tile": list(t), "window": list(w)}, "seed": 0}
                 for t in ((6, 8, 8), (4, 8, 8)) for w in _STA_WINDOWS]
                + [{"params": {"tile": list(t), "window": "mix"}, "seed": s}
                   for t in ((6, 8, 8), (4, 8, 8)) for s in range(6)])
    P["ssta"] = [{"params": {"topk": k, "lam": lam}, "seed": s}
                 for k in (16, 32, 64) for lam in (0.5, 0.7, 1.0) for s in range(5)]
    P["moba"] = [{"params": {"topk": k}, "seed": s} for k in (16, 32, 64) for s in range(3)]
    P["vsa"] = [{"params": {"sparsity": sp}, "seed": s}
                for sp in (0.75, 0.8, 0.875, 0.9, 0.95) for s in range(10)]
    P["radial"] = [{"params": {"decay": d, "block": b, "sink": sink,
                               "layout": "frame" if i % 2 == 0 else "uniform"}, "seed": 0}
                   for i, d in enumerate((0.2, 0.5, 0.95, 1.0)) for b in (64, 128)
                   for sink in (True, False)]
    P["svg"] = [{"params": {"density": d, "temporal_frac": f}, "seed": s}
                for d in (0.1, 0.15, 0.2, 0.25, 0.3) for f in (0.0, 0.25, 0.5, 0.75, 1.0)
                for s in range(2)]
    P["svg2"] = [{"params": {"q_clusters": qc, "kv_clusters": kc, "top_p": p}, "seed": s}
                 for qc in (100, 200, 300, 400) for kc in (500, 1000) for p in (0.8, 0.9, 0.95)
                 for s in range(2)]
    P["sparge"] = [{"params": {"tau": t, "nonsim_frac": f}, "seed": s}
                   for t in (0.6, 0.75, 0.9, 0.95) for f in (0.0, 0.03, 0.1) for s in range(4)]
    P["xattn"] = [{"params": {"tau": t, "stride": st}, "seed": s}
                  for t in (0.8, 0.9, 0.95) for st in (8, 16) for s in range(8)]
    P["jenga"] = [{"params": {"drop": d, "p": p}, "seed": s}
                  for d in (0.7, 0.8, 0.9) for p in (0.3, 0.8) for s in range(6)]
    P["natten"] = [{"params": {"window": [max(1, round(f * n)) for f, n in zip(fr, g.shape)],
                               "stride": st, "tile": list(t)}, "seed": 0}
                   for fr in _NATTEN_FRACS for st in (1, "tile") for t in ((2, 8, 8), (4, 4, 4))]
    P["ditfastattn"] = [{"params": {"window_frac": w, "block": b}, "seed": 0}
                        for w in (1 / 32, 1 / 16, 1 / 8, 1 / 4) for b in (64, 128)]
    return P


_TOKEN_DENSITIES = (0.1, 0.2, 0.3)
_TOKEN_LOCAL = (0.0, 0.5)
_TOKEN_BAND_WIDTHS = (8, 16, 24, 32, 48, 64)


def _token_specs() -> list[dict]:
    """The token-level family (30 specs, shared masks, 12 heads: Wan2.1-1.3B's 480p call):
    random blocks of 4/8/16 tokens at Wan 480p and of 1 token at L = 4,096, and token bands."""
    def spec(grid, params):
        return {"family": "tokens", "grid": grid, "heads": 12, "seed": 0, "step": 0, "text": 0,
                "params": params}
    out = [spec("wan480" if b > 1 else "tok4096",
                {"kind": "random", "block": b, "density": d, "local": loc})
           for b in (4, 8, 16, 1) for d in _TOKEN_DENSITIES for loc in _TOKEN_LOCAL]
    out += [spec("tok4096", {"kind": "band", "block": 1, "width": w}) for w in _TOKEN_BAND_WIDTHS]
    return out


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def group_key(spec: dict) -> str:
    """Canonical JSON of a spec without ``step``/``id``/``split`` (its step sequence)."""
    return _canon({k: v for k, v in spec.items() if k not in ("step", "id", "split")})


def spec_key(spec: dict) -> str:
    """Canonical JSON of a spec without ``id``/``split``."""
    return _canon({k: v for k, v in spec.items() if k not in ("id", "split")})


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def _grid_specs(grid: str) -> list[dict]:
    g = GRIDS[grid]
    out = []
    for fam, items in _family_params(grid).items():
        for i, it in enumerate(items):
            heads = g.heads
            if grid == "wan480" and i % 3 == 2:
                heads = 12                                  # Wan2.1-1.3B
            text = 0
            if g.joint:
                r = np.random.default_rng([zlib.crc32(f"{grid}/{fam}".encode()), i])
                text = int(r.integers(50, g.text_max + 1))
            if fam == "dense" and it["params"]["kind"] == "text" and g.joint:
                it = {"params": {**it["params"], "text_kv": text}, "seed": it["seed"]}
            out.append({"family": fam, "grid": grid, "heads": heads, "seed": it["seed"],
                        "step": 0, "text": text, "params": it["params"]})
    return out


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[str, ...]:
    specs: list[dict] = []
    for grid in MAIN_GRIDS:
        specs += _grid_specs(grid)
    for grid in VARIANT_GRIDS:
        full = _grid_specs(grid)
        by_fam: dict[str, list[dict]] = {}
        for s in full:
            by_fam.setdefault(s["family"], []).append(s)
        # Every other spec (the 1st, 3rd, ...), MoBA from its 2nd: 200 per variant grid.
        specs += [s for fam in by_fam for s in by_fam[fam][1 if fam == "moba" else 0::2]]
    for fam in DYNAMIC_FAMILIES:
        bases = sorted((s for s in specs if s["family"] == fam and s["grid"] in MAIN_GRIDS),
                       key=lambda s: _sha("drift:" + spec_key(s)))[:DRIFT_PER_FAMILY]
        for b in bases:
            specs += [{**copy.deepcopy(b), "step": st} for st in range(1, DRIFT_STEPS + 1)]
    specs += _token_specs()                  # last: the specs before keep their order
    # Split: per family, groups ordered by hash; the first round(20%) go to test.
    test_groups: set[str] = set()
    for fam in FAMILIES:
        groups = sorted({group_key(s) for s in specs if s["family"] == fam}, key=_sha)
        test_groups.update(groups[:round(TEST_FRACTION * len(groups))])
    out = []
    for s in specs:
        s = dict(s)
        s["id"] = _sha(spec_key(s))[:16]
        s["split"] = "test" if group_key(s) in test_groups else "train"
        out.append(_canon(s))
    if len(out) != CORPUS_SIZE:
        raise AssertionError(f"corpus has {len(out)} specs, expected {CORPUS_SIZE}")
    return tuple(out)


def corpus(split: str | None = None) -> list[dict]:
    """The corpus specs (fresh copies), optionally only ``split`` ("train" or "test").

    A spec: ``{"id", "family", "grid", "heads", "seed", "step", "text", "params", "split"}``.
    """
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be None, 'train' or 'test', got {split!r}")
    specs = [json.loads(s) for s in _corpus()]
    return specs if split is None else [s for s in specs if s["split"] == split]


def train_specs() -> list[dict]:
    return corpus("train")


def test_specs() -> list[dict]:
    """The held-out specs: never use them for fitting."""
    return corpus("test")


def corpus_digest(exclude=()) -> str:
    """SHA-256 of the canonical corpus (specs and split): provenance for plan tables.
    ``exclude``: family names left out (``("tokens",)``: the corpus before that family)."""
    if (not isinstance(exclude, (list, tuple, set, frozenset))
            or not all(isinstance(f, str) for f in exclude)):
        raise TypeError(f"exclude must be a sequence of family names, got {exclude!r}")
    unknown = sorted(set(exclude) - set(FAMILIES))
    if unknown:
        raise ValueError(f"exclude: unknown families {unknown}; known: {sorted(FAMILIES)}")
    skip = set(exclude)
    return _sha("\n".join(s for s in _corpus() if json.loads(s)["family"] not in skip))


def build(spec: dict, heads: int | None = None) -> BlockMask:
    """The mask of a spec. ``heads``: only the first ``heads`` heads (profiling on a head subset;
    head i is the same mask as in the full build). Shared (Hm == 1) masks stay shared."""
    if not isinstance(spec, dict):
        raise TypeError(f"spec must be a dict, got {type(spec).__name__}")
    missing = [k for k in ("family", "grid", "heads", "seed", "params") if k not in spec]
    if missing:
        raise ValueError(f"spec is missing {missing}")
    fam = spec["family"]
    if fam not in FAMILIES:
        raise ValueError(f"spec family {fam!r} is unknown; known: {sorted(FAMILIES)}")
    h = int(spec["heads"])
    if heads is not None:
        if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)):
            raise TypeError(f"heads must be an int, got {type(heads).__name__}")
        if not 1 <= heads <= h:
            raise ValueError(f"heads must be in [1, {h}], got {heads}")
        h = int(heads)
    params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in spec["params"].items()}
    return FAMILIES[fam](get_grid(spec["grid"]), heads=h, seed=int(spec["seed"]),
                         step=int(spec.get("step", 0)), text=int(spec.get("text", 0)), **params)


def _main(argv=None):
    """``python -m tessera_jax.masks.corpus [--family F] [--out stats.json]``: builds every spec
    and reports density ranges per family (slow: every mask of the corpus)."""
    import argparse
    import time
    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("--family", action="append")
    ap.add_argument("--shard", default="0/1", help="i/n: only specs with index %% n == i")
    ap.add_argument("--sample", type=int, default=0,
                    help="only K evenly spaced step-0 specs per (family, grid); 0: all")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    i, n = (int(x) for x in a.shard.split("/"))
    specs = corpus()
    if a.sample:
        keep = set()
        cells: dict[tuple, list[int]] = {}
        for k, s in enumerate(specs):
            if s["step"] == 0:
                cells.setdefault((s["family"], s["grid"]), []).append(k)
        for ks in cells.values():
            keep.update(ks[j] for j in np.unique(np.linspace(0, len(ks) - 1, a.sample).round()
                                                 .astype(int)))
    rows = []
    for k, s in enumerate(specs):
        if k % n != i or (a.family and s["family"] not in a.family):
            continue
        if a.sample and k not in keep:
            continue
        t = time.perf_counter()
        m = build(s)
        dt = time.perf_counter() - t
        sizes = np.concatenate([m.q_sizes, m.kv_sizes])
        rows.append({"id": s["id"], "family": s["family"], "grid": s["grid"], "split": s["split"],
                     "density": m.density, "shape": list(m.shape), "Lq": m.Lq, "Lkv": m.Lkv,
                     "distinct_sizes": int(np.unique(sizes).size), "seconds": dt,
                     "head_density": (m.selected_per_head() / (m.Lq * m.Lkv)).tolist()})
        print(f"{k:5d} {s['family']:12s} {s['grid']:11s} {m.density:.4f} {m.shape} {dt:.2f}s",
              flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f)
    fams = sorted({r["family"] for r in rows})
    for fam in fams:
        d = [r["density"] for r in rows if r["family"] == fam]
        print(f"{fam:12s} n={len(d):4d} density [{min(d):.4f}, {max(d):.4f}] "
              f"median {float(np.median(d)):.4f}")


if __name__ == "__main__":
    _main()
