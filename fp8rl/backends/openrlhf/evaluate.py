"""Final evaluation bookkeeping: generate k samples per problem, grade, avg@k and pass@k.

``evaluate_run(run_dir, generate=...)`` reads the run's ``config.yaml`` (evaluation sets,
``eval_k``, ``eval_temperature``, ``max_response_len``, the data directory), asks ``generate``
for ``k`` responses per prompt, grades them with the boxed-answer math reward
(``fp8rl.backends.openrlhf.reward_func.score``, process pool with a deadline), and writes

- one ``eval.jsonl`` row per dataset at the run's last step, marked ``"source": "final"``;
- ``eval/<dataset>/avg@k`` and ``eval/<dataset>/pass@k`` into ``summary.json`` (the keys the
  analysis tables read first).

avg@k = mean over problems of (correct samples / k); pass@k = fraction of problems with at
least one correct sample among the k (the unbiased estimator of Chen et al. 2021 with n = k).

``generate`` is ``(prompts, k, temperature, max_tokens) -> list[list[str]]``; the GPU default
(:func:`vllm_generator`) runs vLLM on the final HF checkpoint (``checkpoint/final``); tests pass
a fake generator.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from math import comb
from pathlib import Path

Generate = Callable[[list[str], int, float, int], list[list[str]]]


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
                 k: int | None = None, data_dir: str | Path | None = None) -> dict:
    """Evaluate a run's final policy on its evaluation sets; returns ``{dataset: scores}``."""
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
    if generate is None:
        cpu = o.get("device", "cuda") == "cpu"  # the CPU job (plugin.cpu_support): one engine, eager
        generate = vllm_generator(str(rd.path / "checkpoint" / "final"),
                                  tp=1 if cpu else int(o["vllm_tp"][cfg["model"]["slot"]]),
                                  chat_template=bool(o.get("apply_chat_template", True)), cpu=cpu)
    metrics = rd.read_metrics() if rd.metrics_path.exists() else []
    step = max((int(r["step"]) for r in metrics), default=0)
    results, rows = {}, []
    for ds in o["eval_sets"]:
        path = ddir / f"{ds}.jsonl"
        data = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        prompts, labels = [d["input"] for d in data], [d["label"] for d in data]
        responses = generate(prompts, k, float(cfg["eval_temperature"]), int(cfg["max_response_len"]))
        res = score_dataset(labels, prompts, responses, k, pool)
        results[ds] = res
        row = M.eval_row(step, ds, avg_at_k=res["avg@k"], pass_at_k=res["pass@k"], k=k, n=res["n"])
        rows.append({**row, "source": "final"})
    old = [r for r in read_jsonl(rd.eval_path) if r.get("source") != "final"] if rd.eval_path.exists() else []
    atomic_write_text(rd.eval_path, "".join(dumps(r) + "\n" for r in old + rows))
    summary = dict(rd.summary() or {})
    for ds, res in results.items():
        summary[M.eval_key(ds, M.EVAL_AVG)] = res["avg@k"]
        summary[M.eval_key(ds, M.EVAL_PASS)] = res["pass@k"]
    summary["final_eval"] = {"k": k, "step": step}
    rd.write_summary(summary)
    return results


def vllm_generator(model_path: str, *, tp: int = 1, seed: int = 0, chat_template: bool = True,
                   cpu: bool = False) -> Generate:
    """A generator backed by vLLM (BF16) on ``model_path``; built lazily on first call.

    ``chat_template``: wrap prompts as the training did (``openrlhf.apply_chat_template``).
    ``cpu``: vLLM's CPU build (the CPU job): eager, and a small share of the machine's memory
    (on CPUs ``gpu_memory_utilization`` reserves host memory)."""
    state: dict = {}

    def generate(prompts: list[str], k: int, temperature: float, max_tokens: int) -> list[list[str]]:
        from vllm import LLM, SamplingParams

        if "llm" not in state:
            extra = {}
            if cpu:
                import os

                from fp8rl.backends.openrlhf.plugin.cpu_support import worker_env

                for key, value in worker_env().items():
                    if key != "PYTHONPATH":
                        os.environ.setdefault(key, value)
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
                extra = {"enforce_eager": True, "gpu_memory_utilization": 0.05}
            state["llm"] = LLM(model=model_path, tensor_parallel_size=tp, dtype="bfloat16", seed=seed, **extra)
        llm = state["llm"]
        tok = llm.get_tokenizer()
        chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in prompts] if chat_template else prompts
        params = SamplingParams(n=k, temperature=temperature, max_tokens=max_tokens, seed=seed)
        return [[o.text for o in out.outputs] for out in llm.generate(chats, params)]

    return generate
