"""Moved: every benchmark times through ``tessera_jax.tools.timing`` (one rule for all systems).

What is left here are two names older callers used, expressed through that module.
"""

from __future__ import annotations

import numpy as np

from tessera_jax.tools.timing import (KERNEL_RULE, REQUEST_RULE, Timing,  # noqa: F401
                                      TimingRule, assert_same_rule, time_kernel, time_request,
                                      wall_rule)


def wall_ms(fn, iters: int = 5, warmup: int = 1, sync=None, before=None,
            gc_ms: list | None = None) -> list[float]:
    """``time_request``'s samples (host wall clock); ``gc_ms`` receives its per-call GC ms."""
    t = time_request(fn, rule=wall_rule(iters, warmup), before=before, sync=sync)
    if gc_ms is not None:
        gc_ms.extend(t.gc_ms)
    return list(t.samples)


def med(xs) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return float(np.median(xs)) if xs else None
