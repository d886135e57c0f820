# Two commands matter: `make demo` (the one-command demo) and `make test`.
# Both build .venv on first use. Each installs only what it needs, once: the demo
# the package and its few dependencies; the tests, linters and benchmarks also the
# dev tools and PyTorch (pinned to the CPU build: a plain `torch` would pull a
# multi-GB CUDA one). A stamp per set makes later runs a no-op unless
# pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
TORCH := torch==2.13.0
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: install demo test lint typecheck pytest bench bench-core bench-daemon clean

install: $(DEV_STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e .
	touch $@

# The dev set includes the package: the demo needs nothing more after it.
$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[dev,torch,s3,torchtitan]' '$(TORCH)'
	touch $@ $(RUN_STAMP)

demo: $(RUN_STAMP)
	$(BIN)/convergenced demo

lint: $(DEV_STAMP)
	$(BIN)/ruff check convergenced tests benchmarks proto
	$(BIN)/ruff format --check convergenced tests benchmarks proto

typecheck: $(DEV_STAMP)
	$(BIN)/mypy convergenced

# Two workers by default (TEST_WORKERS=0: one process); worksteal keeps both busy
# to the end although a few tests take minutes.
TEST_WORKERS ?= 2

pytest: $(DEV_STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

test: lint typecheck pytest

# The comparative benchmarks of BENCHMARKS.md, one after the other on this machine
# (about 50 minutes): each writes its tables and plots to benchmarks/results/, and
# report.py splices the tables into BENCHMARKS.md between its markers. Needs etcd
# (Debian package etcd-server). `make test` runs a quick smoke of each.
BENCH_OUT := benchmarks/results

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/bench_etcd.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_training.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_training.py --no-step-allreduce --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_daemon.py --only throughput --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_scale.py --budget-s 900 --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_churn.py --nodes 16 32 64 128 --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_footprint.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_daemon.py --only convergence --nodes 3 8 16 --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_frames.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_rollout.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_fleet.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/report.py $(BENCH_OUT) BENCHMARKS.md

bench-core: $(DEV_STAMP)
	$(BIN)/python benchmarks/bench_core.py

bench-daemon: $(DEV_STAMP)
	$(BIN)/python benchmarks/bench_daemon.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
