"""Gradients of ``tj.sparse_attention`` (``runtime.core``) against a float64 NumPy oracle:
the XLA backward over host and device plans (property tests), the Triton backward kernels in
interpret mode and the Mosaic GPU ones under its interpreter, the transforms with
``backend=None``, and the errors of what is not supported.

The Mosaic GPU interpreter checks the plan walking, the TMA rings and their barriers, the
wgmma products with SMEM operands, the masking of every step kind and the stores; it runs the
products whose A operand lives in registers (dS K, P^T dO, dS^T Q) as plain dots and ignores
SMEM layouts, so those wgmma calls, TMA alignment, register pressure and speed are checked on
the GPU only (``benchmarks/backward.py``)."""

import functools
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.extend
import jax.numpy as jnp

import tessera_jax as tj
from pallas_kernels import backward_rows
from tessera_jax.planning.plan import AttentionPlan, host_pass
from tessera_jax.planning.planner import build_plan
from tessera_jax.runtime import core, device_route, host_plans

from strategies import random_qkv

try:
    from jax._src.pallas.mosaic_gpu.interpret import params as _interp
    INTERPRET = _interp.InterpretGPUParams()
except Exception:  # pragma: no cover
    INTERPRET = None


# --- the oracle ------------------------------------------------------------------------------
def oracle(q, k, v, mask, do, dlse=None, scale=None):
    """(out, lse, dq, dk, dv) in float64 NumPy: dense attention under the token mask and its
    gradients for the cotangents do (and dlse), written out by hand (no autodiff)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    g = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    tm = np.broadcast_to(mask.token_mask(), (Hq,) + (Lq, k.shape[1]))      # [Hq, Lq, Lkv]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = np.where(tm[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l_ = e.sum(-1, keepdims=True)
    p = e / np.where(l_ > 0, l_, 1.0)
    lse = np.where(l_[..., 0] > 0, np.log(np.where(l_[..., 0] > 0, l_[..., 0], 1.0))
                   + m[..., 0], -np.inf)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    delta = np.einsum("bqhd,bqhd->bhq", out, do)
    if dlse is not None:
        delta = delta - np.where(np.isfinite(lse), np.asarray(dlse, np.float64), 0.0)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    fold = lambda x: x.reshape(B, x.shape[1], Hkv, g, D).sum(3)   # noqa: E731  GQA sum
    return out, lse, dq, fold(dk), fold(dv)


def assert_grads(got, want, tol, atol=0.0):
    """Each of (dq, dk, dv) within ``tol`` of the oracle's, relative to its largest entry, or
    within ``atol`` (a gradient that is 0 in exact arithmetic holds only rounding)."""
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        a = np.asarray(a, np.float64)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert np.isfinite(a).all(), f"{name} is not finite"
        diff = np.abs(a - b).max()
        err = diff / max(np.abs(b).max(), 1e-6)
        assert err <= tol or diff <= atol, \
            f"{name}: relative error {err:.3g} > {tol} (absolute {diff:.3g} > {atol:.3g})"


def grads(fn, q, k, v, mask, do, dlse=None, **kw):
    """(dq, dk, dv) of ``fn(q, k, v, mask, **kw)`` for the cotangent do (and dlse: the call
    returns lse too), through jax.vjp."""
    if dlse is None:
        _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask, **kw), q, k, v)
        return vjp(do)
    _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask, return_lse=True, **kw), q, k, v)
    return vjp((do, dlse))


def run(p, q, k, v, scale, return_lse, options=None):
    """The core over a host plan ``p`` (``tj.plan``'s), as ``sparse_attention`` runs it."""
    opts = options or tj.Options()
    return core.attention(q, k, v, host_plans.attention_plan(p, opts), scale, return_lse, opts)


def cotangents(B, Lq, Hq, D, dtype, seed, with_lse):
    rng = np.random.default_rng(seed + 1)
    do = jnp.asarray(rng.standard_normal((B, Lq, Hq, D)), dtype)
    dlse = jnp.asarray(rng.standard_normal((B, Hq, Lq)), jnp.float32) if with_lse else None
    return do, dlse


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


# --- random problems -------------------------------------------------------------------------
# Fixed shapes per test (masks vary): compiled executables are reused across examples.
SHAPE = dict(B=2, Lq=37, Lkv=29, Hq=4, Hkv=2)


def _bounds(rng, L, n, max_size):
    """n + 1 strictly increasing bounds from 0 to L with blocks of at most ~max_size tokens
    (1-token blocks among them); ``n`` fixed so that device masks keep their shapes."""
    sizes = np.minimum(rng.integers(1, max_size + 1, size=n), L)
    cuts = np.unique(np.clip(np.cumsum(sizes)[:-1], 1, L - 1))
    while len(cuts) < n - 1:                                  # refill to n blocks
        cuts = np.unique(np.r_[cuts, rng.integers(1, L)])
    return np.r_[0, np.sort(cuts[: n - 1]), L]


@st.composite
def problems(draw, device=False):
    """Variable bounds (1-token blocks among them), shared or per-head masks (per-head bounds
    too for device masks), GQA (Hq = 4, Hkv = 2), empty rows, ragged Lq != Lkv, B = 2, lse
    returned (with its cotangent) or not."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Lq, Lkv, Hq = SHAPE["Lq"], SHAPE["Lkv"], SHAPE["Hq"]
    Hm = draw(st.sampled_from([1, Hq])) if not device else Hq
    nq, nk = (draw(st.integers(1, 9)), draw(st.integers(1, 9))) if not device else (6, 5)
    size = draw(st.sampled_from([1, 3, 12, 40]))
    per_head = device and draw(st.booleans())
    rows = Hm if per_head else 1
    qb = np.stack([_bounds(rng, Lq, nq, size) for _ in range(rows)])
    kb = np.stack([_bounds(rng, Lkv, nk, size) for _ in range(rows)])
    if not per_head:
        qb, kb = qb[0], kb[0]
    blocks = rng.random((Hm, nq, nk)) < draw(st.sampled_from([0.2, 0.6, 1.0]))
    if draw(st.booleans()):
        blocks[:, rng.integers(nq)] = False                  # a query block with no key
    return dict(mask=tj.BlockMask(qb, kb, blocks), with_lse=device or draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def _check_problem(case, fn, tol=2e-4, D=8, to_device=None):
    mask = case["mask"]
    B, Hq = SHAPE["B"], SHAPE["Hq"]
    q, k, v = random_qkv(B, mask.Lq, mask.Lkv, Hq, SHAPE["Hkv"], D, "float32", case["seed"])
    do, dlse = cotangents(B, mask.Lq, Hq, D, jnp.float32, case["seed"], case["with_lse"])
    want = oracle(q, k, v, mask, do, dlse)
    m = mask if to_device is None else to_device(mask)
    assert_grads(grads(fn, q, k, v, m, do, dlse), want[2:], tol,
                 atol=_rounding_atol(q, k, v, do))


def _rounding_atol(q, k, v, do) -> float:
    """Where dq or dk is 0 in exact arithmetic (every selecting row keeps one key: P = 1, so
    dS = P (dP - delta) = 0), float32 leaves the rounding of dP - delta, |dP| <= D |do| |v|,
    times scale |k| (|q|): an absolute bound of 8 float32 eps at that size."""
    D = q.shape[-1]
    big = lambda x: float(np.abs(np.asarray(x)).max())      # noqa: E731
    return 8 * float(np.finfo(np.float32).eps) * D * D ** -0.5 * big(do) * big(v) * max(
        big(k), big(q), 1.0)


# --- the XLA backward over plans -------------------------------------------------------------
@settings(max_examples=8)
@given(problems())
def test_host_plans_xla_gradients_match_float64(case):
    _check_problem(case, functools.partial(tj.sparse_attention, backend="xla"))


_jitted_xla = jax.jit(functools.partial(tj.sparse_attention, backend="xla"),
                      static_argnames=("return_lse",))


@settings(max_examples=5)
@given(problems(device=True))
def test_device_masks_xla_gradients_match_float64(case):
    """Device masks inside jit (traced blocks and bounds, per-head bounds: one compiled
    program for every example): the device planner's forward and transposed plans, or the
    exact path where a tile meets too many blocks for the bitmap capacity."""
    _check_problem(case, _jitted_xla, to_device=lambda m: tj.BlockMask(
        jnp.broadcast_to(jnp.asarray(m.q_bounds), (SHAPE["Hq"], m.blocks.shape[1] + 1)),
        jnp.broadcast_to(jnp.asarray(m.kv_bounds), (SHAPE["Hq"], m.blocks.shape[2] + 1)),
        jnp.asarray(m.blocks)))


def test_exact_path_backward_matches_float64(monkeypatch):
    """Past the bitmap budget a device mask runs the exact path, forward and backward."""
    rng = np.random.default_rng(3)
    qb = np.r_[np.arange(0, 40, 2), 40]
    kb = np.r_[0, 1, np.arange(3, 33, 3), 33]
    mask = tj.BlockMask(qb, kb, rng.random((2, len(qb) - 1, len(kb) - 1)) < 0.4)
    q, k, v = random_qkv(1, 40, 33, 2, 1, 8, "float32", 4)
    do, dlse = cotangents(1, 40, 2, 8, jnp.float32, 4, True)
    want = oracle(q, k, v, mask, do, dlse)
    calls = []
    monkeypatch.setattr(core, "exact_backward", functools.partial(
        lambda f, *a, **kw: calls.append(1) or f(*a, **kw), core.exact_backward))
    with pytest.warns(UserWarning, match="exact XLA path"):
        got = grads(tj.sparse_attention, q, k, v, tj.BlockMask(qb, kb, jnp.asarray(mask.blocks)),
                    do, dlse, options=tj.Options(bitmap_budget_bytes=64))
    assert calls, "the exact backward did not run"
    assert_grads(got, want[2:], 2e-4)


def test_transposed_plan_selects_the_transposed_mask():
    """The dk/dv plan is the host planner's plan of the transposed mask: the same selected
    interactions, keys as rows; cached per forward plan."""
    rng = np.random.default_rng(5)
    mask = tj.BlockMask([0, 1, 9, 40, 70], [0, 30, 31, 50], rng.random((3, 4, 3)) < 0.5)
    p = tj.plan(mask, (1, 70, 3, 16), (1, 50, 1, 16), jnp.float32, backend="xla")
    tp = host_plans.dkv_plan(p)
    assert tp is host_plans.dkv_plan(p)
    assert tp.selected_interactions == p.selected_interactions
    assert (tp.shape.q_len, tp.shape.kv_len) == (50, 70)
    np.testing.assert_array_equal(host_plans.transposed_mask(mask).token_mask(),
                                  np.swapaxes(mask.token_mask(), 1, 2))


def test_transposed_plan_takes_the_cheapest_policy():
    """Of ``Options.dkv_policies`` the dk/dv plan of least estimated time wins, whichever it
    is (cached per options)."""
    rng = np.random.default_rng(11)
    mask = tj.BlockMask.uniform(1024, 1024, 64, 64, rng.random((2, 16, 16)) < 0.15)
    p = tj.plan(mask, (1, 1024, 2, 64), (1, 1024, 2, 64), jnp.float32, backend="xla")
    est = {}
    for pols in (("merge",), ("pack",), ("merge", "pack")):
        opts = tj.Options(dkv_policies=pols, paired_dkv_policy=None)
        est[pols] = host_plans.dkv_score(host_plans.dkv_plan(p, "mosaic_gpu", opts), 1)
    assert est[("pack",)] != est[("merge",)]
    assert est[("merge", "pack")] == min(est[("pack",)], est[("merge",)])


def test_transposed_plan_pairs_64_token_blocks():
    """Mosaic GPU's dk/dv plan: paired 64-key units for 64-token blocks (128-key units would
    compute the union of two blocks' queries), 128-key units for 128-aligned blocks."""
    rng = np.random.default_rng(12)
    for block, tile in ((64, 64), (128, 128)):
        n = 2048 // block
        mask = tj.BlockMask.uniform(2048, 2048, block, block, rng.random((2, n, n)) < 0.15)
        p = tj.plan(mask, (1, 2048, 2, 64), (1, 2048, 2, 64), jnp.float32, backend="xla")
        assert host_plans.dkv_plan(p, "mosaic_gpu").tile_q == tile, block


def test_a_wrong_dk_fails_the_check(monkeypatch):
    """The checks can fail: dk / dv of the first head of each group only (no GQA sum) are
    caught, and so is a dq whose lse cotangent is dropped."""
    from pallas_kernels.xla import backward as xb
    q, k, v = random_qkv(1, 23, 19, 4, 2, 8, "float32", 9)
    mask = tj.BlockMask([0, 5, 23], [0, 11, 19], np.array([[[1, 0], [1, 1]]], bool))
    do, dlse = cotangents(1, 23, 4, 8, jnp.float32, 9, True)
    want = oracle(q, k, v, mask, do, dlse)
    fn = functools.partial(tj.sparse_attention, backend="xla")
    monkeypatch.setattr(backward_rows, "group_sum",
                        lambda x, hkv: x[:, :, ::x.shape[2] // hkv].astype(jnp.float32))
    xb.dkv.clear_cache()
    with pytest.raises(AssertionError, match="dk"):
        assert_grads(grads(fn, q, k, v, mask, do, dlse), want[2:], 2e-4)
    monkeypatch.undo()
    xb.dkv.clear_cache()
    got = grads(fn, q, k, v, mask, do, dlse)
    assert_grads(got, want[2:], 2e-4)
    with pytest.raises(AssertionError, match="dq"):
        assert_grads(got, oracle(q, k, v, mask, do)[2:], 2e-4)


# --- transforms with backend=None ------------------------------------------------------------
def test_grad_vjp_checkpoint_vmap_jit_with_backend_none():
    """jax.grad, jax.checkpoint, jax.vmap over jax.grad and jit(grad) of a device mask all give
    the oracle's gradients (backend=None: the XLA path on CPU; jax.vjp: the tests above)."""
    rng = np.random.default_rng(6)
    mask = tj.BlockMask([0, 1, 10, 24], [0, 7, 8, 21], rng.random((2, 3, 3)) < 0.7)
    q, k, v = random_qkv(3, 24, 21, 2, 1, 8, "float32", 6)
    w = jnp.asarray(rng.standard_normal(q.shape[1:]), jnp.float32)

    def loss(q, k, v, m=mask):                       # one batch element: [L, H, D]
        return jnp.sum(tj.sparse_attention(q[None], k[None], v[None], m)[0] * w)

    want = [oracle(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask, w[None])[2:] for i in range(3)]
    want = [np.concatenate([x[j] for x in want]) for j in range(3)]
    g = jax.grad(loss, (0, 1, 2))
    assert_grads([x[None] for x in g(q[0], k[0], v[0])], [x[:1] for x in want], 2e-4)
    ck = jax.grad(jax.checkpoint(loss), (0, 1, 2))
    assert_grads([x[None] for x in ck(q[1], k[1], v[1])], [x[1:2] for x in want], 2e-4)
    assert_grads(jax.vmap(g)(q, k, v), want, 2e-4)
    dev = tj.BlockMask(mask.q_bounds, mask.kv_bounds, jnp.asarray(mask.blocks))
    gj = jax.jit(jax.grad(loss, (0, 1, 2)))(q[2], k[2], v[2], dev)
    assert_grads([x[None] for x in gj], [x[2:] for x in want], 2e-4)


def test_check_grads():
    """jax.test_util.check_grads in reverse mode: the custom_vjp against finite differences."""
    from jax.test_util import check_grads
    mask = tj.BlockMask([0, 2, 9], [0, 5, 7], np.array([[[1, 1], [0, 1]]], bool))
    q, k, v = random_qkv(1, 9, 7, 2, 1, 4, "float32", 8)
    f = lambda q, k, v: tj.sparse_attention(q, k, v, mask, backend="xla")   # noqa: E731
    check_grads(f, (q, k, v), order=1, modes=("rev",), eps=1e-2, atol=2e-2, rtol=2e-2)


# --- the Triton backward (interpret mode) ----------------------------------------------------
def _fine_mask(rng, Lq, Lkv, Hm):
    """Blocks of 1 to ~40 tokens: plans of 64- and 128-token tiles hold grid steps (a tile
    meeting <= 4 blocks per axis) and bitmap steps (the 1-token key blocks)."""
    qb = np.r_[0, 3, 4, 30, Lq]
    kb = np.r_[0, 20, 40, 41, 42, 43, 44, 70, Lkv]
    blocks = rng.random((Hm, len(qb) - 1, len(kb) - 1)) < 0.6
    blocks[:, 2] = False                                  # rows 4..29 select no key
    return tj.BlockMask(qb, kb, blocks)


def _steps_kinds(*plans):
    """(grid steps, bitmap steps) summed over plans."""
    return tuple(sum(p.stats()[key] for p in plans) for key in ("grid_steps", "bitmap_steps"))


def test_triton_backward_host_plan():
    """The Triton kernels (interpret mode) through ``core.attention`` on a host plan of a Triton
    template (grid and bitmap steps, GQA, per-head mask, empty rows, lse cotangent), and under
    jax.vmap; float32 against the float64 oracle."""
    rng = np.random.default_rng(_seed("triton"))
    Lq, Lkv, Hq, Hkv, D = 70, 90, 2, 1, 16
    mask = _fine_mask(rng, Lq, Lkv, Hq)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "float32", 10)
    do, dlse = cotangents(1, Lq, Hq, D, jnp.float32, 10, True)
    want = oracle(q, k, v, mask, do, dlse, scale=0.3)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="triton_q128_kv64_w8_s3_pf_hm")
    tp = host_plans.dkv_plan(p)
    assert tp.tile_q == 64 and all(_steps_kinds(p, tp))
    got = grads(lambda q, k, v, m, return_lse: run(p, q, k, v, 0.3, return_lse),
                q, k, v, mask, do, dlse)
    assert_grads(got, want[2:], 1e-4)
    # jax.vmap of the gradient over two problems (the Pallas kernels' own batching rules,
    # the row-dot kernel's included).
    q2, k2, v2 = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "float32", 11)
    do2, _ = cotangents(1, Lq, Hq, D, jnp.float32, 11, False)
    fn = lambda q, k, v, m: run(p, q, k, v, 0.3, False)                     # noqa: E731
    got = jax.vmap(lambda q, k, v, do: grads(fn, q, k, v, mask, do))(
        *(jnp.stack([jnp.asarray(a), jnp.asarray(b)]) for a, b in ((q, q2), (k, k2), (v, v2),
                                                                   (do, do2))))
    for i, (qi, ki, vi, doi) in enumerate(((q, k, v, do), (q2, k2, v2, do2))):
        assert_grads([x[i] for x in got], oracle(qi, ki, vi, mask, doi, scale=0.3)[2:], 1e-4)


# --- the row-dot kernel (pallas_kernels.triton.delta) ----------------------------------------
@settings(max_examples=10, deadline=None)
@given(st.data())
def test_row_dots_kernel_equals_the_rowsum(data):
    """``row_dots`` (interpreted) is rowsum(out * dout) in float32 for ragged lengths (1 token,
    across the kernel's row blocks), head dims that are not a power of two and 2-byte dtypes."""
    from pallas_kernels.triton import delta as td
    B = data.draw(st.integers(1, 2))
    L = data.draw(st.sampled_from([1, 5, td.ROWS, td.ROWS + 1, 150]))
    H = data.draw(st.integers(1, 4))
    D = data.draw(st.sampled_from([8, 16, 72, 128]))
    dtype = data.draw(st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]))
    k1, k2 = jax.random.split(jax.random.key(data.draw(st.integers(0, 99))))
    o, g = (jax.random.normal(k, (B, L, H, D), dtype) for k in (k1, k2))
    got = np.asarray(td.row_dots(o, g, interpret=True))
    want = np.einsum("bqhd,bqhd->bhq", np.asarray(o, np.float64), np.asarray(g, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_row_dots_refuses_bad_input():
    from pallas_kernels.triton import delta as td
    x = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="one \\[B, L, H, D\\] shape"):
        td.row_dots(x, x[:, :4])
    with pytest.raises(TypeError, match="share a dtype"):
        td.row_dots(x, x.astype(jnp.float16))


def test_row_dots_lowers_with_token_major_operands():
    """Lowered for CUDA (an abstract H200), the row dots are a Triton custom call whose
    operands are row-major [B, L, H * D]: XLA must then keep the forward's gathered output
    token-major (no head-major copy beside it in a rematerialised step)."""
    import re
    from cuda_lowering import lower_for_h200
    from pallas_kernels.triton import delta as td
    x = jax.ShapeDtypeStruct((1, 300, 12, 128), jnp.bfloat16)
    text = lower_for_h200(functools.partial(td._row_dots, interpret=False), x, x)
    call = next(ln for ln in text.splitlines() if "__gpu$xla.gpu.triton" in ln)
    assert re.search(r"operand_layouts = \[dense<\[2, 1, 0\]> : tensor<3xindex>, "
                     r"dense<\[2, 1, 0\]> : tensor<3xindex>\]", call), call


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_backward_row_dots_by_backend(backend):
    """The GPU backends' backward takes delta from the row-dot kernel; the XLA one from jnp."""
    rng = np.random.default_rng(_seed("rowdots"))
    mask = _fine_mask(rng, 70, 90, 2)
    q, k, v = random_qkv(1, 70, 90, 2, 1, 16, "float32", 11)
    tmpl = {"triton": "triton_q128_kv64_w8_s3_pf_hm", "xla": None}[backend]
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template=tmpl, backend=backend)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: run(p, q, k, v, 0.3, False).sum()))(q)
    assert ("tessera_row_dots" in str(jaxpr)) == (backend == "triton")


def _primitives(jaxpr, out=None):
    """Names of the primitives in a jaxpr and its sub-jaxprs (not inside Pallas kernels)."""
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        if eqn.primitive.name != "pallas_call":
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                _primitives(sub, out)
    return out


def test_host_plan_backward_gathers_through_constants():
    """Under ``jax.checkpoint`` a host plan's row gathers use host constants (token-major
    row_index, unit row indices): no scatter rebuilds row_index from units inside the program
    (XLA ran them, and kept them live, in every recomputed block: ~3 MB a layer at Wan 480p),
    while a plan without a host row_index still makes it on the device."""
    rng = np.random.default_rng(_seed("consts"))
    Lq, Lkv, Hq, Hkv, D = 70, 90, 2, 1, 16
    mask = _fine_mask(rng, Lq, Lkv, Hq)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "float32", 13)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="triton_q128_kv64_w8_s3_pf_hm")

    def prims(plan):
        f = jax.checkpoint(lambda q, k, v: core.attention(q, k, v, plan, 0.3, False))
        g = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))
        return _primitives(jax.make_jaxpr(g)(q, k, v).jaxpr)

    assert "scatter" not in prims(host_plans.attention_plan(p))
    # The same pass plans without host row maps (as a device plan has them).
    bare = AttentionPlan(host_pass(p), host_pass(host_plans.dkv_plan(p)), template=p.template,
                         backend="triton")
    assert "scatter" in prims(bare)


def test_unsupported_derivatives_name_themselves():
    """Differentiating a GPU backend's backward (a second-order derivative) raises an error
    that says so, not jax's 'Differentiation rule for ... not implemented' (raised when the
    second derivative is traced, before any kernel runs; the XLA path differentiates again);
    forward mode is refused by name (jax's custom_vjp message)."""
    mask = tj.BlockMask([0, 5, 16], [0, 16], np.ones((1, 2, 1), bool))
    q, k, v = random_qkv(1, 16, 16, 1, 1, 16, "float32", 11)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="triton_q128_kv64_w8_s3_pf_hm")
    inner = jax.grad(lambda q: jnp.sum(run(p, q, k, v, 0.25, False) ** 2))
    with pytest.raises(NotImplementedError, match="second-order gradients .* 'triton'"):
        jax.grad(lambda q: jnp.sum(inner(q)))(q)
    xla = jax.grad(lambda q: jnp.sum(tj.sparse_attention(q, k, v, mask, backend="xla") ** 2))
    assert np.isfinite(np.asarray(jax.grad(lambda q: jnp.sum(xla(q)))(q))).all()
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda q: tj.sparse_attention(q, k, v, mask), (q,), (q,))


# --- the Mosaic GPU backward (interpreter) ---------------------------------------------------
# On a CPU the kernels run under the Mosaic GPU interpreter (``Options.interpret`` None).
needs_interp = pytest.mark.skipif(INTERPRET is None, reason="no Mosaic GPU interpreter")


@needs_interp
@pytest.mark.parametrize("template", ["mgpu_q128_kv64_s2_hm", "mgpu_q128_kv64x2_s2_hm"])
def test_mosaic_backward_host_plan(template):
    """dq over a 128 x 64 forward plan (step pairs: two steps a stage, each half masked by its
    own kind) and dk/dv over the 128 x 64 transposed plan (paired units off:
    ``test_mosaic_paired_dkv`` runs those), both with grid and bitmap steps; f16, GQA,
    per-head mask, empty rows, lse cotangent."""
    opts = tj.Options(paired_dkv_policy=None)
    rng = np.random.default_rng(_seed("mosaic"))
    Lq, Lkv, Hq, Hkv, D = 136, 90, 2, 1, 64
    mask = _fine_mask(rng, Lq, Lkv, Hq)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "float16", 12)
    do, dlse = cotangents(1, Lq, Hq, D, jnp.float16, 12, True)
    want = oracle(q, k, v, mask, do, dlse)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template=template)
    tp = host_plans.dkv_plan(p, options=opts)
    assert (tp.tile_q, tp.tile_kv) == (128, 64) and all(_steps_kinds(p, tp))
    got = grads(lambda q, k, v, m, return_lse: run(p, q, k, v, D ** -0.5, return_lse, opts),
                q, k, v, mask, do, dlse)
    assert_grads(got, want[2:], 1.5e-2)


@needs_interp
def test_mosaic_backward_gather_plan():
    """A gather plan end to end on Mosaic GPU: the forward's and dq's gathered stages, dk/dv
    over the transposed plan; bf16, GQA, per-head clusters, lse cotangent."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gather import mask_var_clusters

    Lq, Lkv, Hq, Hkv, D = 200, 232, 2, 1, 64
    mask = mask_var_clusters(Lq, Hq, q_mean=60, kv_mean=20, density=0.3, seed=6, kv_len=Lkv)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "bfloat16", 15)
    do, dlse = cotangents(1, Lq, Hq, D, jnp.bfloat16, 15, True)
    want = oracle(q, k, v, mask, do, dlse)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="mgpu_q128_kv128_s2_gather",
                policy="gather")
    assert p.stats()["gather_steps"] > 0
    got = grads(lambda q, k, v, m, return_lse: run(p, q, k, v, D ** -0.5, return_lse),
                q, k, v, mask, do, dlse)
    assert_grads(got, want[2:], 2e-2)


@needs_interp
def test_mosaic_paired_dkv(monkeypatch):
    """The paired dk/dv kernel (64-key units, two per CTA, one Q/dO ring per warpgroup) over
    the transposed mask's 64 x 64 pack plan: an odd unit count, grid and bitmap steps, GQA,
    per-head mask, empty rows."""
    from pallas_kernels import abi, templates
    from pallas_kernels import backward_rows as rows
    from pallas_kernels.mosaic import backward as mb
    from pallas_kernels.mosaic import ops as mosaic_ops
    rng = np.random.default_rng(_seed("paired dkv"))
    Lq, Lkv, Hq, Hkv, D = 136, 130, 2, 1, 64           # 7 units
    mask = _fine_mask(rng, Lq, Lkv, Hq)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "bfloat16", 14)
    do, _ = cotangents(1, Lq, Hq, D, jnp.bfloat16, 14, False)
    want = oracle(q, k, v, mask, do)
    tp = build_plan(host_plans.transposed_mask(mask), (1, Lkv, Hq, D), (1, Lq, Hq, D), q.dtype,
                    tile_q=64, tile_kv=64, policy="pack", q_align=8, kv_align=8,
                    unit_order="head_major")
    assert tp.num_units % 2 == 1 and all(_steps_kinds(tp))
    lse = rows.lse_for_backward(jnp.asarray(want[1], jnp.float32))
    delta = jnp.asarray(np.einsum("bqhd,bqhd->bhq", want[0], np.asarray(do, np.float64)),
                        jnp.float32)
    tpp = abi.PassPlan(tp.units, tp.steps, None, 64, 64, tp.q_len_padded, tp.kv_len_padded,
                       tp.max_steps)
    dk, dv = mosaic_ops.dkv(q, k, v, do, lse, delta, tpp,
                            template=templates.get("mgpu_q64x2_kv64_s2_hm"), scale=D ** -0.5,
                            interpret=INTERPRET)
    assert_grads([want[2], dk, dv], want[2:], 2e-2)
    from pallas_kernels.mosaic import kernel as mk
    assert mb.smem_bytes("dkv", 64, 128, rings=2) <= mk.MAX_SMEM      # two Q/dO rings fit

    # The device route on a 64-key template plans dk/dv for the paired kernel too.
    from tessera_jax.validation import check_qkv
    t = device_route.dispatch.get_template("mgpu_q64x2_kv64_s2_hm")
    assert device_route.dkv_tiles(t, D) == (64, 64)
    dev = tj.BlockMask(mask.q_bounds, mask.kv_bounds, jnp.asarray(mask.blocks))
    # The exact fallback gives zeros here, so only the kernels' gradients can pass.
    monkeypatch.setattr(core, "exact_backward",
                        lambda q, k, v, *a, **kw: (jnp.zeros_like(q), jnp.zeros_like(k),
                                                   jnp.zeros_like(v)))
    got = grads(lambda q, k, v, m: device_route.attention(
        q, k, v, m, check_qkv(q, k, v), "mosaic_gpu", t, D ** -0.5, False), q, k, v, dev, do)
    assert_grads(got, want[2:], 2e-2)


@needs_interp
def test_mosaic_backward_paired_dq_and_device_route():
    """The dq kernel on a paired plan (tile_q = 64, two units per CTA, an odd unit count), the
    device route (traced blocks) on the kv128 template, and jax.vmap of grad; bf16."""
    from pallas_kernels import abi, templates
    from pallas_kernels import backward_rows as rows
    from pallas_kernels.mosaic import ops as mosaic_ops
    from tessera_jax.validation import check_qkv
    rng = np.random.default_rng(_seed("paired"))
    Lq, Lkv, Hq, Hkv, D = 136, 130, 3, 1, 64
    blocks = rng.random((1, 3, 5)) < 0.6
    blocks[:, :, 0] = True
    mask = tj.BlockMask.uniform(Lq, Lkv, 64, 32, blocks)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "bfloat16", 13)
    do, _ = cotangents(1, Lq, Hq, D, jnp.bfloat16, 13, False)
    want = oracle(q, k, v, mask, do)
    p = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=64, tile_kv=64, policy="pack",
                   q_align=8, kv_align=8, template="mgpu_q64x2pp_kv64_s2_hm")
    assert p.num_units % 2 == 1
    lse = rows.lse_for_backward(jnp.asarray(want[1], jnp.float32))
    delta = jnp.asarray(np.einsum("bqhd,bqhd->bhq", want[0], np.asarray(do, np.float64)),
                        jnp.float32)
    pp = abi.PassPlan(p.units, p.steps, None, p.tile_q, p.tile_kv, p.q_len_padded,
                      p.kv_len_padded, p.max_steps)
    dq = mosaic_ops.dq(q, k, v, do, lse, delta, pp, template=templates.get(p.template),
                       scale=D ** -0.5, interpret=INTERPRET)
    assert_grads([dq, want[3], want[4]], want[2:], 2e-2)

    # The device route (plans of traced blocks; two query heads, one K/V head), and a host
    # plan and the device route under jax.vmap over two problems: one folded kernel call of
    # batch 2 (runtime.batching).
    mask = tj.BlockMask.uniform(128, 120, 64, 32, blocks[:, :2, :4])
    qs, ks, vs, dos = (jnp.stack([x[:, :L, :2], x[:, ::-1][:, :L, :2]])
                       for x, L in ((q, 128), (k, 120), (v, 120), (do, 128)))
    t = device_route.dispatch.get_template("mgpu_q128_kv128_s2_hm")
    dev = tj.BlockMask(mask.q_bounds, mask.kv_bounds, jnp.asarray(mask.blocks))
    got = grads(lambda q, k, v, m: device_route.attention(
        q, k, v, m, check_qkv(q, k, v), "mosaic_gpu", t, D ** -0.5, False),
        qs[0], ks[0], vs[0], dev, dos[0])
    assert_grads(got, oracle(qs[0], ks[0], vs[0], mask, dos[0])[2:], 2e-2)
    p = tj.plan(mask, qs[0].shape, ks[0].shape, qs.dtype, template=t.name)
    fn = lambda q, k, v, m: run(p, q, k, v, D ** -0.5, False)               # noqa: E731
    got = jax.vmap(lambda q, k, v, do: grads(fn, q, k, v, mask, do))(qs, ks, vs, dos)
    for i in range(2):
        want = oracle(qs[i], ks[i], vs[i], mask, dos[i])
        assert_grads([x[i] for x in got], want[2:], 2e-2)
    fn = lambda q, k, v, m: device_route.attention(                           # noqa: E731
        q, k, v, m, check_qkv(q, k, v), "mosaic_gpu", t, D ** -0.5, False)
    got = jax.vmap(lambda q, k, v, do: grads(fn, q, k, v, dev, do))(qs, ks, vs, dos)
    for i in range(2):
        want = oracle(qs[i], ks[i], vs[i], mask, dos[i])
        assert_grads([x[i] for x in got], want[2:], 2e-2)


def test_fold_vmap_folds_tensors_and_maps_batched_plans():
    """``runtime.batching.fold_vmap``: batched tensors run one call of the folded batch;
    batched plan arrays one call per element."""
    from tessera_jax.runtime import batching
    calls = []

    def fn(x, y, *plan):
        calls.append(x.shape)
        return x * y + (plan[0].sum() if plan else 0)

    x, y, p = jnp.ones((3, 2, 4)), jnp.full((2, 4), 2.0), jnp.arange(3 * 5).reshape(3, 5)
    out = jax.vmap(lambda x: batching.fold_vmap(fn, (x, y)))(x)
    assert calls[-1] == (6, 4) and out.shape == (3, 2, 4) and (out == 2).all()
    out = jax.vmap(lambda x, p: batching.fold_vmap(fn, (x, y), (p,)))(x, p)
    np.testing.assert_array_equal(out[:, 0, 0], 2 + p.sum(1))


def test_host_dkv_plan_is_made_on_the_first_backward_only(monkeypatch):
    """A forward-only request (eager or traced) makes no dk/dv plan; the first backward makes
    it once (cached per forward plan)."""
    made = []
    real = host_plans.dkv_plan
    monkeypatch.setattr(host_plans, "dkv_plan", lambda p, *a: made.append(p) or real(p, *a))
    rng = np.random.default_rng(21)
    mask = tj.BlockMask([0, 9, 20, 33], [0, 7, 19, 30], rng.random((2, 3, 3)) < 0.6)
    q, k, v = random_qkv(1, 33, 30, 2, 1, 8, "float32", 21)
    f = functools.partial(tj.sparse_attention, mask=mask, backend="xla")
    f(q, k, v)
    jax.jit(f)(q, k, v)
    assert not made
    g = jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2))
    g(q)
    g(q + 1)
    assert len({id(p) for p in made}) == 1


def test_one_custom_vjp_in_the_tree():
    """The runtime's core (``runtime.core``) is the one ``jax.custom_vjp`` of the library and
    the kernels: every route differentiates through it."""
    import pathlib
    import re
    root = pathlib.Path(tj.__file__).resolve().parents[1]
    uses = [f"{p.relative_to(root)}:{i}" for d in ("tessera_jax", "pallas_kernels")
            for p in sorted((root / d).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"jax\.custom_vjp\s*[,)(]|@custom_vjp|custom_vjp\(", line)]
    assert [u.split(":")[0] for u in uses] == ["tessera_jax/runtime/core.py"], uses


@needs_interp
def test_step_pairs_device_route_forward_and_gradients(monkeypatch):
    """The step-pairs template on the device route (traced blocks of SpargeAttn's shape: 128-row
    query blocks, 64-key blocks, ragged last blocks, odd and even step counts, an empty query
    block, GQA): the forward runs two kv64 plan steps a stage, dq and dk/dv the kv64 plan's
    own kernels; out and every gradient against the float64 oracle (the exact fallback gives
    zeros, so only the kernels can pass)."""
    from tessera_jax.validation import check_qkv
    rng = np.random.default_rng(_seed("step_pairs"))
    Lq, Lkv, Hq, Hkv, D = 328, 300, 2, 1, 64
    qb = np.r_[np.arange(0, Lq, 128), Lq]
    kb = np.r_[np.arange(0, Lkv, 64), Lkv]
    blocks = rng.random((Hq, len(qb) - 1, len(kb) - 1)) < 0.55
    blocks[0, 1] = False
    blocks[1, 1, :3] = True                      # odd and even counts across units
    mask = tj.BlockMask(qb, kb, blocks)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, "bfloat16", 23)
    do, _ = cotangents(1, Lq, Hq, D, jnp.bfloat16, 23, False)
    want = oracle(q, k, v, mask, do)
    t = device_route.dispatch.get_template("mgpu_q128_kv64x2_s2_hm")
    dev = tj.BlockMask(qb, kb, jnp.asarray(blocks))
    monkeypatch.setattr(core, "exact_backward",
                        lambda q, k, v, *a, **kw: (jnp.zeros_like(q), jnp.zeros_like(k),
                                                   jnp.zeros_like(v)))

    def fn(q, k, v, m):
        return device_route.attention(q, k, v, m, check_qkv(q, k, v), "mosaic_gpu", t,
                                      D ** -0.5, False)

    out = jax.jit(fn)(q, k, v, dev)
    err = np.linalg.norm(np.asarray(out, np.float64) - want[0]) / np.linalg.norm(want[0])
    assert err < 2e-2, err
    assert_grads(grads(fn, q, k, v, dev, do), want[2:], 2e-2)
