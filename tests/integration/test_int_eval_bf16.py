"""The evaluation after training on vLLM 0.29's CPU build: the arm's own FP8 engine and the BF16
engine of ``openrlhf.eval_bf16`` (``fp8rl.backends.openrlhf.evaluate``), on the smoke model.

The run directory is a tensorwise cell whose final checkpoint is the base model itself, so the
BF16 engine scores identical weights at step 0 and at the end: with one seed for every pass the
two BF16 evaluations must be equal, while the own engine holds FP8 weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from int_paths import REPO, SUPPORT

from fp8rl.runs import RunDir
from fp8rl.runs import metrics as M

pytestmark = pytest.mark.integration


def test_the_own_engine_is_fp8_and_the_bf16_engine_pairs_step_0_with_the_end(integration_ready, tmp_path):
    from fp8rl.backends.openrlhf.data import prepare
    from fp8rl.backends.openrlhf.smoke import MODEL_ID, write_model

    data = tmp_path / "data"
    prepare(["smoke_eval"], data, {"smoke_eval": "fp8rl-smoke:7:6"})
    base = write_model(data / "smoke_model")
    cfg = {"openrlhf": {"eval_sets": ["smoke_eval"], "vllm_tp": {"8b": 1}, "data_dir": str(data),
                        "models": {"8b": MODEL_ID}, "eval_bf16": False, "device": "cpu",
                        "apply_chat_template": False},
           "fp8": {"rollout_recipe": "tensorwise"}, "model": {"slot": "8b"}, "eval_k": 3,
           "eval_temperature": 0.6, "max_response_len": 12, "output_dir": str(tmp_path / "sweep")}
    rd = RunDir(tmp_path / "sweep" / "grpo-8b-tensorwise-vanilla-s0-00000000").init(cfg)
    shutil.copytree(base, rd.path / "checkpoint" / "final")
    rd.metrics_path.write_text('{"step": 1}\n{"step": 2}\n')
    rd.write_summary({"state": "DONE"})
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SUPPORT / "eval_bf16.py"), str(rd.path), str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(out.read_text())
    engines = {(e["model"].endswith("final"), e["quantization"]): e for e in got["engines"]}
    assert set(engines) == {(True, "fp8_per_tensor"), (False, None), (True, None)}  # each built once
    own = engines[(True, "fp8_per_tensor")]
    assert own["vllm_quantization"] == "fp8_per_tensor" and own["fp8_weights"] > 0
    for key in ((False, None), (True, None)):
        assert engines[key]["vllm_quantization"] is None
        assert engines[key]["fp8_weights"] == 0 and engines[key]["bf16_weights"] > 0
    res = got["results"]["smoke_eval"]
    assert res["bf16"] == res["bf16_initial"]  # same weights, same engine, same seed
    rows = [r for r in rd.read_eval() if r.get("source") == "final"]
    assert [r["step"] for r in rows] == [0, 2]
    assert set(rows[0]) & {M.eval_key("smoke_eval", s) for s in (M.EVAL_AVG, M.EVAL_PASS)} == set()
    assert rows[1][M.eval_key("smoke_eval", M.EVAL_AVG)] == res["avg@k"]
    assert rows[1][M.eval_key("smoke_eval", M.EVAL_AVG, precision=M.EVAL_BF16)] == res["bf16"]["avg@k"]
    s = rd.summary()
    assert s["final_eval"]["quantization"] == "fp8_per_tensor" and s["final_eval"]["bf16"] is True
