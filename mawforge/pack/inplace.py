"""Packing in place (`pack --in-place`): what can be read where it lies, and the index that says where."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from mawforge.errors import FormatError
from mawforge.formats.source import ExpertTensor, Source
from mawforge.pack.manifest import ExpertIndex, LayerBlocks, TensorRecord
from mawforge.pack.sources import SourceFile, SourceRange


class InPlaceRefused(FormatError):
    """A source whose experts cannot be read in place (checked before anything is written)."""


def check_in_place(et: ExpertTensor, rec: TensorRecord, byte_exact: bool) -> None:
    what = f"--in-place: layer {et.layer} {et.kind} experts"
    if not byte_exact or len(rec.parts) != 1:
        raise InPlaceRefused(f"{what} ({et.qtype.name}) are stored transcoded ({rec.codec}), not as the source's "
                             "bytes; in-place packs need --layout exact and a type the runtime reads as stored")
    if len({p for p, _, _ in et.pieces}) != 1:
        raise InPlaceRefused(f"{what} lie in several files; in-place packs need each expert tensor in one file")


def in_place_index(plan_layers, src: Source, layers: list[LayerBlocks], src_digests: dict, out: Path,
                   alignment: int) -> ExpertIndex:
    """The index of an in-place pack: the source files and, per layer and tensor, where each
    expert's bytes lie in them."""
    files = list(src.files)
    where = {f: i for i, f in enumerate(files)}
    recs = tuple(SourceFile(f.name, str(f.resolve()), os.path.relpath(f.resolve(), out.resolve()),
                            os.path.getsize(f)) for f in files)
    done = []
    for (ets, _), lb in zip(plan_layers, layers):
        ranges = tuple(SourceRange(where[et.pieces[0][0]], f"blk.{et.layer}.ffn_{et.kind}_exps.weight",
                                   tuple(off for _, off, _ in et.pieces), src_digests[(et.layer, et.kind)])
                       for et in ets)
        done.append(replace(lb, sources=ranges))
    return ExpertIndex(alignment, tuple(done), recs)
