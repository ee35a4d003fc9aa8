"""The mini rollout engine: the vLLM of the mini pipeline.

The engine holds **its own copy** of the policy weights. After every policy update the trainer
calls ``sync(trainer_model)``: the engine copies the trainer's high-precision master weights
and re-quantizes them per the rollout recipe (``fp8rl.quant``'s rollout path: FP8 weights and
dynamically quantized activations, W8A8, like vLLM's ``--quantization fp8``), so rollouts are
sampled from the FP8 policy while the trainer keeps its own precision, exactly the
train/inference mismatch of the real pipeline. With the ``bf16`` rollout recipe the copy is
exact.

Sampling is batched autoregressive decoding with a KV cache (``qwen3.LeanQwen3`` with a
preallocated ``KVCache``: transformers' eager Qwen3 maths op for op, bit-identical to
``model(...)`` with a ``DynamicCache``): one prefill over the left-padded prompts, then one
token per step for every row until all rows emitted ``<eos>`` or ``max_new_tokens`` is reached. Sampling uses a caller-owned
``torch.Generator`` (deterministic per seed). The engine returns, per sampled token, its **own**
log-prob ``log softmax(logits / temperature)[token]`` computed from the engine's (FP8) logits;
the trainer uses the same temperature convention (``batch.token_logprobs``). Asked with
``topk=k`` (the training rollouts of a Score Centering arm, ``fp8rl.rl.score_centering``), it
also returns the ``k`` largest entries of the same ``log softmax(logits / temperature)`` per
generated position, ids and log-probs (``RolloutBatch.topk_ids``, ``topk_logprobs``), read off
the distribution the token was drawn from: a read only, so the sampled tokens and the
generator's stream are those of ``topk=0``.

Choices: tokens after ``<eos>`` are ``<pad>`` and outside the response mask; a response with
no ``<eos>`` within the cap is *truncated* (DAPO's overlong shaping reads its length).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fp8rl.backends.mini.batch import position_ids
from fp8rl.backends.mini.live_rows import LiveRows, rows_independent
from fp8rl.quant.recipes import Recipe, get_recipe


@dataclass
class RolloutBatch:
    """Output of one batched generation.

    Attributes:
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts (as given).
        response_ids: ``[B, T]`` sampled tokens, ``<pad>`` after ``<eos>``.
        response_mask: ``[B, T]`` 1 on generated tokens up to and including ``<eos>``.
        rollout_log_probs: ``[B, T]`` the engine's log-probs of the sampled tokens (0 off-mask).
        truncated: ``[B]`` bool, no ``<eos>`` within the cap.
        topk_ids: ``[B, T, k]`` long, the ids of the ``k`` most likely tokens of the distribution
            each response token was drawn from (``topk=k``; None when not asked); off-mask
            ``0..k-1`` (distinct ids, so a padded position is still a valid head).
        topk_logprobs: ``[B, T, k]`` their log-probs, descending along ``k`` (0 off-mask).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    truncated: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)


def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None,
    greedy: bool = False,
    dtype: torch.dtype = torch.float32,
    weights_rounded: bool = False,
    attention: str = "eager",
    compact: bool = True,
    topk: int = 0,
) -> RolloutBatch:
    """Sample responses for left-padded prompts with a KV cache.

    Args:
        prompt_ids, prompt_mask: ``[B, P]``.
        temperature: sampling temperature (> 0); ignored for sampling when ``greedy``.
        generator: the ``torch.Generator`` that drives sampling (on the model's device).
        dtype, weights_rounded, attention: the compute dtype, whether the weights already hold
            its values, and the attention path (``qwen3.LeanQwen3``).
        compact: let finished rows leave the computed batch where no number changes
            (``live_rows``; ``False``: compute every row to the end, as before).
        topk: ``k >= 1``: also return the top-``k`` ids and log-probs per generated position
            (``RolloutBatch.topk_ids``, ``topk_logprobs``); 0: none (the default).
    Returns: ``RolloutBatch`` with ``T <= max_new_tokens`` columns.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = model.config.vocab_size
    if isinstance(topk, bool) or not isinstance(topk, int) or not 0 <= topk <= vocab:
        raise ValueError(f"topk must be an integer in [0, {vocab}] (the vocabulary size; 0: no top-k), "
                         f"got {topk!r}")
    heads: list[tuple[torch.Tensor, torch.Tensor]] = []
    toks, logps, valid, done = _decode(model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                                       temperature=temperature, eos_id=eos_id, pad_id=pad_id,
                                       generator=generator, greedy=greedy, dtype=dtype,
                                       weights_rounded=weights_rounded, attention=attention, compact=compact,
                                       topk=topk, heads=heads)
    # stacked outside inference mode: the trainer gets ordinary tensors
    response_ids = torch.stack(toks, 1)
    response_mask = torch.stack(valid, 1).long()
    topk_ids = topk_logprobs = None
    if topk:
        topk_ids = torch.stack([i for i, _ in heads], 1)  # [B, T, k]
        topk_logprobs = torch.stack([v for _, v in heads], 1)
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, rollout_log_probs=torch.stack(logps, 1),
        truncated=~done, topk_ids=topk_ids, topk_logprobs=topk_logprobs,
    )


@torch.inference_mode()
def _decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
            max_new_tokens: int, temperature: float, eos_id: int, pad_id: int,
            generator: torch.Generator | None, greedy: bool, dtype: torch.dtype = torch.float32,
            weights_rounded: bool = False, attention: str = "eager", compact: bool = False,
            topk: int = 0, heads: list | None = None,
            ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The decode loop of ``generate`` under ``torch.inference_mode`` (no autograd bookkeeping):
    per-step ``[B]`` tokens, log-probs and validity, and the final ``[B]`` done flags. ``topk``
    ``k >= 1``: per step, ``([B, k] ids, [B, k] log-probs)`` of the top-``k`` are appended to
    the list ``heads``.

    The forward is :class:`~fp8rl.backends.mini.qwen3.LeanQwen3` with a preallocated KV cache
    (the same numbers as ``model(...)`` with a ``DynamicCache``, with fewer operations); each
    distinct prompt is prefilled once where that gives the same bits (``shared_prefill``).
    ``compact``: finished rows leave the computed batch where that changes no number
    (``live_rows``).
    """
    import fp8rl.backends.mini.shared_prefill as shared_prefill
    from fp8rl.backends.mini.qwen3 import LeanQwen3, causal_bias, decode_bias

    b, p = prompt_ids.shape
    lean = LeanQwen3(model, model.config.max_position_embeddings, dtype=dtype, weights_rounded=weights_rounded,
                     attention=attention)
    bias = decode_bias(prompt_mask, max_new_tokens, dtype)  # [B, 1, 1, P + max_new]
    # each distinct prompt prefilled once where that gives the same bits (shared_prefill.py)
    full, cache = shared_prefill.prefill(lean, prompt_ids, prompt_mask, p + max_new_tokens,
                                         causal_bias(prompt_mask, dtype), position_ids(prompt_mask))
    next_pos = prompt_mask.sum(-1, keepdim=True)  # [B, 1] position of the first response token
    # the rotary cos/sin of every decode position, gathered once (step i slices column i): the
    # values the step would gather itself; skipped if the last positions fall off the table
    # (then a step that reaches them raises, as before)
    steps_pos = next_pos + torch.arange(max_new_tokens, device=next_pos.device)  # [B, max_new]
    rope = lean.rope(steps_pos) if int(steps_pos.max()) < lean.cos_table.shape[0] else None
    # finished rows leave the computed batch (live_rows.py): sampling keeps reading all B rows
    # of ``full`` ([B, V]: a finished row keeps its last logits), so the random stream is the same
    live = LiveRows(b, compact and LiveRows.eligible(b) and rows_independent(lean.linear_layers(), b, dtype))
    done = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
    pad = torch.full_like(done, pad_id, dtype=torch.long)
    zero = torch.zeros((), dtype=torch.float32, device=prompt_ids.device)
    toks, logps, valid = [], [], []
    if topk:  # what a finished row's position holds: distinct ids 0..k-1, log-probs 0
        head_pad = torch.arange(topk, device=prompt_ids.device).expand(b, topk)
    for i in range(max_new_tokens):
        last = full
        if last.dtype != torch.float32:
            last = last.float()
        if temperature != 1.0:  # x / 1.0 == x: skip the no-op division
            last = last / temperature
        logp_all = torch.log_softmax(last, dim=-1)
        if greedy:
            tok = last.argmax(-1)
        else:
            tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
        tok = torch.where(done, pad, tok)
        valid.append(~done)
        toks.append(tok)
        logps.append(torch.where(done, zero, logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)))
        if topk:  # the distribution ``tok`` was drawn from (read only: the stream is unchanged)
            head_lp, head_ids = logp_all.topk(topk, dim=-1)
            off = done.unsqueeze(-1)
            heads.append((torch.where(off, head_pad, head_ids), torch.where(off, zero, head_lp)))
        done = done | (tok == eos_id)
        if bool(done.all()):
            break
        sel = live.update(done)
        if sel is not None:  # fewer rows from now on: gather what they carry
            cache.keep_rows(sel)
            full = full.clone()  # owned: the computed rows are written into it from now on
            bias, next_pos = bias.index_select(0, sel), next_pos.index_select(0, sel)
            if rope is not None:
                rope = (rope[0].index_select(0, sel), rope[1].index_select(0, sel))
        step_tok = tok if live.rows is None else tok.index_select(0, live.rows)
        if rope is None:
            logits = lean(step_tok.unsqueeze(-1), bias[..., : p + i + 1], next_pos, cache)
        else:
            logits = lean(step_tok.unsqueeze(-1), bias[..., : p + i + 1], None, cache,
                          rope=(rope[0][:, :, i : i + 1], rope[1][:, :, i : i + 1]))
        if live.rows is None:
            full = logits[:, -1, :]
        else:
            full.index_copy_(0, live.rows, logits[:, -1, :])
        next_pos = next_pos + 1
    return toks, logps, valid, done


class RolloutEngine:
    """The rollout engine: a weight copy quantized per ``recipe``, synced from the trainer.

    Args:
        template: a model of the trainer's architecture (deep-copied; never aliased).
        recipe: the rollout recipe (an ``fp8rl.quant.Recipe`` or a ``RECIPES`` name, resolved
            here once; ``bf16`` = no FP8).
        emulate: emulate FP8 compute (CPU).
        dtype: the compute dtype. With ``torch.bfloat16`` the engine is a BF16 engine as vLLM
            runs one: every sync rounds the trainer's fp32 master weights to BF16 once (FP8
            layers quantize from those BF16 values, as vLLM quantizes a BF16 checkpoint) and
            decoding computes in BF16 (``qwen3.LeanQwen3``). Its computation differs from the
            trainer's forward the way an inference engine's does: a KV cache with one query
            per step instead of full sequences, and a fused attention (fp32 scores and
            probabilities, ``attention="fused"``) instead of the trainer's eager attention,
            which rounds scores and probabilities to BF16; so the two policies have a small
            natural mismatch (``rollout/mismatch_kl``) that TIS corrects.
    """

    def __init__(self, template: torch.nn.Module, recipe: Recipe | str, *, emulate: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        self.recipe = get_recipe(recipe)
        self.emulate = emulate
        self.dtype = dtype
        self.model = copy.deepcopy(template).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._prepare()

    def _prepare(self) -> None:
        """Swap the copy's linears (LM head excluded) for FP8 W8A8 inference linears.

        ``bf16``: nothing is swapped and the engine runs the exact high-precision copy.
        """
        from fp8rl.quant.rollout import convert_for_rollout

        self.model = convert_for_rollout(self.model, self.recipe, emulate=self.emulate)

    @torch.no_grad()
    def sync(self, trainer_model: torch.nn.Module) -> None:
        """Copy the trainer's master weights into the engine, re-quantizing the FP8 layers."""
        from fp8rl.quant.rollout import sync_rollout_weights

        sync_rollout_weights(self.model, _master_state_dict(trainer_model, self.dtype), self.recipe)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **kw) -> RolloutBatch:
        return generate(self.model, prompt_ids, prompt_mask, dtype=self.dtype,
                        weights_rounded=self.dtype != torch.float32, attention="fused", **kw)


def _master_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The trainer's fp32 master parameters by name, rounded to the engine's compute dtype
    (kept in fp32 storage: fp32 GEMMs on them are the emulated low-precision GEMMs)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        out[k] = v.to(dtype).to(v.dtype) if v.is_floating_point() and dtype != v.dtype else v
    return out
