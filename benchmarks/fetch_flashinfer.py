#!/usr/bin/env python3
"""Fetch FlashInfer 0.7.2.post1 (+ apache-tvm-ffi) from PyPI and trim it to the block-sparse prefill
path, so it fits the GPU machine's 64 MiB carry (that machine has no network; issue 7).

Run here (PyPI reachable; nvcc, if present, makes the trim exact and checks it):

    .venv/bin/python benchmarks/fetch_flashinfer.py [--probe-python PY] [--check preprocess]

It downloads the wheels into ``--wheels`` (default /tmp/fi_wheels), unpacks them, and writes the
trimmed site folder ``.carry/flashinfer_site/`` (git-ignored: never commit FlashInfer's files).
What stays:
- the Python modules that ``import flashinfer``, the two wrappers and the JIT spec generators of
  the fa2/fa3 batch-prefill and decode modules load, found by running them in ``--probe-python``
  (a Python with torch + jinja2; torch needs no GPU for this), closed over module-level imports,
  plus the wrappers' own lazily imported modules (``ALWAYS_MODULES``);
- the CUDA sources/templates those generators read, and the headers their builds include:
  exactly, from ``nvcc -M`` (host and sm90a device passes) with each module's own build.ninja
  flags, when nvcc is on the PATH; else (or with ``--conservative``) the whole ``#include``
  closure through FlashInfer's, CUTLASS/CuTe's, CCCL's and spdlog's headers;
- apache-tvm-ffi (without its C++/Cython sources and libbacktrace's sources).
What goes: tests, docs, experimental/, MoE, GEMM, comm, MLA, sm100/sm120 kernels, FP4/FP8 GEMMs,
CuTe-DSL kernels, cutlass examples/python, unused headers, the packbits module (only BSR in-block
masks need it: ``--with-packbits`` keeps it). It prints the sizes and what was dropped, then
checks, through ``--probe-python``, that ``import flashinfer`` and the wrappers import from the
trimmed folder and that the specs' sources exist; with ``--check preprocess`` (default) and nvcc
it runs ``nvcc -E`` (host + device preprocessing, cheap) on every distinct source of every
module with its build's flags against the trimmed tree. (Constructing a wrapper needs a CUDA
driver: its pinned host buffer; and plan() needs the GPU.)

The GPU image already has torch 2.11, numpy, einops, ninja, jinja2, click, requests, tabulate,
tqdm, packaging, nvidia-ml-py and cuda-bindings/core/pathfinder (KINDS.md); FlashInfer's other
requirements (cuda-tile, nvidia-cutlass-dsl, nvidia-cudnn-frontend, nccl4py, ...) are not
imported on this path and are left out.

Device ``run``: FlashInfer JIT-compiles its fa3 (sm90a) batch-prefill module with nvcc (present
there) on the first plan(): minutes the first time on a fresh machine; the build is cached under
FLASHINFER_WORKSPACE_BASE for the rest of that machine's life (it goes back 30 s after a call).

    run(carry=[".carry"], timeout_s=600, command=
        "export PYTHONPATH=$PWD/.carry/flashinfer_site:$PWD:$PYTHONPATH "
        "FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1; "
        "python3 benchmarks/peers.py --out $OUT/h200-peers.json --time-budget 480 "
        "--per-family 2 --heads 8")

(FLASHINFER_WORKSPACE_BASE: JIT cache, generated sources and built .so under /tmp/fi_ws/.cache;
FLASHINFER_CUDA_ARCH_LIST=9.0a: build for the H200 only; MAX_JOBS: parallel nvcc jobs.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLASHINFER = "flashinfer-python==0.7.2.post1"
#: Runtime deps the GPU image lacks (flashinfer needs apache-tvm-ffi>=0.1.11,<0.2).
EXTRA_DEPS = ("apache-tvm-ffi==0.1.15.post2",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
#: Python modules kept whatever the probe says (the path's own lazily imported modules).
ALWAYS_MODULES = ("sparse.py", "prefill.py", "decode.py", "utils.py", "api_logging.py",
                  "quantization/packbits.py", "jit/core.py", "jit/cpp_ext.py", "jit/env.py",
                  "jit/utils.py", "jit/attention/modules.py", "jit/attention/utils.py",
                  "jit/attention/variants.py", "jit/quantization.py", "jit/_cuda_architecture.py",
                  "version.py", "_build_meta.py")
#: Include dirs of FlashInfer's JIT build (jit/env.py, jit/cpp_ext.py), in search order.
INCLUDE_DIRS = ("data/cccl/cub", "data/cccl/libcudacxx/include", "data/cccl/thrust",
                "data/include", "data/csrc", "data/cutlass/include",
                "data/cutlass/tools/util/include", "data/spdlog/include")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
MACRO_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+[A-Za-z_]', re.M)

PROBE = r'''
import builtins, io, json, os, sys
PKG = os.path.realpath(sys.argv[1]); OUT = sys.argv[2]; WS = sys.argv[3]
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
os.environ["FLASHINFER_WORKSPACE_BASE"] = WS
opened = set(); _open = builtins.open
def rec_open(f, *a, **k):
    try:
        p = os.path.realpath(os.fspath(f))
        if p.startswith(PKG + os.sep): opened.add(p)
    except TypeError:
        pass
    return _open(f, *a, **k)
builtins.open = io.open = rec_open
import torch
import flashinfer
from flashinfer import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper
from flashinfer.sparse import convert_bsr_mask_layout
from flashinfer.prefill import get_batch_prefill_module
from flashinfer.jit.attention import modules as M
from flashinfer.jit.quantization import gen_quantization_module
bf = torch.bfloat16
args = (bf, bf, bf, torch.int32, 128, 128, 0, False, False, False)
specs = [M.gen_batch_prefill_module("fa3", *args), M.gen_batch_prefill_module("fa2", *args),
         M._gen_batch_prefill_primary_module("fa2", *args),
         M._gen_batch_prefill_independent_paged_module("fa2", *args),
         M.gen_batch_decode_module(bf, bf, bf, torch.int32, 128, 128, 0, False, False)]
if os.environ.get("FI_TRIM_PACKBITS") == "1":    # only BSR in-block (custom) masks need it
    specs.append(gen_quantization_module())
for s in specs:      # everything up to the nvcc call: writes build.ninja, imports the build path
    try:
        s.write_ninja()
    except Exception as e:
        print("write_ninja:", s.name[:60], type(e).__name__, str(e)[:200])
mods = sorted({os.path.realpath(m.__file__) for m in list(sys.modules.values())
               if getattr(m, "__file__", None) and os.path.realpath(m.__file__).startswith(PKG + os.sep)})
out = {"version": flashinfer.__version__, "modules": mods, "opened": sorted(opened),
       "specs": [{"name": s.name, "sources": [str(x) for x in s.sources],
                  "ninja": str(s.ninja_path) if s.ninja_path.exists() else None} for s in specs]}
with _open(OUT, "w") as f:
    json.dump(out, f, indent=1)
print("probe ok", flashinfer.__version__, len(mods), "modules")
'''


def log(*a):
    print(*a, flush=True)


def mib(n: int) -> str:
    return f"{n / 2**20:7.1f} MiB"


def tree_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


# --------------------------------------------------------------------------------------------
def download(wheels: Path) -> list[Path]:
    """pip download of the FlashInfer wheel and the extra deps, for cp312 x86_64 manylinux."""
    wheels.mkdir(parents=True, exist_ok=True)
    for req in (FLASHINFER,) + EXTRA_DEPS:
        name = req.split("==")[0].replace("-", "_")
        if any(wheels.glob(f"{name}-{req.split('==')[1]}-*.whl")):
            log(f"have {req}")
            continue
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(wheels), req]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        log("+", " ".join(cmd))
        subprocess.run(cmd, check=True)
    out = []
    for req in (FLASHINFER,) + EXTRA_DEPS:
        name, ver = req.split("==")
        found = sorted(wheels.glob(f"{name.replace('-', '_')}-{ver}-*.whl"))
        if not found:
            raise SystemExit(f"no wheel for {req} in {wheels}")
        out.append(found[-1])
    return out


def unpack(whls: list[Path], dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for w in whls:
        with zipfile.ZipFile(w) as z:
            z.extractall(dest)
        log(f"unpacked {w.name} ({mib(w.stat().st_size)} wheel)")


def run_probe(python: str, site: Path, work: Path) -> dict:
    """Runs PROBE with ``site`` first on PYTHONPATH; returns its JSON."""
    out = work / "probe.json"
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               FLASHINFER_CUDA_ARCH_LIST="9.0a", CUDA_VISIBLE_DEVICES="")
    script = work / "probe.py"
    script.write_text(PROBE)
    r = subprocess.run([python, str(script), str(site / "flashinfer"), str(out), str(work / "ws")],
                       env=env, capture_output=True, text=True, timeout=900, cwd=str(work))
    sys.stdout.write(r.stdout[-3000:])
    if r.returncode:
        sys.stderr.write(r.stderr[-6000:])
        raise RuntimeError(f"probe failed (rc={r.returncode}) with {python} on {site}")
    return json.loads(out.read_text())


# --------------------------------------------------------------------------------------------
def _module_imports(path: Path, pkg_root: Path, top_level_only: bool) -> set[Path]:
    """flashinfer modules a file imports (module level, or everywhere)."""
    import ast
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return set()
    out: set[Path] = set()
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if top_level_only and isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for sub in getattr(node, field, []) or []:
                    stack.extend(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])
            continue
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                mod = base.relative_to(pkg_root.parent).as_posix().replace("/", ".")
                mod = f"{mod}.{node.module}" if node.module else mod
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            if not n.startswith("flashinfer"):
                continue
            rel = Path(*n.split("."))
            for cand in (pkg_root.parent / rel.with_suffix(".py"), pkg_root.parent / rel / "__init__.py"):
                if cand.is_file():
                    out.add(cand.resolve())
    return out


def python_keep(site: Path, probe: dict) -> set[Path]:
    """Loaded modules + ALWAYS_MODULES, closed over module-level imports, + package __init__s."""
    pkg = (site / "flashinfer").resolve()
    keep = {Path(m) for m in probe["modules"]}
    keep |= {(pkg / m).resolve() for m in ALWAYS_MODULES if (pkg / m).is_file()}
    todo = list(keep)
    while todo:
        f = todo.pop()
        for dep in _module_imports(f, pkg, top_level_only=True):
            if dep not in keep:
                keep.add(dep)
                todo.append(dep)
    for f in list(keep):
        d = f.parent
        while d != pkg.parent and pkg in (d, *d.parents):
            init = d / "__init__.py"
            if init.is_file():
                keep.add(init)
            d = d.parent
    # files the import/spec-generation read (json tables, jinja templates, sources)
    keep |= {Path(p) for p in probe["opened"]}
    return keep


def include_closure(site: Path, sources: list[Path]) -> tuple[set[Path], set[str]]:
    """Headers under data/ reachable from ``sources`` by #include (conservative), + unresolved."""
    pkg = (site / "flashinfer").resolve()
    dirs = [pkg / d for d in INCLUDE_DIRS]
    seen: set[Path] = set()
    unresolved: set[str] = set()
    todo = [s.resolve() for s in sources if s.is_file()]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        if MACRO_INCLUDE_RE.search(text):
            unresolved.add(f"{f.name}: #include MACRO")
        for kind, name in INCLUDE_RE.findall(text):
            cands = ([f.parent / name] if kind == '"' else []) + [d / name for d in dirs]
            hit = next((c for c in cands if c.is_file()), None)
            if hit is None:
                unresolved.add(name)
            else:
                todo.append(hit.resolve())
    return {p for p in seen if pkg in p.parents}, unresolved


def _ninja_flags(ninja: Path) -> list[str]:
    """common + CUDA flags of a FlashInfer build.ninja, variables expanded."""
    var = {}
    text = re.sub(r"\$\n\s*", " ", ninja.read_text())          # ninja line continuations
    for line in text.splitlines():
        m = re.match(r"^(\w+)\s*=\s*(.*)$", line)
        if m:
            var[m.group(1)] = m.group(2)

    def expand(s: str) -> str:
        for _ in range(5):
            s = re.sub(r"\$(\w+)", lambda m: var.get(m.group(1), ""), s)
        return s

    flags = expand(var.get("common_cflags", "")).split() + expand(var.get("cuda_cflags", "")).split()
    return [f for f in flags if not f.startswith("--compress-mode")]


def _representative_sources(spec: dict) -> list[Path]:
    """One source per distinct file (kernels differing only in their mask mode share includes)."""
    out, seen = [], set()
    for s in spec["sources"]:
        key = re.sub(r"_mask_\d+", "_mask_N", Path(s).name)
        if key not in seen:
            seen.add(key)
            out.append(Path(s))
    return out


_MISSING_RE = re.compile(r"fatal error: ([^:\s]+): No such file or directory")
#: Toolkit headers this machine's CUDA lacks (e.g. curand_kernel.h), stubbed for nvcc -M/-E only.
STUBBED: set[str] = set()


def _nvcc(mode: str, flags: list[str], src: Path, stub_dir: Path) -> subprocess.CompletedProcess:
    """``nvcc -M``/``-E`` with the build's flags; a toolkit header missing *here* (not in the
    package) gets an empty stub in ``stub_dir`` (searched last) and the run is retried."""
    for _ in range(30):
        cmd = " ".join([shutil.which("nvcc"), mode, *(["-o", os.devnull] if mode == "-E" else []),
                        *flags, f"-isystem {stub_dir}", str(src)])
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=900)
        m = _MISSING_RE.search(r.stderr)
        if r.returncode == 0 or not m or m.group(1).startswith(("flashinfer/", "cutlass/", "cute/")):
            return r
        (stub_dir / m.group(1)).parent.mkdir(parents=True, exist_ok=True)
        (stub_dir / m.group(1)).write_text("// stub: missing from this machine's CUDA toolkit\n")
        STUBBED.add(m.group(1))
    return r


def nvcc_deps(probe: dict, pkg: Path, stub_dir: Path) -> set[Path] | None:
    """Exact headers (host and sm90a device passes) via ``nvcc -M`` with each build's flags."""
    if not shutil.which("nvcc") or not all(spec["ninja"] for spec in probe["specs"]):
        return None
    deps: set[Path] = set()
    for spec in probe["specs"]:
        flags = _ninja_flags(Path(spec["ninja"]))
        for src in _representative_sources(spec):
            r = _nvcc("-M", flags, src, stub_dir)
            if r.returncode:
                log(f"  nvcc -M failed on {src.name}: {r.stderr[-1500:]}")
                return None
            for tok in r.stdout.replace("\\\n", " ").split():
                if tok.endswith(":") or tok == "\\":
                    continue
                p = Path(tok).resolve()
                if pkg in p.parents:
                    deps.add(p)
            log(f"  nvcc -M {src.name[:70]}: {len(deps)} package files so far")
    return deps


def trim(site: Path, probe: dict, exact: bool = True) -> dict:
    """Deletes from ``site/flashinfer`` every file not needed; returns a report."""
    pkg = (site / "flashinfer").resolve()
    keep = python_keep(site, probe)
    sources = [Path(s) for spec in probe["specs"] for s in spec["sources"]]
    # sources are generated copies (workspace) or csrc files; csrc twins of generated files
    # (copied from csrc by the generators) are kept by name.
    csrc = pkg / "data" / "csrc"
    for s in list(sources):
        twin = csrc / s.name
        if twin.is_file():
            keep.add(twin.resolve())
            sources.append(twin)
    _, unresolved = include_closure(site, sources)
    stub_dir = Path(tempfile.mkdtemp(prefix="fi_stubs_"))
    headers = nvcc_deps(probe, pkg, stub_dir) if exact else None
    how = "nvcc -M (exact, host + sm90a device passes)"
    if headers is None:
        headers, _ = include_closure(site, sources + [p for p in keep if p.suffix in
                                                      (".cu", ".cuh", ".h", ".inc")])
        how = "#include closure (conservative: every include under any #if)"
    log(f"headers kept by {how}: {len(headers)}")
    keep |= headers
    dropped: dict[str, int] = {}
    kept_bytes = 0
    for f in sorted(pkg.rglob("*")):
        if not f.is_file():
            continue
        rf = f.resolve()
        if rf in keep:
            kept_bytes += f.stat().st_size
            continue
        rel = f.relative_to(pkg).parts
        key = "flashinfer/" + "/".join(rel[:3] if rel[0] == "data" else rel[:1])
        dropped[key] = dropped.get(key, 0) + f.stat().st_size
        f.unlink()
    # tvm_ffi: its C++/Cython sources and libbacktrace's sources aren't used.
    tvm = site / "tvm_ffi"
    for rel in ("3rdparty/libbacktrace", "src", "cython"):
        p = tvm / rel
        if p.exists():
            dropped[f"tvm_ffi/{rel}"] = tree_size(p) if p.is_dir() else p.stat().st_size
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    # wheel RECORDs (only pip uninstall reads them) and the wheel's build helpers
    for rec in site.glob("*.dist-info/RECORD"):
        dropped[str(rec.relative_to(site))] = rec.stat().st_size
        rec.write_text("")
    for extra in ("build_backend.py", "build_utils.py", "b12x"):
        p = site / extra
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for d in sorted((p for p in site.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return {"kept_bytes": kept_bytes, "dropped": dropped, "unresolved_includes": sorted(unresolved),
            "exact": how.startswith("nvcc")}


# --------------------------------------------------------------------------------------------
def check_tree(site: Path, python: str, work: Path, nvcc_check: str,
               baseline_unresolved: set[str], exact: bool) -> bool:
    """Import + spec generation from the trimmed tree; every source (and, for a conservative
    trim, every #include) there; then ``nvcc -E`` of each distinct source (the exact check)."""
    probe = run_probe(python, site, work)
    ok = True
    for spec in probe["specs"]:
        srcs = [Path(s) for s in spec["sources"]]
        missing = [str(s) for s in srcs if not s.is_file()]
        _, unresolved = include_closure(site, srcs)
        # includes the full tree couldn't resolve either are CUDA/system/tvm-ffi headers or
        # sit under #if branches the build doesn't take; an exact (nvcc -M) trim also drops
        # headers under untaken #if branches (msvc, nvrtc, ...), so only nvcc -E judges it
        lost = sorted(u for u in unresolved - baseline_unresolved if _is_ours(u))
        if exact:
            lost = []
        if missing or lost:
            ok = False
            log(f"  MISSING for {spec['name'][:70]}: sources {missing[:5]}, includes {lost[:10]}")
        else:
            log(f"  files ok: {spec['name'][:90]} ({len(srcs)} sources)")
    if nvcc_check == "preprocess":
        if not shutil.which("nvcc"):
            log("  nvcc not on PATH: preprocessor check skipped")
        else:
            for spec in probe["specs"]:
                if not spec["ninja"]:
                    log(f"  no build.ninja for {spec['name'][:60]}: nvcc -E skipped")
                    continue
                flags = _ninja_flags(Path(spec["ninja"]))
                for src in _representative_sources(spec):
                    ok &= _preprocess_one(src, flags, spec["name"])
    return ok


def _is_ours(name: str) -> bool:
    return name.split("/")[0] in ("flashinfer", "cutlass", "cute", "cub", "thrust", "spdlog") or \
        name.startswith("cuda/") or name.endswith((".cuh", ".inc", ".jinja"))


def _preprocess_one(src: Path, flags: list[str], name: str) -> bool:
    """``nvcc -E`` (host and sm90a device preprocessing) of one source with its build's flags."""
    r = _nvcc("-E", flags, src, Path(tempfile.mkdtemp(prefix="fi_stubs_")))
    if r.returncode:
        log(f"  nvcc -E FAILED on {src.name} ({name[:60]}):\n{r.stderr[-2000:]}")
        return False
    log(f"  nvcc -E ok: {src.name[:60]} ({name[:50]})")
    return True


# --------------------------------------------------------------------------------------------
def find_probe_python(arg: str | None) -> str | None:
    cands = [arg] if arg else [sys.executable, "/tmp/fi_venv/bin/python", "python3"]
    for c in cands:
        if not c:
            continue
        try:
            r = subprocess.run([c, "-c", "import torch, jinja2"], capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return c
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(REPO / ".carry" / "flashinfer_site"))
    ap.add_argument("--wheels", default="/tmp/fi_wheels")
    ap.add_argument("--probe-python", default=None,
                    help="a Python with torch + jinja2 (default: this one, /tmp/fi_venv, python3)")
    ap.add_argument("--check", choices=("none", "files", "preprocess"), default="preprocess")
    ap.add_argument("--budget-mib", type=float, default=55.0)
    ap.add_argument("--with-packbits", action="store_true",
                    help="also keep the packbits (segment_packbits) JIT module: only BSR "
                         "in-block (custom) masks need it, and peers.py uses none")
    ap.add_argument("--conservative", action="store_true",
                    help="keep the whole #include closure instead of nvcc -M's exact list")
    a = ap.parse_args(argv)

    dest = Path(a.dest).resolve()
    os.environ["FI_TRIM_PACKBITS"] = "1" if a.with_packbits else "0"
    python = find_probe_python(a.probe_python)
    if python is None:
        log("no Python with torch found (--probe-python): can't find what `import flashinfer` "
            "loads. Make one, e.g.: python3 -m venv /tmp/fi_venv && /tmp/fi_venv/bin/pip install "
            "torch==2.11.0 numpy einops click requests tabulate tqdm packaging ninja nvidia-ml-py "
            "cuda-bindings jinja2")
        return 2
    whls = download(Path(a.wheels))
    with tempfile.TemporaryDirectory(prefix="fi_trim_") as tmp:
        work = Path(tmp)
        full = work / "site"
        unpack(whls, full)
        before = {p.name: tree_size(p) for p in full.iterdir() if p.is_dir()}
        total_before = tree_size(full)
        log(f"unpacked: {mib(total_before)}")
        probe = run_probe(python, full, work)
        log(f"flashinfer {probe['version']}: {len(probe['modules'])} modules loaded, "
            f"{len(probe['opened'])} package files read, {len(probe['specs'])} JIT specs")
        rep = trim(full, probe, exact=not a.conservative)
        log(f"{len(rep['unresolved_includes'])} #include names resolve outside the package "
            f"(CUDA toolkit, system, tvm-ffi, generated config) or under unused #if branches")
        log("dropped (largest first):")
        for k, v in sorted(rep["dropped"].items(), key=lambda kv: -kv[1])[:25]:
            log(f"  {mib(v)}  {k}")
        log(f"  {mib(sum(rep['dropped'].values()))}  in all ({len(rep['dropped'])} groups)")
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(full), str(dest))
    after = {p.name: tree_size(p) for p in dest.iterdir() if p.is_dir()}
    log("kept, per top folder (before -> after):")
    for k in sorted(before, key=lambda k: -before[k]):
        log(f"  {k:45s} {mib(before[k])} -> {mib(after.get(k, 0))}")
    pkg = dest / "flashinfer"
    for sub in ("data/include", "data/csrc", "data/cutlass", "data/cccl", "data/spdlog"):
        p = pkg / sub
        log(f"  flashinfer/{sub:36s} {mib(tree_size(p) if p.exists() else 0)}")
    total = tree_size(dest)
    log(f"total: {mib(total_before)} -> {mib(total)} (budget {a.budget_mib} MiB)")
    ok = total <= a.budget_mib * 2**20
    if not ok:
        log("OVER BUDGET")
    if a.check != "none":
        with tempfile.TemporaryDirectory(prefix="fi_check_") as tmp:
            log(f"checking the trimmed tree with {python}:")
            ok &= check_tree(dest, python, Path(tmp), a.check, set(rep["unresolved_includes"]),
                             rep["exact"])
    if STUBBED:
        log(f"note: this machine's CUDA toolkit lacks {sorted(STUBBED)}; they were stubbed for the "
            f"nvcc -M/-E checks only (the GPU machine's toolkit must provide them)")
    log("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
