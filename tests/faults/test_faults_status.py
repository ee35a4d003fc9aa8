"""One damaged file must not hide a sweep: ``experiments.status`` and ``analysis.report`` show
that run as damaged with the reason and print or write the rest. Resume: keys outside the run
identity (``checkpoint_every``, ``output_dir``, ``mini.cache_dir``) may change, and a moved
sweep directory resumes its cells.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8rl.runs.synthetic import RunSpec, make_sweep

DAMAGE = [
    # (id, file, content)
    ("status-not-json", "status.json", b"{not json"),
    ("status-a-list", "status.json", b"[1, 2]"),
    ("status-not-utf8", "status.json", b"\xff\xfe\x00"),
    ("config-not-yaml", "config.yaml", b"a: [\n"),
]


def _sweep(root: Path) -> tuple[Path, Path, Path]:
    """A two-run synthetic sweep; returns (sweep dir, run to damage, healthy run)."""
    d = root / "sweep"
    specs = [RunSpec(fp8="bf16", steps=20, eval={"aime24": 0.3}, eval_every=10),
             RunSpec(fp8="tensorwise", steps=20, eval={"aime24": 0.2}, eval_every=10)]
    make_sweep(d, specs, fast=True)
    bad, good = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
    return d, bad, good


@pytest.mark.parametrize(("name", "content"), [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_status_shows_damaged_run_and_the_rest(tmp_path, capsys, name, content):
    from experiments.status import main

    d, bad, good = _sweep(tmp_path)
    (bad / name).write_bytes(content)
    code = main([str(d), "--no-slurm"])
    out = capsys.readouterr().out
    assert code == 1, out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert "DAMAGED" in lines[bad.name] and "DONE" in lines[good.name], out
    assert f"{bad.name}: {name}" in out, out  # the reason names the file


@pytest.mark.parametrize(("name", "content"), [c[1:] for c in DAMAGE[:2]], ids=[c[0] for c in DAMAGE[:2]])
def test_report_lists_damaged_run_and_writes_the_rest(tmp_path, capsys, name, content):
    from analysis.report import main

    d, bad, _good = _sweep(tmp_path)
    (bad / name).write_bytes(content)
    code = main([str(d), "--no-cache", "--no-progress", "--figures", "entropy"])
    assert code == 0, capsys.readouterr()
    text = "\n".join(p.read_text() for p in (d / "report").glob("*.md"))
    row = next(ln for ln in text.splitlines() if bad.name in ln and "damaged" in ln)
    assert name in row, text


def _launch(args: list[str], capsys) -> int:
    """``python -m experiments.launch ARGS`` in this process; returns the exit status."""
    import sys

    import experiments.launch as launch

    old = sys.argv
    sys.argv = ["experiments/launch.py", *args]
    try:
        launch.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    capsys.readouterr()
    return code


def test_moved_sweep_resumes_with_other_checkpoint_every(tmp_path, capsys):
    """A sweep directory moved elsewhere, relaunched from there with another checkpoint cadence:
    its interrupted cell resumes (not "a different config"), every step logged once, and
    provenance says what changed."""
    import json
    import shutil

    from fp8rl.runs import RunDir

    cell = ["+sweep=smoke", "fp8=bf16", "clip=vanilla", "steps=2", "workers=1", "progress=false"]
    assert _launch([*cell, f"output_dir={tmp_path}/a"], capsys) == 0
    (run,) = [p for p in (tmp_path / "a" / "smoke").iterdir() if (p / "status.json").exists()]
    rd = RunDir(run)
    rd.set_status("PREEMPTED", 2, "interrupted")  # as if stopped after its last checkpoint
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert _launch([*cell, f"output_dir={tmp_path}/b", "checkpoint_every=2"], capsys) == 0
    moved = RunDir(tmp_path / "b" / "smoke" / run.name)
    assert moved.state == "DONE"
    assert [r["step"] for r in moved.read_metrics()] == [1, 2]
    changed = json.loads(moved.provenance_path.read_text())["extra"]["changed_on_resume"]
    assert changed["checkpoint_every"] == {"before": 1, "now": 2}
    assert changed["output_dir"]["now"] == str(tmp_path / "b" / "smoke")
    assert "mini.cache_dir" in changed
