"""The Mosaic GPU forward storing its units' owned rows in place (``abi.PassPlan.rows_owned``,
``kernel.forward(direct=True)``) against the unit-major store and its gather, and against the
dense reference; which plans claim that their units own every row."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import jax
import jax.numpy as jnp

import tessera_jax as tj
from pallas_kernels import abi, contract, templates
from pallas_kernels.mosaic import kernel as mosaic_kernel
from pallas_kernels.mosaic import ops as mosaic_ops
from tessera_jax.planning import device as device_planner
from tessera_jax.planning.plan import host_pass
from tessera_jax.planning.planner import build_plan
from tessera_jax.runtime import core, host_plans

from cuda_lowering import assert_mosaic_lowers
from strategies import random_qkv
from test_mosaic_kernel import INTERPRET, _check

TEMPLATES = ["mgpu_q128_kv64_s2_hm", "mgpu_q128_kv128_s2_hm", "mgpu_q64x2_kv64_s2_hm",
             "mgpu_q128_kv64_s2_skip", "mgpu_q128_kv128_s2_gather"]


def _units(rows):
    """Units [(head, q_start, own_lo, own_hi)] as an ABI array (no steps)."""
    u = np.zeros((len(rows), abi.UNIT_COLS), np.int32)
    for i, (h, s, lo, hi) in enumerate(rows):
        u[i, [abi.UNIT_HEAD, abi.UNIT_Q_START, abi.UNIT_OWN_LO, abi.UNIT_OWN_HI]] = h, s, lo, hi
    return u


def test_units_own_all_rows_counts_each_heads_rows():
    # Two heads of 200 rows; the last tile moved back to 72 owns rows 128 .. 199 only.
    full = [(h, s, lo, 128) for h in range(2) for s, lo in ((0, 0), (72, 56))]
    assert abi.units_own_all_rows(_units(full), 2, 200)
    assert not abi.units_own_all_rows(_units(full[:-1]), 2, 200)          # head 1 short
    gap = [(0, 0, 0, 100), (0, 72, 56, 128), (1, 0, 0, 128), (1, 72, 56, 128)]
    assert not abi.units_own_all_rows(_units(gap), 2, 200)               # rows 100 .. 127
    # Rows past q_len count for nothing: a 256-row tile list covers 200 rows, not 256.
    over = [(0, 0, 0, 128), (0, 128, 0, 128)]
    assert abi.units_own_all_rows(_units(over), 1, 200)
    assert not abi.units_own_all_rows(_units(over), 1, 260)
    assert not abi.units_own_all_rows(np.zeros((0, abi.UNIT_COLS), np.int32), 1, 8)


def _mask(rng, Lq, Lkv, Hm, nq, nkv, density, empty_row):
    qb = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, Lq), nq - 1, replace=False)), Lq])
    kb = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, Lkv), nkv - 1, replace=False)), Lkv])
    blocks = rng.random((Hm, len(qb) - 1, len(kb) - 1)) < density
    blocks[..., rng.integers(len(kb) - 1)] |= True            # every query row selects a key
    if empty_row:
        blocks[:, rng.integers(len(qb) - 1)] = False
    return tj.BlockMask(qb, kb, blocks)


@pytest.mark.skipif(INTERPRET is None, reason="Mosaic GPU interpreter not importable")
# 4 examples, random each run, and the one below, on sequences of Lq <= 260, Lkv <= 200
# (ragged lengths, several tiles): the interpreter's time is per step (~0.5 s on the 2-core box)
# and each example runs two kernels.
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31 - 1), template=st.sampled_from(TEMPLATES),
       D=st.sampled_from([64, 128]), Lq=st.integers(70, 260), Lkv=st.integers(40, 200),
       gqa=st.booleans(), per_head=st.booleans(), empty_row=st.sampled_from([False] * 3 + [True]))
# A gathering template's plan of one step row: its producer read the words of a plain step
# past the end of ``steps`` (the interpreter's out-of-bounds check; common.copy_starts).
@example(seed=155, template="mgpu_q128_kv128_s2_gather", D=64, Lq=70, Lkv=40, gqa=False,
         per_head=False, empty_row=False)
def test_direct_store_equals_the_gathered_output(seed, template, D, Lq, Lkv, gqa, per_head,
                                                 empty_row):
    """Ragged lengths (padded q, a moved-back last tile), unaligned block edges (own ranges
    inside 64-row slabs), 1-token blocks, GQA, per-head masks: the in-place store gives the
    gathered output bit for bit, and the reference's (rows selecting nothing: 0 and -inf)."""
    rng = np.random.default_rng(seed)
    t = templates.get(template)
    Hkv = 1
    Hq = 2 if gqa else 1
    nq = int(rng.integers(1, min(Lq, 12)))
    nkv = int(rng.integers(1, min(Lkv, 9)))
    mask = _mask(rng, Lq, Lkv, Hq if per_head else 1, nq + 1, nkv + 1, 0.5,
                 empty_row and nq > 1)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, jnp.bfloat16, seed)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=t.tile_q, tile_kv=t.tile_kv,
                      policy=t.policy, q_align=t.q_align, kv_align=t.kv_align, template=t.name)
    # Every query row selecting a key: every row owned (an empty one may be owned too, by a
    # unit whose tile holds selected rows: it stores zeros there).
    if np.all(np.asarray(mask.blocks).any(axis=-1)):
        assert plan.rows_owned
    # Partly owned slabs in place too (the ladder), whatever the rule would pick.
    p = dataclasses.replace(host_pass(plan), partial_groups=0.0)
    assert p.rows_owned == plan.rows_owned
    run = lambda pp: mosaic_ops.forward(q, k, v, pp, template=t, scale=D ** -0.5,  # noqa: E731
                                        return_lse=True, interpret=INTERPRET)
    out, lse = run(p)
    ref_out, ref_lse = tj.reference_attention(q, k, v, mask, return_lse=True)
    _check(out, lse, ref_out, ref_lse, jnp.bfloat16)
    if p.rows_owned:
        assert mosaic_ops._direct(p, t, D)
        gathered = run(dataclasses.replace(p, rows_owned=False))
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(gathered[0], np.float32))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(gathered[1]))


@pytest.mark.parametrize("template", TEMPLATES)
def test_direct_store_lowers_for_cuda(template):
    """The in-place store (whole slabs from the tiled buffer, the ladder from the untiled one)
    passes Mosaic GPU lowering and layout inference, cross-lowered on this CPU machine."""
    t = templates.get(template)
    L, Hq, Hkv, D = 333, 2, 1, 128
    mask = tj.BlockMask.uniform(L, L, 37, 37,
                                np.random.default_rng(0).random((Hq, 9, 9)) < 0.5)
    plan = build_plan(mask, (1, L, Hq, D), (1, L, Hkv, D), jnp.bfloat16, tile_q=t.tile_q,
                      tile_kv=t.tile_kv, policy=t.policy, q_align=8, kv_align=8,
                      template=t.name)
    sds = jax.ShapeDtypeStruct
    args = (sds((1, L, Hq, D), jnp.bfloat16), sds((1, L, Hkv, D), jnp.bfloat16),
            sds((1, L, Hkv, D), jnp.bfloat16), sds(plan.units.shape, jnp.int32),
            sds(plan.steps.shape, jnp.int32), sds(plan.row_index.shape, jnp.int32))
    f = lambda *a: contract.forward_call(  # noqa: E731
        *a, kernel=mosaic_kernel.forward,
        cfg=mosaic_kernel.KernelConfig.from_template(t, "cond"),
        q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded, head_dim=D,
        scale=0.1, return_lse=True, interpret=False, direct=True)
    assert_mosaic_lowers(f, *args)


def test_templates_fit_shared_memory_with_the_direct_store():
    n = 0
    for t in templates.all_templates():
        if t.backend == "mosaic_gpu":
            n += 1
            cfg = mosaic_kernel.KernelConfig.from_template(t, "cond")
            for D in t.head_dims:
                assert mosaic_kernel.smem_bytes(cfg, D, direct=True) <= mosaic_kernel.MAX_SMEM
    assert n >= len(TEMPLATES)


# 4 examples (was 8): each compiles a planner program (~5 s on the 2-core runner).
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), per_head=st.booleans(), traced=st.booleans())
def test_device_plans_own_every_row(seed, per_head, traced):
    """The device planner's claim (``rows_owned``): its units own each row < Lq of each head,
    whatever the selection (rows selecting nothing too) and bounds."""
    rng = np.random.default_rng(seed)
    Lq, Lkv, Hq = int(rng.integers(65, 600)), int(rng.integers(65, 600)), 2
    Hb = Hq if per_head else 1
    nq, nk = int(rng.integers(2, 9)), int(rng.integers(2, 9))

    def bounds(L, n):
        return np.stack([np.r_[0, np.sort(rng.choice(np.arange(1, L), n - 1, replace=False)), L]
                         for _ in range(Hb)]).astype(np.int32)

    qb, kb = bounds(Lq, nq), bounds(Lkv, nk)
    blocks = jnp.asarray(rng.random((Hb, nq, nk)) < 0.4)
    plan_fn = lambda b, q_, k_: device_planner.plan_on_device(  # noqa: E731
        b, q_, k_, num_q_heads=Hq, q_len=Lq, kv_len=Lkv, tile_q=128, tile_kv=64,
        bitmap_capacity=Hb * -(-Lq // 128) * -(-Lkv // 64))       # room for any bitmap
    if traced:
        plan, ok = jax.jit(plan_fn)(blocks, jnp.asarray(qb), jnp.asarray(kb))
    else:
        plan, ok = jax.jit(lambda b: plan_fn(b, qb, kb))(blocks)
    assert plan.rows_owned
    if bool(ok):
        assert abi.units_own_all_rows(np.asarray(plan.units), Hq, Lq)


@pytest.mark.skipif(INTERPRET is None, reason="Mosaic GPU interpreter not importable")
@pytest.mark.parametrize("template", ["mgpu_q128_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm"])
def test_store_in_place_option_gives_the_same_outputs_and_gradients(template):
    """``Options.store_in_place`` on (the forward and, where its buffer fits, dq store rows in
    place) and off (unit-major tiles gathered): the same out, lse and gradients, bit for bit,
    and in-place stores really ran (the pass plan owns every row; dq's fits for kv64 tiles
    unpaired)."""
    rng = np.random.default_rng(7)
    Lq, Lkv, Hq = 203, 150, 2
    mask = _mask(rng, Lq, Lkv, 1, 9, 7, 0.5, False)
    q, k, v = random_qkv(1, Lq, Lkv, Hq, 1, 64, jnp.bfloat16, 11)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    t = templates.get(template)
    plan = tj.plan(mask, q.shape, k.shape, q.dtype, template=template)
    res = []
    for in_place in (True, False):
        opts = tj.Options(interpret=True, store_in_place=in_place)

        def f(q, k, v):
            return core.attention(q, k, v, host_plans.attention_plan(plan, opts), 64 ** -0.5,
                                  True, opts)
        (out, lse), vjp = jax.vjp(f, q, k, v)
        res.append((out, lse) + vjp((do, jnp.zeros_like(lse))))
    ref_out, ref_lse = tj.reference_attention(q, k, v, mask, return_lse=True)
    _check(res[0][0], res[0][1], ref_out, ref_lse, jnp.bfloat16)
    for a, b in zip(*res):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    p = host_pass(plan)
    assert p.rows_owned and mosaic_ops._direct(p, t, 64)
    assert mosaic_ops._dq_direct(p, t, 64)
    # At head_dim 128 dq's untiled buffer fits beside one ring of kv64 tiles only.
    assert mosaic_ops._dq_direct(p, t, 128) == (not t.kernel.paired)
    assert not tj.Options(store_in_place=False).store_in_place
    with pytest.raises(TypeError, match="store_in_place"):
        tj.Options(store_in_place=1)


def test_dq_direct_store_lowers_for_cuda():
    """dq's in-place store (q128 x kv64 tiles, head_dim 128: its buffer fits) passes Mosaic
    GPU lowering, cross-lowered on this CPU machine."""
    from pallas_kernels.mosaic import backward as mb
    L, Hq, D, U, S = 256, 2, 128, 4, 16
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((1, L, Hq, D), bf), sds((1, L, 1, D), bf), sds((1, L, 1, D), bf),
            sds((1, L, Hq, D), bf), sds((1, U, 128), jnp.float32),
            sds((1, U, 128), jnp.float32), sds((U, abi.UNIT_COLS), jnp.int32),
            sds((S, abi.STEP_COLS), jnp.int32))
    f = lambda *a: mb.dq_call(*a, tile_q=128, tile_kv=64, paired=False,  # noqa: E731
                              mode="cond", scale=0.1, interpret=False, direct=True)
    assert_mosaic_lowers(f, *args)


def test_partial_groups_count_and_the_in_place_rule():
    """``abi.partial_groups`` counts the owned 64-row groups owned in part (rows past q_len
    count as owned); the Mosaic forward stores in place only below ``DIRECT_MAX_PARTIAL``."""
    # Tile 0 owns rows 0..127 (two whole groups), tile 1 (moved back to 72) 56..127 of its
    # own: one partial group, one whole; q_len 200: its end is the length.
    assert abi.partial_groups([0, 72], [0, 56], [128, 128], 128, 200) == 1 / 4
    assert abi.partial_groups([0, 128], [0, 0], [128, 72], 128, 200) == 0.0
    assert abi.partial_groups([0], [0], [100], 128, 300) == 1 / 2
    rng = np.random.default_rng(3)
    t = templates.get("mgpu_q64x2_kv64_s2_hm")
    mask = _mask(rng, 2000, 900, 1, 60, 20, 0.3, False)      # ~33-token query blocks
    plan = tj.plan(mask, (1, 2000, 2, 128), (1, 900, 2, 128), jnp.bfloat16, template=t.name)
    p = host_pass(plan)
    assert p.rows_owned and p.partial_groups == plan.partial_groups > mosaic_ops.DIRECT_MAX_PARTIAL
    assert not mosaic_ops._direct(p, t, 128)
    assert mosaic_ops._direct(dataclasses.replace(p, partial_groups=0.0), t, 128)
