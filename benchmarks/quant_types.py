"""Decode and prefill on every quant type people download, MawForge against llama.cpp
(llama-cpp-python, repack off: the load that mmaps the file and can page, as MawForge's reads do)
in the same run, engines alternating, whole model in memory, the same thread count.

    python benchmarks/quant_types.py [--layers 4] [--types Q2_K,IQ4_XS,...] [--rounds 1]
                                     [--prompt-tokens 512] [--decode-tokens 24]

One F16 shape-true Qwen3-30B-A3B GGUF (`mawforge synth --quant F16`) is requantized to each type by
llama.cpp's own quantizer (mawforge/fixtures/requant.py: llama_model_quantize for the llama ftypes,
ggml_quantize_chunk on the routed experts for the IQ2 / IQ1 types, which need an importance
matrix). Each row: decode tok/s teacher-forced on random tokens after a prompt of random tokens
(never greedy: on random weights greedy repeats one token and one set of experts), and the
prompt's prefill tok/s (MawForge in one chunk of the prompt's length, llama.cpp n_batch 512).
Prints the table with each type's ratios and writes one JSON record (CPU, commit, command, quiet
check before and after) to work/bench and, with --record, to benchmarks/records/.

    python benchmarks/quant_types.py --report RECORD.json [...]   # the README's table from records
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import (ROOT, WORK, commit, cpu_kind, machine, median, pack_of, quiet, save,  # noqa: E402
                    synth_model, worker_row)

DECODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py")
# every type of the every-quant-type work, as a user's file carries it: the llama ftype, or (IQ2 / IQ1)
# the experts in that type over llama.cpp's Q4_K_M mix
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "IQ4_NL", "IQ4_XS",
         "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4_MOE", "BF16", "F16")


# IQ2 / IQ1 experts: ggml's grid search quantizes 16 experts of each tensor, repeated over the 128
# (requant.py: all 128 take 5-20 minutes a type on 2 cores); each expert keeps its own bytes
DISTINCT = 16
# llama ftypes made the same way for time: llama.cpp's IQ3_S and IQ4_NL search every block of all 128 experts
# (over 10 minutes on 2 cores for 4 layers)
GGML_FOR_TIME = ("IQ3_S", "IQ4_NL")


def quant_file(source: Path, name: str, layers: int) -> Path:
    from mawforge.fixtures.requant import GGML_EXPERT_TYPES, quantize_gguf
    if name == "F16":
        return source
    out = WORK / f"qwen3moe-L{layers}-{name}-from-F16.gguf"
    if not out.exists():
        t0 = time.perf_counter()
        by_ggml = name in GGML_EXPERT_TYPES or name in GGML_FOR_TIME
        base = quant_file(source, "Q4_K_M", layers) if by_ggml else None
        quantize_gguf(source, out.with_suffix(".part"), name, distinct_experts=DISTINCT, base=base,
                      experts_by_ggml=name in GGML_FOR_TIME)
        out.with_suffix(".part").rename(out)
        print(f"# made {out.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def report(paths: list[Path], columns: int = 2) -> str:
    """The Markdown table of records (later records' rows replace earlier ones of the same type):
    decode and prefill ratios with each record's commit; `columns` types side by side (README)."""
    rows: dict[str, dict] = {}
    for path in paths:
        rec = json.loads(Path(path).read_text())
        for r in rec["rows"]:
            rows[r["type"]] = {**r, "commit": rec["commit"], "cpu": rec["cpu"]}
    f = lambda v: f"{v:.2f}x" if isinstance(v, (int, float)) else "-"
    cells = [f"{t} ({r['experts']}) | {f(r['decode_tok_s_ratio'])} | {f(r['prefill_tok_s_ratio'])}"
             for t, r in rows.items()]
    cells += [" | | "] * (-len(cells) % columns)
    per = len(cells) // columns
    return "\n".join("| " + " | ".join(cells[i + per * c] for c in range(columns)) + " |" for i in range(per))


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report([Path(p) for p in sys.argv[2:]]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rounds", type=int, default=1, help="alternating llama.cpp / MawForge pairs per type")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--record", action="store_true", help="also write the record to benchmarks/records/")
    ap.add_argument("--keep-packs", action="store_true", help="keep each type's pack (default: removed after its "
                    "rows: every type's pack beside its GGUF would not fit the disk)")
    a = ap.parse_args()
    threads = int(os.environ.get("MAWFORGE_BENCH_THREADS", "2"))
    source = synth_model(a.layers, "F16")
    ctx = a.prompt_tokens + a.decode_tokens + 8
    common = ["--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens),
              "--warmup", str(a.warmup), "--context", str(ctx)]
    cpu = cpu_kind()
    record = {"benchmark": "quant_types", "cpu": cpu["kind"], "cpu_family_model": [cpu["family"], cpu["model"]],
              "machine": machine(), "commit": commit(),
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "threads": threads,
              "tokens": "random ids, decode teacher-forced", "quiet_before": quiet(), "rows": []}
    for name in a.types.split(","):
        from mawforge.fixtures.requant import expert_type
        gguf = quant_file(source, name, a.layers)
        pack = pack_of(gguf)
        pairs = []
        for _ in range(a.rounds):
            ll = worker_row(DECODE, ["llama", "--model", str(gguf), "--no-repack", *common])
            mf = worker_row(DECODE, ["maw", "--pack", str(pack), "--cache-percent", "100", "--preload",
                                     "--prefill-chunk", str(a.prompt_tokens), *common])
            pairs.append((ll, mf))
        row = {"type": name, "experts": expert_type(gguf), "file_bytes": gguf.stat().st_size,
               "llama": [p[0] for p in pairs], "mawforge": [p[1] for p in pairs]}
        for k in ("decode_tok_s", "prefill_tok_s"):
            row[f"llama_{k}"] = median([p[0].get(k, 0) for p in pairs])
            row[f"mawforge_{k}"] = median([p[1].get(k, 0) for p in pairs])
            row[f"{k}_ratio"] = row[f"mawforge_{k}"] / row[f"llama_{k}"] if row[f"llama_{k}"] else None
        for r in (*row["llama"], *row["mawforge"]):
            r.pop("cgroup", None)
        if not a.keep_packs:
            shutil.rmtree(pack)
        record["rows"].append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                          if k not in ("llama", "mawforge")}), flush=True)
    record["quiet_after"] = quiet()
    print(f"\n# quant types, {record['cpu']} (family {cpu['family']} model {cpu['model']}), {threads} threads each, "
          f"{a.layers} layers, commit {record['commit']}")
    print(f"# quiet: load {record['quiet_before']['loadavg'][0]:.2f} before, {record['quiet_after']['loadavg'][0]:.2f}"
          f" after; other busy processes: {[b['name'] for b in record['quiet_before']['busy']]}")
    print(f"{'type':10s} {'experts':8s} {'GB':>6s} {'llama dec':>9s} {'maw dec':>8s} {'ratio':>6s} "
          f"{'llama pp':>9s} {'maw pp':>8s} {'ratio':>6s}")
    for r in record["rows"]:
        f = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"
        print(f"{r['type']:10s} {r['experts']:8s} {r['file_bytes'] / 1e9:6.2f} {f(r['llama_decode_tok_s']):>9s} "
              f"{f(r['mawforge_decode_tok_s']):>8s} {f(r['decode_tok_s_ratio']):>6s} {f(r['llama_prefill_tok_s']):>9s} "
              f"{f(r['mawforge_prefill_tok_s']):>8s} {f(r['prefill_tok_s_ratio']):>6s}")
    path = save("quant_types", record)
    print(f"# record: {path}")
    if a.record:
        out = ROOT / "benchmarks" / "records" / f"quant_types-{record['commit'].split('+')[0]}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(record, indent=1, default=str))
        print(f"# record: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
