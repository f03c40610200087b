"""tessera_jax.viz draws plans (Agg backend, no display)."""

import sys

import matplotlib

matplotlib.use("Agg")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tessera_jax as tj  # noqa: E402


def _mask():
    rng = np.random.default_rng(0)
    qb = np.array([0, 1, 40, 41, 200, 260, 300])
    kb = np.array([0, 64, 65, 190, 300])
    return tj.BlockMask(qb, kb, rng.random((2, 6, 4)) < 0.5)


def _boxes(coll) -> list[tuple]:
    """A PolyCollection's rectangles as sorted (x0, x1, y0, y1) = (keys, queries) tuples."""
    out = []
    for p in coll.get_paths():
        v = p.vertices[:4]
        out.append((v[:, 0].min(), v[:, 0].max(), v[:, 1].min(), v[:, 1].max()))
    return sorted(tuple(float(x) for x in b) for b in out)


def _want(x0, x1, y0, y1) -> list[tuple]:
    return sorted(zip(*(np.asarray(a, float).tolist() for a in (x0, x1, y0, y1))))


def _rgba(c):
    from matplotlib.colors import to_rgba
    return tuple(np.round(to_rgba(c), 3))


def _face(coll):
    """A collection's one face colour (rgba, rounded), None where it draws no faces."""
    f = coll.get_facecolor()
    return _rgba(f[0]) if len(f) and f[0][3] > 0 else None


@pytest.mark.parametrize("policy,head", [("keep", 1), ("merge", 0), ("split", 1),
                                         ("pack", 0), ("auto", 1)])
def test_plot_plan_draws_the_plan(policy, head):
    """What is drawn is the plan: one grey rectangle per selected block of the head, one
    hatched rectangle per tile the head computes (the tile's rows x keys), one filled rectangle
    per tile in its kind's colour (the step's rows x keys) and one outline per tile; block lines
    at the bounds; a dashed line at each padded length; the title's counts and waste."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection, PolyCollection

    from tessera_jax import viz
    from tessera_jax.planning.planner import tile_kinds

    m = _mask()
    p = tj.plan(m, (1, 300, 2, 16), (1, 300, 1, 16), jnp.float32, template="xla_64x128",
                policy=policy)
    ax = viz.plot_plan(p, head=head)
    polys = [c for c in ax.collections if isinstance(c, PolyCollection)]
    qb, kb = m.q_bounds, m.kv_bounds
    bi, bj = np.nonzero(m.blocks[head])
    grey = [c for c in polys if _face(c) == _rgba("#d9d9d9")]
    assert len(grey) == 1 and _boxes(grey[0]) == _want(kb[bj], kb[bj + 1], qb[bi], qb[bi + 1])

    t = p.tile_rects()
    kind = tile_kinds(p, t)
    sel = t["head"] == head
    assert sel.any() and not sel.all()            # both heads have tiles: the head is chosen
    t, kind = {k: v[sel] for k, v in t.items()}, kind[sel]
    hatched = [c for c in polys if c.get_hatch()]
    assert len(hatched) == 1 and _boxes(hatched[0]) == _want(t["k0"], t["k1"], t["q0"], t["q1"])
    for k, name in enumerate(("kept", "merged", "split")):
        colour, of = _rgba(viz.KIND_COLORS[name]), kind == k
        fills = [c for c in polys if not c.get_hatch() and _face(c)
                 and _face(c)[:3] == colour[:3]]
        lines = [c for c in polys if _face(c) is None and _rgba(c.get_edgecolor()[0]) == colour]
        if not of.any():
            assert not fills and not lines, name
            continue
        assert len(fills) == 1 and len(lines) == 1, name
        assert _boxes(fills[0]) == _want(t["c0"][of], t["c1"][of], t["r0"][of], t["r1"][of])
        assert _boxes(lines[0]) == _want(t["k0"][of], t["k1"][of], t["q0"][of], t["q1"][of])

    segs = [c for c in ax.collections if isinstance(c, LineCollection)]
    ys = sorted({s[0][1] for c in segs for s in c.get_segments() if s[0][1] == s[1][1]})
    xs = sorted({s[0][0] for c in segs for s in c.get_segments() if s[0][0] == s[1][0]})
    assert ys == sorted(set(qb.tolist())) and xs == sorted(set(kb.tolist()))
    dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert ([ln.get_ydata()[0] for ln in dashed if ln.get_ydata()[0] == ln.get_ydata()[1]]
            == ([300] if p.q_len_padded > 300 else []))
    assert ([ln.get_xdata()[0] for ln in dashed if ln.get_xdata()[0] == ln.get_xdata()[1]]
            == ([300] if p.kv_len_padded > 300 else []))
    assert ax.get_xlim() == (0, p.kv_len_padded) and ax.get_ylim() == (p.q_len_padded, 0)

    n = int(sel.sum())
    waste = 1 - ((t["r1"] - t["r0"]) * (t["c1"] - t["c0"])).sum() / (n * 64 * 128)
    title = ax.get_title()
    assert title.startswith(policy) and f"| 64x128 | head {head}\n" in title
    assert title.endswith(f"{n} tiles, waste {waste:.0%}")
    assert [x.get_text() for x in ax.get_legend().get_texts()] == [
        "selected block", "kept tile", "merged tile", "split tile", "computed, masked"]
    ax.figure.canvas.draw()
    plt.close(ax.figure)


def test_plot_plan_marks_the_true_lengths_of_a_padded_plan():
    """A Mosaic GPU template pads 300 tokens to 304 (planned on the host, any machine): dashed
    lines at 300 on both axes, the axes span the padded lengths."""
    import matplotlib.pyplot as plt

    from tessera_jax import viz

    p = tj.plan(_mask(), (1, 300, 2, 64), (1, 300, 1, 64), jnp.bfloat16,
                template="mgpu_q128_kv64_s2_hm")
    assert (p.q_len_padded, p.kv_len_padded) == (304, 304)
    ax = viz.plot_plan(p, head=0)
    dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    rows = [ln.get_ydata()[0] for ln in dashed if ln.get_ydata()[0] == ln.get_ydata()[1]]
    cols = [ln.get_xdata()[0] for ln in dashed if ln.get_xdata()[0] == ln.get_xdata()[1]]
    assert rows == [300] and cols == [300] and len(dashed) == 2
    assert ax.get_xlim() == (0, 304) and ax.get_ylim() == (304, 0)
    plt.close(ax.figure)


def test_plot_plan_options_and_an_axes_of_ones_own():
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    from tessera_jax import viz

    p = tj.plan(_mask(), (1, 300, 2, 16), (1, 300, 2, 16), jnp.float32, template="xla_64x64")
    fig, ax = plt.subplots()
    assert viz.plot_plan(p, 1, ax, show_blocks=False, title="mine", legend=False) is ax
    assert ax.get_title() == "mine" and ax.get_legend() is None
    assert not [c for c in ax.collections if isinstance(c, LineCollection)]
    plt.close(fig)


def test_plot_policies_and_table():
    import matplotlib.pyplot as plt

    from tessera_jax import viz

    m = _mask()
    args = (m, (1, 300, 2, 16), (1, 300, 2, 16), jnp.float32)
    fig = viz.plot_policies(*args, template="xla_64x64")
    assert len(fig.axes) == 3
    fig.canvas.draw()
    plt.close(fig)
    rows = viz.policy_table(*args, template="xla_64x64")
    assert [r["policy"] for r in rows] == ["keep", "merge", "split", "pack", "auto"]
    for r in rows:
        assert r["kept"] + r["merged"] + r["split"] == r["tiles"]


def test_plot_plan_bad_head():
    from tessera_jax import viz

    p = tj.plan(_mask(), (1, 300, 2, 16), (1, 300, 2, 16), jnp.float32, template="xla_64x64")
    with pytest.raises(ValueError, match="head"):
        viz.plot_plan(p, head=2)
    with pytest.raises(TypeError, match="plan"):
        viz.plot_plan("not a plan")


def test_matplotlib_is_imported_lazily():
    import subprocess

    code = ("import sys, tessera_jax.viz; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
