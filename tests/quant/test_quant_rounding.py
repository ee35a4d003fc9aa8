"""Stochastic rounding (unbiased, two neighbours, seeded, checkpointed), the wgrad random Hadamard
transform (orthogonal, product unchanged, both operands), NVFP4's 16x16 weight tiles, and the
w4a16 weight-only recipe."""

from __future__ import annotations

import bisect
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from microscale_reference import GRIDS, assert_bits, hadamard_reference, reference
from torch import nn

from fp8rl.quant import RECIPES, convert_to_fp8, fp8_linear
from fp8rl.quant.formats import E2M1, E2M3
from fp8rl.quant.granularity import MX, NVBlock
from fp8rl.quant.hadamard import SIGNS, hadamard, rht, rht_matrix
from fp8rl.quant.microscale import fake_quantize_microscaled, quantize_microscaled
from fp8rl.quant.rounding import QuantizerState, model_quantizer_state


def _x(shape=(4, 48), seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def _decode_scales(x, g, fmt):
    """float32 decode scale of every element (the scales are nearest even either way)."""
    mt = quantize_microscaled(x, g, fmt)
    d = mt.block_scale.repeat_interleave(g.block, dim=-1)[:, : x.shape[1]]
    return d * (1.0 if mt.tensor_scale is None else mt.tensor_scale)


@pytest.mark.parametrize("g,fmt", [(NVBlock(16), E2M1), (MX(32), E2M3)], ids=["nvfp4", "mxfp6"])
def test_stochastic_rounding_lands_on_the_two_neighbours_and_is_unbiased(g, fmt):
    """Every draw is one of the two grid values around x (found by bisection on the enumerated
    grid); over N draws the mean is x within 5 standard errors per element, and both neighbours
    occur (it is no nearest rounding in disguise)."""
    x, n = _x(), 4000
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([fake_quantize_microscaled(x, g, fmt, gen) for _ in range(n)]).double()
    d32 = _decode_scales(x, g, fmt)
    d = d32.double()
    vals = GRIDS[fmt.name]
    lo = torch.empty_like(d)
    hi = torch.empty_like(d)
    for idx, (xi, di) in enumerate(zip(x.flatten().tolist(), d.flatten().tolist(), strict=True)):
        a = float(np.float32(abs(xi) / di))
        i = bisect.bisect_right(vals, a) - 1
        lo.view(-1)[idx] = float(np.float32(vals[i] * di))  # the dequantized value is fp32(q * d)
        hi.view(-1)[idx] = float(np.float32((vals[min(i + 1, len(vals) - 1)] if vals[i] != a else vals[i]) * di))
    sign = torch.sign(x).double()
    on_lo = (draws == sign * lo).all(0) | (draws == sign * lo)
    assert bool(((draws == sign * lo) | (draws == sign * hi)).all()), "a draw left the two neighbours"
    p = ((x.abs().double() - lo) / (hi - lo).clamp_min(1e-300)).clamp(0, 1)
    se = (hi - lo) * torch.sqrt(p * (1 - p) / n)
    err = (draws.mean(0) - x.double()).abs()
    inside = x.abs().double() <= fmt.max * d  # above the largest value an element saturates (not a rounding)
    assert bool(inside.float().mean() > 0.9)
    tol = 5 * se + 1e-6 * x.abs().double()  # 1e-6: the float32 rounding of q * d
    assert bool((err <= tol)[inside].all()), float((err / (se + 1e-30))[inside].max())
    assert bool((draws == sign * (fmt.max * d32).double()).all(0)[~inside].all())
    both = ((draws == sign * lo).any(0) & (draws == sign * hi).any(0) & (lo != hi)).double().mean()
    assert float(both) > 0.5 and bool(on_lo.any())


def test_a_grid_value_never_moves_and_saturation_holds():
    vals = torch.tensor(GRIDS["e2m1"], dtype=torch.float32)
    x = torch.cat([vals, -vals, torch.full((16,), 6.0)]).reshape(2, -1)  # every E2M1 value, amax 6
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = fake_quantize_microscaled(x, MX(32), E2M1, gen)  # MX scale 1 for amax 6: the grid itself
        assert torch.equal(out, x)


def test_stochastic_rounding_is_seeded_and_never_touches_the_global_rng():
    """Same seed -> same bits whatever the global RNG holds; another seed -> other bits; the
    global RNG state is left as it was (a planted draw from the global RNG fails all three)."""
    x = _x((8, 64))

    def run(seed, global_seed):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        gen = QuantizerState(seed).generator
        out = [fake_quantize_microscaled(x, NVBlock(16), E2M1, gen) for _ in range(3)]
        assert torch.equal(torch.get_rng_state(), before), "stochastic rounding drew from the global RNG"
        return torch.stack(out)

    a = run(11, 0)
    assert_bits(a, run(11, 12345))
    assert not torch.equal(a, run(12, 0))


def test_a_stochastic_recipe_refuses_to_run_unseeded():
    with pytest.raises(ValueError, match="seed"):
        convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), "nvfp4", emulate=True,
                       module_filter=lambda m, fqn: True)
    x, w = _x((4, 32)), torch.randn(16, 32)
    with pytest.raises(ValueError, match="seeded quantizer state"):
        fp8_linear(x, w, None, RECIPES["nvfp4"], emulate=True)


def _policy(seed=5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 32))
    return convert_to_fp8(model, "nvfp4", emulate=True, seed=seed, module_filter=lambda m, fqn: True)


class _Trainer:
    """The attributes ``CheckpointMixin`` reads, around a tiny nvfp4 policy."""

    def __init__(self, run_dir):
        from fp8rl.backends.mini.checkpoint import CheckpointMixin

        self.__class__ = type("T", (_Trainer, CheckpointMixin), {})
        self.run_dir, self.device, self.policy = run_dir, torch.device("cpu"), _policy()
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.1)
        self.clipper = SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda s: None)
        self.engine = SimpleNamespace(sync=lambda p: None)
        self.step, self.bad_steps, self.skipped_updates, self.history = 0, 0, 0, []
        g = torch.Generator().manual_seed(3)
        self.x, self.gy = torch.randn(40, 64, generator=g), torch.randn(40, 32, generator=g)

    def train_step(self):
        self.optimizer.zero_grad()
        self.policy(self.x).backward(self.gy)
        grads = [p.grad.clone() for p in self.policy.parameters()]
        self.optimizer.step()
        self.step += 1
        return grads


def test_rounding_noise_resumes_from_the_mini_checkpoint(tmp_path):
    """A run stopped after step 2 and resumed from its checkpoint computes steps 3 and 4 with the
    same rounding draws, so the same gradients bit for bit, as a run that never stopped; a resume
    that starts the stream afresh (the state not restored) computes other gradients."""
    from fp8rl.backends.mini.checkpoint import QUANT_STATE_KEY, load_state

    def run_dir(sub):
        (tmp_path / sub).mkdir()
        return SimpleNamespace(checkpoint_dir=tmp_path / sub, metrics_path=tmp_path / sub / "metrics.jsonl",
                               read_metrics=lambda: [{"step": s} for s in range(1, 10)])

    straight = _Trainer(run_dir("a"))
    want = [straight.train_step() for _ in range(4)][2:]

    first = _Trainer(run_dir("b"))
    first.train_step(), first.train_step()
    first.save_checkpoint()
    assert QUANT_STATE_KEY in load_state(first.checkpoint_path(), "cpu")
    resumed = _Trainer(first.run_dir)
    assert resumed.load_checkpoint() and resumed.step == 2
    got = [resumed.train_step() for _ in range(2)]
    for gw, ww in zip(got, want, strict=True):
        for a, b in zip(gw, ww, strict=True):
            assert_bits(a, b)

    fresh = _Trainer(first.run_dir)  # the checkpoint's weights, the rounding stream from its start
    state = load_state(first.checkpoint_path(), "cpu")
    fresh.policy.load_state_dict(state["model"])
    fresh.optimizer.load_state_dict(state["optimizer"])
    other = fresh.train_step()
    assert not all(torch.equal(a, b) for a, b in zip(other, want[0], strict=True))


def test_quantizer_state_round_trips_and_refuses_another_seed():
    s = QuantizerState(3)
    torch.rand(5, generator=s.generator)
    saved = s.state_dict()
    a = torch.rand(5, generator=s.generator)
    t = QuantizerState(3)
    t.load_state_dict(saved)
    assert torch.equal(torch.rand(5, generator=t.generator), a)
    with pytest.raises(ValueError, match="seed"):
        QuantizerState(4).load_state_dict(saved)
    with pytest.raises(ValueError, match="run seed"):
        QuantizerState(-1)
    assert model_quantizer_state(_policy()) is not None
    assert model_quantizer_state(convert_to_fp8(nn.Sequential(nn.Linear(32, 16)), "nvfp4_rn", emulate=True,
                                                module_filter=lambda m, fqn: True)) is None


# ----- the random Hadamard transform ---------------------------------------------------------


def test_rht_is_orthogonal_and_built_from_the_hadamard_matrix():
    assert np.array_equal(hadamard().numpy(), hadamard_reference(16))
    r = rht_matrix().double()
    assert torch.allclose(r @ r.t(), torch.eye(16, dtype=torch.float64), atol=1e-7)
    assert set(SIGNS) == {1, -1} and len(SIGNS) == 16
    assert torch.equal(r.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("m", [64, 37], ids=["tokens-16k", "ragged"])
def test_rht_on_both_operands_leaves_the_product_unchanged(m):
    a, b = _x((24, m), 1), _x((40, m), 2)
    ta, tb = rht(a), rht(b)
    assert ta.shape[1] == tb.shape[1] == -(-m // 16) * 16
    exact = a.double() @ b.double().t()
    assert float((ta.double() @ tb.double().t() - exact).abs().max() / exact.abs().max()) < 1e-6
    # on one operand only the product is another matrix
    one = ta[:, :m].double() @ b.double().t()
    assert float((one - exact).abs().max() / exact.abs().max()) > 0.5


def test_nvfp4_wgrad_with_rht_estimates_the_true_weight_gradient():
    """The nvfp4 wgrad (both operands rotated, quantized, multiplied) is close to the
    high-precision x^T gy; rotating one operand only would give an unrelated matrix."""
    from dataclasses import replace

    recipe = RECIPES["nvfp4"]
    recipe = replace(recipe, grad_output=replace(recipe.grad_output, rounding="nearest"))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(96, 64, generator=g, requires_grad=True)
    w = (torch.randn(48, 64, generator=g) / 8).requires_grad_(True)
    gy = torch.randn(96, 48, generator=g)
    fp8_linear(x, w, None, recipe, emulate=True).backward(gy)
    true = gy.t() @ x.detach()
    assert float((w.grad - true).norm() / true.norm()) < 0.3


# ----- 16x16 weight tiles and w4a16 ----------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 64), (37, 50)], ids=["tiled", "ragged"])
def test_16x16_tiles_match_the_reference_and_quantize_w_and_w_t_alike(shape):
    w = _x(shape, 5)
    g = NVBlock(16, rows=16)
    got = fake_quantize_microscaled(w, g, E2M1)
    assert_bits(got, reference(w, g, E2M1))
    assert_bits(fake_quantize_microscaled(w.t().contiguous(), g, E2M1).t().contiguous(), got)
    mt = quantize_microscaled(w, g, E2M1)
    assert mt.block_scale.shape == (-(-shape[0] // 16), -(-shape[1] // 16))


def test_w4a16_trainer_and_rollout_see_one_fp4_weight_and_bf16_activations():
    """w4a16: y = x @ Wq^T with x as it is (BF16) and Wq the NVFP4 16x16-tile weight; grad_x =
    gy @ Wq (the same weight, so the exact gradient of the forward); grad_W = gy^T x in high
    precision; the rollout engine's forward equals the trainer's bit for bit."""
    from fp8rl.quant.rollout import convert_for_rollout

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=False)).to(torch.bfloat16)
    engine = convert_for_rollout(copy.deepcopy(model), "w4a16", emulate=True,
                                 module_filter=lambda m, fqn: True)
    trainer = convert_to_fp8(copy.deepcopy(model).float(), "w4a16", emulate=True,
                             module_filter=lambda m, fqn: True)
    x = (torch.randn(8, 64) * 2).to(torch.bfloat16).requires_grad_(True)
    y = trainer(x)
    wq = fake_quantize_microscaled(model[0].weight.detach(), NVBlock(16, rows=16), E2M1)
    assert_bits(y.float(), (x.detach().float() @ wq.t()).to(torch.bfloat16).float())
    with torch.no_grad():
        assert_bits(engine(x.detach()).float(), y.detach().float())
    gy = torch.randn(8, 48).to(torch.bfloat16)
    y.backward(gy)
    assert_bits(x.grad.float(), (gy.float() @ wq).to(torch.bfloat16).float())
    hp = (gy.float().t() @ x.detach().float()).to(torch.bfloat16).float()
    assert_bits(trainer[0].weight.grad, hp)


@pytest.mark.parametrize("change", [
    {"input": "nvfp4"}, {"grad_output": "nvfp4"}, {"wgrad": True}, {"weight": None}, {"fprop": False},
])
def test_a_weight_only_recipe_that_quantizes_more_than_the_weight_is_refused(change):
    """``weight_only`` (w4a16): only fprop's (and dgrad's) weight is quantized; anything else raises."""
    import dataclasses

    from fp8rl.quant.recipes import RECIPES

    base = RECIPES["w4a16"]
    op = base.weight
    kw = {k: (op if v == "nvfp4" else v) for k, v in change.items()}
    with pytest.raises(ValueError, match="weight_only quantizes the weight of fprop"):
        dataclasses.replace(base, name="w4a16_bad", **kw)
