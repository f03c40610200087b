"""The backward's row dots, delta[b, h, i] = sum_d out[b, i, h, d] * dout[b, i, h, d] in
float32, in one Triton kernel reading out and dout in their token-major [B, L, H, D] layout.

Why a kernel: XLA computes the jnp version as a reduce whose [B, H, L] result it prefers
head-major, and lays out its operand, the forward's gathered output, to match; in a
rematerialised training step that output is then kept twice (head-major for the reduce, token-
major for the output projection): one attention-sized array above cuDNN's peak (H200 session
14, Wan2.1-1.3B 480p: 100.6 MB). A custom call's operands are row-major, so out stays
token-major only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backward_rows

#: Token rows a program reads (of one head).
ROWS = 64
NUM_WARPS = 4


def _kernel(o_ref, g_ref, d_ref, *, rows: int, width: int, length: int, head_dim: int):
    b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r = i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    inside = (r < length) & (col < head_dim)
    at = (b, pl.ds(i * rows, rows), pl.ds(h * head_dim, width))
    o = plgpu.load(o_ref.at[at], mask=inside, other=0.0).astype(jnp.float32)
    g = plgpu.load(g_ref.at[at], mask=inside, other=0.0).astype(jnp.float32)
    row = i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    plgpu.store(d_ref.at[b, h, pl.ds(i * rows, rows)], jnp.sum(o * g, axis=1), mask=row < length)


def row_dots(out, dout, *, interpret: bool = False):
    """float32 [B, H, L]: the dot of out and dout [B, L, H, D] (one dtype) over D per row."""
    backward_rows.check_row_dots_args(out, dout)
    if out.size >= 2 ** 31:
        raise ValueError(f"row_dots: at most 2**31 - 1 elements (int32 offsets), got {out.size}")
    return _row_dots(out, dout, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _row_dots(out, dout, *, interpret):
    B, L, H, D = out.shape
    width = max(16, 1 << (D - 1).bit_length())
    return pl.pallas_call(
        functools.partial(_kernel, rows=ROWS, width=width, length=L, head_dim=D),
        grid=(B, pl.cdiv(L, ROWS), H),
        out_shape=jax.ShapeDtypeStruct((B, H, L), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="tessera_row_dots",
    )(out.reshape(B, L, H * D), dout.reshape(B, L, H * D))
