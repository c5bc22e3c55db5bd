"""The one generation path: a streaming generator that the CLI, the server and the bench consume.

    for ev in generate(rt, prompt_ids, params):   # Event(token, text, finish_reason, telemetry)
        ...
The last event has finish_reason set ("stop" or "length") and the request's telemetry.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch

from mawforge.cache.core import read_bytes
from mawforge.engine.processors import TokenLogprob
from mawforge.engine.prompt_reuse import prefill
from mawforge.engine.runtime import Runtime
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.text.tokenizer import Detokenizer
from mawforge.errors import ContextLengthError, RequestError
from mawforge.telemetry import StallMeter, Telemetry, peak_rss_bytes, rss_bytes


@dataclass
class Event:
    token: int | None
    text: str
    finish_reason: str | None = None
    telemetry: Telemetry | None = None
    logprob: TokenLogprob | None = None     # only when params.logprobs is set


class _StopScanner:
    """Holds back text that could be the start of a stop string; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.pending = [s for s in stops if s], ""

    def feed(self, delta: str) -> tuple[str, bool]:
        self.pending += delta
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Decoder(Protocol):
    """What the generator asks of a decoding strategy, one per request: `step` runs the model
    and returns the next tokens (one, or accepted drafts and one more; at most `room`), `finish`
    says how many of the last step's tokens the request used, `report` its telemetry (or None)."""

    def step(self, context: list[int], room: int) -> list[int]: ...
    def finish(self, used: int) -> None: ...
    def report(self) -> dict | None: ...
    def close(self) -> None: ...


class PlainDecoder:
    """One token per step: the Decoder `generate` runs when speculation is off (and the base of
    speculative decoders, mawforge/speculative/decode.py)."""

    def __init__(self, rt: Runtime, sampler: Sampler) -> None:
        self.rt, self.sampler = rt, sampler

    def step(self, context: list[int], room: int) -> list[int]:
        return [self.sampler.sample(self.rt.forward([context[-1]], kind="decode")[-1])]

    def finish(self, used: int) -> None:
        pass

    def report(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


def validate(rt: Runtime, prompt: list[int], params: SamplingParams) -> None:
    if not prompt:
        raise RequestError("the prompt is empty")
    if len(prompt) >= rt.opts.context:
        raise ContextLengthError(f"the prompt has {len(prompt)} tokens; the context is {rt.opts.context} "
                           f"(at least one position must be left to generate)")
    vocab = rt.cfg.vocab
    for t in params.stop_token_ids:
        if not 0 <= t < vocab:
            raise RequestError(f"stop token id {t} is outside the vocabulary of {vocab}")
    for t, _ in params.logit_bias:
        if not 0 <= t < vocab:
            raise RequestError(f"logit_bias token id {t} is outside the vocabulary of {vocab}")


def generate(rt: Runtime, prompt: list[int], params: SamplingParams,
             cancelled: Callable[[], bool] = lambda: False, speculative=None,
             processors: tuple = ()) -> Iterator[Event]:
    """`speculative`: anything with `decoder(prompt, params, sampler) -> Decoder` (a
    speculative.decode.Speculator), or None for plain decoding. Either way each step returns
    the next tokens (one, or accepted drafts plus one) and they stream alike.
    `processors`: the request's sampling.LogitsProcessors (e.g. engine.constraint.Constraint); one
    that reports `done` (a complete grammar) ends the choice with "stop"."""
    validate(rt, prompt, params)
    sampler, detok, scan = Sampler(params, list(processors)), Detokenizer(rt.tokenizer), _StopScanner(params.stop)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else rt.tokenizer.eos_ids)
    before = rt.cache.stats()
    before["miss_counts"] = dict(rt.model.experts.miss.counts)
    emb_before = rt.weights.embedding_bytes_read
    t0 = time.perf_counter()
    rt.cache.prefill_keys.clear()
    rt.interrupt = cancelled                 # a cancelled prompt stops at its next layer (errors.Cancelled)
    try:
        logits, reuse = prefill(rt, prompt)  # reset, and reuse the longest cached prefix (engine/prompt_reuse.py)
    finally:
        rt.interrupt = None
    after = rt.cache.stats()
    prefill_read = read_bytes(after) - read_bytes(before)
    stalls, decoder, context = StallMeter(), None, list(prompt)
    try:
        decoder = speculative.decoder(prompt, params, sampler) if speculative is not None else PlainDecoder(rt, sampler)
        batch = [sampler.sample(logits)]
        n, reason, t_first = 0, None, None
        while True:
            for used, tok in enumerate(batch, 1):
                n += 1
                sampler.accept(tok)
                lp = sampler.logprobs.take(tok) if sampler.logprobs is not None else None
                context.append(tok)
                if t_first is None:
                    t_first = time.perf_counter()
                if tok in stop_ids:
                    reason = "stop"
                    text = scan.flush()
                else:
                    text, hit = scan.feed(detok.push(tok))
                    if hit:
                        reason = "stop"
                    elif sampler.done:
                        reason = "stop"
                        text += scan.flush()
                if reason is None and n >= params.max_tokens:
                    reason = "length"
                if reason is None and len(prompt) + n > rt.opts.context:   # no position left to run tok
                    reason = "length"
                if reason is None and cancelled():
                    reason = "cancelled"
                if reason is not None:
                    if reason == "length":
                        text += scan.flush()
                    decoder.finish(used)
                    tele = _telemetry(rt, len(prompt), n, t0, t_first, before, emb_before, reason)
                    tele.set_stalls(stalls)
                    tele.prefill_read_bytes, tele.prefill_needed_bytes = prefill_read, rt.cache.prefill_needed_bytes()
                    tele.compute_threads = (rt.governor.report() if rt.governor is not None
                                            else {"threads": torch.get_num_threads(), "governor": False})
                    tele.prefetch = rt.prefetch_report()
                    tele.speculative = decoder.report() or tele.speculative
                    tele.planned_draft_bytes = tele.speculative.get("draft", {}).get("planned_bytes", 0)
                    tele.planned_footprint_bytes += tele.planned_draft_bytes
                    tele.set_prompt_cache(reuse, rt.prompt_cache)
                    yield Event(tok, text, reason, tele, lp)
                    return
                yield Event(tok, text, logprob=lp)
            # a step may return up to `room` tokens: the request's remainder and the free KV positions
            waited = rt.cache.read_wait_seconds()
            batch = decoder.step(context, min(params.max_tokens - n, rt.opts.context - rt.kv.pos))
            stalls.record(rt.cache.read_wait_seconds() - waited, len(batch))
    finally:
        reuse.release()                  # a dropped request unpins its entry here, at once
        if decoder is not None:
            decoder.close()
        if rt.prompt_cache is not None:  # the answer's rows, where they are exact, are live for the next turn
            rt.prompt_cache.note_decoded(context)


def _telemetry(rt: Runtime, n_prompt: int, n_out: int, t0: float, t_first: float, before: dict,
               emb_before: int, reason: str) -> Telemetry:
    end = time.perf_counter()
    s = rt.cache.stats()
    d = lambda k: s[k] - before[k]
    hits, misses = d("hits"), d("misses")
    decode_s = end - t_first
    p = rt.plan
    return Telemetry(
        prompt_tokens=n_prompt, completion_tokens=n_out, ttft_s=t_first - t0, prefill_s=t_first - t0,
        decode_s=decode_s, decode_tok_s=(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0,
        total_s=end - t0, hits=hits, misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else 0.0, evictions=d("evictions"),
        materialized_bytes=d("materialized_bytes"), prefetched_bytes=d("prefetch_issued_bytes"),
        prefetch_useful_bytes=d("prefetch_useful_bytes"), prefetch_wasted_bytes=d("prefetch_wasted_bytes"),
        demand_load_s=d("load_seconds"), prefetch_stall_s=d("prefetch_stall_seconds"),
        expert_cache_bytes=p.E, expert_cache_held_bytes=s["held_bytes"], kv_cache_bytes=rt.kv.nbytes,
        resident_common_bytes=rt.weights.resident_bytes,
        embedding_bytes_read=rt.weights.embedding_bytes_read - emb_before,
        rss_bytes=rss_bytes(), peak_rss_bytes=peak_rss_bytes(), budget_bytes=p.budget_bytes,
        budget_source=f"{p.budget_source}; cache: {p.cache_source}", planned_footprint_bytes=p.F,
        miss_policy={**rt.model.experts.miss.report(),
                     **{k: v - before["miss_counts"][k] for k, v in rt.model.experts.miss.counts.items()}},
        cache_policy=rt.opts.policy, pack_digest=rt.manifest.pack_digest, finish_reason=reason)
