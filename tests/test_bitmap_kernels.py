"""Bitmap steps (``pallas_kernels.abi``: STEP_CUTS_B == BITMAP_FLAG, a bit per entry in words
after the step rows) in the XLA executor and the Triton kernel (interpret mode), against the
dense float32 reference (``tessera_jax.reference``) of the token mask the plan selects.

Plans are hand-built here (``bitmap_plan``): random bitmaps per (unit, K/V tile) with their
bounding box as rectangle, mixed with plain and grid steps (and a K/V tile split between a
bitmap and a plain or grid step), words appended after the step rows, shared words, shared
steps across heads (GQA), an empty row inside a bitmap's rectangle. A NumPy decoder of the ABI
text (``decode``) checks the builder; negative controls check that a wrong bit order or word
layout would fail.
"""

from __future__ import annotations

import collections
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_kernels import abi
from pallas_kernels import templates
from pallas_kernels.mosaic import ops as mosaic_ops
from pallas_kernels.triton import ops as triton_ops
from pallas_kernels.xla import ops as xla_ops
from tessera_jax.mask import BlockMask
from tessera_jax.reference import reference_attention

import contract_calls as calls

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
ENCODINGS = ("abi", "reversed_bits", "row_major_words")


# --- the builder -------------------------------------------------------------------------
def _words(bits, tile_q, tile_kv, encoding="abi"):
    """int32 [W * tile_q] words of a [tile_q, tile_kv] bool bitmap: word(r, w) at w * tile_q + r
    holds bit c % 32 for key c = 32 w + c % 32 ("abi"); the negative controls flip the bit
    order within a word or lay the words out row-major (r * W + w)."""
    W = abi.bitmap_words(tile_kv)
    padded = np.zeros((tile_q, W * abi.WORD_BITS), bool)
    padded[:, :tile_kv] = bits
    b = padded.reshape(tile_q, W, abi.WORD_BITS)
    if encoding == "reversed_bits":
        b = b[..., ::-1]
    w = (b.astype(np.uint64) << np.arange(abi.WORD_BITS, dtype=np.uint64)).sum(-1)  # [T, W]
    w = w.astype(np.uint32).view(np.int32)
    return (w.reshape(-1) if encoding == "row_major_words" else w.T.reshape(-1)).copy()


def _rect(rng, own, kmax):
    q_lo, q_hi = sorted(rng.choice(own + 1, 2, replace=False))
    kv_lo, kv_hi = sorted(rng.choice(kmax + 1, 2, replace=False))
    return int(q_lo), int(q_hi), int(kv_lo), int(kv_hi)


def _random_bits(rng, own, kmax, tile_q, tile_kv, row_lo=0):
    """A non-empty random bitmap inside rows [row_lo, own) x keys [0, kmax): dense, sparse,
    single entries, whole rows, keys 31 / 63 (bit 31: a negative word) now and then."""
    bits = np.zeros((tile_q, tile_kv), bool)
    kind = rng.integers(5)
    if kind == 0:                                     # one entry
        bits[rng.integers(row_lo, own), rng.integers(kmax)] = True
    elif kind == 1:                                   # bit 31 of some words, whole rows
        bits[rng.integers(row_lo, own, 3), :kmax] = True
        bits[row_lo:own, 31:kmax:32] = rng.random((own - row_lo, len(range(31, kmax, 32)))) < .5
    else:
        density = (0.05, 0.4, 0.9)[kind - 2]
        r0, r1, c0, c1 = _rect(rng, own - row_lo, kmax)
        bits[row_lo + r0:row_lo + r1, c0:c1] = rng.random((r1 - r0, c1 - c0)) < density
    if not bits.any():
        bits[rng.integers(row_lo, own), rng.integers(kmax)] = True
    return bits


def _bbox(bits):
    r, c = np.nonzero(bits)
    return int(r.min()), int(r.max()) + 1, int(c.min()), int(c.max()) + 1


def _grid_step(rng, row_lo, own, kmax):
    """(rect, cuts_a, cuts_b) of a random grid step inside rows [row_lo, own) x keys [0, kmax)."""
    q_lo, q_hi, kv_lo, kv_hi = _rect(rng, own - row_lo, kmax)
    q_lo, q_hi = q_lo + row_lo, q_hi + row_lo
    qc = tuple(int(x) for x in np.sort(rng.integers(q_lo, q_hi + 1, 3)))
    kc = tuple(int(x) for x in np.sort(rng.integers(kv_lo, kv_hi + 1, 3)))
    ca, cb = abi.pack_grid(qc, kc, int(rng.integers(1, 1 << 16)))
    return abi.pack_rect(q_lo, q_hi, kv_lo, kv_hi), ca, cb


def bitmap_plan(rng, *, Lq, Lkv, Hq, tile_q, tile_kv, shared=False, encoding="abi",
                kinds=("bitmap", "bitmap", "bitmap", "plain", "grid", "split", "none"),
                empty_row=True):
    """A hand-built plan: per head (``shared``: one set of steps every head's units point at)
    and query tile one unit; per K/V tile (shuffled) a step of a random kind: "bitmap" (random
    bits, their bounding box as rectangle; now and then the bits of an earlier bitmap that fit
    the tile, half of those sharing its words), "plain", "grid" (random cuts and cells),
    "split" (rows [0, cut) a bitmap step, rows [cut, own) a plain or grid step of the same
    tile) or "none". One unit (``empty_row``) has only bitmap steps and a row that none
    selects inside their rectangles. The words follow the step rows (one gap row first, each
    bitmap at a multiple of 4 words, gap rows between some), then two zero rows; padding units
    at the end, shuffled unit order.

    Returns (units, steps, row_index, q_len_padded, kv_len_padded, token [Hq, Lq, Lkv] bool,
    counts of the step kinds)."""
    qlp = -(-Lq // tile_q) * tile_q
    klp = -(-Lkv // tile_kv) * tile_kv
    n_qt = qlp // tile_q
    token = np.zeros((Hq, qlp, klp), bool)
    steps, units, seen = [], [], collections.Counter()
    bitmaps = []                 # [bits, the step rows (lists) that read its words]
    empty_unit = (int(rng.integers(1 if shared else Hq)), int(rng.integers(n_qt)))
    for h in range(1 if shared else Hq):
        for t in range(n_qt):
            qs = t * tile_q
            own = min(tile_q, Lq - qs)
            mine, sel = [], np.zeros((tile_q, klp), bool)
            empty = empty_row and (h, t) == empty_unit and own >= 3
            r0 = int(rng.integers(1, own - 1)) if empty else -1

            def add_bitmap(ks, bits, share=None):
                row = [ks, abi.pack_rect(*_bbox(bits)), -1, abi.BITMAP_FLAG]
                if share is not None:
                    share[1].append(row)
                    seen["shared_words"] += 1
                else:
                    bitmaps.append([bits, [row]])
                mine.append(row)
                sel[:, ks:ks + tile_kv] |= bits
                seen["bitmap"] += 1

            for ks in rng.permutation(np.arange(0, klp, tile_kv)):
                ks = int(ks)
                kmax = min(tile_kv, Lkv - ks)
                kind = "bitmap" if empty else kinds[rng.integers(len(kinds))]
                if kind == "none" or (kind == "split" and own < 2):
                    continue
                if kind == "bitmap":
                    fit = [b for b in bitmaps if not b[0][own:].any() and not b[0][:, kmax:].any()]
                    if fit and not empty and rng.random() < 0.3:
                        b = fit[rng.integers(len(fit))]
                        add_bitmap(ks, b[0], b if rng.random() < 0.5 else None)
                        continue
                    bits = _random_bits(rng, own, kmax, tile_q, tile_kv)
                    if empty:                          # row r0 empty, inside the rectangle
                        bits[r0] = False
                        bits[r0 - 1, rng.integers(kmax)] = True
                        bits[r0 + 1, rng.integers(kmax)] = True
                    add_bitmap(ks, bits)
                    continue
                cut = 0
                if kind == "split":
                    cut = int(rng.integers(1, own))
                    add_bitmap(ks, _random_bits(rng, cut, kmax, tile_q, tile_kv))
                    seen["split"] += 1
                sub = "grid" if kind == "grid" or (kind == "split" and rng.random() < .5) \
                    else "plain"
                if sub == "plain":
                    q_lo, q_hi, kv_lo, kv_hi = _rect(rng, own - cut, kmax)
                    row = [ks, abi.pack_rect(q_lo + cut, q_hi + cut, kv_lo, kv_hi), 0, 0]
                else:
                    row = [ks, *_grid_step(rng, cut, own, kmax)]
                m = abi.grid_mask(row[1], row[2], row[3], np.arange(tile_q)[:, None],
                                  np.arange(tile_kv)[None, :])
                assert not (sel[:, ks:ks + tile_kv] & m).any()
                sel[:, ks:ks + tile_kv] |= m
                mine.append(row)
                seen[sub] += 1
            if empty:
                assert not sel[r0].any() and sel[r0 - 1].any() and sel[r0 + 1].any()
                seen["empty_row"] += 1
            mine = [mine[i] for i in rng.permutation(len(mine))]
            assert not sel[own:].any() and not sel[:, Lkv:].any()
            for hh in (range(Hq) if shared else (h,)):
                token[hh, qs:qs + tile_q] |= sel
                units.append((hh, qs, 0, own, len(steps), len(mine)))
            steps += mine
    # The words after the step rows: a gap row, then each bitmap at a row (4 words) boundary.
    n_rows = len(steps) + 1
    placed = []
    for bits, rows in bitmaps:
        wd = _words(bits, tile_q, tile_kv, encoding)
        n = -(-wd.size // abi.STEP_COLS)
        placed.append((n_rows, np.pad(wd, (0, n * abi.STEP_COLS - wd.size))))
        for row in rows:
            row[abi.STEP_CUTS_A] = abi.STEP_COLS * n_rows
        n_rows += n + int(rng.integers(0, 2))
    sa = np.zeros((n_rows + 2, abi.STEP_COLS), np.int32)
    for s, row in enumerate(steps):
        sa[s] = row
    for row0, wd in placed:
        sa[row0:row0 + wd.size // abi.STEP_COLS] = wd.reshape(-1, abi.STEP_COLS)
    U = len(units) + 3                                 # padding units at the end
    ua = np.zeros((U, abi.UNIT_COLS), np.int32)
    ua[:len(units)] = np.array(units, np.int64)[rng.permutation(len(units))]
    row_index = np.full((Hq, Lq), U * tile_q, np.int32)
    for u in range(len(units)):
        h, qs, lo, hi = ua[u, :4]
        row_index[h, qs + lo:qs + hi] = u * tile_q + np.arange(lo, hi)
    return ua, sa, row_index, qlp, klp, token[:, :Lq, :Lkv], seen


def decode(units, steps, tile_q, tile_kv, Hq, qlp, klp):
    """The token mask [Hq, qlp, klp] a plan selects, read from the abi docstring's rules by
    NumPy loops (independent of every executor): a plain step's rectangle, a grid step's
    ``abi.grid_mask``, a bitmap step's bit c % 32 of flat[off + (c // 32) * tile_q + r]."""
    flat = steps.reshape(-1)
    out = np.zeros((Hq, qlp, klp), bool)
    r, c = np.arange(tile_q)[:, None], np.arange(tile_kv)[None, :]
    for h, qs, lo, hi, ptr, cnt in units:
        for s in range(ptr, ptr + cnt):
            ks, rect, ca, cb = (int(x) for x in steps[s])
            if cb == abi.BITMAP_FLAG:
                words = flat[ca + (c // 32) * tile_q + r].astype(np.int64)
                m = ((words >> (c % 32)) & 1) == 1
            else:
                m = abi.grid_mask(rect, ca, cb, r, c)
            assert not (out[h, qs:qs + tile_q, ks:ks + tile_kv] & m).any(), "overlap"
            out[h, qs:qs + tile_q, ks:ks + tile_kv] |= m & (r >= lo) & (r < hi)
    return out


# --- running and checking ----------------------------------------------------------------
def _inputs(seed, B, Lq, Lkv, Hq, Hkv, D, dtype):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)  # noqa: E731
    return mk(B, Lq, Hq, D), mk(B, Lkv, Hkv, D), mk(B, Lkv, Hkv, D)


def _reference(q, k, v, token, scale):
    """tessera_jax's dense reference of the token mask (1-token blocks)."""
    Lq, Lkv = token.shape[1:]
    mask = BlockMask(np.arange(Lq + 1), np.arange(Lkv + 1), token)
    return reference_attention(q, k, v, mask, scale=scale, return_lse=True)


def _errors(out, lse, ref, ref_lse):
    """(relative output error, relative lse error, whether the empty rows match: -inf lse and
    zero output exactly where the reference has no key)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    empty = np.isneginf(ref_lse)
    same_empty = (np.array_equal(np.isneginf(lse), empty)
                  and not out.transpose(0, 2, 1, 3)[empty].any())
    lerr = 0.0
    if (~empty).any():
        lerr = np.abs(lse[~empty] - ref_lse[~empty]).max() / max(np.abs(ref_lse[~empty]).max(), 1)
    return err, lerr, same_empty


def _check(out, lse, ref, ref_lse, dtype):
    err, lerr, same_empty = _errors(out, lse, ref, ref_lse)
    tol = TOL[jnp.dtype(dtype).type]
    assert err <= tol, f"relative output error {err:.3g} > {tol}"
    assert lerr <= tol, f"relative lse error {lerr:.3g} > {tol}"
    assert same_empty, "rows with no key differ from the reference"


def _xla(q, k, v, plan, tile_q, tile_kv, scale, check_plan=True):
    """The XLA executor on a built plan (``abi.check_plan`` validates it first, unless a
    negative control's plan breaks the ABI on purpose)."""
    units, steps, row_index, qlp, klp = plan[:5]
    max_steps = int(units[:, abi.UNIT_STEP_CNT].max())
    p = abi.PassPlan(units, steps, row_index, tile_q, tile_kv, qlp, klp, max(max_steps, 1))
    return xla_ops.forward(q, k, v, p, template=calls.xla_template(tile_q, tile_kv),
                           scale=scale, return_lse=True, check_plan=check_plan)


def _triton(q, k, v, plan, tile_q, tile_kv, scale, check_plan=True, template=None,
            mask_mode=None, **kernel):
    """The Triton forward on a built plan: on ``template``, or on a template of its tiles and
    the ``TritonConfig`` fields ``kernel``; ``mask_mode``: ``contract_calls.with_mask_mode``."""
    units, steps, row_index, qlp, klp = plan[:5]
    t = template or calls.triton_template(tile_q, tile_kv, **kernel)
    return calls.forward(triton_ops, q, k, v,
                         abi.PassPlan(units, steps, row_index, tile_q, tile_kv, qlp, klp, 0), t,
                         mask_mode=mask_mode, scale=scale, return_lse=True,
                         check_plan=check_plan)


def _case(seed, *, B, Lq, Lkv, Hq, Hkv, D, dtype, tile_q, tile_kv, shared=False,
          encoding="abi", **plan_kw):
    rng = np.random.default_rng(seed)
    plan = bitmap_plan(rng, Lq=Lq, Lkv=Lkv, Hq=Hq, tile_q=tile_q, tile_kv=tile_kv,
                       shared=shared, encoding=encoding, **plan_kw)
    if encoding == "abi":                              # the builder agrees with the ABI text
        units, steps, _, qlp, klp, token, _ = plan
        np.testing.assert_array_equal(
            decode(units, steps, tile_q, tile_kv, Hq, qlp, klp)[:, :Lq, :Lkv], token)
        assert not abi.check_plan(units, steps, tile_q, tile_kv, qlp, klp, num_q_heads=Hq)
    q, k, v = _inputs(seed + 1, B, Lq, Lkv, Hq, Hkv, D, dtype)
    return plan, (q, k, v), _reference(q, k, v, plan[5], 0.3)


# --- XLA executor ------------------------------------------------------------------------
XLA_TILES = [(t.tile_q, t.tile_kv) for t in templates.for_backend("xla")]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tile_q,tile_kv", XLA_TILES)
def test_xla_bitmap_steps(tile_q, tile_kv, shared):
    """Every XLA template's tiles: bitmap, plain, grid and split tiles, GQA (per head or steps
    shared by the heads), an empty row inside bitmaps' rectangles, batch 2."""
    assert XLA_TILES == [(64, 64), (128, 128), (64, 128), (128, 64)]
    seed = zlib.crc32(repr((tile_q, tile_kv, shared)).encode())
    plan, (q, k, v), (ref, ref_lse) = _case(
        seed, B=2, Lq=2 * tile_q + 40, Lkv=3 * tile_kv + 20, Hq=4, Hkv=2, D=32,
        dtype=jnp.float32, tile_q=tile_q, tile_kv=tile_kv, shared=shared)
    seen = plan[-1]
    assert seen["bitmap"] >= 4 and seen["plain"] + seen["grid"] >= 2 and seen["empty_row"], seen
    _check(*_xla(q, k, v, plan, tile_q, tile_kv, 0.3), ref, ref_lse, jnp.float32)


@pytest.mark.parametrize("encoding", ENCODINGS[1:])
def test_a_wrong_encoding_fails(encoding):
    """Negative controls: words written with the bit order reversed within a word, or laid out
    row-major (word(r, w) at r * W + w), decode to another mask, so the executors' output
    misses the reference by far: a kernel decoding that way would fail these tests."""
    tile_q, tile_kv = 64, 64
    kw = dict(B=1, Lq=100, Lkv=150, Hq=2, Hkv=1, D=32, dtype=jnp.float32, tile_q=tile_q,
              tile_kv=tile_kv, kinds=("bitmap",), empty_row=False)
    plan, (q, k, v), (ref, ref_lse) = _case(7, encoding=encoding, **kw)
    for run in (_xla, _triton):
        err, lerr, _ = _errors(*run(q, k, v, plan, tile_q, tile_kv, 0.3, check_plan=False), ref,
                               ref_lse)
        assert err > 1e-2 and lerr > 1e-3, (run.__name__, err, lerr)


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@settings(max_examples=12, **_SETTINGS)
@given(tile_q=st.sampled_from([8, 12, 16, 32]), tile_kv=st.sampled_from([8, 24, 32, 48, 80]),
       Lq=st.integers(1, 70), Lkv=st.integers(1, 110), Hkv=st.integers(1, 2),
       group=st.sampled_from([1, 2]), shared=st.booleans(), seed=st.integers(0, 2**31 - 1),
       kinds=st.sampled_from([("bitmap",), ("bitmap", "plain", "grid", "split", "none")]))
def test_xla_bitmap_property(tile_q, tile_kv, Lq, Lkv, Hkv, group, shared, seed, kinds):
    """Any tile shape (tile_q not a multiple of 4: words at a row boundary still; tile_kv not
    a multiple of 32: a partial last word), ragged lengths, GQA, shared steps."""
    plan, (q, k, v), (ref, ref_lse) = _case(
        seed, B=1, Lq=Lq, Lkv=Lkv, Hq=Hkv * group, Hkv=Hkv, D=16, dtype=jnp.float32,
        tile_q=tile_q, tile_kv=tile_kv, shared=shared, kinds=kinds)
    _check(*_xla(q, k, v, plan, tile_q, tile_kv, 0.3), ref, ref_lse, jnp.float32)


# --- Triton kernel (interpret mode) --------------------------------------------------------
@pytest.mark.parametrize("template,dtype,D,Hq,Hkv,shared", [
    ("triton_q128_kv64_w8_s3_pf_hm", jnp.bfloat16, 64, 4, 2, False),     # GQA, per head
    ("triton_q128_kv128_w8_s3_pf_hm", jnp.float32, 32, 2, 1, True),      # MQA, shared steps
    ("triton_q64_kv64_w4_s2", jnp.bfloat16, 136, 2, 2, False),           # D 129..256
])
def test_triton_bitmap_templates(template, dtype, D, Hq, Hkv, shared):
    """The Triton templates' tiles: bitmap, plain, grid and split tiles, empty row."""
    t = templates.get(template)
    plan, (q, k, v), (ref, ref_lse) = _case(
        zlib.crc32(template.encode()), B=1, Lq=t.tile_q + 40, Lkv=3 * t.tile_kv + 20, Hq=Hq,
        Hkv=Hkv, D=D, dtype=dtype, tile_q=t.tile_q, tile_kv=t.tile_kv, shared=shared)
    assert plan[-1]["bitmap"] >= 3 and plan[-1]["empty_row"], plan[-1]
    _check(*_triton(q, k, v, plan, t.tile_q, t.tile_kv, 0.3, template=template), ref, ref_lse,
           dtype)


@pytest.mark.parametrize("seed", range(4))
def test_triton_bitmap_small_tiles(seed):
    """Small tiles in float32, both masking modes, with and without prefetch, GQA, batch 2."""
    rng = np.random.default_rng(seed)
    tile_q, tile_kv = ((16, 64), (32, 32), (16, 128), (32, 16))[seed]
    plan, (q, k, v), (ref, ref_lse) = _case(
        200 + seed, B=2, Lq=int(rng.integers(40, 90)), Lkv=int(rng.integers(60, 200)), Hq=2,
        Hkv=1 + seed % 2, D=(16, 32)[seed % 2], dtype=jnp.float32, tile_q=tile_q,
        tile_kv=tile_kv, shared=seed == 3)
    _check(*_triton(q, k, v, plan, tile_q, tile_kv, 0.3, mask_mode=("cond", "always")[seed % 2],
                    prefetch=seed < 2, num_warps=4), ref, ref_lse, jnp.float32)


# --- the ABI helpers and the planner (end to end) ------------------------------------------
@pytest.mark.parametrize("tile_q,tile_kv", [(64, 64), (12, 80), (128, 128)])
def test_builder_agrees_with_abi_helpers(tile_q, tile_kv):
    """This file's encoder and decoder against the ABI's own (``pack_bitmap``,
    ``step_mask``), so both sides read the docstring the same way."""
    rng = np.random.default_rng(tile_q * 1000 + tile_kv)
    bits = rng.random((tile_q, tile_kv)) < 0.4
    bits[:, tile_kv - 1] = True                        # the top bit of the last word
    np.testing.assert_array_equal(_words(bits, tile_q, tile_kv), abi.pack_bitmap(bits))
    plan = bitmap_plan(rng, Lq=2 * tile_q, Lkv=2 * tile_kv, Hq=2, tile_q=tile_q,
                       tile_kv=tile_kv)
    units, steps = plan[0], plan[1]
    kinds = collections.Counter()
    for s in range((units[:, abi.UNIT_STEP_PTR] + units[:, abi.UNIT_STEP_CNT]).max()):
        ks = int(steps[s, abi.STEP_KV_START])
        mine = decode(np.array([[0, 0, 0, tile_q, s, 1]]), steps, tile_q, tile_kv, 1, tile_q,
                      ks + tile_kv)[0, :, ks:]
        np.testing.assert_array_equal(mine, abi.step_mask(steps, s, tile_q, tile_kv))
        kinds[int(steps[s, abi.STEP_CUTS_B] == abi.BITMAP_FLAG)] += 1
    assert kinds[1] and kinds[0], kinds


def test_end_to_end_token_mask_xla():
    """A 1-token-block mask through ``tj.sparse_attention(..., backend="xla")``: the planner
    emits bitmap steps (tiles cut by more than 4 blocks per axis) and the output matches the
    dense reference, GQA, an empty query row, a ragged last tile."""
    import tessera_jax as tj
    rng = np.random.default_rng(3)
    Lq, Lkv, Hq, Hkv = 150, 200, 4, 2
    token = rng.random((Hq, Lq, Lkv)) < 0.3
    token[:, 70] = False
    mask = BlockMask(np.arange(Lq + 1), np.arange(Lkv + 1), token)
    q, k, v = _inputs(4, 1, Lq, Lkv, Hq, Hkv, 32, jnp.float32)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, backend="xla")
    st = p.steps[:p.num_steps]
    assert (st[:, abi.STEP_CUTS_B] == abi.BITMAP_FLAG).any(), p.describe()
    out, lse = tj.sparse_attention(q, k, v, mask, backend="xla", scale=0.3, return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, mask, scale=0.3, return_lse=True)
    assert np.isneginf(np.asarray(ref_lse)[:, :, 70]).all()
    _check(out, lse, ref, ref_lse, jnp.float32)


def test_end_to_end_token_mask_triton_template():
    """The same through a Triton template's plan, run by the backend runner (interpret)."""
    import tessera_jax as tj
    from tessera_jax.runtime import core, host_plans
    rng = np.random.default_rng(5)
    Lq, Lkv, Hq, Hkv = 140, 150, 2, 1
    token = rng.random((1, Lq, Lkv)) < 0.2
    mask = BlockMask(np.arange(Lq + 1), np.arange(Lkv + 1), token)
    q, k, v = _inputs(6, 1, Lq, Lkv, Hq, Hkv, 32, jnp.bfloat16)
    p = tj.plan(mask, q.shape, k.shape, q.dtype, template="triton_q128_kv64_w8_s3_pf_hm")
    assert (p.steps[:p.num_steps, abi.STEP_CUTS_B] == abi.BITMAP_FLAG).any(), p.describe()
    out, lse = core.attention(q, k, v, host_plans.attention_plan(p), 0.3, True)
    _check(out, lse, *reference_attention(q, k, v, mask, scale=0.3, return_lse=True),
           jnp.bfloat16)


# --- Mosaic GPU kernel (the Mosaic GPU interpreter) --------------------------------------
@pytest.mark.parametrize("template,Hq,Hkv,shared", [
    ("mgpu_q128_kv128_s2_hm", 4, 2, True),        # GQA, steps shared by the heads
    ("mgpu_q64x2pp_kv64_s2_hm", 2, 2, False),     # paired units, per head
    ("mgpu_q128_kv64_s2_skip", 2, 1, False),      # warpgroup skipping (rectangles bound bits)
    ("mgpu_q128_kv64x2_s2_hm", 2, 1, True),       # step pairs: a bitmap step in either half
])
def test_mosaic_bitmap_templates(template, Hq, Hkv, shared):
    """The Mosaic GPU consumer's bitmap branch (row words loaded from GMEM in the fragment's row
    layout, and-ed with each key's bit) beside its plain and grid branches, empty row."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import params as _interp
    except Exception as e:  # pragma: no cover
        pytest.skip(f"Mosaic GPU interpreter not importable: {e}")
    t = templates.get(template)
    plan, (q, k, v), (ref, ref_lse) = _case(
        zlib.crc32(template.encode()), B=1, Lq=t.tile_q + 40, Lkv=3 * t.tile_kv + 24, Hq=Hq,
        Hkv=Hkv, D=64, dtype=jnp.bfloat16, tile_q=t.tile_q, tile_kv=t.tile_kv, shared=shared)
    assert plan[-1]["bitmap"] >= 3 and plan[-1]["empty_row"], plan[-1]
    units, steps, row_index, qlp, klp = plan[:5]
    out, lse = mosaic_ops.forward(
        q, k, v, abi.PassPlan(units, steps, row_index, t.tile_q, t.tile_kv, qlp, klp, 0),
        template=t, scale=0.3, return_lse=True, interpret=_interp.InterpretGPUParams())
    _check(out, lse, ref, ref_lse, jnp.bfloat16)


# --- planned end to end: random token-level bounds through every kernel ----------------------
KERNEL_TEMPLATES = ["mgpu_q128_kv128_s2_hm", "mgpu_q64x2pp_kv64_s2_hm", "mgpu_q128_kv64_s2_skip",
                    "mgpu_q128_kv64x2_s2_hm", "triton_q128_kv64_w8_s3_pf_hm", "xla_64x128"]


@st.composite
def _token_level_cases(draw):
    """A planned problem whose tiles are cut by many blocks: bounds of 1-8 tokens (now and
    then a long block), per-head or shared blocks, GQA, an empty query block, any policy."""
    def bounds(L):
        sizes = draw(st.lists(st.one_of(st.integers(1, 3), st.integers(4, 8),
                                        st.integers(20, 70)), min_size=4, max_size=40))
        b = np.unique(np.minimum(np.r_[0, np.cumsum(sizes)], L))
        return b if b[-1] == L else np.r_[b, L]

    Lq, Lkv = draw(st.integers(70, 180)), draw(st.integers(70, 200))
    qb, kb = bounds(Lq), bounds(Lkv)
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    blocks = rng.random((draw(st.sampled_from(sorted({1, Hq}))), len(qb) - 1, len(kb) - 1)) \
        < draw(st.sampled_from([0.1, 0.3, 0.6]))
    blocks[:, rng.integers(len(qb) - 1)] = False
    return dict(mask=BlockMask(qb, kb, blocks), Hq=Hq, Hkv=Hkv, seed=int(rng.integers(1 << 30)),
                template=draw(st.sampled_from(KERNEL_TEMPLATES)),
                policy=draw(st.sampled_from(["split", "pack", "merge", "auto"])))


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(_token_level_cases())
def test_planned_token_level_masks_every_kernel(case):
    """The planner's plans of token-level masks (bitmap steps where a tile holds more than 4
    blocks per axis, tiles once, never above dense) run exactly on the Mosaic GPU kernel
    (interpreter), the Triton kernel (interpret mode) and the XLA executor."""
    from tessera_jax.planning.planner import build_plan

    t = templates.get(case["template"])
    mask, Hq, Hkv = case["mask"], case["Hq"], case["Hkv"]
    q, k, v = _inputs(case["seed"], 1, mask.Lq, mask.Lkv, Hq, Hkv, 64, jnp.bfloat16)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=t.tile_q, tile_kv=t.tile_kv,
                      policy=case["policy"], q_align=t.q_align, kv_align=t.kv_align,
                      template=t.name)
    st_ = plan.stats()
    assert st_["tile_revisits"] == 0
    # Never above a dense plan of the same tiles (Lq x Lkv when the tiles divide the lengths).
    dense_tiles = -(-mask.Lq // t.tile_q) * t.tile_q * -(-mask.Lkv // t.tile_kv) * t.tile_kv
    assert st_["computed_interactions"] <= dense_tiles * Hq
    kw = dict(scale=0.3, return_lse=True)
    if t.backend == "mosaic_gpu":
        from jax._src.pallas.mosaic_gpu.interpret import params as _interp
        kw["interpret"] = _interp.InterpretGPUParams()
    ops = {"mosaic_gpu": mosaic_ops, "triton": triton_ops, "xla": xla_ops}[t.backend]
    out, lse = calls.forward(ops, q, k, v, plan, t, **kw)
    ref, ref_lse = reference_attention(q, k, v, mask, scale=0.3, return_lse=True)
    _check(out, lse, ref, ref_lse, jnp.bfloat16)
