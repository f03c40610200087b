"""Mask features, ranking tables and per-request selection (fallbacks included)."""

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import templates

import tessera_jax as tj
from tessera_jax.select import features as F
from tessera_jax.select import ranking as S
from tessera_jax.tools import profiler as P
from tessera_jax.validation import check_shapes

# The Mosaic GPU templates of the static table (pallas_kernels.templates).
MGPU = [t.name for t in templates.for_backend("mosaic_gpu")]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """Each test: its own (empty) table directory and no cached tables, choices or warnings."""
    monkeypatch.setenv("TESSERA_JAX_PLAN_TABLES", str(tmp_path / "tables"))
    (tmp_path / "tables").mkdir()
    S.clear_caches()
    F.clear_cache()
    yield
    S.clear_caches()
    getattr(S._current_device, "cache_clear", lambda: None)()


def _shape(mask, D=128, dtype="bfloat16", H=None):
    H = H or mask.num_heads
    return check_shapes((1, mask.Lq, H, D), (1, mask.Lkv, H, D), dtype)


def _fake_gpu(monkeypatch, name, cc="9.0"):
    monkeypatch.setattr(S, "_current_device", lambda: (name, cc))


# --- features -------------------------------------------------------------------------------
def test_features_all_selected_uniform():
    n = 8
    m = tj.BlockMask.uniform(n * 64, n * 64, 64, 64, np.ones((1, n, n), bool))
    f = F.mask_features(m)
    assert set(f) == set(F.FEATURE_NAMES)
    assert f["density"] == 1.0 and f["block_density"] == 1.0
    assert f["row_cv"] == 0.0 and f["row_max_mean"] == 1.0 and f["empty_rows"] == 0.0
    assert f["runs_per_row"] == 1.0
    assert f["log2_run_tokens"] == pytest.approx(math.log2(n * 64))
    assert f["contiguity"] == pytest.approx((n - 1) / n)
    assert f["same_rows"] == 1.0
    assert f["kv_mult64"] == 1.0 and f["kv_mult128"] == 0.0 and f["q_mult64"] == 1.0
    assert f["log2_kv_block"] == 6.0 and f["log2_q_block"] == 6.0
    assert f["kv_partial64"] == 0.0 and f["kv_partial128"] == 1.0
    assert f["run_offgrid64"] == 0.0 and f["run_offgrid128"] == 0.0   # the run is 512 tokens
    assert f["q_partial128"] == 1.0 and f["head_density_cv"] == 0.0
    assert f["log2_q_tiles"] == pytest.approx(math.log2(n * 64 / 128))


def test_features_diagonal():
    n = 10
    m = tj.BlockMask.uniform(n * 128, n * 128, 128, 128, np.eye(n, dtype=bool)[None])
    f = F.mask_features(m)
    assert f["density"] == pytest.approx(1 / n) and f["block_density"] == pytest.approx(1 / n)
    assert f["runs_per_row"] == 1.0 and f["contiguity"] == 0.0 and f["same_rows"] == 0.0
    assert f["log2_run_tokens"] == 7.0 and f["row_cv"] == 0.0
    assert f["kv_partial128"] == 0.0 and f["run_offgrid128"] == 0.0 and f["q_partial128"] == 0.0


def test_features_variable_blocks_and_heads():
    b = np.array([0, 64, 100, 228, 256])
    blocks = np.zeros((2, 4, 4), bool)
    blocks[0, :, 1] = True          # head 0: the 36-token block for every row
    blocks[1] = True                # head 1: everything
    m = tj.BlockMask(b, b, blocks)
    f = F.mask_features(m)
    assert f["kv_mult64"] == pytest.approx(2 / 4) and f["kv_mult128"] == pytest.approx(1 / 4)
    assert f["density"] == pytest.approx(m.density)
    d = np.array([36 / 256, 1.0])
    assert f["head_density_cv"] == pytest.approx(d.std() / d.mean())
    # selected blocks off the 64 grid: head 0 all 4 (36 tokens), head 1: 36 and 28 of 4
    assert f["kv_partial64"] == pytest.approx((4 + 4 * 2) / (4 + 16))
    assert f["log2_kv_block"] == pytest.approx(math.log2((36 + 64) / 2))


def _naive(m):
    """Exact features by plain Python loops (the definitions in features.py: row statistics
    weighted by the query tokens of each block row)."""
    kb = m.kv_bounds
    ks, qs = np.diff(kb), np.diff(m.q_bounds)
    B = m.blocks
    H, nq, nkv = B.shape
    toks, wts = [], []
    acc = dict(w=0.0, ne=0.0, sel=0.0, runs=0.0, run_tok=0.0, adj=0.0, same=0.0, pairs=0.0)
    dens = []
    for h in range(H):
        hd = 0.0
        for i in range(nq):
            r, w = B[h, i], float(qs[i])
            acc["w"] += w
            acc["sel"] += w * r.sum()
            hd += w * ks[r].sum()
            if r.any():
                acc["ne"] += w
                toks.append(float(ks[r].sum()))
                wts.append(w)
            for j in range(nkv):
                if r[j] and (j == 0 or not r[j - 1]):
                    acc["runs"] += w
                if r[j] and j + 1 < nkv and r[j + 1]:
                    acc["adj"] += w
            acc["run_tok"] += w * ks[r].sum()
            if i + 1 < nq:
                acc["pairs"] += w
                acc["same"] += w * np.array_equal(r, B[h, i + 1])
        dens.append(hd / (m.Lq * m.Lkv))
    t, wt = np.array(toks), np.array(wts)
    mean = (t * wt).sum() / wt.sum() if t.size else 0.0
    cv = np.sqrt(((t - mean) ** 2 * wt).sum() / wt.sum()) / mean if t.size else 0.0
    return {"density": m.density, "block_density": acc["sel"] / (acc["w"] * nkv),
            "runs_per_row": acc["runs"] / acc["ne"] if acc["ne"] else 0.0,
            "contiguity": acc["adj"] / acc["sel"] if acc["sel"] else 0.0,
            "same_rows": acc["same"] / acc["pairs"] if acc["pairs"] else 1.0,
            "row_cv": cv, "row_max_mean": t.max() / mean if t.size else 0.0,
            "log2_run_tokens": math.log2(acc["run_tok"] / acc["runs"]) if acc["runs"] else 0.0,
            "empty_rows": 1 - acc["ne"] / acc["w"],
            "head_density_cv": (np.std(dens) / np.mean(dens)) if H > 1 and np.mean(dens) > 0
            else 0.0}


def _bounds(rng, n, kind):
    """Block bounds of ``n`` blocks: "uniform" (one size, a shorter last block), "few" (at
    most 4 sizes: counted by bit masks) or "many" (random sizes: the byte look-up table)."""
    if kind == "uniform":
        sizes = np.full(n, rng.choice([16, 64, 128]))
        sizes[-1] = rng.integers(1, sizes[0] + 1)
    elif kind == "few":
        sizes = rng.choice(rng.integers(1, 300, 4), n)
    else:
        sizes = rng.integers(1, 200, n)
    return np.concatenate([[0], np.cumsum(sizes)])


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_features_exact_on_small_masks(data):
    """On masks under the sample size, features equal their definitions exactly."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    H = data.draw(st.integers(1, 3))
    nq, nkv = data.draw(st.integers(1, 12)), data.draw(st.sampled_from([1, 2, 63, 64, 150]))
    kinds = ("uniform", "few", "many")
    qb = _bounds(rng, nq, data.draw(st.sampled_from(kinds)))
    kb = _bounds(rng, nkv, data.draw(st.sampled_from(kinds)))
    p = data.draw(st.sampled_from([0.05, 0.3, 0.7, 1.0]))
    m = tj.BlockMask(qb, kb, rng.random((H, nq, nkv)) < p)
    f = F.mask_features(m)
    for k, v in _naive(m).items():
        assert f[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def _sampled_reference(m, sampling):
    """The documented sample's features, computed plainly on bool rows: heads evenly spaced
    (at most ``sampling.max_heads``), per head P query tokens evenly spaced and staggered, each
    standing for its block row (weight 1), paired with the next row for same_rows."""
    Hm, nq, nkv = m.blocks.shape
    kb, qs = m.kv_bounds, np.diff(m.q_bounds)
    ks = np.diff(kb)
    hs = np.unique(np.linspace(0, Hm - 1, min(Hm, sampling.max_heads)).round().astype(int))
    Hs = len(hs)
    P = max(F._MIN_PAIRS, sampling.bits // (2 * Hs * nkv))
    pos = (np.arange(P)[None, :] + (np.arange(Hs)[:, None] + 0.5) / Hs) * (m.Lq / P)
    rows = np.minimum(np.searchsorted(m.q_bounds, pos.astype(np.int64), side="right") - 1,
                      nq - 2)
    S, nxt_row = m.blocks[hs[:, None], rows], m.blocks[hs[:, None], rows + 1]
    pad = np.zeros_like(S[..., :1])
    left, right = (np.concatenate([pad, S[..., :-1]], -1),
                   np.concatenate([S[..., 1:], pad], -1))
    starts, ends = S & ~left, S & ~right
    tok = (S * ks).sum(-1).astype(np.float64)
    ne = S.any(-1)
    sel, runs = S.sum(), starts.sum()
    mean = tok[ne].mean() if ne.any() else 0.0
    dens = tok.sum(-1) / (P * m.Lkv)

    def off(a, b, g):
        return (a & (b % g != 0)).sum()

    return {
        "density": dens.mean(), "block_density": sel / S.size,
        "row_cv": tok[ne].std() / mean if mean else 0.0,
        "row_max_mean": tok.max() / mean if mean else 0.0,
        "empty_rows": 1 - ne.mean(), "runs_per_row": runs / ne.sum() if ne.any() else 0.0,
        "log2_run_tokens": math.log2(tok.sum() / runs) if runs else 0.0,
        "contiguity": (S & right).sum() / sel if sel else 0.0,
        "same_rows": (S == nxt_row).all(-1).mean(),
        "kv_partial64": off(S, ks, 64) / sel if sel else 0.0,
        "kv_partial128": off(S, ks, 128) / sel if sel else 0.0,
        "run_offgrid64": ((off(starts, kb[:-1], 64) + off(ends, kb[1:], 64)) / (2 * runs)
                          if runs else 0.0),
        "run_offgrid128": ((off(starts, kb[:-1], 128) + off(ends, kb[1:], 128)) / (2 * runs)
                           if runs else 0.0),
        "q_partial128": (ne & (qs[rows] % 128 != 0)).sum() / ne.sum() if ne.any() else 0.0,
        "head_density_cv": dens.std() / dens.mean() if Hs > 1 and dens.mean() > 0 else 0.0,
    }


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_features_sampled_match_definition(data):
    """Above the sample size, features equal the sample's plain definition (bit-packed rows,
    strided row reads, per-layout caches, few-size and look-up-table token counts)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    H = data.draw(st.integers(1, 6))
    nq, nkv = data.draw(st.integers(2, 40)), data.draw(st.sampled_from([1, 5, 63, 64, 128, 200]))
    kinds = ("uniform", "few", "many")
    qb = _bounds(rng, nq, data.draw(st.sampled_from(kinds)))
    kb = _bounds(rng, nkv, data.draw(st.sampled_from(kinds)))
    p = data.draw(st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0]))
    blocks = rng.random((H, nq, nkv)) < p
    if data.draw(st.booleans()):
        blocks[:, 1::2] = blocks[:, ::2][:, : nq // 2]     # repeated rows
    m = tj.BlockMask(qb, kb, blocks)
    sampling = F.Sampling(bits=data.draw(st.sampled_from([16, 256, 2048])),
                          max_heads=data.draw(st.sampled_from([3, 64])))
    F.clear_cache()
    if H * nq * nkv <= sampling.bits:
        return
    f = F.mask_features(m, sampling=sampling)
    F._CACHE.clear()                       # a new mask of a known layout: same features
    assert F.mask_features(tj.BlockMask(qb, kb, blocks.copy()), sampling=sampling) == f
    ref = _sampled_reference(m, sampling)
    F.clear_cache()
    for k, v in ref.items():
        assert f[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_features_sampled_close_to_exact():
    rng = np.random.default_rng(3)
    n = 400
    dens = np.linspace(0.05, 0.3, 8)[:, None, None]
    m = tj.BlockMask.uniform(n * 64, n * 64, 64, 64, rng.random((8, n, n)) < dens)
    assert m.blocks.size > F.SAMPLE_BITS               # the sampled path
    f = F.mask_features(m)
    exact = F.mask_features(m, sampling=F.Sampling(bits=1 << 30))
    assert exact["density"] == pytest.approx(m.density)
    for k, tol in (("density", 0.02), ("block_density", 0.02), ("contiguity", 0.03),
                   ("head_density_cv", 0.05), ("same_rows", 0.01)):
        assert abs(f[k] - exact[k]) <= tol, (k, f[k], exact[k])
    assert f["runs_per_row"] == pytest.approx(exact["runs_per_row"], rel=0.05)


def test_features_cached_and_bad_input():
    m = tj.BlockMask.uniform(256, 256, 64, 64, np.tril(np.ones((4, 4), bool))[None])
    a = F.mask_features(m)
    b = F.mask_features(tj.BlockMask(m.q_bounds, m.kv_bounds, m.blocks.copy()))
    assert a == b and m.digest in F._CACHE
    with pytest.raises(TypeError, match="mask"):
        F.mask_features(np.ones((4, 4), bool))
    with pytest.raises(TypeError, match="sampling"):
        F.mask_features(m, sampling=1 << 10)
    with pytest.raises(ValueError, match="bits"):
        F.Sampling(bits=0)


# --- GPU names ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,name,arch", [
    ("NVIDIA H200", "h200", "hopper"), ("NVIDIA H100 80GB HBM3", "h100", "hopper"),
    ("NVIDIA GH200 480GB", "gh200", "hopper"), ("NVIDIA A100-SXM4-40GB", "a100", "ampere"),
    ("NVIDIA L40S", "l40s", "ada"), ("NVIDIA B200", "b200", "blackwell"),
    ("NVIDIA GeForce RTX 4090", "rtx4090", "ada")])
def test_gpu_names(kind, name, arch):
    assert S.gpu_name(kind) == name
    assert S.gpu_arch(name) == arch


def test_gpu_arch_from_capability():
    assert S.gpu_arch("x900", "9.0") == "hopper"
    assert S.gpu_arch("x900") is None


# --- tables ----------------------------------------------------------------------------------
def _synthetic_table(cands, n=60, seed=0, gpu=None, real=True):
    """A fitted table where candidate 0 wins on sparse masks and candidate 1 on dense ones.

    ``real``: training features of real masks (``_mask_with_density``), else uniform noise.
    """
    rng = np.random.default_rng(seed)
    if real:
        X = np.stack([F.feature_vector(m, _shape(m)) for m in
                      (_mask_with_density(d, seed=100 + i)
                       for i, d in enumerate(np.linspace(0.02, 0.98, n)))])
    else:
        X = rng.random((n, len(F.FEATURE_NAMES)))
    dens = X[:, F.FEATURE_NAMES.index("density")]
    T = np.full((n, len(cands)), 3.0)
    T[:, 0] = np.where(dens < 0.5, 1.0, 2.0)
    T[:, 1] = np.where(dens < 0.5, 2.0, 1.0)
    if len(cands) > 2:
        T[0, 2] = np.nan                                    # a failed timing
    gpu = gpu or {"name": "h200", "device_kind": "NVIDIA H200", "arch": "hopper",
                  "compute_capability": "9.0"}
    return S.fit_table(X, T, cands, gpu=gpu, provenance={"note": "synthetic"}), X


def _mask_with_density(d, seed=0):
    rng = np.random.default_rng(seed)
    return tj.BlockMask.uniform(2048, 2048, 128, 128, rng.random((2, 16, 16)) < d)


def test_table_round_trip(tmp_path):
    cands = [(t, "merge") for t in MGPU[:3]]
    data, _ = _synthetic_table(cands, real=False)
    path = tmp_path / "h200.json"
    P.write_table(path, data)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(data))
    t = S.load_table(path)
    assert t.candidates == cands and t.k == data["model"]["k"]
    assert data["fit"]["k_cv_leave_group_out"]
    # The fitted ranking separates the two regimes.
    for d, want in ((0.1, 0), (0.9, 1)):
        f = dict(zip(F.FEATURE_NAMES, np.full(len(F.FEATURE_NAMES), 0.5)))
        f["density"] = d
        order = t.order(np.array([f[n] for n in F.FEATURE_NAMES]))
        assert order[0] == want and sorted(order) == [0, 1, 2]


def test_validate_rejects_bad_tables():
    data, _ = _synthetic_table([(t, "merge") for t in MGPU[:3]])
    for breaker in (lambda d: d.pop("model"), lambda d: d.update(version=99),
                    lambda d: d["model"]["points"][0].pop(),
                    lambda d: d["model"].update(scale=[0.0] * len(d["features"])),
                    lambda d: d.update(default_order=[0, 0, 1])):
        bad = json.loads(json.dumps(data))
        breaker(bad)
        with pytest.raises(S.TableError):
            S.validate_table(bad)


def test_select_uses_table_and_filters_support(monkeypatch, tmp_path):
    _fake_gpu(monkeypatch, "h200")
    cands = [("mgpu_q128_kv64_s2_hm", "split"), ("mgpu_q128_kv128_s2_hm", "keep"),
             ("no_such_template", "merge")]
    data, _ = _synthetic_table(cands)
    P.write_table(tmp_path / "tables" / "h200.json", data)
    sparse, dense = _mask_with_density(0.1), _mask_with_density(0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # an exact table: no warning
        assert S.select(sparse, _shape(sparse), "mosaic_gpu") == cands[0]
        assert S.select(dense, _shape(dense), "mosaic_gpu") == cands[1]
    # head_dim 96: no Mosaic template takes it -> the table has nothing, the heuristic neither
    assert S.select(sparse, _shape(sparse, D=96), "mosaic_gpu") is None
    # the XLA backend: none of the table's candidates -> None (the API's default)
    assert S.select(sparse, _shape(sparse), "xla") is None


def test_missing_table_warns_once_and_uses_heuristic(monkeypatch):
    _fake_gpu(monkeypatch, "h200")
    m = _mask_with_density(0.3)
    with pytest.warns(UserWarning, match="no plan table"):
        choice = S.select(m, _shape(m), "mosaic_gpu")
    assert choice == S.heuristic(m, _shape(m), "mosaic_gpu")
    assert choice[0] in MGPU and choice[1] in ("keep", "merge", "split")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        S.select(_mask_with_density(0.5, seed=1), _shape(m), "mosaic_gpu")


@pytest.mark.parametrize("content", ["{not json", '{"format": "tessera_jax.plan_table"}', "[]",
                                     ""])
def test_corrupt_table_warns_and_never_crashes(monkeypatch, tmp_path, content):
    _fake_gpu(monkeypatch, "h200")
    (tmp_path / "tables" / "h200.json").write_text(content)
    m = _mask_with_density(0.3)
    with pytest.warns(UserWarning, match="heuristic"):
        choice = S.select(m, _shape(m), "mosaic_gpu")
    assert choice == S.heuristic(m, _shape(m), "mosaic_gpu")


def test_unknown_gpu_takes_same_architecture_table(monkeypatch, tmp_path):
    _fake_gpu(monkeypatch, "h100")
    cands = [("mgpu_q128_kv64_s2_skip", "auto"), ("mgpu_q64x2_kv64_s2_hm", "split"),
             ("mgpu_q128_kv64_s2_hm", "keep")]
    data, _ = _synthetic_table(cands)
    P.write_table(tmp_path / "tables" / "h200.json", data)
    other, _ = _synthetic_table([("mgpu_q128_kv64_s2_hm", "keep")] * 3,
                                gpu={"name": "a100", "arch": "ampere"})
    P.write_table(tmp_path / "tables" / "a100.json", other)
    m = _mask_with_density(0.1)
    with pytest.warns(UserWarning, match="h200.json.*hopper"):
        assert S.select(m, _shape(m), "mosaic_gpu") == cands[0]
    # an architecture with no table: heuristic
    S.clear_caches()
    _fake_gpu(monkeypatch, "b200", "10.0")
    with pytest.warns(UserWarning, match="no plan table"):
        S.select(m, _shape(m), "mosaic_gpu")


def test_cpu_without_table_is_silent_and_api_default():
    S._current_device.cache_clear()
    m = _mask_with_density(0.3, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert S.select(m, _shape(m, D=32, dtype="float32"), "xla") is None
        p = tj.plan(m, (1, 2048, 2, 32), (1, 2048, 2, 32), np.float32)
    assert p.template == "xla_64x64" and p.policy == "merge"


def test_api_uses_cpu_table(tmp_path):
    """A table for this device (cpu) steers tj.plan: template and policy from the table."""
    S._current_device.cache_clear()
    cands = [("xla_128x64", "split"), ("xla_64x128", "keep")]
    data, _ = _synthetic_table(cands, gpu={"name": "cpu", "arch": "cpu"})
    P.write_table(tmp_path / "tables" / "cpu.json", data)
    m = _mask_with_density(0.05, seed=11)
    p = tj.plan(m, (1, 2048, 2, 32), (1, 2048, 2, 32), np.float32)
    assert (p.template, p.policy) == cands[0]
    # and the result still computes the reference
    import jax
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 2048, 2, 32)) for i in range(3))
    out = tj.sparse_attention(q, k, v, m)
    ref = tj.reference_attention(q, k, v, m)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_heuristic_rules():
    # long aligned runs -> 128-key tiles, contiguous -> merge
    band = np.zeros((1, 32, 32), bool)
    for i in range(32):
        band[0, i, max(0, i - 4): i + 5] = True
    m = tj.BlockMask.uniform(32 * 128, 32 * 128, 128, 128, band)
    t, pol = S.heuristic(m, _shape(m), "mosaic_gpu")
    assert t == "mgpu_q128_kv128_s2_hm" and pol == "merge"
    # scattered 16-token blocks -> 64-key tiles, split
    rng = np.random.default_rng(0)
    blocks = rng.random((1, 64, 64)) < 0.1
    blocks[0, :, 0] = True
    m = tj.BlockMask.uniform(1024, 1024, 16, 16, blocks)
    t, pol = S.heuristic(m, _shape(m), "mosaic_gpu")
    assert t == "mgpu_q128_kv64_s2_hm" and pol == "split"      # nearest to kv64 s3
    # a band over 64-token blocks: rows never repeat, 64-row blocks would half-fill 128-row
    # tiles under keep/merge -> split (the grid packs two blocks per tile)
    m = tj.BlockMask.uniform(32 * 64, 32 * 64, 64, 64, band)
    assert S.heuristic(m, _shape(m), "mosaic_gpu")[1] == "split"
    # repeated rows (dense, 64-token blocks) -> merge
    m = tj.BlockMask.uniform(32 * 64, 32 * 64, 64, 64, np.ones((1, 32, 32), bool))
    assert S.heuristic(m, _shape(m), "mosaic_gpu") == ("mgpu_q128_kv128_s2_hm", "merge")


def test_select_bad_input():
    with pytest.raises(TypeError, match="mask"):
        S.select("mask", None, "xla")


# --- cost ---------------------------------------------------------------------------------
def _wan720_random():
    rng = np.random.default_rng(0)
    return tj.BlockMask.uniform(75600, 75600, 64, 64,
                                rng.integers(0, 256, (40, 1182, 1182), dtype=np.uint8) < 26)


def _wan720_varied():
    """40 heads x 400 x 1000 blocks of random sizes (like svg2's clusters): token counts by
    the byte look-up table."""
    rng = np.random.default_rng(1)
    qb, kb = (np.concatenate([[0], np.cumsum(rng.integers(2, 376, n))]) for n in (400, 1000))
    return tj.BlockMask(qb, kb, rng.integers(0, 256, (40, 400, 1000), dtype=np.uint8) < 28)


@pytest.mark.parametrize("make", [_wan720_random, _wan720_varied])
def test_selection_work_wan720(make, monkeypatch):
    """Selection (features + table look-up) at Wan 720p, 40 heads, counted in work, not wall
    time (this 2-core box is shared; the timings are ``benchmarks/selection.py --cost-only``,
    recorded in ``benchmarks/results/{cpu,h200}-selection-cost.json``): a new layout builds its
    layout once, a new mask of a known layout only reads its sampled rows, a repeated mask is a
    dictionary hit (no features, no ranking); and the rows read stay within SAMPLE_BITS block
    bits (a 16 M- or 56 M-flag mask is never read whole). A realistic table: 1,500 training masks x
    20 candidates."""
    cands = [(t, p) for t in MGPU for p in ("keep", "merge", "split", "auto")]
    rng = np.random.default_rng(1)
    X = rng.random((1500, len(F.FEATURE_NAMES)))
    T = 1.0 + rng.random((1500, len(cands)))
    table = S.Table(S.fit_table(X, T, cands, gpu={"name": "h200", "arch": "hopper"},
                                provenance={}, ks=(5,)))
    m = make()
    shape = _shape(m)
    calls = {"layout": 0, "mask": 0, "rank": 0}
    bits = []

    def spy(name, fn, on_result=None):
        def wrapped(*a, **kw):
            calls[name] += 1
            out = fn(*a, **kw)
            if on_result is not None:
                on_result(out)
            return out
        return wrapped

    monkeypatch.setattr(F, "_make_layout", spy("layout", F._make_layout))
    monkeypatch.setattr(F, "_mask_part", spy("mask", F._mask_part))
    monkeypatch.setattr(F, "_words", lambda *a, real=F._words: (
        lambda w: bits.append(w.size * 64) or w)(real(*a)))
    monkeypatch.setattr(S, "rank", spy("rank", S.rank))
    want = {"cold": {"layout": 1, "mask": 1, "rank": 1},
            "new_mask": {"layout": 0, "mask": 1, "rank": 1},
            "cached": {"layout": 0, "mask": 0, "rank": 0}}
    choices = set()
    for state in ("cold", "new_mask", "cached"):
        if state == "cold":
            F.clear_cache()
        if state != "cached":
            F._CACHE.clear()
            S._CHOICES.clear()
        calls.update(layout=0, mask=0, rank=0)
        choices.add(S.select(m, shape, "mosaic_gpu", table=table))
        assert calls == want[state], state
    assert len(choices) == 1 and choices.pop() in cands
    lay = F._layout(m)
    assert not lay.exact and len(bits) == 2
    assert max(bits) <= F.SAMPLE_BITS * lay.n64 / lay.nkv      # padded to 64-bit words
    assert max(bits) < m.blocks.size / 20                       # 16 M and 56 M flags


def test_q_tiles_feature_saturates_for_head_subsets():
    """A table profiled on 4 heads of a 32K-token video sees the full call as the same size."""
    m = tj.BlockMask.uniform(32760, 32760, 128, 128, np.eye(256, dtype=bool)[None])
    f4, f40 = (F.mask_features(m, _shape(m, H=h)) for h in (4, 40))
    assert f4["log2_q_tiles"] == pytest.approx(f40["log2_q_tiles"], abs=1e-3)
    assert F.mask_features(m, _shape(m, H=1))["log2_q_tiles"] < f4["log2_q_tiles"] - 1


@pytest.mark.parametrize("H,nq,nkv", [(1, 40, 1), (2, 30, 1), (70, 9, 64), (3, 50, 70)])
def test_features_sampled_edge_layouts(H, nq, nkv):
    """Sampled path on layouts where rows end near the buffer's end (fewer bytes than a padded
    row), key-block counts of one word exactly, and more heads than MAX_SAMPLE_HEADS."""
    sampling = F.Sampling(bits=16)
    rng = np.random.default_rng(H * nq + nkv)
    m = tj.BlockMask(_bounds(rng, nq, "few"), _bounds(rng, nkv, "many"),
                     rng.random((H, nq, nkv)) < 0.4)
    f = F.mask_features(m, sampling=sampling)
    for k, v in _sampled_reference(m, sampling).items():
        assert f[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_selection_benchmark_cost_only(tmp_path, capsys):
    """``benchmarks/selection.py --cost-only``: the selection cost alone, no kernel timing."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "selection.py"
    spec = importlib.util.spec_from_file_location("bench_selection_cost", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cands = [("xla_128x64", "split"), ("xla_64x128", "keep")]
    data, _ = _synthetic_table(cands, gpu={"name": "cpu", "arch": "cpu"})
    P.write_table(tmp_path / "cpu.json", data)
    out = tmp_path / "cost.json"
    res = bench.main(["--cost-only", "--tiny", "--table", str(tmp_path / "cpu.json"),
                      "--sel-repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert "masks" not in res and [r["mask"] for r in res["selection_cost"]] == [
        "random-64-blocks-10pct"]
    assert tuple(res["selection_cost"][0]["choice"]) in cands
    for key in ("selection_ms_wan720", "selection_ms_wan720_new_mask_known_layout",
                "selection_ms_wan720_cached"):
        assert isinstance(res["summary"][key], float) and res["summary"][key] > 0, key
    assert "selection_ms_wan720" in capsys.readouterr().out


def test_a_stale_table_folder_does_not_hide_the_source_tables(tmp_path):
    """A checkout with an empty (or raw-only) ``tessera_jax/plan_tables/`` left behind still
    finds the top-level ``plan_tables/`` (an H200 run once fell back to the heuristic so);
    a wheel's own folder wins when it holds tables."""
    from tessera_jax.select import ranking as R
    pkg = tmp_path / "tessera_jax"
    (pkg / "plan_tables" / "raw").mkdir(parents=True)
    (tmp_path / "plan_tables").mkdir()
    (tmp_path / "plan_tables" / "h200.json").write_text("{}")
    assert R._table_dir_of(pkg) == tmp_path / "plan_tables"
    (pkg / "plan_tables" / "h200.json").write_text("{}")
    assert R._table_dir_of(pkg) == pkg / "plan_tables"
