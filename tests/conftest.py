import faulthandler
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM at -O0 without its expensive passes: XLA:CPU compiles (most of this suite's time: each
# interpreted kernel and planner program is compiled once and run on small inputs) ~1.7x
# faster (test_bitmap_words_do_not_depend_on_the_pass_size 67 -> 40 s on the 2-core box).
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
# XLA:CPU sizes its thread pools (the intra-op "XLAEigen" pool the thunk executor runs work on,
# and the client's pool) to the core count: 2 threads on a 2-core CI box. The Mosaic GPU
# interpreter (jax._src.pallas.mosaic_gpu.interpret) runs each simulated warpgroup as its own
# jitted computation from a Python thread (mosaic/interpret/thread_map.py), and its host
# callbacks block while they wait: the thread_map callback on its futures, each warpgroup on
# its barriers. Those callbacks can sit on pool threads, and a warpgroup whose computation is
# queued behind them never starts: with 3 warpgroups (2 consumers + the producer) and the
# launching callback itself on a pool thread, a pool of 2 deadlocks (seen in
# test_mosaic_kernel_runs_a_device_plan and test_mosaic_backward_paired_dq_and_device_route
# under `pytest -n 2`; PJRT_NPROC=1 deadlocks every run). A pool far above the number of
# threads one interpreted kernel can block removes the deadlock; the threads are idle
# otherwise (multi-threaded Eigen is off above). Read when jax creates its CPU client.
os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
settings.register_profile("ci", deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A hang guard for every test (no plugin needed): past the limit, faulthandler prints every
# thread's stack to the real stderr and ends the process, so a deadlock is a failure naming
# the test (under xdist: "worker crashed while running <test>", and a fresh worker carries
# on) instead of a CI job stuck until its own timeout. A test may set its own limit with
# @pytest.mark.hang_limit(seconds); TESSERA_TEST_HANG_LIMIT sets the default (0: off).
HANG_LIMIT_S = float(os.environ.get("TESSERA_TEST_HANG_LIMIT", "600"))
_STDERR_FD = None


def pytest_configure(config):
    global _STDERR_FD
    config.addinivalue_line("markers", "hang_limit(seconds): this test's hang guard (conftest)")
    if _STDERR_FD is None:
        try:        # pytest's capture is suspended here: fd 2 is the real stderr
            _STDERR_FD = os.dup(sys.__stderr__.fileno())
        except (AttributeError, OSError, ValueError):
            _STDERR_FD = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("hang_limit")
    limit = float(mark.args[0]) if mark else HANG_LIMIT_S
    if limit > 0 and _STDERR_FD is not None:
        faulthandler.dump_traceback_later(limit, exit=True, file=_STDERR_FD)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    else:
        yield
