"""End-of-training entropy paired by seed (analysis.entropy_paired), against numbers read back from the
run directories with json.loads and computed with plain loops and the printed t table.

The sweep (GRPO 8b, seeds 0-3, 21 logged steps: the last 25% is the last 6): BF16, tensorwise vanilla
(a non-finite entropy every 4th step), TIS, and calibrated with two modes (same_batch, sampled: a
variant, as in a sweep that varies ``clip.calibration_mode``). Each (arm, seed) ends at its own planted
entropy floor. BF16 seed 1 FAILED (its metrics are there, it must not count) and the sampled arm's
seed 2 never ran: the differences pair only over the common seeds.
"""

import dataclasses
import json
import math

import pytest
import yaml

from analysis.collect import collect
from analysis.entropy_paired import entropy_paired_table, entropy_rows, run_end_entropy, seed_ranges
from analysis.tables import trajectory_table
from fp8rl.runs.synthetic import RunSpec, make_sweep

T975 = {1: 12.706205, 2: 4.302653, 3: 3.182446}  # Student t 0.975 quantiles (printed tables)
STEPS = 21
SEEDS = range(4)
# (fp8, clip, mode): end-entropy floor per seed (nats)
FLOORS = {
    ("bf16", "vanilla", None): (0.0200, 0.0230, 0.0210, 0.0190),
    ("tensorwise", "vanilla", None): (0.0260, 0.0270, 0.0250, 0.0265),
    ("tensorwise", "tis", None): (0.0230, 0.0262, 0.0236, 0.0221),
    ("tensorwise", "calibrated", "same_batch"): (0.0214, 0.0247, 0.0225, 0.0203),
    ("tensorwise", "calibrated", "sampled"): (0.0226, 0.0251, 0.0229, 0.0212),
}
FAILED = {("bf16", "vanilla", None, 1)}
MISSING = {("tensorwise", "calibrated", "sampled", 2)}


def _specs(sweep_modes=("same_batch", "sampled")) -> list[RunSpec]:
    out = []
    for (fp8, clip, mode), floors in FLOORS.items():
        if mode is not None and mode not in sweep_modes:
            continue
        for s in SEEDS:
            state = None if (fp8, clip, mode, s) in MISSING else "FAILED" if (fp8, clip, mode, s) in FAILED else "DONE"
            out.append(RunSpec(fp8=fp8, clip=clip, seed=s, steps=STEPS, entropy_floor=floors[s], calibration_mode=mode,
                               state=state, nan_every=4 if clip == "vanilla" and fp8 != "bf16" else None))
    return out


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    path = tmp_path_factory.mktemp("entropy") / "ent"
    make_sweep(path, _specs(), sweep="ent")
    return path


@pytest.fixture(scope="module")
def coll(sweep):
    return collect(sweep, workers=1, progress=False)


def end_by_loop(sweep) -> dict:
    """{(fp8, clip, mode): {seed: end entropy}} of the finished runs: json.loads line by line, the last
    ceil(n / 4) logged steps, nulls skipped."""
    out: dict = {}
    for d in sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists()):
        if json.loads((d / "status.json").read_text())["state"] != "DONE":
            continue
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows.sort(key=lambda r: r["step"])
        w = math.ceil(len(rows) / 4)
        vals = [r["actor/entropy"] for r in rows[len(rows) - w:] if r.get("actor/entropy") is not None]
        key = (cfg["fp8"]["name"], cfg["clip"]["name"], cfg["clip"].get("calibration_mode"))
        out.setdefault(key, {})[cfg["seed"]] = sum(vals) / len(vals)
    return out


def mean_t(values):
    """Mean, 95% interval (printed t table) and t of ``values``, with loops."""
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = T975[n - 1] * sd / math.sqrt(n)
    return m, m - h, m + h, m / (sd / math.sqrt(n))


def _row(df, clip, mode):
    r = df[(df["method"] == clip) & (df["mode"] == mode)] if mode else df[(df["clip"] == clip) & (df["fp8"] != "bf16")]
    assert len(r) == 1, (clip, mode)
    return r.iloc[0]


def test_end_entropy_is_the_mean_of_the_last_quarter_of_finished_runs(coll, sweep):
    loop = end_by_loop(sweep)
    per_run = run_end_entropy(coll)
    assert len(per_run) == sum(len(v) for v in loop.values()) == 4 * 5 - 2  # FAILED and missing left out
    settings = {r: m for r, m in zip(per_run["run"], per_run["mode"], strict=True)}
    for _, r in per_run.iterrows():
        mode = settings[r["run"]] if r["fp8"] != "bf16" and r["clip"].startswith("calibrated") else None
        assert r["end_entropy"] == pytest.approx(loop[(r["fp8"], r["clip"].split("[")[0], mode)][r["seed"]],
                                                 rel=1e-12)
    # the trajectory table's "last" is the same window (its TIS arm has only finished runs)
    traj = trajectory_table(coll).data.set_index("clip")
    tis = per_run[per_run["clip"] == "tis"]["end_entropy"]
    assert traj.loc["tis", "entropy_last_mean"] == pytest.approx(tis.mean(), rel=1e-12)


def test_differences_to_bf16_and_tis_paired_by_seed(coll, sweep):
    loop = end_by_loop(sweep)
    df, _ = entropy_rows(coll)
    bf16 = loop[("bf16", "vanilla", None)]
    tis = loop[("tensorwise", "tis", None)]
    assert sorted(bf16) == [0, 2, 3]
    for clip, mode, key in (("vanilla", None, ("tensorwise", "vanilla", None)), ("tis", None, ("tensorwise", "tis", None)),
                            ("calibrated", "same_batch", ("tensorwise", "calibrated", "same_batch")),
                            ("calibrated", "sampled", ("tensorwise", "calibrated", "sampled"))):
        r = _row(df, clip, mode)
        mine = loop[key]
        d = [mine[s] - bf16[s] for s in sorted(mine) if s in bf16]
        m, lo, hi, t = mean_t(d)
        assert r["bf16_pairs"] == len(d) == len(set(mine) & {0, 2, 3})
        assert (r["bf16_mean"], r["bf16_lo"], r["bf16_hi"], r["bf16_t"]) == pytest.approx((m, lo, hi, t), rel=1e-6)
        if clip != "calibrated":
            assert r["tis_pairs"] == 0 and math.isnan(r["tis_mean"])
            continue
        d = [mine[s] - tis[s] for s in sorted(mine) if s in tis]
        m, lo, hi, t = mean_t(d)
        assert r["tis_pairs"] == len(d) == len(mine)
        assert (r["tis_mean"], r["tis_lo"], r["tis_hi"], r["tis_t"]) == pytest.approx((m, lo, hi, t), rel=1e-6)
    ref = df[df["fp8"] == "bf16"].iloc[0]
    assert ref["runs"] == 3 and ref["bf16_pairs"] == 0


def test_share_of_the_tis_excess_removed(coll, sweep):
    """mean(TIS - cal) / mean(TIS - BF16) over the seeds all three finished; Fieller's bounds are the
    ratios R where the paired t of x - R y reaches the t quantile."""
    loop = end_by_loop(sweep)
    df, _ = entropy_rows(coll)
    bf16, tis = loop[("bf16", "vanilla", None)], loop[("tensorwise", "tis", None)]
    for mode in ("same_batch", "sampled"):
        cal = loop[("tensorwise", "calibrated", mode)]
        seeds = sorted(set(cal) & set(tis) & set(bf16))
        x = [tis[s] - cal[s] for s in seeds]
        y = [tis[s] - bf16[s] for s in seeds]
        r = _row(df, "calibrated", mode)
        assert r["share_n_x"] == len(seeds) == (2 if mode == "sampled" else 3) and r["share_paired"]
        assert r["share"] == pytest.approx(sum(x) / sum(y), rel=1e-12)
        assert r["share_tis_excess"] == pytest.approx(sum(y) / len(y), rel=1e-12)
        n = len(seeds)
        for bound in (r["share_lo"], r["share_hi"]):
            if not math.isfinite(bound):
                continue
            d = [a - bound * b for a, b in zip(x, y, strict=True)]
            m = sum(d) / n
            sd = math.sqrt(sum((v - m) ** 2 for v in d) / (n - 1))
            assert abs(m) / (sd / math.sqrt(n)) == pytest.approx(T975[n - 1], rel=1e-6)
        assert r["share_lo"] <= r["share"] <= r["share_hi"]


def test_missing_seeds_are_named_and_the_table_renders(coll):
    t = entropy_paired_table(coll)
    _, notes = entropy_rows(coll)
    assert "GRPO 8b FP8 tensorwise + calibrated [clip.calibration_mode=sampled] − BF16: 2 pairs (no partner: " \
           "seeds 1-2)" in notes
    assert "GRPO 8b FP8 tensorwise + calibrated [clip.calibration_mode=sampled] − TIS: 3 pairs (no partner: " \
           "seed 2)" in notes
    assert "GRPO 8b FP8 tensorwise + TIS − BF16: 3 pairs (no partner: seed 1)" in notes
    assert len(notes) == 5  # every arm against BF16 (its seed 1 FAILED), and sampled against TIS
    assert " · ".join(notes) in t.markdown and "reference" in t.markdown
    row = _row(t.data, "calibrated", "same_batch")
    cell = f"{row['tis_mean'] / 1e-4:+.1f} [{row['tis_lo'] / 1e-4:+.1f}, {row['tis_hi'] / 1e-4:+.1f}]"
    assert cell in t.markdown and cell in t.latex
    assert row["share_text"] in t.markdown


def test_modes_from_two_sweeps_stay_apart_and_pair_within_their_sweep(tmp_path):
    """Two sweeps of one calibration mode each (every cell sets it, so not a variant): one row per mode,
    each paired with the BF16 and TIS runs of its own sweep only."""
    for mode in ("same_batch", "sampled"):
        make_sweep(tmp_path / mode, [dataclasses.replace(s, calibration_mode=mode) for s in _specs((mode,))
                                     if s.state == "DONE"], sweep=mode)
    c = collect([tmp_path / "same_batch", tmp_path / "sampled"], workers=1, progress=False)
    df, notes = entropy_rows(c)
    assert "GRPO 8b FP8 tensorwise + calibrated (sampled) − BF16: 2 pairs (no partner: sampled seeds 1-2)" \
        in notes
    cal = df[df["method"] == "calibrated"]
    assert sorted(cal["mode"]) == ["same_batch", "sampled"] and set(cal["clip"]) == {"calibrated"}
    for _, r in cal.iterrows():
        n = 3 if r["mode"] == "sampled" else 4
        assert (r["runs"], r["tis_pairs"]) == (n, n)
        assert r["bf16_pairs"] == len({0, 2, 3} & ({0, 1, 3} if r["mode"] == "sampled" else set(SEEDS)))
    assert (df[df["fp8"] == "bf16"]["runs"] == 6).all()  # one arm, both sweeps' runs


def test_no_entropy_no_rows(tmp_path):
    from fp8rl.runs import metrics as M

    make_sweep(tmp_path / "s", [RunSpec(seed=0, steps=8, metrics=tuple(m for m in M.TRAIN_METRICS
                                                                       if m != M.ACTOR_ENTROPY))])
    t = entropy_paired_table(collect(tmp_path / "s", workers=1, progress=False))
    assert t.data.empty and "No finished run logged `actor/entropy`" in t.markdown


def test_the_report_writes_the_table_after_the_paired_accuracy(coll, tmp_path):
    from analysis.report import write_report

    md = write_report(coll, tmp_path / "r", figures=[]).read_text()
    for ext in ("md", "tex", "csv"):
        assert (tmp_path / "r" / "tables" / f"entropy_paired.{ext}").is_file()
    assert "[entropy_paired](tables/entropy_paired.md)" in md
    assert md.index("## Accuracy gain, paired") < md.index("## End-of-training entropy, paired by seed") \
        < md.index("## Diagnostics")
    assert entropy_paired_table(coll).markdown in md


def test_seed_ranges():
    assert seed_ranges([5]) == "seed 5"
    assert seed_ranges([7, 0, 2, 3, 4]) == "seeds 0, 2-4, 7"
    assert seed_ranges(range(32, 80)) == "seeds 32-79"
    assert seed_ranges([None, 1]) == "seeds 1, ?"
