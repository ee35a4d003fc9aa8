"""Entropy-surge detection: the rule the diagnostics table and the figures use.

The paper's symptom of full-pipeline FP8 RL is a mid-training *entropy surge*: after the usual
early decrease, the policy entropy climbs to several times its low point and garbled outputs
follow (paper, abstract and Sec. on the motivation). The paper gives no numeric definition;
ours, with every knob a named parameter of :class:`SurgeRule`:

1. Smooth ``actor/entropy`` with an EMA of span ``span`` logged steps
   (``alpha = 2 / (span + 1)``, started at the first finite value; NaN steps are skipped, i.e.
   the EMA carries over them and they can neither start nor break a surge).
2. Ignore steps ``< warmup`` (the early decrease from the SFT start is not a baseline).
3. Running minimum ``m_t`` of the smoothed entropy over steps ``warmup .. t``.
4. A step is *elevated* when ``smoothed_t > k * m_t`` **and** ``smoothed_t - m_t > min_rise``
   (the absolute floor keeps a run whose entropy collapsed to ~0 from "surging" on noise).
5. A surge is at least ``m`` consecutive elevated logged steps (NaN steps skipped); its
   **onset** is the step of the first of them. No such stretch: no surge (None).

Defaults ``k=1.5, m=10, warmup=20, span=5, min_rise=0.05`` (entropy in nats per token) are
our guess [G], sized so that a paper-style surge (entropy 2-3x its floor for hundreds of
steps) is caught within a few steps of its start while seed noise of a few percent is not.
With a clean step change of size ``>= k`` the smoothed curve crosses the threshold on the
first step when ``(1 - alpha) + alpha * jump > k``, so the onset is the step of the change.

**Short runs.** A warm-up of 20 and a streak of 10 steps cannot fire in a run of 20 or 30
steps (the mini default is 20). :meth:`SurgeRule.for_length` scales both to the run length:
``warmup = min(20, n // 4)``, ``m = min(10, max(2, n // 4))`` (20 steps: warm-up 5, streak 5;
80 steps or more: the defaults). ``python -m analysis.report`` uses it with the longest run
of the collection unless ``--surge-warmup`` / ``--surge-m`` are given. ``min_rise`` stays
absolute: at the mini scale's entropy (~0.03 nats) a surge must reach ~0.08 nats, i.e. ~3x,
which is the paper's kind of surge (several-fold), not a 1.5x wobble [G].
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SurgeRule:
    """Parameters of the surge rule (see the module docstring)."""

    k: float = 1.5
    m: int = 10
    warmup: int = 20
    span: float = 5.0
    min_rise: float = 0.05

    def __post_init__(self) -> None:
        if not (self.k > 1.0):
            raise ValueError(f"SurgeRule.k must be > 1 (a rise above the running minimum), got {self.k}")
        if not isinstance(self.m, int) or self.m < 1:
            raise ValueError(f"SurgeRule.m must be an int >= 1 (consecutive steps), got {self.m!r}")
        if self.warmup < 0:
            raise ValueError(f"SurgeRule.warmup must be >= 0 steps, got {self.warmup}")
        if not (self.span >= 1):
            raise ValueError(f"SurgeRule.span must be >= 1 (1 = no smoothing), got {self.span}")
        if self.min_rise < 0:
            raise ValueError(f"SurgeRule.min_rise must be >= 0, got {self.min_rise}")

    @classmethod
    def for_length(cls, n_steps: int, **overrides) -> SurgeRule:
        """The default rule with warm-up and streak scaled to runs of ``n_steps`` logged steps
        (module docstring, "Short runs"); ``overrides`` (e.g. ``k=2.0``, ``m=3``) win."""
        if not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
            raise ValueError(f"n_steps must be an int >= 1 (the run length in steps), got {n_steps!r}")
        n = int(n_steps)
        scaled = dict(warmup=min(cls.warmup, n // 4), m=min(cls.m, max(2, n // 4)))
        return cls(**{**scaled, **{k: v for k, v in overrides.items() if v is not None}})

    def describe(self) -> str:
        """One sentence for reports and captions."""
        return (
            f"entropy surge: EMA-smoothed (span {self.span:g}) entropy above {self.k:g}x its "
            f"running minimum (and more than {self.min_rise:g} nats above it) for at least "
            f"{self.m} consecutive logged steps, after a warm-up of {self.warmup} steps; "
            "the step of the first of them is the onset"
        )


def ema(values: np.ndarray, span: float) -> np.ndarray:
    """EMA with ``alpha = 2/(span+1)`` that skips NaN (carries the last value; NaN before the
    first finite value). ``values`` [T] -> [T]."""
    x = np.asarray(values, dtype=np.float64)
    alpha = 2.0 / (float(span) + 1.0)
    if x.size == 0:
        return x.copy()
    import pandas as pd

    return pd.Series(x).ewm(alpha=alpha, adjust=False, ignore_na=True).mean().to_numpy()


def surge_onset(steps, entropy, rule: SurgeRule = SurgeRule()) -> int | None:
    """Onset step of the first entropy surge of one run, or None.

    Args:
        steps: logged step numbers [T], increasing.
        entropy: ``actor/entropy`` at those steps [T] (NaN allowed).
        rule: the parameters.
    """
    steps = np.asarray(steps)
    e = np.asarray(entropy, dtype=np.float64)
    if steps.shape != e.shape:
        raise ValueError(f"steps {steps.shape} and entropy {e.shape} must have the same shape")
    valid = np.isfinite(e)
    steps, e = steps[valid], e[valid]
    if e.size == 0:
        return None
    s = ema(e, rule.span)
    after = steps >= rule.warmup
    if not after.any():
        return None
    steps, s = steps[after], s[after]
    run_min = np.minimum.accumulate(s)
    elevated = (s > rule.k * run_min) & (s - run_min > rule.min_rise)
    if elevated.sum() < rule.m:
        return None
    # first index i with elevated[i : i + m] all True
    c = np.concatenate([[0], np.cumsum(elevated.astype(np.int64))])
    window = c[rule.m :] - c[: -rule.m]
    hits = np.flatnonzero(window == rule.m)
    return int(steps[hits[0]]) if hits.size else None


def surge_table(steps_df, rule: SurgeRule = SurgeRule(), metric: str = "actor/entropy"):
    """Surge onset per run of a ``Collection.steps`` table: DataFrame ``run, surge_step``."""
    import pandas as pd

    rows = []
    if metric not in steps_df.columns:
        return pd.DataFrame({"run": pd.Series(dtype=str), "surge_step": pd.Series(dtype="Int64")})
    for run, g in steps_df.groupby("run", observed=True, sort=False):
        rows.append((str(run), surge_onset(g["step"].to_numpy(), g[metric].to_numpy(), rule)))
    df = pd.DataFrame(rows, columns=["run", "surge_step"])
    df["surge_step"] = df["surge_step"].astype("Int64")
    return df
