"""Rendering shared by the report's tables: the :class:`Table` type (tidy data plus its Markdown
and LaTeX text), one table block per (algorithm, model) in the panels' order, LaTeX escaping,
and the NaN-tolerant statistics the tables use."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.arms import arm_order_key, panel_order_key
from analysis.collect import Collection

#: What every character of a table string becomes in LaTeX: the ten special characters, the
#: ones OT1/T1 fonts print as other glyphs (``<`` as ``¡``, ``>`` as ``¿``, ``|`` as a dash) and
#: the non-ASCII symbols the tables use (as math or text commands of base LaTeX).
LATEX_CHARS: dict[str, str] = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}",
    "±": r"$\pm$", "−": r"$-$", "×": r"$\times$", "·": r"$\cdot$", "→": r"$\to$", "√": r"$\surd$",
    "≤": r"$\leq$", "≥": r"$\geq$", "≈": r"$\approx$", "∞": r"$\infty$", "α": r"$\alpha$",
    "µ": r"$\mu$", "μ": r"$\mu$", "†": r"\dag{}", "‡": r"\ddag{}", "…": r"\ldots{}", "—": "---",
    "–": "--", "▼": r"$\bigtriangledown$", "’": "'", "“": "``", "”": "''", "\u00a0": "~",
}


def latex_escape(s: str) -> str:
    """``s`` as LaTeX text that compiles with pdflatex and prints as written: every character of
    :data:`LATEX_CHARS` replaced, any other non-ASCII character written as ``?`` (a table string
    never needs one; a new symbol belongs in :data:`LATEX_CHARS`)."""
    return "".join(LATEX_CHARS.get(ch, ch if ch.isascii() else "?") for ch in str(s))


def finite(values) -> np.ndarray:
    """``values`` as a float array without NaN/inf."""
    v = np.asarray(values, dtype=float)
    return v[np.isfinite(v)]


def fmean(values) -> float:
    """Mean of the finite ``values``; NaN when there are none."""
    v = finite(values)
    return float(v.mean()) if len(v) else math.nan


def sample_std(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1)) if len(x) >= 2 else math.nan


@dataclasses.dataclass
class Table:
    """A rendered table: tidy ``data`` plus its Markdown and LaTeX text."""

    name: str
    data: pd.DataFrame
    markdown: str
    latex: str

    @classmethod
    def from_lines(cls, name: str, data: pd.DataFrame, md: list[str], tex: list[str],
                   empty: str | None = None) -> Table:
        """Join rendered Markdown / LaTeX lines; ``empty``: the sentence written when ``data``
        has no rows (as a LaTeX comment in the .tex)."""
        if empty is not None and data.empty:
            md.append(empty)
            tex.append(f"% {empty}")
        return cls(name, data, "\n".join(md).rstrip() + "\n", "\n".join(tex).rstrip() + "\n")

    def write(self, out_dir: str | os.PathLike) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"md": out / f"{self.name}.md", "tex": out / f"{self.name}.tex",
                 "csv": out / f"{self.name}.csv"}
        paths["md"].write_text(self.markdown, encoding="utf-8")
        paths["tex"].write_text(self.latex, encoding="utf-8")
        self.data.to_csv(paths["csv"], index=False, lineterminator="\n", float_format="%.6g")
        return paths


def blocks(coll: Collection) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(algorithm, model, arms in display order) for every block of the grid."""
    runs = coll.runs.dropna(subset=["algorithm", "model"])
    out = []
    for (algo, model), g in runs.groupby(["algorithm", "model"], sort=True):
        arms = sorted({(str(f), str(c)) for f, c in zip(g["fp8"], g["clip"], strict=True)},
                      key=lambda p: arm_order_key(*p))
        out.append((str(algo), str(model), arms))
    return sorted(out, key=lambda b: panel_order_key(b[0], b[1]))


def render_blocks(df: pd.DataFrame, header: Sequence[str], cells, caption) -> tuple[list[str], list[str]]:
    """Markdown and LaTeX lines of one table per (algorithm, model) block of ``df``.

    ``cells(row, latex) -> list[str]`` renders a row as plain text (called with ``latex=False``
    for both outputs: every LaTeX cell is that text through :func:`latex_escape`, so no string
    reaches the .tex unescaped); ``caption(algo, model, block_df) -> str`` is the Markdown line
    above each block (the LaTeX table gets ``ALGO · model`` as its title).
    """
    md: list[str] = []
    tex: list[str] = []
    if df.empty:
        return md, tex
    for (algo, model), g in df.groupby(["algorithm", "model"], sort=False):
        md.append(f"**{algo.upper()} · {model}** — {caption(algo, model, g)}\n")
        md.append("| " + " | ".join(header) + " |")
        md.append("|---|" + "---:|" * (len(header) - 1))
        tex += ["\\begin{tabular}{l" + "r" * (len(header) - 1) + "}", "\\toprule",
                f"\\multicolumn{{{len(header)}}}{{l}}{{{latex_escape(f'{algo.upper()} · {model}')}}} \\\\",
                "\\midrule",
                " & ".join(latex_escape(h) for h in header) + " \\\\", "\\midrule"]
        for _, r in g.iterrows():
            text = cells(r, False)
            md.append("| " + " | ".join(text) + " |")
            tex.append(" & ".join(latex_escape(c) for c in text) + " \\\\")
        md.append("")
        tex += ["\\bottomrule", "\\end{tabular}", ""]
    return md, tex


def bf16_reference(arms: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The block's BF16 reference arm: ``bf16`` + ``vanilla`` if present, else the first ``bf16`` arm."""
    bf16 = [a for a in arms if a[0] == "bf16"]
    if not bf16:
        return None
    return ("bf16", "vanilla") if ("bf16", "vanilla") in bf16 else bf16[0]
