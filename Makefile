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
# `venv` holds what the demo needs and nothing more (no compiler run, no transformers).
venv: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[demo]'

# The tests' oracle and peer, llama-cpp-python, is compiled by scripts/llama_wheel.py with
# GGML_NATIVE=OFF, an explicit ISA list and AMX off, into a wheel keyed by those flags (pip's
# own wheel cache is bypassed): a build for one CPU is never reused on another, and AMX Xeons
# do not crash in ggml's AMX repack path. Its first run compiles llama.cpp (~7 min on 2 cores).
venv-test: venv
	$(BIN)/python scripts/llama_wheel.py --pip $(BIN)/pip
	$(BIN)/pip install -q -e '.[test]'

# Builds a tiny Qwen3-MoE (random weights, real GGUF), packs it, inspects and verifies the
# pack, plans, generates under an expert cache of 25% of the routed expert bytes, and serves
# one chat request through the OpenAI API.
DEMO_GGUF := $(WORK)/fixtures/qwen3_moe/qwen3_moe-Q4_K_M.gguf
demo: venv
	$(BIN)/python -m mawforge.fixtures.build $(WORK)/fixtures --arch qwen3_moe --ftype Q4_K_M
	$(BIN)/mawforge pack $(DEMO_GGUF) -o $(WORK)/pack --force
	$(BIN)/mawforge inspect $(WORK)/pack
	$(BIN)/mawforge verify $(WORK)/pack
	$(BIN)/mawforge plan --pack $(WORK)/pack --memory-budget-gib 1 --context 512 --expert-cache-percent 25
	$(BIN)/mawforge run --pack $(WORK)/pack --context 512 --expert-cache-percent 25 --threads 2 \
		--max-tokens 24 --chat --trace-out $(WORK)/trace.npz "What does an expert cache do?"
	$(BIN)/mawforge replay $(WORK)/trace.npz --budgets 10%,25%,50%,100% --policies lru,lfu,fifo,random,s3fifo,belady -o $(WORK)/replay
	$(BIN)/python scripts/demo_serve.py $(WORK)/pack

test: venv-test
	$(BIN)/python -m pytest tests -x -q

clean:
	rm -rf $(VENV) work
