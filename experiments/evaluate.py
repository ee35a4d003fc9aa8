"""``python -m experiments.evaluate RUN_DIR [--k K]``: final evaluation of a paper-scale run.

vLLM generation on the run's final checkpoint (``checkpoint/final``) over its evaluation sets
(AIME 2024/2025, AMC 2023, MATH-500 by default), k samples per problem, boxed-answer
math-verify grading; avg@k and pass@k go into ``summary.json`` and ``eval.jsonl`` (rows marked
``"source": "final"``). Needs a GPU and vLLM (the ``cluster`` extra); the scoring and
bookkeeping are ``fp8rl.backends.openrlhf.evaluate`` (tested on CPU with a fake generator).
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    from fp8rl.backends.openrlhf.evaluate import evaluate_run

    p = argparse.ArgumentParser(
        prog="python -m experiments.evaluate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Final evaluation of a paper-scale run: vLLM on checkpoint/final over its evaluation sets,\n"
                    "k samples per problem; avg@k and pass@k into summary.json and eval.jsonl. Needs a GPU and vLLM.",
        epilog="example:\n  python -m experiments.evaluate runs/main_table/grpo-8b-bf16-vanilla-s0-0123abcd --k 16")
    p.add_argument("run_dir", help="a paper-scale run directory")
    p.add_argument("--k", type=int, default=None, help="samples per problem (default: the run's eval_k)")
    p.add_argument("--data-dir", default=None, help="directory of the evaluation JSONL files")
    args = p.parse_args(argv)
    results = evaluate_run(args.run_dir, k=args.k, data_dir=args.data_dir)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
