"""Mesh plumbing shared by the head- and sequence-parallel wrappers: which parts of a mask travel
into ``jax.shard_map`` as operands (and with which ``PartitionSpec``), which stay static, and
resharding for meshes with explicit axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tessera_jax.mask import BlockMask

__all__ = ["axis_size", "explicit", "fit", "like", "mask_operands"]


def _mesh(mesh):
    return mesh if mesh is not None else jax.sharding.get_abstract_mesh()


def axis_size(mesh, axis_name) -> int:
    """Devices along ``axis_name`` of ``mesh`` (None: the mesh set by ``jax.set_mesh``)."""
    m = _mesh(mesh)
    if m is None or axis_name not in getattr(m, "axis_names", ()):
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {m}; pass mesh= "
                         f"or set one with jax.set_mesh")
    return int(m.shape[axis_name])


def split_heads(shape, mesh, axis_name, what: str) -> int:
    """The size n of ``axis_name``, after checking that Hq and Hkv split evenly over it
    (whole GQA groups per device); ``what`` names the caller in the error."""
    n = axis_size(mesh, axis_name)
    for name, h in (("Hq", shape.num_q_heads), ("Hkv", shape.num_kv_heads)):
        if h % n:
            raise ValueError(f"{name}={h} heads can't be split over {n} devices of axis "
                             f"{axis_name!r}: {what} needs a multiple of {n}")
    return n


def explicit(mesh, spec: P | None = None) -> bool:
    """Whether an axis of ``spec`` (None: of the mesh) is explicit (sharding in types)."""
    m = _mesh(mesh)
    types = dict(zip(m.axis_names, m.axis_types))
    names = m.axis_names if spec is None else [
        a for part in spec if part is not None
        for a in (part if isinstance(part, tuple) else (part,))]
    return any(types.get(a) == AxisType.Explicit for a in names)


def _reshard(x, mesh, spec: P):
    return jax.reshard(x, NamedSharding(mesh, spec) if mesh is not None else spec)


def fit(x, mesh, spec: P):
    """``x`` resharded to ``spec`` where the mesh's axes are explicit (shard_map then needs the
    inputs' shardings to match ``in_specs``); unchanged on auto axes (shard_map reshards)."""
    return _reshard(x, mesh, spec) if explicit(mesh, spec) else x


def like(y, x, mesh, dims=(0, 1, 2, 3)):
    """``y`` resharded as ``x`` is (dim i of y as dim ``dims[i]`` of x) on a mesh with explicit
    axes, where sharding is part of the type and code after the call expects its input's
    layout back; unchanged on auto axes (XLA propagates shardings)."""
    if not explicit(mesh):
        return y
    spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    return _reshard(y, mesh, P(*(spec[d] for d in dims)))


def mask_operands(mask: BlockMask, head_axis=None):
    """(operands, specs, rebuild) of a mask for shard_map.

    A static mask has no operands (it is closed over). A device mask's jax arrays are operands;
    its NumPy bounds stay static (planned with static bounds), except per-head ones when
    ``head_axis`` shards the heads. ``head_axis``: None: every operand replicated (``P()``);
    a mesh axis: per-head parts (blocks of Hm > 1, bounds [Hm, n + 1]) sharded over it.
    ``rebuild(*operands)`` gives the mask inside the body.
    """
    if mask.is_static:
        return (), (), lambda: mask
    parts = [mask.q_bounds, mask.kv_bounds, mask.blocks]
    per_head = [b.ndim == 2 for b in parts[:2]] + [True]
    shard = [head_axis is not None and ph and mask.num_heads > 1 for ph in per_head]
    slots, ops, specs = [], [], []
    for x, s in zip(parts, shard):
        if isinstance(x, np.ndarray) and not s:
            slots.append(x)
            continue
        slots.append(None)
        ops.append(jnp.asarray(x))
        specs.append(P(head_axis) if s else P())

    def rebuild(*operands):
        it = iter(operands)
        return BlockMask(*(x if x is not None else next(it) for x in slots))

    return tuple(ops), tuple(specs), rebuild
