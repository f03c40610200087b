"""Golden plan digests: every plan of a fixed set of masks, hashed byte for byte.

``python tests/golden_plans.py --write`` records them in ``tests/data/golden_plans.json``;
``tests/test_golden_plans.py`` rebuilds the plans and compares, so a change that alters any plan
(units, steps, capacities, padded lengths) fails the test unless it is meant to. Recorded by the
tree before the house refactor (7b7262c; unchanged through it), rewritten for the tiles-once
format (16-byte steps, grid steps: tests/test_tiles_once.py checks exact coverage), and for
bitmap steps (one step per (unit, K/V tile): the 608 plans that revisited a tile changed, and 2
more whose split fallback / auto choice now counts split's tiles after the bitmap pass; the
other 615 byte-identical; tests/test_bitmap_steps.py).

Masks: the first test-split spec of every (family, grid) on the 480p grids, 2 heads each, and
seeded random masks with variable bounds (1-token blocks included), shared and per head, GQA.
Configs: the tile shapes, alignments and unit orders of the shipped templates, every policy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import numpy as np

PATH = pathlib.Path(__file__).parent / "data" / "golden_plans.json"
POLICIES = ("keep", "merge", "split", "pack", "auto")
# (template name recorded in the plan, tile_q, tile_kv, q_align, kv_align, unit_order)
CONFIGS = (
    ("mgpu_q128_kv128_s2_hm", 128, 128, 8, 8, "head_major"),
    ("mgpu_q128_kv64_s2_hm", 128, 64, 8, 8, "head_major"),
    ("mgpu_q64x2_kv64_s2_hm", 64, 64, 8, 8, "head_major"),
    ("mgpu_q128_kv64_s2_skip", 128, 64, 8, 8, "interleaved"),
    ("xla_64x64", 64, 64, 1, 1, "interleaved"),
)
GRIDS = ("wan480", "hy480")


def corpus_masks():
    from tessera_jax.masks.corpus import build, test_specs
    seen = set()
    for spec in test_specs():
        key = (spec["family"], spec["grid"])
        if spec["grid"] not in GRIDS or key in seen or spec.get("step", 0):
            continue
        if spec["family"] == "tokens":      # added after these digests (issue 15): not golden
            continue
        seen.add(key)
        yield f"{spec['family']}/{spec['grid']}/{spec['id']}", build(spec, heads=2), 2, 2


def random_masks(n: int = 24):
    import tessera_jax as tj
    rng = np.random.default_rng(20261201)
    for i in range(n):
        L = int(rng.integers(1, 700))
        Lk = int(rng.integers(1, 700)) if i % 3 else L
        def bounds(length):
            cuts = rng.choice(np.arange(1, length), size=min(length - 1, int(rng.integers(0, 40))),
                              replace=False) if length > 1 else np.array([], int)
            if i % 5 == 0 and length > 1:     # 1-token blocks
                cuts = np.arange(1, min(length, 48))
            return np.concatenate([[0], np.sort(cuts), [length]]).astype(np.int64)
        qb, kb = bounds(L), bounds(Lk)
        Hq, Hkv = ((4, 2), (4, 4), (2, 1))[i % 3]
        Hm = 1 if i % 2 else Hq
        blocks = rng.random((Hm, len(qb) - 1, len(kb) - 1)) < rng.uniform(0.05, 0.9)
        yield f"random{i}", tj.BlockMask(qb, kb, blocks), Hq, Hkv, L, Lk


def plan_digest(p) -> str:
    h = hashlib.sha256()
    for a in (p.units, p.steps):
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(repr((p.template, p.policy, p.tile_q, p.tile_kv, p.q_len_padded, p.kv_len_padded,
                   p.num_units, p.num_steps, p.max_steps, p.selected_interactions,
                   tuple(p.head_policies), p.unit_order)).encode())
    return h.hexdigest()[:24]


def _build_plan():
    try:
        from tessera_jax.planning import build_plan
    except ImportError:
        from tessera_jax.planning.planner import build_plan
    return build_plan


def all_digests(only_corpus: bool = False, config=None) -> dict[str, str]:
    """Every golden plan's digest; ``config``: the planner's ``PlannerConfig`` (None: the
    default)."""
    build_plan = _build_plan()
    kw = {} if config is None else {"config": config}
    cases = []
    for name, mask, Hq, Hkv in corpus_masks():
        Lq, Lk = int(mask.q_bounds[-1]), int(mask.kv_bounds[-1])
        cases.append((name, mask, Hq, Hkv, Lq, Lk))
    if not only_corpus:
        cases += list(random_masks())
    out = {}
    for name, mask, Hq, Hkv, Lq, Lk in cases:
        for tname, tq, tk, qa, ka, order in CONFIGS:
            for pol in POLICIES:
                p = build_plan(mask, (1, Lq, Hq, 64), (1, Lk, Hkv, 64), np.float32, tile_q=tq,
                               tile_kv=tk, policy=pol, q_align=qa, kv_align=ka, template=tname,
                               unit_order=order, **kw)
                out[f"{name}|{tname}|{pol}"] = plan_digest(p)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="record the digests")
    args = ap.parse_args(argv)
    d = all_digests()
    if args.write:
        PATH.parent.mkdir(exist_ok=True)
        PATH.write_text(json.dumps(d, indent=0, sort_keys=True) + "\n")
    print(f"{len(d)} plans")


if __name__ == "__main__":
    main()
