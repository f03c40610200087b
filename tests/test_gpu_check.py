"""tessera_jax.tools.gpu_check on CPU: its case list for the GPU backends, and one case of its
checker through the XLA backend (the same code ``make test-gpu`` runs on a GPU)."""

import numpy as np
import pytest

from tessera_jax.tools import gpu_check


def test_cases_cover_every_gpu_template_and_both_device_routes():
    from pallas_kernels import templates
    got = gpu_check.cases(["mosaic_gpu", "triton"])
    names = {c[1].get("template") for c in got if c[2] == "host"}
    assert names == {t.name for b in ("mosaic_gpu", "triton") for t in templates.for_backend(b)
                     if t.supports(128, np.dtype("bfloat16")) or t.supports(64, np.dtype("bfloat16"))}
    assert {(c[1].get("backend"), c[2]) for c in got if c[2] != "host"} == {
        (b, r) for b in ("mosaic_gpu", "triton") for r in ("device", "perhead")}
    assert gpu_check.cases([]) == []


@pytest.mark.parametrize("route", gpu_check.ROUTES)
def test_check_case_passes_on_xla_and_fails_a_wrong_kernel(route, monkeypatch):
    rng = np.random.default_rng(1)
    rec = gpu_check.check_case(rng, D=32, Hq=2, Hkv=1, route=route, options={"backend": "xla"})
    assert rec["ok"] and rec["empty_rows_ok"], rec
    import tessera_jax as tj
    real = tj.sparse_attention

    def wrong(q, k, v, m, **kw):              # a kernel that drops a tenth of its output
        out, lse = real(q, k, v, m, **kw)
        return out.at[:, : q.shape[1] // 10].set(0), lse

    monkeypatch.setattr(tj, "sparse_attention", wrong)
    assert not gpu_check.check_case(rng, D=32, Hq=2, Hkv=1, route=route,
                                    options={"backend": "xla"})["ok"]


def test_unknown_route_is_refused():
    with pytest.raises(ValueError, match="route"):
        gpu_check.check_case(np.random.default_rng(0), D=32, Hq=1, Hkv=1, route="elsewhere",
                             options={})
