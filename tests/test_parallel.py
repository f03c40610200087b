"""Several devices (tessera_jax.parallel): head-parallel and Ulysses sparse attention equal the
one-device call, and cost balancing cuts the imbalance of skewed heads.

The multi-device tests need 8 devices. jax fixes the CPU device count when it starts, so when
this process has fewer (the usual case: other test modules share it), those tests run once, all
together, in a child pytest of this file started with
``--xla_force_host_platform_device_count=8`` (one child per session, shared by pytest-xdist's
workers), and each test here reports its own outcome there.
Nothing in this process changes.
"""

import functools
import inspect
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tessera_jax as tj
from tessera_jax import parallel as tp

N_DEV = 8
TOL = dict(atol=1e-5, rtol=1e-5)


# --- running the multi-device tests where there are 8 devices --------------------------------
@functools.cache
def _child_outcomes() -> dict:
    """{test name: (outcome, text)} of this file's tests, run in a child with 8 CPU devices."""
    import tempfile
    # conftest's XLA flags (LLVM's cheap passes among them), plus the device count.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ["XLA_FLAGS"]
                          + f" --xla_force_host_platform_device_count={N_DEV}"))
    with tempfile.TemporaryDirectory() as d:
        xml = os.path.join(d, "report.xml")
        proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p",
                               "no:cacheprovider", f"--junitxml={xml}",
                               "-k", " or ".join(_ON_DEVICES)],
                              env=env, capture_output=True, text=True, timeout=600)
        if not os.path.exists(xml):
            raise RuntimeError(f"the {N_DEV}-device child pytest wrote no report:\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        out = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
            out[case.get("name")] = ((bad[0].tag, (bad[0].get("message") or "") + "\n"
                                      + (bad[0].text or "")) if bad else ("passed", ""))
        return out


def _shared_child_outcomes(request) -> dict:
    """``_child_outcomes`` once per test session: under pytest-xdist the workers share it
    through a file next to their temporary directories (the first worker to get here runs
    the child under a lock, the others read its outcomes), instead of a child per worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _child_outcomes()
    import fcntl
    import json
    root = request.getfixturevalue("tmp_path_factory").getbasetemp().parent   # shared by workers
    path = root / f"parallel_child_{N_DEV}.json"
    with open(root / f"parallel_child_{N_DEV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        out = _child_outcomes()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        tmp.replace(path)
        return out


_ON_DEVICES: list = []


def on_devices(fn):
    """Runs the test here when this process has N_DEV devices, else reports its outcome in the
    N_DEV-device child (``_child_outcomes``)."""
    sig = inspect.signature(fn)
    _ON_DEVICES.append(fn.__name__)

    @functools.wraps(fn)
    def wrapper(request, **kw):
        if jax.device_count() >= N_DEV:
            return fn(**kw)
        outcome, text = _shared_child_outcomes(request).get(request.node.name,
                                                             ("missing", "not in report"))
        if outcome == "skipped":
            pytest.skip(text)
        if outcome != "passed":
            pytest.fail(f"[{N_DEV}-device child] {outcome}: {text}", pytrace=False)

    del wrapper.__wrapped__                      # pytest reads the signature below
    wrapper.__signature__ = sig.replace(parameters=[
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *sig.parameters.values()])
    return wrapper


# --- inputs ------------------------------------------------------------------------------------
def _mesh(n=N_DEV, name="x", explicit=True):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh((n,), (name,), axis_types=(kind,), devices=jax.devices()[:n])


def _qkv(L, Hq, Hkv, D=16, B=1, seed=0):
    rng = np.random.default_rng(seed)         # NumPy: no compile per shape
    return tuple(jnp.asarray(rng.standard_normal((B, L, h, D)).astype(np.float32))
                 for h in (Hq, Hkv, Hkv))


def _skewed(L, H, block=32, seed=0):
    """Per-head mask of very unequal density: a full head, an empty one, the rest 2%-90%,
    densest first (contiguous sharding is unbalanced)."""
    n = -(-L // block)
    dens = np.sort(np.r_[0.0, 1.0, np.geomspace(0.02, 0.9, H - 2)])[::-1]
    blocks = np.random.default_rng(seed).random((H, n, n)) < dens[:, None, None]
    return tj.BlockMask.uniform(L, L, block, block, blocks)


@functools.cache
def _ref_of(L, Hq, Hkv):
    q, k, v = _qkv(L, Hq, Hkv)
    return tj.sparse_attention(q, k, v, _skewed(L, Hq), return_lse=True)


def _ref(L, Hq, Hkv, return_lse=False):
    """The one-device output (the plain call) for ``_qkv(L, Hq, Hkv)`` and ``_skewed(L, Hq)``."""
    out = _ref_of(L, Hq, Hkv)
    return out if return_lse else out[0]


def _close(out, ref):
    if isinstance(ref, tuple):
        np.testing.assert_allclose(out[0], ref[0], **TOL)
        lse, rlse = np.asarray(out[1]), np.asarray(ref[1])
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(rlse))
        np.testing.assert_allclose(np.where(np.isinf(rlse), 0, lse),
                                   np.where(np.isinf(rlse), 0, rlse), **TOL)
    else:
        np.testing.assert_allclose(out, ref, **TOL)


# --- cost balancing (this process) -------------------------------------------------------------
def test_assignment_cuts_the_imbalance_of_skewed_heads():
    mask = _skewed(512, 16, block=64)
    q, k, _ = _qkv(512, 16, 8)
    for kind in ("plan", "tokens"):
        costs = tp.head_costs(mask, q.shape, k.shape, q.dtype, kind=kind)
        assert costs.shape == (16,) and costs[0] > 5 * costs[-2] and costs[-1] == 0
        for n, group in ((2, 1), (4, 2), (8, 1)):
            rep = tp.balance_report(costs, n, group_size=group)
            assert rep.unbalanced > 1.5, (kind, n)
            assert rep.balanced < 0.8 * rep.unbalanced and rep.balanced >= 1.0, (kind, n, rep)
            snake = tp.imbalance(costs, tp.assign_heads(costs, n, group_size=group,
                                                        method="snake"))
            assert rep.balanced <= snake + 1e-9
    # 40 heads (Wan2.1-14B) of lognormal costs on 2 devices: LPT + swaps gets within 1%.
    costs = np.random.default_rng(1).lognormal(0, 1, 40)
    costs[:10] *= 5
    rep = tp.balance_report(costs, 2)
    assert rep.balanced < 1.01 < 1.2 < rep.unbalanced


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=8), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 2]), st.sampled_from(["lpt", "snake", "contiguous"]))
def test_assignment_is_a_grouped_equal_split(per_group, n, group, method):
    G = len(per_group) * n
    costs = np.repeat(np.resize(per_group, G), group) / group
    heads = tp.assign_heads(costs, n, group_size=group, method=method)
    assert heads.shape == (n, G * group // n)
    assert sorted(heads.reshape(-1).tolist()) == list(range(G * group))
    g = heads.reshape(n, -1, group)
    assert (g == g[..., :1] // group * group + np.arange(group)).all()     # whole GQA groups
    assert (np.diff(heads, axis=1) > 0).all()
    load = tp.device_costs(costs, heads)
    np.testing.assert_allclose(load.sum(), costs.sum(), rtol=1e-9)
    if method == "lpt":     # a swap never leaves the most loaded device above LPT's bound
        gc = costs.reshape(-1, group).sum(1)
        assert load.max() <= costs.sum() / n + gc.max() + 1e-6


def test_device_costs_and_assignment_on_device_match_numpy():
    mask = _skewed(256, 8)
    dev = mask.to_device()
    want = tp.head_costs(mask, kind="tokens")
    got = jax.jit(lambda m: tp.head_costs(m))(dev)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for method in ("lpt", "snake"):
        h_np = tp.assign_heads(want, 4, method=method)
        h_jx = jax.jit(lambda c, method=method: tp.assign_heads(c, 4, method=method))(got)
        assert tp.imbalance(want, h_jx) <= tp.imbalance(want, h_np) + 0.2
        if method == "snake":
            np.testing.assert_array_equal(h_jx, h_np)
    with pytest.raises(ValueError, match="evenly"):
        tp.assign_heads(want, 3)
    with pytest.raises(ValueError, match="kind='plan'"):
        tp.head_costs(dev, kind="plan")


# --- several devices ---------------------------------------------------------------------------
@on_devices
def test_head_parallel_static_mask_gqa_equals_one_device():
    mask = _skewed(256, 16)
    q, k, v = _qkv(256, 16, 8)
    mesh = _mesh()
    hs = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "x", None))
    qs, ks, vs = (jax.device_put(np.asarray(x), hs) for x in (q, k, v))
    f = jax.jit(lambda q, k, v: tp.head_parallel_attention(q, k, v, mask, axis_name="x",
                                                           mesh=mesh, return_lse=True))
    out = f(qs, ks, vs)
    assert out[0].sharding.spec == hs.spec                  # stays head-sharded
    _close(out, _ref(256, 16, 8, return_lse=True))
    plans = tp.device_plans(mask, np.arange(16).reshape(N_DEV, 2), (1, 256, 2, 16),
                            (1, 256, 1, 16), np.float32, backend="xla")
    assert plans.units.shape[0] == N_DEV and len({p.template for p in plans.plans}) == 1
    assert plans.costs.max() > 5 * plans.costs.min()       # unequal work per device


@on_devices
def test_head_parallel_device_mask_gqa_equals_one_device():
    mask = _skewed(256, 16)
    q, k, v = _qkv(256, 16, 8)
    mesh = _mesh(explicit=False)
    f = jax.jit(lambda q, k, v, m: tp.head_parallel_attention(q, k, v, m, axis_name="x",
                                                              mesh=mesh))
    _close(f(q, k, v, mask.to_device()), _ref(256, 16, 8))


@on_devices
def test_local_attention_in_a_users_shard_map():
    """The issue's case: shard_map over heads with a per-head static mask."""
    mask = _skewed(256, 16)
    q, k, v = _qkv(256, 16, 16)
    mesh = _mesh(explicit=False)
    hs = jax.sharding.PartitionSpec(None, None, "x", None)

    def plain(q, k, v):
        return tj.sparse_attention(q, k, v, mask)

    def local(q, k, v):
        return tp.local_attention(q, k, v, mask, axis_name="x")

    with pytest.raises(ValueError, match="mask has 16 heads"):
        jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=(hs,) * 3, out_specs=hs))(q, k, v)
    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(hs,) * 3, out_specs=hs))(q, k, v)
    _close(out, _ref(256, 16, 16))


@on_devices
@pytest.mark.parametrize("heads,Hkv,L", [(None, 16, 250), ("lpt", 8, 256)])
def test_ulysses_static_mask_equals_one_device(heads, Hkv, L):
    mask = _skewed(L, 16)
    q, k, v = _qkv(L, 16, Hkv)
    mesh = _mesh()
    seq = jax.sharding.PartitionSpec(None, "x", None, None)
    args = (q, k, v) if L % N_DEV else [
        jax.device_put(np.asarray(x), jax.sharding.NamedSharding(mesh, seq)) for x in (q, k, v)]
    f = jax.jit(lambda q, k, v: tp.ulysses_attention(q, k, v, mask, axis_name="x", mesh=mesh,
                                                     heads=heads, return_lse=True))
    out = f(*args)
    _close(out, _ref(L, 16, Hkv, return_lse=True))
    if L % N_DEV == 0:
        assert out[0].sharding.spec == seq        # stays sequence-sharded


@on_devices
def test_shared_mask_equals_one_device():
    """A mask shared by all heads (Hm = 1): one plan, the same on every device."""
    shared = tj.BlockMask(*(lambda m: (m.q_bounds, m.kv_bounds, m.blocks[3:4]))(_skewed(256, 8)))
    q, k, v = _qkv(256, 16, 8)
    mesh = _mesh(explicit=False)
    f = jax.jit(lambda q, k, v: (
        tp.ulysses_attention(q, k, v, shared, axis_name="x", mesh=mesh, heads="snake"),
        tp.head_parallel_attention(q, k, v, shared, axis_name="x", mesh=mesh)))
    want = jax.jit(lambda q, k, v: tj.sparse_attention(q, k, v, shared))(q, k, v)
    for out in f(q, k, v):
        _close(out, want)


@on_devices
def test_ulysses_device_mask_balanced_on_device_equals_one_device():
    """A device mask with its assignment computed on the device from its own costs (traced
    head permutation inside the all-to-all), GQA."""
    mask = _skewed(256, 16)
    q, k, v = _qkv(256, 16, 8)
    mesh = _mesh(explicit=False)
    f = jax.jit(lambda q, k, v, m: tp.ulysses_attention(q, k, v, m, axis_name="x", mesh=mesh,
                                                        heads="lpt"))
    _close(f(q, k, v, mask.to_device()), _ref(256, 16, 8))


@on_devices
def test_previous_step_costs_drive_the_next_assignment():
    """Costs of masks made per device after the all-to-all, gathered for the next step."""
    mask = _skewed(256, 16)
    mesh = _mesh(explicit=False)
    P = jax.sharding.PartitionSpec
    heads = tp.assign_heads(np.arange(16.0), N_DEV)            # some earlier assignment

    def body(blocks):
        mine = jnp.asarray(heads)[jax.lax.axis_index("x")]
        local = tj.BlockMask(mask.q_bounds, mask.kv_bounds, blocks[mine])
        return tp.gather_head_costs(tp.head_costs(local), "x", heads)

    costs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(),
                                  check_vma=False))(jnp.asarray(mask.blocks))
    np.testing.assert_allclose(costs, tp.head_costs(mask, kind="tokens"), rtol=1e-6)


@on_devices
def test_one_device_mesh_is_the_unsharded_call():
    mask = _skewed(256, 16)
    q, k, v = _qkv(256, 16, 8)
    mesh = _mesh(1)
    f = jax.jit(lambda q, k, v: [fn(q, k, v, mask, axis_name="x", mesh=mesh, return_lse=True)
                                 for fn in (tp.head_parallel_attention, tp.ulysses_attention)])
    for out in f(q, k, v):                    # the plain call's plan and kernel: bit for bit
        for a, b in zip(out, _ref(256, 16, 8, return_lse=True)):
            np.testing.assert_array_equal(a, b)


def test_clear_caches_forgets_the_per_device_plans():
    from tessera_jax.parallel import local
    mask = _skewed(64, 4)
    q, k, v = _qkv(64, 4, 2)
    tp.head_parallel_attention(q, k, v, mask, axis_name="x", mesh=_mesh(1))
    assert local._local_masks.cache_info().currsize > 0
    tj.clear_caches()
    assert local._local_masks.cache_info().currsize == 0
    assert local._device_plans.cache_info().currsize == 0


def _tiny_wan(num_heads):
    """A 1-layer Wan2.1 of random weights, built without compiling an initialiser per weight."""
    import flax.nnx as nnx
    from tessera_jax.models import WAN21_1_3B, WanModel
    cfg = WAN21_1_3B.replace(num_layers=1, num_heads=num_heads, head_dim=16, ffn_dim=64,
                             text_dim=32, text_len=8, in_channels=4, out_channels=4, freq_dim=32)
    graph, state = nnx.split(nnx.eval_shape(lambda: WanModel(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: jnp.asarray((0.2 * rng.standard_normal(s.shape))
                                               .astype(s.dtype)), state)
    return nnx.merge(graph, state)


@on_devices
def test_ulysses_in_a_compiled_wan_loop():
    """UlyssesAttention as the sparse_fn of a Wan model's jit-compiled Euler loop."""
    from tessera_jax.flax import AttentionOptions, MaskSchedule
    from tessera_jax.models import make_sampler
    model = _tiny_wan(4)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 3, 8, 8, 4)).astype(np.float32))   # 48 tokens
    ctx = jnp.asarray(rng.standard_normal((1, 8, 32)).astype(np.float32))
    sched = MaskSchedule.constant(_skewed(48, 4, block=8), 1, 2)
    opts = AttentionOptions(sparse_fn=tp.UlyssesAttention(_mesh(4), "x", heads="lpt"))
    out = make_sampler(model, sched, options=opts)(x, ctx)
    np.testing.assert_allclose(out, make_sampler(model, sched)(x, ctx), **TOL)


@on_devices
def test_gradients_equal_one_device():
    """jax.grad through Ulysses (all-to-alls, a balanced static assignment, the stacked plan's
    backward) equals the one-device gradient; 2 devices, small shapes."""
    mask = _skewed(128, 4)
    q, k, v = _qkv(128, 4, 2)
    mesh = _mesh(2, explicit=False)

    def loss(fn):
        return jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), (0, 1, 2)))

    want = loss(lambda q, k, v: tj.sparse_attention(q, k, v, mask))(q, k, v)
    got = loss(lambda q, k, v: tp.ulysses_attention(q, k, v, mask, axis_name="x", mesh=mesh,
                                                    heads="lpt"))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **TOL)


@on_devices
def test_check_finite_through_the_stacked_per_device_plans():
    """``Options(check_finite=True)`` in a user's shard_map over heads whose static per-head
    mask runs as stacked per-device plans: exactly the rows that select the NaN key are NaN,
    the others are the clean call's."""
    mask = _skewed(256, 16)
    q, k, v = _qkv(256, 16, 16)
    mesh = _mesh(explicit=False)
    hs = jax.sharding.PartitionSpec(None, None, "x", None)
    opts = tj.Options(check_finite=True)

    def local(q, k, v):
        return tp.local_attention(q, k, v, mask, axis_name="x", options=opts)

    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(hs,) * 3, out_specs=hs))(
        q, k, v.at[:, 100].set(jnp.nan))
    rows = mask.token_mask()[:, :, 100].T[None]                        # [1, Lq, Hq]
    assert 0 < rows.sum() < rows.size
    out = np.asarray(out)
    np.testing.assert_array_equal(np.isnan(out).any(-1), rows)
    np.testing.assert_allclose(out[~rows], np.asarray(_ref(256, 16, 16))[~rows], **TOL)


@on_devices
def test_eager_device_route_on_sharded_and_other_device_inputs():
    """The tiered device route's call is compiled ahead of time for the one device q, k, v are
    on: inputs sharded over devices run jit's call instead, inputs on another device than the
    first get their own executable; both equal the reference (``Options.host_planning``
    "device_first": eager calls, no trace)."""
    from tessera_jax.runtime import tiered
    mask = _skewed(256, 8)
    q, k, v = _qkv(256, 8, 8)
    opts = tj.Options(host_planning="device_first")
    hs = jax.sharding.NamedSharding(_mesh(explicit=False),
                                    jax.sharding.PartitionSpec(None, None, "x", None))
    for put in (lambda x: jax.device_put(x, hs), lambda x: jax.device_put(x, jax.devices()[3])):
        a, b, c = (put(x) for x in (q, k, v))
        before = tiered.stats().get("device_route", 0)
        out = tj.sparse_attention(a, b, c, mask, backend="xla", options=opts)
        assert tiered.stats().get("device_route", 0) == before + 1
        np.testing.assert_allclose(out, tj.reference_attention(q, k, v, mask), **TOL)
        assert tiered.wait(60)
        tj.clear_caches()
