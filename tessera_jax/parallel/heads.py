"""Head-parallel sparse attention: q, k, v sharded over heads, each device runs its own heads'
masks (``local.local_attention``); no communication."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from tessera_jax.mask import BlockMask
from tessera_jax.parallel import specs as _specs
from tessera_jax.parallel.local import local_attention
from tessera_jax.validation import check_mask, check_qkv

__all__ = ["HeadParallelAttention", "head_parallel_attention"]


def head_parallel_attention(q, k, v, mask: BlockMask, *, axis_name="heads", mesh=None,
                            scale=None, return_lse: bool = False, backend: str | None = None,
                            template: str | None = None):
    """``sparse_attention`` with q [B, Lq, Hq, D], k, v [B, Lkv, Hkv, D] split over heads.

    Global arrays in and out (under ``jax.jit``, with inputs sharded over heads by
    ``NamedSharding(mesh, P(None, None, axis_name, None))`` nothing moves; other inputs are
    resharded). Device d holds query heads [d * Hl, (d + 1) * Hl) and their K/V heads (GQA
    groups stay whole: Hkv must split evenly too). A static per-head mask is planned per device
    on the host; a device mask's per-head arrays are sharded with the heads. ``mesh``: None
    takes the mesh of ``jax.set_mesh``. Output (and lse [B, Hq, Lq]) sharded over heads; on a
    mesh with explicit axes, resharded as q is (unchanged when q is head-sharded).
    """
    shape = check_qkv(q, k, v)
    check_mask(mask, shape)
    n = _specs.split_heads(shape, mesh, axis_name, "head parallelism")
    hs = P(None, None, axis_name, None)
    ops, op_specs, rebuild = _specs.mask_operands(mask, axis_name)

    def body(q, k, v, *ops):
        return local_attention(q, k, v, rebuild(*ops), axis_name=axis_name, scale=scale,
                               return_lse=return_lse, backend=backend, template=template)

    args = tuple(_specs.fit(x, mesh, hs) for x in (q, k, v))
    args += tuple(_specs.fit(x, mesh, s) for x, s in zip(ops, op_specs))
    out_specs = (hs, P(None, axis_name, None)) if return_lse else hs
    res = jax.shard_map(body, mesh=mesh, in_specs=(hs,) * 3 + op_specs, out_specs=out_specs,
                        check_vma=False)(*args)
    if not return_lse:
        return _specs.like(res, q, mesh)
    return _specs.like(res[0], q, mesh), _specs.like(res[1], q, mesh, (0, 2, 1))


@dataclasses.dataclass(frozen=True)
class HeadParallelAttention:
    """A hashable ``sparse_fn`` for ``tessera_jax.flax.AttentionOptions``: every sparse call of a
    model runs ``head_parallel_attention`` on ``mesh`` / ``axis_name``."""

    mesh: jax.sharding.Mesh | None = None
    axis_name: str = "heads"
    backend: str | None = None
    template: str | None = None

    def __call__(self, q, k, v, mask, scale=None):
        return head_parallel_attention(q, k, v, mask, axis_name=self.axis_name, mesh=self.mesh,
                                       scale=scale, backend=self.backend, template=self.template)
