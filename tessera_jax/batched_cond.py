"""``cond_all``: a ``lax.cond`` that stays one conditional under ``jax.vmap``.

jax turns a cond with a batched predicate into a select that runs every branch: for a device
plan's ``lax.cond(ok, kernels, exact)`` the dense exact path on every call, for the device
planner's bitmap fills both fills. Used by the runtime's core and the device planner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["cond_all"]


def cond_all(pred, true_fn, false_fn, *operands):
    """``lax.cond(pred, true_fn, false_fn, *operands)`` that stays one conditional under
    ``jax.vmap``: a batched ``pred`` takes ``true_fn`` for the whole batch where every element
    holds, else ``false_fn`` for the whole batch (so ``false_fn`` must be right wherever
    ``true_fn`` is: a device plan's fallback, exact for every mask). The branches see
    ``operands`` only (nothing batched may be closed over)."""

    @jax.custom_batching.custom_vmap
    def cond(pred, *ops):
        return jax.lax.cond(pred, true_fn, false_fn, *ops)

    @cond.def_vmap
    def rule(axis_size, in_batched, pred, *ops):
        axes = tuple(0 if b else None for b in in_batched[1:])
        p = jnp.all(pred) if in_batched[0] else pred
        out = jax.lax.cond(p, jax.vmap(true_fn, in_axes=axes, axis_size=axis_size),
                           jax.vmap(false_fn, in_axes=axes, axis_size=axis_size), *ops)
        return out, jax.tree.map(lambda _: True, out)

    return cond(pred, *operands)
