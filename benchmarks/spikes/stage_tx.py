#!/usr/bin/env python3
"""Spike (issue 31): gathered K/V stages whose copies make no barrier arrivals, the stage's
bytes expected once.

Why: under ``warp_map`` jax 0.11.2 lowers each ``copy_gmem_to_smem`` with every lane of the
issuing warp arriving on the stage's barrier (``arrive(3)`` + ``arrive_expect_tx(bytes /
32)``): a 16 + 16-copy gathered stage costs ~2,000 mbarrier operations, a one-copy stage
~130 (benchmarks/NOTES.md#gathered-steps). Here each stage's barrier gets one warp's
arrivals for all its copies (``expect_stage``: the arrivals of ``n`` copies and the whole
stage's bytes) and the copies complete bytes only (``copy_no_arrive``: Mosaic's
``async_copy(arrive=False)``). Both are jax's own ``copy_gmem_to_smem`` lowering with one
part turned off, as primitives of this spike (jax internals: a spike, not the library).

Predicted: a gathered full step 0.91 -> ~0.97 of cuDNN's rate per computed tile, a one-half
step 0.83 -> ~0.6 of a full one: clusters 0.60 -> ~0.65, cubes with 64-row groups 0.51 ->
~0.65, sliding 0.67 -> ~0.74. Kill criterion: ``stage_tx`` less than 3% faster than
``gather`` and ``stage_tx_skip`` less than 3% faster than ``gather_skip_nopp`` on every mask.
A wrong arrival count hangs the kernel: run it last, under ``timeout``.

    python3 benchmarks/spikes/stage_tx.py --masks clusters,cubes,sliding \
        --out $OUT/h200-stage-tx.json          # benchmarks/gather.py's loop and checks
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

import jax.experimental.pallas as pl  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
from jax._src import core as jax_core  # noqa: E402
from jax._src.pallas.mosaic_gpu import core as gpu_core  # noqa: E402
from jax._src.pallas.mosaic_gpu import lowering  # noqa: E402
from jax._src.pallas.mosaic_gpu import primitives as P  # noqa: E402
from jax.experimental.mosaic import gpu as mgpu  # noqa: E402
from jax.experimental.mosaic.gpu import launch_context, utils as mgpu_utils  # noqa: E402

from pallas_kernels.mosaic import common, kernel  # noqa: E402


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _clone(name, lower):
    """A primitive with copy_gmem_to_smem's abstract evaluation and ``lower`` as its
    lowering (same semantics registrations)."""
    p = jax_core.Primitive(name)
    p.multiple_results = True
    p.def_effectful_abstract_eval(P._copy_gmem_to_smem_abstract_eval)
    for sem in ((mgpu.LoweringSemantics.Lane,), gpu_core.LANExWARP_SEMANTICS,
                (mgpu.LoweringSemantics.Warpgroup,), gpu_core.WGxWARP_SEMANTICS):
        lowering.register_lowering_rule(p, *sem)(lower)
    return p


def _no_arrive_lowering(ctx, *args, **params):
    """The copy, its bytes completed on the barrier, without the issuing lanes' arrivals."""
    noop = lambda *a, **k: None                                       # noqa: E731
    with _patched(mgpu_utils.BarrierRef, "arrive", noop), \
            _patched(mgpu_utils.BarrierRef, "arrive_expect_tx", noop):
        return P._copy_gmem_to_smem_lowering(ctx, *args, **params)


def _expect_lowering(ctx, *args, n_copies, **params):
    """The lanes' arrivals of ``n_copies`` copies and the whole destination's bytes, no
    copy."""
    arrive = mgpu_utils.BarrierRef.arrive

    def more(self, arrival_count=1, can_complete=True, **kw):
        return arrive(self, arrival_count=arrival_count + 4 * (n_copies - 1),
                      can_complete=can_complete, **kw)

    with _patched(mgpu_utils.BarrierRef, "arrive", more), \
            _patched(launch_context.LaunchContext, "async_copy", lambda *a, **k: None):
        return P._copy_gmem_to_smem_lowering(ctx, *args, **params)


copy_no_arrive_p = _clone("tessera_copy_no_arrive", _no_arrive_lowering)


def copy_no_arrive(src, dst, barrier):
    with _patched(P, "copy_gmem_to_smem_p", copy_no_arrive_p):
        plgpu.copy_gmem_to_smem(src, dst, barrier)


_EXPECT = {}


def expect_stage(src, dst, barrier, n_copies: int):
    """One warp's arrivals standing for ``n_copies`` copies, expecting ``dst``'s bytes."""
    if n_copies not in _EXPECT:
        p = jax_core.Primitive(f"tessera_expect_stage_{n_copies}")
        p.multiple_results = True
        p.def_effectful_abstract_eval(P._copy_gmem_to_smem_abstract_eval)
        lower = functools.partial(_expect_lowering, n_copies=n_copies)
        for sem in ((mgpu.LoweringSemantics.Lane,), gpu_core.LANExWARP_SEMANTICS,
                    (mgpu.LoweringSemantics.Warpgroup,), gpu_core.WGxWARP_SEMANTICS):
            lowering.register_lowering_rule(p, *sem)(lower)
        _EXPECT[n_copies] = p
    with _patched(P, "copy_gmem_to_smem_p", _EXPECT[n_copies]):
        plgpu.copy_gmem_to_smem(src, dst, barrier)


def load_gathered_stage_tx(views, smems, bars, consumed, starts, run: int, slot, wait):
    """``common.load_gathered`` with one expected-bytes arrival per stage (warp 0) and
    copies without arrivals (copy j on warp j % 4)."""
    starts = [pl.multiple_of(x, common.ALIGN) for x in starts]
    n = len(starts)
    for view, smem, bar, done in zip(views, smems, bars, consumed):
        if done is not None:
            @pl.when(wait)
            def _(done=done):
                plgpu.barrier_wait(done.at[slot])

        def issue(w, view=view, smem=smem, bar=bar):
            @pl.when(w == 0)
            def _():
                expect_stage(view(pl.ds(starts[0], n * run)), smem.at[slot], bar.at[slot], n)
            for j in range(n):
                pl.when(w == j % 4)(functools.partial(
                    copy_no_arrive, view(pl.ds(starts[j], run)),
                    smem.at[slot, pl.ds(j * run, run)], bar.at[slot]))

        plgpu.warp_map(issue)


def install(setattr=setattr, setitem=lambda d, k, v: d.__setitem__(k, v)):
    """The forward's gathering producer with stage-wide expected bytes (for every gathering
    template of this process), and stand-in templates ``spike_stage_tx`` (gather) and
    ``spike_stage_tx_skip`` (with wg_skip, no ping-pong) for benchmarks/gather.py.
    ``setattr`` / ``setitem``: how to patch (a test passes monkeypatch's)."""
    from pallas_kernels import templates as T
    import gather
    setattr(kernel, "load_gathered", load_gathered_stage_tx)
    base = T.get("mgpu_q128_kv128_s2_gather")
    for name, kw in (("stage_tx", {}),
                     ("stage_tx_skip", dict(wg_skip=True, schedule_barrier=False))):
        t = dataclasses.replace(base, name=f"spike_{name}",
                                kernel=T.MosaicConfig(gather=True, **kw))
        setitem(T._REGISTRY, t.name, t)
        setitem(gather.VARIANTS, name, (t.name, "gather"))


if __name__ == "__main__":
    install()
    import gather
    if "--variants" not in sys.argv:
        sys.argv += ["--variants", "default,gather,gather_skip_nopp,stage_tx,stage_tx_skip"]
    gather.main()
