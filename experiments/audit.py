"""Noise audit: log-prob mismatch and PPO-ratio noise per FP8 (and FP4/FP6) recipe.

    python -m experiments.audit                                   # tiny random Qwen3, all recipes
    python -m experiments.audit --recipes tensorwise blockwise --sweep-dir runs/main_table
    python -m experiments.audit --recipes tensorwise --out /tmp/noise.csv
    python -m experiments.audit --model path/to/hf_causal_lm --dtype bfloat16 --no-emulate

The table is printed and written as CSV into the sweep directory (``--sweep-dir``, default
``runs/audit``: the audit's own directory under the runs root, like a sweep's) as
``audit.csv``, never into the current directory; ``--out PATH`` writes it elsewhere.

Thin shell over ``fp8rl.quant.audit`` (the method and its choices are documented there).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8rl.quant.audit import DEFAULT_RECIPES, AuditConfig, format_table, run_audit, write_csv

#: Where the CSV goes by default: the audit's own sweep directory under the runs root.
DEFAULT_SWEEP_DIR = "runs/audit"
CSV_NAME = "audit.csv"
EPILOG = """examples:
  python -m experiments.audit                                    # -> runs/audit/audit.csv
  python -m experiments.audit --recipes tensorwise blockwise --sweep-dir runs/main_table
  python -m experiments.audit --model path/to/hf_causal_lm --dtype bfloat16 --no-emulate"""


def parse_args(argv: list[str] | None = None) -> tuple[AuditConfig, str]:
    d = AuditConfig()
    p = argparse.ArgumentParser(prog="python -m experiments.audit", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), help="recipe names (fp8rl.quant.RECIPES: FP8, and FP4/FP6 nvfp4, nvfp4_rn, w4a16, mxfp4, mxfp6)")
    p.add_argument("--model", default=None, help="local Hugging Face causal-LM path (default: tiny random Qwen3)")
    p.add_argument("--num-seqs", type=int, default=d.num_seqs)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--response-len", type=int, default=d.response_len)
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate of the one update step")
    p.add_argument("--clip-low", type=float, default=d.clip_low)
    p.add_argument("--clip-high", type=float, default=d.clip_high)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--init-std", type=float, default=d.init_std, help="init std of the tiny random model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype)
    p.add_argument("--no-emulate", dest="emulate", action="store_false",
                   help="use FP8 kernels (torch._scaled_mm); block/MX recipes then raise on CPU")
    hyb = p.add_mutually_exclusive_group()
    hyb.add_argument("--hybrid", dest="hybrid", action="store_const", const=True, default=None,
                     help="E5M2 gradients in every recipe (only matters for training; kept for run names)")
    hyb.add_argument("--no-hybrid", dest="hybrid", action="store_const", const=False)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--sweep-dir", default=DEFAULT_SWEEP_DIR,
                       help=f"directory the CSV goes to, as SWEEP_DIR/{CSV_NAME} (default: {DEFAULT_SWEEP_DIR})")
    where.add_argument("--out", default=None, help="CSV output path (instead of SWEEP_DIR/audit.csv)")
    a = p.parse_args(argv)
    cfg = AuditConfig(
        recipes=tuple(a.recipes), model=a.model, num_seqs=a.num_seqs, prompt_len=a.prompt_len,
        response_len=a.response_len, lr=a.lr, clip_low=a.clip_low, clip_high=a.clip_high,
        seed=a.seed, init_std=a.init_std, emulate=a.emulate, dtype=a.dtype, hybrid=a.hybrid,
    )
    return cfg, a.out or str(Path(a.sweep_dir) / CSV_NAME)


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    rows = run_audit(cfg)
    print(format_table(rows))
    print(f"wrote {write_csv(rows, out, cfg)}")


if __name__ == "__main__":
    main()
