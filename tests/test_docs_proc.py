"""The docs are true: every command and path that README.md and docs/ show works in this tree.

What is read: README.md, docs/*.md and docs/results/mini/*.md (their prose; not the generated
reports under docs/results/mini/<sweep>/ nor the published run directories). From each file:

- **commands**: the lines of fenced code blocks (```bash, ```sh, or unlabelled) and of indented
  code blocks that start with a command this project ships (``python -m ...``, ``.venv/bin/python
  ...``, ``make ...``, ``pip install ...``, ``python <script>.py``), backslash continuations
  joined, trailing ``# comments`` dropped; and inline code spans that start with one;
- **paths**: inline code spans that look like a repository path (a ``/`` in them, or a known file
  extension) and the relative link targets of ``[text](target)``.

What is checked (each failure names the doc, its line and what is wrong):

- a repository path exists (run-time outputs under ``runs/`` and the like, placeholders with
  ``<...>`` and the explicit :data:`CREATED_AT_RUN_TIME` list excepted);
- a link target exists, and its ``#anchor`` is a heading of the target page;
- every ``make X`` names a target of the Makefile;
- every ``pip install -e '.[extra]'`` names an extra of pyproject.toml;
- every ``python -m MODULE`` / ``python path/to/script.py`` exists; our argparse entry points
  (``experiments.*``, ``analysis.*``, ``fp8rl.backends.*``) parse the doc's arguments (the
  parser runs, the command does not); the mini CLI also builds its typed config from the doc's
  overrides;
- every ``python -m experiments.launch ...`` line without placeholders expands and validates
  its whole grid as a dry run (``dry_run=true`` appended), so a stale override, sweep name or
  cluster profile fails here: each distinct command once, one test each (named by the command).

It is part of the default suite (``make test``). The dry runs dominate its time: about 35 s on
an idle 2-core machine, several times that when other jobs load the cores.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: The docs read, relative to the repository.
DOC_GLOBS = ("README.md", "docs/*.md", "docs/results/mini/*.md", "slurm/README.md")

#: Extensions that make an inline code span a path even without a ``/`` in it.
PATH_EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".sh", ".txt", ".toml", ".cfg", ".json", ".jsonl",
                   ".csv", ".ipynb", ".pt", ".log", ".tex", ".png", ".pdf")

#: Leading components of paths that a run writes (run directories, sweep directories, caches,
#: venvs, report outputs): not in a clean checkout, so not checked to exist.
RUN_OUTPUT_ROOTS = ("runs/", "out/", "report/", "build/", ".venv/", ".venv-integration/", ".cache/",
                    "figures/", "tables/", "checkpoint/", "tensorboard/", "samples/", "openrlhf/")

#: Paths a doc names that are created at run time or live outside the repository, each with why.
CREATED_AT_RUN_TIME = {
    ".ci/run": "the CI entry point of the project's CI checkout, not part of this tree",
    "shared/reference/paper.md": "the reference notes kept next to the repository, not in it",
    "my.yaml": "a user's own config file in an example",
    "audit.csv": "experiments.audit's default output file",
    "state.pt": "the mini checkpoint file inside a run directory",
    "state.pt.tmp*": "a checkpoint write's temporary file",
    "model.pt": "a cached SFT warm start's weights",
    "meta.json": "a cached SFT warm start's metadata",
    "owner.json": "the lock file inside a run directory",
    "config.yaml": "inside a run directory",
    "status.json": "inside a run directory",
    "rollout_draws.jsonl": "a smoke-job dump inside a run directory (openrlhf/dumps/)",
    "final_eval.jsonl": "a smoke-job dump inside a run directory (openrlhf/dumps/)",
    "experiences-step<N>-<pid>.pt": "a smoke-job dump inside a run directory (openrlhf/dumps/)",
    "metrics.jsonl": "inside a run directory",
    "eval.jsonl": "inside a run directory",
    "summary.json": "inside a run directory",
    "run.log": "inside a run directory (what the cell printed)",
    "wandb_id.txt": "inside a run directory (its W&B run id)",
    "provenance.json": "inside a run directory",
    "overrides.txt": "inside a run directory",
    "manifest.json": "inside a sweep directory",
    "launch.log": "inside a sweep directory (the launcher's messages and stop summaries)",
    "report.md": "written by analysis.report",
    "attestation.json": "written by a paper-scale driver",
    "command.sh": "written by a paper-scale cell",
    "plugin_spec.json": "written by a paper-scale cell",
    "cells.csv": "written by analysis.report",
    "surges.csv": "written by analysis.report",
    ".submitit/": "submitit's logs in a sweep directory",
    "ray.json": "a paper-scale cell's Ray state, in its run directory",
    "dumps/": "a paper-scale cell's diagnostic dumps, in its run directory",
    # slurm/README.md: what the local Slurm cluster writes under its own directory (--dir)
    "log/": "the local Slurm cluster's log folder",
    "slurmctld.log": "a log of the local Slurm cluster",
    "slurmd.log": "a log of the local Slurm cluster",
    "slurmdbd.log": "a log of the local Slurm cluster",
    "mariadb-install.log": "a log of the local Slurm cluster",
    "munge/": "the local Slurm cluster's munged folder",
    "mysql/": "the local Slurm cluster's MariaDB folder",
}


@dataclass(frozen=True)
class Item:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the doc where the item starts
    text: str

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text!r}"


def doc_files() -> list[Path]:
    out: list[Path] = []
    for g in DOC_GLOBS:
        out.extend(sorted(REPO.glob(g)))
    return out


_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
#: A line is a command when it starts with one of these (after an optional ``$ ``).
_COMMAND_START = re.compile(
    r"^(?:\$ )?(?:python3?|\.venv(?:-integration)?/bin/\w+|make|pip|pytest|bash|eval|source|tensorboard|"
    r"PYTHONPATH=\S+ \S*python)\b")


def _join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, ln in lines:
        if not buf:
            start = n
        stripped = ln.rstrip()
        if stripped.endswith("\\"):
            buf += stripped[:-1].strip() + " "
            continue
        buf += ln.strip()
        out.append((start, buf))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


def _strip_comment(cmd: str) -> str:
    """Drop a trailing ``# comment`` (outside quotes)."""
    try:
        lex = shlex.shlex(cmd, posix=True, punctuation_chars=False)
        lex.whitespace_split = True
        lex.commenters = "#"
        list(lex)  # validates quoting
    except ValueError:
        return cmd.strip()
    # find the first '#' preceded by whitespace outside quotes
    quote = None
    for i, ch in enumerate(cmd):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or cmd[i - 1].isspace()):
            return cmd[:i].strip()
    return cmd.strip()


def extract(path: Path) -> tuple[list[Item], list[Item], list[Item]]:
    """``(commands, inline code spans, link targets)`` of one doc."""
    rel = str(path.relative_to(REPO))
    lines = path.read_text(encoding="utf-8").splitlines()
    commands: list[Item] = []
    code_lines: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    fence, lang = None, ""
    block: list[tuple[int, str]] = []
    prev_blank = True
    in_indented = False
    for n, ln in enumerate(lines, 1):
        m = _FENCE.match(ln)
        if fence is None and m:
            fence, lang, block = m.group(2), m.group(3).lower(), []
            continue
        if fence is not None:
            if ln.strip().startswith(fence[:3]) and ln.strip().strip(fence[0]) == "":
                if lang in _SHELL_LANGS:
                    code_lines.extend(block)
                fence = None
            else:
                block.append((n, ln))
            continue
        # indented code block: 4+ spaces after a blank line (not a list continuation)
        if ln.startswith("    ") and (prev_blank or in_indented) and ln.strip():
            in_indented = True
            code_lines.append((n, ln))
            prev_blank = False
            continue
        in_indented = in_indented and not ln.strip() == "" and ln.startswith("    ")
        prev_blank = not ln.strip()
        prose.append((n, ln))
    for n, cmd in _join_continuations([(n, ln) for n, ln in code_lines]):
        cmd = _strip_comment(cmd)
        if _COMMAND_START.match(cmd):
            commands.append(Item(rel, n, cmd.removeprefix("$ ")))
    spans: list[Item] = []
    links: list[Item] = []
    # inline code may wrap over a line break: scan paragraphs
    para: list[tuple[int, str]] = []

    def flush() -> None:
        if not para:
            return
        text = "\n".join(ln for _, ln in para)
        offsets = []
        pos = 0
        for n, ln in para:
            offsets.append((pos, n))
            pos += len(ln) + 1

        def line_of(i: int) -> int:
            return [n for p, n in offsets if p <= i][-1]

        for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
            spans.append(Item(rel, line_of(m.start()), " ".join(m.group(1).split())))
        no_code = re.sub(r"`[^`]*`", lambda mm: " " * len(mm.group(0)), text)
        for m in re.finditer(r"\]\(([^)\s]+)\)", no_code):
            links.append(Item(rel, line_of(m.start()), m.group(1)))
        para.clear()

    for n, ln in prose:
        if not ln.strip():
            flush()
        else:
            para.append((n, ln))
    flush()
    return commands, spans, links


def all_items() -> tuple[list[Item], list[Item], list[Item]]:
    cmds, spans, links = [], [], []
    for f in doc_files():
        c, s, lk = extract(f)
        cmds += c
        spans += s
        links += lk
    return cmds, spans, links


# --- what counts as a path ----------------------------------------------------------------------

#: Top-level entries of the repository: a span starting with one is a path from the repo root.
TOP_LEVEL = frozenset(p.name for p in REPO.iterdir()
                      if p.name != ".git" and not p.name.startswith(".venv") and p.name != "runs")

#: Spans that look like paths but name something outside this repository, each with why.
NOT_OURS = {
    "transformer_engine/common/recipe/__init__.py": "a file of Transformer Engine's sources",
    "recipe/dapo/run_dapo_qwen2.5_32b.sh": "verl's DAPO recipe (docs/cluster.md cites it)",
    "scripts/train/run_deepscaler_1.5b_8k.sh": "DeepScaleR's training script (docs/cluster.md cites it)",
    "actor.yaml": "verl's actor defaults (docs/cluster.md cites them)",
    "examples/scripts/train_dapo_ray_hybrid_engine.sh": "an example script of OpenRLHF (docs/cluster.md cites it)",
}

#: Whole words that stand for a value the reader fills in (``slurm/profiles/NAME.yaml``).
PLACEHOLDER_WORDS = frozenset({"NAME", "PATH", "DIR", "NEW", "FILE", "OUT"})


def path_candidate(span: str) -> str | None:
    """The repository path an inline code span names, or None when it is not one."""
    t = span.strip()
    if " " in t:  # a path followed by options (``benchmarks/gpu_paper_smoke.py --dry-run``)
        first = t.split()[0]
        if first.split("/")[0] in TOP_LEVEL and first.endswith(PATH_EXTENSIONS) and t.split()[1].startswith("-"):
            t = first
        else:
            return None
    t = t.split("::")[0]
    if any(c in t for c in "<>()=|@[],;'\"$`") or t.startswith(("/", "~")):
        return None
    if set(re.split(r"[/.]", t)) & PLACEHOLDER_WORDS:
        return None
    if t in (".", "./") or re.fullmatch(r"\.\w+", t):  # the current directory, a bare extension
        return None
    if t.startswith(RUN_OUTPUT_ROOTS):
        return None
    if t.split("/")[0] in TOP_LEVEL:
        return t
    if t.endswith(PATH_EXTENSIONS) or t.endswith(PATH_EXTENSIONS + tuple(e + "*" for e in PATH_EXTENSIONS)):
        return t
    if t.endswith("/") and re.fullmatch(r"[\w./-]+", t):  # a folder named relative to its context
        return t
    return None


def _expand_braces(p: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", p)
    if not m:
        return [p]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(p[:m.start()] + alt + p[m.end():])]


_PRUNE = {".git", "__pycache__", "runs", ".venv", ".venv-integration", ".pytest_cache", ".ruff_cache"}


def repo_paths() -> set[str]:
    """Every file and folder of the tree (folders with a trailing ``/``), published runs left out."""
    import os

    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(REPO):
        rel = Path(dirpath).relative_to(REPO)
        dirnames[:] = [d for d in dirnames if d not in _PRUNE and not d.endswith(".egg-info")
                       and not (str(rel) == "docs/results/mini" and d == "runs")]
        for d in dirnames:
            out.add(f"{(rel / d).as_posix()}/".removeprefix("./"))
        for f in filenames:
            out.add((rel / f).as_posix().removeprefix("./"))
    return out


def path_problem(span: str, paths: set[str]) -> str | None:
    """Why the path a span names does not hold, or None."""
    t = path_candidate(span)
    if t is None or t in CREATED_AT_RUN_TIME or t in NOT_OURS:
        return None
    test_id = span.strip().split()[0].split("::")[1:]
    if t.split("/")[0] in TOP_LEVEL:
        hits = [h for alt in _expand_braces(t) for h in REPO.glob(alt.rstrip("/"))]
        missing = [alt for alt in _expand_braces(t) if not list(REPO.glob(alt.rstrip("/")))]
        if missing or not hits:
            return f"no such path in the repository: {', '.join(missing) or t}"
        if test_id:
            src = hits[0].read_text(encoding="utf-8")
            if not re.search(rf"^\s*def {re.escape(test_id[-1])}\b", src, re.M):
                return f"{hits[0].relative_to(REPO)} has no test {test_id[-1]}"
        return None
    pat = re.compile("(^|/)" + re.escape(t).replace(r"\*", "[^/]*") + "$")
    if not any(pat.search(p) for p in paths):
        return f"no file or folder named {t} anywhere in the repository"
    return None


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    out, fence = set(), False
    for ln in md.read_text(encoding="utf-8").splitlines():
        if ln.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", ln)):
            out.add(_slug(m.group(1)))
    return out


def link_problem(item: Item) -> str | None:
    target = item.text
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    doc = REPO / item.doc
    dest = (doc.parent / path).resolve() if path else doc
    if not dest.exists():
        return f"link target {path} does not exist (from {item.doc})"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{dest.relative_to(REPO)} has no heading with anchor #{anchor}"
    return None


# --- commands ----------------------------------------------------------------------------------

_PY = re.compile(r"^(?:\S*/)?python3?$")


def command_parts(cmd: str) -> list[list[str]]:
    """The simple commands of a doc line as token lists (``eval "$(make -s x)"`` -> the make)."""
    out = []
    for inner in re.findall(r"\$\(([^()]*)\)", cmd):
        out += command_parts(inner)
    cmd = re.sub(r"\"?\$\([^()]*\)\"?", " ", cmd)
    for piece in re.split(r"&&|\|\||;|\|", cmd):
        try:
            toks = shlex.split(piece)
        except ValueError:
            toks = piece.split()
        while toks and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", toks[0]):  # VAR=value prefixes
            toks = toks[1:]
        if toks and toks[0] not in ("eval", "source", "tensorboard"):
            out.append(toks)
    return out


def has_placeholder(tokens: list[str]) -> bool:
    return any("<" in t or ">" in t or t in ("...", "…") or t.startswith("[") or t.endswith("]")
               or t in PLACEHOLDER_WORDS for t in tokens)


def makefile_targets() -> set[str]:
    targets = set()
    for ln in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+(?:\s+[A-Za-z0-9_.\-]+)*)\s*:(?!=)", ln)
        if m:
            targets.update(m.group(1).split())
    return targets - {".PHONY"}


def pyproject_extras() -> set[str]:
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return set(data["project"].get("optional-dependencies", {}))


def doc_commands() -> list[tuple[Item, list[str]]]:
    """Every simple command of the docs (code blocks, and inline spans that are commands)."""
    cmds, spans, _ = all_items()
    out = []
    for item in cmds + [s for s in spans if _COMMAND_START.match(s.text)]:
        for toks in command_parts(item.text):
            out.append((item, toks))
    return out


@dataclass(frozen=True)
class PyCommand:
    item: Item
    module: str | None  # python -m MODULE
    script: str | None  # python path/to/script.py
    args: tuple[str, ...]


def python_commands() -> list[PyCommand]:
    out = []
    for item, toks in doc_commands():
        if not _PY.match(toks[0]):
            continue
        rest = toks[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            out.append(PyCommand(item, rest[1], None, tuple(rest[2:])))
        elif rest and rest[0].endswith(".py"):
            out.append(PyCommand(item, None, rest[0], tuple(rest[1:])))
    return out


OUR_PACKAGES = ("experiments", "analysis", "fp8rl")


# --- the tests ---------------------------------------------------------------------------------


def test_the_docs_are_read():
    """The extraction finds what the docs hold (a broken reader would pass every check below)."""
    cmds, spans, links = all_items()
    docs = {i.doc for i in cmds}
    assert {"README.md", "docs/launch.md", "docs/mini.md", "docs/cluster.md"} <= docs, docs
    assert any(i.text == "make reproduce" for i in cmds)
    assert any(i.text.startswith("python -m experiments.launch +sweep=smoke") for i in cmds)  # indented block
    assert any(path_candidate(s.text) == "fp8rl/runs/rundir.py" for s in spans)
    assert any(lk.text == "docs/results/mini/README.md" for lk in links)
    assert len(python_commands()) > 40


def test_paths_in_the_docs_exist():
    paths = repo_paths()
    _, spans, _ = all_items()
    problems = [f"{s.where()}: {p}" for s in spans if (p := path_problem(s.text, paths))]
    assert not problems, "\n".join(problems)


def test_links_in_the_docs_resolve():
    _, _, links = all_items()
    problems = [f"{lk.where()}: {p}" for lk in links if (p := link_problem(lk))]
    assert not problems, "\n".join(problems)


def test_make_targets_in_the_docs_exist():
    targets = makefile_targets()
    assert {"reproduce", "test", "results", "paper-smoke"} <= targets  # the parser reads the Makefile
    problems = []
    for item, toks in doc_commands():
        if toks[0] != "make":
            continue
        for t in toks[1:]:
            if t.startswith("-") or "=" in t:
                continue
            if t not in targets:
                problems.append(f"{item.where()}: the Makefile has no target {t!r}")
    assert not problems, "\n".join(problems)


def test_shell_scripts_in_the_docs_exist():
    problems = [f"{item.where()}: no such script {toks[1]}" for item, toks in doc_commands()
                if toks[0] == "bash" and len(toks) > 1 and not (REPO / toks[1]).is_file()]
    assert not problems, "\n".join(problems)


def test_pip_extras_in_the_docs_exist():
    extras = pyproject_extras()
    problems = []
    for item, toks in doc_commands():
        if not re.match(r"^(?:\S*/)?pip3?$", toks[0]) or toks[1:2] != ["install"]:
            continue
        for t in toks[2:]:
            m = re.fullmatch(r"\.\[([\w,-]+)\]", t)
            for extra in (m.group(1).split(",") if m else []):
                if extra not in extras:
                    problems.append(f"{item.where()}: pyproject.toml has no extra {extra!r}")
    assert not problems, "\n".join(problems)


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once the doc's arguments parsed: nothing runs."""


def _parse_only(cmd: PyCommand, monkeypatch, capsys) -> str | None:
    """Run the entry point's own argument parser on the doc's arguments; why it fails, or None.

    With placeholders in the line (``runs/<sweep>``, ``[--out DIR]``) only the option names are
    checked against the parser."""
    import argparse
    import runpy
    import sys
    import warnings

    args = list(cmd.args)
    placeholder = has_placeholder(args)
    if cmd.module == "fp8rl.backends.mini" and not placeholder and "--config" not in args:
        from fp8rl.backends.mini.__main__ import parse_config  # parses and builds the typed config

        try:
            parse_config(args)
        except SystemExit as e:
            return f"usage error ({e.code}): {capsys.readouterr().err.strip()}"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None
    seen: dict = {}
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, a=None, namespace=None):
        seen["parser"] = self
        if not placeholder:
            original(self, a, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    target = cmd.module or str(REPO / cmd.script)
    monkeypatch.setattr(sys, "argv", [target, *args])
    try:
        if cmd.module:
            with warnings.catch_warnings():  # runpy on a package whose __main__ is imported
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(cmd.module, run_name="__main__", alter_sys=False)
        else:
            runpy.run_path(target, run_name="__main__")
    except _Parsed:
        pass
    except SystemExit as e:
        if e.code not in (0, None):  # --help exits 0
            return f"usage error ({e.code}): {capsys.readouterr().err.strip()}"
    finally:
        monkeypatch.undo()
    if "parser" not in seen:
        return None if "--help" in args else "it never reached an argument parser"
    if placeholder:
        known = seen["parser"]._option_string_actions
        opts = []
        for a in args:
            if a == "--":
                break
            a = a.strip("[]")
            if a.startswith("-") and a not in ("-", "--"):
                opts.append(a.split("=")[0])
        unknown = [o for o in opts if o not in known]
        if unknown:
            return f"unknown option(s) {unknown}"
    return None


def test_python_entry_points_in_the_docs_parse(monkeypatch, capsys):
    """Every ``python -m MODULE`` exists; our entry points and scripts parse the doc's arguments."""
    import importlib.util

    problems, done = [], set()
    for cmd in python_commands():
        if cmd.module == "experiments.launch":  # Hydra: the dry-run test below
            continue
        key = (cmd.module, cmd.script, cmd.args)
        if key in done:
            continue
        done.add(key)
        if cmd.module == "pytest":
            for a, prev in zip(cmd.args, ("", *cmd.args[:-1]), strict=True):
                if not a.startswith("-") and prev not in ("-m", "-k") and not (REPO / a.split("::")[0]).exists():
                    problems.append(f"{cmd.item.where()}: no such test path {a}")
            continue
        if cmd.script:
            if not (REPO / cmd.script).is_file():
                problems.append(f"{cmd.item.where()}: no such script {cmd.script}")
                continue
        else:
            try:
                found = importlib.util.find_spec(cmd.module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                problems.append(f"{cmd.item.where()}: no module {cmd.module}")
                continue
            if cmd.module.split(".")[0] not in OUR_PACKAGES:
                continue
        if not cmd.args and cmd.item.text.split()[-1] == cmd.module:
            continue  # an inline mention of the module, not a command line
        why = _parse_only(cmd, monkeypatch, capsys)
        if why:
            problems.append(f"{cmd.item.where()}: {why}")
    assert not problems, "\n".join(problems)


#: Overrides that say how cells are launched, not what they are: a doc line that adds them to a
#: sweep is checked on one cell of it (``ONE_CELL``), the sweep itself once in full.
LAUNCH_ONLY = ("workers=", "launcher=", "array_parallelism=", "wait=", "progress=")
ONE_CELL = ("algorithm=grpo", "model=8b", "fp8=bf16", "clip=vanilla")


def launch_commands() -> dict[tuple[str, ...], list[Item]]:
    """Distinct ``experiments.launch`` dry runs -> the doc lines they check. Lines with
    placeholders are left out; ``dry_run=`` is dropped (every run is a dry run)."""
    out: dict[tuple[str, ...], list[Item]] = {}
    for cmd in python_commands():
        if cmd.module != "experiments.launch" or has_placeholder(list(cmd.args)):
            continue
        if {"--help", "-h"} & set(cmd.args):  # help, not a launch: checked by test_launch_help
            continue
        args = tuple(a for a in cmd.args if not a.startswith("dry_run="))
        paper = any(a == "scale=paper" for a in args)
        how = tuple(a for a in args if a.startswith(LAUNCH_ONLY) or (a.startswith("cluster=") and not paper))
        what = tuple(a for a in args if a not in how)
        out.setdefault(what, []).append(cmd.item)  # the grid, in full
        if how:
            out.setdefault((*what, *how, *ONE_CELL), []).append(cmd.item)  # how it launches, on one cell
    return out


LAUNCH_COMMANDS = launch_commands()


@pytest.mark.parametrize("args", list(LAUNCH_COMMANDS),
                         ids=[" ".join(a) or "(no overrides)" for a in LAUNCH_COMMANDS])
def test_launch_commands_in_the_docs_dry_run(args, tmp_path, monkeypatch, capsys):
    """Every launch line of the docs, as a dry run: the whole grid expands and validates. One
    test per distinct command (its id), so that the suite's workers share them out."""
    import sys

    import experiments.launch as launch

    monkeypatch.chdir(tmp_path)  # dry runs write nothing; relative run roots resolve here
    monkeypatch.setattr(sys, "argv", ["experiments/launch.py", *args, "dry_run=true"])
    code = 0
    try:
        launch.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    cap = capsys.readouterr()
    where = "; ".join(f"{i.doc}:{i.line}" for i in LAUNCH_COMMANDS[args])
    tail = "\n    ".join((cap.out + cap.err).strip().splitlines()[-8:])
    assert code == 0 and "dry run: nothing was run" in cap.out, (
        f"{where}: python -m experiments.launch {' '.join(args)} dry_run=true -> exit {code}\n    {tail}")
    assert list(tmp_path.iterdir()) == [], f"{where}: a dry run wrote files"


def test_the_docs_have_launch_commands():
    """The parametrized dry runs above are not vacuous: the README's main commands are there."""
    assert ("+sweep=main_table",) in LAUNCH_COMMANDS and len(LAUNCH_COMMANDS) >= 10


# --- docs/design.md stays current ---------------------------------------------------------------


def _table_after(text: str, heading_line: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after the line that starts with
    ``heading_line``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(heading_line))
    rows, seen = [], False
    for ln in lines[start + 1:]:
        if ln.startswith("|"):
            seen = True
            cells = [c.strip() for c in ln.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif seen:
            break
    return rows[1:]  # without the header


def _code(cell: str) -> str:
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"expected one code span, got {cell!r}"
    return m.group(1)


DESIGN = REPO / "docs" / "design.md"


def test_design_lists_exactly_the_metric_names():
    """docs/design.md's metric tables are fp8rl/runs/metrics.py: every name, in order, with its
    constant and whether it is sparse; nothing else."""
    from fp8rl.runs import metrics as M

    text = DESIGN.read_text(encoding="utf-8")
    train = _table_after(text, "Per training step")
    assert [_code(r[0]) for r in train] == list(M.TRAIN_METRICS)
    for name, const, logged, *_ in train:
        assert getattr(M, _code(const)) == _code(name), f"{const} is not {name}"
        assert (logged == "sparse") == (_code(name) in M.SPARSE_METRICS), f"{name}: logged {logged!r}"
    evals = _table_after(text, "Per evaluation")
    assert [_code(r[0]) for r in evals] == [M.eval_key("DS", s, precision=p).replace("DS", "<dataset>")
                                            for p in M.EVAL_PRECISIONS for s in M.EVAL_STATS]
    for name, const, engine, *_ in evals:
        assert _code(name) == M.eval_key("DS", getattr(M, _code(const)), precision=getattr(M, _code(engine))
                                         ).replace("DS", "<dataset>"), f"{name}: constant or engine wrong"


def test_design_describes_every_file_of_the_run_directory():
    from fp8rl.backends.mini.checkpoint import CHECKPOINT_FILE
    from fp8rl.runs import live, lock, manifest, rundir

    text = DESIGN.read_text(encoding="utf-8")
    described = {_code(r[0]).rstrip("/") for r in _table_after(text, "## The run directory")}
    files = {v for k, v in vars(rundir).items() if k.endswith(("_FILE", "_DIR")) and isinstance(v, str)}
    files |= {lock.OWNER_FILE, live.TENSORBOARD_DIR, "openrlhf"}
    assert files == described, f"undescribed: {files - described}; not a run file: {described - files}"
    assert f"`{manifest.MANIFEST_FILE}`" in text and f"`{CHECKPOINT_FILE}`" in text


def test_design_registry_table_names_real_registries():
    import importlib

    from fp8rl.registry import Registry

    rows = _table_after(DESIGN.read_text(encoding="utf-8"), "| registry | module |")
    assert len(rows) >= 10
    for names, modules, listed in rows:
        names = [_code(n.strip()) for n in names.split(",")]
        mods = [_code(m.strip()) for m in modules.split(",")]
        package = mods[0].rsplit(".", 1)[0]
        mods = [m if not m.startswith(".") else package + m for m in mods]  # `.granularity`
        for name, mod in zip(names, mods if len(mods) == len(names) else mods[:1] * len(names), strict=True):
            reg = getattr(importlib.import_module(mod), name, None)
            assert isinstance(reg, Registry), f"{mod}.{name} is not a Registry"
            entries = re.findall(r"`([^`]+)`", listed)
            if len(names) == 1 and entries:  # the row lists the registry's entries: all of them
                assert set(entries) == set(reg), f"{name}: the table lists {entries}, it holds {sorted(reg)}"


def test_design_map_names_existing_files():
    """docs/design.md's "Where does X live": every path it names exists."""
    rows = _table_after(DESIGN.read_text(encoding="utf-8"), "| concept | shared |")
    assert len(rows) >= 15
    paths = [p for r in rows for cell in r[1:] for p in re.findall(r"`([^`]+/[^`]*)`", cell)]
    assert len(paths) >= 30 and all(len(r) == 4 for r in rows)
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"docs/design.md names files that do not exist: {missing}"


def test_design_registry_table_lists_every_registry():
    """Every ``Registry`` the library defines is a row of the registry table."""
    listed = {_code(n.strip()) for r in _table_after(DESIGN.read_text(encoding="utf-8"), "**Sweep axes are")
              for n in r[0].split(",")}
    defined = {m.group(1) for f in (REPO / "fp8rl").rglob("*.py")
               for m in re.finditer(r"^([A-Z_]+)(?:: Registry\[.*\])? = Registry\(", f.read_text(), re.M)}
    assert len(defined) >= 15 and defined == listed, (
        f"not in the table: {sorted(defined - listed)}; not a registry: {sorted(listed - defined)}")


def test_the_offline_cluster_profile_in_the_docs_is_the_file():
    import yaml

    text = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8")
    block = re.search(r"without its comments:\n\n```yaml\n(.*?)```", text, re.S).group(1)
    assert yaml.safe_load(block) == yaml.safe_load((REPO / "slurm/profiles/offline_h100x4.yaml").read_text())


def test_analysis_imports_only_the_run_directory_package():
    """The contract of docs/design.md: analysis reads run directories only."""
    import ast

    for f in (REPO / "analysis").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for n in names:
                assert not n.startswith("fp8rl") or n == "fp8rl.runs" or n.startswith("fp8rl.runs."), \
                    f"{f.relative_to(REPO)} imports {n}"


def test_no_pointer_to_a_design_file_outside_the_repository():
    """Docs, docstrings and tests name docs/design.md, not a DESIGN.md that is not here."""
    import subprocess

    out = subprocess.run(["git", "grep", "-n", "DESIGN", "--", ".", ":!tests/test_docs_proc.py"], cwd=REPO,
                         capture_output=True, text=True, check=False).stdout
    assert out == "", out


def test_the_readme_opens_with_a_published_figure():
    """The README's first screen (its first 40 lines) shows one figure, a PNG in docs/figures/ that
    `make results` copies from a published report (so it is regenerated, not drawn by hand)."""
    import re

    head = "\n".join((REPO / "README.md").read_text(encoding="utf-8").splitlines()[:40])
    figures = re.findall(r"!\[[^\]]+\]\(([^)]+\.png)\)", head)
    assert len(figures) == 1, figures
    (fig,) = figures
    assert fig.startswith("docs/figures/") and (REPO / fig).is_file(), fig
    recipe = re.search(rf"cp (\S+) {re.escape(fig)}", (REPO / "Makefile").read_text(encoding="utf-8"))
    assert recipe, f"no Makefile recipe copies a published figure to {fig}"
    src = recipe.group(1).replace("$(RESULTS)", "docs/results/mini")
    assert (REPO / src).read_bytes() == (REPO / fig).read_bytes(), f"{fig} is not the published {src}"


# --- docs/timings.md: the dated ledger, and the README's one figure per target ------------------------

TIMINGS = REPO / "docs" / "timings.md"
#: targets whose figure the README quotes: (timings.md section title, the README's phrase before it)
README_FIGURES = {"`make reproduce`": "`make reproduce` (= `.venv/bin/python -m experiments.launch +sweep=main_table`) took",
                  "`make test`": "`make test` took"}


def timings_tables() -> dict[str, list[dict]]:
    """``{section title: rows}`` of docs/timings.md, each row a dict of its columns."""
    out: dict[str, list[dict]] = {}
    text = TIMINGS.read_text(encoding="utf-8")
    for title in re.findall(r"^## (.+)$", text, re.M):
        rows = _table_after(text, f"## {title}")
        header = [c.strip() for c in text.split(f"## {title}", 1)[1].split("\n|", 1)[1].split("\n", 1)[0].strip("|").split("|")]
        out[title] = [dict(zip(header, r, strict=True)) for r in rows]
    return out


def test_timings_rows_are_dated_newest_first():
    tables = timings_tables()
    assert set(README_FIGURES) <= set(tables), sorted(tables)
    for title, rows in tables.items():
        assert rows, title
        dates = [r["date"] for r in rows]
        assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", d) for d in dates), (title, dates)
        assert dates == sorted(dates, reverse=True), f"{title}: rows not newest first: {dates}"


def test_the_readme_quotes_the_newest_figure_of_each_target():
    """The README's figure for a target is the newest row of its docs/timings.md table, and the
    README holds no dated history (no date at all)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    tables = timings_tables()
    for title, phrase in README_FIGURES.items():
        m = re.search(re.escape(phrase) + r"\s+\*\*([^*]+)\*\*", readme)
        assert m, f"README.md does not quote {title}'s figure after {phrase!r}"
        assert m.group(1) == tables[title][0]["wall"], (title, m.group(1), tables[title][0])
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "README.md carries a date: dated figures go to docs/timings.md"
