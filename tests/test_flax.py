"""tessera_jax.flax: attention_fn for nnx.MultiHeadAttention, SparseSelfAttention, MaskSchedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.nnx as nnx
from hypothesis import given, settings, strategies as st

import tessera_jax as tj
from tessera_jax.flax import (AttentionOptions, MaskSchedule, SparseAttentionFn,
                              SparseSelfAttention, at_step, attention, make_attention_fn)

TOL = dict(atol=2e-5, rtol=2e-5)


def _rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _qkv(seed, B, L, H, D, Hkv=None):
    ks = jax.random.split(jax.random.key(seed), 3)
    Hkv = Hkv or H
    return (jax.random.normal(ks[0], (B, L, H, D)), jax.random.normal(ks[1], (B, L, Hkv, D)),
            jax.random.normal(ks[2], (B, L, Hkv, D)))


def window_mask(L, block, width, heads=1):
    """Sliding-window block mask: key block j kept for query block i iff |i - j| <= width[h]."""
    n = -(-L // block)
    i = np.arange(n)
    w = np.broadcast_to(np.asarray(width), (heads,))
    return tj.BlockMask.uniform(L, L, block, block, np.abs(i[None, :, None] - i[None, None, :])
                                <= w[:, None, None])


def full_mask(L, bounds=None):
    bounds = bounds if bounds is not None else [0, L]
    n = len(bounds) - 1
    return tj.BlockMask(bounds, bounds, np.ones((1, n, n), bool))


def _dense(q, k, v):
    return jax.nn.dot_product_attention(q, k, v)


# --- the attention_fn -------------------------------------------------------------------------
def test_attention_fn_all_selected_matches_dense():
    q, k, v = _qkv(0, 2, 40, 2, 16)
    fn = make_attention_fn(full_mask(40, [0, 7, 8, 25, 40]))
    np.testing.assert_allclose(fn(q, k, v), _dense(q, k, v), **TOL)


@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_attention_fn_random_mask_matches_reference(data):
    L = data.draw(st.sampled_from([24, 40]), label="L")   # few shapes: few compiles
    cuts = sorted(data.draw(st.sets(st.integers(1, L - 1), min_size=1, max_size=5), label="cuts"))
    bounds = [0, *cuts, L]
    n = len(bounds) - 1
    Hq, group = data.draw(st.sampled_from([(2, 1), (4, 2), (2, 2)]), label="heads")
    Hm = data.draw(st.sampled_from([1, Hq]), label="Hm")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    blocks = np.random.default_rng(seed).random((Hm, n, n)) < 0.5
    mask = tj.BlockMask(bounds, bounds, blocks)
    q, k, v = _qkv(seed, 1, L, Hq, 16, Hq // group)
    out = make_attention_fn(mask)(q, k, v)
    np.testing.assert_allclose(out, tj.reference_attention(q, k, v, mask), **TOL)


def test_attention_fn_extra_batch_dims_and_dtype():
    mask = window_mask(24, 8, 1)
    q, k, v = (x.reshape(2, 1, 24, 2, 8) for x in _qkv(3, 2, 24, 2, 8))
    out = make_attention_fn(mask)(q, k, v, dtype=jnp.bfloat16)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    ref = tj.reference_attention(*(x.reshape(2, 24, 2, 8) for x in (q, k, v)), mask)
    np.testing.assert_allclose(out.reshape(2, 24, 2, 8).astype(jnp.float32), ref, atol=3e-2)


def _mha(fn, seed=0, **kw):
    return nnx.MultiHeadAttention(2, 32, qkv_features=32, attention_fn=fn, decode=False,
                                  rngs=nnx.Rngs(seed), **kw)


def test_multihead_attention_all_selected_matches_default_under_jit():
    x = _rand(1, (2, 30, 32))
    sparse = _mha(make_attention_fn(full_mask(30, [0, 16, 30])))
    dense = _mha(nnx.dot_product_attention)
    want = dense(x)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(sparse, x), want, **TOL)
    gd, state = nnx.split(sparse)
    np.testing.assert_allclose(jax.jit(lambda s, x: nnx.merge(gd, s)(x))(state, x), want, **TOL)


def _ref_fn(q, k, v, mask, scale=None):
    return tj.reference_attention(q, k, v, mask, scale=scale)


def test_multihead_attention_random_mask_matches_reference_and_no_retrace():
    mask = tj.BlockMask.uniform(30, 30, 8, 8, np.random.default_rng(5).random((2, 4, 4)) < 0.5)
    sparse = _mha(make_attention_fn(mask), seed=2)
    ref = _mha(SparseAttentionFn(mask, options=AttentionOptions(sparse_fn=_ref_fn)), seed=2)
    traces = []

    @nnx.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    for seed in (3, 4):
        x = _rand(seed, (1, 30, 32))
        np.testing.assert_allclose(f(sparse, x), ref(x), **TOL)
    assert len(traces) == 1


def test_attention_fn_gqa_in_multihead_attention():
    mask = window_mask(24, 8, 1, heads=4)
    m = nnx.MultiHeadAttention(4, 32, num_kv_heads=2, attention_fn=make_attention_fn(mask),
                               decode=False, rngs=nnx.Rngs(0))
    x = _rand(6, (1, 24, 32))
    q, k, v = m.query(x), m.key(x), m.value(x)
    want = m.out(tj.reference_attention(q, k, v, mask))
    np.testing.assert_allclose(m(x), want, **TOL)


def test_attention_fn_rejects_unsupported_arguments():
    fn = make_attention_fn(window_mask(16, 8, 0))
    q, k, v = _qkv(0, 1, 16, 2, 8)
    with pytest.raises(ValueError, match="mask"):
        fn(q, k, v, mask=jnp.ones((1, 2, 16, 16), bool))
    with pytest.raises(ValueError, match="dropout"):
        fn(q, k, v, dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="is_causal"):
        fn(q, k, v, is_causal=True)
    with pytest.raises(TypeError, match="input_positions"):
        fn(q, k, v, input_positions=jnp.arange(16))
    with pytest.raises(TypeError, match="mask_or_schedule"):
        make_attention_fn(np.ones((16, 16), bool))
    with pytest.raises(ValueError, match="step only applies"):
        make_attention_fn(window_mask(16, 8, 0), step=1)
    with pytest.raises(TypeError, match="options"):
        attention(q, k, v, None, options="xla")
    with pytest.raises(ValueError, match="dense_implementation"):
        AttentionOptions(dense_implementation="flash")


# --- schedules ------------------------------------------------------------------------------------
def test_schedule_selects_mask_at_trace_time():
    m1, m2 = window_mask(32, 8, 0), window_mask(32, 8, 1, heads=2)
    sched = MaskSchedule([[None, m1], [m2, m2]])          # [step][layer]
    q, k, v = _qkv(7, 1, 32, 2, 16)
    fn0, fn1 = make_attention_fn(sched, layer=0), make_attention_fn(sched, layer=1)
    traces = []

    @jax.jit
    def f(q, k, v):
        traces.append(1)
        with at_step(0):
            a, b = fn0(q, k, v), fn1(q, k, v)
        with at_step(1):
            c = fn0(q, k, v)
        return a, b, c

    for seed in (7, 8):
        q, k, v = _qkv(seed, 1, 32, 2, 16)
        a, b, c = f(q, k, v)
        np.testing.assert_allclose(a, _dense(q, k, v), **TOL)
        np.testing.assert_allclose(b, tj.reference_attention(q, k, v, m1), **TOL)
        np.testing.assert_allclose(c, tj.reference_attention(q, k, v, m2), **TOL)
    assert len(traces) == 1
    with pytest.raises(ValueError, match="at_step"):
        fn0(q, k, v)
    np.testing.assert_allclose(make_attention_fn(sched, layer=1, step=1)(q, k, v),
                               tj.reference_attention(q, k, v, m2), **TOL)
    with pytest.raises(TypeError, match="step"):
        with at_step(jnp.int32(0)):
            pass
    # The pitfall: a compiled call inside at_step(s) entered outside jit reuses its traced
    # masks; the block raises instead of returning step 0's output silently.
    g = jax.jit(lambda q, k, v: fn0(q, k, v))
    with at_step(0):
        g(q, k, v)                                       # traced here: step 0 read
    with pytest.raises(ValueError, match="already-compiled"):
        with at_step(1):
            g(q, k, v)                                   # cache hit: step 1 never read
    with at_step(1):
        np.testing.assert_allclose(fn0(q, k, v), tj.reference_attention(q, k, v, m2), **TOL)
    with pytest.raises(ValueError, match="layer"):
        make_attention_fn(sched, layer=2)


def test_mask_schedule_variants_runs_and_identity():
    m = window_mask(32, 8, 1)
    s = MaskSchedule.warmup(m, 3, 10, dense_steps=4, dense_layers=[2])
    assert (s.num_steps, s.num_layers) == (10, 3)
    assert len(s.variants) == 2 and s.runs() == [(0, 4, 0), (4, 10, 1)]
    assert s.mask(0, 3) is None and s.mask(0, 4) == m and s.mask(2, 9) is None
    assert s == MaskSchedule.warmup([m, m, None], 3, 10, dense_steps=4)
    assert hash(s) == hash(MaskSchedule.warmup(lambda l: None if l == 2 else m, 3, 10, dense_steps=4))
    refresh = MaskSchedule.from_fn(lambda l, st: None if st % 3 == 0 else m, 2, 7)
    assert len(refresh.variants) == 2 and len(refresh.runs()) == 5
    np.testing.assert_allclose(s.density()[5], [m.density, m.density, 1.0])
    with pytest.raises(ValueError, match="dense_steps"):
        MaskSchedule.warmup(m, 3, 10, dense_steps=11)
    with pytest.raises(ValueError, match="table\\[1\\]"):
        MaskSchedule([[m, m], [m]])
    with pytest.raises(TypeError, match="table\\[0\\]\\[1\\]"):
        MaskSchedule([[m, "dense"]])
    with pytest.raises(ValueError, match="masks has 2 entries"):
        MaskSchedule.warmup([m, m], 3, 10)
    with pytest.raises(TypeError, match="step"):
        s.mask(0, 1.0)


# --- SparseSelfAttention --------------------------------------------------------------------------
def test_sparse_self_attention_matches_reference_under_nnx_jit_and_jax_jit():
    mask = window_mask(40, 8, 1, heads=4)
    mod = SparseSelfAttention(4, 32, mask=mask, num_kv_heads=2, qk_norm=True, rngs=nnx.Rngs(0))
    traces = []

    @nnx.jit
    def f(m, x):
        traces.append(1)
        return m(x)

    gd, state = nnx.split(mod)
    g = jax.jit(lambda s, x: nnx.merge(gd, s)(x))
    for seed in (1, 2):
        x = _rand(seed, (2, 40, 32))
        q = mod.q_norm(mod.q(x).reshape(2, 40, 4, 8))
        k, v = jnp.split(mod.kv(x).reshape(2, 40, 4, 8), 2, axis=2)
        want = mod.out(tj.reference_attention(q, mod.k_norm(k), v, mask).reshape(2, 40, 32))
        np.testing.assert_allclose(f(mod, x), want, **TOL)
        np.testing.assert_allclose(g(state, x), want, **TOL)
    assert len(traces) == 1


def test_sparse_self_attention_schedule_all_selected_is_dense():
    full = full_mask(24, [0, 5, 24])
    sched = MaskSchedule.warmup(full, 2, 3, dense_steps=1)
    mod = SparseSelfAttention(2, 16, mask=sched, layer=1, rngs=nnx.Rngs(0))
    x = _rand(9, (1, 24, 16))
    dense = mod(x, mask=None, step=0)
    np.testing.assert_allclose(mod(x, step=2), dense, **TOL)
    with at_step(1):
        np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(mod, x), dense, **TOL)
    with pytest.raises(ValueError, match="in_features"):
        SparseSelfAttention(3, 16, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="mask"):
        SparseSelfAttention(2, 16, mask="sliding", rngs=nnx.Rngs(0))


def test_sparse_options_reach_the_sparse_call(monkeypatch):
    """``AttentionOptions.sparse_options`` is the ``options`` of the layer's sparse calls;
    anything but an ``Options`` is refused."""
    from tessera_jax.runtime import api
    seen = []
    monkeypatch.setattr(api, "sparse_attention",
                        lambda *a, **kw: seen.append(kw["options"]) or a[0])
    opts = tj.Options(device_gather="traced")
    q = jnp.ones((1, 8, 2, 4))
    mask = tj.BlockMask([0, 8], [0, 8], np.ones((1, 1, 1), bool))
    tj.flax.attention(q, q, q, mask, options=AttentionOptions(sparse_options=opts))
    assert seen == [opts]
    with pytest.raises(TypeError, match="sparse_options must be a tessera_jax.Options"):
        AttentionOptions(sparse_options={"device_gather": "traced"})
