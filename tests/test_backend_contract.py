"""The backend contract (``pallas_kernels.{mosaic,triton,xla}.ops``): one set of signatures,
and forward / dq / dkv of every family against the float64 oracle on one small plan with
plain, grid and bitmap steps (GQA, empty rows). The Triton kernels run in interpret mode and
the Mosaic GPU ones under its interpreter (``interpret=None``: picked on a CPU)."""

import inspect

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import abi, backward_rows, contract, templates
from pallas_kernels.mosaic import ops as mosaic_ops
from pallas_kernels.triton import ops as triton_ops
from pallas_kernels.xla import ops as xla_ops
from tessera_jax.planning.planner import build_plan
from tessera_jax.runtime.autodiff import transposed_mask

from strategies import random_qkv
from test_backward import _fine_mask, _steps_kinds, assert_grads, cotangents, oracle

try:
    from jax._src.pallas.mosaic_gpu.interpret import params as _interp  # noqa: F401
    HAVE_MOSAIC_INTERPRETER = True
except Exception:  # pragma: no cover
    HAVE_MOSAIC_INTERPRETER = False

FAMILIES = {
    "xla": (xla_ops, "xla_128x64", "float32", 2e-4),
    "triton": (triton_ops, "triton_q128_kv64_w8_s3_pf_hm", "float32", 2e-3),
    "mosaic": (mosaic_ops, "mgpu_q128_kv64_s2_hm", "float16", 2e-2),
}
FAMILY_PARAMS = [
    pytest.param("xla"),
    pytest.param("triton", marks=pytest.mark.slow),
    pytest.param("mosaic", marks=[pytest.mark.slow, pytest.mark.skipif(
        not HAVE_MOSAIC_INTERPRETER, reason="no Mosaic GPU interpreter")]),
]
SHAPE = dict(B=1, Lq=136, Lkv=90, Hq=2, Hkv=1, D=64)


def pass_plan(p, all_full="plan"):
    """The ``abi.PassPlan`` of a planner ``Plan`` (trusted: its ``all_full``, unless given)."""
    return abi.PassPlan(p.units, p.steps, p.row_index, p.tile_q, p.tile_kv, p.q_len_padded,
                        p.kv_len_padded, p.max_steps,
                        p.all_full if all_full == "plan" else all_full)


def problem(family):
    ops, name, dtype, tol = FAMILIES[family]
    t = templates.get(name)
    s = SHAPE
    rng = np.random.default_rng(7)
    mask = _fine_mask(rng, s["Lq"], s["Lkv"], s["Hq"])
    q, k, v = random_qkv(s["B"], s["Lq"], s["Lkv"], s["Hq"], s["Hkv"], s["D"], dtype, 3)
    do, _ = cotangents(s["B"], s["Lq"], s["Hq"], s["D"], jnp.dtype(dtype), 3, False)
    p = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=t.tile_q, tile_kv=t.tile_kv,
                   q_align=t.q_align, kv_align=t.kv_align, template=t.name)
    return ops, t, tol, mask, (q, k, v, do), p


def test_the_families_share_one_signature():
    for fn in ("forward", "dq", "dkv", "dkv_tiles"):
        sigs = {str(inspect.signature(getattr(m, fn))) for m in (mosaic_ops, triton_ops,
                                                                    xla_ops)}
        assert len(sigs) == 1, (fn, sigs)
    for m in (mosaic_ops, triton_ops, xla_ops):
        assert isinstance(m.FIRST_ORDER, bool) and isinstance(m.FOLD_VMAP, bool)
        assert m.PAIRED_DKV_TILES is None or len(m.PAIRED_DKV_TILES) == 4
        assert m.row_dots is None or callable(m.row_dots)


def test_interpret_is_explicit_or_picked_by_the_default_backend():
    assert contract.triton_interpret(None) == contract.default_interpret()
    assert contract.triton_interpret(False) is False
    assert contract.mosaic_interpret(False) is False
    with pytest.raises(TypeError, match="interpret"):
        contract.triton_interpret("yes")


def test_a_template_of_another_family_is_refused():
    ops, t, tol, mask, (q, k, v, do), p = problem("xla")
    with pytest.raises(ValueError, match="not 'triton'"):
        triton_ops.forward(q, k, v, pass_plan(p), template=t, scale=0.1)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_forward_dq_dkv_match_the_oracle(family):
    ops, t, tol, mask, (q, k, v, do), p = problem(family)
    scale = SHAPE["D"] ** -0.5
    want = oracle(q, k, v, mask, do, scale=scale)
    for pp in (pass_plan(p), pass_plan(p, all_full=None)):     # trusted, then checked
        out, lse = ops.forward(q, k, v, pp, template=t, scale=scale, return_lse=True)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want[1]))
        fin = np.isfinite(want[1])
        np.testing.assert_allclose(np.asarray(lse)[fin], want[1][fin], atol=tol)
        np.testing.assert_allclose(np.asarray(out, np.float64), want[0], atol=5 * tol)

    lse = backward_rows.lse_for_backward(jnp.asarray(want[1], jnp.float32))
    delta = jnp.asarray(np.einsum("bqhd,bqhd->bhq", want[0], np.asarray(do, np.float64)),
                        jnp.float32)
    dq = ops.dq(q, k, v, do, lse, delta, pass_plan(p), template=t, scale=scale)
    s = SHAPE
    tq, tk, qa, ka = ops.dkv_tiles(t, s["D"])
    tp = build_plan(transposed_mask(mask), (s["B"], s["Lkv"], s["Hq"], s["D"]),
                    (s["B"], s["Lq"], s["Hq"], s["D"]), q.dtype, tile_q=tq, tile_kv=tk,
                    q_align=qa, kv_align=ka, unit_order="head_major")
    assert all(_steps_kinds(p, tp))                  # grid and bitmap steps in the plans
    dk, dv = ops.dkv(q, k, v, do, lse, delta, pass_plan(tp), template=t, scale=scale)
    assert_grads([dq, dk, dv], want[2:], 5 * tol)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bad_input_is_refused_by_every_family(family):
    """The shared checks (``contract.check_pass``) name the argument, whatever the family."""
    ops, t, tol, mask, (q, k, v, do), p = problem(family)
    pp = pass_plan(p)
    kw = dict(template=t, scale=0.125)
    cases = [
        ((q[0], k, v, pp), ValueError, "q must have rank 4"),
        ((q, k, v[:, :-1], pp), ValueError, "v must have the shape of k"),
        ((q, k.astype(jnp.bfloat16 if q.dtype != jnp.bfloat16 else jnp.float16), v, pp),
         TypeError, "share one dtype"),
        ((q.astype(jnp.int32), k, v, pp), TypeError, "q has dtype"),
        ((q, k, v, p), TypeError, "PassPlan"),
        ((q, k, v, abi.PassPlan(p.units[:, :5], p.steps, None, p.tile_q, p.tile_kv,
                                p.q_len_padded, p.kv_len_padded, p.max_steps, True)),
         ValueError, "units must have shape"),
        ((q, k, v, abi.PassPlan(p.units, p.steps, None, p.tile_q, p.tile_kv, 8,
                                p.kv_len_padded, p.max_steps, True)),
         ValueError, "q_len_padded"),
    ]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            ops.forward(*args, **kw)
    with pytest.raises(ValueError, match="scale"):
        ops.forward(q, k, v, pp, template=t, scale=-1.0)
    with pytest.raises(ValueError, match="do must have the shape of q"):
        ops.dq(q, k, v, do[:, :-1], None, None, pp, **kw)


@pytest.mark.parametrize("family", ["mosaic", "triton"])
@pytest.mark.parametrize("pass_", ["forward", "dq", "dkv"])
def test_gpu_passes_lower_for_cuda(family, pass_):
    """Every pass of both GPU families takes the real GPU path (not an interpreter) when
    lowered for CUDA on an abstract H200 (``interpret=False``), with traced plan arrays."""
    import jax
    from cuda_lowering import lower_for_h200
    ops, name, dtype, _ = FAMILIES[family]
    t = templates.get(name)
    sds = jax.ShapeDtypeStruct
    B, L, Hq, Hkv, D = 1, 384, 4, 2, 128
    q = sds((B, L, Hq, D), jnp.dtype(dtype))
    kv = sds((B, L - 40, Hkv, D), jnp.dtype(dtype))
    units, steps = sds((12, abi.UNIT_COLS), jnp.int32), sds((40, abi.STEP_COLS), jnp.int32)
    if pass_ == "dkv":
        tq, tk = ops.dkv_tiles(t, D)[:2]
    else:
        tq, tk = t.tile_q, t.tile_kv
    plan = lambda u, s: abi.PassPlan(u, s, None, tq, tk, L, L, 4)         # noqa: E731
    fns = {
        "forward": lambda q, k, v, u, s: ops.forward(q, k, v, plan(u, s), template=t, scale=0.1,
                                                     return_lse=True, interpret=False),
        "dq": lambda q, k, v, u, s: ops.dq(q, k, v, q, rows_of(q), rows_of(q), plan(u, s),
                                           template=t, scale=0.1, interpret=False),
        "dkv": lambda q, k, v, u, s: ops.dkv(q, k, v, q, rows_of(q), rows_of(q), plan(u, s),
                                             template=t, scale=0.1, interpret=False),
    }
    text = lower_for_h200(fns[pass_], q, kv, kv, units, steps)
    assert ("mosaic_gpu" if family == "mosaic" else "__gpu$xla.gpu.triton") in text


def rows_of(q):
    """Zero lse / delta rows [B, Hq, Lq] for q."""
    return jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
