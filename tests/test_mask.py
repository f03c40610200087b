import pickle

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera_jax as tj
from strategies import bounds, masks


def test_uniform_partial_last_block():
    m = tj.BlockMask.uniform(100, 70, 32, 64, np.ones((1, 4, 2), bool))
    np.testing.assert_array_equal(m.q_bounds, [0, 32, 64, 96, 100])
    np.testing.assert_array_equal(m.kv_bounds, [0, 64, 70])
    assert m.selected_interactions() == 100 * 70
    assert m.density == 1.0


def test_immutable_and_hash_by_content():
    b = np.zeros((2, 3, 3), bool)
    b[0, 1, 2] = True
    m1 = tj.BlockMask([0, 1, 5, 9], [0, 3, 4, 9], b)
    b[0, 0, 0] = True  # the mask copied its input
    m2 = tj.BlockMask([0, 1, 5, 9], [0, 3, 4, 9], b)
    m3 = tj.BlockMask([0, 1, 5, 9], [0, 3, 4, 9], m1.blocks.copy())
    assert m1 == m3 and hash(m1) == hash(m3) and m1 != m2
    with pytest.raises(AttributeError):
        m1.blocks = b
    with pytest.raises(ValueError):
        m1.blocks[0, 0, 0] = True
    assert pickle.loads(pickle.dumps(m1)) == m1
    assert {m1: 1}[m3] == 1


def test_usable_as_static_argument_and_closure_constant():
    m = tj.BlockMask.uniform(8, 8, 4, 4, np.eye(2, dtype=bool))
    f = jax.jit(lambda x, mask: x * mask.density, static_argnums=1)
    assert float(f(2.0, m)) == pytest.approx(1.0)
    g = jax.jit(lambda x: x + m.selected_interactions())
    assert float(g(0.0)) == 32


@given(masks(num_q_heads=3))
def test_token_mask_roundtrip(m):
    tm = m.token_mask()
    assert tm.shape == (m.num_heads, m.Lq, m.Lkv)
    assert int(tm.sum()) == m.selected_per_head().sum()
    back = tj.BlockMask.from_token_mask(tm, m.q_bounds, m.kv_bounds)
    assert back == m


@given(masks(num_q_heads=3))
def test_packed_leaves_unpack_inside_a_program_to_the_blocks(m):
    """``packed_leaves`` (the tiered route's copy): the digest's packed bits, unpacked by
    ``unpack_blocks`` under jit, give the blocks back, for any block count (padding bits of
    the last byte included); bounds int32 on the device, or these very NumPy arrays."""
    from tessera_jax.mask import unpack_blocks
    for static in (False, True):
        qb, kb, packed = m.packed_leaves(static_bounds=static)
        assert isinstance(packed, jax.Array) and packed.dtype == np.uint8
        assert packed.size == -(-m.blocks.size // 8)
        got = jax.jit(unpack_blocks, static_argnums=1)(packed, m.blocks.shape)
        np.testing.assert_array_equal(np.asarray(got), m.blocks)
        if static:
            assert qb is m.q_bounds and kb is m.kv_bounds
            _, _, bits = m.packed_leaves(static_bounds=True, host_bits=True)
            assert isinstance(bits, np.ndarray) and not bits.flags.writeable
            np.testing.assert_array_equal(bits, np.asarray(packed))
        else:
            assert isinstance(qb, jax.Array) and qb.dtype == np.int32
            np.testing.assert_array_equal(np.asarray(kb), m.kv_bounds)
    with pytest.raises(ValueError, match="host_bits"):
        m.packed_leaves(host_bits=True)


def test_from_token_mask_rejects_mixed_block_unless_inexact():
    tm = np.zeros((6, 6), bool)
    tm[0, 0] = True
    with pytest.raises(ValueError, match="not constant on block"):
        tj.BlockMask.from_token_mask(tm, [0, 3, 6], [0, 3, 6])
    m = tj.BlockMask.from_token_mask(tm, [0, 3, 6], [0, 3, 6], exact=False)
    assert m.blocks[0, 0, 0] and m.blocks.sum() == 1


def test_stack_per_head():
    a = tj.BlockMask.uniform(8, 8, 4, 4, np.eye(2, dtype=bool))
    b = tj.BlockMask.uniform(8, 8, 4, 4, ~np.eye(2, dtype=bool))
    s = tj.BlockMask.stack([a, b, a])
    assert s.num_heads == 3
    np.testing.assert_array_equal(s.blocks[1], b.blocks[0])
    c = tj.BlockMask.uniform(8, 8, 2, 4, np.ones((4, 2), bool))
    with pytest.raises(ValueError, match="other bounds"):
        tj.BlockMask.stack([a, c])
    with pytest.raises(TypeError, match=r"masks\[1\]"):
        tj.BlockMask.stack([a, "x"])
    with pytest.raises(ValueError, match="at least one"):
        tj.BlockMask.stack([])


@pytest.mark.parametrize("qb, match", [
    ([0, 5, 5, 9], "strictly increasing"),
    ([0, 6, 5, 9], "strictly increasing"),
    ([1, 5, 9], "start at 0"),
    ([0], "at least 2"),
    ([[[0, 9]]], r"\[n \+ 1\] or per head \[Hm, n \+ 1\]"),
    ([[0, 4, 9], [0, 3, 8]], "same length"),
    ([[0, 4, 9], [0, 4, 4]], r"q_bounds\[1\] must be strictly increasing"),
])
def test_bad_bounds(qb, match):
    with pytest.raises(ValueError, match=match):
        tj.BlockMask(qb, [0, 9], np.ones((1, max(len(np.ravel(qb)) - 1, 1), 1), bool))


def test_bad_bounds_types():
    with pytest.raises(TypeError, match="q_bounds must hold integers"):
        tj.BlockMask([0.0, 4.0], [0, 4], np.ones((1, 1, 1), bool))
    with pytest.raises(TypeError, match="kv_bounds"):
        tj.BlockMask([0, 4], [False, True], np.ones((1, 1, 1), bool))


def test_bad_blocks():
    with pytest.raises(TypeError, match="blocks must have dtype bool"):
        tj.BlockMask([0, 4], [0, 4], np.ones((1, 1, 1), np.int32))
    with pytest.raises(ValueError, match=r"expected \[Hm, 2, 1\]"):
        tj.BlockMask([0, 2, 4], [0, 4], np.ones((1, 1, 1), bool))
    with pytest.raises(ValueError, match="blocks must be"):
        tj.BlockMask([0, 4], [0, 4], np.ones((1, 1, 1, 1), bool))


def test_uniform_bad_args():
    with pytest.raises(ValueError, match="block size of q"):
        tj.BlockMask.uniform(8, 8, 0, 4, np.ones((1, 2, 2), bool))
    with pytest.raises(TypeError, match="length of kv"):
        tj.BlockMask.uniform(8, 8.0, 4, 4, np.ones((1, 2, 2), bool))


@given(bounds())
def test_bounds_strategy_valid(b):
    m = tj.BlockMask(b, b, np.ones((1, len(b) - 1, len(b) - 1), bool))
    assert m.Lq == b[-1]


@given(masks(num_q_heads=3))
def test_count_selected_counts_the_blocks(m):
    """``count_selected`` (the tiered rule's count, on the packed bits as 64-bit words and a
    byte tail) equals the bools' count for any block count; a device mask has none."""
    assert m.count_selected() == int(np.count_nonzero(m.blocks))
    with pytest.raises(TypeError, match="count_selected"):
        tj.BlockMask(*(jax.numpy.asarray(x) for x in (m.q_bounds, m.kv_bounds, m.blocks)))\
            .count_selected()


@given(masks(num_q_heads=3), st.integers(-1, 400))
def test_a_count_that_may_stop_answers_as_the_whole_count(m, k):
    """``count_selected(stop_above=k)`` is the count when it is <= k, and above k exactly
    when the count is; the chunked loop under it (``mask._count_bits``) stops early on any
    chunk size without changing that."""
    from tessera_jax.mask import _count_bits
    full = int(np.count_nonzero(m.blocks))
    got = m.count_selected(stop_above=k)
    assert (got > k) == (full > k) and (got == full or got > k)
    words = np.random.default_rng(k + 2).integers(0, 2 ** 63, 37, dtype=np.uint64)
    bits = int(np.bitwise_count(words).sum())
    for chunk in (1, 2, 5, 64):
        part = _count_bits(words, 3, k * 8, chunk)
        assert (part > k * 8) == (bits + 3 > k * 8) and (part == bits + 3 or part > k * 8)
    assert _count_bits(words, 3, None) == bits + 3
    ones = np.ones(50, np.uint64)                      # one bit a word: the count steps by 1
    assert _count_bits(ones, 0, k, 1) == min(50, max(k, -1) + 1)


def test_static_blocks_stay_packed_until_read():
    """A static mask keeps its blocks as packed bits (no copy of the bools; the caller's array
    may change afterwards) and unpacks them, read-only, when first read."""
    rng = np.random.default_rng(3)
    qb, kb = np.array([0, 5, 9, 30]), np.array([0, 7, 8, 40, 41])
    b = rng.random((2, 3, 4)) < 0.5
    want = b.copy()
    m = tj.BlockMask(qb, kb, b)
    b[:] = ~b                                        # the caller's array changes
    assert m._blocks is None and m.shape == want.shape and m.num_heads == 2
    assert m.count_selected() == int(want.sum())
    np.testing.assert_array_equal(m.blocks, want)
    assert not m.blocks.flags.writeable and m.blocks is m.blocks
    assert m == tj.BlockMask(qb, kb, want) and pickle.loads(pickle.dumps(m)) == m


def _sha_digest(qb, kb, blocks) -> str:
    """The digest's definition: SHA-256 of bounds (1-D: their size, per-head: their shape),
    the blocks' [Hm, nq, nkv] shape and their packed bits; 32 hex digits."""
    import hashlib
    h = hashlib.sha256()
    for part in (qb, kb):
        part = np.asarray(part, np.int64)
        h.update(np.asarray(part.shape if part.ndim == 2 else part.size, np.int64).tobytes())
        h.update(part.tobytes())
    b = blocks if blocks.ndim == 3 else blocks[None]
    h.update(np.asarray(b.shape, np.int64).tobytes())
    h.update(np.packbits(b.reshape(-1)).tobytes())
    return h.hexdigest()[:32]


@given(masks(num_q_heads=2), st.data())
def test_equality_is_content_and_the_digest_is_made_when_read(m, data):
    """Hash and equality read the packed bits (no SHA-256 on the request path): masks of the
    same bounds and blocks are equal with equal hashes; one flipped block, other bounds, or
    the blocks' words permuted (equal XOR and sum: the same fold) make them unequal. The
    digest, made when first read, is the SHA-256 of the content, and equal exactly when the
    masks are."""
    qb, kb, b = np.asarray(m.q_bounds), np.asarray(m.kv_bounds), np.asarray(m.blocks)
    same = tj.BlockMask(qb.copy(), kb.copy(), b.copy())
    assert same == m and hash(same) == hash(m) and {m: 1}[same] == 1
    assert m._digest is None and same._digest is None        # neither hashed with SHA-256
    i = data.draw(st.integers(0, b.size - 1), label="flipped block")
    f = b.copy().reshape(-1)
    f[i] = ~f[i]
    flipped = tj.BlockMask(qb, kb, f.reshape(b.shape))
    assert flipped != m and m != flipped
    assert flipped.digest != m.digest
    assert m.digest == same.digest == _sha_digest(qb, kb, b)
    if b.size >= 128:                       # two 64-bit words: swap them
        bits = np.packbits(b.reshape(-1))
        w = bits[:16].copy()
        bits[:8], bits[8:16] = w[8:], w[:8]
        swapped = np.unpackbits(bits, count=b.size).astype(bool).reshape(b.shape)
        s = tj.BlockMask(qb, kb, swapped)
        assert (s == m) == np.array_equal(swapped, b) == (s.digest == m.digest)


def test_equality_across_bounds_and_kinds():
    """Same blocks under other bounds, or per-head bounds of the same rows, are other masks;
    a device mask equals only itself and is unhashable."""
    b = np.ones((2, 2, 2), bool)
    m = tj.BlockMask([0, 4, 8], [0, 4, 8], b)
    assert m != tj.BlockMask([0, 3, 8], [0, 4, 8], b)
    assert m != tj.BlockMask([[0, 4, 8]] * 2, [0, 4, 8], b)
    assert m != tj.BlockMask([0, 4, 8], [0, 4, 8], b[:1]) and m != "mask"
    d = m.to_device()
    assert d == d and d != m and m != d
    with pytest.raises(TypeError, match="not hashable"):
        hash(d)


def test_a_hash_collision_is_told_apart_by_the_bits():
    """Two masks whose packed words are a permutation of each other's share the fold (XOR
    and sum of words) so their hashes; equality still tells them apart, and a dict keeps
    both."""
    rng = np.random.default_rng(0)
    b = rng.random((1, 16, 16)) < 0.5                  # 256 bits: four 64-bit words
    bits = np.packbits(b.reshape(-1))
    swapped = np.concatenate([bits[8:16], bits[:8], bits[16:]])
    c = np.unpackbits(swapped).astype(bool).reshape(b.shape)
    assert not np.array_equal(b, c)
    m1, m2 = (tj.BlockMask(np.arange(0, 17), np.arange(0, 17), x) for x in (b, c))
    assert hash(m1) == hash(m2) and m1 != m2
    assert {m1: 1, m2: 2}[tj.BlockMask(np.arange(0, 17), np.arange(0, 17), c)] == 2


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3).flatmap(lambda R: st.integers(1, 6).flatmap(lambda n: st.lists(
           st.tuples(st.sampled_from([0, 0, 0, 1, -1]),
                     st.lists(st.integers(-1, 5), min_size=n - 1, max_size=n - 1)),
           min_size=R, max_size=R))),
       st.sampled_from([0, 0, 2 ** 31 - 100, 2 ** 33]), st.sampled_from([None, "last", 7]))
def test_bounds_checks_accept_exactly_the_valid_rows(rows, shift, length):
    """``_checked_rows`` (the request path's whole-array test, then the row-by-row search for
    the message) accepts a bounds array exactly when every row starts at 0, increases
    strictly, has >= 2 entries, ends within int32 and at ``length`` when given."""
    from tessera_jax.mask import _checked_rows
    arr = np.array([np.r_[start, start + np.cumsum(steps)] for start, steps in rows], np.int64)
    if shift:
        arr[:, 1:] += shift
    if length == "last":
        length = int(arr[0, -1])
    valid = (arr.shape[1] >= 2 and (arr[:, 0] == 0).all() and (np.diff(arr, axis=1) > 0).all()
             and arr[:, -1].max() <= 2 ** 31 - 1
             and (length is None or (arr[:, -1] == length).all()))
    if valid:
        out = _checked_rows("q_bounds", arr, length)
        assert out.dtype == np.int64 and not out.flags.writeable
        np.testing.assert_array_equal(out, arr)
    else:
        with pytest.raises(ValueError, match="q_bounds"):
            _checked_rows("q_bounds", arr, length)
