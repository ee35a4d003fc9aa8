"""Support job of ``test_int_score_centering.py`` (``int_ahead.Job`` kind ``script``): ``OUT PARAMS_JSON``.

vLLM 0.29's own types, no engine and no launch: per-token sample logprobs built by
``vllm.logprobs``' ``append_logprobs_for_next_position`` (what the engine's output processor
calls: the sampled id first, then the top-k with ranks 1..k) into a real ``CompletionOutput``,
read by the plugin's extraction (``binding.agent.add_topk`` with a real ``SamplingParams(logprobs=k)``).
The whole Score Centering path runs in the smoke job's Score Centering cell (``make paper-smoke``).

Writes ``OUT/result.pt``: ``{"ids", "lps", "want", "sampled", "entries", "logprob_type"}``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch


def vllm_types(k: int) -> dict:
    from vllm import SamplingParams
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.outputs import CompletionOutput

    from fp8rl.backends.openrlhf.plugin.binding.agent import add_topk
    from fp8rl.backends.openrlhf.plugin.score_centering import RESPONSE_KEY

    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.randn(8, 50, generator=g) * 3, -1)
    sampled = [int(r.argmax()) if t % 2 == 0 else int(r.argmin()) for t, r in enumerate(logq)]
    logprobs = create_sample_logprobs(False)
    for row, s in zip(logq, sampled, strict=True):
        vals, ids = row.topk(k)
        append_logprobs_for_next_position(logprobs, [s, *ids.tolist()], [float(row[s]), *vals.tolist()],
                                          [None] * (k + 1), int((row > row[s]).sum()) + 1, k)
    out = CompletionOutput(index=0, text="", token_ids=sampled, cumulative_logprob=None, logprobs=logprobs)
    resp = add_topk({}, types.SimpleNamespace(outputs=[out]), SamplingParams(logprobs=k), k)
    got_ids, got_lps = resp[RESPONSE_KEY]
    return {"ids": got_ids, "lps": got_lps, "want": logq.topk(k, dim=-1), "sampled": sampled,
            "entries": [len(d) for d in logprobs], "logprob_type": type(next(iter(logprobs[0].values()))).__name__}


def main() -> None:
    out, params = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.save(vllm_types(int(params["k"])), out / "result.pt")


if __name__ == "__main__":
    main()
