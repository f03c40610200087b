"""The Triton-lowering kernel body: executes a plan (``pallas_kernels.abi``) on any CUDA GPU.

The portable GPU path (Ampere, Ada, Hopper without Mosaic GPU) and the kernel the CPU tests run
in interpret mode. One program per (work unit, batch): it loads its Q tile once, walks the
unit's steps (K/V tiles) with a dynamic loop and an exp2 online softmax, masks only partial
steps (mask mode "cond"; "always" masks every step, "none" none: plans whose visited steps are
all full) with a branch on STEP_CUTS_B between the rectangle of a plain step, the cells of a
grid step (``_grid_keep``) and the bits of a bitmap step (``_bitmap_keep``), and writes one
unit-major tile of output and LSE. Passing ``jax.experimental.pallas.triton.CompilerParams``
selects this lowering even though Mosaic GPU is jax's default GPU lowering.
``pallas_kernels.triton.wrapper`` checks and pads the inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import abi as plan_abi
from pallas_kernels.templates import CompiledConfig, TritonConfig

__all__ = ["KernelConfig", "forward", "padded_head_dim", "MASK_MODES", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256      # padded head dim; beyond it one Q tile + accumulator won't fit registers
MIN_TILE = 16           # Triton's dot needs M, N, K >= 16
# "cond": a ``lax.cond`` per step skips the element mask on full steps; "always": every step
# masked (no branch); "none": no masking code at all (only for plans whose visited steps are
# all full).
MASK_MODES = ("cond", "always", "none")
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


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

    tile_q: int
    tile_kv: int
    stages: int = 2
    variant: TritonConfig = TritonConfig()
    mask_mode: str = "cond"

    VARIANT = TritonConfig
    MASK_MODES = MASK_MODES

    @property
    def prefetch(self) -> bool:
        return bool(self.variant.prefetch)

    def warps_for(self, head_dim: int) -> int:
        if self.variant.num_warps is not None:
            return int(self.variant.num_warps)
        return 4 if head_dim <= 64 else 8


def _segment_select(idx, lo, hi, cuts, vals):
    """Per entry of ``idx`` (an iota): ``vals[n]`` for n = the number of ``cuts``
    (non-decreasing scalars) at or below it, 0 outside [lo, hi). Compares and selects against
    scalars only: later cuts win, so an empty segment (a repeated cut) is skipped exactly as
    ``abi.grid_mask``'s count (idx >= c1) + (idx >= c2) + (idx >= c3)."""
    out = jnp.where(idx >= cuts[0], vals[1], vals[0])
    for cut, val in zip(cuts[1:], vals[2:]):
        out = jnp.where(idx >= cut, val, out)
    return jnp.where((idx >= lo) & (idx < hi), out, jnp.int32(0))


def _grid_keep(row, col, rect, cuts_a, cuts_b):
    """A grid step's selection (``abi.grid_mask``) on the [tile_q, tile_kv] block, from the
    row iota [tile_q, 1] and the key iota [1, tile_kv]: row_bits [tile_q, 1] is the 4-bit row
    of the cell matrix for each row's segment (0 outside the rectangle's rows), col_bit
    [1, tile_kv] = 1 << (each key's segment) (0 outside its keys); per element of the block
    one and and one compare: row_bits & col_bit != 0."""
    q_lo, q_hi, kv_lo, kv_hi = plan_abi.unpack_rect(rect)
    (q1, q2, q3), (k1, k2, k3), _ = plan_abi.unpack_grid(cuts_a, cuts_b)
    nibbles = [(cuts_b >> (plan_abi.GRID_BITS_SHIFT + plan_abi.GRID * n)) & 0xF
               for n in range(plan_abi.GRID)]
    row_bits = _segment_select(row, q_lo, q_hi, (q1, q2, q3), nibbles)
    col_bit = _segment_select(col, kv_lo, kv_hi, (k1, k2, k3),
                              [jnp.int32(1 << j) for j in range(plan_abi.GRID)])
    return (row_bits & col_bit) != 0


assert plan_abi.STEP_COLS == 4      # _bitmap_keep: flat index f is steps[f >> 2, f & 3]


def _bitmap_keep(steps_ref, row, col, rect, off, *, tile_q: int, tile_kv: int,
                 num_steps: int):
    """A bitmap step's selection (``abi``: cuts_b == BITMAP_FLAG, off = cuts_a) on the
    [tile_q, tile_kv] block: key c of row r is kept iff bit c % 32 of word(r, c // 32) is set,
    word(r, w) = steps.reshape(-1)[off + w * tile_q + r]. Word column w is one gather of
    tile_q int32 from ``steps_ref`` [num_steps, STEP_COLS] (row f >> 2, column f & 3 of flat
    index f; off clamped to [0, 4 * num_steps] and the row to the array, so an invalid offset
    reads wrong words, never out of bounds), zeroed outside the rectangle's rows; each key
    picks its word with W - 1 selects against the key iota and tests it against col_bit
    [1, tile_kv] = 1 << (c % 32) (0 outside the rectangle's keys): per element of the block
    W - 1 selects, one and and one compare."""
    q_lo, q_hi, kv_lo, kv_hi = plan_abi.unpack_rect(rect)
    rows_in = (row >= q_lo) & (row < q_hi)                          # [tile_q, 1]
    base = jnp.clip(off, 0, plan_abi.STEP_COLS * num_steps) + row   # [tile_q, 1] flat index
    word = None
    for w in range(plan_abi.bitmap_words(tile_kv)):
        f = base + w * tile_q
        wd = steps_ref[jnp.minimum(f >> 2, num_steps - 1), f & 3]   # [tile_q, 1]
        wd = jnp.where(rows_in, wd, jnp.int32(0))
        word = wd if word is None else jnp.where(col >= w * plan_abi.WORD_BITS, wd, word)
    col_bit = jnp.left_shift(jnp.int32(1), col & (plan_abi.WORD_BITS - 1))
    col_bit = jnp.where((col >= kv_lo) & (col < kv_hi), col_bit, jnp.int32(0))
    return (word & col_bit) != 0


def _fwd_kernel(units_ref, steps_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, tile_q: int,
                tile_kv: int, group: int, qk_scale: float, mask_mode: str, prefetch: int,
                num_steps: int, precision):
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
        k = k_ref[pl.ds(kv_start, tile_kv), kv_head, :]             # [tile_kv, Dp]
        v = v_ref[pl.ds(kv_start, tile_kv), kv_head, :]
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)     # f32 [tile_q, tile_kv]
        if masking != "none":
            rect = steps_ref[s, plan_abi.STEP_RECT]
            cuts_b = steps_ref[s, plan_abi.STEP_CUTS_B]       # 0: a plain step
            plain = cuts_b == 0

            def rect_mask(x):
                q_lo, q_hi, kv_lo, kv_hi = plan_abi.unpack_rect(rect)
                keep = ((row >= q_lo) & (row < q_hi)) & ((col >= kv_lo) & (col < kv_hi))
                return jnp.where(keep, x, -jnp.inf)

            def grid_mask(x):
                keep = _grid_keep(row, col, rect, steps_ref[s, plan_abi.STEP_CUTS_A], cuts_b)
                return jnp.where(keep, x, -jnp.inf)

            def bitmap_mask(x):
                keep = _bitmap_keep(steps_ref, row, col, rect,
                                    steps_ref[s, plan_abi.STEP_CUTS_A], tile_q=tile_q,
                                    tile_kv=tile_kv, num_steps=num_steps)
                return jnp.where(keep, x, -jnp.inf)

            # A branch per step on STEP_CUTS_B: plain steps run the rectangle mask alone, the
            # others branch again between a grid's cells and a bitmap's bits.
            cells = lambda x: lax.cond(cuts_b == plan_abi.BITMAP_FLAG, bitmap_mask, grid_mask, x)
            masked = lambda x: lax.cond(plain, rect_mask, cells, x)
            if masking == "cond":
                full = (rect == jnp.int32(plan_abi.full_rect(tile_q, tile_kv))) & plain
                qk = lax.cond(full, lambda x: x, masked, qk)
            else:
                qk = masked(qk)
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
    plgpu.store(lse_ref, jnp.where(has_key, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf))


def forward(q, k, v, units, steps, *, config: KernelConfig, scale: float, head_dim: int,
            interpret: bool):
    """pallas_call over grid (num_units, B); q/k/v already padded (lengths and head dim) ->
    out_units [B, U, tile_q, Dp] (q.dtype) and lse_units [B, U, tile_q] (float32)."""
    B, Lqp, Hq, d_pad = q.shape
    _, Lkvp, Hkv, _ = k.shape
    U = units.shape[0]
    tq, tkv = config.tile_q, config.tile_kv
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _fwd_kernel, tile_q=tq, tile_kv=tkv, group=Hq // Hkv, qk_scale=scale * _LOG2E,
        mask_mode=config.mask_mode, prefetch=int(config.prefetch), num_steps=steps.shape[0],
        precision=precision)
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
            num_warps=config.warps_for(head_dim), num_stages=config.stages),
        interpret=interpret,
        name="tessera_triton_fwd",
    )(*plan_ops, q, k, v)
