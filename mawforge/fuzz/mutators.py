"""Mutators, one registry per input kind. A mutator edits the copy of a seed in a case
directory in place, drawing every choice from the case's seeded random.Random, and returns
a short description (recorded with the outcome, so any case can be replayed by its number).

    gguf  case/model.gguf          hf  case/model/ (config.json, *.safetensors[, index])
    pack  case/pack/ (manifest.json, experts.index, common.bin, experts.pack, tokenizer files)
"""
from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path
from typing import Callable

from gguf import GGUFValueType as VT

from mawforge.fuzz import gguf_codec as gc

Mutator = Callable[[Path, random.Random], str]
MUTATORS: dict[str, dict[str, Mutator]] = {"gguf": {}, "hf": {}, "pack": {}}


def mutator(*kinds: str):
    def reg(fn: Mutator) -> Mutator:
        for k in kinds:
            MUTATORS[k][fn.__name__.lstrip("_")] = fn
        return fn
    return reg


def _deep(n: int, leaf=0):
    v = leaf
    for _ in range(n):
        v = [v]
    return v


def nasty(rng: random.Random):
    """A value of a wrong type or an absurd size for wherever it lands."""
    return rng.choice([
        None, True, False, -1, 0, 1, 2**31, 2**33, 2**40, 2**62, 2**63, 2**64 + 5, -(2**63), 1.5, -0.0,
        float("nan"), float("inf"), float("-inf"), 1e308, "", "x", "12", "../x/model.safetensors",
        "/etc/passwd", "\udcff", [], [1, 2], [[1], [2]], {}, {"a": 1}, _deep(rng.choice([50, 5000])),
        list(range(rng.choice([3, 1000]))),
    ])


# ---- JSON -------------------------------------------------------------------------------

def _paths(obj, limit: int = 4000) -> list[tuple]:
    """Paths to nodes of a JSON value (breadth-first, at most `limit`)."""
    out, todo = [()], [((), obj)]
    while todo and len(out) < limit:
        path, o = todo.pop(0)
        items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
        for k, v in items:
            out.append(path + (k,))
            todo.append((path + (k,), v))
    return out


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def mutate_json(obj, rng: random.Random, prefer: Callable[[tuple], bool] | None = None):
    """(new value, description): one structural edit somewhere in obj."""
    paths = _paths(obj)
    if prefer is not None and rng.random() < 0.6:
        paths = [p for p in paths if prefer(p)] or paths
    path = rng.choice(paths)
    op = rng.choice(["replace", "replace", "delete", "swap_type", "inflate", "nest", "top"])
    if op == "top" or not path:
        return nasty(rng), "top-level replaced"
    parent, key = _get(obj, path[:-1]), path[-1]
    cur = parent[key]
    if op == "delete":
        del parent[key]
    elif op == "swap_type":
        parent[key] = str(cur) if not isinstance(cur, str) else ([cur] if rng.random() < 0.5 else 7)
    elif op == "inflate" and isinstance(cur, (int, float)) and not isinstance(cur, bool):
        parent[key] = rng.choice([cur * 2**rng.randint(8, 62), -cur - 1, cur + 1, cur - 1, 2**63, 2**64, -(2**62)])
    elif op == "nest":
        parent[key] = _deep(rng.choice([3, 100, 100000]), cur)
    else:
        parent[key] = nasty(rng)
    return obj, f"{op} at {'/'.join(map(str, path))[:120]}"


def _dumps(obj) -> bytes:
    try:
        return json.dumps(obj).encode("utf-8", "surrogatepass")
    except (RecursionError, ValueError):
        return b"[" * 200000


def _edit_json_file(path: Path, rng: random.Random, prefer=None) -> str:
    obj = json.loads(path.read_text())
    obj, desc = mutate_json(obj, rng, prefer)
    path.write_bytes(_dumps(obj))
    return f"{path.name}: {desc}"


# ---- generic file damage ----------------------------------------------------------------

def _pick_file(root: Path, rng: random.Random) -> Path:
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return rng.choice(files)


@mutator("gguf", "hf", "pack")
def _flip_bytes(root: Path, rng: random.Random) -> str:
    f = _pick_file(root, rng)
    b = bytearray(f.read_bytes())
    n = rng.choice([1, 1, 4, 64])
    for _ in range(n):
        if b:
            b[rng.randrange(len(b))] ^= rng.randrange(1, 256)
    f.write_bytes(b)
    return f"{f.name}: {n} random bytes flipped"


@mutator("gguf", "hf", "pack")
def _truncate(root: Path, rng: random.Random) -> str:
    f = _pick_file(root, rng)
    size = f.stat().st_size
    keep = rng.choice([0, 1, 7, 8, 24, rng.randrange(size + 1), max(0, size - 1)]) if size else 0
    with open(f, "r+b") as fh:
        fh.truncate(min(keep, size))
    return f"{f.name}: truncated to {min(keep, size)} of {size}"


@mutator("gguf", "hf", "pack")
def _insert_bytes(root: Path, rng: random.Random) -> str:
    f = _pick_file(root, rng)
    b = f.read_bytes()
    at = rng.randrange(len(b) + 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 3, 17])))
    f.write_bytes(b[:at] + junk + b[at:])
    return f"{f.name}: {len(junk)} bytes inserted at {at}"


@mutator("gguf", "hf", "pack")
def _inflate_u64(root: Path, rng: random.Random) -> str:
    """Overwrite an 8-byte field near the start (counts, lengths, offsets) with a huge value."""
    f = _pick_file(root, rng)
    b = bytearray(f.read_bytes())
    if len(b) < 8:
        return f"{f.name}: too short to inflate"
    at = rng.randrange(0, min(len(b) - 8, 4096) + 1)
    b[at:at + 8] = struct.pack("<Q", rng.choice([2**33, 2**40, 2**62, 2**63 + 1, 2**64 - 1, 0]))
    f.write_bytes(b)
    return f"{f.name}: u64 at {at} inflated"


@mutator("hf", "pack")
def _file_to_dir(root: Path, rng: random.Random) -> str:
    f = _pick_file(root, rng)
    f.unlink()
    f.mkdir()
    return f"{f.name} replaced by a directory"


@mutator("hf", "pack")
def _delete_file(root: Path, rng: random.Random) -> str:
    f = _pick_file(root, rng)
    f.unlink()
    return f"{f.name} deleted"


@mutator("hf", "pack")
def _bad_utf8(root: Path, rng: random.Random) -> str:
    js = [p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".index")]
    if not js:
        return "no JSON file"
    f = rng.choice(js)
    b = f.read_bytes()
    at = rng.randrange(len(b) + 1)
    f.write_bytes(b[:at] + b"\xff\xfe\xc3" + b[at:])
    return f"{f.name}: invalid UTF-8 at {at}"


# ---- GGUF structure ---------------------------------------------------------------------

_GGUF_VALUES = [
    (VT.STRING, "abc"), (VT.STRING, "12"), (VT.FLOAT32, float("nan")), (VT.FLOAT32, float("inf")),
    (VT.FLOAT64, -1e308), (VT.INT64, -1), (VT.UINT64, 2**63), (VT.UINT64, 2**40), (VT.INT32, 0),
    (VT.BOOL, True), (VT.ARRAY, (VT.UINT32, [])), (VT.ARRAY, (VT.INT32, [1, 2])),
    (VT.ARRAY, (VT.STRING, ["a", "b"])), (VT.FLOAT32, 0.5), (VT.UINT32, 2**32 - 1),
]


def _gguf_edit(root: Path, rng: random.Random, edit) -> str:
    m = gc.parse(root.read_bytes())
    desc, counts = edit(m, rng)
    root.write_bytes(gc.dump(m, **counts))
    return desc


@mutator("gguf")
def _gguf_value_type(root: Path, rng: random.Random) -> str:
    def edit(m, rng):
        arch = next((v for k, _, v in m.kv if k == "general.architecture"), "")
        keys = [kv for kv in m.kv if kv[0].startswith(arch + ".") or kv[0].startswith("general.")] or m.kv
        kv = rng.choice(keys)
        if rng.random() < 0.15:
            vt, v = VT.ARRAY, (VT.ARRAY, [(VT.ARRAY, [(VT.UINT8, [1])])] * 2)     # nested arrays
        else:
            vt, v = rng.choice(_GGUF_VALUES)
        kv[1], kv[2] = int(vt), v
        return f"{kv[0]} := {VT(vt).name} {str(v)[:40]}", {}
    return _gguf_edit(root, rng, edit)


@mutator("gguf")
def _gguf_delete_key(root: Path, rng: random.Random) -> str:
    def edit(m, rng):
        kv = rng.choice(m.kv)
        m.kv.remove(kv)
        return f"key {kv[0]} deleted", {}
    return _gguf_edit(root, rng, edit)


@mutator("gguf")
def _gguf_tensor(root: Path, rng: random.Random) -> str:
    def edit(m, rng):
        t = rng.choice(m.tensors)
        op = rng.choice(["zero_dim", "one_d", "swap_dims", "qtype", "overlap", "misalign", "far", "dup", "drop",
                         "drop_needed", "rename", "five_d"])
        if op == "zero_dim":
            t.ne[rng.randrange(len(t.ne))] = 0
        elif op == "one_d":
            t.ne = [t.ne[0]]
        elif op == "swap_dims" and len(t.ne) > 1:
            t.ne = list(reversed(t.ne)) if t.ne[0] != t.ne[-1] else [t.ne[0] * 2] + t.ne[1:]
        elif op == "qtype":
            t.qtype = rng.choice([0, 1, 2, 8, 12, 14, 30, 39, 99, 2**31])
        elif op == "overlap":
            t.offset = rng.choice(m.tensors).offset + rng.choice([0, 32])
        elif op == "misalign":
            t.offset += rng.choice([1, 4, 16])
        elif op == "far":
            t.offset = rng.choice([2**40, 2**63, len(m.data) - 32])
        elif op == "dup":
            m.tensors.append(gc.Tensor(t.name, list(t.ne), t.qtype, t.offset))
        elif op in ("drop", "drop_needed"):
            needed = [x for x in m.tensors if any(s in x.name for s in ("gate_inp", "attn_q.", "attn_norm",
                                                                         "ffn_norm", "output_norm", "attn_k_norm"))]
            t = rng.choice(needed or m.tensors) if op == "drop_needed" else t
            m.tensors.remove(t)
        elif op == "rename":
            t.name = rng.choice(["blk.0.ffn_gate_exps.weight", "blk.99.attn_q.weight", "blk.0.ffn_up.7.weight",
                                 "x" * 300, "blk.-1.ffn_down_exps.weight"])
        elif op == "five_d":
            t.ne = t.ne + [1] * (5 - len(t.ne))
        return f"tensor {t.name[:60]}: {op}", {}
    return _gguf_edit(root, rng, edit)


@mutator("gguf")
def _gguf_counts(root: Path, rng: random.Random) -> str:
    def edit(m, rng):
        field = rng.choice(["n_tensors", "n_kv"])
        real = len(m.tensors) if field == "n_tensors" else len(m.kv)
        v = rng.choice([real + 1, real - 1, 2**20, 2**40, 2**64 - 1, 0])
        return f"{field} claims {v} (has {real})", {field: max(v, 0)}
    return _gguf_edit(root, rng, edit)


# ---- safetensors / config.json / index.json -----------------------------------------------

def _shard(root: Path, rng: random.Random) -> Path:
    return rng.choice(sorted(root.glob("*.safetensors")))


@mutator("hf")
def _st_header(root: Path, rng: random.Random) -> str:
    f = _shard(root, rng)
    b = f.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    head, data = json.loads(b[8:8 + n]), b[8 + n:]
    names = [k for k in head if k != "__metadata__"]
    name = rng.choice(names)
    e = head[name]
    op = rng.choice(["json", "json", "shape_empty", "dtype_list", "offset_str", "offset_frac", "negative",
                     "overlap", "into_header", "past_end", "drop_needed", "zero_dim"])
    if op == "json":
        head, d = mutate_json(head, rng, prefer=lambda p: len(p) >= 2)
        op = d
    elif op == "shape_empty":
        e["shape"] = []
    elif op == "dtype_list":
        e["dtype"] = rng.choice([["F32"], 32, "Q4_K", None])
    elif op == "offset_str":
        e["data_offsets"] = [str(e["data_offsets"][0]), e["data_offsets"][1]]
    elif op == "offset_frac":
        e["data_offsets"] = [e["data_offsets"][0] + 0.5, e["data_offsets"][1] + 0.5]
    elif op == "negative":
        a, z = e["data_offsets"]
        e["data_offsets"] = [a - z - 64, a - 64]
    elif op == "overlap":
        other = head[rng.choice(names)]
        a, z = other["data_offsets"]
        e["data_offsets"] = [a, a + e["data_offsets"][1] - e["data_offsets"][0]]
    elif op == "into_header":
        a, z = e["data_offsets"]
        e["data_offsets"] = [0, z - a]
        head[name] = e
    elif op == "past_end":
        e["data_offsets"] = [len(data) - 4, len(data) - 4 + e["data_offsets"][1] - e["data_offsets"][0]]
    elif op == "drop_needed":
        needed = [k for k in names if any(s in k for s in ("mlp.gate.", "q_proj", "layernorm", "norm.weight"))]
        name = rng.choice(needed or names)
        del head[name]
    elif op == "zero_dim":
        e["shape"] = [0] + list(e.get("shape", [])[1:])
    raw = _dumps(head)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return f"{f.name} header: {op} ({name[:60]})"


@mutator("hf")
def _config_json(root: Path, rng: random.Random) -> str:
    return _edit_json_file(root / "config.json", rng, prefer=lambda p: len(p) == 1)


@mutator("hf")
def _index_json(root: Path, rng: random.Random) -> str:
    idx = root / "model.safetensors.index.json"
    if not idx.exists():
        names = []
        for f in sorted(root.glob("*.safetensors")):
            n = struct.unpack("<Q", f.read_bytes()[:8])[0]
            names += [(k, f.name) for k in json.loads(f.read_bytes()[8:8 + n]) if k != "__metadata__"]
        idx.write_text(json.dumps({"metadata": {}, "weight_map": dict(names)}))
    op = rng.choice(["json", "escape", "absolute", "missing", "json"])
    if op == "json":
        return _edit_json_file(idx, rng, prefer=lambda p: len(p) == 2 and p[0] == "weight_map")
    d = json.loads(idx.read_text())
    key = rng.choice(sorted(d["weight_map"]))
    d["weight_map"][key] = {"escape": "../" + root.name + "/model.safetensors", "absolute": "/etc/hostname",
                            "missing": "model-00009-of-00009.safetensors"}[op]
    idx.write_text(json.dumps(d))
    return f"index.json: {op} shard for {key}"


# ---- pack JSON --------------------------------------------------------------------------

@mutator("pack")
def _manifest_json(root: Path, rng: random.Random) -> str:
    return _edit_json_file(root / "manifest.json", rng)


@mutator("pack")
def _index_fields(root: Path, rng: random.Random) -> str:
    def numeric(p):
        return p and p[-1] in ("offset", "nbytes", "block_nbytes", "alignment") or (len(p) >= 2 and p[-2] == "blocks")
    return _edit_json_file(root / "experts.index", rng, prefer=numeric)


@mutator("pack")
def _index_json(root: Path, rng: random.Random) -> str:
    return _edit_json_file(root / "experts.index", rng)


def copy_seed(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
