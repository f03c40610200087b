"""One plan, one Pallas kernel call: how a host plan reaches a GPU kernel module.

``dispatch`` (the static table of backends) calls ``run(kernel, plan, template, q, k, v,
scale, return_lse)`` with the kernel module its entry imports: ``pallas_kernels.mosaic.wrapper``
or ``pallas_kernels.triton.wrapper``. A kernel module provides ``attention(q, k, v, units,
steps, row_index, *, template, q_len_padded, kv_len_padded, scale, return_lse,
check_plan=True, mask_mode=None)`` (row_index may be None: made on the device;
``check_plan=False``: the plan is the planner's, no host checks) and
``mask_mode_for(template, all_full)``.

Kept apart from ``dispatch``, which decides *which* backend and template run: this module is
*how* a plan's arrays reach the kernel (trusted plans, device copies, traces), tuned on the
H200 (the comments give the measurements), and its tests patch its constants.
"""

from __future__ import annotations

import weakref

import jax
import numpy as np

from tessera_jax.planning.planner import Plan


def tracing(*xs) -> bool:
    """Whether this call is being traced: a traced operand, or concrete ones inside a trace
    (q closed over by a jit, grad over k/v only). Device arrays made now would be tracers, and a
    cached one would leak into later eager calls."""
    from jax._src import core as _core      # trace_state_clean has no public name in jax 0.11
    return any(isinstance(x, jax.core.Tracer) for x in xs) or not _core.trace_state_clean()


# Per plan (weakly held, so a plan dropped from the API's cache frees its entry) and kernel
# module: [device arrays or None, extra keyword arguments (the mask mode), 1 once a call took
# the NumPy arrays]. A planner-built ``Plan`` is trusted: its fullness comes from
# ``Plan.all_full`` and the kernel module never walks its steps (that costs milliseconds per
# call on big per-head plans). A small plan's first eager call hands its NumPy arrays to the
# jitted call (copied for that call only: a one-shot request skips device_put's fixed cost), and
# the second keeps device copies made by ``_put_plan``; a large plan is put there on its first
# call. Under a trace the plan always goes in as
# NumPy arrays: constants of the caller's program, as jax expects; device arrays made or cached
# around a trace would leak into it (an AOT-compiled denoising loop on the H200 failed with
# "compiled for 858 inputs but called with 827"; tests/test_models.py reproduces it).
# Eagerly, row_index is not copied: the kernel module computes it on the device from units
# (a request on a new mask then copies units + steps only; row_index is Hq * Lq * 4 bytes).
_PREPARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def clear_cache() -> None:
    """Forgets the prepared plans (mask modes, device copies); ``tessera_jax.clear_caches``."""
    _PREPARED.clear()


# A large ``steps`` goes to the device in pieces, one transfer each, joined there: jax copies
# the arrays of one device_put in parallel, and a single copy from pageable memory ran at ~3 GB/s
# on the H200 host (64 MB: 19.5 ms as one array, 11.2 ms as two; request_breakdown's probe).
_PUT_PIECE_BYTES = 4 << 20
_PUT_MAX_PIECES = 8
# Up to this many plan bytes, a plan's first eager call passes its NumPy arrays straight into
# the jitted kernel call: jax's C++ dispatch copies them for less than a separate device_put
# (CPU box: 12 us against 74 + 6 us; on the H200 host a device_put cost ~0.45 ms at any size).
_DIRECT_MAX_BYTES = 2 * _PUT_PIECE_BYTES


def _put_plan(units: np.ndarray, steps: np.ndarray) -> tuple:
    """(units, steps) on the default device; steps over 2 * _PUT_PIECE_BYTES in row pieces."""
    k = min(_PUT_MAX_PIECES, steps.nbytes // _PUT_PIECE_BYTES)
    if k < 2:
        return tuple(jax.device_put((units, steps)))
    cuts = np.linspace(0, steps.shape[0], k + 1).astype(np.int64)
    dev = jax.device_put((units,) + tuple(steps[a:b] for a, b in zip(cuts[:-1], cuts[1:])))
    return dev[0], _join(*dev[1:])


@jax.jit
def _join(*pieces):
    import jax.numpy as jnp
    return jnp.concatenate(pieces, axis=0)


def run(kernel, plan, template, q, k, v, scale, return_lse):
    """out (and lse with ``return_lse``) of ``plan`` run by the kernel module ``kernel`` with
    ``template`` (a ``pallas_kernels.templates.Template``)."""
    kw = dict(template=template, q_len_padded=plan.q_len_padded,
              kv_len_padded=plan.kv_len_padded, scale=scale, return_lse=return_lse)
    # Plan.row_index is made on first use: an eager trusted call never touches it.
    arrays = (plan.units, plan.steps)
    if not all(isinstance(a, np.ndarray) for a in arrays):
        # Plan arrays as operands of a jitted caller (the profiler): nothing to check or
        # keep on the host; the template's own mask mode applies.
        return kernel.attention(q, k, v, *arrays, plan.row_index, **kw)
    try:
        per_plan = _PREPARED.setdefault(plan, {})
    except TypeError:           # a plan-like object that can't be weakly referenced
        per_plan = {}
    trusted = isinstance(plan, Plan)       # built by the planner for this template
    key = (kernel.__name__, template.name)
    entry = per_plan.get(key)
    if entry is None:
        # The mask mode (Mosaic GPU: no masking code at all for a plan whose steps are all
        # full); an untrusted plan is walked (and checked) once, here.
        mode = (kernel.mask_mode_for(template, plan.all_full) if trusted else
                kernel.plan_mask_mode(plan.units, plan.steps, template, plan.q_len_padded,
                                      plan.kv_len_padded))
        entry = per_plan[key] = [None, {"mask_mode": mode}, 0]
    on_device, extra, _ = entry
    if tracing(q, k, v):           # the plan, row_index too, become constants
        return kernel.attention(q, k, v, *arrays, plan.row_index, **kw, **extra)
    if on_device is None:
        if not trusted:     # the kernel module checks the NumPy plan once
            arrays += (plan.row_index,)
            out = kernel.attention(q, k, v, *arrays, **kw, **extra)
            entry[0] = tuple(jax.device_put(arrays))
            return out
        if not entry[2] and sum(a.nbytes for a in arrays) <= _DIRECT_MAX_BYTES:
            # The first call of a small plan (a request on a new mask) hands the NumPy
            # arrays to the jitted call; later calls use device copies made once.
            entry[2] = 1
            return kernel.attention(q, k, v, *arrays, None, check_plan=False, **kw, **extra)
        on_device = entry[0] = _put_plan(*arrays) + (None,)
    return kernel.attention(q, k, v, *on_device, **kw, **extra)
