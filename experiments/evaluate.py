"""``python -m experiments.evaluate RUN_DIR [--k K] [--bf16 | --no-bf16]``: evaluation of a paper-scale run.

vLLM generation on the run's final checkpoint (``checkpoint/final``) with the arm's rollout
quantization over its evaluation sets (the paper's six by default), k samples per problem,
boxed-answer math-verify grading; avg@k and pass@k go into ``summary.json`` and ``eval.jsonl``
(rows marked ``"source": "final"``). ``--bf16`` (default: the run's ``openrlhf.eval_bf16``) also
scores the base model and the final checkpoint with a BF16 engine (``eval_bf16/`` keys). Needs a
GPU and vLLM (the ``cluster`` extra), or vLLM's CPU build for the CPU job; the scoring and
bookkeeping are ``fp8rl.backends.openrlhf.evaluate`` (tested with fake generators and with vLLM's
CPU build).
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    from fp8rl.backends.openrlhf.evaluate import evaluate_run

    p = argparse.ArgumentParser(
        prog="python -m experiments.evaluate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Evaluation of a paper-scale run: vLLM on checkpoint/final (the arm's rollout quantization)\n"
                    "over its evaluation sets, k samples per problem; avg@k and pass@k into summary.json and\n"
                    "eval.jsonl. --bf16: also a BF16 engine on the base model and checkpoint/final (eval_bf16/).\n"
                    "Needs a GPU and vLLM.",
        epilog="example:\n  python -m experiments.evaluate runs/main_table/grpo-8b-bf16-vanilla-s0-0123abcd --k 16")
    p.add_argument("run_dir", help="a paper-scale run directory")
    p.add_argument("--k", type=int, default=None, help="samples per problem (default: the run's eval_k)")
    p.add_argument("--data-dir", default=None, help="directory of the evaluation JSONL files")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="also score the base model and checkpoint/final with a BF16 engine (eval_bf16/ keys); "
                        "default: the run's openrlhf.eval_bf16")
    args = p.parse_args(argv)
    results = evaluate_run(args.run_dir, k=args.k, data_dir=args.data_dir, bf16=args.bf16)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
