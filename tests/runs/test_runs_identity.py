import hashlib
import json

import pytest

from fp8rl.runs import metrics as M
from fp8rl.runs.identity import (
    DEFAULT_EXCLUDE,
    canonical_json,
    config_hash,
    parse_run_name,
    run_dir_name,
    run_name,
)

CFG = {
    "algorithm": {"name": "grpo", "eps_low": 0.2, "eps_high": 0.28},
    "fp8": {"recipe": "tensorwise", "emulate": False},
    "seed": 3,
    "paths": {"run_root": "/somewhere"},
    "logging": {"every": 1},
    "launcher": {"partition": "gpu"},
}


def test_run_name_roundtrip():
    name = run_name("grpo", "8b", "rollout_only", "calibrated", 12)
    assert name == "grpo-8b-rollout_only-calibrated-s12"
    d = parse_run_name(run_dir_name(name, "0123abcd"))
    assert d == {"algorithm": "grpo", "model": "8b", "fp8": "rollout_only",
                 "clip": "calibrated", "seed": 12, "hash": "0123abcd"}
    assert parse_run_name(name)["hash"] is None


@pytest.mark.parametrize("bad", ["", "qwen3-8b", "a/b", "a b", "-x", "_x", " x", None, 8])
def test_run_name_rejects_bad_tokens(bad):
    with pytest.raises(ValueError, match="run name part model"):
        run_name("grpo", bad, "bf16", "vanilla", 0)


def test_run_name_suggests_underscore():
    with pytest.raises(ValueError, match="qwen3_8b"):
        run_name("grpo", "qwen3-8b", "bf16", "vanilla", 0)


@pytest.mark.parametrize("seed", [-1, 1.0, True, "0"])
def test_run_name_rejects_bad_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        run_name("grpo", "8b", "bf16", "vanilla", seed)


def test_run_dir_name_validates_hash():
    assert run_dir_name("grpo-8b-bf16-vanilla-s0", "deadbeef") == "grpo-8b-bf16-vanilla-s0-deadbeef"
    for bad in ["DEADBEEF", "deadbee", "deadbeef0", "xyzxyzxy"]:
        with pytest.raises(ValueError):
            run_dir_name("grpo-8b-bf16-vanilla-s0", bad)
    with pytest.raises(ValueError):
        run_dir_name("not a name", "deadbeef")


def test_config_hash_matches_reference_formula():
    # reference: sha256 of sorted, compact JSON of the config without the excluded top-level keys
    ref = {k: v for k, v in CFG.items() if k not in ("paths", "logging", "launcher")}
    want = hashlib.sha256(
        json.dumps(ref, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()[:8]
    assert config_hash(CFG) == want
    assert len(want) == 8 and int(want, 16) >= 0


def test_config_hash_stable_under_key_order_and_tuples():
    reordered = dict(reversed(list(CFG.items())))
    reordered["algorithm"] = dict(reversed(list(CFG["algorithm"].items())))
    assert config_hash(reordered) == config_hash(CFG)
    a = {"x": (1, 2), "y": 1}
    b = {"y": 1, "x": [1, 2]}
    assert config_hash(a) == config_hash(b)


def test_config_hash_exclusion():
    other_paths = {**CFG, "paths": {"run_root": "/elsewhere"}, "hydra": {"job": 1}}
    assert config_hash(other_paths) == config_hash(CFG)
    changed = {**CFG, "seed": 4}
    assert config_hash(changed) != config_hash(CFG)
    lr = {**CFG, "algorithm": {**CFG["algorithm"], "eps_high": 0.2800001}}
    assert config_hash(lr) != config_hash(CFG)
    # dotted exclusion of a nested key; absent keys are ignored
    assert config_hash(CFG, exclude=("algorithm.eps_high", "nope.deeper")) == config_hash(
        {**CFG, "algorithm": {"name": "grpo", "eps_low": 0.2}}, exclude=()
    ) != config_hash(CFG, exclude=())
    assert "paths" in DEFAULT_EXCLUDE and "launcher" in DEFAULT_EXCLUDE
    # exclusion does not mutate the caller's config
    assert CFG["paths"] == {"run_root": "/somewhere"}
    assert "paths" not in canonical_json(CFG)


def test_config_hash_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        config_hash({"lr": float("nan")})
    with pytest.raises(TypeError, match="plain"):
        config_hash({"p": object()})
    with pytest.raises(TypeError):
        config_hash({"a": 1}, exclude="paths")
    with pytest.raises(TypeError):
        config_hash([1, 2])


def test_metric_names():
    assert len(M.TRAIN_METRICS) == len(set(M.TRAIN_METRICS)) == 67
    assert M.ACTOR_CLIPFRAC_NEG_LOW == "actor/clipfrac_neg_low"
    assert all("/" in m for m in M.TRAIN_METRICS)
    assert set(M.SPARSE_METRICS) <= set(M.TRAIN_METRICS)
    assert M.eval_key("aime24", "avg@k") == "eval/aime24/avg@k"
    assert M.eval_key("math500", "pass@k") == "eval/math500/pass@k"
    with pytest.raises(ValueError):
        M.eval_key("aime24", "avg@16")
    with pytest.raises(ValueError):
        M.eval_key("a/b", "avg@k")
    assert M.parse_eval_key("eval/aime24/avg@16") == ("aime24", "avg@k", 16)
    assert M.parse_eval_key("eval/aime24/pass@k") == ("aime24", "pass@k", None)
    assert M.parse_eval_key("eval/arith/greedy") == ("arith", "greedy", None)
    assert M.parse_eval_key("eval/arith/garbled_frac") is None
    assert M.parse_eval_key("actor/entropy") is None
    row = M.eval_row(5, "amc23", avg_at_k=0.5, pass_at_k=0.75, k=4, n=40)
    assert row == {"step": 5, "dataset": "amc23", "k": 4, "n": 40,
                   "eval/amc23/avg@k": 0.5, "eval/amc23/pass@k": 0.75}
    with pytest.raises(ValueError):
        M.eval_row(5, "amc23", avg_at_k=0.5, k=0, n=40)


def test_bf16_evaluation_keys():
    """The BF16 engine's keys: built, parsed, kept apart from the arm's own (``eval/``) keys."""
    assert M.eval_key("aime24", "avg@k", precision="bf16") == "eval_bf16/aime24/avg@k"
    assert M.eval_key("arith", "greedy", precision=M.EVAL_BF16) == "eval_bf16/arith/greedy"
    assert M.eval_key("aime24", "pass@k", precision=M.EVAL_OWN) == "eval/aime24/pass@k"
    with pytest.raises(ValueError, match="precision"):
        M.eval_key("aime24", "avg@k", precision="fp8")
    # the default parse reads the arm's own keys only: a reader written before eval_bf16 existed
    # never mixes the two engines
    assert M.parse_eval_key("eval_bf16/aime24/avg@k") is None
    assert M.parse_eval_key("eval_bf16/aime24/avg@16", precision="bf16") == ("aime24", "avg@k", 16)
    assert M.parse_eval_key("eval/aime24/avg@k", precision="bf16") is None
    assert M.split_eval_key("eval_bf16/arith/greedy") == ("arith", "greedy", None, "bf16")
    assert M.split_eval_key("eval/arith/pass@k") == M.EvalKey("arith", "pass@k", None, "own")
    for bad in ("eval_bf16/arith/garbled_frac", "eval_fp8/arith/avg@k", "evalbf16/arith/avg@k",
                "eval_bf16/a/b/avg@k"):
        assert M.split_eval_key(bad) is None, bad
    row = M.eval_row(5, "amc23", avg_at_k=0.5, pass_at_k=0.75, k=4, n=40, bf16_avg_at_k=0.25, bf16_pass_at_k=0.5)
    assert row == {"step": 5, "dataset": "amc23", "k": 4, "n": 40, "eval/amc23/avg@k": 0.5,
                   "eval/amc23/pass@k": 0.75, "eval_bf16/amc23/avg@k": 0.25, "eval_bf16/amc23/pass@k": 0.5}
    # every key of the row parses back to its engine
    assert {M.split_eval_key(k) for k in row if "/" in k} == {
        ("amc23", "avg@k", None, "own"), ("amc23", "pass@k", None, "own"),
        ("amc23", "avg@k", None, "bf16"), ("amc23", "pass@k", None, "bf16")}
    with pytest.raises(ValueError, match="bf16_avg_at_k"):
        M.eval_row(5, "amc23", avg_at_k=0.5, k=4, n=40, bf16_pass_at_k=0.5)
    # a row of the BF16 engine alone (paper scale's step 0): no eval/ key
    assert M.eval_row(0, "amc23", k=4, n=40, bf16_avg_at_k=0.25) == {
        "step": 0, "dataset": "amc23", "k": 4, "n": 40, "eval_bf16/amc23/avg@k": 0.25}
    with pytest.raises(ValueError, match="needs avg_at_k"):
        M.eval_row(0, "amc23", k=4, n=40)
    with pytest.raises(ValueError, match="pass_at_k without avg_at_k"):
        M.eval_row(0, "amc23", pass_at_k=0.5, k=4, n=40, bf16_avg_at_k=0.25)
