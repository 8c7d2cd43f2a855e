# The two commands of the README: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

NOEXTRAS := .venv-noextras
SRC := $(shell find src/phalanx -type f -not -path '*/__pycache__/*')

.PHONY: demo test test-all pytest lint install smoke-noextras docs clean

# torch and phalanx's own dependencies are byte-compiled as pip installs them, so every process
# of `make demo` starts from bytecode even where PYTHONDONTWRITEBYTECODE is set. The test and
# documentation tools are not (--no-compile: 14 s instead of 33 s here): the suite imports few of
# their modules, and `make pytest` writes the bytecode of those as it first imports them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	$(BIN)/python -c "import torch, phalanx; print('phalanx', phalanx.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/phalanx run --standalone --nproc-per-node 2 examples/digits.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The documentation site (mkdocs.yml, docs/): the benchmark page must be what
# tools/bench_page.py makes from benchmarks/results/, the site builds into site/ with warnings as
# errors, and every internal link of the built pages resolves. `make test` checks the same
# (tests/docs/test_site.py).
docs: $(STAMP)
	$(BIN)/python tools/bench_page.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean --site-dir site
	$(BIN)/python tools/check_site_links.py site

# phalanx as `pip install phalanx` leaves it: a venv with torch (the local wheel, as above) and
# `pip install .` without extras. Made afresh when pyproject.toml changes (a dependency dropped
# there is gone here too); phalanx alone is reinstalled when src/phalanx changes.
$(NOEXTRAS)/.base: pyproject.toml
	rm -rf $(NOEXTRAS)
	$(PYTHON) -m venv $(NOEXTRAS)
	$(NOEXTRAS)/bin/pip install --quiet --upgrade pip
	$(NOEXTRAS)/bin/pip install --quiet torch==2.13.0
	touch $@

# After .venv's editable install (order only): both write src/phalanx.egg-info.
$(NOEXTRAS)/.installed: $(NOEXTRAS)/.base $(SRC) | $(STAMP)
	$(NOEXTRAS)/bin/pip install --quiet .
	touch $@

smoke-noextras: $(NOEXTRAS)/.installed
	$(NOEXTRAS)/bin/python tests/noextras/smoke.py

# Three pytest workers (pytest-xdist), a test file each at a time: most tests wait on
# processes, sockets and sleeps more than they compute, so on two cores a third worker fills the
# idle time (a full run here: 611 s against 691 s on two). PYTEST_WORKERS=0 runs the suite in
# one process.
PYTEST_WORKERS ?= 3

# `make test` leaves out the tests marked `extended` (another size or variant of a path a test it
# runs walks already, or a benchmark's smoke run: docs/testing.md lists them); `make test-all`
# runs every test.
PYTEST_MARK ?= not extended

# First .venv and the no-extras venv's torch, side by side: each is one pip process at a time,
# so together they use both cores, where the second would otherwise compete with pytest. Then
# lint (ruff, mypy) and the no-extras smoke (phalanx installed, then a 2-rank job) run beside
# pytest. Each target's output comes out whole when it ends.
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(NOEXTRAS)/.base
	$(MAKE) --no-print-directory -j3 --output-sync=target lint smoke-noextras pytest

test-all: $(STAMP)
	$(MAKE) --no-print-directory test PYTEST_MARK=

# Python's default bytecode cache, even where the environment sets PYTHONDONTWRITEBYTECODE: the
# suite starts some 600 Python processes, and each would otherwise compile the phalanx modules it
# imports afresh (0.2 s of CPU for a Job's worker).
pytest: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(if $(PYTEST_MARK),-m "$(PYTEST_MARK)")

clean:
	rm -rf $(VENV) $(NOEXTRAS) build dist site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
