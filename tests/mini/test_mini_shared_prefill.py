"""Each distinct prompt of a batch is prefilled once (``shared_prefill.py``) and no sampled token,
log-prob or mask changes: against prefilling every row, for every rollout recipe, with the rows
each prefill computed counted, the check on first use, and a planted difference."""

from __future__ import annotations

import random

import pytest
import torch

import fp8rl.backends.mini.shared_prefill as shared_prefill
from fp8rl.backends.mini import qwen3
from fp8rl.backends.mini.batch import left_pad
from fp8rl.backends.mini.live_rows import ROW_GRANULE
from fp8rl.backends.mini.model import build_model
from fp8rl.backends.mini.rollout import RolloutEngine
from fp8rl.backends.mini.shared_prefill import plan
from fp8rl.backends.mini.tokenizer import CharTokenizer

TOK = CharTokenizer()
DISTINCT, SAMPLES = 12, 8  # 96 rows; 12 distinct prompts -> one 32-row prefill


@pytest.fixture(autouse=True)
def one_thread_fresh_verdicts(monkeypatch):
    """Shared prefills run on one torch thread (as the mini runs compute); each test starts with
    no verdicts, so the first batch of a shape is checked."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(shared_prefill, "VERDICTS", {})
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return build_model("8b", TOK.vocab_size, max_positions=128, seed=0).eval()


def _prompts(distinct: int = DISTINCT, samples: int = SAMPLES, seed: int = 0):
    """``samples`` consecutive rows per prompt, as a GRPO batch lays them out."""
    rng = random.Random(seed)
    texts = [f"Q:{rng.randint(1, 20)}+{rng.randint(1, 20)}*{rng.randint(1, 9)}\n" for _ in range(distinct)]
    return left_pad([TOK.encode(t, bos=True) for t in texts for _ in range(samples)], TOK.pad_id)


def _generate(engine, monkeypatch, enabled: bool, prompts=None):
    """``(RolloutBatch, rows of each prefill call)`` with sharing on or off."""
    monkeypatch.setattr(shared_prefill, "ENABLED", enabled)
    prefills = []
    call = qwen3.LeanQwen3.__call__

    def counted(self, input_ids, *a, **kw):
        if input_ids.shape[1] > 1:  # the prefill: the prompt's tokens at once (decode steps: one)
            prefills.append(input_ids.shape[0])
        return call(self, input_ids, *a, **kw)

    monkeypatch.setattr(qwen3.LeanQwen3, "__call__", counted)
    out = engine.generate(*(prompts or _prompts()), max_new_tokens=24, temperature=1.0, eos_id=TOK.eos_id,
                          pad_id=TOK.pad_id, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(qwen3.LeanQwen3, "__call__", call)
    return out, prefills


def _assert_same(a, b):
    for f in ("response_ids", "response_mask", "rollout_log_probs", "truncated"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize(("recipe", "dtype"), [
    ("bf16", torch.float32), ("bf16", torch.bfloat16), ("tensorwise", torch.bfloat16),
    ("rowwise", torch.bfloat16), ("blockwise", torch.bfloat16), ("mxfp8", torch.bfloat16),
])
def test_prefilling_each_prompt_once_changes_no_number(model, monkeypatch, recipe, dtype):
    """The first batch is checked (a shared and a whole prefill), the next of its shape shares
    without the check; every token, log-prob and mask is the whole prefill's. ``tensorwise``
    shares too: its activation scale is the amax over rows, and the distinct prompts hold every
    value the batch holds."""
    engine = RolloutEngine(model, recipe, emulate=True, dtype=dtype)
    engine.sync(model)
    ref, ref_prefills = _generate(engine, monkeypatch, enabled=False)
    assert ref_prefills == [DISTINCT * SAMPLES]
    first, checked = _generate(engine, monkeypatch, enabled=True)
    assert checked == [ROW_GRANULE, DISTINCT * SAMPLES]  # shared, then the whole batch to compare
    assert list(shared_prefill.VERDICTS.values()) == [True]
    _assert_same(first, ref)
    again, prefills = _generate(engine, monkeypatch, enabled=True)
    assert prefills == [ROW_GRANULE]
    _assert_same(again, ref)


def test_a_difference_at_the_check_keeps_the_whole_prefill(model, monkeypatch):
    """When the check sees any difference, the whole prefill's numbers are used, and that shape
    is prefilled whole from then on (no second check)."""
    engine = RolloutEngine(model, "rowwise", emulate=True, dtype=torch.bfloat16)
    engine.sync(model)
    ref, _ = _generate(engine, monkeypatch, enabled=False)
    monkeypatch.setattr(shared_prefill, "_same", lambda a, b: False)
    first, prefills = _generate(engine, monkeypatch, enabled=True)
    assert prefills == [ROW_GRANULE, DISTINCT * SAMPLES]
    assert list(shared_prefill.VERDICTS.values()) == [False]
    _assert_same(first, ref)
    again, prefills = _generate(engine, monkeypatch, enabled=True)
    assert prefills == [DISTINCT * SAMPLES]
    _assert_same(again, ref)


def test_the_check_sees_a_changed_key_or_value(model, monkeypatch):
    """A shared prefill whose cache differs in one key bit is refused: the check reads the
    keys and values, not only the logits."""
    engine = RolloutEngine(model, "bf16", emulate=True, dtype=torch.bfloat16)
    engine.sync(model)
    ref, _ = _generate(engine, monkeypatch, enabled=False)
    keep = qwen3.KVCache.keep_rows

    def corrupting(self, rows):
        keep(self, rows)
        if rows.numel() == DISTINCT * SAMPLES:  # the shared cache fanned out to the batch
            self.k[0].view(torch.int32)[0, 0, 0, 0] ^= 1

    monkeypatch.setattr(qwen3.KVCache, "keep_rows", corrupting)
    out, _ = _generate(engine, monkeypatch, enabled=True)
    assert list(shared_prefill.VERDICTS.values()) == [False]
    _assert_same(out, ref)


def test_plan_rows_and_inverse():
    """One row per distinct prompt (ids and mask), in order of first appearance, repeated to a
    whole granule; the inverse maps every row to its prompt's."""
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [1, 2, 3]] * 16)  # 64 rows, 2 prompts
    mask = (ids != 0).long()
    rows, inverse = plan(ids, mask)
    assert rows.numel() == ROW_GRANULE
    assert rows[:2].tolist() == [0, 1] and rows.tolist() == [0, 1] * (ROW_GRANULE // 2)
    assert torch.equal(ids[rows][inverse], ids) and torch.equal(mask[rows][inverse], mask)
    # the same ids with another mask are another prompt
    mask2 = mask.clone()
    mask2[2, 0] = 1
    rows2, inverse2 = plan(ids, mask2)
    assert torch.equal(ids[rows2][inverse2], ids) and torch.equal(mask2[rows2][inverse2], mask2)
    assert rows2[:3].tolist() == [0, 1, 2]


def test_plan_declines(monkeypatch):
    distinct = _prompts(distinct=64, samples=1)  # no prompt repeats
    assert plan(*distinct) is None
    assert plan(*_prompts(distinct=40, samples=2)) is None  # 80 rows: not a multiple of the granule
    assert plan(*_prompts(distinct=33, samples=2)) is None  # 66 rows: neither
    assert plan(*_prompts(distinct=4, samples=8)) is None  # one granule: nothing to save
    assert plan(*_prompts(distinct=4, samples=16)) is not None
    monkeypatch.setattr(shared_prefill, "ENABLED", False)
    assert plan(*_prompts(distinct=4, samples=16)) is None
    monkeypatch.setattr(shared_prefill, "ENABLED", True)
    torch.set_num_threads(2)
    assert plan(*_prompts(distinct=4, samples=16)) is None
