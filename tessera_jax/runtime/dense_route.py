"""All-selected masks go to cuDNN's fused dense attention: nothing to plan, copy or gather.

A mask that selects every block of every head is plain attention. On a GPU, when the backend is
chosen automatically and no LSE is asked for, ``sparse_attention`` runs it with
``jax.nn.dot_product_attention(implementation="cudnn")``: the request then costs one dense
call (on the H200, a text-only dense mask took 2.0 ms through the planner against 0.6 ms for
cuDNN, all of the difference host work). Explicit ``backend``/``template``/``policy`` arguments
keep the planned path. A device mask cannot be read on the host: its program holds both the
device plan and the dense call, and a ``lax.cond`` on its blocks picks one
(``device_route.attention(..., dense=True)``).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import numpy as np

from tessera_jax.mask import BlockMask

GPU_BACKENDS = ("mosaic_gpu", "triton")
_DTYPES = ("bfloat16", "float16")
_MAX_HEAD_DIM = 128


_ALL_SELECTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def all_selected(mask: BlockMask) -> bool:
    """Whether the mask selects every block of every head (kept per mask object, weakly: the
    ``all`` over the flags stops at the first unselected block, but a 40-head Wan 720p mask
    that is all selected takes ~1 ms to check)."""
    try:
        return _ALL_SELECTED[mask]
    except KeyError:
        res = _ALL_SELECTED[mask] = bool(mask.blocks.all())
        return res


def may_take(shape, backend: str, return_lse: bool) -> bool:
    """Whether a call of this shape could run on cuDNN if its mask selects everything: a GPU
    backend, no LSE, and a dtype/head_dim cuDNN's flash attention takes."""
    return (not return_lse and backend in GPU_BACKENDS       # available: a CUDA GPU, cc >= 8
            and np.dtype(shape.dtype).name in _DTYPES
            and shape.head_dim <= _MAX_HEAD_DIM and shape.head_dim % 8 == 0)


def takes(mask: BlockMask, shape, backend: str, return_lse: bool) -> bool:
    """Whether this call runs on cuDNN: ``may_take`` and an all-selected mask."""
    return may_take(shape, backend, return_lse) and all_selected(mask)


@functools.cache
def _dense_fn(implementation: str = "cudnn"):
    import jax
    return jax.jit(functools.partial(jax.nn.dot_product_attention,
                                     implementation=implementation), static_argnames=("scale",))


# (q, k, v shapes and dtypes, scale) -> the compiled call, or the error that refused it. Compiled
# once ahead of time, so a refusal at compile time (not only jax's trace-time shape checks)
# falls back to the planned path, under a caller's jit too.
_VERDICTS: dict = {}


def _verdict(q, k, v, scale: float):
    import jax
    key = tuple((tuple(x.shape), str(x.dtype)) for x in (q, k, v)) + (scale,)
    if key not in _VERDICTS:
        try:
            args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
            _VERDICTS[key] = _dense_fn().lower(*args, scale=scale).compile()
        except Exception as e:  # noqa: BLE001  (cuDNN missing, shape refused, compile error)
            _VERDICTS[key] = e
    return _VERDICTS[key]


def compiles(q, k, v, scale: float) -> bool:
    """Whether cuDNN's dense call of these shapes compiles here (q, k, v may be tracers)."""
    return not isinstance(_verdict(q, k, v, scale), Exception)


def dense_call(q, k, v, scale: float):
    """cuDNN's dense attention, traced into the caller's program (``compiles`` first)."""
    return _dense_fn()(q, k, v, scale=scale)


def attention(q, k, v, scale: float):
    """out [B, Lq, Hq, D]: cuDNN fused attention over all keys (GQA by K/V head groups).
    Raises NotImplementedError (with cuDNN's error) where this call does not compile."""
    got = _verdict(q, k, v, scale)
    if isinstance(got, Exception):
        raise NotImplementedError(f"{type(got).__name__}: {got}") from got
    # The jitted function, also eagerly: its C++ dispatch is what a caller's own jitted call
    # pays (the AOT executable's call took ~0.07 ms more a request on the H100: dense text
    # rows in results/h100-peers.json); its first eager call per shape compiles it again.
    return _dense_fn()(q, k, v, scale=scale)


def clear_caches(*, verdicts: bool = False) -> None:
    """Forgets which masks are all selected and, with ``verdicts``, the compiled cuDNN calls
    and refusals per shape and the one-time fallback warning (``tessera_jax.clear_caches``)."""
    _ALL_SELECTED.clear()
    if verdicts:
        _VERDICTS.clear()
        warn_fallback._done = False


def warn_fallback(err: Exception) -> None:
    """One warning per process when cuDNN refuses a call the checks let through."""
    if not getattr(warn_fallback, "_done", False):
        warn_fallback._done = True
        warnings.warn(f"tessera_jax: cuDNN dense attention refused an all-selected mask "
                      f"({type(err).__name__}: {err}); planning it instead", stacklevel=3)
