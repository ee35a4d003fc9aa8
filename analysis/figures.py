"""The paper's figures, regenerated from a :class:`analysis.collect.Collection`.

Every line figure (:data:`FIGURES`) is drawn by ``analysis.granularity``: one panel per FP8
setting, one row of panels per (algorithm, model) and metric, one colour per clip method
(``analysis.style``: the same in every figure of every report; the FP8 setting is the panel,
never the colour), the line the mean over seeds of the EMA-smoothed per-run curves, the band the
95% t interval of that mean cut to the metric's range, the block's BF16 reference arm as a thin
black line over the FP8 panels, one y scale per metric, the legend *below* the panels. Each
figure is written as PNG (200 dpi; PDF with ``pdf=True``), with a CSV of exactly the plotted
numbers beside it, sorted and formatted deterministically.

Figures: entropy over training (surge onsets marked, ``analysis.surge``); ``entropy_vs_bf16``,
each run's entropy minus the BF16 reference run of the same seed (the paired difference, with its
95% interval: differences of 1e-3 nats that the spread between seeds hides);
``actor/clipfrac_neg_low`` (the mechanism, in percent); reward and rollout accuracy (drawn once
where they are the same numbers); response length; mismatch KL (log scale); the clip bounds
``clip/low``, ``clip/high`` and ``clip/alpha``; the ratio quantiles of negative-advantage tokens.
``analysis.bars`` adds the summaries (the paired accuracy differences, the clip fraction per arm).

Panels 2.3 x 1.8 in with 7-8 pt text, at most three per row for a single row of panels, PDF
fonts embedded as TrueType; GRPO before DAPO, models in natural order.

Choices: the EMA span defaults to ``max(1, round(T / 50))`` logged steps for a run of T steps
(``smooth=1`` disables it); metrics logged on a minority of steps (``clip/alpha``,
``shadow/*``) are drawn unsmoothed with markers; a metric absent from every run skips its
figure (the report says so). matplotlib runs on the Agg backend (no display needed).
"""

from __future__ import annotations

import dataclasses
import os

from analysis.collect import Collection
from analysis.curves import (  # noqa: F401  (arm_curves, auto_span, ...: public here too)
    EVAL_AVG_METRIC,
    FigurePaths,
    arm_curves,
    auto_span,
    spec_by_name,
)
from analysis.granularity import plot_by_granularity
from analysis.surge import SurgeRule
from fp8rl.runs import metrics as M


@dataclasses.dataclass(frozen=True)
class FigureSpec:
    """One figure: a name (file stem), metrics (one row of panels each) and their labels."""

    name: str
    metrics: tuple[str, ...]
    ylabels: tuple[str, ...]
    title: str
    logy: bool = False
    mark_surge: bool = False
    smooth: bool = True  # False for step functions such as the clip bounds in force
    #: Factor applied to the plotted values (100: fractions drawn as percent).
    scale: float = 1.0
    #: Each run's curve minus the BF16 reference run of the same seed (``analysis.curves.paired_to_bf16``).
    paired: bool = False


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("entropy", (M.ACTOR_ENTROPY,), ("entropy (nats/token)",),
               "Policy entropy over training", mark_surge=True),
    FigureSpec("entropy_vs_bf16", (M.ACTOR_ENTROPY,), ("entropy − BF16 (nats)",),
               "Policy entropy minus the BF16 reference run of the same seed", paired=True),
    FigureSpec("clipfrac_neg_low", (M.ACTOR_CLIPFRAC_NEG_LOW,),
               ("A<0 below L (%)",),
               "Negative-advantage tokens below the lower clip bound (gradient zeroed)", scale=100.0),
    FigureSpec("reward_accuracy", (M.ROLLOUT_REWARD_MEAN, M.ROLLOUT_ACC),
               ("mean reward", "rollout accuracy (fraction)"), "Reward and rollout accuracy"),
    FigureSpec("response_length", (M.ROLLOUT_RESPONSE_LEN,), ("response length (tokens)",),
               "Response length"),
    FigureSpec("mismatch_kl", (M.ROLLOUT_MISMATCH_KL,), ("rollout-trainer KL (nats/token)",),
               "Rollout / trainer mismatch", logy=True),
    FigureSpec("clip_bounds", (M.CLIP_LOW, M.CLIP_HIGH, M.CLIP_ALPHA),
               ("lower clip bound", "upper clip bound", "alpha (BF16 shadow clip fraction)"),
               "Clip bounds in force and the calibration target", smooth=False),
    FigureSpec("ratio_quantiles", (M.ACTOR_RATIO_NEG_Q01, M.ACTOR_RATIO_NEG_Q50, M.ACTOR_RATIO_NEG_Q99),
               ("ratio q01 (A<0)", "ratio q50 (A<0)", "ratio q99 (A<0)"),
               "PPO ratio quantiles over negative-advantage tokens"),
)
FIGURE_NAMES = tuple(f.name for f in FIGURES)


def figure_spec(name: str) -> FigureSpec:
    return spec_by_name(FIGURES, name)


def plot_figure(
    coll: Collection,
    spec: FigureSpec | str,
    out_dir: str | os.PathLike,
    *,
    smooth: float | None = None,
    surge_rule: SurgeRule = SurgeRule(),  # noqa: B008
    pdf: bool = False,
) -> FigurePaths | None:
    """Draw one figure into ``out_dir`` as ``<name>.png``, ``.csv`` (and ``.pdf`` when ``pdf``);
    the returned paths carry the figure's ``caption``.

    Returns the written paths, or None when no run logged any of the figure's metrics.
    """
    spec = figure_spec(spec) if isinstance(spec, str) else spec
    return plot_by_granularity(coll, spec, out_dir, smooth=smooth, surge_rule=surge_rule, pdf=pdf)
