"""The Mosaic GPU family's backend contract (``pallas_kernels.contract``): ``forward``,
``dq``, ``dkv`` over ``abi.PassPlan``s, and the static facts the runtime's backend table reads.
"""

from __future__ import annotations

from pallas_kernels import abi
from pallas_kernels import contract
from pallas_kernels.mosaic import backward as _backward
from pallas_kernels.mosaic import wrapper as _wrapper
from pallas_kernels.templates import Template
from pallas_kernels.triton import delta as _delta

__all__ = ["forward", "dq", "dkv", "dkv_tiles", "row_dots", "PAIRED_DKV_TILES", "FIRST_ORDER",
           "FOLD_VMAP"]

BACKEND = "mosaic_gpu"
#: Paired dk/dv units (64 keys, two per CTA): a host-plan candidate beside ``dkv_tiles``'.
PAIRED_DKV_TILES = _backward.DKV_PAIRED_TILES
FIRST_ORDER = True          # the kernels can't be differentiated again
FOLD_VMAP = True            # no batching rule for TMA and barriers: vmap folds into the batch


def forward(q, k, v, plan: abi.PassPlan, *, template: Template, scale: float,
            return_lse: bool = False, interpret: bool | None = None, check_plan: bool = True):
    """out [B, Lq, Hq, D] (q.dtype), or (out, lse [B, Hq, Lq] f32) with return_lse."""
    t = contract.family_template(template, BACKEND)
    mode = contract.forward_mask_mode(plan, t, q.shape[2], check_plan)
    return _wrapper.attention(q, k, v, plan.units, plan.steps, plan.row_index, template=t,
                              q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded,
                              scale=scale, return_lse=return_lse,
                              interpret=contract.mosaic_interpret(interpret), mask_mode=mode,
                              check_plan=False)


def dq(q, k, v, do, lse, delta, plan: abi.PassPlan, *, template: Template, scale: float,
       interpret: bool | None = None):
    """dq [B, Lq, Hq, D] over the forward pass plan. lse: ``backward_rows.lse_for_backward``
    (+inf on empty rows); delta: rowsum(out * do) - dlse, [B, Hq, Lq] f32."""
    t = contract.family_template(template, BACKEND)
    return _backward.dq(q, k, v, do, lse, delta, plan.units, plan.steps, template=t,
                        q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded,
                        scale=scale, interpret=contract.mosaic_interpret(interpret),
                        row_index=plan.row_index)


def dkv(q, k, v, do, lse, delta, plan: abi.PassPlan, *, template: Template, scale: float,
        interpret: bool | None = None):
    """(dk, dv) [B, Lkv, Hkv, D] over the dk/dv pass plan (the transposed mask's plan: units
    are key tiles of one query head, steps query tiles); template: the forward's; GQA summed."""
    contract.family_template(template, BACKEND)
    return _backward.dkv(q, k, v, do, lse, delta, plan.units, plan.steps, tile_q=plan.tile_q,
                         tile_kv=plan.tile_kv, q_len_padded=plan.q_len_padded,
                         kv_len_padded=plan.kv_len_padded, scale=scale,
                         interpret=contract.mosaic_interpret(interpret),
                         row_index=plan.row_index)


def dkv_tiles(template: Template, head_dim: int) -> tuple[int, int, int, int]:
    """(tile_q', tile_kv', q_align', kv_align') of the dk/dv pass plan for this forward
    template: units of 128 keys, steps of 64 queries, starts multiples of 8."""
    return _backward.DKV_TILES


def row_dots(out, do, *, interpret: bool | None = None):
    """rowsum(out * do) [B, Hq, Lq] float32 by the Triton row-dot kernel."""
    return _delta.row_dots(out, do, interpret=contract.triton_interpret(interpret))
