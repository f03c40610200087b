"""Backends and their templates: which executors exist here and how a plan is run on each.

A *template* is a kernel configuration the planner can target (tile shape, alignment, kernel
parameters). Kernel modules register their templates here; the planner only reads tile shapes
and alignments, the kernels only read ABI arrays.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import jax

from pallas_kernels import templates as _tpl
from pallas_kernels.templates import BACKENDS, Template

from tessera_jax.validation import AttnShape


_RUNNERS: dict[str, Callable] = {}
_AVAILABLE: dict[str, Callable[[], bool]] = {}


def register_backend(name: str, runner: Callable, available: Callable[[], bool]) -> None:
    """runner(plan, template, q, k, v, scale, return_lse) -> out or (out, lse)."""
    _RUNNERS[name] = runner
    _AVAILABLE[name] = available


def templates(backend: str | None = None) -> list[Template]:
    _load_kernel_backends()
    return list(_tpl.all_templates() if backend is None else _tpl.for_backend(backend))


def get_template(name: str) -> Template:
    _load_kernel_backends()
    if not isinstance(name, str):
        raise TypeError(f"template must be a template name (str), got {type(name).__name__}")
    return _tpl.get(name)


def unsupported(t: Template, shape: AttnShape) -> str | None:
    """Why template ``t`` can't take the call, or None."""
    if not t.supports(shape.head_dim, shape.dtype):
        return (f"{t.name} takes head_dim in {t.head_dims or 'any'} and dtypes {t.dtypes}, "
                f"not head_dim={shape.head_dim}, dtype={shape.dtype}")
    return None


def is_available(backend: str) -> bool:
    _load_kernel_backends()
    return backend in _AVAILABLE and _AVAILABLE[backend]()


def supported_templates(backend: str, shape: AttnShape) -> list[Template]:
    return [t for t in templates(backend) if unsupported(t, shape) is None]


_warned: set = set()


def resolve(backend: str | None, shape: AttnShape) -> str:
    """The backend to run: an explicit one must exist here and take the call."""
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        if not is_available(backend):
            raise ValueError(f"backend {backend!r} is not available on this machine "
                             f"({jax.default_backend()})")
        if not supported_templates(backend, shape):
            reasons = {t.name: unsupported(t, shape) for t in templates(backend)}
            raise ValueError(f"backend {backend!r} can't take this call: {reasons}")
        return backend
    for name in BACKENDS:
        if not is_available(name):
            continue
        if supported_templates(name, shape):
            return name
        key = (name, shape.head_dim, str(shape.dtype))
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"tessera_jax: backend {name!r} can't take head_dim={shape.head_dim}, "
                          f"dtype={shape.dtype}; falling back to the next backend", stacklevel=3)
    raise ValueError("no backend can take this call")  # unreachable: xla takes everything


def tracing(*xs) -> bool:
    """Whether this call is being traced: a traced operand, or concrete ones inside a trace
    (q closed over by a jit, grad over k/v only). Device arrays made now would be tracers, and a
    cached one would leak into later eager calls."""
    from jax._src import core as _core      # trace_state_clean has no public name in jax 0.11
    return any(isinstance(x, jax.core.Tracer) for x in xs) or not _core.trace_state_clean()


def run(plan, q, k, v, scale, return_lse):
    t = get_template(plan.template)
    return _RUNNERS[t.backend](plan, t, q, k, v, scale, return_lse)


@functools.cache
def _load_kernel_backends() -> None:
    """Imports the optional kernel backends (they register themselves)."""
    import importlib
    for mod in ("tessera_jax.runtime.kernel_runner",):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass


# --- the XLA backend --------------------------------------------------------------------
def _run_xla(plan, template, q, k, v, scale, return_lse):
    from pallas_kernels.xla import executor as xla_backend
    # Eagerly the executor makes row_index from units (nothing to build or copy); under a
    # trace the host array is a constant of the caller's program.
    traced = tracing(q, k, v, plan.units)
    return xla_backend.execute(
        q, k, v, plan.units, plan.steps, plan.row_index if traced else None, tile_q=plan.tile_q,
        tile_kv=plan.tile_kv, q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded,
        max_steps=plan.max_steps, scale=scale, return_lse=return_lse)


register_backend("xla", _run_xla, lambda: True)
for _tq, _tk in ((64, 64), (128, 128), (64, 128), (128, 64)):
    _tpl.register(Template(f"xla_{_tq}x{_tk}", "xla", _tq, _tk, stages=1, head_dims=(),
                           dtypes=("float32", "bfloat16", "float16")))
DEFAULT_TEMPLATE = {"xla": "xla_64x64"}
