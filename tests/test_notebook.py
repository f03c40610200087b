"""notebooks/explore_tile_plans.ipynb runs top to bottom (nbclient, CPU)."""

import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "explore_tile_plans.ipynb"


@pytest.mark.slow
def test_explore_tile_plans_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel is this interpreter (the test venv): ipykernel's native spec points at it.
    from ipykernel.kernelspec import write_kernel_spec
    spec_dir = write_kernel_spec(str(tmp_path / "kernels" / "tessera-test"))
    spec = json.loads(pathlib.Path(spec_dir, "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable      # the notebook runs in this venv
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "JAX_PLATFORMS")}
    os.environ["JUPYTER_PATH"] = str(tmp_path)       # the kernel inherits this environment
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        client = nbclient.NotebookClient(nb, timeout=600, kernel_name="tessera-test",
                                         resources={"metadata": {"path": str(NOTEBOOK.parent)}})
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    images = sum(1 for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.get("outputs", []) if "image/png" in out.get("data", {}))
    assert images >= 5, f"expected the policy figures, got {images} images"
    text = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))
    assert "max |out - ref|" in text and "keep" in text and "split" in text
