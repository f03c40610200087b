"""Bounds mistakes are caught the same way for NumPy, concrete jax and traced bounds: a
ValueError naming the argument for the first two, the documented ``checkify`` check for the
third (whose output stays finite: bad device data never reads out of bounds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import tessera_jax as tj
from tessera_jax.runtime import device_route

L = 256
GOOD = np.array([0, 64, 128, 200, 256])
# (bounds, words the error must contain)
MISTAKES = {
    "not_increasing": (np.array([0, 128, 64, 200, 256]), "strictly increasing"),
    "equal_neighbours": (np.array([0, 64, 64, 200, 256]), "strictly increasing"),
    "wrong_start": (np.array([8, 64, 128, 200, 256]), "start at 0"),
    "short_end": (np.array([0, 64, 128, 200, 240]), "256"),
    "past_length": (np.array([0, 64, 128, 200, 300]), "256"),
}


def _qkv(key=0):
    ks = jax.random.split(jax.random.key(key), 3)
    return tuple(jax.random.normal(k, (1, L, 2, 16), jnp.float32) for k in ks)


def _blocks(n=4):
    return np.random.default_rng(0).random((1, n, n)) < 0.6


@pytest.mark.parametrize("name", sorted(MISTAKES))
@pytest.mark.parametrize("which", ["q_bounds", "kv_bounds"])
@pytest.mark.parametrize("kind", ["numpy", "concrete_jax"])
def test_bad_bounds_raise(name, which, kind):
    bad, words = MISTAKES[name]
    bad = bad if kind == "numpy" else jnp.asarray(bad, jnp.int32)
    qb, kb = (bad, GOOD) if which == "q_bounds" else (GOOD, bad)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=which) as err:
        tj.sparse_attention(q, k, v, tj.BlockMask(qb, kb, _blocks()), backend="xla")
    assert words in str(err.value)


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_concrete_per_head_bounds_raise(name):
    bad, _ = MISTAKES[name]
    qb = jnp.asarray(np.stack([GOOD, bad]), jnp.int32)
    with pytest.raises(ValueError, match=r"q_bounds\[1\]|q_bounds"):
        q, k, v = _qkv()
        tj.sparse_attention(q, k, v, tj.BlockMask(qb, GOOD, np.ones((2, 4, 4), bool)),
                            backend="xla")


def test_good_concrete_bounds_run():
    q, k, v = _qkv()
    m = tj.BlockMask(jnp.asarray(GOOD, jnp.int32), GOOD, _blocks())
    out = tj.sparse_attention(q, k, v, m, backend="xla")
    ref = tj.reference_attention(q, k, v, m.to_host())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_traced_bounds_checkify_and_stay_finite(name):
    bad, _ = MISTAKES[name]
    q, k, v = _qkv()

    def f(qb, q, k, v):
        m = tj.BlockMask(qb, GOOD, jnp.asarray(_blocks()))
        device_route.check(m, L, L)
        return tj.sparse_attention(q, k, v, m, backend="xla")

    err, _ = jax.jit(checkify.checkify(f))(jnp.asarray(GOOD, jnp.int32), q, k, v)
    err.throw()                                              # good bounds: no error
    err, out = jax.jit(checkify.checkify(f))(jnp.asarray(bad, jnp.int32), q, k, v)
    with pytest.raises(checkify.JaxRuntimeError, match="q_bounds"):
        err.throw()
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("name", ["not_increasing", "equal_neighbours", "wrong_start"])
@pytest.mark.parametrize("row", [0, 2])
def test_numpy_per_head_bounds_name_the_bad_row(name, row):
    """Per-head NumPy bounds are checked row by row at once: the error names the first bad
    head's row and says what is wrong; rows ending at other lengths are named too."""
    bad, words = MISTAKES[name]
    qb = np.stack([GOOD, GOOD, GOOD])
    qb[row] = bad
    with pytest.raises(ValueError, match=rf"q_bounds\[{row}\]") as err:
        tj.BlockMask(qb, GOOD, np.ones((3, 4, 4), bool))
    assert words in str(err.value)
    qb = np.stack([GOOD, GOOD, GOOD])
    qb[row, -1] = 240
    with pytest.raises(ValueError, match="same length"):
        tj.BlockMask(qb, GOOD, np.ones((3, 4, 4), bool))
    with pytest.raises(TypeError, match="q_bounds"):
        tj.BlockMask(np.stack([GOOD, GOOD]).astype(float), GOOD, np.ones((2, 4, 4), bool))
