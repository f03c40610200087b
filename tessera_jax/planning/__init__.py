"""Planning: logical blocks -> physical tiles -> work units, as the int32 arrays of the plan ABI.

Host NumPy + numba; knows nothing of Pallas. ``planner`` holds the policies and the ``Plan``,
``config`` its options (``PlannerConfig``), ``loops`` the numba-compiled inner loops,
``vectorised`` the same plans in NumPy (what a fresh process plans with while numba compiles)
and ``schedule`` the cost model and unit order (plots of a plan: ``tessera_jax.viz``);
``device`` plans masks held in jax arrays inside jit (jnp; the device planner's core).
"""

from tessera_jax.planning.config import PlannerConfig
from tessera_jax.planning.planner import POLICIES, Plan, bucket, build_plan, tile_kinds, warm_up

__all__ = ["POLICIES", "Plan", "PlannerConfig", "bucket", "build_plan", "tile_kinds", "warm_up"]
