"""A warm start that stops resumes (issue 32, defect 5; ``fp8rl.backends.mini.sft_partial``).

A real direct run stopped with SIGINT mid-warm-start saves its partial state; the next warm
start with the same key trains only the steps left (counted) and writes the same cache entry,
byte for byte, as an uninterrupted one. A partial state of another key, a damaged one, or one
beside a finished entry is never used. The direct run shows the warm start's progress.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fp8rl.backends.mini import sft
from fp8rl.backends.mini.config import MiniSettings
from fp8rl.backends.mini.runtime import torch_settings
from fp8rl.backends.mini.task import make_splits
from fp8rl.backends.mini.tokenizer import CharTokenizer
from fp8rl.runs import stop

sys.path.insert(0, str(Path(__file__).parent))
from direct_run import interrupt_direct_run

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
TOK = CharTokenizer()
#: the smallest warm start worth stopping: 8b slot, 4 problems a step (~100 steps/s on one thread)
SMALL = dict(n_train=64, n_eval=2, sft_batch_size=4, min_terms=2, max_terms=3, max_operand=9, num_threads=1)
STEPS = 40
#: a direct run with one RL step after its warm start
RUN = ["steps=1", "prompts_per_step=2", "num_mini_batches=2", "max_response_len=16", "eval_every=0", "eval_k=1",
       "checkpoint_every=0", "samples_every=0", "algorithm.n_samples_per_prompt=2",
       *(f"mini.{k}={v}" for k, v in SMALL.items())]


def partial_dir(entry: Path) -> Path:
    """Where a warm start keeps its partial state (``<cache_dir>/<key>.partial``)."""
    return entry.with_name(entry.name + ".partial")


def progress_of(entry: Path) -> dict:
    """The progress file of the warm start building ``entry`` ({} while there is none)."""
    try:
        return json.loads((partial_dir(entry) / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def _mini(steps: int = STEPS, **kw) -> MiniSettings:
    return MiniSettings(sft_steps=steps, **{**SMALL, **kw})


class Counter:
    """Counts the SFT steps trained (``sft.sft_batch`` is called once a step); ``stop_at=n``
    requests a stop during step n, ``die_at=n`` raises KeyboardInterrupt in it (a kill)."""

    def __init__(self, monkeypatch) -> None:
        self.n, self.stop_at, self.die_at, self.hook = 0, None, None, None
        original = sft.sft_batch

        def counting(*a):
            self.n += 1
            if self.n == self.stop_at:
                stop.request_stop()
            if self.n == self.die_at:
                raise KeyboardInterrupt("killed")
            if self.hook is not None:
                self.hook(self.n)
            return original(*a)

        monkeypatch.setattr(sft, "sft_batch", counting)

    def reset(self) -> None:
        self.n, self.stop_at, self.die_at = 0, None, None
        stop.clear()


@pytest.fixture
def counter(monkeypatch):
    c = Counter(monkeypatch)
    yield c
    stop.clear()


def warm(m: MiniSettings, root: Path, **kw):
    train, _ = make_splits(m.data_seed, m.n_train, m.n_eval, min_terms=m.min_terms, max_terms=m.max_terms,
                           max_operand=m.max_operand)
    with torch_settings(m.deterministic, m.num_threads, m.device):
        return sft.warm_start("8b", train, TOK, m, root, **kw)


def entry_bytes(root: Path, key: str) -> dict[str, str]:
    return {f: hashlib.sha256((root / key / f).read_bytes()).hexdigest() for f in ("model.pt", "meta.json")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted warm start of :data:`STEPS` steps: ``(cache root, key)``."""
    root = tmp_path_factory.mktemp("reference")
    _, meta = warm(_mini(), root)
    return root, meta["key"]


def test_the_cache_key_is_stable_and_names_the_machines_numerics(monkeypatch):
    """The key is what it was for the same settings on the same numerics (a fixed stand-in for the
    fingerprint here, which differs by machine), so caches keep being found; another machine's
    numerics (another kernel level, MKL path or torch: ``numerics.py``) is another key, so a cache
    shared between machines never hands one's warm start to the other."""
    monkeypatch.setattr(sft, "numerics_key", lambda device: "torch 2.13.0+cpu / AVX2 / transformers 5.24.0 / probe v1:x")
    assert sft.sft_key("8b", _mini(), TOK) == "1ee4fbcb38dcf6b2"
    monkeypatch.setattr(sft, "numerics_key", lambda device: "torch 2.13.0+cpu / AVX512 / transformers 5.24.0 / probe v1:y")
    assert sft.sft_key("8b", _mini(), TOK) != "1ee4fbcb38dcf6b2"


def test_sigint_in_a_direct_run_mid_warm_start_resumes_to_the_same_bytes(tmp_path, counter):
    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.run import prepare_warm_start, warm_start_key

    # long enough that the interrupt lands inside the warm start on any machine: 80 steps took
    # 0.7 s under ATen's AVX2 kernels on one, shorter than the test's poll and signal round trip
    steps = 400
    args = [*RUN, f"mini.sft_steps={steps}", f"mini.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"]
    cfg = parse_config(args)[0]
    entry = Path(warm_start_key(cfg))
    code, out = interrupt_direct_run(args, lambda: progress_of(entry).get("step", 0) >= 10, poll=0.02)
    assert code == 130 and "Traceback" not in out, out
    (stopped,) = re.findall(rf"stopped on request at step (\d+)/{steps} of the SFT warm start; it resumes", out)
    k = int(stopped)
    assert 10 <= k < steps, out
    assert not (entry / "model.pt").exists()
    state = torch.load(partial_dir(entry) / "state.pt", weights_only=True)
    assert state["step"] == k and len(state["losses"]) == k
    assert progress_of(entry)["state"] == "stopped"

    prepare_warm_start(cfg)  # the rerun (the launcher's prepare task, in this process): counted
    assert counter.n == steps - k  # resumed, not restarted
    assert not partial_dir(entry).exists()

    counter.reset()
    ref = dataclasses.replace(cfg, mini=dataclasses.replace(cfg.mini, cache_dir=str(tmp_path / "ref")))
    prepare_warm_start(ref)
    assert counter.n == steps
    assert Path(warm_start_key(ref)).name == entry.name
    assert entry_bytes(entry.parent, entry.name) == entry_bytes(tmp_path / "ref", entry.name)


def test_a_killed_warm_start_resumes_from_its_last_save(tmp_path, counter, reference):
    """No stop request (a kill inside step 27): the state saved every tenth of the steps (step
    24 of 40) is where the next warm start goes on; the entry is the uninterrupted one's."""
    counter.die_at = 27
    with pytest.raises(KeyboardInterrupt):
        warm(_mini(), tmp_path)
    key = reference[1]
    assert torch.load(partial_dir(tmp_path / key) / "state.pt", weights_only=True)["step"] == 24
    counter.reset()
    _, meta = warm(_mini(), tmp_path)
    assert counter.n == STEPS - 24 and not meta["cache_hit"]
    assert entry_bytes(tmp_path, key) == entry_bytes(*reference)


def _stopped_at(root: Path, m: MiniSettings, step: int, counter) -> Path:
    """Stop a warm start of ``m`` after ``step`` steps; its partial directory."""
    counter.stop_at = step
    with pytest.raises(KeyboardInterrupt, match=f"at step {step}/"):
        warm(m, root)
    counter.reset()
    return partial_dir(root / sft.sft_key("8b", m, TOK))


def flip_a_weight_byte(path: Path) -> None:
    """Flip one byte inside the first tensor stored in the zip ``path`` (bit rot)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["another key", "damaged", "bit rot"])
def test_a_partial_state_that_does_not_belong_is_never_used(tmp_path, counter, reference, capfd, how):
    target = partial_dir(tmp_path / reference[1])
    if how == "another key":  # another learning rate, the same steps; its directory copied over
        shutil.copytree(_stopped_at(tmp_path, _mini(sft_lr=1e-3), 10, counter), target)
    else:  # its own, then damaged
        _stopped_at(tmp_path, _mini(), 10, counter)
        if how == "damaged":
            with open(target / "state.pt", "r+b") as f:
                f.truncate(1000)
        else:
            flip_a_weight_byte(target / "state.pt")
    capfd.readouterr()
    warm(_mini(), tmp_path, progress=True)
    assert counter.n == STEPS  # from step 0
    err = capfd.readouterr().err
    why = {"another key": "it was saved for the warm start", "damaged": "it does not load (it is not in the format",
           "bit rot": "it does not load (its tensors do not match the digest"}[how]
    assert f"state.pt not used: {why}" in err and "training from step 0" in err, err
    assert entry_bytes(tmp_path, reference[1]) == entry_bytes(*reference)


def test_a_finished_entry_is_used_and_a_stale_partial_state_removed(tmp_path, counter, reference):
    root, key = reference
    shutil.copytree(root / key, tmp_path / key)
    _stopped_at(tmp_path / "elsewhere", _mini(), 10, counter)
    shutil.copytree(partial_dir(tmp_path / "elsewhere" / key), partial_dir(tmp_path / key))
    _, meta = warm(_mini(), tmp_path)
    assert meta["cache_hit"] and counter.n == 0
    assert not partial_dir(tmp_path / key).exists()


def test_a_direct_run_shows_the_warm_start_and_where_it_resumes(tmp_path, counter, capfd):
    """``python -m fp8rl.backends.mini`` (its ``main``, in this process): a bar with the warm
    start's steps and ETA on standard error, and the step a stopped warm start resumes from."""
    from fp8rl.backends.mini.__main__ import main

    cache = tmp_path / "cache"
    _stopped_at(cache, _mini(), 10, counter)
    capfd.readouterr()
    assert main([*RUN, f"mini.sft_steps={STEPS}", f"mini.cache_dir={cache}", f"run_dir={tmp_path / 'run'}"]) == 0
    err = capfd.readouterr().err
    assert f"warm start 8b: resuming from step 10/{STEPS}" in err, err
    bars = [x for x in re.split(r"[\r\n]", err) if x.startswith("warm start 8b:") and "|" in x]
    assert bars and f"{STEPS}/{STEPS} [" in bars[-1], err  # steps done / steps, then elapsed<ETA
    assert any(re.search(rf" \d+/{STEPS} \[\d+:\d+<\d+:\d+", x) for x in bars), bars
    assert counter.n == STEPS - 10
