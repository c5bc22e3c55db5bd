"""Baseline servers for the bench: llama.cpp (llama-cpp-python) on the source GGUF, with mmap
(its default) or without, and transformers on the HF source directory. Each is a small
OpenAI-compatible server so that a baseline cell runs exactly like a MawForge cell: same
requests, same guard, same cgroup, same evidence.

    python -m mawforge.bench.baselines --engine llama_cpp|transformers --model PATH --port 0 \
        [--no-mmap] [--context N] [--threads T] [--model-id ID] [--max-tokens-default N]
prints `mawforge baseline: listening on URL` to stderr once bound. Responses carry `usage` and
a `telemetry` object (schema mawforge.baseline/1: the timing and memory fields of
mawforge.telemetry with the same names; no expert-cache fields). Decoding is greedy.
(llama-cpp-python ships `python -m llama_cpp.server`, but only with its [server] extras,
which are not installed here; this server needs only starlette and uvicorn.)
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import socket
import sys
import threading
import time
import uuid

SCHEMA = "mawforge.baseline/1"


class Backend:
    """One engine: load once, then render(messages) -> text and tokens(text, max, ignore_eos)."""
    registry: dict[str, type["Backend"]] = {}

    def __init_subclass__(cls, name: str, **kw):
        super().__init_subclass__(**kw)
        Backend.registry[name] = cls

    def render(self, messages: list[dict]) -> str:
        raise NotImplementedError

    def prompt_ids(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokens(self, ids: list[int], max_tokens: int, ignore_eos: bool):
        raise NotImplementedError

    def detokenize(self, ids: list[int]) -> str:
        raise NotImplementedError


class LlamaCppBackend(Backend, name="llama_cpp"):
    def __init__(self, model: str, context: int, threads: int | None, mmap: bool):
        from llama_cpp import Llama

        from mawforge.text.tokenizer import ChatTemplate
        kw = {"n_threads": threads, "n_threads_batch": threads} if threads else {}
        self.llm = Llama(model_path=model, n_ctx=context, use_mmap=mmap, seed=0, verbose=False, **kw)
        self.chat = ChatTemplate(self.llm.metadata.get("tokenizer.chat_template"))

    def render(self, messages):
        return self.chat.render(messages, add_generation_prompt=True)

    def prompt_ids(self, text):
        return self.llm.tokenize(text.encode(), add_bos=True, special=True)

    def tokens(self, ids, max_tokens, ignore_eos):
        eos, n = self.llm.token_eos(), 0
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if tok == eos and not ignore_eos:
                return
            yield int(tok)
            n += 1
            if n >= max_tokens:
                return

    def detokenize(self, ids):
        return self.llm.detokenize(ids).decode("utf-8", errors="replace")


class TransformersBackend(Backend, name="transformers"):
    def __init__(self, model: str, context: int, threads: int | None, mmap: bool):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from mawforge.text.tokenizer import ChatTemplate
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.chat = None if getattr(self.tok, "chat_template", None) else ChatTemplate(None)

    def render(self, messages):
        if self.chat is not None:
            return self.chat.render(messages, add_generation_prompt=True)
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, text):
        return self.tok(text, add_special_tokens=True)["input_ids"]

    def tokens(self, ids, max_tokens, ignore_eos):
        torch, eos = self.torch, self.tok.eos_token_id
        with torch.inference_mode():
            x, past = torch.tensor([ids]), None
            for _ in range(max_tokens):
                out = self.model(input_ids=x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                if tok == eos and not ignore_eos:
                    return
                yield tok
                x = torch.tensor([[tok]])

    def detokenize(self, ids):
        return self.tok.decode(ids)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def complete(backend: Backend, engine: str, mmap: bool, text: str, max_tokens: int,
             ignore_eos: bool) -> tuple[str, dict]:
    """Greedy generation timed like mawforge.telemetry: TTFT to the first sampled token,
    decode tok/s = (completion_tokens - 1) / (last token - first token)."""
    t0 = time.perf_counter()
    ids = backend.prompt_ids(text)
    out, stamps = [], []
    for tok in backend.tokens(ids, max_tokens, ignore_eos):
        out.append(tok)
        stamps.append(time.perf_counter())
    t_end = time.perf_counter()
    ttft = (stamps[0] - t0) if stamps else t_end - t0
    decode_s = stamps[-1] - stamps[0] if stamps else 0.0
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    tel = {"schema": SCHEMA, "engine": engine, "mmap": mmap, "prompt_tokens": len(ids),
           "completion_tokens": len(out), "ttft_s": ttft, "prefill_s": ttft, "decode_s": decode_s,
           "decode_tok_s": (len(out) - 1) / decode_s if decode_s > 0 else 0.0, "total_s": t_end - t0,
           "rss_bytes": rss, "peak_rss_bytes": peak_rss_bytes(),
           "finish_reason": "length" if len(out) >= max_tokens else "stop"}
    return backend.detokenize(out), tel


def build_app(backend: Backend, engine: str, mmap: bool, model_id: str, max_tokens_default: int):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    lock = threading.Lock()             # one generation at a time, like the MawForge engine thread

    def run(kind: str, body: dict) -> dict:
        text = backend.render(body["messages"]) if kind == "chat" else body["prompt"]
        with lock:
            out, tel = complete(backend, engine, mmap, text, int(body.get("max_tokens") or max_tokens_default),
                                bool(body.get("ignore_eos", False)))
        choice = ({"index": 0, "message": {"role": "assistant", "content": out}} if kind == "chat"
                  else {"index": 0, "text": out})
        return {"id": f"{kind}-{uuid.uuid4().hex[:24]}", "object": "chat.completion" if kind == "chat"
                else "text_completion", "created": int(time.time()), "model": model_id,
                "choices": [choice | {"finish_reason": tel["finish_reason"]}],
                "usage": {"prompt_tokens": tel["prompt_tokens"], "completion_tokens": tel["completion_tokens"],
                          "total_tokens": tel["prompt_tokens"] + tel["completion_tokens"]}, "telemetry": tel}

    def endpoint(kind: str):
        async def handle(request: Request) -> JSONResponse:
            try:
                body = await request.json()
                if not isinstance(body, dict) or ("messages" if kind == "chat" else "prompt") not in body:
                    raise ValueError("missing messages/prompt")
            except ValueError as e:
                return JSONResponse({"error": {"message": f"bad request: {e}", "type": "invalid_request_error"}}, 400)
            try:
                return JSONResponse(await asyncio.to_thread(run, kind, body))
            except Exception as e:   # the engine failed: a 500 with its message, the server stays up
                return JSONResponse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}}, 500)
        return handle

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": model_id, "engine": engine, "mmap": mmap})

    return Starlette(routes=[Route("/health", health),
                             Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
                             Route("/v1/completions", endpoint("completion"), methods=["POST"])])


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    p = argparse.ArgumentParser(prog="python -m mawforge.bench.baselines")
    p.add_argument("--engine", required=True, choices=tuple(Backend.registry))
    p.add_argument("--model", required=True, help="GGUF file (llama_cpp) or HF directory (transformers)")
    p.add_argument("--model-id", default="baseline")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-mmap", action="store_true", help="llama.cpp: read the whole file into memory")
    p.add_argument("--max-tokens-default", type=int, default=96)
    a = p.parse_args(argv)
    mmap = not a.no_mmap
    backend = Backend.registry[a.engine](a.model, a.context, a.threads, mmap)
    app = build_app(backend, a.engine, mmap, a.model_id, a.max_tokens_default)
    sock = socket.create_server((a.host, a.port))
    url = f"http://{a.host}:{sock.getsockname()[1]}"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(f"mawforge baseline: listening on {url} ({a.engine}, mmap {mmap})", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, lambda *_: None)   # uvicorn re-raises SIGTERM after shutdown; exit 0
    Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])
    print("mawforge baseline: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
