"""The one timing module (tessera_jax.tools.timing): the rule, the statistic, the CUPTI path with
a fake collector, the same-rule check, and that the benchmarks time through it (CPU, no torch)."""

import ast
import pathlib
import sys

import numpy as np
import pytest

from tessera_jax.tools import timing as T

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_rule_validates_its_fields():
    assert T.KERNEL_RULE == T.TimingRule("cupti", "flush", 3, 20, "median")
    assert T.KERNEL_RULE.name == "cupti/l2=flush/warmup=3/n=20/median"
    for bad in (dict(timer="nvtx"), dict(l2="warm"), dict(stat="p90"), dict(warmup=-1),
                dict(repeats=0), dict(repeats=19)):       # GPU timings: median of >= 20 runs
        with pytest.raises(ValueError):
            T.TimingRule(**bad)
    with pytest.raises(TypeError):
        T.TimingRule(repeats=20.0)
    assert T.wall_rule(3).repeats == 3                    # host clock: fewer runs allowed
    with pytest.raises(ValueError, match="wall clock"):
        T.time_request(lambda: None, rule=T.KERNEL_RULE)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_median_of_timed_calls_after_warmup_rotating_inputs(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(T, "_clock", clock)
    durations = iter([9.0, 9.0, 0.004, 0.001, 0.003, 0.002, 0.050])   # seconds per call
    seen = []

    def fn(i):
        seen.append(i)
        clock.t += next(durations)
        return i

    t = T.time_kernel(fn, [(0,), (1,)], rule=T.wall_rule(5, warmup=2, l2="rotate"))
    assert seen == [0, 1, 0, 1, 0, 1, 0]                  # warm-up calls 0, 1, then 2..6
    assert t.samples == pytest.approx((4.0, 1.0, 3.0, 2.0, 50.0))       # ms, warm-up dropped
    assert t.ms == pytest.approx(3.0) and t.timer == "wall" and t.note is None
    assert t.to_json("kernel_")["kernel_rule"] == "wall/l2=rotate/warmup=2/n=5/median"
    with pytest.raises(ValueError, match="rotate"):
        T.time_kernel(fn, [(0,)], rule=T.wall_rule(5, l2="rotate"))
    assert T.Timing.from_samples([5, 1, 2], T.wall_rule(3).replace(stat="min")).ms == 1.0


def test_request_timing_runs_before_each_call_and_counts_gc(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(T, "_clock", clock)
    log = []

    def fn():
        log.append("call")
        clock.t += 0.002

    t = T.time_request(fn, rule=T.REQUEST_RULE.replace(repeats=3), before=lambda: log.append("b"))
    assert log == ["b", "call"] * 4                       # 1 warm-up + 3 timed, each reset
    assert t.samples == pytest.approx((2.0, 2.0, 2.0)) and t.gc_ms == (0.0, 0.0, 0.0)


class FakeGpu:
    """A device that records what happens and when the CUPTI window is open."""
    name, gpu = "jax", True

    def __init__(self, ext):
        self.ext, self.events = ext, []

    def sync(self, out):
        self.events.append("sync")

    def idle(self):
        pass

    def flush(self):
        assert not self.ext.open, "the L2 flush must stay outside the CUPTI window"
        self.events.append("flush")


class FakeCupti:
    def __init__(self, fail_init=False):
        self.open, self.pending, self.finalized, self.fail_init = False, [], [], fail_init

    def _cupti_init(self):
        if self.fail_init:
            raise RuntimeError("another subscriber is active")
        self.open = True

    def _cupti_get_timings(self, finalize):
        self.open = False
        self.finalized.append(finalize)
        out, self.pending = self.pending, []
        return out


def test_cupti_sums_each_calls_kernels_with_flush_outside_the_window(monkeypatch):
    ext = FakeCupti()
    dev = FakeGpu(ext)
    monkeypatch.setattr(T, "_device", lambda framework: dev)
    monkeypatch.setattr(T, "_cupti_ext", lambda: ext)
    monkeypatch.setitem(T._CUPTI, "broken", None)
    n = iter(range(100))

    def fn():
        i = next(n)
        if ext.open:                                      # a gather and a kernel per call
            ext.pending += [("gather", 0.01), ("attn", 1.0 + i)]

    t = T.time_kernel(fn, rule=T.KERNEL_RULE, framework="torch")
    assert t.samples == pytest.approx([1.01 + i for i in range(3, 23)])
    assert t.ms == pytest.approx(np.median([1.01 + i for i in range(3, 23)]))
    assert t.rule == T.KERNEL_RULE and t.framework == "torch"
    assert dev.events.count("flush") == 20
    assert ext.finalized == [False] * 19 + [True]        # CUPTI detached after the last call

    # CUPTI cannot attach: host clock, and the Timing says so; mixing it with the CUPTI time
    # of another system fails the comparison.
    bad = FakeCupti(fail_init=True)
    monkeypatch.setattr(T, "_cupti_ext", lambda: bad)
    dev.ext = bad
    w = T.time_kernel(fn, rule=T.KERNEL_RULE)
    assert w.timer == "wall" and "another subscriber" in w.note and len(w.samples) == 20
    with pytest.raises(T.MixedRulesError):
        T.assert_same_rule([t, w])


def test_assert_same_rule():
    a = T.Timing.from_samples([1.0], T.wall_rule(1))
    assert T.assert_same_rule([a, a.to_json(), {"ms": 1.0}, None, a.rule.name]) == a.rule.name
    assert T.assert_same_rule([]) is None
    with pytest.raises(T.MixedRulesError, match="peers"):
        T.assert_same_rule([T.KERNEL_RULE, {"rule": a.rule.name}], "peers")


def test_jax_on_cpu_falls_back_to_wall_clock():
    import jax
    import jax.numpy as jnp
    if jax.default_backend() == "gpu":
        pytest.skip("CPU fallback")
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    x = jnp.ones((64, 64), jnp.float32)
    t = T.time_kernel(f, [(x,)])                          # the kernel rule, off the GPU
    assert t.rule == T.KERNEL_RULE.replace(timer="wall", l2="none")
    assert len(t.samples) == 20 and t.ms > 0 and "no GPU" in t.note
    with pytest.raises(RuntimeError, match="no GPU"):
        T.time_kernel(f, [(x,)], fallback=False)
    with pytest.raises(ValueError, match="torch only"):
        T.time_kernel(f, [(x,)], rule=T.KERNEL_RULE.replace(timer="events"))


# Device timers (CUPTI's collector, CUDA events, triton's do_bench, jax's profiler) and wall-clock
# loops belong to tessera_jax/tools/timing.py alone.
_TIMER_NAMES = {"_cupti_init", "_cupti_get_timings", "Event", "elapsed_time", "do_bench",
                "measure"}


@pytest.mark.parametrize("path", ["benchmarks/kernels.py", "benchmarks/peers.py",
                                  "benchmarks/peers_lib/timing.py", "benchmarks/selection.py",
                                  "benchmarks/request_breakdown.py", "benchmarks/xla_path.py",
                                  "tessera_jax/tools/demo.py", "benchmarks/bench_loop.py",
                                  "tessera_jax/tools/profiler.py"])
def test_benchmarks_time_through_the_module(path):
    tree = ast.parse((ROOT / path).read_text())
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & _TIMER_NAMES, f"{path} touches a timer itself: {attrs & _TIMER_NAMES}"
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module == "tessera_jax.tools" for a in n.names}
    imports |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "timing" in imports or "tessera_jax.tools.timing" in imports, path


def test_kernels_benchmark_checks_one_rule_and_keeps_its_sta_mask():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernels as K
    assert K.RULE is T.KERNEL_RULE
    ok = {"dense": {"wan480": {"cudnn_bf16": {"rule": "a"}, "paired": {"rules": ["a"]}}},
          "sparse": {"wan480": [{"kernels": {"t": {"rule": "a"}}, "flex": {"rule": "a"}}]}}
    assert K.timing_rule(ok) == "a"
    ok["sparse"]["wan480"][0]["flex"]["rule"] = "b"        # FlexAttention under another rule
    with pytest.raises(T.MixedRulesError):
        K.timing_rule(ok)
    # mask_sta is now tessera_jax.masks.sta: the same mask as the official run's own generator.
    for grid in ((21, 30, 52), (6, 18, 36)):
        b, xyz, G = K.cube_layout(grid)
        keep = np.ones((len(xyz), len(xyz)), bool)
        for a, w in enumerate((3, 3, 5)):
            half = w // 2
            qc = np.clip(xyz[:, a], half, max(G[a] - 1 - half, half))
            keep &= np.abs(qc[:, None] - xyz[None, :, a]) <= half
        m = K.mask_sta(grid)
        assert np.array_equal(m.q_bounds, b) and np.array_equal(m.kv_bounds, b)
        assert np.array_equal(m.blocks, keep[None])
