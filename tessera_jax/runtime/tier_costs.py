"""The rule of tiered planning (``Options.host_planning="tiered"``): whether a new host mask
runs the device route first, predicted from measured costs of the mask's size, never by
planning both ways.

Tier when the predicted host planning time exceeds the predicted extra time of the device
route over the host plan's run: device planning, the device plan's kernel excess (traced
bounds tile a fixed grid, not the blocks), and the compile of the route's executable when
this process has not compiled it for these shapes. A mask whose device plan would take the
exact XLA path (bitmap steps past the traced capacity) or that no device template takes
never tiers. Inputs cost a count of the blocks' packed bits and NumPy over the bounds. The
host side is scaled by what this process measured of its host plans (``tiered``), so a mask
size the fit misprices (a 40-head Wan 720p DiTFastAttn mask: 2.2 ms predicted, 27 ms on the
H100's host before the planner's compiled loops were ready) tiers once two of its shape's
plans were timed.

Constants per (platform, backend, GPU), from ``benchmarks/tiered.py`` (its ``fit`` section;
benchmarks/NOTES.md#request-path): ``CPU`` measured on the 2-core CPU box, ``H100`` on an
H100 machine; the H200 borrows the H100's until it has a fit. No entry: never tier.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np

from pallas_kernels import abi

from tessera_jax.mask import BlockMask
from tessera_jax.planning import device as _device
from tessera_jax.select import device as select_device
from tessera_jax.validation import AttnShape

__all__ = ["TierCosts", "MaskSize", "CPU", "H100", "H200", "COSTS", "costs_for", "host_gathers",
           "size_of", "predict", "tiers", "base_tiers"]


@dataclasses.dataclass(frozen=True)
class TierCosts:
    """Measured constants of one (platform, backend): ms, and ns per unit.

    host_ms, host_ns_per_block, host_ns_per_selected, host_ns_per_pair: host planning
        (template choice and the planner) of a mask of Hm x nq x nkv blocks, ``selected`` of
        them, covering ``pairs`` (query, key) token pairs over the mask heads (large blocks
        make many steps).
    device_ms, device_ns_per_tile, device_ns_per_bitmap: device planning inside the program,
        per (query head, query tile, key tile) of the device plan and per bitmap step of its
        capacity (traced bounds: what the budget allows).
    kernel_ns_per_interaction: the host plan's kernel per selected (query, key) pair and
        head_dim unit; kernel_excess: the device route's kernel time over the host plan's, - 1.
    compile_ms: the first call of a device-route executable (trace and compile).
    source: where the numbers come from.
    host_ns_per_gather_pair: host planning's extra per selected token pair when the host
        choice is a gathering policy (its plan builds every step's keys chunk by chunk).
    """

    host_ms: float
    host_ns_per_block: float
    host_ns_per_selected: float
    host_ns_per_pair: float
    device_ms: float
    device_ns_per_tile: float
    device_ns_per_bitmap: float
    kernel_ns_per_interaction: float
    kernel_excess: float
    compile_ms: float
    source: str
    host_ns_per_gather_pair: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "source":
                if not isinstance(v, str):
                    raise TypeError(f"source must be a str, got {type(v).__name__}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{f.name} must be a float >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class MaskSize:
    """What the rule reads of a request: blocks (Hm x nq x nkv), selected blocks, estimated
    selected (query, key) token pairs over the mask heads, and over the query heads times
    head_dim; the device plan's tiles (Hq x q tiles x kv tiles) and bitmap capacity; whether
    the host choice gathers (``host_gathers``; False until asked)."""

    blocks: int
    selected: int
    pairs: float
    interactions_d: float
    tiles: int
    bitmaps: int
    gather: bool = False


# CPU box (2 cores, loaded; XLA backend): benchmarks/results/cpu-tiered.json. Host planning:
# its "fit" over 37 masks (11 corpus families x wan480 / hy480 / wan720 and 4 small uniform
# ones, 12 heads; predicted / measured median 1.40x, worst 9.4x: svg2 wan720's 12.6 ms); the
# device planner over 13 (svg2 / vsa / sparge x the same grids and the small ones; median
# 1.46x, at Wan sizes within 1.6x); the kernel and compile terms from its "kernel_fit" at Wan
# 480p (head_dim 8, float32; excess the median of 0.48 / 0.87 / 11.9). Device planning with
# traced bounds costs 0.26-1.9 s at Wan sizes here (two runs) against 0.4-40 ms on the host:
# the rule keeps those on the host; tiny masks with a compiled route are near a tie.
CPU = TierCosts(host_ms=0.383, host_ns_per_block=0.0, host_ns_per_selected=5.62,
                host_ns_per_pair=7.84e-5, device_ms=0.0, device_ns_per_tile=67.7,
                device_ns_per_bitmap=1880.0, kernel_ns_per_interaction=0.962,
                kernel_excess=0.875, compile_ms=7530.0,
                source="CPU box, benchmarks/results/cpu-tiered.json")

# H100 (mosaic_gpu; its host: 16 cores), benchmarks/results/h100-tiered-fit.json (session 31):
# host planning with the H100 table choosing, 22 corpus masks (11 families x Wan 480p / 720p,
# 12 heads) and 4 small uniform ones. The 17 whose choice does not gather: NNLS host_ms +
# ns/selected (median ratio 1.29, worst 4.0 at 1-2 ms); the 8 gathering ones (58 ms-3.5 s):
# the median of their excess per selected pair over that fit (0.02-0.55 ns). Device planning
# of traced bounds over 12 masks (svg2 / vsa / sparge / radial x the two grids and the small
# ones: 0.29-2.6 ms, median ratio 1.29). Kernel excess: the device route's call less its
# plan over the host plan's call, median of six Wan 480p masks (-0.39 to 0.25: 0);
# compile: 16.5 s (h100-tiered-requests.json).
H100 = TierCosts(host_ms=1.105, host_ns_per_block=0.0, host_ns_per_selected=12.38,
                 host_ns_per_pair=0.0, device_ms=0.720, device_ns_per_tile=0.0363,
                 device_ns_per_bitmap=0.714, kernel_ns_per_interaction=1.15e-5,
                 kernel_excess=0.0, compile_ms=16500.0, host_ns_per_gather_pair=0.179,
                 source="H100, benchmarks/results/h100-tiered-fit.json")

# H200: no fit of its own yet; the H100's numbers stand in (the H200's table picks no
# gathering template, so its host plans are the base fit's kind). Replace with the "fit" of
# benchmarks/tiered.py on an H200.
H200 = dataclasses.replace(H100, source="stand-in: the H100 fit (no H200 fit yet)")

#: (platform, backend[, gpu name]) -> constants; the GPU's own entry first, then the
#: platform's; a pair without an entry never tiers.
COSTS = types.MappingProxyType({("cpu", "xla"): CPU, ("gpu", "mosaic_gpu"): H200,
                                ("gpu", "mosaic_gpu", "h100"): H100,
                                ("gpu", "mosaic_gpu", "h200"): H200})


def costs_for(platform: str, backend: str, gpu: str | None = None) -> TierCosts | None:
    """The constants of ``backend`` on ``platform`` (jax's platform name) and device
    (``select.ranking.device_name``: its own entry if measured, else the platform's), or
    None."""
    p = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    return COSTS.get((p, backend, gpu)) or COSTS.get((p, backend))


def host_gathers(mask: BlockMask, shape: AttnShape, backend: str) -> bool:
    """Whether the host plan of this request would gather (its ranking table's choice)."""
    from tessera_jax import select
    choice = select.choose("host", mask, shape, backend)
    return choice is not None and choice[1] == "gather"


def _fine(bounds: np.ndarray, length: int, tile: int) -> tuple[int, int]:
    """(tiles meeting more than ``abi.GRID`` blocks, tiles) of one axis on the fixed grid of
    ``tile`` (what the device plan of traced bounds uses)."""
    b = np.asarray(bounds, np.int32).reshape(1, -1)
    _, _, _, first, last, _, _ = _device._axis(b, length, tile, False)
    return int((last - first + 1 > abi.GRID).sum()), int(first.shape[1])


def size_of(mask: BlockMask, shape: AttnShape, backend: str,
            rule: select_device.DeviceRule = select_device.DEFAULT_RULE,
            bounds_bytes: tuple[bytes, bytes] | None = None,
            selected: int | None = None) -> MaskSize | None:
    """The rule's inputs of a static mask with shared bounds sent to the device route with
    traced bounds; None where that route would not run the kernels (no template, or more tile
    pairs needing bitmap steps than its capacity: the exact path); ``rule``: the route's
    ``Options.device_rule``. A route that gathers (``rule.device_gather``) counts its fixed
    grid's tiles and no bitmap steps, priced by the plain route's fit (no fit of its own; on
    SVG2's clusters, the one family it runs, it ran faster than the plain route:
    benchmarks/NOTES.md#peers). What depends on the bounds and shapes
    only is cached (a fixed grid's masks share it): per mask, one count of its blocks.
    ``bounds_bytes``: the bounds as int64 bytes where the caller has them
    (``tiered.bounds_key``); ``selected``: a count to assume instead of the mask's own
    (``base_tiers``' none and all)."""
    Hm, nq, nk = mask.shape
    if bounds_bytes is None:
        bounds_bytes = tuple(np.asarray(b, np.int64).tobytes()
                             for b in (mask.q_bounds, mask.kv_bounds))
    static = _static_size(*bounds_bytes, Hm, nq, nk, shape, backend, rule)
    if static is None:
        return None
    tiles, cap = static
    if selected is None:
        selected = mask.count_selected()
    pairs = selected * (shape.q_len / nq) * (shape.kv_len / nk)      # mean block sizes
    return MaskSize(blocks=Hm * nq * nk, selected=selected, pairs=pairs,
                    interactions_d=pairs * shape.num_q_heads / Hm * shape.head_dim,
                    tiles=tiles, bitmaps=cap)


@functools.lru_cache(maxsize=256)
def _static_size(q_bounds: bytes, kv_bounds: bytes, Hm: int, nq: int, nk: int,
                 shape: AttnShape, backend: str,
                 rule: select_device.DeviceRule) -> tuple[int, int] | None:
    """(tiles, bitmap capacity) of ``size_of`` from the bounds' bytes, or None."""
    feats = select_device.DeviceFeatures(None, None, (Hm, nq, nk), shape)
    t, cap = select_device.choose_template(feats, backend, None, rule)
    if t is None:
        return None
    fq, nqt = _fine(np.frombuffer(q_bounds, np.int64), shape.q_len, t.tile_q)
    fk, nkt = _fine(np.frombuffer(kv_bounds, np.int64), shape.kv_len, t.tile_kv)
    if select_device.gathers_on_device(t):
        return shape.num_q_heads * nqt * nkt, 0         # gathered steps: no bitmap steps
    need = (fq * nkt + nqt * fk - fq * fk) * Hm
    if need > cap:
        return None
    return shape.num_q_heads * nqt * nkt, int(cap)


def predict(size: MaskSize, costs: TierCosts, compiled: bool,
            host_scale: float = 1.0) -> tuple[float, float]:
    """(host planning ms, the device route's extra ms over the host plan's run);
    ``host_scale``: this process's measured host planning over the fit's (``tiered``)."""
    c = costs
    host = host_scale * (c.host_ms + 1e-6 * (
        c.host_ns_per_block * size.blocks + c.host_ns_per_selected * size.selected
        + (c.host_ns_per_pair + size.gather * c.host_ns_per_gather_pair) * size.pairs))
    device = c.device_ms + 1e-6 * (c.device_ns_per_tile * size.tiles
                                   + c.device_ns_per_bitmap * size.bitmaps
                                   + c.kernel_excess * c.kernel_ns_per_interaction
                                   * size.interactions_d)
    return host, device + (0.0 if compiled else c.compile_ms)


def base_tiers(mask: BlockMask, shape: AttnShape, backend: str,
               rule: select_device.DeviceRule, bounds_bytes: tuple[bytes, bytes] | None,
               costs: TierCosts | None, compiled: bool, host_scale: float = 1.0) -> bool:
    """``tiers(size_of(...), costs, compiled, host_scale)`` (the host choice taken as not
    gathering),
    reading no more of the mask's bits than it takes: both sides of ``predict`` are affine
    in the count of selected blocks, so the sizes with none and with every block selected
    give the count where the answer flips, and the count stops once past it."""
    if costs is None:
        return False
    args = (mask, shape, backend, rule, bounds_bytes)
    none = size_of(*args, selected=0)
    if none is None:
        return False
    lo, hi = (_margin(s, costs, compiled, host_scale) for s in (none, size_of(
        *args, selected=none.blocks)))
    if (lo > 0) == (hi > 0):
        return lo > 0
    flip = -lo / (hi - lo) * none.blocks        # the count where host - device crosses 0
    if hi > lo:                                 # tiers above it
        k = int(np.floor(flip))
        return mask.count_selected(stop_above=k) > k
    k = int(np.ceil(flip)) - 1                  # tiers below it
    return not mask.count_selected(stop_above=k) > k


def _margin(size: MaskSize, costs: TierCosts, compiled: bool, host_scale: float) -> float:
    host, device = predict(size, costs, compiled, host_scale)
    return host - device


def tiers(size: MaskSize | None, costs: TierCosts | None, compiled: bool,
          host_scale: float = 1.0) -> bool:
    """Whether the rule sends the request to the device route first."""
    if size is None or costs is None:
        return False
    host, device = predict(size, costs, compiled, host_scale)
    return host > device
