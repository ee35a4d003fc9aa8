"""Fabricated sweeps with known curves and numbers, for tests, benchmarks and notebook demos.

Nothing here trains: :func:`make_sweep` writes a sweep directory (``manifest.json`` plus one
run directory per cell) through the same writers the backends use (``RunDir``), with curves
whose features are planted on purpose, so analysis can be checked against the numbers written:

- ``actor/entropy`` decays from ``entropy_start`` to ``entropy_floor`` (time constant
  ``steps / 10``) with small seeded noise; with ``surge_at=S`` it jumps to
  ``surge_factor`` times its value at every step ``>= S`` (a clean step, so the onset is S).
- ``actor/clipfrac_neg_low`` is ``clipfrac_neg_low`` (FP8 vanilla arms larger than BF16) and
  grows after a surge; reward/accuracy rise, and fall after a surge; ``rollout/garbled_frac``
  rises after a surge.
- ``clip/low``/``clip/high`` are the vanilla bounds, or for ``clip="calibrated"`` start wide
  (0.6, 1.8) and move towards (0.7, 1.35) at every calibration step (every 20 steps), where
  ``clip/alpha`` and the ``shadow/*`` keys are also logged (sparse metrics).
- the agreement counts (``shadow/{low,high}_{bf16,fp8,both}_n``, which tokens FP8 clips against
  what BF16 would) and their rates are logged where the ``shadow/*`` keys are, or with
  ``shadow_counts=True`` by every arm on every calibration step (``False``: never, an old run):
  per measured step and side, bf16 ~ Poisson(``shadow_tokens``), both ~ Binomial(bf16, recall),
  fp8 = both + Poisson(E[both] (1 / precision - 1)), so pooled over steps recall and precision
  tend to ``low_recall`` / ``low_precision`` (``high_*`` for the upper side).
  ``calibration_mode`` (None: not set) goes into the config as ``clip.calibration_mode`` and
  into the cell's overrides.
- the counts behind the clip fraction, with ``n_neg=N`` (None: not logged, a run from before
  them): every step ``actor/n_neg`` ~ Poisson(N), ``actor/n_neg_low`` ~ Binomial(n_neg, the
  planted fraction), and ``actor/clipfrac_neg_low`` becomes their quotient.
- the held-out calibration error, with ``heldout_ratio=R`` (None: not logged), where the
  agreement counts are: ``heldout_tokens``-Poisson A<0 tokens, of which Binomial(n, 0.05) below
  the BF16 bound and Binomial(n, 0.05 R) below FP8's; logged as ``shadow/oos_*``, or for a
  calibrated ``same_batch`` run as ``shadow/xfit_*`` with ``shadow/oos_*`` all zero (nothing out of
  sample). ``grad_cos=c`` logs ``shadow/grad_cos`` = c + N(0, 0.002) (at most 1) on those steps.
- the held-out rows (``clip.holdout_share``), with ``holdout_ratio=R`` (None: not logged, a run
  from before them), on every step of every arm: ``shadow/ho_n_neg`` ~ Poisson(``holdout_tokens``),
  ``shadow/ho_bf16_low_n`` ~ Binomial(n, 0.05), ``shadow/ho_fp8_low_n`` ~ Binomial(n, 0.05 R), and
  ``shadow/ho_grad_cos`` = ``holdout_grad_cos`` + N(0, ``holdout_cos_noise``) (at most 1); a
  calibrated ``same_batch`` run logs the same counts as its ``shadow/oos_*`` on every step (its
  held-out rows are the only tokens its bounds rule without having seen them, as in the trainer);
  ``alpha_n=a`` logs ``clip/alpha_n`` = a x (1 + N(0, 0.1)) on every step of a calibrated run.
  ``shadow_s`` is the ``perf/shadow_s`` a calibrated run logs on its calibration steps.
- the precision-noise dose, with ``ratio_std=d`` (None: not logged, a run from before it):
  ``actor/ratio_std`` = d x (1 + N(0, 0.05)) on every step (drawn after every other column, so a
  spec without it writes the bytes it wrote before).
- ``eval.jsonl`` holds ``eval_every``-spaced evaluations per dataset whose last value equals
  ``RunSpec.eval[dataset]`` exactly (each value ``final x (0.5 + 0.5 step / last step)``, so the
  gain from step 0 is half the final value); ``RunSpec.eval_bf16`` adds the BF16 engine's keys
  (``eval_bf16/``) to the same rows the same way (empty: a run without them, as before the BF16
  evaluation existed); ``summary.json`` repeats the final numbers (unless ``summary_eval=False``).
- ``state=None`` leaves the cell in the manifest without a directory (a *missing* cell);
  ``truncated_tail=True`` appends half a line to ``metrics.jsonl`` (a writer killed mid-line);
  ``nan_every=n`` logs a non-finite entropy every n steps (written as null).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from fp8rl.runs import metrics as M
from fp8rl.runs.identity import config_hash, run_dir_name, run_name
from fp8rl.runs.manifest import Cell, Manifest, read_manifest, write_manifest
from fp8rl.runs.rundir import DONE, RunDir

CALIBRATION_EVERY = 20


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One fabricated run (see the module docstring for what each field plants)."""

    algorithm: str = "grpo"
    model: str = "8b"
    fp8: str = "bf16"
    clip: str = "vanilla"
    seed: int = 0
    scale: str = "mini"
    steps: int = 100
    state: str | None = DONE
    surge_at: int | None = None
    surge_factor: float = 3.0
    entropy_start: float = 1.0
    entropy_floor: float = 0.4
    noise: float = 0.005
    clipfrac_neg_low: float = 0.002
    eval: Mapping[str, float] = dataclasses.field(default_factory=dict)
    eval_bf16: Mapping[str, float] = dataclasses.field(default_factory=dict)
    eval_k: int = 4
    eval_n: int = 32
    eval_every: int | None = None
    summary_eval: bool = True
    truncated_tail: bool = False
    nan_every: int | None = None
    metrics: tuple[str, ...] = M.TRAIN_METRICS
    shadow_counts: bool | None = None
    shadow_tokens: float = 40.0
    low_recall: float = 0.5
    low_precision: float = 0.5
    high_recall: float = 0.5
    high_precision: float = 0.5
    calibration_mode: str | None = None
    n_neg: float | None = None
    heldout_ratio: float | None = None
    heldout_tokens: float = 400.0
    grad_cos: float | None = None
    holdout_ratio: float | None = None
    holdout_tokens: float = 300.0
    holdout_grad_cos: float = 0.95
    holdout_cos_noise: float = 0.002
    alpha_n: float | None = None
    shadow_s: float = 1.5
    ratio_std: float | None = None

    def name(self) -> str:
        return run_name(self.algorithm, self.model, self.fp8, self.clip, self.seed)

    def config(self) -> dict:
        return {
            "algorithm": {"name": self.algorithm},
            "model": {"name": self.model},
            "fp8": {"name": self.fp8},
            "clip": ({"name": self.clip} if self.calibration_mode is None
                     else {"name": self.clip, "calibration_mode": self.calibration_mode}),
            "scale": {"name": self.scale},
            "seed": self.seed,
            "trainer": {"steps": self.steps},
        }

    def axes(self) -> dict:
        return {
            "algorithm": self.algorithm,
            "model": self.model,
            "fp8": self.fp8,
            "clip": self.clip,
            "seed": self.seed,
            "scale": self.scale,
        }


def entropy_curve(spec: RunSpec, steps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The planted entropy curve of ``spec`` at ``steps`` (noise from ``rng``)."""
    tau = max(spec.steps / 10, 1.0)
    e = spec.entropy_floor + (spec.entropy_start - spec.entropy_floor) * np.exp(-steps / tau)
    e = e * (1.0 + spec.noise * rng.standard_normal(steps.shape))
    if spec.surge_at is not None:
        e = np.where(steps >= spec.surge_at, e * spec.surge_factor, e)
    return e


def _columns(spec: RunSpec, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    s = np.arange(spec.steps, dtype=np.int64)
    sf = s.astype(float)
    after = (s >= spec.surge_at) if spec.surge_at is not None else np.zeros(s.shape, bool)
    u = lambda scale=1.0: scale * rng.standard_normal(s.shape)  # noqa: E731
    prog = 1.0 - np.exp(-sf / max(spec.steps / 5, 1.0))
    acc = 0.2 + 0.5 * prog - np.where(after, 0.3 * (1 - np.exp(-(sf - (spec.surge_at or 0)) / 10)), 0)
    fp8 = spec.fp8 not in ("bf16",)
    full = spec.fp8 not in ("bf16", "rollout_only")
    cnl = spec.clipfrac_neg_low * (1 + np.where(after, 2.0, 0.0)) * (1 + u(0.05))
    eps_low, eps_high = (0.2, 0.28) if spec.algorithm == "dapo" else (0.2, 0.2)
    if spec.clip == "calibrated":
        k = (s // CALIBRATION_EVERY).astype(float)
        low = 0.7 - 0.1 * 0.5**k
        high = 1.35 + 0.45 * 0.5**k
    else:
        low = np.full(s.shape, 1 - eps_low)
        high = np.full(s.shape, 1 + eps_high)
    sigma = 0.1 if full else 0.01
    cols = {
        M.ACTOR_ENTROPY: entropy_curve(spec, sf, rng),
        M.ACTOR_PG_LOSS: u(0.01),
        M.ACTOR_GRAD_NORM: 0.5 + np.abs(u(0.1)) + np.where(after, 1.0, 0.0),
        M.ACTOR_PPO_KL: 1e-3 * (1 + np.abs(u(0.2))),
        M.ACTOR_CLIPFRAC: 3 * cnl,
        M.ACTOR_CLIPFRAC_NEG_LOW: cnl,
        M.ACTOR_CLIPFRAC_NEG_HIGH: 0.5 * cnl,
        M.ACTOR_CLIPFRAC_POS_LOW: 0.5 * cnl,
        M.ACTOR_CLIPFRAC_POS_HIGH: cnl,
        M.ACTOR_RATIO_NEG_Q01: 1 - 2.3 * sigma * (1 + u(0.02)),
        M.ACTOR_RATIO_NEG_Q50: 1 + u(0.001),
        M.ACTOR_RATIO_NEG_Q99: 1 + 2.3 * sigma * (1 + u(0.02)),
        M.CLIP_LOW: low,
        M.CLIP_HIGH: high,
        M.CLIP_ALPHA: np.full(s.shape, 0.002),
        M.SHADOW_CLIPFRAC_NEG_LOW: np.full(s.shape, 0.002),
        M.SHADOW_RATIO_NEG_Q01: 1 - 2.3 * 0.01 * (1 + u(0.02)),
        M.ROLLOUT_MISMATCH_KL: (1e-3 if fp8 else 1e-4) * (1 + np.abs(u(0.1))),
        M.ROLLOUT_IS_CLIPFRAC: (0.01 if fp8 else 0.001) * (1 + np.abs(u(0.1))),
        M.ROLLOUT_REWARD_MEAN: 2 * acc - 1,
        M.ROLLOUT_ACC: acc,
        M.ROLLOUT_RESPONSE_LEN: 200 + 100 * prog + np.where(after, 300.0, 0.0),
        M.ROLLOUT_TRUNCATED_FRAC: np.where(after, 0.2, 0.01),
        M.ROLLOUT_GARBLED_FRAC: np.where(after, 0.3, 0.0),
        M.DAPO_KEPT_GROUP_FRAC: 0.6 + u(0.02),
        M.PERF_STEP_S: 10 + np.abs(u(0.5)),
        M.PERF_ROLLOUT_S: 6 + np.abs(u(0.3)),
        M.PERF_TRAIN_S: 3 + np.abs(u(0.2)),
        M.PERF_SHADOW_S: np.full(s.shape, spec.shadow_s),
        M.PERF_TOKENS_PER_S: 5000 + u(100),
    }
    cols.update(_agreement_columns(spec, len(s), rng))  # drawn last: earlier columns unchanged
    cols.update(_count_columns(spec, cnl, len(s), rng))  # drawn only when asked for: likewise
    cols.update(_holdout_columns(spec, len(s), rng))  # likewise
    if spec.ratio_std is not None:  # likewise
        cols[M.ACTOR_RATIO_STD] = spec.ratio_std * (1.0 + 0.05 * rng.standard_normal(len(s)))
    if spec.nan_every:
        cols[M.ACTOR_ENTROPY] = np.where(s % spec.nan_every == spec.nan_every - 1, np.nan, cols[M.ACTOR_ENTROPY])
    return s, cols


_AGREEMENT: tuple[str, ...] = (
    M.SHADOW_LOW_BF16_N, M.SHADOW_LOW_FP8_N, M.SHADOW_LOW_BOTH_N, M.SHADOW_HIGH_BF16_N, M.SHADOW_HIGH_FP8_N,
    M.SHADOW_HIGH_BOTH_N, M.SHADOW_LOW_RECALL, M.SHADOW_LOW_PRECISION, M.SHADOW_HIGH_RECALL,
    M.SHADOW_HIGH_PRECISION,
)


def _agreement_columns(spec: RunSpec, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The six agreement counts and four rates per step (see the module docstring)."""
    out: dict[str, np.ndarray] = {}
    for side, recall, precision in (("low", spec.low_recall, spec.low_precision),
                                    ("high", spec.high_recall, spec.high_precision)):
        bf16 = rng.poisson(spec.shadow_tokens, n)
        both = rng.binomial(bf16, recall)
        fp8 = both + rng.poisson(spec.shadow_tokens * recall * (1.0 / precision - 1.0), n)
        out[f"shadow/{side}_bf16_n"] = bf16.astype(float)
        out[f"shadow/{side}_fp8_n"] = fp8.astype(float)
        out[f"shadow/{side}_both_n"] = both.astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[f"shadow/{side}_recall"] = np.where(bf16 > 0, both / np.maximum(bf16, 1), np.nan)
            out[f"shadow/{side}_precision"] = np.where(fp8 > 0, both / np.maximum(fp8, 1), np.nan)
    return out


#: Probability that a held-out A<0 token is below the BF16 bound (``heldout_ratio`` scales FP8's).
HELDOUT_P = 0.05


def _count_columns(spec: RunSpec, cnl: np.ndarray, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The counts behind the clip fraction, the held-out counts and grad_cos (module docstring)."""
    out: dict[str, np.ndarray] = {}
    if spec.n_neg is not None:
        neg = rng.poisson(spec.n_neg, n)
        low = rng.binomial(neg, np.clip(cnl, 0.0, 1.0))
        out[M.ACTOR_N_NEG], out[M.ACTOR_N_NEG_LOW] = neg.astype(float), low.astype(float)
        out[M.ACTOR_CLIPFRAC_NEG_LOW] = low / np.maximum(neg, 1)
    if spec.heldout_ratio is not None:
        tokens = rng.poisson(spec.heldout_tokens, n)
        bf16 = rng.binomial(tokens, HELDOUT_P)
        fp8 = rng.binomial(tokens, min(1.0, HELDOUT_P * spec.heldout_ratio))
        xfit = spec.clip == "calibrated" and spec.calibration_mode == "same_batch"
        zero = np.zeros(n)
        oos = (zero, zero, zero) if xfit else (tokens, fp8, bf16)
        for m, v in zip((M.SHADOW_OOS_N_NEG, M.SHADOW_OOS_FP8_LOW_N, M.SHADOW_OOS_BF16_LOW_N), oos, strict=True):
            out[m] = np.asarray(v, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[M.SHADOW_OOS_CLIPFRAC_NEG_LOW] = np.where(oos[0] > 0, oos[1] / np.maximum(oos[0], 1), np.nan)
            out[M.SHADOW_OOS_BF16_CLIPFRAC_NEG_LOW] = np.where(oos[0] > 0, oos[2] / np.maximum(oos[0], 1), np.nan)
        if xfit:
            out[M.SHADOW_XFIT_N_NEG], out[M.SHADOW_XFIT_FP8_LOW_N], out[M.SHADOW_XFIT_BF16_LOW_N] = (
                tokens.astype(float), fp8.astype(float), bf16.astype(float))
    if spec.grad_cos is not None:
        out[M.SHADOW_GRAD_COS] = np.minimum(1.0, spec.grad_cos + 0.002 * rng.standard_normal(n))
    return out


_OOS: tuple[str, ...] = (M.SHADOW_OOS_N_NEG, M.SHADOW_OOS_FP8_LOW_N, M.SHADOW_OOS_BF16_LOW_N,
                         M.SHADOW_OOS_CLIPFRAC_NEG_LOW, M.SHADOW_OOS_BF16_CLIPFRAC_NEG_LOW)
_HOLDOUT: tuple[str, ...] = (M.SHADOW_HO_N_NEG, M.SHADOW_HO_FP8_LOW_N, M.SHADOW_HO_BF16_LOW_N, M.SHADOW_HO_GRAD_COS)


def _holdout_columns(spec: RunSpec, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The held-out rows' counts and cosine, and ``clip/alpha_n`` (module docstring)."""
    out: dict[str, np.ndarray] = {}
    if spec.holdout_ratio is not None:
        tokens = rng.poisson(spec.holdout_tokens, n)
        out[M.SHADOW_HO_N_NEG] = tokens.astype(float)
        out[M.SHADOW_HO_BF16_LOW_N] = rng.binomial(tokens, HELDOUT_P).astype(float)
        out[M.SHADOW_HO_FP8_LOW_N] = rng.binomial(tokens, min(1.0, HELDOUT_P * spec.holdout_ratio)).astype(float)
        out[M.SHADOW_HO_GRAD_COS] = np.minimum(
            1.0, spec.holdout_grad_cos + spec.holdout_cos_noise * rng.standard_normal(n))
        if _holdout_is_oos(spec):  # same_batch: its held-out rows are its only out-of-sample tokens
            oos = (M.SHADOW_OOS_N_NEG, M.SHADOW_OOS_FP8_LOW_N, M.SHADOW_OOS_BF16_LOW_N)
            for o, h in zip(oos, (M.SHADOW_HO_N_NEG, M.SHADOW_HO_FP8_LOW_N, M.SHADOW_HO_BF16_LOW_N), strict=True):
                out[o] = out[h].copy()
            with np.errstate(divide="ignore", invalid="ignore"):
                tok = out[oos[0]]
                out[M.SHADOW_OOS_CLIPFRAC_NEG_LOW] = np.where(tok > 0, out[oos[1]] / np.maximum(tok, 1), np.nan)
                out[M.SHADOW_OOS_BF16_CLIPFRAC_NEG_LOW] = np.where(tok > 0, out[oos[2]] / np.maximum(tok, 1), np.nan)
    if spec.alpha_n is not None:
        out[M.CLIP_ALPHA_N] = spec.alpha_n * (1.0 + 0.1 * rng.standard_normal(n))
    return out


def _holdout_is_oos(spec: RunSpec) -> bool:
    """A calibrated ``same_batch`` run with held-out rows logs them as its out-of-sample counts too
    (on every step, as the trainer does: nothing else it trains on is out of sample)."""
    return spec.holdout_ratio is not None and spec.clip == "calibrated" and spec.calibration_mode == "same_batch"


def _present(spec: RunSpec, metric: str, step: int) -> bool:
    calib = step % CALIBRATION_EVERY == 0
    if metric in _HOLDOUT:
        return spec.holdout_ratio is not None
    if _holdout_is_oos(spec) and metric in _OOS:
        return True
    if metric == M.CLIP_ALPHA_N:
        return spec.clip == "calibrated"
    if metric in _AGREEMENT or metric in M.HELDOUT_METRICS:
        return calib and (spec.clip == "calibrated" if spec.shadow_counts is None else spec.shadow_counts)
    if metric in (M.CLIP_ALPHA, M.SHADOW_CLIPFRAC_NEG_LOW, M.SHADOW_RATIO_NEG_Q01, M.PERF_SHADOW_S):
        return spec.clip == "calibrated" and calib
    if metric == M.DAPO_KEPT_GROUP_FRAC:
        return spec.algorithm == "dapo"
    return True


def metric_rows(spec: RunSpec) -> list[dict]:
    """The ``metrics.jsonl`` rows of ``spec`` (deterministic in the spec)."""
    rng = np.random.default_rng(abs(hash_spec(spec)))
    s, cols = _columns(spec, rng)
    names = [m for m in spec.metrics if m in cols]
    lists = {m: cols[m].tolist() for m in names}
    rows = []
    for i, step in enumerate(s.tolist()):
        row = {M.STEP: step}
        for m in names:
            if _present(spec, m, step):
                row[m] = lists[m][i]
        rows.append(row)
    return rows


def eval_rows(spec: RunSpec) -> list[dict]:
    """The ``eval.jsonl`` rows of ``spec``: the last row per dataset equals ``spec.eval``."""
    if not spec.eval:
        return []
    last = spec.steps - 1
    every = spec.eval_every or max(spec.steps // 4, 1)
    steps = sorted({*range(0, last, every), last})
    rows = []
    for st in steps:
        frac = 0.5 + 0.5 * st / max(last, 1)
        for ds, final in spec.eval.items():
            avg = final if st == last else final * frac
            bf16 = spec.eval_bf16.get(ds)
            if bf16 is not None and st != last:
                bf16 *= frac
            rows.append(
                M.eval_row(st, ds, avg_at_k=avg, pass_at_k=min(1.0, avg + 0.2), k=spec.eval_k, n=spec.eval_n,
                           bf16_avg_at_k=bf16, bf16_pass_at_k=None if bf16 is None else min(1.0, bf16 + 0.2))
            )
    return rows


def hash_spec(spec: RunSpec) -> int:
    """A stable integer seed for a spec's noise (not Python's salted ``hash``)."""
    return int(config_hash(spec.config()), 16)


def write_run(sweep_dir: str | os.PathLike, spec: RunSpec, *, fast: bool = False) -> Cell:
    """Write one fabricated run directory under ``sweep_dir``; returns its manifest cell.

    ``fast=True`` writes ``metrics.jsonl`` in one go (same bytes as the line writer, for the
    benchmark); the default goes through ``RunDir.metrics_writer`` row by row.
    """
    cfg = spec.config()
    h = config_hash(cfg)
    name = spec.name()
    dirname = run_dir_name(name, h)
    cell = Cell(
        name=name,
        hash=h,
        run_dir=dirname,
        axes=spec.axes(),
        overrides=[f"algorithm={spec.algorithm}", f"model={spec.model}", f"fp8={spec.fp8}",
                   f"clip={spec.clip}", f"seed={spec.seed}", f"scale={spec.scale}",
                   *([f"clip.calibration_mode={spec.calibration_mode}"] if spec.calibration_mode else [])],
    )
    if spec.state is None:
        return cell
    run = RunDir(Path(sweep_dir) / dirname).init(cfg, list(cell.overrides))
    rows = metric_rows(spec)
    if fast:
        run.metrics_path.write_text(
            "".join(json.dumps(r, allow_nan=False) + "\n" for r in _nan_to_none(rows)), encoding="utf-8"
        )
    else:
        with run.metrics_writer(fsync=False) as w:  # fabricated: no need to survive a crash
            for r in rows:
                w.write(r)
    with run.eval_writer(fsync=False) as w:
        for r in eval_rows(spec):
            w.write(r)
    if spec.truncated_tail:
        with open(run.metrics_path, "a", encoding="utf-8") as f:
            f.write(f'{{"step": {spec.steps}, "actor/entropy": 0.12')
    last = spec.steps - 1
    reason = {"FAILED": "synthetic failure", "PREEMPTED": "synthetic preemption"}.get(spec.state)
    run.set_status(spec.state, last, reason=reason)
    if spec.state == DONE:
        summary: dict = {"final_step": last}
        if spec.summary_eval:
            for ds, v in spec.eval.items():
                summary[M.eval_key(ds, M.EVAL_AVG)] = v
            for ds, v in spec.eval_bf16.items():
                summary[M.eval_key(ds, M.EVAL_AVG, precision=M.EVAL_BF16)] = v
        run.write_summary(summary)
    return cell


def _nan_to_none(rows: Iterable[dict]) -> Iterable[dict]:
    for r in rows:
        yield {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}


def make_sweep(
    sweep_dir: str | os.PathLike, specs: Sequence[RunSpec], *, sweep: str = "synthetic", fast: bool = False
) -> Manifest:
    """Write a manifest and the runs of ``specs`` into ``sweep_dir``; returns the manifest."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    cells = [write_run(sweep_dir, spec, fast=fast) for spec in specs]
    write_manifest(sweep_dir, sweep, cells)
    return read_manifest(sweep_dir)


#: Paper-like arms (fp8, clip) for :func:`demo_specs`.
DEMO_ARMS: tuple[tuple[str, str], ...] = (
    ("bf16", "vanilla"),
    ("rollout_only", "tis"),
    ("tensorwise", "vanilla"),
    ("tensorwise", "tis"),
    ("tensorwise", "calibrated"),
    ("blockwise", "tis"),
    ("blockwise", "calibrated"),
)
DEMO_DATASETS: tuple[str, ...] = ("aime24", "amc23", "math500")


def demo_specs(steps: int = 200, seeds: Sequence[int] = (0, 1), algorithms: Sequence[str] = ("grpo",),
               models: Sequence[str] = ("8b",)) -> list[RunSpec]:
    """A small paper-like grid: full-FP8 vanilla/TIS arms surge, calibrated and BF16 do not."""
    specs = []
    for algo in algorithms:
        for model in models:
            for fp8, clip in DEMO_ARMS:
                for seed in seeds:
                    full = fp8 not in ("bf16", "rollout_only")
                    surges = full and clip != "calibrated"
                    base = {"aime24": 0.30, "amc23": 0.60, "math500": 0.75}
                    drop = 0.10 if surges else 0.0
                    ev = {ds: round(v - drop + 0.01 * seed, 4) for ds, v in base.items()}
                    specs.append(
                        RunSpec(
                            algorithm=algo, model=model, fp8=fp8, clip=clip, seed=seed,
                            steps=steps,
                            surge_at=(int(steps * (0.5 if fp8 == "tensorwise" else 0.7)) + 5 * seed
                                      if surges else None),
                            clipfrac_neg_low=0.02 if surges else 0.002,
                            eval=ev,
                        )
                    )
    return specs
