"""``AttentionPlan``: the one plan type the runtime's core reads, whatever the route.

A registered pytree holding the pass plans of a call (``pallas_kernels.abi.PassPlan``): the
forward's and the dk/dv pass's (the transposed mask's plan; the dq pass runs over the
forward's). Host plans (the planner's, NumPy leaves) are constants of the caller's program;
device plans (made inside the program by ``planning.device``) have traced leaves and carry
``ok`` and the device mask for the exact path. ``host_pass`` gives a planner ``Plan``'s pass
plan, one object per Plan, so that caches keyed on it (the kernel runner's device copies)
keep working.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax

from pallas_kernels.abi import PassPlan

__all__ = ["AttentionPlan", "PassPlan", "host_pass", "clear_cache"]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["fwd", "dkv", "ok", "dkv_ok", "exact"],
                   meta_fields=["template", "backend", "source", "refine"])
@dataclasses.dataclass(frozen=True, eq=False)
class AttentionPlan:
    """The plans of one attention call.

    fwd:    the forward pass plan (the dq pass runs over it); None: no template fits a device
            mask, the exact path runs forward and backward
    dkv:    the dk/dv pass plan; None with ``source`` (host: made on first use) or, for a
            device plan, when the transposed mask's plan does not fit (exact backward)
    ok:     device plans whose fit is decided on the device: bool [] of the forward plan
            (False: the forward takes the exact path); None: the kernels run
    dkv_ok: likewise of the dk/dv plan (the backward runs the kernels where ok & dkv_ok)
    exact:  (q_bounds, kv_bounds, blocks) of a device mask (the exact path's operands), None
            for host plans
    template: the forward's template name (None: exact path only); backend: its backend
    source: a host plan's maker of the pass plans a trace and the backward need (``fwd(rows)``,
            ``dkv(rows)``; rows: with host row maps), None for device plans
    refine: a device plan whose fit is decided on the device: ``refine(*exact)`` makes the
            plan that runs where this one does not fit, before the exact path (after a first,
            smaller bitmap room the plan with the whole room; after that, unless
            ``Options(device_overflow="exact")``, the gathering template's); None: the exact
            path
    """

    fwd: PassPlan | None
    dkv: PassPlan | None = None
    ok: jax.Array | None = None
    dkv_ok: jax.Array | None = None
    exact: tuple | None = None
    template: str | None = None
    backend: str = "xla"
    source: object = None
    refine: object = None

    def fwd_pass(self, rows: bool) -> PassPlan | None:
        """The forward pass plan; ``rows``: with a host plan's row maps (under a trace)."""
        return self.fwd if self.source is None else self.source.fwd(rows)

    def dkv_pass(self, rows: bool) -> PassPlan | None:
        """The dk/dv pass plan (a host plan's is made on first use)."""
        return self.dkv if self.source is None else self.source.dkv(rows)


# Per planner Plan (weakly held, as the API's plan cache holds it): its pass plans without and
# with the row map. A PassPlan holds the Plan's arrays, never the Plan.
_PASSES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def host_pass(plan, rows: bool = False) -> PassPlan:
    """The pass plan of a planner ``Plan`` (NumPy leaves, trusted: ``all_full`` from
    ``Plan.all_full``), the same object at every call. ``rows``: with ``Plan.row_index`` (host
    row maps, constants under a trace); without, row_index is None (the eager calls: kernels
    make it on the device) and the Plan's row map is never computed."""
    try:
        per = _PASSES.setdefault(plan, {})
    except TypeError:
        per = {}
    hit = per.get(rows)
    if hit is None:
        hit = per[rows] = PassPlan(plan.units, plan.steps, plan.row_index if rows else None,
                                   int(plan.tile_q), int(plan.tile_kv), int(plan.q_len_padded),
                                   int(plan.kv_len_padded), int(plan.max_steps),
                                   bool(plan.all_full), bool(plan.rows_owned),
                                   float(plan.partial_groups))
    return hit


def clear_cache() -> None:
    """Forgets the host pass plans (``tessera_jax.clear_caches``)."""
    _PASSES.clear()
