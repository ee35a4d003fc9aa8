"""A rollout batch with its rewards, and how batches are selected and concatenated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8rl.backends.mini.rollout import RolloutBatch
from fp8rl.backends.mini.task import Problem


@dataclass
class ScoredBatch:
    """A rollout batch with rewards: ``N`` responses in groups of ``n_samples_per_prompt``.

    Tensors are ``[N, P]`` (prompts), ``[N, T]`` (responses) or ``[N]``.
    """

    rollout: RolloutBatch
    problems: list[Problem]
    texts: list[str]
    rewards: torch.Tensor
    correct: torch.Tensor
    garbled: torch.Tensor
    group_ids: torch.Tensor

    def __len__(self) -> int:
        return len(self.problems)

    def select(self, idx: torch.Tensor) -> ScoredBatch:
        r = self.rollout
        i = idx.tolist()
        return ScoredBatch(
            rollout=RolloutBatch(r.prompt_ids[idx], r.prompt_mask[idx], r.response_ids[idx],
                                 r.response_mask[idx], r.rollout_log_probs[idx], r.truncated[idx],
                                 None if r.topk_ids is None else r.topk_ids[idx],
                                 None if r.topk_logprobs is None else r.topk_logprobs[idx]),
            problems=[self.problems[j] for j in i], texts=[self.texts[j] for j in i],
            rewards=self.rewards[idx], correct=self.correct[idx], garbled=self.garbled[idx],
            group_ids=self.group_ids[idx])


def concat_batches(batches: list[ScoredBatch], pad_id: int) -> ScoredBatch:
    """Concatenate scored batches, re-padding prompts (left) and responses (right)."""
    if len(batches) == 1:
        return batches[0]
    p = max(b.rollout.prompt_ids.shape[1] for b in batches)
    t = max(b.rollout.response_ids.shape[1] for b in batches)

    def lpad(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    def rpad(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    rb = RolloutBatch(
        prompt_ids=torch.cat([lpad(b.rollout.prompt_ids, p, pad_id) for b in batches]),
        prompt_mask=torch.cat([lpad(b.rollout.prompt_mask, p, 0) for b in batches]),
        response_ids=torch.cat([rpad(b.rollout.response_ids, t, pad_id) for b in batches]),
        response_mask=torch.cat([rpad(b.rollout.response_mask, t, 0) for b in batches]),
        rollout_log_probs=torch.cat([rpad(b.rollout.rollout_log_probs, t, 0.0) for b in batches]),
        truncated=torch.cat([b.rollout.truncated for b in batches]),
        **_concat_topk([b.rollout for b in batches], t),
    )
    return ScoredBatch(
        rollout=rb, problems=[q for b in batches for q in b.problems],
        texts=[s for b in batches for s in b.texts],
        rewards=torch.cat([b.rewards for b in batches]), correct=torch.cat([b.correct for b in batches]),
        garbled=torch.cat([b.garbled for b in batches]), group_ids=torch.cat([b.group_ids for b in batches]))


def _concat_topk(rbs: list[RolloutBatch], t: int) -> dict:
    """``topk_ids`` / ``topk_logprobs`` of the concatenation, right-padded to ``t`` positions as the
    engine pads a finished row (ids ``0..k-1``, log-probs 0); None where no batch has them."""
    if all(r.topk_ids is None for r in rbs):
        return {}
    if any(r.topk_ids is None for r in rbs):
        raise ValueError("concatenating rollout batches with and without top-k log-probs")

    def rpad(x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, fill.expand(x.shape[0], t - x.shape[1], -1).to(x.dtype)], dim=1)

    k = rbs[0].topk_ids.shape[-1]
    ids = torch.arange(k, device=rbs[0].topk_ids.device)
    return {"topk_ids": torch.cat([rpad(r.topk_ids, ids) for r in rbs]),
            "topk_logprobs": torch.cat([rpad(r.topk_logprobs, torch.zeros_like(ids, dtype=torch.float32))
                                        for r in rbs])}
