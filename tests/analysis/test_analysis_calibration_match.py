"""x BF16 intervals, the half-width criterion and which tokens are clipped
(analysis.bf16_ratio, analysis.calibration_match), against loops over the run directories."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis.calibration_match import (
    HALF_WIDTH_MAX,
    MATCH_RANGE,
    agreement_rows,
    agreement_table,
    arm_modes,
    criterion,
    halfwidth_rows,
    halfwidth_table,
)
from analysis.clip_tables import mechanism_table
from analysis.collect import collect
from analysis.ratio_ci import RatioCI, fieller_ratio
from fp8rl.runs.synthetic import RunSpec, make_sweep

STEPS = 41  # measured (calibration) steps 0, 20, 40
SEEDS = range(4)
# (fp8, clip): (clipfrac_neg_low, low_recall, low_precision, counts logged)
ARMS = {
    ("bf16", "vanilla"): (0.002, 0.5, 0.5, False),
    ("tensorwise", "vanilla"): (0.020, 0.3, 0.4, True),
    ("tensorwise", "tis"): (0.015, 0.35, 0.45, True),
    ("tensorwise", "calibrated"): (0.0021, 0.7, 0.6, True),
    ("blockwise", "tis"): (0.010, 0.4, 0.3, True),
    ("blockwise", "calibrated"): (0.003, 0.8, 0.7, True),
}


def _specs():
    specs = []
    for (fp8, clip), (cf, rec, prec, counts) in ARMS.items():
        for seed in SEEDS:
            specs.append(RunSpec(fp8=fp8, clip=clip, seed=seed, steps=STEPS, clipfrac_neg_low=cf,
                                 low_recall=rec, low_precision=prec, shadow_counts=counts,
                                 calibration_mode="periodic"))
    # a 14b block with one seed per arm: no interval
    for fp8, clip in (("bf16", "vanilla"), ("tensorwise", "calibrated")):
        specs.append(RunSpec(model="14b", fp8=fp8, clip=clip, seed=0, steps=STEPS, shadow_counts=True,
                             calibration_mode="periodic"))
    return specs


@pytest.fixture(scope="module")
def cal_sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal") / "cal"
    make_sweep(d, _specs(), sweep="cal")
    return d


@pytest.fixture(scope="module")
def cal_coll(cal_sweep):
    return collect(cal_sweep, workers=1, progress=False)


def _runs_by_loop(sweep: Path):
    """{(model, fp8, clip): {seed: rows}} read with json.loads line by line (no analysis code)."""
    out = {}
    for d in sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists()):
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        rows = []
        for line in (d / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # the known sweep's truncated last line (collect drops it too)
                pass
        key = (cfg["model"]["name"], cfg["fp8"]["name"], cfg["clip"]["name"])
        out.setdefault(key, {})[cfg["seed"]] = rows
    return out


def _run_mean(rows, metric="actor/clipfrac_neg_low"):
    v = [r[metric] for r in rows if r.get(metric) is not None]
    return sum(v) / len(v)


# --- x BF16 in the mechanism table ----------------------------------------------------------


def test_mechanism_intervals_are_paired_by_seed_against_the_bf16_arm(cal_sweep, cal_coll):
    runs = _runs_by_loop(cal_sweep)
    d = mechanism_table(cal_coll).data.set_index(["model", "arm"])
    ref = [_run_mean(runs[("8b", "bf16", "vanilla")][s]) for s in SEEDS]
    for fp8, clip in ARMS:
        if fp8 == "bf16":
            continue
        x = [_run_mean(runs[("8b", fp8, clip)][s]) for s in SEEDS]
        row = d.loc[("8b", cal_coll.runs.set_index(["fp8", "clip"]).loc[(fp8, clip), "arm"].iloc[0])]
        lo, hi = fieller_ratio(x, ref, paired=True)
        assert row["x_bf16_paired"]
        assert (row["x_bf16_lo"], row["x_bf16_hi"]) == pytest.approx((max(lo, 0.0), hi), rel=1e-9)
        assert row["x_bf16"] == pytest.approx(np.mean(x) / np.mean(ref))
        assert row["x_bf16_ci"] == f"[{max(lo, 0):.2f}, {hi:.2f}]"
    assert d.loc[("8b", "BF16"), "x_bf16_ci"] == "reference"
    assert d.loc[("14b", "FP8 tensorwise + calibrated"), "x_bf16_ci"] == "n/a (1 seed)"
    md = mechanism_table(cal_coll).markdown
    assert "| 95% CI |" in md and "n/a (1 seed)" in md


def test_mechanism_intervals_are_unpaired_when_the_seeds_differ(known_sweep, known_coll):
    """The known sweep: BF16 has seeds 0-2 (2 FAILED, with metrics), tensorwise 0-1 (unpaired),
    blockwise + TIS 0-2 (2 PREEMPTED: paired)."""
    runs = _runs_by_loop(known_sweep)
    d = mechanism_table(known_coll).data.set_index("arm")
    ref = runs[("8b", "bf16", "vanilla")]
    y = [_run_mean(ref[s]) for s in sorted(ref)]
    for fp8, clip, label, paired in (("tensorwise", "vanilla", "FP8 tensorwise (vanilla)", False),
                                     ("blockwise", "tis", "FP8 blockwise + TIS", True)):
        arm = runs[("8b", fp8, clip)]
        x = [_run_mean(arm[s]) for s in sorted(arm)]
        lo, hi = fieller_ratio(x, y, paired=paired)
        assert bool(d.loc[label, "x_bf16_paired"]) is paired
        assert (d.loc[label, "x_bf16_lo"], d.loc[label, "x_bf16_hi"]) == pytest.approx((max(lo, 0.0), hi))
        assert d.loc[label, "x_bf16_ci"].endswith("unpaired") is (not paired)


# --- B: the half-width criterion ---------------------------------------------------------------


def test_halfwidth_rows_recover_the_planted_ratios_and_apply_the_criterion(cal_coll):
    df = halfwidth_rows(cal_coll)
    b8 = df[df["model"] == "8b"].set_index("fp8")
    assert list(b8.index) == ["tensorwise", "blockwise"]
    assert b8.loc["tensorwise", "cal_estimate"] == pytest.approx(1.05, abs=0.03)
    assert b8.loc["blockwise", "cal_estimate"] == pytest.approx(1.5, abs=0.05)
    assert b8.loc["tensorwise", "contrast_clip"] == "vanilla" and b8.loc["blockwise", "contrast_clip"] == "tis"
    assert b8.loc["tensorwise", "con_estimate"] == pytest.approx(10.0, rel=0.03)
    assert b8.loc["blockwise", "con_estimate"] == pytest.approx(5.0, rel=0.03)
    for _, r in b8.iterrows():
        assert r["cal_half_width"] == pytest.approx((r["cal_hi"] - r["cal_lo"]) / 2)
        assert r["cal_lo"] <= r["cal_estimate"] <= r["cal_hi"] and r["cal_paired"]
        assert r["half_width_ok"] == (r["cal_half_width"] <= HALF_WIDTH_MAX)
        assert r["point_ok"] == (MATCH_RANGE[0] <= r["cal_estimate"] <= MATCH_RANGE[1])
        assert r["mode"] == "periodic"
    assert b8.loc["tensorwise", "both_ok"] and not b8.loc["blockwise", "point_ok"]
    assert not b8.loc["blockwise", "both_ok"]
    one = df[df["model"] == "14b"].iloc[0]  # one seed: a point estimate (1.0), no interval
    assert one["cal_ci"] == "n/a (1 seed)" and one["half_width_ok"] is None and one["both_ok"] is None
    assert one["point_ok"]


@pytest.mark.parametrize(("est", "lo", "hi", "note", "want"), [
    (1.0, 0.90, 1.10, "", (True, True, True)),
    (1.0, 0.85, 1.15, "", (True, True, True)),  # half-width exactly 0.15
    (1.0, 0.84, 1.16, "", (False, True, False)),
    (0.8, 0.75, 0.85, "", (True, True, True)),  # range ends included
    (1.25, 1.2, 1.3, "", (True, True, True)),
    (0.79, 0.75, 0.83, "", (True, False, False)),
    (1.26, 1.2, 1.3, "", (True, False, False)),
    (1.0, -math.inf, math.inf, "", (False, True, False)),  # unbounded
    (1.0, math.nan, math.nan, "n/a (1 seed)", (None, True, None)),
    (math.nan, math.nan, math.nan, "n/a (0 seeds)", (None, None, None)),
])
def test_criterion(est, lo, hi, note, want):
    ci = RatioCI(est, lo, hi, math.nan, math.nan, 3, 3, True, note)
    assert criterion(ci) == want
    assert criterion(None) == (None, None, None)


def test_halfwidth_table_headline_and_files(cal_coll, tmp_path):
    t = halfwidth_table(cal_coll)
    first = t.markdown.splitlines()[0]
    assert "point estimate in [0.8, 1.25] for 2 of 3 calibrated cells" in first
    assert f"half-width <= {HALF_WIDTH_MAX} for 2 of 2 with an interval" in first
    assert "both for 1 of 3" in first
    assert "n/a (1 seed)" in t.markdown and "| FP8 tensorwise |" in t.markdown
    paths = t.write(tmp_path)
    assert {p.name for p in paths.values()} == {"calibration_match.md", "calibration_match.tex",
                                                 "calibration_match.csv"}


# --- C: which tokens are clipped -----------------------------------------------------------------


def test_agreement_rows_pool_counts_over_steps_and_seeds(cal_sweep, cal_coll):
    runs = _runs_by_loop(cal_sweep)
    df, omitted = agreement_rows(cal_coll)
    assert omitted == ["GRPO 8b: BF16"]
    b8 = df[df["model"] == "8b"].set_index(["fp8", "method"])
    assert len(b8) == 5
    for (fp8, clip), (_, rec, prec, counts) in ARMS.items():
        if not counts:
            continue
        r = b8.loc[(fp8, clip)]
        per_seed = {}
        for seed, rows in sorted(runs[("8b", fp8, clip)].items()):
            sums = {}
            for row in rows:
                for k in ("low_bf16_n", "low_fp8_n", "low_both_n", "high_bf16_n", "high_fp8_n", "high_both_n"):
                    if row.get(f"shadow/{k}") is not None:
                        sums[k] = sums.get(k, 0.0) + row[f"shadow/{k}"]
            per_seed[seed] = sums
        both = [s["low_both_n"] for s in per_seed.values()]
        bf16 = [s["low_bf16_n"] for s in per_seed.values()]
        fp8n = [s["low_fp8_n"] for s in per_seed.values()]
        assert r["runs"] == 4 and r["measured_steps"] == 12
        assert r["low_bf16_tokens"] == sum(bf16)
        assert r["low_recall"] == pytest.approx(sum(both) / sum(bf16))
        assert r["low_precision"] == pytest.approx(sum(both) / sum(fp8n))
        assert r["low_count"] == pytest.approx(sum(fp8n) / sum(bf16))
        lo, hi = fieller_ratio(fp8n, bf16, paired=True)
        assert (r["low_count_lo"], r["low_count_hi"]) == pytest.approx((max(lo, 0), hi))
        assert r["low_recall"] == pytest.approx(rec, abs=0.08)
        assert r["low_precision"] == pytest.approx(prec, abs=0.08)
        lo, hi = fieller_ratio(both, bf16, paired=True)
        assert (r["low_recall_lo"], r["low_recall_hi"]) == pytest.approx((max(lo, 0), min(hi, 1)))
        lo, hi = fieller_ratio(both, fp8n, paired=True)
        assert (r["low_precision_lo"], r["low_precision_hi"]) == pytest.approx((max(lo, 0), min(hi, 1)))
        hb = [s["high_both_n"] for s in per_seed.values()]
        hd = [s["high_bf16_n"] for s in per_seed.values()]
        assert r["high_recall"] == pytest.approx(sum(hb) / sum(hd))
        assert r["mode"] == ("periodic" if clip == "calibrated" else "—")
    t = agreement_table(cal_coll)
    assert "Omitted (no `shadow/*_n` agreement counts logged" in t.markdown and "GRPO 8b: BF16" in t.markdown
    assert "n/a (1 seed)" in t.markdown  # the 14b block


def test_agreement_table_without_counts(known_coll):
    t = agreement_table(known_coll.__class__(**{**known_coll.__dict__, "steps": known_coll.steps.drop(
        columns=[c for c in known_coll.steps.columns if c.startswith("shadow/") and c.endswith("_n")])}))
    assert t.data.empty and "No run logged the agreement counts" in t.markdown


def test_calibration_mode_from_the_variant_or_the_config(tmp_path, cal_coll):
    # not varied: read from config.yaml; arms that do not calibrate show none
    modes = arm_modes(cal_coll)
    assert {m for (_, _, _, clip), m in modes.items() if clip.startswith("calibrated")} == {"periodic"}
    assert {m for (_, _, _, clip), m in modes.items() if not clip.startswith("calibrated")} == {"—"}
    specs = [RunSpec(fp8="bf16", clip="vanilla", seed=0, steps=STEPS)]
    specs += [RunSpec(fp8="tensorwise", clip="calibrated", seed=0, steps=STEPS, calibration_mode=m)
              for m in ("pooled", "same_batch")]
    make_sweep(tmp_path / "modes", specs, sweep="modes")
    coll = collect(tmp_path / "modes", workers=1, progress=False)
    modes = arm_modes(coll)
    assert modes[("grpo", "8b", "tensorwise", "calibrated[clip.calibration_mode=pooled]")] == "pooled"
    assert modes[("grpo", "8b", "tensorwise", "calibrated[clip.calibration_mode=same_batch]")] == "same_batch"
    assert modes[("grpo", "8b", "bf16", "vanilla")] == "—"
    df, _ = agreement_rows(coll)
    assert set(df["mode"]) == {"pooled", "same_batch"} and set(df["method"]) == {"calibrated"}
    assert all(math.isnan(v) for v in df["low_recall_lo"])  # one seed each
    # the variant names the mode even where config.yaml cannot be read
    for d in (tmp_path / "modes").iterdir():
        if d.is_dir():
            (d / "config.yaml").unlink()
    assert arm_modes(coll)[("grpo", "8b", "tensorwise", "calibrated[clip.calibration_mode=pooled]")] == "pooled"


def test_report_writes_both_sections(cal_coll, tmp_path):
    from analysis.report import write_report

    path = write_report(cal_coll, tmp_path / "rep", figures=[])
    text = path.read_text()
    assert "## Calibrated Clipping against BF16: the half-width criterion" in text
    assert "## Which tokens are clipped: FP8 against the BF16 shadow" in text
    for name in ("calibration_match", "clip_agreement"):
        for ext in ("md", "tex", "csv"):
            assert (tmp_path / "rep" / "tables" / f"{name}.{ext}").stat().st_size > 0
