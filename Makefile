# Two commands on a fresh machine: `make demo` and `make test`. Each sets up what it needs itself:
# a virtual environment with the project and its embedded services (Tansu, moto, the simulator,
# Gemma 3 270M), and for the tests also PyFlink and a llama-server build (cached in ~/.cache).

SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
PACKAGES := prompt_assembly llm_client serving sinks pipeline runner flink_jobs capacity devstack shopper batch realtime gateway
CODE     := $(PACKAGES) tests bench scripts

.PHONY: demo test lint typecheck pytest llama flink-jars bench bench-smoke clean stack-down

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) -m pip install -q -e ".[embedded,dev,flink]" 2>&1 | { grep -v "^WARNING: Location" || true; }
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(VENV)/bin/shopper demo

llama: $(STAMP)
	@PYTHON=$(PY) scripts/build-llama-server

lint: $(STAMP)
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy $(PACKAGES) tests bench

# The Flink Kafka connector jars, pinned, from PyPI (devstack/flink_jars.py; cached in ~/.cache).
flink-jars: $(STAMP)
	$(PY) -m devstack.flink_jars

pytest: $(STAMP) llama flink-jars
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test: lint typecheck pytest

# Run as modules (-m), never as bench/x.py: a script's own folder goes first on the import path, and
# bench/prompt_assembly.py would shadow the prompt_assembly package.
bench: $(STAMP)
	$(PY) -m bench.runner
	$(PY) -m bench.prompt_assembly
	$(PY) -m bench.client_overhead

# Every benchmark command docs/ shows, in a short form, into a temporary results folder (a few minutes;
# tests/bench/test_bench_smoke.py). `make test` runs it too: pytest collects tests/bench with the rest.
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m bench_smoke tests/bench

stack-down: $(STAMP)
	-$(VENV)/bin/shopper flink down
	$(VENV)/bin/shopper stack down

# What runs from .state (a Flink cluster, the embedded stack) is stopped before its state goes.
clean:
	@if [ -x $(VENV)/bin/shopper ]; then $(VENV)/bin/shopper flink down; $(VENV)/bin/shopper stack down; true; fi
	rm -rf $(VENV) .state .pytest_cache .mypy_cache .ruff_cache
