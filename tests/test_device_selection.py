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
    # Mean key blocks between 64 and TRACED_SMALL_MEAN (96) tokens (SVG2's clusters: 66-76
    # keys) take 64-key tiles, with 64-row units where the mean query block is as small;
    # above it, 128 x 128.
    def bounds(n):                                       # n blocks of 512 / n tokens
        return jnp.asarray(np.linspace(0, 512, n + 1).round().astype(np.int32))
    for nq, nk, name in ((4, 6, "mgpu_q128_kv64_s2_hm"), (4, 7, "mgpu_q128_kv64_s2_hm"),
                         (6, 7, "mgpu_q64x2_kv64_s2_hm"), (5, 6, "mgpu_q128_kv64_s2_hm"),
                         (6, 5, "mgpu_q128_kv128_s2_hm"), (4, 5, "mgpu_q128_kv128_s2_hm")):
        traced = tj.BlockMask(bounds(nq), bounds(nk), ones(nq, nk))
        assert D.choose(traced, shape, "mosaic_gpu")[0].name == name, (nq, nk, name)
    # ``traced_small`` (Options.traced_small_blocks) overrides the mean either way.
    small, large = D.DeviceRule(traced_small_blocks=True), D.DeviceRule(traced_small_blocks=False)
    assert D.choose(traced, shape, "mosaic_gpu", rule=small)[0].name == "mgpu_q64x2_kv64_s2_hm"
    traced = tj.BlockMask(jnp.arange(0, 513, 4), jnp.arange(0, 513, 4), ones(128, 128))
    assert D.choose(traced, shape, "mosaic_gpu", rule=large)[0].name == "mgpu_q128_kv128_s2_hm"


def test_budget_is_an_argument_and_part_of_the_key():
    qb = np.r_[np.arange(0, 200, 4), 200]
    m = tj.BlockMask(qb, qb, jnp.ones((2, len(qb) - 1, len(qb) - 1), bool))
    shape = _shape(200, 200)
    t, cap = D.choose(m, shape, "xla")
    assert t is not None and cap > 0
    assert D.choose(m, shape, "xla", rule=D.DeviceRule(1)) == (None, 0)   # the exact path
    # Fewer slots than the pairs that may need one: the budget's room, decided on the device.
    t2, cap2 = D.choose(m, shape, "xla", rule=D.DeviceRule(1024))
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
        D.DeviceRule(bitmap_budget_bytes=-1)
    with pytest.raises(ValueError, match="device_gather"):
        D.DeviceRule(device_gather="always")
    with pytest.raises(TypeError, match="traced_small"):
        D.DeviceRule(traced_small_blocks=1)
    with pytest.raises(TypeError, match="DeviceRule"):
        D.choose(m, shape, "xla", rule=tj.Options())
    with pytest.raises(ValueError, match="route"):
        select.choose("gpu", m, shape, "xla")


def test_host_route_reads_the_ranking():
    m = tj.BlockMask.uniform(256, 256, 64, 64, np.tril(np.ones((4, 4), bool))[None])
    shape = _shape(256, 256)
    assert select.choose("host", m, shape, "xla") == select.ranking.select(m, shape, "xla")


def _brute_price(qb, kb, shape, t, density):
    """``price`` by enumerating every (row, q tile, kv tile) pair of the device plan."""
    from tessera_jax.planning import device as P
    rows_q = np.asarray(qb).reshape(-1, np.shape(qb)[-1])
    rows_k = np.asarray(kb).reshape(-1, np.shape(kb)[-1])
    H = max(len(rows_q), len(rows_k))
    _, _, _, fq, lq, _, _ = P._axis(rows_q, shape.q_len, t.tile_q, True)     # all rows at
    _, _, _, fk, lk, _, _ = P._axis(rows_k, shape.kv_len, t.tile_kv, True)   # once, as plans
    total = 0.0
    for h in range(H):
        for a in np.maximum(lq - fq + 1, 0)[h % len(fq)]:
            for b in np.maximum(lk - fk + 1, 0)[h % len(fk)]:
                total += 1 - (1 - density) ** (int(a) * int(b))
    return D.STEP_COST[t.name] * total * t.tile_q * t.tile_kv / (
        density * shape.q_len * shape.kv_len * H)


@st.composite
def _static_bounds(draw):
    L = draw(st.sampled_from([200, 512, 777]))

    def row():
        sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=40))
        b = np.unique(np.minimum(np.cumsum([0] + sizes), L))
        return b if b[-1] == L else np.r_[b, L]

    per_head = draw(st.booleans())
    if per_head:        # per-head rows of one block count each
        n = draw(st.integers(1, 12))
        rows = [np.r_[0, np.sort(draw(st.lists(st.integers(1, L - 1), min_size=n - 1,
                                                max_size=n - 1, unique=True))), L]
                for _ in range(2)]
        return np.stack(rows), row(), L
    return row(), row(), L


@settings(max_examples=25, deadline=None)
@given(_static_bounds(), st.sampled_from([0.1, 0.5, 0.9]))
def test_price_counts_every_tile_pair(bounds, density):
    """``price`` (counted by blocks a tile meets) equals the sum over every tile pair of the
    probability that one of its blocks is selected, times the step cost."""
    qb, kb, L = bounds
    shape = _shape(L, L)
    for name in D.DEVICE_TEMPLATES["mosaic_gpu"]:
        t = T.get(name)
        got = D.price(D.Const(qb), D.Const(kb), shape, t, density)
        assert got == pytest.approx(_brute_price(qb, kb, shape, t, density), rel=1e-9)
    assert D.price(D.Const(qb), D.Const(kb), shape, T.get("xla_64x64"), density) is None


def test_static_bounds_of_mixed_blocks_take_the_cheapest_price():
    """Blocks of 96, 96, 64 tokens (block-aligned tiles would be 1.5x the grid's, so the
    fixed grid): 128 x 128 tiles meet two, so the rule takes q64x2 x kv64; blocks of 72-384
    tokens (moba, ssta) keep 128 x 128; a regular grid of 128 keeps it at no waste."""
    rng = np.random.default_rng(0)
    L = 4096

    def mixed(sizes):
        b = np.cumsum(np.r_[0, rng.choice(sizes, 200)])
        return np.r_[b[b < L], L]

    shape = _shape(L, L)
    ones = lambda qb, kb: jnp.ones((1, len(qb) - 1, len(kb) - 1), bool)  # noqa: E731
    nat = np.cumsum(np.r_[0, [96, 96, 64] * (L // 256)])   # 128-key tiles meet two blocks
    moba = mixed([72, 96, 144, 192, 288, 384])
    grid = np.arange(0, L + 1, 128)
    assert np.median(np.diff(nat)) > 64           # not the small-block order
    never = D.DeviceRule(device_gather="never")
    for b, name in ((nat, "mgpu_q64x2_kv64_s2_hm"), (moba, "mgpu_q128_kv128_s2_hm"),
                    (grid, "mgpu_q128_kv128_s2_hm")):
        m = tj.BlockMask(b, b, ones(b, b))
        t, cap = D.choose(m, shape, "mosaic_gpu", rule=never)
        prices = {n: D.price(*D.static_parts(m)[:2], shape, T.get(n))
                  for n in D.DEVICE_TEMPLATES["mosaic_gpu"]}
        assert t.name == name == min(prices, key=prices.get) and cap == 0
    # The price is a property of the bounds alone: the selection (traced) does not enter.
    m = tj.BlockMask(nat, nat, jnp.zeros((1, len(nat) - 1, len(nat) - 1), bool))
    assert D.choose(m, shape, "mosaic_gpu", rule=never)[0].name == "mgpu_q64x2_kv64_s2_hm"


def test_candidate_templates_run_when_named_and_are_never_chosen():
    """A device candidate (``DEVICE_CANDIDATES``: the step-pairs kernel, not yet timed on a
    GPU) is device-capable and runs when a caller names it, with the plan of its tiles' bitmap
    capacity; the rule keeps the device list's q128 x kv64 for SpargeAttn's static bounds
    (128-row query blocks, 64-key blocks) and its own order for traced ones."""
    L = 4096
    shape = _shape(L, L)
    qb, kb = np.arange(0, L + 1, 128), np.arange(0, L + 1, 64)
    m = tj.BlockMask(qb, kb, jnp.ones((1, len(qb) - 1, len(kb) - 1), bool))
    for name in D.DEVICE_CANDIDATES["mosaic_gpu"]:
        t = T.get(name)
        assert name not in D.DEVICE_TEMPLATES["mosaic_gpu"] and D.device_capable(t)
        assert D.choose(m, shape, "mosaic_gpu", t) == (t, 0)
    assert D.choose(m, shape, "mosaic_gpu")[0].name == "mgpu_q128_kv64_s2_hm"
    traced = tj.BlockMask(jnp.asarray(qb), jnp.asarray(kb), m.blocks)
    assert D.choose(traced, shape, "mosaic_gpu")[0].name in D.DEVICE_TEMPLATES["mosaic_gpu"]
