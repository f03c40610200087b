"""The Mosaic GPU forward's pre-contract entry point (``attention``), kept until the runtime
calls ``pallas_kernels.mosaic.ops``."""

from __future__ import annotations

from pallas_kernels import abi
from pallas_kernels import contract
from pallas_kernels.contract import MASK_MODES, mask_mode_for, plan_mask_mode
from pallas_kernels.mosaic import ops
from pallas_kernels.mosaic.kernel import KernelConfig

__all__ = ["KernelConfig", "attention", "config_from_template", "mask_mode_for",
           "plan_mask_mode", "MASK_MODES"]


def config_from_template(template, mask_mode: str | None = None) -> KernelConfig:
    """Compatibility shim over KernelConfig.from_template; removed when the runtime uses ops."""
    return KernelConfig.from_template(contract.family_template(template, ops.BACKEND), mask_mode)


def attention(q, k, v, units, steps, row_index, *, template, q_len_padded, kv_len_padded,
              scale=None, return_lse=False, interpret=False, mask_mode=None, check_plan=True):
    """Compatibility shim over ops.forward; removed when the runtime uses ops."""
    t = contract.family_template(template, ops.BACKEND)
    plan = abi.PassPlan(units, steps, row_index, t.tile_q, t.tile_kv, q_len_padded,
                        kv_len_padded, 0)
    return contract.shim_forward(ops.run_forward, q, k, v, plan, t, scale, return_lse,
                                 interpret, mask_mode, check_plan)
