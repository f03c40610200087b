"""The plan ABI's packed step rectangle and grid: pack/unpack round trips (NumPy, jnp, Python
ints), the unpacked views, and tiles too large for a byte rejected where plans are built; the one
plan validator (``abi.check_plan``, grid steps included); the static template table and its
typed, validated configs."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tessera_jax as tj
from pallas_kernels import abi, templates
from pallas_kernels.templates import MosaicConfig, Template, TritonConfig
from tessera_jax.planning.planner import build_plan

_BYTE = st.integers(0, 255)


@given(_BYTE, _BYTE, _BYTE, _BYTE)
@settings(max_examples=300, deadline=None)
def test_pack_unpack_round_trip_scalars(a, b, c, d):
    x = abi.pack_rect(a, b, c, d)
    assert x.dtype == np.int32
    assert (int(x) < 0) == (d >= 128)                  # kv_hi >= 128 sets bit 31
    assert tuple(int(v) for v in abi.unpack_rect(x)) == (a, b, c, d)
    assert tuple(abi.unpack_rect(int(x))) == (a, b, c, d)   # a plain (negative) Python int
    assert int(x) == abi.pack_rect(a, b, c, d)


@pytest.mark.parametrize("field", range(4))
def test_pack_unpack_round_trip_every_byte_value(field):
    """Every value 0..255 of each field (the others random), NumPy and jnp alike."""
    rng = np.random.default_rng(field)
    f = [rng.integers(0, 256, 256) for _ in range(4)]
    f[field] = np.arange(256)
    x = abi.pack_rect(*f)
    assert x.dtype == np.int32 and (x < 0).any()
    for got, want in zip(abi.unpack_rect(x), f):
        np.testing.assert_array_equal(got, want)
    xj = abi.pack_rect(*(jnp.asarray(v, jnp.int32) for v in f))
    assert xj.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(xj), x)
    for got, want in zip(abi.unpack_rect(xj), f):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_unpack_steps_view_and_full_rect():
    rng = np.random.default_rng(1)
    view = np.stack([rng.integers(0, 10**6, 50)] + [rng.integers(0, 256, 50) for _ in range(4)],
                    axis=1).astype(np.int32)
    z = np.zeros(50, np.int32)
    steps = np.stack([view[:, 0], abi.pack_rect(*view[:, 1:].T), z, z], axis=1)
    assert steps.shape == (50, abi.STEP_COLS) and steps.dtype == np.int32
    np.testing.assert_array_equal(abi.unpack_steps(steps), view)
    np.testing.assert_array_equal(np.asarray(abi.unpack_steps(jnp.asarray(steps))), view)
    assert abi.unpack_steps(steps).shape == (50, abi.VIEW_COLS)
    assert abi.full_rect(128, 128) == int(abi.pack_rect(0, 128, 0, 128)) < 0
    assert abi.unpack_rect(abi.full_rect(64, 96)) == (0, 64, 0, 96)
    with pytest.raises(ValueError, match="steps"):
        abi.unpack_steps(np.zeros((3, 5), np.int32))
    # The grid view of plain steps: one selected cell, cuts at the upper bounds.
    g = abi.unpack_steps(steps, grid=True)
    assert g.shape == (50, abi.VIEW_GRID_COLS)
    np.testing.assert_array_equal(g[:, :abi.VIEW_COLS], view)
    for c in (abi.VIEW_Q1, abi.VIEW_Q2, abi.VIEW_Q3):
        np.testing.assert_array_equal(g[:, c], view[:, abi.VIEW_Q_HI])
    for c in (abi.VIEW_K1, abi.VIEW_K2, abi.VIEW_K3):
        np.testing.assert_array_equal(g[:, c], view[:, abi.VIEW_KV_HI])
    assert (g[:, abi.VIEW_BITS] == 1).all()


@given(st.lists(_BYTE, min_size=6, max_size=6), st.integers(1, (1 << 16) - 1))
@settings(max_examples=300, deadline=None)
def test_pack_unpack_grid_round_trip(cuts, bits):
    qc, kc = sorted(cuts[:3]), sorted(cuts[3:])
    ca, cb = abi.pack_grid(qc, kc, bits)
    assert ca.dtype == np.int32 and cb.dtype == np.int32 and cb != 0
    got = abi.unpack_grid(ca, cb)
    assert [int(v) for v in got[0]] == qc and [int(v) for v in got[1]] == kc
    assert int(got[2]) == bits
    gj = abi.unpack_grid(jnp.asarray(ca), jnp.asarray(cb))
    assert [int(v) for v in gj[0]] == qc and [int(v) for v in gj[1]] == kc and int(gj[2]) == bits
    gi = abi.unpack_grid(int(ca), int(cb))            # plain (possibly negative) Python ints
    assert [int(v) for v in gi[0]] == qc and [int(v) for v in gi[1]] == kc and gi[2] == bits
    # The grid view and step_cells agree with grid_mask, and grid_mask with a brute-force
    # reading of the cells (cell (i, j) covers rows [qb[i], qb[i+1]) x cols [kb[j], kb[j+1])).
    rect = abi.pack_rect(0, 255, 0, 255)
    steps = np.array([[0, rect, ca, cb]], np.int32)
    g = abi.unpack_steps(steps, grid=True)[0]
    assert list(g[abi.VIEW_Q1:abi.VIEW_Q3 + 1]) == qc and list(g[abi.VIEW_K1:abi.VIEW_K3 + 1]) == kc
    assert g[abi.VIEW_BITS] == bits
    rows, cols = np.arange(255)[:, None], np.arange(255)[None, :]
    got = abi.grid_mask(rect, ca, cb, rows, cols)
    qb, kb = [0] + qc + [255], [0] + kc + [255]
    want = np.zeros((255, 255), bool)
    for i in range(4):
        for j in range(4):
            if bits >> (4 * i + j) & 1:
                want[qb[i]:qb[i + 1], kb[j]:kb[j + 1]] = True
    np.testing.assert_array_equal(got, want)
    cells = np.zeros((255, 255), bool)
    for _, a, b, c, d in zip(*abi.step_cells([rect], [ca], [cb])):
        cells[a:b, c:d] = True
    np.testing.assert_array_equal(cells, want)


def test_tiles_above_255_are_rejected():
    m = tj.BlockMask.uniform(512, 512, 64, 64, np.ones((1, 8, 8), bool))
    for tq, tk in ((256, 64), (64, 256)):
        with pytest.raises(ValueError, match="255"):
            build_plan(m, (1, 512, 1, 16), (1, 512, 1, 16), jnp.float32, tile_q=tq, tile_kv=tk)
    p = build_plan(m, (1, 512, 1, 16), (1, 512, 1, 16), jnp.float32, tile_q=128, tile_kv=192)
    view = abi.unpack_steps(p.steps[: p.num_steps])          # tiles at 0, 192, 320 (shifted)
    assert (view[:, abi.VIEW_KV_HI] == 192).all() and (p.steps[: p.num_steps, 1] < 0).all()
    assert sorted(set(view[:, abi.VIEW_KV_LO])) == [0, 64]
    with pytest.raises(ValueError, match="255"):
        abi.check_tiles(64, 256)


def test_rect_shift_constants_pack_the_documented_layout():
    assert (abi.RECT_Q_LO_SHIFT, abi.RECT_Q_HI_SHIFT, abi.RECT_KV_LO_SHIFT,
            abi.RECT_KV_HI_SHIFT) == (0, 8, 16, 24)
    packed = (3 << abi.RECT_Q_LO_SHIFT) | (90 << abi.RECT_Q_HI_SHIFT) \
        | (7 << abi.RECT_KV_LO_SHIFT) | (200 << abi.RECT_KV_HI_SHIFT)
    assert int(abi.pack_rect(3, 90, 7, 200)) == np.int64(packed).astype(np.int32)


# --- abi.check_plan: the one validator of concrete plans ------------------------------------
def _plan(units, steps):
    u = np.zeros((len(units), abi.UNIT_COLS), np.int32)
    u[:] = units
    st = np.zeros((len(steps), abi.STEP_COLS), np.int32)
    for i, (kv, *rect) in enumerate(steps):
        st[i, :2] = kv, abi.pack_rect(*rect)
    return u, st


def test_check_plan_accepts_a_valid_plan_and_reports_fullness():
    # (head, q_start, own_lo, own_hi, ptr, cnt); steps (kv_start, q_lo, q_hi, kv_lo, kv_hi)
    units, steps = _plan([(0, 0, 0, 64, 0, 2), (1, 64, 0, 64, 2, 1), (0, 0, 0, 0, 0, 0)],
                         [(0, 0, 64, 0, 64), (64, 0, 64, 0, 64), (64, 0, 40, 0, 64),
                          (0, 0, 0, 0, 0)])
    kw = dict(num_q_heads=2, q_align=8, kv_align=8)
    assert abi.check_plan(units, steps, 64, 64, 128, 128, **kw) is False   # step 2 is partial
    units[1, abi.UNIT_STEP_CNT] = 0       # only full steps visited (unvisited rows don't count)
    units2 = units.copy()                 # a new array: not the memoised answer
    assert abi.check_plan(units2, steps, 64, 64, 128, 128, **kw) is True
    assert abi.check_plan(units2, steps, 64, 64, 128, 128, **kw) is True    # memoised


@pytest.mark.parametrize("what,edit,match", [
    # Alignment (the Mosaic GPU kernels' TMA fills 8-row SMEM tiles).
    ("q_align", lambda u, s: u.__setitem__((0, abi.UNIT_Q_START), 4), "q_align=8"),
    ("kv_align", lambda u, s: s.__setitem__((1, abi.STEP_KV_START), 60), "kv_align=8"),
    # Heads and step counts in range.
    ("head", lambda u, s: u.__setitem__((1, abi.UNIT_HEAD), 2), "head"),
    ("count", lambda u, s: u.__setitem__((1, abi.UNIT_STEP_CNT), -1), "negative"),
    # Tiles inside the padded lengths, step ranges inside steps.
    ("q bounds", lambda u, s: u.__setitem__((1, abi.UNIT_Q_START), 72), "q_len_padded=128"),
    ("kv bounds", lambda u, s: s.__setitem__((1, abi.STEP_KV_START), 72), "kv_len_padded=128"),
    ("range", lambda u, s: u.__setitem__((1, abi.UNIT_STEP_PTR), 4), "step range"),
    # Where they disagreed, the stricter rule: a padding unit's Q tile (the kernels load every
    # unit's Q tile; Mosaic checked units with steps only) and an unvisited step's K/V tile
    # (the ABI: every tile a plan names lies inside the padded lengths; Mosaic checked visited
    # steps only).
    ("padding unit", lambda u, s: u.__setitem__((2, abi.UNIT_Q_START), 128), "q_len_padded"),
    ("padding unit align", lambda u, s: u.__setitem__((2, abi.UNIT_Q_START), 12), "q_align"),
    ("unvisited step", lambda u, s: s.__setitem__((3, abi.STEP_KV_START), 128),
     "kv_len_padded"),
    ("unvisited step align", lambda u, s: s.__setitem__((3, abi.STEP_KV_START), 4), "kv_align"),
    # The XLA executor visits max_steps steps of each unit.
    ("max_steps", None, "max_steps=1"),
])
def test_check_plan_rejects(what, edit, match):
    units, steps = _plan([(0, 0, 0, 64, 0, 2), (1, 64, 0, 64, 2, 1), (0, 0, 0, 0, 0, 0)],
                         [(0, 0, 64, 0, 64), (64, 0, 64, 0, 64), (64, 0, 40, 0, 64),
                          (0, 0, 0, 0, 0)])
    kw = dict(num_q_heads=2, q_align=8, kv_align=8)
    if edit is None:
        kw["max_steps"] = 1
    else:
        edit(units, steps)
    with pytest.raises(ValueError, match=match):
        abi.check_plan(units, steps, 64, 64, 128, 128, **kw)


def _grid_row(rect, qc, kc, bits):
    ca, cb = abi.pack_grid(qc, kc, bits)
    return abi.pack_rect(*rect), ca, cb


def test_check_plan_validates_grid_steps_and_fullness():
    units, steps = _plan([(0, 0, 0, 64, 0, 2), (0, 0, 0, 0, 0, 0)],
                         [(0, 0, 64, 0, 64), (64, 0, 64, 0, 64), (0, 0, 0, 0, 0)])
    kw = dict(num_q_heads=1, q_align=8, kv_align=8)
    assert abi.check_plan(units, steps, 64, 64, 128, 128, **kw) is True
    # A grid step over the whole tile is not full (it masks by its cells).
    g = steps.copy()
    g[1, 1:] = _grid_row((0, 64, 0, 64), (32, 64, 64), (16, 64, 64), 0b0001_0010)
    assert abi.check_plan(units, g, 64, 64, 128, 128, **kw) is False
    bad = {
        "cuts_a != 0": lambda s: s.__setitem__((0, abi.STEP_CUTS_A), 5),
        "bits == 0": lambda s: s.__setitem__((1, abi.STEP_CUTS_B), 7),
        "row cuts": lambda s: s.__setitem__((1, slice(1, 4)), _grid_row(
            (8, 64, 0, 64), (4, 32, 64), (16, 64, 64), 1)),
        "key cuts": lambda s: s.__setitem__((1, slice(1, 4)), _grid_row(
            (0, 64, 0, 40), (32, 64, 64), (16, 48, 40), 1)),
        "q_lo <= q1 <= q2": lambda s: s.__setitem__((1, slice(1, 4)), _grid_row(
            (0, 64, 0, 64), (40, 32, 64), (16, 64, 64), 1)),
    }
    for what, edit in bad.items():
        s2 = g.copy()
        edit(s2)
        with pytest.raises(ValueError, match="grid step|plain step"):
            abi.check_plan(units, s2, 64, 64, 128, 128, **kw)
        assert abi.grid_problems(s2), what
    # Unvisited rows are checked too (every row of steps is the ABI's).
    s3 = g.copy()
    s3[2, abi.STEP_CUTS_A] = 1
    with pytest.raises(ValueError, match="plain step"):
        abi.check_plan(units, s3, 64, 64, 128, 128, **kw)


def test_check_plan_arrays():
    u, s = np.zeros((2, abi.UNIT_COLS), np.int32), np.zeros((3, abi.STEP_COLS), np.int32)
    abi.check_plan_arrays(u, s, np.zeros((2, 5), np.int32), num_q_heads=2, q_len=5)
    abi.check_plan_arrays(jnp.asarray(u), jnp.asarray(s), None)
    with pytest.raises(ValueError, match=r"units must have shape \[U >= 1, 6\]"):
        abi.check_plan_arrays(u[:, :5], s)
    with pytest.raises(ValueError, match=r"steps must have shape \[S >= 1, 4\]"):
        abi.check_plan_arrays(u, s[:0])
    with pytest.raises(TypeError, match="steps must have dtype int32"):
        abi.check_plan_arrays(u, s.astype(np.int64))
    with pytest.raises(TypeError, match="units must be an int32 array"):
        abi.check_plan_arrays(u.tolist(), s)
    with pytest.raises(ValueError, match=r"row_index must have shape \[2, 5\]"):
        abi.check_plan_arrays(u, s, np.zeros((1, 5), np.int32), num_q_heads=2, q_len=5)


def test_every_planner_plan_passes_check_plan():
    """The planner's plans (padding units and steps included) satisfy the stricter rule."""
    rng = np.random.default_rng(8)
    for i in range(6):
        L, Lk = int(rng.integers(100, 600)), int(rng.integers(100, 600))
        qb = np.unique(np.r_[0, rng.integers(1, L, 6), L])
        kb = np.unique(np.r_[0, rng.integers(1, Lk, 6), Lk])
        mask = tj.BlockMask(qb, kb, rng.random((2, len(qb) - 1, len(kb) - 1)) < 0.5)
        for t in templates.for_backend("mosaic_gpu") + templates.for_backend("xla"):
            for policy in ("merge", "pack"):
                p = build_plan(mask, (1, L, 2, 64), (1, Lk, 1, 64), jnp.bfloat16,
                               tile_q=t.tile_q, tile_kv=t.tile_kv, policy=policy,
                               q_align=t.q_align, kv_align=t.kv_align, template=t.name)
                full = abi.check_plan(p.units, p.steps, p.tile_q, p.tile_kv, p.q_len_padded,
                                      p.kv_len_padded, num_q_heads=2, q_align=t.q_align,
                                      kv_align=t.kv_align, max_steps=p.max_steps)
                assert full == p.all_full


# --- the template table ---------------------------------------------------------------------
KEPT = {
    "mosaic_gpu": ["mgpu_q128_kv128_s2_hm", "mgpu_q128_kv64_s2_hm", "mgpu_q128_kv64x2_s2_hm",
                   "mgpu_q64x2_kv64_s2_hm",
                   "mgpu_q128_kv64_s2_skip", "mgpu_q64x2pp_kv64_s2_hm",
                   "mgpu_q128_kv128_s2_gather", "mgpu_q128_kv128_s2_gather_skip_nopp"],
    "triton": ["triton_q128_kv64_w8_s3_pf_hm", "triton_q128_kv128_w8_s3_pf_hm",
               "triton_q64_kv64_w4_s2", "triton_q128_kv128_w8_s3_gather"],
    "xla": ["xla_64x64", "xla_128x128", "xla_64x128", "xla_128x64"],
}


def test_the_table_holds_exactly_the_kept_templates():
    assert [t.name for t in templates.all_templates()] == sum(KEPT.values(), [])
    assert templates.TEMPLATES == templates.all_templates()
    for backend, names in KEPT.items():
        assert [t.name for t in templates.for_backend(backend)] == names
    for t in templates.all_templates():
        assert templates.get(t.name) is t
        want = {"mosaic_gpu": MosaicConfig, "triton": TritonConfig, "xla": type(None)}
        assert type(t.kernel) is want[t.backend]
    assert not hasattr(Template, "option") and "options" not in {
        f.name for f in dataclasses.fields(Template)}
    assert not hasattr(templates, "register") and not hasattr(templates, "supporting")
    with pytest.raises(ValueError, match="unknown template 'mgpu_q128_kv128_s2'.*known:.*"
                                         "mgpu_q128_kv128_s2_hm"):
        templates.get("mgpu_q128_kv128_s2")                # deleted
    with pytest.raises(ValueError, match="backend"):
        templates.for_backend("cuda")


def test_the_ranking_table_candidates_are_templates():
    import json
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    paths = [*root.glob("plan_tables/*.json"), *root.glob("tessera_jax/plan_tables/*.json")]
    assert paths
    for path in paths:
        for c in json.loads(path.read_text())["candidates"]:
            assert templates.get(c["template"]).backend == "mosaic_gpu", (path, c)


@pytest.mark.parametrize("make,exc,field", [
    (lambda: MosaicConfig(schedule_barrier=1), TypeError, "schedule_barrier"),
    (lambda: MosaicConfig(wg_skip="yes"), TypeError, "wg_skip"),
    (lambda: MosaicConfig(paired=None), TypeError, "paired"),
    (lambda: MosaicConfig(pair_pingpong=1.0), TypeError, "pair_pingpong"),
    (lambda: MosaicConfig(mask_mode="unit"), ValueError, "mask_mode"),
    (lambda: MosaicConfig(mask_mode="none"), ValueError, "mask_mode"),
    (lambda: MosaicConfig(pair_pingpong=True), ValueError, "pair_pingpong"),
    (lambda: MosaicConfig(paired=True, pair_pingpong=True, schedule_barrier=False), ValueError,
     "pair_pingpong"),
    (lambda: MosaicConfig(paired=True, wg_skip=True), ValueError, "wg_skip"),
    (lambda: TritonConfig(num_warps=3), ValueError, "num_warps"),
    (lambda: TritonConfig(num_warps=8.0), TypeError, "num_warps"),
    (lambda: TritonConfig(prefetch=1), TypeError, "prefetch"),
    (lambda: TritonConfig(mask_mode="prefix"), ValueError, "mask_mode"),
])
def test_kernel_configs_validate_their_fields(make, exc, field):
    with pytest.raises(exc, match=field):
        make()


_T = dict(name="t", backend="xla", tile_q=64, tile_kv=64, stages=1, head_dims=(),
          dtypes=("float32",))


@pytest.mark.parametrize("override,exc,field", [
    (dict(name=""), ValueError, "name"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(tile_q=0), ValueError, "tile_q"),
    (dict(tile_kv=256), ValueError, "tile_kv"),
    (dict(stages=2.0), TypeError, "stages"),
    (dict(q_align=True), TypeError, "q_align"),
    (dict(head_dims=[64]), ValueError, "head_dims"),
    (dict(dtypes=("int8",)), ValueError, "dtypes"),
    (dict(min_compute_capability=(9,)), ValueError, "min_compute_capability"),
    (dict(policy="fast"), ValueError, "policy"),
    (dict(unit_order="random"), ValueError, "unit_order"),
    (dict(kernel=TritonConfig()), TypeError, "kernel"),
    (dict(backend="triton", kernel=MosaicConfig()), TypeError, "kernel"),
    (dict(backend="triton", tile_q=48), ValueError, "tile_q"),
    (dict(backend="mosaic_gpu", q_align=8, kv_align=8, stages=2, kernel=MosaicConfig()),
     ValueError, "paired"),                                       # tile_q=64 runs paired only
    (dict(backend="mosaic_gpu", tile_q=128, stages=2, kernel=MosaicConfig()), ValueError,
     "q_align"),
])
def test_templates_validate_their_fields(override, exc, field):
    with pytest.raises(exc, match=field):
        Template(**{**_T, **override})


def test_template_defaults_and_frozen():
    t = Template(**{**_T, "backend": "triton"})
    assert t.kernel == TritonConfig() and t.policy == "merge" and t.unit_order == "interleaved"
    assert Template(**_T).kernel is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tile_q = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.kernel.num_warps = 4
    assert t.supports(64, jnp.float32) and not t.supports(64, jnp.bfloat16)
