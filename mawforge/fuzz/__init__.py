"""MawForge's own fuzzer: seeded, bounded mutations of every input the pack tools read
(GGUF files, safetensors directories with config.json and index.json, a pack's JSON and
bytes), each run through the code behind `inspect`, `pack` and `verify` in a forked child
capped at 4 GiB of address space and 20 s. See runner.py for the outcome classes and
scripts/fuzz.py for the command line.
"""
