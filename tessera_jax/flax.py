"""Flax integration: block-sparse attention inside ``flax.nnx`` models and denoising loops.

Four pieces:

* ``make_attention_fn(mask_or_schedule)``: an ``attention_fn`` for
  ``flax.nnx.MultiHeadAttention(..., attention_fn=...)``.
* ``SparseSelfAttention``: a small nnx self-attention layer taking a ``BlockMask`` or a
  ``MaskSchedule``.
* ``MaskSchedule``: which static mask each (layer, denoising step) uses; ``None`` means dense.
* ``DynamicSchedule`` and ``LayerAttention``: the schedule as data, for masks built from each
  layer's q and k inside the compiled loop (``tessera_jax.masks.dynamic``).

A ``MaskSchedule`` holds static host masks: planning happens at trace time, so the mask of a
call must be known while tracing and its step is a Python int (an argument, or the ``at_step``
context); a jit-compiled loop groups its steps into the few distinct per-layer mask tuples
("variants") and traces one model forward per variant (``tessera_jax.models.loop``).

A ``DynamicSchedule`` is data: an int32 table [steps, layers] of choices (0 dense, i >= 1 its
i-th rule) read with the *traced* step, so one traced forward serves every step; each layer
picks its attention with ``lax.switch`` and carries its rule's state (e.g. k-means centroids)
from step to step. Nothing in it is read at trace time, so ``at_step`` has no part in it.

This module is named ``flax``; it uses absolute imports (``import flax.nnx``), so the ``flax``
package is never shadowed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import flax.nnx as nnx

from tessera_jax.mask import BlockMask
from tessera_jax.runtime.options import Options

__all__ = ["AttentionOptions", "DynamicSchedule", "LayerAttention", "MaskSchedule",
           "SparseAttentionFn", "SparseSelfAttention", "at_step", "attention", "current_step",
           "dynamic_attention", "make_attention_fn"]

_DENSE_IMPLS = (None, "xla", "cudnn")


# --- the attention call ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How a layer runs attention: sparse backend for masked calls, dense implementation else.

    backend:   ``tessera_jax.sparse_attention`` backend (None: best available here).
    template, policy: force one kernel template / tiling policy (None: the ranking decides);
               a fixed template and ``policy="keep"`` give the "fixed single-template plan".
    dense_implementation: ``jax.nn.dot_product_attention`` implementation for dense calls
               (None: XLA picks; "cudnn" on GPU for the cuDNN baseline).
    sparse_fn: replaces the sparse call entirely: ``fn(q, k, v, mask, scale=...) -> out``
               (for tests and baselines; must be hashable, a module-level function is).
    sparse_options: ``tessera_jax.Options`` of the sparse calls (None: the defaults), e.g.
               ``Options(device_gather="traced")`` to gather per-head cluster bounds (the
               default device list ran SVG2's clusters faster: ``Options.device_gather``).
    """

    backend: str | None = None
    template: str | None = None
    policy: str | None = None
    dense_implementation: str | None = None
    sparse_fn: Callable | None = None
    sparse_options: Options | None = None

    def __post_init__(self):
        for name in ("backend", "template", "policy"):
            val = getattr(self, name)
            if val is not None and not isinstance(val, str):
                raise TypeError(f"{name} must be a str or None, got {type(val).__name__}")
        if self.dense_implementation not in _DENSE_IMPLS:
            raise ValueError(f"dense_implementation must be one of {_DENSE_IMPLS}, "
                             f"got {self.dense_implementation!r}")
        if self.sparse_fn is not None and not callable(self.sparse_fn):
            raise TypeError(f"sparse_fn must be callable, got {type(self.sparse_fn).__name__}")
        if self.sparse_options is not None and not isinstance(self.sparse_options, Options):
            raise TypeError(f"sparse_options must be a tessera_jax.Options or None, got "
                            f"{type(self.sparse_options).__name__}")


DEFAULT_OPTIONS = AttentionOptions()


def _sparse_attention(q, k, v, mask, scale, options: AttentionOptions):
    if options.sparse_fn is not None:
        return options.sparse_fn(q, k, v, mask, scale=scale)
    from tessera_jax.runtime.api import sparse_attention  # late: keeps import order loose
    return sparse_attention(q, k, v, mask, scale=scale, backend=options.backend,
                            template=options.template, policy=options.policy,
                            options=options.sparse_options)


def attention(q, k, v, mask, *, scale: float | None = None,
              options: AttentionOptions = DEFAULT_OPTIONS):
    """Attention over q [B, Lq, Hq, D], k, v [B, Lkv, Hkv, D]: sparse for a mask, dense for None.

    The dense path is ``jax.nn.dot_product_attention`` (what a model runs in its dense warm-up
    steps and what the cuDNN baseline measures); the sparse path is
    ``tessera_jax.sparse_attention``. ``mask`` may also be a ``LayerAttention`` (a dynamic
    schedule's layer at a traced step), which then decides, builds its mask and keeps its
    state. Output [B, Lq, Hq, D] in q.dtype.
    """
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if isinstance(mask, LayerAttention):
        return mask(q, k, v, scale=scale)
    if mask is None:
        return jax.nn.dot_product_attention(q, k, v, scale=scale,
                                            implementation=options.dense_implementation)
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a tessera_jax.BlockMask or None, got {type(mask).__name__}")
    return _sparse_attention(q, k, v, mask, scale, options)


# --- mask schedules ----------------------------------------------------------------------------
def _check_mask_entry(name: str, m):
    if m is not None and not isinstance(m, BlockMask):
        raise TypeError(f"{name} must be a BlockMask or None (dense), got {type(m).__name__}")
    return m


def _check_count(name: str, n) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {n}")
    return int(n)


class MaskSchedule:
    """The mask of every (layer, step): a ``BlockMask`` (sparse) or ``None`` (dense).

    A mask's heads are per query head (``Hm == Hq``) or shared (``Hm == 1``), so a schedule is
    per layer, head and step. Immutable and hashable by content: usable as a static argument.

    Args:
      table: ``[num_steps][num_layers]`` of ``BlockMask | None``.
    """

    __slots__ = ("table", "_digest", "_variants", "_step_variant")

    def __init__(self, table: Sequence[Sequence[BlockMask | None]]):
        if isinstance(table, (BlockMask, str)) or not isinstance(table, Sequence):
            raise TypeError(f"table must be a sequence (steps) of sequences (layers), "
                            f"got {type(table).__name__}")
        rows = []
        for s, row in enumerate(table):
            if isinstance(row, (BlockMask, str)) or not isinstance(row, Sequence):
                raise TypeError(f"table[{s}] must be a sequence of BlockMask | None (one per "
                                f"layer), got {type(row).__name__}")
            rows.append(tuple(_check_mask_entry(f"table[{s}][{l}]", m) for l, m in enumerate(row)))
        if not rows:
            raise ValueError("table must hold at least one step")
        if not rows[0]:
            raise ValueError("table[0] must hold at least one layer")
        for s, row in enumerate(rows):
            if len(row) != len(rows[0]):
                raise ValueError(f"table[{s}] has {len(row)} layers but table[0] has {len(rows[0])}")
        table = tuple(rows)
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray([len(table), len(table[0])], np.int64).tobytes())
        variants: dict[tuple, int] = {}
        step_variant = []
        for row in table:
            for m in row:
                h.update(b"-" if m is None else m.digest.encode())
            step_variant.append(variants.setdefault(row, len(variants)))
        sv = np.asarray(step_variant, np.int32)
        sv.setflags(write=False)
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "_digest", h.hexdigest())
        object.__setattr__(self, "_variants", tuple(variants))
        object.__setattr__(self, "_step_variant", sv)

    def __setattr__(self, name, value):
        raise AttributeError("MaskSchedule is immutable")

    # --- constructors -------------------------------------------------------------------------
    @classmethod
    def dense(cls, num_layers: int, num_steps: int) -> "MaskSchedule":
        """Dense attention everywhere (the baseline)."""
        num_layers, num_steps = _check_count("num_layers", num_layers), _check_count("num_steps", num_steps)
        return cls([[None] * num_layers] * num_steps)

    @classmethod
    def constant(cls, mask: BlockMask | None, num_layers: int, num_steps: int) -> "MaskSchedule":
        """One mask for every layer and step."""
        _check_mask_entry("mask", mask)
        num_layers, num_steps = _check_count("num_layers", num_layers), _check_count("num_steps", num_steps)
        return cls([[mask] * num_layers] * num_steps)

    @classmethod
    def from_fn(cls, fn: Callable[[int, int], BlockMask | None], num_layers: int,
                num_steps: int) -> "MaskSchedule":
        """``fn(layer, step) -> BlockMask | None``, called once per (layer, step) on the host.

        Return the *same* (equal) mask object for repeated entries: each distinct per-layer
        tuple of masks is one traced forward pass in a compiled loop.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        num_layers, num_steps = _check_count("num_layers", num_layers), _check_count("num_steps", num_steps)
        return cls([[fn(l, s) for l in range(num_layers)] for s in range(num_steps)])

    @classmethod
    def warmup(cls, masks, num_layers: int, num_steps: int, *, dense_steps: int = 0,
               dense_layers: Sequence[int] = ()) -> "MaskSchedule":
        """Dense for the first ``dense_steps`` steps (and always in ``dense_layers``), sparse after.

        masks: one ``BlockMask`` for all layers, a sequence with one ``BlockMask | None`` per
        layer, or ``fn(layer) -> BlockMask | None``. This is the common shape of published
        schedules (e.g. 12 of 50 dense steps for radial, 15 for sliding-tile attention), and it
        compiles to exactly two model forwards.
        """
        num_layers, num_steps = _check_count("num_layers", num_layers), _check_count("num_steps", num_steps)
        if isinstance(dense_steps, (bool, np.bool_)) or not isinstance(dense_steps, (int, np.integer)):
            raise TypeError(f"dense_steps must be an int, got {type(dense_steps).__name__}")
        if not 0 <= dense_steps <= num_steps:
            raise ValueError(f"dense_steps must be in [0, num_steps={num_steps}], got {dense_steps}")
        dense_layers = set(int(l) for l in dense_layers)
        bad = [l for l in dense_layers if not 0 <= l < num_layers]
        if bad:
            raise ValueError(f"dense_layers must be in [0, {num_layers}), got {sorted(bad)}")
        if isinstance(masks, BlockMask) or masks is None:
            per_layer = [masks] * num_layers
        elif callable(masks):
            per_layer = [masks(l) for l in range(num_layers)]
        elif isinstance(masks, Sequence) and not isinstance(masks, str):
            per_layer = list(masks)
            if len(per_layer) != num_layers:
                raise ValueError(f"masks has {len(per_layer)} entries but num_layers={num_layers}")
        else:
            raise TypeError(f"masks must be a BlockMask, a sequence of them or a callable, "
                            f"got {type(masks).__name__}")
        per_layer = [None if l in dense_layers else _check_mask_entry(f"masks[{l}]", m)
                     for l, m in enumerate(per_layer)]
        dense_row = [None] * num_layers
        return cls([dense_row if s < dense_steps else per_layer for s in range(num_steps)])

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.table)

    @property
    def num_layers(self) -> int:
        return len(self.table[0])

    @property
    def digest(self) -> str:
        return self._digest

    def _check_layer_step(self, layer, step) -> tuple[int, int]:
        for name, val, n in (("layer", layer, self.num_layers), ("step", step, self.num_steps)):
            if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
                raise TypeError(f"{name} must be a Python int (static at trace time), "
                                f"got {type(val).__name__}")
            if not 0 <= val < n:
                raise ValueError(f"{name} must be in [0, {n}), got {val}")
        return int(layer), int(step)

    def mask(self, layer: int, step: int) -> BlockMask | None:
        """The mask of (layer, step); None means dense."""
        layer, step = self._check_layer_step(layer, step)
        return self.table[step][layer]

    def step_masks(self, step: int) -> tuple:
        """One ``BlockMask | None`` per layer for this step."""
        _, step = self._check_layer_step(0, step)
        return self.table[step]

    @property
    def variants(self) -> tuple[tuple, ...]:
        """The distinct per-layer mask tuples, in order of first use."""
        return self._variants

    @property
    def step_variant(self) -> np.ndarray:
        """int32 [num_steps]: the variant index of each step."""
        return self._step_variant

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of equal variants: (first step, end step, variant)."""
        sv, out, start = self._step_variant, [], 0
        for s in range(1, len(sv) + 1):
            if s == len(sv) or sv[s] != sv[start]:
                out.append((start, s, int(sv[start])))
                start = s
        return out

    def is_uniform_in_steps(self) -> bool:
        return len(self._variants) == 1

    def density(self) -> np.ndarray:
        """float [num_steps, num_layers]: selected fraction (1.0 for dense entries)."""
        out = np.ones((self.num_steps, self.num_layers))
        for s, row in enumerate(self.table):
            for l, m in enumerate(row):
                if m is not None:
                    out[s, l] = m.density
        return out

    def __hash__(self) -> int:
        return hash(self._digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, MaskSchedule) and other._digest == self._digest

    def __repr__(self) -> str:
        return (f"MaskSchedule(steps={self.num_steps}, layers={self.num_layers}, "
                f"variants={len(self._variants)}, runs={len(self.runs())}, "
                f"mean_density={self.density().mean():.3f}, digest={self._digest[:8]})")


# --- the step of a schedule, at trace time ------------------------------------------------------
@dataclasses.dataclass
class _StepContext:
    step: int
    read: bool = False        # a layer took its masks from this step while tracing


_STEP: contextvars.ContextVar[_StepContext | None] = contextvars.ContextVar(
    "tessera_jax_step", default=None)


@contextlib.contextmanager
def at_step(step: int):
    """Layers that take a ``MaskSchedule`` use the masks of ``step`` inside this block.

    ``step`` is a Python int read while *tracing*. Enter it inside the jitted function (with the
    step a static argument, or a loop over variants as in ``tessera_jax.models.loop``). Entered
    around a call of an already-compiled function, the step would not reach it (jit's cache
    key does not hold it), so the block raises ``ValueError`` when it was entered outside any
    trace and no layer read its step (a compiled call reused the masks it was traced with).
    A ``DynamicSchedule`` never reads it: there the step is an argument (data).
    """
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be a Python int (static at trace time), got "
                        f"{type(step).__name__}; for a step that is data (a loop carry) use a "
                        "DynamicSchedule (tessera_jax.flax.DynamicSchedule)")
    from jax._src import core as _core      # trace_state_clean has no public name in jax 0.11
    outside = _core.trace_state_clean()
    ctx = _StepContext(int(step))
    token = _STEP.set(ctx)
    try:
        yield
    finally:
        _STEP.reset(token)
    if outside and not ctx.read:
        raise ValueError(
            f"at_step({step}) was entered outside jit and no layer read it: a call of an "
            "already-compiled function inside it reused the masks it was traced with. Enter "
            "at_step inside the jitted function with the step a static argument, pass step=... "
            "to the layer, or use tessera_jax.models.make_sampler")


def current_step() -> int | None:
    """The step set by the innermost ``at_step``, or None."""
    ctx = _STEP.get()
    return None if ctx is None else ctx.step


def _resolve_mask(source, layer: int, step: int | None) -> BlockMask | None:
    if source is None or isinstance(source, BlockMask):
        return source
    if step is None and _STEP.get() is not None:
        _STEP.get().read = True
        step = _STEP.get().step
    if step is None:
        if source.is_uniform_in_steps():
            step = 0
        else:
            raise ValueError("this layer takes a MaskSchedule whose masks change between steps: "
                             "pass step=... or call it inside `with tessera_jax.flax.at_step(s):`")
    return source.mask(layer, step)


def _check_source(name: str, source):
    if isinstance(source, DynamicSchedule):
        raise TypeError(f"{name}: a DynamicSchedule runs through LayerAttention with a traced "
                        "step (tessera_jax.models.make_sampler builds the loop), not as a "
                        "layer's static mask")
    if source is not None and not isinstance(source, (BlockMask, MaskSchedule)):
        raise TypeError(f"{name} must be a BlockMask, a MaskSchedule or None, "
                        f"got {type(source).__name__}")
    return source


# --- the schedule as data -------------------------------------------------------------------------
def _check_rule(i: int, rule):
    if not callable(rule) or not callable(getattr(rule, "init_state", None)):
        raise TypeError(f"rules[{i}] must be a dynamic mask rule: callable as rule(q, k, v, "
                        f"state, *, scale, attend) -> (out, state), with init_state(q_shape, "
                        f"kv_shape, dtype) (tessera_jax.masks.dynamic), got {type(rule).__name__}")
    try:
        hash(rule)
    except TypeError:
        raise TypeError(f"rules[{i}] must be hashable (a frozen dataclass): it is part of the "
                        f"compiled loop's static structure") from None
    return rule


class DynamicSchedule:
    """Which attention every (step, layer) runs, as data: ``table[step, layer]`` is 0 for dense
    attention or ``i`` for ``rules[i - 1]``, read with the *traced* step of a compiled loop.

    A rule builds its mask from the layer's q and k (``tessera_jax.masks.dynamic``: ``VSA``,
    ``SVG2``, ``Sparge``, ``XAttention``) and may carry a state from step to step (SVG2's
    centroids). Every layer can take every choice (``lax.switch``), so a new table of the same
    shape runs in the same executable: pass it to the sampler (``table=``) instead of
    recompiling. Immutable and hashable by content (a static argument).

    Args:
      rules: the sparse choices (hashable callables, see ``_check_rule``), at most 127.
      table: ints [num_steps, num_layers] in [0, len(rules)].
    """

    __slots__ = ("rules", "table", "_key")

    def __init__(self, rules, table):
        if callable(rules) or not isinstance(rules, Sequence) or isinstance(rules, str):
            raise TypeError(f"rules must be a sequence of dynamic mask rules, "
                            f"got {type(rules).__name__}")
        rules = tuple(_check_rule(i, r) for i, r in enumerate(rules))
        if len(rules) > 127:
            raise ValueError(f"at most 127 rules, got {len(rules)}")
        arr = np.asarray(table)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"table must hold ints (0 dense, i: rules[i - 1]), got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ValueError(f"table must be [num_steps, num_layers] with both >= 1, got shape "
                             f"{arr.shape}")
        if arr.min() < 0 or arr.max() > len(rules):
            raise ValueError(f"table entries must be in [0, {len(rules)}] (0 dense, i: "
                             f"rules[i - 1]), got [{arr.min()}, {arr.max()}]")
        arr = np.array(arr, np.int32, copy=True)
        arr.setflags(write=False)
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "table", arr)
        object.__setattr__(self, "_key", (rules, arr.shape, arr.tobytes()))

    def __setattr__(self, name, value):
        raise AttributeError("DynamicSchedule is immutable")

    @classmethod
    def warmup(cls, rule, num_layers: int, num_steps: int, *, dense_steps: int = 0,
               dense_layers: Sequence[int] = ()) -> "DynamicSchedule":
        """``rule`` in every layer and step, except dense ones: the first ``dense_steps`` steps
        and, always, the layers in ``dense_layers`` (the papers' warm-up shape)."""
        num_layers, num_steps = _check_count("num_layers", num_layers), _check_count("num_steps", num_steps)
        if isinstance(dense_steps, (bool, np.bool_)) or not isinstance(dense_steps, (int, np.integer)):
            raise TypeError(f"dense_steps must be an int, got {type(dense_steps).__name__}")
        if not 0 <= dense_steps <= num_steps:
            raise ValueError(f"dense_steps must be in [0, num_steps={num_steps}], got {dense_steps}")
        layers = [int(l) for l in dense_layers]
        bad = [l for l in layers if not 0 <= l < num_layers]
        if bad:
            raise ValueError(f"dense_layers must be in [0, {num_layers}), got {sorted(bad)}")
        table = np.ones((num_steps, num_layers), np.int32)
        table[:dense_steps] = 0
        table[:, layers] = 0
        return cls((rule,), table)

    @classmethod
    def dense(cls, num_layers: int, num_steps: int) -> "DynamicSchedule":
        """Dense attention everywhere (no rules)."""
        num_layers, num_steps = _check_count("num_layers", num_layers), _check_count("num_steps", num_steps)
        return cls((), np.zeros((num_steps, num_layers), np.int32))

    @property
    def num_steps(self) -> int:
        return self.table.shape[0]

    @property
    def num_layers(self) -> int:
        return self.table.shape[1]

    def check_table(self, table):
        """A replacement table for the same executable: an int array [num_steps, num_layers]
        (NumPy, checked here; a jax array is checked for shape and dtype only: its values are
        clamped by ``lax.switch``)."""
        if isinstance(table, jax.Array):
            if tuple(table.shape) != self.table.shape or not jnp.issubdtype(table.dtype, jnp.integer):
                raise ValueError(f"table must be an int array of shape {self.table.shape}, got "
                                 f"{table.dtype} {tuple(table.shape)}")
            return table.astype(jnp.int32)
        other = DynamicSchedule(self.rules, table)
        if other.table.shape != self.table.shape:
            raise ValueError(f"table must have shape {self.table.shape}, got {other.table.shape}")
        return other.table

    def init_states(self, q_shape, kv_shape, dtype) -> tuple:
        """The first loop carry: per layer, a tuple with each rule's initial state."""
        per_layer = tuple(r.init_state(tuple(q_shape), tuple(kv_shape), jnp.dtype(dtype))
                          for r in self.rules)
        return (per_layer,) * self.num_layers

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, DynamicSchedule) and other._key == self._key

    def __repr__(self) -> str:
        sparse = float(np.mean(self.table > 0))
        return (f"DynamicSchedule(steps={self.num_steps}, layers={self.num_layers}, "
                f"rules={[type(r).__name__ for r in self.rules]}, sparse_fraction={sparse:.3f})")


def _check_step(step):
    if step is None:
        raise ValueError("a DynamicSchedule needs step=... (an int or a traced int32 scalar, e.g. "
                         "the loop counter); at_step does not apply to it")
    if isinstance(step, (bool, np.bool_)) or not (
            isinstance(step, (int, np.integer))
            or (hasattr(step, "dtype") and jnp.issubdtype(step.dtype, jnp.integer)
                and getattr(step, "ndim", 1) == 0)):
        raise TypeError(f"step must be an int or an int scalar array, got "
                        f"{getattr(step, 'dtype', type(step).__name__)}")
    return step


def dynamic_attention(q, k, v, schedule: DynamicSchedule, *, layer: int, step, state,
                      table=None, scale: float | None = None,
                      options: AttentionOptions = DEFAULT_OPTIONS):
    """``(out, state)``: the attention ``schedule`` picks for ``layer`` at ``step``.

    ``step`` is data (a traced loop counter): ``choice = table[step, layer]`` (``table``
    defaults to the schedule's, a constant; pass a jax array to change the schedule without
    recompiling) selects, by ``lax.switch``, dense attention or rule ``choice - 1`` with its
    sparse attention (``options``: backend, or a ``sparse_fn`` such as a baseline's). A Python
    int step with a NumPy table resolves the choice on the host instead (no switch).
    ``state``: this layer's tuple of rule states (``schedule.init_states(...)[layer]``); only
    the chosen rule's entry changes. An out-of-range step or choice is clamped, never read out
    of bounds.
    """
    if not isinstance(schedule, DynamicSchedule):
        raise TypeError(f"schedule must be a DynamicSchedule, got {type(schedule).__name__}")
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) \
            or not 0 <= layer < schedule.num_layers:
        raise ValueError(f"layer must be an int in [0, {schedule.num_layers}), got {layer!r}")
    step = _check_step(step)
    state = tuple(state)
    if len(state) != len(schedule.rules):
        raise ValueError(f"state must hold one entry per rule ({len(schedule.rules)}), got "
                         f"{len(state)}")

    def dense(q, k, v, st):
        return attention(q, k, v, None, scale=scale, options=options), st

    if not schedule.rules:
        return dense(q, k, v, state)
    tbl = schedule.table if table is None else table
    static = isinstance(step, (int, np.integer)) and isinstance(tbl, np.ndarray)
    if static:      # a host step and table: the choice is known now (no switch traced)
        s = min(max(int(step), 0), tbl.shape[0] - 1)
        choice = min(max(int(tbl[s, int(layer)]), 0), len(schedule.rules))
    else:
        choice = jnp.asarray(tbl, jnp.int32)[step, int(layer)]

    def attend(q, k, v, mask):
        return _sparse_attention(q, k, v, mask, scale, options)

    def branch(i):
        def run(q, k, v, st):
            out, new = schedule.rules[i](q, k, v, st[i], scale=scale, attend=attend)
            # Keep every branch's state avals equal (lax.switch demands it).
            new = jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new, st[i])
            return out.astype(q.dtype), st[:i] + (new,) + st[i + 1:]
        return run

    branches = [dense] + [branch(i) for i in range(len(schedule.rules))]
    if static:
        return branches[choice](q, k, v, state)
    return jax.lax.switch(choice, branches, q, k, v, state)


class LayerAttention:
    """One layer of a ``DynamicSchedule`` in one traced forward, passed to a model where a
    layer's mask goes: ``attention(q, k, v, layer_attention)`` runs ``dynamic_attention`` and
    leaves the layer's new rule states in ``.state`` (read it after the forward; the loop
    carries it to the next step)."""

    __slots__ = ("schedule", "layer", "step", "table", "state", "options", "calls")

    def __init__(self, schedule: DynamicSchedule, layer: int, step, state, *, table=None,
                 options: AttentionOptions = DEFAULT_OPTIONS):
        if not isinstance(schedule, DynamicSchedule):
            raise TypeError(f"schedule must be a DynamicSchedule, got {type(schedule).__name__}")
        self.schedule, self.layer, self.step = schedule, int(layer), _check_step(step)
        self.table, self.state, self.options, self.calls = table, tuple(state), options, 0

    def __call__(self, q, k, v, *, scale: float | None = None):
        out, self.state = dynamic_attention(q, k, v, self.schedule, layer=self.layer,
                                            step=self.step, state=self.state, table=self.table,
                                            scale=scale, options=self.options)
        self.calls += 1
        return out


# --- attention_fn for flax.nnx.MultiHeadAttention -----------------------------------------------
@dataclasses.dataclass(frozen=True)
class SparseAttentionFn:
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention``; build it with ``make_attention_fn``.

    Called as ``fn(query, key, value, **flax_kwargs)`` with query [batch..., Lq, Hq, D] and
    key/value [batch..., Lkv, Hkv, D]. Hashable (a static attribute of the nnx graph). ``dtype``
    casts q, k, v; ``precision`` and ``promote_dtype`` are accepted and not used (the kernels
    accumulate in float32). Dense masks, bias, causal flags, dropout and sown weights raise.
    """

    source: BlockMask | MaskSchedule | None
    layer: int = 0
    step: int | None = None
    scale: float | None = None
    options: AttentionOptions = DEFAULT_OPTIONS

    def __call__(self, query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, promote_dtype=None, is_causal=False, **kwargs):
        if kwargs:
            raise TypeError(f"sparse attention_fn got unsupported arguments {sorted(kwargs)} "
                            f"(e.g. input_positions: apply RoPE before attention instead)")
        if bias is not None or mask is not None:
            raise ValueError("sparse attention_fn takes no dense `mask`/`bias` array: express the "
                             "mask as the BlockMask (BlockMask.from_token_mask)")
        if is_causal:
            raise ValueError("sparse attention_fn takes no is_causal=True: put causality in the "
                             "BlockMask")
        if dropout_rate and not deterministic:
            raise ValueError("sparse attention_fn has no attention dropout: use dropout_rate=0 "
                             "or deterministic=True")
        if module is not None:
            raise ValueError("sparse attention_fn can't sow attention weights (sow_weights=True): "
                             "it never materialises them")
        if dtype is not None:
            query, key, value = (x.astype(dtype) for x in (query, key, value))
        m = _resolve_mask(self.source, self.layer, self.step)
        batch = query.shape[:-3]
        if len(batch) != 1:  # flax allows any number of batch dims; the kernels take exactly one
            query, key, value = (x.reshape((int(np.prod(x.shape[:-3], dtype=np.int64)),)
                                           + x.shape[-3:]) for x in (query, key, value))
        out = attention(query, key, value, m, scale=self.scale, options=self.options)
        return out.reshape(batch + out.shape[-3:])


def make_attention_fn(mask_or_schedule: BlockMask | MaskSchedule | None, *, layer: int = 0,
                      step: int | None = None, scale: float | None = None,
                      backend: str | None = None, template: str | None = None,
                      policy: str | None = None,
                      dense_implementation: str | None = None) -> SparseAttentionFn:
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` running ``tessera_jax.sparse_attention``.

    With a ``MaskSchedule`` the mask is ``schedule.mask(layer, step)``; ``step`` is fixed here or
    taken at trace time from ``at_step``. ``None`` gives dense attention.
    """
    _check_source("mask_or_schedule", mask_or_schedule)
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if isinstance(mask_or_schedule, MaskSchedule):
        mask_or_schedule._check_layer_step(layer, 0 if step is None else step)
    elif step is not None:
        raise ValueError("step only applies to a MaskSchedule")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
        scale = float(scale)
    opts = AttentionOptions(backend=backend, template=template, policy=policy,
                            dense_implementation=dense_implementation)
    return SparseAttentionFn(mask_or_schedule, int(layer), None if step is None else int(step),
                             scale, opts)


# --- a small self-attention module ------------------------------------------------------------
class SparseSelfAttention(nnx.Module):
    """Multi-head self-attention whose attention is block-sparse: x [B, L, F] -> [B, L, F].

    Args:
      num_heads: query heads; ``num_kv_heads`` (default ``num_heads``) for GQA/MQA.
      in_features: F; ``head_dim`` defaults to F // num_heads.
      mask: a ``BlockMask`` over (L, L), a ``MaskSchedule`` (this module is ``layer`` of it) or
        None (dense). Static: stored in the graph definition, not as a parameter.
      qk_norm: RMS-normalise q and k per head (as video DiTs do).
    """

    def __init__(self, num_heads: int, in_features: int, *,
                 mask: BlockMask | MaskSchedule | None = None, layer: int = 0,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 qk_norm: bool = False, use_bias: bool = True, dtype=None,
                 param_dtype=jnp.float32, options: AttentionOptions = DEFAULT_OPTIONS,
                 rngs: nnx.Rngs):
        num_heads = _check_count("num_heads", num_heads)
        in_features = _check_count("in_features", in_features)
        num_kv_heads = num_heads if num_kv_heads is None else _check_count("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if in_features % num_heads:
                raise ValueError(f"in_features={in_features} must be a multiple of "
                                 f"num_heads={num_heads} (or pass head_dim)")
            head_dim = in_features // num_heads
        head_dim = _check_count("head_dim", head_dim)
        if not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
        mask = _check_source("mask", mask)
        # A static mask (or schedule) is part of the module's structure; a device mask is data.
        self.mask = (nnx.data(mask) if isinstance(mask, BlockMask) and not mask.is_static
                     else nnx.static(mask))
        if isinstance(mask, MaskSchedule):
            mask._check_layer_step(layer, 0)
        self.layer = int(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.options = options
        lin = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = nnx.Linear(in_features, num_heads * head_dim, **lin)
        self.kv = nnx.Linear(in_features, 2 * num_kv_heads * head_dim, **lin)
        self.out = nnx.Linear(num_heads * head_dim, in_features, **lin)
        if qk_norm:
            self.q_norm = nnx.RMSNorm(head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.k_norm = nnx.RMSNorm(head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, *, step: int | None = None,
                 mask: BlockMask | None = None):
        """x [B, L, F]; ``step`` picks a schedule's masks (or use ``at_step``); ``mask`` overrides."""
        if x.ndim != 3:
            raise ValueError(f"x must be [B, L, F], got shape {x.shape}")
        B, L, _ = x.shape
        q = self.q(x).reshape(B, L, self.num_heads, self.head_dim)
        k, v = jnp.split(self.kv(x).reshape(B, L, 2 * self.num_kv_heads, self.head_dim), 2, axis=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        m = _check_mask_entry("mask", mask) if mask is not None else _resolve_mask(self.mask, self.layer, step)
        o = attention(q, k, v, m, options=self.options)
        return self.out(o.reshape(B, L, self.num_heads * self.head_dim))
