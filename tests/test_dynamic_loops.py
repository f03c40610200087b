"""Compiled denoising loops with masks built from q and k (issue 17): the schedule as data.

A tiny Wan model runs a DynamicSchedule (VSA- and SVG2-like rules, dense warm-up, per-layer
choices): one trace, nothing moved to the host inside the loop, the output of a dense-masked
float32 reference loop whose choices are read on the host, and the table as data (another
table reuses the executable and changes the result).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.nnx as nnx

from tessera_jax.flax import (AttentionOptions, DynamicSchedule, LayerAttention, MaskSchedule,
                              SparseSelfAttention, at_step, dynamic_attention)
from tessera_jax.masks import dynamic as dm
from tessera_jax.models import WAN21_1_3B, WanModel, make_sampler
from tessera_jax.models.common import numpy_init

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loop  # noqa: E402  (benchmarks/ is not a package)

TOL = dict(atol=1e-4, rtol=1e-4)
# CPU compiles of these loops dominate the file's time: skip LLVM's expensive passes (no
# change to float semantics; this file's executables only).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
WAN_TINY = WAN21_1_3B.replace(num_layers=2, num_heads=2, head_dim=16, ffn_dim=64, text_dim=32,
                              text_len=8, in_channels=4, out_channels=4, freq_dim=32)
# Step x layer choices: 0 dense, 1 VSA, 2 SVG2 (SVG2 starts at step 1 in layer 1 and at step 2
# in layer 0, so both initialise their centroids in the loop and then warm-start).
TABLE = np.array([[0, 0], [1, 2], [2, 1], [2, 2]], np.int32)
RULES = (dm.VSA(block=8, keep=0.25),
         dm.SVG2(q_clusters=4, kv_clusters=6, init_iters=3, iters=1, top_p=0.3))


def masked_dense(q, k, v, mask, scale=None):
    """The mask applied as a dense boolean token mask, float32 softmax (device masks, per-head
    or shared bounds)."""
    B, Lq, Hq, D = q.shape
    Lkv, Hkv = k.shape[1], k.shape[2]
    Hm, nq, nk = mask.blocks.shape
    qb = jnp.asarray(mask.q_bounds, jnp.int32).reshape(-1, nq + 1)
    kb = jnp.asarray(mask.kv_bounds, jnp.int32).reshape(-1, nk + 1)
    def ids(b, L):           # block of each token, per bounds row, broadcast to the mask heads
        i = jax.vmap(lambda r: jnp.searchsorted(r, jnp.arange(L), side="right"))(b) - 1
        return jnp.broadcast_to(i, (Hm, L))

    qi, ki = ids(qb, Lq), ids(kb, Lkv)
    tok = jnp.asarray(mask.blocks)[jnp.arange(Hm)[:, None, None], qi[:, :, None], ki[:, None, :]]
    tok = jnp.broadcast_to(tok, (Hq, Lq, Lkv))
    f32 = jnp.float32
    kf = jnp.repeat(k.astype(f32), Hq // Hkv, axis=2)
    vf = jnp.repeat(v.astype(f32), Hq // Hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), kf, precision="highest")
    s = jnp.where(tok[None], s * (D ** -0.5 if scale is None else scale), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), vf, precision="highest")
    return o.astype(q.dtype)


REF = AttentionOptions(sparse_fn=masked_dense)


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def tiny_wan(seed=0):
    return numpy_init(WanModel, WAN_TINY, seed)


@pytest.fixture(scope="module")
def wan():
    # latent (3, 8, 8, 4), patch (1, 2, 2) -> token grid (3, 4, 4): 48 video tokens
    return tiny_wan(), _normal(1, (1, 3, 8, 8, 4)), _normal(2, (1, 8, 32))


@pytest.fixture(scope="module")
def loop(wan):
    """The compiled loop (AOT, as bench_loop runs it) and its device-resident arguments."""
    model, x, ctx = wan
    sampler = make_sampler(model, DynamicSchedule(RULES, TABLE))
    lowered = sampler.lower(x, ctx)
    args = jax.device_put((nnx.state(model), x, ctx, None, None, sampler.table_array()))
    return sampler, lowered, lowered.compile(FAST), args


def test_one_trace_no_host_transfer(wan, loop):
    sampler, lowered, compiled, args = loop
    assert bench_loop.host_transfer_ops(lowered.as_text()) == 0
    assert bench_loop.host_transfer_ops(compiled.as_text()) == 0
    assert sampler.trace_count == 1 and sampler.traced_forwards == 1
    x2 = jax.device_put(args[1] + 0.5)
    with jax.transfer_guard("disallow"):        # inputs on the device: the loop moves nothing
        a = jax.block_until_ready(compiled(*args))
        b = jax.block_until_ready(compiled(*args[:1], x2, *args[2:]))
    assert sampler.trace_count == 1 and not np.allclose(a, b)
    # The guard is live: a NumPy input would be a host transfer.
    with pytest.raises(Exception, match="[Dd]isallowed"):
        with jax.transfer_guard("disallow"):
            compiled(*args[:1], np.asarray(args[1]), *args[2:])


def test_loop_equals_dense_masked_reference_and_the_table_is_data(wan, loop):
    """Against a loop tracing each step with its choices read on the host (no lax.switch) and
    the masks applied densely in float32; a changed table runs in the same executable and
    changes the result (so a switch that picked the wrong branch would fail the comparison)."""
    model, x, ctx = wan
    sampler, _, compiled, args = loop
    ref_loop = make_sampler(model, DynamicSchedule(RULES, TABLE), mode="unroll", options=REF)
    ref = ref_loop.lower(x, ctx).compile(FAST)(*args)
    assert ref_loop.traced_forwards == len(TABLE)
    out = compiled(*args)
    np.testing.assert_allclose(out, ref, **TOL)
    assert float(jnp.max(jnp.abs(out - x))) > 0.1             # the loop moved the latent
    swapped = TABLE.copy()
    swapped[1] = [2, 1]                                          # VSA <-> SVG2 at step 1
    moved = compiled(*args[:5], sampler.table_array(swapped))
    assert float(jnp.max(jnp.abs(moved - ref))) > 1e-3
    dense = make_sampler(model, MaskSchedule.dense(2, len(TABLE))).lower(x, ctx).compile(FAST)(
        *args[:5])
    all_dense = compiled(*args[:5], sampler.table_array(np.zeros_like(TABLE)))
    np.testing.assert_allclose(all_dense, dense, **TOL)
    assert sampler.trace_count == 1


def test_dynamic_attention_picks_by_the_traced_step():
    """One jitted layer, the step an argument: each step's output is dense attention or the
    rule's, as the table says (with a mask sparse enough to tell them apart)."""
    rule = dm.VSA(block=8, topk=1)
    sched = DynamicSchedule((rule,), np.array([[0], [1], [0], [1]]))
    q, k, v = (_normal(s, (1, 32, 2, 16)) for s in (3, 4, 5))
    traces = []

    def layer(step):
        traces.append(1)
        return dynamic_attention(q, k, v, sched, layer=0, step=step, state=((),))[0]

    def both():
        return jax.nn.dot_product_attention(q, k, v), masked_dense(q, k, v, rule.mask(q, k))

    compiled = jax.jit(layer).lower(jnp.int32(0)).compile(FAST)
    dense, sparse = jax.jit(both).lower().compile(FAST)()
    assert float(jnp.max(jnp.abs(dense - sparse))) > 1e-2
    for s, want in enumerate((dense, sparse, dense, sparse)):
        np.testing.assert_allclose(compiled(jnp.int32(s)), want, **TOL)
    assert len(traces) == 1


def test_svg2_rule_carries_its_centroids():
    """The SVG2 rule initialises its centroids once (``ready``) and then warm-starts from the
    carry: two calls equal svg2_init, then svg2_mask twice from the carried centroids."""
    rule = dm.SVG2(q_clusters=4, kv_clusters=5, init_iters=3, iters=1, top_p=0.5)
    q1, k1, v1, q2, k2, v2 = (_normal(s, (1, 40, 2, 8)) for s in range(10, 16))
    st0 = rule.init_state(q1.shape, k1.shape, q1.dtype)

    def two_steps(q1, k1, v1, q2, k2, v2, st0):
        out1, st1 = rule(q1, k1, v1, st0, attend=masked_dense)
        out2, st2 = rule(q2, k2, v2, st1, attend=masked_dense)
        init = dm.svg2_init(q1, k1, jax.random.key(rule.seed), rule)
        lay1 = dm.svg2_mask(q1, k1, init, rule)
        lay2 = dm.svg2_mask(q2, k2, lay1.state, rule)
        want2 = dm.unpermute(masked_dense(dm.permute(q2, lay2.q_perm),
                                          dm.permute(k2, lay2.kv_perm),
                                          dm.permute(v2, lay2.kv_perm), lay2.mask), lay2.q_perm)
        return st1.ready, st2, out2, want2, lay2.state

    args = (q1, k1, v1, q2, k2, v2, st0)
    ready, st2, out2, want2, want_state = jax.jit(two_steps).lower(*args).compile(FAST)(*args)
    assert bool(ready) and not bool(st0.ready)
    np.testing.assert_allclose(out2, want2, **TOL)
    np.testing.assert_allclose(st2.centroids.kv_centroids, want_state.kv_centroids, **TOL)
    np.testing.assert_allclose(st2.centroids.q_centroids, want_state.q_centroids, **TOL)


def test_schedule_errors_and_the_old_api():
    with pytest.raises(ValueError, match=r"table entries must be in \[0, 2\]"):
        DynamicSchedule(RULES, [[3]])
    with pytest.raises(TypeError, match="dynamic mask rule"):
        DynamicSchedule([lambda q: q], [[1]])
    with pytest.raises(ValueError, match="dense_steps"):
        DynamicSchedule.warmup(RULES[0], 2, 3, dense_steps=4)
    sched = DynamicSchedule.warmup(RULES[0], 2, 3, dense_steps=1, dense_layers=[1])
    assert sched.table.tolist() == [[0, 0], [1, 0], [1, 0]]
    assert sched == DynamicSchedule.warmup(RULES[0], 2, 3, dense_steps=1, dense_layers=[1])
    with pytest.raises(ValueError, match="shape"):
        sched.check_table(np.zeros((2, 2), int))
    with pytest.raises(ValueError, match="needs step"):
        LayerAttention(sched, 0, None, ((),))
    with pytest.raises(TypeError, match="step must be an int"):
        LayerAttention(sched, 0, jnp.float32(1.0), ((),))
    with pytest.raises(TypeError, match="DynamicSchedule runs through LayerAttention"):
        SparseSelfAttention(2, 32, mask=sched, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="use a DynamicSchedule"):
        with at_step(jnp.int32(1)):
            pass
    model = tiny_wan()
    with pytest.raises(ValueError, match="mode 'auto' or 'unroll'"):
        make_sampler(model, sched, mode="phases")
    with pytest.raises(ValueError, match="unroll"):
        make_sampler(model, sched, mode="unroll")(jnp.zeros((1, 3, 8, 8, 4)),
                                                  jnp.zeros((1, 8, 32)), table=sched.table)


def test_bench_loop_dynamic_summary_and_peers_estimate():
    """The summary keys over dynamic cases and the scaling of the peers' per-call times."""
    case = bench_loop.DYN_CASES["wan13b_480p_vsa"]
    rows = {"rows": [{"family": "vsa", "Lq": 1000, "Hq": 8, "density": 0.1, "id": "a",
                      "peers": {"flashinfer_var": {"status": "ok", "request_ms": 2.0},
                                "flex": {"status": "ok", "request_ms": 3.0}}},
                     {"family": "vsa", "Lq": 4000, "Hq": 8, "density": 0.2, "id": "b",
                      "peers": {"flex": {"status": "ok", "request_ms": 5.0}}}]}
    per = bench_loop.peers_per_call(rows, case, 2000, 16, 0.2)
    assert per["flashinfer"]["ms"] == pytest.approx(2.0 * 2 * 4 * 2)   # heads, length^2, density
    assert per["flex"]["row_id"] in ("a", "b")
    assert bench_loop.peers_per_call({"loop_cases": {case.name: {"flex": 7.0}}}, case, 1, 1,
                                     1.0) == {"flex": {"ms": 7.0, "source": "loop_cases"}}

    def dyn(model, dense, ours, host, est, ops=0):
        return {"kind": "dynamic", "model": model, "layers_run": 2, "layers_total": 4,
                "steps": 25, "dense_steps": 6, "per_call": {"density": 0.1},
                "speedup_vs_host_planning": host / ours,
                "peers_estimate": {"speedup_vs_peers_estimate": est / ours},
                "loops": {"dense": {"loop_s": dense},
                          "dynamic": {"loop_s": ours, "speedup_vs_dense": dense / ours,
                                      "trace_count": 1, "host_transfer_ops": ops,
                                      "transfer_guard_ok": True}}}

    s = bench_loop.summarize({"wan13b_480p_vsa": dyn("wan", 2.0, 1.0, 3.0, 1.5),
                              "hunyuan15_720p_sparge": dyn("hunyuan", 4.0, 1.0, 1.4, 1.3)})
    assert s["host_transfers_in_loop"] == 0 and s["compiles_per_loop"] == 1
    assert s["wan13b_480p_dynamic_speedup_vs_dense"] == 2.0
    assert s["hunyuan720_dynamic_speedup_vs_dense"] == 4.0
    assert s["speedup_vs_host_planning_min"] == pytest.approx(1.4)
    assert s["speedup_vs_peers_estimate_min"] == pytest.approx(1.3)
    assert "ESTIMATE" in s["dynamic_notes"]
