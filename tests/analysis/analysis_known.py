"""Known fabricated sweeps for the analysis tests (``fp8rl.runs.synthetic``).

A helper module with a unique name (not ``conftest``) so the tests can import its constants
without clashing with other directories' conftest modules; ``conftest.py`` turns it into
fixtures.

``known_sweep`` is built once per session: a GRPO/8b grid of four arms x two seeds with planted
entropy surges, known final accuracies, one FAILED cell, one missing cell (in the manifest,
never started), one PREEMPTED cell with a truncated last line, one run with NaN entropies.
"""

from fp8rl.runs.synthetic import RunSpec, make_sweep

STEPS = 80
EVALS = {
    ("bf16", "vanilla", 0): {"aime24": 0.30, "math500": 0.70},
    ("bf16", "vanilla", 1): {"aime24": 0.34, "math500": 0.74},
    ("tensorwise", "vanilla", 0): {"aime24": 0.20, "math500": 0.55},
    ("tensorwise", "vanilla", 1): {"aime24": 0.22, "math500": 0.61},
    ("tensorwise", "calibrated", 0): {"aime24": 0.33, "math500": 0.76},
    ("tensorwise", "calibrated", 1): {"aime24": 0.37, "math500": 0.72},
    ("blockwise", "tis", 0): {"aime24": 0.25, "math500": 0.66},
    ("blockwise", "tis", 1): {"aime24": 0.27, "math500": 0.60},
}
SURGES = {("tensorwise", "vanilla", 0): 40, ("tensorwise", "vanilla", 1): 47,
          ("blockwise", "tis", 1): 55}


def known_specs():
    specs = []
    for (fp8, clip, seed), ev in EVALS.items():
        specs.append(RunSpec(fp8=fp8, clip=clip, seed=seed, steps=STEPS, eval=ev,
                             surge_at=SURGES.get((fp8, clip, seed)), eval_every=20))
    # seed 2 of three arms: failed, missing, preempted with a truncated tail
    specs.append(RunSpec(fp8="bf16", clip="vanilla", seed=2, steps=STEPS, state="FAILED",
                         eval={"aime24": 0.9, "math500": 0.9}))
    specs.append(RunSpec(fp8="tensorwise", clip="calibrated", seed=2, steps=STEPS, state=None))
    specs.append(RunSpec(fp8="blockwise", clip="tis", seed=2, steps=50, state="PREEMPTED",
                         truncated_tail=True, nan_every=5, eval={"aime24": 0.9, "math500": 0.9}))
    return specs


def write_known_sweep(path):
    make_sweep(path, known_specs(), sweep="known")
    return path


def capture_figures(monkeypatch) -> dict:
    """Make the report keep each figure it draws (``{name: Figure}``, open) instead of rendering a
    PNG (the slow part): ``save_figure`` of the figure modules returns the paths it would write."""
    from pathlib import Path

    import matplotlib.pyplot as plt

    import analysis.bars as bars
    import analysis.curves as curves
    import analysis.granularity as granularity

    kept = {}

    def save(fig, out_dir, name, caption, **k):
        kept[name] = fig
        paths = curves.FigurePaths(png=Path(out_dir) / f"{name}.png", csv=Path(out_dir) / f"{name}.csv")
        paths.caption = caption
        return paths

    for module in (granularity, bars):
        monkeypatch.setattr(module, "save_figure", save)
    monkeypatch.setattr(plt, "close", lambda fig=None: None)
    return kept


def artist_colours(fig) -> list[tuple[str, str]]:
    """(gid, colour) of every visible line, band and bar drawn with a gid (an arm or the BF16
    reference): a line's colour, a patch's or collection's first face colour (its edge colour
    when it has no face)."""
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D

    out = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for art in [*ax.get_lines(), *ax.collections, *ax.patches]:
            gid = art.get_gid()
            if not gid:
                continue
            if isinstance(art, Line2D):
                col = art.get_color()
            else:
                fc = art.get_facecolor()
                col = fc if getattr(fc, "ndim", 1) == 1 else (fc[0] if len(fc) else art.get_edgecolor()[0])
            out.append((gid, to_hex(col)))
    return out
