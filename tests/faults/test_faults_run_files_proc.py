"""Damaged files a relaunch meets that the digests of checkpoints did not cover (issue 50, round three).

A real two-cell sweep (``+sweep=smoke fp8=bf16 clip=vanilla,calibrated``: 4 steps, a checkpoint
after every step) is launched once per module and kept as a template; each test copies it back
in place, damages one real file, relaunches with the real command (``python -m
experiments.launch``, a subprocess), follows the fix the message prints where there is one, and
compares the cell with the template's uninterrupted run of this machine (never fixed numbers):

- one flipped bit in a digit of ``eval/arith/avg@k`` inside the shared step-0 evaluation cache
  (``<cache>/<key>/eval0-*.json``): a cell reading it used to reach DONE with that number as its
  step-0 evaluation and in ``summary.json``; now the entry's digest refuses it, one line in the
  cell's ``run.log`` says so, and the cell recomputes it: it ends equal to the reference;
- ``provenance.json`` holding ``[]`` (or a field of another type), ``config.yaml`` not YAML:
  the cell is FAILED naming the file and the fix (delete that file, not the run directory), its
  ``run.log`` holds one traceback (marking it FAILED used to read the file again and chain a
  second); done as it says, the cell resumes from its checkpoint and ends equal to the reference;
- a finished cell whose ``metrics.jsonl`` is deleted or cut: ``experiments.status`` shows it
  DAMAGED (it showed ``DONE 4/4 - -``), the launcher refuses it naming the file and the fix
  (it skipped it as DONE); done as it says, the cell runs again and ends equal to the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.runs import RunDir

REPO = Path(__file__).resolve().parents[2]
CELLS = ["+sweep=smoke", "fp8=bf16", "clip=vanilla,calibrated", "workers=1", "progress=false"]
AVG = "eval/arith/avg@k"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _launch(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.launch", *CELLS, f"output_dir={out}"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)


def _no_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _outcome(run: Path) -> dict:
    """What a run computed: metrics, evaluations and summary, without timings and cache hits."""
    rd = RunDir(run)
    summary = {k: v for k, v in (rd.summary() or {}).items()
               if not k.startswith("perf/") and k not in ("wall_s", "sft")}
    return {"metrics": _no_perf(rd.read_metrics()), "eval": rd.read_eval(), "summary": summary}


def _cell(out: Path, clip: str) -> Path:
    (run,) = [p for p in (out / "smoke").iterdir() if p.is_dir() and f"-{clip}-" in p.name]
    return run


def _last_attempt(run: Path) -> str:
    return (run / "run.log").read_text(encoding="utf-8").rsplit("=== attempt", 1)[1]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """``(output dir, template copy, {clip: reference outcome})``: the launched sweep, DONE."""
    root = tmp_path_factory.mktemp("runfiles")
    out = root / "runs"
    proc = _launch(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = {clip: _outcome(_cell(out, clip)) for clip in ("vanilla", "calibrated")}
    shutil.copytree(out, root / "template", symlinks=True)
    return out, root / "template", ref


@pytest.fixture
def sweep(template):
    """``(output dir, {clip: reference})``: a fresh copy of the template in place."""
    out, tpl, ref = template
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tpl, out, symlinks=True)
    return out, ref


# --- the shared step-0 evaluation cache ---------------------------------------------------------


def _flip_a_digit(path: Path, key: str) -> None:
    """Flip the lowest bit of the last digit of ``key``'s number in the JSON file ``path``, in
    place, as a disk would ('0' <-> '1', '4' <-> '5', ...): the file stays valid JSON."""
    data = bytearray(path.read_bytes())
    at = data.index(f'"{key}": '.encode()) + len(key) + 4
    while chr(data[at]) in "0123456789.-eE+":
        at += 1
    data[at - 1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_digit_in_the_step0_cache_is_recomputed_and_the_cell_ends_as_before(sweep):
    out, ref = sweep
    (entry,) = (out / ".cache" / "sft").glob("*/eval0-*.json")  # the BF16 engine's, read by both cells
    whole = entry.read_bytes()
    before = json.loads(whole)["row"][AVG]
    _flip_a_digit(entry, AVG)
    assert json.loads(entry.read_bytes())["row"][AVG] != before  # one flipped bit, still JSON
    run = _cell(out, "calibrated")
    shutil.rmtree(run)  # the cell runs again from scratch, reading the entry at step 0
    proc = _launch(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "run.log").read_text(encoding="utf-8")
    assert f"{entry}: the step-0 evaluation cache entry is damaged" in log, log[-3000:]
    assert "digest" in log and "computing it again" in log, log[-3000:]
    got = _outcome(run)
    assert got["eval"][0] == ref["calibrated"]["eval"][0]  # the step-0 evaluation
    assert got["summary"][f"{AVG}/initial"] == ref["calibrated"]["summary"][f"{AVG}/initial"]
    assert got == ref["calibrated"]
    assert entry.read_bytes() == whole  # written again, whole


def test_a_step0_entry_is_refused_unless_whole_and_its_own(tmp_path, capfd):
    """The loader alone: not JSON, a list, another spec, no digest, a changed row: each is named
    with a line and computed again; a whole entry is read without computing."""
    from fp8rl.backends.mini.evaluate import cached_evaluation

    spec, row = {"seed": 1, "k": 2}, {AVG: 0.25, "step": 0}
    calls = []

    def compute():
        calls.append(1)
        return dict(row)

    assert cached_evaluation(tmp_path, spec, compute) == row and len(calls) == 1
    (entry,) = tmp_path.glob("eval0-*.json")
    whole = entry.read_text()
    assert cached_evaluation(tmp_path, spec, compute) == row and len(calls) == 1  # read, not computed
    assert capfd.readouterr().err == ""
    good = json.loads(whole)
    damages = {"not JSON": whole[: len(whole) // 2], "a list": "[1, 2]",
               "another spec": json.dumps({**good, "spec": {"seed": 2, "k": 2}}),
               "no digest": json.dumps({"spec": spec, "row": row}),
               "a changed row": whole.replace("0.25", "0.35")}
    for n, (name, text) in enumerate(damages.items(), start=2):
        entry.write_text(text)
        assert cached_evaluation(tmp_path, spec, compute) == row, name
        assert len(calls) == n, name
        err = capfd.readouterr().err
        assert f"{entry}: the step-0 evaluation cache entry is damaged" in err and "computing it again" in err, name
        assert entry.read_text() == whole, name


# --- provenance.json and config.yaml --------------------------------------------------------------


DAMAGES = {
    "provenance-a-list": ("provenance.json", "[]", "holds a list"),
    "provenance-a-field": ("provenance.json", json.dumps({"argv": "python", "previous_attempts": []}),
                           "its field argv holds a string, not a list"),
    "config-not-yaml": ("config.yaml", "steps: [4\n", "not YAML"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_provenance_or_config_is_named_and_deleting_that_file_resumes(sweep, damage):
    out, ref = sweep
    name, content, why = DAMAGES[damage]
    run = _cell(out, "vanilla")
    RunDir(run).set_status("PREEMPTED", 3, "stopped")  # the checkpoint holds step 3: a relaunch resumes
    path = run / name
    original = path.read_bytes()
    path.write_text(content)
    proc = _launch(out)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    line = next(ln for ln in text.splitlines() if run.name in ln and "FAILED" not in ln.split(run.name)[0][-3:]
                and str(path) in ln)
    assert f"{path} is damaged" in line and why in line, line
    assert "delete it and relaunch" in line and "delete the run directory" not in line, line
    assert "TypeError" not in text, text[-3000:]
    log = _last_attempt(run)
    assert "During handling of the above exception" not in log, log  # marking it FAILED read it again
    if name == "provenance.json":  # its own check, no parser's exception beneath it
        assert log.count("Traceback (most recent call last)") == 1, log
    assert RunDir(run).state == "FAILED"
    path.unlink()  # what the message says
    again = _launch(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert RunDir(run).state == "DONE"
    assert _outcome(run) == ref["vanilla"]  # resumed from the checkpoint: every step once, the same numbers
    if name == "config.yaml":
        assert path.read_bytes() == original  # written again, the same config
    else:
        assert json.loads(path.read_text())["previous_attempts"] == []  # a fresh record


# --- a finished cell without its metrics ----------------------------------------------------------


def _status(sweep_dir: Path, capsys) -> tuple[int, str]:
    from experiments.status import main

    code = main([str(sweep_dir), "--no-slurm"])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("damage", ["deleted", "cut"])
def test_a_finished_cell_without_its_metrics_is_damaged_in_status_and_launcher(sweep, capsys, damage):
    out, ref = sweep
    run = _cell(out, "vanilla")
    metrics = run / "metrics.jsonl"
    if damage == "deleted":
        metrics.unlink()
        why = ["missing, but status.json says the run finished 4 step(s)"]
    else:
        metrics.write_bytes(b"".join(metrics.read_bytes().splitlines(keepends=True)[:2]))
        why = ["holds 2 of the 4 step rows"]
    fix = ["delete ", "status.json and ", "checkpoint", " and relaunch: the cell runs again from step 0"]
    code, table = _status(out / "smoke", capsys)
    assert code == 1, table
    row = next(ln for ln in table.splitlines() if ln.startswith(run.name))
    assert row.split()[1] == "DAMAGED", table
    reason = next(ln for ln in table.splitlines() if ln.strip().startswith(f"{run.name}:"))
    assert str(metrics) in reason and all(s in reason for s in why + fix), reason
    proc = _launch(out)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    line = next(ln for ln in text.splitlines() if "DAMAGED, not run" in ln and run.name in ln)
    assert str(metrics) in line and all(s in line for s in why + fix), line
    st, ckpt = run / "status.json", run / "checkpoint"
    assert RunDir(run).state == "DONE" and not (damage == "deleted" and metrics.exists())  # nothing touched
    st.unlink()  # what the message says
    shutil.rmtree(ckpt)
    again = _launch(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert RunDir(run).state == "DONE"
    assert _outcome(run) == ref["vanilla"]  # run again from step 0: the uninterrupted run's numbers
    code, table = _status(out / "smoke", capsys)
    assert code == 0, table
