"""CPU tests of the video mask generators and the mask corpus (tessera_jax.masks)."""

from __future__ import annotations

import collections
import json
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tessera_jax.mask import BlockMask
from tessera_jax import masks as M
from tessera_jax.masks import families as F, grids as G

DYNAMIC = ("ssta", "moba", "vsa", "svg2", "sparge", "xattn", "jenga")
ALL = tuple(F.FAMILIES)
# Pinned: changing any generator's spec list or the split must be deliberate (update docs too).
CORPUS_DIGEST = "b62ff0214d2d1953e90f6cdd1c2b386d9b62a0436adef57de6569e5f50b7112f"
# The corpus before the "tokens" family (issue 15): the H200 table's provenance. Every earlier
# spec keeps its id and split, so the corpus without that family digests to it.
CORPUS_DIGEST_BEFORE_TOKENS = "bd175d27e84989137a54385829bba9ec32f8942693204f1e72a0f64fc08ee142"


def _gen(family, grid="small", **kw):
    """A family on a small grid; tile families get small tiles so masks are not all dense."""
    if family in ("sta", "ssta", "moba", "natten"):
        kw.setdefault("tile", (2, 4, 4))
    if family in ("ssta", "moba"):
        kw.setdefault("topk", 6)
    return F.FAMILIES[family](grid, **kw)


# --- grids and layouts ----------------------------------------------------------------------------
def test_grid_token_counts():
    assert G.GRIDS["wan720"].video_tokens == 75_600
    assert G.GRIDS["wan480"].video_tokens == 32_760
    assert G.GRIDS["hy720"].video_tokens == 111_600
    assert G.GRIDS["hy480"].video_tokens == 49_290
    assert G.GRIDS["wan720"].heads == 40 and G.GRIDS["hy720"].heads == 16
    assert G.GRIDS["hy720"].joint and not G.GRIDS["wan720"].joint


def test_vsa_cubes_partial_edges_wan720():
    lay = G.tile_layout(G.GRIDS["wan720"], (4, 4, 4))
    sizes = collections.Counter(np.diff(lay.bounds).tolist())
    assert sizes == {64: 1100, 16: 320, 4: 20}


def test_ssta_tiles_real_token_counts_hy720():
    lay = G.tile_layout(G.GRIDS["hy720"], (6, 8, 8))
    sizes = collections.Counter(np.diff(lay.bounds).tolist())
    assert len(lay.bounds) - 1 == 360
    assert set(sizes) == {384, 240, 64, 40}


def test_frame_layout_wan720():
    b = G.frame_layout(G.GRIDS["wan720"], 128).bounds
    sizes = np.diff(b).reshape(21, 29)
    assert (sizes[:, :28] == 128).all() and (sizes[:, 28] == 16).all()
    assert (b[::29][:21] == np.arange(21) * 3600).all()


@pytest.mark.parametrize("tile", [(4, 4, 4), (2, 8, 8), (6, 8, 8)])
def test_tile_layout_is_a_permutation_of_boxes(tile):
    g = G.GRIDS["small"]
    lay = G.tile_layout(g, tile)
    assert np.array_equal(np.sort(lay.order), np.arange(g.video_tokens))
    c = G.token_coords(g, lay.order)
    for i in range(len(lay.bounds) - 1):
        cc = c[lay.bounds[i]:lay.bounds[i + 1]]
        assert len({tuple(x) for x in cc // np.array(tile)}) == 1     # one tile per block


def test_hilbert_curve_steps_are_unit_moves():
    pts = np.stack(np.meshgrid(*[np.arange(8)] * 3, indexing="ij"), -1).reshape(-1, 3)
    idx = G.hilbert_index_3d(pts, 3)
    assert np.array_equal(np.sort(idx), np.arange(512))
    walk = pts[np.argsort(idx)]
    assert (np.abs(np.diff(walk, axis=0)).sum(1) == 1).all()
    lay = G.hilbert_layout(G.GRIDS["small"], 128)
    assert np.array_equal(np.sort(lay.order), np.arange(G.GRIDS["small"].video_tokens))


# --- every family ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("grid", ["small", "small_text"])
def test_family_deterministic_and_well_formed(family, grid):
    g = G.GRIDS[grid]
    text = 50 if g.joint else 0
    a = _gen(family, grid, seed=3, text=text)
    b = _gen(family, grid, seed=3, text=text)
    assert isinstance(a, BlockMask) and a.digest == b.digest
    assert a.num_heads in (1, g.heads)
    expect_l = g.video_tokens + text
    assert a.Lq == expect_l and (a.Lkv == expect_l or family == "dense")
    assert 0.0 < a.density <= 1.0
    assert a.blocks.any(axis=2).all(), "every query block must see some key"


@pytest.mark.parametrize("family", DYNAMIC)
def test_dynamic_families_depend_on_seed_and_drift_with_step(family):
    m0 = _gen(family, seed=1)
    assert _gen(family, seed=2).digest != m0.digest
    m1 = _gen(family, seed=1, step=1)
    assert m1.digest != m0.digest
    assert m0.num_heads == G.GRIDS["small"].heads

    def jacc(a, b):
        return (a.blocks & b.blocks).sum() / (a.blocks | b.blocks).sum()

    assert jacc(m0, m1) > jacc(m0, _gen(family, seed=2)), "a step must drift, not redraw"


@pytest.mark.parametrize("family", DYNAMIC + ("svg", "sta"))
def test_head_subset_matches_full_build(family):
    kw = {"window": "mix"} if family == "sta" else {}
    full = _gen(family, seed=5, heads=4, **kw)
    sub = _gen(family, seed=5, heads=2, **kw)
    assert np.array_equal(full.head_blocks(4)[:2], sub.head_blocks(2))


def test_per_head_variation_present():
    for fam in DYNAMIC:
        m = _gen(fam, seed=0)
        assert m.num_heads == 4 and len({m.blocks[h].tobytes() for h in range(4)}) > 1, fam


# --- family rules ---------------------------------------------------------------------------------
def _sta_bruteforce(gt, window):
    n = int(np.prod(gt))
    idx = np.array(np.unravel_index(np.arange(n), gt)).T
    out = np.ones((n, n), bool)
    for a in range(3):
        w = min(window[a], gt[a])
        start = np.clip(idx[:, a] - w // 2, 0, gt[a] - w)
        out &= (idx[None, :, a] >= start[:, None]) & (idx[None, :, a] < start[:, None] + w)
    return out


@pytest.mark.parametrize("window", [(3, 3, 3), (1, 2, 5), (5, 1, 1)])
def test_sta_window_rule_and_uniform_rows(window):
    g = G.get_grid("small")
    m = F.sta(g, tile=(2, 4, 4), window=window)
    gt = G.tile_grid(g, (2, 4, 4))
    assert np.array_equal(m.blocks[0], _sta_bruteforce(gt, window))
    rows = m.blocks[0].sum(1)
    assert (rows == np.prod([min(w, n) for w, n in zip(window, gt)])).all()


def test_sta_mix_and_text_tiles():
    m = F.sta("small_text", tile=(2, 4, 4), window="mix", text=500, seed=4)
    lv = G.GRIDS["small_text"].video_tokens
    tb = m.q_bounds[m.q_bounds >= lv]
    assert list(np.diff(tb)) == [384, 116]
    nv = int(np.searchsorted(m.q_bounds, lv))
    assert m.blocks[:, nv:, :].all() and m.blocks[:, :, nv:].all()


def test_ssta_contains_window_and_moba_rows_exact():
    g = G.get_grid("small")
    win = F.sta(g, tile=(2, 4, 4), window=(3, 3, 3)).blocks[0]
    s = F.ssta(g, tile=(2, 4, 4), topk=5, lam=0.7, seed=1)
    assert (s.blocks >= win[None]).all() and s.density > F.sta(g, tile=(2, 4, 4)).density
    mo = F.moba(g, tile=(2, 4, 4), topk=7, seed=1)
    assert (mo.blocks.sum(2) == 7).all()
    assert all(np.diagonal(mo.blocks[h]).all() for h in range(mo.num_heads))


@pytest.mark.parametrize("sparsity", [0.75, 0.9])
def test_vsa_rows_exact_and_partial_cubes(sparsity):
    m = F.vsa("small_text", sparsity=sparsity, seed=2, text=70)
    lay = G.tile_layout(G.GRIDS["small_text"], (4, 4, 4))
    n = len(lay.bounds) - 1
    assert len(np.unique(np.diff(lay.bounds))) > 2           # partial edge cubes
    k = math.ceil((1 - sparsity) * n - 1e-9)
    assert (m.blocks[:, :n, :n].sum(2) == k).all()


def test_radial_structure():
    g = G.get_grid("small")                                   # 192 tokens per frame
    m = F.radial(g, decay=0.2, block=64, sink=True, layout="frame")
    tm = m.token_mask(0)
    tpf = g.tokens_per_frame
    f = np.arange(g.video_tokens) // tpf
    assert tm[np.abs(f[:, None] - f[None, :]) <= 1].all()     # adjacent frames dense
    assert tm[:, :tpf].all()                                  # sink
    assert not m.blocks.all() and m.num_heads == 1
    u = F.radial(g, decay=0.2, block=128, sink=False, layout="uniform")
    assert set(np.diff(u.q_bounds)[:-1]) == {128}
    fr = F.radial(g, decay=0.2, block=128, sink=False, layout="frame")
    assert set(np.diff(fr.q_bounds)) == {128, 64}            # 192 = 128 + 64 per frame


def test_svg_spatial_is_band_plus_sink():
    g = G.get_grid("small")
    m = F.svg(g, density=0.2, temporal_frac=0.0, block=64)
    W = F._svg_width(g, 0.2, 64)
    i = np.arange(g.video_tokens)
    tok = (np.abs(i[:, None] - i[None, :]) <= W) | (i[None, :] < g.tokens_per_frame)
    ref = BlockMask.from_token_mask(tok, m.q_bounds, m.kv_bounds, exact=False)
    assert m.num_heads == 1 and np.array_equal(m.blocks, ref.blocks)
    t = F.svg(g, density=0.2, temporal_frac=1.0, block=64)
    assert t.digest != m.digest
    tt, ss = i // g.tokens_per_frame, i % g.tokens_per_frame
    p = ss * g.t + tt                                         # frame-minor position
    tok = (np.abs(p[:, None] - p[None, :]) <= W) | (tt[None, :] == 0)
    ref = BlockMask.from_token_mask(tok, t.q_bounds, t.kv_bounds, exact=False)
    assert np.array_equal(t.blocks, ref.blocks)
    mixed = F.svg(g, density=0.2, temporal_frac=0.5, block=64, seed=3)
    assert mixed.num_heads in (1, 4)


def test_svg2_heavy_tailed_clusters_and_min_fraction():
    m = F.svg2("small_text", q_clusters=100, kv_clusters=300, top_p=0.8, seed=1, text=90)
    lv = G.GRIDS["small_text"].video_tokens
    qs = np.diff(m.q_bounds)[:-1]
    assert qs.max() > 5 * np.median(qs) and qs.min() >= 1 and qs.sum() == lv
    assert np.diff(m.q_bounds)[-1] == 90                      # text: one dense cluster
    assert (m.blocks[:, :-1, :-1].sum(2) >= math.ceil(0.1 * 300)).all()


def test_sparge_dense_stripes_and_xattn_diag_sink():
    s = F.sparge("small", tau=0.6, nonsim_frac=0.1, seed=3, block_q=64, block_kv=32)
    assert any(s.blocks[h].all(1).any() or s.blocks[h].all(0).any() for h in range(4))
    assert set(np.diff(s.q_bounds)) == {64} and set(np.diff(s.kv_bounds)) == {32}
    x = F.xattn("small", tau=0.8, stride=16, block=64, seed=3)
    for h in range(x.num_heads):
        assert np.diagonal(x.blocks[h]).all() and x.blocks[h][:, 0].all()


def test_jenga_row_minimum_and_adjacency():
    m = F.jenga("small", drop=0.8, p=0.3, block=64, seed=2)
    n = m.blocks.shape[1]
    assert (m.blocks.sum(2) >= math.ceil(0.2 * n)).all()
    assert all(np.diagonal(m.blocks[h]).all() for h in range(m.num_heads))


@pytest.mark.parametrize("tile", [(2, 4, 4), (4, 4, 4)])
def test_natten_stride1_is_cover_of_token_windows(tile):
    g = G.get_grid("small")
    window = (3, 5, 7)
    m = F.natten(g, window=window, stride=1, tile=tile)
    lay = G.tile_layout(g, tile)
    c = G.token_coords(g, lay.order)
    tok = np.ones((g.video_tokens,) * 2, bool)
    for a, (n, k) in enumerate(zip(g.shape, window)):
        s = np.clip(c[:, a] - k // 2, 0, n - k)
        tok &= (c[None, :, a] >= s[:, None]) & (c[None, :, a] < s[:, None] + k)
    ref = BlockMask.from_token_mask(tok, lay.bounds, lay.bounds, exact=False)
    assert np.array_equal(m.blocks, ref.blocks)
    aligned = F.natten(g, window=window, stride="tile", tile=tile)
    assert aligned.digest != m.digest


def test_ditfastattn_band_cover():
    g = G.get_grid("small")
    m = F.ditfastattn(g, window_frac=0.125, block=64)
    i = np.arange(g.video_tokens)
    half = int(0.125 * g.video_tokens) // 2
    ref = BlockMask.from_token_mask(np.abs(i[:, None] - i[None, :]) <= half,
                                    m.q_bounds, m.kv_bounds, exact=False)
    assert np.array_equal(m.blocks, ref.blocks)


def test_dense_full_and_text_only():
    full = F.dense("small_text", text=77)
    assert full.density == 1.0 and full.Lq == G.GRIDS["small_text"].video_tokens + 77
    cross = F.dense("small", kind="text")
    assert cross.Lkv == G.GRIDS["small"].cross_text and cross.Lq == G.GRIDS["small"].video_tokens
    assert F.dense("small_text", kind="text", text=33).Lkv == 33


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(ALL), t=st.integers(1, 6), h=st.integers(2, 9),
       w=st.integers(2, 11), heads=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       text=st.integers(0, 40))
def test_random_small_grids(family, t, h, w, heads, seed, text):
    g = G.Grid("hyp", t, h, w, heads, text_max=40, cross_text=16)
    kw = {"block": 16} if family in ("dense", "radial", "svg", "xattn", "jenga", "ditfastattn") else {}
    if family == "svg2":
        kw = {"q_clusters": 7, "kv_clusters": 11}
    if family == "sparge":
        kw = {"block_q": 16, "block_kv": 8}
    m = F.FAMILIES[family](g, heads=heads, seed=seed, text=text, **kw)
    assert m.Lq == g.video_tokens + text
    assert m.blocks.any(axis=2).all()
    if text:
        nv = int(np.searchsorted(m.q_bounds, g.video_tokens))
        kv = int(np.searchsorted(m.kv_bounds, g.video_tokens))
        assert m.q_bounds[nv] == g.video_tokens and m.kv_bounds[kv] == g.video_tokens
        assert m.blocks[:, nv:, :].all() and m.blocks[:, :, kv:].all()


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="sparsity"):
        F.vsa("small", sparsity=1.5)
    with pytest.raises(ValueError, match="text"):
        F.vsa("small", text=10)                               # no joint text on this grid
    with pytest.raises(TypeError, match="heads"):
        F.sta("small", heads=2.0)
    with pytest.raises(ValueError, match="window"):
        F.sta("small", window=(0, 3, 3))
    with pytest.raises(ValueError, match="grid"):
        F.dense("nope")
    with pytest.raises(ValueError, match="stride"):
        F.natten("small", stride=2)
    with pytest.raises(ValueError, match="kind"):
        F.dense("small", kind="sparse")
    with pytest.raises(ValueError, match="heads"):
        M.build(M.corpus()[0], heads=999)


# --- corpus -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def specs():
    return M.corpus()


def test_corpus_size_ids_and_json(specs):
    assert len(specs) == M.CORPUS_SIZE == 2345
    assert len({s["id"] for s in specs}) == 2345
    assert json.loads(json.dumps(specs)) == specs
    grids = collections.Counter(s["grid"] for s in specs)
    assert set(grids) == set(G.CORPUS_GRIDS)
    assert set(s["family"] for s in specs) == set(ALL)
    assert any(s["heads"] == 12 for s in specs)               # Wan2.1-1.3B
    assert sum(s["step"] > 0 for s in specs) == 315


def test_corpus_split_disjoint_stable_stratified(specs):
    assert M.corpus_digest() == CORPUS_DIGEST
    train, test = M.train_specs(), M.test_specs()
    assert len(train) + len(test) == len(specs)
    assert not {s["id"] for s in train} & {s["id"] for s in test}
    assert not {M.group_key(s) for s in train} & {M.group_key(s) for s in test}
    for fam in ALL:
        n_te = sum(s["family"] == fam for s in test)
        n_tr = sum(s["family"] == fam for s in train)
        assert n_te > 0 and n_tr > 0, fam
        assert 0.1 <= n_te / (n_te + n_tr) <= 0.35, fam
    assert 0.17 <= len(test) / len(specs) <= 0.23
    assert M.corpus() == specs                                 # stable across calls


def test_corpus_text_lengths(specs):
    for s in specs:
        g = G.GRIDS[s["grid"]]
        if g.joint:
            assert 50 <= s["text"] <= g.text_max
        else:
            assert s["text"] == 0


def _density_specs(specs):
    """Two cheap specs per family: wan480 with 12 heads where the family has one."""
    out = []
    for fam in ALL:
        cand = [s for s in specs if s["family"] == fam and s["grid"] == "wan480"]
        small = [s for s in cand if s["heads"] == 12] or cand
        out += [small[0], small[-1]]
    return out


def test_corpus_densities_in_documented_ranges(specs):
    for s in _density_specs(specs):
        m = M.build(s)
        lo, hi = M.DENSITY_RANGES[s["family"]]
        assert lo <= m.density <= hi, (s, m.density)


def test_corpus_build_head_subset_and_variable_blocks(specs):
    hy = [s for s in specs if s["grid"] == "hy480" and s["family"] == "ssta"][0]
    sub = M.build(hy, heads=2)
    assert sub.num_heads == 2 and sub.Lq == 49_290 + hy["text"]
    sizes = set(np.diff(sub.q_bounds).tolist())
    assert {384, 240}.issubset(sizes) and len(sizes) >= 4      # padded tiles, text remainder
    tb = np.diff(sub.q_bounds[sub.q_bounds >= 49_290])
    assert tb.sum() == hy["text"] and (tb[:-1] == 384).all() and 0 < tb[-1] <= 384
    rad = [s for s in specs if s["family"] == "radial" and s["grid"] == "wan720"
           and s["params"]["layout"] == "frame" and s["params"]["block"] == 128][0]
    m = M.build(rad)
    assert collections.Counter(np.diff(m.q_bounds).tolist()) == {128: 28 * 21, 16: 21}


def test_real_grid_generation_is_fast():
    t = time.perf_counter()
    m = F.ditfastattn("wan720", window_frac=0.125, block=64)
    assert m.shape == (1, 1182, 1182)
    x = F.xattn("wan720", tau=0.9, block=128, heads=8, seed=1)
    assert x.shape == (8, 591, 591)
    assert time.perf_counter() - t < 10.0


@pytest.mark.parametrize("layout,block,decay,sink", [("frame", 64, 0.2, True),
                                                      ("uniform", 128, 0.5, False),
                                                      ("frame", 32, 1.0, False),
                                                      ("uniform", 64, 0.95, True)])
def test_radial_is_cover_of_token_rule(layout, block, decay, sink):
    g = G.Grid("r", 12, 6, 10, 1)                              # 60 tokens per frame
    m = F.radial(g, decay=decay, block=block, sink=sink, layout=layout)
    tpf = g.tokens_per_frame
    i = np.arange(g.video_tokens)
    f, pos = i // tpf, i % tpf
    d = np.abs(f[:, None] - f[None, :])
    base = np.array([2.0 ** tpf.bit_length() / 2.0 ** int(x).bit_length() for x in range(g.t)])
    width = np.maximum(base * decay, block)
    split = np.where(base < block, np.maximum(1, block // np.maximum(base, 1)), 1).astype(int)
    keep = (np.arange(g.t) % split) == 0
    tok = (d <= 1) | ((np.abs(pos[:, None] - pos[None, :]) <= width[d]) & keep[d])
    if sink:
        tok |= (f == 0)[None, :]
    ref = BlockMask.from_token_mask(tok, m.q_bounds, m.kv_bounds, exact=False)
    assert np.array_equal(m.blocks, ref.blocks)
    assert not m.blocks.all()


def test_every_family_builds_on_every_corpus_grid(specs):
    """One spec per (family, grid), first head only (cheap): shapes and text on real grids."""
    seen = set()
    for s in specs:
        key = (s["family"], s["grid"])
        if key in seen:
            continue
        seen.add(key)
        m = M.build(s, heads=1)
        g = G.GRIDS[s["grid"]]
        assert m.Lq == g.video_tokens + s["text"], key
        assert m.blocks.any(axis=2).all(), key
    video = len(ALL) - 1                                       # all but tokens
    assert len(seen) == video * (len(G.CORPUS_GRIDS) - 1) + len(M.TOKEN_GRIDS)


# --- token-level family (issue 15) ----------------------------------------------------------------
def test_corpus_before_tokens_is_unchanged(specs):
    """Every spec of the corpus before the tokens family keeps its id, its split and its place."""
    assert M.corpus_digest(exclude=("tokens",)) == CORPUS_DIGEST_BEFORE_TOKENS
    old = [s for s in specs if s["family"] != "tokens"]
    assert [s["family"] for s in specs[len(old):]] == ["tokens"] * (len(specs) - len(old))
    with pytest.raises(ValueError, match="exclude"):
        M.corpus_digest(exclude=("nope",))
    with pytest.raises(TypeError, match="exclude"):
        M.corpus_digest(exclude="tokens")


def test_token_specs_shapes_densities_and_split(specs):
    tok = [s for s in specs if s["family"] == "tokens"]
    assert len(tok) == 30 and sum(s["split"] == "test" for s in tok) == 6
    assert {s["grid"] for s in tok} == set(M.TOKEN_GRIDS)
    blocks = collections.Counter((s["grid"], s["params"]["block"]) for s in tok)
    assert blocks == {("wan480", 4): 6, ("wan480", 8): 6, ("wan480", 16): 6, ("tok4096", 1): 12}
    lo, hi = M.DENSITY_RANGES["tokens"]
    expect = {4: 8190, 8: 4095, 16: 2048, 1: 4096}
    for s in tok:
        m = M.build(s)
        n = expect[s["params"]["block"]]
        assert m.shape == (1, n, n) and m.Lq == G.GRIDS[s["grid"]].video_tokens, s
        assert lo <= m.density <= hi, (s, m.density)
        if s["params"]["kind"] == "random":                     # the requested block density
            assert abs(m.blocks.mean() - s["params"]["density"]) < 0.005, s
        assert M.build(s, heads=2).digest == m.digest           # shared: heads only name the call


@pytest.mark.parametrize("block", [1, 2, 3, 8])
@pytest.mark.parametrize("width", [0, 1, 5, 13])
def test_token_band_is_cover_of_token_rule(block, width):
    g = G.Grid("r", 3, 5, 7, 1)                                # 105 tokens: a partial last block
    m = F.tokens(g, kind="band", block=block, width=width)
    i = np.arange(g.video_tokens)
    ref = BlockMask.from_token_mask(np.abs(i[:, None] - i[None, :]) <= width, m.q_bounds,
                                    m.kv_bounds, exact=False)
    assert np.array_equal(m.blocks, ref.blocks)


def test_token_random_seed_local_band_and_bad_arguments():
    a = F.tokens("small", block=4, density=0.2, local=0.5, seed=1)
    assert a.num_heads == 1 and np.diag(a.blocks[0]).all()
    assert F.tokens("small", block=4, density=0.2, local=0.5, seed=2).digest != a.digest
    n = a.shape[1]
    i = np.arange(n)
    near = np.abs(i[:, None] - i[None, :]) <= 3
    assert a.blocks[0][near].all()                             # the local band (~half of 0.2)
    pure = F.tokens("small", block=4, density=0.2, local=0.0, seed=1)
    assert not pure.blocks[0][near].all()
    with pytest.raises(ValueError, match="kind"):
        F.tokens("small", kind="stripes")
    with pytest.raises(ValueError, match="density"):
        F.tokens("small", density=0.0)
    with pytest.raises(ValueError, match="local"):
        F.tokens("small", local=1.5)
    with pytest.raises(ValueError, match="block"):
        F.tokens("small", block=0)
    with pytest.raises(ValueError, match="width"):
        F.tokens("small", kind="band", width=-1)
