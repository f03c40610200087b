"""The static table of backends: which implementations exist, which one takes a call, and how
a forward pass plan runs on it.

``BACKENDS`` lists them in priority order (``backend=None`` takes the first one available here
with a template for the call's head_dim and dtype):

* ``mosaic_gpu``: Hopper or newer (compute capability >= 9.0), ``pallas_kernels.mosaic.ops``;
* ``triton``: Ampere or newer (>= 8.0), ``pallas_kernels.triton.ops``;
* ``xla``: any device, ``pallas_kernels.xla.ops`` (plain JAX: the CPU/TPU path and the
  fallback).

Each entry names its family's contract module (``forward``, ``dq``, ``dkv`` over
``abi.PassPlan``s and the static facts: dk/dv tiles, first-order kernels, vmap folding, the
row-dot kernel), imported inside its functions (Mosaic GPU's imports are slow and absent on
CPU); nothing is imported by name or registered at import time. Templates (tile shapes and
kernel configurations) come from the static table ``pallas_kernels.templates``. The GPU
entries hand host plans to ``kernel_runner`` (device copies, trusted plans, traces).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from typing import Callable

import jax

from pallas_kernels import abi
from pallas_kernels import templates as _templates
from pallas_kernels.templates import Template

from tessera_jax.runtime import batching, kernel_runner
from tessera_jax.runtime.kernel_runner import tracing
from tessera_jax.validation import AttnShape

__all__ = ["Backend", "BACKENDS", "DEFAULT_TEMPLATE", "get_template", "templates", "unsupported",
           "supported_templates", "is_available", "resolve", "forward", "tracing",
           "clear_warnings", "gpu_capability"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation.

    name:    "mosaic_gpu" | "triton" | "xla" (templates name their backend)
    min_compute_capability: lowest (major, minor) CUDA GPU it runs on; None: any device
    ops:     imports and returns its contract module (``pallas_kernels.<family>.ops``;
             ImportError: not installed here)
    runner:  its eager host plans go through ``kernel_runner`` (device copies kept per plan)
    backward_rows: its dq / dk/dv kernels take a host plan's row maps as constants (else they
             make them from the units inside the program)
    """

    name: str
    min_compute_capability: tuple[int, int] | None
    ops: Callable[[], types.ModuleType]
    runner: bool = True
    backward_rows: bool = True

    def available(self) -> bool:
        """Whether this machine runs it: a GPU of the compute capability, the kernel module."""
        if self.min_compute_capability is not None:
            cc = _gpu_capability()
            if cc is None or cc < self.min_compute_capability:
                return False
        return _imports(self.ops)


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


def gpu_capability() -> tuple[int, int] | None:
    """(major, minor) of this process's first CUDA GPU, (0, 0) if unreadable, None without a
    GPU (a fact of the machine, read once): what picks a GPU kernel family where no backend is
    named (``masks.dynamic.common.kernel_family``)."""
    return _gpu_capability()


# --- the entries' contract modules ----------------------------------------------------------
def _mosaic_ops() -> types.ModuleType:
    from pallas_kernels.mosaic import ops
    return ops


def _triton_ops() -> types.ModuleType:
    from pallas_kernels.triton import ops
    return ops


def _xla_ops() -> types.ModuleType:
    from pallas_kernels.xla import ops
    return ops


#: The implementations, in priority order.
BACKENDS: "types.MappingProxyType[str, Backend]" = types.MappingProxyType({b.name: b for b in (
    Backend("mosaic_gpu", (9, 0), _mosaic_ops),
    Backend("triton", (8, 0), _triton_ops),
    Backend("xla", None, _xla_ops, runner=False, backward_rows=False),
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
        if any(unsupported(t, shape) is None for t in templates(name)):
            return name
        key = (name, shape.head_dim, str(shape.dtype))
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"tessera_jax: backend {name!r} can't take head_dim={shape.head_dim}, "
                          f"dtype={shape.dtype}; falling back to the next backend", stacklevel=3)
    raise ValueError(f"no backend available here has a template for head_dim="
                     f"{shape.head_dim}, dtype={shape.dtype}")


# --- running -------------------------------------------------------------------------------
def forward(plan: abi.PassPlan, template: Template, q, k, v, scale, return_lse, *,
            interpret=None):
    """out [B, Lq, Hq, D], and lse [B, Hq, Lq] with ``return_lse``, of the forward pass plan
    ``plan`` run with ``template`` on its backend. Eager host plans of the GPU backends go
    through ``kernel_runner``; under a trace a backend that folds vmap (Mosaic GPU: its kernel,
    ``mpmd_map``, has no batching rule of its own for TMA and barriers) runs once with the
    vmapped axis folded into the batch (``batching.fold_vmap``)."""
    be = BACKENDS[template.backend]
    ops = be.ops()
    call = functools.partial(kernel_runner.run if be.runner else _direct, ops, template=template,
                             scale=scale, return_lse=return_lse, interpret=interpret)
    if not (ops.FOLD_VMAP and tracing(q, k, v)):
        return call(plan, q, k, v)
    return batching.fold_vmap(lambda q, k, v, *a: call(batching.with_arrays(plan, a), q, k, v),
                              (q, k, v), batching.plan_arrays(plan))


def _direct(ops, plan, q, k, v, *, template, scale, return_lse, interpret):
    """The forward of a backend whose plans need no device copies (XLA: the executor's jitted
    call takes NumPy arrays as constants or operands as they come)."""
    return ops.forward(q, k, v, plan, template=template, scale=scale, return_lse=return_lse,
                       interpret=interpret)
