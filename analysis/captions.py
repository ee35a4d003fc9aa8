"""What a figure's caption says about the runs behind it (computed from the collection).

:func:`describe_runs` -> ``"Sweep entropy_granularity: GRPO 8b; 12 arms (FP8 settings: BF16,
rollout only, ...; clip methods: TIS, calibrated); 3 seeds per arm (seeds 0-2); trained to step 20;
36 runs (36 finished)."`` Every figure of the report ends its caption with it, so a figure
copied out of the report still says what was run.
"""

from __future__ import annotations

import pandas as pd

from analysis.arms import CLIP_LABELS, FP8_LABELS, arm_order_key, panel_order_key, split_clip
from analysis.collect import CELL_OK, Collection


def _join(items) -> str:
    return ", ".join(items)


def describe_runs(coll: Collection) -> str:
    runs = coll.runs
    if runs.empty:
        return "No runs."
    sweeps = sorted(runs["sweep"].astype(str).unique())
    blocks = sorted({(str(a), str(m)) for a, m in zip(runs["algorithm"], runs["model"], strict=True)},
                    key=lambda p: panel_order_key(*p))
    fp8 = sorted({str(f) for f in runs["fp8"]}, key=lambda f: arm_order_key(f, "vanilla"))
    clips = sorted({split_clip(str(c))[0] for c in runs["clip"]}, key=lambda c: arm_order_key("bf16", c))
    n_variants = len({str(c) for c in runs["clip"]}) - len(clips)
    arms = runs.groupby(["algorithm", "model", "fp8", "clip"], observed=True, dropna=False)
    per_arm = arms.size()
    seeds = sorted(int(s) for s in pd.to_numeric(runs["seed"], errors="coerce").dropna().unique())
    n_seed = (f"{per_arm.min()}" if per_arm.min() == per_arm.max() else f"{per_arm.min()}-{per_arm.max()}")
    seed_txt = (f"{n_seed} seed{'s' if per_arm.max() > 1 else ''} per arm"
                + (f" (seeds {seeds[0]}-{seeds[-1]})" if len(seeds) > 1 else f" (seed {seeds[0]})" if seeds else ""))
    last = pd.to_numeric(runs["last_step"], errors="coerce")
    steps = f"trained to step {int(last.max())}" if last.notna().any() else "no steps logged"
    if last.notna().any() and last.min() != last.max():
        steps = f"trained to step {int(last.min())}-{int(last.max())} (runs differ)"
    arms_txt = (f"{len(per_arm)} arms (FP8 settings: {_join(FP8_LABELS.get(f, f) for f in fp8)}; clip "
                f"methods: {_join(CLIP_LABELS.get(c, c) for c in clips)}"
                + (f"; {n_variants + len(clips)} clip variants" if n_variants > 0 else "") + ")")
    n_ok = int((runs["cell"] == CELL_OK).sum())
    return (f"Sweep {_join(sweeps)}: {_join(f'{a.upper()} {m}' for a, m in blocks)}; {arms_txt}; "
            f"{seed_txt}; {steps}; {len(runs)} runs ({n_ok} finished).")
