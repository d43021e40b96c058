# `make train` and `make test` each create .venv with a Python 3.12 found on this machine
# (PATH first, then pyenv's versions folder), install k3jax into it, then run.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=

# First python3.12 / python3 on PATH that really is 3.12 (pyenv shims can exist but fail), then pyenv's
# versions folder. Override with `make test PYTHON312=/path/to/python3.12`.
PYTHON312 ?= $(shell for c in python3.12 python3 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV); do \
  if $$c -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then command -v $$c; break; fi; done)

.PHONY: train test test-full venv clean

$(VENV)/.installed: setup.py constraints.txt
	@if [ -z "$(PYTHON312)" ]; then echo "error: no Python 3.12 on PATH or under pyenv's versions folder" >&2; exit 1; fi
	@echo "Using $(PYTHON312)"
	@[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	@touch $@

venv: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) -m experiments.train $(ARGS)

# CI's command: one case per behaviour (the `full` tier deselected; tests/conftest.py).
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist=worksteal -rs --durations=30 tests $(PYTEST_ARGS)

# Every case, the whole interpret-mode kernel matrix and the longest shapes included.
test-full: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist=worksteal -rs --durations=30 --full-tier tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
