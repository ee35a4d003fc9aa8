"""Calibrated clipping over data-parallel ranks equals the single-process calibration."""

import multiprocessing as mp
import os
import socket

import pytest
import torch

from fp8rl.backends.openrlhf.plugin.loss import calibration_tokens, global_update, varlen_all_gather
from fp8rl.rl.clipping import make_clipper

OPTS = {"mode": "periodic", "period": 1, "ema": 0.0, "init_bounds": (0.8, 1.28), "upper_rule": "contribution"}


def batch(seed, B=24, T=40):
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(torch.randn(B, T, generator=g) * 0.08)
    fp8 = shadow * torch.exp(torch.randn(B, T, generator=g) * 0.15)  # FP8 noise on top
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return fp8, shadow, adv, mask


def single_process(seed):
    ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS)
    r, s, a, m = batch(seed)
    ctl.update(0, ratio=r, shadow_ratio=s, advantages=a, mask=m)
    return ctl


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_simulated_ranks_equal_single_process(world, seed):
    r, s, a, m = batch(seed)
    shards = [calibration_tokens(*(x[i::world] for x in (r, s, a, m))) for i in range(world)]  # uneven sizes
    controllers = []
    for rank in range(world):
        def all_gather(t, rank=rank):
            key = next(k for k, v in shards[rank].items() if v is t)
            return [shards[j][key] for j in range(world)]
        ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS)
        global_update(ctl, 0, shards[rank], all_gather)
        controllers.append(ctl)
    want = single_process(seed)
    for ctl in controllers:
        assert ctl.bounds(0).as_tuple() == pytest.approx(want.bounds(0).as_tuple(), abs=1e-6)
        assert ctl.metrics(0)["clip/alpha"] == want.metrics(0)["clip/alpha"]
    # the local-only calibration differs: the global gather matters
    local = make_clipper("calibrated", 0.2, 0.28, **OPTS)
    global_update(local, 0, shards[0], None)
    assert local.bounds(0).as_tuple() != want.bounds(0).as_tuple()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, seed, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        r, s, a, m = batch(seed)
        local = calibration_tokens(*(x[rank::world] for x in (r, s, a, m)))
        ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS)
        global_update(ctl, 0, local, lambda t: varlen_all_gather(t))
        out.put((rank, ctl.bounds(0).as_tuple()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_equal_single_process(world):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(i, world, port, 0, out)) for i in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want = single_process(0).bounds(0).as_tuple()
    for rank in range(world):
        assert got[rank] == pytest.approx(want, abs=1e-6)
