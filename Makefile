# Set-up and everyday targets. Every target creates .venv itself on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -c constraints.txt
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint typecheck bench bench-small clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) -q torch==2.13.0
	$(PIP) -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/snapstate demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -p no:cacheprovider

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

bench-small: $(STAMP)
	$(BIN)/python benchmarks/bench_small.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
