"""Reward schemes at paper scale: DAPO cells get DAPO's +1/-1 rewards, GRPO cells 0/1; scores
stay 0/1, so that OpenRLHF 0.11.2's dynamic filtering and its eval ``pass1`` (read here from the
installed wheel's source) keep their meaning, and ingestion maps signed eval values back."""

import ast
import dataclasses
import importlib.util
import inspect
import json

import pytest
import torch
from orl_grading import InlinePool
from orl_helpers import function_from_source, main_table_configs, openrlhf_dir

from fp8rl.backends.openrlhf.command import build_args, layout_for, parse_flags
from fp8rl.backends.openrlhf.config import OpenRLHFSettings, reward_scheme
from fp8rl.backends.openrlhf.ingest import ingest, map_eval
from fp8rl.backends.openrlhf.reward_func import reward_func
from fp8rl.backends.openrlhf.run import config_dict, paths_for
from fp8rl.launch.profiles import load_profile
from fp8rl.runs import RunDir

#: (response, label): right, wrong, and no boxed answer.
SAMPLES = [("so \\boxed{\\frac{1}{2}}", "0.5"), ("so \\boxed{3}", "4"), ("I do not know", "4")]
EXPECTED = {"dapo": [1.0, -1.0, -1.0], "grpo": [1.0, 0.0, 0.0], "dr_grpo": [1.0, 0.0, 0.0]}


def load_by_path(path):
    """As OpenRLHF 0.11.2 does (``utils/agent.py``): importlib by path as module ``reward_func``."""
    spec = importlib.util.spec_from_file_location("reward_func", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.reward_func


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return list(main_table_configs(tmp_path_factory.mktemp("cells")))


def test_every_cell_command_names_its_schemes_reward_file(cells, tmp_path):
    """The reward file each main-table command names, loaded and called as OpenRLHF does."""
    profile, seen = load_profile("example"), {}
    for (algo, *_), cfg in cells:
        res = profile.resources_for(cfg.model.slot)
        args = build_args(cfg, layout_for(cfg, res.nodes, res.gpus_per_node), paths_for(cfg, tmp_path))
        seen.setdefault(algo, set()).update(parse_flags(args)["reward.remote_url"])
    assert {a: len(files) for a, files in seen.items()} == {"grpo": 1, "dapo": 1}  # one file per algorithm
    for algo, (path,) in seen.items():
        out = load_by_path(path)([r for r, _ in SAMPLES], [""] * 3, [lab for _, lab in SAMPLES], InlinePool())
        assert out["rewards"] == EXPECTED[algo], algo
        assert out["scores"] == [1.0, 0.0, 0.0], algo
        assert out["extra_logs"]["rollout/acc"] == pytest.approx(1 / 3)
    assert seen["dapo"] != seen["grpo"]


def test_reward_scheme_is_a_validated_recorded_setting(cells):
    cfg = next(c for (algo, *_), c in cells if algo == "dapo")
    assert reward_scheme(cfg) == "signed" and config_dict(cfg)["openrlhf"]["reward_scheme"]["dapo"] == "signed"
    assert reward_scheme(config_dict(cfg)) == "signed"  # the config.yaml a run records
    assert reward_scheme({"algorithm": {"name": "dapo"}, "openrlhf": {}}) == "binary"  # recorded before the field
    assert OpenRLHFSettings().reward_scheme == {"grpo": "binary", "dr_grpo": "binary", "dapo": "signed"}
    with pytest.raises(ValueError, match=r"reward_scheme.dapo='plus_minus' must be one of \('binary', 'signed'\)"):
        OpenRLHFSettings(reward_scheme={"dapo": "plus_minus"})
    with pytest.raises(ValueError, match=r"no scheme for algorithm 'dapo'.*reward_scheme\.dapo=binary or signed"):
        dataclasses.replace(cfg, openrlhf=dataclasses.replace(cfg.openrlhf, reward_scheme={"grpo": "binary"}))
    with pytest.raises(ValueError, match="reward scheme 'x'"):
        reward_func(["\\boxed{1}"], [""], ["1"], InlinePool(), scheme="x")


def test_dynamic_filtering_reads_scores_which_stay_0_1():
    """0.11.2 keeps a group when the mean of its *scores* is strictly inside the filter range
    (``--algo.dynamic_filtering_range 0 1``): under signed rewards a group with one right answer in
    eight must still be kept, which it would not be if the scores were the +1/-1 rewards."""
    path = openrlhf_dir() / "trainer" / "ppo_utils" / "samples_generator.py"
    text = path.read_text()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "_generate_vllm")
    src = ast.get_source_segment(text, node)
    assert "scores = [e.scores[0].item() for e in experiences]" in src and "min_r < avg_reward < max_r" in src
    group = [SAMPLES[0]] + [SAMPLES[1]] * 7
    out = reward_func([r for r, _ in group], [""] * 8, [lab for _, lab in group], InlinePool(), scheme="signed")
    mean = sum(out["scores"]) / 8
    assert 0 < mean < 1 and not 0 < sum(out["rewards"]) / 8 < 1  # kept on scores; rewards would drop it
    for same in (SAMPLES[:1] * 8, SAMPLES[1:2] * 8):  # all right or all wrong: filtered either way
        scores = reward_func([r for r, _ in same], [""] * 8, [lab for _, lab in same], InlinePool(),
                             scheme="signed")["scores"]
        assert not 0 < sum(scores) / 8 < 1


class _Sample:
    def __init__(self, prompt, reward):
        self.prompts, self.rewards = [prompt], torch.tensor([reward])
        self.response_length, self.truncated = torch.tensor(10), torch.tensor(False)


def test_eval_pass1_on_signed_rewards_is_mapped_back_to_accuracy(tmp_path):
    """0.11.2's ``compute_eval_metrics`` (run from the wheel) averages rewards: on +1/-1 rewards
    ``pass1`` is 2 x accuracy - 1; ingestion of a signed run's log gives the accuracy back."""
    compute = function_from_source(openrlhf_dir() / "trainer" / "ppo_trainer.py", "compute_eval_metrics",
                                   {"torch": torch})
    k, correct = 4, {"p1": [1, 0, 0, 0], "p2": [1, 1, 1, 0]}  # accuracy 4/8, pass@4 = 1
    samples, logs = [], {}
    for p, marks in correct.items():
        resp = [SAMPLES[0] if m else SAMPLES[1] for m in marks]
        out = reward_func([r for r, _ in resp], [""] * k, [lab for _, lab in resp], InlinePool(), scheme="signed")
        samples += [_Sample(p, r) for r in out["rewards"]]
    logs = compute([(["aime24", "aime24"], ["p1", "p2"], ["", ""], [None, None])], samples, k)
    assert logs["eval_aime24_pass1"] == pytest.approx(0.0) and logs["eval_aime24_pass4"] == pytest.approx(1.0)
    (row,) = map_eval(20, logs, {"aime24": 2}, scheme="signed")
    assert row["eval/aime24/avg@k"] == pytest.approx(0.5) and row["eval/aime24/pass@k"] == pytest.approx(1.0)
    # the same through ingest(): the scheme comes from the run's recorded config
    rd = RunDir(tmp_path / "dapo-14b-bf16-vanilla-s0-00000000").init(
        {"algorithm": {"name": "dapo"}, "openrlhf": {"reward_scheme": {"dapo": "signed"}}})
    (rd.path / "openrlhf").mkdir()
    (rd.path / "openrlhf" / "driver.1.log").write_text(
        "x Global step 1: {'policy_loss': 0.1}\n"
        f"y Evaluation completed in 0:01:00, global_step 1, eval_metrics: {json.dumps(logs)}\n")
    ingest(rd.path, eval_sizes={"aime24": 2})
    (row,) = rd.read_eval()
    assert row["eval/aime24/avg@k"] == pytest.approx(0.5) and row["eval/aime24/pass@k"] == pytest.approx(1.0)
    assert map_eval(1, {"eval_aime24_pass1": 0.25}, scheme="binary")[0]["eval/aime24/avg@k"] == 0.25


def test_signed_reward_file_matches_the_package_function():
    from fp8rl.backends.openrlhf import reward_func_signed

    assert reward_func_signed.SCHEME == "signed"
    assert list(inspect.signature(reward_func_signed.reward_func).parameters)[:3] == ["queries", "prompts", "labels"]
