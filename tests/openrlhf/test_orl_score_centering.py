"""Score Centering's top-k at paper scale (``plugin.score_centering``, ``binding.agent``,
``binding.rollout``, ``binding.actor``) around OpenRLHF 0.11.2's own source.

Upstream's ``agent.py`` (``SingleTurnAgentExecutor.execute``: the response and its rollout
log-probs), ``samples_generator.py`` (``_process_response_into_experience``) and ``experience.py``
(``concat_experiences``, ``split_experience_batch``, ``remove_padding_in_sequences``,
``make_experience_batch``: the rollout micro-batches, the replay buffer and its collate) run as
written, with their heavy imports stubbed. The engine is a stand-in that answers with vLLM 0.29's
per-token logprob dicts built by vLLM's own rule (the sampled id first, then the top-k with ranks
1..k, later entries overriding: ``vllm/logprobs.py: append_logprobs_for_next_position``); the real
vLLM types are used in ``tests/integration/test_int_score_centering.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import types
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from orl_helpers import function_from_source, openrlhf_dir
from orl_samples import load_samples_generator, sg_args

from fp8rl.backends.openrlhf.plugin import PluginSpec
from fp8rl.backends.openrlhf.plugin import score_centering as sc
from fp8rl.backends.openrlhf.plugin.binding import actor as actor_binding
from fp8rl.backends.openrlhf.plugin.binding import agent as agent_binding
from fp8rl.backends.openrlhf.plugin.binding import trainer as trainer_binding
from fp8rl.backends.openrlhf.plugin.binding.common import UpstreamChangedError
from fp8rl.rl.score_centering import trainer_logp_at_sampler_topk

ns = types.SimpleNamespace
Logprob = namedtuple("Logprob", "logprob rank decoded_token")
V, K = 11, 3
SC_SPEC = dict(seed=5, score_centering={"mode": "tis", "bounds": [0.0, 2.0], "topk": K})


def vllm_dicts(logq: torch.Tensor, sampled: list[int], k: int) -> list[dict]:
    """vLLM 0.29's sample logprobs of one request: per position the sampled id (its rank) first, then
    the top-k (ranks 1..k), in one dict (a repeated id keeps its top-k entry)."""
    out = []
    for row, s in zip(logq, sampled, strict=True):
        vals, ids = row.topk(k)
        token_ids = [s, *ids.tolist()]
        lps = [float(row[s]), *vals.tolist()]
        ranks = [int((row > row[s]).sum()) + 1, *range(1, k + 1)]
        out.append({t: Logprob(lp, r, None) for t, lp, r in zip(token_ids, lps, ranks, strict=True)})
    return out


def sampler(seed: int, g: int) -> tuple[torch.Tensor, list[int]]:
    """A request's sampler log q ``[g, V]`` and its sampled ids: the argmax at even positions (in the
    head), the least likely id at odd ones (outside it)."""
    logq = torch.log_softmax(torch.randn(g, V, generator=torch.Generator().manual_seed(seed)) * 2, -1)
    return logq, [int(r.argmax()) if t % 2 == 0 else int(r.argmin()) for t, r in enumerate(logq)]


def test_extraction_keeps_the_k_head_entries_in_rank_order_and_drops_an_outside_sampled_id():
    logq, sampled = sampler(0, 6)
    ids, lps = sc.topk_from_logprobs(sampled, vllm_dicts(logq, sampled, K), K)
    vals, want = logq.topk(K, dim=-1)
    assert ids.dtype == torch.int32 and lps.dtype == torch.float32 and ids.shape == (6, K)
    assert torch.equal(ids.long(), want) and torch.equal(lps, vals)
    assert [s in ids[t].tolist() for t, s in enumerate(sampled)] == [True, False] * 3  # both cases occurred
    d = vllm_dicts(logq, sampled, K)
    d[1].pop(sampled[1])  # k + 1 entries without the sampled id: not what vLLM sends for logprobs=k
    d[1][99] = Logprob(-9.0, 9, None)
    with pytest.raises(ValueError, match="sampled id"):
        sc.topk_from_logprobs(sampled, d, K)
    with pytest.raises(ValueError, match=r"head ranks|logprobs=k"):
        sc.topk_from_logprobs(sampled, vllm_dicts(logq, sampled, K + 1), K)  # asked for more than k
    with pytest.raises(ValueError, match="no logprobs"):
        sc.topk_from_logprobs(sampled, None, K)


# ---- the whole path: engine -> agent -> experience -> replay buffer -> micro-batch ----------------

def _stub(monkeypatch, name, **attrs):
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))


def _load(monkeypatch, name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_agent(monkeypatch):
    _stub(monkeypatch, "aiohttp")
    _stub(monkeypatch, "openrlhf.utils.logging_utils", init_logger=lambda name: __import__("logging").getLogger(name))
    return _load(monkeypatch, "orl_agent", openrlhf_dir() / "utils" / "agent.py")


def load_experience(monkeypatch):
    root = openrlhf_dir()
    pad = function_from_source(root / "utils" / "utils.py", "zero_pad_sequences",
                               {"torch": torch, "F": F, "List": list})
    _stub(monkeypatch, "openrlhf.utils.utils", zero_pad_sequences=pad)
    return _load(monkeypatch, "orl_experience", root / "trainer" / "ppo_utils" / "experience.py")


class Tokenizer:
    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[100 + i for i in range(int(text.split(":")[1]))]])}


class AgentEngine:
    """The engine actor as upstream's agent sees it (``generate``) wrapped in the Ray-facing
    ``generate_responses`` (the real one runs ``executor.execute`` once per sample)."""

    def __init__(self, executor, log):
        self.executor, self.log, self.truth = executor, log, {}
        self.get_num_unfinished_requests = ns(remote=lambda: _Ref(0))
        self.generate_responses = ns(remote=self._respond)

    async def generate(self, prompt_token_ids, params, multi_modal_data=None):
        g = 3 + params.seed % 5  # response lengths 3..7
        logq, sampled = sampler(params.seed, g)
        self.truth[tuple(prompt_token_ids + sampled)] = logq
        dicts = vllm_dicts(logq, sampled, params.logprobs) if params.logprobs is not None else None
        return ns(outputs=[ns(token_ids=sampled, logprobs=dicts, finish_reason="stop")])

    def _respond(self, *, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1, images=None):
        self.log.append(dict(vars(sampling_params)))
        return _Ref([asyncio.run(self.executor.execute(prompt, label, sampling_params, max_length, hf_tokenizer,
                                                       self, images)) for _ in range(num_samples)])


class _Ref:
    def __init__(self, value):
        self.value = value


def _experiences(monkeypatch, max_len=2048):
    """Seeded train rollouts of four prompts (prompt lengths 2..5) through upstream's agent and
    ``_process_response_into_experience``, the plugin bound: ``(experiences, engine, asked params)``."""
    agent = load_agent(monkeypatch)
    spec = PluginSpec(**SC_SPEC)
    agent_binding.bind_agent(agent, spec)
    module = load_samples_generator(monkeypatch)
    module.Experience = load_experience(monkeypatch).Experience
    trainer_binding.bind_samples_generator(module, spec)
    log = []
    engine = AgentEngine(agent.SingleTurnAgentExecutor(None), log)
    args = sg_args()
    args.algo.advantage.is_correction_level = "token"
    args.rollout.n_samples_per_prompt = 2
    gen = module.SamplesGenerator(ns(args=args), None, None, tokenizer=Tokenizer(), vllm_engines=[engine])
    prompts = [f"p:{n}" for n in (2, 5, 3, 4)]
    it = iter([(None, [p], ["l"], [None]) for p in prompts])
    experiences, _, _ = gen._generate_vllm(it, 4, False, max_len=max_len, max_new_tokens=8)
    return experiences, engine, log


def _replay(monkeypatch, experiences, micro: int, order: list[int]):
    """Upstream's batching: rollout micro-batches of ``micro`` (``concat_experiences``), the replay
    buffer's ``split`` + ``remove_padding``, a training micro-batch collated in ``order``."""
    exp = load_experience(monkeypatch)
    batches = [exp.Experience.concat_experiences(experiences[i:i + micro], 0) for i in range(0, len(experiences), micro)]
    items = [it for b in batches for it in exp.remove_padding_in_sequences(exp.split_experience_batch(b))]
    return exp.make_experience_batch([items[i] for i in order])


@pytest.mark.parametrize("max_len", [2048, 8], ids=["whole", "truncated"])
def test_the_top_k_reaches_the_micro_batch_on_the_action_positions(monkeypatch, max_len):
    """What the loss gets at action position j of every row is the sampler's top-k of the token at
    sequence position j + 1 (ids and log q), after upstream's rollout micro-batches, replay-buffer
    split and collate; the sampled token's rollout log-prob (upstream's, from the same dicts) sits
    at the same position and agrees with the head where the sampled id is in it."""
    experiences, engine, asked = _experiences(monkeypatch, max_len)
    assert {a["logprobs"] for a in asked} == {K}  # every train request asked vLLM for the top-k
    assert len(experiences) == 8 and all(sc.IDS_KEY in e.info for e in experiences)
    batch = _replay(monkeypatch, experiences, micro=2, order=[5, 0, 7, 2, 3])
    ids, lps = sc.take_sampler_topk(batch, K)
    assert sc.IDS_KEY not in batch.info and sc.LOGP_KEY not in batch.info  # upstream never logs them
    mask, seqs = batch.action_mask.bool(), batch.sequences
    assert ids.shape == (*mask.shape, K) and int(mask.sum()) > 0
    checked = 0
    for b in range(mask.shape[0]):
        n = int(batch.attention_mask[b].sum())
        (logq,) = [v for key, v in engine.truth.items() if list(key[:n]) == seqs[b, :n].tolist()]
        start = int(mask[b].nonzero()[0])  # the first generated token's log-prob position
        for j in mask[b].nonzero().flatten().tolist():
            vals, want = logq[j - start].topk(K)
            assert ids[b, j].tolist() == want.tolist() and torch.equal(lps[b, j], vals), (b, j)
            tok = int(seqs[b, j + 1])
            assert float(batch.rollout_log_probs[b, j]) == pytest.approx(float(logq[j - start, tok]))
            if tok in want.tolist():
                assert float(lps[b, j, want.tolist().index(tok)]) == float(batch.rollout_log_probs[b, j])
            checked += 1
    assert checked == int(mask.sum())


def test_eval_rollouts_carry_no_top_k_and_a_missing_one_fails_loudly(monkeypatch):
    agent = load_agent(monkeypatch)
    agent_binding.bind_agent(agent, PluginSpec(**SC_SPEC))
    engine = AgentEngine(agent.SingleTurnAgentExecutor(None), [])
    params = ns(logprobs=1, max_tokens=8, seed=3)  # evaluation: upstream's logprobs, fewer than k
    (resp,) = engine._respond(prompt="p:2", label="l", sampling_params=params, max_length=64,
                              hf_tokenizer=Tokenizer()).value
    assert sc.RESPONSE_KEY not in resp and resp["rollout_log_probs"] is not None
    with pytest.raises(ValueError, match="agent executor was not bound"):
        sc.experience_topk(resp, K, 64)
    agent_binding.bind_agent(agent, PluginSpec(seed=5))  # no Score Centering: upstream's execute again
    assert agent.SingleTurnAgentExecutor.execute is agent.SingleTurnAgentExecutor._fp8rl_originals["execute"]
    batch = ns(info={}, action_mask=torch.ones(1, 4))
    with pytest.raises(RuntimeError, match="without the sampler's top-k"):
        sc.take_sampler_topk(batch, K)


# ---- trainer log p at the ids, from the actor forward's own tensors -----------------------------

def _actor_tensors(seed: int, B=3, S=9, A=6):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, S, V, generator=g) * 3).requires_grad_(True)
    seqs = torch.randint(0, V, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    attn[1, -2:] = 0  # right padding, as upstream collates
    attn[2, -4:] = 0
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * A)]).reshape(B, A, K)
    return logits, seqs, attn, ids


def _action_log_probs(logits, seqs, A):
    """Upstream's ``Actor.forward``: log p of the rolled sequences, the last A positions."""
    lp = torch.log_softmax(logits, -1).gather(-1, torch.roll(seqs, -1, 1).unsqueeze(-1)).squeeze(-1)
    return lp[:, :-1][:, -A:]


def test_trainer_log_p_at_the_ids_equals_the_log_softmax_reference_with_its_gradient():
    logits, seqs, attn, ids = _actor_tensors(0)
    B, S, _ = logits.shape
    A = ids.shape[1]
    got = sc.trainer_logp_at_topk(logits, _action_log_probs(logits, seqs, A), seqs, ids)
    ref = trainer_logp_at_sampler_topk(logits[:, S - 1 - A:S - 1], ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (g_got,) = torch.autograd.grad((got * w).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-6)
    # packed samples (GPU cells): logits [1, nnz, V] in the order of the mask's non-zero entries
    packed = logits.detach().reshape(B * S, V)[attn.reshape(-1).bool()].unsqueeze(0)
    alp = _action_log_probs(logits.detach(), seqs, A)
    got_p = sc.trainer_logp_at_topk(packed, alp, seqs, ids, attention_mask=attn, packed=True)
    m = attn[:, S - A:].bool()  # action positions whose token is attended
    torch.testing.assert_close(got_p[m], ref.detach()[m], rtol=0, atol=2e-6)


class StandInActor(torch.nn.Module):
    """``Actor.forward``'s signature and outputs (logits divided by the temperature, the action
    log-probs), on a linear model."""

    def __init__(self, temperature=0.7):
        super().__init__()
        self.emb = torch.nn.Embedding(V, V)
        self.temperature, self.packing_samples = temperature, False

    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False, allgather_logits=False,
                return_logprobs=False, ring_attn_group=None, packed_seq_lens=None, return_entropy=False, **mm):
        out = {"logits": self.emb(sequences).float() / self.temperature}
        alp = _action_log_probs(out["logits"], sequences, action_mask.shape[1]) * action_mask
        return (alp, out) if return_output else alp


def test_the_actor_hook_hands_the_loss_log_p_at_the_micro_batchs_ids(monkeypatch):
    """``binding.actor``'s hook: the micro-batch's top-k leaves its info, the one forward of
    ``training_step`` gives the loss log p at those ids (temperature-scaled, with gradient into the
    model) and log q; a second forward in the same step is refused."""
    actor = StandInActor()
    _, seqs, attn, ids = _actor_tensors(2)
    B, S, A = seqs.shape[0], seqs.shape[1], ids.shape[1]
    lq = torch.log_softmax(torch.randn(B, A, K), -1)
    info = {sc.IDS_KEY: [r.reshape(-1).int() for r in ids], sc.LOGP_KEY: [r.reshape(-1) for r in lq], "x": 1}
    exp = ns(info=info, action_mask=attn[:, S - A:].clone(), sequences=seqs, attention_mask=attn)
    loss = ns(spec=PluginSpec(**SC_SPEC), sc_inputs="stale")
    trainer = ns(actor=actor, actor_loss_fn=loss)
    handle = actor_binding.score_centering_hook(trainer, exp)
    assert loss.sc_inputs is None and set(exp.info) == {"x"}
    actor(seqs, exp.action_mask, attention_mask=attn, return_output=True)
    train_lp, sampler_lp, got_ids = loss.sc_inputs
    logits = actor.emb(seqs).float() / actor.temperature
    ref = trainer_logp_at_sampler_topk(logits[:, S - 1 - A:S - 1], ids)
    m = exp.action_mask.bool()
    torch.testing.assert_close(train_lp[m], ref[m], rtol=0, atol=2e-6)
    assert torch.equal(sampler_lp, lq) and torch.equal(got_ids, ids) and train_lp.requires_grad
    with pytest.raises(UpstreamChangedError, match="twice"):
        actor(seqs, exp.action_mask, attention_mask=attn, return_output=True)
    handle.remove()


def test_upstream_shapes_the_hook_relies_on_are_checked():
    class Renamed(StandInActor):
        def forward(self, input_ids, action_mask=None, attention_mask=None, return_output=False):
            return super().forward(input_ids, action_mask, attention_mask, return_output)

    exp = ns(info={sc.IDS_KEY: [torch.zeros(6, dtype=torch.int32)], sc.LOGP_KEY: [torch.zeros(6)]},
             action_mask=torch.ones(1, 2))
    with pytest.raises(UpstreamChangedError, match=r"Actor\.forward"):
        actor_binding.score_centering_hook(ns(actor=Renamed(), actor_loss_fn=ns(spec=PluginSpec(**SC_SPEC))), exp)

