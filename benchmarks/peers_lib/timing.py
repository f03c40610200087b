"""GPU timing helpers for the peers benchmark: torch CUDA events, JAX CUPTI, host wall clock.

Kernel-only times are device times: CUDA events around one call for torch (the L2 is flushed
before each call), CUPTI kernel time of every launch in the call for JAX. Request latencies are
host wall-clock from the start of mask conversion to the result being ready on the device.
"""

from __future__ import annotations

import time

import numpy as np

_L2 = None


def _flush_l2():
    """Overwrites a 256 MiB buffer (the H200's L2 is 60 MiB) so no call starts with a warm L2."""
    global _L2
    import torch
    if _L2 is None:
        _L2 = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _L2.zero_()


def torch_kernel_ms(fn, iters: int = 20, warmup: int = 3) -> list[float]:
    """Per-call device milliseconds (CUDA events), after ``warmup`` calls (wall clock on CPU)."""
    import torch
    if not torch.cuda.is_available():
        return wall_ms(fn, iters=iters, warmup=warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        _flush_l2()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(float(a.elapsed_time(b)))
    return out


_CUPTI_OK: bool | None = None


def _cupti_eager(fn, iters: int) -> list[float]:
    """CUPTI kernel time per call of an arbitrary (not jitted) ``fn()``: the same collection
    as ``jax.experimental.mosaic.gpu.profiler.measure`` (which jits its argument), so an eager
    call that reuses cached executables is timed without compiling a new one."""
    import jax
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    jax.block_until_ready(fn())
    ext._cupti_init()
    try:
        outs = [fn() for _ in range(iters)]
        for o in outs:
            jax.block_until_ready(o)
    finally:
        timings = ext._cupti_get_timings(True)
    if not timings or len(timings) % iters:
        raise RuntimeError(f"{len(timings or [])} kernel launches for {iters} calls")
    per = len(timings) // iters
    return [float(sum(t for _, t in timings[i * per:(i + 1) * per])) for i in range(iters)]


def jax_kernel_ms(fn, args, iters: int = 20, warmup: int = 2,
                  eager: bool = False) -> tuple[list[float], str]:
    """Per-call kernel milliseconds of ``fn(*args)`` (CUPTI, else wall clock). ``eager``: call
    ``fn`` as is (no new jit: for calls whose executables are already compiled and cached)."""
    global _CUPTI_OK
    import jax
    if eager and _CUPTI_OK is not False:
        try:
            out = _cupti_eager(lambda: fn(*args), iters)
            _CUPTI_OK = True
            return out, "cupti_eager"
        except Exception as e:  # noqa: BLE001
            print("eager CUPTI timing failed, jitting instead:", repr(e)[:200], flush=True)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)      # already jitted: reuse its cache
    for _ in range(warmup):
        jax.block_until_ready(jitted(*args))
    if _CUPTI_OK is not False:
        try:
            from jax.experimental.mosaic.gpu import profiler
            _, ts = profiler.measure(jitted, iterations=iters)(*args)
            _CUPTI_OK = True
            return [float(t) for t in np.atleast_1d(ts)], "cupti"
        except Exception as e:  # noqa: BLE001
            print("CUPTI timing unavailable, using wall clock:", repr(e)[:200], flush=True)
            _CUPTI_OK = False
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        out.append((time.perf_counter() - t0) * 1e3)
    return out, "wall"


class _GcClock:
    """Milliseconds the interpreter spent in garbage collections since ``reset`` (gc.callbacks):
    a collection inside a timed request is host time no planner or kernel accounts for."""

    def __init__(self):
        self.ms, self._t0 = 0.0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def reset(self):
        self.ms, self._t0 = 0.0, None


def wall_ms(fn, iters: int = 5, warmup: int = 1, sync=None, before=None,
            gc_ms: list | None = None) -> list[float]:
    """Host wall-clock milliseconds of ``fn()`` until ``sync()`` returns (device done).

    ``before()`` runs untimed before each call (e.g. clearing a plan cache so planning is paid).
    ``gc_ms``: a list that receives, per timed call, the milliseconds spent in garbage collection.
    """
    import gc
    for _ in range(warmup):
        if before:
            before()
        fn()
        if sync:
            sync()
    out = []
    clock = _GcClock()
    gc.callbacks.append(clock)
    try:
        for _ in range(iters):
            if before:
                before()
            if sync:
                sync()
            clock.reset()
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            out.append((time.perf_counter() - t0) * 1e3)
            if gc_ms is not None:
                gc_ms.append(clock.ms)
    finally:
        gc.callbacks.remove(clock)
    return out


def med(xs) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return float(np.median(xs)) if xs else None
