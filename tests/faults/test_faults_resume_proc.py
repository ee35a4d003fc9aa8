"""Kill a mini run at each phase, relaunch it: it ends DONE with an uninterrupted run's numbers.

The run is the mini CLI (``python -m fp8rl.backends.mini``) on a tiny configuration, killed in
a subprocess with SIGKILL or SIGTERM at a named point by ``kill_at.py`` (see there), then
relaunched with the same command. Phases (5 steps, a checkpoint after steps 2 and 4):

- before the first checkpoint (step 1 logged, with its samples, the step-0 evaluation and the
  TensorBoard events): the relaunch has no checkpoint and restarts the run from scratch;
- during a checkpoint write (the first: no checkpoint yet; the second: the step-2 checkpoint
  is there): the temporary file of the write is left behind; the relaunch ignores it, removes
  it and says so;
- during a metrics append (half of step 1's line written);
- after the last step, before ``summary.json`` and DONE (a run that writes no checkpoint).

After the relaunch the run is DONE and ``metrics.jsonl`` equals the uninterrupted run's except
the wall-time keys (``perf/*``); ``eval.jsonl``, ``samples/`` and ``summary.json`` (its numbers)
are equal too, and TensorBoard has every step once. One uninterrupted reference run is shared
by the module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.backends.mini.__main__ import main as mini_main
from fp8rl.runs import RunDir

ROOT = Path(__file__).resolve().parents[2]
KILL_AT = Path(__file__).with_name("kill_at.py")
#: tests/mini's tiny configuration as CLI overrides: 5 steps, checkpoints after steps 2 and 4
TINY = ["steps=5", "prompts_per_step=4", "num_mini_batches=2", "max_response_len=32", "eval_every=2",
        "eval_k=2", "checkpoint_every=2", "samples_every=1", "lr=1e-3", "algorithm.n_samples_per_prompt=4",
        "fp8.name=tensorwise", "fp8.rollout_recipe=tensorwise", "fp8.trainer_recipe=tensorwise",
        "fp8.emulate=true", "clip.arm=calibrated", "clip.calibration_mode=periodic", "clip.period=2", "mini.n_train=200", "mini.n_eval=4",
        "mini.sft_steps=150", "mini.sft_batch_size=32", "mini.min_terms=2", "mini.max_terms=3",
        "mini.max_operand=9", "mini.num_threads=1"]
#: wall-time keys: the only ones an interrupted run may log differently
WALL_TIME = ("perf/",)
#: summary.json keys that differ between attempts: times, and whether the warm start was cached
SUMMARY_VARIES = ("wall_s", "sft")


def _args(run_dir: Path, cache: Path) -> list[str]:
    return ["--no-progress", *TINY, f"mini.cache_dir={cache}", f"run_dir={run_dir}"]


def _no_wall_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(WALL_TIME)} for r in rows]


def _numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in SUMMARY_VARIES and not k.startswith(WALL_TIME)}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.exists() else {}


def _tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return sorted(e.step for e in ea.Scalars(tag))


@pytest.fixture(scope="module")
def cache(shared_sft_cache) -> Path:
    """The run's SFT cache (``tests/conftest.py``; tests/mini's ``tiny`` trains the same key)."""
    return shared_sft_cache


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> RunDir:
    """The uninterrupted run (it also trains the shared SFT warm start)."""
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    assert mini_main(_args(run_dir, cache)) == 0
    return RunDir(run_dir)


def _kill(run_dir: Path, cache: Path, point: str, sig: signal.Signals,
          extra: list[str] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(KILL_AT), point, sig.name[3:], *_args(run_dir, cache), *extra],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -sig, f"the run was not killed at {point}:\n{proc.stderr[-3000:]}"
    return proc


def _assert_same_as(rd: RunDir, ref: RunDir) -> None:
    assert rd.state == "DONE"
    assert _no_wall_time(rd.read_metrics()) == _no_wall_time(ref.read_metrics())
    assert rd.read_eval() == ref.read_eval()
    assert _files(rd.samples_dir) == _files(ref.samples_dir)
    assert _numbers(rd.summary()) == _numbers(ref.summary())
    assert _tensorboard_steps(rd.path, "actor/entropy") == [1, 2, 3, 4, 5]
    assert _tensorboard_steps(rd.path, "eval/arith/avg@k") == [0, 2, 4, 5]


def _by_signal(name: str, default: signal.Signals, *values) -> list:
    """``values`` killed by SIGKILL and by SIGTERM (ids ``NAME-SIGKILL``, ``NAME-SIGTERM``). The
    signal that is not ``default`` is in the slow tier (``make test-slow``, which CI runs): each
    kill point has one signal in ``make test``, and both signals are there."""
    return [pytest.param(*values, s, id=f"{name}-{s.name}", marks=() if s == default else pytest.mark.slow)
            for s in (signal.SIGKILL, signal.SIGTERM)]


@pytest.mark.parametrize(("point", "extra", "sig"), [
    *_by_signal("before-first-checkpoint", signal.SIGKILL, "step:2", []),
    *_by_signal("metrics-append", signal.SIGTERM, "metrics:1", []),
    # a run without checkpoints (the metrics do not depend on checkpointing)
    *_by_signal("after-last-step", signal.SIGKILL, "summary", ["checkpoint_every=0"]),
])
def test_killed_run_relaunched_ends_as_the_uninterrupted_run(reference, cache, tmp_path, capfd, point, extra, sig):
    run_dir = tmp_path / "run"
    _kill(run_dir, cache, point, sig, extra)
    rd = RunDir(run_dir)
    assert rd.state == "RUNNING" and not (run_dir / "checkpoint" / "state.pt").exists()
    assert rd.metrics_path.stat().st_size > 0  # the attempt logged something the restart must drop
    capfd.readouterr()
    assert mini_main(_args(run_dir, cache) + extra) == 0
    assert "restarting the run from step 0" in capfd.readouterr().err
    _assert_same_as(rd, reference)


@pytest.mark.parametrize(("nth", "sig"), [*_by_signal("1", signal.SIGTERM, 1), *_by_signal("2", signal.SIGKILL, 2)])
def test_kill_during_a_checkpoint_write_leaves_a_temp_file_the_relaunch_removes(
        reference, cache, tmp_path, capfd, nth, sig):
    run_dir = tmp_path / "run"
    _kill(run_dir, cache, f"checkpoint:{nth}", sig)
    ckpt = run_dir / "checkpoint"
    temps = [p for p in ckpt.iterdir() if p.name != "state.pt"]
    assert temps, "the kill left no temporary checkpoint file"
    assert (ckpt / "state.pt").exists() == (nth == 2)
    capfd.readouterr()
    assert mini_main(_args(run_dir, cache)) == 0
    err = capfd.readouterr().err
    assert [p.name for p in ckpt.iterdir()] == ["state.pt"]  # the final checkpoint, no temp file
    for p in temps:
        assert str(p.name) in err, f"no log line names the removed {p.name}:\n{err}"
    _assert_same_as(RunDir(run_dir), reference)


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_an_event_file_stamped_an_hour_ahead_does_not_stall_the_resume(reference, cache, tmp_path):
    """A killed attempt on a node whose clock ran an hour ahead left its TensorBoard event file
    stamped an hour ahead: the relaunch (a subprocess of the CLI) used to sleep until then."""
    import time

    run_dir = tmp_path / "run"
    _kill(run_dir, cache, "step:4", signal.SIGKILL)  # the checkpoint of step 2, step 3 logged
    (event,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    parts = event.name.split(".")
    parts[3] = f"{int(time.time()) + 3600:010d}"
    event.rename(event.with_name(".".join(parts)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "fp8rl.backends.mini", *_args(run_dir, cache)], env=env,
                          capture_output=True, text=True, timeout=100)  # it used to sleep for an hour
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ahead of this machine's clock" in proc.stderr, proc.stderr[-3000:]
    _assert_same_as(RunDir(run_dir), reference)  # TensorBoard included: every step once


def test_a_kill_during_a_samples_write_leaves_a_temp_file_the_relaunch_removes(reference, cache, tmp_path, capfd):
    run_dir = tmp_path / "run"
    _kill(run_dir, cache, "samples:3", signal.SIGKILL)  # the checkpoint of step 2 is there
    temps = [p for p in (run_dir / "samples").iterdir() if p.name.endswith(".tmp")]
    assert [p.name[:len(".step_000003.jsonl.")] for p in temps] == [".step_000003.jsonl."], temps
    capfd.readouterr()
    assert mini_main(_args(run_dir, cache)) == 0
    err = capfd.readouterr().err
    assert not [p for p in (run_dir / "samples").iterdir() if p.name.endswith(".tmp")]
    assert f"samples/{temps[0].name}" in err, err
    _assert_same_as(RunDir(run_dir), reference)


# ----- the relaunch's clean-up on its own (no run) ----------------------------------------------


def _run_dir(tmp_path: Path) -> RunDir:
    rd = RunDir(tmp_path / "run").init({"seed": 0})
    rd.set_status("RUNNING", 0)
    return rd


def test_a_restart_finishes_a_discard_a_kill_interrupted(tmp_path):
    from fp8rl.runs.relaunch import discard_outputs

    rd = _run_dir(tmp_path)
    assert discard_outputs(rd) == [] and list(rd.samples_dir.iterdir()) == []  # a new run: nothing
    (rd.path / ".discarded").mkdir()  # killed after moving metrics.jsonl, before the rest
    (rd.path / ".discarded" / "metrics.jsonl").write_text('{"step": 1}\n')
    rd.eval_path.write_text('{"step": 0}\n')
    (rd.samples_dir / "step_000001.jsonl").write_text("{}\n")
    (rd.path / "tensorboard").mkdir()
    (rd.path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    before = {p.name: p.read_bytes() for p in rd.path.iterdir() if p.is_file() and p.name != "eval.jsonl"}
    discard_outputs(rd)
    assert sorted(p.name for p in rd.path.iterdir()) == sorted([*before, "samples"])
    assert {n: (rd.path / n).read_bytes() for n in before} == before  # config, status, ... kept
    assert list(rd.samples_dir.iterdir()) == []


def test_only_temporary_files_of_atomic_writes_are_removed(tmp_path, capsys):
    from fp8rl.runs.relaunch import remove_stale_temps

    rd = _run_dir(tmp_path)
    rd.checkpoint_dir.mkdir()
    keep = [rd.checkpoint_dir / "state.pt", rd.metrics_path, rd.path / "owner.json"]
    keep.append(rd.path / "notes.tmpl")  # not a temporary file of ours
    stale = [rd.checkpoint_dir / "state.pt.tmpa1b2c3d4", rd.path / ".status.json.x_9zk0p1.tmp",
             rd.samples_dir / ".step_000004.jsonl.k2j4m6n8.tmp"]
    for p in keep + stale:
        p.write_text("x")
    assert sorted(remove_stale_temps(rd)) == sorted(stale)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in stale)
    err = capsys.readouterr().err
    assert "checkpoint/state.pt.tmpa1b2c3d4" in err and ".status.json.x_9zk0p1.tmp" in err
    assert "samples/.step_000004.jsonl.k2j4m6n8.tmp" in err
