"""Plan executor in plain JAX: gathers the K/V tiles of each work unit, masked blockwise softmax.

Each step selects what the plan ABI says: its rectangle; for a grid step the selected cells of
its <= 4 x 4 grid (``abi.grid_mask``); for a bitmap step the bits of its words (read from the
flat ``steps``). Every kind is evaluated as one bit test per entry (``selection``).

The CPU/TPU path, the fallback, and the independent check of every plan. It never builds the
dense [Lq, Lkv] score matrix: memory is O(units x max_steps x tile_q x tile_kv), processed in
chunks of units. Differentiable by JAX autodiff.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import abi

# Units per chunk are chosen so that one chunk's scores stay near this many float32 elements.
CHUNK_ELEMS = 1 << 22


@functools.partial(jax.jit, static_argnames=("tile_q", "tile_kv", "q_len_padded",
                                             "kv_len_padded", "max_steps", "scale", "return_lse"))
def execute_plan(q, k, v, units, steps, row_index, *, tile_q, tile_kv, q_len_padded,
                 kv_len_padded, max_steps, scale, return_lse=False):
    """out [B, Lq, Hq, D] (and lse [B, Hq, Lq]) of the plan given by its ABI arrays and
    statics (``row_index=None``: computed on the device from units); unchecked."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    q = jnp.pad(q, ((0, 0), (0, q_len_padded - Lq), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, kv_len_padded - Lkv), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, kv_len_padded - Lkv), (0, 0), (0, 0)))
    U = units.shape[0]
    M = max_steps
    per_unit = tile_q * M * tile_kv * B
    chunk = max(1, min(U, CHUNK_ELEMS // max(per_unit, 1)))
    n_chunks = -(-U // chunk)
    pad_u = n_chunks * chunk - U
    units_p = jnp.pad(units, ((0, pad_u), (0, 0)))  # padding units: zero steps, own nothing
    r_t = jnp.arange(tile_q)
    m_idx = jnp.arange(M)
    acc_t = jnp.float32
    flat = steps.reshape(-1)            # the flat view a bitmap step's words are read from

    def one_chunk(u):                                     # u: [C, UNIT_COLS]
        h = u[:, abi.UNIT_HEAD]
        ptr, cnt = u[:, abi.UNIT_STEP_PTR], u[:, abi.UNIT_STEP_CNT]
        valid = m_idx[None, :] < cnt[:, None]             # [C, M]
        sidx = jnp.where(valid, ptr[:, None] + m_idx[None, :], 0)
        st = steps[sidx]                                  # [C, M, STEP_COLS]
        qi = u[:, abi.UNIT_Q_START, None] + r_t[None]     # [C, T]
        qt = q[:, qi, h[:, None]]                         # [B, C, T, D]
        ki = abi.tile_keys(st, flat, tile_kv)             # [C, M, Tk]
        kvh = (h // group)[:, None, None]
        kt = k[:, ki, kvh]                                # [B, C, M, Tk, D]
        vt = v[:, ki, kvh]
        s = jnp.einsum("bctd,bcmkd->bctmk", qt, kt,
                       preferred_element_type=acc_t, precision=lax.Precision.HIGHEST) * scale
        # The step's selection on [C, T, M, Tk]: row t of the unit's tile, step m, key c of
        # its K/V tile.
        sel = selection(st, valid, flat, tile_q, tile_kv)
        s = jnp.where(sel[None], s, -jnp.inf)
        m = jnp.max(s, axis=(-2, -1), keepdims=True)
        m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=(-2, -1))                                        # [B, C, T]
        o = jnp.einsum("bctmk,bcmkd->bctd", p.astype(v.dtype),
                       vt, preferred_element_type=acc_t, precision=lax.Precision.HIGHEST)
        o = o / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, jnp.log(jnp.where(l > 0, l, 1.0)) + m[..., 0, 0], -jnp.inf)
        return o.astype(q.dtype), lse

    if n_chunks == 1:
        out_u, lse_u = one_chunk(units_p)
    else:
        out_c, lse_c = lax.map(one_chunk, units_p.reshape(n_chunks, chunk, -1))
        # [n, B, C, T, D] -> [B, n*C, T, D]
        out_u = jnp.moveaxis(out_c, 0, 1).reshape(B, n_chunks * chunk, tile_q, D)
        lse_u = jnp.moveaxis(lse_c, 0, 1).reshape(B, n_chunks * chunk, tile_q)
    if row_index is None:           # computed on the device from units
        row_index = abi.row_index_from_units(units, Hq, Lq, tile_q)
    out, lse = abi.gather_rows(out_u[:, :U], lse_u[:, :U], row_index)
    return (out, lse) if return_lse else out


def selection(st, valid, flat, tile_q, tile_kv):
    """[C, T, M, Tk] bool: whether row t of the unit's tile and key c of step m's K/V tile are
    selected, for the steps st [C, M, STEP_COLS] (valid [C, M]: the unit has step m).

    Every step kind is one bit test, ``(row_word[t, m, c // 32] & key_bit[m, c]) != 0``, of two
    small arrays ([C, T, M, W] and [C, M, Tk], W = ``abi.bitmap_words(tile_kv)``), so each
    entry costs an and and a compare whatever the plan holds:
      * a grid step (``abi.grid_mask``): row_word = the 4-bit row of its cell matrix for the
        row's segment, key_bit = 1 << the key's segment (as the Pallas kernels'
        ``step_masks.grid_vectors``); a plain step is the grid of one selected cell (row_word
        = key_bit = 1);
      * a bitmap step (cuts_b == BITMAP_FLAG): row_word = word(t, w) = flat[off + w * tile_q
        + t] (off = cuts_a, flat = steps.reshape(-1)), key_bit = 1 << (c % 32);
      * a gathered step (``abi.is_gather``): row_word = its key words where row t's bit is set,
        else 0; key_bit = 1 << (c % 32) (its keys are gathered by ``abi.tile_keys``).
    Both are 0 outside the step's rectangle (rows / keys) and for m >= the unit's step count.
    """
    rect, ca, cb = st[..., abi.STEP_RECT], st[..., abi.STEP_CUTS_A], st[..., abi.STEP_CUTS_B]
    q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(rect)                # each [C, M]
    (q1, q2, q3), (k1, k2, k3), bits = abi.unpack_grid(ca, cb)
    plain, bitmap = cb == 0, cb == abi.BITMAP_FLAG
    gather = abi.is_gather(cb)
    W = abi.bitmap_words(tile_kv)
    # Rows: [C, T, M] (x[:, None]: a step's value against the row iota t [1, T, 1]).
    t = np.arange(tile_q, dtype=np.int32)[None, :, None]
    i = (t >= q1[:, None]).astype(jnp.int32) + (t >= q2[:, None]) + (t >= q3[:, None])
    nibble = jnp.where(plain[:, None], 1, (bits[:, None] >> (abi.GRID * i)) & 0xF)
    rows_in = (t >= q_lo[:, None]) & (t < q_hi[:, None]) & valid[:, None]
    # A bitmap step's words [C, M, W, T] -> [C, T, M, W] (mode="clip": any other step's cuts_a
    # is no offset; its words are read in bounds and unused).
    idx = (np.arange(W, dtype=np.int32) * tile_q)[:, None] + np.arange(tile_q, dtype=np.int32)
    words = jnp.transpose(jnp.take(flat, ca[:, :, None, None] + idx, mode="clip"), (0, 3, 1, 2))
    row_word = jnp.where(bitmap[:, None, :, None], words, nibble[..., None])
    if tile_kv % abi.GATHER_ROWS == 0:
        # A gathered step: row t's words are the key words where its row bit is set.
        kw = ca + abi.gather_chunks(tile_kv)                              # [C, M]
        key_words = jnp.take(flat, kw[..., None] + np.arange(W, dtype=np.int32), mode="clip")
        rw = kw[:, None, :] + W + t // abi.WORD_BITS                      # [C, T, M]
        row_bit = (jnp.take(flat, rw, mode="clip") >> (t % abi.WORD_BITS)) & 1
        row_word = jnp.where(gather[:, None, :, None],
                             jnp.where(row_bit[..., None] == 1, key_words[:, None], 0), row_word)
    row_word = jnp.where(rows_in[..., None], row_word, 0)
    # Keys: [C, M, Tk] (x[..., None]: a step's value against the key iota c [1, 1, Tk]).
    c = np.arange(tile_kv, dtype=np.int32)[None, None, :]
    j = (c >= k1[..., None]).astype(jnp.int32) + (c >= k2[..., None]) + (c >= k3[..., None])
    word_bit = np.left_shift(np.int32(1), c % abi.WORD_BITS)        # int32: bit 31 is < 0
    key_bit = jnp.where(plain[..., None], 1,
                        jnp.where((bitmap | gather)[..., None], word_bit, jnp.left_shift(1, j)))
    key_bit = jnp.where((c >= kv_lo[..., None]) & (c < kv_hi[..., None]), key_bit, 0)
    # Key c = 32 w + b tests row_word[..., w] against key_bit [C, M, W, 32]: [C, T, M, W, 32]
    # -> [C, T, M, W * 32] -> the first Tk keys.
    C, M = key_bit.shape[:2]
    key_bit = jnp.pad(key_bit, ((0, 0), (0, 0), (0, W * abi.WORD_BITS - tile_kv)))
    key_bit = key_bit.reshape(C, 1, M, W, abi.WORD_BITS)
    sel = (row_word[..., None] & key_bit) != 0
    return sel.reshape(*sel.shape[:3], W * abi.WORD_BITS)[..., :tile_kv]

