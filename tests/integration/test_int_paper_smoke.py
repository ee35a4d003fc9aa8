"""The paper's job, whole, on CPU: what ``make paper-smoke`` left in ``runs/paper_smoke``.

``make paper-smoke`` (``experiments.paper_smoke``) runs ``+sweep=paper_smoke scale=paper`` through
the local Slurm cluster (or the local launcher without one): per cell, Ray started by our job
script, the fp8rl driver, OpenRLHF 0.11.2's ``train_ppo_ray``, vLLM 0.29's CPU build generating
(FP8 where the arm says), the reward, DeepSpeed ZeRO-3 training with the plugin's loss (FP8
linears where the arm says), the weight sync into the engines, OpenRLHF's evaluation, the final
evaluation, and the report; one cell is interrupted after its first checkpoint and resumes.
These tests read what that job wrote -- the run directories and the diagnostic dumps the smoke
sweep switches on (``openrlhf.dump_loss_inputs``: the loss inputs per micro-batch, the GEMM
kernels per step, the engines' weights after every sync, every graded sample) -- and check it
against references computed here. Nothing in the job is a stand-in except what
``fp8rl.backends.openrlhf.plugin.cpu_support`` fills on CPU and the flash-attn import stand-in
(packed samples are off).

They skip when the job has not run (``make paper-smoke`` first), and fail instead under
``FP8RL_REQUIRE_PAPER_SMOKE`` (``.ci/run`` sets it after running the job).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from smoke_job import (
    CELLS,
    COVERAGE,
    ENGINE_LINEARS,
    INTERRUPTED,
    LINEARS,
    REFERENCE,
    REPO,
    STEPS,
    SWEEP,
    jsonl,
    loss_dumps,
    metrics,
)
from smoke_job import syncs as _syncs

pytestmark = pytest.mark.integration

def test_every_cell_ran_the_whole_path_to_done(runs):
    """Each cell is DONE after its steps, through the driver (``driver.main``: its log line, the
    attestation it wrote) and OpenRLHF's own loop (its ``Global step`` lines), with an
    OpenRLHF evaluation and the final evaluation; on Slurm each ran as an array task."""
    for prefix, run in runs.items():
        status = json.loads((run / "status.json").read_text())
        assert status["state"] == "DONE" and status["step"] == STEPS, (prefix, status)
        logs = sorted((run / "openrlhf").glob("driver.*.log"))
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        # driver.main ran: it connected to the job's Ray and wrote the attestation of its start-up check
        assert "Connected to Ray cluster" in text and (run / "openrlhf" / "attestation.json").exists(), prefix
        assert "fp8rl.backends.openrlhf.driver" in (run / "openrlhf" / "command.sh").read_text()
        for step in range(1, STEPS + 1):
            assert f"Global step {step}:" in text, (prefix, step)
        rows = metrics(run)
        assert sorted(rows) == list(range(1, STEPS + 1)), prefix  # each step logged once
        evals = jsonl(run / "eval.jsonl")
        assert any(e.get("source") != "final" for e in evals), prefix  # OpenRLHF's evaluation
        assert any(e.get("source") == "final" for e in evals), prefix  # experiments.evaluate
        summary = json.loads((run / "summary.json").read_text())
        assert any(k.startswith("eval/smoke_eval/") for k in summary), prefix


def test_vllm_generated_tokens_in_every_step(runs):
    """Every step's rollout came from the engines: responses with tokens, graded by the reward."""
    for prefix, run in runs.items():
        for step, row in metrics(run).items():
            assert row["rollout/response_len"] > 0, (prefix, step)
            assert "rollout/reward_mean" in row, (prefix, step)
        samples = jsonl(run / "openrlhf" / "dumps" / "samples.jsonl")
        assert len(samples) >= STEPS * 4 * 4, prefix
        # Every sample the last attempt graded says something. An attempt killed mid-rollout (the
        # interrupted cell's first) grades its aborted requests as it dies: no token past the
        # prompt (CI saw 11 of 72 at the instant of the kill, ``tail`` empty), never trained.
        last = _driver_pid(sorted((run / "openrlhf").glob("driver.*.log"), key=_attempt)[-1])
        mine = [s for s in samples if s.get("driver_pid") == last]
        assert len(mine) >= 4 * 4 and all(s["response"] for s in mine), (prefix, last, len(mine),
                                                                         [s for s in mine if not s["response"]][:3])
        assert len({s["score"] for s in samples}) == 2, prefix  # mixed rewards: training had signal


def _attempt(log: Path) -> int:
    return int(log.stem.split(".")[-1])


def _driver_pid(log: Path) -> str:
    """The pid the driver wrote on its log's first line (``[fp8rl driver] pid N, ...``)."""
    first = log.read_text(errors="replace").splitlines()[0]
    assert first.startswith("[fp8rl driver] pid "), first
    return first.split()[3].rstrip(",")


def test_engine_weights_after_every_sync_are_fp8_exactly_where_the_arm_says(runs):
    """After every weight sync the engine's linear weights are float8_e4m3fn for FP8-rollout
    cells (per tensor or per channel as the arm says) and bfloat16 for the BF16 cell."""
    for prefix, run in runs.items():
        quant = CELLS[prefix][0]
        syncs = _syncs(run)
        assert len(syncs) >= STEPS, prefix  # one per step (and one at the resume)
        for s in syncs:
            assert s["quantization"] == quant, prefix
            # the embedding and the LM head have a (BF16) quant method too; the 8 linears are FP8 or not
            want = {"float8_e4m3fn": ENGINE_LINEARS, "bfloat16": 2} if quant else {"bfloat16": ENGINE_LINEARS + 2}
            assert s["linear_dtypes"] == want, (prefix, s["linear_dtypes"])


def test_the_policy_changed_between_steps(runs):
    """Consecutive syncs carried other weights into the engines (training moved the policy): the
    linear layers' kernels compute other outputs on the fixed probe (their weights may live inside
    vLLM's CPU GEMM kernel, so the probe, not the parameter digest, is what must change)."""
    for prefix, run in runs.items():
        syncs = _syncs(run)
        assert all(len(s["probe"]) == ENGINE_LINEARS + 1 for s in syncs), prefix  # + the LM head
        for a, b in itertools.pairwise(syncs):
            if a["pid"] != b["pid"]:
                continue  # the resumed engine's first sync re-sends the checkpoint's weights
            changed = [n for n in a["probe"] if a["probe"][n] != b["probe"][n]]
            assert any("proj" in n for n in changed), (prefix, a["sync"], b["sync"])


def _fresh_engine_greedy(model: Path, quantization: str | None, prompts: list[str], out: Path,
                         max_num_seqs: int | None) -> dict:
    script = REPO / "tests" / "integration" / "support" / "fresh_engine.py"
    subprocess.run([sys.executable, str(script), str(model), json.dumps(quantization), str(out),
                    json.dumps(max_num_seqs)],
                   input=json.dumps(prompts), text=True, check=True, timeout=300, cwd=REPO,
                   env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def test_greedy_samples_after_the_last_sync_equal_a_fresh_engine_on_the_new_weights(runs, tmp_path):
    """OpenRLHF's evaluation after the last step decoded greedily on the engine that had just
    received the trained weights; a fresh vLLM engine built from the saved final checkpoint
    (same quantization and batching) decodes the same prompts to the same text. Also: its weights' digests
    equal the last sync's, bit for bit. (The cells' fresh engines run two at a time: each is one
    single-threaded process.)"""
    from concurrent.futures import ThreadPoolExecutor

    eval_file = SWEEP.parent / ".cache" / "openrlhf_data" / "smoke_eval.jsonl"  # the job's evaluation set
    cfg_eval = {json.loads(ln)["input"] for ln in eval_file.read_text().splitlines() if ln.strip()} \
        if eval_file.exists() else None
    wanted = {}
    for prefix, run in runs.items():
        samples = jsonl(run / "openrlhf" / "dumps" / "samples.jsonl")
        evals = [s for s in samples if cfg_eval is None or s["prompt"] in cfg_eval]
        last = {}
        for s in evals:  # the last evaluation's response per prompt
            last[s["prompt"]] = s["response"]
        assert len(last) >= 4, prefix
        wanted[prefix] = last

    def fresh(prefix: str) -> dict:
        run = runs[prefix]
        spec = json.loads((run / "openrlhf" / "plugin_spec.json").read_text())
        return _fresh_engine_greedy(run / "checkpoint" / "final", CELLS[prefix][0], sorted(wanted[prefix]),
                                    tmp_path / f"{prefix}.json", spec.get("engine_max_num_seqs"))

    with ThreadPoolExecutor(max_workers=2) as pool:
        engines = dict(zip(wanted, pool.map(fresh, wanted), strict=True))
    for prefix, got in engines.items():
        run = runs[prefix]
        assert got["digest"] == _syncs(run)[-1]["digest"], prefix
        assert got["probe"] == _syncs(run)[-1]["probe"], prefix  # what every GEMM computes
        for prompt, response in got["responses"].items():  # OpenRLHF's text keeps the end token
            assert response == wanted[prefix][prompt].removesuffix("<eos>"), (prefix, prompt[-40:])


def _dumps(run: Path) -> list[dict]:
    return [torch.load(p, weights_only=False) for p in sorted((run / "openrlhf" / "dumps").glob("rank*-*.pt"))]


def test_logged_clip_diagnostics_equal_counts_recomputed_from_the_loss_inputs(runs):
    """``actor/clipfrac_*`` of every logged step equals the counts over that step's micro-batches,
    recomputed here from the loss inputs the plugin dumped (ratio, advantages, mask, bounds)."""
    for prefix, run in runs.items():
        by_step = loss_dumps(run)  # each rank's last attempt (the two-rank cell logs both ranks' counts)
        rows = metrics(run)
        for step in range(STEPS):
            recs = by_step.get(step + 1, [])
            assert recs, (prefix, step)
            n = dict.fromkeys(("neg", "neg_low", "neg_high", "pos", "pos_low", "pos_high"), 0)
            for r in recs:
                ratio, adv, mask = r["ratio"], r["advantages"], r["mask"].bool()
                for side, sel in (("neg", mask & (adv < 0)), ("pos", mask & (adv > 0))):
                    n[side] += int(sel.sum())
                    n[f"{side}_low"] += int((sel & (ratio < r["low"])).sum())
                    n[f"{side}_high"] += int((sel & (ratio > r["high"])).sum())
            row = rows[step + 1]
            for side in ("neg", "pos"):
                if n[side] == 0:
                    continue
                for b in ("low", "high"):
                    assert row[f"actor/clipfrac_{side}_{b}"] == pytest.approx(n[f"{side}_{b}"] / n[side]), \
                        (prefix, step, side, b)


#: Cells whose loss applies TIS (token-level truncated IS on the rollout/trainer mismatch): both
#: have FP8 engines, so their rollout log-probs differ from the trainer's old log-probs. The DAPO
#: one adds the Score Centering term (test_int_score_centering.py checks it).
TIS_CELLS = ("grpo-8b-rowwise-calibrated", "dapo-8b-tensorwise-score_centering_tis")


def sc_loss_term(d: dict) -> torch.Tensor | float:
    """The Score Centering term A * C a dumped micro-batch's loss added per token (0 without it)."""
    t = d.get("sc_loss_term")
    return 0.0 if t is None else t.double()


def _tis_cap(run: Path) -> float:
    import yaml

    return float(yaml.safe_load((run / "config.yaml").read_text())["clip"]["tis_cap"])


def test_tis_ran_on_the_engines_log_probs_in_every_micro_batch(runs):
    """In the TIS cells (the calibrated cell applies TIS too) every micro-batch's loss received the
    engines' rollout log-probs (vLLM asked for them: ``SamplingParams(logprobs=1)``), which differ
    from the trainer's old log-probs (FP8 engines), and applied IS weights equal to
    min(exp(old - rollout), C), C the cell's ``clip.tis_cap``, recomputed here; they are not all 1,
    and the per-token loss it reduced is the PPO loss times them (plus the Score Centering cell's
    A * C, which test_int_score_centering.py recomputes). The logged
    ``rollout/mismatch_kl`` of every step equals the token-weighted k3 recomputed from the same
    dumps. The vanilla cells apply no weight."""
    for prefix, run in runs.items():
        dumps = _dumps(run)
        assert dumps, prefix
        if prefix not in TIS_CELLS:
            assert all(d["correction"] == "none" and d["is_weights"] is None for d in dumps), prefix
            assert not any("rollout/mismatch_kl" in r for r in metrics(run).values()), prefix
            continue
        cap = _tis_cap(run)
        assert sorted({d["step"] for d in dumps}) == list(range(STEPS)), prefix
        for d in dumps:
            where = (prefix, d["step"], d["n"], d["pid"])
            m, old, rollout, w = d["mask"].bool(), d["old_log_probs"].double(), d["rollout_log_probs"], d["is_weights"]
            assert d["correction"] == "tis" and d["correction_params"] == {"cap": cap}, where
            assert rollout is not None and w is not None, where
            rollout = rollout.double()
            assert rollout.shape == old.shape == m.shape and m.any(), where
            assert torch.isfinite(rollout[m]).all() and (rollout[m] <= 0).all(), where
            # FP8 engines against the trainer: (nearly) every token's log-prob differs
            assert ((rollout - old).abs()[m] > 1e-6).float().mean() > 0.5, where
            want = torch.where(m, torch.exp(old - rollout).clamp(max=cap), torch.zeros((), dtype=torch.float64))
            torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6, msg=lambda e, where=where: f"{where}: {e}")
            # a correction, not weights of 1: some weight differs from 1 by more than the float
            # tolerance the weights were compared at just above (how far depends on the CPU's
            # kernels: on one AVX-512 machine the largest deviation in a micro-batch was 4e-4)
            assert (w.double() - 1).abs()[m].max() > 1e-5 + 1e-6, where
            r, adv = d["ratio"].double(), d["advantages"].double()
            ppo = torch.where(m, torch.maximum(-adv * r, -adv * r.clamp(d["low"], d["high"])),
                              torch.zeros((), dtype=torch.float64))
            torch.testing.assert_close(d["token_loss"].double(), ppo * want + sc_loss_term(d), rtol=1e-5, atol=1e-6,
                                       msg=lambda e, where=where: f"{where}: {e}")
        rows = metrics(run)
        by_step = loss_dumps(run)  # the attempt that logged each step
        for step in range(STEPS):
            num = den = 0.0
            for d in by_step[step + 1]:
                m = d["mask"].bool()
                lr = (d["old_log_probs"].double() - d["rollout_log_probs"].double()).clamp(-20, 20)[m]
                num += float((torch.expm1(lr) - lr).sum())
                den += float(m.sum())
            assert rows[step + 1]["rollout/mismatch_kl"] == pytest.approx(num / den, rel=1e-4), (prefix, step)
            assert num > 0, (prefix, step)


def _kernels(run: Path) -> list[tuple[str, dict]]:
    files = sorted((run / "openrlhf" / "dumps").glob("kernels-rank0-step*.json"))
    return [(f.name, json.loads(f.read_text())) for f in files]


def test_fp8_trainer_cells_ran_fp8_gemms(runs):
    """Counted at the dispatcher in the real DeepSpeed actor: FP8-trainer cells ran
    ``_scaled_mm`` on FP8 operands (3 per FP8 linear and micro-batch: forward, grad input, grad
    weight); BF16-trainer cells ran none, only BF16 GEMMs."""
    for prefix, run in runs.items():
        fp8_trainer = CELLS[prefix][1]
        kernels = _kernels(run)
        assert len(kernels) >= STEPS, prefix
        for name, k in kernels:
            scaled = sum(v for key, v in k["train"].items() if key.startswith("_scaled_mm:float8"))
            if fp8_trainer:
                assert scaled > 0 and scaled % (3 * LINEARS) == 0, (prefix, name, k["train"])
            else:
                bf16 = sum(v for key, v in k["train"].items() if key.endswith("bfloat16"))
                assert scaled == 0 and bf16 > 0, (prefix, name, k["train"])


def test_the_bf16_shadow_pass_ran_no_fp8_gemm(runs):
    """The calibrated cell's BF16 shadow forwards (old and current policy) ran GEMMs, none of them
    ``_scaled_mm``: the shadow really is BF16. No other cell ran a shadow."""
    for prefix, run in runs.items():
        ran = 0
        for name, k in _kernels(run):
            shadow = k.get("shadow", {})
            assert not any(key.startswith("_scaled_mm") for key in shadow), (prefix, name, shadow)
            ran += sum(shadow.values())
        assert (ran > 0) == (CELLS[prefix][3] == "calibrated"), (prefix, ran)


PERIOD = 2  # sweeps/smoke_cell/grpo_rowwise_calibrated.yaml (the default mode, periodic)
#: The calibrated cell's calibration steps, 1-based as its metrics (calibrate_at_start: the first).
CALIBRATION_STEPS = [s + 1 for s in range(STEPS) if s % PERIOD == 0]


def test_periodic_shadows_every_row_on_its_calibration_steps_only(runs):
    """``clip.calibration_mode=periodic`` (the default) in the real actor: on every ``PERIOD``-th
    step, the first included, every row got a BF16 shadow and fed the step's one estimate, and the
    shadow forwards ran twice on all of them (old and current weights); on the steps between, no
    shadow ran at all (a schedule that shadows every step, or none, fails)."""
    run = runs.get(INTERRUPTED)
    if run is None:
        pytest.skip("the calibrated cell is not among the runs")
    kernels = dict(_kernels(run))
    for step in range(1, STEPS + 1):
        k = kernels.get(f"kernels-rank0-step{step - 1}.json", {})
        plan, rows = k.get("plan") or {}, k.get("rows", {})
        if step in CALIBRATION_STEPS:
            assert plan["measured"] == list(range(plan["n"])), (step, plan)
            assert plan["shadowed"] == plan["measured"], (step, plan)
            assert rows.get("shadow", 0) == 2 * plan["n"], (step, rows)
            assert sum(k["shadow"].values()) > 0, step
        else:
            assert not plan.get("measured") and not plan.get("shadowed"), (step, plan)
            assert rows.get("shadow", 0) == 0 and not sum(k.get("shadow", {}).values()), (step, k)
        assert "fp8_prepass" not in rows, step  # only same_batch runs a pre-pass


def test_periodic_calibrations_log_their_data_and_rule_the_next_steps_across_the_restart(runs):
    """Issue 46's calibration data in the real run, recomputed from the loss inputs the plugin
    dumped: on a calibration step ``clip/n`` is the step's A<0 tokens (every row measured),
    ``clip/k`` lies in [0, n], ``clip/alpha_n`` is the run's BF16 rate so far times n, and
    ``clip/alpha_run`` at the last calibration pools both calibrations, the first of them made
    before the interruption (the controller's run totals survived the checkpoint). The bounds:
    step 1 ran under the initial ones, and step 1's calibration ruled steps 2 and 3 -- step 3 in
    the resumed attempt, so a restart that forgot the calibrated bounds fails. Steps without a
    calibration log no calibration data; the cells without a shadow log none of it."""
    if INTERRUPTED not in runs:
        pytest.skip("the calibrated cell is not among the runs")
    run = runs[INTERRUPTED]
    rows, dumps = metrics(run), loss_dumps(run)
    for step in range(1, STEPS + 1):
        r = rows[step]
        assert "clip/low" in r and "clip/high" in r, step
        if step not in CALIBRATION_STEPS:
            assert not any(k in r for k in ("clip/k", "clip/n", "clip/alpha_n", "clip/events")), (step, r)
            continue
        n_neg = sum(int(((d["advantages"] < 0) & d["mask"].bool()).sum()) for d in dumps[step])
        assert r["clip/events"] == 1 and r["clip/n"] == n_neg > 0, (step, r, n_neg)
        assert 0 <= r["clip/k"] <= r["clip/n"] and float(r["clip/k"]).is_integer(), (step, r)
        assert r["clip/alpha_n"] == pytest.approx(r["clip/alpha_run"] * r["clip/n"]), (step, r)
        assert r["shadow/oos_n_neg"] > 0, (step, r)  # its tokens ran under earlier bounds: out of sample
    first, last = rows[CALIBRATION_STEPS[0]], rows[CALIBRATION_STEPS[-1]]
    assert last["clip/alpha_run"] == pytest.approx((first["clip/k"] + last["clip/k"]) / (first["clip/n"] + last["clip/n"]))
    init = (0.6, 1.8)  # sweeps/clip/calibrated.yaml's init_bounds
    assert all((d["low"], d["high"]) == pytest.approx(init) for d in dumps[1])
    assert (rows[1]["clip/low"], rows[1]["clip/high"]) == pytest.approx(init)  # the bounds in force
    ruled = (rows[1]["clip/low_next"], rows[1]["clip/high_next"])  # step 1's calibration, EMA-smoothed
    assert ruled != pytest.approx(init), ruled
    for step in (2, 3):
        assert (rows[step]["clip/low"], rows[step]["clip/high"]) == pytest.approx(ruled), step
        assert all((d["low"], d["high"]) == pytest.approx(ruled) for d in dumps[step]), step
    assert rows[STEPS]["clip/calibrations"] + rows[STEPS]["clip/degenerate_updates"] == len(CALIBRATION_STEPS)
    assert rows[STEPS]["clip/calibrations"] > 0
    for prefix in [p for p in ("grpo-8b-bf16-vanilla", "dapo-8b-tensorwise-score_centering_tis") if p in runs]:
        assert not any(k.startswith(("shadow/", "clip/k", "clip/n", "clip/alpha")) for r in metrics(runs[prefix]).values()
                       for k in r)


def test_the_driver_checked_every_policy_actor_before_training(runs):
    """The driver's start-up check ran in every cell and read the FP8 conversion it expects."""
    for prefix, run in runs.items():
        for path in [run / "openrlhf" / "attestation.json"]:
            att = json.loads(path.read_text())
            assert att["checked"] and att["actors"], prefix
            for a in att["actors"]:
                assert a["loss"] == "Fp8rlPolicyLoss", prefix
                assert a["fp8_layers"] == (LINEARS if CELLS[prefix][1] else 0), prefix


def test_the_interrupted_cell_resumed_from_its_checkpoint(runs):
    """The cell killed after its first checkpoint ran again (a second driver attempt), resumed
    from the checkpoint (no step before it rerun) and logged every step exactly once."""
    if INTERRUPTED not in runs:
        pytest.skip(f"{INTERRUPTED} not in this (partial) smoke run")
    run = runs[INTERRUPTED]
    logs = sorted((run / "openrlhf").glob("driver.*.log"))
    assert len(logs) >= 2, [p.name for p in logs]
    resumed = logs[-1].read_text(errors="replace")
    assert "Global step 1:" not in resumed  # step 1 came from the checkpoint
    assert f"Global step {STEPS}:" in resumed
    rows = metrics(run)
    assert sorted(rows) == list(range(1, STEPS + 1))
    # the controller's counts survived the restart: every calibration step, each counted once
    assert rows[STEPS]["clip/calibrations"] + rows[STEPS]["clip/degenerate_updates"] == len(CALIBRATION_STEPS)


def test_the_report_was_written(runs):
    report = SWEEP / "report" / "report.md"
    assert report.exists() and report.stat().st_size > 0
    text = report.read_text()
    for arm in ("BF16", "FP8 rowwise + calibrated", "FP8 tensorwise + Score Centering + TIS", "FP8 rollout only"):
        assert f"| {arm} |" in text, arm
    assert "4 cells: 4 ok." in text


#: Metric-key prefixes of wall times (they differ between any two runs); everything else must match.
WALL_TIME = ("openrlhf/timing/", "perf/")


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(WALL_TIME)}


def test_the_resumed_cell_equals_an_uninterrupted_run(runs):
    """The interrupted cell, resumed from its checkpoint, logged the same metrics at every step,
    the same evaluation and ended with bit-identical engine weights as the same cell run once
    more, uninterrupted (``paper_smoke_reference``). Rollouts are seeded per request and taken in
    dispatch order (``plugin.binding.rollout``), the engines decode one sequence at a time
    (``openrlhf.engine_max_num_seqs: 1``: nothing depends on batch-mates) and the CPU job's AdamW
    resumes exactly (``cpu_support.torch_adam``), so nothing but wall time may differ."""
    twin = next((p for p in REFERENCE.glob(INTERRUPTED + "-s0-*") if (p / "config.yaml").exists()), None)
    if twin is None:
        msg = f"{REFERENCE} lacks the uninterrupted {INTERRUPTED}: run `make paper-smoke` first"
        if os.environ.get("FP8RL_REQUIRE_PAPER_SMOKE"):
            pytest.fail(msg)
        pytest.skip(msg)
    run = runs[INTERRUPTED]
    assert twin.name == run.name  # the same run identity: the same cell
    assert len(list((run / "openrlhf").glob("driver.*.log"))) >= 2  # it was interrupted and resumed
    assert len(list((twin / "openrlhf").glob("driver.*.log"))) == 1  # the reference was not
    got, want = metrics(run), metrics(twin)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert _deterministic(got[step]) == _deterministic(want[step]), step
    assert len(_deterministic(want[STEPS])) > 20  # the comparison covers the step's metrics

    def evals(path):
        return [_deterministic(e) for e in jsonl(path / "eval.jsonl")]

    assert evals(run) == evals(twin)
    for key in ("digest", "probe"):
        assert _syncs(run)[-1][key] == _syncs(twin)[-1][key], key


def test_driver_main_ran_whole_under_coverage(runs):
    """Every driver of the smoke job ran under coverage (``FP8RL_DRIVER_COVERAGE``): combined, every
    statement of ``driver.main`` ran but the usage error for a command line without ``--``."""
    import ast

    coverage = pytest.importorskip("coverage")
    files = sorted(COVERAGE.glob(".coverage.*")) if COVERAGE.exists() else []
    if not files:
        msg = f"no coverage data in {COVERAGE}: run `make paper-smoke` first"
        if os.environ.get("FP8RL_REQUIRE_PAPER_SMOKE"):
            pytest.fail(msg)
        pytest.skip(msg)
    # one per driver that exited: every cell's and the reference's (the interrupted attempt need not)
    assert len(files) >= len(runs) + REFERENCE.exists(), [f.name for f in files]
    data = coverage.CoverageData(no_disk=True)
    for f in files:
        part = coverage.CoverageData(basename=str(f))
        part.read()
        data.update(part)
    # the driver that ran: this tree's, or that of the copy the job ran from (planted-bug checks)
    measured = next((f for f in data.measured_files()
                     if Path(f).parts[-4:] == ("fp8rl", "backends", "openrlhf", "driver.py")), None)
    assert measured is not None, sorted(data.measured_files())[:5]
    source = Path(measured)
    ran = set(data.lines(measured))
    main = next(n for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    statements = {n.lineno for n in ast.walk(main) if isinstance(n, ast.stmt) and n is not main}
    usage = {n.lineno for n in ast.walk(main) if isinstance(n, ast.Raise)}
    assert usage and statements - usage, statements
    assert statements - usage <= ran, sorted(statements - usage - ran)
