"""The BF16 evaluation at paper scale (``openrlhf.eval_bf16``): from the config to the evaluation
command, the plan of engines, and the rows and summary keys the evaluation writes (fake
generators here; vLLM's CPU build in tests/integration/test_int_eval_bf16.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from orl_helpers import FIXTURES, main_table_configs

from fp8rl.backends.openrlhf.data import prepare
from fp8rl.backends.openrlhf.evaluate import EvalPass, evaluate_run, evaluation_plan
from fp8rl.backends.openrlhf.grading import GradingPool
from fp8rl.backends.openrlhf.run import describe, evaluate_command, resolve_run_dir
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M


@pytest.fixture(scope="module")
def pool():
    p = GradingPool(workers=2, timeout_s=20.0)
    yield p
    p.close()


def _cell(tmp_path, fp8: str = "tensorwise", **openrlhf):
    """One main-table cell (GRPO, 8b, vanilla) from the YAML tree, with ``openrlhf`` overrides."""
    cfg = next(c for (a, m, f, cl), c in main_table_configs(tmp_path)
               if (a, m, f, cl) == ("grpo", "8b", fp8, "vanilla"))
    return dataclasses.replace(cfg, openrlhf=dataclasses.replace(cfg.openrlhf, **openrlhf))


def test_the_option_reaches_the_evaluation_command_and_the_dry_run(tmp_path):
    off, on = _cell(tmp_path), _cell(tmp_path, eval_bf16=True)
    assert off.openrlhf.eval_bf16 is False  # sweeps/backend/openrlhf.yaml's default
    assert evaluate_command(off, tmp_path)[-1] == "--no-bf16"
    cmd = evaluate_command(on, tmp_path)
    assert cmd[1:4] == ["-m", "experiments.evaluate", str(tmp_path)] and cmd[-1] == "--bf16"
    from fp8rl.launch.profiles import Resources

    res = Resources(nodes=1, gpus_per_node=8)
    lines = {n: [ln for ln in describe(c, res, tmp_path) if ln.lstrip().startswith("evaluate:")]
             for n, c in (("off", off), ("on", on))}
    assert lines["off"] == ["    evaluate:  checkpoint/final with vLLM fp8_per_tensor (eval/)"]
    assert lines["on"] == ["    evaluate:  checkpoint/final with vLLM fp8_per_tensor (eval/); base model and "
                           "checkpoint/final with vLLM bf16 (eval_bf16/, openrlhf.eval_bf16)"]
    # outside the run identity (it changes no training): turning it on resumes the same run
    assert resolve_run_dir(off) == resolve_run_dir(on)


def test_the_option_needs_the_evaluation_after_training(tmp_path):
    with pytest.raises(ValueError, match=r"eval_bf16.*final_eval"):
        _cell(tmp_path, eval_bf16=True, final_eval=False)


def test_experiments_evaluate_passes_the_option(monkeypatch):
    import experiments.evaluate as ev
    import fp8rl.backends.openrlhf.evaluate as E

    got = []
    monkeypatch.setattr(E, "evaluate_run", lambda run_dir, **kw: got.append(kw["bf16"]) or {})
    for argv, want in ((["r", "--bf16"], True), (["r", "--no-bf16"], False), (["r"], None)):
        assert ev.main(argv) == 0
        assert got[-1] is want


def _config(tmp_path, data, recipe: str, eval_bf16: bool) -> dict:
    return {"openrlhf": {"eval_sets": ["aime24", "math500"], "vllm_tp": {"8b": 1}, "data_dir": str(data),
                         "models": {"8b": "Qwen/Qwen3-8B-Base"}, "eval_bf16": eval_bf16},
            "fp8": {"rollout_recipe": recipe}, "model": {"slot": "8b"}, "eval_k": 4, "eval_temperature": 0.6,
            "max_response_len": 64, "output_dir": str(tmp_path / "sweep")}


def test_the_plan_names_each_engine(tmp_path):
    run = tmp_path / "run"
    final = str(run / "checkpoint" / "final")
    assert evaluation_plan(_config(tmp_path, tmp_path, "tensorwise", False), run) == [
        EvalPass("final", final, "fp8_per_tensor", M.EVAL_OWN)]
    assert evaluation_plan(_config(tmp_path, tmp_path, "rowwise", True), run) == [
        EvalPass("final", final, "fp8_per_channel", M.EVAL_OWN),
        EvalPass("initial", "Qwen/Qwen3-8B-Base", None, M.EVAL_BF16),
        EvalPass("final", final, None, M.EVAL_BF16)]
    bf16 = evaluation_plan(_config(tmp_path, tmp_path, "bf16", False), run, bf16=True)  # the flag wins
    assert [p.engine for p in bf16] == [(final, None), ("Qwen/Qwen3-8B-Base", None), (final, None)]
    with pytest.raises(ValueError, match="supported FP8 rollout recipes"):
        evaluation_plan(_config(tmp_path, tmp_path, "mxfp8", True), run)


#: What each fake engine answers: (model, quantization) -> (aime24 answers, math500 answers).
ANSWERS = {
    ("base", None): (["no"] * 4, ["\\boxed{1}"] * 4),                                    # 0/4, 0/4
    ("final", "fp8_per_tensor"): (["\\boxed{24}", "\\boxed{23}", "no", "no"], ["no"] * 4),  # 1/4, 0/4
    ("final", None): (["\\boxed{24}"] * 3 + ["no"], ["\\boxed{1}"] * 4),                  # 3/4, 0/4
}


def _fake_engines(calls: list):
    """Engines that record every generation: ``(model, quantization)``."""
    def engines(model: str, quantization):
        name = "final" if model.endswith("final") else "base"

        def generate(prompts, k, temperature, max_tokens):
            calls.append((name, quantization))
            aime, math500 = ANSWERS[(name, quantization)]
            return [aime if "2^{10}" in p else math500 for p in prompts]

        generate.state = {"digest": f"{name}/{quantization}"}  # what a real engine's digest names
        return generate

    return engines


@pytest.mark.parametrize("recipe", ["tensorwise", "bf16"])
def test_evaluation_writes_both_engines(tmp_path, pool, recipe):
    """The arm's own engine scores the final checkpoint (``eval/``); the BF16 engine the base
    model at step 0 and the final checkpoint (``eval_bf16/``); each engine generates once (a BF16
    arm's own engine is the BF16 engine); summary and rows carry each where it belongs."""
    data = tmp_path / "data"
    prepare(["aime24", "math500"], data, {}, sources={"aime24": str(FIXTURES / "aime24.jsonl"),
                                                      "math500": str(FIXTURES / "math500.jsonl")})
    rd = RunDir(tmp_path / "sweep" / f"grpo-8b-{recipe}-vanilla-s0-00000000").init(
        _config(tmp_path, data, recipe, True))
    rd.metrics_path.write_text('{"step": 1}\n{"step": 7}\n')
    rd.eval_path.write_text('{"step": 7, "dataset": "aime24", "k": 4, "n": 1, "eval/aime24/avg@k": 0.0}\n')
    rd.write_summary({"state": "DONE"})
    calls = []
    res = evaluate_run(rd.path, pool=pool, engines=_fake_engines(calls))
    own_q = "fp8_per_tensor" if recipe == "tensorwise" else None
    assert calls == ([("final", own_q), ("base", None), ("final", None)] if own_q else
                     [("final", None), ("base", None)]) * 2  # per dataset
    want_own = sum("24" in a for a in ANSWERS[("final", own_q)][0]) / 4
    assert res["aime24"]["avg@k"] == want_own and res["aime24"]["bf16"]["avg@k"] == 0.75
    assert res["aime24"]["bf16_initial"]["avg@k"] == 0.0
    s = rd.summary()
    assert s["eval/aime24/avg@k"] == want_own and s["eval_bf16/aime24/avg@k"] == 0.75
    assert s["eval_bf16/aime24/pass@k"] == 1.0 and s["eval_bf16/aime24/avg@k/initial"] == 0.0
    weights = s["final_eval"].pop("weights")
    assert s["final_eval"] == {"k": 4, "step": 7, "quantization": own_q, "bf16": True}
    # what each pass scored: the pass's step and model, and the digest its own engine reported
    assert [(w["pass"], w["precision"], w["step"], w["model"], w["quantization"], w["digest"]) for w in weights] == [
        ("final", "own", 7, "checkpoint/final", own_q, f"final/{own_q}"),
        ("initial", "bf16", 0, "Qwen/Qwen3-8B-Base", None, "base/None"),
        ("final", "bf16", 7, "checkpoint/final", None, "final/None")]
    rows = rd.read_eval()
    assert [(r["step"], r.get("source")) for r in rows] == [(0, "final"), (0, "final"), (7, None),
                                                            (7, "final"), (7, "final")]
    step0 = [r for r in rows if r["step"] == 0]
    assert all(not any(k.startswith("eval/") for k in r) for r in step0)  # the BF16 engine alone
    aime = {r["step"]: r for r in rows if r["dataset"] == "aime24" and r.get("source") == "final"}
    assert aime[0]["eval_bf16/aime24/avg@k"] == 0.0
    assert aime[7]["eval/aime24/avg@k"] == want_own and aime[7]["eval_bf16/aime24/avg@k"] == 0.75
    evaluate_run(rd.path, pool=pool, engines=_fake_engines([]))  # a rerun replaces its rows
    assert rd.read_eval() == rows


def test_without_the_option_the_evaluation_is_the_arms_own_engine_only(tmp_path, pool):
    data = tmp_path / "data"
    prepare(["aime24", "math500"], data, {}, sources={"aime24": str(FIXTURES / "aime24.jsonl"),
                                                      "math500": str(FIXTURES / "math500.jsonl")})
    rd = RunDir(tmp_path / "sweep" / "grpo-8b-tensorwise-vanilla-s0-00000000").init(
        _config(tmp_path, data, "tensorwise", False))
    rd.metrics_path.write_text('{"step": 3}\n')
    calls = []
    evaluate_run(rd.path, pool=pool, engines=_fake_engines(calls))
    assert calls == [("final", "fp8_per_tensor")] * 2
    assert not any(k.startswith(M.EVAL_BF16_PREFIX) for r in rd.read_eval() for k in r)
    assert not any(k.startswith(M.EVAL_BF16_PREFIX) for k in rd.summary())


def test_the_smoke_job_dump_holds_every_generation(tmp_path, pool):
    """With ``openrlhf.dump_loss_inputs`` the pass writes each engine's generations per dataset,
    with the sampling settings its generator reported and the scores computed from them."""
    data = tmp_path / "data"
    prepare(["aime24", "math500"], data, {}, sources={"aime24": str(FIXTURES / "aime24.jsonl"),
                                                      "math500": str(FIXTURES / "math500.jsonl")})
    cfg = _config(tmp_path, data, "tensorwise", False)
    cfg["openrlhf"]["dump_loss_inputs"] = True
    rd = RunDir(tmp_path / "sweep" / "grpo-8b-tensorwise-vanilla-s0-00000000").init(cfg)
    rd.metrics_path.write_text('{"step": 3}\n')
    rd.write_summary({"state": "DONE"})

    def engines(model, quantization):
        def generate(prompts, k, temperature, max_tokens):
            generate.state["params"] = {"n": k, "temperature": temperature, "max_tokens": max_tokens}
            return [["\\boxed{24}"] * k for _ in prompts]

        generate.state = {}
        return generate

    evaluate_run(rd.path, pool=pool, engines=engines)
    rows = [json.loads(ln) for ln in (rd.path / "openrlhf" / "dumps" / "final_eval.jsonl").read_text().splitlines()]
    assert [(r["dataset"], r["model"], r["quantization"]) for r in rows] == [
        ("aime24", "checkpoint/final", "fp8_per_tensor"), ("math500", "checkpoint/final", "fp8_per_tensor")]
    assert all(r["params"] == {"n": 4, "temperature": 0.6, "max_tokens": 64} for r in rows)
    assert [len(r["responses"]) for r in rows] == [len(r["prompts"]) for r in rows] == [len(r["labels"]) for r in rows]
    assert rows[0]["scores"]["avg@k"] == rd.summary()["eval/aime24/avg@k"]
