"""Seeded rollouts in dispatch order (``plugin.binding.rollout``) around OpenRLHF 0.11.2's real
``SamplesGenerator`` source.

Upstream's ``samples_generator.py`` runs as written around stand-in engines (``orl_samples``:
they answer deterministically from a request's seed and complete in an order the test chooses).
They prove the logic only; the real path -- Ray, vLLM 0.29's CPU engines, a resumed run repeating
an uninterrupted one's metrics -- is ``tests/integration/test_int_paper_smoke.py``'s.
"""

from __future__ import annotations

import itertools
import json
import types

import pytest
import torch
from orl_samples import FILTER_LABELS, Engine, load_samples_generator, sg_args, tokens
from orl_samples import make_generator as _generator

from fp8rl.backends.openrlhf.plugin import PluginSpec
from fp8rl.backends.openrlhf.plugin.binding import rollout
from fp8rl.backends.openrlhf.plugin.binding import trainer as trainer_binding
from fp8rl.backends.openrlhf.plugin.binding.common import UpstreamChangedError

ns = types.SimpleNamespace


def _key(experiences):
    return [(e.prompts[0], tuple(e.sequences[0].tolist())) for e in experiences]


def test_request_seeds_are_distinct_stable_and_checked():
    seeds = {rollout.request_seed(7, p, s, k, j) for p in rollout.PURPOSES for s in range(3)
             for k in range(5) for j in range(4)}
    assert len(seeds) == 2 * 3 * 5 * 4 and all(0 <= x < 2**63 for x in seeds)
    assert rollout.request_seed(7, "train", 1, 2, 3) == rollout.request_seed(7, "train", 1, 2, 3)
    assert rollout.request_seed(7, "train", 1, 2, 3) != rollout.request_seed(8, "train", 1, 2, 3)
    with pytest.raises(ValueError, match="purpose"):
        rollout.request_seed(7, "test", 0, 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        rollout.request_seed(7, "train", 0, -1, 0)


def test_seeded_groups_come_in_dispatch_order_whatever_order_the_engines_finish(monkeypatch):
    """Every sample is its own request with ``request_seed(seed, purpose, step, k, j)``; the
    experiences come back prompt by prompt in dispatch order, samples in order, and are the
    same whichever order the engines complete in. Upstream (unbound) takes completion order."""
    runs = {}
    for name, completion in (("reverse", reversed), ("forward", iter)):
        module = load_samples_generator(monkeypatch, completion)
        upstream_gen, it = _generator(module, [], ["p0", "p1", "p2"])
        upstream = upstream_gen._generate_vllm(it, 3, False)[0]
        monkeypatch.setitem(trainer_binding._STEPS_DONE, "n", 5)
        trainer_binding.bind_samples_generator(module, PluginSpec(seed=3))
        log = []
        gen, it = _generator(module, log, ["p0", "p1", "p2"])
        experiences, consumed, exhausted = gen._generate_vllm(it, 3, False)
        assert (consumed, exhausted) == (3, False)
        assert [e.prompts[0] for e in experiences] == [p for p in ("p0", "p1", "p2") for _ in range(4)]
        assert [r["seed"] for r in log] == [rollout.request_seed(3, "train", 5, k, j) for k in range(3)
                                            for j in range(4)]
        assert all(r["num_samples"] == 1 for r in log)
        runs[name] = _key(experiences)
        if name == "reverse":  # upstream's order follows completion: the last prompt first
            assert upstream[0].prompts[0] == "p2"
    assert runs["reverse"] == runs["forward"]


@pytest.mark.parametrize("prompts, drawn_expected, kept_expected, exhausted_expected", [
    pytest.param([f"p{i}" for i in range(8)], ["p0", "p1", "p2", "p3", "p4", "p5"], ["p0", "p2", "p5"], False,
                 id="refilled"),
    pytest.param([f"p{i}" for i in range(5)], ["p0", "p1", "p2", "p3", "p4"], ["p0", "p2"], True,
                 id="prompts-run-out"),
])
def test_dynamic_filtering_replacements_are_deterministic(monkeypatch, tmp_path, prompts, drawn_expected,
                                                          kept_expected, exhausted_expected):
    """Under dynamic filtering a dropped group's replacement is the next prompt, dispatched as the
    ``k``-th prompt of the call and seeded ``request_seed(seed, "train", step, k, j)``; the kept
    groups are the mixed ones, in dispatch order, each sample the one its seed gives, whichever
    order the engines complete in. Upstream (unbound) keeps them in completion order."""
    seed, step, n = 11, 4, 4
    kept = {}
    for name, completion in (("reverse", reversed), ("forward", iter)):
        module = load_samples_generator(monkeypatch, completion)
        upstream_gen, it = _generator(module, [], prompts, dynamic=True, labels=FILTER_LABELS)
        upstream, upstream_consumed, _ = upstream_gen._generate_vllm(it, 3, True)
        monkeypatch.setitem(trainer_binding._STEPS_DONE, "n", step)
        dumps = tmp_path / name
        trainer_binding.bind_samples_generator(module, PluginSpec(seed=seed, dump_dir=str(dumps)))
        log, drawn = [], []
        gen, it = _generator(module, log, prompts, dynamic=True, labels=FILTER_LABELS, drawn=drawn)
        experiences, consumed, exhausted = gen._generate_vllm(it, 3, True)
        # the dump the smoke job's tests read: what was drawn, kept, asked for and not found
        (rec,) = [json.loads(ln) for ln in (dumps / rollout.DRAWS_FILE).read_text().splitlines()]
        assert rec["prompts"] == drawn and rec["kept"] == [p in kept_expected for p in drawn]
        assert (rec["replacements"], rec["missed"], rec["exhausted"], rec["steps_done"], rec["purpose"]) == (
            3, int(exhausted_expected), exhausted_expected, step, "train")  # p1, p3, p4 dropped; p4's finds none

        # filtering happened: 3 groups dropped (p1, p3, p4), each replaced while prompts remained
        assert drawn == drawn_expected and consumed == upstream_consumed == len(drawn_expected) > 3
        assert consumed - len(experiences) // n == 3 and exhausted is exhausted_expected
        # every drawn prompt dispatched once, in draw order, sample j of the k-th seeded (k, j)
        assert [(r["prompt"], r["seed"], r["num_samples"]) for r in log] == [
            (p, rollout.request_seed(seed, "train", step, k, j), 1) for k, p in enumerate(drawn) for j in range(n)]
        # the kept groups: the mixed ones in dispatch order, each sample its seed's response
        assert [e.prompts[0] for e in experiences] == [p for p in kept_expected for _ in range(n)]
        k_of = {p: k for k, p in enumerate(drawn)}
        assert [e.sequences[0].tolist()[2:] for e in experiences] == [
            tokens(rollout.request_seed(seed, "train", step, k_of[p], j)) for p in kept_expected for j in range(n)]
        assert [e.scores[0].item() for e in experiences] == [0.0, 1.0, 0.0, 1.0] * len(kept_expected)
        kept[name] = _key(experiences)
        if name == "reverse":  # upstream keeps the groups in completion order: the last dispatched first
            assert [e.prompts[0] for e in upstream[::n]] == [kept_expected[1], *kept_expected[2:], kept_expected[0]]
    assert kept["reverse"] == kept["forward"]


def test_eval_requests_have_their_own_seeds(monkeypatch):
    module = load_samples_generator(monkeypatch)
    monkeypatch.setitem(trainer_binding._STEPS_DONE, "n", 2)
    trainer_binding.bind_samples_generator(module, PluginSpec(seed=3))
    log = []
    gen, _ = _generator(module, log, [])
    gen.eval_dataloader = [(None, ["q0"], ["l"], [None])]
    gen.generate_eval_samples(n_samples_per_prompt=1, temperature=0.0)
    assert [r["seed"] for r in log] == [rollout.request_seed(3, "eval", 2, 0, 0)]
    assert gen._fp8rl_purpose == "train"


@pytest.mark.parametrize("level", ["off", "token"])
def test_seeded_requests_ask_the_engines_for_what_upstream_asks(monkeypatch, level):
    """Each seeded request's ``SamplingParams`` are upstream's own ``_dispatch_prompts_to_vllm``'s
    (the real source, for the same arguments) plus the seed: with an IS correction on they ask the
    engines for the sampled tokens' log-probs (``logprobs=1``), which the TIS loss needs."""
    module = load_samples_generator(monkeypatch)
    asked = {"upstream": [], "ours": []}

    class Recording(Engine):
        def __init__(self, into):
            super().__init__([])
            self.into = into
            self.generate_responses = ns(remote=self._record)

        def _record(self, *, sampling_params, **kw):
            self.into.append(dict(vars(sampling_params)))
            return self._generate(sampling_params=sampling_params, **kw)

    kwargs = dict(temperature=0.7, top_p=0.9, max_new_tokens=24, min_new_tokens=2, n_samples_per_prompt=2)
    for who in asked:
        strategy = ns(args=sg_args())
        strategy.args.algo.advantage.is_correction_level = level
        gen = module.SamplesGenerator(strategy, None, None, tokenizer=None, vllm_engines=[Recording(asked[who])])
        if who == "upstream":
            gen._dispatch_prompts_to_vllm(["p0"], ["l0"], **kwargs)
        else:
            rollout.dispatch(gen, ["p0"], ["l0"], None, 0, lambda k, j: 100 + j, **kwargs)
    (theirs,) = asked["upstream"]
    assert [a.pop("seed") for a in asked["ours"]] == [100, 101] and theirs.pop("seed") is None
    assert asked["ours"] == [theirs, theirs]
    assert theirs["logprobs"] == (1 if level == "token" else None)


def test_without_a_seed_the_binding_leaves_upstream_rollout(monkeypatch):
    module = load_samples_generator(monkeypatch)
    upstream = module.SamplesGenerator._generate_vllm
    trainer_binding.bind_samples_generator(module, PluginSpec(seed=1))
    assert module.SamplesGenerator._generate_vllm is not upstream
    trainer_binding.bind_samples_generator(module, PluginSpec())  # rebinding starts from the originals
    assert module.SamplesGenerator._generate_vllm is upstream
    log = []
    gen, it = _generator(module, log, ["p0"])
    gen._generate_vllm(it, 1, False)
    assert [r["num_samples"] for r in log] == [4] * 4 and {r["seed"] for r in log} == {None}  # one call, unseeded


def test_the_prompt_order_is_seeded_and_resumes_from_the_sampler_state():
    """``seed_prompt_sampler`` seeds the loader's ``RandomSampler`` generator: two loaders seeded
    alike shuffle alike; a loader whose sampler has no generator is refused (upstream moved)."""
    data = list(range(20))

    def order(seed):
        loader = torch.utils.data.DataLoader(
            data, batch_size=1, sampler=torch.utils.data.RandomSampler(data, generator=torch.Generator()))
        torch.manual_seed(int(torch.randint(0, 10**6, ())) + seed)  # the global RNG must not matter
        rollout.seed_prompt_sampler(loader, seed)
        return [int(b) for b in itertools.chain.from_iterable(loader)]

    assert order(5) == order(5) and order(5) != order(6)
    with pytest.raises(UpstreamChangedError, match="RandomSampler"):
        rollout.seed_prompt_sampler(torch.utils.data.DataLoader(data, shuffle=True), 5)


def test_spec_seed_round_trips():
    spec = PluginSpec(seed=9)
    assert PluginSpec.from_json(spec.to_json()).seed == 9 and PluginSpec().seed is None
