"""Shared by the request benchmarks: a corpus test mask by FAMILY:GRID, its inputs, and a reset
of the caches a new mask would miss (so that a timed call pays what a new request pays)."""

from __future__ import annotations


def first_test_mask(item: str, heads: int, specs: list):
    """(spec, mask): the first test-split spec of ``item`` = "FAMILY:GRID", with its first
    ``heads`` heads (``masks.build``: head i as in the full mask; shared masks stay shared)."""
    from tessera_jax.masks import build
    fam, grid = item.split(":")
    spec = next(s for s in specs if s["family"] == fam and s["grid"] == grid)
    return spec, build(spec, heads=min(int(heads), int(spec["heads"])))


def bf16_inputs(mask, heads: int, head_dim: int = 128, seed: int = 0):
    """q, k, v [1, L, heads, head_dim] bfloat16, normal, for ``mask``'s lengths."""
    import jax
    import jax.numpy as jnp
    key = jax.random.key(seed)
    return tuple(jax.random.normal(jax.random.fold_in(key, i), (1, L, heads, head_dim),
                                   jnp.bfloat16)
                 for i, L in enumerate((mask.Lq, mask.Lkv, mask.Lkv)))


def forget_request_caches(selection: bool = True) -> None:
    """A "new mask" reset. With ``selection`` (the default): ``tj.clear_caches()``, everything
    a request computes from its mask (plans, mask features and layouts, choices, all-selected
    verdicts, the kernel runner's prepared plans and device copies), so the next call pays what
    a request on a new mask pays. Without: only the plans (API front cache, planner, the kernel
    runner's prepared plans), for timing planning with the mask's choice kept."""
    if selection:
        import tessera_jax as tj
        tj.clear_caches()
        return
    from tessera_jax.planning import planner
    from tessera_jax.runtime import api, kernel_runner
    api._PLANS.clear()
    planner.clear_cache()
    kernel_runner.clear_cache()
