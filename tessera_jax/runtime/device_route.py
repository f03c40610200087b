"""The device route: a device mask (jax arrays; or per-head bounds) planned and run inside one
compiled program, with no host planning, no host transfer and no recompile for a new mask of
the same shapes.

A call site's template is a *static* choice, made by the selector's device rule
(``select.device``: the call site's static features, ``Options.bitmap_budget_bytes``); then
``device_plans``, the route's chooser inside the program, makes the forward and the dk/dv pass
plans together (``planning.device.plan_on_device``; a template of the gather policy gets
``planning.device_gather``'s forward plan: traced or per-head bounds decide on the device,
static ones that break its limits take ``plan_on_device``'s) and
``runtime.core`` runs them. A static
mask with per-head bounds comes here too (the host planner takes shared bounds only); its
arrays become constants of the program.

Tiles that meet more than ``abi.GRID`` blocks per axis (blocks under ~tile / 3 tokens) get
bitmap steps, within a static capacity: for static bounds the count of such tile pairs (known
when tracing) where the budget holds them, else (and for traced bounds) what the budget
allows. Exactness for every mask: a selection whose bitmap steps overflow the capacity
(``lax.cond`` on the plan's ``ok``), or a budget of less than one step (static bounds: known
when tracing, a one-time warning), runs ``exact_attention``, a chunked XLA attention that
evaluates the mask per token (dense work, O(chunk x Lkv) memory), after (with
``Options.device_overflow`` "gather", the default) the backend's gathering template (no
bitmap steps, room for any selection). Invalid device bounds (not increasing from 0 to the
length) also take the exact path, whose indices are clamped: finite output, never an
out-of-bounds read; ``check`` surfaces them under ``checkify``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi
from pallas_kernels.templates import Template

from tessera_jax.batched_cond import batch_all
from tessera_jax.mask import BlockMask, unpack_blocks
from tessera_jax.planning import device as _device
from tessera_jax.planning import device_gather as _device_gather
from tessera_jax.planning.plan import AttentionPlan
from tessera_jax.runtime import core, dense_route, dispatch
from tessera_jax.runtime import options as options_
from tessera_jax.runtime.exact import exact_attention
from tessera_jax.runtime.options import Options
from tessera_jax.select import device as select_device
from tessera_jax.validation import AttnShape

__all__ = ["takes", "choose", "attention", "prepare", "device_plans",
           "dkv_tiles", "exact_attention", "check"]


def takes(mask: BlockMask) -> bool:
    """Whether a mask goes the device route: a device mask, or per-head bounds."""
    return not mask.is_static or mask.per_head_bounds


def choose(mask: BlockMask, shape: AttnShape, backend: str, template: Template | None,
           options: Options = options_.DEFAULT) -> Template | None:
    """The template of a device-route call (``select.device``), or None: no template's tiles
    fit the static bounds (the exact path runs). A caller's template must be device-capable
    (ValueError)."""
    return select_device.choose(mask, shape, backend, template, rule=options.device_rule)[0]


def _choose(consts: tuple, mask: BlockMask, shape: AttnShape, backend: str,
            template: Template | None,
            rule: select_device.DeviceRule = select_device.DEFAULT_RULE,
            ) -> tuple[Template | None, int]:
    """(template, bitmap capacity) of the static rule (``rule``: ``Options.device_rule``) for
    these static parts; (None, 0): the exact path."""
    if template is not None and not select_device.device_capable(template):
        choose(mask, shape, backend, template)              # raises
    features = select_device.DeviceFeatures(consts[0], consts[1], tuple(mask.blocks.shape),
                                            shape)
    return select_device.choose_template(features, backend, template, rule)


def decides(consts: tuple, blocks_shape: tuple, shape: AttnShape, t: Template | None,
            capacity: int) -> bool:
    """Whether the plan of ``_choose``'s (``t``, ``capacity``) decides its fit on the device
    (the plan's ``ok``): traced bounds, and static ones that may need more bitmap steps than
    the room; other static bounds fit."""
    return t is not None and select_device.decided_on_device(consts[0], consts[1],
                                                             blocks_shape, shape, t, capacity)


_warned: set = set()


def attention(q, k, v, mask: BlockMask, shape: AttnShape, backend: str, template: Template | None,
              scale: float, return_lse: bool, options: Options = options_.DEFAULT,
              packed=None, dense: str | None = None):
    """out (and lse) of a device-route call (arguments validated by the caller). ``packed``:
    the blocks as ``BlockMask.packed_leaves`` gives them (``mask.blocks`` then only says their
    shape), unpacked inside the program. ``dense``: an implementation of
    ``jax.nn.dot_product_attention`` ("cudnn": ``dense_route.on_device``) that runs the call
    when its blocks, traced, are all selected (one ``lax.cond``; None: no such test; static
    blocks are tested on the host by the caller, so it does not apply to them)."""
    statics = _statics(mask, shape, backend, template, scale, return_lse, options,
                       packed is not None, dense)
    blocks = mask.blocks if packed is None else packed
    return _run(q, k, v, *_dynamic(statics["consts"], mask.q_bounds, mask.kv_bounds, blocks),
                **statics)


def prepare(mask: BlockMask, shape: AttnShape, backend: str, template: Template | None,
            scale: float, return_lse: bool, options: Options = options_.DEFAULT,
            packed: bool = False):
    """``attention`` of this call site as ``fn(q, k, v, q_bounds, kv_bounds, blocks)`` for
    masks whose static parts (``select.device.static_parts``) and shapes are this one's (a
    static part's argument is ignored; ``blocks`` packed with ``packed``): the static choice
    made once and closed over by its own ``jax.jit``, so a call is jax's dispatch alone (no
    template choice, no static arguments hashed and compared: CPU box 147 -> 82 us). For a
    caller that keeps one per call site (``runtime.tiered``)."""
    statics = _statics(mask, shape, backend, template, scale, return_lse, options, packed, None)
    run, consts = jax.jit(functools.partial(_run_impl, **statics)), statics["consts"]
    compiled: dict = {}

    def fn(q, k, v, q_bounds, kv_bounds, blocks):
        args = (q, k, v, *_dynamic(consts, q_bounds, kv_bounds, blocks))
        dev = _device_of(q, k, v)
        if dev is None:                 # sharded, apart, or not jax arrays: jit's call
            return run(*args)
        c = compiled.get(dev)
        if c is None:
            c = compiled[dev] = _compile(run, dev, args)
        return c(*args)
    fn.executables = compiled           # device -> the compiled call
    fn.jitted = run
    return fn


def _device_of(*xs):
    """The one device these jax arrays are all on (committed there or not), else None."""
    found = set()
    for x in xs:
        devices = getattr(x, "devices", None)
        if devices is None:
            return None
        found |= devices()
    return next(iter(found)) if len(found) == 1 else None


def _compile(run, device, args):
    """``run`` compiled ahead of time for ``args``' shapes and dtypes on ``device``. One
    executable serves arrays committed to that device and uncommitted ones
    alike, where ``jax.jit``'s cache compiles each kind apart (``tj.precompile`` runs zeros,
    uncommitted; requests often bring committed arrays: DLPack, ``device_put(x, device)``,
    or anything computed from them: an XLA compile, seconds on a GPU, on the first request)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = [None if a is None else jax.ShapeDtypeStruct(np.shape(a), a.dtype,
                                                         sharding=sharding) for a in args]
    return run.lower(*specs).compile()


def _statics(mask, shape, backend, template, scale, return_lse, options, packed: bool,
             dense) -> dict:
    """``_run``'s static arguments of a call site (the template chosen, its warning given)."""
    consts = select_device.static_parts(mask)
    t, capacity = _choose(consts, mask, shape, backend, template, options.device_rule)
    if t is None:
        key = (tuple(mask.blocks.shape), shape.q_len, shape.kv_len, backend)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"tessera_jax: this mask needs bitmap steps (tiles meeting more "
                          f"than {abi.GRID} blocks) and Options.bitmap_budget_bytes holds "
                          "none on any template of the device route; it runs the exact XLA "
                          "path (dense work). A larger budget, larger blocks, or a static "
                          "mask with shared bounds (host planner) run the kernels",
                          stacklevel=4)
    if packed and consts[2] is not None:
        raise ValueError("packed blocks need a mask whose blocks are not NumPy")
    if return_lse or consts[2] is not None:
        dense = None
    return dict(consts=consts, template=t.name if t else None, capacity=capacity,
                decide=decides(consts, tuple(mask.blocks.shape), shape, t, capacity),
                scale=float(scale), return_lse=bool(return_lse), options=options,
                packed_shape=tuple(mask.blocks.shape) if packed else None, dense=dense)


def _dynamic(consts: tuple, q_bounds, kv_bounds, blocks) -> list:
    """``_run``'s array arguments: None where the call site's static parts hold the value."""
    return [None if c is not None else x for c, x in zip(consts, (q_bounds, kv_bounds, blocks))]


def _run_impl(q, k, v, qb, kb, blocks, *, consts, template, capacity, decide, scale,
              return_lse, options, packed_shape=None, dense=None):
    if packed_shape is not None:
        blocks = unpack_blocks(blocks, packed_shape)
    # Static parts stay NumPy constants the planner reads when tracing; only the traced ones
    # reach the conditional below (by closure), never the constants as operands.
    qb, kb, blocks = (c.array if c is not None else x for c, x in zip(consts, (qb, kb, blocks)))

    def planned():
        if template is None:
            plan = AttentionPlan(None, exact=(qb, kb, blocks))
        else:
            full, first = _refines(consts, template, capacity, decide, q, k,
                                   tuple(blocks.shape), options)
            plan = full(qb, kb, blocks) if first is None else \
                dataclasses.replace(first(qb, kb, blocks), refine=full)
        return core.attention(q, k, v, plan, scale, return_lse, options)

    if dense is None:
        return planned()
    return jax.lax.cond(batch_all(jnp.all(blocks)),
                        lambda: dense_route.fused(q, k, v, scale, dense), planned)


_run = jax.jit(_run_impl, static_argnames=("consts", "template", "capacity", "decide", "scale",
                                           "return_lse", "options", "packed_shape", "dense"))


def _refines(consts, template: str, capacity: int, decide: bool, q, k, blocks_shape,
             options: Options):
    """(whole room's plans, first room's plans or None) of a call site (``_Refine``s; ``q``,
    ``k``: anything with a shape and dtype): the first only for traced bounds where
    ``_first_room`` gives one."""
    full = _Refine(consts, template, capacity, options.bitmap_budget_bytes, decide,
                   tuple(q.shape), tuple(k.shape), str(np.dtype(q.dtype)))
    full = dataclasses.replace(full, then=_overflow(full, options))
    traced = consts[0] is None or consts[1] is None
    first = _first_room(dispatch.get_template(template), capacity, blocks_shape, q.shape[1],
                        k.shape[1], options) if traced else None
    return full, (None if first is None else dataclasses.replace(
        full, capacity=first[0], budget=first[1], then=None))


def _overflow(full: "_Refine", options: Options) -> "_Refine | None":
    """The plan after ``full`` where its selection overflows the room decided on the device
    (``Options.device_overflow`` "gather", the default): the backend's gathering template,
    whose plan has room for any selection (``planning.device_gather``); None: the exact path
    follows."""
    t = dispatch.get_template(full.template)
    g = select_device.GATHER_TEMPLATES.get(t.backend)
    if options.device_overflow != "gather" or not full.decide or g is None \
            or select_device.gathers_on_device(t):
        return None
    if not dispatch.get_template(g).supports(full.q_shape[-1], np.dtype(full.dtype)):
        return None
    return dataclasses.replace(full, template=g, capacity=0, decide=True)


def _first_room(t: Template, capacity: int, blocks_shape, q_len: int, kv_len: int,
                options: Options):
    """(capacity, budget) of the first plan of traced bounds (``Options.bitmap_first_bytes``),
    or None: one plan with the whole room. Only where the mean blocks span at least 3/4 of a
    tile on both axes (a tile then rarely meets more than GRID blocks: Wan 480p cubes and
    sliding tiles, 52.5 tokens in 64-token tiles, fit the first room; variable clusters of ~41
    keys in 64-key tiles need 76 MB and were planned twice: per-head over shared 1.35 against
    1.19 with one plan, H100, results/h100-clusters-device.json)."""
    first = options.bitmap_first_bytes
    if not capacity or not first or first >= options.bitmap_budget_bytes \
            or select_device.gathers_on_device(t):
        return None
    _, nq, nk = blocks_shape
    if 4 * q_len < 3 * t.tile_q * nq or 4 * kv_len < 3 * t.tile_kv * nk:
        return None
    cap = min(capacity, max(1, first // select_device.bitmap_step_bytes(t)))
    return (cap, first) if cap < capacity else None


@dataclasses.dataclass(frozen=True)
class _Refine:
    """``device_plans`` of one call site with a given bitmap room, as a function of the mask's
    (traced) arrays: ``AttentionPlan.refine`` (hashable: it rides in the plan's treedef)."""

    consts: tuple
    template: str
    capacity: int
    budget: int
    decide: bool
    q_shape: tuple
    k_shape: tuple
    dtype: str
    then: "_Refine | None" = None     # where this plan overflows (``_overflow``); None: exact

    def __call__(self, qb, kb, blocks) -> AttentionPlan:
        q = jax.ShapeDtypeStruct(self.q_shape, np.dtype(self.dtype))
        k = jax.ShapeDtypeStruct(self.k_shape, np.dtype(self.dtype))
        plan = device_plans(q, k, qb, kb, blocks, consts=self.consts,
                            t=dispatch.get_template(self.template), capacity=self.capacity,
                            decide=self.decide, budget=self.budget)
        return plan if self.then is None else dataclasses.replace(plan, refine=self.then)


class _Tiles(NamedTuple):
    tile_q: int
    tile_kv: int


def dkv_tiles(t: Template, head_dim: int) -> tuple[int, int]:
    """(keys per unit, queries per step) of a device dk/dv plan for forward template ``t``:
    the backend's paired tiles when ``t`` has 64-key tiles (the route's choice for K/V blocks
    of <= 64 tokens: a 128-key unit would compute the union of two blocks' queries), else its
    dk/dv tiles."""
    ops = dispatch.BACKENDS[t.backend].ops()
    paired = ops.PAIRED_DKV_TILES
    if paired is not None and t.tile_kv <= paired[0]:
        return int(paired[0]), int(paired[1])
    tiles = ops.dkv_tiles(t, head_dim)
    return int(tiles[0]), int(tiles[1])


def device_plans(q, k, qb, kb, blocks, *, consts, t: Template, capacity: int, decide: bool,
                 budget: int) -> AttentionPlan:
    """The device route's chooser, inside the program: the forward plan of template ``t`` and
    the dk/dv plan of the transposed mask (``planning.device.plan_on_device``), its bitmap
    capacity as the forward's (None past the budget: the backward takes the exact path). A
    forward-only program never uses the dk/dv plan, and XLA removes it."""
    B, Lq, Hq, D = q.shape
    Lkv = k.shape[1]
    bounds = tuple(c.array if c is not None else x for c, x in zip(consts[:2], (qb, kb)))
    kw = dict(q_len=Lq, kv_len=Lkv, tile_q=t.tile_q, tile_kv=t.tile_kv)
    if select_device.gathers_on_device(t) and (decide or _device_gather.fits(*bounds, **kw)):
        # The gather policy in jnp (``planning.device_gather``), with room for any selection:
        # its ``ok`` holds for static bounds that fit, and decides for traced ones.
        cap = _device_gather.step_bound(*bounds, **kw)[1] * blocks.shape[0]
        fwd, ok = _device_gather.plan_gather_on_device(blocks, *bounds, num_q_heads=Hq,
                                                       capacity=cap, row_group=t.row_group,
                                                       **kw)
    else:
        fwd, ok = _device.plan_on_device(blocks, qb, kb, num_q_heads=Hq, q_len=Lq,
                                         kv_len=Lkv, tile_q=t.tile_q, tile_kv=t.tile_kv,
                                         bitmap_capacity=capacity)
    tq, tk = dkv_tiles(t, D)
    Hm, nq, nk = blocks.shape
    tshape = AttnShape(B, Lkv, Lq, Hq, Hq, D, np.dtype(q.dtype))
    args_t = (consts[1], consts[0], (Hm, nk, nq), tshape, _Tiles(tq, tk))
    cap_t = select_device.capacity(*args_t, budget)
    dkv = dkv_ok = None
    dkv_decides = False
    if cap_t is not None:
        dkv, dkv_ok = _device.plan_on_device(jnp.swapaxes(jnp.asarray(blocks), 1, 2), kb, qb,
                                             num_q_heads=Hq, q_len=Lkv, kv_len=Lq, tile_q=tq,
                                             tile_kv=tk, bitmap_capacity=cap_t)
        dkv_decides = select_device.decided_on_device(*args_t, cap_t)
    return AttentionPlan(fwd, dkv, ok if decide else None, dkv_ok if dkv_decides else None,
                         exact=(qb, kb, blocks), template=t.name, backend=t.backend)


def check(mask: BlockMask, q_len: int, kv_len: int) -> None:
    """A ``checkify`` check that a device mask's bounds increase strictly from 0 to the
    lengths (run the caller under ``jax.experimental.checkify.checkify``, e.g. in debug runs
    and tests). Invalid bounds never read out of bounds: without the check they give finite,
    meaningless output."""
    from jax.experimental import checkify
    for name, b, length in (("q_bounds", mask.q_bounds, q_len),
                            ("kv_bounds", mask.kv_bounds, kv_len)):
        b = jnp.asarray(b).reshape(-1, b.shape[-1])
        ok = jnp.all(b[:, 0] == 0) & jnp.all(b[:, -1] == length) & jnp.all(b[:, 1:] > b[:, :-1])
        checkify.check(ok, f"BlockMask.{name} must increase strictly from 0 to {length}")
