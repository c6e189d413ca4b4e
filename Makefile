# The README's commands: `make test`, `make demo` and `make docs`. Each creates .venv on a fresh clone.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch is pinned: 2.13.0 is the CPU build on this machine; an unpinned torch pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: test test-slow demo lint bench clean wheel-check docs

# requirements-titan.txt: torchtitan (tests/test_titan.py) and the four packages its MoE imports, installed
# without their dependencies: torchtitan 0.3 asks for datasets<4.8, which would downgrade the pinned
# datasets / huggingface_hub (docs/scaling.md)
$(STAMP): pyproject.toml constraints.txt requirements-titan.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt "$(TORCH)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps -r requirements-titan.txt
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

# the wheel as a user installs it: built, installed into a fresh venv with the core dependencies only,
# `moelab --help` and the README's layer example (tests/test_extras.py; torch from the pinned file)
wheel-check: $(STAMP)
	$(BIN)/python -m pytest -m slow tests/test_extras.py

# the documentation site (mkdocs.yml) into site/, offline; --strict: a broken link or anchor, a page left
# out of the nav or an API name mkdocstrings cannot find fails the build (CI runs it after `make test`)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean --site-dir site

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

lint: $(STAMP)
	$(BIN)/ruff check src tests examples docs/hooks
	$(BIN)/ruff format --check src tests examples docs/hooks

demo: $(STAMP)
	$(BIN)/moelab compare --size demo --out runs/demo --resume

# the full benchmark grid of docs/performance-suite.md (about an hour on 2 cores); an interrupted run continues where it stopped.
# It runs in your environment as it is (the OpenMP wait policy included: docs/performance.md shows both rows;
# `OMP_WAIT_POLICY=PASSIVE make bench` gives the other)
bench: $(STAMP)
	$(BIN)/moelab bench suite --out runs/bench/suite.json --resume

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache
