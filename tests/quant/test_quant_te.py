"""Transformer Engine implementation (fp8rl.quant.te), against a stand-in ``transformer_engine``.

The stand-in is injected into ``sys.modules`` per test. Its recipe classes accept exactly the
constructor fields of Transformer Engine 2.20.2's ``transformer_engine/common/recipe/__init__.py``
(read from that release's source) and record them; its ``Linear`` stores weights and computes
``F.linear`` like ``nn.Linear``, refuses token counts TE refuses, and records the recipe of the
autocast it runs in; its ``autocast`` records entry and exit. The gpu-marked test at the end
builds the same recipes with the real package, so a moved upstream field fails loudly there.
"""

from __future__ import annotations

import copy
import enum
import importlib.util
import sys
import types
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8rl.config import Fp8Config
from fp8rl.quant import (
    E5M2,
    RECIPES,
    TE_KINDS,
    Fp8UnsupportedError,
    OperandConfig,
    PerBlock,
    PerRow,
    PerTensor,
    convert_to_fp8,
    default_impl,
    fp8_disabled,
    fp8_layers,
    get_recipe,
    resolve_impl,
    te_recipe_kind,
    te_skipped_layers,
    to_te_recipe,
)
from fp8rl.quant import convert as convert_mod
from fp8rl.quant import te as te_mod
from fp8rl.quant.audit import build_tiny_qwen3
from fp8rl.quant.linear import Fp8Linear
from fp8rl.registry import RegistryError

# ---------------------------------------------------------------- the stand-in package

# Constructor fields of TE 2.20.2's recipe dataclasses (QParams members are class attributes
# there, not fields, so they are not accepted by the constructors).
TE_FIELDS = {
    "DelayedScaling": {"margin", "fp8_format", "amax_history_len", "amax_compute_algo",
                       "scaling_factor_compute_algo", "reduce_amax", "fp8_dpa", "fp8_mha",
                       "backward_override"},
    "Float8CurrentScaling": {"use_power_2_scales", "fp8_format", "fp8_gemm_fprop", "fp8_gemm_dgrad",
                             "fp8_gemm_wgrad", "fp8_dpa", "fp8_mha", "backward_override"},
    "MXFP8BlockScaling": {"margin", "fp8_format", "fp8_dpa", "fp8_mha", "backward_override"},
    "Float8BlockScaling": {"use_f32_scales", "fp8_format", "x_block_scaling_dim",
                           "w_block_scaling_dim", "grad_block_scaling_dim", "fp8_gemm_fprop",
                           "fp8_gemm_dgrad", "fp8_gemm_wgrad", "fp8_dpa", "fp8_mha",
                           "backward_override"},
}


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


class _FakeRecipe:
    def __init__(self, **kwargs):
        unknown = set(kwargs) - TE_FIELDS[type(self).__name__]
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected fields {sorted(unknown)}")
        self.kwargs = kwargs


def _recipe_module() -> types.ModuleType:
    mod = types.ModuleType("transformer_engine.common.recipe")
    mod.Format, mod.QParams = Format, QParams
    for name in TE_FIELDS:
        setattr(mod, name, type(name, (_FakeRecipe,), {}))
    return mod


def _pytorch_module(recipe_mod, *, with_autocast=True, available=None) -> types.ModuleType:
    te = types.ModuleType("transformer_engine.pytorch")
    te.events = []  # ("enter"|"exit", recipe)
    te.active = []  # recipe stack
    te.calls = []  # (recipe, token count) per Linear forward

    class autocast:
        def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
            assert enabled
            self.recipe = recipe

        def __enter__(self):
            te.events.append(("enter", self.recipe))
            te.active.append(self.recipe)
            return self

        def __exit__(self, *exc):
            te.active.pop()
            te.events.append(("exit", self.recipe))

    def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None):
        return autocast(enabled=enabled, recipe=fp8_recipe)

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kw):
            super().__init__()
            dtype = params_dtype or torch.get_default_dtype()
            self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
            self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            else:
                self.bias = torch.Tensor().to(dtype=dtype, device=device)  # as TE does

        def forward(self, inp, is_first_microbatch=None):
            recipe = te.active[-1] if te.active else None
            if recipe is not None:  # TE refuses FP8 GEMMs on unaligned shapes
                align = 32 if type(recipe).__name__ == "MXFP8BlockScaling" else 16
                tokens = inp.numel() // inp.shape[-1]
                if tokens % align or inp.shape[-1] % 16:
                    raise ValueError(f"FP8 execution requires aligned dims, got {list(inp.shape)}")
                te.calls.append((recipe, tokens))
            return F.linear(inp, self.weight, self.bias if self.use_bias else None)

        def get_extra_state(self):  # TE stores FP8 metadata here
            return torch.empty(0, dtype=torch.uint8)

        def set_extra_state(self, state):
            pass

    te.Linear = Linear
    if with_autocast:
        te.autocast = autocast
    te.fp8_autocast = fp8_autocast
    for fn, result in (available or {}).items():
        setattr(te, fn, lambda return_reason=False, _r=result: _r if return_reason else _r[0])
    return te


def _install(monkeypatch, **kw) -> types.ModuleType:
    recipe_mod = _recipe_module()
    te = _pytorch_module(recipe_mod, **kw)
    pkg, common = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
    pkg.pytorch, pkg.common, common.recipe = te, common, recipe_mod
    for name, mod in (("transformer_engine", pkg), ("transformer_engine.pytorch", te),
                      ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    te.recipe_mod = recipe_mod
    return te


@pytest.fixture
def fake_te(monkeypatch):
    """Stand-in TE, and convert_to_fp8 told the model sits on an sm100 GPU (every TE recipe)."""
    monkeypatch.setattr(convert_mod, "_hardware", lambda model, device=None: ("cuda", (10, 0)))
    return _install(monkeypatch)


class Toy(nn.Module):
    """Linears TE takes (32->64, 64->32 without bias), one it cannot (40->64), and an LM head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.odd = nn.Linear(40, 64)
        self.lm_head = nn.Linear(32, 50)

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        return self.lm_head(h + self.down(self.odd(torch.cat([h, h[..., :8]], -1))))


# ---------------------------------------------------------------- recipe mapping

# (our recipe, TE class, expected constructor fields, expected power-of-two QParams or None)
MAPPING = [
    (get_recipe("tensorwise"), "Float8CurrentScaling",
     {"fp8_format": Format.HYBRID, "use_power_2_scales": False}, False),
    (get_recipe("tensorwise", hybrid=False), "Float8CurrentScaling",
     {"fp8_format": Format.E4M3, "use_power_2_scales": False}, False),
    (get_recipe("tensorwise_delayed"), "DelayedScaling",
     {"fp8_format": Format.HYBRID, "amax_history_len": 1024, "amax_compute_algo": "max",
      "margin": 0, "reduce_amax": False}, None),
    (get_recipe("tensorwise_delayed", amax_history_len=16, amax_compute_algo="most_recent"),
     "DelayedScaling", {"fp8_format": Format.HYBRID, "amax_history_len": 16,
                        "amax_compute_algo": "most_recent", "margin": 0, "reduce_amax": False}, None),
    (get_recipe("blockwise"), "Float8BlockScaling",
     {"fp8_format": Format.E4M3, "x_block_scaling_dim": 1, "w_block_scaling_dim": 2,
      "grad_block_scaling_dim": 1, "use_f32_scales": True}, False),
    (get_recipe("blockwise", hybrid=True), "Float8BlockScaling",
     {"fp8_format": Format.HYBRID, "x_block_scaling_dim": 1, "w_block_scaling_dim": 2,
      "grad_block_scaling_dim": 1, "use_f32_scales": True}, False),
    (replace(RECIPES["blockwise"], name="blockwise_pow2", pow2_scales=True), "Float8BlockScaling",
     {"fp8_format": Format.E4M3, "x_block_scaling_dim": 1, "w_block_scaling_dim": 2,
      "grad_block_scaling_dim": 1, "use_f32_scales": False}, True),
    (get_recipe("mxfp8"), "MXFP8BlockScaling", {"fp8_format": Format.E4M3, "margin": 0}, None),
]


@pytest.mark.parametrize(("recipe", "cls", "fields", "pow2"), MAPPING, ids=[m[0].name for m in MAPPING])
def test_te_recipe_mapping(recipe, cls, fields, pow2):
    out = to_te_recipe(recipe, _recipe_module())
    assert type(out).__name__ == cls
    # explicit where TE would read an environment variable; attention stays in BF16
    want = {**fields, "fp8_dpa": False, "fp8_mha": False, "backward_override": None}
    assert out.kwargs == want
    if pow2 is None:
        assert not hasattr(out, "fp8_quant_fwd_inp")
    else:
        for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            assert getattr(out, attr) == QParams(power_2_scale=pow2, amax_epsilon=0.0)


def test_te_kinds_and_refusals():
    assert [te_recipe_kind(n) for n in ("tensorwise", "tensorwise_delayed", "blockwise", "mxfp8")] == [
        "current", "delayed", "block", "mxfp8"]
    for name in ("rowwise", "rowwise_with_gw_hp"):
        with pytest.raises(ValueError, match="impl='torchao'"):
            te_recipe_kind(name)
    with pytest.raises(ValueError, match="nothing for Transformer Engine"):
        te_recipe_kind("bf16")
    e5 = replace(RECIPES["tensorwise"], name="e5fwd", input=OperandConfig(PerTensor(), E5M2))
    with pytest.raises(ValueError, match="forward is E4M3 only"):
        te_recipe_kind(e5)
    two_d = replace(RECIPES["blockwise"], name="b2d", input=OperandConfig(PerBlock(128, 128)))
    with pytest.raises(ValueError, match="128x128 x 128x128"):
        te_recipe_kind(two_d)
    odd = replace(RECIPES["blockwise"], name="b64", input=OperandConfig(PerBlock(1, 64)))
    with pytest.raises(ValueError, match="no Transformer Engine equivalent"):
        te_recipe_kind(odd)


def test_delayed_recipe_options_validate():
    d = RECIPES["tensorwise_delayed"]
    assert d.scaling == "delayed" and d.hybrid and d.impl == "transformer_engine"
    assert "amax history 1024, max" in d.describe()
    assert get_recipe(d, amax_history_len=1024) is d
    assert get_recipe(d, amax_history_len=16).name == "tensorwise_delayed_h16"
    with pytest.raises(ValueError, match="delayed-scaling recipes only"):
        get_recipe("tensorwise", amax_history_len=16)
    with pytest.raises(ValueError, match="amax_history_len must be an int >= 1"):
        get_recipe(d, amax_history_len=0)
    with pytest.raises(ValueError, match="amax_compute_algo must be one of"):
        get_recipe(d, amax_compute_algo="mean")
    with pytest.raises(ValueError, match="must be PerTensor"):
        replace(d, name="rd", input=OperandConfig(PerRow()))
    with pytest.raises(ValueError, match="only apply to delayed scaling"):
        replace(RECIPES["tensorwise"], name="t", amax_history_len=16)


# ---------------------------------------------------------------- default implementation


def test_default_impl_per_recipe():
    want = {  # recipe: (emulate=False, emulate=True)
        "tensorwise": ("torchao", "fp8rl"),
        "rowwise": ("torchao", "fp8rl"),
        "rowwise_with_gw_hp": ("torchao", "fp8rl"),
        "blockwise": ("transformer_engine", "fp8rl"),
        "mxfp8": ("transformer_engine", "fp8rl"),
        "tensorwise_delayed": ("transformer_engine", None),
        "nvfp4": ("fp8rl", "fp8rl"),
        "nvfp4_rn": ("fp8rl", "fp8rl"),
        "w4a16": ("fp8rl", "fp8rl"),
        "mxfp4": ("fp8rl", "fp8rl"),
        "mxfp6": ("fp8rl", "fp8rl"),
    }
    assert set(want) == set(RECIPES) - {"bf16"}
    for name, (hw, emu) in want.items():
        assert default_impl(name, emulate=False) == resolve_impl(name, "auto") == hw
        if emu is None:
            with pytest.raises(ValueError, match=r"no emulation.*fp8\.emulate=false"):
                default_impl(name, emulate=True)
        else:
            assert default_impl(name, emulate=True) == resolve_impl(name, None, emulate=True) == emu
    assert resolve_impl("bf16", "transformer_engine") == "none"


def test_resolve_impl_refuses_what_an_implementation_cannot_run():
    with pytest.raises(ValueError, match="torchao float8 training supports per-tensor and per-row"):
        resolve_impl("blockwise", "torchao")
    with pytest.raises(ValueError, match=r"delayed scaling.*impl='transformer_engine'"):
        resolve_impl("tensorwise_delayed", "fp8rl", emulate=True)
    with pytest.raises(ValueError, match="has no emulation"):
        resolve_impl("blockwise", "transformer_engine", emulate=True)
    with pytest.raises(ValueError, match="impl='torchao'"):
        resolve_impl("rowwise", "transformer_engine")
    with pytest.raises(RegistryError, match="valid names are: auto, fp8rl, torchao, transformer_engine"):
        resolve_impl("tensorwise", "te")
    assert resolve_impl("blockwise", "fp8rl", emulate=True) == "fp8rl"
    assert resolve_impl("tensorwise", "transformer_engine") == "transformer_engine"


def test_fp8_config_impl_field():
    assert Fp8Config().impl == "auto"
    Fp8Config(name="blockwise", rollout_recipe="blockwise", trainer_recipe="blockwise", impl="transformer_engine")
    Fp8Config(name="tensorwise_delayed", rollout_recipe="tensorwise", trainer_recipe="tensorwise_delayed")
    bad = [
        (dict(trainer_recipe="tensorwise_delayed", emulate=True), "no emulation"),
        (dict(trainer_recipe="blockwise", impl="torchao"), "fp8.impl='torchao' cannot run"),
        (dict(trainer_recipe="blockwise", impl="transformer_engine", emulate=True), "has no emulation"),
        (dict(impl="tei"), "valid names are: auto"),
        (dict(rollout_recipe="tensorwise_delayed"), "fp8.rollout_recipe=tensorwise"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            Fp8Config(**kw)


# ---------------------------------------------------------------- hardware and installation


def test_check_te_supported_rules():
    ok = [("tensorwise", (8, 9)), ("tensorwise_delayed", (9, 0)), ("blockwise", (9, 0)),
          ("blockwise", (10, 0)), ("mxfp8", (10, 0)), ("mxfp8", (10, 3))]
    for name, cap in ok:
        te_mod.check_te_supported(name, device_type="cuda", capability=cap)
    bad = [("tensorwise", "cuda", (8, 6), r"capability >= 8\.9"),
           ("blockwise", "cuda", (8, 9), r"capability >= 9\.0"),
           ("mxfp8", "cuda", (9, 0), r"10\.x"), ("mxfp8", "cuda", (12, 0), r"10\.x"),
           ("blockwise", "cpu", None, "CUDA GPUs only.*emulate=True")]
    for name, dev, cap, msg in bad:
        with pytest.raises(Fp8UnsupportedError, match=msg):
            te_mod.check_te_supported(name, device_type=dev, capability=cap)
    with pytest.raises(Fp8UnsupportedError, match="no emulation"):
        te_mod.check_te_supported("blockwise", device_type="cuda", capability=(9, 0), emulate=True)
    assert {k: v.align for k, v in TE_KINDS.items()} == {"current": 16, "delayed": 16, "block": 16, "mxfp8": 32}


def test_missing_te_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    model = Toy()
    for kw in ({"impl": "transformer_engine"}, {}):  # explicit, and blockwise's default
        with pytest.raises(Fp8UnsupportedError,
                           match=r"cannot be imported.*pip install 'fp8rl\[cluster\]'.*fp8\.emulate=true"):
            convert_to_fp8(model, "blockwise", **kw)
    assert not fp8_layers(model)
    # emulation was asked for: our linear, no TE needed
    emu = convert_to_fp8(Toy(), "blockwise", emulate=True)
    assert isinstance(emu.up, Fp8Linear)


def test_te_runtime_check_reason_is_reported(monkeypatch):
    monkeypatch.setattr(convert_mod, "_hardware", lambda model, device=None: ("cuda", (9, 0)))
    _install(monkeypatch, available={"is_fp8_block_scaling_available": (False, "needs CUDA >= 12.9")})
    with pytest.raises(Fp8UnsupportedError, match=r"needs CUDA >= 12\.9.*emulate=True"):
        convert_to_fp8(Toy(), "blockwise")


def test_convert_checks_the_hardware_of_the_model(monkeypatch):
    _install(monkeypatch)  # TE importable, model on the CPU
    with pytest.raises(Fp8UnsupportedError, match="CUDA GPUs only"):
        convert_to_fp8(Toy(), "blockwise", impl="transformer_engine")
    monkeypatch.setattr(convert_mod, "_hardware", lambda model, device=None: ("cuda", (9, 0)))
    with pytest.raises(Fp8UnsupportedError, match=r"10\.x"):
        convert_to_fp8(Toy(), "mxfp8")


# ---------------------------------------------------------------- module swap


@pytest.mark.parametrize("name", ["tensorwise", "blockwise", "mxfp8", "tensorwise_delayed"])
def test_swap_shares_weights_and_skips_filtered_and_unfit_layers(fake_te, name):
    ref = Toy()
    model = copy.deepcopy(ref)
    params = {n: p for n, p in model.named_parameters()}
    convert_to_fp8(model, name, impl="transformer_engine")
    te_cls = te_mod.te_linear_class(fake_te)
    assert isinstance(model.up, te_cls) and isinstance(model.down, te_cls)
    assert type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear
    assert set(te_skipped_layers(model)) == {"odd"}  # 40 input features
    assert "multiples of" in te_skipped_layers(model)["odd"]
    # the same Parameter objects (no copy) with the same values; same state-dict keys
    for n, p in model.named_parameters():
        assert p is params[n]
    assert model.up.fp8_recipe is get_recipe(name) and not model.down.use_bias
    assert model.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    assert model.up.te_recipe.kwargs == to_te_recipe(name, fake_te.recipe_mod).kwargs
    with pytest.raises(ValueError, match="already has FP8 layers"):
        convert_to_fp8(model, name, impl="transformer_engine")


def test_mxfp8_skips_layers_not_multiple_of_32(fake_te):
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32), nn.Linear(64, 32))
    convert_to_fp8(model, "mxfp8", module_filter=lambda m, fqn: isinstance(m, nn.Linear))
    assert set(te_skipped_layers(model)) == {"0", "1"}
    assert type(model[2]).__name__ == "TeFp8Linear"
    convert_to_fp8(m := nn.Sequential(nn.Linear(32, 48)), "blockwise",
                   module_filter=lambda m, fqn: isinstance(m, nn.Linear))
    assert te_skipped_layers(m) == {} and type(m[0]).__name__ == "TeFp8Linear"


def test_autocast_wraps_forward_and_is_absent_under_fp8_disabled(fake_te):
    ref = Toy()
    model = convert_to_fp8(copy.deepcopy(ref), "blockwise")  # default with emulate=False: TE
    x = torch.randn(2, 8, 32)  # 16 tokens: no padding
    y = model(x)
    # three converted-layer calls (up, down, down), each inside its own autocast with its recipe
    assert [e for e, _ in fake_te.events] == ["enter", "exit"] * 3
    assert all(r is model.up.te_recipe for _, r in fake_te.events)
    assert not fake_te.active
    assert [t for _, t in fake_te.calls] == [16, 16, 16]
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)  # the stand-in computes F.linear
    y.square().mean().backward()
    assert model.up.weight.grad is not None and model.down.weight.grad is not None
    fake_te.events.clear()
    with torch.no_grad(), fp8_disabled(model):
        y_hp = model(x)
        assert "forward" in model.up.__dict__
    assert fake_te.events == []  # no autocast: the BF16 shadow pass
    assert torch.equal(y_hp, ref(x))
    assert "forward" not in model.up.__dict__
    model(x)
    assert len(fake_te.events) == 6  # FP8 again after the block


def test_token_padding_is_exact(fake_te):
    lin = nn.Linear(32, 64)
    conv = convert_to_fp8(copy.deepcopy(lin), "mxfp8", module_filter=lambda m, fqn: True)
    x = torch.randn(3, 5, 32, requires_grad=True)  # 15 tokens -> padded to 32
    y = conv(x)
    assert y.shape == (3, 5, 64) and [t for _, t in fake_te.calls] == [32]
    torch.testing.assert_close(y, lin(x), rtol=1e-6, atol=1e-6)
    y.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    lin(x).sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(conv.weight.grad, lin.weight.grad, rtol=1e-5, atol=1e-5)


def test_tiny_qwen3_converts_and_matches_under_stand_in(fake_te):
    ref = build_tiny_qwen3(layers=1)
    model = convert_to_fp8(copy.deepcopy(ref), "tensorwise", impl="transformer_engine")
    names = [n for n, m in model.named_modules() if hasattr(m, "fp8_recipe")]
    assert len(names) == 7 and not any("lm_head" in n for n in names)  # q k v o gate up down
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert len(fake_te.calls) == 7


def test_older_te_fp8_autocast_is_used_when_autocast_is_absent(monkeypatch):
    monkeypatch.setattr(convert_mod, "_hardware", lambda model, device=None: ("cuda", (9, 0)))
    te = _install(monkeypatch, with_autocast=False)
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)), "tensorwise", impl="transformer_engine",
                           module_filter=lambda m, fqn: True)
    model(torch.randn(16, 32))
    assert [e for e, _ in te.events] == ["enter", "exit"]


# ---------------------------------------------------------------- real Transformer Engine (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available(),
                    reason="needs a CUDA GPU with transformer_engine installed")
def test_real_te_accepts_the_mapped_recipes():
    _, recipe_mod = te_mod.import_te()
    for name in ("tensorwise", "tensorwise_delayed", "blockwise", "mxfp8"):
        out = to_te_recipe(name, recipe_mod)
        assert type(out).__name__ == TE_KINDS[te_recipe_kind(name)].te_class
    assert to_te_recipe("blockwise", recipe_mod).fp8_quant_fwd_inp.power_2_scale is False
    cap = torch.cuda.get_device_capability()
    if cap < (9, 0):
        pytest.skip("blockwise needs sm90+")
    lin = nn.Linear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16)
    conv = convert_to_fp8(copy.deepcopy(lin), "blockwise", module_filter=lambda m, fqn: True)
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)  # padded to 208 tokens
    y = conv(x)
    emu = convert_to_fp8(copy.deepcopy(lin), "blockwise", emulate=True, module_filter=lambda m, fqn: True)
    y_emu = emu(x)
    rel = float((y.float() - y_emu.float()).abs().max() / y_emu.float().abs().max())
    assert rel < 2e-2, rel
    with torch.no_grad(), fp8_disabled(conv):
        assert torch.equal(conv(x), lin(x))


def test_device_argument_checks_the_training_device(monkeypatch):
    """A plugin converts before DeepSpeed moves the model: the check uses the GPU it will train on."""
    te = _install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = convert_to_fp8(Toy(), "blockwise", impl="auto", device="cuda")  # parameters on the CPU
    assert type(model.up).__name__ == "TeFp8Linear" and model.up.weight.device.type == "cpu"
    model(torch.randn(16, 32))
    assert len(te.calls) == 3
    with pytest.raises(Fp8UnsupportedError, match=r"10\.x"):
        convert_to_fp8(Toy(), "mxfp8", device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an sm90+ GPU with transformer_engine installed")
def test_te_blockwise_matches_emulation_on_a_small_qwen3():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_te_blockwise.py"
    spec = importlib.util.spec_from_file_location("gpu_te_blockwise", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--check-only"])
    assert res["check"]["passed"], res["check"]


def test_openrlhf_plugin_converts_with_the_configured_impl(monkeypatch):
    """Issue item 4: the plugin's actor conversion goes through convert_to_fp8 with fp8.impl."""
    from fp8rl.backends.openrlhf.plugin import PluginSpec, convert_trainer_model

    te = _install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cfg = types.SimpleNamespace(
        steps=10, seed=0, clip=types.SimpleNamespace(method="vanilla", clipper_options=dict,
                                                     score_centering_options=lambda: None, holdout_share=0.0),
        algorithm=types.SimpleNamespace(eps_low=0.2, eps_high=0.28),
        openrlhf=types.SimpleNamespace(device="cuda", dump_loss_inputs=False, engine_max_num_seqs=None),
        fp8=Fp8Config(name="tensorwise", rollout_recipe="tensorwise", trainer_recipe="tensorwise",
                      impl="transformer_engine"))
    spec = PluginSpec.from_json(PluginSpec.from_config(cfg).to_json())
    assert spec.trainer_impl == "transformer_engine"
    model = convert_trainer_model(Toy(), spec)
    assert type(model.up).__name__ == "TeFp8Linear"  # tensorwise's default would be torchao
    model(torch.randn(16, 32))
    assert [e for e, _ in te.events] == ["enter", "exit"] * 3
    auto = PluginSpec(trainer_recipe="tensorwise")
    assert type(convert_trainer_model(Toy(), auto).up).__name__ == "Float8Linear"  # auto: torchao
