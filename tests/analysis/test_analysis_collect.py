import json
import shutil

import numpy as np
import pandas as pd
import pytest
from analysis_known import EVALS, STEPS

from analysis.collect import collect, final_evals, parse_jsonl, rows_to_columns
from fp8rl.runs import read_jsonl
from fp8rl.runs.synthetic import RunSpec, make_sweep, write_run


def _reference_steps(run_dir):
    """Slow reference: json.loads per line via fp8rl.runs.read_jsonl, then pandas."""
    df = pd.DataFrame(read_jsonl(run_dir / "metrics.jsonl")).astype(float)
    return df.sort_values("step").reset_index(drop=True)


def test_runs_table_cells_and_problems(known_coll):
    runs = known_coll.runs.set_index("run")
    assert len(runs) == len(EVALS) + 3
    by_seed2 = {(r.fp8, r.clip): r.cell for r in known_coll.runs.itertuples() if r.seed == 2}
    assert by_seed2 == {("bf16", "vanilla"): "failed", ("tensorwise", "calibrated"): "missing",
                        ("blockwise", "tis"): "incomplete"}
    assert (known_coll.runs[known_coll.runs["seed"] < 2]["cell"] == "ok").all()
    probs = known_coll.problems
    assert sorted(probs["cell"]) == ["failed", "incomplete", "missing"]
    assert "synthetic failure" in probs.loc[probs["cell"] == "failed", "reason"].item()
    assert "PREEMPTED" in probs.loc[probs["cell"] == "incomplete", "reason"].item()
    missing = runs[runs["cell"] == "missing"]
    assert missing["n_rows"].item() == 0 and missing["arm"].item() == "FP8 tensorwise + calibrated"


def test_steps_equal_reference_reader(known_coll, known_sweep):
    for r in known_coll.runs.itertuples():
        if r.cell == "missing":
            continue
        ref = _reference_steps(known_sweep / r.run)
        got = known_coll.steps[known_coll.steps["run"] == r.run].reset_index(drop=True)
        assert np.array_equal(got["step"].to_numpy(), ref["step"].to_numpy().astype(int))
        for col in ref.columns:
            if col == "step":
                continue
            np.testing.assert_array_equal(got[col].to_numpy(), ref[col].to_numpy(), err_msg=col)
        # metrics that this run never logged are NaN, not dropped rows
        for col in set(known_coll.metrics) - set(ref.columns):
            assert got[col].isna().all()


def test_truncated_tail_nan_and_lengths(known_coll):
    pre = known_coll.runs[known_coll.runs["cell"] == "incomplete"].iloc[0]
    assert pre["truncated_tail"] and pre["n_rows"] == 50 and pre["last_step"] == 49
    assert any("truncated last line" in n and pre["run"] in n for n in known_coll.notes)
    ent = known_coll.steps.loc[known_coll.steps["run"] == pre["run"], "actor/entropy"]
    assert ent.isna().sum() == 10  # nan_every=5 over 50 steps, written as null
    ok = known_coll.runs[known_coll.runs["cell"] == "ok"]
    assert (ok["n_rows"] == STEPS).all()


def test_evals_and_final_evals(known_coll):
    fe = final_evals(known_coll)
    assert set(fe["source"]) == {"summary"}
    for (fp8, clip, seed), ev in EVALS.items():
        sub = fe[(fe["fp8"] == fp8) & (fe["clip"] == clip) & (fe["seed"] == seed)]
        assert dict(zip(sub["dataset"], sub["value"], strict=True)) == ev
    # the eval table's last rows carry the same numbers
    ev = known_coll.evals
    last = ev[(ev["stat"] == "avg@k") & (ev["step"] == STEPS - 1)]
    assert len(last) == 2 * (len(EVALS) + 1)  # + the FAILED run's evals
    assert set(ev["stat"]) == {"avg@k", "pass@k"} and (ev["k"] == 4).all()
    # unfinished runs are not in final_evals by default
    assert set(fe["run"]) == set(known_coll.runs.loc[known_coll.runs["cell"] == "ok", "run"])


def test_final_evals_falls_back_to_eval_rows(tmp_path):
    make_sweep(tmp_path, [RunSpec(eval={"amc23": 0.4}, summary_eval=False, steps=30)])
    fe = final_evals(collect(tmp_path))
    assert fe[["dataset", "value", "step", "source"]].values.tolist() == [["amc23", 0.4, 29, "eval"]]


def test_engines_agree(known_sweep):
    a = collect(known_sweep, engine="auto")
    b = collect(known_sweep, engine="loop")
    c = collect(known_sweep, engine="json")
    for other in (b, c):
        pd.testing.assert_frame_equal(a.steps, other.steps)
        pd.testing.assert_frame_equal(a.evals, other.evals)


@pytest.mark.slow
def test_workers_agree(known_sweep):
    a = collect(known_sweep, workers=1)
    b = collect(known_sweep, workers=2)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    pd.testing.assert_frame_equal(a.runs, b.runs)


def test_parse_jsonl_corrupt_lines_and_nan_literals(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0, "a": NaN}\n{"step": 1, "a": 1.5}\n{"st\n\n{"step": 3, "a": null}\n{"step"')
    got = parse_jsonl(p)
    assert got.truncated_tail and got.bad_lines == 1
    assert [r["step"] for r in got.rows] == [0, 1, 3]
    steps, cols = rows_to_columns(got.rows)
    assert steps.tolist() == [0, 1, 3]
    assert np.isnan(cols["a"][0]) and cols["a"][1] == 1.5 and np.isnan(cols["a"][2])
    assert parse_jsonl(tmp_path / "absent.jsonl").rows == []


def test_rows_to_columns_reference():
    rng = np.random.default_rng(0)
    keys = ["x", "y", "z"]
    rows = []
    for s in range(50):
        r = {"step": s}
        for k in keys:
            if rng.random() < 0.7:
                r[k] = float(rng.random())
        if s % 7 == 0:
            r["y"] = None
        if s % 11 == 0:
            r = dict(reversed(list(r.items())))  # other key order
        rows.append(r)
    rows.append({"no_step": 1})
    rows.append({"step": "bad", "x": 1.0})
    steps, cols = rows_to_columns(rows)
    assert steps.tolist() == list(range(50))
    for k in keys:
        ref = [np.nan if r.get(k) is None else r[k] for r in rows[:50]]
        np.testing.assert_array_equal(cols[k], np.array(ref, dtype=float))


def test_eval_row_variants(tmp_path):
    spec = RunSpec(steps=10)
    write_run(tmp_path, spec)
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    with open(run / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "eval/aime24/avg@16": 0.5, "eval/amc23/avg@16": 0.25}) + "\n")
        f.write(json.dumps({"step": 9, "dataset": "math500", "avg@k": 0.75, "pass@k": 0.9, "k": 8,
                            "n": 500}) + "\n")
    c = collect(tmp_path)
    ev = c.evals.set_index(["dataset", "stat"])
    assert ev.loc[("aime24", "avg@k"), "value"] == 0.5 and ev.loc[("aime24", "avg@k"), "k"] == 16
    assert ev.loc[("amc23", "avg@k"), "value"] == 0.25
    assert ev.loc[("math500", "pass@k"), "value"] == 0.9 and ev.loc[("math500", "avg@k"), "n"] == 500
    assert any("no manifest.json" in n for n in c.notes)  # discovered without a manifest


def test_duplicates_unlisted_and_corrupt_status(tmp_path):
    make_sweep(tmp_path, [RunSpec(steps=20)])
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    with open(run / "metrics.jsonl", "a") as f:  # a resume that did not truncate
        f.write(json.dumps({"step": 10, "actor/entropy": 123.0}) + "\n")
    shutil.copytree(run, tmp_path / "grpo-8b-bf16-vanilla-s9-0123abcd")
    (tmp_path / "grpo-8b-bf16-vanilla-s9-0123abcd" / "status.json").write_text("{not json")
    (tmp_path / "report").mkdir()  # not a run directory: ignored
    c = collect(tmp_path)
    r0 = c.runs.set_index("run").loc[run.name]
    assert r0["duplicate_steps"] == 1 and r0["n_rows"] == 20
    st = c.steps[c.steps["run"] == run.name].set_index("step")
    assert st.loc[10, "actor/entropy"] == 123.0  # the last row of a step wins
    extra = c.runs.set_index("run").loc["grpo-8b-bf16-vanilla-s9-0123abcd"]
    assert extra["cell"] == "unlisted" and extra["seed"] == 9 and not extra["in_manifest"]
    assert "status.json unreadable" in extra["reason"]
    assert any("duplicated step" in n for n in c.notes)
    assert len(c.runs) == 2


def test_long_and_errors(known_coll, tmp_path):
    lg = known_coll.long(["actor/entropy", "clip/alpha", "not/a_metric"])
    for m in ("actor/entropy", "clip/alpha"):
        assert (lg["metric"] == m).sum() == known_coll.steps[m].notna().sum() > 0
    alpha_runs = set(lg.loc[lg["metric"] == "clip/alpha", "clip"].astype(str))
    assert alpha_runs == {"calibrated"}  # sparse metric: logged by calibrated arms only
    with pytest.raises(FileNotFoundError):
        collect(tmp_path / "nope")


def test_cache_incremental_equals_fresh(tmp_path):
    from fp8rl.runs import RunDir

    make_sweep(tmp_path / "s", [RunSpec(steps=30, truncated_tail=True), RunSpec(seed=1, steps=30)])
    cache = tmp_path / "cache"
    first = collect(tmp_path / "s", cache_dir=cache)
    assert len(list(cache.glob("*.npy"))) == len(list(cache.glob("*.json"))) == 2
    again = collect(tmp_path / "s", cache_dir=cache)  # served from the cache
    pd.testing.assert_frame_equal(first.steps, again.steps)
    assert again.notes == first.notes
    runs = sorted(p for p in (tmp_path / "s").iterdir() if p.is_dir())
    # a writer resumes: it cuts the truncated tail in place and appends new steps
    with RunDir(runs[0]).metrics_writer() as w:
        for s in range(30, 35):
            w.write({"step": s, "actor/entropy": 0.5, "new/metric": float(s)})
    # the other run is resumed from step 19: truncate_after replaces the file
    rd = RunDir(runs[1])
    rd.truncate_after(19)
    with rd.metrics_writer() as w:
        w.write({"step": 20, "actor/entropy": 7.0})
    inc = collect(tmp_path / "s", cache_dir=cache)
    fresh = collect(tmp_path / "s")
    pd.testing.assert_frame_equal(inc.steps, fresh.steps)
    assert inc.runs["n_rows"].tolist() == [35, 21]
    assert inc.steps["new/metric"].notna().sum() == 5
    # a cache file that is garbage is ignored
    for f in cache.glob("*.npy"):
        f.write_bytes(b"junk")
    pd.testing.assert_frame_equal(collect(tmp_path / "s", cache_dir=cache).steps, fresh.steps)


def test_progress_display(known_sweep, capsys):
    collect(known_sweep, progress=True)
    assert "collect" in capsys.readouterr().err  # tqdm bar on stderr
    collect(known_sweep)  # small sweep: no bar by default
    assert "collect" not in capsys.readouterr().err


def _columns_reference(rows):
    """Explicit per-value loop: the contract rows_to_columns must meet."""
    keep = [r for r in rows if isinstance(r.get("step"), (int, float)) and not isinstance(r.get("step"), bool)
            and np.isfinite(r["step"]) and r["step"] >= 0 and r["step"] == int(r["step"])]
    keys = dict.fromkeys(k for r in keep for k in r if k != "step")
    cols = {}
    for k in keys:
        vals = [r.get(k) for r in keep]
        cols[k] = np.array([np.nan if v is None or isinstance(v, (str, list, dict)) else float(v)
                            for v in vals], dtype=float)
    return np.array([int(r["step"]) for r in keep], dtype=np.int64), cols


@pytest.mark.parametrize("case", ["uniform", "one_reordered", "sparse_keys", "nulls", "bad_step"])
def test_rows_to_columns_fast_path_equals_reference(case):
    """The one-key-sequence fast path and the grouped path give the explicit loop's columns."""
    rng = np.random.default_rng(1)
    rows = [{"step": s, "a": float(rng.normal()), "b": float(rng.random()), "c": int(s * 3)} for s in range(40)]
    if case == "one_reordered":  # same keys, other order: must not take the fast path blindly
        rows[17] = dict(reversed(list(rows[17].items())))
    elif case == "sparse_keys":
        for r in rows[::5]:
            r["extra"] = 2.5
    elif case == "nulls":  # NaN written as null, also in the fast path
        rows[3]["a"] = None
        rows[30]["b"] = None
    elif case == "bad_step":
        rows[5]["step"] = 4.5
        rows[6]["step"] = -1
    steps, cols = rows_to_columns(rows)
    ref_steps, ref_cols = _columns_reference(rows)
    np.testing.assert_array_equal(steps, ref_steps)
    assert set(cols) == set(ref_cols)
    for k, v in ref_cols.items():
        np.testing.assert_array_equal(cols[k], v)
        assert cols[k].dtype == np.float64 and cols[k].flags.c_contiguous


@pytest.mark.parametrize("tail", ["", "\n", "\n\n", "\r\n", '{"step": 9, "a"', '{"step": 9, "a": 1}'])
def test_parse_fast_join_equals_loop(tmp_path, tail):
    """The one-array parse (joined lines) equals the per-line loop, whatever the file's end."""
    body = "\n".join(json.dumps({"step": s, "a": s / 7, "b": None if s == 2 else s}) for s in range(6))
    p = tmp_path / "m.jsonl"
    p.write_text(body + ("\n" + tail if tail.startswith("{") else tail))
    fast, loop, js = parse_jsonl(p), parse_jsonl(p, engine="loop"), parse_jsonl(p, engine="json")
    assert fast.rows == loop.rows == js.rows
    assert fast.truncated_tail == loop.truncated_tail == (tail == '{"step": 9, "a"')
    assert len(fast.rows) == 6 + (tail == '{"step": 9, "a": 1}')
    assert fast.bad_lines == loop.bad_lines == 0


def test_variants_are_the_options_a_sweep_varies_beyond_the_axes():
    from analysis.collect import _variants

    ovs = [["fp8=tensorwise", "clip.period=10", "lr=1e-5", "+sweep=abl", "seed=0"],
           ["fp8=tensorwise", "clip.period=20", "lr=1e-5", "+sweep=abl", "seed=1"],
           ["fp8=bf16", "clip.period=20", "clip.upper_rule=fixed", "lr=1e-5", "+sweep=abl"]]
    # fp8/seed are axes, +sweep is a group addition, lr is shared: only clip.period and upper_rule vary
    assert _variants(ovs) == ["clip.period=10", "clip.period=20", "clip.period=20 clip.upper_rule=fixed"]
    assert _variants([["fp8=bf16", "lr=1"], ["fp8=tensorwise", "lr=1"]]) == ["", ""]
    assert _variants([]) == []


def test_ablation_cells_become_separate_arms(known_sweep, tmp_path):
    """Cells that differ only in an ablated option (not an axis) are separate arms everywhere."""

    from analysis.arms import arm_label, split_clip
    from analysis.clip_tables import mechanism_table

    d = tmp_path / "abl"
    shutil.copytree(known_sweep, d)
    man = json.loads((d / "manifest.json").read_text())
    for c in man["cells"]:
        c["overrides"] = [*c["overrides"], f"clip.period={10 if c['axes']['seed'] == 0 else 20}"]
    (d / "manifest.json").write_text(json.dumps(man))
    coll = collect(d, workers=1, progress=False)
    clips = set(coll.runs["clip"].astype(str))
    assert "calibrated[clip.period=10]" in clips and "calibrated[clip.period=20]" in clips
    assert {split_clip(c)[0] for c in clips} == {"vanilla", "calibrated", "tis"}
    for _, row in coll.runs.iterrows():
        assert row["arm"] == arm_label(row["fp8"], row["clip"])
    assert arm_label("tensorwise", "calibrated[clip.period=10]") == "FP8 tensorwise + calibrated [clip.period=10]"
    arms = set(mechanism_table(coll).data["arm"])
    assert {"FP8 tensorwise + calibrated [clip.period=10]", "FP8 tensorwise + calibrated [clip.period=20]"} <= arms
    # the plain sweep is unchanged
    assert "calibrated" in set(collect(known_sweep, workers=1, progress=False).runs["clip"].astype(str))
