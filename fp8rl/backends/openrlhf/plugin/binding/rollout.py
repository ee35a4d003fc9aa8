"""The binding in the PPO trainer actor: seeded rollouts, in dispatch order (a resume repeats them).

OpenRLHF 0.11.2 makes a rollout irreproducible in three places, all in the PPO trainer actor:

1. the prompt order: the prompt loader's ``RandomSampler`` draws its seed from the process's
   global torch RNG, which nothing seeds in the PPO trainer actor (``--train.seed`` reaches the
   DeepSpeed actors only), so two runs of one cell train on different prompt orders;
2. the samples: ``SamplingParams`` carry no seed, so vLLM draws from the engine's one generator,
   in whatever order requests reach its batches;
3. the order of the groups: ``SamplesGenerator._generate_vllm`` takes them in completion order
   (``ray.wait``), which decides the micro-batches, the replay-buffer shuffle's input and, under
   dynamic filtering, which prompt a filtered group's replacement is dispatched after.

With :attr:`PluginSpec.seed` set (every cell's ``seed``), the binding fixes all three:

1. the prompt sampler's generator is seeded with ``seed`` when ``SamplesGenerator`` is built,
   before any iteration (a resumed run then loads the sampler state of its checkpoint, as
   upstream does);
2. every sample is its own request with its own seed, :func:`request_seed` of ``(seed, purpose,
   steps done, k, j)`` -- ``purpose`` ``train`` or ``eval``, ``k`` the prompt's dispatch index in
   this generation call (replacements included), ``j`` the sample index -- so a sample is the same
   whatever else the engine batches it with, *when the engine's arithmetic is batch-invariant*:
   ``fp8_per_tensor`` never is (its activation scale is one amax over the whole batch, so a
   request's logits depend on its batch-mates); BF16 and ``fp8_per_channel`` were on vLLM 0.29's
   CPU build on an AVX512 CPU, but GEMM kernels chosen by row count (CPU AMX kernels, GPU
   libraries) break it. ``openrlhf.engine_max_num_seqs: 1`` (the CPU smoke job) decodes one
   sequence at a time, which makes every engine batch-invariant; on GPUs vLLM's own
   batch-invariant mode is the way (not set by fp8rl) -- docs/cluster.md;
3. groups are taken in dispatch order (``ray.get`` of the oldest pending group); a filtered
   group's replacement is dispatched when the filtered group is reached in that order.

Score Centering cells (``PluginSpec.score_centering``) ask their train rollouts for ``logprobs=k``
and put the sampler's top-k on each experience (``plugin.score_centering``); this needs the seeded
path (the spec refuses Score Centering without a seed).

:func:`generate_vllm` is upstream's ``_generate_vllm`` with these changes and nothing else: same
prompt collection (``_collect_prompt_batch``), same engine choice per prompt (fewest unfinished
requests, a prompt's samples on one engine), same ``SamplingParams`` fields, same experience
conversion (``_process_response_into_experience``) and the same dynamic-filtering rule. Its
cost: ``n`` Ray calls per prompt instead of one, and a replacement dispatched no earlier than the
groups dispatched before the filtered one have returned (GRPO, without filtering, waits for all
groups either way).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections import deque

from fp8rl.backends.openrlhf.plugin.binding.common import (
    UpstreamChangedError,
    _check_params,
    _originals,
)
from fp8rl.backends.openrlhf.plugin.spec import PluginSpec

log = logging.getLogger(__name__)

#: ``purpose`` values of :func:`request_seed`.
PURPOSES = ("train", "eval")


def request_seed(seed: int, purpose: str, step: int, k: int, j: int) -> int:
    """The vLLM request seed of sample ``j`` of the ``k``-th prompt dispatched in one generation call.

    ``step``: training steps done (the checkpoint's on resume). A 63-bit integer from SHA-256, so
    that neighbouring ``(k, j)`` give unrelated random streams (``seed + k`` would make sample
    ``j`` of prompt ``k`` and sample ``j - 1`` of prompt ``k + 1`` share one)."""
    if purpose not in PURPOSES:
        raise ValueError(f"request_seed purpose={purpose!r} must be one of {PURPOSES}")
    if min(step, k, j) < 0:
        raise ValueError(f"request_seed needs step, k, j >= 0, got {(step, k, j)}")
    digest = hashlib.sha256(f"fp8rl:{int(seed)}:{purpose}:{int(step)}:{int(k)}:{int(j)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_prompt_sampler(loader, seed: int) -> None:
    """Seed the shuffle of OpenRLHF's prompt loader (a ``StatefulDataLoader`` over a ``RandomSampler``
    whose generator upstream seeds from the unseeded global RNG; a ``DistributedSampler`` is
    already seeded with ``--train.seed``)."""
    import torch

    sampler = getattr(loader, "sampler", None)
    if type(sampler).__name__ == "DistributedSampler":
        return
    generator = getattr(sampler, "generator", None)
    if not isinstance(generator, torch.Generator):
        raise UpstreamChangedError(
            f"OpenRLHF's prompt loader samples with {type(sampler).__name__} (generator "
            f"{type(generator).__name__}), not a RandomSampler with a torch.Generator: fp8rl cannot seed "
            "its order; the binding was written for openrlhf 0.11.2")
    generator.manual_seed(int(seed))


def _get(refs):
    """``ray.get`` (unit tests stand in for it)."""
    import ray

    return ray.get(refs)


def _sampling_params(**kwargs):
    """``vllm.SamplingParams(**kwargs)`` (unit tests stand in for it)."""
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def _engine_order(engines, n_prompts: int, n_samples: int) -> list[int]:
    """Upstream's engine choice: each prompt to the engine with the fewest unfinished requests."""
    pending = _get([e.get_num_unfinished_requests.remote() for e in engines])
    heap = [(count, i) for i, count in enumerate(pending)]
    heapq.heapify(heap)
    order = []
    for _ in range(n_prompts):
        load, i = heapq.heappop(heap)
        order.append(i)
        heapq.heappush(heap, (load + n_samples, i))
    return order


def samples_per_prompt(generator, **generate_kwargs) -> int:
    """Upstream's samples per prompt: the call's ``n_samples_per_prompt``, else the rollout's."""
    return int(generate_kwargs.get("n_samples_per_prompt", generator.args.rollout.n_samples_per_prompt))


def sampling_fields(generator, topk: int | None = None, **generate_kwargs) -> dict:
    """The ``SamplingParams`` fields upstream's ``_dispatch_prompts_to_vllm`` sets (seed aside);
    ``topk``: Score Centering's k, asked as ``logprobs=k`` (the sampled token's log-prob is in the
    answer either way, so upstream's ``rollout_log_probs`` are unchanged)."""
    logprobs = 1 if generator.args.algo.advantage.is_correction_level != "off" else None
    if topk is not None:
        logprobs = max(int(topk), logprobs or 0)
    return dict(
        temperature=generate_kwargs.get("temperature", 1.0),
        top_p=generate_kwargs.get("top_p", 1.0),
        top_k=generate_kwargs.get("top_k", -1),
        max_tokens=generate_kwargs.get("max_new_tokens"),
        min_tokens=generate_kwargs.get("min_new_tokens", 1),
        skip_special_tokens=generate_kwargs.get("skip_special_tokens", False),
        logprobs=logprobs,
    )


def score_centering_topk(spec: PluginSpec, purpose: str) -> int | None:
    """The k of a train rollout of a Score Centering cell (None: no top-k asked, as for evaluation)."""
    return int(spec.score_centering["topk"]) if spec.score_centering is not None and purpose == "train" else None


def dispatch(generator, prompts, labels, images, first_k: int, seeds, topk: int | None = None,
             **generate_kwargs) -> list[list]:
    """Send every sample of every prompt as its own seeded request; one list of refs per prompt.

    ``seeds(k, j)`` gives the request seed of sample ``j`` of the prompt dispatched ``k``-th
    (``first_k`` is the index of ``prompts[0]``). The ``SamplingParams`` fields are upstream's, but
    ``logprobs=topk`` for Score Centering's train rollouts (:func:`sampling_fields`)."""
    n = samples_per_prompt(generator, **generate_kwargs)
    common = sampling_fields(generator, topk, **generate_kwargs)
    images = images if images is not None else [None] * len(prompts)
    engines = generator.vllm_engines
    groups = []
    for i, (engine_idx, prompt, label, img) in enumerate(
            zip(_engine_order(engines, len(prompts), n), prompts, labels, images, strict=True)):
        engine = engines[engine_idx]
        groups.append([
            engine.generate_responses.remote(
                prompt=prompt, label=label, sampling_params=_sampling_params(**common, seed=seeds(first_k + i, j)),
                max_length=generate_kwargs.get("max_len", 2048), hf_tokenizer=generator.tokenizer,
                num_samples=1, images=img)
            for j in range(n)])
    return groups


def generate_vllm(generator, samples_module, spec: PluginSpec, purpose: str, step: int,
                  dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs):
    """Seeded ``SamplesGenerator._generate_vllm``: ``(experiences, prompts_consumed, exhausted)``."""
    collect = samples_module._collect_prompt_batch
    topk = score_centering_topk(spec, purpose)

    def seeds(k: int, j: int) -> int:
        return request_seed(spec.seed, purpose, step, k, j)

    def experience(response):
        e = generator._process_response_into_experience(response, **generate_kwargs)
        if topk is not None:  # the sampler's top-k on the experience's action positions (plugin.score_centering)
            from fp8rl.backends.openrlhf.plugin.score_centering import attach_to_experience

            attach_to_experience(e, response, topk, generate_kwargs.get("max_len", 2048))
        return e

    prompts, labels, images, exhausted = collect(dataloader_iter, num_prompts)
    # what this call drew and decided (``rollout_draws.jsonl`` with ``spec.dump_dir``; the smoke
    # job's tests): the prompts in dispatch order, each group kept or filtered, the replacements
    # asked for and how many found no prompt left, the samples per prompt and sampling settings
    draw = {"purpose": purpose, "steps_done": int(step), "asked": int(num_prompts), "prompts": list(prompts),
            "kept": [], "replacements": 0, "missed": 0, "n": samples_per_prompt(generator, **generate_kwargs),
            "params": {k: v for k, v in sampling_fields(generator, topk, **generate_kwargs).items()
                       if k in ("temperature", "top_p", "top_k", "max_tokens", "logprobs")}}
    if not prompts:
        _record(spec, {**draw, "exhausted": True})
        return [], 0, True
    pending = deque(dispatch(generator, prompts, labels, images, 0, seeds, topk, **generate_kwargs))
    dispatched = consumed = len(prompts)
    accepted = []
    while pending:
        group = [resp for out in _get(pending.popleft()) for resp in out]
        experiences = [experience(r) for r in group]
        if dynamic_filtering and all(e.scores is not None for e in experiences):
            scores = [e.scores[0].item() for e in experiences]
            low, high = generator.args.algo.dynamic_filtering_range
            if not low < sum(scores) / len(scores) < high:
                experiences = []
        draw["kept"].append(bool(experiences))
        if experiences:
            accepted.extend(experiences)
        elif dynamic_filtering:
            new_prompts, new_labels, new_images, exhausted = collect(dataloader_iter, 1)
            consumed += len(new_prompts)
            draw["replacements"] += 1
            draw["missed"] += not new_prompts
            if new_prompts:
                draw["prompts"] += list(new_prompts)
                pending.extend(dispatch(generator, new_prompts, new_labels, new_images, dispatched, seeds, topk,
                                        **generate_kwargs))
                dispatched += len(new_prompts)
    _record(spec, {**draw, "exhausted": bool(exhausted)})
    if purpose == "train" and dynamic_filtering:
        STEP_FILTERING["filtered"] += draw["kept"].count(False)
        STEP_FILTERING["replacements"] += draw["replacements"]
    return accepted, consumed, exhausted


#: Dynamic filtering's counts since the last training step (``trainer.bind_ppo_trainer`` logs and
#: resets them: ``dapo/filtered_groups``, ``dapo/replacements``).
STEP_FILTERING = {"filtered": 0, "replacements": 0}


#: The dump file of :func:`generate_vllm`'s draws and ``trainer.whole_steps_only``'s batches.
DRAWS_FILE = "rollout_draws.jsonl"


def _record(spec: PluginSpec, rec: dict) -> None:
    """Append ``rec`` to ``<spec.dump_dir>/rollout_draws.jsonl`` (no dump dir: nothing). One
    writer: the PPO trainer actor, the one process that draws prompts."""
    if not spec.dump_dir:
        return
    import json
    import os
    import time

    os.makedirs(spec.dump_dir, exist_ok=True)
    with open(os.path.join(spec.dump_dir, DRAWS_FILE), "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **rec}) + "\n")


def bind_seeded_rollout(samples_module, spec: PluginSpec, steps_done) -> None:
    """Bind :func:`generate_vllm` and the sampler seed into ``SamplesGenerator`` (no-op without a seed).

    ``steps_done()``: training steps done in this process (``trainer``'s count, restored on resume).
    ``generate_samples`` is wrapped by ``trainer.bind_samples_generator``, which sets the purpose
    ``train``; ``generate_eval_samples`` sets ``eval`` here."""
    cls = samples_module.SamplesGenerator
    names = ("__init__", "_generate_vllm", "generate_eval_samples")
    if spec.seed is None:  # upstream's rollout (a rebinding starts from the originals)
        saved = _originals(cls, ())
        for n in (n for n in names if n in saved):
            setattr(cls, n, saved[n])
        return
    orig = _originals(cls, names)
    _check_params(orig["__init__"], ("self", "strategy", "prompts_dataloader", "eval_dataloader", "tokenizer",
                                     "vllm_engines"), "SamplesGenerator.__init__")
    _check_params(orig["_generate_vllm"], ("self", "dataloader_iter", "num_prompts", "dynamic_filtering"),
                  "SamplesGenerator._generate_vllm")
    for name in ("_collect_prompt_batch",):
        if not callable(getattr(samples_module, name, None)):
            raise UpstreamChangedError(f"openrlhf.trainer.ppo_utils.samples_generator.{name} is gone")

    def __init__(self, strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines):
        orig["__init__"](self, strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines)
        if prompts_dataloader is not None:
            seed_prompt_sampler(prompts_dataloader, spec.seed)

    def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs):
        purpose = getattr(self, "_fp8rl_purpose", "train")
        return generate_vllm(self, samples_module, spec, purpose, steps_done(), dataloader_iter, num_prompts,
                             dynamic_filtering, **generate_kwargs)

    def generate_eval_samples(self, **generate_kwargs):
        self._fp8rl_purpose = "eval"
        try:
            return orig["generate_eval_samples"](self, **generate_kwargs)
        finally:
            self._fp8rl_purpose = "train"

    cls.__init__, cls._generate_vllm, cls.generate_eval_samples = __init__, _generate_vllm, generate_eval_samples
