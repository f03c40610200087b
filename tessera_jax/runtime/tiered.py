"""Tiered host planning (``Options.host_planning``): an eager call on a host mask whose host
plan is not made yet runs the device route while the host plan is made on a background
thread; the first call of the request that finds the plan ready, and every call after, runs
the host plan (the API's front cache).

The device route gets the mask copied to the device (``BlockMask.packed_leaves``: blocks
bit-packed and unpacked inside the route's program, bounds as jax arrays, so traced: one
executable serves every mask of these shapes), or, where the executable of these very bounds
was compiled (``precompile``: a fixed-grid method's bounds repeat), the bounds kept static
(tiles aligned to the blocks, cheaper planning); its output agrees with the host plan's within
the kernels' tolerance (other tiles, same math).

The background plan starts once the device route's output is ready (it waits for it with
the GIL released), so its Python never competes with the request's launch and return.

A mask's host plan starts at its ``Options.host_plan_from_call``-th call (default 2: when
the mask comes again). A new mask per call (dynamic sparsity, a stream of requests) then
never pays a host plan it would not use: the plan's thread took 0.3-1.0 ms of a request on
the H100 even after the route's output (benchmarks/NOTES.md#request-path).

Every host plan made on this path (the rule's and the background's) is timed: the rule
scales its predicted host planning by the least measured / predicted ratio of the request
shape's last plans of the last minute (``_host_scale``), so a size the fit misprices tiers
after two plans, and is measured again a minute later.

Rules: one background plan per request key (concurrent calls on one new mask share it, and a
synchronous plan of that key waits for it: ``wait_for``); a finished plan goes into the front
cache from the worker; a failed one is kept and re-raised, once, by the next call of its key
(which then forgets it, so the call after plans again); ``clear`` (``tj.clear_caches``)
cancels the plans not started, waits for the running ones and drops what they made, so no
plan lands in a cache after it was cleared. One worker thread: the planner's loops already
use a second thread (its own helper pool), which plans running side by side would queue on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time

import jax
import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.runtime import device_route, tier_costs
from tessera_jax.runtime.options import DEFAULT, Options
from tessera_jax.select import device as _select_device
from tessera_jax.select import ranking as _ranking
from tessera_jax.validation import AttnShape

__all__ = ["SMALL_TILES_MEDIANS", "attention", "precompile", "compiled", "bounds_key",
           "route_options", "mode", "wait_for", "wait", "clear", "pending", "stats"]


class _Entry:
    """A background plan: its future, the mask's device copy (``BlockMask.packed_leaves``,
    made by the first call that needs it), the generation of ``clear`` it belongs to."""

    __slots__ = ("future", "leaves", "gen")

    def __init__(self, gen: int):
        self.future, self.leaves, self.gen = None, None, gen


_LOCK = threading.Lock()             # guards everything below
_PENDING: dict = {}                  # request key -> _Entry (running, or failed)
_GEN = 0                             # bumped by clear(): older jobs publish nothing
_COMPILED: set = set()               # device-route executables this process has run
_PREPARED: dict = {}                 # compiled key -> the device route's prepared call
_PREPARED_MAX = 64
# (backend, shape, mask.shape) -> (monotonic time, measured / predicted planning time) of the
# last host plans; a sample counts for _HOST_RATIOS_TTL_S seconds
_HOST_RATIOS: collections.OrderedDict = collections.OrderedDict()
_HOST_RATIOS_KEPT, _HOST_RATIOS_MIN, _HOST_RATIOS_MAX = 8, 2, 256
_HOST_RATIOS_TTL_S = 60.0
_COUNTS: collections.Counter = collections.Counter()
_SEEN: collections.OrderedDict = collections.OrderedDict()  # hash(request key) -> calls so far
_SEEN_MAX = 4096
_POOL = None                         # (pid, executor), made on first use and after a fork


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The worker (called under ``_LOCK``)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(),
                 concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tessera-tiered"))
    return _POOL[1]


@functools.lru_cache(maxsize=64)
def _untiered(options: Options) -> Options:
    """``options`` with ``host_planning`` "sync" and the default ``host_plan_from_call``: the
    device route's executable depends on neither, so tiered calls share it with device-mask
    calls."""
    return dataclasses.replace(options, host_planning="sync",
                               host_plan_from_call=DEFAULT.host_plan_from_call)


def attention(q, k, v, *, key, mask: BlockMask, shape: AttnShape, backend: str, scale: float,
              return_lse: bool, options: Options, build, cache):
    """out (and lse) of a tiered call on the device route, or None: run the host plan
    (``cache`` holds it now, or the rule says the host plan is faster; the caller plans).
    ``key``: the front cache's key of the request; ``build()``: its host plan; ``cache``:
    the front cache (``get``, ``put``). Raises a failed background plan's exception."""
    bkey = bounds_key(mask)
    options = route_options(options, bkey)
    traced_key = _compiled_key(q, k, mask, backend, scale, return_lse, options)
    static_key = traced_key + (bkey,)
    with _LOCK:
        static = static_key in _COMPILED
        compiled_key = static_key if static else traced_key
        if cache.get(key) is not None:
            return None
        e = _PENDING.get(key)
        if e is not None and e.future.done():
            del _PENDING[key]
            exc = None if e.future.cancelled() else e.future.exception()
            if exc is not None:
                _COUNTS["reraised"] += 1
                raise exc
            return None
        start = declined = False
        if e is None:
            if options.host_planning != "device_first" and not _rule(
                    mask, shape, backend, options, compiled_key in _COMPILED, q, bkey,
                    _host_scale(_ratio_key(mask, shape, backend))):
                _COUNTS["declined"] += 1
                declined = True
            elif _sighted(key, options.host_plan_from_call):
                e = _PENDING[key] = _Entry(_GEN)
                e.future = concurrent.futures.Future()
                start = True
                _COUNTS["started"] += 1
            else:
                _COUNTS["deferred"] += 1
        if not declined:
            _COUNTS["device_route"] += 1
    if declined:                   # the host plan now, timed: the rule learns its real cost
        cache.put(key, _timed(build, mask, shape, backend, options, _platform(q), bkey))
        return None
    # The host plan starts once the device route's output is ready: a plan running beside
    # the request would hold the GIL for its Python and NumPy parts while this thread
    # launches the kernels and returns from its wait (H100: 0.2-1.1 ms a request).
    out = None
    try:
        leaves = None if e is None else e.leaves
        if leaves is None or isinstance(leaves[0], np.ndarray) != static:
            # static bounds: the bits go to the route's jit as NumPy (copied in its dispatch)
            leaves = mask.packed_leaves(static_bounds=static, host_bits=static)
            if e is not None:
                e.leaves = leaves
        out = _device_route(q, k, v, mask, leaves, shape, backend, scale, return_lse, options,
                            compiled_key)
        return out
    finally:
        if start:
            _executor().submit(_job, key, functools.partial(
                _timed, build, mask, shape, backend, options, _platform(q), bkey), cache, e, out)


def _sighted(key, from_call: int) -> bool:
    """Whether this call on the request ``key`` (no host plan made or pending) is its
    ``from_call``-th or later, so its host plan starts now; counts it otherwise (called
    under ``_LOCK``). Counts are kept per ``hash(key)`` for the last ``_SEEN_MAX`` keys, not
    the keys (they hold the masks): a collision starts a plan early, never late."""
    if from_call <= 1:
        return True
    h = hash(key)
    n = _SEEN.pop(h, 0) + 1
    if n >= from_call:
        return True
    _SEEN[h] = n
    if len(_SEEN) > _SEEN_MAX:
        _SEEN.popitem(last=False)
    return False


def _device_route(q, k, v, mask: BlockMask, leaves, shape, backend, scale, return_lse, options,
                  compiled_key):
    """The device route on ``mask`` copied as ``leaves`` (``BlockMask.packed_leaves``: its
    blocks unpacked inside the program)."""
    fn = _PREPARED.get(compiled_key)
    if fn is not None:
        return fn(q, k, v, *leaves)
    # the key holds what the call site's static choice reads: prepared once
    qb, kb, _ = leaves
    like = BlockMask._from_leaves(qb, kb, jax.ShapeDtypeStruct(mask.shape, np.bool_))
    fn = device_route.prepare(like, shape, backend, None, scale, return_lse, _untiered(options),
                              packed=True)
    out = fn(q, k, v, *leaves)
    with _LOCK:
        _remember(_PREPARED, _COMPILED, compiled_key, fn, _PREPARED_MAX)
    return out


def _remember(prepared: dict, compiled: set, key, fn, cap: int) -> None:
    """Records ``fn``, the prepared call of ``key``, and its executables; past ``cap`` calls
    the oldest goes, and its key leaves ``compiled`` (its executables go with it, so the rule
    counts a compile again)."""
    compiled.add(key)
    prepared[key] = fn
    while len(prepared) > cap:
        oldest = next(iter(prepared))
        del prepared[oldest]
        compiled.discard(oldest)


def route_options(options: Options, bkey: tuple) -> Options:
    """``options`` for the device route of a tiered call on the mask of ``bounds_key``
    ``bkey``: ``device_gather`` "auto" sees the host mask's key bounds, so irregular ones
    (``select.device.irregular_kv``) whose median blocks are <= ``SMALL_TILES_MEDIANS``
    (128 query, 64 key tokens) take the device list's 64-row, 64-key tiles where the route
    traces them (``traced_small_blocks``), other irregular ones gather ("traced"); with the
    bounds static (a precompiled executable) the device list's fitted tiles run them."""
    if options.device_gather != "auto" or options.traced_small_blocks is not None \
            or not _irregular(bkey):
        return options
    return _small_tiles(options) if _small(bkey) else _gathering(options)


@functools.lru_cache(maxsize=256)
def _irregular(bkey: tuple) -> bool:
    return _select_device.irregular_kv(np.frombuffer(bkey[2], np.int64))


#: Median (query, key) blocks up to which a tiered call's irregular traced bounds take
#: ``traced_small_blocks`` rather than the gathering template. SVG2's clusters, plan + kernel
#: (H100, 12 heads): Wan 480p, medians 44 x 29: 6.33 ms against gathering's 7.43
#: (results/h100-svg2-traced-alt.json); Wan 720p, 101 x 33: 28.67-28.97 against 30.33
#: (results/h100-svg2-720-traced.json); HunyuanVideo 720p, 442 x 52: gathering's plan computes
#: 0.93x the area of q64x2's (CPU counts, benchmarks/NOTES.md#peers), so it gathers.
SMALL_TILES_MEDIANS = (128, 64)


@functools.lru_cache(maxsize=256)
def _small(bkey: tuple) -> bool:
    """Whether the query and key axes' median blocks (over every bounds row) are within
    ``SMALL_TILES_MEDIANS``."""
    return all(_select_device.small_blocks(np.frombuffer(b, np.int64).reshape(-1, n + 1), t)
               for b, n, t in zip((bkey[1], bkey[2]), (bkey[0][1], bkey[0][2]),
                                  SMALL_TILES_MEDIANS))


@functools.lru_cache(maxsize=64)
def _gathering(options: Options) -> Options:
    return dataclasses.replace(options, device_gather="traced")


@functools.lru_cache(maxsize=64)
def _small_tiles(options: Options) -> Options:
    return dataclasses.replace(options, device_gather="never", traced_small_blocks=True)


def _compiled_key(q, k, mask: BlockMask, backend, scale, return_lse, options) -> tuple:
    """What picks the device route's executable of a tiered call with traced bounds (one per
    shapes); with ``bounds_key(mask)`` appended, the one with these bounds static."""
    return (tuple(q.shape), tuple(k.shape), q.dtype, mask.shape, backend, float(scale),
            bool(return_lse), _untiered(options))


def bounds_key(mask: BlockMask) -> tuple:
    """A static mask's block shape and bounds, as a key: what picks its static-bounds route."""
    return (mask.shape,) + tuple(np.asarray(b, np.int64).tobytes()
                                 for b in (mask.q_bounds, mask.kv_bounds))


#: ``tj.precompile``'s ``tiered_routes``: the device routes a tiered call may run.
TIERED_ROUTES = ("traced", "static")


def precompile(q, k, v, *, mask: BlockMask, shape: AttnShape, backend: str, scale: float,
               return_lse: bool, options: Options, routes=TIERED_ROUTES):
    """Runs (so compiles) the device routes a tiered call of this mask's shapes would run, so
    the rule no longer counts a compile for them (``tj.precompile`` where calls tier), those
    of ``routes``: "traced" bounds (any mask of these shapes) and "static" (these bounds: a
    new mask of the same bounds, as fixed-grid methods make; tiles aligned to its blocks,
    cheaper planning, and a smaller program: decided on the device only past the budget)."""
    bkey = bounds_key(mask)
    options = route_options(options, bkey)
    key = _compiled_key(q, k, mask, backend, scale, return_lse, options)
    if "traced" in routes:
        jax.block_until_ready(_device_route(q, k, v, mask, mask.packed_leaves(), shape, backend,
                                            scale, return_lse, options, key))
    if "static" in routes:
        # the leaves as a request makes them (NumPy bits: jit's cache tells them from device
        # ones)
        jax.block_until_ready(_device_route(
            q, k, v, mask, mask.packed_leaves(static_bounds=True, host_bits=True), shape,
            backend, scale, return_lse, options, key + (bkey,)))


def compiled(q, k, mask: BlockMask, backend: str, scale: float, return_lse: bool,
             options: Options) -> bool:
    """Whether this process has run a device route a tiered call of this mask would run
    (traced bounds of its shapes, or its bounds static)."""
    bkey = bounds_key(mask)
    key = _compiled_key(q, k, mask, backend, scale, return_lse, route_options(options, bkey))
    with _LOCK:
        return key in _COMPILED or key + (bkey,) in _COMPILED


def _platform(q) -> str:
    return next(iter(q.devices())).platform if hasattr(q, "devices") else jax.default_backend()


def mode(options: Options, q) -> str:
    """``options.host_planning`` with "auto" resolved for the device of ``q``: "tiered" on a
    GPU, "sync" elsewhere."""
    m = options.host_planning
    if m != "auto":
        return m
    return "sync" if _platform(q) == "cpu" else "tiered"


def _rule(mask, shape, backend, options, compiled, q, bkey, host_scale: float = 1.0) -> bool:
    """``tier_costs.tiers`` for this request on this machine (``host_scale``: the measured
    host planning over the fit's, ``_host_scale``). The mask's selected blocks are counted
    only as far as the answer needs (``tier_costs.base_tiers``), and the host choice (a table
    look-up, cached for the host plan) is read only where a gathering plan's planning time
    could still tip the rule."""
    costs = tier_costs.costs_for(_platform(q), backend, _ranking.device_name())
    if costs is None:
        return False
    args = (mask, shape, backend, options.device_rule, bkey[1:])
    if tier_costs.base_tiers(*args, costs, compiled, host_scale):
        return True
    if costs.host_ns_per_gather_pair <= 0:
        return False
    size = tier_costs.size_of(*args)
    if size is None:
        return False
    size = dataclasses.replace(size, gather=tier_costs.host_gathers(mask, shape, backend))
    return tier_costs.tiers(size, costs, compiled, host_scale)


def _ratio_key(mask: BlockMask, shape: AttnShape, backend: str) -> tuple:
    """Masks whose host plans share a measured scale: one request shape and block count."""
    return backend, shape, mask.shape


def _host_scale(rkey, now: float | None = None) -> float:
    """The least measured / predicted host planning time of the last plans of ``rkey`` timed
    in the last ``_HOST_RATIOS_TTL_S`` seconds (1.0 with fewer than ``_HOST_RATIOS_MIN``):
    the least, because one-time costs and a loaded host only ever add time (a process's first
    plans run before numba's loops are ready: a Wan 720p DiTFastAttn plan 10 ms against 2 ms
    with them, CPU box); recent, because a shape the scale sends to the device route times no
    more plans of its own, so it plans on the host again once they are old, and is measured
    anew (called under ``_LOCK``)."""
    r = _HOST_RATIOS.get(rkey)
    if r is None:
        return 1.0
    now = time.monotonic() if now is None else now
    recent = [x for t, x in r if now - t <= _HOST_RATIOS_TTL_S]
    return min(recent) if len(recent) >= _HOST_RATIOS_MIN else 1.0


def _timed(build, mask, shape, backend, options, platform: str, bkey):
    """``build()``, its wall time recorded against the rule's prediction for the mask (the
    plan's own policy says whether it gathered)."""
    t0 = time.perf_counter()
    p = build()
    ms = (time.perf_counter() - t0) * 1e3
    costs = tier_costs.costs_for(platform, backend, _ranking.device_name())
    size = None if costs is None else tier_costs.size_of(mask, shape, backend,
                                                         options.device_rule, bkey[1:])
    if size is not None:
        size = dataclasses.replace(size, gather=getattr(p, "policy", None) == "gather")
        predicted = tier_costs.predict(size, costs, True)[0]
        if predicted > 0:
            rkey = _ratio_key(mask, shape, backend)
            with _LOCK:
                r = _HOST_RATIOS.pop(rkey, None) or collections.deque(maxlen=_HOST_RATIOS_KEPT)
                r.append((time.monotonic(), ms / predicted))
                _HOST_RATIOS[rkey] = r                     # the newest last
                if len(_HOST_RATIOS) > _HOST_RATIOS_MAX:
                    _HOST_RATIOS.popitem(last=False)
                _COUNTS["timed"] += 1
    return p


#: Seconds the background plan lets pass after the device route's output is ready, so the
#: request's own thread (woken by the same event) takes the GIL first and returns.
_AFTER_OUTPUT_S = 0.001


def _job(key, build, cache, entry: _Entry, after=None):
    """The background plan: made once ``after`` (the device route's output) is ready, then
    put in the front cache unless ``clear`` ran since; its outcome set on ``entry.future``
    (made by the call that submitted it)."""
    if not entry.future.set_running_or_notify_cancel():       # cleared before it started
        return
    if after is not None:
        try:
            jax.block_until_ready(after)         # releases the GIL while the kernels run
        except Exception:  # noqa: BLE001 -- a deleted (donated) output: plan now
            pass
        time.sleep(_AFTER_OUTPUT_S)
    try:
        p = build()
    except BaseException as exc:
        with _LOCK:
            _COUNTS["failed"] += 1
        entry.future.set_exception(exc)
        return
    with _LOCK:
        if entry.gen == _GEN:
            cache.put(key, p)
            if _PENDING.get(key) is entry:
                del _PENDING[key]
            entry.leaves = None
            _COUNTS["published"] += 1
    entry.future.set_result(p)


def wait_for(key):
    """The background plan of ``key`` once made (waiting for it), or None: none pending.
    Raises its exception if it failed (and forgets it)."""
    with _LOCK:
        e = _PENDING.get(key)
    if e is None:
        return None
    try:
        return e.future.result()
    except concurrent.futures.CancelledError:
        return None
    except BaseException:
        with _LOCK:
            if _PENDING.get(key) is e:
                del _PENDING[key]
                _COUNTS["reraised"] += 1
        raise


def wait(timeout: float | None = None) -> bool:
    """Waits until no background plan runs (failed ones stay to be re-raised); True unless
    ``timeout`` (seconds) passed first. For benchmarks and tests."""
    with _LOCK:
        futs = [e.future for e in _PENDING.values()]
    _, not_done = concurrent.futures.wait(futs, timeout)
    return not not_done


def clear(fresh_process: bool = False) -> None:
    """Cancels the background plans not started, waits for running ones and drops them all
    (``tj.clear_caches``; the device route's prepared calls and the record of their
    executables stay, as jax keeps executables, unless ``fresh_process``: the calls hold
    template choices made from the ranking tables that it drops, and their executables go
    with them; so do the measured host planning times, facts of this machine)."""
    global _GEN
    with _LOCK:
        _GEN += 1
        entries = list(_PENDING.values())
        _PENDING.clear()
        _SEEN.clear()
        if fresh_process:                   # their executables go with them
            _HOST_RATIOS.clear()
            _COMPILED.difference_update(_PREPARED)
            _PREPARED.clear()
    # A cancelled plan never runs (its job returns at once), whether or not it was submitted
    # yet; only running ones are waited for.
    concurrent.futures.wait([e.future for e in entries if not e.future.cancel()])


def pending() -> int:
    """Background plans running or failed and not re-raised yet."""
    with _LOCK:
        return len(_PENDING)


def stats() -> dict:
    """Counts since the process started: calls that ran the device route, background plans
    started / published / failed / re-raised, device-route calls that started no plan
    (deferred: an earlier call than ``host_plan_from_call``), calls the rule sent to the host
    plan (declined), host plans timed for the rule's measured scale (timed)."""
    with _LOCK:
        return dict(_COUNTS)
