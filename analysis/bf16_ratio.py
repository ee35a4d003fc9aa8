"""Per arm: a per-run value relative to the block's BF16 arm, with its 95% interval.

The report's "x BF16" numbers (the mechanism table, the half-width criterion of
:mod:`analysis.calibration_match`) are R = mean over the arm's runs / mean over the BF16
reference arm's runs of one per-run value (``actor/clipfrac_neg_low`` averaged over a run's
logged steps). The BF16 reference arm is the block's (same algorithm and model slot)
``bf16`` + ``vanilla``, else its first ``bf16`` arm (:func:`analysis.tabulate.bf16_reference`).

**Pairing.** A run's pairing key is (sweep, seed). When the arm and the BF16 arm hold the same
set of keys, each once, the seeds pair (same seed, same sweep: same warm start and prompts) and
the interval uses the covariance between them; otherwise the two arms are independent samples.
The interval is Fieller's (:mod:`analysis.ratio_ci`: why not the bootstrap, and its coverage);
"n/a (1 seed)" with a single run on either side.
"""

from __future__ import annotations

import pandas as pd

from analysis.arms import select
from analysis.collect import Collection
from analysis.ratio_ci import RatioCI, ratio_ci
from analysis.tabulate import bf16_reference, blocks

Arm = tuple[str, str, str, str]  # (algorithm, model, fp8, clip)


def keyed_values(per_run: pd.DataFrame, coll: Collection, column: str) -> pd.DataFrame:
    """``per_run`` (one row per run with a ``run`` column and ``column``) with ``algorithm,
    model, fp8, clip`` and the pairing ``key`` = (sweep, seed) from ``coll.runs`` added.

    Returns columns ``run, algorithm, model, fp8, clip, key, value``.
    """
    runs = coll.runs[["run", "sweep", "algorithm", "model", "fp8", "clip", "seed"]].astype({"run": str})
    df = per_run[["run", column]].astype({"run": str}).merge(runs, on="run", how="left")
    df["key"] = [(str(s), None if pd.isna(k) else int(k)) for s, k in zip(df["sweep"], df["seed"], strict=True)]
    return df.rename(columns={column: "value"})[["run", "algorithm", "model", "fp8", "clip", "key", "value"]]


def _by_key(df: pd.DataFrame) -> dict:
    """{key: value}; a key seen twice (two runs of one seed in one arm) is made unique per run,
    so that such an arm does not pair."""
    out: dict = {}
    for run, key, v in zip(df["run"], df["key"], df["value"], strict=True):
        out[key if key not in out else (key, run)] = float(v)
    return out


def bf16_ratios(coll: Collection, per_run: pd.DataFrame, column: str) -> dict[Arm, RatioCI]:
    """{(algorithm, model, fp8, clip): RatioCI of ``column`` against the block's BF16 arm} for
    every non-reference arm of every block that has a BF16 arm.

    ``per_run``: one row per run, ``run`` and ``column`` (NaN = the run did not log it, dropped).
    """
    vals = keyed_values(per_run, coll, column)
    out: dict[Arm, RatioCI] = {}
    for algo, model, arms in blocks(coll):
        ref = bf16_reference(arms)
        if ref is None:
            continue
        y = _by_key(select(vals, algo, model, *ref))
        for arm in arms:
            if arm == ref:
                continue
            out[(algo, model, *arm)] = ratio_ci(_by_key(select(vals, algo, model, *arm)), y)
    return out
