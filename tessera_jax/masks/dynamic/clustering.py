"""Fixed-iteration k-means batched over heads (SVG2's clustering), its assignment by XLA or by
one GPU kernel (``pallas_kernels.mosaic.kmeans`` on Hopper, ``pallas_kernels.triton.kmeans``
on Ampere/Ada)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera_jax.masks.dynamic import common as c


def _assign(x, c):
    """Nearest centroid of each point (squared Euclidean, ties to the lower index): x [L, F]
    (its dtype sets the matmul's), c float32 [C, F] -> int32 [L]."""
    cx = c.astype(x.dtype)
    cn = jnp.sum(jnp.square(cx.astype(jnp.float32)), axis=-1)
    dots = jnp.einsum("lf,cf->lc", x, cx, preferred_element_type=jnp.float32)
    return jnp.argmin(cn[None, :] - 2.0 * dots, axis=-1).astype(jnp.int32)


def _update(x, labels, c):
    """Centroids as the means of their points; an empty cluster keeps its centroid.
    x [H, L, F], labels int32 [H, L], c float32 [H, C, F]. The sums are a ``segment_sum``
    (scatter-add); one-hot matmuls per head instead were slower on the H200 and removed
    (session 12, Wan 720p SVG2 ``iters=1`` builder: 26.05 ms against 14.90 ms)."""
    C = c.shape[1]
    seg = jax.vmap(lambda v, lh: jax.ops.segment_sum(v, lh, num_segments=C))
    sums = seg(x.astype(jnp.float32), labels)
    counts = seg(jnp.ones(labels.shape, jnp.float32), labels)
    return jnp.where(counts[..., None] > 0, sums / jnp.maximum(counts, 1.0)[..., None], c)


def _kernels(x):
    """The assignment kernels by family (``common.kernel_or_xla``), None where one does not
    take points of x's shape and dtype (the Mosaic GPU kernel: 2-byte points, F a multiple of
    64). Labels are piecewise constant (zero derivative); the kernels have no autodiff rule, so
    their inputs leave the trace of gradients (as the XLA argmin's do implicitly)."""
    from pallas_kernels.triton import kmeans as tk
    mk = c.mosaic_module("kmeans")
    sg = jax.lax.stop_gradient

    def run(mod):
        return lambda x, cent, interpret: mod.assign(sg(x), sg(cent), interpret=interpret)

    return {"triton": run(tk),
            "mosaic": run(mk) if mk and mk.supports(x.shape, x.dtype) else None}


def kmeans(x, centroids, *, iters: int, assign: str = "auto"):
    """Fixed-iteration k-means (squared Euclidean), batched over heads.

    Each iteration assigns every point to its nearest centroid (ties: the lower index) and
    moves each centroid to the mean of its points (an empty cluster keeps its centroid), as
    SVG2's ``batch_kmeans_Euclid`` without the host-side convergence test.

    Args:
      x: [H, L, F] points (any float dtype: the distance matmul runs in it, float32 sums).
      centroids: float32 [H, C, F], the warm start.
      iters: static int >= 0.
      assign: how points are assigned (``common.KERNEL_CHOICES``): "mosaic"
        (``pallas_kernels.mosaic.kmeans.assign``: one Mosaic GPU kernel, wgmma and the argmin
        in registers; 2-byte points with F a multiple of 64, else XLA), "triton" (or
        "pallas": ``pallas_kernels.triton.kmeans.assign``, the same in one Triton kernel),
        "xla" (a matmul, then an argmin over the [L, C] distances, which go to memory and
        back: ~24 GB a call at SVG2's Wan 720p key side) or "auto" (the default: on a GPU the
        Mosaic kernel, the Triton one before Hopper). Same labels up to float rounding of near
        ties. H200, session 12 (Wan 720p SVG2 ``iters=1``, 40 heads, L = 75,600, one call):
        builder 9.27 ms with the Triton kernel against 15.17 ms with XLA.
    Returns:
      (labels int32 [H, L]: the last iteration's assignment, centroids float32 [H, C, F]: the
      means of those clusters). ``iters == 0``: the assignment to ``centroids``, unchanged.
    """
    fn = "kmeans"
    c.check_array(fn, "x", x, 3, "[H, L, F]")
    c.check_array(fn, "centroids", centroids, 3, "[H, C, F]")
    if centroids.shape[0] != x.shape[0] or centroids.shape[2] != x.shape[2]:
        raise ValueError(f"{fn}: centroids {tuple(centroids.shape)} do not match x "
                         f"{tuple(x.shape)}: expected [{x.shape[0]}, C, {x.shape[2]}]")
    iters = c.check_int(fn, "iters", iters, 0)
    c.check_choice(fn, "assign", assign, c.KERNEL_CHOICES)
    cent = centroids.astype(jnp.float32)

    def labels(x, cent):
        return c.kernel_or_xla(assign, _kernels(x), jax.vmap(_assign), x, cent)

    if iters == 0:
        return labels(x, cent), cent

    def body(_, carry):
        cent, _ = carry
        lab = labels(x, cent)
        return _update(x, lab, cent), lab

    carry = (cent, jnp.zeros(x.shape[:2], jnp.int32))
    if iters <= 4:                  # the per-step warm starts: unrolled, no device loop
        for i in range(iters):
            carry = body(i, carry)
        cent, lab = carry
    else:
        cent, lab = jax.lax.fori_loop(0, iters, body, carry)
    return lab, cent
