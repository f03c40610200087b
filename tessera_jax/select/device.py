"""The device route's template choice: a static rule over what a call site knows when tracing.

A device-route call (a device mask, or per-head bounds) is planned inside the compiled program,
so its template is chosen once per call site from *static features* (``DeviceFeatures``): the
shapes, the block counts, and the block bounds where they are NumPy (their block sizes, and the
tiles that meet more than ``abi.GRID`` blocks). The rule: the first template of the backend's
list in ``DEVICE_TEMPLATES`` that takes the call and whose plan needs no bitmap steps for the
static bounds, else the first whose bitmap steps fit ``bitmap_budget_bytes`` (traced bounds:
the first; static bounds that fit no template's budget: the fewest worst-case bytes, its fit
decided on the device); static K/V blocks of <= 64 tokens (median) try 64-key tiles first,
static query blocks of <= 64 tokens 64-row units (q64x2: two per CTA); static bounds of
larger blocks try the templates in order of ``price`` (the computed area their tiles would
take at a nominal density, times ``STEP_COST``: blocks of 96, 96, 64 tokens, whose 128-token
tiles meet two, take q64x2); traced bounds (per-head bounds of a content-dependent method),
whose sizes are unknown when tracing, try both when the mean key block (length / count) is
<= 64 tokens, and 64-key tiles (with 64-row units where the mean query block is as small)
up to ``TRACED_SMALL_MEAN`` (96) tokens. Why a rule and not the ranking table
(which the host route reads, ``select.ranking``): the table reads mask features the host does
not have under a trace, a ``lax.switch`` over ranked templates would compile every template
into every call site, and the device planner has one policy (a step per selected tile), for
which q128 x kv128 steps run fastest on the H200 (full steps 0.97 of cuDNN's rate against
0.79-0.81 at kv64, masked ones 0.69-0.85 against 0.52-0.66: ``benchmarks/NOTES.md`` section
13). ``select.choose`` is the one entry point of both routes. ``Options.device_gather`` may
send traced bounds, or static irregular key blocks, to the backend's gathering template
instead (``GATHER_TEMPLATES``, planned by ``planning.device_gather``).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import numpy as np

from pallas_kernels import abi
from pallas_kernels import templates as _templates
from pallas_kernels.templates import Template

from tessera_jax.mask import BlockMask
from tessera_jax.planning import device as _device
from tessera_jax.validation import AttnShape

__all__ = ["DEVICE_TEMPLATES", "DEVICE_CANDIDATES", "GATHER_TEMPLATES", "DEVICE_GATHER",
           "BITMAP_BUDGET_BYTES", "STEP_COST", "TRACED_SMALL_MEAN", "PRICE_DENSITY", "price",
           "Const", "DeviceFeatures", "static_parts", "device_capable", "bitmap_pairs",
           "capacity", "decided_on_device", "irregular_kv", "small_blocks", "DeviceRule",
           "DEFAULT_RULE", "choose_template", "choose"]

#: Per backend, the templates a device plan may run, in order of preference (see the module
#: docstring). q64x2 runs neighbouring 64-row units of the device plan in one CTA, one per
#: consumer warpgroup (units heaviest first, so a CTA's two units cost about the same).
DEVICE_TEMPLATES = types.MappingProxyType({
    "mosaic_gpu": ("mgpu_q128_kv128_s2_hm", "mgpu_q128_kv64_s2_hm", "mgpu_q64x2_kv64_s2_hm"),
    "triton": ("triton_q128_kv128_w8_s3_pf_hm", "triton_q128_kv64_w8_s3_pf_hm",
               "triton_q64_kv64_w4_s2"),
    "xla": ("xla_64x64", "xla_128x128", "xla_64x128", "xla_128x64"),
})

#: Per backend, templates a device plan may run when a caller names them but the rule does not
#: choose yet (not timed on a GPU against the device list): ``peers.py --device-alt`` times
#: them beside it. The step-pairs kernel runs the q128 x kv64 device plan two steps a stage.
DEVICE_CANDIDATES = types.MappingProxyType({
    "mosaic_gpu": ("mgpu_q128_kv64x2_s2_hm",),
})

#: Per backend, its gathering template (``planning.device_gather`` plans it on the device: 8-key
#: chunks from anywhere, any block sizes), which ``device_gather`` may choose instead of the
#: device list's (``choose_template``).
GATHER_TEMPLATES = types.MappingProxyType({
    "mosaic_gpu": "mgpu_q128_kv128_s2_gather_skip_nopp",
    "triton": "triton_q128_kv128_w8_s3_gather",
})

#: Time per computed tile area of each device-list template on the device plan's steps,
#: relative to q128 x kv128 (H100, ``peers.py --device-alt``: every template on the same
#: natten, moba and svg2 masks at Wan 480p; kernel time over computed / selected: kv64
#: 1.13-1.21, q64x2 x kv64 1.19-1.29; ``benchmarks/NOTES.md``, device rule per mask). The
#: static-bounds rule orders templates by ``price``; templates missing here keep the
#: block-size order.
STEP_COST = types.MappingProxyType({
    "mgpu_q128_kv128_s2_hm": 1.0, "mgpu_q128_kv64_s2_hm": 1.17, "mgpu_q64x2_kv64_s2_hm": 1.26,
})

#: Selection density at which ``price`` counts the tiles a plan visits. 0.5: moba's and
#: ssta's bounds (blocks of 72-384 tokens) run q128 x kv128 best at density 0.29 and 0.61
#: alike, and lower densities would send them to q64x2 (2-12% slower there); natten's
#: (24-128 tokens) run q64x2 1.30x faster than kv128, which the price at 0.5 still picks.
PRICE_DENSITY = 0.5

#: ``Options.device_gather``'s values (``choose_template``).
DEVICE_GATHER = ("auto", "never", "traced", "irregular")

#: Distinct key-block sizes (in a head) past which static bounds count as irregular.
IRREGULAR_KV_SIZES = 8

#: Default bytes of bitmap steps a device plan may hold (tiles meeting more than ``abi.GRID``
#: blocks per axis: 2 KB each at 128 x 128); where a mask may need more, its plan gets this
#: much room and takes the exact path when the selection overflows it (decided on the device).
BITMAP_BUDGET_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class DeviceRule:
    """What a device-route template choice reads besides the call site's features:
    ``Options``' fields of the same names, as one validated, hashable value
    (``Options.device_rule``, which is also how ``Options`` validates them), so every caller
    passes all three and the choice's memo keys hold them."""

    bitmap_budget_bytes: int = BITMAP_BUDGET_BYTES
    device_gather: str = "auto"
    traced_small_blocks: bool | None = None

    def __post_init__(self):
        b = self.bitmap_budget_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"bitmap_budget_bytes must be an int >= 0, got {b!r}")
        if not isinstance(self.device_gather, str) or self.device_gather not in DEVICE_GATHER:
            raise ValueError(f"device_gather must be one of {DEVICE_GATHER}, got "
                             f"{self.device_gather!r}")
        t = self.traced_small_blocks
        if t is not None and not isinstance(t, bool):
            raise TypeError(f"traced_small_blocks must be a bool or None, got "
                            f"{type(t).__name__}")


#: The rule of ``Options()``.
DEFAULT_RULE = DeviceRule()


class Const:
    """A NumPy array as a hashable static argument, compared by ``key`` (its content by
    default; a static mask's digest where it has one)."""

    __slots__ = ("array", "_key")

    def __init__(self, array: np.ndarray, key=None):
        self.array = array
        self._key = key if key is not None else (array.shape, array.dtype.str, array.tobytes())

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, Const) and other._key == self._key


@dataclasses.dataclass(frozen=True)
class DeviceFeatures:
    """What a device-route call site knows when tracing: the block bounds where they are
    static (``Const``; None: traced), the block counts [Hm, nq, nkv] and the call's shape."""

    q_bounds: Const | None
    kv_bounds: Const | None
    block_shape: tuple
    shape: AttnShape

    @classmethod
    def of(cls, mask: BlockMask, shape: AttnShape) -> "DeviceFeatures":
        """The features of ``mask`` (its static bounds, ``static_parts``)."""
        qb, kb, _ = static_parts(mask)
        return cls(qb, kb, tuple(mask.blocks.shape), shape)


def static_parts(mask: BlockMask) -> tuple:
    """(q_bounds, kv_bounds, blocks) of ``mask`` as ``Const``s where they are NumPy (None for a
    jax array), keyed by the mask's digest when it is static (no hashing of its arrays per
    call). A device mask's NumPy blocks are not made static (they would be hashed every call):
    they go into the program as an operand."""
    parts = (mask.q_bounds, mask.kv_bounds, mask.blocks)
    if mask.is_static:
        return tuple(Const(np.asarray(x), (mask.digest, i)) for i, x in enumerate(parts))
    return tuple(Const(np.asarray(x)) if i < 2 and not isinstance(x, jax.Array) else None
                 for i, x in enumerate(parts))


@functools.lru_cache(maxsize=512)
def _tile_blocks(bounds: Const, length: int, tile: int) -> np.ndarray:
    """Blocks each of the device plan's tiles meets, per bounds row [Hb, nt] (0: a padding
    tile owning nothing), for static bounds. Memoised (a function of the bounds alone: the
    rule asks it again on every call whose choice was cleared)."""
    b = np.asarray(bounds.array, np.int32).reshape(-1, bounds.array.shape[-1])
    org, _, _, first, last, _, _ = _device._axis(b, length, tile, True)
    return np.broadcast_to(np.maximum(last - first + 1, 0), (b.shape[0], org.shape[1]))


def _fine_tiles(bounds: Const | None, n: int, length: int, tile: int):
    """Per bounds row, how many of the device plan's tiles meet more than ``abi.GRID`` blocks
    (static bounds), or a bound from the block count (traced bounds: a tile meeting more than
    GRID blocks holds GRID of the n - 1 inner bounds); and the tile count."""
    if bounds is None:
        nt = _device.traced_slots(length, tile)
        return np.array([min(nt, (n - 1) // abi.GRID)]), nt
    nb = _tile_blocks(bounds, length, tile)
    return (nb > abi.GRID).sum(axis=1), nb.shape[1]


def price(qb: Const, kb: Const, shape: AttnShape, t: Template,
          density: float = PRICE_DENSITY) -> float | None:
    """The rule's price of ``t``'s device plan on static bounds: its expected computed tile
    area over the selected area when each block is selected independently with ``density``
    (a tile pair meeting n blocks is visited with probability 1 - (1 - density)^n), times
    ``STEP_COST``; None where ``t`` has no step cost. A bounds-only proxy: the selection is
    traced. Counted by the blocks a tile meets, so O(tiles + GRID^2) per bounds row."""
    cost = STEP_COST.get(t.name)
    if cost is None:
        return None
    return cost * _waste(qb, kb, shape.q_len, shape.kv_len, t.tile_q, t.tile_kv, density)


@functools.lru_cache(maxsize=512)
def _waste(qb: Const, kb: Const, q_len: int, kv_len: int, tile_q: int, tile_kv: int,
           density: float) -> float:
    """``price`` without the step cost (memoised: a function of the bounds and tiles)."""
    nq = _tile_blocks(qb, q_len, tile_q)
    nk = _tile_blocks(kb, kv_len, tile_kv)
    rows = max(nq.shape[0], nk.shape[0])
    nq = np.broadcast_to(nq, (rows, nq.shape[1]))
    nk = np.broadcast_to(nk, (rows, nk.shape[1]))
    top = int(max(nq.max(), nk.max())) + 1
    n = np.arange(top)
    visit = _device.visit_probability(np.outer(n, n), density)  # [a, b] blocks met per axis
    pairs = sum(np.bincount(a, minlength=top) @ visit @ np.bincount(c, minlength=top)
                for a, c in zip(nq, nk))
    return float(pairs * tile_q * tile_kv / (density * q_len * kv_len * rows))


def bitmap_step_bytes(t) -> int:
    """Bytes of one bitmap step's words in a plan of ``t``'s tiles (2 KB at 128 x 128)."""
    return abi.bitmap_rows(t.tile_q, t.tile_kv) * abi.STEP_COLS * 4


@functools.lru_cache(maxsize=512)
def bitmap_pairs(qb: Const | None, kb: Const | None, shape_blocks: tuple, shape: AttnShape,
                 t: Template) -> int:
    """Tile pairs of ``t``'s device plan that may take a bitmap step, whatever the selection:
    for static bounds every (head, q tile, kv tile) with a tile meeting more than
    ``abi.GRID`` blocks, for traced bounds a bound from the block counts. Memoised: the
    route asks it again on every call (``decided_on_device``), and it tiles static bounds."""
    Hm, nq, nk = shape_blocks
    fq, nqt = _fine_tiles(qb, nq, shape.q_len, t.tile_q)
    fk, nkt = _fine_tiles(kb, nk, shape.kv_len, t.tile_kv)
    per_row = fq * nkt + nqt * fk - fq * fk
    return int(per_row.sum() if len(per_row) == Hm else per_row.max() * Hm)


def capacity(qb: Const | None, kb: Const | None, shape_blocks, shape: AttnShape, t: Template,
             bitmap_budget_bytes: int = BITMAP_BUDGET_BYTES) -> int | None:
    """Bitmap steps the device plan of ``t`` gets room for (0: it needs none): every pair
    that may take one (``bitmap_pairs``) where the budget holds them, else what the budget
    allows, the plan's ``ok`` deciding on the device whether the selection fitted
    (``decided_on_device``). None: static bounds that need bitmap steps and a budget of less
    than one (the exact path runs); traced bounds get at least one."""
    pairs = bitmap_pairs(qb, kb, shape_blocks, shape, t)
    if not pairs:
        return 0
    room = bitmap_budget_bytes // bitmap_step_bytes(t)
    if qb is not None and kb is not None:
        return min(pairs, room) if room else None
    return max(1, min(pairs, room))


def decided_on_device(qb: Const | None, kb: Const | None, shape_blocks, shape: AttnShape,
                      t: Template, cap: int) -> bool:
    """Whether a device plan of ``t`` with room for ``cap`` bitmap steps decides its fit on
    the device (``ok``): traced bounds, or static ones whose pairs that may take a bitmap step
    outnumber the room (a sparse selection still fits: variable clusters at Wan 720p need 0.4
    of their 1.03 GB worst case at q64x2 x kv64)."""
    if qb is None or kb is None:
        return True
    return bool(cap) and bitmap_pairs(qb, kb, shape_blocks, shape, t) > cap


def gathers_on_device(t: Template) -> bool:
    """Whether a device plan of ``t`` is the gather policy's (``planning.device_gather``:
    gathered steps of 8-key chunks, no bitmap steps)."""
    from pallas_kernels import contract
    return t.policy == "gather" and contract.gathers(t) == abi.GATHER_ROWS


def device_capable(t: Template) -> bool:
    """Whether a device plan may run ``t`` (one of the device list, or not query-paired)."""
    return t.name in DEVICE_TEMPLATES[t.backend] or not getattr(t.kernel, "paired", False)


def small_blocks(bounds, tokens: int = 64) -> bool:
    """Whether NumPy bounds' ([n + 1] or per head [Hm, n + 1]) median block, over every row,
    is <= ``tokens``."""
    return float(np.median(np.diff(np.asarray(bounds), axis=-1))) <= tokens


@functools.lru_cache(maxsize=512)
def _small(b: Const | None) -> bool:
    """``small_blocks`` of static bounds (traced ones: False)."""
    return b is not None and small_blocks(b.array)


#: Mean key block (tokens) up to which traced bounds take 64-key tiles first, and 64-row
#: units where their mean query block is no larger (``_traced_order``); at <= 64 tokens, both
#: whatever the query blocks. SVG2's clusters (median 29-33 keys, a few long clusters)
#: average 66 keys at Wan 480p and 76 at Wan 720p, where q128 x kv128 ran 8.12 ms against
#: q64x2 x kv64's 6.33 (480p, query mean 82) and, at 720p, its greedy 128-token tiles
#: overflow the traced slots into more bitmap steps than the budget holds: the exact path,
#: 5,569 ms against q128 x kv64's 28.38 and q64x2's 28.97 (query mean 189; H100, 12 heads,
#: results/h100-svg2-traced-alt.json, h100-svg2-720-traced.json). The traced masks measured
#: with 128-row, 128-key tiles average 120-128 tokens (frames, aligned).
TRACED_SMALL_MEAN = 96


def _traced_order(q_len: int, nq: int, kv_len: int, nk: int) -> tuple[bool, bool]:
    """(64-row units first, 64-key tiles first) for traced bounds of ``nq`` / ``nk`` blocks:
    a mean key block of <= 64 tokens takes both (cubes, clusters of ~41 keys whose 128-row
    units would need twice the bitmap steps); up to ``TRACED_SMALL_MEAN`` it takes 64-key
    tiles, and 64-row units where the mean query block is also within it."""
    sk = kv_len <= TRACED_SMALL_MEAN * nk
    return kv_len <= 64 * nk or (sk and q_len <= TRACED_SMALL_MEAN * nq), sk


def irregular_kv(kv_bounds) -> bool:
    """Whether NumPy key bounds ([n + 1] or per head [Hm, n + 1]) have more than
    ``IRREGULAR_KV_SIZES`` distinct block sizes in a head (clusters, not a grid of cubes or
    frames)."""
    sizes = np.diff(np.asarray(kv_bounds).reshape(-1, np.shape(kv_bounds)[-1]), axis=-1)
    return any(len(np.unique(row)) > IRREGULAR_KV_SIZES for row in sizes)


@functools.lru_cache(maxsize=512)
def _irregular_kv(b: Const | None) -> bool:
    """``irregular_kv`` of static key bounds (traced ones: False)."""
    return b is not None and irregular_kv(b.array)


def _gathers(f: DeviceFeatures, device_gather: str) -> bool:
    """Whether ``device_gather`` sends this call site to the backend's gathering template."""
    traced = f.q_bounds is None or f.kv_bounds is None
    if device_gather == "traced":
        return traced
    if device_gather == "irregular":
        return traced or _irregular_kv(f.kv_bounds)
    # "auto" here is "never": static bounds take the device list by price (H100, Wan 480p
    # svg2: q64x2 x kv64 on fitted tiles 5.78 ms against the gathering template's 6.85);
    # a tiered call's traced irregular bounds gather ("traced", tiered.route_options).
    return False


@functools.lru_cache(maxsize=512)
def choose_template(features: DeviceFeatures, backend: str, template: Template | None = None,
                    rule: DeviceRule = DEFAULT_RULE) -> tuple[Template | None, int]:
    """(template, bitmap capacity) of a device-route call by the static rule (module
    docstring); (None, 0): the exact path. ``template``: the caller's (its capacity only).
    ``rule.device_gather`` (``Options.device_gather``): "traced" runs the backend's gathering
    template (``GATHER_TEMPLATES``) where a bound is traced (per-head bounds of a
    content-dependent method), "irregular" also where static key blocks are irregular
    (``_irregular_kv``); "auto" and "never" keep the device list (a tiered call turns "auto"
    into "traced" for irregular host key bounds, ``runtime.tiered.route_options``).
    ``rule.traced_small_blocks``: traced bounds' template order, None: by the mean blocks
    (``_traced_order``)."""
    if not isinstance(rule, DeviceRule):
        raise TypeError(f"rule must be a select.device.DeviceRule, got {type(rule).__name__}")
    f = features
    budget = rule.bitmap_budget_bytes
    if template is not None:
        if gathers_on_device(template):
            return template, 0       # gathered steps: no bitmap steps, any valid bounds
        cap = capacity(f.q_bounds, f.kv_bounds, f.block_shape, f.shape, template, budget)
        return (template, cap) if cap is not None else (None, 0)
    g = GATHER_TEMPLATES.get(backend)
    if g is not None and _gathers(f, rule.device_gather):
        t = _templates.get(g)
        if t.supports(f.shape.head_dim, f.shape.dtype):
            return t, 0              # gathered steps: no bitmap steps in the forward plan
    # K/V blocks of <= 64 tokens: a 128-key tile would hold two, and a sparse per-head
    # selection keeps one of them most of the time (a masked step at 0.67 of cuDNN's rate
    # for half the keys, against a full 64-key step at 0.80): 64-key tiles first. Query blocks
    # of <= 64 tokens likewise: 64-row units (VSA's cubes at Wan 720p: the host's q64x2 plan
    # ran 76.7 ms against 111.8 for the device's q128 x kv64 one). Otherwise 128-row units.
    sq, sk = _small(f.q_bounds), _small(f.kv_bounds)
    if f.q_bounds is None and f.kv_bounds is None:
        # Traced bounds hide the block sizes but not their count: the mean blocks decide
        # (``_traced_order``). A mean key block of <= 64 tokens takes the small-block order,
        # 64-row units included (Wan 480p cubes with per-head bounds: q64x2 x kv64 5.35 ms
        # against 7.25 for q128 x kv128, results/h200-perhead-diag.json; clusters, q mean
        # ~126 x kv ~41: q64x2 x kv64 is the host's and static bounds' choice, and its bitmap
        # steps are half q128 x kv64's: at Wan 720p 359 MB against 531 MB and 1.4 GB at q128 x
        # kv128, past the 512 MB budget, where the exact path ran, 4.5 s against 28 ms,
        # results/h200-gather.json); means over 96 keep 128-row, 128-key tiles (aligned
        # blocks: 2.58 against 4.76 for q64x2).
        sq, sk = (_traced_order(f.shape.q_len, f.block_shape[1], f.shape.kv_len,
                                f.block_shape[2]) if rule.traced_small_blocks is None
                  else (rule.traced_small_blocks,) * 2)
    ts = sorted((_templates.get(n) for n in DEVICE_TEMPLATES[backend]),
                key=lambda t: (sq != (t.tile_q <= 64), sk != (t.tile_kv <= 64)))
    if f.q_bounds is not None and f.kv_bounds is not None and not (sq or sk):
        # Static bounds of blocks over 64 tokens (median): the expected computed area at
        # PRICE_DENSITY, times each template's step cost (natten's mixed 24-128-token
        # blocks: kv128 tiles meet 2-4 of them, and q64x2 x kv64 ran 4.03 ms against 5.22,
        # H100). Smaller blocks keep the block-size order: at a sparse selection (svg2's
        # clusters, density 0.1) the price at 0.5 would take kv128 and its bitmap steps.
        prices = [price(f.q_bounds, f.kv_bounds, f.shape, t) for t in ts]
        if all(p is not None for p in prices):
            ts = [t for _, _, t in sorted(zip(prices, range(len(ts)), ts))]
    fitting, over = [], []
    for t in ts:
        if t.supports(f.shape.head_dim, f.shape.dtype):
            cap = capacity(f.q_bounds, f.kv_bounds, f.block_shape, f.shape, t, budget)
            if cap == 0:
                return t, 0                  # no bitmap steps: the first such template
            if cap is None:
                continue
            if f.q_bounds is not None and f.kv_bounds is not None and decided_on_device(
                    f.q_bounds, f.kv_bounds, f.block_shape, f.shape, t, cap):
                # Static bounds past the budget: the fewest worst-case bytes is likeliest
                # to fit (decided on the device).
                worst = bitmap_pairs(f.q_bounds, f.kv_bounds, f.block_shape, f.shape, t)
                over.append((worst * bitmap_step_bytes(t), len(over), t, cap))
            else:
                fitting.append((t, cap))
    if fitting:
        return fitting[0]
    return min(over)[2:] if over else (None, 0)


def choose(mask: BlockMask, shape: AttnShape, backend: str, template: Template | None = None,
           *, rule: DeviceRule = DEFAULT_RULE) -> tuple[Template | None, int]:
    """``choose_template`` of ``mask``'s static features. A caller's template must be
    device-capable (ValueError). Memoised per (static bounds, shapes, backend, template,
    rule)."""
    if template is not None and not device_capable(template):
        raise ValueError(f"template {template.name!r} pairs query units; a device mask runs "
                         f"on one of {DEVICE_TEMPLATES[template.backend]}")
    return choose_template(DeviceFeatures.of(mask, shape), backend, template, rule)


def clear_cache() -> None:
    """Forgets the memoised choices (``tessera_jax.clear_caches`` should call it). What the
    bounds alone decide (their tiles' blocks, prices, block sizes, ``bitmap_pairs``) stays:
    a new mask of the same bounds has the same."""
    choose_template.cache_clear()
