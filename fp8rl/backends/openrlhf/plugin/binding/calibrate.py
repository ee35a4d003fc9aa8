"""The calibration plan in the PPO actors: the BF16 shadow forwards and each optimizer step's
calibration, for every mode through the one plan (``fp8rl.rl.calibration.plan``; called from
``actor``).

OpenRLHF 0.11.2's ``ActorPPOTrainer.ppo_train`` runs one *step* (the controller's step: the
number of ``ppo_train`` calls so far) as ``num_mini_batches`` optimizer steps per rank, each
accumulating ``accumulated_gradient`` micro-batches (``iter_grad_accum_global_norm`` groups
them into *windows*; a micro-batch is ``micro_train_batch_size`` samples; forward, loss and
backward per micro-batch in ``training_step``, the optimizer step after the last one of a window).

**The step's plan** (:func:`begin_step`). Every replay-buffer sample of this rank gets a row id
(``ROW_KEY`` in its ``info``; the global sequence id is ``rank << 24 | row``), and the clip
method's ``begin_step`` (eligible rows: any A != 0 token; the DP rank) says which rows get a BF16
shadow (``plan.shadowed``) and which feed the estimate (``plan.measured``: all rows of a
calibration step, or ``sampled``'s seeded subset). The held-out rows (``clip.holdout_share``,
``PluginSpec.holdout_share``; issue 46) are drawn there too, from ``(spec.seed, step, rank)`` for
every clip method alike: the plan shadows them and never measures them. The BF16 log-probs of
the shadowed samples under the weights before the first update are computed first (``fp8_disabled``, no grad, in
micro-batches of the shadowed samples only; kept in the sample's ``info`` under
``SHADOW_OLD_KEY``, popped before upstream sees it).

**Held-out rows** ride the same shadow passes as the other shadowed rows; the loss counts them
against the bounds it used in an ``observe`` call of their own (``holdout=True``: ``shadow/ho_*``,
summed over the ranks by ``plan.finish``). A method or step that does not calibrate gets the
windows too when ``holdout_share > 0`` (:func:`runs_windows`: the spec decides, so every rank
takes the same path; a rank without held-out rows runs the equalizing shadow forwards), with no
sink and no calibration: its held-out rows are shadowed and counted, its training unchanged.

**Each window** (:func:`plan_windows`, wrapping upstream's window iterator when the step
calibrates or holds rows out). The window's micro-batches are put in the order the plan needs -- those holding
``w.first`` rows (measured rows whose own loss runs under the bounds in force, ``sampled``) first,
the others after, each group in upstream's order -- and the calibration runs once, on every rank
at the same point, when the FP8 ratios of all the window's measured rows are in:

- ``w.prepass`` (``same_batch``, whose bounds rule the tokens they come from): before the first
  micro-batch, a no-grad FP8 forward of each micro-batch holding measured rows (the loss's ratio:
  same weights, same inputs, same module in train mode; deterministic forwards give the same
  numbers, checked on CPU by the integration tier) and the BF16 shadow of its measured rows;
- otherwise from the losses of the micro-batches holding measured rows (the loss hands their
  tokens to the window's sink), after the last of them: before the first micro-batch without
  measured rows, or after the window (``periodic`` / ``pooled``: every micro-batch is measured,
  and the window's ``calibrate`` only collects; the step's pooled update is ``plan.finish``).

The window's measured tokens of all ranks are gathered (``plugin.calibration``) and handed to
``w.calibrate``; the loss uses ``w.bounds()`` (``before`` until the calibration, then ``after``).
The BF16 shadow ratio of a micro-batch's shadowed rows (:func:`before_micro_batch`) is one more
no-grad forward with FP8 off on those rows only, re-collated from their samples, on the weights
the micro-batch's loss sees. Deviations from the mini trainer: the unit of ``first`` is the
micro-batch, so under ``sampled`` the unmeasured rows sharing a micro-batch with measured ones
are ruled by ``before`` too (their tokens are still out of sample); the same_batch FP8 ratio comes
from a separate no-grad forward (equal to the loss's where the forward is deterministic).
Dynamic batching (``--train.dynamic_batch_enable``, which fp8rl never sets) has no windows and is
refused for the in-window modes.

Cost per step (forwards of the shadowed samples): BF16 old log-probs 1, BF16 current 1, and
``same_batch``'s FP8 pre-pass 1 more per micro-batch (``fp8rl.rl.calibration.cost``); the
held-out rows are shadowed samples like the others (a method that does not calibrate shadows
them alone: two BF16 forwards of ``holdout_share`` of its samples per step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from fp8rl.backends.openrlhf.plugin.binding.common import SHADOW_OLD_KEY, UpstreamChangedError
from fp8rl.backends.openrlhf.plugin.calibration import (
    Pending,
    StepTokens,
    add_measured,
    gather_calibration,
    log_ratio_to_ratio,
)

#: Key of a replay-buffer sample's row id (this rank's index) in its ``info``.
ROW_KEY = "_fp8rl_row"


def _device() -> torch.device:
    """Where the step's tensors live (the rank's GPU; the CPU in the CPU job)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def counting(counters: dict | None, phase: str):
    """``plugin.kernels.count_matmuls`` into ``counters[phase]`` (a no-op without counters)."""
    import contextlib

    if counters is None:
        return contextlib.nullcontext()
    from fp8rl.backends.openrlhf.plugin.kernels import count_matmuls

    return count_matmuls(counters[phase])


def actor_log_probs(trainer, experience, *, fp8: bool) -> torch.Tensor:
    """Log-probs ``[B, T]`` of ``experience`` under the current weights, no grad; ``fp8=False``:
    the BF16 shadow (``fp8_disabled``), ``fp8=True``: the FP8 model as the loss's forward runs it."""
    import contextlib

    from fp8rl.quant.convert import fp8_disabled

    counter = getattr(trainer, "_fp8rl_kernels", None)  # diagnostic dumps only (plugin.kernels)
    off = contextlib.nullcontext() if fp8 else fp8_disabled(trainer.actor.model)
    if counter is not None:
        counter["rows"]["fp8_prepass" if fp8 else "shadow"] += int(experience.sequences.shape[0])
    with torch.no_grad(), off, counting(counter, "train" if fp8 else "shadow"):
        return trainer.actor(experience.sequences, experience.action_mask, attention_mask=experience.attention_mask,
                             ring_attn_group=trainer.strategy.ring_attn_group)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _reduce_max(trainer, n: int) -> int:
    """The largest ``n`` over the DP ranks (``trainer._fp8rl_reduce_max``; this rank's without one)."""
    fn = getattr(trainer, "_fp8rl_reduce_max", None)
    return int(n) if fn is None else int(fn(int(n)))


def _bf16_log_probs(trainer, items: list) -> list[torch.Tensor]:
    """BF16 log-probs of ``items`` (samples), each cut to its own response length, on the CPU.

    In chunks of ``micro_train_batch_size``; every DP rank runs the same number of forwards (the
    largest count of any rank; a rank with fewer runs the rest on a sample of its own and drops
    them), because ZeRO-3 gathers the parameters inside each forward, collectively."""
    out: list[torch.Tensor] = []
    size = max(1, int(trainer.micro_train_batch_size))
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    spare = [trainer._fp8rl_items[0]] if trainer._fp8rl_items else []
    for i in range(_reduce_max(trainer, len(chunks))):
        chunk = chunks[i] if i < len(chunks) else spare
        if not chunk:
            raise RuntimeError("this rank has no sample to run the equalizing shadow forward on")
        batch = trainer.replay_buffer.collate_fn(chunk)
        batch.to_device(_device())
        lp = actor_log_probs(trainer, batch, fp8=False).to("cpu")
        if i < len(chunks):
            out.extend(lp[j, : item.action_mask.shape[0]] for j, item in enumerate(chunk))
    return out


def begin_step(trainer, step: int) -> None:
    """The step's plan, the row ids, and the BF16 old log-probs of the shadowed samples."""
    clipper = trainer.actor_loss_fn.clipper
    items = trainer.replay_buffer.items
    eligible = torch.tensor([bool(((it.advantages != 0) & it.action_mask.bool()).any()) for it in items],
                            dtype=torch.bool)
    spec = trainer.actor_loss_fn.spec
    plan = clipper.begin_step(step, eligible=eligible, rank=_rank(), holdout_share=spec.holdout_share,
                              seed=int(spec.seed or 0))
    if plan.in_window and trainer.args.train.dynamic_batch_enable:
        raise ValueError(f"calibration mode {clipper.mode} calibrates each optimizer step and needs OpenRLHF's "
                         "fixed optimizer-step windows; --train.dynamic_batch_enable has none: turn dynamic "
                         "batching off or use clip.calibration_mode=pooled")
    trainer._fp8rl_plan = plan
    trainer._fp8rl_items = items
    counter = getattr(trainer, "_fp8rl_kernels", None)
    if counter is not None:  # the step's rows, for the smoke job's tests (plugin.kernels)
        counter["plan"].update({k: torch.nonzero(v, as_tuple=False).flatten().tolist()
                                for k, v in (("eligible", eligible), ("measured", plan.measured),
                                             ("shadowed", plan.shadowed), ("holdout", plan.holdout))})
        counter["plan"]["rank"], counter["plan"]["n"] = _rank(), len(items)
    trainer._fp8rl_shadow_old = {}
    for i, it in enumerate(items):
        it.info[ROW_KEY] = i
    loss = trainer.actor_loss_fn
    loss.window = loss.pending = loss.sink = None
    rows = torch.nonzero(plan.shadowed, as_tuple=False).flatten().tolist()
    if _reduce_max(trainer, len(rows)) > 0:  # every rank runs the pass when any rank has a shadowed row
        t0 = time.perf_counter()
        lps = _bf16_log_probs(trainer, [items[r] for r in rows])
        trainer._fp8rl_shadow_old = dict(zip(rows, lps, strict=True))
        trainer._fp8rl_metrics.shadow_s += time.perf_counter() - t0


def runs_windows(trainer, plan) -> bool:
    """Whether the step runs :func:`plan_windows`: it calibrates, or the spec holds rows out (the
    same answer on every rank, whatever rows each drew)."""
    return plan is not None and (plan.calibrates or trainer.actor_loss_fn.spec.holdout_share > 0)


def _rows(experience) -> torch.Tensor:
    rows = experience.info.get(ROW_KEY)
    if rows is None:
        raise RuntimeError("a micro-batch reached the loss without the plugin's row ids: its samples are not this "
                           "step's replay buffer (upstream's batching changed?)")
    return torch.as_tensor(rows, dtype=torch.long).reshape(-1)


def _shadow_ratio(experience, rows: torch.Tensor, shadowed: torch.Tensor, now: dict, old: dict) -> torch.Tensor:
    """BF16 ratio ``[B, T]`` of the shadowed rows (ones elsewhere) from their BF16 log-probs now and
    before the step (per row, each its own response length)."""
    mask = experience.action_mask
    out = torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
    for j in torch.nonzero(shadowed, as_tuple=False).flatten().tolist():
        r = int(rows[j])
        if r not in old or r not in now:
            raise RuntimeError("a shadowed row has no BF16 old or current log-probs: the shadow passes missed it")
        n = min(len(now[r]), len(old[r]), mask.shape[1])
        out[j, :n] = log_ratio_to_ratio(now[r][:n], old[r][:n]).to(out.device, out.dtype)
    return out


def before_micro_batch(trainer, experience) -> None:
    """``training_step``, before upstream's forward: hand the loss this micro-batch's plan view
    (prepared by :func:`plan_windows`) and drop the plugin's keys from what upstream sees."""
    experience.info.pop(ROW_KEY, None)
    experience.info.pop(SHADOW_OLD_KEY, None)
    trainer.actor_loss_fn.pending = getattr(experience, "_fp8rl_pending", None)


def end_step(trainer, step: int, reduce_sum=None) -> dict:
    """After upstream's ``ppo_train`` (every rank): the plan's pooled update and metrics."""
    loss = trainer.actor_loss_fn
    plan, trainer._fp8rl_plan = trainer._fp8rl_plan, None
    loss.window = loss.pending = loss.sink = None
    return plan.finish(reduce_sum) if plan is not None else {}


def abort_step(trainer) -> None:
    loss = trainer.actor_loss_fn
    loss.window = loss.pending = loss.sink = None
    trainer._fp8rl_plan = None
    for it in getattr(trainer, "_fp8rl_items", None) or []:
        it.info.pop(ROW_KEY, None)
        it.info.pop(SHADOW_OLD_KEY, None)
    trainer._fp8rl_items = None
    trainer._fp8rl_shadow_old = None


def _calibrate(trainer, window) -> None:
    """The window's calibration on the measured tokens of all ranks (a collective)."""
    loss = trainer.actor_loss_fn
    g = gather_calibration(loss.sink.local(_device()), loss.all_gather)
    window.calibrate(g["ratio"], g.get("shadow"), g["adv"], torch.ones_like(g["ratio"], dtype=torch.bool),
                     seq=g.get("seq"))
    loss.sink = None


def plan_windows(trainer, upstream: Iterator, accumulated_gradient: int) -> Iterator:
    """Wrap upstream's ``iter_grad_accum_global_norm`` output: per optimizer-step window, the
    shadow, the order and the calibration point the plan asks for (module docstring).

    At each window's start (every rank at the same point): the BF16 current log-probs of the
    window's shadowed samples (the weights its losses see: the optimizer steps after the window);
    with ``w.prepass`` the FP8 ratios of its micro-batches and the calibration; then the
    micro-batches holding ``w.first`` rows, the others after; the calibration runs before the
    ``K``-th micro-batch, ``K`` the largest count over ranks of micro-batches up to the last one
    holding measured rows (so every rank runs its collectives -- the gather here, upstream's
    per-micro-batch all-reduce, ZeRO-3's parameter gathers -- in the same order), or after the
    window. Upstream yields windows of ``accumulated_gradient`` micro-batches (a trailing partial
    one when the data is not a multiple), each sharing one ``loss_batch_info`` dict; a window whose
    micro-batches do not share it means upstream's grouping changed, and raises."""
    gas = max(int(accumulated_gradient), 1)
    plan = trainer._fp8rl_plan
    loss = trainer.actor_loss_fn
    device = _device()
    while True:
        window = []
        for item in upstream:
            window.append(item)
            if len(window) == gas:
                break
        if not window:
            return
        if len({id(info) for _, info in window}) != 1:
            raise UpstreamChangedError("iter_grad_accum_global_norm yielded an optimizer-step window whose "
                                       "micro-batches do not share one loss_batch_info: its grouping changed")
        rows = [_rows(exp) for exp, _ in window]
        w = plan.window(torch.cat(rows))
        loss.window = w  # a step that does not calibrate (held-out rows only) has no sink and never calibrates
        loss.sink = StepTokens(shadow=plan.clipper.measures(plan.step)) if plan.calibrates else None
        offsets = _offsets(rows)
        first = [bool(w.first[o:o + len(r)].any()) for o, r in zip(offsets, rows, strict=True)]
        measured = [bool(w.measured[o:o + len(r)].any()) for o, r in zip(offsets, rows, strict=True)]
        shadow_rows = torch.cat(rows)[w.shadowed].tolist()
        now: dict = {}
        if _reduce_max(trainer, len(shadow_rows)) > 0:
            t0 = time.perf_counter()
            now = dict(zip(shadow_rows, _bf16_log_probs(trainer, [trainer._fp8rl_items[r] for r in shadow_rows]),
                           strict=True))
            trainer._fp8rl_metrics.shadow_s += time.perf_counter() - t0
        for (exp, _), r, o in zip(window, rows, offsets, strict=True):
            sh = w.shadowed[o:o + len(r)]
            shadow = _shadow_ratio(exp, r, sh, now, trainer._fp8rl_shadow_old) if bool(sh.any()) else None
            exp._fp8rl_pending = Pending(r, w.measured[o:o + len(r)], sh, shadow, rank=_rank(),
                                         holdout=w.holdout[o:o + len(r)])
        if w.prepass:
            for exp, _ in window:
                exp.to_device(device)
                ratio = log_ratio_to_ratio(actor_log_probs(trainer, exp, fp8=True), exp.action_log_probs)
                add_measured(loss.sink, exp._fp8rl_pending, ratio, exp.advantages, exp.action_mask)
            _calibrate(trainer, w)
        order = [i for i in range(len(window)) if first[i]] + [i for i in range(len(window)) if not first[i]]
        last = max((k for k, i in enumerate(order) if measured[i]), default=-1)
        point = _reduce_max(trainer, last + 1) if loss.sink is not None else -1
        for k, i in enumerate(order):
            if loss.sink is not None and k == point:
                _calibrate(trainer, w)
            yield window[i]
        if loss.sink is not None:
            _calibrate(trainer, w)
        loss.window = None


def _offsets(rows: list[torch.Tensor]) -> list[int]:
    out, o = [], 0
    for r in rows:
        out.append(o)
        o += len(r)
    return out
