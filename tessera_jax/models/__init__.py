"""Video DiTs in flax nnx (Wan2.1, HunyuanVideo-1.5; random weights) and a compiled denoising loop."""

from tessera_jax.models.common import extend_with_text, patchify, rope_3d, unpatchify
from tessera_jax.models.hunyuan import HUNYUAN15, HUNYUAN15_I2V, HunyuanConfig, HunyuanModel
from tessera_jax.models.loop import (DynamicSampler, DynamicSchedule, MaskSchedule, Sampler,
                                    flow_sigmas, make_forward, make_sampler)
from tessera_jax.models.wan import WAN21_1_3B, WAN21_14B, WanConfig, WanModel

__all__ = ["DynamicSampler", "DynamicSchedule", "HUNYUAN15", "HUNYUAN15_I2V", "HunyuanConfig",
           "HunyuanModel", "MaskSchedule", "Sampler", "WAN21_14B", "WAN21_1_3B", "WanConfig",
           "WanModel", "extend_with_text", "flow_sigmas", "make_forward", "make_sampler",
           "patchify", "rope_3d", "unpatchify"]
