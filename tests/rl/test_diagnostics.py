"""Diagnostics: chunked entropy vs the direct formula, masked reductions, clip table, quantiles."""

import math

import numpy as np
import pytest
import torch

import fp8rl.rl.diagnostics as diag
from fp8rl.rl.diagnostics import (
    clip_counts,
    clip_table,
    fractions_from_counts,
    masked_mean,
    masked_quantiles,
    masked_sum,
    ratio_quantiles,
    token_entropy,
)


def direct_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 10_000])
def test_entropy_matches_direct_formula(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g) * 4
    got = token_entropy(logits, chunk_size=chunk_size)
    assert got.shape == (3, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), direct_entropy(logits), rtol=1e-5, atol=1e-5)


def test_entropy_on_bf16_logits_and_extremes():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 9, 300, generator=g) * 8).bfloat16()
    logits[0, 0] = 0.0  # uniform: entropy log V
    logits[0, 1, 5] = 1e4  # one-hot: entropy 0
    got = token_entropy(logits, chunk_size=4)
    torch.testing.assert_close(got.double(), direct_entropy(logits.float()), rtol=1e-5, atol=1e-5)
    assert float(got[0, 0]) == pytest.approx(math.log(300), rel=1e-6)
    assert float(got[0, 1]) == pytest.approx(0.0, abs=1e-6)


def test_entropy_temperature_and_noncontiguous():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(8, 5, 40, generator=g)
    logits = base.transpose(0, 1)  # [5, 8, 40], not contiguous
    assert not logits.is_contiguous()
    got = token_entropy(logits, temperature=0.7, chunk_size=3)
    torch.testing.assert_close(got.double(), direct_entropy(logits, 0.7), rtol=1e-5, atol=1e-5)


def test_entropy_converts_only_chunks_to_float32(monkeypatch):
    """No [B, T, V] float32 copy: each float32 conversion covers at most chunk_size rows."""
    seen = []
    real = diag._entropy_rows

    def spy(chunk, temperature):
        seen.append((tuple(chunk.shape), chunk.dtype))
        return real(chunk, temperature)

    monkeypatch.setattr(diag, "_entropy_rows", spy)
    for logits in (torch.randn(4, 10, 33).bfloat16(), torch.randn(10, 4, 33).bfloat16().transpose(0, 1)):
        seen.clear()
        token_entropy(logits, chunk_size=6)
        assert seen and all(shape[0] <= 6 and shape[1] == 33 and dtype == torch.bfloat16 for shape, dtype in seen)
        assert sum(shape[0] for shape, _ in seen) == 40


def test_entropy_is_detached_and_validates():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    assert not token_entropy(logits).requires_grad
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(logits, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_entropy(logits, chunk_size=0)
    with pytest.raises(TypeError, match="floating"):
        token_entropy(torch.ones(2, 3, dtype=torch.long))


def test_masked_reductions():
    x = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, float("inf")]])
    m = torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert float(masked_sum(x, m)) == 13.0
    assert float(masked_mean(x, m)) == 13.0 / 4
    assert masked_mean(x, m, dim=-1).tolist() == [2.0, 4.5]
    assert masked_sum(x, m.bool(), dim=0).tolist() == [5.0, 5.0, 3.0]
    assert math.isnan(float(masked_mean(x, torch.zeros(2, 3))))
    assert masked_mean(x.bfloat16(), m).dtype == torch.float32
    with pytest.raises(ValueError, match="0/1"):
        masked_mean(x, m * 2)


def loop_table(ratio, adv, mask, low, high):
    c = dict(tok=0, neg=0, pos=0, neg_low=0, neg_high=0, pos_low=0, pos_high=0)
    for r, a, keep in zip(ratio.flatten().tolist(), adv.flatten().tolist(), mask.flatten().tolist(), strict=True):
        if not keep:
            continue
        c["tok"] += 1
        if a != 0:
            s = "neg" if a < 0 else "pos"
            c[s] += 1
            c[f"{s}_low"] += r < low
            c[f"{s}_high"] += r > high
    return c


def test_clip_table_vs_loop_and_shard_reduction():
    g = torch.Generator().manual_seed(3)
    ratio = torch.exp(torch.randn(6, 20, generator=g) * 0.3)
    adv = torch.randn(6, 20, generator=g)
    adv[:, ::7] = 0.0
    mask = torch.rand(6, 20, generator=g) > 0.3
    c = loop_table(ratio, adv, mask, 0.8, 1.28)
    t = {k: float(v) for k, v in clip_table(ratio, adv, mask, low=0.8, high=1.28, prefix="shadow/").items()}
    assert t["shadow/clipfrac"] == pytest.approx((c["neg_low"] + c["pos_high"]) / c["tok"])
    for cell in ("neg_low", "neg_high", "pos_low", "pos_high"):
        assert t[f"shadow/clipfrac_{cell}"] == pytest.approx(c[cell] / c[cell[:3]])
    # counts summed over two "ranks" give the whole-batch table
    parts = [clip_counts(ratio[s], adv[s], mask[s], low=0.8, high=1.28) for s in (slice(0, 2), slice(2, None))]
    summed = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    whole = clip_table(ratio, adv, mask, low=0.8, high=1.28)
    assert all(torch.equal(fractions_from_counts(summed)[k], whole[k]) for k in whole)


@pytest.mark.parametrize("n", [1, 2, 5, 101, 4000])
def test_masked_quantiles_match_torch_quantile(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n + 7, generator=g)
    mask = torch.ones(n + 7, dtype=torch.bool)
    mask[torch.randperm(n + 7, generator=g)[:7]] = False
    qs = [0.0, 0.01, 0.25, 0.5, 0.99, 1.0]
    torch.testing.assert_close(masked_quantiles(x, mask, qs), torch.quantile(x[mask], torch.tensor(qs)))


def test_ratio_quantiles_select_negative_advantages():
    ratio = torch.tensor([[0.5, 0.9, 1.1, 3.0, 7.0]])
    adv = torch.tensor([[-1.0, -1.0, -2.0, 1.0, 0.0]])
    q = ratio_quantiles(ratio, adv, torch.ones(1, 5))
    assert float(q["actor/ratio_neg_q50"]) == pytest.approx(0.9)
    assert float(q["actor/ratio_neg_q01"]) == pytest.approx(0.5 + 0.02 * 0.4)
    assert all(math.isnan(float(v)) for v in ratio_quantiles(ratio, torch.ones_like(adv), torch.ones(1, 5)).values())
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        masked_quantiles(ratio, torch.ones(1, 5), [1.5])


@pytest.mark.slow
def test_masked_quantiles_beyond_torch_quantile_limit():
    """torch.quantile refuses > 2**24 elements; ours does not, and agrees with numpy."""
    n = (1 << 24) + 1001
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    with pytest.raises(RuntimeError):
        torch.quantile(x, 0.5)
    got = masked_quantiles(x, mask, [0.01, 0.5, 0.99]).double().numpy()
    want = np.quantile(x.double().numpy(), [0.01, 0.5, 0.99])
    np.testing.assert_allclose(got, want, rtol=1e-6)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_entropy_peak_memory_on_gpu_stays_below_a_float32_copy():
    """On CUDA the peak extra memory is a few chunks, far below one [B, T, V] float32 copy."""
    logits = torch.randn(2, 2048, 32000, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = token_entropy(logits, chunk_size=256)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    fp32_copy = logits.numel() * 4
    assert extra < 0.25 * fp32_copy, (extra, fp32_copy)
    ref = direct_entropy(logits[:, :64].float().cpu())
    torch.testing.assert_close(got[:, :64].double().cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_quantiles_and_clip_table_on_gpu_match_cpu():
    g = torch.Generator().manual_seed(0)
    ratio = torch.exp(torch.randn(64, 512, generator=g) * 0.2)
    adv = torch.randn(64, 512, generator=g)
    mask = torch.rand(64, 512, generator=g) > 0.2
    cpu = {**clip_table(ratio, adv, mask, low=0.8, high=1.28), **ratio_quantiles(ratio, adv, mask)}
    gpu = {**clip_table(ratio.cuda(), adv.cuda(), mask.cuda(), low=0.8, high=1.28),
           **ratio_quantiles(ratio.cuda(), adv.cuda(), mask.cuda())}
    for k, v in cpu.items():
        torch.testing.assert_close(gpu[k].cpu(), v, rtol=1e-6, atol=1e-7)


def test_ratio_std_is_numpys_std_of_r_minus_1_over_response_tokens_summed_over_micro_batches():
    """``actor/ratio_std`` (issue 48's dose): the population std of r - 1 over the masked tokens,
    the same from sums added over micro-batches (and ranks) as from the whole step; padding,
    whatever its ratio, never counts; NaN without tokens."""
    import numpy as np

    from fp8rl.rl.diagnostics import ratio_dev_sums, ratio_std_from_sums

    g = torch.Generator().manual_seed(3)
    ratio = torch.exp(0.05 * torch.randn(6, 9, generator=g))
    mask = torch.rand(6, 9, generator=g) > 0.3
    ratio_padded = torch.where(mask, ratio, torch.full_like(ratio, 50.0))  # padding must not count
    want = np.std((ratio[mask] - 1).double().numpy())
    whole = ratio_std_from_sums(ratio_dev_sums(ratio_padded, mask))["actor/ratio_std"]
    assert float(whole) == pytest.approx(want, rel=1e-12)
    parts = [ratio_dev_sums(ratio_padded[i:i + 2], mask[i:i + 2]) for i in range(0, 6, 2)]
    summed = {k: sum(p[k] for p in parts) for k in parts[0]}
    assert float(ratio_std_from_sums(summed)["actor/ratio_std"]) == pytest.approx(want, rel=1e-12)
    assert float(ratio_std_from_sums(ratio_dev_sums(ratio, torch.ones_like(mask)))["actor/ratio_std"]) != \
        pytest.approx(want, rel=1e-3)  # the mask matters
    empty = ratio_dev_sums(ratio, torch.zeros_like(mask))
    assert math.isnan(float(ratio_std_from_sums(empty)["actor/ratio_std"]))
