"""``SharedInput``: layers that read one input quantize it once, with unchanged numbers.

Reference: the same layers called one by one (``forward``). Checked bit for bit (outputs and
every gradient), and by counting the quantizations that ran on the shared input: a third of
the separate calls' for three layers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8rl.quant.linear as linear_mod
import fp8rl.quant.rollout as rollout_mod
from fp8rl.quant import RECIPES, Fp8Linear, convert_to_fp8, fp8_disabled, get_recipe
from fp8rl.quant.linear import SharedInput
from fp8rl.quant.rollout import Fp8InferenceLinear

EMULATED = [n for n in RECIPES if n != "bf16"]
#: recipes that quantize their input (w4a16 keeps activations in high precision: nothing to share)
QUANTIZED_INPUT = [n for n in EMULATED if not RECIPES[n].weight_only]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _layers(cls, recipe, n=3, k=96, out=(64, 32, 32), dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    mods = []
    for i in range(n):
        lin = nn.Linear(k, out[i], bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out[i], k, generator=g) / k**0.5)
        mods.append(cls.from_linear(lin.to(dtype), recipe, emulate=True))
    return mods


class _Counter:
    """Counts the fake-quantizations whose input is a view of ``x``."""

    def __init__(self, monkeypatch, module, x: torch.Tensor) -> None:
        self.n, self.ptr, real = 0, x.untyped_storage().data_ptr(), module.fake_quantize

        def counted(t, *a, **k):
            self.n += t.untyped_storage().data_ptr() == self.ptr
            return real(t, *a, **k)

        monkeypatch.setattr(module, "fake_quantize", counted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", QUANTIZED_INPUT)
def test_training_layers_share_the_input_bit_for_bit(monkeypatch, name, dtype):
    from fp8rl.quant.rounding import QuantizerState

    recipe = get_recipe(name)
    mods = _layers(Fp8Linear, recipe, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    x0 = (torch.randn(4, 40, 96, generator=g) * 3).to(dtype)
    gys = [torch.randn(4, 40, m.out_features, generator=g).to(dtype) for m in mods]

    def run(shared: SharedInput | None):
        x = x0.clone().requires_grad_(True)
        state = QuantizerState(7)  # nvfp4's stochastic gradients: the same draws in both runs
        for m in mods:
            m.quant_state = state
        counter = _Counter(monkeypatch, linear_mod, x)
        ys = [m(x) if shared is None else m.forward_with(x, shared) for m in mods]
        sum((y * gy).sum() for y, gy in zip(ys, gys, strict=True)).backward()
        grads = [x.grad] + [m.weight.grad.clone() for m in mods]
        for m in mods:
            m.weight.grad = None
        return ys, grads, counter.n

    ys, grads, n_alone = run(None)
    ys_s, grads_s, n_shared = run(SharedInput())
    for a, b in zip(ys + grads, ys_s + grads_s, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert n_alone > 0 and n_shared * 3 == n_alone  # once per GEMM role, not once per layer


@pytest.mark.parametrize("name", QUANTIZED_INPUT)
def test_rollout_layers_share_the_input_bit_for_bit(monkeypatch, name):
    mods = _layers(Fp8InferenceLinear, get_recipe(name))
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(3)) * 2
    counter = _Counter(monkeypatch, rollout_mod, x)
    alone = [m(x) for m in mods]
    n_alone, counter.n = counter.n, 0
    shared = SharedInput()
    together = [m.forward_with(x, shared) for m in mods]
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert (n_alone, counter.n) == (3, 1)


@pytest.mark.parametrize("cls", [Fp8Linear, Fp8InferenceLinear])
def test_a_new_input_is_quantized_afresh(cls):
    """A second input of the same shape (the next decode step) is not served the first's operands."""
    mod = _layers(cls, get_recipe("rowwise"), n=1)[0]
    shared = SharedInput()
    g = torch.Generator().manual_seed(4)
    x1, x2 = torch.randn(8, 96, generator=g), torch.randn(8, 96, generator=g)
    mod.forward_with(x1, shared)
    with torch.no_grad():
        assert torch.equal(mod.forward_with(x2, shared), mod(x2))
        assert not torch.equal(mod.forward_with(x2, shared), mod(x1))


def test_lean_model_shares_only_where_the_layers_forward_as_is():
    """``_fwd_shared`` binds FP8 layers to one ``SharedInput``, but never bypasses a switched-off
    FP8 layer (the BF16 shadow's ``fp8_disabled``) or a layer with hooks."""
    from fp8rl.backends.mini.qwen3 import _fwd_shared

    parent = convert_to_fp8(nn.ModuleList([nn.Linear(96, 32) for _ in range(3)]), "tensorwise", emulate=True,
                            impl="fp8rl", module_filter=lambda m, fqn: isinstance(m, nn.Linear))
    mods = list(parent)
    assert all(type(m) is Fp8Linear for m in mods)
    fwds = _fwd_shared(mods, lambda m: m.forward)
    assert all(f.func.__func__ is Fp8Linear.forward_with for f in fwds)
    assert len({id(f.keywords["shared"]) for f in fwds}) == 1
    with fp8_disabled(parent):
        fwds = _fwd_shared(mods, lambda m: m.forward)
        assert all(f == m.forward and "forward" in vars(m) for f, m in zip(fwds, mods, strict=True))
    handle = mods[0].register_forward_hook(lambda *a: None)
    fwds = _fwd_shared(mods, lambda m: m if m._forward_hooks else m.forward)
    assert fwds[0] is mods[0] and not any(hasattr(f, "keywords") for f in fwds)
    handle.remove()
