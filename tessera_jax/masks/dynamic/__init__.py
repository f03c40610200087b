"""Content-dependent block masks built on the device, inside ``jax.jit`` (issue 17, item 1).

Four builders, each a pure-jnp function of the layer's ``q`` and ``k`` ([B, L, H, D]; GQA:
``Hq % Hkv == 0``, each key head repeated over its query group when scores are pooled) and of
its *rule*, a frozen (hashable) dataclass holding every knob of the builder, with static
shapes and no host round trip: each returns what ``tessera_jax.sparse_attention`` needs,
traced values that a compiled denoising loop can build per step and layer without retracing.

* ``vsa_mask(q, k, VSA(...))`` (``vsa``): VSA-like. Mean-pool q and k over static blocks
  (4x4x4 cubes in cube-major order: ``cube_layout``), per-head top-k key blocks of the pooled
  scores per query block.
* ``sparge_mask(q, k, Sparge(...))`` (``sparge``): SpargeAttn-like. Mean-pool over 128-query x
  64-key blocks, softmax of the pooled scores, keep key blocks while the cumulative probability
  stays <= ``cdf_threshold``; blocks that are not self-similar keep their whole row / column.
* ``xattn_mask(q, k, XAttention(...))`` (``xattn``): XAttention-like. Strided antidiagonal
  scores (stride 8) summed per 128-token block, keep the fewest blocks reaching ``tau`` of the
  row's mass.
* ``svg2_init`` / ``svg2_mask`` / ``svg2_attention`` with ``SVG2(...)`` (``svg2``, k-means in
  ``clustering``): SVG2-like. Per-head k-means of q and of k (fixed iteration count, warm-started
  from carried centroids), tokens permuted so that clusters are contiguous (per head), per-head
  bounds from the cluster sizes, cluster pairs kept by size-weighted softmax mass up to
  ``top_p``; ``permute`` / ``unpermute`` move tensors in and out of the cluster order.

A rule is also the form a ``tessera_jax.flax.DynamicSchedule`` takes: ``rule(q, k, v, state,
*, scale, attend)`` builds the mask, runs the attention it is given and returns the state to
carry to the next step (SVG2's centroids), so a compiled denoising loop calls it at every step
and layer. Every option that changes the compiled computation is a rule field, so part of
jit's cache key: e.g. ``VSA(top_k="xla", pool="xla", score_precision="highest")``. The kernel
options ("auto" by default) pick a kernel when the computation is compiled for a GPU and XLA's
ops elsewhere, by the platform of the compilation (``lax.platform_dependent``), not the
process's default backend: the Mosaic GPU kernel (Hopper), or the Triton one where the
process's GPU predates Hopper (``common.KERNEL_CHOICES``: "mosaic" and "triton" name one).

Batch: ``BlockMask`` has no batch axis, so the B elements of a call share one mask; every
rule is applied to the batch mean of its score (SpargeAttn's self-similarity: the batch
minimum; SVG2: k-means on the tokens' features concatenated over the batch). Call a builder
per element for per-element masks.

Rule fields are checked when the rule is made and shape-dependent limits when tracing, raising
``ValueError``/``TypeError`` naming the field or argument; the data cannot be checked inside
``jit``, but no data (NaN included) makes a builder read out of bounds or emit invalid bounds:
every gather is clamped and every index is built in range. ``docs/dynamic_masks.md`` has the
knobs, the per-call cost at Wan 720p and the use in a compiled loop; NumPy references of the
rules are in ``tests/dynamic_oracles.py``.
"""

from tessera_jax.masks.dynamic.common import KERNEL_CHOICES, SCORE_PRECISIONS
from tessera_jax.masks.dynamic.clustering import kmeans
from tessera_jax.masks.dynamic.sparge import Sparge, sparge_mask
from tessera_jax.masks.dynamic.svg2 import (KV_ORDERS, SVG2, SVG2Carry, SVG2Layout, SVG2State,
                                            permute, svg2_attention, svg2_init, svg2_mask,
                                            unpermute)
from tessera_jax.masks.dynamic.vsa import VSA, cube_layout, vsa_mask
from tessera_jax.masks.dynamic.xattn import XAttention, xattn_mask

__all__ = ["cube_layout", "vsa_mask", "sparge_mask", "xattn_mask", "SVG2State", "SVG2Layout",
           "kmeans", "svg2_init", "svg2_mask", "svg2_attention", "permute", "unpermute",
           "VSA", "Sparge", "XAttention", "SVG2", "SVG2Carry", "KERNEL_CHOICES",
           "SCORE_PRECISIONS", "KV_ORDERS"]
