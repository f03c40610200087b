"""The XLA family's backend contract (``pallas_kernels.contract``): ``forward``, ``dq``,
``dkv`` over ``abi.PassPlan``s in plain JAX (any device; differentiable again), and the static
facts the runtime's backend table reads.
"""

from __future__ import annotations

from pallas_kernels import abi
from pallas_kernels import contract
from pallas_kernels.templates import Template
from pallas_kernels.xla import backward as _backward
from pallas_kernels.xla import executor as _executor

__all__ = ["forward", "dq", "dkv", "dkv_tiles", "row_dots", "PAIRED_DKV_TILES", "FIRST_ORDER",
           "FOLD_VMAP"]

BACKEND = "xla"
PAIRED_DKV_TILES = None     # no paired dk/dv units
FIRST_ORDER = False         # plain jnp: differentiable again
FOLD_VMAP = False           # plain jnp batches itself
row_dots = None             # delta by jnp (``backward_rows.delta_of``)


def forward(q, k, v, plan: abi.PassPlan, *, template: Template, scale: float,
            return_lse: bool = False, interpret: bool | None = None, check_plan: bool = True):
    """out [B, Lq, Hq, D] (q.dtype), or (out, lse [B, Hq, Lq] f32) with return_lse.
    ``interpret`` is ignored (no kernel); the plan's tiles may be any."""
    t = contract.family_template(template, BACKEND)
    scale = contract.check_pass(q, k, v, plan, t, scale)
    if check_plan and plan.all_full is None and contract.is_host(plan):
        # An out-of-range index would be clamped by the gathers, silently, and a unit of more
        # than max_steps steps would lose some.
        contract.check_pass_plan(plan, t, q.shape[2], max_steps=plan.max_steps)
    units, steps, row_index, _ = contract.plan_operands(plan)
    return _executor.execute_plan(q, k, v, units, steps, row_index, tile_q=int(plan.tile_q),
                                  tile_kv=int(plan.tile_kv), q_len_padded=int(plan.q_len_padded),
                                  kv_len_padded=int(plan.kv_len_padded),
                                  max_steps=int(plan.max_steps), scale=scale,
                                  return_lse=bool(return_lse))


def _run(fn, q, k, v, do, lse, delta, plan: abi.PassPlan, template, scale, transposed):
    t = contract.family_template(template, BACKEND)
    scale = contract.check_pass(q, k, v, plan, t, scale, do=do, transposed=transposed)
    return fn(q, k, v, do, lse, delta, plan.units, plan.steps, plan.row_index,
              tile_q=int(plan.tile_q), tile_kv=int(plan.tile_kv),
              q_len_padded=int(plan.q_len_padded), kv_len_padded=int(plan.kv_len_padded),
              max_steps=int(plan.max_steps), scale=scale)


def run_dq(q, k, v, do, lse, delta, plan, template, scale, interpret=None, mode=None):
    """dq by ``backward.dq`` (exact: every step masked as ``abi.step_mask`` says, any mode)."""
    return _run(_backward.dq, q, k, v, do, lse, delta, plan, template, scale, False)


def run_dkv(q, k, v, do, lse, delta, plan, template, scale, interpret=None, mode=None):
    """(dk, dv) by ``backward.dkv`` (exact, any mode)."""
    return _run(_backward.dkv, q, k, v, do, lse, delta, plan, template, scale, True)


dq, dkv = contract.backward_ops(run_dq, run_dkv)


def dkv_tiles(template: Template, head_dim: int) -> tuple[int, int, int, int]:
    """(tile_q', tile_kv', q_align', kv_align') of the dk/dv pass plan: the forward's tiles
    swapped (any alignment)."""
    return (template.tile_kv, template.tile_q, 1, 1)
