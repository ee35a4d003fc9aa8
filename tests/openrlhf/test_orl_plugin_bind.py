"""The plugin binds where OpenRLHF 0.11.2 looks things up (real ppo_actor.py source, heavy imports stubbed).

Stand-ins: ``ray`` (``ray.remote`` as the identity), ``deepspeed`` and OpenRLHF's heavy modules
are stubbed so that the binding's logic runs in milliseconds. They prove only the logic. The
same claims against the real systems (real Ray 2.55 workers, the real ``PolicyModelActor`` and
``ActorPPOTrainer`` of openrlhf 0.11.2, DeepSpeed ZeRO-3 on CPU) are the integration tier's:
``tests/integration/test_int_policy_actor.py`` (run by ``.ci/run``).
"""

import importlib.util
import sys
import types
from importlib.metadata import version

import pytest
import torch
from orl_helpers import load_upstream_loss, openrlhf_dir, random_batch

from fp8rl.backends.openrlhf import plugin
from fp8rl.backends.openrlhf.plugin import PluginSpec, PluginVersionError, check_version


def test_installed_openrlhf_is_the_pinned_version():
    openrlhf_dir()
    assert version("openrlhf") == plugin.OPENRLHF_VERSION == "0.11.2"
    assert check_version() == "0.11.2"


@pytest.mark.parametrize("other", ["0.11.1", "0.11.3", "0.10.2"])
def test_other_versions_fail_loudly(other):
    with pytest.raises(PluginVersionError, match=r"0\.11\.2"):
        check_version(other)


def _stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []
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
        "openrlhf.utils.loss_utils": _stub("openrlhf.utils.loss_utils", get_loss_batch_info=None,
                                           iter_grad_accum_global_norm=None),
        "openrlhf.utils.vlm_utils": _stub("openrlhf.utils.vlm_utils", merge_mm_train_inputs=None),
    }
    for k, v in stubs.items():
        monkeypatch.setitem(sys.modules, k, v)
    spec = importlib.util.spec_from_file_location("openrlhf.trainer.ray.ppo_actor", root / "trainer/ray/ppo_actor.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ray.ppo_actor", mod)
    spec.loader.exec_module(mod)
    return mod, loss


def _args(eps=(0.2, 0.28)):
    ns = types.SimpleNamespace
    return ns(
        train=ns(max_epochs=1, colocate_all=False, async_enable=False, dynamic_batch_enable=False),
        actor=ns(eps_clip_low_high=eps, dual_clip=None, loss_agg_mode="token-mean", policy_loss_type="ppo",
                 aux_loss_coef=0.0),
        algo=ns(advantage=ns(is_correction_level="token", is_correction_mode="clip", is_correction_gating="ratio",
                             is_correction_threshold=[0.0, 2.0])),
        ds=ns(packing_samples=False), vllm=ns(sync_backend="nccl"),
    )


class _Strategy:  # DeepspeedStrategy's attributes the trainer reads (a plain object: weak-referenceable)
    def __init__(self):
        self.args, self.accumulated_gradient = _args(), 1


def _trainer(ppo_actor, strategy=None):
    strategy = strategy or _Strategy()
    return ppo_actor.ActorPPOTrainer(strategy, actor=torch.nn.Linear(2, 2), ema_model=None, actor_optim=None,
                                     actor_scheduler=None)


def test_install_binds_where_actor_ppo_trainer_looks(monkeypatch):
    """Unit level (imports stubbed, ``ray.remote`` the identity): the binding's logic. That it is
    *reached* in real Ray workers is shown by tests/integration (real Ray, real openrlhf)."""
    ppo_actor, loss = load_ppo_actor(monkeypatch)
    spec = PluginSpec(clip_method="calibrated", clip_options={"period": 20, "init_bounds": [0.6, 1.8]},
                      eps_low=0.2, eps_high=0.28)
    orig_step = ppo_actor.ActorPPOTrainer.training_step
    plugin.install(spec, modules={"ppo_actor": ppo_actor})
    assert issubclass(ppo_actor.PolicyLoss, loss.PolicyLoss) and ppo_actor.PolicyLoss is not loss.PolicyLoss
    assert ppo_actor.ActorPPOTrainer.training_step is not orig_step
    assert ppo_actor._fp8rl_spec_json == spec.to_json()
    # upstream's own constructor builds our loss from its args
    trainer = _trainer(ppo_actor)
    fn = trainer.actor_loss_fn
    assert type(fn).__name__ == "Fp8rlPolicyLoss"
    assert fn.correction == "tis" and fn.correction_params == {"cap": 2.0}
    assert fn.clipper.bounds(0).as_tuple() == (0.6, 1.8)  # the calibrated arm's wide start
    lp, old, rollout, adv, mask = random_batch(0)
    out = fn(lp, old, adv, mask, rollout_log_probs=rollout)
    assert len(out) == 5
    # a second install (another spec) starts from upstream's functions: nothing stacks
    plugin.install(PluginSpec(eps_low=0.2, eps_high=0.28), modules={"ppo_actor": ppo_actor})
    assert ppo_actor.PolicyLoss._fp8rl_upstream is loss.PolicyLoss
    assert ppo_actor.ActorPPOTrainer._fp8rl_originals["training_step"] is orig_step
    assert type(_trainer(ppo_actor).actor_loss_fn.clipper).__name__ == "VanillaClip"


def test_trainer_refuses_a_cell_whose_fp8_conversion_did_not_happen(monkeypatch):
    """Defect 1's guard: an FP8 trainer recipe with a BF16 actor raises before any training."""
    ppo_actor, _ = load_ppo_actor(monkeypatch)
    plugin.install(PluginSpec(eps_low=0.2, eps_high=0.28, trainer_recipe="tensorwise"), modules={"ppo_actor": ppo_actor})
    with pytest.raises(plugin.Fp8ConversionError, match="no FP8 linear layer"):
        _trainer(ppo_actor)


def test_binding_fails_loudly_when_upstream_moves(monkeypatch):
    ppo_actor, _ = load_ppo_actor(monkeypatch)

    def training_step(self, experience, kl_ctl):  # a changed upstream signature
        return None

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "training_step", training_step)
    with pytest.raises(plugin.UpstreamChangedError, match=r"ActorPPOTrainer\.training_step"):
        plugin.install(PluginSpec(eps_low=0.2, eps_high=0.28), modules={"ppo_actor": ppo_actor})


def test_training_step_wrapper_calibrates_on_the_measured_micro_batch(monkeypatch):
    ppo_actor, _ = load_ppo_actor(monkeypatch)
    spec = PluginSpec(clip_method="calibrated", clip_options={"period": 1, "ema": 0.0, "init_bounds": [0.8, 1.28],
                                                             "reference": "static", "alpha": 0.01,
                                                             "upper_rule": "proportional"},
                      eps_low=0.2, eps_high=0.28)
    bounds = []

    def fake_step(self, experience, kl_ctl, step, loss_batch_info=None):  # upstream's order of events
        out = self.actor_loss_fn(experience.lp, experience.old, experience.adv, experience.mask)
        bounds.append(self.actor_loss_fn.clipper.bounds(0).as_tuple())
        return out

    lp, old, _, adv, mask = random_batch(2)
    exp = types.SimpleNamespace(lp=lp, old=old, adv=adv, mask=mask, info={}, action_log_probs=old,
                                action_mask=mask)

    def fake_ppo_train(self, kl_ctl):  # two micro-batches, one per optimizer step (accumulation 1)
        self.training_step(exp, kl_ctl, 0)
        self.training_step(exp, kl_ctl, 1)
        return {"policy_loss": 0.0}

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "training_step", fake_step)
    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "ppo_train", fake_ppo_train)
    plugin.install(spec, modules={"ppo_actor": ppo_actor})
    trainer = _trainer(ppo_actor)
    trainer.replay_buffer.items = [types.SimpleNamespace(info={}) for _ in range(2)]
    status = trainer.ppo_train(0.0)
    assert bounds[0] == pytest.approx((0.8, 1.28))  # micro-batch 0: not the measured one (2nd optimizer step)
    assert bounds[1][0] != pytest.approx(0.8)  # micro-batch 1 calibrated: static alpha=0.01 moved the bound
    assert status["clip/low"] == pytest.approx(bounds[1][0])  # logged once, the bound in force after the step
    assert status["policy_loss"] == 0.0 and "actor/clipfrac_neg_low" in status
    assert trainer._fp8rl_step == 1 and trainer.actor_loss_fn.step_metrics is None


def test_lazy_hook_binds_only_when_the_target_is_imported(monkeypatch, tmp_path):
    """The setup hook imports nothing heavy; a target module is bound right after it executes."""
    from fp8rl.backends.openrlhf.plugin import hook

    pkg = tmp_path / "fp8rl_fake_target"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hook, "TARGETS", ("fp8rl_fake_target.mod",))
    seen = []
    monkeypatch.setattr(hook, "_bind", lambda name, module, spec_json: seen.append((name, module.VALUE, spec_json)))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    hook.install_lazy("{}")
    assert seen == [] and "fp8rl_fake_target.mod" not in sys.modules
    import fp8rl_fake_target.mod  # noqa: F401

    assert seen == [("fp8rl_fake_target.mod", 1, "{}")]
    monkeypatch.delitem(sys.modules, "fp8rl_fake_target.mod")
    monkeypatch.delitem(sys.modules, "fp8rl_fake_target")
