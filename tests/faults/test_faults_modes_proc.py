"""Run files get the user's umask, not ``mkstemp``'s 0600: a lab shares run directories.

A real mini run in a subprocess started under a umask (as a person's shell would start it);
every file it writes atomically (``config.yaml``, ``status.json``, ``provenance.json``,
``summary.json``, the checkpoint) and the sweep's ``manifest.json`` must have mode
``0666 & ~umask``, like the files it appends to (``metrics.jsonl``).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.runs.safe_io import atomic_write_bytes, current_umask

REPO = Path(__file__).resolve().parents[2]
#: a run of two tiny steps without a warm start (seconds)
TINY = ["steps=2", "prompts_per_step=2", "num_mini_batches=2", "max_response_len=16", "eval_every=0",
        "eval_k=1", "checkpoint_every=1", "samples_every=0", "algorithm.n_samples_per_prompt=2",
        "mini.n_train=64", "mini.n_eval=2", "mini.sft_steps=0", "mini.num_threads=1"]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_atomic_writer_gives_the_umask_mode(tmp_path, mask):
    old = os.umask(mask)
    try:
        assert current_umask() == mask
        atomic_write_bytes(tmp_path / "f.json", b"{}")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "f.json") == 0o666 & ~mask


@pytest.mark.parametrize("mask", ["022", "002"])
def test_a_real_run_writes_its_files_with_the_users_umask(tmp_path, mask):
    out = tmp_path / "runs"
    cmd = (f"umask {mask} && exec {sys.executable} -m experiments.launch +sweep=smoke fp8=bf16 clip=vanilla "
           f"steps=2 checkpoint_every=1 workers=1 output_dir={out}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    want = 0o666 & ~int(mask, 8)
    (run,) = [p for p in (out / "smoke").iterdir() if p.is_dir() and not p.name.startswith(".")]
    files = [run / n for n in ("config.yaml", "overrides.txt", "status.json", "provenance.json", "summary.json",
                               "metrics.jsonl")] + [out / "smoke" / "manifest.json"]
    files += list((run / "checkpoint").glob("*"))
    got = {str(p.relative_to(out)): oct(_mode(p)) for p in files if p.is_file()}
    assert len(got) >= len(files) - 1, got
    assert set(got.values()) == {oct(want)}, got
