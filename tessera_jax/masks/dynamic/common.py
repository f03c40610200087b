"""What the dynamic mask builders share: argument checks, the rules' typed options, the choice
between a GPU kernel (Mosaic GPU on Hopper, Triton on Ampere/Ada) and XLA's ops, block pooling
and each row's top k."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import _as_bounds

HI = jax.lax.Precision.HIGHEST

#: Values of a kernel option (``top_k``, ``pool``, ``kmeans_assign``): "mosaic" (the Mosaic
#: GPU kernel, ``pallas_kernels.mosaic``: Hopper), "triton" (the Pallas Triton kernel,
#: ``pallas_kernels.triton``: Ampere/Ada; "pallas" is its old name, the same computation),
#: "xla" (XLA's ops) or "auto" (the default: when the computation is compiled for a GPU, the
#: Mosaic GPU kernel, or the Triton one where this process's GPU predates Hopper; XLA's ops
#: elsewhere). A Triton kernel named explicitly runs under its interpreter when compiled for
#: another platform, a Mosaic one when the process has no GPU (slow); a kernel that does not
#: take the call's shape leaves it to XLA.
KERNEL_CHOICES = ("auto", "xla", "mosaic", "triton", "pallas")
#: The kernel family each explicit value names.
_FAMILY = {"mosaic": "mosaic", "triton": "triton", "pallas": "triton"}
#: Values of ``score_precision``: the matmul precision of pooled block scores.
SCORE_PRECISIONS = ("high", "highest")


# --- argument checks ---------------------------------------------------------------------
def check_int(fn: str, name: str, v, lo: int = 1, hi: int | None = None) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{fn}: {name} must be {rng}, got {v}")
    return int(v)


def check_frac(fn: str, name: str, v, *, lo_open=True, hi_open=False) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: {name} must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or (v <= 0 if lo_open else v < 0) or (v >= 1 if hi_open else v > 1):
        raise ValueError(f"{fn}: {name} must be in {'(' if lo_open else '['}0, 1"
                         f"{')' if hi_open else ']'}, got {v}")
    return v


def check_bool(fn: str, name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(v).__name__}")
    return bool(v)


def check_choice(fn: str, name: str, v, choices: tuple) -> str:
    if v not in choices:
        raise ValueError(f"{fn}: {name} must be one of {choices}, got {v!r}")
    return v


def check_scale(fn: str, scale, D: int) -> float:
    if scale is None:
        return float(D) ** -0.5
    if isinstance(scale, (bool, np.bool_)) or not isinstance(
            scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: scale must be a float or None, got {type(scale).__name__}")
    if not (math.isfinite(float(scale)) and scale > 0):
        raise ValueError(f"{fn}: scale must be a positive finite number, got {scale}")
    return float(scale)


def check_array(fn: str, name: str, x, ndim: int, what: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array {what}, got {type(x).__name__}")
    if len(x.shape) != ndim:
        raise ValueError(f"{fn}: {name} must be {what}, got shape {tuple(x.shape)}")
    if any(int(s) == 0 for s in x.shape):
        raise ValueError(f"{fn}: {name} has an empty axis: shape {tuple(x.shape)}")


def check_qk(fn: str, q, k) -> tuple[int, int, int, int, int, int]:
    """(B, Lq, Lkv, Hq, Hkv, D) of q [B, Lq, Hq, D] and k [B, Lkv, Hkv, D]."""
    check_array(fn, "q", q, 4, "[B, Lq, Hq, D]")
    check_array(fn, "k", k, 4, "[B, Lkv, Hkv, D]")
    for name, x in (("q", q), ("k", k)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{fn}: {name} must have a floating dtype, got {x.dtype}")
    B, Lq, Hq, D = (int(s) for s in q.shape)
    Bk, Lkv, Hkv, Dk = (int(s) for s in k.shape)
    if Bk != B:
        raise ValueError(f"{fn}: k has batch {Bk} but q has batch {B}")
    if Dk != D:
        raise ValueError(f"{fn}: k has head dim {Dk} but q has head dim {D}")
    if Hq % Hkv:
        raise ValueError(f"{fn}: q's heads Hq={Hq} must be a multiple of k's heads Hkv={Hkv} "
                         f"(GQA)")
    return B, Lq, Lkv, Hq, Hkv, D


def check_rule(fn: str, rule, cls):
    if not isinstance(rule, cls):
        raise TypeError(f"{fn}: rule must be a {cls.__name__}, got {type(rule).__name__}")
    return rule


def bounds_or_uniform(fn: str, name: str, bounds, block: int, length: int) -> np.ndarray:
    """Static block bounds [n + 1] from 0 to ``length``: ``bounds`` (a rule's tuple) if given,
    else ``block``-token blocks, the last one partial."""
    if bounds is not None:
        return _as_bounds(f"{fn}: {name}", np.asarray(bounds, np.int64), length)
    return np.append(np.arange(0, length, block, dtype=np.int64), np.int64(length))


# --- the rules' fields ---------------------------------------------------------------------
def static_bounds_field(rule, name: str):
    """A rule's bounds field as a tuple of ints (hashable: rules are static), None kept."""
    bounds = getattr(rule, name)
    if bounds is None:
        return
    where = f"{type(rule).__name__}: {name}"
    if isinstance(bounds, jax.Array):
        raise TypeError(f"{where} must be static (NumPy or a sequence of ints), got a jax array: "
                        f"the block layout of these builders is fixed at trace time")
    arr = np.asarray(bounds)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        raise TypeError(f"{where} must be 1-D ints, got {arr.dtype} of shape {arr.shape}")
    object.__setattr__(rule, name, tuple(int(x) for x in arr))


def check_fields(rule, spec: dict):
    """Validates a rule's fields; ``spec``: name -> (kind, *args) with kind "int", "frac",
    "bool", "choice" or "optional_int" / "optional_frac" (None allowed). Stores the normalised
    values (Python ints / floats / bools)."""
    fn = type(rule).__name__
    checks = {"int": check_int, "frac": check_frac, "bool": check_bool, "choice": check_choice}
    for name, (kind, *args) in spec.items():
        v = getattr(rule, name)
        if kind.startswith("optional_"):
            if v is None:
                continue
            kind = kind[len("optional_"):]
        kw = args.pop() if args and isinstance(args[-1], dict) else {}
        object.__setattr__(rule, name, checks[kind](fn, name, v, *args, **kw))


def check_pooled_rule(rule, spec: dict):
    """``check_fields`` of a block-pooling rule (VSA, SpargeAttn): its static bounds, the
    fields in ``spec`` and the pooling rules' kernel options."""
    static_bounds_field(rule, "q_bounds")
    static_bounds_field(rule, "kv_bounds")
    check_fields(rule, {**spec, "top_k": ("choice", KERNEL_CHOICES),
                        "pool": ("choice", KERNEL_CHOICES),
                        "score_precision": ("choice", SCORE_PRECISIONS)})


class Stateless:
    """A rule without a loop carry: ``mask(q, k, scale)`` builds the mask, the call runs the
    attention it is given on it."""

    def init_state(self, q_shape, kv_shape, dtype):
        return ()

    def __call__(self, q, k, v, state, *, scale=None, attend):
        return attend(q, k, v, self.mask(q, k, scale)), state


# --- kernel or XLA ---------------------------------------------------------------------------
def kernel_family(option: str) -> str | None:
    """The kernel family ("mosaic" or "triton") a kernel option runs on a GPU, None for "xla".
    "auto" takes Mosaic GPU unless this process's GPU predates Hopper (compute capability
    below 9.0: Ampere/Ada run the Triton kernels); without a visible GPU (a computation
    lowered here for another machine) it takes Mosaic GPU, Hopper's path."""
    if option == "xla":
        return None
    if option != "auto":
        return _FAMILY[option]
    from tessera_jax.runtime import dispatch
    cc = dispatch.gpu_capability()
    return "triton" if cc is not None and cc < (9, 0) else "mosaic"


def mosaic_module(name: str):
    """``pallas_kernels.mosaic.<name>``, or None where Mosaic GPU is not installed."""
    import importlib
    try:
        return importlib.import_module(f"pallas_kernels.mosaic.{name}")
    except ImportError:
        return None


def kernel_or_xla(option: str, kernels: dict, xla, *args):
    """``kernel(*args, interpret=...)`` or ``xla(*args)`` by a kernel option (``KERNEL_CHOICES``).
    ``kernels``: family ("mosaic", "triton") -> kernel, or None where that kernel does not take
    these arguments (then XLA's ops serve). The platform is that of the compilation
    (``lax.platform_dependent``: resolved when lowering, so a computation compiled for a GPU
    runs the kernel whatever the process's default backend, and nothing of the other branch is
    compiled)."""
    family = kernel_family(option)
    kernel = None if family is None else kernels.get(family)
    if kernel is None:
        return xla(*args)
    if option == "mosaic":
        # The Mosaic GPU interpreter calls back to the host (ordered effects), which a branch
        # of platform_dependent left out of the lowering cannot carry: a named Mosaic kernel
        # is interpreted when the process has no GPU (the Mosaic attention kernels' rule).
        from pallas_kernels import contract
        return kernel(*args, interpret=contract.default_interpret())
    on_gpu = functools.partial(kernel, interpret=False)
    off_gpu = xla if option == "auto" else functools.partial(kernel, interpret=True)
    return jax.lax.platform_dependent(*args, cuda=on_gpu, rocm=on_gpu, default=off_gpu)


def score_precision(option: str):
    return getattr(jax.lax.Precision, option.upper())


# --- pooling -------------------------------------------------------------------------------
def pool_sum(x, bounds: np.ndarray, pool: str = "auto"):
    """Float32 sum of ``x`` [B, L, H, F] over each static block: [B, n, H, F]. ``pool``: a
    kernel (2-byte inputs; Mosaic GPU: ``pallas_kernels.mosaic.pool``, Triton:
    ``pallas_kernels.triton.pool``, each within its limits) or XLA."""
    # The kernels for 2-byte inputs (q, k), read once in their dtype; float32 arrays the
    # builder derives (SpargeAttn's unit vectors) stay with XLA, which fuses their making
    # into the sums (through the Triton kernel they are written out first: 3.96 -> 4.51 ms).
    if pool == "xla" or jnp.dtype(x.dtype).itemsize > 2:
        return _pool_sum_xla(x, bounds)
    from pallas_kernels.triton import pool as tp
    mp = mosaic_module("pool")

    # Mask scores only (piecewise constant): the kernels have no autodiff rule.
    def triton(x, interpret):
        return tp.block_sums(jax.lax.stop_gradient(x), bounds, interpret=interpret)

    def mosaic(x, interpret):
        return mp.block_sums(jax.lax.stop_gradient(x), bounds, interpret=interpret)

    kernels = {"triton": triton if np.diff(bounds).max() <= tp.MAX_BLOCK else None,
               "mosaic": mosaic if mp and mp.supports(x.shape, x.dtype, bounds) else None}
    return kernel_or_xla(pool, kernels, lambda x: _pool_sum_xla(x, bounds), x)


def _pool_sum_xla(x, bounds: np.ndarray):
    sizes = np.diff(bounds)
    x = x.astype(jnp.float32)
    n, L = len(sizes), int(bounds[-1])
    b = int(sizes[0])
    if n == 1 or (np.all(sizes[:-1] == b) and sizes[-1] <= b):
        xp = jnp.pad(x, ((0, 0), (0, n * b - L), (0, 0), (0, 0)))
        return xp.reshape(x.shape[0], n, b, *x.shape[2:]).sum(axis=2)
    bmax = int(sizes.max())
    if n * bmax <= 2 * L:
        # Unequal blocks (cube layouts' partial edge cubes): gather each block's tokens into a
        # row of bmax, zeros past its end, and sum the rows. A scatter-add (segment_sum) costs
        # one atomic per element on a GPU: ~4 ms per tensor at Wan 480p against ~0.05 here.
        j = np.arange(bmax)
        idx = np.where(j[None] < sizes[:, None], bounds[:-1, None] + j[None], L).astype(np.int32)
        xp = jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0)))
        g = jnp.take(xp, jnp.asarray(idx.reshape(-1)), axis=1, mode="clip")
        return g.reshape(x.shape[0], n, bmax, *x.shape[2:]).sum(axis=2)
    ids = np.repeat(np.arange(n, dtype=np.int32), sizes)
    s = jax.ops.segment_sum(jnp.moveaxis(x, 1, 0), ids, num_segments=n, indices_are_sorted=True)
    return jnp.moveaxis(s, 0, 1)


def pool_mean(x, bounds: np.ndarray, pool: str = "auto"):
    sizes = jnp.asarray(np.diff(bounds), jnp.float32)
    return pool_sum(x, bounds, pool) / sizes[None, :, None, None]


def repeat_heads(x, group: int, axis: int):
    return x if group == 1 else jnp.repeat(x, group, axis=axis)


# --- rows: top k and sorted selections ------------------------------------------------------
def scatter_rows(order, keep_sorted):
    """bool [..., n]: ``out[..., order[..., r]] = keep_sorted[..., r]`` (``order`` a
    permutation of each row)."""
    flat_o = order.reshape(-1, order.shape[-1])
    flat_k = keep_sorted.reshape(-1, order.shape[-1])
    rows = jnp.arange(flat_o.shape[0])[:, None]
    out = jnp.zeros(flat_o.shape, bool).at[rows, flat_o].set(flat_k, mode="drop")
    return out.reshape(order.shape)


def sorted_desc(p):
    """(order, sorted values) of each row, largest first, ties by the lower index."""
    order = jnp.argsort(-p, axis=-1, stable=True)
    return order, jnp.take_along_axis(p, order, axis=-1, mode="clip")


# Each row's top k (``vsa_mask``, ``sparge_mask`` with ``topk``) is taken by one fused kernel on
# a GPU (``top_k`` option: Mosaic GPU on Hopper, ``pallas_kernels.mosaic.topk``; Triton on
# Ampere/Ada, ``pallas_kernels.triton.topk``), else by XLA (``lax.top_k``; SpargeAttn's
# ``argsort``). Measured on the H200, builder wall time per call at Wan 720p ([40, 1440, 1440]
# scores; session 13): VSA 7.61 ms with lax.top_k, 3.63 ms with the Triton kernel; SpargeAttn
# top-k 5.96 vs 3.90 ms. A radix select written as XLA ops was slower than the sort and was
# removed (session 12: VSA 8.73 vs 7.71 ms; Wan 480p 1.42 vs 0.79 ms, launch-bound). Same kept
# set exactly (ties to the lower index, -0.0 below +0.0 as ``lax.top_k``; scores have no NaN).
# Rows longer than the kernels' ``MAX_COLS`` (4096) always take XLA's path.
def top_k_rows(x, k: int, top_k: str, xla):
    """bool mask of each row's top k of ``x`` [..., n]: a fused kernel or ``xla(x)`` (the same
    set) by the ``top_k`` option."""
    from pallas_kernels.triton import topk as tt
    mt = mosaic_module("topk")
    n = x.shape[-1]

    # The mask is piecewise constant and the kernels have no autodiff rule: their input leaves
    # the trace of gradients (as lax.top_k's indices carry none).
    def run(mod):
        def kernel(x, interpret):
            return mod.topk_mask(jax.lax.stop_gradient(x.astype(jnp.float32)), k,
                                 interpret=interpret)
        return kernel

    kernels = {"triton": run(tt) if n <= tt.MAX_COLS else None,
               "mosaic": run(mt) if mt and n <= mt.MAX_COLS else None}
    return kernel_or_xla(top_k, kernels, xla, x)
