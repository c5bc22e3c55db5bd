"""Which replica a request goes to: the one that holds its conversation's prompt cache.

A request becomes a list of segments whose leading ones a later turn of the same conversation
repeats: a chat's messages, a Responses request's instructions and input items, a completion
prompt's 64-character (or 16-token) blocks. The conversation's key is the prefix up to and
including the first user message (for a completion, the first block), so conversations that
only share a system prompt still spread over the replicas. A new key goes to the replica that
rendezvous hashing picks among those up (stable as replicas come and go: only the keys of a
replica that is down move, and each moves to the next replica in its own order). Every routed
prefix is remembered (bounded, least recently used first out): a later request whose longest
remembered prefix (at least the key) names a replica that is up goes there, so a conversation
that failed over stays where its prompt cache now is, and a completion prompt that grew past
its first block finds the replica of its earlier turns. A `previous_response_id` goes to the
replica that made that response."""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Iterable

BLOCK_CHARS, BLOCK_TOKENS = 64, 16
REMEMBER = 16384            # remembered prefixes (and response ids), least recently used first out


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def segments(endpoint: str, body: dict) -> tuple[list[str], int]:
    """(segments, key length): the request's conversation as segments, and how many of them
    make its key. Malformed bodies give no segments (the replica answers the 400)."""
    def dump(x) -> str:
        return json.dumps(x, sort_keys=True, separators=(",", ":"), default=str)

    def until_user(items: list) -> int:
        for i, m in enumerate(items):
            if isinstance(m, dict) and m.get("role") == "user":
                return i + 1
        return len(items)

    if endpoint == "chat":
        msgs = body.get("messages")
        msgs = msgs if isinstance(msgs, list) else []
        return [dump(m) for m in msgs], until_user(msgs)
    if endpoint == "responses":
        items = body.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else \
            items if isinstance(items, list) else []
        head = [dump(body["instructions"])] if isinstance(body.get("instructions"), str) else []
        return head + [dump(i) for i in items], len(head) + until_user(items)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                     # a list of prompts: routed by the first
    if isinstance(prompt, str):
        segs = [prompt[i:i + BLOCK_CHARS] for i in range(0, len(prompt), BLOCK_CHARS)]
    elif isinstance(prompt, list):
        segs = [dump(prompt[i:i + BLOCK_TOKENS]) for i in range(0, len(prompt), BLOCK_TOKENS)]
    else:
        segs = []
    return segs, min(1, len(segs))


def prefix_digests(segs: Iterable[str]) -> list[bytes]:
    """The digest of every prefix: digests[i] covers segments[0..i]."""
    out, h = [], b""
    for s in segs:
        h = _digest(h + s.encode())
        out.append(h)
    return out


def rendezvous(key: bytes, names: Iterable[str]) -> list[str]:
    """The replicas in this key's order of preference (highest random weight first)."""
    return sorted(names, key=lambda n: _digest(key + n.encode()), reverse=True)


class Affinity:
    """Picks a replica per request and remembers where each conversation went."""

    def __init__(self, names: list[str], remember: int = REMEMBER):
        self.names, self.remember = list(names), remember
        self.prefixes: OrderedDict[bytes, str] = OrderedDict()
        self.responses: OrderedDict[str, str] = OrderedDict()

    def _keep(self, table: OrderedDict, key, name: str) -> None:
        table[key] = name
        table.move_to_end(key)
        while len(table) > self.remember:
            table.popitem(last=False)

    def order(self, endpoint: str, body: dict, up: set[str]) -> tuple[list[str], list[bytes]]:
        """(replicas to try, best first, only those up; the prefixes to remember for the one used)."""
        prev = body.get("previous_response_id") if endpoint == "responses" else None
        segs, k = segments(endpoint, body)
        digests = prefix_digests(segs)
        first: list[str] = []
        if isinstance(prev, str) and self.responses.get(prev) in up:
            first.append(self.responses[prev])
        for d in reversed(digests[max(k, 1) - 1:]):            # the longest remembered prefix, at least the key
            name = self.prefixes.get(d)
            if name in up:
                first.append(name)
                break
        key = digests[k - 1] if k else b""
        ranked = first + rendezvous(key, [n for n in self.names if n in up])
        return list(dict.fromkeys(ranked)), digests[max(k, 1) - 1:]

    def routed(self, name: str, digests: list[bytes], response_id: str | None = None) -> None:
        """Remember that these prefixes (and this response) now live on replica `name`."""
        for d in digests:
            self._keep(self.prefixes, d, name)
        if response_id:
            self._keep(self.responses, response_id, name)

    def holder(self, response_id: str) -> str | None:
        return self.responses.get(response_id)
