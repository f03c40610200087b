"""Reverse-mode autodiff of ``sparse_attention``: a ``jax.custom_vjp`` over both routes.

Forward: the planned kernel, returning out and lse; the residuals are q, k, v, out and lse
(O(L): never a score matrix). Backward, on the forward's backend (``BACKWARD``):

* delta = rowsum(out * dout) - dlse (the cotangent of lse when it is returned), and lse with
  +inf on rows that select nothing (``pallas_kernels.backward_rows``);
* dq: one pass over the *forward plan* (each unit's query tile against its K/V steps);
* dk, dv: one pass over the *transposed plan*, the plan of the transposed mask (blocks
  [Hm, nkv, nq], bounds swapped) made by the same planners (host: ``planner.build_unchecked``,
  cached per forward plan; device: ``planning.device.plan_on_device`` inside the program):
  its units are key tiles of one query head, its steps query tiles; dk, dv per query head are
  summed over each K/V head's group (GQA).

Device masks the device plan can't hold (the forward's exact path) get ``exact_backward``,
chunked over queries like ``device_route.exact_attention`` (dense work, O(chunk x Lkv)
memory). GPU backward kernels are first-order: differentiating the backward again raises a
``NotImplementedError`` that says so (the XLA path is plain jnp and differentiates again).
Forward-mode (``jax.jvp``) is not defined for a ``custom_vjp``; jax says so.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import backward_rows as rows_

from tessera_jax.mask import BlockMask
from tessera_jax.planning import device as _device
from tessera_jax.planning import planner
from tessera_jax.runtime import batching, device_route, dispatch
from tessera_jax.runtime.kernel_runner import tracing
from tessera_jax.validation import AttnShape

__all__ = ["Backward", "BACKWARD", "run", "device_run", "transposed_mask", "transposed_plan",
           "dkv_tiles", "exact_backward", "clear_cache"]


# --- the backward table ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Backward:
    """One backend's backward.

    dq:        dq(plan, template, q, k, v, do, lse, delta, scale) -> dq [B, Lq, Hq, D], over the
               forward plan (a ``Plan`` or a plan-like namespace: units, steps, tile_q, tile_kv,
               q_len_padded, kv_len_padded, max_steps)
    dkv:       dkv(tplan, q, k, v, do, lse, delta, scale) -> (dk, dv) [B, Lkv, Hkv, D], over
               the transposed plan
    dkv_tiles: dkv_tiles(tile_q, tile_kv, shape) -> (tile_q', tile_kv', q_align', kv_align')
               of the transposed plan (tile_q': keys per unit, tile_kv': queries per step)
               for a forward plan of those tiles
    paired_dkv_tiles: tiles of paired dk/dv units (two units per CTA, one per warpgroup), a
               host-plan candidate beside dkv_tiles' (None: the backend has none)
    first_order: its kernels can't be differentiated again (GPU kernels)
    fold_vmap: under jax.vmap its kernels run once with the vmapped axis folded into the batch
               (``runtime.batching``; Mosaic GPU kernels have no batching rule to rely on)
    row_dots:  row_dots(out, do) -> rowsum(out * do) [B, Hq, Lq] float32 as a kernel (None:
               jnp, ``backward_rows.delta_of``); see ``pallas_kernels.triton.delta``
    """

    name: str
    dq: Callable
    dkv: Callable
    dkv_tiles: Callable
    paired_dkv_tiles: tuple | None = None
    first_order: bool = True
    fold_vmap: bool = False
    row_dots: Callable | None = None


def _host_rows(plan):
    """A host plan's row_index (NumPy: its gathers then use host constants), else None (a
    device plan's is made from its units inside the program)."""
    ri = getattr(plan, "row_index", None) if isinstance(plan, planner.Plan) else None
    return ri if isinstance(ri, np.ndarray) else None


def _xla_dq(plan, template, q, k, v, do, lse, delta, scale):
    from pallas_kernels.xla import backward as xb
    return xb.dq(q, k, v, do, lse, delta, plan.units, plan.steps, None, tile_q=plan.tile_q,
                 tile_kv=plan.tile_kv, q_len_padded=plan.q_len_padded,
                 kv_len_padded=plan.kv_len_padded, max_steps=plan.max_steps, scale=scale)


def _xla_dkv(tp, q, k, v, do, lse, delta, scale):
    from pallas_kernels.xla import backward as xb
    return xb.dkv(q, k, v, do, lse, delta, tp.units, tp.steps, None, tile_q=tp.tile_q,
                  tile_kv=tp.tile_kv, q_len_padded=tp.q_len_padded,
                  kv_len_padded=tp.kv_len_padded, max_steps=tp.max_steps, scale=scale)


def _triton_dq(plan, template, q, k, v, do, lse, delta, scale):
    from pallas_kernels.triton import backward as tb
    return tb.dq(q, k, v, do, lse, delta, plan.units, plan.steps, tile_q=plan.tile_q,
                 tile_kv=plan.tile_kv, q_len_padded=plan.q_len_padded,
                 kv_len_padded=plan.kv_len_padded, scale=scale, row_index=_host_rows(plan))


def _triton_dkv(tp, q, k, v, do, lse, delta, scale):
    from pallas_kernels.triton import backward as tb
    return tb.dkv(q, k, v, do, lse, delta, tp.units, tp.steps, tile_q=tp.tile_q,
                  tile_kv=tp.tile_kv, q_len_padded=tp.q_len_padded,
                  kv_len_padded=tp.kv_len_padded, scale=scale, row_index=_host_rows(tp))


def _triton_tiles(tile_q, tile_kv, shape: AttnShape):
    from pallas_kernels.triton import backward as tb
    return tb.dkv_tiles(shape.head_dim) + (1, 1)


def _mosaic_dq(plan, template, q, k, v, do, lse, delta, scale):
    from pallas_kernels.mosaic import backward as mb
    return mb.dq(q, k, v, do, lse, delta, plan.units, plan.steps, template=template,
                 q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded, scale=scale,
                 interpret=_mosaic_interpret(), row_index=_host_rows(plan))


def _mosaic_dkv(tp, q, k, v, do, lse, delta, scale):
    from pallas_kernels.mosaic import backward as mb
    return mb.dkv(q, k, v, do, lse, delta, tp.units, tp.steps, tile_q=tp.tile_q,
                  tile_kv=tp.tile_kv, q_len_padded=tp.q_len_padded,
                  kv_len_padded=tp.kv_len_padded, scale=scale, interpret=_mosaic_interpret(),
                  row_index=_host_rows(tp))


def _triton_row_dots(out, do):
    from pallas_kernels.triton import delta, wrapper
    return delta.row_dots(out, do, interpret=wrapper.default_interpret())


def _mosaic_tiles(tile_q, tile_kv, shape: AttnShape):
    from pallas_kernels.mosaic import backward as mb
    return mb.DKV_TILES


#: Set by tests to run the Mosaic GPU backward under its interpreter on CPU (the forward's
#: wrapper takes ``interpret=`` per call; the runtime never sets it).
MOSAIC_INTERPRET = None


def _mosaic_interpret():
    return MOSAIC_INTERPRET


#: The backward of each backend of ``dispatch.BACKENDS``.
BACKWARD: "types.MappingProxyType[str, Backward]" = types.MappingProxyType({b.name: b for b in (
    Backward("mosaic_gpu", _mosaic_dq, _mosaic_dkv, _mosaic_tiles, fold_vmap=True,
             paired_dkv_tiles=(64, 64, 8, 8),        # mosaic.backward.DKV_PAIRED_TILES
             row_dots=_triton_row_dots),
    Backward("triton", _triton_dq, _triton_dkv, _triton_tiles, row_dots=_triton_row_dots),
    Backward("xla", _xla_dq, _xla_dkv, lambda tq, tk, shape: (tk, tq, 1, 1), first_order=False),
)})


def _backend_of(template_name: str) -> str:
    return dispatch.get_template(template_name).backend


# --- first-order kernels ---------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _first_order(fn, backend, *args):
    return fn(*args)


def _first_order_fwd(fn, backend, *args):
    return fn(*args), None


def _first_order_bwd(fn, backend, res, g):
    raise NotImplementedError(
        f"tessera_jax: second-order gradients of sparse_attention (differentiating its "
        f"backward) are not implemented on backend {backend!r}: its backward kernels are "
        f"first-order. Pass backend='xla' (plain JAX, differentiable again) for higher-order "
        f"derivatives")


_first_order.defvjp(_first_order_fwd, _first_order_bwd)


def _kernels(impl: Backward, fn, *args):
    """fn(*args), behind a clear error if differentiated (GPU kernels: the forward inside the
    custom_vjp's fwd and the backward, which a second-order derivative differentiates)."""
    if impl.first_order:
        return _first_order(fn, impl.name, *args)
    return fn(*args)


# --- host plans ------------------------------------------------------------------------------
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


def dkv_tiles(backend: str, tile_q: int, tile_kv: int, shape: AttnShape):
    """(tile_q', tile_kv', q_align', kv_align') of the transposed plan on ``backend`` for a
    forward plan of tiles tile_q x tile_kv."""
    return tuple(int(x) for x in BACKWARD[backend].dkv_tiles(tile_q, tile_kv, shape))


def device_dkv_tiles(backend: str, tile_q: int, tile_kv: int, shape: AttnShape):
    """The dk/dv tiles of the device route: the backend's paired tiles when its forward
    template has 64-key tiles (the device route's choice for K/V blocks of <= 64 tokens: a
    128-key unit would compute the union of two blocks' queries), else ``dkv_tiles``'."""
    paired = BACKWARD[backend].paired_dkv_tiles
    if paired is not None and tile_kv <= paired[0]:
        return tuple(int(x) for x in paired)
    return dkv_tiles(backend, tile_q, tile_kv, shape)


# Per forward plan (weakly held, like the API's plan cache holds it): backend -> transposed plan.
_TRANSPOSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def clear_cache() -> None:
    """Forgets the transposed host plans (``tessera_jax.clear_caches``)."""
    _TRANSPOSED.clear()


#: Policies tried for the host dk/dv plan with the backend's dk/dv tiles; the plan of least
#: estimated time (``_dkv_score``) wins, paired units (``PAIRED_DKV_POLICY``) among them. On
#: the transposed Wan 480p masks (computed / selected on top-k cubes, sliding tiles,
#: clusters): 128 x 64 merge 2.61 / 2.26 / 2.06, pack 2.04 / 1.26 / 1.68; paired 64 x 64 pack
#: 1.23 / 1.04 / 1.46.
DKV_POLICIES: tuple[str, ...] = ("merge", "pack")
PAIRED_DKV_POLICY: str | None = "pack"


# dk/dv time per computed interaction at head_dim 128, fitted to the H200's times of 9 dk/dv
# plans (merge128, pack128, paired64 of three irregular masks; benchmarks/NOTES.md#backward):
# max error 18%, and it orders all three masks' plans as measured. The forward's cost model
# (K/V bytes, partial steps) mis-ordered clusters' (paired 5.30 vs pack 4.94 ms predicted;
# 9.67 vs 10.36 ms measured).
DKV_NS_PER_INTERACTION_D128 = 2.58e-3


def _dkv_score(tp: planner.Plan, per_sm: int) -> float:
    """Estimated ns of a dk/dv plan whose units run ``per_sm`` at a time on an SM: its computed
    work at the measured dk/dv rate, plus the per-step and per-unit fixed costs of the
    planner's cost model, which concurrent units overlap (they break ties)."""
    s, m = tp.stats(), tp.cost_model
    work = s["computed_interactions"] * tp.shape.head_dim / 128 * DKV_NS_PER_INTERACTION_D128
    return work + (s["tiles"] * m.step_ns + s["units"] * m.unit_ns) / per_sm / m.num_sms


def transposed_plan(plan: planner.Plan, backend: str | None = None) -> planner.Plan:
    """The host plan of the dk/dv pass of ``plan`` (a planner ``Plan`` of a static mask with
    shared bounds) on ``backend`` (None: the plan's template's): the transposed mask planned
    by the host planner (head-major units) with the backend's dk/dv tiles under each policy
    of ``DKV_POLICIES``, and its paired tiles under ``PAIRED_DKV_POLICY``: the plan of least
    estimated time (``_dkv_score``). Cached per forward plan and backend."""
    backend = backend or _backend_of(plan.template)
    try:
        per = _TRANSPOSED.setdefault(plan, {})
    except TypeError:
        per = {}
    hit = per.get(backend)
    if hit is not None:
        return hit
    if plan.mask is None:
        raise ValueError("transposed_plan needs a plan that holds its mask (planner.Plan.mask)")
    shape = transposed_shape(plan.shape)
    tq, tk, qa, ka = dkv_tiles(backend, plan.tile_q, plan.tile_kv, plan.shape)
    tmask = transposed_mask(plan.mask)
    # (tiles, policy, units an SM runs at once): a paired CTA runs two 64-key units together.
    opts = [((tq, tk, qa, ka), pol, 1) for pol in DKV_POLICIES]
    paired = BACKWARD[backend].paired_dkv_tiles
    if paired is not None and PAIRED_DKV_POLICY is not None:
        opts.append((paired, PAIRED_DKV_POLICY, 2))
    opts = opts or [((tq, tk, qa, ka), "merge", 1)]        # nothing asked for: merge
    cands = [(planner.build_unchecked(tmask, shape, tile_q=t[0], tile_kv=t[1], policy=pol,
                                      q_align=t[2], kv_align=t[3],
                                      template=f"bwd_dkv_{backend}_{t[0]}x{t[1]}",
                                      unit_order="head_major"), per_sm)
             for t, pol, per_sm in opts]
    tp = min(cands, key=lambda c: _dkv_score(*c))[0]                   # first on ties
    per[backend] = tp
    return tp


def run(plan, q, k, v, scale: float, return_lse: bool):
    """``dispatch.run`` of a host plan, differentiable: out (and lse) with the backward above.
    An eager call (no trace, so nothing differentiates it) skips the custom_vjp's binding
    (~0.5 ms a call on the CPU box: a request's latency)."""
    if not tracing(q, k, v):
        return dispatch.run(plan, q, k, v, scale, return_lse)
    return _host(plan, float(scale), bool(return_lse), q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _host(plan, scale, return_lse, q, k, v):
    return dispatch.run(plan, q, k, v, scale, return_lse)


def _host_fwd(plan, scale, return_lse, q, k, v):
    impl = BACKWARD[_backend_of(plan.template)]
    out, lse = _kernels(impl, lambda q, k, v: dispatch.run(plan, q, k, v, scale, True), q, k, v)
    return ((out, lse) if return_lse else out), (q, k, v, out, lse)


def _host_bwd(plan, scale, return_lse, res, g):
    q, k, v, out, lse = res
    do, dlse = g if return_lse else (g, None)
    be = _backend_of(plan.template)
    tp = transposed_plan(plan, be)
    return _backward(BACKWARD[be], plan, plan.template, tp, q, k, v, out, lse, do, dlse, scale)


_host.defvjp(_host_fwd, _host_bwd)


def _row_dots(impl: Backward):
    """The backend's row-dot kernel as ``delta_of`` takes it (first-order, vmap folded like
    its other kernels), or None."""
    dots = impl.row_dots
    if dots is None:
        return None
    fn = (lambda o, g: batching.fold_vmap(dots, (o, g))) if impl.fold_vmap else dots
    return lambda o, g: _kernels(impl, fn, o, g)


def _backward(impl: Backward, plan, template, tp, q, k, v, out, lse, do, dlse, scale):
    """(dq, dk, dv) from the forward plan and the transposed plan on ``impl``'s kernels."""
    do = do.astype(q.dtype)
    delta = rows_.delta_of(out, do, dlse, _row_dots(impl))
    lse_b = rows_.lse_for_backward(lse)

    # A device plan's (traced) arrays travel as operands, so that vmap sees them.
    pa, ta = batching.plan_arrays(plan), batching.plan_arrays(tp)

    def grads(q, k, v, do, lse_b, delta, *arrays):
        p = batching.with_arrays(plan, arrays[:len(pa)])
        t = batching.with_arrays(tp, arrays[len(pa):])
        dq = impl.dq(p, template, q, k, v, do, lse_b, delta, scale)
        dk, dv = impl.dkv(t, q, k, v, do, lse_b, delta, scale)
        return dq, dk, dv

    fn = grads
    if impl.fold_vmap:
        fn = lambda *a: batching.fold_vmap(grads, a[:6], a[6:])          # noqa: E731
    return _kernels(impl, fn, q, k, v, do, lse_b, delta, *pa, *ta)


# --- device masks ----------------------------------------------------------------------------
def device_run(q, k, v, qb, kb, blocks, *, consts, template, capacity, decide, scale,
               return_lse):
    """``device_route._run``, differentiable (arguments as there); eagerly ``_run`` itself."""
    spec = (consts, template, capacity, decide, float(scale), bool(return_lse))
    if not tracing(q, k, v, qb, kb, blocks):
        return _fwd_run(spec, q, k, v, qb, kb, blocks, spec[5])
    return _device_vjp(spec, q, k, v, qb, kb, blocks)


def _fwd_run(spec, q, k, v, qb, kb, blocks, return_lse):
    consts, template, capacity, decide, scale, _ = spec
    return device_route._run(q, k, v, qb, kb, blocks, consts=consts, template=template,
                             capacity=capacity, decide=decide, scale=scale,
                             return_lse=return_lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _device_vjp(spec, q, k, v, qb, kb, blocks):
    return _fwd_run(spec, q, k, v, qb, kb, blocks, spec[5])


def _device_fwd(spec, q, k, v, qb, kb, blocks):
    template = spec[1]
    if template is not None and BACKWARD[_backend_of(template)].first_order:
        out, lse = _first_order(lambda q, k, v: _fwd_run(spec, q, k, v, qb, kb, blocks, True),
                                _backend_of(template), q, k, v)
    else:
        out, lse = _fwd_run(spec, q, k, v, qb, kb, blocks, True)
    return ((out, lse) if spec[5] else out), (q, k, v, qb, kb, blocks, out, lse)


def _device_bwd(spec, res, g):
    q, k, v, qb, kb, blocks, out, lse = res
    do, dlse = g if spec[5] else (g, None)
    dq, dk, dv = _device_grads(q, k, v, qb, kb, blocks, out, lse, do, dlse, spec=spec)
    return dq, dk, dv, None, None, None


_device_vjp.defvjp(_device_fwd, _device_bwd)


@functools.partial(jax.jit, static_argnames=("spec",))
def _device_grads(q, k, v, qb, kb, blocks, out, lse, do, dlse, *, spec):
    consts, template, capacity, decide, scale, _ = spec
    qb, kb, blocks = (c.array if c is not None else x for c, x in zip(consts, (qb, kb, blocks)))
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    do = do.astype(q.dtype)

    def exact():
        return exact_backward(q, k, v, qb, kb, blocks, out, lse, do, dlse, scale=scale)

    if template is None:
        return exact()
    t = dispatch.get_template(template)
    impl = BACKWARD[t.backend]
    shape = AttnShape(B, Lq, Lkv, Hq, Hkv, D, np.dtype(q.dtype))
    tq, tk, _, _ = device_dkv_tiles(t.backend, t.tile_q, t.tile_kv, shape)
    Hm, nq, nk = blocks.shape
    # The transposed plan's bitmap capacity, as the forward's (None: past the budget).
    cap_t = device_route._capacity(consts[1], consts[0], (Hm, nk, nq), transposed_shape(shape),
                                   types.SimpleNamespace(tile_q=tq, tile_kv=tk))
    if cap_t is None:
        return exact()
    p = _device.plan_on_device(blocks, qb, kb, num_q_heads=Hq, q_len=Lq, kv_len=Lkv,
                               tile_q=t.tile_q, tile_kv=t.tile_kv, bitmap_capacity=capacity)
    pt = _device.plan_on_device(jnp.swapaxes(jnp.asarray(blocks), 1, 2), kb, qb, num_q_heads=Hq,
                                q_len=Lkv, kv_len=Lq, tile_q=tq, tile_kv=tk,
                                bitmap_capacity=cap_t)

    def kernels():
        return _backward(impl, p, t.name, pt, q, k, v, out, lse, do, dlse, scale)

    return jax.lax.cond(p.ok & pt.ok, kernels, exact) if decide else kernels()


def exact_backward(q, k, v, q_bounds, kv_bounds, blocks, out, lse, do, dlse=None, *, scale):
    """(dq, dk, dv) of ``device_route.exact_attention``: the mask evaluated per token, float32,
    over query chunks (dense work, O(chunk x Lkv) memory, dk / dv accumulated in the loop).
    Bounds [n + 1] or [Hm, n + 1], blocks [Hm, nq, nk] (NumPy or jax)."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    Hm, nq, nk = blocks.shape
    f32 = jnp.float32
    qb = jnp.asarray(q_bounds, jnp.int32).reshape(-1, nq + 1)
    kb = jnp.asarray(kv_bounds, jnp.int32).reshape(-1, nk + 1)
    blocks = jnp.asarray(blocks)
    kid = device_route._block_ids(kb, jnp.arange(Lkv, dtype=jnp.int32))      # [Hbk, Lkv]
    delta = rows_.delta_of(out, do, dlse)
    lse = rows_.lse_for_backward(lse)
    C = int(max(8, min(Lq, device_route._EXACT_CHUNK_ELEMS // max(1, B * Hq * Lkv))))
    n = -(-Lq // C)
    qx = rows_.pad_len(q.astype(f32), n * C).reshape(B, n, C, Hq, D).swapaxes(0, 1)
    dox = rows_.pad_len(do.astype(f32), n * C).reshape(B, n, C, Hq, D).swapaxes(0, 1)
    lx = rows_.pad_rows(lse, n * C, jnp.inf).reshape(B, Hq, n, C).transpose(2, 0, 1, 3)
    dx = rows_.pad_rows(delta, n * C, 0.0).reshape(B, Hq, n, C).transpose(2, 0, 1, 3)
    kf = jnp.repeat(k.astype(f32), Hq // Hkv, axis=2)
    vf = jnp.repeat(v.astype(f32), Hq // Hkv, axis=2)
    heads = jnp.arange(Hm)[:, None, None]
    hi = jax.lax.Precision.HIGHEST

    def body(carry, xs):
        dk, dv = carry
        i, qc, doc, lc, dc = xs
        qid = device_route._block_ids(qb, i * C + jnp.arange(C, dtype=jnp.int32))
        sel = jnp.broadcast_to(blocks[heads, qid[:, :, None], kid[:, None, :]], (Hq, C, Lkv))
        s = jnp.einsum("bqhd,bkhd->bhqk", qc, kf, precision=hi) * scale
        p = jnp.where(sel[None], jnp.exp(s - lc[..., None]), 0.0)
        dp = jnp.einsum("bqhd,bkhd->bhqk", doc, vf, precision=hi)
        ds = p * (dp - dc[..., None])
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kf, precision=hi) * scale
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, qc, precision=hi) * scale
        dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, doc, precision=hi)
        return (dk, dv), dq

    zeros = jnp.zeros((B, Lkv, Hq, D), f32)
    (dk, dv), dq = jax.lax.scan(body, (zeros, zeros),
                                (jnp.arange(n, dtype=jnp.int32), qx, dox, lx, dx))
    dq = dq.swapaxes(0, 1).reshape(B, n * C, Hq, D)[:, :Lq]
    dk, dv = rows_.group_sum(dk, Hkv), rows_.group_sum(dv, Hkv)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
