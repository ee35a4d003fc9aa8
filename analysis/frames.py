"""The tables ``analysis.collect`` returns: :class:`Collection`, the cell states, and the
assembly of per-run columns into the ``steps`` frame (categorical axes, one float column per
metric, NaN where a run did not log it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.arms import arm_order_key
from fp8rl.runs import metrics as M
from fp8rl.runs.manifest import AXES

CELL_OK, CELL_MISSING, CELL_FAILED, CELL_INCOMPLETE, CELL_UNLISTED, CELL_DAMAGED = (
    "ok",
    "missing",
    "failed",
    "incomplete",
    "unlisted",
    "damaged",
)
RUN_COLUMNS = [
    "sweep", "run", "name", "hash", *AXES, "arm", "state", "status_step", "reason", "cell",
    "in_manifest", "n_rows", "first_step", "last_step", "truncated_tail", "bad_lines",
    "duplicate_steps", "code", "cpu", "steps_configured", "summary", "run_dir",
]
EVAL_COLUMNS = ["run", "step", "dataset", "stat", "k", "n", "value", "precision"]


@dataclasses.dataclass
class Collection:
    """The tables of one or more sweeps (see the module docstring for their columns)."""

    runs: pd.DataFrame
    steps: pd.DataFrame
    evals: pd.DataFrame
    problems: pd.DataFrame
    notes: list[str]
    sweep_dirs: list[Path]

    @property
    def metrics(self) -> list[str]:
        """Metric columns present in ``steps``."""
        return [c for c in self.steps.columns if "/" in c]

    def long(self, metrics: Sequence[str] | None = None) -> pd.DataFrame:
        """``steps`` melted to ``run, step, <axes>, arm, metric, value`` (NaN rows dropped)."""
        metrics = list(metrics) if metrics is not None else self.metrics
        metrics = [m for m in metrics if m in self.steps.columns]
        ids = [c for c in self.steps.columns if "/" not in c]
        out = self.steps.melt(id_vars=ids, value_vars=metrics, var_name="metric", value_name="value")
        return out.dropna(subset=["value"]).reset_index(drop=True)

    def arms(self) -> list[tuple[str, str]]:
        """``(fp8, clip)`` pairs of all cells, in display order."""
        pairs = {(str(f), str(c)) for f, c in zip(self.runs["fp8"], self.runs["clip"], strict=True)}
        return sorted(pairs, key=lambda p: arm_order_key(*p))



def axis_columns(runs: pd.DataFrame, run_idx: np.ndarray) -> dict[str, object]:
    out: dict[str, object] = {}
    for col in ("run", "algorithm", "model", "fp8", "clip", "scale", "arm"):
        cat = pd.Categorical(runs[col].astype("string"))
        out[col] = pd.Categorical.from_codes(cat.codes[run_idx], categories=cat.categories)
    out["seed"] = runs["seed"].to_numpy()[run_idx]
    return out


def build_steps(runs: pd.DataFrame, parts: list[tuple[int, np.ndarray, dict]]) -> pd.DataFrame:
    names: dict[str, None] = {}
    for _, _, cols in parts:
        for k in cols:
            names[k] = None
    metric_names = sorted(names, key=metric_order)
    if not parts:
        return pd.DataFrame(columns=["run", "step", "algorithm", "model", "fp8", "clip", "seed",
                                     "scale", "arm", *metric_names])
    lens = np.array([len(s) for _, s, _ in parts])
    run_idx = np.repeat(np.array([i for i, _, _ in parts]), lens)
    data: dict[str, object] = {}
    ax = axis_columns(runs, run_idx)
    data["run"] = ax.pop("run")
    data["step"] = np.concatenate([s for _, s, _ in parts])
    data.update(ax)
    for m in metric_names:
        data[m] = np.concatenate([cols[m] if m in cols else np.full(len(s), np.nan) for _, s, cols in parts])
    return pd.DataFrame(data)


def metric_order(name: str) -> tuple:
    known = {m: i for i, m in enumerate(M.TRAIN_METRICS)}
    return (0, known[name], "") if name in known else (1, 0, name)
