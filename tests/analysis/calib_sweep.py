"""A fabricated sweep with the counts behind the clip fraction, the held-out counts and grad_cos
(``fp8rl.runs.synthetic``), and a reader that gets the numbers back with ``json.loads`` line by
line (no analysis code), for the tests of analysis.counts, analysis.heldout and
analysis.calibration_report.

GRPO 8b, seeds 0-3, 41 steps (diagnostic steps 0, 20, 40). Per arm (fp8, clip, mode): the planted
clip fraction, A<0 tokens per step, own-shadow clipped tokens per diagnostic step, held-out
FP8 / BF16 ratio and grad_cos. FP8 arms make 10% more A<0 tokens than BF16, so the count ratio is
1.1x the fraction's. A 14b block of runs from before the new keys (one seed per arm, no counts):
every new number there is n/a.
"""

import json
from pathlib import Path

import yaml

from fp8rl.runs.synthetic import RunSpec, make_sweep

STEPS = 41
SEEDS = range(4)
# (fp8, clip, mode): (clipfrac_neg_low, n_neg, shadow_tokens, heldout_ratio, grad_cos)
ARMS = {
    ("bf16", "vanilla", None): (0.002, 1000.0, 40.0, 1.0, 0.999),
    ("tensorwise", "vanilla", None): (0.020, 1100.0, 44.0, 6.0, 0.90),
    ("tensorwise", "tis", None): (0.018, 1100.0, 46.0, 5.0, 0.92),
    ("tensorwise", "calibrated", "same_batch"): (0.0022, 1100.0, 45.0, 1.3, 0.97),
    ("tensorwise", "calibrated", "periodic"): (0.0025, 1100.0, 43.0, 1.1, 0.95),
}


def specs() -> list[RunSpec]:
    out = []
    for (fp8, clip, mode), (cf, n_neg, shadow, ratio, cos) in ARMS.items():
        for seed in SEEDS:
            out.append(RunSpec(fp8=fp8, clip=clip, seed=seed, steps=STEPS, clipfrac_neg_low=cf, n_neg=n_neg,
                               shadow_counts=True, shadow_tokens=shadow, heldout_ratio=ratio, grad_cos=cos,
                               calibration_mode=mode))
    for fp8, clip in (("bf16", "vanilla"), ("tensorwise", "vanilla"), ("tensorwise", "calibrated")):
        out.append(RunSpec(model="14b", fp8=fp8, clip=clip, seed=0, steps=STEPS))
    return out


def write(path: Path) -> Path:
    make_sweep(path, specs(), sweep="heldout")
    return path


def runs_by_loop(sweep: Path) -> dict:
    """{(model, fp8, clip, mode): {seed: [metrics rows]}} read with json.loads line by line; the
    mode is the config's clip.calibration_mode (None where unset)."""
    out: dict = {}
    for d in sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists()):
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        key = (cfg["model"]["name"], cfg["fp8"]["name"], cfg["clip"]["name"], cfg["clip"].get("calibration_mode"))
        out.setdefault(key, {})[cfg["seed"]] = rows
    return out


def per_step_mean(rows, metric) -> float:
    v = [r[metric] for r in rows if r.get(metric) is not None]
    return sum(v) / len(v) if v else float("nan")


def total(rows, metric) -> float:
    return float(sum(r[metric] for r in rows if r.get(metric) is not None))
