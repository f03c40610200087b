"""The Triton-lowering family's backend contract (``pallas_kernels.contract``): ``forward``,
``dq``, ``dkv`` over ``abi.PassPlan``s, and the static facts the runtime's backend table reads.

The kernels: ``kernel`` (forward), ``backward`` (dq, dk/dv), ``delta`` (the row dots). Any
CUDA GPU of compute capability >= 8.0; float32, bf16, f16; the head dim padded to a power of
two (>= 16, at most ``kernel.MAX_HEAD_DIM``); plan starts at any row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels import backward_rows as rows_
from pallas_kernels import contract
from pallas_kernels.templates import Template
from pallas_kernels.triton import backward as _backward
from pallas_kernels.triton import delta as _delta
from pallas_kernels.triton import kernel as _kernel

__all__ = ["forward", "dq", "dkv", "dkv_tiles", "row_dots", "PAIRED_DKV_TILES", "FIRST_ORDER",
           "FOLD_VMAP"]

BACKEND = "triton"
PAIRED_DKV_TILES = None     # no paired dk/dv units
FIRST_ORDER = True          # the kernels can't be differentiated again
FOLD_VMAP = False           # pallas_call's own batching rule


def _check_head_dim(q) -> int:
    """The padded head dim, after checking it fits the kernel."""
    d_pad = _kernel.padded_head_dim(q.shape[-1])
    if d_pad > _kernel.MAX_HEAD_DIM:
        raise ValueError(f"head_dim D={q.shape[-1]} is not supported by the Triton kernel "
                         f"(max {_kernel.MAX_HEAD_DIM})")
    return d_pad


def run_forward(q, k, v, plan: abi.PassPlan, t: Template, mode: str, scale: float,
                return_lse: bool, interpret):
    """``forward`` with the mask mode ``mode``, after the checks."""
    d_pad = _check_head_dim(q)
    if (plan.tile_q, plan.tile_kv) != (t.tile_q, t.tile_kv):
        raise ValueError(f"the plan's tiles {plan.tile_q} x {plan.tile_kv} are not template "
                         f"{t.name!r}'s ({t.tile_q} x {t.tile_kv})")
    units, steps, row_index, row_index_t = contract.plan_operands(plan)
    return contract.forward_call(
        q, k, v, units, steps, row_index, row_index_t, kernel=_kernel.forward,
        cfg=_kernel.KernelConfig.from_template(t, mode), q_len_padded=int(plan.q_len_padded),
        kv_len_padded=int(plan.kv_len_padded), head_dim=d_pad, scale=float(scale),
        return_lse=bool(return_lse), interpret=contract.triton_interpret(interpret))


def run_dq(q, k, v, do, lse, delta, plan, template, scale, interpret, mode):
    """``dq`` with the mask mode ``mode``; the kernel runs the plan's tiles."""
    t = contract.family_template(template, BACKEND)
    scale = contract.check_pass(q, k, v, plan, t, scale, do=do, aligns=(1, 1))
    d_pad = _check_head_dim(q)
    units, steps, _, row_index_t = contract.plan_operands(plan)
    return _dq(q, k, v, do, lse, delta, units, steps,
               rows_.host_unit_index(plan.units, int(plan.tile_q), int(plan.q_len_padded)),
               row_index_t, tile_q=int(plan.tile_q), tile_kv=int(plan.tile_kv), d_pad=d_pad,
               q_len_padded=int(plan.q_len_padded), kv_len_padded=int(plan.kv_len_padded),
               scale=scale, mask_mode=mode, interpret=contract.triton_interpret(interpret),
               gather=bool(contract.gathers(t)))


_STATICS = ("tile_q", "tile_kv", "d_pad", "q_len_padded", "kv_len_padded", "scale",
            "mask_mode", "interpret")


@functools.partial(jax.jit, static_argnames=_STATICS + ("gather",))
def _dq(q, k, v, do, lse, delta, units, steps, unit_index, row_index_t, *, tile_q, tile_kv,
        d_pad, q_len_padded, kv_len_padded, scale, mask_mode, interpret, gather):
    lse_u = rows_.unit_rows(rows_.pad_rows(lse, q_len_padded, jnp.inf), units, tile_q,
                            unit_index)
    delta_u = rows_.unit_rows(rows_.pad_rows(delta, q_len_padded, 0.0), units, tile_q,
                              unit_index)
    dq_u = _backward.dq_call(
        contract.pad(q, q_len_padded, d_pad), contract.pad(k, kv_len_padded, d_pad),
        contract.pad(v, kv_len_padded, d_pad), contract.pad(do, q_len_padded, d_pad), lse_u,
        delta_u, units, steps, tile_q=tile_q, tile_kv=tile_kv, mode=mask_mode, scale=scale,
        interpret=interpret, gather=gather)
    return contract.gather_dq(dq_u, units, row_index_t, q.shape, tile_q)


def run_dkv(q, k, v, do, lse, delta, plan, template, scale, interpret, mode):
    """``dkv`` with the mask mode ``mode``; the kernel runs the plan's tiles."""
    t = contract.family_template(template, BACKEND)
    scale = contract.check_pass(q, k, v, plan, t, scale, do=do, transposed=True,
                                aligns=(1, 1))
    d_pad = _check_head_dim(q)
    contract.check_dkv_gathers(plan, 0)
    units, steps, _, row_index_t = contract.plan_operands(plan)
    return _dkv(q, k, v, do, lse, delta, units, steps, row_index_t, tile_q=int(plan.tile_q),
                tile_kv=int(plan.tile_kv), d_pad=d_pad, q_len_padded=int(plan.q_len_padded),
                kv_len_padded=int(plan.kv_len_padded), scale=scale, mask_mode=mode,
                interpret=contract.triton_interpret(interpret))


@functools.partial(jax.jit, static_argnames=_STATICS)
def _dkv(q, k, v, do, lse, delta, units, steps, row_index_t, *, tile_q, tile_kv, d_pad,
         q_len_padded, kv_len_padded, scale, mask_mode, interpret):
    # The dk/dv plan's rows are keys (q_len_padded), its steps queries (kv_len_padded).
    lse_p = rows_.pad_rows(lse, kv_len_padded, jnp.inf)
    delta_p = rows_.pad_rows(delta, kv_len_padded, 0.0)
    dk_u, dv_u = _backward.dkv_call(
        contract.pad(q, kv_len_padded, d_pad), contract.pad(k, q_len_padded, d_pad),
        contract.pad(v, q_len_padded, d_pad), contract.pad(do, kv_len_padded, d_pad), lse_p,
        delta_p, units, steps, tile_q=tile_q, tile_kv=tile_kv, mode=mask_mode, scale=scale,
        interpret=interpret)
    return contract.gather_dkv(dk_u, dv_u, units, row_index_t, q.shape, k, v, tile_q)


forward = contract.forward_op(BACKEND, run_forward)
dq, dkv = contract.backward_ops(run_dq, run_dkv)


def dkv_tiles(template: Template, head_dim: int) -> tuple[int, int, int, int]:
    """(tile_q', tile_kv', q_align', kv_align') of the dk/dv pass plan for this forward
    template (``backward.dkv_tiles``; pointer loads: no alignment)."""
    return _backward.dkv_tiles(head_dim) + (1, 1)


def row_dots(out, do, *, interpret: bool | None = None):
    """rowsum(out * do) [B, Hq, Lq] float32 by the Triton row-dot kernel."""
    return _delta.row_dots(out, do, interpret=contract.triton_interpret(interpret))
