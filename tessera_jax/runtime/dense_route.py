"""All-selected masks go to cuDNN's fused dense attention: nothing to plan, copy or gather.

A mask that selects every block of every head is plain attention. On a GPU, when the backend is
chosen automatically and no LSE is asked for, ``sparse_attention`` runs it with
``jax.nn.dot_product_attention(implementation="cudnn")``: the request then costs one dense
call (on the H200, a text-only dense mask took 2.0 ms through the planner against 0.6 ms for
cuDNN, all of the difference host work). Explicit ``backend``/``template``/``policy`` arguments
keep the planned path. A device mask's blocks are known only inside the program: there the
device route tests them (``on_device``, ``fused``: one ``lax.cond`` on ``all(blocks)``) and
runs cuDNN when every block is selected, its plan otherwise.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.runtime.kernel_runner import tracing

GPU_BACKENDS = ("mosaic_gpu", "triton")
_DTYPES = ("bfloat16", "float16")
_MAX_HEAD_DIM = 128


_ALL_SELECTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def all_selected(mask: BlockMask) -> bool:
    """Whether the mask selects every block of every head (kept per mask object, weakly:
    counting a 40-head Wan 720p mask's bits takes a fraction of a ms)."""
    try:
        return _ALL_SELECTED[mask]
    except KeyError:
        res = _ALL_SELECTED[mask] = mask.selects_all()    # on the packed bits
        return res


def eligible(shape, backend: str, return_lse: bool) -> bool:
    """Whether a call of these shapes may run on cuDNN when its mask selects everything: a GPU
    backend, no LSE, and a dtype/head_dim cuDNN's flash attention takes."""
    return (not return_lse and backend in GPU_BACKENDS       # available: a CUDA GPU, cc >= 8
            and np.dtype(shape.dtype).name in _DTYPES
            and shape.head_dim <= _MAX_HEAD_DIM and shape.head_dim % 8 == 0)


def takes(mask: BlockMask, shape, backend: str, return_lse: bool) -> bool:
    """Whether this call on a static mask runs on cuDNN: ``eligible`` and all selected."""
    return eligible(shape, backend, return_lse) and all_selected(mask)


def on_device(q, k, v, shape, backend: str, return_lse: bool, scale: float) -> str | None:
    """The implementation a device-route call's all-selected test runs ("cudnn"), or None where
    cuDNN would not take the call: the route then has no such test. ``q, k, v`` may be tracers
    (only shapes and dtypes are read)."""
    if not eligible(shape, backend, return_lse):
        return None
    return None if isinstance(_verdict(q, k, v, scale), Exception) else "cudnn"


def fused(q, k, v, scale: float, implementation: str = "cudnn"):
    """out of ``jax.nn.dot_product_attention`` with this implementation, traced into the
    caller's program (the device route's branch for all-selected blocks)."""
    return _dense_fn(implementation)(q, k, v, scale=scale)


@functools.cache
def _dense_fn(implementation: str = "cudnn"):
    import jax
    return jax.jit(functools.partial(jax.nn.dot_product_attention,
                                     implementation=implementation), static_argnames=("scale",))


# (q, k, v shapes and dtypes, scale) -> the compiled call, or the error that refused it. Compiled
# once ahead of time, so a refusal at compile time (not only jax's trace-time shape checks)
# falls back to the planned path, under a caller's jit too; eager calls run that executable.
_VERDICTS: dict = {}


def _verdict(q, k, v, scale: float):
    import jax
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype, scale)
    if key not in _VERDICTS:
        try:
            args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
            _VERDICTS[key] = _dense_fn().lower(*args, scale=scale).compile()
        except Exception as e:  # noqa: BLE001  (cuDNN missing, shape refused, compile error)
            _VERDICTS[key] = e
    return _VERDICTS[key]


def attention(q, k, v, scale: float):
    """out [B, Lq, Hq, D]: cuDNN fused attention over all keys (GQA by K/V head groups).
    Raises NotImplementedError (with cuDNN's error) where this call does not compile."""
    got = _verdict(q, k, v, scale)
    if isinstance(got, Exception):
        raise NotImplementedError(f"{type(got).__name__}: {got}") from got
    if tracing(q, k, v):
        return fused(q, k, v, scale)                    # inlined into the caller's program
    return got(q, k, v)


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
