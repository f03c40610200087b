"""The compiled kernels on this machine's GPU against the float32 reference (``make
test-gpu``): every template of the available GPU backends through the host route and each
backend's device route (shared, per-head and traced bounds), forward and backward, on fresh
random masks (``tessera_jax.tools.gpu_check``). Skipped without a GPU."""

import zlib

import jax
import numpy as np
import pytest

from tessera_jax.tools import gpu_check

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]

CASES = gpu_check.cases() if ON_GPU else []


@pytest.mark.parametrize("name,options,route,D,Hq,Hkv", CASES, ids=[c[0] for c in CASES])
def test_compiled_kernel_matches_the_reference(name, options, route, D, Hq, Hkv):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    rec = gpu_check.check_case(rng, D=D, Hq=Hq, Hkv=Hkv, route=route, options=options)
    assert rec["ok"], rec


def test_there_is_something_to_check():
    """A GPU machine runs at least one backend's kernels (else the suite checks nothing)."""
    assert CASES, "no GPU backend available on this GPU machine"
