"""Float32 sums of x over static token blocks as one Mosaic GPU kernel (Hopper): the
replacement of ``pallas_kernels.triton.pool`` on Hopper's path. Each CTA (one warpgroup) reads
one block's rows of one 256-column (or 128-column) chunk once, by one TMA copy of exactly the
block's rows (its size class picks the copy's static box), straight from x's 2-byte dtype,
sums them row by row from shared memory in float32 (2 columns a thread, or 1) and writes the
sums. Any static bounds (no alignment: shared memory is not tiled), as the Triton kernel's.

XLA's version (``masks.dynamic.common._pool_sum_xla``) pads a float32 copy of x, gathers the
blocks into equal rows and sums them (H200 session 14, q and k at Wan 720p: 1.67 ms against
the Triton kernel's 0.63, one read being ~0.35).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = ["block_sums", "supports", "MAX_BLOCK", "MAX_CLASSES"]

#: Longest block the kernel takes (a block's rows live in shared memory).
MAX_BLOCK = 256
#: Most distinct block sizes (one TMA box, one branch of the copy's switch, each).
MAX_CLASSES = 16
#: Columns a CTA sums (a TMA box's row: at most 256 elements), 2 per thread (128 columns, 1 per
#: thread, where H * F is not a multiple of 256); rows summed per loop step.
_CHUNK, _UNROLL = 256, 4
_LANES = 128


def supports(shape, dtype, bounds) -> bool:
    """Whether the kernel takes x of this [B, L, H, F] shape and dtype over these static
    bounds: 2-byte floats, H * F a multiple of 128, blocks of at most ``MAX_BLOCK`` tokens in
    at most ``MAX_CLASSES`` distinct sizes (else the caller's XLA pooling serves)."""
    b = np.asarray(bounds)
    if len(shape) != 4 or b.ndim != 1 or len(b) < 2:
        return False
    sizes = np.diff(b)
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and (shape[2] * shape[3]) % _LANES == 0 and sizes.min() > 0
            and sizes.max() <= MAX_BLOCK and len(set(sizes.tolist())) <= MAX_CLASSES)


def block_sums(x, bounds, *, interpret: bool = False):
    """float32 [B, n, H, F]: the sum of x [B, L, H, F] over each block [bounds[j],
    bounds[j + 1]) (``bounds`` static NumPy ints increasing from 0 to L; blocks of at most
    ``MAX_BLOCK`` tokens in at most ``MAX_CLASSES`` sizes; x bf16 or f16, H * F a multiple of
    128). ``interpret``: the Mosaic GPU interpreter (CPU tests)."""
    bounds = np.asarray(bounds)
    if x.ndim != 4:
        raise ValueError(f"block_sums: x must be [B, L, H, F], got {x.shape}")
    if bounds.ndim != 1 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != x.shape[1] or \
            (np.diff(bounds) <= 0).any():
        raise ValueError(f"block_sums: bounds must increase strictly from 0 to {x.shape[1]}")
    if not supports(x.shape, x.dtype, bounds):
        raise ValueError(f"block_sums: the Mosaic kernel takes bf16 / f16 x with H * F a "
                         f"multiple of {_LANES} and blocks of at most {MAX_BLOCK} tokens in "
                         f"at most {MAX_CLASSES} sizes; got {x.dtype} {x.shape}, "
                         f"{len(set(np.diff(bounds).tolist()))} sizes up to "
                         f"{np.diff(bounds).max()}")
    return _block_sums(x, tuple(int(v) for v in bounds), interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("bounds", "interpret"))
def _block_sums(x, bounds, *, interpret):
    B, L, H, F = x.shape
    b = np.asarray(bounds, np.int64)
    sizes = np.diff(b)
    n, cols = len(sizes), H * F
    # The size classes present: one static TMA box each, picked per block by a switch.
    classes = sorted(set(int(s) for s in sizes))
    cls = np.searchsorted(classes, sizes).astype(np.int32)
    chunk = _CHUNK if cols % _CHUNK == 0 else _LANES
    layout = plgpu.Layout.WG_STRIDED((chunk,), vec_size=chunk // _LANES)

    def tessera_block_sums_mgpu(x_ref, start_ref, size_ref, cls_ref, o_ref):
        c, j, bb = lax.axis_index("c"), lax.axis_index("j"), lax.axis_index("b")
        start, size = start_ref[j], size_ref[j]
        col0 = c * chunk

        def scoped(x_smem, o_smem, bar):
            def copy(r):
                plgpu.copy_gmem_to_smem(x_ref.at[bb, pl.ds(start, r), pl.ds(col0, chunk)],
                                        x_smem.at[pl.ds(0, r)], bar.at[0])

            lax.switch(cls_ref[j], [functools.partial(copy, r) for r in classes])
            plgpu.barrier_wait(bar.at[0])

            def load(r):
                return plgpu.load(x_smem.at[r], layout=layout).astype(jnp.float32)

            def rows(i, acc):                  # _UNROLL independent loads: latency overlaps
                part = [load(i * _UNROLL + u) for u in range(_UNROLL)]
                return acc + functools.reduce(lambda a, b: a + b, part)

            zero = plgpu.layout_cast(jnp.zeros((chunk,), jnp.float32), layout)
            full = lax.div(size, _UNROLL)
            acc = lax.fori_loop(0, full, rows, zero)
            o_smem[...] = lax.fori_loop(full * _UNROLL, size, lambda r, a: a + load(r), acc)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bb, j, pl.ds(col0, chunk)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((max(classes), chunk), x.dtype),
                      plgpu.SMEM((chunk,), jnp.float32), plgpu.Barrier(num_barriers=1))

    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    # Column chunks vary fastest: neighbouring CTAs read neighbouring parts of the same rows.
    out = plgpu.kernel(tessera_block_sums_mgpu,
                       out_type=jax.ShapeDtypeStruct((B, n, cols), jnp.float32),
                       grid=(cols // chunk, n, B), grid_names=("c", "j", "b"), **kwargs)(
        x.reshape(B, L, cols), jnp.asarray(b[:-1].astype(np.int32)),
        jnp.asarray(sizes.astype(np.int32)), jnp.asarray(cls))
    return out.reshape(B, n, H, F)
