"""Non-finite values at keys a row does not select never reach it: ``tj.reference_attention``
always, ``tj.sparse_attention`` with ``Options(check_finite=True)`` on every route (host plans,
device masks, per-head bounds) and backend (XLA; Triton and Mosaic GPU in interpret mode),
forward and gradients. The expected NaN rows come from the mask's token mask (NumPy); the
other rows must equal the reference on the clean inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tessera_jax as tj
from tessera_jax.runtime import dispatch

from strategies import random_qkv

FINITE = tj.Options(check_finite=True)
TOL = dict(atol=2e-5, rtol=2e-5)

# The issue's layout: blocks that no 64-key tile respects, keys 200-255 selected by no row.
L, HQ, HKV, D = 256, 2, 1, 16
QB = np.array([0, 40, 96, 160, 256])
KB = np.array([0, 50, 100, 130, 200, 256])


def _issue_mask():
    blocks = np.random.default_rng(0).random((HQ, 4, 5)) < 0.6
    blocks[:, :, 4] = False                         # keys 200-255: selected by no row
    blocks[:, 0, 2], blocks[:, 1, 2] = True, False  # key 100 (block 2): some rows select it
    return tj.BlockMask(QB, KB, blocks)


def expected_rows(mask, Hq, Hkv, bad_q, bad_kv):
    """bool [B, Hq, Lq]: rows that select a key with a non-finite k or v (bad_kv [B, Lkv,
    Hkv]), or hold a non-finite q (bad_q [B, Lq, Hq]) and select any key."""
    tm = mask.token_mask()
    tm = np.broadcast_to(tm, (Hq,) + tm.shape[1:]).astype(np.int64)
    per_head = bad_kv[:, :, np.arange(Hq) // (Hq // Hkv)].astype(np.int64)
    hit = np.einsum("hqk,bkh->bhq", tm, per_head) > 0
    return hit | (np.swapaxes(bad_q, 1, 2) & tm.any(-1)[None])


def poison(rng, x, n, kind):
    """x with ``n`` random (batch, position, head) rows given a NaN, inf or -inf entry, and the
    bool [B, L, H] of rows hit."""
    a = np.array(x, np.float32)
    B, Lx, H, Dx = a.shape
    hit = np.zeros((B, Lx, H), bool)
    for _ in range(n):
        b, i, h = rng.integers(B), rng.integers(Lx), rng.integers(H)
        a[b, i, h, rng.integers(Dx)] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
        hit[b, i, h] = True
    return jnp.asarray(a, x.dtype), hit


def assert_by_selection(res, clean, rows, tol=TOL):
    """out and lse NaN exactly on ``rows`` [B, Hq, Lq]; elsewhere equal to the clean ones."""
    out, lse = (np.asarray(x, np.float32) for x in res)
    ref, ref_lse = (np.asarray(x, np.float32) for x in clean)
    out, ref = np.swapaxes(out, 1, 2), np.swapaxes(ref, 1, 2)          # [B, Hq, Lq, D]
    np.testing.assert_array_equal(np.isnan(out).any(-1), rows)
    assert np.isnan(out[rows]).all()
    np.testing.assert_array_equal(np.isnan(lse), rows)
    np.testing.assert_allclose(out[~rows], ref[~rows], **tol)
    np.testing.assert_allclose(lse[~rows], ref_lse[~rows], **tol)


def reference(q, k, v, mask):
    return tj.reference_attention(q, k, v, mask, return_lse=True)


def xla_host(q, k, v, mask):
    assert mask.is_static
    return tj.sparse_attention(q, k, v, mask, return_lse=True, backend="xla", options=FINITE)


@jax.jit
def _device(q, k, v, mask):
    return tj.sparse_attention(q, k, v, mask, return_lse=True, options=FINITE)


def xla_device(q, k, v, mask):
    return _device(q, k, v, tj.BlockMask(*(jnp.asarray(x) for x in (
        mask.q_bounds, mask.kv_bounds, mask.blocks))))


ROUTES = {"reference": reference, "xla_host": xla_host, "xla_device": xla_device}


# --- the issue's two cases -------------------------------------------------------------------
@pytest.mark.parametrize("route", list(ROUTES))
def test_nonfinite_keys_no_row_selects_change_nothing(route):
    """Keys 200-255 selected by no row, v (and k) NaN or inf there: the output is the clean
    one (before: every row NaN in the reference, the host and the device routes)."""
    mask = _issue_mask()
    q, k, v = random_qkv(1, L, L, HQ, HKV, D, "float32", 1)
    clean = reference(q, k, v, mask)
    bad_v, bad_k = v.at[:, 200:].set(jnp.nan), k.at[:, 230:, :, 3].set(jnp.inf)
    none = np.zeros((1, HQ, L), bool)
    assert_by_selection(ROUTES[route](q, k, bad_v, mask), clean, none)
    assert_by_selection(ROUTES[route](q, bad_k, bad_v, mask), clean, none)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("where", ["v", "k"])
def test_one_nonfinite_key_makes_exactly_its_selecting_rows_nan(route, where):
    """One NaN at key 100: exactly the rows that select key 100 are NaN (before: the XLA
    backend's tiles made more rows NaN; the reference made every row NaN)."""
    mask = _issue_mask()
    q, k, v = random_qkv(1, L, L, HQ, HKV, D, "float32", 2)
    clean = reference(q, k, v, mask)
    args = {"k": (q, k.at[:, 100, 0, 5].set(jnp.nan), v),
            "v": (q, k, v.at[:, 100].set(jnp.nan))}[where]
    rows = mask.token_mask()[None, :, :, 100]                              # [1, Hq, Lq]
    assert 0 < rows.sum() < rows.size
    assert_by_selection(ROUTES[route](*args, mask), clean, rows)


# --- random masks and placements ---------------------------------------------------------------
LQ, LKV = 72, 88


def _bounds(rng, length, n, per_head):
    """[n + 1] bounds (or [per_head, n + 1]) from 0 to length, n blocks of >= 1 token."""
    def one():
        return np.r_[0, np.sort(rng.choice(np.arange(1, length), n - 1, replace=False)), length]
    return np.stack([one() for _ in range(per_head)]) if per_head else one()


@st.composite
def cases(draw):
    """A random mask (shared or per-head bounds and blocks, GQA, empty rows) and poison."""
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    Hm = draw(st.sampled_from(sorted({1, Hq})))
    per_head = Hm > 1 and draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    qb = _bounds(rng, LQ, 5, Hm if per_head else 0)
    kb = _bounds(rng, LKV, 4, Hm if per_head else 0)
    blocks = rng.random((Hm, 5, 4)) < draw(st.sampled_from([0.2, 0.5, 1.0]))
    blocks[:, rng.integers(5)] = False                      # a query block selecting nothing
    return dict(mask=tj.BlockMask(qb, kb, blocks), Hq=Hq, Hkv=Hkv, rng=rng,
                kind=draw(st.sampled_from(["nan", "inf", "-inf"])),
                n=[draw(st.integers(0, 3)) for _ in range(3)])


def _check_case(case, route):
    mask, Hq, Hkv, rng = case["mask"], case["Hq"], case["Hkv"], case["rng"]
    q, k, v = random_qkv(2, LQ, LKV, Hq, Hkv, 16, "float32", int(rng.integers(2**31)))
    clean = reference(q, k, v, mask)
    (bq, hq), (bk, hk), (bv, hv) = (poison(rng, x, n, case["kind"])
                                    for x, n in zip((q, k, v), case["n"]))
    rows = expected_rows(mask, Hq, Hkv, hq, hk | hv)
    assert_by_selection(route(bq, bk, bv, mask), clean, rows)


@settings(max_examples=25)
@given(cases())
def test_reference_masks_by_selection(case):
    _check_case(case, reference)


# 3 examples, random each run: each compiles the host and the device route (~7 s on the
# 2-core runner).
@settings(max_examples=3)
@given(cases())
def test_check_finite_masks_by_selection_on_every_route(case):
    """Static masks with shared bounds (host plans), per-head bounds (the device route,
    eagerly) and device masks under jit, on the XLA backend."""
    _check_case(case, xla_host if case["mask"].is_static else xla_device)
    if case["mask"].per_head_bounds:
        return
    _check_case(case, xla_device)


# --- gradients ---------------------------------------------------------------------------------
def _loss(fn, w):
    """Sum of the finite outputs, weighted (NaN rows pass no gradient)."""
    def loss(q, k, v, mask):
        out = fn(q, k, v, mask)[0]
        return jnp.sum(jnp.where(jnp.isnan(out), 0.0, out) * w)
    return loss


@pytest.mark.parametrize("route", ["xla_host", "xla_device"])
def test_gradients_ignore_what_no_row_selects_and_rows_set_to_nan(route):
    """Non-finite k, v at keys no row selects: the gradients are the clean ones; at key 100,
    which some rows select: finite, the reference's, and 0 at key 100 (the rows that select
    it are NaN and pass no gradient)."""
    mask = _issue_mask()
    q, k, v = random_qkv(1, L, L, HQ, HKV, D, "float32", 3)
    w = jnp.cos(jnp.arange(D, dtype=jnp.float32))
    grad = lambda fn, *a: jax.grad(_loss(fn, w), argnums=(0, 1, 2))(*a, mask)   # noqa: E731
    want = grad(reference, q, k, v)
    got = grad(ROUTES[route], q, k.at[:, 230:].set(jnp.inf), v.at[:, 200:].set(jnp.nan))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    bad = (q, k.at[:, 100, 0, 1].set(-jnp.inf), v.at[:, 100].set(jnp.nan))
    got, want = grad(ROUTES[route], *bad), grad(reference, *bad)
    for a, b in zip(got, want):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert not np.asarray(got[1])[:, 100].any() and not np.asarray(got[2])[:, 100].any()


# --- the Pallas kernels (interpret mode) -------------------------------------------------------
@pytest.mark.parametrize("template,dtype,tol", [
    pytest.param("triton_q128_kv64_w8_s3_pf_hm", "float32", 2e-3),
    pytest.param("mgpu_q128_kv64_s2_hm", "float16", 2e-2, marks=pytest.mark.slow)])
def test_pallas_backends_with_check_finite(monkeypatch, template, dtype, tol):
    """Triton and Mosaic GPU kernels (interpret mode, as if on a Hopper GPU): a host plan and
    a device mask, NaN in v at keys no row selects and at key 100."""
    monkeypatch.setattr(dispatch, "_gpu_capability", lambda: (9, 0))
    backend = dispatch.get_template(template).backend
    mask = _issue_mask()
    q, k, v = random_qkv(1, L, L, HQ, HKV, 64, dtype, 4)
    clean = reference(q, k, v, mask)
    bad_v = v.at[:, 200:].set(jnp.nan).at[:, 100].set(jnp.inf)
    rows = mask.token_mask()[None, :, :, 100]
    dev = tj.BlockMask(*(jnp.asarray(x) for x in (QB, KB, mask.blocks)))
    for m in (mask, dev):
        res = tj.sparse_attention(q, k, bad_v, m, return_lse=True, backend=backend,
                                  template=template, options=FINITE)
        assert_by_selection(res, clean, rows, dict(atol=tol, rtol=tol))


def test_check_finite_is_a_checked_bool():
    with pytest.raises(TypeError, match="check_finite"):
        tj.Options(check_finite=1)
    assert tj.Options(check_finite=True) != tj.Options()
    assert not tj.Options().check_finite


def test_eager_calls_copy_a_static_mask_once_and_clear_caches_forgets_it(monkeypatch):
    """The row marks of an eager call read a static mask's device copy, made once per mask
    (not a copy of its NumPy arrays per call); ``tj.clear_caches`` forgets it."""
    made = []
    real = tj.BlockMask.to_device
    monkeypatch.setattr(tj.BlockMask, "to_device",
                        lambda self, *a: made.append(self.digest) or real(self, *a))
    mask = _issue_mask()
    q, k, v = random_qkv(1, L, L, HQ, HKV, D, "float32", 5)
    tj.clear_caches()                                # an equal mask of an earlier test
    for _ in range(2):
        xla_host(q, k, v, mask)
    assert made == [mask.digest]
    jax.jit(xla_host, static_argnums=3)(q, k, v, mask)       # traced: constants, no copy
    assert made == [mask.digest]
    tj.clear_caches()
    xla_host(q, k, v, mask)
    assert made == [mask.digest] * 2


def test_check_finite_changed_between_calls_of_a_jitted_function_takes_effect():
    """``Options`` is a static argument of jit: turning ``check_finite`` on compiles anew."""
    mask = _issue_mask()
    q, k, v = random_qkv(1, L, L, HQ, HKV, D, "float32", 6)
    f = jax.jit(lambda q, k, v, options: tj.sparse_attention(
        q, k, v, mask, backend="xla", options=options), static_argnames="options")
    bad_v = v.at[:, 200:].set(jnp.nan)
    assert np.isnan(np.asarray(f(q, k, bad_v, options=tj.Options()))).any()
    np.testing.assert_allclose(f(q, k, bad_v, options=FINITE), reference(q, k, v, mask)[0],
                               **TOL)
