"""The plan ABI: the int32 arrays a kernel executes, and nothing about masks.

A plan is produced on the host by ``tessera_jax.planning.planner`` (or on the device by
``tessera_jax.planning.device``) and executed by any backend family's ``ops`` module
(``pallas_kernels.{mosaic,triton,xla}.ops``, the contract of ``pallas_kernels.contract``),
one pass at a time: a ``PassPlan`` holds the arrays below and the static integers. Kernels
see only those; they never see a mask. ``check_plan`` is the one validator of a concrete
(NumPy) plan; ``pallas_kernels.step_masks`` decodes a step's mask in the Pallas kernels.

Static parameters (Python ints, part of the compiled executable):
  tile_q        rows of one work unit's query tile (the Q tile height the kernel loads)
  tile_kv       keys of one K/V tile (a step)
  num_units     capacity U of the ``units`` array, >= the real count
  num_steps     capacity S of the ``steps`` array, >= the real count
  max_steps     capacity M >= the largest step_count of any unit; only the XLA executor
                needs it, kernels loop over ``step_count`` dynamically
                The planner rounds each capacity up to a bucket (``planner.bucket``): n itself
                up to 8, else the next multiple of 2^(k-3) where 2^(k-1) < n <= 2^k (four
                buckets per octave: under 25% padding, and masks of similar size share one
                compiled executable). The kernels need no particular capacity.
  q_len_padded, kv_len_padded
                the sequence lengths the plan indexes into. They are >= Lq / Lkv; the
                backend pads q (k, v) with zeros up to them when they differ. Every tile the
                plan names lies inside them: q_start + tile_q <= q_len_padded and
                kv_start + tile_kv <= kv_len_padded.

``units``: int32 [U, UNIT_COLS]; row u is one work unit, in schedule order (the kernels'
grids launch unit u as program u, so the heaviest units start first).
  UNIT_HEAD      query head h (the K/V head is h // (Hq // Hkv))
  UNIT_Q_START   first query row of the tile: the unit loads q[q_start : q_start + tile_q]
  UNIT_OWN_LO    the unit *owns* tile rows [own_lo, own_hi): only these rows of its output
  UNIT_OWN_HI    are used. Units of one head own disjoint rows; rows no unit owns have no
                 selected key (output 0, lse -inf). own_lo == own_hi marks a padding unit.
  UNIT_STEP_PTR  index of the unit's first step in ``steps``
  UNIT_STEP_CNT  number of steps; the unit visits steps[ptr : ptr + cnt] in order
  Units may point at the same rows (the heads of a shared mask, the interior units of a tall
  row group visit the same tiles with the same rectangles): kernels only read ``steps``.

``steps``: int32 [S, STEP_COLS] (16 bytes a row); row s is one K/V tile visited by one unit.
  STEP_KV_START  first key of the tile: k[kv_start : kv_start + tile_kv]
  STEP_RECT      the step's bounding rectangle, four bytes of one int32:
                   rect = q_lo | q_hi << 8 | kv_lo << 16 | kv_hi << 24
                 rows [q_lo, q_hi) of the unit's tile (always inside [own_lo, own_hi)) and
                 keys [kv_lo, kv_hi) of the K/V tile, each field in 0..255 (tiles are at most
                 MAX_TILE = 255 rows / keys). kv_hi >= 128 sets bit 31, so rect can be
                 negative: decode a field as ``(rect >> shift) & 0xFF``, which is exact under
                 an arithmetic shift too (``pack_rect`` / ``unpack_rect`` / ``unpack_steps``;
                 compiled loops shift by ``RECT_Q_HI_SHIFT`` etc. themselves).
  STEP_CUTS_A,   the *grid* inside the rectangle, for a tile that several logical blocks
  STEP_CUTS_B    touch (so that the tile is computed once, however many blocks select parts
                 of it). STEP_CUTS_B == 0: no grid, the whole rectangle is selected (a *plain*
                 step; STEP_CUTS_A is 0 too). Otherwise the rectangle is cut into at most
                 GRID x GRID = 4 x 4 cells by three row cuts q_lo <= q1 <= q2 <= q3 <= q_hi and
                 three key cuts kv_lo <= k1 <= k2 <= k3 <= kv_hi (unused cuts repeat a bound,
                 leaving empty segments), and a 16-bit matrix says which cells are selected:
                   cuts_a = q1 | q2 << 8 | q3 << 16 | k1 << 24
                   cuts_b = k2 | k3 << 8 | bits << 16,   bits != 0
                 Row r of the tile (q_lo <= r < q_hi) lies in row segment
                 i = (r >= q1) + (r >= q2) + (r >= q3), key c (kv_lo <= c < kv_hi) in key segment
                 j = (c >= k1) + (c >= k2) + (c >= k3); (r, c) is selected iff bit 4 * i + j of
                 ``bits`` is set (``pack_grid`` / ``unpack_grid`` / ``grid_mask``). The same
                 iota comparisons a causal mask uses, no gather.
  STEP_CUTS_B == BITMAP_FLAG (= 1, never a grid: a grid's bits are non-zero) marks a *bitmap
                 step*, for a tile cut by more than GRID blocks per axis (blocks of 1-8
                 tokens): its selection is a bit per entry. STEP_CUTS_A = ``off``, an offset
                 in int32 words into the flat view ``steps.reshape(-1)``, a multiple of 4
                 (a row of ``steps``). The words lie in rows of ``steps`` that no unit's step
                 range [ptr, ptr + cnt) covers (the planner puts them after the step rows,
                 ``Plan.num_steps`` rows, each bitmap from a row boundary: ``bitmap_rows``
                 rows), W = ceil(tile_kv / 32) (``bitmap_words``) columns of tile_q words each:
                   word(r, w) = steps.reshape(-1)[off + w * tile_q + r]
                 and (r, c) is selected iff bit c % 32 of word(r, c // 32) is set (bit 31: a
                 negative int32). Bits outside the step's rectangle (and keys >= tile_kv) are 0;
                 the rectangle is the bounding box of the selected entries (the planner's is
                 tight; a valid plan needs it non-empty and at least one bit set). Steps may
                 share one bitmap. ``pack_bitmap`` / ``unpack_bitmap`` convert a [tile_q,
                 tile_kv] selection; ``step_mask`` evaluates any step (plain, grid, bitmap).
                 The planner emits a bitmap step only for a (unit, tile) whose selection needs
                 more than a GRID x GRID grid (``tile_once`` below); a bitmap step is never full.
  STEP_CUTS_B == GATHER_FLAG (= 2) or GATHER_FULL_FLAG (= 3) marks a *gathered step*: its
                 K/V tile is not one run of keys but G = tile_kv / GATHER_ROWS chunks of
                 GATHER_ROWS (= 8) keys each, from anywhere (a TMA copy per chunk fills the
                 8-row tiled SMEM layout), and it selects a row set x key set of that tile.
                 STEP_CUTS_A = ``off`` (as a bitmap's: a multiple of 4 into the flat view, in rows
                 no unit visits), and ``gather_words(tile_q, tile_kv)`` words from there:
                   chunk starts  G words: key c of the tile is k[start[c // 8] + c % 8];
                                 each start a multiple of GATHER_ROWS, start + 8 <= kv_len_padded
                   key bits      W = bitmap_words(tile_kv) words: key c selected iff bit c % 32
                                 of word c // 32
                   row bits      bitmap_words(tile_q) words: tile row r selected iff bit r % 32
                                 of word r // 32
                 (r, c) is selected iff both bits are set (``pack_gather`` / ``unpack_gather``):
                 one rank-one selection, so a kernel masks it with a per-key bias and a per-row
                 penalty, no per-entry test. GATHER_FULL_FLAG: every bit is set (no mask at
                 all). The rectangle is the bounding box of the selection; STEP_KV_START is the
                 first chunk's start (kernels ignore it). Unused chunks repeat a start, with no
                 key bit set. Only backends whose kernels gather take such steps
                 (``check_plan(..., gather=True)``); the host planner's ``gather`` policy emits
                 them.
  A step selects exactly those entries; every other entry of the tile is masked (-inf before
  the softmax). A step is *full* when it is plain and the rectangle is the whole tile,
  rect == pack_rect(0, tile_q, 0, tile_kv) (``full_rect``) and cuts_b == 0: kernels may skip
  masking then. The selections of one unit's steps never overlap, so each selected interaction
  is computed exactly once. Padding steps have q_lo == q_hi (select nothing; an all-zero row
  is one).
  Invariant of a planner's plan (``tile_once``): a unit visits each K/V tile (kv_start) at most
  once, so a plan computes at most tile_q x tile_kv interactions per (unit, tile), whatever
  the logical block sizes: the one step of a (unit, tile) is plain if its selection is a
  rectangle, a grid if it fits GRID x GRID, else a bitmap.

Outputs are *unit-major*: out_units [B, U, tile_q, D] and lse_units [B, U, tile_q] (float32,
natural log; -inf for a row with no selected key). The backend gathers the owned rows back
to [B, Lq, Hq, D]; this keeps every kernel store a whole, non-overlapping tile. A kernel may
instead store each unit's owned rows in place into [B, Lq_padded, Hq, D] where the plan says
its units own every row (``PassPlan.rows_owned``; Mosaic GPU's forward and dq, by the rule of
``PassPlan.partial_groups``): no row is then left unwritten, and only lse is gathered.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

UNIT_HEAD, UNIT_Q_START, UNIT_OWN_LO, UNIT_OWN_HI, UNIT_STEP_PTR, UNIT_STEP_CNT = range(6)
UNIT_COLS = 6
STEP_KV_START, STEP_RECT, STEP_CUTS_A, STEP_CUTS_B = range(4)
STEP_COLS = 4
GRID = 4                # a grid step has at most GRID row segments and GRID key segments
GRID_BITS_SHIFT = 16    # the cell bits' offset in STEP_CUTS_B
BITMAP_FLAG = 1         # STEP_CUTS_B of a bitmap step (bits in words past the step rows)
WORD_BITS = 32          # keys per bitmap word
GATHER_FLAG = 2         # STEP_CUTS_B of a gathered step (chunked K/V tile, row x key bits)
GATHER_FULL_FLAG = 3    # ... of a gathered step selecting its whole tile (no mask)
GATHER_ROWS = 8         # keys per chunk of a gathered step's tile
MAX_TILE = 255          # the largest tile_q / tile_kv: a rectangle bound must fit one byte
# Bit offsets of the four bytes of STEP_RECT: rect = q_lo << RECT_Q_LO_SHIFT | q_hi <<
# RECT_Q_HI_SHIFT | kv_lo << RECT_KV_LO_SHIFT | kv_hi << RECT_KV_HI_SHIFT. Plain ints, so
# numba-compiled planning loops (tessera_jax.planning.loops) pack with them as constants.
RECT_Q_LO_SHIFT, RECT_Q_HI_SHIFT, RECT_KV_LO_SHIFT, RECT_KV_HI_SHIFT = 0, 8, 16, 24
# Columns of ``unpack_steps``'s view [S, 5] (the rectangle's four bounds unpacked), and of its
# grid view [S, 12] (``unpack_steps(steps, grid=True)``: the same five, then the cuts and bits;
# a plain step reads q1 = q2 = q3 = q_hi, k1 = k2 = k3 = kv_hi, bits = 1: one cell, selected).
VIEW_KV_START, VIEW_Q_LO, VIEW_Q_HI, VIEW_KV_LO, VIEW_KV_HI = range(5)
VIEW_COLS = 5
VIEW_Q1, VIEW_Q2, VIEW_Q3, VIEW_K1, VIEW_K2, VIEW_K3, VIEW_BITS = range(5, 12)
VIEW_GRID_COLS = 12


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["units", "steps", "row_index"],
                   meta_fields=["tile_q", "tile_kv", "q_len_padded", "kv_len_padded",
                                "max_steps", "all_full", "rows_owned", "partial_groups"])
@dataclasses.dataclass(frozen=True, eq=False)       # identity hash: caches key on the object
class PassPlan:
    """The plan of one kernel pass (a forward, or a backward's dq or dk/dv pass): the ABI
    arrays above and the static integers a backend compiles against. A pytree: NumPy leaves
    for a host plan (the planner's, cached, so identity keys device copies), traced leaves for
    a device plan. ``row_index`` None: made on the device from ``units``. ``all_full``: True /
    False when the planner knows whether every visited step is full (a *trusted* plan: no
    backend walks its steps), None when unknown (a concrete plan is then checked).
    ``rows_owned``: True when the planner knows that its units own every query row (< the
    true Lq) of every query head, so a kernel may store rows in place and leave none unwritten
    (``units_own_all_rows``); False: unknown, the kernel's output is gathered.
    ``partial_groups``: the fraction of the units' owned STORE_ROWS-row groups that a unit owns
    only in part (``partial_groups``; 0.0 where the planner did not count them), which an
    in-place store writes by several copies."""

    units: np.ndarray | jax.Array
    steps: np.ndarray | jax.Array
    row_index: np.ndarray | jax.Array | None
    tile_q: int
    tile_kv: int
    q_len_padded: int
    kv_len_padded: int
    max_steps: int
    all_full: bool | None = None
    rows_owned: bool = False
    partial_groups: float = 0.0


def bitmap_words(tile_kv: int) -> int:
    """W: the word columns of a bitmap step's bits (ceil(tile_kv / WORD_BITS))."""
    return -(-int(tile_kv) // WORD_BITS)


def bitmap_rows(tile_q: int, tile_kv: int) -> int:
    """Rows of ``steps`` one bitmap fills (its W * tile_q words from a row boundary, the last
    row padded with zeros): ceil(bitmap_words(tile_kv) * tile_q / STEP_COLS)."""
    return -(-bitmap_words(tile_kv) * int(tile_q) // STEP_COLS)


def _bits(sel):
    """int32 words [..., ceil(n / 32)] of bool [..., n]: bit i % 32 of word i // 32."""
    sel = np.asarray(sel, bool)
    n = sel.shape[-1]
    W = bitmap_words(n)
    if n != W * WORD_BITS:
        pad = np.zeros(sel.shape[:-1] + (W * WORD_BITS,), bool)
        pad[..., :n] = sel
        sel = pad
    packed = np.packbits(sel, axis=-1, bitorder="little")            # [..., 4 W] bytes
    return np.ascontiguousarray(packed).view("<i4").astype(np.int32)


def pack_bits(sel):
    """int32 words [..., ceil(n / 32)] of bool [..., n], bit i % 32 of word i // 32: the
    packing of every word layout here (bitmap steps, gathered steps' key and row bits)."""
    return _bits(sel)


def _unbits(words, n: int):
    """bool [..., n] of ``_bits``' words [..., ceil(n / 32)]."""
    w = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    c = np.arange(n)
    return ((w[..., c // WORD_BITS] >> (c % WORD_BITS)) & 1) == 1


def pack_bitmap(sel):
    """The W * tile_q words (int32, NumPy) of a bitmap step selecting ``sel`` (bool [tile_q,
    tile_kv], or [..., tile_q, tile_kv] for several: words [..., W * tile_q]): word(r, w) at
    w * tile_q + r holds bit c % 32 for key c = 32 w + c % 32."""
    w = _bits(sel)                                                       # [..., T, W]
    return np.ascontiguousarray(np.swapaxes(w, -1, -2)).reshape(w.shape[:-2] + (-1,))


def unpack_bitmap(words, tile_q: int, tile_kv: int):
    """bool [..., tile_q, tile_kv]: the selection of bitmap words [..., W * tile_q] (NumPy)."""
    W = bitmap_words(tile_kv)
    w = np.asarray(words).reshape(np.shape(words)[:-1] + (W, tile_q))
    return _unbits(np.swapaxes(w, -1, -2), tile_kv)


def gather_chunks(tile_kv: int) -> int:
    """G: the chunks of a gathered step's K/V tile (tile_kv / GATHER_ROWS)."""
    if int(tile_kv) % GATHER_ROWS:
        raise ValueError(f"gathered steps need tile_kv a multiple of {GATHER_ROWS}, got {tile_kv}")
    return int(tile_kv) // GATHER_ROWS


def gather_run(gather) -> int:
    """Keys a kernel copies at once of a ``check_plan`` ``gather`` value (0: no gathering;
    True: GATHER_ROWS)."""
    if gather is True:
        return GATHER_ROWS
    if not gather:
        return 0
    if isinstance(gather, (int, np.integer)) and gather > 0 and gather % GATHER_ROWS == 0:
        return int(gather)
    raise ValueError(f"gather must be a bool or a positive multiple of {GATHER_ROWS} keys, "
                     f"got {gather!r}")


def gather_run_chunks(tile_kv: int, run: int) -> int:
    """Chunks of one copy run of ``run`` keys (a multiple of GATHER_ROWS dividing tile_kv)."""
    if isinstance(run, bool) or not isinstance(run, (int, np.integer)) or run <= 0 \
            or run % GATHER_ROWS or gather_chunks(tile_kv) % (run // GATHER_ROWS):
        raise ValueError(f"gather run must be a positive multiple of {GATHER_ROWS} keys "
                         f"dividing tile_kv={tile_kv}, got {run!r}")
    return int(run) // GATHER_ROWS


def gather_words(tile_q: int, tile_kv: int) -> int:
    """Words of one gathered step: chunk starts, key bits, row bits."""
    return gather_chunks(tile_kv) + bitmap_words(tile_kv) + bitmap_words(tile_q)


def gather_word_rows(tile_q: int, tile_kv: int) -> int:
    """Rows of ``steps`` one gathered step's words fill (from a row boundary)."""
    return -(-gather_words(tile_q, tile_kv) // STEP_COLS)


def pack_gather(starts, key_sel, row_sel):
    """The ``gather_words`` words (int32, NumPy) of a gathered step: chunk ``starts`` [..., G]
    (multiples of GATHER_ROWS), ``key_sel`` bool [..., tile_kv], ``row_sel`` bool [..., tile_q]."""
    starts = np.asarray(starts, np.int64)
    key_sel, row_sel = np.asarray(key_sel, bool), np.asarray(row_sel, bool)
    if starts.shape[-1] != gather_chunks(key_sel.shape[-1]):
        raise ValueError(f"pack_gather: {starts.shape[-1]} chunk starts for a tile of "
                         f"{key_sel.shape[-1]} keys")
    return np.concatenate([starts.astype(np.int32), _bits(key_sel), _bits(row_sel)], axis=-1)


def unpack_gather(words, tile_q: int, tile_kv: int):
    """(starts [..., G], key_sel bool [..., tile_kv], row_sel bool [..., tile_q]) of
    gathered-step words [..., gather_words] (NumPy)."""
    words = np.asarray(words)
    G, W = gather_chunks(tile_kv), bitmap_words(tile_kv)
    return (words[..., :G].astype(np.int64), _unbits(words[..., G:G + W], tile_kv),
            _unbits(words[..., G + W:G + W + bitmap_words(tile_q)], tile_q))


def gather_runs_ok(starts, tile_kv: int, run: int) -> bool:
    """Whether gathered steps' chunk starts (int [n, tile_kv / GATHER_ROWS]) come in runs of
    ``run`` consecutive keys at stage positions aligned to it, as a kernel copying ``run``
    keys at once reads them."""
    m = gather_run_chunks(tile_kv, run)
    runs = np.asarray(starts).reshape(len(starts), gather_chunks(tile_kv) // m, m)
    return bool((runs == runs[:, :, :1] + GATHER_ROWS * np.arange(m)).all())


def is_gather(cuts_b):
    """Whether STEP_CUTS_B values mark gathered steps (NumPy or jnp)."""
    return (cuts_b == GATHER_FLAG) | (cuts_b == GATHER_FULL_FLAG)


def step_keys(steps, s, tile_kv: int):
    """int [*shape(s), tile_kv]: the key row each key of step ``s``'s K/V tile reads:
    kv_start + c, or for a gathered step start[c // GATHER_ROWS] + c % GATHER_ROWS (NumPy or
    jnp; a jnp read of other steps' words is clamped and unused)."""
    if not _is_jax(steps, s):
        steps, s = np.asarray(steps), np.asarray(s)
    return tile_keys(steps[s], steps.reshape(-1), tile_kv)


def tile_keys(st, flat, tile_kv: int):
    """``step_keys`` of step rows ``st`` [..., STEP_COLS] whose words are in ``flat``
    (``steps.reshape(-1)``)."""
    xp = jnp if _is_jax(st, flat) else np
    c = xp.arange(tile_kv)
    plain = st[..., STEP_KV_START, None] + c
    if tile_kv % GATHER_ROWS:
        return plain
    idx = xp.clip(st[..., STEP_CUTS_A, None] + c // GATHER_ROWS, 0, flat.shape[0] - 1)
    gathered = flat[idx] + c % GATHER_ROWS
    return xp.where(is_gather(st[..., STEP_CUTS_B, None]), gathered, plain)


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
        a, b, c, d = (jnp.asarray(x, jnp.int32) for x in (q_lo, q_hi, kv_lo, kv_hi))
        return _pack(a, b, c, d)
    a, b, c, d = (np.asarray(x, np.int64) for x in (q_lo, q_hi, kv_lo, kv_hi))
    return _pack(a, b, c, d).astype(np.int32)[()]


def _pack(a, b, c, d):
    return a | (b << RECT_Q_HI_SHIFT) | (c << RECT_KV_LO_SHIFT) | (d << RECT_KV_HI_SHIFT)


assert RECT_Q_LO_SHIFT == 0     # _pack and unpack_rect leave the low byte unshifted


def full_rect(tile_q: int, tile_kv: int) -> int:
    """The STEP_RECT of a full step (the whole tile), as a Python int in int32 range."""
    return int(pack_rect(0, tile_q, 0, tile_kv))


def unpack_rect(x):
    """(q_lo, q_hi, kv_lo, kv_hi) of STEP_RECT values (int, NumPy or jnp; any integer dtype)."""
    # q_lo is the low byte (RECT_Q_LO_SHIFT == 0): no shift, so kernels trace one op less.
    return (x & 0xFF, (x >> RECT_Q_HI_SHIFT) & 0xFF, (x >> RECT_KV_LO_SHIFT) & 0xFF,
            (x >> RECT_KV_HI_SHIFT) & 0xFF)


def pack_grid(q_cuts, kv_cuts, bits):
    """(cuts_a, cuts_b) of a grid step: ``q_cuts`` = (q1, q2, q3), ``kv_cuts`` = (k1, k2, k3)
    (each 0..255, non-decreasing inside the step's rectangle), ``bits`` the 16-bit cell matrix
    (bit 4 * i + j: row segment i, key segment j; non-zero). NumPy int32 scalars or arrays."""
    q1, q2, q3 = (np.asarray(x, np.int64) for x in q_cuts)
    k1, k2, k3 = (np.asarray(x, np.int64) for x in kv_cuts)
    b = np.asarray(bits, np.int64)
    a = (q1 | (q2 << 8) | (q3 << 16) | (k1 << 24)).astype(np.int32)
    c = (k2 | (k3 << 8) | (b << GRID_BITS_SHIFT)).astype(np.int32)
    return a[()], c[()]


def unpack_grid(cuts_a, cuts_b):
    """((q1, q2, q3), (k1, k2, k3), bits) of STEP_CUTS_A / STEP_CUTS_B values (int, NumPy or
    jnp). Meaningful only where cuts_b != 0 (a grid step)."""
    return (((cuts_a & 0xFF), (cuts_a >> 8) & 0xFF, (cuts_a >> 16) & 0xFF),
            ((cuts_a >> 24) & 0xFF, cuts_b & 0xFF, (cuts_b >> 8) & 0xFF),
            (cuts_b >> GRID_BITS_SHIFT) & 0xFFFF)


def grid_nibble(cuts_b, n: int):
    """Row ``n`` of a grid step's GRID x GRID cell matrix from its STEP_CUTS_B: GRID bits,
    bit j for key segment j (int, NumPy or jnp)."""
    return (cuts_b >> (GRID_BITS_SHIFT + GRID * n)) & 0xF


def grid_mask(rect, cuts_a, cuts_b, rows, cols):
    """Whether entry (rows, cols) of a step's tile is selected (broadcasting ``rows`` against
    ``cols``; NumPy or jnp): the rectangle, and for a grid step (cuts_b != 0) its cell bit.
    The reference rule every kernel implements."""
    q_lo, q_hi, kv_lo, kv_hi = unpack_rect(rect)
    (q1, q2, q3), (k1, k2, k3), bits = unpack_grid(cuts_a, cuts_b)
    inside = (rows >= q_lo) & (rows < q_hi) & (cols >= kv_lo) & (cols < kv_hi)
    i = (rows >= q1).astype(np.int32) + (rows >= q2) + (rows >= q3)
    j = (cols >= k1).astype(np.int32) + (cols >= k2) + (cols >= k3)
    cell = ((bits >> (GRID * i + j)) & 1) == 1
    return inside & ((cuts_b == 0) | cell)


def step_mask(steps, s, tile_q: int, tile_kv: int):
    """bool [*shape(s), tile_q, tile_kv]: whether entry (r, c) of the tile of step ``s`` (an
    index or an index array into ``steps`` [S, STEP_COLS]) is selected, for every step kind:
    a plain step's rectangle, a grid step's cells (``grid_mask``), a bitmap step's bits (bit
    c % 32 of steps.reshape(-1)[off + (c // 32) * tile_q + r], inside its rectangle). NumPy or
    jnp (a jnp gather, clamped: another step's cuts_a is no offset, its words are unused).
    A gathered step: its row bits x key bits (over the keys of its chunks, ``step_keys``).
    The reference rule every kernel implements, and what every test evaluates plans with."""
    xp = np
    if _is_jax(steps, s):
        xp = jnp
    else:
        steps, s = np.asarray(steps), np.asarray(s)
    st = steps[s].astype(xp.int32) if xp is not np else steps[s].astype(np.int64)
    rect, ca, cb = (st[..., k, None, None] for k in (STEP_RECT, STEP_CUTS_A, STEP_CUTS_B))
    rows = xp.arange(tile_q)[:, None]
    cols = xp.arange(tile_kv)[None, :]
    sel = grid_mask(rect, ca, cb, rows, cols)    # a bitmap step: False (its grid bits are 0)
    bitmap = cb == BITMAP_FLAG
    q_lo, q_hi, kv_lo, kv_hi = unpack_rect(rect)
    inside = (rows >= q_lo) & (rows < q_hi) & (cols >= kv_lo) & (cols < kv_hi)
    flat = steps.reshape(-1)
    last = flat.shape[0] - 1
    idx = xp.where(bitmap, ca, 0) + (cols // WORD_BITS) * tile_q + rows
    idx = xp.clip(idx, 0, last)
    word = flat[idx]
    bit = ((word >> (cols % WORD_BITS)) & 1) == 1
    sel = sel | (bitmap & inside & bit)
    if tile_kv % GATHER_ROWS:
        return sel
    gather = is_gather(cb)
    kw = ca + gather_chunks(tile_kv)
    rw = kw + bitmap_words(tile_kv)
    key = (flat[xp.clip(kw + cols // WORD_BITS, 0, last)] >> (cols % WORD_BITS)) & 1
    row = (flat[xp.clip(rw + rows // WORD_BITS, 0, last)] >> (rows % WORD_BITS)) & 1
    return xp.where(gather, inside & (key == 1) & (row == 1), sel)


def unpack_steps(steps, *, grid: bool = False):
    """int32 [S, VIEW_COLS] (kv_start, q_lo, q_hi, kv_lo, kv_hi) of steps [S, STEP_COLS]: the
    unpacked view, for tests, plots and debugging (NumPy in, NumPy out; jnp in, jnp out).
    ``grid=True``: [S, VIEW_GRID_COLS], the same five columns then q1, q2, q3, k1, k2, k3, bits
    (``VIEW_Q1`` ... ``VIEW_BITS``); a plain step (cuts_b == 0) reads as the grid of one
    selected cell (cuts at q_hi / kv_hi, bits 1), so every plain or grid row is evaluated by one
    rule. A bitmap or gathered step reads as cuts at q_hi / kv_hi and bits 0: its
    selection is in its words (``step_mask``). Pass step rows only: word rows are no steps."""
    xp = np
    if _is_jax(steps):
        xp = jnp
    else:
        steps = np.asarray(steps)
    if steps.ndim != 2 or steps.shape[1] != STEP_COLS:
        raise ValueError(f"steps must have shape [S, {STEP_COLS}], got {tuple(steps.shape)}")
    r = steps[:, STEP_RECT]
    rect = unpack_rect(r)
    cols = [steps[:, STEP_KV_START], *rect]
    if grid:
        cb = steps[:, STEP_CUTS_B]
        bitmap = (cb == BITMAP_FLAG) | is_gather(cb)
        plain = (cb == 0) | bitmap
        (q1, q2, q3), (k1, k2, k3), bits = unpack_grid(steps[:, STEP_CUTS_A], cb)
        q_hi, kv_hi = rect[1], rect[3]
        cols += [xp.where(plain, q_hi, q1), xp.where(plain, q_hi, q2), xp.where(plain, q_hi, q3),
                 xp.where(plain, kv_hi, k1), xp.where(plain, kv_hi, k2),
                 xp.where(plain, kv_hi, k3), xp.where(bitmap, 0, xp.where(plain, 1, bits))]
    return xp.stack(cols, axis=1).astype(xp.int32)


def step_cells(rect, cuts_a, cuts_b):
    """The selected cells of plain and grid steps as rectangles (NumPy arrays of N step values):
    returns (step, q_lo, q_hi, kv_lo, kv_hi) int64 arrays, one entry per selected non-empty
    cell, in step order (a plain step: its rectangle, if not empty). The selections of
    ``grid_mask``. ValueError for a bitmap step (its cells need its words: ``selected_cells``)."""
    rect, ca, cb = (np.asarray(x, np.int64).reshape(-1) for x in (rect, cuts_a, cuts_b))
    if ((cb == BITMAP_FLAG) | is_gather(cb)).any():
        raise ValueError("step_cells: a bitmap or gathered step's selection is in its words; "
                         "use selected_cells(steps, s, tile_q, tile_kv)")
    q_lo, q_hi, kv_lo, kv_hi = unpack_rect(rect)
    (q1, q2, q3), (k1, k2, k3), bits = unpack_grid(ca, cb)
    plain = cb == 0
    qb = np.stack([q_lo, np.where(plain, q_hi, q1), np.where(plain, q_hi, q2),
                   np.where(plain, q_hi, q3), q_hi], axis=1)
    kb = np.stack([kv_lo, np.where(plain, kv_hi, k1), np.where(plain, kv_hi, k2),
                   np.where(plain, kv_hi, k3), kv_hi], axis=1)
    bits = np.where(plain, 1, bits)
    # Cell (i, j) = rows [qb[i], qb[i + 1]) x keys [kb[j], kb[j + 1]), clipped to the rectangle.
    i = np.repeat(np.arange(GRID), GRID)
    j = np.tile(np.arange(GRID), GRID)
    r0 = np.clip(qb[:, i], q_lo[:, None], q_hi[:, None])
    r1 = np.clip(qb[:, i + 1], q_lo[:, None], q_hi[:, None])
    c0 = np.clip(kb[:, j], kv_lo[:, None], kv_hi[:, None])
    c1 = np.clip(kb[:, j + 1], kv_lo[:, None], kv_hi[:, None])
    on = (((bits[:, None] >> (GRID * i + j)[None]) & 1) == 1) & (r0 < r1) & (c0 < c1)
    s, c = np.nonzero(on)
    return s, r0[s, c], r1[s, c], c0[s, c], c1[s, c]


_CELL_CHUNK = 1 << 22     # entries of bitmap selections decoded at a time


def selected_cells(steps, s, tile_q: int, tile_kv: int):
    """The selected cells of steps ``s`` (indices into ``steps``, every kind) as rectangles:
    (i, q_lo, q_hi, kv_lo, kv_hi) int64 arrays, ``i`` the position in ``s`` (NumPy), sorted by
    i. Plain and grid steps as ``step_cells``; a bitmap or gathered step's runs of selected
    keys in each row, a run repeated in the rows below it merged into one rectangle (keys of
    the step's tile: a gathered step's are mapped to key rows by ``step_keys``). Disjoint within
    a step; their union is ``step_mask``."""
    steps = np.asarray(steps)
    s = np.asarray(s, np.int64).reshape(-1)
    st = steps[s].astype(np.int64)
    bm = (st[:, STEP_CUTS_B] == BITMAP_FLAG) | is_gather(st[:, STEP_CUTS_B])
    parts = []
    g = np.flatnonzero(~bm)
    if g.size:
        v, *box = step_cells(st[g, STEP_RECT], st[g, STEP_CUTS_A], st[g, STEP_CUTS_B])
        parts.append((g[v], *box))
    b = np.flatnonzero(bm)
    per = max(1, _CELL_CHUNK // (int(tile_q) * int(tile_kv)))
    for a in range(0, b.size, per):
        idx = b[a:a + per]
        sel = step_mask(steps, s[idx], tile_q, tile_kv)             # [n, T, Tk]
        pad = np.zeros(sel.shape[:2] + (tile_kv + 2,), np.int8)
        pad[:, :, 1:-1] = sel
        d = np.diff(pad, axis=2)
        n0, r0, c0 = np.nonzero(d == 1)                               # run starts, in order
        _, _, c1 = np.nonzero(d == -1)                                # and ends, same order
        # Merge a run with the same run in the row above (same step, keys): group by
        # (step, c0, c1) in row order, a new rectangle where the row is not the previous + 1.
        o = np.lexsort((r0, c1, c0, n0))
        n0, r0, c0, c1 = n0[o], r0[o], c0[o], c1[o]
        new = np.ones(len(n0), bool)
        new[1:] = ((n0[1:] != n0[:-1]) | (c0[1:] != c0[:-1]) | (c1[1:] != c1[:-1])
                   | (r0[1:] != r0[:-1] + 1))
        first = np.flatnonzero(new)
        last = np.r_[first[1:], len(n0)] - 1
        parts.append((idx[n0[first]], r0[first], r0[last] + 1, c0[first], c1[first]))
    if not parts:
        z = np.zeros(0, np.int64)
        return z, z, z, z, z
    i, q_lo, q_hi, kv_lo, kv_hi = (np.concatenate(x).astype(np.int64) for x in zip(*parts))
    o = np.lexsort((kv_lo, q_lo, i))
    return i[o], q_lo[o], q_hi[o], kv_lo[o], kv_hi[o]


def grid_problems(steps) -> list[str]:
    """What is wrong with the grid columns of the step rows ``steps`` (NumPy [S, STEP_COLS];
    pass step rows, not bitmap word rows): a plain step (cuts_b == 0) must have cuts_a == 0; a
    grid step needs bits != 0 and cuts non-decreasing inside its rectangle (q_lo <= q1 <= q2 <=
    q3 <= q_hi, kv_lo <= k1 <= k2 <= k3 <= kv_hi). Bitmap steps (cuts_b == BITMAP_FLAG) are
    skipped: ``bitmap_problems`` checks them with their words."""
    st = np.asarray(steps)
    bad = []
    plain = st[:, STEP_CUTS_B] == 0
    if ((st[:, STEP_CUTS_A] != 0) & plain).any():
        bad.append("steps: a plain step (cuts_b == 0) has cuts_a != 0")
    g = np.flatnonzero(~plain & (st[:, STEP_CUTS_B] != BITMAP_FLAG)
                       & ~is_gather(st[:, STEP_CUTS_B]))
    if g.size:
        sg = st[g].astype(np.int64)
        q_lo, q_hi, kv_lo, kv_hi = unpack_rect(sg[:, STEP_RECT])
        (q1, q2, q3), (k1, k2, k3), bits = unpack_grid(sg[:, STEP_CUTS_A], sg[:, STEP_CUTS_B])
        if (bits == 0).any():
            bad.append("steps: a grid step (cuts_b != 0) has no cell selected (bits == 0)")
        if not ((q_lo <= q1) & (q1 <= q2) & (q2 <= q3) & (q3 <= q_hi)).all():
            bad.append("steps: a grid step's row cuts are not q_lo <= q1 <= q2 <= q3 <= q_hi")
        if not ((kv_lo <= k1) & (k1 <= k2) & (k2 <= k3) & (k3 <= kv_hi)).all():
            bad.append("steps: a grid step's key cuts are not kv_lo <= k1 <= k2 <= k3 <= kv_hi")
    return bad


_WORD_CHUNK = 1 << 21     # bitmap words checked at a time


def bitmap_problems(steps, rows, tile_q: int, tile_kv: int, visited=None):
    """(what is wrong, word rows) for the bitmap steps at rows ``rows`` of ``steps`` (NumPy;
    rows whose cuts_b != BITMAP_FLAG are ignored): off = cuts_a a multiple of STEP_COLS, its
    W * tile_q words inside ``steps``, none in a ``visited`` row (bool [S]: the rows some unit's
    step range covers), no bit outside the step's rectangle (rows [q_lo, q_hi), keys [kv_lo,
    kv_hi)) or at a key >= tile_kv, the rectangle non-empty and some bit set. ``word rows`` is
    bool [S]: the rows holding these steps' words (all False where an offset is invalid)."""
    st = np.asarray(steps)
    S = st.shape[0]
    rows = np.asarray(rows, np.int64).reshape(-1)
    rows = rows[st[rows, STEP_CUTS_B] == BITMAP_FLAG]
    words_at = np.zeros(S, bool)
    if rows.size == 0:
        return [], words_at
    b = st[rows].astype(np.int64)       # one check per row (units sharing a row share it)
    off = b[:, STEP_CUTS_A]
    W = bitmap_words(tile_kv)
    n = W * int(tile_q)
    bad = []
    ok = (off % STEP_COLS == 0) & (off >= 0) & (off + n <= S * STEP_COLS)
    if not (off % STEP_COLS == 0).all():
        bad.append(f"steps: a bitmap step's offset (cuts_a) is not a multiple of {STEP_COLS}")
    if not ((off >= 0) & (off + n <= S * STEP_COLS)).all():
        bad.append(f"steps: a bitmap step's {n} words (tile_q x ceil(tile_kv / {WORD_BITS})) "
                   f"leave the {S} rows of steps")
    q_lo, q_hi, kv_lo, kv_hi = unpack_rect(b[:, STEP_RECT])
    if not ((q_lo < q_hi) & (kv_lo < kv_hi)).all():
        bad.append("steps: a bitmap step's rectangle is empty")
    b, off = b[ok], off[ok]
    q_lo, q_hi, kv_lo, kv_hi = q_lo[ok], q_hi[ok], kv_lo[ok], kv_hi[ok]
    words_at, r0, r1 = _word_rows(S, off, n)
    if _in_visited(visited, r0, r1):
        bad.append("steps: a bitmap step's words lie in rows a unit visits as steps")
    wr = bitmap_rows(tile_q, tile_kv)
    w = np.arange(W)
    r = np.arange(int(tile_q))
    per = max(1, _WORD_CHUNK // n)
    empty = False
    outside = False
    for a in range(0, len(b), per):
        sl = slice(a, a + per)
        m = len(off[sl])
        blk = st[r0[sl, None] + np.arange(wr)].reshape(m, wr * STEP_COLS)    # whole rows
        words = blk[:, :n].view(np.uint32).reshape(m, W, int(tile_q))         # [m, W, T]
        lo = np.clip(kv_lo[sl, None] - WORD_BITS * w, 0, WORD_BITS)
        hi = np.clip(np.minimum(kv_hi[sl], tile_kv)[:, None] - WORD_BITS * w, 0, WORD_BITS)
        keys = (np.left_shift(1, hi) - np.left_shift(1, lo)).astype(np.uint32)   # [m, W]
        out_rows = (r < q_lo[sl, None]) | (r >= q_hi[sl, None])                  # [m, T]
        outside |= bool((words & ~keys[:, :, None]).any())
        outside |= bool(words[np.broadcast_to(out_rows[:, None, :], words.shape)].any())
        empty |= bool((~words.reshape(m, -1).any(axis=1)).any())
    if outside:
        bad.append("steps: a bitmap step has a bit outside its rectangle (or at a key >= "
                   "tile_kv)")
    if empty:
        bad.append("steps: a bitmap step selects nothing (no bit set)")
    return bad, words_at


def _word_rows(S: int, off, n: int):
    """(bool [S]: the rows of ``steps`` that n words at each offset ``off`` fill, first rows,
    end rows)."""
    r0, r1 = off // STEP_COLS, -(-(off + n) // STEP_COLS)
    edges = np.bincount(r0, minlength=S + 1) - np.bincount(r1, minlength=S + 1)
    return np.cumsum(edges[:S], dtype=np.int32) > 0, r0, r1


def visited_rows(units, num_rows: int) -> np.ndarray:
    """bool [num_rows]: the rows of ``steps`` some unit visits as a step; the others hold a
    bitmap or gathered step's words, or padding, whose columns mean nothing as a step. Units'
    ranges must lie inside the rows (``check_plan`` checks it first)."""
    u = np.asarray(units, np.int64)
    ptr, cnt = u[:, UNIT_STEP_PTR], u[:, UNIT_STEP_CNT]
    real = cnt > 0
    # +1 at each range start, -1 at its end, prefix sum (O(U + S), no per-visit index array:
    # units of a shared mask visit the same rows).
    edges = (np.bincount(ptr[real], minlength=num_rows + 1)
             - np.bincount((ptr + cnt)[real], minlength=num_rows + 1))
    return np.cumsum(edges[:num_rows], dtype=np.int32) > 0


def _in_visited(visited, r0, r1) -> bool:
    """Whether some row range [r0, r1) holds a ``visited`` row (None: no check)."""
    if visited is None:
        return False
    vc = np.zeros(len(visited) + 1, np.int32)
    np.cumsum(np.asarray(visited, bool), dtype=np.int32, out=vc[1:])
    return bool(((vc[r1] - vc[r0]) > 0).any())


def gather_problems(steps, rows, tile_q: int, tile_kv: int, kv_len_padded: int, visited=None,
                    run: int = GATHER_ROWS):
    """(what is wrong, word rows) for the gathered steps at rows ``rows`` of ``steps`` (NumPy;
    other rows ignored), as ``bitmap_problems``: off = cuts_a a multiple of STEP_COLS, its
    ``gather_words`` words inside ``steps`` and in no ``visited`` row; chunk starts multiples of
    GATHER_ROWS with start + GATHER_ROWS <= kv_len_padded, in runs of ``run`` consecutive keys
    (chunks j..j + run / 8 - 1 for j a multiple of run / 8); the rectangle the bounding box of
    the row and key bits; GATHER_FULL_FLAG only with every bit set."""
    st = np.asarray(steps)
    S = st.shape[0]
    rows = np.asarray(rows, np.int64).reshape(-1)
    rows = rows[is_gather(st[rows, STEP_CUTS_B])]
    if rows.size == 0:
        return [], np.zeros(S, bool)
    b = st[rows].astype(np.int64)
    off = b[:, STEP_CUTS_A]
    n = gather_words(tile_q, tile_kv)
    bad = []
    ok = (off % STEP_COLS == 0) & (off >= 0) & (off + n <= S * STEP_COLS)
    if not ok.all():
        bad.append(f"steps: a gathered step's offset (cuts_a) is not a multiple of {STEP_COLS} "
                   f"or its {n} words leave the {S} rows of steps")
    b, off = b[ok], off[ok]
    words_at, r0, r1 = _word_rows(S, off, n)
    if _in_visited(visited, r0, r1):
        bad.append("steps: a gathered step's words lie in rows a unit visits as steps")
    flat = st.reshape(-1)
    starts, keys, rws = unpack_gather(flat[off[:, None] + np.arange(n)], tile_q, tile_kv)
    if ((starts % GATHER_ROWS != 0) | (starts < 0)
            | (starts + GATHER_ROWS > kv_len_padded)).any():
        bad.append(f"steps: a gathered step's chunk start is not a multiple of {GATHER_ROWS} "
                   f"in [0, kv_len_padded - {GATHER_ROWS}] (kv_len_padded={kv_len_padded})")
    if not gather_runs_ok(starts, tile_kv, run):
        bad.append(f"steps: a gathered step's chunks are not in runs of {run} consecutive "
                   f"keys (the copies of kernels that gather {run} keys at once)")
    q_lo, q_hi, kv_lo, kv_hi = unpack_rect(b[:, STEP_RECT])
    if not (keys.any(1) & rws.any(1)).all():
        bad.append("steps: a gathered step selects nothing (no row or no key bit set)")
    else:
        first_r, last_r = rws.argmax(1), tile_q - rws[:, ::-1].argmax(1)
        first_c, last_c = keys.argmax(1), tile_kv - keys[:, ::-1].argmax(1)
        if ((first_r != q_lo) | (last_r != q_hi) | (first_c != kv_lo) | (last_c != kv_hi)).any():
            bad.append("steps: a gathered step's rectangle is not the bounding box of its "
                       "row and key bits")
    full = b[:, STEP_CUTS_B] == GATHER_FULL_FLAG
    if (full & ~(keys.all(1) & rws.all(1))).any():
        bad.append("steps: a GATHER_FULL_FLAG step does not select every row and key")
    return bad, words_at


def check_plan_arrays(units, steps, row_index=None, *, num_q_heads=None, q_len=None) -> None:
    """TypeError / ValueError unless ``units`` is int32 [U >= 1, UNIT_COLS], ``steps`` int32
    [S >= 1, STEP_COLS] and ``row_index`` (None: made on the device from units) int32
    [num_q_heads, q_len]. Shapes and dtypes only: NumPy, jnp and traced arrays alike."""
    for name, x, shape in (("units", units, ("U >= 1", UNIT_COLS)),
                           ("steps", steps, ("S >= 1", STEP_COLS)),
                           ("row_index", row_index, (num_q_heads, q_len))):
        if x is None and name == "row_index":
            continue
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an int32 array, got {type(x).__name__}")
        if np.dtype(x.dtype) != np.int32:
            raise TypeError(f"{name} must have dtype int32, got {x.dtype}")
        got = tuple(x.shape)
        if name == "row_index":
            ok = len(got) == 2 and all(w is None or g == w for g, w in zip(got, shape))
        else:
            ok = len(got) == 2 and got[0] >= 1 and got[1] == shape[1]
        if not ok:
            want = ", ".join(str(w) for w in shape)
            raise ValueError(f"{name} must have shape [{want}], got {got}")


_CHECKED: dict = {}     # (ids, static parameters) -> (units, steps, all_full)
_CHECKED_MAX = 64


def check_plan(units, steps, tile_q, tile_kv, q_len_padded, kv_len_padded, *,
               num_q_heads=None, q_align=1, kv_align=1, max_steps=None,
               gather: bool | int = False) -> bool:
    """Validates a concrete (NumPy) plan for a backend that compiles it with these static
    parameters; returns whether every step a unit visits is full (``full_rect``), i.e. whether
    mask mode "none" (no masking code) can run it. Every backend checks concrete plans with it.

    The rule (a tile out of bounds would read out of bounds on a GPU, a misaligned one would
    read the wrong rows through TMA's tiled SMEM layout):
      * ``check_plan_arrays``: int32 arrays of UNIT_COLS / STEP_COLS columns, at least one row;
      * every unit, padding units too (kernels load every unit's Q tile): 0 <= head <
        num_q_heads (when given), q_start a multiple of ``q_align``, 0 <= q_start and
        q_start + tile_q <= q_len_padded;
      * every unit: step_count >= 0 (and <= ``max_steps`` when given: the XLA executor visits
        that many); a unit with steps: 0 <= step_ptr and step_ptr + step_count <= S;
      * every row of ``steps`` but bitmap word rows (the ABI: every tile a plan names lies
        inside the padded lengths): kv_start a multiple of ``kv_align``, 0 <= kv_start and
        kv_start + tile_kv <= kv_len_padded;
      * every such row, its grid (``grid_problems``): a plain step has cuts_a == 0, a grid
        step bits != 0 and its cuts non-decreasing inside its rectangle;
      * every visited bitmap step (``bitmap_problems``): its offset a multiple of STEP_COLS,
        its words inside ``steps`` and in no visited row, no bit outside its rectangle or at a
        key >= tile_kv, the rectangle non-empty and a bit set. The rows its words fill are
        word rows (not steps: not checked as steps);
      * a visited gathered step only with ``gather`` (a backend whose kernels gather: True,
        or the keys its kernels copy at once, a multiple of GATHER_ROWS), and
        ``gather_problems``: its words as a bitmap's, chunk starts aligned and inside
        kv_len_padded (its kv_start is not checked), in runs of consecutive keys at stage
        positions aligned to the copy, its bits tight in its rectangle.
    A visited grid or bitmap step is never full (it masks by its cells / bits); a gathered one
    is full with GATHER_FULL_FLAG. ValueError
    naming each broken rule. Memoised per array pair (held, so ids stay unique): a
    plan checked once costs a dict look-up per call; change a checked plan's arrays in place
    and it is not checked again.
    """
    check_plan_arrays(units, steps)
    statics = tuple(None if x is None else int(x) for x in (
        tile_q, tile_kv, q_len_padded, kv_len_padded, num_q_heads, q_align, kv_align,
        max_steps, gather_run(gather)))
    key = (id(units), id(steps)) + statics
    hit = _CHECKED.get(key)
    if hit is not None and hit[0] is units and hit[1] is steps:
        return hit[2]
    (tile_q, tile_kv, q_len_padded, kv_len_padded, num_q_heads, q_align, kv_align, max_steps,
     gather) = statics
    u, st = np.asarray(units, np.int64), np.asarray(steps)
    S = st.shape[0]
    head, qs = u[:, UNIT_HEAD], u[:, UNIT_Q_START]
    ptr, cnt = u[:, UNIT_STEP_PTR], u[:, UNIT_STEP_CNT]
    real = cnt > 0
    bad = []
    if num_q_heads is not None and ((head < 0) | (head >= num_q_heads)).any():
        bad.append(f"units: a head is outside [0, {num_q_heads})")
    if ((qs < 0) | (qs + tile_q > q_len_padded)).any():
        bad.append(f"units: a Q tile [q_start, q_start + {tile_q}) leaves "
                   f"[0, q_len_padded={q_len_padded})")
    if (qs % q_align).any():
        bad.append(f"units: a q_start is not a multiple of q_align={q_align}")
    if (cnt < 0).any():
        bad.append("units: a step count is negative")
    if max_steps is not None and (cnt > max_steps).any():
        bad.append(f"units: a step count exceeds max_steps={max_steps}")
    if ((ptr < 0) | (ptr + cnt > S))[real].any():
        bad.append(f"units: a step range [ptr, ptr + cnt) leaves the {S} rows of steps")
        _raise(bad)
    visited = visited_rows(u, S)
    vb = np.flatnonzero(visited & (st[:, STEP_CUTS_B] == BITMAP_FLAG))
    more, words_at = bitmap_problems(st, vb, tile_q, tile_kv, visited)
    vis_gather = visited & is_gather(st[:, STEP_CUTS_B])
    if vis_gather.any() and not gather:
        bad.append("steps: a gathered step (cuts_b == GATHER_FLAG / GATHER_FULL_FLAG) in a "
                   "plan for kernels that do not gather")
    elif vis_gather.any():
        g_bad, g_at = gather_problems(st, np.flatnonzero(vis_gather), tile_q, tile_kv,
                                      kv_len_padded, visited, run=gather)
        more += g_bad
        words_at = words_at | g_at
    rows = ~words_at                      # step rows (visited or not): the rest hold words
    kvs = st[rows & ~vis_gather, STEP_KV_START].astype(np.int64)   # a gathered kv_start: none
    if ((kvs < 0) | (kvs + tile_kv > kv_len_padded)).any():
        bad.append(f"steps: a K/V tile [kv_start, kv_start + {tile_kv}) leaves "
                   f"[0, kv_len_padded={kv_len_padded})")
    if (kvs % kv_align).any():
        bad.append(f"steps: a kv_start is not a multiple of kv_align={kv_align}")
    bad += grid_problems(st[rows])
    bad += more
    if bad:
        _raise(bad)
    vis = st[visited]
    all_full = bool((((vis[:, STEP_RECT] == full_rect(tile_q, tile_kv))
                      & (vis[:, STEP_CUTS_B] == 0))
                     | (vis[:, STEP_CUTS_B] == GATHER_FULL_FLAG)).all())
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[key] = (units, steps, all_full)
    return all_full


def _raise(bad):
    raise ValueError("invalid plan for these tiles and padded lengths (plan for the template "
                     "that runs it): " + "; ".join(bad))


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


#: Rows a kernel stores as one piece (a consumer warpgroup's rows): ``partial_groups``' unit.
STORE_ROWS = 64


def partial_groups(q_start, own_lo, own_hi, tile_q: int, q_len: int) -> float:
    """The fraction of the owned STORE_ROWS-row groups of tiles (unit or (head, tile) arrays of
    starts and own ranges, NumPy) that their unit owns only in part: a kernel storing rows in
    place writes a whole group by one copy, a part by several. Rows past ``q_len`` count as
    owned (a store may write the padding)."""
    start = np.asarray(q_start, np.int64).reshape(-1)
    lo = np.asarray(own_lo, np.int64).reshape(-1)
    hi = np.asarray(own_hi, np.int64).reshape(-1)
    hi = np.where(start + hi >= q_len, tile_q, np.minimum(hi, tile_q))
    part = whole = 0
    for r0 in range(0, tile_q, STORE_ROWS):
        a = np.clip(lo - r0, 0, STORE_ROWS)
        b = np.clip(hi - r0, 0, STORE_ROWS)
        w = (a == 0) & (b == STORE_ROWS)
        whole += int(w.sum())
        part += int(((b > a) & ~w).sum())
    return part / max(part + whole, 1)


def units_own_all_rows(units: np.ndarray, num_q_heads: int, q_len: int) -> bool:
    """Whether host ``units`` own every row < ``q_len`` of each of ``num_q_heads`` heads (the
    units of a head own disjoint rows, a plan invariant: counting the owned rows suffices)."""
    units = np.asarray(units)
    if units.shape[0] == 0:
        return num_q_heads * q_len == 0
    start = units[:, UNIT_Q_START].astype(np.int64)
    lo = np.minimum(start + units[:, UNIT_OWN_LO], q_len)
    hi = np.minimum(start + units[:, UNIT_OWN_HI], q_len)
    per_head = np.bincount(units[:, UNIT_HEAD], np.maximum(hi - lo, 0),
                           minlength=num_q_heads)
    return bool(np.all(per_head[:num_q_heads] == q_len))


_HOST: dict = {}


def host_cached(array: np.ndarray, tag, make):
    """``make(array)``, computed once per host array and ``tag`` (at most 8 kept): a plan's
    derived constant is then the same object at every call site (one constant per program)."""
    key = (id(array), tag)
    hit = _HOST.get(key)
    if hit is not None and hit[0] is array:
        return hit[1]
    if len(_HOST) >= 8:                # a few plans at a time: each entry holds two arrays
        _HOST.clear()
    out = make(array)
    _HOST[key] = (array, out)
    return out


def clear_host_cache() -> None:
    """Forgets ``host_cached``'s arrays (``tessera_jax.clear_caches``)."""
    _HOST.clear()


def token_major(row_index):
    """``row_index.T`` [Lq, Hq], contiguous, for a NumPy row_index (a host plan's constant),
    else None. Gathers of [B, Lq, Hq, D] outputs take it: with the transpose inside the
    program, XLA may gather head-major and transpose after, two [B, Lq, Hq, D] copies (and
    under ``jax.checkpoint`` the transpose of the constant is not folded away: it runs, and
    stays live, in every recomputed block)."""
    if not isinstance(row_index, np.ndarray):
        return None
    return host_cached(row_index, "T", lambda r: np.ascontiguousarray(r.T))


def gather_rows(out_units, lse_units, row_index, row_index_t=None):
    """Unit-major kernel outputs -> out [B, Lq, Hq, D] and lse [B, Hq, Lq] (float32).

    out_units: [B, U, tile_q, D]; lse_units: [B, U, tile_q] float32; row_index: int32 [Hq, Lq];
    row_index_t: its transpose [Lq, Hq] when the caller has it (``token_major``).
    Rows no unit owns get 0 and -inf.
    """
    B, U, T, D = out_units.shape
    # The sentinel U * T is one past the end: "fill" gives it the value, with no padded copy.
    flat = out_units.reshape(B, U * T, D)
    idx = row_index.T if row_index_t is None else row_index_t
    out = jnp.take(flat, idx, axis=1, mode="fill", fill_value=0)               # [B, Lq, Hq, D]
    return out, gather_lse(lse_units, row_index)


def gather_lse(lse_units, row_index):
    """Unit-major lse [B, U, tile_q] -> [B, Hq, Lq] float32 (-inf on rows no unit owns)."""
    B, U, T = lse_units.shape
    lflat = lse_units.reshape(B, U * T).astype(jnp.float32)
    return jnp.take(lflat, row_index, axis=1, mode="fill", fill_value=-jnp.inf)
