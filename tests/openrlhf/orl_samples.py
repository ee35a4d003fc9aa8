"""Upstream OpenRLHF 0.11.2 ``samples_generator.py`` around stand-in vLLM engines (imported as
``orl_samples``; used by the rollout-seed and ingestion tests).

``samples_generator.py`` is executed from the installed wheel with its heavy imports stubbed
(``ray``, ``vllm``, the engine module, ``Experience`` as a record); upstream's own
``_collect_prompt_batch``, ``_process_response_into_experience``, ``_generate_vllm`` and
``generate_samples`` run as written. The engines are stand-ins (real vLLM engines need Ray and a
model) that answer deterministically from a request's seed, score samples by the prompt's label
and complete in an order the test chooses (what real engines under Ray do on their own time).
The same claims on real engines: the smoke job's draws, dispatch order and filtering under real
Ray and vLLM (``tests/integration/test_int_smoke_algorithm.py``), its seeded resume
(``test_int_paper_smoke.py::test_the_resumed_cell_equals_an_uninterrupted_run``).
"""

from __future__ import annotations

import collections
import importlib.util
import sys
import types

import torch
from orl_helpers import openrlhf_dir

from fp8rl.backends.openrlhf.plugin.binding import rollout

ns = types.SimpleNamespace


class Ref:
    """An object ref: resolved by the stub ``ray.get``."""

    def __init__(self, value):
        self.value = value


class Engine:
    """Answers ``generate_responses`` from the request's seed (``None``: a fresh random draw, as
    vLLM's shared generator gives); records every request.

    A sample's score comes from its prompt's label: ``all 0`` / ``all 1`` score every sample so (a
    group dynamic filtering drops), ``mixed`` alternates 0, 1, 0, 1 over the prompt's samples in
    request order (a group it keeps), any other label the parity of the first token."""

    def __init__(self, log):
        self.log = log
        self.samples_of = collections.Counter()
        self.get_num_unfinished_requests = ns(remote=lambda: Ref(0))
        self.generate_responses = ns(remote=self._generate)

    def _score(self, prompt, label, toks):
        j = self.samples_of[prompt]
        self.samples_of[prompt] += 1
        fixed = {"all 0": 0.0, "all 1": 1.0, "mixed": float(j % 2)}
        return fixed.get(label, float(toks[0] % 2))

    def _generate(self, *, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1, images=None):
        out = []
        for _ in range(num_samples):
            seed = sampling_params.seed
            toks = tokens(seed if seed is not None else int(torch.randint(0, 2**31, ())))
            score = self._score(prompt, label, toks)
            self.log.append({"prompt": prompt, "seed": seed, "num_samples": num_samples})
            out.append({"prompt": prompt, "label": label, "observation_tokens": [1, 2, *toks],
                        "action_ranges": [(2, 8)], "reward": score, "scores": score, "rollout_log_probs": None,
                        "truncated": False, "extra_logs": {}})
        return Ref(out)


def tokens(seed: int) -> list[int]:
    """The stand-in engine's six response tokens for a request seed."""
    return torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(seed)).tolist()


def load_samples_generator(monkeypatch, completion=reversed):
    """Upstream ``samples_generator`` with stubs; ``ray.wait`` returns the pending ref that
    ``completion`` puts first (default: the last dispatched completes first)."""
    path = openrlhf_dir() / "trainer" / "ppo_utils" / "samples_generator.py"

    def wait(pending, num_returns=1, timeout=None):
        first = next(iter(completion(list(pending))))
        return [first], [r for r in pending if r is not first]

    class Experience:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)
            self.seed = kw.get("seed")

    stubs = {
        "ray": types.SimpleNamespace(get=lambda r: [x.value for x in r] if isinstance(r, list) else r.value,
                                     wait=wait),
        "vllm": types.SimpleNamespace(SamplingParams=SamplingParams),
        "tqdm": types.SimpleNamespace(tqdm=lambda *a, **k: types.SimpleNamespace(update=lambda *a: None,
                                                                                  set_postfix=lambda *a: None)),
        "openrlhf.trainer.ppo_utils.experience": types.SimpleNamespace(Experience=Experience),
        "openrlhf.trainer.ray.vllm_engine": types.SimpleNamespace(batch_vllm_engine_call=lambda *a, **k: None),
        "openrlhf.utils.logging_utils": types.SimpleNamespace(init_logger=lambda name: __import__("logging")
                                                              .getLogger(name)),
    }
    for name, mod in stubs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    spec = importlib.util.spec_from_file_location("orl_samples_generator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(rollout, "_get", stubs["ray"].get)
    monkeypatch.setattr(rollout, "_sampling_params", SamplingParams)
    return module


#: Labels for dynamic filtering (range (0, 1), 3 prompts a call, 4 samples each): p1, p3 and p4
#: score alike in all their samples and are dropped; p3 replaces p1, p4 replaces p3, p5 replaces p4.
FILTER_LABELS = {"p0": "mixed", "p1": "all 0", "p2": "mixed", "p3": "all 1", "p4": "all 0", "p5": "mixed",
                 "p6": "mixed", "p7": "mixed"}


def sg_args(dynamic=False):
    """``SamplesGenerator``'s ``args``: 3 prompts a step, 4 samples each, filtering range (0, 1)."""
    return ns(rollout=ns(batch_size=3, n_samples_per_prompt=4, vllm_generate_batch_size=None),
              algo=ns(dynamic_filtering_enable=dynamic, dynamic_filtering_range=[0.0, 1.0],
                      advantage=ns(is_correction_level="off")),
              vllm=ns(enable_sleep=False))


class _Loader:
    """A re-iterable prompt loader (upstream's ``generate_samples`` calls ``iter`` on it)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return self.batches()


def make_generator(module, log, prompts, dynamic=False, engines=2, labels=None, drawn=None):
    """A ``SamplesGenerator`` and a prompt iterator in upstream's batches of one prompt (also its
    ``prompts_dataloader``, for ``generate_samples``); ``labels`` (prompt -> label) default to
    ``label <prompt>``; ``drawn`` records the prompts as they are drawn."""
    labels = labels or {p: f"label {p}" for p in prompts}

    def loader():
        for p in prompts:
            if drawn is not None:
                drawn.append(p)
            yield None, [p], [labels[p]], [None]

    strategy = ns(args=sg_args(dynamic))
    gen = module.SamplesGenerator(strategy, None, None, tokenizer=None,
                                  vllm_engines=[Engine(log) for _ in range(engines)])
    gen.prompts_dataloader = _Loader(loader)  # after __init__: the binding seeds a real loader's sampler
    return gen, loader()
