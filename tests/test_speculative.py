"""Speculative decoding: drafters, exact verification (greedy identity, sampling distribution),
KV rollback, MoE-aware accounting against an exact counterfactual, the auto controller, the CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch

from mawforge.speculative.drafters import DraftModelDrafter, Drafter, NgramDrafter
from mawforge.engine.generate import generate
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.engine.sampling import Sampler, SamplingParams
from mawforge.speculative.accounting import AutoController
from mawforge.speculative.decode import SpecOptions, Speculator, accept_drafts
from mawforge.errors import BudgetRejected, FormatError, RequestError, UnsupportedError
from mawforge.plan import Budget, PackFacts, make_plan
from helpers import run_cli, sample_outputs
from bounds import SAMPLING_TV

TARGET, DRAFT, OTHER = ("qwen3_moe", "F32"), ("qwen3_moe", "Q8_0"), ("qwen2_moe", "F32")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine they oversubscribe."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def forward_clock(monkeypatch):
    """Replaces auto's clock with one that advances one unit per forward call, whatever its
    width: a machine where a verify step costs what a one-token step does. On it speculation
    never loses (ties go to 'spec'), so auto must verify, and no test depends on real speed."""
    from mawforge.speculative import decode as speculative
    now = [0.0]
    forward = Runtime.forward

    def counted(self, *a, **kw):
        now[0] += 1.0
        return forward(self, *a, **kw)

    monkeypatch.setattr(Runtime, "forward", counted)
    monkeypatch.setattr(speculative, "clock", lambda: now[0])
    return now


def covering_prompt(vocab: int = 1024) -> list[int]:
    """Every token id once, shuffled: whatever a random tiny model emits, prompt lookup finds it."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist()


def runtime(pack, budget: str = "50", context: int = 1100, prefetch: str = "none") -> Runtime:
    """prefetch "none" by default here: the counterfactual replays plain decoding exactly only when
    the cache's decisions follow from routing alone; auto prefetch's router lookahead and its
    on/off windows are live decisions it cannot replay (the report says so)."""
    if budget == "min":
        gib = PackFacts.from_pack(pack).min_cache_bytes / 2**30
        return Runtime(pack, RuntimeOptions(context=context, expert_cache_gib=gib, prefetch=prefetch))
    return Runtime(pack, RuntimeOptions(context=context, expert_cache_percent=float(budget), prefetch=prefetch))


def run(pack, mode: str, budget: str, params: SamplingParams, prompt: str | list[int] = CODE,
        prefetch: str = "none", **spec):
    rt = runtime(pack, budget, prefetch=prefetch)
    sp = Speculator(rt, SpecOptions(mode=mode, **spec)) if mode != "off" else None
    ids = rt.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    try:
        events = list(generate(rt, ids, params, speculative=sp))
        kv_pos, n_prompt = rt.kv.pos, len(ids)
    finally:
        if sp is not None:
            sp.close()
        rt.close()
    return [e.token for e in events], "".join(e.text for e in events), events[-1].telemetry, kv_pos - n_prompt


# ---- drafters --------------------------------------------------------------------------

def test_ngram_drafter_proposes_the_latest_longest_match():
    d = NgramDrafter(None, SpecOptions(mode="ngram", ngram_max=3))
    assert d.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # "7 2" occurs twice: the bigram match wins over the unigram "2", and the later occurrence wins
    assert d.propose([5, 2, 9, 7, 2, 8, 6, 7, 2], 2) == [8, 6]
    assert d.probs is None                                 # deterministic proposals: point masses
    assert d.propose([9, 9, 9, 1], 4) == []                # 1 never occurred before
    assert d.propose([4, 4], 3) == [4]                     # a context that does not extend the last one resets
    assert d.propose([1, 2, 1], 0) == []


def test_mtp_reports_a_model_without_mtp_layers(packs):
    rt = runtime(packs[TARGET])
    try:
        with pytest.raises(UnsupportedError, match="has no MTP layers"):
            Speculator(rt, SpecOptions(mode="mtp"))
        with pytest.raises(FormatError, match="--draft-pack"):
            Speculator(rt, SpecOptions(mode="draft"))
        with pytest.raises(RequestError, match="speculative mode"):
            SpecOptions(mode="sometimes")
    finally:
        rt.close()


def test_draft_pack_must_share_the_tokenizer_and_fit_the_budget(packs):
    rt = runtime(packs[("mixtral", "F32")])
    try:
        with pytest.raises(FormatError, match="tokenizer"):
            Speculator(rt, SpecOptions(mode="draft", draft_pack=str(packs[DRAFT])))
    finally:
        rt.close()
    target = packs[TARGET]
    L = make_plan(PackFacts.from_pack(target), context=256, expert_cache_percent=25).L
    tight = Runtime(target, RuntimeOptions(context=256, expert_cache_percent=25, budget=Budget(L + 1024, "test")))
    try:
        with pytest.raises(BudgetRejected, match="draft"):
            Speculator(tight, SpecOptions(mode="draft", draft_pack=str(packs[DRAFT])))
    finally:
        tight.close()


# ---- greedy: identical output, exact accounting ------------------------------------------

@pytest.mark.parametrize("budget", ["min", "50", "100"])
def test_greedy_speculation_matches_plain_decoding(packs, budget, forward_clock):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = {"code": CODE, "cover": covering_prompt()}
    plain = {name: run(packs[TARGET], "off", budget, params, prompt=p) for name, p in prompts.items()}
    assert plain["code"][2].speculative["mode"] == "off"
    for mode, prompt, spec in (("ngram", "cover", {}), ("auto", "cover", {"window": 4}),
                               ("draft", "code", {"draft_pack": str(packs[DRAFT])}),
                               ("draft", "code", {"draft_pack": str(packs[OTHER]), "k": 2})):
        toks, text, t, kv_kept = run(packs[TARGET], mode, budget, params, prompt=prompts[prompt], **spec)
        want, plain_text, t_plain, _ = plain[prompt]
        s = t.speculative
        assert toks == want and text == plain_text, (mode, spec)
        assert kv_kept == len(toks) - 1                    # rejected positions were rolled back
        assert 0 <= s["accepted"] <= s["drafted"]
        # every mode verifies: auto too, on forward_clock's machine where speculation never loses
        assert s["verify_steps"] > 0 and s["drafted"] > 0, mode
        assert 1 < s["verify_width"] <= 1 + s["k"]
        assert s["union_experts_per_layer"] >= s["single_token_experts_per_layer"] == 2.0
        # the counterfactual replays exactly what plain decoding materialized
        assert t.materialized_bytes - s["extra_materialized_bytes"] == t_plain.materialized_bytes
        assert t.evictions - s["extra_evictions"] == t_plain.evictions
        assert t.misses - s["extra_misses"] == t_plain.misses
        assert sum(st["materialized_bytes"] for st in s["steps"]) == s["decode_materialized_bytes"]
        if mode == "draft" and spec["draft_pack"] == str(packs[DRAFT]):
            assert s["accepted"] > 0                       # same weights at Q8_0: most drafts survive
            assert s["draft"]["kv_cache_bytes"] > 0 and s["draft"]["expert_cache_bytes"] > 0


def test_speculation_under_auto_prefetch_is_transparent_and_labels_its_counterfactual(packs, forward_clock):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want, text, _, _ = run(packs[TARGET], "off", "min", params, prompt=covering_prompt(), prefetch="auto")
    got, got_text, t, _ = run(packs[TARGET], "ngram", "min", params, prompt=covering_prompt(), prefetch="auto")
    assert (got, got_text) == (want, text)
    assert t.speculative["verify_steps"] > 0 and t.prefetch["mode"] == "auto"
    assert "router lookahead not replayed" in t.speculative["plain_counterfactual"]


def test_stop_inside_accepted_drafts_ends_the_stream_there(packs):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _, _, _ = run(packs[TARGET], "off", "50", params)
    stop = (plain[10],)
    want, _, t_plain, _ = run(packs[TARGET], "off", "50", SamplingParams(max_tokens=24, stop_token_ids=stop))
    got, _, t, _ = run(packs[TARGET], "draft", "50", SamplingParams(max_tokens=24, stop_token_ids=stop),
                       draft_pack=str(packs[DRAFT]))
    assert got == want and t.finish_reason == "stop"
    assert t.materialized_bytes - t.speculative["extra_materialized_bytes"] == t_plain.materialized_bytes


# ---- sampling: the output distribution is the plain sampler's ------------------------------

def _tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in set(a) | set(b))


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(point_mass):
    """Two positions, V=5: the target p(t1), p(t2|t1) and a deliberately wrong draft q; the joint
    of the first two emitted tokens must be p's. Seeded, so the statistic is a fixed number."""
    V, N = 5, 6000
    g = torch.Generator().manual_seed(7)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, 1)             # row t1 -> p(t2 | t1)
    q1 = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, 1)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    counts: dict = {}
    for _ in range(N):
        if point_mass:                                    # a lookup drafter: fixed proposals
            d = [int(torch.argmax(q1)), int(torch.argmax(q2[int(torch.argmax(q1))]))]
            q = None
        else:
            d1 = int(torch.multinomial(q1, 1, generator=g))
            d = [d1, int(torch.multinomial(q2[d1], 1, generator=g))]
            q = [q1, q2[d1]]
        logits = torch.log(torch.stack([p1, p2[d[0]], p2[d[1]]]))           # [W, V]
        n, nxt = accept_drafts(sampler, logits, d, q)
        out = d[:n] + [nxt]
        if len(out) == 1:                                 # the next step samples t2 after the correction
            out.append(sampler.draw(p2[out[0]]))
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    want = {(a, b): float(p1[a] * p2[a, b]) for a in range(V) for b in range(V)}
    got = {k: v / N for k, v in counts.items()}
    naive = {(a, b): float(q1[a] * q2[a, b]) for a in range(V) for b in range(V)}   # always-accept would give q
    assert _tv(naive, want) > 0.3                         # the check has power against a wrong verifier
    assert _tv(got, want) < SAMPLING_TV                   # expected <= 0.026 at N=6000 (bounds.py)


def test_greedy_acceptance_follows_the_argmax():
    s = Sampler(SamplingParams())
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert accept_drafts(s, logits, [1, 0], None) == (2, 2)
    assert accept_drafts(s, logits, [1, 2], None) == (1, 0)
    assert accept_drafts(s, logits, [2, 0], None) == (0, 1)


class _SkewedDraft(DraftModelDrafter):
    """The target's own weights, but drafting mostly the least likely allowed token."""

    def _q(self, logits):
        p = super()._q(logits)
        worst = torch.where(p > 0, p, torch.full_like(p, 2.0)).argmin()
        skew = torch.zeros_like(p)
        skew[worst] = 1.0
        return 0.8 * skew + 0.2 * p


def test_model_drafted_sampling_matches_the_exact_distribution(packs):
    """t1 comes from prefill; t2 and t3 from one verify step (accept, resample or bonus). Their
    exact joint under top-k=3 sampling is computed from the target; 700 seeded requests must match."""
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    rt = runtime(packs[TARGET], "100", context=32)
    prompt = rt.tokenizer.encode("a b")
    sampler = Sampler(SamplingParams(**params))

    def dist(prefix):
        rt.reset()
        return sampler.probs(rt.forward(prompt + prefix)[-1])

    want = {}
    p1 = dist([])
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = dist([a])
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = dist([a, b])
            for c in torch.nonzero(p3).flatten().tolist():
                want[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    sp = Speculator(rt, SpecOptions(mode="draft", draft_pack=str(packs[TARGET]), k=2),
                    _drafter=_SkewedDraft(rt, SpecOptions(mode="draft", draft_pack=str(packs[TARGET]))))
    N = 700
    try:
        counts, drafted, accepted = sample_outputs(rt, prompt, params, sp, N)
    finally:
        sp.drafter.close()
        rt.close()
    assert drafted == N and 0 < accepted < N              # both the accept and the resample paths ran
    assert set(counts) <= set(want)
    chi2 = sum((counts.get(k, 0) - N * p) ** 2 / (N * p) for k, p in want.items())
    dof = len(want) - 1
    # chi-square upper tail at p ~ 1e-6 (Wilson-Hilferty); a skewed, unverified draft scores in the thousands
    z = 4.75
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit)


# ---- auto ---------------------------------------------------------------------------------

def test_auto_controller_keeps_the_faster_mode_and_reprobes():
    for spec_rate, plain_rate, winner in ((30.0, 10.0, "spec"), (5.0, 10.0, "plain")):
        c = AutoController(window=4, probe_every=4)
        used = {"spec": 0, "plain": 0}
        for _ in range(200):
            m = c.mode()
            used[m] += 1
            c.record(m, 2, 2 / (spec_rate if m == "spec" else plain_rate))
        loser = "plain" if winner == "spec" else "spec"
        assert used[winner] > 2 * used[loser] and used[loser] > 0
        r = c.report()
        assert r["spec_windows"] + r["plain_windows"] == 100
        assert r[f"{winner}_tok_s"] > r[f"{loser}_tok_s"]


def test_auto_falls_back_to_plain_when_speculation_is_slower(packs, monkeypatch):
    """A drafter whose proposals are always wrong and cost a (fake) second each: auto must
    spend most steps plain. The engine's clock is replaced, so nothing here is timed."""
    from mawforge.speculative import decode as speculative
    now = [0.0]

    def clock():
        now[0] += 0.001
        return now[0]

    monkeypatch.setattr(speculative, "clock", clock)

    class _Slow(Drafter):
        def propose(self, context, k):
            now[0] += 1.0
            self.probs = None
            return [(context[-1] + 1) % 7] * k

    rt = runtime(packs[TARGET], "50")
    sp = Speculator(rt, SpecOptions(mode="auto", window=2, probe_every=8), _drafter=_Slow(rt, None))
    try:
        ev = list(generate(rt, rt.tokenizer.encode(CODE), SamplingParams(max_tokens=40, ignore_eos=True),
                           speculative=sp))
    finally:
        rt.close()
    s = ev[-1].telemetry.speculative
    assert s["mode"] == "auto" and s["auto"]["plain_windows"] > s["auto"]["spec_windows"] >= 1
    assert s["plain_steps"] > s["verify_steps"]


# ---- request override and CLI -------------------------------------------------------------

def test_for_request_override(packs):
    rt = runtime(packs[TARGET])
    try:
        sp = Speculator(rt, SpecOptions(mode="auto"))
        assert sp.for_request(None) is sp and sp.for_request("off") is None
        assert sp.for_request("ngram").opts.mode == "ngram"
        with pytest.raises(RequestError, match="did not load"):
            sp.for_request("draft")
    finally:
        rt.close()


def test_cli_run_speculative_reports_counters(packs):
    r = run_cli("run", "--pack", str(packs[TARGET]), "--context", "128", "--expert-cache-percent", "25",
                "--max-tokens", "12", "--ignore-eos", "--speculative", "draft", "--draft-pack", str(packs[DRAFT]),
                "--draft-k", "3", "--telemetry-json", "one two one two one two")
    assert r.returncode == 0, r.stderr
    tele = json.loads(r.stderr.strip().splitlines()[-1])
    s = tele["speculative"]
    assert tele["completion_tokens"] == 12 and s["mode"] == "draft" and s["k"] == 3 and s["drafted"] > 0
    r = run_cli("run", "--pack", str(packs[TARGET]), "--context", "128", "--speculative", "mtp", "hi")
    assert r.returncode != 0 and "has no MTP layers" in r.stderr and "Traceback" not in r.stderr


def test_cli_run_plans_the_draft_beside_the_target(packs):
    """run with --draft-pack checks target + draft against the budget before loading (exit 4, the
    draft named), sizes the target's cache in what the draft leaves, and reports the draft's L in F."""
    tf, df = PackFacts.from_pack(packs[TARGET]), PackFacts.from_pack(packs[DRAFT])
    alone = make_plan(tf, context=128, expert_cache_percent=25)
    draft_L = make_plan(df, context=128, expert_cache_percent=100).L
    args = ("run", "--pack", str(packs[TARGET]), "--context", "128", "--max-tokens", "6", "--ignore-eos",
            "--speculative", "draft", "--draft-pack", str(packs[DRAFT]), "--threads", "1")
    r = run_cli(*args, "--expert-cache-percent", "25",
                "--memory-budget-gib", str((alone.L + draft_L // 2) / 2**30), "hi")
    assert r.returncode == BudgetRejected.exit_code and "draft L" in r.stderr and "Traceback" not in r.stderr
    roomy = (alone.C + alone.K + 2 * alone.O + draft_L + tf.expert_bytes) / 2**30
    r = run_cli(*args, "--memory-budget-gib", str(roomy), "--telemetry-json", "one two one two")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stderr.strip().splitlines()[-1])
    assert t["planned_draft_bytes"] == draft_L == t["speculative"]["draft"]["planned_bytes"]
    assert "less the draft" in t["budget_source"] and t["planned_footprint_bytes"] > draft_L


def test_benchmark_script_writes_the_table(packs, tmp_path, capsys):
    """benchmarks/speculative.py at smoke size: one row per mode x cache point x prompt, greedy
    tokens identical to plain, and the ratios the issue asks for."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "speculative.py"
    spec = importlib.util.spec_from_file_location("bench_speculative", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--pack", str(packs[TARGET]), "--draft-pack", str(packs[DRAFT]), "--cache", "min", "50",
                       "--prompts", "prose", "--modes", "ngram", "draft", "--decode-tokens", "6",
                       "--warmup-tokens", "2", "--json-out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["cache"], r["mode"]) for r in rows] == \
        [(c, m) for c in ("min", "50") for m in ("plain", "ngram", "draft")]
    assert rows[3]["cache_percent"] == 50.0 and 0 < rows[0]["distinct_fraction"] <= 1
    for i, r in enumerate(rows):
        if r["mode"] != "plain":
            # each ratio is this row's figure over the plain row of the same cache point and prompt
            plain = rows[i - i % 3]
            assert r["identical"] and r["plain_decode_tok_s"] == plain["decode_tok_s"] > 0
            assert r["tok_s_ratio"] == pytest.approx(r["decode_tok_s"] / plain["decode_tok_s"])
            assert r["plain_materialized_bytes"] == plain["materialized_bytes"] > 0
            assert r["materialized_ratio"] == pytest.approx(r["materialized_bytes"] / plain["materialized_bytes"])
    assert rows[2]["draft_planned_bytes"] > 0 and "dec x" in capsys.readouterr().out


# ---- hybrid models: recurrent (delta-net) state rolls back ----------------------------------

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> dict:
    """Qwen3.5-MoE (delta-net + attention) packs: the HF target and a Q8_0 GGUF of the same weights."""
    from mawforge.fixtures.archs.qwen35moe import build_hf, write_gguf
    from mawforge.pack.packer import pack
    root = tmp_path_factory.mktemp("hybrid")
    src = build_hf("qwen3_5_moe", root / "hf")
    pack(src, root / "target", progress=False)
    pack(write_gguf(src, root / "q8.gguf", "Q8_0"), root / "draft", progress=False)
    return {"target": root / "target", "draft": root / "draft"}


class _Oracle(Drafter):
    """Proposes the plain continuation for 0, 1, 2, ... tokens, then a wrong one: every
    acceptance length occurs, so the recurrent state is rolled back into every verify position."""

    def __init__(self, truth: list[int], n_prompt: int) -> None:
        super().__init__(None, None)
        self.truth, self.n_prompt, self.steps = truth, n_prompt, 0

    def propose(self, context, k):
        self.probs = None
        want = self.truth[len(context) - self.n_prompt:][:k]
        j = self.steps % (len(want) + 1)
        self.steps += 1
        return want[:j] + [(t + 1) % 1024 for t in want[j:j + 1]]


@pytest.mark.parametrize("budget", ["min", "50", "100"])
def test_speculation_on_a_hybrid_model_matches_plain_decoding(hybrid, budget, forward_clock):
    """ngram, draft (itself a hybrid pack: its own state rolls back too), auto and forced partial
    acceptance all emit plain decoding's tokens on Qwen3.5-MoE; kept positions are the emitted ones."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    target, prompt = hybrid["target"], covering_prompt()[:200]
    want, text, t_plain, _ = run(target, "off", budget, params, prompt=prompt)
    for mode, spec in (("ngram", {}), ("auto", {"window": 4}), ("draft", {"draft_pack": str(hybrid["draft"]), "k": 3})):
        toks, got_text, t, kept = run(target, mode, budget, params, prompt=prompt, **spec)
        s = t.speculative
        assert toks == want and got_text == text and kept == len(toks) - 1, mode
        assert t.materialized_bytes - s["extra_materialized_bytes"] == t_plain.materialized_bytes
        # every mode verifies: auto too, on forward_clock's machine where speculation never loses
        assert s["verify_steps"] > 0, mode
        if mode == "draft":
            assert s["accepted"] > 0 and s["rollback_state_bytes"] > 0
    rt = runtime(target, budget)
    sp = Speculator(rt, SpecOptions(mode="ngram", k=4), _drafter=_Oracle(want, len(prompt)))
    try:
        ev = list(generate(rt, prompt, params, speculative=sp))
        s = ev[-1].telemetry.speculative
        assert [e.token for e in ev] == want and 0 < s["accepted"] < s["drafted"]
        assert {st["accepted"] for st in s["steps"]} >= {0, 1, 2, 3}
    finally:
        rt.close()
