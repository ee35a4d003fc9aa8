"""What a user gives ``python -m analysis.report``, checked before anything is read or written: each
mistake is one line (or a short block) naming the bad value and the fix, exit status 2, no traceback.

- a sweep directory that does not exist (with the nearest existing name beside it, if any), or is
  a file;
- a directory with no run directory and no manifest: a run directory given for its sweep, a folder
  of sweeps (``runs/``) given for one of them, or a sweep not launched yet;
- an unknown name in ``--figures``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from fp8rl.runs.manifest import MANIFEST_FILE
from fp8rl.runs.rundir import CONFIG_FILE, METRICS_FILE, STATUS_FILE


class ReportInputError(ValueError):
    """A value the user gave cannot be reported on; the message names it and the fix."""


def _nearest(d: Path) -> str:
    """``" (did you mean X?)"`` for the nearest existing sibling directory of ``d``, else ""."""
    parent = d.parent if str(d.parent) else Path(".")
    if not parent.is_dir():
        return ""
    names = sorted(p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
    close = difflib.get_close_matches(d.name, names, n=1, cutoff=0.6)
    return f" (did you mean {parent / close[0] if str(d.parent) not in ('', '.') else close[0]}?)" if close else ""


def _sweeps_under(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_dir() and (p / MANIFEST_FILE).is_file())


def check_sweep_dirs(dirs: Sequence[Path]) -> None:
    """Raise :class:`ReportInputError` for the first directory that cannot be a sweep directory."""
    for d in dirs:
        if not d.exists():
            parent = d.parent if str(d.parent) else Path(".")
            raise ReportInputError(
                f"sweep directory {d} does not exist{_nearest(d)}: give the directory a sweep was launched "
                f"into (it holds {MANIFEST_FILE}; `ls {parent}` lists what is there)")
        if not d.is_dir():
            raise ReportInputError(f"{d} is a file, not a sweep directory: give the directory that holds "
                                   f"{MANIFEST_FILE} and the run directories")


def no_runs(dirs: Sequence[Path]) -> str:
    """The message of a report that found no run directory and no manifest cell in ``dirs``."""
    for d in dirs:
        if any((d / f).exists() for f in (STATUS_FILE, METRICS_FILE, CONFIG_FILE)):
            return (f"{d} is a run directory, not a sweep directory: give its sweep directory, "
                    f"python -m analysis.report {d.parent}")
        sweeps = _sweeps_under(d) if d.is_dir() else []
        if sweeps:
            shown = " ".join(str(d / s) for s in sweeps[:4]) + (" ..." if len(sweeps) > 4 else "")
            return (f"{d} holds sweeps, not run directories: give one or more of them, e.g. "
                    f"python -m analysis.report {shown}")
    return (f"no run directories or manifest cells found in {', '.join(map(str, dirs))}: give the directory "
            f"a sweep was launched into (it holds {MANIFEST_FILE}), or launch the sweep first "
            "(python -m experiments.launch +sweep=NAME output_dir=...)")


def check_figures(arg: str | None, all_figures: Sequence[str], published: Sequence[str]) -> list[str] | None:
    """``--figures`` as a list of names (None: all); :class:`ReportInputError` naming an unknown one."""
    if arg is None:
        return None
    names = [f.strip() for f in arg.split(",") if f.strip()]
    if names == ["published"]:
        return list(published)
    bad = [n for n in names if n not in all_figures]
    if bad or not names:
        close = difflib.get_close_matches(bad[0], all_figures, n=1) if bad else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ReportInputError(
            f"--figures {arg!r}: unknown figure {bad[0] if bad else '(none given)'!r}{hint}; give a comma-separated "
            f"subset of {','.join(all_figures)}, or 'published'")
    return names
