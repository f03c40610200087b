"""Jit-compiled flow-matching Euler loops: one driven by a ``MaskSchedule`` (static masks), one
by a ``DynamicSchedule`` (masks built from q and k inside the loop, the schedule as data).

Static masks must all be known while tracing. Tracing one model forward per step (50 copies of
a 30-54 layer model) would make compile time and program size grow with the number of steps.
Instead the schedule's steps are grouped into *variants* (distinct per-layer mask tuples; a
warm-up schedule has two: dense and sparse) and the loop traces **one forward per variant**:

* ``mode="phases"``: one ``lax.fori_loop`` per maximal run of equal steps (dense warm-up steps,
  then sparse steps). Straight-line loop bodies, no device-side branching. Chosen by "auto"
  when each variant forms a single run.
* ``mode="switch"``: one ``fori_loop`` over all steps whose body is ``lax.switch`` between the
  variants, indexed by a constant step->variant table. One traced forward per distinct variant
  however they interleave (e.g. a dense refresh every 10 steps). "auto" picks it otherwise.
* ``mode="unroll"``: every step traced separately (tiny models and debugging only).

A ``DynamicSchedule`` (``DynamicSampler``) traces **one forward** for the whole loop: the step is
the ``fori_loop`` counter (data), each layer reads ``table[step, layer]`` and ``lax.switch``es
between dense attention and its rules, and the rules' states (SVG2's centroids) ride in the
loop carry. The table is an argument, so another table of the same shape reuses the executable.
``mode="unroll"`` traces every step with a Python-int step, each layer's choice then read on
the host and no ``lax.switch`` (the reference the tests compare the switch against).

The step index stays dynamic inside a phase; only the sigma/timestep values depend on it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import flax.nnx as nnx

from tessera_jax.flax import (DEFAULT_OPTIONS, AttentionOptions, DynamicSchedule, LayerAttention,
                              MaskSchedule)

__all__ = ["MODES", "DynamicSampler", "DynamicSchedule", "MaskSchedule", "Sampler",
           "flow_sigmas", "make_forward", "make_sampler"]

MODES = ("auto", "phases", "switch", "unroll")


def flow_sigmas(num_steps: int, shift: float = 5.0) -> np.ndarray:
    """float64 [num_steps + 1]: shifted flow-matching sigmas from 1 (noise) to 0 (data).

    sigma' = shift * s / (1 + (shift - 1) * s) over s = linspace(1, 0) (Wan2.1 / HunyuanVideo
    samplers; shift 5 for Wan 480p, 7 for HunyuanVideo-1.5 I2V).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps <= 0:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not np.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be finite and positive, got {shift}")
    s = np.linspace(1.0, 0.0, int(num_steps) + 1)
    return shift * s / (1.0 + (shift - 1.0) * s)


def _model_layers(model) -> int:
    n = getattr(model, "num_layers", None)
    if not isinstance(n, int):
        raise TypeError("model must expose num_layers (an int) and take "
                        "(x, t, context, *, masks=..., options=..., cond=...)")
    return n


@dataclasses.dataclass(eq=False)
class Sampler:
    """A compiled denoising loop: ``sampler(noise, context) -> latent`` after all steps.

    Build with ``make_sampler``. ``trace_count`` counts traces of the whole loop (it stays 1
    across calls with the same shapes), ``traced_forwards`` the model forwards in that trace.
    """

    model: nnx.Module
    schedule: MaskSchedule
    sigmas: np.ndarray
    guidance_scale: float | None
    mode: str
    options: AttentionOptions
    token_order: np.ndarray | None = None
    trace_count: int = 0
    traced_forwards: int = 0

    def __post_init__(self):
        self.graphdef = nnx.graphdef(self.model)
        self._jitted = jax.jit(self._run)

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    def _args(self, noise, context, negative_context, cond):
        if (self.guidance_scale is None) != (negative_context is None):
            raise ValueError("negative_context is required with guidance_scale and only then")
        return nnx.state(self.model), noise, context, negative_context, cond

    def __call__(self, noise, context, negative_context=None, cond=None):
        return self._jitted(*self._args(noise, context, negative_context, cond))

    def lower(self, noise, context, negative_context=None, cond=None):
        """``jax.jit(...).lower`` of the loop (for AOT compilation and timing without warm-up runs)."""
        return self._jitted.lower(*self._args(noise, context, negative_context, cond))

    def _velocity(self, model, masks, x, t, ctx, neg, cond):
        self.traced_forwards += 1
        B = x.shape[0]
        if self.guidance_scale is None:
            return model(x, jnp.full((B,), t), ctx, masks=masks, options=self.options, cond=cond,
                         token_order=self.token_order)
        x2 = jnp.concatenate([x, x])
        c2 = None if cond is None else jnp.concatenate([cond, cond])
        v = model(x2, jnp.full((2 * B,), t), jnp.concatenate([ctx, neg]), masks=masks,
                  options=self.options, cond=c2, token_order=self.token_order).astype(jnp.float32)
        return v[B:] + self.guidance_scale * (v[:B] - v[B:])

    def _run(self, state, x, ctx, neg, cond):
        self.trace_count += 1
        model = nnx.merge(self.graphdef, state)
        sig = jnp.asarray(self.sigmas, jnp.float32)
        variants = self.schedule.variants

        def step(variant, i, x):
            s, s_next = sig[i], sig[i + 1]
            v = self._velocity(model, variants[variant], x, s * 1000.0, ctx, neg, cond)
            return (x.astype(jnp.float32) + (s_next - s) * v.astype(jnp.float32)).astype(x.dtype)

        mode = self.mode
        if mode == "auto":
            mode = "phases" if len(self.schedule.runs()) == len(variants) else "switch"
        if mode == "unroll":
            for i, var in enumerate(self.schedule.step_variant):
                x = step(int(var), i, x)
        elif mode == "phases" or len(variants) == 1:
            for start, stop, var in self.schedule.runs():
                x = jax.lax.fori_loop(start, stop, lambda i, x, var=var: step(var, i, x), x)
        else:
            table = jnp.asarray(self.schedule.step_variant)
            branches = [lambda i, x, var=var: step(var, i, x) for var in range(len(variants))]
            x = jax.lax.fori_loop(0, self.num_steps,
                                  lambda i, x: jax.lax.switch(table[i], branches, i, x), x)
        return x


@dataclasses.dataclass(eq=False)
class DynamicSampler(Sampler):
    """A compiled denoising loop with a ``DynamicSchedule``: ``sampler(noise, context) ->
    latent``. Build with ``make_sampler``.

    One ``lax.fori_loop`` over the steps; the carry is the latent and every layer's rule
    states. ``table`` (optional, [num_steps, num_layers] ints) replaces the schedule's choices
    without recompiling. ``trace_count`` counts traces of the loop (1 per shapes),
    ``traced_forwards`` model forwards traced (1 for the compiled loop; one per step with
    ``mode="unroll"``).
    """

    def __post_init__(self):
        super().__post_init__()
        self._table = None

    def table_array(self, table=None):
        """The choices as a device array (the schedule's, put on the device once)."""
        if table is not None:
            return jnp.asarray(self.schedule.check_table(table))
        if self._table is None:
            self._table = jax.device_put(self.schedule.table)
        return self._table

    def _args(self, noise, context, negative_context, cond, table):
        if (self.guidance_scale is None) != (negative_context is None):
            raise ValueError("negative_context is required with guidance_scale and only then")
        if table is not None and self.mode == "unroll":
            raise ValueError("mode='unroll' runs the schedule's own table (read on the host); "
                             "another table needs the compiled loop (mode='auto')")
        return (nnx.state(self.model), noise, context, negative_context, cond,
                self.table_array(table))

    def __call__(self, noise, context, negative_context=None, cond=None, table=None):
        return self._jitted(*self._args(noise, context, negative_context, cond, table))

    def lower(self, noise, context, negative_context=None, cond=None, table=None):
        """``jax.jit(...).lower`` of the loop; call the compiled loop with
        ``(nnx.state(model), noise, context, negative_context, cond, sampler.table_array())``."""
        return self._jitted.lower(*self._args(noise, context, negative_context, cond, table))

    def attention_shapes(self, noise, context):
        """(q shape, kv shape) of the self-attention of one forward of this loop."""
        cfg = self.model.cfg
        B = noise.shape[0] * (1 if self.guidance_scale is None else 2)
        tokens = int(np.prod([n // p for n, p in zip(noise.shape[1:4], cfg.patch)]))
        L = cfg.self_attention_len(tokens, context.shape[1])
        return (B, L, cfg.num_heads, cfg.head_dim), (B, L, cfg.num_heads, cfg.head_dim)

    def _run(self, state, x, ctx, neg, cond, table):
        self.trace_count += 1
        model = nnx.merge(self.graphdef, state)
        sig = jnp.asarray(self.sigmas, jnp.float32)
        q_shape, kv_shape = self.attention_shapes(x, ctx)
        states0 = self.schedule.init_states(q_shape, kv_shape, jnp.dtype(model.cfg.dtype))

        host = self.mode == "unroll"       # Python-int steps: choices read on the host

        def step(i, carry):
            x, states = carry
            layers = [LayerAttention(self.schedule, l, i, states[l],
                                     table=None if host else table, options=self.options)
                      for l in range(len(states))]
            v = self._velocity(model, layers, x, sig[i] * 1000.0, ctx, neg, cond)
            x = (x.astype(jnp.float32) + (sig[i + 1] - sig[i]) * v.astype(jnp.float32)).astype(x.dtype)
            return x, tuple(la.state for la in layers)

        if self.mode == "unroll":
            carry = (x, states0)
            for i in range(self.num_steps):
                carry = step(i, carry)
            return carry[0]
        return jax.lax.fori_loop(0, self.num_steps, step, (x, states0))[0]


def make_sampler(model: nnx.Module, schedule: MaskSchedule | DynamicSchedule, *,
                 shift: float = 5.0, guidance_scale: float | None = None, mode: str = "auto",
                 options: AttentionOptions = DEFAULT_OPTIONS,
                 token_order=None) -> Sampler | DynamicSampler:
    """A jit-compiled ``schedule.num_steps``-step Euler loop of ``model`` (see module doc for mode).

    A ``MaskSchedule`` gives a ``Sampler`` (static masks); a ``DynamicSchedule`` a
    ``DynamicSampler`` (one traced forward; ``mode`` "auto" or "unroll").
    ``token_order``: the video token order the schedule's masks refer to (see ``WanModel``).
    """
    if not isinstance(schedule, (MaskSchedule, DynamicSchedule)):
        raise TypeError(f"schedule must be a MaskSchedule or a DynamicSchedule, got "
                        f"{type(schedule).__name__}")
    n = _model_layers(model)
    if schedule.num_layers != n:
        raise ValueError(f"schedule has {schedule.num_layers} layers but the model has {n}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if guidance_scale is not None:
        guidance_scale = float(guidance_scale)
    if isinstance(schedule, DynamicSchedule):
        if mode not in ("auto", "unroll"):
            raise ValueError(f"a DynamicSchedule's loop takes mode 'auto' or 'unroll', got {mode!r}")
        return DynamicSampler(model, schedule, flow_sigmas(schedule.num_steps, shift),
                              guidance_scale, mode, options, token_order)
    return Sampler(model, schedule, flow_sigmas(schedule.num_steps, shift), guidance_scale, mode,
                   options, token_order)


def make_forward(model: nnx.Module, masks=None, *, options: AttentionOptions = DEFAULT_OPTIONS,
                 token_order=None) -> Callable:
    """Jitted single forward ``f(state, x, t, context, cond=None)`` with static per-layer masks.

    Pass ``nnx.state(model)`` as ``state`` (for step-time measurements).
    """
    graphdef = nnx.graphdef(model)

    @jax.jit
    def f(state, x, t, context, cond=None):
        return nnx.merge(graphdef, state)(x, t, context, masks=masks, options=options, cond=cond,
                                                 token_order=token_order)

    return f
