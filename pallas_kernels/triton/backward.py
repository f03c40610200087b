"""Backward kernels on the Pallas Triton lowering: dq over the forward plan, dk/dv over the
transposed plan (``pallas_kernels.backward_rows`` says which is which).

FlashAttention-2's backward split in two launches, each one program per (unit, batch) like the
forward kernel (``pallas_kernels.triton.kernel``), each step masked as the forward masks it
(a plain step's rectangle, a grid step's cells, a bitmap step's bits; full steps unmasked):

* ``dq``: the unit's Q, dO tile and each row's lse / delta; per step (a K/V tile)
  P = exp2(S * scale * log2 e - lse * log2 e), dP = dO V^T, dS = P (dP - delta), dQ += dS K;
* ``dkv``: the unit's K, V tile (keys of query head UNIT_HEAD's K/V head); per step (a query
  tile) P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q. dk / dv are
  written per query head in float32 and summed over each K/V head's group outside.

Rows with no selected key carry lse = +inf (``backward_rows.lse_for_backward``): P is 0 there.
On CPU the kernels run in interpret mode (``interpret=None`` picks it without a GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import abi
from pallas_kernels import step_masks
from pallas_kernels.contract import LOG2E
from pallas_kernels.triton.kernel import padded_head_dim

__all__ = ["dq_call", "dkv_call", "dkv_tiles"]



def dkv_tiles(head_dim: int) -> tuple[int, int]:
    """(keys per unit, queries per step) of the transposed plan: 64 x 64 keeps the two
    float32 accumulators (dK, dV) and the K / V tile of a program in registers up to D = 128
    (tuned on the GPU later; any power of two in [16, 128] is correct)."""
    return (64, 64) if padded_head_dim(head_dim) <= 128 else (32, 32)


def _warps(tile_q: int) -> int:
    return 8 if tile_q >= 128 else 4


def _dq_kernel(units_ref, steps_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
               *, tile_q: int, tile_kv: int, group: int, scale: float, mode: str,
               num_steps: int, precision, gather: bool):
    u = pl.program_id(0)
    head = units_ref[u, abi.UNIT_HEAD]
    q_start = units_ref[u, abi.UNIT_Q_START]
    ptr, cnt = units_ref[u, abi.UNIT_STEP_PTR], units_ref[u, abi.UNIT_STEP_CNT]
    kv_head = head if group == 1 else lax.div(head, jnp.int32(group))
    q = q_ref[pl.ds(q_start, tile_q), head, :]                       # [tile_q, Dp]
    do = do_ref[pl.ds(q_start, tile_q), head, :]
    lse2 = lse_ref[...] * LOG2E                                     # [tile_q], log2 units
    delta = delta_ref[...]
    row = lax.broadcasted_iota(jnp.int32, (tile_q, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, tile_kv), 1)
    qk_scale = scale * LOG2E

    def body(s, acc):
        keys = step_masks.step_key_rows(steps_ref, s, col, tile_kv=tile_kv,
                                        num_steps=num_steps, gather=gather)
        k = k_ref[keys, kv_head, :]                                  # [tile_kv, Dp]
        v = v_ref[keys, kv_head, :]
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)      # f32 [tile_q, tile_kv]
        qk = step_masks.masked_block(steps_ref, s, qk, row, col, mode=mode, tile_q=tile_q,
                                     tile_kv=tile_kv, num_steps=num_steps, gather=gather)
        p = jnp.exp2(qk * qk_scale - lse2[:, None])
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        return acc + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

    acc = lax.fori_loop(ptr, ptr + cnt, body, jnp.zeros((tile_q, q.shape[-1]), jnp.float32))
    plgpu.store(dq_ref, (acc * scale).astype(dq_ref.dtype))


def _dkv_kernel(units_ref, steps_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, tile_q: int, tile_kv: int, group: int, scale: float, mode: str,
                num_steps: int, precision):
    u = pl.program_id(0)
    head = units_ref[u, abi.UNIT_HEAD]                               # a query head
    k_start = units_ref[u, abi.UNIT_Q_START]                         # the unit's first key
    ptr, cnt = units_ref[u, abi.UNIT_STEP_PTR], units_ref[u, abi.UNIT_STEP_CNT]
    kv_head = head if group == 1 else lax.div(head, jnp.int32(group))
    k = k_ref[pl.ds(k_start, tile_q), kv_head, :]                    # [tile_q keys, Dp]
    v = v_ref[pl.ds(k_start, tile_q), kv_head, :]
    row = lax.broadcasted_iota(jnp.int32, (tile_q, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, tile_kv), 1)
    qk_scale = scale * LOG2E

    def body(s, carry):
        dk, dv = carry
        q_start = steps_ref[s, abi.STEP_KV_START]                    # the step's first query
        q = q_ref[pl.ds(q_start, tile_kv), head, :]                  # [tile_kv queries, Dp]
        do = do_ref[pl.ds(q_start, tile_kv), head, :]
        lse2 = lse_ref[head, pl.ds(q_start, tile_kv)] * LOG2E
        delta = delta_ref[head, pl.ds(q_start, tile_kv)]
        st = plgpu.dot(k, q, trans_b=True, precision=precision)      # S^T [keys, queries]
        st = step_masks.masked_block(steps_ref, s, st, row, col, mode=mode, tile_q=tile_q,
                                     tile_kv=tile_kv, num_steps=num_steps)
        pt = jnp.exp2(st * qk_scale - lse2[None, :])
        dv = dv + plgpu.dot(pt.astype(do.dtype), do, precision=precision)
        dpt = plgpu.dot(v, do, trans_b=True, precision=precision)
        dst = pt * (dpt - delta[None, :])
        dk = dk + plgpu.dot(dst.astype(q.dtype), q, precision=precision)
        return dk, dv

    zeros = jnp.zeros((tile_q, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(ptr, ptr + cnt, body, (zeros, zeros))
    plgpu.store(dk_ref, dk * scale)
    plgpu.store(dv_ref, dv)


def _specs(units, steps, d_pad: int):
    """BlockSpecs of every program: the whole plan arrays, and a [L, H, d_pad] sequence of
    batch element b."""
    whole = lambda a: pl.BlockSpec(a.shape, lambda u, b: (0,) * a.ndim)     # noqa: E731
    seq = lambda L, H: pl.BlockSpec((None, L, H, d_pad), lambda u, b: (b, 0, 0, 0))  # noqa: E731
    return [whole(units), whole(steps)], seq


def dq_call(q, k, v, do, lse_u, delta_u, units, steps, *, tile_q, tile_kv, mode, scale,
            interpret, gather: bool = False):
    """The dq kernel over grid (units, B): q, k, v, do padded (lengths and head dim), lse_u
    and delta_u [B, U, tile_q] per unit row -> unit-major dq [B, U, tile_q, Dp] (q.dtype);
    ``gather``: the plan may hold gathered steps (keys loaded by index)."""
    B, Lqp, Hq, d_pad = q.shape
    Lkvp, Hkv = k.shape[1], k.shape[2]
    U = units.shape[0]
    kernel = functools.partial(
        _dq_kernel, tile_q=tile_q, tile_kv=tile_kv, group=Hq // Hkv, scale=scale,
        mode=mode, num_steps=steps.shape[0], precision=_precision(q.dtype), gather=gather)
    plan_specs, seq = _specs(units, steps, d_pad)
    per_unit = pl.BlockSpec((None, None, tile_q), lambda u, b: (b, u, 0))
    return pl.pallas_call(
        kernel, grid=(U, B),
        in_specs=plan_specs + [seq(Lqp, Hq), seq(Lkvp, Hkv), seq(Lkvp, Hkv), seq(Lqp, Hq),
                               per_unit, per_unit],
        out_specs=pl.BlockSpec((None, None, tile_q, d_pad), lambda u, b: (b, u, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, U, tile_q, d_pad), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=_warps(tile_q), num_stages=2),
        interpret=interpret, name="tessera_triton_dq",
    )(units, steps, q, k, v, do, lse_u, delta_u)


def dkv_call(q, k, v, do, lse, delta, units, steps, *, tile_q, tile_kv, mode, scale,
             interpret):
    """The dk/dv kernel over grid (units, B) of a dk/dv plan: q, do padded to the steps'
    length, k, v to the units', lse and delta [B, Hq, Lp] -> unit-major dk, dv per query head
    [B, U, tile_q, Dp] (float32)."""
    B, Lp, Hq, d_pad = q.shape
    Lkp, Hkv = k.shape[1], k.shape[2]
    U = units.shape[0]
    kernel = functools.partial(
        _dkv_kernel, tile_q=tile_q, tile_kv=tile_kv, group=Hq // Hkv, scale=scale,
        mode=mode, num_steps=steps.shape[0], precision=_precision(q.dtype))
    plan_specs, seq = _specs(units, steps, d_pad)
    rows = pl.BlockSpec((None, Hq, Lp), lambda u, b: (b, 0, 0))
    out = pl.BlockSpec((None, None, tile_q, d_pad), lambda u, b: (b, u, 0, 0))
    shape = jax.ShapeDtypeStruct((B, U, tile_q, d_pad), jnp.float32)
    return pl.pallas_call(
        kernel, grid=(U, B),
        in_specs=plan_specs + [seq(Lp, Hq), seq(Lkp, Hkv), seq(Lkp, Hkv), seq(Lp, Hq), rows,
                               rows],
        out_specs=[out, out], out_shape=[shape, shape],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(tile_q), num_stages=2),
        interpret=interpret, name="tessera_triton_dkv",
    )(units, steps, q, k, v, do, lse, delta)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
