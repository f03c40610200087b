"""Options are explicit values: no test changes behaviour by assigning an UPPER_CASE module
attribute (``monkeypatch.setattr(mod, "NAME", ...)``, ``setattr(mod, "NAME", ...)``,
``mod.NAME = ...``); options are fields of frozen dataclasses or keyword arguments, part of the
caches' keys, so a changed option takes effect on the next call."""

from __future__ import annotations

import ast
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as tj
from tessera_jax.planning import PlannerConfig, build_plan

TESTS = pathlib.Path(__file__).resolve().parent
_UPPER = re.compile(r"^_*[A-Z][A-Z0-9_]*$")


def _str(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _namespace(node) -> bool:
    """``x.__dict__``, ``vars(x)`` or ``globals()``: a module's attributes as a dict."""
    return ((isinstance(node, ast.Attribute) and node.attr == "__dict__")
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("vars", "globals")))


def constant_assignments(source: str, filename: str = "<test>") -> list[str]:
    """'file:line NAME' for each assignment of an UPPER_CASE attribute in ``source``:
    ``<any>.setattr(obj, "NAME", value)`` (monkeypatch, a MonkeyPatch context) or
    ``<any>.setattr("pkg.mod.NAME", value)``, the builtin ``setattr(obj, "NAME", value)``,
    ``obj.NAME = value`` / ``obj.NAME += value`` (also inside tuples and chained targets), and
    through the namespace dict: ``<any>.setitem(mod.__dict__, "NAME", value)``,
    ``vars(mod)["NAME"] = value``."""
    found = []

    def hit(node, name):
        if name is not None and _UPPER.match(name):
            found.append(f"{filename}:{node.lineno} {name}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "setitem" and len(node.args) >= 2
                    and _namespace(node.args[0])):
                hit(node, _str(node.args[1]))
                continue
            is_setattr = ((isinstance(f, ast.Attribute) and f.attr == "setattr")
                          or (isinstance(f, ast.Name) and f.id == "setattr"))
            if not is_setattr or not node.args:
                continue
            first = _str(node.args[0])
            if first is not None and isinstance(f, ast.Attribute):     # "pkg.mod.NAME"
                hit(node, first.rsplit(".", 1)[-1])
            elif len(node.args) >= 2:
                hit(node, _str(node.args[1]))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            stack = list(targets)
            while stack:
                t = stack.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    stack.extend(t.elts)
                elif isinstance(t, ast.Attribute):
                    hit(node, t.attr)
                elif isinstance(t, ast.Subscript) and _namespace(t.value):
                    hit(node, _str(t.slice))
    return found


def test_detector_finds_every_form():
    snippet = '''
import pytest
def test(monkeypatch):
    monkeypatch.setattr(planner, "PLAN_THREADS", 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loops, "_JITTED", False)
    monkeypatch.setattr("tessera_jax.masks.dynamic.TOP_K", 3)
    setattr(dm, "POOL", "xla")
    dm.KMEANS_ASSIGN = "dot"
    a.b.SHARE_STEP_LISTS = False
    planner._PAR_MIN_ROWS += 1
    x, dm.SCORE_PRECISION = 1, None
    monkeypatch.setitem(route.__dict__, "BITMAP_BUDGET_BYTES", 64)
    vars(api)["_MAX_PLANS"] = 2
'''
    names = [f.split()[-1] for f in constant_assignments(snippet)]
    assert sorted(names) == sorted(["PLAN_THREADS", "_JITTED", "TOP_K", "POOL", "KMEANS_ASSIGN",
                                    "SHARE_STEP_LISTS", "_PAR_MIN_ROWS", "SCORE_PRECISION",
                                    "BITMAP_BUDGET_BYTES", "_MAX_PLANS"])


def test_detector_leaves_functions_and_locals_alone():
    snippet = '''
def test(monkeypatch):
    monkeypatch.setattr(planner, "check_mask", lambda *a: None)
    monkeypatch.setattr(F, "_mask_part", spy)
    monkeypatch.setenv("TESSERA_JAX_PLAN_TABLES", "x")
    obj.value = 3
    SIZE = 4
    getattr(mod, "TOP_K")
    monkeypatch.setitem(table, "TOP_K", 3)
    d["TOP_K"] = 3
'''
    assert constant_assignments(snippet) == []


def test_no_test_assigns_a_module_constant():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += constant_assignments(path.read_text(), str(path.relative_to(TESTS)))
    assert not found, ("tests assign UPPER_CASE module attributes (set options through the "
                       "API instead):\n" + "\n".join(found))


def test_a_changed_planner_option_takes_effect_on_the_next_call():
    """The plan cache keys on the PlannerConfig: share_step_lists off, then on again, gives
    each its own plan (a tall row group stores its step rows once when sharing)."""
    blocks = np.ones((1, 8, 8), bool)
    m = tj.BlockMask.uniform(1024, 1024, 128, 128, blocks)
    shapes = ((1, 1024, 2, 64), (1, 1024, 2, 64), jnp.float32)

    def plan(**options):
        return build_plan(m, *shapes, tile_q=64, tile_kv=64, policy="merge",
                          config=PlannerConfig(**options))

    shared, plain = plan(), plan(share_step_lists=False)
    assert plain.num_steps > shared.num_steps
    np.testing.assert_array_equal(plan().steps, shared.steps)
    assert plan(share_step_lists=False).num_steps == plain.num_steps
    assert plan(threads=1).num_steps == shared.num_steps      # a speed option: same plan


def test_planner_config_is_validated_and_hashable():
    assert hash(PlannerConfig()) == hash(PlannerConfig())
    with pytest.raises(ValueError, match="loops"):
        PlannerConfig(loops="numba")
    with pytest.raises(ValueError, match="threads"):
        PlannerConfig(threads=0)
    with pytest.raises(TypeError, match="share_step_lists"):
        PlannerConfig(share_step_lists=1)
    with pytest.raises(TypeError, match="config"):
        build_plan(tj.BlockMask.uniform(64, 64, 64, 64, np.ones((1, 1, 1), bool)),
                   (1, 64, 1, 8), (1, 64, 1, 8), jnp.float32, tile_q=64, tile_kv=64,
                   config={"threads": 1})


def test_planner_config_travels_in_options():
    """``tj.Options(planner=...)`` reaches the host planner and keys the plan cache: the two
    settings give two plans, each made with its config, and the same output."""
    import jax

    rng = np.random.default_rng(0)
    m = tj.BlockMask.uniform(512, 512, 64, 64, rng.random((1, 8, 8)) < 0.5)
    off = tj.Options(planner=PlannerConfig(share_step_lists=False))
    a = tj.plan(m, (1, 512, 2, 64), (1, 512, 2, 64), "float32", options=off)
    b = tj.plan(m, (1, 512, 2, 64), (1, 512, 2, 64), "float32")
    assert a is not b and not a.config.share_step_lists and b.config.share_step_lists
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 512, 2, 64), jnp.float32)
               for i in range(3))
    np.testing.assert_array_equal(
        np.asarray(tj.sparse_attention(q, k, v, m, options=off, backend="xla")),
        np.asarray(tj.sparse_attention(q, k, v, m, backend="xla")))
    with pytest.raises(TypeError, match="planner must be"):
        tj.Options(planner={"threads": 1})
