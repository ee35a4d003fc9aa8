"""Live views of a mini run: TensorBoard event files and W&B, read back with their own readers."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fp8rl.backends.mini.run import run_mini
from fp8rl.config import LoggingConfig
from fp8rl.runs import RunDir
from fp8rl.runs.live import LiveLog, scalars


def _tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value), ...]`` as TensorBoard itself loads the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def _expected(rd: RunDir) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rd.read_eval() + rd.read_metrics():
        for k, v in scalars(row).items():
            out.setdefault(k, []).append((row["step"], v))
    return {k: sorted(v) for k, v in out.items()}


def _close(a, b) -> bool:  # TensorBoard stores float32
    return len(a) == len(b) and all(sa == sb and abs(va - vb) <= 1e-6 * max(1.0, abs(vb))
                                    for (sa, va), (sb, vb) in zip(a, b, strict=True))


def test_tensorboard_mirrors_metrics_jsonl_under_the_same_names(tiny, tmp_path):
    s = run_mini(tiny("tensorwise", "calibrated", run_dir=str(tmp_path / "r"), steps=3, eval_every=2))
    rd = RunDir(s["run_dir"])
    tb, want = _tensorboard(rd.path), _expected(rd)
    assert set(tb) == set(want)
    assert {"actor/entropy", "actor/clipfrac_neg_low", "clip/low", "eval/arith/avg@k", "perf/step_s"} <= set(tb)
    for tag in want:
        assert _close(sorted(tb[tag]), want[tag]), tag


def test_resumed_run_has_each_step_once_in_tensorboard(tiny, tmp_path, killed_at):
    cfg = tiny("bf16", run_dir=str(tmp_path / "r"), steps=5, checkpoint_every=2, eval_every=2)
    killed_at(cfg, 4)
    run_mini(cfg)  # resumes from the step-2 checkpoint; step 3 is logged again
    rd = RunDir(tmp_path / "r")
    tb = _tensorboard(rd.path)
    assert [s for s, _ in sorted(tb["actor/entropy"])] == [1, 2, 3, 4, 5]  # step 3 purged once
    for tag, want in _expected(rd).items():
        assert _close(sorted(tb[tag]), want), tag


def test_tensorboard_off(tiny, tmp_path):
    cfg = tiny("bf16", run_dir=str(tmp_path / "r"), steps=2)
    cfg = replace(cfg, logging=LoggingConfig(tensorboard=False))
    run_mini(cfg)
    assert not (tmp_path / "r" / "tensorboard").exists()


def test_a_failing_view_is_switched_off_and_the_run_goes_on(tmp_path, capsys):
    live = LiveLog(tmp_path, LoggingConfig())

    class Broken:
        def log(self, row):
            raise OSError("disk full")

        def close(self):
            pass

    live.sinks["tensorboard"].close()
    live.sinks["tensorboard"] = Broken()
    live.log({"step": 1, "actor/entropy": 0.5})
    live.log({"step": 2, "actor/entropy": 0.5})
    assert live.sinks == {}
    assert capsys.readouterr().err.count("live view tensorboard failed (OSError: disk full)") == 1


def test_wandb_without_the_package_is_refused_when_configured(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="wandb package is not installed"):
        LoggingConfig(wandb_project="p")
    with pytest.raises(ValueError, match="wandb_mode must be 'online' or 'offline'"):
        LoggingConfig(wandb_mode="sometimes")


def test_wandb_offline_gets_the_same_rows(tiny, tmp_path):
    pytest.importorskip("wandb")  # in the dev extra: installed wherever the tests run
    cfg = tiny("bf16", run_dir=str(tmp_path / "sweep" / "r"), steps=3, eval_every=0)
    cfg = replace(cfg, logging=LoggingConfig(tensorboard=False, wandb_project="fp8rl-test", wandb_mode="offline"))
    run_mini(cfg)
    rd = RunDir(tmp_path / "sweep" / "r")
    (log,) = glob.glob(str(rd.path / "wandb" / "offline-run-*" / "run-*.wandb"))
    # wandb's own reader of its transaction log
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", log],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    run = next(r for r in records if r["type"] == "run")
    assert json.dumps(run).count("fp8rl-test") >= 1 and rd.path.name in json.dumps(run)
    want: dict[int, dict] = {}
    for row in rd.read_eval() + rd.read_metrics():
        want.setdefault(row["step"], {}).update(scalars(row))
    assert sorted(history) == sorted(want)
    for step, vals in want.items():
        got = {k: v for k, v in history[step].items() if not k.startswith("_")}
        assert got.keys() == vals.keys(), step
        assert all(abs(got[k] - vals[k]) <= 1e-12 * max(1.0, abs(vals[k])) for k in vals)


def test_a_resume_in_the_same_second_as_the_interrupted_attempt_still_purges(tmp_path):
    """TensorBoard reads event files in name order (second opened, host, pid). An interrupted
    attempt's file opened in the same second as the resume's, by a process whose pid sorts after
    it, would be read last and its late steps would come back as duplicates; the resumed writer
    waits for the next second so that it sorts after every earlier file."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tensorboard"
    with LiveLog(tmp_path, LoggingConfig()) as live:  # the interrupted attempt: steps 1-4
        for step in range(1, 5):
            live.log({"step": step, "actor/entropy": float(step)})
    (old,) = tb.glob("events.out.tfevents.*")
    parts = old.name.split(".")
    parts[3], parts[5] = str(int(time.time())), "zzzz"  # this second, a pid that sorts last
    old.rename(tb / ".".join(parts))
    with LiveLog(tmp_path, LoggingConfig(), resume_step=2) as live:  # resumed from step 2's checkpoint
        for step in range(3, 6):
            live.log({"step": step, "actor/entropy": float(step)})
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    assert sorted(e.step for e in ea.Scalars("actor/entropy")) == [1, 2, 3, 4, 5]
