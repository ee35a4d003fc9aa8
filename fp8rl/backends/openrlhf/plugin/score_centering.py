"""Score Centering at paper scale: the sampler's top-k from vLLM to the loss of OpenRLHF's actor.

The term itself is ``fp8rl.rl.score_centering`` (docs/score_centering.md): at every response token
it needs the rollout sampler's top-k ids H and their log-probs log q, and the trainer's log p at the
same ids. This module holds the pure pieces of the path those travel at paper scale; the binding
(``binding.agent``, ``binding.rollout``, ``binding.actor``) calls them in the processes involved:

1. **vLLM engine actor** (``binding.agent``): the cell's rollout requests ask for ``logprobs=k``
   (``SamplingParams``; ``binding.rollout.sampling_fields``), and the engines are built with
   ``logprobs_mode="processed_logprobs"`` and ``max_logprobs=k`` (:func:`engine_kwargs`, added by
   ``binding.install_driver``). vLLM 0.29 returns, per generated token, a dict id -> ``Logprob``
   holding the top-k (ranks 1..k) plus the sampled token (its own rank) when it is not among them
   (``vllm/logprobs.py: append_logprobs_for_next_position``); :func:`topk_from_logprobs` keeps
   exactly the k head entries, in rank order, as tensors ``[G, k]`` (G generated tokens), and the
   wrapped ``SingleTurnAgentExecutor.execute`` adds them to its response dict (:data:`RESPONSE_KEY`).
2. **PPO trainer actor** (``binding.rollout.generate_vllm``): after upstream's
   ``_process_response_into_experience``, :func:`attach_to_experience` lays the top-k out on the
   experience's action positions (position j = the log-prob of sequence token j + 1, as
   ``action_mask`` and ``rollout_log_probs``) and stores it, flattened, in ``experience.info``
   (:data:`IDS_KEY` int32, :data:`LOGP_KEY` float32, ``[1, (L - 1) * k]``). Flattened because
   upstream pads ``info`` tensors on their *last* dimension (``zero_pad_sequences`` in
   ``Experience.concat_experiences``): right-padding ``[1, (L - 1) * k]`` adds whole positions at the
   end, so the layout survives the rollout micro-batches, the split into the replay buffer
   (``split_experience_batch``: one row per sample) and the collate (``make_experience_batch``: a
   list of rows) unchanged. Evaluation requests carry none (train rollouts only).
3. **PPO actor** (``binding.actor``): :func:`take_sampler_topk` pops the two keys from the
   micro-batch (upstream never logs them) and rebuilds ``[B, A, k]``; a forward hook on the actor
   module, for the one forward of ``training_step``, reads its logits and action log-probs and
   :func:`trainer_logp_at_topk` gives log p at the ids; the loss (``plugin.loss``) adds
   ``score_centering_loss_mat(C, A, mask)`` to its per-token loss before the reduction, as the
   mini trainer does (``loss_mat * IS weights + A * C``), and logs ``sc/*`` (``fp8rl.rl.score_centering.score_centering_sums``).

Choices, and where we deviate or guessed:

- **Which distribution.** vLLM 0.29's default ``logprobs_mode`` is ``raw_logprobs``: the model's
  log-softmax *before* temperature and logits processors. The sampler q that drew the tokens is the
  *processed* one (after the min-tokens processor, penalties, temperature, top-k/top-p), which is
  also what OpenRLHF's ``rollout_log_probs`` use when its IS correction is on (``train_ppo_ray``
  passes ``logprobs_mode="processed_logprobs"`` to the engines then, with ``max_logprobs=1``). So
  every Score Centering cell uses ``processed_logprobs``, also the ``score_centering`` arm without
  an IS correction (for which upstream would leave vLLM's raw default): the top-k log-probs and
  the sampled token's rollout log-prob come from one dict, one distribution. The trainer's log p is
  upstream's own temperature convention (``Actor.forward`` divides the logits by the rollout
  temperature before its log-probs; we reuse those logits). Deviation: the processed q is exactly 0
  on tokens the min-tokens processor masks (the end token at the first ``min_new_tokens`` = 1
  position) while the trainer's p is not; the top-p renormalisation of the guide's "Sampling
  filters" is not applied either (fp8rl's cells sample with top_p = 1, top_k = -1).
- **Trainer log p without a second log-softmax.** ``Actor.forward`` returns the action log-probs
  ``log p(y_t) = z_t[y_t] - lse(z_t)`` (``log_probs_from_logits``); :func:`trainer_logp_at_topk`
  takes ``lse(z_t) = z_t[y_t] - log p(y_t)`` from them and returns ``z_t[v] - lse(z_t)`` at the k
  ids: one gather of B x A x (k + 1) values and no second log-softmax (the step's log-softmax over
  the vocabulary is upstream's, computed once). Its backward still writes a logits-shaped gradient
  (a scatter into zeros, added to upstream's): that, not the gather, is its cost (the benchmark). The gradient is exact (``d/dz = e_v - softmax(z)``); the
  value equals ``log_softmax(z)[v]`` up to float32 rounding of ``|z|`` (checked against
  ``fp8rl.rl.score_centering.trainer_logp_at_sampler_topk`` in the tests).
- **Packed samples** (``--ds.packing_samples``, the GPU cells): the logits are ``[1, nnz, V]`` in
  the order of the attention mask's non-zero entries (upstream's ``unpad_input``); the rows are
  mapped back by the mask's cumulative sum. Ring attention (sliced sequences) is refused; fp8rl
  never sets it.
- **Single-turn only**: a response with several action ranges (agent executors) is refused.
- **Cost** (``benchmarks/bench_score_centering_carry.py``, docs/cluster.md "Score Centering at
  paper scale"): k int32 ids + k float32 log-probs per response token carried, and the k gathers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

#: Key of the top-k in the response dict of the engine's agent executor (``binding.agent``).
RESPONSE_KEY = "fp8rl_sc_topk"
#: Keys of the flattened top-k ids / log-probs in an experience's ``info`` (popped before upstream sees them).
IDS_KEY = "_fp8rl_sc_ids"
LOGP_KEY = "_fp8rl_sc_logp"
#: The vLLM ``logprobs_mode`` of every Score Centering cell (module docstring, "Which distribution").
LOGPROBS_MODE = "processed_logprobs"


def engine_kwargs(options: Mapping | None) -> dict:
    """Extra ``vllm.AsyncEngineArgs`` of a cell's rollout engines for its Score Centering options
    (``PluginSpec.score_centering``; None: none)."""
    if not options:
        return {}
    return {"logprobs_mode": LOGPROBS_MODE, "max_logprobs": int(options["topk"])}


def topk_from_logprobs(token_ids: Sequence[int], logprobs: Sequence[Mapping], k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-token logprob dicts -> the sampler's top-k ``(ids [G, k] int32, log q [G, k] float32)``.

    ``token_ids``: the G generated ids (``CompletionOutput.token_ids``); ``logprobs``: one mapping id ->
    ``Logprob`` (``.logprob``, ``.rank``) per generated token (``CompletionOutput.logprobs``), asked
    with ``logprobs=k``. Each mapping holds the k head entries (ranks 1..k) and, when the sampled id
    is not among them, the sampled id too (k + 1 entries); rows are in rank order.
    """
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if logprobs is None:
        raise ValueError("the engine returned no logprobs: the request did not ask for logprobs=k")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"{len(logprobs)} logprob entries for {len(token_ids)} generated tokens")
    ids = torch.empty((len(token_ids), k), dtype=torch.int32)
    lps = torch.empty((len(token_ids), k), dtype=torch.float32)
    for t, (tok, d) in enumerate(zip(token_ids, logprobs, strict=True)):
        items = list(d.items())
        if len(items) == k + 1:  # the sampled id is outside the head: drop its entry
            if tok not in d:
                raise ValueError(f"position {t}: {k + 1} logprob entries but the sampled id {tok} is not one")
            items = [(i, lp) for i, lp in items if i != tok]
        elif len(items) != k or tok not in d:
            raise ValueError(f"position {t}: {len(items)} logprob entries (sampled id {tok} "
                             f"{'in' if tok in d else 'not in'} them); vLLM gives k = {k} head entries plus the "
                             "sampled id when it is outside the head: was the request asked for logprobs=k?")
        items.sort(key=lambda e: (e[1].rank, -e[1].logprob))
        ranks = [e[1].rank for e in items]
        if ranks != list(range(1, k + 1)):
            raise ValueError(f"position {t}: head ranks {ranks}, expected 1..{k}")
        for c, (i, lp) in enumerate(items):
            ids[t, c], lps[t, c] = int(i), float(lp.logprob)
    return ids, lps


def experience_topk(response: Mapping, k: int, truncate_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of one response on its experience's action positions, flattened: ``(ids, log q)``,
    each ``[1, (L - 1) * k]`` (int32, float32), zeros off the generated tokens.

    ``response``: the engine's response dict (``observation_tokens``, ``action_ranges`` and
    :data:`RESPONSE_KEY`); ``truncate_length``: upstream's ``max_len`` (``L`` = the observation
    truncated to it). Generated token g of the range ``(start, end)`` is sequence token ``start + g``,
    whose log-prob sits at position ``start + g - 1`` (as ``action_mask`` and ``rollout_log_probs``).
    """
    got = response.get(RESPONSE_KEY)
    if got is None:
        raise ValueError(f"the engine's response has no {RESPONSE_KEY!r}: its agent executor was not bound "
                         "(the vLLM engine process did not import the plugin)")
    ids, lps = got
    ranges = list(response["action_ranges"])
    if len(ranges) != 1:
        raise ValueError(f"Score Centering takes single-turn responses (one action range), got {len(ranges)}")
    start, end = (int(x) for x in ranges[0])
    if ids.shape != (end - start, k) or lps.shape != ids.shape:
        raise ValueError(f"top-k of shape {tuple(ids.shape)} for {end - start} generated tokens and k = {k}")
    length = min(len(response["observation_tokens"]), int(truncate_length))
    out_ids = torch.zeros((length - 1, k), dtype=torch.int32)
    out_lps = torch.zeros((length - 1, k), dtype=torch.float32)
    n = max(0, min(end, length) - start)  # generated tokens left after truncation
    out_ids[start - 1:start - 1 + n] = ids[:n]
    out_lps[start - 1:start - 1 + n] = lps[:n]
    return out_ids.reshape(1, -1), out_lps.reshape(1, -1)


def attach_to_experience(experience, response: Mapping, k: int, truncate_length: int) -> None:
    """Put :func:`experience_topk` into ``experience.info`` (:data:`IDS_KEY`, :data:`LOGP_KEY`)."""
    ids, lps = experience_topk(response, k, truncate_length)
    if experience.action_mask is not None and ids.shape[1] != experience.action_mask.shape[1] * k:
        raise ValueError(f"top-k laid out on {ids.shape[1] // k} positions, the experience has "
                         f"{experience.action_mask.shape[1]}")
    experience.info[IDS_KEY], experience.info[LOGP_KEY] = ids, lps


def _rows(value, batch: int) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # [B, X] (or one row's [X])
        if value.dim() > 2 or (value.dim() == 1 and batch != 1):
            raise ValueError(f"the top-k is a tensor of shape {tuple(value.shape)} for a micro-batch of {batch}")
        rows = list(value.reshape(batch, -1))
    else:
        rows = list(value)
    if len(rows) != batch:
        raise ValueError(f"the top-k has {len(rows)} rows for a micro-batch of {batch}")
    return rows


def take_sampler_topk(experience, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pop the top-k from a micro-batch's ``info`` -> ``(ids [B, A, k] int64, log q [B, A, k] float32)``
    on the device of its ``action_mask`` (``[B, A]``); positions past a row's own are zeros."""
    info = experience.info
    if IDS_KEY not in info or LOGP_KEY not in info:
        raise RuntimeError(f"a micro-batch reached the loss without the sampler's top-k ({IDS_KEY!r} in its info): "
                           "the rollout did not carry it (binding.rollout) or upstream's batching dropped it")
    raw_ids, raw_lps = info.pop(IDS_KEY), info.pop(LOGP_KEY)
    mask = experience.action_mask
    B, A = mask.shape
    ids = torch.zeros((B, A, k), dtype=torch.int64, device=mask.device)
    lps = torch.zeros((B, A, k), dtype=torch.float32, device=mask.device)
    for b, (ri, rl) in enumerate(zip(_rows(raw_ids, B), _rows(raw_lps, B), strict=True)):
        if ri.numel() % k or ri.numel() != rl.numel():
            raise ValueError(f"row {b}: {ri.numel()} ids / {rl.numel()} log-probs do not split into k = {k}")
        n = min(A, ri.numel() // k)
        ids[b, :n] = ri.reshape(-1, k)[:n].to(mask.device, torch.int64)
        lps[b, :n] = rl.reshape(-1, k)[:n].to(mask.device, torch.float32)
    return ids, lps


def trainer_logp_at_topk(logits: torch.Tensor, action_log_probs: torch.Tensor, sequences: torch.Tensor,
                         topk_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                         packed: bool = False) -> torch.Tensor:
    """Trainer log p at the sampler's ids, ``[B, A, k]``, from the actor forward's own tensors.

    Args:
        logits: ``[B, S, V]`` (``packed``: ``[1, nnz, V]``, rows in the order of ``attention_mask``'s
            non-zero entries), already divided by the temperature (``Actor.forward`` does).
        action_log_probs: ``[B, A]`` log p of the action tokens (``Actor.forward``'s first output);
            row ``i = S - 1 - A + j`` of the logits predicts token ``i + 1``, the action token at j.
        sequences: ``[B, S]`` token ids; ``topk_ids``: ``[B, A, k]``; ``attention_mask``: ``[B, S]``.

    ``log p(v) = z[v] - lse(z)`` with ``lse(z) = z[y] - log p(y)`` (y the token taken): gathers only.
    Positions whose action log-prob upstream masked to 0 give values to be masked.
    """
    B, S = sequences.shape
    A = action_log_probs.shape[1]
    if topk_ids.shape[:2] != (B, A):
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected [{B}, {A}, k]")
    if A > S - 1:
        raise ValueError(f"{A} action positions for sequences of length {S}")
    taken = sequences[:, S - A:].long()  # the token each action position predicts
    # one gather of the k ids and the taken id: its backward is one logits-shaped scatter, not two
    cols = torch.cat([taken.unsqueeze(-1), topk_ids.long()], dim=-1)
    if packed:
        if attention_mask is None:
            raise ValueError("packed logits need the attention mask to find their rows")
        rows = (attention_mask.reshape(-1).long().cumsum(0) - 1).clamp(min=0).reshape(B, S)[:, S - 1 - A:S - 1]
        at = logits[0][rows.unsqueeze(-1), cols]
    else:
        at = logits[:, S - 1 - A:S - 1].gather(-1, cols)
    lse = at[..., 0].float() - action_log_probs.float()
    return at[..., 1:].float() - lse.unsqueeze(-1)
