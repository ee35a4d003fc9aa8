"""``runtime.keep_freed_memory``: glibc keeps a step's freed temporaries for reuse.

Measured where it matters, in a fresh interpreter each (the setting is process-wide): the minor
page faults of 50 rounds of a step's allocation pattern (live 0.6-4 MB temporaries of several
sizes, a result replaced by the next), on one thread (worker threads get malloc arenas of their
own, which added 625 faults to 2 of 15 runs here).

glibc's own start state is not a fixed baseline: its mmap threshold moves as blocks are freed,
so the same script faulted 0, 2,624 or 164,400 times from run to run (0 in one CI run). Both
runs therefore first pin glibc's documented start values (a 128 KiB mmap threshold and trim
threshold, fixed): from there every such block is a fresh ``mmap`` faulted in again on every
allocation (166,250 faults here), and :func:`keep_freed_memory` must turn that into reuse (0).
A run that still faults (1,875 faults once, in a CI run with the Slurm tests beside it) is
measured again, up to three times, and the least count is judged: without the setting every
run faults about 166,000 times, so the retry cannot hide a broken setting.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, resource, sys, torch
from fp8rl.backends.mini.runtime import _M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD, keep_freed_memory
torch.set_num_threads(1)
libc = ctypes.CDLL(None)
assert libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 128 << 10) == 1
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
    _, pinned = _faults("pinned")
    applied, kept = _faults("keep")
    tries = [kept]
    while kept >= 50 and len(tries) < 3:  # a stray arena's pages (module docstring): measured again
        applied, kept = _faults("keep")
        tries.append(kept)
    kept = min(tries)
    assert pinned > 500, pinned  # glibc's start thresholds: pages handed back and faulted in again
    assert applied
    assert kept < 50, (tries, pinned)  # reused: next to none


def test_setting_is_idempotent():
    from fp8rl.backends.mini.runtime import keep_freed_memory

    assert keep_freed_memory() == keep_freed_memory()
