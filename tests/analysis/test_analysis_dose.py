"""The dose-response section (analysis.dose, analysis.dose_report, analysis.dose_figures) against
references computed here from the run files read with json.loads: the dose per precision (vanilla
runs, t interval from the printed t table) and its order, surge counts from ``surge_onset`` on each
run, the share below the bound as a ratio of sums, Wilson's interval as the root of its quadratic
and published values, Fisher's exact test by enumeration and published values, Holm by hand; and
collections that get no section.

The sweep (GRPO 8b, 4 seeds, 40 steps): BF16 vanilla and, per FP precision, vanilla and TIS. The
planted doses (``actor/ratio_std``) run against the nominal order (MXFP8 the largest, NVFP4 the
smallest; one step of each NVFP4 vanilla run spiked 10^4-fold, so a mean over steps would misorder it); surges are planted per arm and seed (one BF16 run too, so counting BF16 among the FP
runs changes both counts); the A<0 counts grow with the seed while the clip fraction does too, so
the ratio of sums and the mean of per-run fractions differ.
"""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis.collect import collect
from analysis.dose import dose_arms, fisher_exact, fp_runs, has_dose, wilson
from analysis.dose_accuracy import accuracy_comparison_rows
from analysis.dose_report import dose_sections
from analysis.pooling import subset
from analysis.report_md import write_report
from analysis.surge import SurgeRule, surge_onset
from fp8rl.runs.synthetic import RunSpec, make_sweep

STEPS, SEEDS = 40, range(4)
T975_3 = 3.1824  # Student t 0.975 quantile, 3 degrees of freedom (printed table)
Z = 1.959963984540054
#: Planted dose per precision, against the nominal order mxfp8 < tensorwise < nvfp4.
DOSE = {"bf16": 0.005, "mxfp8": 0.09, "tensorwise": 0.05, "nvfp4": 0.02}
#: Seeds that surge, per (fp8, clip).
SURGES = {("bf16", "vanilla"): (3,), ("mxfp8", "vanilla"): (0, 1, 2), ("mxfp8", "tis"): (0, 1, 2, 3),
          ("tensorwise", "vanilla"): (1,), ("tensorwise", "tis"): (0, 2)}
RULE = SurgeRule.for_length(STEPS - 1)


def _specs(ratio_std=True, fp8s=tuple(DOSE)):
    out = []
    for fp8 in fp8s:
        for clip in ("vanilla",) if fp8 == "bf16" else ("vanilla", "tis"):
            for s in SEEDS:
                out.append(RunSpec(
                    fp8=fp8, clip=clip, seed=s, steps=STEPS, ratio_std=DOSE[fp8] if ratio_std else None,
                    surge_at=20 + 2 * s if s in SURGES.get((fp8, clip), ()) else None,
                    n_neg=50.0 * (1 + 3 * s), clipfrac_neg_low=0.01 * (1 + s) * (1 + 10 * DOSE[fp8]),
                    holdout_ratio=1 + 20 * DOSE[fp8], holdout_tokens=300.0,
                    eval={"mini": 0.5}, eval_bf16={"mini": _planted_acc(fp8, clip, s)}))
    return out


def _planted_acc(fp8, clip, seed):
    """The final BF16-scored avg@k planted per run: a dose and seed trend plus per-run noise, so
    that paired differences vary over seeds (the synthetic step 0 is half of it)."""
    noise = np.random.default_rng([seed, list(DOSE).index(fp8), len(clip)]).normal(0.0, 0.02)
    return 0.4 + 0.01 * seed + DOSE[fp8] + noise


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    path = tmp_path_factory.mktemp("dose") / "dose"
    make_sweep(path, _specs(), sweep="dose", fast=True)
    # One heavy-tailed step per NVFP4 vanilla run, as FP4 logs them (a step's std of r - 1 at 10^4 x
    # the run's typical one): the median over steps ignores it, a mean would make NVFP4 the top dose.
    for d in path.iterdir():
        cfg = yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").exists() else None
        if cfg and (cfg["fp8"]["name"], cfg["clip"]["name"]) == ("nvfp4", "vanilla"):
            rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
            spiked = [r for r in rows if "actor/ratio_std" in r][STEPS // 2]
            spiked["actor/ratio_std"] = 1e4 * DOSE["nvfp4"]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def coll(sweep):
    return collect(sweep, workers=1, progress=False)


@pytest.fixture(scope="module")
def numbers(coll):
    return dose_arms(coll, RULE)


@pytest.fixture(scope="module")
def loop(sweep):
    """{(fp8, clip): {seed: (metrics rows, eval rows)}} read with json.loads line by line."""
    out: dict = {}
    for d in sorted(p for p in Path(sweep).iterdir() if (p / "metrics.jsonl").exists()):
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        ev = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines() if x.strip()]
        out.setdefault((cfg["fp8"]["name"], cfg["clip"]["name"]), {})[cfg["seed"]] = (rows, ev)
    return out


@pytest.fixture(scope="module")
def section(coll, tmp_path_factory):
    out = tmp_path_factory.mktemp("dose_report")
    secs = dose_sections(coll, out / "tables", out / "figures", rule=RULE)
    return out, secs


def _onset(rows):
    return surge_onset([r["step"] for r in rows], [r["actor/entropy"] for r in rows], RULE)


def _arm(arms, fp8, clip):
    a = arms[(arms["fp8"] == fp8) & (arms["clip"] == clip)]
    assert len(a) == 1
    return a.iloc[0]


def _wilson_ref(k, n):
    """The two roots p of (k/n - p)^2 = z^2 p (1 - p) / n (the score test's acceptance bounds)."""
    ph, z2 = k / n, Z * Z / n
    a, b, c = 1 + z2, -(2 * ph + z2), ph * ph
    r = math.sqrt(b * b - 4 * a * c)
    return (-b - r) / (2 * a), (-b + r) / (2 * a)


def _fisher_ref(table):
    """Two-sided Fisher p by enumerating every 2x2 table with the margins of ``table``."""
    (a, b), (c, d) = table
    n, r1, c1 = a + b + c + d, a + b, a + c

    def prob(x):
        return math.comb(r1, x) * math.comb(n - r1, c1 - x) / math.comb(n, c1)

    p0 = prob(a)
    return sum(prob(x) for x in range(0, min(r1, c1) + 1) if c1 - x <= n - r1 and prob(x) <= p0 * (1 + 1e-9))


def test_wilson_against_its_quadratic_and_published_values():
    for n in (1, 4, 6, 24):
        for k in range(n + 1):
            p, lo, hi = wilson(k, n)
            rlo, rhi = _wilson_ref(k, n)
            assert p == pytest.approx(k / n)
            assert lo == pytest.approx(max(rlo, 0.0), abs=1e-12) and hi == pytest.approx(min(rhi, 1.0), abs=1e-12)
    assert wilson(0, 10)[2] == pytest.approx(0.27753, abs=1e-5)  # the textbook 0/10 upper bound
    assert wilson(5, 10)[1:] == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson(0, 24)[1] == 0.0 and wilson(6, 6)[2] == 1.0
    assert all(math.isnan(x) for x in wilson(0, 0))
    with pytest.raises(ValueError, match="k <= n"):
        wilson(3, 2)


def test_fisher_exact_against_enumeration_and_published_values():
    # scipy.stats.fisher_exact / R's fisher.test: Wikipedia's example, the tea-tasting table, two more
    for table, p in ((((1, 9), (11, 3)), 0.0027594561852200836), (((3, 1), (1, 3)), 0.4857142857142857),
                     (((5, 1), (0, 6)), 0.015151515151515152), (((0, 6), (4, 2)), 0.06060606060606061)):
        assert fisher_exact(*table[0], *table[1]) == pytest.approx(p, rel=1e-12)
    for a in range(5):
        for c in range(7):
            t = ((a, 4 - a), (c, 6 - c))
            assert fisher_exact(*t[0], *t[1]) == pytest.approx(min(1.0, _fisher_ref(t)), rel=1e-12)
    assert fisher_exact(0, 24, 0, 6) == 1.0


def test_doses_ordered_by_the_measured_ratio_std_not_the_nominal_order(numbers, loop, section):
    _, levels, arms, _ = numbers
    assert levels["fp8"].tolist() == ["bf16", "nvfp4", "tensorwise", "mxfp8"]  # nominal: mxfp8 < tensorwise < nvfp4
    assert levels["dose_rank"].tolist() == [0, 1, 2, 3]
    assert levels.set_index("fp8")["nominal_rank"].to_dict() == {"bf16": 0, "mxfp8": 1, "tensorwise": 2, "nvfp4": 4}
    for lv in levels.itertuples(index=False):  # the dose: the vanilla runs' mean of per-run medians, t interval
        per_run = [np.median([r["actor/ratio_std"] for r in rows if "actor/ratio_std" in r])
                   for rows, _ in loop[(lv.fp8, "vanilla")].values()]
        m, h = np.mean(per_run), T975_3 * np.std(per_run, ddof=1) / 2
        assert (lv.dose_mean, lv.dose_lo, lv.dose_hi) == pytest.approx((m, m - h, m + h), rel=1e-4)
        assert lv.dose_from == "vanilla" and lv.dose_n == 4
    assert list(dict.fromkeys(arms["fp8"])) == ["bf16", "nvfp4", "tensorwise", "mxfp8"]
    out, secs = section
    text = "\n".join(secs[0][1])
    assert "FP4 NVFP4 (0.02" in text and "the two orders differ." in text
    rows = [ln for ln in (out / "tables" / "dose.md").read_text().splitlines() if ln.startswith("| ") and "rank" not in ln]
    assert [r.split(" | ")[2] for r in rows] == ["BF16", "FP4 NVFP4", "FP4 NVFP4", "FP8 tensorwise", "FP8 tensorwise",
                                                 "FP8 MXFP8", "FP8 MXFP8"]
    curve = pd.read_csv(out / "figures" / "dose_response.csv")
    vanilla = curve[curve["clip"] == "vanilla"].sort_values("dose")
    assert vanilla["fp8"].tolist() == ["bf16", "nvfp4", "tensorwise", "mxfp8"]


def test_surge_counts_and_onsets_match_surge_onset_on_each_run(numbers, loop):
    runs, _, arms, _ = numbers
    for (fp8, clip), seeds in loop.items():
        onsets = [_onset(rows) for rows, _ in seeds.values()]
        hit = [o for o in onsets if o is not None]
        a = _arm(arms, fp8, clip)
        assert len(hit) == len(SURGES.get((fp8, clip), ()))  # the planted surges are found
        assert (a["runs"], a["surged"]) == (len(onsets), len(hit))
        lo, hi = _wilson_ref(len(hit), len(onsets))
        assert (a["p_lo"], a["p_hi"]) == pytest.approx((max(lo, 0), min(hi, 1)), abs=1e-12)
        if hit:
            assert (a["onset_median"], a["onset_min"], a["onset_max"]) == (np.median(hit), min(hit), max(hit))
            after = [r["rollout/garbled_frac"] for rows, _ in seeds.values() for r in rows
                     if _onset(rows) is not None and r["step"] >= _onset(rows)]
            assert a["garbled_after"] == pytest.approx(np.mean(after))
        else:
            assert math.isnan(a["onset_median"]) and math.isnan(a["garbled_after"])
        assert a["garbled"] == pytest.approx(np.mean([r["rollout/garbled_frac"] for rows, _ in seeds.values()
                                                      for r in rows]))
    assert int(runs["surged"].sum()) == sum(len(v) for v in SURGES.values())


def test_share_below_the_bound_is_a_ratio_of_sums(numbers, loop):
    _, _, arms, _ = numbers
    for (fp8, clip), seeds in loop.items():
        low = [sum(r["actor/n_neg_low"] for r in rows) for rows, _ in seeds.values()]
        neg = [sum(r["actor/n_neg"] for r in rows) for rows, _ in seeds.values()]
        mean_of_fractions = np.mean(np.array(low) / np.array(neg))
        a = _arm(arms, fp8, clip)
        assert a["share"] == pytest.approx(sum(low) / sum(neg), rel=1e-12)
        assert abs(sum(low) / sum(neg) - mean_of_fractions) > 0.05 * mean_of_fractions  # the sweep tells them apart
        assert (a["n_neg_low"], a["n_neg"]) == (sum(low), sum(neg))


def test_heldout_ratio_and_final_bf16_accuracy(numbers, loop):
    _, _, arms, _ = numbers
    for (fp8, clip), seeds in loop.items():
        a = _arm(arms, fp8, clip)
        fp = sum(r["shadow/ho_fp8_low_n"] for rows, _ in seeds.values() for r in rows)
        bf = sum(r["shadow/ho_bf16_low_n"] for rows, _ in seeds.values() for r in rows)
        assert a["ho_ratio"] == pytest.approx(fp / bf, rel=1e-12) and a["ho_lo"] < a["ho_ratio"] < a["ho_hi"]
        acc = [max(ev, key=lambda e: e["step"])["eval_bf16/mini/avg@k"] for _, ev in seeds.values()]
        m, h = np.mean(acc), T975_3 * np.std(acc, ddof=1) / 2
        assert (a["acc_mean"], a["acc_lo"], a["acc_hi"]) == pytest.approx((m, m - h, m + h), rel=1e-4)


def test_comparisons_fisher_and_holm_by_hand(numbers, section):
    _, _, arms, comp = numbers
    # 3 doses x TIS against vanilla, 6 FP arms against BF16 vanilla
    assert len(comp) == 9 and "bf16" not in set(comp["fp8"])
    assert (comp["against"] == "vanilla").sum() == 3 and (comp["against"] == "BF16").sum() == 6
    for r in comp.itertuples(index=False):
        ref = _arm(arms, r.fp8, "vanilla") if r.against == "vanilla" else _arm(arms, "bf16", "vanilla")
        assert (r.ref_surged, r.ref_runs) == (ref["surged"], ref["runs"])
        t = ((r.surged, r.runs - r.surged), (r.ref_surged, r.ref_runs - r.ref_surged))
        assert r.p == pytest.approx(min(1.0, _fisher_ref(t)), rel=1e-12)
    p = comp["p"].to_numpy()
    order = np.argsort(p, kind="stable")
    adj, running = np.empty(len(p)), 0.0
    for j, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - j) * p[i]))
        adj[i] = running
    assert comp["p_holm"].to_numpy() == pytest.approx(adj, rel=1e-12)
    assert (adj > p + 1e-9).any()  # the correction changes something here
    assert comp["survives"].tolist() == (adj < 0.05).tolist()
    out, _ = section
    md = (out / "tables" / "dose_comparisons.md").read_text()
    assert "Holm" in md and "over all 9 comparisons" in md
    smallest = comp.loc[comp["p"].idxmin()]
    assert f"| {smallest['p']:.3g} | {smallest['p_holm']:.3g} |" in md


def _t_two_sided_ref(t, df, n=200_000):
    """2 P(T > |t|) by integrating Student's t density on [0, |t|] (Simpson's rule)."""
    x = np.linspace(0.0, abs(t), n + 1)
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    f = c * (1 + x * x / df) ** (-(df + 1) / 2)
    integral = (x[1] - x[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return 1 - 2 * integral


def _gain(ev):
    """BF16-scored avg@k, last evaluation minus step 0, from a run's eval rows."""
    by_step = {e["step"]: e["eval_bf16/mini/avg@k"] for e in ev if "eval_bf16/mini/avg@k" in e}
    return by_step[max(by_step)] - by_step[0]


def test_accuracy_comparisons_paired_by_seed_on_the_gain_with_holm(coll, numbers, loop, section):
    _, _, arms, comp = numbers
    acc = accuracy_comparison_rows(coll, arms)
    # the surge comparisons' pairs, in the same order
    assert acc[["fp8", "clip", "against"]].values.tolist() == comp[["fp8", "clip", "against"]].values.tolist()
    for r in acc.itertuples(index=False):
        ref = (r.fp8, "vanilla") if r.against == "vanilla" else ("bf16", "vanilla")
        d = np.array([_gain(loop[(r.fp8, r.clip)][s][1]) - _gain(loop[ref][s][1]) for s in SEEDS])
        m, sd = d.mean(), d.std(ddof=1)
        h, t = T975_3 * sd / 2, m / (sd / 2)
        assert r.pairs == 4
        assert (r.diff_mean, r.t) == pytest.approx((m, t), rel=1e-9)
        assert (r.diff_lo, r.diff_hi) == pytest.approx((m - h, m + h), abs=1e-4 * h)  # T975_3: 4 places
        assert r.p == pytest.approx(_t_two_sided_ref(t, 3), abs=1e-7)
        # the gain, not the final value: the planted step 0 differs between arms
        finals = np.array([_planted_acc(r.fp8, r.clip, s) - _planted_acc(*ref, s) for s in SEEDS])
        assert abs(r.diff_mean - finals.mean()) > 1e-3
    p = acc["p"].to_numpy()
    order, running, adj = np.argsort(p, kind="stable"), 0.0, np.empty(len(p))
    for j, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - j) * p[i]))
        adj[i] = running
    assert acc["p_holm"].to_numpy() == pytest.approx(adj, rel=1e-12)
    assert acc["survives"].tolist() == (adj < 0.05).tolist() and acc["survives"].any()
    out, secs = section
    md = (out / "tables" / "dose_accuracy.md").read_text()
    assert "over all 9 accuracy comparisons" in md
    best = acc.loc[acc["p"].idxmin()]
    assert f"| {best['t']:.2f} | {best['p']:.3g} | {best['p_holm']:.3g} | yes |" in md
    assert f"{int(acc['survives'].sum())} of 9 paired comparisons" in "\n".join(secs[0][1])


def test_accuracy_comparison_pairs_only_the_seeds_both_arms_finished(coll, numbers):
    _, _, arms, _ = numbers
    drop = coll.runs[(coll.runs["fp8"] == "mxfp8") & (coll.runs["clip"] == "tis") & (coll.runs["seed"] == 2)]
    part = subset(coll, set(coll.runs["run"].astype(str)) - set(drop["run"].astype(str)))
    acc = accuracy_comparison_rows(part, arms)
    rows = acc[(acc["fp8"] == "mxfp8") & (acc["clip"] == "tis")]
    assert rows["pairs"].tolist() == [3, 3] and (acc.drop(rows.index)["pairs"] == 4).all()
    gains = {(r.fp8, r.clip, r.against): r.ref_gain for r in acc.itertuples(index=False)}
    full = {(r.fp8, r.clip, r.against): r.ref_gain
            for r in accuracy_comparison_rows(coll, arms).itertuples(index=False)}
    # the reference's mean gain is over the paired seeds only
    assert gains[("mxfp8", "tis", "vanilla")] != pytest.approx(full[("mxfp8", "tis", "vanilla")], rel=1e-9)


def test_bf16_runs_are_not_fp_runs(numbers, section):
    runs, _, _, comp = numbers
    fp_surged = sum(len(v) for k, v in SURGES.items() if k[0] != "bf16")
    fp = fp_runs(runs)
    assert (len(fp), int(fp["surged"].sum())) == (24, fp_surged) and "bf16" not in set(fp["fp8"])
    assert "bf16" not in set(comp["fp8"])
    _, secs = section
    text = "\n".join(secs[0][1])
    assert f"{fp_surged} of 24 FP runs surged" in text
    assert "1 of 4 BF16 vanilla runs surged" in text
    assert "vanilla 4 of 12 surged" in text and "TIS 6 of 12 surged" in text


def test_section_files_and_report(coll, section, sweep, tmp_path):
    out, secs = section
    assert [t for t, _ in secs] == ["Dose response"]
    for name in ("dose", "surge_dose", "dose_comparisons", "dose_accuracy"):
        assert all((out / "tables" / f"{name}.{ext}").is_file() for ext in ("md", "tex", "csv"))
    for name in ("entropy_dose", "dose_response", "share_vs_surge"):
        assert (out / "figures" / f"{name}.png").is_file() and (out / "figures" / f"{name}.csv").is_file()
    text = "\n".join(secs[0][1])
    assert f"warm-up {RULE.warmup}" in text and f"m = {RULE.m}" in text  # the rule's parameters are stated
    share = pd.read_csv(out / "figures" / "share_vs_surge.csv")
    assert len(share) == 28 and share["surged"].sum() == sum(len(v) for v in SURGES.values())
    report = write_report(coll, tmp_path / "r", figures=[], rule=RULE).read_text()
    assert "## Dose response" in report and (tmp_path / "r" / "tables" / "surge_dose.md").is_file()


def test_no_section_without_ratio_std_or_with_one_fp_dose(tmp_path):
    for name, specs in (("none", _specs(ratio_std=False)), ("one", _specs(fp8s=("bf16", "mxfp8")))):
        make_sweep(tmp_path / name, specs, sweep=name, fast=True)
        c = collect(tmp_path / name, workers=1, progress=False)
        assert not has_dose(c)
        assert dose_sections(c, tmp_path / f"{name}_t", tmp_path / f"{name}_f", rule=RULE) == []
        assert not (tmp_path / f"{name}_t").exists() and not (tmp_path / f"{name}_f").exists()
