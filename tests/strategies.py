"""Hypothesis strategies shared by the tests: random bounds, masks and attention shapes."""

import numpy as np
from hypothesis import strategies as st

import tessera_jax as tj


@st.composite
def bounds(draw, length=None, max_len=300, max_blocks=8):
    """Strictly increasing bounds from 0 to length, mixing 1-token and long blocks."""
    if length is None:
        length = draw(st.integers(1, max_len))
    n_cuts = draw(st.integers(0, min(max_blocks - 1, length - 1)))
    cuts = draw(st.lists(st.integers(1, length - 1), min_size=n_cuts, max_size=n_cuts,
                         unique=True)) if length > 1 else []
    return np.array([0] + sorted(cuts) + [length])


@st.composite
def masks(draw, Lq=None, Lkv=None, num_q_heads=1, max_len=300):
    qb = draw(bounds(Lq, max_len))
    kb = draw(bounds(Lkv, max_len))
    Hm = draw(st.sampled_from(sorted({1, num_q_heads})))
    density = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    blocks = rng.random((Hm, len(qb) - 1, len(kb) - 1)) < density
    if draw(st.booleans()) and blocks.shape[1] > 1:
        blocks[:, rng.integers(blocks.shape[1])] = False  # an empty query-block row
    return tj.BlockMask(qb, kb, blocks)


@st.composite
def attn_problem(draw, dtypes=("float32",), max_len=300):
    """(q, k, v, mask) with GQA/MQA, B >= 1, Lq != Lkv allowed."""
    Hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    Hq = Hkv * group
    B = draw(st.integers(1, 2))
    D = draw(st.sampled_from([8, 16, 32]))
    Lq = draw(st.integers(1, max_len))
    Lkv = draw(st.integers(1, max_len))
    dtype = draw(st.sampled_from(dtypes))
    mask = draw(masks(Lq, Lkv, Hq))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, Lq, Lkv, Hq, Hkv, D, dtype, mask, seed


def random_qkv(B, Lq, Lkv, Hq, Hkv, D, dtype, seed):
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, Lq, Hq, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Lkv, Hkv, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Lkv, Hkv, D)), dtype)
    return q, k, v


def heads_and_blocks(draw, n_q: int, n_kv: int, densities):
    """(Hq, Hkv, blocks [Hm, n_q, n_kv], rng) drawn inside an ``st.composite``: GQA or not, a
    shared (Hm = 1) or per-head mask, random blocks at one of ``densities``."""
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    Hm = draw(st.sampled_from(sorted({1, Hq})))
    density = draw(st.sampled_from(list(densities)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return Hq, Hkv, rng.random((Hm, n_q, n_kv)) < density, rng


def bounds_from_sizes(sizes, max_len: int):
    """Block bounds of consecutive ``sizes``, cut at ``max_len`` when they run past it (and at
    least two bounds stay)."""
    b = np.concatenate([[0], np.cumsum(sizes)])
    return b[b <= max_len] if b[-1] > max_len and (b <= max_len).sum() >= 2 else b
