"""Our mini RL step against Hugging Face TRL's ``GRPOTrainer`` on identical settings.

    make bench-peer                # installs the benchmark extra (TRL) and runs this
    python benchmarks/bench_peer_trl.py [--batches N] [--rounds R] [--arm fp32] [key=value ...]

A one-machine user who wants GRPO on a small model would reach for TRL; this prints how much
faster (or slower) a generation batch of our mini backend is. Each system runs in a process of
its own (``multiprocessing`` spawn), as each is run by its users, and the parent alternates
them round by round. Identical settings, taken from one ``MiniRunConfig``:

- the **model**: the same warm-started tiny Qwen3 (``Qwen3ForCausalLM``, fp32 master weights),
  which each process loads from the warm-start cache (TRL: a fresh deep copy per round); TRL's copy uses transformers' default SDPA attention (as a TRL user
  gets it; ours runs its own Qwen3 forward, ``fp8rl.backends.mini.qwen3``, with fused SDPA in
  the engine and eager attention in the trainer);
- the **prompts**: the arithmetic task's training prompts with ``<bos>``; TRL gets a
  ``PreTrainedTokenizerFast`` with exactly our character vocabulary (checked: it encodes every
  prompt to our ids);
- the **generation batch**: ``prompts_per_step`` prompts x ``n_samples_per_prompt``
  completions (8 x 8 unless overridden, e.g. ``prompts_per_step=16`` for the mini default),
  sampled at ``temperature`` (no top-k / top-p);
- the **completion length** (``--trl-length fixed``, the default): TRL generates exactly ``L``
  tokens per completion (``min_new_tokens = max_new_tokens = L``), ``L`` = our measured mean
  completion length in the same run, rounded; so both systems train on the same number of
  completion tokens and neither generates more. Ours samples until ``<eos>`` (its batch decodes
  until its longest completion ends). ``--trl-length natural``: TRL samples until ``<eos>`` too
  (same policy, so the same length distribution; not the same samples);
- the **updates**: ``num_mini_batches`` AdamW steps per generation batch (TRL:
  ``steps_per_generation`` = that, ``per_device_train_batch_size`` = batch / that, one
  iteration), old log-probs recomputed by the trainer before the updates (TRL does this when
  ``steps_per_generation > gradient_accumulation_steps``), PPO clip ``eps_low``/``eps_high``,
  token-mean loss (TRL ``loss_type="dapo"``), group-normalised advantages, no KL
  (``beta=0``), same lr, betas, gradient clipping, constant schedule;
- **threads**: ``torch.set_num_threads(--threads)`` (default 1) for both (checked inside TRL's
  training steps);
- **determinism**: ours in its default deterministic mode (``mini.deterministic``); TRL as its
  users run it, in torch's default mode (deterministic mode makes TRL's chunked log-prob kernel
  fill a large scratch buffer on every call, ~4x its step time at this size; not TRL's fault);
- the **reward**: our exact-match grader in both;
- the **allocator**: a mini run has glibc keep freed memory for reuse
  (``runtime.keep_freed_memory``, applied by ``torch_settings``), a process-wide setting. TRL
  runs at glibc's defaults, as its users run it (``trl``), and, unless ``--trl-allocator
  default``, also in a third process with our setting (``trl_kept``): what TRL would gain from
  it, so the allocator's share of the speedup is measured, not argued.

Timing: ours = ``MiniTrainer.train_step`` (rollout = generation + grading; train = old
log-probs, updates, engine sync, diagnostics); TRL = from the first optimizer step of a
generation batch to the first of the next (rollout = its ``_generate``; train = everything
else: scoring, old log-probs, the four optimizer steps, its bookkeeping). Both as wall time and
as the process's CPU time (``time.process_time``: on a shared machine it leaves out the time
other processes hold the cores, which wall time does not).

Protocol: one process per system, each loading the same warm start once; ``--rounds`` rounds;
in each, every system runs ``--warmup + --batches`` generation batches (a fresh trainer each
round) while the others wait, the order rotating round by round (ours first in round 1, where
TRL's completion length is measured) so that a load change on the machine hits all alike; the
first ``--warmup`` batches of each round are dropped. Printed: per round the medians and their
ratios; overall the medians over all measured batches with their interquartile range, and
``speedup`` = TRL's median / ours per generation batch (> 1: we are faster), with the per-round
ratios' minimum and maximum as its spread, and the per-round ratios' median with a
distribution-free 95% interval (order statistics; from 6 rounds on); ``speedup_vs_trl_kept``:
the same against ``trl_kept``; the same for CPU time (each process's own); the machine (CPU, cores, torch and
TRL versions), each process's allocator setting, and the load average before and after.
``--arm`` picks our arm
from ``sweeps/fp8/`` (default ``fp32``: TRL runs the fp32 model in fp32, so ``fp32`` is the
like-for-like comparison; ``bf16`` adds our CPU emulation of BF16 GEMMs, ``tensorwise`` etc.
FP8, which TRL does not have). Both systems train every parameter at ``lr`` (``lr_lm_head`` /
``lr_final_norm`` are set to null unless overridden).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def hf_tokenizer(tok):
    """A ``PreTrainedTokenizerFast`` with exactly ``tok``'s ids (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(tok.specials)}
    vocab.update({c: i + len(tok.specials) for i, c in enumerate(tok.alphabet)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    t.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", padding_side="left")


class Ours:
    """Our mini trainer on ``cfg`` (no run directory)."""

    def __init__(self, cfg, base, sft_cache: str) -> None:
        from fp8rl.backends.mini.trainer import MiniTrainer

        self.trainer = MiniTrainer(cfg, None, sft_cache=sft_cache)
        self.step = 0

    def batches(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            self.step += 1
            c0, t0 = time.process_time(), time.perf_counter()
            row = self.trainer.train_step(self.step)
            total, cpu = time.perf_counter() - t0, time.process_time() - c0
            out.append({"total_s": total, "cpu_s": cpu, "rollout_s": row["perf/rollout_s"],
                        "train_s": total - row["perf/rollout_s"], "completion_len": row["rollout/response_len"]})
        return out


class Trl:
    """TRL's ``GRPOTrainer`` on the same model, prompts, reward and update schedule."""

    def __init__(self, cfg, base, train_set, tok, workdir: str) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from fp8rl.rewards.exact import grade_exact

        self.cfg, self.workdir = cfg, workdir
        self.hf_tok = hf_tokenizer(tok)
        prompts = [p.prompt for p in train_set]
        for p in prompts[:256]:  # the two tokenizers agree
            assert self.hf_tok(p)["input_ids"] == tok.encode(p, bos=True), p
        self.dataset = Dataset.from_dict({"prompt": prompts, "answer": [str(p.answer) for p in train_set]})
        self.base = base

        def reward(completions, answer, **_):
            return [float(grade_exact(c, a).correct) for c, a in zip(completions, answer, strict=True)]

        self.reward = reward
        self.GRPOConfig, self.GRPOTrainer = GRPOConfig, GRPOTrainer

    def batches(self, n: int, length: int | None) -> list[dict]:
        """Train a fresh GRPOTrainer for ``n`` generation batches and time each; ``length``:
        every completion exactly that many tokens (None: until ``<eos>``, at most
        ``max_response_len``)."""
        from transformers import TrainerCallback

        cfg, a = self.cfg, self.cfg.algorithm
        m = cfg.num_mini_batches
        batch = cfg.prompts_per_step * a.n_samples_per_prompt
        args = self.GRPOConfig(
            output_dir=self.workdir, use_cpu=True, bf16=False, fp16=False, seed=cfg.seed,
            per_device_train_batch_size=batch // m, gradient_accumulation_steps=1, steps_per_generation=m,
            num_generations=a.n_samples_per_prompt, num_iterations=1, max_steps=n * m,
            max_completion_length=cfg.max_response_len if length is None else length,
            generation_kwargs=None if length is None else {"min_new_tokens": length},
            temperature=cfg.temperature, top_p=1.0, top_k=0,
            learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0,
            adam_beta1=cfg.adam_betas[0], adam_beta2=cfg.adam_betas[1], weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm, beta=0.0, epsilon=a.eps_low, epsilon_high=a.eps_high,
            loss_type="dapo", scale_rewards="group", report_to="none", logging_steps=n * m,
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
            gradient_checkpointing=False,  # TRL's default is True; our trainer does not recompute
        )
        stamps: list[float] = []
        cpu_stamps: list[float] = []
        gen_s: list[float] = []
        threads: list[int] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *_a, **_k):
                stamps.append(time.perf_counter())
                cpu_stamps.append(time.process_time())
                threads.append(torch.get_num_threads())

            def on_train_end(self, *_a, **_k):
                stamps.append(time.perf_counter())
                cpu_stamps.append(time.process_time())

        model = copy.deepcopy(self.base).train()
        model.set_attn_implementation("sdpa")  # transformers' default, what a TRL user gets
        trainer = self.GRPOTrainer(model=model, reward_funcs=[self.reward], args=args,
                                   train_dataset=self.dataset, processing_class=self.hf_tok, callbacks=[Clock()])
        inner = trainer._generate
        lengths: list[float] = []

        def timed_generate(prompts):
            t0 = time.perf_counter()
            out = inner(prompts)
            gen_s.append(time.perf_counter() - t0)
            lengths.append(sum(len(c) for c in out[1]) / len(out[1]))
            return out

        trainer._generate = timed_generate
        # TRL as its users run it: torch's default (non-deterministic) mode. Deterministic mode
        # makes every ``torch.empty`` fill its memory, which costs TRL's chunked log-prob kernel
        # (a large scratch buffer per call) about 4x its step time at this size.
        with deterministic(False), contextlib.redirect_stdout(sys.stderr):  # its log lines off our JSON
            trainer.train()
        if set(threads) != {torch.get_num_threads()}:
            raise RuntimeError(f"TRL ran with {sorted(set(threads))} threads, ours with {torch.get_num_threads()}")
        def batch_starts(clock: list[float]) -> list[float]:
            starts = clock[::m][: n + 1]
            return starts if len(starts) == n + 1 else [*starts, clock[-1]]

        starts, cpu_starts = batch_starts(stamps), batch_starts(cpu_stamps)
        out = []
        for i in range(n):
            total = starts[i + 1] - starts[i]
            out.append({"total_s": total, "cpu_s": cpu_starts[i + 1] - cpu_starts[i], "rollout_s": gen_s[i],
                        "train_s": total - gen_s[i], "completion_len": lengths[i]})
        return out


@contextlib.contextmanager
def deterministic(on: bool):
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


KEYS = ("total_s", "cpu_s", "rollout_s", "train_s", "completion_len")


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def iqr(rows: list[dict], key: str) -> list[float]:
    """The interquartile range ``[q1, q3]`` of ``key`` over ``rows``."""
    q = statistics.quantiles([r[key] for r in rows], n=4, method="inclusive")
    return [round(q[0], 4), round(q[2], 4)]


def machine() -> dict:
    """What the numbers were measured on."""
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        trl_version = version("trl")
    except Exception:  # only reported
        trl_version = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "trl": trl_version,
            "python": platform.python_version()}


def median_ci95(values: list[float]) -> list[float] | None:
    """A distribution-free interval for the median of ``values``: the order statistics
    ``[x_(k), x_(n-k+1)]`` with the largest ``k`` such that ``P(Binomial(n, 1/2) < k) <= 0.025``
    (coverage >= 95%); None when ``n`` is too small for one (n < 6)."""
    n, xs = len(values), sorted(values)
    below, k = 0.0, 0
    while below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    return None if k == 0 else [xs[k - 1], xs[n - k]]


#: the TRL processes of each ``--trl-allocator`` choice: ``trl`` at glibc's defaults, ``trl_kept``
#: with our allocator setting (beside ``ours``, always measured)
PEERS = {"default": ("trl",), "kept": ("trl_kept",), "both": ("trl", "trl_kept")}


def summarize(rounds: dict[str, list[list[dict]]], length: int | None) -> dict:
    """Medians, interquartile ranges and the speedups with their per-round spread.

    ``rounds``: per system (``ours`` and ``PEERS``' names), per round, the measured batches' rows."""
    flat = {name: [r for rows in per for r in rows] for name, per in rounds.items()}
    ours = flat["ours"]

    def part(rows):
        return {k: round(median(rows, k), 4) for k in KEYS} | {"total_s_iqr": iqr(rows, "total_s"),
                                                               "cpu_s_iqr": iqr(rows, "cpu_s")}

    def against(peer: str, suffix: str) -> dict:
        def ratio(key: str) -> float:
            return round(median(flat[peer], key) / median(ours, key), 3)

        def per_round(key: str) -> list[float]:
            return [round(median(t, key) / median(o, key), 3)
                    for o, t in zip(rounds["ours"], rounds[peer], strict=True)]

        total, cpu = per_round("total_s"), per_round("cpu_s")
        return {f"speedup{suffix}": ratio("total_s"), f"speedup{suffix}_rounds": total,
                f"speedup{suffix}_spread": [min(total), max(total)],
                f"speedup{suffix}_rounds_median": round(statistics.median(total), 3),
                f"speedup{suffix}_rounds_median_ci95": median_ci95(total),
                f"speedup{suffix}_cpu": ratio("cpu_s"), f"speedup{suffix}_cpu_rounds": cpu,
                f"speedup{suffix}_cpu_spread": [min(cpu), max(cpu)],
                f"speedup{suffix}_rollout": ratio("rollout_s"), f"speedup{suffix}_train": ratio("train_s")}

    out: dict = {"trl_completion_len": "natural" if length is None else length}
    out |= {name: part(rows) for name, rows in flat.items()}
    if "trl" in rounds:
        out |= against("trl", "")
    if "trl_kept" in rounds:
        out |= against("trl_kept", "_vs_trl_kept")
    return out


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=8, help="measured generation batches per round and system")
    p.add_argument("--warmup", type=int, default=2, help="batches dropped at the start of each round")
    p.add_argument("--rounds", type=int, default=12,
                   help="rounds, the order of the systems rotating (6 or more for the median's interval)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trl-length", choices=("fixed", "natural"), default="fixed",
                   help="fixed: TRL completions exactly our measured mean length; natural: until <eos>")
    p.add_argument("--trl-allocator", choices=tuple(PEERS), default="both",
                   help="TRL at glibc's defaults (as its users run it), with our allocator setting, or both")
    p.add_argument("--arm", default="fp32",
                   help="our arm, a sweeps/fp8/ name (default fp32: TRL's model computes in fp32 here)")
    p.add_argument("--cache", default="runs/.cache/sft", help="SFT warm-start cache")
    p.add_argument("overrides", nargs="*", help="MiniRunConfig key=value overrides")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.batches < 1 or args.warmup < 0:
        raise SystemExit("--rounds and --batches must be >= 1 and --warmup >= 0")
    overrides = config_overrides(args.arm, args.threads, args.cache, args.overrides)
    cfg = parse(overrides)
    from fp8rl.backends.mini.runtime import torch_settings

    # the warm start, trained (or found in the cache) once here, before the systems' processes
    # load it; this process then only waits for them
    with torch_settings(cfg.mini.deterministic, args.threads, cfg.mini.device):
        load(cfg, args.cache)
    return measure(args, cfg, overrides, ["ours", *PEERS[args.trl_allocator]])


def config_overrides(arm: str, threads: int, cache: str, extra: list[str]) -> list[str]:
    """The ``MiniRunConfig`` overrides of a run: the arm (a ``sweeps/fp8/`` name), one learning
    rate, the issue's batch, the thread count and the cache, then ``extra``."""
    import yaml

    arm_file = Path(__file__).resolve().parents[1] / "sweeps" / "fp8" / f"{arm}.yaml"
    if not arm_file.is_file():
        raise SystemExit(f"--arm {arm!r}: no sweeps/fp8/{arm}.yaml; use an FP8 arm name such as "
                         "fp32, bf16, tensorwise, blockwise")
    arm_kv = [f"fp8.{k}={v}" for k, v in yaml.safe_load(arm_file.read_text()).items()]
    # one learning rate for every parameter, as TRL trains (the mini regime's per-group rates
    # cost nothing extra, but like for like); a key=value override replaces these
    same_lr = ["lr_lm_head=null", "lr_final_norm=null"]
    # the settings of issue 33: 8 prompts x 8 completions (the mini default is 16 prompts)
    issue = ["prompts_per_step=8"]
    return [*arm_kv, *same_lr, *issue, f"mini.num_threads={threads}", f"mini.cache_dir={cache}", *extra]


def parse(overrides: list[str]):
    from fp8rl.backends.mini.__main__ import parse_config

    return parse_config(overrides)[0]


def load(cfg, cache: str):
    """``(train_set, tokenizer, warm-started base model)`` of ``cfg``."""
    from fp8rl.backends.mini.sft import warm_start
    from fp8rl.backends.mini.task import make_splits
    from fp8rl.backends.mini.tokenizer import CharTokenizer

    mini, tok = cfg.mini, CharTokenizer()
    train_set, _ = make_splits(mini.data_seed, mini.n_train, mini.n_eval, min_terms=mini.min_terms,
                               max_terms=mini.max_terms, max_operand=mini.max_operand)
    base, _ = warm_start(cfg.model.slot, train_set, tok, mini, cache)
    return train_set, tok, base


def serve(conn, system: str, overrides: list[str], threads: int, cache: str, repo: str) -> None:
    """A system's process: set up as its users run it, then run rounds on request.

    Requests: ``(batches, length)``; replies: the rows of ``Ours/Trl.batches`` (or an error
    string). ``system``: ``ours`` or a name of ``PEERS``."""
    sys.path.insert(0, repo)
    try:
        from fp8rl.backends.mini.runtime import keep_freed_memory, torch_settings

        cfg = parse(overrides)
        if system == "ours":  # a mini run's torch settings, the allocator setting among them
            settings = torch_settings(cfg.mini.deterministic, threads, cfg.mini.device)
        else:
            torch.set_num_threads(threads)
            settings = contextlib.nullcontext()
        with settings, tempfile.TemporaryDirectory() as tmp:
            kept = keep_freed_memory() if system in ("ours", "trl_kept") else False
            train_set, tok, base = load(cfg, cache)
            trl = None if system == "ours" else Trl(cfg, base, train_set, tok, tmp)
            conn.send({"allocator": "kept (runtime.keep_freed_memory)" if kept else "glibc defaults",
                       "threads": torch.get_num_threads()})
            while (req := conn.recv()) is not None:
                n, length = req
                conn.send(Ours(cfg, base, cache).batches(n) if trl is None else trl.batches(n, length))
    except BaseException as e:  # reported by the parent, which stops
        import traceback

        conn.send(f"{system}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise


def measure(args: argparse.Namespace, cfg, overrides: list[str], systems: list[str]) -> dict:
    """The rounds of ``main``, one process per system; prints and returns the JSON summary."""
    import multiprocessing
    import os

    repo = str(Path(__file__).resolve().parents[1])
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no allocator setting inherited
    procs, conns, setup = {}, {}, {}

    def ask(name: str, request):
        conns[name].send(request)
        reply = conns[name].recv()
        if isinstance(reply, str):
            raise SystemExit(reply)
        return reply

    try:
        for name in systems:
            conns[name], child = ctx.Pipe()
            procs[name] = ctx.Process(target=serve, args=(child, name, overrides, args.threads, args.cache, repo),
                                      daemon=True)
            procs[name].start()
        for name in systems:
            setup[name] = conns[name].recv()
            if isinstance(setup[name], str):
                raise SystemExit(setup[name])
        load_before = os.getloadavg()
        rounds: dict[str, list[list[dict]]] = {name: [] for name in systems}
        length: int | None = None
        keep = slice(args.warmup, None)
        for r in range(args.rounds):
            for name in systems[r % len(systems):] + systems[: r % len(systems)]:
                rounds[name].append(ask(name, (args.warmup + args.batches, length))[keep])
                if name == "ours" and length is None and args.trl_length == "fixed":  # round 1: ours first
                    length = round(statistics.mean(b["completion_len"] for b in rounds["ours"][0]))
            o = median(rounds["ours"][-1], "total_s")
            peers = ", ".join(f"{name} {median(rounds[name][-1], 'total_s'):.4f} s "
                              f"(x{median(rounds[name][-1], 'total_s') / o:.3f}; cpu "
                              f"x{median(rounds[name][-1], 'cpu_s') / median(rounds['ours'][-1], 'cpu_s'):.3f})"
                              for name in systems[1:])
            print(f"round {r + 1}/{args.rounds}: ours {o:.4f} s, {peers} per generation batch, "
                  f"load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        for name in systems:
            conns[name].send(None)
    finally:
        for proc in procs.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    out = {
        "settings": {"slot": cfg.model.slot, "arm": args.arm, "prompts x samples":
                     f"{cfg.prompts_per_step} x {cfg.algorithm.n_samples_per_prompt}",
                     "updates_per_batch": cfg.num_mini_batches, "max_response_len": cfg.max_response_len,
                     "threads": args.threads, "rounds": args.rounds,
                     "batches_measured_per_system": sum(len(x) for x in rounds["ours"])},
        "machine": machine(),
        "processes": setup,
        "load_avg_1_5_15": {"before": [round(x, 2) for x in load_before],
                            "after": [round(x, 2) for x in os.getloadavg()]},
        **summarize(rounds, length),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
