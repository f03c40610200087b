"""Hopper (sm_90a) Mosaic GPU forward kernel that executes a plan (see ``plan_abi``).

Modelled on jax's ``ops/gpu/attention_mgpu.py`` (FlashAttention-3 style): one CTA per work unit,
consumer warpgroups of 64 query rows each and a producer warpgroup that streams the unit's K/V
tiles by TMA through a ``stages``-deep shared-memory ring. The consumers run wgmma and an
online softmax in base 2. With tile_q = 128 two consumers are ping-ponged by a schedule barrier
so one warpgroup's softmax overlaps the other's matrix products; with tile_q = 64 there is one
consumer, no ping-pong, and the overlap comes from two CTAs per SM (small SMEM, no register
split). What differs from the dense kernel: the K/V tiles a unit visits, and how many, come
from the plan's ``steps`` (read from GMEM at run time), and the rectangle mask is applied only
on partial steps (a ``lax.cond`` skips it on full ones; mask mode "unit" instead sends units
whose steps are all full to a loop without masking code; mask mode "none", picked from a
concrete plan whose steps are all full, compiles only the unmasked loop). Plan starts must
be multiples of 8 (TMA fills the 8-row tiled, swizzled SMEM layout); templates declare it as
q_align / kv_align. Variants (template options): a persistent loop (one CTA per SM walking the
units, the ring continuing across units), masking on every step, ``wg_skip`` (a consumer
warpgroup skips the matrix products and softmax of steps whose rows miss its 64 rows, for
plans that pack two 64-row query blocks into one unit) and ``paired`` (tile_q = 64, two
units per CTA, one per consumer warpgroup, each with its own K/V ring); measurements in
``benchmarks/NOTES.md``. On CPU, ``interpret=`` runs it under the Mosaic GPU interpreter,
with P @ V as a plain dot (the interpreter lacks run_state and wgmma with a register operand).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import abi as plan_abi
from pallas_kernels import templates as _templates

__all__ = ["KernelConfig", "attention", "config_from_template"]

_WG_ROWS = 64                      # rows per consumer warpgroup (one wgmma M tile)
_ALIGN = 8                         # q_start / kv_start alignment (rows of one SMEM tile)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static shape of one compiled kernel: tile_q query rows (one consumer warpgroup per 64),
    tile_kv keys per step, ``stages`` ring slots, and the variant switches."""

    tile_kv: int
    stages: int
    tile_q: int = 2 * _WG_ROWS
    use_schedule_barrier: bool = True  # ping-pong of the two consumer WGs (ignored with one)
    mask_mode: str = "cond"      # "cond": mask partial steps only (a cond per step);
    #                              "unit": units whose steps are all full run a loop without
    #                              masking code, the others as "cond"; "always": every step;
    #                              "none": never (plans whose steps are all full)
    persistent: bool = False     # one CTA per SM looping over the units, or one CTA per unit
    num_ctas: int = 0            # persistent CTAs; 0: one per multiprocessor
    prefetch_rect: bool = False  # read step i+1's rectangle from GMEM during step i
    wg_skip: bool = False        # a consumer WG skips steps whose rows miss its 64 rows
    paired: bool = False         # tile_q=64: two consumer WGs, each on its own unit and ring
    pair_pingpong: bool = False  # paired: ping-pong the two units' WGs like tile_q=128's

    def __post_init__(self):
        if self.tile_q not in (_WG_ROWS, 2 * _WG_ROWS):
            raise ValueError(f"tile_q must be {_WG_ROWS} (one consumer warpgroup) or "
                             f"{2 * _WG_ROWS} (two warpgroups of {_WG_ROWS} rows), "
                             f"got {self.tile_q}")
        if self.tile_kv % 64 or not 0 < self.tile_kv <= plan_abi.MAX_TILE:
            raise ValueError(f"tile_kv must be a positive multiple of 64 up to "
                             f"{plan_abi.MAX_TILE} (the plan ABI packs rectangle bounds in "
                             f"bytes), got {self.tile_kv}")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2, got {self.stages}")
        if self.mask_mode not in _MASK_MODES:
            raise ValueError(f"mask_mode must be one of {_MASK_MODES}, got {self.mask_mode!r}")
        if self.wg_skip and self.tile_q == _WG_ROWS:
            raise ValueError("wg_skip needs two consumer warpgroups on one unit (tile_q=128): "
                             "with tile_q=64 every step's rows are the warpgroup's rows")
        if self.paired and (self.tile_q != _WG_ROWS or self.persistent):
            raise ValueError("paired (two 64-row units per CTA) needs tile_q=64 and a grid "
                             "kernel (persistent=False)")
        if self.pair_pingpong and not self.paired:
            raise ValueError("pair_pingpong needs paired=True (two units per CTA)")

    @property
    def compute_wgs(self) -> int:
        """Consumer warpgroups (64 query rows each)."""
        return 2 if self.paired else self.tile_q // _WG_ROWS

    @property
    def rings(self) -> int:
        """K/V rings: one per unit the CTA runs at once."""
        return 2 if self.paired else 1

    @property
    def schedule_barrier(self) -> bool:
        """Whether the two consumer warpgroups ping-pong: on one 128-row unit, or on two paired
        units with ``pair_pingpong`` (the one with fewer steps keeps the barrier's phases)."""
        return self.use_schedule_barrier and (self.tile_q == 2 * _WG_ROWS or self.pair_pingpong)


_MASK_MODES = ("unit", "cond", "always", "none")


def config_from_template(template, mask_mode: str | None = None) -> KernelConfig:
    """The kernel config of a registered ``mosaic_gpu`` template (name or Template);
    ``mask_mode`` overrides the template's (the wrapper picks "none" for all-full plans)."""
    t = _templates.get(template)
    if t.backend != "mosaic_gpu":
        raise ValueError(f"template {t.name!r} is for backend {t.backend!r}, not mosaic_gpu")
    return KernelConfig(tile_kv=t.tile_kv, stages=t.stages, tile_q=t.tile_q,
                        use_schedule_barrier=bool(t.option("schedule_barrier", True)),
                        mask_mode=str(mask_mode or t.option("mask_mode", "cond")),
                        persistent=bool(t.option("persistent", False)),
                        num_ctas=int(t.option("num_ctas", 0)),
                        prefetch_rect=bool(t.option("prefetch_rect", False)),
                        wg_skip=bool(t.option("wg_skip", False)),
                        paired=bool(t.option("paired", False)),
                        pair_pingpong=bool(t.option("pair_pingpong", False)))


def _num_sms() -> int:
    """Multiprocessors of the default GPU (132 on an H100/H200 SXM when it can't be read)."""
    try:
        dev = jax.devices()[0]
        n = int(getattr(dev, "core_count", 0) or 0)
        return n if dev.platform == "gpu" and n > 0 else 132
    except Exception:  # noqa: BLE001
        return 132


def _smem_bytes(cfg: KernelConfig, head_dim: int) -> int:
    """Shared memory of one CTA: Q/O tiles, the K/V ring, LSE, plus ~2.7 KB of barriers and
    alignment (232,568 bytes measured for tile_kv=128, 3 stages, D=128; the reduction scratch
    and barriers take 2.6-2.9 KB in the cross-lowered kernels)."""
    rows = cfg.compute_wgs * _WG_ROWS
    return 2 * (rows * head_dim + 2 * cfg.rings * cfg.stages * cfg.tile_kv * head_dim) \
        + 4 * rows + 2900


_MAX_SMEM = 232448                 # bytes per CTA on sm_90 (the limit Mosaic GPU reports)
_SM_SMEM = 233472                  # bytes per multiprocessor (228 KiB), 1 KiB reserved per CTA


def _ctas_per_sm(cfg: KernelConfig, head_dim: int) -> int:
    """CTAs that fit on one multiprocessor by shared memory (registers permitting)."""
    return _SM_SMEM // (_smem_bytes(cfg, head_dim) + 1024)


def _plan_forward(q, k, v, units, steps, *, cfg: KernelConfig, scale: float, interpret=False):
    """Runs the kernel: q [B, Lqp, Hq, D], k/v [B, Lkvp, Hkv, D] (already padded) ->
    out_units [B, U, tile_q, D] (q.dtype) and lse_units [B, U, tile_q] (float32, natural log)."""
    B, _, Hq, D = q.shape
    _, _, Hkv, _ = k.shape
    group = Hq // Hkv
    U = units.shape[0]
    dtype = q.dtype
    tile_kv, stages, tile_q = cfg.tile_kv, cfg.stages, cfg.tile_q
    nwg = cfg.compute_wgs                  # consumer warpgroups; the producer is warpgroup nwg
    paired = cfg.paired                    # consumer WG w runs unit 2 * cta + w, ring w
    sched_on = cfg.schedule_barrier
    qk_scale = float(scale) * _LOG2E       # scores kept in base-2 units: s * scale * log2(e)

    num_steps = steps.shape[0]
    work = U * B                           # work items (unit u, batch b), u-major
    if cfg.persistent:
        num_ctas = min(work, cfg.num_ctas or _num_sms())

    def kernel(q_ref, k_ref, v_ref, units_ref, steps_ref, unit_full_ref, out_ref, lse_ref,
               scoped):
        wg = lax.axis_index("wg")
        (qo_smem2, k_smem, v_smem, lse_smem2), (k_bar, v_bar, q_bar), \
            (k_consumed, v_consumed), schedule_barrier = scoped
        if cfg.persistent:
            # Each CTA takes work items cta, cta + P, ... in the plan's schedule order. Ring
            # slots follow a step counter that runs on across units, so the producer fills
            # the next unit's K/V while the consumers finish the current one.
            cta = lax.axis_index("cta")
            n_items = lax.div(work - cta + num_ctas - 1, num_ctas)
            item = lambda j: cta + j * num_ctas
        else:
            n_items = 1
            item = lambda j: lax.axis_index("unit") * B + lax.axis_index("batch")

        def unit_of(j, ring=0):
            if paired:
                # Units 2c and 2c + 1 (neighbours in the schedule, so of similar cost); the
                # second one may lie past the last unit when U is odd: no steps, no store.
                u = lax.axis_index("unit") * 2 + ring
                b = lax.axis_index("batch")
                valid = u < U
                u = jnp.minimum(u, U - 1)
            else:
                w = item(j)
                u, b = lax.div(w, B), lax.rem(w, B)
                valid = True
            cnt = units_ref[u, plan_abi.UNIT_STEP_CNT]
            if paired:
                cnt = jnp.where(valid, cnt, 0)
            return (u, b, units_ref[u, plan_abi.UNIT_HEAD], units_ref[u, plan_abi.UNIT_Q_START],
                    units_ref[u, plan_abi.UNIT_STEP_PTR], cnt, valid)

        def slot_of(g, ring=0):
            return lax.rem(g, jnp.array(stages, g.dtype)) + ring * stages

        def schedule():
            if sched_on:
                plgpu.barrier_arrive(schedule_barrier)
                plgpu.barrier_wait(schedule_barrier)

        @pl.when(wg < nwg)
        def _consumer():
            if nwg == 2:
                # With one consumer WG the CTA stays small enough (registers, SMEM) for two
                # CTAs per SM; the register split only pays with two consumers (also when
                # paired: three warpgroups like the tile_q=128 kernel).
                plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            # This warpgroup's rows of the unit's tile, and its ring (paired: a unit of its own).
            ring = wg if paired else 0
            row0 = 0 if paired else pl.multiple_of(wg * _WG_ROWS, _WG_ROWS)

            def do_unit(j, base):
                u, b, head, q_start, ptr, cnt, valid = unit_of(j, ring)
                slot_of_ = lambda g: slot_of(g, ring)
                # Plan starts are multiples of 8 (templates' q_align/kv_align): tell the layout
                # inference, which must prove TMA starts divisible by the 8-row SMEM tiling.
                q_row = pl.multiple_of(q_start + row0, _ALIGN)
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_row, _WG_ROWS), head],
                                        qo_smem, q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])
                m_i = plgpu.layout_cast(jnp.full((_WG_ROWS,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((_WG_ROWS,), 0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((_WG_ROWS, D), 0, jnp.float32),
                                        plgpu.Layout.WGMMA)

                @pl.when(cnt > 0)
                def _():
                    plgpu.barrier_wait(k_bar.at[slot_of_(base)])

                pl.when(wg == 1)(schedule)

                def rect(i):
                    # Rectangle of step i, rows relative to this warpgroup's 64 rows. The
                    # index is clamped so a unit with no steps never reads past ``steps``.
                    # One int32 load, four bytes (``plan_abi.unpack_rect``).
                    s = jnp.minimum(ptr + i, num_steps - 1)
                    q_lo, q_hi, kv_lo, kv_hi = plan_abi.unpack_rect(
                        steps_ref[s, plan_abi.STEP_RECT])
                    return q_lo - row0, q_hi - row0, kv_lo, kv_hi

                def make_body(mode, wg_skip):
                    # One step of the K/V loop, specialised for a mask mode ("cond", "always" or
                    # "none") and for warpgroup skipping.
                    def body(i, carry):
                        acc, m_i, l_i, cur = carry
                        slot = slot_of_(base + i)
                        if cfg.prefetch_rect:
                            # Step i's rectangle came with the carry; read step i+1's now, so the
                            # GMEM latency hides behind this step's matrix products.
                            q_lo, q_hi, kv_lo, kv_hi = cur
                            nxt = rect(jnp.minimum(i + 1, cnt - 1))
                        elif mode == "none" and not wg_skip:
                            q_lo = q_hi = kv_lo = kv_hi = None     # never read: every step is full
                            nxt = cur
                        else:
                            q_lo, q_hi, kv_lo, kv_hi = rect(i)
                            nxt = cur

                        def end_softmax_barriers():
                            if sched_on:
                                plgpu.barrier_arrive(schedule_barrier)
                            plgpu.barrier_wait(v_bar.at[slot])
                            if sched_on:
                                plgpu.barrier_wait(schedule_barrier)

                        def wait_next_k():
                            @pl.when(i + 1 < cnt)
                            def _():
                                plgpu.barrier_wait(k_bar.at[slot_of_(base + i + 1)])

                        def compute(state):
                            acc, m_i, l_i = state

                            def compute_qk(acc_ref):
                                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                                schedule()
                                return acc_ref[...]

                            qk = pl.run_scoped(compute_qk,
                                               plgpu.ACC((_WG_ROWS, tile_kv), jnp.float32))
                            plgpu.barrier_arrive(k_consumed.at[slot])

                            def mask(x):
                                r = plgpu.broadcasted_iota(jnp.int32, x.shape, 0,
                                                           layout=plgpu.Layout.WGMMA)
                                c = plgpu.broadcasted_iota(jnp.int32, x.shape, 1,
                                                           layout=plgpu.Layout.WGMMA)
                                keep = (r >= q_lo) & (r < q_hi) & (c >= kv_lo) & (c < kv_hi)
                                return jnp.where(keep, x, -jnp.inf)

                            if mode == "cond":
                                full = ((q_lo <= 0) & (q_hi >= _WG_ROWS) & (kv_lo == 0)
                                        & (kv_hi == tile_kv))
                                qk = lax.cond(full, lambda x: x, mask, qk)
                            elif mode == "always":
                                qk = mask(qk)

                            # Online softmax in base 2. A row may have seen only masked entries so
                            # far (m == -inf): subtract 0 then, so that exp2 gives 0, never NaN.
                            # Without masking (all steps full) every score is finite: no guard.
                            m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
                            if mode == "none":
                                m_sub = m_ij
                            else:
                                m_sub = jnp.where(m_ij == -jnp.inf, 0.0, m_ij)
                            alpha = jnp.exp2(m_i - m_sub)
                            m_i = m_ij
                            p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_sub, qk.shape, [0]))
                            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                            l_i *= alpha
                            p16 = p.astype(dtype)

                            if D <= 128:
                                l_i += p.sum(axis=1)
                                acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
                                end_softmax_barriers()
                            else:
                                end_softmax_barriers()
                                l_i += p.sum(axis=1)

                            if interpret:
                                # The Mosaic GPU interpreter has neither a rule for run_state nor
                                # wgmma with a register A operand: PV is a plain dot on the tile.
                                acc = acc + jnp.dot(p16, v_smem.at[slot][...],
                                                    preferred_element_type=jnp.float32)
                                wait_next_k()
                            else:
                                def compute_pv(acc_ref):
                                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                                    wait_next_k()

                                acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
                            plgpu.barrier_arrive(v_consumed.at[slot])
                            return acc, m_i, l_i

                        def skip(state):
                            # The step's rows miss this warpgroup's: no matrix products and no
                            # softmax, but the same barrier traffic (ring slot release, the data
                            # barriers' phases, both ping-pong arrivals) as a computed step.
                            plgpu.barrier_arrive(k_consumed.at[slot])
                            schedule()
                            end_softmax_barriers()
                            wait_next_k()
                            plgpu.barrier_arrive(v_consumed.at[slot])
                            return state

                        state = (acc, m_i, l_i)
                        if wg_skip:
                            active = (q_lo < _WG_ROWS) & (q_hi > 0) & (q_lo < q_hi)
                            state = lax.cond(active, compute, skip, state)
                        else:
                            state = compute(state)
                        return (*state, nxt)

                    return body

                first = rect(0) if cfg.prefetch_rect else (jnp.int32(0),) * 4

                def run(mode, wg_skip):
                    def go(state):
                        out = lax.fori_loop(0, cnt, make_body(mode, wg_skip), (*state, first))
                        return out[:3]
                    return go

                if cfg.mask_mode == "unit":
                    # A unit whose steps are all full (flag computed from the plan outside the
                    # kernel) runs the loop without any masking code; the others mask their
                    # partial steps under a cond. Both warpgroups of a unit take one branch.
                    acc, m_i, l_i = lax.cond(unit_full_ref[u] != 0, run("none", False),
                                             run("cond", cfg.wg_skip), (acc, m_i, l_i))
                else:
                    acc, m_i, l_i = run(cfg.mask_mode, cfg.wg_skip)((acc, m_i, l_i))
                if paired and sched_on:
                    # Ping-pong over two units: each computed step takes two passes of the
                    # schedule barrier per warpgroup, so the warpgroup whose unit has fewer
                    # steps makes the passes of the other's remaining steps (no K/V, no math).
                    cnt_other = unit_of(j, 1 - ring)[5]

                    def pad(i, c):
                        schedule()
                        schedule()
                        return c

                    lax.fori_loop(cnt, jnp.maximum(cnt, cnt_other), pad, jnp.int32(0))
                pl.when(wg == 0)(schedule)

                empty = l_i == 0.0
                l_safe = jnp.where(empty, 1.0, l_i)
                acc /= lax.broadcast_in_dim(l_safe, acc.shape, [0])
                qo_smem[...] = acc.astype(dtype)
                lse_smem[...] = jnp.where(empty, -jnp.inf, m_i * _LN2 + jnp.log(l_safe))
                plgpu.commit_smem()

                def store():
                    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[b, u, pl.ds(row0, _WG_ROWS)])
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, u, pl.ds(row0, _WG_ROWS)])
                    plgpu.wait_smem_to_gmem(0)  # Q/O and LSE buffers are reused next unit

                if paired:
                    pl.when(valid)(store)      # an odd unit count leaves the last WG idle
                else:
                    store()
                return base + cnt

            lax.fori_loop(0, n_items, do_unit, jnp.int32(0))

        @pl.when(wg == nwg)
        def _producer():
            if nwg == 2:
                plgpu.set_max_registers(40, action="decrease")

            def load(ring, b, kv_head, ptr, i, g):
                slot = slot_of(g, ring)
                kv_start = pl.multiple_of(steps_ref[ptr + i, plan_abi.STEP_KV_START], _ALIGN)
                src = (b, pl.ds(kv_start, tile_kv), kv_head)

                @pl.when(g >= stages)
                def _():
                    plgpu.barrier_wait(k_consumed.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])

                @pl.when(g >= stages)
                def _():
                    plgpu.barrier_wait(v_consumed.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

            def drain(ring, total):
                # Observe the consumption of the last tiles too, so every barrier phase is
                # waited for before the barriers go away (the interpreter checks this).
                @pl.loop(jnp.maximum(total - stages, 0), total)
                def _(g):
                    plgpu.barrier_wait(k_consumed.at[slot_of(g, ring)])
                    plgpu.barrier_wait(v_consumed.at[slot_of(g, ring)])

            if paired:
                # Both units' tiles in step order, one of each in turn, each in its own ring.
                streams = []
                for ring in range(2):
                    _, b, head, _, ptr, cnt, _ = unit_of(0, ring)
                    streams.append((b, lax.div(head, jnp.array(group, head.dtype)), ptr, cnt))

                @pl.loop(0, jnp.maximum(streams[0][3], streams[1][3]))
                def _(i):
                    for ring, (b, kv_head, ptr, cnt) in enumerate(streams):
                        pl.when(i < cnt)(lambda: load(ring, b, kv_head, ptr, i, i))

                for ring, (_, _, _, cnt) in enumerate(streams):
                    drain(ring, cnt)
                return

            def do_unit(j, base):
                _, b, head, _, ptr, cnt, _ = unit_of(j)
                kv_head = lax.div(head, jnp.array(group, head.dtype))

                @pl.loop(0, cnt)
                def _(i):
                    load(0, b, kv_head, ptr, i, base + i)

                return base + cnt

            drain(0, lax.fori_loop(0, n_items, do_unit, jnp.int32(0)))

    def entry(q_ref, k_ref, v_ref, units_ref, steps_ref, *refs):
        unit_full_ref = refs[0] if len(refs) == 3 else None
        out_ref, lse_ref = refs[-2:]
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        slots = cfg.rings * stages
        qo = plgpu.SMEM((nwg, _WG_ROWS, D), dtype, transforms=(tiling, swizzle))
        kbuf = plgpu.SMEM((slots, tile_kv, D), dtype, transforms=(tiling, swizzle))
        vbuf = plgpu.SMEM((slots, tile_kv, D), dtype, transforms=(tiling, swizzle))
        lse = plgpu.SMEM((nwg, _WG_ROWS), jnp.float32)
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, units_ref, steps_ref, unit_full_ref,
                                   out_ref, lse_ref, scoped),
            (qo, kbuf, vbuf, lse),
            (plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots),
             plgpu.Barrier(num_barriers=nwg)),
            # A slot is free once every warpgroup that reads it is done with it.
            (plgpu.Barrier(num_arrivals=1 if paired else nwg, num_barriers=slots),) * 2,
            plgpu.Barrier(num_arrivals=nwg),
            collective_axes="wg",
        )

    out_type = (jax.ShapeDtypeStruct((B, U, tile_q, D), dtype),
                jax.ShapeDtypeStruct((B, U, tile_q), jnp.float32))
    kwargs = {}
    if interpret:
        kwargs["interpret"] = interpret
    if cfg.persistent:
        grid, grid_names = (num_ctas,), ("cta",)
    else:
        grid, grid_names = (-(-U // 2) if paired else U, B), ("unit", "batch")
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(q, k, v, units, steps, *([_unit_full(units, steps, tile_q, tile_kv)]
                               if cfg.mask_mode == "unit" else []))


def _unit_full(units, steps, tile_q, tile_kv):
    """int32 [U]: 1 where every step of the unit is the full tile (in-graph, so traced plans
    get it too): a prefix count of partial steps differenced over [ptr, ptr + cnt)."""
    S = steps.shape[0]
    full = steps[:, plan_abi.STEP_RECT] == plan_abi.full_rect(tile_q, tile_kv)
    partial = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                               jnp.cumsum((~full).astype(jnp.int32))])
    lo = jnp.clip(units[:, plan_abi.UNIT_STEP_PTR], 0, S)
    hi = jnp.clip(units[:, plan_abi.UNIT_STEP_PTR] + units[:, plan_abi.UNIT_STEP_CNT], lo, S)
    return (partial[hi] == partial[lo]).astype(jnp.int32)


def _check(q, k, v, units, steps, row_index, t, q_len_padded, kv_len_padded, scale):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a rank-4 array [B, L, H, D], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    B, Lq, Hq, D = q.shape
    Bk, Lkv, Hkv, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if Bk != B or Dk != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch/head dim")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not t.supports(D, q.dtype):
        raise ValueError(f"template {t.name!r} supports head dims {t.head_dims} and dtypes "
                         f"{t.dtypes}; got head_dim={D}, dtype={jnp.dtype(q.dtype).name}")
    if units.ndim != 2 or units.shape[1] != plan_abi.UNIT_COLS or units.dtype != jnp.int32:
        raise ValueError(f"units must be int32 [U, {plan_abi.UNIT_COLS}], got "
                         f"{units.dtype}{tuple(units.shape)}")
    if steps.ndim != 2 or steps.shape[1] != plan_abi.STEP_COLS or steps.dtype != jnp.int32:
        raise ValueError(f"steps must be int32 [S, {plan_abi.STEP_COLS}], got "
                         f"{steps.dtype}{tuple(steps.shape)}")
    if row_index is not None and (tuple(row_index.shape) != (Hq, Lq)
                                  or row_index.dtype != jnp.int32):
        raise ValueError(f"row_index must be int32 [Hq, Lq] = [{Hq}, {Lq}], got "
                         f"{row_index.dtype}{tuple(row_index.shape)}")
    for name, val, low, unit, align in (("q_len_padded", q_len_padded, Lq, t.tile_q, t.q_align),
                                        ("kv_len_padded", kv_len_padded, Lkv, t.tile_kv,
                                         t.kv_align)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{name} must be a static int, got {type(val).__name__}")
        if val < max(low, unit) or val % align:
            raise ValueError(f"{name}={val} must be >= the sequence length {low} and the tile "
                             f"{unit}, and a multiple of {align}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 \
            or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")


def _check_concrete_plan(units, steps, t, q_len_padded, kv_len_padded) -> bool:
    """Host-side checks of a NumPy plan: alignment and bounds the kernel relies on. Returns
    whether every step a unit visits is full (the whole tile_q x tile_kv tile)."""
    if units.ndim != 2 or units.shape[1] != plan_abi.UNIT_COLS:
        return False  # _check reports the shape
    if steps.ndim != 2 or steps.shape[1] != plan_abi.STEP_COLS:
        return False
    real = units[:, plan_abi.UNIT_STEP_CNT] > 0
    qs = units[real, plan_abi.UNIT_Q_START].astype(np.int64)
    if np.any(qs % t.q_align) or np.any(qs < 0) or np.any(qs + t.tile_q > q_len_padded):
        raise ValueError(f"units: every q_start must be a multiple of q_align={t.q_align} with "
                         f"q_start + {t.tile_q} <= q_len_padded={q_len_padded} "
                         f"(template {t.name!r}); plan for this template")
    ptr = units[real, plan_abi.UNIT_STEP_PTR].astype(np.int64)
    cnt = units[real, plan_abi.UNIT_STEP_CNT].astype(np.int64)
    S = steps.shape[0]
    if np.any(ptr < 0) or np.any(ptr + cnt > S):
        raise ValueError("units: step ranges [ptr, ptr + cnt) must lie inside steps")
    # Rows some unit visits: +1 at each range start, -1 at its end, prefix sum (O(U + S), no
    # per-visit index array: units of a shared mask visit the same rows).
    edges = np.bincount(ptr, minlength=S + 1) - np.bincount(ptr + cnt, minlength=S + 1)
    vis = steps[np.cumsum(edges[:S]) > 0]
    ks = vis[:, plan_abi.STEP_KV_START]
    if np.any(ks % t.kv_align) or np.any(ks < 0) or np.any(ks > kv_len_padded - t.tile_kv):
        raise ValueError(f"steps: every kv_start must be a multiple of kv_align={t.kv_align} "
                         f"with kv_start + {t.tile_kv} <= kv_len_padded={kv_len_padded} "
                         f"(template {t.name!r}); plan for this template")
    return bool(np.all(vis[:, plan_abi.STEP_RECT] == plan_abi.full_rect(t.tile_q, t.tile_kv)))


def mask_mode_for(template, all_full: bool) -> str:
    """The mask mode a plan runs with, given whether every step it visits is full (for a
    trusted plan whose fullness is known, e.g. ``Plan.all_full``: no walk over the steps)."""
    return _auto_mask_mode(_templates.get(template), bool(all_full))


def plan_mask_mode(units, steps, template, q_len_padded, kv_len_padded) -> str:
    """The mask mode a concrete (NumPy) plan runs with: "none" (no cond, no -inf guard, no
    per-unit flag) when the template masks by cond (the default) or by unit and every visited
    step is full, else the template's own mode ("always" stays, and so does every mode of a
    template with the option ``auto_none=False``, for comparisons). Checks the plan like
    ``attention`` does."""
    t = _templates.get(template)
    all_full = _check_concrete_plan(np.asarray(units), np.asarray(steps), t, q_len_padded,
                                    kv_len_padded)
    return _auto_mask_mode(t, all_full)


def _auto_mask_mode(t, all_full: bool) -> str:
    mode = str(t.option("mask_mode", "cond"))
    auto = bool(t.option("auto_none", True))
    return "none" if auto and mode in ("cond", "unit") and all_full else mode


def _pad_len(x, length):
    if x.shape[1] == length:
        return x
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))


@functools.partial(jax.jit, static_argnames=("template", "q_len_padded", "kv_len_padded",
                                             "scale", "return_lse", "interpret", "mask_mode"))
def _attention(q, k, v, units, steps, row_index, *, template, q_len_padded, kv_len_padded,
               scale, return_lse, interpret, mask_mode=None):
    cfg = config_from_template(template, mask_mode)
    qp = _pad_len(q, q_len_padded)
    kp = _pad_len(k, kv_len_padded)
    vp = _pad_len(v, kv_len_padded)
    out_u, lse_u = _plan_forward(qp, kp, vp, units, steps, cfg=cfg, scale=scale,
                                 interpret=interpret)
    if row_index is None:
        row_index = plan_abi.row_index_from_units(units, q.shape[2], q.shape[1], template.tile_q)
    out, lse = plan_abi.gather_rows(out_u, lse_u, row_index)
    return (out, lse) if return_lse else out


def attention(q, k, v, units, steps, row_index, *, template, q_len_padded, kv_len_padded,
              scale=None, return_lse=False, interpret=False, mask_mode=None, check_plan=True):
    """Block-sparse attention executing a plan on Hopper with Mosaic GPU.

    q [B, Lq, Hq, D]; k, v [B, Lkv, Hkv, D] (bf16 or f16, D in the template's head dims);
    units, steps, row_index: the plan's int32 arrays (``plan_abi``), built for this
    template's tile_q / tile_kv and the given padded lengths; ``row_index=None`` computes it on
    the device from units (``plan_abi.row_index_from_units``: nothing to copy). Returns out [B, Lq, Hq, D]
    (q.dtype) and, with ``return_lse``, lse [B, Hq, Lq] (float32, natural log; -inf and
    output 0 for a row with no selected key). ``interpret``: a Mosaic GPU interpreter params
    object (``jax._src.pallas.mosaic_gpu.interpret``) to run on CPU, for tests.
    ``mask_mode``: None picks it from a concrete NumPy plan (``plan_mask_mode``: "none" when
    every step is full) or takes the template's for traced plan arrays; "none" on a plan with
    partial steps would be wrong, so a concrete plan is checked. ``check_plan=False``: the
    caller vouches for a NumPy plan (the planner built it for this template): no host walk over
    its steps, and its arrays go into the jitted call as they are (copied by jax's C++ dispatch,
    which costs less than a separate device_put).
    """
    t = _templates.get(template)
    if mask_mode is not None and mask_mode not in _MASK_MODES:
        raise ValueError(f"mask_mode must be None or one of {_MASK_MODES}, got {mask_mode!r}")
    if check_plan and isinstance(units, np.ndarray) and isinstance(steps, np.ndarray):
        all_full = _check_concrete_plan(units, steps, t, q_len_padded, kv_len_padded)
        if mask_mode == "none" and not all_full:
            raise ValueError("mask_mode='none' needs a plan whose steps are all full; this "
                             "plan has partial steps")
        mask_mode = mask_mode or _auto_mask_mode(t, all_full)
    # NumPy arrays stay NumPy: the jitted call copies them (not a separate device_put).
    units, steps = (a if isinstance(a, np.ndarray) else jnp.asarray(a) for a in (units, steps))
    if row_index is not None and not isinstance(row_index, np.ndarray):
        row_index = jnp.asarray(row_index)   # None: computed on the device from units
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5 if hasattr(q, "shape") and len(q.shape) == 4 else 1.0
    _check(q, k, v, units, steps, row_index, t, q_len_padded, kv_len_padded, scale)
    return _attention(q, k, v, units, steps, row_index, template=t,
                      q_len_padded=int(q_len_padded), kv_len_padded=int(kv_len_padded),
                      scale=float(scale), return_lse=bool(return_lse), interpret=interpret,
                      mask_mode=mask_mode)
