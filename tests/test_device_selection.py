"""select.device: the device route's template choice (static features, a static rule), and
select.choose, the one entry point of both routes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera_jax as tj
from pallas_kernels import templates as T
from tessera_jax import select
from tessera_jax.select import device as D
from tessera_jax.validation import check_shapes

BACKENDS = ("mosaic_gpu", "triton", "xla")


def _shape(Lq, Lkv, H=2, D_=64, dtype=jnp.bfloat16):
    return check_shapes((1, Lq, H, D_), (1, Lkv, H, D_), dtype)


@st.composite
def _device_masks(draw):
    """Masks of the device route: static bounds (shared or per head) or traced ones, block
    sizes from 1 token to whole tiles, traced blocks."""
    L = draw(st.sampled_from([64, 200, 512, 1000]))

    def bounds():
        size = draw(st.sampled_from([1, 3, 4, 24, 64, 100, 128, 200]))
        jitter = draw(st.booleans())
        b, x = [0], 0
        while x < L:
            step = size + (draw(st.integers(0, size)) if jitter else 0)
            x = min(L, x + max(step, 1))
            b.append(x)
        return np.array(b)

    qb, kb = bounds(), bounds()
    H = draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["static", "traced_q", "traced_kv", "traced", "per_head"]))
    blocks = jnp.ones((H, len(qb) - 1, len(kb) - 1), bool)
    if kind == "per_head":
        qb2 = np.stack([qb] * H)
        kb2 = np.stack([kb] * H)
        return tj.BlockMask(qb2, kb2, np.ones((H, len(qb) - 1, len(kb) - 1), bool)), L
    q = jnp.asarray(qb) if kind in ("traced_q", "traced") else qb
    k = jnp.asarray(kb) if kind in ("traced_kv", "traced") else kb
    return tj.BlockMask(q, k, blocks), L


def test_known_choices():
    """The rule's documented preferences (as tests/test_device_route.py pins them)."""
    shape = _shape(512, 512)
    ones = lambda nq, nk: jnp.ones((1, nq, nk), bool)  # noqa: E731
    cases = {
        "mgpu_q128_kv128_s2_hm": tj.BlockMask(np.arange(0, 513, 128), np.arange(0, 513, 128),
                                              ones(4, 4)),
        "mgpu_q128_kv64_s2_hm": tj.BlockMask(np.arange(0, 513, 128), np.arange(0, 513, 64),
                                             ones(4, 8)),
        "mgpu_q64x2_kv64_s2_hm": tj.BlockMask(np.arange(0, 513, 4), np.arange(0, 513, 4),
                                              ones(128, 128)),
    }
    for name, m in cases.items():
        t, cap = D.choose(m, shape, "mosaic_gpu")
        assert t.name == name
        assert (cap > 0) == (name == "mgpu_q64x2_kv64_s2_hm")      # 4-token blocks: bitmaps
    # Traced bounds: the mean key block (length / count) decides the order.
    traced = tj.BlockMask(jnp.arange(0, 513, 4), jnp.arange(0, 513, 4), ones(128, 128))
    assert D.choose(traced, shape, "mosaic_gpu")[0].name == "mgpu_q64x2_kv64_s2_hm"
    traced = tj.BlockMask(jnp.arange(0, 513, 128), jnp.arange(0, 513, 128), ones(4, 4))
    assert D.choose(traced, shape, "mosaic_gpu")[0].name == "mgpu_q128_kv128_s2_hm"
    # Large query blocks, small key blocks (clusters-like): 64-row units and 64-key tiles
    # (the smallest bitmap steps); small query blocks, large key blocks: 128 x 128.
    traced = tj.BlockMask(jnp.arange(0, 513, 128), jnp.arange(0, 513, 8), ones(4, 64))
    assert D.choose(traced, shape, "mosaic_gpu")[0].name == "mgpu_q64x2_kv64_s2_hm"
    traced = tj.BlockMask(jnp.arange(0, 513, 8), jnp.arange(0, 513, 128), ones(64, 4))
    assert D.choose(traced, shape, "mosaic_gpu")[0].name == "mgpu_q128_kv128_s2_hm"


def test_budget_is_an_argument_and_part_of_the_key():
    qb = np.r_[np.arange(0, 200, 4), 200]
    m = tj.BlockMask(qb, qb, jnp.ones((2, len(qb) - 1, len(qb) - 1), bool))
    shape = _shape(200, 200)
    t, cap = D.choose(m, shape, "xla")
    assert t is not None and cap > 0
    assert D.choose(m, shape, "xla", bitmap_budget_bytes=1) == (None, 0)   # the exact path
    # Fewer slots than the pairs that may need one: the budget's room, decided on the device.
    t2, cap2 = D.choose(m, shape, "xla", bitmap_budget_bytes=1024)
    assert cap2 == 1024 // D.bitmap_step_bytes(t2) < D.bitmap_pairs(
        *D.static_parts(m)[:2], m.shape, shape, t2)
    assert D.decided_on_device(*D.static_parts(m)[:2], m.shape, shape, t2, cap2)
    assert not D.decided_on_device(*D.static_parts(m)[:2], m.shape, shape, t, cap)
    assert D.choose(m, shape, "xla") == (t, cap)                   # and back: not remembered


def test_caller_template_and_bad_input():
    m = tj.BlockMask(np.arange(0, 257, 64), np.arange(0, 257, 64), jnp.ones((1, 4, 4), bool))
    shape = _shape(256, 256)
    t = T.get("xla_128x128")
    assert D.choose(m, shape, "xla", t) == (t, 0)
    with pytest.raises(ValueError, match="pairs query units"):
        D.choose(m, shape, "mosaic_gpu", T.get("mgpu_q64x2pp_kv64_s2_hm"))
    with pytest.raises(ValueError, match="bitmap_budget_bytes"):
        D.choose(m, shape, "xla", bitmap_budget_bytes=-1)
    with pytest.raises(ValueError, match="route"):
        select.choose("gpu", m, shape, "xla")


def test_host_route_reads_the_ranking():
    m = tj.BlockMask.uniform(256, 256, 64, 64, np.tril(np.ones((4, 4), bool))[None])
    shape = _shape(256, 256)
    assert select.choose("host", m, shape, "xla") == select.ranking.select(m, shape, "xla")
