"""The FP4/FP6 formats and the Score Centering arms as axis values of the paper artefacts' sweeps
(issue 47, item 5): given on the command line of ``main_table`` and the calibration sweeps they
expand into valid mini-scale cells; ``fp4_score_centering`` is their comparison in one command;
at paper scale each FP4 cell is refused in one line naming it (the line itself is the plugin's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FP4_FP6 = ("nvfp4", "nvfp4_rn", "mxfp4", "mxfp6", "w4a16")
SCORE_CENTERING = ("score_centering", "score_centering_tis")


def _present(values) -> list[str]:
    """The values whose YAML exists (an arm another change is adding may not be there yet)."""
    return [v for v in values if (REPO / "sweeps" / "fp8" / f"{v}.yaml").is_file()
            or (REPO / "sweeps" / "clip" / f"{v}.yaml").is_file()]


def _cells(out: str) -> list[str]:
    """The run directory names a dry run prints."""
    return [ln.split()[2] for ln in out.splitlines() if re.match(r"cell \d+/\d+ ", ln)]


@pytest.mark.parametrize(("sweep", "extra"), [("main_table", ("algorithm=dapo", "model=14b")),
                                              ("calibration_match", ()), ("calibration_modes", ())])
def test_new_formats_and_arms_expand_into_valid_mini_cells(launch, tmp_path, sweep, extra):
    """``+sweep=<artefact> fp8=<new formats> clip=<new arms>``: every cell valid, each pair present,
    nothing written (main_table on one of its blocks: its other axes are not what is checked)."""
    fp8, clip = _present(FP4_FP6), _present(SCORE_CENTERING)
    assert {"nvfp4", "mxfp4", "mxfp6"} <= set(fp8) and clip == list(SCORE_CENTERING)
    res = launch(f"+sweep={sweep}", f"fp8={','.join(fp8)}", f"clip={','.join(clip)}", *extra, "dry_run=true",
                 f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    n = len(fp8) * len(clip)
    assert f"{n} cell(s) valid" in res.out
    cells = _cells(res.out)
    assert len(cells) == len(set(cells)) == n
    for f in fp8:
        for c in clip:
            assert sum(f"-{f}-{c}-s0-" in d for d in cells) == 1, (f, c)
    assert not (tmp_path / "runs").exists()


def test_fp4_score_centering_is_the_whole_comparison_in_one_command(launch, tmp_path):
    res = launch("+sweep=fp4_score_centering", "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code == 0, res.err
    assert "sweep fp4_score_centering: 64 cell(s) valid" in res.out
    cells = _cells(res.out)
    want = {f"grpo-8b-{f}-{c}-s{s}" for f in ("bf16", "mxfp8", "nvfp4", "mxfp4")
            for c in ("vanilla", "tis", *SCORE_CENTERING) for s in range(4)}
    assert {d.rsplit("-", 1)[0] for d in cells} == want and len(cells) == 64
    assert all(f"{tmp_path}/runs/fp4_score_centering/{d}" in res.out for d in cells)


def test_paper_scale_refuses_each_fp4_cell_in_one_line(launch, tmp_path):
    res = launch("+sweep=fp4_score_centering", "seeds=1", "fp8=bf16,nvfp4,mxfp4", "scale=paper", "cluster=example",
                 "dry_run=true", f"output_dir={tmp_path}/runs")
    assert res.code != 0
    text = res.out + res.err
    problems = [ln for ln in text.splitlines() if re.match(r"\s+cell \d+/12 \[", ln)]
    assert "8 problem(s) in 12 cell(s)" in text, text[-2000:]
    for fmt in ("nvfp4", "mxfp4"):
        for clip in ("vanilla", "tis", *SCORE_CENTERING):
            mine = [ln for ln in problems if f"fp8={fmt} clip={clip} " in ln]
            assert len(mine) == 1, (fmt, clip, mine)
            assert f"'{fmt}'" in mine[0] and "paper scale" in mine[0] and "Blackwell" in mine[0], mine[0]
    assert not [ln for ln in problems if "fp8=bf16 " in ln], "a BF16 cell is refused"
    assert not (tmp_path / "runs").exists()
