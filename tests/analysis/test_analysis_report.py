import time

from analysis.report import main


def test_report_cli(known_sweep, tmp_path, capsys):
    out = tmp_path / "rep"
    t0 = time.perf_counter()
    assert main([str(known_sweep), "--out", str(out), "--no-progress"]) == 0
    elapsed = time.perf_counter() - t0
    text = (out / "report.md").read_text()
    assert "1 failed, 1 incomplete, 1 missing, 8 ok" in text
    for cell in ("| failed |", "| missing |", "| incomplete |", "no run directory", "synthetic failure"):
        assert cell in text
    assert "truncated last line" in text
    for name in ("entropy", "clipfrac_neg_low", "reward_accuracy", "eval_accuracy", "response_length",
                 "mismatch_kl", "clip_bounds", "ratio_quantiles"):
        for ext in ("png", "pdf", "csv"):
            assert (out / "figures" / f"{name}.{ext}").stat().st_size > 0
        assert f"](figures/{name}.png)" in text
    for t in ("accuracy", "diagnostics"):
        for ext in ("md", "tex", "csv"):
            assert (out / "tables" / f"{t}.{ext}").stat().st_size > 0
    assert (out / "tables" / "cells.csv").exists()
    assert "report.md: 11 cells, 3 missing/failed/incomplete" in capsys.readouterr().out
    print(f"report took {elapsed:.1f} s")


def test_report_default_out_and_empty(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no run directories" in capsys.readouterr().err
