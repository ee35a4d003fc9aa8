"""``analysis.report`` on any set of sweep directories a user can name, and on damaged cells
(issue 50, robustness round three; the report side).

Real run directories (``fp8rl.runs.synthetic``: the backends' own writers), damaged the way a
disk or a person damages them, reported with the real command line (``analysis.report.main``;
the user errors also as a real process, to see that nothing but one line reaches the terminal).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.collect import collect
from analysis.damage import metrics_damage
from analysis.report import main
from fp8rl.runs.synthetic import RunSpec, make_sweep

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
ARGS = ["--no-progress", "--no-cache", "--figures", "entropy,entropy_vs_bf16"]


def _sweep(path: Path, name: str = "quick") -> Path:
    specs = [RunSpec(fp8=f, clip="vanilla", seed=s, steps=STEPS, eval={"aime24": 0.3}, eval_every=10)
             for f in ("bf16", "tensorwise") for s in (0, 1)]
    make_sweep(path, specs, sweep=name, fast=True)
    return path


def _runs(sweep: Path) -> list[Path]:
    return sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))


def _provenance(run: Path, flags) -> None:
    (run / "provenance.json").write_text(json.dumps(
        {"git": {"sha": "a" * 40, "dirty": False}, "device": "cpu x1", "cpu": {"model": "Some CPU", "flags": flags}}))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return _sweep(tmp_path_factory.mktemp("template") / "quick")


@pytest.fixture
def sweep(template, tmp_path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "runs" / "quick"))


# --- item 2: one sweep given twice, a sweep and its copy, one sweep from two machines ----------------


def test_one_sweep_given_twice_is_reported_once(sweep, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main([str(sweep), str(sweep), "--out", str(out), *ARGS]) == 0, capsys.readouterr().err
    cells = pd.read_csv(out / "tables" / "cells.csv")
    assert len(cells) == 4 and cells["run"].is_unique
    assert "given twice; read once" in (out / "report.md").read_text()


@pytest.mark.parametrize("machines", [False, True], ids=["copy", "two-machines"])
def test_a_sweep_and_its_copy_are_refused_then_separate_and_pool_both_work(sweep, tmp_path, capsys, machines):
    copy = Path(shutil.copytree(sweep, tmp_path / "other" / "quick"))
    if machines:  # the same sweep run on two machines: other CPU numerics
        for r in _runs(sweep):
            _provenance(r, ["avx2", "fma"])
        for r in _runs(copy):
            _provenance(r, ["avx2", "fma", "avx512f"])
    out = tmp_path / "rep"
    assert main([str(sweep), str(copy), "--out", str(out), *ARGS]) == 3
    err = capsys.readouterr().err
    assert "refusing to pool runs of 2 groups" in err and "runs/quick ·" in err and "other/quick ·" in err, err
    assert main([str(sweep), str(copy), "--out", str(out), *ARGS, "--separate"]) == 0, capsys.readouterr().err
    reports = sorted(out.glob("*/report.md"))
    assert [p.parent.name.split("-")[0] for p in reports] == ["other_quick", "runs_quick"], reports
    for rep in reports:
        cells = pd.read_csv(rep.parent / "tables" / "cells.csv")
        assert len(cells) == 4 and set(cells["cell"]) == {"ok"}, cells
    assert main([str(sweep), str(copy), "--out", str(tmp_path / "pooled"), *ARGS, "--pool"]) == 0
    cells = pd.read_csv(tmp_path / "pooled" / "tables" / "cells.csv")
    assert len(cells) == 8 and cells["run"].is_unique
    assert set(cells["sweep"]) == {"runs/quick", "other/quick"}
    # the paired figure pairs each run with the BF16 run of its own directory
    fig = pd.read_csv(tmp_path / "pooled" / "figures" / "entropy_vs_bf16.csv")
    assert set(fig["n_seeds"]) == {4}


# --- item 4: a damaged provenance.json or config.yaml in one cell ------------------------------------


@pytest.mark.parametrize(("name", "content"), [("provenance.json", b'{"git": {"sha": '),
                                               ("provenance.json", b"\xff\xfe"),
                                               ("config.yaml", b"a: [\n"),
                                               ("config.yaml", b"- a list\n")],
                         ids=["provenance-cut", "provenance-not-utf8", "config-not-yaml", "config-a-list"])
def test_a_damaged_provenance_or_config_is_listed_and_the_rest_reported(sweep, tmp_path, capsys, name, content):
    for r in _runs(sweep):
        _provenance(r, ["avx2", "fma"])
    bad = _runs(sweep)[1]
    (bad / name).write_bytes(content)
    out = tmp_path / "rep"
    assert main([str(sweep), "--out", str(out), *ARGS]) == 0, capsys.readouterr().err  # not refused as 2 groups
    cells = pd.read_csv(out / "tables" / "cells.csv").set_index("run")
    assert cells.loc[bad.name, "cell"] == "damaged"
    assert (cells.drop(index=bad.name)["cell"] == "ok").all()
    reason = cells.loc[bad.name, "reason"]
    assert reason.startswith(f"{name} unreadable (")
    assert "delete it and relaunch" in reason and "keeping the rest of its run directory" in reason  # the launcher's fix
    text = (out / "report.md").read_text()
    row = next(ln for ln in text.splitlines() if bad.name in ln and "| damaged |" in ln)
    assert name in row
    assert "All 3 runs come from one sweep, one commit and one CPU" in text
    # written from the rest: the damaged cell's steps are in no figure
    fig = pd.read_csv(out / "figures" / "entropy.csv")
    assert set(fig.loc[fig["kind"] == "line", "n_seeds"]) == {1, 2}


# --- item 5: a finished cell whose metrics.jsonl is missing or short -------------------------------


@pytest.mark.parametrize("damage", ["deleted", "emptied", "cut"])
def test_a_done_cell_with_missing_or_short_metrics_is_damaged(sweep, tmp_path, capsys, damage):
    bad = _runs(sweep)[2]
    metrics = bad / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    if damage == "deleted":
        metrics.unlink()
    else:
        metrics.write_bytes(b"" if damage == "emptied" else b"".join(lines[: len(lines) // 2]))
    out = tmp_path / "rep"
    assert main([str(sweep), "--out", str(out), *ARGS]) == 0, capsys.readouterr().err
    cells = pd.read_csv(out / "tables" / "cells.csv").set_index("run")
    assert cells.loc[bad.name, "cell"] == "damaged", cells.loc[bad.name].to_dict()
    reason = cells.loc[bad.name, "reason"]
    done = STEPS - 1
    want = {"deleted": f"metrics.jsonl missing, but status.json says the run finished {done} step(s)",
            "emptied": f"metrics.jsonl holds 0 of the {done} step rows",
            "cut": f"metrics.jsonl holds {len(lines) // 2 - 1} of the {done} step rows"}[damage]
    assert reason.startswith(want), reason
    assert "restore metrics.jsonl from a copy" in reason
    text = (out / "report.md").read_text()
    assert "1 cells are missing, failed, damaged or incomplete" in text
    assert next(ln for ln in text.splitlines() if bad.name in ln and "| damaged |" in ln)
    surges = pd.read_csv(out / "tables" / "surges.csv")
    assert bad.name not in set(surges["run"])  # left out, and named above


def test_metrics_damage_is_a_pure_rule():
    assert metrics_damage("DONE", 19, True, list(range(1, 20))) is None
    assert metrics_damage("RUNNING", 19, False, []) is None  # not finished: not damage
    assert metrics_damage("DONE", None, False, []) is None  # nothing says how far it went
    assert metrics_damage("DONE", 19, True, list(range(1, 19))).startswith("metrics.jsonl holds 18 of the 19")
    # a row lost in the middle is damage too: the launcher's rule (fp8rl.runs.rundir.missing_step_rows)
    assert metrics_damage("DONE", 19, True, [s for s in range(1, 20) if s != 7]).startswith("metrics.jsonl holds 18")


def test_collect_keeps_a_damaged_cell_out_of_steps_and_evals(sweep):
    bad = _runs(sweep)[0]
    (bad / "metrics.jsonl").unlink()
    coll = collect(sweep)
    assert bad.name not in set(coll.steps["run"].astype(str))
    assert bad.name not in set(coll.evals["run"].astype(str))
    assert coll.problems.set_index("run").loc[bad.name, "cell"] == "damaged"


# --- item 6: every mistake a user can make is one line naming the value and the fix ------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis.report", *args, "--no-progress"], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_user_mistakes_are_one_line_each(sweep, tmp_path):
    root = sweep.parent  # runs/
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    cases = {
        "runs/quik": ("sweep directory runs/quik does not exist (did you mean runs/quick?)", "manifest.json"),
        str(tmp_path / "afile"): ("is a file, not a sweep directory", "manifest.json"),
        str(tmp_path / "empty"): ("no run directories or manifest cells found", "launch the sweep first"),
        str(_runs(sweep)[0]): ("is a run directory, not a sweep directory", f"analysis.report {sweep}"),
        "runs": ("holds sweeps, not run directories", "analysis.report runs/quick"),
    }
    for arg, (what, fix) in cases.items():
        proc = _cli(arg, "--out", str(tmp_path / "out"), cwd=root.parent)
        assert proc.returncode == 2, (arg, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (arg, proc.stderr)
        assert what in lines[0] and fix in lines[0], (arg, lines[0])
        assert not (tmp_path / "out").exists(), arg  # nothing written
    proc = _cli(str(sweep), "--figures", "entropy,entrpy", "--out", str(tmp_path / "out"), cwd=tmp_path)
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "unknown figure 'entrpy' (did you mean entropy?)" in line, line
