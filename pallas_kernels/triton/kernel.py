"""The Triton-lowering kernel body: executes a plan (``pallas_kernels.abi``) on any CUDA GPU.

The portable GPU path (Ampere, Ada, Hopper without Mosaic GPU) and the kernel the CPU tests run
in interpret mode. One program per (work unit, batch): it loads its Q tile once, walks the
unit's steps (K/V tiles) with a dynamic loop and an exp2 online softmax, masks only partial
steps (mask mode "cond"; "always" masks every step, "none" none: plans whose visited steps are
all full) with a branch on STEP_CUTS_B between the rectangle of a plain step, the cells of a
grid step and the bits of a bitmap step (``pallas_kernels.step_masks.masked_block``), and
writes one unit-major tile of output and LSE. Passing
``jax.experimental.pallas.triton.CompilerParams`` selects this lowering even though Mosaic GPU
is jax's default GPU lowering. ``pallas_kernels.triton.ops`` checks and pads the inputs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import abi as plan_abi
from pallas_kernels import step_masks
from pallas_kernels.contract import LN2, LOG2E, MASK_MODES
from pallas_kernels.templates import CompiledConfig, TritonConfig

__all__ = ["KernelConfig", "forward", "padded_head_dim", "MASK_MODES", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256      # padded head dim; beyond it one Q tile + accumulator won't fit registers
MIN_TILE = 16           # Triton's dot needs M, N, K >= 16


def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernel computes with: the next power of two, at least ``MIN_TILE``."""
    return max(MIN_TILE, pl.next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True)
class KernelConfig(CompiledConfig):
    """Static kernel parameters (part of the compiled executable): a ``TritonConfig`` (warps,
    prefetch) plus the tile shape, the pipelining depth and the mask mode compiled.

    tile_q, tile_kv: the plan's Q tile height and K/V tile width (powers of two in [16, 128]:
      Triton blocks must be powers of two, its dot needs 16, the plan ABI's rectangle bytes
      hold at most 255).
    stages: software-pipelining depth of the K/V loads inside the step loop (num_stages).
    variant: num_warps (None: 4 for head_dim <= 64, else 8, like jax's mha) and prefetch (the
      loop carries the next step's kv_start, so a step's K/V address does not hang on a scalar
      load of the same iteration; with it and stages >= 3 Triton's pipeliner issues the K/V
      copies a full step ahead (3 buffers) instead of after the step's compute, seen in the
      TTGIR of Triton 3.9 for sm_90; carrying two steps ahead stopped it pipelining at all).
    mask_mode: ``MASK_MODES``.
    """

    variant: TritonConfig = TritonConfig()

    VARIANT = TritonConfig

    @property
    def prefetch(self) -> bool:
        return bool(self.variant.prefetch)

    def warps_for(self, head_dim: int) -> int:
        if self.variant.num_warps is not None:
            return int(self.variant.num_warps)
        return 4 if head_dim <= 64 else 8


def _fwd_kernel(units_ref, steps_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, tile_q: int,
                tile_kv: int, group: int, qk_scale: float, mask_mode: str, prefetch: int,
                num_steps: int, precision, gather: bool):
    """One work unit x one batch element: Q tile vs. the unit's steps, online softmax (exp2)."""
    u = pl.program_id(0)
    head = units_ref[u, plan_abi.UNIT_HEAD]
    q_start = units_ref[u, plan_abi.UNIT_Q_START]
    step_ptr = units_ref[u, plan_abi.UNIT_STEP_PTR]
    step_cnt = units_ref[u, plan_abi.UNIT_STEP_CNT]
    kv_head = head if group == 1 else lax.div(head, jnp.int32(group))
    d_pad = q_ref.shape[-1]

    q = q_ref[pl.ds(q_start, tile_q), head, :]                      # [tile_q, Dp]
    row = lax.broadcasted_iota(jnp.int32, (tile_q, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, tile_kv), 1)

    def step(s, kv_start, carry, masking):
        acc, m_prev, l_prev = carry
        keys = (step_masks.step_key_rows(steps_ref, s, col, tile_kv=tile_kv,
                                         num_steps=num_steps, gather=True) if gather
                else pl.ds(kv_start, tile_kv))
        k = k_ref[keys, kv_head, :]                                 # [tile_kv, Dp]
        v = v_ref[keys, kv_head, :]
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)     # f32 [tile_q, tile_kv]
        qk = step_masks.masked_block(steps_ref, s, qk, row, col, mode=masking, tile_q=tile_q,
                                     tile_kv=tile_kv, num_steps=num_steps, gather=gather)
        # Scores in log2 units: s = qk * scale * log2(e); max commutes with the positive scale,
        # so exp2(qk * c - m) is one FMA per element.
        m_cur = jnp.max(qk, axis=-1) * qk_scale
        m_next = jnp.maximum(m_prev, m_cur)
        if masking == "none":
            m_safe = m_next             # every row has a finite score from the first step on
        else:
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)     # a row with nothing yet
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(qk * qk_scale - m_safe[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=-1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_next, l_next

    init = (jnp.zeros((tile_q, d_pad), jnp.float32),
            jnp.full((tile_q,), -jnp.inf, jnp.float32),
            jnp.zeros((tile_q,), jnp.float32))
    lo, hi = step_ptr, step_ptr + step_cnt
    last = jnp.int32(num_steps - 1)

    def run(masking, lo, hi, init):
        if not prefetch:
            body = lambda s, c: step(s, steps_ref[s, plan_abi.STEP_KV_START], c, masking)
            return lax.fori_loop(lo, hi, body, init)

        # The kv_start of the next ``prefetch`` steps ride in the loop carry, so a step's K/V
        # address does not wait on a scalar load issued in the same iteration (depth 1 only
        # from the config: depth 2 made Triton 3.9 drop the software pipelining).
        kv_at = lambda i: steps_ref[jnp.minimum(i, last), plan_abi.STEP_KV_START]

        def body(s, c):
            starts, carry = c
            nxt = kv_at(s + prefetch)
            return starts[1:] + (nxt,), step(s, starts[0], carry, masking)

        first = tuple(kv_at(lo + i) for i in range(prefetch))
        return lax.fori_loop(lo, hi, body, (first, init))[1]

    acc, m_i, l_i = run(mask_mode, lo, hi, init)

    has_key = l_i > 0.0
    l_safe = jnp.where(has_key, l_i, 1.0)
    # plgpu.store, not ref[...] = x: the latter lowers to a swap (an extra load of the tile).
    plgpu.store(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype))
    plgpu.store(lse_ref, jnp.where(has_key, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf))


def forward(q, k, v, units, steps, *, cfg: KernelConfig, scale: float, interpret: bool):
    """pallas_call over grid (num_units, B); q/k/v already padded (lengths and head dim) ->
    out_units [B, U, tile_q, Dp] (q.dtype) and lse_units [B, U, tile_q] (float32). The warps
    follow the padded head dim Dp (``KernelConfig.warps_for``: the same count as for D)."""
    B, Lqp, Hq, d_pad = q.shape
    _, Lkvp, Hkv, _ = k.shape
    U = units.shape[0]
    tq, tkv = cfg.tile_q, cfg.tile_kv
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _fwd_kernel, tile_q=tq, tile_kv=tkv, group=Hq // Hkv, qk_scale=scale * LOG2E,
        mask_mode=cfg.mask_mode, prefetch=int(cfg.prefetch), num_steps=steps.shape[0],
        precision=precision, gather=bool(cfg.variant.gather))
    whole = lambda shape: pl.BlockSpec(shape, lambda u, b: (0,) * len(shape))
    plan_ops = [units, steps]
    return pl.pallas_call(
        kernel,
        grid=(U, B),
        in_specs=[whole(x.shape) for x in plan_ops] + [
            pl.BlockSpec((None, Lqp, Hq, d_pad), lambda u, b: (b, 0, 0, 0)),
            pl.BlockSpec((None, Lkvp, Hkv, d_pad), lambda u, b: (b, 0, 0, 0)),
            pl.BlockSpec((None, Lkvp, Hkv, d_pad), lambda u, b: (b, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, tq, d_pad), lambda u, b: (b, u, 0, 0)),
            pl.BlockSpec((None, None, tq), lambda u, b: (b, u, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, U, tq, d_pad), q.dtype),
            jax.ShapeDtypeStruct((B, U, tq), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=cfg.warps_for(d_pad), num_stages=cfg.stages),
        interpret=interpret,
        name="tessera_triton_fwd",
    )(*plan_ops, q, k, v)
