"""``benchmarks/aux_kernels.py --small`` on CPU: every section runs its old (Triton) and new
(Mosaic GPU) kernels under their interpreters, their outputs agree, and the summary has the
ratios the H200 run reports (issue 32, item 3)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import aux_kernels  # noqa: E402  (benchmarks/ is not a package)


def test_aux_kernels_small_run(tmp_path):
    out = tmp_path / "aux.json"
    res = aux_kernels.main(["--small", "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == res["summary"]
    s = res["summary"]
    assert s["errors"] == [] and s["outputs_agree"] is True
    for name in ("delta", "pool", "topk", "kmeans", "kmeans_kv", "kmeans_q", "builder_vsa",
                 "builder_sparge_topk"):
        assert s[f"{name}_new_over_old"] > 0, name
    assert isinstance(s["all_within_1_1"], bool)          # wall-clock ratios off a GPU
    assert res["sections"]["topk"]["check"]["identical"]
