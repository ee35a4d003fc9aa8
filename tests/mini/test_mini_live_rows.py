"""Finished rows leave the decode batch (``live_rows.py``) and no sampled token, log-prob or mask
changes: against decoding every row to the end, for every rollout recipe, with the rows the
engine computed at each step counted."""

from __future__ import annotations

import random

import pytest
import torch

import fp8rl.backends.mini.live_rows as live_rows
from fp8rl.backends.mini import qwen3
from fp8rl.backends.mini.batch import left_pad
from fp8rl.backends.mini.live_rows import ROW_GRANULE, LiveRows, rows_independent
from fp8rl.backends.mini.model import build_model
from fp8rl.backends.mini.rollout import RolloutEngine
from fp8rl.backends.mini.tokenizer import CharTokenizer

TOK = CharTokenizer()
BATCH = 4 * ROW_GRANULE


@pytest.fixture(autouse=True)
def one_thread():
    """Rows leave the batch only on one torch thread (as the mini runs compute)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    # untrained: rows emit <eos> at scattered steps, so the batch shrinks step by step
    return build_model("8b", TOK.vocab_size, max_positions=128, seed=0).eval()


def _prompts(n: int = BATCH):
    rng = random.Random(0)
    texts = [f"Q:{rng.randint(1, 20)}+{rng.randint(1, 20)}-{rng.randint(1, 20)}\n" for _ in range(n)]
    return left_pad([TOK.encode(t, bos=True) for t in texts], TOK.pad_id)


def _generate(engine, monkeypatch, enabled: bool, greedy: bool = False):
    """``(RolloutBatch, rows computed per forward call)`` with dropping on or off."""
    monkeypatch.setattr(live_rows, "ENABLED", enabled)
    counts = []
    call = qwen3.LeanQwen3.__call__

    def counted(self, input_ids, *a, **kw):
        counts.append(input_ids.shape[0])
        return call(self, input_ids, *a, **kw)

    monkeypatch.setattr(qwen3.LeanQwen3, "__call__", counted)
    out = engine.generate(*_prompts(), max_new_tokens=32, temperature=1.0, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
                          generator=None if greedy else torch.Generator().manual_seed(3), greedy=greedy)
    monkeypatch.setattr(qwen3.LeanQwen3, "__call__", call)
    return out, counts


@pytest.mark.parametrize(("recipe", "dtype", "drops"), [
    ("bf16", torch.float32, True), ("bf16", torch.bfloat16, True), ("rowwise", torch.bfloat16, True),
    ("blockwise", torch.bfloat16, True), ("mxfp8", torch.bfloat16, True),
    # one activation scale over the whole batch, finished rows included: every row stays
    ("tensorwise", torch.bfloat16, False),
])
def test_dropping_finished_rows_changes_no_number(model, monkeypatch, recipe, dtype, drops):
    engine = RolloutEngine(model, recipe, emulate=True, dtype=dtype)
    engine.sync(model)
    ref, ref_counts = _generate(engine, monkeypatch, enabled=False)
    out, counts = _generate(engine, monkeypatch, enabled=True)
    for f in ("response_ids", "response_mask", "rollout_log_probs", "truncated"):
        assert torch.equal(getattr(out, f), getattr(ref, f)), f
    assert ref_counts == [BATCH] * len(ref_counts)
    assert len(counts) == len(ref_counts)
    if not drops:
        assert counts == ref_counts
        return
    # every live row was computed at every step, in whole granules, and fewer rows than before
    live = ref.response_mask.sum(0).tolist()  # rows still generating at each step
    assert all(c % ROW_GRANULE == 0 for c in counts)
    assert all(c >= n for c, n in zip(counts[1:], live[1:], strict=False))
    assert min(counts) < BATCH and sum(counts) < sum(ref_counts)
    assert counts == sorted(counts, reverse=True)


def test_greedy_decoding_drops_rows_too(model, monkeypatch):
    engine = RolloutEngine(model, "bf16", emulate=True)
    ref, _ = _generate(engine, monkeypatch, enabled=False, greedy=True)
    out, counts = _generate(engine, monkeypatch, enabled=True, greedy=True)
    assert torch.equal(out.response_ids, ref.response_ids) and torch.equal(out.rollout_log_probs, ref.rollout_log_probs)
    assert min(counts) < BATCH


def test_several_threads_keep_every_row(model, monkeypatch):
    # multi-threaded kernels split a batch by its size (the CPU flash attention's rows differ)
    torch.set_num_threads(2)
    engine = RolloutEngine(model, "bf16", emulate=True)
    ref, _ = _generate(engine, monkeypatch, enabled=False)
    out, counts = _generate(engine, monkeypatch, enabled=True)
    assert counts == [BATCH] * len(counts)
    assert torch.equal(out.rollout_log_probs, ref.rollout_log_probs)


def test_live_rows_policy(monkeypatch):
    done = torch.zeros(128, dtype=torch.bool)
    live = LiveRows(128, True)
    done[:30] = True  # 98 live: still four granules
    assert live.update(done) is None and live.count == 128
    done[:32] = True  # 96 live: three granules, exactly the live rows
    sel = live.update(done)
    assert sel.tolist() == list(range(32, 128)) and live.rows.tolist() == list(range(32, 128))
    done[32:88] = True  # 40 live: two granules, filled with the first finished rows of the 96
    sel = live.update(done)
    assert live.count == 64 and live.rows.tolist() == list(range(32, 56)) + list(range(88, 128))
    assert sel.tolist() == list(range(0, 24)) + list(range(56, 96))  # positions within the 96
    done[88:125] = True  # 3 live: never fewer than one granule
    live.update(done)
    assert live.count == ROW_GRANULE and set(range(125, 128)) <= set(live.rows.tolist())
    assert live.update(done) is None  # one granule: nothing to drop
    # batches that cannot shrink: not whole granules, a single granule, dropping switched off
    assert LiveRows(100, True).update(torch.ones(100, dtype=torch.bool)) is None
    assert LiveRows(ROW_GRANULE, True).update(torch.ones(ROW_GRANULE, dtype=torch.bool)) is None
    assert LiveRows(128, False).update(torch.ones(128, dtype=torch.bool)) is None
    monkeypatch.setattr(live_rows, "ENABLED", False)
    assert LiveRows(128, True).update(torch.ones(128, dtype=torch.bool)) is None


class _Layer(torch.nn.Module):
    def __init__(self, k: int = 16) -> None:
        super().__init__()
        self.in_features = self.out_features = k
        self.weight = torch.nn.Parameter(torch.randn(k, k))


@pytest.mark.parametrize(("forward", "independent"), [
    (lambda x: x * 2, True),
    (lambda x: x / x.abs().amax(), False),  # one scale for the batch
    (lambda x: x - x.mean(0), False),  # a batch statistic
])
def test_probe_finds_rows_that_share_numbers(forward, independent):
    layer = _Layer()
    assert rows_independent([(layer, forward)], 128, torch.float32) is independent


def test_probe_on_the_engines_layers(model):
    for recipe, independent in (("rowwise", True), ("blockwise", True), ("tensorwise", False)):
        engine = RolloutEngine(model, recipe, emulate=True)
        lean = qwen3.LeanQwen3(engine.model, 128)
        layers = lean.linear_layers()
        assert len(layers) == 7 * 2 + 1  # q k v o gate up down per layer, and the LM head
        assert rows_independent(layers, 128, torch.float32) is independent, recipe
