"""A bounded storm against a running `mawforge serve` (stdlib HTTP only, so it runs anywhere):
concurrent good requests (half streamed), malformed requests, clients that disconnect
mid-stream, large bad bodies while /health is polled, an overload burst, and optionally a
SIGTERM while streams are in flight. Returns what happened; tests assert on it and
benchmarks/storm.py prints it (the /health latencies are figures, never asserted).

    figures = storm(url, model, Storm(clients=8, requests=4), terminate=proc.terminate)
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@dataclass
class Storm:
    clients: int = 8               # concurrent good clients
    requests: int = 4              # good requests per client
    max_tokens: int = 6
    disconnects: int = 4
    big_bodies: int = 4            # ~big_mb MB prompts (refused: over the context)
    big_mb: float = 5.0
    overload: int = 12             # simultaneous requests in the overload burst
    in_flight_at_term: int = 3     # streams open when SIGTERM arrives (if terminate is given)


@dataclass
class Result:
    good: list = field(default_factory=list)          # (prompt index, status, text)
    malformed: list = field(default_factory=list)     # (name, status, error body or None)
    disconnects: int = 0
    big: list = field(default_factory=list)           # statuses
    health_ms: list = field(default_factory=list)     # /health latencies during the bad-body phase
    health_failures: int = 0
    overload: Counter = field(default_factory=Counter)
    retry_after_missing: int = 0
    term_streams: list = field(default_factory=list)  # finish_reason of each stream in flight at SIGTERM
    sent: Counter = field(default_factory=Counter)    # requests sent per endpoint (all phases)

    def figures(self) -> dict:
        h = sorted(self.health_ms)
        pct = lambda q: round(h[min(len(h) - 1, int(q * len(h)))], 1) if h else None
        return {"good": len(self.good), "good_statuses": dict(Counter(s for _, s, _ in self.good)),
                "malformed": len(self.malformed),
                "malformed_statuses": dict(Counter(s for _, s, _ in self.malformed)),
                "disconnects": self.disconnects, "big_bodies": dict(Counter(self.big)),
                "health_polls": len(h), "health_failures": self.health_failures,
                "health_ms_p50": pct(0.5), "health_ms_p99": pct(0.99), "health_ms_max": round(h[-1], 1) if h else None,
                "overload": dict(self.overload), "retry_after_missing": self.retry_after_missing,
                "term_streams": self.term_streams}


def malformed(model: str, context: int) -> list[tuple[str, str, bytes]]:
    """(name, path, body): each must get a 4xx in OpenAI's error schema."""
    msg = [{"role": "user", "content": "hi"}]
    j = lambda **kw: json.dumps({"model": model, **kw}).encode()
    deep = b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    return [
        ("deep nesting 100k", CHAT, deep),
        ("deep nesting 40", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "x", "x": %s}]}'
         % (model.encode(), b"[" * 40 + b"]" * 40)),
        ("invalid utf-8", CHAT, b'{"model": "\xff\xfe", "messages": []}'),
        ("not json", COMP, b"prompt=hello"),
        ("empty body", COMP, b""),
        ("json array", CHAT, b"[1, 2, 3]"),
        ("unknown field", CHAT, j(messages=msg, max_token=5)),
        ("max_tokens 1e12", COMP, j(prompt="hi", max_tokens=10**12)),
        ("max_tokens past the context", COMP, j(prompt="hi", max_tokens=context)),
        ("max_tokens string", COMP, j(prompt="hi", max_tokens="10")),
        ("stop_token_ids negative", COMP, j(prompt="hi", stop_token_ids=[-1])),
        ("stop_token_ids not a list", COMP, j(prompt="hi", stop_token_ids="2")),
        ("stop_token_ids past vocab", COMP, j(prompt="hi", stop_token_ids=[10**9])),
        ("messages not a list", CHAT, j(messages="hi")),
        ("role not a string", CHAT, j(messages=[{"role": 5, "content": "x"}])),
        ("content a number", CHAT, j(messages=[{"role": "user", "content": 5}])),
        ("temperature NaN", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
        ("temperature 1e999", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'),
        ("n 0", CHAT, j(messages=msg, n=0)),
        ("n times max_tokens past the context", CHAT, j(messages=msg, n=16, max_tokens=context // 8)),
        ("model null", CHAT, json.dumps({"model": None, "messages": msg}).encode()),
        ("logit_bias past vocab", CHAT, j(messages=msg, logit_bias={str(10**9): 1})),
        ("top_logprobs 21", CHAT, j(messages=msg, logprobs=True, top_logprobs=21)),
        ("wrong model", CHAT, json.dumps({"model": "gpt-4", "messages": msg}).encode()),
        ("17 prompts", COMP, j(prompt=["a"] * 17)),
        ("token id past vocab", COMP, j(prompt=[10**9])),
        ("prompt of 10^5 ids", COMP, j(prompt=list(range(1, 100001)))),
        ("stream a string", COMP, j(prompt="hi", stream="yes")),
        ("stream_options a list", COMP, j(prompt="hi", stream=True, stream_options=[1])),
    ]


class _Http:
    def __init__(self, url: str, timeout: float = 120.0):
        u = urlsplit(url)
        self.host, self.port, self.timeout = u.hostname, u.port, timeout

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            c.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = c.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            c.close()

    def post(self, path: str, obj) -> tuple[int, dict, bytes]:
        return self.request("POST", path, json.dumps(obj).encode())


def _text(path: str, status: int, raw: bytes, stream: bool) -> str | None:
    if status != 200:
        return None
    if stream:
        out = []
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch:
                    out.append(ch[0].get("text") or ch[0].get("delta", {}).get("content") or "")
        return "".join(out)
    c = json.loads(raw)["choices"][0]
    return c["text"] if path == COMP else c["message"]["content"]


def _error_body(raw: bytes) -> dict | None:
    try:
        err = json.loads(raw)["error"]
        return err if set(err) == {"message", "type", "param", "code"} and err["message"] else None
    except (ValueError, KeyError, TypeError):
        return None


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


PROMPTS = [f"Storm prompt {i}: count the experts." for i in range(4)]    # the good clients' prompts


def storm(url: str, model: str, cfg: Storm, context: int, terminate=None) -> Result:
    h, res, lock = _Http(url), Result(), threading.Lock()
    prompts = PROMPTS

    def good(c: int) -> None:
        for k in range(cfg.requests):
            i, stream = (c + k) % len(prompts), (c + k) % 2 == 1
            path = CHAT if k % 2 else COMP
            body = {"model": model, "temperature": 0, "max_tokens": cfg.max_tokens, "stream": stream}
            body.update({"messages": [{"role": "user", "content": prompts[i]}]} if path == CHAT
                        else {"prompt": prompts[i]})
            for _ in range(200):             # a polite client: on 429, wait as told (capped) and retry
                status, headers, raw = h.post(path, body)
                with lock:
                    res.sent[path] += 1
                if status != 429:
                    break
                time.sleep(min(0.25, float(headers.get("retry-after", headers.get("Retry-After", "1")))))
            with lock:
                res.good.append(((path, i), status, _text(path, status, raw, stream)))

    def bad() -> None:
        for name, path, body in malformed(model, context):
            status, _, raw = h.request("POST", path, body)
            with lock:
                res.sent[path] += 1
                res.malformed.append((name, status, _error_body(raw)))
        status, _, raw = h.request("POST", COMP, b"x" * (9 << 20))       # over --max-body-bytes (8 MiB)
        with lock:
            res.sent[COMP] += 1
            res.malformed.append(("body over the size limit", status, _error_body(raw)))

    def disconnect() -> None:
        for _ in range(cfg.disconnects):
            body = json.dumps({"model": model, "prompt": "leave early", "max_tokens": 64, "stream": True,
                               "ignore_eos": True}).encode()
            with socket.create_connection((h.host, h.port), timeout=60) as s:
                s.sendall(f"POST {COMP} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                s.recv(256)                                  # the first bytes of the answer, then leave
            with lock:
                res.sent[COMP] += 1
                res.disconnects += 1

    _run([threading.Thread(target=good, args=(c,)) for c in range(cfg.clients)]
         + [threading.Thread(target=bad), threading.Thread(target=disconnect)])

    # large bad bodies while /health is polled
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status, _, _ = h.request("GET", "/health")
                ok = status == 200
            except OSError:
                ok = False
            with lock:
                res.health_ms.append((time.perf_counter() - t0) * 1e3)
                res.health_failures += not ok
            time.sleep(0.02)

    big_body = json.dumps({"model": model, "prompt": "cache " * int(cfg.big_mb * (1 << 20) / 6)}).encode()

    def big() -> None:              # one shared body: the client's own GIL must not skew the /health times
        status, _, _ = h.request("POST", COMP, big_body)
        with lock:
            res.sent[COMP] += 1
            res.big.append(status)

    poller = threading.Thread(target=poll)
    poller.start()
    _run([threading.Thread(target=big) for _ in range(cfg.big_bodies)])
    stop.set()
    poller.join()

    # overload: a simultaneous burst; the queue is small, so some must wait their turn as 429s
    barrier = threading.Barrier(cfg.overload)

    def burst() -> None:
        barrier.wait()
        status, headers, _ = h.post(COMP, {"model": model, "prompt": "burst", "max_tokens": 32, "ignore_eos": True})
        with lock:
            res.sent[COMP] += 1
            res.overload[status] += 1
            if status == 429 and not headers.get("retry-after", headers.get("Retry-After", "")).isdigit():
                res.retry_after_missing += 1

    _run([threading.Thread(target=burst) for _ in range(cfg.overload)])
    if terminate is not None:
        drain(url, model, cfg, res, terminate)
    return res


def drain(url: str, model: str, cfg: Storm, res: Result, terminate) -> None:
    """Open streams (one running, the rest queued), then SIGTERM once one is in flight: each
    must still get a well-formed end (a finish_reason, or a 503 if it never started)."""
    h, lock, first = _Http(url), threading.Lock(), threading.Event()

    def stream() -> None:
        c = http.client.HTTPConnection(h.host, h.port, timeout=120)
        body = json.dumps({"model": model, "prompt": "drain me", "max_tokens": 40, "stream": True,
                           "ignore_eos": True})
        c.request("POST", COMP, body=body, headers={"Content-Type": "application/json"})
        with lock:
            res.sent[COMP] += 1
        r = c.getresponse()
        if r.status != 200:
            r.read()
            outcome = f"status {r.status}"
        else:
            r.readline()
            first.set()
            outcome = None
            for line in r.read().decode().splitlines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"]
                    if ch and ch[0].get("finish_reason"):
                        outcome = ch[0]["finish_reason"]
        c.close()
        with lock:
            res.term_streams.append(outcome)

    ts = [threading.Thread(target=stream) for _ in range(cfg.in_flight_at_term)]
    for t in ts:
        t.start()
    first.wait(120)
    terminate()
    for t in ts:
        t.join()
