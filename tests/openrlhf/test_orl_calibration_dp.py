"""Calibrated clipping over data-parallel ranks equals the single-process calibration, in every mode.

Each rank holds several micro-batches (``StepTokens``); the plugin gathers the tokens of all
ranks and runs the controller on every rank (``periodic`` / ``pooled``: one ``update`` per step
on all micro-batches; ``same_batch``: one ``update_batch`` per optimizer step). Every rank must
end with the same bounds and the same agreement counts, equal to one process fed the
concatenated tokens; a rank calibrating on its own tokens must not.
"""

import multiprocessing as mp
import os
import socket

import pytest
import torch

from fp8rl.backends.openrlhf.plugin.calibration import (
    StepTokens,
    global_update,
    global_update_batch,
    varlen_all_gather,
)
from fp8rl.rl.calibration.agreement import COUNT_KEYS
from fp8rl.rl.clipping import make_clipper

MODES = ("periodic", "pooled", "same_batch")
COMMON = {"init_bounds": (0.8, 1.28), "upper_rule": "contribution"}
OPTS = {"periodic": {"mode": "periodic", "period": 1, "ema": 0.5, **COMMON},
        "pooled": {"mode": "pooled", **COMMON},
        "same_batch": {"mode": "same_batch", **COMMON}}
MICRO = 3  # micro-batches per rank and optimizer step (same_batch) / per step (the others)


def batch(seed, B=24, T=40):
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(torch.randn(B, T, generator=g) * 0.08)
    fp8 = shadow * torch.exp(torch.randn(B, T, generator=g) * 0.15)  # FP8 noise on top
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return fp8, shadow, adv, mask


def micro_batches(seed, rank, world):
    """Rank ``rank``'s micro-batches of ``batch(seed)`` (uneven sizes over the ranks)."""
    rows = torch.arange(24)[rank::world]
    return [tuple(x[part] for x in batch(seed)) for part in torch.tensor_split(rows, MICRO)]


def local_tokens(seed, rank, world) -> dict:
    st = StepTokens()
    for r, s, a, m in micro_batches(seed, rank, world):
        st.add(r, s, a, m)
    assert st.micro_batches == MICRO
    return st.local()


def calibrate(mode, ctl, steps, local_of, all_gather):
    """Run the plugin's calls for ``steps`` (one calibration per step, or per optimizer step);
    ``local_of(seed)`` -> this rank's tokens. Returns the bounds after each call (flat) and each
    step's agreement counts (read at the end of the step, as the plugin logs them)."""
    out, counts = [], []
    for step, seeds in enumerate(steps):
        for seed in seeds:  # same_batch: one optimizer step per seed; the others: one seed per step
            if mode == "same_batch":
                out += global_update_batch(ctl, step, local_of(seed), all_gather).as_tuple()
            else:
                out += global_update(ctl, step, local_of(seed), all_gather).as_tuple()
        m = ctl.metrics(step)
        counts.append([m[k] for k in COUNT_KEYS] + [m["clip/alpha"]])
    return out, counts


def schedule(mode):
    return [[0, 1], [2, 3]] if mode == "same_batch" else [[0], [1]]


def single_process(mode):
    """One process fed the concatenation of every rank's tokens."""
    ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS[mode])
    return calibrate(mode, ctl, schedule(mode), lambda seed: local_tokens(seed, 0, 1), None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_equal_single_process(mode, world):
    locals_ = {(seed, rank): local_tokens(seed, rank, world) for seed in range(4) for rank in range(world)}
    got = []
    for rank in range(world):
        state = {}

        def local_of(seed, rank=rank, state=state):
            state["seed"] = seed
            return locals_[(seed, rank)]

        def all_gather(t, rank=rank, state=state):
            key = next(k for k, v in locals_[(state["seed"], rank)].items() if v is t)
            return [locals_[(state["seed"], j)][key] for j in range(world)]

        ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS[mode])
        got.append(calibrate(mode, ctl, schedule(mode), local_of, all_gather))
    want, want_counts = single_process(mode)
    for bounds, counts in got:
        assert bounds == pytest.approx(want, abs=1e-6)  # every rank, every calibration
        assert counts == want_counts  # global agreement counts (and alpha) on every rank
    assert all(sum(c[:6]) > 0 for c in want_counts)
    # a rank calibrating on its own tokens differs: the gather matters
    alone = make_clipper("calibrated", 0.2, 0.28, **OPTS[mode])
    mine, mine_counts = calibrate(mode, alone, schedule(mode), lambda seed: locals_[(seed, 0)], None)
    assert mine != pytest.approx(want, abs=1e-6)
    assert mine_counts != want_counts


def test_step_tokens_refuse_a_mix_of_shadowed_and_unshadowed_micro_batches():
    r, s, a, m = batch(0)
    st = StepTokens()
    st.add(r, s, a, m)
    with pytest.raises(ValueError, match="BF16 shadow ratio"):
        st.add(r, None, a, m)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, mode, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS[mode])
        bounds, counts = calibrate(mode, ctl, schedule(mode), lambda seed: local_tokens(seed, rank, world),
                                   lambda t: varlen_all_gather(t))
        out.put((rank, bounds, counts))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_gloo_ranks_equal_single_process(mode, world=2):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(i, world, port, mode, out)) for i in range(world)]
    for p in procs:
        p.start()
    got = {rank: (bounds, counts) for rank, bounds, counts in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want, want_counts = single_process(mode)
    for rank in range(world):
        assert got[rank][0] == pytest.approx(want, abs=1e-6)
        assert got[rank][1] == want_counts
