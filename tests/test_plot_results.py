"""benchmarks/plot_results.py draws the committed result files."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import plot_results  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def test_plots_of_the_result_files(tmp_path):
    names = ("h200-backward.json", "h200-loop.json", "h100-direct-store.json",
             "h200-gather.json")
    files = [os.path.join(RESULTS, f) for f in names]
    out = plot_results.main(files + ["--out-dir", str(tmp_path)])
    assert [os.path.basename(p) for p in out] == [n.replace(".json", ".png") for n in names]
    assert all(os.path.getsize(p) > 10_000 for p in out)


def test_an_unknown_file_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a backward"):
        plot_results.main([str(bad)])
