"""Conversations and agents at the speed of the first token (issue 27, item 4): every turn resends
the whole conversation, as a chat client or an agent does, and the first token's wait is timed at
the client. Two workloads, seeded text, nothing downloaded:

  chat   a system message and three user turns of ~200 words each, a fixed assistant reply between
         them (the issue's three-turn chat)
  agent  a 10-turn agent loop: a ~1,500-token system prompt with six JSON-schema tools; each turn a
         user message or a tool result (100-200 tokens) answering the assistant's previous tool
         call. The assistant turns are fixed text and tool calls written by the benchmark, not the
         model's output, so every engine sees the same prompts.

Engines, one at a time, each in its own process on a dropped page cache (in a cgroup v1 memory
limit for a limit; the order alternates between --rounds):
  mawforge   `mawforge serve` (--memory-budget-gib 0.92 x limit), the openai client, streamed
  llama.cpp  llama-cpp-python in a worker child, fed the token ids of MawForge's chat template
             (its default prefix reuse keeps the longest common prefix of the previous call)
  fastllm    `ftllm serve` (1.9.0) on the same GGUF, 1 thread (its default), its disk-MoE mode with
             an expert cache of limit - 4.5 GiB under a limit (its KV pool and dense weights take
             ~4), of the file's size resident
All engines render with Qwen3's own chat template (Qwen3-30B-A3B ships the one llama.cpp keeps as
Qwen-Qwen3-0.6B.jinja, read from the pinned llama-cpp-python sdist; benchmarks/qwen_tools.jinja,
Qwen2.5's tool format, when the sdist is missing): the files' own ChatML template cannot show
tools. max_tokens 8 per turn, greedy.

    python benchmarks/conversation.py [--limits 0,8] [--rounds 2] [--workloads chat,agent]
    python benchmarks/conversation.py --gguf mawforge/demo/mawforge-demo-qwen3moe-Q4_K_M.gguf --scale 0.1 --limits 0

Per workload, configuration and engine: each turn's prompt tokens, cached tokens, TTFT and decode
tok/s (medians over rounds); then the issue's ratios: MawForge resident TTFT / llama.cpp resident
TTFT per turn (target <= 1.0), and under a limit MawForge's TTFT / its own resident TTFT (turn 2
on, target <= 1.5) and / fastllm's at the same limit (target < 1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import conv_engines as E  # noqa: E402
from common import ROOT, WORK, fullsize_model, machine, pack_of, save, worker_row  # noqa: E402

FALLBACK_TEMPLATE = Path(__file__).with_name("qwen_tools.jinja")
THREADS = int(os.environ.get("MAWFORGE_BENCH_THREADS", "2"))
WORDS = ("the system data model memory request server token cache layer expert budget file disk read write "
         "time value state table field number result error config option client answer question message "
         "reason design change update review test build release version branch commit patch issue note "
         "plan step phase limit size count rate speed first last next early late small large quick slow "
         "careful clear simple strong quiet busy open close start stop keep drop move copy check measure "
         "compare explain describe summarize report list find show give take make use run load save send "
         "receive river mountain garden kitchen window morning evening winter summer market village story").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text_of_tokens(tok, rng: random.Random, n: int) -> str:
    """Seeded words whose tokens number n (the fewest words that reach it)."""
    pool = words(rng, 4 * n + 8).split()
    lo, hi = 1, len(pool)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.encode(" ".join(pool[:mid]), add_special=False)) >= n:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(pool[:lo])


def _fn(name: str, desc: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


S, I, B = ({"type": "string"}, {"type": "integer"}, {"type": "boolean"})
TOOLS = [
    _fn("read_file", "Read a text file of the repository and return its lines.",
        {"path": {**S, "description": "path relative to the repository root"},
         "start": {**I, "description": "first line, 1-based"}, "end": {**I, "description": "last line"}}, ["path"]),
    _fn("write_file", "Replace a file's contents, creating it if needed.",
        {"path": S, "content": {**S, "description": "the whole new text"}}, ["path", "content"]),
    _fn("run_shell", "Run a shell command in the repository and return its output and exit status.",
        {"command": S, "timeout_s": {**I, "description": "seconds before it is killed"}}, ["command"]),
    _fn("search_code", "Search the repository for a regular expression.",
        {"pattern": S, "glob": {**S, "description": "only files matching this glob"},
         "ignore_case": B, "max_results": I}, ["pattern"]),
    _fn("list_directory", "List a directory's entries with their sizes.",
        {"path": S, "recursive": B, "max_depth": I}, ["path"]),
    _fn("http_get", "Fetch a URL and return the response body as text.",
        {"url": {**S, "format": "uri"}, "headers": {"type": "object", "additionalProperties": S},
         "method": {**S, "enum": ["GET", "HEAD"]}}, ["url"]),
]
REPLY = ("Thank you, that is clear. Here is a short summary of what you wrote, and the two points I "
         "would look at first before going further.")


def chat_workload(scale: float, seed: int) -> dict:
    rng = random.Random(seed)
    msgs, turns = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}], []
    for k in range(3):
        if k:
            msgs.append({"role": "assistant", "content": REPLY})
        msgs.append({"role": "user", "content": words(rng, max(8, round(200 * scale)))})
        turns.append([dict(m) for m in msgs])
    return {"tools": None, "turns": turns}


def agent_workload(render, tok, scale: float, seed: int) -> dict:
    """10 requests; system + tools ~1,500 tokens x scale; tool results of 100-200 tokens x scale."""
    rng = random.Random(seed + 1)
    base = len(render([{"role": "system", "content": ""}], TOOLS))
    system = text_of_tokens(tok, rng, max(16, round(1500 * scale) - base))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": words(rng, max(8, round(60 * scale)))}]
    turns = [[dict(m) for m in msgs]]
    for k in range(1, 10):
        if k == 5:       # the agent reports back, the user asks for more
            msgs += [{"role": "assistant", "content": REPLY},
                     {"role": "user", "content": words(rng, max(8, round(60 * scale)))}]
        else:
            fn = TOOLS[k % len(TOOLS)]["function"]
            args = {p: words(rng, 12) if p == "content" else f"src/{rng.choice(WORDS)}_{k}.py"
                    for p in fn["parameters"]["required"]}
            msgs += [{"role": "assistant", "content": "", "tool_calls": [
                         {"id": f"call_{k}", "type": "function",
                          "function": {"name": fn["name"], "arguments": json.dumps(args)}}]},
                     {"role": "tool", "tool_call_id": f"call_{k}",
                      "content": text_of_tokens(tok, rng, max(8, round(rng.randint(100, 200) * scale)))}]
        turns.append([dict(m) for m in msgs])
    return {"tools": TOOLS, "turns": turns}


def qwen3_template() -> Path:
    from mawforge.fixtures.sdist_templates import SdistMissing, template_dir
    try:
        return template_dir() / "Qwen-Qwen3-0.6B.jinja"
    except SdistMissing as e:
        print(f"no llama-cpp-python sdist ({e}): Qwen2.5's template {FALLBACK_TEMPLATE.name} instead", flush=True)
        return FALLBACK_TEMPLATE


def renderer(pack: Path, template: Path):
    """(render(messages, tools) -> token ids, tokenizer): the prompt `mawforge serve` builds for
    the same request with --chat-template-file template."""
    from mawforge.text.chat import ChatTemplate
    from mawforge.text.tokenizer import load_tokenizer
    from mawforge.pack.manifest import read_manifest
    from mawforge.front.chatreq import ChatDefaults, ChatFront, parse_chat_options
    tok = load_tokenizer(pack, read_manifest(pack).tokenizer)
    front = ChatFront(ChatTemplate(template.read_text(), tok.chat.bos, tok.chat.eos), ChatDefaults())

    def render(messages: list, tools: list | None) -> list[int]:
        body = {"messages": messages, **({"tools": tools} if tools else {})}
        return tok.encode(front.prepare(parse_chat_options(body, messages)).prompt)
    return render, tok


# ---- worker (llama.cpp child) ------------------------------------------------------------------
def worker(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("worker")
    for k in ("--model", "--requests"):
        ap.add_argument(k, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--turn-timeout", type=float, default=1800)
    a = ap.parse_args(argv)
    requests = json.loads(Path(a.requests).read_text())
    E.emit_json(E.llama_turns(a.model, requests, a.context, THREADS, a.max_tokens, a.no_repack, a.turn_timeout,
                              E.emit_json))
    return 0


# ---- driver ------------------------------------------------------------------------------------
def run_engine(name: str, a, wl: dict, ids: list[list[int]], gib: float | None, gguf: Path, pack: Path,
               context: int, tag: str) -> dict:
    limit = int(gib * E.GiB) if gib else None
    log = WORK / f"conv-{tag}.log"
    if name == "llama.cpp":
        req = WORK / f"conv-{tag}.ids.json"
        req.write_text(json.dumps(ids))
        # under a limit its default load (the weights copied into repacked buffers) cannot fit
        repack_off = a.llama_repack_off or limit is not None
        args = ["--model", str(gguf), "--requests", str(req), "--context", str(context),
                "--turn-timeout", str(a.turn_timeout)] + (["--no-repack"] if repack_off else [])
        r = worker_row(__file__, args, limit, timeout=a.turn_timeout * len(ids) + 600)
        r["load"] = "repack off" if repack_off else "default"
        return r
    if name == "mawforge":
        cmd = E.maw_command(pack, a.chat_template, context, THREADS, gib, not _tied(pack), a.maw_args.split())
        srv = E.Server(cmd, log, limit)
        return E.serve_turns(srv, E.maw_url, wl, a.max_tokens, a.turn_timeout, a.ready_timeout)
    port = E.free_port()
    cache = max(0.5, gib - 4.5) if gib else max(0.5, 1.05 * os.path.getsize(gguf) / E.GiB)
    cmd = E.ftllm_command(a.ftllm_venv, a.ftllm_extra, gguf, a.chat_template, port, context, cache)
    r = E.serve_turns(E.Server(cmd, log, limit), E.probe_url(port), wl, a.max_tokens, a.turn_timeout,
                      a.ready_timeout)
    r["moe_cpu_cache_gib"] = cache
    return r


def _tied(pack: Path) -> bool:
    from mawforge.pack.manifest import read_manifest
    return bool(read_manifest(pack).config.tie_embeddings)


def med(rows: list[dict], turn: int, key: str):
    xs = [r["turns"][turn][key] for r in rows
          if turn < len(r.get("turns", [])) and r["turns"][turn].get(key) is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(rows: list[dict], workloads: dict, configs: list[str], engines: list[str]) -> None:
    for w, wl in workloads.items():
        n = len(wl["turns"])
        by = {(c, e): [r for r in rows if (r["workload"], r["config"], r["engine"]) == (w, c, e)]
              for c in configs for e in engines}
        for (c, e), rs in by.items():
            if not rs:
                continue
            peak = max(r.get("peak_rss_bytes") or r.get("cgroup", {}).get("peak_rss_bytes") or 0 for r in rs)
            up = statistics.median(r.get("ready_s") or r.get("load_s") or 0 for r in rs)
            print(f"\n## {w} / {c} / {e}: " + ", ".join(r["status"] for r in rs) + f"; load/ready {up:.1f} s, "
                  f"peak RSS {peak / E.GiB:.2f} GiB" + (f" ({rs[0]['load']} load)" if "load" in rs[0] else ""))
            print(f"{'turn':>4s} {'prompt':>7s} {'cached':>7s} {'TTFT s':>8s} {'tok/s':>7s} {'server TTFT':>11s} "
                  f"{'prefill read GB':>15s}")
            for t in range(n):
                tel = [r["turns"][t]["telemetry"] for r in rs if t < len(r["turns"]) and "telemetry" in r["turns"][t]]
                st = statistics.median(x["ttft_s"] for x in tel) if tel else None
                rb = statistics.median(x["prefill_read_bytes"] or 0 for x in tel) / 1e9 if tel else None
                timeouts = sum(1 for r in rs if t < len(r["turns"]) and r["turns"][t].get("status") == "timeout")
                print(f"{t + 1:4d} {fmt(med(rs, t, 'prompt_tokens'), '.0f'):>7s} "
                      f"{fmt(med(rs, t, 'cached_tokens'), '.0f'):>7s} {fmt(med(rs, t, 'ttft_s')):>8s} "
                      f"{fmt(med(rs, t, 'decode_tok_s')):>7s} {fmt(st):>11s} {fmt(rb):>15s}"
                      + (f"  ({timeouts} timeout)" if timeouts else ""))
        print(f"\n## {w}: ratios of TTFT medians (turn: value)")
        ttft = {k: [med(rs, t, "ttft_s") for t in range(n)] for k, rs in by.items()}

        def ratio(num, den, first: int = 0) -> str:
            a, b = ttft.get(num), ttft.get(den)
            if not a or not b:
                return "n/a"
            return ", ".join(f"{t + 1}: {a[t] / b[t]:.2f}x" for t in range(first, n) if a[t] and b[t]) or "n/a"
        print("mawforge resident / llama.cpp resident (target <= 1.0): "
              + ratio(("resident", "mawforge"), ("resident", "llama.cpp")))
        for c in configs[1:]:
            print(f"mawforge {c} / mawforge resident, turn 2 on (target <= 1.5): "
                  f"{ratio((c, 'mawforge'), ('resident', 'mawforge'), 1)}")
            print(f"mawforge {c} / fastllm {c} (target < 1): {ratio((c, 'mawforge'), (c, 'fastllm'))}")
            print(f"llama.cpp {c} / llama.cpp resident: {ratio((c, 'llama.cpp'), ('resident', 'llama.cpp'))}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="another GGUF (default: the full-size 48-layer synthetic file)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--routing", choices=("zipf", "real"), default="zipf",
                    help="the full-size file's routing: zipf (skew 1.0, stickiness 0.3) or real (synth --routing real)")
    ap.add_argument("--limits", default="0,8", help="GiB; 0 = resident (the whole model in memory)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every row, alternating the engine order")
    ap.add_argument("--workloads", default="chat,agent")
    ap.add_argument("--engines", default="mawforge,llama.cpp,fastllm")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the word and token counts (0.1 for a smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--turn-timeout", type=float, default=900, help="seconds a turn may take before the row stops")
    ap.add_argument("--ready-timeout", type=float, default=1200, help="seconds a server may take to come up")
    ap.add_argument("--llama-repack-off", action="store_true", help="llama.cpp's repack-off load (mmap)")
    ap.add_argument("--chat-template", type=Path, help="a jinja chat template for every engine (default: Qwen3's)")
    ap.add_argument("--maw-args", default="", help="extra `mawforge serve` arguments")
    ap.add_argument("--ftllm-venv", type=Path, default=ROOT / "work" / "ftllm-venv")
    ap.add_argument("--ftllm-sys-path", default="",
                    help="folders appended to fastllm's sys.path for packages its --no-deps venv lacks")
    a = ap.parse_args()
    gguf = a.gguf.resolve() if a.gguf else fullsize_model(a.layers, a.routing)
    if a.gguf:                  # packed beside a link under work/bench, not beside the file
        WORK.mkdir(parents=True, exist_ok=True)
        link = WORK / gguf.name
        if not link.exists():
            link.symlink_to(gguf)
        gguf = link
    pack = pack_of(gguf)
    a.ftllm_extra = [p for p in a.ftllm_sys_path.split(os.pathsep) if p]
    a.chat_template = (a.chat_template or qwen3_template()).resolve()
    render, tok = renderer(pack, a.chat_template)
    workloads = {"chat": chat_workload(a.scale, a.seed), "agent": agent_workload(render, tok, a.scale, a.seed)}
    workloads = {w: workloads[w] for w in a.workloads.split(",") if w}
    ids = {w: [render(m, wl["tools"]) for m in wl["turns"]] for w, wl in workloads.items()}
    engines = [e for e in a.engines.split(",") if e]
    if "fastllm" in engines:
        why = E.ftllm_check(a.ftllm_venv, a.ftllm_extra)
        if why is not None:
            print(f"fastllm skipped: {why}", flush=True)
            engines.remove("fastllm")
    limits = [float(x) for x in a.limits.split(",") if x.strip()]
    configs = ["resident" if not g else f"{g:g} GiB" for g in limits]
    rows = []
    for w, wl in workloads.items():
        context = 256 * math.ceil((len(ids[w][-1]) + a.max_tokens + 64) / 256)
        for gib, config in zip(limits, configs):
            for k in range(a.rounds):
                for name in (engines if k % 2 == 0 else engines[::-1]):
                    tag = f"{w}-{config.replace(' ', '')}-{name}-{k}-{time.strftime('%H%M%S')}"
                    r = run_engine(name, a, wl, ids[w], gib or None, gguf, pack, context, tag)
                    r.update(workload=w, config=config, engine=name, round=k, context=context)
                    r.setdefault("status", "failed")
                    rows.append(r)
                    print(json.dumps({"workload": w, "config": config, "engine": name, "round": k,
                                      "status": r["status"], "error": r.get("error") or r.get("stderr_tail"),
                                      "ttft_s": [round(t["ttft_s"], 3) for t in r.get("turns", []) if "ttft_s" in t]}),
                          flush=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    print(f"\n# conversation benchmark, {machine()}, {stamp}, {THREADS} threads (fastllm 1), file {gguf.name} "
          f"({os.path.getsize(gguf) / 1e9:.2f} GB), scale {a.scale}, max_tokens {a.max_tokens}, "
          f"llama.cpp resident {'repack off' if a.llama_repack_off else 'default load'}, "
          f"template {a.chat_template.name}")
    report(rows, workloads, configs, engines)
    print(f"saved {save('conversation', {'machine': machine(), 'date': stamp, 'args': vars(a), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
