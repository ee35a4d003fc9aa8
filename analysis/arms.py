"""Arms: the (fp8, clip) pair a curve or a table row stands for, with a fixed label and style.

An *arm* is one line of a figure and one row of a table: the FP8 setting (``bf16``,
``rollout_only``, ``tensorwise``, ``rowwise``, ``blockwise``, ``mxfp8``, ...) combined with the
clip method (``vanilla``, ``tis``, ``calibrated``). Labels follow the paper's wording::

    ("bf16", "vanilla")            -> "BF16"
    ("rollout_only", "vanilla")    -> "FP8 rollout only"
    ("rollout_only", "tis")        -> "FP8 rollout only + TIS"
    ("tensorwise", "vanilla")      -> "FP8 tensorwise (vanilla)"
    ("tensorwise", "tis")          -> "FP8 tensorwise + TIS"
    ("tensorwise", "calibrated")   -> "FP8 tensorwise + calibrated"

Style: the **colour** comes from the FP8 setting (one hue family per granularity: BF16
black, rollout-only grey, tensorwise reds, rowwise blues, blockwise greens, MXFP8 purples, MXFP6
oranges, NVFP4 magentas and its plain-format control NVFP4-RN pinks, MXFP4 steel blues, W4A16
browns) and its **shade** from the clip method (vanilla light, TIS medium, calibrated dark); the
**line style** also comes from the clip method (vanilla dotted, TIS dashed, calibrated solid, the
controls of Calibrated Clipping dash-dot, Score Centering dash-dot-dot: in the light shade without
TIS, the medium one with it, as vanilla and TIS), so the figures stay readable in greyscale. The
mapping is a fixed table, so an arm has the same look in every figure whatever subset of arms a
sweep holds.

Score Centering (``score_centering``, ``score_centering_tis``) is a correction added to the loss,
not a clip method; ``clip=`` names it all the same, so it is labelled and styled here like one
(``"FP4 NVFP4 + Score Centering + TIS"``).

Unknown values never crash (the axes are extensible registries): an unknown FP8 setting gets
the label ``"FP8 <name>"`` and a colour from a fallback palette picked by a stable hash
(CRC32) of its name; an unknown clip method gets ``"+ <name>"`` and a dash-dot line.

Variants. A sweep that varies options beyond the four axes (``calibration_ablation`` varies
``clip.period``, ``clip.init_bounds`` and ``clip.upper_rule``) yields cells with the same
(fp8, clip) that must stay apart; ``analysis.collect`` appends those options to the clip value,
``"calibrated[clip.period=10 clip.upper_rule=fixed]"`` (:func:`with_variant`). Everything here
reads such a value as its base method plus a variant (:func:`split_clip`): the label gets
``" [clip.period=10 clip.upper_rule=fixed]"``, the colour and line style are the base method's,
and variants sort by name after their base.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

#: Display order and label of the known FP8 settings.
FP8_LABELS: dict[str, str] = {
    "bf16": "BF16",
    "rollout_only": "FP8 rollout only",
    "tensorwise": "FP8 tensorwise",
    "rowwise": "FP8 rowwise",
    "blockwise": "FP8 blockwise",
    "mxfp8": "FP8 MXFP8",
    "mxfp6": "FP6 MXFP6",
    "nvfp4": "FP4 NVFP4",
    "nvfp4_rn": "FP4 NVFP4-RN",
    "mxfp4": "FP4 MXFP4",
    "w4a16": "W4A16",
}
#: Display order and label suffix of the known clip methods.
CLIP_LABELS: dict[str, str] = {"vanilla": "vanilla", "tis": "TIS", "calibrated": "calibrated",
                               "no_lower_clip": "no lower clip", "wide_lower": "wide lower bound",
                               "score_centering": "Score Centering",
                               "score_centering_tis": "Score Centering + TIS"}
#: Which of an FP8 setting's three shades (light, medium, dark) each clip method takes; the two
#: controls of Calibrated Clipping share the dash-dot line and take the light and dark shades, the
#: two Score Centering arms share the dash-dot-dot line and take vanilla's and TIS's shades.
_SHADE: dict[str, int] = {"vanilla": 0, "tis": 1, "calibrated": 2, "no_lower_clip": 0, "wide_lower": 2,
                          "score_centering": 0, "score_centering_tis": 1}

# (vanilla, tis, calibrated) shades per FP8 setting: light -> dark
_COLOURS: dict[str, tuple[str, str, str]] = {
    "bf16": ("#000000", "#525252", "#252525"),
    "rollout_only": ("#8c8c8c", "#6e6e6e", "#4d4d4d"),
    "tensorwise": ("#fc8d59", "#e34a33", "#b30000"),
    "rowwise": ("#74a9cf", "#2b8cbe", "#045a8d"),
    "blockwise": ("#78c679", "#31a354", "#006837"),
    "mxfp8": ("#9e9ac8", "#756bb1", "#54278f"),
    "mxfp6": ("#fdd49e", "#fdbb84", "#d7301f"),
    "nvfp4": ("#c994c7", "#dd1c77", "#980043"),
    "nvfp4_rn": ("#fcc5c0", "#f768a1", "#ae017e"),
    "mxfp4": ("#a6bddb", "#3690c0", "#034e7b"),
    "w4a16": ("#dfc27d", "#bf812d", "#8c510a"),
}
_FALLBACK: tuple[str, ...] = ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#d95f02", "#7570b3")
#: Dash-dot-dot: matplotlib's (offset, (on, off, ...)) in points.
DASH_DOT_DOT: tuple = (0, (3, 1, 1, 1, 1, 1))
_LINESTYLES: dict[str, str | tuple] = {"vanilla": ":", "tis": "--", "calibrated": "-", "no_lower_clip": "-.",
                                       "wide_lower": "-.", "score_centering": DASH_DOT_DOT,
                                       "score_centering_tis": DASH_DOT_DOT}


@dataclass(frozen=True)
class ArmStyle:
    """How one arm is drawn: matplotlib colour, line style (a name such as ``"--"`` or a dash
    tuple, :data:`DASH_DOT_DOT`) and line width."""

    color: str
    linestyle: str | tuple
    linewidth: float


def with_variant(clip: str, variant: str) -> str:
    """``clip`` with the sweep-specific options ``variant`` attached (unchanged when empty)."""
    return f"{clip}[{variant}]" if variant else str(clip)


def split_clip(clip: str) -> tuple[str, str]:
    """``"calibrated[clip.period=10]"`` -> ``("calibrated", "clip.period=10")``; ``"tis"`` -> ``("tis", "")``."""
    clip = str(clip)
    if clip.endswith("]") and "[" in clip:
        base, _, rest = clip.partition("[")
        return base, rest[:-1]
    return clip, ""


def arm_label(fp8: str, clip: str) -> str:
    """The paper-style label of the arm ``(fp8, clip)`` (see the module docstring)."""
    fp8 = str(fp8)
    clip, variant = split_clip(clip)
    base = FP8_LABELS.get(fp8, f"FP8 {fp8}")
    if fp8 == "bf16" or fp8 == "rollout_only":
        label = base if clip == "vanilla" else f"{base} + {CLIP_LABELS.get(clip, clip)}"
    elif clip == "vanilla":
        label = f"{base} (vanilla)"
    else:
        label = f"{base} + {CLIP_LABELS.get(clip, clip)}"
    return f"{label} [{variant}]" if variant else label


def arm_order_key(fp8: str, clip: str) -> tuple:
    """Sort key: known FP8 settings in :data:`FP8_LABELS` order, then unknown ones by name;
    within one, known clip methods in :data:`CLIP_LABELS` order, then unknown ones."""
    fp8_keys = list(FP8_LABELS)
    clip_keys = list(CLIP_LABELS)
    clip, variant = split_clip(clip)
    f = (0, fp8_keys.index(fp8), "") if fp8 in FP8_LABELS else (1, 0, str(fp8))
    c = (0, clip_keys.index(clip), "") if clip in CLIP_LABELS else (1, 0, str(clip))
    return (*f, *c, _natural(variant))


def arm_style(fp8: str, clip: str) -> ArmStyle:
    """The fixed colour / line style of ``(fp8, clip)``; unknown values get a stable fallback."""
    fp8, clip = str(fp8), split_clip(clip)[0]
    if fp8 in _COLOURS:
        shades = _COLOURS[fp8]
        color = shades[_SHADE.get(clip, 1)]
    else:
        color = _FALLBACK[zlib.crc32(fp8.encode()) % len(_FALLBACK)]
    linestyle = _LINESTYLES.get(clip, "-.")
    if fp8 in ("bf16",) and clip == "vanilla":
        linestyle = "-"
    linewidth = 2.0 if clip == "calibrated" or fp8 == "bf16" else 1.5
    return ArmStyle(color=color, linestyle=linestyle, linewidth=linewidth)


def select(df, algorithm: str, model: str, fp8: str | None = None, clip: str | None = None):
    """Rows of the DataFrame ``df`` for one (algorithm, model) panel and, given ``fp8`` and
    ``clip``, one arm of it (values compared as strings, so categorical columns work too)."""
    mask = (df["algorithm"].astype(str) == algorithm) & (df["model"].astype(str) == model)
    if fp8 is not None:
        mask &= df["fp8"].astype(str) == fp8
    if clip is not None:
        mask &= df["clip"].astype(str) == clip
    return df[mask]


def sort_arms(pairs) -> list[tuple[str, str]]:
    """Unique ``(fp8, clip)`` pairs in display order."""
    return sorted({(str(f), str(c)) for f, c in pairs}, key=lambda p: arm_order_key(*p))


ALGORITHM_ORDER: tuple[str, ...] = ("grpo", "dapo")


_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _natural(s: str) -> tuple:
    """``"8b" < "14b" < "32b"``, ``"low_min=0.05" < "0.2" < "0.5"``, ``"lr=1e-05" < "lr=0.0001"``:
    numbers (decimals and exponents included) compare by value; the string itself breaks ties,
    so two different labels never sort equal (the order of a report does not depend on the
    order the runs were read in)."""
    parts, pos = [], 0
    for m in _NUMBER.finditer(s):
        if m.start() > pos:
            parts.append((1, 0.0, s[pos:m.start()]))
        parts.append((0, float(m.group()), ""))
        pos = m.end()
    if pos < len(s):
        parts.append((1, 0.0, s[pos:]))
    return (*parts, (2, 0.0, s))


def panel_order_key(algorithm: str, model: str) -> tuple:
    """Panels: GRPO before DAPO (then other algorithms by name), models in natural order."""
    a = (0, ALGORITHM_ORDER.index(algorithm), "") if algorithm in ALGORITHM_ORDER else (1, 0, algorithm)
    return (*a, _natural(model))
