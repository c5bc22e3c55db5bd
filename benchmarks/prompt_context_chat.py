"""Long prompts, long contexts and conversations against llama.cpp in one run, each target beside its
verdict: what to run once on a quiet machine to put a CPU kind on the record.

    python benchmarks/prompt_context_chat.py [--steps attention,prompt,context,chat,chat0,chat8] [--rounds 2]
                                 [--context-decode 40 --context-warmup 20] [--dry-run]

Each step is an existing benchmark run as a child, in this order (its rows saved under
work/bench as usual):
  attention  attention.py: the kernel rows (no target; they explain item 3's figures)
  prompt     long_prompt.py --prompts 512,2048 --limits 8 --engines maw,llama-default,llama
  context    long_context.py --contexts 4096,16384,32768 --limits 8 --engines maw,maw-q8,llama,llama-q8
             --limit-engines maw,maw-q8, timing --context-decode steps after --context-warmup
             untimed ones (a limited row then measures a warm expert cache, not its first fill)
  chat       conversation.py --limits 0 --engines mawforge,llama.cpp --workloads agent,chat, resident
             (MawForge preloaded, llama.cpp's default load), --rounds alternating the order
  chat0      conversation.py --limits 0 --engines mawforge --workloads agent,chat (preloaded): MawForge's own
             resident turns, right before chat8's, so the limited / resident ratio pairs runs minutes apart
             (this VM's speed drifts by as much as that target's margin over twenty minutes)
  chat8      conversation.py --limits 8 --engines mawforge --workloads agent,chat
Before each step the machine is checked for quiet (CPU time of the whole machine over 3 s; up to
--wait-quiet seconds of waiting): the verdict table marks a step that started on a busy machine.

Targets (issue 27): prefill of 512 and 2,048 tokens >= 1.0x llama.cpp's (default load and repack
off, each reported); inside 8 GiB the 2,048-token TTFT <= 1.5x resident and prefill reads <=
1.1x the routed experts' bytes; resident decode after the prompt >= 1.2x llama.cpp repack off
(item 5); decode at 4K / 16K / 32K >= 1.0x llama.cpp resident, resident and inside 8 GiB, peak
RSS <= the plan's F; every resident conversation turn's TTFT <= 1.0x llama.cpp's, and inside
8 GiB turns 2 on <= 1.5x MawForge's resident TTFT. Prints the table with the CPU's family and
model, and saves it as work/bench/prompt_context_chat-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import PY, KNOWN_CPUS, cpu_kind, machine, save  # noqa: E402,F401

HERE = Path(__file__).resolve().parent
STEPS = ("attention", "prompt", "context", "chat", "chat0", "chat8")
def commands(a) -> dict[str, list[str]]:
    r = str(a.rounds)
    return {
        "attention": ["attention.py"],
        "prompt": ["long_prompt.py", "--prompts", "512,2048", "--limits", "8", "--rounds", r,
                   "--engines", "maw,llama-default,llama"],
        "context": ["long_context.py", "--contexts", "4096,16384,32768", "--limits", "8",
                    "--engines", "maw,maw-q8,llama,llama-q8", "--limit-engines", "maw,maw-q8",
                    "--decode-tokens", str(a.context_decode), "--warmup", str(a.context_warmup)],
        "chat": ["conversation.py", "--limits", "0", "--engines", "mawforge,llama.cpp", "--workloads", "agent,chat",
                 "--maw-args=--preload", "--rounds", r],
        "chat0": ["conversation.py", "--limits", "0", "--engines", "mawforge", "--workloads", "agent,chat",
                  "--maw-args=--preload"],
        "chat8": ["conversation.py", "--limits", "8", "--engines", "mawforge", "--workloads", "agent,chat"],
    }


def cpu_busy(seconds: float = 3.0) -> float:
    """The share of the machine's CPU time spent busy over `seconds` (0..1), from /proc/stat."""
    def sample():
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(v), v[3] + v[4]          # all, idle + iowait
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(limit_s: float, busy_max: float = 0.05) -> dict:
    """Poll until the machine is quiet or limit_s passes: {"quiet", "busy", "waited_s", "top"}."""
    t0 = time.monotonic()
    while True:
        busy = cpu_busy()
        if busy <= busy_max or time.monotonic() - t0 >= limit_s:
            break
    top = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    return {"quiet": busy <= busy_max, "busy": round(busy, 3), "waited_s": round(time.monotonic() - t0, 1),
            "top": top.splitlines()[1:4]}


def saved_path(output: str) -> str | None:
    """The last `saved PATH` line a benchmark printed (stdout or stderr)."""
    hits = re.findall(r"^saved (\S+\.json)\s*$", output, flags=re.M)
    return hits[-1] if hits else None


def _line(item: int, what: str, value, target: str, ok, note: str = "") -> dict:
    return {"item": item, "what": what, "value": value, "target": target, "met": ok, "note": note}


def prompt_verdicts(rows: list[dict]) -> list[dict]:
    from long_prompt import report
    out = []
    for n, o in report(rows).items():
        for tag, peer in (("llama_cpp_default_load", "its default load"), ("llama_cpp", "repack off")):
            x = o.get(f"prefill_x_{tag}")
            out.append(_line(2, f"resident prefill, {n} tokens / llama.cpp {peer}", x, ">= 1.0",
                             None if x is None else x >= 1.0, "" if x is not None else "row missing or failed"))
        d = o.get("decode_x_llama_cpp")
        out.append(_line(5, f"resident decode after {n} tokens / llama.cpp repack off", d, ">= 1.2",
                         None if d is None else d >= 1.2))
        for k, v in o.items():
            if k.endswith("ttft_x_resident") and n == max(r["prompt_tokens"] for r in rows):
                out.append(_line(2, f"{k.split()[0]} TTFT / resident, {n} tokens", v, "<= 1.5", v <= 1.5))
            if k.endswith("prefill_read_x_needed"):
                out.append(_line(2, f"{k.split()[0]} prefill bytes read / routed experts' bytes, {n} tokens", v,
                                 "<= 1.1", v <= 1.1))
    return out


def context_verdicts(rows: list[dict]) -> list[dict]:
    from long_context import report
    out = []
    for n, o in report(rows).items():
        for e in ("maw", "maw-q8", *[k for k in o if isinstance(o[k], dict) and "@" in k]):
            peer = "llama-q8" if e.startswith("maw-q8") and f"{e}_x_llama-q8" in o else "llama"
            x = o.get(f"{e}_x_{peer}")
            if x is not None:
                out.append(_line(3, f"decode at {n} cached, {e} / {peer} resident", x, ">= 1.0", x >= 1.0))
        for e, v in o.items():
            if isinstance(v, dict) and e.startswith("maw") and v.get("planned_F_gib"):
                ok = v["peak_rss_gib"] <= v["planned_F_gib"]
                out.append(_line(3, f"peak RSS at {n}, {e} (GiB) / plan's F", v["peak_rss_gib"] / v["planned_F_gib"],
                                 "<= 1.0", ok, f"{v['peak_rss_gib']:.2f} of {v['planned_F_gib']:.2f} GiB"))
    return out


def conversation_verdicts(rows: list[dict], against: str) -> list[dict]:
    """Per workload, the worst turn of one ratio of TTFT medians over rounds (every turn in the note):
    against "llama.cpp", MawForge resident over llama.cpp resident; against "resident", each limited
    config over MawForge resident from turn 2 on."""
    from conversation import med
    out = []
    for w in sorted({r["workload"] for r in rows}):
        by = {}
        for r in rows:
            if r["workload"] == w and r.get("status") == "ok":
                by.setdefault((r["config"], r["engine"]), []).append(r)
        turns = max((len(r.get("turns", [])) for rs in by.values() for r in rs), default=0)
        ttft = {k: [med(rs, t, "ttft_s") for t in range(turns)] for k, rs in by.items()}
        if against == "llama.cpp":
            pairs = [(f"{w}: resident TTFT / llama.cpp's, worst turn", ("resident", "mawforge"),
                      ("resident", "llama.cpp"), 0, 1.0)]
        else:
            pairs = [(f"{w}: {c} TTFT / resident, worst of turns 2 on", (c, "mawforge"), ("resident", "mawforge"),
                      1, 1.5) for c in sorted({c for c, _ in by if c != "resident"})]
        for what, num, den, first, target in pairs:
            a, b = ttft.get(num), ttft.get(den)
            rs = [] if not a or not b else [(t + 1, a[t] / b[t]) for t in range(first, turns) if a[t] and b[t]]
            if rs:
                worst = max(v for _, v in rs)
                out.append(_line(4, what, worst, f"<= {target}", worst <= target,
                                 ", ".join(f"{t}: {v:.2f}" for t, v in rs)))
    return out


def verdicts(results: dict[str, dict]) -> list[dict]:
    """The target lines from each step's saved JSON (results[step] = that JSON)."""
    out = []
    if "prompt" in results:
        out += prompt_verdicts(results["prompt"]["rows"])
    if "context" in results:
        out += context_verdicts(results["context"]["rows"])
    rows = lambda *steps: [r for s in steps if s in results for r in results[s]["rows"]]
    if "chat" in results:           # resident against llama.cpp
        out += conversation_verdicts(rows("chat"), "llama.cpp")
    if "chat8" in results:          # inside 8 GiB against MawForge's resident run nearest in time
        own = rows("chat0") or [r for r in rows("chat") if r["engine"] == "mawforge"]
        out += conversation_verdicts(own + rows("chat8"), "resident")
    return out


def table(lines: list[dict], steps: dict, cpu: dict) -> str:
    busy = [s for s, v in steps.items() if not v.get("quiet", {}).get("quiet", True)]
    head = [f"# issue 27 targets, {cpu['kind']} (family {cpu['family']} model {cpu['model']}: {cpu['model_name']}"
            f"{', AMX' if cpu['amx'] else ''})",
            "quiet: every step" if not busy else f"NOT QUIET at the start of: {', '.join(busy)}",
            "| item | measure | value | target | met | turns / note |", "|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    met = lambda m: "n/a" if m is None else ("**yes**" if m else "**no**")
    return "\n".join(head + [f"| {x['item']} | {x['what']} | {fmt(x['value'])} | {x['target']} | {met(x['met'])} | "
                             f"{x['note']} |" for x in lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the prompt and resident chat steps")
    ap.add_argument("--context-decode", type=int, default=40)
    ap.add_argument("--context-warmup", type=int, default=20)
    ap.add_argument("--wait-quiet", type=float, default=120, help="seconds to wait for a quiet machine per step")
    ap.add_argument("--from-json", nargs="*", default=[], metavar="STEP=PATH",
                    help="take a step's rows from a saved JSON instead of running it")
    ap.add_argument("--out", type=Path,
                    help="where the verdicts' JSON goes (default: work/bench/prompt_context_chat-*.json)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    a = ap.parse_args()
    steps = [s for s in a.steps.split(",") if s]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        ap.error(f"unknown steps {bad}; choose from {', '.join(STEPS)}")
    cmds, given = commands(a), dict(x.split("=", 1) for x in a.from_json if "=" in x)
    bad = [x for x in a.from_json if "=" not in x or x.split("=", 1)[0] not in STEPS
           or not Path(x.split("=", 1)[1]).is_file()]
    if bad:
        ap.error(f"--from-json takes STEP=PATH with a step of {', '.join(STEPS)} and a saved JSON file: {bad}")
    if a.dry_run:
        for s in steps:
            print(f"{s}: {PY} {HERE / cmds[s][0]} {' '.join(cmds[s][1:])}")
        return 0
    cpu, record, results = cpu_kind(), {}, {}
    print(f"# {machine()}; {cpu['kind']}", flush=True)
    for s in steps:
        if s in given:
            results[s] = json.loads(Path(given[s]).read_text())
            record[s] = {"from": given[s]}
            continue
        quiet = wait_quiet(a.wait_quiet)
        t0 = time.strftime("%H:%M:%S", time.gmtime())
        print(f"## {s} from {t0} UTC ({'quiet' if quiet['quiet'] else 'BUSY'} {quiet['busy']:.0%})", flush=True)
        p = subprocess.run([PY, str(HERE / cmds[s][0]), *cmds[s][1:]], capture_output=True, text=True)
        print(p.stdout[-4000:], flush=True)
        path = saved_path(p.stdout + "\n" + p.stderr)
        record[s] = {"cmd": cmds[s], "start_utc": t0, "end_utc": time.strftime("%H:%M:%S", time.gmtime()),
                     "rc": p.returncode, "quiet": quiet, "saved": path}
        if p.returncode or not path:
            print(f"{s} failed (rc {p.returncode}):\n{p.stderr[-3000:]}", flush=True)
            continue
        results[s] = json.loads(Path(path).read_text())
    lines = verdicts(results)
    print(table(lines, record, cpu))
    data = {"machine": machine(), "cpu": cpu, "steps": record, "verdicts": lines}
    if a.out:
        a.out.write_text(json.dumps(data, indent=1))
    print(f"saved {a.out or save('prompt_context_chat', data)}")
    return 0 if all(x["met"] is not False for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
