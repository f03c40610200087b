"""Pictures of plans: the logical mask with the physical tiles the planner chose drawn over it.

matplotlib is imported inside the functions, so ``import tessera_jax.viz`` costs nothing until
a figure is drawn (matplotlib is in the ``notebook``, ``bench`` and ``test`` extras).
"""

from __future__ import annotations

import numpy as np

from tessera_jax.planning.planner import Plan, tile_kinds

__all__ = ["plot_plan", "plot_policies", "policy_table", "KIND_COLORS"]

# kept / merged / split tiles (see the planner's docstring for the definitions)
KIND_COLORS = {"kept": "#4daf4a", "merged": "#377eb8", "split": "#ff7f00"}
_KINDS = ("kept", "merged", "split")
_MAX_BLOCK_LINES = 160


def _rects_xy(x0, x1, y0, y1):
    """Rectangle vertices [N, 4, 2] for a PolyCollection (x = keys, y = queries)."""
    return np.stack([np.stack([x0, y0], -1), np.stack([x1, y0], -1),
                     np.stack([x1, y1], -1), np.stack([x0, y1], -1)], axis=1)


def plot_plan(plan: Plan, head: int = 0, ax=None, *, show_blocks: bool = True,
              title: str | None = None, legend: bool = True):
    """Draws query head ``head`` of ``plan``: logical blocks, physical tiles, masked area.

    Selected logical blocks are grey; every computed tile is outlined and its selected
    rectangle filled in the colour of its kind (kept / merged / split); the computed but
    masked part of each tile is hatched. Queries run down, keys to the right; dashed lines
    mark the true sequence lengths when the plan pads. Returns the matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a tessera_jax Plan, got {type(plan).__name__}")
    Hq = plan.shape.num_q_heads
    if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or not 0 <= head < Hq:
        raise ValueError(f"head must be an int in [0, {Hq}), got {head!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 6 * plan.shape.q_len / max(plan.shape.kv_len, 1)
                                      if plan.shape.q_len < 2 * plan.shape.kv_len else 6))
    mask = plan.mask
    qb, kb = mask.q_bounds, mask.kv_bounds
    blocks = mask.head_blocks(Hq)[head]
    Lq, Lkv = plan.shape.q_len, plan.shape.kv_len

    # Logical mask: selected blocks in grey.
    bi, bj = np.nonzero(blocks)
    ax.add_collection(PolyCollection(_rects_xy(kb[bj], kb[bj + 1], qb[bi], qb[bi + 1]),
                                     facecolors="#d9d9d9", edgecolors="none", zorder=1))
    if show_blocks and len(qb) <= _MAX_BLOCK_LINES and len(kb) <= _MAX_BLOCK_LINES:
        ax.hlines(qb, 0, Lkv, colors="#bdbdbd", linewidth=0.4, zorder=2)
        ax.vlines(kb, 0, Lq, colors="#bdbdbd", linewidth=0.4, zorder=2)

    # Physical tiles of this head.
    t = plan.tile_rects()
    kind = tile_kinds(plan, t)
    sel = t["head"] == head
    t = {k: v[sel] for k, v in t.items()}
    kind = kind[sel]
    tiles = _rects_xy(t["k0"], t["k1"], t["q0"], t["q1"])
    ax.add_collection(PolyCollection(tiles, facecolors="white", edgecolors="#969696",
                                     hatch="////", linewidths=0.3, zorder=3, alpha=0.9))
    for k, name in enumerate(_KINDS):
        m = kind == k
        if not m.any():
            continue
        ax.add_collection(PolyCollection(_rects_xy(t["c0"][m], t["c1"][m], t["r0"][m], t["r1"][m]),
                                         facecolors=KIND_COLORS[name], edgecolors="none",
                                         alpha=0.75, zorder=4))
        ax.add_collection(PolyCollection(tiles[m], facecolors="none",
                                         edgecolors=KIND_COLORS[name], linewidths=0.9, zorder=5))
    if plan.q_len_padded > Lq:
        ax.axhline(Lq, color="k", linestyle="--", linewidth=0.6, zorder=6)
    if plan.kv_len_padded > Lkv:
        ax.axvline(Lkv, color="k", linestyle="--", linewidth=0.6, zorder=6)
    ax.set_xlim(0, plan.kv_len_padded)
    ax.set_ylim(plan.q_len_padded, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title is None:
        n = int(sel.sum())
        chosen = (f" ({plan.head_policies[head if mask.num_heads > 1 else 0]})"
                  if plan.policy == "auto" else "")
        done = float(((t["r1"] - t["r0"]) * (t["c1"] - t["c0"])).sum())
        waste = 1.0 - done / (n * plan.tile_q * plan.tile_kv) if n else 0.0
        title = (f"{plan.policy}{chosen} | {plan.tile_q}x{plan.tile_kv} | head {head}\n"
                 f"{n} tiles, waste {waste:.0%}")
    ax.set_title(title, fontsize=9)
    if legend:
        handles = [Patch(facecolor="#d9d9d9", label="selected block")]
        handles += [Patch(facecolor=KIND_COLORS[n], edgecolor=KIND_COLORS[n], label=f"{n} tile")
                    for n in _KINDS]
        handles.append(Patch(facecolor="white", edgecolor="#969696", hatch="////",
                             label="computed, masked"))
        ax.legend(handles=handles, loc="upper right", fontsize=7, framealpha=0.9)
    return ax


def plot_policies(mask, q_shape, kv_shape, dtype, *, template: str | None = None,
                  policies=("keep", "merge", "split"), head: int = 0, axes=None,
                  figsize_per=4.0):
    """Side-by-side ``plot_plan`` of one mask planned with each policy; returns the Figure."""
    import matplotlib.pyplot as plt

    from tessera_jax.runtime.api import plan as make_plan

    policies = tuple(policies)
    if axes is None:
        fig, axes = plt.subplots(1, len(policies), figsize=(figsize_per * len(policies),
                                                            figsize_per + 0.6), squeeze=False)
        axes = axes[0]
    else:
        fig = axes[0].figure
    for i, (pol, ax) in enumerate(zip(policies, axes)):
        p = make_plan(mask, q_shape, kv_shape, dtype, template=template, policy=pol)
        plot_plan(p, head=head, ax=ax, legend=(i == len(policies) - 1))
    fig.tight_layout()
    return fig


def policy_table(mask, q_shape, kv_shape, dtype, *, template: str | None = None,
                 policies=("keep", "merge", "split", "pack", "auto")) -> list[dict]:
    """One row per policy: tiles, kinds, waste, K/V bytes, estimated time and balance."""
    from tessera_jax.runtime.api import plan as make_plan

    rows = []
    for pol in policies:
        s = make_plan(mask, q_shape, kv_shape, dtype, template=template, policy=pol).stats()
        rows.append({"policy": pol, "units": s["units"], "tiles": s["tiles"],
                     "kept": s["kept"], "merged": s["merged"], "split": s["split"],
                     "waste": round(s["waste_fraction"], 3),
                     "kv_MiB": round(s["kv_bytes"] / 2**20, 2),
                     "est_us": round(s["est_time_us"], 1),
                     "balance": round(s["balance"], 3)})
    return rows
