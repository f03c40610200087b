"""The device route: a device mask (jax arrays; or per-head bounds) planned and run inside one
compiled program, with no host planning, no host transfer and no recompile for a new mask of
the same shapes.

A call site's template is a *static* choice (``choose``): the first template of the backend's
list in ``DEVICE_TEMPLATES`` that takes the call and whose plan needs no bitmap steps for the
static bounds, else the first whose bitmap steps fit ``BITMAP_BUDGET_BYTES`` (traced bounds:
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

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi
from pallas_kernels.templates import Template

from tessera_jax.mask import BlockMask
from tessera_jax.planning import device as _device
from tessera_jax.runtime import dispatch
from tessera_jax.validation import AttnShape

__all__ = ["DEVICE_TEMPLATES", "takes", "choose", "attention", "exact_attention", "check"]

#: Per backend, the templates a device plan may run, in order of preference (see the module
#: docstring). q64x2 runs neighbouring 64-row units of the device plan in one CTA, one per
#: consumer warpgroup (units heaviest first, so a CTA's two units cost about the same).
DEVICE_TEMPLATES = types.MappingProxyType({
    "mosaic_gpu": ("mgpu_q128_kv128_s2_hm", "mgpu_q128_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm"),
    "triton": ("triton_q128_kv128_w8_s3_pf_hm", "triton_q128_kv64_w8_s3_pf_hm",
               "triton_q64_kv64_w4_s2"),
    "xla": ("xla_64x64", "xla_128x128", "xla_64x128", "xla_128x64"),
})

#: Bytes of bitmap steps a device plan may hold (tiles meeting more than ``abi.GRID`` blocks
#: per axis: 2 KB each at 128 x 128); past it, static bounds take the exact path and traced
#: bounds take it when the plan overflows (decided on the device).
BITMAP_BUDGET_BYTES = 512 << 20

# Scores of one chunk of the exact path stay near this many float32 elements.
_EXACT_CHUNK_ELEMS = 1 << 24


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


def _capacity(qb, kb, shape_blocks, shape: AttnShape, t: Template) -> int | None:
    """Bitmap steps the device plan of ``t`` needs room for (0: none), or None when that
    exceeds ``BITMAP_BUDGET_BYTES`` for static bounds (the exact path runs); traced bounds get
    what the budget allows (the plan's ``ok`` says on the device whether it sufficed)."""
    Hm, nq, nk = shape_blocks
    fq, nqt = _fine_tiles(qb, nq, shape.q_len, t.tile_q)
    fk, nkt = _fine_tiles(kb, nk, shape.kv_len, t.tile_kv)
    if not fq.any() and not fk.any():
        return 0
    per_row = fq * nkt + nqt * fk - fq * fk
    pairs = int(per_row.sum() if len(per_row) == Hm else per_row.max() * Hm)
    per_bitmap = abi.bitmap_rows(t.tile_q, t.tile_kv) * abi.STEP_COLS * 4
    room = BITMAP_BUDGET_BYTES // per_bitmap
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
            backend: str, template: Template | None) -> tuple[Template | None, int]:
    """(template, bitmap capacity); (None, 0): the exact path."""
    if template is not None:
        cap = _capacity(qb, kb, shape_blocks, shape, template)
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
            cap = _capacity(qb, kb, shape_blocks, shape, t)
            if cap == 0:
                return t, 0                  # no bitmap steps: the first such template
            if cap is not None:
                fitting.append((t, cap))
    return fitting[0] if fitting else (None, 0)


def choose(mask: BlockMask, shape: AttnShape, backend: str,
           template: Template | None) -> Template | None:
    """The template of a device-route call, or None: no template's tiles fit the static bounds
    (the exact path runs). A caller's template must be device-capable (ValueError). Memoised
    per (static bounds, shapes, backend, template)."""
    if template is not None and not _device_capable(template):
        raise ValueError(f"template {template.name!r} pairs query units; a device mask runs "
                         f"on one of {DEVICE_TEMPLATES[template.backend]}")
    qb, kb, _ = _consts(mask)
    return _choose(qb, kb, tuple(mask.blocks.shape), shape, backend, template)[0]


_warned: set = set()


def clear_caches() -> None:
    """Forgets the memoised template choices (``tessera_jax.clear_caches``)."""
    _choose.cache_clear()


def attention(q, k, v, mask: BlockMask, shape: AttnShape, backend: str, template: Template | None,
              scale: float, return_lse: bool):
    """out (and lse) of a device-route call (arguments validated by the caller)."""
    consts = _consts(mask)
    if template is not None and not _device_capable(template):
        choose(mask, shape, backend, template)              # raises
    t, capacity = _choose(consts[0], consts[1], tuple(mask.blocks.shape), shape, backend,
                          template)
    if t is None:
        key = (tuple(mask.blocks.shape), shape.q_len, shape.kv_len, backend)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"tessera_jax: this mask's bitmap steps (tiles meeting more than "
                          f"{abi.GRID} blocks) exceed device_route.BITMAP_BUDGET_BYTES on "
                          "every template of the device route; it runs the exact XLA path "
                          "(dense work). Larger blocks, or a static mask with shared bounds "
                          "(host planner), run the kernels", stacklevel=3)
    dyn = [None if c is not None else x
           for c, x in zip(consts, (mask.q_bounds, mask.kv_bounds, mask.blocks))]
    # With static bounds the fit is known now (``choose``); traced bounds decide on the device.
    decide = consts[0] is None or consts[1] is None
    from tessera_jax.runtime import autodiff      # _run under a custom_vjp (it imports us)
    return autodiff.device_run(q, k, v, *dyn, consts=consts, template=t.name if t else None,
                               capacity=capacity, decide=decide, scale=scale,
                               return_lse=return_lse)


@functools.partial(jax.jit, static_argnames=("consts", "template", "capacity", "decide",
                                             "scale", "return_lse"))
def _run(q, k, v, qb, kb, blocks, *, consts, template, capacity, decide, scale, return_lse):
    qb, kb, blocks = (c.array if c is not None else x for c, x in zip(consts, (qb, kb, blocks)))
    Lq, Hq, Lkv = q.shape[1], q.shape[2], k.shape[1]

    def exact():
        return exact_attention(q, k, v, qb, kb, blocks, scale=scale, return_lse=return_lse)

    if template is None:
        return exact()
    t = dispatch.get_template(template)
    p = _device.plan_on_device(blocks, qb, kb, num_q_heads=Hq, q_len=Lq, kv_len=Lkv,
                               tile_q=t.tile_q, tile_kv=t.tile_kv, bitmap_capacity=capacity)
    plan = types.SimpleNamespace(template=t.name, units=p.units, steps=p.steps, row_index=None,
                                 tile_q=p.tile_q, tile_kv=p.tile_kv, q_len_padded=p.q_len_padded,
                                 kv_len_padded=p.kv_len_padded, max_steps=p.max_steps)

    def kernel():
        return dispatch.run(plan, q, k, v, scale, return_lse)

    return jax.lax.cond(p.ok, kernel, exact) if decide else kernel()


def _block_ids(bounds, positions):
    """Block index of each position, per bounds row: [Hb, P], clamped into range (bad bounds
    give wrong but in-range ids)."""
    n = bounds.shape[-1] - 1
    ids = jax.vmap(lambda b: jnp.searchsorted(b, positions, side="right"))(bounds) - 1
    return jnp.clip(ids, 0, n - 1)


def exact_attention(q, k, v, q_bounds, kv_bounds, blocks, *, scale, return_lse=False):
    """Attention under a block mask evaluated per token, in float32, over query chunks (dense
    work, O(chunk x Lkv) memory): the exact path of masks the device plan can't hold. Bounds
    [n + 1] or [Hm, n + 1] (NumPy or jax), blocks [Hm, nq, nk]."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    Hm, nq, nk = blocks.shape
    qb = jnp.asarray(q_bounds, jnp.int32).reshape(-1, nq + 1)
    kb = jnp.asarray(kv_bounds, jnp.int32).reshape(-1, nk + 1)
    blocks = jnp.asarray(blocks)
    kid = _block_ids(kb, jnp.arange(Lkv, dtype=jnp.int32))             # [Hbk, Lkv]
    C = int(max(8, min(Lq, _EXACT_CHUNK_ELEMS // max(1, B * Hq * Lkv))))
    n_chunks = -(-Lq // C)
    qp = jnp.pad(q, ((0, 0), (0, n_chunks * C - Lq), (0, 0), (0, 0)))
    qc = qp.reshape(B, n_chunks, C, Hq, D).swapaxes(0, 1)
    kf = jnp.repeat(k.astype(jnp.float32), Hq // Hkv, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), Hq // Hkv, axis=2)
    heads = jnp.arange(Hm)[:, None, None]

    def one(args):
        i, qx = args
        rows = i * C + jnp.arange(C, dtype=jnp.int32)
        qid = _block_ids(qb, rows)                                       # [Hbq, C]
        sel = blocks[heads, qid[:, :, None], kid[:, None, :]]            # [Hm, C, Lkv]
        sel = jnp.broadcast_to(sel, (Hq, C, Lkv))
        s = jnp.einsum("bqhd,bkhd->bhqk", qx.astype(jnp.float32), kf,
                       precision="highest") * scale
        s = jnp.where(sel[None], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), vf, precision="highest")
        lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0))
                        + m[..., 0], -jnp.inf)
        return o, lse

    o, lse = jax.lax.map(one, (jnp.arange(n_chunks, dtype=jnp.int32), qc))
    out = o.swapaxes(0, 1).reshape(B, n_chunks * C, Hq, D)[:, :Lq].astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.moveaxis(lse, 0, 2).reshape(B, Hq, n_chunks * C)[:, :, :Lq]
    return out, lse


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
