"""The kernel templates: the compiled configurations a plan can target, in one static table.

A template fixes what a kernel is compiled for (tile shape, pipeline depth, the kernel variant)
and says what it can take (head dims, dtypes, alignment of tile starts). The planner reads
``tile_q``, ``tile_kv``, ``q_align``, ``kv_align`` and ``unit_order`` to build plans a template
can run; the ranking chooses among the templates that ``supports`` a call; the families' ``ops``
compile ``kernel``, a typed, frozen, validated config of the template's backend
(``MosaicConfig``, ``TritonConfig``; None for ``xla``).

The table (``TEMPLATES``) holds only what a ranking table uses or a measurement supports:
the five Mosaic GPU templates of ``plan_tables/h200.json``, the two Triton v2
templates (and one Triton template for head dims 129..256), and the XLA executor's shapes.
``benchmarks/NOTES.md`` records the deleted variants and what each measured.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import numpy as np

__all__ = ["Template", "MosaicConfig", "TritonConfig", "TEMPLATES", "get", "all_templates",
           "for_backend"]

BACKENDS = ("mosaic_gpu", "triton", "xla")
POLICIES = ("keep", "merge", "split", "pack", "auto", "gather", "gather32", "gather64")
UNIT_ORDERS = ("interleaved", "head_major")                 # tessera_jax.planning.schedule's
_DTYPE_NAMES = ("bfloat16", "float16", "float32")
MAX_TILE = 255      # pallas_kernels.abi.MAX_TILE (a rectangle bound is one byte)


def _check_bool(owner: str, name: str, val) -> None:
    if not isinstance(val, (bool, np.bool_)):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(val).__name__} {val!r}")


def _check_int(owner: str, name: str, val, minimum: int = 1) -> None:
    if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
        raise TypeError(f"{owner}.{name} must be an int, got {type(val).__name__} {val!r}")
    if val < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {val}")


def _check_choice(owner: str, name: str, val, choices) -> None:
    if not isinstance(val, str) or val not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {val!r}")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """The variant of the Mosaic GPU kernel (``pallas_kernels.mosaic``) a template compiles.

    schedule_barrier: the consumer warpgroups ping-pong on a schedule barrier (FA3), so one's
        softmax overlaps the other's matrix products. It acts on the two 64-row halves of a
        tile_q=128 unit, and on paired units only with ``pair_pingpong``.
    wg_skip:    a consumer warpgroup skips the matrix products and softmax of a step whose
        rectangle misses its 64 rows (tile_q=128; for ``pack``/``split`` plans that put two
        64-row query blocks in one unit).
    paired:     tile_q=64: one CTA runs two neighbouring units, one per consumer warpgroup, each
        with its own K/V ring.
    pair_pingpong: paired units ping-pong like a tile_q=128 unit's halves (needs ``paired``
        and ``schedule_barrier``).
    mask_mode:  "cond" masks partial steps only (a cond per step; a plan whose steps are all
        full runs mode "none", no masking code, chosen by ``contract``), "always" every step.
    gather:     the producer fills every K/V stage by tile_kv / 8 copies of 8 keys issued from
        its four warps (``abi.GATHER_FLAG`` steps: chunks from the step's words; other steps:
        kv_start + 8 j), so plans may hold gathered steps.
    gather_run: keys one copy loads (a multiple of 8 dividing tile_kv): plans for it hold
        chunks in runs of that many consecutive keys (policies gather / gather32 / gather64).
    step_pairs: the kernel runs a unit's plan steps two at a time: steps 2i and 2i + 1 fill one
        K/V stage of 2 x tile_kv keys (a TMA copy each) and share one S = Q K^T and one P V,
        each half masked by its own step (an odd count leaves the last stage's second half
        masked). A tile_kv=64 plan then runs 128-key matrix products, with no change to the
        plan (tile_kv=64 only: a 256-key stage does not fit shared memory); dq likewise, dk/dv
        runs the transposed plan's kernel unchanged.
    """

    schedule_barrier: bool = True
    wg_skip: bool = False
    paired: bool = False
    pair_pingpong: bool = False
    mask_mode: str = "cond"
    gather: bool = False
    gather_run: int = 8
    step_pairs: bool = False

    MASK_MODES = ("cond", "always")

    def __post_init__(self):
        for name in ("schedule_barrier", "wg_skip", "paired", "pair_pingpong", "gather",
                     "step_pairs"):
            _check_bool("MosaicConfig", name, getattr(self, name))
        _check_choice("MosaicConfig", "mask_mode", self.mask_mode, self.MASK_MODES)
        _check_int("MosaicConfig", "gather_run", self.gather_run, 8)
        if self.gather_run % 8:
            raise ValueError(f"MosaicConfig.gather_run must be a multiple of 8 keys (TMA fills "
                             f"8-row SMEM tiles), got {self.gather_run}")
        if self.pair_pingpong and not (self.paired and self.schedule_barrier):
            raise ValueError("MosaicConfig.pair_pingpong needs paired=True (two units per CTA) "
                             "and schedule_barrier=True")
        if self.wg_skip and self.paired:
            raise ValueError("MosaicConfig.wg_skip needs two warpgroups on one unit; paired "
                             "gives each warpgroup a unit of its own")
        if self.step_pairs and (self.paired or self.wg_skip or self.gather):
            raise ValueError("MosaicConfig.step_pairs runs one 128-row unit's steps two at a "
                             "time: not with paired, wg_skip or gather")

    def row_group(self, tile_q: int) -> int:
        """Rows of a tile the kernel computes as one: a warpgroup's 64 with ``wg_skip`` (it
        skips a step whose rectangle misses them), else the tile."""
        return 64 if self.wg_skip else tile_q

    def check_tiles(self, tile_q: int, tile_kv: int, stages: int) -> None:
        """ValueError unless the kernel variant can be compiled for this tile shape."""
        if tile_q not in (64, 128):
            raise ValueError(f"tile_q must be 128 (two consumer warpgroups of 64 rows) or 64 "
                             f"with paired=True for the Mosaic GPU kernel, got {tile_q}")
        if tile_kv % 64 or not 0 < tile_kv <= MAX_TILE:
            raise ValueError(f"tile_kv must be a positive multiple of 64 up to {MAX_TILE} (the "
                             f"plan ABI packs rectangle bounds in bytes), got {tile_kv}")
        if stages < (1 if self.paired else 2):
            raise ValueError(f"stages must be at least 2 for the Mosaic GPU kernel (1 with "
                             f"paired=True: each unit its own ring), got {stages}")
        if self.wg_skip and tile_q != 128:
            raise ValueError("MosaicConfig.wg_skip needs two consumer warpgroups on one unit "
                             "(tile_q=128): with tile_q=64 every step's rows are the "
                             "warpgroup's rows")
        if self.gather and tile_kv % self.gather_run:
            raise ValueError(f"MosaicConfig.gather_run={self.gather_run} must divide "
                             f"tile_kv={tile_kv}")
        if self.paired and tile_q != 64:
            raise ValueError("MosaicConfig.paired (two 64-row units per CTA) needs tile_q=64")
        if self.step_pairs and tile_kv != 64:
            raise ValueError(f"MosaicConfig.step_pairs needs tile_kv=64 (two steps fill a "
                             f"128-key stage), got {tile_kv}")
        if tile_q == 64 and not self.paired:
            raise ValueError("tile_q=64 needs MosaicConfig.paired=True: the kernel runs two "
                             "consumer warpgroups (the one-warpgroup kernel was deleted)")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """The variant of the Triton-lowering kernel (``pallas_kernels.triton``) a template compiles.

    num_warps: warps per program; None picks 4 for head_dim <= 64, else 8 (like jax's mha).
    prefetch:  the step loop carries the next step's kv_start, so Triton's pipeliner (with
        stages >= 3) issues the K/V copies a full step ahead.
    mask_mode: "cond" masks partial steps only (a plan whose steps are all full runs mode
        "none", chosen by ``contract``), "always" every step.
    gather:    the forward and dq kernels load a gathered step's keys by index
        (``abi.GATHER_FLAG``: its chunks' rows), so plans may hold gathered steps.
    """

    num_warps: int | None = None
    prefetch: bool = False
    mask_mode: str = "cond"
    gather: bool = False

    MASK_MODES = ("cond", "always")
    NUM_WARPS = (1, 2, 4, 8, 16)

    def __post_init__(self):
        if self.num_warps is not None:
            _check_int("TritonConfig", "num_warps", self.num_warps)
            if self.num_warps not in self.NUM_WARPS:
                raise ValueError(f"TritonConfig.num_warps must be None or one of "
                                 f"{self.NUM_WARPS}, got {self.num_warps}")
        _check_bool("TritonConfig", "prefetch", self.prefetch)
        _check_bool("TritonConfig", "gather", self.gather)
        if self.gather and self.prefetch:
            raise ValueError("TritonConfig.gather reads each step's keys in its iteration: "
                             "not with prefetch (which carries a kv_start)")
        _check_choice("TritonConfig", "mask_mode", self.mask_mode, self.MASK_MODES)

    def check_tiles(self, tile_q: int, tile_kv: int, stages: int) -> None:
        """ValueError unless the kernel can be compiled for this tile shape."""
        for name, val in (("tile_q", tile_q), ("tile_kv", tile_kv)):
            if val & (val - 1) or not 16 <= val <= 128:
                raise ValueError(f"{name} must be a power of two in [16, 128] for the Triton "
                                 f"kernel (its dot needs 16, blocks are powers of two), got {val}")
        if not 1 <= stages <= 8:
            raise ValueError(f"stages must be in [1, 8] for the Triton kernel, got {stages}")


_KERNEL_CONFIGS = {"mosaic_gpu": MosaicConfig, "triton": TritonConfig, "xla": type(None)}


@dataclasses.dataclass(frozen=True)
class CompiledConfig:
    """Shared by the backends' compiled kernel configs (``mosaic.kernel.KernelConfig``,
    ``triton.kernel.KernelConfig``): the tile shape, the pipeline depth, the backend's typed
    variant (subclasses set ``VARIANT`` and the field's default) and the mask mode compiled:
    "cond" masks partial steps only (a cond per step), "always" every step, "none" never (for
    plans whose visited steps are all full: no masking code at all)."""

    tile_q: int
    tile_kv: int
    stages: int = 2
    variant: typing.Any = None
    mask_mode: str = "cond"

    VARIANT: typing.ClassVar[type] = object
    MASK_MODES: typing.ClassVar[tuple[str, ...]] = ("cond", "always", "none")

    def __post_init__(self):
        for name in ("tile_q", "tile_kv", "stages"):
            _check_int("KernelConfig", name, getattr(self, name))
        if not isinstance(self.variant, self.VARIANT):
            raise TypeError(f"KernelConfig.variant must be a {self.VARIANT.__name__}, got "
                            f"{type(self.variant).__name__}")
        self.variant.check_tiles(self.tile_q, self.tile_kv, self.stages)
        _check_choice("KernelConfig", "mask_mode", self.mask_mode, self.MASK_MODES)

    @classmethod
    def from_template(cls, t, mask_mode: str | None = None):
        """The config of a Template of this backend; ``mask_mode`` overrides its own (made and
        checked once per template and mode: every eager call asks)."""
        return _config(cls, t, mask_mode or t.kernel.mask_mode)


@functools.lru_cache(maxsize=256)
def _config(cls, t, mask_mode: str):
    return cls(t.tile_q, t.tile_kv, t.stages, t.kernel, mask_mode)


@dataclasses.dataclass(frozen=True)
class Template:
    """One compiled kernel configuration.

    name:        unique key, e.g. "mgpu_q128_kv128_s2_hm"
    backend:     "mosaic_gpu" | "triton" | "xla"
    tile_q:      query rows of one work unit (the plan's tile_q)
    tile_kv:     keys of one step (the plan's tile_kv)
    stages:      K/V pipeline depth (SMEM ring slots for Mosaic GPU, num_stages for Triton)
    head_dims:   head dims the kernel is compiled for (empty: any)
    dtypes:      input dtype names ("bfloat16", "float16", "float32")
    q_align:     every unit's q_start must be a multiple of this
    kv_align:    every step's kv_start must be a multiple of this
    min_compute_capability: lowest (major, minor) GPU it runs on; (0, 0) for any
    policy:      the plan policy the template is meant for (benchmarks plan with it)
    unit_order:  the order the planner gives the units: "interleaved" | "head_major"
    kernel:      the backend's kernel config (``MosaicConfig`` / ``TritonConfig``; None for
                 "xla"); None for a GPU backend means that backend's default config
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
    policy: str = "merge"
    unit_order: str = "interleaved"
    kernel: MosaicConfig | TritonConfig | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Template.name must be a non-empty str, got {self.name!r}")
        _check_choice("Template", "backend", self.backend, BACKENDS)
        for name in ("tile_q", "tile_kv", "stages", "q_align", "kv_align"):
            _check_int("Template", name, getattr(self, name))
        for name in ("tile_q", "tile_kv"):
            if getattr(self, name) > MAX_TILE:
                raise ValueError(f"Template.{name} must be <= {MAX_TILE} (the plan ABI packs "
                                 f"rectangle bounds in bytes), got {getattr(self, name)}")
        if not isinstance(self.head_dims, tuple) or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.head_dims):
            raise ValueError(f"Template.head_dims must be a tuple of positive ints (empty: any), "
                             f"got {self.head_dims!r}")
        if not isinstance(self.dtypes, tuple) or not self.dtypes or any(
                d not in _DTYPE_NAMES for d in self.dtypes):
            raise ValueError(f"Template.dtypes must be a non-empty tuple of {_DTYPE_NAMES}, "
                             f"got {self.dtypes!r}")
        cc = self.min_compute_capability
        if not (isinstance(cc, tuple) and len(cc) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)):
            raise ValueError(f"Template.min_compute_capability must be a (major, minor) tuple "
                             f"of ints, got {cc!r}")
        _check_choice("Template", "policy", self.policy, POLICIES)
        _check_choice("Template", "unit_order", self.unit_order, UNIT_ORDERS)
        want = _KERNEL_CONFIGS[self.backend]
        if self.kernel is None and want is not type(None):
            object.__setattr__(self, "kernel", want())
        if not isinstance(self.kernel, want):
            raise TypeError(f"Template.kernel of a {self.backend!r} template must be "
                            f"{'None' if want is type(None) else want.__name__}, got "
                            f"{type(self.kernel).__name__}")
        if self.kernel is not None:
            try:
                self.kernel.check_tiles(self.tile_q, self.tile_kv, self.stages)
            except ValueError as e:
                raise ValueError(f"template {self.name!r}: {e}") from None
        if self.backend == "mosaic_gpu" and (self.q_align % 8 or self.kv_align % 8):
            raise ValueError(f"Template.q_align / kv_align of a mosaic_gpu template must be "
                             f"multiples of 8 (TMA fills 8-row SMEM tiles), got "
                             f"{self.q_align} / {self.kv_align}")

    @property
    def row_group(self) -> int:
        """Rows of a tile the kernel computes as one (``planner.build_plan(row_group=)``)."""
        group = getattr(self.kernel, "row_group", None)
        return group(self.tile_q) if group is not None else self.tile_q

    def supports(self, head_dim: int, dtype) -> bool:
        """Whether this template can run a call with this head dim and dtype."""
        return ((not self.head_dims or int(head_dim) in self.head_dims)
                and _dtype_name(dtype) in self.dtypes)


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype) -> str:
    """The dtype's name (memoised: jnp.dtype costs microseconds on every request)."""
    try:
        import jax.numpy as jnp  # bfloat16 lives in ml_dtypes; jnp.dtype knows it
        return jnp.dtype(dtype).name
    except Exception:  # pragma: no cover
        return np.dtype(dtype).name


# --- Mosaic GPU (Hopper, sm_90a): pallas_kernels.mosaic ------------------------------------
# tile_q 128: two consumer warpgroups of 64 rows each (FA3 ping-pong). SMEM per CTA is
# 2*tile_q*D (Q/O) + stages * 2 * tile_kv * D * 2 (K, V ring).
# q_align = kv_align = 8: TMA writes the (8, 64)-tiled, 128B-swizzled SMEM layout that wgmma
# reads by viewing GMEM as [L/8, D/64, 8, 64] tiles; a start that is not a multiple of 8 would
# reach past a tile's 8 rows and read zeros (the interpreter, which ignores layouts, can't see it).
# Head-major unit order (the planner keeps each head's units together, like attention_mgpu's
# grid) keeps one head's K/V hot in L2 for the concurrent CTAs.
_MGPU = dict(backend="mosaic_gpu", stages=2, head_dims=(64, 128), dtypes=("bfloat16", "float16"),
             q_align=8, kv_align=8, min_compute_capability=(9, 0))
_MOSAIC = (
    Template("mgpu_q128_kv128_s2_hm", tile_q=128, tile_kv=128, unit_order="head_major",
             kernel=MosaicConfig(), **_MGPU),
    Template("mgpu_q128_kv64_s2_hm", tile_q=128, tile_kv=64, unit_order="head_major",
             kernel=MosaicConfig(), **_MGPU),
    # The same plans (64-key steps) run two steps a stage: 128-key matrix products (full steps
    # 0.97 of cuDNN's rate at kv128 against ~0.80 at kv64 on the H200) for K/V blocks of 64
    # tokens, which 128-key tiles would straddle. Not yet timed on a GPU
    # (benchmarks/NOTES.md#kernel-steps, step pairs).
    Template("mgpu_q128_kv64x2_s2_hm", tile_q=128, tile_kv=64, unit_order="head_major",
             kernel=MosaicConfig(step_pairs=True), **_MGPU),
    # Paired tile_q 64: one CTA of the tile_q=128 shape (two consumer WGs, register split) runs
    # two neighbouring 64-row units at once, each warpgroup its own unit with its own K/V ring
    # (~164 KB of SMEM at D=128). Planned with ``pack`` (partial edge cubes share a unit).
    # The schedule barrier acts on paired units only with pair_pingpong: not here.
    Template("mgpu_q64x2_kv64_s2_hm", tile_q=64, tile_kv=64, policy="pack",
             unit_order="head_major", kernel=MosaicConfig(paired=True), **_MGPU),
    # Warpgroup step skipping for ``pack`` plans (two 64-row query blocks in one 128-row unit,
    # one rectangle per step): no ping-pong, so the two warpgroups may drift up to ``stages``
    # steps apart and one computes while the other skips.
    Template("mgpu_q128_kv64_s2_skip", tile_q=128, tile_kv=64, policy="pack",
             kernel=MosaicConfig(schedule_barrier=False, wg_skip=True), **_MGPU),
    # Paired units with ping-pong: the two warpgroups alternate their matrix products and
    # softmax as in the tile_q=128 kernel, the shorter unit's warpgroup passing the barrier for
    # the longer one's remaining steps.
    Template("mgpu_q64x2pp_kv64_s2_hm", tile_q=64, tile_kv=64, policy="pack",
             unit_order="head_major", kernel=MosaicConfig(paired=True, pair_pingpong=True),
             **_MGPU),
    # Gathered K/V stages (16 copies of 8 keys from the producer's four warps: 0.926 of the
    # one-copy step, benchmarks/NOTES.md#gathered-steps) for ``gather`` plans.
    Template("mgpu_q128_kv128_s2_gather", tile_q=128, tile_kv=128, policy="gather",
             unit_order="head_major", kernel=MosaicConfig(gather=True), **_MGPU),
    # The same with warpgroup step skipping, without the ping-pong barrier: a gathered step
    # of a class whose rows lie in one 64-row half runs on that half's warpgroup only, the
    # halves' steps interleaved (Wan 480p computed / selected, 128-row steps -> 64-row groups
    # met: clusters 1.442 -> 1.300, cubes 2.005 -> 1.203, sliding 1.321 -> 1.069). Measured
    # against gather: clusters 0.98x, cubes 1.20x, sliding 1.06x; below the default plan on
    # all three (benchmarks/NOTES.md#gathered-steps): a table candidate.
    Template("mgpu_q128_kv128_s2_gather_skip_nopp", tile_q=128, tile_kv=128, policy="gather",
             unit_order="head_major",
             kernel=MosaicConfig(gather=True, wg_skip=True, schedule_barrier=False), **_MGPU),
)

# --- Triton lowering (portable: Ampere/Ada/Hopper): pallas_kernels.triton -----------------
# Pointer loads at any row offset, so no alignment; the head dim is padded to a power of two
# (>= 16) inside the kernel, up to 256.
# v2 (benchmarks/NOTES.md#triton-kernel): with ``prefetch`` and 3 stages Triton 3.9's
# pipeliner issues a step's K/V copies a full step ahead. SMEM at D=128: 131 KB (kv64),
# 229,432 of 232,448 bytes (kv128), so D <= 128 only; 238 / 255 registers, no spills: one CTA
# of 8 warps per SM. Head-major order keeps one head's K/V hot in L2, like Flex's grid. Order
# is deliberate: benchmarks/kernels.py times the first Triton template(s) and checks the
# first two.
_TRITON = dict(backend="triton", dtypes=("bfloat16", "float16", "float32"),
               min_compute_capability=(8, 0))
_TRITON_V2 = dict(_TRITON, stages=3, head_dims=tuple(range(1, 129)), unit_order="head_major",
                  kernel=TritonConfig(num_warps=8, prefetch=True))
_TRITON_TEMPLATES = (
    Template("triton_q128_kv64_w8_s3_pf_hm", tile_q=128, tile_kv=64, **_TRITON_V2),
    Template("triton_q128_kv128_w8_s3_pf_hm", tile_q=128, tile_kv=128, **_TRITON_V2),
    # Kept for capability, not speed: the v2 templates take D <= 128 only, this one the head
    # dims 129..256 (v1 grid, 4 warps, 2 stages: small tiles leave registers for D = 256).
    Template("triton_q64_kv64_w4_s2", tile_q=64, tile_kv=64, stages=2,
             head_dims=tuple(range(129, 257)), kernel=TritonConfig(num_warps=4), **_TRITON),
    # Gathered steps by index (``gather`` plans; keys read per step, so no prefetch).
    Template("triton_q128_kv128_w8_s3_gather", tile_q=128, tile_kv=128, policy="gather",
             **dict(_TRITON_V2, kernel=TritonConfig(num_warps=8, gather=True))),
)

# --- XLA executor (plain JAX: CPU/TPU, the fallback): pallas_kernels.xla.executor ---------
# The mixed shapes are kept because the CPU tests plan with them (tests/test_api.py,
# test_viz.py, test_planner.py, test_selection.py: xla_64x128 / xla_128x64), and the planner
# names a plan without a template ``xla_{tile_q}x{tile_kv}``.
_XLA = tuple(Template(f"xla_{tq}x{tk}", "xla", tq, tk, stages=1, head_dims=(),
                      dtypes=("float32", "bfloat16", "float16"))
             for tq, tk in ((64, 64), (128, 128), (64, 128), (128, 64)))

TEMPLATES: tuple[Template, ...] = _MOSAIC + _TRITON_TEMPLATES + _XLA

# By name, in table order. Tests may add a stand-in (monkeypatch.setitem); nothing else writes it.
_REGISTRY: dict[str, Template] = {t.name: t for t in TEMPLATES}
assert len(_REGISTRY) == len(TEMPLATES), "template names must be unique"


def get(name) -> Template:
    """The template of this name (a Template passes through); ValueError naming the known
    ones otherwise."""
    if isinstance(name, Template):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown template {name!r}; known: {sorted(_REGISTRY)}") from None


def all_templates() -> tuple[Template, ...]:
    return tuple(_REGISTRY.values())


def for_backend(backend: str) -> tuple[Template, ...]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return tuple(t for t in _REGISTRY.values() if t.backend == backend)
