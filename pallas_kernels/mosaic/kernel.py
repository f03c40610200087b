"""The Mosaic GPU kernel body: executes a plan (``pallas_kernels.abi``) on Hopper (sm_90a).

Modelled on jax's ``ops/gpu/attention_mgpu.py`` (FlashAttention-3 style): one CTA per work
unit, two consumer warpgroups of 64 query rows each (the two halves of a tile_q = 128 unit,
or with ``paired`` two tile_q = 64 units, each with its own K/V ring) and a producer
warpgroup that streams the unit's K/V tiles by TMA through a ``stages``-deep shared-memory
ring. The consumers run wgmma and an online softmax in base 2, ping-ponged by a schedule
barrier (unless the config turns it off) so one warpgroup's softmax overlaps the other's
matrix products. What differs from the dense kernel: the K/V tiles a unit visits, and
how many, come from the plan's ``steps`` (read from GMEM at run time), and the mask is applied
only on partial steps (a ``lax.cond`` skips it on full ones; mask mode "none", picked by the
backend for a plan whose steps are all full, compiles no masking code; "always" masks every
step). A ``lax.switch`` on STEP_CUTS_B picks the mask (``_step_mask``, decoding by
``pallas_kernels.step_masks`` and ``common``): for a plain step a
per-key bias (0 / -inf) and a per-row penalty that the softmax applies, the cells of the
grid for a grid step (``_grid_mask``: row and key vectors of the fragment's
layouts, one and, compare and select per element), a bit per entry for a bitmap step
(``_bitmap_mask``: row words loaded from GMEM, and-ed with each key's bit). With
``step_pairs`` a stage holds two consecutive steps of a 64-key plan (``_pair_step``: one
128-key S and P V, each half masked by its own step, ``_pair_mask``). Plan
starts must be multiples of 8 (TMA fills the 8-row tiled, swizzled SMEM layout). On CPU,
``interpret=`` runs it under the Mosaic GPU interpreter, with P @ V as a plain dot (the
interpreter lacks run_state and wgmma with a register operand).

Layout of this module: ``KernelConfig`` (the static configuration), ``forward`` (builds and
launches the kernel), and the kernel's parts as functions of ``_Ctx`` (its static shape, refs
and barriers): ``_consumer`` / ``_consumer_unit`` / ``_step`` (one K/V step: ``_compute_step``
or ``_skip_step``) / ``_store`` for the consumer warpgroups, ``_producer`` / ``_load`` /
``_drain`` for the TMA producer. ``pallas_kernels.mosaic.ops`` checks and pads the inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import abi as plan_abi
from pallas_kernels import step_masks
from pallas_kernels.contract import LN2, LOG2E, MASK_MODES
from pallas_kernels.mosaic.common import (ALIGN, CONSUMERS, WG_ROWS, bcast, bitmap_mask,
                                          gather_produce, gather_vectors, grid_mask, iota,
                                          load_gathered, masked_pair, owned_rows, rows_of,
                                          store_owned)
from pallas_kernels.templates import CompiledConfig, MosaicConfig

__all__ = ["KernelConfig", "forward", "smem_bytes", "MASK_MODES", "MAX_SMEM"]

MAX_SMEM = 232448                  # bytes per CTA on sm_90 (the limit Mosaic GPU reports)


@dataclasses.dataclass(frozen=True)
class KernelConfig(CompiledConfig):
    """Static shape of one compiled kernel: a template's ``MosaicConfig`` plus its tile shape
    (tile_q query rows: 128, or 64 with ``paired``; tile_kv keys per step; ``stages`` ring
    slots) and the mask mode compiled ("none" only for plans whose steps are all full)."""

    variant: MosaicConfig = MosaicConfig()

    VARIANT = MosaicConfig

    @property
    def paired(self) -> bool:
        """tile_q=64, two units per CTA: consumer warpgroup w runs unit 2 * cta + w, ring w."""
        return self.variant.paired

    @property
    def wg_skip(self) -> bool:
        return self.variant.wg_skip

    @property
    def step_pairs(self) -> bool:
        """Two plan steps a K/V stage (``MosaicConfig.step_pairs``)."""
        return self.variant.step_pairs

    @property
    def stage_kv(self) -> int:
        """Keys of one K/V ring slot: tile_kv, or two steps' with ``step_pairs``."""
        return 2 * self.tile_kv if self.step_pairs else self.tile_kv

    @property
    def rings(self) -> int:
        """K/V rings: one per unit the CTA runs at once."""
        return 2 if self.paired else 1

    @property
    def pingpong(self) -> bool:
        """Whether the two consumer warpgroups ping-pong on the schedule barrier: on one
        128-row unit, or on two paired units with ``pair_pingpong`` (the one with fewer steps
        keeps the barrier's phases)."""
        return self.variant.schedule_barrier and (self.tile_q == 2 * WG_ROWS
                                                  or self.variant.pair_pingpong)


def smem_bytes(cfg: KernelConfig, head_dim: int, direct: bool = False) -> int:
    """Shared memory of one CTA: Q/O tiles, the K/V ring, LSE, with ``direct`` the untiled O
    rows, plus ~2.7 KB of barriers and alignment (232,568 bytes measured for tile_kv=128, 3
    stages, D=128; the reduction scratch and barriers take 2.6-2.9 KB in the cross-lowered
    kernels)."""
    rows = CONSUMERS * WG_ROWS
    return 2 * ((2 if direct else 1) * rows * head_dim
                + 2 * cfg.rings * cfg.stages * cfg.stage_kv * head_dim) + 4 * rows + 2900


class _Ctx(NamedTuple):
    """One kernel instance: static shape and config, GMEM refs, SMEM buffers, barriers."""

    cfg: KernelConfig
    batch: int
    num_units: int
    head_dim: int
    group: int                 # query heads per K/V head
    dtype: Any
    num_steps: int             # rows of ``steps``
    qk_scale: float            # scale * log2(e): scores are kept in base-2 units
    interpret: Any
    q: Any
    k: Any
    v: Any
    units: Any
    steps: Any
    words: Any                 # steps.reshape(-1): bitmap steps' words (abi.BITMAP_FLAG)
    out: Any                   # direct: [B, Lqp, Hq, D]; else unit-major [B, U, tile_q, D]
    lse: Any
    direct: bool               # O rows stored in place (``forward``'s ``direct``)
    qo_smem: Any               # [CONSUMERS, 64, D]: Q tile in, O tile out
    rows_smem: Any             # direct: [CONSUMERS, 64, D] untiled, O rows of a partial slab
    k_smem: Any                # [rings * stages, tile_kv, D]
    v_smem: Any
    lse_smem: Any              # [CONSUMERS, 64]
    k_bar: Any                 # per ring slot: its K / V tile arrived
    v_bar: Any
    q_bar: Any                 # per consumer WG: its Q tile arrived
    k_consumed: Any            # per ring slot: every WG reading it is done with it
    v_consumed: Any
    schedule_barrier: Any      # the consumers' ping-pong barrier


class _Wg(NamedTuple):
    """A consumer warpgroup on its unit."""

    wg: Any                    # warpgroup index
    ring: int | Any            # its K/V ring (paired: its own unit's)
    row0: int | Any            # its first row of the unit's tile
    qo_smem: Any
    lse_smem: Any
    base: Any                  # ring position of the unit's first step
    ptr: Any                   # the unit's first step in ``steps``
    cnt: Any                   # the unit's K/V stages: its steps (step_pairs: half, rounded up)
    nsteps: Any                # the unit's step count


def forward(q, k, v, units, steps, *, cfg: KernelConfig, scale: float, interpret=False,
            direct: bool = False):
    """Runs the kernel: q [B, Lqp, Hq, D], k/v [B, Lkvp, Hkv, D] (already padded) ->
    out_units [B, U, tile_q, D] (q.dtype) and lse_units [B, U, tile_q] (float32, natural log).

    ``direct``: out is [B, Lqp, Hq, D], each unit's owned rows stored in place (a whole
    64-row slab by one TMA copy, a partial one by at most six copies of 32 .. 1 rows), so no
    gather of the unit-major output follows; rows no unit owns are left unwritten (only for
    plans whose units own every query row, ``abi.PassPlan.rows_owned``)."""
    B, _, Hq, D = q.shape
    _, _, Hkv, _ = k.shape
    U = units.shape[0]
    if cfg.step_pairs and cfg.mask_mode == "none":
        # Full steps still leave an odd count's last stage half empty: masked by the cond.
        cfg = dataclasses.replace(cfg, mask_mode="cond")
    dtype = q.dtype
    nwg = CONSUMERS
    static = dict(cfg=cfg, batch=B, num_units=U, head_dim=D, group=Hq // Hkv, dtype=dtype,
                  num_steps=steps.shape[0], qk_scale=float(scale) * LOG2E,
                  interpret=interpret)

    def entry(q_ref, k_ref, v_ref, units_ref, steps_ref, words_ref, out_ref, lse_ref):
        direct_rows = ((plgpu.SMEM((nwg, WG_ROWS, D), dtype),) if direct else ())
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        slots = cfg.rings * cfg.stages
        qo = plgpu.SMEM((nwg, WG_ROWS, D), dtype, transforms=(tiling, swizzle))
        kbuf = plgpu.SMEM((slots, cfg.stage_kv, D), dtype, transforms=(tiling, swizzle))
        vbuf = plgpu.SMEM((slots, cfg.stage_kv, D), dtype, transforms=(tiling, swizzle))
        lse = plgpu.SMEM((nwg, WG_ROWS), jnp.float32)

        def scoped(bufs, bars, consumed, schedule_barrier):
            (qo_smem, k_smem, v_smem, lse_smem, *rows_smem), (k_bar, v_bar, q_bar) = bufs, bars
            c = _Ctx(q=q_ref, k=k_ref, v=v_ref, units=units_ref, steps=steps_ref,
                     words=words_ref, out=out_ref, lse=lse_ref, direct=direct,
                     rows_smem=rows_smem[0] if direct else None, qo_smem=qo_smem,
                     k_smem=k_smem, v_smem=v_smem,
                     lse_smem=lse_smem, k_bar=k_bar, v_bar=v_bar, q_bar=q_bar,
                     k_consumed=consumed[0], v_consumed=consumed[1],
                     schedule_barrier=schedule_barrier, **static)
            _kernel(c)

        # A gathering producer arrives once per copy (gather_run keys each), a step-pairs one
        # once per step.
        copies = cfg.stage_kv // _copy_run(cfg)
        pl.run_scoped(
            scoped,
            (qo, kbuf, vbuf, lse, *direct_rows),
            (plgpu.Barrier(num_arrivals=copies, num_barriers=slots),
             plgpu.Barrier(num_arrivals=copies, num_barriers=slots),
             plgpu.Barrier(num_barriers=nwg)),
            # A slot is free once every warpgroup that reads it is done with it.
            (plgpu.Barrier(num_arrivals=1 if cfg.paired else nwg, num_barriers=slots),) * 2,
            plgpu.Barrier(num_arrivals=nwg),
            collective_axes="wg",
        )

    out_shape = q.shape if direct else (B, U, cfg.tile_q, D)
    out_type = (jax.ShapeDtypeStruct(out_shape, dtype),
                jax.ShapeDtypeStruct((B, U, cfg.tile_q), jnp.float32))
    kwargs = {}
    if interpret:
        kwargs["interpret"] = interpret
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(-(-U // 2) if cfg.paired else U, B),
        grid_names=("unit", "batch"),
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(q, k, v, units, steps, steps.reshape(-1))


def _copy_run(cfg: KernelConfig) -> int:
    """Keys of one TMA copy into a K/V stage: gather_run (gathering), tile_kv (step pairs:
    a step each), else the whole stage."""
    if cfg.variant.gather:
        return cfg.variant.gather_run
    return cfg.tile_kv


def _kernel(c: _Ctx):
    wg = lax.axis_index("wg")
    pl.when(wg < CONSUMERS)(functools.partial(_consumer, c, wg))
    pl.when(wg == CONSUMERS)(functools.partial(_producer, c))


def _unit_of(c: _Ctx, ring=0):
    """(u, b, head, q_start, step_ptr, step_count, valid) of the unit this CTA runs (paired:
    the unit of this ring)."""
    if c.cfg.paired:
        # Units 2c and 2c + 1 (neighbours in the schedule, so of similar cost); the
        # second one may lie past the last unit when U is odd: no steps, no store.
        u = lax.axis_index("unit") * 2 + ring
        b = lax.axis_index("batch")
        valid = u < c.num_units
        u = jnp.minimum(u, c.num_units - 1)
    else:
        # One flat work index (unit u, batch b), u-major, split again: the kernel as measured.
        w = lax.axis_index("unit") * c.batch + lax.axis_index("batch")
        u, b = lax.div(w, c.batch), lax.rem(w, c.batch)
        valid = True
    cnt = c.units[u, plan_abi.UNIT_STEP_CNT]
    if c.cfg.paired:
        cnt = jnp.where(valid, cnt, 0)
    return (u, b, c.units[u, plan_abi.UNIT_HEAD], c.units[u, plan_abi.UNIT_Q_START],
            c.units[u, plan_abi.UNIT_STEP_PTR], cnt, valid)


def _slot(c: _Ctx, g, ring=0):
    """Ring slot of the unit's ``g``-th step."""
    return lax.rem(g, jnp.array(c.cfg.stages, g.dtype)) + ring * c.cfg.stages


def _schedule(c: _Ctx):
    """One pass of the ping-pong barrier (nothing without ping-pong)."""
    if c.cfg.pingpong:
        plgpu.barrier_arrive(c.schedule_barrier)
        plgpu.barrier_wait(c.schedule_barrier)


# --- consumer warpgroups ---------------------------------------------------------------------
def _consumer(c: _Ctx, wg):
    # Registers move from the producer (40 per thread) to the consumers (232).
    plgpu.set_max_registers(232, action="increase")
    qo_smem, lse_smem = c.qo_smem.at[wg], c.lse_smem.at[wg]
    # This warpgroup's rows of the unit's tile, and its ring (paired: a unit of its own).
    ring = wg if c.cfg.paired else 0
    row0 = 0 if c.cfg.paired else pl.multiple_of(wg * WG_ROWS, WG_ROWS)
    # A loop of one work item: the kernel as measured (ring positions run on from ``base``).
    lax.fori_loop(0, 1, functools.partial(_consumer_unit, c, wg, ring, row0, qo_smem, lse_smem),
                  jnp.int32(0))


def _consumer_unit(c: _Ctx, wg, ring, row0, qo_smem, lse_smem, j, base):
    """One warpgroup's unit: load its Q rows, run the K/V steps, store O and LSE."""
    paired = c.cfg.paired
    u, b, head, q_start, ptr, nsteps, valid = _unit_of(c, ring)
    cnt = (nsteps + 1) // 2 if c.cfg.step_pairs else nsteps        # K/V stages
    w = _Wg(wg, ring, row0, qo_smem, lse_smem, base, ptr, cnt, nsteps)
    # Plan starts are multiples of 8 (templates' q_align/kv_align): tell the layout
    # inference, which must prove TMA starts divisible by the 8-row SMEM tiling.
    q_row = pl.multiple_of(q_start + row0, ALIGN)
    plgpu.copy_gmem_to_smem(c.q.at[b, pl.ds(q_row, WG_ROWS), head], qo_smem, c.q_bar.at[wg])
    plgpu.barrier_wait(c.q_bar.at[wg])
    m_i = plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((WG_ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((WG_ROWS, c.head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(cnt > 0)
    def _():
        plgpu.barrier_wait(c.k_bar.at[_slot(c, base, ring)])

    schedule = functools.partial(_schedule, c)     # one function: traced once for both whens
    pl.when(wg == 1)(schedule)
    # The carry's last four scalars are unused: the kernel as measured.
    first = (jnp.int32(0),) * 4
    body = (functools.partial(_pair_step, c, w, c.cfg.mask_mode) if c.cfg.step_pairs
            else functools.partial(_step, c, w, c.cfg.mask_mode, c.cfg.wg_skip))
    acc, m_i, l_i = lax.fori_loop(0, cnt, body, (acc, m_i, l_i, first))[:3]
    if paired and c.cfg.pingpong:
        # Ping-pong over two units: each computed step takes two passes of the
        # schedule barrier per warpgroup, so the warpgroup whose unit has fewer
        # steps makes the passes of the other's remaining steps (no K/V, no math).
        cnt_other = _unit_of(c, 1 - ring)[5]
        lax.fori_loop(cnt, jnp.maximum(cnt, cnt_other), functools.partial(_pad_step, c),
                      jnp.int32(0))
    pl.when(wg == 0)(schedule)
    _store(c, w, u, b, valid, acc, m_i, l_i, head, q_row)
    return base + cnt


def _pad_step(c: _Ctx, i, carry):
    _schedule(c)
    _schedule(c)
    return carry


class _Rect(NamedTuple):
    """What the consumer reads of step ``s`` before its matrix products: the bounding
    rectangle (rows relative to this warpgroup's 64 rows) and, when the step may be masked,
    STEP_CUTS_B (0: a plain step; else a grid step, whose STEP_CUTS_A the grid mask reads)."""

    q_lo: Any
    q_hi: Any
    kv_lo: Any
    kv_hi: Any
    s: Any                     # the (clamped) row of ``steps``
    cuts_b: Any                # None when the mode never masks (nothing read)


def _rect(c: _Ctx, w: _Wg, i, cuts: bool):
    """Rectangle of step i, rows relative to this warpgroup's 64 rows, and with ``cuts`` its
    STEP_CUTS_B. The index is clamped so a unit with no steps never reads past ``steps``.
    One int32 load (four bytes), two with ``cuts``."""
    s = jnp.minimum(w.ptr + i, c.num_steps - 1)
    q_lo, q_hi, kv_lo, kv_hi = plan_abi.unpack_rect(c.steps[s, plan_abi.STEP_RECT])
    cuts_b = c.steps[s, plan_abi.STEP_CUTS_B] if cuts else None
    return _Rect(q_lo - w.row0, q_hi - w.row0, kv_lo, kv_hi, s, cuts_b)


def _step(c: _Ctx, w: _Wg, mode, wg_skip, i, carry):
    """One step of the K/V loop, specialised for a mask mode ("cond", "always" or "none") and
    for warpgroup skipping."""
    acc, m_i, l_i, cur = carry
    slot = _slot(c, w.base + i, w.ring)
    if mode == "none" and not wg_skip:
        rect = None                        # never read: every step is full
    else:
        rect = _rect(c, w, i, cuts=mode != "none")
    state = (acc, m_i, l_i)
    if wg_skip:
        # The bounding rectangle: a grid step's cells lie inside it, so a warpgroup whose
        # rows it misses has nothing selected (one it meets may still have none: computed,
        # all masked).
        q_lo, q_hi = rect.q_lo, rect.q_hi
        active = (q_lo < WG_ROWS) & (q_hi > 0) & (q_lo < q_hi)
        state = lax.cond(active, functools.partial(_compute_step, c, w, mode, i, slot, rect),
                         functools.partial(_skip_step, c, w, i, slot), state)
    else:
        state = _compute_step(c, w, mode, i, slot, rect, state)
    return (*state, cur)


def _pair_step(c: _Ctx, w: _Wg, mode, i, carry):
    """One K/V stage of a step-pairs kernel: plan steps 2i and 2i + 1 (the second absent at
    an odd count's end), one S = Q K^T and one P V over both tiles (mode "cond" or
    "always")."""
    acc, m_i, l_i, cur = carry
    slot = _slot(c, w.base + i, w.ring)
    ra = _rect(c, w, 2 * i, cuts=True)
    rb = _rect(c, w, 2 * i + 1, cuts=True)       # clamped: read, unused without has_b
    has_b = 2 * i + 1 < w.nsteps
    state = _compute_step(c, w, mode, i, slot, None, (acc, m_i, l_i), pair=(ra, rb, has_b))
    return (*state, cur)


def _pair_full(c: _Ctx, ra: _Rect, rb: _Rect, has_b):
    """Whether both steps of a stage are full for this warpgroup."""
    def full(r):
        return step_masks.rows_full(r.q_lo, r.q_hi, r.kv_lo, r.kv_hi, r.cuts_b, WG_ROWS,
                                    c.cfg.tile_kv)
    return full(ra) & has_b & full(rb)


def _pair_mask(c: _Ctx, w: _Wg, ra: _Rect, rb: _Rect, has_b, zero_rows, x):
    """(scores, row penalty) of a step-pairs stage: keys [0, tile_kv) are step a's, the rest
    step b's. Two plain steps over the same rows (or a alone): a per-key bias and a row
    penalty, as a plain step's (``_step_mask``); otherwise each half by its step's kind
    (``common.masked_pair``, dq's mask too)."""
    T = c.cfg.tile_kv

    def plain(x):
        cols = iota(2 * T, 0)
        keep = ((cols >= ra.kv_lo) & (cols < ra.kv_hi)) | (
            (cols >= T + rb.kv_lo) & (cols < T + rb.kv_hi) & has_b)
        col_bias = jnp.where(keep, 0.0, -jnp.inf)
        rows = iota(WG_ROWS, 1)
        row_pen = jnp.where((rows >= ra.q_lo) & (rows < ra.q_hi), 0.0, jnp.inf)
        return x + bcast(col_bias, x.shape, 1), row_pen

    def each(x):
        return masked_pair(c.steps, c.words, ra.s, rb.s, has_b, w.row0, c.cfg.tile_q, T,
                           "always", x), zero_rows

    same_rows = (rb.q_lo == ra.q_lo) & (rb.q_hi == ra.q_hi)
    simple = (ra.cuts_b == 0) & (~has_b | ((rb.cuts_b == 0) & same_rows))
    return lax.cond(simple, plain, each, x)


def _end_softmax_barriers(c: _Ctx, slot):
    if c.cfg.pingpong:
        plgpu.barrier_arrive(c.schedule_barrier)
    plgpu.barrier_wait(c.v_bar.at[slot])
    if c.cfg.pingpong:
        plgpu.barrier_wait(c.schedule_barrier)


def _wait_next_k(c: _Ctx, w: _Wg, i):
    @pl.when(i + 1 < w.cnt)
    def _():
        plgpu.barrier_wait(c.k_bar.at[_slot(c, w.base + i + 1, w.ring)])


def _qk(c: _Ctx, w: _Wg, slot, acc_ref):
    plgpu.wgmma(acc_ref, w.qo_smem, c.k_smem.at[slot].transpose((1, 0)))
    _schedule(c)
    return acc_ref[...]


def _grid_mask(c: _Ctx, w: _Wg, rect: _Rect, x):
    """A grid step's mask (``common.grid_mask``: a row vector of cell bits and a column vector
    of key-segment bits in the fragment's layouts, 2 and tile_kv / 4 values per thread).
    STEP_CUTS_A is read here, on grid steps only."""
    cuts_a = c.steps[rect.s, plan_abi.STEP_CUTS_A]
    return grid_mask(cuts_a, rect.cuts_b, rect.q_lo, rect.q_hi, rect.kv_lo, rect.kv_hi,
                     lambda: iota(WG_ROWS, 1), lambda: iota(c.cfg.tile_kv, 0), w.row0, x)


def _bitmap_mask(c: _Ctx, w: _Wg, rect: _Rect, x):
    """A bitmap step's mask (``common.bitmap_mask``: per word column, this warpgroup's 64 row
    words loaded from GMEM and-ed with each key's bit)."""
    off = c.steps[rect.s, plan_abi.STEP_CUTS_A]
    return bitmap_mask(c.words, off, w.row0, c.cfg.tile_q, c.cfg.tile_kv,
                       iota(c.cfg.tile_kv, 0), x)


def _step_mask(c: _Ctx, w: _Wg, rect: _Rect, zero_rows, x):
    """(scores, row penalty) of a step that is not known to be full, by a switch on its kind
    (STEP_CUTS_B: 0 plain, BITMAP_FLAG bitmap, else grid). A plain step masks its keys with a
    per-key bias (0 / -inf: one add per entry) and its rows through the softmax (a row penalty
    of +inf: m kept, p = 0): no per-entry compares (0.83 / 0.88 of cuDNN's rate against 0.77 /
    0.85 with the rectangle's four compares per entry at kv128, benchmarks/NOTES.md#masked-steps).
    Grid and bitmap steps mask entries (``_grid_mask``, ``_bitmap_mask``; penalty 0)."""
    def plain(x):
        cols = iota(c.cfg.tile_kv, 0)
        col_bias = jnp.where((cols >= rect.kv_lo) & (cols < rect.kv_hi), 0.0, -jnp.inf)
        rows = iota(WG_ROWS, 1)
        row_pen = jnp.where((rows >= rect.q_lo) & (rows < rect.q_hi), 0.0, jnp.inf)
        return x + bcast(col_bias, x.shape, 1), row_pen

    branches = [plain, lambda x: (_grid_mask(c, w, rect, x), zero_rows),
                lambda x: (_bitmap_mask(c, w, rect, x), zero_rows)]
    kind = step_masks.step_kind(rect.cuts_b)
    if c.cfg.variant.gather:
        branches.append(functools.partial(_gather_mask, c, w, rect))
        kind = jnp.where(plan_abi.is_gather(rect.cuts_b), 3, kind)
    return lax.switch(kind, branches, x)


def _gather_mask(c: _Ctx, w: _Wg, rect: _Rect, x):
    """A gathered step's mask: its key bits as a per-key bias (0 / -inf, one add per entry)
    and this warpgroup's row bits as the softmax's row penalty (+inf: m kept, p = 0)."""
    keys, rows = gather_vectors(c.words, c.steps[rect.s, plan_abi.STEP_CUTS_A], w.row0,
                                c.cfg.tile_kv)
    col_bias = jnp.where(keys, 0.0, -jnp.inf)
    row_pen = jnp.where(rows, 0.0, jnp.inf)
    return x + bcast(col_bias, x.shape, 1), row_pen


def _pv(c: _Ctx, w: _Wg, i, slot, p16, acc_ref):
    plgpu.wgmma(acc_ref, p16, c.v_smem.at[slot])
    _wait_next_k(c, w, i)


def _compute_step(c: _Ctx, w: _Wg, mode, i, slot, rect, state, pair=None):
    """S = Q K^T on the step's K/V tile (``pair``: (rect a, rect b, has_b), the two steps of
    a step-pairs stage, ``rect`` unused), its mask, the online softmax update and O += P V."""
    acc, m_i, l_i = state
    qk = pl.run_scoped(functools.partial(_qk, c, w, slot),
                       plgpu.ACC((WG_ROWS, c.cfg.stage_kv), jnp.float32))
    plgpu.barrier_arrive(c.k_consumed.at[slot])
    if mode != "none":
        zero_rows = plgpu.layout_cast(jnp.full((WG_ROWS,), 0, jnp.float32),
                                      plgpu.Layout.WGMMA.reduce(1))
        mask = (functools.partial(_pair_mask, c, w, *pair, zero_rows) if pair is not None
                else functools.partial(_step_mask, c, w, rect, zero_rows))
    if mode == "cond" and pair is not None:
        full = _pair_full(c, *pair)
        qk, row_pen = lax.cond(full, lambda x: (x, zero_rows), mask, qk)
    elif mode == "cond":
        q_lo, q_hi, kv_lo, kv_hi = rect[:4]
        # Full for this warpgroup: a plain step whose rectangle covers its 64 rows, all keys.
        full = step_masks.rows_full(q_lo, q_hi, kv_lo, kv_hi, rect.cuts_b, WG_ROWS,
                                    c.cfg.tile_kv)
        if c.cfg.variant.gather:
            full = full | (rect.cuts_b == plan_abi.GATHER_FULL_FLAG)
        qk, row_pen = lax.cond(full, lambda x: (x, zero_rows), mask, qk)
    elif mode == "always":
        qk, row_pen = mask(qk)

    # Online softmax in base 2. A row may have seen only masked entries so far
    # (m == -inf): subtract 0 then, so that exp2 gives 0, never NaN. Without masking
    # (all steps full) every score is finite: no guard.
    m_ij = jnp.maximum(m_i, qk.max(axis=1) * c.qk_scale)
    if mode == "none":
        m_sub = m_ij
    else:
        # Rows outside a plain step's rectangle (row_pen = +inf): m unchanged, p = 0.
        m_ij = jnp.where(row_pen == 0, m_ij, m_i)
        m_sub = jnp.where(m_ij == -jnp.inf, 0.0, m_ij)
    alpha = jnp.exp2(m_i - m_sub)
    m_i = m_ij
    if mode != "none":
        m_sub = m_sub + row_pen
    p = jnp.exp2(qk * c.qk_scale - lax.broadcast_in_dim(m_sub, qk.shape, [0]))
    acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i *= alpha
    p16 = p.astype(c.dtype)

    if c.head_dim <= 128:
        l_i += p.sum(axis=1)
        acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
        _end_softmax_barriers(c, slot)
    else:
        _end_softmax_barriers(c, slot)
        l_i += p.sum(axis=1)

    if c.interpret:
        # The Mosaic GPU interpreter has neither a rule for run_state nor wgmma with a
        # register A operand: PV is a plain dot on the tile.
        acc = acc + jnp.dot(p16, c.v_smem.at[slot][...], preferred_element_type=jnp.float32)
        _wait_next_k(c, w, i)
    else:
        acc = pl.run_state(functools.partial(_pv, c, w, i, slot, p16))(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(c.v_consumed.at[slot])
    return acc, m_i, l_i


def _skip_step(c: _Ctx, w: _Wg, i, slot, state):
    """The step's rows miss this warpgroup's: no matrix products and no softmax, but the
    same barrier traffic (ring slot release, the data barriers' phases, both ping-pong
    arrivals) as a computed step."""
    plgpu.barrier_arrive(c.k_consumed.at[slot])
    _schedule(c)
    _end_softmax_barriers(c, slot)
    _wait_next_k(c, w, i)
    plgpu.barrier_arrive(c.v_consumed.at[slot])
    return state


def _store(c: _Ctx, w: _Wg, u, b, valid, acc, m_i, l_i, head, q_row):
    """Normalises the accumulator and writes the warpgroup's 64 rows of O (``direct``: its
    owned rows, in place at rows ``q_row`` .. of ``head``, ``common.store_owned``) and LSE."""
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    acc /= lax.broadcast_in_dim(l_safe, acc.shape, [0])
    o16 = acc.astype(c.dtype)
    w.lse_smem[...] = jnp.where(empty, -jnp.inf, m_i * LN2 + jnp.log(l_safe))
    if not c.direct:
        w.qo_smem[...] = o16
    plgpu.commit_smem()

    def store():
        rows = pl.ds(w.row0, WG_ROWS)
        if c.direct:
            lo, hi = owned_rows(c.units, u, w.row0)
            store_owned(o16, w.qo_smem, c.rows_smem.at[w.wg], lo, hi,
                        lambda p, n: c.out.at[b, pl.ds(q_row + p, n), head])
        else:
            plgpu.copy_smem_to_gmem(w.qo_smem, c.out.at[b, u, rows])
        plgpu.copy_smem_to_gmem(w.lse_smem, c.lse.at[b, u, rows])
        plgpu.wait_smem_to_gmem(0)  # Q/O and LSE buffers are reused next unit

    if c.cfg.paired:
        pl.when(valid)(store)      # an odd unit count leaves the last WG idle
    else:
        store()


# --- TMA producer ------------------------------------------------------------------------------
def _producer(c: _Ctx):
    plgpu.set_max_registers(40, action="decrease")
    if c.cfg.variant.gather or c.cfg.step_pairs:
        _gather_producer(c)
        return
    if c.cfg.paired:
        # Both units' tiles in step order, one of each in turn, each in its own ring.
        streams = []
        for ring in range(2):
            _, b, head, _, ptr, cnt, _ = _unit_of(c, ring)
            streams.append((b, lax.div(head, jnp.array(c.group, head.dtype)), ptr, cnt))

        @pl.loop(0, jnp.maximum(streams[0][3], streams[1][3]))
        def _(i):
            for ring, (b, kv_head, ptr, cnt) in enumerate(streams):
                pl.when(i < cnt)(functools.partial(_load, c, ring, b, kv_head, ptr, i, i))

        for ring, (_, _, _, cnt) in enumerate(streams):
            _drain(c, ring, cnt)
        return

    def do_unit(j, base):
        _, b, head, _, ptr, cnt, _ = _unit_of(c)
        kv_head = lax.div(head, jnp.array(c.group, head.dtype))

        @pl.loop(0, cnt)
        def _(i):
            _load(c, 0, b, kv_head, ptr, i, base + i)

        return base + cnt

    # A loop of one work item, like the consumers': the kernel as measured.
    _drain(c, 0, lax.fori_loop(0, 1, do_unit, jnp.int32(0)))


def _gather_producer(c: _Ctx):
    """The producer of a gathering or step-pairs kernel: each unit's (paired: both units', in
    turn) stages in order (``common.gather_produce``)."""
    streams = []
    for ring in range(c.cfg.rings):
        _, b, head, _, ptr, cnt, _ = _unit_of(c, ring)
        streams.append((b, lax.div(head, jnp.array(c.group, head.dtype)), ptr, cnt))

    def load(b, kv_head, starts, slot, wait):
        load_gathered(rows_of((c.k, c.v), b, kv_head), (c.k_smem, c.v_smem),
                      (c.k_bar, c.v_bar), (c.k_consumed, c.v_consumed), starts,
                      _copy_run(c.cfg), slot, wait)

    def drain(slot):
        plgpu.barrier_wait(c.k_consumed.at[slot])
        plgpu.barrier_wait(c.v_consumed.at[slot])

    gather_produce(streams, c.steps, c.words, c.num_steps, c.cfg.tile_kv, _copy_run(c.cfg),
                   c.cfg.stages, load, drain, step_pairs=c.cfg.step_pairs)


def _load(c: _Ctx, ring, b, kv_head, ptr, i, g):
    """TMA copies of step ``ptr + i``'s K and V tiles into ring slot ``g``, each once the
    consumers released the slot's previous tile."""
    slot = _slot(c, g, ring)
    kv_start = pl.multiple_of(c.steps[ptr + i, plan_abi.STEP_KV_START], ALIGN)
    src = (b, pl.ds(kv_start, c.cfg.tile_kv), kv_head)

    @pl.when(g >= c.cfg.stages)
    def _():
        plgpu.barrier_wait(c.k_consumed.at[slot])

    plgpu.copy_gmem_to_smem(c.k.at[src], c.k_smem.at[slot], c.k_bar.at[slot])

    @pl.when(g >= c.cfg.stages)
    def _():
        plgpu.barrier_wait(c.v_consumed.at[slot])

    plgpu.copy_gmem_to_smem(c.v.at[src], c.v_smem.at[slot], c.v_bar.at[slot])


def _drain(c: _Ctx, ring, total):
    """Observes the consumption of the last tiles too, so every barrier phase is waited for
    before the barriers go away (the interpreter checks this)."""
    @pl.loop(jnp.maximum(total - c.cfg.stages, 0), total)
    def _(g):
        plgpu.barrier_wait(c.k_consumed.at[_slot(c, g, ring)])
        plgpu.barrier_wait(c.v_consumed.at[_slot(c, g, ring)])
