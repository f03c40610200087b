"""The core of every route: ``attention(q, k, v, plan, scale, return_lse, options)`` over an
``AttentionPlan``, differentiable in reverse mode under the tree's one ``jax.custom_vjp``.

Forward: the forward pass plan on its backend (``dispatch.forward``); a device plan whose fit
is decided on the device runs ``lax.cond(ok, kernels, exact)`` (one conditional under
``jax.vmap`` too: ``batched_cond.batch_all``), one with no template the
exact path (``exact``). The residuals are q, k, v, out and lse (O(L): never a score matrix)
and the plan's traced arrays. Backward, on the backend's contract module:

* delta = rowsum(out * dout) - dlse (the cotangent of lse when it is returned), and lse with
  +inf on rows that select nothing (``pallas_kernels.backward_rows``);
* dq: one pass over the forward pass plan (each unit's query tile against its K/V steps);
* dk, dv: one pass over the dk/dv pass plan, the plan of the transposed mask (host: made by
  ``host_plans`` on first use; device: made with the forward's by ``device_route``): its units
  are key tiles of one query head, its steps query tiles; dk, dv per query head are summed
  over each K/V head's group (GQA).

Device plans run ``lax.cond(ok & dkv_ok, kernels, exact_backward)``; a plan with a next plan
(``AttentionPlan.refine``: after a first, smaller bitmap room the whole room, after that the
gathering template's unless ``Options(device_overflow="exact")``) falls back to it first, in
both passes. A plan's jax leaves
travel as operands of the custom_vjp (so vmap and the backward see them); its NumPy leaves
stay constants. An eager call (no trace, so nothing differentiates it) skips the custom_vjp's
binding (~0.5 ms a call on the CPU box: a request's latency). GPU backward kernels are
first-order: differentiating the backward again raises a ``NotImplementedError`` that says
so (``_first_order``; the XLA backend is plain jnp and differentiates again). Forward-mode
(``jax.jvp``) is not defined for a ``custom_vjp``; jax says so.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import numpy as np

from pallas_kernels import backward_rows as rows_

from tessera_jax.batched_cond import batch_all
from tessera_jax.planning.plan import AttentionPlan
from tessera_jax.runtime import batching, dispatch
from tessera_jax.runtime.exact import exact_attention, exact_backward
from tessera_jax.runtime.kernel_runner import tracing
from tessera_jax.runtime.options import DEFAULT, Options

__all__ = ["attention"]


def attention(q, k, v, plan: AttentionPlan, scale: float, return_lse: bool,
              options: Options = DEFAULT):
    """out [B, Lq, Hq, D] (and lse [B, Hq, Lq] with ``return_lse``) of ``plan``,
    differentiable (arguments validated by the caller)."""
    static, arrays = _split(plan)
    if not tracing(q, k, v, *arrays):
        return _forward(plan, q, k, v, scale, return_lse, options, rows=False)
    return _core(static, float(scale), bool(return_lse), options, q, k, v, *arrays)


class _Static:
    """A plan with jax leaves taken out: its treedef and its NumPy leaves (None where a jax
    leaf was)."""

    __slots__ = ("treedef", "leaves")

    def __init__(self, treedef, leaves):
        self.treedef, self.leaves = treedef, leaves


def _split(plan: AttentionPlan):
    """(static part, jax leaves). A plan without jax leaves (a host plan) is its own static
    part: its identity keys the kernel runner's caches."""
    if plan.source is not None:          # a host plan: NumPy leaves only
        return plan, ()
    leaves, treedef = jax.tree_util.tree_flatten(plan)
    arrays = tuple(x for x in leaves if not isinstance(x, np.ndarray))
    if not arrays:
        return plan, ()
    return _Static(treedef, tuple(x if isinstance(x, np.ndarray) else None for x in leaves)), \
        arrays


def _join(static, arrays) -> AttentionPlan:
    if not isinstance(static, _Static):
        return static
    it = iter(arrays)
    return static.treedef.unflatten([next(it) if x is None else x for x in static.leaves])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _core(static, scale, return_lse, options, q, k, v, *arrays):
    return _forward(_join(static, arrays), q, k, v, scale, return_lse, options, rows=True)


def _core_fwd(static, scale, return_lse, options, q, k, v, *arrays):
    plan = _join(static, arrays)

    def fwd(q, k, v, *arrays):
        return _forward(_join(static, arrays), q, k, v, scale, True, options, rows=True)

    out, lse = _kernels(plan, fwd, q, k, v, *arrays)
    return ((out, lse) if return_lse else out), (q, k, v, out, lse, arrays)


def _core_bwd(static, scale, return_lse, options, res, g):
    q, k, v, out, lse, arrays = res
    do, dlse = g if return_lse else (g, None)
    dq, dk, dv = _backward(_join(static, arrays), q, k, v, out, lse, do, dlse, scale, options)
    return (dq, dk, dv) + (None,) * len(arrays)


_core.defvjp(_core_fwd, _core_bwd)


# Pass plans with ``rows_owned`` cleared (``Options.store_in_place`` False), one per plan, so
# that caches keyed on a host pass plan (the kernel runner's device copies) keep working.
_GATHERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _stores(p, options: Options):
    """Pass plan ``p`` as the kernels get it: without ``rows_owned`` when the caller turned
    in-place stores off (kernels then write unit-major tiles, gathered after)."""
    if p is None or options.store_in_place or not p.rows_owned:
        return p
    if isinstance(p.units, np.ndarray):
        hit = _GATHERED.get(p)
        if hit is None:
            hit = _GATHERED[p] = dataclasses.replace(p, rows_owned=False)
        return hit
    return dataclasses.replace(p, rows_owned=False)


def _forward(plan: AttentionPlan, q, k, v, scale, return_lse, options: Options, *, rows):
    """The forward of ``plan``; ``rows``: a host plan's row maps go in as constants."""
    fwd = _stores(plan.fwd_pass(rows), options)

    def exact():
        return exact_attention(q, k, v, *plan.exact, scale=scale, return_lse=return_lse)

    if fwd is None:
        return exact()
    t = dispatch.get_template(plan.template)

    def kernels():
        return dispatch.forward(fwd, t, q, k, v, scale, return_lse, interpret=options.interpret)

    if plan.ok is None:
        return kernels()
    # batch_all: under jax.vmap over device masks one conditional for the batch.
    if plan.refine is None:
        return _cond(batch_all(plan.ok), kernels, exact)
    # A plan that overflowed its bitmap room: the next plan (``AttentionPlan.refine``), then
    # exact.
    return _cond(batch_all(plan.ok), kernels, lambda: _forward(
        plan.refine(*plan.exact), q, k, v, scale, return_lse, options, rows=rows))


def _cond(pred, kernels, fallback):
    """``lax.cond(pred, kernels, fallback)`` with every result flattened to 1-D inside the
    branches: XLA gives a conditional's results one layout for both branches and took the
    exact path's (head-major), so the kernels' output was written transposed and copied back
    after the conditional (100 MB at Wan 480p; dq, dk and dv likewise). Flat results have one
    layout; a branch whose result is laid out otherwise pays its own copy."""
    shapes = []

    def flat(f):
        def branch():
            leaves, tree = jax.tree_util.tree_flatten(f())
            shapes[:] = [tree, [x.shape for x in leaves]]
            return [x.reshape(-1) for x in leaves]
        return branch

    out = jax.lax.cond(pred, flat(kernels), flat(fallback))
    tree, shp = shapes
    return jax.tree_util.tree_unflatten(tree, [x.reshape(s) for x, s in zip(out, shp)])


def _backward(plan: AttentionPlan, q, k, v, out, lse, do, dlse, scale, options: Options):
    """(dq, dk, dv) of ``plan``: the kernels over its forward and dk/dv pass plans, or the exact
    path's."""
    do = do.astype(q.dtype)

    def exact():
        return exact_backward(q, k, v, *plan.exact, out, lse, do, dlse, scale=scale)

    if plan.template is None:
        return exact()
    be = dispatch.BACKENDS[plan.backend]
    fwd, dkv = (_stores(p, options) for p in (plan.fwd_pass(be.backward_rows),
                                              plan.dkv_pass(be.backward_rows)))
    if dkv is None:                       # a device mask's transposed plan past the budget
        return exact()

    def kernels():
        return _grads(plan, fwd, dkv, q, k, v, out, lse, do, dlse, scale, options)

    oks = [x for x in (plan.ok, plan.dkv_ok) if x is not None]
    if not oks:
        return kernels()
    fallback = exact if plan.refine is None else lambda: _backward(
        plan.refine(*plan.exact), q, k, v, out, lse, do, dlse, scale, options)
    return _cond(batch_all(functools.reduce(jax.numpy.logical_and, oks)), kernels, fallback)


def _grads(plan: AttentionPlan, fwd, dkv, q, k, v, out, lse, do, dlse, scale, options):
    """(dq, dk, dv) from the forward and dk/dv pass plans on the backend's kernels."""
    ops = dispatch.BACKENDS[plan.backend].ops()
    t = dispatch.get_template(plan.template)
    delta = rows_.delta_of(out, do, dlse, _row_dots(plan, ops, options))
    lse_b = rows_.lse_for_backward(lse)
    kw = dict(template=t, scale=scale, interpret=options.interpret)
    # A device plan's (traced) arrays travel as operands, so that vmap sees them.
    pa, ta = batching.plan_arrays(fwd), batching.plan_arrays(dkv)

    def grads(q, k, v, do, lse_b, delta, *arrays):
        p = batching.with_arrays(fwd, arrays[:len(pa)])
        tp = batching.with_arrays(dkv, arrays[len(pa):])
        dq = ops.dq(q, k, v, do, lse_b, delta, p, **kw)
        dk, dv = ops.dkv(q, k, v, do, lse_b, delta, tp, **kw)
        return dq, dk, dv

    fn = grads
    if ops.FOLD_VMAP:
        fn = lambda *a: batching.fold_vmap(grads, a[:6], a[6:])          # noqa: E731
    return _kernels(plan, fn, q, k, v, do, lse_b, delta, *pa, *ta)


def _row_dots(plan: AttentionPlan, ops, options: Options):
    """The backend's row-dot kernel as ``delta_of`` takes it (first-order, vmap folded like
    its other kernels), or None (jnp)."""
    if ops.row_dots is None:
        return None
    dots = functools.partial(ops.row_dots, interpret=options.interpret)
    fn = (lambda o, g: batching.fold_vmap(dots, (o, g))) if ops.FOLD_VMAP else dots
    return lambda o, g: _kernels(plan, fn, o, g)


# --- first-order kernels ---------------------------------------------------------------------
def _kernels(plan: AttentionPlan, fn, *args):
    """fn(*args), behind a clear error if differentiated when the plan's backend has
    first-order kernels (GPU kernels: the forward inside the custom_vjp's fwd and the backward,
    which a second-order derivative differentiates)."""
    if plan.template is not None and dispatch.BACKENDS[plan.backend].ops().FIRST_ORDER:
        return _first_order(fn, plan.backend, *args)
    return fn(*args)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _first_order(fn, backend, *args):
    return fn(*args)


@_first_order.defjvp
def _first_order_jvp(fn, backend, primals, tangents):
    raise NotImplementedError(
        f"tessera_jax: second-order gradients of sparse_attention (differentiating its "
        f"backward) are not implemented on backend {backend!r}: its backward kernels are "
        f"first-order. Pass backend='xla' (plain JAX, differentiable again) for higher-order "
        f"derivatives")
