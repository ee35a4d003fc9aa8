"""Damaged, full and hostile run directories: nothing lost, nothing run that should not be.

Each fault either survives with nothing lost or is refused with one clear error naming the
file (never silently used, never a raw traceback from deep inside torch or json):

- disk full (ENOSPC) and a read-only run directory (EROFS / EACCES) while writing any run
  file: ``RunDirWriteError`` naming the path and the fix, no half-written file, the run stays
  resumable;
- damaged ``state.pt`` (truncated, zero bytes, garbage) and a crafted pickle that would run
  code: refused, the payload never runs;
- damaged ``metrics.jsonl``, ``manifest.json``, ``owner.json``, ``config.yaml``;
- a symlink in place of a run file: refused, its target untouched.

One interrupted tiny run (5 steps, checkpoint every 2; killed at step 4: checkpoint of step 2,
rows of steps 1-3 logged) is made once per module; every test damages a fresh copy of it (in
the same place: the run directory's path is part of its config) and resumes.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil

import pytest

from fp8rl.backends.mini.config import MiniRunConfig, MiniSettings
from fp8rl.config import AlgorithmConfig, ClipConfig, Fp8Config, LoggingConfig
from fp8rl.runs import RunDir
from fp8rl.runs.jsonl import JsonlWriter, atomic_write_json
from fp8rl.runs.lock import own

STEPS = 5
KILLED_AT = 4


def _cfg(run_dir, cache) -> MiniRunConfig:
    return MiniRunConfig(
        algorithm=AlgorithmConfig(n_samples_per_prompt=2),
        fp8=Fp8Config(name="bf16", rollout_recipe="bf16", trainer_recipe="bf16", emulate=True),
        clip=ClipConfig(arm="vanilla", calibration_mode="periodic", period=2),
        mini=MiniSettings(n_train=50, n_eval=2, sft_steps=5, sft_batch_size=8, min_terms=2, max_terms=2,
                          max_operand=9, cache_dir=str(cache), num_threads=1),
        logging=LoggingConfig(tensorboard=False),
        steps=STEPS, prompts_per_step=2, num_mini_batches=1, max_response_len=8, eval_every=0, eval_k=1,
        checkpoint_every=2, samples_every=0, run_dir=str(run_dir), output_dir=str(run_dir.parent),
    )


def _run(cfg):
    from fp8rl.backends.mini.run import run_mini

    return run_mini(cfg)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """``(cfg, template, reference rows)``: the interrupted run, kept at ``template``."""
    from fp8rl.backends.mini.trainer import MiniTrainer

    root = tmp_path_factory.mktemp("faults")
    cfg = _cfg(root / "run", root / "sft")
    original = MiniTrainer.train_step

    def dies(self, s):
        if s == KILLED_AT:
            raise KeyboardInterrupt("killed")
        return original(self, s)

    MiniTrainer.train_step = dies
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(cfg)
    finally:
        MiniTrainer.train_step = original
    rd = RunDir(cfg.run_dir)
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3]
    assert (rd.checkpoint_dir / "state.pt").exists()
    template = root / "template"
    os.rename(rd.path, template)
    ref = _run(_cfg(root / "reference", root / "sft"))  # the same run, never interrupted
    return cfg, template, RunDir(ref["run_dir"]).read_metrics()


@pytest.fixture
def run(interrupted):
    """``(cfg, rd, reference rows)`` for a fresh copy of the interrupted run."""
    cfg, template, ref = interrupted
    rd = RunDir(cfg.run_dir)
    shutil.rmtree(rd.path, ignore_errors=True)
    shutil.copytree(template, rd.path, symlinks=True)
    return cfg, rd, ref


def _no_perf(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _resumes_with_nothing_lost(cfg, rd, ref):
    summary = _run(cfg)
    assert summary["state"] == "DONE", summary
    assert _no_perf(rd.read_metrics()) == _no_perf(ref)


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


# --- disk full, read-only run directory ---------------------------------------------------------


def _fail_fsync(monkeypatch, err: int, *, after: int = 0):
    """Make ``os.fsync`` fail with ``err`` after ``after`` successful calls."""
    real, calls = os.fsync, [0]

    def fsync(fd):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(err, os.strerror(err))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("err, words", [(errno.ENOSPC, "no space left"), (errno.EROFS, "read-only"),
                                         (errno.EACCES, "permission denied")])
def test_atomic_write_failure_is_clear_and_leaves_the_old_file(tmp_path, monkeypatch, err, words):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"state": "RUNNING", "step": 2})
    _fail_fsync(monkeypatch, err)
    with pytest.raises(OSError) as e:
        atomic_write_json(path, {"state": "DONE", "step": 4})
    msg = _one_line(e.value)
    assert words in msg and str(path) in msg and "relaunch" in msg
    assert json.loads(path.read_text()) == {"state": "RUNNING", "step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no temporary left


def test_jsonl_append_on_a_full_disk_leaves_no_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path, monotonic=True)
    w.write({"step": 1, "x": 1.0})
    before = path.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):  # the disk fills in the middle of the line
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as e:
        w.write({"step": 2, "x": 2.0})
    monkeypatch.undo()
    msg = _one_line(e.value)
    assert "no space left" in msg and str(path) in msg
    assert path.read_bytes() == before
    w.write({"step": 2, "x": 2.0})  # space freed: the same step goes in whole
    w.close()
    assert [r["step"] for r in RunDir(tmp_path).read_metrics()] == [1, 2]


def test_checkpoint_on_a_full_disk_keeps_the_previous_one_and_resumes(run, monkeypatch):
    from fp8rl.backends.mini.trainer import MiniTrainer
    cfg, rd, ref = run
    ckpt = rd.checkpoint_dir / "state.pt"
    old = ckpt.read_bytes()
    real_save, real_fsync, saving = MiniTrainer.save_checkpoint, os.fsync, [False]

    def fsync(fd):  # the disk is full while the checkpoint of step 4 is written
        if saving[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    def save(self):
        saving[0] = True
        try:
            real_save(self)
        finally:
            saving[0] = False

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(MiniTrainer, "save_checkpoint", save)
    with pytest.raises(OSError) as e:
        _run(cfg)
    msg = _one_line(e.value)
    assert "no space left" in msg and str(ckpt) in msg and "resumes from its last checkpoint" in msg
    assert ckpt.read_bytes() == old
    assert sorted(p.name for p in rd.checkpoint_dir.iterdir()) == ["state.pt"]
    monkeypatch.undo()
    _resumes_with_nothing_lost(cfg, rd, ref)


@pytest.mark.parametrize("err, words", [(errno.EROFS, "read-only"), (errno.EACCES, "permission denied")])
def test_a_read_only_run_directory_is_refused_clearly_and_resumes_later(run, monkeypatch, err, words):
    cfg, rd, ref = run
    metrics, ckpt = rd.metrics_path.read_bytes(), (rd.checkpoint_dir / "state.pt").read_bytes()
    _fail_fsync(monkeypatch, err)  # as root, chmod does not stop writes: inject what a read-only mount says
    with pytest.raises(OSError) as e:
        _run(cfg)
    msg = _one_line(e.value)
    assert words in msg and str(rd.path) in msg and "relaunch" in msg
    assert rd.metrics_path.read_bytes() == metrics and (rd.checkpoint_dir / "state.pt").read_bytes() == ckpt
    monkeypatch.undo()
    _resumes_with_nothing_lost(cfg, rd, ref)


# --- checkpoints: damaged, crafted ------------------------------------------------------------


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_checkpoint_never_runs(run, tmp_path):
    cfg, rd, _ = run
    marker = tmp_path / "PWNED"
    with open(rd.checkpoint_dir / "state.pt", "wb") as f:
        pickle.dump({"step": 2, "model": _Payload(str(marker))}, f)
    with pytest.raises(Exception) as e:
        _run(cfg)
    assert not marker.exists()
    msg = _one_line(e.value)
    assert "state.pt" in msg and "refus" in msg


@pytest.mark.parametrize("damage", ["truncated", "zero-byte", "garbage"])
def test_a_damaged_checkpoint_is_refused_clearly(run, damage):
    cfg, rd, _ = run
    ckpt = rd.checkpoint_dir / "state.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes({"truncated": data[: len(data) // 2], "zero-byte": b"",
                      "garbage": os.urandom(4096)}[damage])
    metrics = rd.metrics_path.read_bytes()
    with pytest.raises(Exception) as e:
        _run(cfg)
    msg = _one_line(e.value)
    assert str(ckpt) in msg and "damaged" in msg
    assert rd.metrics_path.read_bytes() == metrics  # nothing logged on top of it


def test_a_checkpoint_of_the_current_format_loads_without_unpickling_code(run):
    import torch

    cfg, rd, ref = run
    torch.load(rd.checkpoint_dir / "state.pt", weights_only=True)  # plain data and tensors only
    _resumes_with_nothing_lost(cfg, rd, ref)


# --- metrics.jsonl, config.yaml, manifest.json, owner.json ------------------------------------


def test_a_torn_last_metrics_row_is_relogged(run):
    cfg, rd, ref = run
    data = rd.metrics_path.read_bytes()
    rd.metrics_path.write_bytes(data[: len(data) - 40])  # killed in the middle of step 3's row
    _resumes_with_nothing_lost(cfg, rd, ref)


@pytest.mark.parametrize("damage", ["zero-byte", "garbage"])
def test_metrics_missing_rows_the_checkpoint_covers_are_refused(run, damage):
    cfg, rd, _ = run
    rd.metrics_path.write_bytes(b"" if damage == "zero-byte" else b'{"step": 1}\n\x00\xff garbage\n')
    with pytest.raises(Exception) as e:
        _run(cfg)
    msg = _one_line(e.value)
    assert str(rd.metrics_path) in msg


@pytest.mark.parametrize("damage", ["truncated", "zero-byte", "garbage"])
def test_a_damaged_config_is_refused_clearly(run, damage):
    cfg, rd, _ = run
    text = rd.config_path.read_text()
    rd.config_path.write_text({"truncated": text[: len(text) // 3], "zero-byte": "",
                               "garbage": "\x00: [unclosed\n"}[damage])
    with pytest.raises(Exception) as e:
        _run(cfg)
    msg = _one_line(e.value)
    assert str(rd.config_path) in msg
    # a cut file may still parse (a shorter mapping: "holds a different config"), the rest is named damaged
    assert "damaged" in msg or (damage == "truncated" and "different config" in msg)


@pytest.mark.parametrize("damage", ["truncated", "zero-byte", "garbage"])
def test_a_damaged_manifest_is_refused_clearly(tmp_path, damage):
    from fp8rl.runs.manifest import read_manifest, write_manifest

    cell = {"name": "a", "hash": "1", "run_dir": "a-1",
            "axes": {"algorithm": "grpo", "model": "8b", "fp8": "bf16", "clip": "vanilla", "seed": 0,
                     "scale": "mini"}}
    path = write_manifest(tmp_path, "s", [cell])
    text = path.read_text()
    path.write_text({"truncated": text[: len(text) // 2], "zero-byte": "", "garbage": "\x00\xff}"}[damage])
    with pytest.raises(ValueError) as e:
        read_manifest(tmp_path)
    msg = _one_line(e.value)
    assert str(path) in msg and "damaged" in msg
    write_manifest(tmp_path, "s", [cell])  # the launcher rewrites it
    assert read_manifest(tmp_path).cells[0].name == "a"


@pytest.mark.parametrize("damage", ["truncated", "zero-byte", "garbage"])
def test_a_damaged_owner_file_is_taken_over(run, damage):
    cfg, rd, ref = run
    path = rd.path / "owner.json"
    text = path.read_text()
    path.write_text({"truncated": text[: len(text) // 2], "zero-byte": "", "garbage": "\x00\xff{"}[damage])
    _resumes_with_nothing_lost(cfg, rd, ref)
    assert json.loads(path.read_text())["released"]


# --- symlinks in place of run files -------------------------------------------------------------


@pytest.mark.parametrize("name", ["owner.json", "metrics.jsonl", "status.json", "checkpoint/state.pt"])
def test_a_symlinked_run_file_is_refused_and_its_target_untouched(run, tmp_path, name):
    cfg, rd, _ = run
    target = tmp_path / "precious.txt"
    target.write_text("do not touch\n")
    link = rd.path / name
    link.unlink()
    link.symlink_to(target)
    with pytest.raises(Exception) as e:
        _run(cfg)
    msg = _one_line(e.value)
    assert str(link) in msg and "symlink" in msg
    assert target.read_text() == "do not touch\n"
    assert link.is_symlink()


def test_own_refuses_a_symlinked_owner_file(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("do not touch\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "owner.json").symlink_to(target)
    with pytest.raises(Exception) as e, own(tmp_path / "run"):
        pass
    assert "symlink" in _one_line(e.value) and "owner.json" in str(e.value)
    assert target.read_text() == "do not touch\n"


def test_atomic_writes_refuse_a_symlink(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("do not touch\n")
    (tmp_path / "summary.json").symlink_to(target)
    with pytest.raises(Exception) as e:
        atomic_write_json(tmp_path / "summary.json", {"x": 1})
    assert "symlink" in _one_line(e.value)
    assert (tmp_path / "summary.json").is_symlink() and target.read_text() == "do not touch\n"
