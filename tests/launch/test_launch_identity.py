"""What a cell is, as the launcher shows and names it: the clip arm on the layout line, and the
run identity of a mini run started directly versus the same cell from the launcher."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_paper_dry_run_layout_line_names_the_clip_arm(launch, tmp_path):
    """TIS runs vanilla clipping plus TIS: the layout line says tis, not the clip method."""
    res = launch("+sweep=main_table", "scale=paper", "cluster=example", "dry_run=true", "algorithm=grpo",
                 "model=8b", "fp8=tensorwise", "clip=vanilla,tis,calibrated", f"output_dir={tmp_path}")
    assert res.code == 0, res.err
    cells = re.findall(r"^cell \d+/3 (\S+)", res.out, re.M)
    layouts = re.findall(r"^    layout: .*, clip (\S+)$", res.out, re.M)
    assert len(cells) == len(layouts) == 3, res.out
    for name, arm in zip(cells, layouts, strict=True):
        assert name.split("-")[3] == arm, (name, arm)
    assert sorted(layouts) == ["calibrated", "tis", "vanilla"]


def _launcher_run_dir(launch, root: Path) -> str:
    res = launch("dry_run=true", f"output_dir={root}")
    assert res.code == 0, res.err
    (run_dir,) = re.findall(r"^    run dir:\s+(\S+)$", res.out, re.M)
    return run_dir


def test_direct_mini_run_and_launcher_cell_share_the_identity_at_the_same_thread_count(launch, tmp_path):
    """``mini.num_threads`` changes the numbers (float round-off; docs/launch.md, "Run identity"),
    so it stays in the run identity: a direct run with the launcher's thread count (1) lands in the
    launcher's run directory, one with torch's default (0) in another."""
    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.run import resolve_run_dir

    cell = _launcher_run_dir(launch, tmp_path / "runs")
    sweep_dir = tmp_path / "runs" / "default"
    same, _, _ = parse_config([f"output_dir={sweep_dir}", "mini.num_threads=1"])
    assert str(resolve_run_dir(same)) == cell
    default, _, _ = parse_config([f"output_dir={sweep_dir}"])
    assert default.mini.num_threads == 0
    other = resolve_run_dir(default)
    assert other.name.rsplit("-", 1)[0] == Path(cell).name.rsplit("-", 1)[0] and str(other) != cell
    doc = (REPO / "docs" / "launch.md").read_text(encoding="utf-8")
    identity = doc[doc.index("**Run identity**"):].split("\n\n", 1)[0]
    assert "mini.num_threads" in identity and "changes the numbers" in identity
    assert "mini.num_threads=1" in identity  # how to get the launcher's run from a direct one
