"""Flax integration: block-sparse attention inside ``flax.nnx`` models and denoising loops.

Three pieces:

* ``make_attention_fn(mask_or_schedule)``: an ``attention_fn`` for
  ``flax.nnx.MultiHeadAttention(..., attention_fn=...)``.
* ``SparseSelfAttention``: a small nnx self-attention layer taking a ``BlockMask`` or a
  ``MaskSchedule``.
* ``MaskSchedule``: which mask each (layer, denoising step) uses; ``None`` means dense.

Masks are static host objects: planning happens at trace time, so the mask of a call must be
known while tracing. A schedule's step is therefore a Python int (an argument, or the
``at_step`` context); a jit-compiled loop groups its steps into the few distinct per-layer mask
tuples ("variants") and traces one model forward per variant (see
``tessera_jax.models.loop``), never one per step.

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

__all__ = ["AttentionOptions", "MaskSchedule", "SparseAttentionFn", "SparseSelfAttention",
           "at_step", "attention", "current_step", "make_attention_fn"]

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
    """

    backend: str | None = None
    template: str | None = None
    policy: str | None = None
    dense_implementation: str | None = None
    sparse_fn: Callable | None = None

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


DEFAULT_OPTIONS = AttentionOptions()


def _sparse_attention(q, k, v, mask, scale, options: AttentionOptions):
    if options.sparse_fn is not None:
        return options.sparse_fn(q, k, v, mask, scale=scale)
    from tessera_jax.runtime.api import sparse_attention  # late: keeps import order loose
    return sparse_attention(q, k, v, mask, scale=scale, backend=options.backend,
                            template=options.template, policy=options.policy)


def attention(q, k, v, mask: BlockMask | None, *, scale: float | None = None,
              options: AttentionOptions = DEFAULT_OPTIONS):
    """Attention over q [B, Lq, Hq, D], k, v [B, Lkv, Hkv, D]: sparse for a mask, dense for None.

    The dense path is ``jax.nn.dot_product_attention`` (what a model runs in its dense warm-up
    steps and what the cuDNN baseline measures); the sparse path is
    ``tessera_jax.sparse_attention``. Output [B, Lq, Hq, D] in q.dtype.
    """
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
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
    """
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step must be a Python int (static at trace time), got {type(step).__name__}")
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
    if source is not None and not isinstance(source, (BlockMask, MaskSchedule)):
        raise TypeError(f"{name} must be a BlockMask, a MaskSchedule or None, "
                        f"got {type(source).__name__}")
    return source


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
