"""The published mini reproduction (docs/results/mini/) regenerates from its committed run directories.

For every sweep copied under ``docs/results/mini/runs/`` (``python -m experiments.publish``), run
the documented command ``python -m analysis.report docs/results/mini/runs/<sweep> --out
docs/results/mini/<sweep> --no-cache --figures published`` (``--pool`` for the sweeps of
:data:`POOLED`; ``make results``) into a temporary directory and compare every table, every
figure's data (CSV) and ``report.md`` with the committed ones, byte for byte. Images are not
compared (their bytes depend on the matplotlib build); their data is.

Slow (a few tens of seconds per sweep): ``pytest -m slow tests/analysis/test_published_results.py``.
"""

import re
from pathlib import Path

import pytest

from analysis.report import PUBLISHED_FIGURES
from analysis.report import main as report_main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "mini"
#: Sweeps whose runs span several commits, reported with ``--pool`` (the Makefile's POOLED).
POOLED = {"calibration_match", "calibration_match_80", "long_body", "surge_dose"}
SWEEPS = sorted(p.name for p in (RESULTS / "runs").iterdir() if p.is_dir()) if (RESULTS / "runs").is_dir() else []

pytestmark = pytest.mark.slow


def test_the_published_sweeps_are_there():
    assert {"main_table", "entropy_granularity"} <= set(SWEEPS), f"published sweeps: {SWEEPS}"
    for s in SWEEPS:
        assert (RESULTS / s / "report.md").is_file(), f"{s}: no committed report"
        text = (RESULTS / s / "report.md").read_text(encoding="utf-8")
        for name in PUBLISHED_FIGURES:  # the figures report.md shows are committed (PNG; a split one, each image)
            images = re.findall(rf"\]\(figures/({re.escape(name)}(?:-[a-z0-9-]+)?\.png)\)", text)
            if images:
                for image in images:
                    assert (RESULTS / s / "figures" / image).is_file(), f"{s}: {image}"
            else:  # skipped for want of data (entropy_vs_bf16 of a sweep without a BF16 arm), and said so
                assert "figure skipped." in text, f"{s}: {name} neither shown nor skipped"
    main = (RESULTS / "main_table" / "report.md").read_text()
    assert all(re.search(rf"\]\(figures/{re.escape(n)}(-[a-z0-9-]+)?\.png\)", main) for n in PUBLISHED_FIGURES)
    # the slim form: no PDFs, no decoded samples, no TensorBoard event files
    heavy = [p for p in RESULTS.rglob("*") if p.suffix == ".pdf" or "samples" in p.parts
             or p.name.startswith("events.out.tfevents")]
    assert not heavy, heavy[:5]


def test_no_machine_path_in_the_published_runs():
    """``experiments.publish`` rewrote the checkout's absolute path: every published ``config.yaml``
    names a relative ``output_dir`` and SFT cache, every ``provenance.json`` a relative launcher."""
    bad = []
    for s in SWEEPS:
        for run in sorted((RESULTS / "runs" / s).iterdir()):
            for name in ("config.yaml", "provenance.json", "overrides.txt"):
                f = run / name
                if f.is_file() and re.search(r"(^|[\s\"':])/(work|tmp|home|root|Users)/", f.read_text(encoding="utf-8"),
                                             re.MULTILINE):
                    bad.append(str(f.relative_to(RESULTS)))
    assert not bad, f"{len(bad)} published files carry a machine path, e.g. {bad[:3]}"


def test_the_makefile_pools_the_same_sweeps():
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("POOLED"))
    assert set(line.split("?=")[1].split()) == POOLED


@pytest.mark.parametrize("sweep", SWEEPS)
def test_report_regenerates_from_the_committed_run_directories(sweep, tmp_path):
    out = tmp_path / sweep
    assert report_main([str(RESULTS / "runs" / sweep), "--out", str(out), "--no-cache", "--no-progress",
                        "--figures", "published", *(["--pool"] if sweep in POOLED else [])]) == 0
    committed = RESULTS / sweep
    files = sorted(p.relative_to(committed) for p in committed.rglob("*")
                   if p.is_file() and (p.suffix in (".csv", ".md", ".tex")))
    regenerated = sorted(p.relative_to(out) for p in out.rglob("*")
                         if p.is_file() and (p.suffix in (".csv", ".md", ".tex")))
    assert files == regenerated
    assert Path("report.md") in files and Path("tables/accuracy.csv") in files
    for rel in files:
        assert (out / rel).read_bytes() == (committed / rel).read_bytes(), f"{sweep}/{rel} differs"
