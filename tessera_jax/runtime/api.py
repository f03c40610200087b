"""Public entry points: ``sparse_attention``, ``plan``, ``precompile``, ``clear_caches`` and
``enable_compilation_cache``.

The way of a ``sparse_attention`` call, each stop once:

1. validation (``tessera_jax.validation``): q, k, v, mask, scale, return_lse, policy;
2. the target (``dispatch``): the backend, and the template when one is given;
3. the dense route (``dense_route``): an all-selected mask with nothing chosen by the caller
   runs cuDNN's dense attention on a GPU;
4. the plan (``_planned``): the front cache ``_PLANS``, else the host chooser
   (``host_plans.build``: template and policy from the ranking, ``select.ranking``, and the
   planner's ``build_unchecked``; nothing re-validated);
5. the run (``core.attention`` of ``host_plans.attention_plan``): the one custom_vjp, then the
   backend's contract module through ``dispatch.forward`` (``kernel_runner`` on a GPU).

A device mask (or per-head bounds) takes the device route instead (``device_route``: planned
inside the program, same core). With ``Options(host_planning="tiered")`` an eager call whose
host plan is not cached may take it too while step 4 runs on a background thread
(``tiered``, when ``tier_costs`` predicts that faster). ``Options`` carries what changes a
compiled computation; with ``Options.check_finite`` steps 3-5 run on q, k, v with non-finite
entries zeroed and the rows that select one are set to NaN (``finite``).

``plan`` takes steps 1, 2 and 4 for shapes instead of arrays, so it returns the very plan
``sparse_attention`` runs, and says when the dense route runs instead (``Plan.dense_route``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import threading

import numpy as np

from pallas_kernels import abi as plan_abi
from pallas_kernels.templates import Template

from tessera_jax.mask import BlockMask
from tessera_jax.planning import planner
from tessera_jax.planning.planner import POLICIES, Plan
from tessera_jax.planning import plan as plan_
from tessera_jax.runtime import (core, dense_route, device_route, dispatch, finite,
                                 host_plans, kernel_runner, tiered)
from tessera_jax.runtime.options import Options, check_options
from tessera_jax.select import device as select_device
from tessera_jax.select import features, ranking
from tessera_jax.validation import (AttnShape, check_bool, check_mask, check_qkv, check_scale,
                                    check_shapes)


def _check_policy(policy) -> None:
    if policy is not None and (not isinstance(policy, str) or policy not in POLICIES):
        raise ValueError(f"policy must be one of {POLICIES} or None, got {policy!r}")


def _target(shape: AttnShape, backend, template, *, runs_here: bool) -> tuple[str, Template | None]:
    """(backend, Template or None: chosen per mask) for a call; ``runs_here``: the template's
    backend must be available on this machine (``sparse_attention``; ``plan`` may plan for
    another machine's template)."""
    if template is None:
        return dispatch.resolve(backend, shape), None
    t = dispatch.get_template(template)
    if backend is not None and backend != t.backend:
        raise ValueError(f"template {template!r} belongs to backend {t.backend!r}, "
                         f"not {backend!r}")
    if runs_here:
        dispatch.resolve(t.backend, shape)
    why = dispatch.unsupported(t, shape)
    if why:
        raise ValueError(f"template {template!r} can't take this call: {why}")
    return t.backend, t


class PlanCache:
    """The front cache of finished plans, keyed by mask digest and request (the arguments as
    given): a hit skips template choice and planning and costs a dict look-up. Least recently
    used plans are dropped past ``max_plans`` entries or ``max_bytes`` of plan arrays (a
    40-head Wan 720p plan can hold tens of MB)."""

    def __init__(self, max_plans: int = 256, max_bytes: int = 1 << 30):
        self.max_plans, self.max_bytes = int(max_plans), int(max_bytes)
        self.plans: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()      # tiered planning puts plans from its worker

    def get(self, key) -> Plan | None:
        if key is None:
            return None
        with self._lock:
            hit = self.plans.get(key)
            if hit is not None:
                self.plans.move_to_end(key)
        return hit

    def put(self, key, p: Plan) -> None:
        with self._lock:
            self.plans[key] = p
            total = sum(_plan_bytes(x) for x in self.plans.values())
            while len(self.plans) > 1 and (len(self.plans) > self.max_plans
                                           or total > self.max_bytes):
                _, old = self.plans.popitem(last=False)
                total -= _plan_bytes(old)

    def clear(self) -> None:
        with self._lock:
            self.plans.clear()

    def __len__(self) -> int:
        return len(self.plans)

    def keys(self):
        with self._lock:
            return list(self.plans)


def _plan_bytes(p: Plan) -> int:
    """Host bytes a cached plan keeps alive: its arrays and the mask it holds."""
    mask = getattr(p, "mask", None)
    ri = vars(p).get("row_index")       # made on first use only (Plan.row_index)
    return int(p.units.nbytes + p.steps.nbytes + (ri.nbytes if ri is not None else 0)
               + (mask.blocks.nbytes if mask is not None else 0))


_PLANS = PlanCache()


def _key(mask, q_shape, kv_shape, dtype, template, policy, backend, planner_config):
    """The front cache's key of a request, or None when an argument is unhashable (the checks
    then say what is wrong)."""
    try:
        key = (mask, tuple(q_shape), tuple(kv_shape), np.dtype(dtype), template, policy, backend,
               planner_config)
        hash(key)
    except TypeError:
        return None
    return key


def _planned(key, mask: BlockMask, shape: AttnShape, backend: str, t: Template | None,
             policy: str | None, auto: bool, options: Options) -> Plan:
    """The plan of a validated request (``key`` from ``_key``, None: not cached; ``backend``
    resolved, ``t`` the caller's template or None, ``auto``: nothing chosen by the caller)."""
    hit = _PLANS.get(key)
    if hit is not None:
        return hit
    p = tiered.wait_for(key) if key is not None else None      # planning in the background
    if p is None:
        p = _plan_now(mask, shape, backend, t, policy, auto, options)
    if key is not None:
        _PLANS.put(key, p)
    return p


def _plan_now(mask: BlockMask, shape: AttnShape, backend: str, t: Template | None,
              policy: str | None, auto: bool, options: Options) -> Plan:
    """The host plan of a validated request, made now (``_planned``'s arguments)."""
    p = host_plans.build(mask, shape, backend, t, policy, options)
    # The planner's cached plan stays as is; the front cache's copy says how it was chosen.
    return dataclasses.replace(
        p, chosen_by=("the caller's template" if t is not None else
                      ranking.source(mask, shape, backend)) +
        (" and policy" if policy is not None else ""),
        dense_route=auto and dense_route.takes(mask, shape, backend, False))


def plan(mask: BlockMask, q_shape, kv_shape, dtype, template: str | None = None,
         policy: str | None = None, backend: str | None = None,
         options: Options | None = None) -> Plan:
    """The plan ``sparse_attention`` runs for a call of these shapes and arguments (cached by
    mask digest: the same object ``sparse_attention`` uses).

    ``template`` may belong to a backend this machine lacks (planning is host work). When
    ``sparse_attention`` would send the call to cuDNN instead (an all-selected mask on a GPU,
    with template, policy and backend left to choose and no LSE: ``dense_route``), the plan
    says so: ``Plan.dense_route`` is True and ``describe()`` starts with it; the plan is then
    what runs with ``return_lse=True`` or if cuDNN refuses the call.
    """
    options = check_options(options)
    key = _key(mask, q_shape, kv_shape, dtype, template, policy, backend, options.planner)
    hit = _PLANS.get(key)
    if hit is not None:
        return hit
    shape = check_shapes(q_shape, kv_shape, dtype)
    check_mask(mask, shape)
    if device_route.takes(mask):
        raise TypeError("tessera_jax.plan takes static masks with shared bounds (host "
                        "planning); a device mask, or per-head bounds, is planned inside the "
                        "call: tessera_jax.planning.device.plan_on_device gives that plan")
    _check_policy(policy)
    be, t = _target(shape, backend, template, runs_here=False)
    return _planned(key, mask, shape, be, t, policy,
                    template is None and policy is None and backend is None, options)


def sparse_attention(q, k, v, mask: BlockMask, *, scale=None, return_lse=False, backend=None,
                     template: str | None = None, policy: str | None = None,
                     options: Options | None = None):
    """Attention restricted to the mask's selected blocks.

    q: [B, Lq, Hq, D]; k, v: [B, Lkv, Hkv, D] with Hq % Hkv == 0. Returns out [B, Lq, Hq, D] in
    q.dtype, and lse [B, Hq, Lq] (float32, natural log) when ``return_lse``. A query with no
    selected key gives 0 and lse -inf. ``backend`` is "mosaic_gpu", "triton", "xla" or None (the
    best available here, ``dispatch.BACKENDS``). ``template`` names a kernel configuration
    (``pallas_kernels.templates``), None: chosen per mask by the ranking tables
    (``select.ranking``). ``policy`` (``planning.planner.POLICIES``), None: the ranking's
    choice, else the template's own ``policy``. A static mask (NumPy) is planned on the host
    once, before XLA compiles; a device mask (jax arrays: a jit argument, computed from q and
    k inside jit) or one with per-head bounds is planned inside the program
    (``runtime.device_route``: a static template per call site, ``policy`` does not apply,
    and masks the device plan can't hold run an exact XLA path). A mask that
    selects everything runs cuDNN's dense attention instead when the backend is left to
    choose (a GPU), no LSE is asked for and no ``template`` or ``policy`` is given
    (``dense_route``; ``plan(...).dense_route`` tells). Differentiable in reverse mode on every
    backend (out and lse): a dq pass over the plan and a dk/dv pass over the transposed mask's
    plan (``runtime.core``). ``options`` (``tessera_jax.Options``, None: the defaults): the
    settings that change what is computed or compiled (bitmap budget of device plans, dk/dv
    plan candidates, interpret mode, ``check_finite``, ``host_planning``); hashable, so a
    static argument of an enclosing jit. ``Options(host_planning="tiered")``: an eager call on
    a static mask whose host plan is not made yet may run the device route while the host
    plan is made in the background (``runtime.tiered``), when measured costs predict that
    faster (``runtime.tier_costs``); later calls run the host plan once it is ready.

    Non-finite inputs: by default a NaN or inf in k or v may reach rows that do not select it
    (the kernels compute whole tiles; 0 * NaN is NaN). With ``Options(check_finite=True)``
    keys a row does not select never reach it, on every backend and route: row i of head h
    is NaN (out and lse) exactly when it selects a key whose k or v holds a NaN or inf, or
    when its own q does and it selects any key; a row selecting nothing stays 0 / -inf; the
    rows set to NaN pass no gradient, so gradients stay finite. ``tj.reference_attention``
    follows that rule always. It costs a read and write of q, k, v and out
    (benchmarks/NOTES.md#inputs).
    """
    shape = check_qkv(q, k, v)
    check_mask(mask, shape)
    scale = check_scale(scale, shape.head_dim)
    return_lse = check_bool("return_lse", return_lse)
    _check_policy(policy)
    options = check_options(options)
    be, t = _target(shape, backend, template, runs_here=True)
    if device_route.takes(mask) and policy is not None:
        raise ValueError("policy applies to host plans only; a device mask (or per-head "
                         f"bounds) has one device plan, got policy={policy!r}")
    route = functools.partial(_route, mask=mask, shape=shape, backend=be, t=t, scale=scale,
                              return_lse=return_lse, options=options,
                              asked=(template, policy, backend))
    if options.check_finite:
        return finite.attention(route, q, k, v, mask, return_lse)
    return route(q, k, v)


def _route(q, k, v, *, mask: BlockMask, shape: AttnShape, backend: str, t: Template | None,
           scale: float, return_lse: bool, options: Options, asked: tuple):
    """A validated call on its route: the device route, cuDNN's dense attention, or the host
    plan on the core (``backend`` resolved; ``asked``: template, policy, backend as given)."""
    template, policy, asked_backend = asked
    auto = template is None and policy is None and asked_backend is None
    # A static all-selected mask (per-head bounds too) runs cuDNN; a device mask's blocks are
    # tested inside the device route's program.
    if auto and mask.is_static and dense_route.takes(mask, shape, backend, return_lse):
        try:
            return dense_route.attention(q, k, v, scale)
        except (NotImplementedError, ValueError) as e:   # cuDNN refused this call
            dense_route.warn_fallback(e)
    if device_route.takes(mask):
        dense = (dense_route.on_device(q, k, v, shape, backend, return_lse, scale)
                 if auto and not mask.is_static else None)
        return device_route.attention(q, k, v, mask, shape, backend, t, scale, return_lse,
                                      options, dense=dense)
    key = (mask, tuple(q.shape), tuple(k.shape), shape.dtype, template, policy, asked_backend,
           options.planner)
    if template is None and policy is None and _PLANS.get(key) is None \
            and not kernel_runner.tracing(q, k, v) and tiered.mode(options, q) != "sync":
        out = tiered.attention(q, k, v, key=key, mask=mask, shape=shape, backend=backend,
                               scale=scale, return_lse=return_lse, options=options,
                               build=functools.partial(_plan_now, mask, shape, backend, t,
                                                       policy, auto, options),
                               cache=_PLANS)
        if out is not None:
            return out
    p = _planned(key, mask, shape, backend, t, policy, auto, options)
    return core.attention(q, k, v, host_plans.attention_plan(p, options), scale, return_lse,
                          options)


def clear_caches(*, fresh_process: bool = False) -> None:
    """Forgets what earlier calls computed from their masks, so that the next call on any mask
    costs what a request on a new mask costs (benchmarks call it between requests).

    Cleared: the background plans of ``Options(host_planning="tiered")`` (``runtime.tiered``:
    those not started are cancelled, running ones awaited and dropped); the front plan cache
    (``runtime.api._PLANS``) and the planner's plan cache;
    mask features and block layouts (``select.features``); the ranking's choices per mask
    (``select.ranking``); which masks are all selected (``runtime.dense_route``); the kernel
    runner's prepared plans: mask modes and device copies (``runtime.kernel_runner``); the
    device route's template choices per static bounds (``select.device``); the
    host pass plans (``planning.plan``), the dk/dv host plans (``runtime.host_plans``) and the
    plans' token-major row and unit indices (``pallas_kernels.abi.host_cached``); the device
    copies of static masks that ``Options.check_finite`` keeps (``runtime.finite``); the
    per-device masks and plans of ``tessera_jax.parallel``.

    Kept, unless ``fresh_process``: what a process computes once, whatever the masks: the
    loaded ranking tables and which table this GPU uses, the compiled cuDNN dense calls (and
    refusals) per shape, the tiered device route's prepared calls (``runtime.tiered``: their
    template choices came from the tables) and its measured host planning times, and the
    one-time warnings. ``fresh_process=True``
    clears those too.
    Never cleared: jax's compiled executables (``jax.clear_caches()``) and the device facts
    (GPU model, compute capability).
    """
    fresh_process = check_bool("fresh_process", fresh_process)
    tiered.clear(fresh_process)  # first: no background plan may fill a cache cleared below
    _PLANS.clear()
    planner.clear_cache()
    features.clear_cache()
    ranking.clear_caches(tables=fresh_process)
    dense_route.clear_caches(verdicts=fresh_process)
    kernel_runner.clear_cache()
    select_device.clear_cache()
    plan_.clear_cache()
    host_plans.clear_cache()
    finite.clear_cache()
    plan_abi.clear_host_cache()
    par = sys.modules.get("tessera_jax.parallel.local")       # only if it was imported
    if par is not None:
        par.clear_caches()
    if fresh_process:
        dispatch.clear_warnings()


def enable_compilation_cache(path: str, min_compile_time_secs: float = 0.0) -> None:
    """Turns on jax's persistent compilation cache at ``path`` (executables survive restarts)."""
    import jax
    if not isinstance(path, str) or not path:
        raise TypeError(f"path must be a non-empty str, got {path!r}")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def precompile(masks, q_shape, kv_shape, dtype, *, backend=None, return_lse=False,
               scale=None, options: Options | None = None,
               tiered_routes=tiered.TIERED_ROUTES) -> list[Plan]:
    """Plans every mask and compiles the executables they need, off the request path.

    One executable per distinct (template, capacity bucket); with
    ``enable_compilation_cache`` they are also stored on disk for later processes. Where
    eager calls tier (``Options.host_planning`` "tiered", or "auto" on a GPU: the default)
    also the device route's executable per mask shape that tiered calls run (its rule counts
    a compile, ~16 s on an H100, for shapes not compiled yet, so a new mask of a shape never
    precompiled plans on the host); ``Options(host_planning="sync")`` skips it.
    ``tiered_routes``: which of those routes, "traced" (bounds traced: any mask of these
    shapes, as content-dependent bounds need) and "static" (each mask's own bounds: new masks
    of a fixed grid); a server whose masks keep their bounds can name "static" alone (the
    traced route decides its fit on the device, a larger program: both took 33-43 s to
    compile on an H100 for a new Wan 480p shape). Both kinds of q, k, v are served without a
    compile: arrays committed to a device (DLPack, ``jax.device_put(x, device)``, whatever is
    computed from them) and uncommitted ones, which ``jax.jit`` compiles apart (the host
    plans' calls are compiled for both, the device route's once ahead of time). The host
    planner's compiled loops are made ready too (``planner.loops_ready``): a process's plans
    before them run the NumPy tier, 3-25x slower (a Wan 720p DiTFastAttn plan 10 ms against
    2, CPU box). Returns the plans.
    """
    import jax
    import jax.numpy as jnp
    if isinstance(masks, BlockMask):
        masks = [masks]
    masks = list(masks)
    for i, m in enumerate(masks):
        if not isinstance(m, BlockMask):
            raise TypeError(f"masks[{i}] must be a BlockMask, got {type(m).__name__}")
    if not isinstance(tiered_routes, (tuple, list)) or not tiered_routes or any(
            r not in tiered.TIERED_ROUTES for r in tiered_routes):
        raise ValueError(f"tiered_routes must be a non-empty tuple of {tiered.TIERED_ROUTES}, "
                         f"got {tiered_routes!r}")
    shape = check_shapes(q_shape, kv_shape, dtype)
    options = check_options(options)
    planner.loops_ready(options.planner)
    q = jnp.zeros(tuple(q_shape), shape.dtype)
    k = jnp.zeros(tuple(kv_shape), shape.dtype)
    # jit's cache compiles arrays committed to a device (DLPack, device_put(x, device), what
    # is computed from them) apart from uncommitted ones: the host plans' calls run both
    committed = tuple(jax.device_put(x, next(iter(x.devices()))) for x in (q, k))
    host = dataclasses.replace(options, host_planning="sync")     # the host plan's executable
    plans, seen = [], set()
    for m in masks:
        p = plan(m, q_shape, kv_shape, dtype, backend=backend, options=options)
        plans.append(p)
        key = (p.template, p.capacities)
        if key not in seen:
            seen.add(key)
            for a, b in ((q, k), committed):
                jax.block_until_ready(sparse_attention(a, b, b, m, backend=backend, scale=scale,
                                                       options=host, return_lse=return_lse))
    if tiered.mode(options, q) != "sync":
        be = dispatch.resolve(backend, shape)
        sc = check_scale(scale, shape.head_dim)
        for m in {tiered.bounds_key(m): m for m in masks
                  if not device_route.takes(m)}.values():
            tiered.precompile(q, k, k, mask=m, shape=shape, backend=be, scale=sc,
                              return_lse=bool(return_lse), options=options,
                              routes=tuple(tiered_routes))
    return plans
