"""`mawforge bench`: `quick MODEL` (your model on this machine at three memory limits, llama.cpp
beside it: bench/quick.py) or `matrix MATRIX.yaml` (the guarded validation matrix: bench/matrix.py;
`mawforge bench MATRIX.yaml` is the same)."""
from __future__ import annotations

import argparse

from mawforge.bench import matrix, quick

help = "benchmarks: `quick MODEL` (your model, three memory limits, llama.cpp beside it) or a matrix"
SUBCOMMANDS = ("quick", "matrix")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="{quick,matrix}")
    q = sub.add_parser("quick", help=quick.help, description=quick.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    quick.add_arguments(q)
    matrix.add_arguments(sub.add_parser("matrix", help=matrix.help))


def main(a: argparse.Namespace) -> int:
    return (quick.main if a.bench_command == "quick" else matrix.main)(a)


def normalize(argv: list[str]) -> list[str]:
    """`bench MATRIX.yaml ...` as `bench matrix MATRIX.yaml ...` (the form before the subcommands)."""
    i = argv.index("bench")
    nxt = next((x for x in argv[i + 1:] if not x.startswith("-")), None)
    if nxt is not None and nxt not in SUBCOMMANDS:
        return argv[:i + 1] + ["matrix"] + argv[i + 1:]
    return argv
