"""The quick variant of the long-horizon dose sweep (issue 48), run whole as a user runs it:
``python -m experiments.launch +sweep=surge_dose_quick`` (a subprocess: 2 doses x 2 arms x 2 seeds
at scale=long, 8 steps), then ``python -m analysis.report`` on its directory. A smoke check of
the pipeline, not a result: every cell DONE at scale=long's task, every step logging the measured
dose (``actor/ratio_std``) and the held-out rows' counts, the calibrated cells their calibration
data on their calibration steps, every evaluation scored by the BF16 engine too, and the report
written. Slow tier (``-m slow``; .ci/run runs it)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("surge_quick")
    res = subprocess.run([sys.executable, "-m", "experiments.launch", "+sweep=surge_dose_quick", f"output_dir={out}",
                          "progress=false"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out / "surge_dose_quick"


def test_every_cell_ran_the_long_regimes_pipeline(quick):
    runs = sorted(p for p in quick.iterdir() if (p / "status.json").exists())
    assert len(runs) == 8, [p.name for p in runs]
    cells = {(p.name.split("-")[2], p.name.split("-")[3]) for p in runs}
    assert cells == {(f, c) for f in ("tensorwise", "nvfp4") for c in ("vanilla", "calibrated")}
    import yaml

    for run in runs:
        status = json.loads((run / "status.json").read_text())
        assert status["state"] == "DONE" and status["step"] == 8, (run.name, status)
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert (cfg["mini"]["min_terms"], cfg["mini"]["max_terms"], cfg["max_response_len"]) == (7, 9, 128)
        assert cfg["clip"]["holdout_share"] == 0.125
        assert cfg["mini"]["sft_slip_rate"] == 0.6  # the warm start that slips
        metrics = _rows(run / "metrics.jsonl")
        assert [r["step"] for r in metrics] == list(range(1, 9))
        for r in metrics:
            assert math.isfinite(r["actor/ratio_std"]) and r["actor/ratio_std"] > 0, (run.name, r["step"])
        # the held-out rows: shadowed in BF16 on every arm, never fed to a calibration
        assert any(r.get("shadow/ho_n_neg", 0) > 0 for r in metrics), run.name
        calibrated = cfg["clip"]["arm"] == "calibrated"
        logged = [r["step"] for r in metrics if "clip/n" in r]
        assert logged == ([1, 5] if calibrated else []), (run.name, logged)  # periodic, every 4 steps
        evals = _rows(run / "eval.jsonl")
        assert [e["step"] for e in evals] == [0, 4, 8]
        assert all("eval_bf16/arith/avg@k" in e for e in evals), run.name
    manifest = json.loads((quick / "manifest.json").read_text())
    assert {c["axes"]["scale"] for c in manifest["cells"]} == {"long"}


def test_the_report_reads_the_quick_sweep(quick, tmp_path):
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "analysis.report", str(quick), "--out", str(out), "--no-cache",
                          "--no-progress"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = (out / "report.md").read_text()
    from analysis.dose_report import TITLE

    assert TITLE in text  # the dose-response section: two FP doses logged actor/ratio_std
    for table in ("dose", "surge_dose", "dose_comparisons"):
        assert (out / "tables" / f"{table}.csv").exists(), table
    assert (out / "figures" / "entropy_dose.png").exists()
    dose = (out / "tables" / "dose.csv").read_text()
    assert "tensorwise" in dose and "nvfp4" in dose
