"""XAttention-like masks: strided antidiagonal block scores, a per-row cumulative threshold
(``XAttention``, ``xattn_mask``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tessera_jax.mask import BlockMask
from tessera_jax.masks.dynamic import common as c

# Elements of float32 scores one chunk may hold (256 MiB).
_CHUNK_ELEMS = 1 << 26


@dataclasses.dataclass(frozen=True)
class XAttention(c.Stateless):
    """XAttention (Xu et al., "XAttention: Block Sparse Attention with Antidiagonal Scoring",
    ICML 2025, arXiv:2503.16428; mit-han-lab/x-attention ``xattn_estimate``,
    ``find_blocks_chunked``):

    1. queries and keys in groups of ``stride`` S consecutive tokens; the score of query
       group i' and key group j' is the antidiagonal sum ``sum_m q[i'S + S-1-m] . k[j'S + m]``
       times ``scale / S``, softmaxed over all key groups of the row;
    2. block score A[i, j] = the sum of those probabilities over the ``block`` x ``block``
       block (``block / S`` groups each way); a row's mass is the sum of its A;
    3. each query block keeps the fewest key blocks, largest A first, whose mass reaches
       ``tau`` of the row's: a block is kept while the mass before it is < tau * total.
       ``keep_diagonal`` / ``keep_sink`` (block i == j / key block 0) are always kept and
       counted first, as in the paper's causal mode.

    Paper's video settings (HunyuanVideo): stride 8, tau 0.9 or 0.95, blocks of 128, 5 dense
    warm-up steps (the cheaper variant of docs/dynamic_masks.md is ``stride=64``). The
    non-causal reference code has no forced blocks but, as a side effect of its index scatter,
    also sets key block 0 in rows that drop a block (``keep_sink=True`` comes close). Lengths
    need not be multiples of ``block`` or S: the last group and block are partial (zero-padded
    tokens, all-padding key groups excluded).

    Cost: the strided scores are 1/S of dense QK^T (see docs/dynamic_masks.md); queries are
    processed ``chunk_blocks`` query blocks at a time (default: ~2**26 float32 scores). A frozen
    (hashable) dataclass: the configuration of ``xattn_mask`` and a rule of a
    ``tessera_jax.flax.DynamicSchedule``.
    """

    block: int = 128
    stride: int = 8
    tau: float = 0.9
    keep_diagonal: bool = False
    keep_sink: bool = False
    chunk_blocks: int | None = None

    def __post_init__(self):
        c.check_fields(self, {"block": ("int",), "stride": ("int",), "tau": ("frac",),
                              "keep_diagonal": ("bool",), "keep_sink": ("bool",),
                              "chunk_blocks": ("optional_int",)})
        if self.block % self.stride:
            raise ValueError(f"XAttention: block={self.block} must be a multiple of "
                             f"stride={self.stride}")

    def mask(self, q, k, scale=None) -> BlockMask:
        return xattn_mask(q, k, self, scale=scale)


def _strided(x, n_groups: int, stride: int, reverse: bool):
    """[B, L, H, D] -> [B, n_groups, H, stride * D]: group g holds tokens g*S .. g*S+S-1
    (reversed for queries: the antidiagonal), zero past the length."""
    B, L, H, D = x.shape
    xp = jnp.pad(x, ((0, 0), (0, n_groups * stride - L), (0, 0), (0, 0)))
    xp = xp.reshape(B, n_groups, stride, H, D)
    if reverse:
        xp = xp[:, :, ::-1]
    return jnp.moveaxis(xp, 2, 3).reshape(B, n_groups, H, stride * D)


def _block_mass(q, k, rule: XAttention, scale: float):
    """A [Hq, nqb, nkb]: each block's sum of the strided probabilities (batch mean)."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    block, stride = rule.block, rule.stride
    nqb, nkb = -(-Lq // block), -(-Lkv // block)
    rb = block // stride                      # groups per block
    if rule.chunk_blocks is None:
        chunk_blocks = max(1, min(nqb, _CHUNK_ELEMS // max(1, B * Hq * rb * nkb * rb)))
    else:
        chunk_blocks = min(rule.chunk_blocks, nqb)
    n_chunks = -(-nqb // chunk_blocks)
    nq_groups = n_chunks * chunk_blocks * rb
    nk_groups = nkb * rb
    qr = _strided(q, nq_groups, stride, True)                          # [B, nqg, Hq, S*D]
    kr = c.repeat_heads(_strided(k, nk_groups, stride, False), Hq // Hkv, axis=2)
    q_valid = jnp.arange(nq_groups) * stride < Lq
    k_valid = jnp.arange(nk_groups) * stride < Lkv
    qr = qr.reshape(B, n_chunks, chunk_blocks * rb, Hq, stride * D).swapaxes(0, 1)
    qv = q_valid.reshape(n_chunks, chunk_blocks * rb)
    f = scale / stride

    def one(args):
        qc, valid = args
        s = jnp.einsum("bihf,bjhf->bhij", qc, kr, precision=c.HI,
                       preferred_element_type=jnp.float32) * f
        s = jnp.where(k_valid[None, None, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(valid[None, None, :, None], p, 0.0)
        a = p.reshape(B, Hq, chunk_blocks, rb, nkb, rb).sum(axis=(3, 5))
        return a.mean(axis=0)                                          # [Hq, cb, nkb]

    if n_chunks == 1:
        a = one((qr[0], qv[0]))[None]
    else:
        a = jax.lax.map(one, (qr, qv))                                 # [nc, Hq, cb, nkb]
    return jnp.moveaxis(a, 0, 1).reshape(Hq, n_chunks * chunk_blocks, nkb)[:, :nqb]


def xattn_mask(q, k, rule: XAttention = XAttention(), *, scale=None) -> BlockMask:
    """The XAttention-like mask of q [B, Lq, Hq, D] and k [B, Lkv, Hkv, D] by ``rule``
    (``XAttention``: the knobs). ``scale``: default ``D ** -0.5``.

    Returns ``BlockMask`` with uniform static bounds of ``rule.block`` and traced blocks
    [Hq, nq, nkv].
    """
    fn = "xattn_mask"
    rule = c.check_rule(fn, rule, XAttention)
    B, Lq, Lkv, Hq, Hkv, D = c.check_qk(fn, q, k)
    scale = c.check_scale(fn, scale, D)
    a = _block_mass(q, k, rule, scale)
    nqb, nkb = a.shape[1], a.shape[2]
    forced = np.zeros((nqb, nkb), bool)
    if rule.keep_diagonal:
        d = np.arange(min(nqb, nkb))
        forced[d, d] = True
    if rule.keep_sink:
        forced[:, 0] = True
    forced_j = jnp.asarray(forced)[None]
    total = jnp.sum(a, axis=-1, keepdims=True)
    order = jnp.argsort(-jnp.where(forced_j, jnp.inf, a), axis=-1, stable=True)
    a_sorted = jnp.take_along_axis(a, order, axis=-1, mode="clip")
    before = jnp.cumsum(a_sorted, axis=-1) - a_sorted
    blocks = c.scatter_rows(order, before < rule.tau * total) | forced_j
    bounds = np.append(np.arange(0, Lq, rule.block, dtype=np.int64), np.int64(Lq))
    kbounds = np.append(np.arange(0, Lkv, rule.block, dtype=np.int64), np.int64(Lkv))
    return BlockMask(bounds, kbounds, blocks)
