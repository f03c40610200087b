"""The ``gather`` policy on the device: a block mask in jax arrays -> a plan of gathered steps.

The host policy (``planning.gather``) inside jit, for masks whose selection is traced and whose
bounds are static (NumPy, shared by the heads): everything but the selection bits is then known
when tracing. Units are the host policy's query segments (``gather.segments``, at most
``max_blocks`` query blocks each), one per (query head, segment). In a segment a key block's
*signature* is the max_blocks bits of the local query blocks selecting it; the classes are the
2^max_blocks - 1 signature values, and a class's chunks (``abi.GATHER_ROWS`` keys) come from
the (key block, chunk) pairs whose block has that signature: sorted by (class, chunk) per
segment, equal pairs' bits summed (the key blocks of one chunk hold disjoint keys), ranked in
their class, 16 to a step. The steps of all units are compacted into ``capacity`` rows (static);
more make ``ok`` False and the excess is dropped. Steps come in unit order, a unit's in class
order: the host policy's plan up to the order of its classes and of its full chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import abi
from tessera_jax.planning import device as _device
from tessera_jax.planning import gather as _gather

__all__ = ["plan_gather_on_device", "step_bound", "fits"]


def _static(q_bounds, kv_bounds, q_len: int, kv_len: int, tile_q: int, tile_kv: int,
            max_blocks: int):
    """The structure of a mask with static shared bounds (``_structure``'s fields, one bounds
    head): the host policy's segments, their local query blocks and rows, the (key block,
    chunk, bits) pairs, the padded lengths."""
    qb = np.asarray(q_bounds, np.int64).reshape(-1)
    kb = np.asarray(kv_bounds, np.int64).reshape(-1)
    A = abi.GATHER_ROWS
    qp = -(-q_len // tile_q) * tile_q
    kvp = -(-kv_len // tile_kv) * tile_kv
    segs = np.array(_gather.segments(qb, tile_q, q_len, max_blocks=max_blocks),
                    np.int64).reshape(-1, 2)
    w0, w1 = segs[:, 0], segs[:, 1]
    s0 = np.minimum(w0 - w0 % A, qp - tile_q)
    i0 = np.searchsorted(qb, w0, side="right") - 1
    nbs = np.searchsorted(qb, w1, side="left") - i0
    r = s0[:, None] + np.arange(tile_q)
    local = np.searchsorted(qb, r, side="right") - 1 - i0[:, None]
    local = np.where((r >= w0[:, None]) & (r < w1[:, None]), local, -1)      # [S, tile_q]
    pj, pch, pbits = _gather.chunk_pairs(kb[:-1], kb[1:])
    pbits = pbits.astype(np.int32)
    bn = np.bincount(pj, minlength=len(kb) - 1)
    li = np.arange(max_blocks)
    return dict(qp=int(qp), kvp=int(kvp), w0=w0[None], w1=w1[None], s0=s0[None],
                nchunks=int(kvp // A), rows=np.minimum(i0[:, None] + li, len(qb) - 2)[None],
                valid=(li[None, :] < nbs[:, None])[None], local=local[None],
                pj=pj[None], pch=pch[None], pbits=pbits[None],
                pvalid=np.ones((1, len(pj)), bool), bn=bn[None],
                bstart=(np.cumsum(bn) - bn)[None], dup=int(np.bincount(pch).max()), ok=True)


def _traced(q_bounds, kv_bounds, q_len: int, kv_len: int, tile_q: int, tile_kv: int,
            max_blocks: int):
    """The structure of a mask whose bounds are traced (or per head: [Hb, n + 1]), for any
    block sizes. Query side: fixed tiles of tile_q rows; a tile meeting more than
    ``max_blocks`` query blocks gets one unit per ``max_blocks`` of them (its *sub-units*,
    each owning its blocks' rows of the tile), at most ``nt + (nq - 1) // max_blocks`` units
    in all (``nt`` tiles, ``nq`` blocks; unused ones are padding). Key side: every (key
    block, chunk of 8 keys) it meets, at most ``nchunks + nk - 1`` pairs. ``ok`` False only
    on bounds not increasing from 0 to the lengths (every index clamped: never an
    out-of-bounds read)."""
    A, C = abi.GATHER_ROWS, max_blocks
    qb = jnp.asarray(q_bounds, jnp.int32).reshape(-1, q_bounds.shape[-1])
    kb = jnp.asarray(kv_bounds, jnp.int32).reshape(-1, kv_bounds.shape[-1])
    Hb, nq, nk = qb.shape[0], qb.shape[1] - 1, kb.shape[1] - 1
    qp = -(-q_len // tile_q) * tile_q
    kvp = -(-kv_len // tile_kv) * tile_kv
    NT, NCH = qp // tile_q, kvp // A
    S, P = NT + (nq - 1) // C, NCH + nk - 1
    find = jax.vmap(lambda b, x: jnp.searchsorted(b, x, side="right", method=_device._SEARCH))
    t0 = np.arange(NT) * tile_q
    # Query side: the blocks meeting each tile, its sub-units, each sub-unit's tile and blocks.
    i0, last = _device._blocks_of(qb, t0[None], np.minimum(t0 + tile_q, q_len)[None])
    last = jnp.maximum(last, i0)                                           # [Hb, NT]
    subs = (last - i0) // C + 1
    cum = jnp.cumsum(subs, axis=1)                                         # [Hb, NT]
    j = jnp.arange(S, dtype=jnp.int32)
    used = j[None] < cum[:, -1:]                                           # [Hb, S]
    t = jnp.minimum(find(cum, jnp.broadcast_to(j, (Hb, S))), NT - 1)
    b0 = jnp.take_along_axis(i0, t, 1) + C * (j[None] - jnp.take_along_axis(cum - subs, t, 1))
    b0 = jnp.clip(b0, 0, nq - 1)
    s0 = t * tile_q
    bound = lambda i: jnp.take_along_axis(qb, jnp.clip(i, 0, nq), 1)       # noqa: E731
    w0 = jnp.where(used, jnp.maximum(s0, bound(b0)), s0)
    w1 = jnp.where(used, jnp.minimum(jnp.minimum(s0 + tile_q, q_len), bound(b0 + C)), s0)
    r = (t0[:, None] + np.arange(tile_q)).reshape(-1)
    rb = (find(qb, jnp.broadcast_to(jnp.asarray(r, jnp.int32), (Hb, len(r)))) - 1
          ).reshape(Hb, NT, tile_q)
    row = s0[:, :, None] + jnp.arange(tile_q)
    local = jnp.where((row >= w0[:, :, None]) & (row < w1[:, :, None]),
                      jnp.take_along_axis(rb, t[:, :, None], 1) - b0[:, :, None], -1)
    li = jnp.arange(C)
    rows = jnp.minimum(b0[:, :, None] + li, nq - 1)
    valid = used[:, :, None] & ((b0[:, :, None] + li)
                                <= jnp.take_along_axis(last, t, 1)[:, :, None])
    # Key side: block j meets chunks [a_j // A, ceil(b_j / A)); the pairs in block order.
    a, b = kb[:, :-1], kb[:, 1:]
    c0 = a // A
    n = jnp.maximum(-(-b // A) - c0, 0)
    ncum = jnp.cumsum(n, axis=1)                                           # [Hb, nk]
    p = jnp.arange(P, dtype=jnp.int32)
    pj = jnp.minimum(find(ncum, jnp.broadcast_to(p, (Hb, P))), nk - 1)
    pch = jnp.take_along_axis(c0, pj, 1) + p - jnp.take_along_axis(ncum - n, pj, 1)
    pvalid = p[None] < ncum[:, -1:]
    pch = jnp.where(pvalid, jnp.clip(pch, 0, NCH - 1), 0)
    lo = jnp.clip(jnp.take_along_axis(a, pj, 1) - pch * A, 0, A)
    hi = jnp.clip(jnp.take_along_axis(b, pj, 1) - pch * A, 0, A)
    pbits = jnp.where(pvalid, (1 << hi) - (1 << lo), 0)
    ok = jnp.asarray(True)
    for bnd, length in ((qb, q_len), (kb, kv_len)):
        ok &= jnp.all(bnd[:, 1:] > bnd[:, :-1]) & jnp.all(bnd[:, 0] == 0) \
            & jnp.all(bnd[:, -1] == length)
    return dict(qp=int(qp), kvp=int(kvp), w0=w0, w1=w1, s0=s0, nchunks=int(NCH), rows=rows,
                valid=valid, local=local, pj=pj, pch=pch, pbits=pbits, pvalid=pvalid, bn=n,
                bstart=jnp.minimum(ncum - n, P - 1), dup=int(min(A, nk)), ok=ok)


def _structure(q_bounds, kv_bounds, q_len, kv_len, tile_q, tile_kv, max_blocks):
    """``_static`` for static bounds shared by the heads, else ``_traced``. Per-segment fields
    (``w0``, ``w1``, ``s0``: [Hb, S]; ``rows``, ``valid``, ``local``) and per-pair ones
    (``pj``, ``pch``, ``pbits``, ``pvalid``: [Hb, P]; pairs in block order, a block's
    chunks in order) and per-key-block ones (``bn``: its pairs, ``bstart``: its first) have a
    bounds-head axis (1: shared)."""
    static = all(isinstance(b, np.ndarray) and (b.ndim == 1 or b.shape[0] == 1)
                 for b in (q_bounds, kv_bounds))
    if static:
        return _static(q_bounds, kv_bounds, q_len, kv_len, tile_q, tile_kv, max_blocks)
    return _traced(q_bounds, kv_bounds, q_len, kv_len, tile_q, tile_kv, max_blocks)


def fits(q_bounds, kv_bounds, *, q_len: int, kv_len: int, tile_q: int, tile_kv: int,
         max_blocks: int = 4) -> bool:
    """Whether static (NumPy) bounds are valid for the policy: increasing from 0 to the
    lengths (any block sizes fit). Evaluated now, also inside a trace (per-head NumPy bounds
    take ``_traced``'s jnp code)."""
    with jax.ensure_compile_time_eval():
        return bool(_structure(q_bounds, kv_bounds, q_len, kv_len, tile_q, tile_kv,
                               max_blocks)["ok"])


def step_bound(q_bounds, kv_bounds, *, q_len: int, kv_len: int, tile_q: int, tile_kv: int,
               max_blocks: int = 4) -> tuple[int, int]:
    """(most steps one unit can have, most steps a mask head's units can have): every pair a
    class of its own run of chunks, each class one partial step."""
    st = _structure(q_bounds, kv_bounds, q_len, kv_len, tile_q, tile_kv, max_blocks)
    per_unit = -(-st["pch"].shape[-1] // abi.gather_chunks(tile_kv)) + (1 << max_blocks) - 1
    return per_unit, per_unit * st["s0"].shape[-1]


def plan_gather_on_device(blocks, q_bounds, kv_bounds, *, num_q_heads: int, q_len: int,
                          kv_len: int, tile_q: int, tile_kv: int, capacity: int,
                          max_blocks: int = 4, max_elements: int = 1 << 26,
                          row_group: int = 0) -> tuple[abi.PassPlan, jax.Array]:
    """(plan, ok) of the gather policy for ``blocks`` bool [Hm, nq, nk] (jax or NumPy; Hm = 1
    or num_q_heads) over bounds ``q_bounds`` / ``kv_bounds``: static and shared (NumPy [n + 1]
    or [1, n + 1]: the host policy's segments of at most ``max_blocks`` query blocks), or
    traced or per head ([Hm, n + 1]: fixed tiles of tile_q rows, a tile meeting more than
    ``max_blocks`` query blocks split into units of that many; any block sizes). At most
    ``capacity`` steps (static; ``step_bound`` gives enough for any selection). ``ok``
    False when the selection needs more steps or traced bounds are not increasing from 0 to
    the lengths; every index is clamped. The plan's leaves are jax arrays, its
    ``row_index`` None and ``all_full`` None. Mask heads are planned in groups of at most
    ``max_elements`` (head, unit, key pair) entries, one after another, each with an equal
    share of ``capacity`` (rounded up). ``row_group``: rows of a tile the kernel computes as
    one (``Template.row_group``: 64 for warpgroup step skipping; 0 or ``tile_q``: the tile):
    a unit's steps that meet one group alternate between the groups, then those meeting
    several, as the host policy's ``gather.interleave_groups`` orders them (each warpgroup
    computes while the other skips). Units come heaviest first (``schedule.order_units``'
    head-major order, as the host planner's and ``planning.device``'s)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) \
            or not 1 <= max_blocks <= 8:
        raise ValueError(f"max_blocks must be an int in [1, 8], got {max_blocks!r}")
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise ValueError(f"max_elements must be a positive int, got {max_elements!r}")
    if isinstance(row_group, bool) or not isinstance(row_group, int) or row_group < 0 \
            or (row_group and tile_q % row_group):
        raise ValueError(f"row_group must be 0 or a positive int dividing tile_q={tile_q}, "
                         f"got {row_group!r}")
    groups = tile_q // row_group if row_group else 1
    Hm, nq, nk = blocks.shape
    if Hm not in (1, num_q_heads):
        raise ValueError(f"blocks has {Hm} heads: 1 (shared) or num_q_heads={num_q_heads}")
    for name, b, n in (("q_bounds", q_bounds, nq), ("kv_bounds", kv_bounds, nk)):
        if np.ndim(b) not in (1, 2) or np.shape(b)[-1] != n + 1 \
                or (np.ndim(b) == 2 and np.shape(b)[0] not in (1, Hm)):
            raise ValueError(f"{name} must be [{n + 1}] or [1 or {Hm}, {n + 1}], got shape "
                             f"{np.shape(b)}")
    st = _structure(q_bounds, kv_bounds, q_len, kv_len, tile_q, tile_kv, max_blocks)
    G = abi.gather_chunks(tile_kv)
    C, S, P, NCH = max_blocks, st["s0"].shape[-1], st["pch"].shape[-1], st["nchunks"]
    blocks = jnp.asarray(blocks, bool)
    Hb = st["rows"].shape[0]
    wr = abi.gather_word_rows(tile_q, tile_kv)
    hg = max(d for d in range(1, Hm + 1)
             if Hm % d == 0 and (d == 1 or d * S * P <= max_elements))
    ng = Hm // hg
    cap_g = -(-capacity // ng)
    capacity = cap_g * ng
    heads = ("rows", "valid", "pj", "pch", "pbits", "pvalid", "bn", "bstart", "local")

    def group(blk, part, offset):
        return _group_steps(blk, part, offset, capacity=capacity, cap_g=cap_g, C=C, G=G,
                            NCH=NCH, wr=wr, dup=st["dup"], groups=groups)

    if ng == 1:
        head, words, base, nsteps, totals = group(blocks, {f: st[f] for f in heads}, 0)
    else:
        # Head groups one after another (lax.map): [hg, S, P] temporaries, not [Hm, S, P].
        split = lambda x: jnp.asarray(x).reshape((ng, hg) + np.shape(x)[1:])   # noqa: E731
        xs = (split(blocks), {f: split(st[f]) for f in heads if Hb > 1},
              jnp.arange(ng, dtype=jnp.int32) * cap_g)
        shared = {f: st[f] for f in heads if Hb == 1}
        head, words, base, nsteps, totals = lax.map(
            lambda x: group(x[0], {**shared, **x[1]}, x[2]), xs)
        head, words = head.reshape(capacity, -1), words.reshape(capacity * wr, -1)
        base, nsteps = base.reshape(Hm, S), nsteps.reshape(Hm, S)
    steps = jnp.concatenate([head, words], axis=0)
    # Units: one per (query head, segment), its mask head's steps.
    hq = np.arange(num_q_heads)
    hm = hq if Hm > 1 else np.zeros_like(hq)
    ptr = jnp.minimum(base[hm], capacity)                                  # [Hq, S]
    cnt = jnp.clip(capacity - ptr, 0, nsteps[hm])
    hb = hm if Hb > 1 else np.zeros_like(hq)
    s0, w0, w1 = (jnp.asarray(st[f])[hb].reshape(-1) for f in ("s0", "w0", "w1"))
    units = jnp.stack([jnp.asarray(np.repeat(hq, S)), s0, w0 - s0, w1 - s0,
                       ptr.reshape(-1), cnt.reshape(-1)], axis=1).astype(jnp.int32)
    per_unit = -(-P // G) + (1 << C) - 1
    # Heaviest units first (steps, and those not whole): in (head, segment) order a head's
    # costliest segments could come last and form the kernel's tail.
    full = (head[:, abi.STEP_CUTS_B] == abi.GATHER_FULL_FLAG).astype(jnp.int32)
    fsum = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(full)])
    nfull = fsum[jnp.minimum(ptr + cnt, capacity)] - fsum[ptr]
    units = units[_device._heavy_first(units, (cnt - nfull).reshape(-1), tile_q, tile_kv,
                                       int(min(per_unit, capacity)), num_q_heads)]
    plan = abi.PassPlan(units, steps, None, int(tile_q), int(tile_kv), st["qp"], st["kvp"],
                        int(min(per_unit, capacity)))
    return plan, jnp.all(totals <= cap_g) & jnp.asarray(st["ok"])


def _group_steps(blocks, part, offset, *, capacity: int, cap_g: int, C: int, G: int, NCH: int,
                 wr: int, dup: int, groups: int = 1):
    """The steps of mask heads ``blocks`` [hg, nq, nk] (their structure fields ``part``, a
    bounds-head axis of hg or 1): head rows [cap_g, STEP_COLS] and word rows [cap_g * wr,
    STEP_COLS] for global steps offset .. offset + cap_g of a plan of ``capacity`` steps,
    each (head, unit)'s first global step and step count [hg, S], and the steps needed.
    ``groups`` > 1: a unit's steps in ``_step_order``'s order (row groups of tile_q /
    groups rows), else in class order."""
    A = abi.GATHER_ROWS
    Hm, nq, nk = blocks.shape
    Hb = part["rows"].shape[0]
    S, P = part["local"].shape[1], part["pch"].shape[-1]
    per_head = lambda x: jnp.broadcast_to(jnp.asarray(x), (Hm,) + np.shape(x)[1:])  # noqa

    # Signatures: bit l of a key block's is local query block l of the segment selecting it.
    li = np.arange(C)
    rows = per_head(part["rows"]).reshape(Hm, S * C)
    sel = jnp.take_along_axis(blocks, rows[:, :, None], axis=1).reshape(Hm, S, C, nk)
    sel = sel & per_head(part["valid"])[..., None]                          # [Hm, S, C, nk]
    sig = jnp.sum(sel.astype(jnp.int32) << jnp.asarray(li)[None, None, :, None], axis=2)
    # Per key block: whether its first chunk is an earlier block's of its class (a chunk's
    # blocks are at most dup consecutive ones), the rank of that chunk in its class, its first
    # step; then each pair's from its block's in one gather.
    pch_h, bn = per_head(part["pch"]).astype(jnp.int32), per_head(part["bn"])
    bstart = per_head(part["bstart"])
    c0 = jnp.take_along_axis(pch_h, bstart, 1)[:, None, :]                 # [Hm, 1, nk]
    c1 = jnp.take_along_axis(pch_h, jnp.maximum(bstart + bn - 1, 0), 1)[:, None, :]
    merged = jnp.zeros(sig.shape, bool)
    for d in range(1, dup):
        merged |= (_shift(sig, -d, 0) == sig) & (_shift(c1, -d, -1) == c0)
    merged &= sig > 0
    r0, counts = _block_ranks(sig, jnp.where(sig > 0, bn[:, None, :] - merged, 0), C)
    # Steps: each class's entries G at a time, classes in order, units one after another.
    csteps = -(-counts // G)                                               # [Hm, S, 2^C]
    nsteps = jnp.sum(csteps, axis=-1)                                      # [Hm, S]
    base = (jnp.cumsum(nsteps.reshape(-1)) - nsteps.reshape(-1)).reshape(Hm, S)
    total = jnp.sum(nsteps)
    rt = _row_tables(part["local"], C)
    place = _step_order(csteps, per_head(rt["lo"]), per_head(rt["hi"]),
                        part["local"].shape[-1], groups)
    # (class, merged, rank of the block's first pair minus its index + P) in one word.
    packed = (sig << 27) | (merged.astype(jnp.int32) << 26) \
        | (r0 - merged - bstart[:, None, :] + P)
    pj = jnp.broadcast_to(per_head(part["pj"])[:, None, :], (Hm, S, P))
    pk = jnp.take_along_axis(packed, pj, 2)                                # [Hm, S, P]
    cls = pk >> 27
    pidx = jnp.arange(P, dtype=jnp.int32)
    rank = (pk & ((1 << 26) - 1)) - P + pidx
    valid = (cls > 0) & per_head(part["pvalid"])[:, None, :]
    first = pidx == jnp.take_along_axis(bstart, per_head(part["pj"]), 1)[:, None, :]
    ent = valid & ~(first & ((pk >> 26) & 1 == 1))
    ch = jnp.broadcast_to(pch_h[:, None, :], pk.shape)
    comb = _chunk_bits(jnp.where(valid, cls * NCH + ch, -1),
                       jnp.broadcast_to(per_head(part["pbits"])[:, None, :], pk.shape), dup)
    gstep = base[:, :, None] + place(cls, rank // G)                       # [Hm, S, P]
    tgt = jnp.where(ent & (gstep < cap_g), gstep, cap_g)                   # cap_g: dropped
    slot = rank % G
    new_step = ent & (slot == 0)
    # Scatters of exactly cap_g rows, index cap_g dropped: a slice of a larger scatter trips
    # XLA GPU's scatter-slice simplifier (a RET_CHECK shape mismatch, jax 0.11.2 on the H100).
    starts = jnp.full((cap_g, G), -1, jnp.int32).at[tgt, slot].set(ch * A, mode="drop")
    kbits = jnp.zeros((cap_g, G), jnp.int32).at[tgt, slot].set(comb, mode="drop")
    lead = jnp.where(new_step, tgt, cap_g)
    hs = jnp.arange(Hm * S, dtype=jnp.int32).reshape(Hm, S)[:, :, None]
    step_cls = jnp.zeros(cap_g, jnp.int32).at[lead].set(cls, mode="drop")
    step_hs = jnp.zeros(cap_g, jnp.int32).at[lead].set(jnp.broadcast_to(hs, lead.shape),
                                                       mode="drop")
    starts = jnp.where(starts < 0, starts[:, :1], starts)                  # unused: slot 0's
    starts = jnp.maximum(starts, 0)                                        # an empty row
    # Row bits depend on (segment, class) alone: static tables, gathered per step.
    live = jnp.arange(cap_g) < total
    sc = ((step_hs // S) if Hb > 1 else 0, step_hs % S, step_cls)
    rw = jnp.where(live[:, None], jnp.asarray(rt["words"])[sc], 0)
    q_lo, q_hi = jnp.asarray(rt["lo"])[sc], jnp.asarray(rt["hi"])[sc]
    # Key bits: 8 a chunk, four chunks a word.
    kbits = jnp.where(live[:, None], kbits, 0)
    kw = jnp.sum(kbits.reshape(cap_g, -1, 4).astype(jnp.uint32)
                 << (8 * jnp.arange(4, dtype=jnp.uint32)), axis=2)
    kw = lax.bitcast_convert_type(kw, jnp.int32)
    kv_lo, kv_hi = _key_span(kbits)
    words = jnp.concatenate([starts, kw, rw], axis=1)
    words = jnp.pad(words, ((0, 0), (0, wr * abi.STEP_COLS - words.shape[1])))
    full = jnp.all(kbits == (1 << A) - 1, axis=1) & jnp.asarray(rt["full"])[sc]
    head = jnp.stack([starts[:, 0], abi.pack_rect(q_lo, q_hi, kv_lo, kv_hi),
                      (capacity + (offset + jnp.arange(cap_g, dtype=jnp.int32)) * wr)
                      * abi.STEP_COLS,
                      jnp.where(full, abi.GATHER_FULL_FLAG, abi.GATHER_FLAG)], axis=1)
    head = jnp.where(live[:, None], head, jnp.zeros_like(head))
    return (head.astype(jnp.int32), words.reshape(cap_g * wr, abi.STEP_COLS),
            base + offset, nsteps, total)


def _step_order(csteps, lo, hi, tile_q: int, groups: int):
    """``place(cls, k)``: the place in its unit of the k-th step of class ``cls`` (int arrays
    [Hm, S, P]), for classes' steps ``csteps`` [Hm, S, 2^C] and row ranges [lo, hi) [Hm, S,
    2^C]. groups == 1: classes in order. Else (row groups of tile_q / groups rows) the order
    of ``gather.interleave_groups``: the steps meeting one group first, by (rank among that
    group's steps, group), so the groups alternate while each has steps left; then those
    meeting several, in class order (ranks within a kind in class order, as the host's)."""
    coff = jnp.cumsum(csteps, axis=-1) - csteps
    if groups <= 1:
        return lambda cls, k: jnp.take_along_axis(coff, cls, 2) + k
    R = tile_q // groups
    meets = jnp.stack([(lo < (g + 1) * R) & (hi > g * R) & (lo < hi) for g in range(groups)])
    one = meets.sum(axis=0) == 1
    kind = jnp.where(one, jnp.argmax(meets, axis=0), groups)               # groups: several
    n, off = [], jnp.zeros_like(csteps)
    for g in range(groups + 1):
        in_g = jnp.where(kind == g, csteps, 0)
        n.append(jnp.sum(in_g, axis=-1, keepdims=True))                    # [Hm, S, 1]
        off = off + jnp.where(kind == g, jnp.cumsum(in_g, axis=-1) - in_g, 0)
    singles = sum(n[:groups])
    table = (off << 4) | kind                                              # groups <= 15

    def place(cls, k):
        t = jnp.take_along_axis(table, cls, 2)
        g, r = t & 15, (t >> 4) + k
        # A single-group step of rank r in group g follows the steps of rank < r of every
        # group and of rank r of the groups before g.
        pos = sum(jnp.minimum(r + (h < g), n[h]) for h in range(groups))
        return jnp.where(g < groups, pos, singles + r)

    return place


def _shift(x, d: int, fill):
    """x moved d places along its last axis (d > 0: x[..., i + d] at i; d < 0: toward higher
    indices), ``fill`` where nothing comes."""
    pad = jnp.full(x.shape[:-1] + (abs(d),), fill, x.dtype)
    return (jnp.concatenate([x[..., d:], pad], axis=-1) if d > 0
            else jnp.concatenate([pad, x[..., :d]], axis=-1))


def _chunk_bits(key, bits, dup: int):
    """Each pair's bits plus those of the later pairs of its (class, chunk) ``key`` (-1: not
    selected; pairs [..., P] in block order: a chunk's are consecutive, at most ``dup``;
    disjoint keys, so the sum is the union): an entry's bits."""
    comb = bits
    for d in range(1, dup):
        comb = comb + jnp.where(_shift(key, d, -2) == key, _shift(bits, d, 0), 0)
    return comb


def _block_ranks(sig, entries, C: int):
    """(rank in its class of each key block's first entry, entries per class) for key blocks
    [..., nk] of classes ``sig`` (0: none) contributing ``entries`` each, a class's blocks in
    key order: one sort of the blocks by class."""
    nk = sig.shape[-1]
    j = jnp.arange(nk, dtype=jnp.int32)
    key = lax.sort(jnp.where(sig > 0, sig * nk + j, (1 << C) * nk), dimension=sig.ndim - 1)
    js, cs = key % nk, key // nk
    e = jnp.where(cs < (1 << C), jnp.take_along_axis(entries, js, sig.ndim - 1), 0)
    ex = jnp.cumsum(e, axis=-1) - e
    start = lax.cummax(jnp.where(cs != _shift(cs, -1, -1), ex, 0), axis=sig.ndim - 1)
    ranks = jnp.put_along_axis(jnp.zeros_like(sig), js, ex - start, axis=-1, inplace=False)
    counts = jnp.sum(jnp.where(sig[..., None] == jnp.arange(1 << C), entries[..., None], 0),
                     axis=-2)
    return ranks, counts


def _row_tables(local, C: int) -> dict:
    """Per (bounds head, segment, class): the row words (``abi.pack_gather``'s), the first and
    last + 1 selected row, whether every row is selected. ``local`` [Hb, S, tile_q]: each tile
    row's local query block (-1: not the segment's); NumPy (static) or jnp."""
    xp = np if isinstance(local, np.ndarray) else jnp
    cls = xp.arange(1 << C)
    sel = (local[:, :, None, :] >= 0) & (
        (cls[None, None, :, None] >> xp.maximum(local[:, :, None, :], 0)) & 1 == 1)
    T = local.shape[-1]
    any_ = sel.any(axis=-1)
    lo = xp.where(any_, sel.argmax(axis=-1), 0)
    hi = xp.where(any_, T - sel[..., ::-1].argmax(axis=-1), 0)
    words = abi.pack_bits(sel) if xp is np else _device.pack_words(sel, abi.bitmap_words(T))
    return dict(words=words, lo=lo.astype(xp.int32), hi=hi.astype(xp.int32),
                full=sel.all(axis=-1))


def _key_span(kbits):
    """(first selected key, last + 1) of chunks' 8-bit key masks [n, G] (0, 0: none)."""
    A = abi.GATHER_ROWS
    G = kbits.shape[1]
    nz = kbits != 0
    any_ = jnp.any(nz, axis=1)
    j0 = jnp.argmax(nz, axis=1)
    j1 = G - 1 - jnp.argmax(nz[:, ::-1], axis=1)
    b0 = jnp.take_along_axis(kbits, j0[:, None], axis=1)[:, 0]
    b1 = jnp.take_along_axis(kbits, j1[:, None], axis=1)[:, 0]
    low = lax.population_count((b0 & -b0) - 1)                  # index of the lowest set bit
    high = 32 - lax.clz(b1)                                     # index of the highest + 1
    return jnp.where(any_, A * j0 + low, 0), jnp.where(any_, A * j1 + high, 0)
