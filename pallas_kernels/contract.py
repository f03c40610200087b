"""What the three backend families (``mosaic``, ``triton``, ``xla``) share around their
kernels: the checks of q / k / v, of a pass plan's padded lengths and of the scale, the
interpret-mode rule, the mask mode a plan runs with, the padding and the gathering of the
unit-major outputs.

Each family's ``ops`` module gets its ``forward`` (GPU families), ``dq`` and ``dkv`` from
``forward_op`` / ``backward_ops`` here (one signature for all three families) and supplies only
its ``run_*`` functions, so a rule changes in one place.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi
from pallas_kernels import backward_rows as rows_
from pallas_kernels import templates as _templates
from pallas_kernels.templates import Template

__all__ = ["family_template", "default_interpret", "mosaic_interpret", "triton_interpret",
           "check_qkv", "check_padded", "check_scale", "check_pass", "check_pass_plan",
           "check_dkv_gathers",
           "mask_mode_for", "forward_mask_mode", "is_host", "forward_op", "backward_ops",
           "plan_operands", "pad", "unpad", "forward_call", "gather_dq", "gather_dkv",
           "FLOAT_DTYPES", "MASK_MODES", "BACKWARD_MASK_MODE", "LOG2E", "LN2"]

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
MASK_MODES = _templates.CompiledConfig.MASK_MODES     # what a compiled kernel config takes
#: The mask mode of the backward passes: full steps skip masking by a cond.
BACKWARD_MASK_MODE = "cond"
# The kernels' softmax runs in base 2: scores times scale * LOG2E, the lse back times LN2.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# --- templates, interpret mode ----------------------------------------------------------------
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


# --- checks -----------------------------------------------------------------------------------
def check_qkv(q, k, v, t: _templates.Template, do=None) -> None:
    """TypeError / ValueError unless q [B, Lq, Hq, D], k and v [B, Lkv, Hkv, D] (and ``do``,
    the shape of q) are arrays of one float dtype that template ``t`` takes, Hq % Hkv == 0."""
    named = (("q", q), ("k", k), ("v", v)) + ((("do", do),) if do is not None else ())
    for name, x in named:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have rank 4 [B, L, H, D], got shape {tuple(x.shape)}")
    B, Lq, Hq, D = q.shape
    Bk, Lkv, Hkv, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if do is not None and tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do must have the shape of q {tuple(q.shape)}, got {tuple(do.shape)}")
    if Bk != B or Dk != D:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head dim")
    if min(q.shape) < 1 or min(k.shape) < 1:
        raise ValueError(f"q and k must have no empty dimension, got {q.shape} and {k.shape}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    dt = jnp.dtype(q.dtype)
    if dt.name not in FLOAT_DTYPES:
        raise TypeError(f"q has dtype {dt}; supported: {', '.join(FLOAT_DTYPES)}")
    for name, x in (("k", k), ("v", v)):
        if jnp.dtype(x.dtype) != dt:
            raise TypeError(f"q, k, v must share one dtype: {name} has dtype {x.dtype} but q "
                            f"has dtype {dt}")
    if not t.supports(D, dt):
        raise ValueError(f"template {t.name!r} takes head dims {_dims(t.head_dims)} and dtypes "
                         f"{t.dtypes}; got head_dim={D}, dtype={dt.name}")


def _dims(dims) -> str:
    if not dims:
        return "(any)"
    if len(dims) > 2 and tuple(dims) == tuple(range(dims[0], dims[0] + len(dims))):
        return f"{dims[0]}..{dims[-1]}"
    return str(tuple(dims))


def _static_int(name, val) -> int:
    if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
        raise TypeError(f"{name} must be a static int, got {type(val).__name__}")
    return int(val)


def check_padded(plan: abi.PassPlan, rows: int, cols: int, q_align: int = 1,
                 kv_align: int = 1) -> None:
    """ValueError unless the plan's padded lengths are static ints covering ``rows`` (the
    length its units tile) and ``cols`` (the length its steps tile) and its tiles, in
    multiples of the alignments."""
    for name, low, tile, align in (("q_len_padded", rows, plan.tile_q, q_align),
                                   ("kv_len_padded", cols, plan.tile_kv, kv_align)):
        val = _static_int(name, getattr(plan, name))
        if val < max(low, tile) or val % align:
            raise ValueError(f"{name}={val} must be >= the sequence length {low} and the tile "
                             f"{tile}, and a multiple of {align}")


def check_scale(scale) -> float:
    """The scale as a Python float; ValueError unless finite and positive."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(
            scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a Python float (static), got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    return scale


def check_pass(q, k, v, plan: abi.PassPlan, t, scale, *, do=None, transposed=False,
               aligns=None) -> float:
    """The checks of one pass: q / k / v (and do) for template ``t``, the plan's arrays and
    padded lengths (``transposed``: a dk/dv plan, whose units tile the keys and steps the
    queries; ``aligns``: (q_align, kv_align), default the template's), the scale."""
    if not isinstance(plan, abi.PassPlan):
        raise TypeError(f"plan must be a pallas_kernels.abi.PassPlan, got {type(plan).__name__}")
    check_qkv(q, k, v, t, do)
    Lq, Hq, Lkv = q.shape[1], q.shape[2], k.shape[1]
    rows, cols = (Lkv, Lq) if transposed else (Lq, Lkv)
    abi.check_plan_arrays(plan.units, plan.steps, plan.row_index, num_q_heads=Hq, q_len=rows)
    check_padded(plan, rows, cols, *(aligns or (t.q_align, t.kv_align)))
    return check_scale(scale)


# --- mask modes -------------------------------------------------------------------------------
def mask_mode_for(template, all_full: bool) -> str:
    """The mask mode a plan runs with on a GPU template, given whether every step it visits
    is full: "none" (no masking code) for an all-full plan on a template that masks by
    "cond", else the template's."""
    mode = _templates.get(template).kernel.mask_mode
    return "none" if mode == "cond" and all_full else mode


def check_pass_plan(plan: abi.PassPlan, t, num_q_heads=None, *, max_steps=None) -> bool:
    """``abi.check_plan`` of a concrete pass plan with template ``t``'s alignment; whether
    every visited step is full."""
    return abi.check_plan(plan.units, plan.steps, plan.tile_q, plan.tile_kv,
                          plan.q_len_padded, plan.kv_len_padded, num_q_heads=num_q_heads,
                          q_align=t.q_align, kv_align=t.kv_align, max_steps=max_steps,
                          gather=gathers(t))


def gathers(t) -> int:
    """The keys template ``t``'s kernels copy at once on gathered steps (``abi.GATHER_FLAG``;
    0: they do not gather). The XLA executor reads any chunk layout."""
    if t.backend == "xla":
        return abi.GATHER_ROWS
    if not getattr(t.kernel, "gather", False):
        return 0
    return getattr(t.kernel, "gather_run", abi.GATHER_ROWS)     # Triton: any 8-key chunks


def check_dkv_gathers(plan: abi.PassPlan, gather_run: int) -> None:
    """ValueError when a host dk/dv plan holds gathered steps the kernel cannot copy: it does
    not gather (it would read each such step as one run of queries), or it copies
    ``gather_run`` queries at once and a step's chunks are not in such runs (wrong gradients
    either way). Traced plans are the device planner's, which emits none for such kernels."""
    if not is_host(plan) or not len(plan.steps):
        return
    st = np.asarray(plan.steps)
    g = abi.visited_rows(plan.units, len(st)) & abi.is_gather(st[:, abi.STEP_CUTS_B])
    if not g.any():
        return
    if not gather_run:
        raise ValueError("this dk/dv plan has gathered steps (abi.GATHER_FLAG), but the "
                         "template's dk/dv kernel does not gather: plan dk/dv without the "
                         "gather policy, or use a gathering template")
    n = abi.gather_chunks(plan.tile_kv)
    starts = st.reshape(-1)[st[g, abi.STEP_CUTS_A].astype(np.int64)[:, None] + np.arange(n)]
    if not abi.gather_runs_ok(starts, plan.tile_kv, gather_run):
        raise ValueError(f"this dk/dv plan's gathered steps are not in runs of {gather_run} "
                         f"consecutive queries, the copies of the template's dk/dv kernel: "
                         f"plan dk/dv with the gather{gather_run} policy")


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


# --- the contract's entry points -----------------------------------------------------------------
def forward_op(backend: str, run_forward):
    """A GPU family's ``forward`` (the contract's signature): the checks, the mask mode
    (``forward_mask_mode``), then ``run_forward(q, k, v, plan, t, mode, scale, return_lse,
    interpret)``, the family's."""
    def forward(q, k, v, plan: abi.PassPlan, *, template: Template, scale: float,
                return_lse: bool = False, interpret: bool | None = None,
                check_plan: bool = True):
        """out [B, Lq, Hq, D] (q.dtype), or (out, lse [B, Hq, Lq] f32) with return_lse."""
        t = family_template(template, backend)
        scale = check_pass(q, k, v, plan, t, scale)
        mode = forward_mask_mode(plan, t, q.shape[2], check_plan)
        return run_forward(q, k, v, plan, t, mode, scale, return_lse, interpret)

    return forward


def backward_ops(run_dq, run_dkv):
    """A family's ``dq`` and ``dkv`` (the contract's signatures) over its ``run_dq`` /
    ``run_dkv(q, k, v, do, lse, delta, plan, template, scale, interpret, mode)``, which check
    their inputs, with the backward passes' mask mode."""
    def dq(q, k, v, do, lse, delta, plan: abi.PassPlan, *, template: Template,
           scale: float, interpret: bool | None = None):
        """dq [B, Lq, Hq, D] over the forward pass plan. lse: ``backward_rows.lse_for_backward``
        (+inf on empty rows); delta: rowsum(out * do) - dlse, [B, Hq, Lq] f32."""
        return run_dq(q, k, v, do, lse, delta, plan, template, scale, interpret,
                      BACKWARD_MASK_MODE)

    def dkv(q, k, v, do, lse, delta, plan: abi.PassPlan, *, template: Template,
            scale: float, interpret: bool | None = None):
        """(dk, dv) [B, Lkv, Hkv, D] over the dk/dv pass plan (the transposed mask's plan:
        units are key tiles of one query head, steps query tiles); template: the forward's;
        summed over each K/V head's group."""
        return run_dkv(q, k, v, do, lse, delta, plan, template, scale, interpret,
                       BACKWARD_MASK_MODE)

    return dq, dkv


# --- padding, the kernel call, gathering --------------------------------------------------------
def plan_operands(plan: abi.PassPlan):
    """(units, steps, row_index, row_index_t) as the jitted pass takes them: NumPy arrays
    stay NumPy (the jitted call copies them, cheaper than a separate device_put), others go
    through jnp.asarray; row_index None is made on the device from units; row_index_t is the
    host row_index's transpose (``abi.token_major``) or None."""
    units, steps, ri = plan.units, plan.steps, plan.row_index
    units, steps = (a if isinstance(a, (np.ndarray, jax.Array)) else jnp.asarray(a)
                    for a in (units, steps))
    if ri is not None and not isinstance(ri, (np.ndarray, jax.Array)):
        ri = jnp.asarray(ri)
    return units, steps, ri, abi.token_major(ri)


def pad(x, length: int, head_dim: int | None = None):
    """[B, L, H, D] -> [B, length, H, head_dim (None: D)] with zeros."""
    extra = length - x.shape[1]
    pad_d = 0 if head_dim is None else head_dim - x.shape[-1]
    if extra == 0 and pad_d == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, pad_d)))


def unpad(x, shape):
    """``pad``'s inverse: [B, >= L, H, >= D] -> the leading [B, L, H, D] of ``shape``."""
    L, D = shape[1], shape[-1]
    return x if x.shape[1] == L and x.shape[-1] == D else x[:, :L, :, :D]


@functools.partial(jax.jit, static_argnames=("kernel", "cfg", "q_len_padded", "kv_len_padded",
                                             "head_dim", "scale", "return_lse", "interpret",
                                             "direct"))
def forward_call(q, k, v, units, steps, row_index, row_index_t=None, *, kernel, cfg,
                 q_len_padded, kv_len_padded, head_dim, scale, return_lse, interpret,
                 direct=False):
    """A GPU forward pass: q, k, v padded to the plan's lengths (and to ``head_dim``), the
    kernel ``kernel(q, k, v, units, steps, cfg=, scale=, interpret=)`` -> unit-major out,
    lse; the owned rows gathered to out [B, Lq, Hq, D] (and lse [B, Hq, Lq]). ``direct``
    (a kernel that stores owned rows in place, a plan whose units own every row): the kernel
    takes ``direct=True`` and returns out [B, Lqp, Hq, head_dim]; only lse is gathered."""
    B, Lq, Hq, D = q.shape
    kw = dict(direct=True) if direct else {}
    out_u, lse_u = kernel(pad(q, q_len_padded, head_dim), pad(k, kv_len_padded, head_dim),
                          pad(v, kv_len_padded, head_dim), units, steps, cfg=cfg, scale=scale,
                          interpret=interpret, **kw)
    if direct and not return_lse:
        return unpad(out_u, q.shape)
    if row_index is None:
        row_index = abi.row_index_from_units(units, Hq, Lq, cfg.tile_q)
    if direct:
        return unpad(out_u, q.shape), abi.gather_lse(lse_u, row_index)
    if head_dim != D:
        out_u = out_u[..., :D]
    out, lse = abi.gather_rows(out_u, lse_u, row_index, row_index_t)
    return (out, lse) if return_lse else out


def gather_dq(dq_u, units, row_index_t, q_shape, tile_q: int):
    """Unit-major dq [B, U, tile_q, >= D] -> [B, Lq, Hq, D]."""
    _, Lq, Hq, D = q_shape
    if dq_u.shape[-1] != D:
        dq_u = dq_u[..., :D]
    return rows_.gather_units(dq_u, None, rows_.token_rows(units, row_index_t, Hq, Lq, tile_q))


def gather_dkv(dk_u, dv_u, units, row_index_t, q_shape, k, v, tile_q: int):
    """Unit-major dk, dv per query head [B, U, tile_q, >= D] -> [B, Lkv, Hkv, D] in k's and
    v's dtypes, summed over each K/V head's group."""
    D, Hq = q_shape[3], q_shape[2]
    Lkv, Hkv = k.shape[1], k.shape[2]
    ri_t = rows_.token_rows(units, row_index_t, Hq, Lkv, tile_q)
    dk, dv = (rows_.group_sum(rows_.gather_units(x if x.shape[-1] == D else x[..., :D], None,
                                                 ri_t), Hkv) for x in (dk_u, dv_u))
    return dk.astype(k.dtype), dv.astype(v.dtype)
