"""The headline benchmark: the full-size shape-true Qwen3-30B-A3B file (48 layers, 18.5 GB) resident
and inside cgroup v1 memory limits (12, 8, 6 GiB), MawForge against llama.cpp's default load
(repack on) and its repack-off load, in the same run; each engine both teacher-forced and as
greedy generation on the prompt classes of `mawforge bench`.

    python benchmarks/fullsize.py [--layers 48] [--limits 12,8,6] [--greedy-tokens 24] [--trace-dir DIR]

Each (engine, configuration) is one child process, started on a dropped page cache (and inside
its own cgroup under a limit), that loads once and then runs: a 64-token random prompt and 32
teacher-forced random decode tokens (the first 4 warm-up), then for each prompt class a reset, the
class's first prompt (TTFT = its prefill) and greedy decode. llama.cpp under a limit runs the
short form (the same 64-token prompt, 4 decode tokens, one class), as it decodes at a fraction of
a token a second there. MawForge runs with its defaults (`--prefetch auto`, thread governor on); the
`mawforge none` rows turn prefetch off in the same run, to show what auto prefetch buys.
Per-token stall figures (the share of decode tokens that waited on a read, p50/p95 wait) come
from MawForge's own counters; llama.cpp has no such counter (its reads are page faults).
`--trace-dir` keeps each MawForge child's route trace (with its live counters and router
lookaheads) for `mawforge replay`; `--policies s3fifo,s3fifo-classic --rounds 2` runs MawForge's
limited rows under each cache policy, alternating, for a same-run A/B.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import fullsize_model, llama_repack_off, machine, pack_of, save, worker_parser, worker_row  # noqa: E402

THREADS = int(os.environ.get("MAWFORGE_BENCH_THREADS", "2"))
GiB = 2**30


def rand_tokens(n: int, seed: int, vocab: int = 151000) -> list[int]:
    import numpy as np
    return [int(t) for t in np.random.default_rng(seed).integers(1000, vocab, n)]


def context_for(a) -> int:
    """Both engines' context: 1024, or the filled positions, the prompt and the decode steps with
    room to spare."""
    return max(1024, getattr(a, "fill_context", 0) + a.prompt_tokens + a.decode_tokens + 64)


def synthetic_rows(n: int, width: int, seed: int = 5):
    """n rows of `width` float16 values, normal(0, 1) (a KV cache's contents for --fill-context:
    attention costs the same whatever the values; both engines get rows of the same distribution)."""
    import numpy as np
    return np.random.default_rng(seed).standard_normal((n, width), dtype=np.float32).astype(np.float16)


def synthetic_q8_rows(n: int, width: int):
    """synthetic_rows' values as q8_0 blocks (a q8_0 cache's contents): uint8 tensor [n, width / 32 * 34]"""
    import torch

    from mawforge.kernels import q8_0
    return q8_0.quantize(torch.from_numpy(synthetic_rows(n, width)).float())


# ---- workers (child processes) ---------------------------------------------------------------
def fill_cache(kv, n: int) -> None:
    """Positions 0..n-1 of every attention layer of a MawForge KV cache hold synthetic_rows
    (a q8_0 cache: synthetic_q8_rows of the same values, as llama.cpp's q8_0 cache holds them);
    committed, so the next token runs at position n."""
    import torch
    block = None
    for kc, vc in zip(kv.k, kv.v):
        if kc is None or vc is None:
            continue
        g, _, d = kc.shape
        if block is None:
            if kv.quant:
                block = synthetic_q8_rows(n, g * (d // 34 * 32)).view(n, g, d).transpose(0, 1)
            else:
                block = torch.from_numpy(synthetic_rows(n, g * d)).view(n, g, d).transpose(0, 1).to(kc.dtype)
        kc[:, :n].copy_(block)
        vc[:, :n].copy_(block)
    kv.commit(n)


class LlamaEngine:
    def __init__(self, a) -> None:
        import llama_cpp
        if a.no_repack:
            llama_repack_off()
        self.flash_attn = bool(getattr(a, "flash_attn", False))     # llama-cpp-python's default: off
        self.kv_dtype = getattr(a, "kv_dtype", None) or "float16"
        q8 = {}
        if self.kv_dtype == "q8_0":         # --cache-type-k/v q8_0: a quantized V needs flash attention
            q8, self.flash_attn = dict(type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0), True
        elif self.kv_dtype != "float16":
            raise SystemExit(f"llama.cpp rows take --kv-dtype float16 or q8_0, not {self.kv_dtype}")
        self.llm = llama_cpp.Llama(a.model, n_ctx=context_for(a), n_batch=512, n_threads=THREADS,
                                   n_threads_batch=THREADS, flash_attn=self.flash_attn, verbose=False, **q8)

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)

    def fill(self, n: int) -> None:
        """Positions 0..n-1 of sequence 0 hold synthetic keys and values: a sequence state file in
        llama.cpp's own format (llama_state_seq_save_file's), laid out as llama.cpp lays out this
        context's cache (read from a state it saved after two real tokens), loaded with
        llama_state_seq_load_file, which reads it layer by layer into the cache."""
        import ctypes

        import llama_cpp
        ctx = self.llm._ctx.ctx
        os.makedirs(WORK_DIR, exist_ok=True)
        self.llm.eval([1000, 1001])
        small = os.path.join(WORK_DIR, f"llama-seq-{os.getpid()}.small")
        toks = (llama_cpp.llama_token * 2)(1000, 1001)
        if not llama_cpp.llama_state_seq_save_file(ctx, small.encode(), 0, toks, 2):
            raise RuntimeError("llama_state_seq_save_file failed")
        layout = SeqState.parse(open(small, "rb").read())
        os.unlink(small)
        big = os.path.join(WORK_DIR, f"llama-seq-{os.getpid()}.state")
        layout.write(big, n)
        self.llm.reset()
        out = (llama_cpp.llama_token * n)()
        count = ctypes.c_size_t(0)
        try:
            if not llama_cpp.llama_state_seq_load_file(ctx, big.encode(), 0, out, n, ctypes.byref(count)):
                raise RuntimeError("llama_state_seq_load_file failed")
        finally:
            os.unlink(big)
        self.llm.n_tokens = n

    def reset(self) -> None:
        self.llm.reset()

    def run(self, ids: list[int]) -> int:
        """Run ids at the next positions; the greedy next token."""
        import numpy as np
        self.llm.eval(ids)
        # the last position's logits, read from the context (Llama.eval keeps none unless
        # logits_all, and its eval_logits property copies every row into lists)
        row = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return int(np.argmax(row))

    def wait(self) -> float:
        return 0.0

    def read_bytes(self) -> int:
        return 0

    def needed_bytes(self) -> int:
        return 0

    def report(self) -> dict:
        return {"flash_attn": self.flash_attn, "kv_dtype": self.kv_dtype}


class MawEngine:
    def __init__(self, a) -> None:
        import torch

        from mawforge.engine.runtime import Runtime, RuntimeOptions
        from mawforge.commands.run import make_recorder
        from mawforge.plan import Budget
        torch.set_num_threads(THREADS)
        self.torch = torch
        self.trace_out, self.recorder = a.trace_out, make_recorder(a)
        budget = None if a.budget_gib is None else Budget.from_gib(a.budget_gib, "--budget-gib")
        self.rt = Runtime(a.pack, RuntimeOptions(context=context_for(a), expert_cache_percent=a.cache_percent,
                                                 budget=budget, prefill_chunk=a.prefill_chunk,
                                                 threads=THREADS, check_digests=False,
                                                 stream_embeddings=a.budget_gib is not None, prefetch=a.prefetch,
                                                 io_threads=a.io_threads, policy=a.policy,
                                                 kv_dtype=getattr(a, "kv_dtype", None)), recorder=self.recorder)
        if a.preload:
            self.rt.cache.preload()

    def encode(self, text: str) -> list[int]:
        return self.rt.tokenizer.encode(text)

    def fill(self, n: int) -> None:
        """Positions 0..n-1 of every attention layer hold synthetic keys and values (the rows
        LlamaEngine.fill writes); the next token runs at position n."""
        fill_cache(self.rt.kv, n)

    def reset(self) -> None:
        self.rt.reset()

    def run(self, ids: list[int]) -> int:
        kind = "decode" if len(ids) == 1 else None
        return int(self.torch.argmax(self.rt.forward(ids, kind=kind)[-1]))

    def wait(self) -> float:
        return self.rt.cache.read_wait_seconds()

    def read_bytes(self) -> int:
        from mawforge.cache.core import read_bytes
        return read_bytes(self.rt.cache.stats())

    def needed_bytes(self) -> int:
        return self.rt.cache.prefill_needed_bytes()

    def save_trace(self) -> None:
        """The route trace of the whole child (prefill, teacher-forced steps, each class's prompt and
        greedy steps) with the live counters, for `mawforge replay` to compare policies on."""
        if self.recorder is not None:
            rt = self.rt
            self.recorder.set_live(rt.plan.E, rt.opts.policy, rt.prefetch_spec, rt.cache.core.stats())
            self.recorder.save(self.trace_out)

    def report(self) -> dict:
        s, p = self.rt.cache.stats(), self.rt.plan
        return {"hit_rate": s["hit_rate"], "materialized_bytes": s["materialized_bytes"],
                "prefetch_issued_bytes": s["prefetch_issued_bytes"],
                "prefetch_useful_bytes": s["prefetch_useful_bytes"],
                "prefetch_wasted_bytes": s["prefetch_wasted_bytes"], "prefetch_spared": s["prefetch_spared"],
                "expert_cache_bytes": p.E, "planned_F": p.F, "cache_percent": p.cache_percent,
                "prefetch": self.rt.prefetch_report(),
                "compute_threads": self.rt.governor.report() if self.rt.governor is not None else None}


WORK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "work", "bench")


class SeqState:
    """llama.cpp's sequence state file (llama-context.cpp state_seq_save_file, llama-kv-cache.cpp
    state_write, one stream): magic, version, the token count and tokens, the stream count, then
    per stream its cell count, each cell's position and sequence ids, and the data: v_trans, the
    layer count, each layer's key type, row size and rows, then each layer's values (rows, or
    with v_trans each of the n_embd_v columns over the cells). parse() reads a saved one and
    checks that writing it back gives the same bytes; write() lays out n cells the same way."""

    def __init__(self, head: bytes, streams: int, v_trans: int, k: list, v: list) -> None:
        self.head, self.streams, self.v_trans, self.k, self.v = head, streams, v_trans, k, v

    @classmethod
    def parse(cls, raw: bytes) -> "SeqState":
        import struct
        magic, version, nt = struct.unpack_from("<III", raw, 0)
        at = 12 + 4 * nt
        streams, cells = struct.unpack_from("<II", raw, at)
        at += 8
        for _ in range(cells):                  # pos, n_seq_id, the ids (no cell extension here)
            _, nseq = struct.unpack_from("<iI", raw, at)
            at += 8 + 4 * nseq
        v_trans, layers = struct.unpack_from("<II", raw, at)
        at += 8
        k = []
        for _ in range(layers):
            ktype, row = struct.unpack_from("<iQ", raw, at)
            k.append((ktype, row))
            at += 12 + cells * row
        v = []
        for _ in range(layers):
            if v_trans:
                vtype, el, width = struct.unpack_from("<iII", raw, at)
                v.append((vtype, el, width))
                at += 12 + cells * el * width
            else:
                vtype, row = struct.unpack_from("<iQ", raw, at)
                v.append((vtype, row))
                at += 12 + cells * row
        if at != len(raw) or streams != 1:
            raise RuntimeError(f"unexpected llama.cpp sequence state layout ({at} of {len(raw)} bytes, "
                               f"{streams} streams)")
        st = cls(struct.pack("<II", magic, version), streams, v_trans, k, v)
        if st.layout_bytes(cells) != len(raw):
            raise RuntimeError("llama.cpp sequence state: cannot lay it out again")
        return st

    def layout_bytes(self, n: int) -> int:
        per_v = sum(12 + n * (x[1] * x[2] if self.v_trans else x[1]) for x in self.v)
        return 12 + 4 * n + 8 + n * 12 + 8 + sum(12 + n * row for _, row in self.k) + per_v

    def write(self, path: str, n: int) -> None:
        import struct

        import numpy as np
        ktypes = {t for t, _ in self.k} | {x[0] for x in self.v}
        if ktypes == {1}:                       # GGML_TYPE_F16
            rows = synthetic_rows(n, self.k[0][1] // 2)
        elif ktypes == {8} and not self.v_trans:    # GGML_TYPE_Q8_0 (flash attention: V rows, not columns)
            rows = synthetic_q8_rows(n, self.k[0][1] // 34 * 32).numpy()
        else:
            raise RuntimeError(f"llama.cpp's cache is neither float16 nor q8_0 rows here (types {ktypes})")
        with open(path, "wb") as f:
            f.write(self.head + struct.pack("<I", n) + np.full(n, 1000, np.int32).tobytes())
            f.write(struct.pack("<II", self.streams, n))
            cells = np.zeros((n, 3), np.int32)
            cells[:, 0] = np.arange(n)
            cells[:, 1] = 1                     # one sequence id: 0
            f.write(cells.tobytes())
            f.write(struct.pack("<II", self.v_trans, len(self.k)))
            for ktype, row in self.k:
                f.write(struct.pack("<iQ", ktype, row))
                f.write(rows.tobytes())
            cols = np.ascontiguousarray(rows.T) if self.v_trans else rows
            for x in self.v:
                f.write(struct.pack("<iII", *x) if self.v_trans else struct.pack("<iQ", *x))
                f.write(cols.tobytes())
        if os.path.getsize(path) != self.layout_bytes(n):
            raise RuntimeError("llama.cpp sequence state: wrote the wrong size")


def decode_loop(eng, first: int, feed: list[int] | None, n: int, warmup: int) -> dict:
    """n one-token steps, teacher-forced over `feed` or greedy from `first`; stall figures as the
    request telemetry computes them (mawforge.telemetry.StallMeter), and the page faults of the timed
    steps (first touches of expert-cache slots and scratch, mostly: the warmup's are the cache's
    first fill)."""
    import resource

    from mawforge.telemetry import StallMeter
    times, stalls, tok, read0, faults0 = [], StallMeter(), first, 0, 0
    for i in range(n):
        if i == warmup:
            read0, faults0 = eng.read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = feed[i] if feed is not None else tok
        w0, t0 = eng.wait(), time.perf_counter()
        tok = eng.run([x])
        times.append(time.perf_counter() - t0)
        if i >= warmup:
            stalls.record(eng.wait() - w0, 1)
    warm = times[warmup:]
    share, p50, p95 = stalls.summary()
    out = {"decode_tok_s": len(warm) / sum(warm), "stall_token_share": share, "stall_p50_s": p50, "stall_p95_s": p95,
           "minor_faults_per_token": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / len(warm)}
    if isinstance(eng, MawEngine):
        out["read_bytes_per_token"] = (eng.read_bytes() - read0) / len(warm)
    return out


def work(a) -> dict:
    from mawforge.bench.prompts import prompt_for
    try:        # if the machine runs out of memory, this worker goes first, not the driver
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    t0 = time.perf_counter()
    eng = MawEngine(a) if a.engine == "maw" else LlamaEngine(a)
    out = {"load_s": time.perf_counter() - t0}
    if a.fill_context:
        t0 = time.perf_counter()
        eng.fill(a.fill_context)
        out["fill_s"] = time.perf_counter() - t0
    prompt = rand_tokens(a.prompt_tokens, 1)
    read0 = eng.read_bytes()
    t0 = time.perf_counter()
    first = eng.run(prompt)
    out["ttft_s"] = time.perf_counter() - t0
    out["prefill_tok_s"] = len(prompt) / out["ttft_s"]
    out["context_at_decode"] = a.fill_context + len(prompt)
    out["prefill_read_bytes"], out["prefill_needed_bytes"] = eng.read_bytes() - read0, eng.needed_bytes()
    out.update(decode_loop(eng, first, rand_tokens(a.decode_tokens, 2), a.decode_tokens, a.warmup))
    out["teacher_forced"] = eng.report()
    greedy = {}
    for cls in [c for c in a.classes.split(",") if c]:
        eng.reset()
        ids = eng.encode(prompt_for(cls, 0))
        t0 = time.perf_counter()
        first = eng.run(ids)
        g = {"prompt_tokens": len(ids), "ttft_s": time.perf_counter() - t0}
        g.update(decode_loop(eng, first, None, a.greedy_tokens, min(2, a.greedy_tokens - 1)))
        greedy[cls] = g
    out["greedy"] = greedy
    out["final"] = eng.report()
    if isinstance(eng, MawEngine):
        eng.save_trace()
    return out


# ---- driver ----------------------------------------------------------------------------------
def child(args: list[str], limit_bytes: int | None, timeout: float) -> dict:
    return worker_row(__file__, args, limit_bytes, timeout)


def greedy_tok_s(r: dict) -> float:
    g = [v["decode_tok_s"] for v in r.get("greedy", {}).values()]
    return statistics.median(g) if g else float("nan")


def policy_summary(name: str, rs: list[dict]) -> str:
    """One MawForge engine's rows of one config (several rounds or policies): each TF rate, medians."""
    tf = ", ".join(f"{r['decode_tok_s']:.2f}" for r in rs)
    mb = statistics.median(r.get("read_bytes_per_token", 0) for r in rs) / 1e6
    return (f"{name} TF {tf} (median {statistics.median(r['decode_tok_s'] for r in rs):.2f}), {mb:.0f} MB/token, "
            f"TTFT median {statistics.median(r['ttft_s'] for r in rs):.1f} s")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        ap = worker_parser(("llama", "maw"))
        ap.add_argument("--prefetch", default="auto")
        ap.add_argument("--io-threads", type=int, default=4, help="MawForge: concurrent expert reads")
        ap.add_argument("--prefill-chunk", type=int, default=512, help="MawForge: as llama.cpp's n_batch here")
        ap.add_argument("--classes", default="code,summarization,writing,reasoning")
        ap.add_argument("--greedy-tokens", type=int, default=24)
        ap.add_argument("--trace-out", help="MawForge: save the child's route trace here (.npz)")
        ap.add_argument("--policy", default="s3fifo", help="MawForge: expert cache policy")
        ap.add_argument("--flash-attn", action="store_true", help="llama.cpp: flash attention on")
        ap.add_argument("--kv-dtype", help="KV cache dtype (MawForge's --kv-dtype; llama.cpp: float16 or q8_0, "
                                           "--cache-type-k/v, with flash attention)")
        ap.add_argument("--fill-context", type=int, default=0,
                        help="first fill this many positions with synthetic keys and values (long-context decode)")
        print(json.dumps(work(ap.parse_args())))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--limits", default="12,8,6", help="cgroup limits in GiB ('' for resident only)")
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--classes", default="code,summarization,writing,reasoning")
    ap.add_argument("--no-llama-default-under-limits", action="store_true",
                    help="skip llama.cpp's default load under limits (it copies the weights: OOM below the file size)")
    ap.add_argument("--none-at", default="8", help="limits (GiB) where MawForge also runs with --prefetch none")
    ap.add_argument("--only", default="", help="comma list of configs to run (resident, 12, 8, ...)")
    ap.add_argument("--engines", default="",
                    help="comma list of engines to run (llama.cpp default, llama.cpp repack off, "
                         "mawforge, mawforge none); default all")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--trace-dir", help="save each MawForge child's route trace here (CONFIG-ENGINE.npz)")
    ap.add_argument("--policies", default="s3fifo",
                    help="MawForge's cache policies under the limits, each its own row "
                         "(the first is 'mawforge', others 'mawforge [POLICY]'), alternating --rounds times")
    ap.add_argument("--rounds", type=int, default=1, help="repeat each limit's MawForge rows, alternating")
    ap.add_argument("--routing", choices=("zipf", "real"), default="zipf",
                    help="the file's routing: zipf (skew 1.0, stickiness 0.3) or real (synth --routing real)")
    a = ap.parse_args()
    gguf = fullsize_model(a.layers, a.routing)
    pack = pack_of(gguf)
    size = os.path.getsize(gguf)
    full = ["--classes", a.classes, "--greedy-tokens", str(a.greedy_tokens)]
    # same prompts as MawForge (TTFT compares), fewer decode tokens and one class
    short = ["--decode-tokens", "4", "--warmup", "1", "--classes", a.classes.split(",")[0], "--greedy-tokens", "4"]
    configs = [("resident", None)] + [(f"{g} GiB", float(g)) for g in a.limits.split(",") if g]
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    rows = []

    engines = {x.strip() for x in a.engines.split(",") if x.strip()}

    def trace(config: str, name: str) -> list[str]:
        if not a.trace_dir:
            return []
        os.makedirs(a.trace_dir, exist_ok=True)
        return ["--trace-out", os.path.join(a.trace_dir, re.sub(r"[^\w.-]+", "_", f"{config}-{name}") + ".npz")]

    def add(config, name, make):
        if engines and name.split(" [")[0] not in engines:    # "mawforge [POLICY]" runs with "mawforge"
            return
        r = make()
        r.update(model=gguf.name, layers=a.layers, config=config, engine=name, file_bytes=size)
        rows.append(r)
        brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                 if k in ("config", "engine", "status", "ttft_s", "decode_tok_s", "stall_token_share",
                          "peak_rss_bytes")}
        brief["greedy_tok_s"] = round(greedy_tok_s(r), 3)
        print(json.dumps(brief), flush=True)

    for config, gib in configs:
        if only and config.split()[0] not in only:
            continue
        limit = int(gib * GiB) if gib else None
        lim_args = full if limit is None else short
        if limit is None or not a.no_llama_default_under_limits:
            add(config, "llama.cpp default",
                lambda: child(["llama", "--model", str(gguf), *lim_args], limit, a.timeout))
        add(config, "llama.cpp repack off",
            lambda: child(["llama", "--model", str(gguf), "--no-repack", *lim_args], limit, a.timeout))
        if limit is None:
            add(config, "mawforge", lambda: child(["maw", "--pack", str(pack), "--cache-percent", "100", "--preload",
                                                   *full, *trace(config, "mawforge")], None, a.timeout))
        else:
            # the budget leaves 8% of the limit to the page cache and the kernel (as decode.py)
            budget = ["--budget-gib", f"{gib * 0.92:.3f}"]
            policies = [p for p in a.policies.split(",") if p]
            for r in range(a.rounds):
                for pol in policies:
                    name = "mawforge" if pol == policies[0] else f"mawforge [{pol}]"
                    tag = name if a.rounds == 1 else f"{name}-{r}"
                    add(config, name, lambda: child(["maw", "--pack", str(pack), *budget, *full, "--policy", pol,
                                                     *trace(config, tag)], limit, a.timeout))
            if config.split()[0] in a.none_at.split(","):
                add(config, "mawforge none", lambda: child(["maw", "--pack", str(pack), *budget, "--prefetch", "none",
                                                            *full, *trace(config, "mawforge none")], limit, a.timeout))
    print(f"\n# full-size benchmark, {machine()}, {THREADS} threads each, file {size / 1e9:.2f} GB")
    print(f"{'config':10s} {'engine':22s} {'status':12s} {'TTFT s':>7s} {'TF tok/s':>9s} {'greedy tok/s':>12s} "
          f"{'stall %':>7s} {'p50 ms':>7s} {'p95 ms':>7s} {'hit %':>6s} {'MB/tok':>7s} {'peak RSS GiB':>12s} "
          f"{'F GiB':>6s} {'prefill read/need GB':>20s}")
    for r in rows:
        tf = r.get("teacher_forced", {})
        print(f"{r['config']:10s} {r['engine']:22s} {r['status'][:12]:12s} {r.get('ttft_s', 0):7.2f} "
              f"{r.get('decode_tok_s', 0):9.3f} {greedy_tok_s(r):12.3f} {100 * r.get('stall_token_share', 0):7.1f} "
              f"{1e3 * r.get('stall_p50_s', 0):7.1f} {1e3 * r.get('stall_p95_s', 0):7.1f} "
              f"{100 * tf.get('hit_rate', 0):6.1f} {r.get('read_bytes_per_token', 0) / 1e6:7.1f} "
              f"{r['peak_rss_bytes'] / GiB:12.2f} {tf.get('planned_F', 0) / GiB:6.2f} "
              f"{r.get('prefill_read_bytes', 0) / 1e9:9.2f}/{r.get('prefill_needed_bytes', 0) / 1e9:<10.2f}")
    by = {(r["config"], r["engine"]): r for r in rows if r["status"] == "ok"}
    resident = by.get(("resident", "mawforge"))
    for config, _ in configs:
        m = by.get((config, "mawforge"))
        if m is None:
            continue
        parts = []
        for peer in ("llama.cpp default", "llama.cpp repack off"):
            p = by.get((config, peer))
            if p:
                parts.append(f"TF {m['decode_tok_s'] / p['decode_tok_s']:.2f}x {peer}, "
                             f"TTFT {m['ttft_s'] / p['ttft_s']:.2f}x")
        if resident is not None and config != "resident":
            parts.append(f"greedy {greedy_tok_s(m) / greedy_tok_s(resident):.2f} of resident greedy")
        print(f"{config}: " + "; ".join(parts))
        ours: dict[str, list[dict]] = {}
        for r in rows:
            if r["config"] == config and r["status"] == "ok" and r["engine"].split(" [")[0] == "mawforge":
                ours.setdefault(r["engine"], []).append(r)
        if len(ours) > 1 or any(len(v) > 1 for v in ours.values()):
            print(f"{config}: " + "; ".join(policy_summary(name, rs) for name, rs in ours.items()))
    print(f"saved {save('fullsize', {'machine': machine(), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
