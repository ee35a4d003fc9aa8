"""The held-out calibration error, grad_cos (analysis.heldout) and what holds by construction
(analysis.calibration_report), against sums read from the run directories with json.loads
(tests/analysis/calib_sweep.py) and the printed t table."""

import json
import math
import shutil

import numpy as np
import pytest
import yaml
from calib_sweep import ARMS, SEEDS, runs_by_loop, total, write

from analysis.calibration_report import construction_note, construction_rows, construction_table
from analysis.clip_config import SAME_BATCH, default_estimator, run_settings
from analysis.collect import collect
from analysis.heldout import heldout_rows, heldout_table, mean_ci
from analysis.ratio_ci import fieller_ratio
from fp8rl.runs.synthetic import RunSpec, make_sweep

T975 = {2: 4.3027, 3: 3.1824}  # Student t 0.975 quantiles (printed tables)
OOS = ("shadow/oos_n_neg", "shadow/oos_fp8_low_n", "shadow/oos_bf16_low_n")
XFIT = ("shadow/xfit_n_neg", "shadow/xfit_fp8_low_n", "shadow/xfit_bf16_low_n")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    return write(tmp_path_factory.mktemp("heldout") / "heldout")


@pytest.fixture(scope="module")
def coll(sweep):
    return collect(sweep, workers=1, progress=False)


@pytest.fixture(scope="module")
def loop(sweep):
    return runs_by_loop(sweep)


def _row(df, fp8, clip, mode=None, model="8b"):
    method = clip
    m = "—" if clip != "calibrated" else mode
    r = df[(df["model"] == model) & (df["fp8"] == fp8) & (df["method"] == method) & (df["mode"] == m)]
    assert len(r) == 1, (fp8, clip, mode, len(r))
    return r.iloc[0]


def _t_interval(values):
    """Mean and 95% Student t interval with an explicit loop and the printed t table."""
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = T975[n - 1] * sd / math.sqrt(n)
    return m, m - h, m + h


def test_heldout_ratio_out_of_sample_and_cross_fitted(coll, loop):
    df, omitted = heldout_rows(coll)
    assert omitted == ["GRPO 14b: BF16", "GRPO 14b: FP8 tensorwise (vanilla)", "GRPO 14b: FP8 tensorwise + calibrated"]
    for (fp8, clip, mode), (*_, ratio, _cos) in ARMS.items():
        r = _row(df, fp8, clip, mode)
        keys = XFIT if mode == SAME_BATCH else OOS
        assert r["kind"] == ("cross-fitted" if mode == SAME_BATCH else "out of sample")
        runs = loop[("8b", fp8, clip, mode)]
        n_neg = [total(runs[s], keys[0]) for s in SEEDS]
        fp8n = [total(runs[s], keys[1]) for s in SEEDS]
        bf16 = [total(runs[s], keys[2]) for s in SEEDS]
        assert (r["n_neg_tokens"], r["fp8_tokens"], r["bf16_tokens"]) == (sum(n_neg), sum(fp8n), sum(bf16))
        assert r["runs"] == 4 and r["steps"] == 12
        lo, hi = fieller_ratio(fp8n, bf16, paired=True)
        assert r["ratio"] == pytest.approx(sum(fp8n) / sum(bf16), rel=1e-12)
        assert (r["ratio_lo"], r["ratio_hi"]) == pytest.approx((max(lo, 0), hi), rel=1e-9)
        assert r["ratio_text"] == f"{sum(fp8n) / sum(bf16):.2f} [{max(lo, 0):.2f}, {hi:.2f}]"
        assert r["ratio"] == pytest.approx(ratio, rel=0.35)  # the planted ratio, up to binomial noise
    sb = _row(df, "tensorwise", "calibrated", SAME_BATCH)
    assert sb["lower_estimator"] == "in_sample"
    assert _row(df, "tensorwise", "calibrated", "periodic")["lower_estimator"] == "unbiased"


def test_grad_cos_mean_and_the_paired_difference_to_tis(coll, loop):
    df, _ = heldout_rows(coll)
    tis = {s: np.mean([r["shadow/grad_cos"] for r in loop[("8b", "tensorwise", "tis", None)][s]
                       if r.get("shadow/grad_cos") is not None]) for s in SEEDS}
    for (fp8, clip, mode), (*_, cos) in ARMS.items():
        r = _row(df, fp8, clip, mode)
        per_seed = {s: np.mean([row["shadow/grad_cos"] for row in loop[("8b", fp8, clip, mode)][s]
                                if row.get("shadow/grad_cos") is not None]) for s in SEEDS}
        m, lo, hi = _t_interval(list(per_seed.values()))
        assert r["grad_cos_runs"] == 4
        assert (r["grad_cos_mean"], r["grad_cos_lo"], r["grad_cos_hi"]) == pytest.approx((m, lo, hi), abs=1e-6)
        assert r["grad_cos_mean"] == pytest.approx(cos, abs=0.003)
        if fp8 == "bf16":
            assert r["tis_clip"] == "" and r["tis_pairs"] == 0
            continue
        if clip == "tis":
            assert r["tis_clip"] == "tis" and math.isnan(r["tis_diff_mean"])
            continue
        d = [per_seed[s] - tis[s] for s in SEEDS]
        m, lo, hi = _t_interval(d)
        assert r["tis_pairs"] == 4
        assert (r["tis_diff_mean"], r["tis_diff_lo"], r["tis_diff_hi"]) == pytest.approx((m, lo, hi), abs=1e-6)
        sd = np.std(d, ddof=1)
        assert r["tis_diff_t"] == pytest.approx(m / (sd / 2), rel=1e-6)
    md = heldout_table(coll).markdown
    assert "| FP8 tensorwise | calibrated | same_batch | cross-fitted | 4 |" in md
    assert "reference" in md and "no TIS arm" in md and "tables/clip_agreement.md" in md
    assert "Omitted (no held-out counts" in md and "GRPO 14b: BF16" in md


def test_xfit_is_never_counted_as_out_of_sample(tmp_path):
    """A periodic run that also carries xfit counts, and a same_batch run that carries out-of-sample
    counts: each is read from the keys its mode names, whatever else is in the file."""
    src = write(tmp_path / "src")
    loop = runs_by_loop(src)
    rng = np.random.default_rng(0)
    for d in src.iterdir():
        if not (d / "metrics.jsonl").exists():
            continue
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        if cfg["model"]["name"] != "8b" or cfg["clip"]["name"] != "calibrated":
            continue
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for row in rows:
            if row.get("shadow/low_bf16_n") is None:
                continue
            wrong = XFIT if cfg["clip"]["calibration_mode"] == "periodic" else OOS
            row[wrong[0]] = 400.0
            row[wrong[1]] = float(rng.integers(100, 200))  # a ratio far from anything planted
            row[wrong[2]] = 5.0
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = collect(src, workers=1, progress=False)
    df, _ = heldout_rows(c)
    for mode, keys in (("periodic", OOS), (SAME_BATCH, XFIT)):
        r = _row(df, "tensorwise", "calibrated", mode)
        runs = loop[("8b", "tensorwise", "calibrated", mode)]
        fp8n = sum(total(runs[s], keys[1]) for s in SEEDS)
        bf16 = sum(total(runs[s], keys[2]) for s in SEEDS)
        assert r["ratio"] == pytest.approx(fp8n / bf16, rel=1e-12) and r["ratio"] < 2


def test_one_row_per_calibration_mode_when_sweeps_are_combined(tmp_path):
    """Two sweeps, one mode each (so not a variant): the mode comes from config.yaml and the rows
    stay apart."""
    for mode in ("periodic", SAME_BATCH):
        make_sweep(tmp_path / mode, [RunSpec(fp8="tensorwise", clip="calibrated", seed=s, steps=21,
                                             calibration_mode=mode, heldout_ratio=1.0, grad_cos=0.9)
                                     for s in range(2)], sweep=mode)
    c = collect([tmp_path / "periodic", tmp_path / SAME_BATCH], workers=1, progress=False)
    df, _ = heldout_rows(c)
    assert sorted(zip(df["mode"], df["kind"], df["runs"], strict=True)) == [
        ("periodic", "out of sample", 2), ("same_batch", "cross-fitted", 2)]


def test_old_runs_and_missing_configs(tmp_path, known_coll):
    t = heldout_table(known_coll)
    assert t.data.empty and "No run logged the held-out counts" in t.markdown
    # no config.yaml: a calibrated run's mode is unknown; its kind follows its data
    make_sweep(tmp_path / "nocfg", [RunSpec(fp8="tensorwise", clip="calibrated", seed=s, steps=21,
                                            calibration_mode="same_batch", heldout_ratio=1.0) for s in range(2)],
               sweep="nocfg")
    for d in (tmp_path / "nocfg").iterdir():
        if d.is_dir():
            (d / "config.yaml").unlink()
    c = collect(tmp_path / "nocfg", workers=1, progress=False)
    s = run_settings(c)
    assert set(s["mode"]) == {""} and set(s["lower_estimator"]) == {""}
    df, _ = heldout_rows(c)
    assert list(df["kind"]) == ["cross-fitted"]  # logged no out-of-sample token, but xfit ones
    row = construction_rows(c).iloc[0]
    assert row["by_construction"] == "unknown calibration mode"


def test_lower_estimator_default_agrees_with_the_trainer():
    from fp8rl.rl.calibration.schedule import CALIBRATION_MODES, resolve_lower_estimator

    for mode in CALIBRATION_MODES.names():
        assert default_estimator(mode) == resolve_lower_estimator(mode, None), mode
    assert default_estimator("") == ""


def test_configured_lower_estimator_wins(tmp_path):
    make_sweep(tmp_path / "est", [RunSpec(fp8="tensorwise", clip="calibrated", seed=0, steps=21,
                                          calibration_mode="same_batch")], sweep="est")
    d = next(p for p in (tmp_path / "est").iterdir() if p.is_dir())
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["clip"]["lower_estimator"] = "unbiased"
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    c = collect(tmp_path / "est", workers=1, progress=False)
    assert list(run_settings(c)["lower_estimator"]) == ["unbiased"]
    assert construction_rows(c).iloc[0]["by_construction"].startswith("bounds fit on the tokens they rule")


@pytest.mark.parametrize(("args", "start"), [
    (("bf16", "calibrated", "same_batch", "in_sample"), "no FP8"),
    (("tensorwise", "vanilla", "—", ""), "nothing (never calibrates)"),
    (("tensorwise", "tis", "—", ""), "nothing (never calibrates)"),
    (("tensorwise", "calibrated", "same_batch", "in_sample"), "FP8-clipped / own shadow ~1"),
    (("tensorwise", "calibrated", "same_batch", "unbiased"), "bounds fit on the tokens they rule"),
    (("tensorwise", "calibrated", "periodic", "unbiased"), "nothing: the bounds rule tokens"),
    (("tensorwise", "calibrated", "pooled", "unbiased"), "nothing: the bounds rule tokens"),
    (("tensorwise", "calibrated", "sampled", "unbiased"), "nothing: the bounds rule tokens"),
    (("tensorwise", "calibrated", "periodic/pooled", "unbiased"), "modes differ"),
])
def test_construction_note(args, start):
    assert construction_note(*args).startswith(start)


def test_construction_table_puts_the_numbers_side_by_side(coll, sweep):
    from analysis.calibration_match import agreement_rows
    from analysis.clip_tables import mechanism_table

    df = construction_rows(coll)
    mech = mechanism_table(coll).data.set_index(["model", "arm"])
    agree = agreement_rows(coll)[0].set_index(["model", "arm"])
    held = heldout_rows(coll)[0].set_index(["model", "arm"])
    for _, r in df[df["model"] == "8b"].iterrows():
        key = ("8b", r["arm"])
        if r["fp8"] == "bf16":
            assert (r["s_text"], r["fraction_text"], r["count_text"]) == ("reference",) * 3
        else:
            assert r["fraction"] == pytest.approx(mech.loc[key, "x_bf16"], rel=1e-12)
            assert r["count_text"] == mech.loc[key, "count_x_bf16_text"]
            assert r["s_text"].split(" ")[0] == f"{r['s']:.2f}"
        assert r["measured"] == pytest.approx(agree.loc[key, "low_count"], rel=1e-12)
        assert r["heldout_text"] == f"{held.loc[key, 'ratio_text']} ({held.loc[key, 'kind']})"
    sb = df[(df["mode"] == SAME_BATCH)].iloc[0]
    assert sb["lower_estimator"] == "in_sample" and sb["by_construction"].startswith("FP8-clipped / own shadow ~1")
    old = df[(df["model"] == "14b") & (df["fp8"] != "bf16")]
    assert (old["s_text"] == "n/a (not logged)").all() and (old["count_text"] == "n/a (not logged)").all()
    assert (old["heldout_text"] == "n/a (not logged)").all()
    assert "holds by construction" in construction_table(coll).markdown


def test_report_writes_the_calibration_section(coll, tmp_path):
    from analysis.report import write_report

    text = write_report(coll, tmp_path / "rep", figures=[]).read_text()
    titles = [line for line in text.splitlines() if line.startswith("## ")]
    i = titles.index("## Calibrated Clipping against BF16: the half-width criterion")
    assert titles[i:i + 4] == ["## Calibrated Clipping against BF16: the half-width criterion",
                               "## What holds by construction",
                               "## Which tokens are clipped: FP8 against the BF16 shadow",
                               "## Held-out calibration error and the gradient against BF16's"]
    for name in ("by_construction", "heldout_calibration"):
        for ext in ("md", "tex", "csv"):
            assert (tmp_path / "rep" / "tables" / f"{name}.{ext}").stat().st_size > 0
    shutil.rmtree(tmp_path / "rep")


def test_mean_ci():
    assert mean_ci([]) == (pytest.approx(math.nan, nan_ok=True),) * 3 + (0,)
    m, lo, hi, n = mean_ci([0.5])
    assert (m, n) == (0.5, 1) and math.isnan(lo) and math.isnan(hi)
    m, lo, hi, n = mean_ci([1.0, 2.0, 3.0, float("nan")])
    assert n == 3 and (m, lo, hi) == pytest.approx(_t_interval([1.0, 2.0, 3.0]), abs=1e-4)  # table: 4 decimals
