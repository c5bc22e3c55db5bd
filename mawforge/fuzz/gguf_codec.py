"""A GGUF file as an editable value, written back byte for byte: the structure-aware GGUF
mutators change types, shapes, offsets and counts that a writer library would refuse to emit.

    m = parse(path.read_bytes()); m.kv[...]; m.tensors[...]; path.write_bytes(dump(m))
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from gguf import GGUF_MAGIC, GGUFValueType as VT

SCALAR = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
          VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}


@dataclass
class Tensor:
    name: str
    ne: list[int]            # GGUF order: innermost first
    qtype: int
    offset: int              # relative to the data section


@dataclass
class GGUFModel:
    version: int
    kv: list[list]                      # [key, vtype, value]; arrays: value = (etype, [items])
    tensors: list[Tensor]
    data: bytes                         # the data section, from its aligned start
    align: int = 32
    extra: dict = field(default_factory=dict)

    def key(self, name: str) -> list | None:
        return next((kv for kv in self.kv if kv[0] == name), None)


class _In:
    def __init__(self, b: bytes):
        self.b, self.pos = b, 0

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.b, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("Q")
        s = self.b[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vt: int):
        if vt == VT.STRING:
            return self.string()
        if vt == VT.ARRAY:
            et, n = self.take("I"), self.take("Q")
            return (et, [self.value(et) for _ in range(n)])
        return self.take(SCALAR[VT(vt)])


def parse(b: bytes) -> GGUFModel:
    """A well-formed GGUF (a seed) into a GGUFModel."""
    r = _In(b)
    if r.take("I") != GGUF_MAGIC:
        raise ValueError("not a GGUF seed")
    version, n_t, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    kv = []
    for _ in range(n_kv):
        k = r.string()
        vt = r.take("I")
        kv.append([k, vt, r.value(vt)])
    tensors = []
    for _ in range(n_t):
        name, nd = r.string(), r.take("I")
        ne = [r.take("Q") for _ in range(nd)]
        tensors.append(Tensor(name, ne, r.take("I"), r.take("Q")))
    align = next((v for k, _, v in kv if k == "general.alignment"), 32)
    start = -(-r.pos // align) * align
    return GGUFModel(version, kv, tensors, b[start:], align)


def _value(vt: int, v) -> bytes:
    if vt == VT.STRING:
        raw = v.encode("utf-8", "surrogatepass") if isinstance(v, str) else bytes(v)
        return struct.pack("<Q", len(raw)) + raw
    if vt == VT.ARRAY:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(_value(et, x) for x in items)
    return struct.pack("<" + SCALAR[VT(vt)], v)


def dump(m: GGUFModel, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    """Bytes of m; counts may be overridden to lie about the tables that follow."""
    out = [struct.pack("<IIQQ", GGUF_MAGIC, m.version, len(m.tensors) if n_tensors is None else n_tensors,
                       len(m.kv) if n_kv is None else n_kv)]
    for k, vt, v in m.kv:
        out.append(_value(VT.STRING, k) + struct.pack("<I", vt) + _value(vt, v))
    for t in m.tensors:
        out.append(_value(VT.STRING, t.name) + struct.pack("<I", len(t.ne))
                   + b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.ne)
                   + struct.pack("<IQ", t.qtype, t.offset & (2**64 - 1)))
    head = b"".join(out)
    align = m.align if isinstance(m.align, int) and m.align > 0 else 32
    return head + b"\0" * (-len(head) % align) + m.data
