"""Planner: logical blocks -> physical tiles -> work units, as the int32 arrays of the plan ABI.

NumPy (and numba-compiled loops for keep/merge) on the host, run at trace time; knows nothing
of Pallas. The output format is documented in ``pallas_kernels/abi.py``: a *work unit* is
one query tile [q_start, q_start + tile_q) of one query head plus the list of K/V tiles
(*steps*) it visits; each step selects a rectangle of its tile (rows x keys), or, a *grid*
step, the selected cells of a <= 4 x 4 grid inside that rectangle, or, a *bitmap* step, the
entries whose bits are set in words stored after the step rows; everything else in the tile
is masked. The steps' selections cover the mask's selected (query, key) pairs exactly once,
whatever the policy: policies only change *how* the selected set is cut into tiles.

Tiles once (issue 15): a policy cuts the selected set into *pieces* (one rectangle in one K/V
tile); a unit's pieces come in non-decreasing kv_start (the rectangles of one key segment tile
by tile), and the pieces of one tile are joined greedily into one grid step while the union
fits a 4 x 4 grid (at most 5 distinct row bounds and 5 distinct key bounds, the grid
normalised), in the step loops themselves (``plan_loops._nb_tiles_once``; keep/merge, whose
pieces of a unit share their rows, join in ``_nb_fill`` as they write). Where the pieces of a
tile need more than a 4 x 4 grid (tiles cut by more than 4 blocks per axis: 1-8 token blocks,
token-level bands, small clusters), that leaves several steps of one tile. The bitmap pass makes
them one step selecting their union: the step loops count these revisits as they write (a
comparison a row); split's loops (``plan_loops._nb_rects``) pass the rows of a unit that has
any, still in cache, to ``plan_loops._nb_bm_unit`` (one row per tile, in place; the steps of
each revisited tile logged), and once all step rows are written ``_finish``
(``plan_loops._nb_bm_pass``) writes each logged tile's step: plain if the union is a
rectangle, a grid if it fits 4 x 4, else a bitmap step (``abi.BITMAP_FLAG``) whose words
follow the step rows (``Plan.num_steps`` step rows, then ``Plan.bitmap_rows`` word rows,
``abi.bitmap_rows`` per bitmap). The other policies' plans may lose heads to the fallback to
split below (``auto``: to its choice among candidates), so their rows go through the same
pass after that choice, on the kept units only (``_bitmap_steps``, which copies the step ranges
and compacts those that revisit a tile), and only where some unit revisits a tile. So every
plan visits each (unit, K/V tile) once (``stats()["tile_revisits"]`` == 0) and computes at
most tile_q x tile_kv interactions there, whatever the block sizes. Units sharing a step range
(shared masks, tall row groups) keep sharing it, words included. The specification, in plain
Python: ``plan_oracle.tiles_once`` (the grid join) and ``plan_oracle.bitmap_steps`` (the pass).

Policies (the tile shape is fixed by the template; ``q_align``/``kv_align`` are honoured by
rounding tile starts down to a multiple, and tiles that would cross the padded length are
shifted back inside it):

* ``keep``  - one logical block, one set of tiles. Every non-empty query block is its own row
  group, and each selected key block its own key interval. Tiles start at the block's start; a
  block smaller than the tile leaves the rest of the tile masked, a block larger than the tile
  is cut into consecutive tiles (counted as *split* tiles, which is unavoidable).
* ``merge`` - along keys, each run of adjacent selected key blocks is one interval, tiled from
  its start (K/V loaded once for the run, fewer partial tiles); along queries, adjacent query
  blocks with identical key lists form one taller row group, whose rows are cut into units of
  ``tile_q`` rows that all stream the same K/V tiles.
* ``split`` - cut everything at the fixed global tile grid: units are the query tiles
  [k * tile_q, (k + 1) * tile_q) and steps the key tiles [c * tile_kv, (c + 1) * tile_kv); a
  block that crosses a grid line is split into the tiles on each side, and the small blocks
  inside one grid cell share its tile. In a cell, each query block's selected key runs become
  rectangles, and rectangles of adjacent query blocks with the same key range are merged
  vertically; the rectangles of a cell are one grid step where they fit 4 x 4 (tiles once).
* ``pack``  - ``merge`` plus packing along queries: consecutive row groups (identical rows
  merged as in ``merge``) share one unit while their rows fit in ``tile_q`` (greedy, per head),
  so query blocks shorter than the tile no longer leave most of the Q tile masked. The unit's
  K/V tiles are anchored at the runs of the *union* of its groups' key sets; inside, the keys
  are cut into segments where the set of selecting groups is constant, and each vertical run of
  adjacent selecting groups is one rectangle. A tile holding several rectangles (an L shape, say)
  is one grid step (tiles once).
* ``auto``  - per mask head (so per query head for per-head masks, globally for a shared mask),
  the policy among ``merge``, ``split`` and ``pack`` with the least estimated total cost
  (``tessera_jax.planning.schedule``) among those whose plan of the head computes at most
  dense (below; all of them if none does); units of one head always come from one policy.
  ``keep`` is not a candidate: ``merge`` never has more units or more steps than ``keep`` (a
  run tiled as a whole needs at most the tiles of its blocks tiled one by one, and likewise
  for rows).

The invariant (enforced by ``build_plan``): no head computes more interactions than a dense plan
of the same tiles (``dense_tile_interactions``: ceil(Lq / tile_q) tile_q x ceil(Lkv / tile_kv)
tile_kv, which is Lq x Lkv when the tiles divide the lengths). A head whose plan would
(``keep``/``merge`` anchor a tile at every block start: 1-token blocks computed ~400x dense)
is planned by ``split`` instead where that computes less (``stats()["fallback_heads"]``,
``head_policies``; the comparison counts the tiles each unit visits, after the bitmap pass).
``split`` visits each (query tile, key tile) of the global grid at most once, so it is always
within dense. Bitmap steps do not make the fallback rare: keep/merge give a row group shorter
than the tile a unit of its own (1-token query blocks: a unit per row, ~350x dense), and pack
anchors tiles at its groups' key runs, off the grid (4-token blocks 2.5x, ``masks.svg2("small")``
8.8x dense at 64 x 64); what bitmap steps remove is split's (and pack's) revisits, so the
fallback now lands within dense.

Every tile (step, counted once per unit that visits it) is classified for ``stats()``: it is
*split* if its selection (a grid step's selected cells) covers only part of a logical block it
touches (along queries or keys), otherwise *merged* if it covers several logical blocks whole,
otherwise *kept* (it covers exactly one logical block, whole). ``kept + merged + split ==
tiles``. ``computed_interactions`` counts each visit as tile_q x tile_kv;
``dense_interactions`` is Lq x Lkv x Hq; ``tile_revisits`` the visits of a K/V tile the unit
visited before (0: tiles once holds, always); ``grid_steps`` / ``bitmap_steps`` the visits of
grid / bitmap steps (a bitmap step's kind is read from its bits, ``_bitmap_kinds``).

Mask heads with identical blocks are planned once and their units share one step list (a
shared mask is the case of a single distinct head), so ``steps`` grows with the distinct head
masks, not with Hq. Units are ordered by ``tessera_jax.planning.schedule.order_units`` (heaviest
estimated cost first, then heads interleaved, or head-major where ``build_plan``'s
``unit_order`` asks for it: the runtime passes its template's ``unit_order``). The int32 arrays are padded to capacity buckets
(``bucket``) so that masks of similar size reuse one compiled executable.

Host cost: the work grows with the number of runs and tiles the plan holds, never with dense
[H, nq, nkv] temporaries other than the one ``packbits`` pass (``benchmarks/planning.py``).
``keep``/``merge`` (the default policy) run as numba-compiled loops that decode each unit's
key intervals from the packed bits and write its step rows straight into the preallocated
int32 ``steps``, on two threads, or on ``PlannerConfig.threads`` (up to 8) for large plans
where the host has 4 or more cores. Small plans run the same loops as plain Python
(``PlannerConfig.loops``); until numba has compiled them (12-25 s on a fresh install, for
split/pack), the NumPy tier (``planning.vectorised``) makes the larger plans, the same plans
byte for byte, and the first of those starts compiling the loops in the background
(``warm_up()`` compiles them ahead of time).
``split``/``pack`` choose their units (NumPy / a compiled greedy pass) and
write their steps with one compiled loop, once, into a reserved upper bound as keep/merge do.
The NumPy versions of the three step builders (``plan_oracle``) are the tests' oracles.
``stats()`` is computed on first call, not at build time.
Units share step rows where their lists are equal: the heads of a shared mask, and (keep/merge)
the interior units of a tall row group, so an all-selected mask stores one list per unit
height; this keeps the plan small to build and to copy to the GPU.
``build_plan`` is cached by (mask digest, shape, tile shape, policy, alignment, template,
cost model, unit order, ``PlannerConfig``): a repeated mask costs a dictionary lookup. Every
option is a field of the frozen ``PlannerConfig`` (``tessera_jax.planning.config``) passed as
``build_plan(config=...)``; none is a module global.

* ``tessera_jax.planning.loops``: the numba-compiled inner loops (``_nb_*``), ``compile_all()``;
  this module keeps the policies, the drivers that run those loops (threads, bounds), the API.
* ``plan_oracle``: the NumPy versions of the step builders, the tests' oracles
  (``_plan_rowgroups_numpy``, ``_plan_grid_numpy``, ``_plan_pack_numpy``, ``bitmap_steps``);
  plans never use them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os

import numpy as np

from pallas_kernels import abi

from tessera_jax.planning import config as _config
from tessera_jax.planning import gather as _gather_policy
from tessera_jax.planning import loops as _loops
from tessera_jax.planning import schedule as _sched
from tessera_jax.mask import BlockMask
from tessera_jax.validation import AttnShape, check_mask, check_shapes
from tessera_jax.planning.config import PlannerConfig

# Policies that cut the selected set at runs of keys (tiles once, bitmap pass); the gather
# policies assemble K/V tiles from 8-key chunks instead (``planning.gather``), in copy runs of
# this many keys.
TILE_POLICIES = ("keep", "merge", "split", "pack", "auto")
GATHER_RUNS = {"gather": 8, "gather32": 32, "gather64": 64}
POLICIES = TILE_POLICIES + tuple(GATHER_RUNS)
_BASE_POLICIES = ("keep", "merge", "split", "pack")
_AUTO_CANDIDATES = ("merge", "split", "pack")
_U64 = np.dtype("<u8")


def bucket(n: int) -> int:
    """Capacity bucket >= n: the next multiple of 2^(k-3) where 2^(k-1) < n <= 2^k.

    Four buckets per octave keep padding under 25% (about 10% on average) while masks of
    similar size share one compiled executable.
    """
    n = max(int(n), 1)
    if n <= 8:
        return n
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A host plan: ABI arrays plus the static integers a backend compiles against."""

    template: str
    policy: str
    tile_q: int
    tile_kv: int
    shape: AttnShape
    q_len_padded: int
    kv_len_padded: int
    units: np.ndarray        # int32 [U_cap, UNIT_COLS], schedule order
    steps: np.ndarray        # int32 [S_cap, STEP_COLS]; units may share steps (shared masks)
    num_units: int           # real units (the rest is padding)
    num_steps: int           # real step rows of ``steps`` (units point into [0, num_steps))
    max_steps: int           # capacity >= the longest unit
    mask_digest: str
    selected_interactions: int  # summed over query heads, one batch element
    mask: BlockMask | None = None
    head_policies: tuple[str, ...] = ()   # policy used for each mask head
    unit_cost: np.ndarray | None = None   # estimated ns of each real unit, schedule order
    cost_model: _sched.CostModel = _sched.DEFAULT_COST_MODEL
    unit_order: str = "interleaved"       # schedule.order_units order
    maybe_all_full: bool = True           # False: some step is certainly partial (cost model)
    # Set by ``tessera_jax.plan`` (the runtime), never by the planner: ``sparse_attention``
    # without LSE sends this request to cuDNN's dense attention (an all-selected mask on a
    # GPU, see ``tessera_jax.runtime.dense_route``), so this plan runs only for return_lse=True
    # or where cuDNN refuses the call. ``describe()`` says so.
    dense_route: bool = False
    # Set by the runtime: where the template and policy came from (a ranking table, the
    # heuristic, the caller), in words for ``describe()``; "" when the planner was called alone.
    chosen_by: str = ""
    # Rows of ``steps`` after the num_steps step rows that hold bitmap steps' words
    # (``abi.BITMAP_FLAG``): [num_steps, num_steps + bitmap_rows), never visited as steps; the
    # rest of the capacity is zero padding.
    bitmap_rows: int = 0
    config: PlannerConfig = _config.DEFAULT   # the planner's options it was made with
    # Rows of a tile the kernel computes as one (0: the whole tile): a step's row groups that
    # its rectangle misses are skipped (Mosaic GPU ``wg_skip``: 64), so ``stats()`` counts
    # only the groups it meets.
    row_group: int = 0

    @functools.cached_property
    def row_index(self) -> np.ndarray:
        """int32 [Hq, Lq] (``plan_abi``), made from ``units`` on first use: a request on the
        GPU never needs it (kernels make it on the device), so planning skips it (it was 20-50%
        of planning time on 8-head Wan/Hunyuan masks, CPU box)."""
        # Contiguous columns: the compiled loop's one specialisation (``warm_up`` makes it).
        u = np.ascontiguousarray(self.units[: self.num_units].T, np.int64)
        out = _row_index(u[abi.UNIT_HEAD], u[abi.UNIT_Q_START], u[abi.UNIT_OWN_LO],
                         u[abi.UNIT_OWN_HI], np.arange(self.num_units), self.shape.num_q_heads,
                         self.shape.q_len, self.tile_q, self.units.shape[0] * self.tile_q,
                         self.config)
        out.setflags(write=False)
        return out

    @functools.cached_property
    def all_full(self) -> bool:
        """Whether every step is the whole tile (no masking needed anywhere): exact, from the
        step rows, and skipped when the planner already counted a partial step."""
        if not self.maybe_all_full:
            return False
        st = self.steps[: self.num_steps]            # step rows (bitmap words follow)
        return bool(np.all(((st[:, abi.STEP_RECT] == abi.full_rect(self.tile_q, self.tile_kv))
                            & (st[:, abi.STEP_CUTS_B] == 0))
                           | (st[:, abi.STEP_CUTS_B] == abi.GATHER_FULL_FLAG)))

    @functools.cached_property
    def rows_owned(self) -> bool:
        """Whether the units own every query row of every query head (a row selecting no key
        may be owned by no unit): kernels then store rows in place (``abi.PassPlan``)."""
        return abi.units_own_all_rows(self.units[: self.num_units], self.shape.num_q_heads,
                                      self.shape.q_len)

    @functools.cached_property
    def partial_groups(self) -> float:
        """The fraction of the units' owned 64-row groups owned only in part
        (``abi.partial_groups``)."""
        u = self.units[: self.num_units]
        return abi.partial_groups(u[:, abi.UNIT_Q_START], u[:, abi.UNIT_OWN_LO],
                                  u[:, abi.UNIT_OWN_HI], self.tile_q, self.shape.q_len)

    @property
    def capacities(self) -> tuple[int, int, int]:
        return (self.units.shape[0], self.steps.shape[0], self.max_steps)

    def step_counts(self) -> np.ndarray:
        return self.units[: self.num_units, abi.UNIT_STEP_CNT]

    def tile_rects(self) -> dict:
        """Every computed tile in absolute coordinates, one row per (unit, step) visit.

        Returns int64 arrays: ``unit``, ``head``, ``q0``/``q1`` (the tile's rows),
        ``k0``/``k1`` (its keys), ``r0``/``r1`` and ``c0``/``c1`` (the step's rectangle:
        rows [r0, r1) x keys [c0, c1); all of it selected unless ``grid`` or ``bitmap``),
        ``step`` (index into ``steps``), ``grid`` (bool: a grid step, its selection the cells
        of ``cuts_a`` / ``cuts_b``), ``bitmap`` (bool: a bitmap step, its selection the bits
        of its words; see ``tile_cells``). Word rows are never visits.
        """
        return _tile_rects(self)

    def tile_cells(self, rects: dict | None = None) -> dict:
        """Every selected rectangle of every visit (a plain step's rectangle, a grid step's
        selected cells, a bitmap step's runs of selected keys, ``abi.selected_cells``),
        absolute: int64 arrays ``visit`` (row of ``tile_rects``), ``unit``, ``head``,
        ``r0``/``r1``, ``c0``/``c1``. Disjoint per head; they cover the mask's selected
        (query, key) pairs exactly."""
        t = rects if rects is not None else _tile_rects(self)
        # Cells of each distinct step once (units of a shared mask visit the same rows).
        us, inv = np.unique(t["step"], return_inverse=True)
        i, r0, r1, c0, c1 = abi.selected_cells(self.steps, us, self.tile_q, self.tile_kv)
        i, r0, r1, c0, c1 = _gathered_cells(self.steps, us, i, r0, r1, c0, c1, self.tile_kv)
        per = np.bincount(i, minlength=len(us))
        first = np.cumsum(per) - per
        n = per[inv.reshape(-1)]
        v = np.repeat(np.arange(len(inv)), n)
        x = np.repeat(first[inv.reshape(-1)] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        r0, r1, c0, c1 = r0[x], r1[x], c0[x], c1[x]
        q0 = t["q0"][v]
        k0 = np.where(t["gather"][v], 0, t["k0"][v])     # gathered cells: absolute already
        return {"visit": v, "unit": t["unit"][v], "head": t["head"][v], "r0": q0 + r0,
                "r1": q0 + r1, "c0": k0 + c0, "c1": k0 + c1}

    def stats(self) -> dict:
        return dict(self._stats)

    @functools.cached_property
    def _stats(self) -> dict:
        return _stats(self)

    def describe(self) -> str:
        s = self.stats()
        pol = self.policy
        if self.policy == "auto":
            pol += " -> " + ", ".join(f"{k}:{v}" for k, v in s["head_policies"].items() if v)
        route = ("dense route: sparse_attention runs cuDNN dense attention for this "
                 "all-selected mask (no LSE); this plan runs only with return_lse=True or if "
                 "cuDNN refuses the call. " if self.dense_route else "")
        if s["fallback_heads"]:
            pol += (f"; {s['fallback_heads']} heads planned by split, where {self.policy} "
                    f"would compute more than a dense plan of these tiles")
        dense = s["dense_interactions"]
        chosen = f"chosen by {self.chosen_by}; " if self.chosen_by else ""
        return (
            f"{route}plan {self.template} ({pol}; {chosen}tiles {self.tile_q}x{self.tile_kv}), "
            f"{s['units']} work units, {s['tiles']} tiles "
            f"(kept {s['kept']}, merged {s['merged']}, split {s['split']}; "
            f"{s['partial_tiles']} partial, {s['grid_steps']} grid steps, "
            f"{s['bitmap_steps']} bitmap steps, {s['tile_revisits']} tile revisits); "
            f"selected {s['selected_interactions']:,} interactions, computed "
            f"{s['computed_interactions']:,} (waste {s['waste_fraction']:.1%}; "
            f"{s['computed_interactions'] / dense if dense else 0.0:.2f}x Lq x Lkv x heads); "
            f"K/V bytes {s['kv_bytes'] / 2**20:.1f} MiB; the cost model (an H200-class GPU of "
            f"{self.cost_model.num_sms} SMs, whatever this machine is) estimates "
            f"{s['est_time_us']:.1f} us (balance {s['balance']:.2f}); capacities "
            f"U={self.capacities[0]} S={self.capacities[1]} M={self.capacities[2]}")


# --- bit helpers ------------------------------------------------------------------------
def pack_rows(rows: np.ndarray, config: PlannerConfig | None = None) -> np.ndarray:
    """bool [..., n] -> little-endian uint64 words [..., ceil(n / 64)]; bit j%64 of word j//64.

    Large C-contiguous masks with n % 8 == 0 are packed by the compiled loop (8 flags at a
    time, on ``config.threads`` threads) where ``config.loops`` runs compiled loops (not
    before they are ready, for "auto"); the rest by ``np.packbits`` (the same words).
    """
    cfg = _config.check(config)
    n = rows.shape[-1]
    if (rows.size >= cfg.pack_min_bytes and n % 8 == 0 and rows.dtype == np.bool_
            and rows.flags.c_contiguous and (cfg.loops in ("compiled", "interpreted")
                                             or (cfg.loops == "auto" and _loops.ready()))):
        b8 = rows.reshape(-1, n).view(np.uint64)
        out = np.empty((b8.shape[0], -(-n // 64)), _U64)
        run = _runner(cfg) if cfg.loops == "interpreted" else _loops.runner("compiled")
        _run_split(cfg, run._nb_pack, b8.shape[0], b8.shape[0] * n, b8, out)
        return out.reshape(rows.shape[:-1] + (out.shape[1],))
    pk = np.packbits(rows, axis=-1, bitorder="little")
    nb = pk.shape[-1]
    W = -(-nb // 8)
    if nb != 8 * W:
        out = np.empty(pk.shape[:-1] + (8 * W,), np.uint8)
        out[..., :nb] = pk
        out[..., nb:] = 0
        pk = out
    return np.ascontiguousarray(pk).view(_U64)


_pack = pack_rows     # the former private name (tests/test_planner.py uses it)


def _chunk(starts, ends, tile, align, limit):
    """Cuts intervals [starts, ends) into tiles of ``tile`` at aligned offsets inside [0, limit).

    Returns (owner, tile_start, lo, hi): the interval each tile came from, its first token and
    the selected sub-range [lo, hi) relative to the tile. Tiles that would cross ``limit`` are
    shifted back (their lo/hi shift with them), so kernels never read past the padded length.
    Tiles come in interval order, and in token order within an interval.
    """
    starts = np.asarray(starts, np.int64)
    ends = np.asarray(ends, np.int64)
    a0 = (starts // align) * align
    n = -(-(ends - a0) // tile)
    total = int(n.sum())
    first = np.cumsum(n) - n
    owner = np.repeat(np.arange(len(starts)), n)
    ts = np.repeat(a0 - first * tile, n) + np.arange(0, total * tile, tile, dtype=np.int64)
    # Only an interval's first tile can start late, only its last can end early or cross limit.
    lo = np.zeros(total, np.int64)
    lo[first] = starts - a0
    hi = np.full(total, tile, np.int64)
    last = first + n - 1
    hi[last] = ends - ts[last]
    over = np.flatnonzero(ts[last] + tile > limit)
    if over.size:
        t = last[over]
        shift = ts[t] + tile - limit
        ts[t] -= shift
        hi[t] += shift
        lo[t] += shift
    return owner, ts, lo, hi


@dataclasses.dataclass
class _Raw:
    """Units of one policy before scheduling; steps are laid out in unit order, or, with
    ``ptr``, unit u's are rows [ptr[u], ptr[u] + cnt[u]) and units may share rows. The policies'
    step loops (or ``_bitmap_steps`` after them) leave one step per (unit, K/V tile) (bitmap
    steps where a grid does not do), ``words`` rows of bitmap words after the step rows; unless
    ``pending``: then the rows as the loops joined them, ``rev`` revisits among them."""

    head: np.ndarray   # mask head of each unit
    qs: np.ndarray     # q_start
    lo: np.ndarray     # owned rows [lo, hi) relative to q_start
    hi: np.ndarray
    cnt: np.ndarray    # steps per unit
    steps: np.ndarray  # int32 [>= S + words, STEP_COLS]: S step rows, the words, then zeros
    nfull: np.ndarray  # full steps per unit
    area: np.ndarray   # selected interactions per unit
    ptr: np.ndarray | None = None   # first row of each unit (None: consecutive, in unit order)
    stored: int | None = None       # rows of steps in use when ptr is given
    words: int = 0                  # rows of bitmap words after the step rows
    wr: int = 0                     # rows of one bitmap's words (``abi.bitmap_rows``) if words
    rev: np.ndarray | None = None   # per unit: its steps that revisited a tile, before the pass
    njoin: np.ndarray | None = None  # per unit: full steps the pass made (counted in nfull)
    pending: bool = False           # rows not through the bitmap pass yet (``_bitmap_steps``)

    def __post_init__(self):
        if self.rev is None:
            self.rev = np.zeros(len(self.cnt), np.int64)
        if self.njoin is None:
            self.njoin = np.zeros(len(self.cnt), np.int64)

    @property
    def num_steps(self) -> int:
        """Rows of ``steps`` in use (with shared rows, fewer than the steps the units visit)."""
        return int(self.cnt.sum()) if self.ptr is None else int(self.stored)

    @property
    def first(self) -> np.ndarray:
        """The first row of each unit's steps."""
        return np.cumsum(self.cnt) - self.cnt if self.ptr is None else self.ptr

    def visits(self) -> np.ndarray:
        """The K/V tiles each unit visits (after the bitmap pass, if ``pending``)."""
        return self.cnt - self.rev if self.pending else self.cnt

    def unshared(self) -> "_Raw":
        """The same units with every unit's rows of its own (bitmap words too), consecutive in
        unit order."""
        if self.ptr is None:
            return self
        S = int(self.cnt.sum())
        idx = np.repeat(self.ptr - (np.cumsum(self.cnt) - self.cnt), self.cnt) + np.arange(S)
        if self.words:
            steps, words = _gather(self.steps, idx, self.stored, self.wr)
        else:
            steps, words = np.zeros((bucket(S), abi.STEP_COLS), np.int32), 0
            np.take(self.steps, idx, axis=0, out=steps[:S])
        return dataclasses.replace(self, steps=steps, ptr=None, stored=None, words=words)

    def select_heads(self, keep_head: np.ndarray) -> "_Raw":
        """The units of the kept heads (rows in unit order, no bitmap words yet: ``auto`` and
        the fallback to split select heads before the bitmap pass)."""
        assert self.ptr is None and not self.words, "select_heads: rows in unit order, no words"
        ku = keep_head[self.head]
        ks = np.repeat(ku, self.cnt)
        return _Raw(self.head[ku], self.qs[ku], self.lo[ku], self.hi[ku], self.cnt[ku],
                    self.steps[: len(ks)][ks], self.nfull[ku], self.area[ku],
                    rev=self.rev[ku], njoin=self.njoin[ku], pending=self.pending)

    @staticmethod
    def concat(parts) -> "_Raw":
        assert all(p.ptr is None and not p.words for p in parts), \
            "concat needs rows in unit order, no bitmap words yet"
        assert len({p.pending for p in parts}) == 1, "concat of pending and passed rows"
        cat = {f.name: np.concatenate([getattr(p, f.name) for p in parts])
               for f in dataclasses.fields(_Raw)
               if f.name not in ("steps", "ptr", "stored", "words", "wr", "pending")}
        S = int(cat["cnt"].sum())
        steps = np.zeros((bucket(S), abi.STEP_COLS), np.int32)
        np.concatenate([p.steps[: p.num_steps] for p in parts], out=steps[:S])
        return _Raw(steps=steps, pending=parts[0].pending, **cat)


def _gather(steps: np.ndarray, rows: np.ndarray, S0: int, wr: int):
    """The step rows ``rows`` of ``steps`` (step rows [0, S0), then the words of its bitmap
    steps, ``wr`` rows each, as ``_finish`` lays them out), then the words of their bitmap
    steps, in the order of those: (int32 [bucket(len(rows) + words), STEP_COLS], word rows)."""
    x = steps[rows]
    b = np.flatnonzero(x[:, abi.STEP_CUTS_B] == abi.BITMAP_FLAG)
    S, words = len(x), len(b) * wr
    out = np.zeros((bucket(S + words), abi.STEP_COLS), np.int32)
    out[:S] = x
    if len(b):
        old = (x[b, abi.STEP_CUTS_A].astype(np.int64) // abi.STEP_COLS - S0) // wr
        n = (len(steps) - S0) // wr
        blocks = steps[S0: S0 + n * wr].reshape(n, wr, abi.STEP_COLS)
        out[S: S + words] = blocks[old].reshape(-1, abi.STEP_COLS)
        out[b, abi.STEP_CUTS_A] = (S + np.arange(len(b)) * wr) * abi.STEP_COLS
    return out, words


@dataclasses.dataclass(frozen=True)
class _Ctx:
    qb: np.ndarray
    kb: np.ndarray
    words: np.ndarray      # packed blocks [Hm, nq, W]
    tile_q: int
    tile_kv: int
    q_align: int
    kv_align: int
    qp: int
    kvp: int
    cfg: PlannerConfig = _config.DEFAULT
    row_group: int = 0         # rows the kernel computes as one (0: the tile)

    @property
    def run(self) -> _loops.Runner:
        """The loops as ``cfg.loops`` runs them."""
        return _runner(self.cfg)


def _runner(cfg: PlannerConfig) -> _loops.Runner:
    return _loops.runner(cfg.loops, cfg.interp_max_work, cfg.interp_budget_work)


# --- compiled step builders: drivers of the loops in ``plan_loops`` -----------------------
# keep/merge run as numba-compiled loops (nogil) that decode each unit's key intervals from
# the packed words (merge: run boundaries w ^ (w << 1); keep: set bits) and write its step
# rows straight into the preallocated int32 ``steps``. The exact step count is not known
# before writing, so ``steps`` is allocated (zeroed lazily by the OS) for an upper bound:
# an interval of blocks J needs at most sum_J ceil((size_j + kv_align - 1) / tile_kv) tiles,
# so a group needs at most popcount * cmax rows (cmax: that bound's largest term). With
# two threads the units are split in two halves of about equal bound; the second half is
# written from the first half's bound on a worker thread and moved down after. When the bound
# is too large to reserve, the step counts are computed exactly in a first pass instead.
# split/pack (``_nb_rects``) do the same with their own bound (``_nb_rect_bound``): a step is a
# rectangle x tile, charged to one (group, selected key block) whose keys its tile touches.
# Mask packing and row_index are compiled too.
# numba is imported and the loops compiled (or loaded from numba's on-disk cache) in the
# background after the first plan with a loop call too large to run interpreted (that plan,
# and those until the loops are ready, are the NumPy tier's: ``_tiered_policy_raw``), not at
# import; ``warm_up()`` does it ahead of time. The drivers call each loop through ``ctx.run``
# (``plan_loops.runner``).
# Threads of the compiled loops (``PlannerConfig.threads``). Most loops use two of them. The
# step builders (split/pack and keep/merge) use all of them on large plans from _WIDE_MIN
# threads on: the units in ``threads`` chunks, each counted, then written at its exact offset,
# both passes in parallel (~1.6x one pass's work, so 2 threads keep the estimate schemes
# below). Below ``par_min_rows`` of work (step rows, flags, words), one thread.
_WIDE_MIN = 4


def _wide(cfg: PlannerConfig, units: int, bound_rows: int) -> bool:
    """Whether split/pack or keep/merge take the wide (``cfg.threads``-chunk) path."""
    return (cfg.threads >= _WIDE_MIN and units >= cfg.threads
            and bound_rows >= max(cfg.wide_min_rows, cfg.par_min_rows))


def _two(cfg: PlannerConfig, n: int, work: int) -> bool:
    """Whether n items of ``work`` in all are split in two halves on two threads."""
    return cfg.threads >= 2 and n >= 2 and work >= cfg.par_min_rows


_POOL = None                   # (pid, one-thread executor) of the second thread


def _rect_steps(ctx: _Ctx, gh, gi, r0, r1, ugroups, uq, uqlo, uqhi, grid: bool,
                bitmaps: bool = True):
    """(cnt, steps, nfull, area, rev, njoin, words) of ``_nb_rects``'s units (one step per
    (unit, K/V tile); ``words`` rows of bitmap words after the step rows, ``_finish``; with
    ``bitmaps`` False the rows as the loops join them, ``rev`` revisits), written in one pass
    into a reserved upper bound, or after an exact counting pass where the bound is too large
    to reserve. (Counting passes count the rows after the bitmap pass and the revisits.)

    On two threads the second half of the units is written from an estimate of where
    the first half ends (a sampled count, scaled by the bound; the first half stops at any unit
    that could cross it), then moved down: the estimate keeps the move in memory already
    touched. Where the first half stopped early, the rest of it is counted, the second half
    moved up to make room, and the rest written.
    """
    U = len(uq)
    cfg, run = ctx.cfg, ctx.run
    tq, tk = ctx.tile_q, ctx.tile_kv
    kb = np.array(ctx.kb, np.int64)
    ltk = tk.bit_length() - 1 if tk & (tk - 1) == 0 else -1
    args = (ctx.words, gh, gi, r0, r1, ugroups, uq, uqlo, uqhi, kb, kb - kb % ctx.kv_align,
            grid, tq, tk, ltk, ctx.kvp)
    cnt, nfull, area, rev, njoin = (np.zeros(U, np.int64) for _ in range(5))
    per = (cnt, nfull, area, rev)
    cmax = int(((kb[1:] - kb[:-1] + 2 * tk - 2) // tk).max())
    bound = np.empty(U + 1, np.int64)
    run._nb_rect_bound(ctx.words, gh, gi, ugroups, cmax, bound)
    B = int(bound[-1])
    big = 1 << 62
    if _wide(cfg, U, B):
        steps, words = _rect_steps_wide(cfg, args, bound, per, tq, tk, bitmaps, njoin)
        return cnt, steps, nfull + njoin, area, rev, njoin, words
    two = _two(cfg, U, B)
    mid = min(max(int(np.searchsorted(bound, B // 2)), 1), U - 1) if two else U
    none = np.zeros((1, abi.STEP_COLS), np.int32)
    if bucket(B) * abi.STEP_COLS * 4 > cfg.max_bound_bytes:   # count first, then exact offsets
        _run_split(cfg, run._nb_rects, U, B, 0, *args, bound, big, False, none, *per, 0, True)
        written = cnt + rev                     # rows each unit writes before the bitmap pass
        B = int(written.sum())
        r1 = int(written[:mid].sum())
        steps = np.zeros((_room(B, int(rev.sum()) if bitmaps else 0, tq, tk), abi.STEP_COLS),
                         np.int32)
    else:
        if two:
            r1 = min(int(bound[mid]), _first_half_rows(ctx, args, bound, mid))
        steps = _reserve(cfg, B)
    out = (True, steps) + per
    if not two:
        S, _, log, nlog, nt = run._nb_rects(0, U, 0, *args, bound, big, *out, B, bitmaps)
        steps, words = _finish(cfg, steps, S, [(log, nlog, nt, 0)], tq, tk, S, njoin)
        return cnt, steps, nfull + njoin, area, rev, njoin, words
    fut = _on_worker(run._nb_rects, mid, U, r1, *args, bound, big, *out,
                     int(bound[U] - bound[mid]), bitmaps)
    # (Its log by the rows its units write before the pass: the cap r1 is on the rows after.)
    e0, stop, log0, n0, b0 = run._nb_rects(0, mid, 0, *args, bound, r1, *out,
                                           int(bound[mid]), bitmaps)
    e1, _, log1, n1, b1 = fut.result()
    start1 = r1                 # where the second half was written (its log's rows)
    parts = [(log0, n0, b0, 0)]
    top = e1                    # rows at or past S up to here were written: zeroed at the end
    if stop < mid:              # the estimate was short: count the rest, make room, write it
        rest = np.empty(U, np.int64)
        rrev = np.zeros(U, np.int64)
        c = run._nb_rects(stop, mid, 0, *args, bound, big, False, none, rest, nfull, area,
                          rrev, 0, True)[0]
        r2 = e0 + c + int(rrev[stop:mid].sum())       # its rows before the bitmap pass
        if not bitmaps:
            c = r2 - e0
        _move_rows(steps, r2, r1, e1 - r1)
        if r2 > r1:             # left behind by the move: rows are written on zeros
            steps[r1:r2] = 0
        e1, r1 = r2 + e1 - r1, r2
        top = max(top, e1)
        e, _, log2, n2, b2 = run._nb_rects(stop, mid, e0, *args, bound, big, *out, r2 - e0,
                                           bitmaps)
        if e != e0 + c:
            raise RuntimeError("planner: split/pack step count changed between passes")
        parts.append((log2, n2, b2, 0))
        e0 = e
    if e0 > r1 or e1 > bucket(B):      # the bound is proven and the cap checked; never seen
        raise RuntimeError("planner: split/pack steps exceeded their bound")
    S = e0 + e1 - r1
    _move_rows(steps, e0, r1, e1 - r1)          # the second half down
    parts.append((log1, n1, b1, e0 - start1))
    steps, words = _finish(cfg, steps, S, parts, tq, tk, top, njoin)
    return cnt, steps, nfull + njoin, area, rev, njoin, words


def _rect_steps_wide(cfg: PlannerConfig, args, bound, per, tq: int, tk: int, bitmaps: bool,
                     njoin):
    """``_rect_steps`` on ``cfg.threads`` threads: the units in chunks of about equal bound, each
    chunk's rows counted, then each chunk written from its exact offset (both passes in
    parallel; no estimate), the gaps its bitmap pass left closed after. Returns (steps,
    words)."""
    cnt, rev = per[0], per[3]
    run = _runner(cfg)
    edges = _wide_edges(bound, cfg.threads)
    chunks = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
    big = 1 << 62
    none = np.zeros((1, abi.STEP_COLS), np.int32)
    _on_threads_wide(cfg, [(run._nb_rects, lo, hi, 0, *args, bound, big, False, none, *per, 0,
                            True) for lo, hi in chunks])
    offs = np.zeros(len(chunks) + 1, np.int64)     # rows written before the bitmap pass
    np.cumsum([int(cnt[lo:hi].sum() + rev[lo:hi].sum()) for lo, hi in chunks], out=offs[1:])
    steps = np.zeros((_room(int(offs[-1]), int(rev.sum()) if bitmaps else 0, tq, tk),
                      abi.STEP_COLS), np.int32)
    ends = _on_threads_wide(cfg, [(run._nb_rects, lo, hi, int(o), *args, bound, big, True,
                                   steps, *per, int(o1 - o), bitmaps)
                                  for (lo, hi), o, o1 in zip(chunks, offs[:-1], offs[1:])])
    kept = [int(cnt[lo:hi].sum()) for lo, hi in chunks]
    if [e[0] - int(o) for e, o in zip(ends, offs[:-1])] != kept:
        raise RuntimeError("planner: split/pack step count changed between passes")
    S, parts = _close_gaps(steps, offs, ends, kept)
    return _finish(cfg, steps, S, parts, tq, tk, max(e[0] for e in ends), njoin)


def _wide_edges(bound: np.ndarray, n: int) -> np.ndarray:
    """Unit indices cutting [0, U) into n chunks of about equal bound (the cumulative row
    bound, length U + 1); empty chunks dropped."""
    U, B = len(bound) - 1, int(bound[-1])
    return np.unique(np.r_[0, np.searchsorted(bound, np.arange(1, n) * (B / n)), U])


def _on_threads_wide(cfg: PlannerConfig, calls):
    """[fn(*args) for fn, *args in calls], the first on this thread and the rest on the wide
    pool of ``cfg.threads`` - 1 threads (the compiled loops release the GIL)."""
    global _WIDE_POOL
    if _WIDE_POOL is None or _WIDE_POOL[0] != (os.getpid(), cfg.threads):
        import concurrent.futures
        _WIDE_POOL = ((os.getpid(), cfg.threads), concurrent.futures.ThreadPoolExecutor(
            max(cfg.threads - 1, 1), thread_name_prefix="tessera-plan-wide"))
    futs = [_WIDE_POOL[1].submit(fn, *a) for fn, *a in calls[1:]]
    first = calls[0][0](*calls[0][1:])
    return [first] + [f.result() for f in futs]


_WIDE_POOL = None       # ((pid, threads), executor) of the wide split/pack


def _close_gaps(steps, offs, ends, kept):
    """Moves chunk c's ``kept[c]`` rows (written from row offs[c]) down after the rows of the
    chunks before it (the bitmap pass left the rest of its rows free). Returns (step rows,
    ``_finish``'s parts: each chunk's log and the move)."""
    dest = 0
    parts = []
    for c, (o, e) in enumerate(zip(offs[:-1].tolist(), ends)):
        _move_rows(steps, dest, o, kept[c])
        parts.append((e[-3], e[-2], e[-1], dest - o))
        dest += kept[c]
    return dest, parts


def _move_rows(steps: np.ndarray, to: int, frm: int, n: int) -> None:
    """Moves rows [frm, frm + n) of ``steps`` to row ``to`` (the ranges may overlap)."""
    if to != frm and n > 0:
        row = steps.strides[0]
        ctypes.memmove(steps.ctypes.data + to * row, steps.ctypes.data + frm * row, n * row)


def _first_half_rows(ctx: _Ctx, args, bound, mid: int) -> int:
    """An estimate (a little high) of the step rows of units [0, mid): every
    ``sample_stride``-th unit counted, the total scaled by the units' bounds (a ratio
    estimate), with ``est_margin`` and ``est_slack`` of headroom (``PlannerConfig``)."""
    cfg = ctx.cfg
    idx = np.arange(0, mid, cfg.sample_stride)
    ug, uq, uqlo, uqhi = (np.ascontiguousarray(a[idx]) for a in args[5:9])
    sargs = args[:5] + (ug, uq, uqlo, uqhi) + args[9:]
    sb = np.zeros(len(idx) + 1, np.int64)
    np.cumsum(bound[idx + 1] - bound[idx], out=sb[1:])
    c = np.empty(len(idx), np.int64)
    z = np.zeros(len(idx), np.int64)
    n = ctx.run._nb_rects(0, len(idx), 0, *sargs, sb, 1 << 62, False,
                          np.zeros((1, abi.STEP_COLS), np.int32), c, z, z, z, 0, True)[0]
    if sb[-1] == 0:
        return 0
    return max(int(bound[mid] * (n / sb[-1]) * (1 + cfg.est_margin)) + cfg.est_slack, 0)


# --- the bitmap pass's last stage: after all the step rows -------------------------------
# ``plan_loops._nb_bm_unit`` leaves one row per (unit, K/V tile) in the rows of the units that
# revisit a tile (in split/pack's loops as they write, or in ``_bitmap_steps`` after them) and
# logs the steps of each revisited tile; a bitmap step's words go after all the step rows,
# whose end is known only once every part of them is written and moved. ``_finish`` then writes each logged tile's step, the union of its logged
# steps, and the words of the bitmap steps (``plan_loops._nb_bm_pass``), each union built once.
def _reserve(cfg: PlannerConfig, rows: int) -> np.ndarray:
    """Zeros for up to ``rows`` step rows (a bound): int32 [bucket(rows), STEP_COLS], with as
    many rows again (within ``max_bound_bytes``) from ``room_min_rows`` rows on, so that the
    bitmap words after the step rows seldom need the rows copied (``_finish``). The OS backs
    only the rows written."""
    n = bucket(rows)
    if n >= cfg.room_min_rows:
        n += max(0, min(n, cfg.max_bound_bytes // (abi.STEP_COLS * 4) - n))
    return np.zeros((n, abi.STEP_COLS), np.int32)


def _room(rows: int, revisits: int, tq: int, tk: int) -> int:
    """Rows for ``rows`` step rows written before the bitmap pass, ``revisits`` of them
    revisits (the pass leaves rows - revisits): the steps and the most words it can write (a
    bitmap per revisit), bucketed."""
    return bucket(rows + revisits * (abi.bitmap_rows(tq, tk) - 1))


def _finish(cfg: PlannerConfig, steps: np.ndarray, S: int, parts, tq: int, tk: int, top: int,
            njoin):
    """The plan's step array from ``steps``, whose rows [0, S) are the step rows (rows from S
    up to ``top`` may hold rows left behind: zeroed): the steps of the revisited tiles logged
    in ``parts`` ((log, log rows, tiles, how far that part's rows moved) per part, in row
    order) written, their bitmap words after the step rows (``plan_loops._nb_bm_pass``, the
    parts on threads: each writes its words after room for all the tiles of the parts before,
    moved down after); ``njoin[u]`` counts unit u's steps made whole (full). Returns (int32
    [bucket(S + words), STEP_COLS], word rows): a view of ``steps`` where it has the rows,
    else a copy of the step rows."""
    T = sum(p[2] for p in parts)
    if T == 0:
        out = steps[: bucket(S)]
        out[S:min(top, len(out))] = 0
        return out, 0
    wr = abi.bitmap_rows(tq, tk)
    need = bucket(S + T * wr)                  # room for a bitmap per tile
    if need <= steps.shape[0]:
        work = steps[:need]
        work[S:min(top, need)] = 0
    else:
        work = np.zeros((need, abi.STEP_COLS), np.int32)
        work[:S] = steps[:S]
    calls, room = [], []
    k = 0
    for log, nlog, n, shift in parts:
        if n:
            calls.append((_runner(cfg)._nb_bm_pass, log, nlog, shift, work,
                          (S + k * wr) * abi.STEP_COLS, tq, tk, njoin))
            room.append((log, nlog, shift, S + k * wr))
        k += n
    if cfg.threads >= 2 and len(calls) >= 2 and T * wr >= cfg.par_min_rows // 4:
        made = _on_threads_wide(cfg, calls)
    else:
        made = [fn(*a) for fn, *a in calls]
    dest = S
    for (log, nlog, shift, at), n in zip(room, made):
        if at > dest and n:            # the words down after those of the parts before
            _move_rows(work, dest, at, n * wr)
            _runner(cfg)._nb_bm_shift(log, nlog, shift, work, (at - dest) * abi.STEP_COLS)
        dest += n * wr
    words = dest - S
    out = work[: bucket(S + words)]
    out[S + words: min(S + T * wr, len(out))] = 0          # left behind by the moves
    return out, words


def warm_up() -> None:
    """Imports numba and compiles (or loads from numba's on-disk cache) every loop of the
    planner now, with the argument types plans pass them: ~0.4 s with the cache warm, 15-25 s
    cold (2-core CPU box). Without it, small plans run the loops interpreted, and larger ones
    are made by the NumPy tier while this runs in the background (``loops.start_warm_up``)."""
    _loops.compile_all()
    cfg = PlannerConfig(loops="compiled")
    z64 = np.zeros(1, np.int64)
    flags = np.zeros((1, 1), _U64)
    flags.setflags(write=False)                     # as a mask's blocks
    _loops._nb_pack(0, 1, flags, np.empty((1, 1), _U64))
    _loops._nb_row_index(0, 1, z64, z64, z64, z64 + 1, z64, 8, 8, np.empty((1, 1), np.int32))
    b = np.array([0, 1, 2])
    words = pack_rows(np.ones((1, 2, 2), bool))
    ctx = _Ctx(b, b, words, 8, 8, 1, 1, 8, 8, cfg)
    _plan_grid(ctx)
    _plan_pack(ctx)
    for merge in (False, True):
        _plan_rowgroups(ctx, merge)
        _loops._nb_count(0, 1, words, z64, z64, merge, b, b, 8, 3, 0, z64.copy())
    b = np.arange(9)                    # 1-token blocks, a checkerboard: a bitmap step
    ctx = _Ctx(b, b, pack_rows((np.add.outer(b[:8], b[:8]) % 2 == 0)[None]), 8, 8, 1, 1, 8, 8,
               cfg)
    _plan_grid(ctx)
    _bitmap_steps(_plan_grid(ctx, bitmaps=False), 8, 8, cfg)      # (the pass after the loops)
    _loops._nb_gather_window(np.ones((1, 1), bool), np.array([0, 8]), np.zeros(8, np.int64),
                             1, 1, 1)
    _loops._nb_gather_units(np.ones((1, 1, 1), bool), np.array([0, 8]), np.zeros(1, np.int64),
                            np.zeros(1, np.int64), np.ones(1, np.int64),
                            np.zeros((1, 8), np.int64), 1, 1, 1, 4)


def loops_ready(config: PlannerConfig = _config.DEFAULT) -> bool:
    """The compiled loops that ``config.loops`` "auto" plans with, ready now: a background
    warm-up started where none ran, then waited for (~0.4 s with numba's on-disk cache warm,
    15-25 s cold, once a process); False where they cannot run (no numba, a failed warm-up:
    the NumPy tier plans) or ``config`` does not use the warm-up."""
    if config.loops != "auto" or not config.background_compile:
        return False
    _loops.start_warm_up(warm_up)
    return _loops.wait_ready()


def _on_worker(fn, *args):
    """Starts fn(*args) on the planner's worker thread; returns its future."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():     # none yet, or inherited through fork
        import concurrent.futures
        _POOL = (os.getpid(),
                 concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tessera-plan"))
    return _POOL[1].submit(fn, *args)


def _run_split(cfg: PlannerConfig, fn, n, work, *args):
    """fn(lo, hi, *args) over [0, n): in two halves on two threads when ``cfg.threads`` >= 2
    and the work (a size, for equal items) is large enough to pay for the hand-off."""
    if not _two(cfg, n, work):
        fn(0, n, *args)
        return
    fut = _on_worker(fn, n // 2, n, *args)
    fn(0, n // 2, *args)
    fut.result()


def _plan_rowgroups(ctx: _Ctx, merge: bool, share: bool | None = None) -> _Raw:
    """keep / merge: one row group per unit, the group's K/V tiles anchored at interval starts
    (compiled; ``.unshared()`` of the result equals ``plan_oracle._plan_rowgroups_numpy``'s).
    The rows are ``pending``: the bitmap pass is ``_bitmap_steps``'s (``build_plan`` decides
    the fallback to split first, which is common on token-level masks: none of the pass is
    spent on rows it drops).
    ``share`` (default ``ctx.cfg.share_step_lists``): the interior units of a tall row group (same group,
    same rows) point at one copy of their step rows, so an all-selected mask stores one list
    per unit height instead of one per unit: a smaller plan to build and to copy to the GPU."""
    share = ctx.cfg.share_step_lists if share is None else bool(share)
    cfg, run = ctx.cfg, ctx.run
    tq, tk, al = ctx.tile_q, ctx.tile_kv, ctx.kv_align
    words = ctx.words
    gh, gi, ge, pc = run._nb_groups(words, merge)
    if len(gh) == 0:
        return _empty_raw(pending=True)
    kb = np.array(ctx.kb, np.int64)                # writable: one compiled specialisation
    ka = kb - kb % al                               # aligned start of each key block
    ltk = tk.bit_length() - 1 if tk & (tk - 1) == 0 else -1
    lim = ctx.kvp - tk                              # a tile starting past lim is shifted
    ug, qs, qlo, qhi = run._nb_units(np.array(ctx.qb, np.int64), gi, ge, tq, ctx.q_align, ctx.qp)
    U = len(ug)
    ugh, ugi = gh[ug], gi[ug]
    cmax = int(((kb[1:] - ka[:-1] + tk - 1) // tk).max())
    bound = np.zeros(U + 1, np.int64)              # cumulative bound on step rows
    np.cumsum(pc[ug] * cmax, out=bound[1:])
    cnt, upart, ukeys, rev, ptr = (np.empty(U, np.int64) for _ in range(5))
    B = int(bound[-1])
    common = (words, ugh, ugi, merge, qlo, qhi, kb, ka, tk, ltk, lim)
    if _wide(cfg, U, B):
        steps, S, ptr = _rowgroups_wide(cfg, common, bound, cnt, upart, ukeys, rev, share)
        nfull = np.where((qlo == 0) & (qhi == tq), cnt - upart, 0)
        raw = _Raw(ugh, qs, qlo, qhi, cnt, steps, nfull, (qhi - qlo) * ukeys, rev=rev,
                   pending=True)
        if share:
            raw.ptr, raw.stored = ptr, S
        return raw
    two = _two(cfg, U, B)
    mid = min(max(int(np.searchsorted(bound, B // 2)), 1), U - 1) if two else U
    if bucket(B) * abi.STEP_COLS * 4 <= cfg.max_bound_bytes:
        steps = np.zeros((bucket(B), abi.STEP_COLS), np.int32)
        r1 = int(bound[mid])
        out = (True, steps, cnt, upart, ukeys, rev, ptr, share)
        fut = _on_worker(run._nb_fill, mid, U, r1, *common, *out) if two else None
        e0 = run._nb_fill(0, mid, 0, *common, *out)
        S = e0
        if fut is not None:
            e1 = fut.result()
            S = e0 + e1 - r1
            if r1 > e0:                         # move the second half down, zero the rest
                _move_rows(steps, e0, r1, e1 - r1)
                steps[S:min(e1, bucket(S))] = 0        # the rest is outside the view
                ptr[mid:] -= r1 - e0
        steps = steps[: bucket(S)]     # a view; the OS never backs the bound's untouched rows
    else:
        cargs = (words, ugh, ugi, merge, kb, ka, tk, ltk, lim, cnt)
        fut = _on_worker(run._nb_count, mid, U, *cargs) if two else None
        run._nb_count(0, mid, *cargs)
        if fut is not None:
            fut.result()
        S = int(cnt.sum())
        r1 = int(cnt[:mid].sum())
        steps = np.zeros((bucket(S), abi.STEP_COLS), np.int32)
        share = False           # the halves are placed by exact counts: no rows left out
        out = (True, steps, cnt, upart, ukeys, rev, ptr, share)
        fut = _on_worker(run._nb_fill, mid, U, r1, *common, *out) if two else None
        run._nb_fill(0, mid, 0, *common, *out)
        if fut is not None:
            fut.result()
    nfull = np.where((qlo == 0) & (qhi == tq), cnt - upart, 0)
    raw = _Raw(ugh, qs, qlo, qhi, cnt, steps, nfull, (qhi - qlo) * ukeys, rev=rev, pending=True)
    if share:
        raw.ptr, raw.stored = ptr, S
    return raw


def _rowgroups_wide(cfg: PlannerConfig, common, bound, cnt, upart, ukeys, rev, share: bool):
    """keep/merge's step rows on ``cfg.threads`` threads: the units in chunks of about equal
    bound, each unit's steps counted, then each chunk written from its exact offset (both passes
    in parallel). A chunk's first unit never shares the rows of the unit before it (``_nb_fill``
    shares only inside [lo, hi)), so the rows a chunk stores are known before writing.
    Returns (steps, stored rows, ptr)."""
    words, ugh, ugi, merge, qlo, qhi, kb, ka, tk, ltk, lim = common
    U = len(cnt)
    run = _runner(cfg)
    edges = _wide_edges(bound, cfg.threads)
    chunks = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
    _on_threads_wide(cfg, [(run._nb_count, lo, hi, words, ugh, ugi, merge, kb, ka, tk, ltk, lim,
                            cnt) for lo, hi in chunks])
    stored = cnt.copy()
    if share and U > 1:         # the rows of a unit equal to the one before are not stored
        same = ((ugh[1:] == ugh[:-1]) & (ugi[1:] == ugi[:-1]) & (qlo[1:] == qlo[:-1])
                & (qhi[1:] == qhi[:-1]))
        same[edges[1:-1] - 1] = False                  # chunk starts store their rows
        stored[1:][same] = 0
    offs = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum([int(stored[lo:hi].sum()) for lo, hi in chunks], out=offs[1:])
    S = int(offs[-1])
    steps = np.zeros((bucket(S), abi.STEP_COLS), np.int32)
    ptr = np.empty(U, np.int64)
    ends = _on_threads_wide(cfg, [(run._nb_fill, lo, hi, int(o), *common, True, steps, cnt,
                                   upart, ukeys, rev, ptr, share)
                                  for (lo, hi), o in zip(chunks, offs[:-1])])
    if list(ends) != offs[1:].tolist():
        raise RuntimeError("planner: keep/merge step count changed between passes")
    return steps, S, ptr


def _empty_raw(pending: bool = False) -> _Raw:
    """No units (an empty mask); ``pending`` as the policy's rows would be."""
    z = np.zeros(0, np.int64)
    return _Raw(z, z, z, z, z, np.zeros((1, abi.STEP_COLS), np.int32), z, z, pending=pending)


def _plan_grid(ctx: _Ctx, bitmaps: bool = True) -> _Raw:
    """split: units are the query grid cells, K/V tiles the key grid cells (compiled steps:
    a counting pass, then the rows; the arrays equal ``plan_oracle._plan_grid_numpy``'s)."""
    tq = ctx.tile_q
    g = _grid_groups(ctx)
    if g is None:
        return _empty_raw(pending=not bitmaps)
    gh, gi, r0, r1, ustart, uq, lo, hi = g
    ugroups = np.stack([ustart, np.append(ustart[1:], len(gh))], axis=1)
    z = np.zeros(len(uq), np.int64)
    cnt, steps, nfull, area, rev, njoin, words = _rect_steps(ctx, gh, gi, r0, r1, ugroups, uq,
                                                             z, z + tq, True, bitmaps)
    return _Raw(gh[ustart], uq, lo, hi, cnt, steps, nfull, area, words=words,
                wr=abi.bitmap_rows(tq, ctx.tile_kv) if words else 0, rev=rev, njoin=njoin,
                pending=not bitmaps)


def _grid_groups(ctx: _Ctx):
    """split's row groups and units (None: no units): (head, query block, rows [r0, r1)) of
    each query block's piece in a query grid cell, the first group of each unit (head, cell),
    and each unit's q_start and owned rows [lo, hi)."""
    tq = ctx.tile_q
    nonempty = ctx.words.any(axis=-1)                          # [Hm, nq]
    own_q, cell, plo, phi = _chunk(ctx.qb[:-1], ctx.qb[1:], tq, tq, ctx.qp)
    gh, gp = np.nonzero(nonempty[:, own_q])
    if len(gh) == 0:
        return None
    gcell, gi = cell[gp], own_q[gp]
    r0, r1 = gcell + plo[gp], gcell + phi[gp]
    new = np.r_[True, (gh[1:] != gh[:-1]) | (gcell[1:] != gcell[:-1])]
    ustart = np.flatnonzero(new)
    uq = gcell[ustart]
    lo = np.minimum.reduceat(r0, ustart) - uq
    hi = np.maximum.reduceat(r1, ustart) - uq
    return gh, gi, r0, r1, ustart, uq, lo, hi


def _plan_pack(ctx: _Ctx, bitmaps: bool = True) -> _Raw:
    """pack: consecutive row groups share one unit while they fit in tile_q rows; each unit's
    K/V tiles are anchored at the runs of the union of its groups' key sets (compiled steps;
    the arrays
    equal ``plan_oracle._plan_pack_numpy``'s)."""
    gh, gi, ge, _ = ctx.run._nb_groups(ctx.words, True)
    if len(gh) == 0:
        return _empty_raw(pending=not bitmaps)
    qb = np.array(ctx.qb, np.int64)
    r0, r1 = qb[gi], qb[ge]
    ugroups = ctx.run._nb_pack_units(gh, r0, r1, ctx.tile_q, ctx.q_align)
    # Units: each packed unit's rows in tiles of tile_q (several only for one tall group).
    cu, qs, qlo, qhi = ctx.run._nb_units(qb, gi[ugroups[:, 0]], ge[ugroups[:, 1] - 1],
                                        ctx.tile_q, ctx.q_align, ctx.qp)
    ustart = ugroups[:, 0]
    ugroups = ugroups[cu]
    cnt, steps, nfull, area, rev, njoin, words = _rect_steps(ctx, gh, gi, r0, r1, ugroups, qs,
                                                             qlo, qhi, False, bitmaps)
    has = cnt > 0
    return _Raw(gh[ustart[cu]][has], qs[has], qlo[has], qhi[has], cnt[has], steps, nfull[has],
                area[has], words=words,
                wr=abi.bitmap_rows(ctx.tile_q, ctx.tile_kv) if words else 0, rev=rev[has],
                njoin=njoin[has], pending=not bitmaps)


def _bitmap_steps(raw: _Raw, tile_q: int, tile_kv: int,
                  cfg: PlannerConfig = _config.DEFAULT) -> _Raw:
    """The bitmap pass on a raw plan whose rows did not go through it in the step loops
    (``pending``: keep/merge's, and the policies' whose heads ``build_plan`` chooses first, on
    the chosen units only; or rows written otherwise, such as tests' hand-written rows): where
    a unit visits a K/V tile more than once (its rows in non-decreasing kv_start, plain and grid
    steps), the steps of that tile become one step selecting their union
    (``plan_loops._nb_bm_unit``, as in split/pack's loops: plain if a rectangle, a grid where
    it fits 4 x 4, else a bitmap step). Each distinct step range (units sharing rows keep
    sharing) is rewritten once, in row order, compactly (``plan_loops._nb_bm_ranges``): the
    step rows first, then the bitmap words (``abi.bitmap_rows`` rows each, ``_finish``). The
    raw as it is where no unit revisits a tile."""
    if raw.pending and not raw.rev.any():
        return dataclasses.replace(raw, pending=False)
    first, cnt = raw.first, raw.cnt
    U = len(cnt)
    live = np.flatnonzero(cnt > 0)
    big = int(raw.num_steps) + 1
    key = first[live].astype(np.int64) * big + cnt[live]
    uk, pick, inv = np.unique(key, return_index=True, return_inverse=True)
    rs, rn = uk // big, uk % big
    if raw.pending:                             # revisits counted by the step loops
        rrev = raw.rev[live[pick]]
    else:
        kv = raw.steps[:, abi.STEP_KV_START]
        same = np.r_[0, np.cumsum(kv[1:] == kv[:-1])]    # rows y <= x like y - 1
        rrev = same[rs + rn - 1] - same[rs]
    if not rrev.any():
        return dataclasses.replace(raw, pending=False) if raw.pending else raw
    tq, tk = tile_q, tile_kv
    R = len(uk)
    steps = np.zeros((_room(int(rn.sum()), int(rrev.sum()), tq, tk), abi.STEP_COLS), np.int32)
    nptr, ncnt, njoin = (np.zeros(R, np.int64) for _ in range(3))
    # Two halves of about equal work on two threads: the second written after the first's
    # rows as they were, then moved down.
    work = np.cumsum(np.where(rrev > 0, rn, 0))
    run = _runner(cfg)
    two = cfg.threads >= 2 and R >= 2 and int(work[-1]) >= cfg.par_min_rows // 4
    mid = min(max(int(np.searchsorted(work, work[-1] // 2)), 1), R - 1) if two else R
    r1 = int(rn[:mid].sum())
    args = (raw.steps, rs, rn, rrev, steps)
    fut = (_on_worker(run._nb_bm_ranges, mid, R, *args, r1, nptr, ncnt,
                      int(rn[mid:][rrev[mid:] > 0].sum())) if two else None)
    e0, log0, n0, t0 = run._nb_bm_ranges(0, mid, *args, 0, nptr, ncnt,
                                          int(rn[:mid][rrev[:mid] > 0].sum()))
    S, top, parts = e0, e0, [(log0, n0, t0, 0)]
    if fut is not None:
        e1, log1, n1, t1 = fut.result()
        S, top = e0 + e1 - r1, e1
        _move_rows(steps, e0, r1, e1 - r1)
        nptr[mid:] -= r1 - e0
        parts.append((log1, n1, t1, e0 - r1))
    out, words = _finish(cfg, steps, S, parts, tq, tk, top, njoin)
    ptr, new_cnt, rev, nj = (np.zeros(U, np.int64) for _ in range(4))
    inv = inv.reshape(-1)
    ptr[live] = nptr[inv]
    new_cnt[live] = ncnt[inv]
    rev[live] = rrev[inv]
    nj[live] = njoin[inv]
    return dataclasses.replace(raw, cnt=new_cnt, steps=out, nfull=raw.nfull + nj, ptr=ptr,
                               stored=S, words=words, wr=abi.bitmap_rows(tq, tk) if words else 0,
                               rev=rev, njoin=nj, pending=False)


def _raw_costs(raw: _Raw, ctx: _Ctx, shape: AttnShape, model, cnt=None) -> np.ndarray:
    """Estimated ns of each unit of ``raw``; ``cnt``: its step counts if not raw.cnt (the
    tiles it will visit after the bitmap pass, ``_Raw.visits``)."""
    cnt = raw.cnt if cnt is None else cnt
    return _sched.unit_costs(cnt, cnt - raw.nfull, tile_q=ctx.tile_q,
                             tile_kv=ctx.tile_kv, head_dim=shape.head_dim,
                             itemsize=np.dtype(shape.dtype).itemsize, model=model)


def _plan_policy(ctx: _Ctx, policy: str, share: bool | None = None,
                 bitmaps: bool = True) -> _Raw:
    """The units and steps of one policy (tiles once: the step loops join the pieces of one
    K/V tile into grid steps as they write them; with ``bitmaps`` one step of the steps of
    each tile a unit revisits, made by split/pack's loops as they write or by
    ``_bitmap_steps`` after keep/merge's; without, the raw is ``pending``)."""
    if policy == "split":
        return _plan_grid(ctx, bitmaps)
    if policy == "pack":
        return _plan_pack(ctx, bitmaps)
    raw = _plan_rowgroups(ctx, merge=(policy == "merge"), share=share)
    return _bitmap_steps(raw, ctx.tile_q, ctx.tile_kv, ctx.cfg) if bitmaps else raw


def build_plan(mask: BlockMask, q_shape, kv_shape, dtype, *, tile_q: int, tile_kv: int,
               policy: str = "merge", q_align: int = 1, kv_align: int = 1,
               template: str | None = None,
               cost_model: _sched.CostModel | None = None,
               unit_order: str = "interleaved",
               config: PlannerConfig | None = None,
               row_group: int | None = None) -> Plan:
    """Plans ``mask`` for q [B, Lq, Hq, D] / k, v [B, Lkv, Hkv, D] with the given tile shape.

    ``unit_order``: "interleaved" (default) or "head_major" (``schedule.order_units``); the
    runtime passes its template's ``unit_order``. ``template`` is only the name recorded in the
    plan (default ``f"xla_{tile_q}x{tile_kv}"``): the planner reads no template table.
    ``config``: the planner's options (``PlannerConfig``; None: ``config.DEFAULT``).
    ``row_group``: rows of a tile the kernel computes as one (a divisor of tile_q; None: the
    tile), so ``stats()`` counts a step's row groups its rectangle meets (a kernel that skips
    the others, like a Mosaic GPU template with ``wg_skip``: 64).
    """
    shape = check_shapes(q_shape, kv_shape, dtype)
    check_mask(mask, shape)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    for name, val in (("tile_q", tile_q), ("tile_kv", tile_kv), ("q_align", q_align),
                      ("kv_align", kv_align)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    abi.check_tiles(tile_q, tile_kv)
    if tile_q % q_align:
        raise ValueError(f"tile_q={tile_q} must be a multiple of q_align={q_align}")
    if tile_kv % kv_align:
        raise ValueError(f"tile_kv={tile_kv} must be a multiple of kv_align={kv_align}")
    if cost_model is None:
        cost_model = _sched.DEFAULT_COST_MODEL
    elif not isinstance(cost_model, _sched.CostModel):
        raise TypeError(f"cost_model must be a schedule.CostModel, got "
                        f"{type(cost_model).__name__}")
    if template is not None and not isinstance(template, str):
        raise TypeError(f"template must be a str (the name recorded in the plan) or None, "
                        f"got {type(template).__name__}")
    if unit_order not in _sched.UNIT_ORDERS:
        raise ValueError(f"unit_order must be one of {_sched.UNIT_ORDERS}, got {unit_order!r}")
    if row_group is not None and (isinstance(row_group, bool) or not isinstance(row_group, int)
                                  or row_group <= 0 or tile_q % row_group):
        raise ValueError(f"row_group must be None or a positive int dividing tile_q={tile_q}, "
                         f"got {row_group!r}")
    return build_unchecked(mask, shape, tile_q=tile_q, tile_kv=tile_kv, policy=policy,
                           q_align=q_align, kv_align=kv_align, template=template,
                           cost_model=cost_model, unit_order=unit_order,
                           config=_config.check(config), row_group=row_group)


def build_unchecked(mask: BlockMask, shape: AttnShape, *, tile_q: int, tile_kv: int,
                    policy: str, q_align: int, kv_align: int, template: str | None,
                    unit_order: str, cost_model: _sched.CostModel | None = None,
                    config: PlannerConfig | None = None, row_group: int | None = None) -> Plan:
    """``build_plan`` without its argument checks, for a caller that made them (the runtime:
    ``shape`` from ``validation.check_shapes``, the mask checked against it, tiles, alignment,
    policy and unit order from a ``Template``). Cached like ``build_plan``."""
    return _build_cached(mask, shape, tile_q, tile_kv, policy, q_align, kv_align,
                         template or f"xla_{tile_q}x{tile_kv}",
                         cost_model or _sched.DEFAULT_COST_MODEL, unit_order,
                         config or _config.DEFAULT, row_group or tile_q)


def clear_cache() -> None:
    """Forgets the cached plans (``tessera_jax.clear_caches`` calls it)."""
    _build_cached.cache_clear()


def _dedupe_heads(words: np.ndarray):
    """(distinct head words, map head -> distinct index): heads with identical masks share
    their units' steps (a shared mask is the case of a single head)."""
    Hm = words.shape[0]
    if Hm == 1:
        return words, np.zeros(1, np.int64)
    flat = words.reshape(Hm, -1)
    sample = flat[:, :: max(1, flat.shape[1] // 256)]     # a cheap key; checked exactly below
    fp = [row.tobytes() for row in sample]
    rep: dict = {}
    hmap = np.empty(Hm, np.int64)
    distinct: list[int] = []
    for h in range(Hm):
        for k in rep.get(fp[h], ()):
            if np.array_equal(flat[distinct[k]], flat[h]):
                hmap[h] = k
                break
        else:
            rep.setdefault(fp[h], []).append(len(distinct))
            hmap[h] = len(distinct)
            distinct.append(h)
    if len(distinct) == Hm:
        return words, np.arange(Hm)
    return words[distinct], hmap


@functools.lru_cache(maxsize=32)
def _build_cached(mask, shape, tile_q, tile_kv, policy, q_align, kv_align, template,
                  cost_model, unit_order, cfg, row_group) -> Plan:
    """The plan (cached by the mask's digest and every argument, the ``PlannerConfig``
    included); the arguments are checked by the callers. Steps: the policy's raw plan of the
    distinct mask heads (``_policy_raw``), its units expanded to query heads
    (``_expand_heads``), ordered (``schedule.order_units``) and packed (``_assemble``)."""
    qp = _round_up(max(shape.q_len, tile_q), q_align)
    # Gathered steps copy chunks of GATHER_ROWS keys: the padded keys hold whole chunks.
    kv_step = math.lcm(kv_align, abi.GATHER_ROWS) if policy in GATHER_RUNS else kv_align
    kvp = _round_up(max(shape.kv_len, tile_kv), kv_step)
    words, hmap = _dedupe_heads(pack_rows(mask.blocks, cfg))
    ctx = _Ctx(mask.q_bounds, mask.kv_bounds, words, tile_q, tile_kv, q_align, kv_align,
               qp, kvp, cfg, row_group)
    raw, head_policies, mixed, compile_later = _tiered_policy_raw(ctx, policy, shape,
                                                                  cost_model, hmap,
                                                                  mask.num_heads)
    # Tiles once: one step of each (unit, K/V tile), made by split's step loops, else by
    # _bitmap_steps.
    cost = _raw_costs(raw, ctx, shape, cost_model)
    # Selected interactions per unit, from its rectangles (each is computed exactly once).
    per_unit = [raw.head, raw.qs, raw.lo, raw.hi, raw.cnt, raw.first, cost, raw.area]
    if mixed:                             # units of a distinct head must be contiguous
        srt = np.argsort(raw.head, kind="stable")
        per_unit = [x[srt] for x in per_unit]
    Hq = shape.num_q_heads
    qmap = np.zeros(Hq, np.int64) if mask.num_heads == 1 else hmap
    uh, (qs, lo, hi, cnt, first, cost, uarea) = _expand_heads(per_unit, qmap, words.shape[0])
    order = _sched.order_units(cost, qs, uh // (Hq // shape.num_kv_heads), uh, unit_order)
    units = _assemble(*(x[order] for x in (uh, qs, lo, hi, first, cnt)))
    cost = cost[order]
    for a in (units, raw.steps, cost):
        a.setflags(write=False)
    U = len(uh)
    if compile_later:                     # after this plan: it never waits for numba
        _loops.start_warm_up(warm_up)
    return Plan(template=template, policy=policy, tile_q=tile_q, tile_kv=tile_kv, shape=shape,
                q_len_padded=qp, kv_len_padded=kvp, units=units,
                steps=raw.steps,                # padded to bucket(S) by the policy
                num_units=U, num_steps=raw.num_steps,
                max_steps=bucket(int(cnt.max()) if U else 0), bitmap_rows=raw.words,
                mask_digest=mask.digest, selected_interactions=int(uarea.sum()),
                mask=mask, head_policies=head_policies, unit_cost=cost, cost_model=cost_model,
                unit_order=unit_order, config=cfg, row_group=row_group,
                maybe_all_full=bool(int(raw.nfull.sum()) >= int(raw.cnt.sum())))


def _tiered_policy_raw(ctx: _Ctx, policy: str, shape: AttnShape, cost_model, hmap,
                       num_heads: int):
    """``_policy_raw``'s (raw, head policies, mixed), by the tier ``ctx.cfg.loops`` picks (the
    same plan from each), and whether to start compiling the loops once the plan is built.
    "vectorised": the NumPy tier (``planning.vectorised``; the ``auto`` policy: interpreted
    loops). "auto": the loops, compiled once ready; a loop call too large to interpret before
    that (``loops.NotReady``) makes the whole plan the NumPy tier's, and the loops compile
    in the background after it (``background_compile``, ``loops.start_warm_up``; without
    it, or for the ``auto`` policy, the plan compiles them first)."""
    cfg = ctx.cfg
    if cfg.loops == "vectorised":
        got = _vectorised_policy_raw(ctx, policy, shape, hmap, num_heads)
        if got is None:
            got = _policy_raw(ctx, policy, shape, cost_model, hmap, num_heads)
        return (*got, False)
    try:
        return (*_policy_raw(ctx, policy, shape, cost_model, hmap, num_heads), False)
    except _loops.NotReady:
        pass
    got = (_vectorised_policy_raw(ctx, policy, shape, hmap, num_heads)
           if cfg.background_compile else None)
    if got is None:
        _loops.ensure_compiled()
        return (*_policy_raw(ctx, policy, shape, cost_model, hmap, num_heads), False)
    return (*got, True)


def _vectorised_policy_raw(ctx: _Ctx, policy: str, shape: AttnShape, hmap, num_heads: int):
    """``_policy_raw`` by the NumPy tier, or None for ``auto`` (which it lacks)."""
    from tessera_jax.planning import vectorised
    if policy in GATHER_RUNS:
        return _gather_policy_raw(ctx, policy, shape, num_heads,
                                  lambda: vectorised.split_raw(ctx))
    return vectorised.policy_raw(ctx, policy, shape, hmap, num_heads)


def _policy_raw(ctx: _Ctx, policy: str, shape: AttnShape, cost_model, hmap, num_heads: int):
    """(raw plan of the distinct mask heads after the bitmap pass, policy of each mask head,
    whether the heads' units come from several policies) under ``policy``, the invariant
    (``dense_tile_interactions``: a head computes at most what a dense plan of these tiles
    computes) enforced; the split plan meets it wherever its tiles are visited once."""
    if policy in GATHER_RUNS:
        return _gather_policy_raw(ctx, policy, shape, num_heads,
                                  lambda: _plan_policy(ctx, "split"),
                                  window=_gather_window(ctx))
    bound = dense_tile_interactions(shape.q_len, shape.kv_len, ctx.tile_q, ctx.tile_kv)
    if policy == "auto":
        raw, choice = _auto_raw(ctx, shape, cost_model, bound)
        return raw, tuple(_AUTO_CANDIDATES[choice[k]] for k in hmap), True
    if policy == "split":             # always within dense: the step loops' bitmap pass
        return _plan_policy(ctx, policy), (policy,) * num_heads, False
    # Enforced: a head whose plan computes more than dense takes split's plan, where that
    # computes less (a mask of 1-token blocks under keep/merge: a tile anchored at every
    # block start). Token-level masks make such heads common, so the bitmap pass runs
    # after the choice (``_bitmap_steps``), never on rows that are then dropped; the
    # comparison counts the tiles each unit will visit after it.
    Hd, tq, tk = ctx.words.shape[0], ctx.tile_q, ctx.tile_kv
    raw = _plan_policy(ctx, policy, bitmaps=False)
    head_policies, mixed = (policy,) * num_heads, False
    comp = _head_computed(raw, Hd, tq, tk, raw.visits())
    if (comp > bound).any():
        alt = _plan_policy(ctx, "split", share=False, bitmaps=False)
        use = (comp > bound) & (_head_computed(alt, Hd, tq, tk, alt.visits()) < comp)
        if use.any():
            raw = _Raw.concat([raw.unshared().select_heads(~use), alt.select_heads(use)])
            head_policies = tuple("split" if use[k] else policy for k in hmap)
            mixed = True
    return _bitmap_steps(raw, tq, tk, ctx.cfg), head_policies, mixed


#: Mean query blocks per query tile up to which the gather policy plans with NumPy's
#: all-units pass even where the compiled loops run (the same steps): 2-9x faster than the
#: compiled loops at 1-2.4 blocks a tile (Wan 480p corpus masks, 12 heads: ssta 29 against 215
#: ms, vsa 115 / 265; Wan 720p sparge, 40 heads: 0.93 / 6.2 s), 1.8x at 4 (random 32-token
#: blocks); the loops win from ~8 (token-level masks, 4-token blocks: 2.4 against 3.9 s).
GATHER_NUMPY_MAX_BLOCKS = 4.0


def _gather_window(ctx: _Ctx):
    """The gather policy's unit loop for the loops' tier: NumPy's (None) where query blocks
    are large (``GATHER_NUMPY_MAX_BLOCKS``); else the compiled loop once it is ready; before
    that, NumPy's for a small mask, else ``NotReady`` (the NumPy tier plans it and the loops
    compile meanwhile: interpreted, the loop is slower than NumPy's); NumPy's under
    "interpreted" and "vectorised"."""
    cfg = ctx.cfg
    if ctx.tile_q * (len(ctx.qb) - 1) <= GATHER_NUMPY_MAX_BLOCKS * int(ctx.qb[-1]) \
            and cfg.loops != "compiled":
        return None
    if cfg.loops == "compiled" or (cfg.loops == "auto" and _loops.ready()):
        return _runner(cfg)._nb_gather_window
    if cfg.loops == "auto" and ctx.words.shape[0] * ctx.words.shape[1] * (len(ctx.kb) - 1) \
            > cfg.interp_max_work:
        raise _loops.NotReady("_nb_gather_window")
    return None


def _gather_policy_raw(ctx: _Ctx, policy: str, shape: AttnShape, num_heads: int, split,
                       window=None):
    """``_policy_raw`` of a gather policy: its plan where every head computes at most what a
    dense plan of these tiles computes, else ``split()``'s plan, whole (many small classes
    per window: token-level masks)."""
    raw = _gather_raw(ctx, shape, GATHER_RUNS[policy], window)
    bound = dense_tile_interactions(shape.q_len, shape.kv_len, ctx.tile_q, ctx.tile_kv)
    if (_head_computed(raw, ctx.words.shape[0], ctx.tile_q, ctx.tile_kv) <= bound).all():
        return raw, (policy,) * num_heads, False
    return split(), ("split",) * num_heads, False


def _gather_raw(ctx: _Ctx, shape: AttnShape, run: int, window=None) -> _Raw:
    """A gather policy's raw plan (``planning.gather``): a unit owns its segment's rows.
    ``window``: the loop of one unit (``loops._nb_gather_window``; None: NumPy's); with it,
    the compiled loop over all units (``loops._nb_gather_units``)."""
    nk = len(ctx.kb) - 1
    blocks = np.unpackbits(np.ascontiguousarray(ctx.words).view(np.uint8), axis=-1,
                           bitorder="little")[..., :nk].astype(bool)
    units = None if window is None else _runner(ctx.cfg)._nb_gather_units
    g = _gather_policy.plan_gather(ctx.qb, ctx.kb, blocks, ctx.tile_q, ctx.tile_kv, shape.q_len,
                                   ctx.qp, ctx.kvp, run, row_group=ctx.row_group,
                                   window=window, units=units)
    return _Raw(g.head, g.qs, g.lo, g.hi, g.cnt, g.steps, g.nfull, g.area,
                words=g.word_rows, wr=abi.gather_word_rows(ctx.tile_q, ctx.tile_kv))


def _auto_raw(ctx: _Ctx, shape: AttnShape, cost_model, bound: int):
    """(raw plan, candidate index of each distinct mask head) of ``auto``: per head the
    candidate of least estimated cost among those within the invariant (all if none is)."""
    # Unshared rows: the heads' policies are mixed by selecting rows in unit order; the
    # bitmap pass runs on the selected units only, the candidates counting the steps it
    # will leave.
    Hd, tq, tk = ctx.words.shape[0], ctx.tile_q, ctx.tile_kv
    raws = [_plan_policy(ctx, p, share=False, bitmaps=False) for p in _AUTO_CANDIDATES]
    visits = [r.visits() for r in raws]
    costs = [_raw_costs(r, ctx, shape, cost_model, v) for r, v in zip(raws, visits)]
    per_head = np.stack([np.bincount(r.head, weights=c, minlength=Hd)
                         for r, c in zip(raws, costs)])
    over = np.stack([_head_computed(r, Hd, tq, tk, v) > bound for r, v in zip(raws, visits)])
    per_head = np.where(over & ~over.all(axis=0), np.inf, per_head)
    choice = np.argmin(per_head, axis=0)            # ties -> the earlier policy
    raw = _bitmap_steps(_Raw.concat([r.select_heads(choice == k) for k, r in enumerate(raws)]),
                        tq, tk, ctx.cfg)
    return raw, choice


def _expand_heads(per_unit, qmap, Hd: int):
    """(query head of each unit, the other per-unit arrays) with the units of distinct mask
    head ``qmap[h]`` repeated for each query head h (equal heads share their steps)."""
    n_d = np.bincount(per_unit[0], minlength=Hd)
    start_d = np.cumsum(n_d) - n_d
    n_q = n_d[qmap]
    take = np.repeat(start_d[qmap] - (np.cumsum(n_q) - n_q), n_q) + np.arange(int(n_q.sum()))
    uh = np.repeat(np.arange(len(qmap)), n_q)
    return uh, [x[take] for x in per_unit[1:]]


def _assemble(uh, qs, lo, hi, first, cnt) -> np.ndarray:
    """The int32 unit table [bucket(U), UNIT_COLS] of units in schedule order."""
    units = np.zeros((bucket(len(uh)), abi.UNIT_COLS), np.int32)
    for col, x in ((abi.UNIT_HEAD, uh), (abi.UNIT_Q_START, qs), (abi.UNIT_OWN_LO, lo),
                   (abi.UNIT_OWN_HI, hi), (abi.UNIT_STEP_PTR, first), (abi.UNIT_STEP_CNT, cnt)):
        units[:len(uh), col] = x
    return units


def dense_tile_interactions(q_len: int, kv_len: int, tile_q: int, tile_kv: int) -> int:
    """Interactions per query head of a dense plan of these tiles, ceil(Lq / tile_q) tile_q x
    ceil(Lkv / tile_kv) tile_kv: the planner's bound on what one head computes (``build_plan``
    falls back to ``split`` for a head above it). Lq x Lkv (``dense_interactions`` per head)
    when the tiles divide the lengths; a tile is computed whole even where it overhangs."""
    return -(-q_len // tile_q) * tile_q * (-(-kv_len // tile_kv)) * tile_kv


def _head_computed(raw: _Raw, Hd: int, tile_q: int, tile_kv: int, cnt=None) -> np.ndarray:
    """Computed interactions of each distinct mask head of a raw plan (``cnt``: its units'
    step counts if not raw.cnt, e.g. ``raw.visits()``)."""
    return np.bincount(raw.head, weights=raw.cnt if cnt is None else cnt,
                       minlength=Hd) * float(tile_q * tile_kv)


def _row_index(uh, qs, lo, hi, order, Hq, Lq, tile_q, sentinel,
               cfg: PlannerConfig = _config.DEFAULT):
    """row_index [Hq, Lq]: u * tile_q + r for the row r of unit u that owns it, else sentinel.

    uh, qs, lo, hi: the units before scheduling, ``order`` the schedule (unit u is
    ``order[u]`` of these). Written head by head in row order (compiled, the query heads split
    over ``cfg.threads`` threads); units arrive in (head, row) order, else are sorted first.
    """
    U = len(uh)
    uidx = np.empty(U, np.int64)
    uidx[order] = np.arange(U)
    f0 = uh * Lq + qs + lo
    if U and not np.all(f0[1:] > f0[:-1]):
        srt = np.argsort(f0, kind="stable")
        uh, qs, lo, hi, uidx = uh[srt], qs[srt], lo[srt], hi[srt], uidx[srt]
    if cfg.loops != "vectorised":
        out = np.empty((Hq, Lq), np.int32)
        try:
            _run_split(cfg, _runner(cfg)._nb_row_index, Hq, Hq * Lq, uh, qs, lo, hi, uidx,
                       tile_q, sentinel, out)
            return out
        except _loops.NotReady:         # "auto" before the loops are ready: the NumPy tier's
            pass
    from tessera_jax.planning import vectorised
    return vectorised.row_index(uh, qs, lo, hi, uidx, Hq, Lq, tile_q, sentinel)


def _gathered_cells(steps, us, i, r0, r1, c0, c1, tile_kv: int):
    """The cells of ``abi.selected_cells`` with those of gathered steps cut at chunk bounds
    and moved to absolute keys (start[c // GATHER_ROWS] + c % GATHER_ROWS)."""
    g = abi.is_gather(steps[us[i], abi.STEP_CUTS_B]) if len(i) else np.zeros(0, bool)
    if not g.any():
        return i, r0, r1, c0, c1
    A = abi.GATHER_ROWS
    gi = np.flatnonzero(g)
    a, b = c0[gi] // A, -(-c1[gi] // A)
    n = b - a
    rep = np.repeat(gi, n)
    ch = np.repeat(a, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    lo = np.maximum(c0[rep], ch * A)
    hi = np.minimum(c1[rep], ch * A + A)
    off = steps[us[i[rep]], abi.STEP_CUTS_A].astype(np.int64)
    start = steps.reshape(-1)[off + ch].astype(np.int64)
    keep = np.flatnonzero(~g)
    cat = lambda x, y: np.concatenate([x[keep], y])      # noqa: E731
    i2 = cat(i, i[rep])
    out = (i2, cat(r0, r0[rep]), cat(r1, r1[rep]), cat(c0, start + lo - ch * A),
           cat(c1, start + hi - ch * A))
    o = np.argsort(i2, kind="stable")
    return tuple(x[o] for x in out)


def _tile_rects(plan: Plan) -> dict:
    u = plan.units[: plan.num_units].astype(np.int64)
    cnt = u[:, abi.UNIT_STEP_CNT]
    T = int(cnt.sum())
    unit = np.repeat(np.arange(plan.num_units), cnt)
    step = np.repeat(u[:, abi.UNIT_STEP_PTR] - (np.cumsum(cnt) - cnt), cnt) + np.arange(T)
    st = plan.steps[step]
    q0 = u[unit, abi.UNIT_Q_START]
    k0 = st[:, abi.STEP_KV_START].astype(np.int64)
    q_lo, q_hi, kv_lo, kv_hi = abi.unpack_rect(st[:, abi.STEP_RECT].astype(np.int64))
    cb = st[:, abi.STEP_CUTS_B].astype(np.int64)
    bitmap = cb == abi.BITMAP_FLAG
    gather = abi.is_gather(cb)
    return {"unit": unit, "step": step, "head": u[unit, abi.UNIT_HEAD],
            "q0": q0, "q1": q0 + plan.tile_q, "k0": k0, "k1": k0 + plan.tile_kv,
            "r0": q0 + q_lo, "r1": q0 + q_hi, "c0": k0 + kv_lo, "c1": k0 + kv_hi,
            "cuts_a": st[:, abi.STEP_CUTS_A].astype(np.int64), "cuts_b": cb,
            "grid": (cb != 0) & ~bitmap & ~gather, "bitmap": bitmap, "gather": gather}


def tile_kinds(plan: Plan, rects: dict | None = None) -> np.ndarray:
    """Kind of each computed tile (as in ``tile_rects``): 0 kept, 1 merged, 2 split."""
    t = rects if rects is not None else _tile_rects(plan)
    qb, kb = plan.mask.q_bounds, plan.mask.kv_bounds

    def span(b, a0, a1):
        f = np.searchsorted(b, a0, side="right") - 1
        l = np.searchsorted(b, a1 - 1, side="right") - 1
        return (b[f] < a0) | (b[l + 1] > a1), l > f

    cut_q, many_q = span(qb, t["r0"], t["r1"])
    cut_k, many_k = span(kb, t["c0"], t["c1"])
    kind = np.where(many_q | many_k, 1, 0)
    kind = np.where(cut_q | cut_k, 2, kind).astype(np.int8)
    g = np.flatnonzero(t["grid"])
    if g.size:
        kind[g] = _grid_kinds(qb, kb, t["r0"][g], t["r1"][g], t["c0"][g], t["c1"][g],
                              t["cuts_a"][g], t["cuts_b"][g], t["q0"][g], t["k0"][g])
    b = np.flatnonzero(t["bitmap"])
    if b.size:
        kind[b] = _bitmap_kinds(plan, qb, kb, t["step"][b], t["q0"][b], t["k0"][b],
                                (many_q | many_k)[b])
    return kind


_KIND_CHUNK = 1 << 22     # bitmap entries classified at a time


def _bitmap_kinds(plan: Plan, qb, kb, step, q0, k0, many) -> np.ndarray:
    """``tile_kinds`` of bitmap steps, from their selections (``abi.step_mask``), as
    ``_grid_kinds`` with entries for cells: *split* if a selected entry has a side that is no
    block bound with no selected entry across it (the block goes on outside the selection),
    else *merged* if its (tight) bounding box crosses a block bound (``many``), else *kept*.
    One evaluation per distinct (step, q0, k0)."""
    tq, tk = plan.tile_q, plan.tile_kv
    key = np.stack([step, q0, k0], axis=1)
    uniq, inv = np.unique(key, axis=0, return_inverse=True)
    split = np.zeros(len(uniq), bool)
    per = max(1, _KIND_CHUNK // (tq * tk))
    for a in range(0, len(uniq), per):
        s, qa, ka = uniq[a:a + per].T
        sel = abi.step_mask(plan.steps, s, tq, tk)                      # [n, T, Tk]
        # Row r / key c starts a block: the side above r / left of c is a block bound.
        qs = np.isin(qa[:, None] + np.arange(tq + 1), qb)                # [n, T + 1]
        ks = np.isin(ka[:, None] + np.arange(tk + 1), kb)
        pad = np.zeros((len(s), tq + 2, tk + 2), bool)
        pad[:, 1:-1, 1:-1] = sel
        open_up = sel & ~pad[:, :-2, 1:-1] & ~qs[:, :-1, None]
        open_down = sel & ~pad[:, 2:, 1:-1] & ~qs[:, 1:, None]
        open_left = sel & ~pad[:, 1:-1, :-2] & ~ks[:, None, :-1]
        open_right = sel & ~pad[:, 1:-1, 2:] & ~ks[:, None, 1:]
        split[a:a + per] = (open_up | open_down | open_left | open_right).any(axis=(1, 2))
    sp = split[inv.reshape(-1)]
    return np.where(sp, 2, np.where(many, 1, 0)).astype(np.int8)


def _grid_kinds(qb, kb, r0, r1, c0, c1, cuts_a, cuts_b, q0, k0) -> np.ndarray:
    """``tile_kinds`` of grid steps, from their selected cells: *split* if a logical block
    the step selects part of reaches outside its selection (a side of a selected cell that is
    no block bound, with no selected cell across it), else *merged* if it selects several
    blocks, else *kept*."""
    (q1, q2, q3), (k1, k2, k3), bits = abi.unpack_grid(cuts_a, cuts_b)
    R = np.stack([r0, q0 + q1, q0 + q2, q0 + q3, r1], axis=1)          # [G, 5] absolute
    K = np.stack([c0, k0 + k1, k0 + k2, k0 + k3, c1], axis=1)
    i = np.arange(abi.GRID)
    sel = (((bits[:, None, None] >> (abi.GRID * i[:, None] + i[None, :])) & 1) == 1)
    rne, kne = R[:, 1:] > R[:, :-1], K[:, 1:] > K[:, :-1]             # non-empty segments
    sel &= rne[:, :, None] & kne[:, None, :]                           # [G, 4 rows, 4 keys]

    def neighbours(ne):
        """For each segment, the previous / next non-empty segment (-1: none)."""
        G = ne.shape[0]
        prev = np.full((G, abi.GRID), -1)
        nxt = np.full((G, abi.GRID), -1)
        last = np.full(G, -1)
        for a in range(abi.GRID):
            prev[:, a] = last
            last = np.where(ne[:, a], a, last)
        last = np.full(G, -1)
        for a in range(abi.GRID - 1, -1, -1):
            nxt[:, a] = last
            last = np.where(ne[:, a], a, last)
        return prev, nxt

    def across(idx, axis):
        """Whether the cell across (segment ``idx`` [G, 4] along ``axis``) is selected."""
        ok = idx >= 0
        if axis == 1:
            got = np.take_along_axis(sel, np.maximum(idx, 0)[:, :, None], axis=1)
            return got & ok[:, :, None]
        got = np.take_along_axis(sel, np.maximum(idx, 0)[:, None, :], axis=2)
        return got & ok[:, None, :]

    rp, rn = neighbours(rne)
    kp, kn = neighbours(kne)
    on_q = np.isin(R, qb)                                              # sides on block bounds
    on_k = np.isin(K, kb)
    cut = ((~on_q[:, :-1, None] & ~across(rp, 1)) | (~on_q[:, 1:, None] & ~across(rn, 1))
           | (~on_k[:, None, :-1] & ~across(kp, 2)) | (~on_k[:, None, 1:] & ~across(kn, 2)))
    split = (sel & cut).any(axis=(1, 2))
    # Blocks of each selected cell: several in one cell, or cells in different blocks.
    fq = np.searchsorted(qb, R[:, :-1], side="right") - 1
    lq = np.searchsorted(qb, R[:, 1:] - 1, side="right") - 1
    fk = np.searchsorted(kb, K[:, :-1], side="right") - 1
    lk = np.searchsorted(kb, K[:, 1:] - 1, side="right") - 1
    many = ((lq > fq)[:, :, None] | (lk > fk)[:, None, :]) & sel
    bid = (fq[:, :, None] * len(kb) + fk[:, None, :]).astype(np.int64)
    lo = np.where(sel, bid, np.iinfo(np.int64).max).min(axis=(1, 2))
    hi = np.where(sel, bid, -1).max(axis=(1, 2))
    merged = many.any(axis=(1, 2)) | (hi > lo)
    return np.where(split, 2, np.where(merged, 1, 0)).astype(np.int8)


def _computed(plan: Plan, rects: dict, tiles: int) -> int:
    """Interactions the kernel computes: tile_q x tile_kv a visit, or with row groups
    (``Plan.row_group``) row_group x tile_kv per group the step's rectangle meets (a step
    whose rectangle is empty computes none)."""
    g = plan.row_group or plan.tile_q
    if g >= plan.tile_q:
        return tiles * plan.tile_q * plan.tile_kv
    lo, hi = rects["r0"] - rects["q0"], rects["r1"] - rects["q0"]
    groups = np.where(hi > lo, -(-hi // g) - lo // g, 0)
    return int(groups.sum()) * g * plan.tile_kv


def _stats(plan: Plan) -> dict:
    U = plan.num_units
    cnt = plan.step_counts().astype(np.int64)
    tiles = int(cnt.sum())
    sel = plan.selected_interactions
    itemsize = np.dtype(plan.shape.dtype).itemsize
    rects = _tile_rects(plan)
    computed = _computed(plan, rects, tiles)
    gathered = rects["gather"]
    if gathered.any():          # kept / merged / split say how blocks map to fixed tiles
        kinds = np.zeros(3, np.int64)
    else:
        kinds = np.bincount(tile_kinds(plan, rects), minlength=3)     # plans hold their mask
    full = ((rects["r0"] == rects["q0"]) & (rects["r1"] == rects["q1"])
            & (rects["c0"] == rects["k0"]) & (rects["c1"] == rects["k1"]) & (rects["cuts_b"] == 0))
    nfull = int(full.sum()) + int((rects["cuts_b"] == abi.GATHER_FULL_FLAG).sum())
    # Visits of a K/V tile the unit visited before (visits come in unit order; a gathered
    # step's tile is its chunks, not a run from kv_start).
    by = np.lexsort((rects["k0"], rects["unit"]))
    by = by[~gathered[by]]
    ku, kk = rects["unit"][by], rects["k0"][by]
    revisits = int(((ku[1:] == ku[:-1]) & (kk[1:] == kk[:-1])).sum())
    Hq, Lq, Lkv = plan.shape.num_q_heads, plan.shape.q_len, plan.shape.kv_len
    if plan.policy in ("split", "auto"):
        fallback = 0
    elif plan.mask is not None and plan.mask.num_heads == 1:
        fallback = Hq if plan.head_policies[:1] == ("split",) else 0
    else:
        fallback = plan.head_policies.count("split")
    cost = plan.unit_cost if plan.unit_cost is not None else np.zeros(U)
    nsm = plan.cost_model.num_sms
    hp = {p: plan.head_policies.count(p) for p in _BASE_POLICIES}
    return {
        "template": plan.template,
        "policy": plan.policy,
        "head_policies": hp,
        "tile_q": plan.tile_q,
        "tile_kv": plan.tile_kv,
        "row_group": plan.row_group or plan.tile_q,
        "units": U,
        "tiles": tiles,
        "full_tiles": nfull,
        "partial_tiles": tiles - nfull,
        "selected_interactions": int(sel),
        "computed_interactions": int(computed),
        "dense_interactions": int(Lq * Lkv * Hq),
        "dense_tile_interactions": int(
            dense_tile_interactions(Lq, Lkv, plan.tile_q, plan.tile_kv) * Hq),
        "tile_revisits": revisits,
        "grid_steps": int(rects["grid"].sum()),
        "bitmap_steps": int(rects["bitmap"].sum()),
        "gather_steps": int(gathered.sum()),
        "fallback_heads": int(fallback),
        "waste_fraction": float(1.0 - sel / computed) if computed else 0.0,
        "kv_bytes": int(tiles * 2 * plan.tile_kv * plan.shape.head_dim * itemsize),
        "kept": int(kinds[0]),
        "merged": int(kinds[1]),
        "split": int(kinds[2]),
        "max_unit_cost": float(cost.max()) if U else 0.0,
        "est_time_us": _sched.makespan(cost, nsm) / 1e3,
        "balance": _sched.balance(cost, nsm),
        "capacities": plan.capacities,
        "unit_order": plan.unit_order,
    }
