# One-command set-up and entry points. Every target installs what it needs into .venv.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# On CPU-only machines torch must be installed before the project, or pip pulls a CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: install test test-all lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	@# Upstream reference code for parity tests: loaded by path, never imported as a package.
	$(BIN)/pip install --quiet --no-deps openrlhf==0.11.2
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q

test-all: install
	$(BIN)/python -m pytest -q -m ''

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/bench_calibration.py

# Our mini step against Hugging Face TRL's GRPOTrainer (benchmarks/bench_peer_trl.py).
.PHONY: bench-peer
bench-peer: install
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench_peer_trl.py

clean:
	rm -rf $(VENV) .pytest_cache

# The project's local Slurm cluster for the `slurm` tests (root; see slurm/README.md):
#   eval "$(make -s slurm-up)"   ...   make slurm-down
.PHONY: slurm-up slurm-down
slurm-up:
	@bash slurm/local_cluster.sh start
slurm-down:
	@bash slurm/local_cluster.sh stop

# The README's main command: the paper's main table at mini scale, on this machine.
.PHONY: reproduce
reproduce: install
	$(BIN)/python -m experiments.launch +sweep=main_table

# The published mini reproduction (docs/results/mini/README.md). After the sweeps have run:
# copy each sweep's run directories (no checkpoints, no machine paths) into $(RESULTS)/runs/
# and regenerate its report from that copy; tests/analysis/test_published_results.py checks it.
RESULTS ?= docs/results/mini
SWEEPS  ?= main_table entropy_granularity calibration_ablation surge_stress
.PHONY: results
results: install
	@for s in $(SWEEPS); do \
	  $(BIN)/python -m experiments.publish runs/$$s $(RESULTS)/runs/$$s --replace || exit 1; \
	  rm -rf $(RESULTS)/$$s/figures $(RESULTS)/$$s/tables $(RESULTS)/$$s/report.md; \
	  $(BIN)/python -m analysis.report $(RESULTS)/runs/$$s --out $(RESULTS)/$$s --no-cache --no-progress || exit 1; \
	done
