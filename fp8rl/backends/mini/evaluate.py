"""Held-out evaluation of the mini backend: avg@k and pass@k on the task's eval split.

Each eval problem is sampled ``k`` times by the **rollout engine** (so an FP8 rollout arm is
evaluated with its FP8 engine, as the paper evaluates with its vLLM engine) at
``eval_temperature``, with a generator the trainer seeds from the run's seed alone (the same
at every evaluation: evaluations of one run are paired), so evaluation never perturbs the
training random stream and a resumed run evaluates identically.

- avg@k: mean accuracy over the ``n * k`` samples;
- pass@k: fraction of problems with at least one correct sample among its ``k``;
- garbled: fraction of garbled samples (logged beside the two, ``eval/<ds>/garbled_frac``);
- greedy: accuracy of one greedy decode per problem (``eval/<ds>/greedy``), when asked.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from fp8rl.backends.mini.batch import left_pad
from fp8rl.backends.mini.rollout import RolloutEngine
from fp8rl.backends.mini.task import Problem
from fp8rl.backends.mini.tokenizer import CharTokenizer
from fp8rl.rewards.exact import grade_exact

DATASET = "arith"


@torch.no_grad()
def evaluate(
    engine: RolloutEngine,
    problems: list[Problem],
    tok: CharTokenizer,
    *,
    k: int,
    temperature: float,
    max_new_tokens: int,
    generator: torch.Generator,
    device: torch.device,
    greedy: bool = False,
) -> dict[str, float]:
    """``{"avg@k", "pass@k", "garbled_frac", "n", "k"}`` over ``problems``, and ``"greedy"``
    (accuracy of one greedy decode per problem) when ``greedy``."""
    if k < 1 or not problems:
        raise ValueError(f"need k >= 1 and at least one problem, got k={k}, {len(problems)} problems")
    rows = [p for p in problems for _ in range(k)]
    ids, mask = left_pad([tok.encode(p.prompt, bos=True) for p in rows], tok.pad_id)
    out = engine.generate(ids.to(device), mask.to(device), max_new_tokens=max_new_tokens,
                          temperature=temperature, eos_id=tok.eos_id, pad_id=tok.pad_id,
                          generator=generator)
    grades = [grade_exact(tok.decode(r), str(p.answer))
              for r, p in zip(out.response_ids.cpu().tolist(), rows, strict=True)]
    correct = torch.tensor([g.correct for g in grades], dtype=torch.float32).view(len(problems), k)
    garbled = torch.tensor([g.garbled for g in grades], dtype=torch.float32)
    out = {
        "avg@k": float(correct.mean()),
        "pass@k": float((correct.max(dim=1).values > 0).float().mean()),
        "garbled_frac": float(garbled.mean()),
        "n": len(problems),
        "k": k,
    }
    if greedy:
        ids, mask = left_pad([tok.encode(p.prompt, bos=True) for p in problems], tok.pad_id)
        g = engine.generate(ids.to(device), mask.to(device), max_new_tokens=max_new_tokens, temperature=1.0,
                            eos_id=tok.eos_id, pad_id=tok.pad_id, generator=None, greedy=True)
        out["greedy"] = sum(grade_exact(tok.decode(r), str(p.answer)).correct
                            for r, p in zip(g.response_ids.cpu().tolist(), problems, strict=True)) / len(problems)
    return out


def cached_evaluation(directory: Path, spec: dict, compute: Callable[[], dict]) -> dict:
    """``compute()``'s evaluation row, stored as ``<directory>/eval0-<hash of spec>.json``.

    For the step-0 evaluation, which every cell sharing a warm start, an engine, the evaluation
    settings and a seed computes identically: the first cell computes it under a lock, the others
    read it. ``spec`` must hold everything the numbers depend on (the caller's version tag too).

    The entry carries a SHA-256 digest of its spec and row (``digest``), as the warm start it sits
    beside carries one of its weights: an entry that does not match it (one flipped digit of
    ``avg@k``), is not JSON, holds another spec or was written before digests is not read: one line
    names the file and says so, and the row is computed again and written over it (the same
    numbers: the evaluation is deterministic given the spec).
    """
    from fp8rl.runs.jsonl import atomic_write_json
    from fp8rl.runs.lock import exclusive

    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(directory) / f"eval0-{key}.json"
    with exclusive(path.with_suffix(".lock")):
        if path.exists():
            row, why = _read_entry(path, spec)
            if row is not None:
                return row
            print(f"{path}: the step-0 evaluation cache entry is damaged and was not read ({why}); computing "
                  "it again (the same numbers: the evaluation is deterministic) and writing it over the entry",
                  file=sys.stderr, flush=True)
        row = compute()
        atomic_write_json(path, {"spec": spec, "row": row, "digest": entry_digest(spec, row)})
    return row


def entry_digest(spec: dict, row: dict) -> str:
    """SHA-256 (hex) of a step-0 cache entry's spec and row as JSON (keys sorted, non-finite
    numbers as ``null``, as the file holds them)."""
    from fp8rl.runs.jsonl import dumps

    return hashlib.sha256(dumps({"spec": spec, "row": row}, sort_keys=True).encode()).hexdigest()


def _read_entry(path: Path, spec: dict) -> tuple[dict | None, str]:
    """``(row, "")`` of the entry at ``path`` when it is whole and holds ``spec``; else
    ``(None, why)``."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError included
        return None, f"not JSON: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if not isinstance(entry, dict) or not isinstance(entry.get("row"), dict):
        return None, "not a cache entry (no row mapping)"
    if "digest" not in entry:
        return None, "written before step-0 entries carried a digest"
    if entry.get("digest") != entry_digest(entry.get("spec"), entry["row"]):
        return None, ("its spec and row do not match the digest written with them: the file changed after "
                      "it was written (bit rot on disk, a bad copy, an edit)")
    if json.loads(json.dumps(spec)) != entry.get("spec"):
        return None, "it holds another evaluation's spec"
    return entry["row"], ""
