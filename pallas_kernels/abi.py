"""The plan ABI: the int32 arrays a kernel executes, and nothing about masks.

A plan is produced on the host by ``tessera_jax.planning.planner`` and executed by any backend
(``pallas_kernels.xla.executor``, ``pallas_kernels.triton.forward``, ``pallas_kernels.mosaic.forward``).
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

``steps``: int32 [S, STEP_COLS] (8 bytes a row); row s is one K/V tile visited by one unit.
  STEP_KV_START  first key of the tile: k[kv_start : kv_start + tile_kv]
  STEP_RECT      the selected rectangle, four bytes of one int32:
                   rect = q_lo | q_hi << 8 | kv_lo << 16 | kv_hi << 24
                 rows [q_lo, q_hi) of the unit's tile (always inside [own_lo, own_hi)) and
                 keys [kv_lo, kv_hi) of the K/V tile, each field in 0..255 (tiles are at most
                 MAX_TILE = 255 rows / keys). kv_hi >= 128 sets bit 31, so rect can be
                 negative: decode a field as ``(rect >> shift) & 0xFF``, which is exact under
                 an arithmetic shift too (``pack_rect`` / ``unpack_rect`` / ``unpack_steps``).
  A step selects exactly the rectangle rows [q_lo, q_hi) x keys [kv_lo, kv_hi); every other
  entry of the tile is masked (-inf before the softmax). A step is *full* when the rectangle
  is the whole tile, rect == pack_rect(0, tile_q, 0, tile_kv) (``full_rect``): kernels may
  skip masking then. The rectangles of one unit never overlap, so each selected interaction
  is computed exactly once. Padding steps have q_lo == q_hi (select nothing; an all-zero row
  is one).

Outputs are *unit-major*: out_units [B, U, tile_q, D] and lse_units [B, U, tile_q] (float32,
natural log; -inf for a row with no selected key). The wrapper gathers the owned rows back
to [B, Lq, Hq, D]; this keeps every kernel store a whole, non-overlapping tile.
"""

import numpy as np

UNIT_HEAD, UNIT_Q_START, UNIT_OWN_LO, UNIT_OWN_HI, UNIT_STEP_PTR, UNIT_STEP_CNT = range(6)
UNIT_COLS = 6
STEP_KV_START, STEP_RECT = range(2)
STEP_COLS = 2
MAX_TILE = 255          # the largest tile_q / tile_kv: a rectangle bound must fit one byte
# Columns of ``unpack_steps``'s view [S, 5] (the rectangle's four bounds unpacked).
VIEW_KV_START, VIEW_Q_LO, VIEW_Q_HI, VIEW_KV_LO, VIEW_KV_HI = range(5)
VIEW_COLS = 5


def check_tiles(tile_q, tile_kv) -> None:
    """ValueError unless both tiles fit the packed rectangle (1..MAX_TILE)."""
    for name, val in (("tile_q", tile_q), ("tile_kv", tile_kv)):
        if not 1 <= int(val) <= MAX_TILE:
            raise ValueError(f"{name}={val} does not fit the plan ABI's packed step rectangle "
                             f"(each bound is one byte): tiles must be in [1, {MAX_TILE}]")


def _is_jax(*xs) -> bool:
    return any(type(x).__module__.startswith(("jax", "jaxlib")) for x in xs)


def pack_rect(q_lo, q_hi, kv_lo, kv_hi):
    """The STEP_RECT value of a rectangle (fields 0..255): int32, NumPy or jnp like the input.

    NumPy inputs are combined in int64 and wrapped to int32 (kv_hi >= 128 gives a negative
    value); jnp int32 inputs wrap by themselves. Python ints give a NumPy int32 scalar.
    """
    if _is_jax(q_lo, q_hi, kv_lo, kv_hi):
        import jax.numpy as jnp

        a, b, c, d = (jnp.asarray(x, jnp.int32) for x in (q_lo, q_hi, kv_lo, kv_hi))
        return a | (b << 8) | (c << 16) | (d << 24)
    a, b, c, d = (np.asarray(x, np.int64) for x in (q_lo, q_hi, kv_lo, kv_hi))
    return (a | (b << 8) | (c << 16) | (d << 24)).astype(np.int32)[()]


def full_rect(tile_q: int, tile_kv: int) -> int:
    """The STEP_RECT of a full step (the whole tile), as a Python int in int32 range."""
    return int(pack_rect(0, tile_q, 0, tile_kv))


def unpack_rect(x):
    """(q_lo, q_hi, kv_lo, kv_hi) of STEP_RECT values (int, NumPy or jnp; any integer dtype)."""
    return x & 0xFF, (x >> 8) & 0xFF, (x >> 16) & 0xFF, (x >> 24) & 0xFF


def unpack_steps(steps):
    """int32 [S, VIEW_COLS] (kv_start, q_lo, q_hi, kv_lo, kv_hi) of steps [S, STEP_COLS]: the
    unpacked view, for tests, plots and debugging (NumPy in, NumPy out; jnp in, jnp out)."""
    xp = np
    if _is_jax(steps):
        import jax.numpy as jnp
        xp = jnp
    else:
        steps = np.asarray(steps)
    if steps.ndim != 2 or steps.shape[1] != STEP_COLS:
        raise ValueError(f"steps must have shape [S, {STEP_COLS}], got {tuple(steps.shape)}")
    r = steps[:, STEP_RECT]
    return xp.stack([steps[:, STEP_KV_START], *unpack_rect(r)], axis=1).astype(xp.int32)


# ``row_index``: int32 [Hq, q_len] (q_len = the true Lq), part of every plan. For query head h
# and row i it is the flat index u * tile_q + r of the unit row that owns (h, i), or the
# sentinel U * tile_q for a row no unit owns. Backends gather
#   out[b, i, h] = concat(out_units.reshape(B, U * tile_q, D), zeros)[b, row_index[h, i]]
# (and likewise lse with -inf as the sentinel value). ``row_index_from_units`` computes the same
# array on the device from ``units``, so a request need not copy it (Hq * Lq * 4 bytes: 3.6 MB
# for 8 heads at HunyuanVideo 720p); backends take ``row_index=None`` to mean that.


def row_index_from_units(units, num_q_heads: int, q_len: int, tile_q: int):
    """``row_index`` [Hq, Lq] from ``units`` (a jnp program: one scatter of U * tile_q rows).

    Equal to the planner's host array: units of one head own disjoint rows, rows past Lq and
    padding units (own_lo == own_hi) write nothing, every other entry is the sentinel U * tile_q.
    """
    import jax.numpy as jnp

    units = jnp.asarray(units)
    U = units.shape[0]
    r = jnp.arange(tile_q, dtype=jnp.int32)[None, :]
    head = units[:, UNIT_HEAD, None]
    row = units[:, UNIT_Q_START, None] + r
    own = (r >= units[:, UNIT_OWN_LO, None]) & (r < units[:, UNIT_OWN_HI, None]) & (row < q_len)
    size = num_q_heads * q_len
    # Rows no unit owns get index ``size`` (out of bounds): dropped by the scatter.
    dest = jnp.where(own, head * q_len + row, size).reshape(-1)
    src = (jnp.arange(U, dtype=jnp.int32)[:, None] * tile_q + r).reshape(-1)
    flat = jnp.full((size,), U * tile_q, jnp.int32)
    flat = flat.at[dest].set(src, mode="drop")
    return flat.reshape(num_q_heads, q_len)


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
