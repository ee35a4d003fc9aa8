"""What Score Centering costs at the paper's shapes: carrying the sampler's top-k, and the trainer's side.

Score Centering at paper scale (``fp8rl.backends.openrlhf.plugin.score_centering``) carries, per
response token, the sampler's k top ids and their k log-probs from the vLLM engines through
OpenRLHF's experiences and replay buffer to the loss, and the trainer gathers its own k log-probs
at those ids from the logits and computes the term. Two comparisons, each against a baseline
measured in the same run:

**bytes per step** (exact, from the dtypes): the top-k payload (k ids as int32 -- what the plugin
carries -- or int64, + k float32 log-probs) against the per-token payload an OpenRLHF 0.11.2 GRPO
experience already carries on its step fields (``sequences``, ``attention_mask``, ``action_mask``:
int64 as upstream builds them; ``action_log_probs``, ``rollout_log_probs``, ``advantages``,
``returns``, ``kl``: float32), per response token (prompt tokens are extra for both, and the top-k
rows of prompt positions are zeros: counted, as the plugin carries them). The step has
``prompts_per_step x n_samples_per_prompt`` responses of up to ``max_response_len`` tokens
(sweeps/scale/paper.yaml, sweeps/algorithm/*.yaml, sweeps/backend/openrlhf.yaml).

**trainer compute** (measured on CPU on a slice of ``--tokens`` response tokens at the Qwen3
vocabulary, 151,936, float32 logits as OpenRLHF's ``Actor.forward`` makes them; scaled to the step
by token count): the baseline is upstream's per-token log-prob of the taken token over the full
vocabulary -- ``log_probs_from_logits``' CPU path, a logsumexp over V and a gather -- forward and
backward; Score Centering adds ``trainer_logp_at_topk`` (k + 1 gathers from the same logits, the
logsumexp recovered from the action log-probs), ``score_centering_term`` (tis mode, cap 2) and
``A * C``, forward and backward (its backward scatters into a dense logits-shaped gradient, the
same size as the baseline's). Printed: median times over ``--repeats`` (interleaved, one warm-up),
their ratio, and the step's seconds at that rate. The CPU rate is not a GPU's; the ratio is the
number to read.

    .venv/bin/python benchmarks/bench_score_centering_carry.py [--k 8] [--tokens 512] [--repeats 7] \\
        [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from fp8rl.backends.openrlhf.plugin.score_centering import trainer_logp_at_topk
from fp8rl.rl.score_centering import score_centering_loss_mat, score_centering_term

VOCAB = 151_936  # Qwen3
#: The paper cells' step: prompts_per_step x n_samples_per_prompt responses, response caps per algorithm.
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT = 128, 8
RESPONSE_CAP = {"grpo": 16_384, "dapo": 20_480}
#: Bytes per token of an OpenRLHF 0.11.2 GRPO experience's step fields, by dtype as upstream builds them.
UPSTREAM_FIELDS = {"sequences": torch.int64, "attention_mask": torch.int64, "action_mask": torch.int64,
                   "action_log_probs": torch.float32, "rollout_log_probs": torch.float32,
                   "advantages": torch.float32, "returns": torch.float32, "kl": torch.float32}


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_table(k: int) -> None:
    base = sum(_size(d) for d in UPSTREAM_FIELDS.values())
    sc32 = k * (_size(torch.int32) + _size(torch.float32))
    sc64 = k * (_size(torch.int64) + _size(torch.float32))
    print(f"per response token: upstream step fields {base} B ({', '.join(UPSTREAM_FIELDS)}); top-k k={k}: "
          f"{sc32} B with int32 ids (x{sc32 / base:.2f}), {sc64} B with int64 ids (x{sc64 / base:.2f})")
    n_resp = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    for algo, cap in RESPONSE_CAP.items():
        tokens = n_resp * cap
        print(f"  {algo}: {n_resp} responses x {cap} tokens (the cap; an upper bound) = {tokens / 1e6:.1f}M tokens: "
              f"upstream {tokens * base / 2**30:.2f} GiB, top-k {tokens * sc32 / 2**30:.2f} GiB (int32) / "
              f"{tokens * sc64 / 2**30:.2f} GiB (int64) per step")


def _times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def compute(k: int, tokens: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    S = tokens + 1  # one sequence row: logits row i predicts token i + 1
    logits = (torch.randn(1, S, VOCAB, generator=g) * 2).requires_grad_(True)
    seqs = torch.randint(0, VOCAB, (1, S), generator=g)
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:k] for _ in range(tokens)]).unsqueeze(0)
    sampler = torch.log_softmax(torch.randn(1, tokens, k, generator=g), -1) - 2.0  # head mass ~ e^-2
    adv = torch.randn(1, tokens, generator=g)
    mask = torch.ones(1, tokens, dtype=torch.bool)

    def action_log_probs():  # upstream's CPU path: gather - logsumexp over V (log_probs_from_logits)
        z = logits[:, :-1]
        return z.gather(-1, seqs[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)

    def baseline():
        logits.grad = None
        (action_log_probs() * adv).sum().backward()

    def with_sc():  # the baseline, plus Score Centering on the same logits
        logits.grad = None
        alp = action_log_probs()
        lp = trainer_logp_at_topk(logits, alp, seqs, ids)
        term = score_centering_term(lp, sampler, "tis", bounds=(0.0, 2.0), mask=mask)
        ((alp * adv).sum() + score_centering_loss_mat(term, adv, mask).sum()).backward()

    for f in (baseline, with_sc):  # warm-up
        f()
    base_t, sc_t = [], []
    for _ in range(repeats):  # interleaved: load from other processes hits both alike
        base_t += _times(baseline, 1)
        sc_t += _times(with_sc, 1)
    b, s = statistics.median(base_t), statistics.median(sc_t)
    ratios = [y / x - 1.0 for x, y in zip(base_t, sc_t, strict=True)]
    print(f"trainer compute on {tokens} tokens x V={VOCAB} (float32 logits, fwd+bwd, CPU, "
          f"{torch.get_num_threads()} thread(s)): baseline log-prob {b * 1e3:.1f} ms, with Score Centering "
          f"{s * 1e3:.1f} ms; Score Centering's extra = {statistics.median(ratios):.3f} x the baseline "
          f"(median of {repeats} paired repeats)")
    n_resp = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    for algo, cap in RESPONSE_CAP.items():
        scale = n_resp * cap / tokens
        print(f"  {algo} step at the cap ({n_resp * cap / 1e6:.1f}M tokens), at this CPU rate: baseline "
              f"{b * scale / 3600:.1f} h, Score Centering extra {(s - b) * scale / 3600:.2f} h")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8, help="top-k (clip.score_centering_topk; default 8)")
    ap.add_argument("--tokens", type=int, default=512, help="response tokens in the measured slice")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {os.cpu_count()} CPU(s)")
    bytes_table(a.k)
    compute(a.k, a.tokens, a.repeats)


if __name__ == "__main__":
    main()
