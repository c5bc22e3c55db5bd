"""CLI commands for packs: pack, inspect, verify."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mawforge.errors import IntegrityError


class Pack:
    help = "split a GGUF file or HF directory into a pack (streaming, atomic)"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("source", help="model.gguf or a Hugging Face model directory")
        p.add_argument("-o", "--output", required=True, help="pack directory to create")
        p.add_argument("--alignment", type=int, default=65536, help="block alignment in bytes (>= 4096)")
        p.add_argument("--layout", choices=("exact", "int4pack", "fast"), default="exact",
                       help="exact (default): keep the GGUF bytes, computed by the native kernels as "
                            "llama.cpp does; int4pack (old name: fast): transcode Q4/Q8 to torch's CPU "
                            "int4pack kernels, for machines without a C compiler")
        p.add_argument("--in-place", action="store_true",
                       help="no second copy: the pack holds the common tensors, the index and the digests, and "
                            "reads expert blocks from the GGUF file(s) where they lie (keep them there)")
        p.add_argument("--force", action="store_true", help="replace an existing pack")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    @staticmethod
    def main(a: argparse.Namespace) -> int:
        from mawforge.pack.inspect import gib
        from mawforge.pack.packer import pack
        m = pack(a.source, a.output, alignment=a.alignment, layout=a.layout, force=a.force,
                 progress=not a.quiet and sys.stderr.isatty(), in_place=a.in_place)
        b = m.byte_totals
        where = f" read in place from {len(m.source['files'])} source file(s)" if a.in_place else ""
        print(f"packed {m.config.arch} into {a.output}: common {gib(b['common'])}, "
              f"experts {gib(b['experts'])} in {b['expert_blocks']} blocks{where}, digest {m.pack_digest}")
        return 0


class Inspect:
    help = "show what is in a pack or a source model"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("path", help="pack directory, model.gguf or HF directory")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    @staticmethod
    def main(a: argparse.Namespace) -> int:
        from mawforge.pack.inspect import describe, table
        d = describe(a.path)
        print(json.dumps(d, indent=1) if a.json else table(d))
        return 0


class Verify:
    help = "recompute every digest of a pack; names damaged blocks (a GGUF or its shards: checks every file)"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("pack")
        p.add_argument("--json", action="store_true")

    @staticmethod
    def main(a: argparse.Namespace) -> int:
        from mawforge.pack.manifest import MANIFEST
        from mawforge.pack.verify import verify
        if not (Path(a.pack) / MANIFEST).exists():      # a source: its files read and checked whole
            from mawforge.formats.source import open_source
            src = open_source(a.pack)
            n = len(src.common) + sum(len(t.pieces) for t in src.experts.values())
            line = (f"{src.path}: a {src.kind} source, {len(src.files)} file{'s' if len(src.files) > 1 else ''}, "
                    f"every tensor within its file ({n} tensors and experts); pack it for digests")
            print(json.dumps({"ok": True, "source": str(src.path), "files": [str(f) for f in src.files]})
                  if a.json else line)
            return 0
        rep = verify(a.pack, progress=sys.stderr.isatty() and not a.json)
        if a.json:
            print(json.dumps({"ok": rep.ok, "blocks_checked": rep.blocks_checked,
                              "damaged_blocks": rep.damaged_blocks, "damaged_common": rep.damaged_common,
                              "problems": rep.problems}))
        else:
            print("\n".join(rep.lines()))
        return 0 if rep.ok else IntegrityError.exit_code
