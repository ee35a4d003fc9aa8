"""A relaunch meets a damaged file: refused naming the file, never trained on, the other cells run;
the fix the message gives works.

A real one-cell sweep (``+sweep=smoke``, 4 steps, a checkpoint after every step) is launched
once per module and kept as a template; each test copies it back in place (the paths are part
of its config), damages one real file it wrote, and relaunches with the real command
(``python -m experiments.launch``, a subprocess) or, where only the loader's answer matters,
calls the loader on that file:

- one flipped exponent bit of ``model.norm.weight[0]`` (and of an Adam moment) inside
  ``checkpoint/state.pt``: ``torch.load`` does not check the zip's CRC-32s, so before digests
  the relaunch ended DONE with other numbers. Now the cell is FAILED naming the file and the
  tensor; deleting the checkpoint as the message says restarts it from step 0 and it ends with
  the uninterrupted run's numbers;
- the same flip in the shared warm-start cache's ``model.pt``: refused naming the file, and the
  entry retrained after it is deleted holds the same weights;
- a damaged cache entry (``model.pt`` truncated, a crafted pickle, ``meta.json`` truncated): the
  file is named, the pickle never runs, and no message repeats torch's advice to load with
  ``weights_only=False``;
- checkpoints and caches written before digests load (with one line saying so), and the zip's
  CRC-32 check still refuses a flipped bit in them;
- one cell's ``status.json`` not UTF-8 (or cut) in a two-cell sweep: that cell is reported
  DAMAGED with the file and a fix that keeps its checkpoint, the other cell runs; following the
  fix resumes the damaged cell from its checkpoint;
- ``manifest.json`` cut in half: ``experiments.launch``, ``experiments.status`` and
  ``analysis.report`` each answer with one line naming it and the fix, no traceback.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from fp8rl.runs import RunDir

REPO = Path(__file__).resolve().parents[2]
CELL = ["+sweep=smoke", "clip=vanilla", "workers=1", "progress=false"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _launch(out: Path, *extra: str, fp8: str = "bf16") -> subprocess.CompletedProcess:
    """``python -m experiments.launch +sweep=smoke fp8=FP8 clip=vanilla ...`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "experiments.launch", *CELL, f"fp8={fp8}", f"output_dir={out}",
                           *extra], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)


def _no_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """``(output dir, template copy, reference metrics)``: the launched sweep, DONE."""
    root = tmp_path_factory.mktemp("bitrot")
    out = root / "runs"
    proc = _launch(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p for p in (out / "smoke").iterdir() if (p / "status.json").exists()]
    ref = RunDir(run).read_metrics()
    shutil.copytree(out, root / "template", symlinks=True)
    return out, root / "template", ref


@pytest.fixture
def sweep(template):
    """``(output dir, run dir, cache entry, reference metrics)`` of a fresh copy of the template,
    its cell stopped after the checkpoint of step 3 (a relaunch resumes it)."""
    out, tpl, ref = template
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tpl, out, symlinks=True)
    (run,) = [p for p in (out / "smoke").iterdir() if (p / "status.json").exists()]
    RunDir(run).set_status("PREEMPTED", 3, "stopped")  # the checkpoint holds step 3
    (entry,) = [p for p in (out / ".cache" / "sft").iterdir() if p.is_dir()]
    return out, run, entry, ref


class _Locate(pickle.Unpickler):
    """Reads a ``torch.save`` zip's ``data.pkl`` without torch: each tensor becomes
    ``(storage key, element offset, storage type)`` (test-only; plain containers and numbers pass)."""

    def persistent_load(self, pid):
        return pid[2], pid[1]  # ("storage", storage type, key, location, numel)

    def find_class(self, module, name):
        if name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return lambda storage, offset, *rest: (storage[0], offset, storage[1])
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch":
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def _element_offset(path: Path, names: list) -> int:
    """Byte offset in ``path`` of the first element of the tensor at ``names`` (keys into the
    saved object), found from the zip's own layout, so the flip hits exactly that tensor."""
    with zipfile.ZipFile(path) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        obj = _Locate(io.BytesIO(z.read(pkl))).load()
        for k in names:
            obj = obj[k]
        key, offset, storage_type = obj
        assert storage_type is torch.FloatStorage, storage_type
        info = z.getinfo(f"{pkl[: -len('data.pkl')]}data/{key}")
    with open(path, "rb") as f:  # the member's data follows its local header (30 bytes, name, extra)
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len + 4 * offset


def _flip_exponent_bit(path: Path, *names) -> None:
    """Flip the lowest exponent bit (bit 23: 1.0 <-> 2.0) of the first element of the float32
    tensor at ``names`` inside ``path``, in place, as a disk would."""
    at = _element_offset(path, list(names)) + 2  # little-endian: bits 16..23 are the third byte
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x80]))


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_bit_rot_in_a_checkpoint_is_refused_and_the_advised_restart_ends_as_before(sweep):
    out, run, _, ref = sweep
    ckpt = run / "checkpoint" / "state.pt"
    before = torch.load(ckpt, weights_only=True)["model"]["model.norm.weight"][0].item()
    _flip_exponent_bit(ckpt, "model", "model.norm.weight")
    after = torch.load(ckpt, weights_only=True)["model"]["model.norm.weight"][0].item()
    assert after in (2 * before, before / 2)  # one flipped bit, the rest of the file as it was
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = _launch(out)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert "FAILED" in text and str(ckpt) in text and "model.norm.weight" in text, text[-3000:]
    assert "digest" in text and "delete it and relaunch: the cell restarts from step 0" in text, text[-3000:]
    assert "Traceback" not in proc.stderr.split("FAILED", 1)[1]
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained on the rotten weights
    ckpt.unlink()  # what the message says
    again = _launch(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert RunDir(run).state == "DONE"
    assert _no_perf(RunDir(run).read_metrics()) == _no_perf(ref)


def test_bit_rot_in_an_adam_moment_is_refused_naming_it(sweep):
    from fp8rl.backends.mini.checkpoint import CheckpointRefused, load_state

    _, run, _, _ = sweep
    ckpt = run / "checkpoint" / "state.pt"
    last = max(torch.load(ckpt, weights_only=True)["optimizer"]["state"])  # the last parameter's moments
    name = f"optimizer.state.{last}.exp_avg_sq"
    _flip_exponent_bit(ckpt, "optimizer", "state", last, "exp_avg_sq")
    with pytest.raises(CheckpointRefused) as e:
        load_state(ckpt, "cpu")
    msg = str(e.value)
    assert "\n" not in msg and str(ckpt) in msg and name in msg


def _strip_digest(ckpt: Path) -> dict:
    """Rewrite ``ckpt`` as checkpoints were written before digests; returns its state."""
    state = torch.load(ckpt, weights_only=True)
    del state["digest"]
    torch.save(state, ckpt)
    return state


def test_a_checkpoint_written_before_digests_loads_with_a_note_and_crc_still_catches_rot(sweep, capfd):
    from fp8rl.backends.mini.checkpoint import CheckpointRefused, load_state

    _, run, _, _ = sweep
    ckpt = run / "checkpoint" / "state.pt"
    old = _strip_digest(ckpt)
    state = load_state(ckpt, "cpu")
    assert state["step"] == old["step"] == 3
    assert torch.equal(state["model"]["model.norm.weight"], old["model"]["model.norm.weight"])
    assert "written before tensor digests" in capfd.readouterr().err
    _flip_exponent_bit(ckpt, "model", "model.norm.weight")
    with pytest.raises(CheckpointRefused) as e:
        load_state(ckpt, "cpu")
    assert "CRC-32" in str(e.value) and str(ckpt) in str(e.value)


# --- the SFT warm-start cache ----------------------------------------------------------------


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_bit_rot_in_the_warm_start_cache_is_refused_and_retrains_the_same_weights(sweep):
    out, _, entry, _ = sweep
    model = entry / "model.pt"
    weights = torch.load(model, weights_only=True)
    _flip_exponent_bit(model, "model.norm.weight")
    proc = _launch(out, "seed=1")  # a new cell on the same warm start
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert f"{model}: the SFT warm-start cache entry is damaged" in text, text[-3000:]
    assert "model.norm.weight" in text and f"Delete {entry} and relaunch" in text, text[-3000:]
    shutil.rmtree(entry)  # what the message says
    again = _launch(out, "seed=1")
    assert again.returncode == 0, again.stderr[-3000:]
    again_weights = torch.load(model, weights_only=True)
    assert all(torch.equal(again_weights[k], v) for k, v in weights.items())  # the same weights


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_as_the_cache_is_named_and_never_run(sweep, tmp_path):
    out, _, entry, _ = sweep
    marker = tmp_path / "PWNED"
    with open(entry / "model.pt", "wb") as f:
        pickle.dump({"model.norm.weight": _Payload(str(marker))}, f)
    proc = _launch(out, "seed=1")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert not marker.exists()
    assert f"{entry / 'model.pt'}: the SFT warm-start cache entry is damaged" in text, text[-3000:]
    assert "weights_only=False" not in text and "weights_only` set to `False" not in text, text[-3000:]


def test_a_crafted_pickle_inside_torchs_zip_as_the_cache_leaves_no_torch_advice_in_run_log(sweep, tmp_path):
    """The pickle inside torch's own zip format reaches ``torch.load(weights_only=True)``, whose
    error advises ``weights_only=False``: the cell's ``run.log`` (its traceback with every cause)
    must not repeat that advice (it used to, through the refusal's chained cause)."""
    out, _, entry, _ = sweep
    marker = tmp_path / "PWNED"
    torch.save({"model.norm.weight": _Payload(str(marker))}, entry / "model.pt")
    proc = _launch(out, "seed=1")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert not marker.exists()
    (run,) = [p for p in (out / "smoke").iterdir() if "-s1-" in p.name]
    log = (run / "run.log").read_text(encoding="utf-8")
    assert f"{entry / 'model.pt'}: the SFT warm-start cache entry is damaged" in log, log[-3000:]
    assert "could run code; it was not unpickled" in log, log[-3000:]
    for advice in ("weights_only=False", "weights_only` set to `False", "will likely succeed"):
        assert advice not in log and advice not in text, log[-3000:]


@pytest.mark.parametrize("damage", ["model-truncated", "model-zip-pickle", "meta-truncated", "meta-a-list"])
def test_a_damaged_cache_entry_is_named(sweep, tmp_path, damage):
    from fp8rl.backends.mini.sft import CacheRefused, load_cached

    _, _, entry, _ = sweep
    marker = tmp_path / "PWNED"
    name = "meta.json" if damage.startswith("meta") else "model.pt"
    path = entry / name
    data = path.read_bytes()
    if damage == "model-zip-pickle":  # torch's own zip format around a pickle that would run code
        torch.save({"model.norm.weight": _Payload(str(marker))}, path)
    elif damage == "meta-a-list":
        path.write_text("[1, 2]")
    else:
        path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheRefused) as e:
        load_cached(entry, "cpu")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and f"Delete {entry}" in msg, msg
    assert "weights_only" not in msg
    assert not marker.exists()


def test_a_cache_entry_written_before_digests_loads_with_a_note(sweep, capfd):
    import json

    from fp8rl.backends.mini.sft import load_cached

    _, _, entry, _ = sweep
    meta = json.loads((entry / "meta.json").read_text())
    del meta["digest"]
    (entry / "meta.json").write_text(json.dumps(meta))
    got_meta, state = load_cached(entry, "cpu")
    assert "digest" not in got_meta and "model.norm.weight" in state
    assert "written before tensor digests" in capfd.readouterr().err


# --- a damaged status.json in a sweep -----------------------------------------------------------


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_a_damaged_status_is_reported_and_the_other_cells_run(sweep):
    out, run, _, ref = sweep
    status = run / "status.json"
    status.write_bytes(b"\xff\xfe")
    proc = _launch(out, fp8="bf16,tensorwise")  # a two-cell sweep: the other cell is new
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    line = next(ln for ln in text.splitlines() if "DAMAGED" in ln and run.name in ln)
    assert str(status) in line and "delete it and relaunch: the cell resumes from its checkpoint" in line, line
    (other,) = [p for p in (out / "smoke").iterdir() if "tensorwise" in p.name]
    assert RunDir(other).state == "DONE"
    assert status.read_bytes() == b"\xff\xfe" and (run / "checkpoint" / "state.pt").exists()
    status.unlink()  # what the message says
    again = _launch(out, fp8="bf16,tensorwise")
    assert again.returncode == 0, again.stderr[-3000:]
    assert RunDir(run).state == "DONE"
    assert _no_perf(RunDir(run).read_metrics()) == _no_perf(ref)  # resumed, every step once


@pytest.mark.parametrize("content", [b'{"state": "RUNN', b"[1, 2]", b"\xff\xfe"], ids=["cut", "a-list", "not-utf8"])
def test_a_damaged_status_is_refused_with_a_fix_that_keeps_the_checkpoint(tmp_path, content):
    from fp8rl.runs.jsonl import RunDirDamaged

    rd = RunDir(tmp_path / "run")
    rd.set_status("RUNNING", 2)
    rd.status_path.write_bytes(content)
    with pytest.raises(RunDirDamaged) as e:
        rd.status()
    msg = str(e.value)
    assert "\n" not in msg and str(rd.status_path) in msg and "delete the run directory" not in msg, msg
    assert "resumes from its checkpoint" in msg


# --- a damaged manifest.json ----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["launch", "status", "report"])
def test_a_damaged_manifest_is_one_line_from_each_command(sweep, command):
    out, _, _, _ = sweep
    manifest = out / "smoke" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    if command == "launch":
        proc = _launch(out)
    else:
        args = {"status": ["experiments.status", str(out / "smoke"), "--no-slurm"],
                "report": ["analysis.report", str(out / "smoke"), "--no-progress", "--figures", "entropy"]}[command]
        proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode in (1, 2), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if str(manifest) in ln]
    assert "is damaged" in line and "delete it and relaunch the sweep" in line, line
    assert manifest.read_text() == text[: len(text) // 2]  # nothing written over it
    assert not (out / "smoke" / "report").exists()
