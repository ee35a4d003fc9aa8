"""The lean Qwen3 forward equals transformers' ``Qwen3ForCausalLM`` bit for bit.

References are transformers' own code: ``model(...)`` for full forwards and gradients, and the
decode loop as it was written against ``model(..., cache=DynamicCache)`` (``_hf_decode``) for
sampling, for the bf16 model and every FP8 trainer / rollout recipe.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fp8rl.backends.mini.batch import left_pad, position_ids
from fp8rl.backends.mini.model import build_model
from fp8rl.backends.mini.qwen3 import KVCache, LeanQwen3, causal_bias
from fp8rl.backends.mini.rollout import _decode
from fp8rl.backends.mini.tokenizer import CharTokenizer
from fp8rl.quant.convert import convert_to_fp8
from fp8rl.quant.rollout import convert_for_rollout

TOK = CharTokenizer()
TRAINER_RECIPES = ["bf16", "tensorwise", "rowwise", "blockwise", "mxfp8"]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return build_model("8b", TOK.vocab_size, max_positions=128, seed=0)


def _batch():
    prompts = ["Q:12+7-5\n", "Q:1+2\n", "Q:3-4+5-6\n", "Q:9\n"] * 2
    ids, mask = left_pad([TOK.encode(p, bos=True) for p in prompts], TOK.pad_id)
    g = torch.Generator().manual_seed(1)
    resp = torch.randint(3, TOK.vocab_size, (len(prompts), 11), generator=g)
    full = torch.cat([ids, resp], 1)
    return full, torch.cat([mask, torch.ones_like(resp)], 1)


def _hf_logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits


@pytest.mark.parametrize("recipe", TRAINER_RECIPES)
def test_full_forward_and_gradients_equal_transformers(base, recipe):
    ids, mask = _batch()
    model = convert_to_fp8(copy.deepcopy(base).train(), recipe, emulate=True)
    lean = LeanQwen3(model, 128)
    out = {}
    for name, fn in (("hf", lambda: _hf_logits(model, ids, mask)),
                     ("lean", lambda: lean(ids, causal_bias(mask), position_ids(mask)))):
        model.zero_grad(set_to_none=True)
        logits = fn()
        (logits.square().mean() + logits[:, -3:].logsumexp(-1).mean()).backward()
        out[name] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    assert torch.equal(out["lean"][0], out["hf"][0])
    assert all(torch.equal(a, b) for a, b in zip(out["lean"][1], out["hf"][1], strict=True))


@torch.inference_mode()
def _hf_decode(model, prompt_ids, prompt_mask, *, max_new_tokens, temperature, eos_id, pad_id, generator):
    """The decode loop against transformers' own forward and ``DynamicCache`` (the reference)."""
    from transformers import DynamicCache

    b = prompt_ids.shape[0]
    mask = prompt_mask.clone()
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=position_ids(mask),
                cache=DynamicCache(config=model.config), use_cache=True)
    next_pos = mask.sum(-1, keepdim=True)
    done = torch.zeros(b, dtype=torch.bool)
    toks, logps = [], []
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1, :].float() / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        toks.append(tok)
        logps.append(torch.where(done, torch.zeros_like(logits[:, 0]), logp_all.gather(-1, tok[:, None])[:, 0]))
        done = done | (tok == eos_id)
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, cache=out.cache,
                    use_cache=True)
        next_pos = next_pos + 1
    return torch.stack(toks, 1), torch.stack(logps, 1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("recipe", TRAINER_RECIPES)
def test_decode_equals_transformers_dynamic_cache(base, recipe, temperature):
    engine = convert_for_rollout(copy.deepcopy(base).eval(), recipe, emulate=True)
    prompts = ["Q:12+7-5\n", "Q:1+2\n", "Q:3-4+5-6\n"] * 4
    ids, mask = left_pad([TOK.encode(p, bos=True) for p in prompts], TOK.pad_id)
    kw = dict(max_new_tokens=30, temperature=temperature, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    ref_toks, ref_logps = _hf_decode(engine, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    toks, logps, _valid, _done = _decode(engine, ids, mask, generator=torch.Generator().manual_seed(3),
                                         greedy=False, **kw)
    assert torch.equal(torch.stack(toks, 1), ref_toks)
    assert torch.equal(torch.stack(logps, 1), ref_logps)
    assert bool((ref_toks == TOK.eos_id).any()), "the reference should finish some rows"


def test_unsupported_models_raise(base):
    sdpa = copy.deepcopy(base)
    sdpa.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="needs 'eager'"):
        LeanQwen3(sdpa, 64)
    with pytest.raises(ValueError, match="not a Qwen3ForCausalLM"):
        LeanQwen3(base.model, 64)


def test_kv_cache_refuses_to_overflow():
    c = KVCache(1, 2, 1, 4, 8, dtype=torch.float32, device=torch.device("cpu"))
    k = torch.zeros(2, 1, 3, 8)
    c.append(0, k, k)
    c.advance(3)
    with pytest.raises(ValueError, match="KV cache full"):
        c.append(0, k, k)


def _scaled(base):
    """A copy with larger weights (logits of a few units), so BF16 rounding is visible."""
    m = copy.deepcopy(base)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return m


def test_bf16_forward_follows_transformers_bf16_and_trains_fp32_masters(base):
    """In BF16 the lean forward computes what transformers' model cast to BF16 computes, up to
    the GEMMs' fp32 accumulation order (ours: exact products, fp32 sums; PyTorch's native BF16
    GEMM on CPU: its own order): it stays much closer to that than to the fp32 forward."""
    m = _scaled(base).train()
    ids, mask = _batch()
    pos = position_ids(mask)
    with torch.no_grad():
        hf_bf16 = copy.deepcopy(m).to(torch.bfloat16)(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        fp32 = LeanQwen3(m, 128)(ids, causal_bias(mask), pos)
    lean = LeanQwen3(m, 128, dtype=torch.bfloat16)(ids, causal_bias(mask, torch.bfloat16), pos)
    assert lean.dtype == torch.bfloat16
    v = mask.bool()
    to_hf = (lean.float() - hf_bf16.float())[v].abs().mean()
    hf_to_fp32 = (hf_bf16.float() - fp32)[v].abs().mean()
    assert 0 < to_hf < 0.8 * hf_to_fp32
    lean.float().logsumexp(-1).mean().backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(torch.equal(g, g.to(torch.bfloat16).float()) for g in grads)  # BF16 gradients, upcast


def test_bf16_decode_equals_the_full_forward_and_fused_attention_differs(base):
    """The KV-cache path alone rounds like the full forward in BF16 (the same eager maths);
    the engine's fused attention keeps scores in fp32 and so differs a little: the BF16
    engine/trainer mismatch of the mini backend."""
    from fp8rl.backends.mini.batch import response_logits, token_logprobs

    m = _scaled(base).eval()
    prompts = ["Q:12+7-5\n", "Q:1+2\n", "Q:3-4+5-6\n"] * 4
    ids, mask = left_pad([TOK.encode(p, bos=True) for p in prompts], TOK.pad_id)
    kw = dict(max_new_tokens=20, temperature=1.0, eos_id=TOK.eos_id, pad_id=TOK.pad_id, greedy=False,
              dtype=torch.bfloat16)
    out = {}
    for attention in ("eager", "fused"):
        toks, logps, valid, _ = _decode(m, ids, mask, generator=torch.Generator().manual_seed(3),
                                        attention=attention, **kw)
        out[attention] = (torch.stack(toks, 1), torch.stack(logps, 1), torch.stack(valid, 1))
    toks, logps, valid = out["eager"]
    with torch.no_grad():
        full = token_logprobs(response_logits(m, ids, mask, toks, valid.long(), torch.bfloat16), toks, 1.0)
    assert torch.equal(torch.where(valid, full, 0.0), logps)
    f_toks, f_logps, f_valid = out["fused"]
    with torch.no_grad():
        f_full = token_logprobs(response_logits(m, ids, mask, f_toks, f_valid.long(), torch.bfloat16), f_toks, 1.0)
    diff = (torch.where(f_valid, f_full, 0.0) - f_logps).abs()
    assert 0 < float(diff.max()) < 0.1


def test_fused_attention_equals_eager_in_fp32_up_to_round_off(base):
    ids, mask = _batch()
    pos = position_ids(mask)
    with torch.no_grad():
        eager = LeanQwen3(base, 128)(ids, causal_bias(mask), pos)
        fused = LeanQwen3(base, 128, attention="fused")(ids, causal_bias(mask), pos)
    assert float((eager - fused)[mask.bool()].abs().max()) < 1e-5
