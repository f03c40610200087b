"""The host route's chooser: a static mask's template, policy and plans.

The forward: the selector's host choice for the mask (``select.choose``: the ranking table), else
the backend's default template with its own policy, planned by the host planner
(``planner.build_unchecked``). The dk/dv pass: the transposed mask (blocks [Hm, nkv, nq],
bounds swapped) planned by the same planner (head-major units) with the backend's dk/dv tiles
under each of ``Options.dkv_policies``, and its paired tiles under
``Options.paired_dkv_policy``: the plan of least estimated time (``dkv_score``). It is made
on the first backward (forward-only requests never pay for it) and cached per forward plan.
``attention_plan`` gives the ``AttentionPlan`` the core runs.
"""

from __future__ import annotations

import weakref

import jax.numpy as jnp
import numpy as np

from pallas_kernels.templates import Template

from tessera_jax.mask import BlockMask
from tessera_jax.planning import planner
from tessera_jax.planning.plan import AttentionPlan, PassPlan, host_pass
from tessera_jax.runtime import dispatch
from tessera_jax.runtime.options import DEFAULT, Options
from tessera_jax import select
from tessera_jax.validation import AttnShape

__all__ = ["choose_template", "build", "attention_plan", "dkv_plan", "dkv_candidates",
           "dkv_tiles", "dkv_score", "transposed_mask", "transposed_shape", "clear_cache"]


def choose_template(mask: BlockMask, shape: AttnShape, backend: str) -> tuple[str, str]:
    """(template, policy) for a request: the selector's host choice (the ranking table), else
    the backend's default template (or its first that takes the call) with its own policy."""
    choice = select.choose("host", mask, shape, backend)
    if choice is not None:
        return choice
    supported = dispatch.supported_templates(backend, shape)
    default = dispatch.DEFAULT_TEMPLATE.get(backend)
    t = next((t for t in supported if t.name == default), supported[0])
    return t.name, t.policy


def build(mask: BlockMask, shape: AttnShape, backend: str, t: Template | None,
          policy: str | None, options: Options = DEFAULT) -> planner.Plan:
    """The forward's planner ``Plan`` of a validated request: ``t`` and ``policy`` as given,
    else chosen (``choose_template``), else the template's own policy; planned with
    ``options.planner``."""
    if t is None:
        name, chosen = choose_template(mask, shape, backend)
        t = dispatch.get_template(name)
        policy = policy or chosen
    return planner.build_unchecked(mask, shape, tile_q=t.tile_q, tile_kv=t.tile_kv,
                                   policy=policy or t.policy, q_align=t.q_align,
                                   kv_align=t.kv_align, template=t.name,
                                   unit_order=t.unit_order, config=options.planner,
                                   row_group=t.row_group)


class _Passes:
    """A host plan's pass plans, as ``AttentionPlan.source``: the forward's (cached per Plan
    by ``host_pass``) and the dk/dv pass's (made on first use, cached per Plan)."""

    __slots__ = ("plan", "backend", "options")

    def __init__(self, plan: planner.Plan, backend: str, options: Options):
        self.plan, self.backend, self.options = plan, backend, options

    def fwd(self, rows: bool) -> PassPlan:
        return host_pass(self.plan, rows)

    def dkv(self, rows: bool) -> PassPlan:
        return host_pass(dkv_plan(self.plan, self.backend, self.options), rows)


def attention_plan(plan: planner.Plan, options: Options = DEFAULT) -> AttentionPlan:
    """The ``AttentionPlan`` of a host plan (its pass plans made, and cached, on use)."""
    backend = dispatch.get_template(plan.template).backend
    return AttentionPlan(None, template=plan.template, backend=backend,
                         source=_Passes(plan, backend, options))


# --- the dk/dv pass --------------------------------------------------------------------------
def transposed_mask(mask: BlockMask) -> BlockMask:
    """The mask of keys x queries: blocks [Hm, nkv, nq], bounds swapped (NumPy or jax)."""
    blocks = mask.blocks
    t = np.ascontiguousarray(np.swapaxes(blocks, 1, 2)) if isinstance(blocks, np.ndarray) \
        else jnp.swapaxes(blocks, 1, 2)
    return BlockMask(mask.kv_bounds, mask.q_bounds, t)


def transposed_shape(shape: AttnShape) -> AttnShape:
    """The transposed problem: Lkv "queries" of Hq heads against Lq "keys" of Hq heads (the
    K/V head of a query head is read by the kernels, not planned)."""
    return AttnShape(shape.batch, shape.kv_len, shape.q_len, shape.num_q_heads,
                     shape.num_q_heads, shape.head_dim, shape.dtype)


def dkv_tiles(backend: str, template: Template, head_dim: int) -> tuple[int, int, int, int]:
    """(tile_q', tile_kv', q_align', kv_align') of the dk/dv pass plan on ``backend`` for a
    forward plan of ``template`` (the backend's contract)."""
    return tuple(int(x) for x in dispatch.BACKENDS[backend].ops().dkv_tiles(template, head_dim))


def dkv_score(tp: planner.Plan, per_sm: int, options: Options = DEFAULT) -> float:
    """Estimated ns of a dk/dv plan whose units run ``per_sm`` at a time on an SM: its computed
    work at the measured dk/dv rate (``Options.dkv_ns_per_interaction_d128``), plus the
    per-step and per-unit fixed costs of the planner's cost model, which concurrent units
    overlap (they break ties). The forward's cost model (K/V bytes, partial steps) mis-ordered
    clusters' (paired 5.30 vs pack 4.94 ms predicted; 9.67 vs 10.36 ms measured)."""
    s, m = tp.stats(), tp.cost_model
    work = s["computed_interactions"] * tp.shape.head_dim / 128 * \
        options.dkv_ns_per_interaction_d128
    return work + (s["tiles"] * m.step_ns + s["units"] * m.unit_ns) / per_sm / m.num_sms


# Per forward plan (weakly held, like the API's plan cache holds it): (backend, dk/dv options)
# -> the dk/dv planner Plan (which holds the transposed mask, never the forward plan).
_DKV: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def clear_cache() -> None:
    """Forgets the dk/dv host plans (``tessera_jax.clear_caches``)."""
    _DKV.clear()


def dkv_plan(plan: planner.Plan, backend: str | None = None,
             options: Options = DEFAULT) -> planner.Plan:
    """The host plan of the dk/dv pass of ``plan`` (a planner ``Plan`` of a static mask with
    shared bounds) on ``backend`` (None: the plan's template's): see the module docstring.
    Cached per forward plan, backend and the options it depends on."""
    t = dispatch.get_template(plan.template)
    backend = backend or t.backend
    key = (backend, options.dkv_policies, options.paired_dkv_policy,
           options.dkv_ns_per_interaction_d128)
    try:
        per = _DKV.setdefault(plan, {})
    except TypeError:
        per = {}
    hit = per.get(key)
    if hit is not None:
        return hit
    cands = dkv_candidates(plan, backend, options)
    tp = min(cands, key=lambda c: dkv_score(*c, options))[0]            # first on ties
    per[key] = tp
    return tp


def dkv_gather_policy(t, backend: str) -> str | None:
    """The gathered dk/dv policy of template ``t`` on ``backend``: the gather policy of the
    runs its dk/dv kernel copies (the backend's ``DKV_GATHER_RUN``); None where it does not
    gather."""
    run = getattr(dispatch.BACKENDS[backend].ops(), "DKV_GATHER_RUN", 0)
    if not (run and t.backend == backend and getattr(t.kernel, "gather", False)):
        return None
    return next(p for p, r in planner.GATHER_RUNS.items() if r == run)


def dkv_candidates(plan: planner.Plan, backend: str,
                   options: Options = DEFAULT) -> list[tuple[planner.Plan, int]]:
    """The dk/dv plans ``dkv_plan`` chooses from, each with the units an SM runs at once (a
    paired CTA runs two 64-key units together): the backend's dk/dv tiles under each of
    ``options.dkv_policies`` (and, for a gathering template on a backend whose dk/dv kernel
    gathers too, that kernel's ``dkv_gather_policy``), then its paired tiles under
    ``options.paired_dkv_policy``."""
    if plan.mask is None:
        raise ValueError("a dk/dv plan needs a plan that holds its mask (planner.Plan.mask)")
    t = dispatch.get_template(plan.template)
    shape = transposed_shape(plan.shape)
    tiles = dkv_tiles(backend, t, plan.shape.head_dim)
    tmask = transposed_mask(plan.mask)
    gather_pol = dkv_gather_policy(t, backend)
    for pol in options.dkv_policies:
        if pol.startswith("gather") and pol != gather_pol:
            raise ValueError(f"Options.dkv_policies names {pol!r}, but template {t.name!r} on "
                             f"backend {backend!r} has no dk/dv kernel that runs it (only a "
                             "gathering Mosaic GPU template's dk/dv kernel gathers)")
    opts = [(tiles, pol, 1) for pol in options.dkv_policies]
    if gather_pol and gather_pol not in options.dkv_policies:
        opts.append((tiles, gather_pol, 1))    # a gathering template's dk/dv kernel gathers too
    paired = dispatch.BACKENDS[backend].ops().PAIRED_DKV_TILES
    if paired is not None and options.paired_dkv_policy is not None:
        opts.append((paired, options.paired_dkv_policy, 2))
    if not opts:
        raise ValueError(f"Options.dkv_policies is empty and backend {backend!r} has no "
                         "paired dk/dv units: no dk/dv plan to choose")
    # A skipping template's dk/dv kernel skips a 128-key unit's steps on the warpgroup whose
    # 64 keys they miss: its plans count 64-row groups.
    group = 64 if t.backend == backend and getattr(t.kernel, "wg_skip", False) else None
    return [(planner.build_unchecked(tmask, shape, tile_q=x[0], tile_kv=x[1], policy=pol,
                                     q_align=x[2], kv_align=x[3],
                                     template=f"bwd_dkv_{backend}_{x[0]}x{x[1]}",
                                     unit_order="head_major", config=plan.config,
                                     row_group=group if per_sm == 1 and x[0] > 64 else None),
             per_sm)
            for x, pol, per_sm in opts]
