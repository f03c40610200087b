"""k-means' assignment step as one Mosaic GPU kernel (Hopper): the replacement of
``pallas_kernels.triton.kmeans`` on Hopper's path, the argmin kept in registers so the [L, C]
distance matrix never reaches memory (XLA's matmul + argmin writes and reads it back).

One CTA per 128 points of one head: two consumer warpgroups of 64 points each (their tile
copied once by TMA) and a producer warpgroup streaming the head's centroids, ``tile`` at a
time, through a two-slot shared-memory ring. Per centroid tile a consumer runs one wgmma
(x . c in float32), forms |c|^2 - 2 x.c, and keeps each point's running minimum and its first
index (ties to the lower index, a later tile winning only when strictly nearer: ``jnp.argmin``'s
rule). The last points tile of a length that is not a multiple of 128 starts earlier and
overlaps its neighbour (same labels written twice).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = ["assign", "supports", "MAX_FEATURES"]

#: Points per consumer warpgroup (one wgmma fragment's rows) and consumers per CTA.
ROWS, CONSUMERS = 64, 2
#: Centroid ring slots.
STAGES = 2
#: Feature widths the kernel takes: multiples of 64 (128-byte swizzled rows) up to this (the
#: points tiles and the ring in shared memory: 193 KB at 256).
MAX_FEATURES = 256
_ALIGN, _COLS = 8, 64
_NO_INDEX = 2 ** 30


def supports(x_shape, x_dtype) -> bool:
    """Whether the kernel takes points of this [H, L, F] shape and dtype: 2-byte floats (the
    matmul's dtype; float32 points need HIGHEST precision, which wgmma lacks) and F a multiple
    of 64 up to ``MAX_FEATURES``."""
    if len(x_shape) != 3:
        return False
    F = x_shape[2]
    return (jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and 0 < F <= MAX_FEATURES and F % _COLS == 0)


def assign(x, c, *, interpret: bool = False):
    """Nearest centroid of each point, per head: x [H, L, F] (bf16 or f16: the matmul's dtype),
    c [H, C, F] float32 -> int32 [H, L], as ``masks.dynamic._assign`` computes it: centroids
    cast to x's dtype, |c|^2 in float32 minus 2 x.c with float32 accumulation, ties to the
    lower index (labels equal up to float rounding of near ties). ``interpret``: the Mosaic
    GPU interpreter (CPU tests)."""
    if x.ndim != 3 or c.ndim != 3 or x.shape[0] != c.shape[0] or x.shape[2] != c.shape[2]:
        raise ValueError(f"assign: x must be [H, L, F] and c [H, C, F], got {x.shape}, {c.shape}")
    if not supports(x.shape, x.dtype):
        raise ValueError(f"assign: the Mosaic kernel takes bf16 / f16 points with F a multiple "
                         f"of {_COLS} up to {MAX_FEATURES}, got {x.dtype} {x.shape}")
    if 0 in x.shape or c.shape[1] == 0:
        raise ValueError(f"assign: empty points or centroids: {x.shape}, {c.shape}")
    return _assign(x, c, interpret=bool(interpret))


def _tile(C: int) -> int:
    """Centroids per wgmma: 128, or 64 when that pads C less."""
    return 64 if -(-C // 64) * 64 < -(-C // 128) * 128 else 128


@functools.partial(jax.jit, static_argnames=("interpret",))
def _assign(x, c, *, interpret):
    H, L, F = x.shape
    C = c.shape[1]
    tc = _tile(C)
    Cp = -(-C // tc) * tc
    cx = c.astype(x.dtype)
    cn = jnp.sum(jnp.square(cx.astype(jnp.float32)), axis=-1)
    cp = jnp.pad(cx, ((0, 0), (0, Cp - C), (0, 0)))
    cnp = jnp.pad(cn, ((0, 0), (0, Cp - C)), constant_values=jnp.inf)   # never the nearest
    Lp = L
    if L < ROWS or L % _ALIGN:              # TMA rows: a multiple of 8, one full tile
        Lp = max(ROWS, -(-L // _ALIGN) * _ALIGN)
        x = jnp.pad(x, ((0, 0), (0, Lp - L), (0, 0)))
    out = _call(x, cp, cnp, tc, interpret)
    return out[:, :L]


def _call(x, cp, cnp, tc: int, interpret: bool):
    H, L, F = x.shape
    n_tiles = cp.shape[1] // tc
    smem_tiles = (plgpu.TilingTransform((_ALIGN, _COLS)), plgpu.SwizzleTransform(128))
    rows_layout, cols_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def consumer(x_ref, cn_ref, o_ref, x_smem, c_smem, o_smem, x_bar, c_bar, consumed, wg):
        i, h = lax.axis_index("i"), lax.axis_index("h")
        start = pl.multiple_of(jnp.minimum(i * (CONSUMERS * ROWS) + wg * ROWS, L - ROWS),
                               _ALIGN)
        plgpu.copy_gmem_to_smem(x_ref.at[h, pl.ds(start, ROWS)], x_smem.at[wg], x_bar.at[wg])
        plgpu.barrier_wait(x_bar.at[wg])

        def step(j, carry):
            best, arg = carry
            slot = lax.rem(j, STAGES)
            plgpu.barrier_wait(c_bar.at[slot])

            def dots(acc_ref):
                plgpu.wgmma(acc_ref, x_smem.at[wg], c_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            acc = pl.run_scoped(dots, plgpu.ACC((ROWS, tc), jnp.float32))
            plgpu.barrier_arrive(consumed.at[slot])
            cn = plgpu.load(cn_ref.at[h, pl.ds(j * tc, tc)], layout=cols_layout,
                            optimized=False)
            d = _cols(cn, (ROWS, tc)) - 2.0 * acc
            m = d.min(axis=1)
            col = plgpu.broadcasted_iota(jnp.int32, (tc,), 0, layout=cols_layout) + j * tc
            a = jnp.where(d == lax.broadcast_in_dim(m, (ROWS, tc), [0]),
                          _cols(col, (ROWS, tc)), _NO_INDEX).min(axis=1)
            nearer = m < best
            return jnp.where(nearer, m, best), jnp.where(nearer, a, arg)

        best = plgpu.layout_cast(jnp.full((ROWS,), jnp.inf, jnp.float32), rows_layout)
        arg = plgpu.layout_cast(jnp.full((ROWS,), 0, jnp.int32), rows_layout)
        _, arg = lax.fori_loop(0, n_tiles, step, (best, arg))
        o_smem.at[wg][...] = arg
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[h, pl.ds(start, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    def producer(c_ref, c_smem, c_bar, consumed):
        h = lax.axis_index("h")

        @pl.loop(0, n_tiles)
        def _(j):
            slot = lax.rem(j, STAGES)

            @pl.when(j >= STAGES)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            plgpu.copy_gmem_to_smem(c_ref.at[h, pl.ds(j * tc, tc)], c_smem.at[slot],
                                    c_bar.at[slot])

        # Every phase waited for before the barriers go (the interpreter checks it).
        @pl.loop(jnp.maximum(n_tiles - STAGES, 0), n_tiles)
        def _(j):
            plgpu.barrier_wait(consumed.at[lax.rem(j, STAGES)])

    def tessera_kmeans_assign_mgpu(x_ref, c_ref, cn_ref, o_ref):
        def scoped(x_smem, c_smem, o_smem, x_bar, c_bar, consumed):
            wg = lax.axis_index("wg")
            pl.when(wg < CONSUMERS)(functools.partial(
                consumer, x_ref, cn_ref, o_ref, x_smem, c_smem, o_smem, x_bar, c_bar,
                consumed, wg))
            pl.when(wg == CONSUMERS)(functools.partial(producer, c_ref, c_smem, c_bar,
                                                       consumed))

        pl.run_scoped(scoped,
                      plgpu.SMEM((CONSUMERS, ROWS, F), x.dtype, transforms=smem_tiles),
                      plgpu.SMEM((STAGES, tc, F), x.dtype, transforms=smem_tiles),
                      plgpu.SMEM((CONSUMERS, ROWS), jnp.int32),
                      plgpu.Barrier(num_barriers=CONSUMERS),
                      plgpu.Barrier(num_barriers=STAGES),
                      # A slot is free once both consumers are done with it.
                      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),
                      collective_axes="wg")

    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    return plgpu.kernel(tessera_kmeans_assign_mgpu,
                        out_type=jax.ShapeDtypeStruct((H, L), jnp.int32),
                        grid=(pl.cdiv(L, CONSUMERS * ROWS), H), grid_names=("i", "h"),
                        num_threads=CONSUMERS + 1, thread_name="wg", **kwargs)(x, cp, cnp)


def _cols(vec, shape):
    """A column vector (one value per centroid) broadcast over a [rows, cols] fragment."""
    return plgpu.layout_cast(lax.broadcast_in_dim(vec, shape, [1]), plgpu.Layout.WGMMA)
