"""Video DiTs in flax nnx (Wan2.1, HunyuanVideo-1.5; random weights) and a compiled denoising loop."""

from .common import extend_with_text, patchify, rope_3d, unpatchify
from .hunyuan import HUNYUAN15, HUNYUAN15_I2V, HunyuanConfig, HunyuanModel
from .loop import MaskSchedule, Sampler, flow_sigmas, make_forward, make_sampler
from .wan import WAN21_1_3B, WAN21_14B, WanConfig, WanModel

__all__ = ["HUNYUAN15", "HUNYUAN15_I2V", "HunyuanConfig", "HunyuanModel", "MaskSchedule",
           "Sampler", "WAN21_14B", "WAN21_1_3B", "WanConfig", "WanModel", "extend_with_text",
           "flow_sigmas", "make_forward", "make_sampler", "patchify", "rope_3d", "unpatchify"]
