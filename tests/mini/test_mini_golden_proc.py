"""Golden numbers: short real mini runs must log exactly the numbers recorded before.

A speed change (fewer operations, cached tables, no NaN fill) must leave every logged number
of a run that does not opt in bit for bit as it was, so that a published run replays. These
tests run the golden cells of ``tiny_cells.py`` (SFT warm start, 3 steps, evaluations at steps 0
and 3; fp32 and BF16 compute, the FP8 trainer and rollout at every granularity, NVFP4's training
recipe and MXFP6, TIS, Calibrated Clipping in its ``same_batch``, ``sampled`` and ``periodic``
modes, 64-row rollouts that share their prefill)
and compare every value of ``metrics.jsonl`` and ``eval.jsonl`` except ``perf/*`` (wall times)
with ``golden_numerics.json``, exactly; the FP8 and FP4 / FP6 cells also check that they ran the native
``fake_quantize`` kernels where those are built, and the 64-row cells that their rollouts
prefilled each prompt once.

**Which machine's numbers.** The bits depend on the machine: torch's ATen kernel level and the
code path MKL takes for the fp32 GEMMs (chosen by CPU vendor and ISA), besides torch and
transformers (``fp8rl/backends/mini/numerics.py`` says what was measured). So numbers are stored
per numerics fingerprint, whose key holds a digest of a probe of those kernels' output bits. On a
machine whose key has no numbers the comparison skips with one line naming the key and the
command that records them, and what runs everywhere still guards the numerics:

- every golden cell, run twice in fresh processes, logs identical numbers (and the fingerprint
  is the same in both: the probe is stable);
- the FP8 GEMM emulation holds the float32 accumulation bound against a float64 reference
  (``tests/quant/test_quant_linear.py``), and the quantizers are exact to the bit on every value
  (``tests/quant/test_quant_quantize.py``, ``test_quantize_grid.py``): both hold on any CPU.

Record from a commit whose numbers are right (before the change under test), never from the
change itself (``make record-golden``, which runs)::

    FP8RL_RECORD_GOLDEN=1 python -m pytest -q tests/mini/test_mini_golden_proc.py

(recording writes this machine's entry and keeps the others; ``FP8RL_GOLDEN_FILE`` points it at
another file).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_cells import CELLS, WIDE, _canon, cell_numbers, first_difference, golden_config

from fp8rl.backends.mini import numerics

GOLDEN = Path(os.environ.get("FP8RL_GOLDEN_FILE") or Path(__file__).with_name("golden_numerics.json"))
TINY_CELLS = Path(__file__).with_name("tiny_cells.py")
REPO = Path(__file__).resolve().parents[2]
RECORD_HINT = "FP8RL_RECORD_GOLDEN=1 python -m pytest -q tests/mini/test_mini_golden_proc.py (make record-golden)"


def _recorded() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"probe_source": None, "machines": {}}


def _recorded_for_this_machine() -> dict | None:
    return _recorded()["machines"].get(numerics.fingerprint()["key"])


def _describe(fp: dict) -> str:
    cpu = fp["cpu"] or {}
    return f"{fp['key']} (MKL: {fp['mkl'] or 'none'}; CPU: {cpu.get('vendor')} {cpu.get('model')})"


def _record(name: str, numbers: dict) -> None:
    fp = numerics.fingerprint()
    data = _recorded()
    data["probe_source"] = numerics.probe_source_digest()
    entry = data["machines"].setdefault(fp["key"], {"cells": {}})
    entry["machine"] = {k: fp[k] for k in ("aten", "mkl", "cpu", "torch", "transformers")}
    entry["cells"][name] = numbers
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", list(CELLS))
def test_logged_numbers_are_unchanged(sft_cache, tmp_path, name):
    cfg = golden_config(sft_cache, tmp_path / "runs", name)
    if os.environ.get("FP8RL_RECORD_GOLDEN") == "1":
        _record(name, cell_numbers(cfg))
        pytest.skip(f"recorded {name} for {numerics.fingerprint()['key']}")
    entry = _recorded_for_this_machine()
    if entry is None or name not in entry["cells"]:
        pytest.skip(f"no golden numbers for this machine's numerics fingerprint {_describe(numerics.fingerprint())}; "
                    f"fresh-process determinism is checked instead; record them from a commit known to be right: "
                    f"{RECORD_HINT}")
    from fp8rl.backends.mini import shared_prefill
    from fp8rl.quant import native

    before = sum(native.calls.values())
    shared_prefill.VERDICTS.clear()  # the cell's own checks of its shared prefills
    got = cell_numbers(cfg)
    diff = first_difference(entry["cells"][name], got)
    assert diff is None, f"{name}: the logged numbers changed: {diff}"
    if CELLS[name][0] not in ("fp32", "bf16") and native.enabled():  # what computed them
        assert sum(native.calls.values()) > before, f"{name}: the FP8 cell did not run the native kernels"
    if name in WIDE:  # what computed them: its rollouts prefilled each prompt once
        assert True in shared_prefill.VERDICTS.values(), f"{name}: no rollout shared its prefill"


def _fresh_process(cache: Path, runs: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(TINY_CELLS), "--cache", str(cache), "--runs", str(runs),
                           "--out", str(out)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_golden_cell_logs_the_same_numbers_in_two_fresh_processes(tmp_path):
    """Runs everywhere, recorded numbers or not: the first process trains the SFT warm start into an
    empty cache, the second loads it; every cell's numbers must be equal, and the numerics
    fingerprint the same in both. Where this machine has recorded numbers they must equal them too."""
    cache = tmp_path / "sft"
    a = _fresh_process(cache, tmp_path / "a", tmp_path / "a.json")
    b = _fresh_process(cache, tmp_path / "b", tmp_path / "b.json")
    assert a["fingerprint"]["key"] == b["fingerprint"]["key"] == numerics.fingerprint()["key"]
    assert set(a["cells"]) == set(b["cells"]) == set(CELLS)
    for name in CELLS:
        assert a["cells"][name]["metrics"], name  # it trained and logged
        diff = first_difference(a["cells"][name], b["cells"][name])
        assert diff is None, f"{name}: a second fresh process logged other numbers: {diff}"
    entry = _recorded_for_this_machine()
    for name in (entry or {}).get("cells", {}):
        diff = first_difference(entry["cells"][name], a["cells"][name])
        assert diff is None, f"{name}: the logged numbers changed: {diff}"


def test_the_probe_is_the_one_the_numbers_were_recorded_with():
    """The fingerprint's probe keys every recorded machine: editing it re-keys them all, which would
    turn every comparison into a skip. Change the probe only together with re-recording every entry
    (bump ``numerics.PROBE_VERSION``)."""
    data = _recorded()
    assert data["machines"], "no golden numbers recorded at all"
    assert data["probe_source"] == numerics.probe_source_digest(), (
        "fp8rl/backends/mini/numerics.py's probe changed since the golden numbers were recorded: bump "
        f"PROBE_VERSION and re-record each machine's entry ({RECORD_HINT})")
    for key in data["machines"]:
        assert f"probe v{numerics.PROBE_VERSION}:" in key, key


def test_a_changed_number_is_reported():
    """The comparison itself: one last-bit change, one missing key, one extra row."""
    want = {"metrics": [{"step": 1, "a": 0.1, "b": "nan"}], "eval": [{"step": 0, "x": 1.0}]}
    same = json.loads(json.dumps(want))
    assert first_difference(want, same) is None
    bumped = json.loads(json.dumps(want))
    bumped["metrics"][0]["a"] = math.nextafter(0.1, 1.0)
    assert "a: got" in first_difference(want, bumped)
    missing = json.loads(json.dumps(want))
    del missing["eval"][0]["x"]
    assert "x: got '<missing>'" in first_difference(want, missing)
    extra = json.loads(json.dumps(want))
    extra["metrics"].append({"step": 2})
    assert "2 rows" in first_difference(want, extra)
    assert _canon(float("nan")) == "nan"
