"""Evaluations: ``eval.jsonl`` rows -> entries, the ``evals`` frame, each run's final evaluation.

Two engines may score one evaluation (``fp8rl.runs.metrics``): the arm's own rollout engine
(``eval/`` keys) and a BF16 engine on the same weights (``eval_bf16/``). The ``evals`` frame keeps
them apart in its ``precision`` column (``"own"`` / ``"bf16"``, ``M.EVAL_PRECISIONS``), and every
reader selects one (:func:`select_evals`; the arm's own by default, as before the BF16 engine
existed, so runs without ``eval_bf16/`` keys read as they always did).

Choices: a run's *final* evaluation (:func:`final_evals`) is the ``eval/<dataset>/<stat>``
(``eval_bf16/...`` for the BF16 engine) value in ``summary.json`` when present (the backend's
final numbers), else the eval row with the largest step. When several rows share a (step,
dataset, statistic, precision), the last one wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from analysis.frames import CELL_OK, EVAL_COLUMNS, Collection, axis_columns
from analysis.jsonl import _num
from fp8rl.runs import metrics as M
from fp8rl.runs.manifest import AXES


def eval_entries(rows: Iterable[dict]) -> list[tuple]:
    """eval.jsonl rows -> ``(step, dataset, stat, k, n, value, precision)`` tuples.

    Accepts the canonical layout (``eval/<ds>/avg@k`` and ``eval_bf16/<ds>/avg@k`` keys plus
    ``k``/``n`` fields), a numeric k in the key (``eval/<ds>/avg@16``), rows holding several
    datasets, and bare ``avg@k``/``pass@k`` keys next to a ``dataset`` field (the arm's own).
    """
    out = []
    for r in rows:
        step = r.get(M.STEP)
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        k_row, n_row, ds_row = r.get(M.EVAL_K), r.get(M.EVAL_N), r.get(M.EVAL_DATASET)
        for key, value in r.items():
            parsed = M.split_eval_key(key)
            if parsed is None and ds_row is not None and "/" not in key:
                parsed = M.split_eval_key(f"{M.EVAL_PREFIX}{ds_row}/{key}")
            if parsed is None:
                continue
            ds, stat, k, precision = parsed
            out.append((step, ds, stat, k if k is not None else k_row, n_row, _num(value), precision))
    return out


def select_evals(ev: pd.DataFrame, stat: str, precision: str = M.EVAL_OWN) -> pd.DataFrame:
    """The rows of an ``evals`` frame of one statistic scored by one engine (``precision``:
    ``"own"``, the arm's rollout engine, or ``"bf16"``)."""
    if precision not in M.EVAL_PRECISIONS:
        raise ValueError(f"precision must be one of {M.EVAL_PRECISIONS}, got {precision!r}")
    if not len(ev):
        return ev
    return ev[(ev["stat"] == stat) & (ev["precision"] == precision)]


def has_evals(coll: Collection, stat: str, precision: str = M.EVAL_OWN) -> bool:
    """Whether any run has an evaluation of ``stat`` by the engine ``precision``."""
    return len(select_evals(coll.evals, stat, precision)) > 0



def build_evals(runs: pd.DataFrame, parts: list[tuple[int, list]]) -> pd.DataFrame:
    if not parts:
        return pd.DataFrame(columns=[*EVAL_COLUMNS, "algorithm", "model", "fp8", "clip", "seed",
                                     "scale", "arm"])
    run_idx = np.concatenate([np.full(len(e), i) for i, e in parts])
    flat = [t for _, e in parts for t in e]
    df = pd.DataFrame(flat, columns=["step", "dataset", "stat", "k", "n", "value", "precision"])
    ax = axis_columns(runs, run_idx)
    df.insert(0, "run", ax.pop("run"))
    for k, v in ax.items():
        df[k] = v
    df["k"] = pd.to_numeric(df["k"], errors="coerce").astype("Int64")
    df["n"] = pd.to_numeric(df["n"], errors="coerce").astype("Int64")
    # last row wins per (run, step, dataset, stat, precision)
    df = df.drop_duplicates(subset=["run", "step", "dataset", "stat", "precision"], keep="last")
    return df.sort_values(["run", "precision", "dataset", "stat", "step"], kind="stable").reset_index(drop=True)


def final_evals(coll: Collection, stat: str = M.EVAL_AVG, *, cells: Sequence[str] = (CELL_OK,),
                precision: str = M.EVAL_OWN) -> pd.DataFrame:
    """Each run's final evaluation per dataset: ``run, dataset, value, step, source`` + axes.

    Only runs whose ``cell`` is in ``cells`` (default: finished runs). ``source`` is
    ``"summary"`` when ``summary.json`` holds ``eval/<dataset>/<stat>`` (``eval_bf16/...`` with
    ``precision="bf16"``), else ``"eval"`` (the eval row with the largest step).
    """
    runs = coll.runs[coll.runs["cell"].isin(cells)]
    rows = []
    ev = select_evals(coll.evals, stat, precision)
    last = ev.sort_values("step").groupby(["run", "dataset"], observed=True).tail(1) if len(ev) else ev
    last_by_run: dict[str, list] = {}
    for r in last.itertuples(index=False):
        last_by_run.setdefault(str(r.run), []).append(r)
    for r in runs.itertuples(index=False):
        from_summary: dict[str, float] = {}
        if isinstance(r.summary, dict):
            for key, v in r.summary.items():
                p = M.parse_eval_key(key, precision=precision)
                if p is not None and p[1] == stat:
                    from_summary[p[0]] = _num(v)
        for e in last_by_run.get(r.run, []):
            if e.dataset not in from_summary:
                rows.append((r.run, e.dataset, float(e.value), int(e.step), "eval"))
        for ds, v in from_summary.items():
            rows.append((r.run, ds, v, r.last_step, "summary"))
    df = pd.DataFrame(rows, columns=["run", "dataset", "value", "step", "source"])
    axes = coll.runs[["run", *AXES, "arm"]]
    return df.merge(axes, on="run", how="left")
