"""The plan ABI's packed step rectangle: pack/unpack round trips (NumPy, jnp, Python ints),
the unpacked view, and tiles too large for a byte rejected where plans are built."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera_jax as tj
from pallas_kernels import abi
from tessera_jax.planning.planner import build_plan

_BYTE = st.integers(0, 255)


@given(_BYTE, _BYTE, _BYTE, _BYTE)
@settings(max_examples=300, deadline=None)
def test_pack_unpack_round_trip_scalars(a, b, c, d):
    x = abi.pack_rect(a, b, c, d)
    assert x.dtype == np.int32
    assert (int(x) < 0) == (d >= 128)                  # kv_hi >= 128 sets bit 31
    assert tuple(int(v) for v in abi.unpack_rect(x)) == (a, b, c, d)
    assert tuple(abi.unpack_rect(int(x))) == (a, b, c, d)   # a plain (negative) Python int
    assert int(x) == abi.pack_rect(a, b, c, d)


@pytest.mark.parametrize("field", range(4))
def test_pack_unpack_round_trip_every_byte_value(field):
    """Every value 0..255 of each field (the others random), NumPy and jnp alike."""
    rng = np.random.default_rng(field)
    f = [rng.integers(0, 256, 256) for _ in range(4)]
    f[field] = np.arange(256)
    x = abi.pack_rect(*f)
    assert x.dtype == np.int32 and (x < 0).any()
    for got, want in zip(abi.unpack_rect(x), f):
        np.testing.assert_array_equal(got, want)
    xj = abi.pack_rect(*(jnp.asarray(v, jnp.int32) for v in f))
    assert xj.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(xj), x)
    for got, want in zip(abi.unpack_rect(xj), f):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_unpack_steps_view_and_full_rect():
    rng = np.random.default_rng(1)
    view = np.stack([rng.integers(0, 10**6, 50)] + [rng.integers(0, 256, 50) for _ in range(4)],
                    axis=1).astype(np.int32)
    steps = np.stack([view[:, 0], abi.pack_rect(*view[:, 1:].T)], axis=1)
    assert steps.shape == (50, abi.STEP_COLS) and steps.dtype == np.int32
    np.testing.assert_array_equal(abi.unpack_steps(steps), view)
    np.testing.assert_array_equal(np.asarray(abi.unpack_steps(jnp.asarray(steps))), view)
    assert abi.unpack_steps(steps).shape == (50, abi.VIEW_COLS)
    assert abi.full_rect(128, 128) == int(abi.pack_rect(0, 128, 0, 128)) < 0
    assert abi.unpack_rect(abi.full_rect(64, 96)) == (0, 64, 0, 96)
    with pytest.raises(ValueError, match="steps"):
        abi.unpack_steps(np.zeros((3, 5), np.int32))


def test_tiles_above_255_are_rejected():
    m = tj.BlockMask.uniform(512, 512, 64, 64, np.ones((1, 8, 8), bool))
    for tq, tk in ((256, 64), (64, 256)):
        with pytest.raises(ValueError, match="255"):
            build_plan(m, (1, 512, 1, 16), (1, 512, 1, 16), jnp.float32, tile_q=tq, tile_kv=tk)
    p = build_plan(m, (1, 512, 1, 16), (1, 512, 1, 16), jnp.float32, tile_q=128, tile_kv=192)
    view = abi.unpack_steps(p.steps[: p.num_steps])          # tiles at 0, 192, 320 (shifted)
    assert (view[:, abi.VIEW_KV_HI] == 192).all() and (p.steps[: p.num_steps, 1] < 0).all()
    assert sorted(set(view[:, abi.VIEW_KV_LO])) == [0, 64]
    with pytest.raises(ValueError, match="255"):
        abi.check_tiles(64, 256)
