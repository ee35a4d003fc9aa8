"""``--help`` of every entry point: specific text (what it does, its arguments, an example), exit 0."""

from __future__ import annotations

import importlib
import re

import pytest

from fp8rl.launch.cli_help import MAIN_KEYS, header_summary
from fp8rl.launch.keys import SWEEPS_DIR, unknown_path
from fp8rl.launch.profiles import available_profiles


def test_launch_help_lists_sweeps_scales_profiles_keys_and_examples(launch):
    res = launch("--help")
    assert res.code == 0, res.err
    text = res.out
    assert text.startswith("usage: python -m experiments.launch")
    assert "Hydra" not in text.splitlines()[0] and "== Flags ==" not in text  # ours, not Hydra's generic page
    for p in (SWEEPS_DIR / "sweep").glob("*.yaml"):
        assert re.search(rf"^  {p.stem} +\S", text, re.M), f"sweep {p.stem} not listed"
    for scale in ("mini", "paper"):
        assert re.search(rf"^  {scale} +\S", text, re.M)
    for name in available_profiles():
        assert re.search(rf"^  {name} +\S", text, re.M), f"profile {name} not listed"
    assert re.search(r"^  algorithm +grpo, dapo, dr_grpo$", text, re.M)  # default first
    assert re.search(r"^  clip +vanilla, ", text, re.M)
    for key, _ in MAIN_KEYS:
        assert unknown_path(key) is None, f"{key} is not a key of the schema"
        assert re.search(rf"^  {re.escape(key)}=\S+ ", text, re.M), f"{key} not listed"
    assert "=?" not in text  # every default was found in the composed config
    # the defaults are the composed default config's (mini scale), not the dataclasses'
    assert "  steps=20 " in text and "  seeds=1 " in text and "  launcher=local " in text
    for cmd in ("python -m experiments.launch +sweep=", "python -m experiments.status runs/",
                "python -m analysis.report runs/"):
        assert cmd in text
    assert res.err == ""


def test_launch_help_short_flag_and_after_overrides(launch):
    res = launch("+sweep=smoke", "-h")
    assert res.code == 0 and "sweeps (+sweep=NAME):" in res.out


def test_header_summary_is_the_first_clause(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("# @package _global_\n# Paper artefact: the main table (a, b: c). More text.\n"
                 "# Command: python -m x\nsweep_name: s\n")
    assert header_summary(f) == "the main table (a, b: c)"
    f.write_text("# Paper artefact: none (a CI smoke test: 4 cells).\nx: 1\n")
    assert header_summary(f) == "a CI smoke test"


ENTRY_POINTS = [
    # (module, words its help must contain besides its usage line)
    ("experiments.status", ["sweep_dir", "--no-slurm", "exit status", "python -m experiments.status runs/"]),
    ("experiments.audit", ["--recipes", "--sweep-dir", "audit.csv", "python -m experiments.audit"]),
    ("experiments.evaluate", ["run_dir", "--k", "avg@k", "python -m experiments.evaluate runs/"]),
    ("experiments.publish", ["sweep_dir", "dest", "--replace", "python -m experiments.publish runs/"]),
    ("experiments.paper_smoke", ["--cell", "--no-slurm", "interrupted", "python -m experiments.paper_smoke"]),
    ("analysis.report", ["sweep_dirs", "--out", "report.md", "python -m analysis.report runs/"]),
]


@pytest.mark.parametrize(("module", "words"), ENTRY_POINTS, ids=[m for m, _ in ENTRY_POINTS])
def test_entry_point_help_is_specific(module, words, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m {module}")
    for w in words:
        assert w in text, f"{w!r} not in {module} --help:\n{text}"
    assert "``" not in text  # no reST markup in a terminal
