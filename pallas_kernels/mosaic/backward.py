"""Backward kernels on Mosaic GPU (Hopper, sm_90a): dq over the forward plan, dk/dv over the
transposed plan (``pallas_kernels.backward_rows`` says which is which).

Modelled on jax's ``ops/gpu/attention_mgpu.py`` backward (separate ``kernel_dq`` and
``kernel_dkv``, delta computed first, a memory warpgroup streaming tiles through a
``stages``-deep SMEM ring to two compute warpgroups of 64 rows each, wgmma for the five matrix
products, exp2 with the row's lse), with the K/V tiles (dq) or query tiles (dk/dv) a unit
visits and how many read from the plan's ``steps`` at run time, and each step masked as the
forward masks it (``common.masked_step``: a plain step's rectangle, a grid step's cells, a
bitmap step's bits; a full step unmasked with mask mode "cond").

* ``dq`` runs the forward plan's template shape: tile_q = 128 (two warpgroups on the two
  64-row halves of one unit, one K/V ring) or, for ``paired`` templates, tile_q = 64 (each
  warpgroup its own unit and ring). Per step: S = Q K^T, dP = dO V^T, P = exp2(S c - lse c),
  dS = P (dP - delta), dQ += dS K (c = log2 e; scores scaled).
* ``dkv`` runs units of ``DKV_TILES`` (128 keys: two warpgroups of 64 keys), or paired units of
  ``DKV_PAIRED_TILES`` (64 keys, two per CTA, each warpgroup its own unit and Q/dO ring), over
  steps of 64 queries of one query head: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T,
  dS^T = P^T (dP^T - delta), dK += dS^T Q; written per query head in the input dtype (as
  attention_mgpu) and summed over each K/V head's group in float32 outside.

bf16 and f16 (the SMEM buffers are in the input dtype, unlike attention_mgpu's float16
scratch), head dims 64 and 128, plan starts multiples of 8 (TMA). On CPU, ``interpret=`` runs
them under the Mosaic GPU interpreter, with the products whose A operand lives in registers
(dS K, P^T dO, dS^T Q) as plain dots: the interpreter has no rule for run_state nor for
wgmma with a register A operand (the forward kernel does the same for P V).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import abi
from pallas_kernels.contract import LOG2E
from pallas_kernels.mosaic.common import (ALIGN, CONSUMERS, WG_ROWS, bcast, gather_produce,
                                          load_gathered, masked_pair, masked_step, owned_rows,
                                          rows_of, store_owned)

__all__ = ["dq_call", "dkv_call", "DKV_TILES", "DKV_PAIRED_TILES", "STAGES",
           "smem_bytes"]

STAGES = 2                      # ring slots of the streamed tiles
#: The transposed plan's (keys per unit, queries per step, key align, query align).
DKV_TILES = (CONSUMERS * WG_ROWS, 64, ALIGN, ALIGN)
#: Paired dk/dv units: 64 keys each, two per CTA, each warpgroup streaming its own unit's
#: queries (two Q/dO rings): for key blocks of <= 64 tokens, as the forward's q64x2.
DKV_PAIRED_TILES = (WG_ROWS, 64, ALIGN, ALIGN)
#: Queries one copy of a gathered dk/dv stage loads: 32, so each copy of lse / delta (f32) is
#: 128 bytes, TMA's SMEM alignment (8-query copies put lse at 32-byte offsets: the H200 raised
#: CUDA_ERROR_MISALIGNED_ADDRESS, benchmarks/NOTES.md#gathered-steps).
DKV_GATHER_RUN = 32


def smem_bytes(kernel: str, tile_kv: int, head_dim: int, rings: int = 1,
               stages: int = STAGES, direct: bool = False) -> int:
    """SMEM of one CTA (bytes, 2-byte inputs): ``dq``: Q and dO tiles (with ``direct`` the
    untiled dQ rows), lse / delta rows and the K/V ring(s) of ``tile_kv`` keys (``stages``
    slots each); ``dkv``: K and V tiles, the Q/dO ring and its lse / delta rows. Barriers and
    alignment add ~3 KB."""
    rows = CONSUMERS * WG_ROWS
    if kernel == "dq":
        return 2 * ((3 if direct else 2) * rows * head_dim
                    + 2 * rings * stages * tile_kv * head_dim) + 8 * rows + 3072
    return 2 * (2 * rows * head_dim + 2 * rings * STAGES * DKV_TILES[1] * head_dim) \
        + 8 * rings * STAGES * DKV_TILES[1] + 3072


# --- shared pieces ---------------------------------------------------------------------------
def _skipping(c, s, row0, compute, skip, state):
    """``compute(state)`` for step ``s``, or with ``c.wg_skip`` ``skip(state)`` (only the
    slot's releases: the data barriers were waited for, so releases keep the ring's phases)
    when the step's rectangle misses this warpgroup's 64 rows (tile rows row0 ..)."""
    if not c.wg_skip:
        return compute(state)
    q_lo, q_hi = abi.unpack_rect(c.steps[s, abi.STEP_RECT])[:2]
    active = (q_lo < row0 + WG_ROWS) & (q_hi > row0) & (q_lo < q_hi)
    return lax.cond(active, compute, skip, state)


def _mma(a_smem, b_smem_t, shape):
    """a @ b^T of two SMEM tiles by wgmma, float32 [shape]."""
    def body(acc):
        plgpu.wgmma(acc, a_smem, b_smem_t.transpose((1, 0)))
        return acc[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _mma_acc(acc, a_regs, b_smem, interpret):
    """acc + a @ b with a in registers (wgmma's register A operand; a plain dot under the
    interpreter, which lacks it)."""
    if interpret:
        return acc + jnp.dot(a_regs, b_smem[...], preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_regs, b_smem)
    return pl.run_state(body)(plgpu.ACC.init(acc))


# --- dq --------------------------------------------------------------------------------------
# Fields of both backward kernels' contexts (built by keyword): statics, then the
# operands in HBM.
_SHARED_FIELDS = [
    ("paired", bool),
    ("wg_skip", bool),  # a warpgroup skips the steps whose rectangle misses its 64 rows
    ("num_units", int),
    ("mode", str),
    ("num_steps", int),
    ("group", int),
    ("head_dim", int),
    ("dtype", Any),
    ("qk_scale", float),
    ("scale", float),
    ("interpret", Any),
    ("q", Any),
    ("k", Any),
    ("v", Any),
    ("do", Any),
    ("lse", Any),
    ("delta", Any),
    ("units", Any),
    ("steps", Any),
    ("words", Any),
]


_Dq = NamedTuple("_Dq", [
    ("tile_q", int),
    ("tile_kv", int),
    ("step_pairs", bool),  # two plan steps a K/V stage (``MosaicConfig.step_pairs``)
    ("gather_run", int),  # keys a copy of a gathered stage loads (0: steps are runs of keys)
    ("stages", int),      # K/V ring slots per ring
    ("dq", Any),
    ("q_smem", Any),
    ("do_smem", Any),
    ("lse_smem", Any),
    ("delta_smem", Any),
    ("k_smem", Any),
    ("v_smem", Any),
    ("direct", bool),  # dQ's owned rows stored in place into dq [B, Lqp, Hq, D]
    ("rows_smem", Any),  # direct: [CONSUMERS, 64, D] untiled, dQ rows of a partial slab
    ("in_bars", Any),  # per consumer warpgroup: Q, dO, lse, delta arrived
    ("k_bar", Any),
    ("v_bar", Any),
    ("k_consumed", Any),
    ("v_consumed", Any),
] + _SHARED_FIELDS)


def _unit(c, ring):
    """(u, b, head, row_start, ptr, cnt, valid) of this CTA's unit (paired: the ring's unit;
    ``valid`` False past the last unit, whose count then reads 0)."""
    b = lax.axis_index("batch")
    if c.paired:
        u = lax.axis_index("unit") * 2 + ring
        valid = u < c.num_units
        u = jnp.minimum(u, c.num_units - 1)
    else:
        u, valid = lax.axis_index("unit"), True
    cnt = c.units[u, abi.UNIT_STEP_CNT]
    if c.paired:
        cnt = jnp.where(valid, cnt, 0)
    return (u, b, c.units[u, abi.UNIT_HEAD], c.units[u, abi.UNIT_Q_START],
            c.units[u, abi.UNIT_STEP_PTR], cnt, valid)


def _if_valid(c, valid, fn):
    """Runs ``fn`` (a unit's store) unless a paired CTA's second ring is past the last unit."""
    if c.paired:
        pl.when(valid)(fn)
    else:
        fn()


def _warpgroups(c, consumer, producer):
    """The kernel body per warpgroup: ``consumer(c, wg)`` on the CONSUMERS compute
    warpgroups, ``producer(c)`` on the last (the loads)."""
    wg = lax.axis_index("wg")
    pl.when(wg < CONSUMERS)(functools.partial(consumer, c, wg))
    pl.when(wg == CONSUMERS)(functools.partial(producer, c))


def _produce(c, load, drain):
    """The producer warpgroup of both kernels: for each ring's unit (two when paired), step
    i's tiles loaded by ``load(slot, i, b, head, start)`` (start: the step's STEP_KV_START;
    ``load`` waits for the slot to be free), then ``drain(slot)`` on the last STAGES slots,
    so the CTA ends only after the consumers are done with them."""
    plgpu.set_max_registers(40, action="decrease")
    streams = [_unit(c, ring) for ring in range(2 if c.paired else 1)]

    @pl.loop(0, functools.reduce(jnp.maximum, [s[5] for s in streams]))
    def _(i):
        for ring, (_, b, head, _, ptr, cnt, _) in enumerate(streams):
            @pl.when(i < cnt)
            def _():
                start = pl.multiple_of(c.steps[ptr + i, abi.STEP_KV_START], ALIGN)
                load(_slot(i, ring), i, b, head, start)

    for ring, unit in enumerate(streams):
        @pl.loop(jnp.maximum(unit[5] - STAGES, 0), unit[5])
        def _(g):
            drain(_slot(g, ring))


def _slot(g, ring, stages: int = STAGES):
    return lax.rem(g, jnp.array(stages, g.dtype)) + ring * stages


def _dq_consumer(c: _Dq, wg):
    plgpu.set_max_registers(232, action="increase")
    ring = wg if c.paired else 0
    row0 = 0 if c.paired else pl.multiple_of(wg * WG_ROWS, WG_ROWS)
    u, b, head, q_start, ptr, cnt, valid = _unit(c, ring)
    rows = pl.ds(pl.multiple_of(q_start + row0, ALIGN), WG_ROWS)
    q_smem, do_smem = c.q_smem.at[wg], c.do_smem.at[wg]
    bars = c.in_bars
    plgpu.copy_gmem_to_smem(c.q.at[b, rows, head], q_smem, bars[0].at[wg])
    plgpu.copy_gmem_to_smem(c.do.at[b, rows, head], do_smem, bars[1].at[wg])
    plgpu.copy_gmem_to_smem(c.lse.at[b, u, pl.ds(row0, WG_ROWS)], c.lse_smem.at[wg],
                            bars[2].at[wg])
    plgpu.copy_gmem_to_smem(c.delta.at[b, u, pl.ds(row0, WG_ROWS)], c.delta_smem.at[wg],
                            bars[3].at[wg])
    for bar in bars:
        plgpu.barrier_wait(bar.at[wg])
    lse2 = plgpu.load(c.lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    delta = plgpu.load(c.delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    shape = (WG_ROWS, 2 * c.tile_kv if c.step_pairs else c.tile_kv)

    def step(i, acc):
        slot = _slot(i, ring, c.stages)
        first = 2 * i if c.step_pairs else i
        s_row = jnp.minimum(ptr + first, c.num_steps - 1)
        plgpu.barrier_wait(c.k_bar.at[slot])
        plgpu.barrier_wait(c.v_bar.at[slot])

        def compute(acc):
            s = _mma(q_smem, c.k_smem.at[slot], shape)
            dp = _mma(do_smem, c.v_smem.at[slot], shape)
            plgpu.barrier_arrive(c.v_consumed.at[slot])
            if c.step_pairs:
                s = masked_pair(c.steps, c.words, s_row,
                                jnp.minimum(s_row + 1, c.num_steps - 1), first + 1 < cnt,
                                row0, c.tile_q, c.tile_kv, c.mode, s)
            else:
                s = masked_step(c.steps, c.words, s_row, row0, c.tile_q, c.tile_kv, c.mode, s,
                                gather=c.gather_run > 0)
            p = jnp.exp2(s * c.qk_scale - bcast(lse2, shape, 0))
            ds = p * (dp - bcast(delta, shape, 0))
            acc = _mma_acc(acc, ds.astype(c.dtype), c.k_smem.at[slot], c.interpret)
            plgpu.barrier_arrive(c.k_consumed.at[slot])
            return acc

        def skip(acc):
            plgpu.barrier_arrive(c.v_consumed.at[slot])
            plgpu.barrier_arrive(c.k_consumed.at[slot])
            return acc

        return _skipping(c, s_row, row0, compute, skip, acc)

    acc = plgpu.layout_cast(jnp.full((WG_ROWS, c.head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, (cnt + 1) // 2 if c.step_pairs else cnt, step, acc)
    dq = (acc * c.scale).astype(c.dtype)
    if not c.direct:
        q_smem[...] = dq                                   # Q is read no more: dQ goes there
        plgpu.commit_smem()

    def store():
        if c.direct:
            lo, hi = owned_rows(c.units, u, row0)
            q_row = pl.multiple_of(q_start + row0, ALIGN)     # the whole slab's TMA start
            store_owned(dq, q_smem, c.rows_smem.at[wg], lo, hi,
                        lambda p, n: c.dq.at[b, pl.ds(q_row + p, n), head])
        else:
            plgpu.copy_smem_to_gmem(q_smem, c.dq.at[b, u, pl.ds(row0, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    _if_valid(c, valid, store)


def _dq_producer(c: _Dq):
    if c.gather_run or c.step_pairs:
        _dq_gather_producer(c)
        return

    def load(slot, i, b, head, kv_start):
        src = (b, pl.ds(kv_start, c.tile_kv), lax.div(head, jnp.array(c.group, head.dtype)))

        @pl.when(i >= STAGES)
        def _():
            plgpu.barrier_wait(c.k_consumed.at[slot])
        plgpu.copy_gmem_to_smem(c.k.at[src], c.k_smem.at[slot], c.k_bar.at[slot])

        @pl.when(i >= STAGES)
        def _():
            plgpu.barrier_wait(c.v_consumed.at[slot])
        plgpu.copy_gmem_to_smem(c.v.at[src], c.v_smem.at[slot], c.v_bar.at[slot])

    def drain(slot):
        plgpu.barrier_wait(c.k_consumed.at[slot])
        plgpu.barrier_wait(c.v_consumed.at[slot])

    _produce(c, load, drain)


def _dq_gather_producer(c: _Dq):
    """The dq producer of a gathering plan (each ring's unit's K/V stages by runs of
    ``gather_run`` keys) or of step pairs (a copy of each step's tile_kv keys):
    ``common.load_gathered``, ``_gather_produce``."""
    run = c.tile_kv if c.step_pairs else c.gather_run

    def load(b, head, starts, slot, wait):
        load_gathered(rows_of((c.k, c.v), b, lax.div(head, jnp.array(c.group, head.dtype))),
                      (c.k_smem, c.v_smem), (c.k_bar, c.v_bar), (c.k_consumed, c.v_consumed),
                      starts, run, slot, wait)

    def drain(slot):
        plgpu.barrier_wait(c.k_consumed.at[slot])
        plgpu.barrier_wait(c.v_consumed.at[slot])

    _gather_produce(c, c.tile_kv, c.stages, load, drain, run, c.step_pairs)


def _gather_produce(c, tile: int, stages: int, load, drain, run: int | None = None,
                    step_pairs: bool = False):
    """The producer warpgroup of a gathering plan (both kernels) or of step pairs:
    ``common.gather_produce`` over each ring's unit (two when paired)."""
    plgpu.set_max_registers(40, action="decrease")
    streams = []
    for ring in range(2 if c.paired else 1):
        _, b, head, _, ptr, cnt, _ = _unit(c, ring)
        streams.append((b, head, ptr, cnt))
    gather_produce(streams, c.steps, c.words, c.num_steps, tile,
                   c.gather_run if run is None else run, stages, load, drain,
                   step_pairs=step_pairs)


def dq_call(q, k, v, do, lse_u, delta_u, units, steps, *, tile_q, tile_kv, paired, mode,
            scale, interpret, gather_run: int = 0, stages: int = STAGES, wg_skip: bool = False,
            direct: bool = False, step_pairs: bool = False):
    """dQ per unit [B, U, tile_q, D] over the forward plan; ``gather_run``: keys a copy loads
    on gathered steps (0: a plan without them, one copy a stage); ``stages``: K/V ring slots
    per ring (a gathering producer's; the other keeps STAGES); ``wg_skip``: a warpgroup skips
    the steps whose rectangle misses its rows (tile_q 128); ``direct``: dQ [B, Lqp, Hq, D],
    each unit's owned rows stored in place (``common.store_owned``; a plan whose units own
    every row); ``step_pairs``: two plan steps a K/V stage (``MosaicConfig.step_pairs``: the
    forward's 128-key products for a plan of 64-key steps)."""
    if wg_skip and paired:
        raise ValueError("dq_call: wg_skip needs two warpgroups on one unit (not paired)")
    if step_pairs and (paired or wg_skip or gather_run or tile_kv != 64):
        raise ValueError("dq_call: step_pairs runs a 128-row unit's 64-key steps (not paired, "
                         "wg_skip or gathering)")
    if not gather_run and stages != STAGES:
        raise ValueError(f"dq_call: stages={stages} needs a gathering producer (gather_run)")
    if mode == "none" and step_pairs:
        mode = "cond"          # an odd count's last stage masks its second half
    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    U = units.shape[0]
    dtype = q.dtype
    rings = 2 if paired else 1
    slots = rings * stages
    stage_kv = 2 * tile_kv if step_pairs else tile_kv
    static = dict(tile_q=tile_q, tile_kv=tile_kv, step_pairs=step_pairs, gather_run=gather_run,
                  stages=stages, paired=paired, wg_skip=wg_skip, mode=mode, num_units=U,
                  num_steps=steps.shape[0], group=Hq // Hkv, head_dim=D, dtype=dtype,
                  qk_scale=float(scale) * LOG2E, scale=float(scale), interpret=interpret)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, units_ref, steps_ref, words_ref,
              dq_ref):
        def scoped(bufs, in_bars, kv_bars, consumed):
            c = _Dq(q=q_ref, k=k_ref, v=v_ref, do=do_ref, lse=lse_ref, delta=delta_ref,
                    units=units_ref, steps=steps_ref, words=words_ref, dq=dq_ref,
                    q_smem=bufs[0], do_smem=bufs[1], lse_smem=bufs[2], delta_smem=bufs[3],
                    k_smem=bufs[4], v_smem=bufs[5], in_bars=in_bars, k_bar=kv_bars[0],
                    v_bar=kv_bars[1], k_consumed=consumed[0], v_consumed=consumed[1],
                    direct=direct, rows_smem=bufs[6] if direct else None, **static)
            _warpgroups(c, _dq_consumer, _dq_producer)

        pl.run_scoped(
            scoped,
            (plgpu.SMEM((CONSUMERS, WG_ROWS, D), dtype, transforms=tr),
             plgpu.SMEM((CONSUMERS, WG_ROWS, D), dtype, transforms=tr),
             plgpu.SMEM((CONSUMERS, WG_ROWS), jnp.float32),
             plgpu.SMEM((CONSUMERS, WG_ROWS), jnp.float32),
             plgpu.SMEM((slots, stage_kv, D), dtype, transforms=tr),
             plgpu.SMEM((slots, stage_kv, D), dtype, transforms=tr),
             *((plgpu.SMEM((CONSUMERS, WG_ROWS, D), dtype),) if direct else ())),
            (plgpu.Barrier(num_barriers=CONSUMERS),) * 4,
            # A gathering producer arrives once per copy (step pairs: one per step).
            (plgpu.Barrier(num_arrivals=(tile_kv // gather_run if gather_run
                                         else 2 if step_pairs else 1), num_barriers=slots),) * 2,
            # A slot is free once every warpgroup reading it is done with it.
            (plgpu.Barrier(num_arrivals=1 if paired else CONSUMERS, num_barriers=slots),) * 2,
            collective_axes="wg",
        )

    kwargs = {"interpret": interpret} if interpret else {}
    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct(q.shape if direct else (B, U, tile_q, D), dtype),
        grid=(-(-U // 2) if paired else U, B), grid_names=("unit", "batch"),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), **kwargs,
    )(q, k, v, do, lse_u, delta_u, units, steps, steps.reshape(-1))


# --- dk, dv ----------------------------------------------------------------------------------
_Dkv = NamedTuple("_Dkv", [
    ("tile_q", int),
    ("gather_run", int),  # queries a copy of a gathered stage loads (0: steps are runs)
    ("dk", Any),
    ("dv", Any),
    ("k_smem", Any),  # [CONSUMERS, 64, D]: K in, dK out
    ("v_smem", Any),  # [CONSUMERS, 64, D]: V in, dV out
    ("q_smem", Any),  # [STAGES, 64, D] ring
    ("do_smem", Any),
    ("lse_smem", Any),  # [STAGES, 64]
    ("delta_smem", Any),
    ("kv_bars", Any),  # per consumer warpgroup: its K, V arrived
    ("ring_bars", Any),  # per slot: Q, dO, lse, delta arrived
    ("consumed", Any),  # per slot: both warpgroups are done with it
] + _SHARED_FIELDS)


def _dkv_consumer(c: _Dkv, wg):
    plgpu.set_max_registers(232, action="increase")
    tile_q, tile_kv = c.tile_q, DKV_TILES[1]
    ring = wg if c.paired else 0
    row0 = 0 if c.paired else pl.multiple_of(wg * WG_ROWS, WG_ROWS)
    u, b, head, k_start, ptr, cnt, valid = _unit(c, ring)
    kv_head = lax.div(head, jnp.array(c.group, head.dtype))
    rows = pl.ds(pl.multiple_of(k_start + row0, ALIGN), WG_ROWS)
    k_smem, v_smem = c.k_smem.at[wg], c.v_smem.at[wg]
    plgpu.copy_gmem_to_smem(c.k.at[b, rows, kv_head], k_smem, c.kv_bars[0].at[wg])
    plgpu.copy_gmem_to_smem(c.v.at[b, rows, kv_head], v_smem, c.kv_bars[1].at[wg])
    plgpu.barrier_wait(c.kv_bars[0].at[wg])
    plgpu.barrier_wait(c.kv_bars[1].at[wg])
    shape = (WG_ROWS, tile_kv)

    def step(i, carry):
        slot = _slot(i, ring)
        s_row = jnp.minimum(ptr + i, c.num_steps - 1)
        for bar in c.ring_bars:
            plgpu.barrier_wait(bar.at[slot])

        def compute(carry):
            dk, dv = carry
            q_s, do_s = c.q_smem.at[slot], c.do_smem.at[slot]
            st = _mma(k_smem, q_s, shape)                           # S^T [keys, queries]
            st = masked_step(c.steps, c.words, s_row, row0, tile_q, tile_kv, c.mode, st,
                         gather=c.gather_run > 0)
            lse2 = plgpu.load(c.lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            pt = jnp.exp2(st * c.qk_scale - bcast(lse2, shape, 1))
            dpt = _mma(v_smem, do_s, shape)
            dv = _mma_acc(dv, pt.astype(c.dtype), do_s, c.interpret)
            delta = plgpu.load(c.delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            dst = pt * (dpt - bcast(delta, shape, 1))
            dk = _mma_acc(dk, dst.astype(c.dtype), q_s, c.interpret)
            plgpu.barrier_arrive(c.consumed.at[slot])
            return dk, dv

        def skip(carry):
            plgpu.barrier_arrive(c.consumed.at[slot])
            return carry

        return _skipping(c, s_row, row0, compute, skip, carry)

    zeros = plgpu.layout_cast(jnp.full((WG_ROWS, c.head_dim), 0, jnp.float32),
                              plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, cnt, step, (zeros, zeros))
    k_smem[...] = (dk * c.scale).astype(c.dtype)           # K, V are read no more
    v_smem[...] = dv.astype(c.dtype)
    plgpu.commit_smem()
    out_rows = pl.ds(row0, WG_ROWS)

    def store():
        plgpu.copy_smem_to_gmem(k_smem, c.dk.at[b, u, out_rows], commit_group=False)
        plgpu.copy_smem_to_gmem(v_smem, c.dv.at[b, u, out_rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    _if_valid(c, valid, store)


def _dkv_producer(c: _Dkv):
    if c.gather_run:
        _dkv_gather_producer(c)
        return

    def load(slot, i, b, head, q_start):
        cols = pl.ds(q_start, DKV_TILES[1])

        @pl.when(i >= STAGES)
        def _():
            plgpu.barrier_wait(c.consumed.at[slot])

        for src, dst, bar in ((c.q.at[b, cols, head], c.q_smem, c.ring_bars[0]),
                              (c.do.at[b, cols, head], c.do_smem, c.ring_bars[1]),
                              (c.lse.at[b, head, cols], c.lse_smem, c.ring_bars[2]),
                              (c.delta.at[b, head, cols], c.delta_smem, c.ring_bars[3])):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])

    _produce(c, load, lambda slot: plgpu.barrier_wait(c.consumed.at[slot]))


def _dkv_gather_producer(c: _Dkv):
    """The dk/dv producer of a gathering plan (units of keys, steps of gathered queries): each
    ring's unit's Q, dO, lse and delta stages by runs of ``gather_run`` queries
    (``common.load_gathered``; one slot-free wait for the four; ``_gather_produce``)."""
    def load(b, head, starts, slot, wait):
        views = rows_of((c.q, c.do), b, head) + rows_of((c.lse, c.delta), b, head,
                                                         token_major=False)
        load_gathered(views, (c.q_smem, c.do_smem, c.lse_smem, c.delta_smem), c.ring_bars,
                      (c.consumed, None, None, None), starts, c.gather_run, slot, wait)

    _gather_produce(c, DKV_TILES[1], STAGES, load,
                    lambda slot: plgpu.barrier_wait(c.consumed.at[slot]))


def dkv_call(q, k, v, do, lse2, delta, units, steps, *, tile_q, mode, scale, interpret,
             gather_run: int = 0, wg_skip: bool = False):
    """(dK, dV) per unit [B, U, tile_q, D] over the dk/dv plan; ``gather_run``: queries a copy
    loads on gathered steps (0: a plan without them, one copy a stage); ``wg_skip``: a
    warpgroup skips the steps whose rectangle misses its 64 keys (128-key units)."""
    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    U = units.shape[0]
    dtype = q.dtype
    tile_kv = DKV_TILES[1]
    paired = tile_q == WG_ROWS
    slots = (2 if paired else 1) * STAGES
    static = dict(tile_q=tile_q, gather_run=gather_run, paired=paired,
                  wg_skip=wg_skip and not paired, num_units=U, mode=mode,
                  num_steps=steps.shape[0], group=Hq // Hkv, head_dim=D, dtype=dtype,
                  qk_scale=float(scale) * LOG2E, scale=float(scale), interpret=interpret)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, units_ref, steps_ref, words_ref,
              dk_ref, dv_ref):
        def scoped(bufs, kv_bars, ring_bars, consumed):
            c = _Dkv(q=q_ref, k=k_ref, v=v_ref, do=do_ref, lse=lse_ref, delta=delta_ref,
                     units=units_ref, steps=steps_ref, words=words_ref, dk=dk_ref, dv=dv_ref,
                     k_smem=bufs[0], v_smem=bufs[1], q_smem=bufs[2], do_smem=bufs[3],
                     lse_smem=bufs[4], delta_smem=bufs[5], kv_bars=kv_bars,
                     ring_bars=ring_bars, consumed=consumed, **static)
            _warpgroups(c, _dkv_consumer, _dkv_producer)

        pl.run_scoped(
            scoped,
            (plgpu.SMEM((CONSUMERS, WG_ROWS, D), dtype, transforms=tr),
             plgpu.SMEM((CONSUMERS, WG_ROWS, D), dtype, transforms=tr),
             plgpu.SMEM((slots, tile_kv, D), dtype, transforms=tr),
             plgpu.SMEM((slots, tile_kv, D), dtype, transforms=tr),
             plgpu.SMEM((slots, tile_kv), jnp.float32),
             plgpu.SMEM((slots, tile_kv), jnp.float32)),
            (plgpu.Barrier(num_barriers=CONSUMERS),) * 2,
            # A gathering producer arrives once per copy.
            (plgpu.Barrier(num_arrivals=tile_kv // gather_run if gather_run else 1,
                           num_barriers=slots),) * 4,
            # A slot is free once every warpgroup reading it is done with it.
            plgpu.Barrier(num_arrivals=1 if paired else CONSUMERS, num_barriers=slots),
            collective_axes="wg",
        )

    out = jax.ShapeDtypeStruct((B, U, tile_q, D), dtype)
    kwargs = {"interpret": interpret} if interpret else {}
    return plgpu.kernel(
        entry, out_type=(out, out), grid=(-(-U // 2) if paired else U, B),
        grid_names=("unit", "batch"),
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), **kwargs,
    )(q, k, v, do, lse2, delta, units, steps, steps.reshape(-1))
