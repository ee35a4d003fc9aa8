"""Per-step bookkeeping of the mini trainer: mini-batch results -> the step's metrics,
optimizer groups, and the brief history rows the summary reads."""

from __future__ import annotations

import math

import torch

from fp8rl.backends.mini.config import MiniRunConfig
from fp8rl.runs import metrics as M


def to_float(x: object) -> float:
    return float(x.detach().float()) if isinstance(x, torch.Tensor) else float(x)  # type: ignore[arg-type]


class UpdateStats:
    """Accumulates mini-batch results into the step's actor/ metrics (exact clip fractions from
    summed counts; ratio quantiles over all mini-batches' tokens)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.skipped = 0

    def add(self, res: dict) -> None:
        self.items.append(res)
        self.skipped += res["skipped"]

    def result(self) -> dict:
        from fp8rl.rl.diagnostics import (
            fractions_from_counts,
            neg_counts,
            ratio_dev_sums,
            ratio_quantiles,
            ratio_std_from_sums,
        )

        if not self.items:
            return {}
        counts = {k: sum(r["counts"][k] for r in self.items) for k in self.items[0]["counts"]}
        out = {k: to_float(v) for k, v in fractions_from_counts(counts).items()}
        out.update({k: to_float(v) for k, v in neg_counts(counts).items()})
        t = max(r["ratio"].shape[1] for r in self.items)

        def cat(key: str) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(r[key].float(), (0, t - r[key].shape[1])) for r in self.items])

        out.update({k: to_float(v) for k, v in ratio_quantiles(cat("ratio"), cat("adv"), cat("mask")).items()})
        out.update({k: to_float(v) for k, v in ratio_std_from_sums(ratio_dev_sums(cat("ratio"), cat("mask"))).items()})
        good = [r for r in self.items if not r["skipped"]]

        def mean(key: str) -> float:
            vals = [r[key] for r in good]
            return sum(vals) / len(vals) if vals else float("nan")

        out.update({M.ACTOR_PG_LOSS: mean("pg_loss"), M.ACTOR_GRAD_NORM: mean("grad_norm"),
                    M.ACTOR_PPO_KL: mean("ppo_kl")})
        # diagnostic steps: the trained gradient against BF16's (shadow.reference_grad_cos); a
        # mini-batch without gradient (every A = 0) has no direction and is left out
        cos = [r["grad_cos"] for r in good if r.get("grad_cos") is not None and math.isfinite(r["grad_cos"])]
        if cos:
            out[M.SHADOW_GRAD_COS] = sum(cos) / len(cos)
        ho = [r["ho_grad_cos"] for r in good if r.get("ho_grad_cos") is not None and math.isfinite(r["ho_grad_cos"])]
        if ho:  # the held-out rows alone (shadow.holdout_grad_cos)
            out[M.SHADOW_HO_GRAD_COS] = sum(ho) / len(ho)
        return out


def param_groups(model: torch.nn.Module, cfg: MiniRunConfig) -> list[dict]:
    """AdamW groups: the body at ``lr``, the LM head at ``lr_lm_head`` and the final norm's scale
    at ``lr_final_norm`` (each ``None`` = ``lr``); groups named for the metrics."""
    special = {"lm_head.weight": ("lm_head", cfg.lr_lm_head), "model.norm.weight": ("final_norm", cfg.lr_final_norm)}
    groups: dict[str, dict] = {}
    for name, p in model.named_parameters():
        group, lr = special.get(name, ("body", None))
        g = groups.setdefault(group, {"name": group, "params": [], "lr": cfg.lr if lr is None else lr})
        g["params"].append(p)
    return list(groups.values())


def brief(row: dict) -> dict:
    keep = (M.STEP, M.ROLLOUT_ACC, M.ROLLOUT_GARBLED_FRAC, M.ACTOR_ENTROPY, M.ACTOR_CLIPFRAC_NEG_LOW,
            M.ROLLOUT_MISMATCH_KL, M.PERF_STEP_S)
    return {k: row[k] for k in keep if k in row}


def progress_bar(it, enabled: bool, **kw):
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, desc="mini", dynamic_ncols=True, **kw)


def run_summary(history: list[dict], *, steps: int, wall_s: float, state: str, reason: str | None,
                skipped_updates: int, sft_meta: dict) -> dict:
    """The numbers tables read (``summary.json``): final/best eval, late-training rollout stats,
    clip stats, from the run's brief history (training rows and ``{"eval": row}`` entries)."""
    import math

    from fp8rl.backends.mini.evaluate import DATASET

    train = [h for h in history if "eval" not in h]
    evals = [h["eval"] for h in history if "eval" in h]
    avg, pas = M.eval_key(DATASET, "avg@k"), M.eval_key(DATASET, "pass@k")

    def mean_of(key: str, rows: list[dict]) -> float | None:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return sum(vals) / len(vals) if vals else None

    last = train[-10:]
    out = {
        "state": state, "reason": reason, "steps": steps, "wall_s": wall_s,
        "skipped_updates": skipped_updates,
        avg: evals[-1][avg] if evals else None, pas: evals[-1][pas] if evals else None,
        f"{avg}/initial": evals[0][avg] if evals else None,
        f"{avg}/best": max((e[avg] for e in evals), default=None),
        f"{M.ROLLOUT_ACC}/last10": mean_of(M.ROLLOUT_ACC, last),
        f"{M.ROLLOUT_GARBLED_FRAC}/last10": mean_of(M.ROLLOUT_GARBLED_FRAC, last),
        f"{M.ACTOR_ENTROPY}/last10": mean_of(M.ACTOR_ENTROPY, last),
        f"{M.ACTOR_ENTROPY}/max": max((r[M.ACTOR_ENTROPY] for r in train if M.ACTOR_ENTROPY in r), default=None),
        f"{M.ACTOR_CLIPFRAC_NEG_LOW}/mean": mean_of(M.ACTOR_CLIPFRAC_NEG_LOW, train),
        f"{M.ROLLOUT_MISMATCH_KL}/mean": mean_of(M.ROLLOUT_MISMATCH_KL, train),
        f"{M.PERF_STEP_S}/mean": mean_of(M.PERF_STEP_S, train),
        "sft": {k: v for k, v in sft_meta.items() if k != "path"},
    }
    # the BF16 engine's evaluation of the same weights, as the arm's own above (rows that have it)
    bavg, bpas = (M.eval_key(DATASET, s, precision=M.EVAL_BF16) for s in (M.EVAL_AVG, M.EVAL_PASS))
    # (a run resumed across the change has them from some row on: initial / final are None where absent)
    bf16 = [e[bavg] for e in evals if bavg in e]
    if bf16:
        out.update({bavg: evals[-1].get(bavg), bpas: evals[-1].get(bpas), f"{bavg}/initial": evals[0].get(bavg),
                    f"{bavg}/best": max(bf16)})
    return out
