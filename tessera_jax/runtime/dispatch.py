"""The static table of backends: which implementations exist, which one takes a call, and how
a plan runs on it.

``BACKENDS`` lists them in priority order (``backend=None`` takes the first one available here
with a template for the call's head_dim and dtype):

* ``mosaic_gpu``: Hopper or newer (compute capability >= 9.0), ``pallas_kernels.mosaic.wrapper``;
* ``triton``: Ampere or newer (>= 8.0), ``pallas_kernels.triton.wrapper``;
* ``xla``: any device, ``pallas_kernels.xla.executor`` (plain JAX: the CPU/TPU path and the
  fallback).

Templates (tile shapes and kernel configurations) come from the static table
``pallas_kernels.templates``. Each entry imports its kernel module with a plain ``from ...
import`` inside its functions (Mosaic GPU's imports are slow and absent on CPU); nothing is
imported by name or registered at import time. The GPU entries hand the plan to
``kernel_runner`` (device copies, trusted plans, traces).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from typing import Callable

import jax

from pallas_kernels import templates as _templates
from pallas_kernels.templates import Template
from pallas_kernels.xla import executor as _xla

from tessera_jax.runtime import kernel_runner
from tessera_jax.runtime.kernel_runner import tracing
from tessera_jax.validation import AttnShape

__all__ = ["Backend", "BACKENDS", "DEFAULT_TEMPLATE", "get_template", "templates", "unsupported",
           "supported_templates", "is_available", "resolve", "run", "tracing", "clear_warnings"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation.

    name:    "mosaic_gpu" | "triton" | "xla" (templates name their backend)
    min_compute_capability: lowest (major, minor) CUDA GPU it runs on; None: any device
    run:     run(plan, template, q, k, v, scale, return_lse) -> out, or (out, lse)
    kernel:  imports and returns the kernel module (ImportError: not installed here); None
             when ``run`` needs no module beyond those imported with this one
    """

    name: str
    min_compute_capability: tuple[int, int] | None
    run: Callable
    kernel: Callable[[], types.ModuleType] | None = None

    def available(self) -> bool:
        """Whether this machine runs it: a GPU of the compute capability, the kernel module."""
        if self.min_compute_capability is not None:
            cc = _gpu_capability()
            if cc is None or cc < self.min_compute_capability:
                return False
        return self.kernel is None or _imports(self.kernel)


@functools.cache
def _imports(kernel: Callable[[], types.ModuleType]) -> bool:
    """Whether the kernel module imports here (a fact of the installation: asked once)."""
    try:
        kernel()
    except ImportError:
        return False
    return True


@functools.cache
def _gpu_capability() -> tuple[int, int] | None:
    """(major, minor) of the first CUDA GPU, (0, 0) if unreadable, None without a GPU."""
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    if not devs:
        return None
    cc = getattr(devs[0], "compute_capability", None)
    try:
        major, minor = (int(x) for x in str(cc).split("."))
    except (TypeError, ValueError):
        return (0, 0)
    return (major, minor)


# --- the entries' functions ----------------------------------------------------------------
def _mosaic_kernel() -> types.ModuleType:
    from pallas_kernels.mosaic import wrapper
    return wrapper


def _triton_kernel() -> types.ModuleType:
    from pallas_kernels.triton import wrapper
    return wrapper


def _run_mosaic(plan, template, q, k, v, scale, return_lse):
    if not tracing(q, k, v):
        return kernel_runner.run(_mosaic_kernel(), plan, template, q, k, v, scale, return_lse)
    # Traced (vmap among the traces): the vmapped axis is folded into the batch, the kernel
    # (mpmd_map) has no batching rule of its own for TMA and barriers.
    from tessera_jax.runtime import batching

    def call(q, k, v, *arrays):
        return kernel_runner.run(_mosaic_kernel(), batching.with_arrays(plan, arrays), template,
                                 q, k, v, scale, return_lse)

    return batching.fold_vmap(call, (q, k, v), batching.plan_arrays(plan))


def _run_triton(plan, template, q, k, v, scale, return_lse):
    return kernel_runner.run(_triton_kernel(), plan, template, q, k, v, scale, return_lse)


def _run_xla(plan, template, q, k, v, scale, return_lse):
    # Eagerly the executor makes row_index from units (nothing to build or copy); under a
    # trace the host array is a constant of the caller's program.
    traced = tracing(q, k, v, plan.units)
    return _xla.execute(
        q, k, v, plan.units, plan.steps, plan.row_index if traced else None, tile_q=plan.tile_q,
        tile_kv=plan.tile_kv, q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded,
        max_steps=plan.max_steps, scale=scale, return_lse=return_lse)


#: The implementations, in priority order.
BACKENDS: "types.MappingProxyType[str, Backend]" = types.MappingProxyType({b.name: b for b in (
    Backend("mosaic_gpu", (9, 0), _run_mosaic, _mosaic_kernel),
    Backend("triton", (8, 0), _run_triton, _triton_kernel),
    Backend("xla", None, _run_xla),
)})
#: A backend's template when no ranking table has an opinion (else its first that takes the call).
DEFAULT_TEMPLATE = types.MappingProxyType({"xla": "xla_64x64"})


# --- templates -----------------------------------------------------------------------------
def get_template(name: str) -> Template:
    """The template of this name (TypeError for a non-str, ValueError for an unknown name)."""
    if not isinstance(name, str):
        raise TypeError(f"template must be a template name (str), got {type(name).__name__}")
    try:
        return _templates.get(name)
    except (KeyError, ValueError):
        known = sorted(t.name for t in _templates.all_templates())
        raise ValueError(f"unknown template {name!r}; known: {known}") from None


def templates(backend: str | None = None) -> list[Template]:
    """Every template, or those of one backend."""
    return list(_templates.all_templates() if backend is None
                else _templates.for_backend(backend))


def unsupported(t: Template, shape: AttnShape) -> str | None:
    """Why template ``t`` can't take the call, or None."""
    if not t.supports(shape.head_dim, shape.dtype):
        return (f"{t.name} takes head_dim {_dims(t.head_dims)} and dtypes {t.dtypes}, "
                f"not head_dim={shape.head_dim}, dtype={shape.dtype}")
    return None


def _dims(dims: tuple[int, ...]) -> str:
    """A template's head dims for a message: "any", "in (64, 128)" or "in 129..256"."""
    if not dims:
        return "any"
    if len(dims) > 2 and tuple(dims) == tuple(range(dims[0], dims[0] + len(dims))):
        return f"in {dims[0]}..{dims[-1]}"
    return f"in {tuple(dims)}"


def supported_templates(backend: str, shape: AttnShape) -> list[Template]:
    return [t for t in templates(backend) if unsupported(t, shape) is None]


# --- which backend -------------------------------------------------------------------------
def _check_name(backend) -> Backend:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    try:
        return BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)} or None, "
                         f"got {backend!r}") from None


def is_available(backend: str) -> bool:
    """Whether ``backend`` (a name of ``BACKENDS``) runs on this machine."""
    return _check_name(backend).available()


_warned: set = set()


def clear_warnings() -> None:
    """Gives the one-time fallback warnings again (``tessera_jax.clear_caches``)."""
    _warned.clear()


def resolve(backend: str | None, shape: AttnShape) -> str:
    """The backend to run: an explicit one must exist here and have a template for the call;
    None takes the first of ``BACKENDS`` that does (a warning names each one skipped for
    head_dim or dtype)."""
    if backend is not None:
        be = _check_name(backend)
        if not be.available():
            raise ValueError(f"backend {backend!r} is not available on this machine "
                             f"({jax.default_backend()})")
        if not supported_templates(backend, shape):
            reasons = {t.name: unsupported(t, shape) for t in templates(backend)}
            raise ValueError(f"backend {backend!r} can't take this call: {reasons}")
        return backend
    for name, be in BACKENDS.items():
        if not be.available():
            continue
        if supported_templates(name, shape):
            return name
        key = (name, shape.head_dim, str(shape.dtype))
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"tessera_jax: backend {name!r} can't take head_dim={shape.head_dim}, "
                          f"dtype={shape.dtype}; falling back to the next backend", stacklevel=3)
    raise ValueError(f"no backend available here has a template for head_dim="
                     f"{shape.head_dim}, dtype={shape.dtype}")


# --- running -------------------------------------------------------------------------------
def run(plan, q, k, v, scale, return_lse):
    """Runs ``plan`` (a ``Plan``, or a plan-like namespace of its fields) on its template's
    backend: out [B, Lq, Hq, D], and lse [B, Hq, Lq] with ``return_lse``."""
    t = get_template(plan.template)
    return BACKENDS[t.backend].run(plan, t, q, k, v, scale, return_lse)
