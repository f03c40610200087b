"""Video DiTs (Wan2.1, HunyuanVideo-1.5; tiny configs), the compiled Euler loop and
benchmarks/bench_loop.py --tiny."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.nnx as nnx

import tessera_jax as tj
from tessera_jax.flax import AttentionOptions, MaskSchedule
from tessera_jax.models import (HUNYUAN15, WAN21_14B, WAN21_1_3B, HunyuanModel, WanModel,
                                extend_with_text, flow_sigmas, make_forward, make_sampler,
                                patchify, rope_3d, unpatchify)
from tessera_jax.models.common import apply_rope, device_init, numpy_init

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loop  # noqa: E402  (benchmarks/ is not a package)

TOL = dict(atol=1e-4, rtol=1e-4)

WAN_TINY = WAN21_1_3B.replace(num_layers=2, num_heads=2, head_dim=16, ffn_dim=64, text_dim=32,
                              text_len=8, in_channels=4, out_channels=4, freq_dim=32)
HY_TINY = HUNYUAN15.replace(num_layers=2, num_heads=2, head_dim=16, mlp_dim=64, text_dim=32,
                            text_len=8, in_channels=4, out_channels=4, freq_dim=32,
                            rope_dims=(4, 6, 6))


def _rand(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.fixture(scope="module")
def wan():
    # latent (3, 8, 8, 4), patch (1, 2, 2) -> token grid (3, 4, 4) = 48 video tokens
    return WanModel(WAN_TINY, rngs=nnx.Rngs(0)), _rand(1, (1, 3, 8, 8, 4)), _rand(2, (1, 8, 32))


@pytest.fixture(scope="module")
def hunyuan():
    # latent (3, 4, 4, 4), patch 1 -> 48 video tokens + 8 joint text tokens
    return HunyuanModel(HY_TINY, rngs=nnx.Rngs(0)), _rand(3, (1, 3, 4, 4, 4)), _rand(4, (1, 8, 32))


def _full(L, bounds):
    n = len(bounds) - 1
    return tj.BlockMask(bounds, bounds, np.ones((2, n, n), bool))   # per-head, all selected


def _window(L, block, widths):
    n = -(-L // block)
    i = np.arange(n)
    w = np.asarray(widths)
    return tj.BlockMask.uniform(L, L, block, block,
                                np.abs(i[None, :, None] - i[None, None, :]) <= w[:, None, None])


def _ref_fn(q, k, v, mask, scale=None):
    return tj.reference_attention(q, k, v, mask, scale=scale)


REF = AttentionOptions(sparse_fn=_ref_fn)


# --- pieces -----------------------------------------------------------------------------------
def test_configs_match_published_shapes():
    assert (WAN21_1_3B.num_layers, WAN21_1_3B.num_heads, WAN21_1_3B.dim, WAN21_1_3B.ffn_dim) == (30, 12, 1536, 8960)
    assert (WAN21_14B.num_layers, WAN21_14B.num_heads, WAN21_14B.dim, WAN21_14B.ffn_dim) == (40, 40, 5120, 13824)
    assert (HUNYUAN15.num_layers, HUNYUAN15.num_heads, HUNYUAN15.dim, HUNYUAN15.mlp_dim) == (54, 16, 2048, 8192)
    assert WAN21_1_3B.token_grid(81, 480, 832) == (21, 30, 52)
    assert WAN21_14B.token_grid(81, 720, 1280) == (21, 45, 80)
    assert HUNYUAN15.token_grid(121, 720, 1280) == (31, 45, 80)
    with pytest.raises(ValueError, match="rope_dims"):
        HUNYUAN15.replace(rope_dims=(16, 56, 54))


def test_device_init_draws_like_numpy_init():
    """bench_loop's GPU init: the leaves numpy_init makes (paths, shapes, dtypes), drawn on the
    device with the same scales: matrices N(0, 1/fan_in), vectors 0.1 N(0, 1) (+1 for norm
    scales), and a different seed gives different weights."""
    from tessera_jax.tools.finetune import tiny_config
    cfg = tiny_config(layers=1, heads=2, head_dim=16)
    got = jax.tree_util.tree_leaves_with_path(nnx.state(device_init(WanModel, cfg, 0)))
    want = jax.tree_util.tree_leaves_with_path(nnx.state(numpy_init(WanModel, cfg, 0)))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (p, x), (_, y) in zip(got, want):
        assert (x.shape, x.dtype) == (y.shape, y.dtype), p
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.size >= 512:
            assert abs(x.std() / y.std() - 1) < 0.15, p
            assert abs(x.mean() - y.mean()) < 0.1 * y.std() + 1e-3, p
    other = jax.tree_util.tree_leaves(nnx.state(device_init(WanModel, cfg, 1)))
    assert not np.array_equal(np.asarray(other[-1]), np.asarray(got[-1][1]))


def test_patchify_roundtrip_and_rope():
    x = _rand(0, (2, 4, 6, 8, 3))
    tok, grid = patchify(x, (2, 3, 2))
    assert tok.shape == (2, 2 * 2 * 4, 36) and grid == (2, 2, 4)
    np.testing.assert_array_equal(unpatchify(tok, grid, (2, 3, 2), 3), x)
    with pytest.raises(ValueError, match="patch"):
        patchify(x, (3, 3, 2))
    # RoPE: a rotation (norm kept) whose q.k depends only on the position difference.
    @jax.jit
    def rope_checks(q, k):
        cos, sin = rope_3d((3, 4, 5), (4, 6, 6))
        q, k = (jnp.broadcast_to(a, (1, 60, 1, 16)) for a in (q, k))
        rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        idx = lambda t, h, w: (t * 4 + h) * 5 + w
        return (jnp.linalg.norm(rq, axis=-1) - jnp.linalg.norm(q, axis=-1),
                jnp.vdot(rq[0, idx(0, 1, 1), 0], rk[0, idx(1, 2, 3), 0]),
                jnp.vdot(rq[0, idx(1, 2, 2), 0], rk[0, idx(2, 3, 4), 0]),
                jnp.vdot(rq[0, idx(1, 2, 2), 0], rk[0, idx(2, 3, 3), 0]))

    dnorm, a, b, c = rope_checks(_rand(1, (16,)), _rand(2, (16,)))
    np.testing.assert_allclose(dnorm, 0.0, atol=1e-5)
    np.testing.assert_allclose(a, b, rtol=1e-4)
    assert abs(float(a - c)) > 1e-3        # a different offset gives a different score


def test_extend_with_text():
    m = _window(48, 16, [0, 1])
    j = extend_with_text(m, 8)
    tok = j.token_mask()
    assert j.Lq == 56 and tok[:, :48, :48].tolist() == m.token_mask().tolist()
    assert tok[:, 48:].all() and tok[:, :, 48:].all()
    assert extend_with_text(None, 8) is None


def test_flow_sigmas():
    s = flow_sigmas(50, 5.0)
    assert s.shape == (51,) and s[0] == 1.0 and s[-1] == 0.0 and np.all(np.diff(s) < 0)
    np.testing.assert_allclose(flow_sigmas(4, 1.0), [1, .75, .5, .25, 0])
    with pytest.raises(ValueError, match="num_steps"):
        flow_sigmas(0)


# --- the loop: all-selected masks match dense attention ---------------------------------------
def test_wan_loop_all_selected_matches_dense(wan):
    model, x, ctx = wan
    full = _full(48, [0, 5, 16, 40, 48])
    dense = make_sampler(model, MaskSchedule.dense(2, 2))(x, ctx)
    sparse = make_sampler(model, MaskSchedule.warmup(full, 2, 2, dense_steps=1))
    out = sparse(x, ctx)
    assert sparse.traced_forwards == 2          # one forward per variant (dense, sparse)
    np.testing.assert_allclose(out, dense, **TOL)
    assert float(jnp.max(jnp.abs(out - x))) > 0.1   # the loop moved the latent


def test_hunyuan_loop_all_selected_matches_dense(hunyuan):
    model, x, ctx = hunyuan
    video_only = _full(48, [0, 16, 32, 48])          # layer 0: text appended as dense blocks
    joint = _full(56, [0, 20, 48, 56])               # layer 1: over [video, text]
    dense = make_sampler(model, MaskSchedule.dense(2, 2))(x, ctx)
    out = make_sampler(model, MaskSchedule([[video_only, joint]] * 2))(x, ctx)
    np.testing.assert_allclose(out, dense, **TOL)


def test_forward_sparse_mask_uses_the_mask(wan):
    """A real mask through sparse_attention matches the same model with reference attention,
    and differs from dense."""
    model, x, ctx = wan
    masks = (_window(48, 8, [0, 1]), _window(48, 16, [1, 0]))
    t = jnp.full((1,), 700.0)
    state = nnx.state(model)
    out = make_forward(model, masks)(state, x, t, ctx)
    ref = make_forward(model, masks, options=REF)(state, x, t, ctx)
    dense = make_forward(model, None)(state, x, t, ctx)
    np.testing.assert_allclose(out, ref, **TOL)
    assert float(jnp.max(jnp.abs(out - dense))) > 1e-3


def test_masks_from_tessera_jax_masks_in_their_token_order(wan):
    """Sliding-tile masks (tile-major order) drive the model through token_order: a window that
    covers every tile is dense attention exactly; a per-head window mix matches the reference."""
    from tessera_jax.masks import Grid, sta
    from tessera_jax.masks.grids import tile_layout
    model, x, ctx = wan
    grid = Grid("wan_tiny", 3, 4, 4, 2, 0, 8, "wan")              # the tiny model's token grid
    order = tile_layout(grid, (1, 2, 2)).order
    everything = sta(grid, tile=(1, 2, 2), window=(3, 2, 2))
    mix = sta(grid, tile=(1, 2, 2), window="mix", seed=3)
    assert everything.density == 1.0 and mix.density < 1.0 and mix.num_heads == 2
    t, state = jnp.full((1,), 600.0), nnx.state(model)
    dense = make_forward(model)(state, x, t, ctx)
    full = make_forward(model, (everything, everything), token_order=order)(state, x, t, ctx)
    np.testing.assert_allclose(full, dense, **TOL)
    sparse = make_forward(model, (mix, everything), token_order=order)(state, x, t, ctx)
    ref = make_forward(model, (mix, everything), token_order=order, options=REF)(state, x, t, ctx)
    np.testing.assert_allclose(sparse, ref, **TOL)
    assert float(jnp.max(jnp.abs(sparse - dense))) > 1e-3


def test_loop_modes_agree_and_do_not_retrace(wan):
    model, x, ctx = wan
    m = _window(48, 8, [1, 2])
    sched = MaskSchedule.from_fn(lambda l, s: None if s == 1 else m, 2, 3)   # sparse, dense, sparse
    auto = make_sampler(model, sched, options=REF)                           # -> switch
    unrolled = make_sampler(model, sched, mode="unroll", options=REF)
    a = auto(x, ctx)
    assert auto.traced_forwards == 2                      # 2 variants, 3 steps
    np.testing.assert_allclose(a, unrolled(x, ctx), **TOL)
    assert unrolled.traced_forwards == 3
    b = auto(x + 0.5, ctx)
    assert auto.trace_count == 1 and not np.allclose(a, b)
    with pytest.raises(ValueError, match="layers"):
        make_sampler(model, MaskSchedule.dense(3, 2))
    with pytest.raises(ValueError, match="mode"):
        make_sampler(model, sched, mode="scan")


def test_token_order_is_exact_and_guidance(wan):
    model, x, ctx = wan
    order = np.random.default_rng(0).permutation(48)
    t = jnp.full((1,), 1000.0)
    state = nnx.state(model)
    plain = make_forward(model)(state, x, t, ctx)
    permuted = make_forward(model, token_order=order)(state, x, t, ctx)
    np.testing.assert_allclose(permuted, plain, **TOL)
    with pytest.raises(ValueError, match="token_order"):
        make_forward(model, token_order=np.zeros(48, int))(state, x, t, ctx)
    # One Euler step with guidance 1 is the conditional step x + (sigma_1 - 1) * v.
    neg = _rand(9, ctx.shape)
    cfg = make_sampler(model, MaskSchedule.dense(2, 1), shift=3.0, guidance_scale=1.0)(x, ctx, neg)
    np.testing.assert_allclose(cfg, x + (flow_sigmas(1, 3.0)[1] - 1.0) * plain, **TOL)
    with pytest.raises(ValueError, match="negative_context"):
        make_sampler(model, MaskSchedule.dense(2, 1), guidance_scale=5.0)(x, ctx)


def test_model_input_checks(wan, hunyuan):
    model, x, ctx = wan
    with pytest.raises(ValueError, match="masks has 1"):
        model(x, jnp.ones(1), ctx, masks=[None])
    with pytest.raises(ValueError, match="context"):
        model(x, jnp.ones(1), ctx[..., :16])
    hmodel, hx, hctx = hunyuan
    with pytest.raises(ValueError, match="joint sequence"):
        hmodel(hx, jnp.ones(1), hctx, masks=[_window(40, 8, [0, 0])] * 2)
    with pytest.raises(ValueError, match="cond"):
        hmodel(hx, jnp.ones(1), hctx, cond=hx)


def test_hunyuan_i2v_cond_channels_enter_the_input(hunyuan):
    _, x, ctx = hunyuan
    model = HunyuanModel(HY_TINY.replace(num_layers=1, cond_channels=5), rngs=nnx.Rngs(1))
    f = make_forward(model, (_full(48, [0, 24, 48]),))
    state, t = nnx.state(model), jnp.full((1,), 900.0)
    cond = _rand(5, x.shape[:-1] + (5,))
    a, b = f(state, x, t, ctx, cond), f(state, x, t, ctx, cond + 1.0)
    assert a.shape == x.shape and bool(jnp.all(jnp.isfinite(a))) and not np.allclose(a, b)
    with pytest.raises(ValueError, match="cond must be"):
        f(state, x, t, ctx)


# --- the benchmark's CPU mode ---------------------------------------------------------------
def test_bench_loop_tiny(tmp_path):
    assert bench_loop.parse_args(["--tiny"]).out is None      # no --out: nothing written
    out = tmp_path / "loop.json"
    doc = bench_loop.main(["--tiny", "--models", "wan14b_720p", "--steps", "2",
                           "--attn-repeats", "1", "--step-repeats", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    s = saved["summary"]
    for key in ("speedup_vs_fixed_plan", "overhead_outside_attention"):
        assert np.isfinite(s[key])
    assert s["wan13b_480p_speedup_vs_dense"] is None      # that case did not run
    case = saved["cases"]["wan14b_720p"]
    assert case["extrapolated"] and case["layers_run"] < case["layers_total"]
    assert all(case["loops"][v]["finite"] for v in ("dense", "tessera", "fixed"))
    assert case["environment"]["tiny"] and doc["summary"] == s
    # Two processes' files (one per GPU) merge into one, the summary over both cases.
    other = json.loads(out.read_text())
    other["cases"] = {"wan13b_480p": dict(case, speedup_vs_fixed_plan=4.0)}
    other["errors"] = {"wan14b_720p": {"error": "stale"}, "hunyuan15_720p": {"error": "cut"}}
    (tmp_path / "b.json").write_text(json.dumps(other))
    merged = bench_loop.main(["--merge", str(out), str(tmp_path / "b.json"),
                              "--out", str(tmp_path / "m.json")])
    assert set(merged["cases"]) == {"wan14b_720p", "wan13b_480p"}
    assert list(merged["errors"]) == ["hunyuan15_720p"] and len(merged["runs"]) == 2
    assert merged["summary"]["speedup_vs_fixed_plan"] == pytest.approx(
        (4.0 * case["speedup_vs_fixed_plan"]) ** 0.5)
    assert json.loads((tmp_path / "m.json").read_text())["summary"] == merged["summary"]


def test_bench_loop_tiny_dynamic(tmp_path):
    """The dynamic cases (VSA, SVG2, SpargeAttn-like) at tiny sizes: every loop runs, the
    dynamic loop under a transfer guard with no host-transfer site and one trace, the
    host-planning baseline through its callback (one site), the issue's summary keys."""
    out = tmp_path / "dyn.json"
    # "dynamic" names every dynamic case; the run takes the three above (each case compiles
    # its four model loops; XAttention's mask in a compiled program: test_dynamic_masks).
    names = ["wan13b_480p_vsa", "wan14b_720p_svg2", "hunyuan15_720p_sparge"]
    assert [c.name for c in bench_loop.parse_args(["--tiny", "--models", "dynamic"]).cases] \
        == list(bench_loop.DYN_CASES) and set(names) < set(bench_loop.DYN_CASES)
    doc = bench_loop.main(["--tiny", "--models", ",".join(names), "--steps", "2",
                           "--attn-repeats", "1", "--out", str(out)])
    assert sorted(doc["cases"]) == sorted(names)
    s = json.loads(out.read_text())["summary"]
    assert s["host_transfers_in_loop"] == 0 and s["compiles_per_loop"] == 1
    for key in ("wan13b_480p_dynamic_speedup_vs_dense", "hunyuan720_dynamic_speedup_vs_dense",
                "speedup_vs_host_planning_min", "speedup_vs_peers_estimate_min"):
        assert np.isfinite(s[key]), key
    for name, c in doc["cases"].items():
        loops = c["loops"]
        assert all(loops[v]["finite"] for v in ("dense", "dynamic", "null", "host")), name
        assert loops["dynamic"]["transfer_guard_ok"] and loops["host"]["host_transfer_ops"] >= 1
        assert loops["host"]["host_callback"]["overflows"] == 0
        assert loops["host"]["host_callback"]["calls_per_loop"] == c["sparse_calls"]
        # Same masks, same plan format: the host-planned loop matches ours.
        assert abs(loops["host"]["max_abs_diff_vs_dense_loop"]
                   - loops["dynamic"]["max_abs_diff_vs_dense_loop"]) < 1e-4
        assert "ESTIMATE" in c["peers_estimate"]["label"] and 0 < c["per_call"]["density"] < 1
    assert doc["cases"]["wan14b_720p_svg2"]["extrapolated"]
    # --merge --peers-json re-estimates the peers' loops from another peers file; the measured
    # loops stay as they were.
    saved = json.loads(out.read_text())
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps({"loop_cases": {n: {"flashinfer": 50.0, "flex": 60.0}
                                                for n in saved["cases"]}}))
    merged = bench_loop.main(["--merge", str(out), "--peers-json", str(peers),
                              "--out", str(tmp_path / "m.json")])
    for name, c in merged["cases"].items():
        est, pc = c["peers_estimate"], c["per_call"]
        assert est["peers_json"] == str(peers) and est["best_peer"] == "flashinfer"
        assert est["best_loop_s"] == pytest.approx(
            c["loops"]["null"]["loop_s"] + c["dense_calls"] * pc["dense_attention_s"]
            + c["sparse_calls"] * (pc["build_s"] + 0.050))
        assert c["loops"] == saved["cases"][name]["loops"]
    assert merged["summary"]["speedup_vs_peers_estimate_by_case"] == {
        n: c["peers_estimate"]["speedup_vs_peers_estimate"] for n, c in merged["cases"].items()}
    with pytest.raises(SystemExit):
        bench_loop.main(["--merge", str(out), "--peers-json", "--out", str(tmp_path / "x.json")])


def test_bench_loop_scaling_check(tmp_path):
    """--merge --scaling-check: a layer subset's and a full-depth run's loops of one case, each
    scaled to the whole model, their speed-ups and full / subset; runs that are not a subset
    and a full depth, or whose steps differ, are refused."""
    def doc(layers, dense, dynamic, steps=2):
        case = dict(kind="dynamic", layers_run=layers, layers_total=54, steps=steps,
                    loops={"dense": {"loop_full_model_s": dense},
                           "dynamic": {"loop_full_model_s": dynamic}})
        return {"cases": {"c": case}, "environment": dict(commit="abc", device="GPU",
                                                          command=f"run {layers}")}

    paths = {}
    for name, d in (("sub", doc(2, 24.0, 5.0)), ("full", doc(54, 21.0, 6.0)),
                    ("sub3", doc(2, 24.0, 5.0, steps=3)), ("base", {"cases": {}, "runs": []})):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(d))
    merged = bench_loop.main(["--merge", str(paths["base"]), "--scaling-check",
                              str(paths["sub"]), str(paths["full"]),
                              "--out", str(tmp_path / "m.json")])
    chk = merged["layer_scaling_check"]["c"]
    assert chk["subset"]["speedup_vs_dense"] == pytest.approx(4.8)
    assert chk["full"]["speedup_vs_dense"] == pytest.approx(3.5)
    assert chk["full_over_subset_speedup"] == pytest.approx(3.5 / 4.8)
    assert chk["full_over_subset_loop_s"] == pytest.approx({"dense": 21 / 24, "dynamic": 1.2})
    assert merged["summary"]["dynamic_speedup_vs_dense_full_depth_by_case"] == {
        "c": pytest.approx(3.5)}
    for a, b in (("full", "sub"), ("sub3", "full")):
        with pytest.raises(ValueError, match="layer subset|steps differ"):
            bench_loop.main(["--merge", str(paths["base"]), "--scaling-check", str(paths[a]),
                             str(paths[b]), "--out", str(tmp_path / "x.json")])


def test_host_planned_baseline_matches_the_reference():
    """bench_loop's plan-on-host baseline (pure_callback -> tj.plan -> the kernel on that plan)
    on device masks: static bounds, per-head traced bounds (planned a head at a time, GQA),
    shared traced bounds; each equals the reference attention of the same mask."""
    from bench_loop import HOST_STATS, HostPlanned, _reset_host_stats
    rng = np.random.default_rng(0)
    q, k, v = _rand(20, (1, 96, 4, 16)), _rand(21, (1, 96, 2, 16)), _rand(22, (1, 96, 2, 16))
    static_b = np.array([0, 16, 40, 64, 96])
    per_head = np.stack([np.sort(np.r_[0, rng.choice(np.arange(1, 96), 5, replace=False), 96])
                         for _ in range(4)])
    blocks = [rng.random((4, 4, 4)) < 0.5, rng.random((4, 6, 6)) < 0.4, rng.random((1, 4, 4)) < 0.5]
    host = HostPlanned(backend="xla")

    @jax.jit
    def run(q, k, v, b0, b1, b2, hb, sb):
        masks = (tj.BlockMask(static_b, static_b, b0), tj.BlockMask(hb, hb, b1),
                 tj.BlockMask(sb, sb, b2))
        return [host(q, k, v, m) for m in masks], masks

    _reset_host_stats()
    outs, masks = run(q, k, v, *(jnp.asarray(b) for b in blocks), jnp.asarray(per_head),
                      jnp.asarray(static_b))
    assert HOST_STATS["calls"] == 3 and HOST_STATS["overflows"] == 0
    for out, m in zip(outs, masks):
        np.testing.assert_allclose(out, tj.reference_attention(q, k, v, m.to_host()), **TOL)


def test_loop_through_the_kernel_backend_runner_compiles_ahead_of_time(wan, monkeypatch):
    """The jitted loop, lowered and compiled ahead of time, through the GPU backends' runner
    (``kernel_runner``) after a jitted attention-only call of the same mask, as bench_loop
    does. The "triton" entry of the backend table runs here (a GPU's compute capability
    stands in), its forward a stand-in computing with the XLA executor. Regression: the runner
    once cached the plan's device arrays and handed them to later traces, and the AOT loop
    failed with "Computation compiled for N inputs but called with M" (H200, session 2)."""
    from pallas_kernels import templates
    from pallas_kernels.triton import ops as triton_ops

    from tessera_jax.runtime import dispatch
    from pallas_kernels.xla import ops as xla_ops
    from tessera_jax.flax import attention

    from contract_calls import xla_template

    seen = []

    def fake_forward(q, k, v, plan, *, template, scale, return_lse=False, interpret=None,
                     check_plan=True):
        seen.append(type(plan.units).__name__)
        return xla_ops.forward(q, k, v, plan, template=xla_template(plan.tile_q, plan.tile_kv),
                               scale=scale, return_lse=return_lse, check_plan=check_plan)

    monkeypatch.setattr(dispatch, "_gpu_capability", lambda: (9, 0))
    monkeypatch.setattr(triton_ops, "forward", fake_forward)
    t = templates.Template("fake_triton_16x16", "triton", 16, 16, stages=1, head_dims=(),
                           dtypes=("float32",))
    monkeypatch.setitem(templates._REGISTRY, t.name, t)
    model, x, ctx = wan
    blocks = np.random.default_rng(0).random((2, 3, 3)) < 0.6
    blocks[:, :, 0] = True
    m = tj.BlockMask(np.array([0, 16, 32, 48]), np.array([0, 16, 32, 48]), blocks)
    opts = AttentionOptions(backend="triton", template=t.name, policy="merge")
    q = _rand(5, (1, 48, 2, 16))
    jax.block_until_ready(jax.jit(lambda q: attention(q, q, q, m, options=opts))(q))
    sampler = make_sampler(model, MaskSchedule.warmup(m, 2, 3, dense_steps=1), options=opts)
    compiled = sampler.lower(x, ctx).compile()
    out = compiled(nnx.state(model), x, ctx, None, None)
    ref = make_sampler(model, MaskSchedule.warmup(m, 2, 3, dense_steps=1), options=REF)(x, ctx)
    np.testing.assert_allclose(out, ref, **TOL)
    assert seen and set(seen) == {"ndarray"}       # traces get the plan as NumPy constants
    # Eager calls after those traces: the first hands the small plan's NumPy arrays to the
    # jitted call, the second copies the plan to the device once (nothing leaked from the
    # traces); both match the traced result.
    eager = attention(q, q, q, m, options=opts)
    eager2 = attention(q, q, q, m, options=opts)
    traced = jax.jit(lambda q: attention(q, q, q, m, options=opts))(q)
    np.testing.assert_allclose(eager, traced, **TOL)
    np.testing.assert_allclose(eager2, traced, **TOL)
    assert seen[-3:] == ["ndarray", "ArrayImpl", "ndarray"]
