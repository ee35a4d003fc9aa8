"""Process-level tests say so in their name: a default-tier test module that starts processes
(``subprocess``, a pty, ``multiprocessing``, ``os.fork``) ends in ``_proc.py``, and one that does
not, does not. They are the slow, machine-sensitive part of the suite (real launches, kills,
Ctrl-C, fresh interpreters); the suffix lets a reader find them and ``pytest --ignore-glob`` or
``-k`` leave them out (tests/README.md). ``tests/integration/`` is its own tier and keeps its
names."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: What starting a process looks like in a test module's source.
STARTS_PROCESSES = re.compile(r"\bsubprocess\.|\bPopen\b|\bPtyShell\b|^import pty\b|\bmultiprocessing\b|\bos\.fork\b",
                              re.MULTILINE)


def _modules() -> list[Path]:
    """The default-tier test modules, this one aside (its source spells the patterns)."""
    return sorted(p for p in TESTS.rglob("test_*.py")
                  if "integration" not in p.relative_to(TESTS).parts and p != Path(__file__).resolve())


def process_level(source: str) -> bool:
    return STARTS_PROCESSES.search(source) is not None


def test_process_level_modules_end_in_proc_and_no_other_does():
    wrong = [f"{p.relative_to(TESTS)}: {'starts processes, name it *_proc.py' if process_level(t) else 'starts none, drop _proc'}"
             for p in _modules() if process_level(t := p.read_text()) != p.stem.endswith("_proc")]
    assert not wrong, "\n".join(wrong)


def test_the_rule_tells_the_two_apart():
    assert process_level("import subprocess\nsubprocess.run(['true'])\n")
    assert process_level("from pty_shell import PtyShell\nsh = PtyShell(cmd, cwd, env)\n")
    assert process_level("import multiprocessing as mp\n")
    assert not process_level("def test_x():\n    assert 1 + 1 == 2\n")
    assert not process_level("# runs in one process; no subprocess here\n")
