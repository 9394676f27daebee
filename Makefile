# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch for development; installed before the package so no CUDA build is pulled.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup run test test-gpu lint plots clean

$(BIN)/.installed: pyproject.toml Makefile
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

run: setup
	bash scripts/run-main.sh examples/01-tiny-code.yaml

test: setup
	bash scripts/run-tests.sh

test-gpu: setup
	$(BIN)/python -m pytest -m gpu

# PNG charts of bench/results/*.json into docs/images/ (a chart whose results are not recorded is skipped).
plots: setup
	$(BIN)/python bench/plots.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy fusedserve models

clean:
	rm -rf $(VENV) build dist *.egg-info .cache
