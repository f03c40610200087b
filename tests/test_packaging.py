"""Packaging and fresh-process behaviour (house issue item 5).

* The wheel ships the plan tables (the top-level ``plan_tables/*.json``, as
  ``tessera_jax/plan_tables/``) and an installed, non-editable copy selects by them; the source
  tree finds the same tables at the top level; ``pyproject.toml`` lists every package.
* A fresh process plans a small mask without importing numba (its loops run interpreted), and
  the interpreted loops give the golden plans byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import tomllib
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TESSERA_JAX_PLAN_TABLES", "NUMBA_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def _build_wheel(tmp: pathlib.Path) -> pathlib.Path:
    """``pip wheel`` of a copy of the project's sources (no build files in the work tree)."""
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc")
    for pkg in ("tessera_jax", "pallas_kernels", "plan_tables"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=junk)
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w",
           str(tmp / "dist")]
    if importlib.util.find_spec("setuptools") is not None:
        cmd.append("--no-build-isolation")        # offline; else pip fetches setuptools
    subprocess.run(cmd, check=True, cwd=tmp, env=_env(), timeout=300)
    (wheel,) = (tmp / "dist").glob("tessera_jax-*.whl")
    return wheel


# Runs in the installed copy: the editable install's finder is dropped, so that nothing of the
# work tree can be imported.
_INSTALLED_CHECK = r"""
import json, sys, warnings
sys.meta_path[:] = [f for f in sys.meta_path
                    if not str(getattr(f, "__module__", "")).startswith("__editable__")]
warnings.simplefilter("error")          # "no plan table ... heuristic" would raise
import numpy as np
import pallas_kernels
import tessera_jax as tj
from tessera_jax.select import ranking
from tessera_jax.validation import check_shapes

ranking._current_device = lambda: ("h200", "9.0")     # an H200, seen from this CPU host
d = ranking.table_dir()
path, exact = ranking.find_table(ranking.gpu_name("NVIDIA H200"), ranking.gpu_arch("h200"))
table = ranking.load_table(path)
b = np.arange(0, 2049, 64)
masks = [tj.BlockMask(b, b, np.tril(np.ones((1, 32, 32), bool))),
         tj.BlockMask(b, b, np.eye(32, dtype=bool)[None] | np.eye(32, k=5, dtype=bool)[None])]
shape = check_shapes((1, 2048, 2, 128), (1, 2048, 2, 128), "bfloat16")
picks = [ranking.select(m, shape, "mosaic_gpu") for m in masks]
with_table = [ranking.select(m, shape, "mosaic_gpu", table=table) for m in masks]
# The first plan of this process (CPU, XLA backend): a small mask, no numba.
p = tj.plan(masks[0], (1, 2048, 2, 64), (1, 2048, 2, 64), "float32")
print(json.dumps({
    "files": [tj.__file__, pallas_kernels.__file__, ranking.__file__],
    "table_dir": str(d), "table": str(path), "exact": exact,
    "candidates": [list(c) for c in table.candidates],
    "picks": [list(c) for c in picks], "with_table": [list(c) for c in with_table],
    "plan_units": int(p.num_units), "numba": "numba" in sys.modules,
}))
"""


def test_wheel_ships_plan_tables_and_selects_by_them(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "tessera_jax/plan_tables/h200.json" in names
    assert "tessera_jax/plan_tables/README.md" in names
    assert not [n for n in names if n.startswith("plan_tables/")], "tables ship inside the package"
    assert not [n for n in names if "/raw/" in n], "raw profiler timings must not ship"

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(site), str(wheel)], check=True, env=_env(), timeout=300)
    run = tmp_path / "run"                     # outside the repository
    run.mkdir()
    r = subprocess.run([sys.executable, "-c", _INSTALLED_CHECK], cwd=run, capture_output=True,
                       text=True, env=_env(PYTHONPATH=str(site)), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])

    for f in out["files"]:                      # the installed copy, not the work tree
        assert pathlib.Path(f).resolve().is_relative_to(site.resolve()), out["files"]
    assert pathlib.Path(out["table_dir"]) == site / "tessera_jax" / "plan_tables"
    assert out["exact"] and out["table"] == str(site / "tessera_jax" / "plan_tables" / "h200.json")
    # Selection used the shipped table (no warning, which would have raised): each pick is
    # one of its candidates, the one the table ranks first among those that take the call.
    assert out["picks"] == out["with_table"]
    assert all(p in out["candidates"] for p in out["picks"])
    assert out["plan_units"] > 0 and not out["numba"]


def test_source_tree_finds_the_top_level_tables(monkeypatch):
    from tessera_jax.select import ranking
    monkeypatch.delenv("TESSERA_JAX_PLAN_TABLES", raising=False)
    assert ranking.table_dir() == ROOT / "plan_tables"
    path, exact = ranking.find_table("h200", "hopper")
    assert exact and path == ROOT / "plan_tables" / "h200.json"
    assert ranking.load_table(path).candidates


def test_pyproject_lists_every_package():
    """``packages`` is a list (``packages.find`` can't map ``plan_tables/``): a new package of
    the source tree must be added to it, else the wheel leaves it out."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(f.parent.relative_to(ROOT).parts)
             for pkg in ("tessera_jax", "pallas_kernels") for f in (ROOT / pkg).rglob("__init__.py")}
    assert listed == found | {"tessera_jax.plan_tables"}


_FIRST_PLAN = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import tessera_jax as tj
t1 = time.perf_counter()
b = np.arange(0, 257, 64)
m = tj.BlockMask(b, b, np.tril(np.ones((4, 4), bool))[None].repeat(2, 0))
t2 = time.perf_counter()
tj.plan(m, (1, 256, 2, 64), (1, 256, 2, 64), "float32")
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_plan_s": t3 - t2, "numba": "numba" in sys.modules}))
"""


def test_first_plan_of_a_fresh_process_is_fast_and_needs_no_numba(tmp_path):
    """The house issue's target is <= 0.3 s (``benchmarks/first_plan.py`` measures it: ~0.02 s
    on the 2-core CPU box); here a loose bound that a loaded CI box still meets, and the
    deterministic reason: numba is not imported for a small plan."""
    r = subprocess.run([sys.executable, "-c", _FIRST_PLAN], cwd=tmp_path, capture_output=True,
                       text=True, env=_env(NUMBA_CACHE_DIR=str(tmp_path / "numba")),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["numba"], "a small plan imported numba"
    assert out["first_plan_s"] <= 2.0, out


def test_interpreted_loops_give_the_golden_plans(monkeypatch):
    """Every loop call interpreted (none compiled) on the golden random masks: the plans are
    the recorded golden digests, byte for byte (the compiled loops give them too:
    ``test_golden_plans``)."""
    import golden_plans
    from tessera_jax.planning import PlannerConfig, loops, planner

    def no_compiling(*args):
        raise AssertionError("a compiled loop was called")
    monkeypatch.setattr(loops, "compile_all", no_compiling)
    for name in loops._PLAIN:                        # the compiled loops, if loaded already
        monkeypatch.setattr(loops, name, no_compiling)
    interpreted = PlannerConfig(loops="interpreted")

    want = json.loads(golden_plans.PATH.read_text())
    build = golden_plans._build_plan()
    planner._build_cached.cache_clear()
    try:
        changed = []
        for name, mask, Hq, Hkv, Lq, Lk in golden_plans.random_masks():
            for tname, tq, tk, qa, ka, order in golden_plans.CONFIGS:
                for pol in golden_plans.POLICIES:
                    p = build(mask, (1, Lq, Hq, 64), (1, Lk, Hkv, 64), np.float32, tile_q=tq,
                              tile_kv=tk, policy=pol, q_align=qa, kv_align=ka, template=tname,
                              unit_order=order, config=interpreted)
                    p.row_index                    # made by an interpreted loop too
                    key = f"{name}|{tname}|{pol}"
                    if golden_plans.plan_digest(p) != want[key]:
                        changed.append(key)
    finally:
        planner._build_cached.cache_clear()
    assert not changed, f"{len(changed)} plans differ interpreted, e.g. {changed[:5]}"


def test_int32_stores_wrap_as_compiled():
    from tessera_jax.planning import loops
    a = np.zeros(3, np.int32).view(loops._Int32Out)
    a[0] = 2 ** 31 + 5                     # Python int: wraps (NumPy alone would raise)
    a[1] = np.int64(-(2 ** 31) - 1)
    a[2:] = np.array([2 ** 32 + 7])
    assert a.view(np.ndarray).tolist() == [-(2 ** 31) + 5, 2 ** 31 - 1, 7]
