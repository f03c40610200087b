# Two commands for a fresh machine:  `make demo` (set up + main job) and `make test` (set up + tests).
PYENV_PY := $(shell PYENV_VERSION=3.12.1 pyenv which python3 2>/dev/null)
PYTHON ?= $(if $(PYENV_PY),$(PYENV_PY),python3.12)
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: setup demo test test-gpu clean

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

# The compiled kernels on this machine's GPU against the reference (tests/gpu; they skip without
# a GPU). The project's venv when there is one, else the machine's python3 (a GPU image with
# jax[cuda13], pytest and hypothesis; no install, so it runs on machines without a network).
# JAX_PLATFORMS is emptied: tests/conftest.py pins the CPU suite to the CPU otherwise.
test-gpu:
	JAX_PLATFORMS= PYTHONPATH=$(CURDIR) $(if $(wildcard $(VPY)),$(VPY),python3) -m pytest -q -p no:cacheprovider \
		-m gpu tests/gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
