"""The evaluation after training with vLLM's CPU build: the arm's own engine and the BF16 engine.

    PYTHONPATH=<repo> python tests/integration/support/eval_bf16.py RUN_DIR OUT.json

Runs ``fp8rl.backends.openrlhf.evaluate.evaluate_run(RUN_DIR, bf16=True)`` with the real
:func:`~fp8rl.backends.openrlhf.evaluate.vllm_generator` for every engine (as the run's default
would build them on CPU), then asks each engine vLLM built what it holds: its ``quantization``
and the dtypes of its linear layers' weights. Writes ``{"results", "engines": [{"model",
"quantization", "vllm_quantization", "fp8_weights", "bf16_weights"}]}`` for
``tests/integration/test_int_eval_bf16.py``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _dtypes(worker) -> dict[str, str]:
    return {n: str(p.dtype) for n, p in worker.model_runner.model.named_parameters() if n.endswith("proj.weight")}


def main() -> int:
    run_dir, out = sys.argv[1], sys.argv[2]
    from fp8rl.backends.openrlhf.evaluate import evaluate_run, vllm_generator

    built = []

    def engines(model: str, quantization):
        gen = vllm_generator(model, tp=1, chat_template=False, cpu=True, quantization=quantization)
        built.append((model, quantization, gen))
        return gen

    results = evaluate_run(run_dir, bf16=True, engines=engines)
    report = []
    for model, quantization, gen in built:
        llm = gen.state["llm"]
        dtypes = llm.collective_rpc(_dtypes)[0]
        report.append({"model": model, "quantization": quantization,
                       "vllm_quantization": llm.llm_engine.vllm_config.model_config.quantization,
                       "fp8_weights": sum("float8" in d for d in dtypes.values()),
                       "bf16_weights": sum(d == "torch.bfloat16" for d in dtypes.values())})
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"results": results, "engines": report}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
