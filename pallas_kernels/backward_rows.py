"""Row bookkeeping shared by the backward kernels of every backend (jnp; no kernel code).

The backward of attention over a plan (``pallas_kernels.abi``) runs two passes:

* **dq** over the forward plan: unit u holds rows [q_start, q_start + tile_q) of query head h
  and visits K/V tiles; it needs each row's ``lse`` and ``delta`` (``unit_rows``) and writes a
  unit-major dq tile that ``gather_units`` brings back to [B, Lq, Hq, D];
* **dk/dv** over the *transposed* plan (the plan of the transposed mask: its units are key
  tiles of query head h, its steps query tiles), writing unit-major dk / dv per query head,
  brought back to [B, Lkv, Hq, D] and summed over each K/V head's group (``group_sum``).

Conventions every backward kernel takes: ``lse`` [B, Hq, Lq] float32 with **+inf** on rows
that select no key (``lse_for_backward``: exp(s - lse) is then 0 there, never NaN, and a
masked score of -inf gives 0 too), ``delta`` [B, Hq, Lq] float32 = rowsum(out * dout) - dlse.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi


def lse_for_backward(lse):
    """lse with +inf where a row selects no key (-inf): exp(score - lse) is 0 there."""
    lse = lse.astype(jnp.float32)
    return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def check_row_dots_args(out, dout) -> None:
    """The checks every row-dot kernel (``mosaic.delta``, ``triton.delta``) makes of its
    operands: one [B, L, H, D] shape (ValueError) and one dtype (TypeError)."""
    if out.ndim != 4 or out.shape != dout.shape:
        raise ValueError(f"row_dots: out and dout must be one [B, L, H, D] shape, got "
                         f"{out.shape} and {dout.shape}")
    if out.dtype != dout.dtype:
        raise TypeError(f"row_dots: out and dout must share a dtype, got {out.dtype} and "
                        f"{dout.dtype}")


def delta_of(out, dout, dlse=None, row_dots=None):
    """delta [B, Hq, Lq] float32 = rowsum(out * dout) - dlse (dlse: the cotangent of lse, or
    None). d score_ij = p_ij (dp_ij - delta_i) then carries the LSE's gradient too.
    ``row_dots(out, dout)``: a kernel for the rowsum (``pallas_kernels.mosaic.delta``,
    ``pallas_kernels.triton.delta``), else jnp."""
    if row_dots is not None:
        d = row_dots(out, dout)
    else:
        d = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), dout.astype(jnp.float32))
    return d if dlse is None else d - dlse.astype(jnp.float32)


def pad_rows(x, length: int, value):
    """[B, H, L] -> [B, H, length], the new columns ``value``."""
    extra = length - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, ((0, 0), (0, 0), (0, extra)), constant_values=value)


def pad_len(x, length: int):
    """[B, L, H, D] -> [B, length, H, D] with zero rows."""
    extra = length - x.shape[1]
    return x if extra == 0 else jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))


def unit_rows(x, units, tile_q: int, index=None):
    """[B, H, Lp] (padded to cover every unit's tile) -> [B, U, tile_q]: row r of unit u is
    x[b, head_u, q_start_u + r]. ``index``: ``host_unit_index``'s constant, when there is one."""
    if index is not None:
        return x.reshape(x.shape[0], -1)[:, index]
    h = units[:, abi.UNIT_HEAD, None]
    rows = units[:, abi.UNIT_Q_START, None] + jnp.arange(tile_q, dtype=jnp.int32)[None]
    return x[:, h, rows]


def host_unit_index(units, tile_q: int, length_padded: int):
    """``unit_rows``' gather index [U, tile_q] into [H * Lp], on the host for NumPy units
    (a constant: under ``jax.checkpoint`` index arithmetic on a plan's constants is not
    folded away, it runs and stays live in every recomputed block); None for device units."""
    if not isinstance(units, np.ndarray):
        return None

    def make(u):
        base = u[:, abi.UNIT_HEAD].astype(np.int64) * length_padded + u[:, abi.UNIT_Q_START]
        return (base[:, None] + np.arange(tile_q)[None]).astype(np.int32)

    return abi.host_cached(units, ("unit_rows", tile_q, length_padded), make)


def gather_units(x_units, row_index, row_index_t=None):
    """Unit-major [B, U, T, D] -> [B, L, H, D] through ``row_index`` [H, L] (``abi``), or its
    transpose ``row_index_t`` [L, H] when the caller has it (``abi.token_major``); rows no unit
    owns (the sentinel U * T) get 0."""
    B, U, T, D = x_units.shape
    flat = x_units.reshape(B, U * T, D)      # the sentinel is one past the end: "fill" gives 0
    idx = row_index.T if row_index_t is None else row_index_t
    return jnp.take(flat, idx, axis=1, mode="fill", fill_value=0)


def group_sum(x, num_kv_heads: int):
    """[B, L, Hq, D] per query head -> [B, L, Hkv, D], summed in float32 over each K/V head's
    group of Hq // Hkv consecutive query heads (GQA / MQA); ``x`` itself without groups."""
    B, L, Hq, D = x.shape
    if Hq == num_kv_heads:
        return x
    return x.astype(jnp.float32).reshape(B, L, num_kv_heads, Hq // num_kv_heads, D).sum(axis=3)


def row_index(units, row_index_or_none, num_heads: int, length: int, tile_q: int):
    """The plan's row_index, or made on the device from units when None."""
    if row_index_or_none is not None:
        return jnp.asarray(row_index_or_none)
    return abi.row_index_from_units(units, num_heads, length, tile_q)


def token_rows(units, row_index_t, num_heads: int, length: int, tile_q: int):
    """The token-major row index [length, num_heads] for ``gather_units``: the host's
    (``abi.token_major``), or ``row_index``'s made on the device from units when None."""
    if row_index_t is not None:
        return row_index_t
    return abi.row_index_from_units(units, num_heads, length, tile_q).T
