"""row_index made on the device from units (what an eager request runs) equals the planner's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import abi as plan_abi

from pallas_kernels.triton import ops as triton_ops
from pallas_kernels.xla import ops as xla_ops
from tessera_jax.planning.planner import build_plan
from tessera_jax.reference import reference_attention

import contract_calls as calls
from strategies import masks, random_qkv


def run_plan(p, q, k, v, scale=0.25):
    """The core over a planner ``Plan`` (as ``sparse_attention`` runs it)."""
    from tessera_jax.runtime import core, host_plans
    return core.attention(q, k, v, host_plans.attention_plan(p), scale, False)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_row_index_from_units_equals_the_planners(data):
    Hkv = data.draw(st.sampled_from([1, 2]))
    Hq = Hkv * data.draw(st.sampled_from([1, 3]))
    Lq, Lkv = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 300))
    mask = data.draw(masks(Lq, Lkv, Hq))
    tile_q = data.draw(st.sampled_from([16, 32, 64]))
    policy = data.draw(st.sampled_from(["keep", "merge", "split", "pack", "auto"]))
    plan = build_plan(mask, (1, Lq, Hq, 8), (1, Lkv, Hkv, 8), jnp.float32, tile_q=tile_q,
                      tile_kv=16, policy=policy, q_align=data.draw(st.sampled_from([1, 16])))
    # One program, as the executors run it (eagerly: ~13 ops, each compiled for the shape).
    got = jax.jit(plan_abi.row_index_from_units, static_argnums=(1, 2, 3))(
        plan.units, Hq, Lq, plan.tile_q)
    assert got.dtype == jnp.int32 and got.shape == (Hq, Lq)
    np.testing.assert_array_equal(np.asarray(got), plan.row_index)


def test_a_wrong_owner_changes_row_index():
    """The check above can fail: moving one unit's owned rows moves its row_index entries."""
    from tessera_jax.mask import BlockMask
    mask = BlockMask.uniform(96, 64, 32, 32, np.ones((1, 3, 2), bool))
    plan = build_plan(mask, (1, 96, 1, 8), (1, 64, 1, 8), jnp.float32, tile_q=32, tile_kv=32,
                      policy="keep")
    units = plan.units.copy()
    units[0, plan_abi.UNIT_OWN_HI] -= 1
    got = np.asarray(plan_abi.row_index_from_units(units, 1, 96, 32))
    assert (got != plan.row_index).sum() == 1


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_kernels_take_row_index_none(backend):
    B, Lq, Lkv, Hq, Hkv, D = 2, 75, 90, 4, 2, 16
    rng = np.random.default_rng(3)
    from tessera_jax.mask import BlockMask
    mask = BlockMask([0, 20, 64, 75], [0, 7, 50, 90], rng.random((Hq, 3, 3)) < 0.6)
    q, k, v = random_qkv(B, Lq, Lkv, Hq, Hkv, D, "float32", 4)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=32, tile_kv=32, policy="merge")
    ops, t = ((xla_ops, calls.xla_template(32, 32)) if backend == "xla"
              else (triton_ops, calls.triton_template(32, 32)))
    run = lambda ri: ops.forward(  # noqa: E731
        q, k, v, plan_abi.PassPlan(plan.units, plan.steps, ri, 32, 32, plan.q_len_padded,
                                   plan.kv_len_padded, plan.max_steps),
        template=t, scale=0.25, return_lse=True)
    out, lse = run(None)
    out_h, lse_h = run(plan.row_index)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_h))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_h))
    ref, ref_lse = reference_attention(q, k, v, mask, scale=0.25, return_lse=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5, rtol=2e-5)


def test_mosaic_kernel_takes_row_index_none():
    """The Mosaic GPU kernel under its CPU interpreter, row_index None vs the host array."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import params as _interp
        interp = _interp.InterpretGPUParams()
    except Exception as e:  # pragma: no cover
        pytest.skip(f"Mosaic GPU interpreter not importable: {e!r}")
    from pallas_kernels import templates
    from pallas_kernels.mosaic import ops as mosaic_ops
    from tessera_jax.mask import BlockMask
    t = templates.get("mgpu_q128_kv64_s2_hm")
    B, Lq, Lkv, Hq, Hkv, D = 1, 200, 140, 2, 1, 64
    rng = np.random.default_rng(5)
    mask = BlockMask([0, 40, 64, 200], [0, 64, 100, 140], rng.random((Hq, 3, 3)) < 0.6)
    q, k, v = random_qkv(B, Lq, Lkv, Hq, Hkv, D, "bfloat16", 6)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=t.tile_q, tile_kv=t.tile_kv,
                      policy="merge", q_align=t.q_align, kv_align=t.kv_align, template=t.name)
    run = lambda ri: mosaic_ops.forward(  # noqa: E731
        q, k, v, plan_abi.PassPlan(plan.units, plan.steps, ri, t.tile_q, t.tile_kv,
                                   plan.q_len_padded, plan.kv_len_padded, plan.max_steps),
        template=t, scale=D ** -0.5, return_lse=True, interpret=interp)
    out, lse = run(None)
    out_h, lse_h = run(plan.row_index)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_h, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_h))


def test_eager_runner_never_makes_the_host_row_index():
    """A planner-built plan run eagerly by a kernel backend copies units + steps only:
    Plan.row_index (a property made on first use) stays unmade; under jit it is a constant."""
    import jax
    import tessera_jax as tj
    from tessera_jax.mask import BlockMask
    mask = BlockMask([0, 30, 64, 90], [0, 20, 64, 80],
                     np.random.default_rng(14).random((1, 3, 3)) < 0.7)
    q, k, v = random_qkv(1, 90, 80, 2, 1, 16, "float32", 2)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="triton_q128_kv64_w8_s3_pf_hm")
    out = run_plan(p, q, k, v)
    assert "row_index" not in vars(p)
    ref = reference_attention(q, k, v, mask, scale=0.25)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    jitted = jax.jit(lambda q, k, v: run_plan(p, q, k, v))
    np.testing.assert_allclose(np.asarray(jitted(q, k, v)), np.asarray(ref), atol=2e-5, rtol=2e-5)
    assert "row_index" in vars(p)


def test_large_steps_go_to_the_device_in_pieces():
    """kernel_runner.put_plan: pieces joined on the device equal the host arrays."""
    from tessera_jax.runtime import kernel_runner as kb
    transfers = kb.Transfers(piece_bytes=1 << 10)
    rng = np.random.default_rng(0)
    units = rng.integers(-2**31, 2**31 - 1, (37, plan_abi.UNIT_COLS), dtype=np.int64).astype(np.int32)
    for rows in (10, 700, 1001, 5003):
        steps = rng.integers(-2**31, 2**31 - 1, (rows, plan_abi.STEP_COLS),
                             dtype=np.int64).astype(np.int32)
        u, s = kb.put_plan(units, steps, transfers)
        np.testing.assert_array_equal(np.asarray(u), units)
        np.testing.assert_array_equal(np.asarray(s), steps)
        assert s.dtype == jnp.int32 and s.shape == steps.shape


def test_runner_under_a_trace_with_concrete_q_caches_nothing_traced():
    """q closed over by a jit over k, v only: the runner must not keep device arrays made under
    that trace (they would be tracers; the next eager call raised UnexpectedTracerError)."""
    import jax
    import tessera_jax as tj
    from tessera_jax.mask import BlockMask
    mask = BlockMask([0, 30, 64, 90], [0, 20, 64, 80],
                     np.random.default_rng(4).random((1, 3, 3)) < 0.7)
    q, k, v = random_qkv(1, 90, 80, 2, 1, 16, "float32", 3)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="triton_q128_kv64_w8_s3_pf_hm")
    ref = np.asarray(reference_attention(q, k, v, mask, scale=0.25))
    first = run_plan(p, q, k, v)                                        # NumPy into the call
    traced = jax.jit(lambda k, v: run_plan(p, q, k, v))(k, v)
    again = run_plan(p, q, k, v)                                        # device copies now
    for out in (first, traced, again, run_plan(p, q, k, v)):
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


def test_runner_puts_a_large_plan_in_pieces_on_its_first_call(monkeypatch):
    """A plan over ``Transfers.direct_max_bytes`` goes to the device by ``put_plan`` on its
    first eager call (in pieces), once; the result matches the reference."""
    import tessera_jax as tj
    from pallas_kernels import templates
    from pallas_kernels.triton import ops
    from tessera_jax.mask import BlockMask
    from tessera_jax.planning.plan import host_pass
    from tessera_jax.runtime import kernel_runner as kb
    transfers = kb.Transfers(piece_bytes=16, direct_max_bytes=0)
    puts = []
    real = kb.put_plan
    monkeypatch.setattr(kb, "put_plan", lambda *a: puts.append(a[1].shape) or real(*a))
    mask = BlockMask([0, 30, 64, 90], [0, 20, 64, 80],
                     np.random.default_rng(5).random((2, 3, 3)) < 0.8)
    q, k, v = random_qkv(1, 90, 80, 2, 2, 16, "float32", 4)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="triton_q128_kv64_w8_s3_pf_hm")
    assert p.steps.nbytes >= 2 * 16               # at least two pieces
    ref = np.asarray(reference_attention(q, k, v, mask, scale=0.25))
    for _ in range(2):
        out = kb.run(ops, host_pass(p), q, k, v, template=templates.get(p.template), scale=0.25,
                     return_lse=False, transfers=transfers)
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)
    assert puts == [p.steps.shape]


def test_gathers_take_the_token_major_row_index():
    """``token_major``: a host row_index's contiguous transpose (the same object for the same
    array; None for a jax array); the output and unit gathers give the same rows with it,
    sentinel rows included."""
    rng = np.random.default_rng(7)
    H, L, U, T, D = 3, 10, 4, 8, 2
    ri = rng.integers(0, U * T + 1, (H, L)).astype(np.int32)          # U * T: the sentinel
    t = plan_abi.token_major(ri)
    assert t.flags.c_contiguous and (t == ri.T).all() and plan_abi.token_major(ri) is t
    assert plan_abi.token_major(jnp.asarray(ri)) is None
    out_u = jnp.asarray(rng.standard_normal((1, U, T, D)), jnp.float32)
    lse_u = jnp.asarray(rng.standard_normal((1, U, T)), jnp.float32)
    want = plan_abi.gather_rows(out_u, lse_u, jnp.asarray(ri))
    got = plan_abi.gather_rows(out_u, lse_u, jnp.asarray(ri), t)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    from pallas_kernels import backward_rows
    np.testing.assert_array_equal(np.asarray(backward_rows.gather_units(out_u, None, t)),
                                  np.asarray(want[0]))
    assert not np.asarray(want[0])[0][ri.T == U * T].any()


def test_unit_rows_through_the_host_index():
    """``host_unit_index`` (NumPy units: a constant) gathers the rows ``unit_rows`` computes
    from the units on the device; device units get no host index."""
    from pallas_kernels import backward_rows
    rng = np.random.default_rng(8)
    H, Lp, U, T = 3, 48, 7, 16
    units = np.zeros((U, plan_abi.UNIT_COLS), np.int32)
    units[:, plan_abi.UNIT_HEAD] = rng.integers(0, H, U)
    units[:, plan_abi.UNIT_Q_START] = rng.integers(0, Lp - T + 1, U) // 8 * 8
    x = jnp.asarray(rng.standard_normal((2, H, Lp)), jnp.float32)
    idx = backward_rows.host_unit_index(units, T, Lp)
    want = backward_rows.unit_rows(x, jnp.asarray(units), T)
    np.testing.assert_array_equal(np.asarray(backward_rows.unit_rows(x, units, T, idx)),
                                  np.asarray(want))
    assert backward_rows.host_unit_index(jnp.asarray(units), T, Lp) is None
