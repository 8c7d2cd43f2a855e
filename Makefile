# The two commands of the README: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -c "import torch, phalanx; print('phalanx', phalanx.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/phalanx run --standalone --nproc-per-node 2 examples/digits.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
