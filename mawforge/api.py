"""The Python API: load a model once under a memory budget, then generate, complete and chat,
each call with its telemetry. The `mawforge run` command stands on it.

    import mawforge
    with mawforge.load("model.gguf", memory_budget_gib=8, context=4096) as m:
        for ev in m.generate("The capital of France is", max_tokens=16):
            print(ev.text, end="")                       # ev.token, ev.finish_reason, ev.telemetry
        reply = m.chat([{"role": "user", "content": "Hi"}], max_tokens=64)
        print(reply.content, reply.telemetry.ttft_s)

`load` takes a pack directory, or a GGUF file or Hugging Face directory that it packs on first
use into a cache directory (atomically: a pack is either whole or absent) and reuses after.
Errors are MawError subclasses with the CLI's one-line messages. `memory_budget_gib` also takes a
plan.Budget (bytes and the source the plan's table names), which is how the commands pass theirs.
The commands stand on this module: a configuration becomes a plan only through
engine/options.py's plan_for_options (`plan_for`, the runtime `load` opens), and `mawforge run`
and `serve` open their model with Model.from_options.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from mawforge.engine.options import RuntimeOptions, plan_for_options
from mawforge.errors import FormatError, MawError, RequestError
from mawforge.formats.gguf import SHARD_RE, shard_paths
from mawforge.plan import API_SOURCE, PREFILL_WAVE, Budget, PackFacts, Plan
from mawforge.telemetry import Telemetry

if TYPE_CHECKING:             # torch loads with the first model, not with `plan_for` (bench, tune)
    from mawforge.engine.generate import Event
    from mawforge.engine.runtime import Runtime
    from mawforge.engine.sampling import SamplingParams
    from mawforge.speculative.decode import SpecOptions

__all__ = ["load", "plan_for", "open_pack", "Model", "Completion", "ChatReply", "ModelClosed", "Busy"]


class ModelClosed(MawError):
    """A call on a model after close()."""


class Busy(RequestError):
    """A second generation started while one is still streaming: the runtime runs one sequence."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("MAWFORGE_CACHE", Path.home() / ".cache" / "mawforge")) / "packs"


def _is_pack(p: Path) -> bool:
    return p.is_dir() and (p / "manifest.json").is_file()


def _is_gguf_model(p: Path) -> bool:
    """a GGUF file, or a directory of GGUF shards (no config.json)"""
    return (p.is_file() and p.suffix == ".gguf") or (
        p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf")))


def _source_key(src: Path, layout: str) -> str:
    """Which pack a source becomes: its resolved path, every file's size and mtime, the layout
    (and whether it is packed in place)."""
    if _is_gguf_model(src):
        files = shard_paths(src)         # a shard set: every shard's size and mtime
        src = files[0]
    else:
        files = sorted(f for f in src.rglob("*") if f.is_file()) if src.is_dir() else [src]
    h = hashlib.sha256(f"{src.resolve()}\0{layout}".encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f.relative_to(src) if src.is_dir() else f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def open_pack(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, layout: str = "exact",
              progress: bool = False, in_place: bool | None = None) -> Path:
    """The pack for `path`: the path itself when it is a pack, else the cached pack of that GGUF
    file or HF directory, packed now if missing or if the source changed since; a GGUF in the exact
    layout in place by default (in_place=None: the experts read from the GGUF, no second copy)."""
    p = Path(path)
    if _is_pack(p):
        return p
    if not p.exists():
        raise FormatError(f"{p}: no such file or directory")
    if p.is_dir() and not (p / "config.json").is_file() and not _is_gguf_model(p):
        raise FormatError(f"{p}: neither a pack (manifest.json), a Hugging Face directory (config.json) nor "
                          "a directory of GGUF shards")
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = p.stem if p.is_file() else p.name
    if _is_gguf_model(p):          # a shard set is named by its model, however it was given
        first = shard_paths(p)[0]
        name = m["stem"] if (m := SHARD_RE.match(first.name)) else first.stem
    if default := in_place is None:
        in_place = _is_gguf_model(p) and layout == "exact"
    out = out / f"{name}-{_source_key(p, layout + ('+in-place' if in_place else ''))}"
    if not _is_pack(out):
        from mawforge.pack.packer import InPlaceRefused, pack
        try:
            pack(p, out, layout=layout, force=out.exists(), progress=progress, in_place=in_place)
        except InPlaceRefused:
            if not default:
                raise
            out = out.with_name(f"{name}-{_source_key(p, layout)}")    # a type stored transcoded: a copy
            if not _is_pack(out):
                pack(p, out, layout=layout, force=out.exists(), progress=progress)
    return out


def as_budget(memory_budget_gib: float | Budget | None) -> Budget | None:
    """The API's budget argument as a Budget: GiB given here, or a Budget passed through."""
    if memory_budget_gib is None or isinstance(memory_budget_gib, Budget):
        return memory_budget_gib
    return Budget.from_gib(memory_budget_gib, API_SOURCE)


def plan_for(path: str | os.PathLike, *, memory_budget_gib: float | Budget | None = None, context: int = 4096,
             expert_cache_percent: float | None = None, expert_cache_gib: float | None = None,
             kv_dtype: str | None = None, prefill_chunk: int = 128, prefill_wave: int = PREFILL_WAVE,
             prompt_cache_gib: float | None = None, stream_embeddings: bool = False) -> Plan:
    """The static plan of a pack under a budget, without loading it (`mawforge plan`, `bench`,
    `tune`): the plan `load` would make with these arguments, with the framework's static size."""
    opts = RuntimeOptions(context=context, budget=as_budget(memory_budget_gib),
                          expert_cache_percent=expert_cache_percent, expert_cache_gib=expert_cache_gib,
                          kv_dtype=kv_dtype, prefill_chunk=prefill_chunk, prefill_wave=prefill_wave,
                          prompt_cache_gib=prompt_cache_gib, stream_embeddings=stream_embeddings)
    return plan_for_options(PackFacts.from_pack(path), opts)


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    telemetry: Telemetry


@dataclass(frozen=True)
class ChatReply:
    """One assistant turn, parsed as the server parses it: content, reasoning, tool calls."""
    message: dict                    # {"role": "assistant", "content", ["reasoning_content"], ["tool_calls"]}
    finish_reason: str               # "stop" | "length" | "tool_calls"
    telemetry: Telemetry
    tokens: list[int] = field(default_factory=list)

    @property
    def content(self) -> str | None:
        return self.message.get("content")

    @property
    def reasoning(self) -> str | None:
        return self.message.get("reasoning_content")

    @property
    def tool_calls(self) -> list[dict]:
        return list(self.message.get("tool_calls") or ())


class Model:
    """A loaded pack: one runtime (resident common tensors, expert cache, KV cache) and one plan.
    One generation runs at a time; a second one started while a stream is open raises Busy."""

    def __init__(self, runtime: Runtime, speculator=None, chat_template: str | None = None):
        """`speculator`: a speculative.decode.Speculator over this runtime (closed with the model)."""
        self.runtime, self.speculator = runtime, speculator
        self._lock = threading.Lock()
        self._busy = False
        self._closed = False
        self.last_telemetry: Telemetry | None = None
        self._chat_template = chat_template
        self._front = None

    @classmethod
    def from_options(cls, pack: str | os.PathLike, opts: RuntimeOptions, *, speculative: SpecOptions | None = None,
                     recorder=None, plan: Plan | None = None, chat_template: str | None = None) -> "Model":
        """A pack opened with a whole configuration (`load`, `mawforge run` and `serve`): its one
        runtime (which makes the plan, or takes `plan`, plan_for_options' of these options) and,
        unless speculative is None or off, its speculator. `recorder`: a trace.record.TraceRecorder."""
        from mawforge.engine.runtime import Runtime
        rt = Runtime(pack, opts, recorder=recorder, plan=plan)
        try:
            spec = None
            if speculative is not None and speculative.mode != "off":
                from mawforge.speculative.decode import Speculator
                spec = Speculator(rt, speculative)
        except BaseException:
            rt.close()
            raise
        return cls(rt, spec, chat_template)

    # ---- facts ----
    @property
    def plan(self) -> Plan:
        return self.runtime.plan

    @property
    def config(self):
        return self.runtime.cfg

    @property
    def tokenizer(self):
        return self.runtime.tokenizer

    @property
    def pack_digest(self) -> str:
        return self.runtime.manifest.pack_digest

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        self._check_open()
        return self.runtime.tokenizer.encode(text, add_special=add_special)

    def decode(self, ids: Sequence[int]) -> str:
        self._check_open()
        return self.runtime.tokenizer.decode(list(ids))

    # ---- generation ----
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 96, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                 response_format: dict | None = None, _turn=None, **extra) -> Iterator[Event]:
        """Text (tokenized with the model's special tokens) or token ids in; a stream of Events
        out, one a token (`token`, its `text`), the last with `finish_reason` and `telemetry`.
        `response_format`: OpenAI's ({"type": "json_object"} or {"type": "json_schema",
        "json_schema": {"name", "schema", "strict"}}): the output is constrained to it token by
        token (llguidance). Validation happens here, before the stream is returned."""
        self._check_open()
        ids = self._ids(prompt)
        params = self._params(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              min_p=min_p, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
                              ignore_eos=ignore_eos, **extra)
        from mawforge.engine.generate import validate
        validate(self.runtime, ids, params)
        return self._stream(ids, params, self._processors(response_format, _turn))

    def complete(self, prompt: str | Sequence[int], **kw) -> Completion:
        """generate() run to its end: the whole text and tokens."""
        texts, toks, last = [], [], None
        for ev in self.generate(prompt, **kw):
            texts.append(ev.text)
            if ev.token is not None:
                toks.append(ev.token)
            last = ev
        return Completion("".join(texts), toks, last.finish_reason, last.telemetry)

    def chat(self, messages: Sequence[dict], *, tools: list | None = None, tool_choice=None,
             response_format: dict | None = None, chat_template_kwargs: dict | None = None,
             reasoning_format: str | None = None, **kw) -> ChatReply:
        """One assistant turn through the model's chat template, with the server's tool-call and
        reasoning parsing and constraints (OpenAI message, tool and response_format shapes): a
        forced tool call (tool_choice "required" or a named function) follows its schema."""
        turn = self.chat_turn(messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                              chat_template_kwargs=chat_template_kwargs, reasoning_format=reasoning_format)
        texts, toks, last = [], [], None
        for ev in self.generate(turn.prompt, response_format=response_format, _turn=turn, **kw):
            texts.append(ev.text)
            if ev.token is not None:
                toks.append(ev.token)
            last = ev
        from mawforge.front.chatreq import shape_choice
        choice: dict = {}
        shape_choice(choice, turn.parser, texts, last.finish_reason)
        return ChatReply(choice["message"], choice["finish_reason"], last.telemetry, toks)

    def chat_turn(self, messages: Sequence[dict], *, tools: list | None = None, tool_choice=None,
                  response_format: dict | None = None, chat_template_kwargs: dict | None = None,
                  reasoning_format: str | None = None):
        """The rendered prompt and output parser of a chat turn (front/chatreq.py Turn)."""
        self._check_open()
        from mawforge.front.chatreq import parse_chat_options
        from mawforge.front.protocol import ApiError
        body = {"tools": tools, "tool_choice": tool_choice, "chat_template_kwargs": chat_template_kwargs,
                "reasoning_format": reasoning_format, "response_format": response_format}
        try:
            msgs = [self._message(m, i) for i, m in enumerate(messages)]
            if not msgs:
                raise RequestError("messages must be a non-empty list")
            return self._chat_front().prepare(parse_chat_options(body, msgs))
        except ApiError as e:                  # the server's request checks, as the API's error type
            raise RequestError(e.message) from None

    # ---- lifetime ----
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self.speculator is not None:
                self.speculator.close()
        finally:
            self.runtime.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inside ----
    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosed("this model is closed; load it again")

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.runtime.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("prompt must be a string or a sequence of token ids")
        return ids

    @staticmethod
    def _params(stop, stop_token_ids, **kw) -> SamplingParams:
        from mawforge.engine.sampling import SamplingParams
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        return SamplingParams(stop=stops, stop_token_ids=tuple(stop_token_ids), **kw)

    @staticmethod
    def _message(m, i: int) -> dict:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be a dict with a string role")
        return {**m, "content": "" if m.get("content") is None else m["content"]}

    def _processors(self, response_format: dict | None, turn) -> tuple:
        """The request's constraint, as the server builds it (front/structured.py)."""
        if response_format is None and (turn is None or not (turn.forced or turn.offered)):
            return ()
        from mawforge.front.protocol import ApiError, parse_response_format
        from mawforge.front.structured import request_constraint
        try:
            proc = request_constraint(self.runtime, parse_response_format(response_format), turn)
        except ApiError as e:
            raise RequestError(e.message) from None
        return () if proc is None else (proc,)

    def _chat_front(self):
        if self._front is None:
            from mawforge.front.chatreq import ChatDefaults, ChatFront
            chat = self.runtime.tokenizer.chat
            if self._chat_template is not None:
                from mawforge.text.chat import ChatTemplate
                chat = ChatTemplate(self._chat_template, chat.bos, chat.eos)
            self._front = ChatFront(chat, ChatDefaults())
        return self._front

    def _stream(self, ids: list[int], params: SamplingParams, processors: tuple = ()) -> Iterator[Event]:
        with self._lock:
            self._check_open()
            if self._busy:
                raise Busy("a generation is still streaming on this model; finish or close it first")
            self._busy = True
        from mawforge.engine.generate import generate
        try:
            for ev in generate(self.runtime, ids, params, speculative=self.speculator, processors=processors):
                if ev.telemetry is not None:
                    self.last_telemetry = ev.telemetry
                yield ev
        finally:
            self._busy = False


def load(path: str | os.PathLike, *, memory_budget_gib: float | Budget | None = None, context: int = 4096,
         expert_cache_percent: float | None = None, expert_cache_gib: float | None = None,
         policy: str = "s3fifo", prefetch: str = "auto", threads: int | None = None,
         kv_dtype: str | None = None, prefill_chunk: int = 128, prefill_wave: int = PREFILL_WAVE,
         prompt_cache_gib: float | None = None, speculative: str | None = None,
         chat_template: str | None = None, cache_dir: str | os.PathLike | None = None,
         layout: str = "exact", device: str = "cpu", progress: bool = False,
         stream_embeddings: bool = False, miss_policy: str = "exact") -> Model:
    """Load a pack (or a GGUF file / HF directory, packed on first use) under a memory budget.
    The plan is made once; a configuration it rejects raises BudgetRejected with its reason.
    `prompt_cache_gib`: saved prompts reused by later calls that share a prefix (None: the
    planner's auto size, 0: off). `miss_policy`: models/miss_policy.py (lossy ones are opt-in)."""
    opts = RuntimeOptions(context=context, budget=as_budget(memory_budget_gib),
                          expert_cache_percent=expert_cache_percent, expert_cache_gib=expert_cache_gib,
                          policy=policy, prefetch=prefetch, threads=threads, kv_dtype=kv_dtype,
                          prefill_chunk=prefill_chunk, prefill_wave=prefill_wave, miss_policy=miss_policy,
                          prompt_cache_gib=prompt_cache_gib, device=device, stream_embeddings=stream_embeddings)
    pack = open_pack(path, cache_dir, layout, progress)
    spec = None
    if speculative not in (None, "off"):
        from mawforge.speculative.decode import SpecOptions
        spec = SpecOptions(mode=speculative)
    return Model.from_options(pack, opts, speculative=spec, chat_template=chat_template)


def describe(model: Model) -> str:
    """One JSON line of what was loaded (pack, plan terms), for logs."""
    p = model.plan
    return json.dumps({"pack_digest": model.pack_digest, "arch": model.config.arch, "C": p.C, "E": p.E,
                       "K": p.K, "P": p.P, "O": p.O, "F": p.F, "budget_bytes": p.budget_bytes})
