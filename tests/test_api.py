"""sparse_attention (XLA backend) against the dense reference, and its input checks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tessera_jax as tj
from strategies import attn_problem, random_qkv


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (den if den > 0 else 1.0)


def check_against_reference(q, k, v, mask, tol, **kw):
    out, lse = tj.sparse_attention(q, k, v, mask, return_lse=True, backend="xla", **kw)
    ref, ref_lse = tj.reference_attention(q, k, v, mask, return_lse=True)
    chex.assert_shape(out, q.shape)
    chex.assert_type(out, q.dtype)
    chex.assert_shape(lse, (q.shape[0], q.shape[2], q.shape[1]))
    chex.assert_type(lse, jnp.float32)
    assert not np.isnan(np.asarray(out, np.float32)).any() and not np.isnan(lse).any()
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin],
                               rtol=tol, atol=tol * 10)
    empty = ~fin  # [B, Hq, Lq]: rows with no selected key are exactly 0
    out_bhq = np.moveaxis(np.asarray(out, np.float32), 2, 1)  # [B, Hq, Lq, D]
    assert np.all(out_bhq[empty] == 0)


# 15 examples, random each run: each compiles the executor and the reference (~0.5 s).
@settings(max_examples=15)
@given(attn_problem(dtypes=("float32",)), st.sampled_from(["keep", "merge"]),
       st.sampled_from(["xla_64x64", "xla_128x128", "xla_64x128"]))
def test_matches_reference_f32(problem, policy, template):
    B, Lq, Lkv, Hq, Hkv, D, dtype, mask, seed = problem
    q, k, v = random_qkv(B, Lq, Lkv, Hq, Hkv, D, dtype, seed)
    check_against_reference(q, k, v, mask, 1e-5, policy=policy, template=template)


@settings(max_examples=10)
@given(attn_problem(dtypes=("bfloat16", "float16")))
def test_matches_reference_half(problem):
    B, Lq, Lkv, Hq, Hkv, D, dtype, mask, seed = problem
    q, k, v = random_qkv(B, Lq, Lkv, Hq, Hkv, D, dtype, seed)
    check_against_reference(q, k, v, mask, 2e-2)


def test_empty_mask_and_scale():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(1, 50, 70, 2, 1, 16, "float32", 3)
    empty = tj.BlockMask([0, 20, 50], [0, 70], np.zeros((1, 2, 1), bool))
    out, lse = tj.sparse_attention(q, k, v, empty, return_lse=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))
    full = tj.BlockMask([0, 50], [0, 70], np.ones((1, 1, 1), bool))
    out = tj.sparse_attention(q, k, v, full, scale=0.3)
    dense = jax.nn.dot_product_attention(q, k, v, scale=0.3)
    assert rel_err(out, dense) < 1e-5
    del rng


def test_gradients_match_reference():
    q, k, v = random_qkv(1, 40, 56, 4, 2, 8, "float32", 7)
    rng = np.random.default_rng(2)
    mask = tj.BlockMask([0, 3, 20, 40], [0, 1, 30, 56], rng.random((4, 3, 3)) < 0.6)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, mask) * jnp.cos(jnp.arange(8.0)))

    g = jax.grad(loss(lambda *a: tj.sparse_attention(*a, backend="xla")), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(loss(tj.reference_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, gr):
        assert not np.isnan(a).any()
        assert rel_err(a, b) < 1e-4


def test_jit_no_retrace_same_mask():
    q, k, v = random_qkv(1, 64, 64, 2, 2, 16, "float32", 0)
    mask = tj.BlockMask.uniform(64, 64, 16, 16, np.random.default_rng(0).random((2, 4, 4)) < .5)
    traces = []

    @jax.jit
    def f(q, k, v):
        traces.append(1)
        return tj.sparse_attention(q, k, v, mask)

    a = f(q, k, v)
    b = f(q + 1, k, v)
    assert len(traces) == 1
    g = jax.jit(tj.sparse_attention, static_argnames=("mask",))
    g(q, k, v, mask=mask)
    g(q, k, v, mask=tj.BlockMask(mask.q_bounds, mask.kv_bounds, mask.blocks.copy()))
    assert g._cache_size() == 1
    del a, b


def test_new_mask_same_bucket_does_not_recompile():
    from pallas_kernels.xla import executor
    q, k, v = random_qkv(1, 128, 128, 2, 2, 16, "float32", 0)
    rng = np.random.default_rng(5)
    before = executor.execute_plan._cache_size()
    seen = set()
    for i in range(6):
        b = np.zeros((2, 8, 8), bool)
        b[:, :, :4] = rng.random((2, 8, 4)) < 0.9
        b[:, :, 0] = True
        m = tj.BlockMask.uniform(128, 128, 16, 16, b)
        tj.sparse_attention(q, k, v, m, template="xla_64x64", policy="keep")
        seen.add(tj.plan(m, q.shape, k.shape, q.dtype, template="xla_64x64",
                         policy="keep").capacities)
    assert executor.execute_plan._cache_size() - before == len(seen) < 6


# --- bad input --------------------------------------------------------------------------
def _ok():
    q, k, v = random_qkv(1, 32, 32, 4, 2, 8, "float32", 0)
    return q, k, v, tj.BlockMask.uniform(32, 32, 16, 16, np.ones((1, 2, 2), bool))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, k, v, m: (q[0], k, v, m), ValueError, "q must have rank 4"),
    (lambda q, k, v, m: (q, k[0], v, m), ValueError, "k must have rank 4"),
    (lambda q, k, v, m: (q, k, v[:, :16], m), ValueError, "v must have the shape of k"),
    (lambda q, k, v, m: (q[..., :4], k, v, m), ValueError, "head dim"),
    (lambda q, k, v, m: (q, k[:, :16], v[:, :16], m), ValueError, "mask covers Lkv=32"),
    (lambda q, k, v, m: (q[:, :16], k, v, m), ValueError, "mask covers Lq=32"),
    (lambda q, k, v, m: (q[:, :, :3], k, v, m), ValueError, "multiple of the number"),
    (lambda q, k, v, m: (jnp.concatenate([q, q]), k, v, m), ValueError, "batch"),
    (lambda q, k, v, m: (q.astype(jnp.bfloat16), k, v, m), TypeError, "k has dtype float32"),
    (lambda q, k, v, m: (q, k, v.astype(jnp.float16), m), TypeError, "v has dtype float16"),
    (lambda q, k, v, m: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32), m),
     TypeError, "q has dtype int32"),
    (lambda q, k, v, m: (q, k, v, m.blocks), TypeError, "mask must be a tessera_jax.BlockMask"),
    (lambda q, k, v, m: (q, k, v, tj.BlockMask.uniform(32, 32, 16, 16, np.ones((2, 2, 2), bool))),
     ValueError, "mask has 2 heads"),
    (lambda q, k, v, m: ("q", k, v, m), TypeError, "q must be an array"),
])
def test_bad_inputs(mutate, exc, match):
    args = mutate(*_ok())
    with pytest.raises(exc, match=match):
        tj.sparse_attention(*args)
    if not isinstance(args[0], str):
        with pytest.raises(exc, match=match):
            tj.reference_attention(*args)


@pytest.mark.parametrize("scale, exc, match", [
    (0.0, ValueError, "finite and positive"), (-1.0, ValueError, "finite and positive"),
    (float("nan"), ValueError, "finite and positive"), (float("inf"), ValueError, "finite"),
    ("1", TypeError, "scale must be"), (True, TypeError, "scale must be"),
])
def test_bad_scale(scale, exc, match):
    q, k, v, m = _ok()
    with pytest.raises(exc, match=match):
        tj.sparse_attention(q, k, v, m, scale=scale)


def test_bad_backend_and_flags():
    q, k, v, m = _ok()
    with pytest.raises(ValueError, match="backend must be one of"):
        tj.sparse_attention(q, k, v, m, backend="cuda")
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        tj.sparse_attention(q, k, v, m, return_lse=1)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="not available"):
            tj.sparse_attention(q, k, v, m, backend="mosaic_gpu")
    with pytest.raises(ValueError, match="unknown template"):
        tj.sparse_attention(q, k, v, m, template="nope")


def test_plan_contract():
    q, k, v, m = _ok()
    p = tj.plan(m, q.shape, k.shape, q.dtype)
    s = p.stats()
    for key in ("template", "tile_q", "tile_kv", "tiles", "selected_interactions",
                "computed_interactions", "kept", "merged", "split"):
        assert key in s
    assert s["selected_interactions"] == 32 * 32 * 4
    assert isinstance(p.describe(), str)
    assert tj.plan(m, q.shape, k.shape, q.dtype) is p  # cached by mask digest


def test_precompile_and_persistent_cache(tmp_path):
    from pallas_kernels.xla import executor
    rng = np.random.default_rng(3)
    ms = [tj.BlockMask.uniform(96, 96, 32, 32, rng.random((2, 3, 3)) < 0.7) for _ in range(3)]
    ms = [m for m in ms if m.blocks.any()] or ms
    tj.enable_compilation_cache(str(tmp_path))
    try:
        plans = tj.precompile(ms, (1, 96, 2, 8), (1, 96, 2, 8), jnp.float32, backend="xla")
        assert len(plans) == len(ms)
        n = executor.execute_plan._cache_size()
        q, k, v = random_qkv(1, 96, 96, 2, 2, 8, "float32", 1)
        for m in ms:
            tj.sparse_attention(q, k, v, m, backend="xla")
        assert executor.execute_plan._cache_size() == n  # nothing new compiled
        assert any(tmp_path.iterdir())                   # executables written to disk
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
    with pytest.raises(TypeError, match=r"masks\[0\]"):
        tj.precompile(["m"], (1, 96, 2, 8), (1, 96, 2, 8), jnp.float32)


def test_precompile_readies_the_planners_compiled_loops():
    """A fresh process: no compiled planner loops before ``tj.precompile``, ready after it
    (the plans of its requests then skip the NumPy tier); "vectorised" planning asks for none.
    In a subprocess: this one's loops may be ready from other tests."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = (
        "import numpy as np, tessera_jax as tj\n"
        "from tessera_jax.planning import loops, planner\n"
        "m = tj.BlockMask.uniform(256, 256, 64, 64, np.ones((1, 4, 4), bool))\n"
        "s = (1, 256, 2, 32)\n"
        "flat = tj.Options(planner=planner.PlannerConfig(loops='vectorised'))\n"
        "tj.precompile(m, s, s, 'float32', options=flat)\n"
        "print(loops.ready(), loops.warming())\n"
        "tj.precompile(m, s, s, 'float32')\n"
        "print(loops.ready())\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True"], out.stdout


def test_precompile_serves_committed_inputs():
    """``jax.jit``'s cache tells arrays committed to a device (DLPack, ``device_put(x,
    device)``, whatever is computed from them) from uncommitted ones (``jnp.zeros``, what
    ``tj.precompile`` runs): it compiles both kinds, so a request of either compiles nothing."""
    from pallas_kernels.xla import executor
    rng = np.random.default_rng(31)
    m = tj.BlockMask.uniform(96, 96, 32, 32, rng.random((2, 3, 3)) < 0.6)
    shape = (1, 96, 2, 12)                               # a shape no other test compiles
    tj.precompile(m, shape, shape, jnp.float32, backend="xla",
                  options=tj.Options(host_planning="sync"))
    n = executor.execute_plan._cache_size()
    q, k, v = (jax.device_put(x, jax.devices()[0])
               for x in random_qkv(1, 96, 96, 2, 2, 12, "float32", 5))
    assert q.committed
    out = tj.sparse_attention(q, k, v, m, backend="xla")
    assert executor.execute_plan._cache_size() == n      # nothing new compiled
    np.testing.assert_allclose(out, tj.reference_attention(q, k, v, m), rtol=2e-5, atol=2e-5)


def test_plan_cache_is_bounded_lru():
    """The front cache (``api.PlanCache``) drops the least recently used plans past its entry
    count or its bytes of plan arrays; ``tj.plan`` returns its hits."""
    from tessera_jax.runtime.api import PlanCache
    rng = np.random.default_rng(9)
    ms = [tj.BlockMask.uniform(64, 64, 16, 16, rng.random((1, 4, 4)) < 0.5) for _ in range(5)]
    shape = (1, 64, 2, 8)
    plans = [tj.plan(m, shape, shape, jnp.float32) for m in ms]
    assert tj.plan(ms[0], shape, shape, jnp.float32) is plans[0]
    cache = PlanCache(max_plans=3)
    for i in range(3):
        cache.put(i, plans[i])
    assert cache.get(0) is plans[0]                    # a hit refreshes entry 0
    cache.put(3, plans[3])                             # evicts 1, not 0
    assert len(cache) == 3 and cache.keys() == [2, 0, 3]
    assert cache.get(1) is None and cache.get(None) is None
    small = PlanCache(max_bytes=1)                     # bytes bound: keep only the newest
    small.put(0, plans[0])
    small.put(4, plans[4])
    assert small.keys() == [4]


# --- one way through, one owner of the caches ------------------------------------------------
def test_backend_table_is_static_and_ordered():
    from tessera_jax.runtime import dispatch
    assert list(dispatch.BACKENDS) == ["mosaic_gpu", "triton", "xla"]
    assert dispatch.BACKENDS["xla"].min_compute_capability is None
    with pytest.raises(TypeError):
        dispatch.BACKENDS["cuda"] = dispatch.BACKENDS["xla"]      # no registration
    from tessera_jax.validation import check_qkv
    q, k, v, m = _ok()
    shape = check_qkv(q, k, v)
    if jax.default_backend() == "cpu":
        assert dispatch.resolve(None, shape) == "xla"
        assert not dispatch.is_available("mosaic_gpu") and not dispatch.is_available("triton")


def test_sparse_attention_checks_the_mask_once_and_runs_the_plan_of_tj_plan(monkeypatch):
    from tessera_jax.planning import planner
    from tessera_jax.runtime import api, host_plans
    from tessera_jax import validation
    checks = []

    def counted(mask, shape):
        checks.append(1)
        return validation.check_mask(mask, shape)

    monkeypatch.setattr(api, "check_mask", counted)
    monkeypatch.setattr(planner, "check_mask", counted)
    ran = []
    real = host_plans.attention_plan
    monkeypatch.setattr(host_plans, "attention_plan", lambda p, *a: ran.append(p) or real(p, *a))
    q, k, v = random_qkv(1, 64, 64, 2, 2, 16, "float32", 4)
    m = tj.BlockMask.uniform(64, 64, 16, 16, np.random.default_rng(41).random((2, 4, 4)) < .5)
    tj.sparse_attention(q, k, v, m)                  # a new mask: planned once, checked once
    assert len(checks) == 1
    assert tj.plan(m, q.shape, k.shape, q.dtype) is ran[0]    # the plan that ran (cache hit)
    assert len(checks) == 1


def test_plan_takes_the_templates_policy_and_unit_order():
    """An explicit template without a policy plans with the template's own policy and unit
    order (the planner reads no template table); a given policy wins."""
    from pallas_kernels import templates
    t = templates.get("mgpu_q64x2_kv64_s2_hm")
    assert (t.policy, t.unit_order) == ("pack", "head_major")
    m = tj.BlockMask.uniform(256, 256, 64, 64, np.random.default_rng(7).random((2, 4, 4)) < .6)
    shape = (1, 256, 2, 64)
    p = tj.plan(m, shape, shape, jnp.bfloat16, template=t.name)     # no GPU needed to plan
    assert (p.template, p.policy, p.unit_order, p.tile_q) == (t.name, "pack", "head_major", 64)
    assert tj.plan(m, shape, shape, jnp.bfloat16, template=t.name, policy="keep").policy == "keep"
    with pytest.raises(ValueError, match="belongs to backend 'mosaic_gpu'"):
        tj.plan(m, shape, shape, jnp.bfloat16, template=t.name, backend="xla")
    with pytest.raises(ValueError, match="policy must be one of"):
        tj.plan(m, shape, shape, jnp.bfloat16, policy="best")
    with pytest.raises(ValueError, match="can't take this call"):
        tj.plan(m, (1, 256, 2, 32), (1, 256, 2, 32), jnp.bfloat16, template=t.name)


def test_clear_caches_makes_the_next_call_a_new_mask_request(monkeypatch, tmp_path):
    """tj.clear_caches(): a repeated call recomputes the mask's features and its plan; the
    loaded ranking table stays (a new mask does not reload it) unless fresh_process=True."""
    from tessera_jax.planning import planner
    from tessera_jax.runtime import api, dense_route, kernel_runner
    from tessera_jax.select import features as F
    from tessera_jax.select import ranking as S
    from tessera_jax.tools import profiler as P
    # A table for this device (cpu), so that selection computes features here.
    monkeypatch.setenv("TESSERA_JAX_PLAN_TABLES", str(tmp_path))
    rng = np.random.default_rng(0)
    cands = [("xla_64x64", "merge"), ("xla_128x128", "keep")]
    P.write_table(tmp_path / "cpu.json", S.fit_table(
        rng.random((12, len(F.FEATURE_NAMES))), 1.0 + rng.random((12, 2)), cands,
        gpu={"name": "cpu", "arch": "cpu"}, provenance={}))
    monkeypatch.setattr(S, "_current_device", lambda: ("cpu", None))
    features = []
    real = F._mask_part
    monkeypatch.setattr(F, "_mask_part", lambda m, *a: features.append(m.digest) or real(m, *a))
    builds = []
    real_build = planner.build_unchecked     # a request that plans (one policy or more)
    monkeypatch.setattr(planner, "build_unchecked", lambda *a, **kw: builds.append(1)
                        or real_build(*a, **kw))
    q, k, v = random_qkv(1, 64, 64, 2, 2, 16, "float32", 5)
    m = tj.BlockMask.uniform(64, 64, 16, 16, rng.random((2, 4, 4)) < .5)
    try:
        tj.clear_caches(fresh_process=True)
        for _ in range(2):
            tj.sparse_attention(q, k, v, m)
        assert features == [m.digest] and len(builds) == 1
        assert len(api._PLANS) == 1 and S._TABLES
        tj.clear_caches()
        assert not (api._PLANS or F._CACHE or F._LAYOUTS or S._CHOICES
                    or dense_route._ALL_SELECTED or kernel_runner._PREPARED)
        assert S._TABLES and S._RESOLVED                   # kept: no new mask reloads them
        tj.sparse_attention(q, k, v, m)
        assert features == [m.digest] * 2 and len(builds) == 2
        tj.clear_caches(fresh_process=True)
        assert not (S._TABLES or S._RESOLVED)
        with pytest.raises(TypeError, match="fresh_process must be a bool"):
            tj.clear_caches(fresh_process="yes")
    finally:
        tj.clear_caches(fresh_process=True)


def test_describe_says_how_the_plan_was_chosen_and_for_which_machine():
    """``describe()`` names the source of the template choice (table, heuristic, default or
    the caller) and says its time estimate is the cost model's, not this machine's."""
    import warnings

    from tessera_jax.select import ranking
    from tessera_jax.validation import check_shapes
    m = tj.BlockMask.uniform(512, 512, 64, 64, np.random.default_rng(0).random((2, 8, 8)) < .5)
    shapes = ((1, 512, 2, 64), (1, 512, 2, 64), "float32")
    d = tj.plan(m, *shapes, backend="xla").describe()
    assert "chosen by the XLA backend's default template" in d
    assert "cost model (an H200-class GPU of 132 SMs" in d
    assert "chosen by the caller's template;" in tj.plan(m, *shapes, template="xla_128x128").describe()
    assert "caller's template and policy" in tj.plan(m, *shapes, template="xla_128x128",
                                                     policy="split").describe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # no table for this CPU: warned once
        src = ranking.source(m, check_shapes(*shapes), "mosaic_gpu")
    assert src.startswith("the documented heuristic (no usable table for")
