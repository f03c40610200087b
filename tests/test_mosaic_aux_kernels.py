"""The Mosaic GPU replacements of the Triton auxiliary kernels (issue 32, item 3), run under
the Mosaic GPU interpreter: row dots (``pallas_kernels.mosaic.delta``), block sums (``pool``),
each row's top k (``topk``) and the k-means assignment (``kmeans``), each against a float64 /
NumPy reference and against the Triton kernel it replaces (interpreted), on fresh random
inputs with ragged lengths, short rows and ties; their refusals; and that each lowers to a
Mosaic GPU call for an abstract H200 at Wan 480p shapes."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic import delta as md, kmeans as mk, pool as mp, topk as mt
from pallas_kernels.triton import delta as td, kmeans as tk, pool as tp, topk as tt
from tessera_jax.masks import dynamic as dm
from tessera_jax.masks.dynamic import clustering

DTYPES = [jnp.bfloat16, jnp.float16]


def _rng(data):
    return np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))


# --- row dots ----------------------------------------------------------------------------------
@settings(max_examples=5, deadline=None)
@given(st.data())
def test_row_dots_equal_the_rowsum_and_the_triton_kernel(data):
    """rowsum(out * dout) in float32 for lengths that are not a multiple of the 64-row tile (the
    last tile overlaps), D 64 / 128, both 2-byte dtypes, B > 1."""
    rng = _rng(data)
    B, H = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    L = data.draw(st.sampled_from([64, 72, 136, 200]))
    D = data.draw(st.sampled_from([64, 128]))
    dtype = data.draw(st.sampled_from(DTYPES))
    o, g = (jnp.asarray(rng.standard_normal((B, L, H, D)), dtype) for _ in range(2))
    got = np.asarray(md.row_dots(o, g, interpret=True))
    want = np.einsum("bqhd,bqhd->bhq", np.asarray(o, np.float64), np.asarray(g, np.float64))
    assert got.dtype == np.float32 and got.shape == (B, H, L)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got, np.asarray(td.row_dots(o, g, interpret=True)), rtol=1e-5,
                               atol=1e-4)


def test_row_dots_refusals_and_the_backend_fallback():
    """Shapes the kernel does not take are refused naming the rule; the Mosaic backend's
    ``row_dots`` hands them to jnp (same values)."""
    from pallas_kernels.mosaic import ops
    x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="one \\[B, L, H, D\\] shape"):
        md.row_dots(x, x[:, :8])
    with pytest.raises(TypeError, match="share a dtype"):
        md.row_dots(x, x.astype(jnp.float16))
    for shape, dtype in (((1, 70, 2, 64), jnp.bfloat16), ((1, 56, 2, 64), jnp.bfloat16),
                         ((1, 64, 2, 32), jnp.bfloat16), ((1, 64, 2, 64), jnp.float32)):
        assert not md.supports(shape, dtype)
        y = jnp.ones(shape, dtype)
        with pytest.raises(ValueError, match="supports"):
            md.row_dots(y, y)
        np.testing.assert_array_equal(np.asarray(ops.row_dots(y, y, interpret=True)),
                                      np.full((1, 2, shape[1]), shape[3], np.float32))


# --- block sums --------------------------------------------------------------------------------
@settings(max_examples=5, deadline=None)
@given(st.data())
def test_block_sums_equal_the_sum_and_the_triton_kernel(data):
    """Each block's float32 sum for random partitions (1-token blocks, odd sizes, blocks up to
    MAX_BLOCK), B > 1, H * F of one or more 256-column chunks or of 128-column ones."""
    rng = _rng(data)
    sizes = data.draw(st.lists(st.sampled_from([1, 3, 8, 64, 77, mp.MAX_BLOCK]), min_size=1,
                               max_size=5))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    H, F = data.draw(st.sampled_from([(2, 128), (1, 256), (4, 128), (1, 128), (3, 128)]))
    dtype = data.draw(st.sampled_from(DTYPES))
    B = data.draw(st.integers(1, 2))
    x = jnp.asarray(rng.standard_normal((B, int(bounds[-1]), H, F)), dtype)
    got = np.asarray(mp.block_sums(x, bounds, interpret=True))
    want = np.stack([np.asarray(x[:, a:b], np.float64).sum(axis=1)
                     for a, b in zip(bounds[:-1], bounds[1:])], axis=1)
    assert got.dtype == np.float32 and got.shape == (B, len(sizes), H, F)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-4)
    np.testing.assert_allclose(got, np.asarray(tp.block_sums(x, bounds, interpret=True)),
                               rtol=1e-5, atol=2e-4)


def test_block_sums_on_a_cube_layout_and_refusals():
    """VSA's cube layout (partial edge cubes: 8 block sizes) summed exactly as the rows; what
    the kernel does not take is refused naming the rule (``supports``)."""
    _, b = dm.cube_layout((3, 6, 7))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, int(b[-1]), 2, 128)),
                    jnp.bfloat16)
    want = np.stack([np.asarray(x[:, i:j], np.float64).sum(axis=1)
                     for i, j in zip(b[:-1], b[1:])], axis=1)
    np.testing.assert_allclose(np.asarray(mp.block_sums(x, b, interpret=True)), want,
                               rtol=1e-5, atol=2e-4)
    y = jnp.zeros((1, 10, 2, 128), jnp.bfloat16)
    for bad in ([0, 5, 9], [0, 5, 5, 10], [1, 10]):
        with pytest.raises(ValueError, match="bounds must increase"):
            mp.block_sums(y, np.array(bad))
    for shape, dtype, bounds in (((1, 10, 1, 64), jnp.bfloat16, [0, 10]),         # H * F
                                 ((1, 10, 2, 128), jnp.float32, [0, 10]),         # dtype
                                 ((1, 300, 2, 128), jnp.bfloat16, [0, 300]),      # > MAX
                                 ((1, 153, 2, 128), jnp.bfloat16, np.cumsum([0] + list(
                                     range(1, 18))))):                            # 17 sizes
        assert not mp.supports(shape, dtype, bounds)
        with pytest.raises(ValueError, match="Mosaic kernel takes"):
            mp.block_sums(jnp.zeros(shape, dtype), np.asarray(bounds))


# --- top k -------------------------------------------------------------------------------------
def _top_k_set(x, k):
    """bool mask of the indices ``lax.top_k`` returns."""
    _, idx = jax.lax.top_k(jnp.asarray(x), k)
    m = np.zeros(np.shape(x), bool)
    np.put_along_axis(m, np.asarray(idx), True, axis=-1)
    return m


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_top_k_keeps_the_set_of_lax_top_k_and_the_triton_kernel(data):
    """Exactly ``lax.top_k``'s indices (ties to the lower index, -0.0 below +0.0, infinities),
    k a row, for row lengths below and above the 128-lane width, a total smaller than one
    window (the padded path) and leading batch axes."""
    rng = _rng(data)
    n = data.draw(st.sampled_from([1, 5, 37, 130, 300]))
    lead = data.draw(st.sampled_from([(1,), (3,), (2, 2)]))
    k = data.draw(st.sampled_from(sorted({c for c in (1, 2, n // 3 + 1, n - 1, n)
                                          if 1 <= c <= n})))
    kind = data.draw(st.sampled_from(["ints", "normal", "zeros", "tiny"]))
    shape = (*lead, n)
    if kind == "ints":                                    # heavy ties
        x = rng.integers(-2, 3, shape).astype(np.float32)
    elif kind == "normal":
        x = rng.standard_normal(shape).astype(np.float32)
    elif kind == "zeros":                                 # +0.0 and -0.0 only: all ties
        x = np.where(rng.random(shape) < 0.5, -0.0, 0.0).astype(np.float32)
    else:                                                 # subnormals and huge values
        x = rng.choice(np.array([1e-45, -1e-45, 3e38, -3e38, 1.0, -1.0], np.float32), shape)
    hit = rng.random(shape) < 0.2
    x = np.where(hit, rng.choice(np.array([np.inf, -np.inf, -0.0, 0.0], np.float32), shape),
                 x).astype(np.float32)
    got = np.asarray(mt.topk_mask(jnp.asarray(x), k, interpret=True))
    assert got.dtype == np.bool_ and got.shape == shape
    np.testing.assert_array_equal(got, _top_k_set(x, k))
    np.testing.assert_array_equal(got, np.asarray(tt.topk_mask(jnp.asarray(x), k,
                                                               interpret=True)))


def test_top_k_long_rows_all_ties_and_refusals():
    """A MAX_COLS row (32 values a thread) and all-equal rows: the first k; refusals name the
    argument."""
    x = np.zeros((2, mt.MAX_COLS), np.float32)
    x[1, ::3] = 1.0
    for k in (1, 1500, mt.MAX_COLS):
        np.testing.assert_array_equal(np.asarray(mt.topk_mask(jnp.asarray(x), k,
                                                              interpret=True)), _top_k_set(x, k))
    with pytest.raises(ValueError, match="k must be in"):
        mt.topk_mask(jnp.zeros((2, 5)), 6)
    with pytest.raises(TypeError, match="k must be an int"):
        mt.topk_mask(jnp.zeros((2, 5)), 2.0)
    with pytest.raises(ValueError, match="float32"):
        mt.topk_mask(jnp.zeros((2, 5), jnp.bfloat16), 2)
    with pytest.raises(ValueError, match="rows of 1.."):
        mt.topk_mask(jnp.zeros((2, mt.MAX_COLS + 1)), 2)


# --- k-means assignment ------------------------------------------------------------------------
@settings(max_examples=4, deadline=None)
@given(st.data())
def test_assign_equals_xla_and_the_triton_kernel_with_exact_ties(data):
    """Small-integer points and centroids (every distance exact in float32, so ties are exact
    ties), a centroid repeated in a later tile: the labels of XLA's matmul + argmin (ties to
    the lower index) and of the Triton kernel, for ragged L (below one tile, not a multiple of
    8, across tiles) and C (one tile, several, padded)."""
    rng = _rng(data)
    H = data.draw(st.integers(1, 2))
    L = data.draw(st.sampled_from([40, 100, 200]))
    C = data.draw(st.sampled_from([3, 70, 150]))
    F = data.draw(st.sampled_from([64, 128]))
    dtype = data.draw(st.sampled_from(DTYPES))
    x = rng.integers(-3, 4, (H, L, F)).astype(np.float32)
    c = rng.integers(-3, 4, (H, C, F)).astype(np.float32)
    c[:, -1] = c[:, 1]                                    # a duplicate, in the last tile
    x[:, :5] = c[:, 1:2]                                  # points on it
    x, c = jnp.asarray(x, dtype), jnp.asarray(c)
    got = np.asarray(mk.assign(x, c, interpret=True))
    want = np.asarray(jax.vmap(clustering._assign)(x, c))
    assert got.dtype == np.int32 and got.shape == (H, L)
    np.testing.assert_array_equal(got, want)
    assert (got[:, :5] == 1).all()
    np.testing.assert_array_equal(got, np.asarray(tk.assign(x, c, interpret=True)))


def test_assign_on_normal_data_is_the_nearest_and_refusals():
    """Random normal bf16 points: each label's distance is the smallest up to float32 rounding
    (the interpreter's matmul rounds per column position, so only near ties may differ from
    XLA's); refusals name the rule."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 136, 64)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((2, 200, 64)), jnp.float32)
    got = np.asarray(mk.assign(x, c, interpret=True))
    xf, cf = np.asarray(x, np.float64), np.asarray(c.astype(jnp.bfloat16), np.float64)
    d = (cf ** 2).sum(-1)[:, None, :] - 2 * np.einsum("hlf,hcf->hlc", xf, cf)
    picked = np.take_along_axis(d, got[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(picked, d.min(-1), atol=1e-3)
    assert (got == np.asarray(jax.vmap(clustering._assign)(x, c))).mean() > 0.99
    with pytest.raises(ValueError, match="assign: x must be"):
        mk.assign(jnp.zeros((2, 5, 64), jnp.bfloat16), jnp.zeros((2, 3, 128)))
    for shape, dtype in (((1, 8, 64), jnp.float32), ((1, 8, 48), jnp.bfloat16),
                         ((1, 8, 320), jnp.bfloat16)):
        assert not mk.supports(shape, dtype)
        with pytest.raises(ValueError, match="Mosaic kernel takes"):
            mk.assign(jnp.zeros(shape, dtype), jnp.zeros((1, 3, shape[2])))


# --- the real lowering -------------------------------------------------------------------------
def test_each_kernel_lowers_to_mosaic_gpu_at_wan_480p():
    """No GPU here: lowered for CUDA on an abstract H200 at the Wan 480p shapes the callers use
    (12 heads, L = 32,760, D = 128, bf16; VSA's 624 cubes; SVG2's 300 / 1000 clusters), each is
    one Mosaic GPU call (the real path, not the interpreter) and no Triton call."""
    from cuda_lowering import lower_for_h200
    sds = jax.ShapeDtypeStruct
    _, cubes = dm.cube_layout((21, 30, 52))
    x = sds((1, 32760, 12, 128), jnp.bfloat16)
    cases = [
        (functools.partial(md._row_dots, interpret=False), (x, x)),
        (functools.partial(mp._block_sums, bounds=tuple(int(v) for v in cubes),
                           interpret=False), (x,)),
        (functools.partial(mt._topk_mask, k=78, interpret=False),
         (sds((12, 624, 624), jnp.float32),)),
        (functools.partial(mk._assign, interpret=False),
         (sds((12, 32760, 128), jnp.bfloat16), sds((12, 1000, 128), jnp.float32))),
    ]
    for f, args in cases:
        text = lower_for_h200(f, *args)
        assert text.count("@mosaic_gpu") == 1 and "__gpu$xla.gpu.triton" not in text
