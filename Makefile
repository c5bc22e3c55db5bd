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
# The dashboard's browser test drives Debian's Chromium: installed here where it is missing (root and
# apt-get, as on CI and these machines); elsewhere install it by hand or point MAWFORGE_CHROMIUM at one.
venv-test: venv
	$(BIN)/python scripts/llama_wheel.py --pip $(BIN)/pip
	$(BIN)/pip install -q -e '.[test]'
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || [ -n "$$MAWFORGE_CHROMIUM" ] || \
		(apt-get update -qq && apt-get install -y -qq chromium) || \
		echo "make: could not install chromium; the browser test will fail until one is installed" >&2

# Packs the shipped demo model (mawforge/demo/: a small Qwen3-MoE trained on the KJV Bible and
# the Python docs, Q4_K_M made by llama.cpp's quantizer), inspects and verifies the pack, plans,
# generates under an expert cache of 25% of the routed expert bytes, replays the route trace,
# and serves one chat request through the OpenAI API.
DEMO_GGUF := mawforge/demo/mawforge-demo-qwen3moe-Q4_K_M.gguf
demo: venv
	$(BIN)/mawforge pack $(DEMO_GGUF) -o $(WORK)/pack --force
	$(BIN)/mawforge inspect $(WORK)/pack
	$(BIN)/mawforge verify $(WORK)/pack
	$(BIN)/mawforge plan --pack $(WORK)/pack --memory-budget-gib 1 --context 512 --expert-cache-percent 25
	$(BIN)/mawforge run --pack $(WORK)/pack --context 512 --expert-cache-percent 25 --threads 2 \
		--max-tokens 48 --chat --trace-out $(WORK)/trace.npz "What does Genesis 1:3 say?"
	$(BIN)/mawforge replay $(WORK)/trace.npz --budgets 10%,25%,50%,100% --policies lru,lfu,fifo,random,s3fifo,belady -o $(WORK)/replay
	$(BIN)/python scripts/demo_serve.py $(WORK)/pack "Tell me about the for statement."

test: venv-test
	$(BIN)/ruff check mawforge tests benchmarks scripts
	$(BIN)/python -m pytest tests -x -q

clean:
	rm -rf $(VENV) work
