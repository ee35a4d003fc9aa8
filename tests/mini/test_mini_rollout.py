"""Rollout engine: KV-cache sampling vs full forward, determinism, weight sync (bf16 and FP8)."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl.backends.mini.batch import left_pad, response_logits, token_logprobs
from fp8rl.backends.mini.model import MINI_MODELS, build_model, num_parameters
from fp8rl.backends.mini.rollout import RolloutEngine, generate
from fp8rl.backends.mini.tokenizer import CharTokenizer
from fp8rl.quant.convert import convert_to_fp8
from fp8rl.quant.rollout import Fp8InferenceLinear, quantize_for_rollout

TOK = CharTokenizer()


@pytest.fixture(scope="module")
def model():
    return build_model("8b", TOK.vocab_size, max_positions=128, seed=0).eval()


def _prompts():
    return left_pad([TOK.encode(p, bos=True) for p in ["Q:12+7-5\n", "Q:1+2\n", "Q:3-4+5-6\n"] * 2], TOK.pad_id)


def _sample(m, seed=0, temperature=1.0, **kw):
    ids, mask = _prompts()
    g = torch.Generator().manual_seed(seed)
    return generate(m, ids, mask, max_new_tokens=24, temperature=temperature, eos_id=TOK.eos_id,
                    pad_id=TOK.pad_id, generator=g, **kw)


def test_slots_grow():
    sizes = [num_parameters(build_model(s, TOK.vocab_size, max_positions=64, seed=0)) for s in ("8b", "14b", "32b")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
    assert MINI_MODELS.names() == ["14b", "32b", "8b"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_log_probs_match_a_full_forward(model, temperature):
    out = _sample(model, temperature=temperature)
    with torch.no_grad():
        logits = response_logits(model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
    ref = token_logprobs(logits, out.response_ids, temperature)
    m = out.response_mask.bool()
    assert torch.allclose(out.rollout_log_probs[m], ref[m], atol=1e-5)
    assert (out.rollout_log_probs[~m] == 0).all() and (out.response_ids[~m] == TOK.pad_id).all()
    ends = out.response_mask.sum(-1) - 1
    for i in range(len(ends)):  # rows that stopped end with <eos>; the rest are truncated
        assert bool(out.truncated[i]) == (out.response_ids[i, ends[i]] != TOK.eos_id)


def test_sampling_is_deterministic_per_generator(model):
    a, b, c = _sample(model, 0), _sample(model, 0), _sample(model, 1)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    g = _sample(model, 0, greedy=True)
    assert torch.equal(g.response_ids, _sample(model, 1, greedy=True).response_ids)
    with pytest.raises(ValueError):
        _sample(model, temperature=0.0)


def _perturb(m):
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 1e-2)


def test_bf16_sync_copies_the_trainer_weights(model):
    engine = RolloutEngine(model, "bf16", emulate=True)
    trainer = copy.deepcopy(model)
    _perturb(trainer)
    assert not all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), trainer.state_dict().values(), strict=True))
    engine.sync(trainer)
    theirs = trainer.state_dict()
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, theirs[k]), k
    assert engine.model.state_dict()["model.layers.0.mlp.up_proj.weight"].data_ptr() != \
        theirs["model.layers.0.mlp.up_proj.weight"].data_ptr()  # a copy, not an alias


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("trainer_recipe", ["bf16", "tensorwise"])
def test_fp8_sync_equals_the_quantized_trainer_weights(model, recipe, trainer_recipe):
    engine = RolloutEngine(model, recipe, emulate=True)
    trainer = convert_to_fp8(copy.deepcopy(model), trainer_recipe, emulate=True)
    _perturb(trainer)
    engine.sync(trainer)
    ref, _ = quantize_for_rollout(trainer.state_dict(), recipe)
    mine = engine.model.state_dict()
    assert set(mine) == set(ref)
    for k, v in ref.items():
        assert mine[k].dtype == v.dtype and torch.equal(mine[k], v), k
    fp8 = [n for n, m in engine.model.named_modules() if isinstance(m, Fp8InferenceLinear)]
    assert len(fp8) == 7 * MINI_MODELS["8b"].layers  # q k v o gate up down; LM head stays high precision
    assert not isinstance(engine.model.lm_head, Fp8InferenceLinear)
    out = engine.generate(*_prompts(), max_new_tokens=8, temperature=1.0, eos_id=TOK.eos_id,
                          pad_id=TOK.pad_id, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.rollout_log_probs).all()
