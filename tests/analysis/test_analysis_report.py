import pytest

from analysis.report import ALL_FIGURES, main


def _check_report(out, figures, pdf=False):
    text = (out / "report.md").read_text()
    assert "1 failed, 1 incomplete, 1 missing, 8 ok" in text
    for cell in ("| failed |", "| missing |", "| incomplete |", "no run directory", "synthetic failure"):
        assert cell in text
    assert "truncated last line" in text
    for name in figures:
        for ext in ("png", "csv"):
            assert (out / "figures" / f"{name}.{ext}").stat().st_size > 0
        assert (out / "figures" / f"{name}.pdf").exists() == pdf
        assert f"](figures/{name}.png)" in text
    for t in ("accuracy", "diagnostics"):
        for ext in ("md", "tex", "csv"):
            assert (out / "tables" / f"{t}.{ext}").stat().st_size > 0
    assert (out / "tables" / "cells.csv").exists()
    assert list((out / ".cache").glob("*.npy"))  # parsed metrics kept for the next run


def test_report_cli(known_sweep, tmp_path, capsys):
    out = tmp_path / "rep"
    figs = ["entropy", "clip_bounds"]
    assert main([str(known_sweep), "--out", str(out), "--no-progress", "--figures", ",".join(figs),
                 "--pdf"]) == 0
    _check_report(out, figs, pdf=True)
    assert "report.md: 11 cells, 3 missing/failed/damaged/incomplete" in capsys.readouterr().out
    assert not (out / "figures" / "mismatch_kl.png").exists()
    assert main([str(known_sweep), "--out", str(out), "--figures", "nope"]) == 2
    assert "unknown figure 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_report_cli_all_figures(known_sweep, tmp_path):
    out = tmp_path / "rep"
    assert main([str(known_sweep), "--out", str(out), "--no-progress"]) == 0
    _check_report(out, ALL_FIGURES)


def test_report_default_out_and_empty(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no run directories" in capsys.readouterr().err


def test_tables_do_not_depend_on_where_the_sweep_lives(known_sweep, tmp_path):
    """Published tables are regenerated from copies of the run directories: same bytes anywhere."""
    import shutil

    a, b = tmp_path / "a" / known_sweep.name, tmp_path / "elsewhere" / "deeper" / known_sweep.name
    shutil.copytree(known_sweep, a)
    shutil.copytree(known_sweep, b)
    for src in (a, b):
        assert main([str(src), "--out", str(src.parent / "rep"), "--no-progress", "--no-cache",
                     "--figures", "entropy"]) == 0
    tables = sorted(p.name for p in (a.parent / "rep" / "tables").iterdir())
    assert "cells.csv" in tables and "accuracy.csv" in tables
    for name in tables:
        ta = (a.parent / "rep" / "tables" / name).read_bytes()
        assert ta == (b.parent / "rep" / "tables" / name).read_bytes(), name
        assert str(tmp_path).encode() not in ta, f"{name} carries a machine path"
    assert (a.parent / "rep" / "report.md").read_bytes() == (b.parent / "rep" / "report.md").read_bytes()
