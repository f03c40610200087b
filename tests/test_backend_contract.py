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
from tessera_jax.runtime.host_plans import transposed_mask

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


def _with(p, **kw):
    """A PassPlan of planner Plan ``p`` with some fields replaced (trusted unless all_full)."""
    f = dict(units=p.units, steps=p.steps, row_index=None, tile_q=p.tile_q, tile_kv=p.tile_kv,
             q_len_padded=p.q_len_padded, kv_len_padded=p.kv_len_padded,
             max_steps=p.max_steps, all_full=True)
    f.update(kw)
    return abi.PassPlan(**f)


def _bad_inputs(family, t, q, k, v, p):
    """(args of forward, error, match) the shared checks refuse."""
    other = jnp.bfloat16 if q.dtype != jnp.bfloat16 else jnp.float16
    k2 = jnp.concatenate([k, k], 2)                # Hkv = 2
    bad_steps = np.array(p.steps)
    bad_steps[0, abi.STEP_KV_START] = 3            # not a multiple of kv_align = 8
    bad_head = np.array(p.units)
    bad_head[0, abi.UNIT_HEAD] = q.shape[2]
    past = np.zeros((p.units.shape[0] + 1, abi.UNIT_COLS), np.int32)
    past[:-1] = p.units
    past[-1, abi.UNIT_Q_START] = p.q_len_padded    # a padding unit's Q tile past the end
    cases = [
        ((q[0], k, v, _with(p)), ValueError, "q must have rank 4"),
        ((q, k, v[:, :-1], _with(p)), ValueError, "v must have the shape of k"),
        ((jnp.concatenate([q, q[:, :, :1]], 2), k2, k2, _with(p)), ValueError,
         "Hq=3 must be a multiple of Hkv=2"),
        ((q, k.astype(other), v, _with(p)), TypeError, "share one dtype"),
        ((q.astype(jnp.int32), k, v, _with(p)), TypeError, "q has dtype"),
        ((q, k, v, p), TypeError, "PassPlan"),
        ((q, k, v, _with(p, units=p.units[:, :5])), ValueError, "units must have shape"),
        ((q, k, v, _with(p, steps=abi.unpack_steps(p.steps))), ValueError,
         rf"steps must have shape \[S >= 1, {abi.STEP_COLS}\]"),
        ((q, k, v, _with(p, steps=p.steps.astype(np.int64))), TypeError, "steps"),
        ((q, k, v, _with(p, row_index=p.row_index[:1])), ValueError, "row_index"),
        ((q, k, v, _with(p, q_len_padded=8)), ValueError, "q_len_padded"),
        ((q, k, v, _with(p, kv_len_padded=p.kv_len_padded - 1)), ValueError, "kv_len_padded"),
        ((q, k, v, _with(p, units=bad_head, all_full=None)), ValueError, "a head is outside"),
        ((q, k, v, _with(p, units=past, all_full=None)), ValueError, "q_len_padded"),
    ]
    if t.kv_align > 1:
        cases.append(((q, k, v, _with(p, steps=bad_steps, all_full=None)), ValueError,
                      "kv_align"))
    if "float32" not in t.dtypes:
        cases.append((tuple(x.astype(jnp.float32) for x in (q, k, v)) + (_with(p),),
                      ValueError, "dtypes"))
    if t.head_dims:
        d = max(t.head_dims) + 8
        wide = tuple(jnp.zeros(x.shape[:3] + (d,), x.dtype) for x in (q, k, v))
        cases.append((wide + (_with(p),), ValueError, "head dims"))
    return cases


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bad_input_is_refused_by_every_family(family):
    """The shared checks (``contract.check_pass``, ``abi.check_plan`` of an untrusted plan)
    name the argument, whatever the family."""
    ops, t, tol, mask, (q, k, v, do), p = problem(family)
    for args, err, match in _bad_inputs(family, t, q, k, v, p):
        with pytest.raises(err, match=match):
            ops.forward(*args, template=t, scale=0.125)
    pp = pass_plan(p)
    with pytest.raises(ValueError, match="scale"):
        ops.forward(q, k, v, pp, template=t, scale=-1.0)
    with pytest.raises(ValueError, match="unknown template"):
        ops.forward(q, k, v, pp, template="nope", scale=0.125)
    with pytest.raises(ValueError, match="do must have the shape of q"):
        ops.dq(q, k, v, do[:, :-1], None, None, pp, template=t, scale=0.125)


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


def test_a_pass_plan_is_a_pytree_traced_under_jit():
    """A PassPlan is a jit argument (a device plan): its arrays trace, its statics stay keys
    of the compiled executable; the forward equals the eager one on the host plan."""
    import jax
    ops, t, tol, mask, (q, k, v, do), p = problem("xla")
    pp = pass_plan(p)
    leaves, _ = jax.tree_util.tree_flatten(pp)
    assert len(leaves) == 3                       # units, steps, row_index
    f = jax.jit(lambda q, k, v, plan: ops.forward(q, k, v, plan, template=t, scale=0.125))
    want = ops.forward(q, k, v, pp, template=t, scale=0.125)
    np.testing.assert_array_equal(np.asarray(f(q, k, v, pp)), np.asarray(want))
    no_rows = abi.PassPlan(p.units, p.steps, None, p.tile_q, p.tile_kv, p.q_len_padded,
                           p.kv_len_padded, p.max_steps, p.all_full)
    np.testing.assert_array_equal(np.asarray(f(q, k, v, no_rows)), np.asarray(want))
