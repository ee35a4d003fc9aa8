# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Mechanism: clip cells, ratio quantiles, calibrated bounds
#
# FP8 noise widens the PPO ratio distribution, so more negative-advantage tokens fall below the
# lower clip bound, where their gradient is zero (`actor/clipfrac_neg_low`). Calibrated
# Clipping moves the bounds (`clip/low`, `clip/high`) so the FP8 clip fraction matches the BF16
# shadow's (`clip/alpha`). This notebook only calls `analysis` functions.

# %% tags=["parameters"]
# ruff: noqa: E402  (notebook: imports follow the parameters cell)
SWEEP_DIR = None

# %%
import tempfile
from pathlib import Path

from IPython.display import Image, display

from analysis.clip_tables import clip_cells_table
from analysis.collect import collect
from analysis.figures import plot_figure
from fp8rl.runs.synthetic import demo_specs, make_sweep

if SWEEP_DIR is None:
    SWEEP_DIR = Path(tempfile.mkdtemp()) / "demo"
    make_sweep(SWEEP_DIR, demo_specs(steps=150), sweep="demo")
coll = collect(SWEEP_DIR)
out = Path(tempfile.mkdtemp())

# %% [markdown]
# The four clip cells (A<0 / A>0 x below low / above high), mean over training per arm:

# %%
clip_cells_table(coll)

# %%
for name in ("clipfrac_neg_low", "ratio_quantiles", "clip_bounds"):
    paths = plot_figure(coll, name, out)
    if paths is not None:
        display(Image(filename=str(paths["png"])))
