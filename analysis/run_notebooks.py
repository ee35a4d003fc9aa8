"""Execute the analysis notebooks headless: ``python -m analysis.run_notebooks [--sweep DIR]``.

Every jupytext notebook of ``analysis/notebooks/`` is read, its cell tagged ``parameters`` set
to ``SWEEP_DIR = <DIR>`` (default: the published ``docs/results/mini/runs/entropy_granularity``),
and run top to bottom with nbclient on a kernel that is this interpreter (a kernelspec written
into a temporary directory, so no ``ipykernel install`` is needed and no other Python can be
picked up). Any cell error stops the run with exit code 1 and the cell's traceback; with
``--out DIR`` the executed notebooks are written there as ``.ipynb`` (outputs included).
``make notebooks`` runs it; CI runs ``make notebooks`` after ``make test``.

Needs the ``dev`` (or ``analysis``) extra: nbclient, nbformat, ipykernel, jupytext.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "analysis" / "notebooks"
DEFAULT_SWEEP = REPO / "docs" / "results" / "mini" / "runs" / "entropy_granularity"
KERNEL = "fp8rl-analysis"


def notebooks(directory: str | Path = NOTEBOOK_DIR) -> list[Path]:
    """The jupytext (percent format) notebooks of ``directory``, sorted."""
    return sorted(Path(directory).glob("*.py"))


def write_kernelspec(directory: str | Path, python: str = sys.executable) -> Path:
    """A kernelspec named :data:`KERNEL` under ``directory`` that starts ``python``."""
    spec = Path(directory) / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fp8rl (this interpreter)", "language": "python",
    }))
    return Path(directory)


def execute(path: str | Path, sweep_dir: str | Path | None, kernel_dir: str | Path, *,
            cwd: str | Path, timeout: int = 300):
    """Run one notebook with ``SWEEP_DIR`` set; returns the executed ``nbformat`` notebook.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first failing cell and
    ``ValueError`` when the notebook has no single cell tagged ``parameters``.
    """
    import jupytext
    import nbclient
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    nb = jupytext.read(path)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    if len(params) != 1:
        raise ValueError(f"{path}: {len(params)} cells tagged 'parameters' (need exactly one)")
    if sweep_dir is not None:
        params[0].source = f"SWEEP_DIR = {str(Path(sweep_dir).resolve())!r}"
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = nbclient.NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.run_notebooks", description=__doc__.splitlines()[0])
    p.add_argument("--sweep", type=Path, default=DEFAULT_SWEEP,
                   help="sweep directory every notebook reads (default: %(default)s)")
    p.add_argument("--notebooks", type=Path, default=NOTEBOOK_DIR, help="directory of the notebooks")
    p.add_argument("--out", type=Path, default=None, help="write the executed notebooks here (.ipynb)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = p.parse_args(argv)
    import nbformat
    from nbclient.exceptions import CellExecutionError

    paths = notebooks(args.notebooks)
    if not paths:
        print(f"no notebooks in {args.notebooks}", file=sys.stderr)
        return 2
    if not args.sweep.is_dir():
        print(f"sweep directory {args.sweep} does not exist", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        kernels = write_kernelspec(Path(tmp) / "kernels")
        for path in paths:
            t0 = time.perf_counter()
            try:
                nb = execute(path, args.sweep, kernels, cwd=tmp, timeout=args.timeout)
            except (CellExecutionError, ValueError) as e:
                failed += 1
                print(f"FAILED {path.name}:\n{e}", file=sys.stderr)
                continue
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                nbformat.write(nb, args.out / f"{path.stem}.ipynb")
            print(f"ok {path.name} ({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
