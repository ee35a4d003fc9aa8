"""The FP4/FP6 formats (``nvfp4``, ``nvfp4_rn``, ``mxfp4``, ``mxfp6``, ``w4a16``) and the Score Centering arms
(``score_centering``, ``score_centering_tis``) in a report (issue 47, item 5): every table has a
row per arm under its own label, every figure draws each method in its own colour.

References are written out here, not derived from ``analysis.arms``: the labels a reader sees
and the rule "no method in the fallback palette, no two methods in one colour". A synthetic
sweep (``fp8rl.runs.synthetic``) holds two seeds of every (format, arm) pair; the figures are
captured, not rendered (``analysis_known.capture_figures``).
"""

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from analysis_known import artist_colours, capture_figures

from analysis.arms import _COLOURS, _LINESTYLES, _SHADE, CLIP_LABELS, FP8_LABELS, arm_style
from analysis.collect import collect
from analysis.report import write_report
from analysis.style import FALLBACK, METHOD_COLOURS, REFERENCE_COLOUR, method_colour
from fp8rl.runs.synthetic import RunSpec, make_sweep

NEW_FP8 = ("nvfp4", "nvfp4_rn", "mxfp4", "mxfp6", "w4a16")
NEW_CLIP = ("score_centering", "score_centering_tis")
FP8 = ("bf16", "mxfp8", *NEW_FP8)
CLIP = ("vanilla", "tis", *NEW_CLIP)
ARMS = [(f, c) for f in FP8 for c in CLIP]
#: The labels a reader sees (the reference: spelled out, not computed).
FP8_TEXT = {"bf16": "BF16", "mxfp8": "FP8 MXFP8", "nvfp4": "FP4 NVFP4", "nvfp4_rn": "FP4 NVFP4-RN",
            "mxfp4": "FP4 MXFP4", "mxfp6": "FP6 MXFP6", "w4a16": "W4A16"}
CLIP_TEXT = {"vanilla": "", "tis": " + TIS", "score_centering": " + Score Centering",
             "score_centering_tis": " + Score Centering + TIS"}
DATASETS = ("aime24", "math500")
#: Tables that have one row per arm (and block), and the accuracy tables' rows per arm.
PER_ARM_TABLES = ("paired_accuracy", "paired_accuracy_bf16", "entropy_paired", "mechanism", "diagnostics",
                  "trajectory")
ACCURACY_TABLES = ("accuracy", "accuracy_bf16")
#: The figures drawn: lines, bars, dots, and clip_bounds (seven formats x three metrics, one of them,
#: clip/alpha, logged by no arm here: the report crashed on that image of no line before).
FIGURES = ("entropy", "clipfrac_neg_low", "clipfrac_summary", "eval_accuracy", "clip_bounds")


def expected_label(fp8: str, clip: str) -> str:
    if clip == "vanilla":
        return FP8_TEXT[fp8] if fp8 == "bf16" else f"{FP8_TEXT[fp8]} (vanilla)"
    return FP8_TEXT[fp8] + CLIP_TEXT[clip]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The report over two seeds of every (format, arm): ``(out dir, {figure: Figure})``."""
    base = tmp_path_factory.mktemp("new_arms")
    specs = [RunSpec(fp8=f, clip=c, seed=s, steps=10, eval_every=5, n_neg=200,
                     eval={"aime24": 0.30 + 0.01 * s, "math500": 0.60},
                     eval_bf16={"aime24": 0.30, "math500": 0.60 - 0.01 * s})
             for f, c in ARMS for s in (0, 1)]
    make_sweep(base / "sweep", specs, sweep="fp4_score_centering")
    coll = collect(base / "sweep", workers=1, progress=False)
    mp = pytest.MonkeyPatch()
    try:
        kept = capture_figures(mp)
        write_report(coll, base / "report", figures=list(FIGURES))
    finally:
        mp.undo()
    yield base / "report", kept
    for fig in kept.values():
        plt.close(fig)


def test_every_table_has_one_row_per_new_arm_under_its_own_label(report):
    out, _ = report
    tables = out / "tables"
    for name in (*PER_ARM_TABLES, *ACCURACY_TABLES):
        df = pd.read_csv(tables / f"{name}.csv", keep_default_na=False)
        pairs = list(zip(df["fp8"].astype(str), df["clip"].astype(str), strict=True))
        per_arm = len(DATASETS) + 1 if name in ACCURACY_TABLES else 1  # the datasets and their Average
        assert sorted(set(pairs)) == sorted(ARMS), f"{name}: arms {sorted(set(ARMS) - set(pairs))} missing"
        assert all(pairs.count(a) == per_arm for a in ARMS), f"{name}: rows per arm"
        labels = dict(zip(pairs, df["arm"], strict=True))
        wrong = {a: labels[a] for a in ARMS if labels[a] != expected_label(*a)}
        assert not wrong, f"{name}: labels {wrong}"
        # the Markdown: one row per arm (rows are grouped by label, so two arms sharing a label
        # would silently become one)
        md = (tables / f"{name}.md").read_text(encoding="utf-8")
        rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith(("| Arm", "| Granularity"))]
        assert len(rows) == len(ARMS), f"{name}.md: {len(rows)} rows for {len(ARMS)} arms"
        for a in ARMS:
            assert sum(r.startswith(f"| {expected_label(*a)} |") for r in rows) == 1, (name, a)
    report_md = (out / "report.md").read_text(encoding="utf-8")
    for a in ARMS:
        assert f"| {expected_label(*a)} |" in report_md, a


def test_every_figure_draws_each_new_method_in_its_own_colour(report):
    out, kept = report
    assert set(FIGURES) <= {k.split("-")[0] for k in kept}, sorted(kept)  # a split figure: <name>-<part>
    assert "No run of GRPO · 8b logged clip/alpha: no panels for it there." in (out / "report.md").read_text()
    bounds = [ax for k, fig in kept.items() if k.split("-")[0] == "clip_bounds" for ax in fig.axes if ax.get_visible()]
    assert len(bounds) == 2 * len(FP8)  # clip/low and clip/high per format
    colour_of: dict[str, set[str]] = {}
    drawn: set[tuple[str, str]] = set()
    fallback = {c.lower() for c in FALLBACK}
    for name, fig in kept.items():
        for gid, col in artist_colours(fig):
            if gid == "reference":
                assert col == REFERENCE_COLOUR, name
                continue
            fp8, clip = gid.split("|")[:2]
            drawn.add((fp8, clip))
            colour_of.setdefault(clip, set()).add(col)
            assert col not in fallback, f"{name}: {gid} in the fallback palette ({col})"
    assert set(ARMS) <= drawn, f"arms drawn in no figure: {sorted(set(ARMS) - drawn)}"
    assert set(colour_of) == set(CLIP), colour_of
    assert all(len(c) == 1 for c in colour_of.values()), colour_of  # one colour per method everywhere
    colours = [next(iter(c)) for c in colour_of.values()]
    assert len(set(colours)) == len(CLIP) and REFERENCE_COLOUR not in colours, colour_of


def test_every_clip_arm_of_the_launcher_has_a_label_a_line_and_a_colour():
    """A ``clip=`` arm (``fp8rl.rl.clipping.CLIP_ARMS``) drawn with the fallback label, the
    dash-dot line and a hashed colour can share its colour with another new arm: each has its entry,
    no two methods share a colour, and none is in the fallback palette."""
    from fp8rl.rl.clipping import CLIP_ARMS

    for arm in CLIP_ARMS.names():
        assert arm in CLIP_LABELS and arm in _LINESTYLES and arm in _SHADE and arm in METHOD_COLOURS, arm
    colours = [c.lower() for c in METHOD_COLOURS.values()]
    assert len(set(colours)) == len(colours), METHOD_COLOURS
    assert not set(colours) & {c.lower() for c in FALLBACK} and REFERENCE_COLOUR not in colours
    assert method_colour("score_centering") != method_colour("score_centering_tis")
    assert [CLIP_LABELS[c] for c in NEW_CLIP] == ["Score Centering", "Score Centering + TIS"]


def test_every_arm_has_its_own_look_in_a_format_colour_family():
    """``arm_style`` (notebooks): within every format's family, every clip arm differs by shade or
    line; the new formats have a family (not a hashed fallback colour) of three shades."""
    for fp8 in NEW_FP8:
        assert fp8 in FP8_LABELS and len(set(_COLOURS[fp8])) == 3, fp8
    families = [set(v) for v in _COLOURS.values()]
    assert all(not (a & b) for i, a in enumerate(families) for b in families[i + 1:])
    for fp8 in FP8_LABELS:
        looks = {(arm_style(fp8, c).color, arm_style(fp8, c).linestyle) for c in CLIP_LABELS}
        assert len(looks) == len(CLIP_LABELS), fp8
        assert all(arm_style(fp8, c).color in _COLOURS[fp8] for c in CLIP_LABELS)
