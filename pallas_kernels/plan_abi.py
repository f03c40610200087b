"""The plan ABI: the int32 arrays a kernel executes, and nothing about masks.

A plan is produced on the host by ``tessera_jax.planner`` and executed by any backend
(``tessera_jax.xla_backend``, ``pallas_kernels.triton_fwd``, ``pallas_kernels.mosaic_fwd``).
Kernels see only the arrays below plus static integers; they never see a mask.

Static parameters (Python ints, part of the compiled executable):
  tile_q        rows of one work unit's query tile (the Q tile height the kernel loads)
  tile_kv       keys of one K/V tile (a step)
  num_units     capacity U of the ``units`` array (a power of two >= the real count)
  num_steps     capacity S of the ``steps`` array (a power of two >= the real count)
  max_steps     capacity M >= the largest step_count of any unit (a power of two); only the
                XLA executor needs it, kernels loop over ``step_count`` dynamically
  q_len_padded, kv_len_padded
                the sequence lengths the plan indexes into. They are >= Lq / Lkv; the
                wrapper pads q (k, v) with zeros up to them when they differ. Every tile the
                plan names lies inside them: q_start + tile_q <= q_len_padded and
                kv_start + tile_kv <= kv_len_padded.

``units``: int32 [U, UNIT_COLS]; row u is one work unit, in schedule order (the order in
which a persistent kernel should take them; a grid kernel uses u as its program id).
  UNIT_HEAD      query head h (the K/V head is h // (Hq // Hkv))
  UNIT_Q_START   first query row of the tile: the unit loads q[q_start : q_start + tile_q]
  UNIT_OWN_LO    the unit *owns* tile rows [own_lo, own_hi): only these rows of its output
  UNIT_OWN_HI    are used. Units of one head own disjoint rows; rows no unit owns have no
                 selected key (output 0, lse -inf). own_lo == own_hi marks a padding unit.
  UNIT_STEP_PTR  index of the unit's first step in ``steps``
  UNIT_STEP_CNT  number of steps; the unit visits steps[ptr : ptr + cnt] in order
  Units may point at the same rows (the heads of a shared mask, the interior units of a tall
  row group visit the same tiles with the same rectangles): kernels only read ``steps``.

``steps``: int32 [S, STEP_COLS]; row s is one K/V tile visited by one unit.
  STEP_KV_START  first key of the tile: k[kv_start : kv_start + tile_kv]
  STEP_Q_LO      selected rows of this step, relative to the unit's tile: [q_lo, q_hi)
  STEP_Q_HI        (always inside [own_lo, own_hi))
  STEP_KV_LO     selected keys of this step, relative to the tile: [kv_lo, kv_hi)
  STEP_KV_HI
  A step selects exactly the rectangle rows [q_lo, q_hi) x keys [kv_lo, kv_hi); every other
  entry of the tile is masked (-inf before the softmax). A step is *full* when the rectangle
  is the whole tile (q_lo == 0, q_hi == tile_q, kv_lo == 0, kv_hi == tile_kv): kernels may
  skip masking then. The rectangles of one unit never overlap, so each selected interaction
  is computed exactly once. Padding steps have q_lo == q_hi (select nothing).

Outputs are *unit-major*: out_units [B, U, tile_q, D] and lse_units [B, U, tile_q] (float32,
natural log; -inf for a row with no selected key). The wrapper gathers the owned rows back
to [B, Lq, Hq, D]; this keeps every kernel store a whole, non-overlapping tile.
"""

UNIT_HEAD, UNIT_Q_START, UNIT_OWN_LO, UNIT_OWN_HI, UNIT_STEP_PTR, UNIT_STEP_CNT = range(6)
UNIT_COLS = 6
STEP_KV_START, STEP_Q_LO, STEP_Q_HI, STEP_KV_LO, STEP_KV_HI = range(5)
STEP_COLS = 5

# ``row_index``: int32 [Hq, q_len] (q_len = the true Lq), part of every plan. For query head h
# and row i it is the flat index u * tile_q + r of the unit row that owns (h, i), or the
# sentinel U * tile_q for a row no unit owns. Backends gather
#   out[b, i, h] = concat(out_units.reshape(B, U * tile_q, D), zeros)[b, row_index[h, i]]
# (and likewise lse with -inf as the sentinel value).


def gather_rows(out_units, lse_units, row_index):
    """Unit-major kernel outputs -> out [B, Lq, Hq, D] and lse [B, Hq, Lq] (float32).

    out_units: [B, U, tile_q, D]; lse_units: [B, U, tile_q] float32; row_index: int32 [Hq, Lq].
    Rows no unit owns get 0 and -inf.
    """
    import jax.numpy as jnp  # local: keeps this module importable without jax for docs

    B, U, T, D = out_units.shape
    flat = out_units.reshape(B, U * T, D)
    flat = jnp.concatenate([flat, jnp.zeros((B, 1, D), flat.dtype)], axis=1)
    lflat = lse_units.reshape(B, U * T).astype(jnp.float32)
    lflat = jnp.concatenate([lflat, jnp.full((B, 1), -jnp.inf, jnp.float32)], axis=1)
    out = jnp.take(flat, row_index.T, axis=1)            # [B, Lq, Hq, D]
    lse = jnp.take(lflat, row_index, axis=1)              # [B, Hq, Lq]
    return out, lse
