"""Calibrated clipping over data-parallel ranks equals the single-process calibration, in every mode.

Each rank holds its own sequences; the plugin follows the step's plan on every rank (the window's
measured tokens of all ranks gathered into ``WindowPlan.calibrate``; the counts each rank makes
of its own tokens summed by ``StepPlan.finish(reduce_sum)``). Every rank must end with the same
bounds and the same metrics, equal to one process fed the concatenated measured tokens and
counting every token; a rank calibrating on its own tokens must not.
"""

import multiprocessing as mp
import os
import socket

import pytest
import torch

from fp8rl.backends.openrlhf.plugin.calibration import (
    Pending,
    StepTokens,
    add_measured,
    varlen_all_gather,
)
from fp8rl.rl.calibration.agreement import COUNT_KEYS
from fp8rl.rl.calibration.heldout import HELDOUT_KEYS, XFIT_KEYS
from fp8rl.rl.clipping import make_clipper

MODES = ("periodic", "pooled", "same_batch", "sampled")
COMMON = {"init_bounds": (0.8, 1.28), "upper_rule": "contribution", "low_min": 0.05}
OPTS = {"periodic": {"mode": "periodic", "period": 1, "ema": 0.5, **COMMON},
        "pooled": {"mode": "pooled", **COMMON},
        "same_batch": {"mode": "same_batch", **COMMON},
        "sampled": {"mode": "sampled", "sample_fraction": 0.5, "sample_pool": 2, **COMMON}}
N, T, WINDOWS = 24, 40, 2
COUNTED = (*COUNT_KEYS, *HELDOUT_KEYS, *XFIT_KEYS, "clip/alpha", "clip/low", "clip/high")


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    shadow = torch.exp(torch.randn(N, T, generator=g) * 0.08)
    fp8 = shadow * torch.exp(torch.randn(N, T, generator=g) * 0.15)  # FP8 noise on top
    adv = torch.randn(N, 1, generator=g).expand(N, T).clone()
    adv[::7] = 0.0  # some sequences carry no signal
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return fp8, shadow, adv, mask


def rank_windows(rank, world):
    """Rank ``rank``'s sequences (global ids) and its windows (indices into them)."""
    rows = torch.arange(N)[rank::world]
    return rows, list(torch.tensor_split(torch.arange(len(rows)), WINDOWS))


def single_windows(world):
    """The same windows in one process: window w holds every rank's window w, in rank order."""
    per = [rank_windows(r, world) for r in range(world)]
    order = torch.cat([rows for rows, _ in per])
    offsets = [sum(len(per[j][0]) for j in range(r)) for r in range(world)]
    return order, [torch.cat([per[r][1][w] + offsets[r] for r in range(world)]) for w in range(WINDOWS)]


def run_rank(mode, rank, world, gather, reduce_sum, layout=None):
    """One rank's plugin calls for two steps; ``gather(window_index, local dict) -> gathered dict``.
    Returns the bounds of every window and each step's metrics."""
    ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS[mode], seed=3)
    rows, windows = layout or rank_windows(rank, world)
    out, metrics = [], []
    for step in range(2):
        r, s, a, m = (x[rows] for x in batch(step))
        plan = ctl.begin_step(step, eligible=((a != 0) & m).any(1), rank=rank)
        for wi, part in enumerate(windows):
            w = plan.window(part)
            sink = StepTokens(shadow=True)
            p = Pending(part, w.measured, w.shadowed, s[part], rank=rank)
            add_measured(sink, p, r[part], a[part], m[part])
            g = gather((step, wi), sink.local())
            after = w.calibrate(g["ratio"], g.get("shadow"), g["adv"], torch.ones_like(g["ratio"], dtype=torch.bool),
                                seq=g.get("seq"))
            out += after.as_tuple()
            first = w.first
            sh = w.shadowed
            for rows_, use_after in ((first & sh, False), (~first & sh, True)):
                if bool(rows_.any()):
                    idx = part[rows_]
                    w.observe(r[idx], s[idx], a[idx], m[idx], after=use_after)
        got = plan.finish(reduce_sum)
        metrics.append({k: got.get(k) for k in COUNTED})
    return out, metrics


def _lockstep(mode, world):
    import threading

    barrier = threading.Barrier(world)
    store: dict = {}
    counts: dict = {}
    results = [None] * world

    def gather(rank):
        def g(key, local):
            store.setdefault(key, {})[rank] = local
            barrier.wait()
            return {k: torch.cat([store[key][j][k] for j in range(world)]) for k in local}
        return g

    def reduce_sum(rank):
        def red(t):
            key = ("sum", len(counts.setdefault(rank, [])))
            counts[rank].append(t)
            store.setdefault(key, {})[rank] = t
            barrier.wait()
            return sum(store[key][j] for j in range(world))
        return red

    def worker(rank):
        results[rank] = run_rank(mode, rank, world, gather(rank), reduce_sum(rank))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results)
    return results


def single_process(mode, world):
    """One process holding every sequence: each window's tokens are the ranks' together."""
    return run_rank(mode, 0, 1, lambda key, local: local, None, layout=single_windows(world))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 3])
def test_simulated_ranks_agree_and_count_globally(mode, world):
    got = _lockstep(mode, world)
    first_bounds, first_metrics = got[0]
    for bounds, metrics in got[1:]:
        assert bounds == first_bounds  # every rank, every window
        assert metrics == first_metrics  # summed counts, alpha, logged bounds
    if mode != "sampled":  # sampled draws per rank: a single process draws another subset
        want, want_metrics = single_process(mode, world)
        assert first_bounds == pytest.approx(want, abs=1e-6)
        for g, w in zip(first_metrics, want_metrics, strict=True):
            for k in set(COUNTED) - set(XFIT_KEYS):  # cross-fitting splits by sequence id: ids differ
                if k in ("clip/low", "clip/high", "clip/alpha"):
                    assert g[k] == pytest.approx(w[k], abs=1e-6), k
                else:
                    assert g[k] == w[k], k
    assert all(sum((m[k] or 0) for k in COUNT_KEYS) > 0 for m in first_metrics)
    # a rank calibrating on its own tokens differs: the gather matters
    alone, _ = run_rank(mode, 0, world, lambda key, local: local, None)
    assert alone != pytest.approx(first_bounds, abs=1e-6)


def test_sampled_ranks_draw_their_own_subsets():
    ctl = make_clipper("calibrated", 0.2, 0.28, **OPTS["sampled"])
    eligible = torch.ones(40, dtype=torch.bool)
    a = ctl.begin_step(0, eligible=eligible, rank=0).measured
    b = ctl.begin_step(0, eligible=eligible, rank=1).measured
    assert int(a.sum()) == int(b.sum()) == 20 and not torch.equal(a, b)


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
        def gather(key, local):
            return {k: torch.cat(varlen_all_gather(v.contiguous())) for k, v in sorted(local.items())}

        def reduce_sum(t):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t

        out.put((rank, *run_rank(mode, rank, world, gather, reduce_sum)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_gloo_ranks_equal_simulated_ranks(mode, world=2):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(i, world, port, mode, out)) for i in range(world)]
    for p in procs:
        p.start()
    got = {rank: (bounds, metrics) for rank, bounds, metrics in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    want = _lockstep(mode, world)[0]
    for rank in range(world):
        assert got[rank][0] == pytest.approx(want[0], abs=1e-6)
        assert got[rank][1] == want[1]
