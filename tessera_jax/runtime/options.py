"""``Options``: the settings of a ``sparse_attention`` call that change what it computes or
compiles, as one frozen, validated, hashable value (so part of jit's cache key when passed as
a static argument, and of every cache keyed on a call).
"""

from __future__ import annotations

import dataclasses
import functools

from tessera_jax.planning.config import PlannerConfig
from tessera_jax.select.device import BITMAP_BUDGET_BYTES, DeviceRule

__all__ = ["Options", "DEFAULT", "HOST_PLANNING", "DEVICE_OVERFLOW"]

_DKV_POLICIES = ("merge", "pack")        # the host planner's policies a dk/dv plan may use
#: Also in ``dkv_policies``: the gathered dk/dv plan of a gathering template (runs of 32 queries).
_DKV_GATHER_POLICIES = ("gather32",)
#: ``Options.host_planning``'s values (``runtime.tiered``).
HOST_PLANNING = ("auto", "sync", "tiered", "device_first")
#: ``Options.device_overflow``'s values.
DEVICE_OVERFLOW = ("gather", "exact")


@dataclasses.dataclass(frozen=True)
class Options:
    """Options of a ``sparse_attention`` call (``options=None``: ``Options()``).

    bitmap_budget_bytes: bytes of bitmap steps a device plan may hold (tiles meeting more than
        ``abi.GRID`` blocks per axis: 2 KB each at 128 x 128); a mask that may need more gets
        this much room and takes the exact path where its selection overflows it (decided on
        the device); a budget under one step sends such masks to the exact path.
    bitmap_first_bytes: traced bounds whose mean blocks span at least 3/4 of a tile on both
        axes (few tiles meet more than GRID blocks) are planned first with room for this many
        bytes of bitmap steps; a plan that overflows it is made again with the whole budget
        inside the program, before the exact path. The room is allocated on every call, not
        zeroed (512 MB for per-head bounds at Wan 480p, where cubes use 6 MB). 0: one plan
        with the whole budget.
    dkv_policies: the host planner's policies tried for a host dk/dv plan with the backend's
        dk/dv tiles (empty: the paired candidate alone); the plan of least estimated time
        wins. On the transposed Wan 480p masks
        (computed / selected on top-k cubes, sliding tiles, clusters): 128 x 64 merge 2.61 /
        2.26 / 2.06, pack 2.04 / 1.26 / 1.68; paired 64 x 64 pack 1.23 / 1.04 / 1.46.
        "gather32" (gathered runs of 32 queries) only with a gathering template whose
        backend's dk/dv kernel gathers (Mosaic GPU), which offers it as a candidate anyway;
        naming it alone, with ``paired_dkv_policy=None``, forces it (the GPU checks do).
    paired_dkv_policy: the policy of the paired 64-key dk/dv candidate (backends that have
        paired units), None: no paired candidate.
    dkv_ns_per_interaction_d128: the dk/dv time per computed interaction at head_dim 128 that
        scores the dk/dv candidates, fitted to the H200's times of 9 dk/dv plans (merge128,
        pack128, paired64 of three irregular masks; benchmarks/NOTES.md#backward): max
        error 18%, and it orders all three masks' plans as measured.
    interpret: run the Pallas kernels (Mosaic GPU, Triton) in interpret mode; None: exactly
        when jax's default backend is not a GPU.
    planner: the host planner's options (``planning.PlannerConfig``) for the forward and the
        dk/dv plans of static masks.
    check_finite: keys a row does not select never reach it, whatever their values, on every
        backend and route (``runtime.finite``): the call runs on q, k, v with non-finite
        entries replaced by 0, and a row that selects a key whose k or v is non-finite, or
        whose own q is (and selects any key), is NaN (out and lse). Off by default: it reads
        and writes q, k, v and out once more (benchmarks/NOTES.md#inputs); without it a NaN or
        inf in k or v may reach rows of the tiles it shares (0 * NaN in P @ V).
    host_planning: how an eager call plans a host mask whose host plan is not cached yet
        (``runtime.tiered``). "sync": on the host, before the call runs. "tiered": when the
        measured cost model (``runtime.tier_costs``) predicts host planning slower than the
        device route, the call runs the device route and the host plan is made on a
        background thread, used from the first call that finds it ready (outputs of the two
        routes agree within the kernels' rounding, not bit for bit). "auto" (default):
        "tiered" on a GPU, "sync" elsewhere (on the CPU box the rule never tiers at video
        sizes). "device_first": every such call tiers (benchmarks, tests). Calls under a jax
        trace, and calls naming a template or policy, plan on the host as with "sync".
    host_plan_from_call: with "tiered" or "device_first", the call of a mask (counted per
        request: mask, shapes, options) from which a call on the device route starts the
        host plan in the background; earlier calls run the device route alone. 2 (default):
        a mask's host plan is made when the mask comes again, so a new mask per call never
        pays for a plan it won't use (on the H100 a plan starting beside the request cost
        it 0.3-1.0 ms). 1: from the first call.
    device_gather: when the device route (a device mask, or per-head bounds) runs the
        backend's gathering template (``select.device.GATHER_TEMPLATES``, planned by
        ``planning.device_gather``) instead of its device list: "auto" (default): where a
        tiered call's host key bounds are irregular (more than 8 distinct sizes, e.g. SVG2's
        clusters), the route traces them and their median blocks exceed 128 query or 64 key
        tokens (else ``traced_small_blocks``' tiles run them: ``tiered.SMALL_TILES_MEDIANS``);
        static bounds keep the list, whose fitted tiles run them faster (H100, Wan 480p, 12
        heads, SVG2: q64x2 x kv64 5.78 ms against the gathering template's 6.85,
        ``results/h100-device-alt-ab.json``); "never";
        "traced" (every traced bound); "irregular" (traced bounds and irregular static ones).
        Traced irregular bounds by measurement: plan + kernel 7.33 -> 5.97 ms with gathering
        (H100, ``results/h100-peers.json`` ``gather_alt``); on per-head cubes and sliding
        tiles the gathering template ran slower than the device list (H200, session 23:
        0.18 / 0.15 of cuDNN against 0.21 / 0.31), so traced bounds of unknown content keep
        the list (benchmarks/NOTES.md#gathered-steps).
    traced_small_blocks: the device route's template order for traced bounds (whose block
        sizes are unknown when tracing): True: 64-row units and 64-key tiles first (blocks of
        <= 64 tokens), False: 128-row / 128-key first; None (default): by the mean blocks
        (length / count): a mean key block of <= 64 tokens takes both, one of up to
        ``select.device.TRACED_SMALL_MEAN`` (96) 64-key tiles, with 64-row units where the
        mean query block is as small. A tiered call sets True for host key bounds that are
        irregular with median blocks of <= 128 query and 64 key tokens (SVG2's clusters,
        H100, 12 heads, plan + kernel: Wan 480p, medians 44 x 29, q64x2 x kv64 6.33 ms
        against gathering's 7.43; Wan 720p, 101 x 33, 28.67 against 30.33;
        ``results/h100-svg2-traced-alt.json``, ``h100-svg2-720-traced.json``).
    device_overflow: what a device plan runs where its selection overflows the bitmap room
        decided on the device (traced bounds, or static ones past the budget): "gather"
        (default) the backend's gathering template (``select.device.GATHER_TEMPLATES``: no
        bitmap steps, room for any selection), then the exact path; "exact" the exact path
        at once (a chunked XLA attention over every key: Wan 720p SVG2's clusters, 12 heads,
        5,569 ms against 28-30 ms for either template, H100). "gather" compiles the
        gathering plan and kernels into such call sites too (backends without one, XLA, run
        "exact"); ``make test-gpu`` (its overflow cases included) passed with it on an H100
        (``benchmarks/results/h100-test-gpu.log``).
    store_in_place: kernels that can (Mosaic GPU's forward and dq) store each unit's owned
        rows straight into the [B, L, H, D] output when the plan's units own every query row
        (``abi.PassPlan.rows_owned``) and at most a quarter of its 64-row groups only in part,
        instead of unit-major tiles gathered after the kernel (a copy of the output: ~78 us
        at Wan 480p, 12 heads, on the H100; the forward 5-7% faster on sliding tiles and
        aligned blocks, benchmarks/NOTES.md#kernel-steps). False: always the unit-major tiles
        and their gather.
    """

    bitmap_budget_bytes: int = BITMAP_BUDGET_BYTES
    bitmap_first_bytes: int = 32 << 20
    dkv_policies: tuple[str, ...] = _DKV_POLICIES
    paired_dkv_policy: str | None = "pack"
    dkv_ns_per_interaction_d128: float = 2.58e-3
    interpret: bool | None = None
    planner: PlannerConfig = PlannerConfig()
    check_finite: bool = False
    host_planning: str = "auto"
    host_plan_from_call: int = 2
    device_gather: str = "auto"
    traced_small_blocks: bool | None = None
    store_in_place: bool = True
    device_overflow: str = "gather"

    def __post_init__(self):
        # bitmap_budget_bytes, device_gather and traced_small_blocks are checked by the
        # DeviceRule they make (``device_rule``, made here once).
        _ = self.device_rule
        f = self.bitmap_first_bytes
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"bitmap_first_bytes must be an int >= 0, got {f!r}")
        pols = self.dkv_policies
        allowed = _DKV_POLICIES + _DKV_GATHER_POLICIES
        if not isinstance(pols, tuple) or any(p not in allowed for p in pols):
            raise ValueError(f"dkv_policies must be a tuple of {allowed}, got {pols!r}")
        if not pols and self.paired_dkv_policy is None:
            raise ValueError("dkv_policies is empty and paired_dkv_policy is None: no dk/dv "
                             "plan to choose")
        if self.paired_dkv_policy is not None and self.paired_dkv_policy not in _DKV_POLICIES:
            raise ValueError(f"paired_dkv_policy must be one of {_DKV_POLICIES} or None, got "
                             f"{self.paired_dkv_policy!r}")
        ns = self.dkv_ns_per_interaction_d128
        if isinstance(ns, bool) or not isinstance(ns, (int, float)) or not ns > 0:
            raise ValueError(f"dkv_ns_per_interaction_d128 must be a positive float, got {ns!r}")
        if not isinstance(self.planner, PlannerConfig):
            raise TypeError(f"planner must be a tessera_jax.planning.PlannerConfig, got "
                            f"{type(self.planner).__name__}")
        if self.interpret is not None and not isinstance(self.interpret, bool):
            raise TypeError(f"interpret must be a bool or None, got "
                            f"{type(self.interpret).__name__}")
        if not isinstance(self.check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got "
                            f"{type(self.check_finite).__name__}")
        if not isinstance(self.store_in_place, bool):
            raise TypeError(f"store_in_place must be a bool, got "
                            f"{type(self.store_in_place).__name__}")
        if not isinstance(self.host_planning, str) or self.host_planning not in HOST_PLANNING:
            raise ValueError(f"host_planning must be one of {HOST_PLANNING}, got "
                             f"{self.host_planning!r}")
        n = self.host_plan_from_call
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"host_plan_from_call must be an int >= 1, got {n!r}")
        if not isinstance(self.device_overflow, str) or self.device_overflow not in \
                DEVICE_OVERFLOW:
            raise ValueError(f"device_overflow must be one of {DEVICE_OVERFLOW}, got "
                             f"{self.device_overflow!r}")

    @functools.cached_property
    def device_rule(self) -> DeviceRule:
        """The three fields the device route's template choice reads, as one value
        (``select.device.DeviceRule``), made once per ``Options``."""
        return DeviceRule(self.bitmap_budget_bytes, self.device_gather,
                          self.traced_small_blocks)


DEFAULT = Options()


def check_options(options) -> Options:
    """``options`` as an ``Options`` (None: the defaults); TypeError for anything else."""
    if options is None:
        return DEFAULT
    if not isinstance(options, Options):
        raise TypeError(f"options must be a tessera_jax.Options or None, got "
                        f"{type(options).__name__}")
    return options
