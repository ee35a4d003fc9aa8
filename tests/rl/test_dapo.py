"""DAPO dynamic-sampling filter and soft overlong penalty vs their definitions."""

import pytest
import torch

from fp8rl.rl.dapo import dynamic_sampling_filter, overlong_penalty


def dapo_eq13(length, max_len, cache_len):
    """DAPO Eq. 13, case by case."""
    if length <= max_len - cache_len:
        return 0.0
    if length <= max_len:
        return ((max_len - cache_len) - length) / cache_len
    return -1.0


@pytest.mark.parametrize("max_len, cache_len", [(20, 4), (20480, 4096), (10, 10), (7, 1)])
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_matches_formula_at_every_length(max_len, cache_len, factor):
    start = max_len - cache_len
    probe = sorted({0, 1, start - 1, start, start + 1, (start + max_len) // 2, max_len - 1, max_len,
                    max_len + 1, 2 * max_len} - {-1})
    got = overlong_penalty(torch.tensor(probe), max_len=max_len, cache_len=cache_len, factor=factor)
    want = torch.tensor([factor * dapo_eq13(L, max_len, cache_len) for L in probe])
    torch.testing.assert_close(got, want)


def test_overlong_boundaries():
    pen = overlong_penalty(torch.tensor([16, 17, 18, 20, 21]), max_len=20, cache_len=4)
    assert pen.tolist() == [0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(torch.tensor([20, 21]), max_len=20, cache_len=4, factor=0.3).tolist() == pytest.approx([-0.3, -0.3])
    assert overlong_penalty(torch.tensor([17.0]), max_len=20, cache_len=4).dtype == torch.float32


def test_overlong_bad_input():
    L = torch.tensor([3])
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(L, max_len=10, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(L, max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(L, max_len=10, cache_len=2, factor=-1.0)
    with pytest.raises(ValueError, match=r"\[N\]"):
        overlong_penalty(L[None], max_len=10, cache_len=2)


def test_group_filter_keeps_mixed_groups_only():
    ids = torch.tensor([7, 3, 7, 3, 11, 11, 50, 7, 50, 3])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.5, 0.0])
    # group 7: all 1 (drop), 3: all 0 (drop), 11: mixed (keep), 50: all 0.5 (drop)
    f = dynamic_sampling_filter(rewards, ids)
    assert f.keep.tolist() == [i in (4, 5) for i in range(10)]
    assert f.indices.tolist() == [4, 5]
    assert (f.num_groups, f.num_kept) == (4, 1)
    assert f.metrics() == {"dapo/kept_group_frac": 0.25}


def test_group_filter_vs_loop():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-5, 30, (200,), generator=g)
    rewards = torch.randint(0, 2, (200,), generator=g).float()
    f = dynamic_sampling_filter(rewards, ids)
    groups = {int(i) for i in ids}
    varied = {k for k in groups if len({float(r) for r, i in zip(rewards, ids, strict=True) if int(i) == k}) > 1}
    assert f.keep.tolist() == [int(i) in varied for i in ids]
    assert f.kept_group_frac == pytest.approx(len(varied) / len(groups))
    assert 0 < len(varied) < len(groups)


def test_group_filter_singleton_is_dropped_and_bad_input_raises():
    f = dynamic_sampling_filter(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
    assert f.keep.tolist() == [True, True, False]
    with pytest.raises(ValueError, match="NaN"):
        dynamic_sampling_filter(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="integer"):
        dynamic_sampling_filter(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        dynamic_sampling_filter(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="empty"):
        dynamic_sampling_filter(torch.zeros(0), torch.zeros(0, dtype=torch.long))
