"""Public entry points: plan(...) and sparse_attention(...)."""

from __future__ import annotations

import collections
import functools

import numpy as np

from tessera_jax.runtime import dispatch as backends

from tessera_jax.runtime import dense_route
from tessera_jax.mask import BlockMask
from tessera_jax.planning.planner import Plan, build_plan
from tessera_jax.validation import check_bool, check_mask, check_qkv, check_scale, check_shapes


@functools.cache
def _selector():
    """The offline-profiled ranking's ``select`` if that module exists, else None."""
    try:
        from tessera_jax.select.ranking import select
    except ImportError:
        return None
    return select


def _choose_template(mask: BlockMask, shape, backend: str) -> tuple[str, str]:
    """(template, policy) for a request; the ranking tables refine this when present."""
    select = _selector()
    if select is not None:
        choice = select(mask, shape, backend)
        if choice is not None:
            return choice
    supported = backends.supported_templates(backend, shape)
    default = backends.DEFAULT_TEMPLATE.get(backend)
    names = [t.name for t in supported]
    return (default if default in names else names[0]), "merge"


def plan(mask: BlockMask, q_shape, kv_shape, dtype, template: str | None = None,
         policy: str | None = None, backend: str | None = None) -> Plan:
    """The plan ``sparse_attention`` would run for these shapes (cached by mask digest).

    One exception: an all-selected mask that ``sparse_attention`` sends to cuDNN
    (``dense_route``: GPU, backend/policy/template left to choose, no LSE) still gets the plan
    the kernels would run here, but none runs then.
    """
    try:
        key = (mask, tuple(q_shape), tuple(kv_shape), np.dtype(dtype), template, policy, backend)
        hash(key)
    except TypeError:
        key = None  # unhashable input: let the checks below say what is wrong
    if key is not None:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            return hit
    p = _plan(mask, q_shape, kv_shape, dtype, template, policy, backend)
    if key is not None:
        _remember(key, p)
    return p


# Front cache of finished plans, keyed by mask digest and call: a hit skips every check
# (they passed when the entry was made) and costs a dict look-up. Least recently used plans
# are dropped past _MAX_PLANS entries or _MAX_PLAN_BYTES of plan arrays (a 40-head Wan 720p
# plan can hold tens of MB).
_PLANS: collections.OrderedDict = collections.OrderedDict()
_MAX_PLANS = 256
_MAX_PLAN_BYTES = 1 << 30


def _plan_bytes(p: Plan) -> int:
    """Host bytes a cached plan keeps alive: its arrays and the mask it holds."""
    mask = getattr(p, "mask", None)
    ri = vars(p).get("row_index")       # made on first use only (Plan.row_index)
    return int(p.units.nbytes + p.steps.nbytes + (ri.nbytes if ri is not None else 0)
               + (mask.blocks.nbytes if mask is not None else 0))


def _remember(key, p: Plan) -> None:
    _PLANS[key] = p
    total = sum(_plan_bytes(x) for x in _PLANS.values())
    while len(_PLANS) > 1 and (len(_PLANS) > _MAX_PLANS or total > _MAX_PLAN_BYTES):
        _, old = _PLANS.popitem(last=False)
        total -= _plan_bytes(old)


def _plan(mask, q_shape, kv_shape, dtype, template, policy, backend) -> Plan:
    shape = check_shapes(q_shape, kv_shape, dtype)
    check_mask(mask, shape)
    if template is None:
        be = backends.resolve(backend, shape)
        template, default_policy = _choose_template(mask, shape, be)
        policy = policy or default_policy
    t = backends.get_template(template)
    why = backends.unsupported(t, shape)
    if why:
        raise ValueError(f"template {template!r} can't take this call: {why}")
    return build_plan(mask, q_shape, kv_shape, dtype, tile_q=t.tile_q, tile_kv=t.tile_kv,
                      policy=policy or "merge", q_align=t.q_align, kv_align=t.kv_align,
                      template=t.name)


def sparse_attention(q, k, v, mask: BlockMask, *, scale=None, return_lse=False, backend=None,
                     template: str | None = None, policy: str | None = None):
    """Attention restricted to the mask's selected blocks.

    q: [B, Lq, Hq, D]; k, v: [B, Lkv, Hkv, D] with Hq % Hkv == 0. Returns out [B, Lq, Hq, D] in
    q.dtype, and lse [B, Hq, Lq] (float32, natural log) when ``return_lse``. A query with no
    selected key gives 0 and lse -inf. ``backend`` is "mosaic_gpu", "triton", "xla" or None (the
    best available here). Planning is host NumPy at trace time, so under ``jax.jit`` the mask
    must be a static (closure or static-argument) value. A mask that selects everything runs
    cuDNN's dense attention instead when the backend is left to choose (a GPU), no LSE is asked
    for and no ``policy`` is given (``dense_route``).
    """
    shape = check_qkv(q, k, v)
    check_mask(mask, shape)
    scale = check_scale(scale, shape.head_dim)
    return_lse = check_bool("return_lse", return_lse)
    if template is not None:
        t = backends.get_template(template)
        if backend is not None and backend != t.backend:
            raise ValueError(f"template {template!r} belongs to backend {t.backend!r}, "
                             f"not {backend!r}")
        backends.resolve(t.backend, shape)
    else:
        auto = backend is None and policy is None
        backend = backends.resolve(backend, shape)
        if auto and dense_route.takes(mask, shape, backend, return_lse):
            try:
                return dense_route.attention(q, k, v, scale)
            except (NotImplementedError, ValueError) as e:   # cuDNN refused this call
                dense_route.warn_fallback(e)
    p = plan(mask, q.shape, k.shape, q.dtype, template=template, policy=policy, backend=backend)
    return backends.run(p, q, k, v, scale, return_lse)


def enable_compilation_cache(path: str, min_compile_time_secs: float = 0.0) -> None:
    """Turns on jax's persistent compilation cache at ``path`` (executables survive restarts)."""
    import jax
    if not isinstance(path, str) or not path:
        raise TypeError(f"path must be a non-empty str, got {path!r}")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def precompile(masks, q_shape, kv_shape, dtype, *, backend=None, return_lse=False,
               scale=None) -> list[Plan]:
    """Plans every mask and compiles the executables they need, off the request path.

    One executable per distinct (template, capacity bucket); with
    ``enable_compilation_cache`` they are also stored on disk for later processes. Returns the
    plans.
    """
    import jax
    import jax.numpy as jnp
    if isinstance(masks, BlockMask):
        masks = [masks]
    masks = list(masks)
    for i, m in enumerate(masks):
        if not isinstance(m, BlockMask):
            raise TypeError(f"masks[{i}] must be a BlockMask, got {type(m).__name__}")
    shape = check_shapes(q_shape, kv_shape, dtype)
    q = jnp.zeros(tuple(q_shape), shape.dtype)
    k = jnp.zeros(tuple(kv_shape), shape.dtype)
    plans, seen = [], set()
    for m in masks:
        p = plan(m, q_shape, kv_shape, dtype, backend=backend)
        plans.append(p)
        key = (p.template, p.capacities)
        if key not in seen:
            seen.add(key)
            jax.block_until_ready(sparse_attention(q, k, k, m, backend=backend, scale=scale,
                                                   return_lse=return_lse))
    return plans
