"""Token layout shared by the SFT phase, the rollout engine and the trainer.

A batch row is ``[left-padded prompt | response, right-padded]``: prompts are left-padded to a
common length ``P`` so that every response starts at column ``P``; position ids count real
tokens only (``cumsum(attention_mask) - 1``), so a row's logits do not depend on how much
padding it got. The logits at columns ``P-1 .. P+T-2`` predict the response tokens
``0 .. T-1``. The response mask covers the generated tokens up to and including ``<eos>``.

Temperature convention (as in verl/OpenRLHF): the policy at temperature ``tau`` is
``softmax(logits / tau)``; the rollout engine samples from it and reports the log-prob of the
sampled token under it, and the trainer's log-probs (old, current, shadow) use the same ``tau``.
"""

from __future__ import annotations

import torch


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ``seqs`` -> ``(ids [B, P], mask [B, P])`` with ``P = max len``."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("left_pad needs a non-empty list of non-empty sequences")
    p = max(len(s) for s in seqs)
    # built as Python lists, one tensor each (not a tensor per row)
    ids = torch.tensor([[pad_id] * (p - len(s)) + list(s) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (p - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``seqs`` -> ``(ids [B, T], mask [B, T])``; ``T = length`` or the max len."""
    t = max((len(s) for s in seqs), default=0) if length is None else length
    cut = [list(s[:t]) for s in seqs]
    ids = torch.tensor([s + [pad_id] * (t - len(s)) for s in cut], dtype=torch.long).view(len(seqs), t)
    mask = torch.tensor([[1] * len(s) + [0] * (t - len(s)) for s in cut], dtype=torch.long).view(len(seqs), t)
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions counting real tokens only (padding gets 0)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def response_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Logits ``[B, T, V]`` that predict each response token (full forward, no cache).

    The forward is ``qwen3.LeanQwen3``: the numbers of ``model(input_ids=..., attention_mask=...,
    position_ids=...)``, bit for bit, with less per-call overhead.

    Args:
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        response_ids, response_mask: ``[B, T]`` right-padded responses.
        dtype: the compute dtype (``qwen3.LeanQwen3``); the logits come out in it.
    """
    from fp8rl.backends.mini.qwen3 import LeanQwen3, causal_bias

    ids = torch.cat([prompt_ids, response_ids], dim=1)
    # padding after <eos> is attended by no real token that matters (causal), but keep it
    # masked so the layout equals the rollout engine's
    mask = torch.cat([prompt_mask, torch.ones_like(response_mask)], dim=1)
    lean = LeanQwen3(model, model.config.max_position_embeddings, dtype=dtype)
    logits = lean(ids, causal_bias(mask, dtype), position_ids(mask))
    p = prompt_ids.shape[1]
    return logits[:, p - 1 : -1, :]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / temperature)[tokens]``: ``[B, T, V], [B, T] -> [B, T]`` (fp32)."""
    z = logits.float()
    if temperature != 1.0:  # x / 1.0 == x, and its gradient likewise: skip the no-op division
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
