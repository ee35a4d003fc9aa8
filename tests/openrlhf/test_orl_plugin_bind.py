"""The plugin binds where OpenRLHF 0.11.2 looks things up (real ppo_actor.py source, heavy imports stubbed).

Stand-ins (``ppo_flow``): ``ray`` (``ray.remote`` as the identity), ``deepspeed`` and OpenRLHF's heavy modules
are stubbed so that the binding's logic runs in milliseconds. They prove only the logic. The
same claims against the real systems (real Ray 2.55 workers, the real ``PolicyModelActor`` and
``ActorPPOTrainer`` of openrlhf 0.11.2, DeepSpeed ZeRO-3 on CPU) are the integration tier's:
``tests/integration/test_int_policy_actor.py`` (run by ``.ci/run``).
"""

import sys
from importlib.metadata import version

import pytest
import torch
from orl_helpers import main_table_configs, openrlhf_dir, random_batch
from ppo_flow import PpoFlow, load_ppo_actor
from ppo_flow import Strategy as _Strategy  # the name test_orl_episode_end imports from here
from ppo_flow import upstream_args as _args
from ppo_flow import want as _want

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


@pytest.mark.parametrize("mode", ["periodic", "pooled", "same_batch"])
def test_calibration_mode_travels_from_the_config_to_the_loss(tmp_path, monkeypatch, mode):
    """clip.calibration_mode -> PluginSpec.from_config -> the JSON the workers read -> the loss's
    controller (a dropped argument would build the default mode)."""
    import dataclasses

    cfg = next(c for key, c in main_table_configs(tmp_path) if key[3] == "calibrated")
    from fp8rl.rl.calibration.schedule import PERIODIC_DEFAULTS

    cfg = dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, calibration_mode=mode, **PERIODIC_DEFAULTS))
    spec = PluginSpec.from_json(PluginSpec.from_config(cfg).to_json())
    ppo_actor, _ = load_ppo_actor(monkeypatch)
    plugin.install(spec, modules={"ppo_actor": ppo_actor})
    strategy = _Strategy()
    strategy.args = _args(eps=(spec.eps_low, spec.eps_high))
    assert _trainer(ppo_actor, strategy).actor_loss_fn.clipper.mode == mode
    with pytest.raises(ValueError, match="shadow_diagnostics"):
        PluginSpec.from_config(dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, shadow_diagnostics=True)))


def _flow(monkeypatch, mode, n=8, t=64, gas=2, steps=2):
    """``ppo_flow.PpoFlow`` (the binding around upstream's ``ppo_train``) on a Calibrated Clipping
    spec of ``mode``, recording the controller's calls: ``update`` (the plan's pooled update, per
    step) and ``update_batch`` (the window calibrations), each with its bounds, how many losses ran
    before it, and the FP8 and BF16 ratios it read."""
    opts = {"mode": mode, "init_bounds": [0.8, 1.28], "upper_rule": "proportional",
            **({"period": 2, "ema": 0.0} if mode == "periodic" else {}),
            **({"sample_fraction": 0.25} if mode == "sampled" else {})}
    spec = PluginSpec(clip_method="calibrated", clip_options=opts, eps_low=0.2, eps_high=0.28)
    flow = PpoFlow(monkeypatch, spec, n=n, t=t, gas=gas)
    ctl, forwards = flow.ctl, flow.forwards
    assert ctl.mode == mode  # spec -> the loss's controller
    calls = {"update": [], "update_batch": []}  # the plan's pooled update (step-level) and window calibrations

    def record_step(step, parts, _orig=ctl.update_step):
        out = _orig(step, parts)
        calls["update"].append({"step": step, "bounds": out.as_tuple(), "n_calls": len(forwards),
                                "ratio": torch.cat([p[0] for p in parts]), "shadow_ratio": torch.cat([p[1] for p in parts])})
        return out

    def record_window(step, tokens, _orig=ctl.calibrate_window, **kw):
        out = _orig(step, tokens, **kw)
        calls["update_batch"].append({"step": step, "bounds": out.as_tuple(), "n_calls": len(forwards),
                                      "ratio": tokens[0], "shadow_ratio": tokens[1], "seq": kw.get("seq")})
        return out

    ctl.update_step, ctl.calibrate_window = record_step, record_window
    flow.train(steps)
    return spec, flow.actor, flow.adv, flow.mask, flow.old, forwards, calls, flow.statuses


def test_same_batch_calibrates_each_optimizer_step_before_its_loss(monkeypatch):
    """``same_batch`` through the binding: one ``update_batch`` per optimizer step (the first
    included), before its first loss, on the FP8 and BF16 ratios of all its micro-batches on the
    weights its losses see; every loss of the window uses those bounds (not the previous window's)."""
    spec, actor, adv, mask, old, forwards, calls, statuses = _flow(monkeypatch, "same_batch")
    assert not calls["update"] and len(calls["update_batch"]) == 2 * 4  # 2 steps x 4 optimizer steps
    reference = spec.make_clipper()
    for w, up in enumerate(calls["update_batch"]):
        window = forwards[2 * w: 2 * w + 2]
        assert up["n_calls"] == 2 * w and {f["k"] for f in window} == {w % 4}  # before its losses, same weights
        assert all(f["bounds"] == up["bounds"] for f in window)
        fp8, bf16, a = (torch.cat(x) for x in zip(*[_want(actor, adv, mask, old, f["idx"], f["k"]) for f in window],
                                                  strict=True))
        torch.testing.assert_close(up["ratio"], fp8)
        torch.testing.assert_close(up["shadow_ratio"], bf16)
        want = reference.update_batch(up["step"], ratio=fp8, shadow_ratio=bf16, advantages=a,
                                      mask=torch.ones_like(fp8, dtype=torch.bool))
        assert want.as_tuple() == pytest.approx(up["bounds"])
    assert len({f["bounds"] for f in forwards}) > 2  # the bounds move from window to window
    assert "shadow/low_bf16_n" in statuses[0] and "shadow/low_recall" in statuses[0]


@pytest.mark.parametrize("mode", ["periodic", "pooled"])
def test_pooling_modes_measure_every_micro_batch_and_rule_from_the_next_step(monkeypatch, mode):
    """``periodic`` (period 2) / ``pooled``: on a calibration step every micro-batch (the first
    included) hands its FP8 ratio and its BF16 shadow ratio (on the weights its loss sees) to one
    ``update`` after the step; the step ran on the previous bounds, the next one runs on the new."""
    spec, actor, adv, mask, old, forwards, calls, statuses = _flow(monkeypatch, mode, steps=3)
    assert not calls["update_batch"]
    steps = [0, 2] if mode == "periodic" else [0, 1, 2]
    assert [u["step"] for u in calls["update"]] == steps
    reference = spec.make_clipper()
    in_force = (0.8, 1.28)
    for step in range(3):
        fwds = [f for f in forwards if f["step"] == step]
        assert len(fwds) == 8 and all(f["bounds"] == pytest.approx(in_force) for f in fwds)
        if step not in steps:
            continue
        (up,) = [u for u in calls["update"] if u["step"] == step]
        assert up["n_calls"] == 8 * (step + 1)  # after the step's last loss
        fp8, bf16, a = (torch.cat(x) for x in zip(*[_want(actor, adv, mask, old, f["idx"], f["k"]) for f in fwds],
                                                  strict=True))
        torch.testing.assert_close(up["ratio"], fp8)  # all 8 micro-batches, in order
        torch.testing.assert_close(up["shadow_ratio"], bf16)
        want = reference.update(step, ratio=fp8, shadow_ratio=bf16, advantages=a,
                                mask=torch.ones_like(fp8, dtype=torch.bool))
        assert want.as_tuple() == pytest.approx(up["bounds"])
        assert statuses[step]["shadow/low_bf16_n"] == float(((a < 0) & (bf16 < 0.8)).sum())
        assert statuses[step]["shadow/low_fp8_n"] == float(((a < 0) & (fp8 < in_force[0])).sum())
        in_force = up["bounds"]
    shadow_calls = [c for c in actor.calls if c[0] == "bf16"]
    assert len(shadow_calls) == 2 * 8 * len(steps)  # old log-probs + every micro-batch, calibration steps only


def test_sampled_measures_its_subset_first_and_rules_the_rest(monkeypatch):
    """``sampled`` through the binding: each step a seeded subset of the samples (share 1/4) gets
    the BF16 shadow (old and current log-probs of those samples only); in every optimizer-step
    window the micro-batches holding subset samples run first, under the bounds in force, their
    losses' FP8 ratios and the shadow's ratios feed the window's calibration, and the window's
    other micro-batches run under its result (out of sample)."""
    spec, actor, adv, mask, old, forwards, calls, statuses = _flow(monkeypatch, "sampled", steps=2)
    assert not calls["update"] and len(calls["update_batch"]) == 2 * 4  # one calibration per window
    reference = spec.make_clipper()
    in_force = (0.8, 1.28)
    for step in range(2):
        measured = reference.begin_step(step, eligible=torch.ones(8, dtype=torch.bool)).measured
        assert int(measured.sum()) == 2  # the share: 1/4 of 8 samples
        for w in range(4):
            up = calls["update_batch"][4 * step + w]
            window = forwards[8 * step + 2 * w: 8 * step + 2 * w + 2]
            mine = [f for f in window if measured[f["idx"][0]]]
            assert window[: len(mine)] == mine  # the subset's micro-batches run first
            assert all(f["bounds"] == pytest.approx(in_force) for f in mine)  # under the bounds in force
            assert up["n_calls"] == 8 * step + 2 * w + len(mine)  # calibrated right after them
            assert all(f["bounds"] == pytest.approx(up["bounds"]) for f in window[len(mine):])
            if mine:
                fp8, bf16, _ = (torch.cat(x) for x in zip(*[_want(actor, adv, mask, old, f["idx"], f["k"])
                                                            for f in mine], strict=True))
                torch.testing.assert_close(up["ratio"], fp8)
                torch.testing.assert_close(up["shadow_ratio"], bf16)
            else:
                assert up["ratio"].numel() == 0
            in_force = up["bounds"]
        assert statuses[step]["clip/sample_share"] == 0.25 and statuses[step]["clip/sample_seqs"] == 2
        neg = sum(int((mask[i] & (adv[i] < 0)).sum()) for i in torch.nonzero(measured).flatten().tolist())
        assert statuses[step]["shadow/oos_n_neg"] == neg  # every shadowed A<0 token is out of sample
        assert "shadow/xfit_n_neg" not in statuses[step]
    # the BF16 shadow ran on the subsets only: old and current log-probs of 2 samples per step
    assert len([c for c in actor.calls if c[0] == "bf16"]) == 2 * 2 * 2


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
