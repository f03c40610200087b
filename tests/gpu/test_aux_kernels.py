"""The Mosaic GPU auxiliary kernels compiled on this machine's Hopper GPU (``make test-gpu``):
row dots, block sums, top-k and the k-means assignment against NumPy references and the Triton
kernels they replace, on ragged shapes (the interpreted versions: tests/test_mosaic_aux_kernels.py;
timings: benchmarks/aux_kernels.py). Skipped without a Hopper GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera_jax.masks import dynamic as dm
from tessera_jax.runtime import dispatch

HOPPER = jax.default_backend() in ("gpu", "cuda") and (dispatch.gpu_capability() or (0, 0)) >= (
    9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")]


def test_row_dots_compiled():
    from pallas_kernels.mosaic import delta as md
    from pallas_kernels.triton import delta as td
    rng = np.random.default_rng(0)
    for shape in ((1, 200, 3, 128), (2, 64, 1, 64), (1, 32760, 12, 128)):
        o, g = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
        got = np.asarray(md.row_dots(o, g))
        want = np.einsum("bqhd,bqhd->bhq", np.asarray(o, np.float64), np.asarray(g, np.float64))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(got, np.asarray(td.row_dots(o, g)), rtol=1e-5, atol=1e-4)


def test_block_sums_compiled():
    from pallas_kernels.mosaic import pool as mp
    from pallas_kernels.triton import pool as tp
    rng = np.random.default_rng(1)
    for bounds, H in ((np.cumsum([0, 1, 3, 64, 77, 256, 8]), 2),
                      (dm.cube_layout((21, 30, 52))[1], 12)):
        x = jnp.asarray(rng.standard_normal((1, int(bounds[-1]), H, 128)), jnp.bfloat16)
        got = np.asarray(mp.block_sums(x, bounds))
        want = np.stack([np.asarray(x[:, a:b], np.float64).sum(axis=1)
                         for a, b in zip(bounds[:-1], bounds[1:])], axis=1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(got, np.asarray(tp.block_sums(x, bounds)), rtol=1e-5,
                                   atol=2e-4)


def test_top_k_compiled():
    from pallas_kernels.mosaic import topk as mt
    from pallas_kernels.triton import topk as tt
    rng = np.random.default_rng(2)
    for shape, k in (((3, 37), 5), ((12, 624, 624), 78), ((2, 4096), 1000), ((1, 5), 5)):
        x = rng.integers(-3, 4, shape).astype(np.float32)        # ties
        x[..., ::7] = rng.standard_normal(x[..., ::7].shape)
        got = np.asarray(mt.topk_mask(jnp.asarray(x), k))
        _, idx = jax.lax.top_k(jnp.asarray(x), k)
        want = np.zeros(shape, bool)
        np.put_along_axis(want, np.asarray(idx), True, axis=-1)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, np.asarray(tt.topk_mask(jnp.asarray(x), k)))


def test_assign_compiled():
    from pallas_kernels.mosaic import kmeans as mk
    from pallas_kernels.triton import kmeans as tk
    from tessera_jax.masks.dynamic import clustering
    rng = np.random.default_rng(3)
    for H, L, F, C in ((2, 100, 64, 3), (2, 200, 128, 150), (12, 32760, 128, 1000)):
        x = rng.integers(-3, 4, (H, L, F)).astype(np.float32)   # exact distances: exact ties
        c = rng.integers(-3, 4, (H, C, F)).astype(np.float32)
        c[:, -1] = c[:, 1]
        x, c = jnp.asarray(x, jnp.bfloat16), jnp.asarray(c)
        got = np.asarray(mk.assign(x, c))
        np.testing.assert_array_equal(got, np.asarray(jax.vmap(clustering._assign)(x, c)))
        np.testing.assert_array_equal(got, np.asarray(tk.assign(x, c)))
