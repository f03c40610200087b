"""Ulysses sequence parallelism for sparse attention: sequence shards -> head shards by one
all-to-all, each device's heads' sparse attention over the whole sequence, and back.

The head order of the all-to-all is an assignment (``assign.assign_heads``): device d receives
the query heads ``heads[d]`` (and their K/V heads), so heads of unequal cost can be spread
evenly at no extra communication: each device permutes its sequence shard's heads locally
before the all-to-all and un-permutes after the one back.

Building blocks for a shard_map body (``seq_to_heads``, ``heads_to_seq``, ``lse_to_seq``,
``gather_head_costs``), the global-array wrapper ``ulysses_attention``, and ``UlyssesAttention``,
a ``sparse_fn`` for ``tessera_jax.flax.AttentionOptions`` (Flax models, compiled loops).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tessera_jax.mask import BlockMask
from tessera_jax.parallel import assign as _assign
from tessera_jax.parallel import specs as _specs
from tessera_jax.parallel.local import _as_heads, local_attention
from tessera_jax.validation import check_mask, check_qkv

__all__ = ["UlyssesAttention", "gather_head_costs", "heads_to_seq", "kv_heads", "lse_to_seq",
           "seq_to_heads", "ulysses_attention"]


def _xp(a):
    return jnp if isinstance(a, jax.Array) else np


def _flat(heads):
    return None if heads is None else _xp(heads).asarray(heads).reshape(-1)


def _inverse(order):
    return _xp(order).argsort(order)


def kv_heads(heads, group_size: int):
    """The K/V heads [n, Hkv / n] of a query-head assignment [n, Hq / n] (whole GQA groups)."""
    if heads is None or group_size == 1:
        return heads
    return heads[:, ::group_size] // group_size


def seq_to_heads(x, axis_name, heads=None):
    """Inside shard_map over ``axis_name``: x [B, L / n, H, D] (this device's sequence shard, all
    heads) -> [B, L, H / n, D] (the whole sequence, this device's heads: ``heads[d]``, [n, H / n];
    None: contiguous)."""
    h = _flat(heads)
    if h is not None:
        x = jnp.take(x, h, axis=2)
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(y, axis_name, heads=None):
    """The inverse of ``seq_to_heads``: [B, L, H / n, D] -> [B, L / n, H, D] in head order."""
    y = jax.lax.all_to_all(y, axis_name, split_axis=1, concat_axis=2, tiled=True)
    h = _flat(heads)
    return y if h is None else jnp.take(y, _inverse(h), axis=2)


def lse_to_seq(lse, axis_name, heads=None):
    """lse [B, H / n, L] of this device's heads -> [B, H, L / n] (this sequence shard)."""
    lse = jax.lax.all_to_all(lse, axis_name, split_axis=2, concat_axis=1, tiled=True)
    h = _flat(heads)
    return lse if h is None else jnp.take(lse, _inverse(h), axis=1)


def gather_head_costs(local_costs, axis_name, heads=None):
    """Inside shard_map: every device's costs of its heads ([Hl] each, e.g. the selected counts
    of masks computed after ``seq_to_heads``) -> the costs of all query heads [Hq] in head order,
    the same on every device (an ``all_gather``): the next step's ``assign_heads`` input."""
    everyone = jax.lax.all_gather(local_costs, axis_name)          # [n, Hl]
    h = _flat(heads)
    flat = everyone.reshape(-1)
    return flat if h is None else jnp.zeros_like(flat).at[jnp.asarray(h)].set(flat)


def _pad_mask(mask: BlockMask, Lq: int, Lkv: int, Lq_pad: int, Lkv_pad: int) -> BlockMask:
    """The mask over sequences padded to Lq_pad / Lkv_pad: one more block per padded axis,
    never selected (padded queries output 0, padded keys are never attended)."""
    parts = [mask.q_bounds, mask.kv_bounds]
    blocks = mask.blocks
    for axis, (L, Lp) in enumerate(((Lq, Lq_pad), (Lkv, Lkv_pad))):
        if Lp == L:
            continue
        b = parts[axis]
        xp = _xp(b)
        end = xp.full(b.shape[:-1] + (1,), Lp, dtype=b.dtype)
        parts[axis] = xp.concatenate([b, end], axis=-1)
        pad = [(0, 0)] * 3
        pad[1 + axis] = (0, 1)
        blocks = _xp(blocks).pad(blocks, pad)
    return BlockMask(parts[0], parts[1], blocks)


def _resolve_heads(heads, mask, q, k, n, group, cost, backend):
    """The assignment: None (contiguous), a method name (from the mask's head costs) or given."""
    if heads is None:
        return None
    if isinstance(heads, str):
        costs = _assign.head_costs(mask, q.shape, k.shape, q.dtype, kind=cost, backend=backend)
        return _assign.assign_heads(costs, n, group_size=group, method=heads)
    heads = _as_heads(heads, n, q.shape[2] // n)
    if group > 1 and isinstance(heads, np.ndarray):
        grp = heads.reshape(n, -1, group)
        if not np.array_equal(grp, grp[..., :1] // group * group + np.arange(group)):
            raise ValueError(f"heads must keep each GQA group of {group} query heads together, "
                             f"in order, on one device")
    return heads


def ulysses_attention(q, k, v, mask: BlockMask, *, axis_name="seq", mesh=None, heads=None,
                      cost: str = "auto", scale=None, return_lse: bool = False,
                      backend: str | None = None, template: str | None = None):
    """``sparse_attention`` with q [B, Lq, Hq, D], k, v [B, Lkv, Hkv, D] split over the sequence.

    Global arrays in and out, sharded over the sequence (axis 1) on ``axis_name`` (under
    ``jax.jit`` with ``NamedSharding(mesh, P(None, axis_name))`` inputs nothing else moves).
    One all-to-all per operand brings each device the whole sequence of ``Hq / n`` heads
    (whole GQA groups: Hkv must split evenly too), it runs their masks (``local_attention``),
    and one all-to-all takes the output back. ``heads``: None (contiguous: device d gets heads
    [d * Hl, (d + 1) * Hl)), ``"lpt"`` / ``"snake"`` (balanced by the mask's ``head_costs`` of
    ``cost`` kind: the planner's estimate for a static mask, selected tokens computed on the
    device for a device mask) or an assignment [n, Hq / n] (NumPy: static; jax: e.g. from the
    previous step's costs). Sequences not divisible by n are padded (and the mask with an
    unselected block). ``mask`` holds all Hq heads (or 1); it is replicated. On a mesh with
    explicit axes the output is resharded as q is (unchanged when q is sequence-sharded).
    """
    shape = check_qkv(q, k, v)
    check_mask(mask, shape)
    n = _specs.split_heads(shape, mesh, axis_name, "Ulysses")
    group = shape.num_q_heads // shape.num_kv_heads
    heads = _resolve_heads(heads, mask, q, k, n, group, cost, backend)
    Lq, Lkv = shape.q_len, shape.kv_len
    q0 = q
    Lq_pad, Lkv_pad = -(-Lq // n) * n, -(-Lkv // n) * n
    if (Lq_pad, Lkv_pad) != (Lq, Lkv):
        mask = _pad_mask(mask, Lq, Lkv, Lq_pad, Lkv_pad)
        q = jnp.pad(q, ((0, 0), (0, Lq_pad - Lq), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, Lkv_pad - Lkv), (0, 0), (0, 0))) for x in (k, v))
    ss = P(None, axis_name, None, None)
    ops, op_specs, rebuild = _specs.mask_operands(mask, None)
    traced = isinstance(heads, jax.Array)
    if traced:
        ops, op_specs = ops + (heads,), op_specs + (P(),)

    def body(q, k, v, *ops):
        hq = ops[-1] if traced else heads
        m = rebuild(*(ops[:-1] if traced else ops))
        hkv = kv_heads(hq, group)
        qh = seq_to_heads(q, axis_name, hq)
        kh, vh = (seq_to_heads(x, axis_name, hkv) for x in (k, v))
        res = local_attention(qh, kh, vh, m, axis_name=axis_name, heads=hq, scale=scale,
                              return_lse=return_lse, backend=backend, template=template)
        if not return_lse:
            return heads_to_seq(res, axis_name, hq)
        return heads_to_seq(res[0], axis_name, hq), lse_to_seq(res[1], axis_name, hq)

    args = tuple(_specs.fit(x, mesh, ss) for x in (q, k, v))
    args += tuple(_specs.fit(x, mesh, s) for x, s in zip(ops, op_specs))
    out_specs = (ss, P(None, None, axis_name)) if return_lse else ss
    res = jax.shard_map(body, mesh=mesh, in_specs=(ss,) * 3 + op_specs, out_specs=out_specs,
                        check_vma=False)(*args)
    out, lse = res if return_lse else (res, None)
    out = _specs.like(out, q0, mesh)
    out = out if Lq_pad == Lq else out[:, :Lq]
    if not return_lse:
        return out
    lse = _specs.like(lse, q0, mesh, (0, 2, 1))
    return out, lse if Lq_pad == Lq else lse[:, :, :Lq]


@dataclasses.dataclass(frozen=True)
class UlyssesAttention:
    """A hashable ``sparse_fn`` for ``tessera_jax.flax.AttentionOptions``: every sparse call of
    a model (``make_attention_fn``, ``WanModel``, ``HunyuanModel``, ``make_sampler``'s loop)
    runs ``ulysses_attention`` on ``mesh`` / ``axis_name``; ``heads`` None, ``"lpt"`` or
    ``"snake"`` (balanced per mask, see ``ulysses_attention``). Dense calls (mask None) stay
    ``jax.nn.dot_product_attention``, partitioned by XLA."""

    mesh: jax.sharding.Mesh | None = None
    axis_name: str = "seq"
    heads: str | None = None
    cost: str = "auto"
    backend: str | None = None
    template: str | None = None

    def __post_init__(self):
        if self.heads is not None and self.heads not in _assign.METHODS:
            raise ValueError(f"heads must be None or one of {_assign.METHODS}, got "
                             f"{self.heads!r}")

    def __call__(self, q, k, v, mask, scale=None):
        return ulysses_attention(q, k, v, mask, axis_name=self.axis_name, mesh=self.mesh,
                                 heads=self.heads, cost=self.cost, scale=scale,
                                 backend=self.backend, template=self.template)
