"""Plots of the result files as PNGs in ``--out-dir`` (default /tmp/tessera-plots):
forward+backward times per mask (``h200-backward.json``), the compiled loops' times per
variant (``h200-loop.json``), the in-place row stores against the gathered output per
family and route (``h100-direct-store.json``) and issue 31's efficiency per family and route
against its targets (``h200-gather.json``).

    python benchmarks/plot_results.py benchmarks/results/h200-backward.json \
        benchmarks/results/h200-loop.json benchmarks/results/h100-direct-store.json \
        benchmarks/results/h200-gather.json [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _ratio(x: float) -> str:
    """A speedup to two decimals, rounded down: a bar never shows a target it missed."""
    return f"{math.floor(x * 100) / 100:.2f}"


def plot_backward(doc: dict, path: str) -> str:
    """Forward+backward ms per mask: ours, FlexAttention and cuDNN dense, with ours vs Flex."""
    rows = [r for r in doc.get("fwd_bwd", []) if "ours" in r]
    dense = doc.get("dense_fwd_bwd", {}).get("ms")
    names = [r["mask"] for r in rows]
    ours = [r["ours"]["ms"] for r in rows]
    flex = [r.get("flex", {}).get("ms") for r in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 3, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], ours, 0.4, label="tessera_jax")
    ax.bar([i + 0.2 for i in x], [f or 0 for f in flex], 0.4, label="FlexAttention")
    for i, (o, f) in enumerate(zip(ours, flex)):
        if f:
            ax.annotate(f"{_ratio(f / o)}x", (i, max(o, f)), ha="center", va="bottom", fontsize=8)
    if dense:
        ax.axhline(dense, color="k", ls="--", lw=1, label=f"cuDNN dense {dense:.1f} ms")
    ax.set_xticks(list(x), [f"{n}\n(d {r['density']:.2f})" for n, r in zip(names, rows)],
                  fontsize=8)
    ax.set_ylabel("forward + backward, ms")
    s = doc.get("summary", {})
    sh = doc.get("shape", {})
    ax.set_title(f"H200, L {sh.get('L')}, {sh.get('heads')} heads, D {sh.get('head_dim')}, "
                 f"{sh.get('dtype')}; vs Flex on irregular masks (geomean): "
                 f"{_ratio(s.get('fwd_bwd_speedup_vs_flex_irregular_geomean') or 0)}x", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


_VARIANTS = ("dense", "fixed", "tessera", "dynamic", "host", "null")


def plot_loops(doc: dict, path: str) -> str:
    """Seconds per compiled loop (the whole model, extrapolated per layer where a layer subset
    ran), each variant a bar, with the speedup over dense."""
    cases = doc.get("cases", {})
    fig, axes = plt.subplots(1, len(cases), figsize=(2.6 * len(cases), 3.6), squeeze=False)
    for ax, (name, c) in zip(axes[0], cases.items()):
        loops = c.get("loops", {})
        vs = [v for v in _VARIANTS if "loop_full_model_s" in loops.get(v, {})]
        ts = [loops[v]["loop_full_model_s"] for v in vs]
        ax.bar(vs, ts, color=["0.5" if v in ("dense", "null") else "C0" for v in vs])
        d = loops.get("dense", {}).get("loop_full_model_s")
        for i, (v, t) in enumerate(zip(vs, ts)):
            if d and v not in ("dense", "null"):
                ax.annotate(f"{_ratio(d / t)}x", (i, t), ha="center", va="bottom", fontsize=8)
        ax.set_title(name + (" (extrap.)" if c.get("extrapolated") else ""), fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    axes[0][0].set_ylabel("loop, s (whole model)")
    fig.suptitle("H200 denoising loops: speedup over dense above each bar", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_direct_store(doc: dict, path: str) -> str:
    """ms per (family, route), in place beside gathered, the gathered / in-place speedup
    above each pair."""
    bars = [(f"{r['family']}\n{route}", r[f"{route}_in_place_ms"], r[f"{route}_gathered_ms"])
            for r in doc.get("rows", []) for route in ("host", "device", "fwd_bwd")
            if f"{route}_in_place_ms" in r]
    fig, ax = plt.subplots(figsize=(1.1 * len(bars) + 2, 3.8))
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="in place")
    ax.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="unit-major + gather",
           color="0.6")
    for i, (_, a, g) in enumerate(bars):
        ax.annotate(f"{_ratio(g / a)}x", (i, max(a, g)), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("ms (kernel rule)")
    ax.set_title(f"{doc.get('device', '')}: in-place row stores (Wan 480p)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: Issue 31's efficiency targets per family (``gather_acceptance``'s summary keys).
GATHER_TARGETS = {"clusters": 0.70, "cubes": 0.80, "sliding": 0.80, "frame_aligned": 0.95,
                  "aligned": 0.90}


def plot_gather(doc: dict, path: str) -> str:
    """Efficiency (selected FLOPs / time over cuDNN's dense FLOPs / time) per family and route,
    one panel per grid, each family's target as a line across its bars."""
    rows = [r for r in doc.get("rows", []) if "efficiency" in r and r.get("ok")]
    grids = sorted({r["grid"] for r in rows})
    routes = [x for x in ("host", "device", "perhead", "perhead_all", "fwd_bwd")
              if any(r["route"] == x for r in rows)]
    fams = list(GATHER_TARGETS)
    fig, axes = plt.subplots(1, max(1, len(grids)), figsize=(6.5 * max(1, len(grids)), 3.8),
                             squeeze=False)
    w = 0.8 / max(1, len(routes))
    for ax, grid in zip(axes[0], grids):
        eff = {(r["family"], r["route"]): r["efficiency"] for r in rows if r["grid"] == grid}
        for j, route in enumerate(routes):
            xs = [i + (j - (len(routes) - 1) / 2) * w for i, f in enumerate(fams)
                  if (f, route) in eff]
            ys = [eff[(f, route)] for f in fams if (f, route) in eff]
            ax.bar(xs, ys, w, label=route)
        for i, f in enumerate(fams):
            ax.hlines(GATHER_TARGETS[f], i - 0.45, i + 0.45, colors="k", linestyles="--",
                      linewidth=1)
        ax.set_xticks(range(len(fams)), [f.replace("_", "\n") for f in fams], fontsize=8)
        ax.set_ylim(0, 1.2)
        ax.set_ylabel("efficiency vs cuDNN dense")
        ax.set_title(f"{grid}: dashed = issue 31's forward target (fwd_bwd: 0.65)", fontsize=9)
    axes[0][0].legend(fontsize=7, ncol=len(routes))
    dev = doc.get("device") or ", ".join(sorted({r.get("device", "") for r in
                                                  doc.get("runs", [])}))
    fig.suptitle(f"{dev}: block-sparse attention efficiency per family and route", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+",
                    help="h200-backward.json, h200-loop.json, h100-direct-store.json and / or "
                    "h200-gather.json")
    ap.add_argument("--out-dir", default="/tmp/tessera-plots", help="folder of the PNGs")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    out = []
    for f in args.files:
        with open(f) as fh:
            doc = json.load(fh)
        png = os.path.join(args.out_dir,
                           os.path.basename(f).replace(".json", ".png"))
        if doc.get("benchmark", "").startswith("backward"):
            out.append(plot_backward(doc, png))
        elif doc.get("benchmark") == "direct_store":
            out.append(plot_direct_store(doc, png))
        elif "cases" in doc:
            out.append(plot_loops(doc, png))
        elif any(k.startswith("efficiency_") for k in doc.get("summary", {})):
            out.append(plot_gather(doc, png))
        else:
            raise SystemExit(f"plot_results: {f} is not a backward, loop or direct-store "
                             f"result file")
        print(out[-1])
    return out


if __name__ == "__main__":
    main()
