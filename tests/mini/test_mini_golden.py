"""Golden numbers: short real mini runs must log exactly the numbers recorded before.

A speed change (fewer operations, cached tables, no NaN fill) must leave every logged number
of a run that does not opt in bit for bit as it was, so that a published run replays. These
tests run four tiny cells (the ``tiny`` fixture: SFT warm start, 3 steps, evaluations at steps
0 and 3) in arms that cover the code paths: fp32 and BF16 compute, the FP8 trainer and
rollout (tensorwise with Calibrated Clipping in its default ``same_batch`` mode and in the
``sampled`` mode at a share of 1/8 with the shadow diagnostics, rowwise with TIS, blockwise,
and MXFP8 with its power-of-two scales and 32-wide blocks, ragged on the mini model's widths),
and compare every value of ``metrics.jsonl`` and ``eval.jsonl`` except ``perf/*`` (wall times)
with ``golden_numerics.json``, exactly; the FP8 cells also check that they ran the native
``fake_quantize`` kernels (``fp8rl.quant.native``) where those are built, and two cells with
8 x 8 rollouts that their rollouts prefilled each prompt once (``shared_prefill.py``).

The numbers depend on the machine's kernels (AVX2 and AVX-512 GEMMs round differently) and on
torch and transformers, so they are stored per fingerprint (:func:`fingerprint`); on a machine
with no recorded numbers the tests skip and say how to record them. Record them from a commit
whose numbers are right (before the change under test), never from the change itself::

    FP8RL_RECORD_GOLDEN=1 PYTHONPATH=$PWD python -m pytest -q tests/mini/test_mini_golden.py

(recording writes this machine's entry and keeps the others).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("golden_numerics.json")

#: cell name -> (arm, clip arm, clip options)
CELLS = {
    "fp32-vanilla": ("fp32", "vanilla", {}),
    "bf16-vanilla": ("bf16", "vanilla", {}),
    "tensorwise-calibrated-same_batch": ("tensorwise", "calibrated", {"calibration_mode": "same_batch"}),
    "rowwise-tis": ("rowwise", "tis", {}),
    "blockwise-vanilla": ("blockwise", "vanilla", {}),
    "mxfp8-calibrated-same_batch": ("mxfp8", "calibrated", {"calibration_mode": "same_batch"}),
    "tensorwise-calibrated-sampled": ("tensorwise", "calibrated", {"calibration_mode": "sampled",
                                                                   "sample_fraction": 0.125,
                                                                   "shadow_diagnostics": True}),
    # 8 prompts x 8 samples: 64-row rollouts, whose 8 distinct prompts are prefilled once
    # (shared_prefill.py; the cells above have 16 rows, too few to share)
    "bf16-vanilla-64rows": ("bf16", "vanilla", {}),
    "rowwise-tis-64rows": ("rowwise", "tis", {}),
}
#: cells with more than the tiny fixture's 4 x 4 rollout rows (their run settings)
WIDE = {"bf16-vanilla-64rows", "rowwise-tis-64rows"}


def fingerprint() -> str:
    """What the numbers depend on besides the code: torch's CPU kernel level, torch and
    transformers versions."""
    import torch
    import transformers

    return f"torch {torch.__version__} / {torch.backends.cpu.get_cpu_capability()} / transformers {transformers.__version__}"


def _canon(value):
    """JSON-comparable: NaN as a string (NaN != NaN), everything else as logged."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def cell_numbers(cfg) -> dict:
    """Run ``cfg`` and return its logged numbers without ``perf/*``."""
    from fp8rl.backends.mini import run_mini
    from fp8rl.runs import RunDir

    summary = run_mini(cfg)
    assert summary["state"] == "DONE", summary
    rd = RunDir(summary["run_dir"])

    def strip(rows):
        return [{k: _canon(v) for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    return {"metrics": strip(rd.read_metrics()), "eval": strip(rd.read_eval())}


def make_cell(tiny, name: str):
    arm, clip, opts = CELLS[name]
    wide = {"prompts_per_step": 8, "algorithm": {"n_samples_per_prompt": 8}} if name in WIDE else {}
    return tiny(arm, clip, clip_opts=opts or None, steps=3, eval_every=3, samples_every=0, **wide)


def first_difference(want: dict, got: dict) -> str | None:
    for part in ("metrics", "eval"):
        if len(want[part]) != len(got[part]):
            return f"{part}: {len(got[part])} rows, recorded {len(want[part])}"
        for i, (w, g) in enumerate(zip(want[part], got[part], strict=True)):
            for k in sorted(set(w) | set(g)):
                if w.get(k, "<missing>") != g.get(k, "<missing>"):
                    return f"{part} row {i} (step {w.get('step')}) {k}: got {g.get(k, '<missing>')!r}, " \
                           f"recorded {w.get(k, '<missing>')!r}"
    return None


@pytest.mark.parametrize("name", list(CELLS))
def test_logged_numbers_are_unchanged(tiny, name):
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    fp = fingerprint()
    if os.environ.get("FP8RL_RECORD_GOLDEN") == "1":
        recorded.setdefault(fp, {})[name] = cell_numbers(make_cell(tiny, name))
        GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {name} for {fp}")
    if fp not in recorded or name not in recorded[fp]:
        pytest.skip(f"no golden numbers recorded for this machine ({fp}); record them from a commit known "
                    "to be right: FP8RL_RECORD_GOLDEN=1 PYTHONPATH=$PWD python -m pytest tests/mini/test_mini_golden.py")
    from fp8rl.backends.mini import shared_prefill
    from fp8rl.quant import native

    before = sum(native.calls.values())
    shared_prefill.VERDICTS.clear()  # the cell's own checks of its shared prefills
    got = cell_numbers(make_cell(tiny, name))
    diff = first_difference(recorded[fp][name], got)
    assert diff is None, f"{name}: the logged numbers changed: {diff}"
    if CELLS[name][0] not in ("fp32", "bf16") and native.enabled():  # what computed them
        assert sum(native.calls.values()) > before, f"{name}: the FP8 cell did not run the native kernels"
    if name in WIDE:  # what computed them: its rollouts prefilled each prompt once
        assert True in shared_prefill.VERDICTS.values(), f"{name}: no rollout shared its prefill"


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
