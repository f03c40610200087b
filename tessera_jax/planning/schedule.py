"""Cost model and ordering of work units: what the planner minimises and how units are scheduled.

A work unit's cost is an estimate of the time one GPU multiprocessor (SM) spends on it:

    cost(unit) = UNIT_NS                                   # load Q, pipeline fill, epilogue, store
               + steps * (STEP_NS                          # barriers, softmax rescale per tile
                          + tile_q * tile_kv * D * MAC_NS  # the tile's two matmuls (computed, not
                                                           #   selected, interactions: masked
                                                           #   entries cost as much as the rest)
                          + 2 * tile_kv * D * itemsize * BYTE_NS)   # K and V tile loads
               + partial_steps * MASK_NS                   # building the element mask

The constants live in ``CostModel`` below. The defaults are rough H200 figures derived from
DESIGN.md's dense measurements (592 TFLOP/s over 132 SMs; HBM 4.8 TB/s with ~3x L2 reuse of
K/V across units); the offline profiler replaces them with fitted values.

Ordering (``order_units``): heaviest units first (longest-processing-time first is within 4/3
of the optimal makespan for a persistent kernel that hands the next unit to the first free
SM); among units of similar cost (same cost class, eight classes per octave) the order is
either
* ``"interleaved"`` (default): by query position, then K/V head, then query head, so that units
  of the query heads that share a K/V head, and neighbouring query tiles of all heads, run at
  the same time and reuse the K/V tiles they load from L2; or
* ``"head_major"``: by query head, then query position, as jax's ``attention_mgpu`` launches
  its grid: the units resident at one time are consecutive query tiles of one head, which all
  stream that head's K/V from L2.
A template picks one with its ``unit_order`` option (``planner.build_plan`` reads it).
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

__all__ = ["CostModel", "DEFAULT_COST_MODEL", "UNIT_ORDERS", "unit_costs", "order_units",
           "makespan", "balance"]

UNIT_ORDERS = ("interleaved", "head_major")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-SM time constants (nanoseconds) of the unit cost estimate; see the module docstring.

    mac_ns:   one computed interaction per head-dim element (QK^T and PV: 4 flops), so a
              tile_q x tile_kv step at head dim D costs tile_q * tile_kv * D * mac_ns.
    byte_ns:  one byte of K or V loaded into shared memory (amortised with L2 reuse).
    step_ns:  fixed cost of one K/V tile visit (synchronisation, online-softmax rescale).
    mask_ns:  extra cost of a partial step (computing and applying the element mask).
    unit_ns:  fixed cost of one work unit (Q load, pipeline fill and drain, output store).
    num_sms:  multiprocessors the units are spread over (132 on an H200).
    """

    mac_ns: float = 4.0 / (592e12 / 132) * 1e9   # 4 flops per interaction per D, dense rate
    byte_ns: float = 132 / (3 * 4.8e12) * 1e9     # HBM 4.8 TB/s, ~3x reuse from L2
    step_ns: float = 150.0
    mask_ns: float = 60.0
    unit_ns: float = 1500.0
    num_sms: int = 132

    def __post_init__(self):
        for f in ("mac_ns", "byte_ns", "step_ns", "mask_ns", "unit_ns"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ValueError(f"{f} must be a finite non-negative number, got {v!r}")
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms < 1:
            raise ValueError(f"num_sms must be a positive int, got {self.num_sms!r}")

    def step_ns_total(self, tile_q: int, tile_kv: int, head_dim: int, itemsize: int) -> float:
        """Estimated time of one (full) step of a unit."""
        return (self.step_ns + tile_q * tile_kv * head_dim * self.mac_ns
                + 2 * tile_kv * head_dim * itemsize * self.byte_ns)


DEFAULT_COST_MODEL = CostModel()


def unit_costs(steps_per_unit, partial_per_unit, *, tile_q: int, tile_kv: int, head_dim: int,
               itemsize: int, model: CostModel = DEFAULT_COST_MODEL) -> np.ndarray:
    """Estimated nanoseconds of each unit (float64 [U])."""
    cnt = np.asarray(steps_per_unit, np.float64)
    part = np.asarray(partial_per_unit, np.float64)
    return (model.unit_ns + cnt * model.step_ns_total(tile_q, tile_kv, head_dim, itemsize)
            + part * model.mask_ns)


def order_units(cost, q_start, kv_head, q_head, order: str = "interleaved") -> np.ndarray:
    """Schedule order (a permutation): heaviest cost class first, then, for ``"interleaved"``,
    q position, K/V head, query head, or for ``"head_major"``, query head, q position. Cost
    classes are eight per octave, so near-equal units count as equal."""
    if order not in UNIT_ORDERS:
        raise ValueError(f"order must be one of {UNIT_ORDERS}, got {order!r}")
    cost = np.asarray(cost, np.float64)
    cls = np.floor(np.log2(np.maximum(cost, 1.0)) * 8).astype(np.int64)
    if order == "head_major":
        return np.lexsort((np.asarray(q_start), np.asarray(q_head), -cls))
    return np.lexsort((np.asarray(q_head), np.asarray(kv_head), np.asarray(q_start), -cls))


def makespan(cost_in_order, num_sms: int) -> float:
    """Finish time of a persistent kernel that gives each unit, in order, to the first free SM
    (list scheduling, simulated exactly)."""
    c = np.asarray(cost_in_order, np.float64)
    if c.size == 0:
        return 0.0
    if c.size <= num_sms:
        return float(c.max())
    heap = [float(x) for x in c[:num_sms]]
    heapq.heapify(heap)
    for x in c[num_sms:].tolist():
        heapq.heapreplace(heap, heap[0] + x)
    return float(max(heap))


def balance(cost_in_order, num_sms: int) -> float:
    """Ideal time (total / num_sms, at least the largest unit) over the simulated makespan; 1.0
    is perfect balance."""
    c = np.asarray(cost_in_order, np.float64)
    if c.size == 0:
        return 1.0
    ideal = max(c.sum() / num_sms, c.max())
    return float(ideal / makespan(c, num_sms))
