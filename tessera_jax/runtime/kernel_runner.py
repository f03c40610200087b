"""How a host pass plan reaches a GPU kernel: trusted plans, device copies, traces.

``dispatch.forward`` calls ``run(ops, plan, q, k, v, template=..., scale=..., return_lse=...,
interpret=...)`` with the backend's contract module (``pallas_kernels.mosaic.ops`` or
``pallas_kernels.triton.ops``) and an ``abi.PassPlan``. Kept apart from ``dispatch``, which
decides *which* backend and template run: this module is *how* a plan's arrays reach the
kernel, tuned on the H200 (the comments give the measurements).
"""

from __future__ import annotations

import dataclasses
import weakref

import jax
import numpy as np

from pallas_kernels import abi


def tracing(*xs) -> bool:
    """Whether this call is being traced: a traced operand, or concrete ones inside a trace
    (q closed over by a jit, grad over k/v only). Device arrays made now would be tracers, and a
    cached one would leak into later eager calls."""
    from jax._src import core as _core      # trace_state_clean has no public name in jax 0.11
    return any(isinstance(x, jax.core.Tracer) for x in xs) or not _core.trace_state_clean()


# Per host pass plan (weakly held, so a plan dropped from the API's cache frees its entry):
# [the plan with device copies or None, 1 once a call took the NumPy arrays]. A pass plan with
# ``all_full`` set is trusted (made by a planner for its template): the kernel module takes its
# mask mode from it and never walks its steps (that costs milliseconds per call on big
# per-head plans). A small plan's first eager call hands its NumPy arrays to the jitted call
# (copied for that call only: a one-shot request skips device_put's fixed cost), and the second
# keeps device copies made by ``put_plan``; a large plan is put there on its first call. Under
# a trace the plan always goes in as NumPy arrays: constants of the caller's program, as jax
# expects; device arrays made or cached around a trace would leak into it (an AOT-compiled
# denoising loop on the H200 failed with "compiled for 858 inputs but called with 827";
# tests/test_models.py reproduces it). Eagerly, row_index is not copied: the kernel module
# computes it on the device from units (a request on a new mask then copies units + steps
# only; row_index is Hq * Lq * 4 bytes).
_PREPARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def clear_cache() -> None:
    """Forgets the prepared plans (device copies); ``tessera_jax.clear_caches``."""
    _PREPARED.clear()


@dataclasses.dataclass(frozen=True)
class Transfers:
    """How host plans are copied to the device (tuning only: no result depends on it).

    piece_bytes / max_pieces: a large ``steps`` goes to the device in pieces, one transfer
        each, joined there: jax copies the arrays of one device_put in parallel, and a single
        copy from pageable memory ran at ~3 GB/s on the H200 host (64 MB: 19.5 ms as one
        array, 11.2 ms as two; request_breakdown's probe).
    direct_max_bytes: up to this many plan bytes, a plan's first eager call passes its NumPy
        arrays straight into the jitted kernel call: jax's C++ dispatch copies them for less
        than a separate device_put (CPU box: 12 us against 74 + 6 us; on the H200 host a
        device_put cost ~0.45 ms at any size).
    """

    piece_bytes: int = 4 << 20
    max_pieces: int = 8
    direct_max_bytes: int = 8 << 20


TRANSFERS = Transfers()


def put_plan(units: np.ndarray, steps: np.ndarray, transfers: Transfers = TRANSFERS) -> tuple:
    """(units, steps) on the default device; steps over 2 pieces' bytes in row pieces."""
    k = min(transfers.max_pieces, steps.nbytes // transfers.piece_bytes)
    if k < 2:
        return tuple(jax.device_put((units, steps)))
    cuts = np.linspace(0, steps.shape[0], k + 1).astype(np.int64)
    dev = jax.device_put((units,) + tuple(steps[a:b] for a, b in zip(cuts[:-1], cuts[1:])))
    return dev[0], _join(*dev[1:])


@jax.jit
def _join(*pieces):
    import jax.numpy as jnp
    return jnp.concatenate(pieces, axis=0)


def run(ops, plan: abi.PassPlan, q, k, v, *, template, scale, return_lse, interpret=None,
        transfers: Transfers = TRANSFERS):
    """out (and lse with ``return_lse``) of the forward pass plan ``plan`` run by the contract
    module ``ops`` with ``template`` (a ``pallas_kernels.templates.Template``)."""
    def call(p, check_plan=True):
        return ops.forward(q, k, v, p, template=template, scale=scale, return_lse=return_lse,
                           interpret=interpret, check_plan=check_plan)

    host = isinstance(plan.units, np.ndarray) and isinstance(plan.steps, np.ndarray)
    if not host or plan.all_full is None:
        # Plan arrays as operands of a jitted caller (a device plan, the profiler): nothing to
        # keep on the host. An untrusted NumPy plan: the kernel module checks it.
        return call(plan)
    if tracing(q, k, v):           # the plan, row_index too, become constants
        return call(plan, check_plan=False)
    try:
        entry = _PREPARED.setdefault(plan, [None, 0])
    except TypeError:              # a plan that can't be weakly referenced
        entry = [None, 0]
    if entry[0] is None:
        if not entry[1] and plan.units.nbytes + plan.steps.nbytes <= transfers.direct_max_bytes:
            # The first call of a small plan (a request on a new mask) hands the NumPy
            # arrays to the jitted call; later calls use device copies made once.
            entry[1] = 1
            return call(plan, check_plan=False)
        units, steps = put_plan(plan.units, plan.steps, transfers)
        entry[0] = dataclasses.replace(plan, units=units, steps=steps, row_index=None)
    return call(entry[0], check_plan=False)
