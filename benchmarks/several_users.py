"""Several users at once (issue 30, item 3): 1, 2, 4 and 8 concurrent streams of greedy chat on the
full-size file, resident and inside a cgroup v1 memory limit, MawForge against llama.cpp in the
same run.

  mawforge   `mawforge serve --max-batch 8` (continuous batching: every active stream advances in
             one step, each routed expert read once for all of them), driven by N client threads
             with the official openai client, streamed, all sent at once
  llama.cpp  llama.cpp's own batched decode, as llama-server with -np N runs it: llama-cpp-python's
             low-level API in a worker child (one context of N sequences, kv_unified; the N prompts
             in one batch, then one llama_decode of N tokens a step), repack off (the load that
             mmaps the file: its default load needs more memory than this machine has)

Each stream's prompt is a chat-template-rendered user message of seeded words (--prompt-tokens,
different for each stream) as token ids, the same ids for both engines; `ignore_eos`, --tokens
generated each. Per (limit, engine, N): per-stream TTFT (median and max) and decode tok/s,
aggregate tok/s (all tokens over the wall time from sending to the last stream's end), and bytes
read from storage per generated token (the server process's /proc/PID/io read_bytes, prompts
included). Both engines first run one warm-up stream (a long prompt); resident, MawForge also
preloads its whole expert cache (`serve --preload`) and llama.cpp's warm-up pages in what it
touches.

    python benchmarks/several_users.py [--streams 1,2,4,8] [--limits 0,8] [--tokens 32] [--prompt-tokens 128]

Targets (issue 30): inside 8 GiB, 4 streams >= 2.5x the aggregate tok/s of one and <= 0.5x the
bytes per generated token; resident 4 streams >= 2x; at 4 streams no stream's TTFT above 2x its
solo TTFT.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import conv_engines as E  # noqa: E402
from common import WORK, machine, pack_of, save, synth_model, worker_row  # noqa: E402
from conversation import text_of_tokens  # noqa: E402

THREADS = int(os.environ.get("MAWFORGE_BENCH_THREADS", "2"))
GiB = 2**30


def prompts(pack: Path, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts (token ids) of about `tokens` tokens each, rendered with the pack's template."""
    from mawforge.pack.manifest import read_manifest
    from mawforge.text.tokenizer import load_tokenizer
    tok = load_tokenizer(pack, read_manifest(pack).tokenizer)
    out = []
    for i in range(n):
        render = lambda body: tok.encode(tok.chat.render([{"role": "user", "content": body}]), add_special=False)
        head = f"Stream {i}. Summarize: "
        body = text_of_tokens(tok, random.Random(seed * 1000 + i), max(1, tokens - len(render(head))))
        out.append(render(head + body))
    return out


def proc_read_bytes(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/io"):
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def summarize(streams: list[dict], wall: float, read: int, decode_read: int | None = None) -> dict:
    """decode_read: bytes read from the moment every stream had its first token to the end (the
    reads of batched decode alone, prompts excluded)."""
    toks = sum(s["completion_tokens"] for s in streams)
    later = toks - len(streams)
    ttft = [s["ttft_s"] for s in streams]
    dec = [s["decode_tok_s"] for s in streams if s.get("decode_tok_s")]
    return {"streams": len(streams), "tokens": toks, "wall_s": wall, "aggregate_tok_s": toks / wall,
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "per_stream_tok_s": statistics.median(dec) if dec else None,
            "read_bytes": read, "read_bytes_per_token": read / toks if toks else None,
            "decode_read_bytes_per_token": decode_read / later if decode_read is not None and later > 0 else None,
            "per_stream": streams}


# ---- MawForge: the server and N client threads ---------------------------------------------
def run_mawforge(pack: Path, reqs: list[list[int]], counts: list[int], tokens: int, limit_gib: float | None,
                 warm: list[int], log: Path) -> list[dict]:
    import openai
    context = max(len(r) for r in reqs + [warm]) + tokens + 16
    cmd = [sys.executable, "-m", "mawforge.cli", "serve", "--pack", str(pack), "--port", "0", "--model-id",
           E.MODEL_ID, "--context", str(context), "--threads", str(THREADS), "--max-batch", str(max(counts)),
           "--max-waiting", "16", "--no-dashboard"]
    cmd += (["--expert-cache-percent", "100", "--preload"] if limit_gib is None
            else ["--memory-budget-gib", f"{0.92 * limit_gib:.3f}"])
    server = E.Server(cmd, log, int(limit_gib * GiB) if limit_gib else None)
    rows = []
    try:
        server.ready(E.maw_url, 900)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=3600)

        def one(ids, out, i):
            t0 = time.perf_counter()
            out[i] = E.timed_stream(client.completions.create(
                model=E.MODEL_ID, prompt=ids, max_tokens=tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}), t0)
        one(warm, [None], 0)
        for n in counts:
            out = [None] * n
            r0, t0 = proc_read_bytes(server.proc.pid), time.perf_counter()
            samples, done = [], threading.Event()

            def sample():                   # (time, read_bytes) every 0.1 s: the reads after the last first token
                while not done.wait(0.1):
                    samples.append((time.perf_counter(), proc_read_bytes(server.proc.pid)))
            threads = [threading.Thread(target=one, args=(reqs[i], out, i)) for i in range(n)]
            watcher = threading.Thread(target=sample)
            watcher.start()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            done.set()
            watcher.join()
            end = proc_read_bytes(server.proc.pid)
            first_all = t0 + max(o["ttft_s"] for o in out)
            at = next((b for t, b in samples if t >= first_all), end)
            rows.append(summarize(out, time.perf_counter() - t0, end - r0, end - at))
            print(f"  mawforge {n} streams: {rows[-1]['aggregate_tok_s']:.2f} tok/s aggregate, TTFT max "
                  f"{rows[-1]['ttft_max_s']:.1f} s", file=sys.stderr, flush=True)
    finally:
        stats = server.close()
    for r in rows:
        r["peak_rss_bytes"] = stats.get("peak_rss_bytes")
    return rows


# ---- llama.cpp: its batched decode in a worker child ---------------------------------------
def llama_worker(a) -> None:
    import ctypes

    import llama_cpp
    import numpy as np

    from common import llama_repack_off
    llama_repack_off()
    reqs, warm, counts = json.loads(Path(a.requests).read_text())
    n_max = max(counts)
    per = max(len(r) for r in reqs + [warm]) + a.tokens + 16
    base = llama_cpp.llama_cpp.llama_context_default_params

    def params():
        p = base()
        p.n_seq_max, p.kv_unified = n_max, True
        return p
    llama_cpp.llama_cpp.llama_context_default_params = params
    llama_cpp.llama.llama_cpp.llama_context_default_params = params
    llm = llama_cpp.Llama(a.model, n_ctx=per * n_max, n_batch=512, n_ubatch=512, n_threads=THREADS,
                          n_threads_batch=THREADS, verbose=False)
    ctx, vocab = llm.ctx, llm.n_vocab()
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(512, 0, n_max)

    def decode(items):
        """items: (token, pos, seq, wants_logits); in batches of 512; returns {seq: logits row}."""
        got = {}
        for s in range(0, len(items), 512):
            part = items[s:s + 512]
            batch.n_tokens = len(part)
            for j, (tok, pos, seq, want) in enumerate(part):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
                batch.seq_id[j][0], batch.logits[j] = seq, want
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for j, (_, _, seq, want) in enumerate(part):
                if want:
                    p = llama_cpp.llama_get_logits_ith(ctx, j)
                    got[seq] = np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_float)), (vocab,))
        return got

    def run(prompt_list):
        llama_cpp.llama_memory_clear(mem, True)
        n = len(prompt_list)
        t0 = time.perf_counter()
        items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompt_list) for i, t in enumerate(p)]
        logits = decode(items)
        first = [None] * n
        toks = [[int(np.argmax(logits[s]))] for s in range(n)]
        t1 = time.perf_counter()
        first = [t1 - t0] * n
        r1 = proc_read_bytes(os.getpid())
        for step in range(1, a.tokens):
            logits = decode([(toks[s][-1], len(prompt_list[s]) + step - 1, s, True) for s in range(n)])
            for s in range(n):
                toks[s].append(int(np.argmax(logits[s])))
        t2 = time.perf_counter()
        return ([{"ttft_s": first[s], "completion_tokens": a.tokens,
                  "decode_tok_s": (a.tokens - 1) / (t2 - t1) if a.tokens > 1 else None} for s in range(n)], t2 - t0,
                proc_read_bytes(os.getpid()) - r1)
    run([warm])
    rows = []
    for n in counts:
        r0 = proc_read_bytes(os.getpid())
        streams, wall, decode_read = run(reqs[:n])
        rows.append(summarize(streams, wall, proc_read_bytes(os.getpid()) - r0, decode_read))
        print(f"  llama.cpp {n} streams: {rows[-1]['aggregate_tok_s']:.2f} tok/s aggregate", file=sys.stderr,
              flush=True)
        print(json.dumps({"rows": rows}), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        ap = argparse.ArgumentParser()
        ap.add_argument("worker")
        ap.add_argument("--model")
        ap.add_argument("--requests")
        ap.add_argument("--tokens", type=int)
        return llama_worker(ap.parse_args())
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--gguf", default=None, help="another GGUF (default: the full-size synthetic file)")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--limits", default="0,8", help="GiB; 0 = resident")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--warm-tokens", type=int, default=512, help="the warm-up stream's prompt")
    ap.add_argument("--engines", default="mawforge,llama.cpp")
    a = ap.parse_args()
    gguf = Path(a.gguf) if a.gguf else synth_model(a.layers, "Q4_K_M", 1.0, 0.3)
    pack = pack_of(gguf)
    counts = [int(x) for x in a.streams.split(",")]
    reqs = prompts(pack, max(counts), a.prompt_tokens)
    warm = prompts(pack, 1, a.warm_tokens, seed=99)[0]
    WORK.mkdir(parents=True, exist_ok=True)
    req_file = WORK / "several-users-requests.json"
    req_file.write_text(json.dumps([reqs, warm, counts]))
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "file": str(gguf),
              "tokens": a.tokens, "prompt_tokens": [len(r) for r in reqs], "threads": THREADS, "runs": {}}
    for lim in [float(x) for x in a.limits.split(",")]:
        limit = lim or None
        key = f"{lim:g} GiB" if limit else "resident"
        for engine in a.engines.split(","):
            print(f"{key}: {engine}", file=sys.stderr, flush=True)
            if engine == "mawforge":
                rows = run_mawforge(pack, reqs, counts, a.tokens, limit, warm, WORK / "several-users-serve.log")
            else:
                r = worker_row(__file__, ["--model", str(gguf), "--requests", str(req_file), "--tokens",
                                          str(a.tokens)], limit_bytes=int(limit * GiB) if limit else None,
                               timeout=7200)
                rows = r.get("rows", [])
                if r["status"] != "ok":
                    rows.append({"status": r["status"], "stderr": r.get("stderr_tail")})
            result["runs"][f"{key} {engine}"] = rows
    print(json.dumps(report(result), indent=1))
    print(f"saved {save('several-users', result)}", file=sys.stderr)


def _mb(x):
    return round(x / 1e6, 1) if x is not None else None


def _ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def report(result: dict) -> dict:
    """Per configuration: each engine's aggregate tok/s and scaling, and the issue's ratios."""
    out = {}
    for key, rows in result["runs"].items():
        ok = [r for r in rows if "aggregate_tok_s" in r]
        if not ok:
            out[key] = rows
            continue
        solo = ok[0]
        out[key] = [{"streams": r["streams"], "aggregate_tok_s": round(r["aggregate_tok_s"], 3),
                     "x_one_stream": round(r["aggregate_tok_s"] / solo["aggregate_tok_s"], 2),
                     "per_stream_tok_s": r["per_stream_tok_s"] and round(r["per_stream_tok_s"], 3),
                     "ttft_median_s": round(r["ttft_median_s"], 2), "ttft_max_s": round(r["ttft_max_s"], 2),
                     "ttft_max_x_solo": round(r["ttft_max_s"] / solo["ttft_median_s"], 2),
                     "read_MB_per_token": r["read_bytes_per_token"] and round(r["read_bytes_per_token"] / 1e6, 1),
                     "read_x_one_stream": (round(r["read_bytes_per_token"] / solo["read_bytes_per_token"], 2)
                                           if solo["read_bytes_per_token"] else None),
                     "decode_read_MB_per_token": _mb(r.get("decode_read_bytes_per_token")),
                     "decode_read_x_one_stream": _ratio(r.get("decode_read_bytes_per_token"),
                                                        solo.get("decode_read_bytes_per_token")),
                     "decode_tok_s_aggregate": (round(r["per_stream_tok_s"] * r["streams"], 3)
                                                if r["per_stream_tok_s"] else None)} for r in ok]
    for key in [k for k in out if k.endswith(" mawforge")]:
        peer = key.replace(" mawforge", " llama.cpp")
        if peer in out and isinstance(out[peer], list) and isinstance(out[key], list):
            by = {r["streams"]: r for r in out[peer]}
            for r in out[key]:
                p = by.get(r["streams"])
                if p:
                    r["x_llama_cpp_aggregate"] = round(r["aggregate_tok_s"] / p["aggregate_tok_s"], 2)
    return out


if __name__ == "__main__":
    main()
