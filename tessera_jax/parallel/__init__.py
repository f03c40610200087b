"""Sparse attention over several devices: head parallelism, Ulysses sequence parallelism, and
head-to-device assignment balanced by plan cost (``docs/multi_gpu.md``).

* ``head_parallel_attention``: q, k, v sharded over heads; each device runs its heads' masks.
* ``ulysses_attention``: sequence shards -> head shards (all-to-all), sparse attention, back.
* ``local_attention``: the per-device call inside your own ``jax.shard_map``.
* ``head_costs`` / ``assign_heads`` / ``imbalance`` / ``balance_report``: cost balancing.
* ``UlyssesAttention`` / ``HeadParallelAttention``: ``sparse_fn`` for Flax models and loops.
"""

from tessera_jax.parallel.assign import (BalanceReport, assign_heads, balance_report,
                                         contiguous_heads, device_costs, head_costs, imbalance)
from tessera_jax.parallel.heads import HeadParallelAttention, head_parallel_attention
from tessera_jax.parallel.local import clear_caches, device_plans, local_attention, local_masks
from tessera_jax.parallel.ulysses import (UlyssesAttention, gather_head_costs, heads_to_seq,
                                          kv_heads, lse_to_seq, seq_to_heads, ulysses_attention)

__all__ = ["BalanceReport", "HeadParallelAttention", "UlyssesAttention", "assign_heads",
           "balance_report", "clear_caches", "contiguous_heads", "device_costs", "device_plans",
           "gather_head_costs", "head_costs", "head_parallel_attention", "heads_to_seq",
           "imbalance", "kv_heads", "local_attention", "local_masks", "lse_to_seq",
           "seq_to_heads", "ulysses_attention"]
