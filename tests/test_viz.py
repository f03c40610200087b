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


def test_viz_module_imports_without_matplotlib_work():
    import importlib

    import tessera_jax.viz as viz
    importlib.reload(viz)
    assert hasattr(viz, "plot_plan")


@pytest.mark.parametrize("policy", ["keep", "merge", "split", "pack", "auto"])
def test_plot_plan_draws_every_tile(policy):
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    from tessera_jax import viz

    m = _mask()
    p = tj.plan(m, (1, 300, 2, 16), (1, 300, 1, 16), jnp.float32, template="xla_64x128",
                policy=policy)
    ax = viz.plot_plan(p, head=1)
    n_tiles = int((p.tile_rects()["head"] == 1).sum())
    colls = [c for c in ax.collections if isinstance(c, PolyCollection)]
    hatched = [c for c in colls if c.get_hatch()]
    assert len(hatched) == 1 and len(hatched[0].get_paths()) == n_tiles
    filled = sum(len(c.get_paths()) for c in colls
                 if not c.get_hatch() and len(c.get_facecolor()) and c.get_facecolor()[0][3] < 1)
    assert filled == n_tiles              # one selected rectangle per tile, coloured by kind
    assert ax.get_legend() is not None
    ax.figure.canvas.draw()
    plt.close(ax.figure)


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
