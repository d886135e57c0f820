# Two commands matter: `make demo` (the one-command demo) and `make test`.
# Both build .venv on first use; the stamp makes later runs a no-op unless
# pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck pytest bench-core bench-daemon clean

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

bench-core: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

bench-daemon: $(STAMP)
	$(BIN)/python benchmarks/bench_daemon.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
