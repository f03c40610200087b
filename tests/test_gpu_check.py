"""tessera_jax.tools.gpu_check on CPU: its case list for the GPU backends, and one case of its
checker through the XLA backend (the same code ``make test-gpu`` runs on a GPU)."""

import numpy as np
import pytest

from tessera_jax.tools import gpu_check


def test_cases_cover_every_gpu_template_and_the_device_routes():
    from pallas_kernels import templates
    got = gpu_check.cases(["mosaic_gpu", "triton"])
    names = {c[1].get("template") for c in got if c[2] == "host"}
    assert names == {t.name for b in ("mosaic_gpu", "triton") for t in templates.for_backend(b)
                     if t.supports(128, np.dtype("bfloat16")) or t.supports(64, np.dtype("bfloat16"))}
    assert {(c[1].get("backend"), c[2]) for c in got
            if c[2] != "host" and "template" not in c[1]} == {
        (b, r) for b in ("mosaic_gpu", "triton")
        for r in ("device", "perhead", "traced", "decided", "tiered", "overflow")}
    # The device rule's candidates, named on the device route (the rule never chooses them).
    from tessera_jax.select import device as select_device
    assert {c[1]["template"] for c in got if c[2] == "device" and "template" in c[1]} == {
        n for b in ("mosaic_gpu", "triton") for n in select_device.DEVICE_CANDIDATES.get(b, ())}
    assert [c[0] for c in got if gpu_check._refines(c[2], c[1])] == [
        "mosaic_gpu-traced-refine-D128", "triton-traced-refine-D128"]
    assert gpu_check.cases([]) == []


@pytest.mark.parametrize("route", gpu_check.ROUTES)
def test_check_case_passes_on_xla(route):
    rng = np.random.default_rng(1)
    rec = gpu_check.check_case(rng, D=32, Hq=2, Hkv=1, route=route, options={"backend": "xla"})
    assert rec["ok"] and rec["empty_rows_ok"], rec


def test_check_case_fails_a_wrong_kernel(monkeypatch):
    """Once, on the host route: ``ok`` is the same comparison against the reference on every
    route (a route's own checks only add conditions), and each route's case compiles anew."""
    rng = np.random.default_rng(1)
    import tessera_jax as tj
    real = tj.sparse_attention

    def wrong(q, k, v, m, **kw):              # a kernel that drops a tenth of its output
        out, lse = real(q, k, v, m, **kw)
        return out.at[:, : q.shape[1] // 10].set(0), lse

    monkeypatch.setattr(tj, "sparse_attention", wrong)
    assert not gpu_check.check_case(rng, D=32, Hq=2, Hkv=1, route="host",
                                    options={"backend": "xla"})["ok"]


def test_tiered_case_fails_a_wrong_route_or_a_route_not_taken(monkeypatch):
    """The tiered case compares each eager call with the reference and counts its device-route
    calls: a route that drops part of its output fails it, and so do calls the rule keeps on
    the host (the case then checks nothing of the route)."""
    from tessera_jax.runtime import tiered
    real = tiered._device_route

    def wrong(q, *a):
        res = real(q, *a)
        if not isinstance(res, tuple):              # precompile's call (no LSE)
            return res
        return res[0].at[:, : q.shape[1] // 10].set(0), res[1]

    monkeypatch.setattr(tiered, "_device_route", wrong)
    kw = dict(D=32, Hq=2, Hkv=1, route="tiered", options={"backend": "xla"})
    assert not gpu_check.check_case(np.random.default_rng(1), **kw)["ok"]
    monkeypatch.setattr(tiered, "_device_route", real)
    monkeypatch.setattr(tiered, "attention", lambda *a, **k: None)     # the host plan runs
    rec = gpu_check.check_case(np.random.default_rng(1), **kw)
    assert rec["device_route_calls"] == 0 and rec["rel_out"] < gpu_check.OUT_TOL
    assert not rec["ok"]


def test_refine_case_checks_that_the_first_room_fell_back():
    """A traced case with a first bitmap room of 1 byte overflows its first plan and fits the
    whole room's (``first_ok`` False, ``full_ok`` True); with no first room (0) it is a plain
    traced case: one plan, no refine check. A first room that holds the whole capacity makes
    one plan too: the refine check then fails."""
    import jax
    import jax.numpy as jnp
    import tessera_jax as tj

    rng = np.random.default_rng(2)
    rec = gpu_check.check_case(rng, D=32, Hq=2, Hkv=1, route="traced", options={
        "backend": "xla", "options": tj.Options(bitmap_first_bytes=1)})
    assert rec["ok"] and rec["first_ok"] is False and rec["full_ok"] is True, rec
    assert not gpu_check._refines("traced", {"options": tj.Options(bitmap_first_bytes=0)})
    qb, blocks = gpu_check._refine_parts(rng, 800, 2)
    q, k = (jax.ShapeDtypeStruct((1, 800, h, 32), jnp.bfloat16) for h in (2, 1))
    assert gpu_check._refine_oks(qb, qb, blocks, q, k, {
        "backend": "xla", "options": tj.Options(bitmap_first_bytes=1 << 20)}) is None


def test_unknown_route_is_refused():
    with pytest.raises(ValueError, match="route"):
        gpu_check.check_case(np.random.default_rng(0), D=32, Hq=1, Hkv=1, route="elsewhere",
                             options={})


@pytest.mark.parametrize("case", [c for c in gpu_check.cases(["mosaic_gpu", "triton"])
                                  if c[0].startswith(("mgpu_", "triton_")) and "gather" in c[0]],
                         ids=lambda c: c[0])
def test_gathering_cases_run_gathered_steps(case):
    """A gathering template's case draws its mask as ``check_case`` does (the test's seed,
    then L, then clusters) and plans it: the forward plan, and the dk/dv plan where the case
    forces the gathered one, hold gathered steps, so the compiled check runs them (random
    blocks gave none: the gather policy fell back to split)."""
    import zlib

    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.runtime import host_plans

    name, options, route, D, Hq, Hkv = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    L = int(rng.integers(700, 1500))
    qb, kb, blocks = gpu_check._cluster_case(rng, L, Hq)
    assert not blocks[:, 1].any()                              # an empty query cluster
    opts = options.get("options") or tj.Options()
    p = tj.plan(tj.BlockMask(qb, kb, blocks), (1, L, Hq, D), (1, L, Hkv, D), jnp.bfloat16,
                template=options["template"], options=opts)
    assert p.stats()["gather_steps"] > 0
    if name.startswith("mgpu_"):
        assert opts.dkv_policies == ("gather32",) and opts.paired_dkv_policy is None
        d = host_plans.dkv_plan(p, options=opts)
        assert d.policy == "gather32" and d.stats()["gather_steps"] > 0


def test_gathered_dkv_policy_needs_a_gathering_kernel():
    """``Options.dkv_policies`` may name gather32; a template whose dk/dv kernel does not
    gather refuses it, naming the option."""
    import jax.numpy as jnp
    import tessera_jax as tj
    from pallas_kernels import templates
    from tessera_jax.runtime import host_plans

    opts = tj.Options(dkv_policies=("gather32",), paired_dkv_policy=None)
    with pytest.raises(ValueError, match="dkv_policies"):
        tj.Options(dkv_policies=("gather",))
    m = tj.BlockMask(np.array([0, 128, 256]), np.array([0, 128, 256]),
                     np.array([[True, False], [True, True]]))
    for t in ("mgpu_q128_kv128_s2_hm", "triton_q128_kv128_w8_s3_gather"):
        p = tj.plan(m, (1, 256, 2, 64), (1, 256, 2, 64), jnp.bfloat16, template=t)
        with pytest.raises(ValueError, match="Options.dkv_policies names 'gather32'"):
            host_plans.dkv_candidates(p, templates.get(t).backend, opts)
    p = tj.plan(m, (1, 256, 2, 64), (1, 256, 2, 64), jnp.bfloat16,
                template="mgpu_q128_kv128_s2_gather")
    assert [c.policy for c, _ in host_plans.dkv_candidates(p, "mosaic_gpu", opts)] == ["gather32"]


@pytest.mark.parametrize("case", [c for c in gpu_check.cases(["mosaic_gpu", "triton"])
                                  if c[2] != "host" and "gather" in c[0]], ids=lambda c: c[0])
def test_device_gathering_cases_choose_the_gathering_template(case):
    """A device-route case with ``Options.device_gather`` draws small blocks (as
    ``check_case`` does) that the route sends to the backend's gathering template, and
    whose tiles meet more than 4 query blocks (the planner's units split)."""
    import zlib

    import jax.numpy as jnp
    import tessera_jax as tj
    from tessera_jax.runtime import device_route
    from tessera_jax.validation import check_shapes

    name, options, route, D, Hq, Hkv = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    L = int(rng.integers(700, 1500))
    qb, blocks = gpu_check._mask_parts(rng, L, Hq, route, n=64)
    dev = tj.BlockMask(qb, qb, jnp.asarray(blocks))
    t = device_route.choose(dev, check_shapes((1, L, Hq, D), (1, L, Hkv, D), jnp.bfloat16),
                            options["backend"], None, options["options"])
    assert t.kernel.gather
    b = np.asarray(qb).reshape(-1, qb.shape[-1])[0]
    t0 = np.arange(0, L, 128)
    assert (np.searchsorted(b, np.minimum(t0 + 128, L) - 1, "right")
            - np.searchsorted(b, t0, "right")).max() >= 4
