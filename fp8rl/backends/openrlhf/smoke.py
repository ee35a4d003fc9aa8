"""The CPU smoke job's model and data: ``python -m fp8rl.backends.openrlhf.smoke --out DIR``.

``make paper-smoke`` runs the paper's job whole (``scale=paper``, ``openrlhf.device=cpu``) on a
model and data that this module writes, so that nothing is downloaded:

- a **tiny Qwen3-architecture model** (2 layers x 128, ~0.5M parameters, BF16 safetensors) with
  a character-level tokenizer over printable ASCII, **briefly fine-tuned** (a few hundred AdamW
  steps, seconds on a CPU) to answer ``a+b`` problems in the paper's prompt template with
  ``\\boxed{...}``. A random model never writes a box, so every reward would be 0: GRPO's
  advantages would all vanish and DAPO's dynamic filtering would drop every group. The warm
  start gives mixed rewards (the format is learned, the sums only partly), so both algorithms
  train on real signal. It is not a model of anything; it exercises the pipeline.
- **problems** ``What is a+b?`` (``a, b`` in 0..4: a task the warm start half learns) as datasets ``smoke_train`` / ``smoke_eval``
  whose ids ``fp8rl-smoke:<seed>:<count>`` (``sweeps/sweep/paper_smoke.yaml``) make
  ``data.prepare`` generate the rows instead of downloading them; they go through the same
  conversion (the paper's prompt template) as the paper's sets.

The sweep names the model :data:`MODEL_ID`; the run writes it on first use under
``<data_dir>/smoke_model`` (``prepare_model``) and passes its directory to OpenRLHF. Everything
is deterministic (seeded) and cached: a directory that holds a model written with the same
settings (``smoke.json``) is reused. ``python -m fp8rl.backends.openrlhf.smoke --out DIR``
writes one by hand.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

#: Settings of the model and its warm start (recorded in ``smoke.json``; a change rewrites).
SETTINGS = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "max_positions": 512, "sft_steps": 200,
            "batch": 16, "lr": 3e-3, "seed": 0, "max_operand": 4, "version": 2}
SPECIALS = ["<pad>", "<eos>"]


def vocab() -> list[str]:
    """Special tokens, then every printable ASCII character but the form feed / vertical tab."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r\t"]
    return SPECIALS + chars


def problems(n: int, seed: int, max_operand: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"What is {a}+{b}?", str(a + b)) for a, b in
            ((rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n))]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    v = vocab()
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(v)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def _decode_fix(path: Path) -> None:
    """Character tokens decode without separators (WordLevel joins tokens with spaces)."""
    cfg_path = path / "tokenizer.json"
    data = json.loads(cfg_path.read_text())
    data["decoder"] = {"type": "Fuse"}
    cfg_path.write_text(json.dumps(data))


def write_model(out: Path, s: dict = SETTINGS, log=print) -> Path:
    """Train and save the tiny model under ``out/model`` (skipped when it is there with ``s``)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_dir = out / "model"
    marker = model_dir / "smoke.json"
    if marker.exists() and json.loads(marker.read_text()) == s:
        return model_dir
    tok = tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.5M-parameter model: one thread is fastest on a shared machine
    torch.manual_seed(s["seed"])
    cfg = Qwen3Config(vocab_size=len(vocab()), hidden_size=s["hidden"], intermediate_size=2 * s["hidden"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["hidden"] // s["heads"],
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, max_position_embeddings=s["max_positions"])
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"])
    rng = random.Random(s["seed"] + 1)
    from fp8rl.backends.openrlhf.prompts import TEMPLATE

    def example() -> tuple[list[int], int]:
        a, b = rng.randint(0, s["max_operand"]), rng.randint(0, s["max_operand"])
        prompt = tok(TEMPLATE.format(problem=f"What is {a}+{b}?"))["input_ids"]
        answer = tok(f" \\boxed{{{a + b}}}")["input_ids"] + [tok.eos_token_id]
        return prompt + answer, len(prompt)

    model.train()
    for step in range(s["sft_steps"]):
        batch = [example() for _ in range(s["batch"])]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (seq, p) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, p: len(seq)] = torch.tensor(seq[p:])
            attn[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == s["sft_steps"] - 1:
            log(f"[smoke model] SFT step {step}: loss {loss.item():.3f}")
    torch.set_num_threads(threads)
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    _decode_fix(model_dir)
    marker.write_text(json.dumps(s))
    return model_dir


#: Model id of the smoke model in ``openrlhf.models`` (written beside the data on first use).
MODEL_ID = "fp8rl-smoke:tiny-qwen3"
#: Dataset-id prefix in ``openrlhf.datasets``: ``fp8rl-smoke:<seed>:<count>[:<rows>]`` problems
#: (``data.prepare``; :func:`dataset_rows`).
DATASET_PREFIX = "fp8rl-smoke:"


def model_path(model_id: str, data_dir: Path) -> str | None:
    """Where the smoke model lives for ``model_id`` (None: a real model id, used as given)."""
    return str(Path(data_dir).absolute() / "smoke_model" / "model") if model_id == MODEL_ID else None


def prepare_model(model_id: str, data_dir: Path) -> None:
    """Write the smoke model (cached) when the cell's model is :data:`MODEL_ID`."""
    if model_id == MODEL_ID:
        from fp8rl.runs.lock import exclusive

        out = Path(data_dir).absolute() / "smoke_model"
        with exclusive(out.parent / "smoke_model.lock"):  # cells that start together train it once
            write_model(out)


#: The label of an unanswerable smoke row: no response the model writes grades correct, so its
#: group always scores 0 and DAPO's dynamic filtering always drops it.
UNANSWERABLE = "none"


def dataset_rows(hf_id: str) -> list[dict]:
    """Rows (``problem``, ``answer``) of a smoke dataset id.

    ``fp8rl-smoke:<seed>:<count>``: ``count`` seeded ``a+b`` problems (repeats possible).
    ``fp8rl-smoke:<seed>:<count>:<i>,<j>,...``: ``count`` distinct problems, the listed rows
    unanswerable (label :data:`UNANSWERABLE`). The DAPO cells of the smoke job use this to make an
    episode end certain inside a step: rows placed last in the prompt loader's seeded order
    (``plugin.binding.rollout.seed_prompt_sampler``) are drawn last and always filtered, so their
    replacements are asked for when no prompt is left (sweeps/sweep/paper_smoke.yaml).
    """
    parts = hf_id[len(DATASET_PREFIX):].split(":") if hf_id.startswith(DATASET_PREFIX) else []
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        seed, count = int(parts[0]), int(parts[1])
        dead = sorted({int(i) for i in parts[2].split(",")}) if len(parts) == 3 else []
    except ValueError as e:
        raise ValueError(f"smoke dataset id {hf_id!r} must be {DATASET_PREFIX}<seed>:<count> or "
                         f"{DATASET_PREFIX}<seed>:<count>:<row>,<row>,... (unanswerable rows)") from e
    if len(parts) == 2:
        return [{"problem": p, "answer": a} for p, a in problems(count, seed, SETTINGS["max_operand"])]
    m = SETTINGS["max_operand"]
    if not 0 < count <= (m + 1) ** 2 or any(not 0 <= i < count for i in dead):
        raise ValueError(f"smoke dataset id {hf_id!r}: {count} distinct problems need 0 < count <= {(m + 1) ** 2} "
                         f"and unanswerable rows in 0..{count - 1}")
    pairs = random.Random(seed).sample([(a, b) for a in range(m + 1) for b in range(m + 1)], count)
    return [{"problem": f"What is {a}+{b}?", "answer": UNANSWERABLE if i in dead else str(a + b)}
            for i, (a, b) in enumerate(pairs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8rl.backends.openrlhf.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for model/ and data/")
    args = p.parse_args(argv)
    print(f"model: {write_model(Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
