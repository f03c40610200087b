"""Head-to-device assignment by attention cost: a cost per query head, a balanced assignment of
heads to devices (GQA groups kept whole, equal head counts per device), and the imbalance it
leaves (max device cost / mean device cost).

An assignment is an int array ``heads`` [n_devices, Hq / n_devices]: row d lists the query heads
device d holds, in its local order (ascending). NumPy costs give a NumPy assignment (a static
value: static masks are sliced and planned per device on the host); jax costs (a device mask's,
traced values included) give a jax assignment computed inside the program.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import abi
from tessera_jax.mask import BlockMask

__all__ = ["COST_KINDS", "METHODS", "BalanceReport", "assign_heads", "balance_report",
           "contiguous_heads", "device_costs", "head_costs", "imbalance"]

COST_KINDS = ("auto", "plan", "tokens")
METHODS = ("lpt", "snake", "contiguous")


def _is_jax(x) -> bool:
    return isinstance(x, jax.Array)


# --- costs -------------------------------------------------------------------------------------
def _token_costs(mask: BlockMask):
    """Selected (query, key) interactions per mask head, [Hm]: float64 NumPy for a static mask,
    float32 computed on the device for a device mask."""
    if mask.is_static:
        return mask.selected_per_head().astype(np.float64)
    Hm = mask.num_heads

    def sizes(b):
        d = jnp.diff(jnp.asarray(b, jnp.int32), axis=-1).astype(jnp.float32)
        return jnp.broadcast_to(d.reshape(-1, d.shape[-1]), (Hm, d.shape[-1]))

    blocks = jnp.asarray(mask.blocks).astype(jnp.float32)
    return jnp.einsum("hij,hi,hj->h", blocks, sizes(mask.q_bounds), sizes(mask.kv_bounds))


def _plan_costs(mask: BlockMask, q_shape, kv_shape, dtype, backend) -> np.ndarray:
    """The host planner's estimated time per query head (ns, one batch element), [Hq]."""
    from tessera_jax.runtime import api
    p = api.plan(mask, q_shape, kv_shape, dtype, backend=backend)
    Hq = int(q_shape[2])
    if p.unit_cost is None:
        raise ValueError("this plan has no cost estimate")
    head = p.units[: p.num_units, abi.UNIT_HEAD].astype(np.int64)
    return np.bincount(head, weights=np.asarray(p.unit_cost, np.float64), minlength=Hq)[:Hq]


def head_costs(mask: BlockMask, q_shape=None, kv_shape=None, dtype=None, *, kind: str = "auto",
               backend: str | None = None):
    """Cost of each query head's attention, [Hq] (a shared mask counts once per head).

    ``kind``: ``"plan"``: the host planner's time estimate of the plan ``sparse_attention`` runs
    (static masks with shared bounds; needs the shapes and dtype): counts tile waste, masked
    steps and per-unit overheads; ``"tokens"``: selected token interactions (any mask; for a
    device mask computed on the device, jnp float32); ``"auto"``: ``"plan"`` where it applies,
    else ``"tokens"``. ``Hq`` is ``q_shape[2]`` when given, else the mask's head count.
    """
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a tessera_jax.BlockMask, got {type(mask).__name__}")
    if kind not in COST_KINDS:
        raise ValueError(f"kind must be one of {COST_KINDS}, got {kind!r}")
    Hq = int(q_shape[2]) if q_shape is not None else mask.num_heads
    if mask.num_heads not in (1, Hq):
        raise ValueError(f"mask has {mask.num_heads} heads; it must have 1 or Hq={Hq}")
    plannable = mask.is_static and not mask.per_head_bounds and None not in (q_shape, kv_shape,
                                                                            dtype)
    if kind == "plan" and not plannable:
        raise ValueError("kind='plan' needs a static mask with shared bounds and q_shape, "
                         "kv_shape, dtype; use kind='tokens' (device masks: computed on device)")
    if kind != "tokens" and plannable:
        return _plan_costs(mask, q_shape, kv_shape, dtype, backend)
    c = _token_costs(mask)
    if mask.num_heads == 1 and Hq > 1:
        c = jnp.broadcast_to(c, (Hq,)) if _is_jax(c) else np.broadcast_to(c, (Hq,)).copy()
    return c


# --- assignment --------------------------------------------------------------------------------
def contiguous_heads(num_heads: int, num_devices: int) -> np.ndarray:
    """The assignment of plain head sharding: device d holds heads [d * Hl, (d + 1) * Hl)."""
    _check_counts(num_heads, num_devices, 1)
    return np.arange(num_heads).reshape(num_devices, -1)


def _check_counts(num_heads: int, num_devices: int, group_size: int) -> int:
    for name, v in (("num_heads", num_heads), ("num_devices", num_devices),
                    ("group_size", group_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_heads % group_size:
        raise ValueError(f"num_heads={num_heads} is not a multiple of group_size={group_size}")
    groups = num_heads // group_size
    if groups % num_devices:
        raise ValueError(f"{groups} head groups (GQA groups of {group_size} query heads) can't "
                         f"be split evenly over {num_devices} devices; each device must hold "
                         f"whole groups, the same number each")
    return groups


def _snake(gc, n, xp):
    """Device of each group: groups by decreasing cost dealt 0..n-1, n-1..0, 0..n-1, ..."""
    G = gc.shape[0]
    order = xp.argsort(-gc, stable=True)
    i = xp.arange(G)
    r, j = i // n, i % n
    dev_sorted = xp.where(r % 2 == 0, j, n - 1 - j)
    if xp is np:
        dev = np.empty(G, np.int64)
        dev[order] = dev_sorted
        return dev
    return jnp.zeros(G, jnp.int32).at[order].set(dev_sorted.astype(jnp.int32))


def _lpt_numpy(gc: np.ndarray, n: int) -> np.ndarray:
    """Longest processing time first with equal group counts, then pairwise swaps between the
    most loaded device and the others while the maximum load drops."""
    G = gc.shape[0]
    cap = G // n
    loads, counts = np.zeros(n), np.zeros(n, np.int64)
    dev = np.zeros(G, np.int64)
    for g in np.argsort(-gc, kind="stable"):
        d = int(np.argmin(np.where(counts < cap, loads, np.inf)))
        dev[g], loads[d], counts[d] = d, loads[d] + gc[g], counts[d] + 1
    for _ in range(G * G):
        a = int(np.argmax(loads))
        best, best_max = None, loads[a]
        for b in range(n):
            if b == a:
                continue
            ga, gb = np.nonzero(dev == a)[0], np.nonzero(dev == b)[0]
            delta = gc[ga][:, None] - gc[gb][None, :]          # load moved from a to b
            new_max = np.maximum(loads[a] - delta, loads[b] + delta)
            i, j = np.unravel_index(np.argmin(new_max), new_max.shape)
            if new_max[i, j] < best_max * (1 - 1e-12):
                best, best_max = (ga[i], gb[j], b, delta[i, j]), new_max[i, j]
        if best is None:
            break
        x, y, b, dl = best
        dev[x], dev[y] = b, a
        loads[a] -= dl
        loads[b] += dl
    return dev


def _lpt_jax(gc, n: int):
    """``_lpt_numpy``'s first pass in jnp (no swaps): a ``fori_loop`` over the groups."""
    G = gc.shape[0]
    cap = G // n
    order = jnp.argsort(-gc, stable=True)

    def place(i, carry):
        loads, counts, dev = carry
        g = order[i]
        d = jnp.argmin(jnp.where(counts < cap, loads, jnp.inf))
        return loads.at[d].add(gc[g]), counts.at[d].add(1), dev.at[g].set(d.astype(jnp.int32))

    init = (jnp.zeros(n, gc.dtype), jnp.zeros(n, jnp.int32), jnp.zeros(G, jnp.int32))
    return jax.lax.fori_loop(0, G, place, init)[2]


def _heads_of(dev, n: int, group_size: int, xp):
    """[n, Hq / n] query heads per device from each group's device (groups ascending)."""
    G = dev.shape[0]
    groups = xp.argsort(dev * G + xp.arange(G), stable=True).reshape(n, G // n)
    heads = groups[..., None] * group_size + xp.arange(group_size)
    return heads.reshape(n, -1).astype(np.int64 if xp is np else jnp.int32)


def assign_heads(costs, num_devices: int, *, group_size: int = 1, method: str = "lpt"):
    """Balanced assignment of query heads to devices, ``heads`` [num_devices, Hq / num_devices].

    ``costs``: [Hq] per query head (``head_costs``). ``group_size`` = Hq / Hkv: the query heads
    of one GQA group stay on one device. Every device gets the same number of groups.
    ``method``: ``"lpt"`` (longest first onto the least loaded device with room; NumPy costs
    then swap pairs while the maximum drops), ``"snake"`` (groups by decreasing cost dealt in a
    back-and-forth order, xDiT's sorted snake) or ``"contiguous"`` (plain head sharding).
    NumPy costs give a NumPy array; jax costs a jax array (works under jit)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    xp = jnp if _is_jax(costs) else np
    costs = xp.asarray(costs)
    if costs.ndim != 1:
        raise ValueError(f"costs must be 1-D [Hq], got shape {tuple(costs.shape)}")
    H = int(costs.shape[0])
    _check_counts(H, num_devices, group_size)
    if method == "contiguous":
        out = contiguous_heads(H, num_devices)
        return jnp.asarray(out, jnp.int32) if xp is jnp else out
    gc = costs.reshape(-1, group_size).sum(axis=1)
    if method == "snake":
        dev = _snake(gc, num_devices, xp)
    elif xp is np:
        dev = _lpt_numpy(gc.astype(np.float64), num_devices)
    else:
        dev = _lpt_jax(gc.astype(jnp.float32), num_devices)
    return _heads_of(dev, num_devices, group_size, xp)


# --- imbalance ---------------------------------------------------------------------------------
def device_costs(costs, heads):
    """Cost per device, [n]: the sum of its heads' costs."""
    xp = jnp if _is_jax(costs) or _is_jax(heads) else np
    return xp.asarray(costs)[xp.asarray(heads)].sum(axis=1)


def imbalance(costs, heads):
    """max device cost / mean device cost (1.0: perfectly even; 1.0 when all costs are 0)."""
    xp = jnp if _is_jax(costs) or _is_jax(heads) else np
    d = device_costs(costs, heads)
    mean = d.mean()
    out = xp.where(mean > 0, d.max() / xp.where(mean > 0, mean, 1), 1.0)
    return out if xp is jnp else float(out)


class BalanceReport(NamedTuple):
    """``heads``: the balanced assignment; ``balanced`` / ``unbalanced``: the imbalance with it
    and with contiguous head sharding."""

    heads: np.ndarray
    balanced: float
    unbalanced: float


def balance_report(costs, num_devices: int, *, group_size: int = 1,
                   method: str = "lpt") -> BalanceReport:
    """The imbalance with and without cost balancing, and the balanced assignment."""
    heads = assign_heads(costs, num_devices, group_size=group_size, method=method)
    H = int(np.shape(costs)[0])
    return BalanceReport(heads, imbalance(costs, heads),
                         imbalance(costs, contiguous_heads(H, num_devices)))
