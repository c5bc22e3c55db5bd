"""What is in a pack or a source model, with byte totals: a table for people, JSON for scripts."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from mawforge.codecs.native_types import fallback_tensors, source_codec
from mawforge.formats.source import open_source
from mawforge.pack.manifest import MANIFEST, read_index, read_manifest


def describe(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir() and (p / MANIFEST).exists():
        return _describe_pack(p)
    return _describe_source(p)


def _config_fields(cfg) -> dict:
    return {"architecture": cfg.arch, "layers": cfg.n_layers, "experts": cfg.n_experts,
            "top_k": cfg.top_k, "hidden": cfg.hidden, "expert_ff": cfg.expert_ff,
            "shared_ff": cfg.shared_ff, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "vocab": cfg.vocab}


def _describe_pack(p: Path) -> dict:
    man, index = read_manifest(p), read_index(p)
    qtypes = Counter()
    for lb in index.layers:
        for t in lb.tensors:
            qtypes[f"{t.qtype}->{t.codec}"] += len(lb.offsets)
    for t in man.common:
        qtypes[f"{t.qtype}->{t.codec}"] += 1
    entries = [(t.name, t.qtype, t.codec, len(t.shape)) for t in man.common]
    entries += [(f"blk.{lb.layer}.{t.name} (experts)", t.qtype, t.codec, len(t.shape))
                for lb in index.layers for t in lb.tensors]
    return {"kind": "pack", "path": str(p), **_config_fields(man.config),
            "pack_digest": man.pack_digest, "source": man.source, "layout": man.layout,
            "alignment": man.alignment, "bytes": man.byte_totals,
            "common_bytes": man.byte_totals["common"], "expert_bytes": man.byte_totals["experts"],
            "block_bytes_by_layer": index.block_bytes(), "quant_types": dict(qtypes),
            "transforms": list(man.transforms), "tokenizer": man.tokenizer,
            "fallback_tensors": fallback_tensors(entries),
            "in_place_files": [f.name for f in index.files]}


def _describe_source(p: Path) -> dict:
    src = open_source(p)
    qtypes = Counter()
    for t in src.common.values():
        qtypes[t.qtype.name] += 1
    for t in src.experts.values():
        qtypes[t.qtype.name] += len(t.pieces)
    per_layer = [sum(src.experts[(l, k)].expert_nbytes for k in src.expert_kinds(l))
                 for l in range(src.config.n_layers)]
    expert_bytes = sum(b * src.config.n_experts for b in per_layer)
    common = sum(t.nbytes for t in src.common.values())
    entries = [(t.name, t.qtype.name, source_codec(t.qtype.name), len(t.shape)) for t in src.common.values()]
    entries += [(f"blk.{t.layer}.{t.kind} (experts)", t.qtype.name, source_codec(t.qtype.name), 2)
                for t in src.experts.values()]
    return {"kind": src.kind, "path": str(p), **_config_fields(src.config),
            "source": src.identity(), "common_bytes": common, "expert_bytes": expert_bytes,
            "block_bytes_by_layer": per_layer, "quant_types": dict(qtypes),
            "fallback_tensors": fallback_tensors(entries)}


def gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def table(d: dict) -> str:
    rows = [("path", d["path"]), ("kind", d["kind"]), ("architecture", d["architecture"]),
            ("layers", d["layers"]), ("experts / top-k", f"{d['experts']} / {d['top_k']}"),
            ("hidden / expert ff", f"{d['hidden']} / {d['expert_ff']}"),
            ("heads / kv heads / head dim", f"{d['heads']} / {d['kv_heads']} / {d['head_dim']}"),
            ("vocab", d["vocab"]), ("common (resident) bytes", f"{d['common_bytes']:,} ({gib(d['common_bytes'])})"),
            ("routed expert bytes", f"{d['expert_bytes']:,} ({gib(d['expert_bytes'])})")]
    if d["kind"] == "pack":
        rows += [("pack digest", d["pack_digest"]), ("layout", d["layout"]),
                 ("alignment", d["alignment"]), ("source digest", d["source"].get("digest"))]
        if d.get("in_place_files"):
            rows.append(("experts read in place from", ", ".join(d["in_place_files"])))
    sizes = Counter(d["block_bytes_by_layer"])
    rows.append(("block bytes by layer",
                 ", ".join(f"{b:,} x{n}" for b, n in sorted(sizes.items()))))
    rows += [(f"  {q}", n) for q, n in sorted(d["quant_types"].items())]
    rows.append(("dequantizing fallback", fallback_line(d["fallback_tensors"])))
    w = max(len(str(k)) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def fallback_line(names: list[str]) -> str:
    """one line naming the matrices no native kernel computes (each use dequantizes them to float)"""
    if not names:
        return "none (every matrix runs on the native kernels where they build)"
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"{len(names)} matrices have no native kernel and are dequantized to float at each use: {shown}"
