"""``make reproduce-surge`` runs ``surge_dose`` one seed block at a time: the same cells as the plain
launches.

The recipe's loop runs for real with the launcher swapped for ``echo`` (the only stand-in: it
captures the arguments the loop passes); each captured command then goes through the real
launcher as a dry run, and its run directories must be exactly those that the two plain commands
(``+sweep=surge_dose fp8=bf16 clip=vanilla`` and ``+sweep=surge_dose``, six seeds) plan for those
seeds: 17 per seed, nothing more, so the published blocks are the sweep's own cells.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEEDS = (2, 5)


def _dirs(launch, tmp_path, *args: str) -> set[str]:
    res = launch(*args, "dry_run=true", f"output_dir={tmp_path}")
    assert res.code == 0, res.err
    dirs = re.findall(r"^    run dir:\s+(\S+)$", res.out, re.M)
    assert dirs, res.out
    return {Path(d).name for d in dirs}


def _recipe(*make_args: str) -> list[list[str]]:
    out = subprocess.run(["make", "--no-print-directory", "-o", "install-run", "reproduce-surge",
                          "LAUNCH=echo launch", *make_args],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [shlex.split(ln)[1:] for ln in out.stdout.splitlines() if ln.startswith("launch ")]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_seed_blocks_are_the_plain_launches_cells(launch, tmp_path):
    cmds = _recipe(f"SURGE_SEEDS={' '.join(map(str, SEEDS))}")
    assert len(cmds) == 2 * len(SEEDS)  # per seed: the BF16 cell, then the 16-cell grid
    blocks = [_dirs(launch, tmp_path, *c) for c in cmds]
    assert [len(b) for b in blocks] == [1, 16] * len(SEEDS)
    for i, s in enumerate(SEEDS):  # block order: every cell of a seed before the next seed
        assert all(name.rsplit("-", 2)[1] == f"s{s}" for name in blocks[2 * i] | blocks[2 * i + 1])
    plain = _dirs(launch, tmp_path, "+sweep=surge_dose", "fp8=bf16", "clip=vanilla") \
        | _dirs(launch, tmp_path, "+sweep=surge_dose")
    assert len(plain) == 102
    wanted = {n for n in plain if n.rsplit("-", 2)[1] in {f"s{s}" for s in SEEDS}}
    assert set().union(*blocks) == wanted


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_default_blocks_are_the_six_seeds():
    cmds = _recipe()
    assert [c[-1] for c in cmds[::2]] == [f"seed={s}" for s in range(6)]
