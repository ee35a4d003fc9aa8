"""Execute the jupytext notebooks of analysis/notebooks headlessly against a generated sweep,
through the runner that ``make notebooks`` uses (``analysis.run_notebooks``).

The kernel is this interpreter (``sys.executable``, i.e. the project's venv): the runner writes a
kernelspec into a temporary directory and hands nbclient a KernelManager that only looks
there, so no ``ipykernel install --user`` is needed and no other Python can be picked up.
"""


import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from analysis.run_notebooks import execute, main, notebooks, write_kernelspec  # noqa: E402

NOTEBOOKS = notebooks()


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return write_kernelspec(tmp_path_factory.mktemp("kernels"))


def test_notebooks_found():
    assert {p.stem for p in NOTEBOOKS} == {"entropy_curves", "accuracy_table", "mechanism"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, known_sweep, kernel_dir, tmp_path):
    nb = execute(path, known_sweep, kernel_dir, cwd=tmp_path, timeout=120)  # raises on any failing cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code if c.source.strip()), "every code cell ran"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert params[0].source == f"SWEEP_DIR = {str(known_sweep.resolve())!r}"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    kinds = {k for o in outputs for k in o.get("data", {})}
    if path.stem in ("entropy_curves", "mechanism"):
        assert "image/png" in kinds  # the figures were drawn
    if path.stem == "accuracy_table":
        assert "text/markdown" in kinds
        md = "".join(o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
        assert "FP8 tensorwise + calibrated" in md and "n/a" not in md


def test_runner_fails_on_a_cell_error(tmp_path, known_sweep, capsys):
    """``make notebooks`` must fail when a notebook breaks: a cell raising is exit code 1."""
    d = tmp_path / "nbs"
    d.mkdir()
    (d / "ok.py").write_text('# %% tags=["parameters"]\nSWEEP_DIR = None\n\n# %%\nprint(SWEEP_DIR)\n')
    (d / "broken.py").write_text('# %% tags=["parameters"]\nSWEEP_DIR = None\n\n# %%\n'
                                 'raise RuntimeError("planted failure")\n')
    assert main(["--sweep", str(known_sweep), "--notebooks", str(d), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "FAILED broken.py" in err and "planted failure" in err
    assert (tmp_path / "out" / "ok.ipynb").is_file() and not (tmp_path / "out" / "broken.ipynb").exists()
    (d / "broken.py").unlink()
    assert main(["--sweep", str(known_sweep), "--notebooks", str(d)]) == 0
    assert main(["--sweep", str(tmp_path / "nope"), "--notebooks", str(d)]) == 2
