"""``PlannerConfig``: every option of the host planner, one frozen, hashable value.

The plan cache keys on it, so a changed option takes effect on the next call. Only
``share_step_lists`` changes a plan's arrays (which units share step rows); every other field
chooses how the same plan is computed (threads, thresholds, compiled or interpreted loops) and
gives byte-identical plans (tests/test_planner.py, tests/test_packaging.py).
"""

from __future__ import annotations

import dataclasses
import os

LOOP_MODES = ("auto", "compiled", "interpreted", "vectorised")


def _default_threads() -> int:
    return min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """Options of ``planner.build_plan`` (None there: ``DEFAULT``).

    share_step_lists: keep/merge units of a tall row group (same group, same rows) point at
        one copy of their step rows (smaller plans to build and copy); False gives each unit
        its own rows (``benchmarks/request_path.py`` measures both).
    threads: threads of the compiled loops (two halves from ``par_min_rows`` of work on; the
        step builders on all of them, in chunks, from 4 threads and ``wide_min_rows`` on).
    loops: "auto" runs the compiled loops once they are ready (``loops.ready()``); before,
        a loop call of at most ``interp_max_work`` array elements runs as plain Python while
        this process has interpreted fewer than ``interp_budget_work`` elements in all (about
        0.1 s at ~0.6 us an element), so a small plan never imports numba, and a plan with a
        larger call is the NumPy tier's (``planning.vectorised``), which starts compiling the
        loops (``background_compile``). "compiled" always compiles them; "interpreted" never
        does (plain Python throughout); "vectorised" plans keep/merge/split/pack with the
        NumPy tier, the rest interpreted.
    background_compile: "auto"'s first plan too large to interpret is planned by the NumPy
        tier (a fresh install: <= ~1-2 s, not the 12-25 s numba takes to compile split/pack)
        and then starts compiling the loops in the background (``loops.start_warm_up``: a
        Python subprocess fills numba's cache, then a thread loads it); False: that plan
        compiles them first.
    tier_chunk_steps: the NumPy tier makes a plan's steps this many at a time (and counts
        them this many mask words at a time): its temporaries stay a few MB, reused, since
        new memory costs a fresh process ~2 ms a MB on a VM.
    pack_min_bytes: masks from this many flags up are packed by the compiled loop.
    max_bound_bytes: most bytes reserved for a step-row bound; above, an exact counting pass.
    room_min_rows: reservations from this many rows get as many again for bitmap words.
    sample_stride, est_margin, est_slack: the estimate of the first half's rows on two
        threads (every sample_stride-th unit counted; relative and absolute headroom).
    """

    share_step_lists: bool = True
    threads: int = dataclasses.field(default_factory=_default_threads)
    loops: str = "auto"
    background_compile: bool = True
    interp_max_work: int = 1 << 13
    interp_budget_work: int = 1 << 17
    par_min_rows: int = 1 << 16
    wide_min_rows: int = 1 << 18
    tier_chunk_steps: int = 1 << 17
    pack_min_bytes: int = 1 << 16
    max_bound_bytes: int = 1 << 30
    room_min_rows: int = 1 << 16
    sample_stride: int = 32
    est_margin: float = 0.02
    est_slack: int = 64

    def __post_init__(self):
        for name in ("share_step_lists", "background_compile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.loops not in LOOP_MODES:
            raise ValueError(f"loops must be one of {LOOP_MODES}, got {self.loops!r}")
        for name in ("threads", "sample_stride", "tier_chunk_steps"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        for name in ("interp_max_work", "interp_budget_work", "par_min_rows", "wide_min_rows",
                     "pack_min_bytes", "max_bound_bytes", "room_min_rows", "est_slack"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"{name} must be a non-negative int, got {val!r}")
        if isinstance(self.est_margin, bool) or not isinstance(self.est_margin, (int, float)) \
                or not -1.0 < self.est_margin:
            raise ValueError(f"est_margin must be a number above -1, got {self.est_margin!r}")


DEFAULT = PlannerConfig()


def check(config) -> PlannerConfig:
    """``config`` as a PlannerConfig (None: ``DEFAULT``); TypeError for anything else."""
    if config is None:
        return DEFAULT
    if not isinstance(config, PlannerConfig):
        raise TypeError(f"config must be a planning.PlannerConfig or None, got "
                        f"{type(config).__name__}")
    return config
