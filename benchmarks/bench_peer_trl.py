"""Our mini RL step against Hugging Face TRL's ``GRPOTrainer`` on identical settings.

    make bench-peer                # installs the benchmark extra (TRL) and runs this
    python benchmarks/bench_peer_trl.py [--batches N] [--rounds R] [--arm bf16] [key=value ...]

A one-machine user who wants GRPO on a small model would reach for TRL; this prints how much
faster (or slower) a generation batch of our mini backend is, measured in the same process,
alternating the two systems ``--rounds`` times so that a load change on the (shared) machine
hits both alike. Identical settings, taken from one ``MiniRunConfig``:

- the **model**: the same warm-started tiny Qwen3 (``Qwen3ForCausalLM``, fp32 master weights),
  one deep copy per system; TRL's copy uses transformers' default SDPA attention (as a TRL user
  gets it; ours runs its own Qwen3 forward, ``fp8rl.backends.mini.qwen3``, with fused SDPA in
  the engine and eager attention in the trainer);
- the **prompts**: the arithmetic task's training prompts with ``<bos>``; TRL gets a
  ``PreTrainedTokenizerFast`` with exactly our character vocabulary (checked: it encodes every
  prompt to our ids);
- the **generation batch**: ``prompts_per_step`` prompts x ``n_samples_per_prompt``
  completions, sampled at ``temperature`` (no top-k / top-p), at most ``max_response_len``
  tokens; lengths are printed for both (same policy, so the same distribution; not the same
  samples);
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
- the **reward**: our exact-match grader in both.

Timing: ours = wall time of ``MiniTrainer.train_step`` (rollout = generation + grading;
train = old log-probs, updates, engine sync, diagnostics); TRL = wall time from the first
optimizer step of a generation batch to the first of the next (rollout = its ``_generate``;
train = everything else: scoring, old log-probs, the four optimizer steps, its bookkeeping).
Per round the first ``--warmup`` batches of each are dropped; the printed numbers are the
medians over all measured batches. ``speedup`` = TRL time / our time per generation batch
(> 1: we are faster). ``--arm`` picks our arm from ``sweeps/fp8/`` (default ``fp32``: TRL runs the
fp32 model in fp32, so ``fp32`` is the like-for-like comparison; ``bf16`` adds our CPU emulation
of BF16 GEMMs, ``tensorwise`` etc. FP8, which TRL does not have). Both systems train every
parameter at ``lr`` (``lr_lm_head`` / ``lr_final_norm`` are set to null unless overridden).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
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
            t0 = time.perf_counter()
            row = self.trainer.train_step(self.step)
            total = time.perf_counter() - t0
            out.append({"total_s": total, "rollout_s": row["perf/rollout_s"], "train_s": total - row["perf/rollout_s"],
                        "completion_len": row["rollout/response_len"]})
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

    def batches(self, n: int) -> list[dict]:
        """Train a fresh GRPOTrainer for ``n`` generation batches and time each."""
        from transformers import TrainerCallback

        cfg, a = self.cfg, self.cfg.algorithm
        m = cfg.num_mini_batches
        batch = cfg.prompts_per_step * a.n_samples_per_prompt
        args = self.GRPOConfig(
            output_dir=self.workdir, use_cpu=True, bf16=False, fp16=False, seed=cfg.seed,
            per_device_train_batch_size=batch // m, gradient_accumulation_steps=1, steps_per_generation=m,
            num_generations=a.n_samples_per_prompt, num_iterations=1, max_steps=n * m,
            max_completion_length=cfg.max_response_len, temperature=cfg.temperature, top_p=1.0, top_k=0,
            learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0,
            adam_beta1=cfg.adam_betas[0], adam_beta2=cfg.adam_betas[1], weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm, beta=0.0, epsilon=a.eps_low, epsilon_high=a.eps_high,
            loss_type="dapo", scale_rewards="group", report_to="none", logging_steps=n * m,
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
            gradient_checkpointing=False,  # TRL's default is True; our trainer does not recompute
        )
        stamps: list[float] = []
        gen_s: list[float] = []
        threads: list[int] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *_a, **_k):
                stamps.append(time.perf_counter())
                threads.append(torch.get_num_threads())

            def on_train_end(self, *_a, **_k):
                stamps.append(time.perf_counter())

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
        with deterministic(False):
            trainer.train()
        if set(threads) != {torch.get_num_threads()}:
            raise RuntimeError(f"TRL ran with {sorted(set(threads))} threads, ours with {torch.get_num_threads()}")
        starts = stamps[::m][: n + 1]
        if len(starts) < n + 1:
            starts.append(stamps[-1])
        out = []
        for i in range(n):
            total = starts[i + 1] - starts[i]
            out.append({"total_s": total, "rollout_s": gen_s[i], "train_s": total - gen_s[i],
                        "completion_len": lengths[i]})
        return out


@contextlib.contextmanager
def deterministic(on: bool):
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=8, help="measured generation batches per round and system")
    p.add_argument("--warmup", type=int, default=2, help="batches dropped at the start of each round")
    p.add_argument("--rounds", type=int, default=3, help="alternations ours / TRL")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arm", default="fp32",
                   help="our arm, a sweeps/fp8/ name (default fp32: TRL's model computes in fp32 here)")
    p.add_argument("--cache", default="runs/.cache/sft", help="SFT warm-start cache")
    p.add_argument("overrides", nargs="*", help="MiniRunConfig key=value overrides")
    args = p.parse_args(argv)

    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.sft import warm_start
    from fp8rl.backends.mini.task import make_splits
    from fp8rl.backends.mini.tokenizer import CharTokenizer

    arm_file = Path(__file__).resolve().parents[1] / "sweeps" / "fp8" / f"{args.arm}.yaml"
    if not arm_file.is_file():
        raise SystemExit(f"--arm {args.arm!r}: no sweeps/fp8/{args.arm}.yaml; use an FP8 arm name such as "
                         "fp32, bf16, tensorwise, blockwise")
    import yaml

    arm = [f"fp8.{k}={v}" for k, v in yaml.safe_load(arm_file.read_text()).items()]
    # one learning rate for every parameter, as TRL trains (the mini regime's per-group rates
    # cost nothing extra, but like for like); a key=value override replaces these
    same_lr = ["lr_lm_head=null", "lr_final_norm=null"]
    cfg, _, _ = parse_config([*arm, *same_lr, f"mini.num_threads={args.threads}", f"mini.cache_dir={args.cache}",
                              *args.overrides])
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(cfg.mini.deterministic)
    mini, tok = cfg.mini, CharTokenizer()
    train_set, _ = make_splits(mini.data_seed, mini.n_train, mini.n_eval, min_terms=mini.min_terms,
                               max_terms=mini.max_terms, max_operand=mini.max_operand)
    base, _ = warm_start(cfg.model.slot, train_set, tok, mini, args.cache)
    ours_rows, trl_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        trl = Trl(cfg, base, train_set, tok, tmp)
        for r in range(args.rounds):
            ours = Ours(cfg, base, args.cache)
            ours_rows += ours.batches(args.warmup + args.batches)[args.warmup:]
            trl_rows += trl.batches(args.warmup + args.batches)[args.warmup:]
            print(f"round {r + 1}/{args.rounds}: ours {median(ours_rows, 'total_s'):.4f} s, "
                  f"TRL {median(trl_rows, 'total_s'):.4f} s per generation batch", file=sys.stderr)

    def part(rows):
        return {k: round(median(rows, k), 4) for k in ("total_s", "rollout_s", "train_s", "completion_len")}

    ours_p, trl_p = part(ours_rows), part(trl_rows)
    out = {
        "settings": {"slot": cfg.model.slot, "arm": args.arm, "prompts x samples":
                     f"{cfg.prompts_per_step} x {cfg.algorithm.n_samples_per_prompt}",
                     "updates_per_batch": cfg.num_mini_batches, "max_response_len": cfg.max_response_len,
                     "threads": args.threads, "batches_measured": len(ours_rows)},
        "ours": ours_p, "trl": trl_p,
        "speedup": round(trl_p["total_s"] / ours_p["total_s"], 3),
        "speedup_rollout": round(trl_p["rollout_s"] / ours_p["rollout_s"], 3),
        "speedup_train": round(trl_p["train_s"] / ours_p["train_s"], 3),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
