"""W&B run ids: unique per sweep directory and cell, stable across resumes (and a moved sweep)."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

from fp8rl.runs.live import WANDB_ID_FILE, LiveLog, wandb_run_id

CELL = "grpo-8b-bf16-vanilla-s0-0123abcd"


def test_same_cell_in_two_sweeps_gets_two_ids(tmp_path):
    a, b = tmp_path / "runs" / "quick" / CELL, tmp_path / "runs" / "main_table" / CELL
    other_root = tmp_path / "elsewhere" / "quick" / CELL
    for d in (a, b, other_root):
        d.mkdir(parents=True)
    ids = {wandb_run_id(a), wandb_run_id(b), wandb_run_id(other_root)}
    assert len(ids) == 3
    assert all(i.startswith(CELL + "-") and not set(i) & set("/\\#?%: ") for i in ids)


def test_id_is_stable_across_resumes_and_a_moved_sweep(tmp_path):
    rd = tmp_path / "runs" / "quick" / CELL
    rd.mkdir(parents=True)
    first = wandb_run_id(rd)
    assert (rd / WANDB_ID_FILE).read_text().strip() == first
    assert wandb_run_id(rd) == first  # a resume in place
    moved = tmp_path / "scratch" / "quick"
    shutil.copytree(tmp_path / "runs" / "quick", moved)
    assert wandb_run_id(moved / CELL) == first  # output_dir=NEW resumes the same W&B run
    fresh = tmp_path / "other" / "quick" / CELL  # the same cell started afresh elsewhere: a new run
    fresh.mkdir(parents=True)
    assert wandb_run_id(fresh) != first


def test_live_log_passes_the_id_to_wandb(tmp_path, monkeypatch):
    seen = {}

    class _Run:
        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or _Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = types.SimpleNamespace(tensorboard=False, wandb_project="p", wandb_entity=None, wandb_mode="offline")
    ids = []
    for sweep in ("quick", "main_table"):
        rd = Path(tmp_path / sweep / CELL)
        rd.mkdir(parents=True)
        with LiveLog(rd, cfg):
            pass
        assert seen["id"] == wandb_run_id(rd) and seen["name"] == CELL and seen["group"] == sweep
        assert seen["resume"] == "allow"
        ids.append(seen["id"])
    assert ids[0] != ids[1]
