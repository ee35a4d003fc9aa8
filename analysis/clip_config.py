"""The clip settings of a run that the calibration tables need: method, calibration mode, lower
bound estimator.

The calibration mode (``clip.calibration_mode``: ``periodic``, ``pooled``, ``same_batch``,
``sampled``) of a run is its cell's variant value when the sweep varies it (``analysis.collect``
appends varied options to the clip value), else the value in its ``config.yaml``; "" where
neither says. Arms that do not calibrate (vanilla, TIS) show "—": the mode is in their config,
but nothing reads it.

The lower bound's estimator (``clip.lower_estimator``: ``in_sample``, ``unbiased``) is read the
same way; when it is unset (null) the mode's own applies, the rule of
``fp8rl.rl.calibration.schedule.resolve_lower_estimator`` restated here without importing the
trainer's code (it needs torch): ``in_sample`` for ``same_batch`` (whose bounds rule the very
tokens they are computed from), ``unbiased`` for the modes whose bounds rule later or other
tokens. ``tests/analysis/test_analysis_heldout.py`` checks the two agree for every registered
mode.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from analysis.arms import split_clip
from analysis.collect import Collection
from fp8rl.runs.rundir import CONFIG_FILE

MODE_KEY = "clip.calibration_mode"
ESTIMATOR_KEY = "clip.lower_estimator"
#: The mode whose bounds rule only the tokens they are computed from (nothing out of sample).
SAME_BATCH = "same_batch"
#: Shown as the mode of an arm that does not calibrate.
NO_MODE = "—"


def config_clip(run_dir: str) -> dict:
    """The ``clip`` section of a run's ``config.yaml`` ({} when missing or unreadable)."""
    try:
        cfg = yaml.load(Path(run_dir, CONFIG_FILE).read_text(encoding="utf-8"),
                        Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    clip = cfg.get("clip") if isinstance(cfg, dict) else None
    return clip if isinstance(clip, dict) else {}


def _variant(clip: str) -> tuple[str, dict[str, str]]:
    base, text = split_clip(str(clip))
    return base, dict(kv.partition("=")[::2] for kv in text.split() if "=" in kv)


def default_estimator(mode: str) -> str:
    """The lower estimator a calibrated run in ``mode`` uses when ``clip.lower_estimator`` is
    null ("" for an unknown mode)."""
    if not mode:
        return ""
    return "in_sample" if mode == SAME_BATCH else "unbiased"


def run_settings(coll: Collection) -> pd.DataFrame:
    """One row per run: ``run, method`` (vanilla / tis / calibrated ...), ``mode`` (:data:`NO_MODE`
    for a method that does not calibrate, "" when unknown) and ``lower_estimator`` (the one in
    force: configured, else the mode's; "" where unknown or not calibrating)."""
    rows = []
    for run, clip, run_dir in zip(coll.runs["run"], coll.runs["clip"], coll.runs["run_dir"], strict=True):
        if clip is None or (isinstance(clip, float) and clip != clip):
            continue
        base, variant = _variant(str(clip))
        if base != "calibrated":
            rows.append({"run": str(run), "method": base, "mode": NO_MODE, "lower_estimator": ""})
            continue
        cfg = config_clip(str(run_dir)) if isinstance(run_dir, str) and (
            MODE_KEY not in variant or ESTIMATOR_KEY not in variant) else {}
        mode = variant.get(MODE_KEY) or str(cfg.get("calibration_mode") or "")
        est = variant.get(ESTIMATOR_KEY)
        if est in (None, "null", "None"):
            est = cfg.get("lower_estimator")
        est = str(est) if est not in (None, "null", "None") else default_estimator(mode)
        rows.append({"run": str(run), "method": base, "mode": mode, "lower_estimator": est})
    return pd.DataFrame(rows, columns=["run", "method", "mode", "lower_estimator"])


def arm_modes(coll: Collection) -> dict[tuple[str, str, str, str], str]:
    """{(algorithm, model, fp8, clip): calibration mode} for every arm: the arm's variant's
    ``clip.calibration_mode=`` value when the sweep varies it, else the distinct values of its
    runs' ``config.yaml`` joined by "/" ("" when no run sets it); "—" for arms that do not
    calibrate (vanilla, TIS: the mode is in their config but nothing reads it)."""
    out: dict[tuple[str, str, str, str], str] = {}
    runs = coll.runs.dropna(subset=["algorithm", "model"])
    for (algo, model, fp8, clip), g in runs.groupby(["algorithm", "model", "fp8", "clip"], sort=False):
        base, variant = _variant(str(clip))
        if base != "calibrated":
            mode = NO_MODE
        elif MODE_KEY in variant:
            mode = variant[MODE_KEY]
        else:
            modes = sorted({m for m in (str(config_clip(str(d)).get("calibration_mode") or "")
                                        for d in g["run_dir"] if isinstance(d, str)) if m})
            mode = "/".join(modes)
        out[(str(algo), str(model), str(fp8), str(clip))] = mode
    return out
