"""SFT warm start: cached by config hash, deterministic, and it learns the format."""

from __future__ import annotations

import dataclasses

import torch

from fp8rl.backends.mini.config import MiniSettings
from fp8rl.backends.mini.sft import sft_batch, sft_key, warm_start
from fp8rl.backends.mini.task import make_splits
from fp8rl.backends.mini.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _mini(**kw):
    return MiniSettings(**{"n_train": 100, "n_eval": 4, "sft_steps": 6, "sft_batch_size": 8,
                           "min_terms": 2, "max_terms": 2, "max_operand": 9, **kw})


def test_key_depends_on_what_matters():
    m = _mini()
    assert sft_key("8b", m, TOK) == sft_key("8b", _mini(), TOK)
    assert sft_key("14b", m, TOK) != sft_key("8b", m, TOK)
    for change in (dict(sft_steps=7), dict(sft_lr=1e-3), dict(max_operand=8), dict(data_seed=1),
                   dict(sft_slip_rate=0.6)):
        assert sft_key("8b", dataclasses.replace(m, **change), TOK) != sft_key("8b", m, TOK), change
    # where the cache lives does not change the weights' identity; the thread count does (CPU
    # reductions split by threads: the weights differ in the last bits)
    assert sft_key("8b", dataclasses.replace(m, cache_dir="/elsewhere"), TOK) == sft_key("8b", m, TOK)
    assert sft_key("8b", dataclasses.replace(m, num_threads=2), TOK) != sft_key("8b", dataclasses.replace(m, num_threads=1), TOK)


def test_cache_hit_returns_the_same_weights_and_training_is_deterministic(tmp_path):
    m = _mini()
    train, _ = make_splits(m.data_seed, m.n_train, m.n_eval, min_terms=2, max_terms=2, max_operand=9)
    a, meta_a = warm_start("8b", train, TOK, m, tmp_path / "c1")
    b, meta_b = warm_start("8b", train, TOK, m, tmp_path / "c1")
    c, meta_c = warm_start("8b", train, TOK, m, tmp_path / "c2")  # trained again elsewhere
    assert (meta_a["cache_hit"], meta_b["cache_hit"], meta_c["cache_hit"]) == (False, True, False)
    assert meta_a["key"] == meta_b["key"] == sft_key("8b", m, TOK)
    for (k, va), vb, vc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True):
        assert torch.equal(va, vb) and torch.equal(va, vc), k
    assert not list((tmp_path / "c1" / meta_a["key"]).glob("*.tmp*"))  # atomic writes left no temp files


def test_sft_loss_goes_down(tmp_path):
    m = _mini(sft_steps=30, sft_batch_size=16)
    train, _ = make_splits(m.data_seed, m.n_train, m.n_eval, min_terms=2, max_terms=2, max_operand=9)
    from fp8rl.backends.mini.model import build_model
    from fp8rl.backends.mini.sft import train_sft

    model = build_model("8b", TOK.vocab_size, max_positions=64, seed=0)
    losses = train_sft(model, train, TOK, m)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_sft_batch_layout():
    train, _ = make_splits(0, 4, 1, min_terms=2, max_terms=3, max_operand=9)
    p_ids, p_mask, r_ids, r_mask = sft_batch(train, TOK)
    for i, p in enumerate(train):
        assert TOK.decode(p_ids[i][p_mask[i].bool()]) == p.prompt
        assert TOK.decode(r_ids[i]) == p.solution
        assert int(r_mask[i].sum()) == len(p.solution) + 1  # + <eos>


def test_the_slip_rate_changes_what_the_warm_start_trains_on(monkeypatch):
    """With ``sft_slip_rate`` the warm start's batches carry the slipped demonstrations (per step
    stream ``slip/<sft_seed>/<step>``); without it, the references (and the same batches)."""
    import random

    from fp8rl.backends.mini import sft as sft_mod
    from fp8rl.backends.mini.model import build_model
    from fp8rl.backends.mini.task import slipped_solution

    train, _ = make_splits(0, 200, 4, min_terms=7, max_terms=9, max_operand=20)
    seen: list[tuple[list, list]] = []
    real = sft_mod.sft_batch

    def spy(problems, tok, solutions=None):
        seen.append((list(problems), solutions))
        return real(problems, tok, solutions)

    monkeypatch.setattr(sft_mod, "sft_batch", spy)
    runs = {}
    for rate in (0.0, 0.6):
        seen.clear()
        model = build_model("8b", TOK.vocab_size, max_positions=128, seed=0)
        sft_mod.train_sft(model, train, TOK, _mini(min_terms=7, max_terms=9, max_operand=20,
                                                   n_train=200, sft_slip_rate=rate, sft_steps=3))
        runs[rate] = list(seen)
    for (p0, s0), (p6, _s6) in zip(runs[0.0], runs[0.6], strict=True):
        assert p0 == p6 and s0 is None  # the same problems drawn; references at rate 0
    n_diff = 0
    for step, (problems, sols) in enumerate(runs[0.6]):
        slip = random.Random(f"slip/0/{step}")
        assert sols == [slipped_solution(p, slip, 0.6) for p in problems]
        n_diff += sum(s != p.solution for s, p in zip(sols, problems, strict=True))
    assert n_diff > 5
