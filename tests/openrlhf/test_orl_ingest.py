"""Ingestion of a recorded OpenRLHF 0.11.2 driver log into metrics.jsonl / eval.jsonl."""

import json
import shutil

import pytest
from orl_helpers import FIXTURES, openrlhf_dir
from orl_samples import FILTER_LABELS, load_samples_generator, make_generator

from fp8rl.backends.openrlhf.ingest import ingest, kept_group_frac, map_step, parse_dict, parse_log
from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

LOG = FIXTURES / "openrlhf_0.11.2_driver.log"


@pytest.fixture
def run_dir(tmp_path):
    rd = RunDir(tmp_path / "grpo-8b-tensorwise-calibrated-s0-00000000").init({"algorithm": {"n_samples_per_prompt": 8}})
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
    assert s2[M.ACTOR_PG_LOSS] == -0.005
    assert s2[M.DAPO_KEPT_GROUP_FRAC] == 0.64  # pass rate 512 = 128 groups x 8 samples / 200 prompts x 100
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


def _status_line(step: int, status: dict) -> str:
    """A ``Global step`` line as ``PPOTrainer.fit`` prints it (the f-string checked against the source)
    and as the paper-smoke job's driver log carries it (Ray's coloured actor prefix)."""
    return f"\x1b[36m(PPOTrainer pid=27281)\x1b[0m INFO 12-03 13:59:28 ppo_trainer.py:551] ✨ Global step {step}: {status}"


@pytest.mark.parametrize("prompts, labels, kept, drawn", [
    pytest.param(8, FILTER_LABELS, 3, 6, id="three-dropped"),
    pytest.param(8, {f"p{i}": "mixed" for i in range(8)}, 3, 3, id="none-dropped"),
    pytest.param(5, FILTER_LABELS, 2, 5, id="prompts-run-out"),
])
def test_kept_group_frac_from_upstreams_own_pass_rate(monkeypatch, tmp_path, prompts, labels, kept, drawn):
    """Upstream's ``generate_samples`` (real source, stand-in engines: ``orl_samples``) computes the
    pass rate; printed in ``PPOTrainer.fit``'s format and ingested, it reads kept groups / prompts
    drawn, in [0, 1] (1 when nothing is dropped: the raw rate is 400 at n = 4)."""
    fit = (openrlhf_dir() / "trainer" / "ppo_trainer.py").read_text()
    assert 'status["dynamic_filtering_pass_rate"] = filter_pass_rate' in fit
    assert 'logger.info(f"✨ Global step {global_step}: {log_status}")' in fit
    module = load_samples_generator(monkeypatch)
    gen, _ = make_generator(module, [], [f"p{i}" for i in range(prompts)], dynamic=True, labels=labels)
    samples, pass_rate, consumed, _ = gen.generate_samples()
    n = gen.args.rollout.n_samples_per_prompt
    assert (len(samples), consumed) == (kept * n, drawn) and pass_rate == pytest.approx(100 * n * kept / drawn)

    rd = RunDir(tmp_path / "dapo-14b-bf16-vanilla-s0-00000000").init(
        {"algorithm": {"name": "dapo", "n_samples_per_prompt": n}})
    (rd.path / "openrlhf").mkdir()
    (rd.path / "openrlhf" / "driver.1.log").write_text(
        _status_line(1, {"policy_loss": 0.1, "dynamic_filtering_pass_rate": pass_rate}) + "\n")
    ingest(rd.path)
    (row,) = rd.read_metrics()
    assert row[M.DAPO_KEPT_GROUP_FRAC] == pytest.approx(kept / drawn) and 0.0 < row[M.DAPO_KEPT_GROUP_FRAC] <= 1.0
    assert "openrlhf/dynamic_filtering_pass_rate" not in row


def test_kept_group_frac_bounds_and_bad_n():
    assert kept_group_frac(0.0, 4) == 0.0 and kept_group_frac(400.0, 4) == 1.0 and kept_group_frac(200, 8) == 0.25
    assert kept_group_frac(12 / 7 * 100, 4) == pytest.approx(3 / 7)  # as upstream computes it: 12 samples / 7 prompts
    for rate in (401.0, 800.0, -1.0):  # outside [0, 100 n]: the n given is not the run's
        with pytest.raises(ValueError, match="not the n"):
            kept_group_frac(rate, 4)
    for n in (0, -4, 2.5, True, "4", None):
        with pytest.raises(ValueError, match="integer >= 1"):
            kept_group_frac(100.0, n)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        map_step({"dynamic_filtering_pass_rate": 200.0})
    assert map_step({"dynamic_filtering_pass_rate": 200.0}, 4) == {M.DAPO_KEPT_GROUP_FRAC: 0.5}
    assert map_step({"dynamic_filtering_pass_rate": None, "policy_loss": 1.0}) == {M.ACTOR_PG_LOSS: 1.0}
    # the paper-smoke job's three DAPO steps (4 prompts a step, n = 4): 4 groups kept of 5, 6 and 4 drawn
    steps, _ = parse_log([_status_line(s, {"rollout/acc": 0.5, "dynamic_filtering_pass_rate": r})
                          for s, r in ((1, 320.0), (2, 266.66666666666663), (3, 400.0))])
    assert [map_step(raw, 4)[M.DAPO_KEPT_GROUP_FRAC] for raw in steps.values()] == pytest.approx([4 / 5, 4 / 6, 1.0])


@pytest.mark.parametrize("algorithm, error", [
    ({"name": "dapo"}, "records no algorithm.n_samples_per_prompt"),
    ({"name": "dapo", "n_samples_per_prompt": 0}, "integer >= 1"),
    ({"name": "dapo", "n_samples_per_prompt": "eight"}, "integer >= 1"),
])
def test_ingest_needs_the_runs_group_size_for_a_pass_rate(tmp_path, algorithm, error):
    """A config without a usable ``algorithm.n_samples_per_prompt`` refuses a log with a pass rate
    (a guessed n would put the metric on another scale); the argument supplies it; a log without
    one (GRPO) does not need it."""
    rd = RunDir(tmp_path / "dapo-14b-bf16-vanilla-s0-00000000").init({"algorithm": algorithm})
    (rd.path / "openrlhf").mkdir()
    log = rd.path / "openrlhf" / "driver.1.log"
    log.write_text(_status_line(1, {"policy_loss": 0.1, "dynamic_filtering_pass_rate": 300.0}) + "\n")
    with pytest.raises(ValueError, match=error):
        ingest(rd.path)
    if "n_samples_per_prompt" not in algorithm:
        ingest(rd.path, n_samples_per_prompt=4)
        assert rd.read_metrics()[0][M.DAPO_KEPT_GROUP_FRAC] == 0.75
        log.write_text(_status_line(1, {"policy_loss": 0.1}) + "\n")
        assert ingest(rd.path)["steps"] == 1 and M.DAPO_KEPT_GROUP_FRAC not in rd.read_metrics()[0]
