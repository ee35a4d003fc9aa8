"""``runtime.keep_freed_memory``: glibc keeps a step's freed temporaries for reuse.

Measured where it matters, in a fresh interpreter each (the setting is process-wide): the minor
page faults of 50 rounds of a step's allocation pattern (live 0.6-4 MB temporaries of several
sizes, a result replaced by the next). With glibc's defaults freed blocks go back to the kernel
and are faulted in again (1,250 or 164,400 faults in ten runs here, depending on the heap's
layout); with the setting the same pages come back from the heap (0 here).
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from fp8rl.backends.mini.runtime import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
xs = [torch.ones(n) for n in (320_000, 160_000, 640_000, 1_000_000)]
def once():  # a step's pattern: live temporaries of several sizes, a result replaced by the next
    ys = [x * 2 for x in xs]
    y = xs[2] * 3
    y = y * 0.25
    del ys
    return y
for _ in range(3):
    once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    once()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    applied, kept = _faults("keep")
    _, default = _faults("default")
    assert applied
    assert default > 500, default  # pages handed back and faulted in again
    assert kept < 50, (kept, default)  # reused: next to none


def test_setting_is_idempotent():
    from fp8rl.backends.mini.runtime import keep_freed_memory

    assert keep_freed_memory() == keep_freed_memory()
