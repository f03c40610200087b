"""Registry of kernel templates: the compiled shapes a plan can target, with their constraints.

A template fixes what a kernel is compiled for (tile shape, pipeline depth) and says what it can
take (head dims, dtypes, alignment of tile starts). The planner reads ``tile_q``, ``tile_kv``,
``q_align`` and ``kv_align`` to build plans a template can run; the ranking chooses among the
templates that ``supports`` a call. Backends add their entries with ``register``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Template", "register", "get", "all_templates", "for_backend", "supporting"]

BACKENDS = ("mosaic_gpu", "triton", "xla")
_DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Template:
    """One compiled kernel configuration.

    name:        unique key, e.g. "mgpu_q128_kv128_s2"
    backend:     "mosaic_gpu" | "triton" | "xla"
    tile_q:      query rows of one work unit (the plan's tile_q)
    tile_kv:     keys of one step (the plan's tile_kv)
    stages:      K/V pipeline depth (SMEM ring slots for Mosaic GPU, num_stages for Triton)
    head_dims:   head dims the kernel is compiled for (empty: any)
    dtypes:      input dtype names ("bfloat16", "float16", "float32")
    q_align:     every unit's q_start must be a multiple of this
    kv_align:    every step's kv_start must be a multiple of this
    min_compute_capability: lowest (major, minor) GPU it runs on; (0, 0) for any
    options:     backend-specific extras as (key, value) pairs (hashable)
    """

    name: str
    backend: str
    tile_q: int
    tile_kv: int
    stages: int
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    q_align: int = 1
    kv_align: int = 1
    min_compute_capability: tuple[int, int] = (0, 0)
    options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for field in ("tile_q", "tile_kv", "stages", "q_align", "kv_align"):
            val = getattr(self, field)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{field} must be a positive int, got {val!r}")
        if any(not isinstance(d, int) or d < 1 for d in self.head_dims):
            raise ValueError(f"head_dims must be a tuple of positive ints (empty: any), "
                             f"got {self.head_dims!r}")
        if not self.dtypes or any(d not in _DTYPE_NAMES for d in self.dtypes):
            raise ValueError(f"dtypes must be a non-empty tuple of {_DTYPE_NAMES}, "
                             f"got {self.dtypes!r}")

    def option(self, key, default=None):
        return dict(self.options).get(key, default)

    def supports(self, head_dim: int, dtype) -> bool:
        """Whether this template can run a call with this head dim and dtype."""
        return ((not self.head_dims or int(head_dim) in self.head_dims)
                and _dtype_name(dtype) in self.dtypes)


def _dtype_name(dtype) -> str:
    try:
        import jax.numpy as jnp  # bfloat16 lives in ml_dtypes; jnp.dtype knows it
        return jnp.dtype(dtype).name
    except Exception:  # pragma: no cover
        return np.dtype(dtype).name


_REGISTRY: dict[str, Template] = {}


def register(template: Template) -> Template:
    """Adds a template; re-registering the same name with a different template is an error."""
    if not isinstance(template, Template):
        raise TypeError(f"template must be a Template, got {type(template).__name__}")
    old = _REGISTRY.get(template.name)
    if old is not None and old != template:
        raise ValueError(f"a different template named {template.name!r} is already registered")
    _REGISTRY[template.name] = template
    return template


def get(name: str) -> Template:
    """The registered template of this name (``ValueError`` naming the known ones otherwise)."""
    if isinstance(name, Template):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown template {name!r}; registered: {sorted(_REGISTRY)}") from None


def all_templates() -> tuple[Template, ...]:
    return tuple(_REGISTRY.values())


def for_backend(backend: str) -> tuple[Template, ...]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return tuple(t for t in _REGISTRY.values() if t.backend == backend)


def supporting(head_dim: int, dtype, backend: str | None = None) -> tuple[Template, ...]:
    """Templates (of one backend, or all) that can run this head dim and dtype."""
    pool = _REGISTRY.values() if backend is None else for_backend(backend)
    return tuple(t for t in pool if t.supports(head_dim, dtype))


# --- Mosaic GPU (Hopper, sm_90a): pallas_kernels.mosaic.forward --------------------------------
# tile_q 128: two consumer warpgroups of 64 rows each (FA3 ping-pong). SMEM per CTA is
# 2*tile_q*D (Q/O) + stages * 2 * tile_kv * D * 2 (K, V ring): at D=128, tile_kv=128 three
# stages take 224 KiB of the 227 KiB available, four don't fit.
# q_align = kv_align = 8: TMA writes the (8, 64)-tiled, 128B-swizzled SMEM layout that wgmma
# reads by viewing GMEM as [L/8, D/64, 8, 64] tiles; a start that is not a multiple of 8 would
# reach past a tile's 8 rows and read zeros (the interpreter, which ignores layouts, can't see it).
# Options (mosaic_fwd.config_from_template): prefetch_rect (default off: run 3 measured it at
# 0 to -5%), schedule_barrier, mask_mode, auto_none, persistent, num_ctas, wg_skip, paired;
# unit_order is read by the planner ("interleaved" by default), policy by
# benchmarks/kernels.py (the plan policy a template is meant for; "merge" when absent).
_MGPU_COMMON = dict(backend="mosaic_gpu", head_dims=(64, 128),
                    dtypes=("bfloat16", "float16"), q_align=8, kv_align=8,
                    min_compute_capability=(9, 0))
for _kv, _stages in ((128, 2), (128, 3), (64, 2), (64, 3), (64, 4)):
    _t = Template(name=f"mgpu_q128_kv{_kv}_s{_stages}", tile_q=128, tile_kv=_kv, stages=_stages,
                  **_MGPU_COMMON)
    if (_kv, _stages) == (128, 3):
        # Measured on the H200: 232,568 bytes of SMEM at D=128 (ring, Q/O, LSE, barriers)
        # against 232,448 available, so D=64 only.
        _t = dataclasses.replace(_t, head_dims=(64,))
    register(_t)
# Persistent variants: one CTA per multiprocessor walks the units in schedule order, and the
# producer streams the next unit's K/V while the consumers finish the current one.
for _kv in (128, 64):
    register(Template(name=f"mgpu_q128_kv{_kv}_s2_persist", tile_q=128, tile_kv=_kv, stages=2,
                      options=(("persistent", True),), **_MGPU_COMMON))
# tile_q 64: one consumer warpgroup (64 rows, so 64-token query blocks fill a unit) plus the
# TMA producer, no ping-pong: the overlap of one CTA's softmax with another's matrix products
# comes from two CTAs per SM, so SMEM must fit twice in the SM's 228 KiB. At D=128 only
# kv64 with 2 stages does (~85 KB); kv64 s3 (~118 KB) and kv128 s2 (~150 KB) only at D=64.
# Planned with ``pack`` (partial edge cubes share a unit): on Wan 480p cubes / sliding tiles /
# clusters it computes 4-6% less than merge with fewer steps.
_Q64 = {(64, 2): (64, 128), (64, 3): (64,), (128, 2): (64,)}
for (_kv, _stages), _dims in _Q64.items():
    register(Template(name=f"mgpu_q64_kv{_kv}_s{_stages}", tile_q=64, tile_kv=_kv,
                      stages=_stages, options=(("policy", "pack"),),
                      **{**_MGPU_COMMON, "head_dims": _dims}))
# Paired tile_q 64: one CTA of the tile_q=128 shape (two consumer WGs, register split) runs
# two neighbouring 64-row units at once, each warpgroup its own unit with its own K/V ring;
# the overlap of softmax and matrix products then needs no second CTA per SM (no reliance on
# the compiler keeping registers at <= 128 per thread). Two rings: kv64 s2 at D=128 (~164 KB).
for _kv, _dims in ((64, (64, 128)), (128, (64,))):
    register(Template(name=f"mgpu_q64x2_kv{_kv}_s2", tile_q=64, tile_kv=_kv, stages=2,
                      options=(("paired", True), ("policy", "pack")),
                      **{**_MGPU_COMMON, "head_dims": _dims}))
# Warpgroup step skipping: a consumer warpgroup whose 64 rows miss a step's rectangle skips
# its matrix products and softmax, so ``pack``/``split`` plans (two 64-row query blocks in one
# 128-row unit, one rectangle per step) compute only the selected half. No ping-pong by
# default: the two warpgroups may then drift up to ``stages`` steps apart, so one computes
# while the other skips (benchmarks/kernels.py's "+sched" turns the barrier back on).
for _kv, _stages in ((64, 2), (64, 3), (128, 2)):
    register(Template(name=f"mgpu_q128_kv{_kv}_s{_stages}_skip", tile_q=128, tile_kv=_kv,
                      stages=_stages,
                      options=(("policy", "pack"), ("schedule_barrier", False),
                               ("wg_skip", True)), **_MGPU_COMMON))
# Mask mode "unit": a unit whose steps are all full runs a K/V loop without masking code, the
# others the per-step cond (both loops in one kernel, chosen per unit by a lax.cond).
for _kv in (128, 64):
    register(Template(name=f"mgpu_q128_kv{_kv}_s2_unit", tile_q=128, tile_kv=_kv, stages=2,
                      options=(("mask_mode", "unit"),), **_MGPU_COMMON))
# Head-major unit order (the planner keeps each head's units together, like attention_mgpu's
# grid, whose last axis is CUDA's fastest), to measure L2 reuse of K/V against the default
# interleaved order; 64-row units load each K/V tile for half the rows, so they need it more.
for _kv in (128, 64):
    register(Template(name=f"mgpu_q128_kv{_kv}_s2_hm", tile_q=128, tile_kv=_kv, stages=2,
                      options=(("unit_order", "head_major"),), **_MGPU_COMMON))
register(Template(name="mgpu_q64x2_kv64_s2_hm", tile_q=64, tile_kv=64, stages=2,
                  options=(("paired", True), ("policy", "pack"), ("unit_order", "head_major")),
                  **_MGPU_COMMON))
# Paired units with ping-pong: the two warpgroups alternate their matrix products and softmax
# as in the tile_q=128 kernel (run 4: ping-pong was worth ~15% on kv64 steps, q128_kv64 490 vs
# q64x2_kv64 424 TFLOP/s on the aligned d=0.5 mask), the shorter unit's warpgroup passing the
# barrier for the longer one's remaining steps.
register(Template(name="mgpu_q64x2pp_kv64_s2_hm", tile_q=64, tile_kv=64, stages=2,
                  options=(("paired", True), ("pair_pingpong", True), ("policy", "pack"),
                           ("unit_order", "head_major")), **_MGPU_COMMON))
del _kv, _stages, _t, _dims


# --- Triton lowering (portable: Ampere/Ada/Hopper): pallas_kernels.triton.forward -------------------
# Pointer loads at any row offset, so no alignment; the head dim is padded to a power of two
# (>= 16) inside the kernel, up to 256. Options: num_warps, mask_mode (triton_fwd.MASK_MODES;
# "cond" when absent, "none" automatically for all-full concrete plans), prefetch (carry the
# next step's kv_start), unit_order (read by the planner).
_TRITON_COMMON = dict(backend="triton", head_dims=tuple(range(1, 257)),
                      dtypes=("bfloat16", "float16", "float32"), min_compute_capability=(8, 0))
# v2 (benchmarks/NOTES.md "Triton kernel v2"). Compiled offline by Triton 3.9 for sm_90 (TTGIR
# + ptxas): a step's K/V address hangs on a scalar load of its kv_start, and the pipeliner then
# issues the K/V copies only after the step's compute (latency exposed; at s3 the index load is
# pipelined but the copies still go out one step late). With ``prefetch`` and s3 they go out a
# full step ahead (3 buffers). SMEM at D=128: 131 KB (kv64), 229,432 of 232,448 bytes (kv128: D <= 128
# only, nothing to spare); 238 / 255 registers, no spills: one CTA of 8 warps per SM.
# Head-major order keeps one head's K/V (16.8 MB at Wan 480p) hot in L2 for the concurrent
# CTAs, like Flex's grid. Registration order is deliberate: benchmarks/kernels.py times the
# first Triton template(s) and checks the first two, so the first four are the v2 run's set
# (two v2 candidates, the interleaved-order control, the v1 baseline).
_TRITON_V2 = dict(_TRITON_COMMON, head_dims=tuple(range(1, 129)))


def _register_v2(name, tile_kv, stages, **opts):
    o = {"num_warps": 8, "prefetch": True, "unit_order": "head_major", **opts}
    register(Template(name=name, tile_q=128, tile_kv=tile_kv, stages=stages,
                      options=tuple(sorted(o.items())), **_TRITON_V2))


_register_v2("triton_q128_kv64_w8_s3_pf_hm", 64, 3)
_register_v2("triton_q128_kv128_w8_s3_pf_hm", 128, 3)
_register_v2("triton_q128_kv64_w8_s3_pf", 64, 3, unit_order="interleaved")
# v1 grid. The first entry is jax's ops/gpu/attention.py dense configuration (128x64, 8 warps,
# 2 stages), measured at 433 TFLOP/s dense on the H200; it is the baseline of the v2 run.
for _tq, _tk, _w, _s in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
                         (64, 64, 4, 3), (64, 128, 4, 2)):
    register(Template(name=f"triton_q{_tq}_kv{_tk}_w{_w}_s{_s}", tile_q=_tq, tile_kv=_tk,
                      stages=_s, options=(("num_warps", _w),), **_TRITON_COMMON))
# More v2 variants (not in the first four): each unit's leading full steps without masking
# code (at L = 32,760 only the last, partial K/V tile of a row needs the mask), head-major
# order alone.
_register_v2("triton_q128_kv64_w8_s3_pf_hm_prefix", 64, 3, mask_mode="prefix")
_register_v2("triton_q128_kv64_w8_s2_hm", 64, 2, prefetch=False)
del _tq, _tk, _w, _s
