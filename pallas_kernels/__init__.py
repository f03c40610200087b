"""Pallas kernels that execute tessera_jax plans (see ``abi``); they know nothing of masks."""
