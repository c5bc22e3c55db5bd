"""`mawforge` command: a dispatcher. Each command's arguments and main live with its module."""
from __future__ import annotations

import argparse
import importlib
import sys

from mawforge.errors import MawError

# name -> "module:attr"; attr is a class or module with help, add_arguments(p) and main(args).
COMMANDS = {
    "pack": "mawforge.pack.commands:Pack",
    "inspect": "mawforge.pack.commands:Inspect",
    "verify": "mawforge.pack.commands:Verify",
    "synth": "mawforge.fixtures.synth:",
    "plan": "mawforge.plan:",
    "run": "mawforge.engine.run:",
    "serve": "mawforge.serve.app:",
    "replay": "mawforge.trace.replay:",
    "synth-trace": "mawforge.trace.synthetic:",
    "bench": "mawforge.bench.matrix:",
    "tune": "mawforge.bench.tune:",
}


def _load(spec: str):
    mod, _, attr = spec.partition(":")
    m = importlib.import_module(mod)
    return getattr(m, attr) if attr else m


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mawforge", description="Run MoE models larger than memory.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, spec in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help="(see mawforge NAME --help)")
            continue
        try:
            cmd = _load(spec)
        except ModuleNotFoundError:
            continue   # a command whose module is not built yet is simply absent
        p = sub.add_parser(name, help=getattr(cmd, "help", None) or (cmd.__doc__ or "").split("\n")[0])
        cmd.add_arguments(p)
        p.set_defaults(_main=cmd.main)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(first if first in COMMANDS else None).parse_args(argv)
    try:
        return int(args._main(args) or 0)
    except MawError as e:
        print(f"mawforge {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"mawforge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
