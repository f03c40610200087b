"""``tj.precompile`` on this machine's GPU (``make test-gpu``): a request after it, with q, k, v
committed to the device (as DLPack or ``device_put(x, device)`` give them), compiles nothing on
the tiered device route and on the host plan's route, and agrees with the reference. Skipped
without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tessera_jax as tj
from tessera_jax.runtime import tiered
from tessera_jax.tools.timing import backend_compiles

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]


@pytest.mark.parametrize("mode", ["device_first", "sync"])
def test_tiered_and_host_routes_serve_committed_inputs_after_precompile(mode):
    rng = np.random.default_rng(41)
    L, H, D = 1024, 2, 128
    qb = np.r_[0, np.sort(rng.choice(np.arange(16, L - 16, 8), 11, replace=False)), L]
    m = tj.BlockMask(qb, qb, rng.random((H, 12, 12)) < 0.4)
    opts = tj.Options(host_planning=mode)
    tj.precompile(m, (1, L, H, D), (1, L, H, D), jnp.bfloat16, options=opts,
                  tiered_routes=("static",))
    ks = jax.random.split(jax.random.key(7), 3)
    dev = jax.devices()[0]
    q, k, v = (jax.device_put(jax.random.normal(x, (1, L, H, D), jnp.bfloat16), dev)
               for x in ks)
    assert q.committed
    tj.clear_caches()
    new = m if mode == "sync" else tj.BlockMask(qb, qb, ~m.blocks)   # same bounds
    before = tiered.stats().get("device_route", 0)
    with backend_compiles() as compiles:
        out = jax.block_until_ready(tj.sparse_attention(q, k, v, new, options=opts))
    assert compiles == []
    assert tiered.stats().get("device_route", 0) - before == (mode == "device_first")
    ref = tj.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), new)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2, rtol=2e-2)
    assert tiered.wait(120)
