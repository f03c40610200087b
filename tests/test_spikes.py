"""The prepared GPU spikes still apply to the kernel they patch (a spike that fails on the GPU
machine costs a machine start): each cross-lowers for CUDA on this CPU machine."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SPIKES = os.path.join(os.path.dirname(HERE), "benchmarks", "spikes")


def test_multicast_spike_patches_and_lowers(monkeypatch, capsys):
    monkeypatch.syspath_prepend(SPIKES)
    import multicast_pairs

    monkeypatch.setattr(sys, "argv", ["multicast_pairs", "--lower-only", "--L", "512",
                                      "--heads", "2"])
    try:
        multicast_pairs.main()
    except Exception as e:  # pragma: no cover - depends on the installed jaxlib
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"no CUDA lowering in this jaxlib: {e}")
        raise
    out = capsys.readouterr().out
    assert out.count('"lowered": true') == 6, out
    # Every patch applies exactly once, and the patched kernel uses clusters.
    src = open(os.path.join(os.path.dirname(HERE), "pallas_kernels", "mosaic",
                            "kernel.py")).read()
    for old, _ in multicast_pairs.PATCHES:
        assert src.count(old) == 1
