"""A fresh vLLM engine (the CPU build) on a saved checkpoint: greedy responses and weight digests.

    python tests/integration/support/fresh_engine.py MODEL_DIR QUANTIZATION_JSON OUT.json [MAX_NUM_SEQS] < prompts.json

``QUANTIZATION_JSON`` is ``null`` (BF16) or a vLLM online FP8 shorthand (``"fp8_per_tensor"``...),
as the plugin injects it into OpenRLHF's engines. Writes ``{"responses": {prompt: text},
"digest": {param: sha256[:16]}, "probe": {layer: sha256[:16]}}``: computed by the same function
the plugin's worker extension logs after every weight sync (``binding.vllm_worker.engine_weights``),
so a test can compare the engine that trained with one built from scratch on the same weights
(the probes also where vLLM's CPU build packed a BF16 weight into its GEMM kernel).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    model, quant, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    max_num_seqs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None  # as the job's engines ran
    prompts = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams

    from fp8rl.backends.openrlhf.plugin.binding.vllm_worker import engine_weights

    kw = {"quantization": quant} if quant else {}
    if max_num_seqs is not None:
        kw["max_num_seqs"] = max_num_seqs
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, skip_special_tokens=False))
    responses = {p: o.outputs[0].text for p, o in zip(prompts, outs, strict=True)}

    def weights(worker):
        return engine_weights(worker.model_runner.model, worker.vllm_config)

    w = llm.collective_rpc(weights)[0]
    result = {"responses": responses, "digest": w["digest"], "probe": w["probe"]}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
