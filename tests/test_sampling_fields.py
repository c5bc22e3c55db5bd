"""OpenAI's sampling fields in the engine (engine/processors.py through Sampler.processors):
logprobs against torch.log_softmax of the runtime's own logits, presence/frequency penalties and
logit_bias against OpenAI's formula, seeds, and their composition with speculative decoding."""
from __future__ import annotations

import pytest
import torch

from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.speculative.decode import SpecOptions, Speculator
from mawforge.errors import RequestError

TARGET = ("qwen3_moe", "F32")
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a"


@pytest.fixture(scope="module")
def rt(packs):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    runtime = Runtime(packs[TARGET], RuntimeOptions(context=1100, expert_cache_percent=100, prefetch="none"))
    yield runtime
    runtime.close()
    torch.set_num_threads(n)


def replay_logits(rt: Runtime, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The raw logits of each generated position, computed again the way decoding computes them:
    the prompt in one forward, then one token at a time. [V] each, float32."""
    rt.reset()
    out = [rt.forward(prompt)[-1].float()]
    for t in tokens[:-1]:
        out.append(rt.forward([t], kind="decode")[-1].float())
    return out


def penalized(raw: torch.Tensor, before: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition, written out: mu[j] -= c[j] * frequency + (c[j] > 0) * presence."""
    out = raw.clone()
    for j in set(before):
        c = before.count(j)
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


def test_logprobs_are_log_softmax_of_the_runtime_logits(rt):
    ids = rt.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=3, logprobs=5, ignore_eos=True)
    events = list(generate(rt, ids, params))
    tokens = [e.token for e in events]
    for e, logits in zip(events, replay_logits(rt, ids, tokens)):
        ref = torch.log_softmax(logits, dim=-1)
        assert e.logprob.token == e.token
        torch.testing.assert_close(e.logprob.logprob, float(ref[e.token]), rtol=0, atol=1e-6)
        vals, idx = torch.topk(ref, 5)
        assert [t for t, _ in e.logprob.top] == idx.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e.logprob.top]), vals, rtol=0, atol=1e-6)
    # nothing is computed when nobody asks
    assert all(e.logprob is None for e in generate(rt, ids, SamplingParams(max_tokens=3)))


def test_penalties_follow_openais_formula_on_the_recorded_logits(rt):
    ids = rt.tokenizer.encode(PROMPT)
    plain = [e.token for e in generate(rt, ids, SamplingParams(max_tokens=16, ignore_eos=True))]
    pres, freq = -1.0, -1.5          # negative: a token once emitted is pushed up, so the output changes
    params = SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=pres, frequency_penalty=freq)
    got = [e.token for e in generate(rt, ids, params)]
    assert got != plain and len(set(got)) < len(got)
    for i, logits in enumerate(replay_logits(rt, ids, got)):
        assert got[i] == int(torch.argmax(penalized(logits, got[:i], pres, freq)))


def test_sampler_processors_apply_bias_and_penalties_and_roll_back():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=g)
    s = Sampler(SamplingParams(temperature=1.0, presence_penalty=-0.5, frequency_penalty=0.25,
                               logit_bias=((3, 100.0), (7, -100.0), (3, 1.0))))
    seen = [5, 9, 5]
    for t in seen:
        s.accept(t)
    want = penalized(logits, seen, -0.5, 0.25)
    want[3] += 101.0
    want[7] -= 100.0
    torch.testing.assert_close(s.process(logits), want)
    s.rollback(2)                                          # back to [5]
    want = penalized(logits, [5], -0.5, 0.25)
    want[3] += 101.0
    want[7] -= 100.0
    torch.testing.assert_close(s.process(logits), want)
    assert s.probs(logits)[7] < 1e-30 and int(torch.argmax(s.probs(logits))) == 3


def test_logit_bias_steers_greedy_decoding(rt):
    ids = rt.tokenizer.encode(PROMPT)
    plain = [e.token for e in generate(rt, ids, SamplingParams(max_tokens=4, ignore_eos=True))]
    banned = [e.token for e in generate(rt, ids, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                logit_bias=((plain[0], -100.0),)))]
    assert banned[0] != plain[0] and plain[0] not in banned
    forced = next(t for t in range(5, 100) if t not in rt.tokenizer.eos_ids)
    got = [e.token for e in generate(rt, ids, SamplingParams(max_tokens=4, logit_bias=((forced, 100.0),)))]
    assert got == [forced] * 4


def test_gguf_token_bytes_spell_the_text(rt):
    for text in ("naïve café 🦙 日本語", "def f(x):\n    return x"):
        ids = rt.tokenizer.encode(text, add_special=False)
        assert b"".join(rt.tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_seed_reproduces_and_choices_get_their_own_seeds(rt):
    ids = rt.tokenizer.encode(PROMPT)
    p = SamplingParams(max_tokens=10, temperature=1.5, seed=11, ignore_eos=True)
    run = lambda q: [e.token for e in generate(rt, ids, q)]
    assert run(p) == run(p)
    assert p.for_choice(0) is p and p.for_choice(1).seed != p.seed != p.for_choice(2).seed
    assert run(p.for_choice(1)) == run(p.for_choice(1))
    assert SamplingParams(seed=None).for_choice(3).seed is None


@pytest.mark.parametrize("kw,field", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"seed": 2**64}, "seed")])
def test_bad_values_name_their_field(kw, field):
    with pytest.raises(RequestError, match=f"^{field} "):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary_is_refused(rt):
    with pytest.raises(RequestError, match="^logit_bias token id"):
        list(generate(rt, [1, 2], SamplingParams(logit_bias=((rt.cfg.vocab, 1.0),))))


def covering_prompt(vocab: int) -> list[int]:
    """Every token id once: prompt lookup finds whatever the model emits, so drafts are verified."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist()


def test_speculation_keeps_penalized_output_and_takes_logprobs_from_the_verify_logits(rt):
    """Greedy with penalties: the speculative run emits the plain run's tokens (the penalty state
    advances through each draft it checks and rolls back), and its logprobs, read from the verify
    forward's logits, equal the plain run's within float32 reduction-order noise."""
    ids = covering_prompt(rt.cfg.vocab)
    params = SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4,
                            logprobs=2)
    plain = list(generate(rt, ids, params))
    sp = Speculator(rt, SpecOptions(mode="ngram", k=4))
    try:
        spec = list(generate(rt, ids, params, speculative=sp))
    finally:
        sp.close()
    assert [e.token for e in spec] == [e.token for e in plain]
    assert spec[-1].telemetry.speculative["verify_steps"] > 0
    for a, b in zip(spec, plain):
        assert abs(a.logprob.logprob - b.logprob.logprob) < 1e-4
        assert [t for t, _ in a.logprob.top] == [t for t, _ in b.logprob.top]
