"""``analysis.replay``: a sweep's runs against a reference copy, value by value, and what report.md
says about it (these are the published numbers, or this machine's)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from analysis.replay import (
    PUBLISHED,
    compare_runs,
    compare_sweeps,
    main,
    published_copy,
    verdict_lines,
)

SWEEP = "calibration_floor"  # the smallest published sweep (9 runs)


def _copy(tmp_path: Path, n: int | None = None) -> Path:
    src = PUBLISHED / SWEEP
    dst = tmp_path / SWEEP
    shutil.copytree(src, dst)
    if n is not None:  # keep the manifest and n runs
        for run in sorted(p for p in dst.iterdir() if p.is_dir())[n:]:
            shutil.rmtree(run)
    return dst


def _edit_metrics(run: Path, edit) -> None:
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    edit(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _runs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_dir())


def test_an_unchanged_copy_replays_every_value(tmp_path):
    copy = _copy(tmp_path)
    rep = compare_sweeps(copy, PUBLISHED / SWEEP)
    assert len(rep.runs) == len(_runs(copy)) and not rep.unmatched
    assert rep.equal == len(rep.runs) and rep.compared > 1000
    assert "these are the published numbers" in verdict_lines(rep, "ref")[0]


def test_one_last_bit_a_missing_row_and_a_new_key(tmp_path):
    copy = _copy(tmp_path)
    ref = PUBLISHED / SWEEP
    a, b, c = _runs(copy)[:3]

    def bump(rows):
        k = next(k for k, v in rows[2].items() if isinstance(v, float) and not k.startswith("perf/") and math.isfinite(v))
        rows[2][k] = math.nextafter(rows[2][k], math.inf)

    _edit_metrics(a, bump)
    _edit_metrics(b, lambda rows: rows.pop())
    _edit_metrics(c, lambda rows: [r.update({"new/key": 1.0, "perf/step_s": -1.0}) for r in rows])
    ra, rb, rc = (compare_runs(x, ref / x.name) for x in (a, b, c))
    assert ra.differ == 1 and not ra.equal and "row 2" in ra.first
    assert rb.rows_differ and not rb.equal
    n_rows = len((c / "metrics.jsonl").read_text().splitlines())
    assert rc.equal and rc.only_one == n_rows  # the new key counted once a row; perf/* ignored
    rep = compare_sweeps(copy, ref)
    assert rep.equal == len(rep.runs) - 2
    text = verdict_lines(rep, "ref")[0]
    assert "2 of" in text and "these numbers are this machine's" in text and ra.run in text


def test_runs_without_a_reference_are_counted_not_compared(tmp_path):
    copy = _copy(tmp_path, n=2)
    shutil.copytree(_runs(copy)[0], copy / "grpo-8b-other-s9-00000000")
    rep = compare_sweeps(copy, PUBLISHED / SWEEP)
    assert len(rep.runs) == 2 and rep.unmatched == ["grpo-8b-other-s9-00000000"]
    assert any("no run of the same configuration" in x for x in verdict_lines(rep, "ref"))


def test_the_published_copy_is_found_by_name_and_never_compared_with_itself(tmp_path):
    assert published_copy(PUBLISHED / SWEEP) is None
    assert published_copy(_copy(tmp_path)) == PUBLISHED / SWEEP
    assert published_copy(tmp_path / "no_such_sweep") is None


def test_the_cli_prints_the_verdict_and_refuses_a_missing_directory(tmp_path, capsys):
    copy = _copy(tmp_path, n=2)
    assert main([str(copy)]) == 0
    assert "these are the published numbers" in capsys.readouterr().out
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no runs directory" in capsys.readouterr().err


@pytest.mark.parametrize("changed", [False, True])
def test_report_says_whose_numbers_these_are(tmp_path, changed):
    from analysis.collect import collect
    from analysis.report import write_report

    copy = _copy(tmp_path, n=3)
    if changed:
        _edit_metrics(_runs(copy)[0], lambda rows: rows[0].update({"actor/entropy": rows[0]["actor/entropy"] * 2}))
    text = write_report(collect(copy), tmp_path / "report", figures=[]).read_text()
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    if changed:
        assert "these numbers are this machine's, not the published ones" in text
        assert "These numbers are this machine's" in summary
    else:
        assert "log exactly the numbers of the published copy" in text
        assert "this machine's" not in summary
