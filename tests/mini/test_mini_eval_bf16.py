"""The BF16 evaluation of the mini backend: every evaluation also scores the same weights with a
BF16 engine (``eval_bf16/`` keys), paired with the arm's own evaluation (same problems, same seed).

References: a BF16 engine built here from the warm start (the ``bf16`` rollout recipe, no FP8
layer) and synced from the trained policy; a BF16 arm's own evaluation of the same warm start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8rl.backends.mini import run_mini, trainer_eval
from fp8rl.backends.mini import trainer as T
from fp8rl.backends.mini.batch import left_pad
from fp8rl.backends.mini.evaluate import evaluate
from fp8rl.backends.mini.rollout import RolloutEngine
from fp8rl.backends.mini.runtime import seed_for, torch_settings
from fp8rl.backends.mini.sft import warm_start
from fp8rl.backends.mini.trainer import MiniTrainer
from fp8rl.quant.rollout import Fp8InferenceLinear
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

DS = "arith"
OWN = {s: M.eval_key(DS, s) for s in M.EVAL_STATS}
BF16 = {s: M.eval_key(DS, s, precision=M.EVAL_BF16) for s in M.EVAL_STATS}


def _own(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(M.EVAL_BF16_PREFIX)}


def _bf16_as_own(row: dict) -> dict:
    """The BF16 part of a row with ``eval/`` keys (comparable with a BF16 engine's own row)."""
    out = {k: v for k, v in row.items() if "/" not in k}
    out.update({M.EVAL_PREFIX + k[len(M.EVAL_BF16_PREFIX):]: v for k, v in row.items()
                if k.startswith(M.EVAL_BF16_PREFIX)})
    return out


def _reference_bf16_row(trainer: MiniTrainer, step: int) -> dict:
    """What a BF16 engine gives on the trainer's current weights: an engine built here from the
    warm start with the ``bf16`` recipe, synced from the policy, evaluated with the run's seed."""
    cfg = trainer.cfg
    base, _ = warm_start(cfg.model.slot, trainer.train_set, trainer.tok, cfg.mini, cfg.mini.cache_dir)
    engine = RolloutEngine(base, "bf16", emulate=True, dtype=torch.bfloat16)
    assert not _has_fp8_layers(engine.model)
    engine.sync(trainer.policy)
    gen = torch.Generator().manual_seed(seed_for(cfg.seed, "eval"))
    res = evaluate(engine, trainer.eval_set, trainer.tok, k=cfg.eval_k, temperature=cfg.eval_temperature,
                   max_new_tokens=cfg.max_response_len, generator=gen, device=trainer.device, greedy=cfg.eval_greedy)
    row = M.eval_row(step, DS, avg_at_k=res["avg@k"], pass_at_k=res["pass@k"], k=res["k"], n=res["n"])
    row[f"eval/{DS}/garbled_frac"] = res["garbled_frac"]
    row[OWN["greedy"]] = res["greedy"]
    return row


def _trained(cfg) -> MiniTrainer:
    """A trainer of ``cfg`` after its run (no run directory)."""
    with torch_settings(cfg.mini.deterministic, cfg.mini.num_threads, cfg.mini.device):
        t = MiniTrainer(cfg, None, sft_cache=cfg.mini.cache_dir)
        assert t.run()["state"] == "DONE"
    return t


def _has_fp8_layers(model: torch.nn.Module) -> bool:
    """Any FP8 module: the rollout path's W8A8 linears, or a trainer's FP8 linears (ours, torchao)."""
    return any(isinstance(m, Fp8InferenceLinear) or type(m).__module__.startswith(("fp8rl.quant", "torchao"))
               for m in model.modules())


def _spy(monkeypatch) -> list[dict]:
    """Record every call of the evaluation: the engine's recipe, whether it holds FP8 layers, its
    weights, and the sampler's state (the seed) at the call."""
    calls: list[dict] = []
    real = trainer_eval.evaluate

    def spy(engine, problems, tok, *, generator, **kw):
        calls.append({"recipe": engine.recipe.name, "engine": engine, "fp8_layers": _has_fp8_layers(engine.model),
                      "weights": {k: v.clone() for k, v in engine.model.state_dict().items()},
                      "rng": generator.get_state().clone()})
        return real(engine, problems, tok, generator=generator, **kw)

    monkeypatch.setattr(trainer_eval, "evaluate", spy)
    return calls


@pytest.mark.parametrize("arm", ["tensorwise", "rollout_only"])
def test_fp8_rollout_arms_are_also_scored_by_a_bf16_engine(tiny, arm, monkeypatch):
    """An FP8-rollout arm's ``eval_bf16/`` keys are a BF16 engine's evaluation of its current
    weights: the engine has no FP8 layer, holds the policy's weights rounded to BF16 (synced at
    this step), samples from the same seed as the arm's own evaluation, and its numbers equal a
    BF16 engine built independently on the same weights."""
    calls = _spy(monkeypatch)
    # a seed of its own: nothing in the step-0 cache, so step 0 is computed here too
    cfg = tiny(arm, "tis", steps=2, eval_every=0, eval_k=8, seed={"tensorwise": 9101, "rollout_only": 9102}[arm])
    t = _trained(cfg)
    evals = [h["eval"] for h in t.history if "eval" in h]
    assert [e["step"] for e in evals] == [0, 2]
    final = evals[-1]
    assert set(BF16.values()) <= set(final) and f"eval_bf16/{DS}/garbled_frac" in final
    # step 0 and the end: the arm's engine, then the BF16 engine
    assert len(calls) == 4
    base, _ = warm_start(cfg.model.slot, t.train_set, t.tok, cfg.mini, cfg.mini.cache_dir)
    weights = {0: {k: v.detach() for k, v in base.state_dict().items()},
               2: {k: v.detach() for k, v in t.policy.state_dict().items()}}
    for step, (own_call, bf16_call) in zip((0, 2), (calls[:2], calls[2:]), strict=True):
        assert own_call["engine"] is t.engine and own_call["recipe"] == cfg.fp8.rollout_recipe
        assert own_call["fp8_layers"]
        assert bf16_call["engine"] is not t.engine and bf16_call["recipe"] == "bf16" and not bf16_call["fp8_layers"]
        assert torch.equal(own_call["rng"], bf16_call["rng"])  # paired: the same sampling seed
        for k, w in bf16_call["weights"].items():  # the step's weights (synced now), rounded to BF16
            assert torch.equal(w, weights[step][k].to(torch.bfloat16).to(w.dtype)), (step, k)
    assert _bf16_as_own(final) == _reference_bf16_row(t, 2)
    # the two engines compute different log-probs on the same tokens (so the comparison with the
    # reference can tell them apart even where 4 problems give the same accuracy)
    ids, mask = left_pad([t.tok.encode(p.prompt, bos=True) for p in t.eval_set], t.tok.pad_id)
    lp = [e.generate(ids, mask, max_new_tokens=8, temperature=1.0, eos_id=t.tok.eos_id, pad_id=t.tok.pad_id,
                     generator=None, greedy=True).rollout_log_probs for e in (t.engine, calls[-1]["engine"])]
    assert not torch.equal(*lp)


def test_a_bf16_arm_reuses_its_own_evaluation_which_is_the_bf16_engines(tiny, monkeypatch):
    """A BF16-rollout arm evaluates once: ``eval_bf16/`` repeats ``eval/``, and those are the
    numbers of a BF16 engine built independently on the same weights."""
    calls = _spy(monkeypatch)
    cfg = tiny("bf16", "vanilla", steps=2, eval_every=0, eval_k=8)
    t = _trained(cfg)
    final = [h["eval"] for h in t.history if "eval" in h][-1]
    assert all(c["engine"] is t.engine for c in calls) and len(calls) in (1, 2)  # step 0 may be cached
    for s in M.EVAL_STATS:
        assert final[BF16[s]] == final[OWN[s]]
    assert _bf16_as_own(final) == _own(final) == _reference_bf16_row(t, 2)


def test_the_bf16_evaluation_changes_nothing_else(tiny, tmp_path, monkeypatch):
    """Training and the arm's own evaluation are those of a run without the BF16 evaluation
    (``MiniTrainer(bf16_eval=False)``): every metric (timings aside) and every ``eval/`` value,
    bit for bit."""
    kw = dict(steps=3, eval_every=2, samples_every=0, seed=7)
    with_bf16 = run_mini(tiny("tensorwise", "calibrated", run_dir=str(tmp_path / "with"), **kw))
    init = MiniTrainer.__init__
    monkeypatch.setattr(MiniTrainer, "__init__", lambda self, *a, **k: init(self, *a, **k, bf16_eval=False))
    monkeypatch.setattr(MiniTrainer, "bf16_eval_engine", lambda self: pytest.fail("BF16 engine used"))
    without = run_mini(tiny("tensorwise", "calibrated", run_dir=str(tmp_path / "without"), **kw))

    def no_perf(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    a, b = RunDir(with_bf16["run_dir"]), RunDir(without["run_dir"])
    assert no_perf(a.read_metrics()) == no_perf(b.read_metrics())
    ea, eb = a.read_eval(), b.read_eval()
    assert [e["step"] for e in ea] == [0, 2, 3]
    assert [_own(e) for e in ea] == eb
    assert all(set(BF16.values()) <= set(e) for e in ea) and not any(BF16[M.EVAL_AVG] in e for e in eb)


def test_summary_has_the_bf16_evaluation(tiny):
    s = run_mini(tiny("rollout_only", "vanilla", steps=2, eval_every=1))
    ev = RunDir(s["run_dir"]).read_eval()
    avg, pas = BF16[M.EVAL_AVG], BF16[M.EVAL_PASS]
    assert s[avg] == ev[-1][avg] and s[pas] == ev[-1][pas]
    assert s[f"{avg}/initial"] == ev[0][avg] and s[f"{avg}/best"] == max(e[avg] for e in ev)
    assert s[OWN[M.EVAL_AVG]] == ev[-1][OWN[M.EVAL_AVG]]  # the arm's own, as before


def test_summary_reads_each_engines_first_last_and_best_row():
    """``stats.run_summary`` on a history with distinct values: final, initial and best of each
    engine; a history whose first rows lack the BF16 keys (a run resumed across the change) has no
    BF16 initial value instead of a later one."""
    from fp8rl.backends.mini.stats import run_summary

    def ev(step, own, bf16=None):
        row = M.eval_row(step, DS, avg_at_k=own, pass_at_k=own + 0.1, k=2, n=4)
        if bf16 is not None:
            row.update({BF16[M.EVAL_AVG]: bf16, BF16[M.EVAL_PASS]: bf16 + 0.2})
        return {"eval": row}

    kw = dict(steps=4, wall_s=1.0, state="DONE", reason=None, skipped_updates=0, sft_meta={})
    s = run_summary([ev(0, 0.5, 0.6), {"step": 1}, ev(2, 0.7, 0.9), ev(4, 0.55, 0.65)], **kw)
    avg, pas = BF16[M.EVAL_AVG], BF16[M.EVAL_PASS]
    assert (s[avg], s[pas], s[f"{avg}/initial"], s[f"{avg}/best"]) == (0.65, 0.65 + 0.2, 0.6, 0.9)
    assert (s[OWN[M.EVAL_AVG]], s[f"{OWN[M.EVAL_AVG]}/initial"], s[f"{OWN[M.EVAL_AVG]}/best"]) == (0.55, 0.5, 0.7)
    resumed = run_summary([ev(0, 0.5), ev(2, 0.7, 0.9), ev(4, 0.55, 0.65)], **kw)
    assert resumed[f"{avg}/initial"] is None and resumed[avg] == 0.65
    assert not any(k.startswith(M.EVAL_BF16_PREFIX) for k in run_summary([ev(0, 0.5), ev(4, 0.55)], **kw))


def test_step0_bf16_evaluation_is_the_bf16_arms_own(tiny, tmp_path):
    """At step 0 the weights are the warm start for every arm, so an FP8 arm's BF16 evaluation is
    the BF16 arm's own evaluation (same seed), read from the same cache entry; each engine has one
    entry (the cache key names the engine), and a damaged entry is recomputed to the same row."""
    seed = 5151
    cache = Path(tiny("bf16").mini.cache_dir)

    def entries() -> set[Path]:  # this test's entries (tests on other workers share the cache)
        def seed_of(p: Path):
            try:
                return json.loads(p.read_text())["spec"]["seed"]
            except ValueError:  # another test's deliberately damaged entry
                return None

        return {p for p in cache.glob("*/eval0-*.json") if seed_of(p) == seed}

    before = entries()
    fp8 = run_mini(tiny("tensorwise", "vanilla", steps=1, seed=seed, run_dir=str(tmp_path / "fp8")))
    added = sorted(entries() - before)
    assert len(added) == 2  # the tensorwise engine's and the BF16 engine's
    specs = sorted(json.loads(p.read_text())["spec"]["rollout_recipe"] for p in added)
    assert specs == ["bf16", "tensorwise"]
    bf16 = run_mini(tiny("bf16", "vanilla", steps=1, seed=seed, run_dir=str(tmp_path / "bf16")))
    assert entries() - before == set(added)  # the BF16 arm read its entry
    e_fp8, e_bf16 = RunDir(fp8["run_dir"]).read_eval()[0], RunDir(bf16["run_dir"]).read_eval()[0]
    assert _bf16_as_own(e_fp8) == _own(e_bf16) == _bf16_as_own(e_bf16)
    entry = {json.loads(p.read_text())["spec"]["rollout_recipe"]: json.loads(p.read_text())["row"] for p in added}
    assert entry == {"tensorwise": _own(e_fp8), "bf16": _bf16_as_own(e_fp8)}
    for p in added:  # computed again from scratch: the same rows
        p.write_text("{damaged", encoding="utf-8")
    again = run_mini(tiny("tensorwise", "vanilla", steps=1, seed=seed, run_dir=str(tmp_path / "again")))
    assert RunDir(again["run_dir"]).read_eval()[0] == e_fp8


def test_with_bf16_refuses_rows_of_another_evaluation():
    own = M.eval_row(2, DS, avg_at_k=0.5, pass_at_k=1.0, k=2, n=4)
    bf16 = M.eval_row(3, DS, avg_at_k=0.25, pass_at_k=0.5, k=2, n=4)
    with pytest.raises(ValueError, match="not the same evaluation"):
        trainer_eval.with_bf16(own, bf16)
    row = trainer_eval.with_bf16(own, {**bf16, "step": 2})
    assert row == {**own, BF16[M.EVAL_AVG]: 0.25, BF16[M.EVAL_PASS]: 0.5}


def test_step0_cache_key_names_the_cpu_kernels(tiny, monkeypatch):
    """Another CPU kernel level (a cluster node with another CPU sharing the cache's file system,
    or ``ATEN_CPU_CAPABILITY``) computes other bits: it must not read this level's entry."""
    from types import SimpleNamespace

    from fp8rl.backends.mini.numerics import fingerprint

    me = SimpleNamespace(cfg=tiny("tensorwise", "vanilla"), device=torch.device("cpu"))
    here = T.MiniTrainer._eval0_spec(me, "tensorwise")
    assert here["kernels"] == fingerprint()["key"]  # the kernel level and the probe of the kernels' bits
    assert torch.backends.cpu.get_cpu_capability() in here["kernels"]
    monkeypatch.setattr(trainer_eval, "numerics_key", lambda device: "another machine's numerics")
    assert T.MiniTrainer._eval0_spec(me, "tensorwise") != here
