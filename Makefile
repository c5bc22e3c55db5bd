# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORK ?= work/demo

.PHONY: venv venv-test demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to the CPU build on this machine's disk (plain `torch` pulls a CUDA build).
venv: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .

venv-test: venv
	$(BIN)/pip install -q -e '.[test]'

demo: venv-test
	$(BIN)/python -m mawforge.fixtures.build $(WORK)/fixtures --archs qwen3_moe --ftypes Q8_0
	$(BIN)/mawforge pack $(WORK)/fixtures/qwen3_moe/model-Q8_0.gguf -o $(WORK)/pack --force
	$(BIN)/mawforge inspect $(WORK)/pack
	$(BIN)/mawforge verify $(WORK)/pack

test: venv-test
	$(BIN)/python -m pytest tests -x -q

clean:
	rm -rf $(VENV) work
