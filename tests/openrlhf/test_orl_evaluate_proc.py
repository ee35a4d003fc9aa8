"""Final-evaluation bookkeeping with a fake generator; the FP8 rollout checkpoint layout; dry run."""

import subprocess
import sys

import pytest
from orl_helpers import FIXTURES, REPO

from fp8rl.backends.openrlhf.data import prepare
from fp8rl.backends.openrlhf.evaluate import evaluate_run, pass_at_k, score_dataset
from fp8rl.backends.openrlhf.grading import GradingPool
from fp8rl.runs import RunDir


@pytest.fixture(scope="module")
def pool():
    p = GradingPool(workers=2, timeout_s=20.0)
    yield p
    p.close()


def test_pass_at_k_reference():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_evaluate_run_with_fake_generator(tmp_path, pool):
    data = tmp_path / "data"
    prepare(["aime24", "math500"], data, {}, sources={"aime24": str(FIXTURES / "aime24.jsonl"),
                                                      "math500": str(FIXTURES / "math500.jsonl")})
    cfg = {"openrlhf": {"eval_sets": ["aime24", "math500"], "vllm_tp": {"8b": 1}, "data_dir": str(data)},
           "fp8": {"rollout_recipe": "bf16"}, "model": {"slot": "8b"}, "eval_k": 4, "eval_temperature": 0.6, "max_response_len": 64,
           "output_dir": str(tmp_path / "sweep")}
    rd = RunDir(tmp_path / "sweep" / "grpo-8b-bf16-vanilla-s0-00000000").init(cfg)
    rd.metrics_path.write_text('{"step": 1}\n{"step": 7}\n')
    rd.write_summary({"state": "DONE"})
    answers = {"aime24": ["\\boxed{24}", "\\boxed{23}", "no", "\\boxed{24}"],  # 2 of 4 correct
               "math500": ["\\boxed{1}"] * 4}                               # none correct
    seen = []

    def fake(prompts, k, temperature, max_tokens):
        seen.append((len(prompts), k, temperature, max_tokens))
        ds = "aime24" if "2^{10}" in prompts[0] else "math500"
        return [answers[ds] for _ in prompts]

    res = evaluate_run(rd.path, fake, pool=pool)
    assert seen == [(1, 4, 0.6, 64), (1, 4, 0.6, 64)]
    assert res["aime24"] == {"avg@k": 0.5, "pass@k": 1.0, "n": 1, "k": 4}
    assert res["math500"]["avg@k"] == 0.0 and res["math500"]["pass@k"] == 0.0
    summary = rd.summary()
    assert summary["eval/aime24/avg@k"] == 0.5 and summary["eval/math500/pass@k"] == 0.0 and summary["state"] == "DONE"
    rows = [r for r in rd.read_eval() if r["dataset"] == "aime24"]
    assert rows[-1]["step"] == 7 and rows[-1]["source"] == "final" and rows[-1]["k"] == 4
    evaluate_run(rd.path, fake, pool=pool)  # idempotent: final rows replaced, not duplicated
    assert len(rd.read_eval()) == 2


def test_score_dataset_rejects_wrong_shapes(pool):
    with pytest.raises(ValueError, match="responses per problem"):
        score_dataset(["1"], [""], [["\\boxed{1}"]], k=2, pool=pool)


def test_rollout_recipes_map_to_vllm_online_fp8_or_are_rejected():
    """Defect 4: rowwise rollout is vLLM's per-channel online FP8 (per-token activations); a recipe
    vLLM 0.29 has no online method for is rejected naming the supported ones."""
    from fp8rl.backends.openrlhf.plugin import (
        PluginSpec,
        check_rollout_recipe,
        rollout_engine_kwargs,
    )

    want = {"tensorwise": "fp8_per_tensor", "rowwise": "fp8_per_channel", "blockwise": "fp8_per_block"}
    for recipe, quant in want.items():
        kw = rollout_engine_kwargs(PluginSpec(rollout_recipe=recipe))
        assert kw == {"quantization": quant,
                      "worker_extension_cls": "fp8rl.backends.openrlhf.plugin.binding.Fp8WorkerWrap"}
    assert rollout_engine_kwargs(PluginSpec()) == {}
    with pytest.raises(ValueError, match=r"supported FP8 rollout recipes: \['blockwise', 'rowwise', 'tensorwise'\]"):
        check_rollout_recipe("mxfp8")


def test_driver_injects_fp8_engine_kwargs():
    from fp8rl.backends.openrlhf.plugin import PluginSpec, install_driver

    got = {}

    class FakeActor:
        @staticmethod
        def options(**opts):
            class H:
                @staticmethod
                def remote(**kw):
                    got.update(opts=opts, kw=kw)
            return H

    class Group:
        def async_init_model_from_pretrained(self, *a, **k):
            return []

    mod = type(sys)("vllm_engine")
    mod.RolloutRayActor = FakeActor
    launcher, ppo_actor = type(sys)("launcher"), type(sys)("ppo_actor")
    launcher.RayActorGroup, ppo_actor.PolicyModelActor = Group, object
    install_driver(PluginSpec(rollout_recipe="blockwise"),
                   modules={"vllm_engine": mod, "launcher": launcher, "ppo_actor": ppo_actor})
    mod.RolloutRayActor.options(num_gpus=1).remote(model="hf/id", dtype="bfloat16", worker_extension_cls="x")
    assert got["opts"] == {"num_gpus": 1}
    assert got["kw"]["model"] == "hf/id" and got["kw"]["quantization"] == "fp8_per_block"
    assert got["kw"]["dtype"] == "bfloat16" and got["kw"]["worker_extension_cls"].endswith("binding.Fp8WorkerWrap")
    assert Group._fp8rl_originals  # the attestation wrapper is in place (exercised in tests/integration)


def test_dry_run_prints_resources_and_openrlhf_command(tmp_path):
    """The README/docs command, on the 3 cells of one (algorithm, model, fp8) point of main_table."""
    cmd = [sys.executable, "-m", "experiments.launch", "+sweep=main_table", "scale=paper", "cluster=example",
           "dry_run=true", "algorithm=dapo", "model=14b", "fp8=blockwise", f"output_dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "3 cell(s) valid" in text
    assert text.count("    sbatch:    --nodes=2 --ntasks-per-node=1 --gpus-per-node=8") == 3
    assert text.count("    openrlhf:  python -m fp8rl.backends.openrlhf.driver -- ") == 3
    assert "--actor.model_name_or_path Qwen/Qwen3-14B-Base" in text and "--algo.dynamic_filtering_enable" in text
    assert "8 vLLM engine(s) x TP 2" in text
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
