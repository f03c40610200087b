"""The main job (`make demo`) runs on CPU and its check passes."""

import subprocess
import sys


def test_demo_runs_and_checks():
    p = subprocess.run([sys.executable, "-m", "tessera_jax.tools.demo", "--cpu-grid", "2,8,16",
                        "--repeats", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "check vs reference_attention" in p.stdout and "(ok," in p.stdout
    assert "plan " in p.stdout and "speed-up" in p.stdout
