"""The evaluation pass after training: generate k samples per problem, grade, avg@k and pass@k.

``evaluate_run(run_dir)`` reads the run's ``config.yaml`` (evaluation sets, ``eval_k``,
``eval_temperature``, ``max_response_len``, the data directory, the rollout recipe,
``openrlhf.eval_bf16``), asks vLLM engines for ``k`` responses per prompt, grades them with the
boxed-answer math reward (``fp8rl.backends.openrlhf.reward_func.score``, process pool with a
deadline), and writes ``eval.jsonl`` rows marked ``"source": "final"`` (:data:`SOURCE`; kept by
ingestion, replaced by the next pass) and the numbers into ``summary.json``, with what each pass
scored (``final_eval.weights``: the step, the checkpoint and a digest of the parameters its engine
held, :func:`evaluated_weights`). With ``openrlhf.dump_loss_inputs`` (the smoke job) it also writes
every generation with the sampling settings the engine got to ``openrlhf/dumps/final_eval.jsonl``.

The engines (:func:`evaluation_plan`):

- **the arm's own engine** on the final checkpoint (``checkpoint/final``): vLLM with the
  arm's rollout quantization (``plugin.fp8_rollout.VLLM_QUANTIZATION``: the online FP8 method the
  rollout engines ran; none for a ``bf16`` rollout), so that ``eval/<dataset>/avg@k`` and
  ``pass@k`` mean one engine at every step, OpenRLHF's evaluations during training included;
- with ``openrlhf.eval_bf16`` (or ``--bf16``), **a BF16 engine** (vLLM, ``dtype=bfloat16``, no
  quantization) on the base model (step 0) and on the final checkpoint: ``eval_bf16/<dataset>/...``
  at step 0 and at the last step, so every arm is evaluated in one precision and the training
  effect is the BF16-evaluated paired gain (``analysis.paired``). For a ``bf16`` rollout arm the
  final BF16 numbers are its own (one engine, generated once).

Every engine samples with the same vLLM seed, so the two engines and the two steps are paired by
problem and seed. Cost: the default pass is one evaluation of the final checkpoint; the BF16
option adds one (the base model) for a BF16 arm and two for an FP8 arm, each a full pass over the
evaluation sets at ``eval_k`` samples, as long as one of OpenRLHF's evaluations during training
plus loading the model once more (docs/cluster.md).

avg@k = mean over problems of (correct samples / k); pass@k = fraction of problems with at
least one correct sample among the k (the unbiased estimator of Chen et al. 2021 with n = k).

A generator is ``(prompts, k, temperature, max_tokens) -> list[list[str]]``;
:func:`vllm_generator` builds one on a model with a quantization; tests pass fake ones.

History: before ``openrlhf.eval_bf16`` existed this pass ran vLLM in BF16 for every arm and wrote
the result under ``eval/``, so an FP8 arm's last ``eval/`` row was scored by another engine than its
rows during training.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import comb
from pathlib import Path

Generate = Callable[[list[str], int, float, int], list[list[str]]]
#: ``(model path or HF id, vLLM quantization or None for BF16) -> Generate``.
Engines = Callable[[str, "str | None"], Generate]

#: ``source`` of the ``eval.jsonl`` rows this pass writes (ingestion keeps them; a new pass replaces them).
SOURCE = "final"


@dataclass(frozen=True)
class EvalPass:
    """One engine scoring one model: ``step`` is ``"initial"`` (the base model, step 0) or
    ``"final"`` (``checkpoint/final``, the run's last step); ``quantization`` is vLLM's online FP8
    shorthand or None (BF16); ``precision`` the keys it writes (``fp8rl.runs.metrics.EVAL_OWN``:
    ``eval/``, ``EVAL_BF16``: ``eval_bf16/``)."""

    step: str
    model: str
    quantization: str | None
    precision: str

    @property
    def engine(self) -> tuple[str, str | None]:
        """What generates: passes with the same engine share one generation."""
        return self.model, self.quantization


def evaluation_plan(cfg: dict, run_dir: str | Path, *, bf16: bool | None = None,
                    data_dir: str | Path | None = None) -> list[EvalPass]:
    """The passes of a run's evaluation (see the module docstring), from its ``config.yaml`` dict.

    ``bf16``: add the BF16 engine's passes (default: the config's ``openrlhf.eval_bf16``).
    """
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import VLLM_QUANTIZATION, check_rollout_recipe
    from fp8rl.backends.openrlhf.run import data_dir_of
    from fp8rl.backends.openrlhf.smoke import model_path
    from fp8rl.runs import metrics as M

    o = cfg["openrlhf"]
    recipe = cfg["fp8"]["rollout_recipe"]
    check_rollout_recipe(recipe)
    own_q = VLLM_QUANTIZATION.get(recipe)  # None: the bf16 rollout recipe
    final = str(Path(run_dir) / "checkpoint" / "final")
    plan = [EvalPass("final", final, own_q, M.EVAL_OWN)]
    if o.get("eval_bf16", False) if bf16 is None else bf16:
        model_id = o["models"][cfg["model"]["slot"]]
        base = model_path(model_id, Path(data_dir) if data_dir else data_dir_of(cfg)) or model_id
        plan += [EvalPass("initial", base, None, M.EVAL_BF16), EvalPass("final", final, None, M.EVAL_BF16)]
    return plan


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def score_dataset(labels: Sequence[str], prompts: Sequence[str], responses: Sequence[Sequence[str]],
                  k: int, pool=None) -> dict:
    """``{"avg@k", "pass@k", "n", "k"}`` for one dataset's graded responses."""
    from fp8rl.backends.openrlhf.reward_func import score

    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} response lists for {len(labels)} problems")
    avg, pas = 0.0, 0.0
    for _prompt, label, resp in zip(prompts, labels, responses, strict=True):
        if len(resp) != k:
            raise ValueError(f"expected {k} responses per problem, got {len(resp)}")
        c = sum(score(r, "", label, pool)["correct"] for r in resp)
        avg += c / k
        pas += pass_at_k(k, c, k)
    n = len(labels)
    return {"avg@k": avg / n, "pass@k": pas / n, "n": n, "k": k}


def evaluate_run(run_dir: str | Path, generate: Generate | None = None, *, pool=None,
                 k: int | None = None, data_dir: str | Path | None = None, bf16: bool | None = None,
                 engines: Engines | None = None) -> dict:
    """Evaluate a run (:func:`evaluation_plan`); returns ``{dataset: scores}`` of the arm's own
    engine on the final checkpoint, with ``"bf16"`` / ``"bf16_initial"`` scores inside each
    dataset's dict when the BF16 engine ran.

    ``generate``: the own engine's generator on the final checkpoint (tests); ``engines`` builds
    every other one (default :func:`vllm_generator` with the run's layout). ``bf16``: overrides
    ``openrlhf.eval_bf16``.
    """
    from fp8rl.backends.openrlhf.run import data_dir_of
    from fp8rl.runs import RunDir
    from fp8rl.runs import metrics as M
    from fp8rl.runs.rundir import atomic_write_text, dumps, read_jsonl

    rd = RunDir(run_dir)
    cfg = rd.config()
    if cfg is None:
        raise FileNotFoundError(f"{run_dir} has no config.yaml: not a run directory")
    o = cfg["openrlhf"]
    k = int(k or cfg["eval_k"])
    ddir = Path(data_dir) if data_dir else data_dir_of(cfg)
    plan = evaluation_plan(cfg, rd.path, bf16=bf16, data_dir=ddir)
    if engines is None:
        cpu = o.get("device", "cuda") == "cpu"  # the CPU job (plugin.cpu_support): one engine, eager
        tp = 1 if cpu else int(o["vllm_tp"][cfg["model"]["slot"]])

        def engines(model: str, quantization: str | None) -> Generate:
            return vllm_generator(model, tp=tp, chat_template=bool(o.get("apply_chat_template", True)), cpu=cpu,
                                  quantization=quantization)
    gens: dict[tuple, Generate] = {}
    if generate is not None:
        gens[plan[0].engine] = generate
    dumped: list[dict] = []  # with openrlhf.dump_loss_inputs (the smoke job): every generation, for the tests
    metrics = rd.read_metrics() if rd.metrics_path.exists() else []
    last = max((int(r["step"]) for r in metrics), default=0)
    at = {"initial": 0, "final": last}
    results, rows = {}, []
    for ds in o["eval_sets"]:
        path = ddir / f"{ds}.jsonl"
        data = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        prompts, labels = [d["input"] for d in data], [d["label"] for d in data]
        scored: dict[tuple, dict] = {}  # engine -> scores (an engine scoring twice generates once)
        by_pass = {}
        for p in plan:
            if p.engine not in scored:
                if p.engine not in gens:
                    gens[p.engine] = engines(*p.engine)
                responses = gens[p.engine](prompts, k, float(cfg["eval_temperature"]), int(cfg["max_response_len"]))
                scored[p.engine] = score_dataset(labels, prompts, responses, k, pool)
                state = getattr(gens[p.engine], "state", None) or {}
                dumped.append({"dataset": ds, "model": _model_name(p.model, rd.path),
                               "quantization": p.quantization, "params": state.get("params"), "prompts": prompts,
                               "labels": labels, "responses": responses, "scores": scored[p.engine]})
            by_pass[(p.step, p.precision)] = scored[p.engine]
        own = by_pass[("final", M.EVAL_OWN)]
        res = dict(own)
        bf16_final, bf16_initial = by_pass.get(("final", M.EVAL_BF16)), by_pass.get(("initial", M.EVAL_BF16))
        if bf16_initial is not None:
            res["bf16"], res["bf16_initial"] = bf16_final, bf16_initial
            rows.append({**M.eval_row(at["initial"], ds, bf16_avg_at_k=bf16_initial["avg@k"],
                                      bf16_pass_at_k=bf16_initial["pass@k"], k=k, n=own["n"]), "source": SOURCE})
        results[ds] = res
        row = M.eval_row(at["final"], ds, avg_at_k=own["avg@k"], pass_at_k=own["pass@k"], k=k, n=own["n"],
                         bf16_avg_at_k=bf16_final["avg@k"] if bf16_final else None,
                         bf16_pass_at_k=bf16_final["pass@k"] if bf16_final else None)
        rows.append({**row, "source": SOURCE})
    old = [r for r in read_jsonl(rd.eval_path) if r.get("source") != SOURCE] if rd.eval_path.exists() else []
    rows = sorted(old + rows, key=lambda r: r[M.STEP])  # stable: step 0 first, the pass's rows after OpenRLHF's
    atomic_write_text(rd.eval_path, "".join(dumps(r) + "\n" for r in rows))
    summary = dict(rd.summary() or {})
    for ds, res in results.items():
        summary[M.eval_key(ds, M.EVAL_AVG)] = res["avg@k"]
        summary[M.eval_key(ds, M.EVAL_PASS)] = res["pass@k"]
        if "bf16" in res:
            avg = M.eval_key(ds, M.EVAL_AVG, precision=M.EVAL_BF16)
            summary[avg] = res["bf16"]["avg@k"]
            summary[M.eval_key(ds, M.EVAL_PASS, precision=M.EVAL_BF16)] = res["bf16"]["pass@k"]
            summary[f"{avg}/initial"] = res["bf16_initial"]["avg@k"]
    summary["final_eval"] = {"k": k, "step": last, "quantization": plan[0].quantization,
                             "bf16": any(p.precision == M.EVAL_BF16 for p in plan),
                             "weights": [evaluated_weights(p, at[p.step], gens.get(p.engine), rd.path) for p in plan]}
    rd.write_summary(summary)
    if o.get("dump_loss_inputs"):
        dumps = rd.path / "openrlhf" / "dumps"
        dumps.mkdir(parents=True, exist_ok=True)
        atomic_write_text(dumps / "final_eval.jsonl", "".join(json.dumps(d) + "\n" for d in dumped))
    return results


def evaluated_weights(p: EvalPass, step: int, generate: Generate | None, run_dir: Path) -> dict:
    """What one pass scored: ``{"pass", "precision", "step", "model", "quantization", "digest"}``.

    ``model``: the checkpoint, relative to the run directory where it lies inside it (``checkpoint/final``),
    else as given (the base model); ``digest``: :func:`~fp8rl.backends.openrlhf.plugin.binding.vllm_worker.weights_digest`
    of the parameters the engine held when it generated (``generate.state["digest"]``; None for a
    generator that does not report them, as the unit tests' fakes), comparable with the digest the
    rollout engines logged after their last weight sync (``openrlhf/dumps/engine_syncs.jsonl``)."""
    state = getattr(generate, "state", None) or {}
    return {"pass": p.step, "precision": p.precision, "step": step, "model": _model_name(p.model, run_dir),
            "quantization": p.quantization, "digest": state.get("digest")}


def _model_name(model: str, run_dir: Path) -> str:
    """``model`` relative to the run directory where it lies inside it, else as given."""
    try:
        return str(Path(model).resolve().relative_to(Path(run_dir).resolve()))
    except ValueError:
        return str(model)


def _engine_digest(worker) -> str:
    """Runs in the vLLM worker (``LLM.collective_rpc``): the digest of its model's parameters."""
    from fp8rl.backends.openrlhf.plugin.binding.vllm_worker import engine_weights, weights_digest

    return weights_digest(engine_weights(worker.model_runner.model)["digest"])


def vllm_generator(model_path: str, *, tp: int = 1, seed: int = 0, chat_template: bool = True,
                   cpu: bool = False, quantization: str | None = None) -> Generate:
    """A generator backed by vLLM on ``model_path``; built lazily on first call (then in
    ``generate.state["llm"]``).

    ``quantization``: None (BF16) or vLLM's online FP8 shorthand (``fp8_per_tensor``...), the
    engine the rollout engines of an FP8 arm ran (``plugin.fp8_rollout.rollout_engine_kwargs``).
    ``chat_template``: wrap prompts as the training did (``openrlhf.apply_chat_template``).
    ``cpu``: vLLM's CPU build (the CPU job): eager, and a small share of the machine's memory
    (on CPUs ``gpu_memory_utilization`` reserves host memory)."""
    state: dict = {}

    def generate(prompts: list[str], k: int, temperature: float, max_tokens: int) -> list[list[str]]:
        from vllm import LLM, SamplingParams

        if "llm" not in state:
            extra = {}
            if cpu:
                from fp8rl.backends.openrlhf.plugin.cpu_support import worker_env

                for key, value in worker_env().items():
                    if key != "PYTHONPATH":
                        os.environ.setdefault(key, value)
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
                extra = {"enforce_eager": True, "gpu_memory_utilization": 0.05}
            if quantization is not None:
                extra["quantization"] = quantization
            # the digest below sends a function of ours to the workers, which vLLM's multiprocess
            # engine (GPUs) accepts with this set
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            state["llm"] = LLM(model=model_path, tensor_parallel_size=tp, dtype="bfloat16", seed=seed, **extra)
            state["digest"] = state["llm"].collective_rpc(_engine_digest)[0]  # the weights it generates with
        llm = state["llm"]
        tok = llm.get_tokenizer()
        chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in prompts] if chat_template else prompts
        params = SamplingParams(n=k, temperature=temperature, max_tokens=max_tokens, seed=seed)
        state["params"] = {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
                           "max_tokens": params.max_tokens, "seed": params.seed}  # as the engine got them
        return [[o.text for o in out.outputs] for out in llm.generate(chats, params)]

    generate.state = state  # the engine once built (``state["llm"]``) and its weights' ``state["digest"]``
    return generate
