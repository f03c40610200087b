"""All-selected masks on a GPU go to cuDNN dense attention (tessera_jax.runtime.dense_route)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera_jax as tj
from tessera_jax.runtime import api, core, host_plans
from tessera_jax.runtime import dispatch
from tessera_jax.runtime import dense_route
from tessera_jax.validation import check_shapes

from strategies import random_qkv


def _full(Hm=1):
    return tj.BlockMask([0, 30, 64, 90], [0, 40, 80], np.ones((Hm, 3, 2), bool))


def test_all_selected():
    m = _full(Hm=3)
    assert dense_route.all_selected(m)
    b = np.ones((3, 3, 2), bool)
    b[2, 1, 0] = False                      # one block of one head
    assert not dense_route.all_selected(tj.BlockMask(m.q_bounds, m.kv_bounds, b))


@pytest.mark.parametrize("backend,dtype,D,lse,expect", [
    ("mosaic_gpu", jnp.bfloat16, 128, False, True),
    ("triton", jnp.float16, 64, False, True),
    ("mosaic_gpu", jnp.bfloat16, 128, True, False),      # LSE asked: planned path
    ("xla", jnp.bfloat16, 128, False, False),            # no GPU
    ("mosaic_gpu", jnp.float32, 128, False, False),
    ("mosaic_gpu", jnp.bfloat16, 160, False, False),
    ("mosaic_gpu", jnp.bfloat16, 60, False, False),
])
def test_takes(backend, dtype, D, lse, expect):
    shape = check_shapes((1, 90, 2, D), (1, 80, 2, D), dtype)
    assert dense_route.takes(_full(), shape, backend, lse) is expect
    b = np.ones((1, 3, 2), bool)
    b[0, 0, 1] = False
    assert not dense_route.takes(tj.BlockMask([0, 30, 64, 90], [0, 40, 80], b), shape, backend,
                                 lse)


@pytest.fixture
def fake_gpu(monkeypatch):
    """resolve() says mosaic_gpu; cuDNN is the float32 reference; planning is recorded."""
    calls = {"dense": 0, "planned": 0}

    def dense(q, k, v, scale):
        calls["dense"] += 1
        return tj.reference_attention(q, k, v, _full(), scale=scale).astype(q.dtype)

    def run(q, k, v, plan, scale, return_lse, options):
        calls["planned"] += 1
        return jnp.zeros_like(q)

    monkeypatch.setattr(dispatch, "resolve", lambda backend, shape: backend or "mosaic_gpu")
    monkeypatch.setattr(dense_route, "attention", dense)
    monkeypatch.setattr(api, "_planned", lambda *a, **k: object())
    monkeypatch.setattr(host_plans, "attention_plan", lambda p, options: p)
    monkeypatch.setattr(core, "attention", run)
    return calls


def test_sparse_attention_routes_full_masks_to_dense(fake_gpu):
    q, k, v = random_qkv(1, 90, 80, 4, 2, 64, "bfloat16", 0)
    out = tj.sparse_attention(q, k, v, _full(), scale=0.3)
    assert fake_gpu == {"dense": 1, "planned": 0}
    ref = tj.reference_attention(q, k, v, _full(), scale=0.3)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)
    # An explicit backend or policy, an LSE, or a mask with a hole keep the planned path.
    tj.sparse_attention(q, k, v, _full(), backend="mosaic_gpu")
    tj.sparse_attention(q, k, v, _full(), policy="keep")
    tj.sparse_attention(q, k, v, _full(), return_lse=True)
    b = np.ones((1, 3, 2), bool)
    b[0, 2, 0] = False
    tj.sparse_attention(q, k, v, tj.BlockMask([0, 30, 64, 90], [0, 40, 80], b))
    assert fake_gpu == {"dense": 1, "planned": 4}


def test_cudnn_refusal_warns_once_and_plans(fake_gpu, monkeypatch):
    def refuse(q, k, v, scale):
        raise NotImplementedError("head dim")
    monkeypatch.setattr(dense_route, "attention", refuse)
    monkeypatch.setattr(dense_route.warn_fallback, "_done", False, raising=False)
    q, k, v = random_qkv(1, 90, 80, 2, 2, 64, "bfloat16", 1)
    with pytest.warns(UserWarning, match="cuDNN dense attention refused"):
        tj.sparse_attention(q, k, v, _full())
    assert fake_gpu["planned"] == 1


@pytest.fixture
def fresh_verdicts():
    """The compiled cuDNN calls and refusals per shape forgotten before and after the test."""
    dense_route.clear_caches(verdicts=True)
    yield
    dense_route.clear_caches(verdicts=True)


def test_dense_call_gqa_scale_under_jit(monkeypatch, fresh_verdicts):
    """dense_route.attention itself (GQA, a non-default scale, eager and under jit), with
    jax's XLA implementation standing in for cuDNN on this CPU."""
    import jax
    real = dense_route._dense_fn
    monkeypatch.setattr(dense_route, "_dense_fn", lambda implementation="xla": real("xla"))
    q, k, v = random_qkv(2, 90, 80, 6, 2, 32, "float32", 7)
    ref = np.asarray(tj.reference_attention(q, k, v, _full(), scale=0.3))
    for fn in (dense_route.attention, jax.jit(dense_route.attention, static_argnums=3)):
        np.testing.assert_allclose(np.asarray(fn(q, k, v, 0.3)), ref, atol=1e-5, rtol=1e-5)


def test_a_call_that_does_not_compile_is_refused_once(monkeypatch, fresh_verdicts):
    """A compile-time refusal (not a trace-time check) becomes NotImplementedError, remembered
    per shape, so sparse_attention plans instead."""
    class Broken:
        calls = 0

        def lower(self, *a, **k):
            Broken.calls += 1
            raise RuntimeError("cuDNN is not detected.")

    monkeypatch.setattr(dense_route, "_dense_fn", lambda implementation="cudnn": Broken())
    q, k, v = random_qkv(1, 90, 80, 2, 2, 64, "bfloat16", 2)
    for _ in range(2):
        with pytest.raises(NotImplementedError, match="cuDNN is not detected"):
            dense_route.attention(q, k, v, 0.125)
    assert Broken.calls == 1


def test_plan_says_when_the_dense_route_runs(monkeypatch):
    """tj.plan is honest: the plan of a request sparse_attention sends to cuDNN says so
    (Plan.dense_route, describe()), and it is the plan that runs with return_lse=True."""
    monkeypatch.setattr(dispatch, "resolve", lambda backend, shape: backend or "mosaic_gpu")
    monkeypatch.setattr(host_plans, "choose_template",
                        lambda m, s, b: ("mgpu_q128_kv64_s2_hm", "merge"))
    tj.clear_caches()
    ran = []
    monkeypatch.setattr(host_plans, "attention_plan", lambda p, options: p)
    monkeypatch.setattr(core, "attention", lambda q, k, v, p, *a: ran.append(p) or (q, None))
    q, k, v = random_qkv(1, 90, 80, 4, 2, 64, "bfloat16", 3)
    p = tj.plan(_full(), q.shape, k.shape, q.dtype)
    assert p.dense_route and p.describe().startswith("dense route: sparse_attention runs cuDNN")
    assert p.template == "mgpu_q128_kv64_s2_hm" and tj.plan(_full(), q.shape, k.shape, q.dtype) is p
    tj.sparse_attention(q, k, v, _full(), return_lse=True)
    assert ran == [p]
    # Anything chosen by the caller, or a mask with a hole: the plan is what runs.
    for kw in ({"policy": "merge"}, {"template": "mgpu_q128_kv64_s2_hm"},
               {"backend": "mosaic_gpu"}):
        other = tj.plan(_full(), q.shape, k.shape, q.dtype, **kw)
        assert not other.dense_route and "dense route" not in other.describe()
    b = np.ones((1, 3, 2), bool)
    b[0, 2, 0] = False
    holed = tj.BlockMask([0, 30, 64, 90], [0, 40, 80], b)
    assert not tj.plan(holed, q.shape, k.shape, q.dtype).dense_route
    # A backend without cuDNN's route (here: the host) never sets it.
    monkeypatch.setattr(dispatch, "resolve", lambda backend, shape: backend or "xla")
    monkeypatch.setattr(host_plans, "choose_template", lambda m, s, b: ("xla_64x64", "merge"))
    tj.clear_caches()
    assert not tj.plan(_full(), q.shape, k.shape, q.dtype).dense_route
    tj.clear_caches()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2))
def test_all_selected_reads_the_packed_bits(H, nq, nk, holes):
    """``all_selected`` on the packed bits (first byte, then the count) agrees with the
    blocks' ``all`` for any block count, all selected or with unselected blocks anywhere
    (the first byte full and a hole later included)."""
    from tessera_jax.runtime import dense_route
    rng = np.random.default_rng(H * 100 + nq * 10 + nk + holes)
    b = np.ones((H, nq, nk), bool)
    for _ in range(holes):
        b.reshape(-1)[rng.integers(b.size)] = False
    m = tj.BlockMask(np.arange(nq + 1) * 8, np.arange(nk + 1) * 8, b)
    dense_route.clear_caches()
    assert dense_route.all_selected(m) == bool(b.all())


def _device_case(seed, all_selected, per_head_bounds=False):
    """(q, k, v, device mask with traced blocks, static bounds or per-head ones as jax arrays,
    the same mask on the host)."""
    rng = np.random.default_rng(seed)
    qb, kb = np.array([0, 30, 64, 90]), np.array([0, 40, 80])
    if per_head_bounds:
        qb = np.stack([qb, [0, 20, 50, 90]])
        kb = np.stack([kb, [0, 16, 80]])
    blocks = np.ones((2, 3, 2), bool) if all_selected else rng.random((2, 3, 2)) < 0.6
    q, k, v = random_qkv(1, 90, 80, 2, 1, 16, "float32", seed)    # GQA
    host = tj.BlockMask(qb, kb, blocks)
    bounds = (jnp.asarray(qb), jnp.asarray(kb)) if per_head_bounds else (qb, kb)
    return q, k, v, tj.BlockMask(*bounds, jnp.asarray(blocks)), host


@pytest.mark.parametrize("per_head_bounds", [False, True])
@pytest.mark.parametrize("all_selected", [True, False])
def test_device_route_tests_traced_blocks_and_keeps_the_plan_otherwise(all_selected,
                                                                       per_head_bounds,
                                                                       monkeypatch):
    """A device mask's traced blocks, all selected, run the dense branch (jax's XLA attention
    stands in for cuDNN); otherwise the planned branch, bit for bit the route without the test
    (static bounds stay static inside the conditional: planning them as traced operands gave
    other plans and +13% on the H100), exact against the reference either way, under jit,
    vmap (one predicate for the batch) and grad."""
    import jax
    from tessera_jax.runtime import device_route
    q, k, v, dev, host = _device_case(3, all_selected, per_head_bounds)
    shape = check_shapes(q.shape, k.shape, q.dtype)

    def run(q, k, v, m, dense):
        return device_route.attention(q, k, v, m, shape, "xla", None, 0.25, False,
                                      dense=dense)

    from tessera_jax.planning import device as planner
    real, kinds = planner.plan_on_device, []

    def spy(blocks, qb, kb, **kw):                  # what the planner sees: NumPy or traced
        kinds.append((type(qb).__module__.split(".")[0], type(kb).__module__.split(".")[0]))
        return real(blocks, qb, kb, **kw)

    monkeypatch.setattr(device_route._device, "plan_on_device", spy)
    device_route._run.clear_cache()                     # traced again: the spy sees it
    # The mask is made inside the program: NumPy bounds stay static (a BlockMask passed as a
    # jit argument has its bounds traced).
    f = jax.jit(lambda q, k, v, b, dense: run(q, k, v, tj.BlockMask(dev.q_bounds,
                                                                     dev.kv_bounds, b), dense),
                static_argnames="dense")
    with_test = f(q, k, v, dev.blocks, "xla")
    seen_with, kinds[:] = list(kinds), []
    without = f(q, k, v, dev.blocks, None)
    assert seen_with and seen_with == kinds
    assert ("numpy", "numpy") in kinds or per_head_bounds
    ref = tj.reference_attention(q, k, v, host, scale=0.25)
    np.testing.assert_allclose(with_test, ref, atol=2e-5, rtol=2e-5)
    if not all_selected:
        np.testing.assert_array_equal(with_test, without)
    jaxpr = jax.make_jaxpr(lambda q, k, v, m: run(q, k, v, m, "xla"))(q, k, v, dev)
    assert "cond[" in str(jaxpr)
    # vmap over the batch with per-element blocks: one predicate (an element with a hole
    # sends the whole batch to the planned branch, exact for every element).
    blocks = jnp.stack([dev.blocks, dev.blocks.at[0, 0, 0].set(False)])
    qs, ks, vs = (jnp.stack([x, x]) for x in (q, k, v))

    def one(q, k, v, b):
        return run(q, k, v, tj.BlockMask(dev.q_bounds, dev.kv_bounds, b), "xla")

    out = jax.jit(jax.vmap(one))(qs, ks, vs, blocks)
    for i in range(2):
        m = tj.BlockMask(host.q_bounds, host.kv_bounds, np.asarray(blocks[i]))
        np.testing.assert_allclose(out[i], tj.reference_attention(q, k, v, m, scale=0.25),
                                   atol=2e-5, rtol=2e-5)
    g = jax.jit(jax.grad(lambda q, k, v: run(q, k, v, dev, "xla").sum(), argnums=(0, 1, 2)))
    want = jax.grad(lambda q, k, v: tj.reference_attention(q, k, v, host, scale=0.25).sum(),
                    argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g(q, k, v), want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_sparse_attention_gives_device_masks_the_test_and_static_ones_the_host_check(
        fake_gpu, monkeypatch):
    """sparse_attention asks the device route for the all-selected test (cuDNN) on a device
    mask with nothing chosen by the caller and no LSE; a static all-selected mask with
    per-head bounds goes to cuDNN directly; static blocks never carry the test."""
    from tessera_jax.runtime import device_route
    seen = []
    monkeypatch.setattr(dense_route, "_verdict", lambda *a: object())   # cuDNN compiles it
    monkeypatch.setattr(device_route, "attention",
                        lambda *a, dense=None, **k: seen.append(dense) or a[0])
    q, k, v, dev, host = _device_case(4, True, per_head_bounds=True)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    tj.sparse_attention(q, k, v, dev)
    tj.sparse_attention(q, k, v, dev, return_lse=True)
    tj.sparse_attention(q, k, v, dev, backend="mosaic_gpu")
    assert seen[0] == "cudnn" and seen[1:] == [None, None]
    tj.sparse_attention(q, k, v, host)                       # static per-head, all selected
    assert fake_gpu["dense"] == 1 and len(seen) == 3
    b = host.blocks.copy()
    b[1, 0, 0] = False
    tj.sparse_attention(q, k, v, tj.BlockMask(host.q_bounds, host.kv_bounds, b))
    assert seen[3] is None and fake_gpu["dense"] == 1
    # cuDNN refusing the static per-head all-selected mask: the device route (the host
    # planner takes shared bounds only), without the test.
    def refuse(q, k, v, scale):
        raise NotImplementedError("head dim")
    monkeypatch.setattr(dense_route, "attention", refuse)
    monkeypatch.setattr(dense_route.warn_fallback, "_done", False, raising=False)
    with pytest.warns(UserWarning, match="cuDNN dense attention refused"):
        tj.sparse_attention(q, k, v, host)
    assert seen[4:] == [None]
