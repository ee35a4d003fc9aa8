"""Supervised warm start: turn a random tiny Qwen3 into a "base model" with some accuracy.

The paper starts RL from pretrained base models that already solve part of the problems. At
mini scale we get the same starting point by a short supervised phase on reference worked
solutions (``task.Problem.solution``): next-token cross-entropy on the response tokens only
(prompt tokens are context), AdamW with linear warm-up and cosine decay, fixed seeds, and
``torch.use_deterministic_algorithms(True)``. Few enough steps leave the model between 0% and
100% accuracy, which is what RL needs (groups with mixed rewards).

Cache: the result is saved under ``<cache_dir>/<key>/`` (``model.pt`` + ``meta.json``), where
``key`` is a hash of everything that determines it (``SFT_VERSION``, model dims, tokenizer
alphabet, task settings and split seed, SFT hyper-parameters, device type); a sweep therefore
trains it once per model slot. Files are written to a temporary name and renamed, so a killed
process never leaves a half-written cache entry; two processes racing write identical bytes.
``meta.json`` carries the digest of the weights (``checkpoint.tensor_digests``); loading checks it
and the file's CRC-32s, loads tensors only (``weights_only=True``), and refuses a damaged entry
(bit rot, a truncated ``model.pt`` or ``meta.json``, a pickle that is not ours) with
:class:`CacheRefused`, naming the file and saying to delete the entry: the warm start is then
trained again, the same weights (it is deterministic). An entry written before digests loads
after the CRC check, with one line saying so.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from dataclasses import asdict
from pathlib import Path

import torch

from fp8rl.backends.mini.batch import left_pad, right_pad
from fp8rl.backends.mini.checkpoint import (
    check_crc,
    load_tensors,
    refuse_mismatch,
    saved_bytes,
    say_no_digest,
    tensor_digests,
)
from fp8rl.backends.mini.config import MAX_POSITIONS, MiniSettings
from fp8rl.backends.mini.model import MINI_MODELS, build_model
from fp8rl.backends.mini.numerics import numerics_key
from fp8rl.backends.mini.sft_partial import SftPartial
from fp8rl.backends.mini.task import Problem, slipped_solution
from fp8rl.backends.mini.tokenizer import CharTokenizer

SFT_VERSION = 1  # bump when the SFT procedure changes, to invalidate caches


class CacheRefused(RuntimeError):
    """A damaged warm-start cache entry: not loaded (the message names the file and the fix)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(
            f"{path}: the SFT warm-start cache entry is damaged and was not loaded: {why}. Delete "
            f"{path.parent} and relaunch: the warm start is trained again (the same weights)")
        self.path = Path(path)


def sft_key(slot: str, mini: MiniSettings, tok: CharTokenizer) -> str:
    """16-hex hash of everything that determines the warm-started weights."""
    spec = {
        "version": SFT_VERSION,
        "dims": asdict(MINI_MODELS[slot]),
        "alphabet": tok.alphabet,
        "task": [mini.min_terms, mini.max_terms, mini.max_operand, mini.data_seed, mini.n_train,
                 mini.n_eval],
        "sft": [mini.sft_steps, mini.sft_batch_size, mini.sft_lr, mini.sft_seed],
        # only when set, so the warm starts cached before the slip existed keep their keys
        **({"slip": mini.sft_slip_rate} if mini.sft_slip_rate else {}),
        "device": torch.device(mini.device).type,
        # CPU kernels split reductions by thread count: 1 and 2 threads give weights ~1e-7 apart
        # (measured; docs/launch.md), so a warm start is cached per effective thread count
        "threads": mini.num_threads or torch.get_num_threads(),
        # the machine's kernels compute the bits (numerics.py): a cache shared by machines with
        # other CPUs, ATen levels or torch builds must not hand one's weights to the other
        "numerics": numerics_key(mini.device),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def sft_batch(problems: list[Problem], tok: CharTokenizer,
              solutions: list[str] | None = None) -> tuple[torch.Tensor, ...]:
    """``(prompt_ids, prompt_mask, response_ids, response_mask)`` in the shared layout; the
    responses are ``solutions`` where given, else the reference solutions."""
    p_ids, p_mask = left_pad([tok.encode(p.prompt, bos=True) for p in problems], tok.pad_id)
    sols = [p.solution for p in problems] if solutions is None else solutions
    r_ids, r_mask = right_pad([tok.encode(s, eos=True) for s in sols], tok.pad_id)
    return p_ids, p_mask, r_ids, r_mask


def train_sft(model: torch.nn.Module, train: list[Problem], tok: CharTokenizer,
              mini: MiniSettings, *, partial: SftPartial | None = None) -> list[float]:
    """Run the supervised phase in place; returns the loss per step. With ``partial``
    (``sft_partial``), it resumes from the saved state, saves it every so often and on a stop
    request, and reports its progress."""
    from fp8rl.backends.mini.batch import response_logits

    dev = torch.device(mini.device)
    rng = random.Random(mini.sft_seed)
    # foreach: the per-parameter loop's arithmetic, bit for bit (the golden numbers train their
    # warm starts), in fewer calls
    opt = torch.optim.AdamW(model.parameters(), lr=mini.sft_lr, weight_decay=0.0, foreach=True)
    warm = max(1, mini.sft_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, mini.sft_steps) / max(1, mini.sft_steps))))
    losses: list[float] = []
    start = partial.resume(model, opt, sched, rng, losses) if partial else 0
    model.train()
    from fp8rl.runs.stop import RunStopped, stop_requested

    if partial:
        partial.begin(start)
    try:
        for step in range(start, mini.sft_steps):
            if stop_requested():  # saved: the next warm start with this key resumes from here
                raise RunStopped(partial.stop(step, model, opt, sched, rng, losses) if partial else
                                 "stopped on request during the SFT warm start (it is trained again on relaunch)")
            batch = [train[rng.randrange(len(train))] for _ in range(mini.sft_batch_size)]
            sols = None
            if mini.sft_slip_rate:  # its own stream, per step, so it resumes with the step
                slip = random.Random(f"slip/{mini.sft_seed}/{step}")
                sols = [slipped_solution(p, slip, mini.sft_slip_rate) for p in batch]
            p_ids, p_mask, r_ids, r_mask = (t.to(dev) for t in sft_batch(batch, tok, sols))
            logits = response_logits(model, p_ids, p_mask, r_ids, r_mask)
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), r_ids.flatten(), reduction="none")
            loss = (nll * r_mask.flatten()).sum() / r_mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            if partial:
                partial.after_step(step + 1, model, opt, sched, rng, losses)
    finally:
        if partial:
            partial.end(len(losses))
    model.eval()
    return losses


def warm_start(slot: str, train: list[Problem], tok: CharTokenizer, mini: MiniSettings,
               cache_root: str | os.PathLike, *, progress: bool = False) -> tuple[torch.nn.Module, dict]:
    """The warm-started model for ``slot``, from the cache or trained now (then cached); a
    warm start that was stopped resumes from its partial state (``sft_partial``). ``progress``:
    a progress bar on standard error while it trains.

    Returns ``(model, meta)``; ``meta`` holds the key, the cache path, whether it was a hit and
    the final SFT loss.
    """
    from fp8rl.runs.lock import exclusive

    key = sft_key(slot, mini, tok)
    path = Path(cache_root) / key
    # one process trains a given warm start; others wait for it and load the result
    with exclusive(Path(cache_root) / f"{key}.lock"):
        partial = SftPartial(path, key, slot, mini.sft_steps, show=progress)
        out = _load_or_train(slot, train, tok, mini, key, path, partial)
        partial.discard()  # the entry is written (or was there): no partial state is needed
        return out


def _load_or_train(slot: str, train: list[Problem], tok: CharTokenizer, mini: MiniSettings, key: str,
                   path: Path, partial: SftPartial) -> tuple[torch.nn.Module, dict]:
    model = build_model(slot, tok.vocab_size, max_positions=MAX_POSITIONS, seed=mini.sft_seed)
    model.to(torch.device(mini.device))
    if (path / "model.pt").exists() and (path / "meta.json").exists():
        meta, state = load_cached(path, mini.device)
        try:
            model.load_state_dict(state)
        except (RuntimeError, KeyError) as e:
            raise CacheRefused(path / "model.pt", f"its weights do not fit the model ({_first_line(e)})") from e
        return model.eval(), {**_shown(meta), "cache_hit": True, "path": str(path)}
    losses = train_sft(model, train, tok, mini, partial=partial)
    meta = {"key": key, "slot": slot, "steps": mini.sft_steps,
            "final_loss": float(sum(losses[-10:]) / max(1, len(losses[-10:]))) if losses else None,
            "digest": tensor_digests(model.state_dict())}
    path.mkdir(parents=True, exist_ok=True)
    weights = saved_bytes(model.state_dict())
    _atomic_save(lambda f: f.write(weights), path / "model.pt")
    _atomic_save(lambda f: f.write(json.dumps(meta, indent=1).encode()), path / "meta.json")
    return model.eval(), {**_shown(meta), "cache_hit": False, "path": str(path)}


def _shown(meta: dict) -> dict:
    """What a run reports of its warm start (``summary.json``'s ``sft``): the meta but the digest."""
    return {k: v for k, v in meta.items() if k != "digest"}


def load_cached(path: Path, device: str) -> tuple[dict, dict]:
    """``(meta, state dict)`` of the cache entry ``path``, checked (module docstring); raises
    :class:`CacheRefused` naming the damaged file."""
    meta_path, model_path = path / "meta.json", path / "model.pt"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise CacheRefused(meta_path, f"it is not JSON ({_first_line(e)})") from e
    if not isinstance(meta, dict):
        raise CacheRefused(meta_path, f"it holds a {type(meta).__name__}, not a mapping")

    def refuse(why: str) -> CacheRefused:
        return CacheRefused(model_path, why)

    state = load_tensors(model_path, device, refuse)
    if not isinstance(state, dict):
        raise refuse(f"it holds a {type(state).__name__}, not a state dict")
    if "digest" in meta:
        refuse_mismatch(state, meta["digest"], refuse)
    else:
        say_no_digest(model_path, "a warm-start cache entry")
    check_crc(model_path, refuse)
    return meta, state


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


def _atomic_save(write, dest: Path) -> None:
    """``write(f)`` to ``dest.tmp*``, fsync, rename (``fp8rl.runs.safe_io.atomic_write_with``)."""
    from fp8rl.runs.safe_io import atomic_write_with

    atomic_write_with(dest, write, prefix=dest.name + ".tmp", suffix="")
