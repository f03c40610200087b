"""The Triton forward's pre-contract entry point (``attention``), kept until the runtime calls
``pallas_kernels.triton.ops``."""

from __future__ import annotations

from pallas_kernels import abi
from pallas_kernels import contract
from pallas_kernels.contract import (MASK_MODES, default_interpret, mask_mode_for,
                                     plan_mask_mode)
from pallas_kernels.triton import ops
from pallas_kernels.triton.kernel import KernelConfig

__all__ = ["KernelConfig", "attention", "mask_mode_for", "plan_mask_mode", "default_interpret",
           "MASK_MODES"]


def _template_of(template, tile_q, tile_kv, num_warps, num_stages, prefetch):
    """The template given, or one of the direct arguments (num_stages defaults to 2)."""
    if template is None:
        if tile_q is None or tile_kv is None:
            raise ValueError("pass either template or both tile_q and tile_kv")
        return ops.direct_template(tile_q, tile_kv, 2 if num_stages is None else num_stages,
                                   num_warps, False if prefetch is None else prefetch)
    t = contract.family_template(template, ops.BACKEND)
    for name, given, want in (("tile_q", tile_q, t.tile_q), ("tile_kv", tile_kv, t.tile_kv),
                              ("num_stages", num_stages, t.stages),
                              ("num_warps", num_warps, t.kernel.num_warps),
                              ("prefetch", prefetch, t.kernel.prefetch)):
        if given is not None and given != want:
            raise ValueError(f"{name}={given} contradicts template {t.name!r} ({name}={want})")
    return t


def attention(q, k, v, units, steps, row_index, *, q_len_padded, kv_len_padded, tile_q=None,
              tile_kv=None, scale=None, return_lse=False, num_warps=None, num_stages=None,
              mask_mode=None, prefetch=None, template=None, interpret=None, check_plan=True):
    """Compatibility shim over ops.forward; removed when the runtime uses ops."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    t = _template_of(template, tile_q, tile_kv, num_warps, num_stages, prefetch)
    plan = abi.PassPlan(units, steps, row_index, t.tile_q, t.tile_kv, q_len_padded,
                        kv_len_padded, 0)
    return contract.shim_forward(ops.run_forward, q, k, v, plan, t, scale, return_lse,
                                 contract.triton_interpret(interpret), mask_mode, check_plan)
