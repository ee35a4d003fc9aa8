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
# # Accuracy table
#
# The paper's accuracy table: rows = arms, columns = evaluation sets (avg@k, %) and their
# average, mean ± std over seeds, best per column in bold, missing cells marked. All logic
# lives in `analysis.tables`; this notebook shows it.

# %% tags=["parameters"]
# ruff: noqa: E402  (notebook: imports follow the parameters cell)
SWEEP_DIR = None

# %%
import tempfile
from pathlib import Path

from IPython.display import Markdown, display

from analysis.collect import collect, final_evals
from analysis.tables import accuracy_table, diagnostics_table
from fp8rl.runs.synthetic import demo_specs, make_sweep

if SWEEP_DIR is None:
    SWEEP_DIR = Path(tempfile.mkdtemp()) / "demo"
    make_sweep(SWEEP_DIR, demo_specs(steps=150), sweep="demo")
coll = collect(SWEEP_DIR)

# %% [markdown]
# Each finished run's final evaluation (from `summary.json`, else the last `eval.jsonl` row):

# %%
final_evals(coll).head(10)

# %%
acc = accuracy_table(coll)
display(Markdown(acc.markdown))

# %%
print(acc.latex)

# %%
diag = diagnostics_table(coll)
display(Markdown(diag.markdown))
