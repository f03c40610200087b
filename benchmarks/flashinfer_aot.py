#!/usr/bin/env python3
"""Install FlashInfer modules built on a GPU machine into the carried site as AOT artifacts, so
a fresh machine loads them instead of JIT-building them (the fa3 batch-prefill module: ~80-100 s
of every session's first peers call).

FlashInfer loads ``flashinfer/data/aot/<name>/<name>.so`` when it exists, before any JIT build
(``flashinfer.jit.env.get_aot_artifacts``). ``h200_session.sh``'s peers parts leave the module
they built under ``$OUT`` as ``<name>.so.xz``; copy those files here (e.g. ``.carry/fi_aot/``)
and run

    .venv/bin/python benchmarks/flashinfer_aot.py .carry/fi_aot/*.so.xz [--drop-jit-headers]

``--drop-jit-headers`` removes CUTLASS's and CCCL's headers (the JIT build's, ~29 MiB) so the
site and the modules fit the 64 MiB carry together; a module not installed here then cannot be
built on the machine (peers.py needs only the bf16, head_dim 128 fa3 batch-prefill module).
It prints the sizes and checks, through ``--probe-python``, that FlashInfer resolves each
module to its AOT artifact.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

from fetch_flashinfer import REPO, mib, tree_size

JIT_HEADERS = ("data/cutlass", "data/cccl")


def module_name(path: Path) -> str:
    """``<name>`` of ``<name>.so`` or ``<name>.so.xz``; a ValueError for anything else."""
    name = path.name
    for suffix in (".so.xz", ".so"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"module file must be <name>.so or <name>.so.xz, got {path}")


def install(path: Path, pkg: Path) -> Path:
    """Writes ``path`` (decompressed where it is .xz) to ``pkg/data/aot/<name>/<name>.so``."""
    name = module_name(path)
    dest = pkg / "data" / "aot" / name / f"{name}.so"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".xz"):
        with lzma.open(path) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)
    else:
        shutil.copyfile(path, dest)
    return dest


def check(python: str, site: Path, names: list[str]) -> bool:
    code = ("import sys; from flashinfer.jit import env\n"
            "for n in sys.argv[1:]:\n"
            "    a = env.get_aot_artifacts(n)\n"
            "    print(n, [str(x.path) for x in a]); assert a, n\n")
    r = subprocess.run([python, "-c", code, *names], capture_output=True, text=True,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin",
                            # no __pycache__ in the carried site (~11 MB)
                            "PYTHONDONTWRITEBYTECODE": "1"})
    print(r.stdout + r.stderr)
    return r.returncode == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="+", type=Path, help="<name>.so or <name>.so.xz files")
    ap.add_argument("--site", type=Path, default=REPO / ".carry" / "flashinfer_site")
    ap.add_argument("--drop-jit-headers", action="store_true")
    ap.add_argument("--probe-python", default="/tmp/fi_venv/bin/python",
                    help="a Python with torch (FlashInfer's import needs it); skipped if absent")
    ap.add_argument("--budget-mib", type=float, default=55.0)
    a = ap.parse_args(argv)
    pkg = a.site / "flashinfer"
    if not pkg.is_dir():
        ap.error(f"--site {a.site} has no flashinfer package (benchmarks/fetch_flashinfer.py)")
    names = []
    for m in a.modules:
        dest = install(m, pkg)
        names.append(module_name(m))
        print(f"{dest.relative_to(a.site)}: {mib(dest.stat().st_size)}")
    if a.drop_jit_headers:
        for rel in JIT_HEADERS:
            p = pkg / rel
            print(f"dropped {rel}: {mib(tree_size(p))}")
            shutil.rmtree(p, ignore_errors=True)
    total = tree_size(a.site)
    ok = total <= a.budget_mib * 2**20
    print(f"site: {mib(total)} (budget {a.budget_mib} MiB){'' if ok else ': OVER'}")
    if Path(a.probe_python).exists():
        ok &= check(a.probe_python, a.site.resolve(), names)
    else:
        print(f"no {a.probe_python}: FlashInfer's resolution not checked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
