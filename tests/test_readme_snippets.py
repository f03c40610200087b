"""Every ```python block of README.md runs as written, on its own (a fresh namespace: each
defines what it uses), on CPU. The slow ones (a model loop) are marked slow; all of them
together stay under a minute on the 2-core CI box."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
# Blocks that build a model and compile its loops: marked slow (~10 s on the CI box).
SLOW = ("from tessera_jax.models import",)


def snippets() -> list[str]:
    return BLOCK.findall(README.read_text())


def _params():
    out = []
    for i, code in enumerate(snippets()):
        marks = [pytest.mark.slow] if any(s in code for s in SLOW) else []
        out.append(pytest.param(code, id=f"block{i}", marks=marks))
    return out


def test_the_readme_has_its_snippets():
    codes = snippets()
    assert len(codes) >= 4
    assert any("tj.sparse_attention" in c for c in codes)
    assert any("make_sampler" in c for c in codes)


@pytest.mark.parametrize("code", _params())
def test_snippet_runs_as_written(code):
    ns = {"__name__": "readme_snippet"}
    exec(compile(code, str(README), "exec"), ns)      # nothing defined outside the block
