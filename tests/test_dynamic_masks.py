"""Dynamic (content-dependent) mask builders, ``tessera_jax.masks.dynamic`` (issue 17 item 1).

Each builder is exact against a NumPy float64 implementation of the same rule
(``tests/dynamic_oracles.py``) on random inputs: rows whose decision is within ``DELTA`` of flipping
(a near-tie of the float32 scores) are left out of the comparison, and most rows must be
compared. Each runs inside ``jax.jit``, traces once for several inputs, lowers without a host
callback, and ``tj.sparse_attention`` with the built mask equals ``tj.reference_attention``
with the same mask on the host. Negative controls: the same comparisons fail for a rule off by
one (top-k with k - 1, inclusive instead of exclusive cumulative sums). The kernel options
(``top_k``, ``pool``, ``score_precision``, ``kmeans_assign``, ``kv_order``) are rule fields,
set through the rules.
"""

import functools
import re

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import jax
import jax.numpy as jnp

import dynamic_oracles as oracles
import tessera_jax as tj
from tessera_jax.masks import dynamic as dm
from tessera_jax.masks.dynamic import clustering, svg2 as svg2_mod

TOL = dict(atol=2e-5, rtol=2e-5)
DELTA = 2e-5          # rows closer than this to flipping are near-ties of float32 vs float64


def _data(seed, B, Lq, Lkv, Hq, Hkv, D, structured=True):
    """q, k, v (float32). ``structured``: tokens in runs around shared 'topic' vectors with a
    per-run noise level, so blocks range from self-similar to not (SpargeAttn's judgment) and
    scores have structure; else i.i.d. normal."""
    rng = np.random.default_rng(seed)

    def one(L, H):
        if not structured:
            return rng.standard_normal((B, L, H, D))
        out = np.empty((B, L, H, D))
        p = 0
        while p < L:
            n = int(rng.integers(4, 40))
            amp = rng.choice([0.15, 0.6, 0.8, 2.0])
            topic = rng.standard_normal((B, 1, H, D))
            out[:, p:p + n] = topic + amp * rng.standard_normal((B, min(n, L - p), H, D))
            p += n
        return out

    q, k, v = one(Lq, Hq), one(Lkv, Hkv), rng.standard_normal((B, Lkv, Hkv, D))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _compare_rows(got, want, margin, min_frac=0.5):
    """Blocks [H, nq, nk] equal on every row whose margin is >= DELTA (most of them)."""
    got = np.asarray(got)
    ok = np.asarray(margin) >= DELTA
    assert ok.mean() >= min_frac, f"only {ok.mean():.2f} of the rows are not near-ties"
    np.testing.assert_array_equal(got[ok], want[ok])


def _lowered_has_no_callback(f, *args):
    text = jax.jit(f).lower(*args).as_text().lower()
    assert "callback" not in text


# The exactness tests draw shapes and static arguments from small sets (each new combination
# compiles the builder once).

# --- VSA -----------------------------------------------------------------------------------
_vsa_jit = jax.jit(dm.vsa_mask, static_argnames="rule")


@st.composite
def vsa_cases(draw):
    layout = draw(st.sampled_from(["uniform", "cubes", "cross"]))
    kw = {}
    if layout == "uniform":
        B, Lq, Lkv, Hq, Hkv = 1, 136, 136, 4, 2               # 17 blocks of 8
        kw["block"] = 8
    elif layout == "cubes":
        order, bounds = dm.cube_layout((3, 5, 7), (2, 2, 4))   # 105 tokens, partial cubes
        B, Lq, Lkv, Hq, Hkv = 2, len(order), len(order), 2, 2
        kw["q_bounds"] = tuple(int(b) for b in bounds)
    else:
        B, Lq, Lkv, Hq, Hkv = 1, 100, 77, 2, 1
        kw["q_bounds"] = (0, 9, 30, 31, 64, 100)
        kw["kv_bounds"] = (0, 20, 22, 50, 77)
    choice = draw(st.sampled_from(["keep", "topk", "local"]))
    if choice == "keep":
        kw["keep"] = draw(st.sampled_from([None, 0.3]))
    elif choice == "topk" or layout == "cross":
        kw["topk"] = draw(st.sampled_from([1, 3]))
    else:
        kw["topk"], kw["local"] = 4, 1
    return dict(B=B, Lq=Lq, Lkv=Lkv, Hq=Hq, Hkv=Hkv, kw=kw,
                seed=draw(st.integers(0, 2**31 - 1)),
                structured=draw(st.booleans()))


def _vsa_k(n_kv, kw):
    keep = kw.get("keep") or 0.125
    return kw["topk"] if "topk" in kw else max(1, int(np.ceil(keep * n_kv - 1e-9)))


@pytest.mark.parametrize("top_k", ["xla", "pallas"])
@settings(max_examples=20)
@given(case=vsa_cases())
def test_vsa_mask_equals_numpy_rule(top_k, case):
    """Against NumPy, with ``lax.top_k`` and with the fused Triton top-k (interpreted)."""
    q, k, _ = _data(case["seed"], case["B"], case["Lq"], case["Lkv"], case["Hq"], case["Hkv"], 16,
                    case["structured"])
    m = _vsa_jit(q, k, dm.VSA(top_k=top_k, **case["kw"]))
    assert not m.is_static
    qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
    kk = _vsa_k(len(kb) - 1, case["kw"])
    want, margin = oracles.numpy_vsa(q, k, qb, kb, kk, case["kw"].get("local"))
    _compare_rows(m.blocks, want, margin)
    assert (np.asarray(m.blocks).sum(-1) == kk).all()             # uniform rows
    if kk > 1:                                                    # negative control: k - 1
        wrong, _ = oracles.numpy_vsa(q, k, qb, kb, kk - 1, case["kw"].get("local"))
        assert not np.array_equal(np.asarray(m.blocks), wrong)


@pytest.mark.parametrize("top_k", ["xla", "pallas"])
def test_vsa_top_k_ties_go_to_the_lower_index(top_k):
    """Equal pooled scores (identical key blocks): ``lax.top_k`` (and the fused kernel) keeps
    the lowest indices, as the NumPy rule's stable sort; +inf (``local``) blocks count towards
    k."""
    q, k, _ = _data(2, 1, 64, 64, 2, 1, 8)
    k = jnp.tile(k[:, :8], (1, 8, 1, 1))                       # 8 equal key blocks of 8
    b = np.asarray(_vsa_jit(q, k, dm.VSA(block=8, topk=3, top_k=top_k)).blocks)
    assert (b[..., :3].all()) and not b[..., 3:].any()
    b = np.asarray(_vsa_jit(q, k, dm.VSA(block=8, topk=3, local=1, top_k=top_k)).blocks)
    i = np.arange(8)
    forced = np.abs(i[:, None] - i[None, :]) <= 1
    assert (b.sum(-1) == 3).all() and b[:, forced].all()
    rest = b & ~forced[None]                                   # the non-forced pick: lowest
    first_free = np.argmax(~forced, axis=-1)
    rows = forced.sum(-1) < 3
    assert (rest[:, rows].sum(-1) == 1).all()
    np.testing.assert_array_equal(np.argmax(rest[:, rows], axis=-1),
                                  np.broadcast_to(first_free[rows], (2, rows.sum())))


def test_vsa_local_blocks_are_kept_and_count_towards_k():
    q, k, _ = _data(1, 1, 96, 96, 2, 1, 8)
    m = _vsa_jit(q, k, dm.VSA(block=8, topk=5, local=2))
    b = np.asarray(m.blocks)
    i = np.arange(12)
    assert b[:, np.abs(i[:, None] - i[None, :]) <= 2].all()
    assert (b.sum(-1) == 5).all()


# --- the fused top-k (pallas_kernels.triton.topk; the rules' top_k) ---------------------
def _top_k_set(x, k):
    """bool mask of the indices ``lax.top_k`` returns."""
    _, idx = jax.lax.top_k(jnp.asarray(x), k)
    m = np.zeros(np.shape(x), bool)
    np.put_along_axis(m, np.asarray(idx), True, axis=-1)
    return m


@st.composite
def top_k_rows(draw):
    """Rows [3, n] (n a power of two or not) with many ties, signed zeros, infinities; a k
    from a small set (k is static: each one compiles the interpreted kernel)."""
    n = draw(st.sampled_from([1, 5, 16, 37, 130]))
    k = draw(st.sampled_from(sorted({c for c in (1, 2, n // 3 + 1, n - 1, n) if 1 <= c <= n})))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["ints", "normal", "zeros", "tiny"]))
    if kind == "ints":                                    # heavy ties
        x = rng.integers(-2, 3, (3, n)).astype(np.float32)
    elif kind == "normal":
        x = rng.standard_normal((3, n)).astype(np.float32)
    elif kind == "zeros":                                 # +0.0 and -0.0 only: all ties
        x = np.where(rng.random((3, n)) < 0.5, -0.0, 0.0).astype(np.float32)
    else:                                                 # subnormals and huge values
        x = rng.choice(np.array([1e-45, -1e-45, 3e38, -3e38, 1.0, -1.0], np.float32), (3, n))
    special = np.array([np.inf, -np.inf, -0.0, 0.0], np.float32)
    hit = rng.random((3, n)) < draw(st.sampled_from([0.0, 0.2]))
    x = np.where(hit, rng.choice(special, (3, n)), x).astype(np.float32)
    return x, k


@settings(max_examples=30, deadline=None)
@given(top_k_rows())
def test_fused_top_k_keeps_the_set_of_lax_top_k(case):
    """The Triton top-k (interpreted) keeps exactly ``lax.top_k``'s indices: ties (equal
    values, infinities) to the lower index, -0.0 below +0.0 (``lax.top_k``'s total order), k
    entries a row."""
    from pallas_kernels.triton import topk as tt
    x, k = case
    got = np.asarray(tt.topk_mask(jnp.asarray(x), k, interpret=True))
    np.testing.assert_array_equal(got, _top_k_set(x, k))
    assert (got.sum(-1) == k).all()


def test_fused_top_k_ties_go_to_the_lower_index_in_3d():
    """A batch [H, n, n] of all-equal rows (and of 2-valued rows): the first k per tie group,
    as ``lax.top_k``; a tie rule picking the higher index fails here."""
    from pallas_kernels.triton import topk as tt
    x = np.zeros((2, 3, 40), np.float32)
    x[1, :, ::4] = 1.0                                    # 10 ones, 30 zeros a row
    for k in (1, 7, 13, 39):
        got = np.asarray(tt.topk_mask(jnp.asarray(x), k, interpret=True))
        np.testing.assert_array_equal(got, _top_k_set(x, k))
    assert got[0, 0, :39].all() and not got[0, 0, 39]
    with pytest.raises(ValueError, match="k must be in"):
        tt.topk_mask(jnp.asarray(x), 41)
    with pytest.raises(ValueError, match="float32"):
        tt.topk_mask(jnp.asarray(x, jnp.bfloat16), 3)


def _cpu_hlo(f, *args) -> str:
    """The optimized CPU HLO of ``jax.jit(f)``, without source metadata."""
    text = jax.jit(f).lower(*args).compile().as_text()
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n[\s\S]*?\n\n", "",
                  text, flags=re.M)
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def _vsa_blocks(rule):
    def blocks(q, k):
        return dm.vsa_mask(q, k, rule).blocks
    return blocks


def _sparge_blocks(rule):
    def blocks(q, k):
        return dm.sparge_mask(q, k, rule).blocks
    return blocks


def _kmeans_labels(assign):
    def blocks(x, c):
        return dm.kmeans(x, c, iters=1, assign=assign)[0]
    return blocks


_KERNEL_OPTION_CASES = {
    "vsa top_k": (lambda o: _vsa_blocks(dm.VSA(block=8, topk=2, top_k=o, pool="xla")), "f32"),
    "vsa pool": (lambda o: _vsa_blocks(dm.VSA(block=8, topk=2, top_k="xla", pool=o)), "bf16"),
    "sparge top_k": (lambda o: _sparge_blocks(dm.Sparge(block_q=8, block_kv=8, topk=0.3,
                                                        top_k=o, pool="xla")), "f32"),
    "sparge pool": (lambda o: _sparge_blocks(dm.Sparge(block_q=8, block_kv=8, top_k="xla",
                                                       pool=o)), "bf16"),
    "kmeans assign": (_kmeans_labels, "kmeans"),
}

_TRITON_CALL, _MOSAIC_CALL = "__gpu$xla.gpu.triton", "@mosaic_gpu"


def _option_args(kind):
    """Arguments each kernel takes (the Mosaic ones: 2-byte inputs, H * F a multiple of 256
    for pooling, F a multiple of 64 for the assignment)."""
    if kind == "kmeans":
        return jnp.zeros((1, 64, 64), jnp.bfloat16), jnp.zeros((1, 3, 64))
    dt = jnp.bfloat16 if kind == "bf16" else jnp.float32
    return jnp.zeros((1, 64, 2, 128), dt), jnp.zeros((1, 64, 2, 128), dt)


@pytest.mark.parametrize("case", list(_KERNEL_OPTION_CASES))
def test_kernel_options_auto_follow_the_compilation_platform(case, monkeypatch):
    """A kernel option "auto" (the default) is the Mosaic GPU kernel when the computation is
    compiled for a GPU (lowered here for an abstract H200: a Mosaic GPU call, no Triton call)
    and exactly XLA's ops elsewhere (CPU: the same optimized HLO as "xla"); "triton" (or its
    old name "pallas") is the Triton kernel everywhere (interpreted off a GPU), "mosaic" the
    Mosaic one (interpreted in a process without a GPU: a GPU process stands in for the
    lowering), "xla" never a kernel."""
    from cuda_lowering import lower_for_h200
    from pallas_kernels import contract
    make, kind = _KERNEL_OPTION_CASES[case]
    args = _option_args(kind)
    for option, want in (("auto", _MOSAIC_CALL), ("triton", _TRITON_CALL),
                         ("pallas", _TRITON_CALL), ("xla", None)):
        text = lower_for_h200(make(option), *args)
        for call in (_TRITON_CALL, _MOSAIC_CALL):
            assert (call in text) == (call == want), (option, call)
    assert "pallas_call" in str(jax.make_jaxpr(make("pallas"))(*args))
    assert "pallas_call" not in str(jax.make_jaxpr(make("xla"))(*args))
    assert _cpu_hlo(make("auto"), *args) == _cpu_hlo(make("xla"), *args)
    with monkeypatch.context() as m:
        m.setattr(contract, "default_interpret", lambda: False)
        text = lower_for_h200(make("mosaic"), *args)
    assert _MOSAIC_CALL in text and _TRITON_CALL not in text


def test_kernel_option_auto_takes_triton_before_hopper(monkeypatch):
    """On a GPU older than Hopper (compute capability 8.x: Ampere/Ada) "auto" takes the
    Triton kernels, which run there; on Hopper and without a visible GPU, Mosaic GPU's."""
    from cuda_lowering import lower_for_h200
    from tessera_jax.runtime import dispatch
    make, kind = _KERNEL_OPTION_CASES["vsa top_k"]
    args = _option_args(kind)
    calls = {"triton": _TRITON_CALL, "mosaic": _MOSAIC_CALL}
    for cc, family in (((8, 9), "triton"), ((8, 0), "triton"), ((9, 0), "mosaic"),
                       (None, "mosaic")):
        monkeypatch.setattr(dispatch, "_gpu_capability", lambda cc=cc: cc)
        assert dm.common.kernel_family("auto") == family
        text = lower_for_h200(make("auto"), *args)
        assert [f for f, call in calls.items() if call in text] == [family], cc


def test_kernel_options_are_checked_and_long_rows_take_xla():
    """Unknown option values are refused naming the field; rows longer than the top-k kernels'
    ``MAX_COLS`` take ``lax.top_k`` even with a kernel named."""
    from pallas_kernels.triton import topk as tt
    for make, field in ((lambda: dm.VSA(top_k="cuda"), "top_k"),
                        (lambda: dm.Sparge(pool="mgpu"), "pool"),
                        (lambda: dm.VSA(score_precision="bf16"), "score_precision"),
                        (lambda: dm.SVG2(kmeans_assign="kernel"), "kmeans_assign"),
                        (lambda: dm.SVG2(kv_order="random"), "kv_order")):
        with pytest.raises(ValueError, match=f"{field} must be one of"):
            make()
    with pytest.raises(ValueError, match="assign must be one of"):
        dm.kmeans(jnp.zeros((1, 8, 4)), jnp.zeros((1, 3, 4)), iters=1, assign="cuda")
    n = tt.MAX_COLS + 1
    q = jax.ShapeDtypeStruct((1, n, 1, 4), jnp.float32)
    for option in ("pallas", "mosaic"):
        for f in (_vsa_blocks(dm.VSA(block=1, topk=2, top_k=option, pool="xla")),
                  _sparge_blocks(dm.Sparge(block_q=64, block_kv=1, topk=0.3, top_k=option))):
            assert "pallas_call" not in str(jax.make_jaxpr(f)(q, q))


def test_a_rule_option_changed_between_calls_of_a_jitted_function_takes_effect():
    """Rules are static arguments (hashable): a changed option is a new cache entry, traced
    again, whose computation follows it."""
    traces = []

    @functools.partial(jax.jit, static_argnames="rule")
    def f(q, k, rule):
        traces.append(rule)
        return dm.vsa_mask(q, k, rule).blocks

    q, k, _ = _data(0, 1, 64, 64, 2, 1, 8)
    high, highest = dm.VSA(block=8, topk=2), dm.VSA(block=8, topk=2, score_precision="highest")
    f(q, k, high)
    f(q, k, highest)
    f(q, k, dm.VSA(block=8, topk=2))                          # equal rule: the cached one
    assert traces == [high, highest]
    assert "precision = [HIGHEST" not in f.lower(q, k, high).as_text()
    assert "precision = [HIGHEST" in f.lower(q, k, highest).as_text()


@pytest.mark.parametrize("seed", range(3))
def test_sparge_top_k_fused_equals_sort(seed):
    """``sparge_mask(topk=...)``: the fused top-k (interpreted) keeps the blocks of the stable
    descending sort exactly (p has ties at 0: blocks that are not self-similar)."""
    q, k, _ = _data(seed, 1, 120, 100, 4, 2, 16)
    kw = dict(block_q=16, block_kv=8, topk=0.25, sim_threshold=0.3 + 0.3 * (seed == 2),
              smooth_k=seed != 1)
    got = {t: np.asarray(_sparge_jit(q, k, dm.Sparge(top_k=t, **kw)).blocks)
           for t in ("xla", "pallas")}
    np.testing.assert_array_equal(got["pallas"], got["xla"])


def test_fused_top_k_lowers_to_triton():
    """No GPU here, but the kernel must lower through the real Triton path (not interpret):
    lower for CUDA with an abstract H200 and check the Triton custom call is emitted."""
    from cuda_lowering import lower_for_h200
    from pallas_kernels.triton import topk as tt
    for shape, k in [((12, 624, 624), 78), ((40, 1440, 1440), 180), ((2, 4096), 5)]:
        f = functools.partial(tt._topk_mask, k=k, interpret=False)
        assert "__gpu$xla.gpu.triton" in lower_for_h200(f, jax.ShapeDtypeStruct(shape,
                                                                                 jnp.float32))


# --- the block-pooling kernel (pallas_kernels.triton.pool; the rules' pool) ---------------
@settings(max_examples=12, deadline=None)
@given(st.data())
def test_block_sums_kernel_equals_the_sum(data):
    """``block_sums`` (interpreted) gives each block's float32 sum of bf16 / f32 x (up to the
    order of the additions), for random partitions (1-token blocks, blocks up to MAX_BLOCK) and
    column counts that are not a multiple of the chunk."""
    from pallas_kernels.triton import pool as tp
    sizes = data.draw(st.lists(st.sampled_from([1, 3, 16, 64, 77, tp.MAX_BLOCK]),
                               min_size=1, max_size=6))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    H, F = data.draw(st.sampled_from([(1, 8), (3, 16), (5, 200)]))
    dtype = data.draw(st.sampled_from([jnp.bfloat16, jnp.float32]))
    x = jax.random.normal(jax.random.key(data.draw(st.integers(0, 99))),
                          (2, int(bounds[-1]), H, F), dtype)
    got = np.asarray(tp.block_sums(x, bounds, interpret=True))
    want = np.stack([np.asarray(x[:, a:b], np.float32).sum(axis=1)
                     for a, b in zip(bounds[:-1], bounds[1:])], axis=1)
    # Float32 sums in another order: ~n * eps * |x| apart (a row missed or added: ~1).
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-4)


def test_block_sums_refuses_bad_bounds():
    from pallas_kernels.triton import pool as tp
    x = jnp.zeros((1, 10, 1, 4))
    for b in ([0, 5, 9], [0, 5, 5, 10], [1, 10]):
        with pytest.raises(ValueError, match="bounds must increase"):
            tp.block_sums(x, np.array(b))
    with pytest.raises(ValueError, match="blocks of at most"):
        tp.block_sums(jnp.zeros((1, tp.MAX_BLOCK + 1, 1, 4)), np.array([0, tp.MAX_BLOCK + 1]))


def test_pool_option_keeps_the_masks():
    """``pool="pallas"`` (interpreted) builds the same VSA and SpargeAttn masks as XLA's
    pooling on cube-layout bounds, the kernel taking 2-byte q and k only (float32 arrays stay
    with XLA)."""
    _, b = dm.cube_layout((3, 6, 7))
    q, k = (x.astype(jnp.bfloat16) for x in _data(3, 1, int(b[-1]), int(b[-1]), 2, 2, 16)[:2])
    got = {}
    for mode in ("xla", "pallas"):
        fs = (_vsa_blocks(dm.VSA(q_bounds=b, topk=3, pool=mode)),
              _sparge_blocks(dm.Sparge(block_q=16, block_kv=8, topk=0.3, pool=mode)))
        got[mode] = [np.asarray(jax.jit(f)(q, k)) for f in fs]
        for f in fs:
            for x, kernel in ((q, mode == "pallas"), (q.astype(jnp.float32), False)):
                text = str(jax.make_jaxpr(f)(x, x))
                assert ("tessera_block_sums" in text) == kernel, (mode, x.dtype)
    for a, c in zip(got["xla"], got["pallas"]):
        np.testing.assert_array_equal(a, c)


def test_score_precision_option():
    """``score_precision`` sets the VSA and SpargeAttn score matmuls' precision."""
    q, k = jnp.ones((1, 32, 2, 8)), jnp.ones((1, 32, 2, 8))
    for mode, want in (("highest", "HIGHEST"), ("high", "HIGH")):
        for f in (_vsa_blocks(dm.VSA(block=8, topk=2, score_precision=mode)),
                  _sparge_blocks(dm.Sparge(block_q=8, block_kv=8, topk=0.5,
                                           score_precision=mode))):
            text = str(jax.make_jaxpr(f)(q, k))
            assert f"precision=(Precision.{want}, Precision.{want})" in text, text[:2000]


def test_block_sums_lowers_to_triton():
    """The pooling kernel lowers through the real Triton path for an abstract H200."""
    from cuda_lowering import lower_for_h200
    from pallas_kernels.triton import pool as tp
    _, b = dm.cube_layout((21, 45, 80))
    f = functools.partial(tp._block_sums, bounds=tuple(int(v) for v in b), interpret=False)
    x = jax.ShapeDtypeStruct((1, int(b[-1]), 40, 128), jnp.bfloat16)
    assert "__gpu$xla.gpu.triton" in lower_for_h200(f, x)


def test_cube_layout_orders_tokens_cube_major():
    order, bounds = dm.cube_layout((3, 5, 6), (2, 2, 4))
    assert sorted(order.tolist()) == list(range(90))
    assert bounds[0] == 0 and bounds[-1] == 90 and (np.diff(bounds) > 0).all()
    t, h, w = np.unravel_index(order, (3, 5, 6))
    cube = (t // 2) * 6 + (h // 2) * 2 + w // 4                    # 3 x 2 cubes per frame pair
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert len(set(cube[a:b].tolist())) == 1
    assert np.diff(bounds).max() == 16 and np.diff(bounds).min() == 2


# --- SpargeAttn ----------------------------------------------------------------------------
_sparge_jit = jax.jit(dm.sparge_mask, static_argnames="rule")


@st.composite
def sparge_cases(draw):
    mode = draw(st.sampled_from(["cdf", "cdf_min", "topk"]))
    B, Hq, Hkv = {"cdf": (1, 2, 1), "cdf_min": (2, 2, 2), "topk": (1, 4, 2)}[mode]
    sim = draw(st.sampled_from([0.6, 0.3]))
    kw = dict(block_q=16, block_kv=8, sim_threshold=sim, smooth_k=sim > 0.5)
    if mode == "cdf":
        kw["cdf_threshold"] = 0.9
    elif mode == "cdf_min":
        kw["cdf_threshold"], kw["min_keep"] = 0.6, 3
    else:
        kw["topk"], kw["sink"] = 0.25, True
    return dict(B=B, Hq=Hq, Hkv=Hkv, kw=kw, seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=20)
@given(sparge_cases())
def test_sparge_mask_equals_numpy_rule(case):
    Lq, Lkv = 120, 100                                         # partial last blocks
    q, k, _ = _data(case["seed"], case["B"], Lq, Lkv, case["Hq"], case["Hkv"], 16)
    m = _sparge_jit(q, k, dm.Sparge(**case["kw"]))
    qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
    assert (np.diff(qb[:-1]) == 16).all() and qb[-1] == Lq and kb[-1] == Lkv
    kw = {x: y for x, y in case["kw"].items() if x not in ("block_q", "block_kv")}
    want, margin = oracles.numpy_sparge(q, k, qb, kb, **kw)
    _compare_rows(m.blocks, want, margin, min_frac=0.3)
    # negative control: mass before the block (cdf), or one block fewer a row (topk)
    wrong, _ = oracles.numpy_sparge(q, k, qb, kb, **_off_by_one_sparge(kw, len(kb) - 1))
    ok = (margin >= DELTA)[..., None] & (want != wrong)
    if ok.any():
        assert not np.array_equal(np.asarray(m.blocks)[ok], wrong[ok])


def _off_by_one_sparge(kw, nk):
    """``oracles.numpy_sparge`` arguments of a deliberately wrong rule: the exclusive cumulative sum,
    or with ``topk`` one block fewer per row (int(topk * nk) - 1)."""
    if "topk" not in kw:
        return dict(kw, inclusive=False)
    c = max(1, int(kw["topk"] * nk))
    assert c > 1
    return dict(kw, topk=(c - 0.5) / nk)


@pytest.mark.parametrize("kw", [{"cdf_threshold": 0.9, "sim_threshold": 0.3, "smooth_k": False},
                                {"topk": 0.25, "sim_threshold": 0.3, "smooth_k": False}],
                         ids=["cdf", "topk"])
def test_sparge_negative_control_detects_an_off_by_one_rule(kw):
    """The comparison above catches SpargeAttn's rule read as 'mass before the block', and a
    top-k that keeps one block fewer per row."""
    caught = 0
    for seed in range(3):
        q, k, _ = _data(seed, 1, 120, 100, 2, 1, 16)
        m = _sparge_jit(q, k, dm.Sparge(block_q=16, block_kv=8, **kw))
        qb, kb = np.asarray(m.q_bounds), np.asarray(m.kv_bounds)
        _, margin = oracles.numpy_sparge(q, k, qb, kb, **kw)
        wrong, _ = oracles.numpy_sparge(q, k, qb, kb, **_off_by_one_sparge(kw, len(kb) - 1))
        ok = margin >= DELTA
        caught += not np.array_equal(np.asarray(m.blocks)[ok], wrong[ok])
    assert caught == 3


def test_sparge_self_similarity_gives_dense_stripes():
    """Blocks of unrelated tokens (not self-similar) keep full rows / columns."""
    q, k, _ = _data(3, 1, 64, 64, 1, 1, 16, structured=False)  # cosine ~ 1/n: none similar
    m = _sparge_jit(q, k, dm.Sparge(block_q=16, block_kv=16))
    assert np.asarray(m.blocks).all()
    m = _sparge_jit(q, k, dm.Sparge(block_q=16, block_kv=16, sim_threshold=-1.0,
                                    cdf_threshold=0.5))
    assert not np.asarray(m.blocks).all()


# --- XAttention ----------------------------------------------------------------------------
_xattn_jit = jax.jit(dm.xattn_mask, static_argnames="rule")


@st.composite
def xattn_cases(draw):
    stride = draw(st.sampled_from([4, 8]))
    # lengths off the block and the stride, GQA, B = 2
    B, Lq, Lkv, Hq, Hkv = (1, 128, 128, 2, 1) if stride == 4 else (2, 117, 90, 2, 2)
    diag, sink, chunk = draw(st.sampled_from([(False, False, None), (True, True, 3),
                                              (False, True, None)]))
    kw = dict(block=16, stride=stride, tau=draw(st.sampled_from([0.9, 0.6])),
              keep_diagonal=diag, keep_sink=sink, chunk_blocks=chunk)
    return dict(B=B, Lq=Lq, Lkv=Lkv, Hq=Hq, Hkv=Hkv, kw=kw,
                seed=draw(st.integers(0, 2**31 - 1)), structured=draw(st.booleans()))


@settings(max_examples=20)
@given(xattn_cases())
def test_xattn_mask_equals_numpy_rule(case):
    q, k, _ = _data(case["seed"], case["B"], case["Lq"], case["Lkv"], case["Hq"], case["Hkv"], 8,
                    case["structured"])
    m = _xattn_jit(q, k, dm.XAttention(**case["kw"]))
    kw = {x: y for x, y in case["kw"].items() if x != "chunk_blocks"}
    want, margin = oracles.numpy_xattn(q, k, **kw)
    _compare_rows(m.blocks, want, margin)
    wrong, _ = oracles.numpy_xattn(q, k, exclusive=False, **kw)   # negative control
    differ = (margin >= DELTA)[..., None] & (want != wrong)
    assert differ.any()
    assert not np.array_equal(np.asarray(m.blocks)[differ], wrong[differ])


# --- SVG2 ----------------------------------------------------------------------------------
_kmeans_jit = jax.jit(dm.kmeans, static_argnames=("iters", "assign"))


@settings(max_examples=20)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 3, 6]), st.sampled_from(["xla", "pallas"]))
def test_kmeans_equals_numpy(seed, iters, assign):
    """k-means against NumPy: the XLA assignment and the Triton assignment kernel (interpreted;
    70 points and 37 clusters: ragged point and centroid tiles)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 70, 8)) + 2 * rng.integers(0, 3, (2, 70, 1)),
                    jnp.float32)
    C = 37 if assign == "pallas" else 5
    c0 = jnp.asarray(np.asarray(x)[:, rng.choice(70, C, replace=False)])
    lab, c = _kmeans_jit(x, c0, iters=iters, assign=assign)
    want_lab, want_c, margin = oracles.numpy_kmeans(np.asarray(x), np.asarray(c0), iters)
    assume(margin >= 1e-4)
    np.testing.assert_array_equal(np.asarray(lab), want_lab)
    np.testing.assert_allclose(np.asarray(c), want_c, atol=1e-5, rtol=1e-5)


def test_svg2_attention_gradient_with_the_fused_assignment():
    """The Triton assignment has no autodiff rule: its inputs are cut from the gradient (the
    labels are piecewise constant), so gradients through ``svg2_attention`` equal the XLA
    assignment's."""
    q, k, v = _data(5, 1, 48, 40, 2, 1, 8)
    state = _svg2_state(q, k, (3, 4))
    grads = {}
    for assign in ("xla", "pallas"):
        rule = dm.SVG2(iters=1, top_p=0.5, kmeans_assign=assign)
        grads[assign] = jax.jit(jax.grad(
            lambda q: dm.svg2_attention(q, k, v, state, rule)[0].sum()))(q)
    assert np.abs(np.asarray(grads["xla"])).sum() > 0
    np.testing.assert_allclose(np.asarray(grads["pallas"]), np.asarray(grads["xla"]), **TOL)


def test_triton_assign_matches_xla_and_breaks_ties_low():
    """The Triton assignment (interpreted) equals ``_assign`` on ragged bf16 / f32 shapes, and
    a centroid repeated in a later centroid tile never wins over its first copy."""
    from pallas_kernels.triton import kmeans as tk
    rng = np.random.default_rng(4)
    for dt in (jnp.float32, jnp.bfloat16):
        x = rng.standard_normal((2, 150, 24))
        c = rng.standard_normal((2, 100, 24)).astype(np.float32)
        c[:, 90] = c[:, 3]                       # exact duplicate in the second 64-tile
        x[:, :5] = c[:, 3:4]                     # points on it
        x, c = jnp.asarray(x, dt), jnp.asarray(c)
        got = np.asarray(tk.assign(x, c, interpret=True))
        np.testing.assert_array_equal(got, np.asarray(jax.vmap(clustering._assign)(x, c)))
        assert (got == 3).any() and not (got == 90).any()
    with pytest.raises(ValueError, match="assign: x must be"):
        tk.assign(jnp.zeros((2, 5, 4)), jnp.zeros((2, 3, 8)))


SVG2_SHAPE = dict(B=1, Lq=96, Lkv=80, Hq=4, Hkv=2, D=8)
SVG2_C = (5, 7)
_svg2_jit = jax.jit(dm.svg2_mask, static_argnames="rule")


_init_jit = jax.jit(dm.svg2_init, static_argnames="rule")


def _svg2_state(q, k, C=SVG2_C, seed=0):
    return _init_jit(q, k, jax.random.key(seed),
                     dm.SVG2(q_clusters=C[0], kv_clusters=C[1], init_iters=2))


def _token_mask(lay, Lq, Lkv, group):
    """The builder's mask on token level over the original order, [Hq, Lq, Lkv]."""
    qb, kb = np.asarray(lay.mask.q_bounds), np.asarray(lay.mask.kv_bounds)
    blocks = np.asarray(lay.mask.blocks)
    qp, kp = np.asarray(lay.q_perm), np.asarray(lay.kv_perm)
    out = np.zeros((blocks.shape[0], Lq, Lkv), bool)
    for h in range(blocks.shape[0]):
        qid = np.searchsorted(qb[h], np.arange(Lq), side="right") - 1
        kid = np.searchsorted(kb[h], np.arange(Lkv), side="right") - 1
        out[h][np.ix_(qp[h], kp[h // group])] = blocks[h][qid][:, kid]
    return out


def _check_layout(lay, labels_q, labels_k, L, C, m, group):
    """Valid per-head layouts: permutations, C strictly increasing blocks from 0 to L, each
    block within one cluster group, blocks of >= m tokens where the split has room."""
    for perm, bounds, labels in ((lay.q_perm, lay.mask.q_bounds, labels_q),
                                 (lay.kv_perm, lay.mask.kv_bounds, labels_k)):
        perm, bounds = np.asarray(perm), np.asarray(bounds)
        for h in range(perm.shape[0]):
            assert sorted(perm[h].tolist()) == list(range(perm.shape[1]))
            lab = labels[h][perm[h]]                             # clusters contiguous:
            assert np.count_nonzero(np.diff(lab)) == len(np.unique(lab)) - 1  # one run each
        for h in range(bounds.shape[0]):
            b = bounds[h]
            assert b[0] == 0 and b[-1] == perm.shape[1] and (np.diff(b) > 0).all()
    for bounds, n, c in ((lay.mask.q_bounds, L[0], C[0]), (lay.mask.kv_bounds, L[1], C[1])):
        assert np.asarray(bounds).shape[-1] == c + 1
        if n >= (2 * m - 1) * c:
            assert np.diff(np.asarray(bounds), axis=-1).min() >= m


@settings(max_examples=12)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 12]))
def test_svg2_mask_equals_numpy_rule_on_tokens(seed, m):
    s, top_p = SVG2_SHAPE, 0.7
    q, k, _ = _data(seed, s["B"], s["Lq"], s["Lkv"], s["Hq"], s["Hkv"], s["D"])
    state = _svg2_state(q, k, seed=seed % 7)
    lay = _svg2_jit(q, k, state, dm.SVG2(top_p=top_p, min_cluster_tokens=m))
    tok, ql, kl, qc, kc, margin = oracles.numpy_svg2(
        q, k, state.q_centroids, state.kv_centroids, top_p=top_p, min_cluster_tokens=m)
    assume(margin >= DELTA)
    g = s["Hq"] // s["Hkv"]
    np.testing.assert_array_equal(_token_mask(lay, s["Lq"], s["Lkv"], g), tok)
    np.testing.assert_allclose(np.asarray(lay.state.q_centroids), qc, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lay.state.kv_centroids), kc, atol=1e-5, rtol=1e-5)
    _check_layout(lay, ql, kl, (s["Lq"], s["Lkv"]), SVG2_C, m, g)
    wrong = oracles.numpy_svg2(q, k, state.q_centroids, state.kv_centroids, top_p=top_p,
                           min_cluster_tokens=m, exclusive=False)[0]
    if not np.array_equal(wrong, tok):                        # negative control
        assert not np.array_equal(_token_mask(lay, s["Lq"], s["Lkv"], g), wrong)


def test_svg2_kv_group_order_by_popularity():
    """Key groups by how many query groups select them (summed over a key head's query heads),
    ties in label order, empty group ids last."""
    merged = np.zeros((2, 3, 5), bool)          # 2 query heads on one key head, 4 groups
    merged[0, :, 2] = True                       # group 2: 3 + 1 selections
    merged[1, 0, 2] = True
    merged[0, 0, 1] = merged[1, 1, 1] = True     # group 1: 2
    merged[1, 2, 3] = True                       # group 3: 1; group 0: 0
    merged[:, :, 4] = True                       # id 4 >= n_groups: last whatever it holds
    order = svg2_mod._kv_group_order(jnp.asarray(merged), jnp.asarray([4]), 2)
    np.testing.assert_array_equal(np.asarray(order), [[2, 1, 3, 0, 4]])


def test_svg2_kv_order_keeps_the_token_mask():
    """The key-group order moves tokens, never the selection: the popularity layout (the
    default ``kv_order``) gives the NumPy rule's token-level mask, the same as the layout with
    the groups in label order, with no more selected runs per query block than that one."""
    s = SVG2_SHAPE
    q, k, _ = _data(3, s["B"], s["Lq"], s["Lkv"], s["Hq"], s["Hkv"], s["D"])
    state = _svg2_state(q, k, seed=3)
    g = s["Hq"] // s["Hkv"]
    toks, runs = {}, {}
    for order in ("label", "popularity"):
        lay = _svg2_jit(q, k, state, dm.SVG2(top_p=0.5, min_cluster_tokens=1, kv_order=order))
        toks[order] = _token_mask(lay, s["Lq"], s["Lkv"], g)
        b = np.asarray(lay.mask.blocks)
        runs[order] = np.sum(b[..., 1:] & ~b[..., :-1]) + np.sum(b[..., 0])
    tok, *_, margin = oracles.numpy_svg2(q, k, state.q_centroids, state.kv_centroids,
                                         top_p=0.5, min_cluster_tokens=1)
    assert margin >= DELTA
    np.testing.assert_array_equal(toks["popularity"], tok)
    np.testing.assert_array_equal(toks["label"], toks["popularity"])
    assert 0 < tok.mean() < 1
    assert runs["popularity"] < runs["label"]


def test_svg2_negative_control_detects_an_off_by_one_rule():
    s = SVG2_SHAPE
    differs = 0
    for seed in range(4):
        q, k, _ = _data(seed, s["B"], s["Lq"], s["Lkv"], s["Hq"], s["Hkv"], s["D"])
        state = _svg2_state(q, k)
        lay = _svg2_jit(q, k, state, dm.SVG2(top_p=0.7, min_cluster_tokens=1))
        wrong = oracles.numpy_svg2(q, k, state.q_centroids, state.kv_centroids, top_p=0.7,
                               exclusive=False)[0]
        differs += not np.array_equal(_token_mask(lay, s["Lq"], s["Lkv"], 2), wrong)
    assert differs >= 3


def test_svg2_layout_never_breaks_on_bad_data():
    """NaN inputs: still permutations and strictly increasing bounds (nothing out of
    bounds; the attention call gets a valid layout)."""
    s = SVG2_SHAPE
    q, k, _ = _data(0, s["B"], s["Lq"], s["Lkv"], s["Hq"], s["Hkv"], s["D"])
    state = _svg2_state(q, k)
    q = q.at[0, :10].set(jnp.nan)
    k = k.at[0, 3].set(jnp.inf)
    lay = _svg2_jit(q, k, state, dm.SVG2(top_p=0.7, min_cluster_tokens=1))
    for perm, bounds, L in ((lay.q_perm, lay.mask.q_bounds, s["Lq"]),
                            (lay.kv_perm, lay.mask.kv_bounds, s["Lkv"])):
        perm, bounds = np.asarray(perm), np.asarray(bounds)
        assert all(sorted(p.tolist()) == list(range(L)) for p in perm)
        assert (bounds[:, 0] == 0).all() and (bounds[:, -1] == L).all()
        assert (np.diff(bounds, axis=-1) > 0).all()


def test_permute_and_unpermute_are_inverse():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 30, 3, 4)), jnp.float32)
    perm = jnp.asarray(np.stack([rng.permutation(30) for _ in range(3)]), jnp.int32)
    y = dm.permute(x, perm)
    np.testing.assert_array_equal(np.asarray(y)[:, :, 1], np.asarray(x)[:, np.asarray(perm)[1], 1])
    np.testing.assert_array_equal(np.asarray(dm.unpermute(y, perm)), np.asarray(x))


# --- inside jit: one trace, no callback, attention equals the reference -------------------
def _assert_attention_under_jit(build, shapes, seeds=(0, 1, 2)):
    """``build(q, k)`` -> BlockMask, inside one jitted layer with sparse_attention: traced
    once for several inputs, no callback, output equal to the reference on the host mask."""
    traces = []

    @jax.jit
    def layer(q, k, v):
        traces.append(1)
        m = build(q, k)
        return tj.sparse_attention(q, k, v, m), m

    for seed in seeds:
        q, k, v = _data(seed, *shapes)
        out, m = layer(q, k, v)
        ref = tj.reference_attention(q, k, v, m.to_host())
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    assert len(traces) == 1
    _lowered_has_no_callback(layer, q, k, v)


def test_vsa_attention_under_jit():
    _assert_attention_under_jit(lambda q, k: dm.vsa_mask(q, k, dm.VSA(block=48, keep=0.4)),
                                (1, 192, 192, 4, 2, 16))
    order, bounds = dm.cube_layout((2, 6, 10), (2, 4, 4))      # cubes of 32, 16, 24, 12, 8
    _assert_attention_under_jit(lambda q, k: dm.vsa_mask(q, k, dm.VSA(q_bounds=bounds, topk=3)),
                                (2, 120, 120, 2, 2, 16), seeds=(3, 4))


def test_sparge_attention_under_jit():
    rule = dm.Sparge(block_q=64, block_kv=48, cdf_threshold=0.8)
    _assert_attention_under_jit(lambda q, k: dm.sparge_mask(q, k, rule),
                                (1, 200, 150, 2, 1, 16))


def test_xattn_attention_under_jit():
    rule = dm.XAttention(block=64, stride=8, tau=0.8)
    _assert_attention_under_jit(lambda q, k: dm.xattn_mask(q, k, rule),
                                (1, 200, 176, 2, 2, 16))


def test_svg2_attention_in_a_compiled_loop_equals_the_reference_on_tokens():
    """svg2_attention in a lax.scan over steps (state carried), traced once for several
    inputs, no callback; each step's output equals the reference attention on the original
    (un-permuted) tensors with the NumPy rule's token-level mask."""
    B, Lq, Lkv, Hq, Hkv, D = 2, 96, 80, 4, 2, 8
    traces, compared = [], 0

    @jax.jit
    def loop(qs, ks, vs, state):
        traces.append(1)

        def step(st, qkv):
            out, st2 = dm.svg2_attention(*qkv, st, dm.SVG2(iters=2, top_p=0.7))
            return st2, (out, st.q_centroids, st.kv_centroids)

        return jax.lax.scan(step, state, (qs, ks, vs))

    for seed in (0, 1):
        steps = [_data(10 * seed + i, B, Lq, Lkv, Hq, Hkv, D) for i in range(2)]
        qs, ks, vs = (jnp.stack(x) for x in zip(*steps))
        state = _svg2_state(qs[0], ks[0], seed=seed)
        final, (outs, qcs, kcs) = loop(qs, ks, vs, state)
        for i, (q, k, v) in enumerate(steps):
            tok, _, _, qc, kc, margin = oracles.numpy_svg2(q, k, qcs[i], kcs[i], top_p=0.7)
            if margin < DELTA:                                 # a near-tie: not comparable
                continue
            compared += 1
            ref = tj.reference_attention(q, k, v, tj.BlockMask(np.arange(Lq + 1),
                                                               np.arange(Lkv + 1), tok))
            np.testing.assert_allclose(np.asarray(outs[i]), np.asarray(ref), **TOL)
            if i == len(steps) - 1:
                np.testing.assert_allclose(np.asarray(final.kv_centroids), kc, atol=1e-5,
                                           rtol=1e-5)
    assert len(traces) == 1 and compared >= 3
    _lowered_has_no_callback(loop, qs, ks, vs, state)


def test_builders_lower_without_callbacks():
    q, k, _ = _data(0, 1, 64, 64, 2, 1, 8)
    _lowered_has_no_callback(lambda q, k: dm.vsa_mask(q, k, dm.VSA(block=16)).blocks, q, k)
    _lowered_has_no_callback(_sparge_blocks(dm.Sparge(block_q=16, block_kv=8)),
                             q, k)
    _lowered_has_no_callback(
        lambda q, k: dm.xattn_mask(q, k, dm.XAttention(block=16, stride=4)).blocks, q, k)
    state = _svg2_state(q, k, (4, 4))
    _lowered_has_no_callback(lambda q, k, s: dm.svg2_mask(q, k, s).mask.blocks, q, k, state)
    _lowered_has_no_callback(lambda q, k: dm.svg2_init(
        q, k, jax.random.key(0), dm.SVG2(q_clusters=4, kv_clusters=4)), q, k)


# --- argument errors name the argument ------------------------------------------------------
def test_errors_name_the_argument():
    q, k, v = _data(0, 1, 64, 64, 4, 2, 8)
    state = _svg2_state(q, k, (4, 4))
    cases = [
        (lambda: dm.vsa_mask(q, k, dm.VSA(keep=1.5)), ValueError, "keep must be in"),
        (lambda: dm.vsa_mask(q, k, dm.VSA(keep=0.2, topk=2)), ValueError, "keep or topk, not both"),
        (lambda: dm.vsa_mask(q, k, dm.VSA(block=16, topk=9)), ValueError, "topk must be in"),
        (lambda: dm.vsa_mask(q, k, dm.VSA(block=16, topk=2, local=1)), ValueError, "local=1"),
        (lambda: dm.vsa_mask(q, k, dm.VSA(q_bounds=jnp.arange(0, 65, 16))), TypeError,
         "q_bounds must be static"),
        (lambda: dm.vsa_mask(q, k, dm.VSA(q_bounds=[0, 32, 60])), ValueError,
         "q_bounds must end at the sequence length 64"),
        (lambda: dm.vsa_mask(q, k, dm.VSA(block=0)), ValueError, "block must be >= 1"),
        (lambda: dm.vsa_mask(q[0], k), ValueError, r"q must be \[B, Lq, Hq, D\]"),
        (lambda: dm.vsa_mask(q, k[:, :, :1].repeat(3, 2)), ValueError, "multiple of k's heads"),
        (lambda: dm.vsa_mask(q, k, scale=-1.0), ValueError, "scale must be a positive"),
        (lambda: dm.sparge_mask(q, k, dm.Sparge(cdf_threshold=0)), ValueError,
         "cdf_threshold must be in"),
        (lambda: dm.sparge_mask(q, k, dm.Sparge(sim_threshold=2)), ValueError,
         "sim_threshold must be in"),
        (lambda: dm.sparge_mask(q, k, dm.Sparge(smooth_k=1)), TypeError, "smooth_k must be a bool"),
        (lambda: dm.sparge_mask(q, k, dm.Sparge(block_kv=16, min_keep=5)), ValueError,
         "min_keep must be"),
        (lambda: dm.xattn_mask(q, k, dm.XAttention(block=20, stride=8)), ValueError,
         "block=20 must be a multiple of stride=8"),
        (lambda: dm.xattn_mask(q, k, dm.XAttention(tau=1.2)), ValueError, "tau must be in"),
        (lambda: dm.xattn_mask(q, k, dm.XAttention(stride=2.0)), TypeError,
         "stride must be an int"),
        (lambda: dm.svg2_init(q, k, jax.random.key(0), dm.SVG2(q_clusters=65)), ValueError,
         "q_clusters=65 exceeds the sequence length 64"),
        (lambda: dm.svg2_mask(q, k, (state.q_centroids, state.kv_centroids)), TypeError,
         "state must be an SVG2State"),
        (lambda: dm.svg2_mask(q, k, state, dm.SVG2(top_p=0)), ValueError, "top_p must be in"),
        (lambda: dm.svg2_mask(q, k, state, dm.SVG2(min_cluster_tokens=0)), ValueError,
         "min_cluster_tokens must be >= 1"),
        (lambda: dm.svg2_mask(q, k, dm.SVG2State(state.q_centroids[..., :4],
                                                 state.kv_centroids)), ValueError,
         r"state.q_centroids has shape \(4, 4, 4\), expected \[4, C, 8\]"),
        (lambda: dm.svg2_attention(q, k, v[0], state), ValueError, "v must be"),
        (lambda: dm.permute(q, jnp.zeros((4, 63), jnp.int32)), ValueError,
         r"perm has shape \(4, 63\)"),
        (lambda: dm.permute(q, jnp.zeros((4, 64))), TypeError, "perm must hold integers"),
        (lambda: dm.kmeans(svg2_mod._features(q), state.q_centroids, iters=-1), ValueError,
         "iters must be >= 0"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()
