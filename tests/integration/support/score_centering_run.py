"""Support job of ``test_int_score_centering.py`` (``int_ahead.Job`` kind ``script``): ``OUT PARAMS_JSON``.

1. vLLM 0.29's own types: per-token sample logprobs built by ``vllm.logprobs``'
   ``append_logprobs_for_next_position`` (what the engine's output processor calls, the sampled
   id first, then the top-k with ranks 1..k) into a real ``CompletionOutput``, read by the plugin's
   extraction (``binding.agent.add_topk`` with a real ``SamplingParams(logprobs=k)``).
2. One real Score Centering cell through the launcher: the paper-smoke GRPO BF16 cell (tiny Qwen3,
   vLLM's CPU build, Ray, DeepSpeed, OpenRLHF 0.11.2) on the ``score_centering_tis`` arm, a few
   steps, no evaluation; its run directory is read by the test.

Writes ``OUT/result.pt``: ``{"vllm_types": {...}, "run_dir": str, "launch_s": float}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


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


def launch(out: Path, params: dict) -> Path:
    cmd = [sys.executable, "-m", "experiments.launch", "+sweep=paper_smoke", "scale=paper", "launcher=local",
           "+smoke_cell=grpo_bf16_vanilla", "clip=score_centering_tis", f"clip.score_centering_topk={params['k']}",
           f"clip.tis_cap={params['tis_cap']}", f"steps={params['steps']}", "eval_every=0",
           "openrlhf.final_eval=false", f"output_dir={out / 'runs'}", "sweep_name=sc", "progress=false"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=params.get("timeout_s", 900))
    if res.returncode != 0:
        raise SystemExit(f"launch failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    (run,) = [p for p in (out / "runs" / "sc").iterdir() if (p / "config.yaml").exists()]
    return run


def main() -> None:
    out, params = Path(sys.argv[1]), json.loads(sys.argv[2])
    result = {"vllm_types": vllm_types(int(params["k"]))}
    t = time.monotonic()
    result["run_dir"] = str(launch(out, params))
    result["launch_s"] = time.monotonic() - t
    torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
