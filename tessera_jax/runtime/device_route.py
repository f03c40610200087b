"""The device route: a device mask (jax arrays; or per-head bounds) planned and run inside one
compiled program, with no host planning, no host transfer and no recompile for a new mask of
the same shapes.

A call site's template is a *static* choice (``choose``): the first template of the backend's
list in ``DEVICE_TEMPLATES`` that takes the call and whose plan needs no bitmap steps for the
static bounds, else the first whose bitmap steps fit ``Options.bitmap_budget_bytes`` (traced bounds:
the first); static K/V blocks of <= 64 tokens (median) try 64-key tiles first, static query
blocks of <= 64 tokens 64-row units (q64x2: two per CTA). Why static, not
a ``lax.switch`` over ranked templates: the ranking reads mask features the host does not have
under a trace, a switch would compile every template into every call site, and the device
planner has one policy (a step per selected tile), for which q128 x kv128 steps run fastest on
the H200 (full steps 0.97 of cuDNN's rate against 0.79-0.81 at kv64, masked ones 0.69-0.85
against 0.52-0.66: ``benchmarks/NOTES.md#masked-steps``). A static mask with per-head bounds
comes here too (the host planner takes shared bounds only); its arrays become constants of the
program.

Tiles that meet more than ``abi.GRID`` blocks per axis (blocks under ~tile / 3 tokens) get
bitmap steps, within a static capacity: for static bounds the count of such tile pairs (known
when tracing), for traced bounds what the budget allows. Exactness for every mask: a mask
whose bitmaps exceed the budget (static bounds: known when tracing, a one-time warning) or
overflow the capacity (traced bounds: ``lax.cond`` on the plan's ``ok``) runs
``exact_attention`` instead, a chunked XLA attention that evaluates the mask per token (dense
work, O(chunk x Lkv) memory). Invalid device bounds (not increasing from 0 to the length) also
take the exact path, whose indices are clamped: finite output, never an out-of-bounds read;
``check`` surfaces them under ``checkify``.
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi
from pallas_kernels.templates import Template

from tessera_jax.mask import BlockMask
from tessera_jax.planning import device as _device
from tessera_jax.planning.plan import AttentionPlan
from tessera_jax.runtime import core, dispatch
from tessera_jax.runtime import options as options_
from tessera_jax.runtime.exact import exact_attention
from tessera_jax.runtime.options import Options
from tessera_jax.validation import AttnShape

__all__ = ["DEVICE_TEMPLATES", "takes", "choose", "attention", "device_plans", "dkv_tiles",
           "exact_attention", "check"]

#: Per backend, the templates a device plan may run, in order of preference (see the module
#: docstring). q64x2 runs neighbouring 64-row units of the device plan in one CTA, one per
#: consumer warpgroup (units heaviest first, so a CTA's two units cost about the same).
DEVICE_TEMPLATES = types.MappingProxyType({
    "mosaic_gpu": ("mgpu_q128_kv128_s2_hm", "mgpu_q128_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm"),
    "triton": ("triton_q128_kv128_w8_s3_pf_hm", "triton_q128_kv64_w8_s3_pf_hm",
               "triton_q64_kv64_w4_s2"),
    "xla": ("xla_64x64", "xla_128x128", "xla_64x128", "xla_128x64"),
})


def takes(mask: BlockMask) -> bool:
    """Whether a mask goes the device route: a device mask, or per-head bounds."""
    return not mask.is_static or mask.per_head_bounds


class _Const:
    """A NumPy array as a hashable static argument, compared by ``key`` (its content by
    default; a static mask's digest where it has one)."""

    __slots__ = ("array", "_key")

    def __init__(self, array: np.ndarray, key=None):
        self.array = array
        self._key = key if key is not None else (array.shape, array.dtype.str, array.tobytes())

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Const) and other._key == self._key


def _fine_tiles(bounds: _Const | None, n: int, length: int, tile: int):
    """Per bounds row, how many of the device plan's tiles meet more than ``abi.GRID`` blocks
    (static bounds), or a bound from the block count (traced bounds: a tile meeting more than
    GRID blocks holds GRID of the n - 1 inner bounds); and the tile count."""
    if bounds is None:
        nt = -(-length // tile)
        return np.array([min(nt, (n - 1) // abi.GRID)]), nt
    b = np.asarray(bounds.array, np.int32).reshape(-1, bounds.array.shape[-1])
    org, _, _, first, last, _, _ = _device._axis(b, length, tile, True)
    return (last - first + 1 > abi.GRID).sum(axis=1), org.shape[1]


def _capacity(qb, kb, shape_blocks, shape: AttnShape, t, budget: int) -> int | None:
    """Bitmap steps the device plan of ``t`` (its tile_q, tile_kv) needs room for (0: none),
    or None when that exceeds ``budget`` bytes for static bounds (the exact path runs); traced
    bounds get what the budget allows (the plan's ``ok`` says on the device whether it
    sufficed)."""
    Hm, nq, nk = shape_blocks
    fq, nqt = _fine_tiles(qb, nq, shape.q_len, t.tile_q)
    fk, nkt = _fine_tiles(kb, nk, shape.kv_len, t.tile_kv)
    if not fq.any() and not fk.any():
        return 0
    per_row = fq * nkt + nqt * fk - fq * fk
    pairs = int(per_row.sum() if len(per_row) == Hm else per_row.max() * Hm)
    per_bitmap = abi.bitmap_rows(t.tile_q, t.tile_kv) * abi.STEP_COLS * 4
    room = budget // per_bitmap
    if qb is not None and kb is not None:
        return pairs if pairs <= room else None
    return max(1, min(pairs, room))


def _device_capable(t: Template) -> bool:
    return t.name in DEVICE_TEMPLATES[t.backend] or not getattr(t.kernel, "paired", False)


def _consts(mask: BlockMask) -> tuple:
    """The mask's NumPy parts as static arguments (None for a jax array), keyed by the mask's
    digest when it is static (no hashing of its arrays per call). A device mask's NumPy blocks
    are not made static (they would be hashed every call): they go in as an operand."""
    parts = (mask.q_bounds, mask.kv_bounds, mask.blocks)
    if mask.is_static:
        return tuple(_Const(np.asarray(x), (mask.digest, i)) for i, x in enumerate(parts))
    return tuple(_Const(np.asarray(x)) if i < 2 and not isinstance(x, jax.Array) else None
                 for i, x in enumerate(parts))


@functools.lru_cache(maxsize=512)
def _choose(qb: _Const | None, kb: _Const | None, shape_blocks: tuple, shape: AttnShape,
            backend: str, template: Template | None,
            budget: int = options_.DEFAULT.bitmap_budget_bytes) -> tuple[Template | None, int]:
    """(template, bitmap capacity); (None, 0): the exact path."""
    if template is not None:
        cap = _capacity(qb, kb, shape_blocks, shape, template, budget)
        return (template, cap) if cap is not None else (None, 0)
    names = DEVICE_TEMPLATES[backend]

    def small(b):
        return b is not None and float(np.median(np.diff(np.asarray(b.array), axis=-1))) <= 64

    # K/V blocks of <= 64 tokens: a 128-key tile would hold two, and a sparse per-head
    # selection keeps one of them most of the time (a masked step at 0.67 of cuDNN's rate
    # for half the keys, against a full 64-key step at 0.80): 64-key tiles first. Query blocks
    # of <= 64 tokens likewise: 64-row units (VSA's cubes at Wan 720p: the host's q64x2 plan
    # ran 76.7 ms against 111.8 for the device's q128 x kv64 one). Otherwise 128-row units.
    sq, sk = small(qb), small(kb)
    names = sorted(names, key=lambda n: (sq != (dispatch.get_template(n).tile_q <= 64),
                                         sk != (dispatch.get_template(n).tile_kv <= 64)))
    fitting = []
    for name in names:
        t = dispatch.get_template(name)
        if dispatch.unsupported(t, shape) is None:
            cap = _capacity(qb, kb, shape_blocks, shape, t, budget)
            if cap == 0:
                return t, 0                  # no bitmap steps: the first such template
            if cap is not None:
                fitting.append((t, cap))
    return fitting[0] if fitting else (None, 0)


def choose(mask: BlockMask, shape: AttnShape, backend: str, template: Template | None,
           options: Options = options_.DEFAULT) -> Template | None:
    """The template of a device-route call, or None: no template's tiles fit the static bounds
    (the exact path runs). A caller's template must be device-capable (ValueError). Memoised
    per (static bounds, shapes, backend, template)."""
    if template is not None and not _device_capable(template):
        raise ValueError(f"template {template.name!r} pairs query units; a device mask runs "
                         f"on one of {DEVICE_TEMPLATES[template.backend]}")
    qb, kb, _ = _consts(mask)
    return _choose(qb, kb, tuple(mask.blocks.shape), shape, backend, template,
                   options.bitmap_budget_bytes)[0]


_warned: set = set()


def clear_caches() -> None:
    """Forgets the memoised template choices (``tessera_jax.clear_caches``)."""
    _choose.cache_clear()


def attention(q, k, v, mask: BlockMask, shape: AttnShape, backend: str, template: Template | None,
              scale: float, return_lse: bool, options: Options = options_.DEFAULT):
    """out (and lse) of a device-route call (arguments validated by the caller)."""
    consts = _consts(mask)
    if template is not None and not _device_capable(template):
        choose(mask, shape, backend, template)              # raises
    t, capacity = _choose(consts[0], consts[1], tuple(mask.blocks.shape), shape, backend,
                          template, options.bitmap_budget_bytes)
    if t is None:
        key = (tuple(mask.blocks.shape), shape.q_len, shape.kv_len, backend)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"tessera_jax: this mask's bitmap steps (tiles meeting more than "
                          f"{abi.GRID} blocks) exceed Options.bitmap_budget_bytes on "
                          "every template of the device route; it runs the exact XLA path "
                          "(dense work). Larger blocks, or a static mask with shared bounds "
                          "(host planner), run the kernels", stacklevel=3)
    dyn = [None if c is not None else x
           for c, x in zip(consts, (mask.q_bounds, mask.kv_bounds, mask.blocks))]
    # With static bounds the fit is known now (``choose``); traced bounds decide on the device.
    decide = consts[0] is None or consts[1] is None
    return _run(q, k, v, *dyn, consts=consts, template=t.name if t else None,
                capacity=capacity, decide=decide, scale=float(scale),
                return_lse=bool(return_lse), options=options)


@functools.partial(jax.jit, static_argnames=("consts", "template", "capacity", "decide",
                                             "scale", "return_lse", "options"))
def _run(q, k, v, qb, kb, blocks, *, consts, template, capacity, decide, scale, return_lse,
         options):
    qb, kb, blocks = (c.array if c is not None else x for c, x in zip(consts, (qb, kb, blocks)))
    if template is None:
        plan = AttentionPlan(None, exact=(qb, kb, blocks))
    else:
        plan = device_plans(q, k, qb, kb, blocks, consts=consts,
                            t=dispatch.get_template(template), capacity=capacity,
                            decide=decide, budget=options.bitmap_budget_bytes)
    return core.attention(q, k, v, plan, scale, return_lse, options)


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
    fwd, ok = _device.plan_on_device(blocks, qb, kb, num_q_heads=Hq, q_len=Lq, kv_len=Lkv,
                                     tile_q=t.tile_q, tile_kv=t.tile_kv,
                                     bitmap_capacity=capacity)
    tq, tk = dkv_tiles(t, D)
    Hm, nq, nk = blocks.shape
    tshape = AttnShape(B, Lkv, Lq, Hq, Hq, D, np.dtype(q.dtype))
    cap_t = _capacity(consts[1], consts[0], (Hm, nk, nq), tshape, _Tiles(tq, tk), budget)
    dkv = dkv_ok = None
    if cap_t is not None:
        dkv, dkv_ok = _device.plan_on_device(jnp.swapaxes(jnp.asarray(blocks), 1, 2), kb, qb,
                                             num_q_heads=Hq, q_len=Lkv, kv_len=Lq, tile_q=tq,
                                             tile_kv=tk, bitmap_capacity=cap_t)
    return AttentionPlan(fwd, dkv, ok if decide else None, dkv_ok if decide else None,
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
