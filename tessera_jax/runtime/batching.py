"""``jax.vmap`` of a kernel call: the vmapped axis folded into the batch dimension.

A Mosaic GPU kernel (``plgpu.kernel``, the ``mpmd_map`` primitive) has no batching rule we
can rely on for TMA and barriers, so its calls go through ``fold_vmap``: under ``jax.vmap`` the
tensors' vmapped axis joins their batch dimension (axis 0 of every tensor, input and output:
q, k, v, dout [B, L, H, D], lse, delta [B, H, L]) and the kernel runs once; a plan that is
itself vmapped (a device mask per vmapped element) runs one call per element (``lax.map``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["fold_vmap", "plan_arrays", "with_arrays"]


def plan_arrays(plan) -> tuple:
    """A pass plan's jax arrays (units, steps) that must travel as operands: a device plan's
    (traced) arrays; a host plan's NumPy arrays are constants (empty tuple)."""
    arrays = (plan.units, plan.steps)
    return arrays if all(isinstance(a, jax.Array) for a in arrays) else ()


def with_arrays(plan, arrays: tuple):
    """The pass plan ``plan`` with its units and steps replaced by ``arrays`` (when given)."""
    if not arrays:
        return plan
    return dataclasses.replace(plan, units=arrays[0], steps=arrays[1])


def fold_vmap(fn, tensors: tuple, extras: tuple = ()):
    """fn(*tensors, *extras), whose outputs (a pytree of arrays) have the batch dimension
    first like the tensors. Under ``jax.vmap``: batched tensors fold the vmapped axis into the
    batch (unbatched ones are broadcast), one call; batched ``extras`` (plan arrays): one call
    per vmapped element."""
    n = len(tensors)

    @jax.custom_batching.custom_vmap
    def call(*args):
        return fn(*args)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        def full(a, b):
            return a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)

        if any(in_batched[n:]):
            out = jax.lax.map(lambda xs: fn(*xs),
                              tuple(full(a, b) for a, b in zip(args, in_batched)))
        else:
            ts = [full(a, b) for a, b in zip(args[:n], in_batched[:n])]
            out = fn(*(t.reshape((-1,) + t.shape[2:]) for t in ts), *args[n:])
            out = jax.tree.map(lambda o: o.reshape((axis_size, -1) + o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return call(*tensors, *extras)
