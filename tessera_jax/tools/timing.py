"""The one timing module: every benchmark times every system (ours and the peers') through it.

A ``TimingRule`` says how a time is taken: the timer kind, the L2 policy, the warm-up calls, the
timed calls and the statistic. Every system of one comparison is timed under the same rule, and
the comparison checks it (``assert_same_rule``) and writes the rule into its result file.

Kernel time, ``KERNEL_RULE`` (the default of ``time_kernel``), the same for jax and torch:

- timer ``"cupti"``: the sum of the CUPTI durations of every kernel that ran during one call.
  The collector is jax's Mosaic GPU CUPTI extension (``_cupti_init`` / ``_cupti_get_timings``,
  what ``jax.experimental.mosaic.gpu.profiler.measure`` uses). CUPTI's kernel activity is
  process-wide, so the kernels torch launches (FlashInfer, FlexAttention's Triton kernels) are
  recorded by the same collector as XLA's and Pallas's. One collection window per call: it
  opens on an idle device (the flush and the previous call have finished) and closes when the
  call's result is ready, so it holds this call's kernels and nothing else. Host time between a
  call's kernels (launch gaps, eager dispatch) is not kernel time and is not counted; copies and
  memsets are not kernels. (Why not CUDA events: jax has none in Python. Why not torch.profiler:
  it is CUPTI too, but CUPTI takes one subscriber, and the jax collector works for both.)
- L2 ``"flush"``: before each timed call, outside the window, 256 MiB are written on the device
  (the H200's L2 is 60 MiB) by the system's framework (torch: ``zero_`` of a uint8 buffer, as
  ``triton.testing.do_bench`` does; jax: ``b + 1`` on a donated uint32 buffer) and the device is
  synchronised: no call starts with its inputs or the previous call's data in L2.
- 3 warm-up calls (compilation, autotuning, plan caches), then the median of 20 timed calls,
  rotating through the given input sets (random inputs, never zeros).

Off the GPU (CPU runs, smoke tests) or where CUPTI cannot attach, a kernel rule falls back to
host wall clock; the ``Timing`` then carries the rule it was really taken under (timer
``"wall"``), so a comparison that mixes a fallback with a CUPTI time fails ``assert_same_rule``.

Request latency, ``REQUEST_RULE`` (``time_request``): host wall clock from the call to the result
being ready, the same for every system (``before`` runs untimed before each call, e.g. a cache
reset so that a new mask's work is paid; garbage-collection time inside each call is recorded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from typing import Any, Callable, Iterable

TIMERS = ("cupti", "events", "wall")
L2_POLICIES = ("flush", "none", "rotate")
STATS = {"median": statistics.median, "mean": statistics.fmean, "min": min}
#: Device timers (CUPTI, CUDA events): the median of at least this many timed calls.
DEVICE_MIN_REPEATS = 20
#: Bytes written to flush the L2 (the H200's is 60 MiB; 4x leaves no line of before).
FLUSH_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class TimingRule:
    """How one time is taken. ``timer``: ``"cupti"`` (summed CUPTI kernel durations per call),
    ``"events"`` (CUDA events around the call: torch only) or ``"wall"`` (host clock until the
    result is ready). ``l2``: ``"flush"`` (256 MiB written before each timed call), ``"none"``
    or ``"rotate"`` (no flush; inputs rotate over >= 2 sets). ``warmup`` untimed calls, then
    ``repeats`` timed calls summarised by ``stat``."""

    timer: str = "cupti"
    l2: str = "flush"
    warmup: int = 3
    repeats: int = 20
    stat: str = "median"

    def __post_init__(self):
        if self.timer not in TIMERS:
            raise ValueError(f"TimingRule.timer must be one of {TIMERS}, got {self.timer!r}")
        if self.l2 not in L2_POLICIES:
            raise ValueError(f"TimingRule.l2 must be one of {L2_POLICIES}, got {self.l2!r}")
        if self.stat not in STATS:
            raise ValueError(f"TimingRule.stat must be one of {tuple(STATS)}, got {self.stat!r}")
        for f in ("warmup", "repeats"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"TimingRule.{f} must be an int, got {v!r}")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"TimingRule needs warmup >= 0 and repeats >= 1, got "
                             f"warmup={self.warmup}, repeats={self.repeats}")
        if self.timer != "wall" and self.repeats < DEVICE_MIN_REPEATS:
            raise ValueError(f"GPU timings take the {self.stat} of >= {DEVICE_MIN_REPEATS} runs; "
                             f"got repeats={self.repeats} for timer {self.timer!r}")

    @property
    def name(self) -> str:
        return f"{self.timer}/l2={self.l2}/warmup={self.warmup}/n={self.repeats}/{self.stat}"

    def replace(self, **changes) -> "TimingRule":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "name": self.name}

    def summarize(self, samples) -> float:
        return float(STATS[self.stat](list(samples)))


#: Kernel time of every system in a comparison (ours, the torch peers, cuDNN dense).
KERNEL_RULE = TimingRule()
#: Request latency (host wall clock, everything a call pays) of every system in a comparison:
#: the median of 21 calls, as the design's GPU timings (>= 20 runs): single wall-clock calls
#: on a GPU host spread by up to ~1 ms (benchmarks/NOTES.md, request rule).
REQUEST_RULE = TimingRule(timer="wall", l2="none", warmup=1, repeats=21)


@dataclasses.dataclass(frozen=True)
class Timing:
    """One system's time: ``ms`` (the rule's statistic of ``samples``, milliseconds), under
    ``rule`` (the rule really applied: a fallback shows here), by ``framework``."""

    ms: float
    samples: tuple
    rule: TimingRule
    framework: str = "host"
    gc_ms: tuple | None = None
    note: str | None = None

    @property
    def timer(self) -> str:
        return self.rule.timer

    @classmethod
    def from_samples(cls, samples: Iterable[float], rule: TimingRule, framework: str = "host",
                     **kw) -> "Timing":
        s = tuple(float(x) for x in samples)
        if not s:
            raise ValueError("no samples")
        return cls(rule.summarize(s), s, rule, framework, **kw)

    def to_json(self, prefix: str = "") -> dict:
        """``{prefix}ms``, ``samples``, ``timer``, ``rule`` (its name) [, ``gc_ms``,
        ``timing_note``]: the fields a result row keeps."""
        d = {"ms": self.ms, "samples": list(self.samples), "timer": self.timer,
             "rule": self.rule.name}
        if self.gc_ms is not None:
            d["gc_ms"] = list(self.gc_ms)
        if self.note:
            d["timing_note"] = self.note
        return {prefix + k: v for k, v in d.items()}


class MixedRulesError(AssertionError):
    """Systems of one comparison were timed under different rules."""


def _rule_name(x) -> str | None:
    if x is None:
        return None
    if isinstance(x, Timing):
        return x.rule.name
    if isinstance(x, TimingRule):
        return x.name
    if isinstance(x, dict):
        return _rule_name(x.get("rule"))
    if isinstance(x, str):
        return x
    raise TypeError(f"not a timing, a rule or a rule name: {type(x).__name__}")


def assert_same_rule(items: Iterable[Any], what: str = "comparison") -> str | None:
    """The one rule name of ``items`` (``Timing``, ``TimingRule``, rule names, or result dicts
    with a ``"rule"`` key; ``None`` and dicts without one are skipped), ``None`` if there is
    none; raises ``MixedRulesError`` if they hold more than one."""
    seen: dict[str, int] = {}
    for x in items:
        n = _rule_name(x)
        if n is not None:
            seen[n] = seen.get(n, 0) + 1
    if len(seen) > 1:
        raise MixedRulesError(f"{what}: systems timed under different rules "
                              f"(one rule for all): {seen}")
    return next(iter(seen), None)


# ----------------------------------------------------------------------------------------------
# Devices: synchronisation and the L2 flush, per framework
# ----------------------------------------------------------------------------------------------
_clock = time.perf_counter           # tests replace it with a fake clock


class _Jax:
    name = "jax"

    def __init__(self):
        import jax
        self.jax = jax
        self.gpu = jax.default_backend() == "gpu"

    def sync(self, out):
        self.jax.block_until_ready(out)

    def idle(self):
        _torch_sync()                # a torch peer's work in flight would land in the window

    def flush(self):
        buf = _FLUSH.get("jax")
        if buf is None:
            import jax.numpy as jnp
            _FLUSH["jax_bump"] = self.jax.jit(lambda b: b + 1, donate_argnums=0)
            buf = jnp.zeros(FLUSH_BYTES // 4, jnp.uint32)
        buf = _FLUSH["jax_bump"](buf)
        self.jax.block_until_ready(buf)
        _FLUSH["jax"] = buf


class _Torch:
    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch
        self.gpu = bool(torch.cuda.is_available())

    def sync(self, out):
        if self.gpu:
            self.torch.cuda.synchronize()

    def idle(self):
        self.sync(None)

    def flush(self):
        buf = _FLUSH.get("torch")
        if buf is None:
            buf = _FLUSH["torch"] = self.torch.empty(FLUSH_BYTES, dtype=self.torch.uint8,
                                                     device="cuda")
        buf.zero_()
        self.torch.cuda.synchronize()


_FLUSH: dict = {}


def _torch_sync():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def _device(framework: str):
    if framework not in ("jax", "torch"):
        raise ValueError(f"framework must be 'jax' or 'torch', got {framework!r}")
    return _Jax() if framework == "jax" else _Torch()


# ----------------------------------------------------------------------------------------------
# Kernel time
# ----------------------------------------------------------------------------------------------
class CuptiUnavailable(RuntimeError):
    """The CUPTI collector cannot be loaded or attached here."""


_CUPTI = {"broken": None}            # why CUPTI failed once: later timings go to wall at once


def _cupti_ext():
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init, ext._cupti_get_timings  # noqa: B018 - both must exist
    except Exception as e:  # noqa: BLE001
        raise CuptiUnavailable(f"no Mosaic GPU CUPTI collector: {e!r}"[:300]) from e
    return ext


def _cupti_samples(call, rule, dev, start):
    # One window per timed call, as ``profiler.Cupti(finalize=False).measure`` called once per
    # sample (jax's own benchmark helpers do so); CUPTI is detached after the last one.
    ext = _cupti_ext()
    out = []
    for j in range(rule.repeats):
        if rule.l2 == "flush":
            dev.flush()
        dev.idle()
        try:
            ext._cupti_init()
        except Exception as e:  # noqa: BLE001
            raise CuptiUnavailable(f"CUPTI did not attach: {e!r}"[:300]) from e
        last = j == rule.repeats - 1
        try:
            dev.sync(call(start + j))
        except BaseException:
            with contextlib.suppress(Exception):
                ext._cupti_get_timings(True)
            raise
        try:
            recs = ext._cupti_get_timings(last)
        except Exception as e:  # noqa: BLE001
            raise CuptiUnavailable(f"CUPTI collection failed: {e!r}"[:300]) from e
        if not recs:
            raise RuntimeError("the timed call launched no kernel: nothing to time")
        out.append(float(sum(t for _, t in recs)))
    return out


def _event_samples(call, rule, dev, start):
    torch = dev.torch
    out = []
    for j in range(rule.repeats):
        if rule.l2 == "flush":
            dev.flush()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        call(start + j)
        b.record()
        b.synchronize()
        out.append(float(a.elapsed_time(b)))
    return out


def _wall_samples(call, rule, dev, start):
    out = []
    for j in range(rule.repeats):
        if rule.l2 == "flush":
            dev.flush()
        dev.idle()
        t0 = _clock()
        dev.sync(call(start + j))
        out.append((_clock() - t0) * 1e3)
    return out


_SAMPLERS = {"cupti": _cupti_samples, "events": _event_samples, "wall": _wall_samples}


def _host_fallback(rule: TimingRule, why: str, fallback: bool) -> tuple[TimingRule, str]:
    if not fallback:
        raise RuntimeError(f"cannot time under {rule.name}: {why}")
    return rule.replace(timer="wall"), f"host wall clock instead of {rule.timer}: {why}"


def time_kernel(fn: Callable, arg_sets=((),), *, rule: TimingRule = KERNEL_RULE,
                framework: str = "jax", fallback: bool = True) -> Timing:
    """Times ``fn(*args)`` under ``rule``: ``rule.warmup`` untimed calls, then ``rule.repeats``
    timed ones, call ``i`` on ``arg_sets[i % len(arg_sets)]``. ``fn`` is called as given (jit it
    first for one executable; an eager call of cached executables is timed as it runs).
    ``framework`` ("jax" or "torch") says how to wait for the device and flush its L2.
    ``fallback``: off the GPU or without CUPTI, time with the host clock (the returned
    ``Timing.rule`` says so) instead of raising."""
    dev = _device(framework)
    arg_sets = [tuple(a) for a in arg_sets]
    if not arg_sets:
        raise ValueError("time_kernel needs at least one input set")
    if rule.l2 == "rotate" and len(arg_sets) < 2:
        raise ValueError("l2='rotate' needs >= 2 input sets to rotate through")
    if rule.timer == "events" and framework != "torch":
        raise ValueError("CUDA-event timing is torch only (jax has no events): use 'cupti'")
    eff, note = rule, None
    if not dev.gpu:
        if rule.timer != "wall" or rule.l2 == "flush":
            eff, note = _host_fallback(rule, "no GPU", fallback)
            if eff.l2 == "flush":
                eff = eff.replace(l2="none")           # no device L2 to flush
    elif rule.timer == "cupti" and _CUPTI["broken"]:
        eff, note = _host_fallback(rule, _CUPTI["broken"], fallback)

    def call(i):
        return fn(*arg_sets[i % len(arg_sets)])

    for i in range(eff.warmup):
        dev.sync(call(i))
    try:
        samples = _SAMPLERS[eff.timer](call, eff, dev, eff.warmup)
    except CuptiUnavailable as e:
        _CUPTI["broken"] = str(e)
        print(f"tessera_jax.tools.timing: {e}; timing with the host clock", file=sys.stderr,
              flush=True)
        eff, note = _host_fallback(rule, str(e), fallback)
        samples = _wall_samples(call, eff, dev, eff.warmup)
    return Timing.from_samples(samples, eff, framework, note=note)


# ----------------------------------------------------------------------------------------------
# Request latency (host wall clock)
# ----------------------------------------------------------------------------------------------
class _GcClock:
    """Milliseconds the interpreter spent in garbage collections since ``reset`` (gc.callbacks):
    a collection inside a timed request is host time no planner or kernel accounts for."""

    def __init__(self):
        self.ms, self._t0 = 0.0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = _clock()
        elif self._t0 is not None:
            self.ms += (_clock() - self._t0) * 1e3
            self._t0 = None

    def reset(self):
        self.ms, self._t0 = 0.0, None


def time_request(fn: Callable[[], Any], *, rule: TimingRule = REQUEST_RULE,
                 before: Callable[[], Any] | None = None,
                 sync: Callable[[], Any] | None = None) -> Timing:
    """Host wall-clock milliseconds of ``fn()`` until ``sync()`` returns (the device is done;
    ``fn`` may block itself, e.g. ``jax.block_until_ready``). ``before()`` runs untimed before
    every call (warm-up included): e.g. ``tj.clear_caches`` so a new mask's work is paid.
    ``Timing.gc_ms``: per timed call, the milliseconds spent in garbage collection."""
    if rule.timer != "wall" or rule.l2 != "none":
        raise ValueError(f"request latency is host wall clock without flush; got {rule.name}")
    for _ in range(rule.warmup):
        if before:
            before()
        fn()
        if sync:
            sync()
    out, gcs = [], []
    clock = _GcClock()
    gc.callbacks.append(clock)
    try:
        for _ in range(rule.repeats):
            if before:
                before()
            if sync:
                sync()
            clock.reset()
            t0 = _clock()
            fn()
            if sync:
                sync()
            out.append((_clock() - t0) * 1e3)
            gcs.append(clock.ms)
    finally:
        gc.callbacks.remove(clock)
    return Timing.from_samples(out, rule, "host", gc_ms=tuple(gcs))


def wall_once(fn: Callable[[], Any], sync: Callable[[Any], Any] | None = None):
    """``(result, ms)``: one host wall-clock call of ``fn()`` until ``sync(result)`` returns;
    for loops that interleave several timed parts (collect the samples, then
    ``Timing.from_samples(samples, rule)``)."""
    t0 = _clock()
    r = fn()
    if sync is not None:
        sync(r)
    return r, (_clock() - t0) * 1e3


#: jax.monitoring's event of one XLA backend compile (its duration in seconds).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles():
    """Yields a list that gets the seconds of each XLA backend compile run inside the block: a
    compile where none is due (a request after ``tj.precompile``) shows as a non-empty list."""
    import jax
    seen = []

    def listen(event, duration, **_):
        if event == BACKEND_COMPILE:
            seen.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def wall_rule(repeats: int, warmup: int = 1, l2: str = "none") -> TimingRule:
    """A host wall-clock rule (CPU runs, end-to-end loops, requests)."""
    return TimingRule(timer="wall", l2=l2, warmup=warmup, repeats=repeats)


def add_rule_arguments(parser) -> None:
    """``--warmup`` / ``--iters`` on an argparse parser: a tool's overrides of the kernel rule
    (``None``: the rule's own values)."""
    from tessera_jax.tools import cli
    parser.add_argument("--warmup", type=cli.nonnegative_int, default=None,
                        help="warm-up calls (default: the kernel rule's, timing.KERNEL_RULE)")
    parser.add_argument("--iters", type=cli.positive_int, default=None,
                        help="timed calls, median (default: the kernel rule's; >= 20 on GPU)")
