# Two commands matter: `make demo` (the one-command demo) and `make test`.
# Both build .venv on first use; the stamp makes later runs a no-op unless
# pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck pytest bench bench-core bench-daemon clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,torch]' 'torch==2.13.0'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/convergenced demo

lint: $(STAMP)
	$(BIN)/ruff check convergenced tests benchmarks proto
	$(BIN)/ruff format --check convergenced tests benchmarks proto

typecheck: $(STAMP)
	$(BIN)/mypy convergenced

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

# The comparative benchmarks of BENCHMARKS.md, one after the other on this machine
# (about 50 minutes): each writes its tables and plots to benchmarks/results/, and
# report.py splices the tables into BENCHMARKS.md between its markers. Needs etcd
# (Debian package etcd-server). `make test` runs a quick smoke of each.
BENCH_OUT := benchmarks/results

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_etcd.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_training.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_training.py --no-step-allreduce --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_daemon.py --only throughput --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_scale.py --budget-s 900 --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_footprint.py --out $(BENCH_OUT)
	$(BIN)/python benchmarks/bench_daemon.py --only convergence --nodes 8 16 --out $(BENCH_OUT)
	$(BIN)/python benchmarks/report.py $(BENCH_OUT) BENCHMARKS.md

bench-core: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

bench-daemon: $(STAMP)
	$(BIN)/python benchmarks/bench_daemon.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
