"""Sparse attention of one device's heads, called inside ``jax.shard_map``.

Inside a shard_map body q, k, v hold this device's heads (``Hl = Hq / n``) while a per-head
mask usually holds all ``Hq`` heads. ``local_attention`` runs this device's heads' masks:

* a shared mask (``Hm == 1``), or one holding exactly this device's heads (a device mask
  sharded over heads by ``in_specs``): ``sparse_attention`` as on one device;
* a static mask with shared bounds and a static assignment: every device's slice is planned on
  the host (``tessera_jax.plan``, cached), the plans are padded to one capacity and stacked
  into ``[n, ...]`` constants, and each device reads its own plan at ``lax.axis_index``. One
  template for all devices (the ranking's choice for the costliest slice), so one kernel is
  compiled; the plan is an operand of that kernel, not a constant of its own program. The
  runtime's core runs it (``runtime.core``, its one custom_vjp); the backward's dk/dv plans
  (each slice's, ``host_plans.dkv_candidates``, one choice of tiles and policy for all) are
  stacked the same way on the first backward;
* anything else (a device mask holding every head, per-head bounds, an assignment computed on
  the device): this device's rows of the mask are gathered at ``lax.axis_index`` and planned on
  the device (``runtime.device_route``).

Why not a ``lax.switch`` over per-device static plans: every device's program would hold all n
branches, each its own kernel instance and its own compile (n x the compile time and program
size of one slice), while the stacked plan compiles one kernel whose plan arrays differ by
device; the kernels read their plan from memory either way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.abi import PassPlan

from tessera_jax.mask import BlockMask
from tessera_jax.planning.plan import AttentionPlan
from tessera_jax.runtime import core, dispatch, finite, host_plans
from tessera_jax.runtime.options import Options, check_options
from tessera_jax.validation import check_bool, check_mask, check_qkv, check_scale

__all__ = ["DevicePlans", "clear_caches", "device_plans", "local_attention", "local_masks"]


def _as_heads(heads, n: int, Hl: int):
    """The assignment as [n, Hl] ints (NumPy stays NumPy: a static value)."""
    if isinstance(heads, jax.Array):
        if heads.shape != (n, Hl) or not jnp.issubdtype(heads.dtype, jnp.integer):
            raise ValueError(f"heads must be ints [{n}, {Hl}] (devices x local heads), got "
                             f"{heads.dtype}{list(heads.shape)}")
        return heads
    arr = np.asarray(heads)
    if arr.shape != (n, Hl) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"heads must be ints [{n}, {Hl}] (devices x local heads), got "
                         f"{arr.dtype}{list(arr.shape)}")
    if not np.array_equal(np.sort(arr.reshape(-1)), np.arange(n * Hl)):
        raise ValueError(f"heads must hold each of the {n * Hl} query heads once")
    return arr.astype(np.int64)


def local_masks(mask: BlockMask, heads) -> tuple[BlockMask, ...]:
    """Each device's mask (static): the rows ``heads[d]`` of a static per-head mask."""
    return _local_masks(mask, tuple(tuple(int(h) for h in row) for row in np.asarray(heads)))


@functools.lru_cache(maxsize=8)
def _local_masks(mask: BlockMask, heads: tuple) -> tuple[BlockMask, ...]:
    return tuple(BlockMask(mask.q_bounds, mask.kv_bounds, mask.blocks[list(row)])
                 for row in heads)


@dataclasses.dataclass(frozen=True, eq=False)
class DevicePlans:
    """Host plans of every device's slice, stacked: ``units`` [n, U, UNIT_COLS], ``steps``
    [n, S, STEP_COLS] (each padded with zero rows: padding units and steps), one template."""

    template: str
    units: np.ndarray
    steps: np.ndarray
    tile_q: int
    tile_kv: int
    q_len_padded: int
    kv_len_padded: int
    max_steps: int
    costs: np.ndarray         # estimated ns of each device's plan (planner's cost model)
    plans: tuple              # the per-device ``Plan`` objects
    dkv: dict = dataclasses.field(default_factory=dict)   # options -> stacked dk/dv plans

    def local(self, index) -> PassPlan:
        """The pass plan of device ``index`` (traced): its rows of the stacked arrays."""
        pick = functools.partial(jax.lax.dynamic_index_in_dim, index=index, keepdims=False)
        return PassPlan(pick(jnp.asarray(self.units)), pick(jnp.asarray(self.steps)), None,
                        self.tile_q, self.tile_kv, self.q_len_padded, self.kv_len_padded,
                        self.max_steps)

    def dkv_plans(self, backend: str, options: Options) -> "DevicePlans":
        """The stacked dk/dv plans of the slices (made on first use): each slice's candidates
        (``host_plans.dkv_candidates``); one candidate for all, each slice's cheapest when
        they agree, else the one of least worst estimated time."""
        hit = self.dkv.get(options)
        if hit is None:
            cands = [host_plans.dkv_candidates(p, backend, options) for p in self.plans]
            scores = np.array([[host_plans.dkv_score(tp, per_sm, options) for tp, per_sm in c]
                               for c in cands])
            best = scores.argmin(axis=1)
            i = int(best[0]) if (best == best[0]).all() else int(scores.max(axis=0).argmin())
            hit = self.dkv[options] = _stack([c[i][0] for c in cands], scores[:, i])
        return hit


class _Local:
    """``AttentionPlan.source`` of stacked plans inside shard_map: this device's forward and
    dk/dv pass plans, picked at ``lax.axis_index`` where the core asks for them."""

    __slots__ = ("plans", "axis_name", "backend", "options")

    def __init__(self, plans: DevicePlans, axis_name, backend: str, options: Options):
        self.plans, self.axis_name, self.backend, self.options = \
            plans, axis_name, backend, options

    def fwd(self, rows: bool) -> PassPlan:
        return self.plans.local(jax.lax.axis_index(self.axis_name))

    def dkv(self, rows: bool) -> PassPlan:
        return self.plans.dkv_plans(self.backend, self.options).local(
            jax.lax.axis_index(self.axis_name))


def _cost(p) -> float:
    return float(np.sum(p.unit_cost)) if p.unit_cost is not None else float(p.num_steps)


def device_plans(mask: BlockMask, heads, q_shape, kv_shape, dtype, *, backend=None,
                 template=None) -> DevicePlans:
    """Plans every device's slice of a static mask (shared bounds) for local shapes q_shape
    [B, Lq, Hl, D] / kv_shape, with one template: ``template`` or, when all slices' ranking
    choices don't agree, that of the costliest slice (its policy too). Cached."""
    heads = np.asarray(heads)
    key = tuple(tuple(int(h) for h in row) for row in heads)
    return _device_plans(mask, key, tuple(q_shape), tuple(kv_shape), np.dtype(dtype), backend,
                         template)


@functools.lru_cache(maxsize=8)
def _device_plans(mask, heads, q_shape, kv_shape, dtype, backend, template) -> DevicePlans:
    from tessera_jax.runtime import api
    masks = _local_masks(mask, heads)
    plans = [api.plan(m, q_shape, kv_shape, dtype, backend=backend, template=template)
             for m in masks]
    if len({(p.template, p.policy) for p in plans}) > 1:
        worst = max(plans, key=_cost)
        plans = [api.plan(m, q_shape, kv_shape, dtype, backend=backend,
                          template=worst.template, policy=worst.policy) for m in masks]
    return _stack(plans, np.array([_cost(p) for p in plans]))


def _stack(plans, costs) -> DevicePlans:
    """Plans of one template (tiles, padded lengths) stacked, padded with zero rows."""
    p0 = plans[0]
    for p in plans:
        if (p.tile_q, p.tile_kv, p.q_len_padded, p.kv_len_padded) != \
                (p0.tile_q, p0.tile_kv, p0.q_len_padded, p0.kv_len_padded):
            raise AssertionError("plans of one template disagree on tiles or padded lengths")
    U = max(p.units.shape[0] for p in plans)
    S = max(p.steps.shape[0] for p in plans)

    def pad(a, rows):
        return np.pad(a, ((0, rows - a.shape[0]), (0, 0)))

    units = np.stack([pad(p.units, U) for p in plans]).astype(np.int32)
    steps = np.stack([pad(p.steps, S) for p in plans]).astype(np.int32)
    for a in (units, steps):
        a.setflags(write=False)
    return DevicePlans(p0.template, units, steps, p0.tile_q, p0.tile_kv, p0.q_len_padded,
                       p0.kv_len_padded, max(p.max_steps for p in plans), costs, tuple(plans))


def clear_caches() -> None:
    """Forgets the per-device masks and plans (``tessera_jax.clear_caches`` clears the plans
    they were made from)."""
    _local_masks.cache_clear()
    _device_plans.cache_clear()


def _take(x, rows):
    return jnp.take(jnp.asarray(x), rows, axis=0)


def local_attention(q, k, v, mask: BlockMask, *, axis_name, heads=None, scale=None,
                    return_lse: bool = False, backend: str | None = None,
                    template: str | None = None, options: Options | None = None):
    """Sparse attention of this device's heads, inside ``jax.shard_map`` over ``axis_name``.

    q: [B, Lq, Hl, D], k, v: [B, Lkv, Hkvl, D]: this device's heads (whole GQA groups). ``mask``
    has 1 head (shared), Hl heads (already this device's) or ``n * Hl`` (all query heads: this
    device runs the rows ``heads[axis_index]``). ``heads``: [n, Hl] query heads per device (see
    ``assign.assign_heads``; NumPy: static; jax: computed on the device); None: contiguous,
    device d holds heads [d * Hl, (d + 1) * Hl). Returns out [B, Lq, Hl, D] (and lse
    [B, Hl, Lq] with ``return_lse``), as ``tessera_jax.sparse_attention`` on these heads
    (``options`` as there).
    """
    from tessera_jax.runtime.api import sparse_attention
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a tessera_jax.BlockMask, got {type(mask).__name__}")
    shape = check_qkv(q, k, v)
    Hl, Hm = shape.num_q_heads, mask.num_heads
    n = jax.lax.axis_size(axis_name)
    kw = dict(scale=scale, return_lse=return_lse, backend=backend, template=template,
              options=options)
    if Hm != n * Hl:
        if Hm not in (1, Hl):
            raise ValueError(f"mask has {Hm} heads; inside shard_map over {axis_name!r} "
                             f"({n} devices, {Hl} query heads here) it must have 1 (shared), "
                             f"{Hl} (this device's) or {n * Hl} (all query heads)")
        if heads is not None and Hm != 1:
            raise ValueError("heads selects rows of a mask holding all query heads; this mask "
                             "holds this device's heads already")
        return sparse_attention(q, k, v, mask, **kw)
    heads = _as_heads(np.arange(Hm).reshape(n, Hl) if heads is None else heads, n, Hl)
    static = isinstance(heads, np.ndarray)
    if static and mask.is_static and not mask.per_head_bounds:
        masks = local_masks(mask, heads)
        if len({m.digest for m in masks}) == 1:          # n == 1, or equal slices
            return sparse_attention(q, k, v, masks[0], **kw)
        check_mask(masks[0], shape)
        scale = check_scale(scale, shape.head_dim)
        return_lse = check_bool("return_lse", return_lse)
        options = check_options(options)
        be = dispatch.resolve(backend, shape)
        plans = device_plans(mask, heads, q.shape, k.shape, shape.dtype, backend=be,
                             template=template)
        t = dispatch.get_template(plans.template)
        plan = AttentionPlan(None, template=t.name, backend=t.backend,
                             source=_Local(plans, axis_name, t.backend, options))

        def attend(q, k, v):
            return core.attention(q, k, v, plan, scale, return_lse, options)

        if not options.check_finite:
            return attend(q, k, v)
        mine = jnp.asarray(heads, jnp.int32)[jax.lax.axis_index(axis_name)]
        here = BlockMask(mask.q_bounds, mask.kv_bounds, _take(mask.blocks, mine))
        return finite.attention(attend, q, k, v, here, return_lse)
    mine = jnp.asarray(heads, jnp.int32)[jax.lax.axis_index(axis_name)]
    qb, kb = (_take(b, mine) if b.ndim == 2 else b for b in (mask.q_bounds, mask.kv_bounds))
    return sparse_attention(q, k, v, BlockMask(qb, kb, _take(mask.blocks, mine)), **kw)
