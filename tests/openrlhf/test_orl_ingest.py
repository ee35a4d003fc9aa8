"""Ingestion of a recorded OpenRLHF 0.11.2 driver log into metrics.jsonl / eval.jsonl."""

import json
import shutil

import pytest
from orl_helpers import FIXTURES

from fp8rl.backends.openrlhf.ingest import ingest, map_step, parse_dict, parse_log
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

LOG = FIXTURES / "openrlhf_0.11.2_driver.log"


@pytest.fixture
def run_dir(tmp_path):
    rd = RunDir(tmp_path / "grpo-8b-tensorwise-calibrated-s0-00000000").init({"x": 1})
    (rd.path / "openrlhf").mkdir()
    shutil.copy(LOG, rd.path / "openrlhf" / "driver.1.log")
    return rd


def test_recorded_log_to_shared_metric_names(run_dir):
    stats = ingest(run_dir.path, eval_sizes={"aime24": 30, "math500": 500})
    assert stats == {"steps": 2, "evals": 2, "last_step": 2}
    rows = run_dir.read_metrics()
    assert [r["step"] for r in rows] == [1, 2]
    s1, s2 = rows
    assert s1[M.ACTOR_ENTROPY] == 0.52 and s1[M.ACTOR_PG_LOSS] == 0.0123
    assert s1[M.ACTOR_GRAD_NORM] == 0.41 and s1[M.ACTOR_CLIPFRAC] == 0.0031 and s1[M.ACTOR_PPO_KL] == 1.2e-05
    assert s1[M.ROLLOUT_MISMATCH_KL] == 0.0011  # the plugin's k3; vllm_kl (k1) kept beside it
    assert s1["rollout/mismatch_k1"] == 0.0009
    assert s1[M.ROLLOUT_IS_CLIPFRAC] == 0.0012
    assert s1[M.ACTOR_CLIPFRAC_NEG_LOW] == 0.0021 and s1[M.CLIP_LOW] == 0.7 and s1[M.CLIP_ALPHA] == 0.0008
    assert s1[M.SHADOW_CLIPFRAC_NEG_LOW] == 0.0008 and s1[M.SHADOW_RATIO_NEG_Q01] == 0.91
    assert s1[M.ROLLOUT_REWARD_MEAN] == 0.3125 and s1[M.ROLLOUT_RESPONSE_LEN] == 2304.5
    assert s1[M.ROLLOUT_TRUNCATED_FRAC] == 0.01 and s1[M.ROLLOUT_ACC] == 0.31
    assert s1[M.ROLLOUT_GARBLED_FRAC] == 0.02
    assert s1[M.PERF_STEP_S] == 263.8 and s1[M.PERF_ROLLOUT_S] == 140.2 and s1[M.PERF_TRAIN_S] == 88.1
    assert s1["openrlhf/timing/broadcast"] == 4.3  # unknown keys are kept under openrlhf/
    # step 2 was logged twice (preemption, resume): the later attempt wins
    assert s2[M.ACTOR_PG_LOSS] == -0.005 and s2[M.DAPO_KEPT_GROUP_FRAC] == 0.62
    assert s2[M.ROLLOUT_MISMATCH_KL] == 0.0011  # no plugin k3 in that line: vllm_kl fills it


def test_eval_rows(run_dir):
    ingest(run_dir.path, eval_sizes={"aime24": 30, "math500": 500})
    rows = {r["dataset"]: r for r in run_dir.read_eval()}
    assert set(rows) == {"aime24", "math500"}
    a = rows["aime24"]
    assert a["step"] == 2 and a["k"] == 16 and a["n"] == 30
    assert a["eval/aime24/avg@k"] == 0.125 and a["eval/aime24/pass@k"] == 0.4


def test_final_eval_rows_survive_reingestion(run_dir):
    final = {**M.eval_row(2, "amc23", avg_at_k=0.5, pass_at_k=0.8, k=16, n=40), "source": "final"}
    run_dir.eval_path.write_text(json.dumps(final) + "\n")
    ingest(run_dir.path)
    assert any(r.get("source") == "final" for r in run_dir.read_eval())


def test_parse_edge_cases():
    assert parse_dict("{'a': nan, 'b': inf, 'c': [1, 2]}")["b"] == float("inf")
    assert map_step({"a": float("nan"), "generated_samples": ["x", 1.0]}) == {"openrlhf/a": None}
    steps, evals = parse_log(["no step here", "Global step 3: {'policy_loss': 1}"])
    assert steps == {3: {"policy_loss": 1}} and evals == {}
    with pytest.raises((ValueError, SyntaxError)):
        parse_dict("{'a': __import__('os')}")
