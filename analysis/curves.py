"""What every figure shares: per-arm curves over seeds, the text style, saving with a caption.

:func:`arm_curves` turns a :class:`analysis.collect.Collection` into per (algorithm, model, arm,
step) statistics over seeds of the EMA-smoothed per-run curves: mean, std (ddof=1), the band
(the 95% t interval of the mean, cut to the metric's support: ``analysis.style``) and the
number of seeds; with ``paired=True`` of each run's curve minus its BF16 partner's (same seed). :func:`save_figure` writes a figure as PNG (200 dpi, the caption in
the PNG's ``Description`` text chunk) and, on request, PDF (TrueType fonts, the caption as the
PDF's ``Subject``). :func:`plain_yaxis` gives a linear axis tick labels without matplotlib's
offset or multiplier text (a ratio quantile near 1 reads ``1.000010``, not ``+1`` and ``1e-5``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker as mticker
import numpy as np
import pandas as pd

from analysis.arms import panel_order_key
from analysis.collect import Collection
from analysis.surge import ema
from fp8rl.runs import metrics as M

EVAL_AVG_METRIC = "eval/mean/avg@k"  # pseudo-metric: avg@k averaged over evaluation sets
MAX_COLS = 3  # panels per row before wrapping (single-metric figures) or narrowing
PAGE_WIDTH = 7.2  # inches: a two-column paper's text width

RC = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "pdf.fonttype": 42,
    "savefig.bbox": "tight",
}



class FigurePaths(dict):
    """``{"png": Path, "csv": Path[, "pdf": Path]}`` of one written figure, plus its ``caption``."""

    caption: str = ""


def spec_by_name(specs, name: str, what: str = "figure"):
    """The spec called ``name`` among ``specs`` (anything with a ``.name``); KeyError naming
    the valid ones."""
    for f in specs:
        if f.name == name:
            return f
    raise KeyError(f"unknown {what} {name!r}; valid names are: {', '.join(f.name for f in specs)}")


def _eval_mean_steps(coll: Collection) -> pd.DataFrame:
    """``run, step, eval/mean/avg@k`` (percent): avg@k of the arm's own engine averaged over the
    evaluation sets that the run evaluated at that step (only steps where every set of the run is
    present)."""
    from analysis.evals import select_evals

    ev = coll.evals
    if len(ev) == 0:
        return pd.DataFrame(columns=["run", "step", EVAL_AVG_METRIC])
    ev = select_evals(ev, M.EVAL_AVG)
    n_sets = ev.groupby("run", observed=True)["dataset"].nunique()
    g = ev.groupby(["run", "step"], observed=True)["value"].agg(["mean", "count"]).reset_index()
    g = g[g["count"].to_numpy() == n_sets.reindex(g["run"]).to_numpy()]
    return pd.DataFrame({"run": g["run"].astype(str), "step": g["step"].astype(np.int64),
                         EVAL_AVG_METRIC: 100.0 * g["mean"].to_numpy()})


def _series_table(coll: Collection, metric: str) -> pd.DataFrame:
    """``run, step, value`` for one metric (NaN dropped)."""
    if metric == EVAL_AVG_METRIC:
        df = _eval_mean_steps(coll).rename(columns={EVAL_AVG_METRIC: "value"})
    elif metric in coll.steps.columns:
        df = coll.steps[["run", "step", metric]].rename(columns={metric: "value"})
        df = df.assign(run=df["run"].astype(str))
    else:
        return pd.DataFrame(columns=["run", "step", "value"])
    return df.dropna(subset=["value"])


def auto_span(n_steps: int) -> float:
    """Default EMA span for a run of ``n_steps`` logged steps."""
    return float(max(1, round(n_steps / 50)))


def _smoothed_runs(coll: Collection, metric: str, smooth: float | None) -> pd.DataFrame:
    """``run, step, v``: each run's curve of ``metric``, EMA-smoothed (sparse metrics and the
    evaluation pseudo-metric are not)."""
    df = _series_table(coll, metric)
    if df.empty:
        return pd.DataFrame(columns=["run", "step", "v"])
    runs = coll.runs.set_index("run")
    parts = []
    for run, g in df.groupby("run", sort=False):
        g = g.sort_values("step")
        n_rows = runs.at[run, "n_rows"] if run in runs.index else len(g)
        sparse = metric != EVAL_AVG_METRIC and len(g) < 0.5 * max(int(n_rows or 0), 1)
        span = 1.0 if sparse or metric == EVAL_AVG_METRIC else (smooth or auto_span(len(g)))
        v = ema(g["value"].to_numpy(), span) if span > 1 else g["value"].to_numpy(dtype=float)
        parts.append(pd.DataFrame({"run": run, "step": g["step"].to_numpy(), "v": v}))
    return pd.concat(parts, ignore_index=True)


def paired_to_bf16(coll: Collection, per_run: pd.DataFrame) -> pd.DataFrame:
    """``per_run`` (``run, step, v``) minus, at the same step, the run of the block's BF16
    reference arm (``analysis.tabulate.bf16_reference``) with the same (sweep, seed); runs without
    such a partner, and the reference arm itself, are left out."""
    from analysis.tabulate import bf16_reference, blocks

    r = coll.runs[["run", "sweep", "algorithm", "model", "fp8", "clip", "seed"]].astype({"run": str})
    ref_runs = []
    for algo, model, arms in blocks(coll):
        ref = bf16_reference(arms)
        if ref is not None:
            m = ((r["algorithm"].astype(str) == algo) & (r["model"].astype(str) == model)
                 & (r["fp8"].astype(str) == ref[0]) & (r["clip"].astype(str) == ref[1]))
            ref_runs += r.loc[m, "run"].tolist()
    keyed = per_run.merge(r, on="run", how="left")
    is_ref = keyed["run"].isin(ref_runs)
    refs = keyed[is_ref].drop_duplicates(["sweep", "algorithm", "model", "seed", "step"], keep=False)
    refs = refs[["sweep", "algorithm", "model", "seed", "step", "v"]].rename(columns={"v": "v_ref"})
    out = keyed[~is_ref].merge(refs, on=["sweep", "algorithm", "model", "seed", "step"], how="inner")
    return pd.DataFrame({"run": out["run"], "step": out["step"], "v": out["v"] - out["v_ref"]})


def arm_curves(coll: Collection, metric: str, *, smooth: float | None = None, paired: bool = False,
               bounds: tuple[float, float] | None = None) -> pd.DataFrame:
    """Per (algorithm, model, arm, step): mean and std over seeds of smoothed per-run curves.

    Returns ``algorithm, model, fp8, clip, arm, metric, step, mean, std, lo, hi, n_seeds``
    (``lo``/``hi``: the band, the 95% t interval of the mean over seeds cut to ``bounds``,
    default the metric's support, ``analysis.style``; NaN below two seeds, as std); ``smooth``
    is the EMA span (None = :func:`auto_span` per run; sparse metrics are never smoothed).
    ``paired``: each run's curve minus its BF16 partner's (same sweep and seed, same step) before
    averaging (:func:`paired_to_bf16`); the bounds are then unbounded.
    """
    from analysis.style import mean_band, support

    cols = ["algorithm", "model", "fp8", "clip", "arm", "metric", "step", "mean", "std", "lo", "hi",
            "n_seeds"]
    per_run = _smoothed_runs(coll, metric, smooth)
    if paired and len(per_run):
        per_run = paired_to_bf16(coll, per_run)
    if per_run.empty:
        return pd.DataFrame(columns=cols)
    runs = coll.runs.set_index("run")[["algorithm", "model", "fp8", "clip", "arm"]]
    s = per_run.join(runs, on="run")
    agg = (
        s.groupby(["algorithm", "model", "fp8", "clip", "arm", "step"], observed=True)["v"]
        .agg(mean="mean", std="std", n_seeds="count")
        .reset_index()
    )
    agg["metric"] = metric
    agg.loc[agg["n_seeds"] < 2, "std"] = np.nan
    if bounds is None:
        bounds = (-math.inf, math.inf) if paired else support(metric)
    agg["lo"], agg["hi"] = mean_band(agg["mean"], agg["std"], agg["n_seeds"], bounds)
    return agg[cols]


def panels_of(coll: Collection) -> list[tuple[str, str]]:
    pairs = coll.runs[["algorithm", "model"]].dropna().astype(str).drop_duplicates()
    return sorted(map(tuple, pairs.to_numpy().tolist()), key=lambda p: panel_order_key(*p))


def format_number(x) -> str:
    return "" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.6g}"


def plain_yaxis(ax) -> None:
    """Tick labels without offset or multiplier: as many decimals as the tick spacing needs."""

    def fmt(v, _pos, ax=ax):
        ticks = ax.yaxis.get_majorticklocs()
        step = float(np.min(np.diff(ticks))) if len(ticks) > 1 else 0.0
        dec = 0 if step <= 0 or not math.isfinite(step) else max(0, math.ceil(-math.log10(step) - 1e-9))
        dec = min(dec + (1 if step > 0 and round(step * 10**dec) % 10 not in (0, 1, 2, 5) else 0), 9)
        s = f"{v:.{dec}f}"
        return "0" if s.lstrip("-").strip("0.") == "" else s

    ax.yaxis.set_major_formatter(mticker.FuncFormatter(fmt))


def save_figure(fig, out_dir: str | os.PathLike, name: str, caption: str, *, pdf: bool = False) -> FigurePaths:
    """Write ``fig`` as ``<name>.png`` (and ``<name>.pdf`` when ``pdf``) with ``caption`` in
    the file's metadata; returns the paths (the CSV path is filled in by the caller)."""
    out_dir = Path(out_dir)
    paths = FigurePaths(png=out_dir / f"{name}.png", csv=out_dir / f"{name}.csv")
    paths.caption = caption
    fig.savefig(paths["png"], dpi=200, metadata={"Title": name, "Description": caption})
    if pdf:
        paths["pdf"] = out_dir / f"{name}.pdf"
        fig.savefig(paths["pdf"], metadata={"CreationDate": None, "Title": name, "Subject": caption})
    return paths
