import json
import math
import os

import numpy as np
import pytest
import yaml

from fp8rl.runs import rundir as rd
from fp8rl.runs.rundir import JsonlWriter, RunDir, RunDirConflict, read_jsonl

CFG = {"algorithm": {"name": "grpo", "eps": [0.2, 0.28]}, "seed": 0, "fp8": "tensorwise"}


def test_init_writes_config_and_overrides(tmp_path):
    run = RunDir(tmp_path / "r").init(CFG, ["fp8=tensorwise", "seed=0"])
    assert yaml.safe_load(run.config_path.read_text()) == CFG
    assert list(yaml.safe_load(run.config_path.read_text())) == list(CFG)  # order kept
    assert run.overrides() == ["fp8=tensorwise", "seed=0"]
    assert run.samples_dir.is_dir()
    assert run.checkpoint_dir == run.path / "checkpoint"
    assert run.status() is None and run.state is None and not run.is_done()


def test_init_same_config_resumes_different_raises(tmp_path):
    run = RunDir(tmp_path / "r").init(CFG, ["a=1"])
    mtime = run.config_path.stat().st_mtime_ns
    RunDir(tmp_path / "r").init(dict(CFG), ["b=2"])  # same config: resume
    assert run.config_path.stat().st_mtime_ns == mtime
    assert run.overrides() == ["a=1"]  # the original overrides are kept
    other = {**CFG, "algorithm": {"name": "grpo", "eps": [0.2, 0.3]}}
    with pytest.raises(RunDirConflict, match=r"algorithm\.eps"):
        RunDir(tmp_path / "r").init(other, [])
    assert yaml.safe_load(run.config_path.read_text()) == CFG


def test_init_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError):
        RunDir(tmp_path / "r").init([1, 2])
    with pytest.raises(ValueError):
        RunDir(tmp_path / "r").init(CFG, ["a=1\nb=2"])
    with pytest.raises(TypeError, match="cannot write"):
        RunDir(tmp_path / "r").init({"x": object()})


def test_status_atomic_and_validated(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "r").init(CFG)
    run.set_status("RUNNING", 0)
    assert run.state == "RUNNING"
    run.set_status("DONE", 10, reason=None)
    st = run.status()
    assert st["state"] == "DONE" and st["step"] == 10 and st["reason"] is None and st["time"]
    assert run.is_done()
    for bad in [("done", 1), ("DONE", -1), ("DONE", 1.5), ("DONE", True)]:
        with pytest.raises(ValueError):
            run.set_status(*bad)
    # atomic: a failure while writing leaves the old file intact and no temp files
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(rd.os, "replace", boom)
    with pytest.raises(OSError):
        run.set_status("FAILED", 11, reason="x")
    monkeypatch.undo()
    assert run.status()["state"] == "DONE"
    assert [p.name for p in run.path.iterdir() if p.name.endswith(".tmp")] == []


def test_provenance_and_attempts(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "r").init(CFG)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    p = run.write_provenance({"note": "first"}, device="cpu")
    assert p["slurm"] == {"SLURM_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    assert p["device"] == "cpu" and p["extra"] == {"note": "first"}
    assert set(p["packages"]) == {"torch", "torchao", "transformers", "fp8rl"}
    assert p["packages"]["fp8rl"] is not None
    assert set(p["git"]) == {"sha", "dirty"}
    assert p["time_started"].endswith("Z") and p["time_ended"] is None
    run.set_status("PREEMPTED", 5)
    assert run.provenance()["time_ended"] is not None
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    run.write_provenance(device="cpu")
    prov = run.provenance()
    assert prov["slurm"]["SLURM_JOB_ID"] == "78"
    assert [a["slurm"]["SLURM_JOB_ID"] for a in prov["previous_attempts"]] == ["77"]
    assert prov["time_ended"] is None


def test_provenance_records_the_cpu_and_its_numeric_extensions(tmp_path, monkeypatch):
    from fp8rl.runs import provenance as pv

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C\n"
        "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw amx_tile amx_bf16 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
    )
    # Only the first processor's block; flags in NUMERIC_CPU_FLAGS order, others dropped.
    assert pv.cpu_info(info) == {"model": "Intel(R) Xeon(R) Platinum 8480C",
                                 "flags": ["avx2", "fma", "f16c", "avx512f", "avx512bw",
                                           "avx512_bf16", "amx_tile", "amx_bf16"]}
    # Unreadable: the model from platform, flags unknown (None), never an exception.
    assert pv.cpu_info(tmp_path / "missing")["flags"] is None
    monkeypatch.setattr(pv, "CPUINFO", info)
    p = RunDir(tmp_path / "r").init(CFG).write_provenance(device="cpu")
    assert p["cpu"]["model"] == "Intel(R) Xeon(R) Platinum 8480C" and "amx_bf16" in p["cpu"]["flags"]


def test_writer_encodes_nonfinite_as_null_and_scalars(tmp_path):
    run = RunDir(tmp_path / "r").init(CFG)
    with run.metrics_writer() as w:
        w.write({"step": 0, "a": float("nan"), "b": float("inf"), "c": np.float32(0.5),
                 "d": np.int64(3), "e": [1.0, float("-inf")]})
    text = run.metrics_path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)  # strict JSON, one line
    assert row == {"step": 0, "a": None, "b": None, "c": 0.5, "d": 3, "e": [1.0, None]}


def test_writer_flushes_each_line(tmp_path):
    w = JsonlWriter(tmp_path / "m.jsonl")
    w.write({"step": 0, "x": 1})
    assert read_jsonl(tmp_path / "m.jsonl") == [{"step": 0, "x": 1}]  # visible before close
    w.write({"step": 1, "x": 2})
    assert len(read_jsonl(tmp_path / "m.jsonl")) == 2
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write({"step": 2})


def test_writer_validates_rows(tmp_path):
    run = RunDir(tmp_path / "r").init(CFG)
    w = run.metrics_writer()
    with pytest.raises(ValueError, match="step"):
        w.write({"x": 1})
    with pytest.raises(ValueError, match="non-negative int"):
        w.write({"step": 1.5})
    w.write({"step": 3})
    with pytest.raises(ValueError, match="truncate_after"):
        w.write({"step": 3})
    w.close()
    # a fresh writer knows the last step already in the file
    with pytest.raises(ValueError, match="not after"), run.metrics_writer() as w2:
        w2.write({"step": 2})
    # eval rows may repeat a step (one row per dataset)
    with run.eval_writer() as ew:
        ew.write({"step": 3, "dataset": "a"})
        ew.write({"step": 3, "dataset": "b"})
    assert len(run.read_eval()) == 2


def _write_lines(path, text):
    path.write_bytes(text.encode())


def test_read_jsonl_tolerates_truncated_last_line(tmp_path):
    p = tmp_path / "m.jsonl"
    _write_lines(p, '{"step": 0, "x": 1}\n{"step": 1, "x": 2}\n{"step": 2, "x"')
    assert read_jsonl(p) == [{"step": 0, "x": 1}, {"step": 1, "x": 2}]
    # a complete last object without newline is kept
    _write_lines(p, '{"step": 0}\n{"step": 1}')
    assert read_jsonl(p) == [{"step": 0}, {"step": 1}]
    # blank lines are skipped, a missing file is empty
    _write_lines(p, '{"step": 0}\n\n{"step": 1}\n')
    assert len(read_jsonl(p)) == 2
    assert read_jsonl(tmp_path / "absent.jsonl") == []
    # corruption in the middle is an error
    _write_lines(p, '{"step": 0}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(p)


def test_writer_repairs_truncated_tail_before_appending(tmp_path):
    p = tmp_path / "m.jsonl"
    _write_lines(p, '{"step": 0}\n{"step": 1}\n{"step": 2, "x": 0.')
    with JsonlWriter(p, monotonic=True) as w:
        assert w.last_step == 1
        w.write({"step": 2, "x": 0.5})
    assert read_jsonl(p) == [{"step": 0}, {"step": 1}, {"step": 2, "x": 0.5}]
    # complete last line without newline: kept and terminated
    _write_lines(p, '{"step": 0}')
    with JsonlWriter(p) as w:
        w.write({"step": 1})
    assert p.read_text() == '{"step": 0}\n{"step": 1}\n'


def test_truncate_after(tmp_path):
    run = RunDir(tmp_path / "r").init(CFG)
    with run.metrics_writer() as w:
        for s in range(10):
            w.write({"step": s, "v": s * 0.1})
    with run.eval_writer() as w:
        for s in (0, 5, 9):
            w.write({"step": s, "dataset": "a", "eval/a/avg@k": 0.5})
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 10, "v"')  # crash mid-line
    dropped = run.truncate_after(6)
    assert dropped == {"metrics.jsonl": 4, "eval.jsonl": 1}
    assert [r["step"] for r in run.read_metrics()] == list(range(7))
    assert [r["step"] for r in run.read_eval()] == [0, 5]
    with run.metrics_writer() as w:  # resume logs step 7 once
        w.write({"step": 7, "v": 0.7})
    steps = [r["step"] for r in run.read_metrics()]
    assert steps == sorted(set(steps)) == list(range(8))
    assert run.truncate_after(100) == {"metrics.jsonl": 0, "eval.jsonl": 0}
    with pytest.raises(ValueError):
        run.truncate_after(-1)
    assert RunDir(tmp_path / "empty").truncate_after(3) == {"metrics.jsonl": 0, "eval.jsonl": 0}


def test_summary_atomic_roundtrip(tmp_path):
    run = RunDir(tmp_path / "r").init(CFG)
    run.write_summary({"acc": 0.5, "bad": float("nan"), "nested": {"x": np.float64(1.25)}})
    s = run.summary()
    assert s == {"acc": 0.5, "bad": None, "nested": {"x": 1.25}}
    assert not math.isnan(json.loads(run.summary_path.read_text())["acc"])
    with pytest.raises(TypeError):
        run.write_summary([1])
    assert os.fspath(run) == str(run.path)
