"""The gather policy on the device (``planning.device_gather``): plans of traced selections
over static bounds cover the mask exactly (variable and 1-token blocks, shared and per-head
masks, empty rows, Lq != Lkv), pass the ABI's checks, trace once for new selections, report
overflow, and run on the XLA executor against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

import tessera_jax as tj
from pallas_kernels import abi, templates
from pallas_kernels.xla import ops as xla_ops
from tessera_jax.planning import device_gather as dg, planner
from test_gathered_steps import _coverage, _ref64, gather_masks as masks


def _plan(mask, Hq, tq, tk, max_blocks=4, capacity=None):
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    kw = dict(q_len=mask.Lq, kv_len=mask.Lkv, tile_q=tq, tile_kv=tk, max_blocks=max_blocks)
    if capacity is None:
        capacity = dg.step_bound(qb, kb, **kw)[1] * mask.blocks.shape[0]
    # jit: one compile per shape is faster than the eager ops.
    return jax.jit(lambda b: dg.plan_gather_on_device(b, qb, kb, num_q_heads=Hq,
                                                      capacity=capacity, **kw))(
        jnp.asarray(mask.blocks))


class _Shape:                  # what tests/test_gathered_steps._coverage reads of a plan
    def __init__(self, p, mask, Hq):
        self.units, self.steps = np.asarray(p.units), np.asarray(p.steps)
        self.num_units = len(self.units)
        self.tile_q, self.tile_kv = p.tile_q, p.tile_kv
        self.q_len_padded, self.kv_len_padded = p.q_len_padded, p.kv_len_padded
        self.shape = type("S", (), dict(num_q_heads=Hq, q_len=mask.Lq, kv_len=mask.Lkv))


def _token_mask(mask, Hq):
    """int [Hq, Lq, Lkv]: the token-level selection (shared or per-head bounds)."""
    want = mask.head_blocks(Hq)
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    out = []
    for h, w in enumerate(want):
        q_, k_ = (b if b.ndim == 1 else b[h if len(b) > 1 else 0] for b in (qb, kb))
        rq = np.searchsorted(q_, np.arange(mask.Lq), "right") - 1
        rk = np.searchsorted(k_, np.arange(mask.Lkv), "right") - 1
        out.append(w[rq][:, rk])
    return np.stack(out).astype(np.int64)


@given(masks(), st.sampled_from([(128, 128), (64, 128), (128, 64), (64, 64)]),
       st.sampled_from([2, 4]))
# 6 examples, random each run: each compiles the gather planner (~2 s on the 2-core runner).
@settings(max_examples=6, deadline=None)
def test_device_gather_plans_cover_the_mask_exactly_once(mt, tiles, max_blocks):
    mask, Hq, _ = mt
    tq, tk = tiles
    p, ok = _plan(mask, Hq, tq, tk, max_blocks)
    assert bool(ok)
    abi.check_plan(np.asarray(p.units), np.asarray(p.steps), tq, tk, p.q_len_padded,
                   p.kv_len_padded, num_q_heads=Hq, q_align=8, kv_align=8,
                   max_steps=p.max_steps, gather=True)
    np.testing.assert_array_equal(_coverage(_Shape(p, mask, Hq)), _token_mask(mask, Hq))


def _unit_steps(p):
    """Per unit (in plan order): its step rows [cnt, STEP_COLS] and their word rows."""
    units, steps = np.asarray(p.units), np.asarray(p.steps)
    wr = abi.gather_word_rows(p.tile_q, p.tile_kv)
    out = []
    for u in units:
        rows = steps[u[abi.UNIT_STEP_PTR]: u[abi.UNIT_STEP_PTR] + u[abi.UNIT_STEP_CNT]]
        words = [steps[r[abi.STEP_CUTS_A] // abi.STEP_COLS:][:wr].tobytes() for r in rows]
        out.append((tuple(int(x) for x in u[:abi.UNIT_STEP_PTR]), rows, words))
    return out


@given(masks(), st.sampled_from([(128, 128), (128, 64)]), st.booleans())
# 4 examples, random each run: each compiles the gather planner twice (~2-4 s each on the
# 2-core runner).
@settings(max_examples=4, deadline=None)
def test_row_groups_interleave_steps_and_units_come_heaviest_first(mt, tiles, traced):
    """``row_group=64`` (warpgroup step skipping): each unit has the steps of the plan without
    it, in ``gather.interleave_groups``' order (steps meeting one 64-row half alternate
    between the halves, then those meeting both), the plan still exact; units come in
    ``schedule.order_units``' head-major order (cost class descending), with or without."""
    from tessera_jax.planning import gather as host_gather, schedule
    mask, Hq, _ = mt
    tq, tk = tiles
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    kw = dict(q_len=mask.Lq, kv_len=mask.Lkv, tile_q=tq, tile_kv=tk)
    cap = dg.step_bound(qb, kb, **kw)[1] * mask.blocks.shape[0]
    wrap = jnp.asarray if traced else (lambda x: x)
    plans = {}
    for rg in (0, 64):
        plans[rg], ok = jax.jit(lambda b, q, k, rg=rg: dg.plan_gather_on_device(
            b, q, k, num_q_heads=Hq, capacity=cap, row_group=rg, **kw))(
            jnp.asarray(mask.blocks), wrap(qb), wrap(kb))
        assert bool(ok)
    p = plans[64]
    abi.check_plan(np.asarray(p.units), np.asarray(p.steps), tq, tk, p.q_len_padded,
                   p.kv_len_padded, num_q_heads=Hq, q_align=8, kv_align=8,
                   max_steps=p.max_steps, gather=True)
    np.testing.assert_array_equal(_coverage(_Shape(p, mask, Hq)), _token_mask(mask, Hq))
    m = schedule.DEFAULT_COST_MODEL
    step = m.step_ns_total(tq, tk, 128, 2)
    for rg, plan in plans.items():
        units = np.asarray(plan.units).astype(np.int64)
        per = _unit_steps(plan)
        part = np.array([(r[:, abi.STEP_CUTS_B] != abi.GATHER_FULL_FLAG).sum()
                         for _, r, _ in per])
        cost = m.unit_ns + units[:, abi.UNIT_STEP_CNT] * step + part * m.mask_ns
        cls = np.floor(np.log2(np.maximum(cost, 1.0)) * 8)
        assert (np.diff(cls) <= 0).all()
        if rg:
            for _, rows, _ in per:
                q_lo, q_hi, _, _ = abi.unpack_rect(rows[:, abi.STEP_RECT].astype(np.int64))
                r = np.arange(tq)
                sel = (r >= q_lo[:, None]) & (r < q_hi[:, None])
                np.testing.assert_array_equal(host_gather.interleave_groups(sel, rg),
                                              np.arange(len(rows)))
    # The same units with the same steps (each step's row but its words' place, and its
    # words), reordered.
    def key(per):
        return sorted((u, sorted((np.delete(r, abi.STEP_CUTS_A).tobytes(), w)
                                 for r, w in zip(rows, words))) for u, rows, words in per)

    assert key(_unit_steps(plans[0])) == key(_unit_steps(plans[64]))


def test_traced_selections_share_one_trace_and_overflow_is_reported():
    rng = np.random.default_rng(3)
    qb = np.r_[0, np.cumsum(rng.integers(20, 90, 8))]
    kb = np.r_[0, np.cumsum(rng.integers(5, 40, 12))]
    Lq, Lk = int(qb[-1]), int(kb[-1])
    kw = dict(num_q_heads=2, q_len=Lq, kv_len=Lk, tile_q=128, tile_kv=128, capacity=64)
    traces = []

    @jax.jit
    def plan(blocks):
        traces.append(1)
        p, ok = dg.plan_gather_on_device(blocks, qb, kb, **kw)
        return p.units, p.steps, ok

    for seed in range(3):
        blocks = np.random.default_rng(seed).random((2, 8, 12)) < 0.4
        units, steps, ok = plan(jnp.asarray(blocks))
        eager, ok2 = dg.plan_gather_on_device(jnp.asarray(blocks), qb, kb, **kw)
        np.testing.assert_array_equal(units, eager.units)
        np.testing.assert_array_equal(steps, eager.steps)
        assert bool(ok) and bool(ok2)
    assert len(traces) == 1
    dense = np.ones((2, 8, 12), bool)
    p, ok = jax.jit(lambda b: dg.plan_gather_on_device(b, qb, kb, **dict(kw, capacity=2)))(
        jnp.asarray(dense))
    assert not bool(ok)              # past capacity: reported, and what is kept reads in bounds
    abi.check_plan(np.asarray(p.units), np.asarray(p.steps), 128, 128, p.q_len_padded,
                   p.kv_len_padded, num_q_heads=2, q_align=8, kv_align=8, gather=True)
    with pytest.raises(ValueError, match="q_bounds must be"):
        dg.plan_gather_on_device(jnp.asarray(dense), qb[:-1], kb, **kw)
    for bad in (48, -64, True, 64.0):           # must divide tile_q (128), an int >= 0
        with pytest.raises(ValueError, match="row_group must be"):
            dg.plan_gather_on_device(jnp.asarray(dense), qb, kb, row_group=bad, **kw)


@given(masks(), st.sampled_from([(128, 128), (64, 128)]), st.booleans(),
       st.sampled_from([1, 2, 4]), st.sampled_from([1 << 26, 1]))
# 8 examples (was 25, then 15): each compiles the gather planner anew (~4 s on the 2-core
# runner).
@settings(max_examples=8, deadline=None)
def test_traced_and_per_head_bounds(mt, tiles, per_head, max_blocks, max_elements):
    """Traced bounds (and per-head ones: each head its own partition of the same lengths),
    any block sizes (tiles meeting more than ``max_blocks`` query blocks split into units),
    mask heads planned together or one at a time (``max_elements``): ``ok`` and exact."""
    mask, Hq, _ = mt
    tq, tk = tiles
    qb, kb = np.asarray(mask.q_bounds), np.asarray(mask.kv_bounds)
    blocks = np.asarray(mask.head_blocks(Hq)) if per_head else np.asarray(mask.blocks)
    Hm = blocks.shape[0]
    if per_head and Hm > 1:          # head 1: its query blocks in the other order
        sizes = np.diff(qb)[::-1]
        qbs = np.stack([qb] + [np.r_[0, np.cumsum(sizes)]] * (Hm - 1))
        blocks = blocks.copy()
        blocks[1:] = blocks[1:, ::-1]
    else:
        qbs = qb[None]
    kbs = np.broadcast_to(kb, (qbs.shape[0], len(kb)))
    kw = dict(q_len=mask.Lq, kv_len=mask.Lkv, tile_q=tq, tile_kv=tk, max_blocks=max_blocks)
    # The capacity of traced bounds from their shapes, inside the program (``step_bound``
    # run eagerly dispatches its structure op by op: ~200 small compiles per example).
    p, ok = jax.jit(lambda b, q, k: dg.plan_gather_on_device(
        b, q, k, num_q_heads=Hq, capacity=dg.step_bound(q, k, **kw)[1] * Hm,
        max_elements=max_elements, **kw))(
        jnp.asarray(blocks), jnp.asarray(qbs), jnp.asarray(kbs))
    abi.check_plan(np.asarray(p.units), np.asarray(p.steps), tq, tk, p.q_len_padded,
                   p.kv_len_padded, num_q_heads=Hq, q_align=8, kv_align=8,
                   max_steps=p.max_steps, gather=True)
    assert bool(ok)
    want = tj.BlockMask(qbs if qbs.shape[0] > 1 else qb, kbs if qbs.shape[0] > 1 else kb,
                        blocks)
    np.testing.assert_array_equal(_coverage(_Shape(p, want, Hq)), _token_mask(want, Hq))


@pytest.mark.parametrize("gqa", [1, 2])
def test_device_gather_plan_runs_on_the_xla_executor(gqa):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gather import mask_var_clusters

    Lq, Lk, H, D = 700, 530, 4, 16
    m = mask_var_clusters(Lq, H, q_mean=60, kv_mean=20, seed=3, kv_len=Lk)
    p, ok = _plan(m, H, 128, 128)
    assert bool(ok)
    ks = jax.random.split(jax.random.key(gqa), 3)
    q = jax.random.normal(ks[0], (1, Lq, H, D))
    k, v = (jax.random.normal(x, (1, Lk, H // gqa, D)) for x in ks[1:])
    out = xla_ops.forward(q, k, v, p, template=templates.get("xla_128x128"), scale=0.3)
    np.testing.assert_allclose(out, _ref64(q, k, v, m, 0.3), atol=2e-5)
    # Computed no more than the host policy's plan at the same segments.
    host = planner.build_plan(m, q.shape, k.shape, q.dtype, tile_q=128, tile_kv=128,
                              policy="gather").stats()["computed_interactions"]
    dev = int(np.sum(np.asarray(p.units)[:, abi.UNIT_STEP_CNT])) * 128 * 128
    assert dev <= 1.25 * host, (dev, host)


def test_device_route_plans_gather_templates_with_static_bounds():
    """A device mask (traced blocks, static shared bounds) on the gather template: the route
    plans the forward with the gather policy (gathered steps), and forward and gradients match
    the reference (Mosaic GPU in interpret mode: forward and dq gather; dk/dv over the
    transposed plan)."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gather import mask_var_clusters
    from tessera_jax.runtime import device_route, dispatch
    from tessera_jax.select import device as select_device
    from tessera_jax.validation import check_qkv

    Lq, Lk, H, D = 136, 160, 2, 64
    m = mask_var_clusters(Lq, H, q_mean=60, kv_mean=20, density=0.3, seed=6, kv_len=Lk)
    dev = tj.BlockMask(m.q_bounds, m.kv_bounds, jnp.asarray(m.blocks))
    t = dispatch.get_template("mgpu_q128_kv128_s2_gather")
    consts = select_device.static_parts(dev)
    assert select_device.gathers_on_device(t)
    ks = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(x, (1, L, H, D)).astype(jnp.bfloat16)
               for x, L in zip(ks, (Lq, Lk, Lk)))
    # The route's plans in one program (run eagerly, op by op: ~400 small compiles).
    fwd = jax.jit(lambda q, k, b: device_route.device_plans(
        q, k, *(c.array for c in consts[:2]), b, consts=consts, t=t, capacity=0,
        decide=False, budget=0).fwd)(q, k, dev.blocks)
    cb = np.asarray(fwd.steps)[np.asarray(fwd.units)[:, abi.UNIT_STEP_PTR]]
    assert abi.is_gather(cb[:, abi.STEP_CUTS_B]).any()
    f = lambda q, k, v: device_route.attention(q, k, v, dev, check_qkv(q, k, v),   # noqa
                                               "mosaic_gpu", t, 0.125, False)
    out, vjp = jax.vjp(f, q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, rvjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, m, scale=0.125), *f32)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)
    do = jax.random.normal(jax.random.key(5), out.shape).astype(out.dtype)
    for a, b in zip(vjp(do), rvjp(do.astype(jnp.float32))):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=5e-2)


def test_device_route_gathers_with_traced_bounds():
    """Traced bounds on the gather template: the route's plan is the gather policy's on
    fixed tiles (``ok`` decides, on the device, between it and the exact path); forward
    against the reference (Mosaic GPU in interpret mode)."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret")
    from tessera_jax.runtime import device_route, dispatch
    from tessera_jax.validation import check_qkv

    rng = np.random.default_rng(12)
    qb = np.r_[0, np.cumsum(rng.integers(30, 60, 4))]
    kb = np.r_[0, np.cumsum(rng.integers(15, 35, 6))]
    Lq, Lk, H, D = int(qb[-1]), int(kb[-1]), 2, 64
    blocks = rng.random((H, 4, 6)) < 0.5
    blocks[:, :, 0] = True
    m = tj.BlockMask(qb, kb, blocks)
    t = dispatch.get_template("mgpu_q128_kv128_s2_gather")
    ks = jax.random.split(jax.random.key(6), 3)
    q, k, v = (jax.random.normal(x, (1, L, H, D)).astype(jnp.bfloat16)
               for x, L in zip(ks, (Lq, Lk, Lk)))
    f = jax.jit(lambda q, k, v, a, b, c: device_route.attention(
        q, k, v, tj.BlockMask(a, b, c), check_qkv(q, k, v), "mosaic_gpu", t, 0.125, False))
    out = f(q, k, v, jnp.asarray(qb), jnp.asarray(kb), jnp.asarray(blocks))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               tj.reference_attention(*f32, m, scale=0.125), atol=2e-2)


def _perhead_small_blocks(rng, Lq, Lk, H):
    """Per-head bounds [H, n + 1] of small and 1-token blocks (both heads the same number of
    blocks, each its own partition) and blocks [H, nq, nk] selecting ~40%."""
    def parts(L, hi):
        cuts = np.unique(np.r_[rng.integers(1, L, L // hi * 2), rng.integers(1, 40, 3)])
        return np.r_[0, cuts, L]

    qbs = [parts(Lq, 30) for _ in range(H)]
    kbs = [parts(Lk, 20) for _ in range(H)]
    nq, nk = min(len(b) for b in qbs) - 1, min(len(b) for b in kbs) - 1
    qbh = np.stack([np.r_[b[:nq], Lq] for b in qbs])
    kbh = np.stack([np.r_[b[:nk], Lk] for b in kbs])
    return qbh, kbh, rng.random((H, nq, nk)) < 0.4


#: (Lq, Lk, H, D) of the per-head small-block cases below (``_perhead_case``).
_PERHEAD = (136, 104, 2, 64)


def _perhead_case(seed: int, key: int, keys: int = 3):
    """``_perhead_small_blocks`` at ``_PERHEAD``'s shape (NumPy rng ``seed``) and bf16 q, k,
    v from ``keys`` splits of ``jax.random.key(key)``: (qbh, kbh, blocks, q, k, v, the keys)."""
    Lq, Lk, H, D = _PERHEAD
    qbh, kbh, blocks = _perhead_small_blocks(np.random.default_rng(seed), Lq, Lk, H)
    ks = jax.random.split(jax.random.key(key), keys)
    q, k, v = (jax.random.normal(x, (1, L, H, D)).astype(jnp.bfloat16)
               for x, L in zip(ks, (Lq, Lk, Lk)))
    return qbh, kbh, blocks, q, k, v, ks


def test_device_gather_option_runs_static_per_head_bounds():
    """``Options(device_gather="irregular")`` with per-head irregular bounds given as NumPy
    constants (static, not shared) and traced blocks inside a jitted call: the route's static
    fit of the gather policy is decided at trace time (no
    traced bool), and the gathering template's output matches the reference (Mosaic GPU,
    interpret mode; the H100 run of make test-gpu found the trace-time failure)."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret")
    from tessera_jax.runtime import device_route
    from tessera_jax.validation import check_qkv

    qbh, kbh, blocks, q, k, v, _ = _perhead_case(5, 2)
    opts = tj.Options(device_gather="irregular", interpret=True)
    assert device_route.choose(tj.BlockMask(qbh, kbh, jnp.asarray(blocks)), check_qkv(q, k, v),
                               "mosaic_gpu", None, opts).name == \
        "mgpu_q128_kv128_s2_gather_skip_nopp"
    f = jax.jit(lambda q, k, v, b: device_route.attention(
        q, k, v, tj.BlockMask(qbh, kbh, b), check_qkv(q, k, v), "mosaic_gpu", None, 0.125,
        False, opts))
    out = f(q, k, v, jnp.asarray(blocks))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = tj.reference_attention(*f32, tj.BlockMask(qbh, kbh, blocks), scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)


def test_device_gather_option_runs_per_head_bounds_of_small_blocks():
    """``Options(device_gather="traced")``: per-head traced bounds of small and 1-token blocks
    (tiles meeting more than 4 query blocks, chunks several key blocks) run the gathering
    template (Mosaic GPU, interpret mode); forward and gradients against the reference."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret")
    from tessera_jax.runtime import device_route
    from tessera_jax.validation import check_qkv

    Lq, Lk = _PERHEAD[:2]
    qbh, kbh, blocks, q, k, v, ks = _perhead_case(21, 8, keys=4)
    t0 = np.arange(0, Lq, 128)
    meets = [np.searchsorted(b, np.minimum(t0 + 128, Lq) - 1, "right")
             - np.searchsorted(b, t0, "right") + 1 for b in qbh]
    assert max(x.max() for x in meets) > 4             # tiles split into several units
    c0 = np.arange(0, Lk, 8)
    assert max((np.searchsorted(b, np.minimum(c0 + 8, Lk) - 1, "right")
                - np.searchsorted(b, c0, "right")).max() for b in kbh) >= 2
    m = tj.BlockMask(qbh, kbh, blocks)
    opts = tj.Options(device_gather="traced", interpret=True)
    dev = tj.BlockMask(jnp.asarray(qbh), jnp.asarray(kbh), jnp.asarray(blocks))
    assert device_route.choose(dev, check_qkv(q, k, v), "mosaic_gpu", None, opts).name == \
        "mgpu_q128_kv128_s2_gather_skip_nopp"
    f = lambda q, k, v, a, b, c: device_route.attention(   # noqa: E731
        q, k, v, tj.BlockMask(a, b, c), check_qkv(q, k, v), "mosaic_gpu", None, 0.125, False,
        opts)
    args = (jnp.asarray(qbh), jnp.asarray(kbh), jnp.asarray(blocks))
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, *args), q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, rvjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, m, scale=0.125), *f32)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)
    do = jax.random.normal(ks[3], out.shape).astype(out.dtype)
    for a, b in zip(vjp(do), rvjp(do.astype(jnp.float32))):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=5e-2)


def test_svg2_layout_runs_on_the_gathering_template():
    """What ``Options(device_gather="traced")`` does in the SVG2 loop: the rule's per-head
    cluster bounds and blocks (traced, GQA) through the device route on the gathering template
    (Mosaic GPU, interpret mode), inside one jitted builder + attention call, against the
    reference over the permuted tokens."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret")
    from tessera_jax.masks import dynamic as dm
    from tessera_jax.runtime import device_route
    from tessera_jax.validation import check_qkv

    B, L, Hq, Hkv, D = 1, 192, 4, 2, 64
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (B, L, Hq, D)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(x, (B, L, Hkv, D)).astype(jnp.bfloat16) for x in ks[1:3])
    rule = dm.SVG2(q_clusters=6, kv_clusters=20, init_iters=3, iters=1, top_p=0.5)
    state = dm.svg2_init(q, k, ks[3], rule)
    opts = tj.Options(device_gather="traced", interpret=True)

    @jax.jit
    def call(q, k, v, state):
        lay = dm.svg2_mask(q, k, state, rule)
        qp = jnp.take_along_axis(q, lay.q_perm.T[None, :, :, None], axis=1)
        kp, vp = (jnp.take_along_axis(x, lay.kv_perm.T[None, :, :, None], axis=1)
                  for x in (k, v))
        out = device_route.attention(qp, kp, vp, lay.mask, check_qkv(qp, kp, vp),
                                     "mosaic_gpu", None, 0.125, False, opts)
        return out, qp, kp, vp, lay.mask.q_bounds, lay.mask.kv_bounds, lay.mask.blocks

    out, qp, kp, vp, qb, kb, blocks = call(q, k, v, state)
    m = tj.BlockMask(np.asarray(qb), np.asarray(kb), np.asarray(blocks))
    dev = tj.BlockMask(jnp.asarray(qb), jnp.asarray(kb), jnp.asarray(blocks))
    assert device_route.choose(dev, check_qkv(qp, kp, vp), "mosaic_gpu", None, opts).kernel.gather
    ref = tj.reference_attention(*(x.astype(jnp.float32) for x in (qp, kp, vp)), m, scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)
    assert 0 < np.asarray(blocks).mean() < 1


def test_an_overflowing_device_plan_runs_the_gathering_template():
    """``Options.device_overflow``: per-head traced bounds of small blocks whose selection
    overflows the plain plan's bitmap room (a budget of one step, decided on the device) run
    the gathering template ("gather": its output bit for bit) rather than the exact path
    ("exact", the default); both against the reference, forward and gradients (Mosaic GPU,
    interpret mode)."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret")
    import dataclasses

    from tessera_jax.runtime import device_route
    from tessera_jax.select import device as select_device
    from tessera_jax.validation import check_qkv

    qbh, kbh, blocks, q, k, v, ks = _perhead_case(31, 9, keys=4)
    shape = check_qkv(q, k, v)
    args = (jnp.asarray(qbh), jnp.asarray(kbh), jnp.asarray(blocks))
    base = tj.Options(device_gather="never", interpret=True)
    t = device_route.choose(tj.BlockMask(*args), shape, "mosaic_gpu", None, base)
    assert not select_device.gathers_on_device(t)
    one = dataclasses.replace(base, bitmap_budget_bytes=select_device.bitmap_step_bytes(t),
                              device_overflow="gather")
    assert device_route.choose(tj.BlockMask(*args), shape, "mosaic_gpu", None, one) == t
    gather = templates.get(select_device.GATHER_TEMPLATES["mosaic_gpu"])

    def run(opts, template=None):
        return jax.jit(lambda q, k, v, *a: device_route.attention(
            q, k, v, tj.BlockMask(*a), shape, "mosaic_gpu", template, 0.125, False, opts))

    plan = jax.jit(lambda *a: device_route.device_plans(
        q, k, *a, consts=(None, None, None), t=t, capacity=1, decide=True,
        budget=one.bitmap_budget_bytes))(*args)
    assert not bool(plan.ok)                               # the plain plan overflows
    out = run(one)(q, k, v, *args)
    named = run(base, gather)(q, k, v, *args)
    exact = run(dataclasses.replace(one, device_overflow="exact"))(q, k, v, *args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(named, np.float32))
    assert not np.array_equal(np.asarray(exact, np.float32), np.asarray(named, np.float32))
    m = tj.BlockMask(qbh, kbh, blocks)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, rvjp = jax.vjp(lambda q, k, v: tj.reference_attention(q, k, v, m, scale=0.125), *f32)
    for o in (out, exact):
        np.testing.assert_allclose(np.asarray(o, np.float32), ref, atol=2e-2)
    _, vjp = jax.vjp(lambda q, k, v: device_route.attention(
        q, k, v, tj.BlockMask(*args), shape, "mosaic_gpu", None, 0.125, False, one), q, k, v)
    do = jax.random.normal(ks[3], ref.shape).astype(jnp.bfloat16)
    for a, b in zip(vjp(do), rvjp(do.astype(jnp.float32))):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=5e-2)
