"""Which runs may be pooled into one report, and the finished runs the headline ratios use.

**Groups.** Runs are samples of the same thing only when they come from the same sweep, the
same code and the same CPU numerics: the same seed gives another SFT warm start on a CPU with
other vector extensions or another thread count (``fp8rl.runs.provenance``), and a commit may
change what trains. A run's group is therefore (``sweep``, ``code``, ``cpu``) as its
``provenance.json`` and ``config.yaml`` record them (``analysis.rundir_read.run_origin``;
``not recorded`` where a file is absent: such runs form their own group). Cells without a run
directory (missing) and damaged cells (``analysis.damage``: an unreadable ``provenance.json`` or
``config.yaml`` says nothing trustworthy about where the run comes from) belong to no group; they
are listed in the report of every group of their sweep.

``python -m analysis.report`` refuses to pool runs of two or more groups unless told how
(:func:`refusal` is its message): ``--separate`` writes one report per group, ``--pool``
pools them knowingly and report.md lists the groups (:func:`provenance_lines`).

**Finished runs.** :func:`finished` is the collection restricted to runs whose cell is ``ok``
(``DONE`` at the ``steps`` their config asks for): the headline ratios (x BF16, the half-width
criterion, the findings summary) use only those; where unfinished runs still count (the
diagnostics table, the line figures) the report marks them (:func:`unfinished_note`).
"""

from __future__ import annotations

import re

import pandas as pd

from analysis.collect import CELL_DAMAGED, CELL_MISSING, CELL_OK, Collection
from analysis.rundir_read import NOT_RECORDED

GROUP_KEYS: tuple[str, ...] = ("sweep", "code", "cpu")


def groups(coll: Collection) -> pd.DataFrame:
    """One row per (sweep, code, cpu) of the runs that have a run directory and are not damaged:
    those columns and ``runs`` (how many), sorted; empty when no run has one."""
    r = coll.runs[~_grouped_out(coll.runs)]
    if r.empty:
        return pd.DataFrame(columns=[*GROUP_KEYS, "runs"])
    keyed = r[list(GROUP_KEYS)].astype(object).where(r[list(GROUP_KEYS)].notna(), NOT_RECORDED).astype(str)
    return keyed.value_counts().rename("runs").reset_index().sort_values(list(GROUP_KEYS)).reset_index(drop=True)


def _grouped_out(r: pd.DataFrame) -> pd.Series:
    """Cells of no group: missing (no run directory) or damaged (nothing trustworthy says where
    the run comes from); an unlisted damaged run directory too."""
    damaged = (r["cell"] == CELL_DAMAGED) | r["reason"].astype(str).str.startswith(
        f"run directory not in manifest ({CELL_DAMAGED}")
    return (r["cell"] == CELL_MISSING) | damaged


def group_text(g) -> str:
    """``"main_table · code 0419624 · AMD EPYC (avx2 fma f16c), 1 thread: 90 runs"``."""
    n = int(g["runs"])
    return f"{g['sweep']} · code {g['code']} · CPU {g['cpu']}: {n} run{'s' if n != 1 else ''}"


def refusal(gs: pd.DataFrame) -> str:
    """The message of a report that will not pool ``gs`` (two or more groups)."""
    lines = [f"refusing to pool runs of {len(gs)} groups (sweep · code · CPU numerics, from each run's "
             "provenance.json and config.yaml):"]
    lines += [f"  {group_text(g)}" for _, g in gs.iterrows()]
    lines += ["Runs of another sweep, commit or CPU are other samples (another SFT warm start), not more seeds.",
              "Report each group on its own with --separate (OUT/<group>/report.md), or pool them knowingly with "
              "--pool (report.md then lists the groups)."]
    return "\n".join(lines)


def slugs(gs: pd.DataFrame) -> list[str]:
    """A directory name per group: the fields that differ between the groups, joined by ``-``."""
    differ = [k for k in GROUP_KEYS if gs[k].nunique() > 1] or ["sweep"]
    out = []
    for _, g in gs.iterrows():
        s = "-".join(str(g[k]) for k in differ)
        out.append(re.sub(r"[^A-Za-z0-9_.+-]+", "_", s).strip("_") or "group")
    return out


def subset(coll: Collection, runs) -> Collection:
    """``coll`` restricted to the runs named in ``runs`` (every table; notes kept)."""
    keep = {str(r) for r in runs}
    sel = coll.runs["run"].astype(str).isin(keep)

    def rows(df: pd.DataFrame) -> pd.DataFrame:
        if df.empty or "run" not in df.columns:
            return df
        return df[df["run"].astype(str).isin(keep)].reset_index(drop=True)

    return Collection(runs=coll.runs[sel].reset_index(drop=True), steps=rows(coll.steps), evals=rows(coll.evals),
                      problems=rows(coll.problems), notes=list(coll.notes), sweep_dirs=list(coll.sweep_dirs))


def group_subsets(coll: Collection) -> list[tuple[str, Collection]]:
    """``(directory name, collection)`` per group; the missing and damaged cells of a sweep go with
    every group of that sweep (so each report lists them)."""
    gs = groups(coll)
    out = []
    r = coll.runs
    for slug, (_, g) in zip(slugs(gs), gs.iterrows(), strict=True):
        out_of_groups = _grouped_out(r)
        mine = ~out_of_groups & (r["sweep"].astype(str) == g["sweep"])
        for k in ("code", "cpu"):
            mine &= r[k].astype(object).where(r[k].notna(), NOT_RECORDED).astype(str) == g[k]
        missing = out_of_groups & (r["sweep"].astype(str) == g["sweep"])
        out.append((slug, subset(coll, r.loc[mine | missing, "run"])))
    return out


def finished(coll: Collection) -> Collection:
    """The runs that finished (cell ``ok``): what every headline ratio is computed from."""
    return subset(coll, coll.runs.loc[coll.runs["cell"] == CELL_OK, "run"])


def unfinished(coll: Collection) -> pd.DataFrame:
    """Runs that logged steps but did not finish: ``run, arm, cell, reason`` (not the damaged ones:
    their steps are left out of every table and figure)."""
    r = coll.runs
    m = ((r["cell"] != CELL_OK) & (pd.to_numeric(r["n_rows"], errors="coerce").fillna(0) > 0)
         & ~_grouped_out(r))
    return r.loc[m, ["run", "arm", "cell", "reason"]].reset_index(drop=True)


def unfinished_note(coll: Collection, where: str) -> str:
    """One sentence naming the unfinished runs that count in ``where`` ("" when none)."""
    u = unfinished(coll)
    if u.empty:
        return ""
    names = "; ".join(f"{r.run} ({r.reason or r.cell})" for r in u.itertuples(index=False))
    return f"{where} include{'s' if where.endswith('table') else ''} {len(u)} unfinished run(s), marked: {names}."


def provenance_lines(coll: Collection, pooled: bool) -> list[str]:
    """report.md's statement of which groups its runs come from."""
    gs = groups(coll)
    if gs.empty:
        return ["No run directory."]
    if len(gs) == 1:
        g = gs.iloc[0]
        return [f"All {int(g['runs'])} runs come from one sweep, one commit and one CPU: {group_text(g)}."]
    head = ("**Pooled knowingly (`--pool`)**: these runs come from " if pooled
            else "These runs come from ")
    return [head + f"{len(gs)} groups (sweep · code · CPU numerics, from provenance.json and config.yaml); "
            "other code or another CPU gives other warm starts, so seeds of different groups are other samples:",
            "", *(f"- {group_text(g)}" for _, g in gs.iterrows())]
