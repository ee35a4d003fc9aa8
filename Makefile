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
