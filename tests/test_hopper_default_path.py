"""Issue 32, item 3: the default H200 path lowers no Pallas Triton kernel. Lowered for CUDA on
an abstract H200 (``cuda_lowering``), with this process standing in for a Hopper machine (the
backend table reads compute capability 9.0; ``interpret=False``, as on a GPU), the forward and
backward of a call on default options, and the dynamic-mask builders on default rules, hold
Mosaic GPU calls and no Triton call (``__gpu$xla.gpu.triton``). The Triton backend keeps its
kernels (Ampere/Ada): checked on its own templates.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import tessera_jax as tj
from tessera_jax.masks import dynamic as dm
from tessera_jax.runtime import dispatch

from cuda_lowering import lower_for_h200

TRITON_CALL, MOSAIC_CALL = "__gpu$xla.gpu.triton", "@mosaic_gpu"
B, L, H, D = 1, 512, 2, 128


@pytest.fixture
def hopper(monkeypatch):
    """This process as an H200's: compute capability 9.0 (the backend table then takes Mosaic
    GPU first; the builders' "auto" options take the Mosaic kernels)."""
    monkeypatch.setattr(dispatch, "_gpu_capability", lambda: (9, 0))


def _sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _assert_hopper_path(text):
    assert MOSAIC_CALL in text
    assert TRITON_CALL not in text


def _grads(attend):
    """(out, dq, dk, dv) of ``attend(q, k, v)``: the forward and the backward in one program."""
    def f(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(jnp.ones_like(out)))
    return f


def _static_mask():
    rng = np.random.default_rng(0)
    n = L // 64
    blocks = rng.random((H, n, n)) < 0.4
    blocks[:, np.arange(n), np.arange(n)] = True
    bounds = np.arange(0, L + 1, 64)
    return tj.BlockMask(bounds, bounds, blocks)


def test_default_forward_and_backward_lower_no_triton_kernel(hopper):
    """A static mask on default options: the host route picks the Mosaic GPU backend, whose
    forward, dq, dk/dv and row dots (``pallas_kernels.mosaic.delta``) are Mosaic calls."""
    mask, opts = _static_mask(), tj.Options(interpret=False)
    p = tj.plan(mask, (B, L, H, D), (B, L, H, D), jnp.bfloat16)
    assert dispatch.get_template(p.template).backend == "mosaic_gpu"
    f = _grads(lambda q, k, v: tj.sparse_attention(q, k, v, mask, options=opts))
    text = lower_for_h200(f, _sds(B, L, H, D), _sds(B, L, H, D), _sds(B, L, H, D))
    _assert_hopper_path(text)
    assert text.count(MOSAIC_CALL) >= 4           # forward, row dots, dq, dk/dv


@pytest.mark.parametrize("device", [False, True])
def test_step_pairs_forward_and_backward_lower(hopper, device):
    """The step-pairs template named, on the host route (a static mask's plan) and on the device
    route (its blocks traced): the forward and dq with two steps a stage, dk/dv and the row
    dots pass Mosaic GPU's lowering and layout inference."""
    mask, opts = _static_mask(), tj.Options(interpret=False)
    t = "mgpu_q128_kv64x2_s2_hm"
    if device:
        f = _grads(lambda q, k, v: tj.sparse_attention(
            q, k, v, tj.BlockMask(mask.q_bounds, mask.kv_bounds, jnp.asarray(mask.blocks)),
            template=t, options=opts))
    else:
        f = _grads(lambda q, k, v: tj.sparse_attention(q, k, v, mask, template=t,
                                                       options=opts))
    text = lower_for_h200(f, _sds(B, L, H, D), _sds(B, L, H, D), _sds(B, L, H, D))
    _assert_hopper_path(text)
    assert text.count(MOSAIC_CALL) >= 4           # forward, row dots, dq, dk/dv


BUILDERS = {
    "vsa": lambda q, k: dm.vsa_mask(q, k, dm.VSA(block=64, topk=3)).blocks,
    "sparge_topk": lambda q, k: dm.sparge_mask(q, k, dm.Sparge(topk=0.5)).blocks,
    "sparge": lambda q, k: dm.sparge_mask(q, k, dm.Sparge()).blocks,
    "svg2": lambda q, k: dm.svg2_mask(q, k, dm.SVG2State(
        jnp.zeros((H, 4, B * D)), jnp.zeros((H, 6, B * D))), dm.SVG2(iters=1)).mask.blocks,
}


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_dynamic_mask_builders_lower_no_triton_kernel(hopper, builder):
    """Each builder on its default rule: pooling, top-k and the k-means assignment take the
    Mosaic GPU kernels (2-byte q and k, H * D a multiple of 128, D a multiple of 64)."""
    _assert_hopper_path(lower_for_h200(BUILDERS[builder], _sds(B, L, H, D), _sds(B, L, H, D)))


def test_dynamic_mask_attention_lowers_no_triton_kernel(hopper):
    """A VSA mask built inside the program and attended through the device route, forward and
    backward: one program, no Triton call."""
    rule = dm.VSA(block=64, topk=3)
    opts = tj.Options(interpret=False)

    def attend(q, k, v):
        return tj.sparse_attention(q, k, v, dm.vsa_mask(q, k, rule), options=opts)

    text = lower_for_h200(_grads(attend), _sds(B, L, H, D), _sds(B, L, H, D), _sds(B, L, H, D))
    _assert_hopper_path(text)


def test_triton_backend_keeps_its_kernels(hopper):
    """``backend="triton"`` (Ampere/Ada's, also runnable on Hopper) still lowers its Triton
    forward, backward and row dots."""
    mask, opts = _static_mask(), tj.Options(interpret=False)
    f = _grads(lambda q, k, v: tj.sparse_attention(q, k, v, mask, backend="triton",
                                                   options=opts))
    text = lower_for_h200(f, _sds(B, L, H, D), _sds(B, L, H, D), _sds(B, L, H, D))
    assert TRITON_CALL in text and MOSAIC_CALL not in text
    assert "tessera_row_dots" in text
