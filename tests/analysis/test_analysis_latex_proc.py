"""The LaTeX tables print what the Markdown ones say (issue 32, defect 7: ``A<0`` printed as ``A¡0``).

Two checks over every ``.tex`` the report writes (the fabricated sweeps' reports, which hold every
table, and every published report under docs/results/mini/, which hold the real strings):

- an escaping check that needs nothing installed: the file is ASCII, and outside ``$...$`` math
  no character is left that LaTeX reads as something else (``<``, ``>``, ``|``, a bare ``_``,
  ``#``, ``%`` mid-line, ``^``, ``~``);
- a compile check with ``pdflatex`` (Debian: ``texlive-latex-base texlive-latex-recommended``, for
  booktabs), each table in a one-page article; skipped where ``pdflatex`` is not installed.
"""

import re
import shutil
import subprocess
from pathlib import Path

import calib_sweep
import pytest

from analysis.collect import collect
from analysis.report import write_report
from analysis.tabulate import LATEX_CHARS, latex_escape
from fp8rl.runs.synthetic import make_sweep

PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "results" / "mini"
SPECIALS = "&%$#_{}~^\\<>|"


def test_latex_escape_maps_every_special_and_unicode_character():
    every = "".join(chr(c) for c in range(32, 127)) + "".join(LATEX_CHARS) + "é∑"
    out = latex_escape(every)
    assert out.isascii()
    for ch in SPECIALS:
        assert latex_escape(ch) == LATEX_CHARS[ch] and latex_escape(ch) != ch
    assert latex_escape("A<0 below L (%)") == r"A\textless{}0 below L (\%)"
    assert latex_escape("x BF16 − 1 ± 0.2 · √n") == r"x BF16 $-$ 1 $\pm$ 0.2 $\cdot$ $\surd$n"
    assert latex_escape("é") == "?"


_MATH = re.compile(r"(?<!\\)\$.*?(?<!\\)\$")


def unescaped(tex: str) -> list[str]:
    """Lines of ``tex`` where a character would print as another one or break the table."""
    bad = []
    for line in tex.splitlines():
        if line.startswith("%"):  # a comment (the empty-table sentence, notes): never typeset
            continue
        if not line.isascii():
            bad.append(line)
            continue
        text = _MATH.sub("", line)
        text = re.sub(r"\\[A-Za-z]+\{?|\\[&%$#_{}]|\\\\", "", text)
        if re.search(r"[<>|#_^~]|(?<!\\)%", text):
            bad.append(line)
    return bad


def _tex_files(report_dir: Path) -> list[Path]:
    return sorted((report_dir / "tables").glob("*.tex"))


@pytest.fixture(scope="module")
def fabricated_reports(known_coll, tmp_path_factory):
    out = tmp_path_factory.mktemp("tex")
    make_sweep(out / "calib_sweep", calib_sweep.specs(), sweep="calib")
    for name, coll in (("known", known_coll), ("calib", collect(out / "calib_sweep"))):
        write_report(coll, out / name, figures=[])
    return [out / "known", out / "calib"]


def _all_tex(fabricated_reports) -> list[Path]:
    files = [p for d in fabricated_reports for p in _tex_files(d)]
    files += sorted(PUBLISHED.glob("*/tables/*.tex"))
    return files


def test_every_table_string_is_escaped(fabricated_reports):
    files = _all_tex(fabricated_reports)
    names = {p.stem for p in files}
    assert {"accuracy", "mechanism", "calibration_match", "entropy_paired", "heldout_calibration",
            "by_construction", "clip_agreement", "diagnostics", "trajectory", "paired_accuracy"} <= names
    for p in files:
        assert not unescaped(p.read_text(encoding="utf-8")), f"{p}: {unescaped(p.read_text())[:3]}"


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex not installed (texlive-latex-recommended)")
def test_every_table_compiles_with_pdflatex(fabricated_reports, tmp_path):
    files = _all_tex(fabricated_reports)
    body = "\n".join(f"\\section*{{{latex_escape(p.parent.parent.name + '/' + p.name)}}}\n"
                     f"{p.read_text()}\n\\clearpage" for p in files)  # wide tables: overfull boxes, no error
    doc = tmp_path / "tables.tex"
    doc.write_text("\\documentclass{article}\n\\usepackage{booktabs}\n"
                   "\\begin{document}\n" + body + "\n\\end{document}\n")
    r = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, "\n".join(ln for ln in r.stdout.splitlines() if ln.startswith(("!", "l.")))[:3000]
    assert "Missing character" not in (tmp_path / "tables.log").read_text(errors="replace")
