"""Every flag the builder emits, for every main-table cell, exists in 0.11.2's parser (read with ast)."""

import ast

import pytest
from orl_helpers import main_table_configs, openrlhf_dir

from fp8rl.backends.openrlhf.command import (
    ResourceError,
    RunPaths,
    build_args,
    check_resources,
    command_line,
    layout_for,
    parse_flags,
)
from fp8rl.backends.openrlhf.config import OpenRLHFRunConfig
from fp8rl.launch.configs import build_dataclass
from fp8rl.launch.profiles import load_profile


def parser_spec() -> dict[str, dict]:
    """``{flag: {"nargs", "choices", "store_true"}}`` from train_ppo_ray.py's add_argument calls."""
    src = (openrlhf_dir() / "cli" / "train_ppo_ray.py").read_text()
    out: dict[str, dict] = {}
    for node in ast.walk(ast.parse(src)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        first = node.args[0]
        if isinstance(first, ast.JoinedStr):  # f"--{prefix}.optim" in the actor/critic loop
            names = ["".join(v.value if isinstance(v, ast.Constant) else p for v in first.values)
                     for p in ("actor", "critic")]
        else:
            names = [first.value]
        kw = {k.arg: k.value for k in node.keywords}
        info = {
            "store_true": isinstance(kw.get("action"), ast.Constant) and kw["action"].value in ("store_true", "store_false"),
            "nargs": ast.literal_eval(kw["nargs"]) if "nargs" in kw else None,
            "choices": ast.literal_eval(kw["choices"]) if "choices" in kw else None,
        }
        for n in names:
            out[n[2:]] = info
    return out


def args_for(cfg, tmp_path, profile):
    res = profile.resources_for(cfg.model.slot)
    paths = RunPaths(tmp_path, tmp_path / "train.jsonl", (tmp_path / "a.jsonl", tmp_path / "b.jsonl"),
                     tmp_path / "reward_func.py")
    return build_args(cfg, layout_for(cfg, res.nodes, res.gpus_per_node), paths)


def test_every_main_table_flag_exists_with_a_valid_choice(tmp_path):
    spec = parser_spec()
    assert "actor.eps_clip_low_high" in spec and "actor.adam.lr" in spec  # parser read correctly
    profile = load_profile("example")
    cells = list(main_table_configs(tmp_path))
    assert len(cells) == 90
    seen = set()
    for cell, cfg in cells:
        flags = parse_flags(args_for(cfg, tmp_path, profile))
        for flag, values in flags.items():
            assert flag in spec, f"{cell}: --{flag} is not a train_ppo_ray 0.11.2 flag"
            s = spec[flag]
            if s["store_true"]:
                assert values == [], f"{cell}: --{flag} is a switch, got values {values}"
                continue
            nargs = s["nargs"]
            if nargs is None:
                assert len(values) == 1, f"{cell}: --{flag} takes one value, got {values}"
            elif isinstance(nargs, int):
                assert len(values) == nargs, f"{cell}: --{flag} takes {nargs} values, got {values}"
            else:
                assert len(values) >= 1
            if s["choices"] is not None:
                assert all(v in s["choices"] for v in values), f"{cell}: --{flag} {values} not in {s['choices']}"
        seen |= set(flags)
    # the axes really reach the command
    assert {"algo.dynamic_filtering_enable", "reward.overlong_buffer_len",
            "algo.advantage.is_correction_level", "actor.entropy_coef", "eval.dataset"} <= seen


def test_axes_map_to_the_expected_flags(tmp_path):
    profile = load_profile("example")
    by_cell = dict(main_table_configs(tmp_path))
    dapo = parse_flags(args_for(by_cell[("dapo", "14b", "blockwise", "calibrated")], tmp_path, profile))
    assert dapo["actor.eps_clip_low_high"] == ["0.2", "0.28"]
    assert dapo["algo.dynamic_filtering_range"] == ["0", "1"]
    assert dapo["reward.overlong_buffer_len"] == ["4096"]
    assert dapo["rollout.max_new_tokens"] == ["20480"]  # DAPO's L_max; penalty from 20480 - 4096 = 16384
    assert dapo["algo.advantage.is_correction_mode"] == ["clip"]
    assert dapo["algo.advantage.is_correction_threshold"] == ["0", "2"]
    assert dapo["actor.num_nodes"] == ["2"] and dapo["vllm.tensor_parallel_size"] == ["2"]
    assert dapo["vllm.num_engines"] == ["8"]  # 2 nodes x 8 GPUs / TP 2
    grpo = parse_flags(args_for(by_cell[("grpo", "8b", "bf16", "vanilla")], tmp_path, profile))
    assert grpo["rollout.max_new_tokens"] == ["16384"]
    assert grpo["algo.advantage.estimator"] == ["group_norm"]
    assert "algo.advantage.is_correction_level" not in grpo and "algo.dynamic_filtering_enable" not in grpo
    assert grpo["algo.kl.init_coef"] == ["0"]
    # several optimizer steps per rollout batch: 128 prompts x 8 / 256 = 4
    assert int(grpo["rollout.batch_size"][0]) * 8 // int(grpo["train.batch_size"][0]) == 4


def test_resource_rules_of_openrlhf():
    base = ["--actor.num_nodes", "1", "--actor.num_gpus_per_node", "8", "--vllm.num_engines", "4",
            "--vllm.tensor_parallel_size", "1", "--train.colocate_all", "--rollout.n_samples_per_prompt", "8",
            "--rollout.batch_size", "16", "--rollout.micro_batch_size", "8", "--train.batch_size", "32",
            "--train.micro_batch_size", "4"]
    with pytest.raises(ResourceError, match="colocate_all needs actor GPUs"):
        check_resources(base)
    ok = [*base]
    ok[ok.index("--vllm.num_engines") + 1] = "8"
    check_resources(ok)
    few = [*ok]
    few[few.index("--rollout.batch_size") + 1] = "4"  # 8 x 4 / 8 = 4 < 8 actor processes
    with pytest.raises(ResourceError, match="actor processes"):
        check_resources(few)
    single = [*ok, "--algo.advantage.estimator", "group_norm"]
    single[single.index("--rollout.n_samples_per_prompt") + 1] = "1"
    single[single.index("--rollout.batch_size") + 1] = "64"
    single[single.index("--train.batch_size") + 1] = "64"
    with pytest.raises(ResourceError, match="n_samples_per_prompt > 1"):
        check_resources(single)


def test_bad_layout_and_quoting(tmp_path):
    cfg = dict(main_table_configs(tmp_path))[("grpo", "32b", "tensorwise", "tis")]
    with pytest.raises(ResourceError, match="tensor-parallel size 4"):
        layout_for(cfg, 1, 6)
    args = args_for(cfg, tmp_path, load_profile("example"))
    line = command_line(args)
    assert line.startswith("python -m fp8rl.backends.openrlhf.driver -- --actor.model_name_or_path Qwen/Qwen2.5-32B")
    import shlex

    assert shlex.split(line)[4:] == args  # every value survives the shell


def test_paper_config_rejects_emulation_and_unmapped_values(tmp_path):
    cfg = next(iter(main_table_configs(tmp_path)))[1]
    import dataclasses

    d = dataclasses.asdict(cfg)
    d["fp8"]["emulate"] = True
    with pytest.raises(ValueError, match=r"fp8\.emulate=false"):
        build_dataclass(OpenRLHFRunConfig, d)
    d["fp8"]["emulate"] = False
    d["algorithm"]["loss_agg_mode"] = "seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match=r"no OpenRLHF 0\.11\.2 equivalent"):
        build_dataclass(OpenRLHFRunConfig, d)


def test_dapo_cells_plan_enough_episodes_for_their_steps(tmp_path):
    """Defect 6: one episode over ~17k DAPO prompts cannot supply 200 steps of 128 prompts when
    dynamic filtering may draw up to 3 batches per step; the plan derives the episodes."""
    from fp8rl.backends.openrlhf.config import data_plan

    profile = load_profile("example")
    by_cell = dict(main_table_configs(tmp_path))
    dapo_cfg = by_cell[("dapo", "14b", "blockwise", "calibrated")]
    plan = data_plan(dapo_cfg)
    assert (plan.size, plan.rounds, plan.steps_per_episode) == (17000, 3, 17000 // 384)
    assert plan.episodes * plan.steps_per_episode >= dapo_cfg.steps > (plan.episodes - 1) * plan.steps_per_episode
    dapo = parse_flags(args_for(dapo_cfg, tmp_path, profile))
    assert dapo["train.num_episodes"] == [str(plan.episodes)] == ["5"]
    assert dapo["data.max_samples"] == ["17000"]
    grpo = parse_flags(args_for(by_cell[("grpo", "8b", "bf16", "vanilla")], tmp_path, profile))
    assert grpo["train.num_episodes"] == ["1"] and grpo["data.max_samples"] == [str(200 * 128)]
    import dataclasses

    d = dataclasses.asdict(dapo_cfg)
    d["openrlhf"]["train_set_sizes"]["dapo_math_17k"] = 300  # not even one step of 128 x 3 prompts
    with pytest.raises(ValueError, match="fewer than one step needs"):
        build_dataclass(OpenRLHFRunConfig, d)
    d["openrlhf"]["train_set_sizes"] = {"deepscaler": 40315}
    with pytest.raises(ValueError, match="no size for train set 'dapo_math_17k'"):
        build_dataclass(OpenRLHFRunConfig, d)


def test_rowwise_rollout_is_supported_and_other_recipes_rejected_at_validation(tmp_path):
    import dataclasses

    cfg = dict(main_table_configs(tmp_path))[("grpo", "8b", "rowwise", "tis")]
    assert cfg.fp8.rollout_recipe == "rowwise"  # validates: vLLM's fp8_per_channel
    d = dataclasses.asdict(cfg)
    d["fp8"]["rollout_recipe"] = "mxfp8"
    with pytest.raises(ValueError, match=r"no vLLM 0\.29 online quantization"):
        build_dataclass(OpenRLHFRunConfig, d)
