"""``batch_all``: a predicate that stays one value for the batch under ``jax.vmap``.

jax turns a ``lax.cond`` whose predicate is batched into a select that runs every branch: for
a device plan's ``lax.cond(ok, kernels, exact)`` the kernels and the dense exact path on every
call, for the device planner's bitmap fills both fills. ``lax.cond(batch_all(ok), ...)`` stays
one conditional: the first branch for the whole batch where every element holds, else the
second for the whole batch (which must then be right for every element: a plan's fallback).
Only the predicate goes through ``custom_vmap``, so the branches keep differentiating.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["batch_all"]


@jax.custom_batching.custom_vmap
def batch_all(pred):
    """``pred`` (a bool scalar); under ``jax.vmap`` with ``pred`` batched, whether it holds for
    every element, unbatched."""
    return pred


@batch_all.def_vmap
def _rule(axis_size, in_batched, pred):
    return (jnp.all(pred) if in_batched[0] else pred), False
