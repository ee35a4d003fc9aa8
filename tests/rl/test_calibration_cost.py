"""The cost model of the calibration modes (``fp8rl.rl.calibration.cost``) against hand counts,
a slow loop over every GEMM of a tiny model, the paper-scale configs and docs/benchmarks.md."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from fp8rl.rl.calibration import cost as C

REPO = Path(__file__).resolve().parents[2]
TINY = C.ModelShape("tiny", layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10)
#: 8 sequences of 2 prompt + 1 response tokens, 2 optimizer steps: 4 sequences per optimizer step.
TINY_STEP = C.StepShape(sequences=8, num_mini_batches=2, prompt_len=2, response_len=1, response_cap=4)
COLS = ("flops_ckpt", "flops_no_ckpt", "time_ckpt", "time_no_ckpt")


def slow_forward_flops(m: C.ModelShape, L: int) -> dict[str, int]:
    """Every GEMM of one forward of one sequence, enumerated: 2 x in x out per token and linear,
    2 x head_dim per (query, key) pair and head for QK^T and again for AV (causal)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    linears = [(m.hidden, q), (m.hidden, kv), (m.hidden, kv), (q, m.hidden),
               (m.hidden, m.intermediate), (m.hidden, m.intermediate), (m.intermediate, m.hidden)]
    out = {"linear": 0, "head": 0, "attention": 0}
    for _layer in range(m.layers):
        for i in range(L):
            out["linear"] += sum(2 * a * b for a, b in linears)
            for _h in range(m.heads):
                for _j in range(i + 1):
                    out["attention"] += 2 * m.head_dim + 2 * m.head_dim
    out["head"] = L * 2 * m.hidden * m.vocab
    return out


def test_tiny_model_flops_by_hand_and_by_loop():
    # by hand: a layer's linears per token: q 8x8, k 8x4, v 8x4, o 8x8 = 192 MACs; gate, up 8x16,
    # down 16x8 = 384 MACs; 2 layers x 576 x 2 = 2304 FLOPs. Head 2 x 8 x 10 = 160. Attention
    # over L = 3: 6 causal pairs x 2 heads x 2 layers x (4 + 4) MACs x 2 = 384.
    assert TINY.linear_flops(1) == 2304 and TINY.head_flops(1) == 160 and TINY.attention_flops(3) == 384
    for L in (1, 3, 7):
        slow = slow_forward_flops(TINY, L)
        assert TINY.linear_flops(L) == slow["linear"]
        assert TINY.head_flops(L) == slow["head"]
        assert TINY.attention_flops(L) == slow["attention"]
    gqa = C.ModelShape("gqa", layers=3, hidden=12, intermediate=20, heads=6, kv_heads=2, head_dim=2, vocab=7)
    slow = slow_forward_flops(gqa, 5)
    assert (gqa.linear_flops(5), gqa.head_flops(5), gqa.attention_flops(5)) == (slow["linear"], slow["head"],
                                                                                 slow["attention"])


def test_tiny_step_and_same_batch_by_hand():
    # one sequence of L = 3: FP8 forward = linears 6912 (FP8) + head 480 + attention 384 (BF16).
    # FP8 step per sequence: old log-probs + training forward + backward = 4 forwards, + the
    # recomputed layers (6912 FP8 + 384 BF16) with checkpointing; 4 sequences per optimizer step.
    on = C.step_work(TINY, TINY_STEP, checkpointing=True)
    assert (on.fp8, on.bf16) == (4 * (4 * 6912 + 6912), 4 * (4 * 864 + 384))
    off = C.step_work(TINY, TINY_STEP, checkpointing=False)
    assert (off.fp8, off.bf16) == (4 * 4 * 6912, 4 * 4 * 864)
    assert on.time == on.fp8 + 2 * on.bf16  # BF16 GEMMs at half the FP8 rate
    # same_batch: 2 BF16 forwards (7776 BF16 each) + 1 FP8 forward, per sequence
    sb = C.extra_work("same_batch", TINY, TINY_STEP)
    assert (sb.fp8, sb.bf16) == (4 * 6912, 4 * (2 * 7776 + 864))
    r = C.overhead("same_batch", TINY, TINY_STEP)
    assert r["flops_ckpt"] == pytest.approx(93312 / 153600)
    assert r["time_ckpt"] == pytest.approx((27648 + 2 * 65664) / (138240 + 2 * 15360))
    assert r["flops_no_ckpt"] == pytest.approx(0.75)  # 3 forwards over 4, whatever the shapes
    # the BF16 arm's step: every GEMM in BF16
    bf = C.step_work(TINY, TINY_STEP, checkpointing=False, fp8=False)
    assert (bf.fp8, bf.bf16) == (0, off.flops)
    assert r["vs_bf16_no_ckpt"] == pytest.approx((off + sb).time / bf.time)


def test_a_kl_reference_adds_a_bf16_forward():
    import dataclasses

    kl = dataclasses.replace(TINY_STEP, kl_reference=True)
    diff = C.step_work(TINY, kl, checkpointing=True) + C.step_work(TINY, TINY_STEP, checkpointing=True) * -1
    assert (diff.fp8, diff.bf16) == (0, 4 * 7776)


def test_modes_order_and_scale_alike_on_every_column():
    for model, step in [(TINY, TINY_STEP), *[(m, s) for _, m, s in C.paper_shapes(_configs()).values()]]:
        p = C.overhead("periodic", model, step)
        s = C.overhead("sampled", model, step, share=0.125)
        po = C.overhead("pooled", model, step)
        sb = C.overhead("same_batch", model, step)
        whole = C.overhead("sampled", model, step, share=1.0)
        for c in COLS:
            assert 0 < p[c] < s[c] < po[c] < sb[c], (model.name, c)
            assert whole[c] == pytest.approx(po[c])  # sampling every sequence is pooled's work
            assert p[c] == pytest.approx(po[c] / step.period)  # periodic: pooled's work every K steps
        assert C.overhead("sampled", model, step, share=0.0)["time_ckpt"] == 0


def test_same_batch_at_paper_shapes():
    """The issue's claim, in the model's numbers: three no-grad forwards are 60-61% of the FP8 step's
    FLOPs with checkpointing, 75% without, and cost more GEMM time than FP8 saves over BF16."""
    for slot, (_algo, model, step) in C.paper_shapes(_configs()).items():
        r = C.overhead("same_batch", model, step)
        assert 0.60 < r["flops_ckpt"] < 0.61 and r["flops_no_ckpt"] == pytest.approx(0.75), slot
        assert 0.85 < r["time_ckpt"] < r["time_no_ckpt"] < 1.2, slot
        assert r["vs_bf16_ckpt"] > 1 and r["vs_bf16_no_ckpt"] > 1, slot  # slower than the BF16 arm


def test_sampled_at_max_share_stays_within_the_budget_in_every_column():
    for slot, (_, model, step) in C.paper_shapes(_configs()).items():
        s = C.max_share(0.05, model=model, step=step)
        assert 0.05 < s < 0.07, (slot, s)
        r = C.overhead("sampled", model, step, share=s)
        assert max(r[c] for c in COLS) == pytest.approx(0.05)  # tight: one column binds
        assert all(r[c] <= 0.05 + 1e-12 for c in COLS)
        over = C.overhead("sampled", model, step, share=s * 1.01)
        assert max(over[c] for c in COLS) > 0.05
    assert C.max_share(1.0, model=TINY, step=TINY_STEP) == 1.0  # capped at every sequence


def test_paper_steps_come_from_the_dry_run_configs():
    configs = _configs()
    shapes = C.paper_shapes(configs)
    assert set(shapes) == set(C.PAPER_CELLS) == set(C.MODELS)
    for slot, (algo, model, step) in shapes.items():
        cfg = configs[(algo, slot)]
        assert step.sequences == cfg.prompts_per_step * cfg.algorithm.n_samples_per_prompt == 1024
        assert step.num_mini_batches == cfg.num_mini_batches == 4
        assert step.response_cap == cfg.max_response_len == {"grpo": 16384, "dapo": 20480}[algo]
        assert step.response_len == cfg.max_response_len / 2 and step.prompt_len == C.DEFAULT_PROMPT_LEN
        assert step.logprob_micro_batch == cfg.logprob_micro_batch
        assert step.micro_batch == cfg.openrlhf.micro_train_batch_size
        assert step.kl_reference is False and cfg.algorithm.kl_coef == 0  # no reference model at paper scale
        assert step.period == cfg.clip.period
        assert cfg.openrlhf.gradient_checkpointing  # the "ckpt on" columns are the configured ones
        assert model is C.MODELS[slot]


def test_model_shapes_are_the_paper_scale_models():
    from fp8rl.backends.openrlhf.config import DEFAULT_MODELS

    assert {s: m.name for s, m in C.MODELS.items()} == {s: hf.split("/")[1] for s, hf in DEFAULT_MODELS.items()}
    for m in C.MODELS.values():
        assert m.heads * m.head_dim == m.hidden  # all three: 128-wide heads filling the hidden size


def test_every_registered_calibration_mode_is_priced():
    from fp8rl.rl.calibration import CALIBRATION_MODES

    assert set(CALIBRATION_MODES) <= set(C.MODES)


def test_step_shape_from_a_config_reads_its_fields():
    cfg = SimpleNamespace(prompts_per_step=3, num_mini_batches=2, max_response_len=100, logprob_micro_batch=7,
                          algorithm=SimpleNamespace(n_samples_per_prompt=5, kl_coef=0.01),
                          clip=SimpleNamespace(period=4), openrlhf=SimpleNamespace(micro_train_batch_size=2))
    s = C.StepShape.from_config(cfg, prompt_len=10, response_share=0.25)
    assert (s.sequences, s.num_mini_batches, s.response_len, s.seq_len, s.kl_reference, s.period, s.micro_batch,
            s.logprob_micro_batch) == (15, 2, 25, 35, True, 4, 2, 7)
    del cfg.openrlhf  # a mini RunConfig has no openrlhf block
    assert C.StepShape.from_config(cfg).micro_batch == 1


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="unknown calibration mode 'fancy'"):
        C.extra_work("fancy", TINY, TINY_STEP)
    with pytest.raises(ValueError, match="'sampled' needs share"):
        C.overhead("sampled", TINY, TINY_STEP)
    with pytest.raises(ValueError, match="'sampled' needs share"):
        C.overhead("sampled", TINY, TINY_STEP, share=1.5)
    with pytest.raises(ValueError, match="share is the sampled and windowed modes' argument"):
        C.overhead("pooled", TINY, TINY_STEP, share=0.5)
    for b in (0, 1.5, True, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            C.max_share(b, model=TINY, step=TINY_STEP)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        C.ModelShape("x", layers=1, hidden=8, intermediate=8, heads=3, kv_heads=2, head_dim=4, vocab=4)
    with pytest.raises(ValueError, match=r"ModelShape\.layers must be an integer >= 1"):
        C.ModelShape("x", layers=0, hidden=8, intermediate=8, heads=2, kv_heads=1, head_dim=4, vocab=4)
    with pytest.raises(ValueError, match=r"response_len must be in \[0, response_cap=4\]"):
        C.StepShape(sequences=8, num_mini_batches=2, prompt_len=2, response_len=5, response_cap=4)
    with pytest.raises(ValueError, match="prompt_len"):
        C.StepShape(sequences=8, num_mini_batches=2, prompt_len=0, response_len=1, response_cap=4)
    with pytest.raises(ValueError, match=r"StepShape\.period"):
        C.StepShape(sequences=8, num_mini_batches=2, prompt_len=2, response_len=1, response_cap=4, period=0)
    with pytest.raises(ValueError, match="response_share"):
        C.StepShape.from_config(SimpleNamespace(), response_share=2)


def test_docs_show_the_functions_tables():
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- cost tables: python -m experiments\.calibration_cost -->\n(.*?)\n<!-- end of cost tables -->",
                  text, re.S)
    assert m, "docs/benchmarks.md lacks the generated cost tables (between their comment markers)"
    configs = _configs()
    want = C.markdown(C.cost_table(C.paper_shapes(configs)), C.sensitivity_table(configs))
    assert m.group(1) == want, "docs/benchmarks.md's cost tables differ from python -m experiments.calibration_cost"
    from experiments.calibration_cost import tables

    assert tables() == want  # the entry point prints exactly these


def _configs():
    from experiments.calibration_cost import paper_configs

    return paper_configs()  # composed once per process (cached)
