"""A fabricated sweep with held-out rows (``fp8rl.runs.synthetic``: ``shadow/ho_*``, ``clip/alpha_n``)
and unseen-token counts (``shadow/oos_*``: every arm shadowed, as ``clip.shadow_diagnostics`` gives;
``same_batch``'s are its held-out rows')
and a reader that gets the numbers back with ``json.loads`` line by line (no analysis code), for
the tests of analysis.heldout_judgement and analysis.heldout_report.

GRPO 8b, seeds 0-3, 21 steps, every step logs the held-out counts. BF16 vanilla, and per FP8
granularity (tensorwise, blockwise) the arms vanilla, TIS, the two controls and Calibrated Clipping
in three modes (the mode a variant of the clip axis, as a sweep that launches each mode gives).
Planted: ``sampled`` is the cheapest and qualifies (unseen ratio 1, grad_cos above the controls');
``windowed`` clips too much on its unseen tokens (1.4); ``same_batch`` qualifies but costs most. The
held-out rows alone say the opposite of the unseen tokens for ``sampled`` (1.3) and ``windowed`` (1.0),
so a judgement that read them instead would pick another default.
"""

import json
from pathlib import Path

import yaml

from fp8rl.runs.synthetic import RunSpec, make_sweep

STEPS = 21
SEEDS = range(4)
GRANULARITIES = ("tensorwise", "blockwise")
MODES = ("same_batch", "sampled", "windowed")
# (clip, mode): (unseen ratio, holdout_grad_cos, alpha_n, shadow_s, held-out rows' ratio)
ARMS = {
    ("vanilla", None): (5.0, 0.90, None, 0.0, 4.0),
    ("tis", None): (4.0, 0.92, None, 0.0, 3.0),
    ("no_lower_clip", None): (0.0, 0.96, None, 0.0, 0.0),
    ("wide_lower", None): (0.3, 0.955, None, 0.0, 0.4),
    ("calibrated", "same_batch"): (1.0, 0.97, 3.0, 1.5, 1.0),  # unseen = its held-out rows
    ("calibrated", "sampled"): (1.0, 0.965, 0.6, 0.3, 1.3),
    ("calibrated", "windowed"): (1.4, 0.97, 3.2, 1.2, 1.0),
}
TOKENS = 1000.0
#: Unseen A<0 tokens per calibration step of the arms whose unseen tokens are not the held-out rows.
UNSEEN_TOKENS = 2000.0


def specs() -> list[RunSpec]:
    out = [RunSpec(fp8="bf16", clip="vanilla", seed=s, steps=STEPS, holdout_ratio=1.0, holdout_tokens=TOKENS,
                   holdout_grad_cos=0.999, heldout_ratio=1.0, heldout_tokens=UNSEEN_TOKENS, shadow_counts=True)
           for s in SEEDS]
    for fp8 in GRANULARITIES:
        for (clip, mode), (ratio, cos, alpha_n, shadow_s, ho_ratio) in ARMS.items():
            unseen = {} if mode == "same_batch" else {"heldout_ratio": ratio, "heldout_tokens": UNSEEN_TOKENS,
                                                      "shadow_counts": True}
            for s in SEEDS:
                out.append(RunSpec(fp8=fp8, clip=clip, seed=s, steps=STEPS, calibration_mode=mode,
                                   holdout_ratio=ho_ratio, holdout_tokens=TOKENS, holdout_grad_cos=cos,
                                   alpha_n=alpha_n, shadow_s=shadow_s, **unseen))
    return out


def write(path: Path) -> Path:
    make_sweep(path, specs(), sweep="holdout", fast=True)
    return path


def runs_by_loop(sweep: Path) -> dict:
    """{(fp8, clip, mode): {seed: [metrics rows]}} read with json.loads line by line."""
    out: dict = {}
    for d in sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists()):
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        key = (cfg["fp8"]["name"], cfg["clip"]["name"], cfg["clip"].get("calibration_mode"))
        out.setdefault(key, {})[cfg["seed"]] = rows
    return out
