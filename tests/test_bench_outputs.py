"""No benchmark or tool writes into benchmarks/results/ unless its --out says so: the defaults
of --out / --out-dir, the fallbacks ``args.out or ...`` and the DEFAULT_OUT constants of every
script in benchmarks/ and tessera_jax/tools/ name no path there (issue 30, item 8)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/peers_lib/*.py"),
                  *ROOT.glob("tessera_jax/tools/*.py")])


def _default_outputs(tree):
    """The expressions a script writes to when no --out is given."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("--out")):
            yield from (kw.value for kw in node.keywords if kw.arg == "default")
        elif (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or)
              and getattr(node.values[0], "attr", "") == "out"):
            yield from node.values[1:]
        elif isinstance(node, ast.Assign) and any(
                "OUT" in getattr(t, "id", "") or getattr(t, "attr", "") == "out"
                for t in node.targets):
            yield node.value


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_default_output_in_benchmarks_results(path):
    for expr in _default_outputs(ast.parse(path.read_text())):
        strings = [n.value for n in ast.walk(expr)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not any("results" in s for s in strings), (
            f"{path.name}:{expr.lineno} writes into benchmarks/results by default")
