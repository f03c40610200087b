"""What the three backend families (``mosaic``, ``triton``, ``xla``) share around their
kernels: the template and interpret-mode checks and the mask mode a pass plan runs with.

Each family's ``ops`` module (``forward``, ``dq``, ``dkv``, one signature for all three) calls
these, so a rule changes in one place.
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels import abi
from pallas_kernels import templates as _templates

__all__ = ["family_template", "default_interpret", "mosaic_interpret", "triton_interpret",
           "mask_mode_for", "plan_mask_mode", "forward_mask_mode"]


def family_template(template, backend: str) -> _templates.Template:
    """The ``Template`` (or the template of this name) after checking it is ``backend``'s."""
    t = _templates.get(template)
    if t.backend != backend:
        raise ValueError(f"template {t.name!r} is for backend {t.backend!r}, not {backend!r}")
    return t


def default_interpret() -> bool:
    """Interpret mode unless jax's default backend is a GPU."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def triton_interpret(interpret) -> bool:
    """The Triton lowering's ``interpret``: None picks ``default_interpret()``."""
    if interpret is None:
        return default_interpret()
    if not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"interpret must be a bool or None, got {type(interpret).__name__}")
    return bool(interpret)


def mosaic_interpret(interpret):
    """The Mosaic GPU kernels' ``interpret``: False, or the interpreter's params object
    (``jax._src.pallas.mosaic_gpu.interpret``). None picks it by ``default_interpret()``;
    True asks for the default params; a params object passes through."""
    if interpret is None:
        interpret = default_interpret()
    if isinstance(interpret, (bool, np.bool_)):
        if not interpret:
            return False
        from jax._src.pallas.mosaic_gpu.interpret import params as _params
        return _params.InterpretGPUParams()
    return interpret


def mask_mode_for(template, all_full: bool) -> str:
    """The mask mode a plan runs with on a GPU template, given whether every step it visits
    is full: "none" (no masking code) for an all-full plan on a template that masks by
    "cond", else the template's."""
    mode = _templates.get(template).kernel.mask_mode
    return "none" if mode == "cond" and all_full else mode


def check_pass_plan(plan: abi.PassPlan, t, num_q_heads=None, *, max_steps=None) -> bool:
    """``abi.check_plan`` of a concrete pass plan with template ``t``'s alignment; whether
    every visited step is full."""
    return abi.check_plan(np.asarray(plan.units), np.asarray(plan.steps), plan.tile_q,
                          plan.tile_kv, plan.q_len_padded, plan.kv_len_padded,
                          num_q_heads=num_q_heads, q_align=t.q_align, kv_align=t.kv_align,
                          max_steps=max_steps)


def plan_mask_mode(units, steps, template, q_len_padded, kv_len_padded) -> str:
    """The mask mode a concrete (NumPy) plan runs with on a GPU template (``mask_mode_for``
    of its fullness), after checking it (``abi.check_plan``)."""
    t = _templates.get(template)
    all_full = abi.check_plan(np.asarray(units), np.asarray(steps), t.tile_q, t.tile_kv,
                              int(q_len_padded), int(kv_len_padded), q_align=t.q_align,
                              kv_align=t.kv_align)
    return mask_mode_for(t, all_full)


def is_host(plan: abi.PassPlan) -> bool:
    """Whether the plan's arrays are NumPy (a host plan: checkable, constants of a program)."""
    return isinstance(plan.units, np.ndarray) and isinstance(plan.steps, np.ndarray)


def forward_mask_mode(plan: abi.PassPlan, t, num_q_heads: int, check_plan: bool) -> str:
    """The mask mode of a forward pass: from a trusted plan's ``all_full``; for an untrusted
    concrete one, checked (``abi.check_plan``) when ``check_plan``; else the template's."""
    if plan.all_full is not None:
        return mask_mode_for(t, plan.all_full)
    if check_plan and is_host(plan):
        return mask_mode_for(t, check_pass_plan(plan, t, num_q_heads))
    return t.kernel.mask_mode
