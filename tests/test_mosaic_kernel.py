"""The Mosaic GPU plan kernel (pallas_kernels.mosaic) against the dense reference.

On CPU the kernel runs under the Mosaic GPU interpreter (jax._src.pallas.mosaic_gpu.interpret),
which simulates warpgroups, barriers, TMA and wgmma. It has no rule for ``run_state`` nor for
wgmma with a register A operand, so in interpret mode the kernel does its P @ V product as a
plain dot on the SMEM tile; everything else (plan walking, the TMA ring and its barriers, QK
wgmma, masking of partial steps, the online softmax, the LSE and the unit-major stores) is the
code that runs on the GPU. The interpreter ignores SMEM layouts, so TMA alignment (templates'
q_align / kv_align = 8) is checked on the GPU by benchmarks/kernels.py, not here.
"""

import collections
import dataclasses
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import tessera_jax as tj
from tessera_jax.planning.planner import build_plan
from pallas_kernels import contract, templates
from pallas_kernels.mosaic import kernel as mosaic_kernel
from pallas_kernels.mosaic import ops as mosaic_ops
from pallas_kernels import abi as plan_abi
from pallas_kernels.templates import MosaicConfig

import contract_calls as calls
from cuda_lowering import assert_mosaic_lowers
from strategies import random_qkv
from test_triton_kernel import dense_reference, grid_plan

try:
    from jax._src.pallas.mosaic_gpu.interpret import params as _interp
    INTERPRET = _interp.InterpretGPUParams()
except Exception as e:  # pragma: no cover
    INTERPRET = None
    _INTERP_ERR = repr(e)

pytestmark = pytest.mark.skipif(INTERPRET is None,
                                reason="Mosaic GPU interpreter not importable in this jax")


def _tol(dtype):
    return 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 4e-3


def _check(out, lse, ref_out, ref_lse, dtype):
    out = np.asarray(out, np.float32)
    lse = np.asarray(lse)
    ref_out = np.asarray(ref_out, np.float32)
    ref_lse = np.asarray(ref_lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=_tol(dtype), rtol=0)
    err = np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out), 1e-6)
    assert err < _tol(dtype), err
    # Rows with no selected key are exactly 0.
    empty = np.isneginf(ref_lse)                                    # [B, Hq, Lq]
    assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0)


def _run(q, k, v, plan, template, **kw):
    """Mosaic GPU ``ops.forward`` of ``plan`` (``contract_calls.forward``) under the
    interpreter."""
    return calls.forward(mosaic_ops, q, k, v, plan, template, interpret=INTERPRET, **kw)


def _run_planned(mask, B, Lq, Lkv, Hq, Hkv, D, dtype, template, seed, policy="merge"):
    t = templates.get(template)
    q, k, v = random_qkv(B, Lq, Lkv, Hq, Hkv, D, dtype, seed)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=t.tile_q, tile_kv=t.tile_kv,
                      policy=policy, q_align=t.q_align, kv_align=t.kv_align, template=t.name)
    out, lse = _run(q, k, v, plan, t, return_lse=True)
    ref_out, ref_lse = tj.reference_attention(q, k, v, mask, return_lse=True)
    _check(out, lse, ref_out, ref_lse, dtype)
    return plan


def _variable_mask(rng, Lq, Lkv, Hm, nq, nkv, density, empty_row=True):
    qb = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, Lq), nq - 1, replace=False)), Lq])
    kb = np.unique(np.r_[0, np.sort(rng.choice(np.arange(1, Lkv), nkv - 1, replace=False)), Lkv])
    blocks = rng.random((Hm, len(qb) - 1, len(kb) - 1)) < density
    if empty_row:
        blocks[:, rng.integers(len(qb) - 1)] = False
    return tj.BlockMask(qb, kb, blocks)


def _seed(*key) -> int:
    """A stable seed (``hash`` of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


@pytest.mark.parametrize("template,dtype,D,Hq,Hkv,per_head", [
    ("mgpu_q128_kv64_s2_hm", jnp.bfloat16, 64, 4, 2, True),     # GQA, per-head, variable blocks
    ("mgpu_q128_kv128_s2_hm", jnp.float16, 128, 2, 1, False),   # MQA, shared mask
    ("mgpu_q128_kv64x2_s2_hm", jnp.bfloat16, 128, 4, 2, True),  # step pairs: grid steps a half
])
def test_planned_variable_blocks(template, dtype, D, Hq, Hkv, per_head):
    rng = np.random.default_rng(_seed(template, D))
    Lq, Lkv = 200, 200                    # ragged (was 200 x 330: ~40% fewer steps)
    mask = _variable_mask(rng, Lq, Lkv, Hq if per_head else 1, 7, 9, 0.45)
    plan = _run_planned(mask, 1, Lq, Lkv, Hq, Hkv, D, dtype, template, seed=int(rng.integers(1e9)))
    st = plan.stats()
    assert st["partial_tiles"] > 0            # the masked path ran


@pytest.mark.parametrize("template", ["mgpu_q128_kv64_s2_hm", "mgpu_q128_kv64x2_s2_hm"])
def test_full_and_partial_steps_aligned(template):
    """128 x 64 blocks give full steps (no masking) next to partial ones; batch 2 (step pairs:
    units of 1-3 steps, so full pairs, a pair with a partial step and odd counts' lone
    steps)."""
    rng = np.random.default_rng(7)
    Lq, Lkv = 256, 172                     # the last key block has 44 keys: partial steps
    blocks = rng.random((2, 2, 3)) < 0.6
    blocks[:, :, 0] = blocks[:, :, 2] = True
    mask = tj.BlockMask.uniform(Lq, Lkv, 128, 64, blocks)
    plan = _run_planned(mask, 2, Lq, Lkv, 2, 2, 64, jnp.bfloat16, template, seed=3)
    st = plan.stats()
    assert st["full_tiles"] > 0 and st["partial_tiles"] > 0
    counts = plan.units[:, plan_abi.UNIT_STEP_CNT]
    assert (counts % 2 == 1).any() and (counts % 2 == 0).any()


def test_step_pairs_all_full_odd_counts():
    """An all-full plan (mask mode "none" picked) on the step-pairs kernel: an odd count's last
    stage copies its step twice and must mask the copy (the kernel runs "cond"); a unit of one
    step and one of three, 64-key blocks at any 64-aligned start."""
    t = templates.get("mgpu_q128_kv64x2_s2_hm")
    Lq, Lkv = 256, 256
    blocks = np.zeros((1, 2, 4), bool)
    blocks[0, 0, [1]] = True
    blocks[0, 1, [0, 2, 3]] = True
    mask = tj.BlockMask.uniform(Lq, Lkv, 128, 64, blocks)
    plan = _run_planned(mask, 1, Lq, Lkv, 1, 1, 64, jnp.float16, t.name, seed=11)
    assert contract.forward_mask_mode(plan, t, 1, True) == "none"
    assert sorted(plan.units[:, plan_abi.UNIT_STEP_CNT].tolist()) == [1, 3]


def _hand_plan(token_mask, Hq, tile_q, tile_kv, seed):
    """Exact plan with several rectangles per K/V tile and steps in shuffled order."""
    Hm, Lq, Lkv = token_mask.shape
    qlp, klp = -(-Lq // tile_q) * tile_q, -(-Lkv // tile_kv) * tile_kv
    rng = np.random.default_rng(seed)
    units, steps = [], []
    row_index = np.zeros((Hq, Lq), np.int32)
    for h in range(Hq):
        tm = np.zeros((qlp, klp), bool)
        tm[:Lq, :Lkv] = token_mask[h if Hm > 1 else 0]
        for qs in range(0, Lq, tile_q):
            mine = []
            for ks in range(0, klp, tile_kv):
                t = tm[qs:qs + tile_q, ks:ks + tile_kv]
                r = 0
                while r < tile_q:
                    r2 = r + 1
                    while r2 < tile_q and np.array_equal(t[r2], t[r]):
                        r2 += 1
                    cols = np.flatnonzero(np.diff(np.r_[0, t[r].astype(np.int8), 0]))
                    for c0, c1 in zip(cols[::2], cols[1::2]):
                        mine.append((ks, r, r2, c0, c1))
                    r = r2
            rng.shuffle(mine)
            own = min(tile_q, Lq - qs)
            row_index[h, qs:qs + own] = len(units) * tile_q + np.arange(own)
            units.append((h, qs, 0, own, len(steps), len(mine)))
            steps += mine
    U = len(units) + 3                        # padding units at the end
    ua = np.zeros((U, plan_abi.UNIT_COLS), np.int32)
    ua[:len(units)] = units
    sa = np.zeros((len(steps) + 5, plan_abi.STEP_COLS), np.int32)
    if steps:
        view = np.array(steps, np.int64)       # (kv_start, q_lo, q_hi, kv_lo, kv_hi) rows
        sa[:len(steps), plan_abi.STEP_KV_START] = view[:, 0]
        sa[:len(steps), plan_abi.STEP_RECT] = plan_abi.pack_rect(*view[:, 1:].T)
    perm = rng.permutation(len(units))        # any unit order is valid
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(units))
    ua[:len(units)] = ua[perm]
    flat = row_index.astype(np.int64)
    row_index = (inv[flat // tile_q] * tile_q + flat % tile_q).astype(np.int32)
    return ua, sa, row_index, qlp, klp


def test_hand_plan_shuffled_rectangles():
    rng = np.random.default_rng(11)
    Lq, Lkv, Hq, Hkv, D, dtype = 256, 192, 2, 1, 64, jnp.float16
    mask = _variable_mask(rng, Lq, Lkv, Hq, 9, 8, 0.5)
    units, steps, row_index, qlp, klp = _hand_plan(mask.token_mask(), Hq, 128, 64, seed=5)
    assert len(steps) > 2 * units.shape[0]
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, dtype, seed=21)
    out, lse = _run(q, k, v, plan_abi.PassPlan(units, steps, row_index, 128, 64, qlp, klp, 0),
                    "mgpu_q128_kv64_s2_hm", scale=0.3, return_lse=True)
    ref_out, ref_lse = tj.reference_attention(q, k, v, mask, scale=0.3, return_lse=True)
    _check(out, lse, ref_out, ref_lse, dtype)


def test_empty_mask_gives_zero_and_neg_inf():
    mask = tj.BlockMask.uniform(130, 70, 64, 64, np.zeros((1, 3, 2), bool))
    q, k, v = random_qkv(1, 130, 70, 1, 1, 64, jnp.bfloat16, seed=1)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=128, tile_kv=64, q_align=8,
                      kv_align=8)
    out, lse = _run(q, k, v, plan, "mgpu_q128_kv64_s2_hm", return_lse=True)
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))


def _cube_mask(rng, Lq, Lkv, Hm, density, block=64):
    """64-token query/key blocks (VSA-like cubes) with a partial last block, per-head top-k
    style rows of random key blocks."""
    nq, nk = -(-Lq // block), -(-Lkv // block)
    blocks = rng.random((Hm, nq, nk)) < density
    blocks[:, :, 0] |= ~blocks.any(axis=2)             # no empty rows but one
    blocks[:, rng.integers(nq)] = False
    return tj.BlockMask.uniform(Lq, Lkv, block, block, blocks)


@pytest.mark.parametrize("template,dtype,Hq,Hkv", [
    ("mgpu_q64x2_kv64_s2_hm", jnp.float16, 2, 1),        # two 64-row units per CTA
    ("mgpu_q64x2pp_kv64_s2_hm", jnp.bfloat16, 4, 2),     # ... ping-ponged, GQA, per head
])
def test_q64_paired(template, dtype, Hq, Hkv):
    """tile_q=64 (paired: one unit per consumer warpgroup): units of 64 rows fit 64-token
    query blocks, so the plan computes less than with 128-row units, and the kernel matches
    the reference."""
    rng = np.random.default_rng(_seed(template))
    Lq, Lkv, D = 232, 264, 64
    mask = _cube_mask(rng, Lq, Lkv, Hq, 0.4)
    t = templates.get(template)
    plan = _run_planned(mask, 1, Lq, Lkv, Hq, Hkv, D, dtype, template,
                        seed=int(rng.integers(1e9)), policy=t.policy)
    assert plan.tile_q == 64 and plan.policy == "pack"
    p128 = build_plan(mask, (1, Lq, Hq, D), (1, Lkv, Hkv, D), dtype, tile_q=128,
                      tile_kv=t.tile_kv, q_align=8, kv_align=8)
    assert plan.stats()["computed_interactions"] < p128.stats()["computed_interactions"]


@pytest.mark.parametrize("template", ["mgpu_q64x2_kv64_s2_hm", "mgpu_q64x2pp_kv64_s2_hm"])
def test_paired_units_odd_count_and_uneven_steps(template):
    """Paired tile_q=64 kernel on a hand plan: neighbouring units with different step counts
    (several rectangles per K/V tile, shuffled), an odd unit count (the last CTA's second
    warpgroup has no unit) and padding units. With ping-pong, the warpgroup of the shorter
    unit must keep passing the schedule barrier (the interpreter checks the phases)."""
    rng = np.random.default_rng(19)
    Lq, Lkv, Hq, Hkv, D, dtype = 256, 200, 1, 1, 64, jnp.float16
    mask = _variable_mask(rng, Lq, Lkv, Hq, 9, 7, 0.5)
    units, steps, row_index, qlp, klp = _hand_plan(mask.token_mask(), Hq, 64, 64, seed=4)
    assert units.shape[0] % 2 == 1
    cnt = units[:, plan_abi.UNIT_STEP_CNT]
    assert len(set(cnt[:-3].tolist())) > 1
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, dtype, seed=41)
    out, lse = _run(q, k, v, plan_abi.PassPlan(units, steps, row_index, 64, 64, qlp, klp, 0),
                    template, scale=0.2, return_lse=True)
    ref_out, ref_lse = tj.reference_attention(q, k, v, mask, scale=0.2, return_lse=True)
    _check(out, lse, ref_out, ref_lse, dtype)


def _pack_plan(mask, Hq, Hkv, D, dtype, template):
    t = templates.get(template)
    plan = build_plan(mask, (1, mask.Lq, Hq, D), (1, mask.Lkv, Hkv, D), dtype,
                      tile_q=t.tile_q, tile_kv=t.tile_kv, policy="pack", q_align=8, kv_align=8)
    real = plan.units[:plan.num_units]
    idx = np.concatenate([np.arange(p, p + c) for p, c in real[:, 4:6]])
    st = plan_abi.unpack_steps(plan.steps[idx])
    lo, hi = st[:, plan_abi.VIEW_Q_LO], st[:, plan_abi.VIEW_Q_HI]
    return plan, (hi <= 64) | (lo >= 64)


@pytest.mark.parametrize("sched", [False, True])
def test_wg_skip_on_packed_halves(sched):
    """Pack plans on 64-row blocks put two query blocks in one 128-row unit, one rectangle per
    step: with wg_skip the warpgroup whose half a step misses skips it (with and without the
    ping-pong barrier, which must not deadlock), and the result matches the reference."""
    rng = np.random.default_rng(23 + sched)
    Lq, Lkv, Hq, Hkv, D, dtype = 256, 256, 2, 1, 64, jnp.bfloat16
    mask = _cube_mask(rng, Lq, Lkv, Hq, 0.35)
    t = templates.get("mgpu_q128_kv64_s2_skip")
    if sched:
        t = dataclasses.replace(t, name="skip_sched_test",
                                kernel=dataclasses.replace(t.kernel, schedule_barrier=True))
    assert mosaic_kernel.KernelConfig.from_template(t).pingpong == sched
    plan, one_half = _pack_plan(mask, Hq, Hkv, D, dtype, t)
    assert one_half.mean() > 0.5                    # most steps cover only one warpgroup
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, dtype, seed=31 + sched)
    out, lse = _run(q, k, v, plan, t, return_lse=True)
    ref_out, ref_lse = tj.reference_attention(q, k, v, mask, return_lse=True)
    _check(out, lse, ref_out, ref_lse, dtype)


def test_mask_modes_from_the_plan(monkeypatch):
    """A plan whose steps are all full runs without masking code ("none", chosen from the
    concrete plan); otherwise the per-step cond ("cond", the default); a template whose
    config says "always" masks every step, all-full plan or not. All match the reference,
    with the plan untrusted (checked, the mode picked) or trusted (its all_full)."""
    seen = []
    real_call = contract.forward_call

    def spy(*args, cfg, **kw):
        seen.append(cfg.mask_mode)
        return real_call(*args, cfg=cfg, **kw)

    monkeypatch.setattr(contract, "forward_call", spy)
    base = templates.get("mgpu_q128_kv64_s2_hm")
    always = dataclasses.replace(base, name="always_test", kernel=MosaicConfig(mask_mode="always"))
    rng = np.random.default_rng(3)
    Hq, Hkv, D, dtype = 2, 1, 64, jnp.float16
    for Lkv, template, want in ((192, base, "none"),
                                (200, base, "cond"),   # a partial last key tile
                                (200, always, "always")):
        nk = -(-Lkv // 64)
        blocks = rng.random((Hq, 2, nk)) < 0.6
        blocks[:, :, 0] = True
        blocks[:, 0, -1] = False                 # query tile 0: full steps only
        blocks[:, 1, -1] = True                  # query tile 1: the last key tile
        mask = tj.BlockMask.uniform(256, Lkv, 128, 64, blocks)
        q, k, v = random_qkv(1, 256, Lkv, Hq, Hkv, D, dtype, seed=int(rng.integers(1e9)))
        plan = build_plan(mask, q.shape, k.shape, dtype, tile_q=128, tile_kv=64, q_align=8,
                          kv_align=8)
        assert contract.forward_mask_mode(calls.pass_plan(plan), template, Hq, True) == want
        assert contract.mask_mode_for(template, plan.all_full) == want
        ref_out, ref_lse = tj.reference_attention(q, k, v, mask, return_lse=True)
        for all_full in (None, plan.all_full):          # untrusted, trusted
            seen.clear()
            out, lse = mosaic_ops.forward(q, k, v, calls.pass_plan(plan, all_full),
                                          template=template, scale=D ** -0.5,
                                          return_lse=True, interpret=INTERPRET)
            assert seen == [want]
            _check(out, lse, ref_out, ref_lse, dtype)
    # "always" stays "always" on an all-full plan; "cond" stays "cond" on a partial one.
    assert [contract.mask_mode_for(always, f) for f in (True, False)] == ["always", "always"]
    assert [contract.mask_mode_for(base, f) for f in (True, False)] == ["none", "cond"]
    for bad in ("sometimes", "unit"):           # "unit" was deleted with its templates
        with pytest.raises(ValueError, match="mask_mode"):
            calls.with_mask_mode(base, bad)


@pytest.fixture
def attention_calls(monkeypatch):
    """The Mosaic GPU forward (``ops.run_forward``, after the contract's checks) under the
    interpreter, recording (plan arrays are NumPy, mask mode) of every call the backend
    runner makes."""
    from pallas_kernels import contract
    from pallas_kernels.mosaic import ops
    calls = []
    real = ops.run_forward

    def spy(q, k, v, plan, t, mode, *a):
        calls.append((isinstance(plan.units, np.ndarray), mode))
        return real(q, k, v, plan, t, mode, *a)

    monkeypatch.setattr(ops, "forward", contract.forward_op(ops.BACKEND, spy))
    return calls


def test_backend_runner_prepares_each_plan_once(attention_calls, monkeypatch):
    """The kernel runner picks the mask mode once; a small plan's first call takes its NumPy
    arrays into the jitted call, later calls a device copy made once (no host walk over the
    steps in any eager call)."""
    from pallas_kernels.mosaic import ops
    from tessera_jax.planning.plan import host_pass
    from tessera_jax.runtime import kernel_runner as kernel_backends
    calls = attention_calls

    def run(plan, t, q, k, v, scale, return_lse):       # dispatch's mosaic_gpu forward
        return kernel_backends.run(ops, host_pass(plan, kernel_backends.tracing(q)), q, k, v,
                                   template=t, scale=scale, return_lse=return_lse)

    t = templates.get("mgpu_q128_kv64_s2_hm")
    mask = tj.BlockMask.uniform(256, 192, 128, 64, np.random.default_rng(2).random((1, 2, 3)) < .7)
    q, k, v = random_qkv(1, 256, 192, 2, 1, 64, jnp.bfloat16, seed=9)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=128, tile_kv=64, q_align=8,
                      kv_align=8, template=t.name)
    ref_out, ref_lse = tj.reference_attention(q, k, v, mask, scale=0.125, return_lse=True)
    real_check = plan_abi.check_plan

    def no_walk(*a, **kw):
        raise AssertionError("an eager call of a trusted plan walked its steps")

    monkeypatch.setattr(plan_abi, "check_plan", no_walk)
    puts = []
    real_put = kernel_backends.put_plan
    monkeypatch.setattr(kernel_backends, "put_plan", lambda *a: puts.append(1) or real_put(*a))
    for _ in range(3):
        out, lse = run(plan, t, q, k, v, 0.125, True)
        _check(out, lse, ref_out, ref_lse, jnp.bfloat16)
    # A planner-built plan is trusted: its fullness comes from Plan.all_full; the first call
    # passes NumPy (copied by the jitted call), the second copies it to the device once.
    assert plan.all_full
    assert calls == [(True, "none"), (False, "none"), (False, "none")]
    assert puts == [1]
    monkeypatch.setattr(plan_abi, "check_plan", real_check)
    # Traced (the plan becomes constants of a jitted caller): the NumPy arrays, not the cached
    # device arrays (jax would hoist those into extra inputs of an AOT-compiled loop).
    out, lse = jax.jit(lambda q: run(plan, t, q, k, v, 0.125, True))(q)
    _check(out, lse, ref_out, ref_lse, jnp.bfloat16)
    assert calls[3:] == [(True, "none")]


def test_backend_runner_takes_traced_plan_arrays(attention_calls, monkeypatch):
    """The profiler jits the backend call with the plan arrays as operands and a plain
    namespace as the plan: the runner passes them through (no host checks, no cache)."""
    from tessera_jax.tools import profiler as profile
    calls = attention_calls         # dispatch's mosaic_gpu entry calls the spied module
    t = templates.get("mgpu_q128_kv64_s2_hm")
    mask = tj.BlockMask.uniform(256, 192, 128, 64, np.random.default_rng(3).random((1, 2, 3)) < .7)
    q, k, v = random_qkv(1, 256, 192, 2, 1, 64, jnp.bfloat16, seed=11)
    plan = build_plan(mask, q.shape, k.shape, q.dtype, tile_q=128, tile_kv=64, q_align=8,
                      kv_align=8, template=t.name)
    units, steps, ri, ms = profile.padded_arrays(plan)
    fn = profile._executor(t.name, plan.tile_q, plan.tile_kv, plan.q_len_padded,
                           plan.kv_len_padded, ms, 0.125)
    out = fn(q, k, v, units, steps, ri)
    ref = tj.reference_attention(q, k, v, mask, scale=0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=3e-2, rtol=3e-2)
    assert calls == [(False, t.kernel.mask_mode)]


@pytest.mark.parametrize("base,kernel,mask_mode", [
    ("mgpu_q128_kv128_s2_hm", None, None),
    ("mgpu_q128_kv64_s2_hm", None, "none"),
    ("mgpu_q128_kv64_s2_hm", MosaicConfig(mask_mode="always"), None),
    ("mgpu_q128_kv64_s2_skip", None, None),
    ("mgpu_q128_kv64_s2_skip", MosaicConfig(wg_skip=True), None),         # skip + ping-pong
    ("mgpu_q64x2_kv64_s2_hm", None, None),
    ("mgpu_q64x2pp_kv64_s2_hm", None, None),
    ("mgpu_q64x2pp_kv64_s2_hm", None, "none"),
    ("mgpu_q128_kv64x2_s2_hm", None, None),
    ("mgpu_q128_kv64x2_s2_hm", None, "none"),
    ("mgpu_q128_kv64x2_s2_hm", MosaicConfig(step_pairs=True, mask_mode="always"), None),
])
def test_lowers_for_cuda(base, kernel, mask_mode):
    """The real (non-interpreted) kernel passes Mosaic GPU lowering and layout inference
    (cross-lowered for CUDA on this CPU machine; compiling to a cubin needs a GPU). Modes
    "cond" and "always" compile the grid-step mask too (a branch per step on STEP_CUTS_B)."""
    t = templates.get(base)
    if kernel is not None:
        t = dataclasses.replace(t, name="lower_test", kernel=kernel)
    L, Hq, Hkv, D = 512, 2, 1, 128
    mask = tj.BlockMask.uniform(L, L, 96, 96, np.random.default_rng(0).random((Hq, 6, 6)) < 0.5)
    plan = build_plan(mask, (1, L, Hq, D), (1, L, Hkv, D), jnp.bfloat16, tile_q=t.tile_q,
                      tile_kv=t.tile_kv, q_align=8, kv_align=8)
    sds = jax.ShapeDtypeStruct
    args = (sds((1, L, Hq, D), jnp.bfloat16), sds((1, L, Hkv, D), jnp.bfloat16),
            sds((1, L, Hkv, D), jnp.bfloat16), sds(plan.units.shape, jnp.int32),
            sds(plan.steps.shape, jnp.int32), sds(plan.row_index.shape, jnp.int32))
    f = lambda *a: contract.forward_call(  # noqa: E731
        *a, kernel=mosaic_kernel.forward,
        cfg=mosaic_kernel.KernelConfig.from_template(t, mask_mode),
        q_len_padded=plan.q_len_padded, kv_len_padded=plan.kv_len_padded, head_dim=D,
        scale=0.1, return_lse=True, interpret=False)
    assert_mosaic_lowers(f, *args)


def test_templates_and_kernel_configs():
    """The Mosaic templates are the H200 ranking table's candidates, the step-pairs one and the
    gathering ones; their configs fit SMEM."""
    names = [t.name for t in templates.for_backend("mosaic_gpu")]
    assert names == ["mgpu_q128_kv128_s2_hm", "mgpu_q128_kv64_s2_hm", "mgpu_q128_kv64x2_s2_hm",
                     "mgpu_q64x2_kv64_s2_hm",
                     "mgpu_q128_kv64_s2_skip", "mgpu_q64x2pp_kv64_s2_hm",
                     "mgpu_q128_kv128_s2_gather", "mgpu_q128_kv128_s2_gather_skip_nopp"]
    for t in templates.for_backend("mosaic_gpu"):
        if t.kernel.gather:
            assert t.policy == "gather" and "_gather" in t.name
            assert t.kernel.wg_skip == ("_skip" in t.name)
            assert t.row_group == (64 if t.kernel.wg_skip else 128)
            continue
        cfg = mosaic_kernel.KernelConfig.from_template(t)
        assert (cfg.tile_q, cfg.tile_kv, cfg.stages) == (t.tile_q, t.tile_kv, t.stages)
        assert cfg.variant is t.kernel and cfg.mask_mode == "cond"
        assert cfg.wg_skip == t.name.endswith("_skip")
        assert cfg.step_pairs == ("kv64x2" in t.name)
        assert cfg.stage_kv == (128 if cfg.step_pairs else t.tile_kv)
        assert cfg.paired == (t.tile_q == 64) and t.q_align == t.kv_align == 8
        assert t.unit_order == ("interleaved" if t.name.endswith("_skip") else "head_major")
        assert t.policy == ("pack" if t.tile_q == 64 or cfg.wg_skip else "merge")
        for d in t.head_dims:
            assert mosaic_kernel.smem_bytes(cfg, d) <= mosaic_kernel.MAX_SMEM, (t.name, d)
    assert mosaic_kernel.smem_bytes(mosaic_kernel.KernelConfig(128, 128, 3), 128) > \
        mosaic_kernel.MAX_SMEM
    # Ping-pong: on 128-row units unless turned off; on paired units only with pair_pingpong.
    pingpong = {t.name: mosaic_kernel.KernelConfig.from_template(t).pingpong
                for t in templates.for_backend("mosaic_gpu")}
    assert pingpong == {"mgpu_q128_kv128_s2_hm": True, "mgpu_q128_kv64_s2_hm": True,
                        "mgpu_q128_kv64x2_s2_hm": True,
                        "mgpu_q64x2_kv64_s2_hm": False, "mgpu_q128_kv64_s2_skip": False,
                        "mgpu_q64x2pp_kv64_s2_hm": True, "mgpu_q128_kv128_s2_gather": True,
                        "mgpu_q128_kv128_s2_gather_skip_nopp": False}
    t = templates.get("mgpu_q128_kv64_s2_hm")
    assert mosaic_kernel.KernelConfig.from_template(t, "none").mask_mode == "none"
    with pytest.raises(ValueError, match="mosaic_gpu"):
        contract.family_template("triton_q128_kv64_w8_s3_pf_hm", mosaic_ops.BACKEND)


def test_kernel_config_validates():
    K = mosaic_kernel.KernelConfig
    with pytest.raises(ValueError, match="tile_q"):
        K(96, 64, 2)
    with pytest.raises(ValueError, match="tile_kv"):
        K(128, 96, 2)
    with pytest.raises(ValueError, match="stages"):
        K(128, 64, 1)
    with pytest.raises(ValueError, match="wg_skip"):
        K(64, 64, 2, MosaicConfig(wg_skip=True))
    with pytest.raises(ValueError, match="paired"):
        K(128, 64, 2, MosaicConfig(paired=True))
    with pytest.raises(ValueError, match="paired"):           # tile_q=64 runs paired only
        K(64, 64, 2)
    with pytest.raises(ValueError, match="mask_mode"):
        K(128, 64, 2, mask_mode="sometimes")
    with pytest.raises(TypeError, match="variant"):
        K(128, 64, 2, variant="paired")
    assert K(64, 64, 2, MosaicConfig(paired=True), "none").rings == 2
    with pytest.raises(ValueError, match="step_pairs needs tile_kv=64"):
        K(128, 128, 2, MosaicConfig(step_pairs=True))
    for other in (dict(paired=True), dict(wg_skip=True), dict(gather=True)):
        with pytest.raises(ValueError, match="step_pairs"):
            MosaicConfig(step_pairs=True, **other)
    with pytest.raises(TypeError, match="step_pairs"):
        MosaicConfig(step_pairs=1)
    assert K(128, 64, 2, MosaicConfig(step_pairs=True)).stage_kv == 128


# --- grid steps (abi STEP_CUTS_A / STEP_CUTS_B: a tile computed once for several blocks) -----
def _run_grid_plan(template, seed, *, Hq, Hkv, D, dtype, shared=False, half_rows=False,
                   n_q=2, n_kv=3, min_grid=4):
    """A hand plan of grid, plain, full and padding steps (``grid_plan``) on ``template``,
    against dense float32 attention under ``abi.grid_mask``."""
    t = templates.get(template)
    rng = np.random.default_rng(seed)
    Lq, Lkv = n_q * t.tile_q + 24, n_kv * t.tile_kv + 20
    units, steps, row_index, qlp, klp, token, seen = grid_plan(
        rng, Lq=Lq, Lkv=Lkv, Hq=Hq, tile_q=t.tile_q, tile_kv=t.tile_kv, align=t.kv_align,
        shared=shared, half_rows=half_rows)
    assert seen["grid_steps"] >= min_grid, seen
    plan = plan_abi.PassPlan(units, steps, row_index, t.tile_q, t.tile_kv, qlp, klp, 0)
    assert contract.forward_mask_mode(plan, t, Hq, True) == t.kernel.mask_mode
    q, k, v = random_qkv(1, Lq, Lkv, Hq, Hkv, D, dtype, seed=seed + 1)
    out, lse = _run(q, k, v, plan, t, scale=0.25, return_lse=True)
    _check(out, lse, *dense_reference(q, k, v, token, 0.25), dtype)
    return units, steps, seen


def _variant(base, name, **kernel):
    t = templates.get(base)
    return dataclasses.replace(t, name=name, kernel=dataclasses.replace(t.kernel, **kernel))


@pytest.mark.parametrize("template,dtype,D,Hq,Hkv,shared", [
    ("mgpu_q128_kv128_s2_hm", jnp.float16, 128, 2, 1, True),       # MQA, shared steps
    ("mgpu_q128_kv64_s2_hm", jnp.bfloat16, 64, 4, 2, False),       # GQA, per head
    ("mgpu_q64x2_kv64_s2_hm", jnp.float16, 64, 2, 1, False),       # paired units
    ("mgpu_q64x2pp_kv64_s2_hm", jnp.bfloat16, 128, 2, 2, False),   # paired, ping-pong
    ("mgpu_q128_kv64x2_s2_hm", jnp.float16, 64, 2, 1, False),      # step pairs
    ("always", jnp.bfloat16, 128, 2, 1, False),                    # mask mode "always"
    ("pairs_always", jnp.bfloat16, 64, 2, 2, True),                # step pairs, "always"
])
def test_grid_steps(template, dtype, D, Hq, Hkv, shared):
    """Every kept template (and mask mode "always") on hand plans mixing grid steps (random
    cuts and cells on both axes, empty segments, single cells, all cells, bit 15 set, a grid
    step whose rectangle is the whole tile), plain partial, full and padding steps, a K/V tile
    split between a plain and a grid step, K/V tiles at 8-aligned offsets, in shuffled order;
    a unit with no steps, rows no unit owns, padding units."""
    if template == "always":
        template = _variant("mgpu_q128_kv64_s2_hm", "grid_always_test", mask_mode="always")
    elif template == "pairs_always":
        template = _variant("mgpu_q128_kv64x2_s2_hm", "pairs_always_test", mask_mode="always")
    seen = collections.Counter()
    for n in range(2):                       # two plans: every kind of step between them
        seed = _seed("grid", getattr(template, "name", template), D, n)
        seen += _run_grid_plan(template, seed, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype,
                               shared=shared)[2]
    assert all(seen[kind] for kind in ("grid", "grid_full", "plain", "full", "split", "pad")), \
        seen


@pytest.mark.parametrize("sched", [False, True])
def test_grid_steps_wg_skip(sched):
    """wg_skip (the "_skip" template, and with the ping-pong barrier): a warpgroup skips a
    grid step whose bounding rectangle misses its 64 rows, and computes (all masked) one
    whose cells happen to miss them."""
    t = templates.get("mgpu_q128_kv64_s2_skip")
    if sched:
        t = _variant(t.name, "grid_skip_sched_test", schedule_barrier=True)
    units, steps, _ = _run_grid_plan(t, _seed("grid_skip", sched), Hq=2, Hkv=1, D=64,
                                     dtype=jnp.bfloat16 if sched else jnp.float16,
                                     half_rows=True)
    view = plan_abi.unpack_steps(steps)
    grid = steps[:, plan_abi.STEP_CUTS_B] != 0
    one_half = (view[:, plan_abi.VIEW_Q_HI] <= 64) | (view[:, plan_abi.VIEW_Q_LO] >= 64)
    assert (grid & one_half).any() and (grid & ~one_half).any()


def test_grid_plan_never_runs_unmasked():
    """A plan whose rectangles are all the whole tile but with a grid step is partial: it runs
    "cond" (the full-step test includes STEP_CUTS_B == 0)."""
    T, Tk = 128, 64
    t = templates.get("mgpu_q128_kv64_s2_hm")
    full = plan_abi.full_rect(T, Tk)
    a, b = plan_abi.pack_grid((40, 64, 64), (0, 9, 33), 0b1001_0000_0110_1011)
    units = np.array([[0, 0, 0, T, 0, 3]], np.int32)
    steps = np.array([[0, full, 0, 0], [Tk, full, a, b], [2 * Tk, full, 0, 0]], np.int32)
    token = np.zeros((1, T, 3 * Tk), bool)
    token[0, :, :Tk] = token[0, :, 2 * Tk:] = True
    token[0, :, Tk:2 * Tk] = plan_abi.grid_mask(full, a, b, np.arange(T)[:, None],
                                                np.arange(Tk)[None, :])
    row_index = np.arange(T, dtype=np.int32)[None]
    plan = plan_abi.PassPlan(units, steps, row_index, T, Tk, T, 3 * Tk, 0)
    assert contract.forward_mask_mode(plan, t, 1, True) == "cond"
    q, k, v = random_qkv(1, T, 3 * Tk, 1, 1, 64, jnp.float16, seed=3)
    out, lse = _run(q, k, v, plan, t, scale=0.2, return_lse=True)
    _check(out, lse, *dense_reference(q, k, v, token, 0.2), jnp.float16)


@pytest.mark.parametrize("template,policy,dtype,D,Hq,Hkv", [
    ("mgpu_q128_kv64_s2_hm", "split", jnp.bfloat16, 64, 4, 2),
    ("mgpu_q128_kv128_s2_hm", "merge", jnp.float16, 128, 2, 1),
    ("mgpu_q64x2_kv64_s2_hm", "pack", jnp.float16, 64, 2, 1),
    ("mgpu_q128_kv64_s2_skip", "pack", jnp.bfloat16, 64, 2, 2),
    ("mgpu_q64x2pp_kv64_s2_hm", "pack", jnp.bfloat16, 128, 2, 1),
])
def test_planned_small_blocks_grid_steps(template, policy, dtype, D, Hq, Hkv):
    """Planned end to end: 16- and 24-token blocks on 64/128-wide tiles, per head with an
    empty query block; the planner computes each tile once (grid steps where several blocks
    touch it) and the kernel matches the dense reference of the mask."""
    rng = np.random.default_rng(_seed("planned_grid", template, policy))
    Lq, Lkv = 136, 168                    # ragged, two tiles or more (was 200 x 232)
    for block in (16, 24):
        nq, nk = -(-Lq // block), -(-Lkv // block)
        blocks = rng.random((Hq, nq, nk)) < 0.35
        blocks[:, rng.integers(nq)] = False
        mask = tj.BlockMask.uniform(Lq, Lkv, block, block, blocks)
        plan = _run_planned(mask, 1, Lq, Lkv, Hq, Hkv, D, dtype, template,
                            seed=int(rng.integers(1e9)), policy=policy)
        assert (plan.steps[:, plan_abi.STEP_CUTS_B] != 0).any(), \
            "these masks are meant to give grid steps: the test ran plain steps only"


def test_device_plan_runs_on_the_paired_kernel():
    """A device plan of 64-row tiles (one unit per query tile, in plan order) on q64x2: each
    CTA takes two neighbouring units (a pair may span two heads); 3 heads x 3 tiles give an odd
    unit count (the last warpgroup idles); variable blocks give grid steps; an empty block row."""
    from tessera_jax.planning import device
    rng = np.random.default_rng(_seed("device_paired"))
    Lq, Lkv = 136, 100
    qb = np.array([0, 20, 50, 90, 136]); kb = np.array([0, 30, 44, 70, 100])
    blocks = rng.random((3, 4, 4)) < 0.5
    blocks[:, 1] = False
    blocks[:, 2, 0] = True
    q, k, v = random_qkv(1, Lq, Lkv, 3, 1, 64, jnp.float16, int(rng.integers(1e9)))
    # Planned in one program, as the device route does (eagerly: ~200 small compiles).
    p, ok = jax.jit(lambda b: device.plan_on_device(b, qb, kb, num_q_heads=3, q_len=Lq,
                                                    kv_len=Lkv, tile_q=64, tile_kv=64))(
        jnp.asarray(blocks))
    assert bool(ok) and p.units.shape[0] == 9
    out, lse = mosaic_ops.forward(q, k, v, p, template=templates.get("mgpu_q64x2_kv64_s2_hm"),
                                  scale=64 ** -0.5, return_lse=True, interpret=INTERPRET,
                                  check_plan=False)
    _check(out, lse, *tj.reference_attention(q, k, v, tj.BlockMask(qb, kb, blocks),
                                             return_lse=True), jnp.float16)
