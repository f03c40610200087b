"""Tiered planning (``Options(host_planning=...)``, ``runtime.tiered``, ``runtime.tier_costs``):
a new host mask runs the device route while its host plan is made in the background; outputs
agree with the synchronous path and the reference, the next call runs the host plan, jit is
untouched, failures surface, concurrent calls plan once, ``tj.clear_caches`` drops pending
plans."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp

import tessera_jax as tj
from tessera_jax.runtime import api, host_plans, tier_costs, tiered
from tessera_jax.select.device import DeviceRule
from tessera_jax.tools.timing import backend_compiles
from tessera_jax.validation import check_shapes

from strategies import random_qkv

TOL = dict(atol=2e-5, rtol=2e-5)
L, H, D, N = 192, 2, 16, 6             # one block-count shape: the device route compiles once
# The host plan from a mask's first call (the default waits for its second: tested below)
FIRST = tj.Options(host_planning="device_first", host_plan_from_call=1)
TIERED = tj.Options(host_planning="tiered", host_plan_from_call=1)


@pytest.fixture(autouse=True)
def _fresh():
    tj.clear_caches()
    yield
    tj.clear_caches()


def _mask(seed: int, Hm: int = H, density: float = 0.4) -> tj.BlockMask:
    rng = np.random.default_rng(seed)
    qb, kb = (np.r_[0, np.sort(rng.choice(np.arange(1, L), N - 1, replace=False)), L]
              for _ in range(2))
    return tj.BlockMask(qb, kb, rng.random((Hm, N, N)) < density)


def _qkv(seed: int = 0):
    return random_qkv(1, L, L, H, H, D, "float32", seed)


def _routes(fn):
    """(fn(), 'device' or 'host': the route the call took, from ``tiered.stats``)."""
    before = tiered.stats().get("device_route", 0)
    out = fn()
    return out, "device" if tiered.stats().get("device_route", 0) > before else "host"


def test_host_planning_is_validated_and_hashable():
    for bad in ("async", "", None, 1):
        with pytest.raises(ValueError, match="host_planning"):
            tj.Options(host_planning=bad)
    assert hash(TIERED) != hash(tj.Options()) and TIERED == tj.Options(
        host_planning="tiered", host_plan_from_call=1)
    for bad in (0, -1, 1.0, True, "2", None):
        with pytest.raises(ValueError, match="host_plan_from_call"):
            tj.Options(host_plan_from_call=bad)


@pytest.mark.parametrize("from_call", [2, 3])
def test_the_host_plan_starts_at_the_masks_nth_call(from_call):
    """A new mask's host plan starts at its ``host_plan_from_call``-th call: earlier calls run
    the device route and start nothing (a mask that never comes again costs no plan); the
    next call after the plan is in runs it. Other shapes of the same mask are another
    request; ``clear_caches`` forgets the count."""
    opts = tj.Options(host_planning="device_first", host_plan_from_call=from_call)
    m, (q, k, v) = _mask(5), _qkv()
    ref = tj.reference_attention(q, k, v, m)
    call = lambda: tj.sparse_attention(q, k, v, m, options=opts)        # noqa: E731
    for _ in range(from_call - 1):
        out, route = _routes(call)
        assert route == "device" and tiered.pending() == 0
        np.testing.assert_allclose(out, ref, **TOL)
    assert api._PLANS.get((m, q.shape, k.shape, np.dtype(q.dtype), None, None, None,
                           opts.planner)) is None
    started = tiered.stats().get("started", 0)
    out, route = _routes(call)
    assert route == "device" and tiered.stats().get("started", 0) == started + 1
    assert tiered.wait(60)
    out, route = _routes(call)
    assert route == "host"
    np.testing.assert_allclose(out, ref, **TOL)
    # a new count after clear_caches; another mask is counted apart
    tj.clear_caches()
    m2 = _mask(6)
    for mm in (m, m2):
        _, route = _routes(lambda: tj.sparse_attention(q, k, v, mm, options=opts))
        assert route == "device" and tiered.pending() == 0


def test_a_copy_of_the_mask_counts_as_the_mask():
    """Calls count per request, so an equal mask built again (a new object, the same bounds
    and blocks) is the same mask's second call."""
    opts = tj.Options(host_planning="device_first")
    m, (q, k, v) = _mask(7), _qkv()
    tj.sparse_attention(q, k, v, m, options=opts)
    assert tiered.pending() == 0
    again = tj.BlockMask(np.asarray(m.q_bounds), np.asarray(m.kv_bounds), np.array(m.blocks))
    tj.sparse_attention(q, k, v, again, options=opts)
    assert tiered.stats().get("started", 0) >= 1
    assert tiered.wait(60) and _routes(
        lambda: tj.sparse_attention(q, k, v, m, options=opts))[1] == "host"


# 5 examples, random each run: each compiles the device route and the host plan's program.
@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1), Hm=st.sampled_from([1, H]),
       density=st.sampled_from([0.2, 0.6, 1.0]))
def test_first_call_runs_the_device_route_then_the_host_plan(seed, Hm, density):
    """Any bounds (1-token blocks included), shared or per-head blocks: the first call runs
    the device route and matches the reference; once the background plan is in, the next
    call runs it and gives exactly the synchronous path's output, from the same plan."""
    tj.clear_caches()
    m = _mask(seed, Hm, density)
    q, k, v = _qkv(seed % 7)
    ref, ref_lse = tj.reference_attention(q, k, v, m, return_lse=True)
    (out, lse), route = _routes(lambda: tj.sparse_attention(q, k, v, m, return_lse=True,
                                                            options=FIRST))
    assert route == "device"
    np.testing.assert_allclose(out, ref, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    assert tiered.wait(60)
    (out2, lse2), route = _routes(lambda: tj.sparse_attention(q, k, v, m, return_lse=True,
                                                              options=FIRST))
    assert route == "host"
    tiered_plan = tj.plan(m, q.shape, k.shape, q.dtype)
    tj.clear_caches()
    sync_out, sync_lse = tj.sparse_attention(q, k, v, m, return_lse=True)
    sync_plan = tj.plan(m, q.shape, k.shape, q.dtype)
    np.testing.assert_array_equal(out2, sync_out)
    np.testing.assert_array_equal(lse2, sync_lse)
    assert tiered_plan is not sync_plan
    for a in ("units", "steps", "template", "policy", "chosen_by", "dense_route"):
        np.testing.assert_array_equal(getattr(tiered_plan, a), getattr(sync_plan, a))


def test_a_second_call_before_the_plan_is_ready_stays_on_the_device(monkeypatch):
    """The host plan is used once ready, never waited for by a tiered call."""
    release = threading.Event()
    build = host_plans.build

    def slow(*a, **kw):
        release.wait(60)
        return build(*a, **kw)

    monkeypatch.setattr(host_plans, "build", slow)
    m, (q, k, v) = _mask(1), _qkv()
    outs = [_routes(lambda: tj.sparse_attention(q, k, v, m, options=FIRST)) for _ in range(2)]
    assert [r for _, r in outs] == ["device", "device"] and tiered.pending() == 1
    release.set()
    assert tiered.wait(60) and tiered.pending() == 0
    out, route = _routes(lambda: tj.sparse_attention(q, k, v, m, options=FIRST))
    assert route == "host"
    np.testing.assert_allclose(out, outs[0][0], **TOL)


def test_the_host_plan_starts_after_the_device_route_is_dispatched(monkeypatch):
    """A background plan beside the dispatch would hold the GIL while the call launches its
    kernels: the plan is submitted once the device route has returned (dispatched), also when
    that route raises, and a plan cleared before it started never runs."""
    events = []
    route, executor, build = tiered._device_route, tiered._executor, host_plans.build

    def traced_route(*a, **kw):
        events.append("route")
        return route(*a, **kw)

    class Recorder:
        def submit(self, fn, *a):
            events.append("submit")
            return executor().submit(fn, *a)

    monkeypatch.setattr(tiered, "_device_route", traced_route)
    monkeypatch.setattr(tiered, "_executor", Recorder)
    m, (q, k, v) = _mask(21), _qkv()
    jax.block_until_ready(tj.sparse_attention(q, k, v, m, options=FIRST))
    assert tiered.wait(60) and events == ["route", "submit"]
    # a route that raises still submits (and so never leaves a plan pending forever)
    events.clear()
    monkeypatch.setattr(tiered, "_device_route", lambda *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tj.sparse_attention(q, k, v, _mask(22), options=FIRST)
    assert tiered.wait(60) and events == ["submit"] and tiered.pending() == 0
    # cleared between the call's entry and its submission: the background plan never runs
    # (the call, given no output by this route, plans on its own thread)
    ran = []
    monkeypatch.setattr(host_plans, "build", lambda *a, **kw: ran.append(
        threading.current_thread().name) or build(*a, **kw))
    monkeypatch.setattr(tiered, "_device_route", lambda *a, **kw: tj.clear_caches())
    tj.sparse_attention(q, k, v, _mask(23), options=FIRST)
    assert tiered.wait(60) and ran == [threading.current_thread().name]
    assert tiered.pending() == 0


def test_the_host_plan_waits_for_the_device_routes_output(monkeypatch):
    """The background plan starts only once the device route's output is ready (so its
    Python never competes with the request for the GIL): a route whose output is not ready
    holds the plan back until it is."""
    gate, order = threading.Event(), []

    class Pending:
        """An output leaf whose readiness the test releases."""

        def block_until_ready(self):
            gate.wait(60)
            order.append("output ready")
            return self

    build = host_plans.build
    monkeypatch.setattr(tiered, "_device_route", lambda *a, **kw: Pending())
    monkeypatch.setattr(host_plans, "build", lambda *a, **kw: order.append("plan") or build(
        *a, **kw))
    m, (q, k, v) = _mask(24), _qkv()
    assert isinstance(tj.sparse_attention(q, k, v, m, options=FIRST), Pending)
    assert not tiered.wait(0.3) and order == []            # held back by the output
    gate.set()
    assert tiered.wait(60) and order == ["output ready", "plan"]
    assert _routes(lambda: tj.sparse_attention(q, k, v, m, options=FIRST))[1] == "host"


def test_a_tiered_request_reads_the_packed_bits_only(monkeypatch):
    """The tiered request (front, rule, copy, device route) never unpacks the static mask's
    blocks nor makes its SHA-256 digest: only its background host plan does."""
    submitted = []

    class Held:
        def submit(self, fn, *a):
            submitted.append((fn, a))

    monkeypatch.setattr(tiered, "_executor", Held)
    m, (q, k, v) = _mask(25), _qkv()
    m = tj.BlockMask(m.q_bounds, m.kv_bounds, m.blocks)       # a new mask, blocks packed
    out = tj.sparse_attention(q, k, v, m, options=FIRST)
    assert m._blocks is None and m._digest is None and len(submitted) == 1
    fn, a = submitted[0]
    fn(*a)                                                    # the plan reads them
    assert m._blocks is not None
    np.testing.assert_allclose(np.asarray(out), np.asarray(
        tj.sparse_attention(q, k, v, m, options=tj.Options(host_planning="sync"))), **TOL)


def test_under_jit_the_option_changes_nothing():
    """Under a trace the mask is a constant planned at trace time: the same program, no
    background plan, no device route."""
    m, (q, k, v) = _mask(2), _qkv()

    def f(opts):
        return lambda q, k, v: tj.sparse_attention(q, k, v, m, options=opts)

    before = tiered.stats()
    for opts in (FIRST, TIERED):
        tj.clear_caches()
        tiered_jaxpr = str(jax.make_jaxpr(f(opts))(q, k, v))
        tj.clear_caches()
        assert tiered_jaxpr == str(jax.make_jaxpr(f(tj.Options()))(q, k, v))
        out = jax.jit(f(opts))(q, k, v)
        np.testing.assert_array_equal(out, jax.jit(f(tj.Options()))(q, k, v))
        grads = jax.grad(lambda q: f(opts)(q, k, v).sum())(q)
        np.testing.assert_array_equal(grads, jax.grad(lambda q: f(None)(q, k, v).sum())(q))
    assert tiered.stats() == before and tiered.pending() == 0


def test_a_named_template_or_policy_plans_on_the_host():
    m, (q, k, v) = _mask(3), _qkv()
    _, route = _routes(lambda: tj.sparse_attention(q, k, v, m, policy="merge", options=FIRST))
    assert route == "host" and tiered.pending() == 0
    _, route = _routes(lambda: tj.sparse_attention(q, k, v, m, template="xla_64x64",
                                                   options=FIRST))
    assert route == "host" and tiered.pending() == 0


def test_a_background_failure_is_raised_by_the_next_call(monkeypatch):
    """The next call of the mask re-raises it, once; the call after plans again."""
    def broken(*a, **kw):
        raise RuntimeError("planner broke")

    monkeypatch.setattr(host_plans, "build", broken)
    m, (q, k, v) = _mask(4), _qkv()
    out, route = _routes(lambda: tj.sparse_attention(q, k, v, m, options=FIRST))
    assert route == "device"
    assert tiered.wait(60)
    with pytest.raises(RuntimeError, match="planner broke"):
        tj.sparse_attention(q, k, v, m, options=FIRST)
    assert tiered.stats()["reraised"] >= 1 and tiered.pending() == 0
    monkeypatch.undo()
    out2 = tj.sparse_attention(q, k, v, m, options=FIRST)      # plans again, in background
    assert tiered.wait(60)
    np.testing.assert_allclose(out2, out, **TOL)
    # A synchronous plan of a failed key raises too.
    monkeypatch.setattr(host_plans, "build", broken)
    tj.clear_caches()
    tj.sparse_attention(q, k, v, m, options=FIRST)
    assert tiered.wait(60)
    with pytest.raises(RuntimeError, match="planner broke"):
        tj.plan(m, q.shape, k.shape, q.dtype)


def test_concurrent_calls_on_a_new_mask_plan_it_once(monkeypatch):
    """Threads calling the same new mask share one background plan; a synchronous plan of
    that mask meanwhile waits for it instead of planning again."""
    release = threading.Event()
    calls = []
    build = host_plans.build

    def counted(*a, **kw):
        calls.append(1)
        release.wait(60)
        return build(*a, **kw)

    monkeypatch.setattr(host_plans, "build", counted)
    m, (q, k, v) = _mask(5), _qkv()
    outs, errors = [None] * 6, []

    def worker(i):
        try:
            outs[i] = np.asarray(tj.sparse_attention(q, k, v, m, options=FIRST))
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(outs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    planner = threading.Thread(target=lambda: outs.append(tj.plan(m, q.shape, k.shape,
                                                                  q.dtype)))
    planner.start()
    release.set()
    planner.join(60)
    assert tiered.wait(60)
    assert len(calls) == 1
    assert outs[-1] is tj.plan(m, q.shape, k.shape, q.dtype)
    for o in outs[1:6]:
        np.testing.assert_array_equal(o, outs[0])


def test_clear_caches_drops_pending_plans(monkeypatch):
    """A plan running when the caches are cleared lands in no cache; the next call starts
    a new one."""
    started, release = threading.Event(), threading.Event()
    build = host_plans.build

    def slow(*a, **kw):
        started.set()
        release.wait(60)
        return build(*a, **kw)

    monkeypatch.setattr(host_plans, "build", slow)
    m, (q, k, v) = _mask(6), _qkv()
    tj.sparse_attention(q, k, v, m, options=FIRST)
    assert started.wait(60) and tiered.pending() == 1
    threading.Timer(0.2, release.set).start()
    tj.clear_caches()                      # waits for the running plan, publishes nothing
    assert tiered.pending() == 0 and len(api._PLANS) == 0
    n = tiered.stats().get("started", 0)
    _, route = _routes(lambda: tj.sparse_attention(q, k, v, m, options=FIRST))
    assert route == "device" and tiered.stats()["started"] == n + 1
    assert tiered.wait(60) and len(api._PLANS) == 1


def test_check_finite_with_tiering():
    m, (q, k, v) = _mask(7), _qkv()
    k = k.at[0, 5, 0, 0].set(jnp.nan)
    opts = tj.Options(host_planning="device_first", check_finite=True,
                      host_plan_from_call=1)
    out, route = _routes(lambda: tj.sparse_attention(q, k, v, m, options=opts))
    assert route == "device"
    ref = tj.reference_attention(q, k, v, m)
    np.testing.assert_allclose(out, ref, **TOL)                       # NaN rows where equal


# --- the rule ----------------------------------------------------------------------------
def _costs(**kw):
    base = dict(host_ms=0.0, host_ns_per_block=0.0, host_ns_per_selected=0.0,
                host_ns_per_pair=0.0, device_ms=0.0,
                device_ns_per_tile=0.0, device_ns_per_bitmap=0.0,
                kernel_ns_per_interaction=0.0, kernel_excess=0.0, compile_ms=0.0,
                source="test")
    return tier_costs.TierCosts(**{**base, **kw})


def test_the_rule_compares_predicted_costs():
    m = _mask(8)
    shape = check_shapes((1, L, H, D), (1, L, H, D), "float32")
    size = tier_costs.size_of(m, shape, "xla", tj.Options().device_rule)
    assert size.blocks == H * N * N and size.selected == int(m.blocks.sum())
    slow_host = _costs(host_ns_per_block=1e6, device_ms=0.5, compile_ms=100.0)
    assert tier_costs.predict(size, slow_host, True) == pytest.approx((H * N * N, 0.5))
    assert tier_costs.tiers(size, slow_host, compiled=True)
    assert not tier_costs.tiers(size, slow_host, compiled=False)      # + 100 ms compile
    assert not tier_costs.tiers(size, _costs(device_ms=1.0), compiled=True)
    assert not tier_costs.tiers(size, None, compiled=True)
    assert not tier_costs.tiers(None, slow_host, compiled=True)
    assert tier_costs.costs_for("tpu", "xla") is None
    with pytest.raises(ValueError, match="compile_ms"):
        _costs(compile_ms=-1.0)


def test_a_gathering_host_choice_adds_its_planning_time():
    """A gathering host plan costs per selected pair on top of the base terms; only a size
    whose host choice gathers pays it, and the rule asks the host choice only where that term
    could still tip it."""
    import dataclasses
    m = _mask(8)
    shape = check_shapes((1, L, H, D), (1, L, H, D), "float32")
    size = tier_costs.size_of(m, shape, "xla", tj.Options().device_rule)
    assert size.gather is False and size.pairs > 0
    c = _costs(device_ms=1.0, host_ns_per_gather_pair=2e6 / size.pairs)    # 2 ms if gathering
    assert tier_costs.predict(size, c, True)[0] == pytest.approx(0.0)
    gathering = dataclasses.replace(size, gather=True)
    assert tier_costs.predict(gathering, c, True)[0] == pytest.approx(2.0)
    assert not tier_costs.tiers(size, c, True) and tier_costs.tiers(gathering, c, True)


def test_the_rule_reads_the_host_choice_only_when_it_matters(monkeypatch):
    asked = []
    monkeypatch.setattr(tier_costs, "host_gathers", lambda *a: asked.append(1) or True)
    m, (q, k, _) = _mask(9), _qkv()
    shape = check_shapes(q.shape, k.shape, q.dtype)
    for c, want_ask, want in ((_costs(device_ms=1.0), False, False),          # no gather term
                              (_costs(host_ms=5.0, device_ms=1.0,
                                      host_ns_per_gather_pair=1.0), False, True),  # tiers anyway
                              (_costs(device_ms=1.0, host_ns_per_gather_pair=1e9), True, True)):
        asked.clear()
        monkeypatch.setattr(tier_costs, "costs_for", lambda *a, c=c: c)
        assert tiered._rule(m, shape, "xla", TIERED, True, q, tiered.bounds_key(m)) is want
        assert bool(asked) is want_ask


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), density=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
       host_ms=st.floats(0.0, 3.0), per_sel=st.floats(0.0, 1e5), device_ms=st.floats(0.0, 3.0),
       excess=st.floats(0.0, 1e3), per_gather=st.sampled_from([0.0, 1.0]))
def test_the_rule_counts_only_as_far_as_its_answer_needs(
        seed, density, host_ms, per_sel, device_ms, excess, per_gather):
    """The rule's answer equals ``tiers`` of the mask's full size (the host choice asked
    where it tips); the mask is not counted where the sizes with no and with every block
    selected agree, and a count that stops early answers as the whole count."""
    import dataclasses
    from unittest import mock
    rng = np.random.default_rng(seed)
    b = np.arange(0, 4 * L + 1, 4)                 # 192 x 192 blocks of 4 tokens: 576 words
    m = tj.BlockMask(b, b, rng.random((1, L, L)) < density)
    q = k = jnp.zeros((1, 4 * L, H, D), jnp.float32)
    shape = check_shapes(q.shape, k.shape, q.dtype)
    c = _costs(host_ms=host_ms, host_ns_per_selected=per_sel, device_ms=device_ms,
               kernel_ns_per_interaction=1e-3, kernel_excess=excess,
               host_ns_per_gather_pair=per_gather)
    rule = TIERED.device_rule
    size = tier_costs.size_of(m, shape, "xla", rule)
    if size is None:
        return
    host, device = tier_costs.predict(size, c, True)
    if abs(host - device) < 1e-9 * max(host, device, 1.0):
        return                                                 # a tie: rounding decides
    gathers = tier_costs.host_gathers(m, shape, "xla")
    want = tier_costs.tiers(size, c, True) or (
        per_gather > 0 and tier_costs.tiers(dataclasses.replace(size, gather=gathers), c, True))
    ends = {tier_costs.tiers(tier_costs.size_of(m, shape, "xla", rule, selected=n), c,
                             True) for n in (0, size.blocks)}
    stops = []
    real = tj.BlockMask.count_selected
    with mock.patch.object(tiered.tier_costs, "costs_for", lambda *a: c), \
            mock.patch.object(tj.BlockMask, "count_selected",
                              lambda self, stop_above=None: stops.append(stop_above)
                              or real(self, stop_above)):
        got = tiered._rule(m, shape, "xla", TIERED, True, q, tiered.bounds_key(m))
        if stops and stops[0] is not None:       # the early stop answers as the whole count
            assert (real(m, stops[0]) > stops[0]) == (real(m) > stops[0])
    assert got is want
    if len(ends) == 1 and not (per_gather > 0 and not want):
        assert stops == []


@pytest.mark.parametrize("rising", [True, False])
@pytest.mark.parametrize("delta", [-0.5, 0.5])
def test_the_rules_early_count_decides_next_to_the_flip(rising, delta):
    """Costs that put the count where the rule flips half a block from the mask's own count:
    the early-stopping count (16 heads x 192 x 192 blocks: three chunks) answers as the whole
    count would, on either side, whether more selected blocks favour the device route (host
    planning per block) or the host (the device route's kernel excess per interaction)."""
    Hm = 16
    b = np.arange(0, 4 * L + 1, 4)
    m = tj.BlockMask(b, b, np.random.default_rng(3).random((Hm, L, L)) < 0.3)
    n = m.count_selected()
    q = jnp.zeros((1, 4 * L, Hm, D), jnp.float32)
    shape = check_shapes(q.shape, q.shape, q.dtype)
    per_block = 16 * D                                     # interactions_d of one 4 x 4 block
    if rising:        # host 1e-3 ms a block; device fixed at the flip
        c = _costs(host_ns_per_selected=1e3, device_ms=1e-3 * (n + delta))
    else:             # host fixed at the flip; device 1e-6 * per_block ms a block
        c = _costs(host_ms=1e-6 * per_block * (n + delta), kernel_ns_per_interaction=1.0,
                   kernel_excess=1.0)
    got = tier_costs.base_tiers(m, shape, "xla", TIERED.device_rule, None, c, True)
    size = tier_costs.size_of(m, shape, "xla", TIERED.device_rule)
    assert got is tier_costs.tiers(size, c, True) is ((delta < 0) if rising else (delta > 0))


def test_constants_per_gpu_and_auto_mode():
    """The GPU's own constants first, then the platform's; "auto" is "sync" on the CPU and
    "tiered" on a GPU; the default options are "auto"."""
    assert tier_costs.costs_for("gpu", "mosaic_gpu", "h100") is tier_costs.H100
    assert tier_costs.costs_for("cuda", "mosaic_gpu", "h200") is tier_costs.H200
    assert tier_costs.costs_for("gpu", "mosaic_gpu", "b200") is tier_costs.H200
    assert tier_costs.costs_for("cpu", "xla") is tier_costs.CPU
    assert tier_costs.H100.host_ns_per_gather_pair > 0
    assert tier_costs.CPU.host_ns_per_gather_pair == 0
    q = _qkv()[0]
    assert tj.Options().host_planning == "auto" and tiered.mode(tj.Options(), q) == "sync"
    for m in ("sync", "tiered", "device_first"):
        assert tiered.mode(tj.Options(host_planning=m), q) == m

    class OnGpu:
        def devices(self):
            return {type("D", (), {"platform": "gpu"})()}

    assert tiered.mode(tj.Options(), OnGpu()) == "tiered"
    # on the CPU the default never runs the tiered route, even once it is compiled
    m2, (q, k, v) = _mask(10), _qkv()
    tj.precompile(m2, q.shape, k.shape, q.dtype, options=FIRST)
    tj.clear_caches()
    _, route = _routes(lambda: tj.sparse_attention(q, k, v, m2))
    assert route == "host"


def test_measured_host_planning_scales_the_rule(monkeypatch):
    """A size the fit misprices: two timed host plans far slower than predicted make the rule
    tier (one is not enough: a first plan's one-time costs); the least ratio counts, so a
    fast plan takes it back; samples a minute old no longer count; ``clear_caches`` keeps the
    times, a fresh process drops them.
    Costs with room for a loaded box's timing noise: 1 ms predicted host planning against
    100 ms of device-route extra; "slow" plans take 150 ms."""
    import time as _time
    monkeypatch.setattr(tier_costs, "costs_for",
                        lambda *a: _costs(host_ms=1.0, device_ms=100.0))
    m = _mask(21)
    q, k, _ = _qkv()
    shape = check_shapes(q.shape, k.shape, q.dtype)
    bkey, rkey = tiered.bounds_key(m), tiered._ratio_key(m, shape, "xla")
    tiered._HOST_RATIOS.pop(rkey, None)           # other tests' plans of this shape
    made = host_plans.build(m, shape, "xla", None, None)

    def rule():
        with tiered._LOCK:
            scale = tiered._host_scale(rkey)
        return tiered._rule(m, shape, "xla", TIERED, True, q, bkey, scale)

    def timed(ms):                # a host plan that takes ``ms`` (about nothing for 0)
        return tiered._timed(lambda: _time.sleep(ms / 1e3) or made, m, shape, "xla", TIERED,
                             "cpu", bkey)

    try:
        before = tiered.stats().get("timed", 0)
        assert timed(150.0) is made and not rule()                 # one plan: no scale yet
        timed(150.0)
        assert tiered.stats()["timed"] == before + 2 and rule()
        tj.clear_caches()
        assert rule()
        timed(0.0)                                                 # the least ratio counts
        assert not rule()
        timed(150.0), timed(150.0)
        assert not rule()             # the fast one is still among the last plans
        for _ in range(tiered._HOST_RATIOS_KEPT):
            timed(150.0)
        assert rule()
        with tiered._LOCK:             # a minute on, the samples are old: measured anew
            later = _time.monotonic() + tiered._HOST_RATIOS_TTL_S + 1
            assert tiered._host_scale(rkey) > 100 and tiered._host_scale(rkey, later) == 1.0
        tj.clear_caches(fresh_process=True)
        assert not rule()
    finally:
        tiered._HOST_RATIOS.pop(rkey, None)


def test_a_declined_request_times_its_host_plan(monkeypatch):
    """The rule's host plan (declined: costs that keep every size on the host) is timed and
    in the front cache for the caller; the output is the reference's; a background plan is
    timed too."""
    monkeypatch.setattr(tier_costs, "costs_for", lambda *a: _costs(host_ms=1.0, device_ms=1e6))
    m, (q, k, v) = _mask(13), _qkv()
    rkey = tiered._ratio_key(m, check_shapes(q.shape, k.shape, q.dtype), "xla")
    tiered._HOST_RATIOS.pop(rkey, None)
    try:
        before = dict(tiered.stats())
        out, route = _routes(lambda: tj.sparse_attention(q, k, v, m, options=TIERED))
        now = tiered.stats()
        assert route == "host" and now["declined"] == before.get("declined", 0) + 1
        assert now["timed"] == before.get("timed", 0) + 1
        assert len(tiered._HOST_RATIOS[rkey]) == 1
        np.testing.assert_allclose(out, tj.reference_attention(q, k, v, m), **TOL)
        timed = tiered.stats()["timed"]
        _, again = _routes(lambda: tj.sparse_attention(q, k, v, m, options=TIERED))
        assert again == "host" and tiered.stats()["timed"] == timed     # the cached plan
        m2 = _mask(14)                  # the device route first, its host plan in the back
        _, route = _routes(lambda: tj.sparse_attention(q, k, v, m2, options=FIRST))
        assert route == "device" and tiered.wait() and tiered.stats()["timed"] == timed + 1
    finally:
        tiered._HOST_RATIOS.pop(rkey, None)


def test_the_rule_skips_masks_the_device_route_runs_exactly():
    """1-token blocks need more bitmap steps than the traced capacity holds: the device route
    would run the exact XLA path, so the rule keeps the host plan."""
    b = np.arange(L + 1)
    m = tj.BlockMask(b, b, np.eye(L, dtype=bool)[None])
    shape = check_shapes((1, L, H, D), (1, L, H, D), "float32")
    assert tier_costs.size_of(m, shape, "xla", DeviceRule(1 << 12)) is None


def test_a_new_shape_counts_its_compile():
    """A block-count shape whose device route this process has not run pays a compile
    (seconds on the CPU box): the rule keeps the host plan, and ``stats`` says so."""
    rng = np.random.default_rng(12)
    m = tj.BlockMask.uniform(L, L, 48, 48, rng.random((H, 4, 4)) < 0.5)   # [2, 4, 4]: new
    q, k, v = _qkv()
    assert not tiered.compiled(q, k, m, "xla", D ** -0.5, False, TIERED)
    before = tiered.stats().get("declined", 0)
    out, route = _routes(lambda: tj.sparse_attention(q, k, v, m, options=TIERED))
    assert route == "host" and tiered.stats()["declined"] == before + 1
    np.testing.assert_allclose(out, tj.reference_attention(q, k, v, m), **TOL)


def test_the_cpu_rule_keeps_wan480_masks_on_the_host():
    """On the CPU box the device planner costs seconds at Wan 480p against milliseconds of
    host planning: no tiering, even with the route compiled."""
    from tessera_jax.masks import families
    def size(m):
        shape = check_shapes((1, m.Lq, 12, 128), (1, m.Lkv, 12, 128), "float32")
        return tier_costs.size_of(m, shape, "xla")

    s = size(families.vsa("wan480", heads=12))
    host, device = tier_costs.predict(s, tier_costs.CPU, compiled=True)
    assert device > 10 * host and not tier_costs.tiers(s, tier_costs.CPU, True)
    # 1,000 key clusters of ~33 tokens: 64 x 64 tiles, their bitmap steps within the traced
    # capacity, and the host still cheaper; 8-token key clusters: every tile pair may need a
    # bitmap step, more than the capacity (the exact path).
    s = size(families.svg2("wan480", heads=12))
    assert s is not None and not tier_costs.tiers(s, tier_costs.CPU, True)
    assert size(families.svg2("wan480", heads=12, q_clusters=100, kv_clusters=500)) is not None
    assert size(families.svg2("wan480", heads=12, kv_clusters=4000)) is None


def test_precompile_compiles_the_tiered_device_route():
    """With a tiered ``Options``, ``tj.precompile`` also runs the device route of each mask
    shape, so the rule stops counting a compile for them."""
    m, (q, k, v) = _mask(10), _qkv()
    scale = D ** -0.5
    other = tj.Options(host_planning="tiered", bitmap_budget_bytes=1 << 28)   # a new executable
    assert not tiered.compiled(q, k, m, "xla", scale, False, other)
    tj.precompile([m, _mask(11)], q.shape, k.shape, q.dtype, backend="xla", options=other)
    assert tiered.compiled(q, k, m, "xla", scale, False, other)
    assert not tiered.compiled(q, k, m, "xla", scale, True, other)
    assert tiered.pending() == 0


@pytest.mark.parametrize("routes", [("static",), ("traced",)])
def test_precompile_compiles_the_tiered_routes_named(routes):
    """``tiered_routes``: "static" compiles the route of each mask's own bounds only (a mask
    of other bounds, same shapes, still counts a compile), "traced" the one any bounds of
    these shapes run."""
    m, other, (q, k, v) = _mask(12), _mask(13), _qkv()
    assert not np.array_equal(m.kv_bounds, other.kv_bounds)
    scale = D ** -0.5
    opts = tj.Options(host_planning="tiered",                       # executables of their own
                      bitmap_budget_bytes=(1 << 26) + len(routes[0]))
    tj.precompile(m, q.shape, k.shape, q.dtype, backend="xla", options=opts,
                  tiered_routes=routes)
    assert tiered.compiled(q, k, m, "xla", scale, False, opts)
    assert tiered.compiled(q, k, other, "xla", scale, False, opts) == (routes == ("traced",))


def test_a_precompiled_route_serves_committed_inputs_without_a_compile():
    """``tj.precompile`` runs zeros (uncommitted); a request's q, k, v are often committed to
    the device (DLPack, ``device_put(x, device)``, whatever is computed from them), which
    ``jax.jit``'s cache tells apart: the device route's call is compiled ahead of time, one
    executable for both, so such a request compiles nothing (an H100 host row paid 3-4 s)."""
    opts = tj.Options(host_planning="device_first", bitmap_budget_bytes=(1 << 26) + 7)
    m, (q, k, v) = _mask(14), _qkv(3)
    tj.precompile(m, q.shape, k.shape, q.dtype, backend="xla", options=opts,
                  tiered_routes=("static",))
    dev = jax.devices()[0]
    q, k, v = (jax.device_put(x, dev) for x in (q, k, v))
    assert q.committed
    tj.clear_caches()
    new = tj.BlockMask(m.q_bounds, m.kv_bounds, ~m.blocks)       # same bounds, new blocks
    with backend_compiles() as compiles:
        out, r = _routes(lambda: tj.sparse_attention(q, k, v, new, backend="xla", options=opts))
    assert r == "device" and compiles == []
    np.testing.assert_allclose(out, tj.reference_attention(q, k, v, new), **TOL)
    assert tiered.wait(60)


@pytest.mark.parametrize("bad", [(), ("static", "host"), "static", None])
def test_precompile_rejects_unknown_tiered_routes(bad):
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match="tiered_routes must be"):
        tj.precompile(_mask(12), q.shape, k.shape, q.dtype, backend="xla", tiered_routes=bad)


def test_precompiled_bounds_run_the_static_bounds_route(monkeypatch):
    """A new mask whose bounds' executable ``precompile`` compiled runs the device route with
    those bounds static (NumPy: tiles aligned to its blocks); a mask of other bounds, same
    shapes, the traced one; both agree with the reference, and the next call the host plan."""
    seen = []
    route = tiered._device_route

    def spy(q, k, v, mask, leaves, *a, **kw):
        seen.append(isinstance(leaves[0], np.ndarray) and isinstance(leaves[1], np.ndarray))
        return route(q, k, v, mask, leaves, *a, **kw)

    def executables():
        return sum(len(fn.executables) for fn in tiered._PREPARED.values())

    opts = tj.Options(host_planning="device_first", bitmap_budget_bytes=1 << 27,
                      host_plan_from_call=1)
    (q, k, v), scale = _qkv(), D ** -0.5
    m = _mask(30)
    tj.precompile(m, q.shape, k.shape, q.dtype, backend="xla", options=opts)
    assert tiered.compiled(q, k, m, "xla", scale, False, opts)
    same_bounds = tj.BlockMask(m.q_bounds, m.kv_bounds, ~m.blocks)
    other = _mask(31)
    assert tiered.compiled(q, k, other, "xla", scale, False, opts)       # traced: same shapes
    compiled, prepared = executables(), len(tiered._PREPARED)
    monkeypatch.setattr(tiered, "_device_route", spy)
    tj.clear_caches()
    for mask, static in ((same_bounds, True), (other, False)):
        seen.clear()
        out, r = _routes(lambda: tj.sparse_attention(q, k, v, mask, backend="xla",
                                                     options=opts))
        assert r == "device" and seen == [static]
        np.testing.assert_allclose(out, tj.reference_attention(q, k, v, mask), **TOL)
        assert tiered.wait(60)
        out2, r = _routes(lambda: tj.sparse_attention(q, k, v, mask, backend="xla",
                                                      options=opts))
        assert r == "host"
        np.testing.assert_allclose(out2, out, **TOL)
    # the requests ran what precompile compiled (the packed blocks' programs): no new one
    assert executables() == compiled and len(tiered._PREPARED) == prepared


def test_the_device_routes_prepared_calls_outlive_clear_caches_but_not_a_fresh_process():
    """A tiered call keeps its device route's prepared call (static choice made once) per
    compiled key: ``clear_caches`` keeps it, as jax keeps executables; ``fresh_process=True``
    drops it (its template choice came from the ranking tables it reloads). Outputs agree
    with the reference on both sides."""
    (q, k, v), m = _qkv(), _mask(50)
    tj.sparse_attention(q, k, v, m, backend="xla", options=FIRST)
    assert tiered.wait(60)
    keys = set(tiered._PREPARED)
    assert keys
    tj.clear_caches()
    assert set(tiered._PREPARED) == keys
    out, r = _routes(lambda: tj.sparse_attention(q, k, v, _mask(51), backend="xla",
                                                 options=FIRST))
    assert r == "device" and set(tiered._PREPARED) == keys
    np.testing.assert_allclose(out, tj.reference_attention(q, k, v, _mask(51)), **TOL)
    assert tiered.wait(60)
    tj.clear_caches(fresh_process=True)
    assert not tiered._PREPARED and not keys & tiered._COMPILED    # their executables gone
    out, r = _routes(lambda: tj.sparse_attention(q, k, v, _mask(52), backend="xla",
                                                 options=FIRST))
    assert r == "device" and tiered._PREPARED
    np.testing.assert_allclose(out, tj.reference_attention(q, k, v, _mask(52)), **TOL)
    assert tiered.wait(60)


def test_evicting_a_prepared_call_forgets_its_executables():
    """Past the cap the oldest prepared call goes, and the rule's record of compiled routes
    with it (its executables are gone: a mask of that key pays a compile again); keys
    compiled without a prepared call (none today) are left alone."""
    prepared, compiled = {}, {"other"}
    for key in ("a", "b", "c"):
        tiered._remember(prepared, compiled, key, key.upper(), cap=2)
    assert prepared == {"b": "B", "c": "C"} and compiled == {"other", "b", "c"}
    tiered._remember(prepared, compiled, "d", "D", cap=1)
    assert prepared == {"d": "D"} and compiled == {"other", "d"}


def _irregular_mask(seed: int) -> tj.BlockMask:
    """Key blocks of 12 distinct sizes (clusters), query blocks as ``_mask``'s."""
    rng = np.random.default_rng(seed)
    kb = np.r_[0, np.cumsum(rng.permutation(np.arange(8, 20)))]          # 12 sizes, 162 keys
    kb = np.r_[kb[:-1], L]                                                # the last one to L
    qb = np.r_[0, np.sort(rng.choice(np.arange(1, L), N - 1, replace=False)), L]
    return tj.BlockMask(qb, kb, rng.random((H, N, len(kb) - 1)) < 0.4)


def test_auto_device_gather_reads_the_host_masks_key_bounds(monkeypatch):
    """``Options.device_gather`` "auto": a tiered call sends irregular host key bounds whose
    median blocks are <= 128 query and 64 key tokens to the device route's 64-row, 64-key
    tiles (``traced_small_blocks``, no gathering), other irregular ones as "traced" (gathered
    where the route traces them), regular ones as they are; the output agrees with the
    reference."""
    irr, reg = _irregular_mask(40), _mask(41)
    small = tiered.route_options(tj.Options(), tiered.bounds_key(irr))
    assert (small.device_gather, small.traced_small_blocks) == ("never", True)
    rng = np.random.default_rng(3)
    big_kv = np.r_[0, np.cumsum(rng.permutation(np.arange(100, 112) * 3))]   # 300-333 keys
    big = tj.BlockMask(np.r_[0, 1000, big_kv[-1]], big_kv, np.ones((1, 2, 12), bool))
    small_kv = np.r_[0, np.cumsum(rng.permutation(np.arange(8, 20)))]     # 162 keys
    mid_q = tj.BlockMask(np.r_[0, 100, 162], small_kv, np.ones((1, 2, 12), bool))  # 81
    big_q = tj.BlockMask(np.r_[0, 162], small_kv, np.ones((1, 1, 12), bool))       # 162
    kv46 = np.r_[0, np.cumsum(rng.permutation(np.arange(40, 52)))]        # median 45.5
    mid_kv = tj.BlockMask(np.arange(0, 547, 91), kv46, np.ones((1, 6, 12), bool))
    for m, dg, ts in ((big, "traced", None), (big_q, "traced", None),
                      (mid_q, "never", True), (mid_kv, "never", True)):
        o = tiered.route_options(tj.Options(), tiered.bounds_key(m))
        assert (o.device_gather, o.traced_small_blocks) == (dg, ts)
    for m, opts in ((reg, tj.Options()), (irr, tj.Options(device_gather="never")),
                    (irr, tj.Options(traced_small_blocks=False))):
        assert tiered.route_options(opts, tiered.bounds_key(m)) is opts
    seen = []
    route = tiered._device_route

    def spy(q, k, v, mask, leaves, shape, backend, scale, lse, options, key):
        seen.append((options.device_gather, options.traced_small_blocks))
        return route(q, k, v, mask, leaves, shape, backend, scale, lse, options, key)

    monkeypatch.setattr(tiered, "_device_route", spy)
    q, k, v = _qkv()
    for m, want in ((irr, ("never", True)), (reg, ("auto", None))):
        seen.clear()
        out, r = _routes(lambda: tj.sparse_attention(q, k, v, m, backend="xla", options=FIRST))
        assert r == "device" and seen == [want]
        np.testing.assert_allclose(out, tj.reference_attention(q, k, v, m), **TOL)
        assert tiered.wait(60)


def test_the_rule_sizes_a_gathering_route_without_bitmap_steps():
    """A route that gathers (Mosaic GPU, irregular keys) is sized on its fixed 128 x 128 grid
    with no bitmap steps; the device list's route of the same mask counts its capacity."""
    m = _irregular_mask(42)
    shape = check_shapes((1, L, H, 64), (1, L, H, 64), "bfloat16")
    g = tier_costs.size_of(m, shape, "mosaic_gpu", DeviceRule(1 << 27, "irregular"))
    assert g is not None and g.bitmaps == 0 and g.tiles == H * 2 * 2       # 192 rows: 2 tiles
    plain = tier_costs.size_of(m, shape, "mosaic_gpu", DeviceRule(1 << 27, "never"))
    assert plain is not None and plain.selected == g.selected and plain.bitmaps > 0

