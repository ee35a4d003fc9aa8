"""The tiny mini runs of the tests, and the golden cells, as plain functions (no pytest).

``tiny_config`` builds what the ``tiny`` fixture hands to tests; ``CELLS`` are the golden cells
(``test_mini_golden_proc.py``) and ``cell_numbers`` runs one and returns its logged numbers without wall
times. Run as a script, it runs golden cells in this fresh process and writes their numbers and this
machine's numerics fingerprint as JSON: the golden tests' determinism check and the numerics-factor
experiment (``python -m experiments.numerics --factors``) start it::

    python tests/mini/tiny_cells.py --cache DIR --runs DIR --out FILE [--threads N] [CELL ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fp8rl.backends.mini.config import MiniRunConfig, MiniSettings
from fp8rl.config import AlgorithmConfig, ClipConfig, Fp8Config

#: precision arms of the tiny runs: name -> (rollout recipe, trainer recipe)
ARMS = {
    "fp32": ("bf16", "bf16"),
    "bf16": ("bf16", "bf16"),
    "rollout_only": ("tensorwise", "bf16"),
    "tensorwise": ("tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise"),
    "blockwise": ("blockwise", "blockwise"),
    "mxfp8": ("mxfp8", "mxfp8"),
    # FP4 / FP6 (test_mini_native_microscale.py also runs them with the native kernel on and off)
    "mxfp6": ("mxfp6", "mxfp6"),
    "nvfp4": ("nvfp4", "nvfp4"),
}

#: golden cell name -> (arm, clip arm, clip options); they cover fp32 and BF16 compute, the FP8
#: trainer and rollout at every granularity, TIS, Calibrated Clipping in its two shadow modes
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
    # FP4 / FP6: NVIDIA's NVFP4 training recipe (stochastic gradients, wgrad RHT, 16x16 weight
    # tiles) and MXFP6, recorded where the FP4 / FP6 kernel (native.microscaled) did not exist yet
    "nvfp4-calibrated": ("nvfp4", "calibrated", {}),
    "mxfp6-tis": ("mxfp6", "tis", {}),
}
#: cells with more than the tiny fixture's 4 x 4 rollout rows (their run settings)
WIDE = {"bf16-vanilla-64rows", "rowwise-tis-64rows"}


def _clip_opts(arm: str, opts: dict | None) -> dict:
    """The tiny runs calibrate ``periodic``ally every 2 steps, one calibration per bound (window 1,
    not the mini preset's 4: the golden numbers were recorded so), unless ``opts`` names a mode."""
    opts = {"arm": arm, **(opts or {})}
    if opts.get("calibration_mode", "periodic") == "periodic":
        opts = {"calibration_mode": "periodic", "period": 2, "window": 1, **opts}
    return opts


def tiny_config(sft_cache: str | Path, output_dir: str | Path, arm: str = "bf16", clip: str = "vanilla", *,
                algorithm: dict | None = None, clip_opts: dict | None = None, mini: dict | None = None,
                **kw) -> MiniRunConfig:
    """8b slot, 4 prompts x 4 samples, an easy task (2-3 terms, operands <= 9) and a short SFT
    (about 10% accuracy: mixed rewards); ``kw`` overrides run settings."""
    rollout, trainer = ARMS[arm]
    base = dict(steps=5, prompts_per_step=4, num_mini_batches=2, max_response_len=32,
                eval_every=5, eval_k=2, checkpoint_every=0, samples_every=2, lr=1e-3,
                output_dir=str(output_dir))
    base.update(kw)
    return MiniRunConfig(
        algorithm=AlgorithmConfig(**{"n_samples_per_prompt": 4, **(algorithm or {})}),
        fp8=Fp8Config(name=arm, rollout_recipe=rollout, trainer_recipe=trainer, emulate=True,
                      compute_dtype="fp32" if arm == "fp32" else "bf16"),
        clip=ClipConfig(**_clip_opts(clip, clip_opts)),
        mini=MiniSettings(**{"n_train": 200, "n_eval": 4, "sft_steps": 150, "sft_batch_size": 32,
                             "min_terms": 2, "max_terms": 3, "max_operand": 9,
                             "cache_dir": str(sft_cache), "num_threads": 1, **(mini or {})}),
        **base,
    )


def golden_config(sft_cache: str | Path, output_dir: str | Path, name: str, *, threads: int = 1) -> MiniRunConfig:
    """The golden cell ``name``: 3 steps, evaluations at steps 0 and 3, on ``threads`` threads (the
    recorded numbers: one)."""
    arm, clip, opts = CELLS[name]
    wide = {"prompts_per_step": 8, "algorithm": {"n_samples_per_prompt": 8}} if name in WIDE else {}
    return tiny_config(sft_cache, output_dir, arm, clip, clip_opts=opts or None, steps=3, eval_every=3,
                       samples_every=0, mini={"num_threads": threads}, **wide)


def _canon(value):
    """JSON-comparable: NaN as a string (NaN != NaN), everything else as logged."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def cell_numbers(cfg: MiniRunConfig) -> dict:
    """Run ``cfg`` and return its logged numbers without ``perf/*`` (wall times)."""
    from fp8rl.backends.mini import run_mini
    from fp8rl.runs import RunDir

    summary = run_mini(cfg)
    assert summary["state"] == "DONE", summary
    rd = RunDir(summary["run_dir"])

    def strip(rows):
        return [{k: _canon(v) for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    return {"metrics": strip(rd.read_metrics()), "eval": strip(rd.read_eval())}


def first_difference(want: dict, got: dict) -> str | None:
    """The first logged value where ``got`` differs from ``want`` (None when all are equal)."""
    for part in ("metrics", "eval"):
        if len(want[part]) != len(got[part]):
            return f"{part}: {len(got[part])} rows, recorded {len(want[part])}"
        for i, (w, g) in enumerate(zip(want[part], got[part], strict=True)):
            for k in sorted(set(w) | set(g)):
                if w.get(k, "<missing>") != g.get(k, "<missing>"):
                    return f"{part} row {i} (step {w.get('step')}) {k}: got {g.get(k, '<missing>')!r}, " \
                           f"recorded {w.get(k, '<missing>')!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="the SFT warm-start cache directory (shared between runs)")
    p.add_argument("--runs", required=True, help="a fresh directory for the run directories")
    p.add_argument("--out", required=True, help="JSON file: {'fingerprint': ..., 'cells': {name: numbers}}")
    p.add_argument("--threads", type=int, default=1, help="torch threads per cell (recorded numbers: 1)")
    p.add_argument("cells", nargs="*", help=f"golden cells (default: all of {', '.join(CELLS)})")
    a = p.parse_args(argv)
    bad = [c for c in a.cells if c not in CELLS]
    if bad:
        p.error(f"unknown cell(s) {bad}; choose from {list(CELLS)}")
    from fp8rl.backends.mini.numerics import fingerprint

    cells = {name: cell_numbers(golden_config(a.cache, a.runs, name, threads=a.threads)) for name in (a.cells or CELLS)}
    Path(a.out).write_text(json.dumps({"fingerprint": fingerprint(), "cells": cells}, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
