"""The engines of benchmarks/conversation.py: the same conversation turns sent to MawForge's and
fastllm's OpenAI servers (each a real server process, started on a dropped page cache, inside a
cgroup v1 memory limit when one is given) through the `openai` client, and to llama.cpp
(llama-cpp-python, in a worker child) as the token ids MawForge's chat template produces.
Every turn is streamed and timed at the client: TTFT is the first chunk that carries a token."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from common import PY, drop_caches

GiB = 2**30
MODEL_ID = "conv"


# ---- one streamed turn ------------------------------------------------------------------------
def _g(o, k):
    return o.get(k) if isinstance(o, dict) else getattr(o, k, None)


def _has_token(choice) -> bool:
    """A chunk that carries a generated token (a role-only chunk sent before prefill does not);
    llama-cpp-python's completion chunks are dicts with `text`."""
    d = _g(choice, "delta")
    if d is None:
        return bool(_g(choice, "text"))
    return _g(d, "content") is not None or bool(_g(d, "reasoning_content")) or bool(_g(d, "tool_calls"))


def timed_stream(chunks, t0: float) -> dict:
    """TTFT, decode tok/s and the final usage of one stream of chat (or completion) chunks."""
    first = last = None
    n, usage, telemetry = 0, None, None
    for c in chunks:
        choices = _g(c, "choices")
        if choices and _has_token(choices[0]):
            last = time.perf_counter()
            first = first or last
            n += 1
        usage = _g(c, "usage") or usage
        telemetry = (_g(c, "model_extra") or {}).get("telemetry") or telemetry
    tokens = getattr(usage, "completion_tokens", None) or n
    out = {"ttft_s": (first or time.perf_counter()) - t0, "completion_tokens": tokens,
           "decode_tok_s": (tokens - 1) / (last - first) if first and last > first and tokens > 1 else None}
    if usage is not None:
        details = getattr(usage, "prompt_tokens_details", None)
        out["prompt_tokens"] = usage.prompt_tokens
        out["cached_tokens"] = getattr(details, "cached_tokens", None) if details is not None else None
    if telemetry:
        out["telemetry"] = {k: telemetry.get(k) for k in ("ttft_s", "decode_tok_s", "prefill_read_bytes",
                                                          "prefill_needed_bytes", "materialized_bytes",
                                                          "peak_rss_bytes", "hit_rate")}
    return out


def chat_turn(client, messages: list, tools: list | None, max_tokens: int) -> dict:
    kw = {"tools": tools} if tools else {}
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=max_tokens, stream=True,
                                            temperature=0, stream_options={"include_usage": True}, **kw)
    return timed_stream(stream, t0)


# ---- servers ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a dropped page cache (in its own memory cgroup under a limit); its
    output goes to `log`. `url` is known once `ready` returns."""

    def __init__(self, cmd: list[str], log: Path, limit_bytes: int | None, env: dict | None = None):
        self.cg = None
        if limit_bytes:
            from mawforge.bench.cgroup import MemoryCgroup
            self.cg = MemoryCgroup(limit_bytes).__enter__()
            cmd = self.cg.wrap(cmd)
        drop_caches()
        self.log = log
        self.t0 = time.perf_counter()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def ready(self, find_url, timeout: float) -> float:
        """Wait until find_url() gives the base URL; the seconds the server took to come up."""
        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited rc={self.proc.returncode}: {self.tail()}")
            url = find_url(self)
            if url:
                self.url = url
                return time.perf_counter() - self.t0
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 600) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def peak_rss_bytes(self) -> int | None:
        """The server's own peak RSS (VmHWM; the cgroup wrapper execs into the server)."""
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def close(self) -> dict:
        stats = self.cg.stats() if self.cg else {}
        stats["peak_rss_bytes"] = self.peak_rss_bytes()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.cg:
            self.cg.close()
        return stats


def maw_url(s: Server) -> str | None:
    m = re.search(r"listening on (http://\S+)", s.tail(4000))
    return m.group(1) if m else None


def probe_url(port: int):
    def find(s: Server) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                return f"http://127.0.0.1:{port}" if r.status == 200 else None
        except OSError:
            return None
    return find


def maw_command(pack: Path, template: Path, context: int, threads: int, limit_gib: float | None,
                stream_embeddings: bool, extra: list[str]) -> list[str]:
    cmd = [PY, "-m", "mawforge.cli", "serve", "--pack", str(pack), "--port", "0", "--model-id", MODEL_ID,
           "--context", str(context), "--threads", str(threads), "--chat-template-file", str(template)]
    if limit_gib is None:
        cmd += ["--expert-cache-percent", "100"]
    else:     # as fullsize.py: 8% of the limit left to the page cache and the kernel
        cmd += ["--memory-budget-gib", f"{0.92 * limit_gib:.3f}"]
        cmd += ["--stream-embeddings"] if stream_embeddings else []
    return cmd + extra


def ftllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


# fastllm's --chat_template is ignored for a GGUF (it sets the template only on an HF folder's
# tokenizer), and its tool calls need that tokenizer's template: the launcher gives the tokenizer it
# rebuilds from the GGUF our template, as --chat_template does for a folder.
FTLLM_MAIN = """import sys
sys.path += [p for p in {extra!r} if p]
import ftllm.llm as llm
rebuild = llm.try_load_gguf_tokenizer
def with_template(path):
    t = rebuild(path)
    if t is not None:
        t.chat_template = open({template!r}).read()
    return t
llm.try_load_gguf_tokenizer = with_template
sys.argv = ["ftllm"] + sys.argv[1:]
from ftllm.cli import main
sys.exit(main())"""


def ftllm_check(venv: Path, extra: list[str]) -> str | None:
    """None when fastllm's server, its tool-call parsers and transformers import; else why not."""
    if not ftllm_python(venv).exists():
        return f"no fastllm venv at {venv} (pip install --no-deps ftllm==1.9.0 there)"
    code = (f"import sys; sys.path += {extra!r}; import ftllm.server, ftllm.openai_server.toolcall_parser, "
            "transformers, tokenizers")
    r = subprocess.run([str(ftllm_python(venv)), "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return (f"fastllm does not import in {venv}: {last} (it was installed --no-deps: install jinja2, "
                "regex, partial-json-parser, transformers there, or pass --ftllm-sys-path)")
    return None


def ftllm_command(venv: Path, extra: list[str], gguf: Path, template: Path, port: int, context: int,
                  cache_gib: float) -> list[str]:
    """fastllm at its default of 1 thread in its disk-MoE mode with an expert cache of `cache_gib`
    (its KV pool and dense weights take ~4 GiB besides; resident: a cache the size of the file.
    Its NUMA CPU-MoE mode, the default, did not finish its warm-up here on 2 busy cores)."""
    cmd = [str(ftllm_python(venv)), "-c", FTLLM_MAIN.format(extra=extra, template=str(template)), "serve", str(gguf),
           "-t", "1", "--host", "127.0.0.1", "--port", str(port), "--model_name", MODEL_ID,
           "--max_context_length", str(context)]
    return cmd + ["--moe_device", "disk", "--moe_cpu_cache", f"{int(cache_gib * 1024)}m"]


def serve_turns(server: Server, find_url, workload: dict, max_tokens: int, turn_timeout: float,
                ready_timeout: float) -> dict:
    """Start-up time, then each turn of the workload; a turn past turn_timeout ends the row."""
    import openai
    out: dict = {"turns": []}
    try:
        out["ready_s"] = server.ready(find_url, ready_timeout)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=turn_timeout, max_retries=0)
        for messages in workload["turns"]:
            try:
                out["turns"].append(chat_turn(client, messages, workload["tools"], max_tokens))
            except openai.APITimeoutError:
                out["turns"].append({"status": "timeout"})
                break
        out["status"] = "ok" if all("ttft_s" in t for t in out["turns"]) else "timeout"
    except Exception as e:        # a server that fails is a row with its reason, not a dead run
        out["status"], out["error"] = "failed", f"{type(e).__name__}: {e}"[-800:]
    finally:
        out["cgroup"] = server.close()
        out["server_log_tail"] = server.tail(400)
    return out


# ---- llama.cpp (inside a worker child) --------------------------------------------------------
def llama_turns(model: str, requests: list[list[int]], context: int, threads: int, max_tokens: int,
                repack_off: bool, turn_timeout: float, emit) -> dict:
    """Each turn's ids through create_completion (its default prefix reuse keeps the longest
    common prefix of the previous call); `emit(result)` gets the partial result if a turn runs
    past turn_timeout, then the process ends."""
    import llama_cpp

    from common import llama_repack_off
    if repack_off:
        llama_repack_off()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model, n_ctx=context, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    out = {"load_s": time.perf_counter() - t0, "turns": [], "status": "ok"}
    for ids in requests:
        prev = list(llm._input_ids[:llm.n_tokens])
        same = next((i for i, (a, b) in enumerate(zip(prev, ids)) if a != b), min(len(prev), len(ids)))
        cached = same - 1 if same == len(ids) else same
        timer = threading.Timer(turn_timeout, lambda: (out["turns"].append({"status": "timeout"}),
                                                       out.update(status="timeout"), emit(out), os._exit(0)))
        timer.start()
        t0 = time.perf_counter()
        turn = timed_stream(llm.create_completion(prompt=ids, max_tokens=max_tokens, stream=True, temperature=0.0,
                                                  top_k=1), t0)
        timer.cancel()
        turn.update(prompt_tokens=len(ids), cached_tokens=cached)
        out["turns"].append(turn)
    return out


def emit_json(row: dict) -> None:
    import json
    print(json.dumps(row), flush=True)
    sys.stdout.flush()
