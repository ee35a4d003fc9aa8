"""One colour per clip method in every figure of every report, and bands that respect the support.

**Colours** (:data:`METHOD_COLOURS`, Okabe-Ito, readable by colour-blind readers): vanilla
orange, TIS blue, calibrated green, the controls of Calibrated Clipping ``no_lower_clip``
reddish purple and ``wide_lower`` vermillion, Score Centering ``score_centering`` wine and
``score_centering_tis`` sky blue (Okabe-Ito's last usable hue, beside TIS's blue; wine is Paul
Tol's, Okabe-Ito's yellow being unreadable on white); :data:`REFERENCE_COLOUR` (black) is the
BF16 reference (the block's BF16 arm drawn over the FP8 panels, the zero line of a difference to
BF16, the dashed line of a bar summary). Figures show the FP8 setting by panel, never by colour,
so a method looks the same in every panel, figure and report. :func:`method_colour` takes a clip **key**
(``"tis"``, ``"calibrated[clip.period=10]"``): the method, not its label. An unknown method gets
a colour from :data:`FALLBACK` picked by a stable hash (CRC32) of its name. Variants of one
method (the calibration ablation) share its colour and differ by line style and marker
(:func:`variant_style`).

**Bands** (:func:`mean_band`): the 95% Student-t interval of the mean over seeds, mean ± t(0.975,
n − 1) · sd / √n, cut to the metric's support (:func:`support`: fractions in [0, 1], entropies,
lengths, KL, bounds and ratios ≥ 0, rewards and differences unbounded); no band below two seeds.
A fraction's band therefore never goes below 0 %, and captions say "95% t interval of the mean
over seeds, clipped to the metric's range".
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from analysis.arms import CLIP_LABELS, split_clip
from analysis.ratio_ci import t_quantile

METHOD_COLOURS: dict[str, str] = {"vanilla": "#E69F00", "tis": "#0072B2", "calibrated": "#009E73",
                                  "no_lower_clip": "#CC79A7", "wide_lower": "#D55E00",
                                  "score_centering": "#882255", "score_centering_tis": "#56B4E9"}
REFERENCE_COLOUR = "#000000"
#: Colours of unknown methods (Paul Tol's muted scheme): none of them a known method's, so a new
#: method never borrows an existing one's colour (two new ones may share one: give them entries).
FALLBACK: tuple[str, ...] = ("#44AA99", "#999933", "#117733", "#AA4499", "#332288", "#DDCC77")
#: (line style, marker) of the variants of one method, in display order (the first: the plain line).
VARIANT_STYLES: tuple[tuple[str, str | None], ...] = (
    ("-", None), ("--", None), (":", None), ("-.", None), ("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))
BAND_TEXT = "95% t interval of the mean over seeds, clipped to the metric's range"


def method_colour(clip: str) -> str:
    """The colour of the clip method of ``clip`` (a key such as ``"tis"`` or a variant of one).

    Raises ValueError for a display label (``"TIS"``, ``"FP8 tensorwise + TIS"``): colours
    are looked up by key, and a label would silently fall back to another colour."""
    base = split_clip(str(clip))[0]
    if base in METHOD_COLOURS:
        return METHOD_COLOURS[base]
    if base in set(CLIP_LABELS.values()) - set(CLIP_LABELS) or " " in base:
        raise ValueError(f"method_colour takes a clip key (vanilla, tis, calibrated, ...), not the label {clip!r}")
    return FALLBACK[zlib.crc32(base.encode()) % len(FALLBACK)]


def variant_style(index: int) -> tuple[str, str | None]:
    """(line style, marker) of the ``index``-th variant of a method within a panel."""
    return VARIANT_STYLES[index % len(VARIANT_STYLES)]


_NONNEG = ("entropy", "kl", "len", "clip/low", "clip/high", "ratio_neg", "grad_norm", "perf/", "n_neg",
           "_n", "tokens", "filtered_groups", "replacements", "avg@k", "pass@k")


def support(metric: str) -> tuple[float, float]:
    """The range a metric's values can take (raw units): [0, 1] for fractions, [0, inf) for
    non-negative quantities, (-inf, inf) otherwise (rewards, losses, differences)."""
    m = metric.lower()
    if m.startswith("eval/") or m.startswith("eval_bf16/"):
        return (0.0, 1.0) if not m.endswith("avg@k") else (0.0, 100.0)
    if "frac" in m or m.endswith("/acc") or m.endswith("alpha") or "recall" in m or "precision" in m:
        return 0.0, 1.0
    if "reward" in m or "loss" in m or "grad_cos" in m:
        return -math.inf, math.inf
    if any(k in m for k in _NONNEG):
        return 0.0, math.inf
    return -math.inf, math.inf


def mean_band(mean, std, n, bounds: tuple[float, float] = (-math.inf, math.inf)) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper ends of the 95% t interval of the mean (arrays; NaN where n < 2), cut to
    ``bounds``."""
    mean, std, n = (np.asarray(x, dtype=float) for x in (mean, std, n))
    t = np.array([t_quantile(0.975, k - 1) if k >= 2 else math.nan for k in n.ravel()]).reshape(n.shape)
    half = t * std / np.sqrt(np.where(n >= 2, n, np.nan))
    lo, hi = np.clip(mean - half, *bounds), np.clip(mean + half, *bounds)
    return lo, hi
