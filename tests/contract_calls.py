"""How the kernel tests call the backend contract (``pallas_kernels.<family>.ops.forward``):
the pass plan of a planner ``Plan`` (or of any object with its ABI fields), a run in a given
mask mode, and Triton templates of direct kernel parameters."""

from __future__ import annotations

import dataclasses

from pallas_kernels import abi, contract, templates
from pallas_kernels.templates import Template, TritonConfig


def pass_plan(p, all_full=None) -> abi.PassPlan:
    """The ``abi.PassPlan`` of ``p``: a planner Plan, a PassPlan or a namespace of units, steps,
    row_index, tile_q, tile_kv, q_len_padded, kv_len_padded (max_steps: 0 when absent).
    ``all_full`` None: untrusted (the backend checks a NumPy plan and picks the mask mode)."""
    return abi.PassPlan(p.units, p.steps, p.row_index, int(p.tile_q), int(p.tile_kv),
                        int(p.q_len_padded), int(p.kv_len_padded),
                        int(getattr(p, "max_steps", 0)), all_full)


def with_mask_mode(template, mask_mode):
    """(template, all_full) that run a plan in ``mask_mode`` through the contract: None, the
    template with an untrusted plan (the backend picks); "none", a trusted all-full plan on
    a "cond" template; "cond" / "always", that variant of the template with a trusted plan
    that has partial steps (the mode as the template says)."""
    t = templates.get(template)
    if mask_mode is None:
        return t, None
    if mask_mode == "none":
        if t.kernel.mask_mode != "cond":
            raise ValueError(f"mask mode 'none' needs a 'cond' template, not {t.name!r}")
        return t, True
    if t.kernel.mask_mode != mask_mode:
        t = dataclasses.replace(t, name=f"{t.name}+{mask_mode}",
                                kernel=dataclasses.replace(t.kernel, mask_mode=mask_mode))
    return t, False


def forward(ops, q, k, v, p, template, *, mask_mode=None, scale=None, **kw):
    """``ops.forward`` of ``p`` (see ``pass_plan``) on ``template`` in ``mask_mode`` (see
    ``with_mask_mode``); ``scale`` None: head_dim ** -0.5."""
    t, all_full = with_mask_mode(template, mask_mode)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return ops.forward(q, k, v, pass_plan(p, all_full), template=t, scale=scale, **kw)


def triton_template(tile_q: int, tile_kv: int, stages: int = 2, **kernel) -> Template:
    """A Triton template outside the table (any head dim and dtype) of these tiles, stages and
    ``TritonConfig`` fields."""
    cfg = TritonConfig(**kernel)
    name = "triton_test_q{}_kv{}_s{}_{}".format(tile_q, tile_kv, stages,
                                                "_".join(f"{k}{v}" for k, v in kernel.items()))
    return Template(name, "triton", tile_q, tile_kv, stages, head_dims=(),
                    dtypes=contract.FLOAT_DTYPES, kernel=cfg)


def xla_template(tile_q: int, tile_kv: int) -> Template:
    """An XLA template of these tiles (the executor runs plans of any)."""
    return Template(f"xla_{tile_q}x{tile_kv}", "xla", tile_q, tile_kv, stages=1, head_dims=(),
                    dtypes=contract.FLOAT_DTYPES)
