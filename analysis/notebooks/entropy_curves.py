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
# # Entropy curves
#
# The paper's headline symptom: under full-pipeline FP8 the policy entropy surges mid-training,
# while BF16 and Calibrated Clipping stay flat. This notebook only calls `analysis` functions
# on a sweep directory (`python -m analysis.report` writes the same figures).
#
# Set `SWEEP_DIR` to a sweep directory; left as `None` it fabricates a small demo sweep with
# `fp8rl.runs.synthetic` (planted surges), so the notebook runs anywhere.

# %% tags=["parameters"]
# ruff: noqa: E402, B018  (notebook: imports follow the parameters cell; bare expressions display)
SWEEP_DIR = None

# %%
import tempfile
from pathlib import Path

from IPython.display import Image, display

from analysis.collect import collect
from analysis.figures import arm_curves, plot_figure
from analysis.surge import SurgeRule, surge_table
from fp8rl.runs.synthetic import demo_specs, make_sweep

if SWEEP_DIR is None:
    SWEEP_DIR = Path(tempfile.mkdtemp()) / "demo"
    make_sweep(SWEEP_DIR, demo_specs(steps=150), sweep="demo")
coll = collect(SWEEP_DIR)
coll.runs[["run", "arm", "seed", "cell", "n_rows"]]

# %% [markdown]
# Cells that are missing, FAILED or incomplete (never dropped silently):

# %%
coll.problems

# %%
rule = SurgeRule.for_length(int(coll.steps["step"].max()))  # warm-up and streak scaled to short runs
print(rule.describe())
surge_table(coll.steps, rule).merge(coll.runs[["run", "arm", "seed"]], on="run")

# %%
out = Path(tempfile.mkdtemp())
paths = plot_figure(coll, "entropy", out, surge_rule=rule)
display(Image(filename=str(paths["png"])))

# %% [markdown]
# The plotted numbers (mean and std over seeds of the EMA-smoothed curves):

# %%
arm_curves(coll, "actor/entropy").head()
