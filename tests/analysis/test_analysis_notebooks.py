"""Execute the jupytext notebooks of analysis/notebooks headlessly against a generated sweep.

The kernel is this interpreter (``sys.executable``, i.e. the project's venv): the test writes a
kernelspec into a temporary directory and hands nbclient a KernelManager that only looks
there, so no ``ipykernel install --user`` is needed and no other Python can be picked up.
"""

import json
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "analysis" / "notebooks").glob("*.py"))
KERNEL = "fp8rl-test-venv"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    spec = d / KERNEL
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fp8rl venv", "language": "python",
    }))
    return d


def test_notebooks_found():
    assert {p.stem for p in NOTEBOOKS} == {"entropy_curves", "accuracy_table", "mechanism"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, known_sweep, kernel_dir, tmp_path):
    nb = jupytext.read(path)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "each notebook has exactly one cell tagged 'parameters'"
    params[0].source = f"SWEEP_DIR = {str(known_sweep)!r}"
    nb.cells.insert(0, jupytext.reads("import sys\nprint(sys.executable)", fmt="py:percent").cells[0])
    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)])
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)
    client = nbclient.NotebookClient(nb, km=km, timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on any failing cell
    first = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert first.strip() == sys.executable
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    kinds = {k for o in outputs for k in o.get("data", {})}
    if path.stem in ("entropy_curves", "mechanism"):
        assert "image/png" in kinds  # the figures were drawn
    if path.stem == "accuracy_table":
        assert "text/markdown" in kinds
        md = "".join(o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
        assert "FP8 tensorwise + calibrated" in md and "n/a" not in md
