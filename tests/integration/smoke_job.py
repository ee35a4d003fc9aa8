"""The smoke job's run directories and readers, shared by the tests that check what
``make paper-smoke`` left in ``runs/paper_smoke`` (``test_int_paper_smoke.py``: the FP8 side and
the whole path; ``test_int_smoke_algorithm.py``: the RL algorithm around it). Imported as
``smoke_job``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SWEEP = Path(os.environ.get("FP8RL_PAPER_SMOKE_DIR", REPO / "runs" / "paper_smoke"))
REFERENCE = Path(os.environ.get("FP8RL_PAPER_SMOKE_REFERENCE_DIR", SWEEP.parent / "paper_smoke_reference"))
COVERAGE = SWEEP.parent / "paper_smoke_coverage"
CELLS = {  # run-name prefix -> (rollout FP8?, trainer FP8?, algorithm, clip method)
    "grpo-8b-bf16-vanilla": (None, False, "grpo", "vanilla"),
    "grpo-8b-rowwise-calibrated": ("fp8_per_channel", True, "grpo", "calibrated"),
    "dapo-8b-tensorwise-score_centering_tis": ("fp8_per_tensor", True, "dapo", "vanilla"),  # + TIS + Score Centering
    "dapo-8b-rollout_only-vanilla": ("fp8_per_tensor", False, "dapo", "vanilla"),
}
INTERRUPTED = "grpo-8b-rowwise-calibrated"
STEPS = 3
LINEARS = 14  # 2 decoder layers x (q, k, v, o, gate, up, down); the LM head stays BF16
ENGINE_LINEARS = 8  # vLLM fuses them: 2 layers x (qkv, o, gate_up, down)


def find_runs() -> dict[str, Path]:
    """The cells' run directories (the integration tier's ``runs`` fixture, conftest.py). ``FP8RL_PAPER_SMOKE_PARTIAL=1`` accepts a subset (the planted-bug
    checks of docs/cluster.md run one cell with a bug planted and point ``FP8RL_PAPER_SMOKE_DIR``
    at it)."""
    dirs = {p.name: p for p in SWEEP.glob("*") if (p / "config.yaml").exists()} if SWEEP.exists() else {}
    found = {prefix: next((p for n, p in dirs.items() if n.startswith(prefix + "-s0-")), None) for prefix in CELLS}
    missing = [k for k, v in found.items() if v is None]
    if os.environ.get("FP8RL_PAPER_SMOKE_PARTIAL") and len(missing) < len(CELLS):
        return {k: v for k, v in found.items() if v is not None}
    if missing:
        msg = f"{SWEEP} lacks {missing}: run `make paper-smoke` first"
        if os.environ.get("FP8RL_REQUIRE_PAPER_SMOKE"):
            pytest.fail(msg)
        pytest.skip(msg)
    return found


def jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def metrics(run: Path) -> dict[int, dict]:
    rows = jsonl(run / "metrics.jsonl")
    return {int(r["step"]): r for r in rows}


def syncs(run: Path) -> list[dict]:
    return jsonl(run / "openrlhf" / "dumps" / "engine_syncs.jsonl")


def loss_dumps(run: Path) -> dict[int, list[dict]]:
    """Step (1-based) -> the loss inputs its micro-batches dumped (``rank<R>-<pid>-<N>.pt``), each
    rank's last attempt only: an interrupted cell may have run the step it was killed in twice."""
    import torch

    recs = [torch.load(p, weights_only=False) for p in sorted((run / "openrlhf" / "dumps").glob("rank*-*.pt"))]
    out: dict[int, list[dict]] = {}
    for step in sorted({r["step"] for r in recs}):
        mine = [r for r in recs if r["step"] == step]
        last = {rank: max((r for r in mine if r["rank"] == rank), key=lambda r: r["time"])["pid"]
                for rank in {r["rank"] for r in mine}}
        out[step + 1] = [r for r in mine if r["pid"] == last[r["rank"]]]
    return out
