"""Device masks through ``tj.sparse_attention`` (``runtime.device_route``): masks of jax arrays
and per-head bounds, planned inside the compiled program, exact against the reference."""

import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.extend
import jax.numpy as jnp
from jax.experimental import checkify

import tessera_jax as tj
from tessera_jax.planning import device as planner
from tessera_jax.runtime import core, device_route
from tessera_jax.validation import check_qkv, check_shapes

from strategies import random_qkv

TOL = dict(atol=2e-5, rtol=2e-5)


def _attend(q, k, v, m):
    return tj.sparse_attention(q, k, v, m, return_lse=True)


_jit_attend = jax.jit(_attend)
# Calls a function (a vjp returned by a jitted function) in one compiled program: run
# eagerly, its backward dispatched op by op (seconds of small compiles).
_call = jax.jit(lambda f, *a: f(*a))


@st.composite
def _sizes(draw, length):
    """Block sizes summing to ``length``: large blocks (the kernel path), or small ones (a
    tile meets > 4 blocks: the exact path), or a mix."""
    kind = draw(st.sampled_from(["large", "small", "mixed"]))
    lo, hi = {"large": (22, 120), "small": (1, 9), "mixed": (1, 120)}[kind]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = []
    while sum(sizes) < length:
        sizes.append(int(rng.integers(lo, hi + 1)))
    sizes[-1] -= sum(sizes) - length
    if len(sizes) > 1 and sizes[-1] < lo:
        last = sizes.pop()
        sizes[-1] += last
    return np.array(sizes)


@st.composite
def device_cases(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    Hm = draw(st.sampled_from(sorted({1, Hq})))
    Lq, Lkv = draw(st.integers(24, 260)), draw(st.integers(24, 260))
    per_head = Hm > 1 and draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    qs = draw(_sizes(Lq))
    ks = draw(_sizes(Lkv))

    def bounds(sizes):
        if not per_head:
            return np.r_[0, np.cumsum(sizes)]
        return np.stack([np.r_[0, np.cumsum(rng.permutation(sizes))] for _ in range(Hm)])

    qb, kb = bounds(qs), bounds(ks)
    blocks = rng.random((Hm, len(qs), len(ks))) < draw(st.sampled_from([0.1, 0.5, 1.0]))
    if draw(st.booleans()):
        blocks[:, rng.integers(len(qs))] = False               # query rows with no key
    return dict(qb=qb, kb=kb, blocks=blocks, Hq=Hq, Hkv=Hkv, B=draw(st.integers(1, 2)),
                traced=draw(st.sampled_from(["all", "blocks", "q_bounds"])),
                seed=draw(st.integers(0, 2**31 - 1)))


# 5 examples, random each run: each new shape or static bound set compiles the whole device
# route (~1.5 s alone, 3-5 s on a loaded 2-core runner).
@settings(max_examples=5)
@given(device_cases())
def test_device_masks_under_jit_are_exact(case):
    """Any block sizes (1-token ones included), shared or per-head bounds, GQA, empty rows,
    traced blocks and traced or static bounds: out and lse equal the reference's."""
    qb, kb, blocks = case["qb"], case["kb"], case["blocks"]
    host = tj.BlockMask(qb, kb, blocks)
    Lq, Lkv = host.Lq, host.Lkv
    q, k, v = random_qkv(case["B"], Lq, Lkv, case["Hq"], case["Hkv"], 16, "float32",
                         case["seed"])
    parts = {"all": (jnp.asarray(qb), jnp.asarray(kb), jnp.asarray(blocks)),
             "blocks": (qb, kb, jnp.asarray(blocks)),
             "q_bounds": (jnp.asarray(qb), kb, blocks)}[case["traced"]]
    dev = tj.BlockMask(*parts)
    assert not dev.is_static
    out, lse = _jit_attend(q, k, v, dev)
    ref, ref_lse = tj.reference_attention(q, k, v, host, return_lse=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **TOL)
    assert np.isfinite(np.asarray(out)).all()


def test_static_mask_with_per_head_bounds_runs_eagerly_and_exactly():
    rng = np.random.default_rng(3)
    qb = np.stack([[0, 40, 100, 130], [0, 60, 70, 130]])       # 70-60: a 10-token block
    kb = np.stack([[0, 50, 120], [0, 30, 120]])
    m = tj.BlockMask(qb, kb, rng.random((2, 3, 2)) < 0.6)
    assert m.is_static and m.per_head_bounds
    q, k, v = random_qkv(1, 130, 120, 2, 1, 16, "float32", 4)
    out, lse = tj.sparse_attention(q, k, v, m, return_lse=True)
    ref, ref_lse = tj.reference_attention(q, k, v, m, return_lse=True)
    np.testing.assert_allclose(out, ref, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


# --- a mask computed from q and k inside jit ---------------------------------------------
POOL, KEEP = 16, 3


def _topk_blocks(q, k):
    """VSA-like: mean-pool q and k over 16-token blocks, keep each query block's top-3 key
    blocks per head (GQA: the key head of each query head's group)."""
    B, L, Hq, D = q.shape
    Hkv = k.shape[2]
    pq = q[0].reshape(L // POOL, POOL, Hq, D).mean(1)
    pk = jnp.repeat(k[0].reshape(L // POOL, POOL, Hkv, D).mean(1), Hq // Hkv, axis=1)
    s = jnp.einsum("ihd,jhd->hij", pq, pk)
    _, idx = jax.lax.top_k(s, KEEP)
    return jnp.zeros(s.shape, bool).at[jnp.arange(Hq)[:, None, None],
                                       jnp.arange(L // POOL)[None, :, None], idx].set(True)


def test_mask_from_q_and_k_inside_jit_is_exact_traces_once_and_has_no_callback():
    L, Hq, Hkv = 192, 4, 2
    bounds = np.arange(0, L + 1, POOL)
    traces = []

    @jax.jit
    def layer(q, k, v):
        traces.append(1)
        mask = tj.BlockMask(bounds, bounds, _topk_blocks(q, k))
        return tj.sparse_attention(q, k, v, mask)

    for seed in range(3):
        q, k, v = random_qkv(1, L, L, Hq, Hkv, 16, "float32", seed)
        want_blocks = np.asarray(jax.jit(_topk_blocks)(q, k))
        ref = tj.reference_attention(q, k, v, tj.BlockMask(bounds, bounds, want_blocks))
        np.testing.assert_allclose(layer(q, k, v), ref, **TOL)
    assert len(traces) == 1
    text = layer.lower(q, k, v).as_text()
    assert "callback" not in text.lower()
    assert "custom_call" not in text or "cpu_callback" not in text


def test_new_device_masks_do_not_retrace_and_pytree_round_trips():
    rng = np.random.default_rng(0)
    qb = kb = np.array([0, 40, 90, 128])
    q, k, v = random_qkv(1, 128, 128, 2, 2, 16, "float32", 1)
    traces = []

    @jax.jit
    def f(q, k, v, m):
        traces.append(1)
        return tj.sparse_attention(q, k, v, m)

    for _ in range(3):
        blocks = rng.random((2, 3, 3)) < 0.5
        m = tj.BlockMask(jnp.asarray(qb), jnp.asarray(kb), jnp.asarray(blocks))
        np.testing.assert_allclose(f(q, k, v, m), tj.reference_attention(
            q, k, v, tj.BlockMask(qb, kb, blocks)), **TOL)
    assert len(traces) == 1
    leaves, tree = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 3
    back = jax.tree_util.tree_unflatten(tree, [object()] * 3)    # unflatten never validates
    assert isinstance(back, tj.BlockMask)

    # A static mask has no leaves: under jit it stays static (host planning, hashed).
    s = tj.BlockMask(qb, kb, blocks)
    assert jax.tree_util.tree_leaves(s) == []
    assert jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(s), []) is s


def test_device_mask_as_scan_carry():
    qb = kb = np.array([0, 32, 64])
    q, k, v = random_qkv(1, 64, 64, 1, 1, 8, "float32", 2)
    m0 = tj.BlockMask(jnp.asarray(qb), jnp.asarray(kb), jnp.eye(2, dtype=bool)[None])

    def body(m, _):
        out = tj.sparse_attention(q, k, v, m)
        return tj.BlockMask(m.q_bounds, m.kv_bounds, ~m.blocks), out

    _, outs = jax.lax.scan(body, m0, None, length=2)
    for i, blocks in enumerate((np.eye(2, dtype=bool), ~np.eye(2, dtype=bool))):
        ref = tj.reference_attention(q, k, v, tj.BlockMask(qb, kb, blocks[None]))
        np.testing.assert_allclose(outs[i], ref, **TOL)


def test_to_device_copies_bit_packed_blocks(monkeypatch):
    rng = np.random.default_rng(1)
    m = tj.BlockMask.uniform(300, 300, 10, 10, rng.random((3, 30, 30)) < 0.3)
    sent = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **kw: sent.append(
        sum(np.asarray(y).nbytes for y in jax.tree_util.tree_leaves(x))) or real_put(x, *a, **kw))
    d = m.to_device()
    assert sent == [-(-3 * 30 * 30 // 8) + 2 * 31 * 4]      # bits + two int32 bound arrays
    assert not d.is_static and d.to_host() == m


# --- bad device data ---------------------------------------------------------------------
def _bad_bounds_run(q, k, v, qb, kb, check):
    m = tj.BlockMask(qb, kb, jnp.ones((1, 3, 3), bool))       # traced: the device's check
    if check:
        device_route.check(m, q.shape[1], k.shape[1])
    return tj.sparse_attention(q, k, v, m)


# One unchecked and one checkified program for every case below (the bounds are traced: the
# four cases share them instead of compiling their own, ~4 s each on the 2-core runner).
_bad_bounds_plain = jax.jit(lambda *a: _bad_bounds_run(*a, False))
_bad_bounds_checked = jax.jit(checkify.checkify(lambda *a: _bad_bounds_run(*a, True)))


@pytest.mark.parametrize("bad", [
    [0, 50, 40, 128],          # not increasing
    [0, 40, 90, 500],          # past the length
    [-30, 40, 90, 128],        # below 0
    [0, 0, 0, 128],            # empty blocks
])
def test_bad_device_bounds_give_finite_output_and_fail_the_checkify_check(bad):
    q, k, v = random_qkv(1, 128, 128, 2, 1, 16, "float32", 5)
    blocks = jnp.ones((1, 3, 3), bool)
    with pytest.raises(ValueError, match="q_bounds"):        # concrete: checked at once
        tj.sparse_attention(q, k, v, tj.BlockMask(jnp.asarray(bad), jnp.asarray([0, 40, 90, 128]),
                                                  blocks))

    kb = jnp.asarray([0, 40, 90, 128])
    out = _bad_bounds_plain(q, k, v, jnp.asarray(bad), kb)
    assert np.isfinite(np.asarray(out)).all()
    checked = _bad_bounds_checked
    err, _ = checked(q, k, v, jnp.asarray(bad), kb)
    with pytest.raises(checkify.JaxRuntimeError, match="q_bounds must increase strictly"):
        err.throw()
    err, _ = checked(q, k, v, kb, kb)
    err.throw()


# --- argument errors ---------------------------------------------------------------------
def test_device_mask_errors_name_the_argument():
    b = jnp.ones((1, 2, 2), bool)
    with pytest.raises(TypeError, match="q_bounds must hold integers"):
        tj.BlockMask(jnp.asarray([0.0, 4.0, 8.0]), [0, 4, 8], b)
    with pytest.raises(TypeError, match="blocks must have dtype bool"):
        tj.BlockMask(jnp.asarray([0, 4, 8]), [0, 4, 8], jnp.ones((1, 2, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"expected \[Hm, 2, 3\]"):
        tj.BlockMask(jnp.asarray([0, 4, 8]), [0, 4, 6, 8], b)
    with pytest.raises(ValueError, match="kv_bounds has per-head bounds for 3 heads"):
        tj.BlockMask(jnp.asarray([0, 4, 8]), jnp.zeros((3, 3), jnp.int32), b)
    m = tj.BlockMask(jnp.asarray([0, 4, 8]), [0, 4, 8], b)
    with pytest.raises(TypeError, match="not hashable"):
        hash(m)
    with pytest.raises(TypeError, match="Lq is not known statically"):
        m.Lq
    q, k, v = random_qkv(1, 8, 8, 2, 2, 8, "float32", 0)
    with pytest.raises(ValueError, match="policy applies to host plans only"):
        tj.sparse_attention(q, k, v, m, policy="split")
    with pytest.raises(TypeError, match="tessera_jax.plan takes static masks"):
        tj.plan(m, q.shape, k.shape, q.dtype)
    with pytest.raises(ValueError, match="mask covers Lkv=8 keys but k has length 9"):
        tj.sparse_attention(q, k[:, :1].repeat(9, 1), v[:, :1].repeat(9, 1), m)
    with pytest.raises(ValueError, match="mask has 3 heads"):
        tj.sparse_attention(q, k, v, tj.BlockMask(jnp.asarray([0, 4, 8]), [0, 4, 8],
                                                  jnp.ones((3, 2, 2), bool)))
    with pytest.raises(ValueError, match="pairs query units"):
        device_route.choose(m, check_shapes(
            (1, 8, 2, 64), (1, 8, 2, 64), jnp.bfloat16), "mosaic_gpu",
            device_route.dispatch.get_template("mgpu_q64x2pp_kv64_s2_hm"))


def test_template_choice_is_static_and_follows_static_bounds():
    shape = check_shapes((1, 512, 2, 64), (1, 512, 2, 64), jnp.bfloat16)
    big = tj.BlockMask(np.arange(0, 513, 128), np.arange(0, 513, 128), jnp.ones((1, 4, 4), bool))
    rows128 = tj.BlockMask(np.arange(0, 513, 128), np.arange(0, 513, 64), jnp.ones((1, 4, 8), bool))
    cubes = tj.BlockMask(np.arange(0, 513, 64), np.arange(0, 513, 64), jnp.ones((1, 8, 8), bool))
    small_kv = tj.BlockMask(np.arange(0, 513, 128), np.r_[np.arange(0, 512, 24), 512],
                           jnp.ones((1, 4, 22), bool))
    rows64 = tj.BlockMask(np.arange(0, 513, 64), np.arange(0, 513, 128), jnp.ones((1, 8, 4), bool))
    tiny = tj.BlockMask(np.arange(0, 513, 4), np.arange(0, 513, 4), jnp.ones((1, 128, 128), bool))
    traced = tj.BlockMask(jnp.arange(0, 513, 4), jnp.arange(0, 513, 4), jnp.ones((1, 128, 128), bool))
    pick = lambda m: getattr(device_route.choose(m, shape, "mosaic_gpu", None), "name", None)  # noqa: E731
    assert pick(big) == "mgpu_q128_kv128_s2_hm"
    assert pick(rows128) == "mgpu_q128_kv64_s2_hm"      # 64-key blocks: 64-key tiles first
    assert pick(small_kv) == "mgpu_q128_kv64_s2_hm"     # 24-token key blocks: 6 meet a kv128 tile
    assert pick(cubes) == "mgpu_q64x2_kv64_s2_hm"       # 64-token query blocks: 64-row units
    assert pick(rows64) == "mgpu_q64x2_kv64_s2_hm"
    assert pick(tiny) == "mgpu_q64x2_kv64_s2_hm"        # bitmap steps (4-token blocks)
    assert pick(traced) == "mgpu_q64x2_kv64_s2_hm"      # traced: mean blocks of 4 tokens
    traced_big = tj.BlockMask(jnp.arange(0, 513, 128), jnp.arange(0, 513, 128),
                              jnp.ones((1, 4, 4), bool))
    assert pick(traced_big) == "mgpu_q128_kv128_s2_hm"  # fit decided on the device


def test_device_gather_option_sends_traced_and_irregular_bounds_to_the_gathering_template():
    """``Options.device_gather``: "never" keeps the device list, "traced" gathers where a bound
    is traced, "irregular" also where static key blocks have more than 8 distinct sizes, "auto"
    (the default) nowhere (a tiered call makes it "traced" for irregular host bounds); a
    named template wins; a bad value is refused."""
    shape = check_shapes((1, 512, 2, 64), (1, 512, 2, 64), jnp.bfloat16)
    rng = np.random.default_rng(0)
    kb = np.r_[0, np.cumsum(rng.integers(1, 40, 400))]
    kb = kb[kb < 512]
    kb = np.r_[kb, 512]
    clusters = tj.BlockMask(np.arange(0, 513, 128), kb, jnp.ones((1, 4, len(kb) - 1), bool))
    cubes = tj.BlockMask(np.arange(0, 513, 64), np.arange(0, 513, 64), jnp.ones((1, 8, 8), bool))
    traced = tj.BlockMask(jnp.arange(0, 513, 64), jnp.arange(0, 513, 64), jnp.ones((1, 8, 8), bool))
    gather = "mgpu_q128_kv128_s2_gather_skip_nopp"

    def pick(m, mode, template=None):
        t = device_route.choose(m, shape, "mosaic_gpu", template,
                                tj.Options(device_gather=mode))
        return t.name

    assert len(np.unique(np.diff(kb))) > 8
    assert [pick(m, "never") for m in (clusters, cubes, traced)] == [
        "mgpu_q128_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm"]
    assert [pick(m, "traced") for m in (clusters, cubes, traced)] == [
        "mgpu_q128_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm", gather]
    assert [pick(m, "irregular") for m in (clusters, cubes, traced)] == [
        gather, "mgpu_q64x2_kv64_s2_hm", gather]
    assert [pick(m, "auto") for m in (clusters, cubes, traced)] == [
        pick(m, "never") for m in (clusters, cubes, traced)]
    perhead = tj.BlockMask(np.arange(0, 513, 128), np.stack([kb, kb]),
                           jnp.ones((2, 4, len(kb) - 1), bool))
    assert pick(perhead, "auto") != gather and pick(perhead, "irregular") == gather
    assert tj.Options().device_gather == "auto"
    named = device_route.dispatch.get_template("mgpu_q128_kv128_s2_hm")
    assert pick(traced, "irregular", named) == "mgpu_q128_kv128_s2_hm"
    assert device_route.choose(traced, shape, "triton", None,
                               tj.Options(device_gather="traced")).name == \
        "triton_q128_kv128_w8_s3_gather"
    with pytest.raises(ValueError, match="device_gather must be one of"):
        tj.Options(device_gather="always")
    with pytest.raises(TypeError, match="traced_small_blocks must be a bool or None"):
        tj.Options(traced_small_blocks=1)
    for bad in ("dense", None):
        with pytest.raises(ValueError, match="device_overflow must be one of"):
            tj.Options(device_overflow=bad)
    assert device_route.choose(traced, shape, "mosaic_gpu", None).name == \
        "mgpu_q64x2_kv64_s2_hm"                              # mean 64 tokens: small order
    assert device_route.choose(traced, shape, "mosaic_gpu", None, tj.Options(
        traced_small_blocks=False)).name == "mgpu_q128_kv128_s2_hm"
    # A caller's gathering template needs no bitmap steps: static bounds whose plain device
    # plan is over the bitmap budget still run it (the H100 run took the exact path here).
    tight = tj.Options(bitmap_budget_bytes=1)
    for name in (gather, "mgpu_q128_kv128_s2_gather"):
        g = device_route.dispatch.get_template(name)
        assert device_route.choose(clusters, shape, "mosaic_gpu", g, tight).name == name
    assert device_route.choose(clusters, shape, "mosaic_gpu", named, tight) is None


def test_device_route_through_the_triton_kernel_interpret_mode():
    """The route's glue to a GPU kernel module (Triton lowering, interpret mode on CPU)."""
    rng = np.random.default_rng(7)
    qb = np.array([0, 50, 128, 200]); kb = np.array([0, 64, 150, 180])
    blocks = rng.random((2, 3, 3)) < 0.6
    host = tj.BlockMask(qb, kb, blocks)
    q, k, v = random_qkv(1, 200, 180, 2, 1, 16, "float32", 8)
    shape = check_qkv(q, k, v)
    t = device_route.dispatch.get_template("triton_q128_kv64_w8_s3_pf_hm")
    dev = tj.BlockMask(jnp.asarray(qb), jnp.asarray(kb), jnp.asarray(blocks))
    out, lse = device_route.attention(q, k, v, dev, shape, "triton", t, 0.25, True)
    ref, ref_lse = tj.reference_attention(q, k, v, host, scale=0.25, return_lse=True)
    np.testing.assert_allclose(out, ref, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_small_blocks_run_bitmap_steps_within_the_budget(monkeypatch):
    """4-token blocks with static bounds run the device plan's bitmap steps (the exact path is
    never traced), exactly; with a bitmap budget (``Options.bitmap_budget_bytes``) that holds
    no step they take the exact path, with a warning."""
    rng = np.random.default_rng(11)
    qb = np.r_[np.arange(0, 200, 4), 200]
    blocks = rng.random((2, len(qb) - 1, len(qb) - 1)) < 0.2
    q, k, v = random_qkv(1, 200, 200, 2, 1, 16, "float32", 12)
    ref = tj.reference_attention(q, k, v, tj.BlockMask(qb, qb, blocks))

    def no_exact(*a, **kw):
        raise AssertionError("the exact path ran")

    monkeypatch.setattr(core, "exact_attention", no_exact)
    out = tj.sparse_attention(q, k, v, tj.BlockMask(qb, qb, jnp.asarray(blocks)))
    np.testing.assert_allclose(out, ref, **TOL)

    monkeypatch.undo()
    with pytest.warns(UserWarning, match="exact XLA path"):
        out = tj.sparse_attention(q, k, v, tj.BlockMask(qb, qb, jnp.asarray(blocks[:, ::-1])),
                                  options=tj.Options(bitmap_budget_bytes=1))
    np.testing.assert_allclose(out, tj.reference_attention(
        q, k, v, tj.BlockMask(qb, qb, blocks[:, ::-1])), **TOL)


def test_static_bounds_past_the_budget_decide_on_the_device():
    """Static bounds whose tile pairs that may take a bitmap step outnumber the budget's room
    (variable clusters at Wan 720p: 1.03 GB worst case at q64x2 x kv64) get the room and
    decide on the device: a selection that fits runs the kernels (``ok``), one that overflows
    the exact path (``Options(device_overflow="exact")``; "gather", the default, is
    test_device_gather's); exact either way, forward and
    backward (the Mosaic GPU kernels in interpret mode; the XLA backend: ``gpu_check``'s
    decided case, tests/test_gpu_check.py)."""
    backend = "mosaic_gpu"
    from tessera_jax.select import device as select_device

    rng = np.random.default_rng(21)
    L, H = 256, 2
    qb = np.r_[np.arange(0, L, 4), L]
    n = len(qb) - 1
    tol = 3e-2
    q, k, v = random_qkv(1, L, L, H, 1, 64, "bfloat16", 22)
    ct = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
    shape = check_qkv(q, k, v)
    sparse = np.zeros((H, n, n), bool)
    sparse[:, :16, :16] = rng.random((H, 16, 16)) < 0.3       # one 64 x 64 tile pair per head
    sparse[:, 0, 0] = True
    dense = rng.random((H, n, n)) < 0.3
    dev = tj.BlockMask(qb, qb, jnp.asarray(sparse))
    consts = select_device.static_parts(dev)
    t, cap = device_route._choose(consts, dev, shape, backend, None,
                                  select_device.DeviceRule(1 << 30))
    worst = select_device.bitmap_pairs(consts[0], consts[1], (H, n, n), shape, t)
    step = select_device.bitmap_step_bytes(t)
    budget = step * (worst // 4)                      # room for a quarter of the pairs
    opts = tj.Options(bitmap_budget_bytes=budget, device_overflow="exact")
    t, cap = device_route._choose(consts, dev, shape, backend, None, opts.device_rule)
    assert t is not None and cap == worst // 4
    assert select_device.decided_on_device(consts[0], consts[1], (H, n, n), shape, t, cap)
    assert not select_device.decided_on_device(consts[0], consts[1], (H, n, n), shape, t,
                                               worst)
    # One program of each for both selections (the blocks traced, the bounds static).
    plans = jax.jit(lambda b: device_route.device_plans(q, k, qb, qb, b, consts=consts, t=t,
                                                        capacity=cap, decide=True,
                                                        budget=budget))
    f = jax.jit(lambda q, k, v, b: jax.vjp(lambda q, k, v: device_route.attention(
        q, k, v, tj.BlockMask(qb, qb, b), shape, backend, None, 0.125, False, opts), q, k, v))
    for blocks, fits in ((sparse, True), (dense, False)):
        plan = plans(jnp.asarray(blocks))
        assert bool(plan.ok) == fits
        assert plan.dkv_ok is not None and bool(plan.dkv_ok) == fits
        host = tj.BlockMask(qb, qb, blocks)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref, ref_vjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, host,
                                                                      scale=0.125), *f32)
        out, vjp = f(q, k, v, jnp.asarray(blocks))
        for a, b in zip([out, *_call(vjp, ct)], [ref, *ref_vjp(ct.astype(jnp.float32))]):
            np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=tol, rtol=tol)


def test_an_option_changed_between_calls_of_a_jitted_function_takes_effect(monkeypatch):
    """``Options`` is hashable: a static argument of jit, so a changed budget compiles anew
    (the bitmap plan, then the exact path) instead of reusing the first program."""
    rng = np.random.default_rng(13)
    qb = np.r_[np.arange(0, 160, 4), 160]
    blocks = jnp.asarray(rng.random((1, len(qb) - 1, len(qb) - 1)) < 0.3)
    q, k, v = random_qkv(1, 160, 160, 2, 1, 16, "float32", 14)
    ref = tj.reference_attention(q, k, v, tj.BlockMask(qb, qb, np.asarray(blocks)))
    ran = []
    monkeypatch.setattr(core, "exact_attention",
                        lambda *a, real=core.exact_attention, **kw: ran.append(1) or real(*a, **kw))
    f = jax.jit(lambda q, k, v, b, options: tj.sparse_attention(
        q, k, v, tj.BlockMask(qb, qb, b), options=options), static_argnames="options")
    np.testing.assert_allclose(f(q, k, v, blocks, options=tj.Options()), ref, **TOL)
    assert not ran
    with pytest.warns(UserWarning, match="exact XLA path"):
        out = f(q, k, v, blocks, options=tj.Options(bitmap_budget_bytes=1))
    assert ran
    np.testing.assert_allclose(out, ref, **TOL)


def test_options_are_checked():
    with pytest.raises(ValueError, match="bitmap_budget_bytes"):
        tj.Options(bitmap_budget_bytes=-1)
    with pytest.raises(ValueError, match="dkv_policies"):
        tj.Options(dkv_policies=("sliding",))
    with pytest.raises(TypeError, match="interpret"):
        tj.Options(interpret="yes")
    q = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(TypeError, match="options"):
        tj.sparse_attention(q, q, q, tj.BlockMask.uniform(64, 64, 32, 32, np.ones((1, 2, 2), bool)),
                            options={"interpret": True})


def test_first_bitmap_room_falls_back_to_the_whole_room_then_exact(monkeypatch):
    """Traced per-head bounds of large mean blocks are planned first with
    ``Options.bitmap_first_bytes`` of bitmap room; a plan that overflows it (head 0's six
    4-token blocks put a tile past GRID blocks) is made again with the whole budget inside
    the program, and that plan fits: forward and backward exact. Past the whole budget too,
    the exact path; with no first room, one plan."""
    import dataclasses

    L, H = 512, 2
    sizes = [np.array([4] * 6 + [200, 288]), np.full(8, 64)]
    qb = jnp.asarray(np.stack([np.r_[0, np.cumsum(s)] for s in sizes]), jnp.int32)
    rng = np.random.default_rng(5)
    blocks = rng.random((H, 8, 8)) < 0.6
    blocks[0, :6] = True                                  # the small blocks' tiles selected
    q, k, v = random_qkv(1, L, L, H, H, 16, "float32", 6)
    m_np = tj.BlockMask(np.asarray(qb), np.asarray(qb), blocks)
    ref, ref_vjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, m_np), q, k, v)
    ct = jnp.asarray(rng.standard_normal(ref.shape), jnp.float32)
    ref_g = ref_vjp(ct)
    plans = []
    real_core = core.attention
    monkeypatch.setattr(device_route.core, "attention",
                        lambda q, k, v, plan, *a, **kw: plans.append(plan)
                        or real_core(q, k, v, plan, *a, **kw))

    def run(opts):
        f = jax.jit(lambda q, k, v, b, x: jax.vjp(lambda q, k, v: tj.sparse_attention(
            q, k, v, tj.BlockMask(x, x, b), options=opts), q, k, v))
        out, vjp = f(q, k, v, jnp.asarray(blocks), qb)
        np.testing.assert_allclose(out, ref, **TOL)
        for a, b in zip(_call(vjp, ct), ref_g):                # the backward compiled
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
        return plans[-1].refine

    full = run(tj.Options(bitmap_first_bytes=1))
    assert full is not None and full.capacity > 1
    first = dataclasses.replace(full, capacity=1, budget=1)
    b = jnp.asarray(blocks)

    def oks(*refines):                     # the plans' fits, made in one compiled program
        return tuple(bool(x) for x in jax.jit(lambda *a: [r(*a).ok for r in refines])(qb, qb, b))

    assert oks(first, full) == (False, True)                               # the fallback ran
    from pallas_kernels import abi
    from tessera_jax.runtime import dispatch

    t = dispatch.get_template(full.template)
    slot = abi.bitmap_rows(t.tile_q, t.tile_kv) * abi.STEP_COLS * 4
    full = run(tj.Options(bitmap_first_bytes=1, bitmap_budget_bytes=2 * slot))
    assert full.capacity == 2 and oks(full) == (False,)                     # then exact
    assert device_route._first_room(t, full.capacity, blocks.shape, L, L,
                                    tj.Options(bitmap_first_bytes=0)) is None


def _conds(jaxpr) -> list:
    """The cond equations of a jaxpr, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            out.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _conds(sub)
    return out


_NO_BITMAP_ROOM = tj.Options(bitmap_budget_bytes=0)


def _fwd_bwd_one(q, k, v, qb, b, ct):
    m = tj.BlockMask(qb, qb, b)
    out, vjp = jax.vjp(lambda q, k, v: tj.sparse_attention(
        q[None], k[None], v[None], m, backend="xla", options=_NO_BITMAP_ROOM)[0], q, k, v)
    return out, vjp(ct)


# Programs the two cases below share (the same shapes: the fit is decided on the device).
_vmapped_fwd_bwd = jax.vmap(_fwd_bwd_one, in_axes=(0, 0, 0, 0, 0, None))
_vmapped_fwd_bwd_jit = jax.jit(_vmapped_fwd_bwd)
_plan_fits = jax.jit(lambda b, qb, **kw: planner.plan_on_device(b, qb, qb, **kw)[1],
                     static_argnames=("num_q_heads", "q_len", "kv_len", "tile_q", "tile_kv"))


@pytest.mark.parametrize("fits", [True, False])
def test_vmap_of_device_masks_keeps_one_conditional(fits):
    """jax.vmap over per-element device masks (traced per-head bounds): the fit stays one
    ``cond`` on all elements' ``ok`` (jax would make a batched predicate a select running
    the kernels and the exact path on every call), forward and backward, and so do the
    planner's bitmap fills; exact either way:
    every element fits, or one does not (a tile meeting more than GRID blocks with no bitmap
    room: the whole batch takes the exact path)."""
    L, H, n = 96, 2, 6
    rng = np.random.default_rng(11)
    cuts = np.arange(1, L // 8) * 8                        # blocks of >= 8 tokens: they fit
    qbs = np.stack([np.stack([np.r_[0, np.sort(rng.choice(cuts, n - 1, replace=False)), L]
                              for _ in range(H)]) for _ in range(3)])
    if not fits:
        qbs[1, 0] = np.r_[0, 1, 2, 3, 4, 5, L]             # head 0: six blocks in one tile
    blocks = rng.random((3, H, n, n)) < 0.6
    q, k, v = random_qkv(3, L, L, H, H, 8, "float32", 12)
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    opts = _NO_BITMAP_ROOM
    t = device_route.choose(tj.BlockMask(jnp.asarray(qbs[0]), jnp.asarray(qbs[0]),
                                         jnp.asarray(blocks[0])),
                            check_shapes(q[:1].shape, k[:1].shape, q.dtype), "xla", None, opts)
    oks = [bool(_plan_fits(jnp.asarray(blocks[i]), jnp.asarray(qbs[i]), num_q_heads=H,
                           q_len=L, kv_len=L, tile_q=t.tile_q, tile_kv=t.tile_kv))
           for i in range(3)]
    assert oks == [True, fits, True]

    args = (q, k, v, jnp.asarray(qbs, jnp.int32), jnp.asarray(blocks), ct[0])
    jaxpr = jax.make_jaxpr(_vmapped_fwd_bwd)(*args)
    conds = _conds(jaxpr.jaxpr)
    # The forward's and the backward's, and the planner's bitmap fills: each one predicate
    # for the batch (no select running every branch).
    assert len(conds) >= 2 and all(c.invars[0].aval.shape == () for c in conds)
    out, grads = _vmapped_fwd_bwd_jit(*args)
    for i in range(3):
        m = tj.BlockMask(qbs[i], qbs[i], blocks[i])
        want, vjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, m),
                            q[i:i + 1], k[i:i + 1], v[i:i + 1])
        np.testing.assert_allclose(out[i], want[0], **TOL)
        for g, w in zip(grads, vjp(ct[:1])):
            np.testing.assert_allclose(g[i], w[0], atol=1e-4, rtol=1e-4)


def test_second_order_through_a_device_decided_fit():
    """The XLA backend differentiates twice through a plan whose fit is decided on the device
    (traced per-head bounds: ``lax.cond`` on ``batch_all(ok)``), as through the reference."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(1, 40, 40, 2, 2, 8, "float32", 1)
    qb = jnp.asarray([[0, 8, 24, 40], [0, 16, 32, 40]], jnp.int32)
    b = jnp.asarray(rng.random((2, 3, 3)) < 0.7)
    m = tj.BlockMask(np.asarray(qb), np.asarray(qb), np.asarray(b))

    def second(attn):
        g = jax.grad(lambda q: jnp.sum(attn(q) ** 2))
        return jax.grad(lambda q: jnp.sum(g(q) ** 2))(q)

    got = jax.jit(lambda q: second(lambda x: tj.sparse_attention(
        x, k, v, tj.BlockMask(qb, qb, b), backend="xla")))(q)
    want = jax.jit(lambda q: second(lambda x: tj.reference_attention(x, k, v, m)))(q)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_a_device_decided_fit_returns_the_kernels_output_without_a_copy():
    """A call whose fit is decided on the device (per-head bounds: ``lax.cond`` on the plan's
    ``ok``), forward and backward, hands the kernels' results out of the conditional as they
    are: XLA gave the conditionals the exact path's head-major layout and copied each result
    back after them (out, then dq, dk and dv: ~0.07 ms each at Wan 480p on the H100)."""
    L, H, D = 2048, 4, 64                 # (at 512 x 2 x 32 XLA keeps the forward's layout)
    rng = np.random.default_rng(0)
    qb = np.r_[0:L:64, L]
    n = len(qb) - 1
    bl = jnp.asarray(rng.random((H, n, n)) < 0.4)
    bh = jnp.asarray(np.broadcast_to(qb, (H, n + 1)).copy())
    q = jnp.asarray(rng.standard_normal((1, L, H, D)), jnp.bfloat16)

    def loss(q, k, v, bl, b):
        out = tj.sparse_attention(q, k, v, tj.BlockMask(b, b, bl), scale=0.2, backend="xla")
        return out.astype(jnp.float32).sum()

    for f in (jax.jit(lambda *a: tj.sparse_attention(
                  a[0], a[1], a[2], tj.BlockMask(a[4], a[4], a[3]), scale=0.2, backend="xla")),
              jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        text = f.lower(q, q, q, bl, bh).compile().as_text()
        entry = text[text.index("\nENTRY"):]
        conds = [x for x in entry.splitlines() if " conditional(" in x and "/cond" in x
                 and "plan_words" not in x]
        assert conds
        root = next(x for x in entry.splitlines() if x.strip().startswith("ROOT"))
        rhs = root.split("=", 1)[1].split("metadata")[0]
        results = [root] if " tuple(" not in rhs else [
            next(x for x in entry.splitlines() if x.strip().startswith(f"%{name} ="))
            for name in re.findall(r"%([\w.\-]+)", rhs)]
        for line in results:                  # each the conditional's result, or its bitcast
            assert " bitcast(" in line or " get-tuple-element(" in line, line[:200]
