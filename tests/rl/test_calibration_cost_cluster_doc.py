"""docs/cluster.md's "Calibrated Clipping at paper scale: what it costs and what alpha n to expect"
shows what the cost model and the paper-scale configs give (issue 46 item 6).

References: the per-step overheads of ``fp8rl.rl.calibration.cost`` on the configs the paper-scale
dry run composes (``experiments.calibration_cost.paper_configs``), and alpha n = rate x A<0 tokens
per calibration with the section's stated assumptions (the configs' sequences per step, responses
at the cost model's share of the cap, half the response tokens A<0), recomputed here; the window
the shared rule would pick from them (``windowed``: the fewest steps whose alpha n reaches 3).
"""

from __future__ import annotations

from pathlib import Path

from fp8rl.rl.calibration import cost as C
from fp8rl.rl.calibration.schedule import MODE_OPTION_DEFAULTS

REPO = Path(__file__).resolve().parents[2]
TITLE = "### Calibrated Clipping at paper scale: what it costs and what alpha n to expect"
RATES = (0.0005, 0.0015, 0.005)
NEG_SHARE = 0.5  # the section's assumption: half the response tokens have A < 0


def _section() -> str:
    text = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8")
    assert TITLE in text, "docs/cluster.md lacks the section on Calibrated Clipping's cost and alpha n at paper scale"
    body = text.split(TITLE, 1)[1]
    return body.split("\n## ", 1)[0]


def _shapes():
    from experiments.calibration_cost import paper_configs

    return C.paper_shapes(paper_configs())


def _cell(row: dict) -> str:
    """FLOPs / GEMM time with gradient checkpointing, as the cost model's markdown prints them."""
    return f"+{100 * row['flops_ckpt']:.1f}% / +{100 * row['time_ckpt']:.1f}%"


def test_the_cost_rows_are_the_cost_models():
    section = _section()
    rows = C.cost_table(_shapes())
    for slot, (algo, model, _) in _shapes().items():
        mine = {r["mode"]: r for r in rows if r["slot"] == slot and (r["mode"] != "sampled" or r["share"] != 0.125)}
        s = mine["windowed"]["share"]
        assert mine["sampled"]["share"] == s and _cell(mine["sampled"]) == _cell(mine["windowed"])
        want = (f"| {model.name} ({algo.upper()}) | {_cell(mine['periodic'])} | {_cell(mine['pooled'])} | "
                f"{_cell(mine['same_batch'])} | s = {s:.4f}: {_cell(mine['windowed'])} |")
        assert want in section, want


def test_the_alpha_n_rows_follow_from_the_configs_and_the_window_is_one_step():
    section = _section()
    target = MODE_OPTION_DEFAULTS["window_target"]
    for _, (algo, model, step) in _shapes().items():
        n = step.sequences * step.response_len * NEG_SHARE  # A<0 tokens per step
        s = C.max_share(model=model, step=step)
        whole = " / ".join(f"{r * n:,.0f}" for r in RATES)
        part = " / ".join(f"{r * n * s:,.0f}" for r in RATES)
        want = f"| {model.name} ({algo.upper()}) | {n / 1e6:.2f}M | {whole} | {n * s / 1e3:.0f}K tokens: {part} |"
        assert want in section, want
        # the rule's W at the lowest rate and the cheapest share: one step already reaches the target
        assert min(RATES) * n * s >= target
        assert target / (n * s) < 2e-5  # "W > 1 needs a rate below about 0.001%"
    assert f"`clip.window_target` {target:g}" in section
