# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast soak install clean shell

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependency list changes. torch==2.13.0 (the CPU wheel, from local disk) goes in first:
# pyproject declares a range (GPU users bring their own CUDA build), which pip would otherwise resolve to
# a multi-GB CUDA wheel.
TORCH ?= torch==2.13.0
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dlaunch recipe=linear strategy=mirrored cluster=1x2
	@echo "dlaunch lives in $(BIN): run 'source $(BIN)/activate' (or 'make shell') to have it on PATH"

# A shell with the venv active, so that `dlaunch` is on PATH (exit leaves it).
shell: $(STAMP)
	@echo "dlaunch $$($(BIN)/dlaunch --version | cut -d' ' -f2) on PATH; exit to leave"
	@. $(BIN)/activate && exec $${SHELL:-bash} -i

# Five test processes (pytest-xdist), a test file each at a time, the costliest files first (tests/conftest.py):
# most tests wait on the processes they start, so five streams keep two cores busy, idle or shared (figures:
# docs/DEVELOPMENT.md). TEST_JOBS=0 runs them in one.
TEST_JOBS ?= 5
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

# SLURM end to end (docs/OPERATIONS.md, SLURM): start a one-node SLURM with munge on this machine (root; installs
# slurmctld, slurmd and munge with apt if absent), then run the tests that submit through hydra/launcher=submitit_slurm.
# `tests/slurm/setup_slurm.sh stop` stops the daemons again.
.PHONY: test-slurm
test-slurm: $(STAMP)
	tests/slurm/setup_slurm.sh
	$(BIN)/python -m pytest tests/cli/test_slurm.py

# The chaos soak (docs/RELIABILITY.md): one run interrupted SOAK_N times at random, then compared with an
# uninterrupted one. `make test` runs it with 5 interruptions; replay a failure with the SOAK_SEED it printed.
SOAK_N ?= 30
SOAK_REPORT ?= soak-report.json
soak: $(STAMP)
	SOAK_N=$(SOAK_N) SOAK_REPORT=$(SOAK_REPORT) $(BIN)/python -m pytest tests/launch/test_chaos.py -m soak -s -q

# Benchmarks (docs/PERFORMANCE.md): the bench_mlp workload through dlaunch and hand-written torch,
# interleaved rounds, then the micro-benchmarks. Results: benchmarks/results/. Quick check: make bench BENCH_ARGS=--quick
.PHONY: bench
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/micro.py $(filter --quick,$(BENCH_ARGS))

# The GPU benchmark (docs/PERFORMANCE.md, GPU section): scaled charlm through dlaunch and a hand-written loop,
# fp32 / bf16-mixed / bf16-mixed + torch.compile, interleaved rounds. Needs a CUDA GPU.
.PHONY: bench-gpu
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/gpu.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) outputs multirun build *.egg-info
