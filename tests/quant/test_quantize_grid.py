"""``round_to_fp8_grid``: FP8 rounding in float32 arithmetic, bit for bit PyTorch's cast.

Reference: ``y.to(fmt.dtype).to(torch.float32)`` (PyTorch's own conversion). The default tier
checks every place where rounding can go wrong: each FP8 value, each midpoint between two
neighbours (the ties, which go to the even code), one float32 ulp either side of those, the
subnormal range, both zeros and a million random values; the slow tier checks every float32 in
the range the dynamic-scale path can produce.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl.quant.fake import round_to_fp8_grid
from fp8rl.quant.formats import E4M3, E5M2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _reference(y: torch.Tensor, fmt) -> torch.Tensor:
    return y.to(fmt.dtype).to(torch.float32)


def _critical_points(fmt) -> torch.Tensor:
    """Every finite non-negative FP8 value, the midpoints between neighbours, and one float32
    ulp either side of each; both signs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).to(torch.float32)
    vals = codes[torch.isfinite(codes) & (codes >= 0)].unique()  # sorted, +0 first
    mids = (vals[:-1].double() + vals[1:].double()) / 2  # exact in float32: one bit more
    pts = torch.cat([vals, mids.float()])
    near = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, float("inf"))),
                      torch.nextafter(pts, torch.zeros_like(pts))])
    near = near[near <= fmt.max]
    return torch.cat([near, -near])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_every_value_tie_and_neighbour_rounds_as_the_cast(fmt):
    y = _critical_points(fmt)
    assert torch.equal(_bits(round_to_fp8_grid(y, fmt)), _bits(_reference(y, fmt)))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_random_values_subnormals_and_signed_zeros(fmt):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(1_000_000, generator=g) * torch.exp2(torch.randint(-20, 9, (1_000_000,), generator=g).float())
    wide = wide.clamp(-fmt.max, fmt.max)
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30]).float()  # float32 subnormals too
    sub = torch.linspace(-2.0 ** fmt.min_normal_exp, 2.0 ** fmt.min_normal_exp, 100_001)
    for y in (wide, tiny, sub):
        got, want = round_to_fp8_grid(y, fmt), _reference(y, fmt)
        assert torch.equal(_bits(got), _bits(want))
    assert torch.signbit(round_to_fp8_grid(torch.tensor([-1e-30]), fmt)).item()  # -0.0, as the cast


def test_layout_is_kept_and_input_untouched():
    y = (torch.randn(64, 48) * 100).t()  # transposed: not contiguous
    before = y.clone()
    out = round_to_fp8_grid(y)
    assert out.stride() == y.stride()
    assert torch.equal(_bits(out), _bits(_reference(y, E4M3)))
    assert torch.equal(y, before)


def test_non_float32_input_is_refused():
    with pytest.raises(TypeError, match="needs float32"):
        round_to_fp8_grid(torch.ones(4, dtype=torch.bfloat16))


@pytest.mark.slow  # every float32 up to fmt.max * (1 + 2^-20), both signs: about a minute per format
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_every_float32_in_range_rounds_as_the_cast(fmt):
    top = torch.tensor([fmt.max * (1 + 2.0 ** -20)], dtype=torch.float32).view(torch.int32).item()
    chunk = 1 << 24
    for start in range(0, top + 1, chunk):
        bits = torch.arange(start, min(start + chunk, top + 1), dtype=torch.int64).to(torch.int32)
        for sign in (0, -(2 ** 31)):
            y = (bits | sign).view(torch.float32)
            bad = _bits(round_to_fp8_grid(y, fmt)) != _bits(_reference(y, fmt))
            assert not bad.any(), f"{fmt.name}: {y[bad][:5].tolist()} round differently from the cast"
