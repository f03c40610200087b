"""The Mosaic GPU family's backend contract (``pallas_kernels.contract``): ``forward``,
``dq``, ``dkv`` over ``abi.PassPlan``s, and the static facts the runtime's backend table reads.

The kernels: ``kernel`` (forward), ``backward`` (dq, dk/dv). Hopper (sm_90a), bf16 / f16, head
dims 64 and 128, plan starts multiples of 8 (TMA fills 8-row tiled, swizzled SMEM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import abi
from pallas_kernels import backward_rows as rows_
from pallas_kernels import contract
from pallas_kernels.mosaic import backward as _backward
from pallas_kernels.mosaic import kernel as _kernel
from pallas_kernels.mosaic import delta as _delta
from pallas_kernels.templates import Template

__all__ = ["forward", "dq", "dkv", "dkv_tiles", "row_dots", "PAIRED_DKV_TILES", "FIRST_ORDER",
           "FOLD_VMAP"]

BACKEND = "mosaic_gpu"
#: Paired dk/dv units (64 keys, two per CTA): a host-plan candidate beside ``dkv_tiles``'.
PAIRED_DKV_TILES = _backward.DKV_PAIRED_TILES
FIRST_ORDER = True          # the kernels can't be differentiated again
FOLD_VMAP = True            # no batching rule for TMA and barriers: vmap folds into the batch


def run_forward(q, k, v, plan: abi.PassPlan, t: Template, mode: str, scale: float,
                return_lse: bool, interpret):
    """``forward`` with the mask mode ``mode``, after the checks."""
    _check_tiles(plan, (t.tile_q, t.tile_kv))
    units, steps, row_index, row_index_t = contract.plan_operands(plan)
    return contract.forward_call(
        q, k, v, units, steps, row_index, row_index_t, kernel=_kernel.forward,
        cfg=_kernel.KernelConfig.from_template(t, mode), q_len_padded=int(plan.q_len_padded),
        kv_len_padded=int(plan.kv_len_padded), head_dim=q.shape[-1], scale=float(scale),
        return_lse=bool(return_lse), interpret=contract.mosaic_interpret(interpret),
        direct=_direct(plan, t, q.shape[-1]))


#: The in-place store's limit on partly owned 64-row groups (``abi.PassPlan.partial_groups``):
#: each costs a ladder of copies from an untiled buffer at the unit's end. H100, Wan 480p,
#: in place against gathered (benchmarks/NOTES.md#kernel-steps): aligned (0.002) -6.3%,
#: sliding (0.057) -5.0%, frames (0.040) -5.2%, cubes (0.010) -3.6%, clusters (0.50) +4.0%.
DIRECT_MAX_PARTIAL = 0.25


def _in_place(plan: abi.PassPlan, smem_bytes: int) -> bool:
    """Whether a kernel stores rows in place: the plan's units own every row, few of its
    64-row groups only in part, and the kernel with its untiled buffer (``smem_bytes``) fits
    shared memory."""
    return bool(plan.rows_owned) and plan.partial_groups <= DIRECT_MAX_PARTIAL and \
        smem_bytes <= _kernel.MAX_SMEM


def _direct(plan: abi.PassPlan, t: Template, head_dim: int) -> bool:
    """Whether the forward stores rows in place (``_in_place``)."""
    return _in_place(plan, _direct_smem(t, head_dim))


@functools.lru_cache(maxsize=256)
def _direct_smem(t: Template, head_dim: int) -> int:
    """Shared memory of template ``t``'s forward with the in-place store's buffer."""
    return _kernel.smem_bytes(_kernel.KernelConfig.from_template(t, "cond"), head_dim,
                              direct=True)


def _check_tiles(plan: abi.PassPlan, *allowed) -> None:
    if (plan.tile_q, plan.tile_kv) not in allowed:
        raise ValueError(f"the Mosaic GPU kernel runs plans of tiles (tile_q, tile_kv) in "
                         f"{allowed}, got ({plan.tile_q}, {plan.tile_kv})")


def run_dq(q, k, v, do, lse, delta, plan, template, scale, interpret, mode):
    """``dq`` with the mask mode ``mode``."""
    t = contract.family_template(template, BACKEND)
    scale = contract.check_pass(q, k, v, plan, t, scale, do=do)
    _check_tiles(plan, (t.tile_q, t.tile_kv))
    units, steps, _, row_index_t = contract.plan_operands(plan)
    return _dq(q, k, v, do, lse, delta, units, steps,
               rows_.host_unit_index(plan.units, t.tile_q, int(plan.q_len_padded)),
               row_index_t, tile_q=t.tile_q, tile_kv=t.tile_kv, paired=bool(t.kernel.paired),
               q_len_padded=int(plan.q_len_padded), kv_len_padded=int(plan.kv_len_padded),
               scale=scale, mask_mode=mode, interpret=contract.mosaic_interpret(interpret),
               gather_run=contract.gathers(t),
               stages=t.stages if contract.gathers(t) else _backward.STAGES,
               wg_skip=bool(t.kernel.wg_skip), direct=_dq_direct(plan, t, q.shape[-1]),
               step_pairs=bool(t.kernel.step_pairs))


def _dq_direct(plan: abi.PassPlan, t: Template, head_dim: int) -> bool:
    """Whether dq stores rows in place (``_in_place``)."""
    stages = t.stages if contract.gathers(t) else _backward.STAGES
    stage_kv = 2 * t.tile_kv if t.kernel.step_pairs else t.tile_kv
    return _in_place(plan, _backward.smem_bytes("dq", stage_kv, head_dim,
                                                2 if t.kernel.paired else 1, stages,
                                                direct=True))


@functools.partial(jax.jit, static_argnames=("tile_q", "tile_kv", "paired", "q_len_padded",
                                             "kv_len_padded", "scale", "mask_mode",
                                             "interpret", "gather_run", "stages", "wg_skip",
                                             "direct", "step_pairs"))
def _dq(q, k, v, do, lse, delta, units, steps, unit_index, row_index_t, *, tile_q, tile_kv,
        paired, q_len_padded, kv_len_padded, scale, mask_mode, interpret, gather_run, stages,
        wg_skip, direct, step_pairs):
    lse_u = rows_.unit_rows(rows_.pad_rows(lse * contract.LOG2E, q_len_padded, jnp.inf), units,
                            tile_q, unit_index)
    delta_u = rows_.unit_rows(rows_.pad_rows(delta, q_len_padded, 0.0), units, tile_q,
                              unit_index)
    dq_u = _backward.dq_call(
        contract.pad(q, q_len_padded), contract.pad(k, kv_len_padded),
        contract.pad(v, kv_len_padded), contract.pad(do.astype(q.dtype), q_len_padded),
        lse_u, delta_u, units, steps, tile_q=tile_q, tile_kv=tile_kv, paired=paired,
        mode=mask_mode, scale=scale, interpret=interpret, gather_run=gather_run, stages=stages,
        wg_skip=wg_skip, direct=direct, step_pairs=step_pairs)
    if direct:
        return contract.unpad(dq_u, q.shape)
    return contract.gather_dq(dq_u, units, row_index_t, q.shape, tile_q)


def run_dkv(q, k, v, do, lse, delta, plan, template, scale, interpret, mode):
    """``dkv`` with the mask mode ``mode``."""
    t = contract.family_template(template, BACKEND)
    scale = contract.check_pass(q, k, v, plan, t, scale, do=do, transposed=True,
                                aligns=_backward.DKV_TILES[2:])
    _check_tiles(plan, _backward.DKV_TILES[:2], PAIRED_DKV_TILES[:2])
    gather_run = DKV_GATHER_RUN if contract.gathers(t) else 0
    contract.check_dkv_gathers(plan, gather_run)
    units, steps, _, row_index_t = contract.plan_operands(plan)
    return _dkv(q, k, v, do, lse, delta, units, steps, row_index_t, tile_q=int(plan.tile_q),
                q_len_padded=int(plan.q_len_padded), kv_len_padded=int(plan.kv_len_padded),
                scale=scale, mask_mode=mode, interpret=contract.mosaic_interpret(interpret),
                gather_run=gather_run, wg_skip=bool(t.kernel.wg_skip))


@functools.partial(jax.jit, static_argnames=("tile_q", "q_len_padded", "kv_len_padded",
                                             "scale", "mask_mode", "interpret", "gather_run",
                                             "wg_skip"))
def _dkv(q, k, v, do, lse, delta, units, steps, row_index_t, *, tile_q, q_len_padded,
         kv_len_padded, scale, mask_mode, interpret, gather_run, wg_skip):
    # The dk/dv plan's rows are keys (q_len_padded), its steps queries (kv_len_padded).
    lse2 = rows_.pad_rows(lse * contract.LOG2E, kv_len_padded, jnp.inf)
    delta_p = rows_.pad_rows(delta, kv_len_padded, 0.0)
    dk_u, dv_u = _backward.dkv_call(
        contract.pad(q, kv_len_padded), contract.pad(k, q_len_padded),
        contract.pad(v, q_len_padded), contract.pad(do.astype(q.dtype), kv_len_padded), lse2,
        delta_p, units, steps, tile_q=tile_q, mode=mask_mode, scale=scale, interpret=interpret,
        gather_run=gather_run, wg_skip=wg_skip)
    return contract.gather_dkv(dk_u, dv_u, units, row_index_t, q.shape, k, v, tile_q)


forward = contract.forward_op(BACKEND, run_forward)
dq, dkv = contract.backward_ops(run_dq, run_dkv)


#: Queries one copy of a gathering template's dk/dv kernel loads: its dk/dv plans may hold
#: gathered steps whose chunks come in runs of that many (0 where a backend's do not gather).
DKV_GATHER_RUN = _backward.DKV_GATHER_RUN


def dkv_tiles(template: Template, head_dim: int) -> tuple[int, int, int, int]:
    """(tile_q', tile_kv', q_align', kv_align') of the dk/dv pass plan for this forward
    template: units of 128 keys, steps of 64 queries, starts multiples of 8."""
    return _backward.DKV_TILES


def row_dots(out, do, *, interpret: bool | None = None):
    """rowsum(out * do) [B, Hq, Lq] float32 by the Mosaic GPU row-dot kernel (``delta``; no
    Triton kernel on Hopper's path), or by jnp for shapes it does not take (``delta.supports``:
    lengths not a multiple of 8 or below 64)."""
    if not _delta.supports(out.shape, out.dtype) or out.dtype != do.dtype:
        return jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
    return _delta.row_dots(out, do, interpret=contract.mosaic_interpret(interpret) is not False)
