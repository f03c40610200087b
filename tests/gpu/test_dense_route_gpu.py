"""The device route's all-selected test on this machine's GPU (``make test-gpu``): a device mask
whose traced blocks are all selected runs cuDNN, one with a hole runs its plan, bit for bit the
route without the test, both exact against the reference, forward and backward. Skipped
without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as tj
from tessera_jax.runtime import dense_route, device_route, dispatch
from tessera_jax.validation import check_shapes

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]


def _case(seed, all_selected, Hq=4, Hkv=2, D=128):
    rng = np.random.default_rng(seed)
    qb = np.r_[0, np.sort(rng.choice(np.arange(16, 1000, 8), 7, replace=False)), 1024]
    kb = np.r_[0, np.sort(rng.choice(np.arange(16, 760, 8), 5, replace=False)), 768]
    blocks = np.ones((Hq, 8, 6), bool) if all_selected else rng.random((Hq, 8, 6)) < 0.5
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (1, 1024, Hq, D), jnp.bfloat16)
    k, v = (jax.random.normal(x, (1, 768, Hkv, D), jnp.bfloat16) for x in ks[1:])
    return q, k, v, qb, kb, blocks


@pytest.mark.parametrize("all_selected", [True, False])
def test_all_selected_test_on_the_gpu(all_selected):
    q, k, v, qb, kb, blocks = _case(5 + all_selected, all_selected)
    shape = check_shapes(q.shape, k.shape, q.dtype)
    backend = dispatch.resolve(None, shape)
    impl = dense_route.on_device(q, k, v, shape, backend, False, 0.1)
    assert impl == "cudnn"

    def route(dense):
        return jax.jit(lambda q, k, v, b: device_route.attention(
            q, k, v, tj.BlockMask(qb, kb, b), shape, backend, None, 0.1, False, dense=dense))

    b = jnp.asarray(blocks)
    with_test, without = route(impl)(q, k, v, b), route(None)(q, k, v, b)
    user = jax.jit(lambda q, k, v, b: tj.sparse_attention(q, k, v, tj.BlockMask(qb, kb, b),
                                                          scale=0.1))(q, k, v, b)
    ref = tj.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                 tj.BlockMask(qb, kb, blocks), scale=0.1)
    np.testing.assert_allclose(np.asarray(with_test, np.float32), ref, atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.asarray(user), np.asarray(with_test))
    if not all_selected:
        np.testing.assert_array_equal(np.asarray(with_test), np.asarray(without))
    ct = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)

    def loss(f):
        return lambda q, k, v: (f(q, k, v).astype(jnp.float32) * ct).sum()

    got = jax.jit(jax.grad(loss(lambda q, k, v: tj.sparse_attention(
        q, k, v, tj.BlockMask(qb, kb, b), scale=0.1)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: tj.reference_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        tj.BlockMask(qb, kb, blocks), scale=0.1)), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        scale = float(jnp.abs(w.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=3e-2 * scale, rtol=3e-2)
