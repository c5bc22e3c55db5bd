"""`mawforge run`: one generation from a pack under a budget; streams text, then telemetry."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from mawforge.cache.core import read_bytes
from mawforge.commands.plan import add_budget_arguments, plan_options
from mawforge.plan import PREFILL_WAVE

help = "generate once from a pack under a memory budget, with telemetry"


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pack", required=True)
    add_budget_arguments(p)
    p.add_argument("--policy", default="s3fifo",
                   help="expert cache eviction policy: s3fifo (default), s3fifo-classic, lru, lfu, fifo, random:SEED")
    p.add_argument("--prefetch", default="auto",
                   help="auto (default: router lookahead two layers ahead, measured against none by "
                        "wall clock and turned off while it loses), none, or a policy such as confidence:0.2")
    p.add_argument("--lookahead", action="store_true",
                   help="with an explicit --prefetch policy (or none): also prefetch the experts of the "
                        "layers ahead by router lookahead (always on in auto)")
    p.add_argument("--miss-policy", default="exact",
                   help="decode's handling of a missed expert: exact (default: read it), or, lossy, "
                        "substitute[:W] (the best resident expert by router score) or skip[:W], for "
                        "misses whose gate weight is below W (default 0.1); prefill is always exact; "
                        "docs/miss-policy.md gives each setting's measured price")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: torch's, the cores)")
    p.add_argument("--no-thread-governor", action="store_true",
                   help="keep every decode step at --threads (default: the kernels' thread count follows "
                        "measured speed, fewer when another program takes a core)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="tokens one attention call takes")
    p.add_argument("--prefill-wave", type=int, default=PREFILL_WAVE,
                   help="tokens a prompt runs layer by layer: each layer's experts are read once a wave")
    p.add_argument("--no-direct-io", action="store_true", help="buffered reads instead of O_DIRECT")
    p.add_argument("--trace-out", default=None, help="write the route trace (.npz) here")
    p.add_argument("--preload", dest="preload", action="store_true", default=None,
                   help="fill the expert cache before the first prompt (at --expert-cache-percent 100: the whole "
                        "model); default: when the plan holds every expert, so the first tokens are as fast as "
                        "the next (not with --trace-out: a trace replays from an empty cache)")
    p.add_argument("--no-preload", dest="preload", action="store_false",
                   help="start at once and read experts as the first prompt routes to them")


def should_preload(flag: bool | None, plan) -> bool:
    """--preload / --no-preload as given; by default, when the plan's expert cache holds every expert
    (a resident model): the first prompt then reads nothing, where it read every expert it routed
    to while computing (a first turn about twice the next ones' TTFT at full size, and a first
    decode that still waits on reads)."""
    return flag if flag is not None else plan.E >= plan.expert_bytes_total


def runtime_options(a: argparse.Namespace):
    """The whole run configuration of `run` and `serve`: the budget flags and the runtime's."""
    return replace(plan_options(a), policy=a.policy, prefetch=a.prefetch, device=a.device,
                   direct_io=not a.no_direct_io, threads=a.threads, lookahead=a.lookahead,
                   thread_governor=not a.no_thread_governor, miss_policy=a.miss_policy)


def make_recorder(a: argparse.Namespace):
    if not a.trace_out:
        return None
    from mawforge.pack.manifest import read_index, read_manifest
    from mawforge.trace.record import TraceRecorder
    man, index = read_manifest(a.pack), read_index(a.pack)
    c = man.config
    return TraceRecorder(n_layers=c.n_layers, n_experts=c.n_experts, top_k=c.top_k,
                         block_bytes=[lb.slot_nbytes for lb in index.layers],
                         model=c.arch, pack_digest=man.pack_digest)


class PrefillProgress:
    """Prefill progress for a prompt longer than one chunk: tokens done and expert bytes read,
    as a tqdm bar on stderr, only when stderr is a terminal (piped output gets nothing extra).
    Installed as Runtime.on_chunk; the bar goes away when the prompt is done."""

    def __init__(self, rt, stream=None):
        self.rt, self.stream, self.bar = rt, stream or sys.stderr, None
        s = rt.cache.stats()
        self.read0 = read_bytes(s)

    @classmethod
    def install(cls, rt, stream=None) -> "PrefillProgress | None":
        stream = stream or sys.stderr
        if not stream.isatty():
            return None
        rt.on_chunk = progress = cls(rt, stream)
        return progress

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm
            try:           # a terminal that reports no size (a bare pty) gets 80 x 24: tqdm hides
                size = os.get_terminal_size(self.stream.fileno())     # its bar below 0 rows
            except OSError:
                size = os.terminal_size((0, 0))
            self.bar = tqdm(total=total, unit="tok", desc="prefill", file=self.stream, leave=False,
                            mininterval=0, ncols=size.columns or 80, nrows=size.lines or 24)
        s = self.rt.cache.stats()
        read = read_bytes(s) - self.read0
        self.bar.n = done
        self.bar.set_postfix_str(f"read {read / 2**20:.1f} MiB")      # draws the bar
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    p.set_defaults(prompt_cache_gib=0.0)      # one generation: no later prompt to reuse it
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--telemetry-json", action="store_true", help="print telemetry as JSON")
    from mawforge.commands.speculative import add_speculative_arguments
    add_speculative_arguments(p)


def main(a: argparse.Namespace) -> int:
    from mawforge.api import Model
    from mawforge.commands.speculative import pair_plan_or_reject, spec_options
    opts = runtime_options(a)
    pair = pair_plan_or_reject(a, opts)    # a draft pack's L is planned beside the target's
    if pair is not None:
        opts = replace(opts, reserved_bytes=pair.draft.L)
    recorder = make_recorder(a)
    model = Model.from_options(a.pack, opts, speculative=spec_options(a), recorder=recorder)
    rt = model.runtime
    if recorder is None and should_preload(a.preload, rt.plan):
        rt.cache.preload()      # a warm start: blocks in (layer, expert) order until E is full
    try:
        with model:
            prompt = [{"role": "user", "content": a.prompt}]
            ids = model.encode(model.chat_turn(prompt).prompt if a.chat else a.prompt)
            progress = PrefillProgress.install(rt)
            for ev in model.generate(ids, max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                                     top_p=a.top_p, min_p=a.min_p, seed=a.seed, stop=a.stop,
                                     ignore_eos=a.ignore_eos):
                if progress is not None:      # prefill is over once a token arrives
                    progress.close()
                    rt.on_chunk = progress = None
                sys.stdout.write(ev.text)
                sys.stdout.flush()
                if ev.telemetry is not None:
                    print()
                    t = ev.telemetry
                    print(json.dumps(t.to_dict()) if a.telemetry_json else t.line(), file=sys.stderr)
                    if model.speculator is not None and not a.telemetry_json:
                        from mawforge.speculative.decode import summary_line
                        print(summary_line(t.speculative), file=sys.stderr)
    finally:
        if recorder is not None:
            # the trace carries each step's prefetch state and every lookahead's keys, so replay
            # reproduces these counters with auto prefetch and lookahead too
            recorder.set_live(rt.plan.E, a.policy, rt.prefetch_spec, rt.cache.core.stats())
            recorder.save(a.trace_out)
    return 0
