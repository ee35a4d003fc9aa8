"""Upstream OpenRLHF 0.11.2's real ``ppo_actor.py`` driven through the plugin binding, on CPU in
milliseconds (imported as ``ppo_flow`` by ``test_orl_plugin_bind`` and ``test_orl_holdout``).

``load_ppo_actor`` executes the installed wheel's ``openrlhf/trainer/ray/ppo_actor.py`` with every
heavy import stubbed (``ray.remote`` the identity, DeepSpeed and OpenRLHF's heavy modules empty).
``FakeActor`` stands in for the policy model, ``want`` recomputes its ratios independently of the
binding, and ``PpoFlow`` runs ``ppo_train`` steps in upstream's order of events with a fake
``training_step`` / ``ppo_train`` and records every loss's forward. They prove only the binding's
logic; the same claims against the real systems are the integration tier's
(``tests/integration/test_int_policy_actor.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import torch
from orl_helpers import load_upstream_loss, openrlhf_dir

from fp8rl.backends.openrlhf import plugin
from fp8rl.backends.openrlhf.plugin import PluginSpec


def _stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []
    return mod


def _real(path, name):
    """An upstream module executed from the installed wheel's source (it must import torch only)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_ppo_actor(monkeypatch):
    """Execute openrlhf/trainer/ray/ppo_actor.py with every heavy import stubbed."""
    root = openrlhf_dir()
    loss = load_upstream_loss(monkeypatch)
    ray = _stub("ray", remote=lambda *a, **k: (lambda cls: cls))
    ds = _stub("deepspeed")

    class Buffer:
        def __init__(self, *a, **k):
            self.items, self.sample_batch_size = [], 1

        def __len__(self):
            return len(self.items)

    stubs = {
        "ray": ray, "deepspeed": ds, "tqdm": _stub("tqdm", tqdm=lambda x, **k: x),
        "openrlhf": _stub("openrlhf"), "openrlhf.models": _stub("openrlhf.models", Actor=object,
                                                                PolicyLoss=loss.PolicyLoss,
                                                                aggregate_loss=loss.aggregate_loss),
        "openrlhf.models.utils": _stub("openrlhf.models.utils", compute_approx_kl=None, masked_mean=None),
        "openrlhf.trainer": _stub("openrlhf.trainer"), "openrlhf.trainer.ppo_utils":
            _stub("openrlhf.trainer.ppo_utils", NaiveReplayBuffer=Buffer),
        "openrlhf.trainer.ppo_utils.experience": _stub("openrlhf.trainer.ppo_utils.experience", Experience=object),
        "openrlhf.trainer.ray": _stub("openrlhf.trainer.ray"),
        "openrlhf.trainer.ray.launcher": _stub("openrlhf.trainer.ray.launcher", BaseModelActor=object),
        "openrlhf.trainer.ray.utils": _stub("openrlhf.trainer.ray.utils", get_physical_gpu_id=None),
        "openrlhf.utils": _stub("openrlhf.utils", get_tokenizer=None),
        "openrlhf.utils.deepspeed": _stub("openrlhf.utils.deepspeed", DeepspeedStrategy=object),
        "openrlhf.utils.deepspeed.deepspeed_utils": _stub("openrlhf.utils.deepspeed.deepspeed_utils",
                                                          offload_deepspeed_states=None,
                                                          reload_deepspeed_states=None),
        "openrlhf.utils.distributed_util": _stub("openrlhf.utils.distributed_util",
                                                 stateless_init_process_group=None,
                                                 torch_dist_barrier_and_cuda_sync=lambda: None),
        "openrlhf.utils.logging_utils": _stub("openrlhf.utils.logging_utils",
                                              init_logger=lambda n: __import__("logging").getLogger(n)),
        "openrlhf.utils.loss_utils": _real(root / "utils/loss_utils.py", "openrlhf.utils.loss_utils"),  # torch only
        "openrlhf.utils.vlm_utils": _stub("openrlhf.utils.vlm_utils", merge_mm_train_inputs=None),
    }
    for k, v in stubs.items():
        monkeypatch.setitem(sys.modules, k, v)
    spec = importlib.util.spec_from_file_location("openrlhf.trainer.ray.ppo_actor", root / "trainer/ray/ppo_actor.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ray.ppo_actor", mod)
    spec.loader.exec_module(mod)
    return mod, loss


def upstream_args(eps=(0.2, 0.28)):
    """The ``strategy.args`` fields the trainer reads (TIS on: token-level clip at 2)."""
    ns = types.SimpleNamespace
    return ns(
        train=ns(max_epochs=1, colocate_all=False, async_enable=False, dynamic_batch_enable=False),
        actor=ns(eps_clip_low_high=eps, dual_clip=None, loss_agg_mode="token-mean", policy_loss_type="ppo",
                 aux_loss_coef=0.0),
        algo=ns(advantage=ns(is_correction_level="token", is_correction_mode="clip", is_correction_gating="ratio",
                             is_correction_threshold=[0.0, 2.0])),
        ds=ns(packing_samples=False), vllm=ns(sync_backend="nccl"),
    )


class Strategy:  # DeepspeedStrategy's attributes the trainer reads (a plain object: weak-referenceable)
    def __init__(self):
        self.args, self.accumulated_gradient = upstream_args(), 1


class FakeActor(torch.nn.Module):
    """Stand-in for OpenRLHF's ``Actor`` (no model on CPU in the default suite): log-probs of
    samples ``sequences`` ``[B]`` under weight version ``k`` (= optimizer steps done): ``base +
    k * drift`` in BF16, plus an FP8 error ``noise[k]`` unless ``bf16`` (``PpoFlow``'s
    ``fp8_disabled`` sets it). ``calls``: ``(kind, k, rows)`` of every forward."""

    def __init__(self, n, t, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model = self
        self.base = -torch.rand(n, t, generator=g) - 0.5
        self.drift = torch.randn(n, t, generator=g) * 0.3
        self.noise = torch.randn(8, n, t, generator=g) * 0.2
        self.k, self.bf16, self.calls = 0, False, []

    def forward(self, sequences, action_mask, attention_mask=None, ring_attn_group=None):
        self.calls.append(("bf16" if self.bf16 else "fp8", self.k, sequences.tolist()))
        lp = self.base[sequences] + self.k * self.drift[sequences]
        return lp if self.bf16 else lp + self.noise[self.k][sequences]


def want(actor, adv, mask, old, idx, k):
    """The calibration tokens of samples ``idx`` on weights ``k``: FP8 and BF16 ratios, advantages
    (each ``[tokens]``: the unmasked tokens with A != 0, row-major)."""
    idx = torch.tensor(idx)
    m = mask[idx] & (adv[idx] != 0)
    lp = actor.base[idx] + k * actor.drift[idx]
    fp8 = torch.exp((lp + actor.noise[k][idx] - old[idx]).clamp(-20, 20))
    bf16 = torch.exp((lp - actor.base[idx]).clamp(-20, 20))
    return fp8[m], bf16[m], adv[idx][m]


class PpoFlow:
    """The binding around ``ppo_train`` in upstream's order of events: the module's
    ``iter_grad_accum_global_norm`` (upstream's, from its source) groups ``micro_train_batch_size``
    1 micro-batches into optimizer steps of ``gas``; per micro-batch the wrapped ``training_step``
    runs the FP8 forward and our loss; after each window the weights change (``actor.k += 1``).

    ``n`` samples of ``t`` tokens; advantages ``adv`` ``[n, t]`` of alternating sign by row (both
    signs in every window), ``mask`` ``[n, t]`` of seeded lengths in ``[t/2, t]``; ``zero_last``:
    the last sample has A == 0 (not eligible). ``two_ranks``: the DP collectives of
    ``binding.actor`` act as two ranks holding this one's data. Build it, wrap ``ctl`` (the loss's
    controller) as a test needs, then ``train(steps)``. Records: ``forwards`` (per loss: the step,
    weights ``k``, rows ``idx``, the ``bounds`` it used), ``statuses`` (what ``ppo_train``
    returned), ``step_calls`` (the actor's forwards of each step), ``old`` (the FP8 trainer's old
    log-probs ``[n, t]``, before the step's first update)."""

    def __init__(self, monkeypatch, spec: PluginSpec, *, n: int, t: int, gas: int, zero_last: bool = False,
                 two_ranks: bool = False):
        import fp8rl.quant.convert as convert

        ppo_actor, _ = load_ppo_actor(monkeypatch)
        self.spec, self.n, self.gas = spec, n, gas
        self.actor = actor = FakeActor(n, t)

        @contextlib.contextmanager
        def fp8_disabled(model):
            model.bf16 = True
            try:
                yield model
            finally:
                model.bf16 = False

        monkeypatch.setattr(convert, "fp8_disabled", fp8_disabled)
        if two_ranks:
            _two_ranks(monkeypatch)
        g = torch.Generator().manual_seed(1)
        sign = torch.tensor([(-1.0) ** i for i in range(n)])[:, None]  # both signs in every window
        self.adv = adv = (sign * (torch.rand(n, 1, generator=g) + 0.1)).expand(n, t).clone()
        if zero_last:
            adv[n - 1] = 0.0
        self.mask = mask = torch.arange(t)[None, :] < torch.randint(t // 2, t + 1, (n,), generator=g)[:, None]

        def collate(chunk):
            idx = torch.tensor([c.idx for c in chunk])
            info = {k: [c.info[k] for c in chunk] for k in chunk[0].info}
            return types.SimpleNamespace(sequences=idx, action_mask=mask[idx], attention_mask=None,
                                         advantages=adv[idx], action_log_probs=None, info=info,
                                         to_device=lambda d, self=None: None)

        self.forwards = forwards = []
        flow = self

        def fake_step(self, experience, kl_ctl, step, loss_batch_info=None):  # upstream's order of events
            lp = self.actor(experience.sequences, experience.action_mask)
            loss = self.actor_loss_fn
            out = loss(lp, experience.action_log_probs, experience.advantages, experience.action_mask,
                       rollout_log_probs=experience.action_log_probs, **loss_batch_info)  # TIS on: weights of 1
            w = loss.window
            forwards.append({"step": loss.step, "k": self.actor.k, "idx": experience.sequences.tolist(),
                             "bounds": (w.bounds() if w is not None else loss.clipper.bounds(loss.step)).as_tuple()})
            if step % gas == gas - 1:
                self.actor.k += 1
            return out

        def fake_ppo_train(self, kl_ctl):
            batches = []
            for i in range(n):
                b = collate([self.replay_buffer.items[i]])
                b.action_log_probs = flow.old[i:i + 1]
                batches.append(b)
            windows = ppo_actor.iter_grad_accum_global_norm(iter(batches), self.strategy, gas, lambda e: e.action_mask)
            for step, (exp, info) in enumerate(windows):
                self.training_step(exp, kl_ctl, step, info)
            return {"policy_loss": 0.0}

        monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "training_step", fake_step)
        monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "ppo_train", fake_ppo_train)
        plugin.install(spec, modules={"ppo_actor": ppo_actor})
        strategy = Strategy()
        strategy.ring_attn_group = None
        self.trainer = ppo_actor.ActorPPOTrainer(strategy, actor=actor, ema_model=None, actor_optim=None,
                                                 actor_scheduler=None)
        self.trainer.micro_train_batch_size = 1
        self.trainer.replay_buffer.collate_fn = collate
        self.ctl = self.trainer.actor_loss_fn.clipper
        self.old, self.statuses, self.step_calls = None, [], []

    def train(self, steps: int) -> PpoFlow:
        """``steps`` ``ppo_train`` calls, each on all ``n`` samples from weights ``k = 0``."""
        actor, adv, mask = self.actor, self.adv, self.mask
        for _ in range(steps):
            actor.k = 0
            self.old = actor.base + actor.noise[0]  # the FP8 trainer's old log-probs, before the step's first update
            self.trainer.replay_buffer.items = [
                types.SimpleNamespace(idx=i, action_mask=mask[i], advantages=adv[i], info={}) for i in range(self.n)]
            before = len(actor.calls)
            self.statuses.append(self.trainer.ppo_train(0.0))
            self.step_calls.append(actor.calls[before:])
        return self


def _two_ranks(monkeypatch) -> None:
    """The DP collectives ``binding.actor`` uses act as two ranks holding this rank's data: the
    gather returns it twice, a SUM all-reduce doubles it."""
    import torch.distributed as dist

    from fp8rl.backends.openrlhf.plugin.binding import actor as actor_binding

    def all_reduce(t, op=None, group=None):
        if op == dist.ReduceOp.SUM:
            t.mul_(2)
        return t

    monkeypatch.setattr(actor_binding, "_dp_group", lambda strategy: (None, True))
    monkeypatch.setattr(actor_binding, "varlen_all_gather", lambda t, group=None: [t, t])
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
