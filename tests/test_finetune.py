"""The fine-tuning example (``tessera_jax.tools.finetune``) at a tiny size: a Wan-style DiT
with a sparse mask in every layer trains with optax through jax.checkpoint, the loss falls,
and the gradients come from the sparse backward (``runtime.core``)."""

import numpy as np

from tessera_jax.runtime import core, device_route, host_plans
from tessera_jax.tools import finetune


def test_finetune_loss_falls_through_the_sparse_backward(monkeypatch):
    planned = []
    orig = host_plans.dkv_plan
    monkeypatch.setattr(host_plans, "dkv_plan",
                        lambda p, *a: planned.append(p) or orig(p, *a))
    cfg = finetune.tiny_config()
    mask = finetune.window_mask(48, 8, 1, cfg.num_heads)
    assert 0.2 < mask.density < 0.8
    losses = finetune.train(cfg, steps=24, checkpoint=True)
    assert planned and all(p.mask == mask for p in planned)
    assert np.isfinite(losses).all()
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.8 * first, (first, last)


def test_finetune_with_masks_built_from_q_and_k(monkeypatch):
    """``mask="vsa"``: every layer builds its VSA-like mask from q and k inside the compiled
    step; the gradients come from the device route's backward, and the loss falls."""
    traced, exact = [], []
    orig = device_route.device_plans
    monkeypatch.setattr(device_route, "device_plans",
                        lambda *a, **kw: traced.append(orig(*a, **kw)) or traced[-1])
    monkeypatch.setattr(core, "exact_backward", lambda *a, **kw: exact.append(1))
    losses = finetune.train(finetune.tiny_config(), steps=24, mask="vsa", keep=0.25,
                            checkpoint=True)
    assert traced and all(p.dkv is not None for p in traced) and not exact
    assert np.isfinite(losses).all()
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.8 * first, (first, last)
