"""Pallas kernels that execute tessera_jax plans (see ``plan_abi``); they know nothing of masks."""
