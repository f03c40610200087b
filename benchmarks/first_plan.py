"""The first ``tj.plan`` of a fresh process: import time, first plan, and whether numba loaded.

Each sample is a new Python process (``--child``) that imports ``tessera_jax`` and plans one
mask, timed with ``time.perf_counter``:

* ``small``: 4 x 4 causal blocks of 64 tokens, 2 heads, q/kv (1, 256, 2, 64) float32 (the house
  issue's "small mask"); its loops run interpreted (``PlannerConfig.loops`` "auto"), so
  numba is never imported.
* ``large``: the Wan2.1 720p ``sta`` mask of ``benchmarks/planning.py`` (1,440 cube blocks,
  40 heads, bf16, the default template and policy of the host): it loads numba and the
  compiled loops.

Numba cache: ``warm`` = a ``NUMBA_CACHE_DIR`` that a first (discarded) process filled; ``cold``
= a new empty ``NUMBA_CACHE_DIR`` for every sample (compiles the loops the plan calls).
Python's own bytecode cache matters as much as numba's on a fresh install: every sample runs
with ``PYTHONPYCACHEPREFIX`` pointing at one directory that a discarded first process filled
(as a normal ``pip install``, which writes ``.pyc`` files, leaves it), unless ``--no-pyc``
(``PYTHONDONTWRITEBYTECODE=1``, no prefix: every module compiled from source, as on a host
whose site-packages holds no ``.pyc``).

    .venv/bin/python benchmarks/first_plan.py [--repeats 5] [--out benchmarks/results/cpu-first-plan.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(case: str) -> dict:
    t0 = time.perf_counter()
    import numpy as np
    import tessera_jax as tj
    t_import = time.perf_counter() - t0
    if case == "small":
        b = np.arange(0, 257, 64)
        m = tj.BlockMask(b, b, np.tril(np.ones((4, 4), bool))[None].repeat(2, 0))
        args = ((1, 256, 2, 64), (1, 256, 2, 64), "float32")
        kw = {}
    else:
        sys.path.insert(0, HERE)
        import planning as P
        bounds, cgrid = P.cube_layout()
        blocks = np.stack([P.sta_blocks(cgrid, P.WINDOWS[h % len(P.WINDOWS)])
                           for h in range(P.HEADS)])
        m = tj.BlockMask(bounds, bounds, blocks)
        shape = (1, m.Lq, P.HEADS, P.HEAD_DIM)
        args = (shape, shape, "bfloat16")
        kw = {}
    m.digest
    numba_before = "numba" in sys.modules
    t0 = time.perf_counter()
    tj.plan(m, *args, **kw)
    t_plan = time.perf_counter() - t0
    return {"import_s": round(t_import, 4), "first_plan_s": round(t_plan, 4),
            "numba_imported_before_plan": numba_before,
            "numba_imported_after_plan": "numba" in sys.modules}


def _run(case, env):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", case], env=env,
                       capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(case: str, cache: str, repeats: int, pyc: bool, tmp: str) -> dict:
    env = dict(os.environ)
    env.pop("NUMBA_CACHE_DIR", None)
    if pyc:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pyc")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("PYTHONPYCACHEPREFIX", None)
    warm_dir = os.path.join(tmp, f"numba-warm-{case}")
    if cache == "warm":
        env["NUMBA_CACHE_DIR"] = warm_dir
        _run(case, env)                                  # fills both caches; not counted
    elif pyc:
        _run(case, dict(env, NUMBA_CACHE_DIR=os.path.join(tmp, "numba-discard")))
    samples = []
    for i in range(repeats):
        if cache == "cold":
            env["NUMBA_CACHE_DIR"] = os.path.join(tmp, f"numba-cold-{case}-{i}")
        samples.append(_run(case, env))
    med = lambda k: round(sorted(s[k] for s in samples)[len(samples) // 2], 4)  # noqa: E731
    return {"case": case, "numba_cache": cache, "pyc": pyc,
            "first_plan_s_median": med("first_plan_s"), "import_s_median": med("import_s"),
            "first_plan_s_min": min(s["first_plan_s"] for s in samples),
            "numba_imported_after_plan": any(s["numba_imported_after_plan"] for s in samples),
            "samples": samples}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=["small", "large"])
    ap.add_argument("--no-pyc", action="store_true", help="PYTHONDONTWRITEBYTECODE=1 instead")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child)))
        return None
    load0 = list(os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            for cache in ("warm", "cold"):
                r = measure(case, cache, a.repeats, not a.no_pyc, tmp)
                rows.append(r)
                print(f"{case:5s} numba cache {cache:4s}: first plan {r['first_plan_s_median']:.3f} s "
                      f"(min {r['first_plan_s_min']:.3f}), import {r['import_s_median']:.3f} s, "
                      f"numba loaded: {r['numba_imported_after_plan']}", flush=True)
    import numpy as np
    result = {
        "command": " ".join([".venv/bin/python", "benchmarks/first_plan.py"]
                            + (argv if argv is not None else sys.argv[1:])),
        "what": "first tj.plan of a fresh process (after `import tessera_jax`), medians of "
                "--repeats processes; small = 4x4 causal blocks of 64, (1,256,2,64) float32",
        "targets": {"small_warm_first_plan_s": 0.3},
        "load_average_before_after": [load0, list(os.getloadavg())],
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "numpy": np.__version__},
        "runs": rows,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", a.out)
    return result


if __name__ == "__main__":
    main()
