"""XLA executor of plans: plain JAX (CPU/TPU, the fallback, differentiable)."""
