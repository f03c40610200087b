# Two commands for a fresh machine:  `make demo` (set up + main job) and `make test` (set up + tests).
PYENV_PY := $(shell PYENV_VERSION=3.12.1 pyenv which python3 2>/dev/null)
PYTHON ?= $(if $(PYENV_PY),$(PYENV_PY),python3.12)
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: setup demo test clean

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[test,bench]"
	touch $@

setup: $(VENV)/.stamp

demo: setup
	$(VPY) -m tessera_jax.tools.demo

test: setup
	$(VPY) -m pytest -q -n 2 --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
